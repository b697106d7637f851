"""GPT (ctxmodels.gpt): parity with Hugging Face OpenAI GPT / GPT-2, causality, sizes, training."""

from __future__ import annotations

import json
import time

import pytest
import torch

from ctxmodels.gpt import PRESETS, GPTConfig, GPTForPreTraining
from ctxmodels.hf import from_hf, to_hf
from ctxmodels.outputs import PretrainOutput

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

torch.set_num_threads(1)


def tiny(norm: str, **overrides) -> GPTConfig:
    fields = dict(vocab_size=97, d_model=32, n_layer=2, n_head=4, d_ff=128, max_seq_len=24, dropout=0.0, norm=norm)
    return GPTConfig(**(fields | overrides))


def hf_reference(norm: str):
    """A randomly initialised HF model of the tiny size, every weight (LayerNorms too) perturbed."""
    torch.manual_seed(0)
    if norm == "post":
        hf_cfg = transformers.OpenAIGPTConfig(
            vocab_size=97, n_positions=24, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        model = transformers.OpenAIGPTLMHeadModel(hf_cfg)
    else:
        hf_cfg = transformers.GPT2Config(
            vocab_size=97, n_positions=24, n_embd=32, n_layer=2, n_head=4, n_inner=80,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
        model = transformers.GPT2LMHeadModel(hf_cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def batch(B: int = 3, T: int = 11, vocab: int = 97, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 7:] = 0  # right padding, as our packed batches have
    mask[2, 4:] = 0
    return ids, mask


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_parity_with_hugging_face(norm):
    hf = hf_reference(norm)
    family, cfg, model = from_hf(hf.config.to_dict(), hf.state_dict())
    model.eval()
    assert family == "gpt" and cfg.norm == norm and cfg.d_ff == (128 if norm == "post" else 80)
    ids, mask = batch()
    for attention_mask in (None, mask):
        with torch.no_grad():
            ref = hf(ids, attention_mask=attention_mask, output_hidden_states=True)
            ours = model.backbone.hidden_states(ids, attention_mask)
            logits = model.logits(ids, attention_mask)
        real = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else mask.bool()
        assert len(ours) == len(ref.hidden_states) == cfg.n_layer + 1
        for a, b in zip(ours, ref.hidden_states):
            torch.testing.assert_close(a[real], b[real], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[real], ref.logits[real], atol=1e-4, rtol=1e-4)

    # Same loss as HF's shifted causal-LM loss with -100 labels.
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref_loss = hf(ids, attention_mask=mask, labels=labels).loss
        out = model(ids, attention_mask=mask)
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_to_hf_loads_in_transformers(norm, tmp_path):
    torch.manual_seed(0)
    model = GPTForPreTraining(tiny(norm)).eval()
    hf_config, state_dict = to_hf(model, "gpt")
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    safetensors_torch.save_file(state_dict, str(tmp_path / "model.safetensors"))
    cls = transformers.OpenAIGPTLMHeadModel if norm == "post" else transformers.GPT2LMHeadModel
    hf = cls.from_pretrained(tmp_path).eval()
    ids, mask = batch()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits
        ours = model.logits(ids, mask)
    torch.testing.assert_close(ours[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=1e-4)
    # And back again, bit for bit.
    _, _, again = from_hf(hf_config, state_dict)
    for name, t in model.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_causal_no_position_sees_the_future(norm):
    torch.manual_seed(0)
    model = GPTForPreTraining(tiny(norm)).eval()
    ids, _ = batch(B=3, T=12)
    changed = ids.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 97
    with torch.no_grad():
        before = model.backbone.hidden_states(ids)
        after = model.backbone.hidden_states(changed)
        padded = model.backbone.hidden_states(changed, torch.ones_like(ids).index_fill(1, torch.tensor([11]), 0))
    for layer, (a, b, c) in enumerate(zip(before, after, padded)):
        torch.testing.assert_close(a[:, :8], b[:, :8], atol=1e-6, rtol=0, msg=f"layer {layer}")
        torch.testing.assert_close(b[:, :11], c[:, :11], atol=1e-5, rtol=1e-5, msg=f"layer {layer}")
        assert not torch.allclose(a[:, 8], b[:, 8]), f"layer {layer}: position 8 ignored its own token"


@pytest.mark.parametrize(("preset", "expected", "rel"), [("base", 117e6, 0.03), ("gpt2-small", 124e6, 0.02)])
def test_parameter_count(preset, expected, rel):
    with torch.device("meta"):
        model = GPTForPreTraining(PRESETS[preset])
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - expected) / expected < rel, f"{preset}: {n / 1e6:.1f}M parameters"


@pytest.mark.parametrize("preset", ["tiny", "gpt2-tiny"])
def test_tiny_forward_backward_is_fast(preset):
    torch.manual_seed(0)
    cfg = PRESETS[preset]
    model = GPTForPreTraining(cfg)
    ids = torch.randint(0, cfg.vocab_size, (8, 128))
    mask = torch.ones_like(ids)
    mask[0, 100:] = 0
    model(ids, attention_mask=mask).loss.backward()  # warm-up
    start = time.perf_counter()
    out = model(ids, attention_mask=mask)
    out.loss.backward()
    assert time.perf_counter() - start < 1.0
    assert isinstance(out, PretrainOutput) and out.loss.requires_grad
    assert set(out.metrics) == {"lm_loss", "lm_acc", "n_pred"}
    assert all(m.ndim == 0 and not m.requires_grad for m in out.metrics.values())
    assert out.metrics["n_pred"].item() == 8 * 127 - 28  # padded targets are not predicted
    assert all(p.grad is not None for p in model.parameters())


def test_labels_are_shifted_inside_the_model():
    torch.manual_seed(0)
    model = GPTForPreTraining(tiny("pre")).eval()
    ids, mask = batch()
    labels = torch.full_like(ids, -100)
    labels[0, 5] = ids[0, 5]  # one target: predicted from position 4
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels)
        logits = model.logits(ids, mask)
    expected = torch.nn.functional.cross_entropy(logits[0, 4:5], ids[0, 5:6])
    assert out.metrics["n_pred"].item() == 1
    torch.testing.assert_close(out.loss, expected)
    empty = model(ids, labels=torch.full_like(ids, -100))
    assert empty.loss.item() == 0.0 and empty.metrics["n_pred"].item() == 0


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_loss_falls_when_overfitting_a_tiny_batch(norm):
    torch.manual_seed(0)
    model = GPTForPreTraining(tiny(norm, dropout=0.1))
    ids, mask = batch(B=4, T=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        out = model(ids, attention_mask=mask)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="GPTConfig.norm"):
        tiny("middle")
    with pytest.raises(ValueError, match="GPTConfig.d_model"):
        tiny("post", n_head=5)
    with pytest.raises(ValueError, match="GPTConfig.activation"):
        tiny("post", activation="relu")
    with pytest.raises(ValueError, match="GPTConfig.vocab_size"):
        tiny("post", vocab_size=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        GPTForPreTraining(tiny("post"))(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match="d_ff"):
        to_hf(GPTForPreTraining(tiny("post", d_ff=80)), "gpt")


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_left_padding_and_empty_rows_stay_finite(norm):
    torch.manual_seed(0)
    model = GPTForPreTraining(tiny(norm)).eval()
    ids, _ = batch(B=3, T=10)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: the first queries see no real key
    mask[1] = 0  # nothing real at all
    with torch.no_grad():
        states = model.backbone.hidden_states(ids, mask)
        out = model(ids, attention_mask=mask)
        alone = model.backbone.hidden_states(ids[2:], mask[2:])
    assert all(torch.isfinite(h).all() for h in states) and torch.isfinite(out.loss)
    for h, a in zip(states, alone):  # rows do not leak into each other
        torch.testing.assert_close(h[2:], a, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_decode_step_with_the_cache_equals_the_full_forward(norm):
    """The prompt, then one token (and once three) at a time: every step's scores are the full
    forward's last-position scores, up to the last position max_seq_len allows."""
    torch.manual_seed(0)
    model = GPTForPreTraining(tiny(norm)).eval()
    ids, _ = batch(B=3, T=24)
    with torch.no_grad():
        full = model.logits(ids)  # (B, T, V)
        logits, cache = model.decode_step(ids[:, :5])
        torch.testing.assert_close(logits, full[:, 4], atol=1e-5, rtol=0)
        t = 5
        while t < 24:
            n = 3 if t == 10 else 1
            logits, cache = model.decode_step(ids[:, t : t + n], cache)
            t += n
            assert cache.length == t
            torch.testing.assert_close(logits, full[:, t - 1], atol=1e-5, rtol=0, msg=f"step to {t}")
        with pytest.raises(ValueError, match="position 24 but max_seq_len is 24"):
            model.decode_step(ids[:, :1], cache)


def test_cached_greedy_continuation_equals_hugging_face_generate(tmp_path):
    """A tiny GPT-2 of ours, exported to transformers: our cached greedy loop writes the tokens that
    ``GPT2LMHeadModel.generate(do_sample=False, use_cache=True)`` writes, to the last position."""
    torch.manual_seed(0)
    model = GPTForPreTraining(tiny("pre", init_std=0.1)).eval()
    hf_config, state_dict = to_hf(model, "gpt")
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    safetensors_torch.save_file(state_dict, str(tmp_path / "model.safetensors"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    hf.generation_config.eos_token_id = None  # generate to max_new_tokens, as our loop below
    hf.generation_config.pad_token_id = 0
    for prompt_len in (1, 6, 13):
        prompt = torch.randint(0, 97, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
        n_new = 24 - prompt_len
        with torch.no_grad():
            ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_new, min_new_tokens=n_new,
                              do_sample=False, use_cache=True)[0, prompt_len:].tolist()
            ours, cache, unread = [], None, prompt
            for _ in range(n_new):
                logits, cache = model.decode_step(unread, cache)
                ours.append(int(logits[0].argmax()))
                unread = torch.tensor([[ours[-1]]])
        assert ours == ref, prompt_len
        assert len(set(ours)) > 1  # a continuation that says something about the cache, not one token repeated
