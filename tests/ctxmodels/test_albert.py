"""ALBERT (ctxmodels.albert): parity with Hugging Face, parameter sharing, sizes, training."""

from __future__ import annotations

import json
import time

import pytest
import torch

from ctxmodels.albert import PRESETS, AlbertConfig, AlbertForPreTraining
from ctxmodels.hf import from_hf, to_hf
from ctxmodels.outputs import PretrainOutput

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

torch.set_num_threads(1)

VOCAB = 97


def tiny(**overrides) -> AlbertConfig:
    fields = dict(
        vocab_size=VOCAB, embedding_size=16, d_model=32, n_layer=3, n_head=4, d_ff=64, max_seq_len=24
    )
    return AlbertConfig(**(fields | overrides))


def hf_reference(num_hidden_groups: int):
    """A randomly initialised HF ALBERT of the tiny size, every weight (LayerNorms too) perturbed."""
    torch.manual_seed(0)
    hf_cfg = transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=3,
        num_hidden_groups=num_hidden_groups, inner_group_num=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=24, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
    )
    model = transformers.AlbertForPreTraining(hf_cfg)
    with torch.no_grad():
        for p in model.parameters():  # tied weights are one Parameter, so they stay tied
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def batch(B: int = 3, T: int = 12, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    token_type_ids = (torch.arange(T) >= T // 2).long().expand(B, T) * mask
    labels = torch.full((B, T), -100)
    chosen = (torch.rand(B, T, generator=g) < 0.3) & mask.bool()
    chosen[0, 1] = True
    labels[chosen] = ids[chosen]
    return dict(
        input_ids=ids,
        attention_mask=mask,
        token_type_ids=token_type_ids,
        labels=labels,
        next_sentence_label=torch.tensor([0, 1, 1]),
    )


@pytest.mark.parametrize(("groups", "share"), [(1, "all"), (3, "none")])
def test_parity_with_hugging_face(groups, share):
    hf = hf_reference(groups)
    _, cfg, model = from_hf(hf.config.to_dict(), hf.state_dict())
    model.eval()
    assert cfg.share == share and cfg.activation == "gelu_tanh"
    b = batch()
    inputs = {k: b[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        ref = hf(**inputs, output_hidden_states=True)
        ours = model.backbone.hidden_states(**inputs)
        mlm, sop = model.logits(**inputs, labels=b["labels"])
        ref_loss = hf(**inputs, labels=b["labels"], sentence_order_label=b["next_sentence_label"]).loss
        out = model(**b)
    assert len(ours) == len(ref.hidden_states) == cfg.n_layer + 1
    for a, r in zip(ours, ref.hidden_states):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4)
    masked = b["labels"] != -100
    assert mlm.shape == (int(masked.sum()), VOCAB)  # scored only where labels != -100
    torch.testing.assert_close(mlm, ref.prediction_logits[masked], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sop, ref.sop_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=1e-5)  # MLM mean + SOP mean


@pytest.mark.parametrize("share", ["all", "none"])
def test_to_hf_loads_in_transformers(share, tmp_path):
    torch.manual_seed(0)
    model = AlbertForPreTraining(tiny(share=share)).eval()
    hf_config, state_dict = to_hf(model, "albert")
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    safetensors_torch.save_file(state_dict, str(tmp_path / "model.safetensors"))
    hf = transformers.AlbertForPreTraining.from_pretrained(tmp_path).eval()
    b = batch()
    inputs = {k: b[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    with torch.no_grad():
        ref = hf(**inputs)
        mlm, sop = model.logits(**inputs)
    torch.testing.assert_close(mlm, ref.prediction_logits.reshape(-1, VOCAB), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sop, ref.sop_logits, atol=1e-4, rtol=1e-4)
    _, _, again = from_hf(hf_config, state_dict)
    for name, t in model.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_share_modes_store_the_expected_parameters():
    n = {s: count(AlbertForPreTraining(tiny(share=s, n_layer=4))) for s in ("all", "attention", "ffn", "none")}
    one = AlbertForPreTraining(tiny(share="all", n_layer=4)).backbone
    attention, ffn = count(one.attention[0]), count(one.ffn[0])
    assert n["none"] > n["attention"] > n["all"] and n["none"] > n["ffn"] > n["all"]
    assert n["attention"] == n["all"] + 3 * ffn  # attention shared, one FFN per layer
    assert n["ffn"] == n["all"] + 3 * attention
    assert n["none"] == n["all"] + 3 * (attention + ffn)


def test_share_all_applies_one_block_n_layer_times():
    model = AlbertForPreTraining(tiny(share="all", n_layer=5)).eval()
    backbone = model.backbone
    assert len(backbone.attention) == 1 and len(backbone.ffn) == 1
    assert all(backbone.layer(i)[0] is backbone.attention[0] for i in range(5))
    calls = []
    backbone.attention[0].register_forward_hook(lambda *_: calls.append("attention"))
    backbone.ffn[0].register_forward_hook(lambda *_: calls.append("ffn"))
    with torch.no_grad():
        states = backbone.hidden_states(batch()["input_ids"])
    assert calls == ["attention", "ffn"] * 5
    assert len(states) == 6 and not torch.allclose(states[1], states[2])
    none = AlbertForPreTraining(tiny(share="none", n_layer=5)).backbone
    assert len({id(none.layer(i)[0]) for i in range(5)}) == 5


@pytest.mark.parametrize(("preset", "expected"), [("base", 12e6), ("large", 18e6), ("xlarge", 60e6)])
def test_parameter_count(preset, expected):
    with torch.device("meta"):
        model = AlbertForPreTraining(PRESETS[preset])
    n = count(model)
    assert abs(n - expected) / expected < 0.05, f"{preset}: {n / 1e6:.1f}M parameters"


def test_tiny_forward_backward():
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    model = AlbertForPreTraining(cfg)
    B, T = 8, 128
    ids = torch.randint(5, cfg.vocab_size, (B, T))
    mask = torch.ones_like(ids)
    mask[0, 100:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]
    b = dict(
        input_ids=ids,
        attention_mask=mask,
        token_type_ids=(torch.arange(T) >= 64).long().expand(B, T),
        labels=labels,
        next_sentence_label=torch.randint(0, 2, (B,)),
    )
    model(**b).loss.backward()  # warm-up
    model.zero_grad()
    start = time.perf_counter()
    out = model(**b)
    out.loss.backward()
    assert time.perf_counter() - start < 1.0
    assert isinstance(out, PretrainOutput) and out.loss.requires_grad and torch.isfinite(out.loss)
    assert set(out.metrics) == {"mlm_loss", "mlm_acc", "n_pred", "sop_loss", "sop_acc"}
    assert all(m.ndim == 0 and not m.requires_grad for m in out.metrics.values())
    assert out.metrics["n_pred"].item() == B * len(range(0, T, 7))
    torch.testing.assert_close(out.loss, out.metrics["mlm_loss"] + out.metrics["sop_loss"])
    assert all(p.grad is not None for p in model.parameters())


def test_loss_falls_when_overfitting_a_tiny_batch():
    torch.manual_seed(0)
    model = AlbertForPreTraining(tiny())
    b = batch(B=4, T=16)
    b["next_sentence_label"] = torch.tensor([0, 1, 1, 0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        out = model(**b)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_mlm_only_and_missing_labels():
    b = batch()
    model = AlbertForPreTraining(tiny(sop=False))
    b.pop("next_sentence_label")
    out = model(**b)
    assert set(out.metrics) == {"mlm_loss", "mlm_acc", "n_pred"}
    assert not any(k.startswith("sop_classifier") for k in to_hf(model, "albert")[1])
    with pytest.raises(ValueError, match="next_sentence_label"):
        AlbertForPreTraining(tiny())(**b)
    b.pop("labels")
    with pytest.raises(ValueError, match="labels"):
        model(**b)
    empty = model(**batch() | {"labels": torch.full((3, 12), -100)})
    assert empty.loss.item() == 0.0 and empty.metrics["n_pred"].item() == 0


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="AlbertConfig.share"):
        tiny(share="layers")
    with pytest.raises(ValueError, match="AlbertConfig.d_model"):
        tiny(n_head=5)
    with pytest.raises(ValueError, match="AlbertConfig.activation"):
        tiny(activation="relu")
    with pytest.raises(ValueError, match="AlbertConfig.embedding_size"):
        tiny(embedding_size=0)
    with pytest.raises(ValueError, match="AlbertConfig.pad_token_id"):
        tiny(pad_token_id=VOCAB)
    with pytest.raises(ValueError, match="max_seq_len"):
        AlbertForPreTraining(tiny()).backbone.hidden_states(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match="share='attention'"):
        to_hf(AlbertForPreTraining(tiny(share="attention")), "albert")


def test_empty_rows_stay_finite():
    torch.manual_seed(0)
    model = AlbertForPreTraining(tiny()).eval()
    b = batch()
    b["attention_mask"][1] = 0  # a sample with nothing real in it
    with torch.no_grad():
        states = model.backbone.hidden_states(b["input_ids"], b["attention_mask"], b["token_type_ids"])
        out = model(**b)
    assert all(torch.isfinite(h).all() for h in states) and torch.isfinite(out.loss)
