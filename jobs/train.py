"""`ctx pretrain`: a recipe -> a Ray Data stream -> Ray Train (DDP) -> checkpoints.

The driver checks the recipe and the corpus, gets the tokenizer (trains one from a sample of the
corpus, or reuses the run's), builds the lazy dataset and starts a ``TorchTrainer``. Rerunning
the same recipe (same ``output_dir`` and ``name``) resumes from the run's latest checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ctxmodels.registry import FAMILIES
from jobs.config import Recipe, RecipeError, model_overrides_with_vocab
from jobs.registry import ModelVersion, resolve
from jobs.tracking import record_run
from jobs.loop import (  # noqa: F401 (lr_factor, param_groups, freeze_unused, StepSamples, model_inputs: re-exported)
    BOOKKEEPING,
    Checkpointer,
    Stepper,
    StepMeter,
    StepSamples,
    build_optimizer,
    evaluate_batches,
    fit,
    freeze_unused,
    ingest_options,
    init_ray,
    seed_worker_rng,
    to_device,
    load_optimizer,
    lr_factor,
    model_inputs,
    param_groups,
    perplexity,
    report_progress,
    resume,
    run_folder,
)
from pipelines import storage
from pipelines.dataset import StreamSpec, build_dataset, local_batches, row_kind, shard_keys, tokenizer_dir_from_files, tokenizer_files, vocab_info
from pipelines.masking import MlmConfig
from pipelines.objectives import Objective, objective
from pipelines.permutation import PlmConfig
from pipelines.position import DataPosition, load_position
from pipelines.spans import NgramConfig, SpanConfig
from pipelines.sources import sample_text
from pipelines.tokenizers import ROLES, MissingSpecialToken, load_tokenizer, train_tokenizer

# Evaluation batches are masked as if they were this epoch: masks keyed by (data.seed, EVAL_EPOCH,
# sample_id), the same at every evaluation and on every rerun, and not those of any training epoch
# (an eval shard that is also a training shard is masked differently there).
EVAL_EPOCH = 1 << 20


@dataclass
class PretrainResult:
    run_uri: str
    checkpoint_uri: str | None
    metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)  # every logged metrics dict of rank 0
    registered: Any = None  # the jobs.registry.ModelVersion the checkpoint became (registry.enabled)


# ---------------------------------------------------------------------------------------------
# Driver side.


def run_uri(recipe: Recipe) -> str:
    return run_folder(recipe.output_dir, recipe.name)


def ensure_tokenizer(recipe: Recipe, shards: list[str], run: str, workdir: Path, log=print) -> Path:
    """The run's tokenizer as a local folder: the recipe's, the run's saved one, or a new one."""
    store = storage.Store.of(recipe.data)
    if recipe.tokenizer.path:
        return store.download_dir(recipe.tokenizer.path, workdir / "tokenizer")
    saved = storage.join(run, "tokenizer")
    if store.exists(saved):
        log(f"tokenizer: reusing {saved}")
        return store.download_dir(saved, workdir / "tokenizer")
    t = recipe.tokenizer
    log(f"tokenizer: training {t.kind} (vocab {t.vocab_size}) on up to {t.sample_chars:,} characters of the corpus")
    t0 = time.perf_counter()
    texts = sample_text(shards, t.sample_chars, recipe.data.format, recipe.data.text_field, store.endpoint_url, store.deadline_s)
    tok = train_tokenizer(t.kind, texts, t.vocab_size, lowercase=t.lowercase)
    local = workdir / "tokenizer"
    tok.save(local)
    store.copy_dir(local, saved)
    log(f"tokenizer: {tok.vocab_size} tokens in {time.perf_counter() - t0:.1f}s -> {saved}")
    return local


