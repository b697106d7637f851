"""Inference passes replayed from CUDA graphs: a serving replica's forward without Python's launches.

Why: a pass of a small encoder is bound by the host on a GPU. MiniLM over 128 rows is some 150
kernels, each launched from Python (about 45 µs a launch on the H200 machine this project
borrows), against a millisecond or two of GPU work; the first GPU session measured float16 no
faster than float32 (``benchmarks/gpu_embed.py``), the GPU waiting on the host either way. A CUDA
graph records the kernels of one pass once and replays them all with one launch: vLLM's and
TensorRT-LLM's decode graphs, one per batch size, do the same.

A graph fixes its shapes and its tensors' addresses, so a pass is padded up to a *bucket*: its rows
to the next power of two (at most ``max_rows``), its length to the next multiple of
``LENGTH_MULTIPLE`` (at most ``max_len``); other dimensions (a (B, K, T) pass: K options, or both
orders of a symmetric pair) are part of the bucket as they come. A workload meets a handful of
buckets (a bulk request's length-sorted passes: full passes at a few lengths, then its tail).
Padding rows hold one real token (the padding id) in each of their sequences, so their attention
has a key to attend to, and padding positions are masked keys, so the real rows get what an eager
pass over the same real tokens gives, up to the kernels' own tiling. Other inputs (token type ids)
are padded with zeros. The output is sliced back to the caller's rows and, for per-token outputs
((B, T, ...): hidden states, token labels, answer spans), to its length.

A bucket's graph is recorded the first time it comes, on that pass's own inputs: two eager passes
on a side stream first (for the lazy initialisations that capture forbids), then the capture, then
one replay, which must give the last eager pass's values (within half precision's rounding). A
recording that fails or a replay that disagrees turns the graphs off for good, with a warning:
every pass from then on runs eagerly, unpadded. At most ``max_graphs`` graphs are kept, the least
recently used dropped. All share one memory pool: passes run one at a time and each output is read
before the next replay, which may overwrite it (the output is a view of the graph's memory, valid
until the next call).

What is graphed is a function of the inputs with no host synchronisation and no data-dependent
shape on a GPU: the last hidden state of a BERT, RoBERTa, SpanBERT or ALBERT backbone, or a task
model's logits on one (``jobs.serving.replica.GRAPHED_FAMILIES``). ``record=False`` runs that function
eagerly on the bucket's padded inputs instead: what a replay computes, checkable on a CPU.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

LENGTH_MULTIPLE = 32  # a bucket's length is a multiple of this: max_len / 32 lengths at most


@dataclass
class _Bucket:
    inputs: dict[str, Tensor]  # (R, ..., L) each: the graph's inputs, padded
    graph: torch.cuda.CUDAGraph | None  # None until recorded, and when not recording
    out: Tensor | None  # what a replay writes: (R, ...)

    @property
    def ids(self) -> Tensor:
        return self.inputs["input_ids"]

    @property
    def mask(self) -> Tensor:
        return self.inputs["attention_mask"]


class GraphedPasses:
    """``fn(input_ids, attention_mask, **others)`` for (B, ..., T) inputs, replayed from one CUDA
    graph per bucket. ``per_token``: the output is (B, T, ...) and is cut to the caller's T (else
    (B, ...), cut to its B only)."""

    def __init__(self, fn: Callable[..., Tensor], *, max_rows: int, max_len: int, pad_id: int,
                 per_token: bool = True, max_graphs: int = 32, record: bool = True, name: str = "model"):
        if max_rows < 1 or max_len < 1 or max_graphs < 1:
            raise ValueError(f"max_rows={max_rows}, max_len={max_len}, max_graphs={max_graphs}: each must be at least 1")
        self.fn, self.max_rows, self.max_len, self.pad_id = fn, max_rows, max_len, pad_id
        self.per_token, self.max_graphs, self.record, self.name = per_token, max_graphs, record, name
        self.buckets: collections.OrderedDict[tuple[int, ...], _Bucket] = collections.OrderedDict()
        self.recorded = 0  # graphs recorded so far, dropped ones included
        self.failed: str | None = None  # why the graphs were turned off; None while they are on
        self._names: tuple[str, ...] | None = None  # the inputs every pass brings
        self._pool = None

    def bucket(self, rows: int, length: int) -> tuple[int, int]:
        """(R, L): the rows and length a (rows, length) pass is padded to; never smaller than the pass."""
        R = min(1 << (rows - 1).bit_length(), max(self.max_rows, rows))  # the next power of two, at most max_rows
        L = min(-(-length // LENGTH_MULTIPLE) * LENGTH_MULTIPLE, max(self.max_len, length))
        return R, L

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, **others: Tensor) -> Tensor:
        """``fn``'s output for (B, ..., T) inputs on the graphs' device: a view of the bucket's output,
        valid until the next call."""
        if self.failed is not None:
            return self.fn(input_ids, attention_mask, **others)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **others}
        if self._names is None:
            self._names = tuple(inputs)
        elif tuple(inputs) != self._names:
            raise ValueError(f"passes bring the inputs {list(self._names)}; this one brought {list(inputs)}")
        B, T = input_ids.shape[0], input_ids.shape[-1]
        R, L = self.bucket(B, T)
        b = self._get((R, *input_ids.shape[1:-1], L), inputs)
        for name, x in inputs.items():
            b.inputs[name].fill_(self.pad_id if name == "input_ids" else 0)
            b.inputs[name][:B, ..., :T] = x
        b.mask[B:, ..., 0] = 1  # padding rows: one real token in each of their sequences
        if not self.record:
            out = self.fn(b.ids, b.mask, **self._others(b))
        elif b.graph is None:
            out = self._record(b)
            if out is None:  # the graphs are off now: this pass, as every later one, runs eagerly
                return self.fn(input_ids, attention_mask, **others)
        else:
            b.graph.replay()
            out = b.out
        return out[:B, :T] if self.per_token else out[:B]

    def _others(self, b: _Bucket) -> dict[str, Tensor]:
        return {k: v for k, v in b.inputs.items() if k not in ("input_ids", "attention_mask")}

    def _get(self, key: tuple[int, ...], like: dict[str, Tensor]) -> _Bucket:
        if key in self.buckets:
            self.buckets.move_to_end(key)
            return self.buckets[key]
        while len(self.buckets) >= self.max_graphs:
            self.buckets.popitem(last=False)  # its graph and output go back to the pool
        inputs = {name: x.new_zeros(key) for name, x in like.items()}  # (R, ..., L) each, in the callers' dtypes
        self.buckets[key] = _Bucket(inputs, None, None)
        return self.buckets[key]

    def _record(self, b: _Bucket) -> Tensor | None:
        """Records ``b``'s graph on the inputs it holds and replays it once; its output, or None (and
        the graphs off) if the recording fails or the replay differs from the eager pass."""
        device = b.ids.device
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisations (cuBLAS workspaces, kernel choices) outside the capture
                    eager = self.fn(b.ids, b.mask, **self._others(b))
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.fn(b.ids, b.mask, **self._others(b))
            graph.replay()
        except RuntimeError as e:  # an operation CUDA graphs cannot record: eagerly rather than not at all
            return self._turn_off(f"recording a pass of bucket {tuple(b.ids.shape)} as a CUDA graph failed ({e})")
        if not torch.allclose(out.float(), eager.float(), atol=0.05, rtol=0.05, equal_nan=True):  # half precision's rounding, not a wrong replay
            worst = float((out.float() - eager.float()).abs().nan_to_num(float("inf")).max())
            return self._turn_off(f"the replay of bucket {tuple(b.ids.shape)} differs from its eager pass (largest difference {worst:.3g})")
        b.graph, b.out = graph, out
        self.recorded += 1
        return out

    def _turn_off(self, why: str) -> None:
        self.failed = why
        self.buckets.clear()
        logger.warning("%s: %s; every pass runs eagerly from now on", self.name, why)
        return None
