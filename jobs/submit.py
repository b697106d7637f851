"""Run a `ctx` command on a Ray cluster through the Jobs API and follow its logs.

    python -c "from jobs.submit import submit; submit('http://HEAD:8265', ['train', 'configs/x.yaml'])"

The job's entrypoint is `python -m jobs.cli <ctx_args...>`, run in a copy of `working_dir` that Ray
uploads to the cluster (minus `excludes`). The entrypoint runs with the cluster's PATH, so `python`
must name an interpreter there that has this project's dependencies installed.

Token authentication (Ray 2.60): a head started while `~/.ray/auth_token` exists, or with
`RAY_AUTH_MODE=token`, answers 401 to clients without the token. Ray's client sends the token
only when `RAY_AUTH_MODE=token` is set in the submitting process; `submit` also sends it when it is
given as `token=` or through `RAY_AUTH_TOKEN` / `RAY_AUTH_TOKEN_PATH`, whatever that mode says.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from pathlib import Path
from typing import TextIO

from ray.job_submission import JobStatus, JobSubmissionClient

# Never uploaded: environments, run outputs, VCS data and caches. Ray also honours .gitignore.
DEFAULT_EXCLUDES = [
    ".venv",
    "venv",
    "runs",
    ".git",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
]

TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}


def build_entrypoint(ctx_args: list[str], python: str = "python") -> str:
    """The shell command the cluster runs: every argument quoted, so spaces and `$` survive."""
    return shlex.join([python, "-m", "jobs.cli", *ctx_args])


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


def submit(
    address: str,
    ctx_args: list[str],
    *,
    working_dir: str = ".",
    follow: bool = True,
    python: str = "python",
    env_vars: dict[str, str] | None = None,
    excludes: list[str] | None = None,
    token: str | None = None,
    out: TextIO | None = None,
) -> int:
    """Submit `python -m jobs.cli <ctx_args>` to the cluster at `address` (the dashboard URL).

    Returns 0 when the job SUCCEEDED, 1 otherwise. With `follow=False` it returns 0 once the job is
    accepted and prints how to follow it. `excludes` add to DEFAULT_EXCLUDES. Note that Ray lets
    RAY_ADDRESS / RAY_API_SERVER_ADDRESS in the environment override `address`.
    """
    out = out or sys.stdout
    if not Path(working_dir).is_dir():
        raise FileNotFoundError(f"working_dir {working_dir!r} is not a directory")
    runtime_env: dict = {
        "working_dir": str(working_dir),
        "excludes": DEFAULT_EXCLUDES + list(excludes or []),
    }
    if env_vars:
        runtime_env["env_vars"] = {str(k): str(v) for k, v in env_vars.items()}
    entrypoint = build_entrypoint(ctx_args, python)

    # --- Ray seam: the Jobs REST API on the head's dashboard ---
    try:
        client = JobSubmissionClient(address, headers=auth_headers(token))
    except Exception as e:  # Ray raises ConnectionError, RuntimeError or AuthenticationError
        hint = ""
        if "401" in str(e) or "uthentication" in str(e):
            hint = (
                "\nThe cluster uses token authentication: pass token=..., or set RAY_AUTH_TOKEN"
                " (or RAY_AUTH_MODE=token with the token in ~/.ray/auth_token)."
            )
        raise ConnectionError(f"cannot reach the Ray Jobs API at {address}: {e}{hint}") from e
    job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
    print(f"submitted {job_id}: {entrypoint}", file=out, flush=True)
    if not follow:
        print(f"follow with: ray job logs --address {address} --follow {job_id}", file=out, flush=True)
        return 0

    try:
        asyncio.run(_print_logs(client, job_id, out))
        status = _wait_terminal(client, job_id)
    except KeyboardInterrupt:
        print(
            f"\nstopped following; the job keeps running. Stop it with: "
            f"ray job stop --address {address} {job_id}",
            file=out,
            flush=True,
        )
        return 1
    info = client.get_job_info(job_id)
    message = f": {info.message}" if info.message else ""
    print(f"job {job_id} {status.value}{message}", file=out, flush=True)
    return 0 if status == JobStatus.SUCCEEDED else 1


async def _print_logs(client: JobSubmissionClient, job_id: str, out: TextIO) -> None:
    async for chunk in client.tail_job_logs(job_id):
        out.write(chunk)
        out.flush()


def _wait_terminal(client: JobSubmissionClient, job_id: str, timeout_s: float = 60.0) -> JobStatus:
    """The log stream can close a moment before the status turns terminal: poll briefly."""
    deadline = time.monotonic() + timeout_s
    status = client.get_job_status(job_id)
    while status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(job_id)
    return status
