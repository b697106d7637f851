"""jobs/serving/batching.py: continuous batching, plain asyncio (no Ray, no model).

The property that matters for serving: a batch is formed when the model is free, from everything that
waited, so under load the passes grow instead of staying at what one wait timeout collects."""

from __future__ import annotations

import asyncio
import random

import pytest

from jobs.serving.batching import Batcher


class Model:
    """An async ``run``: records every batch, takes ``seconds`` per pass, answers item * 10."""

    def __init__(self, seconds: float = 0.0, fail_on: int | None = None):
        self.batches: list[list[int]] = []
        self.seconds, self.fail_on = seconds, fail_on

    async def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        await asyncio.sleep(self.seconds)
        if self.fail_on in items:
            raise ValueError(f"bad item {self.fail_on}")
        return [i * 10 for i in items]


def test_what_arrives_during_a_pass_runs_in_the_next_pass_whole():
    """One request starts a pass; 20 arrive during it, spread over 40 ms (longer than the 5 ms wait):
    they run as one batch of 20, not as the 5 ms slices @serve.batch would cut. The pass ends when
    the test says so, not after a fixed time, so a slow machine cannot end it before all 20 arrived."""
    released = None
    passes = []

    async def run(items):
        passes.append(list(items))
        if len(passes) == 1:
            await released.wait()  # the first pass runs until all 20 have arrived
        return [i * 10 for i in items]

    batcher = Batcher(run, max_batch_size=32, batch_wait_timeout_s=0.005)

    async def main():
        nonlocal released
        released = asyncio.Event()
        first = asyncio.ensure_future(batcher(0))
        while not passes:  # the first pass is running
            await asyncio.sleep(0.001)
        later = []
        for i in range(1, 21):
            later.append(asyncio.ensure_future(batcher(i)))
            await asyncio.sleep(0.002)
        released.set()
        return await asyncio.gather(first, *later)

    assert asyncio.run(main()) == [i * 10 for i in range(21)]
    assert passes == [[0], list(range(1, 21))]


def test_batches_hold_at_most_max_batch_size_in_arrival_order():
    model = Model(seconds=0.01)
    batcher = Batcher(model, max_batch_size=32, batch_wait_timeout_s=0.001)

    async def main():
        return await asyncio.gather(*(batcher(i) for i in range(70)))

    assert asyncio.run(main()) == [i * 10 for i in range(70)]
    assert [len(b) for b in model.batches] == [32, 32, 6]
    assert sum(model.batches, []) == list(range(70))


def test_a_lone_request_waits_for_company_only_up_to_the_timeout():
    model = Model()
    batcher = Batcher(model, max_batch_size=8, batch_wait_timeout_s=0.2)

    async def main():
        loop = asyncio.get_running_loop()
        start = loop.time()
        first = asyncio.ensure_future(batcher(1))
        await asyncio.sleep(0.05)
        second = await batcher(2)  # joins the first: its batch has not run yet
        assert await first == 10 and second == 20
        both = loop.time() - start
        start = loop.time()
        assert await batcher(3) == 30
        return both, loop.time() - start

    both, alone = asyncio.run(main())
    assert model.batches == [[1, 2], [3]]
    assert 0.15 <= both < 1.0 and 0.15 <= alone < 1.0  # each batch waited ~0.2 s for more, then ran


def test_a_full_batch_runs_without_waiting():
    model = Model()
    batcher = Batcher(model, max_batch_size=4, batch_wait_timeout_s=10.0)

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(batcher(i) for i in range(4))), 2.0)

    assert asyncio.run(main()) == [0, 10, 20, 30]


def test_a_failing_batch_fails_its_requests_and_the_next_batch_runs():
    model = Model(seconds=0.02, fail_on=3)
    batcher = Batcher(model, max_batch_size=4, batch_wait_timeout_s=0.001)

    async def main():
        results = await asyncio.gather(*(batcher(i) for i in range(8)), return_exceptions=True)
        return results, await batcher(9)

    results, after = asyncio.run(main())
    assert all(isinstance(r, ValueError) and "bad item 3" in str(r) for r in results[:4])
    assert results[4:] == [40, 50, 60, 70] and after == 90


def test_a_wrong_number_of_results_is_an_error_for_the_batch():
    async def short(items):
        return items[:-1]

    batcher = Batcher(short, max_batch_size=4, batch_wait_timeout_s=0.001)

    async def main():
        return await asyncio.gather(batcher(1), batcher(2), return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "2 items gave 1 results" in str(r) for r in results)