def warm_start_source(recipe: Recipe, workdir: Path, log=print) -> tuple[str, Path, ModelVersion | None]:
    """``model.init`` resolved to one checkpoint URI (a run folder: its best or newest complete
    checkpoint), checked against the recipe's family, and that checkpoint's tokenizer as a local
    folder: a warm start keeps the vocabulary its embeddings were trained with. The third item is the
    registry version when ``model.init`` named one (``models:/NAME@alias``, looked up once)."""
    from jobs.runs import local_copy, resolve_checkpoint

    store = storage.Store.of(recipe.data)
    source, version = resolve(recipe.model.init, recipe.registry.tracking_uri)  # models:/NAME@alias -> its checkpoint
    uri = resolve_checkpoint(source, store)
    local = local_copy(uri, workdir / "init", store)
    try:
        payload = json.loads((local / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise RecipeError(f"model.init: {uri} has no readable config.json ({e}); give a checkpoint or run folder") from None
    if "task" in payload:
        raise RecipeError(f"model.init: {uri} is a fine-tuned checkpoint; pretraining continues from a pretraining checkpoint")
    family = payload.get("family") if payload.get("format") == "ctxmodels" else None
    if family is not None and family != recipe.model.family:
        raise RecipeError(f"model.init: {uri} is a {family} checkpoint but model.family is {recipe.model.family!r}; set model.family: {family}")
    tok = local / "tokenizer" if (local / "tokenizer").is_dir() else local  # ours in tokenizer/, HF folders at the top
    log(f"warm start: weights and tokenizer of {uri}" + (f" (registry version {version.ref})" if version else ""))
    return uri, tok, version


def resume_state(run: str, endpoint_url: str | None, deadline_s: float = storage.DEFAULT_RETRY_DEADLINE_S
                 ) -> tuple[dict[str, Any], DataPosition] | None:
    """trainer_state.json and the data position of the run's latest committed checkpoint, if any."""
    latest = storage.latest_complete_checkpoint(run, endpoint_url, deadline_s)
    if latest is None:
        return None
    state = json.loads(storage.read_bytes(storage.join(latest, "trainer_state.json"), endpoint_url, deadline_s))
    return state, load_position(latest, endpoint_url, deadline_s)


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
        retry_deadline_s=d.retry_deadline_s,
    )


def check_tokenizer_for_objective(tok, objective_name: str) -> None:
    """A RecipeError before Ray starts when the tokenizer lacks a special token that the objective's
    rows need: [MASK] for the masking objectives, [CLS]/[SEP]/[PAD] unless a GPT-2 tokenizer's
    <|endoftext|> stands in (``pipelines.dataset.vocab_info``), every role for ELMo's characters."""
    try:
        vocab_info(tok, objective_name)
        if objective(objective_name).uses_chars:
            for role in ROLES:
                tok.require(role, f"data.objective {objective_name!r} gives it its own characters")
    except MissingSpecialToken as e:
        raise RecipeError(f"tokenizer: {e}") from None


def pretrain(recipe: Recipe, verbose: bool = False, progress: bool = True, log=print) -> PretrainResult:
    """Pretrain under the run folder's lock (jobs/runlock.py), taken before anything is read from
    the run, so a second driver on the same output fails at once instead of resuming from the same
    checkpoint; released when the run ends, also when it fails. The tokenizer's local copy lives in
    a temporary folder, removed whatever happens: the workers and the data stage get its files as
    bytes."""
    from jobs.runlock import RunLock

    with RunLock(run_uri(recipe), storage.Store.of(recipe.data), command=f"ctx pretrain ({recipe.name})"), \
            tempfile.TemporaryDirectory(prefix="ctx-pretrain-") as workdir:
        return _pretrain(recipe, Path(workdir), verbose, progress, log)


def _pretrain(recipe: Recipe, workdir: Path, verbose: bool, progress: bool, log) -> PretrainResult:
    ep = recipe.data.endpoint_url
    store = storage.Store.of(recipe.data)  # every call of the driver: the recipe's endpoint and deadline
    shards = store.list_files(recipe.data.input)
    log(f"data: {len(shards)} shard(s) from {recipe.data.input}")
    eval_shards = store.list_files(recipe.data.eval_input) if recipe.data.eval_input else []
    run = run_uri(recipe)
    init = warm_start_source(recipe, workdir, log) if recipe.model.init else None
    init_version = init[2] if init else None  # models:/NAME@alias: the parent of the version this run registers
    tok_dir = init[1] if init and not recipe.tokenizer.path else ensure_tokenizer(recipe, shards, run, workdir, log)
    tok = load_tokenizer(tok_dir)
    model_overrides_with_vocab(recipe, tok.vocab_size)  # fail before Ray if the vocab can't fit
    check_tokenizer_for_objective(tok, recipe.data.objective)  # and that its rows can be built

    resumed = resume_state(run, ep, recipe.data.retry_deadline_s)
    first_epoch = 0
    if resumed:
        state, position = resumed
        first_epoch = int(state["epoch"])  # the position's oldest open epoch
        log(f"resume: step {state['step']} from the latest checkpoint of {run} "
            f"(epoch {first_epoch}, {position.committed(first_epoch)} of its samples already trained on)")

    init_ray(verbose)
    # run_uri: the data stage drops the samples committed by the run's latest checkpoint, read
    # each time the stream starts (so also after Ray Train restarts failed workers), and writes
    # each shard's data report under the run.
    spec = stream_spec(recipe, shards, first_epoch, run_uri=run)
    dataset = build_dataset(spec, tok_dir)
    result = fit(
        train_loop_per_worker,
        {
            "recipe": recipe.model_dump(mode="json"),
            "tokenizer_files": tokenizer_files(tok_dir),
            "vocab_size": tok.vocab_size,
            "stream_ordered": row_kind(spec) == "stream",
            "run_uri": run,
            "init_checkpoint": init[0] if init else None,
            "shard_keys": shard_keys(shards),
            "eval_shards": eval_shards,
            "predicted_per_row": objective(spec.objective).predicted(recipe.data.seq_len, spec),
        },
        name=recipe.name, output_dir=recipe.output_dir, endpoint_url=ep, scaling=recipe.scaling,
        datasets={"train": dataset}, max_steps=recipe.train.max_steps, progress=progress, label="pretrain",
        retry_deadline_s=recipe.data.retry_deadline_s,
    )
    log(f"checkpoint: {result.checkpoint_uri}")
    try:
        _log_data_report(run, store, log, result.metrics.get("epoch"), len(shards))
    except (OSError, storage.StorageError) as e:  # telemetry: the run itself is done and committed
        log(f"warning: data report of {run} not read: {e}")
    registered = record_run(  # MLflow run + model version; raises RegistrationError (the checkpoint stays)
        kind="pretrain", recipe=recipe, checkpoint=result.checkpoint_uri, metrics=result.metrics, history=result.history,
        run_uri=run, shards=shards, eval_metrics={k: v for k, v in result.metrics.items() if k.startswith("eval_")},
        family=recipe.model.family, store=store, parent=init_version, log=log,
    )
    return PretrainResult(run_uri=run, checkpoint_uri=result.checkpoint_uri, metrics=result.metrics, history=result.history,
                          registered=registered)


def _log_data_report(run: str, store: storage.Store, log, epoch: int | None, n_shards: int) -> None:
    """The data report (records read, used, rejected per shard and reason) of the epoch training
    ended in (the data stage reads ahead, so later epochs may have reports too)."""
    from pipelines import datareport

    epochs = datareport.list_epochs(run, store.endpoint_url, store.deadline_s)
    if not epochs:
        return
    epoch = epoch if epoch in epochs else epochs[-1]
    report = datareport.epoch_report(run, epoch, store.endpoint_url, store.deadline_s)
    lines = datareport.format_report(report).splitlines()
    if report["n_shards"] < n_shards:
        lines[0] += f" (so far: {report['n_shards']} of {n_shards} shards read)"
    for line in lines:
        log(f"data: {line}")


# ---------------------------------------------------------------------------------------------
# Worker side (runs inside each Ray Train worker process).


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

    def __init__(self, run: str, endpoint_url: str | None, rank: int, world: int, resumed_step: int, resumed_from: str | None,
                 deadline_s: float = storage.DEFAULT_RETRY_DEADLINE_S) -> None:
        import uuid

        self.uri = storage.join(run, "sample_log", f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}-rank{rank}.jsonl")
        self.endpoint_url, self.deadline_s = endpoint_url, deadline_s
        self.fs, self.path = storage.filesystem(self.uri, endpoint_url)
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

            storage.best_effort(append, f"write {self.uri}", self.deadline_s, self.endpoint_url)
            return
        self.lines.extend(new)
        data = "".join(line + "\n" for line in self.lines).encode()

        def put() -> None:
            with self.fs.open_output_stream(self.path) as f:
                f.write(data)

        storage.best_effort(put, f"write {self.uri}", self.deadline_s, self.endpoint_url)


def train_batches(config: dict[str, Any], micro: int, device):
    """Ray seam: this worker's share of the training stream, as (micro, ...) tensor batches."""
    import ray.train

    shard = ray.train.get_dataset_shard("train")
    if config.get("stream_ordered"):  # one Ray Data row = one whole (B, T) micro-batch of this worker
        return stream_batches(shard.iter_torch_batches(batch_size=1, device=device), micro)
    # Host batches, moved by to_device: pinned, asynchronous copies, and packed rows' all-ones
    # masks found on the host, so attention runs with no mask (flash kernels) on a GPU.
    return (to_device(b, device) for b in shard.iter_torch_batches(batch_size=micro, drop_last=True))


def eval_batches(recipe: Recipe, shards: list[str], tok_dir: Path, rows: int, device) -> list[dict[str, Any]]:
    """The held-out batches of ``data.eval_input``: at most ``data.eval_max_samples`` samples in
    batches of ``rows`` (the training micro-batch, so memory models keep their batch size), built
    by the same NumPy pipeline as training, masked as epoch ``EVAL_EPOCH``: identical at every
    evaluation, on every worker and on every rerun."""
    import torch

    spec = stream_spec(recipe, shards)
    n = max(1, recipe.data.eval_max_samples // rows)
    out = []
    for b in local_batches(spec, load_tokenizer(tok_dir), batch_size=rows, epoch=EVAL_EPOCH, max_batches=n):
        out.append({k: torch.as_tensor(v).to(device) for k, v in b.items()})
    return out


def evaluate(wrapped, batches: list[dict[str, Any]], obj: Objective, plan, device, rank: int, world: int) -> dict[str, float]:
    """Held-out loss, perplexity of the objective's main loss and its accuracy (masked-token
    accuracy for the MLM objectives), and every other model metric, as ``eval_*``."""
    meter = StepMeter(obj.is_token_metric)

    def forward(model, batch: dict[str, Any], counted: bool) -> None:
        out = model(**model_inputs(batch))
        if counted:
            meter.micro_batch(out, batch)

    evaluate_batches(wrapped, batches, plan, device, rank, world, forward)
    m = meter.reduce(world)
    out = {"eval_loss": m["loss"], "eval_samples": sum(len(b["sample_id"]) for b in batches)}
    for k, v in m.items():
        if k not in ("loss", "tokens", "tokens_per_s", "samples_per_s", "data_wait", "stream_resets"):
            out[f"eval_{k}"] = v
    if obj.main_loss and obj.main_loss in m:
        out["eval_ppl"] = perplexity(m[obj.main_loss])
        acc = obj.main_loss.replace("_loss", "_acc")
        if acc in m:
            out["eval_acc"] = m[acc]
    return out


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray seam: the loop Ray Train runs on every worker. The tokenizer's files (written into each
    checkpoint) live in a temporary folder for the attempt, removed when it ends."""
    with tempfile.TemporaryDirectory(prefix="ctx-tokenizer-") as d:
        _train_loop(config, tokenizer_dir_from_files(config["tokenizer_files"], d))


def _train_loop(config: dict[str, Any], tok_dir: Path) -> None:
    import ray.train
    import ray.train.torch
    import torch

    from ctxmodels.registry import build_model
    from jobs import parallel

    recipe = Recipe.model_validate(config["recipe"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(recipe.scaling.cpus_per_worker)))
    t, ep, run = recipe.train, recipe.data.endpoint_url, config["run_uri"]
    deadline = recipe.data.retry_deadline_s
    micro, accum = recipe.micro_batch_size, recipe.accumulation(world)
    if micro * accum * world != t.batch_size:
        raise RuntimeError(f"{world} workers x {accum} micro-batches x {micro} rows != train.batch_size {t.batch_size}")
    obj = objective(recipe.data.objective)

    if config.get("init_checkpoint"):  # warm start: the checkpoint's architecture and weights
        model_cfg, model = warm_start_model(config["init_checkpoint"], storage.Store(ep, deadline))
    else:
        overrides = model_overrides_with_vocab(recipe, config["vocab_size"])
        for key, value in obj.families[recipe.model.family].items():
            overrides.setdefault(key, value)  # e.g. packed single-segment MLM: no NSP head to train
        model_cfg, model = build_model(recipe.model.family, recipe.model.preset, overrides, seed=t.seed)
    seed_worker_rng(t.seed, rank)  # dropout
    # Resume from what the run committed last, whatever restarted us (a rerun, a worker failure,
    # a new worker count).
    resumed = resume(run, ep, model, rank, deadline)
    state = resumed.state
    if rank == 0 and resumed.uri:
        print(f"resumed from {resumed.uri}: step {state.step}, {state.samples_seen} samples, data position {resumed.position.summary()}")

    device = ray.train.torch.get_device()
    plan = parallel.ParallelPlan(strategy=recipe.scaling.strategy, precision=t.precision, compile=t.compile)
    precision = parallel.step_precision(plan, device)  # what autocast() runs the step in
    if rank == 0 and t.precision != precision:
        print(f"warning: train.precision is {t.precision!r}, but {device} has no native bf16 products (it takes a GPU, "
              "or a CPU with AVX512-BF16 or AMX): the step runs in fp32")
    stream = train_batches(config, micro, device)
    first = next(stream, None)
    if first is None:
        raise RuntimeError("the data stream is empty: no full micro-batch of train.micro_batch_size rows")
    frozen = freeze_unused(model.to(device), model_inputs(first))
    if frozen and rank == 0:
        print(f"not trained by objective {recipe.data.objective!r} (frozen): {', '.join(frozen)}")
    wrapped = parallel.wrap_model(model, plan, device)
    optimizer = build_optimizer(model, wrapped, recipe.scaling.strategy, device, t.lr, t.weight_decay, t.betas, t.eps)
    load_optimizer(wrapped, optimizer, resumed)
    schedule = partial(lr_factor, warmup_samples=t.warmup_steps * t.batch_size, total_samples=t.max_steps * t.batch_size)
    stepper = Stepper(wrapped, optimizer, plan, device, accum, t.batch_size, t.lr, schedule, t.grad_clip,
                      max_bad_steps=t.max_bad_steps, debug_nan_steps=t.debug_nan_steps)
    meter = StepMeter(obj.is_token_metric)

    checkpointer = Checkpointer(
        run, ep, config["shard_keys"], rank, world, resumed.position,
        save=partial(_save, family=recipe.model.family, model_cfg=model_cfg, tok_dir=tok_dir),
        fresh_model=lambda: build_model(recipe.model.family, recipe.model.preset, dataclasses.asdict(model_cfg))[1],
        strategy=recipe.scaling.strategy,
        sampleless=partial(_sampleless, run, ep, deadline), on_epoch_closed=partial(_epoch_closed, run, ep, deadline),
        committed_step=state.step, retry_deadline_s=deadline,
    )
    held_out = eval_batches(recipe, config["eval_shards"], tok_dir, micro, device) if config.get("eval_shards") else []
    log = SampleLog(run, ep, rank, world, state.step, resumed.uri, deadline) if t.sample_log else None
    metrics_log = _metrics_log(run, ep, deadline) if rank == 0 else None
    flops_per_sample, peak = _flops_and_peak(recipe, model_cfg, config.get("predicted_per_row"), device, precision, torch)
    t_start, start_step, epoch = time.perf_counter(), state.step, 0

    def interval_metrics() -> dict[str, Any]:
        """The interval's metrics, reduced over workers (every rank calls it)."""
        m = meter.reduce(world)
        state.tokens_seen += int(m.pop("tokens"))
        if obj.main_loss in m:
            m["ppl"] = perplexity(m[obj.main_loss])
        rate = (state.step - start_step) / max(time.perf_counter() - t_start, 1e-9)
        m.update(
            step=state.step, max_steps=t.max_steps, epoch=epoch, lr=stepper.current_lr, samples_seen=state.samples_seen,
            tokens_seen=state.tokens_seen, workers=world, eta_s=(t.max_steps - state.step) / rate if rate > 0 else None,
            bad_steps=state.bad_steps,
        )
        if flops_per_sample and peak:
            m["mfu"] = m["samples_per_s"] * flops_per_sample / (peak * world)
        return m

    def evaluated(m: dict[str, Any]) -> dict[str, Any]:
        m.update(evaluate(wrapped, held_out, obj, plan, device, rank, world))
        stepper.forget_memory()  # evaluation ran other text through the memory of memory models
        return m

    batches = itertools.chain([first], stream)
    model.train()
    while state.step < t.max_steps:
        taken = stepper.step(batches, state, meter)
        if taken is None:  # the stream ended (inside a step: its partial gradient is dropped, its samples not committed)
            break
        # A skipped step's samples count as consumed, not trained on (docs/FAULTS.md): committed
        # with the next checkpoint, so the batch that broke the step is not fed again on resume.
        checkpointer.record(taken.batches)
        epoch = max(int(b["epoch"].max()) for b in taken.batches)
        if log is not None:
            log.step(state.step + taken.skipped, taken.batches, skipped=taken.skipped)
        if taken.skipped:
            continue  # no new step: nothing to log, evaluate or commit
        last = state.step >= t.max_steps
        eval_now = bool(held_out) and (last or state.step % t.eval_every == 0)
        if state.step % t.log_every == 0 or last or eval_now:
            metrics = interval_metrics()
            if eval_now:
                metrics = evaluated(metrics)
            report_progress(config, rank, metrics, metrics_log)
            if state.step % t.checkpoint_every == 0 or last:
                checkpointer.commit(state, wrapped, optimizer, metrics, {"recipe": config["recipe"]})
            else:
                ray.train.report(metrics)
    if state.step > checkpointer.committed_step:  # the stream ended between checkpoints: commit what was trained
        metrics = interval_metrics() if meter.steps else {"step": state.step}
        if held_out:
            metrics = evaluated(metrics)
        if len(metrics) > 1:
            report_progress(config, rank, metrics, metrics_log)
        checkpointer.commit(state, wrapped, optimizer, metrics, {"recipe": config["recipe"]})
    if metrics_log is not None:
        metrics_log.close()
    if state.step < t.max_steps and rank == 0:
        print(f"data stream ended at step {state.step} before train.max_steps={t.max_steps}; raise data.max_epochs")


def warm_start_model(checkpoint: str, store: storage.Store | str | None):
    """(config, pretraining model) of ``checkpoint``, ready to train; the run's own checkpoint, if it
    has one, is loaded over these weights afterwards (``resume``)."""
    from ctxmodels.checkpoint import load_checkpoint
    from jobs.runs import local_copy

    with tempfile.TemporaryDirectory(prefix="ctx-init-") as d:  # every worker, every restart: never left behind
        loaded = load_checkpoint(local_copy(checkpoint, Path(d), store))
    return loaded.config, loaded.model.train()


def _save(folder: str, model, extra_json: dict[str, Any], extra_tensors: dict[str, Any], *, family: str, model_cfg, tok_dir: Path) -> None:
    from ctxmodels.checkpoint import save_checkpoint

    save_checkpoint(folder, model, family, model_cfg, tokenizer_dir=tok_dir, extra_json=extra_json, extra_tensors=extra_tensors)


def _sampleless(run: str, endpoint_url: str | None, deadline_s: float, epoch: int) -> set[int]:
    from pipelines import datareport

    return datareport.sampleless_shards(run, epoch, endpoint_url, deadline_s)


def _epoch_closed(run: str, endpoint_url: str | None, deadline_s: float, epoch: int) -> None:
    """An epoch every shard of which is committed: its data report (read = used + rejected per
    shard) is written and printed; telemetry, so a store that cannot be read is a warning."""
    from pipelines import datareport

    try:
        report = datareport.write_epoch_report(run, epoch, endpoint_url, deadline_s)
    except (OSError, storage.StorageError) as e:
        print(f"warning: data report of epoch {epoch} not written: {e}")
        return
    print("data: " + datareport.format_report(report).replace("\n", "\ndata: "))


def _metrics_log(run: str, endpoint_url: str | None, deadline_s: float):
    """Rank 0's ``MetricsLog``, or None (with a warning) when its folder cannot be set up: metrics
    are telemetry, a run trains without them."""
    from jobs.metrics import MetricsLog

    try:
        return MetricsLog(run, endpoint_url, deadline_s=deadline_s)
    except (OSError, storage.StorageError) as e:
        print(f"warning: metrics of {run} will not be written: {e}", file=sys.stderr)
        return None


def _flops_and_peak(recipe: Recipe, model_cfg, predicted_per_row: int | None, device, precision: str, torch) -> tuple[float, float]:
    """Model FLOPs per sample of a training step, and one worker's peak FLOP/s in the step's
    ``precision`` (the datasheet's for known GPUs, else a measured matmul peak): what MFU is
    computed from. (0, 0) if unknown."""
    from ctxmodels import flops

    try:
        per_sample = flops.train_flops_per_step(recipe.model.family, model_cfg, 1, recipe.data.seq_len, predicted_per_row)
    except (KeyError, ValueError, NotImplementedError):
        return 0.0, 0.0
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    peak = flops.known_peak_flops(torch.cuda.get_device_name(device), dtype) if device.type == "cuda" else None
    if peak is None:
        # 1024 on CPU: one 2048 product takes 0.2 s on a thread, so warm-up and the three timed
        # runs turned the 0.3 s budget into 1.3 s of every run's start; 1024 fits and peaks as high.
        n = 1024 if device.type == "cpu" else 2048
        peak = flops.measure_matmul_peak(str(device.type), dtype, n=n, seconds=0.3)
    return per_sample, peak
