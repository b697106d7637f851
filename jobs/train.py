"""`ctx pretrain`: a recipe -> a Ray Data stream -> Ray Train (DDP) -> checkpoints.

The driver checks the recipe and the corpus, gets the tokenizer (trains one from a sample of the
corpus, or reuses the run's), builds the lazy dataset and starts a ``TorchTrainer``. Rerunning
the same recipe (same ``output_dir`` and ``name``) resumes from the run's latest checkpoint.
"""

from __future__ import annotations

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
from jobs.config import FAMILY_OBJECTIVES, Recipe, RecipeError, model_overrides_with_vocab
from pipelines import storage
from pipelines.dataset import StreamSpec, build_dataset, row_kind, tokenizer_files
from pipelines.masking import MlmConfig
from pipelines.permutation import PlmConfig
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
    storage.upload_dir(local, saved, ep) if storage.is_remote(saved) else _copy_local(local, saved)
    log(f"tokenizer: {tok.vocab_size} tokens in {time.perf_counter() - t0:.1f}s -> {saved}")
    return local


def _copy_local(src: Path, dst: str) -> None:
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True)


def resume_state(run: str, endpoint_url: str | None) -> dict[str, Any] | None:
    """trainer_state.json of the run's latest committed checkpoint, if any."""
    latest = storage.latest_complete_checkpoint(run, endpoint_url)
    if latest is None:
        return None
    fs, path = storage.filesystem(latest, endpoint_url)
    with fs.open_input_stream(f"{path}/trainer_state.json") as f:
        return json.loads(f.read())


def stream_spec(recipe: Recipe, shards: list[str], first_epoch: int = 0) -> StreamSpec:
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
        # Stream-ordered batches are cut in the data stage, so it must know the per-worker rows.
        stream_rows=recipe.train.batch_size // recipe.scaling.num_workers,
        stream_block_batches=d.stream_block_batches,
        char_max_chars=int(recipe.model.overrides.get("max_chars", getattr(preset, "max_chars", 50))),
        tokenize_actors=d.tokenize_actors,
    )


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
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
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

    state = resume_state(run, ep)
    first_epoch = int(state["epoch"]) if state else 0
    if state:
        log(f"resume: step {state['step']} from the latest checkpoint of {run}")

    init_ray(verbose)
    board = ProgressBoard.remote()
    spec = stream_spec(recipe, shards, first_epoch)
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
        },
        scaling_config=ScalingConfig(
            num_workers=recipe.scaling.num_workers,
            use_gpu=recipe.scaling.use_gpu,
            resources_per_worker={"CPU": recipe.scaling.cpus_per_worker},
        ),
        run_config=RunConfig(
            name=recipe.name,
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            checkpoint_config=CheckpointConfig(num_to_keep=3),
            failure_config=FailureConfig(max_failures=2),
        ),
        datasets={"train": dataset},
    )
    result = run_with_progress(trainer.fit, board, recipe.train.max_steps, enabled=progress)
    if result.error:
        raise result.error
    ckpt = None
    if result.checkpoint is not None:
        scheme = recipe.output_dir.split("://", 1)[0] + "://" if storage.is_remote(recipe.output_dir) else ""
        ckpt = scheme + result.checkpoint.path
    log(f"checkpoint: {ckpt}")
    history = ray.get(board.history.remote())
    return PretrainResult(run_uri=run, checkpoint_uri=ckpt, metrics=dict(result.metrics or {}), history=history)


# ---------------------------------------------------------------------------------------------
# Worker side (runs inside each Ray Train worker process).


