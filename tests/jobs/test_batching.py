"""jobs/batching.py: continuous batching, plain asyncio (no Ray, no model).

The property that matters for serving: a batch is formed when the model is free, from everything that
waited, so under load the passes grow instead of staying at what one wait timeout collects."""

from __future__ import annotations

import asyncio

import pytest

from jobs.batching import Batcher


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
    """One request starts a 50 ms pass; 20 arrive during it, spread over 40 ms (longer than the 5 ms
    wait): they run as one batch of 20, not as the 5 ms slices @serve.batch would cut."""
    model = Model(seconds=0.05)
    batcher = Batcher(model, max_batch_size=32, batch_wait_timeout_s=0.005)

    async def main():
        first = asyncio.ensure_future(batcher(0))
        await asyncio.sleep(0.006)  # the first pass is running
        later = []
        for i in range(1, 21):
            later.append(asyncio.ensure_future(batcher(i)))
            await asyncio.sleep(0.002)
        return await asyncio.gather(first, *later)

    assert asyncio.run(main()) == [i * 10 for i in range(21)]
    assert model.batches == [[0], list(range(1, 21))]


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
    to every model it loads (jobs/serve.py MultiplexedModels._load)."""
    from jobs.serve import EmbeddingModel
    from jobs.serve_config import Limits, ModelConfig

    shared = asyncio.Lock()
    model = EmbeddingModel.func_or_class("m", str(minilm_dir), None, ModelConfig(uri=str(minilm_dir)), Limits(), None, shared)
    assert model.model_lock is shared
    assert model._embed_batch.model_lock is shared and model._rows_batch.model_lock is shared
