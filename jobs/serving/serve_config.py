"""The serving configuration: one typed source of defaults for ``ctx serve``, ``ctx serve --config``,
``ctx serve build``, ``serve run jobs.serving.serve:app_builder`` and ``serve deploy``.

    # serve.yaml
    host: 127.0.0.1
    port: 8000
    models:
      minilm: /models/all-MiniLM-L6-v2          # a URI alone takes the defaults below
      bert:
        uri: s3://bucket/runs/bert-base          # a run folder: its newest complete checkpoint,
        autoscaling:                             # resolved once when the app is built
          min_replicas: 1
          max_replicas: 4
          target_ongoing_requests: 8
    multiplexed:                                 # many models in one deployment (Ray Serve model multiplexing):
      max_num_models_per_replica: 2              # loaded on a replica at its first request, the least recently
      num_replicas: 1                            # used one evicted beyond this many
      models:
        customer-a: s3://bucket/runs/ft-a        # resolved once when the app is built, as the pinned models
        customer-b: models:/ft-b@production
    defaults:                                    # every model's settings unless it sets its own
      max_batch_size: 32                         # texts in one forward pass
      max_batch_tokens: 16384                    # and at most this many padded tokens (rows x longest)
      num_cpus: 1
      max_queued_requests: 64
    limits:
      max_chars_per_request: 1000000
      request_timeout_s: 60
    auth:
      api_key_sha256: [...]                      # `ctx serve --api-key-file` hashes keys into this

Nothing here imports Ray: the config validates (and names the bad key) before anything starts.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

APP_NAME = "ctx-embeddings"
IMPORT_PATH = "jobs.serving.serve:app_builder"
API_KEYS_ENV = "CTX_API_KEYS"  # comma-separated keys, read by `ctx serve` when no --api-key-file is given


class InputError(ValueError):
    """A request a model cannot serve as asked (input too long, no such layer): answered with 400."""


class LimitError(InputError):
    """A request over one of the server's limits (tokens per request, token-embedding size): 413."""


class Limits(BaseModel):
    """Request limits: each is checked before the work it bounds, and answered with 413 naming it."""

    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(8 * 2**20, gt=0)  # read before parsing; 413 even without Content-Length
    max_inputs: int = Field(2048, gt=0)  # texts per request, as OpenAI's embeddings API
    max_chars_per_text: int = Field(100_000, gt=0)  # checked before tokenizing
    max_chars_per_request: int = Field(1_000_000, gt=0)  # ~0.5 s of tokenizing on one core
    max_tokens_per_request: int = Field(65_536, gt=0)  # counted while tokenizing, before the forward pass
    # tokens x layers x width of one /v1/token-embeddings answer: 4M floats is ~16 MB as base64, ~50 MB as JSON
    max_token_embedding_values: int = Field(4 * 2**20, gt=0)
    request_timeout_s: float = Field(60.0, gt=0)  # a request still running then is cancelled: 504
    # /v1/generate's max_tokens: a forward pass per new token (one position with GPT's KV cache or
    # Transformer-XL's memory; the whole sequence again for XLNet)
    max_new_tokens: int = Field(256, gt=0)


class Autoscaling(BaseModel):
    """Ray Serve's autoscaling, the three knobs that matter (Serve's AutoscalingConfig has the rest)."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0)

    @model_validator(mode="after")
    def _order(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        return self


class ModelSettings(BaseModel):
    """How one model's deployment runs: replicas, batching, resources and its bounded queue."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1)  # ignored when autoscaling is set
    autoscaling: Autoscaling | None = None
    max_batch_size: int = Field(32, ge=1)  # texts in one forward pass
    # Padded tokens (rows x longest row) in one forward pass. The texts (or task rows) a batch collects
    # are sorted by length and split into forward passes under this budget, so short texts are not
    # padded to a long one's length; a text longer than the budget runs alone (keep it >= the models' max_len).
    max_batch_tokens: int = Field(16384, ge=1)
    # The budget of a pass while small requests (8 texts or fewer) are about beside a large one: short
    # passes, so a one-text request never waits long for the pass in front of it (jobs/serving/batching.py).
    # ~25 ms a pass of MiniLM on 2 CPU cores; a GPU wants several thousand.
    interactive_batch_tokens: int = Field(256, ge=1)
    batch_wait_timeout_s: float = Field(0.01, ge=0)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # The weights and activations of the forward passes (vectors are float32 either way): "auto" is
    # float16 on a GPU (TEI's and Infinity's default there: half the memory traffic, tensor cores) and
    # float32 on the CPU; "bfloat16" also pays on a CPU with native bf16 products (AVX512-BF16, AMX).
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # On a GPU, sentence-vector passes of a BERT, RoBERTa, SpanBERT or ALBERT backbone, and the task
    # routes' passes of a model fine-tuned on one (classify, rerank, tag, answer), replay from CUDA
    # graphs, one per padded (rows, length) bucket (ctxmodels.graphs): one launch a pass instead of one a
    # kernel. False runs every pass eagerly (vLLM's enforce_eager). Ignored on the CPU.
    cuda_graphs: bool = True
    # XLM with a language table: the language its texts are read as, a name of the checkpoint's
    # data.languages (or an HF folder's lang2id) or a row number; None: the first (row 0). One
    # deployment reads one language: serve the checkpoint under one name per language.
    language: int | str | None = None
    # The sentence vectors of a request that names no pooling / normalize (/v1/embeddings, TEI's /embed):
    # None takes the model's own, a sentence-transformers folder's pooling and Normalize module, else
    # mean pooling, not normalised (TEI's --pooling overrides a folder's pooling the same way).
    pooling: Literal["mean", "cls", "last"] | None = None
    normalize: bool | None = None
    # SPLADE vectors on TEI's POST /embed_sparse, from the masked-LM head: None serves a sentence-transformers
    # SparseEncoder folder so (its SpladePooling), true any pretrained masked LM with its head (max pooling of
    # relu: TEI's --pooling splade), false none. A SPLADE model's dense routes need a pooling named.
    splade: bool | None = None
    max_ongoing_requests: int = Field(32, ge=1)  # per replica
    max_queued_requests: int = Field(64, ge=1)  # per caller (the Gateway); beyond it: 429 + Retry-After
    request_timeout_s: float | None = Field(None, gt=0)  # None: limits.request_timeout_s


