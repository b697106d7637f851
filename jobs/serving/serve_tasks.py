"""Task endpoints of the serving Gateway (``jobs/serving/serve.py``): fine-tuned heads and pretrained heads.

    POST /v1/classify    fine-tuned classification or regression: one text or [text, text_pair]
                         pairs -> labels with probabilities (best first), or the regression value
    POST /v1/tag         fine-tuned token classification: texts (a tag per whitespace-separated word) or
                         pre-split word lists (a tag per given word), each word with its index and
                         character offsets, and the entities they form over word indexes
                         (pipelines.metrics.entities: conlleval's rules, or strict IOB2 / IOBES)
    POST /v1/answer      fine-tuned span QA: answer text, character offsets, score (S_i + E_j), and
                         no-answer for SQuAD 2.0 models (pipelines.qa.decode_qa, windows merged)
    POST /v1/rerank      TEI's shape: {query, texts, raw_scores, return_text} -> [{index, score, text}],
                         best first, scored by a pair classifier (probability of its last label, of 2)
                         or a one-output regression model (the sigmoid of its value, as TEI; raw_scores: the value)
    POST /v1/fill-mask   pretrained BERT / RoBERTa / SpanBERT / ALBERT: the top-k tokens for every mask
                         token in the input, with probabilities and the filled-in text
    POST /v1/generate    pretrained GPT / GPT-2 / Transformer-XL / XLNet: greedy (temperature 0) or
                         sampled (temperature, top_k, top_p) continuations, keyed by ``seed``
    POST /tokenize       any model: ids, token strings and character offsets ([CLS] text [SEP])

What a model serves follows from its checkpoint (``routes_of``): a fine-tuned checkpoint (``ctx
finetune``; ``config.json`` holds its task, label names and the tokenizer) serves its task, a pretrained
one the head its family was pretrained with, and every model serves embeddings and /tokenize. Any other
request is a 400 that lists what the model does serve.

Task inputs are encoded by ``pipelines.finetune``'s encoders with the ``TaskDataConfig`` of the
fine-tuning run (its recipe in ``trainer_state.json``: max_len, doc_stride, max_query_len, version_2,
...), so a served model reads exactly what it was validated on. A checkpoint without a recipe gets the
recipe defaults of ``jobs.training.finetune_config``. Over-long inputs are a 400 unless the request says
``"truncate": true`` (then cut as training cuts them); QA contexts are never cut, they are windowed.

``TaskServing`` is the replica half (a base class of ``jobs.serving.replica.EmbeddingReplica``); the request
models and the pure decoding functions are the Gateway half. Rows of a task model (and masked-LM rows)
are collected by one ``jobs.serving.batching.Batcher``, so concurrent requests share forward passes; as for embeddings, a
batch runs sorted by length in passes of at most ``max_batch_tokens`` padded tokens, each padded only to
its own longest row (``jobs.serving.passes.token_budget_groups``), and every answer is put back in request order.
Generation runs one request at a time (every new token depends on the previous one); GPT / GPT-2 and
Transformer-XL keep what they read (key-value cache, recurrence memory) so each new token costs one
position, XLNet re-reads the sequence.
"""

# No `from __future__ import annotations`: FastAPI reads these request classes from route annotations.
import asyncio
import dataclasses
import json
import secrets
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ctxmodels.task_kinds import TASKS, label_names
from jobs.serving.batching import Batcher
from jobs.serving.serve_config import InputError, LimitError, Limits

# --------------------------------------------------------------------------------------- what serves what

MLM_FAMILIES = ("bert", "roberta", "spanbert", "albert", "xlm")  # pretrained with a masked-LM head
LM_FAMILIES = ("gpt", "transformer-xl", "xlnet", "awd-lstm")  # pretrained to predict the next token (XLNet: any order)
# Families whose generation reads each new token once (decode_step: GPT's key-value cache, Transformer-XL's
# memory, AWD-LSTM's LSTM state). XLNet reads the prompt bidirectionally (only the placeholder is hidden), so every new token
# changes the states of all earlier ones: nothing computed for a step can be reused by the next.
CACHED_FAMILIES = ("gpt", "transformer-xl", "awd-lstm")
MLM_HEAD = {"bert": "mlm", "roberta": "mlm", "spanbert": "mlm", "albert": "mlm_head", "xlm": "mlm"}  # the head's module name
EMBEDDING_ROUTES = ("/v1/embeddings", "/v1/token-embeddings")
NEEDS: dict[str, str] = {
    "/v1/classify": "a fine-tuned classification or regression checkpoint (ctx finetune)",
    "/v1/tag": "a fine-tuned token-classification checkpoint",
    "/v1/answer": "a fine-tuned question-answering checkpoint",
    "/v1/rerank": "a fine-tuned pair classifier with 2 labels, or a regression checkpoint",
    "/v1/fill-mask": f"a pretrained {' / '.join(MLM_FAMILIES)} checkpoint with its masked-LM head (XLM: pretrained with mlm or tlm)",
    "/v1/generate": f"a pretrained {' / '.join(LM_FAMILIES)} checkpoint, or an XLM pretrained as a causal LM (objective clm)",
    "/embed_sparse": ("a SPLADE model: a sentence-transformers SparseEncoder folder (SpladePooling), or a pretrained "
                      f"{' / '.join(MLM_FAMILIES)} checkpoint with its masked-LM head served with splade: true"),
}


# TEI's routes that answer from a native one's model (not listed in /v1/models): what they need of it.
TEI_NEEDS = {"/predict": "/v1/classify", "/decode": "/tokenize"}


def routes_of(family: str, task: Any, untrained_heads: set[str], causal: bool = False) -> list[str]:
    """The routes a model serves: ``task`` is its ``TaskConfig`` (None: pretrained); ``untrained_heads``
    the modules a Hugging Face folder had no weights for (a bare BertModel has no MLM head); ``causal``:
    an XLM pretrained as a causal LM, whose prediction layer scores the next token."""
    if task is not None:
        extra = TASKS[task.kind].routes
        if task.kind == "classification" and task.num_labels != 2:
            extra = tuple(r for r in extra if r != "/v1/rerank")
    elif family in MLM_FAMILIES and MLM_HEAD[family] not in untrained_heads:
        extra = ("/v1/generate",) if causal else ("/v1/fill-mask",)
    elif family in LM_FAMILIES:
        extra = ("/v1/generate",)
    else:
        extra = ()
    return [*EMBEDDING_ROUTES, *extra, "/tokenize"]


def cannot_serve(name: str, info: dict, route: str) -> str:
    """The 400's message for a model asked for what it does not do: what it is and what it serves."""
    what = f"a fine-tuned {info['family']} {info['task']} model" if info["task"] else f"a pretrained {info['family']} model"
    why = ""
    if route in ("/v1/fill-mask", "/embed_sparse") and info["family"] in MLM_FAMILIES and "/v1/generate" in info["routes"] and not info["task"]:
        why = " pretrained as a causal LM (objective clm)"
    elif route in ("/v1/fill-mask", "/embed_sparse") and info["family"] in MLM_FAMILIES and not info["task"] and "/v1/fill-mask" not in info["routes"]:
        why = " whose checkpoint has no trained masked-LM head"
    elif route == "/v1/rerank" and info["task"] == "classification":
        why = f" with {len(info['labels'])} labels"
    elif route == "/embed_sparse" and "/v1/fill-mask" in info["routes"]:
        why = " served for dense vectors (splade is not set)"
    return f"model {name!r} is {what}{why}: it serves {', '.join(info['routes'])}; {route} needs {NEEDS[route]}"


# --------------------------------------------------------------------------------------- requests


def check_texts(value: Any, *, allow_str: bool) -> Any:
    """One readable error instead of pydantic's one-per-union-member list."""
    if isinstance(value, str) and allow_str:
        texts = [value]
    elif isinstance(value, list) and all(isinstance(t, str) for t in value):
        texts = value
    else:
        wanted = "a string or a list of strings" if allow_str else "a list of strings"
        if _token_ids(value):  # OpenAI's API allows token arrays; whose tokenizer made them cannot be known
            raise ValueError(
                f"must be {wanted}: token ids are not accepted, this server reads text with the model's own tokenizer "
                "(ids of another, such as tiktoken's, would be other words). LangChain's OpenAIEmbeddings sends "
                "tiktoken ids unless created with check_embedding_ctx_length=False"
            )
        if isinstance(value, list):
            bad = next(i for i, t in enumerate(value) if not isinstance(t, str))
            raise ValueError(f"must be {wanted}; item {bad} is {type(value[bad]).__name__}")
        raise ValueError(f"must be {wanted}, got {type(value).__name__}")
    if not texts:
        raise ValueError("must not be empty")
    for i, t in enumerate(texts):
        if not t.strip():
            raise ValueError(f"item {i} is empty or only whitespace")
    return value


