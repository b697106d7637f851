"""Pretraining recipes: typed, validated on load, every key overridable from the command line.

A recipe is a YAML file (see ``configs/``) with five sections and two top-level keys::

    name: bert-tiny          # run name; checkpoints go to <output_dir>/<name>/
    output_dir: runs         # local path, file:// or s3://
    model:     family, preset, and any field of that family's config (d_model: 128, ...)
    tokenizer: how to get the tokenizer (train one from the corpus, or load a folder)
    data:      where the corpus is and how samples are built
    train:     optimiser, schedule, steps, logging and checkpoint cadence
    scaling:   Ray Train workers

Validation happens before Ray starts. Every error names the offending key (``train.lr``,
``model.d_modle``) and says what was expected, so a typo costs seconds, not a cluster start.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ctxmodels.registry import FAMILIES
from pipelines.objectives import family_objectives
from pipelines.storage import DEFAULT_RETRY_DEADLINE_S

TokenizerKind = Literal["wordpiece", "sentencepiece-unigram", "sentencepiece-bpe", "byte-level-bpe"]  # pipelines.tokenizers.TrainKind


class RecipeError(ValueError):
    """A recipe that cannot run; the message names the key and the problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class ModelSection(BaseModel):
    """``family`` and ``preset`` pick a config from the family's PRESETS; any other key overrides
    a field of that config (checked against the family's dataclass, with its types)."""

    model_config = ConfigDict(extra="allow", strict=True)

    family: str = "bert"
    preset: str = "tiny"
    # Warm start: continue pretraining from this checkpoint (ours, a run folder: its best or newest
    # complete checkpoint, or a Hugging Face folder; local or s3://; or models:/NAME@alias). Its weights, architecture and
    # tokenizer are kept; the optimizer, schedule and data position start fresh. A run's own
    # checkpoint still wins on a rerun (resume).
    init: str | None = None

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _check_family_fields(self) -> "ModelSection":
        if self.init is not None:
            if not self.init.strip():
                raise ValueError("init: give a checkpoint, run folder or Hugging Face folder, or leave it out")
            if self.overrides:
                key = sorted(self.overrides)[0]
                raise ValueError(f"{key}: the architecture comes from model.init ({self.init}); remove model.{key}")
        if self.family not in FAMILIES:
            raise ValueError(f"family: unknown model family {self.family!r}; known: {sorted(FAMILIES)}")
        spec = FAMILIES[self.family]
        if self.preset not in spec.presets:
            raise ValueError(f"preset: unknown preset {self.preset!r} for family {self.family!r}; known: {sorted(spec.presets)}")
        fields = {f.name: f for f in dataclasses.fields(spec.config_cls)}
        hints = typing.get_type_hints(spec.config_cls)
        for key, value in self.overrides.items():
            if key not in fields:
                raise ValueError(f"{key}: unknown field for family {self.family!r}; known: {sorted(fields)}")
            _check_type(key, value, hints[key])
        return self


def _check_type(key: str, value: Any, hint: Any) -> None:
    """Strict type check of one override against a dataclass field's annotation."""
    from pydantic import TypeAdapter

    try:
        TypeAdapter(hint).validate_python(value, strict=not isinstance(value, list))
    except ValidationError as e:
        msg = e.errors()[0]["msg"]
        raise ValueError(f"{key}: {msg} (got {value!r} of type {type(value).__name__})") from None


class TokenizerSection(_Section):
    path: str | None = None  # an existing tokenizer folder (ours or HF); None = train one
    kind: TokenizerKind = "wordpiece"
    vocab_size: int = Field(8000, gt=10)
    lowercase: bool = True
    sample_chars: int = Field(20_000_000, gt=0)  # how much corpus text the trainer reads


