"""``ctx schedule``: scheduled retraining with a gate (configs/schedule/, jobs/operations/schedule_config.py).

A round (``run_round``, the same function for ``--once`` in the calling process and inside the
detached scheduler actor):

1. continues pretraining (``train.kind: pretrain``) or fine-tuning (``finetune``) from the
   registered model's ``@production`` version (``model.init``) on the files new under
   ``trigger.watch`` since the last round (or the recipe's data on a cron round without a watch);
   for a fine-tuning round the new files (JSONL/Parquet/... records of the task) are its
   ``data.train``; its validation split still picks the best checkpoint;
2. scores candidate and production on the same held-out data (pretraining: masked-token accuracy
   and perplexity, the same masks for both; fine-tuning: the task metrics of ``score_split`` on the
   same labelled split), optionally the word-in-context test, and measures how far
   the embedding space moved: overlap of each probe text's k nearest neighbours and linear CKA
   (``pipelines/drift.py``) of vectors computed by the server's own pooling code;
3. registers the candidate (MLflow, ``jobs/registry.py``) with its metrics, decisions and parent,
   and promotes it only if every gate passes;
4. redeploys the Serve app under the same name with the new checkpoint (Serve rolls the replicas);
5. optionally re-embeds stored texts with the new version (``jobs/serving/embed.py``), beside the old ones.

A failed or gated-out round leaves ``@production`` and the app untouched; every round, whatever
became of it, is a line of ``<state_uri>/rounds.jsonl`` (what ``ctx schedule status`` shows).
The scheduler is one detached actor per schedule (``ctx-schedule-<name>`` in namespace
``ctx-schedule``) running rounds one after another; a round that finds another one running (a
``--once`` beside the actor) refuses to start.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jobs.operations.schedule_config import DRIFT_METRICS, ScheduleConfig, Trigger, decide
from pipelines import storage

HISTORY = "rounds.jsonl"
SEEN = "seen_shards.json"
# A round whose "running" line is older than this is taken for dead (its process was killed).
STALE_ROUND_S = 24 * 3600
START_TIMEOUT_S = 120.0  # for the scheduler's actor to come up (a fresh worker process on a busy head)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------
# State: the history and the shards already trained on, under state_uri (local or s3://)


class ScheduleState:
    """``rounds.jsonl`` (one JSON object per round, rewritten whole: object stores cannot append)
    and ``seen_shards.json``. One writer at a time: rounds never overlap."""

    def __init__(self, state_uri: str, store: storage.Store | str | None = None):
        self.uri = state_uri
        self.store = store if isinstance(store, storage.Store) else storage.Store(store)
        self.fs, self.path = self.store.filesystem(state_uri)

    def _read(self, name: str) -> bytes | None:
        path = f"{self.path.rstrip('/')}/{name}"

        def read() -> bytes | None:
            try:
                with self.fs.open_input_stream(path) as f:
                    return f.read()
            except FileNotFoundError:
                return None

        return self.store.retry(read, f"read {storage.join(self.uri, name)}")

    def _write(self, name: str, data: bytes) -> None:
        path = f"{self.path.rstrip('/')}/{name}"
        if not storage.is_remote(self.uri):
            Path(self.path).mkdir(parents=True, exist_ok=True)

        def write() -> None:
            with self.fs.open_output_stream(path) as f:
                f.write(data)

        self.store.retry(write, f"write {storage.join(self.uri, name)}")

    def rounds(self) -> list[dict[str, Any]]:
        data = self._read(HISTORY)
        return [json.loads(line) for line in (data or b"").decode().splitlines() if line.strip()]

    def save_round(self, record: dict[str, Any]) -> None:
        """Add ``record``, or replace the line of the same round number."""
        rounds = [r for r in self.rounds() if r.get("round") != record["round"]] + [record]
        rounds.sort(key=lambda r: r["round"])
        self._write(HISTORY, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rounds).encode())

    def seen(self) -> list[str]:
        data = self._read(SEEN)
        return list(json.loads(data)) if data else []

    def add_seen(self, shards: list[str]) -> None:
        self._write(SEEN, json.dumps(sorted(set(self.seen()) | set(shards)), indent=1).encode())


def running_round(state: ScheduleState) -> dict[str, Any] | None:
    """The round in progress, if one is (a line still "running" that is not stale)."""
    return running_in(state.rounds(), time.time())


def running_in(rounds: list[dict[str, Any]], now: float) -> dict[str, Any] | None:
    for r in reversed(rounds):
        if r.get("status") == "running" and now - float(r.get("started_ts", 0)) < STALE_ROUND_S:
            return r
    return None


def retry_wait(rounds: list[dict[str, Any]], retry_after_s: float, now: float) -> float:
    """Seconds until new shards may start a round again: after a failed last round, what is left of
    ``retry_after_s`` since it started; else 0."""
    last = next((r for r in reversed(rounds) if r.get("status") not in ("skipped", "busy")), None)
    if last is None or last.get("status") != "failed":
        return 0.0
    return max(0.0, float(last.get("started_ts", 0)) + retry_after_s - now)


def new_shards(cfg: ScheduleConfig, state: ScheduleState) -> list[str]:
    """Shards under ``trigger.watch`` not trained on by an earlier round (none if the prefix is empty)."""
    seen = set(state.seen())
    return [s for s in watched_files(cfg) if s not in seen]


def watched_files(cfg: ScheduleConfig) -> list[str]:
    """Every shard (or, for fine-tuning rounds, split file) under ``trigger.watch``; none if the
    prefix is empty or there is no watch."""
    if cfg.trigger.watch is None:
        return []
    if cfg.train.kind == "finetune":  # task records: the formats a fine-tuning split is read in
        from pipelines.finetune_stream import SPLIT_SUFFIXES as suffixes
    else:
        suffixes = storage.corpus_suffixes(cfg.recipe["data"]["format"])
    try:
        return cfg.store.list_files(cfg.trigger.watch, suffixes=suffixes)
    except storage.StorageError as e:
        if "matches no" in str(e):  # an empty or not yet created prefix: nothing new
            return []
        raise


# ---------------------------------------------------------------------------------------------
# Evaluation of one version: held-out masked-LM metrics, WiC, probe vectors


def _local_checkpoint(uri: str, workdir: Path, store: storage.Store | str | None) -> Path:
    from jobs.runs import local_copy, resolve_checkpoint

    return local_copy(resolve_checkpoint(uri, store), workdir, store)


def held_out_metrics(checkpoint: Path, recipe, shards: list[str]) -> dict[str, float]:
    """eval_loss, eval_ppl, eval_acc (masked-token accuracy) ... of a checkpoint on ``shards``:
    the batches pretraining evaluates on (``jobs.training.train.eval_batches``, masks keyed by the data
    seed), so two versions with one tokenizer are scored on identical inputs and masks."""
    import torch

    from ctxmodels.checkpoint import load_checkpoint
    from jobs.training.parallel import ParallelPlan
    from jobs.training.train import eval_batches, evaluate
    from pipelines.objectives import objective

    loaded = load_checkpoint(checkpoint, verify_hashes=True)
    if loaded.tokenizer_dir is None:
        raise ValueError(f"{checkpoint}: no tokenizer folder; a round needs the version's own tokenizer")
    device = torch.device("cpu")
    batches = eval_batches(recipe, shards, loaded.tokenizer_dir, recipe.micro_batch_size, device)
    out = evaluate(loaded.model.to(device), batches, objective(recipe.data.objective), ParallelPlan(), device, 0, 1)
    return {k: float(v) for k, v in out.items() if k.startswith("eval_")}


def probe_vectors(checkpoint: Path, texts: list[str]) -> np.ndarray:
    """(n, D) mean-pooled last-layer vectors of ``texts``: what ``/v1/embeddings`` answers with
    ``"pooling": "mean", "normalize": false``, computed by the serving class itself in this process
    (``EmbeddingReplica.embed_now``: the replica's code without Serve's request batching, as bulk
    re-embedding uses it). Pooling, normalisation and prompt are fixed, not the model's defaults, so
    two versions are compared on the same footing even when one is a sentence-transformers folder."""
    from jobs.identity import checkpoint_version
    from jobs.serving.replica import EmbeddingReplica
    from jobs.serving.serve_config import Limits, ModelConfig

    model = EmbeddingReplica("probe", str(checkpoint), checkpoint_version(str(checkpoint)), ModelConfig(uri=str(checkpoint)), Limits())
    return np.stack(model.embed_now(texts, pooling="mean", normalize=False, prompt="", truncate=True)["embeddings"])


def probe_texts(cfg: ScheduleConfig) -> list[str]:
    """The probe texts: ``evaluate.probes`` (one a line) or the first distinct lines of the held-out shards."""
    from pipelines.sources import sample_text

    ev = cfg.evaluate
    if ev.probes:
        lines = cfg.store.read_bytes(ev.probes).decode("utf-8").splitlines()
    elif cfg.train.kind == "finetune":
        lines = split_texts(cfg)
    else:
        lines = sample_text(cfg.store.list_files(ev.held_out, storage.corpus_suffixes(cfg.recipe["data"]["format"])), 2_000_000, cfg.recipe["data"]["format"],
                            cfg.recipe["data"]["text_field"], cfg.store)
    texts: list[str] = []
    for line in lines:
        line = line.strip()
        if line and line not in texts:
            texts.append(line[:2000])  # a probe is a sentence or a paragraph, not a book
            if len(texts) == ev.n_probes:
                break
    if len(texts) < 3:
        raise ValueError(f"evaluate: found {len(texts)} probe texts in {ev.probes or ev.held_out}; the drift numbers need at least 3")
    return texts


def split_texts(cfg: ScheduleConfig) -> list[str]:
    """The texts of a fine-tuning round's held-out records, in order: the recipe's text field
    (else sentence1, text, sentence, question, the fields a task reads first), or a token list joined."""
    from pipelines.finetune_stream import read_split

    task, fmt = cfg.recipe["task"], cfg.recipe["data"]["format"]
    table = read_split(cfg.evaluate.held_out, fmt, cfg.store)
    fields = [f for f in (task.get("text_field"), "sentence1", "text", "sentence", "question") if f]
    out = []
    for raw in table.column("_json").to_pylist():
        record = json.loads(raw)
        value = next((record[f] for f in fields if isinstance(record.get(f), str)), None)
        if value is None and isinstance(record.get(task["tokens_field"]), list):
            value = " ".join(str(t) for t in record[task["tokens_field"]])
        if value:
            out.append(value)
    return out


def task_metrics_of(checkpoint: Path, recipe, split: str, store: storage.Store | str | None) -> dict[str, float]:
    """A fine-tuned checkpoint's task metrics on ``split`` (``jobs.training.finetune.score_split``: the
    validation code of ``ctx finetune``), named without the ``val_`` prefix: loss, accuracy, f1 ..."""
    from jobs.training.finetune import score_split

    return {k.removeprefix("val_"): float(v) for k, v in score_split(str(checkpoint), recipe, split, store).items()}


def evaluate_pair(cfg: ScheduleConfig, candidate: str, production: str, log=print) -> tuple[dict[str, float], dict[str, float]]:
    """(candidate metrics, production metrics) on the same held-out data; the drift of the
    candidate's space from production's is in the candidate's (production's own is 1). A
    fine-tuning round's drift is of the backbones (the serving embedding path), as pretraining's."""
    from jobs.training.config import Recipe
    from jobs.training.finetune_config import FinetuneRecipe
    from pipelines.drift import knn_overlap, linear_cka

    finetuning = cfg.train.kind == "finetune"
    if finetuning:
        recipe = FinetuneRecipe.model_validate(cfg.recipe)
        shards: list[str] = []
    else:
        recipe = Recipe.model_validate({**cfg.recipe, "data": {**cfg.recipe["data"], "eval_max_samples": cfg.evaluate.max_samples}})
        shards = cfg.store.list_files(cfg.evaluate.held_out, storage.corpus_suffixes(recipe.data.format))
    texts = probe_texts(cfg)
    work = Path(tempfile.mkdtemp(prefix="ctx-round-eval-"))
    try:
        out: dict[str, dict[str, float]] = {}
        vectors = {}
        for role, uri in (("candidate", candidate), ("production", production)):
            local = _local_checkpoint(uri, work / role, cfg.store)
            if finetuning:
                m = task_metrics_of(local, recipe, cfg.evaluate.held_out, cfg.store)
            else:
                m = held_out_metrics(local, recipe, shards)
            if cfg.evaluate.wic:
                from jobs.evaluation.wic import evaluate_wic

                m["wic_accuracy"] = float(evaluate_wic(str(local), cfg.evaluate.wic, strategies=("last",), store=cfg.store)["accuracy"])
            if cfg.evaluate.retrieval:
                from jobs.evaluation.retrieval import evaluate_retrieval

                scored = evaluate_retrieval(str(local), cfg.evaluate.retrieval, cfg.evaluate.retrieval_split, cfg.store)
                m.update({f"retrieval_{k}": float(v) for k, v in scored["metrics"].items()})
            vectors[role] = probe_vectors(local, texts)
            out[role] = m
            log(f"evaluate: {role} {uri}: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(m.items())))
        out["candidate"]["knn_overlap"] = knn_overlap(vectors["production"], vectors["candidate"], cfg.evaluate.k)
        out["candidate"]["cka"] = linear_cka(vectors["production"], vectors["candidate"])
        for name in DRIFT_METRICS:
            out["production"][name] = 1.0
        log(f"drift over {len(texts)} probes: knn_overlap@{min(cfg.evaluate.k, len(texts) - 1)}={out['candidate']['knn_overlap']:.3f}, "
            f"cka={out['candidate']['cka']:.3f}")
        return out["candidate"], out["production"]
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Serving: roll the app to a new checkpoint


def serve_config_with(app: dict[str, Any], model: str, uri: str):
    """The app's ServeConfig with ``model``, pinned or multiplexed, pointed at ``uri`` (everything
    else as it was)."""
    from jobs.serving.serve_config import validate

    multiplexed = app.get("multiplexed") or {}
    if model in (multiplexed.get("models") or {}):
        changed = {"multiplexed": {**multiplexed, "models": {**multiplexed["models"], model: uri}}}
    else:
        models = dict(app["models"])
        entry = models[model]
        changed = {"models": {**models, model: {**entry, "uri": uri} if isinstance(entry, dict) else uri}}
    return validate({**app, **changed}, where="schedule serve.config")


def roll_serve(app: dict[str, Any], model: str, uri: str) -> str | None:
    """Redeploy the running app under its name with ``model`` at ``uri``; returns the version the
    replicas now serve. Serve replaces the replicas whose arguments changed; requests wait in the
    handles' queues while a replica is replaced, and go to the new one (no failed request: the
    schedule's e2e test and tests/jobs/operations/test_schedule_roll.py). For a multiplexed model that is the
    MultiplexedModels deployment: its new replicas load each model again on its next request, the
    rolled one from ``uri``. Ray seam."""
    from ray import serve

    from jobs.identity import checkpoint_version
    from jobs.runs import resolve_checkpoint
    from jobs.serving import serve as ctx_serve

    config = serve_config_with(app, model, uri)
    application = ctx_serve.build_app(config)
    serve.run(application, name=config.app_name, route_prefix="/")  # blocks until the new replicas are healthy
    return checkpoint_version(resolve_checkpoint(uri))


# ---------------------------------------------------------------------------------------------
# The round


def _recipe_for_round(cfg: ScheduleConfig, n: int, init: str, shards: list[str]):
    from jobs.training.config import Recipe
    from jobs.training.finetune_config import FinetuneRecipe

    data = json.loads(json.dumps(cfg.recipe))
    data["name"] = f"{cfg.name}-round-{n:04d}"
    if cfg.train.output_dir:
        data["output_dir"] = cfg.train.output_dir
    # The round registers the candidate itself, once judged, with the gate's verdict and its parent;
    # the run registering its own checkpoint too would make two versions of one candidate.
    data["registry"] = {**(data.get("registry") or {}), "enabled": False}
    if cfg.train.kind == "finetune":
        data["model"] = {**data["model"], "init": init}
        if not any(o.startswith("model.head=") for o in cfg.train.set):  # continued, head and labels too, unless set
            data["model"]["head"] = "continue"
        if shards:
            data["data"]["train"] = shards
        # The round scores both versions on evaluate.held_out itself; the recipe's test split
        # would be one more pass over data nothing reads.
        data["data"]["test"] = None
        return FinetuneRecipe.model_validate(data)
    data["model"] = {"family": data["model"]["family"], "preset": data["model"]["preset"], "init": init}
    data["tokenizer"]["path"] = None  # the production version's own tokenizer (warm start)
    if shards:
        data["data"]["input"] = shards
    return Recipe.model_validate(data)


def _registry(cfg: ScheduleConfig):
    from jobs.registry import Registry

    return Registry(cfg.tracking_uri)


def run_round(cfg: ScheduleConfig, trigger: str = "manual", log: Callable[[str], None] = print,
              registry=None, train: Callable | None = None) -> dict[str, Any]:
    """One round, start to end; returns its record (also saved in the history). Never raises for
    a round that failed: the record says why (``status: failed``, ``error``)."""
    state = ScheduleState(cfg.state_uri, cfg.store)
    busy = running_round(state)
    if busy is not None:
        return {"status": "busy", "reason": f"round {busy['round']} is running since {busy['started']} on {busy.get('host')}"}
    shards = new_shards(cfg, state)
    if cfg.trigger.watch is not None and not shards and trigger == "watch":
        return {"status": "skipped", "reason": f"no new shards under {cfg.trigger.watch}"}
    past = state.rounds()
    n = (past[-1]["round"] + 1) if past else 1
    record: dict[str, Any] = {
        "round": n, "schedule": cfg.name, "model": cfg.model, "trigger": trigger, "status": "running",
        "started": _now(), "started_ts": time.time(), "host": f"{socket.gethostname()}:{os.getpid()}", "shards": shards,
    }
    if cfg.trigger.watch is not None and not shards:
        record.update(status="skipped", reason=f"no new shards under {cfg.trigger.watch}", finished=_now())
        state.save_round(record)
        return record
    state.save_round(record)
    log(f"round {n} ({trigger}): {len(shards)} new shard(s)" if shards else f"round {n} ({trigger}): the recipe's data")
    try:
        registry = registry or _registry(cfg)
        production = registry.get(f"{cfg.model}@production")
        record["production"] = {"version": production.version, "source": production.source}
        # train.data_from: the new shards only, or everything under the watch (new shards still start the round)
        data = shards if cfg.train.data_from == "new" else watched_files(cfg)
        record["trained_on"] = len(data)
        recipe = _recipe_for_round(cfg, n, production.source, data)
        result = (train or (_finetune if cfg.train.kind == "finetune" else _pretrain))(recipe, log)
        # a fine-tuning run's candidate is its best checkpoint by task.metric on its validation split
        chosen = getattr(result, "best_checkpoint", None) or result.checkpoint_uri
        if not chosen:
            raise RuntimeError(f"training run {result.run_uri} committed no checkpoint")
        record["run"] = result.run_uri
        cand_m, prod_m = evaluate_pair(cfg, chosen, production.source, log)
        record["metrics"] = {"candidate": cand_m, "production": prod_m}
        promote, gates = decide(cfg.gates, cand_m, prod_m)
        record["gates"] = [{"metric": g.metric, "passed": g.passed, "reason": g.reason} for g in gates]
        tags = {"schedule": cfg.name, "round": str(n), "gate": "passed" if promote else "failed",
                **{f"metric.{k}": f"{v:.6g}" for k, v in cand_m.items()}}
        version = registry.register(cfg.model, chosen, tags=tags, parent=production)
        record["candidate"] = {"version": version.version, "source": version.source}
        if not promote:
            failed = [g.reason for g in gates if not g.passed]
            record.update(status="gated", reason="gate failed: " + "; ".join(failed))
            log(f"round {n}: version {version.version} registered, not promoted: {'; '.join(failed)}")
            state.add_seen(shards)  # judged: the next round waits for newer data
            return record
        registry.promote(cfg.model, version.version, "production")
        record.update(status="promoted", reason=f"every gate passed; version {version.version} is production")
        log(f"round {n}: version {version.version} promoted to production")
        state.add_seen(shards)
        if cfg.serve is not None:
            try:
                record["served"] = roll_serve(cfg.serve.app, cfg.serve.model, version.source)
                log(f"round {n}: Serve app {cfg.serve.app['app_name']} serves {record['served']}")
            except Exception as e:  # production moved; the app could not follow: say so loudly, keep the record
                record["serve_error"] = f"{type(e).__name__}: {e}"
                log(f"round {n}: rolling the Serve app failed: {e}")
        if cfg.reembed is not None:
            record["reembed"] = reembed(cfg, version)
        return record
    except Exception as e:
        record.update(status="failed", reason=f"{type(e).__name__}: {e}", error=traceback.format_exc(limit=8))
        log(f"round {n} failed: {type(e).__name__}: {e}")
        return record
    finally:
        record["finished"] = _now()
        state.save_round(record)


def _pretrain(recipe, log):
    from jobs.training.train import pretrain

    return pretrain(recipe, progress=False, log=log)


def _finetune(recipe, log):
    from jobs.training.finetune import finetune

    return finetune(recipe, progress=False, log=log)


def reembed(cfg: ScheduleConfig, version) -> dict[str, Any]:
    """Recompute the stored embeddings with the new version, written beside the old ones under
    ``<reembed.output>/v<version>/`` (never over them), with ``jobs.serving.embed.reembed`` (Ray Data).
    The version's folder is resumed: a round retried after its re-embedding stopped midway embeds only
    the rows that folder lacks, and one that finished is left as it is."""
    r = cfg.reembed
    output = storage.join(r.output, f"v{version.version}")
    try:
        from jobs.serving.embed import reembed as bulk
    except ImportError:
        return {"status": "skipped", "reason": "jobs.serving.embed (ctx embed) is not installed in this checkout"}
    try:
        out = bulk(version.source, r.input, output, id_column=r.id_column, text_column=r.text_column,
                   pooling=r.pooling, normalize=r.normalize, dimensions=r.dimensions, prompt_name=r.prompt_name,
                   precision=r.precision, calibration_rows=r.calibration_rows, store=cfg.store, resume=True)
        return {"status": "done", "output": output, **{k: v for k, v in (out or {}).items() if isinstance(v, (int, float, str))}}
    except Exception as e:
        return {"status": "failed", "output": output, "reason": f"{type(e).__name__}: {e}"}


# ---------------------------------------------------------------------------------------------
# The detached scheduler


def next_cron(expr: str, after: float) -> float:
    """The first time of ``expr`` strictly after ``after`` (epoch seconds), read in UTC."""
    from croniter import croniter

    return float(croniter(expr, datetime.fromtimestamp(after, timezone.utc)).get_next(float))


@dataclass(frozen=True)
class NextStep:
    """What the scheduler loop does now: start a round (``trigger``) or not, the cron time it waits
    for next (carried to the next decision), and how long it sleeps before deciding again."""

    trigger: str | None  # "cron", "watch" or None
    cron_due: float | None
    wait_s: float
    why: str  # for the log and the tests: what was decided, in words


def next_step(trigger: Trigger, now: float, cron_due: float | None, rounds: list[dict[str, Any]],
              has_new_shards: Callable[[], bool]) -> NextStep:
    """When is the next round due: the scheduler loop's one decision, a pure function of the time.

    * cron (UTC): the first decision only sets ``cron_due`` (no catch-up of ticks before the
      scheduler started); once ``now`` reaches it a "cron" round starts and ``cron_due`` moves to
      the next tick after ``now`` (ticks missed meanwhile make no extra rounds);
    * rounds never overlap: while a round runs (a fresh "running" line in ``rounds``, from this loop
      or a ``--once`` elsewhere) nothing starts and a cron tick that falls meanwhile stays due:
      it runs once, right after that round ends (however many ticks it covered);
    * watch: new files under ``trigger.watch`` (``has_new_shards``, asked only when it matters)
      start a "watch" round, but after a failed round only once ``retry_after_s`` has passed;
    * the loop sleeps until the cron time or the next poll, whichever comes first (at most poll_s).
    """
    if trigger.cron is not None and cron_due is None:
        cron_due = next_cron(trigger.cron, now)
    wait = trigger.poll_s if cron_due is None else max(0.0, min(trigger.poll_s, cron_due - now))
    busy = running_in(rounds, now)
    if busy is not None:
        return NextStep(None, cron_due, trigger.poll_s, f"round {busy['round']} is running; nothing starts beside it")
    if cron_due is not None and now >= cron_due:
        return NextStep("cron", next_cron(trigger.cron, now), 0.0, f"cron tick {datetime.fromtimestamp(cron_due, timezone.utc).isoformat()} is due")
    if trigger.watch is not None:
        retry = retry_wait(rounds, trigger.retry_after_s, now)
        if retry > 0:
            return NextStep(None, cron_due, min(wait, retry), f"the last round failed: new files start one in {retry:.0f} s")
        if has_new_shards():
            return NextStep("watch", cron_due, 0.0, f"new files under {trigger.watch}")
    return NextStep(None, cron_due, wait, "nothing due")


class Scheduler:
    """The loop of one schedule, in a detached actor: waits for the next cron time or for new shards
    under the watched prefix, and runs rounds one after another in one thread (they never overlap).
    ``status()`` and ``stop()`` are answered while a round runs (the actor has two threads)."""

    def __init__(self, config: dict[str, Any]):
        self.cfg = ScheduleConfig.model_validate(config)
        self._stop = threading.Event()
        self.current: dict[str, Any] | None = None
        self.log_lines: list[str] = []
        self.started = _now()
        self._thread = threading.Thread(target=self._loop, name=f"schedule-{self.cfg.name}", daemon=True)
        self._thread.start()

    def _log(self, line: str) -> None:
        line = f"{_now()} {line}"
        print(line, flush=True)
        self.log_lines = (self.log_lines + [line])[-200:]

    def _loop(self) -> None:
        cfg = self.cfg
        cron_due: float | None = None
        state = ScheduleState(cfg.state_uri, cfg.store)
        while not self._stop.is_set():
            wait = cfg.trigger.poll_s
            try:
                step = next_step(cfg.trigger, time.time(), cron_due, state.rounds(), lambda: bool(new_shards(cfg, state)))
                cron_due, wait = step.cron_due, step.wait_s
                if step.trigger:
                    self.current = {"trigger": step.trigger, "since": _now()}
                    self._log(f"scheduler: {step.why}")
                    record = run_round(cfg, step.trigger, log=self._log)
                    self._log(f"round: {record.get('status')}: {record.get('reason', '')}")
            except Exception as e:  # reading the state or listing the prefix failed (storage down): next poll
                self._log(f"scheduler: {type(e).__name__}: {e}")
            finally:
                self.current = None
            self._stop.wait(wait)

    def status(self) -> dict[str, Any]:
        return {"name": self.cfg.name, "started": self.started, "running": self.current,
                "alive": self._thread.is_alive(), "log": self.log_lines[-20:]}

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop after the current round (a round in progress finishes); True if the loop has ended."""
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def _connect(address: str | None) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace="ctx-schedule",
                 log_to_driver=False, logging_level="ERROR")


