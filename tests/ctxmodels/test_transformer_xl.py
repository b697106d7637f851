"""Transformer-XL checked without a reference implementation (transformers 5 dropped it):
the paper's score formula by loops, recurrence against one masked pass, causality, stop-gradient,
per-row memory reset, a longer evaluation memory, the base size, and a tiny overfit."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from ctxmodels.outputs import PretrainOutput
from ctxmodels.transformer_xl import (
    PRESETS,
    TransfoXLConfig,
    TransfoXLForPreTraining,
    TransfoXLModel,
    extend_memory,
    sinusoid_embedding,
)

torch.set_num_threads(1)

TINY = PRESETS["tiny"]


def tiny_model(seed: int = 0, **overrides) -> TransfoXLModel:
    cfg = dataclasses.replace(TINY, **overrides)
    return TransfoXLModel(cfg, generator=torch.Generator().manual_seed(seed)).eval()


def random_ids(B: int, T: int, seed: int, vocab: int = TINY.vocab_size) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="TransfoXLConfig.n_head"):
        dataclasses.replace(TINY, n_head=0)
    with pytest.raises(ValueError, match="TransfoXLConfig.layer_norm"):
        dataclasses.replace(TINY, layer_norm="middle")
    with pytest.raises(ValueError, match="TransfoXLConfig.mem_len"):
        dataclasses.replace(TINY, mem_len=-1)


def test_shifted_scores_equal_the_papers_formula_by_loops():
    """A_ij = q_i.k_j + q_i.W_R R_{i-j} + u.k_j + v.W_R R_{i-j}, with memory, for every j <= M + i."""
    model = tiny_model()
    attn = model.layers[0].attn
    B, T, M, D = 2, 4, 3, TINY.d_model
    H, Dh = TINY.n_head, TINY.d_model // TINY.n_head
    g = torch.Generator().manual_seed(1)
    h, mem = torch.randn(B, T, D, generator=g), torch.randn(B, M, D, generator=g)
    K = M + T
    pos_emb = sinusoid_embedding(torch.arange(K - 1, -1, -1), D)  # distances K - 1 ... 0
    with torch.no_grad():
        got = attn.attention_scores(h, mem, pos_emb)  # (B, H, T, K)
        cat = torch.cat([mem, h], dim=1)
        for b in range(B):
            for i in range(T):
                q = attn.q.weight @ h[b, i]  # (H * Dh,)
                for j in range(M + i + 1):
                    k = attn.k.weight @ cat[b, j]
                    R = sinusoid_embedding(torch.tensor([float(M + i - j)]), D)[0]  # R_{i-j}
                    wr = attn.r.weight @ R
                    for n in range(H):
                        s = slice(n * Dh, (n + 1) * Dh)
                        want = q[s] @ k[s] + q[s] @ wr[s] + attn.u[n] @ k[s] + attn.v_bias[n] @ wr[s]
                        torch.testing.assert_close(got[b, n, i, j], want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("layer_norm", ["post", "pre"])
def test_recurrence_equals_one_pass_with_the_same_window(layer_norm):
    """Segments with mem_len = L equal one pass where token t of segment s sees j in
    [start(s) - L, t]: the memory is exactly the previous segment's layer inputs."""
    L, S, B = 5, 3, 2
    model = tiny_model(layer_norm=layer_norm)
    ids = random_ids(B, S * L, seed=2)
    memory, per_segment = None, []
    with torch.no_grad():
        for s in range(S):
            hiddens = model(ids[:, s * L : (s + 1) * L], memory)
            per_segment.append(hiddens)
            memory = extend_memory(memory, hiddens[:-1], torch.ones(B, L, dtype=torch.bool), mem_len=L)
        recurrent = [torch.cat([seg[n] for seg in per_segment], dim=1) for n in range(TINY.n_layer + 1)]

        N = S * L
        t = torch.arange(N)[:, None]
        j = torch.arange(N)[None, :]
        start = (t // L) * L
        blocked = (j > t) | (j < start - L)  # (N, N)
        h = model.embed(ids)
        one_pass = [h]
        pos_emb = model.position_embedding(N, h)
        for layer in model.layers:
            h = layer(h, None, pos_emb, blocked[None])
            one_pass.append(h)
    for n, (a, b) in enumerate(zip(recurrent, one_pass)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"layer {n}")


def test_causal():
    model = tiny_model()
    ids = random_ids(2, 12, seed=3)
    changed = ids.clone()
    changed[:, 7] = (changed[:, 7] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model.hidden_states(ids), model.hidden_states(changed)
    assert len(a) == TINY.n_layer + 1 and all(x.shape == (2, 12, TINY.d_model) for x in a)
    for x, y in zip(a, b):
        torch.testing.assert_close(x[:, :7], y[:, :7])
    assert not torch.allclose(a[-1][:, 7:], b[-1][:, 7:])


def test_padding_keys_do_not_change_real_tokens():
    model = tiny_model()
    ids = random_ids(1, 10, seed=4)
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[:, 8:] = 0
    with torch.no_grad():
        full = model.hidden_states(ids, attention_mask=mask)
        short = model.hidden_states(ids[:, :8])
    torch.testing.assert_close(full[-1][:, :8], short[-1])
    assert torch.isfinite(full[-1]).all()


def pretrain_model(seed: int = 0, **overrides) -> TransfoXLForPreTraining:
    cfg = dataclasses.replace(TINY, **overrides)
    return TransfoXLForPreTraining(cfg, generator=torch.Generator().manual_seed(seed))


def test_no_gradient_flows_into_memory():
    model = pretrain_model(mem_len=8)
    model.train()
    out1 = model(input_ids=random_ids(2, 8, seed=5))
    out1.loss.backward()
    assert all(not s.requires_grad and s.grad_fn is None for s in model.memory.states)
    # If the memory were attached to batch 1's graph, this backward would walk into the freed graph.
    out2 = model(input_ids=random_ids(2, 8, seed=6))
    out2.loss.backward()
    assert model.memory.length == 8
    assert "memory" not in " ".join(model.state_dict())


def test_reset_memory_drops_only_that_rows_memory():
    L = 6
    model = pretrain_model(mem_len=2 * L).eval()
    batch1, batch2 = random_ids(2, L, seed=7), random_ids(2, L, seed=8)
    with torch.no_grad():
        model(input_ids=batch1)
        kept = [s.clone() for s in model.memory.states]
        model(input_ids=batch2, reset_memory=torch.tensor([0, 1]))
        after_reset = model.memory

        model.reset_all_memory()
        model(input_ids=batch1)
        model(input_ids=batch2)
        no_reset = model.memory

        fresh = model.backbone(batch2)  # row 1 must look like a stream that starts here

    for n in range(TINY.n_layer):
        # row 0 continued its stream: identical to the run without any reset
        torch.testing.assert_close(after_reset.states[n][0], no_reset.states[n][0])
        # row 1: its old memory is zeroed and masked, its new states are those of a fresh start
        assert (after_reset.states[n][1, :L] == 0).all()
        torch.testing.assert_close(after_reset.states[n][1, L:], fresh[n][1])
        torch.testing.assert_close(kept[n], no_reset.states[n][:, :L])
    assert after_reset.valid[0].all()
    assert not after_reset.valid[1, :L].any() and after_reset.valid[1, L:].all()


def test_reset_all_rows_equals_a_fresh_model_and_allows_a_new_batch_size():
    model = pretrain_model().eval()
    with torch.no_grad():
        model(input_ids=random_ids(2, 8, seed=9))
        with pytest.raises(ValueError, match="reset_memory"):
            model(input_ids=random_ids(3, 8, seed=10))
        after = model(input_ids=random_ids(3, 8, seed=10), reset_memory=torch.ones(3, dtype=torch.long))
        model.reset_all_memory()
        fresh = model(input_ids=random_ids(3, 8, seed=10))
    torch.testing.assert_close(after.loss, fresh.loss)


def test_longer_eval_memory_runs():
    L = 8
    model = pretrain_model(mem_len=L).eval()
    model.set_mem_len(4 * L)
    with torch.no_grad():
        for s in range(5):
            out = model(input_ids=random_ids(2, L, seed=20 + s))
            assert torch.isfinite(out.loss)
            assert model.memory.length == min((s + 1) * L, 4 * L)
    model.set_mem_len(L)  # shrinking keeps the most recent states
    assert model.memory.length == L and model.mem_len == L


def test_output_contract_and_skipped_last_target():
    model = pretrain_model()
    ids = random_ids(2, 8, seed=11)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    out = model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids),
                reset_memory=torch.ones(2, dtype=torch.long))
    assert isinstance(out, PretrainOutput) and out.loss.requires_grad and out.loss.dim() == 0
    assert set(out.metrics) == {"lm_loss", "lm_acc", "n_pred"}
    assert int(out.metrics["n_pred"]) == 7 + 5  # T - 1 targets per row, minus padding
    assert all(not v.requires_grad and v.dim() == 0 for v in out.metrics.values())
    assert model.memory.valid[1, 6:].logical_not().all()


