"""The task endpoints over real HTTP (jobs/serving/serve_tasks.py), each against what the same checkpoint
computes in this process: same logits -> same labels, scores, tags, spans, top-k tokens, tokens.

Tiny models with MiniLM's vocabulary, built here from seeded weights (nothing is trained): a BERT pair
classifier, a GPT-style regression model, a BERT tagger, a BERT SQuAD 2.0 reader in a fine-tuning run
folder (best.json, recipe in trainer_state.json), and pretrained BERT and GPT. One Serve app for the
module (six replicas start in 30-40 s on two cores); XLNet and Transformer-XL generation are checked
in this process.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from jobs.serving.serve import TEI_ROUTES
from tests.conftest import REPO, serving

pytestmark = pytest.mark.slow

TOL = 1e-5
V = {"vocab_size": 30522}  # MiniLM's vocabulary
NER_LABELS = ["B-LOC", "B-PER", "I-LOC", "I-PER", "O"]
MAX_NEW_TOKENS = 24
BUDGET = 256  # max_batch_tokens: under two full-width rows (128), so mixed requests here run in several passes
QA_RECIPE = {  # what ctx finetune writes into trainer_state.json; max_len small so contexts need windows
    "name": "qa", "model": {"init": "-"}, "data": {"train": "-"},
    "task": {"kind": "question-answering", "max_len": 48, "max_query_len": 12, "doc_stride": 8, "max_answer_len": 10, "version_2": True},
}
QA_QUESTIONS = ["where does john live?", "who lives in paris?"]
QA_CONTEXTS = [
    "John lives in New York, a big city by the sea. " * 4 + "He works in a bank near the river.",
    "Marie lives in Paris. She likes the museums and the long walks along the river on sundays.",
]


def _task_ckpt(path: Path, family: str, task, minilm_dir: Path, seed: int, extra_json: dict | None = None):
    from ctxmodels.checkpoint import load_checkpoint, save_checkpoint
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import build_task_model

    cfg = make_config(family, "tiny", V)
    model = build_task_model(family, cfg, task, torch.Generator().manual_seed(seed))
    save_checkpoint(path, model, family, cfg, tokenizer_dir=minilm_dir, task=task, extra_json=extra_json)
    return load_checkpoint(path).model.eval()


def _encode(tok, records: dict, **cfg):
    from pipelines.finetune import TaskDataConfig, encode_task

    return encode_task(records, tok, TaskDataConfig(with_labels=False, **cfg))


def _logits(model, cols: dict) -> np.ndarray:
    keys = ("input_ids", "attention_mask", "token_type_ids")
    with torch.inference_mode():
        return model(**{k: torch.from_numpy(cols[k]) for k in keys}).logits.float().numpy()


def _qa_decode(model, tok, null_threshold: float | None) -> list[dict]:
    from pipelines.qa import decode_qa

    t = QA_RECIPE["task"]
    cols = _encode(tok, {"question": QA_QUESTIONS, "context": QA_CONTEXTS}, kind="question-answering", max_len=t["max_len"],
                   max_query_len=t["max_query_len"], doc_stride=t["doc_stride"], version_2=True)
    logits = _logits(model, cols)
    features = {"example_index": cols["example_index"], "context_offsets": cols["context_offsets"]}
    return decode_qa(logits[..., 0], logits[..., 1], features, QA_CONTEXTS, t["max_answer_len"], null_threshold), cols


@pytest.fixture(scope="module")
def tok(minilm_dir):
    from pipelines.tokenizers import load_tokenizer

    return load_tokenizer(minilm_dir)


@pytest.fixture(scope="module")
def built(tmp_path_factory, minilm_dir, tok):
    """{name: (uri, in-process model)}; "qa" is a run folder whose best.json names checkpoint_000001."""
    from ctxmodels.checkpoint import load_checkpoint, save_checkpoint
    from ctxmodels.registry import build_model
    from ctxmodels.tasks import TaskConfig
    from jobs.runs import write_best

    root = tmp_path_factory.mktemp("serve-tasks")
    out = {}
    pair = TaskConfig(kind="classification", num_labels=2, labels=["no", "yes"])
    out["pair"] = (root / "pair", _task_ckpt(root / "pair", "bert", pair, minilm_dir, seed=1))
    sts = TaskConfig(kind="regression", num_labels=1, input_style="gpt", lm_weight=0.0)
    out["sts"] = (root / "sts", _task_ckpt(root / "sts", "gpt", sts, minilm_dir, seed=2))
    ner = TaskConfig(kind="token-classification", num_labels=len(NER_LABELS), labels=NER_LABELS)
    out["ner"] = (root / "ner", _task_ckpt(root / "ner", "bert", ner, minilm_dir, seed=3))

    # The QA run: the null threshold sits between the two questions' null-score differences, so one is
    # answered and one is not (a SQuAD 2.0 model says "no answer" when null - best span > threshold).
    qa_task = TaskConfig(kind="question-answering", num_labels=1)
    run = root / "qa-run"
    qa = _task_ckpt(run / "checkpoint_000001", "bert", qa_task, minilm_dir, seed=4)
    diffs = sorted(p["null_score_diff"] for p in _qa_decode(qa, tok, None)[0])
    assert diffs[0] < diffs[1]
    recipe = json.loads(json.dumps(QA_RECIPE))
    recipe["task"]["null_threshold"] = (diffs[0] + diffs[1]) / 2
    state = {"trainer_state": {"step": 10, "recipe": recipe, "task": {"kind": "question-answering"}}}
    qa = _task_ckpt(run / "checkpoint_000001", "bert", qa_task, minilm_dir, seed=4, extra_json=state)
    _task_ckpt(run / "checkpoint_000002", "bert", qa_task, minilm_dir, seed=5, extra_json=state)  # newer, not the best
    write_best(str(run), {"checkpoint": "checkpoint_000001", "metric": "f1", "value": 0.5, "step": 10})
    out["qa"] = (run, qa)
    out["qa_recipe"] = recipe

    for name, family in (("mlm", "bert"), ("gpt", "gpt")):
        cfg, model = build_model(family, "tiny", V, seed=6)
        save_checkpoint(root / name, model, family, cfg, tokenizer_dir=minilm_dir)
        out[name] = (root / name, load_checkpoint(root / name).model.eval())
    return out


@pytest.fixture(scope="module")
def client(ray_session, built):
    names = ("pair", "sts", "ner", "qa", "mlm", "gpt")
    with serving({
        "models": {n: str(built[n][0]) for n in names},
        "defaults": {"num_cpus": 0.25, "max_batch_size": 8, "max_batch_tokens": BUDGET},
        "limits": {"max_new_tokens": MAX_NEW_TOKENS},
    }) as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


def _ok(r: httpx.Response) -> dict | list:
    assert r.status_code == 200, (r.status_code, r.text[:800])
    body = r.json()
    assert r.headers["x-model-version"] and r.headers["x-tokenizer-hash"]
    if isinstance(body, dict):
        assert body["model_version"] == r.headers["x-model-version"]
        assert body["tokenizer_hash"] == r.headers["x-tokenizer-hash"]
    return body


# ----------------------------------------------------------------------------- models and what they serve


def test_replicas_import_this_checkout(ray_session):
    """Replicas are other processes: they must run the code under test, not another installed copy."""
    import ray

    @ray.remote(num_cpus=0)
    def where() -> str:
        import jobs.serving.serve_tasks

        return jobs.serving.serve_tasks.__file__

    assert Path(ray.get(where.remote())).resolve().is_relative_to(REPO)


def test_models_list_family_task_labels_dim_version_and_routes(client, built):
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["pair"]["task"] == "classification" and models["pair"]["labels"] == ["no", "yes"]
    assert models["ner"]["labels"] == NER_LABELS and models["ner"]["routes"] == ["/v1/embeddings", "/v1/token-embeddings", "/v1/tag", "/tokenize"]
    assert models["sts"]["family"] == "gpt" and models["sts"]["task"] == "regression"
    assert models["mlm"]["task"] is None and "/v1/fill-mask" in models["mlm"]["routes"]
    assert models["gpt"]["routes"] == ["/v1/embeddings", "/v1/token-embeddings", "/v1/generate", "/tokenize"]
    assert all(m["dim"] == 64 for m in models.values())
    # The run folder was resolved through best.json, not to its newest checkpoint.
    manifest = (built["qa"][0] / "checkpoint_000001" / "MANIFEST.json").read_bytes()
    assert models["qa"]["version"] == f"checkpoint_000001@{hashlib.sha256(manifest).hexdigest()[:16]}"


def test_untrained_heads_of_a_hugging_face_folder_are_not_served(minilm_dir):
    """MiniLM ships a bare BertModel: its MLM head would be random, so it serves no /v1/fill-mask."""
    from jobs.serving.replica import _load_noting_untrained_heads
    from jobs.serving.serve_tasks import cannot_serve, routes_of

    loaded, untrained = _load_noting_untrained_heads(minilm_dir)
    assert "mlm" in untrained
    routes = routes_of(loaded.family, loaded.task, untrained)
    assert routes == ["/v1/embeddings", "/v1/token-embeddings", "/tokenize"]
    message = cannot_serve("minilm", {"family": "bert", "task": None, "labels": [], "routes": routes}, "/v1/fill-mask")
    assert message.startswith("model 'minilm' is a pretrained bert model whose checkpoint has no trained masked-LM head")
    assert "it serves /v1/embeddings, /v1/token-embeddings, /tokenize" in message


# ----------------------------------------------------------------------------- fine-tuned tasks


def test_classify_pairs_and_texts_match_the_model(client, built, tok):
    from jobs.serving.serve_tasks import softmax

    model = built["pair"][1]
    pairs = [["A man plays a guitar.", "Someone makes music."], ["The cat sleeps.", "Stocks fell sharply today."]]
    body = _ok(client.post("/v1/classify", json={"model": "pair", "input": pairs}))
    cols = _encode(tok, {"text": [a for a, _ in pairs], "text_pair": [b for _, b in pairs]}, kind="classification", max_len=128, labels=("no", "yes"),
                   text_field="text", pair_field="text_pair")
    probs = softmax(_logits(model, cols))
    assert body["task"] == "classification" and [d["index"] for d in body["data"]] == [0, 1]
    for d, p in zip(body["data"], probs):
        assert d["label"] == ["no", "yes"][int(p.argmax())]
        got = {x["label"]: x["score"] for x in d["labels"]}
        np.testing.assert_allclose([got["no"], got["yes"]], p, atol=TOL)
        assert [x["score"] for x in d["labels"]] == sorted(got.values(), reverse=True)
    assert body["usage"]["prompt_tokens"] == int(cols["attention_mask"].sum())

    body = _ok(client.post("/v1/classify", json={"model": "pair", "input": "A single sentence."}))
    cols = _encode(tok, {"text": ["A single sentence."]}, kind="classification", max_len=128, labels=("no", "yes"), text_field="text")
    np.testing.assert_allclose(body["data"][0]["score"], softmax(_logits(model, cols))[0].max(), atol=TOL)


def test_regression_gives_the_value_with_gpt_inputs(client, built, tok):
    texts = ["A dog runs in the park.", "Nothing at all like it"]
    body = _ok(client.post("/v1/classify", json={"model": "sts", "input": texts}))
    cols = _encode(tok, {"text": texts}, kind="regression", max_len=128, input_style="gpt", text_field="text")
    assert cols["input_ids"][0, 0] == tok.cls_id  # start a extract, as the GPT paper's inputs
    np.testing.assert_allclose([d["value"] for d in body["data"]], _logits(built["sts"][1], cols), atol=TOL)


def test_rerank_sorts_by_the_pair_classifier_in_tei_shape(client, built, tok):
    from jobs.serving.serve_tasks import softmax

    query, texts = "where is the bank?", ["the river bank is muddy", "I like cheese", "the bank opens at nine", "banks lend money"]
    r = client.post("/v1/rerank", json={"model": "pair", "query": query, "texts": texts, "return_text": True})
    body = _ok(r)
    cols = _encode(tok, {"text": [query] * 4, "text_pair": texts}, kind="classification", max_len=128, labels=("no", "yes"),
                   text_field="text", pair_field="text_pair")
    logits = _logits(built["pair"][1], cols)
    expected = softmax(logits)[:, 1]  # the probability of the last label
    assert [d["index"] for d in body] == np.argsort(-expected, kind="stable").tolist()
    np.testing.assert_allclose([d["score"] for d in body], np.sort(expected)[::-1], atol=TOL)
    assert all(d["text"] == texts[d["index"]] for d in body)
    raw = _ok(client.post("/v1/rerank", json={"model": "pair", "query": query, "texts": texts, "raw_scores": True}))
    assert all("text" not in d for d in raw)
    np.testing.assert_allclose(sorted(d["score"] for d in raw), np.sort(logits[:, 1] - logits[:, 0]), atol=1e-4)
    # a one-output (regression) head: the sigmoid of its value, as TEI and sentence-transformers' CrossEncoder; raw_scores: the value
    body = _ok(client.post("/v1/rerank", json={"model": "sts", "query": query, "texts": texts}))
    raw = _ok(client.post("/v1/rerank", json={"model": "sts", "query": query, "texts": texts, "raw_scores": True}))
    cols = _encode(tok, {"text": [query] * 4, "text_pair": texts}, kind="regression", max_len=128, input_style="gpt",
                   text_field="text", pair_field="text_pair")
    value = np.sort(_logits(built["sts"][1], cols))[::-1]
    np.testing.assert_allclose([d["score"] for d in body], 1 / (1 + np.exp(-value)), atol=TOL)
    np.testing.assert_allclose([d["score"] for d in raw], value, atol=TOL)
    assert [d["index"] for d in body] == [d["index"] for d in raw]


def test_rerank_answers_cohere_and_jinas_shape_too(client):
    """{"documents", "top_n", "return_documents"} (Cohere's and Jina's rerank API, which Infinity and vLLM
    speak): the TEI answer's order and scores as {"results": [{"index", "relevance_score", "document"}]}."""
    query, texts = "where is the bank?", ["the river bank is muddy", "I like cheese", "the bank opens at nine", "banks lend money"]
    tei = _ok(client.post("/v1/rerank", json={"model": "pair", "query": query, "texts": texts}))
    body = _ok(client.post("/v1/rerank", json={"model": "pair", "query": query, "documents": [texts[0], {"text": texts[1]}, *texts[2:]],
                                               "top_n": 3, "return_documents": True}))
    assert body["object"] == "rerank" and body["model"] == "pair" and body["model_version"]
    assert [(r["index"], r["document"]["text"]) for r in body["results"]] == [(d["index"], texts[d["index"]]) for d in tei[:3]]
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]], [d["score"] for d in tei[:3]], atol=1e-6)
    plain = _ok(client.post("/v1/rerank", json={"model": "pair", "query": query, "documents": texts}))
    assert len(plain["results"]) == 4 and all("document" not in r for r in plain["results"])


