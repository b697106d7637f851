"""The task kinds fine-tuning knows: one ``Task`` per kind, in the literal dict ``TASKS``.

A ``Task`` says, as plain values, what every layer needs to know of a kind: what its head reads
and how many outputs it has, its loss, the batch columns that hold its targets, its metrics (the
first picks the best checkpoint unless the recipe says otherwise), the routes a fine-tuned model of
the kind serves, and what transformers' config calls its outputs. Nothing is imported here (no
torch), so ``pipelines`` (which never imports torch), ``ctxmodels`` (which never imports Ray) and
``jobs`` all read the same entry, and each imports the one ``TaskKind`` from this module.

What a kind *does* is code, and that code lives in the layer it belongs to, in one literal dict per
layer keyed by kind (fairseq keeps a task's data, head and metrics in one class; our layering puts
NumPy encoding and torch heads in different packages):

- ``pipelines.finetune.ENCODERS`` and ``RECORD_CHECKS``: records to model rows, and their checks;
- ``pipelines.metrics.METRICS``: the metrics ``Task.metrics`` names;
- ``ctxmodels.tasks.LOSSES`` (keyed by ``Task.loss``): the loss and the step's running metrics;
- ``ctxmodels.hf.CONVERTERS[family].tasks``: the transformers head class per family and kind (a kind
  with no head, ``embedding``, exports as the base model: ``ctxmodels.hf.BASE_CLASSES``).

Adding a kind is one ``Task`` here plus its line in ``TaskKind``, and an entry in each of those
dicts where its behaviour is new; ``tests/jobs/training/test_task_kinds.py`` fails, naming the dict,
until every layer knows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Literal, get_args

TaskKind = Literal["classification", "regression", "multiple-choice", "token-classification", "question-answering", "embedding"]
TASK_KINDS: tuple[str, ...] = get_args(TaskKind)


@dataclass(frozen=True)
class Task:
    kind: str
    # What the head reads: "sequence" one vector per example (a symmetric pair adds both orders'
    # vectors), "options" one vector per option and a softmax across them, "tokens" every token,
    # "texts" each of an example's texts (anchor, positive, negatives) pooled into its own vector.
    reads: Literal["sequence", "options", "tokens", "texts"]
    # The head's outputs per vector, named as transformers' id2label names them; () means one per
    # label of the training split (the kind is "labelled": its label names come from the data).
    outputs: tuple[str, ...]
    loss: Literal["cross-entropy", "mse", "token-cross-entropy", "span-cross-entropy", "in-batch-negatives"]
    targets: tuple[str, ...]  # the batch columns holding the targets (model forward keywords)
    metrics: tuple[str, ...]  # validation metrics (pipelines.metrics.METRICS); the first is the default best
    routes: tuple[str, ...]  # what a fine-tuned model of this kind serves besides embeddings and /tokenize
    # The output layer's module name (transformers'); None: no output layer, the pooled vectors are the output.
    head: Literal["classifier", "qa_outputs"] | None = "classifier"
    both_orders: bool = False  # a pair may be read in both orders, vectors added (GPT similarity: task.symmetric)
    hf_problem_type: str | None = None  # transformers' config.problem_type

    @property
    def labelled(self) -> bool:
        """Its classes are label names found in the training split (saved with the model)."""
        return self.head is not None and not self.outputs


TASKS: dict[str, Task] = {
    "classification": Task(
        "classification", reads="sequence", outputs=(), loss="cross-entropy", targets=("labels",),
        metrics=("accuracy", "f1", "mcc"), routes=("/v1/classify", "/v1/rerank"), both_orders=True,
        hf_problem_type="single_label_classification",
    ),
    "regression": Task(
        "regression", reads="sequence", outputs=("LABEL_0",), loss="mse", targets=("labels",),
        metrics=("pearson", "spearman"), routes=("/v1/classify", "/v1/rerank"), both_orders=True,
        hf_problem_type="regression",
    ),
    "multiple-choice": Task(
        "multiple-choice", reads="options", outputs=("LABEL_0",), loss="cross-entropy", targets=("labels",),
        metrics=("accuracy",), routes=(),
    ),
    "token-classification": Task(
        "token-classification", reads="tokens", outputs=(), loss="token-cross-entropy", targets=("labels",),
        metrics=("f1", "precision", "recall", "token_accuracy"), routes=("/v1/tag",),
    ),
    "question-answering": Task(  # XLNetForQuestionAnsweringSimple sizes qa_outputs by num_labels: 2
        "question-answering", reads="tokens", outputs=("start", "end"), loss="span-cross-entropy",
        targets=("start_positions", "end_positions"), metrics=("f1", "exact_match"), routes=("/v1/answer",),
        head="qa_outputs",
    ),
    # Sentence embeddings trained contrastively (sentence-transformers' MultipleNegativesRankingLoss:
    # Henderson et al. 2017, van den Oord et al. 2018): an anchor's positive against every other
    # text of the batch. Scored as retrieval (queries: the anchors; documents: the positives and
    # negatives), with MTEB's metric names; the model serves /v1/embeddings with its own pooling.
    "embedding": Task(
        "embedding", reads="texts", outputs=(), loss="in-batch-negatives", targets=(),
        metrics=("ndcg_at_10", "mrr_at_10", "map_at_100", "recall_at_1", "recall_at_10"), routes=(), head=None,
    ),
}


def task_of(kind: str) -> Task:
    """``TASKS[kind]``, or a ValueError that lists the kinds."""
    try:
        return TASKS[kind]
    except KeyError:
        raise ValueError(f"task kind {kind!r}: expected one of {list(TASK_KINDS)}") from None


def label_names(task: Any) -> list[str]:
    """The names of a task head's outputs (``task``: a ``ctxmodels.tasks.TaskConfig``), as its
    config.json's ``id2label`` gives them: the training split's classes, else transformers'
    ``LABEL_i``; a regression head's one output is ``LABEL_0``."""
    kind = task_of(task.kind)
    if kind.labelled:
        return list(task.labels) if len(task.labels) == task.num_labels else [f"LABEL_{i}" for i in range(task.num_labels)]
    return list(kind.outputs)


