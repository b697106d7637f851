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

Idle, a lone request waits up to ``batch_wait_timeout_s`` from its arrival for company, as with
``@serve.batch``; a request that waited in the queue during a pass has already waited that long and
runs at once. Cancelled requests (a client that went away, a timeout) are dropped before their batch
runs. Pure asyncio: no Ray, no torch."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Batcher(Generic[T, R]):
    """``await batcher(item)`` -> that item's result from ``run(items)``, called with batches of at
    most ``max_batch_size`` items, one call at a time, in arrival order.

    ``run`` returns one result per item, in order; if it raises, every request of that batch gets the
    exception, and the next batch runs as usual.

    ``model_lock``, shared by the batchers of one replica (a model's sentence vectors and task rows,
    the models a multiplexed replica holds), lets one forward pass run at a time there: two passes at
    once would split the cores between two sets of torch threads, which on a small machine wait for
    each other. A batch is formed once its batcher holds the lock, from everything queued by then."""

    def __init__(self, run: Callable[[list[T]], Awaitable[list[R]]], max_batch_size: int, batch_wait_timeout_s: float,
                 model_lock: asyncio.Lock | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if batch_wait_timeout_s < 0:
            raise ValueError(f"batch_wait_timeout_s must be >= 0, got {batch_wait_timeout_s}")
        self.run, self.max_batch_size, self.batch_wait_timeout_s = run, max_batch_size, batch_wait_timeout_s
        self.model_lock = model_lock or asyncio.Lock()
        self._queue: collections.deque[tuple[T, asyncio.Future, float]] = collections.deque()  # (item, future, arrival)
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None

    async def __call__(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._worker.get_loop() is not loop:
            # Started on first use, in the loop of the caller (a replica's: one for its life).
            self._arrived = asyncio.Event()
            self._worker = loop.create_task(self._work())
        future = loop.create_future()
        self._queue.append((item, future, loop.time()))
        self._arrived.set()
        return await future

    def _live(self) -> int:
        """Drop the cancelled requests at the head; the live requests queued."""
        while self._queue and self._queue[0][1].done():
            self._queue.popleft()
        return sum(not f.done() for _, f, _ in self._queue)

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        arrived = self._arrived
        while True:
            await arrived.wait()
            arrived.clear()
            while self._live():
                # Wait for company until the oldest request has waited batch_wait_timeout_s.
                deadline = self._queue[0][2] + self.batch_wait_timeout_s
                while self._live() < self.max_batch_size and loop.time() < deadline:
                    try:
                        await asyncio.wait_for(arrived.wait(), deadline - loop.time())
                    except asyncio.TimeoutError:
                        break
                    arrived.clear()
                async with self.model_lock:  # the model is free: what waited meanwhile joins this batch
                    batch = []
                    while self._queue and len(batch) < self.max_batch_size:
                        item, future, _ = self._queue.popleft()
                        if not future.done():
                            batch.append((item, future))
                    if batch:
                        await self._run(batch)

    async def _run(self, batch: list[tuple[T, asyncio.Future]]) -> None:
        try:
            results = await self.run([item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} items gave {len(results)} results")
        except Exception as e:  # the batch's requests fail; the worker goes on with the next batch
            for _, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        for (_, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)
