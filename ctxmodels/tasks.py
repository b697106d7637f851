"""Downstream task models: a pretrained backbone of any family plus the head its paper fine-tunes.

Papers and where each family reads a sequence's vector:
- BERT (Devlin et al. 2019, sec. 4), RoBERTa (Liu et al. 2019), SpanBERT (Joshi et al. 2020) and
  ALBERT (Lan et al. 2020): the final state of ``[CLS]`` (position 0) through the pooler (dense +
  tanh, part of the backbone), dropout, a linear layer. Token tasks and span QA read every token
  (QA: start and end vectors S, E as one ``Linear(D, 2)``). With the pooler's weights named as the
  backbone's, these heads equal Hugging Face's ``BertForSequenceClassification`` /
  ``...ForTokenClassification`` / ``...ForQuestionAnswering`` / ``...ForMultipleChoice``
  (``pooler`` -> ``bert.pooler.dense``, ``classifier`` -> ``classifier``, ``qa_outputs`` ->
  ``qa_outputs``; RoBERTa's ``classifier.dense`` / ``classifier.out_proj`` are our pooler and
  classifier: the same function).
- XLM (Lample & Conneau 2019, sec. 5.1): "a linear classifier on top of the first hidden state":
  the last hidden state at position 0 as it is (XLM has no pooler), dropout, ``classifier``; the
  same function as HF's ``XLMForSequenceClassification`` (its ``sequence_summary.summary``).
- XLNet (Yang et al. 2019): the last token (the data stage puts ``[CLS]`` last) through HF's
  sequence summary (``summary``: dense + tanh), dropout, ``classifier`` (HF's ``logits_proj``).
- GPT / GPT-2 (Radford et al. 2018, sec. 3.2-3.3): inputs are ``start a delim b extract`` (built
  in ``pipelines.finetune``); a linear layer without bias on the extract token, the last real
  token (HF's ``score``), plus the auxiliary language-modelling loss
  ``L = L_task + lm_weight * L_LM`` over the inputs with the tied output embedding. Similarity
  tasks (``symmetric``) feed both orders and add the two extract vectors before the linear layer;
  multiple choice runs one sequence per option with a softmax across options.
- Transformer-XL (Dai et al. 2019) was not fine-tuned in its paper. Our choice: read it like GPT,
  its last real token, with no memory (one segment per example) and no auxiliary loss; a
  left-to-right model sees the whole input only at its last token.
- ELMo (Peters et al. 2018, sec. 3.3): feature-based by default. The biLM is frozen; a task-learned
  scalar mix ``gamma * sum_j softmax(s)_j h_j`` of its layers, dropout after it, concatenated with
  the context-independent token layer ``x`` (the paper concatenates ELMo with the task model's
  own token input; the char-CNN layer is that input here), feeds a 2-layer BiLSTM task model.
- Sentence embeddings (kind ``embedding``; Reimers & Gurevych 2019, "Sentence-BERT", trained as
  sentence-transformers' ``MultipleNegativesRankingLoss``: Henderson et al. 2017, "Efficient Natural
  Language Response Suggestion", sec. 4.4; the InfoNCE of van den Oord et al. 2018): no head. Each of
  an example's K texts (anchor, positive, hard negatives) runs through the backbone alone and is
  pooled as ``ctx serve`` pools it (``pooling``: the mean over real tokens, [CLS]'s state, or the
  last real token's); the loss is the cross-entropy of the anchors' ``scale``-times cosine
  similarities to every positive and negative of the batch, an anchor's own positive the right
  class. Pooling reads the last layer as it is (no pooler, no summary), so the vectors trained are
  the ones served and exported to sentence-transformers.
- AWD-LSTM as ULMFiT fine-tunes it (Howard & Ruder 2018, sec. 3.3): concat pooling of the last
  LSTM's outputs H over the real tokens, ``[h_T; maxpool(H); meanpool(H)]``, then two blocks of
  batch normalisation and dropout around a linear layer: BN, dropout, Linear(3D, 50), ReLU (the
  ``pool`` module), BN, dropout, ``classifier`` Linear(50, L). Token tasks read H per token.

Feature-based use of any family (``freeze: true``, ``features: ...``), as the BERT paper's NER
table (sec. 5.3): the backbone's layers are combined (``ctxmodels.features.combine_layers``) and
feed a linear layer or a 2-layer BiLSTM (``task_model``). Token tasks read each token's output;
sequence tasks the mean over real tokens.

Training token classification with ``labelled_positions_only=True`` (what ``ctx finetune`` does)
computes the head, and for BERT-family backbones the last block's output projection, feed-forward
layer and LayerNorms (``BertModel.last_hidden_at``), only where a label sits: the loss and every
gradient are those of the full computation, and ``logits`` holds those positions' rows. A model
compiled whole (``train.compile: graphs`` on one GPU, for a task model whose ``static_step`` holds)
reads every position instead: the labelled rows' count is found on the device, a shape no graph
keeps; the loss and gradients are the same.

Shape legend:
    B  batch      K  options (multiple choice), 2 orders (symmetric) or texts (embedding)      T  tokens
    D  width of the backbone's states          L  labels
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ctxmodels import registry
from ctxmodels.compiling import has_static_step
from ctxmodels.elmo import ScalarMix
from ctxmodels.features import FeatureStrategy, combine_layers, mean_pool, n_combined
from ctxmodels.ops import Dropout
from ctxmodels.task_kinds import (  # noqa: F401 (TASK_KINDS re-exported)
    PAIR_LOSSES, TASK_KINDS, TaskKind, check_directions, check_embedding_loss, task_of,
)

IGNORE_INDEX = -100
# (B, ...) rows of this worker -> (every worker's rows, in worker order, with their gradients; where
# this worker's start): set on an embedding model by the training loop when it runs on several
# workers (jobs.training.parallel.gather_rows); model code itself stays single-device.
Gather = Callable[[Tensor], tuple[Tensor, int]]

# Where each family reads a sequence's vector: "first" ([CLS] through the pooler), "first-state"
# (XLM: position 0's last hidden state as it is), "summary" (XLNet: last token, dense + tanh),
# "last" (the last real token as it is).
READS: dict[str, str] = {
    "bert": "first", "roberta": "first", "spanbert": "first", "albert": "first", "xlm": "first-state",
    "xlnet": "summary", "gpt": "last", "transformer-xl": "last", "elmo": "features", "awd-lstm": "concat-pool",
}
# Families whose token_type_ids are not sentence segments, so the segment ids of fine-tuning inputs
# ([CLS] a [SEP] b [SEP] gives b type 1) are not given to them: RoBERTa has one type (its HF
# tokenizer gives zeros), and XLM's table holds languages (every token reads the row of the task's
# ``language``: the training texts' language, or another one for cross-lingual transfer).
NO_SEGMENTS = ("roberta", "xlm")
# Left-to-right families: position 0 has seen no text, so "cls" pooling gives one vector for every
# input (an XLM pretrained with objective clm too: its ``config.causal``).
CAUSAL_FAMILIES = ("gpt", "transformer-xl", "awd-lstm")
# ULMFiT's classifier (sec. 4): a hidden layer of 50; its first block's dropout is the task's (or the
# family's, 0.4), the second's this one (fastai's ULMFiT classifier: dropouts 0.4 and 0.1).
CONCAT_POOL_HIDDEN, CONCAT_POOL_DROPOUT = 50, 0.1


@dataclass
class TaskConfig:
    kind: TaskKind = "classification"
    num_labels: int = 2  # classification / token-classification; 1 otherwise
    labels: list[str] = field(default_factory=list)  # names, index = class id (from the training split)
    dropout: float | None = None  # before the head; None = the family's dropout
    lm_weight: float = 0.5  # GPT's auxiliary LM loss weight (0 turns it off)
    symmetric: bool = False  # input (B, 2, T): both orders, vectors added (GPT similarity tasks)
    freeze: bool = False  # backbone not trained (feature-based)
    features: FeatureStrategy | None = None  # None: fine-tune end to end, reading the paper's vector
    task_model: Literal["linear", "bilstm"] = "linear"
    input_style: Literal["bert", "xlnet", "gpt"] = "bert"
    lstm_dim: int = 256  # per direction, task_model bilstm
    # XLM with a language table: the row every token reads (the language of the texts; XLM's
    # cross-lingual transfer fine-tunes on one and evaluates on others), and the rows' names.
    language: int = 0
    languages: list[str] = field(default_factory=list)
    # Embedding: how a text's token states become its vector (what ctx serve's /v1/embeddings gives
    # unasked, as a sentence-transformers folder's Pooling module), whether served vectors are unit
    # length (its Normalize module), the tokens a served text keeps (its max_seq_length; None: the
    # model's positions), and the loss's scale on cosine similarities (sentence-transformers' 20,
    # a temperature of 0.05).
    pooling: Literal["mean", "cls", "last"] = "mean"
    normalize: bool = True
    max_seq_length: int | None = None
    scale: float = 20.0
    # The embedding kind's loss (ctxmodels.task_kinds.EMBEDDING_LOSSES): the in-batch negatives of
    # (anchor, positive[, negatives]) records, or a loss on pairs scored for similarity (``pair_loss``).
    loss: str = "multiple_negatives_ranking"
    # Matryoshka representation learning (Kusupati et al. 2022; sentence-transformers' MatryoshkaLoss):
    # the loss is also taken on each vector's first d dimensions, re-normalised, weighted (default 1
    # each), so a client asking /v1/embeddings for ``dimensions: d`` gets a vector trained to be one.
    matryoshka_dims: list[int] = field(default_factory=list)
    matryoshka_weights: list[float] = field(default_factory=list)
    # Which similarities the in-batch loss's softmax holds, and how it is normalised (``in_batch_negatives``;
    # sentence-transformers' MultipleNegativesRankingLoss ``directions`` and ``partition_mode``).
    directions: list[str] = field(default_factory=lambda: ["query_to_doc"])
    partition_mode: Literal["joint", "per_direction"] = "joint"
    # Hardness weighting of the negatives' logits (``in_batch_negatives``; sentence-transformers' names).
    hardness_mode: Literal["in_batch_negatives", "hard_negatives", "all_negatives"] | None = None
    hardness_strength: float = 0.0

    def __post_init__(self) -> None:
        if task_of(self.kind).labelled and self.num_labels < 1:
            raise ValueError(f"num_labels={self.num_labels}: a {self.kind} task needs at least one label")
        if self.pooling not in ("mean", "cls", "last"):
            raise ValueError(f"pooling={self.pooling!r}: expected mean, cls or last")
        if not self.scale > 0:
            raise ValueError(f"scale={self.scale!r}: the loss's scale on cosine similarities must be positive")
        self.matryoshka_dims = [int(d) for d in self.matryoshka_dims]
        self.matryoshka_weights = [float(w) for w in self.matryoshka_weights] or [1.0] * len(self.matryoshka_dims)
        if len(self.matryoshka_weights) != len(self.matryoshka_dims) or any(d < 1 for d in self.matryoshka_dims):
            raise ValueError(f"matryoshka_dims={self.matryoshka_dims}, matryoshka_weights={self.matryoshka_weights}: "
                             "positive widths, and one weight per width (or none: 1 each)")
        self.labels = [str(x) for x in self.labels]
        self.directions = list(self.directions)
        check_directions(self.directions, self.partition_mode, self.hardness_mode, self.hardness_strength)
        check_embedding_loss(self.loss)
        if self.loss in PAIR_LOSSES and (self.directions != ["query_to_doc"] or self.partition_mode != "joint" or self.hardness_mode):
            raise ValueError(f"loss={self.loss!r} scores pairs: directions, partition_mode and hardness_mode belong to "
                             "the in-batch loss (multiple_negatives_ranking)")


@dataclass
class TaskOutput:
    """``loss`` (None without targets) carries the gradient; ``metrics`` holds detached 0-d tensors."""

    loss: Tensor | None
    logits: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def language_row(names: list[str], rows: int, wanted: str | int) -> int:
    """The row of an XLM's language table (``rows`` of them, named ``names`` or unnamed) that
    ``wanted`` is, a name or a row number; ValueError naming what the table has."""
    if rows < 2:
        raise ValueError(f"language {wanted!r}: the model has no language embeddings (only an XLM trained on two languages or more has)")
    if isinstance(wanted, str):
        if wanted not in names:
            known = f"its languages are {names}" if names else "its checkpoint names none: give the row's number"
            raise ValueError(f"language {wanted!r} is not one of the model's; {known}")
        return names.index(wanted)
    if isinstance(wanted, bool) or not 0 <= wanted < rows:
        raise ValueError(f"language {wanted!r} is not a row of its language table (0..{rows - 1})")
    return wanted


def is_causal(family: str, cfg: Any) -> bool:
    return family in CAUSAL_FAMILIES or bool(getattr(cfg, "causal", False))


def default_pooling(family: str, cfg: Any) -> str:
    """How an embedding model of ``family`` pools when nothing says otherwise: the mean over real
    tokens, or in a left-to-right model the last real token, the one that has seen the whole text
    (sentence-transformers' ``lasttoken``, what decoder embedding models use)."""
    return "last" if is_causal(family, cfg) else "mean"


def effective_task(family: str, task: TaskConfig) -> TaskConfig:
    """ELMo is feature-based unless the recipe says otherwise (frozen biLM, scalar mix, BiLSTM)."""
    if family == "elmo" and task.features is None:
        return dataclasses.replace(task, features="scalar-mix", freeze=True, task_model="bilstm")
    return task


class BiLSTM(nn.Module):
    """2-layer bidirectional LSTM over real tokens: (B, T, D_in) -> (B, T, 2 * H)."""

    def __init__(self, d_in: int, hidden: int, dropout: float):
        super().__init__()
        self.lstm = nn.LSTM(d_in, hidden, num_layers=2, batch_first=True, bidirectional=True, dropout=dropout)
        self.d_out = 2 * hidden

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:
        lengths = attention_mask.sum(dim=1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return out  # (B, T, 2H)


def _init_linear(layer: nn.Linear, std: float, generator: torch.Generator | None) -> nn.Linear:
    nn.init.normal_(layer.weight, std=std, generator=generator)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


def _init_lstm(lstm: nn.LSTM, generator: torch.Generator | None) -> None:
    for name, p in lstm.named_parameters():
        if "bias" in name:
            nn.init.zeros_(p)
        else:
            bound = 1.0 / p.shape[1] ** 0.5
            nn.init.uniform_(p, -bound, bound, generator=generator)


def last_real(h: Tensor, attention_mask: Tensor | None) -> Tensor:
    """(B, T, D) -> (B, D): each row's last real token (rows are right-padded)."""
    if attention_mask is None:
        return h[:, -1]
    idx = (attention_mask.sum(dim=1) - 1).clamp(min=0)  # (B,)
    return h[torch.arange(h.shape[0], device=h.device), idx]


def masked_mean(h: Tensor, attention_mask: Tensor | None) -> Tensor:
    if attention_mask is None:
        return h.mean(dim=1)
    m = attention_mask.to(h.dtype).unsqueeze(-1)  # (B, T, 1)
    return (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


# ------------------------------------------------------------------------------- losses
# Each task's loss (``Task.loss`` names it) and the running metrics a training step logs: a loss
# function takes the logits and the targets ``Task.targets`` names, in that order.


def cross_entropy(logits: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Classes (B, L), or options (B, K): cross-entropy and accuracy."""
    loss = F.cross_entropy(logits, labels)
    return loss, {"acc": (logits.detach().argmax(-1) == labels).float().mean()}


def mse(logits: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """One value per example (B,): mean squared error."""
    return F.mse_loss(logits, labels.to(logits.dtype)), {}


def token_cross_entropy(logits: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Tags (B, T, L) or the labelled rows alone (M, L): cross-entropy over labelled positions
    (``IGNORE_INDEX`` elsewhere) and their accuracy."""
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    seen = labels != IGNORE_INDEX
    hits = (logits.detach().argmax(-1) == labels) & seen  # no boolean gather: the same shapes every batch
    return loss, {"token_acc": hits.sum() / seen.sum().clamp(min=1)}  # 0 where nothing is labelled


def span_cross_entropy(logits: Tensor, start_positions: Tensor, end_positions: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Span QA (B, T, 2): the mean of the start and end positions' cross-entropies (BERT sec. 4.2);
    positions past the window are clamped to its last token, as Hugging Face does."""
    T = logits.shape[1]
    start, end = start_positions.clamp(0, T - 1), end_positions.clamp(0, T - 1)
    return (F.cross_entropy(logits[..., 0], start) + F.cross_entropy(logits[..., 1], end)) / 2, {}


def in_batch_negatives(vectors: Tensor, scale: float = 20.0, gather: Gather | None = None, dims: Sequence[int] = (),
                       weights: Sequence[float] = (), directions: Sequence[str] = ("query_to_doc",),
                       partition_mode: str = "joint", hardness_mode: str | None = None,
                       hardness_strength: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Texts' vectors (B, K, D), anchor first, then its positive and K-2 hard negatives: each anchor
    against all B*(K-1) candidates of the batch (the positives, then the first negatives, ...: the
    order sentence-transformers' MultipleNegativesRankingLoss concatenates them in), ``scale`` times
    the cosine similarity, cross-entropy with its own positive the right class; and how often that
    positive scores highest (``acc``). ``gather``: every worker's batch as candidates (``Gather``,
    sentence-transformers' ``gather_across_devices``), so the anchors of each worker rank against all.
    ``dims``: the loss is instead the sum, times ``weights``, of this loss on each vector's first d
    dimensions re-normalised (sentence-transformers' MatryoshkaLoss around it); ``acc`` stays the full width's.

    ``directions`` (sentence-transformers' MultipleNegativesRankingLoss ``directions``): besides each
    anchor against the documents (``query_to_doc``), each positive against every anchor
    (``doc_to_query``: the symmetric loss), each anchor against the other anchors (``query_to_query``),
    each positive against the other records' documents (``doc_to_doc``); the positive pair's score
    is the right one in each. ``partition_mode`` joint: one softmax over all of them (GTE's improved
    contrastive loss with all four); per_direction: each direction's own softmax, the log-partitions
    averaged (Jina's symmetric loss with query_to_doc and doc_to_query).

    ``hardness_mode`` (sentence-transformers' ``hardness_mode``/``hardness_strength``): the anchor's
    logit of some negatives gains ``hardness_strength`` times their cosine similarity (no gradient
    through it), so the harder ones weigh more in the softmax: ``in_batch_negatives`` the other
    records' texts (Lan et al. 2025), ``hard_negatives`` the record's own negatives (Schechter Vera et
    al. 2025), ``all_negatives`` both. ``acc`` reads the plain scores."""
    B, K, D = vectors.shape
    pool, first = (vectors, 0) if gather is None else gather(vectors)  # (W*B, K, D), this worker's first row there
    rows = torch.arange(B, device=vectors.device)
    right = first + rows

    def at(width: int) -> tuple[Tensor, Tensor]:
        v = F.normalize(pool[..., :width].float(), dim=-1)  # cosine similarity, in float32 whatever the model's dtype
        queries, anchors, positives = v[:, 0], v[first : first + B, 0], v[first : first + B, 1]  # (W*B, d), (B, d), (B, d)
        candidates = v[:, 1:].transpose(0, 1).reshape(-1, width)  # (K-1)*W*B rows: every positive, then negatives
        cosine = anchors @ candidates.T  # (B, (K-1)*W*B)
        column = torch.arange(candidates.shape[0], device=v.device)
        record = column % len(queries)  # each candidate's record
        plain = scale * cosine
        scores = {"query_to_doc": plain}
        if hardness_mode is not None:
            own, positive_block = record[None, :] == right[:, None], (column < len(queries))[None, :]
            harder = {"in_batch_negatives": ~own, "hard_negatives": own & ~positive_block, "all_negatives": ~(own & positive_block)}
            scores["query_to_doc"] = plain + hardness_strength * cosine.detach() * harder[hardness_mode]
        if "query_to_query" in directions:  # (B, W*B), an anchor never against itself
            scores["query_to_query"] = (scale * anchors @ queries.T).masked_fill(record[None, : len(queries)] == right[:, None], -torch.inf)
        if "doc_to_query" in directions:  # (B, W*B): the positive pair's score at the anchor's column
            scores["doc_to_query"] = scale * positives @ queries.T
        if "doc_to_doc" in directions:  # (B, (K-1)*W*B), never a document of its own record
            scores["doc_to_doc"] = (scale * positives @ candidates.T).masked_fill(record[None, :] == right[:, None], -torch.inf)
        positive = scores["query_to_doc"][rows, right]
        if partition_mode == "joint":
            log_z = torch.logsumexp(torch.cat(list(scores.values()), dim=1), dim=1)
        else:
            log_z = sum(torch.logsumexp(s, dim=1) for s in scores.values()) / len(scores)
        return (log_z - positive).mean(), plain

    loss, scores = at(D)
    loss = over_widths(lambda d: at(d)[0], loss, D, dims, weights)
    return loss, {"acc": (scores.detach().argmax(-1) == right).float().mean()}


def over_widths(loss_at: Callable[[int], Tensor], full: Tensor, width: int, dims: Sequence[int], weights: Sequence[float]) -> Tensor:
    """``full`` (the loss on the whole ``width``), or with ``dims`` the sum, times ``weights`` (1 each),
    of the loss on each vector's first d dimensions, ``loss_at(d)`` (``full`` at the whole width):
    sentence-transformers' MatryoshkaLoss around a loss."""
    if not dims:
        return full
    return sum(w * (full if d == width else loss_at(d)) for d, w in zip(dims, weights or [1.0] * len(dims)))


def pair_similarities(vectors: Tensor, similarity: Literal["cosine", "angle"] = "cosine") -> Tensor:
    """(B,) float32: the similarity of each pair's two texts from their vectors (B, 2, D). ``cosine``;
    or ``angle``, AnglE's (Li & Li 2024): the unit vectors read as complex numbers, dimension i the
    real part of the number whose imaginary part is dimension i + D/2, and the similarity is
    |cos + sin| of their angle difference (sentence-transformers' ``pairwise_angle_sim``; an odd width
    gains a zero dimension first)."""
    v = F.normalize(vectors.float(), dim=-1)
    a, b = v[:, 0], v[:, 1]  # (B, D)
    cosine = (a * b).sum(-1)
    if similarity == "cosine":
        return cosine
    if a.shape[-1] % 2:
        a, b = F.pad(a, (0, 1)), F.pad(b, (0, 1))
    a_re, a_im = a.chunk(2, dim=-1)
    b_re, b_im = b.chunk(2, dim=-1)
    sine = (a_im * b_re - a_re * b_im).sum(-1)
    return (cosine + sine).abs()


def ranked_pairs(scores: Tensor, labels: Tensor) -> Tensor:
    """CoSENT's loss (Su 2022; sentence-transformers' CoSENTLoss): log(1 + sum of exp(s_j - s_i) over
    every two pairs i, j of the batch where pair i is scored more similar than pair j), so each
    such pair's ``scores`` (B,) are pushed into the labels' order; 0 when no two labels differ."""
    diff = scores[None, :] - scores[:, None]  # [i, j] = s_j - s_i
    wrong_way = diff.masked_fill(~(labels[:, None] > labels[None, :]), -torch.inf).reshape(-1)
    return torch.logsumexp(torch.cat([wrong_way.new_zeros(1), wrong_way]), dim=0)


def pair_loss(vectors: Tensor, labels: Tensor, loss: str = "cosent", scale: float = 20.0, dims: Sequence[int] = (),
              weights: Sequence[float] = ()) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of pairs scored for similarity: their texts' vectors (B, 2, D), their scores ``labels``
    (B,) (any scale where more is more similar: STS-B's 0-5, or 0-1). ``cosent``: ``ranked_pairs`` of
    ``scale`` times the cosine similarities; ``angle``: the same of AnglE's similarity (Li & Li 2024;
    sentence-transformers' AnglELoss); ``cosine_similarity``: the mean squared difference between
    the cosine and the score (sentence-transformers' CosineSimilarityLoss: scores in [-1, 1]).
    ``dims``: the sum, times ``weights``, of the loss on each vector's first d dimensions (MatryoshkaLoss
    around it), as ``in_batch_negatives``. Each worker's pairs alone, as sentence-transformers takes them."""
    labels = labels.float().reshape(-1)
    if vectors.shape[1] != 2 or labels.shape[0] != vectors.shape[0]:
        raise ValueError(f"{loss}: pairs (B, 2, D) and one score each, got vectors {tuple(vectors.shape)} and {labels.shape[0]} scores")

    def at(width: int) -> Tensor:
        similarity = pair_similarities(vectors[..., :width], "angle" if loss == "angle" else "cosine")
        return F.mse_loss(similarity, labels) if loss == "cosine_similarity" else ranked_pairs(scale * similarity, labels)

    D = vectors.shape[-1]
    return over_widths(at, at(D), D, dims, weights), {}


LOSSES = {
    "cross-entropy": cross_entropy,
    "mse": mse,
    "token-cross-entropy": token_cross_entropy,
    "span-cross-entropy": span_cross_entropy,
    "in-batch-negatives": in_batch_negatives,
}


class TaskModel(nn.Module):
    """``backbone`` (the family's, so pretrained weights load as they are) + the task head."""

    def __init__(self, family: str, cfg: Any, task: TaskConfig, generator: torch.Generator | None = None):
        super().__init__()
        task = effective_task(family, task)
        if family not in READS:
            raise ValueError(f"no task head for family {family!r}; known: {sorted(READS)}")
        self.family, self.cfg, self.task = family, cfg, task
        kind = self.spec = task_of(task.kind)  # what the kind reads, outputs and is trained with
        cls = registry.family_spec(family).pretraining_cls
        pre = cls(cfg, generator) if "generator" in inspect.signature(cls).parameters else cls(cfg)
        self.backbone = pre.backbone
        d = 2 * cfg.d_model if family == "elmo" else cfg.d_model
        std = getattr(cfg, "init_std", 0.02)
        p = task.dropout if task.dropout is not None else getattr(cfg, "dropout", 0.1)
        self.drop = Dropout(p)
        self.reads = "features" if task.features is not None else READS[family]
        if kind.reads == "texts" and (task.features is not None or task.freeze):
            raise ValueError(f"an embedding task trains the backbone's own vectors, the ones ctx serve pools: features "
                             f"and freeze are for heads on top of it ({family} "
                             + ("is feature-based: fine-tune a family whose backbone is trained end to end" if family == "elmo"
                                else f"with features={task.features!r}, freeze={task.freeze})"))
        if kind.reads == "texts" and any(d > cfg.d_model for d in task.matryoshka_dims):
            raise ValueError(f"matryoshka_dims={task.matryoshka_dims}: the model's vectors have {cfg.d_model} dimensions")
        if kind.reads == "texts" and task.pooling == "cls" and is_causal(family, cfg):
            raise ValueError(f"pooling 'cls': a causal {family} model's first position has seen no text; use 'last' or 'mean'")
        if self.reads == "first-state" and getattr(cfg, "causal", False) and kind.reads not in ("tokens", "texts"):
            raise ValueError(f"a causal XLM (pretrained with objective clm) cannot read a {task.kind} task's vector at "
                             "position 0, which sees only itself there; fine-tune an XLM pretrained with mlm or tlm "
                             "(the paper's), or a token-level task")

        # Feature-based: layer combination (+ learned scalar mix) and a task model.
        self.mix = None
        self.encoder = None
        if self.reads == "features":
            n_states = cfg.n_layer + 1
            if task.features == "scalar-mix":
                self.mix = ScalarMix(n_states)
            width = d * n_combined(task.features)
            if family == "elmo":
                width += d  # ELMo is concatenated with the context-independent token layer
            if task.task_model == "bilstm":
                self.encoder = BiLSTM(width, task.lstm_dim, p)
                _init_lstm(self.encoder.lstm, generator)
                width = self.encoder.d_out
            d = width
        if family == "elmo":
            # ELMo reads characters: the tokenizer's table (V, max_chars), filled by set_char_table
            # and saved with the model.
            self.register_buffer("char_table", torch.zeros(cfg.vocab_size, cfg.max_chars, dtype=torch.long))

        self.summary = _init_linear(nn.Linear(d, d), std, generator) if self.reads == "summary" else None
        self.pool = None
        if self.reads == "concat-pool" and kind.reads != "tokens":
            self.pool = nn.Sequential(nn.BatchNorm1d(3 * d), Dropout(p), _init_linear(nn.Linear(3 * d, CONCAT_POOL_HIDDEN), std, generator),
                                      nn.ReLU(), nn.BatchNorm1d(CONCAT_POOL_HIDDEN))
            self.drop = Dropout(CONCAT_POOL_DROPOUT)  # the second block's, before ``classifier``
            d = CONCAT_POOL_HIDDEN
        n_out = task.num_labels if kind.labelled else len(kind.outputs)
        bias = not (self.reads == "last" and kind.reads != "tokens")  # GPT's sequence head has none (HF's score)
        if kind.head is not None:  # an embedding model's output is its pooled vectors
            setattr(self, kind.head, _init_linear(nn.Linear(d, n_out, bias=bias), std, generator))
        if task.freeze:
            for q in self.backbone.parameters():
                q.requires_grad_(False)
        # Whether the training forward keeps its shapes for a fixed (B, T) batch, so the whole model
        # compiles in one graph (``ctxmodels.compiling.has_static_step``; CUDA graphs under
        # ``train.compile: graphs``): a masked-LM family's backbone (no row count found on the device
        # as it runs) with no BiLSTM task model (its packed sequences read their lengths on the host).
        self.static_step = has_static_step(pre) and self.encoder is None
        # An embedding model on several workers: every worker's texts as each anchor's candidates, in
        # training (validation's shares differ in size; its metrics see the whole split anyway).
        self.gather: Gather | None = None

    # ------------------------------------------------------------------------------- helpers

    def set_char_table(self, table: Tensor) -> None:
        """ELMo only: token id -> character ids (``pipelines.char_ids.build_char_table``)."""
        if self.family != "elmo":
            raise ValueError(f"set_char_table is for ELMo; this model is {self.family!r}")
        if tuple(table.shape) != tuple(self.char_table.shape):
            raise ValueError(f"char table of shape {tuple(table.shape)}; the model needs {tuple(self.char_table.shape)}")
        self.char_table.copy_(table)

    def _inputs(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        if self.family != "elmo":
            return input_ids
        chars = self.char_table[input_ids]  # (B, T, C)
        if attention_mask is not None:
            chars = chars * (attention_mask != 0)[..., None]
        return chars

    def _segments(self, input_ids: Tensor, token_type_ids: Tensor | None, language_ids: Tensor | None = None) -> Tensor | None:
        """What the backbone's token_type_ids are: segments, none (RoBERTa), or an XLM's language rows:
        ``language_ids`` (B,), one per sequence, else the task's language for every token."""
        if self.family == "xlm" and language_ids is not None:
            return language_ids[:, None].expand_as(input_ids)  # (B, T)
        if self.family == "xlm" and self.task.language:  # the language's row for every token
            return torch.full_like(input_ids, self.task.language)
        return None if self.family in NO_SEGMENTS else token_type_ids  # (XLM language 0: the table's row 0)

    def _states(self, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor | None,
                language_ids: Tensor | None = None) -> list[Tensor]:
        x = self._inputs(input_ids, attention_mask)
        token_type_ids = self._segments(input_ids, token_type_ids, language_ids)
        if self.task.freeze:
            with torch.no_grad():
                return [s.detach() for s in self.backbone.hidden_states(x, attention_mask, token_type_ids)]
        return self.backbone.hidden_states(x, attention_mask, token_type_ids)

    def token_vectors(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                      language_ids: Tensor | None = None) -> Tensor:
        """(B, T, D'): what token-level heads read. ``language_ids`` (B,): an XLM's language row per sequence."""
        states = self._states(input_ids, attention_mask, token_type_ids, language_ids)
        if self.reads != "features":
            return states[-1]
        h = combine_layers(states, self.task.features, self.mix)
        if self.family == "elmo":
            h = torch.cat([self.drop(h), states[0]], dim=-1)  # dropout after the mix (paper sec. 3.3)
        if self.encoder is not None:
            mask = attention_mask if attention_mask is not None else torch.ones(h.shape[:2], dtype=torch.long, device=h.device)
            h = self.encoder(h, mask)
        return h

    def labelled_vectors(
        self, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor | None, where: Tensor,
        language_ids: Tensor | None = None,
    ) -> Tensor:
        """(M, D'): ``token_vectors(...)[where]``, where (B, T) marks the positions to read. A
        backbone with ``last_hidden_at`` computes its last block at those positions alone."""
        fast = getattr(self.backbone, "last_hidden_at", None)
        if fast is not None and self.reads != "features" and not self.task.freeze:
            return fast(input_ids, attention_mask, self._segments(input_ids, token_type_ids, language_ids), where)
        return self.token_vectors(input_ids, attention_mask, token_type_ids, language_ids)[where]

    def sequence_vector(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                        language_ids: Tensor | None = None) -> Tensor:
        """(B, D'): what sequence-level heads read (see the module docstring)."""
        if self.reads in ("first", "first-state"):
            fast = getattr(self.backbone, "first_token_state", None)
            if fast is not None and not self.task.freeze:
                first = fast(input_ids, attention_mask, self._segments(input_ids, token_type_ids, language_ids))  # only [CLS] runs the last block
            else:
                first = self._states(input_ids, attention_mask, token_type_ids, language_ids)[-1][:, 0]
            return torch.tanh(self.backbone.pooler(first)) if self.reads == "first" else first  # (B, D)
        h = self.token_vectors(input_ids, attention_mask, token_type_ids, language_ids)
        if self.reads == "features":
            return masked_mean(h, attention_mask)
        if self.pool is not None:  # ULMFiT's concat pooling, then its first block
            real = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device) if attention_mask is None else attention_mask.bool()
            top = h.masked_fill(~real[..., None], float("-inf")).amax(dim=1)  # (B, D)
            return self.pool(torch.cat([last_real(h, attention_mask), top, masked_mean(h, attention_mask)], dim=-1))  # (B, 50)
        last = last_real(h, attention_mask)
        return torch.tanh(self.summary(last)) if self.reads == "summary" else last

    def text_vector(self, input_ids: Tensor, attention_mask: Tensor | None = None, language_ids: Tensor | None = None) -> Tensor:
        """(B, D): each text's vector as ``ctx serve`` pools it (``task.pooling`` of the last layer):
        what an embedding model is trained on and serves. Its texts have no segments."""
        h = self.token_vectors(input_ids, attention_mask, None, language_ids)  # (B, T, D)
        if self.task.pooling == "mean":
            return mean_pool(h.float(), attention_mask)  # summed in float32, as the server sums it, whatever the step's dtype
        if self.task.pooling == "cls":
            return h[:, 0]
        return last_real(h, attention_mask)

    def texts_loss(self, vectors: Tensor, labels: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
        """An embedding task's loss on its examples' text vectors (B, K, D) (``in_batch_negatives``
        with the task's scale and Matryoshka widths; every worker's texts as candidates while training,
        when ``gather`` is set). The forward's loss; a gradient-cached step calls it on the vectors of
        all its micro-batches at once (``jobs.training.loop.Stepper``). A pair loss (``task.loss``)
        reads the pairs' scores, ``labels`` (B,): ``pair_loss``."""
        if self.task.loss in PAIR_LOSSES:
            if labels is None:
                raise ValueError(f"loss {self.task.loss!r} needs each pair's score (labels)")
            loss, metrics = pair_loss(vectors, labels, self.task.loss, self.task.scale, self.task.matryoshka_dims,
                                      self.task.matryoshka_weights)
            metrics["task_loss"] = loss.detach()
            return loss, metrics
        loss, metrics = LOSSES[self.spec.loss](vectors, scale=self.task.scale, gather=self.gather if self.training else None,
                                               dims=self.task.matryoshka_dims, weights=self.task.matryoshka_weights,
                                               directions=self.task.directions, partition_mode=self.task.partition_mode,
                                               hardness_mode=self.task.hardness_mode, hardness_strength=self.task.hardness_strength)
        metrics["task_loss"] = loss.detach()
        return loss, metrics

    def _lm_loss(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """GPT's auxiliary objective: next-token prediction over the (flattened) inputs."""
        h = self.backbone.hidden_states(input_ids, attention_mask)[-1][:, :-1]  # (B, T-1, D)
        target = input_ids[:, 1:]
        if attention_mask is not None:
            target = target.masked_fill(attention_mask[:, 1:] == 0, IGNORE_INDEX)
        logits = F.linear(h, self.backbone.tok_emb.weight)  # (B, T-1, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX)

    # ------------------------------------------------------------------------------- forward

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,
        start_positions: Tensor | None = None,
        end_positions: Tensor | None = None,
        labelled_positions_only: bool = False,
        language_ids: Tensor | None = None,
        with_loss: bool = True,
    ) -> TaskOutput:
        """``labelled_positions_only`` (token classification with ``labels``): compute the head
        only where ``labels != -100``; ``logits`` is then (M, L), those positions in row-major
        order, and the loss and gradients are the same (see the module docstring).
        ``language_ids`` (B,): a multilingual XLM's row of its language table per example (a served
        request's language); None: the task's ``language`` for every token.
        ``with_loss=False``: the logits only, whatever targets are given (an embedding step's
        gradient cache takes the loss over several forwards' vectors: ``texts_loss``)."""
        kind = self.spec
        grouped = input_ids.dim() == 3  # (B, K, T): options, or both orders of a symmetric pair
        B = input_ids.shape[0]
        if grouped:
            T = input_ids.shape[-1]
            if language_ids is not None:
                language_ids = language_ids.repeat_interleave(input_ids.shape[1])  # (B*K,)
            input_ids = input_ids.reshape(-1, T)  # (B*K, T)
            attention_mask = attention_mask.reshape(-1, T) if attention_mask is not None else None
            token_type_ids = token_type_ids.reshape(-1, T) if token_type_ids is not None else None

        if kind.reads == "texts":
            v = self.text_vector(input_ids, attention_mask, language_ids)  # (B or B*K, D)
            logits = v.view(B, -1, v.shape[-1]) if grouped else v  # (B, K, D): an example's texts
        elif kind.reads != "tokens":
            v = self.sequence_vector(input_ids, attention_mask, token_type_ids, language_ids)  # (B or B*K, D)
            if grouped and kind.reads == "sequence":
                v = v.view(B, -1, v.shape[-1]).sum(dim=1)  # symmetric: the two orders' vectors added
            logits = self.classifier(self.drop(v))
            if kind.reads == "options":
                logits = logits.view(B, -1)  # (B, K)
            elif len(kind.outputs) == 1:
                logits = logits.squeeze(-1)  # (B,): one value per example
        elif labelled_positions_only and kind.labelled and labels is not None and not torch.compiler.is_compiling():
            # (compiled whole, the head reads every position: the labelled rows' count is found on
            # the device, a shape no graph keeps; the loss and gradients are the same either way)
            where = labels != IGNORE_INDEX  # (B, T)
            h = self.labelled_vectors(input_ids, attention_mask, token_type_ids, where, language_ids)  # (M, D)
            logits = self.classifier(self.drop(h))  # (M, L)
            labels = labels[where]  # (M,), the loss below reads them as it reads (B, T) labels
        else:
            h = self.drop(self.token_vectors(input_ids, attention_mask, token_type_ids, language_ids))  # (B, T, D)
            logits = getattr(self, kind.head)(h)  # (B, T, L) or (B, T, 2)

        loss, metrics = None, {}
        given = {"labels": labels, "start_positions": start_positions, "end_positions": end_positions}
        targets = [given[name] for name in kind.targets]
        if with_loss and kind.reads == "texts" and grouped:  # (B, K, T) to train; single texts are only encoded
            loss, metrics = self.texts_loss(logits, labels)
        elif with_loss and kind.reads != "texts" and all(t is not None for t in targets):
            loss, metrics = LOSSES[kind.loss](logits, *targets)
            metrics["task_loss"] = loss.detach()
            if self.family == "gpt" and self.task.lm_weight > 0 and not self.task.freeze:
                lm = self._lm_loss(input_ids, attention_mask)
                metrics["lm_loss"] = lm.detach()
                loss = loss + self.task.lm_weight * lm
        return TaskOutput(loss, logits, metrics)


def build_task_model(family: str, model_cfg: Any, task: TaskConfig, generator: torch.Generator | None = None) -> TaskModel:
    """A task model for ``family`` with a fresh backbone (load pretrained weights with ``load_backbone``).

    Every weight comes from ``generator`` (None: one seeded from fresh entropy); the layers'
    default draws run on a forked global RNG, which is left as it was (``registry.new_model``)."""
    if generator is None:
        generator = torch.Generator()
        generator.seed()
    with torch.random.fork_rng(devices=[]):
        return TaskModel(family, model_cfg, task, generator)


def load_backbone(task_model: TaskModel, pretrained: nn.Module) -> None:
    """Copy a pretrained (or task) model's backbone weights into ``task_model``'s backbone."""
    result = task_model.backbone.load_state_dict(pretrained.backbone.state_dict(), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"pretrained backbone does not fit the {task_model.family} task model: missing "
            f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
