"""TEI's routes besides /embed and /rerank (jobs/serving/serve.py): /predict, /similarity, /decode, /info
and /health, each against what its reference computes: a classifier's logits as transformers computes
them through TEI's softmax and sigmoid, sentence-transformers' cosine similarities, the tokenizers
library's decoding (what TEI runs), TEI's /info schema; and huggingface_hub's InferenceClient, which
TEI's users call them with.

No Ray: the Gateway's HTTP app in this process over real HTTP (uvicorn on loopback), its models called
in-process (``InProcessHandle``) as ``ModelGateway`` calls its one model. Tiny task models with MiniLM's
vocabulary are built here from seeded weights (nothing is trained)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from jobs.serving.serve import tei_error_type
from tests.conftest import in_process_apps

TOL = 1e-5
V = {"vocab_size": 30522}  # MiniLM's vocabulary
LABELS = ["anger", "joy", "neutral"]
TEXTS = ["the bank raised its rates again", "we sat on the bank of the river", "a quiet afternoon"]
PAIRS = [["is the bank open?", "the bank opens at nine"], ["a cat sleeps", "the stock market fell"]]


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_dir) -> dict[str, Path]:
    """{name: checkpoint}: MiniLM, a 3-label BERT classifier and a BERT regression head."""
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import TaskConfig, build_task_model

    root = tmp_path_factory.mktemp("tei")
    cfg = make_config("bert", "tiny", V)
    out = {"minilm": minilm_dir}
    for seed, (name, task) in enumerate((("emotion", TaskConfig(kind="classification", num_labels=3, labels=LABELS)),
                                         ("sts", TaskConfig(kind="regression", num_labels=1)))):
        model = build_task_model("bert", cfg, task, torch.Generator().manual_seed(seed))
        out[name] = save_checkpoint(root / name, model, "bert", cfg, tokenizer_dir=minilm_dir, task=task)
    return out


@pytest.fixture(scope="module")
def urls(models):
    """{name: base URL} of one Gateway app per model, as TEI serves one model (its clients name none):
    each on a loopback port, in this process, with its own event loop and replica."""
    with in_process_apps({name: (str(path), {}) for name, path in models.items()}) as urls:
        yield urls


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, timeout=60)


def tei_error(r: httpx.Response) -> str:
    """The message of TEI's error body, its shape checked: {"error": the message, "error_type": TEI's name
    for the status}, what TEI's clients read (huggingface_hub prints ``error``)."""
    body = r.json()
    assert set(body) == {"error", "error_type"} and isinstance(body["error"], str), r.text
    assert body["error_type"] == tei_error_type(r.status_code), r.text
    return body["error"]


@pytest.fixture(scope="module")
def hf_logits(models, tmp_path_factory):
    """transformers' logits of the served task checkpoints, exported as Hugging Face folders:
    {name: fn(texts, pairs) -> (N, L) logits}."""
    transformers = pytest.importorskip("transformers")
    from ctxmodels.checkpoint import load_checkpoint
    from ctxmodels.hf import export_hf_folder

    out = {}
    for name in ("emotion", "sts"):
        folder = export_hf_folder(load_checkpoint(models[name]).model, "bert", tmp_path_factory.mktemp(f"hf-{name}"), tokenizer_dir=models["minilm"])
        model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
        tok = transformers.AutoTokenizer.from_pretrained(folder)

        def logits(texts, pairs=None, model=model, tok=tok):
            enc = tok(texts, pairs, padding=True, return_tensors="pt")
            with torch.inference_mode():
                return model(**enc).logits.double().numpy()

        out[name] = logits
    return out


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _expected(scores: np.ndarray, labels: list[str]) -> list[dict]:
    order = np.argsort(-scores, kind="stable")
    return [{"label": labels[k], "score": float(scores[k])} for k in order]


def _close(got: list[dict], want: list[dict]) -> None:
    assert [p["label"] for p in got] == [p["label"] for p in want]
    np.testing.assert_allclose([p["score"] for p in got], [p["score"] for p in want], atol=TOL)


