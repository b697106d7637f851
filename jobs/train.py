"""`ctx pretrain`: a recipe -> a Ray Data stream -> Ray Train (DDP) -> checkpoints.

The driver checks the recipe and the corpus, gets the tokenizer (trains one from a sample of the
corpus, or reuses the run's), builds the lazy dataset and starts a ``TorchTrainer``. Rerunning
the same recipe (same ``output_dir`` and ``name``) resumes from the run's latest checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ctxmodels.registry import FAMILIES
from jobs.config import FAMILY_OBJECTIVES, Recipe, model_overrides_with_vocab
from pipelines import storage
from pipelines.dataset import StreamSpec, build_dataset, row_kind, shard_keys, tokenizer_dir_from_files, tokenizer_files
from pipelines.masking import MlmConfig
from pipelines.permutation import PlmConfig
from pipelines.position import POSITION_FILE, DataPosition, load_position
from pipelines.spans import NgramConfig, SpanConfig
from pipelines.sources import sample_text
from pipelines.tokenizers import load_tokenizer, train_tokenizer

BOOKKEEPING = ("sample_id", "epoch")
# Token-level metrics are averaged weighted by the number of predicted tokens; others per step.
TOKEN_LEVEL_PREFIXES = ("mlm_", "lm_", "plm_", "sbo_", "fwd_", "bwd_")


@dataclass
class PretrainResult:
    run_uri: str
    checkpoint_uri: str | None
    metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)  # every logged metrics dict of rank 0


# ---------------------------------------------------------------------------------------------
# Driver side.


def run_uri(recipe: Recipe) -> str:
    out = recipe.output_dir
    if not storage.is_remote(out):
        out = str(Path(storage.filesystem(out)[1]))
    return storage.join(out, recipe.name)


def ensure_tokenizer(recipe: Recipe, shards: list[str], run: str, workdir: Path, log=print) -> Path:
    """The run's tokenizer as a local folder: the recipe's, the run's saved one, or a new one."""
    ep = recipe.data.endpoint_url
    if recipe.tokenizer.path:
        return storage.download_dir(recipe.tokenizer.path, workdir / "tokenizer", ep)
    saved = storage.join(run, "tokenizer")
    if storage.exists(saved, ep):
        log(f"tokenizer: reusing {saved}")
        return storage.download_dir(saved, workdir / "tokenizer", ep)
    t = recipe.tokenizer
    log(f"tokenizer: training {t.kind} (vocab {t.vocab_size}) on up to {t.sample_chars:,} characters of the corpus")
    t0 = time.perf_counter()
    texts = sample_text(shards, t.sample_chars, recipe.data.format, recipe.data.text_field, ep)
    tok = train_tokenizer(t.kind, texts, t.vocab_size, lowercase=t.lowercase)
    local = workdir / "tokenizer"
    tok.save(local)
    storage.copy_dir(local, saved, ep)
    log(f"tokenizer: {tok.vocab_size} tokens in {time.perf_counter() - t0:.1f}s -> {saved}")
    return local


def resume_state(run: str, endpoint_url: str | None) -> tuple[dict[str, Any], DataPosition] | None:
    """trainer_state.json and the data position of the run's latest committed checkpoint, if any."""
    latest = storage.latest_complete_checkpoint(run, endpoint_url)
    if latest is None:
        return None
    fs, path = storage.filesystem(latest, endpoint_url)
    with fs.open_input_stream(f"{path}/trainer_state.json") as f:
        state = json.loads(f.read())
    return state, load_position(latest, endpoint_url)


