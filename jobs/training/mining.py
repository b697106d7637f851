"""`ctx mine-negatives`: hard negatives for an embedding fine-tuning split, mined with a model.

(anchor, positive) records in, the same records out with ``negative``: a list of the texts the
model ranks closest to the anchor that are not its positives, by sentence-transformers'
``util.mine_hard_negatives`` rules (``pipelines.negatives``: candidate window, margins, score
bounds, top or random sampling). What ``ctx finetune`` with ``task.kind: embedding`` then trains on.

The corpus is every positive of the split, plus ``corpus`` texts when given, without duplicates;
an anchor paired with several positives (in several records) has all of them left out of its
candidates. Vectors come from ``jobs.serving.local.LocalModel`` (what ``ctx serve`` answers): the
anchors through ``encode_query``, the corpus through ``encode_document``, so a model with query and
document prompts mines with them, as sentence-transformers does. Records that cannot be read (an
empty text, a field missing) and records left with fewer than ``num_negatives`` negatives are not
written; the report counts both, and how many candidates each rule skipped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pipelines.negatives import MiningConfig, select_negatives, top_candidates, unit


def mine_hard_negatives(records: list[dict[str, Any]], model: Any, cfg: MiningConfig, *, anchor_field: str | None = None,
                        positive_field: str | None = None, negative_field: str = "negative",
                        corpus: list[str] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(records with ``negative_field`` set to their mined negatives, a report). ``model``: a
    ``LocalModel`` (or anything with its ``encode_query`` / ``encode_document``); ``anchor_field`` /
    ``positive_field`` default as the embedding task reads them (anchor/query/..., positive/document/...)."""
    from pipelines.finetune import NEGATIVE_FIELDS, RecordError, TaskDataConfig, check_records, pick_embedding_texts

    data = TaskDataConfig(kind="embedding", text_field=anchor_field, pair_field=positive_field, n_negatives=0)
    # The anchors and positives as the embedding task reads them; negatives the records have are replaced.
    fields = dict.fromkeys(k for r in records for k in r if k not in (*NEGATIVE_FIELDS, negative_field))
    columns = {key: [r.get(key) for r in records] for key in fields}
    bad = {e.index for e in check_records(columns, data)} if records else set()
    good = [i for i in range(len(records)) if i not in bad]
    if not good:
        raise RecordError(-1, anchor_field or "anchor", f"none of the {len(records)} records has an anchor and a positive text")
    texts = pick_embedding_texts({k: [v[i] for i in good] for k, v in columns.items()}, data)
    anchors_of = [t[0] for t in texts]
    positives_of = [t[1] for t in texts]

    docs = list(dict.fromkeys([*(corpus or []), *positives_of]))  # the corpus, each text once
    row_of = {text: i for i, text in enumerate(docs)}
    queries = list(dict.fromkeys(anchors_of))
    query_of = {text: i for i, text in enumerate(queries)}
    pair_query = np.fromiter((query_of[a] for a in anchors_of), dtype=np.int64, count=len(anchors_of))  # (N,)
    pair_doc = np.fromiter((row_of[p] for p in positives_of), dtype=np.int64, count=len(positives_of))  # (N,)

    q_vec = np.asarray(model.encode_query(queries), dtype=np.float32)  # (Q, D)
    d_vec = np.asarray(model.encode_document(docs), dtype=np.float32)  # (C, D)
    q_unit, d_unit = unit(q_vec), unit(d_vec)
    pairs = np.unique(np.stack([pair_query, pair_doc], axis=1), axis=0)  # (P, 2): every positive an anchor is paired with
    own = np.einsum("nd,nd->n", q_unit[pair_query], d_unit[pair_doc])  # (N,) each record's positive score
    lowest = np.full(len(queries), np.inf, dtype=np.float32)
    np.minimum.at(lowest, pair_query, own)  # an anchor's harder positive sets its margins
    # As sentence-transformers looks: the range_max + (most positives) best texts, the anchor's own positives then out.
    most = int(np.bincount(pairs[:, 0]).max())  # the most positives an anchor has
    window = cfg.window(most)
    scores, rows = top_candidates(q_vec, d_vec, window + most)
    width = len(docs) + 1  # (anchor, corpus row) keys; a missing row (-1) never matches one
    own_rows = np.isin(np.arange(len(queries))[:, None] * width + rows, pairs[:, 0] * width + pairs[:, 1])
    scores[own_rows], rows[own_rows] = -np.inf, -1
    chosen, chosen_scores, skipped = select_negatives(scores, rows, lowest, cfg, keep=window)

    out, short = [], 0
    for i, a in zip(good, anchors_of):
        picked = chosen[query_of[a]]
        if (picked < 0).any():  # fewer than num_negatives qualified
            short += 1
            continue
        out.append({**records[i], negative_field: [docs[j] for j in picked]})
    report = {
        "records": len(records), "unreadable": len(bad), "anchors": len(queries), "corpus": len(docs),
        "written": len(out), "too_few_negatives": short, "skipped_candidates": skipped,
        "negative_score_mean": float(chosen_scores[np.isfinite(chosen_scores)].mean()) if np.isfinite(chosen_scores).any() else None,
        "positive_score_mean": float(lowest.mean()), "config": dataclasses.asdict(cfg),
    }
    return out, report
