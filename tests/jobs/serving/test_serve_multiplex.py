"""Multiplexed models over real HTTP (Ray Serve model multiplexing, jobs/serving/serve.py MultiplexedModels):
one replica that holds two models at a time (``max_num_models_per_replica: 2``), so going round three
models evicts one and loads another at every request, beside a pinned model serving the same
checkpoint as one of them.

Each answer is checked against what the checkpoint computes in this process (mean pooling of the
backbone's hidden states, a classifier's logits) and against the pinned model; versions say which
checkpoint answered. Tiny BERTs with MiniLM's vocabulary, seeded weights, nothing trained; one Serve
app for the module.
"""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import serving

pytestmark = pytest.mark.slow

TOL = 1e-5
V = {"vocab_size": 30522}  # MiniLM's vocabulary
TEXTS = ["the river bank", "a loan from the bank was approved on Tuesday"]


def _bert(path: Path, minilm_dir: Path, seed: int, task=None) -> Path:
    """A tiny BERT checkpoint with seeded weights: pretrained (with its MLM head), or with a task head."""
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model, make_config
    from ctxmodels.tasks import build_task_model

    if task is None:
        cfg, model = build_model("bert", "tiny", V, seed=seed)
    else:
        cfg = make_config("bert", "tiny", V)
        model = build_task_model("bert", cfg, task, torch.Generator().manual_seed(seed))
    return save_checkpoint(path, model, "bert", cfg, tokenizer_dir=minilm_dir, task=task)


def _version(folder: Path) -> str:
    return f"{folder.name}@{hashlib.sha256((folder / 'MANIFEST.json').read_bytes()).hexdigest()[:16]}"


@pytest.fixture(scope="module")
def built(tmp_path_factory, minilm_dir):
    """{name: (URI to serve, checkpoint folder, in-process model)}: "a" a pretrained tiny BERT (the pinned
    "pin" serves it too), "b" a run folder of one, "c" a 2-label classifier, "d" one broken later."""
    from ctxmodels.checkpoint import load_checkpoint
    from ctxmodels.tasks import TaskConfig

    root = tmp_path_factory.mktemp("serve-multiplex")
    a = _bert(root / "a", minilm_dir, seed=1)
    b = _bert(root / "b-run" / "checkpoint_000001", minilm_dir, seed=2)
    c = _bert(root / "c", minilm_dir, seed=3, task=TaskConfig(kind="classification", num_labels=2, labels=["no", "yes"]))
    d = _bert(root / "d", minilm_dir, seed=4)
    out = {name: (folder, folder, load_checkpoint(folder).model.eval()) for name, folder in (("a", a), ("c", c), ("d", d))}
    out["b"] = (root / "b-run", b, load_checkpoint(b).model.eval())
    return out


@pytest.fixture(scope="module")
def client(ray_session, built):
    with serving({
        "models": {"pin": str(built["a"][0])},
        "multiplexed": {
            "max_num_models_per_replica": 2,
            "batch_wait_timeout_s": 0.05,  # concurrent requests for two loaded models meet in one batch
            "models": {name: str(built[name][0]) for name in ("a", "b", "c", "d")},
        },
        "defaults": {"num_cpus": 0.25, "max_batch_size": 8},
    }) as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(minilm_dir):
    from pipelines.tokenizers import load_tokenizer

    return load_tokenizer(minilm_dir)


def _mean_vectors(model, tok, texts: list[str]) -> np.ndarray:
    """Mean pooling of the top layer, one text at a time (no padding): what /v1/embeddings answers."""
    out = []
    for row in tok.encode_for_model(texts, 512)[0]:
        with torch.inference_mode():
            hidden = model.backbone.hidden_states(torch.tensor([list(row)]), torch.ones(1, len(row), dtype=torch.long))[-1]
        out.append(hidden[0].mean(0).numpy())
    return np.stack(out)


def _embed(client, model: str, texts: list[str] = TEXTS) -> tuple[np.ndarray, str]:
    r = client.post("/v1/embeddings", json={"model": model, "input": texts})
    assert r.status_code == 200, (model, r.status_code, r.text[:500])
    body = r.json()
    assert r.headers["x-model-version"] == body["model_version"] and r.headers["x-tokenizer-hash"] == body["tokenizer_hash"]
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32), body["model_version"]