def test_rerank_without_v1_takes_tei_and_infinity_clients_bodies(client):
    """POST /rerank, where TEI's rerank clients (Haystack, LlamaIndex) and Infinity's send: TEI's body
    answers /v1/rerank's list, Infinity's (Cohere's) its results; TEI's clients name no model, which
    with several served is a 400 saying to name one; TEI's truncation_direction "right" is what
    truncate does, "left" is a 422 naming it."""
    query, texts = "where is the bank?", ["the river bank is muddy", "I like cheese", "the bank opens at nine"]
    v1 = _ok(client.post("/v1/rerank", json={"model": "pair", "query": query, "texts": texts, "return_text": True}))
    tei = _ok(client.post("/rerank", json={"model": "pair", "query": query, "texts": texts, "return_text": True,
                                           "truncate": True, "truncation_direction": "right"}))
    assert tei == v1
    cohere = _ok(client.post("/rerank", json={"model": "pair", "query": query, "documents": texts, "top_n": 2}))
    assert [r["index"] for r in cohere["results"]] == [d["index"] for d in v1[:2]]
    r = client.post("/rerank", json={"query": query, "texts": texts})
    assert r.status_code == 400 and "name one" in r.json()["error"], r.text
    r = client.post("/rerank", json={"model": "pair", "query": query, "texts": texts, "truncation_direction": "left"})
    assert r.status_code == 422 and "truncation_direction" in r.json()["error"], r.text
    r = client.post("/rerank", json={"model": "mlm", "query": query, "texts": texts})
    assert r.status_code == 400 and "/v1/rerank needs" in r.json()["error"], r.text


