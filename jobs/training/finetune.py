"""`ctx finetune`: a recipe -> task records through Ray Data -> Ray Train -> the best checkpoint.

The driver resolves ``model.init`` (``jobs.runs``), reads and checks the splits (bad records
counted in the run's data report, over-long inputs truncated and counted), takes the label set
from the training split, and starts a ``TorchTrainer`` on the same machinery as pretraining
(``jobs.training.loop``): DDP/FSDP, elastic worker counts with a fixed global batch, exactly-once data
across failures (``pipelines.finetune_stream``), atomic checkpoints, metrics JSONL/TensorBoard and
the progress line. Every epoch (and every ``train.eval_every`` steps) the validation split is
scored with ``pipelines.metrics.task_metrics``; the checkpoint with the best ``task.metric`` is the
run's ``best.json`` (what ``--model RUN_FOLDER`` resolves to), and ``train.patience`` evaluations
without improvement stop the run. Rerunning the same recipe resumes from the run's latest
checkpoint.

Heads and inputs follow the papers (``ctxmodels/tasks.py``): BERT-style models read [CLS], XLNet
its last token, GPT its extract token with the auxiliary LM loss.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ctxmodels.task_kinds import TASKS
from jobs.training.finetune_config import LOWER_IS_BETTER, FinetuneRecipe, input_style, task_data_config
from jobs.training.finetune_inputs import FORWARD_KEYS, TRIM_LENGTH, task_inputs, train_inputs, trim_length
from jobs.registry import resolve as resolve_model
from jobs.training.tracking import record_run
from jobs.session import init_ray
from jobs.training.loop import (
    WorkerJob,
    all_gather,
    checkpoint_name,
    evaluate_batches,
    fit,
    ingest_options,
    resume_state,
    run_folder,
    run_worker,
    seed_worker_rng,
    to_device,
)
from pipelines import storage

NOT_BEST = -1e30  # checkpoint_score of a checkpoint that is not a new best (JSON-safe, below any score)


@dataclass
class FinetuneResult:
    run_uri: str
    best_checkpoint: str | None  # what best.json names (None without a validation split)
    checkpoint_uri: str | None  # the newest checkpoint
    metrics: dict[str, Any]  # the last checkpoint's metrics (val_* where it was evaluated)
    best: dict[str, Any] | None = None  # best.json
    test_metrics: dict[str, float] | None = None  # data.test scored with the best checkpoint
    data_report: dict[str, Any] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    registered: Any = None  # the jobs.registry.ModelVersion the chosen checkpoint became (registry.enabled)


# ---------------------------------------------------------------------------------------------
# Recipe -> the task's data and model configs


def task_config_fields(recipe: FinetuneRecipe, family: str, labels: tuple[str, ...], language: int = 0,
                       languages: list[str] | None = None, sentence: dict[str, Any] | None = None) -> dict[str, Any]:
    """``ctxmodels.tasks.TaskConfig`` fields (plain values: they travel to the workers as JSON);
    ``language``/``languages``: an XLM's row every token reads, and the rows' names; ``sentence``: an
    embedding task's pooling, normalize and max_seq_length (``sentence_fields``)."""
    kind = recipe.task.kind
    return {
        **(sentence or {}),
        "scale": recipe.task.scale,
        "loss": recipe.task.loss or "multiple_negatives_ranking",
        "matryoshka_dims": list(recipe.task.matryoshka_dims or []),
        "matryoshka_weights": list(recipe.task.matryoshka_weights or []),
        "directions": list(recipe.task.directions or ["query_to_doc"]),
        "partition_mode": recipe.task.partition_mode or "joint",
        "hardness_mode": recipe.task.hardness_mode,
        "hardness_strength": recipe.task.hardness_strength or 0.0,
        "kind": kind,
        "num_labels": len(labels) if TASKS[kind].labelled else 1,
        "labels": list(labels),
        "dropout": recipe.model.dropout,
        "lm_weight": recipe.task.lm_weight,
        "symmetric": recipe.task.symmetric,
        "freeze": recipe.model.freeze,
        "features": recipe.model.features,
        "task_model": recipe.model.task_model,
        "input_style": input_style(family),
        "language": language,
        "languages": list(languages or []),
    }


def task_language(recipe: FinetuneRecipe, family: str, model_fields: dict[str, Any], names: list[str], init_task) -> tuple[int, list[str]]:
    """(row, names) of the language an XLM's task reads: ``task.language`` among model.init's
    languages, else a continued head's, else row 0. RecipeError for a language the model lacks."""
    from ctxmodels.tasks import language_row
    from jobs.training.config import RecipeError

    rows = model_fields.get("type_vocab_size", 0) if family == "xlm" else 0
    names = names if rows > 1 and len(names) == rows else []
    if recipe.task.language is None:
        return (init_task.language if init_task is not None else 0), names
    if family != "xlm":
        raise RecipeError(f"task.language: only an XLM reads its texts as a language; model.init is a {family} model")
    try:
        return language_row(names, rows, recipe.task.language), names
    except ValueError as e:
        raise RecipeError(f"task.language: {e}") from None


