"""Continuous batching for a model replica: concurrent requests share forward passes.

One worker task per ``Batcher`` runs one batch at a time and forms the next batch only when the model
is free, from everything queued by then (up to ``max_batch_size`` items). Under load, every request
that arrived during a forward pass joins the next one, so batches grow with the load by themselves.

Ray Serve's ``@serve.batch`` (Ray 2.60) forms batches eagerly instead: its loop cuts a batch every
``batch_wait_timeout_s`` from whatever has arrived, then queues that batch for the model behind a
semaphore. While a pass runs it keeps cutting small batches, so passes stay small however long the
queue gets: serving MiniLM to 32 concurrent clients on 2 cores, ``@serve.batch`` ran 2.5 texts per pass
with ~20 requests waiting in already-cut batches (timestamps traced in the replica), and
``benchmarks/serving.py`` measured ~61 texts/s.

A request may hold many items (``submit``: the texts of one /v1/embeddings call). Its items run
shortest first (``length``). A batch takes first the shortest waiting item of every queued request,
oldest request first, then the shortest waiting items of all of them together, until it holds
``max_batch_size`` items or the next item would take it over ``max_batch_tokens`` padded tokens (items
x the longest one). So a 1,000-text request runs as a run of length-sorted batches, never as one padded
batch; eight 64-text requests share batches of similar lengths as one sorted queue would; and a
one-text request that arrives meanwhile joins the very next batch instead of waiting behind all of a
large one (the head-of-line blocking of a first-come-first-served queue of whole requests, and of
Infinity's queue sorted by length alone). While small requests (``SMALL_REQUEST`` items or fewer) are
about beside a large one, batches are cut to ``interactive_batch_tokens``, so the pass a small request
waits for is short too, and a batch with a small request in it holds small requests' items alone, so
its own pass is as short as it can be (one-text p99 beside a 1,000-text client: 2.28x its p99 alone
before, 1.65x after, the bulk client about 11% slower meanwhile; ``benchmarks/serving.py --scenarios
mixed``). The answers go back to each request in its own order.

Idle, a lone request waits up to ``batch_wait_timeout_s`` from its arrival for company, as with
``@serve.batch``; a request that waited in the queue during a pass has already waited that long and
runs at once. Cancelled requests (a client that went away, a timeout) are dropped before their next
batch runs. Pure asyncio: no Ray, no torch."""

from __future__ import annotations

import asyncio
import collections
import heapq
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

SMALL_REQUEST = 8  # items: a request this small is someone waiting (a query, a chat turn), not a bulk job
RECENT_S = 1.0  # small requests count as about for this long after the last one arrived


class _Request:
    """One caller's items: taken shortest first (``order``), answered together once all are done."""

    __slots__ = ("items", "lengths", "order", "taken", "results", "left", "future", "arrival")

    def __init__(self, items: Sequence, lengths: list[int], future: asyncio.Future, arrival: float):
        self.items, self.lengths, self.future, self.arrival = items, lengths, future, arrival
        self.order = sorted(range(len(items)), key=lengths.__getitem__)  # stable: ties keep their order
        self.taken = 0  # items of ``order`` handed to batches so far
        self.results: list = [None] * len(items)
        self.left = len(items)  # items not answered yet

    @property
    def waiting(self) -> int:
        return len(self.order) - self.taken