def test_a_cancelled_request_never_reaches_the_model():
    """A client that went away while its request waited for a batch: dropped before the pass."""
    model = Model(seconds=0.05)
    batcher = Batcher(model, max_batch_size=8, batch_wait_timeout_s=0.001)

    async def main():
        first = asyncio.ensure_future(batcher(0))
        await asyncio.sleep(0.01)  # pass 1 running
        gone = asyncio.ensure_future(batcher(1))
        kept = asyncio.ensure_future(batcher(2))
        await asyncio.sleep(0.005)
        gone.cancel()
        return await first, await kept, gone.cancelled()

    assert asyncio.run(main()) == (0, 20, True)
    assert model.batches == [[0], [2]]


def test_a_new_event_loop_gets_its_own_worker():
    """Each asyncio.run is a new loop (as each test of the replicas' Ask helper could be): the worker
    of a closed loop must not swallow the requests."""
    model = Model()
    batcher = Batcher(model, max_batch_size=4, batch_wait_timeout_s=0.001)
    assert asyncio.run(batcher(1)) == 10
    assert asyncio.run(batcher(2)) == 20


@pytest.mark.parametrize("size, wait", [(0, 0.01), (4, -1.0)])
def test_bad_settings_are_refused(size, wait):
    with pytest.raises(ValueError, match="max_batch_size|batch_wait_timeout_s"):
        Batcher(Model(), max_batch_size=size, batch_wait_timeout_s=wait)


def test_batchers_sharing_a_model_lock_never_run_two_passes_at_once():
    """Two batchers of one replica (two models, or a model's vectors and task rows) take turns, and
    what queued at one while the other ran joins its next batch whole."""
    spans: list[tuple[str, float, float]] = []

    def model(name: str):
        async def run(items: list[int]) -> list[int]:
            loop = asyncio.get_running_loop()
            start = loop.time()
            await asyncio.sleep(0.03)
            spans.append((name, start, loop.time()))
            return items
        return run

    async def main():
        lock = asyncio.Lock()
        a = Batcher(model("a"), max_batch_size=32, batch_wait_timeout_s=0.001, model_lock=lock)
        b = Batcher(model("b"), max_batch_size=32, batch_wait_timeout_s=0.001, model_lock=lock)
        first = asyncio.ensure_future(a(0))
        await asyncio.sleep(0.005)  # a's pass is running
        calls = [asyncio.ensure_future(b(i)) for i in range(1, 6)] + [asyncio.ensure_future(a(i)) for i in range(6, 9)]
        await asyncio.gather(first, *calls)

    asyncio.run(main())
    spans.sort(key=lambda s: s[1])
    assert all(later[1] >= earlier[2] for earlier, later in zip(spans, spans[1:])), spans  # no overlap
    assert len(spans) == 3  # a: [0]; then b: [1..5] and a: [6..8], one pass each


def test_one_models_sentence_and_task_batchers_share_the_replicas_lock(minilm_dir):
    """EmbeddingModel gives both of its batchers its model_lock; a multiplexed replica passes one lock
    to every model it loads (jobs/serving/serve.py MultiplexedModels._load)."""
    from jobs.serving.serve import EmbeddingModel
    from jobs.serving.serve_config import Limits, ModelConfig

    shared = asyncio.Lock()
    model = EmbeddingModel.func_or_class("m", str(minilm_dir), None, ModelConfig(uri=str(minilm_dir)), Limits(), None, shared)
    assert model.model_lock is shared
    assert model._embed_batch.model_lock is shared and model._rows_batch.model_lock is shared


# --- requests of many items: length-sorted batches across requests, in turns ---


class Lengths:
    """A ``run`` over (request, index, length) items: records every batch, takes ``per_token`` seconds
    a padded token (items x longest), answers the item itself."""

    def __init__(self, per_token: float = 0.0):
        self.batches: list[list[tuple[int, int, int]]] = []
        self.per_token = per_token

    async def __call__(self, items):
        self.batches.append(list(items))
        await asyncio.sleep(self.per_token * len(items) * max(n for _, _, n in items))
        return list(items)


def _length(item: tuple[int, int, int]) -> int:
    return item[2]


def test_a_request_runs_shortest_first_in_batches_under_the_token_budget():
    model = Lengths()
    batcher = Batcher(model, max_batch_size=4, batch_wait_timeout_s=0.001, length=_length, max_batch_tokens=40)
    lengths = [30, 5, 9, 5, 12, 7, 50, 8]
    items = [(0, i, n) for i, n in enumerate(lengths)]
    assert asyncio.run(batcher.submit(items)) == items  # answered in the request's own order
    assert [[n for _, _, n in b] for b in model.batches] == [[5, 5, 7, 8], [9, 12], [30], [50]]


