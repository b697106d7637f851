"""What every ctx training loop is made of: pretraining (``jobs/training/train.py``) and fine-tuning
(``jobs/training/finetune.py``) both read as "resume, then step, meter, evaluate and commit until done".

Worker side (inside each Ray Train worker):

* ``TrainState``: the counters a checkpoint keeps (``trainer_state.json``);
* ``StepMeter``: one logging interval's sums on one worker, reduced over workers into means;
* ``Stepper``: one optimizer step over micro-batches (gradient accumulation with ``no_sync``,
  clipping, the learning rate as a function of samples consumed), skipped on every rank when a
  loss or the gradient norm is not finite (``docs/FAULTS.md``);
* ``Checkpointer``: the checkpoint commit. Each worker records the samples of its finished
  optimizer steps; at a checkpoint they are gathered and merged into the committed data position,
  which rank 0 writes with the weights, optimizer state and ``TrainState`` (MANIFEST last). The
  protocol is ``docs/EXACTLY_ONCE.md``; its other half, dropping committed samples when a stream
  starts, is ``pipelines.dataset.TokenizePack`` / ``pipelines.finetune_stream.RecordChunks``;
* ``resume``: the run's latest complete checkpoint (by step), loaded into the model;
* ``evaluate_batches``: a forward pass over held-out batches shared out between the workers.

Driver side: ``ingest_options`` and ``fit`` (``TorchTrainer`` + the progress
board of ``jobs/training/progress.py``).

Ray seams are marked; the rest is plain PyTorch and NumPy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from pipelines import storage
from pipelines.position import POSITION_FILE, DataPosition, load_position

BOOKKEEPING = ("sample_id", "epoch")
# The key ``to_device`` sets in a batch whose attention mask is all ones: ``model_inputs`` drops the mask.
NO_PADDING = "_no_padding"
LABEL_POSITIONS = "_label_positions"  # where labels != -100, found by to_device on the host; the forward's label_positions
# to_device pads those positions to a multiple of this many (ops.padded_positions): a few shapes a run
POSITIONS_MULTIPLE = 128


# ---------------------------------------------------------------------------------------------
# State


@dataclass
class TrainState:
    """The counters of a run, saved as ``trainer_state.json`` in every checkpoint."""

    step: int = 0  # optimizer steps done
    samples_seen: int = 0  # global batch x steps: what the learning-rate schedule follows
    tokens_seen: int = 0  # real (non-padding) tokens trained on, over all workers
    epoch: int = 0  # the oldest epoch not closed (the data position's first_epoch)
    world_size: int = 1  # workers of the attempt that wrote the checkpoint
    # Model selection (fine-tuning; pretraining with an eval set records its evaluations too)
    best_score: float | None = None  # the best validation score so far (higher is better)
    best_value: float | None = None  # the best score's metric as measured (a loss is not negated here)
    best_step: int | None = None  # the step it was measured at
    best_checkpoint: str | None = None  # the checkpoint folder written at that step
    evals_since_best: int = 0  # evaluations without improvement (early stopping counts these)
    bad_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient norm (not in ``step``)

    @property
    def attempts(self) -> int:
        """Optimizer steps attempted so far, skipped ones included (what ``train.debug_nan_steps`` counts)."""
        return self.step + self.bad_steps

    def to_json(self, **extra: Any) -> dict[str, Any]:
        return {**dataclasses.asdict(self), **extra}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "TrainState":
        if not data:
            return cls()
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def observe(self, score: float) -> bool:
        """Record a validation score (higher is better); True when it is a new best."""
        if math.isfinite(score) and (self.best_score is None or score > self.best_score):
            self.best_score, self.best_step, self.evals_since_best = float(score), self.step, 0
            return True
        self.evals_since_best += 1
        return False


# ---------------------------------------------------------------------------------------------
# Batches


def seed_worker_rng(seed: int, rank: int) -> None:
    """Seed this worker's global torch generator, which dropout draws from, from (seed, rank): a
    fresh run is repeatable and no two workers draw the same masks. Model weights never come from
    it (``ctxmodels.registry.new_model``). A run resumed after an interruption draws a new
    sequence, not the one the interrupted run would have continued with."""
    import torch

    torch.manual_seed(int(np.random.SeedSequence([int(seed), int(rank)]).generate_state(1)[0]))


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch without its bookkeeping columns: what ``model(**inputs)`` takes. A batch that
    ``to_device`` found unpadded goes without its all-ones ``attention_mask``."""
    drop = ("attention_mask",) if batch.get(NO_PADDING) else ()
    out = {k: v for k, v in batch.items() if k not in BOOKKEEPING and not k.startswith("_") and k not in drop}
    if LABEL_POSITIONS in batch:  # to_device found them because the model takes them
        out["label_positions"] = batch[LABEL_POSITIONS]
    return out


def to_device(batch: dict[str, Any], device, label_positions: bool = False) -> dict[str, Any]:
    """A host batch of tensors on ``device``, for the training step.

    On CUDA the tensors travel through pinned (page-locked) memory and are copied without the
    host waiting (``non_blocking``): the copy is queued behind the previous step's kernels and the
    host goes on preparing the next one. An ``attention_mask`` of all ones (packed pretraining
    rows) is found so here, on the host, and the batch says so (``NO_PADDING``): ``model_inputs``
    then leaves the mask out, the families attend with no mask at all (SDPA's flash kernel;
    ``is_causal`` for GPT) and nothing reads the mask on the device, where each check would make
    the host wait for the GPU. The mask itself stays in the batch (sample digests and token counts
    read it). ``label_positions`` (for a model whose forward takes them: BERT's and ALBERT's
    masked-LM heads): the flat indices where ``labels != -100`` are found here too
    (``LABEL_POSITIONS``, passed on by ``model_inputs``), so the head gathers its rows with no
    wait either, padded to a multiple of ``POSITIONS_MULTIPLE`` with a position that has no target
    (``ctxmodels.ops.padded_positions``): a run's steps then take a handful of shapes, which a
    compiled model keeps graphs for and CUDA graphs replay, while the loss and metrics count the
    real targets only. On the CPU the batch is returned as it is: the families check their masks
    there.
    """
    import torch

    if torch.device(device).type != "cuda":
        return batch
    host = dict(batch)
    labels = batch.get("labels")
    if label_positions and isinstance(labels, torch.Tensor) and labels.device.type == "cpu":
        from ctxmodels.ops import padded_positions

        host[LABEL_POSITIONS] = padded_positions(labels, POSITIONS_MULTIPLE)
    out: dict[str, Any] = {}
    for k, v in host.items():
        if isinstance(v, torch.Tensor) and v.device.type == "cpu":
            # (an expanded view cannot be pinned: one copy of it first)
            v = v.contiguous().pin_memory().to(device, non_blocking=True)
        out[k] = v
    if LABEL_POSITIONS in host:
        from torch._dynamo import maybe_mark_dynamic

        # their count varies: a model compiled whole compiles once for every count, not once per
        # count (marked on the device's copy: the mark is an attribute of the tensor, not its data)
        maybe_mark_dynamic(out[LABEL_POSITIONS], 0)
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.device.type == "cpu" and bool(mask.all()):
        out[NO_PADDING] = True
    return out