def test_tiny_forward_backward_is_fast():
    model = pretrain_model()
    batch = {"input_ids": random_ids(8, TINY.max_seq_len, seed=12)}
    model(**batch).loss.backward()  # warm-up
    start = time.perf_counter()
    model(**batch).loss.backward()
    assert time.perf_counter() - start < 1.0


def test_base_parameter_count():
    cfg = PRESETS["base"]
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.head_dim, cfg.d_ff) == (16, 410, 10, 41, 2100)
    with torch.device("meta"):
        model = TransfoXLForPreTraining(cfg)
    V, D, F, HD, L = cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.n_head * cfg.head_dim, cfg.n_layer
    per_layer = (
        4 * D * HD + HD * D  # W_q, W_k, W_v, W_R and the output projection (no biases)
        + 2 * HD  # u, v
        + 2 * D  # attention LayerNorm
        + D * F + F + F * D + D  # feed-forward
        + 2 * D  # feed-forward LayerNorm
    )
    expected = V * D + L * per_layer + V  # tied embedding/softmax + blocks + output bias
    assert expected == 151_118_605
    assert sum(p.numel() for p in model.parameters()) == expected


def test_loss_falls_on_a_tiny_overfit():
    torch.manual_seed(0)
    model = pretrain_model(dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    # four rows of a periodic stream (period 13) at different phases: next-token is learnable
    stream = (torch.arange(4 * 16)[None, :] * 7 + torch.arange(4)[:, None] * 3) % 13 + 10
    losses = []
    for step in range(40):
        s = step % 4  # the same 4 stream-ordered segments, again and again
        reset = torch.full((4,), int(s == 0))
        out = model(input_ids=stream[:, s * 16 : (s + 1) * 16], reset_memory=reset)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert sum(losses[-4:]) / 4 < 0.2 * sum(losses[:4]) / 4, losses


@pytest.mark.parametrize("overrides", [{}, {"layer_norm": "pre"}, {"clamp_len": 6}])
def test_decode_step_with_memory_equals_one_pass_without(overrides):
    """Generation's recurrence: the prompt, then one token (and once four) at a time with a memory that
    keeps everything; each step's scores are those of the last position of one pass over the whole
    sequence without memory, and the training stream's memory is left alone."""
    cfg = dataclasses.replace(TINY, **overrides)
    model = TransfoXLForPreTraining(cfg, generator=torch.Generator().manual_seed(0)).eval()
    ids = random_ids(2, 40, seed=3)
    with torch.no_grad():
        full = model.logits(model.backbone.hidden_states(ids)[-1])  # (B, T, V)
        logits, memory = model.decode_step(ids[:, :7])
        torch.testing.assert_close(logits, full[:, 6], atol=1e-5, rtol=0)
        t = 7
        while t < 40:
            n = 4 if t == 20 else 1
            logits, memory = model.decode_step(ids[:, t : t + n], memory)
            t += n
            assert memory.length == t  # longer than mem_len (32): nothing is cut while decoding
            torch.testing.assert_close(logits, full[:, t - 1], atol=1e-5, rtol=0, msg=f"step to {t}")
    assert model.memory is None