def test_a_one_text_request_joins_the_next_batch_not_the_end_of_a_bulk_request():
    """Head-of-line blocking: a 1,000-item request is running when a one-item request arrives; the
    one-item request is in the very next batch, and the bulk request still gets its share of it."""
    model = Lengths(per_token=1e-5)
    batcher = Batcher(model, max_batch_size=32, batch_wait_timeout_s=0.001, length=_length, max_batch_tokens=4096)

    async def main():
        bulk = asyncio.ensure_future(batcher.submit([(0, i, 10 + i % 40) for i in range(1000)]))
        await asyncio.sleep(0.02)  # a few bulk batches have run
        ran_before = len(model.batches)
        single = await batcher.submit([(1, 0, 25)])
        await bulk
        return ran_before, single

    ran_before, single = asyncio.run(main())
    assert single == [(1, 0, 25)]
    joined = next(k for k, b in enumerate(model.batches) if (1, 0, 25) in b)
    assert joined <= ran_before  # the batch formed right after it arrived (the one running then is ran_before - 1)
    assert len(model.batches[joined]) == 32 and any(r == 0 for r, _, _ in model.batches[joined])
    assert len(model.batches) < 1000 // 16  # the bulk request never ran one item at a time


def test_concurrent_bulk_requests_share_batches_sorted_across_them():
    """Eight 64-item requests: every batch holds an item of each request still waiting (all move on
    together), and the batches are as little padded as one length-sorted queue of all 512 items."""
    model = Lengths(per_token=1e-6)
    batcher = Batcher(model, max_batch_size=32, batch_wait_timeout_s=0.01, length=_length, max_batch_tokens=16384)
    rng = random.Random(0)
    reqs = [[(r, i, rng.randint(5, 60)) for i in range(64)] for r in range(8)]

    async def main():
        return await asyncio.gather(*(batcher.submit(items) for items in reqs))

    assert asyncio.run(main()) == reqs
    for b in model.batches:
        waiting = {r for r in range(8) if any(it in later for later in model.batches[model.batches.index(b):] for it in reqs[r])}
        assert {r for r, _, _ in b} == waiting
    padded = sum(len(b) * max(n for _, _, n in b) for b in model.batches)
    lengths = sorted(n for items in reqs for _, _, n in items)
    one_queue = sum(len(lengths[s : s + 32]) * lengths[s : s + 32][-1] for s in range(0, len(lengths), 32))
    assert padded <= 1.02 * one_queue  # taken in turns, one item per request, it was 1.08x


def test_small_requests_beside_a_large_one_get_short_batches():
    """While one-item requests are about and a 1,000-item request is queued, batches keep to
    interactive_batch_tokens, and a small request's batch holds small requests' items alone; the
    large request alone gets whole max_batch_tokens batches."""
    model = Lengths(per_token=1e-5)
    batcher = Batcher(model, max_batch_size=32, batch_wait_timeout_s=0.001, length=_length, max_batch_tokens=4096,
                      interactive_batch_tokens=64)

    async def main():
        await batcher.submit([(0, i, 10) for i in range(200)])  # alone
        alone = len(model.batches)
        bulk = asyncio.ensure_future(batcher.submit([(1, i, 10) for i in range(200)]))
        for k in range(5):
            await asyncio.sleep(0.003)
            await batcher.submit([(2, k, 10)])
        await bulk
        return alone

    alone = asyncio.run(main())
    assert [len(b) for b in model.batches[:alone]] == [32] * 6 + [8]
    mixed = [b for b in model.batches[alone:] if any(r == 2 for r, _, _ in b)]
    assert len(mixed) == 5 and all(b == [(2, k, 10)] for k, b in enumerate(mixed))  # each its own pass, not filled up with bulk items
    first, last = (model.batches.index(b) for b in (mixed[0], mixed[-1]))
    assert all(len(b) * 10 <= 64 for b in model.batches[first:last])  # the bulk request's passes between them are short too