def resume_state(run: str, store: storage.Store) -> tuple[dict[str, Any], DataPosition] | None:
    """trainer_state.json and the data position of the run's latest committed checkpoint, if any."""
    latest = store.latest_complete_checkpoint(run)
    if latest is None:
        return None
    state = json.loads(store.read_bytes(storage.join(latest, "trainer_state.json")))
    return state, load_position(latest, store)


def row_digests(batch: dict[str, Any]) -> list[str]:
    """A short hash of each row's model inputs (tokens, mask, labels, ...): two runs that fed a
    sample identically give it the same digest."""
    import hashlib

    # the batch's model columns, the attention mask included where to_device lets the model skip it
    inputs = {k: v for k, v in sorted(batch.items()) if k not in BOOKKEEPING and not k.startswith("_") and k != "reset_memory"}
    rows = len(batch["sample_id"])
    arrays = [np.ascontiguousarray(v.detach().cpu().numpy()).reshape(rows, -1) for v in inputs.values()]
    return [hashlib.blake2b(b"".join(a[i].tobytes() for a in arrays), digest_size=8).hexdigest() for i in range(rows)]


class SampleLog:
    """``train.sample_log``: every consumed sample id, per worker and attempt, as JSON lines under
    ``<run>/sample_log/``, for audits and the exactly-once tests. A line is written when its
    optimizer step is done; the first line of a file says which step the attempt resumed from.
    A local file is appended to; an object-store file (no appends there) is rewritten whole.
    Best-effort (telemetry): a failed write is a warning; an object-store file catches up at the
    next write, which sends every line again."""

    def __init__(self, run: str, store: storage.Store, rank: int, world: int, resumed_step: int, resumed_from: str | None) -> None:
        import uuid

        self.uri = storage.join(run, "sample_log", f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}-rank{rank}.jsonl")
        self.store = store
        self.fs, self.path = storage.filesystem(self.uri, store.endpoint_url)
        self.remote = storage.is_remote(self.uri)
        self.lines: list[str] = []  # the lines an object-store file must hold
        self.write([json.dumps({"rank": rank, "world": world, "pid": os.getpid(), "resumed_step": resumed_step, "resumed_from": resumed_from})])

    def step(self, step: int, batches: list[dict[str, Any]], skipped: bool = False) -> None:
        """The samples of optimizer step ``step``; ``skipped``: of an attempt at it that was skipped
        (consumed, committed with the next checkpoint, not trained on)."""
        self.write([
            json.dumps({
                "step": step,
                **({"skipped": True} if skipped else {}),
                "epoch": np.asarray(b["epoch"].cpu()).reshape(-1).tolist(),
                "ids": np.asarray(b["sample_id"].cpu()).reshape(-1).tolist(),
                "digests": row_digests(b),
            })
            for b in batches
        ])

    def write(self, new: list[str]) -> None:
        if not self.remote:

            def append() -> None:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a") as f:
                    f.write("".join(line + "\n" for line in new))

            self.store.best_effort(append, f"write {self.uri}")
            return
        self.lines.extend(new)
        data = "".join(line + "\n" for line in self.lines).encode()

        def put() -> None:
            with self.fs.open_output_stream(self.path) as f:
                f.write(data)

        self.store.best_effort(put, f"write {self.uri}")


def open_metrics_log(run: str, store: storage.Store):
    """Rank 0's ``MetricsLog``, or None (with a warning) when its folder cannot be set up: metrics
    are telemetry, a run trains without them."""
    from jobs.training.metrics import MetricsLog

    try:
        return MetricsLog(run, store)
    except (OSError, storage.StorageError) as e:
        print(f"warning: metrics of {run} will not be written: {e}", file=sys.stderr)
        return None


