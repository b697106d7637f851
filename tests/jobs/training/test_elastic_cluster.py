"""Elastic training on a live multi-node Ray cluster: a node joins mid-run and the run grows from
1 to 2 workers; a node dies mid-run and it shrinks back to 1; it finishes, and every sample of
every closed epoch was trained on exactly once with its mask (docs/EXACTLY_ONCE.md, "Elastic on a
live cluster").

The cluster and its driver run in a process of their own (``tests/jobs/training/live_cluster.py``): a
cluster of separate node processes cannot share this process with the suite's in-process Ray
session (``ray_session``), whichever test started it first.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from itertools import groupby
from pathlib import Path

import pytest

from tests.jobs.training.exactly_once import (
    RECIPE, REPO, assert_epoch_exactly_once, attempts, committed, overrides, recipe, state, write_corpus,
)

pytestmark = pytest.mark.slow

MAX_STEPS = 200  # 2.5 epochs of 80 steps
ELASTIC = [
    "scaling.num_workers=[1, 2]", "scaling.cpus_per_worker=1", "scaling.resources_per_worker={ctx_trainer: 1}",
    "scaling.resize_interval_s=2", "scaling.max_failures=3", "train.checkpoint_every=5",
    f"train.max_steps={MAX_STEPS}", "data.max_epochs=4",
    # A wider, deeper model than the other exactly-once runs': their steps (~20 a second on 2 cores)
    # finished all 200 before Ray Train had grown the group onto the new node, so the run never grew.
    # Growing takes Ray Train some 35 s here; d_model 128 x 4 layers still finished first on an idle
    # machine (two runs of the fourteenth session); this size left 65 steps to spare.
    "model.d_model=192", "model.n_layer=8", "model.d_ff=768",
]


def run_cluster_scenario(spec: dict, workdir: Path, timeout: float) -> str:
    """``python -m tests.jobs.training.live_cluster`` with its own ``RAY_TMPDIR``; its output, stopped by
    PID (SIGTERM: the cluster's nodes stop with it) if it overruns."""
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    ray_tmp = tempfile.mkdtemp(prefix="ctx-el-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {
        **os.environ,
        "RAY_TMPDIR": ray_tmp,
        # A group restarted on a stale view of the cluster (a node just died) waits this long for
        # its placement group before Ray Train asks again (default 60 s).
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }
    log = workdir / "cluster.log"
    try:
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "tests.jobs.training.live_cluster", str(spec_path)], cwd=REPO, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # the group this test started, nothing else
                    proc.wait()
                rc = f"timed out after {timeout:.0f}s"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    text = log.read_text()
    assert rc == 0, f"cluster scenario: {rc}\n{text[-6000:]}"
    return text


@pytest.mark.extended  # make test-all
def test_run_grows_and_shrinks_with_the_cluster_and_trains_each_sample_once(tmp_path):
    corpus = write_corpus(Path(tempfile.mkdtemp(dir=tmp_path)))
    rec = recipe(corpus, tmp_path, *ELASTIC)
    run = tmp_path / "once"
    out = run_cluster_scenario({
        "recipe": str(RECIPE), "overrides": overrides(corpus, tmp_path, *ELASTIC),
        "out": str(tmp_path), "grow_after": 2,
    }, tmp_path, timeout=780)
    report = json.loads((tmp_path / "events.json").read_text())
    assert "error" not in report, f"{report['error']}\n{out[-6000:]}"
    assert [e["event"] for e in report["events"]] == ["add_node", "remove_node"], (report, out[-6000:])
    assert report["metrics"]["step"] == MAX_STEPS and report["metrics"]["workers"] == 1

    # Attempts (one per worker-group start that trained), in order of the step each resumed from:
    # 1 worker, then 2 on the joined node, then 1 after the node died. Each attempt resumed from a
    # checkpoint of its own, which is what the committed-lines bookkeeping relies on.
    by_start = attempts(run)
    worlds = []
    for start in sorted(by_start):
        heads = [h for h, _ in by_start[start]]
        assert len({h["world"] for h in heads}) == 1 and len(heads) == heads[0]["world"], (start, heads)
        assert sorted(h["rank"] for h in heads) == list(range(heads[0]["world"]))
        worlds.append(heads[0]["world"])
    assert [w for w, _ in groupby(worlds)] == [1, 2, 1], worlds
    logged = [json.loads(x)["workers"] for x in (run / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [w for w, _ in groupby(logged)] == [1, 2, 1], logged
    final = state(run)
    assert final["step"] == MAX_STEPS and final["samples_seen"] == MAX_STEPS * 8 and final["world_size"] == 1

    # Exactly once: every closed epoch whole, with the NumPy pipeline's tokens and masks; and no
    # sample of the open epoch twice either.
    assert final["epoch"] >= 2, final
    for epoch in range(final["epoch"]):
        assert_epoch_exactly_once(rec, run, epoch)
    lines, _ = committed(run)
    twice = [k for k, n in Counter((e, s) for x in lines for e, s in zip(x["epoch"], x["ids"])).items() if n > 1]
    assert not twice, f"{len(twice)} samples trained on twice"
