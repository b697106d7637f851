"""The task routes' forward passes under the token budget (jobs/serving/serve_tasks.py ``TaskServing``), in
this process: a replica class built directly (``EmbeddingModel.func_or_class``) with its real
batch queue (``jobs.serving.batching.Batcher``, plain asyncio).

A mixed-length request must give every row the answer it gets alone (a row alone is never padded),
so padding inside a pass is masked right; every pass must stay under ``max_batch_tokens`` (watched at
the word embedding, the model's real input) and pad less than one pass at the longest row did.
Tiny BERT models (bidirectional: padding a mask does not hide would change every position) with
MiniLM's vocabulary, weights seeded here; a symmetric GPT pair model reads rows of two sequences.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

TOL = 1e-5
BUDGET = 96  # padded tokens per pass: rows here are 5-48 tokens, so a mixed request needs several passes
MAX_ROWS = 6
V = {"vocab_size": 30522}
NER_LABELS = ["B-LOC", "B-PER", "I-LOC", "I-PER", "O"]
QA_TASK = {"kind": "question-answering", "max_len": 48, "max_query_len": 12, "doc_stride": 8, "max_answer_len": 10, "version_2": True}
TEXTS = [
    "Paris",
    "John Smith lives in New York near Lake Tahoe and works for a bank by the river .",
    "the cat sleeps",
    "A man plays a guitar on the corner of the street while the rain falls on the town .",
    "Marie likes museums .",
    "stocks fell sharply today after the bank raised its rates again",
    "ok",
]
QUESTIONS = ["where does john live?", "who lives in paris?", "what falls?"]
CONTEXTS = [
    "John lives in New York, a big city by the sea. " * 4 + "He works in a bank near the river.",  # several windows
    "Marie lives in Paris.",
    "The rain falls on the town while a man plays a guitar on the corner of the street.",
]


def _checkpoint(path: Path, family: str, task, minilm_dir: Path, seed: int, extra_json: dict | None = None) -> str:
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import build_task_model

    cfg = make_config(family, "tiny", V)
    model = build_task_model(family, cfg, task, torch.Generator().manual_seed(seed))
    save_checkpoint(path, model, family, cfg, tokenizer_dir=minilm_dir, task=task, extra_json=extra_json)
    return str(path)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, minilm_dir):
    """{name: replica}: pair (BERT classifier, 2 labels), ner (BERT tagger), qa (BERT SQuAD 2.0 reader,
    windows of 48 tokens), mlm (pretrained BERT), sym (GPT regression over both orders of a pair)."""
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model
    from ctxmodels.tasks import TaskConfig
    from jobs.serving import serve_config as sc
    from jobs.serving.serve import EmbeddingModel

    root = tmp_path_factory.mktemp("task-batching")
    uris = {
        "pair": _checkpoint(root / "pair", "bert", TaskConfig(kind="classification", num_labels=2, labels=["no", "yes"]), minilm_dir, 1),
        "ner": _checkpoint(root / "ner", "bert", TaskConfig(kind="token-classification", num_labels=len(NER_LABELS), labels=NER_LABELS), minilm_dir, 3),
        "sym": _checkpoint(root / "sym", "gpt", TaskConfig(kind="regression", num_labels=1, input_style="gpt", symmetric=True, lm_weight=0.0), minilm_dir, 2),
    }
    recipe = {"name": "qa", "model": {"init": "-"}, "data": {"train": "-"}, "task": QA_TASK}
    uris["qa"] = _checkpoint(root / "qa", "bert", TaskConfig(kind="question-answering", num_labels=1), minilm_dir, 4,
                             {"trainer_state": {"step": 1, "recipe": json.loads(json.dumps(recipe))}})
    cfg, model = build_model("bert", "tiny", V, seed=6)
    save_checkpoint(root / "mlm", model, "bert", cfg, tokenizer_dir=minilm_dir)
    uris["mlm"] = str(root / "mlm")
    cfg, model = build_model("xlm", "tiny", V, seed=7)  # XLM's prediction layer: no transform
    save_checkpoint(root / "xlm", model, "xlm", cfg, tokenizer_dir=minilm_dir)
    uris["xlm"] = str(root / "xlm")

    settings = {"max_batch_size": MAX_ROWS, "max_batch_tokens": BUDGET, "batch_wait_timeout_s": 0.05}
    return {
        name: EmbeddingModel.func_or_class(name, uri, None, sc.ModelConfig(uri=uri, **settings), sc.Limits())
        for name, uri in uris.items()
    }


class Spy:
    """(sequences, tokens) of every forward pass, read where the (B, T) ids enter the model: its
    word embedding, or the BERT embeddings module that holds it (a padded batch's word table
    sees only its real tokens' ids)."""

    def __init__(self, replica):
        self.shapes: list[tuple[int, int]] = []
        word = next(m for m in replica.model.modules() if isinstance(m, torch.nn.Embedding) and m.num_embeddings == V["vocab_size"])
        self.module = next((m for m in replica.model.modules() if getattr(m, "word", None) is word), word)

    def __enter__(self) -> "Spy":
        self.hook = self.module.register_forward_hook(lambda _m, args, _out: self.shapes.append(tuple(args[0].shape)))
        return self

    def __exit__(self, *exc) -> None:
        self.hook.remove()


class Ask:
    """Requests to the replicas on one event loop, as in a replica."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()

    def run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    def __call__(self, replica, route: str, **args) -> dict:
        """The replica's answer to one request: {"body", "batches", version, ...}."""
        return self.run(replica._task(route, args))

    def alone(self, replica, route: str, items: list[dict]) -> list[dict]:
        """Each item's answer asked alone, one request after another: its row is never padded."""
        return [self(replica, route, **item)["body"] for item in items]


@pytest.fixture(scope="module")
def ask():
    a = Ask()
    yield a
    pending = asyncio.all_tasks(a.loop)  # the batch queues' waiting loops
    for task in pending:
        task.cancel()
    a.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    a.loop.close()


def _check_budget(spy: Spy, out: dict, sequences_per_row: int = 1) -> None:
    assert len(spy.shapes) > 1, spy.shapes  # the request was split
    for rows, length in spy.shapes:
        assert rows * length <= BUDGET and rows <= MAX_ROWS * sequences_per_row, spy.shapes
    # What the route reports for /metrics is what the model read.
    assert sorted(p for _, _, p in out["batches"]) == sorted(rows * length for rows, length in spy.shapes)


# ----------------------------------------------------------------------------- same answers as alone


def test_classify_mixed_lengths_equal_each_text_alone_and_the_model(ask, replicas, tok):
    from jobs.serving.serve_tasks import softmax
    from pipelines.finetune import TaskDataConfig, encode_task

    replica = replicas["pair"]
    with Spy(replica) as spy:
        out = ask(replica, "/v1/classify", texts=TEXTS, pairs=None, truncate=False)
    _check_budget(spy, out)
    alone = ask.alone(replica, "/v1/classify", [{"texts": [t], "pairs": None, "truncate": False} for t in TEXTS])
    got = np.array([[x["score"] for x in sorted(d["labels"], key=lambda x: x["label"])] for d in out["body"]["data"]])
    want = np.array([[x["score"] for x in sorted(a["data"][0]["labels"], key=lambda x: x["label"])] for a in alone])
    np.testing.assert_allclose(got, want, atol=TOL)
    assert [d["index"] for d in out["body"]["data"]] == list(range(len(TEXTS)))
    # ... and what the model gives rows padded to the fine-tuning width (128), all in one pass.
    cols = encode_task({"text": TEXTS}, tok, TaskDataConfig(kind="classification", max_len=128, labels=("no", "yes"), text_field="text", with_labels=False))
    with torch.inference_mode():
        logits = replica.model(**{k: torch.from_numpy(cols[k]) for k in ("input_ids", "attention_mask", "token_type_ids")}).logits.numpy()
    np.testing.assert_allclose(got, softmax(logits), atol=TOL)  # labels sorted: "no", "yes"


def test_pairs_of_a_symmetric_model_count_both_orders(ask, replicas):
    replica = replicas["sym"]
    pairs = [(TEXTS[i], TEXTS[-1 - i]) for i in range(len(TEXTS))]
    args = {"texts": [a for a, _ in pairs], "pairs": [b for _, b in pairs], "truncate": False}
    with Spy(replica) as spy:
        out = ask(replica, "/v1/classify", **args)
    _check_budget(spy, out, sequences_per_row=2)
    assert all(rows % 2 == 0 for rows, _ in spy.shapes)  # both orders of every pair in the same pass
    alone = ask.alone(replica, "/v1/classify", [{"texts": [a], "pairs": [b], "truncate": False} for a, b in pairs])
    np.testing.assert_allclose([d["value"] for d in out["body"]["data"]], [a["data"][0]["value"] for a in alone], atol=TOL)


def test_rerank_mixed_lengths_equal_each_text_alone(ask, replicas):
    replica = replicas["pair"]
    query = "where is the bank?"
    with Spy(replica) as spy:
        out = ask(replica, "/v1/rerank", query=query, texts=TEXTS, raw_scores=True, return_text=False, truncate=False)
    _check_budget(spy, out)
    alone = ask.alone(replica, "/v1/rerank", [{"query": query, "texts": [t], "raw_scores": True, "return_text": False, "truncate": False} for t in TEXTS])
    by_index = {d["index"]: d["score"] for d in out["body"]}
    np.testing.assert_allclose([by_index[i] for i in range(len(TEXTS))], [a[0]["score"] for a in alone], atol=TOL)
    scores = [d["score"] for d in out["body"]]
    assert scores == sorted(scores, reverse=True)


def test_tag_mixed_lengths_equal_each_text_alone(ask, replicas):
    replica = replicas["ner"]
    with Spy(replica) as spy:
        out = ask(replica, "/v1/tag", texts=TEXTS, words=None, scheme=None, truncate=False)
    _check_budget(spy, out)
    alone = ask.alone(replica, "/v1/tag", [{"texts": [t], "words": None, "scheme": None, "truncate": False} for t in TEXTS])
    for item, a in zip(out["body"]["data"], alone):
        expected = a["data"][0]
        assert [(w["word"], w["tag"], w["start"]) for w in item["words"]] == [(w["word"], w["tag"], w["start"]) for w in expected["words"]]
        np.testing.assert_allclose([w["score"] for w in item["words"]], [w["score"] for w in expected["words"]], atol=TOL)
        assert [(e["type"], e["words"]) for e in item["entities"]] == [(e["type"], e["words"]) for e in expected["entities"]]


def test_answer_windows_of_mixed_lengths_merge_as_each_question_alone(ask, replicas, tok):
    from pipelines.finetune import TaskDataConfig, encode_task
    from pipelines.qa import decode_qa

    replica = replicas["qa"]
    with Spy(replica) as spy:
        out = ask(replica, "/v1/answer", questions=QUESTIONS, contexts=CONTEXTS, truncate=False)
    _check_budget(spy, out)
    cfg = TaskDataConfig(kind="question-answering", max_len=48, max_query_len=12, doc_stride=8, version_2=True, with_labels=False)
    cols = encode_task({"question": QUESTIONS, "context": CONTEXTS}, tok, cfg)
    windows = np.bincount(cols["example_index"])
    assert windows[0] > 1 and len(cols["input_ids"]) == sum(rows for rows, _ in spy.shapes)  # the long context's windows, every one read once
    assert len(set(cols["attention_mask"].sum(-1).tolist())) > 1  # windows of several lengths

    # The model over the windows at their full width, decoded as the replica decodes them.
    with torch.inference_mode():
        logits = replica.model(**{k: torch.from_numpy(cols[k]) for k in ("input_ids", "attention_mask", "token_type_ids")}).logits.numpy()
    s = replica.settings
    features = {"example_index": cols["example_index"], "context_offsets": cols["context_offsets"]}
    expected = decode_qa(logits[..., 0], logits[..., 1], features, CONTEXTS, s.max_answer_len, s.null_threshold)
    alone = ask.alone(replica, "/v1/answer", [{"questions": [q], "contexts": [c], "truncate": False} for q, c in zip(QUESTIONS, CONTEXTS)])
    for d, e, a in zip(out["body"]["data"], expected, alone):
        a = a["data"][0]
        assert (d["answer"], d["start"], d["end"]) == (e["text"], e["start"], e["end"]) == (a["answer"], a["start"], a["end"])
        np.testing.assert_allclose([d["score"], d["null_score_diff"]], [e["score"], e["null_score_diff"]], atol=TOL)
        np.testing.assert_allclose([d["score"], d["null_score_diff"]], [a["score"], a["null_score_diff"]], atol=TOL)


@pytest.mark.parametrize("name", ["mlm", "xlm"])
def test_fill_mask_mixed_lengths_equal_each_text_alone(ask, replicas, name):
    replica = replicas[name]
    texts = [t.replace(" ", " [MASK] ", 1) if " " in t else f"{t} [MASK]" for t in TEXTS]
    with Spy(replica) as spy:
        out = ask(replica, "/v1/fill-mask", texts=texts, top_k=5, truncate=False)
    _check_budget(spy, out)
    alone = ask.alone(replica, "/v1/fill-mask", [{"texts": [t], "top_k": 5, "truncate": False} for t in texts])
    for item, a in zip(out["body"]["data"], alone):
        for m, e in zip(item["masks"], a["data"][0]["masks"], strict=True):
            assert m["position"] == e["position"] and [p["token_id"] for p in m["predictions"]] == [p["token_id"] for p in e["predictions"]]
            np.testing.assert_allclose([p["score"] for p in m["predictions"]], [p["score"] for p in e["predictions"]], atol=TOL)
    if name == "xlm":  # the scores are the model's own: softmax of mlm_logits at the mask
        ids = torch.as_tensor(replica.tokenizer.encode_for_model([texts[0]], 64)[0][0])[None]  # (1, T)
        with torch.no_grad():
            probs = torch.softmax(replica.model.mlm_logits(ids, torch.ones_like(ids)), dim=-1)[0]
        first = out["body"]["data"][0]["masks"][0]
        np.testing.assert_allclose([p["score"] for p in first["predictions"]],
                                   [probs[first["position"], p["token_id"]].item() for p in first["predictions"]], atol=TOL)


# ----------------------------------------------------------------------------- the passes


def test_a_mixed_request_pads_less_than_one_pass_at_its_longest_row(ask, replicas, tok):
    """Before, a batch's rows were all cut to its longest row; now each pass pads to its own longest,
    which is what ``token_budget_groups`` plans for these lengths."""
    from jobs.serving.passes import token_budget_groups
    from pipelines.finetune import TaskDataConfig, encode_task

    replica = replicas["pair"]
    texts = TEXTS[:MAX_ROWS]  # one serve batch's worth
    replica.recent_passes.clear()
    with Spy(replica) as spy:
        out = ask(replica, "/v1/classify", texts=texts, pairs=None, truncate=False)
    lengths = encode_task({"text": texts}, tok, TaskDataConfig(kind="classification", max_len=128, labels=("no", "yes"), text_field="text", with_labels=False))["attention_mask"].sum(-1).tolist()
    padded = sum(rows * length for rows, length in spy.shapes)
    assert padded < len(texts) * max(lengths), (spy.shapes, lengths)
    planned = token_budget_groups(lengths, MAX_ROWS, BUDGET)
    assert sorted(spy.shapes) == sorted((len(g), max(lengths[i] for i in g)) for g in planned)
    assert sorted(replica.recent_passes) == sorted(spy.shapes)  # what forward_passes() reports
    assert sum(n for _, n, _ in out["batches"]) == sum(lengths) == out["body"]["usage"]["prompt_tokens"]


def test_concurrent_requests_each_get_their_own_answers_and_every_pass_is_reported_once(ask, replicas):
    replica = replicas["pair"]
    requests = [TEXTS[:3], TEXTS[3:], TEXTS[1:2]]

    async def together() -> list[dict]:
        return await asyncio.gather(*(replica._task("/v1/classify", {"texts": r, "pairs": None, "truncate": False}) for r in requests))

    with Spy(replica) as spy:
        outs = ask.run(together())
    assert sum(rows for rows, _ in spy.shapes) == sum(len(r) for r in requests)
    for r, out in zip(requests, outs):
        alone = ask.alone(replica, "/v1/classify", [{"texts": [t], "pairs": None, "truncate": False} for t in r])
        np.testing.assert_allclose([d["score"] for d in out["body"]["data"]], [a["data"][0]["score"] for a in alone], atol=TOL)
    assert sum(len(out["batches"]) for out in outs) == len(spy.shapes)  # every pass reported once


@pytest.fixture(scope="module")
def tok(minilm_dir):
    from pipelines.tokenizers import load_tokenizer

    return load_tokenizer(minilm_dir)