def stream_spec(recipe: Recipe, shards: list[str], first_epoch: int = 0, run_uri: str | None = None) -> StreamSpec:
    d = recipe.data
    preset = FAMILIES[recipe.model.family].presets[recipe.model.preset]
    return StreamSpec(
        shards=tuple(shards),
        seq_len=d.seq_len,
        seed=d.seed,
        first_epoch=first_epoch,
        max_epochs=max(1, d.max_epochs - first_epoch),
        shuffle_files=d.shuffle_files,
        fmt=d.format,
        text_field=d.text_field,
        endpoint_url=d.endpoint_url,
        objective=d.objective,
        mlm=MlmConfig(mlm_probability=d.mlm_probability, whole_word=d.whole_word_mask),
        span=SpanConfig(mask_ratio=d.mlm_probability, geometric_p=d.span_geometric_p),
        ngram=NgramConfig(mask_ratio=d.mlm_probability, max_ngram=d.ngram_max),
        plm=PlmConfig(partial_k=d.plm_partial_k),
        plm_stream=d.plm_stream,
        # Stream-ordered batches are cut in the data stage, so it must know the rows of a
        # micro-batch (fixed whatever the worker count: fewer workers accumulate more of them).
        stream_rows=recipe.micro_batch_size,
        stream_block_batches=d.stream_block_batches,
        char_max_chars=int(recipe.model.overrides.get("max_chars", getattr(preset, "max_chars", 50))),
        tokenize_actors=d.tokenize_actors,
        strict=d.strict,
        max_record_chars=d.max_record_chars,
        run_uri=run_uri,
    )


def ingest_options():
    """Ray Train's default ingest options (``DataConfig.default_ingest_options``: the current
    DataContext's limits), with the order of blocks preserved."""
    from ray.data import ExecutionOptions
    from ray.data.context import DataContext

    current = DataContext.get_current().execution_options
    return ExecutionOptions(resource_limits=current.resource_limits, preserve_order=True, verbose_progress=current.verbose_progress)


def init_ray(verbose: bool = False) -> None:
    """Connect to the cluster in RAY_ADDRESS (set inside `ctx submit` jobs) or start a local one."""
    import ray

    if ray.is_initialized():
        return
    quiet = {} if verbose else {"log_to_driver": False, "logging_level": "ERROR"}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**quiet)
    else:
        ray.init(address="local", include_dashboard=False, **quiet)


def pretrain(recipe: Recipe, verbose: bool = False, progress: bool = True, log=print) -> PretrainResult:
    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from jobs.progress import ProgressBoard, run_with_progress

    ep = recipe.data.endpoint_url
    shards = storage.list_files(recipe.data.input, ep)
    log(f"data: {len(shards)} shard(s) from {recipe.data.input}")
    run = run_uri(recipe)
    workdir = Path(tempfile.mkdtemp(prefix="ctx-pretrain-"))
    tok_dir = ensure_tokenizer(recipe, shards, run, workdir, log)
    tok = load_tokenizer(tok_dir)
    model_overrides_with_vocab(recipe, tok.vocab_size)  # fail before Ray if the vocab can't fit

    resumed = resume_state(run, ep)
    first_epoch = 0
    if resumed:
        state, position = resumed
        first_epoch = int(state["epoch"])  # the position's oldest open epoch
        log(f"resume: step {state['step']} from the latest checkpoint of {run} "
            f"(epoch {first_epoch}, {position.committed(first_epoch)} of its samples already trained on)")

    init_ray(verbose)
    board = ProgressBoard.remote()
    # run_uri: the data stage drops the samples committed by the run's latest checkpoint, read
    # each time the stream starts (so also after Ray Train restarts failed workers), and writes
    # each shard's data report under the run.
    spec = stream_spec(recipe, shards, first_epoch, run_uri=run)
    dataset = build_dataset(spec, tok_dir)

    storage_fs, storage_path = (storage.filesystem(recipe.output_dir, ep) if storage.is_remote(recipe.output_dir) else (None, str(Path(run).parent)))
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "recipe": recipe.model_dump(mode="json"),
            "tokenizer_files": tokenizer_files(tok_dir),
            "vocab_size": tok.vocab_size,
            "board": board,
            "stream_ordered": row_kind(spec) == "stream",
            "run_uri": run,
            "shard_keys": shard_keys(shards),
        },
        scaling_config=ScalingConfig(
            num_workers=recipe.scaling.num_workers,  # an int, or (min, max): elastic
            use_gpu=recipe.scaling.use_gpu,
            resources_per_worker={"CPU": recipe.scaling.cpus_per_worker},
        ),
        run_config=RunConfig(
            name=recipe.name,
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            checkpoint_config=CheckpointConfig(num_to_keep=3),
            failure_config=FailureConfig(max_failures=recipe.scaling.max_failures),
        ),
        datasets={"train": dataset},
        # Blocks leave the data stages in work-unit order, so the order samples are produced in
        # is a function of (seed, epoch) and epochs finish in turn (docs/EXACTLY_ONCE.md).
        dataset_config=DataConfig(execution_options=ingest_options()),
    )
    result = run_with_progress(trainer.fit, board, recipe.train.max_steps, enabled=progress)
    if result.error:
        raise result.error
    ckpt = None
    if result.checkpoint is not None:
        scheme = recipe.output_dir.split("://", 1)[0] + "://" if storage.is_remote(recipe.output_dir) else ""
        ckpt = scheme + result.checkpoint.path
    log(f"checkpoint: {ckpt}")
    _log_data_report(run, ep, log, (result.metrics or {}).get("epoch"), len(shards))
    history = ray.get(board.history.remote())
    return PretrainResult(run_uri=run, checkpoint_uri=ckpt, metrics=dict(result.metrics or {}), history=history)


