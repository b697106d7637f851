"""`ctx mine-negatives` (jobs.training.mining): the corpus is the split's positives (plus given texts)
once each, an anchor's every positive stays out of its negatives, unreadable records and records left
short are counted and not written; with the real all-MiniLM-L6-v2 the negatives are the texts it
ranks closest, and the written split trains (``ctx finetune`` reads its negative lists)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jobs.training.mining import mine_hard_negatives
from pipelines.negatives import MiningConfig

REPO = Path(__file__).resolve().parents[3]


class Vectors:
    """A stand-in model: each text's vector given by a table (queries and documents alike)."""

    def __init__(self, table: dict[str, list[float]]):
        self.table = table
        self.asked: dict[str, list[str]] = {}

    def encode_query(self, texts):
        self.asked["query"] = list(texts)
        return np.array([self.table[t] for t in texts])

    def encode_document(self, texts):
        self.asked["document"] = list(texts)
        return np.array([self.table[t] for t in texts])


def test_the_corpus_positives_duplicates_and_bad_records():
    table = {"q1": [1, 0, 0], "q2": [0, 1, 0], "p1": [0.9, 0.1, 0], "p1b": [0.95, 0, 0.05], "p2": [0, 1, 0.1],
             "near1": [0.8, 0.3, 0], "near2": [0.1, 0.8, 0.3], "far": [0, 0, 1]}
    records = [
        {"anchor": "q1", "positive": "p1", "negative": "old"},  # an existing negative is replaced
        {"anchor": "q1", "positive": "p1b"},  # q1's second positive: never q1's negative
        {"anchor": "q2", "positive": "p2"},
        {"anchor": "", "positive": "p2"},  # unreadable
        {"anchor": "q2", "positive": 7},  # unreadable
    ]
    model = Vectors(table)
    out, report = mine_hard_negatives(records, model, MiningConfig(num_negatives=2), corpus=["near1", "near2", "far", "p1"])
    assert model.asked["query"] == ["q1", "q2"] and model.asked["document"] == ["near1", "near2", "far", "p1", "p1b", "p2"]
    assert [r["anchor"] for r in out] == ["q1", "q1", "q2"]
    assert out[0]["negative"] == out[1]["negative"] == ["near1", "near2"]  # p1 and p1b (closer) are both q1's positives
    assert out[2]["negative"] == ["near2", "near1"] and out[2]["positive"] == "p2"
    assert report["records"] == 5 and report["unreadable"] == 2 and report["written"] == 3 and report["corpus"] == 6
    # A margin that leaves only 2 candidates 0.9 below each anchor's positive: no record has 3, none is written.
    out, report = mine_hard_negatives(records, model, MiningConfig(num_negatives=3, absolute_margin=0.9, range_max=5),
                                      corpus=["near1", "near2", "far"])
    assert out == [] and report["too_few_negatives"] == 3 and report["skipped_candidates"]["absolute_margin"] > 0
    out, report = mine_hard_negatives(records, model, MiningConfig(num_negatives=2, absolute_margin=0.9, range_max=5),
                                      corpus=["near1", "near2", "far"])
    assert [r["negative"] for r in out] == [["far", "p2"], ["far", "p2"], ["far", "p1b"]]


@pytest.fixture(scope="module")
def pairs() -> list[dict]:
    records = [json.loads(line) for line in (REPO / "data/tasks/definitions/train.jsonl").read_text().splitlines()[:120]]
    return [{"id": r["id"], "anchor": r["anchor"], "positive": r["positive"]} for r in records]


