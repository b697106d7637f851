"""One writer per run folder: a lock object ``<run>/LOCK.json`` with a heartbeat.

Two ``ctx pretrain`` (or ``ctx finetune``) drivers on the same output would both resume from the
same checkpoint and then write interleaved checkpoints and data positions into one run. The
driver therefore takes the run's lock before it reads anything from the run, and holds it until
the run ends (also when it fails):

* **Exclusive create.** Local paths: the lock is written to a private temporary file and
  hard-linked to ``LOCK.json``; ``link`` fails with ``EEXIST`` when the name is taken, so the
  lock appears whole or not at all (an ``O_EXCL`` create would let a reader see it empty).
  S3: ``PutObject`` with ``If-None-Match: *`` (S3's conditional write; moto 5.2 implements it).
* **Heartbeat.** A daemon thread rewrites the lock every ``heartbeat_s`` with the current time,
  conditional on it still being the version this holder wrote (S3: ``If-Match`` its ETag; local:
  an atomic rename aside, compare, link back), so a holder that lost the lock finds out instead of
  overwriting its successor's.
* **Stale takeover.** A lock whose heartbeat is older than ``stale_after_s`` (its driver died
  without releasing it) may be taken over, with the same conditional replace against the version
  read: of two runs taking over at once, one wins.
* **Release** deletes the lock, conditional on it being this holder's version (and, locally, the
  folder the lock created, where nothing else was written there).

``ctx embed`` holds its output folder the same way (``jobs.serving.embed.RUN_LOCK``): two runs into
one folder would write the same rows twice.

On S3, taking the lock waits through an outage as every other call of the run does, until the
recipe's ``data.retry_deadline_s`` (the ``Store`` it is given), saying so on stderr; a heartbeat
tries once per beat, and releasing waits at most ``RELEASE_WAIT_S``, so that Ctrl-C or SIGTERM
ends a run at once (a lock left behind goes stale and the next run takes it over).

Other remote filesystems (gs://, hdfs:// ...) offer no conditional write through pyarrow: the run
goes on without a lock and says so. The clock is the machines' wall clock (``time.time``):
heartbeats are compared across hosts, so their clocks must agree to well under ``stale_after_s``.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TextIO

from pipelines import storage
from pipelines.storage import Store, as_store

LOCK_FILE = "LOCK.json"
# What two holders at once would do to a training run, and what to do about it (RunLock's ``clash``).
TRAINING_CLASH = ("Two runs on one output would resume from the same checkpoint and overwrite each other. Wait for it "
                  "to finish, stop it, or give this run another name or output_dir.")
RELEASE_WAIT_S = 10.0  # how long releasing the lock waits for the store: never the run's whole deadline


class RunLockHeld(RuntimeError):
    """Another live process holds the run's lock; the message names it and what to do."""


class _Conflict(Exception):
    """The object changed (or appeared) since it was read: a conditional write lost."""


@dataclass(frozen=True)
class LockInfo:
    owner: str  # a fresh id per holder: a restarted driver on the same host and pid is another owner
    host: str
    pid: int
    command: str  # what holds it, for the person reading the error
    started: float  # unix time the lock was taken
    heartbeat: float  # unix time of the last heartbeat

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "LockInfo | None":
        try:
            raw = json.loads(data)
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__})
        except (ValueError, KeyError, TypeError):
            return None  # not a lock we wrote: treated as held (the error says to delete it by hand)


# ---------------------------------------------------------------------------------------------
# Backends: create-if-absent, read with a version, replace-if-version, delete-if-version