# The embedding kind's losses (ctxmodels.tasks.EMBEDDING_LOSSES), by sentence-transformers' names: the in-batch
# loss on (anchor, positive[, negatives]) records, the default, or a loss on pairs scored for similarity
# (sentence1, sentence2, score; STS-B's layout): CoSENTLoss, AnglELoss, CosineSimilarityLoss.
PAIR_LOSSES = ("cosent", "angle", "cosine_similarity")
EMBEDDING_LOSSES = ("multiple_negatives_ranking", *PAIR_LOSSES)
# What a pair loss's run is validated by: the Pearson and Spearman correlations of the pairs' cosine
# similarities with their scores (sentence-transformers' EmbeddingSimilarityEvaluator names; the first the default).
SIMILARITY_METRICS = ("spearman_cosine", "pearson_cosine")


def check_embedding_loss(loss: str) -> None:
    if loss not in EMBEDDING_LOSSES:
        raise ValueError(f"loss={loss!r}: expected one of {list(EMBEDDING_LOSSES)}")


def scores_pairs(kind: str, loss: str | None) -> bool:
    """Whether a task of ``kind`` trained with ``loss`` (None: the kind's own) reads pairs scored for similarity."""
    return kind == "embedding" and loss in PAIR_LOSSES


def validation_metrics(kind: str, loss: str | None = None) -> tuple[str, ...]:
    """What validation reports for ``kind`` trained with ``loss``: the kind's metrics, or a pair loss's
    SIMILARITY_METRICS; the first is the default best."""
    return SIMILARITY_METRICS if scores_pairs(kind, loss) else task_of(kind).metrics


# The in-batch loss of the embedding kind (ctxmodels.tasks.in_batch_negatives): which similarities its softmax holds.
DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


HARDNESS_MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")


def check_directions(directions: Sequence[str], partition_mode: str, hardness_mode: str | None = None,
                     hardness_strength: float = 0.0) -> None:
    """The in-batch loss's directions, partition mode and hardness weighting, as sentence-transformers
    checks them (a hardness mode of strength 0, which it only warns of, is refused: it changes nothing)."""
    unknown = sorted(set(directions) - set(DIRECTIONS))
    if unknown or "query_to_doc" not in directions:
        raise ValueError(f"directions={list(directions)}: query_to_doc and any of {list(DIRECTIONS[1:])}"
                         + (f" ({unknown} unknown)" if unknown else ""))
    if partition_mode not in ("joint", "per_direction"):
        raise ValueError(f"partition_mode={partition_mode!r}: expected joint or per_direction")
    if partition_mode == "per_direction" and set(directions) & {"query_to_query", "doc_to_doc"}:
        raise ValueError("partition_mode=per_direction: each direction's softmax must hold the positive pair, which "
                         "query_to_query and doc_to_doc lack; use partition_mode=joint")
    if hardness_mode is not None and hardness_mode not in HARDNESS_MODES:
        raise ValueError(f"hardness_mode={hardness_mode!r}: expected one of {list(HARDNESS_MODES)}")
    if not hardness_strength >= 0:
        raise ValueError(f"hardness_strength={hardness_strength!r}: must be non-negative")
    if hardness_mode is not None and hardness_strength == 0:
        raise ValueError(f"hardness_mode={hardness_mode}: needs a positive hardness_strength (Lan et al. use 9 with "
                         "in_batch_negatives, Schechter Vera et al. 5 with hard_negatives); at 0 it changes nothing")
    if hardness_mode is None and hardness_strength:
        raise ValueError(f"hardness_strength={hardness_strength}: set hardness_mode too (which negatives it weighs)")