def _log_data_report(run: str, endpoint_url: str | None, log, epoch: int | None, n_shards: int) -> None:
    """The data report (records read, used, rejected per shard and reason) of the epoch training
    ended in (the data stage reads ahead, so later epochs may have reports too)."""
    from pipelines import datareport

    epochs = datareport.list_epochs(run, endpoint_url)
    if not epochs:
        return
    epoch = epoch if epoch in epochs else epochs[-1]
    report = datareport.epoch_report(run, epoch, endpoint_url)
    lines = datareport.format_report(report).splitlines()
    if report["n_shards"] < n_shards:
        lines[0] += f" (so far: {report['n_shards']} of {n_shards} shards read)"
    for line in lines:
        log(f"data: {line}")


# ---------------------------------------------------------------------------------------------
# Worker side (runs inside each Ray Train worker process).


def param_groups(model, weight_decay: float):
    """No weight decay on biases and LayerNorm weights (as BERT's AdamWeightDecayOptimizer)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch without its bookkeeping columns: what ``model(**inputs)`` takes."""
    return {k: v for k, v in batch.items() if k not in BOOKKEEPING and not k.startswith("_")}


def stream_resets(prev: tuple[int, int] | None, blocks, indices) -> tuple[np.ndarray, tuple[int, int] | None]:
    """``reset_memory`` of stream-ordered batches, from the order one worker processes them in.

    ``blocks``, ``indices`` (n,): each batch's ``_stream_block`` and ``_stream_index``, in
    processing order; ``prev``: (block, index) of the batch this worker processed just before, or
    None. A batch carries the memory over (0) only when it is the successor of the batch before it
    (same block, index + 1); anything else (a new block, a gap left by a batch another worker got,
    blocks delivered out of order) gets 1. Returns int64 (n,) and the new ``prev``.
    """
    blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)  # (n,)
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)  # (n,)
    if blocks.size == 0:
        return np.zeros(0, dtype=np.int64), prev
    before_block = np.concatenate([[prev[0] if prev else 0], blocks[:-1]])  # (n,)
    before_index = np.concatenate([[prev[1] if prev else -2], indices[:-1]])  # (n,); -2: no successor
    follows = (blocks == before_block) & (indices == before_index + 1)  # (n,)
    return (~follows).astype(np.int64), (int(blocks[-1]), int(indices[-1]))