def test_tag_words_offsets_and_entities_match_the_model(client, built, tok):
    from jobs.serving.serve_tasks import softmax
    from pipelines.alignment import first_subtokens
    from pipelines.metrics import entities

    texts = ["John  Smith lives in New York near Lake Tahoe .", "Paris"]
    body = _ok(client.post("/v1/tag", json={"model": "ner", "input": texts}))
    cols = _encode(tok, {"tokens": [t.split() for t in texts]}, kind="token-classification", max_len=128, labels=tuple(NER_LABELS))
    probs = softmax(_logits(built["ner"][1], cols))  # (N, T, L)
    first = first_subtokens(cols["word_ids"])
    for text, item, p, f in zip(texts, body["data"], probs, first):
        words = text.split()
        assert [w["word"] for w in item["words"]] == words
        assert all(text[w["start"] : w["end"]] == w["word"] for w in item["words"])
        expected = p[f]  # (W, L) at each word's first sub-token
        assert [w["tag"] for w in item["words"]] == [NER_LABELS[k] for k in expected.argmax(-1)]
        np.testing.assert_allclose([w["score"] for w in item["words"]], expected.max(-1), atol=TOL)
        types, a, b = entities([[w["tag"] for w in item["words"]]])
        assert [(e["type"], e["words"]) for e in item["entities"]] == [(t, [int(x), int(y)]) for t, x, y in zip(types, a, b)]
        for e in item["entities"]:
            assert e["text"] == text[e["start"] : e["end"]]
    strict = _ok(client.post("/v1/tag", json={"model": "ner", "input": texts, "scheme": "IOB2"}))
    assert strict["scheme"] == "IOB2" and [w["tag"] for w in strict["data"][0]["words"]] == [w["tag"] for w in body["data"][0]["words"]]


