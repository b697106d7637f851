"""Issue 9's hardening over real HTTP: every oversized or malformed request gets its 4xx (never a 5xx)
and the service keeps answering; API keys; full queues answer 429 with Retry-After; timeouts 504
with only a request id; /readyz, /metrics; dimensions, truncate and pooling against the models
computed locally; the official `openai` client.

One Serve app for the module: a tiny BERT, a tiny GPT (causal) and the tiny BERT again behind a
timeout too short to meet ("slow"), with an API key and a small token budget.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import serving

pytestmark = pytest.mark.slow

TOL = 1e-4
KEY = "test-key-" + "0123456789abcdef" * 2
TOKENS_PER_REQUEST = 4096
TOKEN_EMBEDDING_VALUES = 100_000


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, minilm_dir):
    """{name: (checkpoint folder, backbone)} for a tiny BERT and a tiny GPT with MiniLM's vocabulary."""
    from ctxmodels.checkpoint import load_checkpoint, save_checkpoint
    from ctxmodels.registry import build_model

    root = tmp_path_factory.mktemp("serve-hardening")
    out = {}
    for family in ("bert", "gpt"):
        torch.manual_seed(0)
        config, model = build_model(family, "tiny", {"vocab_size": 30522})
        ckpt = save_checkpoint(root / family / "checkpoint_000001", model, family, config, tokenizer_dir=minilm_dir)
        out[family] = (ckpt, load_checkpoint(ckpt).model.backbone.eval())
    return out


@pytest.fixture(scope="module")
def server(ray_session, tiny_models):
    from jobs.serving.serve_config import hash_api_key

    bert, gpt = str(tiny_models["bert"][0]), str(tiny_models["gpt"][0])
    with serving({
        "models": {
            "tiny": {"uri": bert, "max_ongoing_requests": 1, "max_queued_requests": 1},
            "gpt": gpt,
            "slow": {"uri": bert, "request_timeout_s": 0.001},
        },
        "defaults": {"num_cpus": 0.25, "max_batch_size": 8},
        "limits": {"max_tokens_per_request": TOKENS_PER_REQUEST, "max_token_embedding_values": TOKEN_EMBEDDING_VALUES},
        "auth": {"api_key_sha256": [hash_api_key(KEY)]},
        "retry_after_s": 2,
    }) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _vectors(body: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float32)


def _hidden(backbone, minilm_dir, texts: list[str], max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    enc = tok(texts, padding=True, truncation=max_len is not None, max_length=max_len, return_tensors="pt")
    with torch.inference_mode():
        hidden = backbone.hidden_states(enc["input_ids"], attention_mask=enc["attention_mask"])[-1]  # (B, T, D)
    return hidden, enc["attention_mask"]


def _mean(hidden: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    m = mask[..., None].float()  # (B, T, 1)
    return ((hidden * m).sum(1) / m.sum(1)).numpy()


def _assert_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    error = r.json()["error"]
    for w in words:
        assert w.lower() in error["message"].lower(), (w, error["message"])
    return error


def _post_json(client, path: str, body) -> httpx.Response:
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


# ----------------------------------------------------------------------------- bad input: 4xx, never down

LONG = "lorem ipsum dolor sit amet " * 111  # 2997 characters


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        # 2048 long texts (6.1 MB): refused on characters before any tokenizing
        ("/v1/embeddings", {"model": "tiny", "input": [LONG] * 2048}, 413, ["max_chars_per_request"]),
        ("/v1/embeddings", {"model": "tiny", "input": ["x"] * 2049}, 413, ["2049", "max_inputs"]),
        ("/v1/embeddings", {"model": "tiny", "input": ["y" * 100_001]}, 413, ["input[0]", "max_chars_per_text"]),
        # 2048 short texts: under every character limit, over the token budget, refused before the forward pass
        ("/v1/embeddings", {"model": "tiny", "input": ["the river bank is wet"] * 2048}, 413, [str(TOKENS_PER_REQUEST), "max_tokens_per_request"]),
        ("/v1/token-embeddings", {"model": "tiny", "input": ["the river bank"] * 200, "layers": [0, 1, 2]}, 413, ["max_token_embedding_values"]),
        ("/v1/token-embeddings", {"model": "tiny", "input": [LONG] * 400}, 413, ["max_chars_per_request"]),
        ("/v1/embeddings", {"model": "tiny", "input": "word " * 200}, 400, ["input[0]", "128 tokens", "truncate"]),
        ("/v1/embeddings", {"model": "tiny", "input": "x", "dimensions": 65}, 400, ["dimensions 65", "1..64"]),
        ("/v1/embeddings", {"model": "tiny", "input": "x", "dimensions": 0}, 422, ["dimensions"]),
        ("/v1/embeddings", {"model": "gpt", "input": "x", "pooling": "cls"}, 400, ["causal", "'last'"]),
    ],
    ids=["2048-long-texts", "too-many-inputs", "long-text", "token-budget", "token-embeddings-cap",
         "token-embeddings-chars", "over-max-len", "dimensions-too-big", "dimensions-zero", "cls-on-causal"],
)
def test_oversized_and_impossible_requests_get_a_4xx_fast_and_the_service_stays_up(client, path, body, status, words):
    start = time.perf_counter()
    r = _post_json(client, path, body)
    elapsed = time.perf_counter() - start
    _assert_error(r, status, *words)
    assert elapsed < 10, f"refusing took {elapsed:.1f} s"
    assert client.get("/healthz").status_code == 200
    assert _post_json(client, "/v1/embeddings", {"model": "tiny", "input": "still here"}).status_code == 200


