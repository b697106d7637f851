"""A pretraining run on a live multi-node Ray cluster that gains a node and loses one mid-run.

Run by ``test_elastic_cluster.py`` as a process of its own (``python -m tests.jobs.training.live_cluster
SPEC.json``): the cluster is ``ray.cluster_utils.Cluster``, a head and worker nodes that are
separate raylet processes on loopback, under ``$RAY_TMPDIR`` (set by the test, so neither the
cluster's address file nor its sockets meet anyone else's Ray), and this process is its driver.
The suite's own in-process Ray session (``ray_session``) is never touched.

The head has CPUs for Ray Data and the Train controller but no ``ctx_trainer`` resource; each
worker node has one CPU and one ``ctx_trainer``; the recipe asks ``scaling.resources_per_worker:
{ctx_trainer: 1}``, so Ray Train can place exactly one worker per worker node. The run trains in
a thread; the main thread (Ray starts and stops nodes only from there) adds a second worker node
once the one-worker run has trained a few steps, and kills the first worker node (all its
processes, no drain) once a two-worker checkpoint is committed. What it did and when, and the
run's final metrics or error, go to ``SPEC["out"]/events.json`` for the test to check against
the run's logs.

The nodes take this machine's own address: ``ray.init`` turns 127.0.0.1 into it
(``ray._private.services.resolve_ip_for_localhost``), as for the suite's local session.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

WORKER_NODE = {"num_cpus": 1, "resources": {"ctx_trainer": 1}, "object_store_memory": 100 * 1024 * 1024}


def reached(run: Path, world: int) -> int:
    """The highest step a sample-log file of an attempt with ``world`` workers has written (-1:
    none). Files are being appended to: a torn last line is skipped."""
    best = -1
    for f in (run / "sample_log").glob("*.jsonl") if (run / "sample_log").exists() else []:
        lines = f.read_text().splitlines()
        if not lines or json.loads(lines[0]).get("world") != world:
            continue
        for line in reversed(lines[1:]):
            try:
                best = max(best, json.loads(line)["step"])
                break
            except (ValueError, KeyError):
                continue
    return best


def committed_world(run: Path) -> int | None:
    """``world_size`` of the run's latest complete checkpoint."""
    from pipelines import storage

    latest = storage.Store().latest_complete_checkpoint(str(run))
    return json.loads(Path(latest, "trainer_state.json").read_text())["world_size"] if latest else None


def change_nodes(cluster, first_node, run: Path, grow_after: int, events: list[dict], done: threading.Event) -> None:
    """Add a worker node once the one-worker run is past step ``grow_after``; kill the first one
    once a two-worker checkpoint is committed. Returns early when the run ends first."""
    t0 = time.monotonic()

    def wait(cond) -> bool:
        while not done.is_set():
            if cond():
                return True
            time.sleep(0.2)
        return False

    if not wait(lambda: reached(run, 1) >= grow_after):
        return
    events.append({"event": "add_node", "t": time.monotonic() - t0, "step": reached(run, 1)})
    cluster.add_node(**WORKER_NODE)
    if not wait(lambda: committed_world(run) == 2):
        return
    events.append({"event": "remove_node", "t": time.monotonic() - t0, "step": reached(run, 2)})
    cluster.remove_node(first_node, allow_graceful=False)  # a node lost, not drained


def main(spec_path: str) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from jobs.training.config import load_recipe
    from jobs.training.train import pretrain

    spec = json.loads(Path(spec_path).read_text())
    rec = load_recipe(spec["recipe"], spec["overrides"])
    out = Path(spec["out"])
    run = Path(rec.output_dir) / rec.name
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": 2, "object_store_memory": 200 * 1024 * 1024, "include_dashboard": False,
    })
    events: list[dict] = []
    done = threading.Event()
    outcome: dict = {}

    def train() -> None:
        t0 = time.monotonic()
        try:
            result = pretrain(rec, progress=False, log=lambda line: print(line, flush=True))
            outcome.update(metrics=result.metrics, seconds=time.monotonic() - t0)
        except BaseException as e:  # noqa: BLE001 (reported to the test, which fails on it)
            outcome.update(error=repr(e))
        finally:
            done.set()

    try:
        first = cluster.add_node(**WORKER_NODE)
        ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        change_nodes(cluster, first, run, spec["grow_after"], events, done)
        trainer.join()
        (out / "events.json").write_text(json.dumps({"events": events, **outcome}, default=str))
    finally:
        done.set()
        ray.shutdown()
        cluster.shutdown()  # every node's processes, this process's own


if __name__ == "__main__":
    main(sys.argv[1])
