"""What Ray Serve's request path costs on this machine with no model behind it, and the ceiling that
puts on ``serving_vs_limit`` (``benchmarks/serving.py``).

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/serving_floor.py`` (about a minute on 2 cores; the
machine should be otherwise idle: CPU is counted for the whole machine). The last lines are
``path_cpu_ms_per_request: X`` and ``serving_vs_limit_ceiling: X``.

The no-op server: a Serve app started as ``ctx serve`` starts its own (a local Ray inside
``jobs.serving.serve.local_ray_env()``: HAProxy ingress straight to the replica's uvicorn), one replica, a
FastAPI ingress with ``POST /v1/embeddings`` that validates an OpenAI-style body with pydantic and
answers every text with the same fixed 384-float vector (what a MiniLM answer weighs as JSON), no
model, no tokenizer, no batching. The load: ``serving.py``'s clients, texts and timing.

Measured during the timed load: requests/s; the machine's busy CPU time (``/proc/stat``) and the
client's (this process: the load generator, plus the idle Ray driver's threads, which only makes
the server's share look smaller). ``path_cpu_ms_per_request`` = (machine - client) / requests: HAProxy,
uvicorn, Serve's ingress wrapper and metrics, FastAPI and JSON, per request.

The ceiling: the in-process forward (``serving.py``'s limit, best of ours and transformers') on one
thread gives the CPU one text's forward takes at the least (a single thread is busy the whole
time); on ``CORES`` cores a server that pays the request path once per one-text request can then
answer at most ``CORES / (forward + path)`` texts/s, even with a load generator that costs nothing.
``serving_vs_limit_ceiling`` is that over the limit at ``--threads`` threads (what
``serving_vs_limit`` divides by).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
import serving  # noqa: E402  (benchmarks/serving.py: texts, load generator, limit)
from fastapi import FastAPI  # noqa: E402
from pydantic import BaseModel  # noqa: E402

DIM = 384
app = FastAPI()
_v = np.random.default_rng(0).standard_normal(DIM)
VECTOR = (_v / np.linalg.norm(_v)).tolist()  # a unit vector, as normalised embeddings are


class Body(BaseModel):  # here, not serving.EmbeddingsBody: the replica cannot import benchmarks/serving.py
    model: str
    input: str | list[str]


@app.post("/v1/embeddings")
def embeddings(body: Body) -> dict:
    texts = [body.input] if isinstance(body.input, str) else body.input
    return {"object": "list", "model": body.model,
            "data": [{"object": "embedding", "index": i, "embedding": VECTOR} for i in range(len(texts))]}


def busy_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot (every state but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def measure_path(clients: int, seconds: float, texts: list[str]) -> tuple[float, float, float, str]:
    """(requests/s, machine CPU ms per request, client CPU ms per request, ingress) of the no-op Serve app."""
    import ray
    from ray import serve

    from jobs.serving import serve as ctx_serve

    port = serving.free_port()
    with ctx_serve.local_ray_env() as haproxy_files:
        ray.init(address="local", num_cpus=serving.CORES, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(serve.deployment(max_ongoing_requests=2 * clients)(serve.ingress(app)(type("Noop", (), {}))).bind(),
                  name="noop", route_prefix="/")
        running = types.SimpleNamespace(url=f"http://127.0.0.1:{port}", side=types.SimpleNamespace(path="/v1/embeddings"),
                                        body=lambda text: {"model": "noop", "input": text})
        deadline = time.monotonic() + 60
        while True:  # HAProxy may take a moment to route to the replica (errors come back counted, not raised)
            warm = asyncio.run(serving.generate_load(running, texts, [1] * len(texts), 1, 0.5))
            if warm.texts and not warm.errors:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the no-op server did not answer within 60 s: {warm.errors}")
            time.sleep(1)
        cpu0 = busy_cpu_s()
        load = asyncio.run(serving.generate_load(running, texts, [1] * len(texts), clients, seconds))
        machine = busy_cpu_s() - cpu0
        if load.errors:
            raise SystemExit(f"the no-op server answered errors: {load.errors}")
    finally:
        serve.shutdown()
        ray.shutdown()
        if haproxy_files is not None:
            shutil.rmtree(haproxy_files, ignore_errors=True)
    n = load.texts
    ingress = "HAProxy" if haproxy_files is not None else "Serve's Python proxy (no HAProxy here)"
    return n / load.seconds, machine / n * 1e3, load.client_cpu_s / n * 1e3, ingress


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=serving.SECONDS, help=f"timed load (default {serving.SECONDS:g})")
    parser.add_argument("--clients", type=int, default=serving.CLIENTS, help=f"concurrent clients (default {serving.CLIENTS})")
    parser.add_argument("--threads", type=int, default=serving.CORES, help=f"torch threads of the limit ceiling is compared to (default {serving.CORES})")
    parser.add_argument("--limit-seconds", type=float, default=serving.LIMIT_SECONDS)
    args = parser.parse_args()

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    texts = serving.load_texts(serving.N_TEXTS, serving.SEED)
    encoders, tokenizer = serving.limit_encoders(serving.minilm_dir())
    _, batches, batch_tokens = serving.sorted_batches(texts, tokenizer)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores; "
          f"{args.clients} clients, {args.seconds:g} s of load")

    limit: dict[int, float] = {}
    for threads in sorted({1, args.threads}):
        torch.set_num_threads(threads)
        limit[threads] = max(serving.measure_limit(encode, batches, batch_tokens, args.limit_seconds)[0] for encode in encoders.values())
        print(f"in-process forward, {threads} thread(s): {limit[threads]:,.1f} texts/s")
    torch.set_num_threads(args.threads)

    rate, machine_ms, client_ms, ingress = measure_path(args.clients, args.seconds, texts)
    path_ms = machine_ms - client_ms
    forward_ms = 1e3 / limit[1]  # one thread, busy the whole time: CPU ms per text
    ceiling = serving.CORES * 1e3 / (forward_ms + path_ms)
    print(f"no-op Serve app through {ingress}: {rate:,.1f} requests/s, machine CPU {machine_ms:.2f} ms/request, "
          f"of which the client's {client_ms:.2f}")
    print(f"forward_cpu_ms_per_text: {forward_ms:.2f}")
    print(f"path_cpu_ms_per_request: {path_ms:.2f}")
    print(f"ceiling: {ceiling:,.1f} texts/s on {serving.CORES} cores with a free client "
          f"(the limit at {args.threads} thread(s): {limit[args.threads]:,.1f})")
    print(f"serving_vs_limit_ceiling: {ceiling / limit[args.threads]:.2f}")


if __name__ == "__main__":
    main()
