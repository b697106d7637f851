"""Serve contextual embeddings over HTTP with Ray Serve.

    POST /v1/embeddings        OpenAI-compatible sentence vectors (mean or [CLS] pooling)
    POST /v1/token-embeddings  one vector per token from any layers, with the token strings and
                               their character offsets in the input
    GET  /healthz, GET /v1/models

Two kinds of deployment (Ray Serve docs, "Deploy Compositions of Models"):
* ``EmbeddingModel``, one per served model: loads a checkpoint (local path, ``file://`` or ``s3://``;
  a training run folder resolves to its newest complete ``checkpoint_*``) and its tokenizer, and
  groups concurrent sentence requests into one forward pass with ``@serve.batch``.
* ``Gateway``, the FastAPI ingress: validates requests with pydantic, routes them by model name
  and turns every failure into ``{"error": {"message", "type", ...}}`` with a 4xx status.

Deploy from Python (``run``), the command line (``ctx serve --model NAME=URI``), ``serve run``, or
a Serve config for ``serve deploy`` (``serve build`` wants a ready Application; write the config with
``serve_config`` instead):

    serve run jobs.serve:app_builder models=minilm=s3://bucket/minilm,bert=runs/bert-tiny
    python -c "import yaml, jobs.serve as s; print(yaml.safe_dump(s.serve_config({'minilm': 's3://b/m'})))" > serve.yaml
    serve deploy serve.yaml   # talks to the dashboard, port 8265
"""

# No `from __future__ import annotations`: Serve rebuilds the ingress methods' signatures, and FastAPI
# must see the pydantic request classes themselves, not strings, to read them from the body.
import asyncio
import base64
import logging
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, field_validator
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("ray.serve")

APP_NAME = "ctx-embeddings"
MAX_INPUTS = 2048  # texts per request, as OpenAI's embeddings API
DEFAULT_MAX_LEN = 512  # for families without a position table (ELMo's LSTMs read any length)


class InputError(ValueError):
    """A request a model cannot serve as asked (input too long, no such layer): answered with 400."""


# ----------------------------------------------------------------------------- loading


def resolve_checkpoint(uri: str) -> str:
    """The folder to load for ``uri``: itself when it is a checkpoint or a Hugging Face folder,
    else the newest ``checkpoint_*`` subfolder that has its MANIFEST.json (a training run)."""
    from pipelines import storage

    if not storage.exists(uri):
        raise storage.StorageError(f"model folder {uri!r} does not exist")
    if storage.exists(storage.join(uri, "MANIFEST.json")) or storage.exists(storage.join(uri, "config.json")):
        return uri
    latest = storage.latest_complete_checkpoint(uri)
    if latest is None:
        raise storage.StorageError(
            f"{uri!r} is neither a checkpoint (MANIFEST.json), a Hugging Face folder (config.json) nor a "
            f"run folder with a complete checkpoint_* subfolder: check the path, or wait for the first "
            f"checkpoint of the run"
        )
    return latest


