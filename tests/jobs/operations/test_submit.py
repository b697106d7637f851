"""`ctx submit` and `ctx jobs` against a real Ray head on loopback, started with token authentication:
a tokenizer job and a short pretraining job end to end, a retried submit attaching instead of
starting a second copy, list/status/logs/stop, a dropped log stream, what is uploaded, and a second
`ctx pretrain` on the same output refused while the job holds the run.

The head runs as `ray start --head --block` in its own process group with the virtualenv's bin first
on PATH (so the entrypoint's `python` is ours) and is stopped by signalling that group: never
`ray stop`, which would kill every Ray process on the machine.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from ray.job_submission import JobStatus, JobSubmissionClient

from jobs.runlock import LOCK_FILE
from jobs.operations.submit import EXIT_CODES, build_entrypoint, follow_job, job_runtime_env, submit, submit_when_ready
from pipelines import storage
from tests.conftest import REPO, free_port, stop_process_group

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
        "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
        # Ray 2.60's head drains for up to 30 s on SIGTERM while anything holds a lease; the
        # teardown has nothing to drain and would wait that out (30 s of every suite run).
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
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
        "--num-cpus", "2",  # logical: one 0.5-CPU Train worker and Ray Data's tasks beside it
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
        stop_process_group(proc)
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
    monkeypatch.chdir(tmp_path)  # not the project: the project root is uploaded all the same
    out_dir = tmp_path / "tok"
    rc = main(["submit", "--address", address, "--", "tokenizer", "train", "--kind", "wordpiece",
               "--input", "data/sample/wordnet-0000-of-0008.txt.gz", "--vocab-size", "500",
               "--sample-chars", "200000", "--output", str(out_dir)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "wordpiece tokenizer with" in text  # the job's own output reached us through the log tail
    assert "SUCCEEDED" in text
    assert (out_dir / "vocab.txt").exists()


def test_help_job_returns_0_and_runs_once_unless_new(ray_head, client_env):
    address, token = ray_head
    out = io.StringIO()
    rc = submit(address, ["--help"], token=token, out=out)
    assert rc == 0 and "usage:" in out.getvalue().lower(), out.getvalue()
    sid = re.search(r"submitted (ctx-job-[0-9a-f]{16})", out.getvalue()).group(1)
    again = io.StringIO()
    assert submit(address, ["--help"], token=token, out=again) == 0
    assert f"{sid} was submitted before and ended SUCCEEDED" in again.getvalue() and "usage:" not in again.getvalue()
    new = io.StringIO()
    assert submit(address, ["--help"], token=token, new=True, out=new) == 0
    assert f"submitted {sid}-r2" in new.getvalue() and f"job {sid}-r2 SUCCEEDED" in new.getvalue(), new.getvalue()


def test_failing_ctx_command_returns_1_and_a_retry_says_so(ray_head, client_env):
    address, token = ray_head
    out = io.StringIO()
    rc = submit(address, ["no-such-ctx-command"], token=token, out=out)
    assert rc == 1, out.getvalue()
    assert "FAILED" in out.getvalue()
    again = io.StringIO()
    assert submit(address, ["no-such-ctx-command"], token=token, out=again) == 1
    assert "ended FAILED" in again.getvalue() and "--new" in again.getvalue()


def test_missing_token_is_a_readable_error(ray_head, client_env):
    address, _ = ray_head
    with pytest.raises(ConnectionError, match="pass token="):
        submit(address, ["--help"], out=io.StringIO())


def _client(address: str, token: str, cls=JobSubmissionClient) -> JobSubmissionClient:
    return cls(address, headers={"Authorization": f"Bearer {token}"})


def _wait_status(client, sid: str, until, timeout_s: float = 300) -> JobStatus:
    deadline = time.monotonic() + timeout_s
    status = client.get_job_status(sid)
    while not until(status) and time.monotonic() < deadline:
        time.sleep(0.5)
        status = client.get_job_status(sid)
    return status


class DroppingClient(JobSubmissionClient):
    """The real client, except that its log websocket closes before the first line (a proxy timeout)."""

    async def tail_job_logs(self, job_id):
        return
        yield


class DropsOnceClient(JobSubmissionClient):
    """The real client, except that its first log websocket breaks after the first chunk."""

    streams = 0

    async def tail_job_logs(self, job_id):
        self.streams += 1
        async for chunk in super().tail_job_logs(job_id):
            yield chunk
            if self.streams == 1:
                raise ConnectionResetError("websocket closed by a proxy")


def test_a_dropped_log_stream_loses_neither_the_log_nor_the_exit_code(ray_head, client_env):
    address, token = ray_head
    client = _client(address, token)
    sid = f"dropped-{secrets.token_hex(4)}"
    submit_when_ready(client, entrypoint=build_entrypoint(["--help"], sys.executable), runtime_env=job_runtime_env(REPO), submission_id=sid)
    out = io.StringIO()
    rc = follow_job(_client(address, token, DroppingClient), sid, out, poll_s=0.5)
    assert rc == 0, out.getvalue()
    assert "usage: ctx" in out.getvalue() and f"job {sid} SUCCEEDED" in out.getvalue()


def test_a_stopped_job_has_time_to_clean_up(ray_head, client_env):
    """`ctx jobs stop`: Ray sends SIGTERM, then SIGKILL RAY_JOB_STOP_WAIT_TIME_S later (3 s by default;
    this head leaves it unset). A job whose SIGTERM handler takes 6 s, as a driver releasing its run
    lock on a busy node or through a slow S3 may, finishes it: ctx jobs carry STOP_GRACE_S."""
    from jobs.operations.submit import STOP_GRACE_S, stop_job

    address, token = ray_head
    client = _client(address, token)
    script = ("import signal, sys, time\n"
              "def bye(*_):\n    time.sleep(6)\n    print('cleaned up', flush=True)\n    sys.exit(143)\n"
              "signal.signal(signal.SIGTERM, bye)\nprint('ready', flush=True)\ntime.sleep(600)")
    sid = submit_when_ready(client, entrypoint=shlex.join([sys.executable, "-c", script]), runtime_env=job_runtime_env(REPO))
    # lines of their own: the log's first line quotes the script, words and all
    _wait_for(lambda: "ready" in client.get_job_logs(sid).splitlines(), "the job to set its handler")
    assert STOP_GRACE_S > 6
    assert stop_job(client, sid, io.StringIO()) == 0
    assert _wait_status(client, sid, lambda s: s == JobStatus.STOPPED) == JobStatus.STOPPED
    _wait_for(lambda: "cleaned up" in client.get_job_logs(sid).splitlines(), "the handler's last line", timeout_s=15)


def test_a_stream_that_breaks_midway_is_replaced_without_repeating_lines(ray_head, client_env):
    """A job printing a line a second, then failing: polling and a new stream fill in after the
    first stream breaks, each line once, and the exit code is the job's failure."""
    address, token = ray_head
    client = _client(address, token)
    script = "import time\nfor i in range(6):\n    print(f'line {i}', flush=True)\n    time.sleep(1)\nraise SystemExit(1)"
    sid = submit_when_ready(client, entrypoint=shlex.join([sys.executable, "-c", script]), runtime_env=job_runtime_env(REPO))
    follower = _client(address, token, DropsOnceClient)
    out = io.StringIO()
    rc = follow_job(follower, sid, out, poll_s=0.3, restream_s=1.0)
    text = out.getvalue()
    assert rc == 1 and f"job {sid} FAILED" in text, text
    assert [text.count(f"line {i}\n") for i in range(6)] == [1] * 6, text
    assert follower.streams >= 2  # the broken stream was replaced