def _without_scores(items: list[dict]) -> tuple[list[dict], list[float]]:
    """(the answer's items with every score taken out, the scores): rows batched with others may differ in the last bits."""
    scores = [w["score"] for it in items for w in it["words"] + it["entities"]]
    bare = [{**it, "words": [{k: v for k, v in w.items() if k != "score"} for w in it["words"]],
             "entities": [{k: v for k, v in e.items() if k != "score"} for e in it["entities"]]} for it in items]
    return bare, scores


def test_tag_pre_split_words_equal_the_same_text(client, built, tok):
    """``words`` the tokenizer would split the same way give the text's answer; offsets of pre-split words
    index the words joined by single spaces; a given word with a space inside is one word, tagged by its
    first sub-token, as the model scores it."""
    from jobs.serving.serve_tasks import softmax
    from pipelines.alignment import first_subtokens

    texts = ["John Smith lives in New York near Lake Tahoe .", "Paris"]
    words = [t.split() for t in texts]
    by_text = _ok(client.post("/v1/tag", json={"model": "ner", "input": texts}))
    by_words = _ok(client.post("/v1/tag", json={"model": "ner", "words": words}))
    (a, a_scores), (b, b_scores) = _without_scores(by_text["data"]), _without_scores(by_words["data"])
    assert b == a and by_words["usage"] == by_text["usage"]
    np.testing.assert_allclose(b_scores, a_scores, atol=TOL)
    assert [w["index"] for w in a[0]["words"]] == list(range(len(words[0])))

    spaced = _ok(client.post("/v1/tag", json={"model": "ner", "input": ["John  Smith lives in  Paris"]}))["data"][0]
    split = _ok(client.post("/v1/tag", json={"model": "ner", "words": [["John", "Smith", "lives", "in", "Paris"]]}))["data"][0]
    assert [(w["word"], w["tag"]) for w in split["words"]] == [(w["word"], w["tag"]) for w in spaced["words"]]
    assert [w["start"] for w in split["words"]] == [0, 5, 11, 17, 20] and [w["start"] for w in spaced["words"]] == [0, 6, 12, 18, 22]
    assert [e["words"] for e in split["entities"]] == [e["words"] for e in spaced["entities"]]

    odd = [["New York", "is", "big"], ["Lake", "Tahoe"]]
    body = _ok(client.post("/v1/tag", json={"model": "ner", "words": odd}))
    cols = _encode(tok, {"tokens": odd}, kind="token-classification", max_len=128, labels=tuple(NER_LABELS))
    probs = softmax(_logits(built["ner"][1], cols))  # (N, T, L)
    for ws, item, p, f in zip(odd, body["data"], probs, first_subtokens(cols["word_ids"])):
        joined = " ".join(ws)
        assert [(w["index"], w["word"]) for w in item["words"]] == list(enumerate(ws))
        assert all(joined[w["start"] : w["end"]] == w["word"] for w in item["words"])
        assert [w["tag"] for w in item["words"]] == [NER_LABELS[k] for k in p[f].argmax(-1)]
        np.testing.assert_allclose([w["score"] for w in item["words"]], p[f].max(-1), atol=TOL)
        for e in item["entities"]:
            x, y = e["words"]
            assert e["text"] == " ".join(ws[x : y + 1]) == joined[e["start"] : e["end"]]


