"""SpanBERT's Span Boundary Objective head: shapes, what it reads, and that it learns."""

from __future__ import annotations

import pytest
import torch

from ctxmodels.bert import SBO_MAX_SPAN
from ctxmodels.registry import FAMILIES, build_model

B, T, V = 2, 16, 300
# Two spans per row: (start, end) inclusive. Row 0: 3..5 and 9..10; row 1: 1..4 and 12..12.
SPANS = [[(3, 5), (9, 10)], [(1, 4), (12, 12)]]


def span_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (B, T), generator=g)
    labels = torch.full((B, T), -100)
    left = torch.full((B, T), -1)
    right = torch.full((B, T), -1)
    pos = torch.zeros(B, T, dtype=torch.long)
    for b, spans in enumerate(SPANS):
        for s, e in spans:
            labels[b, s : e + 1] = ids[b, s : e + 1]
            left[b, s : e + 1] = s - 1
            right[b, s : e + 1] = e + 1
            pos[b, s : e + 1] = torch.arange(e - s + 1)
    inputs = ids.masked_fill(labels != -100, 4)  # [MASK] = 4 here
    return dict(
        input_ids=inputs, attention_mask=torch.ones(B, T, dtype=torch.long), token_type_ids=torch.zeros(B, T, dtype=torch.long),
        labels=labels, sbo_left=left, sbo_right=right, sbo_pos=pos,
    )


def spanbert(**kw):
    torch.manual_seed(0)
    return build_model("spanbert", "tiny", {"vocab_size": V, **kw})[1]


def test_spanbert_presets_have_sbo_and_no_nsp():
    for name, cfg in FAMILIES["spanbert"].presets.items():
        assert cfg.sbo and not cfg.nsp, name
    assert set(FAMILIES["spanbert"].presets) == {"tiny", "base", "large"}
    assert not any(k.startswith("sbo.") for k in build_model("bert", "tiny", {"vocab_size": V})[1].state_dict())


def test_shapes_metrics_and_loss_is_mlm_plus_sbo():
    model = spanbert().eval()
    batch = span_batch()
    out = model(**batch)
    assert set(out.metrics) == {"mlm_loss", "mlm_acc", "n_pred", "sbo_loss", "sbo_acc"}
    n = int((batch["labels"] != -100).sum())
    assert int(out.metrics["n_pred"]) == n
    torch.testing.assert_close(out.loss.detach(), out.metrics["mlm_loss"] + out.metrics["sbo_loss"])
    last = model.backbone.hidden_states(batch["input_ids"], batch["attention_mask"])[-1]
    selected = batch["labels"] != -100
    logits = model.sbo_logits(last, selected, batch["sbo_left"], batch["sbo_right"], batch["sbo_pos"])
    assert logits.shape == (n, V)
    out.loss.backward()
    assert model.sbo.fc1.weight.grad is not None and model.sbo.position.weight.grad is not None


def test_sbo_reads_only_the_boundary_states_and_the_position():
    model = spanbert().eval()
    batch = span_batch()
    selected = batch["labels"] != -100
    with torch.no_grad():
        last = model.backbone.hidden_states(batch["input_ids"], batch["attention_mask"])[-1]
        base = model.sbo_logits(last, selected, batch["sbo_left"], batch["sbo_right"], batch["sbo_pos"])
        rows, cols = selected.nonzero(as_tuple=True)
        # Change the states of every token inside every span (and of every other non-boundary
        # token): no SBO logit moves.
        boundary = torch.zeros(B, T, dtype=torch.bool)
        for b, spans in enumerate(SPANS):
            for s, e in spans:
                boundary[b, s - 1] = boundary[b, e + 1] = True
        noisy = torch.where(boundary[..., None], last, last + torch.randn_like(last))
        torch.testing.assert_close(model.sbo_logits(noisy, selected, batch["sbo_left"], batch["sbo_right"], batch["sbo_pos"]), base)
        # Change the right boundary of row 0's first span (position 6): only its 3 targets move.
        moved = last.clone()
        moved[0, 6] += 1.0
        changed = (model.sbo_logits(moved, selected, batch["sbo_left"], batch["sbo_right"], batch["sbo_pos"]) - base).abs().amax(-1) > 1e-6
        assert changed.tolist() == [(r == 0 and 3 <= c <= 5) for r, c in zip(rows.tolist(), cols.tolist())]
        # Two tokens with the same boundaries differ only by their position embedding.
        first_span = base[:3]
        assert not torch.allclose(first_span[0], first_span[1])


def test_long_spans_share_the_last_position_row():
    model = spanbert().eval()
    left = right = torch.zeros(2, model.cfg.d_model)
    pos = torch.tensor([SBO_MAX_SPAN - 1, SBO_MAX_SPAN + 40])
    out = model.sbo(left, right, pos, model.backbone.embeddings.word.weight)
    torch.testing.assert_close(out[0], out[1])


def test_sbo_columns_need_the_head_and_each_other():
    batch = span_batch()
    torch.manual_seed(0)
    bert = build_model("bert", "tiny", {"vocab_size": V, "nsp": False})[1]
    with pytest.raises(ValueError, match="no SBO head"):
        bert(**batch)
    partial = {k: v for k, v in batch.items() if k != "sbo_pos"}
    with pytest.raises(ValueError, match="go together"):
        spanbert()(**partial)


def test_sbo_loss_falls_when_overfitting_one_batch():
    torch.set_num_threads(1)
    model = spanbert(dropout=0.0, attn_dropout=0.0).train()
    batch = span_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        out = model(**batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.metrics["sbo_loss"]))
    assert losses[0] > 5.0  # ~ln(300)
    assert losses[-1] < 0.5 * losses[0], losses[::10]