def test_a_failing_batch_fails_each_request_in_it_once_and_drops_their_other_items():
    calls: list[list[tuple[int, int, int]]] = []

    async def run(items):
        calls.append(list(items))
        if any(r == 1 for r, _, _ in items):
            raise ValueError("request 1 breaks the model")
        return list(items)

    batcher = Batcher(run, max_batch_size=4, batch_wait_timeout_s=0.01, length=_length)

    async def main():
        failed = await asyncio.gather(
            batcher.submit([(0, i, 5) for i in range(6)]), batcher.submit([(1, i, 5) for i in range(6)]),
            return_exceptions=True,
        )
        return failed, await batcher.submit([(2, 0, 5)])

    (first, second), after = asyncio.run(main())
    assert isinstance(first, ValueError) and isinstance(second, ValueError)  # both had items in the failing pass
    assert calls[0][:2] == [(0, 0, 5), (1, 0, 5)]  # each request's first item, oldest first
    assert calls[1:] == [[(2, 0, 5)]] and after == [(2, 0, 5)]  # their other items never ran; the next request does


def test_property_every_item_once_in_order_and_no_batch_over_its_budget():
    """Random requests (1-300 items of 1-200 tokens) arriving at random times: every item reaches the
    model exactly once, every answer comes back to its request in order, and no batch holds more than
    max_batch_size items or more than max_batch_tokens padded tokens unless it is one item alone."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    request = st.tuples(st.lists(st.integers(1, 200), min_size=1, max_size=300), st.floats(0, 0.01))

    @settings(max_examples=40, deadline=None)
    @given(st.lists(request, min_size=1, max_size=8), st.integers(1, 48), st.integers(1, 2000))
    def check(requests, max_batch_size, max_batch_tokens):
        model = Lengths()
        batcher = Batcher(model, max_batch_size=max_batch_size, batch_wait_timeout_s=0.001, length=_length,
                          max_batch_tokens=max_batch_tokens)

        async def send(r, lengths, delay):
            await asyncio.sleep(delay)
            return await batcher.submit([(r, i, n) for i, n in enumerate(lengths)])

        async def main():
            return await asyncio.gather(*(send(r, lengths, delay) for r, (lengths, delay) in enumerate(requests)))

        answers = asyncio.run(main())
        for r, ((lengths, _), got) in enumerate(zip(requests, answers)):
            assert got == [(r, i, n) for i, n in enumerate(lengths)]
        ran = [it for b in model.batches for it in b]
        assert sorted(ran) == sorted((r, i, n) for r, (lengths, _) in enumerate(requests) for i, n in enumerate(lengths))
        for b in model.batches:
            assert 1 <= len(b) <= max_batch_size
            assert len(b) == 1 or len(b) * max(n for _, _, n in b) <= max_batch_tokens
        for r, (lengths, _) in enumerate(requests):  # each request's items ran shortest first
            order = [n for b in model.batches for rr, _, n in b if rr == r]
            assert order == sorted(order)

    check()


def test_bulk_and_one_text_requests_interleaved_each_get_their_one_text_vectors(minilm_dir):
    """A replica's model in-process: two bulk requests (200 and 64 texts) and 20 one-text requests
    arriving while they run share length-sorted passes across request boundaries; every vector comes
    back to its own request, in order, equal to the text's vector computed alone (1e-5), and no pass
    holds more than max_batch_size texts or max_batch_tokens padded tokens."""
    import numpy as np

    from jobs.serving.serve import EmbeddingModel
    from jobs.serving.serve_config import Limits, ModelConfig
    from tests.conftest import corpus_texts

    settings = ModelConfig(uri=str(minilm_dir), max_batch_size=16, max_batch_tokens=512)
    model = EmbeddingModel.func_or_class("m", str(minilm_dir), None, settings, Limits())
    texts = corpus_texts(284, seed=7)
    alone = np.stack([model.embed_now([t], normalize=True)["embeddings"][0] for t in texts])  # (284, 384)
    model.recent_passes.clear()

    async def single(k: int):
        await asyncio.sleep(0.01 * k)
        return await model._embed([texts[264 + k]], "mean", True)

    async def main():
        return await asyncio.gather(model._embed(texts[:200], "mean", True), model._embed(texts[200:264], "mean", True),
                                    *(single(k) for k in range(20)))

    answers = asyncio.run(main())
    got = np.concatenate([a["embeddings"] for a in answers])  # (284, 384) in the order sent
    np.testing.assert_allclose(got, alone, atol=1e-5)
    assert [len(a["n_tokens"]) for a in answers] == [200, 64] + [1] * 20
    passes = list(model.recent_passes)
    assert sum(1 for _ in passes) >= 284 // 16
    assert all(rows <= 16 and (rows == 1 or rows * length <= 512) for rows, length in passes), passes
    real = sum(sum(a["n_tokens"]) for a in answers)
    padded = sum(rows * length for rows, length in passes)
    assert padded < 1.15 * real  # sorted across requests: little padding (arrival order gives 1.85x for these texts)
