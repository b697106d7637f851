"""Exactly-once data across failures and worker-count changes (Ray Train + Ray Data, 2 CPUs).

Every worker writes the samples it trained on (``train.sample_log``); the checks
(``tests/jobs/training/exactly_once.py``) take a sample as consumed when its optimizer step was committed
and require every sample of the epoch to be consumed exactly once, with the tokens and mask the
pure NumPy pipeline gives it: none lost, none repeated, whatever failed or changed in between.
"""

from __future__ import annotations

import json

import pytest

from jobs.training.train import pretrain
from tests.jobs.training.exactly_once import WorkerKiller, assert_epoch_exactly_once, committed, recipe, state, write_corpus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_worker_killed_mid_epoch_finishes_and_consumes_each_sample_once(ray_session, corpus, tmp_path):
    rec = recipe(corpus, tmp_path, "train.max_steps=80", "scaling.num_workers=[1, 2]")  # elastic: Ray places what fits
    run = tmp_path / "once"
    killer = WorkerKiller(run, after_step=25)  # the highest rank, after the checkpoint at 20; 1 or 2 workers may run
    result = pretrain(rec, progress=False, log=lambda *_: None)
    killer.killed()
    _, starts = committed(run)
    assert starts[0] == 0 and len(starts) == 2 and 20 <= starts[1] < 30, starts  # resumed from its checkpoint
    assert result.metrics["step"] == 80 and state(run)["samples_seen"] == 80 * 8 and result.metrics["workers"] in (1, 2)
    n = assert_epoch_exactly_once(rec, run, epoch=0)
    assert n > 8 * 40  # the epoch really was longer than the kill point


@pytest.mark.extended  # make test-all
def test_two_workers_then_one_consumes_each_sample_once(ray_session, corpus, tmp_path):
    run = tmp_path / "once"
    pretrain(recipe(corpus, tmp_path, "train.max_steps=30", "scaling.num_workers=2"), progress=False, log=lambda *_: None)
    first = state(run)
    assert first["step"] == 30 and first["world_size"] == 2 and first["epoch"] == 0  # mid-epoch
    rec = recipe(corpus, tmp_path, "train.max_steps=80", "scaling.num_workers=1")
    result = pretrain(rec, progress=False, log=lambda *_: None)
    assert result.metrics["step"] == 80 and result.metrics["workers"] == 1
    last = state(run)
    # the global batch stayed 8 (one worker ran 2 micro-batches of 4 per step)
    assert last["samples_seen"] == 80 * 8 and last["world_size"] == 1 and last["epoch"] >= 1
    assert_epoch_exactly_once(rec, run, epoch=0)


def test_resume_skips_a_checkpoint_cut_in_half(ray_session, corpus, tmp_path):
    """The newest checkpoint's weights are cut to half their bytes (an upload cut off after the
    manifest landed): the rerun resumes from the one before, and its data position with it."""
    run = tmp_path / "once"
    pretrain(recipe(corpus, tmp_path, "train.max_steps=20", "scaling.num_workers=1"), progress=False, log=lambda *_: None)
    ckpts = sorted(p for p in run.iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))
    assert len(ckpts) == 2
    weights = ckpts[-1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    lines = []
    rec = recipe(corpus, tmp_path, "train.max_steps=25", "scaling.num_workers=1")
    pretrain(rec, progress=False, log=lines.append)
    assert any("resume: step 10 " in x for x in lines), lines
    heads = [json.loads(f.read_text().splitlines()[0]) for f in (run / "sample_log").glob("*.jsonl")]
    assert sorted(h["resumed_step"] for h in heads) == [0, 10]
    assert {h["resumed_from"] for h in heads if h["resumed_step"] == 10} == {str(ckpts[0])}
    # what steps 11-20 of the first run trained on was rolled back with the weights: trained again
    attempts = {}
    for f in (run / "sample_log").glob("*.jsonl"):
        head, *rest = [json.loads(y) for y in f.read_text().splitlines()]
        attempts[head["resumed_step"]] = rest
    rolled_back = {s for x in attempts[0] if 11 <= x["step"] <= 20 for s in x["ids"]}
    kept = {s for x in attempts[0] if x["step"] <= 10 for s in x["ids"]}
    retrained = {s for x in attempts[10] for s in x["ids"]}
    assert len(rolled_back) == 80 and rolled_back <= retrained and not kept & retrained
