"""Checkpoint directories: round trip, MANIFEST last, optimizer state without pickle, registry."""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ctxmodels import checkpoint as ckpt
from ctxmodels.checkpoint import (
    checkpoint_problem,
    is_complete,
    load_checkpoint,
    load_optimizer_state,
    optimizer_state_to_tensors,
    read_extra_json,
    read_extra_tensors,
    save_checkpoint,
)
from ctxmodels.registry import FAMILIES, FamilySpec, build_model


def batch_for(cfg, seed=0, B=4, T=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (B, T), generator=g)
    labels = torch.full((B, T), -100)
    labels[:, ::4] = ids[:, ::4]
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids), labels=labels)
    if cfg.nsp:
        batch["next_sentence_label"] = torch.randint(0, 2, (B,), generator=g)
    return batch


@pytest.fixture()
def no_pickle(monkeypatch):
    """Any unpickling during the test fails loudly."""

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint loading must not unpickle")

    # torch.optim imports torch._dynamo on first use, which subclasses pickle.Unpickler: import it
    # before patching so the patch only sees our code.
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))]).step()
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_round_trip_gives_identical_outputs(tmp_path, minilm_dir, family, no_pickle):
    torch.manual_seed(0)
    config, model = build_model(family, "tiny", {"n_layer": 1})
    model.eval()
    out = save_checkpoint(tmp_path / "ck", model, family, config, tokenizer_dir=minilm_dir)
    assert json.loads((out / "config.json").read_text()) == {
        "format": "ctxmodels", "family": family, "model": json.loads(json.dumps(config.__dict__)),
    }
    assert (out / "tokenizer" / "vocab.txt").exists() and not (out / "tokenizer" / "model.safetensors").exists()

    loaded = load_checkpoint(out)
    assert loaded.family == family and loaded.config == config
    assert loaded.tokenizer_dir == out / "tokenizer"
    assert not loaded.model.training
    batch = batch_for(config)
    with torch.no_grad():
        a, b = model(**batch), loaded.model(**batch)
        assert torch.equal(a.loss, b.loss)
        assert torch.equal(model.mlm_logits(batch["input_ids"]), loaded.model.mlm_logits(batch["input_ids"]))
    for (name, p), q in zip(model.state_dict().items(), loaded.model.state_dict().values()):
        assert torch.equal(p, q), name


class TiedToy(nn.Module):
    """A model whose output projection shares its Parameter with the embedding (GPT-style tying)."""

    def __init__(self, config=None, generator=None):
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.out = nn.Linear(4, 11, bias=False)
        self.out.weight = self.emb.weight


def test_tied_weights_are_stored_once_and_retied(tmp_path, monkeypatch):
    @dataclass
    class ToyConfig:
        size: int = 4

    monkeypatch.setitem(FAMILIES, "toy", FamilySpec(ToyConfig, TiedToy, {"tiny": ToyConfig()}))
    model = TiedToy()
    save_checkpoint(tmp_path, model, "toy", ToyConfig())
    assert set(load_file(tmp_path / "model.safetensors")) == {"emb.weight"}
    loaded = load_checkpoint(tmp_path).model
    assert loaded.out.weight is loaded.emb.weight
    assert torch.equal(loaded.emb.weight, model.emb.weight)


def test_manifest_is_written_last_and_lists_every_file(tmp_path, minilm_dir, monkeypatch):
    config, model = build_model("bert", "tiny", {"n_layer": 1})
    kwargs = dict(
        tokenizer_dir=minilm_dir,
        extra_json={"trainer_state": {"step": 7}},
        extra_tensors={"optimizer": {"x": torch.ones(3)}},
        extra_text={"MLmodel": "flavors: {}\n"},
    )
    for bad in ({"MANIFEST.json": ""}, {"sub/MLmodel": ""}, {"optimizer.safetensors": ""}):  # reserved, nested, twice
        with pytest.raises(ValueError, match="extra file"):
            save_checkpoint(tmp_path / "bad", model, "bert", config, **{**kwargs, "extra_text": bad})
    published = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (published.append(os.path.basename(dst)), real_replace(src, dst)))
    save_checkpoint(tmp_path / "full", model, "bert", config, **kwargs)
    assert published[-1] == "MANIFEST.json" and published.count("MANIFEST.json") == 1
    manifest = json.loads((tmp_path / "full" / "MANIFEST.json").read_text())
    listed = {f["path"] for f in manifest["files"]}
    on_disk = {p.relative_to(tmp_path / "full").as_posix() for p in (tmp_path / "full").rglob("*") if p.is_file()}
    assert listed == on_disk - {"MANIFEST.json"}
    assert {"model.safetensors", "config.json", "trainer_state.json", "optimizer.safetensors", "tokenizer/vocab.txt", "MLmodel"} <= listed
    assert is_complete(tmp_path / "full", verify_hashes=True)

    # A save that dies at any step leaves a directory that is not complete.
    for crash_at in range(len(published)):
        calls = []

        def dying_replace(src, dst, crash_at=crash_at):
            if len(calls) == crash_at:
                raise OSError("disk full")
            calls.append(dst)
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", dying_replace)
        target = tmp_path / f"crash{crash_at}"
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(target, model, "bert", config, **kwargs)
        assert not is_complete(target)
    monkeypatch.setattr(os, "replace", real_replace)