def test_answer_equals_decode_qa_over_windows_with_no_answer(client, built, tok):
    expected, cols = _qa_decode(built["qa"][1], tok, built["qa_recipe"]["task"]["null_threshold"])
    assert len(cols["input_ids"]) > len(QA_QUESTIONS)  # the contexts were read in several windows
    body = _ok(client.post("/v1/answer", json={"model": "qa", "question": QA_QUESTIONS, "context": QA_CONTEXTS}))
    assert sorted(d["no_answer"] for d in body["data"]) == [False, True]
    for d, e in zip(body["data"], expected):
        assert (d["answer"], d["start"], d["end"]) == (e["text"], e["start"], e["end"])
        assert d["no_answer"] == (e["start"] < 0)
        np.testing.assert_allclose([d["score"], d["null_score_diff"]], [e["score"], e["null_score_diff"]], atol=1e-4)
        if not d["no_answer"]:
            assert QA_CONTEXTS[d["index"]][d["start"] : d["end"]] == d["answer"]
    one = _ok(client.post("/v1/answer", json={"model": "qa", "question": QA_QUESTIONS[1], "context": QA_CONTEXTS[1]}))
    assert one["data"][0]["answer"] == expected[1]["text"]


def test_task_passes_stay_under_the_token_budget_and_reach_the_metrics(client, built, tok):
    """Rows of very different lengths (one at the full 128 tokens): every pass the replica ran is under
    max_batch_tokens, the answers are the model's, and /metrics counts the passes of /v1/classify."""
    from ray import serve

    from jobs.serving.serve_config import APP_NAME
    from jobs.serving.serve_tasks import softmax

    texts = ["word " * 200, "short", "a somewhat longer sentence about the river bank", "x y"] * 2
    body = _ok(client.post("/v1/classify", json={"model": "pair", "input": texts, "truncate": True}))
    cols = _encode(tok, {"text": texts}, kind="classification", max_len=128, labels=("no", "yes"), text_field="text")
    np.testing.assert_allclose([d["labels"][0]["score"] for d in body["data"]], softmax(_logits(built["pair"][1], cols)).max(-1), atol=TOL)

    passes = serve.get_deployment_handle("EmbeddingModel-0-pair", app_name=APP_NAME).forward_passes.remote().result(timeout_s=30)
    assert passes and all(rows * length <= BUDGET for rows, length in passes), passes
    assert (2, 128) in passes  # the two full-width rows share a pass; the short rows are not padded to 128
    metrics = client.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith('ctx_batch_size_padded_tokens_count{model="pair"}'))
    assert float(line.split()[-1]) >= 1, line


