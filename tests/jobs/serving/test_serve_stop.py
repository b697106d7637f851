"""Stopping `ctx serve` the way a script and Kubernetes do: it runs in the background of a shell
(`ctx serve ... &`, so it inherits SIGINT ignored) and gets SIGTERM while requests are in flight,
or SIGINT. The requests complete, and no process of the Ray it started is left: every process that
descended from it, shared its process group or names its private Ray temp folder is gone.
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

import httpx
import pytest
import yaml

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.slow


def _stat(pid: int) -> tuple[int, int, int, str] | None:
    """(ppid, pgid, start time, state) from /proc/<pid>/stat, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), int(fields[2]), int(fields[19]), fields[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _started_by(root: int, marker: str) -> dict[int, tuple[int, str]]:
    """{pid: (start time, cmdline)} of the processes `root` started: its descendants, its process group
    (Ray makes the driver a group leader) and any naming `marker` (its private Ray temp folder)."""
    stats = {pid: s for pid in _all_pids() if (s := _stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            if child not in found:
                found.add(child)
                todo.append(child)
    found |= {pid for pid, (_, pgid, _, _) in stats.items() if pgid == root and pid != root}
    found |= {pid for pid in stats if marker in _cmdline(pid)}
    return {pid: (stats[pid][2], _cmdline(pid)) for pid in found if pid in stats}


def _alive(pid: int, start_time: int) -> bool:
    s = _stat(pid)
    return s is not None and s[2] == start_time and s[3] != "Z"  # same process (no pid reuse), not a zombie


def _start_in_background(config: dict, tmp_path: Path) -> tuple[int, Path, str]:
    """`ctx serve --config` started by a non-interactive shell with `&`, as a script would; returns
    (its pid, its log, its private Ray temp folder)."""
    ray_tmp = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    log = tmp_path / "serve.log"
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "PYTHONPATH": str(REPO)}
    cmd = f"'{sys.executable}' -m jobs.cli serve --config '{tmp_path / 'serve.yaml'}' --address local > '{log}' 2>&1 & echo $!"
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, cwd=REPO, check=True)
    return int(out.stdout.strip()), log, ray_tmp


def _wait_ready(url: str, pid: int, log: Path, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _stat(pid) is None:
            pytest.fail(f"ctx serve exited before it was ready:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail(f"ctx serve not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


def _wait_gone(pid: int, start_time: int, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pid, start_time):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"ctx serve still running {timeout_s} s after the signal:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def _assert_nothing_left(started: dict[int, tuple[int, str]], ray_tmp: str, log: Path) -> None:
    deadline = time.monotonic() + 30  # agents notice their raylet is gone within a few seconds
    while True:
        left = {pid: cmd for pid, (t, cmd) in started.items() if _alive(pid, t)}
        left |= {pid: _cmdline(pid) for pid in _all_pids() if ray_tmp in _cmdline(pid)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1)
    for pid in left:  # tidy up before failing: these are processes this test started
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"left behind: {[c[:120] for c in left.values()]}\n{log.read_text()[-2000:]}"


def test_sigterm_drains_in_flight_requests_and_leaves_no_ray_process(tmp_path, minilm_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = {"port": port, "models": {"minilm": str(minilm_dir)}, "defaults": {"num_cpus": 0.5, "max_batch_size": 16}}
    pid, log, ray_tmp = _start_in_background(config, tmp_path)
    start_time = _stat(pid)[2]
    _wait_ready(url, pid, log)
    started = _started_by(pid, ray_tmp)
    cmdlines = " ".join(cmd for _, cmd in started.values())
    assert "raylet" in cmdlines and "gcs_server" in cmdlines, cmdlines[:2000]  # we did find its Ray
    # requests reach the replica through Serve's HAProxy ingress, whose files sit in a folder of this run's own
    haproxy = [cmd for _, cmd in started.values() if cmd.split(" ")[0].endswith("/haproxy")]  # two while one reloads
    assert haproxy, cmdlines[:2000]
    haproxy_files = Path(re.search(r" -f (\S+)/[0-9a-f]+/haproxy\.cfg", haproxy[0]).group(1))
    assert haproxy_files.name.startswith("ctx-hap-"), haproxy

    texts = [f"request {i}: the bank by the river approved a loan for the new boat house" for i in range(200)]
    results: list[tuple[int, int, float]] = []

    def one() -> None:
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": texts}, timeout=300)
        n = len(r.json()["data"]) if r.status_code == 200 else -1
        results.append((r.status_code, n, time.monotonic()))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # 800 texts take MiniLM several seconds on two cores: these are in flight
    signalled = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    for t in threads:
        t.join(300)
    assert [(status, n) for status, n, _ in results] == [(200, 200)] * 4, results
    assert any(done > signalled for _, _, done in results), "no request was still in flight at SIGTERM"

    _wait_gone(pid, start_time, log)
    assert "draining" in log.read_text()
    _assert_nothing_left(started, ray_tmp, log)
    assert not haproxy_files.exists()
    shutil.rmtree(ray_tmp, ignore_errors=True)  # its Ray's logs: kept only when the test fails


def test_sigint_stops_a_background_ctx_serve_too(tmp_path, minilm_dir):
    """A shell's background job ignores SIGINT unless the program installs its own handler."""
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model

    config_, model = build_model("bert", "tiny", {"vocab_size": 30522})
    ckpt = save_checkpoint(tmp_path / "checkpoint_000001", model, "bert", config_, tokenizer_dir=minilm_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    pid, log, ray_tmp = _start_in_background({"port": port, "models": {"tiny": str(ckpt)}, "defaults": {"num_cpus": 0.5}}, tmp_path)
    start_time = _stat(pid)[2]
    _wait_ready(url, pid, log)
    started = _started_by(pid, ray_tmp)
    assert httpx.post(f"{url}/v1/embeddings", json={"model": "tiny", "input": "x"}, timeout=60).status_code == 200
    os.kill(pid, signal.SIGINT)
    _wait_gone(pid, start_time, log)
    assert "SIGINT" in log.read_text()
    _assert_nothing_left(started, ray_tmp, log)
    shutil.rmtree(ray_tmp, ignore_errors=True)