def stream_batches(rows, per_worker: int):
    """Ray seam: iterate rows that each hold one whole stream-ordered batch (``pipelines.dataset``),
    squeeze them to (B, ...) and add ``reset_memory`` from what this worker actually receives."""
    import torch

    prev = None
    for row in rows:
        batch = {k: v[0] for k, v in row.items()}  # (1, B, ...) -> (B, ...)
        if batch["input_ids"].shape[0] != per_worker:
            raise RuntimeError(
                f"the data stage cut stream batches of {batch['input_ids'].shape[0]} rows but this worker "
                f"trains on train.batch_size / num_workers = {per_worker}"
            )
        block, index = int(batch["_stream_block"][0]), int(batch["_stream_index"][0])
        resets, prev = stream_resets(prev, [block], [index])
        batch["reset_memory"] = torch.full((per_worker,), int(resets[0]), dtype=torch.int64, device=batch["input_ids"].device)
        yield batch


def freeze_unused(model, inputs: dict[str, Any]) -> list[str]:
    """Freeze parameters the objective never reaches (e.g. BERT's pooler under MLM-only training).

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


class StepSamples:
    """The samples one worker consumed in the current optimizer step, as (n,) arrays."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, ...]] = []

    def add(self, batch: dict[str, Any]) -> None:
        cols = [batch[k] for k in ("epoch", "_shard", "sample_id", "_shard_total")]
        self.parts.append(tuple(np.asarray(c.cpu() if hasattr(c, "cpu") else c).reshape(-1) for c in cols))

    def arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(np.concatenate(col) for col in zip(*self.parts)) if self.parts else tuple(np.zeros(0, np.int64) for _ in range(4))


def lr_factor(samples: int, warmup_samples: int, total_samples: int) -> float:
    """Linear warm-up to the peak, then linear decay to zero (BERT, RoBERTa), as a function of the
    samples consumed, so a change of worker count or micro-batch size leaves the schedule alone."""
    if samples < warmup_samples:
        return (samples + 1) / max(1, warmup_samples)
    return max(0.0, (total_samples - samples) / max(1, total_samples - warmup_samples))


def row_digests(batch: dict[str, Any]) -> list[str]:
    """A short hash of each row's model inputs (tokens, mask, labels, ...): two runs that fed a
    sample identically give it the same digest."""
    import hashlib

    inputs = {k: v for k, v in sorted(model_inputs(batch).items()) if k != "reset_memory"}
    rows = len(batch["sample_id"])
    arrays = [np.ascontiguousarray(v.detach().cpu().numpy()).reshape(rows, -1) for v in inputs.values()]
    return [hashlib.blake2b(b"".join(a[i].tobytes() for a in arrays), digest_size=8).hexdigest() for i in range(rows)]


class SampleLog:
    """``train.sample_log``: every consumed sample id, per worker and attempt, as JSON lines under
    ``<run>/sample_log/``, for audits and the exactly-once tests. A line is written when its
    optimizer step is done; the first line of a file says which step the attempt resumed from.
    A local file is appended to; an object-store file (no appends there) is rewritten whole."""

    def __init__(self, run: str, endpoint_url: str | None, rank: int, world: int, resumed_step: int, resumed_from: str | None) -> None:
        import uuid

        self.uri = storage.join(run, "sample_log", f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}-rank{rank}.jsonl")
        self.endpoint_url = endpoint_url
        self.fs, self.path = storage.filesystem(self.uri, endpoint_url)
        self.remote = storage.is_remote(self.uri)
        if not self.remote:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.lines: list[str] = []  # the lines an object-store file must hold
        self.write([json.dumps({"rank": rank, "world": world, "pid": os.getpid(), "resumed_step": resumed_step, "resumed_from": resumed_from})])

    def step(self, step: int, batches: list[dict[str, Any]]) -> None:
        self.write([
            json.dumps({
                "step": step,
                "epoch": np.asarray(b["epoch"].cpu()).reshape(-1).tolist(),
                "ids": np.asarray(b["sample_id"].cpu()).reshape(-1).tolist(),
                "digests": row_digests(b),
            })
            for b in batches
        ])

    def write(self, new: list[str]) -> None:
        if not self.remote:
            with open(self.path, "a") as f:
                f.write("".join(line + "\n" for line in new))
            return
        self.lines.extend(new)
        data = "".join(line + "\n" for line in self.lines).encode()

        def put() -> None:
            with self.fs.open_output_stream(self.path) as f:
                f.write(data)

        storage.with_retries(put, f"write {self.uri}")