class Batcher(Generic[T, R]):
    """``await batcher(item)`` -> that item's result; ``await batcher.submit(items)`` -> the results of
    a request's items in their order. ``run(items)`` is called with batches of at most
    ``max_batch_size`` items (and at most ``max_batch_tokens`` padded tokens, when ``length`` says how
    long an item is), one call at a time.

    ``run`` returns one result per item, in order; if it raises, every request with an item in that
    batch gets the exception, and the next batch runs as usual.

    ``model_lock``, shared by the batchers of one replica (a model's sentence vectors and task rows,
    the models a multiplexed replica holds), lets one forward pass run at a time there: two passes at
    once would split the cores between two sets of torch threads, which on a small machine wait for
    each other. A batch is formed once its batcher holds the lock, from everything queued by then."""

    def __init__(self, run: Callable[[list[T]], Awaitable[list[R]]], max_batch_size: int, batch_wait_timeout_s: float,
                 model_lock: asyncio.Lock | None = None, *, length: Callable[[T], int] | None = None,
                 max_batch_tokens: int | None = None, interactive_batch_tokens: int | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if batch_wait_timeout_s < 0:
            raise ValueError(f"batch_wait_timeout_s must be >= 0, got {batch_wait_timeout_s}")
        for name, value in (("max_batch_tokens", max_batch_tokens), ("interactive_batch_tokens", interactive_batch_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.run, self.max_batch_size, self.batch_wait_timeout_s = run, max_batch_size, batch_wait_timeout_s
        self.length, self.max_batch_tokens, self.interactive_batch_tokens = length, max_batch_tokens, interactive_batch_tokens
        self._small_at: float | None = None  # when the last small request arrived (loop time)
        self.model_lock = model_lock or asyncio.Lock()
        self._queue: collections.deque[_Request] = collections.deque()  # requests with items not yet in a batch
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None

    async def __call__(self, item: T) -> R:
        return (await self.submit([item]))[0]

    async def submit(self, items: Sequence[T]) -> list[R]:
        """The results of ``items`` (one request's), in their order."""
        if not items:
            return []
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            # Started on first use, in the loop of the caller (a replica's: one for its life).
            self._arrived = asyncio.Event()
            self._worker = loop.create_task(self._work())
        lengths = [self.length(item) for item in items] if self.length is not None else [1] * len(items)
        request = _Request(items, lengths, loop.create_future(), loop.time())
        if len(items) <= SMALL_REQUEST:
            self._small_at = request.arrival
        self._queue.append(request)
        self._arrived.set()
        return await request.future  # a cancelled caller cancels the future: its items are dropped

    def queued(self) -> int:
        """Items of live requests not in a batch yet; drops the requests whose callers went away."""
        if any(r.future.done() for r in self._queue):
            self._queue = collections.deque(r for r in self._queue if not r.future.done())
        return sum(r.waiting for r in self._queue)

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        arrived = self._arrived
        while True:
            await arrived.wait()
            arrived.clear()
            while self.queued():
                # Wait for company until the oldest request has waited batch_wait_timeout_s.
                deadline = self._queue[0].arrival + self.batch_wait_timeout_s
                while self.queued() < self.max_batch_size and loop.time() < deadline:
                    try:
                        await asyncio.wait_for(arrived.wait(), deadline - loop.time())
                    except asyncio.TimeoutError:
                        break
                    arrived.clear()
                async with self.model_lock:  # the model is free: what waited meanwhile joins this batch
                    if self.queued():
                        await self._run(self._take())

    def _take(self) -> list[tuple[_Request, int]]:
        """The next batch as (request, item index). First each queued request's shortest waiting item,
        oldest request first, so every request moves on with every batch; then the shortest waiting
        items of all requests together, so a batch holds texts of similar length across request
        boundaries. An item that would take the batch over its token budget is left for a later one
        (in the second step nothing shorter is left either); the first item always goes in, however
        long: an item over the budget runs alone. While one-item-or-few requests are about and a large
        one is queued, the budget is ``interactive_batch_tokens``: short passes, so a small request
        never waits long for the pass in front of it; and if small requests are queued, the batch is
        theirs alone, so their own pass is short too."""
        live = [r for r in self._queue if r.waiting]
        budget = self.max_batch_tokens
        if self.interactive_batch_tokens is not None and self._mixed(live):
            budget = min(budget or self.interactive_batch_tokens, self.interactive_batch_tokens)
            small = [r for r in live if len(r.items) <= SMALL_REQUEST]
            if small:  # their pass alone: as short as a waiting person's pass can be
                live = small
        batch: list[tuple[_Request, int]] = []
        longest = 0

        def add(r: _Request) -> bool:
            nonlocal longest
            n = r.lengths[r.order[r.taken]]
            if batch and budget is not None and (len(batch) + 1) * max(longest, n) > budget:
                return False
            batch.append((r, r.order[r.taken]))
            longest = max(longest, n)
            r.taken += 1
            return True

        for r in live:
            if len(batch) == self.max_batch_size:
                break
            add(r)
        heap = [(r.lengths[r.order[r.taken]], k, r) for k, r in enumerate(live) if r.waiting]  # (next length, age, request)
        heapq.heapify(heap)
        while heap and len(batch) < self.max_batch_size:
            _, k, r = heap[0]
            if not add(r):
                break  # the shortest waiting item does not fit: no other does
            if r.waiting:
                heapq.heapreplace(heap, (r.lengths[r.order[r.taken]], k, r))
            else:
                heapq.heappop(heap)
        self._queue = collections.deque(r for r in self._queue if r.waiting)  # the rest are in batches now
        return batch

    def _mixed(self, live: list[_Request]) -> bool:
        """A large request is queued while small ones are about (one arrived within RECENT_S)."""
        recent = self._small_at is not None and asyncio.get_running_loop().time() - self._small_at < RECENT_S
        return recent and any(len(r.items) > SMALL_REQUEST for r in live)

    async def _run(self, batch: list[tuple[_Request, int]]) -> None:
        try:
            results = await self.run([r.items[i] for r, i in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} items gave {len(results)} results")
        except Exception as e:  # the batch's requests fail; the worker goes on with the next batch
            for r, _ in batch:
                if not r.future.done():
                    r.future.set_exception(e)
            return
        for (r, i), result in zip(batch, results):
            if r.future.done():  # cancelled, or failed in an earlier batch
                continue
            r.results[i] = result
            r.left -= 1
            if r.left == 0:
                r.future.set_result(r.results)