def fetch_checkpoint(uri: str) -> tuple[Path, Path | None]:
    """(local folder to load, temporary folder to delete afterwards or None).

    Remote folders are copied with pyarrow.fs (``s3://`` honours AWS_ENDPOINT_URL)."""
    from pipelines import storage

    resolved = resolve_checkpoint(uri)
    if not storage.is_remote(resolved):
        return Path(storage.filesystem(resolved)[1]), None
    tmp = Path(tempfile.mkdtemp(prefix="ctx-serve-"))
    try:
        return storage.download_dir(resolved, tmp / "checkpoint"), tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def char_ids_backbone(backbone, tokenizer, max_chars: int):
    """ELMo reads characters: wrap its backbone so ``hidden_states`` takes token ids like every other
    family, looking each id's characters up in the table built from the checkpoint's tokenizer."""
    import torch

    from pipelines.char_ids import build_char_table
    from pipelines.tokenizers import ROLES

    tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]
    special = {role: getattr(tokenizer, f"{role}_id") for role in ROLES}  # pad, unk, cls, sep, mask
    table = torch.from_numpy(build_char_table(tokens, max_chars, special).astype("int64"))  # (V, C)

    class CharIdsBackbone(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = backbone
            self.register_buffer("table", table, persistent=False)

        def hidden_states(self, input_ids, attention_mask=None, token_type_ids=None):
            char_ids = self.table[input_ids]  # (B, T, C)
            if attention_mask is not None:
                char_ids = char_ids * (attention_mask != 0)[..., None]  # padding -> the masking char id 0
            return self.inner.hidden_states(char_ids, attention_mask)

    return CharIdsBackbone()


# ----------------------------------------------------------------------------- model replicas


@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=32)
class EmbeddingModel:
    """One model's replicas. Tokenization and validation run per request, before batching, so a bad
    request fails alone; only the forward pass of sentence requests is batched."""

    def __init__(self, name: str, uri: str, max_batch_size: int = 32, batch_wait_timeout_s: float = 0.01):
        import torch

        from ctxmodels.checkpoint import load_checkpoint
        from pipelines.tokenizers import load_tokenizer

        self.name, self.uri = name, uri
        local_dir, tmp = fetch_checkpoint(uri)
        try:
            loaded = load_checkpoint(local_dir)
            # Our checkpoints keep it in tokenizer/, Hugging Face folders at the top.
            self.tokenizer = load_tokenizer(loaded.tokenizer_dir or local_dir)
        finally:
            if tmp is not None:  # weights and vocabulary are in memory now
                shutil.rmtree(tmp, ignore_errors=True)
        self.family, config = loaded.family, loaded.config
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        backbone = getattr(loaded.model, "backbone", loaded.model)
        if self.family == "elmo":
            backbone = char_ids_backbone(backbone, self.tokenizer, config.max_chars)
        self.backbone = backbone.to(self.device).eval()
        # RoBERTa spends position rows on its offset: max_tokens is what it reads.
        max_len = getattr(config, "max_tokens", None) or getattr(config, "max_seq_len", None)
        self.max_len = int(max_len or DEFAULT_MAX_LEN)
        self.max_batch_size = max_batch_size
        self._embed_batch.set_max_batch_size(max_batch_size)
        self._embed_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        # One real forward pass: warms the model up and tells the layer count and width of any family.
        ids, mask = self._pad(self._encode(["hello world"])[0])
        with torch.inference_mode():
            hidden = self.backbone.hidden_states(ids, attention_mask=mask)
        self.n_hidden = len(hidden)  # n_layer + 1: index 0 is the embedding output
        self.dim = int(hidden[-1].shape[-1])

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "uri": self.uri,
            "family": self.family,
            "n_layer": self.n_hidden - 1,
            "dim": self.dim,
            "max_len": self.max_len,
        }

    # --- plain torch below, up to the Ray seam ---

    def _encode(self, texts: list[str]) -> tuple[list[np.ndarray], list[list[tuple[int, int]]], list[list[str]]]:
        # Ask for one token more than the model reads: a row that long was cut, so the text is too long.
        ids, offsets, tokens = self.tokenizer.encode_for_model(list(texts), self.max_len + 1)
        ids = [np.asarray(row, dtype=np.int64) for row in ids]
        for i, row in enumerate(ids):
            if len(row) > self.max_len:
                raise InputError(
                    f"input[{i}] is longer than the {self.max_len} tokens model {self.name!r} reads "
                    f"(special tokens included): shorten or split it"
                )
        offsets = [[(int(s), int(e)) for s, e in row] for row in offsets]
        return ids, offsets, [list(row) for row in tokens]

    def _pad(self, rows: list[np.ndarray]):
        """Right-padded (B, T) ids and attention mask on the model's device (ELMo needs right padding)."""
        import torch

        T = max(len(r) for r in rows)
        ids = np.full((len(rows), T), self.tokenizer.pad_id, dtype=np.int64)  # (B, T)
        mask = np.zeros((len(rows), T), dtype=np.int64)  # (B, T)
        for b, r in enumerate(rows):
            ids[b, : len(r)] = r
            mask[b, : len(r)] = 1
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device)

    def _layers(self, layers: str | list[int]) -> list[int]:
        from ctxmodels.features import resolve_layers

        try:
            return resolve_layers(layers, self.n_hidden)
        except ValueError as e:
            raise InputError(f"layers: {e} (model {self.name!r})") from None

    def _cls_position(self, row: np.ndarray) -> int:
        where = np.flatnonzero(row == self.tokenizer.cls_id)
        if len(where) == 0:
            raise InputError(f"pooling 'cls': model {self.name!r} puts no [CLS] token in its input; use pooling 'mean'")
        return int(where[0])

    def _token_vectors(self, rows: list[np.ndarray], layers: list[int]) -> list[np.ndarray]:
        """float32 (T_i, len(layers)*D) per row, run in chunks of max_batch_size rows."""
        import torch

        from ctxmodels import features

        out = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start : start + self.max_batch_size]
            ids, mask = self._pad(chunk)
            with torch.inference_mode():
                hidden = features.token_embeddings(self.backbone, ids, mask, layers=layers)  # (B, T, L*D)
            hidden = hidden.float().cpu().numpy()
            out.extend(hidden[b, : len(row)] for b, row in enumerate(chunk))
        return out

    def _pool(self, items: list[tuple[np.ndarray, int | None]]) -> list[np.ndarray]:
        """items: (ids, position to take, or None for the mean over real tokens) -> float32 (D,)."""
        import torch

        from ctxmodels import features

        ids, mask = self._pad([row for row, _ in items])
        with torch.inference_mode():
            hidden = features.token_embeddings(self.backbone, ids, mask, layers="last")  # (B, T, D)
            mean = features.mean_pool(hidden, mask)  # (B, D)
            out = [mean[b] if pos is None else hidden[b, pos] for b, (_, pos) in enumerate(items)]
        return [v.float().cpu().numpy() for v in out]

    # --- Ray seam: request handlers, called through DeploymentHandles ---

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def _embed_batch(self, items: list[tuple[np.ndarray, int | None]]) -> list[np.ndarray]:
        # The forward runs in a thread (torch releases the GIL), so the loop keeps queueing the next batch.
        return await asyncio.to_thread(self._pool, items)

    async def embed(self, texts: list[str], pooling: Literal["mean", "cls"] = "mean", normalize: bool = False) -> dict:
        """{"embeddings": float32 (D,) arrays, "n_tokens": tokens per text, special tokens included}."""
        ids, _, _ = self._encode(texts)
        positions = [self._cls_position(row) if pooling == "cls" else None for row in ids]
        vectors = await asyncio.gather(*(self._embed_batch((row, pos)) for row, pos in zip(ids, positions)))
        if normalize:
            vectors = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]
        return {"embeddings": vectors, "n_tokens": [len(row) for row in ids]}

    async def token_embeddings(self, texts: list[str], layers: str | list[int] = "last") -> list[dict]:
        """Per text: tokens, offsets, n_tokens and float32 (T, len(layers)*D) vectors, layers in the order asked."""
        layer_ids = self._layers(layers)
        ids, offsets, tokens = self._encode(texts)
        vectors = await asyncio.to_thread(self._token_vectors, ids, layer_ids)
        return [
            {"tokens": tok, "offsets": off, "embeddings": vec, "n_tokens": len(row)}
            for tok, off, vec, row in zip(tokens, offsets, vectors, ids)
        ]


