"""SPLADE's pooling (ctxmodels/features.py) against sentence-transformers' SpladePooling."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("pooling", ["max", "sum"])
@pytest.mark.parametrize("activation", ["relu", "log1p_relu"])
def test_splade_pool_equals_sentence_transformers_splade_pooling_whole_and_in_chunks(pooling, activation):
    """``features.splade_pool`` of the real positions, flattened, equals sentence-transformers' SpladePooling of
    the padded batch; pooled chunk by chunk (a chunk ending inside a text) it is the same. Max pooling keeps
    the raw scores' maxima and weighs them at the end: a position of padding would show there."""
    sparse_encoder = pytest.importorskip("sentence_transformers.sparse_encoder.modules")
    from ctxmodels.features import splade_accumulate, splade_finish, splade_pool

    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 3, 5, 1])
    B, T, V = len(lengths), int(lengths.max()), 50
    logits = torch.randn(B, T, V, generator=g) * 3
    logits[1, 3:] = 100.0  # padding scores, large: they must not be pooled
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    want = sparse_encoder.SpladePooling(pooling, activation).eval()({"token_embeddings": logits.clone(), "attention_mask": mask})["sentence_embedding"]
    real = mask.bool()
    flat, rows = logits[real], torch.arange(B)[:, None].expand(B, T)[real]
    torch.testing.assert_close(splade_pool(flat, rows, B, pooling, activation), want, rtol=1e-6, atol=1e-6)
    out = torch.zeros(B, V)
    for start in range(0, len(flat), 4):
        splade_accumulate(flat[start:start + 4], rows[start:start + 4], out, pooling, activation)
    torch.testing.assert_close(splade_finish(out, pooling, activation), want, rtol=1e-6, atol=1e-6)