def test_a_task_checkpoint_serves_embeddings_from_its_backbone(client, built, tok):
    texts = ["the river bank", "a loan from the bank"]
    got = np.array([d["embedding"] for d in _ok(client.post("/v1/embeddings", json={"model": "pair", "input": texts}))["data"]])
    ids, _, _ = tok.encode_for_model(texts, 512)
    width = max(len(r) for r in ids)
    input_ids = torch.tensor([r + [tok.pad_id] * (width - len(r)) for r in ids])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])
    with torch.inference_mode():
        hidden = built["pair"][1].backbone.hidden_states(input_ids, mask)[-1]
    m = mask[..., None].float()
    np.testing.assert_allclose(got, ((hidden * m).sum(1) / m.sum(1)).numpy(), atol=1e-4)


# ----------------------------------------------------------------------------- pretrained heads


def test_fill_mask_top_k_equals_the_models(client, built, tok):
    texts = ["the [MASK] flows past the bank.", "[MASK] is the capital of [MASK] ."]
    body = _ok(client.post("/v1/fill-mask", json={"model": "mlm", "input": texts, "top_k": 4}))
    model = built["mlm"][1]
    ids, offsets, _ = tok.encode_for_model(texts, 512)
    for text, item, row, off in zip(texts, body["data"], ids, offsets):
        with torch.inference_mode():
            probs = torch.softmax(model.mlm_logits(torch.tensor([row]))[0], dim=-1)  # (T, V)
        positions = [i for i, t in enumerate(row) if t == tok.mask_id]
        assert [m["position"] for m in item["masks"]] == positions
        for m, pos in zip(item["masks"], positions):
            top = torch.topk(probs[pos], 4)
            assert [p["token_id"] for p in m["predictions"]] == top.indices.tolist()
            np.testing.assert_allclose([p["score"] for p in m["predictions"]], top.values.numpy(), atol=TOL)
            assert text[m["start"] : m["end"]] == "[MASK]" and off[pos] == (m["start"], m["end"])
            for p in m["predictions"]:
                assert p["token"] == tok.id_to_token(p["token_id"])
                assert p["sequence"] == text[: m["start"]] + p["text"] + text[m["end"] :]


def test_greedy_generation_is_the_argmax_by_hand(client, built, tok):
    prompt = "the river bank"
    body = _ok(client.post("/v1/generate", json={"model": "gpt", "prompt": prompt, "max_tokens": 8, "temperature": 0}))
    model = built["gpt"][1]
    ids = [tok.cls_id, *tok.encode_batch([prompt])[0].tolist()]
    new = []
    for _ in range(8):
        with torch.inference_mode():
            nxt = int(model.logits(torch.tensor([ids]))[0, -1].argmax())
        if nxt == tok.sep_id:
            break
        ids.append(nxt)
        new.append(nxt)
    choice = body["choices"][0]
    assert choice["token_ids"] == new and choice["tokens"] == [tok.id_to_token(i) for i in new]
    assert choice["finish_reason"] == ("length" if len(new) == 8 else "stop")
    assert body["usage"] == {"prompt_tokens": len(ids) - len(new), "completion_tokens": len(new), "total_tokens": len(ids)}