class ModelConfig(ModelSettings):
    uri: str = Field(min_length=1)  # checkpoint, Hugging Face folder or training run folder (local, file://, s3://)


class MultiplexedConfig(ModelSettings):
    """Models served by one deployment with Ray Serve's model multiplexing: a replica loads a model on its
    first request for it and keeps at most ``max_num_models_per_replica``, evicting the least recently used.
    The settings (replicas, autoscaling, batching, resources, queue) are the deployment's, shared by its models."""

    models: dict[str, str]  # name -> URI, as a pinned model's uri
    max_num_models_per_replica: int = Field(3, ge=1)  # Serve's @serve.multiplexed argument (its default is 3 too)

    @field_validator("models")
    @classmethod
    def _some(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("give at least one model as {name: uri}")
        for name, uri in v.items():
            if not uri:
                raise ValueError(f"model {name!r}: the uri is empty")
        return v


class GatewaySettings(BaseModel):
    """The FastAPI ingress. One replica: it only routes and encodes, and `ctx serve` drains it on stop."""

    model_config = ConfigDict(extra="forbid")

    max_ongoing_requests: int = Field(256, ge=1)
    max_queued_requests: int = Field(512, ge=1)  # waiting for the Gateway (in its replica behind HAProxy); beyond it Serve answers 429
    num_cpus: float = Field(0.0, ge=0)


class Auth(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # SHA-256 hex digests of the accepted keys: the config (and Serve's dashboard) never holds a key.
    api_key_sha256: list[str] = []
    # Serve without keys on a non-loopback host anyway (behind an authenticating proxy, say).
    insecure_no_auth: bool = False

    @field_validator("api_key_sha256")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        for i, h in enumerate(v):
            if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                raise ValueError(f"item {i} is not a lowercase SHA-256 hex digest (64 characters); hash keys with hash_api_key")
        return v


class ServeConfig(BaseModel):
    """Everything ``ctx serve`` deploys: the models by name, their settings, limits and auth."""

    model_config = ConfigDict(extra="forbid")

    models: dict[str, ModelConfig] = {}  # pinned: always loaded, a deployment each
    multiplexed: MultiplexedConfig | None = None  # loaded on demand, one deployment for all of them
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    defaults: ModelSettings = ModelSettings()
    limits: Limits = Limits()
    gateway: GatewaySettings = GatewaySettings()
    auth: Auth = Auth()
    retry_after_s: float = Field(1.0, ge=0)  # the Retry-After of a 429 (queue full) or 503 (stopping)
    drain_timeout_s: float = Field(30.0, ge=0)  # on stop, how long in-flight requests may take to finish
    app_name: str = APP_NAME

    @model_validator(mode="before")
    @classmethod
    def _models_take_the_defaults(cls, data: Any) -> Any:
        """``models`` as {name: uri | {uri, settings}} or "a=uri,b=uri"; each model, and the multiplexed
        deployment, starts from ``defaults``."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        defaults = data.get("defaults") or {}
        if isinstance(defaults, BaseModel):
            defaults = defaults.model_dump(exclude_unset=True)
        if isinstance(data.get("multiplexed"), dict) and isinstance(defaults, dict):
            data["multiplexed"] = {**defaults, **data["multiplexed"]}
        models = data.get("models")
        if isinstance(models, str):  # "a=uri,b=uri" from `serve run ... models=...`
            pairs = [p.strip() for p in models.split(",") if p.strip()]
            bad = [p for p in pairs if "=" not in p]
            if bad:
                raise ValueError(f"models: expected NAME=URI[,NAME=URI...], got {bad[0]!r}")
            models = dict(p.split("=", 1) for p in pairs)
        if isinstance(models, dict):
            merged = {}
            for name, m in models.items():
                if isinstance(m, str):
                    m = {"uri": m}
                if isinstance(m, dict) and isinstance(defaults, dict):
                    m = {**defaults, **m}
                merged[name] = m
            data["models"] = merged
        return data

    @model_validator(mode="after")
    def _names(self) -> ServeConfig:
        multiplexed = list(self.multiplexed.models) if self.multiplexed is not None else []
        if not self.models and not multiplexed:
            raise ValueError("models: give at least one model as {name: uri} (or under multiplexed.models)")
        for name in [*self.models, *multiplexed]:
            if not _valid_name(name):
                raise ValueError(f"model name {name!r}: use letters, digits and . _ / : - (at most 128 characters)")
        both = sorted(set(self.models) & set(multiplexed))
        if both:
            raise ValueError(f"model {both[0]!r} is under both models and multiplexed.models: a name is served one way")
        return self

    def names(self) -> list[str]:
        """Every model served, pinned and multiplexed."""
        return sorted([*self.models, *(self.multiplexed.models if self.multiplexed is not None else ())])

    def is_multiplexed(self, model: str) -> bool:
        return self.multiplexed is not None and model in self.multiplexed.models

    @model_validator(mode="after")
    def _keys_off_loopback(self) -> ServeConfig:
        if not is_loopback(self.host) and not self.auth.api_key_sha256 and not self.auth.insecure_no_auth:
            raise ValueError(
                f"host {self.host!r} is reachable from other machines and no API key is set: give keys "
                f"(--api-key-file, ${API_KEYS_ENV} or auth.api_key_sha256), or serve without them on purpose "
                f"with --insecure-no-auth (auth.insecure_no_auth: true)"
            )
        return self

    def settings(self, model: str) -> ModelSettings:
        """The settings a served model runs with (a multiplexed one: the multiplexed deployment's)."""
        return self.multiplexed if self.is_multiplexed(model) else self.models[model]

    def timeout_s(self, model: str) -> float:
        return self.settings(model).request_timeout_s or self.limits.request_timeout_s

    @classmethod
    def from_models(cls, models: dict[str, str], **settings: Any) -> ServeConfig:
        """Keyword settings sorted to where they belong: model settings (num_cpus, max_batch_size, ...)
        into ``defaults``, limit names into ``limits``, the rest (host, port, auth, ...) top level."""
        defaults = {k: settings.pop(k) for k in list(settings) if k in ModelSettings.model_fields}
        limits = {k: settings.pop(k) for k in list(settings) if k in Limits.model_fields}
        if defaults:
            settings["defaults"] = {**dict(settings.get("defaults") or {}), **defaults}
        if limits:
            settings["limits"] = {**dict(settings.get("limits") or {}), **limits}
        return cls(models=models, **settings)


def _valid_name(name: str) -> bool:
    import re

    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}", name) is not None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def read_api_keys(path: str | None) -> list[str]:
    """Keys from a file (one a line, # comments) or, without one, from $CTX_API_KEYS (comma-separated)."""
    if path is not None:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        keys = [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]
        if not keys:
            raise ValueError(f"{path}: no API keys in it (one a line)")
    else:
        keys = [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    short = [i for i, k in enumerate(keys) if len(k) < 16]
    if short:
        raise ValueError(f"API key {short[0] + 1} has fewer than 16 characters: use long random keys (e.g. `openssl rand -hex 32`)")
    return keys


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ServeConfig:
    """A serve.yaml, with command-line overrides on top; errors name the file and the key."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read it as YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with a 'models' key, got {type(data).__name__}")
    return validate(_merged(data, overrides or {}), where=str(path))


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` on top, mapping into mapping (``multiplexed.models`` gains the
    flag's models and keeps the file's); anything else replaces what the file had."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def validate(data: dict[str, Any], where: str = "serve config") -> ServeConfig:
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{key}: {msg}" if key else msg)
        raise ConfigError(f"{where}: " + "; ".join(problems)) from None


class ConfigError(ValueError):
    """A serve config that cannot be used; the message names the file and the key."""


def deploy_config(config: ServeConfig) -> dict[str, Any]:
    """The Serve config ``serve deploy`` reads: Serve's HTTP options plus one application that runs
    ``app_builder`` with this config as its args (API keys only as their SHA-256)."""
    exclude = {"host", "port", "defaults"} | ({"multiplexed"} if config.multiplexed is None else set())
    args = config.model_dump(mode="json", exclude=exclude)  # models (and multiplexed) hold their merged settings
    args["models"] = {name: {"uri": m.pop("uri"), **m} for name, m in args["models"].items()}
    return {
        # The proxy's own timeout is a backstop behind the Gateway's per-request one.
        "http_options": {"host": config.host, "port": config.port, "request_timeout_s": config.limits.request_timeout_s + 30},
        "applications": [{"name": config.app_name, "route_prefix": "/", "import_path": IMPORT_PATH, "args": args}],
    }