def _counts(client) -> dict[tuple[str, str], float]:
    """{(metric, model): value} of the Gateway's multiplexed load and eviction counters."""
    text = client.get("/metrics").text
    found = re.findall(r'^ctx_multiplexed_model_(loads|evictions)_total\{model="([^"]+)"\} (\S+)$', text, re.M)
    return {(kind, model): float(v) for kind, model, v in found}


def _delta(before: dict, after: dict, kind: str, model: str) -> float:
    return after.get((kind, model), 0.0) - before.get((kind, model), 0.0)


# ----------------------------------------------------------------------------- the same answers as pinned and in-process


def test_each_multiplexed_model_answers_what_its_checkpoint_computes(client, built, tok):
    for name in ("a", "b", "c"):
        _, folder, model = built[name]
        got, version = _embed(client, name)
        np.testing.assert_allclose(got, _mean_vectors(model, tok, TEXTS), atol=TOL)
        assert version == _version(folder)


def test_a_multiplexed_model_answers_as_the_same_checkpoint_pinned(client, built):
    pinned, pinned_version = _embed(client, "pin")
    multiplexed, version = _embed(client, "a")
    np.testing.assert_allclose(multiplexed, pinned, atol=TOL)
    assert version == pinned_version == _version(built["a"][1])
    for path, body in [("/v1/token-embeddings", {"input": TEXTS, "layers": [0, -1]}), ("/tokenize", {"input": TEXTS})]:
        r_pin, r_mux = client.post(path, json={"model": "pin", **body}), client.post(path, json={"model": "a", **body})
        assert r_pin.status_code == r_mux.status_code == 200, (r_pin.text[:300], r_mux.text[:300])
        assert r_mux.headers["x-model-version"] == r_pin.headers["x-model-version"]
        for p, m in zip(r_pin.json()["data"], r_mux.json()["data"]):
            assert (p.get("tokens"), p["offsets"], p.get("ids")) == (m.get("tokens"), m["offsets"], m.get("ids"))
            if "embeddings" in p:
                np.testing.assert_allclose(np.array(m["embeddings"]), np.array(p["embeddings"]), atol=TOL)


def test_task_routes_and_the_models_list_work_for_multiplexed_models(client, built, tok):
    from jobs.serving.serve_tasks import softmax
    from pipelines.finetune import TaskDataConfig, encode_task

    r = client.post("/v1/classify", json={"model": "c", "input": TEXTS})
    assert r.status_code == 200, r.text
    cols = encode_task({"text": TEXTS}, tok, TaskDataConfig(with_labels=False, kind="classification", max_len=128, labels=("no", "yes"), text_field="text"))
    with torch.inference_mode():
        logits = built["c"][2](**{k: torch.from_numpy(cols[k]) for k in ("input_ids", "attention_mask", "token_type_ids")}).logits
    probs = softmax(logits.float().numpy())
    for d, p in zip(r.json()["data"], probs):
        got = {x["label"]: x["score"] for x in d["labels"]}
        np.testing.assert_allclose([got["no"], got["yes"]], p, atol=TOL)
    assert r.json()["model_version"] == _version(built["c"][1])

    r = client.post("/v1/fill-mask", json={"model": "a", "input": "the [MASK] flows past the bank.", "top_k": 3})
    assert r.status_code == 200, r.text
    row = tok.encode_for_model(["the [MASK] flows past the bank."], 512)[0][0]
    pos = list(row).index(tok.mask_id)
    with torch.inference_mode():
        top = torch.topk(torch.softmax(built["a"][2].mlm_logits(torch.tensor([list(row)]))[0, pos], dim=-1), 3)
    assert [p["token_id"] for p in r.json()["data"][0]["masks"][0]["predictions"]] == top.indices.tolist()

    r = client.post("/v1/tag", json={"model": "c", "input": "x"})  # what a classifier does not do: 400 naming it
    assert r.status_code == 400 and "classification model" in r.json()["error"]["message"]

    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert sorted(models) == ["a", "b", "c", "d", "pin"]
    assert [models[n]["multiplexed"] for n in ("a", "b", "c", "d", "pin")] == [True, True, True, True, False]
    assert models["c"]["task"] == "classification" and models["c"]["labels"] == ["no", "yes"] and "/v1/classify" in models["c"]["routes"]
    assert models["b"]["version"] == _version(built["b"][1]) and models["b"]["dim"] == 64
    assert {k: v for k, v in models["a"].items() if k not in ("id", "multiplexed")} == {k: v for k, v in models["pin"].items() if k not in ("id", "multiplexed")}