class DataSection(_Section):
    input: str | list[str] = "data/sample"  # folder/prefix URI, glob, file, or a list of them
    eval_input: str | list[str] | None = None  # held-out shards: eval loss/ppl/accuracy every train.eval_every steps
    eval_max_samples: int = Field(512, ge=1)  # evaluate on at most this many samples of eval_input
    format: Literal["auto", "text", "jsonl", "parquet"] = "auto"
    text_field: str = "text"  # where JSON/Parquet records keep their text
    seq_len: int = Field(128, ge=8)
    # How samples are built and what the model predicts; FAMILY_OBJECTIVES says which a family takes.
    objective: Literal["mlm", "nsp", "sop", "span", "clm", "clm-stream", "plm", "bilm", "tlm"] = "mlm"
    mlm_probability: float = Field(0.15, gt=0.0, lt=1.0)  # also the span / n-gram masking budget
    whole_word_mask: bool = False  # mlm, nsp
    span_geometric_p: float = Field(0.2, gt=0.0, le=1.0)  # span: span length in words ~ Geo(p), max 10
    ngram_max: int = Field(3, ge=1)  # sop: ALBERT masks n-grams of 1..ngram_max words
    plm_partial_k: int = Field(6, ge=1)  # plm: XLNet predicts the last 1/K of each factorization order
    plm_stream: bool = True  # plm: stream-ordered batches, so XLNet's memory holds the text before
    stream_block_batches: int | None = Field(32, ge=1)  # clm-stream, plm, bilm: batches per block of
    # contiguous rows (memory resets between blocks); null = a whole shard, as Transformer-XL
    seed: int = 0
    shuffle_files: bool = True  # a new shard order each epoch, keyed by (seed, epoch)
    max_epochs: int = Field(100, ge=1)  # the stream ends after this many passes
    tokenize_actors: int = Field(1, ge=1)  # size of the Ray Data actor pool that tokenizes
    strict: bool = False  # fail at the first bad record (shard:line: reason) instead of counting it
    max_record_chars: int = Field(1_000_000, ge=1)  # longer lines/records are rejected as bad data
    endpoint_url: str | None = None  # S3-compatible endpoint (MinIO, moto); else AWS_ENDPOINT_URL
    # How long one storage operation of training (a shard read, a checkpoint upload, a metrics
    # write) retries through transient errors before it gives up: rides out an endpoint restart.
    retry_deadline_s: float = Field(DEFAULT_RETRY_DEADLINE_S, ge=1)
    # XLM (pipelines.languages): the language of each data.input entry, in order (its index is the
    # language id, the model's language embedding row); eval_input, if given, lists one entry per
    # language too. Languages are sampled with q_i ~ p_i^language_alpha (XLM: 0.5; 1 = as stored).
    # objective tlm: the languages the parallel JSONL records name ({"en": ..., "fr": ...}); the
    # inputs are then any shards of such records, every pair kept.
    languages: list[str] | None = None
    language_alpha: float = Field(0.5, gt=0.0, le=1.0)
    # XLM's MLM + TLM (sec. 3.3, objective mlm with data.languages): parallel JSONL shards whose
    # records name two of data.languages. Their translation rows join the languages' MLM rows in
    # one stream, every pair kept (the languages' rows are sampled as above).
    translations: str | list[str] | None = None

    @model_validator(mode="after")
    def _check_languages(self) -> "DataSection":
        if self.objective == "tlm" and (self.languages is None or len(self.languages) < 2):
            raise ValueError(f"languages: the translation LM (objective tlm) reads records that name two of "
                             f"data.languages; list at least two, got {self.languages}")
        if self.translations is not None and (self.objective != "mlm" or self.languages is None or len(self.languages) < 2):
            raise ValueError(f"translations: XLM's MLM + TLM adds translation rows to the masked-LM rows of data.languages; "
                             f"it needs objective mlm and at least two languages, got objective {self.objective!r} and "
                             f"languages {self.languages}")
        if self.languages is None:
            return self
        names = self.languages
        if not names or any(not isinstance(n, str) or not n.strip() for n in names) or len(set(names)) != len(names):
            raise ValueError(f"languages: distinct, non-empty names, one per data.input entry; got {names}")
        for key in ("input", "eval_input") if self.objective != "tlm" else ():
            value = getattr(self, key)
            if key == "eval_input" and value is None:
                continue
            if not isinstance(value, list) or len(value) != len(names):
                raise ValueError(f"{key}: with data.languages, a list of {len(names)} entries (one per language, "
                                 f"in the order of {names}); got {value!r}")
        return self