def test_truncated_or_unlisted_checkpoint_is_incomplete(tmp_path):
    config, model = build_model("bert", "tiny", {"n_layer": 1})
    save_checkpoint(tmp_path, model, "bert", config, extra_json={"trainer_state.json": {"step": 1}})
    assert is_complete(tmp_path)
    assert read_extra_json(tmp_path, "trainer_state") == {"step": 1}

    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-10])
    assert not is_complete(tmp_path)
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        load_checkpoint(tmp_path)

    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    assert is_complete(tmp_path) and not is_complete(tmp_path, verify_hashes=True)
    weights.write_bytes(data)
    (tmp_path / "MANIFEST.json").unlink()
    assert not is_complete(tmp_path)
    with pytest.raises(ValueError, match="MANIFEST.json"):
        load_checkpoint(tmp_path)


def write_small_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A complete checkpoint with every kind of file: weights, config, tokenizer/, extra JSON/tensors."""
    torch.manual_seed(seed)
    config, model = build_model("bert", "tiny", {"n_layer": 1})
    tok = folder.parent / f"{folder.name}-tokenizer"
    tok.mkdir(parents=True)
    (tok / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]))
    (tok / "tokenizer_config.json").write_text('{"do_lower_case": true}')
    return save_checkpoint(
        folder, model, "bert", config, tokenizer_dir=tok,
        extra_json={"trainer_state": {"step": seed}}, extra_tensors={"optimizer": {"x": torch.ones(3)}},
    )


# Ways a copy (or a save) can be cut off halfway. Each cuts a complete checkpoint folder in place and
# returns the words its problem must contain. tests/pipelines/test_storage.py uses them too.
def _lose_half_the_files(folder: Path) -> str:
    entries = json.loads((folder / "MANIFEST.json").read_text())["files"]
    for entry in entries[::2]:
        (folder / entry["path"]).unlink()
    return f"{entries[0]['path']} missing (and {len(entries[::2]) - 1} more)"


def _truncate_the_weights(folder: Path) -> str:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return f"model.safetensors: {len(data) // 2} bytes, manifest says {len(data)}"


def _lose_the_manifest(folder: Path) -> str:
    (folder / "MANIFEST.json").unlink()
    return "MANIFEST.json missing"


def _half_write_the_manifest(folder: Path) -> str:
    manifest = folder / "MANIFEST.json"
    text = manifest.read_bytes()
    manifest.write_bytes(text[: len(text) // 2])
    return "manifest unreadable ("


CUTS = {
    "half-the-files-gone": _lose_half_the_files,
    "weights-truncated": _truncate_the_weights,
    "manifest-missing": _lose_the_manifest,
    "manifest-half-written": _half_write_the_manifest,
}


@pytest.mark.parametrize("cut", CUTS)
def test_a_checkpoint_cut_in_half_is_incomplete_and_refused(tmp_path, cut):
    folder = write_small_checkpoint(tmp_path / "ck")
    assert checkpoint_problem(folder) is None and is_complete(folder, verify_hashes=True)
    expected = CUTS[cut](folder)
    assert expected in checkpoint_problem(folder)
    assert not is_complete(folder)
    with pytest.raises(ValueError, match=f"incomplete checkpoint: {re.escape(expected)}"):
        load_checkpoint(folder)


@pytest.mark.parametrize(
    "manifest, problem",
    [
        ([], "manifest unreadable"),
        ({"files": "model.safetensors"}, "manifest unreadable"),
        ({"files": [{"path": "model.safetensors"}]}, "manifest unreadable"),
        ({"files": [{"path": "model.safetensors", "size": "12"}]}, "manifest unreadable"),
        ({"files": [{"path": "config.json", "size": 1}]}, "manifest does not list model.safetensors"),
    ],
)
def test_a_malformed_manifest_is_named(tmp_path, manifest, problem):
    folder = write_small_checkpoint(tmp_path / "ck")
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))
    assert checkpoint_problem(folder).startswith(problem)
    with pytest.raises(ValueError, match=re.escape(problem)):
        load_checkpoint(folder)


def test_overwriting_a_checkpoint_removes_the_old_manifest_first(tmp_path, monkeypatch):
    config, model = build_model("bert", "tiny", {"n_layer": 1})
    save_checkpoint(tmp_path, model, "bert", config)
    monkeypatch.setattr(ckpt, "save_file", lambda *a, **k: (_ for _ in ()).throw(OSError("boom")))
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, model, "bert", config)
    assert not is_complete(tmp_path)


def train_step(model, opt, batch):
    opt.zero_grad()
    model(**batch).loss.backward()
    opt.step()


def test_adamw_state_round_trips_exactly(tmp_path, no_pickle):
    torch.manual_seed(0)
    overrides = {"n_layer": 1, "dropout": 0.0, "attn_dropout": 0.0}
    config, model = build_model("bert", "tiny", overrides)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.98), weight_decay=0.01)
    for step in range(2):
        train_step(model, opt, batch_for(config, seed=step))

    tensors, meta = optimizer_state_to_tensors(opt)
    save_checkpoint(
        tmp_path, model, "bert", config,
        extra_json={"trainer_state": {"step": 2, "optimizer": meta}}, extra_tensors={"optimizer": tensors},
    )

    loaded = load_checkpoint(tmp_path).model.train()
    opt2 = torch.optim.AdamW(loaded.parameters(), lr=0.5, betas=(0.5, 0.5), weight_decay=0.0)  # overwritten
    load_optimizer_state(opt2, read_extra_tensors(tmp_path, "optimizer"), read_extra_json(tmp_path, "trainer_state")["optimizer"])
    assert opt2.param_groups[0]["betas"] == (0.9, 0.98) and opt2.param_groups[0]["lr"] == 1e-3

    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for pid in s1["state"]:
        for key, value in s1["state"][pid].items():
            assert torch.equal(value, s2["state"][pid][key]), (pid, key)

    batch = batch_for(config, seed=2)
    train_step(model, opt, batch)
    train_step(loaded, opt2, batch)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert torch.equal(p, q), f"{name} differs after one more step"


def test_optimizer_state_refuses_other_optimizer():
    p = nn.Parameter(torch.ones(2))
    tensors, meta = optimizer_state_to_tensors(torch.optim.AdamW([p]))
    with pytest.raises(ValueError, match="AdamW"):
        load_optimizer_state(torch.optim.SGD([p], lr=0.1), tensors, meta)


def test_load_checkpoint_reads_hf_folders(minilm_dir, no_pickle):
    loaded = load_checkpoint(minilm_dir)
    assert loaded.family == "bert" and loaded.config.d_model == 384
    assert loaded.tokenizer_dir == minilm_dir


def test_config_errors_name_the_key(tmp_path):
    config, model = build_model("bert", "tiny", {"n_layer": 1})
    save_checkpoint(tmp_path, model, "bert", config)
    text = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(text.replace('"n_layer"', '"n_layex"'))  # same size: still complete
    assert is_complete(tmp_path)
    with pytest.raises(ValueError, match=r"config\.json.*n_layex"):
        load_checkpoint(tmp_path)


# ---- registry ------------------------------------------------------------------------------


def test_build_model_errors_name_the_unknown_thing():
    with pytest.raises(ValueError, match="family 'bart'"):
        build_model("bart", "tiny", {})
    with pytest.raises(ValueError, match="preset 'huge'"):
        build_model("bert", "huge", {})
    with pytest.raises(ValueError, match="hidden_size"):
        build_model("bert", "tiny", {"hidden_size": 32})
    with pytest.raises(ValueError, match=r"BertConfig\.d_model"):
        build_model("bert", "tiny", {"d_model": 63})


def test_build_model_applies_overrides_and_family_presets():
    config, model = build_model("roberta", "tiny", {"n_layer": 1})
    assert config.position_style == "roberta" and config.n_layer == 1 and not config.nsp
    assert len(model.backbone.layers) == 1
    assert FAMILIES["roberta"].presets["tiny"].n_layer == 2  # presets untouched
