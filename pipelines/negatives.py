"""Hard-negative mining for embedding fine-tuning, in NumPy: which texts of a corpus become an
anchor's negatives, given the anchors' and the corpus's vectors (``jobs.training.mining`` computes
them with the model and writes the records).

The rules are sentence-transformers' ``util.mine_hard_negatives`` (its "top" and "random" sampling
strategies; Karpukhin et al. 2020 and Xiong et al. 2021 on why negatives a retriever ranks high
teach it more than random ones, and Moreira et al. 2024, "NV-Retriever", on the margins that keep
unlabelled positives out):

1. Each anchor's candidates are the ``range_max`` + (the most positives an anchor has) corpus
   texts of highest cosine similarity, its own positives (every positive any record pairs it with)
   then left out; ``range_max`` defaults to room for those positives, ``range_min`` and the negatives.
2. A candidate is skipped when ``score + absolute_margin > positive`` or ``score > positive -
   |positive| * relative_margin`` (``positive``: the anchor's lowest positive score: the harder one),
   ``score > max_score`` or ``score < min_score``.
3. Of what is left, the ``range_max`` most similar are kept, the first ``range_min`` of them (the
   most similar: likely unlabelled positives) dropped, and of the rest the ``num_negatives`` best ("top") or a seeded random draw of them
   ("random", best first again).

Candidates are found in blocks of anchors (``top_candidates``), so the (anchors, corpus) score
matrix never exists whole. Shapes: Q anchors, C corpus texts, k candidates kept per anchor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from pipelines.metrics import unit_rows

SCORE_CELLS = 1 << 24  # anchors x corpus scores computed at a time


@dataclass(frozen=True)
class MiningConfig:
    num_negatives: int = 3
    range_min: int = 0  # the most similar candidates skipped (likely positives nobody labelled)
    range_max: int | None = None  # candidates looked at; None: range_min + num_negatives (x10 with a margin or score bound)
    absolute_margin: float | None = None  # a negative scores at least this much below the positive
    relative_margin: float | None = None  # ... at least this fraction of |positive score| below it (0.05: 5 %)
    max_score: float | None = None
    min_score: float | None = None
    sampling: Literal["top", "random"] = "top"
    seed: int = 0  # random sampling

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"{key}={getattr(self, key)!r}: {why}")

        if self.num_negatives < 1:
            raise bad("num_negatives", "mine at least 1 negative per anchor")
        if self.range_min < 0:
            raise bad("range_min", "expected a non-negative rank")
        if self.sampling not in ("top", "random"):
            raise bad("sampling", "expected top or random")
        window = self.window()
        if window <= self.range_min:
            raise bad("range_max", f"must exceed range_min={self.range_min}")
        if self.num_negatives > window - self.range_min:
            raise bad("num_negatives", f"only {window - self.range_min} candidates remain between range_min={self.range_min} "
                                       f"and range_max={window}: lower it or range_min, or raise range_max")

    @property
    def filtered(self) -> bool:
        return any(v is not None for v in (self.absolute_margin, self.relative_margin, self.max_score, self.min_score))

    def window(self, max_positives: int = 0) -> int:
        """Candidates kept per anchor (``range_max``, else sentence-transformers' default for anchors
        of at most ``max_positives`` positives: room for them, ``range_min`` and the negatives, ten
        times the negatives when a margin or score bound may skip some)."""
        if self.range_max is not None:
            return self.range_max
        return self.range_min + self.num_negatives * (10 if self.filtered else 1) + max_positives


def unit(vectors: np.ndarray) -> np.ndarray:
    """float32 rows of unit length (``pipelines.metrics.unit_rows``: zero and non-finite rows 0), so
    dot products are cosines, as the retrieval metrics score them."""
    return unit_rows(np.asarray(vectors, dtype=np.float32))


def top_candidates(anchors: np.ndarray, corpus: np.ndarray, k: int,
                   exclude: list[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` corpus rows of highest cosine similarity to each anchor, best first, leaving out
    ``exclude[q]`` when given (corpus rows): (scores float32 (Q, k), rows int64 (Q, k)), -inf and -1
    where the corpus has fewer than k others."""
    a, c = unit(anchors), unit(corpus)
    Q, C = len(a), len(c)
    take = min(k, C)
    scores = np.full((Q, k), -np.inf, dtype=np.float32)
    rows = np.full((Q, k), -1, dtype=np.int64)
    block = max(1, SCORE_CELLS // max(C, 1))
    for start in range(0, Q, block):
        s = a[start : start + block] @ c.T  # (q, C)
        q = np.repeat(np.arange(len(s)), [len(exclude[start + i]) for i in range(len(s))]) if exclude else ()
        if len(q):
            s[q, np.concatenate(exclude[start : start + len(s)])] = -np.inf
        if take == 0:
            continue
        part = np.argpartition(-s, take - 1, axis=1)[:, :take] if take < C else np.broadcast_to(np.arange(C), s.shape)
        got = np.take_along_axis(s, part, axis=1)  # (q, take)
        order = np.argsort(-got, axis=1, kind="stable")
        scores[start : start + len(s), :take] = np.take_along_axis(got, order, axis=1)
        rows[start : start + len(s), :take] = np.take_along_axis(part, order, axis=1)
    rows[~np.isfinite(scores)] = -1  # excluded positives, or a corpus with fewer than k others
    return scores, rows


def select_negatives(scores: np.ndarray, rows: np.ndarray, positive_scores: np.ndarray,
                     cfg: MiningConfig, keep: int | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Rules 2 and 3 of the module doc on ``top_candidates``' (Q, k) output, ``positive_scores``
    (Q,) each anchor's lowest positive score: (rows int64 (Q, n), scores float32 (Q, n)), best
    first, -1 / -inf where fewer than n candidates qualify; and how many candidates each rule skipped.
    ``keep``: of what qualifies, only the best ``keep`` are ranked on (sentence-transformers' cut
    to ``range_max`` after it looked at ``range_max`` + the most positives an anchor has)."""
    s = np.array(scores, dtype=np.float32, copy=True)
    skipped: dict[str, int] = {}

    def drop(name: str, where: np.ndarray) -> None:
        where &= np.isfinite(s)
        if where.any():
            skipped[name] = int(where.sum())
        s[where] = -np.inf

    pos = np.asarray(positive_scores, dtype=np.float32)[:, None]  # (Q, 1)
    if cfg.absolute_margin is not None:
        drop("absolute_margin", s + cfg.absolute_margin > pos)
    if cfg.relative_margin is not None:
        drop("relative_margin", s > pos - np.abs(pos) * cfg.relative_margin)
    if cfg.max_score is not None:
        drop("max_score", s > cfg.max_score)
    if cfg.min_score is not None:
        drop("min_score", s < cfg.min_score)
    order = np.argsort(-s, axis=1, kind="stable")  # what qualifies first, still best first
    s, r = np.take_along_axis(s, order, axis=1), np.take_along_axis(rows, order, axis=1)
    s, r = s[:, cfg.range_min : keep], r[:, cfg.range_min : keep]  # (Q, keep - range_min)
    n = cfg.num_negatives
    if cfg.sampling == "random":
        # A seeded draw of n among each anchor's qualifying candidates (all of them where fewer qualify).
        options = np.maximum(np.isfinite(s).sum(axis=1), n)  # (Q,)
        keys = np.random.default_rng(cfg.seed).random(s.shape)
        keys[np.arange(s.shape[1])[None, :] >= options[:, None]] = np.inf  # never beyond the qualifying ones
        picked = np.sort(np.argsort(keys, axis=1, kind="stable")[:, :n], axis=1)  # in rank order: best first
        s, r = np.take_along_axis(s, picked, axis=1), np.take_along_axis(r, picked, axis=1)
    s, r = s[:, :n], r[:, :n]
    r = np.where(np.isfinite(s), r, -1)
    return r, s, skipped
