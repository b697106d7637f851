"""Run any ``ctx`` command as a job on a Ray cluster through Ray's Jobs API, and manage those jobs.

    ctx submit --address http://HEAD:8265 -- pretrain --config configs/bert-tiny.yaml
    ctx jobs list | status ID | logs ID [--follow] | stop ID

The job's entrypoint is ``python -m jobs.cli <ctx_args...>``, run in a copy of the project root
(the folder holding this project's pyproject.toml, found from this file, not from the current
folder) that Ray uploads to the cluster without secrets and build output (``EXCLUDES``). The
entrypoint runs with the cluster's PATH, so ``python`` must name an interpreter there that has
this project's dependencies installed.

Submission ids are deterministic (``submission_id``): the ctx arguments, the contents of the
config files they name and the address. Submitting the same run again (a retry after a timeout, a
second terminal) attaches to the job already running, or says how it ended, instead of starting a
second copy; Ray refuses a second job with the same id, which makes this hold under races too.
``new=True`` (``--new``) starts another run with the next free ``<id>-rN``.

Following a job polls its status (``follow_job``): the log stream is for the eyes only, so a
stream that drops neither loses the exit status nor the end of the log.

Addresses and tokens: ``--address`` and ``RAY_ADDRESS`` / ``RAY_API_SERVER_ADDRESS`` must agree
when both are given (Ray would silently prefer the variable); a token is sent only over https or to
a loopback address. Token authentication (Ray 2.60): a head started with ``RAY_AUTH_MODE=token``
answers 401 to clients without the token. Ray's client sends ``~/.ray/auth_token`` when
``RAY_AUTH_MODE=token`` is set here; ``token=`` or ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` are
sent whatever that mode says.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import os
import re
import shlex
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:  # imported where used: `ctx` commands that never submit do not import Ray's client
    from ray.job_submission import JobSubmissionClient

# Never uploaded (gitignore syntax, relative to the project root; Ray also honours .gitignore, but
# these hold without one). Secrets: environment files, keys and certificates, cloud and cluster
# credential folders. Build output: environments, run outputs, VCS data and caches.
SECRET_EXCLUDES = [
    ".env", ".env.*", "*.env", ".envrc",
    "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", "*.gpg", "*.asc",
    "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*",
    ".ssh/", ".aws/", ".gcp/", ".gcloud/", ".azure/", ".kube/", ".docker/", ".ray/",
    "credentials", "credentials.*", "*credentials*.json", "service-account*.json", "application_default_credentials.json",
    "kubeconfig", "*.kubeconfig", ".netrc", ".pgpass", ".pypirc", ".npmrc", "auth_token",
]  # fmt: skip
BUILD_EXCLUDES = [
    ".venv", ".venv-*", "venv", ".git", "runs/", "mlruns/", "/build/", "/dist/", ".whl/", ".gl/",
    "__pycache__", "*.pyc", "*.egg-info", ".pytest_cache", ".mypy_cache", ".ruff_cache",
]  # fmt: skip
EXCLUDES = SECRET_EXCLUDES + BUILD_EXCLUDES
DEFAULT_EXCLUDES = EXCLUDES  # the older name

# The exit code of `ctx submit` / `ctx jobs logs --follow` for a job's end (2 is the CLI's own
# errors). Keyed by Ray's JobStatus values (a str Enum: JobStatus.FAILED == "FAILED").
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 3}
TERMINAL = set(EXIT_CODES)
LOST_CONTACT = 4  # the head stopped answering while following: the job's end is unknown

# How long a stopped job has to end before Ray kills it. `ctx jobs stop` is Ray's stop: SIGTERM to
# the driver, then SIGKILL RAY_JOB_STOP_WAIT_TIME_S later, 3 s unless set where the job's supervisor
# runs, which is in the job's runtime_env. A ctx driver ends on SIGTERM through its `finally` blocks:
# the run lock released (waiting up to ``runlock.RELEASE_WAIT_S`` for S3), temporary folders removed.
# 3 s cuts that short on a busy node, and a lock killed with its driver blocks the next run until it
# goes stale. 30 s is what Kubernetes gives a pod.
STOP_GRACE_S = 30

# Ray's settings that keep its own lines off a command's console without --verbose, in the
# environment of every process that could print them (``jobs.cli`` sets them for a local Ray, which
# inherits the driver's environment; ``job_runtime_env`` for a job's processes on a cluster). Ray
# Data kills its tokenizing actors when training stops with data left, and the task the actor had
# queued pushes "(raylet) Task MapWorker(...).submit failed. There are infinite retries remaining
# ... killed by `ray.kill`" to the driver: at the end of every run that stops before its stream
# does. A failure that exhausts its retries still raises.
QUIET_RAY_ENV = {"RAY_enable_output_error_log_if_still_retry": "0"}


class SubmitError(RuntimeError):
    """A submission that must not go ahead (address, token, files); the message says what to do."""


# ---------------------------------------------------------------------------------------------
# Where: the project root, the address, the token


def project_root() -> Path:
    """The folder with this project's pyproject.toml: what a job runs in, wherever ctx runs from."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file():
        raise SubmitError(f"no pyproject.toml in {root}: ctx submit uploads the project root, and this copy of "
                          "jobs/ is not inside one (run ctx from a checkout of the project)")
    return root


