"""A serving replica's compute: its one forward-pass thread, how a batch is cut into passes, and its
tokenizing threads.

``jobs.serving.serve`` (sentence and token vectors, generation) and ``jobs.serving.serve_tasks`` (the task routes)
both run their passes through these; they live apart from both so neither imports the other for
them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# What a forward pass costs besides its tokens, in tokens (``token_budget_groups``). MiniLM on 2 CPU threads:
# a pass takes ~2.3 ms plus ~0.1 ms a token, and small passes use the cores less well (8 rows of 16 tokens
# run at 8 tokens/ms, 32 rows at 11), so cutting a batch in two costs 5.7-7.7 ms more than padding it:
# 55-70 tokens (benchmarks/serving.py's 8 x 64-text load ran 16.9 texts a pass at 24, 3% padding).
PASS_TOKENS = 64


def token_budget_groups(lengths: list[int], max_rows: int, max_tokens: int, pass_tokens: int = PASS_TOKENS) -> list[list[int]]:
    """Indices of rows (``lengths`` in tokens) grouped into forward passes, shortest rows first: each
    group has at most ``max_rows`` rows and at most ``max_tokens`` padded tokens (rows x its longest
    row). Of all such cuts of the length-sorted rows into runs, the one with the fewest padded tokens,
    counting ``pass_tokens`` more for each pass (what a pass costs besides its tokens), so a long row
    among short ones gets a pass of its own instead of padding them all to its length, while rows of
    similar length share one. A row longer than ``max_tokens`` gets a pass of its own (it cannot be
    split). Ties keep their given order."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    n = len(order)
    # cost[j]: the cheapest cut of the j shortest rows; start[j]: where its last run starts. A run
    # order[i:j] is padded to its last (longest) row.
    cost = [0] + [0] * n
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        best, best_i = None, j - 1
        for i in range(j - 1, max(j - max_rows, 0) - 1, -1):
            rows = j - i
            if rows > 1 and rows * longest > max_tokens:
                break  # more rows only pad more
            c = cost[i] + rows * longest + pass_tokens
            if best is None or c < best:  # on a tie the shorter last run (earlier runs filled first)
                best, best_i = c, i
        cost[j], start[j] = best, best_i
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(order[start[j] : j])
        j = start[j]
    return groups[::-1]


_FORWARD: concurrent.futures.ThreadPoolExecutor | None = None
_FORWARD_LOCK = threading.Lock()


def _forward_executor() -> concurrent.futures.ThreadPoolExecutor:
    global _FORWARD
    with _FORWARD_LOCK:
        if _FORWARD is None:
            _FORWARD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ctx-forward")
        return _FORWARD


def on_forward_thread(fn, *args):
    """``fn(*args)`` on this process's one forward-pass thread, waiting for it.

    Every torch operation of a serving process (loading, forward passes, pooling) runs on that one
    thread. GNU OpenMP gives each thread that runs a parallel operation a team of its own, and once
    its threads outnumber the cores it stops spinning between operations (GOMP_SPINCOUNT's
    oversubscribed case) and wakes them through the kernel for every operation instead: MiniLM's
    passes then ran at 1.5 of 2 cores, 370 texts/s instead of 580, in every thread of the process,
    once a second thread had run one (1,000 texts in-process, ``asyncio.to_thread`` per pass)."""
    if threading.current_thread().name.startswith("ctx-forward"):
        return fn(*args)
    return _forward_executor().submit(fn, *args).result()


async def forward(fn, *args):
    """``on_forward_thread`` for a coroutine: the event loop goes on meanwhile. Passes take turns
    anyway (``model_lock``)."""
    return await asyncio.get_running_loop().run_in_executor(_forward_executor(), fn, *args)


def tokenizing_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor | None:
    """Threads that tokenize a request's chunks at once, or None for one thread (the caller's).
    The Rust tokenizers (WordPiece, byte-level BPE) give up the GIL while they encode, so the chunks
    of one bulk request (LangChain's 1,000 texts, ``ctx embed``'s blocks) run on as many cores as the
    replica was given (1.63x for 1,000 texts on 2 cores, ``benchmarks/host_floor.py``);
    SentencePiece's binding keeps it but runs at some 77,000 texts/s a core anyway. No OpenMP runs
    on these threads (see ``on_forward_thread``)."""
    if threads <= 1:
        return None
    return concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ctx-tokenize")


def ordered_map(pool: concurrent.futures.ThreadPoolExecutor | None, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
    """``fn(item)`` of each item, in order, computed on ``pool`` at most two per thread ahead of the
    consumer (``map(fn, items)`` without a pool). When the consumer stops early (a request refused at
    its token budget), work not yet started is cancelled."""
    if pool is None:
        yield from map(fn, items)
        return
    ahead = 2 * pool._max_workers
    pending: collections.deque[concurrent.futures.Future] = collections.deque()
    it = iter(items)
    try:
        for item in it:
            pending.append(pool.submit(fn, item))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


def one_pass_behind(queued: Iterable[T], take: Callable[[T], None]) -> None:
    """``take`` each item of ``queued`` once the next one has been produced, the last at the end: a
    replica's passes (``EmbeddingReplica._pool``, ``_token_vectors``, ``TaskServing._rows_forward``)
    read a pass's output off the device (``HostCopy``) only after the next pass is queued."""
    pending: list[T] = []
    for item in queued:
        if pending:
            take(pending.pop())
        pending.append(item)
    for item in pending:
        take(item)


class HostCopy:
    """A pass's output copied to the host without waiting for the device: on a GPU the copy goes into
    pinned memory behind the kernels already queued, and ``numpy()`` waits for that copy alone. A
    replica reads a pass's vectors only after the next pass is queued, so the GPU runs one pass while
    the host pads, copies and launches the next (a blocking ``.cpu()`` would leave it idle meanwhile).
    On the CPU it is the tensor itself."""

    def __init__(self, tensor) -> None:  # torch.Tensor
        import torch

        self.done = None
        if tensor.device.type == "cuda":
            self.host = tensor.to("cpu", non_blocking=True)  # pinned: PyTorch pins a non-blocking copy off the device
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = tensor

    def numpy(self):  # np.ndarray
        if self.done is not None:
            self.done.synchronize()
        return self.host.numpy()
