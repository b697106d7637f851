"""A real Ray Train run (1 worker, tiny BERT) with NaN losses injected (``train.debug_nan_steps``):
a lone NaN step is skipped and counted; three in a row stop the run with a message that says so,
and the newest checkpoint, written before them, is still there with finite weights, the skipped
step's samples committed as consumed; a rerun resumes from it and finishes.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from ctxmodels.checkpoint import load_checkpoint
from jobs.training.config import load_recipe
from jobs.training.train import pretrain
from pipelines import storage
from pipelines.position import load_position

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def recipe(corpus: Path, out: Path, *extra: str):
    return load_recipe(REPO / "configs" / "bert-tiny.yaml", [
        f"data.input={corpus}", f"output_dir={out}", "name=nan", "data.eval_input=null",
        "tokenizer.vocab_size=500", "data.seq_len=32", "model.max_seq_len=32", "data.max_epochs=2",
        "train.batch_size=8", "train.micro_batch_size=4", "train.warmup_steps=2", "train.log_every=1",
        "train.checkpoint_every=2", "train.sample_log=true", "train.max_bad_steps=3",
        "scaling.num_workers=1", "scaling.cpus_per_worker=0.5", "scaling.max_failures=0", *extra,
    ])


def test_nan_steps_are_skipped_and_three_in_a_row_stop_the_run_keeping_the_newest_good_checkpoint(ray_session, tmp_path, monkeypatch):
    import tempfile

    scratch = tmp_path / "tmp"  # the driver's temporary folders (the tokenizer's copy) go here
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    lines = [x.strip() for x in gzip.open(REPO / "data/sample/wordnet-0000-of-0008.txt.gz", "rt") if x.strip()]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "part-0.txt").write_text("\n\n".join(lines[:300]) + "\n")  # ~300 samples of 32 tokens: > 9 steps of 8
    run = tmp_path / "nan"

    # Attempts 1, 2 -> steps 1, 2 (checkpoint); 3 NaN, skipped; 4, 5 -> steps 3, 4 (checkpoint);
    # 6, 7, 8 NaN: the third in a row stops the run.
    with pytest.raises(Exception) as stopped:
        pretrain(recipe(corpus, tmp_path, "train.max_steps=10", "train.debug_nan_steps=[3, 6, 7, 8]"), progress=False, log=lambda *_: None)
    message = str(stopped.value)
    assert "train.max_bad_steps=3" in message and "non-finite loss or gradient norm" in message, message

    newest = storage.Store().latest_complete_checkpoint(str(run))
    state = json.loads(Path(newest, "trainer_state.json").read_text())
    assert (state["step"], state["bad_steps"], state["samples_seen"]) == (4, 1, 4 * 8)
    assert all(torch.isfinite(p).all() for p in load_checkpoint(newest, verify_hashes=True).model.parameters())
    # The skipped step's 8 samples were consumed: committed with the position, not fed again.
    assert load_position(newest, storage.Store()).committed(0) == 5 * 8
    logged = [json.loads(x) for f in (run / "sample_log").glob("*.jsonl") for x in f.read_text().splitlines()[1:]]
    assert [x["step"] for x in logged if x.get("skipped")] == [3, 3, 5, 5, 5, 5]  # 2 micro-batches per attempt; the 3rd raised
    metrics = [json.loads(x) for x in (run / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["bad_steps"]) for m in metrics] == [(1, 0), (2, 0), (3, 1), (4, 1)]
    assert all(m["loss"] == m["loss"] for m in metrics)  # no NaN reached the logged losses
    assert list(scratch.iterdir()) == []  # removed, although the run failed

    # A rerun resumes from that checkpoint (attempt 6 onwards: none poisoned now) and finishes.
    result = pretrain(recipe(corpus, tmp_path, "train.max_steps=6", "train.debug_nan_steps=[3]"), progress=False, log=lambda *_: None)
    final = json.loads(Path(storage.Store().latest_complete_checkpoint(str(run)), "trainer_state.json").read_text())
    assert result.metrics["step"] == 6 and (final["step"], final["bad_steps"]) == (6, 1)
    assert all(torch.isfinite(p).all() for p in load_checkpoint(result.checkpoint_uri).model.parameters())
    assert list(scratch.iterdir()) == []
