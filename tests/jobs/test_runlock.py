"""One writer per run folder: the lock object (jobs/runlock.py) on a local folder and on a real S3
endpoint (moto on loopback, conditional writes), in-process; and a real `ctx pretrain` refused
at once while another holder has the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import boto3
import pytest

from jobs.runlock import LOCK_FILE, RunLock, RunLockHeld
from tests.conftest import REPO


class Clock:
    """A wall clock the test moves: ages a lock without waiting for it."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["local", "s3"])
def run_uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "runs" / "r1")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/runs/r1"


def read_lock(run_uri: str) -> dict | None:
    if run_uri.startswith("s3://"):
        bucket, _, prefix = run_uri[len("s3://"):].partition("/")
        try:
            return json.loads(boto3.client("s3").get_object(Bucket=bucket, Key=f"{prefix}/{LOCK_FILE}")["Body"].read())
        except boto3.client("s3").exceptions.NoSuchKey:
            return None
    path = os.path.join(run_uri, LOCK_FILE)
    return json.loads(open(path).read()) if os.path.exists(path) else None


def test_second_holder_fails_at_once_naming_the_first_then_gets_it_after_release(run_uri):
    first = RunLock(run_uri, command="ctx pretrain (a)").acquire()
    try:
        held = read_lock(run_uri)
        assert held["pid"] == os.getpid() and held["command"] == "ctx pretrain (a)"
        t0 = time.monotonic()
        with pytest.raises(RunLockHeld) as e:
            RunLock(run_uri, command="ctx pretrain (b)").acquire()
        assert time.monotonic() - t0 < 5
        message = str(e.value)
        assert "ctx pretrain (a)" in message and f"pid {os.getpid()}" in message and "Wait for it to finish" in message
    finally:
        first.release()
    assert read_lock(run_uri) is None  # released: the folder is free again
    with RunLock(run_uri, command="ctx pretrain (b)"):
        assert read_lock(run_uri)["command"] == "ctx pretrain (b)"
    assert read_lock(run_uri) is None


def test_released_when_the_run_fails(run_uri):
    with pytest.raises(ZeroDivisionError):
        with RunLock(run_uri):
            1 / 0
    assert read_lock(run_uri) is None


def test_heartbeat_keeps_a_live_lock_fresh(run_uri):
    clock = Clock()
    with RunLock(run_uri, heartbeat_s=0.05, stale_after_s=60, clock=clock):
        started = read_lock(run_uri)["heartbeat"]
        clock.t += 100  # the holder is alive and beating: its heartbeat follows the clock
        deadline = time.monotonic() + 10
        while read_lock(run_uri)["heartbeat"] == started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_lock(run_uri)["heartbeat"] == clock.t
        with pytest.raises(RunLockHeld):  # 100 s after it was taken, but beating: not stale
            RunLock(run_uri, stale_after_s=60, clock=clock).acquire()


def test_a_stale_lock_is_taken_over_and_the_old_holder_finds_out(run_uri, capsys):
    old_clock, new_clock = Clock(), Clock()
    dead = RunLock(run_uri, heartbeat_s=30, stale_after_s=60, clock=old_clock).acquire()
    dead._stop.set()  # a driver that died: its heartbeat stopped
    dead._thread.join()
    new_clock.t = old_clock.t + 61
    taker = RunLock(run_uri, heartbeat_s=30, stale_after_s=60, clock=new_clock).acquire()
    try:
        assert read_lock(run_uri)["owner"] == taker.info.owner
        assert "took over the stale run lock" in capsys.readouterr().err
        # The old holder's next heartbeat is conditional on its own version: it loses, and its
        # release leaves the new holder's lock alone.
        dead._stop.clear()
        dead.heartbeat_s = 0.01
        beat = threading.Thread(target=dead._beat, daemon=True)
        beat.start()
        beat.join(timeout=10)
        assert dead.lost
        dead.release()
        assert read_lock(run_uri)["owner"] == taker.info.owner
    finally:
        taker.release()
    assert read_lock(run_uri) is None


def test_of_racing_takers_exactly_one_wins(tmp_path):
    """Eight threads take one local lock at once (an exclusive create each): one holds it."""
    run = str(tmp_path / "race")
    barrier = threading.Barrier(8)
    won, refused = [], []

    def take():
        lock = RunLock(run)
        barrier.wait()
        try:
            won.append(lock.acquire())
        except RunLockHeld:
            refused.append(lock)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7
    won[0].release()


def test_a_missing_bucket_is_a_storage_error_naming_the_lock(s3_server):
    from pipelines.storage import StorageError

    with pytest.raises(StorageError, match="run lock: cannot write s3://no-such-bucket-x/runs/r/LOCK.json"):
        RunLock("s3://no-such-bucket-x/runs/r").acquire()


def test_an_unreadable_lock_is_never_taken_over(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / LOCK_FILE).write_text("not json")
    with pytest.raises(RunLockHeld, match="delete that file"):
        RunLock(str(run), clock=Clock(10**12)).acquire()


@pytest.mark.parametrize("command, config, name", [
    ("pretrain", "configs/bert-tiny.yaml", "bert-tiny"),
    ("finetune", "configs/finetune/tiny-pairs.yaml", "tiny-pairs"),
])
def test_ctx_training_on_a_held_run_fails_before_starting_ray(tmp_path, command, config, name):
    """A real second `ctx pretrain` / `ctx finetune` process on an output another driver holds:
    exit 2 within seconds (no Ray start, no model read), the message naming the holder; the lock
    is left to its holder. (A job holding the run is tested in test_submit.py.)"""
    out = tmp_path / "out"
    holder = RunLock(str(out / name), command=f"ctx {command} ({name})").acquire()
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "jobs.cli", command, "--config", config, "--set", f"output_dir={out}", "--no-progress"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )
        took = time.monotonic() - t0
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"in use by ctx {command} ({name})" in proc.stderr and f"pid {os.getpid()}" in proc.stderr
        assert took < 60, took  # an import-and-refuse, not a training run
        assert read_lock(str(out / name))["owner"] == holder.info.owner
    finally:
        holder.release()
