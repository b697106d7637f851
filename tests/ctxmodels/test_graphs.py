"""ctxmodels.graphs on the CPU (CI has no GPU; tests/jobs/test_cuda.py records and replays the graphs on
one): a pass padded up to its bucket gives the real rows' values of the eager pass over the same
tokens, the buckets are the documented ones, at most ``max_graphs`` are kept, and the recording path
(warm-up, capture into one pool, replay on the bucket's own tensors) gives the eager values too, with
``torch.cuda``'s graph API replaced by a stand-in that keeps a graph's semantics."""

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


def test_the_recording_path_replays_what_a_graph_recorded_on_its_static_inputs(monkeypatch):
    """``record=True`` on the CPU, with ``torch.cuda``'s graph API replaced by a stand-in that keeps
    a graph's semantics: a capture records the pass on the bucket's own input and output tensors,
    and a replay runs it again on them, writing into the same output. Through the passes of
    ``test_cuda``'s replay test (five buckets, three kept): every pass equals the eager one at the
    real tokens, each recording follows two warm-up passes on a side stream, all share one pool,
    and a bucket seen again replays without recording."""
    _, backbone = _backbone("bert")
    log: list[str] = []
    capturing: list = []

    class Graph:
        def replay(self):
            log.append("replay")
            self.out.copy_(self.rerun())

    class Capture:
        def __init__(self, graph, pool=None):
            self.graph, self.pool = graph, pool

        def __enter__(self):
            log.append(f"capture {self.pool}")
            capturing.append(self.graph)

        def __exit__(self, *exc):
            capturing.pop()

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    class OnStream:
        def __init__(self, stream):
            log.append("side stream")

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            log.append("main stream")

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool-1")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", OnStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())

    def last(ids, mask):
        out = backbone.hidden_states(ids, attention_mask=mask)[-1]
        if capturing:  # what the graph keeps: this pass on these very tensors
            capturing[-1].rerun = lambda: backbone.hidden_states(ids, attention_mask=mask)[-1]
            capturing[-1].out = out
        log.append("pass")
        return out

    graphed = GraphedPasses(last, max_rows=16, max_len=96, pad_id=0, max_graphs=3)
    passes = [[7], [6], [31, 12, 5], [33, 33, 2, 20, 9], [96] * 3 + [40] * 9, [64] * 16, [7], [30, 12, 5]]
    with torch.inference_mode():
        for seed, lengths in enumerate(passes):
            ids, mask = _batch(lengths, seed)
            want = backbone.hidden_states(ids, attention_mask=mask)[-1]
            log.clear()
            got = graphed(ids, mask).clone()
            real = mask.bool()
            torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5, msg=lambda m: f"pass {seed}: {m}")
            recorded = ["side stream", "pass", "pass", "main stream", "capture pool-1", "pass", "replay"]
            assert log == (["replay"] if seed == 1 else recorded), (seed, log)
    assert graphed.recorded == 7 and list(graphed.buckets) == [(16, 64), (1, 32), (4, 32)]