def test_the_upload_leaves_out_secrets_and_build_output(ray_head, client_env, tmp_path):
    """A job that lists its working directory: the code is there, .env, keys, credential folders
    and run outputs are not (no .gitignore in this folder: the excludes alone do it)."""
    address, token = ray_head
    project = tmp_path / "project"
    files = {
        "pyproject.toml": "[project]\nname = 'x'\n", "jobs/cli.py": "", "configs/a.yaml": "name: a\n",
        ".env": "TOKEN=1", ".env.local": "TOKEN=2", "deploy/tls.key": "k", "server.pem": "p", "id_rsa": "k",
        ".aws/credentials": "[default]", ".ssh/config": "Host x", "kubeconfig": "apiVersion: v1",
        "runs/bert/checkpoint_1/model.safetensors": "w", ".venv/bin/python": "", "jobs/__pycache__/cli.cpython-311.pyc": "",
    }  # fmt: skip
    for rel, text in files.items():
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    client = _client(address, token)
    listing = "import os, json; print(json.dumps(sorted(os.path.relpath(os.path.join(r, f)) for r, _, fs in os.walk('.') for f in fs)))"
    sid = submit_when_ready(client, entrypoint=f"{sys.executable} -c \"{listing}\"", runtime_env=job_runtime_env(project))
    assert _wait_status(client, sid, lambda s: s in (JobStatus.SUCCEEDED, JobStatus.FAILED)) == JobStatus.SUCCEEDED, client.get_job_logs(sid)
    uploaded = set(json.loads(client.get_job_logs(sid).strip().splitlines()[-1]))
    assert uploaded == {"pyproject.toml", "jobs/cli.py", "configs/a.yaml"}, uploaded


