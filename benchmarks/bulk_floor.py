"""Where bulk embedding throughput goes on this machine, step by step from the in-process limit to
``ctx serve`` over HTTP, and the ceiling that puts on ``bulk_vs_limit`` and ``langchain_vs_limit``
(``benchmarks/serving.py``).

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/bulk_floor.py`` (about 4 minutes on 2 cores with
the defaults; the machine should be otherwise idle). Options: ``--seconds`` (each timed step, default
10), ``--rounds`` (2). The last lines are ratios over the limit, medians over rounds.

The steps, each measured in every round, in this order:

1. ``limit``: ``serving.py``'s limit (the same model in this process, no HTTP, no Ray:
   length-sorted batches of 32, normalised; the faster of ours and transformers'), before and after
   the other steps of the round (their mean).
2. ``replica direct``: a Ray Serve replica (``EmbeddingModel`` as ``ctx serve`` builds it, 2 CPUs, the
   request-path settings of ``jobs.serving.serve.SERVE_ENV``) running every text in length-sorted passes of
   32 on its forward thread, back to back: what being a Ray worker process costs.
3. ``replica bulk`` / ``replica langchain``: the same replica answering in-replica callers through
   its own request path minus HTTP (``EmbeddingModel._embed``: tokenizing, the cross-request batcher,
   pooling, normalising), as 8 callers sending 64 texts each and as one sending 1,000 texts, back to
   back: what batching requests costs (passes cut from what is queued, not from all texts sorted).
4. ``http bulk`` / ``http langchain``: ``ctx serve`` as ``serving.py`` starts it (HAProxy, uvicorn,
   FastAPI, JSON) under ``serving.py``'s bulk load (8 clients x 64 texts, float JSON) and LangChain's
   (1,000-text requests through the openai client's base64): what HTTP costs. Before the load, with
   no request in flight, ``serve_idle_cores``: the cores every other process on the machine keeps
   busy meanwhile (``ctx serve``'s Ray, Serve's controller, proxy and HAProxy, the replica's own
   timers): what a model inside Ray can never have.

Each replica step also gives the replica process's CPU (cores busy, from ``getrusage``), so a step
that loses throughput at the same CPU loses it to the work it does, and one that loses CPU loses it
to waiting. ``bulk_vs_limit_ceiling`` (and ``langchain_``) is step 3 over the limit: no HTTP front
end, however cheap, can take a Serve replica of this model past it on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import serving  # noqa: E402  (benchmarks/serving.py: texts, limit, servers and load generator)

SECONDS = 10.0
ROUNDS = 2
LANGCHAIN_REQUESTS = 6
IDLE_SETTLE_S = 10.0


class FloorReplica:
    """A Serve replica holding ``ctx serve``'s model object, timed from inside (no HTTP)."""

    def __init__(self, model_dir: str, texts: list[str]):
        from jobs.serving.replica import EmbeddingReplica
        from jobs.serving.serve_config import Limits, ModelConfig

        settings = ModelConfig(uri=model_dir, max_batch_size=serving.BATCH, batch_wait_timeout_s=0.01)  # serving.py's
        self.model = EmbeddingReplica("minilm", model_dir, None, settings, Limits())
        self.texts = texts

    @staticmethod
    def _cpu_s() -> float:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    async def direct(self, seconds: float) -> tuple[float, float]:
        """(texts/s, cores busy) of length-sorted passes of serving.BATCH over every text, back to back."""
        from jobs.serving.passes import forward

        _, items = self.model._embed_inputs(self.texts, "mean", None, False, "last")
        order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
        groups = [[items[i] for i in order[s : s + serving.BATCH]] for s in range(0, len(order), serving.BATCH)]
        await forward(self.model._pool, groups[0])  # warm-up
        cpu0, start, n = self._cpu_s(), time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            for group in groups:
                await forward(self.model._pool, group)
                n += len(group)
        elapsed = time.perf_counter() - start
        return n / elapsed, (self._cpu_s() - cpu0) / elapsed

    async def batched(self, callers: int, per_request: int, seconds: float) -> tuple[float, float]:
        """(texts/s, cores busy) of ``callers`` in-replica callers sending ``per_request`` texts back to
        back through ``_embed`` (normalised, as serving.py asks)."""
        done = [0]
        texts = self.texts

        async def caller(c: int, deadline: float) -> None:
            k = c
            while time.perf_counter() < deadline:
                batch = [texts[(k * per_request + j) % len(texts)] for j in range(per_request)]
                await self.model._embed(batch, "mean", True)
                done[0] += per_request
                k += callers

        await self.model._embed(texts[:per_request], "mean", True)  # warm-up
        cpu0, start = self._cpu_s(), time.perf_counter()
        await asyncio.gather(*(caller(c, start + seconds) for c in range(callers)))
        elapsed = time.perf_counter() - start
        return done[0] / elapsed, (self._cpu_s() - cpu0) / elapsed


