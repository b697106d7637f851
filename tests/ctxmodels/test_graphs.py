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


class FakeGraphs:
    """``torch.cuda``'s graph API replaced by a stand-in that keeps a graph's semantics: a capture
    records the pass on the bucket's own input and output tensors (``keep``, called by the function
    being captured), and a replay runs it again on them, writing into the same output. ``log`` says
    what ran; ``corrupt`` makes replays write zeros, ``fail`` makes captures raise."""

    def __init__(self, monkeypatch):
        self.log: list[str] = []
        self.capturing: list = []
        self.corrupt = self.fail = False
        fake = self

        class Graph:
            def replay(self):
                fake.log.append("replay")
                self.out.copy_(torch.zeros_like(self.out) if fake.corrupt else self.rerun())

        class Capture:
            def __init__(self, graph, pool=None):
                self.graph, self.pool = graph, pool

            def __enter__(self):
                fake.log.append(f"capture {self.pool}")
                fake.capturing.append(self.graph)

            def __exit__(self, *exc):
                fake.capturing.pop()

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                pass

        class OnStream:
            def __init__(self, stream):
                fake.log.append("side stream")

            def __enter__(self):
                pass

            def __exit__(self, *exc):
                fake.log.append("main stream")

        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool-1")
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", OnStream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())

    def keep(self, rerun, out):
        """What the function under capture calls: the graph keeps ``rerun`` and its ``out``."""
        if self.capturing:
            if self.fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.capturing[-1].rerun, self.capturing[-1].out = rerun, out
        self.log.append("pass")
        return out


def test_the_recording_path_replays_what_a_graph_recorded_on_its_static_inputs(monkeypatch):
    """``record=True`` on the CPU, with ``torch.cuda``'s graph API replaced by ``FakeGraphs``. Through
    the passes of ``test_cuda``'s replay test (five buckets, three kept): every pass equals the eager
    one at the real tokens, each recording follows two warm-up passes on a side stream and is
    replayed once (its check against the last warm-up), all share one pool, and a bucket seen again
    replays without recording."""
    _, backbone = _backbone("bert")
    fake = FakeGraphs(monkeypatch)

    def last(ids, mask):
        return fake.keep(lambda: backbone.hidden_states(ids, attention_mask=mask)[-1], backbone.hidden_states(ids, attention_mask=mask)[-1])

    graphed = GraphedPasses(last, max_rows=16, max_len=96, pad_id=0, max_graphs=3)
    passes = [[7], [6], [31, 12, 5], [33, 33, 2, 20, 9], [96] * 3 + [40] * 9, [64] * 16, [7], [30, 12, 5]]
    with torch.inference_mode():
        for seed, lengths in enumerate(passes):
            ids, mask = _batch(lengths, seed)
            want = backbone.hidden_states(ids, attention_mask=mask)[-1]
            fake.log.clear()
            got = graphed(ids, mask).clone()
            real = mask.bool()
            torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5, msg=lambda m: f"pass {seed}: {m}")
            recorded = ["side stream", "pass", "pass", "main stream", "capture pool-1", "pass", "replay"]
            assert fake.log == (["replay"] if seed == 1 else recorded), (seed, fake.log)
    assert graphed.recorded == 7 and list(graphed.buckets) == [(16, 64), (1, 32), (4, 32)] and graphed.failed is None


