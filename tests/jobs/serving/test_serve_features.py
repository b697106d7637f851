"""Feature strategies, word vectors and the token budget of the embeddings endpoints, over real HTTP,
each against what the same checkpoint computes in this process, one text at a time (no padding):
``combine_layers`` + pooling for /v1/embeddings' ``features``, word means taken by hand from character
offsets for /v1/token-embeddings' ``granularity: "word"``.

One Serve app for the module: the real all-MiniLM-L6-v2, a tiny BERT with a small token budget
(``max_batch_tokens``) and a tiny BERT classifier fine-tuned feature-based with a learned scalar mix
(weights set here, nothing is trained). The grouping under the budget, ``token_budget_groups``, is
tested as a pure function in test_serve_config.py.
"""

from __future__ import annotations

import base64
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import serving

pytestmark = pytest.mark.slow

TOL = 1e-4
BUDGET = 160  # tiny's max_batch_tokens: over its 128 positions, so every row fits a pass
VALUES_CAP = 50_000  # max_token_embedding_values
STRATEGIES = ("first", "last", "second-to-last", "sum-last-four", "concat-last-four", "sum-all")
TEXTS = ["Tokenization isn't trivial!", "the river bank"]


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_dir):
    """{name: (checkpoint folder, in-process model)}: MiniLM, a tiny BERT, a tiny scalar-mix classifier."""
    from ctxmodels.checkpoint import load_checkpoint, save_checkpoint
    from ctxmodels.registry import build_model, make_config
    from ctxmodels.tasks import TaskConfig, build_task_model

    root = tmp_path_factory.mktemp("serve-features")
    torch.manual_seed(0)
    config, model = build_model("bert", "tiny", {"vocab_size": 30522})
    tiny = save_checkpoint(root / "tiny", model, "bert", config, tokenizer_dir=minilm_dir)
    cfg = make_config("bert", "tiny", {"vocab_size": 30522})
    task = TaskConfig(kind="classification", num_labels=2, labels=["no", "yes"], features="scalar-mix")
    mixer = build_task_model("bert", cfg, task, torch.Generator().manual_seed(1))
    with torch.no_grad():  # as if learned: far from the equal weights of an untrained mix
        mixer.mix.scalars.copy_(torch.linspace(-2.0, 1.0, cfg.n_layer + 1))
        mixer.mix.gamma.fill_(1.5)
    mix = save_checkpoint(root / "mix", mixer, "bert", cfg, tokenizer_dir=minilm_dir, task=task)
    return {
        "minilm": (minilm_dir, load_checkpoint(minilm_dir).model.eval()),
        "tiny": (tiny, load_checkpoint(tiny).model.eval()),
        "mix": (mix, load_checkpoint(mix).model.eval()),
    }


@pytest.fixture(scope="module")
def client(ray_session, models):
    with serving({
        "models": {
            "minilm": str(models["minilm"][0]),
            "tiny": {"uri": str(models["tiny"][0]), "max_batch_tokens": BUDGET, "batch_wait_timeout_s": 0.05},
            "mix": str(models["mix"][0]),
        },
        "defaults": {"num_cpus": 0.25, "max_batch_size": 8},
        "limits": {"max_token_embedding_values": VALUES_CAP},
    }) as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(minilm_dir):
    from pipelines.tokenizers import load_tokenizer

    return load_tokenizer(minilm_dir)


def _states(model, tok, text: str, max_len: int = 512) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """One text alone through the model: n_layer + 1 hidden states (T, D) and the tokens' offsets."""
    ids, offsets, _ = tok.encode_for_model([text], max_len)
    backbone = getattr(model, "backbone", model)
    with torch.inference_mode():
        states = backbone.hidden_states(torch.tensor(ids), attention_mask=torch.ones(1, len(ids[0]), dtype=torch.long))
    return [s[0] for s in states], offsets[0]


def _combined(model, tok, text: str, strategy: str, max_len: int = 512) -> tuple[np.ndarray, list[tuple[int, int]]]:
    from ctxmodels.features import combine_layers

    states, offsets = _states(model, tok, text, max_len)
    with torch.inference_mode():
        return combine_layers(states, strategy, getattr(model, "mix", None)).numpy(), offsets  # (T, n*D)


def _vectors(body: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float32)


def _post(client, path: str, body) -> httpx.Response:
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