def sentence_fields(recipe: FinetuneRecipe, family: str, model_cfg: Any, init_sentence: Any) -> dict[str, Any]:
    """An embedding task's ``pooling``, ``normalize`` and ``max_seq_length``: the recipe's, else what
    model.init's sentence settings say (a sentence-transformers folder's modules, or an embedding
    checkpoint's task; ``ctxmodels.sbert.checkpoint_sentence_settings``), else mean pooling (the
    last token in a left-to-right model), unit vectors, the model's positions. Fine-tuning all-MiniLM-L6-v2
    so keeps its mean pooling, Normalize module and 256 tokens, as sentence-transformers' trainer does."""
    from ctxmodels.tasks import default_pooling, is_causal
    from jobs.training.config import RecipeError

    task = recipe.task
    if family == "elmo":
        raise RecipeError("task.kind: an embedding task trains the backbone's own vectors; ELMo is fine-tuned feature-based "
                          "(a frozen biLM under a task model), so its vectors would not change: fine-tune another family")
    pooling = task.pooling or (init_sentence.pooling if init_sentence is not None else default_pooling(family, model_cfg))
    if pooling == "cls" and is_causal(family, model_cfg):
        raise RecipeError(f"task.pooling: 'cls' reads the first position, which in a left-to-right {family} model has seen "
                          "no text; use last or mean")
    too_wide = [d for d in task.matryoshka_dims or [] if d > model_cfg.d_model]
    if too_wide:
        raise RecipeError(f"task.matryoshka_dims: {too_wide} wider than model.init's {model_cfg.d_model}-dimensional vectors")
    normalize = task.normalize if task.normalize is not None else (init_sentence.normalize if init_sentence is not None else True)
    return {"pooling": pooling, "normalize": normalize,
            "max_seq_length": init_sentence.max_seq_length if init_sentence is not None else None}


def score_of(metric: str, values: dict[str, float]) -> float:
    """The checkpoint score of a validation (higher is better): the metric, negated for a loss."""
    v = values.get(f"val_{metric}", float("nan"))
    return -v if metric in LOWER_IS_BETTER else v


# ---------------------------------------------------------------------------------------------
# Driver side.


def finetune(recipe: FinetuneRecipe, verbose: bool = False, progress: bool = True, log=print) -> FinetuneResult:
    """Fine-tune under the run folder's lock, as ``jobs.training.train.pretrain`` (one writer per run)."""
    from jobs.runlock import RunLock

    run = run_folder(recipe.output_dir, recipe.name)
    with RunLock(run, storage.Store.of(recipe.data), command=f"ctx finetune ({recipe.name})"):
        return _finetune(recipe, verbose, progress, log)


