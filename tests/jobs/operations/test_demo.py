"""`ctx demo` (issue 27) as a newcomer runs it, on tiny settings, in a fresh process: every step's
line (pretraining, the fine-tuned accuracy beside the baselines, the registry, a /v1/classify and a
/v1/embeddings answer with their registry version header, the scheduled round's gate decision), no
Ray or library log lines, and afterwards no process it started and nothing in its temporary folder;
the same after Ctrl-C in the middle of pretraining (`make test`) and, in `make test-all`, after Ctrl-C in the
middle of fine-tuning and SIGTERM in the middle of pretraining.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.jobs.serving.test_serve_stop import _alive, _all_pids, _cmdline, _started_by
from tests.jobs.test_storage_waits import _as_from_a_terminal

pytestmark = pytest.mark.slow

CTX = Path(sys.executable).parent / "ctx"
# Every step, a few steps and rows each: about 2 minutes on 2 cores.
TINY = ["--steps", "10", "--finetune-steps", "20", "--train-rows", "400", "--new-rows", "64", "--test-rows", "100", "--probes", "40"]
STEP = re.compile(r"^(ctx demo: |\d\. |   |done in )")  # the demo's own lines; anything else is noise


class Demo:
    """``ctx demo`` in a subprocess, started as from a terminal, with its own short TMPDIR (Ray's
    socket paths must stay short); watches which processes it starts while it runs."""

    def __init__(self, cwd: Path):
        self.tmp = Path(tempfile.mkdtemp(prefix="cd-", dir="/tmp"))
        env = {**os.environ, "TMPDIR": str(self.tmp), "RAY_ADDRESS": "", "PYTHONUNBUFFERED": "1"}
        env.pop("MLFLOW_TRACKING_URI", None)
        self.proc = subprocess.Popen([str(CTX), "demo", *TINY, "--port", str(free_port())], cwd=cwd, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_as_from_a_terminal)
        self.lines: list[str] = []
        self.err: list[str] = []
        self.started: dict[int, tuple[int, str]] = {}
        self._done = threading.Event()
        self._threads = [threading.Thread(target=lambda: self.lines.extend(x.rstrip("\n") for x in self.proc.stdout), daemon=True),
                         threading.Thread(target=lambda: self.err.extend(x.rstrip("\n") for x in self.proc.stderr), daemon=True),
                         threading.Thread(target=self._watch, daemon=True)]
        for t in self._threads:
            t.start()

    def _watch(self) -> None:
        while not self._done.is_set():
            self.started.update(_started_by(self.proc.pid, str(self.tmp)))
            self._done.wait(1.0)

    def wait_for_line(self, prefix: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(line.startswith(prefix) for line in self.lines):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no line {prefix!r} within {timeout} s:\n{self.output}")

    def wait_for_process(self, name: str, timeout: float) -> None:
        """Until a process the demo started has ``name`` in its command line (Ray names actors' processes)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            if any(name in cmd for _, cmd in self.started.values()):
                return
            time.sleep(0.2)
        raise AssertionError(f"no process {name!r} of the demo within {timeout} s:\n{self.output}")

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        finally:
            self._done.set()
            if self.proc.poll() is None:
                self.proc.kill()
            for t in self._threads:
                t.join(10)
        return self.proc.returncode

    @property
    def output(self) -> str:
        return "\n".join(self.lines) + "\n--- stderr ---\n" + "\n".join(self.err)

    def line(self, prefix: str) -> str:
        found = [x for x in self.lines if x.lstrip().startswith(prefix)]
        assert found, f"no line starting {prefix!r}:\n{self.output}"
        return found[0]

    def assert_nothing_left(self) -> None:
        """No process it started (descendants, its process group, anything naming its TMPDIR) within
        30 s, nothing in its TMPDIR, no Ray session folder of its pid under /tmp/ray."""
        deadline = time.monotonic() + 30
        while True:
            left = {pid: cmd for pid, (t, cmd) in self.started.items() if _alive(pid, t)}
            left |= {pid: _cmdline(pid) for pid in _all_pids() if str(self.tmp) in _cmdline(pid)}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(1)
        for pid in left:  # tidy up before failing: these are processes this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert not left, f"left behind: {[c[:160] for c in left.values()]}"
        assert self.started, "the watcher saw no process of the demo (Ray's raylet at least)"
        leftover = sorted(p.name for p in self.tmp.iterdir())
        shutil.rmtree(self.tmp, ignore_errors=True)
        assert leftover == [], f"left in its TMPDIR: {leftover}"
        sessions = [p.name for p in Path("/tmp/ray").glob(f"session_*_{self.proc.pid}")] if Path("/tmp/ray").is_dir() else []
        assert sessions == [], f"a Ray session folder under /tmp/ray: {sessions}"


# make test-all: two minutes of the suite's budget; each step's behaviour has a cheaper test in make test
# (test_tracking: pretrain, register, promote, fine-tune, serve; test_schedule_e2e: a round and its gate),
# and the Ctrl-C case below keeps the demo's own start, signal handling and cleanup there.
@pytest.mark.extended
def test_the_demo_runs_every_step_and_leaves_nothing_behind(tmp_path):
    demo = Demo(tmp_path)
    rc = demo.finish(420)
    assert rc == 0, demo.output
    noise = [x for x in demo.lines if not STEP.match(x)] + demo.err
    assert noise == [], f"lines that are not the demo's:\n{noise}\n{demo.output}"

    assert "bert/tiny, 10 steps on 2 Ray Train workers" in demo.line("1. tokenizer + pretraining")
    assert "report page runs/demo-report/index.html" in demo.line("2. held-out masked-token accuracy")
    assert (tmp_path / "runs/demo-report/index.html").is_file()  # the one thing that stays, under the working directory
    assert "20 steps" in demo.line("3. fine-tuning: all-MiniLM-L6-v2")
    m = re.search(r"on 100 lexname test records: fine-tuned ([\d.]+)% .* majority class ([\d.]+)%", demo.line("4. held-out accuracy"))
    assert m, demo.output
    assert float(m.group(1)) > float(m.group(2)), demo.line("4.")  # learnt beyond the majority class in 20 steps
    assert "TF-IDF + logistic regression" in demo.line("4.")
    assert "minilm-lexname@production -> minilm-lexname/1" in demo.line("5. registry: minilm-lexname/1 registered")
    assert "models:/minilm-lexname@production = minilm-lexname/1" in demo.line("6. serving on http://127.0.0.1:")
    assert re.search(r"cosine of 'bank' .* = 0\.\d+", demo.line("bert-tiny /v1/token-embeddings"))
    assert re.search(r"-> (noun|verb|adj|adv)\.\w+ \(\d\.\d\d\); X-Registry-Version: minilm-lexname/1$", demo.line("lexname /v1/classify"))
    assert re.search(r"2 vectors of 384 dims; X-Registry-Version: minilm-lexname/1$", demo.line("lexname /v1/embeddings"))
    assert "64 records landed in" in demo.line("7. scheduled round")
    assert re.search(r"accuracy [\d.]+ \(production [\d.]+\), f1 .*cka", demo.line("on the same held-out records"))
    gates = [x for x in demo.lines if x.lstrip().startswith("gate ")]
    assert [re.match(r"\s+gate (passed|FAILED): (\w+):", g).group(2) for g in gates] == ["accuracy", "f1", "cka"], gates
    decision = demo.line("decision: ")
    if all("gate passed" in g for g in gates):
        assert "decision: promoted: minilm-lexname@production -> minilm-lexname/2" in decision
    else:
        assert "decision: refused (gated): minilm-lexname@production stays minilm-lexname/1" in decision
    assert demo.lines[-1].startswith("done in ")
    demo.assert_nothing_left()


@pytest.mark.parametrize("sig, status, after, wait_s, inside", [
    (signal.SIGINT, 130, "ctx demo: ", "RayTrainWorker", "1. "),  # Ctrl-C while pretraining, once Ray Train's worker runs
    # extended: the same cleanup, later in the demo (a fine-tuning worker) or by `kill` (a pod's shutdown)
    pytest.param(signal.SIGINT, 130, "2. held-out masked-token accuracy", 8, "3. ", marks=pytest.mark.extended),
    pytest.param(signal.SIGTERM, 143, "ctx demo: ", 20, "1. ", marks=pytest.mark.extended),
], ids=["ctrl-c-pretraining", "ctrl-c-fine-tuning", "sigterm-pretraining"])
def test_a_signal_mid_run_exits_at_once_and_leaves_nothing_behind(tmp_path, sig, status, after, wait_s, inside):
    """``wait_s``: seconds after the line ``after``, or the name of a process of the demo's to wait for."""
    demo = Demo(tmp_path)
    demo.wait_for_line(after, 240)
    if isinstance(wait_s, str):
        demo.wait_for_process(wait_s, 240)
    else:
        time.sleep(wait_s)
    assert demo.proc.poll() is None and not any(x.startswith(inside) for x in demo.lines), demo.output  # that step still runs
    demo.proc.send_signal(sig)
    sent = time.monotonic()
    rc = demo.finish(60)
    took = time.monotonic() - sent
    assert rc == status, demo.output
    assert took < 10, f"exited {took:.1f} s after {sig.name}"
    if sig == signal.SIGINT:
        assert demo.err[-1] == "ctx demo: interrupted", demo.output
    demo.assert_nothing_left()
