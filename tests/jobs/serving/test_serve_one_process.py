"""An app of one pinned model on one replica (jobs/serving/serve.py ``ModelGateway``): the Gateway and the model
in one replica, the model called in-process through a bounded queue (``InProcessHandle``).

In-process: the queue bound answers Serve's BackPressureError (the Gateway's 429), a cancelled request
stops the model's work. Served: the app is that single deployment, a burst of concurrent requests runs
in few, large forward passes (``jobs.serving.batching.Batcher``) and every answer equals the in-process vector;
a client that hangs up stops its request's work; an update replaces the replica without losing a request.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.conftest import MIXED_TEXTS, serving

TOL = 1e-5
BURST = 48


class Slow:
    """A model object whose ``work`` takes ``seconds``; counts what started and what finished."""

    def __init__(self, seconds: float):
        self.seconds, self.started, self.finished = seconds, 0, 0

    async def work(self, x: int) -> int:
        self.started += 1
        await asyncio.sleep(self.seconds)
        self.finished += 1
        return x * 2

    def info(self) -> dict:  # a plain method, as EmbeddingModel.info is
        return {"name": "slow"}


def test_local_model_bounds_its_queue_with_servers_backpressure_error():
    from ray.serve.exceptions import BackPressureError

    from jobs.serving.serve import InProcessHandle

    model = Slow(0.05)
    local = InProcessHandle(model, limit=3)

    async def main():
        calls = [local.options(multiplexed_model_id="ignored").work.remote(i) for i in range(5)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        again = await local.work.remote(7)  # room again once the first ones are done
        return results, again, await local.info.remote()

    results, again, info = asyncio.run(main())
    assert results[:3] == [0, 2, 4]
    assert all(isinstance(r, BackPressureError) for r in results[3:])
    assert again == 14 and info == {"name": "slow"} and local.in_model == 0
    assert model.started == model.finished == 4  # the refused calls never reached the model


def test_cancelling_a_local_call_cancels_the_models_work():
    """What the Gateway does when a client goes away or the request times out (response.cancel())."""
    from jobs.serving.serve import InProcessHandle

    model = Slow(10.0)
    local = InProcessHandle(model, limit=2)

    async def main():
        response = local.work.remote(1)
        await asyncio.sleep(0.05)
        response.cancel()
        with pytest.raises(asyncio.CancelledError):
            await response
        return local.in_model

    assert asyncio.run(main()) == 0
    assert model.started == 1 and model.finished == 0


def test_one_pinned_model_on_one_replica_is_one_deployment_and_anything_else_is_not():
    from jobs.serving.serve import one_process
    from jobs.serving.serve_config import ServeConfig

    def config(**kw):
        return ServeConfig.model_validate({"models": {"a": "/m"}, **kw})

    assert one_process(config())
    assert not one_process(config(models={"a": "/m", "b": "/m"}))
    assert not one_process(config(models={"a": {"uri": "/m", "num_replicas": 2}}))
    assert not one_process(config(models={"a": {"uri": "/m", "autoscaling": {"min_replicas": 1, "max_replicas": 2}}}))
    assert not one_process(config(multiplexed={"models": {"b": "/m"}}))


@pytest.fixture(scope="module")
def app(ray_session, minilm_dir):
    with serving({"models": {"minilm": str(minilm_dir)}, "defaults": {"num_cpus": 1, "max_batch_size": 32}}) as url:
        yield url


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """The vectors /v1/embeddings gives, computed by the serving class in this process."""
    from jobs.serving.serve import EmbeddingModel
    from jobs.serving.serve_config import Limits, ModelConfig

    model = EmbeddingModel.func_or_class("ref", str(minilm_dir), None, ModelConfig(uri=str(minilm_dir)), Limits())
    return np.stack(model.embed_now(MIXED_TEXTS, normalize=True)["embeddings"])


def _passes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    counts = [line.split()[-1] for line in text.splitlines() if line.startswith('ctx_batch_size_texts_count{model="minilm"}')]
    return float(counts[0]) if counts else 0.0  # no line before the first pass


def test_the_app_is_one_deployment_that_answers_every_route(app):
    from ray import serve

    from jobs.serving.serve_config import APP_NAME

    deployments = serve.status().applications[APP_NAME].deployments
    assert sorted(deployments) == ["Gateway"]
    ready = httpx.get(f"{app}/readyz", timeout=60)
    assert ready.status_code == 200 and ready.json()["models"]["minilm"]["ready"]
    models = httpx.get(f"{app}/v1/models", timeout=60).json()["data"]
    assert [(m["id"], m["family"], m["dim"], m["multiplexed"]) for m in models] == [("minilm", "bert", 384, False)]
    r = httpx.post(f"{app}/v1/embeddings", json={"model": "nope", "input": "x"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_burst_runs_in_few_large_passes_and_every_answer_is_its_own(app, reference):
    """48 single-text requests at once: each answer equals the in-process vector of its own text, and
    the passes hold 4 texts or more on average (@serve.batch held 2-3 per pass under load)."""
    before = _passes(app)
    indexes = [i % len(MIXED_TEXTS) for i in range(BURST)]

    def one(i: int) -> tuple[int, httpx.Response]:
        return i, httpx.post(f"{app}/v1/embeddings", json={"model": "minilm", "input": MIXED_TEXTS[i], "normalize": True}, timeout=120)

    with ThreadPoolExecutor(BURST) as pool:
        results = list(pool.map(one, indexes))
    for i, r in results:
        assert r.status_code == 200, r.text[:300]
        assert r.headers["x-model-version"]
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], reference[i], atol=TOL)
    passes = _passes(app) - before
    assert 1 <= passes <= BURST / 4, passes


def test_a_bulk_request_and_one_text_requests_beside_it_each_get_their_own_vectors(app, minilm_dir):
    """A 300-text request (base64 answer) and 12 one-text requests sent while it runs: every vector is
    the one its text gets alone (1e-5), in the request's order; the one-text requests are answered
    before the bulk one (they join its next passes, not its end); /metrics counts the padding."""
    import base64
    import time

    from jobs.serving.serve import EmbeddingModel
    from jobs.serving.serve_config import Limits, ModelConfig
    from tests.conftest import corpus_texts

    texts = corpus_texts(312, seed=11)
    model = EmbeddingModel.func_or_class("ref", str(minilm_dir), None, ModelConfig(uri=str(minilm_dir)), Limits())
    alone = np.stack([model.embed_now([t], normalize=True)["embeddings"][0] for t in texts])  # (312, 384)

    def bulk() -> tuple[float, httpx.Response]:
        r = httpx.post(f"{app}/v1/embeddings", json={"model": "minilm", "input": texts[:300], "normalize": True,
                                                     "encoding_format": "base64"}, timeout=120)
        return time.monotonic(), r

    def single(k: int) -> tuple[float, httpx.Response]:
        time.sleep(0.05 * k)
        r = httpx.post(f"{app}/v1/embeddings", json={"model": "minilm", "input": texts[300 + k], "normalize": True}, timeout=120)
        return time.monotonic(), r

    with ThreadPoolExecutor(13) as pool:
        big = pool.submit(bulk)
        time.sleep(0.2)  # the bulk request is in the model
        small = [pool.submit(single, k) for k in range(12)]
        bulk_done, r = big.result()
        singles = [f.result() for f in small]
    assert r.status_code == 200, r.text[:300]
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(300))
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data])
    np.testing.assert_allclose(got, alone[:300], atol=TOL)
    for k, (done, rs) in enumerate(singles):
        assert rs.status_code == 200, rs.text[:300]
        np.testing.assert_allclose(rs.json()["data"][0]["embedding"], alone[300 + k], atol=TOL)
    assert sum(done < bulk_done for done, _ in singles) >= 6  # answered while the bulk request still ran
    metrics = {line.split("{")[0]: float(line.split()[-1]) for line in httpx.get(f"{app}/metrics", timeout=30).text.splitlines()
               if '{model="minilm"}' in line}
    assert metrics["ctx_batch_padding_tokens_total"] == metrics["ctx_batch_size_padded_tokens_sum"] - metrics["ctx_batch_size_tokens_sum"]
    assert metrics["ctx_batch_padding_tokens_total"] < 0.25 * metrics["ctx_batch_size_padded_tokens_sum"]  # length-sorted passes


def test_a_client_that_hangs_up_stops_its_requests_work(app):
    """A request of 1500 texts (seconds of MiniLM passes) whose client closes the connection after 1 s:
    the disconnect reaches the replica through the ingress and the request's texts still waiting are
    dropped, so a request sent next is answered at once instead of after the rest of those passes."""
    import time

    def texts(n: int) -> list[str]:
        return [f"text {i}: the bank by the river approved a loan for the new boat house" for i in range(n)]

    start = time.monotonic()
    assert httpx.post(f"{app}/v1/embeddings", json={"model": "minilm", "input": texts(150)}, timeout=120).status_code == 200
    per_text = (time.monotonic() - start) / 150  # this machine's pace, so the bound below holds on a slow one
    n = 1500
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{app}/v1/embeddings", json={"model": "minilm", "input": texts(n)}, timeout=1.0)
    start = time.monotonic()
    r = httpx.post(f"{app}/v1/embeddings", json={"model": "minilm", "input": "still here"}, timeout=120)
    waited = time.monotonic() - start
    assert r.status_code == 200
    left_if_not_cancelled = n * per_text - 1.0
    assert waited < 0.4 * left_if_not_cancelled, f"the next request waited {waited:.1f} s (the rest of the hung-up one: ~{left_if_not_cancelled:.1f} s)"


def test_an_update_replaces_the_only_replica_and_loses_no_request(app, minilm_dir, reference):
    """Redeploying the app with a new setting replaces its single replica (Gateway and model in one):
    requests sent throughout wait while the new replica loads, and every one is answered, right."""
    import threading
    import time

    from ray import serve

    from jobs.serving import serve as ctx_serve
    from jobs.serving.serve_config import APP_NAME, ServeConfig

    port = int(app.rsplit(":", 1)[1])
    replica_before = _replica_ids()
    stop, statuses, wrong = threading.Event(), [], []

    def client(k: int) -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                i = k % len(MIXED_TEXTS)
                r = c.post(f"{app}/v1/embeddings", json={"model": "minilm", "input": MIXED_TEXTS[i], "normalize": True})
                statuses.append(r.status_code)
                if r.status_code == 200 and not np.allclose(r.json()["data"][0]["embedding"], reference[i], atol=TOL):
                    wrong.append(i)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        config = {"port": port, "models": {"minilm": str(minilm_dir)}, "defaults": {"num_cpus": 1, "max_batch_size": 16}}
        ctx_serve.run(ServeConfig.model_validate(config), blocking=False)  # returns once the new replica is healthy
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    assert serve.status().applications[APP_NAME].deployments["Gateway"].status == "HEALTHY"
    deadline = time.monotonic() + 60  # the old replica drains for a moment after the new one is up
    while _replica_ids() & replica_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert replica_before and _replica_ids() and not (_replica_ids() & replica_before), "the replica was not replaced"
    assert len(statuses) > 20 and set(statuses) == {200}, sorted(set(statuses))
    assert not wrong


def _replica_ids() -> set[str]:
    """The names of the Gateway's live replica actors (Serve names them SERVE_REPLICA::app#deployment#id)."""
    import ray

    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::") and "#Gateway#" in a["name"]}