def _token_ids(value: Any) -> bool:
    """OpenAI's other input forms: a list of token ids, or a list of such lists."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    return ids(value) or (isinstance(value, list) and bool(value) and all(ids(x) for x in value))


def one_text(value: Any) -> Any:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError("must not be empty or only whitespace")
    return value


def _as_list(v: str | list[str]) -> list[str]:
    return [v] if isinstance(v, str) else list(v)


class TaskRequest(BaseModel):
    """Common to the task routes: ``texts`` are what the Gateway's character limits count."""

    model_config = ConfigDict(extra="forbid")

    model: str

    def texts(self) -> list[str]:
        raise NotImplementedError

    def limit_problem(self, limits: Limits) -> str | None:
        """A limit of the config this request is over, named, or None (checked before any work)."""
        return None

    def payload(self) -> dict[str, Any]:
        """What the replica's handler receives."""
        return self.model_dump(exclude={"model"})

    def answer(self, body: Any) -> Any:
        """The replica's body as this request's answer (a route whose request shapes its answer overrides it)."""
        return body


class ClassifyRequest(TaskRequest):
    input: str | list[str] | list[tuple[str, str]]  # texts, or [text, text_pair] pairs
    truncate: bool = False  # false: an input longer than the model's max_len is a 400
    language: str | int | None = None  # a fine-tuned multilingual XLM: the inputs' language (None: the model's `language` setting)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        if isinstance(v, list) and v and all(isinstance(p, (list, tuple)) for p in v):
            for i, p in enumerate(v):
                if len(p) != 2 or not all(isinstance(t, str) for t in p):
                    raise ValueError(f"item {i}: a pair is [text, text_pair], two strings")
            check_texts([t for p in v for t in p], allow_str=False)
            return v
        return check_texts(v, allow_str=True)

    def is_pairs(self) -> bool:
        return isinstance(self.input, list) and not isinstance(self.input[0], str)

    def texts(self) -> list[str]:
        return [t for p in self.input for t in p] if self.is_pairs() else _as_list(self.input)

    def payload(self) -> dict[str, Any]:
        if self.is_pairs():
            return {"texts": [a for a, _ in self.input], "pairs": [b for _, b in self.input], "truncate": self.truncate, "language": self.language}
        return {"texts": _as_list(self.input), "pairs": None, "truncate": self.truncate, "language": self.language}


class TextsRequest(TaskRequest):
    """A route that reads one text or a list of texts under ``input``."""

    input: str | list[str]

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return check_texts(v, allow_str=True)

    def texts(self) -> list[str]:
        return _as_list(self.input)


def check_word_lists(value: Any) -> Any:
    """Pre-split texts: a non-empty list of non-empty lists of words, each a string with a character
    that is not whitespace. The error names the first bad item, ``[i]`` or ``[i][j]``."""
    example = 'e.g. [["John", "lives", "in", "Paris"]]'
    if not isinstance(value, list):
        raise ValueError(f"must be a list of word lists ({example}), got {type(value).__name__}")
    if not value:
        raise ValueError(f"must not be empty: give at least one word list ({example})")
    for i, ws in enumerate(value):
        if not isinstance(ws, list):
            raise ValueError(f"item [{i}] must be a list of words ({example}), got {type(ws).__name__}")
        if not ws:
            raise ValueError(f"item [{i}] is an empty word list: give at least one word")
        for j, w in enumerate(ws):
            if not isinstance(w, str):
                raise ValueError(f"item [{i}][{j}] must be a string, got {type(w).__name__}")
            if not w.strip():
                raise ValueError(f"item [{i}][{j}] is empty or only whitespace: every word must have a character to tag")
    return value


class TagRequest(TaskRequest):
    """Texts (``input``; words are their whitespace-separated runs) or pre-split texts (``words``, as
    CoNLL ``tokens``); exactly one. Offsets of pre-split words index their texts joined by single spaces."""

    input: str | list[str] | None = None
    words: list[list[str]] | None = None
    scheme: Literal["IOB2", "IOBES"] | None = None  # None: conlleval's lenient grouping (what ctx eval scores)
    truncate: bool = False
    language: str | int | None = None  # a fine-tuned multilingual XLM: the inputs' language (None: the model's `language` setting)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return v if v is None else check_texts(v, allow_str=True)

    @field_validator("words", mode="before")
    @classmethod
    def _words(cls, v: Any) -> Any:
        return v if v is None else check_word_lists(v)

    @model_validator(mode="after")
    def _one_of_input_and_words(self) -> "TagRequest":
        if (self.input is None) == (self.words is None):
            which = "both were given" if self.input is not None else "neither was given"
            raise ValueError(f"give exactly one of input (texts, split at whitespace) and words (pre-split texts: lists of words); {which}")
        return self

    def texts(self) -> list[str]:
        return _as_list(self.input) if self.words is None else [" ".join(ws) for ws in self.words]

    def payload(self) -> dict[str, Any]:
        texts = None if self.input is None else _as_list(self.input)
        return {"texts": texts, "words": self.words, "scheme": self.scheme, "truncate": self.truncate, "language": self.language}


class AnswerRequest(TaskRequest):
    question: str | list[str]
    context: str | list[str]  # one per question; long contexts are read in overlapping windows
    truncate: bool = False  # false: a question longer than the run's max_query_len is a 400
    language: str | int | None = None  # a fine-tuned multilingual XLM: the inputs' language (None: the model's `language` setting)

    @field_validator("question", "context", mode="before")
    @classmethod
    def _texts(cls, v: Any) -> Any:
        return check_texts(v, allow_str=True)

    @model_validator(mode="after")
    def _one_context_each(self) -> "AnswerRequest":
        q, c = _as_list(self.question), _as_list(self.context)
        if isinstance(self.question, str) != isinstance(self.context, str) or len(q) != len(c):
            raise ValueError(f"question and context: give one string each, or two lists of equal length (got {len(q)} and {len(c)})")
        return self

    def texts(self) -> list[str]:
        return _as_list(self.question) + _as_list(self.context)

    def payload(self) -> dict[str, Any]:
        return {"questions": _as_list(self.question), "contexts": _as_list(self.context), "truncate": self.truncate, "language": self.language}


class RerankRequest(TaskRequest):
    """TEI's body (``texts``, ``raw_scores``, ``return_text``; answered as TEI's bare list, best first) or
    the one of Cohere's and Jina's rerank APIs, which Infinity and vLLM speak too (``documents`` as
    strings or {"text": ...}, ``top_n``, ``return_documents``; answered as {"results": [{"index",
    "relevance_score", "document"}]}, best first)."""

    query: str
    texts_: list[str] | None = Field(None, alias="texts")  # "texts" is also the method every request has
    raw_scores: bool = False  # the logit (2 labels: logit of the last minus the first) instead of a probability
    return_text: bool = False
    documents: list[str] | None = None
    top_n: int | None = Field(None, ge=1)  # the best n only
    return_documents: bool = False
    truncate: bool = False
    language: str | int | None = None  # a fine-tuned multilingual XLM: the inputs' language (None: the model's `language` setting)

    @field_validator("query", mode="before")
    @classmethod
    def _query(cls, v: Any) -> Any:
        return one_text(v)

    @field_validator("texts_", mode="before")
    @classmethod
    def _texts(cls, v: Any) -> Any:
        return check_texts(v, allow_str=False)

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, v: Any) -> Any:
        if isinstance(v, list):  # Cohere's and Jina's documents may be {"text": ...} objects
            for i, d in enumerate(v):
                if isinstance(d, dict) and set(d) != {"text"}:
                    raise ValueError(f"item {i} must be a string or an object {{\"text\": ...}}, got keys {sorted(d)}")
            v = [d["text"] if isinstance(d, dict) else d for d in v]
        return check_texts(v, allow_str=False)

    @model_validator(mode="after")
    def _one_shape(self) -> "RerankRequest":
        if (self.texts_ is None) == (self.documents is None):
            raise ValueError("give exactly one of texts (TEI's rerank) or documents (Cohere's and Jina's), "
                             + ("both were given" if self.texts_ is not None else "neither was given"))
        tei, cohere = ("raw_scores", "return_text"), ("top_n", "return_documents")
        stray = [k for k in (cohere if self.texts_ is not None else tei) if k in self.model_fields_set]
        if stray:
            raise ValueError(f"{stray[0]} belongs to the other body: with texts give {' and '.join(tei)}; "
                             f"with documents give {' and '.join(cohere)}")
        return self

    def texts(self) -> list[str]:
        return [self.query, *(self.texts_ if self.texts_ is not None else self.documents)]

    def payload(self) -> dict[str, Any]:
        texts = self.texts_ if self.texts_ is not None else self.documents
        return {"query": self.query, "texts": texts, "raw_scores": self.raw_scores, "return_text": self.return_text, "truncate": self.truncate,
                "language": self.language}

    def answer(self, ranked: list[dict]) -> list[dict] | dict:
        """The replica's TEI list as this request's body shape."""
        if self.documents is None:
            return ranked
        results = [{"index": r["index"], "relevance_score": r["score"],
                    **({"document": {"text": self.documents[r["index"]]}} if self.return_documents else {})}
                   for r in ranked[: self.top_n]]
        return {"object": "rerank", "results": results}