# ----------------------------------------------------------------------------- HTTP API


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


def _error(status: int, message: str, type_: str, code: str | None = None) -> JSONResponse:
    body: dict[str, Any] = {"message": message, "type": type_}
    if code:
        body["code"] = code
    return JSONResponse(status_code=status, content={"error": body})


def _check_texts(value: Any, *, allow_str: bool) -> Any:
    """One readable error instead of pydantic's one-per-union-member list."""
    if isinstance(value, str) and allow_str:
        texts = [value]
    elif isinstance(value, list) and all(isinstance(t, str) for t in value):
        texts = value
    else:
        wanted = "a string or a list of strings" if allow_str else "a list of strings"
        if isinstance(value, list):
            bad = next(i for i, t in enumerate(value) if not isinstance(t, str))
            raise ValueError(f"must be {wanted}; item {bad} is {type(value[bad]).__name__}")
        raise ValueError(f"must be {wanted}, got {type(value).__name__}")
    if not texts:
        raise ValueError("must not be empty")
    if len(texts) > MAX_INPUTS:
        raise ValueError(f"has {len(texts)} texts; at most {MAX_INPUTS} per request")
    for i, t in enumerate(texts):
        if not t.strip():
            raise ValueError(f"item {i} is empty or only whitespace")
    return value


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"
    pooling: Literal["mean", "cls"] = "mean"
    normalize: bool = False
    user: str | None = None  # accepted for OpenAI clients; unused

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        return _check_texts(v, allow_str=True)


class TokenEmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: list[str]
    layers: Literal["last"] | list[int] = "last"  # or layer indexes in output order; 0 = embedding output

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        v = _check_texts(v, allow_str=True)
        return [v] if isinstance(v, str) else v

    @field_validator("layers", mode="before")
    @classmethod
    def _layers(cls, v: Any) -> Any:
        ints = isinstance(v, list) and v and all(isinstance(k, int) and not isinstance(k, bool) for k in v)
        if v != "last" and not ints:
            raise ValueError(f'must be "last" or a non-empty list of layer indexes (0 = embedding output), got {v!r}')
        return v


api = FastAPI(title="ctx embeddings", version="1")


@api.exception_handler(ApiError)
async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return _error(e.status, e.message, e.type, e.code)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
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
    return _error(422, "; ".join(problems) or "invalid request", "invalid_request_error")


@api.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found" if e.status_code == 404 else "invalid_request_error"
    return _error(e.status_code, f"{request.method} {request.url.path}: {e.detail}", kind)


@api.exception_handler(Exception)
async def _internal_error(request: Request, e: Exception) -> JSONResponse:
    cause = getattr(e, "cause", None) or e  # a replica's exception arrives wrapped in a RayTaskError
    logger.error("%s %s failed", request.method, request.url.path, exc_info=e)
    return _error(500, f"internal error: {type(cause).__name__}: {cause}", "server_error")


