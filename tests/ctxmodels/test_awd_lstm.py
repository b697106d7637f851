"""AWD-LSTM (ctxmodels/awd_lstm.py): each dropout's mask shape and sharing, weight dropout per step
and not at evaluation, variable-length BPTT windows, carried state, AR/TAR, decoding."""

from __future__ import annotations

import dataclasses
import time
import warnings

import pytest
import torch

from ctxmodels.awd_lstm import (
    AwdLstmForPreTraining,
    WeightDropLSTM,
    bptt_windows,
    embedding_dropout,
    locked_dropout,
)
from ctxmodels.registry import build_model, make_config

V = 50
NO_DROPOUT = {"dropout": 0.0, "dropout_hidden": 0.0, "dropout_input": 0.0, "dropout_embed": 0.0, "dropout_weight": 0.0}


def tiny(seed: int = 0, **overrides) -> AwdLstmForPreTraining:
    return build_model("awd-lstm", "tiny", {"vocab_size": V, **overrides}, seed=seed)[1]


def ids(B: int = 3, T: int = 20, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_embedding_dropout_drops_whole_words_and_rescales():
    torch.manual_seed(0)
    weight = torch.randn(V, 8)
    x = torch.arange(V).repeat(4).reshape(4, V)  # every word type at four positions
    out = embedding_dropout(weight, x, 0.5, training=True)  # (4, V, 8)
    ratio = out / weight[x]  # 0 or 2 everywhere
    dropped = (out == 0).all(dim=-1)  # (4, V)
    assert torch.equal(dropped, dropped[:1].expand_as(dropped))  # a word is dropped at all its positions or none
    assert 0 < int(dropped[0].sum()) < V
    torch.testing.assert_close(ratio[~dropped], torch.full_like(ratio[~dropped], 2.0))
    assert torch.equal(embedding_dropout(weight, x, 0.5, training=False), weight[x])


def test_locked_dropout_has_one_mask_per_sequence_over_time():
    torch.manual_seed(0)
    x = torch.ones(4, 30, 16)
    out = locked_dropout(x, 0.4, training=True)
    assert torch.equal(out, out[:, :1].expand_as(out))  # (B, 1, C): the same units at every step
    assert not torch.equal(out[0], out[1])  # each row its own mask
    values = out.unique()
    assert len(values) == 2 and values[0] == 0 and values[1] == pytest.approx(1 / 0.6, rel=1e-4)
    assert torch.equal(locked_dropout(x, 0.4, training=False), x)


def test_weight_dropout_changes_weight_hh_each_step_and_not_at_eval():
    torch.manual_seed(0)
    layer = WeightDropLSTM(8, 16, 0.5)
    torch.nn.init.uniform_(layer.weight_hh, 0.5, 1.0)  # no zeros of its own
    layer.train()
    a, b = layer.dropped_weight_hh(), layer.dropped_weight_hh()
    assert not torch.equal(a, b)  # a new mask each call (each training step)
    assert a.shape == layer.weight_hh.shape
    zero = a == 0
    assert 0.4 < zero.float().mean() < 0.6
    torch.testing.assert_close(a[~zero], 2.0 * layer.weight_hh.detach()[~zero])
    layer.eval()
    assert layer.dropped_weight_hh() is layer.weight_hh


def test_weight_dropout_reaches_the_recurrence_and_its_gradient():
    model = tiny(**{**NO_DROPOUT, "dropout_weight": 0.5, "bptt": 0}).train()
    x = ids()
    torch.manual_seed(1)
    h1 = model.backbone(x).raw[-1]
    torch.manual_seed(2)
    h2 = model.backbone(x).raw[-1]
    assert not torch.allclose(h1, h2)  # different DropConnect masks, different outputs
    h1.sum().backward()
    assert all(layer.weight_hh.grad is not None and layer.weight_hh.grad.abs().sum() > 0 for layer in model.backbone.layers)
    model.eval()
    torch.testing.assert_close(model.backbone(x).raw[-1], model.backbone(x).raw[-1])


def test_tiny_preset_trains_fast_without_warnings():
    model = tiny().train()
    x = ids(B=8, T=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t0 = time.perf_counter()
        out = model(input_ids=x, reset_memory=torch.ones(8, dtype=torch.long))
        out.loss.backward()
        elapsed = time.perf_counter() - t0
    assert elapsed < 1.0
    assert torch.isfinite(out.loss) and {"lm_loss", "lm_acc", "n_pred", "ar", "tar"} <= out.metrics.keys()
    assert all(p.grad is not None for p in model.parameters())
    cfg = model.config
    assert [layer.weight_hh.shape[1] for layer in model.backbone.layers] == [cfg.lstm_dim, cfg.lstm_dim, cfg.d_model]
    assert model.logits(torch.zeros(cfg.d_model)).shape == (V,)


def test_paper_preset_sizes():
    cfg = make_config("awd-lstm", "base")
    assert (cfg.d_model, cfg.lstm_dim, cfg.n_layer, cfg.bptt) == (400, 1150, 3, 70)
    assert cfg.widths() == [(400, 1150), (1150, 1150), (1150, 400)]
    assert (cfg.ar_alpha, cfg.tar_beta) == (2.0, 1.0)


def test_bptt_windows_follow_the_papers_draw():
    g = torch.Generator().manual_seed(0)
    draws = [bptt_windows(10_000, 70, g) for _ in range(5)]
    assert all(sum(w) == 10_000 for w in draws)
    lengths = torch.tensor([n for w in draws for n in w[:-1]], dtype=torch.float)
    assert lengths.min() >= 5
    near_half = ((lengths - 35).abs() < 20).float().mean()  # the 5% drawn around bptt / 2
    assert 0.02 < near_half < 0.09
    assert abs(float(lengths[(lengths - 70).abs() < 20].mean()) - 70) < 1.0
    assert bptt_windows(64, 0) == [64]


def test_windows_cut_the_gradient_but_not_the_values():
    model = tiny(**NO_DROPOUT).train()
    x = torch.arange(20).expand(2, 20)  # distinct token at every position
    whole = model.backbone(x)
    cut = model.backbone(x, windows=[8, 12])
    torch.testing.assert_close(cut.raw[-1], whole.raw[-1])
    cut.raw[-1][:, 10].sum().backward()
    grad = model.backbone.embed.weight.grad  # rows = positions here
    assert grad[:8].abs().sum() == 0  # before the cut: no gradient through the detached state
    assert grad[8:11].abs().sum() > 0


def test_variable_bptt_loss_weights_every_token_alike(monkeypatch):
    """One mean over the batch's tokens whatever the windows: the loss (and so each token's weight)
    is the same with windows [5, 15] or none, so the paper's lr * seq_len / bptt is not needed."""
    from ctxmodels import awd_lstm

    model = tiny(**NO_DROPOUT, bptt=10).train()
    x = ids(T=20)
    monkeypatch.setattr(awd_lstm, "bptt_windows", lambda T, bptt: [5, 15])
    windowed = model(input_ids=x).loss
    model.eval()
    torch.testing.assert_close(windowed, model(input_ids=x).loss)


def test_state_is_carried_across_stream_ordered_batches_and_reset():
    model = tiny(**NO_DROPOUT).eval()
    x = ids(B=2, T=30)
    full = model.backbone(x).raw[-1]
    zeros, ones = torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.long)
    model(input_ids=x[:, :12], reset_memory=ones)
    state = model._initial_state(x[:, 12:], zeros)
    torch.testing.assert_close(model.backbone(x[:, 12:], state).raw[-1], full[:, 12:])
    model(input_ids=x[:, :12], reset_memory=ones)
    mixed = model._initial_state(x[:, 12:], torch.tensor([1, 0]))  # row 0 starts a new stream
    assert all(h[0].abs().sum() == 0 and h[1].abs().sum() > 0 for h, _ in mixed)
    with pytest.raises(ValueError, match="constant batch size"):
        model(input_ids=x[:1], reset_memory=zeros[:1])


def test_loss_is_nll_plus_ar_and_tar():
    model = tiny(ar_alpha=2.0, tar_beta=1.0).train()
    torch.manual_seed(0)
    out = model(input_ids=ids(), attention_mask=torch.ones(3, 20, dtype=torch.long).index_fill_(1, torch.arange(15, 20), 0))
    m = out.metrics
    torch.testing.assert_close(out.loss.detach(), m["lm_loss"] + 2.0 * m["ar"] + 1.0 * m["tar"])
    assert int(m["n_pred"]) == 3 * 14  # padding is never a target


def test_decode_step_equals_the_full_forward():
    model = tiny().eval()
    x = ids(B=1, T=12)
    full = model.logits(model.backbone(x).dropped[-1])  # (1, T, V)
    logits, state = model.decode_step(x[:, :7])
    torch.testing.assert_close(logits, full[:, 6])
    for t in range(7, 12):
        logits, state = model.decode_step(x[:, t : t + 1], state)
        torch.testing.assert_close(logits, full[:, t], rtol=1e-5, atol=1e-5)


def test_hidden_states_have_every_layer_and_ignore_right_padding():
    model = tiny().eval()
    x = ids(B=2, T=10)
    states = model.backbone.hidden_states(x)
    cfg = model.config
    assert [s.shape[-1] for s in states] == [cfg.d_model, cfg.lstm_dim, cfg.lstm_dim, cfg.d_model]
    padded = model.backbone.hidden_states(torch.cat([x, torch.zeros(2, 4, dtype=torch.long)], 1))
    for a, b in zip(states, padded):
        torch.testing.assert_close(b[:, :10], a)


def test_config_refuses_bad_values():
    cfg = make_config("awd-lstm", "tiny")
    with pytest.raises(ValueError, match="dropout_weight"):
        dataclasses.replace(cfg, dropout_weight=1.0)
    with pytest.raises(ValueError, match="bptt"):
        dataclasses.replace(cfg, bptt=-1)