def _tiny_pretrain(out: Path, max_steps: int) -> list[str]:
    return [
        "pretrain", "--config", "configs/bert-tiny.yaml", "--no-progress",
        "--set", f"output_dir={out}", "--set", "data.input=data/sample/wordnet-0000-of-0008.txt.gz", "--set", "data.eval_input=null",
        "--set", "tokenizer.vocab_size=600", "--set", "tokenizer.sample_chars=100000",
        "--set", "data.seq_len=32", "--set", "model.max_seq_len=32", "--set", "train.batch_size=8",
        "--set", "train.warmup_steps=1", "--set", "train.log_every=1", "--set", f"train.checkpoint_every={min(max_steps, 1000)}",
        "--set", f"train.max_steps={max_steps}", "--set", "scaling.num_workers=1", "--set", "scaling.cpus_per_worker=0.5",
    ]  # fmt: skip


def _wait_for(predicate, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.5)


def test_pretraining_job_retried_submit_attaches_and_one_writer_per_run(ray_head, client_env, monkeypatch, tmp_path, capsys):
    from jobs.cli import main

    address, token = ray_head
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    monkeypatch.setenv("RAY_ADDRESS", address)  # the same address as --address: no disagreement
    out = tmp_path / "runs"
    args = _tiny_pretrain(out, max_steps=3)
    assert main(["submit", "--address", address, "--no-follow", "--", *args]) == 0
    text = capsys.readouterr().out
    sid = re.search(r"submitted (ctx-pretrain-[0-9a-f]{16})", text).group(1)

    # The same submit again (a retry): no second job, it attaches to the one there is.
    assert main(["submit", "--no-follow", "--", *args]) == 0
    assert f"{sid} is already" in capsys.readouterr().out

    # While the job's driver holds the run, a second `ctx pretrain` on the same output is refused at once.
    run = out / "bert-tiny"
    client = _client(address, token)
    _wait_for(lambda: (run / LOCK_FILE).exists() or client.get_job_status(sid).value in EXIT_CODES, "the job to take its run lock")
    assert client.get_job_status(sid) == JobStatus.RUNNING, client.get_job_logs(sid)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": ""}
    local = subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert local.returncode == 2 and "is in use by ctx pretrain (bert-tiny)" in local.stderr, local.stdout + local.stderr

    assert main(["jobs", "status", sid]) == 0
    assert f"{sid} RUNNING" in capsys.readouterr().out
    assert main(["jobs", "list"]) == 0
    listed = capsys.readouterr().out
    assert sid in listed and "pretrain --config configs/bert-tiny.yaml" in listed

    assert main(["jobs", "logs", sid, "--follow"]) == 0
    followed = capsys.readouterr().out
    assert "done: {" in followed and "'step': 3" in followed and f"job {sid} SUCCEEDED" in followed, followed
    assert "(raylet)" not in followed, followed  # Ray's retry lines stay off the job's log (jobs.operations.submit.QUIET_RAY_ENV)

    # Submitted again after it finished: it says so and starts nothing.
    assert main(["submit", "--", *args]) == 0
    assert "ended SUCCEEDED" in capsys.readouterr().out
    assert [j.submission_id for j in client.list_jobs()].count(sid) == 1
    assert not any(j.submission_id.startswith(sid + "-") for j in client.list_jobs())
    assert not (run / LOCK_FILE).exists()  # released at the end of the run
    assert storage.Store().latest_complete_checkpoint(str(run)) is not None


def test_stop_a_long_running_job(ray_head, client_env, monkeypatch, tmp_path, capsys):
    """`ctx jobs stop` on a pretraining run of 100000 steps: it ends STOPPED, `logs --follow` exits 3,
    and the driver released its run lock on the way out."""
    from jobs.cli import main

    address, token = ray_head
    monkeypatch.setenv("RAY_AUTH_TOKEN", token)
    run = tmp_path / "runs" / "bert-tiny"
    assert main(["submit", "--address", address, "--no-follow", "--", *_tiny_pretrain(tmp_path / "runs", max_steps=100_000)]) == 0
    sid = re.search(r"submitted (ctx-pretrain-[0-9a-f]{16})", capsys.readouterr().out).group(1)
    client = _client(address, token)
    # Stopped once training runs (the tokenizer is trained in C++, where a signal waits for it).
    _wait_for(lambda: "tokenizer: " in client.get_job_logs(sid) and " tokens in " in client.get_job_logs(sid)
              or client.get_job_status(sid).value in EXIT_CODES, "the job to start training")
    assert (run / LOCK_FILE).exists(), client.get_job_logs(sid)
    assert main(["jobs", "stop", sid, "--address", address]) == 0
    assert f"{sid} STOPPED" in capsys.readouterr().out
    assert main(["jobs", "logs", sid, "--follow", "--address", address]) == EXIT_CODES["STOPPED"] == 3
    assert f"job {sid} STOPPED" in capsys.readouterr().out
    assert main(["jobs", "status", sid, "--address", address]) == 0
    assert f"{sid} STOPPED" in capsys.readouterr().out
    _wait_for(lambda: not (run / LOCK_FILE).exists(), "the stopped driver to release its run lock", timeout_s=30)