def _encode_vector(v: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's format: little-endian float32 bytes
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
    return np.asarray(v, dtype=np.float32).tolist()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
@serve.ingress(api)
class Gateway:
    """Routes requests by model name to the EmbeddingModel deployments' handles."""

    def __init__(self, models: dict[str, DeploymentHandle]):
        self.models = models
        self.created = int(time.time())

    def _handle(self, name: str) -> DeploymentHandle:
        if name not in self.models:
            known = ", ".join(sorted(self.models))
            raise ApiError(404, f"model {name!r} is not served here; known models: {known}", code="model_not_found")
        return self.models[name]

    async def _call(self, response) -> Any:
        """Await a handle call; InputError raised in the replica becomes a 400."""
        try:
            return await response
        except InputError as e:  # Ray re-raises it as a RayTaskError that is also an InputError
            cause = getattr(e, "cause", e)
            raise ApiError(400, str(cause.args[0]) if cause.args else str(cause)) from None

    @api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok", "models": sorted(self.models)}

    @api.get("/v1/models")
    async def list_models(self) -> dict:
        owner, created = "ctxmodels", self.created
        data = [{"id": name, "object": "model", "created": created, "owned_by": owner} for name in sorted(self.models)]
        return {"object": "list", "data": data}

    @api.post("/v1/embeddings")
    async def embeddings(self, req: EmbeddingsRequest) -> JSONResponse:
        handle = self._handle(req.model)
        texts = [req.input] if isinstance(req.input, str) else req.input
        out = await self._call(handle.embed.remote(texts, req.pooling, req.normalize))
        n_tokens = sum(out["n_tokens"])
        data = [
            {"object": "embedding", "index": i, "embedding": _encode_vector(v, req.encoding_format)}
            for i, v in enumerate(out["embeddings"])
        ]
        # JSONResponse directly: FastAPI's jsonable_encoder would walk every float of every vector.
        return JSONResponse({
            "object": "list",
            "data": data,
            "model": req.model,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        })

    @api.post("/v1/token-embeddings")
    async def token_embeddings(self, req: TokenEmbeddingsRequest) -> JSONResponse:
        handle = self._handle(req.model)
        rows = await self._call(handle.token_embeddings.remote(req.input, req.layers))
        n_tokens = sum(r["n_tokens"] for r in rows)
        data = [
            {
                "index": i,
                "tokens": r["tokens"],
                "offsets": [list(o) for o in r["offsets"]],
                "embeddings": np.asarray(r["embeddings"], dtype=np.float32).tolist(),
            }
            for i, r in enumerate(rows)
        ]
        return JSONResponse({
            "object": "list",
            "model": req.model,
            "layers": req.layers,
            "data": data,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        })


# ----------------------------------------------------------------------------- building and running

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$")


def build_app(
    models: dict[str, str],
    *,
    num_replicas: int = 1,
    max_batch_size: int = 32,
    batch_wait_timeout_s: float = 0.01,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    max_ongoing_requests: int = 32,
) -> serve.Application:
    """A Serve application: one EmbeddingModel deployment per ``name -> uri`` plus the Gateway."""
    if not models:
        raise ValueError("build_app: give at least one model as {name: uri}")
    handles = {}
    for i, (name, uri) in enumerate(models.items()):
        if not _NAME.match(name):
            raise ValueError(f"model name {name!r}: use letters, digits and . _ / : - (at most 128 characters)")
        if not isinstance(uri, str) or not uri:
            raise ValueError(f"model {name!r}: the checkpoint URI must be a non-empty string, got {uri!r}")
        deployment_name = f"EmbeddingModel-{i}-" + re.sub(r"[^A-Za-z0-9_-]", "_", name)
        handles[name] = EmbeddingModel.options(
            name=deployment_name,
            num_replicas=num_replicas,
            max_ongoing_requests=max_ongoing_requests,
            ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        ).bind(name, uri, max_batch_size, batch_wait_timeout_s)
    return Gateway.bind(handles)


class ServeArgs(BaseModel):
    """Arguments of ``app_builder``, from a Serve config's ``args`` or ``serve run ... key=value``."""

    model_config = ConfigDict(extra="forbid")

    models: dict[str, str]
    num_replicas: int = 1
    max_batch_size: int = 32
    batch_wait_timeout_s: float = 0.01
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 32

    @field_validator("models", mode="before")
    @classmethod
    def _models(cls, v: Any) -> Any:
        if isinstance(v, str):  # "a=uri,b=uri" from the command line
            pairs = [p.strip() for p in v.split(",") if p.strip()]
            bad = [p for p in pairs if "=" not in p]
            if bad:
                raise ValueError(f"expected NAME=URI[,NAME=URI...], got {bad[0]!r}")
            return dict(p.split("=", 1) for p in pairs)
        return v


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Entry for ``serve run`` and Serve configs: ``import_path: jobs.serve:app_builder`` with ``args``."""
    parsed = ServeArgs(**args)
    return build_app(parsed.models, **parsed.model_dump(exclude={"models"}))


def serve_config(models: dict[str, str], *, host: str = "0.0.0.0", port: int = 8000, **build_kwargs: Any) -> dict:
    """A Serve config (the YAML that ``serve deploy`` reads) deploying ``app_builder`` with these args."""
    args = ServeArgs(models=models, **build_kwargs).model_dump()  # fail here, not on the cluster
    return {
        "http_options": {"host": host, "port": port},
        "applications": [
            {"name": APP_NAME, "route_prefix": "/", "import_path": "jobs.serve:app_builder", "args": args},
        ],
    }


def run(
    models: dict[str, str],
    host: str = "127.0.0.1",
    port: int = 8000,
    blocking: bool = True,
    verbose: bool = False,
    address: str | None = None,
    **build_kwargs: Any,
) -> DeploymentHandle:
    """Start Serve's HTTP proxy on host:port and deploy the app at "/"; returns the Gateway's handle.

    With ``blocking`` it serves until Ctrl-C, then shuts Serve down. Without a Ray session it calls
    ``ray.init(address)``: None joins the cluster in RAY_ADDRESS or one ``ray start`` left on this
    machine, else starts a local one."""
    import ray

    application = build_app(models, **build_kwargs)  # argument errors before anything starts
    for uri in models.values():
        resolve_checkpoint(uri)  # a wrong path fails here in seconds, not after Serve's replica retries
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=verbose, logging_level="INFO" if verbose else "ERROR")
    logging_config = None if verbose else {"log_level": "WARNING"}
    # --- Ray seam: the HTTP proxy, then the application (blocks until every replica is healthy) ---
    serve.start(http_options={"host": host, "port": port}, logging_config=logging_config)
    handle = serve.run(application, name=APP_NAME, route_prefix="/", logging_config=logging_config)
    if not blocking:
        return handle
    print(f"serving {', '.join(sorted(models))} on http://{host}:{port} (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print("shutting down", flush=True)
    finally:
        serve.shutdown()
    return handle


def shutdown() -> None:
    """Stop Serve (all applications and its HTTP proxy) on the connected cluster."""
    serve.shutdown()