def _normal(address: str) -> str:
    parts = urlsplit(address.strip())
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}{parts.path.rstrip('/')}" if parts.scheme else address.strip().rstrip("/")


def resolve_address(address: str | None, environ: os._Environ | dict | None = None) -> str:
    """The dashboard URL to use: ``address`` or the environment's, and an error when they differ."""
    environ = os.environ if environ is None else environ
    env_name = next((k for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS") if environ.get(k)), None)
    env_value = environ.get(env_name) if env_name else None
    if address and env_value and _normal(address) != _normal(env_value):
        raise SubmitError(f"--address {address} disagrees with {env_name}={env_value}: Ray would use {env_name}. "
                          f"Unset {env_name} or pass the same address to --address.")
    chosen = address or env_value
    if not chosen:
        raise SubmitError("no cluster address: pass --address http://HEAD:8265 (the Ray dashboard) or set RAY_ADDRESS")
    if urlsplit(chosen).scheme not in ("http", "https"):
        where = f"{env_name}={chosen}" if not address else f"--address {chosen}"
        raise SubmitError(f"{where}: expected the dashboard's URL, http(s)://HOST:PORT (e.g. http://127.0.0.1:8265)")
    return chosen


def auth_headers(token: str | None = None) -> dict[str, str]:
    """A bearer header for a token given here or in RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH.

    Empty when there is none: Ray's client then applies its own rule (RAY_AUTH_MODE=token plus
    ~/.ray/auth_token). A server with authentication disabled ignores the header.
    """
    if token is None:
        token = os.environ.get("RAY_AUTH_TOKEN")
    if token is None and os.environ.get("RAY_AUTH_TOKEN_PATH"):
        token = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).expanduser().read_text()
    token = (token or "").strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def check_token_transport(address: str, headers: dict[str, str], environ: os._Environ | dict | None = None) -> None:
    """Refuse to send a token in clear text over a network: https, or http to loopback only."""
    environ = os.environ if environ is None else environ
    sends_token = bool(headers) or environ.get("RAY_AUTH_MODE", "").lower() == "token"
    parts = urlsplit(address)
    if sends_token and parts.scheme == "http" and not _is_loopback(parts.hostname or ""):
        raise SubmitError(f"refusing to send the cluster token over plain HTTP to {parts.hostname}: anyone on the path "
                          f"could read it. Use https://{parts.netloc} (a TLS proxy in front of the dashboard), or an "
                          "SSH tunnel / port-forward to a loopback address (e.g. http://127.0.0.1:8265).")


def connect(address: str | None, token: str | None = None) -> JobSubmissionClient:
    """A Jobs API client for the resolved address, with the token, after the checks above."""
    address = resolve_address(address)
    headers = auth_headers(token)
    check_token_transport(address, headers)
    # --- Ray seam: the Jobs REST API on the head's dashboard ---
    from ray.job_submission import JobSubmissionClient

    error: Exception | None = None
    for attempt in range(3):
        try:
            return JobSubmissionClient(address, headers=headers)
        except ConnectionError as e:  # a busy head can drop a request; a wrong address fails three times in seconds
            error = e
            if attempt < 2:
                time.sleep(1.0 + attempt)
        except Exception as e:  # RuntimeError, AuthenticationError: no use repeating
            error = e
            break
    hint = ""
    if "401" in str(error) or "uthentication" in str(error):
        hint = ("\nThe cluster uses token authentication: pass token=..., or set RAY_AUTH_TOKEN"
                " (or RAY_AUTH_MODE=token with the token in ~/.ray/auth_token).")
    raise ConnectionError(f"cannot reach the Ray Jobs API at {address}: {error}{hint}") from error


# ---------------------------------------------------------------------------------------------
# What: the entrypoint, its id, its runtime environment

CONFIG_SUFFIXES = (".yaml", ".yml", ".json", ".toml")


def build_entrypoint(ctx_args: list[str], python: str = "python") -> str:
    """The shell command the cluster runs: every argument quoted, so spaces and `$` survive."""
    return shlex.join([python, "-m", "jobs.cli", *ctx_args])


def named_config_files(ctx_args: list[str], root: Path) -> list[Path]:
    """The files under ``root`` the arguments name (``--config X``, ``--config=X`` or a bare path)
    with a config suffix. A ``--config`` that is not there is an error: the job would not find it."""
    found: list[Path] = []
    after_config = False
    for arg in ctx_args:
        value = arg.split("=", 1)[1] if arg.startswith("--config=") else arg
        is_config = after_config or arg.startswith("--config=")
        after_config = arg == "--config"
        if arg == "--config" or not value.endswith(CONFIG_SUFFIXES) or "://" in value:
            continue
        path = (root / value).resolve()
        if path.is_file() and path.is_relative_to(root):
            found.append(path)
        elif is_config:
            raise SubmitError(f"--config {value}: not a file in the project root {root}. The job runs in an uploaded copy "
                              "of that folder: put the config there and name it relative to it.")
    return found


def submission_id(ctx_args: list[str], address: str, root: Path) -> str:
    """``ctx-<command>-<16 hex>`` from the ctx arguments, the named config files' contents and the
    address: the same run submitted twice has one id."""
    h = hashlib.sha256(json.dumps({"args": list(ctx_args), "address": _normal(address)}).encode())
    for path in named_config_files(ctx_args, root):
        h.update(str(path.relative_to(root)).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    words = [a for a in ctx_args[:2] if not a.startswith("-")][:2] or ["job"]
    command = re.sub(r"[^a-z0-9]+", "-", "-".join(words).lower()).strip("-") or "job"
    return f"ctx-{command}-{h.hexdigest()[:16]}"


def job_runtime_env(working_dir: str | Path, env_vars: dict[str, str] | None = None, excludes: list[str] | None = None,
                    verbose: bool = False) -> dict:
    """Ray's runtime_env of a ctx job. PYTHONUNBUFFERED: a job's stdout is a file, which Python
    would otherwise flush only every few KB, so `ctx jobs logs` would lag the run by minutes.
    RAY_JOB_STOP_WAIT_TIME_S: a stopped driver's time to clean up (``STOP_GRACE_S``). Unless the
    command is ``verbose``, ``QUIET_RAY_ENV``. ``env_vars`` add to these and win."""
    defaults = {"PYTHONUNBUFFERED": "1", "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_S), **({} if verbose else QUIET_RAY_ENV)}
    return {
        "working_dir": str(working_dir),
        "excludes": EXCLUDES + list(excludes or []),
        "env_vars": {**defaults, **{str(k): str(v) for k, v in (env_vars or {}).items()}},
    }


# ---------------------------------------------------------------------------------------------
# Submit


def submit(
    address: str | None,
    ctx_args: list[str],
    *,
    working_dir: str | Path | None = None,
    follow: bool = True,
    python: str = "python",
    env_vars: dict[str, str] | None = None,
    excludes: list[str] | None = None,
    token: str | None = None,
    new: bool = False,
    out: TextIO | None = None,
) -> int:
    """Submit ``python -m jobs.cli <ctx_args>`` to the cluster at ``address`` (the dashboard URL;
    default RAY_ADDRESS), or attach to the same run already submitted.

    Returns the job's exit code (``EXIT_CODES``) when following; with ``follow=False`` 0 once the
    job is accepted or running (and the code of its end when it had ended). ``working_dir`` defaults
    to the project root; ``excludes`` add to ``EXCLUDES``.
    """
    out = out or sys.stdout
    root = Path(working_dir).resolve() if working_dir is not None else project_root()
    if not root.is_dir():
        raise SubmitError(f"working_dir {str(root)!r} is not a directory")
    client = connect(address, token)
    address = resolve_address(address)
    sid = submission_id(ctx_args, address, root)
    if new:
        sid = _next_free(client, sid)
    entrypoint = build_entrypoint(ctx_args, python)

    info = _job_info(client, sid)
    if info is None:
        try:
            submit_when_ready(client, entrypoint=entrypoint, runtime_env=job_runtime_env(root, env_vars, excludes, verbose="--verbose" in ctx_args),
                              submission_id=sid,
                              metadata={"ctx": shlex.join(ctx_args)[:1000]})
            print(f"submitted {sid}: {entrypoint}", file=out, flush=True)
        except RuntimeError as e:
            if "already exists" not in str(e):
                raise
            info = _job_info(client, sid)  # submitted by a racing twin between our look and our submit
    if info is not None:
        status = _status(info.status)
        if status in TERMINAL:
            message = _summary(info.message)
            print(f"{sid} was submitted before and ended {status}{message}\n"
                  f"not starting a second copy; `ctx jobs logs {sid}` shows its log, `ctx submit --new ...` runs it again"
                  + (" (a pretraining or fine-tuning run resumes from its latest checkpoint)" if status != "SUCCEEDED" else ""),
                  file=out, flush=True)
            return EXIT_CODES[status]
        print(f"{sid} is already {status}: attaching to it instead of starting a second copy", file=out, flush=True)
    if not follow:
        print(f"follow with: ctx jobs logs --follow {sid}   (stop: ctx jobs stop {sid})", file=out, flush=True)
        return 0
    return follow_job(client, sid, out, stop_hint=f"ctx jobs stop {sid}")


def _dropped(error: Exception) -> bool:
    """A request the dashboard dropped without answering (a busy or restarting head)."""
    import requests

    return isinstance(error, (requests.ConnectionError, requests.Timeout))


def _call(fn, *args, wait_s: float = 30.0):
    """``fn(*args)``, a request that may be repeated, retried for ``wait_s`` while it is dropped."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return fn(*args)
        except Exception as e:
            if not _dropped(e) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def submit_when_ready(client: JobSubmissionClient, wait_s: float = 60.0, **job) -> str:
    """``client.submit_job(**job)``, retried while the head answers "No available agent to submit
    job, please try again later" (a head that has just started: its Jobs API answers before the
    agent that runs jobs is up) or drops the request. With a ``submission_id`` a repeat is safe:
    a first attempt that did go through makes the next one fail with "already exists"."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(**job)
        except Exception as e:
            busy = isinstance(e, RuntimeError) and "try again later" in str(e)
            if not (busy or (_dropped(e) and job.get("submission_id"))) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _summary(message: str | None) -> str:
    """": <first line>" of a job's message. A failed job's message goes on with the last lines of
    its log, which `ctx jobs logs` shows in full and a follower has just printed."""
    line = (message or "").strip().split("\n", 1)[0].split(", last available logs", 1)[0].rstrip(":, ")
    return f": {line}" if line else ""


def _status(status) -> str:
    """A job status as its name: Ray's JobStatus is a str Enum, some answers carry plain strings."""
    return str(getattr(status, "value", status))


def _job_info(client: JobSubmissionClient, sid: str):
    try:
        return _call(client.get_job_info, sid)
    except RuntimeError as e:
        if "does not exist" in str(e) or "404" in str(e):
            return None
        raise


def _next_free(client: JobSubmissionClient, sid: str) -> str:
    """``<sid>-r2``, ``-r3`` ...: the first run number no job on the cluster has."""
    taken = {j.submission_id for j in _call(client.list_jobs)}
    n = 2
    while f"{sid}-r{n}" in taken:
        n += 1
    return f"{sid}-r{n}"


# ---------------------------------------------------------------------------------------------
# Follow: the log stream for the eyes, the status by polling


def follow_job(client: JobSubmissionClient, sid: str, out: TextIO, *, poll_s: float = 1.0, patience_s: float = 120.0,
               restream_s: float = 10.0, stop_hint: str | None = None) -> int:
    """Print the job's log as it grows until the job ends; returns the exit code of its end (``EXIT_CODES``).

    The status is polled (``get_job_status``), never inferred from the log stream. The stream
    (``tail_job_logs``, a websocket) runs in a thread and is only for display: when it drops, the
    log is read by polling (``get_job_logs``) and a new stream is tried every ``restream_s``
    (it starts from the log's beginning, so it skips what is already printed); at the end,
    whatever no stream delivered is printed from the full log. A head that does not answer for
    ``patience_s`` gives ``LOST_CONTACT``.
    """
    printed = [0]  # characters of the log written so far, by any stream or poll
    guard = threading.Lock()
    done = threading.Event()

    def stream() -> None:
        seen = 0  # characters this stream has delivered, from the log's beginning

        async def tail() -> None:
            nonlocal seen
            async for chunk in client.tail_job_logs(sid):
                with guard:
                    if done.is_set():
                        return
                    new = chunk[max(0, printed[0] - seen):]
                    seen += len(chunk)
                    if new:
                        out.write(new)
                        out.flush()
                        printed[0] = max(printed[0], seen)

        try:
            asyncio.run(tail())
        except Exception:  # a dropped websocket: polling takes over
            pass

    def catch_up() -> None:
        text = _call(client.get_job_logs, sid)
        with guard:
            if len(text) > printed[0]:
                out.write(text[printed[0]:])
                out.flush()
                printed[0] = len(text)

    def start_stream() -> threading.Thread:
        thread = threading.Thread(target=stream, name=f"logs-{sid}", daemon=True)
        thread.start()
        return thread

    streamer, streamed_at = start_stream(), time.monotonic()
    last_answer = time.monotonic()
    try:
        while True:
            try:
                status = client.get_job_status(sid)
                last_answer = time.monotonic()
                if _status(status) in TERMINAL:
                    break
                if not streamer.is_alive():
                    catch_up()
                    if time.monotonic() - streamed_at > restream_s:
                        streamer, streamed_at = start_stream(), time.monotonic()
            except Exception as e:  # the head restarting, a network blip: keep asking for a while
                if time.monotonic() - last_answer > patience_s:
                    print(f"\nlost contact with the cluster for {patience_s:.0f} s ({e}); the job may still be running: "
                          f"`ctx jobs status {sid}`", file=out, flush=True)
                    return LOST_CONTACT
            time.sleep(poll_s)
        streamer.join(timeout=5)  # the stream ends when the job does; let it deliver its last chunk
        with guard:
            done.set()
        try:
            catch_up()
        except Exception as e:  # the end is known; only the log's tail is missing
            print(f"\n(could not read the rest of the log: {e}; `ctx jobs logs {sid}`)", file=out, flush=True)
    except KeyboardInterrupt:
        done.set()
        print("\nstopped following; the job keeps running." + (f" Stop it with: {stop_hint}" if stop_hint else ""), file=out, flush=True)
        return 130
    info = _call(client.get_job_info, sid)
    message = _summary(info.message)
    print(f"job {sid} {_status(status)}{message}", file=out, flush=True)
    return EXIT_CODES[_status(status)]


# ---------------------------------------------------------------------------------------------
# ctx jobs list / status / logs / stop


def list_jobs(client: JobSubmissionClient, out: TextIO) -> int:
    jobs = sorted(_call(client.list_jobs), key=lambda j: j.start_time or 0)
    rows = [("SUBMISSION ID", "STATUS", "STARTED (UTC)", "DURATION", "COMMAND")]
    for j in jobs:
        started = datetime.fromtimestamp(j.start_time / 1000, timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if j.start_time else "-"
        end = j.end_time or (time.time() * 1000 if j.start_time else None)
        duration = f"{(end - j.start_time) / 1000:.0f} s" if j.start_time and end else "-"
        command = (j.metadata or {}).get("ctx") or j.entrypoint
        rows.append((j.submission_id or j.job_id or "-", _status(j.status), started, duration, command))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4], file=out)
    return 0


def job_status(client: JobSubmissionClient, sid: str, out: TextIO) -> int:
    """Prints ``ID STATUS: message``; returns 0 (the status was read)."""
    info = _job_info(client, sid)
    if info is None:
        raise SubmitError(f"no job {sid} on this cluster (`ctx jobs list` shows them)")
    message = _summary(info.message)
    print(f"{sid} {_status(info.status)}{message}", file=out)
    return 0


def job_logs(client: JobSubmissionClient, sid: str, out: TextIO, follow: bool = False) -> int:
    if _job_info(client, sid) is None:
        raise SubmitError(f"no job {sid} on this cluster (`ctx jobs list` shows them)")
    if follow:
        return follow_job(client, sid, out, stop_hint=f"ctx jobs stop {sid}")
    out.write(_call(client.get_job_logs, sid))
    out.flush()
    return 0


def stop_job(client: JobSubmissionClient, sid: str, out: TextIO, wait_s: float = 60.0) -> int:
    """Ask the job to stop and wait until it has; 0 when it ended (now or before), 1 if it did not in time."""
    if _job_info(client, sid) is None:
        raise SubmitError(f"no job {sid} on this cluster (`ctx jobs list` shows them)")
    was_running = _call(client.stop_job, sid)
    deadline = time.monotonic() + wait_s
    status = _call(client.get_job_status, sid)
    while _status(status) not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        status = _call(client.get_job_status, sid)
    if _status(status) not in TERMINAL:
        print(f"{sid} is still {_status(status)} after {wait_s:.0f} s; `ctx jobs status {sid}` tells when it ends", file=out)
        return 1
    print(f"{sid} {_status(status)}" + ("" if was_running else " (it had already ended)"), file=out)
    return 0
