"""`jobs.submit.submit` against a real Ray head on loopback, started with token authentication.

The head runs as `ray start --head --block` in its own process group with the virtualenv's bin first
on PATH (so the entrypoint's `python` is ours) and is stopped by signalling that group: never
`ray stop`, which would kill every Ray process on the machine.
"""

from __future__ import annotations

import io
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from jobs.submit import build_entrypoint, submit
from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow

VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def ray_head():
    """Yields (dashboard address, token) of a fresh single-node head with token auth on."""
    temp_dir = tempfile.mkdtemp(prefix="rayh-")  # short: Ray's socket paths must fit 107 chars
    token = secrets.token_hex(16)
    dashboard_port = free_port()
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    cmd = [
        str(VENV_BIN / "ray"), "start", "--head", "--block",
        "--node-ip-address", "127.0.0.1",
        "--port", str(free_port()),
        "--ray-client-server-port", str(free_port()),
        "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dashboard_port),
        "--dashboard-agent-listen-port", str(free_port()),
        "--num-cpus", "1",
        "--object-store-memory", str(200 * 1024**2),
        "--temp-dir", temp_dir,
        "--disable-usage-stats",
    ]  # fmt: skip
    log_path = Path(temp_dir) / "head.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        _wait_for_jobs_api(address, token, proc, log_path)
        yield address, token
    finally:
        _stop_group(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_jobs_api(address: str, token: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ray head exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            r = httpx.get(f"{address}/api/jobs/", headers={"Authorization": f"Bearer {token}"}, timeout=2)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the Jobs API at {address} did not come up in 120 s:\n{log_path.read_text()[-3000:]}")


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the `ray start --block` process, which then stops the head's processes in order (~3 s;
    signalling the whole group at once leaves it waiting on its dead GCS), then SIGKILL the group to
    sweep anything left."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


@pytest.fixture()
def client_env(monkeypatch):
    """The submitting side states its auth mode explicitly and carries no ambient token."""
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(var, raising=False)


def test_entrypoint_is_shell_quoted():
    assert build_entrypoint(["train", "my config.yaml", "--set", "x=$HOME"], "python") == (
        "python -m jobs.cli train 'my config.yaml' --set 'x=$HOME'"
    )


def test_ctx_submit_runs_a_real_job_and_streams_its_logs(ray_head, client_env, monkeypatch, tmp_path, capsys):
    """`ctx submit -- tokenizer train ...` through the CLI: the job trains a tokenizer on the cluster."""
    from jobs.cli import main

    address, token = ray_head
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    monkeypatch.chdir(REPO)
    out_dir = tmp_path / "tok"
    rc = main(["submit", "--address", address, "--", "tokenizer", "train", "--kind", "wordpiece",
               "--input", "data/sample/wordnet-0000-of-0008.txt.gz", "--vocab-size", "500",
               "--sample-chars", "200000", "--output", str(out_dir)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "wordpiece tokenizer with" in text  # the job's own output reached us through the log tail
    assert "SUCCEEDED" in text
    assert (out_dir / "vocab.txt").exists()


def test_help_job_returns_0(ray_head, client_env):
    address, token = ray_head
    out = io.StringIO()
    rc = submit(address, ["--help"], working_dir=str(REPO), token=token, out=out)
    assert rc == 0 and "usage:" in out.getvalue().lower(), out.getvalue()


def test_failing_ctx_command_returns_1(ray_head, client_env):
    address, token = ray_head
    out = io.StringIO()
    rc = submit(address, ["no-such-ctx-command"], working_dir=str(REPO), token=token, out=out)
    assert rc == 1, out.getvalue()
    assert "FAILED" in out.getvalue()


def test_missing_token_is_a_readable_error(ray_head, client_env):
    address, _ = ray_head
    with pytest.raises(ConnectionError, match="pass token="):
        submit(address, ["--help"], working_dir=str(REPO), out=io.StringIO())