def tei_sequences(value: Any) -> Any:
    """TEI's ``/predict`` inputs, read as TEI reads them: a string; a list of one or two strings (one
    text, or a pair [text, text_pair]); or a batch of such lists, [[text], [text, text_pair], ...]."""
    shapes = "a text, a pair [text, text_pair], or a batch of [text] and [text, text_pair] lists"
    if isinstance(value, str):
        return one_text(value)
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be {shapes}, got " + ("an empty list" if isinstance(value, list) else type(value).__name__))
    if isinstance(value[0], str):  # one sequence
        if len(value) > 2:
            raise ValueError(f"a list of strings is one text or a pair [text, text_pair], not {len(value)} strings; "
                             "a batch is a list of lists, [[text], [text, text_pair], ...]")
        return check_texts(value, allow_str=False)
    for i, seq in enumerate(value):
        if not (isinstance(seq, list) and 1 <= len(seq) <= 2 and all(isinstance(t, str) for t in seq)):
            raise ValueError(f"item {i}: a batch's items are [text] or [text, text_pair], one or two strings")
        for j, t in enumerate(seq):
            if not t.strip():
                raise ValueError(f"item {i}: text {j} is empty or only whitespace")
    return value


# The shapes of TEI's inputs, declared so the OpenAPI schema tells them (the validators above check them first).
TeiSequence = Annotated[list[str], Field(min_length=1, max_length=2)]  # [text] or [text, text_pair]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class TeiParameters(BaseModel):
    """The Hugging Face Inference API's text-classification ``parameters``, which huggingface_hub's
    ``InferenceClient.text_classification`` sends: ``function_to_apply`` in place of TEI's choice,
    ``top_k`` the best k labels only."""

    model_config = ConfigDict(extra="forbid")

    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None
    top_k: int | None = Field(None, ge=1)


class PredictRequest(TaskRequest):
    """TEI's ``/predict``: a fine-tuned classification or regression model's scores, each sequence's
    labels best first as ``{"score", "label"}``; a batch gets a list per sequence. Scores as TEI's:
    the softmax over the labels, or the sigmoid of a one-output head's logit; ``raw_scores``: the
    logits. TEI serves one model and its clients name none; ``model`` picks one when this server
    serves several."""

    model: str | None = None
    inputs: str | TeiSequence | Annotated[list[TeiSequence], Field(min_length=1)]
    raw_scores: bool = False
    truncate: bool | None = False  # false: an input longer than the model's max_len is a 400
    truncation_direction: Literal["Right", "right"] = "Right"  # the end is cut, as every route's truncate
    parameters: TeiParameters | None = None

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        return tei_sequences(v)

    @model_validator(mode="after")
    def _one_function(self) -> "PredictRequest":
        function = self.parameters.function_to_apply if self.parameters is not None else None
        if self.raw_scores and function not in (None, "none"):
            raise ValueError(f"raw_scores asks for the logits and parameters.function_to_apply for {function!r}: give one of them")
        return self

    def is_batch(self) -> bool:
        return isinstance(self.inputs, list) and isinstance(self.inputs[0], list)

    def sequences(self) -> list[list[str]]:
        if isinstance(self.inputs, str):
            return [[self.inputs]]
        return [list(seq) for seq in self.inputs] if self.is_batch() else [list(self.inputs)]

    def texts(self) -> list[str]:
        return [t for seq in self.sequences() for t in seq]

    def payload(self) -> dict[str, Any]:
        function = "none" if self.raw_scores else (self.parameters.function_to_apply if self.parameters is not None else None)
        return {"sequences": self.sequences(), "function": function, "top_k": self.parameters.top_k if self.parameters is not None else None,
                "truncate": bool(self.truncate)}

    def answer(self, body: list[list[dict]]) -> list[dict] | list[list[dict]]:
        return body if self.is_batch() else body[0]


class EmbedSparseRequest(TaskRequest):
    """TEI's ``/embed_sparse``: a SPLADE model's vector of each input, its nonzero weights as
    ``{"index": token id, "value": weight}`` by token id (a list per input, a string input too).
    TEI serves one model and its clients name none; ``model`` picks one when this server serves several."""

    model: str | None = None
    inputs: str | list[str]
    truncate: bool | None = False  # false: an input longer than the model reads is a 400
    truncation_direction: Literal["Right", "right"] = "Right"  # the end is cut, as every route's truncate
    prompt_name: str | None = None  # one of the folder's prompts, put before each input

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        return check_texts(v, allow_str=True)

    def texts(self) -> list[str]:
        return _as_list(self.inputs)

    def payload(self) -> dict[str, Any]:
        return {"texts": self.texts(), "truncate": bool(self.truncate), "prompt_name": self.prompt_name}