@pytest.mark.parametrize("how", ["replay differs", "capture fails"])
def test_a_recording_that_fails_or_replays_wrong_values_turns_the_graphs_off_and_the_pass_runs_eagerly(monkeypatch, caplog, how):
    """A bucket's first replay is checked against its last warm-up pass (same inputs): a replay that
    gives other values (here zeros), or a capture that raises, turns the graphs off with a warning
    naming why; that pass and every later one run eagerly on the caller's unpadded inputs."""
    _, backbone = _backbone("bert")
    fake = FakeGraphs(monkeypatch)

    def last(ids, mask):
        return fake.keep(lambda: backbone.hidden_states(ids, attention_mask=mask)[-1], backbone.hidden_states(ids, attention_mask=mask)[-1])

    graphed = GraphedPasses(last, max_rows=16, max_len=96, pad_id=0, name="model m")
    with torch.inference_mode():
        ids, mask = _batch([7], 0)
        graphed(ids, mask)  # recorded and checked: graphs on
        assert graphed.recorded == 1 and graphed.failed is None
        fake.corrupt, fake.fail = how == "replay differs", how == "capture fails"
        for seed, lengths in enumerate([[31, 12, 5], [33, 2], [7]], start=1):
            ids, mask = _batch(lengths, seed)
            fake.log.clear()
            got = graphed(ids, mask)
            assert got.shape == (*ids.shape, backbone.hidden_states(ids, attention_mask=mask)[-1].shape[-1])
            torch.testing.assert_close(got, backbone.hidden_states(ids, attention_mask=mask)[-1])  # eager, unpadded
            if seed > 1:
                assert fake.log == ["pass"]  # nothing recorded, nothing replayed, no padding
    assert graphed.recorded == 1 and not graphed.buckets
    why = "differs from its eager pass" if how == "replay differs" else "as a CUDA graph failed (operation not permitted"
    assert why in graphed.failed and f"model m: {graphed.failed}; every pass runs eagerly" in caplog.text


def _task_model(family: str, kind: str, **task):
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import TaskConfig, build_task_model

    labels = {"classification": ["a", "b", "c"], "token-classification": ["O", "B-X", "I-X"]}.get(kind, [])
    cfg = make_config(family, "tiny", {"vocab_size": 128})
    config = TaskConfig(kind=kind, num_labels=max(len(labels), 1), labels=labels, **task)
    return build_task_model(family, cfg, config, torch.Generator().manual_seed(0)).eval()


@pytest.mark.parametrize("family,kind,task", [
    ("bert", "classification", {}),
    ("roberta", "regression", {}),
    ("albert", "token-classification", {}),
    ("bert", "question-answering", {}),
    ("bert", "classification", {"symmetric": True}),
], ids=["bert-classification", "roberta-regression", "albert-token-classification", "bert-question-answering", "bert-symmetric-pairs"])
def test_task_logits_through_padded_buckets_equal_the_eager_ones(family, kind, task):
    """What a GPU replica's task routes replay (``EmbeddingReplica._task_graphed_passes``), eagerly
    on the CPU: a task model's logits, with token type ids, for (B, T) and symmetric (B, 2, T)
    inputs, sequence outputs cut to the caller's rows and per-token ones to its rows and length."""
    model = _task_model(family, kind, **task)
    per_token = kind in ("token-classification", "question-answering")
    graphed = GraphedPasses(lambda ids, mask, **others: model(ids, attention_mask=mask, **others).logits,
                            max_rows=8, max_len=96, pad_id=0, per_token=per_token, record=False)
    with torch.inference_mode():
        for seed, lengths in enumerate([[7], [31, 12, 5], [40, 40, 33, 9, 2]]):
            ids, mask = _batch(lengths, seed)
            types = (torch.arange(ids.shape[1])[None, :] >= torch.tensor(lengths)[:, None] // 2).long() * mask  # a second segment
            types = types * (family != "roberta")  # RoBERTa has one segment
            if task.get("symmetric"):
                ids, mask, types = (torch.stack([x, x.flip(0)], dim=1) for x in (ids, mask, types))  # (B, 2, T)
            want = model(ids, attention_mask=mask, token_type_ids=types).logits
            got = graphed(ids, mask, token_type_ids=types)
            assert got.shape == want.shape
            if per_token:
                real = mask.bool()
                torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
            else:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            R, L = graphed.bucket(ids.shape[0], ids.shape[-1])
            assert graphed.buckets[(R, *ids.shape[1:-1], L)].inputs["token_type_ids"].shape == (R, *ids.shape[1:-1], L)
        with pytest.raises(ValueError, match="this one brought"):
            graphed(ids, mask)  # every pass brings the same inputs