def test_predict_gives_teis_scores_of_transformers_logits(urls, hf_logits):
    """TEI's /predict: the softmax over the labels, best first; a one-output head's sigmoid; raw_scores
    the logits; a text, a pair, and a batch mixing texts and pairs, as TEI reads each."""
    url = urls["emotion"]
    z = hf_logits["emotion"](TEXTS)
    one = post(url, "/predict", {"inputs": TEXTS[0]})
    assert one.status_code == 200, one.text
    _close(one.json(), _expected(_softmax(z[0]), LABELS))  # a text: one flat list

    zp = hf_logits["emotion"]([p[0] for p in PAIRS], [p[1] for p in PAIRS])
    _close(post(url, "/predict", {"inputs": PAIRS[0]}).json(), _expected(_softmax(zp[0]), LABELS))  # two strings: a pair
    _close(post(url, "/predict", {"inputs": [TEXTS[0]]}).json(), _expected(_softmax(z[0]), LABELS))  # one string in a list: a text

    batch = [[TEXTS[1]], PAIRS[1], [TEXTS[2]], PAIRS[0]]  # the texts and the pairs run apart: the answers keep this order
    got = post(url, "/predict", {"inputs": batch, "raw_scores": True}).json()
    assert len(got) == 4
    for g, w in zip(got, [z[1], zp[1], z[2], zp[0]]):
        _close(g, _expected(w, LABELS))

    s = hf_logits["sts"](TEXTS)[:, 0]
    sts = post(urls["sts"], "/predict", {"inputs": [[t] for t in TEXTS]}).json()
    for g, logit in zip(sts, s):
        _close(g, [{"label": "LABEL_0", "score": 1 / (1 + np.exp(-logit))}])
    _close(post(urls["sts"], "/predict", {"inputs": TEXTS[0], "raw_scores": True}).json(), [{"label": "LABEL_0", "score": s[0]}])


def test_predict_takes_the_hf_inference_apis_parameters(urls, hf_logits):
    """huggingface_hub's InferenceClient sends {"inputs", "parameters"}: function_to_apply replaces TEI's
    choice, top_k keeps the best k."""
    url = urls["emotion"]
    z = hf_logits["emotion"](TEXTS[:1])[0]
    sig = post(url, "/predict", {"inputs": TEXTS[0], "parameters": {"function_to_apply": "sigmoid", "top_k": 2}}).json()
    _close(sig, _expected(1 / (1 + np.exp(-z)), LABELS)[:2])
    _close(post(url, "/predict", {"inputs": TEXTS[0], "parameters": {"function_to_apply": "none"}}).json(), _expected(z, LABELS))


def test_predict_refuses_what_tei_refuses_and_names_it(urls):
    url = urls["emotion"]
    cases = {  # body -> (status, words the message holds)
        "three strings": ({"inputs": TEXTS}, 422, "not 3 strings"),
        "empty": ({"inputs": []}, 422, "an empty list"),
        "a batch item of three": ({"inputs": [[TEXTS[0]], TEXTS]}, 422, "item 1"),
        "a blank pair text": ({"inputs": [[TEXTS[0]], ["a", " "]]}, 422, "item 1: text 1"),
        "raw scores and a function": ({"inputs": TEXTS[0], "raw_scores": True, "parameters": {"function_to_apply": "softmax"}}, 422, "give one"),
        "an unknown parameter": ({"inputs": TEXTS[0], "parameters": {"temperature": 2}}, 422, "parameters.temperature"),
        # the third sequence is the long one: named by its place in the request, not among the pairs
        "too long": ({"inputs": [[TEXTS[0]], PAIRS[0], ["word " * 300]]}, 400, "inputs[2] is longer"),
    }
    for what, (body, status, words) in cases.items():
        r = post(url, "/predict", body)
        assert r.status_code == status and words in tei_error(r), (what, r.status_code, r.text)
    assert post(url, "/predict", {"inputs": [["word " * 300]], "truncate": True}).status_code == 200
    r = post(urls["minilm"], "/predict", {"inputs": TEXTS[0]})  # an embedding model is no classifier
    assert r.status_code == 400 and "/v1/classify needs a fine-tuned classification" in tei_error(r)