def test_sampling_is_keyed_by_the_seed(client, built, tok):
    from jobs.serving.serve_tasks import generate_ids

    def sample(model: str, seed: int | None, **kw) -> dict:
        req = {"model": model, "prompt": "once upon a time", "max_tokens": 10, "temperature": 1.5, **kw}
        if seed is not None:
            req["seed"] = seed
        return _ok(client.post("/v1/generate", json=req))

    a, b, c = sample("gpt", 7, top_k=50), sample("gpt", 7, top_k=50), sample("gpt", 8, top_k=50)
    assert a["seed"] == 7 and a["choices"] == b["choices"]
    assert a["choices"][0]["token_ids"] != c["choices"][0]["token_ids"]
    fresh = sample("gpt", None, top_p=0.9)
    assert sample("gpt", fresh["seed"], top_p=0.9)["choices"] == fresh["choices"]  # the returned seed reproduces it
    # What the replica ran is generate_ids with that seed: the same tokens in this process.
    prompt = [tok.cls_id, *tok.encode_batch(["once upon a time"])[0].tolist()]
    ids, finish = generate_ids("gpt", built["gpt"][1], prompt, 10, tok.sep_id, tok.mask_id, 1.5, None, 0.9, fresh["seed"], torch.device("cpu"))
    assert fresh["choices"][0]["token_ids"] == ids and fresh["choices"][0]["finish_reason"] == finish


def test_xlnet_and_transformer_xl_generate_in_process(tok):
    """XLNet predicts the next token with its query stream at a placeholder nobody attends to, so the
    placeholder's id cannot matter; Transformer-XL reads its last position, as GPT."""
    from ctxmodels.registry import build_model
    from jobs.serving.serve_tasks import generate_ids, next_token_logits

    prompt = torch.tensor([[tok.cls_id, *tok.encode_batch(["once upon a time"])[0].tolist()]])
    _, xlnet = build_model("xlnet", "tiny", V, seed=6)
    with torch.inference_mode():
        a, b = (next_token_logits("xlnet", xlnet.eval(), prompt, p) for p in (tok.mask_id, 2000))
    torch.testing.assert_close(a, b)
    _, txl = build_model("transformer-xl", "tiny", V, seed=6)
    txl.eval()
    ids, new = prompt.clone(), []
    for _ in range(5):
        with torch.inference_mode():
            nxt = int(txl.logits(txl.backbone.hidden_states(ids)[-1])[0, -1].argmax())
        if nxt == tok.sep_id:
            break
        new.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    got, _ = generate_ids("transformer-xl", txl, prompt[0].tolist(), 5, tok.sep_id, tok.mask_id, 0.0, None, None, 0, torch.device("cpu"))
    assert got == new


def test_tokenize_gives_ids_tokens_and_offsets(client, tok):
    texts = ["Tokenization isn't trivial!", "the river bank"]
    body = _ok(client.post("/tokenize", json={"model": "ner", "input": texts}))
    ids, offsets, tokens = tok.encode_for_model(texts, 512)
    for item, i, o, t in zip(body["data"], ids, offsets, tokens):
        assert item["ids"] == list(i) and item["tokens"] == list(t) and [tuple(x) for x in item["offsets"]] == list(o)
        assert item["fits"] and item["n_tokens"] == len(i)
    bare = _ok(client.post("/tokenize", json={"model": "gpt", "input": texts[0], "add_special_tokens": False}))
    assert bare["data"][0]["ids"] == list(ids[0][1:-1])