def _finetune(recipe: FinetuneRecipe, verbose: bool, progress: bool, log) -> FinetuneResult:
    import ray
    from ray.train import CheckpointConfig, DataConfig

    from ctxmodels.checkpoint import load_checkpoint
    from ctxmodels.sbert import checkpoint_sentence_settings
    from jobs.runs import best_checkpoint, checkpoint_languages, local_copy, read_best, resolve_checkpoint
    from pipelines import finetune_stream as fs
    from pipelines.dataset import tokenizer_files
    from pipelines.datareport import format_report

    store = storage.Store.of(recipe.data)  # every call of the driver: the recipe's endpoint and deadline
    run = run_folder(recipe.output_dir, recipe.name)
    # models:/NAME@alias -> that version's checkpoint; the version becomes the new one's parent
    source, parent = resolve_model(recipe.model.init, recipe.registry.tracking_uri)
    init_uri = resolve_checkpoint(source, store)
    log(f"model: {recipe.model.init} -> {init_uri}" + (f" (registry version {parent.ref})" if parent else ""))
    with tempfile.TemporaryDirectory(prefix="ctx-finetune-") as workdir:  # a remote init's copy: only its config and tokenizer bytes are kept
        local = local_copy(init_uri, Path(workdir), store)
        init = load_checkpoint(local)
        if init.tokenizer_dir is None:
            raise storage.StorageError(f"model.init: {init_uri} has no tokenizer files (tokenizer/, tokenizer.json or vocab.txt)")
        family, files = init.family, tokenizer_files(init.tokenizer_dir)
        model_fields = dataclasses.asdict(init.config)
        init_task = init.task
        names = checkpoint_languages(local)  # an XLM's languages, by name
        sentence = sentence_fields(recipe, family, init.config, checkpoint_sentence_settings(local, init_task)) \
            if recipe.task.kind == "embedding" else None
        del init
    continuing = recipe.model.head == "continue"
    language, names = task_language(recipe, family, model_fields, names, init_task if continuing else None)
    if names or language:
        log(f"language: the texts are read as {names[language] if names else f'row {language}'} of model.init's language table")
    if sentence is not None:
        log(f"embedding: {sentence['pooling']} pooling, " + ("unit vectors" if sentence["normalize"] else "not normalised")
            + (f", {sentence['max_seq_length']} tokens served" if sentence["max_seq_length"] else "")
            + (f", {recipe.task.loss} loss on scored pairs" if recipe.task.scored_pairs else ""))
        accumulating = recipe.accumulation(recipe.scaling.worker_range[0]) > 1
        if accumulating and recipe.task.scored_pairs:  # no gradient cache, no gathering (FinetuneJob.cached_loss)
            log(f"embedding: each micro-batch of {recipe.micro_batch_size} pairs is a batch of the {recipe.task.loss} loss")
        elif accumulating and recipe.task.gradient_cache is not False:
            log(f"embedding: gradient cache, each anchor ranks against the step's {recipe.train.batch_size} rows, forwarded "
                f"{recipe.micro_batch_size} at a time (task.gradient_cache)")
        elif accumulating:
            log(f"embedding: each anchor ranks against its micro-batch of {recipe.micro_batch_size} rows only (task.gradient_cache: false)")
    if continuing:
        from jobs.training.config import RecipeError

        if init_task is None or init_task.kind != recipe.task.kind:
            raise RecipeError(f"model.head: continue needs a fine-tuned {recipe.task.kind} checkpoint as model.init; {init_uri} "
                              + ("has no task head" if init_task is None else f"is fine-tuned for {init_task.kind}") + " (use model.head: fresh)")

    init_ray(verbose)
    train_table = fs.read_split(recipe.data.train, recipe.data.format, store)
    log(f"data: {train_table.num_rows:,} training records from {recipe.data.train}")
    cfg = task_data_config(recipe, family)
    labels: tuple[str, ...] = ()
    if TASKS[recipe.task.kind].labelled:
        labels = tuple(_checked(fs.label_set, "data.train", train_table, cfg).names)
        if continuing:  # the head's classes, in its order; the new data may hold only some of them
            unknown = sorted(set(labels) - set(init_task.labels))
            if unknown:
                from jobs.training.config import RecipeError

                raise RecipeError(f"data.train: labels {unknown[:12]} are not classes of model.init's head {init_task.labels[:12]}; "
                                  "a continued head cannot learn new classes: fine-tune with model.head: fresh")
            labels = tuple(init_task.labels)
        log(f"labels: {len(labels)} from the training split: {list(labels)[:12]}{' ...' if len(labels) > 12 else ''}")
    cfg = fs.with_labels(cfg, fs.LabelSet(labels) if labels else None)
    train_check = _checked(fs.check_split, "data.train", train_table, files, cfg)
    report = fs.write_split_report(run, "train", train_check, store)
    if not len(train_check.usable):
        raise ValueError(f"data.train: none of the {train_table.num_rows} records is usable:\n{format_report(report)}")

    val = None
    if recipe.data.validation:
        val_table = fs.read_split(recipe.data.validation, recipe.data.format, store)
        val_check = _checked(fs.check_split, "data.validation", val_table, files, cfg)
        report = fs.write_split_report(run, "validation", val_check, store)
        val = {"rows": fs.encode_split(val_table, val_check.usable, files, cfg), **fs.references(val_table, val_check.usable, cfg)}
        log(f"data: {len(val_check.usable):,} of {val_table.num_rows:,} validation records usable")
    if recipe.data.validation_retrieval:
        val = {**(val or {}), "retrieval": retrieval_rows(recipe, files, store, log)}
    for line in format_report(report).splitlines():
        log(f"data: {line}")
    log(f"data: {train_check.truncated:,} training records cut to task.max_len={recipe.task.max_len}")

    t = recipe.train
    rows_per_epoch = train_check.total_rows
    steps_per_epoch = rows_per_epoch // t.batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"train.batch_size: {t.batch_size} is more than the {rows_per_epoch} rows of the training split")
    total_steps = (t.epochs * rows_per_epoch) // t.batch_size
    if t.max_steps is not None:
        total_steps = min(total_steps, t.max_steps)

    resumed = resume_state(run, store)
    first_epoch = 0
    if resumed:
        state, position = resumed
        first_epoch = int(state["epoch"])
        if int(state["step"]) >= total_steps or first_epoch >= t.epochs:
            log(f"resume: {run} already trained {state['step']} of {total_steps} steps; nothing to do")
            latest = store.latest_complete_checkpoint(run)
            best = best_checkpoint(run, store) if recipe.validated else None
            return FinetuneResult(run, best, latest, state, read_best(run, store) if best else None, None, report, [])
        log(f"resume: step {state['step']} from the latest checkpoint of {run} (epoch {first_epoch}, "
            f"{position.committed(first_epoch)} of its rows already trained on)")
    dataset = fs.build_train_dataset(
        train_table, train_check.usable, files, cfg, seed=t.seed, first_epoch=first_epoch, epochs=t.epochs,
        unit_records=recipe.data.unit_records, run_uri=run, store=store,
    )
    scored = recipe.validated
    result = fit(
        finetune_loop_per_worker,
        {
            "recipe": recipe.model_dump(mode="json"),
            "family": family,
            "model": model_fields,
            "init_uri": init_uri,
            "continue_head": continuing,
            "task": task_config_fields(recipe, family, labels, language, names, sentence),
            "data_config": dataclasses.asdict(cfg),
            "tokenizer_files": files,
            "run_uri": run,
            "n_units": fs.n_units(len(train_check.usable), recipe.data.unit_records),
            "total_steps": total_steps,
            "steps_per_epoch": steps_per_epoch,
            "warmup_steps": round(t.warmup_ratio * total_steps),
            "validation": ray.put(val) if scored else None,
        },
        name=recipe.name, output_dir=recipe.output_dir, store=store, scaling=recipe.scaling,
        datasets={"train": dataset}, max_steps=total_steps, progress=progress, label="finetune",
        # Ray keeps the best checkpoints by score (and always the newest, for resume).
        checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="checkpoint_score", checkpoint_score_order="max")
        if scored else CheckpointConfig(num_to_keep=2),
        dataset_config=DataConfig(datasets_to_split=["train"], execution_options=ingest_options()),
    )
    best = best_checkpoint(run, store) if scored else None
    log(f"checkpoint: newest {result.checkpoint_uri}" + (f", best {best} ({read_best(run, store)})" if best else ""))
    test_metrics = None
    if recipe.data.test:
        chosen = best or result.checkpoint_uri
        test_metrics = score_split(chosen, recipe, recipe.data.test, store)
        log(f"test: {test_metrics} ({chosen})")
    best_record = read_best(run, store) if scored else None
    registered = record_run(  # MLflow run + model version; raises RegistrationError (the checkpoint stays)
        kind="finetune", recipe=recipe, checkpoint=best or result.checkpoint_uri, metrics=result.metrics, history=result.history,
        run_uri=run, shards=_split_files(recipe), family=family, store=store, parent=parent, log=log,
        eval_metrics={**{k: v for k, v in result.metrics.items() if k.startswith("val_")},
                      **({f"best_{best_record['metric']}": best_record["value"]} if best_record else {}),
                      **{f"test_{k}": v for k, v in (test_metrics or {}).items()}},
        extra_tags={"ctx.task": recipe.task.kind, "ctx.init": init_uri, **({"ctx.labels": json.dumps(list(labels))} if labels else {})},
    )
    return FinetuneResult(run, best, result.checkpoint_uri, result.metrics, best_record, test_metrics, report, result.history, registered)