def start(cfg: ScheduleConfig, address: str | None = None):
    """The schedule's detached actor (started if it is not running): one per name on a cluster."""
    import ray

    _connect(address)
    actor_cls = ray.remote(Scheduler).options(
        name=cfg.actor_name, namespace=cfg.namespace, lifetime="detached", get_if_exists=True,
        max_concurrency=2,  # the loop's thread runs rounds; status/stop are answered beside it
        num_cpus=0,  # it waits; the rounds' Ray Train workers take the CPUs
        # Rounds run pretrain(), a Ray Train driver: it inherits the cluster's environment
        runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "MLFLOW_"))}},
    )
    actor = actor_cls.remote(cfg.model_dump(mode="json"))
    # Wait until the actor has run __init__ (or was already running): `ctx schedule` says it runs
    # only once it does, and an actor that cannot start is reported here, not discovered later.
    try:
        ray.get(actor.status.remote(), timeout=START_TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as e:
        raise RuntimeError(f"the scheduler {cfg.actor_name} did not start within {START_TIMEOUT_S:.0f} s: {e}") from e
    return actor


def _actor(cfg: ScheduleConfig, address: str | None):
    import ray

    _connect(address)
    try:
        return ray.get_actor(cfg.actor_name, namespace=cfg.namespace)
    except ValueError:
        return None


def stop(cfg: ScheduleConfig, address: str | None = None) -> bool:
    """Stop and remove the schedule's actor (after the round it runs, if any); False if none ran."""
    import ray

    actor = _actor(cfg, address)
    if actor is None:
        return False
    try:
        ray.get(actor.stop.remote(timeout_s=30.0), timeout=60)
    finally:
        ray.kill(actor)
    return True


def status(cfg: ScheduleConfig, address: str | None = None, with_actor: bool = True) -> dict[str, Any]:
    """The history (from state_uri: readable from any client) and, if reachable, the actor's state."""
    out: dict[str, Any] = {"schedule": cfg.name, "rounds": ScheduleState(cfg.state_uri, cfg.store).rounds()}
    if with_actor:
        try:
            import ray

            actor = _actor(cfg, address)
            out["scheduler"] = ray.get(actor.status.remote(), timeout=30) if actor is not None else None
        except Exception as e:  # no cluster reachable: the history is still worth showing
            out["scheduler"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def format_status(out: dict[str, Any]) -> str:
    lines = [f"schedule {out['schedule']}"]
    sched = out.get("scheduler", "not asked")
    if sched == "not asked":
        pass
    elif sched is None:
        lines.append("scheduler: not running")
    elif "error" in sched:
        lines.append(f"scheduler: unknown ({sched['error']})")
    else:
        lines.append(f"scheduler: running since {sched['started']}" + (f", round in progress ({sched['running']['trigger']})" if sched.get("running") else ", idle"))
    if not out["rounds"]:
        lines.append("no rounds yet")
    for r in out["rounds"]:
        prod, cand = r.get("production", {}), r.get("candidate", {})
        lines.append(f"round {r['round']} {r['started']} {r['trigger']}: {r['status'].upper()}"
                     + (f" v{cand['version']}" if cand else "") + (f" (production was v{prod['version']})" if prod else ""))
        if r.get("reason"):
            lines.append(f"  why: {r['reason']}")
        m = r.get("metrics")
        if m:
            for k in sorted(m["candidate"]):
                p = m["production"].get(k)
                lines.append(f"  {k}: {m['candidate'][k]:.4g}" + (f" (production {p:.4g})" if p is not None else ""))
        if r.get("served"):
            lines.append(f"  serving: {r['served']}")
        if r.get("serve_error"):
            lines.append(f"  serving NOT rolled: {r['serve_error']}")
    return "\n".join(lines)