class StepSamples:
    """The samples one worker consumed in the current optimizer step, as (n,) arrays."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, ...]] = []

    def add(self, batch: dict[str, Any]) -> None:
        cols = [batch[k] for k in ("epoch", "_shard", "sample_id", "_shard_total")]
        self.parts.append(tuple(np.asarray(c.cpu() if hasattr(c, "cpu") else c).reshape(-1) for c in cols))

    def arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(np.concatenate(col) for col in zip(*self.parts)) if self.parts else tuple(np.zeros(0, np.int64) for _ in range(4))


def freeze_unused(model, inputs: dict[str, Any]) -> list[str]:
    """Freeze parameters the loss never reaches (e.g. BERT's pooler under MLM-only training).

    One forward/backward on a real batch finds them. DDP would otherwise fail on them, or need
    ``find_unused_parameters=True``, which walks the autograd graph on every step.
    """
    import torch

    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[]):  # the probe's dropout must not shift the RNG stream
        model(**inputs).loss.backward()
    frozen = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    for n, p in model.named_parameters():
        if n in frozen:
            p.requires_grad_(False)
    model.zero_grad(set_to_none=True)
    return frozen


# ---------------------------------------------------------------------------------------------
# Optimizer and schedule


def param_groups(model, weight_decay: float, discriminative: float | None = None, by_depth: bool = False):
    """No weight decay on biases and LayerNorm weights (as BERT's AdamWeightDecayOptimizer).

    ``discriminative`` (ULMFiT's discriminative fine-tuning, Howard & Ruder 2018, sec. 3.2): one
    pair of groups per layer depth (``layer_depths``), depth d learning at ``lr / discriminative**d``
    (``lr_scale``; the paper's 2.6). ``by_depth``: the same groups at one learning rate (what
    gradual unfreezing needs to know the depths). Each group says its ``depth``."""
    if discriminative is None and not by_depth:
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.ndim < 2 else decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    depths = layer_depths(model)
    factor = discriminative or 1.0
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        d = depths[name]
        g = groups.setdefault((d, p.ndim < 2), {"params": [], "weight_decay": 0.0 if p.ndim < 2 else weight_decay,
                                                 "depth": d, "lr_scale": factor ** -d})
        g["params"].append(p)
    return [groups[k] for k in sorted(groups)]


_BLOCK = re.compile(r"(?:^|\.)(?:layers|blocks|fwd_lstms|bwd_lstms)\.(\d+)\.")


def layer_depths(model) -> dict[str, int]:
    """Each parameter's layer depth, counted from the top as ULMFiT unfreezes and discounts them:
    0 the task head (everything outside ``backbone``, or a pretraining model's heads), 1 the last
    block (and the backbone's other non-embedding parameters: pooler, final LayerNorm), ...,
    ``n`` the first of ``n`` blocks, ``n + 1`` the embeddings. Blocks are ``backbone.layers.i``,
    ``backbone.blocks.i`` or ELMo's ``fwd_lstms.i``/``bwd_lstms.i`` (both directions of a layer
    together); ALBERT's shared layers are one body at depth 1 over its embeddings at 2."""
    names = [n for n, _ in model.named_parameters()]
    blocks = [int(m.group(1)) for n in names if (m := _BLOCK.search(n))]
    n_blocks = max(blocks) + 1 if blocks else 0
    out = {}
    for name in names:
        m = _BLOCK.search(name)
        inside = name.startswith("backbone.")
        if m:
            out[name] = 1 + (n_blocks - 1 - int(m.group(1)))
        elif inside and ("emb" in name.split(".")[1] or "embed" in name):
            out[name] = max(n_blocks, 1) + 1
        elif inside:
            out[name] = 1
        else:
            out[name] = 0
    return out


def stlr_factor(samples: int, batch_size: int, total_steps: int, cut_frac: float = 0.1, ratio: float = 32.0) -> float:
    """ULMFiT's slanted triangular learning rate (Howard & Ruder 2018, eq. 3), as a factor of the
    peak: at step ``t = samples // batch_size`` of ``T = total_steps``, ``cut = floor(T * cut_frac)``,
    ``p = t / cut`` before the cut, else ``1 - (t - cut) / (cut * (1 / cut_frac - 1))``, and the factor
    ``(1 + p * (ratio - 1)) / ratio``: a short linear rise, a long linear fall, never below
    ``1 / ratio``."""
    t, cut = samples // batch_size, max(1, math.floor(total_steps * cut_frac))
    p = t / cut if t < cut else 1.0 - (t - cut) / (cut * (1.0 / cut_frac - 1.0))
    return (1.0 + max(0.0, p) * (ratio - 1.0)) / ratio


def lr_factor(samples: int, warmup_samples: int, total_samples: int) -> float:
    """Linear warm-up to the peak, then linear decay to zero (BERT, RoBERTa), as a function of the
    samples consumed, so a change of worker count or micro-batch size leaves the schedule alone."""
    if samples < warmup_samples:
        return (samples + 1) / max(1, warmup_samples)
    return max(0.0, (total_samples - samples) / max(1, total_samples - warmup_samples))


def build_optimizer(model, wrapped, strategy: str, device, lr: float, weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-8,
                    discriminative: float | None = None, by_depth: bool = False):
    """AdamW without decay on biases/LayerNorm; fused (one kernel over all parameters) under DDP
    on CPU and CUDA; FSDP's sharded DTensor parameters take the default implementation. Groups per
    layer depth with ``discriminative`` or ``by_depth`` (``param_groups``)."""
    import torch

    fused = strategy == "ddp" and device.type in ("cpu", "cuda")
    groups = param_groups(model, weight_decay, discriminative, by_depth)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)


def load_optimizer(wrapped, optimizer, resumed: "Resumed") -> None:
    """The resumed optimizer state (saved in single-device layout: loads under DDP and FSDP)."""
    from ctxmodels.checkpoint import optimizer_state_from_tensors
    from jobs.training import parallel

    if resumed.optimizer_tensors is None:
        return
    saved = optimizer_state_from_tensors(resumed.optimizer_tensors, resumed.raw_state["optimizer"], type(optimizer).__name__)
    parallel.load_full_optimizer_state(wrapped, optimizer, saved)


# ---------------------------------------------------------------------------------------------
# Metrics of one logging interval


class StepMeter:
    """Sums of one logging interval on one worker; ``reduce`` turns every worker's into means.

    The loss is averaged per micro-batch. A model metric is averaged per micro-batch too, or, when
    ``token_metric(name)`` says so, weighted by the micro-batch's ``n_pred`` (the number of
    predicted tokens), so a token-level accuracy is the share of all predicted tokens.
    """

    def __init__(self, token_metric: Callable[[str], bool] = lambda name: False) -> None:
        self.token_metric = token_metric
        self.reset()

    def reset(self) -> None:
        self.values: dict[str, float] = {}  # metric -> sum of value x weight
        self.weights: dict[str, float] = {}  # metric -> sum of weights
        self.counts = {"loss": 0.0, "micro": 0.0, "rows": 0.0, "tokens": 0.0, "steps": 0.0, "wait": 0.0}
        self.t0 = time.perf_counter()

    def add(self, name: str, value: float, weight: float = 1.0) -> None:
        self.values[name] = self.values.get(name, 0.0) + value * weight
        self.weights[name] = self.weights.get(name, 0.0) + weight

    def micro_batch(self, out, batch: dict[str, Any]) -> None:
        """One forward's loss and metrics, and its batch's rows and real tokens."""
        self.add_micro_batch(float(out.loss.detach()), out.metrics, batch)

    def add_micro_batch(self, loss: float, metrics: dict[str, Any], batch: dict[str, Any]) -> None:
        """``micro_batch`` from the loss and metrics as numbers (the ``Stepper`` keeps those, not the
        outputs, until it knows whether the step is trained or skipped)."""
        n_pred = float(metrics.get("n_pred", 0.0))
        self.counts["loss"] += loss
        self.counts["micro"] += 1.0
        for k, v in metrics.items():
            if k != "n_pred":
                self.add(k, float(v), n_pred if self.token_metric(k) else 1.0)
        self.counts["rows"] += len(batch["sample_id"])
        mask = None if batch.get(NO_PADDING) else batch.get("attention_mask")  # all ones: no sum on the device
        self.counts["tokens"] += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        if "_stream_block" in batch:  # share of batches started without memory: 1 / block length if Ray kept blocks whole
            self.add("stream_resets", float(batch["reset_memory"].reshape(-1)[0]))

    def waited(self, seconds: float) -> None:
        self.counts["wait"] += seconds

    def step(self) -> None:
        self.counts["steps"] += 1.0

    @property
    def steps(self) -> int:
        return int(self.counts["steps"])

    def reduce(self, world: int) -> dict[str, float]:
        """Means over every worker's interval (a collective: every rank calls it), then a new
        interval. ``tokens`` is the interval's real tokens over all workers."""
        import torch

        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        names = sorted(self.values)
        if world > 1 and torch.distributed.is_initialized():  # a worker that evaluated nothing has no names
            names = sorted(set().union(*all_gather(names, world)))
        counts = sorted(self.counts)
        vec = torch.tensor([self.values.get(k, 0.0) for k in names] + [self.weights.get(k, 0.0) for k in names] + [self.counts[k] for k in counts], dtype=torch.float64)
        if world > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(vec)
        v = vec.tolist()
        sums, weights, total = v[: len(names)], v[len(names) : 2 * len(names)], dict(zip(counts, v[2 * len(names) :]))
        out = {"loss": total["loss"] / max(total["micro"], 1.0)}
        out.update({k: s / max(w, 1e-9) for k, s, w in zip(names, sums, weights)})
        out["tokens"] = total["tokens"]
        out["tokens_per_s"] = total["tokens"] / elapsed
        out["samples_per_s"] = total["rows"] / elapsed
        out["data_wait"] = total["wait"] / (elapsed * world)  # share of step time spent waiting for data
        self.reset()
        return out


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


# ---------------------------------------------------------------------------------------------
# The optimizer step


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss, gradient norm or weight and cannot go on."""


@dataclass
class Taken:
    """What one call of ``Stepper.step`` consumed: its micro-batches, and whether the optimizer step
    was skipped (a non-finite loss or gradient norm on some rank: no update, the samples consumed)."""

    batches: list[dict[str, Any]]
    skipped: bool = False


def _random_state(device) -> tuple:
    """The random state a forward's dropout draws from: the CPU generator's, and the device's."""
    import torch

    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_random_state(device, state: tuple) -> None:
    import torch

    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@dataclass
class Stepper:
    """One optimizer step over ``accumulation`` micro-batches of this worker (docs/EXACTLY_ONCE.md
    "Worker counts, batch size and the schedule"): the gradient all-reduce only on the last
    (``no_sync``), clipping, then the learning rate of the samples consumed so far.

    A step whose loss (on any rank, any micro-batch) or gradient norm is not finite is skipped on
    every rank alike (docs/FAULTS.md): no optimizer update, ``step`` and ``samples_seen`` stay, the
    gradients are dropped and ``TrainState.bad_steps`` counts it; ``max_bad_steps`` skips in a row
    raise ``NonFiniteError``."""

    wrapped: Any  # the model as wrapped by jobs.training.parallel.wrap_model
    optimizer: Any
    plan: Any  # jobs.training.parallel.ParallelPlan
    device: Any
    accumulation: int  # micro-batches per worker per step
    batch_size: int  # global rows per step
    lr: float  # peak learning rate
    schedule: Callable[[int], float]  # samples consumed -> factor of lr
    grad_clip: float = 0.0  # 0: no clipping
    inputs: Callable[[dict[str, Any]], dict[str, Any]] = model_inputs
    max_bad_steps: int = 10  # skipped steps in a row before the run stops
    debug_nan_steps: tuple[int, ...] = ()  # fault injection: attempts (1-based, skips counted) whose loss is made NaN on rank 0
    # ULMFiT's gradual unfreezing: step -> how many layer depths train (0: the head, 1: the last
    # block, ...); the deeper groups' gradients are dropped before clipping and the update, so
    # they neither move nor gather optimizer state. None: every depth trains.
    trainable_depths: Callable[[int], int | None] | None = None
    # A gradient-cached step (``_cached``): the loss of all the step's micro-batches' outputs at once
    # (an embedding task's in-batch negatives over the whole batch). None: each micro-batch's own loss.
    cached_loss: Callable[[Any], tuple[Any, dict[str, Any]]] | None = None
    _forget_memory: bool = field(default=False, repr=False)
    _bad_in_a_row: int = field(default=0, repr=False)
    _top_lr: float | None = field(default=None, repr=False)  # lr * schedule at the last step: the head's rate

    def forget_memory(self) -> None:
        """The next micro-batch starts without recurrent memory (after an evaluation changed it)."""
        self._forget_memory = True

    def step(self, batches: Iterator[dict[str, Any]], state: TrainState, meter: StepMeter) -> Taken | None:
        """Train one step on the next micro-batches; returns them (``Taken.skipped`` when the step
        was skipped: the caller records their samples as consumed and starts the next attempt), or
        None when the stream ended inside the step (its partial gradient is dropped, its samples
        not recorded)."""
        import torch

        from jobs.training import parallel

        poisoned = (state.attempts + 1) in self.debug_nan_steps and parallel._rank() == 0
        got = (self._cached if self.cached_loss is not None else self._accumulated)(batches, meter, poisoned)
        if got is None:
            self.optimizer.zero_grad(set_to_none=True)
            return None
        taken, measured = got
        limit = self.trainable_depths(state.step) if self.trainable_depths is not None else None
        if limit is not None:
            for g in self.optimizer.param_groups:
                if g.get("depth", 0) >= limit:  # frozen at this step: as if requires_grad were False
                    for p in g["params"]:
                        p.grad = None
        norm = parallel.grad_norm(self.wrapped)  # before clipping, which the optimizer step does (clipped_step)
        # One decision for every rank, before any rank updates: DDP's averaged gradients are NaN
        # everywhere if they are NaN anywhere, but a rank's loss is its own (and a rank whose
        # gradients are finite must not step while another skips: the weights would part).
        local_bad = not all(math.isfinite(loss) for loss, _ in measured)
        bad = torch.tensor([float(local_bad)], device=norm.device) + (~torch.isfinite(norm)).float().reshape(1)
        if parallel.world_size() > 1:
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if bad.item() > 0:
            self.optimizer.zero_grad(set_to_none=True)
            state.bad_steps += 1
            self._bad_in_a_row += 1
            if self._bad_in_a_row >= self.max_bad_steps:
                losses = ", ".join(f"{loss:g}" for loss, _ in measured)
                raise NonFiniteError(
                    f"train.max_bad_steps={self.max_bad_steps}: the last {self._bad_in_a_row} optimizer steps all had a "
                    f"non-finite loss or gradient norm (this rank's losses {losses}, gradient norm {float(norm):g}) and were "
                    f"skipped; the weights are those of step {state.step} (finite, {state.bad_steps} steps skipped in all). "
                    "Training stops here: the run's newest checkpoint was written before these steps and is kept. "
                    "Lower train.lr or raise train.warmup_steps, look for bad records in the data, or raise train.max_bad_steps."
                )
            return Taken(taken, skipped=True)
        self._bad_in_a_row = 0
        for (loss, metrics), batch in zip(measured, taken):
            meter.add_micro_batch(loss, metrics, batch)
        factor = self.schedule(state.samples_seen)
        for g in self.optimizer.param_groups:
            g["lr"] = self.lr * g.get("lr_scale", 1.0) * factor  # lr_scale: discriminative fine-tuning
        self._top_lr = self.lr * factor
        parallel.clipped_step(self.wrapped, self.optimizer, norm, self.grad_clip)
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.samples_seen += self.batch_size
        meter.step()
        return Taken(taken)

    def _next(self, batches: Iterator[dict[str, Any]], meter: StepMeter) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        batch = next(batches, None)
        meter.waited(time.perf_counter() - t0)
        if batch is not None and self._forget_memory and "reset_memory" in batch:
            batch["reset_memory"] = batch["reset_memory"].clone().fill_(1)
            self._forget_memory = False
        return batch

    def _accumulated(self, batches: Iterator[dict[str, Any]], meter: StepMeter, poisoned: bool):
        """Each micro-batch's own loss, its gradients added up: ([batches], [(loss, metrics)]), or
        None when the stream ended."""
        from jobs.training import parallel

        taken, measured = [], []
        for i in range(self.accumulation):
            batch = self._next(batches, meter)
            if batch is None:
                return None
            with parallel.no_sync(self.wrapped, active=i < self.accumulation - 1), parallel.autocast(self.plan, self.device):
                out = self.wrapped(**self.inputs(batch))
            loss = out.loss * float("nan") if poisoned else out.loss  # NaN gradients too, as a real fault gives
            (loss / self.accumulation).backward()
            # Numbers only: keeping ``out`` until the decision would hold every micro-batch's logits.
            measured.append((float(loss.detach()), {k: float(v) for k, v in out.metrics.items()}))
            taken.append(batch)
        return taken, measured

    def _cached(self, batches: Iterator[dict[str, Any]], meter: StepMeter, poisoned: bool):
        """One loss over the outputs of all the step's micro-batches, at the memory of one micro-batch's
        activations: the gradient cache of Gao et al. 2021 ("Scaling Deep Contrastive Learning Batch
        Size under Memory Limited Setup"; sentence-transformers' CachedMultipleNegativesRankingLoss).

        1. each micro-batch forward without a graph, keeping its outputs (``with_loss=False``: an
           embedding model's text vectors) and the random state it started from;
        2. ``cached_loss`` on all of them at once, backward to the outputs only;
        3. each micro-batch forward again from the same random state (the same dropout), its outputs'
           backward taking the gradients step 2 found for them; the all-reduce on the last.

        The parameters' gradients are those of the one loss on the whole step's batch (as if it fitted
        in memory), for the price of a second forward. Returns what ``_accumulated`` returns: every
        micro-batch measured with the step's loss and metrics."""
        import torch

        from jobs.training import parallel

        taken = []
        for _ in range(self.accumulation):
            batch = self._next(batches, meter)
            if batch is None:
                return None
            taken.append(batch)
        states, parts = [], []
        with torch.no_grad():
            for batch in taken:
                states.append(_random_state(self.device))
                with parallel.autocast(self.plan, self.device):
                    parts.append(self.wrapped(**self.inputs(batch), with_loss=False).logits.detach())
        outputs = torch.cat(parts).requires_grad_()
        loss, metrics = self.cached_loss(outputs)
        loss = loss * float("nan") if poisoned else loss
        loss.backward()
        grads = outputs.grad.split([len(part) for part in parts])
        del outputs, parts
        for i, (batch, random_state, grad) in enumerate(zip(taken, states, grads)):
            _set_random_state(self.device, random_state)
            with parallel.no_sync(self.wrapped, active=i < self.accumulation - 1), parallel.autocast(self.plan, self.device):
                out = self.wrapped(**self.inputs(batch), with_loss=False)
            out.logits.backward(grad)
        measured = (float(loss.detach()), {k: float(v) for k, v in metrics.items()})
        return taken, [measured] * len(taken)

    @property
    def current_lr(self) -> float:
        """The learning rate of the top layers (the peak's share the schedule gives now)."""
        if self._top_lr is not None:
            return float(self._top_lr)
        return float(max(g["lr"] for g in self.optimizer.param_groups))  # before the first step


# ---------------------------------------------------------------------------------------------
# Evaluation


def evaluate_batches(wrapped, batches: list[dict[str, Any]], plan, device, rank: int, world: int,
                     forward: Callable[[Any, dict[str, Any], bool], None]) -> None:
    """Run ``forward(model, batch, counted)`` (no grad, eval mode) over each worker's contiguous
    share of ``batches``; the caller's ``forward`` collects what it needs and reduces it afterwards.

    Every worker runs the same number of forwards, so FSDP's per-forward collectives pair up: a
    worker whose share is short repeats a batch with ``counted`` False (a pass for the collectives
    only). Under DDP the unwrapped module runs (no collectives at all). Recurrent memory: the first batch of each share starts without
    it (``reset_memory`` 1); the caller makes the next training batch start without it too.
    """
    import torch

    from jobs.training import parallel

    n = len(batches)
    per = -(-n // world) if n else 0
    mine = batches[rank * per : (rank + 1) * per]
    fsdp = parallel._is_fsdp(wrapped)
    model = wrapped if fsdp else parallel.unwrap(wrapped)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), parallel.autocast(plan, device):
            for i in range(per):
                real = i < len(mine)
                batch = dict(mine[i] if real else batches[0])
                if i == 0 and "reset_memory" in batch:
                    batch["reset_memory"] = torch.ones_like(batch["reset_memory"])
                if real or fsdp:
                    forward(model, batch, real)
    finally:
        model.train(was_training)


def all_gather(obj: Any, world: int) -> list[Any]:
    """Every worker's ``obj`` (a collective); ``[obj]`` alone."""
    import torch

    if world > 1 and torch.distributed.is_initialized():
        parts = [None] * world
        torch.distributed.all_gather_object(parts, obj)
        return parts
    return [obj]


# ---------------------------------------------------------------------------------------------
# Resume


@dataclass
class Resumed:
    uri: str | None = None  # the checkpoint resumed from (None: a fresh start)
    state: TrainState = field(default_factory=TrainState)
    raw_state: dict[str, Any] = field(default_factory=dict)  # trainer_state.json as written
    optimizer_tensors: dict[str, Any] | None = None
    position: DataPosition = field(default_factory=DataPosition)


def resume(run: str, store: storage.Store, model, rank: int = 0) -> Resumed:
    """The run's latest complete checkpoint (the same one the data stage reads the position of),
    its weights loaded into ``model``. Ray's ``get_checkpoint()`` is not used: it could name a
    checkpoint whose upload was cut off. Reads retry until ``store``'s deadline (data.retry_deadline_s).

    A remote checkpoint is downloaded into a temporary folder that is removed once its files are
    in memory, whatever happens (every worker does this at every restart). Rank 0 first deletes
    the run's incomplete checkpoint folders older than the newest complete one
    (``Store.remove_incomplete_checkpoints``): leftovers of copies cut off by earlier failures.
    """
    from safetensors.torch import load_file

    from ctxmodels.checkpoint import load_checkpoint

    if rank == 0:
        for uri, problem in store.remove_incomplete_checkpoints(run):
            print(f"removed incomplete checkpoint {uri} ({problem}): older than the newest complete one")
    uri = store.latest_complete_checkpoint(run)
    if uri is None:
        return Resumed()
    with tempfile.TemporaryDirectory(prefix="ctx-resume-") as tmp:
        # a local run folder is read in place
        local = store.download_dir(uri, Path(tmp) / "checkpoint")
        model.load_state_dict(load_checkpoint(local).model.state_dict())
        raw = json.loads((local / "trainer_state.json").read_text())
        # load_file copies the tensors into memory (no mapping of a file about to be deleted)
        opt = load_file(str(local / "optimizer.safetensors"))
        position = load_position(str(local), store)
    return Resumed(uri, TrainState.from_json(raw), raw, opt, position)


# ---------------------------------------------------------------------------------------------
# The checkpoint commit


def checkpoint_name() -> str:
    """A new checkpoint folder name, in Ray Train V2's form but in UTC (a change of the machine's
    time zone does not reorder names). Resume orders checkpoints by their step, not by name
    (``Store.latest_complete_checkpoint``): the name is for people."""
    return "checkpoint_" + datetime.now(timezone.utc).strftime("%Y-%m-%d_%H-%M-%S.%f")


def ensure_free_space(need: dict[str, int]) -> None:
    """Raise ``OSError`` (ENOSPC) before writing when a local folder's filesystem has less free space
    than ``need`` (folder -> bytes about to be written under it). Folders on one filesystem add up;
    a folder that does not exist yet is measured at its nearest existing parent."""
    import errno
    import shutil

    by_device: dict[int, tuple[list[str], int, int]] = {}
    for folder, size in need.items():
        path = Path(folder).resolve()
        while not path.exists() and path != path.parent:
            path = path.parent
        dev = os.stat(path).st_dev
        names, total, _ = by_device.get(dev, ([], 0, 0))
        by_device[dev] = (names + [folder], total + size, shutil.disk_usage(path).free)
    for names, total, free in by_device.values():
        if free < total:
            raise OSError(
                errno.ENOSPC,
                f"not enough free disk space for a checkpoint: {total / 2**20:,.0f} MiB to write under "
                f"{' and '.join(names)}, {free / 2**20:,.0f} MiB free there; free some space (old runs, "
                "temporary files) or point TMPDIR (the checkpoint's staging folder) at a larger disk",
            )


def _tensor_bytes(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass
class Checkpointer:
    """Commits checkpoints with the data position (docs/EXACTLY_ONCE.md).

    ``record`` after each optimizer step; ``commit`` at a checkpoint (every rank calls it: it
    gathers, and under FSDP it gathers the weights). ``save(folder, model, extra_json,
    extra_tensors)`` writes the model files (``ctxmodels.checkpoint.save_checkpoint``);
    ``fresh_model()`` builds an unsharded CPU copy for FSDP's gathered weights.
    """

    run: str
    store: storage.Store  # the recipe's: data.endpoint_url, and data.retry_deadline_s for how long an upload retries
    shard_keys: list[int]  # every shard (work-unit key) of an epoch: an epoch closes when all are complete
    rank: int
    world: int
    position: DataPosition
    save: Callable[[str, Any, dict[str, Any], dict[str, Any]], None]
    fresh_model: Callable[[], Any]
    strategy: str = "ddp"
    sampleless: Callable[[int], set[int]] | None = None  # epoch -> shard keys read whole that made no samples
    on_epoch_closed: Callable[[int], None] | None = None  # rank 0, once per closed epoch
    pending: DataPosition = field(default_factory=DataPosition)  # this worker's samples since the last commit
    committed_step: int = 0

    def record(self, batches: list[dict[str, Any]]) -> None:
        """The samples of a finished optimizer step."""
        samples = StepSamples()
        for b in batches:
            samples.add(b)
        self.pending.add(*samples.arrays())

    def merge(self) -> None:
        """Every worker's samples since the last commit, merged on rank 0 (which writes the
        checkpoint) into the committed position; epochs whose every shard is complete close."""
        parts = all_gather(self.pending.to_arrays(), self.world)
        self.pending = DataPosition()
        if self.rank != 0:
            return  # only rank 0's position is written; the others keep none
        for arrays in parts:
            self.position.merge(DataPosition.from_arrays(arrays))
        for epoch in self.position.close_epochs(self.shard_keys, self.sampleless):
            if self.on_epoch_closed is not None:
                self.on_epoch_closed(epoch)

    def commit(self, state: TrainState, wrapped, optimizer, metrics: dict[str, Any], extra_state: dict[str, Any] | None = None,
               name: str | None = None) -> str | None:
        """A checkpoint of ``state`` with the data position, in folder ``name`` (rank 0's counts;
        default a new ``checkpoint_name()``); returns the name on rank 0, None elsewhere. Ray seam:
        ``ray.train.report`` with the checkpoint, a barrier of every rank."""
        import ray.train
        import torch
        from ray.train import Checkpoint

        from ctxmodels.checkpoint import optimizer_state_to_tensors
        from jobs.training import parallel

        self.merge()
        state.epoch = self.position.first_epoch if self.rank == 0 else state.epoch
        state.world_size = self.world
        self.committed_step = state.step
        # Collectives under FSDP (gathering shards): every rank calls them.
        opt_state = parallel.full_optimizer_state(wrapped, optimizer)
        if self.strategy == "fsdp":
            full = parallel.full_state_dict(wrapped)
            if self.rank == 0:  # a CPU copy of the model holds the gathered weights for saving
                model = self.fresh_model()
                model.load_state_dict(full)
        else:
            model = parallel.unwrap(wrapped)
        # The Stepper never applies a non-finite step, but an update can still overflow: such
        # weights are never written (every rank raises alike), so Ray's rotation cannot push the
        # last good checkpoint out for them. A collective under FSDP (each rank checks its shards).
        if not parallel.all_finite(wrapped):
            raise NonFiniteError(
                f"the weights at step {state.step} are not all finite: no checkpoint written, training stops; "
                "the run's newest checkpoint is intact: rerun to resume from it, with a lower train.lr"
            )
        if self.rank != 0:
            ray.train.report(metrics, checkpoint=None)
            return None
        name = name or checkpoint_name()
        tensors, meta = optimizer_state_to_tensors(opt_state, name=type(optimizer).__name__)
        position = {k: torch.from_numpy(v) for k, v in self.position.to_arrays().items()}
        # The staging folder, and a local run folder Ray copies it into, must hold the weights,
        # the optimizer state and the position (tokenizer and JSON files are small: 10% slack).
        size = int(1.1 * (_tensor_bytes(model.state_dict()) + _tensor_bytes(tensors) + _tensor_bytes(position))) + (1 << 20)
        need = {tempfile.gettempdir(): size}
        if not storage.is_remote(self.run):
            need[storage.filesystem(self.run)[1]] = size
        ensure_free_space(need)
        with tempfile.TemporaryDirectory(prefix="ctx-ckpt-") as d:
            self.save(
                d,
                model,
                {"trainer_state.json": state.to_json(**(extra_state or {}), optimizer=meta)},
                {"optimizer.safetensors": tensors, POSITION_FILE: position},
            )
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d), checkpoint_dir_name=name,
                             checkpoint_upload_fn=self.upload)
        return name

    def upload(self, checkpoint, name: str):
        """Ray seam (``report``'s ``checkpoint_upload_fn``): copy the checkpoint folder to
        ``<run>/<name>`` with ``Store.copy_dir``, MANIFEST last, each file retried through an
        outage until the store's deadline; past it the worker fails with a ``StorageError``
        naming the object and the endpoint."""
        from ray.train import Checkpoint

        dest = storage.join(self.run, name)
        self.store.copy_dir(checkpoint.path, dest)
        fs, path = storage.filesystem(dest, self.store.endpoint_url)
        return Checkpoint(path=path, filesystem=fs)


# ---------------------------------------------------------------------------------------------
# Driver side


def run_folder(output_dir: str, name: str) -> str:
    """``<output_dir>/<name>``, absolute for a local output_dir."""
    if not storage.is_remote(output_dir):
        output_dir = str(Path(storage.filesystem(output_dir)[1]))
    return storage.join(output_dir, name)


def ingest_options():
    """Ray Train's default ingest options (``DataConfig.default_ingest_options``: the current
    DataContext's limits), with the order of blocks preserved."""
    from ray.data import ExecutionOptions
    from ray.data.context import DataContext

    current = DataContext.get_current().execution_options
    return ExecutionOptions(resource_limits=current.resource_limits, preserve_order=True, verbose_progress=current.verbose_progress)


def scaling_config(scaling):
    """Ray Train's ScalingConfig of a recipe's scaling section. With ``num_workers: [min, max]``
    Ray Train V2 places as many workers as the cluster holds and, every ``resize_interval_s``
    while the run is healthy, restarts the group from its last checkpoint at a new size when
    that changed; custom ``resources_per_worker`` tie that size to the nodes that carry them
    (docs/EXACTLY_ONCE.md, "Elastic on a live cluster")."""
    from ray.train import ScalingConfig

    return ScalingConfig(
        num_workers=scaling.num_workers,  # an int, or (min, max): elastic
        use_gpu=scaling.use_gpu,
        resources_per_worker={"CPU": scaling.cpus_per_worker, **scaling.resources_per_worker},
        elastic_resize_monitor_interval_s=scaling.resize_interval_s,
    )


@dataclass
class FitResult:
    checkpoint_uri: str | None
    metrics: dict[str, Any]
    history: list[dict[str, Any]]


def fit(loop: Callable[[dict[str, Any]], None], loop_config: dict[str, Any], *, name: str, output_dir: str,
        store: storage.Store, scaling, datasets: dict[str, Any], max_steps: int, progress: bool = True,
        label: str = "pretrain", checkpoint_config=None, dataset_config=None) -> FitResult:
    """Run ``loop`` on Ray Train workers with the progress board; raises what the run raised.

    ``scaling``: a recipe's scaling section (num_workers int or (min, max), use_gpu,
    cpus_per_worker, resources_per_worker, resize_interval_s, max_failures). Ray seam:
    ``TorchTrainer.fit`` in a thread while the driver renders rank 0's metrics (``jobs.training.progress``).
    ``store``: the run's; its deadline is about how long the S3 client through which Ray Train's
    controller writes the run's state retries each request.
    """
    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from jobs.training.progress import ProgressBoard, run_with_progress

    # On the driver's node, as Ray Train puts its controller: a node that leaves an elastic run
    # must not take the board (and the run's history that fit returns) with it.
    board = ProgressBoard.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)).remote()
    remote = storage.is_remote(output_dir)
    # The controller writes the run's state (checkpoint_manager_snapshot.json) through this
    # filesystem and fails the whole run, whatever max_failures says, when a write fails: its S3
    # client retries for about the deadline (checkpoints go through Checkpointer.upload instead).
    storage_fs, storage_path = (storage.filesystem(output_dir, store.endpoint_url, store.deadline_s) if remote
                                else (None, str(Path(run_folder(output_dir, name)).parent)))
    trainer = TorchTrainer(
        loop,
        train_loop_config={**loop_config, "board": board},
        scaling_config=scaling_config(scaling),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            checkpoint_config=checkpoint_config or CheckpointConfig(num_to_keep=3),
            failure_config=FailureConfig(max_failures=scaling.max_failures),
        ),
        datasets=datasets,
        # Blocks leave the data stages in work-unit order, so the order samples are produced in
        # is a function of (seed, epoch) and epochs finish in turn (docs/EXACTLY_ONCE.md).
        dataset_config=dataset_config or DataConfig(execution_options=ingest_options()),
    )
    result = run_with_progress(trainer.fit, board, max_steps, enabled=progress, label=label)
    if result.error:
        raise result.error
    ckpt = None
    if result.checkpoint is not None:
        scheme = output_dir.split("://", 1)[0] + "://" if remote else ""
        ckpt = scheme + result.checkpoint.path
    return FitResult(ckpt, dict(result.metrics or {}), ray.get(board.history.remote()))


