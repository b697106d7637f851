"""ctxmodels.graphs on the CPU (CI has no GPU; tests/jobs/test_cuda.py records and replays the graphs on
one): a pass padded up to its bucket gives the real rows' values of the eager pass over the same
tokens, the buckets are the documented ones, and at most ``max_graphs`` are kept."""

from __future__ import annotations

import pytest
import torch

from ctxmodels.graphs import LENGTH_MULTIPLE, GraphedPasses
from ctxmodels.registry import build_model


def _backbone(family: str):
    cfg, model = build_model(family, "tiny", {"vocab_size": 128}, seed=0)
    return cfg, getattr(model, "backbone", model).eval()


def _batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(5, 128, (len(lengths), T), generator=g)  # (B, T)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()  # (B, T)
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("family", ["bert", "roberta", "albert"])
def test_a_pass_padded_to_its_bucket_gives_the_eager_pass_at_the_real_tokens(family):
    cfg, backbone = _backbone(family)
    max_len = 96
    graphed = GraphedPasses(lambda ids, mask: backbone.hidden_states(ids, attention_mask=mask)[-1],
                            max_rows=16, max_len=max_len, pad_id=0, record=False)
    with torch.inference_mode():
        for seed, lengths in enumerate([[7], [31, 12, 5], [33, 33, 2, 20, 9], [96] * 3 + [40] * 9, [64] * 16]):
            ids, mask = _batch(lengths, seed)
            want = backbone.hidden_states(ids, attention_mask=mask)[-1]  # (B, T, D)
            got = graphed(ids, mask)
            assert got.shape == want.shape
            real = mask.bool()
            torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
            R, L = graphed.bucket(*ids.shape)
            assert graphed.buckets[(R, L)].ids.shape == (R, L)  # what ran was the padded bucket


def test_buckets_are_powers_of_two_rows_and_multiples_of_32_tokens_never_smaller_than_the_pass():
    graphed = GraphedPasses(lambda ids, mask: ids, max_rows=20, max_len=512, pad_id=0, record=False)
    assert LENGTH_MULTIPLE == 32
    assert graphed.bucket(1, 1) == (1, 32)
    assert graphed.bucket(3, 17) == (4, 32)
    assert graphed.bucket(16, 33) == (16, 64)
    assert graphed.bucket(17, 500) == (20, 512)  # rows capped at max_rows, length at max_len
    assert graphed.bucket(25, 513) == (25, 513)  # never smaller than the pass itself
    with pytest.raises(ValueError, match="max_graphs=0"):
        GraphedPasses(lambda ids, mask: ids, max_rows=1, max_len=1, pad_id=0, max_graphs=0)


def test_at_most_max_graphs_buckets_are_kept_the_least_recently_used_dropped():
    calls = []

    def fn(ids, mask):
        calls.append(tuple(ids.shape))
        return ids[..., None].float()  # (R, L, 1)

    graphed = GraphedPasses(fn, max_rows=8, max_len=128, pad_id=0, max_graphs=2, record=False)
    for lengths in ([5], [40], [5, 5], [6]):  # buckets (1, 32), (1, 64), (2, 32), then (1, 32) again
        ids, mask = _batch(lengths, 0)
        out = graphed(ids, mask)
        assert torch.equal(out[..., 0].long(), ids)  # the caller's rows and positions, not the padding
    assert list(graphed.buckets) == [(2, 32), (1, 32)] and calls == [(1, 32), (1, 64), (2, 32), (1, 32)]
