"""Killing one model replica under load: only its in-flight requests fail, and Serve heals itself.

A tiny BERT (seeded, MiniLM's vocabulary) with 2 replicas that take at most MAX_ONGOING requests each,
and more client threads than both replicas take together, so requests queue in the Gateway's router.
One replica actor is killed with ``ray.kill`` while the stream runs. Every answer must be a 200 with
the vector this process computes, or a 5xx that tells only a request id; the 5xx are at most what the
killed replica had in flight (MAX_ONGOING, as the router retries a request it could not hand over on
another replica); no client waits past its timeout; and Serve reports the deployment HEALTHY with 2
running replicas again, after which every request succeeds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import serving

pytestmark = pytest.mark.slow

TOL = 1e-4
MAX_ONGOING = 2  # per replica: the most requests a killed replica can take down with it
CLIENTS = 6  # more than both replicas take at once
CLIENT_TIMEOUT_S = 60.0  # a request still unanswered then counts as a hung client
RECOVERY_S = 90.0  # generous: a fresh replica loads its model on a loaded 2-core machine
TEXTS = ["the river bank", "the bank approved the loan", "a walk along the bank", "interest rates rose"]
DEPLOYMENT = "EmbeddingModel-0-tiny"  # jobs.serving.serve.build_app's name for the first model, "tiny"


@dataclass
class Answer:
    text: int
    start: float
    end: float
    status: int | None  # None: no answer (timeout or connection error), see `error`
    body: dict | None = None
    error: str | None = None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, minilm_dir):
    """(checkpoint folder, the expected mean-pooled vector of each of TEXTS)."""
    from transformers import AutoTokenizer

    from ctxmodels.checkpoint import load_checkpoint, save_checkpoint
    from ctxmodels.registry import build_model

    config, model = build_model("bert", "tiny", {"vocab_size": 30522}, seed=0)
    ckpt = save_checkpoint(tmp_path_factory.mktemp("serve-kill") / "tiny", model, "bert", config, tokenizer_dir=minilm_dir)
    backbone = load_checkpoint(ckpt).model.backbone.eval()
    enc = AutoTokenizer.from_pretrained(str(minilm_dir))(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = backbone.hidden_states(enc["input_ids"], attention_mask=enc["attention_mask"])[-1]  # (B, T, D)
    m = enc["attention_mask"][..., None].float()  # (B, T, 1)
    return ckpt, ((hidden * m).sum(1) / m.sum(1)).numpy()


@pytest.fixture(scope="module")
def server(ray_session, tiny):
    from jobs.serving.serve_config import ServeConfig

    config = {
        "models": {"tiny": {
            "uri": str(tiny[0]), "num_replicas": 2, "num_cpus": 0.25, "max_batch_size": 4,
            "max_ongoing_requests": MAX_ONGOING, "max_queued_requests": 1000,  # queue, never 429
        }},
    }
    with serving(config) as url:
        yield url, ServeConfig.model_validate(config).app_name


def _replica_names() -> list[str]:
    """Named actors of this deployment's replicas: SERVE_REPLICA::<app>#<deployment>#<id> in namespace "serve"."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"#{DEPLOYMENT}#" in a["name"])


def _deployment_state(app: str) -> tuple[str, int]:
    """(deployment status, running replicas) as Serve reports them."""
    from ray import serve
    from ray.serve._private.common import ReplicaState

    deployment = serve.status().applications[app].deployments[DEPLOYMENT]
    return str(deployment.status.value), deployment.replica_states.get(ReplicaState.RUNNING, 0)


def _client(url: str, index: int, stop: threading.Event, answers: list[Answer], lock: threading.Lock) -> None:
    with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as c:
        n = 0
        while not stop.is_set():
            text = (index + n) % len(TEXTS)
            n += 1
            start = time.monotonic()
            try:
                r = c.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS[text]})
                answer = Answer(text, start, time.monotonic(), r.status_code, r.json())
            except Exception as e:  # a timeout or a dropped connection: what this test says never happens
                answer = Answer(text, start, time.monotonic(), None, error=f"{type(e).__name__}: {e}")
            with lock:
                answers.append(answer)
            time.sleep(0.01)  # a steady stream, not a flood of the two shared cores


def test_killing_a_replica_loses_only_its_in_flight_requests_and_serve_heals(server, tiny):
    import ray

    url, app = server
    expected = tiny[1]
    before = _replica_names()
    assert len(before) == 2, before
    assert _deployment_state(app) == ("HEALTHY", 2)

    stop, lock, answers = threading.Event(), threading.Lock(), []
    threads = [threading.Thread(target=_client, args=(url, i, stop, answers, lock), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        time.sleep(3)  # the stream is steady and answered by both replicas
        with lock:
            assert answers and all(a.status == 200 for a in answers), [a for a in answers if a.status != 200][:3]
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)

        # Serve notices the death (its health check) and starts a replacement replica on its own.
        healed_at = None
        while time.monotonic() - killed_at < RECOVERY_S:
            names = _replica_names()
            state = _deployment_state(app)
            if before[0] not in names and len(names) == 2 and state == ("HEALTHY", 2):
                healed_at = time.monotonic()
                break
            time.sleep(0.5)
        assert healed_at is not None, f"not healed {RECOVERY_S:g} s after the kill: {_deployment_state(app)}, replicas {_replica_names()}"
        time.sleep(3)  # and requests keep succeeding on the two replicas
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=CLIENT_TIMEOUT_S + 10)
    assert not any(t.is_alive() for t in threads), "a client thread hung"

    hung = [a for a in answers if a.status is None]
    assert not hung, f"{len(hung)} requests got no answer: {hung[:3]}"
    failed = [a for a in answers if a.status != 200]
    for a in failed:  # a 5xx says only a request id: no traceback, no Ray internals
        assert a.status >= 500, (a.status, a.body)
        error = a.body["error"]
        assert error.get("request_id") and "Traceback" not in error["message"] and "actor" not in error["message"].lower(), error
    assert len(failed) <= MAX_ONGOING, f"{len(failed)} requests failed, more than the {MAX_ONGOING} the killed replica could hold: {failed}"
    assert all(killed_at <= a.end and a.start <= healed_at for a in failed), "a failure outside the kill's window"
    for a in answers:
        if a.status == 200:
            got = np.asarray(a.body["data"][0]["embedding"], dtype=np.float32)
            np.testing.assert_allclose(got, expected[a.text], atol=TOL)
    after = [a for a in answers if a.start > healed_at]
    assert after and all(a.status == 200 for a in after), [a for a in after if a.status != 200][:3]
    print(
        f"{len(answers)} requests, {len(failed)} failed ({sorted({a.status for a in failed})}), "
        f"healed {healed_at - killed_at:.1f} s after the kill, {len(after)} answered after"
    )