def test_huggingface_hubs_inference_client_classifies_and_compares_sentences(urls, minilm_dir, hf_logits, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    st = pytest.importorskip("sentence_transformers")
    # The suite runs with HF_HUB_OFFLINE=1, under which the client refuses every URL, a loopback one
    # too; here it is given this server's URLs only (model=URL), so it reaches nothing else.
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)

    # TEI answers one text with a flat list, which the client reads as its first (best) label
    top = hub.InferenceClient(model=f"{urls['emotion']}/predict").text_classification(TEXTS[0])
    best = _expected(_softmax(hf_logits["emotion"](TEXTS[:1])[0]), LABELS)[0]
    assert top.label == best["label"] and abs(top.score - best["score"]) < TOL

    sentences = ["the river bank was muddy", "interest rates went up", "a cat on a mat"]
    reference = st.SentenceTransformer(str(minilm_dir), device="cpu")
    want = reference.similarity(reference.encode(TEXTS[:1]), reference.encode(sentences)).numpy()[0]
    got = hub.InferenceClient(model=f"{urls['minilm']}/similarity").sentence_similarity(TEXTS[0], other_sentences=sentences)
    np.testing.assert_allclose(got, want, atol=TOL)
    r = post(urls["minilm"], "/similarity", {"inputs": {"source_sentence": TEXTS[0], "sentences": sentences}, "parameters": {"truncate": True}})
    assert r.status_code == 200
    np.testing.assert_allclose(r.json(), want, atol=TOL)
    # and /embed, which LangChain's HuggingFaceEndpointEmbeddings reaches through the same client
    vector = hub.InferenceClient(model=f"{urls['minilm']}/embed").feature_extraction(TEXTS[0])
    np.testing.assert_allclose(np.asarray(vector).reshape(-1), reference.encode(TEXTS[0], normalize_embeddings=True), atol=TOL)
    # a refusal reaches the client's user as the server's message (TEI's body: OpenAI's nested one came out as a dict's repr)
    with pytest.raises(hub.errors.HfHubHTTPError) as refused:
        hub.InferenceClient(model=f"{urls['minilm']}/predict").text_classification(TEXTS[0])
    said = str(refused.value)
    assert "/v1/classify needs a fine-tuned classification" in said and "{'message'" not in said, said
    r = post(urls["minilm"], "/similarity", {"inputs": {"source_sentence": TEXTS[0], "sentences": []}})
    assert r.status_code == 422 and "inputs.sentences: must not be empty" in tei_error(r)


