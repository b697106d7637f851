"""Pretraining evaluates on ``data.eval_input``: deterministic masks keyed by the seed, a bounded
number of samples, loss / perplexity / masked-token accuracy equal to a plain loop over the same
batches, shown on the progress line and in ``ctx report``. That a Ray Train run on 2 workers logs it every
``train.eval_every`` steps and at the end: tests/jobs/training/test_pretrain_e2e.py."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from jobs.training.config import load_recipe
from jobs.training.train import EVAL_EPOCH, eval_batches, evaluate, stream_spec
from pipelines.dataset import local_batches
from pipelines.objectives import objective
from pipelines.sources import sample_text
from pipelines.tokenizers import load_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[3]
EVAL_SHARD = str(REPO / "data/sample/wordnet-0007-of-0008.txt.gz")


def recipe(*extra: str):
    return load_recipe(REPO / "configs/bert-tiny.yaml", [
        "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=8", "scaling.num_workers=1", "data.eval_max_samples=40", *extra,
    ])


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer("wordpiece", sample_text([EVAL_SHARD], 200_000), 1000).save(path)
    return path


def test_eval_batches_are_bounded_and_masked_the_same_every_time(tok_dir):
    rec = recipe()
    a = eval_batches(rec, [EVAL_SHARD], tok_dir, 8, torch.device("cpu"))
    b = eval_batches(rec, [EVAL_SHARD], tok_dir, 8, torch.device("cpu"))
    assert len(a) == 5 and all(len(x["sample_id"]) == 8 for x in a)  # 40 samples, no more
    for x, y in zip(a, b):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
    other_seed = eval_batches(recipe("data.seed=1"), [EVAL_SHARD], tok_dir, 8, torch.device("cpu"))
    assert not all(torch.equal(x["labels"], y["labels"]) for x, y in zip(a, other_seed))
    # not the masks any training epoch gives the same shard
    train_epoch0 = next(local_batches(stream_spec(rec, [EVAL_SHARD]), load_tokenizer(tok_dir), batch_size=8, epoch=0))
    assert torch.equal(a[0]["sample_id"], torch.as_tensor(train_epoch0["sample_id"]))
    assert not np.array_equal(a[0]["labels"].numpy(), train_epoch0["labels"])
    assert EVAL_EPOCH > rec.data.max_epochs


def test_evaluate_equals_a_plain_loop_and_leaves_training_mode(tok_dir):
    from ctxmodels.registry import build_model
    from jobs.training.parallel import ParallelPlan

    rec = recipe()
    batches = eval_batches(rec, [EVAL_SHARD], tok_dir, 8, torch.device("cpu"))
    torch.manual_seed(0)
    _, model = build_model("bert", "tiny", {"vocab_size": load_tokenizer(tok_dir).vocab_size, "max_seq_len": 32, "nsp": False})
    model.train()
    got = evaluate(model, batches, objective("mlm"), ParallelPlan(), torch.device("cpu"), 0, 1)
    assert model.training
    model.eval()
    losses, correct, n_pred = [], 0.0, 0.0
    with torch.no_grad():
        for b in batches:
            out = model(**{k: v for k, v in b.items() if k not in ("sample_id", "epoch") and not k.startswith("_")})
            losses.append(float(out.loss))
            correct += float(out.metrics["mlm_acc"]) * float(out.metrics["n_pred"])
            n_pred += float(out.metrics["n_pred"])
    assert got["eval_loss"] == pytest.approx(np.mean(losses), rel=1e-5)
    assert got["eval_acc"] == got["eval_mlm_acc"] == pytest.approx(correct / n_pred, rel=1e-5)
    assert got["eval_ppl"] == pytest.approx(math.exp(got["eval_mlm_loss"]), rel=1e-6)
    assert got["eval_samples"] == 40


def test_progress_line_and_report_show_held_out_metrics(tmp_path):
    from jobs.training.metrics import MetricsLog
    from jobs.training.progress import describe
    from jobs.evaluation.report import write_report

    line = describe({"step": 10, "max_steps": 20, "loss": 5.0, "eval_loss": 4.5, "eval_ppl": 90.0, "eval_acc": 0.25})
    assert "eval loss 4.500 ppl 90.0 acc 0.250" in line
    run = tmp_path / "run"
    with MetricsLog(str(run)) as log:
        for step in (5, 10):
            log.log({"step": step, "max_steps": 10, "loss": 6.0 - step / 10, "ppl": 300.0, "eval_loss": 5.5, "eval_ppl": 250.0, "eval_acc": 0.1, "eval_samples": 40})
    index = write_report(str(run))
    page = index.read_text()
    assert "held-out loss" in page and "held-out accuracy" in page and (index.parent / "held_out.png").exists()
