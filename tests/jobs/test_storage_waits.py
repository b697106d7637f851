"""Waiting on object storage is visible and bounded by the recipe, on the driver too (issue 28).

Commands as a user runs them (``ctx`` in a subprocess) against a closed port (a socket bound and
closed again: every connection is refused), and against moto behind a proxy that takes the
network away mid-command. A wait says so on stderr at once, gives up at the recipe's
``data.retry_deadline_s`` (or the ``--retry-deadline`` of a command without a recipe) with a
StorageError naming the operation and the endpoint, and Ctrl-C or SIGTERM ends it at once with the
run lock released and no temporary folder left. Credentials never show up in anything written.
"""

from __future__ import annotations

import gzip
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipelines import storage
from tests.proxy import CutProxy

REPO = Path(__file__).resolve().parents[2]
CTX = Path(sys.executable).parent / "ctx"
KEY_ID, SECRET = "AKIAMARKERKEYID7777", "MARKERsecretKEY/9999+x"  # marker credentials, searched for afterwards


@pytest.fixture()
def fake_keys(monkeypatch) -> None:
    """Credentials for boto3 (moto takes any), not the session's: a test may run without s3_server."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def _as_from_a_terminal() -> None:
    """In the child, before exec: SIGINT and SIGTERM handled by default and not blocked, as a command
    typed at a terminal has them. Ignored and blocked signals are inherited across exec, and the
    pytest process may have either from what ran in it before (a library's handler set-up); a
    command started so would never see the signal the test sends."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def signal_state(pid: int) -> str:
    """The process's blocked, ignored and caught signal masks (/proc), for failure messages."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as e:
        return f"({e})"
    return ", ".join(line for line in lines if line.startswith(("SigBlk", "SigIgn", "SigCgt")))


class Command:
    """``ctx ARGS`` in a subprocess; every stderr line with the time it arrived."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, cwd: Path = REPO):
        self.started = time.monotonic()
        self.proc = subprocess.Popen([str(CTX), *args], cwd=cwd, env={**os.environ, **(env or {})}, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_as_from_a_terminal)
        self.lines: list[tuple[float, str]] = []
        self.stdout: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._out_reader = threading.Thread(target=lambda: self.stdout.extend(self.proc.stdout), daemon=True)
        self._out_reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, text: str, timeout: float) -> float:
        """The time the first stderr line with ``text`` arrived."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for t, line in list(self.lines):
                if text in line:
                    return t
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise AssertionError(f"no {text!r} on stderr within {timeout} s:\n{self.stderr}")

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._reader.join(5)
            self._out_reader.join(5)
        return self.proc.returncode

    @property
    def out(self) -> str:
        return "".join(self.stdout)

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)


def pretrain_args(endpoint: str, out: Path, deadline: float, input: str = "s3://corp/x/") -> list[str]:
    return ["pretrain", "--config", "configs/bert-tiny.yaml", "--no-progress", "--set", f"data.input={input}",
            "--set", f"data.endpoint_url={endpoint}", "--set", f"data.retry_deadline_s={deadline:g}", "--set", f"output_dir={out}"]


def leftovers(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir())


# ---- the driver's first listing, as issue 28 found it ---------------------------------------


def test_pretrain_against_a_closed_port_says_so_at_once_and_gives_up_at_the_recipes_deadline(closed_port, tmp_path):
    """``ctx pretrain`` with data.retry_deadline_s=5 and an endpoint that refuses every connection:
    its first retry line comes within 2 s of the command having read its recipe (measured by the same
    command failing on a bad recipe key), names the endpoint and where it is set; the command gives up
    5 s (within 10%) after it started waiting, with a StorageError naming the listing and the
    endpoint, exits non-zero, and leaves the run lock released and no temporary folder."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {"TMPDIR": str(temp)}
    baseline = Command([*pretrain_args(closed_port, tmp_path / "runs", 5), "--set", "data.no_such_key=1"], env)
    assert baseline.finish(60) == 2 and "data.no_such_key" in baseline.stderr
    recipe_read = max(t for t, _ in baseline.lines) - baseline.started  # interpreter, imports and the recipe

    cmd = Command(pretrain_args(closed_port, tmp_path / "runs", 5), env)
    first = cmd.wait_for("storage: stat s3://corp/x/", 30)
    assert first - cmd.started < recipe_read + 2, (first - cmd.started, recipe_read)
    assert (tmp_path / "runs" / "bert-tiny" / "LOCK.json").exists()  # waiting under the run lock
    gave_up = cmd.wait_for("ctx: error:", 30)
    assert cmd.finish(30) == 2
    assert 4.5 <= gave_up - first <= 5.5, gave_up - first

    said = cmd.stderr
    assert f"connection refused by {closed_port}, and nothing has been read from it yet" in said
    assert "data.endpoint_url" in said and "AWS_ENDPOINT_URL" in said and "retrying for up to 5 s more (data.retry_deadline_s=5)" in said
    assert f"ctx: error: stat s3://corp/x/ (endpoint {closed_port}): gave up after " in said and "(data.retry_deadline_s=5)" in said
    assert "Traceback" not in said
    assert not (tmp_path / "runs" / "bert-tiny" / "LOCK.json").exists() and leftovers(temp) == []


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_wait_ends_the_command_at_once_with_the_lock_released(closed_port, tmp_path, sig, status):
    temp = tmp_path / "tmp"
    temp.mkdir()
    cmd = Command(pretrain_args(closed_port, tmp_path / "runs", 120), {"TMPDIR": str(temp)})
    cmd.wait_for("storage: stat s3://corp/x/", 30)
    assert (tmp_path / "runs" / "bert-tiny" / "LOCK.json").exists() and len(leftovers(temp)) == 1  # the lock, the work folder
    time.sleep(0.5)  # well inside the wait
    sent = time.monotonic()
    state = signal_state(cmd.proc.pid)
    cmd.proc.send_signal(sig)
    assert cmd.finish(10) == status, f"the command's signals when {sig.name} was sent: {state}; stderr:\n{cmd.stderr}"
    assert time.monotonic() - sent < 5
    assert not (tmp_path / "runs" / "bert-tiny" / "LOCK.json").exists() and leftovers(temp) == []
    assert "Traceback" not in cmd.stderr
    if sig == signal.SIGINT:
        assert "ctx pretrain: interrupted" in cmd.stderr


def descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every process below ``pid`` (Ray's raylet and GCS, their workers)."""
    parent, cmd = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
    below, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, up in parent.items():
            if up == p and child not in below:
                below[child] = cmd.get(child, "")
                frontier.append(child)
    return below


def assert_gone_within(started: dict[int, str], seconds: float) -> None:
    """Every process in ``started`` (``descendants``' answer) has exited within ``seconds``."""
    end = time.monotonic() + seconds
    while (alive := [p for p in started if Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/cmdline").read_bytes()]) and time.monotonic() < end:
        time.sleep(0.5)
    assert alive == [], f"left running: {[started[p][:120] for p in alive]}"


@pytest.mark.slow
def test_sigterm_while_training_exits_143_with_the_lock_released_and_ray_gone(tmp_path):
    """SIGTERM once Ray Train runs (after ray.init, whose own SIGTERM handler ended the process with 15
    or 134 after Python's): status 143, the finally blocks ran (no LOCK.json), no process of its Ray
    left. (TMPDIR stays as it is: Ray's sockets under a pytest folder would pass the 107-byte limit.)"""
    cmd = Command(["pretrain", "--config", "configs/bert-tiny.yaml", "--no-progress", "--set", "train.max_steps=100000",
                   "--set", f"output_dir={tmp_path / 'runs'}"])
    end = time.monotonic() + 180
    while not any("RayTrainWorker" in c for c in descendants(cmd.proc.pid).values()):
        assert cmd.proc.poll() is None and time.monotonic() < end, f"no Ray Train worker started:\n{cmd.stderr}"
        time.sleep(0.5)
    time.sleep(2)  # training
    started = descendants(cmd.proc.pid)
    cmd.proc.send_signal(signal.SIGTERM)
    assert cmd.finish(30) == 143, cmd.stderr
    assert "Traceback" not in cmd.stderr
    assert not (tmp_path / "runs" / "bert-tiny" / "LOCK.json").exists()
    assert_gone_within(started, 15)


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.5, 1.0])
def test_sigterm_while_ray_starts_exits_143_and_leaves_no_process_of_its_ray(tmp_path, after_s):
    """SIGTERM while `ray.init` starts the local Ray (``after_s`` after its raylet appears): status
    143, and within 8 s no process of that Ray is left. Before ``jobs.session.init_ray`` stopped what
    it had started, the raylet died of SIGKILL and its DashboardAgent and RuntimeEnvAgent stayed a
    minute, reporting it to a GCS that was gone (4 of 6 such stops)."""
    cmd = Command(["pretrain", "--config", "configs/bert-tiny.yaml", "--no-progress", "--set", "data.input=data/sample/wordnet-0000-of-0008.txt.gz",
                   "--set", "tokenizer.sample_chars=100000", "--set", f"output_dir={tmp_path / 'runs'}"])
    end = time.monotonic() + 120
    while not any("raylet" in c for c in descendants(cmd.proc.pid).values()):
        assert cmd.proc.poll() is None and time.monotonic() < end, f"no raylet started:\n{cmd.stderr}"
        time.sleep(0.02)
    time.sleep(after_s)
    started = descendants(cmd.proc.pid)
    cmd.proc.send_signal(signal.SIGTERM)
    assert cmd.finish(30) == 143, cmd.stderr
    assert not (tmp_path / "runs" / "bert-tiny" / "LOCK.json").exists()
    assert_gone_within(started, 8)


def test_sigterm_whose_handler_runs_in_an_at_fork_hook_of_ray_init_still_ends_the_command():
    """ray.init starts Ray's processes with Popen; a SIGTERM whose handler runs in the parent's
    at-fork hooks raises SystemExit where Python drops it ("Exception ignored in: _releaseLock"),
    and the command went on to train. ``init_ray`` raises it once ray.init returns: status 143.
    The stand-in ``ray.init`` sets Ray's handler and forks once; an at-fork hook signals there."""
    script = f"""
import os, signal, subprocess, sys, types
sys.path.insert(0, {str(REPO)!r})
os.environ["RAY_ADDRESS"] = "stand-in"  # a cluster's: no local processes to stop
from jobs import session

state = {{"forking": False, "up": False}}

def ray_init(**options):
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # what ray.init sets for its call
    state["forking"] = True
    subprocess.run(["true"], preexec_fn=lambda: None)  # Ray starts its processes with a preexec_fn: at-fork hooks run
    state["forking"] = False
    state["up"] = True

def signal_after_fork():
    if state["forking"]:
        state["forking"] = False
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before this hook returns

os.register_at_fork(after_in_parent=signal_after_fork)
sys.modules["ray"] = types.SimpleNamespace(is_initialized=lambda: state["up"], init=ray_init)
session.init_ray(verbose=True)
print("went on", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143 and "went on" not in done.stdout, done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


def test_sigterm_that_lands_on_another_thread_ends_the_wait_for_ray_train():
    """The OS gives a process's SIGTERM to any of its threads; Python runs its handler in the main
    thread once that wakes. ``run_with_progress`` (no progress board, as with --no-progress) waits
    for the fit thread in timed joins, so SIGTERM sent to the fit thread itself still ends the
    command at once with 143. With one untimed join it waited until Ray Train returned."""
    script = f"""
import signal, sys, threading
sys.path.insert(0, {str(REPO)!r})
from jobs.session import exit_on_sigterm
from jobs.training.progress import FIT_THREAD, run_with_progress

exit_on_sigterm()

def to_the_fit_thread():
    fit = next(t for t in threading.enumerate() if t.name == FIT_THREAD)
    signal.pthread_kill(fit.ident, signal.SIGTERM)

threading.Timer(0.5, to_the_fit_thread).start()
run_with_progress(threading.Event().wait, board=None, max_steps=1, enabled=False)  # a fit that never returns
"""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143, done.stderr
    assert time.monotonic() - started < 20  # the import of ray and torch, then half a second


@pytest.mark.parametrize("waiting, ends, finalizes", [
    ("fit", "sigterm", False),  # the fit thread (jobs.training.progress.FIT_THREAD) still waits
    ("ray", "sigterm", False),  # connected to Ray: its threads may be inside its calls
    ("ray", "ctrl-c", False),
    ("ray", "status 1", True),  # not interrupted: Python exits as usual
])
def test_a_command_interrupted_inside_ray_exits_with_its_status_without_finalizing(waiting, ends, finalizes):
    """SIGTERM's SystemExit(143), or Ctrl-C's status 130, reaching ``jobs.cli.main`` while the fit
    thread still waits (here on an event, standing in for ``ray.get``) or while connected to Ray (a
    stand-in ``ray`` module): the status is the command's, the `finally` blocks and atexit handlers
    ran, and the process ended without finalizing Python (which, around a thread inside
    ``ray.get``, crashed with SIGSEGV in some stops): a ``__del__`` that finalization would run never
    prints. A command that ends otherwise finalizes as usual."""
    script = f"""
import atexit, sys, threading, types
sys.path.insert(0, {str(REPO)!r})
from jobs import cli

class Finalized:
    def __del__(self):
        print("finalized", flush=True)

keep = Finalized()

def command(args):
    if {waiting!r} == "fit":
        from jobs.training.progress import FIT_THREAD
        threading.Thread(target=threading.Event().wait, name=FIT_THREAD, daemon=True).start()
    else:
        sys.modules["ray"] = types.SimpleNamespace(is_initialized=lambda: True)
    atexit.register(print, "atexit ran", flush=True)
    try:
        if {ends!r} == "sigterm":
            raise SystemExit(143)  # what exit_on_sigterm's handler raises
        return 130 if {ends!r} == "ctrl-c" else 1  # ctrl-c: what _interrupted returns
    finally:
        print("finally ran", flush=True)

cli.build_parser = lambda: type("Parser", (), {{"parse_args": lambda self, argv: type("Args", (), {{"run": staticmethod(command)}})()}})()
sys.exit(cli.main([]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == {"sigterm": 143, "ctrl-c": 130, "status 1": 1}[ends], done.stderr
    assert done.stdout.splitlines() == ["finally ran", "atexit ran"] + ["finalized"] * finalizes, done.stdout + done.stderr


def test_pretrain_in_process_says_so_within_2_s_and_gives_up_at_the_deadline(closed_port, tmp_path, monkeypatch):
    """The same wait timed inside the process: from calling ``pretrain`` to the first line, and to
    the StorageError."""
    from jobs.training.config import load_recipe
    from jobs.training.train import pretrain

    said: list[tuple[float, str]] = []
    monkeypatch.setattr(storage, "_say", lambda line: said.append((time.monotonic(), line)))
    recipe = load_recipe(REPO / "configs" / "bert-tiny.yaml", ["data.input=s3://corp/x/", f"data.endpoint_url={closed_port}",
                                                              "data.retry_deadline_s=5", f"output_dir={tmp_path}"])
    t0 = time.monotonic()
    with pytest.raises(storage.StorageError, match=rf"^stat s3://corp/x/ \(endpoint {closed_port}\): gave up after \d+ attempts in 5 s"):
        pretrain(recipe, progress=False, log=lambda *_: None)
    assert said and said[0][0] - t0 < 2
    assert 4.5 <= time.monotonic() - t0 <= 5.5
    assert not (tmp_path / "bert-tiny" / "LOCK.json").exists()


# ---- commands without a recipe: --retry-deadline --------------------------------------------


FLAG_COMMANDS = {
    "report": (["report", "s3://corp/runs/r"], "stat s3://corp/runs/r"),
    "export": (["export", "--model", "s3://corp/runs/r", "--format", "hf", "--output", "{out}"], "stat s3://corp/runs/r"),
    "eval": (["eval", "--model", "s3://corp/runs/r", "--data", "s3://corp/d.jsonl"], "stat s3://corp/runs/r"),
    "models register": (["models", "register", "x", "s3://corp/runs/r/checkpoint_1"], "stat s3://corp/runs/r/checkpoint_1/tokenizer"),
    "embed": (["embed", "--model", "s3://corp/runs/r", "--input", "s3://corp/texts/", "--output", "s3://corp/vectors/"],
              "stat s3://corp/vectors/"),
    "tokenizer train": (["tokenizer", "train", "--kind", "wordpiece", "--input", "s3://corp/x/", "--vocab-size", "100",
                         "--output", "{out}"], "stat s3://corp/x/"),
}


@pytest.mark.parametrize("name", FLAG_COMMANDS)
def test_commands_without_a_recipe_wait_as_long_as_retry_deadline_says(name, closed_port, tmp_path):
    """The error comes at 2 s: its "in 2 s" is measured where it is raised. The line that prints it
    comes seconds later for commands that import no torch before (report, models register): ctx
    imports its error types, torch among them, only once one was raised (jobs.cli._user_errors)."""
    args, what = FLAG_COMMANDS[name]
    args = [a.format(out=tmp_path / "out") for a in args]
    cmd = Command([*args, "--endpoint-url", closed_port, "--retry-deadline", "2"], {"TMPDIR": str(tmp_path)})
    first = cmd.wait_for(f"storage: {what}", 60)
    gave_up = cmd.wait_for("ctx: error:", 30)
    assert cmd.finish(30) == 2
    assert 1.8 <= gave_up - first <= 2 + 10, gave_up - first
    assert f"ctx: error: {what} (endpoint {closed_port}): gave up after " in cmd.stderr
    assert " attempts in 2 s (--retry-deadline=2)" in cmd.stderr
    assert "Traceback" not in cmd.stderr and leftovers(tmp_path) == []


# ---- an outage mid-command: moto behind a proxy that cuts the network ------------------------


@pytest.fixture()
def corpus_in_s3(s3_server, s3_bucket) -> str:
    import boto3

    lines = [x.strip() for x in gzip.open(REPO / "data/sample/wordnet-0000-of-0008.txt.gz", "rt") if x.strip()]
    s3 = boto3.client("s3", endpoint_url=s3_server)
    for i in range(3):
        s3.put_object(Bucket=s3_bucket, Key=f"corpus/part-{i}.txt", Body="\n".join(lines[i * 400:(i + 1) * 400]).encode())
    return f"s3://{s3_bucket}/corpus/"


def test_an_outage_mid_command_is_waited_out_and_said_and_one_past_the_deadline_is_an_error(s3_server, s3_bucket, corpus_in_s3,
                                                                                             monkeypatch, capsys):
    """`ctx tokenizer train` reading from moto through the proxy: the network goes away for 3 s once
    some bytes went through; the command says so, says when the store is back, and finishes. With the
    network gone for good and --retry-deadline 2, it fails with the operation and the endpoint."""
    from jobs import cli

    monkeypatch.setattr(cli, "_exit_on_sigterm", lambda: None)  # keep pytest's own handler
    with CutProxy(int(s3_server.rsplit(":", 1)[1])) as proxy:
        proxy.cut_after(30_000, 3)  # into the shard reads (3 x ~21 KB), after the listing
        args = ["tokenizer", "train", "--kind", "wordpiece", "--input", corpus_in_s3, "--vocab-size", "300",
                "--endpoint-url", proxy.url, "--output", f"s3://{s3_bucket}/tok"]
        assert cli.main([*args, "--retry-deadline", "30"]) == 0
        err = capsys.readouterr().err
        assert proxy.cuts and proxy.refused > 0, "the network never went away"
        assert f"(endpoint {proxy.url}) failed: " in err and f"(endpoint {proxy.url}) succeeded after " in err, err
        assert "nothing has been read from it yet" not in err  # an outage, not a wrong address
        assert storage.Store(s3_server).exists(f"s3://{s3_bucket}/tok/vocab.txt")

        proxy.cut(3600)
        assert cli.main([*args, "--retry-deadline", "2"]) == 2
        err = capsys.readouterr().err
    assert f"(endpoint {proxy.url}): gave up after " in err and "(--retry-deadline=2)" in err, err


# ---- the run lock on S3 ----------------------------------------------------------------------


def test_taking_the_run_lock_on_s3_waits_until_the_deadline_and_names_the_lock(closed_port, sleeps, fake_keys, capsys):
    from jobs.runlock import RunLock

    with pytest.raises(storage.StorageError, match=rf"write s3://corp/runs/r/LOCK.json \(endpoint {closed_port}\): "
                                                   rf"gave up after \d+ attempts in 4 s \(data.retry_deadline_s=4\)"):
        RunLock("s3://corp/runs/r", storage.Store(closed_port, 4)).acquire()
    assert sum(sleeps) == pytest.approx(4)
    assert "storage: write s3://corp/runs/r/LOCK.json: connection refused by" in capsys.readouterr().err


def test_releasing_the_run_lock_during_an_outage_waits_briefly_and_says_what_happens_next(s3_server, s3_bucket, closed_port, sleeps, capsys):
    from jobs.runlock import RELEASE_WAIT_S, RunLock

    lock = RunLock(f"s3://{s3_bucket}/runs/r", storage.Store(s3_server, 300)).acquire()
    lock.backend.client = storage.s3_client(closed_port)  # the store goes away
    lock.release()
    assert sum(sleeps) == pytest.approx(RELEASE_WAIT_S)  # not the run's 300 s
    err = capsys.readouterr().err
    assert "could not remove the run lock" in err and "the next run then takes it over" in err


# ---- credentials -----------------------------------------------------------------------------


def everything_written(texts: list[str], folders: list[Path], bucket: str | None = None, s3_server: str | None = None) -> str:
    parts = list(texts)
    for folder in folders:
        for p in sorted(folder.rglob("*")):
            if p.is_file() and not p.is_symlink():
                parts.append(str(p))
                parts.append(p.read_bytes().decode("latin-1"))
    if bucket:
        import boto3

        s3 = boto3.client("s3", endpoint_url=s3_server)
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                parts.append(obj["Key"])
                parts.append(s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read().decode("latin-1"))
    return "\n".join(parts)


def assert_no_credentials(text: str) -> None:
    for marker in (KEY_ID, SECRET, SECRET.split("/")[0]):
        assert marker not in text, f"{marker!r} was written: ...{text[max(0, text.find(marker) - 300):text.find(marker) + 100]}..."


def test_marker_credentials_appear_nowhere_a_failed_or_a_finished_command_wrote(s3_server, s3_bucket, corpus_in_s3, closed_port, tmp_path):
    """A failed run (a refused endpoint, the run folder local and on S3) and a finished command
    (`ctx tokenizer train` from and to moto) with marker values in AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY: neither value is in stdout, stderr, the run folders, the temporary
    folders or the bucket. (The slow test below does the same for a whole pretraining run.)"""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "TMPDIR": str(temp)}
    texts = []
    for out in (tmp_path / "runs", "s3://corp/runs"):
        failed = Command(pretrain_args(closed_port, out, 2), env)
        assert failed.finish(60) == 2
        texts += [failed.out, failed.stderr]
    finished = Command(["tokenizer", "train", "--kind", "wordpiece", "--input", corpus_in_s3, "--vocab-size", "300",
                        "--output", f"s3://{s3_bucket}/tok", "--endpoint-url", s3_server], env)
    assert finished.finish(120) == 0, finished.stderr
    texts += [finished.out, finished.stderr]
    assert "gave up after" in texts[1] and "gave up after" in texts[3] and "wordpiece tokenizer" in texts[4]
    assert_no_credentials(everything_written(texts, [tmp_path], s3_bucket, s3_server))


@pytest.mark.slow
def test_marker_credentials_appear_nowhere_a_finished_pretraining_run_wrote(s3_server, s3_bucket, corpus_in_s3, tmp_path):
    """A whole `ctx pretrain` on moto (run folder, checkpoints, metrics, data reports and the lock on
    S3; the model registered in MLflow) with marker credentials: not in its output, its bucket, the
    registry's database or the logs of the Ray it started."""
    import tempfile

    ray_tmp = Path(tempfile.mkdtemp(prefix="ctx28-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    try:
        env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": s3_server, "TMPDIR": str(ray_tmp),
               "RAY_TMPDIR": str(ray_tmp), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "RAY_ADDRESS": ""}
        args = ["pretrain", "--config", "configs/bert-tiny.yaml", "--no-progress", "--set", f"data.input={corpus_in_s3}",
                "--set", f"output_dir=s3://{s3_bucket}/runs", "--set", "name=markers", "--set", "data.eval_input=null",
                "--set", "tokenizer.vocab_size=500", "--set", "data.seq_len=32", "--set", "model.max_seq_len=32",
                "--set", "train.batch_size=8", "--set", "train.micro_batch_size=8", "--set", "train.max_steps=3",
                "--set", "train.warmup_steps=1", "--set", "train.log_every=1", "--set", "train.checkpoint_every=3",
                "--set", "scaling.num_workers=1", "--set", "scaling.cpus_per_worker=0.5", "--set", "data.retry_deadline_s=30"]
        run = Command(args, env)
        assert run.finish(300) == 0, run.stderr
        assert "registry: markers/" in run.out + run.stderr
        # the run stops before its stream does, so Ray Data kills its tokenizing actor with work queued:
        # Ray's "(raylet) Task MapWorker(...) failed. There are infinite retries remaining" stays off the console
        assert "(raylet)" not in run.out + run.stderr, run.out + run.stderr
        written = everything_written([run.out, run.stderr], [tmp_path, ray_tmp], s3_bucket, s3_server)
        assert "runs/markers/checkpoint_" in written and "/logs/" in written and "mlflow.db" in written  # it searched them all
        assert_no_credentials(written)
    finally:
        import shutil

        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_the_registry_keeps_an_endpoint_without_its_password():
    from jobs.training.tracking import _shown

    assert _shown("data.endpoint_url", "http://AKIAMARKER:secret@store:9000") == "http://store:9000"
    assert _shown("data.endpoint_url", "None") == "None" and _shown("name", "a:b@c") == "a:b@c"