class DecodeRequest(TaskRequest):
    """TEI's ``/decode``: token ids (one list, or a list of lists) back to text through the model's own
    tokenizer; a list of texts either way. ``model`` as on ``/predict``."""

    model: str | None = None
    ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    skip_special_tokens: bool = True

    @field_validator("ids", mode="before")
    @classmethod
    def _ids(cls, v: Any) -> Any:
        def is_id(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        if isinstance(v, list) and v and all(is_id(x) for x in v):
            rows = [v]
        elif isinstance(v, list) and v and all(isinstance(r, list) and r and all(is_id(x) for x in r) for r in v):
            rows = v
        else:
            raise ValueError("must be token ids, [id, ...], or a batch of them, [[id, ...], ...]; none empty")
        for i, row in enumerate(rows):
            bad = next((x for x in row if x < 0), None)
            if bad is not None:
                raise ValueError(f"item {i}: {bad} is not a token id (ids are 0 or more)")
        return v

    def rows(self) -> list[list[int]]:
        return [list(r) for r in self.ids] if isinstance(self.ids[0], list) else [list(self.ids)]

    def texts(self) -> list[str]:
        return []

    def limit_problem(self, limits: Limits) -> str | None:
        n = sum(len(r) for r in self.rows())
        if n > limits.max_tokens_per_request:
            return f"ids has {n} token ids, more than {limits.max_tokens_per_request} (max_tokens_per_request): send fewer"
        return None

    def payload(self) -> dict[str, Any]:
        return {"ids": self.rows(), "skip_special_tokens": self.skip_special_tokens}


class FillMaskRequest(TextsRequest):
    # each text holds the tokenizer's mask token ([MASK], <mask>) at least once
    top_k: int = Field(5, ge=1, le=100)
    truncate: bool = False
    language: str | int | None = None  # a multilingual XLM: the texts' language (None: the model's `language` setting)

    def payload(self) -> dict[str, Any]:
        return {"texts": self.texts(), "top_k": self.top_k, "truncate": self.truncate, "language": self.language}


class GenerateRequest(TaskRequest):
    prompt: str
    max_tokens: int = Field(16, ge=1)  # new tokens at most (limits.max_new_tokens bounds it)
    temperature: float = Field(1.0, ge=0.0, le=10.0)  # 0: greedy (argmax at every step)
    top_k: int | None = Field(None, ge=1)  # sample among the k most likely tokens only
    top_p: float | None = Field(None, gt=0.0, le=1.0)  # ... among the smallest set holding this probability
    seed: int | None = Field(None, ge=0, lt=2**63)  # same seed, same prompt, same model: same text; None: a fresh one, returned
    language: str | int | None = None  # a causal XLM: the language it writes in (None: the model's `language` setting)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        return one_text(v)

    def texts(self) -> list[str]:
        return [self.prompt]

    def limit_problem(self, limits: Limits) -> str | None:
        if self.max_tokens > limits.max_new_tokens:
            return f"max_tokens {self.max_tokens} is over the server's limit of {limits.max_new_tokens} new tokens (max_new_tokens)"
        return None


class TokenizeRequest(TaskRequest):
    """Ours, ``{"model", "input"}``: ids, token strings and character offsets per text, and whether it
    fits the model. Or TEI's, ``{"inputs", "prompt_name"}`` (``model`` optional, as on ``/embed``): per
    text its tokens as TEI's ``{"id", "text", "special", "start", "stop"}`` (a special token's text is
    the token, its offsets null)."""

    model: str | None = None
    input: str | list[str] | None = None
    inputs: str | list[str] | None = None
    add_special_tokens: bool = True  # [CLS] ... [SEP] as the embeddings endpoints read a text
    prompt_name: str | None = None  # TEI's: one of the model's sentence-transformers prompts, put before each input

    @field_validator("input", "inputs", mode="before")
    @classmethod
    def _texts(cls, v: Any) -> Any:
        return check_texts(v, allow_str=True)

    @model_validator(mode="after")
    def _one_shape(self) -> "TokenizeRequest":
        if (self.input is None) == (self.inputs is None):
            raise ValueError("give exactly one of input (this server's body, with model) or inputs (TEI's), "
                             + ("both were given" if self.input is not None else "neither was given"))
        if self.input is not None and self.model is None:
            raise ValueError("model: required with input (TEI's body, with inputs, may leave it out)")
        if self.input is not None and self.prompt_name is not None:
            raise ValueError("prompt_name belongs to TEI's body: send the texts as inputs")
        return self

    def texts(self) -> list[str]:
        return _as_list(self.input if self.input is not None else self.inputs)

    def payload(self) -> dict[str, Any]:
        return {"texts": self.texts(), "add_special_tokens": self.add_special_tokens, "tei": self.inputs is not None,
                "prompt_name": self.prompt_name}


REQUESTS: dict[str, type[TaskRequest]] = {
    "/v1/classify": ClassifyRequest,
    "/v1/tag": TagRequest,
    "/v1/answer": AnswerRequest,
    "/v1/rerank": RerankRequest,
    "/v1/fill-mask": FillMaskRequest,
    "/v1/generate": GenerateRequest,
    "/tokenize": TokenizeRequest,
}


# --------------------------------------------------------------------------------------- decoding (pure)


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.asarray(x, dtype=np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _finite(x: float) -> float | None:
    """JSON has no infinities: a score of no span at all is null."""
    return float(x) if np.isfinite(x) else None


def class_results(logits: np.ndarray, kind: str, labels: list[str]) -> list[dict]:
    """Classification logits (N, L) -> the labels of each input, best first; regression (N,) -> values."""
    if kind == "regression":
        return [{"index": i, "value": float(v)} for i, v in enumerate(np.asarray(logits).reshape(-1))]
    probs = softmax(logits)  # (N, L)
    out = []
    for i, p in enumerate(probs):
        order = np.argsort(-p, kind="stable")
        ranked = [{"label": labels[k], "score": float(p[k])} for k in order]
        out.append({"index": i, "label": ranked[0]["label"], "score": ranked[0]["score"], "labels": ranked})
    return out


def tei_model_type(info: dict) -> dict:
    """TEI's ``model_type`` of a served model's info: a classifier with its labels, or a reranker (a
    one-output head: TEI's word for it), else an embedding model with the pooling it serves ("splade":
    a SPLADE model's, whose vectors come from /embed_sparse)."""
    if "outputs" not in info:
        return {"embedding": {"pooling": "splade" if "splade" in info else info["pooling"]}}
    labels = {"id2label": {str(i): n for i, n in enumerate(info["outputs"])}, "label2id": {n: i for i, n in enumerate(info["outputs"])}}
    return {"reranker" if len(info["outputs"]) == 1 else "classifier": labels}


def tei_predictions(logits: np.ndarray, labels: list[str], function: str | None, top_k: int | None) -> list[list[dict]]:
    """TEI's ``/predict`` answer of logits (N, L): per sequence, its labels best first as {"score",
    "label"}. ``function`` None: TEI's choice, the softmax over the labels, or the sigmoid of a
    one-output head's logit; "softmax", "sigmoid" or "none" (the logits) in its place. ``top_k``: the
    best k only."""
    z = np.asarray(logits, dtype=np.float64).reshape(len(logits), -1)
    function = function or ("softmax" if z.shape[1] > 1 else "sigmoid")
    scores = softmax(z) if function == "softmax" else 1.0 / (1.0 + np.exp(-z)) if function == "sigmoid" else z
    out = []
    for row in scores:
        order = np.argsort(-row, kind="stable")[:top_k]
        out.append([{"score": float(row[k]), "label": labels[k]} for k in order])
    return out


def rerank_scores(logits: np.ndarray, kind: str, raw: bool) -> np.ndarray:
    """(N,) relevance of each pair: for 2 labels the probability of the last label (``raw``: its logit
    minus the first's, whose sigmoid that probability is); for a one-output (regression) head the
    sigmoid of its value, as TEI's rerank and sentence-transformers' ``CrossEncoder.predict`` read a
    one-output head (``raw``: the value). The order is the value's either way."""
    logits = np.asarray(logits, dtype=np.float64)
    margin = logits.reshape(-1) if kind == "regression" else logits[:, -1] - logits[:, 0]  # (N,)
    return margin if raw else 1.0 / (1.0 + np.exp(-margin))


def word_tags(logits: np.ndarray, word_ids: np.ndarray, texts: list[str], word_spans: np.ndarray, word_splits: np.ndarray,
              labels: list[str], scheme: str | None) -> list[dict]:
    """Token logits (N, T, L) -> per text its words with index, tag, probability and character span in
    ``texts[i]``, and the entities (pipelines.metrics.entities) over word indexes with the mean of their
    words' scores. Word w of text i spans ``word_spans[word_splits[i] + w]``.

    A word is tagged by its first sub-token, as BERT's NER (and ``ctx eval``) reads it; a word cut
    off by truncation is left out."""
    from pipelines.alignment import pool_words
    from pipelines.metrics import entities

    n_words = int(np.diff(word_splits).max(initial=0))
    probs, present = pool_words(softmax(logits), word_ids, max(n_words, 1), "first")  # (N, W, L), (N, W)
    out = []
    for i, text in enumerate(texts):
        words = []
        for w in np.flatnonzero(present[i, : word_splits[i + 1] - word_splits[i]]):
            s, e = (int(x) for x in word_spans[word_splits[i] + w])
            k = int(probs[i, w].argmax())
            words.append({"index": int(w), "word": text[s:e], "start": s, "end": e, "tag": labels[k], "score": float(probs[i, w, k])})
        try:
            types, first, last = entities([[w["tag"] for w in words]], scheme)
        except ValueError as e:  # a label the strict scheme does not allow
            raise InputError(f"scheme {scheme}: {e}; ask for another scheme, or none") from None
        found = []
        for ty, a, b in zip(types.tolist(), first.tolist(), last.tolist()):
            s, e = words[a]["start"], words[b]["end"]
            score = float(np.mean([w["score"] for w in words[a : b + 1]]))
            found.append({"type": ty, "text": text[s:e], "start": s, "end": e, "score": score, "words": [a, b]})
        out.append({"index": i, "words": words, "entities": found, "truncated": len(words) < int(word_splits[i + 1] - word_splits[i])})
    return out


def answer_results(predictions: list[dict], version_2: bool) -> list[dict]:
    """``pipelines.qa.decode_qa``'s predictions as the API answers them."""
    out = []
    for i, p in enumerate(predictions):
        item = {"index": i, "answer": p["text"], "start": p["start"], "end": p["end"], "score": _finite(p["score"])}
        if version_2:
            item.update(no_answer=p["start"] < 0, null_score=_finite(p["null_score"]), null_score_diff=_finite(p["null_score_diff"]))
        out.append(item)
    return out


def decode_ids(tok, ids: list[int]) -> str:
    """Text of token ids, special tokens dropped, through the tokenizer's own decoder."""
    return tok.decode(ids)


def token_surface(tok, token_id: int) -> str:
    """What one token writes in a text: "bank" for "bank", "Ġbank", "▁bank"; "ing" for "##ing"."""
    text = decode_ids(tok, [token_id]).strip()
    return text[2:] if text.startswith("##") and len(text) > 2 else text


def fill_results(tok, text: str, offsets: list[tuple[int, int]], positions: np.ndarray, probs: np.ndarray, top_k: int) -> list[dict]:
    """Each mask token of ``text`` (token ``positions``, probabilities (M, V)) -> its top-k tokens with
    the text where that mask holds the token."""
    masks = []
    for pos, p in zip(positions.tolist(), probs):
        s, e = offsets[pos]
        top = np.argsort(-p, kind="stable")[:top_k]
        predictions = []
        for k in top.tolist():
            surface = token_surface(tok, k)
            predictions.append({"token_id": k, "token": tok.id_to_token(k), "text": surface, "score": float(p[k]), "sequence": text[:s] + surface + text[e:]})
        masks.append({"position": pos, "start": s, "end": e, "predictions": predictions})
    return masks


# --------------------------------------------------------------------------------------- heads (plain torch)


def mlm_logits_at(family: str, model, input_ids, attention_mask, selected, language_ids=None):
    """Masked-LM scores (N, V) at the ``selected`` (B, T) positions, row-major: only the N rows are
    sent through the head (the (B, T, V) scores of every position are never built). ``language_ids``
    (B, T): a multilingual XLM's rows of its language table (None: row 0)."""
    return mlm_scores(family, model, mlm_states(model, input_ids, attention_mask, language_ids)[selected])


def mlm_states(model, input_ids, attention_mask, language_ids=None):
    """(B, T, D): the last layer a masked-LM head reads (``language_ids`` as ``mlm_logits_at``'s)."""
    given = {} if language_ids is None else {"token_type_ids": language_ids}
    return model.backbone.hidden_states(input_ids, attention_mask, **given)[-1]


def mlm_scores(family: str, model, states):
    """(N, V) masked-LM scores of (N, D) last-layer states, through the family's head (tied to the word embeddings)."""
    if family == "albert":
        return model.mlm_head(states, model.backbone.word_emb.weight)
    return model.mlm(states, model.backbone.embeddings.word.weight)


SPLADE_CHUNK_TOKENS = 512  # positions sent through the head at once for SPLADE: (512, V) scores, 62 MB at V 30,522 in float32


def splade_rows(family: str, model, states, rows: list[dict[str, np.ndarray]], splade) -> list[dict[str, np.ndarray]]:
    """Each row's SPLADE vector (``ctxmodels.features.splade_pool``, a chunk at a time) from the last-layer ``states`` (B, T, D) of
    rows right-padded to T, as its nonzero weights {"indices": int64 (K,), "values": float32 (K,)}, by
    token id; a model's ``max_active_dims`` keeps the K largest. The head reads the real positions
    SPLADE_CHUNK_TOKENS at a time, pooling into one (B, V) float32 buffer."""
    import torch

    from ctxmodels.features import splade_accumulate, splade_finish

    lengths = torch.tensor([len(r["input_ids"]) for r in rows], device=states.device)  # (B,)
    flat = states[torch.arange(states.shape[1], device=states.device)[None] < lengths[:, None]]  # (N, D): the real positions, row after row
    owner = torch.repeat_interleave(torch.arange(len(rows), device=states.device), lengths)  # (N,) the row of each
    pooled = None  # (B, V) float32
    for start in range(0, len(flat), SPLADE_CHUNK_TOKENS):
        chunk = slice(start, start + SPLADE_CHUNK_TOKENS)
        scores = mlm_scores(family, model, flat[chunk])  # (<= SPLADE_CHUNK_TOKENS, V)
        if pooled is None:
            pooled = torch.zeros((len(rows), scores.shape[-1]), dtype=torch.float32, device=states.device)
        splade_accumulate(scores, owner[chunk], pooled, splade.pooling, splade.activation)
    pooled = splade_finish(pooled, splade.pooling, splade.activation)
    if splade.max_active_dims is not None and splade.max_active_dims < pooled.shape[-1]:
        top = pooled.topk(splade.max_active_dims, dim=-1)
        pooled = torch.zeros_like(pooled).scatter_(-1, top.indices, top.values)  # sentence-transformers' select_max_active_dims
    at = pooled.nonzero()  # (K, 2) by row, then token id
    values = pooled[at[:, 0], at[:, 1]].cpu().numpy()
    at = at.cpu().numpy()
    bounds = np.searchsorted(at[:, 0], np.arange(1, len(rows)))
    return [{"indices": i[:, 1], "values": v} for i, v in zip(np.split(at, bounds), np.split(values, bounds))]


def sparse_values(vector: dict[str, np.ndarray]) -> list[dict]:
    """TEI's ``/embed_sparse`` entries of one vector: float32 weights as their shortest digits."""
    return [{"index": int(i), "value": float(str(v))} for i, v in zip(vector["indices"], vector["values"])]


def next_token_logits(family: str, model, input_ids, placeholder_id: int, language: int = 0):
    """Scores (V,) of the token after ``input_ids`` (1, T), read as each family was pretrained, from one
    pass over the whole sequence (generation's uncached path; ``decode_step`` is the cached one).

    GPT, Transformer-XL and AWD-LSTM: the last position's output (one segment, no memory). XLNet (Yang et al.
    2019, sec. 2.3; Hugging Face ``XLNetLMHeadModel`` generation): a placeholder at position T that no
    position may attend to (perm_mask) and whose query stream (target_mapping) predicts it from the
    content of 0..T-1. ``language``: a causal XLM's row of its language table."""
    import torch

    if family == "gpt":
        return model.logits(input_ids)[0, -1]
    if family == "transformer-xl":
        return model.logits(model.backbone.hidden_states(input_ids)[-1][:, -1:])[0, -1]
    if family == "awd-lstm":  # the last position's output from zero state
        return model.logits(model.backbone.hidden_states(input_ids)[-1][:, -1])[0]
    if family == "xlm" and model.cfg.causal:  # XLM's CLM: the prediction layer at the last position
        return model.mlm_logits(input_ids, None, torch.full_like(input_ids, language) if language else None)[0, -1]
    if family == "xlnet":
        T = input_ids.shape[1]
        ids = torch.cat([input_ids, input_ids.new_full((1, 1), placeholder_id)], dim=1)  # (1, T + 1)
        perm_mask = torch.zeros(1, T + 1, T + 1, device=ids.device)
        perm_mask[:, :, T] = 1.0  # nobody sees the placeholder
        target_mapping = torch.zeros(1, 1, T + 1, device=ids.device)
        target_mapping[0, 0, T] = 1.0
        _, g = model.backbone(ids, None, None, None, perm_mask, target_mapping)  # g (1, 1, D)
        return model.logits(g)[0, 0]
    raise ValueError(f"no next-token head for family {family!r}; known: {list(LM_FAMILIES)}")


def pick_token(logits, temperature: float, top_k: int | None, top_p: float | None, generator) -> int:
    """One token from scores (V,): the argmax at temperature 0, else a draw from ``generator`` (a CPU
    ``torch.Generator``) after temperature, top-k and nucleus (top-p, Holtzman et al. 2020) filtering."""
    import torch

    logits = logits.detach().float().cpu()
    if temperature == 0:
        return int(logits.argmax())
    # The best score shifted to 0 and the temperature kept above float32's smallest normal: a tiny one
    # (5e-324 is valid JSON) then gives -inf to the others, never inf - inf or 0 / 0 = nan: the argmax.
    scores = (logits - logits.max()) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k is not None and top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        outside = sorted_p.cumsum(0) - sorted_p >= top_p  # the nucleus was complete before this token
        outside[0] = False  # the best token always stays (a top_p under float32's resolution, 5e-324, keeps it alone)
        sorted_p[outside] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def generation_prompt(tok, prompt: str) -> tuple[list[int], int, int]:
    """(prompt ids, stop id, placeholder id) for ``generate_ids``. A pretraining row opens with [CLS]
    and a document ends with [SEP]; with a GPT-2 tokenizer both are <|endoftext|>
    (``pipelines.dataset.vocab_info``), which is also how GPT-2 opens an unconditional sample.
    XLNet reads [MASK] where the next token goes; the other families never read the placeholder."""
    start = tok.row_id("cls", "/v1/generate opens the prompt with it")
    stop = tok.row_id("sep", "/v1/generate stops at it")
    placeholder = tok.special_id("mask")
    return [start, *(int(i) for i in tok.encode_batch([prompt])[0])], stop, stop if placeholder is None else placeholder


def generate_ids(family: str, model, prompt: list[int], max_tokens: int, stop_id: int, placeholder_id: int,
                 temperature: float, top_k: int | None, top_p: float | None, seed: int, device,
                 use_cache: bool = True, language: int = 0) -> tuple[list[int], str]:
    """New token ids after ``prompt`` and why generation ended: "stop" (the model wrote ``stop_id``,
    the end of a pretraining row) or "length" (``max_tokens``).

    GPT / GPT-2 (a key-value cache) and Transformer-XL (its recurrence memory, unbounded) read the
    prompt once, then one new token per step (``decode_step``); ``use_cache=False``, and XLNet always,
    run the whole sequence again for every token (``next_token_logits``). Both give the same scores
    (to float rounding), hence the same greedy tokens and the same draws from the seeded generator.
    ``language``: a causal XLM writes as this row of its language table."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, T)
    cached = use_cache and family in CACHED_FAMILIES
    state, unread = None, ids  # the cache / memory, and the tokens it has not read yet
    new: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            if cached:
                logits, state = model.decode_step(unread, state)
                logits = logits[0]  # (V,)
            else:
                logits = next_token_logits(family, model, ids, placeholder_id, language)
            token = pick_token(logits, temperature, top_k, top_p, generator)
            if token == stop_id:
                return new, "stop"
            new.append(token)
            unread = ids.new_full((1, 1), token)  # (1, 1)
            ids = torch.cat([ids, unread], dim=1)
    return new, "length"


# --------------------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """How a fine-tuned checkpoint encodes and decodes: its run's recipe, or the recipe defaults."""

    data: Any  # pipelines.finetune.TaskDataConfig, with_labels=False
    max_answer_len: int
    null_threshold: float | None  # None: SQuAD 1.1 (always a span)


def read_recipe(local_dir: Path) -> dict | None:
    """The fine-tuning recipe in a checkpoint's trainer_state.json (what ``ctx finetune`` writes), or None."""
    path = Path(local_dir) / "trainer_state.json"
    if not path.is_file():
        return None
    state = json.loads(path.read_text())
    return state.get("recipe") if isinstance(state, dict) and isinstance(state.get("recipe"), dict) else None


def task_settings(family: str, task: Any, recipe: dict | None, model_max_len: int) -> TaskSettings:
    """The run's ``TaskDataConfig`` (``jobs.training.finetune_config.task_data_config``, the one its validation used)."""
    from jobs.training.finetune_config import task_data_config
    from jobs.training.finetune_config import FinetuneRecipe

    if recipe is None:  # built outside ctx finetune: the recipe defaults, within what the model reads
        recipe = {"model": {"init": "-"}, "data": {"train": "-"}, "task": {"kind": task.kind, "symmetric": task.symmetric}}
        recipe["task"]["max_len"] = min(128, model_max_len)
    parsed = FinetuneRecipe.model_validate(recipe)
    data = dataclasses.replace(task_data_config(parsed, family, tuple(task.labels)), with_labels=False)
    t = parsed.task
    return TaskSettings(data, t.max_answer_len, t.null_threshold if t.version_2 else None)


# --------------------------------------------------------------------------------------- the replica half


class TaskServing:
    """Task routes of one model replica; a base class of ``jobs.serving.replica.EmbeddingReplica``, whose
    ``name``, ``family``, ``tokenizer``, ``device``, ``max_len``, ``limits``, ``max_batch_size``,
    ``max_batch_tokens``, ``recent_passes``, ``_task_graphed`` (a GPU replica's task passes as CUDA
    graphs, or None), ``sentence`` (its sentence-transformers settings, or None), ``_encode``, ``_encode_ids``,
    ``_pad``, ``_on_device``, ``_language_row`` and ``_named_prompt`` it uses. ``splade``: the SPLADE
    settings (``ctxmodels.sbert.Splade``) of a model served for /embed_sparse, else None."""

    def _init_tasks(self, loaded, recipe: dict | None, untrained_heads: set[str], max_batch_size: int, batch_wait_timeout_s: float,
                    splade=None) -> None:
        self.task_config = loaded.task
        self.model = loaded.model.to(self.device).eval()  # its backbone is the one embeddings read
        self.routes = routes_of(self.family, self.task_config, untrained_heads, getattr(loaded.config, "causal", False))
        self.settings = task_settings(self.family, self.task_config, recipe, self.max_len) if self.task_config is not None else None
        self.splade = None
        if splade is not None:
            if "/v1/fill-mask" not in self.routes:  # SPLADE weighs the vocabulary with the masked-LM head
                raise ValueError(f"splade is set, but {cannot_serve(self.name, {'family': self.family, **self.task_info()}, '/embed_sparse')}")
            self.splade, self.routes = splade, [*self.routes, "/embed_sparse"]
        self._rows_batch = Batcher(self._rows_pass, max_batch_size, batch_wait_timeout_s, self.model_lock)

    def task_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"task": self.task_config.kind if self.task_config else None, "labels": list(self.task_config.labels) if self.task_config else [], "routes": self.routes}
        if "/v1/fill-mask" in self.routes:
            info["mask_token"] = self.tokenizer.special_tokens["mask"]
        if self.splade is not None:
            info["splade"] = self.splade.shown()
        if self.task_config is not None and self.task_config.matryoshka_dims:  # the `dimensions` trained to be vectors
            info["matryoshka_dims"] = list(self.task_config.matryoshka_dims)
        if self.task_config is not None and self.task_config.kind in ("classification", "regression"):
            info["outputs"] = label_names(self.task_config)  # the head's outputs by name (TEI's /info, /predict)
        if self.settings is not None:
            info["task_max_len"] = self.settings.data.max_len
            if self.task_config.kind == "question-answering":
                info["version_2"] = self.settings.null_threshold is not None
        return info

    async def _task(self, route: str, args: dict) -> dict:
        needed = TEI_NEEDS.get(route, route)
        if needed not in self.routes:  # the Gateway checks first; a direct handle call gets the same answer
            raise InputError(cannot_serve(self.name, {"family": self.family, **self.task_info()}, needed))
        handler = {
            "/v1/classify": self._classify, "/v1/tag": self._tag, "/v1/answer": self._answer, "/v1/rerank": self._rerank,
            "/v1/fill-mask": self._fill_mask, "/v1/generate": self._generate, "/tokenize": self._tokenize,
            "/predict": self._predict, "/decode": self._decode, "/embed_sparse": self._embed_sparse,
        }[route]
        body, passes = await handler(**args)
        return {"body": body, "batches": passes, **self._stamp()}

    # --- forward passes ---

    def _row_size(self, row: dict[str, np.ndarray]) -> tuple[int, int]:
        """(sequences, real tokens of its longest) of one row: task rows come right-padded to the
        fine-tuning width (a symmetric pair holds both orders, (2, T)); masked-LM rows are unpadded."""
        if self.task_config is None:
            return 1, len(row["input_ids"])
        mask = row["attention_mask"].reshape(-1, row["attention_mask"].shape[-1])  # (K, T)
        return len(mask), int(mask.sum(-1).max())

    def _rows_forward(self, rows: list[dict[str, np.ndarray]]) -> list[tuple[np.ndarray, tuple[int, int, int] | None]]:
        """Each row's output in the given order, with the (rows, real tokens, padded tokens) of each
        forward pass riding on one of its rows. The rows run sorted by length in passes of at most
        max_batch_size rows and max_batch_tokens padded tokens (``jobs.serving.passes.token_budget_groups``, as
        the embeddings' passes), each pass padded only to its own longest row. A pass's outputs are
        read once the next pass is queued (``jobs.serving.passes.HostCopy``: on a GPU it runs meanwhile).

        Task model: logits per row ((L,), or (T, L) padded back to the row's width with -1e4).
        Pretrained masked LM: probabilities (M, V) at each row's mask ``positions``; a row without
        positions (/embed_sparse's), its SPLADE vector (``splade_rows``)."""
        from jobs.serving.passes import one_pass_behind, token_budget_groups

        sizes = [self._row_size(r) for r in rows]
        out: list[tuple[np.ndarray, tuple[int, int, int] | None]] = [None] * len(rows)  # type: ignore[list-item]

        def queued():  # each pass's rows, its reader and its size, read one pass behind
            # A row of K sequences costs K x its length: the budget counts the sequences a pass really reads.
            for group in token_budget_groups([k * n for k, n in sizes], self.max_batch_size, self.max_batch_tokens):
                width = max(sizes[i][1] for i in group)
                yield (group, *self._group_forward([rows[i] for i in group], width))

        def take(queued_pass) -> None:
            group, read, size = queued_pass
            for b, (i, result) in enumerate(zip(group, read())):
                out[i] = (result, size if b == 0 else None)

        one_pass_behind(queued(), take)
        return out

    def _group_forward(self, rows: list[dict[str, np.ndarray]], width: int):
        """One forward pass over ``rows`` padded to ``width`` tokens, queued: (a function that reads
        their outputs (``_rows_forward``) off the device, the pass's (rows, real tokens, padded tokens))."""
        import torch

        from jobs.serving.passes import HostCopy

        languages = np.array([r.get("language", 0) for r in rows], dtype=np.int64)  # (B,) rows of an XLM's table
        if self.task_config is not None:
            # Cut to the group's longest row: right padding past it is masked anyway.
            cols = {k: np.stack([r[k][..., :width] for r in rows]) for k in rows[0] if k != "language"}  # (B, [K,] T)
            batch = {k: self._on_device(v) for k, v in cols.items()}
            with torch.inference_mode():
                if languages.any():  # requests of other languages than the deployment's: eager, with their ids
                    copy = HostCopy(self.model(**batch, language_ids=self._on_device(languages)).logits.float())
                elif self._task_graphed is not None:  # a GPU replica: the pass replays from a CUDA graph
                    copy = HostCopy(self._task_graphed(**batch).float())
                else:
                    copy = HostCopy(self.model(**batch).logits.float())
            full = rows[0]["input_ids"].shape[-1]
            per_token = TASKS[self.task_config.kind].reads == "tokens"

            def read() -> list[np.ndarray]:
                logits = copy.numpy()
                if per_token:
                    logits = np.pad(logits, ((0, 0), (0, full - logits.shape[1]), (0, 0)), constant_values=-1e4)  # (B, L, C)
                return list(logits)

            mask = cols["attention_mask"]
            n_seq, real = mask.size // mask.shape[-1], int(mask.sum())  # B, or B x K; counted on the host
        else:
            ids, mask = self._pad([r["input_ids"] for r in rows])  # (B, T), T = width
            filled = [b for b, r in enumerate(rows) if "positions" in r]  # /v1/fill-mask's rows: their mask positions
            sparse = [b for b, r in enumerate(rows) if "positions" not in r]  # /embed_sparse's: every position
            language_ids = self._on_device(np.repeat(languages[:, None], ids.shape[1], axis=1)) if languages.any() else None  # (B, T)
            outputs: list = [None] * len(rows)
            with torch.inference_mode():  # (reading the selected positions waits for the device anyway)
                states = mlm_states(self.model, ids, mask, language_ids)  # (B, T, D)
                if filled:
                    selected = np.zeros(tuple(ids.shape), dtype=bool)  # (B, T)
                    for b in filled:
                        selected[b, rows[b]["positions"]] = True
                    probs = torch.softmax(mlm_scores(self.family, self.model, states[self._on_device(selected)]).float(), dim=-1).cpu().numpy()  # (N, V)
                    for b, p in zip(filled, np.split(probs, np.cumsum([len(rows[b]["positions"]) for b in filled])[:-1])):
                        outputs[b] = p
                if sparse:
                    vectors = splade_rows(self.family, self.model, states[sparse] if filled else states, [rows[b] for b in sparse], self.splade)
                    for b, v in zip(sparse, vectors):
                        outputs[b] = v

            def read() -> list[np.ndarray]:
                return outputs

            n_seq, real = len(rows), sum(len(r["input_ids"]) for r in rows)
        self.recent_passes.append((n_seq, width))
        return read, (len(rows), real, n_seq * width)

    async def _rows_pass(self, rows: list[dict[str, np.ndarray]]) -> list[tuple[np.ndarray, tuple[int, int, int] | None]]:
        from jobs.serving.passes import forward

        return await forward(self._rows_forward, rows)

    async def _run_rows(self, rows: list[dict[str, np.ndarray]]) -> tuple[list[np.ndarray], list[tuple[int, int, int]]]:
        """Every row through the batched forward pass: (its output, in the given order; the (rows, tokens,
        padded tokens) of the passes these rows started). Rows are handed over shortest first, so a
        request with more rows than a batch holds fills each batch with rows of similar length."""
        order = sorted(range(len(rows)), key=lambda i: self._row_size(rows[i])[1])
        done = await asyncio.gather(*(self._rows_batch(rows[i]) for i in order))
        outputs: list[np.ndarray] = [None] * len(rows)  # type: ignore[list-item]
        for i, (output, _) in zip(order, done):
            outputs[i] = output
        return outputs, [size for _, size in done if size is not None]

    async def _task_rows(self, records: dict, fields: dict[str, Any], truncate: bool, what: str = "input",
                         language: int | str | None = None, indexes: list[int] | None = None) -> tuple[np.ndarray, dict[str, np.ndarray], list]:
        """Records encoded as the fine-tuning run encoded them (its TaskDataConfig with the request's
        field names in place of the recipe's), then every row through the batched forward pass;
        returns (logits stacked over rows, the encoded columns, the passes' (rows, tokens, padded tokens)).
        ``language``: a multilingual XLM reads the rows as this language (None: the deployment's).
        ``indexes``: each record's place in the request, for messages (None: its place here)."""
        from pipelines.finetune import RecordError, encode_task

        lang_row = self._language_row(language)
        cfg = dataclasses.replace(self.settings.data, **fields)
        try:
            cols = await asyncio.to_thread(encode_task, records, self.tokenizer, cfg)
        except (RecordError, ValueError) as e:
            raise InputError(f"model {self.name!r} cannot encode the request: {e}") from None
        if cols["truncated"].any() and not truncate:
            row = int(np.flatnonzero(cols["truncated"])[0])
            if cfg.kind == "question-answering":  # contexts are windowed; only a question can be cut
                index, length = int(cols["example_index"][row]), f"{cfg.max_query_len} tokens (max_query_len)"
            else:
                index, length = (indexes[row] if indexes else row), f"{cfg.max_len} tokens (max_len, special tokens included)"
            raise InputError(
                f"{what}[{index}] is longer than the {length} model {self.name!r} was fine-tuned to read: "
                f"shorten it, or send \"truncate\": true to cut it as training did"
            )
        n_tokens = int(cols["attention_mask"].sum())
        if n_tokens > self.limits.max_tokens_per_request:
            raise LimitError(f"the request encodes to {n_tokens} tokens, more than {self.limits.max_tokens_per_request} (max_tokens_per_request): send fewer or shorter texts")
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in cols]
        rows = [{**{k: cols[k][i] for k in keys}, **({"language": lang_row} if lang_row else {})} for i in range(len(cols["input_ids"]))]
        logits, passes = await self._run_rows(rows)
        return np.stack(logits), cols, passes

    # --- routes: each answers (its body, the (rows, tokens, padded tokens) of the forward passes it started) ---

    async def _classify(self, texts: list[str], pairs: list[str] | None, truncate: bool, language: int | str | None = None) -> tuple[dict, list]:
        if self.settings.data.symmetric and pairs is None:
            raise InputError(f"model {self.name!r} compares text pairs (symmetric): send input as [[text, text_pair], ...]")
        records = {"text": texts, **({"text_pair": pairs} if pairs is not None else {})}
        cfg_fields = {"text_field": "text", "pair_field": "text_pair" if pairs is not None else None, "id_field": None}
        logits, cols, passes = await self._task_rows(records, cfg_fields, truncate, "input", language)
        data = class_results(logits, self.task_config.kind, list(self.task_config.labels))
        return {"object": "list", "task": self.task_config.kind, "data": data, "usage": _usage(cols)}, passes

    async def _predict(self, sequences: list[list[str]], function: str | None, top_k: int | None, truncate: bool) -> tuple[list[list[dict]], list]:
        """TEI's /predict: the texts and the pairs of a batch are encoded apart (a pair as /v1/classify's
        [text, text_pair]), their logits put back in the request's order."""
        groups = {n: [i for i, seq in enumerate(sequences) if len(seq) == n] for n in (1, 2)}
        if groups[1] and self.settings.data.symmetric:
            raise InputError(f"model {self.name!r} compares text pairs (symmetric): send each input as [text, text_pair]")
        logits: list[np.ndarray | None] = [None] * len(sequences)
        passes: list = []
        for n, where in groups.items():
            if not where:
                continue
            records = {"text": [sequences[i][0] for i in where], **({"text_pair": [sequences[i][1] for i in where]} if n == 2 else {})}
            fields = {"text_field": "text", "pair_field": "text_pair" if n == 2 else None, "id_field": None}
            out, _, group_passes = await self._task_rows(records, fields, truncate, "inputs", None, where)
            for i, row in zip(where, out):
                logits[i] = row
            passes += group_passes
        return tei_predictions(np.stack(logits), label_names(self.task_config), function, top_k), passes

    async def _decode(self, ids: list[list[int]], skip_special_tokens: bool) -> tuple[list[str], list]:
        n = self.tokenizer.vocab_size
        for i, row in enumerate(ids):
            bad = next((x for x in row if x >= n), None)
            if bad is not None:
                raise InputError(f"ids item {i}: {bad} is not a token id of model {self.name!r}, whose vocabulary has {n} (0 to {n - 1})")
        return [self.tokenizer.decode(row, skip_special=skip_special_tokens) for row in ids], []

    async def _rerank(self, query: str, texts: list[str], raw_scores: bool, return_text: bool, truncate: bool,
                      language: int | str | None = None) -> tuple[list[dict], list]:
        records = {"text": [query] * len(texts), "text_pair": texts}
        logits, _, passes = await self._task_rows(records, {"text_field": "text", "pair_field": "text_pair", "id_field": None}, truncate, "texts",
                                                  language)
        scores = rerank_scores(logits, self.task_config.kind, raw_scores)
        order = np.argsort(-scores, kind="stable")
        return [{"index": int(i), "score": float(scores[i]), **({"text": texts[i]} if return_text else {})} for i in order], passes

    async def _tag(self, texts: list[str] | None, words: list[list[str]] | None, scheme: str | None, truncate: bool,
                   language: int | str | None = None) -> tuple[dict, list]:
        from pipelines.alignment import joined_words, whitespace_words

        what = "input" if words is None else "words"
        if words is None:  # offsets index the texts as sent
            words = [t.split() for t in texts]
            spans, splits = whitespace_words(texts)
        else:  # offsets index each word list joined by single spaces, the text the model reads
            texts, spans, splits = joined_words(words)
        logits, cols, passes = await self._task_rows({"tokens": words}, {"tokens_field": "tokens", "id_field": None}, truncate, what, language)
        data = word_tags(logits, cols["word_ids"], texts, spans, splits, list(self.task_config.labels), scheme)
        return {"object": "list", "scheme": scheme, "data": data, "usage": _usage(cols)}, passes

    async def _answer(self, questions: list[str], contexts: list[str], truncate: bool, language: int | str | None = None) -> tuple[dict, list]:
        from pipelines.qa import decode_qa

        records = {"question": questions, "context": contexts}
        fields = {"question_field": "question", "context_field": "context", "id_field": None}
        logits, cols, passes = await self._task_rows(records, fields, truncate, "question", language)
        s = self.settings
        features = {"example_index": cols["example_index"], "context_offsets": cols["context_offsets"]}
        predictions = decode_qa(logits[..., 0], logits[..., 1], features, contexts, s.max_answer_len, s.null_threshold)
        return {"object": "list", "data": answer_results(predictions, s.null_threshold is not None), "usage": _usage(cols)}, passes

    async def _fill_mask(self, texts: list[str], top_k: int, truncate: bool, language: int | str | None = None) -> tuple[dict, list]:
        row = self._language_row(language)  # a multilingual XLM: this request's row of its table
        ids, offsets, _ = await asyncio.to_thread(self._encode, texts, truncate)
        mask_id, mask = self.tokenizer.mask_id, self.tokenizer.special_tokens["mask"]
        positions = [np.flatnonzero(row == mask_id) for row in ids]
        for i, pos in enumerate(positions):
            if len(pos) == 0:
                raise InputError(f"input[{i}] has no mask token: write {mask!r} where model {self.name!r} should fill in a token")
        probs, passes = await self._run_rows([{"input_ids": x, "positions": pos, "language": row} for x, pos in zip(ids, positions)])
        data = [{"index": i, "masks": fill_results(self.tokenizer, texts[i], offsets[i], positions[i], probs[i], top_k)} for i in range(len(texts))]
        n_tokens = sum(len(row) for row in ids)
        return {"object": "list", "data": data, "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}, passes

    async def _embed_sparse(self, texts: list[str], truncate: bool, prompt_name: str | None = None) -> tuple[list[list[dict]], list]:
        """TEI's /embed_sparse: each text's SPLADE vector as its nonzero weights by token id (``sparse_vectors``)."""
        vectors, passes = await self.sparse_vectors(texts, truncate, prompt_name)
        return [sparse_values(v) for v in vectors], passes

    async def sparse_vectors(self, texts: list[str], truncate: bool, prompt_name: str | None = None) -> tuple[list[dict[str, np.ndarray]], list]:
        """(each text's SPLADE vector (``self.splade``) as {"indices", "values"}: its nonzero weights by token id;
        the passes' (rows, tokens, padded tokens)). The rows batch with /v1/fill-mask's (one masked-LM pass); a
        prompt goes before each text, as /embed's: ``prompt_name``'s, else the folder's default prompt."""
        ids = await asyncio.to_thread(self._sparse_inputs, texts, truncate, prompt_name)
        return await self._run_rows([{"input_ids": row} for row in ids])

    def sparse_now(self, texts: list[str], truncate: bool = False, prompt_name: str | None = None,
                   prompt: str | None = None) -> list[dict[str, np.ndarray]]:
        """``sparse_vectors`` without Serve's request batching: the passes run here, in this thread (``ctx
        embed``'s actors, as ``embed_now``). ``prompt``: a text put before each text, in place of a named one."""
        from jobs.serving.passes import on_forward_thread

        ids = self._sparse_inputs(texts, truncate, prompt_name, prompt)
        return [v for v, _ in on_forward_thread(self._rows_forward, [{"input_ids": row} for row in ids])] if ids else []

    def _sparse_inputs(self, texts: list[str], truncate: bool, prompt_name: str | None = None, prompt: str | None = None) -> list[np.ndarray]:
        """Each text's token ids with its prompt before it; an InputError for a model not served for SPLADE."""
        if self.splade is None:
            raise InputError(cannot_serve(self.name, {"family": self.family, **self.task_info()}, "/embed_sparse"))
        if prompt is not None and prompt_name is not None:
            raise InputError("prompt and prompt_name: give one of them")
        if prompt is None:
            prompt = self._named_prompt(prompt_name) if prompt_name is not None else (self.sentence.default_prompt if self.sentence is not None else "")
        return self._encode_ids([prompt + text for text in texts], truncate)

    async def _generate(self, prompt: str, max_tokens: int, temperature: float, top_k: int | None, top_p: float | None, seed: int | None,
                        language: int | str | None = None) -> tuple[dict, list]:
        row = self._language_row(language)  # a causal XLM: the row of its table it writes in
        tok = self.tokenizer
        ids, stop, placeholder = generation_prompt(tok, prompt)
        if len(ids) + max_tokens > self.max_len:
            raise InputError(
                f"the prompt has {len(ids)} tokens; with max_tokens {max_tokens} that is over the {self.max_len} tokens "
                f"model {self.name!r} reads: shorten the prompt or ask for fewer tokens"
            )
        if seed is None:
            seed = secrets.randbits(63)  # fresh entropy (never the global RNG), returned so the answer can be reproduced
        from jobs.serving.passes import forward

        # On the forward-pass thread, as every torch operation of the replica (jobs.serving.passes.on_forward_thread).
        new, finish = await forward(
            generate_ids, self.family, self.model, ids, max_tokens, stop, placeholder, temperature, top_k, top_p, seed, self.device, True, row
        )
        choice = {"index": 0, "text": decode_ids(tok, new), "token_ids": new, "tokens": [tok.id_to_token(i) for i in new], "finish_reason": finish}
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)}
        return {"object": "text_completion", "choices": [choice], "seed": seed, "usage": usage}, []  # one request at a time: no batched passes

    async def _tokenize(self, texts: list[str], add_special_tokens: bool, tei: bool = False, prompt_name: str | None = None) -> tuple[dict | list, list]:
        if prompt_name is not None:  # before each text, as /embed puts it
            prefix = self._named_prompt(prompt_name)
            texts = [prefix + text for text in texts]
        ids, offsets, tokens = await asyncio.to_thread(self.tokenizer.encode_for_model, texts, 2**31)
        n_tokens = sum(len(row) for row in ids)
        if n_tokens > self.limits.max_tokens_per_request:
            raise LimitError(f"the texts have {n_tokens} tokens, more than {self.limits.max_tokens_per_request} (max_tokens_per_request): send fewer or shorter texts")
        # [CLS] and [SEP] come off; a GPT-2-style tokenizer adds none, so nothing does
        cut = slice(1, -1) if not add_special_tokens and self.tokenizer.wraps_with_cls_sep else slice(None)
        if tei:  # TEI's tokens: "special" marks the ones the tokenizer added ([CLS], [SEP]), as the tokenizers library's mask does
            out = []
            for text, row_ids, row_offsets, row_tokens in zip(texts, ids, offsets, tokens):
                added = {0, len(row_ids) - 1} if self.tokenizer.wraps_with_cls_sep else set()
                row = []
                for k, (i, (a, b), tok) in enumerate(zip(row_ids, row_offsets, row_tokens)):
                    if k not in added:
                        row.append({"id": int(i), "text": text[a:b], "special": False, "start": int(a), "stop": int(b)})
                    elif add_special_tokens:
                        row.append({"id": int(i), "text": tok, "special": True, "start": None, "stop": None})
                out.append(row)
            return out, []
        data = [
            {"index": i, "ids": [int(x) for x in ids[i][cut]], "tokens": list(tokens[i][cut]), "offsets": [list(o) for o in offsets[i][cut]],
             "n_tokens": len(ids[i][cut]), "fits": len(ids[i]) <= self.max_len}
            for i in range(len(texts))
        ]
        return {"object": "list", "max_len": self.max_len, "data": data}, []


def _usage(cols: dict[str, np.ndarray]) -> dict[str, int]:
    n = int(cols["attention_mask"].sum())
    return {"prompt_tokens": n, "total_tokens": n}
