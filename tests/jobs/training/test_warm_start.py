"""Pretraining's warm start (model.init): validated on load, the checkpoint's family, architecture,
weights and tokenizer kept. The Ray Train run that continues from one is the schedule's e2e test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ctxmodels.checkpoint import save_checkpoint
from ctxmodels.registry import build_model
from jobs.training.config import RecipeError, load_recipe
from jobs.training.train import warm_start_model, warm_start_source
from pipelines.sources import sample_text
from pipelines.tokenizers import train_tokenizer

REPO = Path(__file__).resolve().parents[3]
SHARD = str(REPO / "data/sample/wordnet-0007-of-0008.txt.gz")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("warm")
    tok = train_tokenizer("wordpiece", sample_text([SHARD], 100_000), 600)
    tok.save(root / "tok")
    cfg, model = build_model("bert", "tiny", {"vocab_size": tok.vocab_size, "d_model": 48, "n_head": 2, "nsp": False}, seed=3)
    return save_checkpoint(root / "run" / "checkpoint_2026-01-01_00-00-00.000000", model, "bert", cfg, tokenizer_dir=root / "tok")


def test_init_is_validated_and_refuses_architecture_keys():
    with pytest.raises(RecipeError, match="model.d_model: the architecture comes from model.init"):
        load_recipe(REPO / "configs/bert-tiny.yaml", ["model.init=runs/x", "model.d_model=64"])
    with pytest.raises(RecipeError, match="model.init"):
        load_recipe(REPO / "configs/bert-tiny.yaml", ["model.init=' '"])
    assert load_recipe(REPO / "configs/bert-tiny.yaml", ["model.init=runs/x"]).model.init == "runs/x"


def test_source_resolves_a_run_folder_and_keeps_its_tokenizer(checkpoint, tmp_path):
    rec = load_recipe(REPO / "configs/bert-tiny.yaml", [f"model.init={checkpoint.parent}"])
    uri, tok_dir, _ = warm_start_source(rec, tmp_path, log=lambda *_: None)
    assert uri.rstrip("/").endswith(checkpoint.name)  # the run folder's newest complete checkpoint
    assert (tok_dir / "tokenizer.json").is_file() and tok_dir.parent.name == checkpoint.name
    gpt = load_recipe(REPO / "configs/gpt-tiny.yaml", [f"model.init={checkpoint}"])
    with pytest.raises(RecipeError, match="is a bert checkpoint but model.family is 'gpt'"):
        warm_start_source(gpt, tmp_path, log=lambda *_: None)


def test_a_warm_start_with_languages_needs_the_checkpoints_language_table(tmp_path):
    """data.languages imply the model's language rows; model.init's checkpoint must have as many."""
    tok = train_tokenizer("wordpiece", sample_text([SHARD], 100_000), 600)
    tok.save(tmp_path / "tok")
    cfg, model = build_model("xlm", "tiny", {"vocab_size": tok.vocab_size, "type_vocab_size": 2}, seed=3)
    ckpt = save_checkpoint(tmp_path / "run" / "checkpoint_2026-01-01_00-00-00.000000", model, "xlm", cfg, tokenizer_dir=tmp_path / "tok")
    two = ["data.languages=[en, fr]", "data.input=[a, b]", "data.eval_input=null"]
    rec = load_recipe(REPO / "configs/xlm-tiny.yaml", [f"model.init={ckpt}", *two])
    assert warm_start_source(rec, tmp_path / "w1", log=lambda *_: None)[0].rstrip("/").endswith(ckpt.name)
    three = load_recipe(REPO / "configs/xlm-tiny.yaml", [f"model.init={ckpt}", "data.languages=[en, fr, de]",
                                                         "data.input=[a, b, c]", "data.eval_input=null"])
    with pytest.raises(RecipeError, match=r"data.languages: 3 language\(s\) need type_vocab_size=3, but model.init .* has type_vocab_size=2"):
        warm_start_source(three, tmp_path / "w2", log=lambda *_: None)
    # XLM's causal LM (objective clm) continues only a causal XLM, and MLM only a bidirectional one
    clm = load_recipe(REPO / "configs/xlm-tiny.yaml", [f"model.init={ckpt}", "data.objective=clm", *two])
    with pytest.raises(RecipeError, match=r"model.init: .* is a bidirectional \(objective mlm or tlm\) XLM, but data.objective 'clm' trains a causal"):
        warm_start_source(clm, tmp_path / "w3", log=lambda *_: None)
    cfg, model = build_model("xlm", "tiny", {"vocab_size": tok.vocab_size, "type_vocab_size": 2, "causal": True}, seed=3)
    causal = save_checkpoint(tmp_path / "causal" / "checkpoint_2026-01-01_00-00-00.000000", model, "xlm", cfg, tokenizer_dir=tmp_path / "tok")
    clm = load_recipe(REPO / "configs/xlm-tiny.yaml", [f"model.init={causal}", "data.objective=clm", *two])
    assert warm_start_source(clm, tmp_path / "w4", log=lambda *_: None)[0].rstrip("/").endswith(causal.name)
    with pytest.raises(RecipeError, match=r"is a causal \(objective clm\) XLM, but data.objective 'mlm' trains a bidirectional"):
        warm_start_source(load_recipe(REPO / "configs/xlm-tiny.yaml", [f"model.init={causal}", *two]), tmp_path / "w5", log=lambda *_: None)


def test_model_has_the_checkpoints_architecture_and_weights(checkpoint):
    cfg, model = warm_start_model(str(checkpoint), None)
    assert cfg.d_model == 48 and model.training
    _, original = build_model("bert", "tiny", {"vocab_size": cfg.vocab_size, "d_model": 48, "n_head": 2, "nsp": False}, seed=3)
    for (name, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(original.state_dict().items())):
        assert torch.equal(a, b), name


def test_init_from_the_registry(checkpoint, tmp_path):
    from jobs.registry import Registry

    registry = Registry()  # the session's SQLite store (tests/conftest.py)
    v = registry.register("warm-start-test", str(checkpoint))
    registry.promote("warm-start-test", v.version)
    rec = load_recipe(REPO / "configs/bert-tiny.yaml", ["model.init=models:/warm-start-test@production"])
    uri, tok_dir, _ = warm_start_source(rec, tmp_path, log=lambda *_: None)
    assert uri == str(checkpoint) and (tok_dir / "tokenizer.json").is_file()
