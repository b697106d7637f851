"""ELMo: shapes, directional causality, padding, state carry, scalar mix, loss, preset sizes."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch

from ctxmodels.elmo import (
    PRESETS,
    ElmoConfig,
    ElmoForPreTraining,
    ElmoModel,
    ProjectedLSTM,
    ScalarMix,
    reverse_within_length,
)
from ctxmodels.outputs import PretrainOutput
from pipelines.char_ids import CHAR_VOCAB_SIZE, add_char_ids, build_char_table

torch.set_num_threads(1)


def tiny(**overrides) -> ElmoConfig:
    return dataclasses.replace(PRESETS["tiny"], dropout=0.0, **overrides)


def random_chars(B: int, T: int, cfg: ElmoConfig, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, cfg.char_vocab_size, (B, T, cfg.max_chars), generator=g)


def right_mask(lengths: list[int], T: int) -> torch.Tensor:
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()  # (B, T)


CLIPS = {"stepwise": {}, "fused": {"cell_clip": None, "proj_clip": None}}


@pytest.fixture(params=list(CLIPS))
def cfg(request) -> ElmoConfig:
    return tiny(**CLIPS[request.param])


def make(cls, cfg: ElmoConfig, seed: int = 0):
    torch.manual_seed(seed)
    return cls(cfg).eval()


# ----------------------------------------------------------------------------- shapes & speed


def test_hidden_states_shapes(cfg):
    model = make(ElmoModel, cfg)
    hs = model.hidden_states(random_chars(2, 7, cfg))
    assert len(hs) == cfg.n_layer + 1
    assert all(h.shape == (2, 7, 2 * cfg.d_model) for h in hs)
    D = cfg.d_model
    assert torch.equal(hs[0][..., :D], hs[0][..., D:])  # [x; x]


def test_tiny_forward_backward_is_fast():
    cfg = PRESETS["tiny"]
    model = ElmoForPreTraining(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (4, 32))
    chars = random_chars(4, 32, cfg)
    model(chars, ids).loss.backward()  # warm-up
    start = time.perf_counter()
    out = model(chars, ids, attention_mask=right_mask([32, 30, 20, 5], 32))
    out.loss.backward()
    assert time.perf_counter() - start < 1.0


# ----------------------------------------------------------------------------- causality


@pytest.mark.parametrize("padded", [False, True])
def test_each_direction_sees_only_its_side(cfg, padded):
    model = make(ElmoModel, cfg)
    T, t, D = 10, 4, cfg.d_model
    mask = right_mask([8 if padded else T], T)
    chars = random_chars(1, T, cfg)
    changed = chars.clone()
    changed[0, t] = random_chars(1, 1, cfg, seed=1)[0, 0]
    before, after = model(chars, mask), model(changed, mask)
    for k in range(cfg.n_layer):
        f0, f1 = before.fwd[k][0], after.fwd[k][0]  # (T, D)
        b0, b1 = before.bwd[k][0], after.bwd[k][0]
        assert torch.equal(f0[:t], f1[:t]), f"forward layer {k + 1} saw the future"
        assert torch.equal(b0[t + 1 :], b1[t + 1 :]), f"backward layer {k + 1} saw the past"
        assert not torch.allclose(f0[t], f1[t]) and not torch.allclose(b0[t], b1[t])
    hs0, hs1 = model.hidden_states(chars, mask), model.hidden_states(changed, mask)
    for k in range(1, cfg.n_layer + 1):  # the same, read through the public (B, T, 2D) layout
        assert torch.equal(hs0[k][0, :t, :D], hs1[k][0, :t, :D])
        assert torch.equal(hs0[k][0, t + 1 :, D:], hs1[k][0, t + 1 :, D:])
    assert torch.equal(hs0[0][0, torch.arange(T) != t], hs1[0][0, torch.arange(T) != t])


# ----------------------------------------------------------------------------- padding


def test_padded_row_equals_unpadded_row(cfg):
    model = make(ElmoModel, cfg)
    T, n = 12, 7
    chars = random_chars(2, T, cfg)
    mask = right_mask([n, T], T)
    chars_padded = chars * mask[..., None]  # what add_char_ids gives padding
    batch = model.hidden_states(chars_padded, mask)
    alone = model.hidden_states(chars[:1, :n])
    full = model.hidden_states(chars[1:])
    for k in range(cfg.n_layer + 1):
        torch.testing.assert_close(batch[k][0, :n], alone[k][0])
        torch.testing.assert_close(batch[k][1], full[k][0])
        assert (batch[k][0, n:] == 0).all()


def test_padding_is_ignored_by_the_loss(cfg):
    model = make(ElmoForPreTraining, cfg)
    T, n = 10, 6
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    mask = right_mask([n], T)
    padded = model(random_chars(1, T, cfg) * mask[..., None], ids, attention_mask=mask)
    alone = model(random_chars(1, T, cfg)[:, :n], ids[:, :n])
    torch.testing.assert_close(padded.loss, alone.loss)
    assert padded.metrics["n_pred"] == n - 1


def test_left_padding_is_rejected():
    cfg = tiny()
    with pytest.raises(ValueError, match="right-padded"):
        make(ElmoModel, cfg)(random_chars(1, 4, cfg), torch.tensor([[0, 1, 1, 1]]))


def test_reverse_within_length_is_an_involution():
    x = torch.arange(12.0).reshape(2, 6)
    lengths = torch.tensor([4, 6])
    r = reverse_within_length(x, lengths)
    assert r.tolist() == [[3, 2, 1, 0, 4, 5], [11, 10, 9, 8, 7, 6]]
    assert torch.equal(reverse_within_length(r, lengths), x)


# ----------------------------------------------------------------------------- LSTM paths


def test_stepwise_lstm_matches_torch_kernel():
    torch.manual_seed(0)
    fused = ProjectedLSTM(5, 7, 3, cell_clip=None, proj_clip=None)
    stepwise = ProjectedLSTM(5, 7, 3, cell_clip=1e9, proj_clip=1e9)
    stepwise.load_state_dict(fused.state_dict())
    x = torch.randn(3, 6, 5)
    mask = right_mask([6, 4, 0], 6).bool()
    state = (torch.randn(3, 3), torch.randn(3, 7))
    out_f, (h_f, c_f) = fused(x, mask, state)
    out_s, (h_s, c_s) = stepwise(x, mask, state)
    torch.testing.assert_close(out_s, out_f)
    torch.testing.assert_close(h_s, h_f)
    torch.testing.assert_close(c_s, c_f)
    torch.testing.assert_close(h_s[2], state[0][2])  # an empty row keeps its state
    # state after a padded row's last real token equals running only its real tokens
    _, (h_4, c_4) = fused(x[1:2, :4], mask[1:2, :4], (state[0][1:2], state[1][1:2]))
    torch.testing.assert_close(h_f[1:2], h_4)
    torch.testing.assert_close(c_f[1:2], c_4)


def test_clipping_bounds_projection_and_cell():
    torch.manual_seed(0)
    lstm = ProjectedLSTM(4, 6, 3, cell_clip=0.5, proj_clip=0.1)
    out, (h, c) = lstm(10 * torch.randn(2, 5, 4), torch.ones(2, 5, dtype=torch.bool))
    assert out.abs().max() <= 0.1 + 1e-6 and c.abs().max() <= 0.5 + 1e-6


# ----------------------------------------------------------------------------- scalar mix


@pytest.mark.parametrize("do_layer_norm", [False, True])
def test_scalar_mix_equals_formula(do_layer_norm):
    torch.manual_seed(0)
    layers = [torch.randn(2, 3, 8) for _ in range(3)]
    mix = ScalarMix(3, do_layer_norm=do_layer_norm)
    with torch.no_grad():
        mix.scalars.copy_(torch.tensor([0.3, -1.0, 2.0]))
        mix.gamma.fill_(1.7)
    s = torch.exp(mix.scalars) / torch.exp(mix.scalars).sum()
    if do_layer_norm:
        layers_n = [(h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + 1e-5) for h in layers]
    else:
        layers_n = layers
    expected = 1.7 * (s[0] * layers_n[0] + s[1] * layers_n[1] + s[2] * layers_n[2])
    torch.testing.assert_close(mix(layers), expected)
    torch.testing.assert_close(ScalarMix(3)(layers), sum(layers) / 3)  # uniform at init


def test_elmo_representation_shape_and_grad():
    cfg = tiny()
    model = make(ElmoModel, cfg)
    mix = ScalarMix(cfg.n_layer + 1)
    rep = model.elmo_representation(random_chars(2, 5, cfg), right_mask([5, 3], 5), mix)
    assert rep.shape == (2, 5, 2 * cfg.d_model)
    rep.sum().backward()
    assert mix.scalars.grad is not None and mix.gamma.grad is not None


# ----------------------------------------------------------------------------- pretraining loss


def test_loss_and_metrics(cfg):
    model = make(ElmoForPreTraining, cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 9))
    mask = right_mask([9, 5, 2], 9)
    out = model(random_chars(3, 9, cfg) * mask[..., None], ids, attention_mask=mask)
    assert isinstance(out, PretrainOutput) and out.loss.requires_grad
    m = out.metrics
    assert set(m) == {"lm_loss", "fwd_loss", "bwd_loss", "lm_acc", "n_pred"}
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())
    assert m["n_pred"] == 8 + 4 + 1
    torch.testing.assert_close(out.loss.detach(), m["fwd_loss"] + m["bwd_loss"])
    torch.testing.assert_close(m["lm_loss"], out.loss.detach() / 2)
    assert abs(m["lm_loss"].item() - np.log(cfg.vocab_size)) < 1.0  # near uniform at init


def test_untied_softmax_has_its_own_head():
    cfg = tiny(tie_softmax=False)
    model = make(ElmoForPreTraining, cfg)
    assert model.lm_head_bwd is not None
    ids = torch.randint(0, cfg.vocab_size, (2, 6))
    model(random_chars(2, 6, cfg), ids).loss.backward()
    assert model.lm_head_bwd.weight.grad is not None


def test_loss_falls_when_overfitting_one_batch():
    cfg = tiny()
    torch.manual_seed(0)
    model = ElmoForPreTraining(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (4, 16))
    mask = right_mask([16, 16, 12, 9], 16)
    table = torch.from_numpy(build_char_table([f"tok{i}" for i in range(cfg.vocab_size)], cfg.max_chars)).long()
    chars = table[ids] * mask[..., None]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        out = model(chars, ids, attention_mask=mask)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.metrics["lm_loss"].item())
    # Random targets: ~ln(1000) = 6.9 at start, the batch's unigram entropy (~4) after a few steps,
    # then memorising sequences from context.
    assert losses[-1] < 0.6 * losses[0], losses


# ----------------------------------------------------------------------------- state carry


def test_forward_state_carry_equals_one_pass(cfg):
    model = make(ElmoModel, cfg)
    chars = random_chars(2, 12, cfg)
    whole = model(chars)
    first = model(chars[:, :5])
    second = model(chars[:, 5:], fwd_state=first.fwd_state)
    for k in range(cfg.n_layer):
        torch.testing.assert_close(torch.cat([first.fwd[k], second.fwd[k]], dim=1), whole.fwd[k])
    for (h, c), (h_w, c_w) in zip(second.fwd_state, whole.fwd_state):
        torch.testing.assert_close(h, h_w)
        torch.testing.assert_close(c, c_w)


def test_reset_memory_zeroes_the_carried_state_of_its_row_only():
    cfg = tiny()
    model = make(ElmoForPreTraining, cfg)
    chars = random_chars(2, 10, cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    a, b = slice(0, 6), slice(6, 10)
    model(chars[:, a], ids[:, a], reset_memory=torch.tensor([1, 1]))
    carried = model(chars[:, b], ids[:, b], reset_memory=torch.tensor([0, 1]))
    fresh = model.backbone(chars[:, b]).fwd_state  # both rows from zero state
    whole = model.backbone(chars).fwd_state  # both rows continued
    for (h, c), (h_f, c_f), (h_w, c_w) in zip(model.fwd_memory, fresh, whole):
        torch.testing.assert_close(h[0], h_w[0])  # row 0 continued its stream
        torch.testing.assert_close(c[0], c_w[0])
        torch.testing.assert_close(h[1], h_f[1])  # row 1 was reset
        torch.testing.assert_close(c[1], c_f[1])
    # Only the forward loss depends on the carried state.
    model.clear_memory()
    stateless = model(chars[:, b], ids[:, b])
    assert not torch.allclose(carried.metrics["fwd_loss"], stateless.metrics["fwd_loss"])
    torch.testing.assert_close(carried.metrics["bwd_loss"], stateless.metrics["bwd_loss"])


def test_carried_state_needs_a_constant_batch_size():
    cfg = tiny()
    model = make(ElmoForPreTraining, cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 4))
    model(random_chars(3, 4, cfg), ids, reset_memory=torch.ones(3, dtype=torch.long))
    model(random_chars(2, 4, cfg), ids[:2], reset_memory=torch.ones(2, dtype=torch.long))  # all reset: fine
    with pytest.raises(ValueError, match="constant batch size"):
        model(random_chars(3, 4, cfg), ids, reset_memory=torch.zeros(3, dtype=torch.long))


# ----------------------------------------------------------------------------- config & presets


def analytic_bilm_params(cfg: ElmoConfig) -> int:
    E, D, H = cfg.char_embed_dim, cfg.d_model, cfg.lstm_dim
    n_filters = sum(n for _, n in cfg.filters)
    char_cnn = (
        cfg.char_vocab_size * E
        + sum(w * E * n + n for w, n in cfg.filters)
        + cfg.n_highway * (n_filters * 2 * n_filters + 2 * n_filters)
        + n_filters * D
        + D
    )
    lstm = 4 * H * D + 4 * H * D + 2 * 4 * H + H * D  # W_ih, W_hh, two biases (torch), W_hr
    return char_cnn + 2 * cfg.n_layer * lstm


def test_base_preset_parameter_count():
    cfg = PRESETS["base"]
    assert sum(n for _, n in cfg.filters) == 2048 and cfg.d_model == 512 and cfg.lstm_dim == 4096
    with torch.device("meta"):
        model = ElmoForPreTraining(cfg)
    bilm = sum(p.numel() for p in model.backbone.parameters())
    assert bilm == analytic_bilm_params(cfg) == 93_666_400
    # AllenNLP's "Original" ELMo: 93.6M without softmax (TF keeps one LSTM bias: 65,536 fewer).
    assert 93.5e6 < bilm < 93.8e6
    softmax = sum(p.numel() for p in model.lm_head.parameters())
    assert softmax == cfg.vocab_size * (cfg.d_model + 1)  # 15.7M for 30522 pieces
    assert analytic_bilm_params(PRESETS["tiny"]) == sum(p.numel() for p in ElmoModel(PRESETS["tiny"]).parameters())


def test_config_validation_and_json_round_trip():
    cfg = PRESETS["tiny"]
    loaded = ElmoConfig(**json.loads(json.dumps(dataclasses.asdict(cfg))))
    assert loaded == cfg and isinstance(loaded.filters[0], tuple)
    with pytest.raises(ValueError, match="filters"):
        dataclasses.replace(cfg, filters=((60, 8),))
    with pytest.raises(ValueError, match="activation"):
        dataclasses.replace(cfg, activation="gelu")


def test_char_table_feeds_the_model_end_to_end():
    cfg = tiny()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(cfg.vocab_size - 5)]
    table = build_char_table(vocab, cfg.max_chars, {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4})
    assert table.shape[1] == cfg.max_chars and table.max() < cfg.char_vocab_size == CHAR_VOCAB_SIZE
    ids = np.array([[2, 10, 11, 3, 0], [2, 12, 13, 14, 3]])
    batch = add_char_ids({"input_ids": ids, "attention_mask": (ids != 0).astype(np.int64)}, table)
    tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
    out = make(ElmoForPreTraining, cfg)(**tensors)
    assert torch.isfinite(out.loss) and out.metrics["n_pred"] == 3 + 4