def retrieval_rows(recipe: FinetuneRecipe, files: dict[str, bytes], store: storage.Store, log=print) -> dict[str, Any]:
    """The run's retrieval benchmark (``data.validation_retrieval``, the BEIR layout ``ctx eval retrieval``
    reads) as the workers score it: ``rows`` (N, 1, task.max_len), the queries then the corpus, each
    text encoded as the training texts are; ``n_queries``; ``relevant`` per query, corpus row -> grade."""
    from pipelines.dataset import tokenizer_from_files
    from pipelines.finetune import encode_text_rows
    from pipelines.retrieval import read_beir

    uri, split = recipe.data.validation_retrieval, recipe.data.validation_retrieval_split
    bench = read_beir(uri, split, store)
    input_ids, attention_mask, cut = encode_text_rows([*bench.queries, *bench.corpus], tokenizer_from_files(files), recipe.task.max_len)
    log(f"data: retrieval benchmark {uri} ({split}): {len(bench.queries):,} queries, {len(bench.corpus):,} documents, "
        f"{int(cut.sum()):,} texts cut to task.max_len={recipe.task.max_len}")
    rows = {"input_ids": input_ids[:, None], "attention_mask": attention_mask[:, None], "token_type_ids": np.zeros_like(input_ids)[:, None]}
    return {"rows": rows, "n_queries": len(bench.queries), "relevant": bench.relevant}


def _split_files(recipe: FinetuneRecipe) -> list[str]:
    """The files of the train, validation and test splits and of the retrieval benchmark (what the model
    was trained and chosen on)."""
    uris = [u for split in (recipe.data.train, recipe.data.validation, recipe.data.validation_retrieval, recipe.data.test) if split
            for u in ([split] if isinstance(split, str) else split)]
    return storage.Store.of(recipe.data).list_files(uris, suffixes=("",))


def _checked(fn, key: str, *args):
    """``fn(*args)``; a configuration problem it finds (a field no record has) becomes a
    RecipeError naming the split's key."""
    from jobs.training.config import RecipeError

    try:
        return fn(*args)
    except ValueError as e:
        raise RecipeError(f"{key}: {e}") from None


