"""``ctx distill`` on Ray Train: all-MiniLM-L6-v2 into a 3-layer student (configs/distill/minilm-l3.yaml
on tiny settings), through the one worker loop: the checkpoint is a plain 3-layer BERT (that its
blocks start from the teacher's layers 0, 2 and 4 is tests/ctxmodels/test_distill.py's), the
hidden-state loss falls, a rerun resumes the
student (weights through the Distiller's student-only state dict, optimizer, data position), a
worker killed mid-epoch resumes with every sample of the epoch trained on once, and recipes that
cannot work fail before Ray starts, naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ctxmodels.checkpoint import load_checkpoint
from jobs.training.config import RecipeError, load_recipe
from jobs.training.metrics import read_metrics
from jobs.training.train import pretrain
from tests.jobs.training.exactly_once import WorkerKiller, assert_epoch_exactly_once, committed, state, write_corpus

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "configs" / "distill" / "minilm-l3.yaml"


def _tiny(out: Path, *extra: str) -> list[str]:
    return [
        f"output_dir={out}", "data.seq_len=32", "train.batch_size=8", "train.log_every=2", "train.checkpoint_every=4",
        "train.eval_every=4", "train.warmup_steps=1", "train.lr=1e-3", "data.eval_max_samples=16", "scaling.num_workers=1",
        "scaling.cpus_per_worker=1", "registry.enabled=false", *extra,
    ]


def test_bad_distillation_recipes_fail_before_ray_starts(tmp_path):
    with pytest.raises(RecipeError, match="model.init: a distillation's student starts from teacher.init"):
        load_recipe(RECIPE, ["model.init=runs/x"])
    with pytest.raises(RecipeError, match="data.objective: distillation trains on masked-LM batches"):
        load_recipe(RECIPE, ["data.objective=nsp"])
    with pytest.raises(RecipeError, match="model.family: distillation takes a bert, roberta, spanbert, xlm teacher, not 'albert'"):
        load_recipe(RECIPE, ["model.family=albert"])
    # MiniLM has no trained MLM head: asking for soft targets is refused, with what to set instead
    with pytest.raises(RecipeError, match="teacher.alpha_soft=0"):
        pretrain(load_recipe(RECIPE, _tiny(tmp_path, "teacher.alpha_soft=5.0")), progress=False, log=lambda *_: None)
    with pytest.raises(RecipeError, match="student_layers: \\[0, 6\\] names a layer the 6-layer teacher does not have"):
        pretrain(load_recipe(RECIPE, _tiny(tmp_path, "teacher.student_layers=[0,6]")), progress=False, log=lambda *_: None)


@pytest.mark.slow
def test_minilm_distils_into_three_layers_and_resumes(ray_session, tmp_path):
    logs: list[str] = []
    first = pretrain(load_recipe(RECIPE, _tiny(tmp_path, "train.max_steps=8")), progress=False, log=logs.append)
    assert any(line.startswith("teacher: weights and tokenizer of") for line in logs), logs
    student = load_checkpoint(first.checkpoint_uri)
    assert student.family == "bert" and student.config.n_layer == 3
    rows = read_metrics(str(tmp_path / "minilm-l3"))
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    assert all(0 <= r["sentence_cos"] <= 1 and r["cos_loss"] >= 0 for r in rows)
    assert rows[-1]["cos_loss"] < rows[0]["cos_loss"], rows  # the student moves towards the teacher
    assert [r["step"] for r in rows if "eval_sentence_cos" in r] == [4, 8]

    second = pretrain(load_recipe(RECIPE, _tiny(tmp_path, "train.max_steps=10")), progress=False, log=logs.append)
    assert any("resume: step 8" in line for line in logs), logs
    state = json.loads((Path(second.checkpoint_uri) / "trainer_state.json").read_text())
    assert state["step"] == 10 and state["samples_seen"] == 10 * 8
    resumed = load_checkpoint(second.checkpoint_uri).model.state_dict()
    trained = student.model.state_dict()
    assert resumed.keys() == trained.keys()
    assert any(not torch.equal(resumed[k], trained[k]) for k in trained)  # two more steps trained the student


@pytest.mark.slow
@pytest.mark.extended  # make test-all: the same loop's killed pretraining and fine-tuning workers are in make test
def test_a_killed_distillation_worker_resumes_and_trains_on_each_sample_once(ray_session, tmp_path):
    """The exactly-once check of pretraining (tests/jobs/training/exactly_once.py) on a distillation: the worker
    is SIGKILLed after step 25 (checkpoint at 20), Ray Train restarts it, it resumes the student from
    the checkpoint, and over the first epoch every sample's committed step holds it once, with the
    tokens and mask the NumPy pipeline gives it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_corpus(corpus)
    rec = load_recipe(RECIPE, _tiny(tmp_path, f"data.input={corpus}", "data.eval_input=null", "data.max_epochs=2",
                                    "train.max_steps=80", "train.checkpoint_every=10", "train.log_every=5",
                                    "train.eval_every=1000", "train.sample_log=true"))
    run = tmp_path / "minilm-l3"
    killer = WorkerKiller(run, after_step=25)
    result = pretrain(rec, progress=False, log=lambda *_: None)
    killer.killed()
    _, starts = committed(run)
    assert starts[0] == 0 and len(starts) == 2 and 20 <= starts[1] < 30, starts  # resumed from its checkpoint
    assert result.metrics["step"] == 80 and state(run)["samples_seen"] == 80 * 8
    assert load_checkpoint(result.checkpoint_uri).config.n_layer == 3  # the student, not the teacher
    # the epoch was longer than the kill point; the tokenizer is the teacher's, kept in each checkpoint
    assert assert_epoch_exactly_once(rec, run, epoch=0, tokenizer=Path(result.checkpoint_uri) / "tokenizer") > 8 * 40
