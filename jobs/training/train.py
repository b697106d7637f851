"""`ctx pretrain`: a recipe -> a Ray Data stream -> Ray Train (DDP) -> checkpoints.

The driver checks the recipe and the corpus, gets the tokenizer (trains one from a sample of the
corpus, or reuses the run's), builds the lazy dataset and starts a ``TorchTrainer``. Rerunning
the same recipe (same ``output_dir`` and ``name``) resumes from the run's latest checkpoint.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Collection

import numpy as np

from ctxmodels.registry import FAMILIES
from jobs.training.config import FAMILY_OBJECTIVES, Recipe, RecipeError, language_model_fields, model_overrides_with_vocab
from jobs.registry import ModelVersion, resolve
from jobs.training.tracking import record_run
from jobs.session import init_ray
from jobs.training.loop import (
    StepMeter,
    WorkerJob,
    evaluate_batches,
    fit,
    model_inputs,
    perplexity,
    resume_state,
    run_folder,
    run_worker,
    seed_worker_rng,
    to_device,
)
from pipelines import storage
from pipelines.dataset import PARALLEL_SHARD, StreamSpec, build_dataset, local_batches, row_kind, shard_keys, tokenizer_dir_from_files, tokenizer_files, vocab_info
from pipelines.languages import keep_fractions, sampling_probs
from pipelines.masking import MlmConfig
from pipelines.objectives import Objective, objective
from pipelines.permutation import PlmConfig
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


def ensure_tokenizer(recipe: Recipe, shards: list[str], run: str, workdir: Path, log=print, parallel: Collection[str] = ()) -> Path:
    """The run's tokenizer as a local folder: the recipe's, the run's saved one, or a new one.
    ``parallel``: the shards among ``shards`` that hold translation records (XLM's MLM + TLM)."""
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
    names = tuple(recipe.data.languages or ()) if recipe.data.objective == "tlm" or parallel else ()
    texts = sample_text(shards, t.sample_chars, recipe.data.format, recipe.data.text_field, store, translations=names,
                        parallel=set(parallel) if parallel else None)
    tok = train_tokenizer(t.kind, texts, t.vocab_size, lowercase=t.lowercase)
    local = workdir / "tokenizer"
    tok.save(local)
    store.copy_dir(local, saved)
    log(f"tokenizer: {tok.vocab_size} tokens in {time.perf_counter() - t0:.1f}s -> {saved}")
    return local


def warm_start_source(recipe: Recipe, workdir: Path, log=print, key: str = "model.init") -> tuple[str, Path, ModelVersion | None]:
    """``model.init`` resolved to one checkpoint URI (a run folder: its best or newest complete
    checkpoint), checked against the recipe's family, and that checkpoint's tokenizer as a local
    folder: a warm start keeps the vocabulary its embeddings were trained with. The third item is the
    registry version when ``model.init`` named one (``models:/NAME@alias``, looked up once)."""
    from jobs.runs import local_copy, resolve_checkpoint

    store = storage.Store.of(recipe.data)
    given = recipe.teacher.init if key == "teacher.init" else recipe.model.init
    source, version = resolve(given, recipe.registry.tracking_uri)  # models:/NAME@alias -> its checkpoint
    uri = resolve_checkpoint(source, store)
    local = local_copy(uri, workdir / "init", store)
    try:
        payload = json.loads((local / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise RecipeError(f"{key}: {uri} has no readable config.json ({e}); give a checkpoint or run folder") from None
    if "task" in payload:
        raise RecipeError(f"{key}: {uri} is a fine-tuned checkpoint; {'distillation' if key == 'teacher.init' else 'pretraining'} "
                          "starts from a pretraining checkpoint")
    family = payload.get("family") if payload.get("format") == "ctxmodels" else None
    if family is not None and family != recipe.model.family:
        raise RecipeError(f"{key}: {uri} is a {family} checkpoint but model.family is {recipe.model.family!r}; set model.family: {family}")
    for name, wanted in language_model_fields(recipe.data).items():  # XLM: a language table per data.languages
        if family is not None:
            has = payload.get("model", {}).get(name)
        else:  # an HF XLM folder: a table only with n_langs > 1 and use_lang_emb
            n = int(payload.get("n_langs", 1))
            has = n if n > 1 and payload.get("use_lang_emb", True) else 0
        if has != wanted:
            raise RecipeError(f"data.languages: {len(recipe.data.languages)} language(s) need {name}={wanted}, "
                              f"but {key} {uri} has {name}={has}")
    causal = FAMILY_OBJECTIVES.get(recipe.model.family, {}).get(recipe.data.objective, {}).get("causal")
    has_causal = bool((payload.get("model", {}) if family is not None else payload).get("causal", False))
    if causal is not None and has_causal != causal:  # XLM: CLM's attention sees no later token, MLM's sees all
        kinds = {True: "a causal (objective clm)", False: "a bidirectional (objective mlm or tlm)"}
        raise RecipeError(f"{key}: {uri} is {kinds[has_causal]} XLM, but data.objective {recipe.data.objective!r} trains "
                          f"{kinds[causal]} one: start from an XLM pretrained with the same kind of objective")
    tok = local / "tokenizer" if (local / "tokenizer").is_dir() else local  # ours in tokenizer/, HF folders at the top
    what = "teacher" if key == "teacher.init" else "warm start"
    log(f"{what}: weights and tokenizer of {uri}" + (f" (registry version {version.ref})" if version else ""))
    return uri, tok, version


def language_shards(store: storage.Store, entries: list[str], fmt: str = "auto") -> tuple[list[str], tuple[int, ...]]:
    """(shards, language id of each) for data.languages' inputs: entry i's files are language i (``fmt``:
    data.format, which widens what is listed: ``storage.corpus_suffixes``)."""
    shards: list[str] = []
    languages: list[int] = []
    for i, entry in enumerate(entries):
        for uri in store.list_files(entry, storage.corpus_suffixes(fmt)):
            if uri in shards:
                raise RecipeError(f"data.input: {uri} is listed for two languages (entries {languages[shards.index(uri)]} and {i})")
            shards.append(uri)
            languages.append(i)
    return shards, tuple(languages)


def parallel_shards(store: storage.Store, recipe: Recipe, shards: list[str], log) -> list[str]:
    """XLM's MLM + TLM: the shards of data.translations, whose translation rows join the masked-LM
    rows of the languages' ``shards``; a shard in both is refused."""
    parallel = store.list_files(recipe.data.translations)
    both = sorted(set(parallel) & set(shards))
    if both:
        raise RecipeError(f"data.translations: {both[0]} is also one of data.input's language shards; a shard holds "
                          "one language's text or translation records, not both")
    log(f"data: {len(parallel)} parallel shard(s) from {recipe.data.translations}: their translation rows (TLM) "
        "join the languages' masked-LM rows")
    return parallel


def language_keep(store: storage.Store, recipe: Recipe, shards: list[str], languages: tuple[int, ...], log) -> tuple[float, ...]:
    """Each language's share of rows an epoch keeps, for XLM's q_i ~ p_i^alpha (``pipelines.languages``),
    with p from the stored bytes of each language's shards."""
    names = recipe.data.languages
    sizes = np.zeros(len(names))
    np.add.at(sizes, np.asarray(languages), np.asarray(store.file_sizes(shards), dtype=np.float64))
    if not np.all(sizes > 0):
        empty = [names[i] for i in np.flatnonzero(sizes <= 0)]
        raise RecipeError(f"data.input: the shards of language(s) {empty} are empty")
    q, keep = sampling_probs(sizes, recipe.data.language_alpha), keep_fractions(sizes, recipe.data.language_alpha)
    log("data: languages " + ", ".join(
        f"{n} (id {i}, {sizes[i] / sizes.sum():.1%} of the bytes, sampled {q[i]:.1%}, an epoch keeps {keep[i]:.1%} of its rows)"
        for i, n in enumerate(names)))
    return tuple(float(k) for k in keep)


def stream_spec(recipe: Recipe, shards: list[str], first_epoch: int = 0, run_uri: str | None = None,
                languages: tuple[int, ...] = (), keep: tuple[float, ...] = ()) -> StreamSpec:
    """``languages``/``keep``: XLM's language id of each shard and the share of each language's
    rows an epoch keeps (``StreamSpec.shard_languages`` / ``language_keep``)."""
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
        store=storage.Store.of(d),
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
        shard_languages=tuple(languages),
        language_keep=tuple(keep),
        language_names=tuple(d.languages or ()) if d.objective == "tlm" or d.translations is not None else (),
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
    store = storage.Store.of(recipe.data)  # every call of the driver: the recipe's endpoint and deadline
    if recipe.data.languages and recipe.data.objective != "tlm":  # XLM's MLM: each input entry is one language's shards
        shards, languages = language_shards(store, recipe.data.input, recipe.data.format)
        eval_shards, eval_languages = language_shards(store, recipe.data.eval_input, recipe.data.format) if recipe.data.eval_input else ([], ())
    else:
        suffixes = storage.corpus_suffixes(recipe.data.format)
        shards, languages = store.list_files(recipe.data.input, suffixes), ()
        eval_shards, eval_languages = (store.list_files(recipe.data.eval_input, suffixes) if recipe.data.eval_input else []), ()
    log(f"data: {len(shards)} shard(s) from {recipe.data.input}")
    keep = language_keep(store, recipe, shards, languages, log) if languages else ()
    parallel = parallel_shards(store, recipe, shards, log) if recipe.data.translations is not None else []
    shards, languages = shards + parallel, languages + (PARALLEL_SHARD,) * len(parallel)
    run = run_uri(recipe)
    if recipe.teacher is not None:  # distillation: the teacher's weights and tokenizer, checked before Ray starts
        init = warm_start_source(recipe, workdir, log, key="teacher.init")
        tok_folder = init[1]
        check_teacher(recipe, tok_folder.parent if tok_folder.name == "tokenizer" else tok_folder)  # the checkpoint's folder
    else:
        init = warm_start_source(recipe, workdir, log) if recipe.model.init else None
    init_version = init[2] if init else None  # models:/NAME@alias: the parent of the version this run registers
    tok_dir = init[1] if init and not recipe.tokenizer.path else ensure_tokenizer(recipe, shards, run, workdir, log, parallel)
    tok = load_tokenizer(tok_dir)
    model_overrides_with_vocab(recipe, tok.vocab_size)  # fail before Ray if the vocab can't fit
    check_tokenizer_for_objective(tok, recipe.data.objective)  # and that its rows can be built

    resumed = resume_state(run, store)
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
    spec = stream_spec(recipe, shards, first_epoch, run_uri=run, languages=languages, keep=keep)
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
            "eval_languages": list(eval_languages),
            "predicted_per_row": objective(spec.objective).predicted(recipe.data.seq_len, spec),
        },
        name=recipe.name, output_dir=recipe.output_dir, store=store, scaling=recipe.scaling,
        datasets={"train": dataset}, max_steps=recipe.train.max_steps, progress=progress,
        label="distill" if recipe.teacher is not None else "pretrain",
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

    epochs = datareport.list_epochs(run, store)
    if not epochs:
        return
    epoch = epoch if epoch in epochs else epochs[-1]
    report = datareport.epoch_report(run, epoch, store)
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


def train_batches(config: dict[str, Any], micro: int, device, label_positions: bool = False):
    """Ray seam: this worker's share of the training stream, as (micro, ...) tensor batches;
    ``label_positions``: the model's forward takes them (``jobs.training.loop.to_device``)."""
    import ray.train

    shard = ray.train.get_dataset_shard("train")
    if config.get("stream_ordered"):  # one Ray Data row = one whole (B, T) micro-batch of this worker
        return stream_batches(shard.iter_torch_batches(batch_size=1, device=device), micro)
    # Host batches, moved by to_device: pinned, asynchronous copies, and packed rows' all-ones
    # masks found on the host, so attention runs with no mask (flash kernels) on a GPU.
    return (to_device(b, device, label_positions) for b in shard.iter_torch_batches(batch_size=micro, drop_last=True))


def eval_batches(recipe: Recipe, shards: list[str], tok_dir: Path, rows: int, device,
                 languages: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """The held-out batches of ``data.eval_input``: at most ``data.eval_max_samples`` samples in
    batches of ``rows`` (the training micro-batch, so memory models keep their batch size), built
    by the same NumPy pipeline as training, masked as epoch ``EVAL_EPOCH``: identical at every
    evaluation, on every worker and on every rerun. ``languages``: XLM's language of each shard
    (every row of them kept: evaluation reads the held-out text as it is)."""
    import torch

    spec = stream_spec(recipe, shards, languages=languages)
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
    job = DistillJob if config["recipe"].get("teacher") else PretrainJob
    with tempfile.TemporaryDirectory(prefix="ctx-tokenizer-") as d:
        run_worker(job(config, tokenizer_dir_from_files(config["tokenizer_files"], d)), config)


class PretrainJob(WorkerJob):
    """Pretraining as the worker loop runs it: a fresh (or warm-started) model of the recipe's
    family, the objective's stream of batches, held-out batches of ``data.eval_input``, perplexity
    and MFU in the metrics, and the data report of every epoch that closes."""

    def __init__(self, config: dict[str, Any], tok_dir: Path) -> None:
        self.config, self.tok_dir = config, tok_dir
        self.recipe = recipe = Recipe.model_validate(config["recipe"])
        self.run, self.obj = config["run_uri"], objective(recipe.data.objective)
        self.total_steps, self.warmup_steps = recipe.train.max_steps, recipe.train.warmup_steps
        self.units, self.extra = config["shard_keys"], {"recipe": config["recipe"]}
        self.eval_batches: list[dict[str, Any]] = []
        self.flops_per_sample = self.peak = 0.0
        self.label_positions = False  # whether the model's forward takes label_positions (build_model says)

    def build_model(self, rank: int):
        from ctxmodels.registry import build_model

        recipe, config = self.recipe, self.config
        if config.get("init_checkpoint"):  # warm start: the checkpoint's architecture and weights
            self.model_cfg, model = warm_start_model(config["init_checkpoint"], storage.Store.of(recipe.data))
        else:
            overrides = model_overrides_with_vocab(recipe, config["vocab_size"])
            for key, value in {**self.obj.families[recipe.model.family], **language_model_fields(recipe.data)}.items():
                overrides.setdefault(key, value)  # e.g. packed single-segment MLM: no NSP head to train
            self.model_cfg, model = build_model(recipe.model.family, recipe.model.preset, overrides, seed=recipe.train.seed)
        seed_worker_rng(recipe.train.seed, rank)  # dropout
        self.label_positions = "label_positions" in inspect.signature(model.forward).parameters
        return model

    def started(self, device, precision: str) -> None:
        import torch

        self.flops_per_sample, self.peak = _flops_and_peak(self.recipe, self.model_cfg, self.config.get("predicted_per_row"),
                                                           device, precision, torch)

    def batches(self, config: dict[str, Any], micro: int, device):
        return train_batches(config, micro, device, self.label_positions)

    def frozen_message(self, frozen: list[str]) -> str:
        return f"not trained by objective {self.recipe.data.objective!r} (frozen): {', '.join(frozen)}"

    def meter(self) -> StepMeter:
        return StepMeter(self.obj.is_token_metric)

    def checkpointer_options(self) -> dict[str, Any]:
        from ctxmodels.registry import build_model

        recipe, run = self.recipe, self.run
        store = storage.Store.of(recipe.data)
        return dict(
            save=partial(_save, family=recipe.model.family, model_cfg=self.model_cfg, tok_dir=self.tok_dir),
            fresh_model=lambda: build_model(recipe.model.family, recipe.model.preset, dataclasses.asdict(self.model_cfg))[1],
            sampleless=partial(_sampleless, run, store), on_epoch_closed=partial(_epoch_closed, run, store),
        )

    def held_out(self, micro: int, device) -> bool:
        if self.config.get("eval_shards"):
            self.eval_batches = eval_batches(self.recipe, self.config["eval_shards"], self.tok_dir, micro, device,
                                             tuple(self.config.get("eval_languages", ())))
        return bool(self.eval_batches)

    def interval_extras(self, metrics: dict[str, Any], world: int) -> None:
        if self.obj.main_loss in metrics:
            metrics["ppl"] = perplexity(metrics[self.obj.main_loss])
        if self.flops_per_sample and self.peak and "samples_per_s" in metrics:
            metrics["mfu"] = metrics["samples_per_s"] * self.flops_per_sample / (self.peak * world)

    def evaluation_due(self, step: int) -> bool:
        return step % self.recipe.train.eval_every == 0

    def evaluate(self, wrapped, metrics, state, plan, device, rank: int, world: int) -> bool:
        metrics.update(evaluate(wrapped, self.eval_batches, self.obj, plan, device, rank, world))
        return False  # pretraining keeps the newest checkpoints, not a best one

    def finished(self, state, rank: int) -> None:
        if state.step < self.total_steps and rank == 0:
            print(f"data stream ended at step {state.step} before train.max_steps={self.total_steps}; raise data.max_epochs")


class DistillJob(PretrainJob):
    """Distillation (``ctx distill``) as the worker loop runs it: pretraining's stream, held-out
    batches and cadence, with a ``ctxmodels.distill.Distiller`` as the model: the student (the
    teacher's family, ``teacher.student_layers`` of its layers) trained against the frozen teacher
    in the same worker. Checkpoints hold the student alone, a plain pretraining model of its
    family: ``ctx serve``, ``ctx eval``, ``ctx export`` and ``model.init`` take them as any other."""

    def build_model(self, rank: int):
        from ctxmodels.distill import DistillWeights, Distiller, every_other_layer, init_student

        recipe, s = self.recipe, self.recipe.teacher
        teacher_cfg, teacher = warm_start_model(self.config["init_checkpoint"], storage.Store.of(recipe.data))
        student = init_student(teacher, s.student_layers or every_other_layer(teacher_cfg.n_layer))
        self.model_cfg = student.cfg
        seed_worker_rng(recipe.train.seed, rank)  # dropout
        weights = DistillWeights(temperature=s.temperature, soft=s.alpha_soft, mlm=s.alpha_mlm, cos=s.alpha_cos,
                                 sentence=s.alpha_sentence)
        return Distiller(student, teacher, weights)

    def checkpointer_options(self) -> dict[str, Any]:
        options = super().checkpointer_options()
        save = options["save"]
        options["save"] = lambda folder, model, *args, **kwargs: save(folder, getattr(model, "student", model), *args, **kwargs)
        return options

    def frozen_message(self, frozen: list[str]) -> str:
        return f"not trained by the distillation loss (frozen): {', '.join(frozen)}"


def check_teacher(recipe: Recipe, folder: Path) -> None:
    """Before Ray starts: the teacher loads, the student's layers exist in it, and a teacher without a
    trained masked-LM head (an embedding model) is not asked for soft targets or an MLM loss."""
    from ctxmodels.checkpoint import load_checkpoint

    s = recipe.teacher
    try:
        loaded = load_checkpoint(folder)
    except (OSError, ValueError, KeyError) as e:
        raise RecipeError(f"teacher.init: {s.init} does not load as a {recipe.model.family} model: {e}") from None
    n = getattr(loaded.config, "n_layer", 0)
    if s.student_layers is not None and s.student_layers[-1] >= n:
        raise RecipeError(f"teacher.student_layers: {s.student_layers} names a layer the {n}-layer teacher does not have")
    untrained_head = [name for name in loaded.untrained if name.startswith("mlm.")]
    if untrained_head and (s.alpha_soft > 0 or s.alpha_mlm > 0):
        raise RecipeError(
            f"teacher.init: {s.init} has no trained masked-LM head ({', '.join(untrained_head[:3])} missing): it is an "
            "embedding model; distil it through the hidden states alone: teacher.alpha_soft=0, teacher.alpha_mlm=0, "
            "and teacher.alpha_cos and/or teacher.alpha_sentence above 0")


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
    from jobs.registry import MLMODEL, mlmodel_text

    save_checkpoint(folder, model, family, model_cfg, tokenizer_dir=tok_dir, extra_json=extra_json, extra_tensors=extra_tensors,
                    extra_text={MLMODEL: mlmodel_text(family)})  # an MLflow model too (jobs/serving/pyfunc.py)


def _sampleless(run: str, store: storage.Store, epoch: int) -> set[int]:
    from pipelines import datareport

    return datareport.sampleless_shards(run, epoch, store)


def _epoch_closed(run: str, store: storage.Store, epoch: int) -> None:
    """An epoch every shard of which is committed: its data report (read = used + rejected per
    shard) is written and printed; telemetry, so a store that cannot be read is a warning."""
    from pipelines import datareport

    try:
        report = datareport.write_epoch_report(run, epoch, store)
    except (OSError, storage.StorageError) as e:
        print(f"warning: data report of epoch {epoch} not written: {e}")
        return
    print("data: " + datareport.format_report(report).replace("\n", "\ndata: "))


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