def score_split(checkpoint: str, recipe: FinetuneRecipe, split: str | list[str], store: storage.Store | str | None = None,
                details: dict[str, Any] | None = None, language: str | int | None = None, table=None) -> dict[str, float]:
    """A fine-tuned checkpoint's task metrics on a split, in this process (no Ray Train).
    ``details``, when given, receives ``logits``, ``rows`` (the encoded split) and ``labels`` (and
    ``language``, the name or row read). ``language``: a multilingual XLM reads the split as this
    language instead of its task's (cross-lingual transfer); ValueError for one it lacks.
    ``store``: the command's (``ctx eval --retry-deadline``, the recipe's), or an endpoint URL.
    ``table``: the split as ``pipelines.finetune_stream.read_split`` gave it, when the caller read it already."""
    import torch

    from ctxmodels.checkpoint import load_checkpoint
    from jobs.training import parallel
    from jobs.runs import local_copy
    from pipelines import finetune_stream as fs
    from pipelines.dataset import tokenizer_files

    store = storage.as_store(store)
    with tempfile.TemporaryDirectory(prefix="ctx-score-") as d:  # weights and tokenizer bytes are in memory after
        local = local_copy(checkpoint, Path(d), store)
        loaded = load_checkpoint(local)
        files = tokenizer_files(loaded.tokenizer_dir)
        if loaded.task is None and recipe.task.kind == "embedding":  # any model's sentence vectors, as served
            loaded = as_embedding_model(loaded, recipe, local)
            served = loaded.task.max_seq_length or getattr(loaded.config, "max_tokens", None) or getattr(loaded.config, "max_seq_len", None)
            if served and recipe.task.max_len > served:  # texts read no longer than the server reads them
                recipe = recipe.model_copy(update={"task": recipe.task.model_copy(update={"max_len": int(served)})})
    if loaded.task is None:
        raise ValueError(f"{checkpoint}: a pretrained model has no {recipe.task.kind} head to score; fine-tune it first "
                         "(ctx finetune), or score its sentence vectors on retrieval records (task kind embedding)")
    task = loaded.task
    if language is not None:
        from ctxmodels.tasks import language_row

        rows = loaded.config.type_vocab_size if loaded.family == "xlm" else 0
        task.language = loaded.model.task.language = language_row(task.languages, rows, language)  # the row its tokens read
    if details is not None and loaded.family == "xlm" and (task.languages or task.language):
        details["language"] = task.languages[task.language] if task.languages else task.language
    cfg = task_data_config(recipe, loaded.family, tuple(task.labels))
    if table is None:
        table = fs.read_split(split, recipe.data.format, store)
    check = fs.check_split(table, files, cfg)
    data = {"rows": fs.encode_split(table, check.usable, files, cfg), **fs.references(table, check.usable, cfg)}
    if details is not None:
        details.update(rows=data["rows"], labels=list(task.labels), records=table.num_rows, rejected=table.num_rows - len(check.usable))
    return validate(loaded.model, data, recipe, tuple(task.labels), parallel.ParallelPlan(), torch.device("cpu"), 0, 1, details)


def as_embedding_model(loaded, recipe: FinetuneRecipe, folder: Path):
    """A model without a task (pretrained, a Hugging Face or sentence-transformers folder) as the
    embedding model ``ctx serve`` makes of it: its backbone, pooled and normalised as its sentence
    settings say (else mean pooling, the last token in a left-to-right model), so ``score_split``
    gives its retrieval metrics before any fine-tuning (a zero-shot baseline; a scheduled round's
    production model)."""
    import dataclasses as dc

    import torch

    from ctxmodels.sbert import checkpoint_sentence_settings
    from ctxmodels.tasks import TaskConfig, build_task_model, load_backbone

    fields = sentence_fields(recipe, loaded.family, loaded.config, checkpoint_sentence_settings(folder))
    task = TaskConfig(**task_config_fields(recipe, loaded.family, (), sentence=fields))
    model = build_task_model(loaded.family, loaded.config, task, torch.Generator().manual_seed(0))
    load_backbone(model, loaded.model)
    return dc.replace(loaded, model=model.eval(), task=task)


# ---------------------------------------------------------------------------------------------
# Worker side.


def _pad_time(x: np.ndarray, length: int, fill: float) -> np.ndarray:
    """(B, t, ...) -> (B, length, ...) padded with ``fill`` (batches were trimmed to their rows)."""
    if x.shape[1] == length:
        return x
    pad = np.full((x.shape[0], length - x.shape[1], *x.shape[2:]), fill, dtype=x.dtype)
    return np.concatenate([x, pad], axis=1)


def _row_batches(rows: dict[str, np.ndarray], size: int, device) -> list[dict[str, Any]]:
    """Encoded rows as the model's batches of ``size``, each with its rows' places (``_rows``)."""
    import torch

    n = len(rows["input_ids"])
    batches = []
    for start in range(0, n, size):
        b = {k: torch.as_tensor(v[start : start + size]).to(device) for k, v in rows.items() if k in FORWARD_KEYS}
        b["_rows"] = torch.arange(start, min(start + size, n))
        b[TRIM_LENGTH] = trim_length(torch.as_tensor(rows["attention_mask"][start : start + size]), device)
        batches.append(b)
    return batches


