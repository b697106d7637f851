"""Fine-tuning data: task records -> fixed-width model batches (project issue 8).

One sequence per example (or per option, or per context window), laid out as the model family
expects (``InputStyle``):

* ``bert``: ``[CLS] a [SEP] (b [SEP])``, token types 0 for ``[CLS] a [SEP]`` and 1 for ``b [SEP]``
  (Devlin et al. 2019, sec. 3 and Fig. 4);
* ``xlnet``: ``a [SEP] (b [SEP]) [CLS]``, token types 0 / 1 and 2 for the trailing ``[CLS]``
  (Yang et al. 2019; zihangdai/xlnet ``classifier_utils.convert_single_example``);
* ``gpt``: ``start a (delim b) extract`` (Radford et al. 2018, sec. 3.3 and Fig. 1), token types
  all 0; start = ``[CLS]``'s id, delim = ``[SEP]``'s, extract = ``extract_id`` (default the mask
  id, never seen in causal pretraining, so like the paper's new randomly initialised token). A
  tokenizer without them (a GPT-2 folder: ``<|endoftext|>`` only) uses its end-of-text token for
  each, and to pad: GPT-2 has no new tokens to learn, so the boundaries are the ones it was
  pretrained on between documents; the head still reads the last real token.

Every row is padded on the right to a FIXED ``max_len`` (Ray Data concatenates blocks, so widths
must agree; the training loop trims a batch to its longest real row). Over-long inputs are cut,
never refused: a pair loses tokens by Hugging Face's ``longest_first`` rule (the ``tokenizers``
Rust implementation; checked against ``BertTokenizerFast``) and the ``truncated`` column counts
it. Task encoders (``ENCODERS``) map columnar records to the columns below, whose names equal the
task model's ``forward`` keywords, plus bookkeeping columns the loop drops before calling it:

==================  ===============================  =====================================================
task                model columns                    bookkeeping
==================  ===============================  =====================================================
classification      input_ids, attention_mask,       example_id, truncated
                    token_type_ids (N, L) or (N, 2,
                    L) if symmetric; labels int64
regression          same; labels float32 (N,)        example_id, truncated
multiple-choice     ids etc. (N, K, L); labels (N,)  example_id, truncated
token-              ids etc. (N, L); labels (N, L)   word_ids (N, L) (-1 special/pad), example_id,
classification      -100 where not predicted         truncated
question-answering  ids etc. (F, L); start_positions, example_index, example_id, context_offsets
                    end_positions (F,)               (F, L, 2) (-1 outside the context), truncated
embedding           ids etc. (N, K, L): anchor,      doc_ids (N, K-1) (hash of each candidate's
                    positive, negatives; no labels   text), example_id, truncated
==================  ===============================  =====================================================

Embedding records (sentence-transformers' MultipleNegativesRankingLoss data: anchor, positive and
optional hard negatives) are encoded text by text exactly as the server encodes one text for
/v1/embeddings (``Tokenizer.ids_for_model``: ``[CLS] tokens [SEP]``, tokens alone for GPT-2-style
tokenizers), whatever ``input_style``: the vectors trained are the vectors served. Every record of
a batch has the same number of negatives (``n_negatives``, else the batch's most common count).

Question answering follows BERT's SQuAD recipe (Devlin et al. 2019, sec. 4.2-4.3) in Hugging
Face's form (``run_qa.py`` ``prepare_train_features``), the tests' reference: the question (at
most ``max_query_len`` tokens, leading whitespace stripped) is segment a, a window of the context
segment b; windows start every ``max_context - doc_stride`` tokens, i.e. ``doc_stride`` is the
number of tokens two consecutive windows SHARE (Hugging Face's ``stride``; google-research/bert's
``doc_stride`` is instead the step between window starts). A window that does not contain the
whole answer, and every window of an unanswerable SQuAD 2.0 question, points at position 0 (the
``[CLS]`` of the bert style; the first token, never a context token, in the other styles).

Records are columns (``dict[str, list | np.ndarray]``, a Ray Data batch). A record that cannot be
encoded (a missing or mistyped field, an answer whose ``answer_start`` does not point at its text)
raises ``RecordError`` naming the record and the field; ``check_records`` lists them all and
``drop_bad_records`` removes them, so a caller can count rejected records. A missing COLUMN is a
configuration error (a misspelled field name would reject everything) and raises ``ValueError``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, NamedTuple, get_args

import numpy as np

from ctxmodels.task_kinds import EMBEDDING_LOSSES, TASK_KINDS, TASKS, TaskKind, check_embedding_loss, scores_pairs
from pipelines.alignment import encode_texts, encode_words, first_subtokens
from pipelines.rng import stable_hash64

InputStyle = Literal["bert", "xlnet", "gpt"]

IGNORE_INDEX = -100  # label of positions without a target (Hugging Face / PyTorch convention)
NO_ANSWER_POSITION = 0  # start/end of a window without the answer (and of SQuAD 2.0 unanswerables)

# Field names tried, in order, when TaskDataConfig.text_field / pair_field are None (GLUE, HF).
TEXT_FIELDS = ("sentence1", "text", "sentence")
PAIR_FIELDS = ("sentence2", "text_pair")
ID_FIELDS = ("id", "idx")
# Embedding records (sentence-transformers' datasets: anchor/positive/negative, MS MARCO-style
# query/document, NLI pairs): tried when text_field / pair_field / negative_field are None.
ANCHOR_FIELDS = ("anchor", "query", "sentence1", "text", "sentence")
POSITIVE_FIELDS = ("positive", "document", "sentence2", "text_pair")
NEGATIVE_FIELDS = ("negative", "negatives")
# embedding with a pair loss: each pair's similarity score (label_field; by default "label", else
# "score", the column sentence-transformers' STS datasets name it).
SCORE_FIELDS = ("label", "score")


class RecordError(ValueError):
    """One record cannot be encoded; ``index`` is its row in the batch, ``field`` the culprit."""

    def __init__(self, index: int, field: str, reason: str):
        self.index, self.field, self.reason = index, field, reason
        super().__init__(f"record {index}: field {field!r}: {reason}")


# ------------------------------------------------------------------------------------- labels


def _label_string(v: Any) -> str:
    """A label as a string: integers (also 1.0 or numpy integers) in decimal, strings as they are."""
    if isinstance(v, str):
        return str(v)
    if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
        return str(int(v))
    if isinstance(v, (float, np.floating)) and float(v).is_integer():
        return str(int(v))
    raise ValueError(f"label {v!r} is neither a string nor an integer")


def _label_strings(values: Any) -> list[str]:
    arr = np.asarray(values, dtype=object).reshape(-1)
    return [_label_string(v) for v in arr.tolist()]


class LabelSet:
    """Class names in a fixed order (the model's output index = position here).

    ``LabelSet.from_values(train[label])`` sorts the training split's distinct labels (integers
    numerically, strings lexicographically); ``names`` are strings (integers as "0", "1", ...),
    stored with the model (TaskConfig.labels) and given back as ``LabelSet(names)``.
    """

    def __init__(self, names: Sequence[str]):
        self.names = tuple(str(n) for n in names)
        if len(set(self.names)) != len(self.names):
            dup = sorted({n for n in self.names if self.names.count(n) > 1})
            raise ValueError(f"LabelSet: duplicate label names {dup}")
        self._index = {n: i for i, n in enumerate(self.names)}

    @classmethod
    def from_values(cls, values: Any) -> LabelSet:
        """The distinct labels, sorted: numerically if every label is an integer, else as strings."""
        names = set(_label_strings(values))
        if all(n.lstrip("-").isdigit() for n in names):
            return cls(sorted(names, key=int))
        return cls(sorted(names))

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"LabelSet({list(self.names)})"

    def unknown_label(self, v: Any) -> str | None:
        """Why ``v`` cannot be encoded (not a label, or not in the set), or None if it can."""
        try:
            name = _label_string(v)
        except ValueError as e:
            return str(e)
        if name not in self._index:
            return f"label {v!r} is not one of the {len(self)} labels {list(self.names)[:20]} (from the training split)"
        return None

    def encode(self, values: Any) -> np.ndarray:
        """int64 indices of ``values`` (any shape); an unknown label raises ValueError naming it."""
        shape = np.shape(values)
        out = np.empty(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
        for i, v in enumerate(np.asarray(values, dtype=object).reshape(-1).tolist()):
            why = self.unknown_label(v)
            if why is not None:
                raise ValueError(why)
            out[i] = self._index[_label_string(v)]
        return out.reshape(shape)

    def decode(self, ids: Any) -> list[str]:
        return [self.names[i] for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist()]

    def continuation(self) -> np.ndarray:
        """int64 (K,): the label a non-first sub-token of a word gets when all sub-tokens are labelled:
        ``I-X`` for ``B-X`` if ``I-X`` exists (as Hugging Face ``run_ner.py``), else the label itself."""
        out = np.arange(len(self), dtype=np.int64)
        for i, name in enumerate(self.names):
            if name.startswith("B-") and "I-" + name[2:] in self._index:
                out[i] = self._index["I-" + name[2:]]
        return out


# ------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class TaskDataConfig:
    """How records of one task become model rows. Field names default to GLUE/CoNLL/SQuAD's."""

    kind: TaskKind = "classification"
    max_len: int = 128  # fixed row width (tokens, specials included)
    input_style: InputStyle = "bert"
    labels: tuple[str, ...] = ()  # LabelSet names (classification, token-classification)
    with_labels: bool = True  # False: prediction-time records without labels/answers
    symmetric: bool = False  # GPT similarity: both orders of the pair, (N, 2, L)
    label_all_subtokens: bool = False  # token-classification: label every piece (B-X -> I-X after the first)
    doc_stride: int = 128  # QA: tokens shared by consecutive context windows (HF `stride`)
    max_query_len: int = 64  # QA: question tokens kept
    version_2: bool = False  # QA: SQuAD 2.0, questions may have no answer
    extract_id: int | None = None  # gpt style: the extract token id (None: the tokenizer's mask id)
    text_field: str | None = None  # None: the first of TEXT_FIELDS present
    pair_field: str | None = None  # None: the first of PAIR_FIELDS present, else single texts
    label_field: str = "label"
    tokens_field: str = "tokens"
    tags_field: str = "tags"
    question_field: str = "question"
    context_field: str = "context"
    answers_field: str = "answers"
    options_field: str = "options"
    mc_question_field: str | None = None  # multiple-choice: a question put before each option (RACE)
    id_field: str | None = None  # None: the first of ID_FIELDS present, else the row index
    # embedding: hard negatives (a string or a list of strings per record); None: the first of
    # NEGATIVE_FIELDS present, else none (in-batch negatives only). Anchor and positive are
    # text_field and pair_field (None: the first of ANCHOR_FIELDS / POSITIVE_FIELDS present).
    negative_field: str | None = None
    # embedding: negatives every record must have; None: the batch's most common count.
    # finetune_stream.check_split sets the split's, so every batch of a split has one width.
    n_negatives: int | None = None
    # embedding: the loss the rows are for (ctxmodels.task_kinds.EMBEDDING_LOSSES; None: the in-batch
    # one); a pair loss reads (sentence1, sentence2, score) records: no negatives, a score each.
    loss: str | None = None

    @property
    def scored_pairs(self) -> bool:
        return scores_pairs(self.kind, self.loss)

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"TaskDataConfig.{key}={getattr(self, key)!r}: {why}")

        if self.kind not in TASKS:
            raise bad("kind", f"expected one of {TASK_KINDS}")
        if self.input_style not in get_args(InputStyle):
            raise bad("input_style", f"expected one of {get_args(InputStyle)}")
        for key in ("max_len", "doc_stride", "max_query_len"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(key, "expected a non-negative integer")
        if self.n_negatives is not None and (isinstance(self.n_negatives, bool) or not isinstance(self.n_negatives, int) or self.n_negatives < 0):
            raise bad("n_negatives", "expected a non-negative integer or None")
        if self.max_len < 3:
            raise bad("max_len", "need at least 3 positions for the special tokens of a pair")
        if self.loss is not None and self.kind != "embedding":
            raise bad("loss", f"an embedding task's loss, one of {EMBEDDING_LOSSES}")
        if self.loss is not None:
            check_embedding_loss(self.loss)
        if self.kind == "question-answering" and self.max_len - self.max_query_len - 3 <= self.doc_stride:
            raise bad(
                "doc_stride",
                f"windows must advance: max_len - max_query_len - 3 = {self.max_len - self.max_query_len - 3} context tokens "
                "per window must exceed doc_stride (the tokens two windows share)",
            )
        object.__setattr__(self, "labels", tuple(str(x) for x in self.labels))
        for f in fields(self):
            if f.name.endswith("_field"):
                value = getattr(self, f.name)
                if value is not None and (not isinstance(value, str) or not value):
                    raise bad(f.name, "expected a field name")


# ------------------------------------------------------------------------------ record columns


def _n_records(records: dict) -> int:
    sizes = {k: len(v) for k, v in records.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"record columns have different lengths: {sizes}")
    return next(iter(sizes.values()), 0)


def _column(records: dict, name: str, why: str = "") -> Sequence:
    if name not in records:
        raise ValueError(f"records have no field {name!r}{why} (fields: {sorted(records)}); set the TaskDataConfig field name")
    return records[name]


def _first_present(records: dict, names: Sequence[str]) -> str | None:
    return next((n for n in names if n in records), None)


def _type_name(v: Any) -> str:
    return "nothing (missing)" if v is None else f"{type(v).__name__} {v!r}"[:80]


class _Errors:
    """Record errors of one scan: raised at the first (``collect=False``) or gathered.

    The ``pick_*`` functions take one as their optional last argument: by default they raise the
    first ``RecordError``; ``check_records`` passes a collecting one to list them all.
    """

    def __init__(self, collect: bool):
        self.collect = collect
        self.errors: list[RecordError] = []
        self.bad: set[int] = set()

    def add(self, index: int, field: str, reason: str) -> None:
        err = RecordError(index, field, reason)
        if not self.collect:
            raise err
        self.errors.append(err)
        self.bad.add(index)


def _string(v: Any, i: int, field: str, errors: _Errors) -> str:
    if isinstance(v, str):
        return str(v)
    errors.add(i, field, f"expected a string, got {_type_name(v)}")
    return ""


def _string_list(v: Any, i: int, field: str, errors: _Errors) -> list[str]:
    if isinstance(v, (list, tuple, np.ndarray)) and all(isinstance(x, str) for x in v):
        return [str(x) for x in v]
    errors.add(i, field, f"expected a list of strings, got {_type_name(v)}")
    return []


def pick_text_pairs(records: dict, cfg: TaskDataConfig, errors: _Errors | None = None) -> tuple[list[str], list[str] | None]:
    """(texts, pairs or None) from ``cfg.text_field``/``pair_field`` (None: sentence1/text/sentence, sentence2/text_pair)."""
    errors = errors or _Errors(collect=False)
    text_field = cfg.text_field or _first_present(records, TEXT_FIELDS) or TEXT_FIELDS[0]
    column = _column(records, text_field, "" if cfg.text_field else f" (nor {list(TEXT_FIELDS[1:])})")
    texts = [_string(v, i, text_field, errors) for i, v in enumerate(column)]
    pair_field = cfg.pair_field or _first_present(records, PAIR_FIELDS)
    if pair_field is None:
        return texts, None
    pairs = [_string(v, i, pair_field, errors) for i, v in enumerate(_column(records, pair_field))]
    return texts, pairs


def _label_set(cfg: TaskDataConfig) -> LabelSet:
    if not cfg.labels:
        raise ValueError("TaskDataConfig.labels is empty: set it to LabelSet.from_values(<the training split's labels>).names")
    return LabelSet(cfg.labels)


def pick_class_labels(records: dict, cfg: TaskDataConfig, errors: _Errors | None = None) -> np.ndarray:
    """int64 (N,) indices into ``LabelSet(cfg.labels)``; an unknown label is a record error."""
    errors = errors or _Errors(collect=False)
    label_set = _label_set(cfg)
    values = list(_column(records, cfg.label_field))
    out = np.zeros(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        why = label_set.unknown_label(v)
        if why is None:
            out[i] = label_set._index[_label_string(v)]
        else:
            errors.add(i, cfg.label_field, why)
    return out


def pick_regression_targets(records: dict, cfg: TaskDataConfig, errors: _Errors | None = None) -> np.ndarray:
    errors = errors or _Errors(collect=False)
    out = np.zeros(_n_records(records), dtype=np.float32)
    for i, v in enumerate(_column(records, cfg.label_field)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(float(v)):
            errors.add(i, cfg.label_field, f"expected a finite number, got {_type_name(v)}")
        else:
            out[i] = float(v)
    return out


def pick_tagged_words(records: dict, cfg: TaskDataConfig, errors: _Errors | None = None) -> tuple[list[list[str]], list[np.ndarray] | None]:
    """(words, tag indices or None) per record, from ``tokens``/``tags``: one tag per word, each a
    string or integer in ``LabelSet(cfg.labels)``, returned as int64 indices into it."""
    errors = errors or _Errors(collect=False)
    words = [_string_list(v, i, cfg.tokens_field, errors) for i, v in enumerate(_column(records, cfg.tokens_field))]
    if not cfg.with_labels:
        return words, None
    label_set = _label_set(cfg)
    tags = []
    for i, v in enumerate(_column(records, cfg.tags_field)):
        tags.append(np.zeros(len(words[i]), dtype=np.int64))
        if not isinstance(v, (list, tuple, np.ndarray)):
            errors.add(i, cfg.tags_field, f"expected a list of tags, got {_type_name(v)}")
        elif len(v) != len(words[i]):
            errors.add(i, cfg.tags_field, f"{len(v)} tags for {len(words[i])} tokens")
        else:
            whys = [label_set.unknown_label(t) for t in v]
            bad = next((w for w in whys if w is not None), None)
            if bad is not None:
                errors.add(i, cfg.tags_field, bad)
            else:
                tags[-1] = label_set.encode(list(v)) if len(v) else tags[-1]
    return words, tags


def _answers(v: Any, i: int, cfg: TaskDataConfig, context: str, errors: _Errors) -> tuple[list[str], list[int]]:
    """SQuAD answers as (texts, starts): HF's {"text": [...], "answer_start": [...]} or the official [{"text", "answer_start"}]."""
    field = cfg.answers_field
    if isinstance(v, (list, tuple, np.ndarray)) and all(isinstance(a, dict) for a in v):
        v = {"text": [a.get("text") for a in v], "answer_start": [a.get("answer_start") for a in v]}
    if not isinstance(v, dict) or "text" not in v or "answer_start" not in v:
        errors.add(i, field, f"expected {{'text': [...], 'answer_start': [...]}}, got {_type_name(v)}")
        return [], []
    texts, starts = list(v["text"]), list(v["answer_start"])
    if len(texts) != len(starts):
        errors.add(i, field, f"{len(texts)} answer texts but {len(starts)} answer_start values")
        return [], []
    for text, start in zip(texts, starts):
        if not isinstance(text, str) or not text:
            errors.add(i, field, f"answer text must be a non-empty string, got {_type_name(text)}")
            return [], []
        if isinstance(start, (bool, np.bool_)) or not isinstance(start, (int, np.integer)):
            errors.add(i, field, f"answer_start must be an integer, got {_type_name(start)}")
            return [], []
        if context[start : start + len(text)] != text:
            found = context[max(start, 0) : max(start, 0) + len(text)]
            errors.add(i, field, f"answer_start {start} does not match the answer text {text!r} in the context (found {found!r} there)")
            return [], []
    if not texts and not cfg.version_2:
        errors.add(i, field, "no answer: unanswerable questions need TaskDataConfig.version_2=True (SQuAD 2.0)")
    return [str(t) for t in texts], [int(s) for s in starts]


def pick_squad(records: dict, cfg: TaskDataConfig, errors: _Errors | None = None) -> tuple[list[str], list[str], list[tuple[list[str], list[int]]] | None]:
    """(questions, contexts, answers or None): answers per record as (texts, answer_starts)."""
    errors = errors or _Errors(collect=False)
    questions = [_string(v, i, cfg.question_field, errors) for i, v in enumerate(_column(records, cfg.question_field))]
    contexts = [_string(v, i, cfg.context_field, errors) for i, v in enumerate(_column(records, cfg.context_field))]
    if not cfg.with_labels:
        return questions, contexts, None
    column = _column(records, cfg.answers_field)
    answers = [_answers(v, i, cfg, contexts[i], errors) for i, v in enumerate(column)]
    return questions, contexts, answers


def _most_common(counts: np.ndarray) -> int:
    """The most common value of ``counts`` (ties: the one seen first), 0 if there is none."""
    values, first, freq = np.unique(counts, return_index=True, return_counts=True)
    return int(values[np.lexsort((first, -freq))[0]]) if counts.size else 0


def pick_multiple_choice(records: dict, cfg: TaskDataConfig, errors: _Errors | None = None) -> tuple[list[str], list[list[str]], np.ndarray | None]:
    """(contexts, options (N x K), labels or None): every record must have the batch's K options
    (the most common count; on a tie the first record's), the label the index of the right one."""
    errors = errors or _Errors(collect=False)
    contexts = [_string(v, i, cfg.context_field, errors) for i, v in enumerate(_column(records, cfg.context_field))]
    options = [_string_list(v, i, cfg.options_field, errors) for i, v in enumerate(_column(records, cfg.options_field))]
    k = _most_common(np.array([len(o) for o in options if o], dtype=np.int64))
    for i, o in enumerate(options):
        if len(o) != k and i not in errors.bad:
            errors.add(i, cfg.options_field, f"{len(o)} options where the other records have {k}" if o else "no options")
    if cfg.mc_question_field:
        questions = [_string(v, i, cfg.mc_question_field, errors) for i, v in enumerate(_column(records, cfg.mc_question_field))]
        options = [[f"{q} {o}" for o in opts] for q, opts in zip(questions, options)]
    options = [o if len(o) == k else [""] * k for o in options]
    if not cfg.with_labels:
        return contexts, options, None
    labels = np.zeros(len(contexts), dtype=np.int64)
    for i, v in enumerate(_column(records, cfg.label_field)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not 0 <= v < max(k, 1):
            errors.add(i, cfg.label_field, f"expected the index of the right option in [0, {k}), got {_type_name(v)}")
        else:
            labels[i] = int(v)
    return contexts, options, labels


def _text(v: Any, i: int, field: str, errors: _Errors) -> str:
    """A non-empty string: an empty anchor or document would be trained on and retrieved as [CLS] [SEP]."""
    if isinstance(v, str) and v.strip():
        return str(v)
    errors.add(i, field, f"expected a non-empty string, got {_type_name(v)}")
    return ""


def _negatives(records: dict, cfg: TaskDataConfig, errors: _Errors) -> tuple[str | None, list[list[str] | None]]:
    """(field, each record's negatives): a string is one negative; a record without the field has
    none; None where the value is neither a string nor a list of non-empty strings (an error)."""
    field = cfg.negative_field or _first_present(records, NEGATIVE_FIELDS)
    if field is None:
        return None, [[] for _ in range(_n_records(records))]
    out: list[list[str] | None] = []
    for i, v in enumerate(_column(records, field)):
        if v is None:
            out.append([])
        elif isinstance(v, str):
            out.append([_text(v, i, field, errors)])
        elif isinstance(v, (list, tuple, np.ndarray)) and all(isinstance(x, str) and x.strip() for x in v):
            out.append([str(x) for x in v])
        else:
            errors.add(i, field, f"expected a non-empty string or a list of them, got {_type_name(v)}")
            out.append(None)
    return field, out


def _negative_width(negatives: list[list[str] | None], cfg: TaskDataConfig) -> int:
    if cfg.n_negatives is not None:
        return cfg.n_negatives
    return _most_common(np.array([len(x) for x in negatives if x is not None], dtype=np.int64))


def negative_count(records: dict, cfg: TaskDataConfig) -> int:
    """The negatives every embedding record must have: ``cfg.n_negatives``, else the records' most
    common count (ties: the earliest), as ``pick_multiple_choice`` fixes the options."""
    return _negative_width(_negatives(records, cfg, _Errors(collect=True))[1], cfg)


def pick_embedding_texts(records: dict, cfg: TaskDataConfig, errors: _Errors | None = None) -> list[list[str]]:
    """N x K texts: [anchor, positive, *negatives], K = 2 + ``negative_count``; every text a
    non-empty string. A record with another number of negatives is a record error."""
    errors = errors or _Errors(collect=False)
    anchor_field = cfg.text_field or _first_present(records, ANCHOR_FIELDS) or ANCHOR_FIELDS[0]
    column = _column(records, anchor_field, "" if cfg.text_field else f" (nor {list(ANCHOR_FIELDS[1:])})")
    anchors = [_text(v, i, anchor_field, errors) for i, v in enumerate(column)]
    positive_field = cfg.pair_field or _first_present(records, POSITIVE_FIELDS) or POSITIVE_FIELDS[0]
    column = _column(records, positive_field, "" if cfg.pair_field else f" (nor {list(POSITIVE_FIELDS[1:])})")
    positives = [_text(v, i, positive_field, errors) for i, v in enumerate(column)]
    field, negatives = _negatives(records, cfg, errors)
    k = _negative_width(negatives, cfg)
    others = "the other records have" if cfg.n_negatives is None else "TaskDataConfig.n_negatives (the split's count) is"
    for i, neg in enumerate(negatives):
        if neg is not None and len(neg) != k and i not in errors.bad:
            errors.add(i, field or NEGATIVE_FIELDS[0], f"{len(neg)} negatives where {others} {k}")
    return [[a, p, *(neg if neg is not None and len(neg) == k else [""] * k)] for a, p, neg in zip(anchors, positives, negatives)]


def pick_scored_pairs(records: dict, cfg: TaskDataConfig, errors: _Errors | None = None) -> tuple[list[list[str]], np.ndarray | None]:
    """(N x 2 texts, float32 (N,) scores or None without labels): pairs scored for similarity, read
    as the embedding task reads anchor and positive (sentence1/sentence2 by default), the score from
    ``label_field`` ("label", else "score" when the records have that and no "label")."""
    errors = errors or _Errors(collect=False)
    texts = []
    for given, defaults in ((cfg.text_field, ANCHOR_FIELDS), (cfg.pair_field, POSITIVE_FIELDS)):
        field = given or _first_present(records, defaults) or defaults[0]
        column = _column(records, field, "" if given else f" (nor {list(defaults[1:])})")
        texts.append([_text(v, i, field, errors) for i, v in enumerate(column)])
    pairs = [list(pair) for pair in zip(*texts)]
    if not cfg.with_labels:
        return pairs, None
    field = cfg.label_field
    if field == SCORE_FIELDS[0] and field not in records and SCORE_FIELDS[1] in records:
        field = SCORE_FIELDS[1]
    scores = pick_regression_targets(records, replace(cfg, label_field=field), errors)
    if cfg.loss == "cosine_similarity":  # its target is the cosine itself: a score no cosine reaches cannot be learnt
        for i in np.flatnonzero(np.abs(scores) > 1).tolist():
            errors.add(i, field, f"{scores[i]:g} is outside [-1, 1], the cosine's range that loss cosine_similarity fits: "
                                 "scale the scores (STS-B's 0-5: divide by 5) or use loss cosent or angle, which read only their order")
    return pairs, scores


def _check_embedding(records: dict, cfg: TaskDataConfig, errors: _Errors) -> None:
    (pick_scored_pairs if cfg.scored_pairs else pick_embedding_texts)(records, cfg, errors)


def example_ids(records: dict, cfg: TaskDataConfig, errors: _Errors | None = None) -> np.ndarray:
    """int64 (N,): the records' ids (``cfg.id_field``, else id/idx): integers as they are, strings
    hashed (63-bit, stable across processes); without an id field, the row index in the batch."""
    errors = errors or _Errors(collect=False)
    n = _n_records(records)
    field = cfg.id_field or _first_present(records, ID_FIELDS)
    if field is None:
        return np.arange(n, dtype=np.int64)
    out = np.zeros(n, dtype=np.int64)
    for i, v in enumerate(_column(records, field)):
        if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
            out[i] = int(v)
        elif isinstance(v, str):
            out[i] = stable_hash64(v)
        else:
            errors.add(i, field, f"expected an integer or string id, got {_type_name(v)}")
    return out


def _check_classes(records: dict, cfg: TaskDataConfig, errors: _Errors) -> None:
    pick_text_pairs(records, cfg, errors)
    if cfg.with_labels:
        pick_class_labels(records, cfg, errors)


def _check_values(records: dict, cfg: TaskDataConfig, errors: _Errors) -> None:
    pick_text_pairs(records, cfg, errors)
    if cfg.with_labels:
        pick_regression_targets(records, cfg, errors)


# Each kind's record checks: the same reading its encoder does (``ENCODERS``), collecting every error.
RECORD_CHECKS: dict[str, Callable[[dict, TaskDataConfig, _Errors], Any]] = {
    "classification": _check_classes,
    "regression": _check_values,
    "multiple-choice": pick_multiple_choice,
    "token-classification": pick_tagged_words,
    "question-answering": pick_squad,
    "embedding": _check_embedding,
}


def check_records(records: dict, cfg: TaskDataConfig) -> list[RecordError]:
    """Every record error of the batch, by record (empty if all records can be encoded)."""
    errors = _Errors(collect=True)
    RECORD_CHECKS[cfg.kind](records, cfg, errors)
    example_ids(records, cfg, errors)
    return sorted(errors.errors, key=lambda e: e.index)


def drop_bad_records(records: dict, cfg: TaskDataConfig) -> tuple[dict, list[RecordError]]:
    """(the records without the bad ones, their errors): count the errors as rejected records."""
    errors = check_records(records, cfg)
    if not errors:
        return records, []
    keep = np.setdiff1d(np.arange(_n_records(records)), [e.index for e in errors])
    out = {}
    for k, v in records.items():
        out[k] = v[keep] if isinstance(v, np.ndarray) else [v[i] for i in keep.tolist()]
    return out, errors


# ---------------------------------------------------------------------------------- SQuAD JSON


def flatten_squad(squad: dict) -> dict[str, list]:
    """Official SQuAD JSON (``data[].paragraphs[].qas[]``, v1.1 or v2.0) -> columns ``id, title,
    context, question, answers`` with ``answers = {"text": [...], "answer_start": [...]}`` (the
    flat shape of Hugging Face's ``squad`` / ``squad_v2`` datasets; unanswerable: empty lists).
    Missing keys inside a question become None, for the encoder to reject as a record error."""
    if not isinstance(squad, dict) or not isinstance(squad.get("data"), list):
        raise ValueError("SQuAD JSON: expected an object with a 'data' list (data[].paragraphs[].qas[])")
    cols: dict[str, list] = {"id": [], "title": [], "context": [], "question": [], "answers": []}
    for a, article in enumerate(squad["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            raise ValueError(f"SQuAD JSON: data[{a}] has no 'paragraphs' list")
        for p, paragraph in enumerate(paragraphs):
            qas = paragraph.get("qas") if isinstance(paragraph, dict) else None
            if not isinstance(qas, list):
                raise ValueError(f"SQuAD JSON: data[{a}].paragraphs[{p}] has no 'qas' list")
            for qa in qas:
                qa = qa if isinstance(qa, dict) else {}
                answers = qa.get("answers")
                if qa.get("is_impossible"):
                    answers = []
                if isinstance(answers, list) and all(isinstance(x, dict) for x in answers):
                    answers = {"text": [x.get("text") for x in answers], "answer_start": [x.get("answer_start") for x in answers]}
                cols["id"].append(qa.get("id"))
                cols["title"].append(article.get("title", ""))
                cols["context"].append(paragraph.get("context"))
                cols["question"].append(qa.get("question"))
                cols["answers"].append(answers)
    return cols


def read_squad_json(uri: str, store: Any = None) -> dict[str, list]:
    """``flatten_squad`` of a SQuAD JSON file (local path or URI, read with ``store``'s retries: a
    ``pipelines.storage.Store``; None: the default endpoint and deadline), decompressed by its name's
    ending (``pipelines.storage.ARROW_COMPRESSIONS``: ``Store.read_bytes`` opens with pyarrow's detection)."""
    from pipelines.storage import Store

    try:
        squad = json.loads((store or Store()).read_bytes(uri))
    except json.JSONDecodeError as e:
        raise ValueError(f"{uri}: not valid JSON ({e})") from e
    return flatten_squad(squad)


# ------------------------------------------------------------------------------ row assembly


class _Segment(NamedTuple):
    """Tokens ``[start, start + keep)`` of source row ``rows[r]`` go into output row r."""

    ids: np.ndarray  # int64 (M,) flat token ids of all source rows
    splits: np.ndarray  # int64 (S + 1,) source row boundaries
    rows: np.ndarray  # int64 (N,) source row of each output row
    start: np.ndarray  # int64 (N,) first source token taken (within its row)
    keep: np.ndarray  # int64 (N,) tokens taken


class _Placed(NamedTuple):
    """Where a segment's tokens landed: output (row, column) and flat source index, each (K,)."""

    rows: np.ndarray
    cols: np.ndarray
    src: np.ndarray


def _ragged(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    splits = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=splits[1:])
    flat = np.concatenate(arrays).astype(np.int64) if len(arrays) and splits[-1] else np.zeros(0, dtype=np.int64)
    return flat, splits


def _whole(flat: np.ndarray, splits: np.ndarray, keep: np.ndarray) -> _Segment:
    n = len(splits) - 1
    return _Segment(flat, splits, np.arange(n), np.zeros(n, dtype=np.int64), keep)


def _gather(seg: _Segment, first_col: np.ndarray) -> _Placed:
    """The flat source index and output cell of every kept token (vectorised over all rows)."""
    rows = np.repeat(np.arange(len(seg.keep)), seg.keep)  # (K,)
    first = np.cumsum(seg.keep) - seg.keep  # (N,) exclusive cumsum
    k = np.arange(len(rows)) - first[rows]  # (K,) index within the output row's segment
    src = seg.splits[seg.rows[rows]] + seg.start[rows] + k
    return _Placed(rows, first_col[rows] + k, src)


class _Specials(NamedTuple):
    pad: int
    cls: int
    sep: int
    extract: int


def _specials(tok, style: InputStyle, extract_id: int | None) -> _Specials:
    """The ids the style places. gpt: start, delim and extract are [CLS], [SEP] and [MASK] when the
    tokenizer has them, else its end-of-text token (GPT-2's ``<|endoftext|>``, its only special
    token), which also pads (attention_mask hides padding; Hugging Face pads GPT-2 with it too).
    bert / xlnet: [CLS], [SEP] and [PAD] are required; a missing one raises an error naming it and
    the tokenizer's folder. ``extract_id`` overrides the extract token."""
    if style != "gpt":
        return _Specials(int(tok.pad_id), int(tok.cls_id), int(tok.sep_id), -1)  # -1: no extract token in this style
    eos = tok.special_id("eos")

    def pick(role: str, use: str) -> int:
        found = tok.special_id(role)
        if found is None:
            found = eos if eos is not None else tok.require(role, f"GPT inputs need a {use} token and there is no end-of-text token to use instead")
        return int(found)

    pad, start, delim = pick("pad", "padding"), pick("cls", "start"), pick("sep", "delim")
    extract = pick("mask", "extract") if extract_id is None else int(extract_id)
    if not 0 <= extract < tok.vocab_size:
        raise ValueError(f"extract_id={extract} is outside the vocabulary [0, {tok.vocab_size})")
    return _Specials(pad, start, delim, extract)


def _build(style: InputStyle, a: _Segment, b: _Segment | None, max_len: int, sp: _Specials) -> tuple[dict[str, np.ndarray], _Placed, _Placed | None]:
    """Lay out ``a`` (and ``b``) with the style's special tokens into fixed-width (N, max_len) rows."""
    n = len(a.keep)
    la = a.keep
    lb = b.keep if b is not None else np.zeros(n, dtype=np.int64)
    pair = b is not None
    length = la + 2 + (lb + 1 if pair else 0)  # (N,) real tokens per row
    if int(length.max(initial=0)) > max_len:
        raise AssertionError("rows longer than max_len: truncation is wrong")
    specials: list[tuple[np.ndarray, int, int]] = []  # (column (N,), id, token type)
    if style == "bert":  # [CLS] a [SEP] (b [SEP])
        col_a, col_b = np.ones(n, dtype=np.int64), la + 2
        specials += [(np.zeros(n, dtype=np.int64), sp.cls, 0), (la + 1, sp.sep, 0)]
        if pair:
            specials.append((la + 2 + lb, sp.sep, 1))
        type_a, type_b = 0, 1
    elif style == "xlnet":  # a [SEP] (b [SEP]) [CLS]
        col_a, col_b = np.zeros(n, dtype=np.int64), la + 1
        specials.append((la, sp.sep, 0))
        if pair:
            specials.append((la + 1 + lb, sp.sep, 1))
        specials.append((length - 1, sp.cls, 2))
        type_a, type_b = 0, 1
    elif style == "gpt":  # start a (delim b) extract
        col_a, col_b = np.ones(n, dtype=np.int64), la + 2
        specials.append((np.zeros(n, dtype=np.int64), sp.cls, 0))
        if pair:
            specials.append((la + 1, sp.sep, 0))
        specials.append((length - 1, sp.extract, 0))
        type_a, type_b = 0, 0
    else:
        raise ValueError(f"input_style={style!r}; expected one of {get_args(InputStyle)}")
    input_ids = np.full((n, max_len), sp.pad, dtype=np.int64)  # (N, L)
    token_type_ids = np.zeros((n, max_len), dtype=np.int64)
    rows = np.arange(n)
    for col, tid, ttype in specials:
        input_ids[rows, col] = tid
        token_type_ids[rows, col] = ttype
    placed_a = _gather(a, col_a)
    input_ids[placed_a.rows, placed_a.cols] = a.ids[placed_a.src]
    token_type_ids[placed_a.rows, placed_a.cols] = type_a
    placed_b = None
    if pair:
        placed_b = _gather(b, col_b)
        input_ids[placed_b.rows, placed_b.cols] = b.ids[placed_b.src]
        token_type_ids[placed_b.rows, placed_b.cols] = type_b
    attention_mask = (np.arange(max_len)[None, :] < length[:, None]).astype(np.int64)  # (N, L)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}, placed_a, placed_b


def _longest_first(la: np.ndarray, lb: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens kept of each text of a pair under ``budget``, as Hugging Face ``tokenizers``' longest_first.

    The Rust ``truncate_encodings``: if the shorter text fits in half the budget it stays whole and
    the longer one gets the rest; otherwise the shorter gets ``budget // 2`` and the longer the
    other half (the extra token of an odd budget). On equal lengths the first text counts as the
    shorter. (The pure-Python tokenizers trim one token at a time instead, which differs by one
    token on ties and odd budgets; fast tokenizers are the ones used in practice.)
    """
    fits = la + lb <= budget
    a_short = la <= lb
    short = np.minimum(la, lb)
    small_ok = 2 * short <= budget
    keep_short = np.where(small_ok, short, budget // 2)
    keep_long = np.where(small_ok, budget - short, budget - budget // 2)
    ka = np.where(fits, la, np.minimum(la, np.where(a_short, keep_short, keep_long)))
    kb = np.where(fits, lb, np.minimum(lb, np.where(a_short, keep_long, keep_short)))
    return ka, kb


def encode_text_pairs(tok, texts: Sequence[str], pairs: Sequence[str] | None, max_len: int, style: InputStyle = "bert", extract_id: int | None = None) -> dict[str, np.ndarray]:
    """Texts (and pairs) -> ``input_ids``, ``attention_mask``, ``token_type_ids`` int64 (N, max_len)
    and ``truncated`` bool (N,); see the module doc for the layouts. Pairs are cut longest-first."""
    n_special = 3 if pairs is not None else 2
    if max_len < n_special:
        raise ValueError(f"max_len={max_len}: a {'pair' if pairs is not None else 'text'} needs {n_special} special tokens")
    sp = _specials(tok, style, extract_id)
    ids_a, splits_a = _ragged(tok.encode_batch(list(texts)))
    la = np.diff(splits_a)
    budget = max_len - n_special
    if pairs is None:
        ka = np.minimum(la, budget)
        cols, _, _ = _build(style, _whole(ids_a, splits_a, ka), None, max_len, sp)
        cols["truncated"] = ka < la
        return cols
    if len(pairs) != len(texts):
        raise ValueError(f"encode_text_pairs: {len(texts)} texts but {len(pairs)} pairs")
    ids_b, splits_b = _ragged(tok.encode_batch(list(pairs)))
    lb = np.diff(splits_b)
    ka, kb = _longest_first(la, lb, budget)
    cols, _, _ = _build(style, _whole(ids_a, splits_a, ka), _whole(ids_b, splits_b, kb), max_len, sp)
    cols["truncated"] = (ka < la) | (kb < lb)
    return cols


# ------------------------------------------------------------------------------ task encoders


def _pairs_maybe_symmetric(tok, texts: list[str], pairs: list[str] | None, cfg: TaskDataConfig) -> dict[str, np.ndarray]:
    if not cfg.symmetric:
        return encode_text_pairs(tok, texts, pairs, cfg.max_len, cfg.input_style, cfg.extract_id)
    if pairs is None:
        raise ValueError("TaskDataConfig.symmetric=True needs text pairs (set pair_field)")
    ab = encode_text_pairs(tok, texts, pairs, cfg.max_len, cfg.input_style, cfg.extract_id)
    ba = encode_text_pairs(tok, pairs, texts, cfg.max_len, cfg.input_style, cfg.extract_id)
    out = {k: np.stack([ab[k], ba[k]], axis=1) for k in ("input_ids", "attention_mask", "token_type_ids")}  # (N, 2, L)
    out["truncated"] = ab["truncated"] | ba["truncated"]
    return out


def encode_classification(records: dict, tok, cfg: TaskDataConfig) -> dict[str, np.ndarray]:
    """Single texts or pairs -> rows and ``labels`` int64 (N,) (indices into ``LabelSet(cfg.labels)``)."""
    texts, pairs = pick_text_pairs(records, cfg)
    labels = pick_class_labels(records, cfg) if cfg.with_labels else None
    out = _pairs_maybe_symmetric(tok, texts, pairs, cfg)
    if labels is not None:
        out["labels"] = labels
    out["example_id"] = example_ids(records, cfg)
    return out


def encode_regression(records: dict, tok, cfg: TaskDataConfig) -> dict[str, np.ndarray]:
    """Single texts or pairs -> rows and ``labels`` float32 (N,) (STS-B scores)."""
    texts, pairs = pick_text_pairs(records, cfg)
    labels = pick_regression_targets(records, cfg) if cfg.with_labels else None
    out = _pairs_maybe_symmetric(tok, texts, pairs, cfg)
    if labels is not None:
        out["labels"] = labels
    out["example_id"] = example_ids(records, cfg)
    return out


def encode_multiple_choice(records: dict, tok, cfg: TaskDataConfig) -> dict[str, np.ndarray]:
    """Context paired with each of K options -> rows (N, K, max_len), ``labels`` (N,) = right option."""
    contexts, options, labels = pick_multiple_choice(records, cfg)
    n, k = len(contexts), len(options[0]) if options else 0
    flat = encode_text_pairs(
        tok, [c for c in contexts for _ in range(k)], [o for opts in options for o in opts], cfg.max_len, cfg.input_style, cfg.extract_id
    )
    out = {key: flat[key].reshape(n, k, cfg.max_len) for key in ("input_ids", "attention_mask", "token_type_ids")}  # (N, K, L)
    out["truncated"] = flat["truncated"].reshape(n, k).any(axis=1)
    if labels is not None:
        out["labels"] = labels
    out["example_id"] = example_ids(records, cfg)
    return out


def encode_token_classification(records: dict, tok, cfg: TaskDataConfig) -> dict[str, np.ndarray]:
    """Words with one tag each -> rows, ``word_ids`` and ``labels`` (N, max_len).

    BERT (Devlin et al. 2019, sec. 5.3): the first sub-token of a word carries its label, the other
    pieces -100; ``label_all_subtokens`` labels every piece (``B-X`` becomes ``I-X`` after the first
    piece, as Hugging Face ``run_ner.py --label_all_tokens``). Words cut by truncation lose their
    labels (``truncated`` counts the rows).
    """
    words, tags = pick_tagged_words(records, cfg)
    word_labels = np.concatenate([np.zeros(0, dtype=np.int64), *tags]) if tags is not None else None  # (W,)
    al = encode_words(tok, words)
    n, budget = len(words), cfg.max_len - 2
    keep = np.minimum(al.lengths, budget)
    out, placed, _ = _build(cfg.input_style, _whole(al.ids, al.splits, keep), None, cfg.max_len, _specials(tok, cfg.input_style, cfg.extract_id))
    word_ids = np.full((n, cfg.max_len), -1, dtype=np.int64)  # (N, L)
    word_ids[placed.rows, placed.cols] = al.word_ids[placed.src]
    out["word_ids"] = word_ids
    if word_labels is not None:
        labels = np.full((n, cfg.max_len), IGNORE_INDEX, dtype=np.int64)  # (N, L)
        wid = al.word_ids[placed.src]
        has_word = wid >= 0
        token_label = word_labels[np.where(has_word, al.word_splits[placed.rows] + wid, 0)]  # (K,)
        first = first_subtokens(word_ids)[placed.rows, placed.cols]
        if cfg.label_all_subtokens:
            token_label = np.where(first, token_label, _label_set(cfg).continuation()[token_label])
            chosen = has_word
        else:
            chosen = first
        labels[placed.rows[chosen], placed.cols[chosen]] = token_label[chosen]
        out["labels"] = labels
    out["truncated"] = keep < al.lengths
    out["example_id"] = example_ids(records, cfg)
    return out


def encode_question_answering(records: dict, tok, cfg: TaskDataConfig) -> dict[str, np.ndarray]:
    """SQuAD records -> one row per context window (feature); see the module doc.

    ``start_positions``/``end_positions``: the tokens holding the first answer's first and last
    character, when the window holds the whole answer; else ``NO_ANSWER_POSITION``.
    ``example_index``: the record's row in ``records`` (what ``decode_qa`` merges windows by);
    ``context_offsets``: each context token's character span in its context, -1 elsewhere.
    """
    questions, contexts, answers = pick_squad(records, cfg)
    sp = _specials(tok, cfg.input_style, cfg.extract_id)
    q_ids, q_splits = _ragged(tok.encode_batch([q.lstrip() for q in questions]))  # as HF run_qa: leading spaces break byte-level BPE
    lq = np.diff(q_splits)
    kq = np.minimum(lq, cfg.max_query_len)  # (N,)
    ctx = encode_texts(tok, contexts)
    lc = ctx.lengths  # (N,)
    max_c = cfg.max_len - kq - 3  # (N,) context tokens per window
    step = max_c - cfg.doc_stride  # (N,) > 0 (TaskDataConfig checks it)
    n_win = 1 + -(-np.maximum(lc - max_c, 0) // step)  # (N,) ceil division
    ex = np.repeat(np.arange(len(questions)), n_win)  # (F,) example of each feature
    win = np.arange(len(ex)) - np.repeat(np.cumsum(n_win) - n_win, n_win)  # (F,) window number
    c_from = win * step[ex]
    c_keep = np.minimum(max_c[ex], lc[ex] - c_from)
    a = _Segment(q_ids, q_splits, ex, np.zeros(len(ex), dtype=np.int64), kq[ex])
    b = _Segment(ctx.ids, ctx.splits, ex, c_from, c_keep)
    out, _, placed = _build(cfg.input_style, a, b, cfg.max_len, sp)
    offsets = np.full((len(ex), cfg.max_len, 2), -1, dtype=np.int64)  # (F, L, 2)
    offsets[placed.rows, placed.cols] = ctx.offsets[placed.src]
    col_b = {"bert": kq[ex] + 2, "xlnet": kq[ex] + 1, "gpt": kq[ex] + 2}[cfg.input_style]  # (F,) first context column
    if answers is not None:
        has = np.array([len(t) > 0 for t, _ in answers], dtype=bool)  # (N,)
        s_char = np.array([s[0] if s else 0 for _, s in answers], dtype=np.int64)
        e_char = s_char + np.array([len(t[0]) if t else 0 for t, _ in answers], dtype=np.int64)
        # Character positions of all contexts on one axis (each row shifted by a running base), so
        # one searchsorted finds the answer's tokens for every feature.
        step_chars = np.fromiter((len(c) + 1 for c in contexts), dtype=np.int64, count=len(contexts))
        base = np.cumsum(step_chars) - step_chars  # (N,)
        token_row = np.repeat(np.arange(len(contexts)), lc)
        g_start = ctx.offsets[:, 0] + base[token_row]
        g_end = ctx.offsets[:, 1] + base[token_row]
        lo = ctx.splits[ex] + c_from  # (F,) flat index of the window's first context token
        hi = lo + c_keep  # (F,) one past its last
        safe_lo = np.minimum(lo, max(len(ctx.ids) - 1, 0))
        safe_last = np.clip(hi - 1, 0, max(len(ctx.ids) - 1, 0))
        if len(ctx.ids):
            inside = (c_keep > 0) & (ctx.offsets[safe_lo, 0] <= s_char[ex]) & (ctx.offsets[safe_last, 1] >= e_char[ex])
        else:
            inside = np.zeros(len(ex), dtype=bool)
        inside &= has[ex]
        si = np.clip(np.searchsorted(g_start, s_char[ex] + base[ex], side="right") - 1, lo, hi - 1)  # last token starting <= start
        ei = np.clip(np.searchsorted(g_end, e_char[ex] + base[ex], side="left"), lo, hi - 1)  # first token ending >= end
        out["start_positions"] = np.where(inside, col_b + si - lo, NO_ANSWER_POSITION).astype(np.int64)
        out["end_positions"] = np.where(inside, col_b + ei - lo, NO_ANSWER_POSITION).astype(np.int64)
    out["example_index"] = ex.astype(np.int64)
    out["example_id"] = example_ids(records, cfg)[ex]
    out["context_offsets"] = offsets
    out["truncated"] = (lq > kq)[ex]
    return out


def encode_text_rows(texts: list[str], tok, max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) int64 (N, max_len) and truncated bool (N,) of texts, each
    ``tok.ids_for_model(text, max_len)`` (what /v1/embeddings encodes) padded with ``tok.padding_id``."""
    # One token more than the row holds tells the texts that do not fit; only those are encoded
    # again at max_len, so the kept ids are ids_for_model's own (its truncation keeps [SEP]).
    ids = tok.ids_for_model(texts, max_len + 1)
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))  # (N,)
    cut = lengths > max_len
    long = np.flatnonzero(cut).tolist()
    for j, row in zip(long, tok.ids_for_model([texts[j] for j in long], max_len)):
        ids[j] = row
    lengths = np.minimum(lengths, max_len)
    input_ids = np.full((len(texts), max_len), tok.padding_id, dtype=np.int64)  # (N, L)
    if len(texts) and lengths.sum():
        rows = np.repeat(np.arange(len(texts)), lengths)
        cols = np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        input_ids[rows, cols] = np.concatenate(ids)
    attention_mask = (np.arange(max_len)[None, :] < lengths[:, None]).astype(np.int64)  # (N, L)
    return input_ids, attention_mask, cut


def encode_embedding(records: dict, tok, cfg: TaskDataConfig) -> dict[str, np.ndarray]:
    """Anchor, positive and negatives -> rows (N, K, max_len), one text per row (``encode_text_rows``);
    ``token_type_ids`` all 0 (one segment). ``doc_ids`` (N, K-1): ``stable_hash64`` of each candidate
    text, so the retrieval metrics see a text shared by records as one document. No labels: the
    anchor's positive is column 0 of the candidates. With a pair loss (``cfg.scored_pairs``): the
    two texts of each pair (N, 2, max_len) and their scores, ``labels`` float32 (N,); no ``doc_ids``."""
    if cfg.scored_pairs:
        pairs, scores = pick_scored_pairs(records, cfg)
        input_ids, attention_mask, cut = encode_text_rows([t for pair in pairs for t in pair], tok, cfg.max_len)  # (N*2, L)
        n = len(pairs)
        out = {
            "input_ids": input_ids.reshape(n, 2, cfg.max_len),
            "attention_mask": attention_mask.reshape(n, 2, cfg.max_len),
            "token_type_ids": np.zeros((n, 2, cfg.max_len), dtype=np.int64),
            "truncated": cut.reshape(n, 2).any(axis=1),
            "example_id": example_ids(records, cfg),
        }
        if scores is not None:
            out["labels"] = scores
        return out
    texts = pick_embedding_texts(records, cfg)
    n, k, max_len = len(texts), len(texts[0]) if texts else 2 + (cfg.n_negatives or 0), cfg.max_len
    input_ids, attention_mask, cut = encode_text_rows([t for row in texts for t in row], tok, max_len)  # (N*K, L)
    doc_ids = np.fromiter((stable_hash64(t) for row in texts for t in row[1:]), dtype=np.int64, count=n * (k - 1))
    return {
        "input_ids": input_ids.reshape(n, k, max_len),  # (N, K, L)
        "attention_mask": attention_mask.reshape(n, k, max_len),
        "token_type_ids": np.zeros((n, k, max_len), dtype=np.int64),
        "truncated": cut.reshape(n, k).any(axis=1),
        "doc_ids": doc_ids.reshape(n, k - 1),  # (N, K-1)
        "example_id": example_ids(records, cfg),
    }


ENCODERS: dict[str, Callable[[dict, Any, TaskDataConfig], dict[str, np.ndarray]]] = {
    "classification": encode_classification,
    "regression": encode_regression,
    "multiple-choice": encode_multiple_choice,
    "token-classification": encode_token_classification,
    "question-answering": encode_question_answering,
    "embedding": encode_embedding,
}


def encode_task(records: dict, tok, cfg: TaskDataConfig) -> dict[str, np.ndarray]:
    """``ENCODERS[cfg.kind](records, tok, cfg)``."""
    return ENCODERS[cfg.kind](records, tok, cfg)
