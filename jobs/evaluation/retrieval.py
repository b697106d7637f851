"""`ctx eval retrieval`: a model's sentence vectors on a retrieval benchmark in the BEIR layout
(``pipelines.retrieval``: corpus, queries, graded judgements), as MTEB's retrieval tasks score them.

The model is any one ``ctx serve`` serves (a checkpoint, a run folder, ``models:/NAME@ALIAS``, a
Hugging Face or sentence-transformers folder), run in this process by ``jobs.serving.local.LocalModel``:
the queries through ``encode_query``, the documents through ``encode_document`` (a folder's query and
document prompts, as sentence-transformers applies them, or the prompts given), each text cut to what
the server reads.
Every query ranks the whole corpus by cosine similarity (``pipelines.negatives.top_candidates``, a
block of queries at a time), and its top 100 are scored against the judgements."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def evaluate_retrieval(model_uri: str, data_uri: str, split: str = "test", store=None, batch_size: int = 32,
                       query_prompt: str | None = None, document_prompt: str | None = None) -> dict[str, Any]:
    """The scores of ``model_uri`` on the benchmark folder ``data_uri``'s ``split`` (module docstring).
    ``query_prompt`` / ``document_prompt``: text put before each query / document instead of the
    folder's prompts ("query: " and "passage: " for E5 models; "" for none)."""
    from jobs.serving.local import LocalModel
    from pipelines.negatives import top_candidates
    from pipelines.retrieval import TOP_K, ranking_metrics, read_beir
    from pipelines.storage import as_store

    bench = read_beir(data_uri, split, as_store(store))
    with LocalModel(model_uri, max_batch_size=batch_size) as model:
        t0 = time.perf_counter()  # the encoding alone, the model's loading left out
        queries = np.asarray(model.encode_query(bench.queries, prompt=query_prompt), dtype=np.float32)
        corpus = np.asarray(model.encode_document(bench.corpus, prompt=document_prompt), dtype=np.float32)
        encoded = time.perf_counter() - t0
        info = model.info
    scores, rows = top_candidates(queries, corpus, TOP_K)
    return {
        "model": model_uri, "model_version": info.get("version"), "data": data_uri, "task": "retrieval", "split": split,
        "examples": len(bench.queries), "corpus": len(bench.corpus),
        "relevant_per_query": round(float(np.mean([len(r) for r in bench.relevant])), 3),
        **{k: v for k, v in (("query_prompt", query_prompt), ("document_prompt", document_prompt)) if v is not None},
        "encode_s": round(encoded, 2),
        "metrics": ranking_metrics(scores, rows, bench.relevant),
    }
