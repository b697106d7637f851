"""Scheduled retraining end to end on loopback: a real Ray head (`ray start --head`), an S3 endpoint
(moto's server) and a real MLflow server (`mlflow server --backend-store-uri sqlite:///F`).

Production is seeded with a tiny BERT checkpoint on S3 and served; `ctx schedule` starts the detached scheduler
watching a prefix; new shards land; the round continues pretraining from @production, passes its
gate, is promoted, and the Serve app answers with the new version while a client sending requests
throughout sees only 200s. A second round (`ctx schedule --once`) with a gate it cannot pass
registers its candidate but changes neither @production nor the app, and `ctx schedule status`
says why. Every process is started here and stopped by its PID / process group.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import boto3
import pytest
import requests
import yaml

from tests.conftest import REPO, free_port, stop_process_group

pytestmark = pytest.mark.slow

VENV_BIN = Path(sys.executable).parent
SHARDS = [REPO / f"data/sample/wordnet-000{i}-of-0008.txt.gz" for i in range(3)]
HELD_OUT = REPO / "data/sample/wordnet-0007-of-0008.txt.gz"
TINY = [  # ~10 steps of a small BERT on short sequences: what a round trains
    "data.seq_len=32", "train.batch_size=8", "train.max_steps=10", "train.warmup_steps=2", "train.log_every=5",
    "train.checkpoint_every=10", "scaling.num_workers=1", "scaling.cpus_per_worker=0.5", "data.max_epochs=1",
]



def _wait(what: str, ok, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if ok():
                return
        except Exception:
            pass
        time.sleep(0.5)
    pytest.fail(f"{what} did not come up in {timeout_s} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def mlflow_server():
    """A real MLflow tracking server with a SQLite backend on a free loopback port; yields its URL."""
    root = Path(tempfile.mkdtemp(prefix="mlflow-"))
    port = free_port()
    log = root / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
             "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no huey consumers: the registry needs none
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait("mlflow server", lambda: requests.get(f"{url}/health", timeout=2).status_code == 200, proc, log)
        yield url
    finally:
        stop_process_group(proc)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_head(s3_server, mlflow_server):
    """A single-node Ray head on loopback whose processes import this checkout and reach the S3 and
    MLflow endpoints; yields its GCS address."""
    temp_dir = tempfile.mkdtemp(prefix="raysch-")  # short: Ray's socket paths must fit 107 chars
    port = free_port()
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "RAY_AUTH_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "MLFLOW_TRACKING_URI": mlflow_server,
        # Ray 2.60's head drains for up to 30 s on SIGTERM while the detached scheduler holds a
        # lease; the teardown has nothing to drain and would wait that out.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }
    for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    log = Path(temp_dir) / "head.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(VENV_BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
             "--ray-client-server-port", str(free_port()), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(free_port()),
             "--dashboard-agent-listen-port", str(free_port()), "--num-cpus", "2", "--object-store-memory", str(300 * 1024**2),
             "--temp-dir", temp_dir, "--disable-usage-stats"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        _wait("ray head", lambda: "Ray runtime started" in log.read_text() or "--block" in log.read_text(), proc, log)
        time.sleep(2)
        yield address, env
    finally:
        stop_process_group(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def ctx(args: list[str], env: dict, timeout_s: float = 400) -> subprocess.CompletedProcess:
    """The `ctx` command, as a user runs it, against the head (RAY_ADDRESS)."""
    done = subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"ctx {' '.join(args)} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_scheduled_round_promotes_and_rolls_then_a_gated_round_changes_nothing(ray_head, s3_bucket, mlflow_server, tmp_path):
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model
    from jobs.registry import Registry
    from jobs.operations.schedule import ScheduleState
    from jobs.identity import checkpoint_version
    from pipelines import storage
    from pipelines.sources import sample_text
    from pipelines.tokenizers import train_tokenizer

    address, head_env = ray_head
    env = {**head_env, "RAY_ADDRESS": address, "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
    bucket = f"s3://{s3_bucket}"
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])

    # --- production: a tiny BERT with its own tokenizer, on S3 (what a finished run leaves there),
    # registered and promoted. Not a Ray Train run: the rounds below train for real, and a third
    # training run would add a minute to the suite's most expensive test.
    tok = train_tokenizer("wordpiece", sample_text([str(SHARDS[2])], 200_000), 800)
    tok.save(tmp_path / "tok")
    cfg, model = build_model("bert", "tiny", {"vocab_size": tok.vocab_size, "nsp": False}, seed=0)
    local = save_checkpoint(tmp_path / "seed" / "checkpoint_2026-01-01_00-00-00.000000", model, "bert", cfg, tokenizer_dir=tmp_path / "tok")
    seed_ckpt = f"{bucket}/runs/seed/{local.name}"
    storage.Store().copy_dir(local, seed_ckpt)
    registry = Registry(mlflow_server)
    v1 = registry.register("bert-tiny", seed_ckpt)
    registry.promote("bert-tiny", v1.version)

    # --- serve it; a client sends requests from now to the end
    port = free_port()
    serve_cfg = tmp_path / "serve.yaml"
    serve_cfg.write_text(yaml.safe_dump({"host": "127.0.0.1", "port": port, "models": {"bert": {"uri": seed_ckpt, "num_cpus": 0.1}},
                                         "gateway": {"num_cpus": 0.1}}))
    serve_log = tmp_path / "serve.log"
    with open(serve_log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "jobs.cli", "serve", "--config", str(serve_cfg), "--address", address],
                                  cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    statuses: list[int] = []
    versions: list[str] = []
    stop = threading.Event()

    def client() -> None:
        with requests.Session() as s:
            while not stop.is_set():
                try:
                    r = s.post(f"{url}/v1/embeddings", json={"model": "bert", "input": ["the river bank"]}, timeout=60)
                except requests.RequestException as e:
                    statuses.append(-1)
                    versions.append(repr(e))
                    continue
                statuses.append(r.status_code)
                versions.append(r.json()["model_version"] if r.status_code == 200 else r.text)
                time.sleep(0.05)

    thread = threading.Thread(target=client)
    schedule = {
        "name": "e2e", "model": "bert-tiny", "tracking_uri": mlflow_server, "state_uri": f"{bucket}/schedule",
        "trigger": {"watch": f"{bucket}/incoming/", "poll_s": 2},
        "train": {"recipe": "configs/bert-tiny.yaml", "set": TINY + ["data.eval_input=null"], "output_dir": f"{bucket}/rounds"},
        "evaluate": {"held_out": str(HELD_OUT), "max_samples": 32, "n_probes": 40, "k": 10},
        "gates": {"eval_acc": {"min_absolute_change": -0.5}, "cka": {"threshold": 0.05}},
        "serve": {"config": str(serve_cfg), "model": "bert"},
    }
    config = tmp_path / "schedule.yaml"
    config.write_text(yaml.safe_dump(schedule))
    state = ScheduleState(f"{bucket}/schedule")
    try:
        _wait("ctx serve", lambda: requests.get(f"{url}/readyz", timeout=5).status_code == 200, server, serve_log)
        thread.start()

        # --- the scheduler, detached: it fires when shards land under the watched prefix
        ctx(["schedule", "--config", str(config)], env)
        from jobs.operations.schedule import _now

        second_start = _now()
        time.sleep(1)
        ctx(["schedule", "--config", str(config)], env)  # finds the running scheduler, starts no second one
        s3.upload_file(str(SHARDS[0]), s3_bucket, f"incoming/{SHARDS[0].name}")
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and not any(r["status"] != "running" for r in state.rounds()):
            time.sleep(2)
        rounds = state.rounds()
        assert len(rounds) == 1 and rounds[0]["status"] == "promoted", rounds
        first = rounds[0]
        assert first["trigger"] == "watch" and first["shards"] == [f"{bucket}/incoming/{SHARDS[0].name}"]
        assert first["production"]["version"] == v1.version
        assert set(first["metrics"]["candidate"]) >= {"eval_acc", "eval_ppl", "knn_overlap", "cka"}
        assert 0.0 <= first["metrics"]["candidate"]["knn_overlap"] <= 1.0
        v2 = registry.get("bert-tiny@production")
        assert v2.version == first["candidate"]["version"] != v1.version and v2.source.startswith(f"{bucket}/rounds/e2e-round-0001/")
        new_version = checkpoint_version(v2.source)
        assert first["served"] == new_version
        time.sleep(1)
        assert versions[-1] == new_version  # the app answers with the new version now
        import json

        sched = json.loads(ctx(["schedule", "status", "--config", str(config), "--json"], env).stdout)["scheduler"]
        # Stamps have whole seconds: the first scheduler started at or before second_start, while one
        # started by the second command (a second later) would carry a later second.
        assert sched["alive"] and sched["started"] <= second_start, sched
        ctx(["schedule", "stop", "--config", str(config)], env)

        # --- a second round with a gate it cannot pass: registered, not promoted, nothing else moves
        s3.upload_file(str(SHARDS[1]), s3_bucket, f"incoming/{SHARDS[1].name}")
        impossible = {**schedule, "gates": {"eval_acc": {"min_absolute_change": 0.5}}}
        config.write_text(yaml.safe_dump(impossible))
        done = ctx(["schedule", "--config", str(config), "--once"], env)
        assert "round 2: gated" in done.stdout
        second = state.rounds()[-1]
        assert second["status"] == "gated" and "min_absolute_change 0.5" in second["reason"]
        assert second["shards"] == [f"{bucket}/incoming/{SHARDS[1].name}"]
        assert registry.get("bert-tiny@production").version == v2.version
        v3 = [v for v in registry.versions("bert-tiny") if v.version == second["candidate"]["version"]][0]
        assert "production" not in v3.aliases and v3.tags.get("gate") == "failed"
        time.sleep(1)
        shown = ctx(["schedule", "status", "--config", str(config)], env).stdout
        assert "round 1" in shown and "PROMOTED" in shown and "GATED" in shown and "min_absolute_change 0.5" in shown
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(60)
        stop_process_group(server, grace_s=60)
    # one switch, from the seed to round 1's version; round 2 left the app alone; never a failed request
    assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    switches = [(a, b) for a, b in zip(versions, versions[1:]) if a != b]
    assert switches == [(checkpoint_version(seed_ckpt), new_version)], switches
