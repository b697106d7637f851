"""One way to reach files wherever they live: local paths, ``file://``, ``s3://`` and anything
pyarrow or fsspec can open (``gs://``, ``hdfs://``, ``az://`` ...).

S3-compatible endpoints (MinIO, moto, Ceph) are reached by ``endpoint_url`` or the standard
``AWS_ENDPOINT_URL`` variable, so the same code runs against AWS in production and a loopback
server in tests.

Every call that reaches a store goes through ``with_retries``: transient errors are retried until
a deadline (``data.retry_deadline_s``, or a command's ``--retry-deadline``), and a wait is never
silent. The first retry of an operation says so on stderr (what, the endpoint, the error, the time
left), then one line at most every ``NOTICE_EVERY_S`` while it keeps failing, and one when it
recovers; in Ray workers stderr is the worker's log. A command binds its endpoint and deadline
once in a ``Store`` and makes its calls through it.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import math
import os
import random
import re
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from ctxmodels.files import CONFIG, MANIFEST, WEIGHTS, first_problem, manifest_entries

T = TypeVar("T")

# A text or JSON lines shard may be compressed whole, as corpora ship: gzip (C4, Dolma), zstd (the Pile,
# SlimPajama), xz (CC-100), bzip2. The codec is the name's last ending (pipelines.sources reads them).
CORPUS_COMPRESSIONS: dict[str, str] = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".xz": "xz", ".bz2": "bzip2"}
# The endings pyarrow's Codec.detect undoes by name (open_input_stream's compression="detect", and so Store.read_bytes
# and Ray Data's readers): what fine-tuning splits and ctx embed's inputs may be compressed with.
ARROW_COMPRESSIONS: tuple[str, ...] = (".gz", ".bz2", ".lz4", ".zst")
CORPUS_SUFFIXES = tuple(base + c for base in (".txt", ".jsonl", ".json") for c in ("", *CORPUS_COMPRESSIONS)) + (".parquet",)


def corpus_suffixes(fmt: str = "auto") -> tuple[str, ...]:
    """The endings a corpus listing keeps: ``CORPUS_SUFFIXES``, and, where ``data.format`` names the format
    (not "auto"), also a file that only a compression ending names (Pushshift's Reddit dumps, ``RC_2019-04.zst``)."""
    return CORPUS_SUFFIXES if fmt == "auto" else CORPUS_SUFFIXES + tuple(CORPUS_COMPRESSIONS)


class StorageError(RuntimeError):
    """A URI that cannot be read or written; the message names it."""


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def endpoint(endpoint_url: str | None = None) -> str | None:
    """The S3 endpoint a client reaches: ``endpoint_url``, else the standard variables (None: AWS)."""
    return endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")


def shown_endpoint(url: str | None) -> str:
    """An endpoint as messages show it: without a ``user:password@`` part (a credential never goes
    into a message or a log), ``AWS`` when there is none."""
    if not url:
        return "AWS"
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    return parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")).geturl()


def filesystem(uri: str, endpoint_url: str | None = None, retry_deadline_s: float | None = None,
               attempts: int | None = None) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a URI or local path.

    ``retry_deadline_s``: for S3, have the client itself retry each request for about that long
    (``s3_retry_attempts``). Only for filesystems handed to code that does not retry on its own
    (Ray Train's controller). ``attempts``: for S3, exactly that many tries per request; our own
    calls pass 1 and retry through ``with_retries``, so that the two layers do not multiply (the
    client's default 3 tries take ~1.6 s on a refused connection, before ``with_retries`` hears of
    it) and the deadline holds to the second.
    """
    if uri.startswith("s3://"):
        url = endpoint(endpoint_url)
        kwargs = {}
        if url:
            kwargs["endpoint_override"] = url
            kwargs["scheme"] = "https" if url.startswith("https") else "http"
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            kwargs["region"] = region
        path = uri[len("s3://"):].rstrip("/")
        if attempts is None and retry_deadline_s is not None:
            attempts = s3_retry_attempts(retry_deadline_s)
        if attempts is not None:
            return RetryingS3FileSystem(attempts, **kwargs), path
        return pafs.S3FileSystem(**kwargs), path
    if uri.startswith("file://"):
        return pafs.LocalFileSystem(), uri[len("file://"):]
    if "://" in uri:
        try:
            return pafs.FileSystem.from_uri(uri)
        except (ValueError, OSError):  # pyarrow's ArrowInvalid is a ValueError
            import fsspec
            from pyarrow.fs import FSSpecHandler, PyFileSystem

            fs, path = fsspec.core.url_to_fs(uri)
            return PyFileSystem(FSSpecHandler(fs)), path
    return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())


# ----------------------------------------------------------------------------------------------
# Retries
# ----------------------------------------------------------------------------------------------

# pyarrow reports every S3 failure as a plain OSError without errno; its message carries the AWS
# error name ("AWS Error SLOW_DOWN during ...") and sometimes "(HTTP status 503)". fsspec backends
# raise their own OSError subclasses with similar wording.
_TRANSIENT_WORDS = (
    "slow_down", "slowdown", "throttl", "too many requests", "service_unavailable", "serviceunavailable",
    "internal_failure", "internalerror", "network_connection", "request_timeout", "requesttimeout",
    "timed out", "timeout", "connection reset", "connection aborted", "connection refused",
    "broken pipe", "temporarily unavailable", "try again",
)
_PERMANENT_WORDS = (
    "access_denied", "accessdenied", "forbidden", "no_such_bucket", "nosuchbucket", "nosuchkey",
    "invalid_access_key_id", "invalidaccesskeyid", "signature_does_not_match", "signaturedoesnotmatch",
    "missing_authentication_token", "incomplete_signature", "request_expired", "expired_token",
    "invalid_parameter_value", "aws error validation",
)
_PERMANENT_TYPES = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)
_TRANSIENT_ERRNOS = {
    errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE,
    errno.EAGAIN, errno.EINTR, errno.ENETDOWN, errno.ENETUNREACH, errno.EHOSTUNREACH,
}
_HTTP_STATUS = re.compile(r"(?:HTTP status(?: code)?|status code)[:= ]*(\d{3})", re.IGNORECASE)


def is_transient(error: BaseException) -> bool:
    """Whether retrying the call that raised ``error`` may succeed (a network blip, throttling, a 5xx).

    A missing file, a refused permission, a bad argument or a full local disk fail the same way
    on every attempt, so they are not transient: retrying them only delays the real message.
    """
    if not isinstance(error, OSError) or isinstance(error, _PERMANENT_TYPES):
        return False  # ValueError / TypeError (pyarrow's ArrowInvalid is a ValueError): a bad argument
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    message = str(error).lower()
    # pyarrow puts the bucket and key first ("... key 'runs/timeout-sweep/x' in bucket 'b': AWS Error
    # ..."): read only what follows, so a path cannot pass for an error name.
    message = message[message.find("aws error"):] if "aws error" in message else message
    status = _HTTP_STATUS.search(message)
    if status:
        code = int(status.group(1))
        return code >= 500 or code in (408, 429)
    if any(w in message for w in _PERMANENT_WORDS):
        return False
    if any(w in message for w in _TRANSIENT_WORDS):
        return True
    # An errno means the operating system answered (ENOSPC, EROFS, ...): those do not heal. Remote
    # filesystems raise errno-less OSErrors for anything the network did: worth another try.
    return error.errno in _TRANSIENT_ERRNOS if error.errno is not None else True


# How long training I/O keeps retrying one operation before it gives up (data.retry_deadline_s):
# long enough to ride out an endpoint restart or a short network outage, short enough that a
# store that is really gone fails the run within minutes, not hours.
DEFAULT_RETRY_DEADLINE_S = 300.0
# What a person changes to wait longer or shorter, named in every message about a wait: the recipe
# key; commands without a recipe bind their --retry-deadline flag instead (Store.setting).
DEADLINE_SETTING = "data.retry_deadline_s"
# While one operation keeps failing, a line at most this often: enough to see that it is waiting
# and why, not a line per attempt.
NOTICE_EVERY_S = 30.0

_sleep = time.sleep  # the one place retries wait; tests patch it (and _clock) to run in milliseconds
_clock = time.monotonic


def _say(line: str) -> None:
    """Where retry notices go: stderr, read at call time, so a progress display that redirects it
    (rich) prints them above its line; in a Ray worker, stderr is the worker's log. Tests patch it."""
    print(line, file=sys.stderr, flush=True)


# Endpoints that have answered a call of this process. A refused connection to one that never did
# is most likely a wrong address (a typo, a VPN that is down), not an outage, and the notice says so.
_answered: set[str] = set()


def _refused(error: BaseException) -> bool:
    """A connection refused or not made at all: nothing listens at the address."""
    if isinstance(error, ConnectionRefusedError) or getattr(error, "errno", None) == errno.ECONNREFUSED:
        return True
    message = str(error).lower()
    return any(w in message for w in ("connection refused", "could not connect", "couldn't connect", "failed to connect"))


def _wait_notice(what: str, where: str, ep: str | None, error: BaseException, left: float, deadline_s: float, setting: str) -> str:
    """The first line of a wait: what, where, why, and how long it will go on."""
    bound = f"retrying for up to {left:.0f} s more ({setting}={deadline_s:g})"
    if where and _refused(error) and (ep or "AWS") not in _answered:
        return (f"storage: {what}: connection refused by {shown_endpoint(ep)}, and nothing has been read from it yet: "
                f"is the endpoint right and the store up? (data.endpoint_url or --endpoint-url, else AWS_ENDPOINT_URL); "
                f"{bound}. Error: {error}")
    return f"storage: {what}{where} failed: {error}; {bound}"


def with_retries(
    fn: Callable[[], T], what: str, deadline_s: float = DEFAULT_RETRY_DEADLINE_S, base_delay: float = 0.2,
    max_delay: float = 10.0, endpoint_url: str | None = None, setting: str = DEADLINE_SETTING,
) -> T:
    """``fn()``, retried on transient errors (see ``is_transient``) until ``deadline_s`` seconds
    have passed since the first attempt; the one retry loop of the code base.

    Waits about ``base_delay * 2**i`` (capped at ``max_delay``) before attempt ``i + 2``, with
    jitter so that many workers throttled at once do not come back in lockstep; the last wait
    ends at the deadline. Other errors are raised at once, unchanged. ``what`` names the
    operation and its URI ("list s3://b/run"); the ``StorageError`` raised at the deadline
    repeats it with the attempts, the time spent and, for ``s3://`` URIs, the endpoint.

    A wait is visible (``_say``): a line at the first retry (the error and the time left; a refused
    connection to an endpoint that never answered says the address may be wrong), then at most one
    every ``NOTICE_EVERY_S`` while it keeps failing, and one when it succeeds. ``setting`` is what
    the messages name as the knob for the deadline.
    """
    if deadline_s < 0:
        raise ValueError(f"{what}: deadline_s must be >= 0, got {deadline_s}")
    s3 = "s3://" in what
    ep = endpoint(endpoint_url) if s3 else None
    where = f" (endpoint {shown_endpoint(ep)})" if s3 else ""
    start = _clock()
    attempt = 0
    told: float | None = None  # when the last notice was given
    while True:
        attempt += 1
        try:
            result = fn()
        except OSError as e:
            if not is_transient(e):
                raise
            now = _clock()
            left = deadline_s - (now - start)
            if left <= 0:
                raise StorageError(
                    f"{what}{where}: gave up after {attempt} attempts in {now - start:.0f} s "
                    f"({setting}={deadline_s:g}): {e}"
                ) from e
            if told is None:
                _say(_wait_notice(what, where, ep, e, left, deadline_s, setting))
                told = now
            elif now - told >= NOTICE_EVERY_S:
                _say(f"storage: still waiting on {what}{where}: {attempt} attempts in {now - start:.0f} s, "
                     f"{left:.0f} s left ({setting}={deadline_s:g}); last error: {e}")
                told = now
            delay = min(max_delay, base_delay * 2 ** min(attempt - 1, 30))
            _sleep(min(left, delay / 2 + random.uniform(0, delay / 2)))
        else:
            if s3:
                _answered.add(ep or "AWS")
            if told is not None:
                _say(f"storage: {what}{where} succeeded after {attempt} attempts in {_clock() - start:.0f} s")
            return result


class RetryingS3FileSystem(pafs.S3FileSystem):
    """pyarrow's S3 filesystem with ``AwsStandardS3RetryStrategy(max_attempts)``, and a pickle that
    keeps it: pyarrow's own ``S3FileSystem.__reduce__`` drops the retry strategy (pyarrow 25), so a
    filesystem shipped to Ray Train's controller would retry 3 times, about 1 s, whatever it was
    built with. Nothing secret is pickled: credentials come from the environment."""

    def __init__(self, max_attempts: int, **kwargs: Any):
        super().__init__(retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=max_attempts), **kwargs)
        self.max_attempts, self.kwargs = max_attempts, kwargs

    def __reduce__(self):
        return _retrying_s3, (self.max_attempts, self.kwargs)


def _retrying_s3(max_attempts: int, kwargs: dict[str, Any]) -> RetryingS3FileSystem:
    return RetryingS3FileSystem(max_attempts, **kwargs)


def s3_client(endpoint_url: str | None = None):
    """A boto3 S3 client for calls that pyarrow cannot make (conditional writes, ETags), with one try
    per request: wrap its calls in ``boto_call`` inside ``with_retries``, which does the waiting (and
    the telling). botocore's own default would retry for up to ~15 s before we hear of anything."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint(endpoint_url), config=Config(retries={"mode": "standard", "max_attempts": 1}))


def boto_call(fn: Callable[[], T]) -> T:
    """``fn()``, a boto3 call, with what is worth retrying raised as an ``OSError``, the way pyarrow
    raises it, so ``is_transient`` and ``with_retries`` treat both clients alike: no connection (a
    ``ConnectionError``), throttling and 5xx answers (an ``OSError`` with the HTTP status). Every
    other error (a missing key, a refused permission, a lost condition) is raised unchanged, but for
    missing credentials: a ``StorageError`` that says which variables to set."""
    from botocore import exceptions as bx

    try:
        return fn()
    except bx.NoCredentialsError:
        raise StorageError("no credentials for S3: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)") from None
    except (bx.ConnectionError, bx.HTTPClientError) as e:  # refused, reset, timed out: no answer at all
        raise ConnectionError(str(e)) from e
    except bx.ClientError as e:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = e.response.get("Error", {}).get("Code", "")
        if status >= 500 or status in (408, 429) or code in ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout"):
            raise OSError(f"{e} (HTTP status {status})") from e
        raise


def s3_retry_attempts(deadline_s: float) -> int:
    """``max_attempts`` for pyarrow's ``AwsStandardS3RetryStrategy`` that retries for about
    ``deadline_s``: the AWS SDK waits a random, doubling time (at most 20 s) between
    attempts, about 15 s over the first 6 attempts and 18 s per attempt after that (measured on
    a refused connection: 3 attempts 1.3 s, 6 attempts 15 s, 10 attempts 80 s)."""
    if deadline_s <= 15:
        return max(3, min(6, 2 + math.ceil(deadline_s / 4)))
    return 6 + math.ceil((deadline_s - 15) / 18)


def join(uri: str, *parts: str) -> str:
    if is_remote(uri) or uri.startswith("file://"):
        return "/".join([uri.rstrip("/"), *parts])
    return str(Path(uri).joinpath(*parts))


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def _read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def _put_file(file: Path, fs: pafs.FileSystem, dest: str, rename: bool) -> None:
    target = f"{dest}.tmp" if rename else dest
    pafs.copy_files(str(file), target, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    if rename:
        fs.move(target, dest)


def _delete_if_present(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        pass


# The manifest that ctxmodels.checkpoint.save_checkpoint writes last, and the files every checkpoint
# has: from ctxmodels.files, which imports no torch.
REQUIRED_FILES = (WEIGHTS, CONFIG)
TRAINER_STATE = "trainer_state.json"  # jobs.training.loop.TrainState, in every checkpoint of a ctx run
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's list of the run's reported checkpoints


def checkpoint_order(name: str) -> list:
    """Sort key for checkpoint folder names: digit runs compare as numbers.

    Ray Train V2 names checkpoints ``checkpoint_%Y-%m-%d_%H-%M-%S.%f`` (local time, fixed width),
    for which this is time order as long as the clock and the time zone stay put; it also orders
    Ray V1's ``checkpoint_000012`` and names with unpadded numbers (``checkpoint_step_9`` before
    ``checkpoint_step_10``). Checkpoints are ordered by step first (``Store.checkpoints_by_step``).
    """
    # re.split with a group alternates text and digit runs, so equal positions hold equal types.
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name))]


# ----------------------------------------------------------------------------------------------
# The store handle
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Store:
    """The object store as one command reaches it: the endpoint, the retry deadline and the name of
    the setting that sets it, bound once. Every call the command makes to a store goes through it,
    so none waits longer (or shorter) than the person asked, and every message names the knob.

    ``Store.of(recipe.data)`` for a recipe; ``Store(args.endpoint_url, args.retry_deadline,
    "--retry-deadline")`` for a command without one. Plain values only: it pickles into Ray tasks
    and actors. What this module does to a store is a method here (``store.read_bytes(uri)``,
    ``store.latest_complete_checkpoint(run)``); code elsewhere takes a ``store`` and calls them.
    """

    endpoint_url: str | None = None  # None: AWS_ENDPOINT_URL, else AWS itself
    deadline_s: float = DEFAULT_RETRY_DEADLINE_S  # how long one operation retries before a StorageError
    setting: str = DEADLINE_SETTING  # the knob for deadline_s, named in messages

    def __post_init__(self) -> None:
        if not self.deadline_s > 0:
            raise ValueError(f"{self.setting}: a retry deadline is a number of seconds above 0, got {self.deadline_s:g}")

    def __repr__(self) -> str:  # the endpoint as messages show it: no user:password@
        return f"Store(endpoint {shown_endpoint(endpoint(self.endpoint_url))}, {self.setting}={self.deadline_s:g})"

    @classmethod
    def of(cls, data: Any) -> "Store":
        """A recipe's store: its ``data.endpoint_url`` and ``data.retry_deadline_s``."""
        return cls(data.endpoint_url, data.retry_deadline_s)

    # -- calls -----------------------------------------------------------------------------------

    def retry(self, fn: Callable[[], T], what: str) -> T:
        """``with_retries`` with this store's deadline, endpoint and setting."""
        return with_retries(fn, what, self.deadline_s, endpoint_url=self.endpoint_url, setting=self.setting)

    def best_effort(self, fn: Callable[[], T], what: str) -> T | None:
        """``retry(fn, what)`` for telemetry (metrics, data reports, sample logs): a failure,
        transient past the deadline or permanent (a full disk, a refused permission), is a warning
        on stderr and None, never an error: losing a log line must not stop training."""
        try:
            return self.retry(fn, what)
        except (OSError, StorageError) as e:
            print(f"warning: {what} failed, training goes on without it: {e}", file=sys.stderr)
            return None

    def filesystem(self, uri: str) -> tuple[pafs.FileSystem, str]:
        """(filesystem, path) for calls made through ``retry``: one try per request (retry does the rest)."""
        return filesystem(uri, self.endpoint_url, attempts=1)

    # -- files and folders -----------------------------------------------------------------------

    def list_files(self, uris: str | list[str], suffixes: tuple[str, ...] = CORPUS_SUFFIXES) -> list[str]:
        """Expand folders/prefixes, globs and files into a sorted list of file URIs.

        Each entry of ``uris`` must match at least one file with one of ``suffixes``; otherwise the
        error names the entry, so a typo in a bucket prefix is caught before any worker starts.
        """
        out: list[str] = []
        for uri in [uris] if isinstance(uris, str) else list(uris):
            fs, path = self.filesystem(uri)
            scheme = uri.split("://", 1)[0] + "://" if is_remote(uri) else ""
            if _has_glob(path):
                root = path
                while _has_glob(root):
                    root = root.rsplit("/", 1)[0] if "/" in root else ""
                candidates = self._walk(fs, root, uri)
                matched = [p for p in candidates if fnmatch.fnmatch(p, path)]
            else:
                info = self.retry(lambda: fs.get_file_info(path), f"stat {uri}")
                if info.type == pafs.FileType.File:
                    matched = [path]
                elif info.type == pafs.FileType.Directory:
                    matched = self._walk(fs, path, uri)
                else:
                    raise StorageError(f"input {uri!r} matches no file or folder")
            files = sorted(p for p in matched if p.endswith(suffixes))
            if not files:
                raise StorageError(f"input {uri!r} matches no corpus file (expected one of {', '.join(suffixes)})")
            out.extend(scheme + p for p in files)
        return sorted(dict.fromkeys(out))

    def file_sizes(self, uris: list[str]) -> list[int]:
        """Stored bytes of each file of ``uris`` (one listing request per file, retried)."""
        sizes = []
        for uri in uris:
            fs, path = self.filesystem(uri)
            info = self.retry(lambda: fs.get_file_info(path), f"stat {uri}")
            if info.type != pafs.FileType.File:
                raise StorageError(f"{uri!r} is not a file")
            sizes.append(int(info.size))
        return sizes

    def _walk(self, fs: pafs.FileSystem, root: str, uri: str) -> list[str]:
        sel = pafs.FileSelector(root, recursive=True, allow_not_found=True)
        infos = self.retry(lambda: fs.get_file_info(sel), f"list {uri}")
        return [i.path for i in infos if i.type == pafs.FileType.File]

    def exists(self, uri: str) -> bool:
        return self.file_type(uri) != pafs.FileType.NotFound

    def file_type(self, uri: str) -> pafs.FileType:
        """What ``uri`` is: File (an object on S3), Directory (a prefix) or NotFound; one stat, with retries."""
        fs, path = self.filesystem(uri)
        return self.retry(lambda: fs.get_file_info(path), f"stat {uri}").type

    def read_bytes(self, uri: str, missing_ok: bool = False) -> bytes | None:
        """The whole file or object at ``uri``, read with retries: the one "read a URI" of the code
        base. A missing file raises ``FileNotFoundError``, or gives None with ``missing_ok``."""
        fs, path = self.filesystem(uri)
        if missing_ok and self.retry(lambda: fs.get_file_info(path), f"stat {uri}").type != pafs.FileType.File:
            return None
        return self.retry(lambda: _read_bytes(fs, path), f"read {uri}")

    def write_bytes(self, uri: str, data: bytes) -> None:
        """``data`` as the whole file or object at ``uri``: the one "write a URI" beside ``read_bytes``.
        A local file is written beside its target and moved over it (a reader never sees half of it;
        its folder is made); an object is put with retries."""
        fs, path = self.filesystem(uri)
        if isinstance(fs, pafs.LocalFileSystem):
            folder, name = path.rsplit("/", 1)
            fs.create_dir(folder, recursive=True)
            tmp = f"{folder}/.{name}.{uuid.uuid4().hex}.tmp"  # unique: two writers never share it
            with fs.open_output_stream(tmp) as out:
                out.write(data)
            fs.move(tmp, path)  # atomic replace
            return

        def put() -> None:
            with fs.open_output_stream(path) as out:
                out.write(data)

        self.retry(put, f"write {uri}")

    def download_dir(self, uri: str, local_dir: str | Path) -> Path:
        """Copy a folder (any filesystem) into ``local_dir``; returns the local folder."""
        local_dir = Path(local_dir)
        if not is_remote(uri):
            src = Path(filesystem(uri)[1])
            if not src.is_dir():
                raise StorageError(f"{uri!r} is not a folder")
            return src
        fs, path = self.filesystem(uri)
        info = self.retry(lambda: fs.get_file_info(path), f"stat {uri}")
        if info.type != pafs.FileType.Directory:
            raise StorageError(f"{uri!r} is not a folder")
        local_dir.mkdir(parents=True, exist_ok=True)
        self.retry(lambda: pafs.copy_files(path, str(local_dir), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem()),
                   f"download {uri}")
        return local_dir

    def copy_dir(self, local_dir: str | Path, uri: str) -> None:
        """Copy a local folder into a local path or a remote folder (created if needed), MANIFEST.json last.

        A destination manifest is deleted before anything else is written, and the new one is copied
        after every other file, so an interrupted copy (or overwrite) is never mistaken for a complete
        checkpoint. Each local file lands under a temporary name and is renamed into place; an object
        store publishes an object whole when its upload completes.
        """
        src = Path(local_dir)
        if not src.is_dir():
            raise StorageError(f"cannot copy {str(src)!r} to {uri!r}: not a local folder")
        fs, root = self.filesystem(uri)
        local = isinstance(fs, pafs.LocalFileSystem)
        if local and Path(root).resolve() == src.resolve():
            return  # copying onto itself would truncate every file
        files = sorted(p for p in src.rglob("*") if p.is_file())
        manifest = src / MANIFEST
        if manifest in files:
            files = [p for p in files if p != manifest] + [manifest]
            self.retry(lambda: _delete_if_present(fs, f"{root}/{MANIFEST}"), f"delete {join(uri, MANIFEST)}")
        self.retry(lambda: fs.create_dir(root, recursive=True), f"create {uri}")
        made = {root}
        for file in files:
            rel = file.relative_to(src).as_posix()
            dest = f"{root}/{rel}"
            parent = dest.rsplit("/", 1)[0]
            if parent not in made:
                self.retry(lambda: fs.create_dir(parent, recursive=True), f"create {join(uri, rel.rsplit('/', 1)[0])}")
                made.add(parent)
            self.retry(lambda: _put_file(file, fs, dest, rename=local), f"copy {file} to {join(uri, rel)}")

    # -- checkpoints in a run folder -------------------------------------------------------------

    def checkpoint_problem(self, uri: str) -> str | None:
        """What keeps the checkpoint folder at ``uri`` from being complete, or None when nothing does.

        Complete: MANIFEST.json parses and every file it lists is there with the listed size. Ray Train
        copies a checkpoint folder to storage in no particular order, so a copy cut off halfway can leave
        a manifest beside missing or short files. Costs one listing and one read of the manifest; sizes
        only (``ctxmodels.checkpoint.load_checkpoint(..., verify_hashes=True)`` checks the hashes).
        """
        fs, path = self.filesystem(uri)
        selector = pafs.FileSelector(path, recursive=True, allow_not_found=True)
        infos = self.retry(lambda: fs.get_file_info(selector), f"list {uri}")
        prefix = path.rstrip("/") + "/"
        sizes = {
            i.path[len(prefix):]: i.size for i in infos if i.type == pafs.FileType.File and i.path.startswith(prefix)
        }
        if MANIFEST not in sizes:
            return f"{MANIFEST} missing"
        try:
            text = self.retry(lambda: _read_bytes(fs, prefix + MANIFEST), f"read {join(uri, MANIFEST)}")
        except FileNotFoundError:  # deleted since the listing (an overwrite in progress)
            return f"{MANIFEST} missing"
        entries, unusable = manifest_entries(text)
        if unusable:
            return unusable
        problems = []
        for e in entries:
            size = sizes.get(e["path"])
            if size is None:
                problems.append(f"{e['path']} missing")
            elif size != e["size"]:
                problems.append(f"{e['path']}: {size} bytes, manifest says {e['size']}")
        return first_problem(problems)

    def checkpoint_step(self, uri: str) -> int | None:
        """The ``step`` in the checkpoint's trainer_state.json, or None when it has none (missing, cut
        off, not JSON, no integer step)."""
        try:
            data = json.loads(self.read_bytes(join(uri, TRAINER_STATE)))
        except (FileNotFoundError, ValueError):
            return None
        step = data.get("step") if isinstance(data, dict) else None
        return step if type(step) is int else None

    def checkpoints_by_step(self, run_uri: str) -> list[tuple[str, int | None]]:
        """The run's ``checkpoint_*`` folders as (name, step), oldest first.

        Newer means a higher step in trainer_state.json: folder names carry a local-time stamp, which
        goes backwards when the clock or the time zone does. A folder without a step (a copy cut off
        before its trainer_state.json landed) falls back to name order: it sorts as if it had the step
        of the folder its name follows, just after it; equal steps are in name order too. One read
        per folder.
        """
        fs, path = self.filesystem(run_uri)
        selector = pafs.FileSelector(path, recursive=False, allow_not_found=True)
        infos = self.retry(lambda: fs.get_file_info(selector), f"list {run_uri}")
        names = sorted((i.base_name for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")),
                       key=checkpoint_order)
        out, keys, carried = [], {}, -1
        for name in names:
            step = self.checkpoint_step(join(run_uri, name))
            carried = step if step is not None else carried
            keys[name] = (carried, checkpoint_order(name))
            out.append((name, step))
        return sorted(out, key=lambda item: keys[item[0]])

    def latest_complete_checkpoint(self, run_uri: str) -> str | None:
        """The newest ``checkpoint_*`` folder under a run that is complete (see ``checkpoint_problem``),
        newest by step (``checkpoints_by_step``).

        Newer folders that are not complete are skipped, each with a line on stderr saying why.
        """
        for name, _ in reversed(self.checkpoints_by_step(run_uri)):
            uri = join(run_uri, name)
            problem = self.checkpoint_problem(uri)
            if problem is None:
                return uri
            print(f"warning: skipping incomplete checkpoint {uri}: {problem}", file=sys.stderr)
        return None

    def remove_incomplete_checkpoints(self, run_uri: str) -> list[tuple[str, str]]:
        """Delete the run's incomplete checkpoint folders that are older than its newest complete one;
        returns (uri, problem) of each deleted folder.

        Older: before it in ``checkpoints_by_step`` (a lower step; a folder whose trainer_state.json is
        missing or cut off is placed by its name). Incomplete folders newer than it are left alone (a
        copy may still be under way), and so are folders that Ray Train's snapshot of the run lists (a
        rerun fails when one it lists is gone). Meant for rank 0 when an attempt starts, before it
        writes anything.
        """
        ordered = self.checkpoints_by_step(run_uri)
        problems: dict[str, str | None] = {}
        newest = None
        for name, _ in reversed(ordered):
            problems[name] = self.checkpoint_problem(join(run_uri, name))
            if problems[name] is None:
                newest = name
                break
        if newest is None:
            return []
        fs, path = self.filesystem(run_uri)
        snapshot = self.read_bytes(join(run_uri, RAY_SNAPSHOT), missing_ok=True) or b""
        snapshot = snapshot.decode("utf-8", "replace")
        removed = []
        for name, _ in ordered:
            if name == newest:
                break  # everything from here on is newer
            if name in snapshot:
                continue
            uri = join(run_uri, name)
            problem = problems.get(name) or self.checkpoint_problem(uri)
            if problem is None:
                continue
            self.retry(lambda: fs.delete_dir(f"{path}/{name}"), f"delete {uri}")
            removed.append((uri, problem))
        return removed


def as_store(where: "Store | str | None") -> Store:
    """A Store from what callers written before it pass: a Store as it is, an endpoint URL (or None:
    AWS_ENDPOINT_URL) with the default deadline."""
    return where if isinstance(where, Store) else Store(where)