def _load_resume(run: str, endpoint_url: str | None, model):
    """The run's latest committed checkpoint (the same one the data stage reads the position of):
    loads the weights into ``model``; returns (uri, trainer_state, optimizer tensors, position)."""
    from ctxmodels.checkpoint import load_checkpoint
    from safetensors.torch import load_file

    uri = storage.latest_complete_checkpoint(run, endpoint_url)
    if uri is None:
        return None, None, None, DataPosition()
    local = storage.download_dir(uri, Path(tempfile.mkdtemp(prefix="ctx-resume-")), endpoint_url)
    model.load_state_dict(load_checkpoint(local).model.state_dict())
    state = json.loads((local / "trainer_state.json").read_text())
    opt = load_file(str(local / "optimizer.safetensors"))
    return uri, state, opt, load_position(str(local))  # the downloaded copy: no second read


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    import torch

    from ctxmodels.checkpoint import optimizer_state_from_tensors
    from ctxmodels.registry import build_model
    from jobs import parallel

    recipe = Recipe.model_validate(config["recipe"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(recipe.scaling.cpus_per_worker)))
    t, ep, run = recipe.train, recipe.data.endpoint_url, config["run_uri"]
    micro, accum = recipe.micro_batch_size, recipe.accumulation(world)
    if micro * accum * world != t.batch_size:
        raise RuntimeError(f"{world} workers x {accum} micro-batches x {micro} rows != train.batch_size {t.batch_size}")

    overrides = model_overrides_with_vocab(recipe, config["vocab_size"])
    for key, value in FAMILY_OBJECTIVES[recipe.model.family][recipe.data.objective].items():
        overrides.setdefault(key, value)  # e.g. packed single-segment MLM: no NSP head to train
    torch.manual_seed(t.seed)
    model_cfg, model = build_model(recipe.model.family, recipe.model.preset, overrides)
    # Resume from what the run committed last, whatever restarted us (a rerun, a worker failure,
    # a new worker count): Ray's get_checkpoint() could name a checkpoint whose upload was cut.
    resumed_from, state, opt_tensors, position = _load_resume(run, ep, model)
    step = int(state["step"]) if state else 0
    samples_seen = int(state["samples_seen"]) if state else 0
    tokens_seen = int(state["tokens_seen"]) if state else 0
    if rank == 0 and state:
        print(f"resumed from {resumed_from}: step {step}, {samples_seen} samples, data position {position.summary()}")

    device = ray.train.torch.get_device()
    plan = parallel.ParallelPlan(strategy=recipe.scaling.strategy, precision=t.precision, compile=t.compile)
    shard = ray.train.get_dataset_shard("train")
    if config.get("stream_ordered"):  # one Ray Data row = one whole (B, T) micro-batch of this worker
        it = stream_batches(shard.iter_torch_batches(batch_size=1, device=device), micro)
    else:
        it = iter(shard.iter_torch_batches(batch_size=micro, drop_last=True, device=device))
    first = next(it, None)
    if first is None:
        raise RuntimeError("the data stream is empty: no full micro-batch of train.micro_batch_size rows")
    frozen = freeze_unused(model.to(device), model_inputs(first))
    if frozen and rank == 0:
        print(f"not trained by objective {recipe.data.objective!r} (frozen): {', '.join(frozen)}")
    wrapped = parallel.wrap_model(model, plan, device)
    # fused: one kernel over all parameters instead of a Python loop (CPU and CUDA); FSDP's sharded
    # DTensor parameters take the default implementation.
    fused = recipe.scaling.strategy == "ddp" and device.type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=t.betas, eps=t.eps, fused=fused)
    if opt_tensors is not None:  # saved in single-device layout: loads under DDP and FSDP alike
        saved = optimizer_state_from_tensors(opt_tensors, state["optimizer"], type(optimizer).__name__)
        parallel.load_full_optimizer_state(wrapped, optimizer, saved)
    warmup_samples, total_samples = t.warmup_steps * t.batch_size, t.max_steps * t.batch_size

    tok_dir = tokenizer_dir_from_files(config["tokenizer_files"])
    log = SampleLog(run, ep, rank, world, step, resumed_from) if t.sample_log else None
    metrics_log = _metrics_log(run, ep) if rank == 0 else None
    flops_per_sample, peak = _flops_and_peak(recipe, model_cfg, device, rank, torch)

    pending = DataPosition()  # this worker's samples since the last checkpoint
    sums: dict[str, float] = {}
    interval = {"tokens": 0, "steps": 0, "wait": 0.0, "t0": time.perf_counter()}
    t_start, start_step = time.perf_counter(), step
    committed_step = step

    def log_interval() -> dict[str, Any]:
        """The interval's metrics, reduced over workers; rank 0 shows and logs them."""
        nonlocal sums, interval, tokens_seen
        metrics = _interval_metrics(sums, interval, world, torch)
        tokens_seen += int(metrics.pop("_tokens"))
        rate = (step - start_step) / max(time.perf_counter() - t_start, 1e-9)
        metrics.update(
            step=step, max_steps=t.max_steps, epoch=int(consumed.arrays()[0].max(initial=0)),
            lr=optimizer.param_groups[0]["lr"], samples_seen=samples_seen, tokens_seen=tokens_seen,
            workers=world, eta_s=(t.max_steps - step) / rate if rate > 0 else None,
        )
        if flops_per_sample and peak:
            metrics["mfu"] = metrics["samples_per_s"] * flops_per_sample / (peak * world)
        if rank == 0:
            config["board"].update.remote(metrics)
            if metrics_log is not None:
                metrics_log.log(metrics)
        sums, interval = {}, {"tokens": 0, "steps": 0, "wait": 0.0, "t0": time.perf_counter()}
        return metrics

    def commit(metrics: dict[str, Any]) -> None:
        """A checkpoint with the data position: every worker's samples since the last one."""
        nonlocal position, pending, committed_step
        position = _commit_position(position, pending, config["shard_keys"], world, rank, run, ep, torch)
        pending, committed_step = DataPosition(), step
        state = {"step": step, "samples_seen": samples_seen, "tokens_seen": tokens_seen,
                 "epoch": position.first_epoch, "world_size": world, "recipe": config["recipe"]}
        _report_with_checkpoint(ray, rank, wrapped, recipe, model_cfg, tok_dir, optimizer, state, metrics, position)

    batches = itertools.chain([first], it)
    consumed = StepSamples()
    model.train()
    while step < t.max_steps:
        step_batches, consumed, ended = [], StepSamples(), False
        for i in range(accum):
            t_wait = time.perf_counter()
            batch = next(batches, None)
            interval["wait"] += time.perf_counter() - t_wait
            if batch is None:
                ended = True
                break
            with parallel.no_sync(wrapped, active=i < accum - 1), parallel.autocast(plan, device):
                out = wrapped(**model_inputs(batch))
            (out.loss / accum).backward()
            consumed.add(batch)
            if log is not None:
                step_batches.append(batch)
            _accumulate(sums, out)
            sums["_rows"] = sums.get("_rows", 0.0) + len(batch["sample_id"])
            interval["tokens"] += int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
            if "_stream_block" in batch:  # share of batches started without memory: 1 / block length if Ray kept blocks whole
                sums["stream_resets"] = sums.get("stream_resets", 0.0) + float(batch["reset_memory"][0])
                sums["_w_stream_resets"] = sums.get("_w_stream_resets", 0.0) + 1.0
        if ended:  # the stream ended (inside a step: its partial gradient is dropped, its samples not committed)
            optimizer.zero_grad(set_to_none=True)
            break
        if t.grad_clip > 0:
            parallel.clip_grad_norm(wrapped, t.grad_clip)
        for g in optimizer.param_groups:
            g["lr"] = t.lr * lr_factor(samples_seen, warmup_samples, total_samples)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        samples_seen += t.batch_size
        pending.add(*consumed.arrays())
        if log is not None:
            log.step(step, step_batches)
        interval["steps"] += 1

        last = step >= t.max_steps
        if step % t.log_every == 0 or last:
            metrics = log_interval()
            if step % t.checkpoint_every == 0 or last:
                commit(metrics)
            else:
                ray.train.report(metrics)
    if step > committed_step:  # the stream ended between checkpoints: commit what was trained
        commit(log_interval() if interval["steps"] else {"step": step})
    if metrics_log is not None:
        metrics_log.close()
    if step < t.max_steps and rank == 0:
        print(f"data stream ended at step {step} before train.max_steps={t.max_steps}; raise data.max_epochs")