def validate(model, data: dict[str, Any], recipe: FinetuneRecipe, labels: tuple[str, ...], plan, device, rank: int, world: int,
             details: dict[str, Any] | None = None) -> dict[str, float]:
    """``val_loss`` and the task's metrics (``val_accuracy``, ``val_f1``, ...) on encoded split
    rows, and an embedding run's retrieval benchmark's (``val_retrieval_ndcg_at_10``, ...); every
    worker scores a share and all gather the outputs, so all get the same numbers. ``details``, when
    given, receives the split's ``logits`` (in row order) for reports."""
    out = _split_metrics(model, data, recipe, labels, plan, device, rank, world, details) if data.get("rows") else {}
    if data.get("retrieval") is not None:
        out.update(_retrieval_metrics(model, data["retrieval"], recipe, plan, device, rank, world))
    return out


def _retrieval_metrics(model, bench: dict[str, Any], recipe: FinetuneRecipe, plan, device, rank: int, world: int) -> dict[str, float]:
    """``retrieval_rows``' benchmark scored as ``ctx eval retrieval`` scores it: every query's vector ranks
    the corpus's by cosine similarity, its top 100 against the judgements."""
    from pipelines.negatives import top_candidates
    from pipelines.retrieval import TOP_K, ranking_metrics

    got: list[tuple[np.ndarray, np.ndarray]] = []

    def forward(m, batch: dict[str, Any], counted: bool) -> None:
        vectors = m(**task_inputs(batch), with_loss=False).logits  # (B, 1, D)
        if counted:
            got.append((batch["_rows"].numpy(), vectors[:, 0].float().cpu().numpy()))

    evaluate_batches(model, _row_batches(bench["rows"], recipe.micro_batch_size, device), plan, device, rank, world, forward)
    parts = [x for part in all_gather(got, world) for x in part]
    order = np.concatenate([p[0] for p in parts])
    vectors = np.concatenate([p[1] for p in parts])[np.argsort(order, kind="stable")]  # (queries + corpus, D)
    q = bench["n_queries"]
    scores, top = top_candidates(vectors[:q], vectors[q:], TOP_K)
    return {f"val_retrieval_{k}": v for k, v in ranking_metrics(scores, top, bench["relevant"]).items()}


def _split_metrics(model, data: dict[str, Any], recipe: FinetuneRecipe, labels: tuple[str, ...], plan, device, rank: int, world: int,
                   details: dict[str, Any] | None = None) -> dict[str, float]:
    from pipelines.metrics import similarity_metrics, task_metrics
    from pipelines.qa import decode_qa

    rows = data["rows"]
    kind, max_len = recipe.task.kind, recipe.task.max_len
    n = len(rows.get("sample_id", ()))
    if n == 0:
        return {}
    batches = _row_batches(rows, recipe.micro_batch_size, device)
    got: list[tuple[np.ndarray, float, int, np.ndarray]] = []

    def forward(m, batch: dict[str, Any], counted: bool) -> None:
        out = m(**task_inputs(batch))
        if counted:
            logits = out.logits.float().cpu().numpy()
            if TASKS[kind].reads == "tokens":  # every batch's rows to max_len: -1e4 is never a span's start or end, and no tag is read there
                logits = _pad_time(logits, max_len, -1e4)
            got.append((batch["_rows"].numpy(), float(out.loss) if out.loss is not None else float("nan"), len(batch["_rows"]), logits))

    evaluate_batches(model, batches, plan, device, rank, world, forward)
    parts = [x for part in all_gather(got, world) for x in part]
    order = np.concatenate([p[0] for p in parts])
    logits = np.concatenate([p[3] for p in parts])[np.argsort(order, kind="stable")]
    loss = sum(p[1] * p[2] for p in parts) / max(sum(p[2] for p in parts), 1)
    if details is not None:
        details["logits"] = logits
    if kind == "question-answering":
        start, end = logits[..., 0], logits[..., 1]
        preds = decode_qa(start, end, {"example_index": rows["example_index"], "context_offsets": rows["context_offsets"]},
                          data["contexts"], recipe.task.max_answer_len, recipe.task.null_threshold if recipe.task.version_2 else None)
        records = np.unique(rows["example_index"])
        metrics = task_metrics(kind, [preds[i] for i in records], data["answers"], version_2=recipe.task.version_2)
    elif kind == "embedding":
        def measure(vectors: np.ndarray) -> dict[str, float]:  # scored pairs: each pair's cosine against its score;
            if recipe.task.scored_pairs:  # else the anchors retrieve among every positive and negative of the split
                return similarity_metrics(vectors, rows["labels"])
            return task_metrics(kind, vectors, rows["doc_ids"])

        metrics, main = measure(logits), recipe.task.metrics[0]
        for d in recipe.task.matryoshka_dims or []:  # and the main metric with each Matryoshka width's first dimensions
            if d < logits.shape[-1]:
                metrics[f"{main}_dim{d}"] = measure(logits[..., :d])[main]
    elif kind == "token-classification":
        word_ids = rows["word_ids"] if recipe.task.label_all_subtokens else None
        metrics = task_metrics(kind, logits, rows["labels"], label_names=list(labels), word_ids=word_ids)
    else:
        metrics = task_metrics(kind, logits, rows["labels"])
    return {"val_loss": loss, **{f"val_{k}": float(v) for k, v in metrics.items()}}