class _LocalBackend:
    """A lock file on a local (or NFS-like POSIX) filesystem; the version is the file's bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.made = False  # this holder created the folder: releasing removes it again if nothing else was written

    def _link_new(self, body: bytes) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(body)
        try:
            os.link(tmp, self.path)  # atomic, and fails if the name exists: an exclusive create of whole contents
        except FileExistsError:
            raise _Conflict() from None
        finally:
            tmp.unlink(missing_ok=True)

    def create(self, body: bytes) -> bytes:
        for _ in range(2):  # a second time where another holder's release removed the folder just made
            self.made = not self.path.parent.is_dir()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._link_new(body)
                return body
            except FileNotFoundError:
                continue
        raise _Conflict()

    def read(self) -> tuple[bytes, bytes] | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        return data, data

    def _take_aside(self, version: bytes) -> Path:
        """Rename the lock to a private name (only one renamer wins) and check it is ``version``;
        a different version is put back and the caller lost."""
        aside = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.aside")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            raise _Conflict() from None
        if aside.read_bytes() != version:
            try:
                os.link(aside, self.path)  # restore what we must not have moved (unless a new lock took its place)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            raise _Conflict()
        return aside

    def replace(self, body: bytes, version: bytes) -> bytes:
        """A takeover: the lock is moved aside while it is replaced, so of two takers one wins."""
        aside = self._take_aside(version)
        try:
            self._link_new(body)
        finally:
            aside.unlink(missing_ok=True)
        return body

    def refresh(self, body: bytes, version: bytes) -> bytes:
        """The holder's heartbeat: an atomic ``os.replace``, so the name is never free for a new
        run to take. Check-then-replace is not atomic; the gap matters only against a takeover,
        which happens when this holder is already late by ``stale_after_s``."""
        if self.read() != (version, version):
            raise _Conflict()
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(body)
        os.replace(tmp, self.path)
        return body

    def delete(self, version: bytes) -> None:
        self._take_aside(version).unlink(missing_ok=True)
        if self.made:  # a run that stopped before writing anything leaves no folder behind
            try:
                self.path.parent.rmdir()
            except OSError:
                pass  # it holds what the run wrote (or another run's lock): kept


class _S3Backend:
    """A lock object on S3 (or an S3-compatible store with conditional writes); the version is its ETag.

    Taking the lock (create, read, replace) retries through an outage until the store's deadline;
    a heartbeat (refresh) tries once, release for at most ``RELEASE_WAIT_S``."""

    def __init__(self, uri: str, store: Store) -> None:
        self.uri = uri
        self.store = store
        bucket_key = uri[len("s3://"):]
        self.bucket, _, self.key = bucket_key.partition("/")
        self.client = storage.s3_client(store.endpoint_url)

    def _call(self, what: str, fn: Callable[[], dict], store: Store | None) -> dict:
        """``fn()``, a boto3 call: retried until ``store``'s deadline when one is given, else tried once."""
        if store is None:
            return storage.boto_call(fn)
        return store.retry(lambda: storage.boto_call(fn), f"{what} {self.uri}")

    @staticmethod
    def _lost(error: Exception) -> bool:
        code = getattr(error, "response", {}).get("Error", {}).get("Code", "")
        # 412: the condition failed; 409: a concurrent conditional write won; 404: it is gone
        return code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404", "412", "409")

    def _failed(self, what: str, error: Exception) -> storage.StorageError:
        """Anything else (no bucket, no permission, an outage past botocore's own retries)."""
        return storage.StorageError(f"run lock: cannot {what} {self.uri}: {error}")

    def _put(self, body: bytes, store: Store | None, **condition: str) -> str:
        from botocore.exceptions import ClientError

        def put() -> dict:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, ContentType="application/json", **condition)

        try:
            return self._call("write", put, store)["ETag"]
        except ClientError as e:
            if self._lost(e):
                raise _Conflict() from None
            raise self._failed("write", e) from e

    def create(self, body: bytes) -> str:
        return self._put(body, self.store, IfNoneMatch="*")

    def read(self) -> tuple[bytes, str] | None:
        from botocore.exceptions import ClientError

        def get() -> dict:
            got = self.client.get_object(Bucket=self.bucket, Key=self.key)
            return {"Body": got["Body"].read(), "ETag": got["ETag"]}  # the body too: a cut-off read is retried

        try:
            got = self._call("read", get, self.store)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._failed("read", e) from e
        return got["Body"], got["ETag"]

    def replace(self, body: bytes, version: str) -> str:
        return self._put(body, self.store, IfMatch=version)

    def refresh(self, body: bytes, version: str) -> str:
        """The heartbeat: the same conditional write (If-Match is atomic on S3), tried once; a failed
        beat is retried by the next one, well before the lock goes stale."""
        return self._put(body, None, IfMatch=version)

    def delete(self, version: str) -> None:
        from botocore.exceptions import ClientError

        short = Store(self.store.endpoint_url, min(self.store.deadline_s, RELEASE_WAIT_S), self.store.setting)
        try:
            self._call("delete", lambda: self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=version), short)
        except ClientError as e:
            if self._lost(e):
                raise _Conflict() from None
            raise self._failed("delete", e) from e


def _backend(lock_uri: str, store: Store):
    if lock_uri.startswith("s3://"):
        return _S3Backend(lock_uri, store)
    if not storage.is_remote(lock_uri):
        return _LocalBackend(Path(storage.filesystem(lock_uri)[1]))
    return None


# ---------------------------------------------------------------------------------------------
# The lock