def replica_steps(model_dir: Path, texts: list[str], seconds: float) -> dict[str, tuple[float, float]]:
    """Steps 2 and 3 on a Ray of this process's own, started as ``ctx serve`` starts one."""
    import ray
    from ray import serve

    from jobs.serving import serve as ctx_serve

    temp_dir = tempfile.mkdtemp(prefix="ray-bulk-floor-")
    ray.init(address="local", num_cpus=serving.CORES, object_store_memory=500_000_000, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR", _temp_dir=temp_dir)
    try:
        deployment = serve.deployment(ray_actor_options={"num_cpus": serving.CORES, "runtime_env": {"env_vars": ctx_serve.SERVE_ENV}})
        handle = serve.run(deployment(FloorReplica).bind(str(model_dir), texts), name="bulk-floor", route_prefix=None)
        timeout = 10 * seconds + 120
        return {
            "replica direct": handle.direct.remote(seconds).result(timeout_s=timeout),
            "replica bulk": handle.batched.remote(serving.BULK_CLIENTS, serving.BULK_PER_REQUEST, seconds).result(timeout_s=timeout),
            "replica langchain": handle.batched.remote(1, serving.BULK_TEXTS, seconds).result(timeout_s=timeout),
        }
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def others_cpu_s() -> float:
    """CPU seconds (user + system) used so far by every process on the machine but this one."""
    me, total = os.getpid(), 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def idle_cores(seconds: float) -> float:
    """Cores busy meanwhile outside this process, averaged over ``seconds`` (processes that end
    meanwhile are not counted: run it where nothing else starts or stops)."""
    cpu0, start = others_cpu_s(), time.perf_counter()
    time.sleep(seconds)
    return (others_cpu_s() - cpu0) / (time.perf_counter() - start)


def http_steps(model_dir: Path, texts: list[str], n_tokens: list[int], seconds: float) -> tuple[dict[str, float], float]:
    """Step 4: ``ctx serve`` in a child process, as serving.py runs it, under the bulk and LangChain loads;
    first, with no request at all, the cores its processes (Ray, Serve's controller, proxy and HAProxy,
    the replica) keep busy by themselves."""
    side = serving.sides(model_dir, REPO / ".venv-infinity" / "bin" / "python", serving.CORES)["ours"]
    log_dir = Path(tempfile.mkdtemp(prefix="bulk-floor-logs-"))
    running = serving.Running(side, log_dir, serving.CORES)
    try:
        running.wait_ready()
        time.sleep(IDLE_SETTLE_S)  # past start-up's last deployment steps
        idle = idle_cores(seconds)
        bulk = asyncio.run(serving.generate_load(running, texts, n_tokens, serving.BULK_CLIENTS, seconds,
                                                 per_request=serving.BULK_PER_REQUEST))
        langchain = asyncio.run(serving.generate_load(running, texts, n_tokens, 1, 0, per_request=serving.BULK_TEXTS,
                                                      requests=LANGCHAIN_REQUESTS, extra=serving.OPENAI_CLIENT_BODY))
    finally:
        running.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    for name, load in (("bulk", bulk), ("langchain", langchain)):
        if load.errors:
            raise SystemExit(f"ctx serve answered errors under the {name} load: {load.errors}")
    return {"http bulk": bulk.texts / bulk.seconds, "http langchain": langchain.texts / langchain.seconds}, idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=SECONDS, help=f"each timed step (default {SECONDS:g})")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds (default {ROUNDS})")
    parser.add_argument("--limit-seconds", type=float, default=serving.LIMIT_SECONDS)
    args = parser.parse_args()

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(serving.CORES)
    model_dir = serving.minilm_dir()
    texts = serving.load_texts(serving.N_TEXTS, serving.SEED)
    encoders, tokenizer = serving.limit_encoders(model_dir)
    n_tokens, batches, batch_tokens = serving.sorted_batches(texts, tokenizer)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores; "
          f"{args.seconds:g} s a step, {args.rounds} rounds, {serving.CORES} torch threads")

    def limit() -> float:
        return max(serving.measure_limit(encode, batches, batch_tokens, args.limit_seconds)[0] for encode in encoders.values())

    rounds: list[dict[str, float]] = []
    cores: dict[str, list[float]] = {}
    idle: list[float] = []
    for r in range(args.rounds):
        before = limit()
        replica = replica_steps(model_dir, texts, args.seconds)
        http, idle_now = http_steps(model_dir, texts, n_tokens, args.seconds)
        idle.append(idle_now)
        after = limit()
        got = {"limit": (before + after) / 2, **{k: v for k, (v, _) in replica.items()}, **http}
        for k, (_, c) in replica.items():
            cores.setdefault(k, []).append(c)
        rounds.append(got)
        print(f"round {r + 1}/{args.rounds}: limit {before:,.0f} then {after:,.0f} texts/s; " + ", ".join(
            f"{k} {v:,.0f}" + (f" ({replica[k][1]:.2f} cores)" if k in replica else "") for k, v in got.items() if k != "limit")
            + f"; ctx serve idle: {idle_now:.3f} cores", flush=True)

    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    lim = med["limit"]
    for k, v in med.items():
        busy = f"   {statistics.median(cores[k]):.2f} cores busy in the replica" if k in cores else ""
        print(f"{k + ':':<20} {v:8,.1f} texts/s   {v / lim:.2f} of the limit{busy}")
    print(f"serve_idle_cores: {statistics.median(idle):.3f} ({statistics.median(idle) / serving.CORES:.1%} of the machine, no request in flight)")
    print(f"replica_vs_limit: {med['replica direct'] / lim:.2f}")
    print(f"batching_bulk_vs_direct: {med['replica bulk'] / med['replica direct']:.2f}")
    print(f"batching_langchain_vs_direct: {med['replica langchain'] / med['replica direct']:.2f}")
    print(f"http_bulk_vs_replica: {med['http bulk'] / med['replica bulk']:.2f}")
    print(f"http_langchain_vs_replica: {med['http langchain'] / med['replica langchain']:.2f}")
    print(f"bulk_vs_limit_ceiling: {med['replica bulk'] / lim:.2f}")
    print(f"langchain_vs_limit_ceiling: {med['replica langchain'] / lim:.2f}")


if __name__ == "__main__":
    main()
