"""Scheduled retraining: the schedule's config and its gate. Typed, validated on load; every error
names the file and the key. Nothing here imports Ray or torch.

    # configs/schedule/bert-tiny.yaml
    name: bert-nightly               # the scheduler actor's name, the round folders, the history
    model: bert-tiny                 # the registered model (MLflow) whose @production is retrained
    state_uri: s3://runs/schedules/bert-nightly   # rounds.jsonl (the history) and the shards seen
    retry_deadline_s: 300            # the scheduler's own object-store waits (its runs: their recipe's)
    trigger:
      cron: "0 3 * * *"              # and/or
      watch: s3://corpora/wiki/new/  # a round starts when new shards appear under this prefix
      poll_s: 60
    train:
      kind: pretrain                 # or finetune: a configs/finetune/ recipe, task metrics as gates
      recipe: configs/bert-tiny.yaml # continued from @production (model.init) on the new shards
      set: [train.max_steps=1000]
      output_dir: s3://runs/schedules/bert-nightly/rounds
    evaluate:
      held_out: s3://corpora/wiki/heldout/   # the same data for candidate and production
      # retrieval: s3://benchmarks/scifact/  # optional: a BEIR folder, gates retrieval_ndcg_at_10, ...
    gates:                                   # every gate must pass for the candidate to be promoted
      eval_acc: {threshold: 0.10, min_absolute_change: -0.01}
      eval_ppl: {greater_is_better: false, min_relative_change: -0.05}
      cka: {threshold: 0.5}
    serve:                                   # optional: roll this Serve app to the new version
      config: configs/serve/bert.yaml
      model: bert
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jobs.serving.precision import CALIBRATION_ROWS
from pipelines.retrieval import RETRIEVAL_METRICS
from pipelines.storage import DEFAULT_RETRY_DEADLINE_S

# What a round measures, by train.kind; a gate on anything else is refused on load. Lower is
# better for these; the rest are better higher.
PRETRAIN_METRICS = ("eval_loss", "eval_ppl", "eval_acc", "knn_overlap", "cka", "wic_accuracy")
LOWER_IS_BETTER = ("eval_loss", "eval_ppl", "loss")
# Drift is measured between candidate and production: production's own value is 1 by definition.
DRIFT_METRICS = ("knn_overlap", "cka")
# With evaluate.retrieval: both versions' sentence vectors on a BEIR benchmark (ctx eval retrieval).
RETRIEVAL_GATES = tuple(f"retrieval_{m}" for m in RETRIEVAL_METRICS)


def round_metrics(kind: str, recipe: dict[str, Any]) -> tuple[str, ...]:
    """The metrics a round of ``train.kind`` measures (what its gates may name). A fine-tuning
    round reports what ``jobs.training.finetune.score_split`` gives for the recipe's task kind, without the
    ``val_`` prefix (classification: loss, accuracy, f1, mcc), plus the drift of the backbones."""
    if kind == "pretrain":
        return (*PRETRAIN_METRICS, *RETRIEVAL_GATES)
    from ctxmodels.task_kinds import validation_metrics

    task = recipe.get("task") or {}
    return ("loss", *validation_metrics(task.get("kind", "classification"), task.get("loss")), *DRIFT_METRICS, "wic_accuracy",
            *RETRIEVAL_GATES)


class ScheduleError(ValueError):
    """A schedule config that cannot run; the message names the file and key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class MetricGate(_Section):
    """One metric's gate, as MLflow's ``MetricThreshold``: the candidate's value must reach
    ``threshold``; and it must beat production's by ``min_absolute_change`` and by
    ``min_relative_change`` (a fraction of production's value). "Beat" follows
    ``greater_is_better``. A negative change is a tolerance: -0.01 lets the metric fall by 0.01."""

    threshold: float | None = None
    min_absolute_change: float | None = None
    min_relative_change: float | None = None
    greater_is_better: bool | None = None  # None: by the metric's name (loss and perplexity: lower)

    @field_validator("threshold", "min_absolute_change", "min_relative_change", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @model_validator(mode="after")
    def _something(self) -> "MetricGate":
        if self.threshold is None and self.min_absolute_change is None and self.min_relative_change is None:
            raise ValueError("give at least one of threshold, min_absolute_change, min_relative_change")
        return self


@dataclass(frozen=True)
class GateResult:
    metric: str
    passed: bool
    reason: str  # what was compared, in words, passed or not


def better_is_greater(metric: str, gate: MetricGate) -> bool:
    return gate.greater_is_better if gate.greater_is_better is not None else metric not in LOWER_IS_BETTER


def check_gate(metric: str, gate: MetricGate, candidate: float | None, production: float | None) -> GateResult:
    """One gate: candidate (and production's value of the same metric on the same data) -> result."""
    if candidate is None or not math.isfinite(candidate):
        return GateResult(metric, False, f"{metric}: not measured for the candidate ({candidate})")
    up = better_is_greater(metric, gate)
    sign, word = (1.0, ">=") if up else (-1.0, "<=")
    fails: list[str] = []
    oks: list[str] = []
    if gate.threshold is not None:
        ok = sign * (candidate - gate.threshold) >= 0
        (oks if ok else fails).append(f"{candidate:.6g} {word} threshold {gate.threshold:g}")
    if gate.min_absolute_change is not None or gate.min_relative_change is not None:
        if production is None or not math.isfinite(production):
            fails.append(f"no production value to compare with ({production})")
        else:
            gain = sign * (candidate - production)  # > 0: the candidate is better
            if gate.min_absolute_change is not None:
                ok = gain >= gate.min_absolute_change
                (oks if ok else fails).append(
                    f"change {gain:+.6g} vs production {production:.6g} {'>=' if ok else '<'} min_absolute_change {gate.min_absolute_change:g}")
            if gate.min_relative_change is not None:
                rel = gain / abs(production) if production != 0 else (math.inf if gain > 0 else -math.inf if gain < 0 else 0.0)
                ok = rel >= gate.min_relative_change
                (oks if ok else fails).append(
                    f"relative change {rel:+.4g} vs production {production:.6g} {'>=' if ok else '<'} min_relative_change {gate.min_relative_change:g}")
    if fails:
        return GateResult(metric, False, f"{metric}: " + "; ".join(fails))
    return GateResult(metric, True, f"{metric}: " + "; ".join(oks))


def decide(gates: dict[str, MetricGate], candidate: dict[str, float], production: dict[str, float]) -> tuple[bool, list[GateResult]]:
    """(promote?, every gate's result): promote only when every gate passes (no gates: promote)."""
    results = [check_gate(m, g, candidate.get(m), production.get(m)) for m, g in gates.items()]
    return all(r.passed for r in results), results


# ---------------------------------------------------------------------------------------------
# The schedule


class Trigger(_Section):
    cron: str | None = None  # a cron expression (croniter), in UTC
    watch: str | None = None  # a prefix whose new shards start a round (pipelines.storage.Store.list_files)
    poll_s: float = Field(60.0, gt=0)  # how often the prefix is listed
    # After a failed round its shards are still new: wait this long before the prefix starts another
    # round, so a shard that always fails does not restart training at every poll.
    retry_after_s: float = Field(3600.0, ge=0)

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from croniter import croniter

        if not croniter.is_valid(v):
            raise ValueError(f"cron: {v!r} is not a cron expression (e.g. '0 3 * * *': 03:00 UTC daily)")
        return v

    @model_validator(mode="after")
    def _one(self) -> "Trigger":
        if self.cron is None and self.watch is None:
            raise ValueError("give cron, watch or both: what starts a round")
        return self


class TrainStep(_Section):
    # pretrain: continued pretraining (configs/*.yaml); finetune: continued fine-tuning of a
    # fine-tuned production version (configs/finetune/*.yaml), new split files as its data.train
    kind: Literal["pretrain", "finetune"] = "pretrain"
    recipe: str  # the recipe YAML; its model.init is set to the production checkpoint each round
    set: list[str] = []  # --set overrides, e.g. train.max_steps=100
    output_dir: str | None = None  # where round runs go (default: the recipe's output_dir)
    data_from: Literal["new", "all"] = "new"  # train on the shards new since the last round, or all under watch

    @field_validator("set", mode="before")
    @classmethod
    def _list(cls, v: Any) -> Any:
        return [] if v is None else v


class EvaluateStep(_Section):
    # pretrain: shards both versions are scored on (masked-token accuracy, perplexity);
    # finetune: a labelled split of the recipe's task (JSONL/Parquet/...) scored with its task metrics
    held_out: str
    max_samples: int = Field(256, ge=1)  # pretrain only: held-out samples scored (a finetune round scores the whole split)
    probes: str | None = None  # a text file of probe texts, one a line (default: lines of held_out; finetune: its records' texts)
    n_probes: int = Field(200, ge=3)
    k: int = Field(10, ge=1)  # the k of the neighbour overlap
    wic: str | None = None  # a WiC folder (validation.jsonl, test.jsonl): ctx eval wic on both versions
    # A retrieval benchmark in the BEIR layout (corpus.jsonl, queries.jsonl, qrels/<split>.tsv): ctx eval
    # retrieval on both versions' sentence vectors, as retrieval_ndcg_at_10, retrieval_recall_at_10, ...
    retrieval: str | None = None
    retrieval_split: str = "test"


class ServeStep(_Section):
    config: str  # the serve.yaml the app runs with; read when the schedule loads
    model: str  # the model of that app that rolls to each promoted version
    app: dict[str, Any] = {}  # filled on load: the serve config as validated, so the actor needs no file


class ReembedStep(_Section):
    input: str  # ids and texts: Parquet, JSON lines or CSV, as ctx embed --input
    output: str  # versions are written beside each other: <output>/v<version>/
    id_column: str = "id"
    text_column: str = "text"
    # as ctx embed's: None is the model's own (a sentence-transformers folder's pooling and Normalize module,
    # the pooling an embedding task was fine-tuned with), what the served model answers by default
    pooling: Literal["mean", "cls", "last"] | None = None
    normalize: bool | None = None
    dimensions: int | None = Field(None, ge=1)  # the first N components (Matryoshka)
    prompt_name: str | None = None  # the folder's prompt put before every text ("document")
    # the stored vectors' (ctx embed --precision): int8/uint8 levels in ranges from calibration_rows rows, binary sign bits
    precision: Literal["float32", "int8", "uint8", "binary", "ubinary"] = "float32"
    calibration_rows: int = Field(CALIBRATION_ROWS, ge=2)


class ScheduleConfig(_Section):
    name: str
    model: str  # registered model name
    tracking_uri: str | None = None  # MLflow; default $MLFLOW_TRACKING_URI or the registry's default
    state_uri: str
    namespace: str = "ctx-schedule"  # Ray namespace of the detached actor
    endpoint_url: str | None = None  # S3-compatible endpoint (default AWS_ENDPOINT_URL)
    # how long one object-store call of the scheduler (watching, state, evaluation, re-embedding)
    # retries through an outage before the round fails; the rounds' runs take their recipe's
    retry_deadline_s: float = Field(DEFAULT_RETRY_DEADLINE_S, ge=1)
    trigger: Trigger
    train: TrainStep
    evaluate: EvaluateStep
    gates: dict[str, MetricGate] = {}
    serve: ServeStep | None = None
    reembed: ReembedStep | None = None
    recipe: dict[str, Any] = {}  # filled on load: train.recipe with train.set applied, as validated

    @property
    def store(self):
        """The scheduler's object store: ``endpoint_url`` and ``retry_deadline_s``, bound once."""
        from pipelines.storage import Store

        return Store(self.endpoint_url, self.retry_deadline_s, "retry_deadline_s")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", v):
            raise ValueError(f"name: {v!r}: use letters, digits, '.', '_', '-' (it names an actor and folders)")
        return v

    @model_validator(mode="after")
    def _gates(self) -> "ScheduleConfig":
        # A fine-tuning round's metrics depend on its recipe's task: checked once the recipe is read.
        if self.train.kind == "finetune" and not self.recipe:
            return self
        measured = round_metrics(self.train.kind, self.recipe)
        what = "pretraining round" if self.train.kind == "pretrain" else f"fine-tuning round ({self.recipe['task']['kind']})"
        for metric in self.gates:
            if metric not in measured:
                raise ValueError(f"gates.{metric}: not a metric a {what} measures; use one of {list(measured)}")
        return self

    @model_validator(mode="after")
    def _wic_gate(self) -> "ScheduleConfig":
        if "wic_accuracy" in self.gates and self.evaluate.wic is None:
            raise ValueError("gates.wic_accuracy: needs evaluate.wic (the WiC folder)")
        needs = [m for m in self.gates if m in RETRIEVAL_GATES]
        if needs and self.evaluate.retrieval is None:
            raise ValueError(f"gates.{needs[0]}: needs evaluate.retrieval (a BEIR folder: corpus.jsonl, queries.jsonl, qrels/)")
        return self

    @property
    def actor_name(self) -> str:
        return f"ctx-schedule-{self.name}"


def _errors(e: ValidationError, where: str) -> ScheduleError:
    problems = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        m = re.match(r"^([A-Za-z_][\w.@]*): (.*)$", msg, re.S)
        if m:  # our validators start with the key they found wrong
            key = m.group(1)
            loc = loc if loc == key or loc.endswith("." + key) else (f"{loc}.{key}" if loc else key)
            msg = m.group(2)
        problems.append(f"  {loc}: {msg}" if loc else f"  {msg}")
    return ScheduleError(f"{where}: invalid schedule\n" + "\n".join(problems))


def validate(data: dict[str, Any], where: str = "schedule config", base: Path | None = None) -> ScheduleConfig:
    """A schedule from a dict: the train recipe and serve config it names are read and validated
    too (relative paths from ``base``), so a bad key anywhere fails before anything starts."""
    from jobs.training.config import RecipeError, load_recipe
    from jobs.training.finetune_config import load_finetune_recipe
    from jobs.serving.serve_config import ConfigError, load_config

    try:
        cfg = ScheduleConfig.model_validate(data)
    except ValidationError as e:
        raise _errors(e, where) from None
    base = base or Path.cwd()
    if not cfg.recipe:
        path = Path(cfg.train.recipe)
        path = path if path.is_absolute() else base / path
        try:
            recipe = (load_finetune_recipe if cfg.train.kind == "finetune" else load_recipe)(path, cfg.train.set)
        except RecipeError as e:
            raise ScheduleError(f"{where}: train.recipe: {e}") from None
        try:  # validated again with the recipe: the gates are checked against what its task measures
            cfg = ScheduleConfig.model_validate({**cfg.model_dump(mode="python"), "recipe": recipe.model_dump(mode="json")})
        except ValidationError as e:
            raise _errors(e, where) from None
    if cfg.serve is not None and not cfg.serve.app:
        path = Path(cfg.serve.config)
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            raise ScheduleError(f"{where}: serve.config: {str(path)!r} does not exist")
        try:
            app = load_config(path)
        except ConfigError as e:
            raise ScheduleError(f"{where}: serve.config: {e}") from None
        if cfg.serve.model not in app.names():  # pinned or multiplexed: roll_serve repoints either
            raise ScheduleError(f"{where}: serve.model: {cfg.serve.model!r} is not a model of {path} (it has {app.names()})")
        cfg = cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"app": app.model_dump(mode="json", exclude={"defaults"})})})  # each model carries its settings already
    return cfg


def load_schedule(path: str | Path) -> ScheduleConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as e:
        raise ScheduleError(f"schedule {str(path)!r}: cannot read it ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ScheduleError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ScheduleError(f"{path}: a schedule is a mapping (name, model, state_uri, trigger, train, evaluate, gates), got {type(data).__name__}")
    return validate(data, where=str(path), base=Path.cwd())
