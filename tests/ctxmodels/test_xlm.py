"""XLM (Lample & Conneau 2019) as BERT with XLM's presets: language embeddings, positions given per
token and the transform-free prediction layer equal transformers' ``XLMWithLMHeadModel`` both ways,
for a model with one language, several with embeddings, and several without (``use_lang_emb``); and
XLM's causal LM (``causal``), which reads no later token and is scored against the next one."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

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
    for key, value in (("sinusoidal_embeddings", True), ("asm", True)):
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


# ---------------------------------------------------------------------------------------------
# XLM's causal LM (sec. 3.1, CLM)


@pytest.mark.parametrize("n_langs", [1, 3])
def test_a_causal_xlm_converts_both_ways_with_equal_states_and_logits(n_langs, tmp_path):
    """An HF XLM with ``causal`` imports as ours with ``causal`` (a bidirectional pass would differ at
    every position but the last), and exports back to one."""
    ref = hf_xlm(n_langs, causal=True)
    ref.save_pretrained(tmp_path / "hf")
    family, cfg, ours = load_hf_folder(tmp_path / "hf")
    assert family == "xlm" and cfg.causal
    assert_equal_outputs(ours.eval(), ref, n_langs)
    export_hf_folder(ours, "xlm", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["causal"] is True
    back, info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert back.transformer.causal and not info["missing_keys"], info
    assert_equal_outputs(ours, back.eval(), n_langs)


def _causal_model(**overrides):
    _, model = build_model("xlm", "tiny", {"type_vocab_size": 2, "vocab_size": V, "causal": True, **overrides}, seed=0)
    return model


def _rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    langs = torch.tensor([[0], [1], [1]]).expand(3, 10)
    return ids.masked_fill(mask == 0, PAD), mask, langs


@pytest.mark.parametrize("training", [False, True])
def test_a_causal_xlm_never_reads_a_later_token(training):
    """Changing the token at position 5 changes no state before it and every real one from it, in
    inference and in training (SDPA, and the written-out attention with its dropout drawn alike), with a
    padded row among full ones; the passes that read one position agree with the full pass."""
    model = _causal_model().train(training)
    ids, mask, langs = _rows()
    changed = ids.clone()
    changed[:, 5] = (ids[:, 5] + 1 - 5) % (V - 5) + 5
    states = []
    for x in (ids, changed):
        torch.manual_seed(0)  # the same dropout draws for both
        states.append(model.backbone.hidden_states(x, mask, langs)[-1])
    torch.testing.assert_close(states[0][:, :5], states[1][:, :5], atol=1e-6, rtol=0)
    real_after = mask[:, 5:].bool()
    assert ((states[0][:, 5:] - states[1][:, 5:]).abs().amax(-1)[real_after] > 1e-3).all()
    if not training:
        with torch.no_grad():
            first = model.backbone.first_token_state(changed, mask, langs)
            where = mask.bool() & (torch.arange(10) % 3 == 0)
            at = model.backbone.last_hidden_at(changed, mask, langs, where)
        torch.testing.assert_close(first, states[1][:, 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(at, states[1][where], atol=1e-5, rtol=0)


def test_the_causal_loss_scores_each_position_against_the_next_token():
    model = _causal_model().eval()
    ids, mask, langs = _rows()
    labels = ids.masked_fill(mask == 0, -100)  # unshifted, as GPT's
    with torch.no_grad():
        out = model(ids, mask, langs, labels=labels)
        logits = model.mlm_logits(ids, mask, langs)  # (B, T, V)
    nxt = labels[:, 1:]
    torch.testing.assert_close(out.loss, F.cross_entropy(logits[:, :-1].reshape(-1, V), nxt.reshape(-1)), atol=1e-5, rtol=0)
    scored = nxt != -100
    assert out.metrics["n_pred"].item() == scored.sum().item() == 3 * 9 - 3  # row 1's padding predicts nothing
    hits = (logits[:, :-1].argmax(-1) == nxt)[scored].float().mean()
    torch.testing.assert_close(out.metrics["lm_acc"], hits)
    assert set(out.metrics) == {"lm_loss", "lm_acc", "n_pred"}  # the clm objective's metric names (GPT's)

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(ids, mask, langs, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert model.backbone.embeddings.token_type.weight.grad.abs().sum() > 0


def test_what_a_causal_xlm_cannot_be_is_refused():
    from ctxmodels.distill import init_student
    from ctxmodels.tasks import TaskConfig, TaskModel

    with pytest.raises(ValueError, match="causal: a causal LM predicts the next token"):
        make_config("xlm", "tiny", {"causal": True, "nsp": True})
    cfg = make_config("xlm", "tiny", {"causal": True})
    with pytest.raises(ValueError, match="cannot read a classification task's vector at position 0"):
        TaskModel("xlm", cfg, TaskConfig(kind="classification", num_labels=3))
    TaskModel("xlm", cfg, TaskConfig(kind="token-classification", num_labels=3))  # every token reads what precedes it
    with pytest.raises(ValueError, match="causal XLM teacher"):
        init_student(_causal_model(), [0])


# ---------------------------------------------------------------------------------------------
# Fine-tuned XLM: every token reads the task's language (cross-lingual transfer)


def test_a_fine_tuned_xlm_reads_every_token_as_its_tasks_language():
    """``TaskConfig.language``: the row of the language table every token reads, whatever segment
    ids the pair inputs carry; 0 gives no ids (row 0). Sequence and token tasks alike."""
    from ctxmodels.tasks import TaskConfig, TaskModel, language_row

    cfg = make_config("xlm", "tiny", {"type_vocab_size": 3})
    ids = torch.randint(5, 8000, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    segments = (torch.arange(9) >= 4).long().expand(2, 9)  # a pair's second segment: type 1, not a language
    for kind in ("classification", "token-classification"):
        torch.manual_seed(0)
        model = TaskModel("xlm", cfg, TaskConfig(kind=kind, num_labels=3, language=2, languages=["en", "fr", "de"])).eval()
        with torch.no_grad():
            with_ids = model.backbone.hidden_states(ids, mask, torch.full_like(ids, 2))[-1]
            without = model.backbone.hidden_states(ids, mask)[-1]
            if kind == "classification":
                got = model.sequence_vector(ids, mask, segments)
                model.task.language = 0
                as_row_0 = model.sequence_vector(ids, mask, segments)
                want, want_0 = with_ids[:, 0], without[:, 0]
            else:
                where = mask.bool()
                got = model.labelled_vectors(ids, mask, segments, where)
                model.task.language = 0
                as_row_0 = model.labelled_vectors(ids, mask, segments, where)
                want, want_0 = with_ids[where], without[where]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(as_row_0, want_0, atol=1e-5, rtol=0)
        assert not torch.allclose(got, as_row_0)
    assert language_row(["en", "fr", "de"], 3, "de") == 2 and language_row([], 3, 1) == 1
    for names, rows, wanted, message in ((["en", "fr"], 2, "es", r"'es' is not one of the model's; its languages are \['en', 'fr'\]"),
                                         ([], 2, "fr", "its checkpoint names none: give the row's number"),
                                         ([], 2, 2, r"2 is not a row of its language table \(0..1\)"),
                                         ([], 0, 0, "the model has no language embeddings")):
        with pytest.raises(ValueError, match=message):
            language_row(names, rows, wanted)