def language_model_fields(data: DataSection) -> dict[str, Any]:
    """Model fields that data.languages implies: a language embedding row per language (XLM);
    one language has none (HF XLM's n_langs=1)."""
    if data.languages is None:
        return {}
    n = len(data.languages)
    return {"type_vocab_size": n if n > 1 else 0}


# Which objectives each family trains with, and the model fields an objective implies (applied
# unless the recipe sets them; a recipe that sets them otherwise is refused): a view of
# pipelines.objectives.OBJECTIVES, where each objective is defined.
FAMILY_OBJECTIVES: dict[str, dict[str, dict[str, Any]]] = family_objectives()


class StepChecks(_Section):
    """The training-loop keys pretraining's and fine-tuning's train sections share (jobs/training/loop.py Stepper,
    jobs/training/parallel.py's precision and compilation)."""

    # A step with a non-finite loss or gradient norm is skipped (no update); this many in a row stop the run.
    max_bad_steps: int = Field(10, ge=1)
    # Fault injection, for tests and drills: the optimizer-step attempts (1-based, skipped ones
    # counted) whose loss is made NaN on rank 0. Never set it in a real run.
    debug_nan_steps: tuple[int, ...] = ()
    # The learning-rate schedule: linear warm-up then linear decay (BERT), or ULMFiT's slanted
    # triangular one (Howard & Ruder 2018): a rise over cut_frac of the steps, a long fall, its
    # lowest lr the peak / stlr_ratio (warm-up keys are then unused).
    schedule: Literal["linear", "stlr"] = "linear"
    cut_frac: float = Field(0.1, gt=0, lt=1)
    stlr_ratio: float = Field(32.0, ge=1)
    # ULMFiT's discriminative fine-tuning: each layer down learns at the lr of the one above / this
    # (the paper: 2.6); the head and the last block at train.lr (jobs.training.loop.layer_depths).
    discriminative_lr: float | None = Field(None, ge=1)

    @field_validator("betas", "debug_nan_steps", mode="before", check_fields=False)  # betas: in each subclass
    @classmethod
    def _list_to_tuple(cls, v: Any) -> Any:
        return tuple(v) if isinstance(v, list) else v

    @field_validator("debug_nan_steps")
    @classmethod
    def _attempts_from_one(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(n < 1 for n in v):
            raise ValueError(f"debug_nan_steps: step attempts count from 1, got {list(v)}")
        return v

    # How the step computes (jobs/training/parallel.py), the same keys for every job on the loop.
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast on GPU or a native-bf16 CPU, fp32 weights and optimizer
    # bf16 (with precision bf16): LayerNorm outputs, the residual stream between blocks, in bf16
    # (statistics in fp32, as Megatron-LM's default); fp32: plain autocast's (transformers' Trainer)
    residual: Literal["fp32", "bf16"] = "fp32"
    # torch.compile each Transformer block (true); "graphs": on CUDA also replayed as CUDA graphs, the
    # whole model for BERT, RoBERTa, SpanBERT and ALBERT on one GPU, pretrained or fine-tuned
    # (jobs.training.parallel.compile_scope)
    compile: bool | Literal["graphs"] = False
    # true: on CUDA, a BERT, RoBERTa or SpanBERT backbone computes nothing for padding, as CPU steps
    # always do: every layer runs on the real tokens only, attention over nested jagged tensors
    # (FlashAttention's variable-length kernel). Eager steps only (compile: false): the unpadded
    # shapes change with every batch (jobs.training.parallel.skip_padding)
    unpad: bool = False

    @model_validator(mode="after")
    def _check_step(self) -> "StepChecks":
        if self.residual == "bf16" and self.precision != "bf16":
            raise ValueError("train.residual: bf16 needs train.precision: bf16 (the residual stream is only "
                             "lowered under bf16 autocast)")
        if self.unpad and self.compile:
            raise ValueError(f"train.unpad: true needs train.compile: false, got {self.compile!r}: padding is skipped in "
                             "eager steps only (the unpadded shapes change with every batch)")
        return self


class TrainSection(StepChecks):
    batch_size: int = Field(32, ge=1)  # global, per optimizer step: fixed whatever the worker count
    # Rows per worker forward/backward; default batch_size / the most workers. Fewer workers run
    # more micro-batches per step (gradient accumulation), so the global batch stays batch_size.
    micro_batch_size: int | None = Field(None, ge=1)
    lr: float = Field(5e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.98)  # RoBERTa's beta2 = 0.98 for large-batch stability
    eps: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(100, ge=0)
    max_steps: int = Field(300, ge=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping
    log_every: int = Field(10, ge=1)
    checkpoint_every: int = Field(100, ge=1)
    eval_every: int = Field(100, ge=1)  # steps between evaluations on data.eval_input (and at the end)
    seed: int = 0  # model initialisation
    sample_log: bool = False  # write every consumed sample id (and a digest of its tokens) to <run>/sample_log/


class ScalingSection(_Section):
    # An int, or [min, max] for elastic training: Ray Train starts with as many workers as the
    # cluster can place (at least min) and restarts the group at a new size when that changes.
    num_workers: int | tuple[int, int] = 2
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0)
    max_failures: int = Field(2, ge=-1)  # worker-group restarts after failures before the run fails; -1: no limit
    strategy: Literal["ddp", "fsdp"] = "ddp"  # fsdp: parameters, gradients and optimizer sharded
    # Custom Ray resources each worker needs besides its CPUs/GPU, e.g. {trainer_slot: 1} on a
    # cluster whose training nodes each carry one trainer_slot: then the worker count follows
    # the node count (an elastic range grows when such a node joins, shrinks when one is lost).
    resources_per_worker: dict[str, float] = Field(default_factory=dict)
    # How often a healthy elastic run checks whether the cluster can place more (or fewer)
    # workers (Ray Train's ScalingConfig.elastic_resize_monitor_interval_s; a resize restarts
    # the group from its last checkpoint, so checking very often costs nothing but a resize does).
    resize_interval_s: float = Field(60.0, ge=0)

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        if isinstance(v, list):
            v = tuple(v)
        if isinstance(v, tuple):
            if len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v) or not 1 <= v[0] <= v[1]:
                raise ValueError(f"num_workers: expected an int or [min, max] with 1 <= min <= max, got {list(v)}")
        elif isinstance(v, int) and v < 1:
            raise ValueError(f"num_workers: must be >= 1, got {v}")
        return v

    @field_validator("resources_per_worker", mode="before")
    @classmethod
    def _resources(cls, v: Any) -> Any:
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ValueError(f"resources_per_worker: expected a mapping of Ray resource name -> amount, got {v!r}")
        for name, amount in v.items():
            if name in ("CPU", "GPU"):
                raise ValueError(f"resources_per_worker: {name} is set by {'cpus_per_worker' if name == 'CPU' else 'use_gpu'}, not here")
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
                raise ValueError(f"resources_per_worker: {name} must be a number > 0, got {amount!r}")
        return {str(k): float(a) for k, a in v.items()}

    @property
    def worker_range(self) -> tuple[int, int]:
        n = self.num_workers
        return (n, n) if isinstance(n, int) else n