# ----------------------------------------------------------------------------- eviction and reloading


def test_going_round_three_models_evicts_and_reloads_the_same_checkpoints(client, built, tok):
    """Two models per replica, least recently used evicted: after a, b the replica holds [a, b], and
    c, a, b, c each evict the oldest and load; the answers and versions do not change, and the pinned
    model, the same checkpoint as a, keeps answering the same."""
    expected = {name: _mean_vectors(built[name][2], tok, TEXTS) for name in ("a", "b", "c")}
    _embed(client, "a"), _embed(client, "b")
    before = _counts(client)
    for name in ("c", "a", "b", "c"):
        got, version = _embed(client, name)
        np.testing.assert_allclose(got, expected[name], atol=TOL)
        assert version == _version(built[name][1])
        pinned, _ = _embed(client, "pin")
        np.testing.assert_allclose(pinned, expected["a"], atol=TOL)
    after = _counts(client)
    loads = {n: _delta(before, after, "loads", n) for n in ("a", "b", "c", "pin")}
    evictions = {n: _delta(before, after, "evictions", n) for n in ("a", "b", "c", "pin")}
    assert loads == {"a": 1, "b": 1, "c": 2, "pin": 0}  # pinned models are never loaded on demand
    assert evictions == {"a": 2, "b": 1, "c": 1, "pin": 0}


def test_concurrent_requests_for_different_models_get_their_own_model(client, built, tok):
    """Requests for two loaded models of one replica at once, then for three (evicting while others
    run): each answer is its own model's, never a pass of the other's."""
    expected = {name: _mean_vectors(built[name][2], tok, TEXTS[:1]) for name in ("a", "b", "c")}
    _embed(client, "a"), _embed(client, "b")
    names = ["a", "b"] * 6 + ["a", "b", "c"] * 3

    def one(name: str) -> tuple[str, np.ndarray, str]:
        return (name, *_embed(client, name, TEXTS[:1]))

    with ThreadPoolExecutor(len(names)) as pool:
        for name, got, version in pool.map(one, names):
            np.testing.assert_allclose(got, expected[name], atol=TOL)
            assert version == _version(built[name][1])


def test_the_run_folder_was_resolved_when_the_app_was_built(client, built, minilm_dir):
    """A newer complete checkpoint landing in b's run folder after the build is not what a reload of b
    loads: the build resolved b once, to checkpoint_000001."""
    run, first, _ = built["b"]
    _bert(run / "checkpoint_000002", minilm_dir, seed=9)
    _embed(client, "a"), _embed(client, "c")  # b is evicted
    before = _counts(client)
    _, version = _embed(client, "b")
    assert _delta(before, _counts(client), "loads", "b") == 1
    assert version == _version(first)


# ----------------------------------------------------------------------------- errors


def test_a_model_that_fails_to_load_gets_a_503_naming_it_and_the_others_still_answer(client, built, tok, minilm_dir):
    """d's checkpoint is rewritten after the build: the replica refuses to load a different version
    (a 503 naming the model, promptly, every time), and the other models keep answering."""
    _embed(client, "a"), _embed(client, "b")  # d is not loaded
    _bert(built["d"][1], minilm_dir, seed=5)  # rewritten in place: other weights, another version
    for _ in range(2):
        r = client.post("/v1/embeddings", json={"model": "d", "input": "x"}, timeout=60)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "model_load_failed" and "'d'" in error["message"] and error["request_id"]
    got, _ = _embed(client, "a")
    np.testing.assert_allclose(got, _mean_vectors(built["a"][2], tok, TEXTS), atol=TOL)


def test_unknown_models_are_404_and_readyz_checks_the_pinned_models(client):
    r = client.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404
    assert all(n in r.json()["error"]["message"] for n in ("'nope'", "a", "pin"))
    r = client.get("/readyz")
    assert r.status_code == 200, r.text
    assert list(r.json()["models"]) == ["pin"] and r.json()["multiplexed"] == ["a", "b", "c", "d"]
    assert client.get("/healthz").json()["models"] == ["a", "b", "c", "d", "pin"]
