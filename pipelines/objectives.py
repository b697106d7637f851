"""Pretraining objectives: one object per objective, in one literal dict.

An objective, like a fairseq task (Ott et al. 2019) without its decorator registry, owns what
it means everywhere in the pipeline:

* ``rows``: how stage 1 of the stream builds samples from a shard (``pipelines.dataset``);
* ``transform``: stage 2, a pure NumPy function of ``(batch, TransformContext)`` keyed by
  ``(seed, epoch, sample_id)`` (the masks of BERT, SpanBERT, ALBERT; XLNet's permutations);
* ``families``: the model families it trains and the model fields it implies for each (e.g.
  packed single-segment MLM builds BERT without its NSP head); a recipe that sets such a field
  otherwise is refused;
* ``main_loss`` and ``token_metrics``: which metric the perplexity is taken from, and which
  metrics are averaged per predicted token (the others per micro-batch) when the training loop
  reduces them over steps and workers;
* ``predicted``: how many positions of a row reach the output layer, for the model FLOPs (MFU).

Its settings are the recipe's ``data.*`` keys (``jobs.training.config.DataSection``), carried to the
workers in ``StreamSpec`` and to stage 2 in ``TransformContext``. Adding an objective is one
function here and one line in ``OBJECTIVES``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

import numpy as np

from pipelines.char_ids import add_char_ids
from pipelines.lm import causal_lm_targets
from pipelines.masking import MlmConfig, VocabInfo, mask_tokens
from pipelines.permutation import PlmConfig, plm_targets
from pipelines.spans import NgramConfig, SpanConfig, ngram_mask, span_mask

RowKind = Literal["packed", "nsp-pairs", "sop-pairs", "stream", "translations"]


class MaskingSettings(Protocol):
    """What ``Objective.predicted`` reads of a stream's settings (``pipelines.dataset.StreamSpec`` has them)."""

    mlm: MlmConfig
    span: SpanConfig
    ngram: NgramConfig
    plm: PlmConfig


@dataclass(frozen=True)
class TransformContext:
    """What stage-2 transforms read, built once on the driver (``pipelines.dataset.transform_context``)."""

    seed: int
    mlm: MlmConfig
    span: SpanConfig
    ngram: NgramConfig
    plm: PlmConfig
    vocab: VocabInfo
    char_table: np.ndarray | None = None  # int32 (V, max_chars), "bilm" only
    languages: bool = False  # rows carry XLM language ids as token_type_ids (data.languages)


# ---------------------------------------------------------------------------------------------
# Stage-2 transforms.


def _mlm(batch: dict[str, np.ndarray], ctx: TransformContext) -> dict[str, np.ndarray]:
    return mask_tokens(batch, ctx.seed, ctx.mlm, ctx.vocab)


def _ngram(batch: dict[str, np.ndarray], ctx: TransformContext) -> dict[str, np.ndarray]:
    return ngram_mask(batch, ctx.seed, ctx.ngram, ctx.vocab)


def _span(batch: dict[str, np.ndarray], ctx: TransformContext) -> dict[str, np.ndarray]:
    return span_mask(batch, ctx.seed, ctx.span, ctx.vocab)


def _clm(batch: dict[str, np.ndarray], ctx: TransformContext) -> dict[str, np.ndarray]:
    out = causal_lm_targets(batch)
    if not ctx.languages:  # GPT's forward takes none; one segment anyway. XLM's CLM keeps its language ids
        out.pop("token_type_ids", None)
    return out


def _plm(batch: dict[str, np.ndarray], ctx: TransformContext) -> dict[str, np.ndarray]:
    out = plm_targets(batch, ctx.seed, ctx.plm, ctx.vocab)
    out.pop("token_type_ids", None)  # one segment: XLNet's relative segment term is then constant
    if "_stream_block" not in out:  # packed rows are unrelated: no memory from the previous batch
        out["reset_memory"] = np.ones(len(out["input_ids"]), dtype=np.int64)
    return out


def _bilm(batch: dict[str, np.ndarray], ctx: TransformContext) -> dict[str, np.ndarray]:
    # ELMo derives its forward and backward targets from input_ids; it reads characters.
    return add_char_ids(batch, ctx.char_table)


# ---------------------------------------------------------------------------------------------
# The objectives.