class RegistrySection(_Section):
    """Where a finished run goes (jobs/training/tracking.py): an MLflow run with its params and metrics, and
    a version of ``model_name`` in MLflow's Model Registry whose source is the run's checkpoint."""

    enabled: bool = True
    tracking_uri: str | None = None  # else $MLFLOW_TRACKING_URI, else sqlite:///~/.ctxmodels/mlflow.db
    model_name: str | None = None  # the registered model; None: the recipe's name

    @field_validator("model_name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        from jobs.registry import name_problem

        if v is not None and name_problem(v):
            raise ValueError(f"model_name: {name_problem(v)}")
        return v


def check_registry_name(name: str, registry: RegistrySection) -> None:
    """The name a run registers under must be one MLflow and ``ctx models`` accept (checked on load,
    not after hours of training)."""
    from jobs.registry import name_problem

    if registry.enabled and registry.model_name is None and name_problem(name):
        raise ValueError(f"name: it is the registered model name too: {name_problem(name)}; "
                         f"set registry.model_name or registry.enabled: false")


class TeacherSection(_Section):
    """``ctx distill``: the teacher, the student's layers and the loss's weights
    (``ctxmodels/distill.py``, DistilBERT's recipe; its defaults are the paper's code's)."""

    # The teacher: one of our checkpoints, a run folder, a Hugging Face folder or models:/NAME@alias,
    # as model.init takes. The student is its family with fewer layers; the run keeps its tokenizer.
    init: str
    student_layers: list[int] | None = None  # teacher layers the student's blocks start from; None: 0, 2, 4, ...
    temperature: float = Field(2.0, gt=0)  # of the soft targets
    alpha_soft: float = Field(5.0, ge=0)  # soft-target cross-entropy on the teacher's masked-LM distribution
    alpha_mlm: float = Field(2.0, ge=0)  # the student's own masked-LM loss
    alpha_cos: float = Field(1.0, ge=0)  # 1 - cosine of the last hidden states, every real token
    alpha_sentence: float = Field(0.0, ge=0)  # 1 - cosine of the mean-pooled sentence vectors

    @model_validator(mode="after")
    def _check(self) -> "TeacherSection":
        if not self.init.strip():
            raise ValueError("init: give the teacher: a checkpoint, run folder, Hugging Face folder or models:/NAME@alias")
        if self.student_layers is not None:
            layers = self.student_layers
            if not layers or any(i < 0 for i in layers) or sorted(set(layers)) != layers:
                raise ValueError(f"student_layers: distinct teacher layers in ascending order, from 0; got {layers}")
        if self.alpha_soft + self.alpha_mlm + self.alpha_cos + self.alpha_sentence <= 0:
            raise ValueError("alpha_soft, alpha_mlm, alpha_cos, alpha_sentence: at least one must be above 0")
        return self


DISTILL_FAMILIES = ("bert", "roberta", "spanbert", "xlm")  # ctxmodels.distill: BertForPreTraining's families


class RecipeBase(_Section):
    """What every training recipe shares (pretraining, distillation and fine-tuning): its name and
    run folder, the workers and the registry, and the batch arithmetic over a ``train`` section
    with ``batch_size`` and ``micro_batch_size`` (each subclass declares its own ``train``)."""

    name: str = "run"
    output_dir: str = "runs"
    scaling: ScalingSection = ScalingSection()
    registry: RegistrySection = RegistrySection()

    @property
    def micro_batch_size(self) -> int:
        return self.train.micro_batch_size or self.train.batch_size // self.scaling.worker_range[1]

    def accumulation(self, world: int) -> int:
        """Micro-batches each of ``world`` workers runs per optimizer step."""
        return self.train.batch_size // (world * self.micro_batch_size)

    @model_validator(mode="after")
    def _check_batch_and_name(self) -> "RecipeBase":
        check_batch(self.train.batch_size, self.micro_batch_size, self.scaling.worker_range)
        check_registry_name(self.name, self.registry)
        return self


class Recipe(RecipeBase):
    teacher: TeacherSection | None = None  # distillation (ctx distill): the student starts from the teacher's layers
    model: ModelSection = ModelSection()
    tokenizer: TokenizerSection = TokenizerSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()

    @model_validator(mode="after")
    def _check_model_data_and_teacher(self) -> "Recipe":
        if self.data.seq_len > _max_seq_len(self):
            raise ValueError(f"data.seq_len: {self.data.seq_len} exceeds the model's max_seq_len {_max_seq_len(self)}")
        supported = FAMILY_OBJECTIVES.get(self.model.family, {})
        if self.data.objective not in supported:
            raise ValueError(
                f"data.objective: {self.data.objective!r} does not train family {self.model.family!r}; "
                f"use one of {sorted(supported)}"
            )
        for key, value in supported[self.data.objective].items():
            if self.model.overrides.get(key, value) != value:
                raise ValueError(f"model.{key}: objective {self.data.objective!r} needs {key}={value}")
        if self.data.languages is not None:
            if self.model.family != "xlm":
                raise ValueError(f"data.languages: only family 'xlm' has language embeddings, not {self.model.family!r}")
            for key, value in language_model_fields(self.data).items():
                if self.model.overrides.get(key, value) != value:
                    raise ValueError(f"model.{key}: data.languages lists {len(self.data.languages)} language(s), "
                                     f"which needs {key}={value}")
        if self.teacher is not None:
            if self.model.init is not None:
                raise ValueError("model.init: a distillation's student starts from teacher.init; remove model.init")
            if self.model.overrides:
                key = sorted(self.model.overrides)[0]
                raise ValueError(f"model.{key}: the student's architecture is the teacher's (teacher.init), less its layers; "
                                 f"remove model.{key}")
            if self.model.family not in DISTILL_FAMILIES:
                raise ValueError(f"model.family: distillation takes a {', '.join(DISTILL_FAMILIES)} teacher, not {self.model.family!r}")
            if self.data.objective != "mlm":
                raise ValueError(f"data.objective: distillation trains on masked-LM batches (mlm), not {self.data.objective!r}")
        return self


def check_batch(batch_size: int, micro_batch_size: int, worker_range: tuple[int, int]) -> None:
    """Every worker count of the elastic range runs whole micro-batches of a fixed global batch."""
    lo, hi = worker_range
    g, m = batch_size, micro_batch_size
    if m < 1:
        raise ValueError(f"train.batch_size: {g} is smaller than scaling.num_workers={hi}")
    bad = [w for w in range(lo, hi + 1) if g % (w * m)]
    if bad:
        raise ValueError(
            f"train.batch_size: {g} is not a multiple of micro_batch_size ({m}) x workers for "
            f"{bad} worker(s); every worker count in scaling.num_workers must run whole micro-batches "
            f"(set train.micro_batch_size or choose the range so that it divides)"
        )


def _max_seq_len(recipe: Recipe) -> int:
    spec = FAMILIES[recipe.model.family]
    base = spec.presets[recipe.model.preset]
    return int(recipe.model.overrides.get("max_seq_len", getattr(base, "max_seq_len", 1 << 30)))


# ---------------------------------------------------------------------------------------------
# Loading: YAML + --set overrides -> Recipe, with errors that name the key.


def parse_override(item: str) -> tuple[list[str], Any]:
    """``train.lr=3e-4`` -> (["train", "lr"], 0.0003). Values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. train.lr=3e-4")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise RecipeError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at character {where.column + 1}" if where is not None else ""
        raise RecipeError(f"--set {item!r}: the value of {key.strip()} is not valid YAML ({getattr(e, 'problem', None) or e}{at}); "
                          f"quote a string that holds [ ] {{ }} : or #, as in {key.strip()}='[\"data/part-[0-6].txt\"]'") from None
    # YAML 1.1 reads "3e-4" as a string; users mean a float.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in "eE.") else value
        except ValueError:
            pass
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    data = yaml.safe_load(yaml.safe_dump(data))  # deep copy of plain data
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise RecipeError(f"--set {item!r}: {'.'.join(parts[:-1])} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def recipe_from_dict(data: dict[str, Any], source: str = "<recipe>", cls: type[BaseModel] | None = None):
    """Validate ``data`` as a ``cls`` recipe (default ``Recipe``); every error names its key."""
    try:
        return (cls or Recipe).model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
            # Our validators start their message with the field they found wrong: join the paths.
            m = re.match(r"^([A-Za-z_][\w.]*): (.*)$", msg, re.S)
            if m:
                key = m.group(1)
                loc = loc if loc == key or loc.endswith("." + key) else (f"{loc}.{key}" if loc else key)
                msg = m.group(2)
            lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")
        raise RecipeError(f"{source}: invalid recipe\n" + "\n".join(lines)) from None


def load_recipe(path: str | Path | None, overrides: list[str] | None = None, cls: type[BaseModel] | None = None):
    """A recipe from YAML plus ``--set`` overrides, validated as ``cls`` (default ``Recipe``)."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise RecipeError(f"recipe {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise RecipeError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
        source = str(path)
    data = apply_overrides(data, overrides or [])
    return recipe_from_dict(data, source, cls)


def model_overrides_with_vocab(recipe: Recipe, vocab_size: int) -> dict[str, Any]:
    """The model config overrides for a run: the recipe's, with the tokenizer's vocabulary size."""
    out = recipe.model.overrides
    out.setdefault("vocab_size", vocab_size)
    if out["vocab_size"] < vocab_size:
        raise RecipeError(f"model.vocab_size: {out['vocab_size']} is smaller than the tokenizer's {vocab_size}")
    return out