def _metrics_log(run: str, endpoint_url: str | None):
    from jobs.metrics import MetricsLog

    return MetricsLog(run, endpoint_url)


def _flops_and_peak(recipe: Recipe, model_cfg, device, rank: int, torch) -> tuple[float, float]:
    """Model FLOPs per sample of a training step, and one worker's peak FLOP/s (the datasheet's
    for known GPUs, else a measured matmul peak): what MFU is computed from. (0, 0) if unknown."""
    from ctxmodels import flops

    seq = recipe.data.seq_len
    n_pred = int(round(seq * recipe.data.mlm_probability)) if recipe.data.objective in ("mlm", "nsp", "span", "sop") else None
    try:
        per_sample = flops.train_flops_per_step(recipe.model.family, model_cfg, 1, seq, n_pred)
    except (KeyError, ValueError, NotImplementedError):
        return 0.0, 0.0
    dtype = torch.bfloat16 if recipe.train.precision == "bf16" else torch.float32
    peak = flops.known_peak_flops(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
    if peak is None:
        peak = flops.measure_matmul_peak(str(device.type), dtype, seconds=0.3)
    return per_sample, peak


def _interval_metrics(sums, interval, world: int, torch) -> dict[str, float]:
    elapsed = max(time.perf_counter() - interval["t0"], 1e-9)
    sums = {**sums, "_wait": interval["wait"]}
    metrics = _reduce_metrics(sums, interval["steps"], interval["tokens"], world, torch)
    metrics["tokens_per_s"] = metrics["_tokens"] / elapsed
    metrics["samples_per_s"] = metrics.pop("_samples") / elapsed
    metrics["data_wait"] = metrics.pop("_wait_total") / (elapsed * world)  # share of step time spent waiting for data
    return metrics


def _commit_position(position: DataPosition, pending: DataPosition, shard_keys: list[int], world: int, rank: int, run: str, endpoint_url: str | None, torch) -> DataPosition:
    """Every worker's samples since the last checkpoint, merged on rank 0 (which writes the
    checkpoint) into the committed position; epochs whose every shard is complete are closed, and
    their data report (read = used + rejected per shard) is written and printed."""
    from pipelines import datareport

    parts = [pending.to_arrays()]
    if world > 1 and torch.distributed.is_initialized():
        parts = [None] * world
        torch.distributed.all_gather_object(parts, pending.to_arrays())
    if rank != 0:
        return position  # only rank 0's position is written; the others keep none
    for arrays in parts:
        position.merge(DataPosition.from_arrays(arrays))
    for epoch in position.close_epochs(shard_keys, lambda e: datareport.sampleless_shards(run, e, endpoint_url)):
        report = datareport.write_epoch_report(run, epoch, endpoint_url)
        print("data: " + datareport.format_report(report).replace("\n", "\ndata: "))
    return position


def _accumulate(sums: dict[str, float], out) -> None:
    n_pred = float(out.metrics.get("n_pred", 0.0))
    sums["loss"] = sums.get("loss", 0.0) + float(out.loss.detach())
    sums["_micro"] = sums.get("_micro", 0.0) + 1.0
    sums["_n_pred"] = sums.get("_n_pred", 0.0) + n_pred
    for k, v in out.metrics.items():
        if k == "n_pred":
            continue
        w = n_pred if k.startswith(TOKEN_LEVEL_PREFIXES) else 1.0
        sums[k] = sums.get(k, 0.0) + float(v) * w
        sums["_w_" + k] = sums.get("_w_" + k, 0.0) + w


def _reduce_metrics(sums: dict[str, float], steps: int, tokens: int, world: int, torch) -> dict[str, float]:
    """Sum the interval's statistics over workers and turn them into means."""
    keys = sorted(sums)
    vec = torch.tensor([sums[k] for k in keys] + [float(steps), float(tokens)], dtype=torch.float64)
    if world > 1 and torch.distributed.is_initialized():
        torch.distributed.all_reduce(vec)
    vals = dict(zip(keys + ["_steps", "_tokens"], vec.tolist()))
    # loss sums one value per micro-batch of every worker; "_steps" counts optimizer steps x world
    n_micro = max(vals.get("_micro", vals["_steps"]), 1.0)
    out: dict[str, float] = {"loss": vals["loss"] / n_micro, "_tokens": vals["_tokens"],
                             "_samples": vals.get("_rows", 0.0), "_wait_total": vals.get("_wait", 0.0)}
    for k in keys:
        if k.startswith("_") or k == "loss":
            continue
        out[k] = vals[k] / max(vals["_w_" + k], 1e-9)
    main = next((k for k in ("mlm_loss", "lm_loss", "plm_loss") if k in out), None)
    if main is not None:
        out["ppl"] = math.exp(min(out[main], 50.0))
    return out


def _report_with_checkpoint(ray, rank, wrapped, recipe, model_cfg, tok_dir, optimizer, state, metrics, position) -> None:
    """Rank 0 writes the checkpoint (MANIFEST last) with the data position; every rank reports, as
    Ray Train requires. Under FSDP every rank takes part in gathering the full weights."""
    import torch
    from ray.train import Checkpoint

    from ctxmodels.checkpoint import optimizer_state_to_tensors, save_checkpoint
    from ctxmodels.registry import build_model
    from jobs import parallel

    # Collectives under FSDP (gathering shards): every rank calls them.
    opt_state = parallel.full_optimizer_state(wrapped, optimizer)
    if recipe.scaling.strategy == "fsdp":
        full = parallel.full_state_dict(wrapped)
        if rank == 0:  # a CPU copy of the model holds the gathered weights for saving
            model = build_model(recipe.model.family, recipe.model.preset, dataclasses.asdict(model_cfg))[1]
            model.load_state_dict(full)
    else:
        model = parallel.unwrap(wrapped)
    if rank != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="ctx-ckpt-") as d:
        tensors, meta = optimizer_state_to_tensors(opt_state, name=type(optimizer).__name__)
        save_checkpoint(
            d,
            model,
            recipe.model.family,
            model_cfg,
            tokenizer_dir=tok_dir,
            extra_json={"trainer_state.json": {**state, "optimizer": meta}},
            extra_tensors={
                "optimizer.safetensors": tensors,
                POSITION_FILE: {k: torch.from_numpy(v) for k, v in position.to_arrays().items()},
            },
        )
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))