def test_a_body_over_the_limit_is_413_with_or_without_content_length(client):
    big = json.dumps({"model": "tiny", "input": "z" * (9 * 2**20)})
    _assert_error(client.post("/v1/embeddings", content=big, headers={"content-type": "application/json"}), 413, "max_body_bytes")

    def chunks():  # chunked transfer encoding: no Content-Length to trust
        for i in range(0, len(big), 2**20):
            yield big[i : i + 2**20].encode()

    r = client.post("/v1/embeddings", content=chunks(), headers={"content-type": "application/json"})
    _assert_error(r, 413, "max_body_bytes")
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize(
    "raw, status, words",
    [
        ('{"model": "tiny", "input": ["fine", "bad \\ud800 text"]}', 400, ["input[1]", "lone surrogate", "ud800"]),
        ('{"model": "tiny", "input": "\\udfff"}', 400, ["input[0]", "surrogate"]),
        ('{"model": "\\ud800", "input": "x"}', 404, ["not served here"]),
        ('{"model": "tiny", "input": "x", "user": "\\ud800"}', 200, []),
        ("[" * 100_000, 400, ["parsing the body"]),
        (b'{"model": "tiny", "input": "\xff\xfe"}', 400, []),
    ],
    ids=["surrogate-in-list", "surrogate-alone", "surrogate-model-name", "surrogate-unused-field", "deep-nesting", "not-utf8"],
)
def test_text_that_is_not_unicode_is_a_400_not_a_500(client, raw, status, words):
    r = client.post("/v1/embeddings", content=raw, headers={"content-type": "application/json"})
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        _assert_error(r, status, *words)
    r = client.post("/v1/token-embeddings", content='{"model": "tiny", "input": ["\\ud800"]}', headers={"content-type": "application/json"})
    _assert_error(r, 400, "surrogate")
    assert client.get("/healthz").status_code == 200


# ----------------------------------------------------------------------------- keys, queues, timeouts