def finetune_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray seam: the loop Ray Train runs on every worker. The tokenizer's files (written into each
    checkpoint) live in a temporary folder for the attempt, removed when it ends."""
    from pipelines.dataset import tokenizer_dir_from_files

    with tempfile.TemporaryDirectory(prefix="ctx-tokenizer-") as d:
        run_worker(FinetuneJob(config, tokenizer_dir_from_files(config["tokenizer_files"], d)), config)


class FinetuneJob(WorkerJob):
    """Fine-tuning as the worker loop runs it: a task model (a fresh head on the pretrained backbone,
    or the fine-tuned model as it was), the task's padded rows, validation every epoch (and every
    ``train.eval_every``), the best checkpoint by the recipe's ``best_metric`` (``best.json``), early
    stopping after ``train.patience`` validations without a better one."""

    def __init__(self, config: dict[str, Any], tok_dir: Path) -> None:
        from ctxmodels.registry import config_from_dict
        from ctxmodels.tasks import TaskConfig

        self.config, self.tok_dir = config, tok_dir
        self.recipe = recipe = FinetuneRecipe.model_validate(config["recipe"])
        self.run, self.store = config["run_uri"], storage.Store.of(recipe.data)
        self.total_steps, self.warmup_steps = config["total_steps"], config["warmup_steps"]
        self.per_epoch = config["steps_per_epoch"]
        self.family, self.task = config["family"], TaskConfig(**config["task"])
        self.model_cfg = config_from_dict(self.family, config["model"])
        self.units = list(range(config["n_units"]))
        self.extra = {"recipe": config["recipe"], "task": config["task"]}
        self.metric = recipe.best_metric
        self.data: dict[str, Any] | None = None

    step_inputs = staticmethod(train_inputs)
    empty_stream = "the training stream is empty: no full micro-batch of train.micro_batch_size rows"

    def build_model(self, rank: int):
        import torch

        from ctxmodels.checkpoint import load_checkpoint
        from ctxmodels.tasks import build_task_model, load_backbone
        from jobs.runs import local_copy
        from jobs.training import parallel

        config, t = self.config, self.recipe.train
        # The task model: a fresh head on the pretrained backbone, then whatever the run committed last.
        model = build_task_model(self.family, self.model_cfg, self.task, generator=torch.Generator().manual_seed(t.seed))
        seed_worker_rng(t.seed, rank)  # dropout
        with tempfile.TemporaryDirectory(prefix="ctx-init-") as tmp:  # every worker, every restart: never left behind
            pretrained = load_checkpoint(local_copy(config["init_uri"], Path(tmp), self.store))
        if config.get("continue_head"):  # model.head: continue: the fine-tuned model as it was, head included
            result = model.load_state_dict(pretrained.model.state_dict(), strict=False)
            if result.missing_keys or result.unexpected_keys:
                raise ValueError(f"model.head: continue: {config['init_uri']}'s task model does not fit this recipe's (task.*, "
                                 f"model.features, model.task_model): missing {result.missing_keys[:5]}, "
                                 f"unexpected {result.unexpected_keys[:5]}")
        else:
            load_backbone(model, pretrained.model)
        del pretrained
        if (self.task.kind == "embedding" and not self.recipe.task.scored_pairs and self.recipe.task.gather_across_workers
                and parallel.world_size() > 1):
            model.gather = parallel.gather_rows  # every worker's texts as candidates (the process group is up)
        if self.family == "elmo":  # ELMo reads characters: the tokenizer's char table travels with the model
            model.set_char_table(elmo_char_table(self.tok_dir, self.model_cfg.max_chars))
        return model

    def cached_loss(self, model, accumulation: int):
        """An embedding step's in-batch negatives over all its micro-batches (``task.gradient_cache``). A
        pair loss takes each micro-batch's pairs alone, as sentence-transformers takes each device's."""
        if (self.task.kind != "embedding" or self.recipe.task.scored_pairs or self.recipe.task.gradient_cache is False
                or accumulation == 1):
            return None
        return model.texts_loss

    def resumed(self, resumed, rank: int) -> None:
        from jobs.runs import read_best, write_best

        state = resumed.state
        if rank == 0 and resumed.uri:
            print(f"resumed from {resumed.uri}: step {state.step}, data position {resumed.position.summary()}")
            best = read_best(self.run, self.store)
            if state.best_checkpoint and (best is None or best["checkpoint"] != state.best_checkpoint):
                # the run stopped between committing a new best and pointing best.json at it
                write_best(self.run, {"checkpoint": state.best_checkpoint, "metric": self.metric,
                                      "value": state.best_value, "step": state.best_step}, self.store)

    def batches(self, config: dict[str, Any], micro: int, device):
        import ray.train

        rows = ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=micro, drop_last=True)  # Ray seam
        # pinned, asynchronous copies on a GPU, each with its trim length found on the host
        return (to_device({**b, TRIM_LENGTH: trim_length(b["attention_mask"], device)}, device) for b in rows)

    def freeze_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return task_inputs(batch)

    def frozen_message(self, frozen: list[str]) -> str:
        return f"not reached by the {self.task.kind} loss (frozen): {len(frozen)} tensors, e.g. {', '.join(frozen[:3])}"

    def checkpointer_options(self) -> dict[str, Any]:
        from ctxmodels.tasks import build_task_model

        return dict(save=partial(_save, family=self.family, model_cfg=self.model_cfg, task=self.task, tok_dir=self.tok_dir),
                    fresh_model=lambda: build_task_model(self.family, self.model_cfg, self.task))

    def held_out(self, micro: int, device) -> bool:
        import ray

        self.data = ray.get(self.config["validation"]) if self.config.get("validation") is not None else None
        return self.data is not None

    def trainable_depths(self, step: int) -> int | None:
        return 1 + step // self.per_epoch  # ULMFiT: one more layer depth thawed each epoch, the head first

    def evaluation_due(self, step: int) -> bool:
        every = self.recipe.train.eval_every
        return step % self.per_epoch == 0 or (every is not None and step % every == 0)

    def checkpoint_due(self, step: int, evaluated: bool) -> bool:
        every = self.recipe.train.checkpoint_every
        return evaluated or (every is not None and step % every == 0) or (self.data is None and step % self.per_epoch == 0)

    def evaluate(self, wrapped, metrics, state, plan, device, rank: int, world: int) -> bool:
        metrics.update(validate(wrapped, self.data, self.recipe, tuple(self.task.labels), plan, device, rank, world))
        improved = state.observe(score_of(self.metric, metrics))
        # Ray keeps checkpoints by this score (and the newest): only a new best scores, so an equal
        # later score never rotates the first best away; the kept best is what best.json names.
        metrics["checkpoint_score"] = score_of(self.metric, metrics) if improved else NOT_BEST
        return improved

    def unscored(self, metrics: dict[str, Any]) -> None:
        if self.data is not None:
            metrics["checkpoint_score"] = NOT_BEST  # Ray keeps checkpoints by score: unscored ones go first

    def commit(self, checkpointer, state, wrapped, optimizer, metrics: dict[str, Any], improved: bool, rank: int) -> None:
        from jobs.runs import write_best

        name = checkpoint_name()
        if improved:
            state.best_checkpoint, state.best_value = name, metrics.get(f"val_{self.metric}")
        checkpointer.commit(state, wrapped, optimizer, metrics, self.extra, name=name)
        if improved and rank == 0:
            write_best(self.run, {"checkpoint": name, "metric": self.metric, "value": metrics.get(f"val_{self.metric}"),
                                  "step": state.step}, self.store)

    def stop_after_evaluation(self, state, rank: int) -> bool:
        patience = self.recipe.train.patience
        if patience is None or state.evals_since_best < patience:
            return False
        if rank == 0:
            print(f"early stop at step {state.step}: {patience} validations without a better {self.metric} "
                  f"(best {state.best_value} at step {state.best_step})")
        return True


def _save(folder: str, model, extra_json: dict[str, Any], extra_tensors: dict[str, Any], *, family: str, model_cfg, task, tok_dir: Path) -> None:
    from ctxmodels.checkpoint import save_checkpoint
    from jobs.registry import MLMODEL, mlmodel_text

    save_checkpoint(folder, model, family, model_cfg, tokenizer_dir=tok_dir, extra_json=extra_json, extra_tensors=extra_tensors, task=task,
                    extra_text={MLMODEL: mlmodel_text(family, task.kind)})  # an MLflow model too (jobs/serving/pyfunc.py)


def elmo_char_table(tok_dir: Path, max_chars: int):
    """(V, max_chars) int64 character ids of every token of the tokenizer, as ELMo's task model reads them."""
    import torch

    from pipelines.char_ids import build_char_table
    from pipelines.tokenizers import ROLES, load_tokenizer

    tok = load_tokenizer(tok_dir)
    tokens = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    special = {role: getattr(tok, f"{role}_id") for role in ROLES}
    return torch.from_numpy(build_char_table(tokens, max_chars, special).astype("int64"))