def test_minilm_negatives_are_the_texts_it_ranks_closest_besides_the_positive(minilm_dir, pairs):
    st = pytest.importorskip("sentence_transformers")
    from jobs.serving.local import LocalModel

    with LocalModel(str(minilm_dir)) as model:
        out, report = mine_hard_negatives(pairs, model, MiningConfig(num_negatives=3))
    assert report["written"] == len(pairs) == len(out)
    reference = st.SentenceTransformer(str(minilm_dir), device="cpu")
    corpus = list(dict.fromkeys(r["positive"] for r in pairs))
    scores = reference.encode([r["anchor"] for r in pairs], normalize_embeddings=True) @ reference.encode(corpus, normalize_embeddings=True).T
    positives_of: dict[str, set[str]] = {}
    for r in pairs:  # an anchor asked twice ("What does burn mean?" of two synsets) has two positives
        positives_of.setdefault(r["anchor"], set()).add(r["positive"])
    assert any(len(p) > 1 for p in positives_of.values())
    for r, s in zip(out, scores):
        ranked = [corpus[j] for j in np.argsort(-s, kind="stable") if corpus[j] not in positives_of[r["anchor"]]]
        assert r["negative"] == ranked[:3]


@pytest.mark.parametrize("settings", [
    {"num_negatives": 2},
    {"num_negatives": 2, "range_min": 1, "relative_margin": 0.05},  # NV-Retriever's margin
    {"num_negatives": 3, "absolute_margin": 0.1, "max_score": 0.9},
    {"num_negatives": 2, "range_max": 12, "min_score": 0.2},
], ids=["top", "relative", "absolute", "bounded"])
def test_the_negatives_are_sentence_transformers_mine_hard_negatives(minilm_dir, pairs, settings):
    """The same records written, with the same negatives in the same order, as sentence-transformers'
    util.mine_hard_negatives (its n-tuple output) with the same settings on the same model."""
    st = pytest.importorskip("sentence_transformers")
    datasets = pytest.importorskip("datasets")
    from sentence_transformers.util import mine_hard_negatives as reference_mining

    from jobs.serving.local import LocalModel

    texts = [{"anchor": r["anchor"], "positive": r["positive"]} for r in pairs]
    with LocalModel(str(minilm_dir)) as model:
        out, _ = mine_hard_negatives(texts, model, MiningConfig(**settings))
    theirs = reference_mining(datasets.Dataset.from_list(texts), st.SentenceTransformer(str(minilm_dir), device="cpu"),
                              output_format="n-tuple", sampling_strategy="top", verbose=False, **settings)
    n = settings["num_negatives"]
    want = [(r["anchor"], r["positive"], [r[f"negative_{i + 1}"] for i in range(n)]) for r in theirs]
    assert sorted((r["anchor"], r["positive"], r["negative"]) for r in out) == sorted(want)
    if "relative_margin" in settings or "absolute_margin" in settings:
        assert len(out) < len(texts)  # the margins did leave some anchors short: the rule was exercised


@pytest.mark.slow  # Ray Data reads the split, MiniLM mines, ctx finetune's record check reads the result
def test_ctx_mine_negatives_writes_a_split_the_embedding_task_reads(ray_session, minilm_dir, pairs, tmp_path):
    from jobs.cli import main
    from pipelines import finetune_stream as fs
    from pipelines.dataset import tokenizer_files
    from pipelines.finetune import TaskDataConfig

    data, output = tmp_path / "pairs.jsonl", tmp_path / "mined" / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs) + "not json\n")
    assert main(["mine-negatives", "--model", str(minilm_dir), "--data", str(data), "--output", str(output),
                 "--num-negatives", "2", "--range-min", "1", "--relative-margin", "0.05", "--range-max", "30"]) == 0
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert 0 < len(written) <= len(pairs) and all(len(r["negative"]) == 2 and r["positive"] not in r["negative"] for r in written)
    check = fs.check_split(fs.read_split(str(output)), tokenizer_files(minilm_dir), TaskDataConfig(kind="embedding", max_len=64))
    assert len(check.usable) == len(written)
    with pytest.raises(SystemExit):  # argparse: a bad choice is named
        main(["mine-negatives", "--model", str(minilm_dir), "--data", str(data), "--output", str(output), "--sampling", "best"])