def test_api_keys(server):
    body = {"model": "tiny", "input": "x"}
    for headers in ({}, {"Authorization": "Bearer wrong-key-wrong-key-wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(f"{server}/v1/embeddings", json=body, headers=headers, timeout=60)
        error = _assert_error(r, 401, "api key")
        assert error["type"] == "authentication_error" and r.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(f"{server}{path}", timeout=60).status_code == 401
    for path in ("/healthz", "/readyz"):  # probes need no key
        assert httpx.get(f"{server}{path}", timeout=60).status_code == 200
    assert httpx.post(f"{server}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 200


def test_a_full_queue_answers_429_with_retry_after_and_every_200_is_right(client, tiny_models, minilm_dir):
    """'tiny' takes one request at a time and queues one more: a burst gets 200s and 429s, never a 5xx."""
    texts = [f"sentence {i} about the river bank and the loan " * 8 for i in range(24)]
    hidden, mask = _hidden(tiny_models["bert"][1], minilm_dir, texts)
    expected = _mean(hidden, mask)

    def one(i: int) -> tuple[int, httpx.Response]:
        return i, _post_json(client, "/v1/embeddings", {"model": "tiny", "input": [texts[i]] * 16})

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(len(texts))))
    statuses = sorted({r.status_code for _, r in results})
    assert set(statuses) <= {200, 429}, [r.text[:200] for _, r in results if r.status_code not in (200, 429)]
    assert 200 in statuses and 429 in statuses, statuses
    for i, r in results:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "2" and r.json()["error"]["code"] == "queue_full"
        else:
            got = _vectors(r.json())
            np.testing.assert_allclose(got, np.repeat(expected[i : i + 1], 16, axis=0), atol=TOL)


def test_a_request_over_its_timeout_is_a_504_that_says_only_a_request_id(client):
    r = _post_json(client, "/v1/embeddings", {"model": "slow", "input": "x"})
    error = _assert_error(r, 504, "did not answer within", "request_timeout_s")
    assert error["request_id"] == r.headers["x-request-id"]
    assert "Traceback" not in r.text and "ray" not in r.text.lower()
    assert client.get("/healthz").status_code == 200


# ----------------------------------------------------------------------------- /readyz, /metrics, versions


def test_readyz_runs_every_model_and_metrics_count_routes_statuses_queues_and_batches(client, tiny_models):
    r = client.get("/readyz")
    assert r.status_code == 200, r.text
    assert set(r.json()["models"]) == {"tiny", "gpt", "slow"} and all(m["ready"] for m in r.json()["models"].values())
    _post_json(client, "/v1/embeddings", {"model": "gpt", "input": ["a b c", "d e"]})
    _post_json(client, "/v1/embeddings", {"model": "nope", "input": "x"})
    text = client.get("/metrics").text
    assert 'ctx_http_requests_total{route="/v1/embeddings",status="200"}' in text
    assert 'ctx_http_requests_total{route="/v1/embeddings",status="404"}' in text
    assert 'ctx_http_request_duration_seconds_bucket{le="0.1",route="/v1/embeddings"}' in text
    assert 'ctx_model_queue_depth{model="gpt"} 0.0' in text
    count = next(line for line in text.splitlines() if line.startswith('ctx_batch_size_texts_count{model="gpt"}'))
    assert float(count.split()[-1]) >= 1
    assert 'ctx_batch_size_tokens_sum{model="gpt"}' in text


def test_versions_in_headers_bodies_and_models(client, tiny_models):
    manifest = (tiny_models["gpt"][0] / "MANIFEST.json").read_bytes()
    version = f"checkpoint_000001@{hashlib.sha256(manifest).hexdigest()[:16]}"
    r = _post_json(client, "/v1/embeddings", {"model": "gpt", "input": "x"})
    assert r.headers["x-model-version"] == r.json()["model_version"] == version
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["gpt"]["version"] == version and models["gpt"]["family"] == "gpt"
    assert models["tiny"]["tokenizer_hash"] == models["gpt"]["tokenizer_hash"] == r.headers["x-tokenizer-hash"]  # same vocabulary


# ----------------------------------------------------------------------------- /v1/embeddings options


def test_dimensions_truncate_and_pooling_match_the_models(client, tiny_models, minilm_dir):
    texts = ["the river bank", "the bank approved the loan"]
    bert, gpt = tiny_models["bert"][1], tiny_models["gpt"][1]
    hidden, mask = _hidden(bert, minilm_dir, texts)
    full = _mean(hidden, mask)

    r = _post_json(client, "/v1/embeddings", {"model": "tiny", "input": texts, "dimensions": 16})
    cut = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)  # Matryoshka: truncate, re-normalise
    np.testing.assert_allclose(_vectors(r.json()), cut, atol=TOL)

    r = _post_json(client, "/v1/embeddings", {"model": "tiny", "input": texts, "encoding_format": "base64", "dimensions": 8})
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]])
    np.testing.assert_allclose(decoded, full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True), atol=TOL)

    long = "the river bank " * 60  # 180 words: over the tiny preset's 128 positions
    _assert_error(_post_json(client, "/v1/embeddings", {"model": "tiny", "input": long}), 400, "128 tokens")
    r = _post_json(client, "/v1/embeddings", {"model": "tiny", "input": long, "truncate": True})
    assert r.status_code == 200, r.text
    h, m = _hidden(bert, minilm_dir, [long], max_len=128)
    np.testing.assert_allclose(_vectors(r.json()), _mean(h, m), atol=TOL)
    assert r.json()["usage"]["prompt_tokens"] == 128

    r = _post_json(client, "/v1/embeddings", {"model": "gpt", "input": texts, "pooling": "last"})
    h, m = _hidden(gpt, minilm_dir, texts)
    last = m.sum(1) - 1  # the last real token of each row
    np.testing.assert_allclose(_vectors(r.json()), h[torch.arange(len(texts)), last].numpy(), atol=TOL)

    r = _post_json(client, "/v1/token-embeddings", {"model": "tiny", "input": texts, "encoding_format": "base64"})
    for i, item in enumerate(r.json()["data"]):
        vecs = np.frombuffer(base64.b64decode(item["embeddings"]), dtype="<f4").reshape(item["shape"])
        n = int(mask[i].sum())
        np.testing.assert_allclose(vecs, hidden[i, :n].numpy(), atol=TOL)


