"""XLM (Lample & Conneau 2019) as BERT with XLM's presets: language embeddings, positions given per
token and the transform-free prediction layer equal transformers' ``XLMWithLMHeadModel`` both ways,
for a model with one language, several with embeddings, and several without (``use_lang_emb``)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ctxmodels.hf import export_hf_folder, from_hf, load_hf_folder
from ctxmodels.registry import build_model, make_config, new_model

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

V, PAD, T = 99, 2, 12


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def batch(n_langs: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Translation-LM-shaped rows: two sentences, each with its own language and positions from 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (3, T), generator=g)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, 9:] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    half = T // 2
    langs = torch.cat([torch.zeros(3, half, dtype=torch.long), torch.full((3, T - half), n_langs - 1)], dim=1)
    positions = torch.cat([torch.arange(half), torch.arange(T - half)]).expand(3, T)
    return {"input_ids": ids, "attention_mask": mask, "langs": langs, "position_ids": positions}


def hf_xlm(n_langs: int, use_lang_emb: bool = True, **kw):
    config = transformers.XLMConfig(vocab_size=V, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=40,
                                    n_langs=n_langs, use_lang_emb=use_lang_emb, pad_token_id=PAD, **kw)
    torch.manual_seed(0)
    model = transformers.XLMWithLMHeadModel(config)
    perturb(model)
    return model.eval()


def assert_equal_outputs(ours, ref, n_langs: int) -> None:
    b = batch(n_langs)
    real = b["attention_mask"].bool()
    with torch.no_grad():
        out = ref(**b, output_hidden_states=True)
        states = ours.backbone.hidden_states(b["input_ids"], b["attention_mask"], b["langs"], b["position_ids"])
        logits = ours.mlm_logits(b["input_ids"], b["attention_mask"], b["langs"], b["position_ids"])
    assert len(states) == len(out.hidden_states)
    for a, h in zip(states, out.hidden_states):
        torch.testing.assert_close(a[real], h[real], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[real], out.logits[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize(("n_langs", "use_lang_emb", "table"), [(1, True, 0), (3, True, 3), (3, False, 0)])
def test_hf_xlm_imports_with_equal_states_and_logits(n_langs, use_lang_emb, table, tmp_path, caplog):
    ref = hf_xlm(n_langs, use_lang_emb)
    ref.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ctxmodels.hf"):
        family, cfg, ours = load_hf_folder(tmp_path)
    assert family == "xlm" and cfg.type_vocab_size == table and not cfg.mlm_transform and cfg.d_ff == 4 * 32
    assert "no weights for" not in caplog.text and "ignoring" not in caplog.text, caplog.text
    assert_equal_outputs(ours.eval(), ref, n_langs)


@pytest.mark.parametrize("n_langs", [1, 4])
def test_our_xlm_exports_as_xlm_with_lm_head(n_langs, tmp_path):
    _, ours = build_model("xlm", "tiny", {"vocab_size": V, "d_model": 32, "n_head": 4, "d_ff": 128, "max_seq_len": 40,
                                           "type_vocab_size": 0 if n_langs == 1 else n_langs, "pad_token_id": PAD}, seed=0)
    perturb(ours)
    export_hf_folder(ours.eval(), "xlm", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["XLMWithLMHeadModel"] and config["n_langs"] == n_langs
    ref, info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(ref).__name__ == "XLMWithLMHeadModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert_equal_outputs(ours, ref.eval(), n_langs)


def test_a_language_changes_the_vectors_only_through_its_row():
    """Language ids pick rows of the table; swapping two rows swaps what the languages give."""
    _, model = build_model("xlm", "tiny", {"type_vocab_size": 2}, seed=0)
    model.eval()
    ids = torch.randint(5, 8000, (2, 10), generator=torch.Generator().manual_seed(0))
    zeros, ones = torch.zeros_like(ids), torch.ones_like(ids)
    with torch.no_grad():
        en, fr = model.backbone(ids, None, zeros)[0], model.backbone(ids, None, ones)[0]
        assert not torch.allclose(en, fr)
        model.backbone.embeddings.token_type.weight.copy_(model.backbone.embeddings.token_type.weight.flip(0))
        torch.testing.assert_close(model.backbone(ids, None, ones)[0], en)


def test_given_positions_equal_the_counted_ones_and_survive_padding_skips():
    """position_ids = 0..T-1 is what the model counts by itself; on a padded batch the CPU path that
    embeds only the real tokens (``Packing``) reads the same rows of them as the plain layout."""
    cfg = make_config("xlm", "tiny", {"type_vocab_size": 2})
    model = new_model("xlm", cfg, seed=0).eval()
    b = batch(2)
    ids, mask = b["input_ids"] % cfg.vocab_size, b["attention_mask"]
    real = mask.bool()
    with torch.no_grad():
        counted = model.mlm_logits(ids, mask, b["langs"])
        given = model.mlm_logits(ids, mask, b["langs"], torch.arange(T).expand(3, T))
        torch.testing.assert_close(given, counted, atol=0, rtol=0)
        restarted = model.mlm_logits(ids, mask, b["langs"], b["position_ids"])
        assert not torch.allclose(restarted[real], counted[real])
        model.backbone.skip_padding = False
        plain = model.mlm_logits(ids, mask, b["langs"], b["position_ids"])
    torch.testing.assert_close(restarted[real], plain[real], atol=1e-5, rtol=0)


def test_pretraining_loss_falls_with_languages_and_positions():
    _, model = build_model("xlm", "tiny", {"type_vocab_size": 2, "vocab_size": V}, seed=0)
    b = batch(2)
    labels = b["input_ids"].clone().masked_fill(b["attention_mask"] == 0, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        out = model(b["input_ids"], b["attention_mask"], b["langs"], labels=labels, position_ids=b["position_ids"])
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert model.backbone.embeddings.token_type.weight.grad.abs().sum() > 0


def test_import_and_export_refuse_what_xlm_cannot_be(tmp_path):
    for key, value in (("causal", True), ("sinusoidal_embeddings", True), ("asm", True)):
        ref = transformers.XLMConfig(vocab_size=V, emb_dim=32, n_layers=1, n_heads=4, **{key: value})
        with pytest.raises(ValueError, match=f"{key}=True is not supported"):
            from_hf(ref.to_dict(), {}, "folder")
    for overrides, why in (({"mlm_transform": True}, "mlm_transform"), ({"d_ff": 100}, "d_ff=100"),
                           ({"type_vocab_size": 1}, "type_vocab_size=1")):
        _, model = build_model("xlm", "tiny", overrides, seed=0)
        with pytest.raises(ValueError, match=why):
            export_hf_folder(model, "xlm", tmp_path / "out")


@pytest.mark.parametrize(("preset", "n_langs"), [("en-2048", 1), ("xnli15-1024", 15), ("100-1280", 100)])
def test_presets_have_the_released_models_parameters(preset, n_langs):
    """Our large presets hold as many weights as transformers' XLMWithLMHeadModel of the released
    model's config (built on the meta device: no memory), less the pooler XLM lacks."""
    cfg = make_config("xlm", preset)
    hf_config = transformers.XLMConfig(vocab_size=cfg.vocab_size, emb_dim=cfg.d_model, n_layers=cfg.n_layer,
                                       n_heads=cfg.n_head, n_langs=n_langs, use_lang_emb=cfg.type_vocab_size > 0)
    with torch.device("meta"):
        ours = new_model("xlm", cfg, seed=0)
        ref = transformers.XLMWithLMHeadModel(hf_config)
    pooler = sum(p.numel() for p in ours.backbone.pooler.parameters())
    assert sum(p.numel() for p in ours.parameters()) - pooler == sum(p.numel() for p in ref.parameters())