@dataclass(frozen=True)
class Objective:
    rows: RowKind  # how stage 1 builds rows from a shard
    transform: Callable[[dict[str, np.ndarray], TransformContext], dict[str, np.ndarray]]  # stage 2
    families: dict[str, dict[str, Any]]  # family -> model fields the objective implies
    predicted: Callable[[int, MaskingSettings], int]  # positions of a row of seq_len that reach the output layer
    main_loss: str | None = None  # the metric behind ``ppl``
    token_metrics: tuple[str, ...] = ()  # metric-name prefixes averaged per predicted token (``n_pred``)
    uses_chars: bool = False  # stage 2 needs the tokenizer's character table (ELMo)
    places_mask: bool = False  # stage 2 writes [MASK] into inputs: the tokenizer must have one
    notes: str = field(default="", compare=False)

    def is_token_metric(self, name: str) -> bool:
        return name.startswith(self.token_metrics)


def _masked(T: int, s: MaskingSettings) -> int:
    return round(T * s.mlm.mlm_probability)


def _next_token(T: int, s: MaskingSettings) -> int:
    return T - 1


MASKED_LM = ("mlm_",)
SPAN_LM = ("mlm_", "sbo_")
CAUSAL_LM = ("lm_",)

OBJECTIVES: dict[str, Objective] = {
    # BERT / RoBERTa: dynamic MLM masking of packed FULL-SENTENCES rows.
    "mlm": Objective(
        rows="packed", transform=_mlm, predicted=_masked, main_loss="mlm_loss", token_metrics=MASKED_LM, places_mask=True,
        families={"bert": {"nsp": False}, "roberta": {"nsp": False}, "albert": {"sop": False}, "xlm": {"nsp": False, "causal": False}},
    ),
    # BERT: sentence pairs, MLM + next-sentence prediction.
    "nsp": Objective(
        rows="nsp-pairs", transform=_mlm, predicted=_masked, main_loss="mlm_loss", token_metrics=MASKED_LM, places_mask=True,
        families={"bert": {"nsp": True}},
    ),
    # ALBERT: ordered / swapped segment pairs + n-gram masking.
    "sop": Objective(
        rows="sop-pairs", transform=_ngram, predicted=lambda T, s: round(T * s.ngram.mask_ratio),
        main_loss="mlm_loss", token_metrics=MASKED_LM, places_mask=True, families={"albert": {"sop": True}},
    ),
    # SpanBERT: single segments, geometric spans, span boundary objective.
    "span": Objective(
        rows="packed", transform=_span, predicted=lambda T, s: round(T * s.span.mask_ratio),
        main_loss="mlm_loss", token_metrics=SPAN_LM, places_mask=True, families={"spanbert": {"sbo": True, "nsp": False}},
    ),
    # XLM: translation LM, a sentence and its translation in one row (data.languages names them).
    "tlm": Objective(
        rows="translations", transform=_mlm, predicted=_masked, main_loss="mlm_loss", token_metrics=MASKED_LM,
        places_mask=True, families={"xlm": {"nsp": False, "causal": False}},
    ),
    # GPT, and XLM's causal LM (sec. 3.1; with data.languages, one language a row): next token, independent rows.
    "clm": Objective(
        rows="packed", transform=_clm, predicted=_next_token, main_loss="lm_loss", token_metrics=CAUSAL_LM,
        families={"gpt": {}, "xlm": {"causal": True, "nsp": False}},
    ),
    # Transformer-XL, AWD-LSTM: next token, with memory (LSTM state) across stream-ordered batches.
    "clm-stream": Objective(
        rows="stream", transform=_clm, predicted=_next_token, main_loss="lm_loss", token_metrics=CAUSAL_LM,
        families={"transformer-xl": {}, "awd-lstm": {}},
    ),
    # XLNet: permutation LM (packed rows if not data.plm_stream).
    "plm": Objective(
        rows="stream", transform=_plm, predicted=lambda T, s: math.ceil(T / s.plm.partial_k),
        main_loss="plm_loss", token_metrics=("plm_",), families={"xlnet": {}},
    ),
    # ELMo: forward and backward LMs over characters, truncated BPTT.
    "bilm": Objective(
        rows="stream", transform=_bilm, predicted=_next_token, main_loss="lm_loss", token_metrics=("lm_", "fwd_", "bwd_"),
        uses_chars=True, families={"elmo": {}},
    ),
}


def objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise ValueError(f"data.objective: unknown objective {name!r}; known: {sorted(OBJECTIVES)}")
    return OBJECTIVES[name]


def family_objectives() -> dict[str, dict[str, dict[str, Any]]]:
    """family -> {objective: model fields it implies}: ``OBJECTIVES`` seen from the families."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, obj in OBJECTIVES.items():
        for family, fields in obj.families.items():
            out.setdefault(family, {})[name] = dict(fields)
    return out