class RunLock:
    """``with RunLock(run_uri, store, command="ctx pretrain"):`` holds ``<run>/LOCK.json``.

    Raises ``RunLockHeld`` at once when a live holder has it. ``store``: the run's ``Store`` (its
    endpoint and retry deadline), or an endpoint URL. ``clock`` is injectable so tests can age a
    lock without waiting. ``name``, ``folder`` and ``clash``: the lock file's name, what the
    folder is and what two writers would do to it, as the held message says them (``ctx embed``
    locks its output folder as ``_embed.lock.json``, a name Parquet readers skip).
    """

    def __init__(self, run_uri: str, store: Store | str | None = None, *, command: str = "ctx", heartbeat_s: float = 10.0,
                 stale_after_s: float = 60.0, clock: Callable[[], float] = time.time, err: TextIO | None = None,
                 name: str = LOCK_FILE, folder: str = "run folder", clash: str = TRAINING_CLASH) -> None:
        if not 0 < heartbeat_s < stale_after_s:
            raise ValueError(f"heartbeat_s ({heartbeat_s}) must be positive and below stale_after_s ({stale_after_s})")
        self.uri = storage.join(run_uri, name)
        self.folder, self.clash = folder, clash
        self.command = command
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.err = err or sys.stderr
        self.backend = _backend(self.uri, as_store(store))
        self.info: LockInfo | None = None
        self.lost = False  # set when a heartbeat found the lock taken over
        self._version = None
        self._guard = threading.Lock()  # the heartbeat thread and release() both replace the version
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- taking it

    def acquire(self) -> "RunLock":
        if self.backend is None:
            print(f"warning: no run lock for {self.uri}: this filesystem has no conditional write here; "
                  "make sure no other run writes to the same output", file=self.err)
            return self
        now = self.clock()
        info = LockInfo(uuid.uuid4().hex, socket.gethostname(), os.getpid(), self.command, now, now)
        for _ in range(3):  # a release or a takeover between our read and write: look again
            try:
                self._version = self.backend.create(info.to_bytes())
                break
            except _Conflict:
                pass
            current = self.backend.read()
            if current is None:
                continue  # released in between
            data, version = current
            holder = LockInfo.from_bytes(data)
            if holder is not None and holder.owner == info.owner:  # our create landed, its answer was lost and retried
                self._version = version
                break
            if holder is None or self.clock() - holder.heartbeat <= self.stale_after_s:
                raise RunLockHeld(self._held_message(holder))
            try:
                self._version = self.backend.replace(info.to_bytes(), version)
            except _Conflict:
                continue
            print(f"note: took over the stale run lock {self.uri} ({self._describe(holder)}, "
                  f"no heartbeat for {self.clock() - holder.heartbeat:.0f} s)", file=self.err)
            break
        else:
            raise RunLockHeld(f"could not take the run lock {self.uri}: other runs keep taking it; is another run starting?")
        self.info = info
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="ctx-run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _describe(holder: LockInfo) -> str:
        return f"{holder.command} on {holder.host}, pid {holder.pid}"

    def _held_message(self, holder: LockInfo | None) -> str:
        where = self.uri.rsplit("/", 1)[0] if "://" in self.uri else str(Path(self.uri).parent)
        if holder is None:  # never taken over: we cannot tell whether its writer lives
            return (f"the {self.folder} {where} has a lock {self.uri} that is not a ctx run lock (or is damaged). "
                    f"If no run is writing to this folder, delete that file and start again.")
        age = self.clock() - holder.heartbeat
        who = f"{self._describe(holder)} (owner {holder.owner[:8]}, heartbeat {age:.0f} s ago)"
        return (f"the {self.folder} {where} is in use by {who}. {self.clash} If its driver died, the lock becomes "
                f"stale after {self.stale_after_s:.0f} s without a heartbeat and the next run takes it over.")

    # -- holding it

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._guard:
                if self.info is None or self.lost:
                    return
                fresh = LockInfo(**{**asdict(self.info), "heartbeat": self.clock()})
                try:
                    self._version = self.backend.refresh(fresh.to_bytes(), self._version)
                    self.info = fresh
                except _Conflict:
                    self.lost = True
                    print(f"error: lost the run lock {self.uri}: another run took it over (this run's heartbeat "
                          f"was late by more than {self.stale_after_s:.0f} s); stop this run", file=self.err)
                    return
                except Exception as e:  # a storage blip: the next beat tries again, well before the lock goes stale
                    print(f"warning: run lock heartbeat for {self.uri} failed: {e}", file=self.err)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        with self._guard:
            if self.info is None or self.lost:
                self.info = None
                return
            try:
                self.backend.delete(self._version)
            except _Conflict:
                print(f"warning: the run lock {self.uri} was not this run's any more; left it in place", file=self.err)
            except (OSError, storage.StorageError) as e:  # the store is down: the lock goes stale, the next run takes it over
                print(f"warning: could not remove the run lock {self.uri} ({e}); it goes stale {self.stale_after_s:.0f} s "
                      f"after its last heartbeat and the next run then takes it over", file=self.err)
            self.info = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