# ----------------------------------------------------------------------------- refusals: 4xx naming the problem


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/v1/fill-mask", {"model": "gpt", "input": "a [MASK]"}, 400, ["model 'gpt' is a pretrained gpt model", "it serves /v1/embeddings, /v1/token-embeddings, /v1/generate, /tokenize"]),
        ("/v1/generate", {"model": "mlm", "prompt": "hi"}, 400, ["pretrained bert model", "/v1/fill-mask", "/v1/generate needs"]),
        ("/v1/classify", {"model": "ner", "input": "x"}, 400, ["fine-tuned bert token-classification model", "/v1/tag"]),
        ("/v1/tag", {"model": "pair", "input": "x"}, 400, ["classification model", "/v1/classify, /v1/rerank"]),
        ("/v1/answer", {"model": "mlm", "question": "q", "context": "c"}, 400, ["/v1/answer needs a fine-tuned question-answering"]),
        ("/v1/rerank", {"model": "qa", "query": "q", "texts": ["a"]}, 400, ["question-answering", "/v1/answer"]),
        ("/v1/classify", {"model": "nope", "input": "x"}, 404, ["'nope'", "known models"]),
        ("/v1/fill-mask", {"model": "mlm", "input": "no mask here"}, 400, ["input[0]", "'[MASK]'"]),
        ("/v1/fill-mask", {"model": "mlm", "input": "a [MASK]", "top_k": 0}, 422, ["top_k"]),
        ("/v1/generate", {"model": "gpt", "prompt": "hi", "max_tokens": MAX_NEW_TOKENS + 1}, 413, ["max_new_tokens", str(MAX_NEW_TOKENS)]),
        ("/v1/generate", {"model": "gpt", "prompt": "word " * 126, "max_tokens": 4}, 400, ["prompt has 127 tokens", "128 tokens"]),
        ("/v1/generate", {"model": "gpt", "prompt": "hi", "temperature": -1}, 422, ["temperature"]),
        ("/v1/generate", {"model": "gpt", "prompt": "  "}, 422, ["prompt", "empty"]),
        ("/v1/classify", {"model": "pair", "input": [["a", "b", "c"]]}, 422, ["item 0", "pair"]),
        ("/v1/classify", {"model": "pair", "input": ["a", ["b", "c"]]}, 422, ["input", "item 1"]),
        ("/v1/classify", {"model": "pair", "input": "word " * 200}, 400, ["input[0]", "128 tokens", "truncate"]),
        ("/v1/answer", {"model": "qa", "question": ["a", "b"], "context": "c"}, 422, ["question and context"]),
        ("/v1/answer", {"model": "qa", "question": "why " * 20, "context": "c"}, 400, ["question[0]", "max_query_len"]),
        ("/v1/tag", {"model": "ner", "input": "x", "scheme": "BIO"}, 422, ["scheme"]),
        ("/v1/tag", {"model": "ner", "words": []}, 422, ["words", "must not be empty"]),
        ("/v1/tag", {"model": "ner", "words": [["a"], []]}, 422, ["words", "item [1] is an empty word list"]),
        ("/v1/tag", {"model": "ner", "words": [["John", 3]]}, 422, ["words", "item [0][1] must be a string, got int"]),
        ("/v1/tag", {"model": "ner", "words": [["John", " "]]}, 422, ["words", "item [0][1] is empty or only whitespace"]),
        ("/v1/tag", {"model": "ner", "words": ["John lives"]}, 422, ["words", "item [0] must be a list of words"]),
        ("/v1/tag", {"model": "ner", "input": "x", "words": [["x"]]}, 422, ["exactly one of input", "both were given"]),
        ("/v1/tag", {"model": "ner"}, 422, ["exactly one of input", "neither was given"]),
        ("/v1/tag", {"model": "ner", "words": [["w"] * 200]}, 400, ["words[0]", "128 tokens", "truncate"]),
        ("/v1/rerank", {"model": "pair", "query": "q", "texts": []}, 422, ["texts", "empty"]),
        ("/v1/rerank", {"model": "pair", "query": "q", "texts": ["a"], "documents": ["b"]}, 422, ["exactly one of texts", "both were given"]),
        ("/v1/rerank", {"model": "pair", "query": "q", "documents": ["a"], "raw_scores": True}, 422, ["raw_scores belongs to the other body"]),
        ("/v1/rerank", {"model": "pair", "query": "q", "documents": [{"title": "a"}]}, 422, ['item 0 must be a string or an object {"text": ...}']),
        ("/tokenize", {"model": "pair", "input": 3}, 422, ["input"]),
    ],
)
def test_wrong_model_or_malformed_input_gets_a_4xx_naming_it(client, path, body, status, words):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    message = error if path in TEI_ROUTES else error["message"]  # TEI's body on TEI's paths (/tokenize)
    for w in words:
        assert w.lower() in message.lower(), (w, message)


def test_truncate_cuts_as_training_does(client):
    r = client.post("/v1/classify", json={"model": "pair", "input": "word " * 200, "truncate": True})
    assert _ok(r)["usage"]["prompt_tokens"] == 128
    r = client.post("/v1/answer", json={"model": "qa", "question": "why " * 20, "context": "because", "truncate": True})
    assert _ok(r)["data"][0]["index"] == 0
