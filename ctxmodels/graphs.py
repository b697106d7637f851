"""Inference passes replayed from CUDA graphs: a serving replica's forward without Python's launches.

Why: a sentence-embedding pass of a small encoder is bound by the host on a GPU. MiniLM over 128
rows is some 150 kernels, each launched from Python (about 45 µs a launch on the H200 machine this
project borrows), against a millisecond or two of GPU work; the first GPU session measured float16
no faster than float32 (``benchmarks/gpu_embed.py``), the GPU waiting on the host either way. A CUDA
graph records the kernels of one pass once and replays them all with one launch: vLLM's and
TensorRT-LLM's decode graphs, one per batch size, do the same.

A graph fixes its shapes and its tensors' addresses, so a pass is padded up to a *bucket*: its rows
to the next power of two (at most ``max_rows``), its length to the next multiple of
``LENGTH_MULTIPLE`` (at most ``max_len``). A workload meets a handful of buckets (a bulk request's
length-sorted passes: full passes at a few lengths, then its tail). Padding rows hold one real
token (the padding id) so their attention has a key to attend to, and padding positions are masked
keys, so the real rows get what an eager pass over the same real tokens gives, up to the kernels'
own tiling. The caller slices the output back to its (B, T).

A bucket's graph is recorded the first time it comes (two eager passes on a side stream first, for
the lazy initialisations that capture forbids), and at most ``max_graphs`` are kept, the least
recently used dropped. All share one memory pool: passes run one at a time and each output is read
before the next replay, which may overwrite it (the output is a view of the graph's memory, valid
until the next call).

What is graphed is a function of (ids, mask) with no host synchronisation and no data-dependent
shape on a GPU: the last hidden state of a BERT, RoBERTa, SpanBERT or ALBERT backbone
(``jobs.replica.GRAPHED_FAMILIES``). ``record=False`` runs that function eagerly on the bucket's
padded inputs instead: what a replay computes, checkable on a CPU.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

LENGTH_MULTIPLE = 32  # a bucket's length is a multiple of this: max_len / 32 lengths at most


@dataclass
class _Bucket:
    ids: Tensor  # (R, L) the graph's input ids, padded
    mask: Tensor  # (R, L) its attention mask: padding rows hold one real token
    graph: torch.cuda.CUDAGraph | None  # None when not recording
    out: Tensor | None  # (R, L, D) what a replay writes


class GraphedPasses:
    """``fn(ids, mask)`` -> (B, T, D) for (B, T) inputs, replayed from one CUDA graph per bucket."""

    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor], *, max_rows: int, max_len: int, pad_id: int,
                 max_graphs: int = 32, record: bool = True):
        if max_rows < 1 or max_len < 1 or max_graphs < 1:
            raise ValueError(f"max_rows={max_rows}, max_len={max_len}, max_graphs={max_graphs}: each must be at least 1")
        self.fn, self.max_rows, self.max_len, self.pad_id = fn, max_rows, max_len, pad_id
        self.max_graphs, self.record = max_graphs, record
        self.buckets: collections.OrderedDict[tuple[int, int], _Bucket] = collections.OrderedDict()
        self.recorded = 0  # graphs recorded so far, dropped ones included
        self._pool = None

    def bucket(self, rows: int, length: int) -> tuple[int, int]:
        """(R, L): the shape a (rows, length) pass is padded to; never smaller than the pass."""
        R = min(1 << (rows - 1).bit_length(), max(self.max_rows, rows))  # the next power of two, at most max_rows
        L = min(-(-length // LENGTH_MULTIPLE) * LENGTH_MULTIPLE, max(self.max_len, length))
        return R, L

    def __call__(self, ids: Tensor, mask: Tensor) -> Tensor:
        """(B, T, D) for ``ids`` and ``mask`` (B, T) on the graphs' device: a view of the bucket's
        output, valid until the next call."""
        B, T = ids.shape
        b = self._get(*self.bucket(B, T), ids.device)
        b.ids.fill_(self.pad_id)
        b.ids[:B, :T] = ids
        b.mask.zero_()
        b.mask[:, 0] = 1  # padding rows: one real token
        b.mask[:B, :T] = mask
        if b.graph is None:
            return self.fn(b.ids, b.mask)[:B, :T]
        b.graph.replay()
        return b.out[:B, :T]

    def _get(self, R: int, L: int, device: torch.device) -> _Bucket:
        key = (R, L)
        if key in self.buckets:
            self.buckets.move_to_end(key)
            return self.buckets[key]
        while len(self.buckets) >= self.max_graphs:
            self.buckets.popitem(last=False)  # its graph and output go back to the pool
        ids = torch.full((R, L), self.pad_id, dtype=torch.long, device=device)  # (R, L)
        mask = torch.zeros((R, L), dtype=torch.long, device=device)  # (R, L)
        mask[:, 0] = 1
        graph = out = None
        if self.record:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisations (cuBLAS workspaces, kernel choices) outside the capture
                    self.fn(ids, mask)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.fn(ids, mask)
            self.recorded += 1
        self.buckets[key] = _Bucket(ids, mask, graph, out)
        return self.buckets[key]
