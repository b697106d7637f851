"""Retrieval benchmarks in the BEIR layout (the layout of MTEB's retrieval tasks), and the metrics of
a ranking against graded relevance judgements.

A benchmark folder (local or ``s3://``) holds::

    corpus.jsonl         {"_id", "title" (optional), "text"} per document
    queries.jsonl        {"_id", "text"} per query
    qrels/<split>.tsv    query-id <TAB> corpus-id <TAB> score, after a header line; score > 0: relevant

A document is read as its title and text joined by a space, as MTEB reads it. Only the queries the
split's qrels judge relevant to something are scored (BEIR's and MTEB's rule).

``ranking_metrics`` scores each query's ranked documents (best first) with MTEB's names:
``ndcg_at_10`` (gain = the qrels score, discount log2(rank + 1), against the ideal ordering of the
query's judged documents), ``mrr_at_10``, ``map_at_100`` (precision at each relevant hit, over
min(relevant, 100): sentence-transformers' InformationRetrievalEvaluator), ``recall_at_k`` (the share
of the relevant documents in the top k) and ``precision_at_k``. With binary judgements these equal
sentence-transformers' InformationRetrievalEvaluator's. Documents of equal score are ranked with the
relevant ones last, so ties count against the model (a collapsed model scores worst), as
``pipelines.metrics.retrieval_ranks`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipelines import storage
from pipelines.sources import json_lines

CUTOFFS = (1, 10, 100)
TOP_K = 100  # the documents each query ranks: the deepest cutoff of the metrics (map_at_100, recall_at_100)
# What ranking_metrics returns for rankings of 100 or more documents (MTEB's names).
RETRIEVAL_METRICS = ("ndcg_at_10", "mrr_at_10", "map_at_100", *(f"{m}_at_{c}" for m in ("recall", "precision") for c in CUTOFFS))


class BenchmarkError(ValueError):
    """A benchmark folder that cannot be read: the file and what is wrong with it."""


@dataclass
class RetrievalSplit:
    corpus_ids: list[str]
    corpus: list[str]  # title and text, as MTEB joins them
    query_ids: list[str]  # the judged queries only, in queries.jsonl order
    queries: list[str]
    relevant: list[dict[int, float]] = field(default_factory=list)  # per query: corpus row -> score (> 0)


def _jsonl(store: storage.Store, uri: str) -> list[dict]:
    data = store.read_bytes(uri, missing_ok=True)
    if data is None:
        raise BenchmarkError(f"{uri}: not found (a BEIR folder holds corpus.jsonl, queries.jsonl and qrels/<split>.tsv)")
    out = []
    for n, row in json_lines(data, uri, BenchmarkError):
        if "_id" not in row or not isinstance(row.get("text"), str):
            raise BenchmarkError(f"{uri}:{n}: expected an object with \"_id\" and a \"text\" string")
        out.append(row)
    return out


def read_beir(folder: str, split: str = "test", store: storage.Store | None = None) -> RetrievalSplit:
    """The documents, the judged queries and their relevant documents of ``folder``'s ``split``."""
    store = store or storage.Store()
    base = folder.rstrip("/")
    docs = _jsonl(store, f"{base}/corpus.jsonl")
    corpus_ids = [str(d["_id"]) for d in docs]
    row_of = {doc_id: i for i, doc_id in enumerate(corpus_ids)}
    if len(row_of) != len(corpus_ids):
        raise BenchmarkError(f"{base}/corpus.jsonl: document ids repeat")
    qrels_uri = f"{base}/qrels/{split}.tsv"
    data = store.read_bytes(qrels_uri, missing_ok=True)
    if data is None:
        raise BenchmarkError(f"{qrels_uri}: not found (the split's judgements: query-id, corpus-id, score)")
    judged: dict[str, dict[int, float]] = {}
    for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
        cells = line.rstrip("\r").split("\t")
        if not line.strip() or (n == 1 and cells[-1].strip().lower() == "score"):
            continue
        if len(cells) != 3:
            raise BenchmarkError(f"{qrels_uri}:{n}: expected query-id, corpus-id and score separated by tabs")
        try:
            score = float(cells[2])
        except ValueError:
            raise BenchmarkError(f"{qrels_uri}:{n}: score {cells[2]!r} is not a number") from None
        if cells[1] not in row_of:
            raise BenchmarkError(f"{qrels_uri}:{n}: document {cells[1]!r} is not in corpus.jsonl")
        if score > 0:
            judged.setdefault(cells[0], {})[row_of[cells[1]]] = score
    queries = [q for q in _jsonl(store, f"{base}/queries.jsonl") if str(q["_id"]) in judged]
    if not queries:
        raise BenchmarkError(f"{qrels_uri}: no query of queries.jsonl is judged relevant to a document")
    return RetrievalSplit(
        corpus_ids=corpus_ids,
        corpus=[(str(d.get("title") or "") + " " + d["text"]).strip() for d in docs],
        query_ids=[str(q["_id"]) for q in queries],
        queries=[q["text"] for q in queries],
        relevant=[judged[str(q["_id"])] for q in queries],
    )


def ranking_metrics(scores: np.ndarray, rows: np.ndarray, relevant: list[dict[int, float]]) -> dict[str, float]:
    """The module docstring's metrics, averaged over queries. ``scores`` float (Q, k) and ``rows``
    int (Q, k): each query's k best documents, best first (-1 where the corpus has fewer; k >= 100
    for ``map_at_100`` and ``recall_at_100`` to mean what they say); ``relevant``: per query, corpus
    row -> graded relevance (> 0)."""
    scores, rows = np.asarray(scores, dtype=np.float64), np.asarray(rows, dtype=np.int64)
    if scores.shape != rows.shape or scores.ndim != 2 or len(rows) != len(relevant):
        raise ValueError(f"ranking metrics: scores {scores.shape} and rows {rows.shape} must be (Q, k) for {len(relevant)} queries")
    Q, k = rows.shape
    gain = np.array([[rel.get(int(r), 0.0) for r in row] for row, rel in zip(rows, relevant)])  # (Q, k)
    gain[rows < 0] = 0.0
    order = np.lexsort((gain > 0, -scores), axis=-1)  # by score, then relevant ones last among equals
    gain = np.take_along_axis(gain, order, axis=1)
    hit = gain > 0
    n_rel = np.array([len(rel) for rel in relevant], dtype=np.float64)  # (Q,)
    rank = np.arange(1, k + 1, dtype=np.float64)
    discount = 1.0 / np.log2(rank + 1)
    out: dict[str, float] = {}
    top = min(10, k)
    ideal = np.array([np.sort(np.fromiter(rel.values(), float))[::-1][:top] @ discount[: min(top, len(rel))] for rel in relevant])
    out["ndcg_at_10"] = float(np.mean((gain[:, :top] @ discount[:top]) / ideal))
    first = np.where(hit[:, :top].any(axis=1), hit[:, :top].argmax(axis=1) + 1, 0)
    out["mrr_at_10"] = float(np.mean(np.where(first > 0, 1.0 / np.maximum(first, 1), 0.0)))
    cut = min(100, k)
    precision_at = np.cumsum(hit[:, :cut], axis=1) / rank[:cut]
    out["map_at_100"] = float(np.mean((precision_at * hit[:, :cut]).sum(axis=1) / np.minimum(n_rel, 100)))
    for c in CUTOFFS:
        if c <= k:
            found = hit[:, :c].sum(axis=1)
            out[f"recall_at_{c}"] = float(np.mean(found / n_rel))
            out[f"precision_at_{c}"] = float(np.mean(found / c))
    return out