def test_decode_equals_the_tokenizers_librarys_decoding(urls, minilm_dir):
    """What TEI runs: the tokenizers library's decode of the folder's tokenizer.json, special tokens
    skipped or written."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_padding()  # the folder's tokenizer.json pads to 128
    rows = [tok.encode(t).ids for t in TEXTS]  # [CLS] ... [SEP]
    url = urls["minilm"]
    assert post(url, "/decode", {"ids": rows[0]}).json() == [tok.decode(rows[0], skip_special_tokens=True)]
    assert post(url, "/decode", {"ids": rows, "skip_special_tokens": False}).json() == [tok.decode(r, skip_special_tokens=False) for r in rows]
    assert "[CLS]" in post(url, "/decode", {"ids": rows[0], "skip_special_tokens": False}).json()[0]
    r = post(url, "/decode", {"ids": [rows[0], [tok.get_vocab_size()]]})
    assert r.status_code == 400 and "ids item 1: 30522 is not a token id" in tei_error(r)
    assert post(url, "/decode", {"ids": [-1]}).status_code == 422
    assert post(url, "/decode", {"ids": []}).status_code == 422
    assert post(urls["emotion"], "/decode", {"ids": rows[1]}).json() == [tok.decode(rows[1])]  # every model decodes


def test_info_has_teis_fields_and_health_answers_without_a_key(urls, models):
    """/info as TEI's schema requires it (docs/openapi.json of text-embeddings-inference: Info, ModelType)."""
    required = {"model_id": str, "model_dtype": str, "model_type": dict, "max_concurrent_requests": int, "max_input_length": int,
                "max_batch_tokens": int, "max_client_batch_size": int, "auto_truncate": bool, "tokenization_workers": int, "version": str}
    infos = {name: httpx.get(f"{url}/info", timeout=30).json() for name, url in urls.items()}
    for name, info in infos.items():
        for key, kind in required.items():
            assert isinstance(info[key], kind), (name, key, info)
        assert info["model_id"] == name and info["max_client_batch_size"] == 64
    assert infos["minilm"]["model_type"] == {"embedding": {"pooling": "mean"}} and infos["minilm"]["max_input_length"] == 256
    assert infos["emotion"]["model_type"] == {"classifier": {"id2label": {"0": "anger", "1": "joy", "2": "neutral"},
                                                            "label2id": {"anger": 0, "joy": 1, "neutral": 2}}}
    assert infos["sts"]["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}}
    assert httpx.get(f"{urls['sts']}/info", params={"model": "other"}, timeout=30).status_code == 404
    assert httpx.get(f"{urls['sts']}/health", timeout=30).status_code == 200


def test_tokenize_takes_teis_body_and_answers_teis_tokens(urls, minilm_dir):
    """TEI's /tokenize: each token's id, its text in the input (a special token: the token itself, no
    offsets), as TEI builds them from the tokenizers library's encoding; this server's own body still
    answers its own shape on the same route."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()  # the folder's tokenizer.json pads to 128
    texts = ["The Bank's rates, again!", "naïve café [MASK] words"]

    def tei(text: str, special: bool) -> list[dict]:
        enc = tok.encode(text, add_special_tokens=special)
        return [{"id": i, "text": t, "special": True, "start": None, "stop": None} if m else
                {"id": i, "text": text[a:b], "special": False, "start": a, "stop": b}
                for i, (a, b), m, t in zip(enc.ids, enc.offsets, enc.special_tokens_mask, enc.tokens)]

    url = urls["minilm"]
    assert post(url, "/tokenize", {"inputs": texts[0]}).json() == [tei(texts[0], True)]
    assert post(url, "/tokenize", {"inputs": texts, "add_special_tokens": False}).json() == [tei(t, False) for t in texts]
    ours = post(url, "/tokenize", {"model": "minilm", "input": texts[0]}).json()
    assert ours["data"][0]["ids"] == tok.encode(texts[0]).ids and ours["max_len"] == 256
    for body, words in (({"model": "minilm", "input": "a", "inputs": "a"}, "both were given"), ({"input": "a"}, "model: required"),
                        ({"model": "minilm", "input": "a", "prompt_name": "query"}, "prompt_name belongs to TEI's body")):
        r = post(url, "/tokenize", body)
        assert r.status_code == 422 and words in tei_error(r), r.text
    r = post(url, "/tokenize", {"inputs": "a", "prompt_name": "query"})  # MiniLM's folder has no prompts
    assert r.status_code == 400 and "has no such prompt" in tei_error(r)


def test_embed_all_gives_sentence_transformers_token_embeddings(urls, minilm_dir):
    """TEI's /embed_all: each input's last-layer token vectors, unpooled, special tokens included:
    sentence-transformers' output_value="token_embeddings"."""
    st = pytest.importorskip("sentence_transformers")

    reference = st.SentenceTransformer(str(minilm_dir), device="cpu")
    got = post(urls["minilm"], "/embed_all", {"inputs": TEXTS[:2]})
    assert got.status_code == 200, got.text
    want = reference.encode(TEXTS[:2], output_value="token_embeddings")
    assert [len(rows) for rows in got.json()] == [len(w) for w in want]
    for rows, w in zip(got.json(), want):
        np.testing.assert_allclose(np.asarray(rows), w.numpy(), atol=TOL)
    one = post(urls["minilm"], "/embed_all", {"inputs": TEXTS[0]}).json()  # a string: a list of one
    np.testing.assert_allclose(np.asarray(one[0]), want[0].numpy(), atol=TOL)
    r = post(urls["minilm"], "/embed_all", {"inputs": TEXTS[0], "prompt_name": "query"})
    assert r.status_code == 400 and "has no such prompt" in tei_error(r)


def test_the_bare_url_answers_as_tei_by_the_models_type(urls, minilm_dir, hf_logits, monkeypatch):
    """TEI's POST / (and SageMaker's /invocations): an embedding model's /embed, a classifier's /predict,
    a reranker's (a one-output head) /rerank: where huggingface_hub's InferenceClient, and LangChain's
    HuggingFaceEndpointEmbeddings through it, post when given the server's URL alone."""
    hub = pytest.importorskip("huggingface_hub")
    st = pytest.importorskip("sentence_transformers")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)  # the client reaches this server's URLs only

    reference = st.SentenceTransformer(str(minilm_dir), device="cpu")
    vector = hub.InferenceClient(model=urls["minilm"]).feature_extraction(TEXTS[0])
    np.testing.assert_allclose(np.asarray(vector).reshape(-1), reference.encode(TEXTS[0], normalize_embeddings=True), atol=TOL)
    top = hub.InferenceClient(model=urls["emotion"]).text_classification(TEXTS[0])
    assert top.label == _expected(_softmax(hf_logits["emotion"](TEXTS[:1])[0]), LABELS)[0]["label"]

    s = hf_logits["sts"]([TEXTS[0]] * 2, TEXTS[1:])[:, 0]
    ranked = post(urls["sts"], "/invocations", {"query": TEXTS[0], "texts": TEXTS[1:], "raw_scores": True}).json()
    assert [r["index"] for r in ranked] == list(np.argsort(-s, kind="stable"))
    np.testing.assert_allclose([r["score"] for r in ranked], np.sort(s)[::-1], atol=TOL)
    ranked = post(urls["sts"], "/", {"query": TEXTS[0], "texts": TEXTS[1:]}).json()  # TEI's score: the sigmoid of the one output
    np.testing.assert_allclose([r["score"] for r in ranked], 1 / (1 + np.exp(-np.sort(s)[::-1])), atol=TOL)

    for body, words in (([1, 2], "must be a JSON object"), ({"inputs": 3}, "inputs: must be"), ({"query": "q"}, "texts")):
        r = post(urls["emotion"] if "inputs" in str(body) else urls["sts"], "/", body)
        assert r.status_code == 422 and words in tei_error(r), r.text
    r = httpx.post(f"{urls['minilm']}/", content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 422 and "not valid JSON" in tei_error(r)
    assert httpx.get(f"{urls['minilm']}/ping", timeout=30).status_code == 200