def report_progress(config: dict[str, Any], rank: int, metrics: dict[str, Any], metrics_log=None) -> None:
    """Rank 0 shows ``metrics`` on the driver's progress line and appends them to the run's log."""
    if rank != 0:
        return
    config["board"].update.remote(metrics)
    if metrics_log is not None:
        metrics_log.log(metrics)


# ---------------------------------------------------------------------------------------------
# The worker loop: one for every job (pretraining, distillation, fine-tuning)


class WorkerJob:
    """One kind of training as the worker loop runs it: what differs between pretraining,
    distillation and fine-tuning, behind the questions the loop asks. The loop (``run_worker``) owns the order of
    things and every cadence decision (log, evaluate, checkpoint, stop); a job owns its model,
    batches, inputs, evaluation and what a commit writes besides the checkpoint.

    A subclass sets ``recipe`` (a pretraining or fine-tuning recipe: ``train``, ``scaling``,
    ``data``, ``micro_batch_size``, ``accumulation``), ``run`` (the run's URI), ``total_steps`` and
    ``warmup_steps`` in its constructor, and overrides what it needs; the defaults are a job with
    no held-out data.
    """

    recipe: Any
    run: str
    total_steps: int
    warmup_steps: int
    units: list  # the shard keys (or unit numbers) whose data position the checkpoints commit
    extra: dict[str, Any]  # JSON written into every checkpoint (the recipe, ...)

    # -- set-up
    def build_model(self, rank: int):
        """The model before resuming: built, its starting weights loaded, and the worker's RNG
        seeded (``seed_worker_rng``) once its own initialisation is done."""
        raise NotImplementedError

    def resumed(self, resumed: "Resumed", rank: int) -> None:
        """Called after ``resume``: report where the run goes on from."""
        if rank == 0 and resumed.uri:
            print(f"resumed from {resumed.uri}: step {resumed.state.step}, {resumed.state.samples_seen} samples, "
                  f"data position {resumed.position.summary()}")

    def started(self, device, precision: str) -> None:
        """The device the worker trains on and the precision its step runs in (``jobs.training.parallel.step_precision``)."""

    def batches(self, config: dict[str, Any], micro: int, device) -> Iterator[dict[str, Any]]:
        """This worker's training micro-batches, on ``device``."""
        raise NotImplementedError

    empty_stream = "the data stream is empty: no full micro-batch of train.micro_batch_size rows"

    def freeze_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The forward's keywords for a batch, as ``freeze_unused`` probes them."""
        return model_inputs(batch)

    def frozen_message(self, frozen: list[str]) -> str:
        return f"not trained (frozen): {', '.join(frozen)}"

    step_inputs: Callable[[dict[str, Any]], dict[str, Any]] = staticmethod(model_inputs)  # the training forward's keywords

    def meter(self) -> "StepMeter":
        return StepMeter()

    def cached_loss(self, model, accumulation: int) -> Callable[[Any], tuple[Any, dict[str, Any]]] | None:
        """A loss over the outputs of all of a step's ``accumulation`` micro-batches at once, for a
        gradient-cached step (``Stepper._cached``); None: each micro-batch's own loss, added up."""
        return None

    def trainable_depths(self, step: int) -> int | None:
        """Gradual unfreezing (``train.gradual_unfreezing``): how many layer depths train at ``step``."""
        return None

    def checkpointer_options(self) -> dict[str, Any]:
        """``Checkpointer`` keywords beyond the common ones: ``save`` and ``fresh_model`` at least."""
        raise NotImplementedError

    def held_out(self, micro: int, device) -> bool:
        """Prepare the held-out data; whether there is any to evaluate on."""
        return False

    # -- while training
    def interval_extras(self, metrics: dict[str, Any], world: int) -> None:
        """Add the job's own figures to an interval's metrics reduced over ``world`` workers
        (perplexity, MFU, ...)."""

    def evaluation_due(self, step: int) -> bool:
        """Whether to evaluate after ``step`` (the last step always is, when there is held-out data)."""
        return False

    def checkpoint_due(self, step: int, evaluated: bool) -> bool:
        """Whether to commit a checkpoint after ``step`` (the last step always does)."""
        return step % self.recipe.train.checkpoint_every == 0

    def evaluate(self, wrapped, metrics: dict[str, Any], state: "TrainState", plan, device, rank: int,
                 world: int) -> bool:
        """Add held-out metrics to ``metrics``; return whether they are a new best."""
        return False

    def unscored(self, metrics: dict[str, Any]) -> None:
        """An interval logged without an evaluation."""

    def commit(self, checkpointer: "Checkpointer", state: "TrainState", wrapped, optimizer, metrics: dict[str, Any],
               improved: bool, rank: int) -> None:
        checkpointer.commit(state, wrapped, optimizer, metrics, self.extra)

    def stop_after_evaluation(self, state: "TrainState", rank: int) -> bool:
        """Early stopping: whether to stop after this evaluation."""
        return False

    def finished(self, state: "TrainState", rank: int) -> None:
        """After the last step or the end of the stream."""