def test_teis_embed_route_answers_its_clients_shape(server, tiny_models, minilm_dir):
    """TEI's /embed: {"inputs"} -> a bare list of vectors, normalised unless asked not to; this server
    serves several models, so a request names one ("model"); naming none is a 400 that lists them."""
    from jobs.serving.serve import ApiError, tei_model

    client = httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    texts = ["the river bank", "the bank approved the loan"]
    hidden, mask = _hidden(tiny_models["bert"][1], minilm_dir, texts)
    mean = _mean(hidden, mask)
    r = _post_json(client, "/embed", {"inputs": texts, "model": "tiny"})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(np.array(r.json(), dtype=np.float32), mean / np.linalg.norm(mean, axis=1, keepdims=True), atol=TOL)
    r = _post_json(client, "/embed", {"inputs": texts[0], "model": "tiny", "normalize": False, "dimensions": 16})
    np.testing.assert_allclose(np.array(r.json(), dtype=np.float32), mean[:1, :16] / np.linalg.norm(mean[0, :16]), atol=TOL)  # the cut re-normalises, as /v1/embeddings' dimensions
    r = _post_json(client, "/embed", {"inputs": texts})
    assert r.status_code == 400 and "serves 3 models (gpt, slow, tiny): name one" in r.json()["error"]  # TEI's body on TEI's paths
    r = _post_json(client, "/embed", {"inputs": texts, "model": "tiny", "prompt_name": "query"})
    assert r.json() == {"error": r.json()["error"], "error_type": "Validation"} and r.status_code == 400
    assert "no such prompt (its prompts: none)" in r.json()["error"]
    assert tei_model(None, ["only"]) == "only" and tei_model("x", ["a", "b"]) == "x"
    with pytest.raises(ApiError):
        tei_model(None, [])


def test_infinitys_paths_without_v1_answer_as_the_v1_ones(server):
    """LangChain's InfinityEmbeddings posts to <url>/embeddings and Infinity's clients list <url>/models:
    the same answers as /v1/embeddings and /v1/models."""
    client = httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    body = {"model": "tiny", "input": ["the river bank", "the bank approved the loan"]}
    v1, bare = _post_json(client, "/v1/embeddings", body), _post_json(client, "/embeddings", body)
    assert v1.status_code == bare.status_code == 200, bare.text
    assert [d["embedding"] for d in bare.json()["data"]] == [d["embedding"] for d in v1.json()["data"]]
    assert client.get("/models").json()["data"] == client.get("/v1/models").json()["data"]


def test_the_openai_client_embeds(server, tiny_models, minilm_dir):
    """The official client's embeddings.create, with its default base64 encoding and with floats."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
    texts = ["the river bank", "the bank approved the loan"]
    hidden, mask = _hidden(tiny_models["bert"][1], minilm_dir, texts)
    expected = _mean(hidden, mask)
    out = client.embeddings.create(model="tiny", input=texts)  # encoding_format="base64" on the wire
    np.testing.assert_allclose(np.array([d.embedding for d in out.data], dtype=np.float32), expected, atol=TOL)
    out = client.embeddings.create(model="tiny", input=texts[0], encoding_format="float", dimensions=32)
    cut = expected[0, :32] / np.linalg.norm(expected[0, :32])
    np.testing.assert_allclose(np.array(out.data[0].embedding, dtype=np.float32), cut, atol=TOL)
    assert out.usage.prompt_tokens == int(mask[0].sum())
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong-key-wrong-key", max_retries=0).embeddings.create(model="tiny", input="x")
    # Token arrays (what LangChain's OpenAIEmbeddings sends by default: tiktoken's ids) are refused, saying how to send text
    for ids in ([[57668, 53901], [9906]], [57668, 53901]):
        with pytest.raises(openai.UnprocessableEntityError, match="check_embedding_ctx_length=False"):
            client.embeddings.create(model="tiny", input=ids)