def lr_lambda(warmup: int, total: int):
    """Linear warm-up to the peak, then linear decay to zero at ``total`` (BERT, RoBERTa)."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    return f


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


def train_loop_per_worker(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    import torch

    from ctxmodels.checkpoint import load_checkpoint, load_optimizer_state
    from ctxmodels.registry import build_model
    from safetensors.torch import load_file

    recipe = Recipe.model_validate(config["recipe"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(recipe.scaling.cpus_per_worker)))
    t = recipe.train

    overrides = model_overrides_with_vocab(recipe, config["vocab_size"])
    for key, value in FAMILY_OBJECTIVES[recipe.model.family][recipe.data.objective].items():
        overrides.setdefault(key, value)  # e.g. packed single-segment MLM: no NSP head to train
    torch.manual_seed(t.seed)
    model_cfg, model = build_model(recipe.model.family, recipe.model.preset, overrides)
    step, samples_seen, tokens_seen, epoch = 0, 0, 0, 0
    resume_state = None

    resume = ray.train.get_checkpoint()
    if resume is not None:
        with resume.as_directory() as d:
            model.load_state_dict(load_checkpoint(d).model.state_dict())
            state = json.loads(Path(d, "trainer_state.json").read_text())
            resume_state = (load_file(os.path.join(d, "optimizer.safetensors")), state["optimizer"])
            step, samples_seen, tokens_seen, epoch = state["step"], state["samples_seen"], state["tokens_seen"], state["epoch"]

    device = ray.train.torch.get_device()
    per_worker = t.batch_size // world
    shard = ray.train.get_dataset_shard("train")
    if config.get("stream_ordered"):  # one Ray Data row = one whole (B, T) batch of this worker
        it = stream_batches(shard.iter_torch_batches(batch_size=1, device=device), per_worker)
    else:
        it = iter(shard.iter_torch_batches(batch_size=per_worker, drop_last=True, device=device))
    first = next(it, None)
    if first is None:
        raise RuntimeError("the data stream is empty: no full batch of train.batch_size / num_workers rows")
    frozen = freeze_unused(model.to(device), model_inputs(first))
    if frozen and rank == 0:
        print(f"not trained by objective {recipe.data.objective!r} (frozen): {', '.join(frozen)}")
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=t.betas, eps=t.eps)
    if resume_state is not None:
        load_optimizer_state(optimizer, *resume_state)
    for g in optimizer.param_groups:  # the schedule below re-derives lr from the step
        g["lr"] = t.lr
        g.pop("initial_lr", None)
    schedule, step0 = lr_lambda(t.warmup_steps, t.max_steps), step
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: schedule(s + step0))
    ddp_model = ray.train.torch.prepare_model(model)

    tok_dir = Path(tempfile.mkdtemp(prefix="ctx-tok-"))
    for name, data in config["tokenizer_files"].items():
        (tok_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (tok_dir / name).write_bytes(data)

    sums: dict[str, float] = {}
    interval_tokens, interval_steps = 0, 0
    t_interval = time.perf_counter()
    t_start = time.perf_counter()
    start_step = step
    model.train()
    for batch in itertools.chain([first], it) if step < t.max_steps else ():
        epoch = int(batch["epoch"].max())
        out = ddp_model(**model_inputs(batch))
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        n_tok = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].numel()
        interval_tokens += n_tok
        interval_steps += 1
        samples_seen += per_worker * world
        _accumulate(sums, out)
        if "_stream_block" in batch:  # share of batches started without memory: 1 / block length if Ray kept blocks whole
            sums["stream_resets"] = sums.get("stream_resets", 0.0) + float(batch["reset_memory"][0])
            sums["_w_stream_resets"] = sums.get("_w_stream_resets", 0.0) + 1.0

        last = step >= t.max_steps
        if step % t.log_every == 0 or last:
            metrics = _reduce_metrics(sums, interval_steps, interval_tokens, world, torch)
            elapsed = time.perf_counter() - t_interval
            metrics.update(
                step=step,
                max_steps=t.max_steps,
                epoch=epoch,
                lr=scheduler.get_last_lr()[0],
                tokens_per_s=metrics.pop("_tokens") / max(elapsed, 1e-9),
                samples_seen=samples_seen,
            )
            tokens_seen += int(metrics["tokens_per_s"] * elapsed)
            rate = (step - start_step) / max(time.perf_counter() - t_start, 1e-9)
            metrics["eta_s"] = (t.max_steps - step) / rate if rate > 0 else None
            metrics["tokens_seen"] = tokens_seen
            if rank == 0:
                config["board"].update.remote(metrics)
            sums, interval_tokens, interval_steps, t_interval = {}, 0, 0, time.perf_counter()
            if step % t.checkpoint_every == 0 or last:
                state = {"step": step, "samples_seen": samples_seen, "tokens_seen": tokens_seen, "epoch": epoch, "recipe": config["recipe"]}
                _report_with_checkpoint(ray, rank, model, recipe, model_cfg, tok_dir, optimizer, state, metrics)
            else:
                ray.train.report(metrics)
        if last:
            break
    if step < t.max_steps and rank == 0:
        print(f"data stream ended at step {step} before train.max_steps={t.max_steps}; raise data.max_epochs")


def _accumulate(sums: dict[str, float], out) -> None:
    n_pred = float(out.metrics.get("n_pred", 0.0))
    sums["loss"] = sums.get("loss", 0.0) + float(out.loss.detach())
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
    out: dict[str, float] = {"loss": vals["loss"] / max(vals["_steps"], 1.0), "_tokens": vals["_tokens"]}
    for k in keys:
        if k.startswith("_") or k == "loss":
            continue
        out[k] = vals[k] / max(vals["_w_" + k], 1e-9)
    main = next((k for k in ("mlm_loss", "lm_loss", "plm_loss") if k in out), None)
    if main is not None:
        out["ppl"] = math.exp(min(out[main], 50.0))
    return out


def _report_with_checkpoint(ray, rank, model, recipe, model_cfg, tok_dir, optimizer, state, metrics) -> None:
    """Rank 0 writes the checkpoint (MANIFEST last); every rank reports, as Ray Train requires."""
    from ray.train import Checkpoint

    from ctxmodels.checkpoint import optimizer_state_to_tensors, save_checkpoint

    if rank != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="ctx-ckpt-") as d:
        tensors, meta = optimizer_state_to_tensors(optimizer)
        state = {**state, "optimizer": meta}
        save_checkpoint(
            d,
            model,
            recipe.model.family,
            model_cfg,
            tokenizer_dir=tok_dir,
            extra_json={"trainer_state.json": state},
            extra_tensors={"optimizer.safetensors": tensors},
        )
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))