def run_worker(job: WorkerJob, config: dict[str, Any]) -> None:
    """The loop every Ray Train worker runs, whatever the job: resume from what the run committed
    last, then step, record the samples, log, evaluate when due, commit when due, stop when done
    (``total_steps``, the end of the stream, or the job's early stopping); a run that ends between
    checkpoints commits what it trained. The exactly-once protocol (docs/EXACTLY_ONCE.md) is the
    ``Checkpointer``'s; skipped steps are the ``Stepper``'s (docs/FAULTS.md)."""
    import itertools

    import ray.train
    import ray.train.torch
    import torch

    from jobs.training import parallel

    recipe, t, run = job.recipe, job.recipe.train, job.run
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(recipe.scaling.cpus_per_worker)))
    store = storage.Store.of(recipe.data)  # every call of this worker: the recipe's endpoint and deadline
    micro, accum = recipe.micro_batch_size, recipe.accumulation(world)
    if micro * accum * world != t.batch_size:
        raise RuntimeError(f"{world} workers x {accum} micro-batches x {micro} rows != train.batch_size {t.batch_size}")
    total = job.total_steps

    model = job.build_model(rank)
    # Resume from what the run committed last, whatever restarted us (a rerun, a worker failure,
    # a new worker count).
    resumed = resume(run, store, model, rank)
    state = resumed.state
    job.resumed(resumed, rank)

    device = ray.train.torch.get_device()
    plan = parallel.ParallelPlan(strategy=recipe.scaling.strategy, precision=t.precision, compile=t.compile)
    precision = parallel.step_precision(plan, device)  # what autocast() runs the step in
    if rank == 0 and t.precision != precision:
        print(f"warning: train.precision is {t.precision!r}, but {device} has no native bf16 products (it takes a GPU, "
              "or a CPU with AVX512-BF16 or AMX): the step runs in fp32")
    # each applies its train setting to the model and says where it changes nothing
    for warning in (parallel.lower_residual(model, t.residual, precision), parallel.skip_padding(model, t.unpad, device)):
        if rank == 0 and warning is not None:
            print(warning)
    job.started(device, precision)
    stream = job.batches(config, micro, device)
    first = next(stream, None)
    if first is None:
        raise RuntimeError(job.empty_stream)
    frozen = freeze_unused(model.to(device), job.freeze_inputs(first))
    if frozen and rank == 0:
        print(job.frozen_message(frozen))
    wrapped = parallel.wrap_model(model, plan, device)
    unfreezing = getattr(t, "gradual_unfreezing", False)
    optimizer = build_optimizer(model, wrapped, recipe.scaling.strategy, device, t.lr, t.weight_decay, t.betas, t.eps,
                                discriminative=t.discriminative_lr, by_depth=unfreezing)
    load_optimizer(wrapped, optimizer, resumed)
    if t.schedule == "stlr":  # ULMFiT's slanted triangular rate: its rise is the warm-up
        schedule = partial(stlr_factor, batch_size=t.batch_size, total_steps=total, cut_frac=t.cut_frac, ratio=t.stlr_ratio)
    else:
        schedule = partial(lr_factor, warmup_samples=job.warmup_steps * t.batch_size, total_samples=total * t.batch_size)
    stepper = Stepper(wrapped, optimizer, plan, device, accum, t.batch_size, t.lr, schedule, t.grad_clip,
                      inputs=job.step_inputs, max_bad_steps=t.max_bad_steps, debug_nan_steps=t.debug_nan_steps,
                      trainable_depths=job.trainable_depths if unfreezing else None, cached_loss=job.cached_loss(model, accum))
    meter = job.meter()
    checkpointer = Checkpointer(run, store, job.units, rank, world, resumed.position, strategy=recipe.scaling.strategy,
                                committed_step=state.step, **job.checkpointer_options())
    has_held_out = job.held_out(micro, device)
    sample_log = SampleLog(run, store, rank, world, state.step, resumed.uri) if t.sample_log else None
    metrics_log = open_metrics_log(run, store) if rank == 0 else None
    t_start, start_step, epoch = time.perf_counter(), state.step, 0

    def interval_metrics() -> dict[str, Any]:
        """The interval's metrics, reduced over workers (every rank calls it)."""
        m = meter.reduce(world)
        state.tokens_seen += int(m.pop("tokens"))
        job.interval_extras(m, world)
        rate = (state.step - start_step) / max(time.perf_counter() - t_start, 1e-9)
        m.update(
            step=state.step, max_steps=total, epoch=epoch, lr=stepper.current_lr, samples_seen=state.samples_seen,
            tokens_seen=state.tokens_seen, workers=world, eta_s=(total - state.step) / rate if rate > 0 else None,
            bad_steps=state.bad_steps,
        )
        return m

    def evaluated(m: dict[str, Any]) -> bool:
        improved = job.evaluate(wrapped, m, state, plan, device, rank, world)
        stepper.forget_memory()  # evaluation ran other text through the memory of memory models
        return improved

    batches = itertools.chain([first], stream)
    model.train()
    stopped = False
    while state.step < total and not stopped:
        taken = stepper.step(batches, state, meter)
        if taken is None:  # the stream ended (inside a step: its partial gradient is dropped, its samples not committed)
            break
        # A skipped step's samples count as consumed, not trained on (docs/FAULTS.md): committed
        # with the next checkpoint, so the batch that broke the step is not fed again on resume.
        checkpointer.record(taken.batches)
        epoch = max(int(b["epoch"].max()) for b in taken.batches)
        if sample_log is not None:
            sample_log.step(state.step + taken.skipped, taken.batches, skipped=taken.skipped)
        if taken.skipped:
            continue  # no new step: nothing to log, evaluate or commit
        last = state.step >= total
        eval_now = has_held_out and (last or job.evaluation_due(state.step))
        ckpt_now = last or job.checkpoint_due(state.step, eval_now)
        if state.step % t.log_every == 0 or eval_now or ckpt_now:
            metrics, improved = interval_metrics(), False
            if eval_now:
                improved = evaluated(metrics)
            else:
                job.unscored(metrics)
            report_progress(config, rank, metrics, metrics_log)
            if ckpt_now:
                job.commit(checkpointer, state, wrapped, optimizer, metrics, improved, rank)
            else:
                ray.train.report(metrics)
            if eval_now and job.stop_after_evaluation(state, rank):
                stopped = True
    if state.step > checkpointer.committed_step:  # the stream ended between checkpoints: commit what was trained
        metrics, improved = (interval_metrics() if meter.steps else {"step": state.step}), False
        if has_held_out:
            improved = evaluated(metrics)
        if len(metrics) > 1:
            report_progress(config, rank, metrics, metrics_log)
        job.commit(checkpointer, state, wrapped, optimizer, metrics, improved, rank)
    if metrics_log is not None:
        metrics_log.close()
    job.finished(state, rank)
