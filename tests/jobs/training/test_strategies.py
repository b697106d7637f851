"""FSDP through the whole run: ``scaling.strategy=fsdp`` on 2 Ray Train workers (CPU, gloo)
trains, checkpoints full weights and optimizer state, and resumes from them."""

from pathlib import Path

import json
import math

import pytest
from safetensors.torch import load_file

from ctxmodels.checkpoint import load_checkpoint
from jobs.training.config import load_recipe
from jobs.training.train import pretrain
from pipelines import storage

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


@pytest.mark.extended  # make test-all
def test_fsdp_run_checkpoints_full_state_and_resumes(ray_session, tmp_path):
    common = [
        f"output_dir={tmp_path}", "name=fsdp", "scaling.strategy=fsdp", "scaling.num_workers=2",
        "scaling.cpus_per_worker=0.5", "data.input=data/sample/wordnet-0000-of-0008.txt.gz", "data.eval_input=null",
        "tokenizer.vocab_size=1000", "tokenizer.sample_chars=300000", "data.seq_len=32", "model.max_seq_len=32",
        "train.batch_size=8", "train.log_every=5", "train.checkpoint_every=10", "train.warmup_steps=2",
    ]
    first = pretrain(load_recipe(REPO / "configs" / "bert-tiny.yaml", common + ["train.max_steps=10"]), progress=False, log=lambda *_: None)
    ckpt = Path(first.checkpoint_uri)
    model = load_checkpoint(ckpt).model  # loads strictly: the model's own names, no FSDP prefixes
    assert model.backbone.embeddings.word.weight.shape[0] >= 1000  # whole, not a half-vocabulary shard
    opt = load_file(str(ckpt / "optimizer.safetensors"))
    weights = load_file(str(ckpt / "model.safetensors"))
    # the optimizer moments are whole tensors, one per trained parameter, shaped like the weights
    shapes = sorted(tuple(v.shape) for k, v in opt.items() if k.endswith(".exp_avg"))
    assert shapes and all(s in {tuple(w.shape) for w in weights.values()} for s in shapes)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 10 and state["world_size"] == 2

    again = pretrain(load_recipe(REPO / "configs" / "bert-tiny.yaml", common + ["train.max_steps=20"]), progress=False, log=lambda *_: None)
    assert again.metrics["step"] == 20 and math.isfinite(again.metrics["loss"])
    assert [m["step"] for m in again.history] == [15, 20]  # resumed at 10, not from scratch
    assert storage.Store().latest_complete_checkpoint(str(tmp_path / "fsdp")) == again.checkpoint_uri
