"""`ctx eval retrieval` (``jobs.evaluation.retrieval``, ``pipelines.retrieval``): a BEIR-layout
benchmark built from the shipped definitions test split scores all-MiniLM-L6-v2 as
sentence-transformers' InformationRetrievalEvaluator scores it (several relevant documents for some
queries); graded judgements give scikit-learn's nDCG; ties count against the model; a folder that
cannot be read says which file and why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jobs.cli import main
from pipelines.retrieval import BenchmarkError, ranking_metrics, read_beir

REPO = Path(__file__).resolve().parents[3]
DEFINITIONS = REPO / "data/tasks/definitions/test.jsonl"


def write_beir(folder: Path, corpus: dict[str, str], queries: dict[str, str], qrels: list[tuple[str, str, int]], split: str = "test") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": k, "title": "", "text": v}) + "\n" for k, v in corpus.items()))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": v}) + "\n" for k, v in queries.items()))
    (folder / "qrels").mkdir(exist_ok=True)
    (folder / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t{s}\n" for q, d, s in qrels))
    return folder


@pytest.fixture(scope="module")
def definitions(tmp_path_factory):
    """The definitions test split as a benchmark: each question's definition relevant, and for every
    third question its same-topic negative too; one query judged only 0 (never scored)."""
    records = [json.loads(x) for x in DEFINITIONS.read_text().splitlines()]
    texts = list(dict.fromkeys(t for r in records for t in (r["positive"], r["negative"])))
    doc_id = {t: f"d{i}" for i, t in enumerate(texts)}
    queries = {f"q{i}": r["anchor"] for i, r in enumerate(records)}
    qrels = [(f"q{i}", doc_id[r["positive"]], 1) for i, r in enumerate(records)]
    qrels += [(f"q{i}", doc_id[r["negative"]], 1) for i, r in enumerate(records) if i % 3 == 0 and r["negative"] != r["positive"]]
    queries["unjudged"] = "a query nobody judged"
    qrels.append(("unjudged", "d0", 0))
    corpus = {doc_id[t]: t for t in texts}
    folder = write_beir(tmp_path_factory.mktemp("beir") / "definitions", corpus, queries, qrels)
    relevant: dict[str, set[str]] = {}
    for q, d, s in qrels:
        if s > 0:
            relevant.setdefault(q, set()).add(d)
    return folder, corpus, {q: t for q, t in queries.items() if q in relevant}, relevant


def test_ctx_eval_retrieval_equals_sentence_transformers_information_retrieval_evaluator(definitions, minilm_dir, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    folder, corpus, queries, relevant = definitions
    out = tmp_path / "scores.json"
    assert main(["eval", "retrieval", "--model", str(minilm_dir), "--data", str(folder), "--output", str(out)]) == 0
    got = json.loads(out.read_text())
    assert (got["task"], got["split"], got["examples"], got["corpus"]) == ("retrieval", "test", 200, len(corpus))
    assert got["relevant_per_query"] > 1.2 and out.with_suffix(".html").exists()

    evaluator = InformationRetrievalEvaluator(queries, corpus, relevant, precision_recall_at_k=[1, 10, 100], write_csv=False)
    want = evaluator(st.SentenceTransformer(str(minilm_dir), device="cpu"))
    for ours, theirs in [("ndcg_at_10", "ndcg@10"), ("mrr_at_10", "mrr@10"), ("map_at_100", "map@100"), ("recall_at_1", "recall@1"),
                         ("recall_at_10", "recall@10"), ("recall_at_100", "recall@100"), ("precision_at_10", "precision@10")]:
        assert got["metrics"][ours] == pytest.approx(want[f"cosine_{theirs}"], abs=1e-4), ours
    assert 0.3 < got["metrics"]["ndcg_at_10"] < 0.9

    # E5-style prompts, given on the command line: as sentence-transformers' evaluator with the same prompts
    prompted = tmp_path / "prompted.json"
    assert main(["eval", "retrieval", "--model", str(minilm_dir), "--data", str(folder), "--output", str(prompted),
                 "--query-prompt", "query: ", "--document-prompt", "passage: "]) == 0
    plain_ndcg, got = got["metrics"]["ndcg_at_10"], json.loads(prompted.read_text())
    want = InformationRetrievalEvaluator(queries, corpus, relevant, write_csv=False, query_prompt="query: ",
                                         corpus_prompt="passage: ")(st.SentenceTransformer(str(minilm_dir), device="cpu"))
    assert got["query_prompt"] == "query: " and abs(got["metrics"]["ndcg_at_10"] - plain_ndcg) > 1e-3  # the prompts were read
    for ours, theirs in [("ndcg_at_10", "ndcg@10"), ("mrr_at_10", "mrr@10"), ("map_at_100", "map@100")]:
        assert got["metrics"][ours] == pytest.approx(want[f"cosine_{theirs}"], abs=1e-4), ours


def test_graded_judgements_give_scikit_learns_ndcg_and_ties_count_against_the_model():
    from sklearn.metrics import ndcg_score

    rng = np.random.default_rng(0)
    Q, C = 12, 40
    scores = rng.normal(size=(Q, C))
    grades = np.where(rng.random((Q, C)) < 0.15, rng.integers(1, 4, size=(Q, C)), 0)
    grades[grades.sum(axis=1) == 0, 0] = 2  # every query judges something relevant
    relevant = [{int(d): float(g) for d, g in enumerate(row) if g > 0} for row in grades]
    order = np.argsort(-scores, axis=1)
    got = ranking_metrics(np.take_along_axis(scores, order, axis=1), order, relevant)
    assert got["ndcg_at_10"] == pytest.approx(ndcg_score(grades, scores, k=10), abs=1e-9)
    first = [next((i + 1 for i, d in enumerate(row[:10]) if grades[q, d] > 0), None) for q, row in enumerate(order)]
    assert got["mrr_at_10"] == pytest.approx(np.mean([1 / r if r else 0.0 for r in first]))
    # a collapsed model (every score equal) ranks its relevant documents last: the worst scores, never the best
    flat = ranking_metrics(np.zeros((Q, C)), np.tile(np.arange(C), (Q, 1)), relevant)
    assert flat["ndcg_at_10"] == 0.0 and flat["recall_at_1"] == 0.0 and flat["mrr_at_10"] == 0.0


def test_a_benchmark_that_cannot_be_read_says_which_file_and_why(tmp_path):
    good = write_beir(tmp_path / "ok", {"d1": "a", "d2": "b"}, {"q1": "x"}, [("q1", "d1", 1)])
    assert read_beir(str(good)).relevant == [{0: 1.0}]
    for name, change, match in [
        ("nosplit", lambda f: (f / "qrels" / "test.tsv").unlink(), r"qrels/test.tsv: not found"),
        ("badjson", lambda f: (f / "corpus.jsonl").write_text('{"_id": "d1", "text": "a"}\n{oops\n'), r"corpus.jsonl:2: not valid JSON"),
        ("notext", lambda f: (f / "queries.jsonl").write_text('{"_id": "q1"}\n'), r"queries.jsonl:1: expected an object"),
        ("unknown", lambda f: (f / "qrels" / "test.tsv").write_text("q1\td9\t1\n"), r"test.tsv:1: document 'd9' is not in corpus.jsonl"),
        ("cells", lambda f: (f / "qrels" / "test.tsv").write_text("q1 d1 1\n"), r"separated by tabs"),
        ("unjudged", lambda f: (f / "qrels" / "test.tsv").write_text("q1\td1\t0\n"), r"no query of queries.jsonl is judged"),
    ]:
        folder = write_beir(tmp_path / name, {"d1": "a", "d2": "b"}, {"q1": "x"}, [("q1", "d1", 1)])
        change(folder)
        with pytest.raises(BenchmarkError, match=match):
            read_beir(str(folder))
    assert main(["eval", "retrieval", "--model", "unused", "--data", str(tmp_path / "nosplit")]) != 0  # said, not a traceback


def test_a_benchmark_on_s3_reads_as_the_same_folder_locally(tmp_path, s3_bucket):
    from pipelines import storage

    local = write_beir(tmp_path / "b", {"d1": "a cat", "d2": "a dog", "d3": "a bird"}, {"q1": "cats", "q2": "dogs"},
                       [("q1", "d1", 2), ("q2", "d2", 1), ("q2", "d3", 1)], split="dev")
    storage.Store().copy_dir(local, f"s3://{s3_bucket}/beir")
    remote = read_beir(f"s3://{s3_bucket}/beir/", "dev")
    assert remote == read_beir(str(local), "dev") and remote.relevant == [{0: 2.0}, {1: 1.0, 2: 1.0}]