# ----------------------------------------------------------------------------- /v1/embeddings features


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_embeddings_features_are_combine_layers_then_pooling(client, models, tok, strategy):
    model = models["minilm"][1]
    pooling = {"first": "cls", "sum-all": "last"}.get(strategy, "mean")  # each pooling met at least once
    r = _post(client, "/v1/embeddings", {"model": "minilm", "input": TEXTS, "features": strategy, "pooling": pooling, "normalize": False})
    assert r.status_code == 200, r.text
    expected = []
    for text in TEXTS:
        h, _ = _combined(model, tok, text, strategy)
        expected.append({"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling])
    got = _vectors(r.json())
    assert got.shape == (2, 4 * 384 if strategy == "concat-last-four" else 384)
    np.testing.assert_allclose(got, np.stack(expected), atol=TOL)


def test_concat_last_four_is_four_times_wider_and_dimensions_still_cut_it(client, models, tok):
    h, _ = _combined(models["minilm"][1], tok, TEXTS[0], "concat-last-four")
    full = h.mean(0)  # (1536,)
    r = _post(client, "/v1/embeddings", {"model": "minilm", "input": TEXTS[0], "features": "concat-last-four", "dimensions": 1000, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    got = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(got, full[:1000] / np.linalg.norm(full[:1000]), atol=TOL)


def test_scalar_mix_uses_the_checkpoints_learned_weights(client, models, tok):
    model = models["mix"][1]
    states, _ = _states(model, tok, TEXTS[1])
    with torch.inference_mode():
        learned = model.mix(states).numpy().mean(0)
        equal = torch.stack(states).mean(0).numpy().mean(0)
    r = _post(client, "/v1/embeddings", {"model": "mix", "input": TEXTS[1], "features": "scalar-mix"})
    assert r.status_code == 200, r.text
    got = _vectors(r.json())[0]
    np.testing.assert_allclose(got, learned, atol=TOL)
    assert not np.allclose(got, equal, atol=1e-2)  # the learned weights, not an untrained equal mix
    r = _post(client, "/v1/token-embeddings", {"model": "mix", "input": [TEXTS[1]], "features": "scalar-mix"})
    assert r.status_code == 200, r.text
    with torch.inference_mode():
        np.testing.assert_allclose(np.array(r.json()["data"][0]["embeddings"], dtype=np.float32), model.mix(states).numpy(), atol=TOL)


# ----------------------------------------------------------------------------- /v1/token-embeddings


def _words_by_hand(text: str, h: np.ndarray, offsets: list[tuple[int, int]]) -> tuple[list[str], list[list[int]], np.ndarray]:
    """Whitespace words that kept a token, their spans and the mean of the vectors of the tokens whose
    character offsets lie inside them ([CLS] and [SEP] have (0, 0) and no width)."""
    words, spans, means = [], [], []
    for m in re.finditer(r"\S+", text):
        inside = [k for k, (s, e) in enumerate(offsets) if e > s and m.start() <= s and e <= m.end()]
        if inside:
            words.append(m.group())
            spans.append([m.start(), m.end()])
            means.append(h[inside].mean(0))
    return words, spans, np.stack(means)


def test_word_vectors_are_the_mean_of_their_sub_tokens(client, models, tok):
    model = models["minilm"][1]
    r = _post(client, "/v1/token-embeddings", {"model": "minilm", "input": TEXTS, "granularity": "word", "features": "sum-last-four"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["granularity"] == "word" and body["features"] == "sum-last-four"
    for text, item in zip(TEXTS, body["data"]):
        h, offsets = _combined(model, tok, text, "sum-last-four")
        words, spans, expected = _words_by_hand(text, h, offsets)
        assert item["words"] == words == text.split() and item["offsets"] == spans
        np.testing.assert_allclose(np.array(item["embeddings"], dtype=np.float32), expected, atol=TOL)
    assert body["usage"]["prompt_tokens"] == sum(len(_states(model, tok, t)[1]) for t in TEXTS)

    # base64 (little-endian float32, shape given) with layers instead of features
    r = _post(client, "/v1/token-embeddings", {"model": "minilm", "input": TEXTS[:1], "granularity": "word", "layers": [0, -1], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    got = np.frombuffer(base64.b64decode(item["embeddings"]), dtype="<f4").reshape(item["shape"])
    states, offsets = _states(model, tok, TEXTS[0])
    h = torch.cat([states[0], states[-1]], dim=-1).numpy()
    assert item["shape"] == [3, 768]  # Tokenization | isn't | trivial!
    np.testing.assert_allclose(got, _words_by_hand(TEXTS[0], h, offsets)[2], atol=TOL)

    # A word of characters the tokenizer drops (a zero-width space) keeps no token: no words, no 5xx.
    r = _post(client, "/v1/token-embeddings", {"model": "minilm", "input": ["\u200b"], "granularity": "word", "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    assert item["words"] == [] and item["shape"] == [0, 384]


def test_token_granularity_features_and_base64(client, models, tok):
    for strategy in ("concat-last-four", "second-to-last"):
        r = _post(client, "/v1/token-embeddings", {"model": "tiny", "input": TEXTS, "features": strategy, "encoding_format": "base64"})
        assert r.status_code == 200, r.text
        assert r.json()["layers"] is None
        for text, item in zip(TEXTS, r.json()["data"]):
            h, offsets = _combined(models["tiny"][1], tok, text, strategy, max_len=128)
            got = np.frombuffer(base64.b64decode(item["embeddings"]), dtype="<f4").reshape(item["shape"])
            assert item["offsets"] == [list(o) for o in offsets] and got.shape == h.shape
            np.testing.assert_allclose(got, h, atol=TOL)


def test_truncated_words_are_left_out(client, models, tok):
    long = "a " + "the riverbank " * 70  # 141 words, 211 tokens: over tiny's 128 positions
    r = _post(client, "/v1/token-embeddings", {"model": "tiny", "input": [long], "granularity": "word", "truncate": True})
    assert r.status_code == 200, r.text
    item = r.json()["data"][0]
    h, offsets = _combined(models["tiny"][1], tok, long, "last", max_len=128)
    words, spans, expected = _words_by_hand(long, h, offsets)
    assert item["words"] == words and item["offsets"] == spans
    assert len(words) == 85 and words[-1] == "riverbank"  # 126 tokens: a, 41 x (the river ##bank), the river
    np.testing.assert_allclose(np.array(item["embeddings"], dtype=np.float32), expected, atol=TOL)


def test_the_size_cap_counts_what_the_answer_holds(client, tok):
    text = "unbelievably antidisestablishmentarianism cat " * 8  # 24 words, 114 tokens
    n_tokens = len(tok.encode_for_model([text], 128)[0][0])
    texts = [text] * 4
    tokens, words = 4 * n_tokens, 4 * len(text.split())
    assert tokens * 64 <= VALUES_CAP < tokens * 4 * 64 and words * 4 * 64 <= VALUES_CAP  # the test's premise
    r = _post(client, "/v1/token-embeddings", {"model": "tiny", "input": texts, "features": "concat-last-four"})
    assert r.status_code == 413, r.text
    message = r.json()["error"]["message"]
    assert f"{tokens * 256} numbers" in message and "max_token_embedding_values" in message and "concat-last-four" in message
    for body in ({"features": "last"}, {"features": "concat-last-four", "granularity": "word"}):
        r = _post(client, "/v1/token-embeddings", {"model": "tiny", "input": texts, **body})
        assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/v1/embeddings", {"model": "minilm", "input": "x", "features": "middle"}, 400, ["unknown feature strategy 'middle'", "sum-last-four"]),
        ("/v1/embeddings", {"model": "minilm", "input": "x", "features": "scalar-mix"}, 400, ["scalar-mix", "'minilm'", "no learned mix weights"]),
        ("/v1/embeddings", {"model": "minilm", "input": "x", "features": 4}, 422, ["features", "string"]),
        ("/v1/embeddings", {"model": "minilm", "input": "x", "features": "concat-last-four", "dimensions": 1537}, 400, ["1537", "1..1536"]),
        ("/v1/token-embeddings", {"model": "tiny", "input": ["x"], "features": "middle"}, 400, ["unknown feature strategy"]),
        ("/v1/token-embeddings", {"model": "tiny", "input": ["x"], "features": "scalar-mix"}, 400, ["no learned mix weights"]),
        ("/v1/token-embeddings", {"model": "tiny", "input": ["x"], "granularity": "sentence"}, 422, ["granularity", "'token'", "'word'"]),
        ("/v1/token-embeddings", {"model": "tiny", "input": ["x"], "layers": [0], "features": "last"}, 422, ["layers or features, not both"]),
    ],
    ids=["unknown-strategy", "scalar-mix-without-weights", "strategy-not-a-string", "dimensions-over-4d",
         "token-unknown-strategy", "token-scalar-mix-without-weights", "granularity", "layers-and-features"],
)
def test_bad_feature_options_get_a_4xx_naming_the_problem(client, path, body, status, words):
    r = _post(client, path, body)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    for w in words:
        assert w.lower() in message.lower(), (w, message)


# ----------------------------------------------------------------------------- the token budget


def test_a_mixed_length_burst_equals_one_at_a_time_and_passes_stay_under_the_budget(client, models, tok):
    from ray import serve

    from jobs.serving.serve_config import APP_NAME

    rng = np.random.default_rng(0)
    words = "the river bank approved a loan for every small boat on the water".split()
    texts = [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(1, 100, size=36)]
    requests = [texts[i : i + 3] for i in range(0, len(texts), 3)]  # 12 requests of 3 texts each
    expected = []
    for text in texts:
        h, _ = _combined(models["tiny"][1], tok, text, "last", max_len=128)
        expected.append(h.mean(0))

    def one(batch: list[str]) -> np.ndarray:
        r = _post(client, "/v1/embeddings", {"model": "tiny", "input": batch})
        assert r.status_code == 200, r.text
        return _vectors(r.json())

    with ThreadPoolExecutor(12) as pool:
        got = np.concatenate(list(pool.map(one, requests)))
    np.testing.assert_allclose(got, np.stack(expected), atol=TOL)  # every text's own vector, in request order

    handle = serve.get_deployment_handle("EmbeddingModel-1-tiny", app_name=APP_NAME)
    passes = handle.forward_passes.remote().result(timeout_s=30)
    assert passes and all(rows * length <= BUDGET for rows, length in passes), passes
    assert max(rows for rows, _ in passes) > 1, passes  # the burst was batched

    metrics = client.get("/metrics").text
    for name in ("ctx_batch_size_texts", "ctx_batch_size_tokens", "ctx_batch_size_padded_tokens"):
        line = next(x for x in metrics.splitlines() if x.startswith(f'{name}_count{{model="tiny"}}'))
        assert float(line.split()[-1]) >= 1, line
