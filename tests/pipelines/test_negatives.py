"""pipelines.negatives: candidates are the exact top-k of the cosine matrix without the positives,
and each of sentence-transformers' mining rules (window, margins, score bounds, range_min after
them, top or seeded random sampling) keeps what it says."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines import negatives
from pipelines.negatives import MiningConfig, select_negatives, top_candidates, unit


def test_candidates_are_the_exact_top_k_without_the_positives_in_blocks(monkeypatch):
    rng = np.random.default_rng(0)
    a, c = rng.normal(size=(23, 8)), rng.normal(size=(40, 8))
    exclude = [np.array(sorted(rng.choice(40, size=i % 3, replace=False)), dtype=np.int64) for i in range(23)]
    monkeypatch.setattr(negatives, "SCORE_CELLS", 40 * 5)  # blocks of 5 anchors
    scores, rows = top_candidates(a, c, 7, exclude)
    full = unit(a) @ unit(c).T
    for q in range(23):
        s = full[q].copy()
        s[exclude[q]] = -np.inf
        want = np.argsort(-s, kind="stable")[:7]
        assert rows[q].tolist() == want.tolist()
        np.testing.assert_allclose(scores[q], s[want], rtol=1e-5)
        assert not set(rows[q]) & set(exclude[q].tolist())
    # More candidates asked than the corpus has besides the positives: -1 / -inf fill the rest.
    scores, rows = top_candidates(a[:2], c[:4], 6, [np.array([0, 1]), np.array([], dtype=np.int64)])
    assert rows[0].tolist() == [*rows[0][:2], -1, -1, -1, -1] and sorted(rows[0][:2]) == [2, 3]
    assert (rows[1][:4] >= 0).all() and rows[1][4:].tolist() == [-1, -1] and np.isinf(scores[1][4:]).all()


ROWS = np.array([[10, 11, 12, 13, 14, 15]])
SCORES = np.array([[0.9, 0.8, 0.7, 0.5, 0.3, 0.1]], dtype=np.float32)


@pytest.mark.parametrize("settings, positive, want", [
    ({"num_negatives": 2}, 0.6, [10, 11]),  # top: the best two, even above the positive
    ({"num_negatives": 2, "range_min": 1}, 0.6, [11, 12]),
    ({"num_negatives": 2, "absolute_margin": 0.05}, 0.6, [13, 14]),  # score + 0.05 > 0.6 skipped: 0.9, 0.8, 0.7 (0.5 + 0.05 = 0.55 kept)
    ({"num_negatives": 2, "relative_margin": 0.2}, 0.6, [14, 15]),  # above 0.6 - 0.12 = 0.48 skipped
    ({"num_negatives": 2, "relative_margin": 0.5}, -0.6, []),  # a negative positive score: its threshold is -0.9, nothing below
    ({"num_negatives": 2, "max_score": 0.75, "min_score": 0.2}, 0.6, [12, 13]),
    ({"num_negatives": 2, "max_score": 0.75, "range_min": 1}, 0.6, [13, 14]),  # range_min counts what qualifies
    ({"num_negatives": 3, "min_score": 0.4}, 0.6, [10, 11, 12]),
    ({"num_negatives": 3, "min_score": 0.6}, 0.6, [10, 11, 12]),
    ({"num_negatives": 3, "min_score": 0.75}, 0.6, [10, 11]),  # only two qualify: the third is -1
])
def test_each_rule_keeps_what_it_says(settings, positive, want):
    rows, scores, skipped = select_negatives(SCORES, ROWS, np.array([positive]), MiningConfig(range_max=6, **settings))
    n = settings["num_negatives"]
    assert rows.shape == (1, n) and rows[0].tolist() == want + [-1] * (n - len(want))
    assert np.isinf(scores[0][len(want):]).all() and (np.diff(scores[0][: len(want)]) <= 0).all()
    assert sum(skipped.values()) == sum(1 for s in SCORES[0] if not _qualifies(s, positive, settings))


def _qualifies(s: float, pos: float, st: dict) -> bool:
    return not ((st.get("absolute_margin") is not None and s + st["absolute_margin"] > pos)
                or (st.get("relative_margin") is not None and s > pos - abs(pos) * st["relative_margin"])
                or (st.get("max_score") is not None and s > st["max_score"]) or (st.get("min_score") is not None and s < st["min_score"]))


def test_random_sampling_draws_among_what_qualifies_best_first_and_reproducibly():
    rng = np.random.default_rng(1)
    scores = -np.sort(-rng.random((50, 20)).astype(np.float32), axis=1)
    rows = np.tile(np.arange(20), (50, 1))
    cfg = MiningConfig(num_negatives=4, range_max=20, range_min=2, max_score=0.9, sampling="random", seed=7)
    got, got_scores, _ = select_negatives(scores, rows, np.ones(50), cfg)
    again, _, _ = select_negatives(scores, rows, np.ones(50), cfg)
    assert (got == again).all() and (np.diff(got_scores, axis=1) <= 0).all()
    for q in range(50):
        allowed = [r for r, s in zip(rows[q], scores[q]) if s <= 0.9][2:]  # qualifying, after range_min
        assert set(got[q]) <= set(allowed)
    top, _, _ = select_negatives(scores, rows, np.ones(50), MiningConfig(num_negatives=4, range_max=20, range_min=2, max_score=0.9))
    assert (got != top).any()  # not simply the top ones
    other, _, _ = select_negatives(scores, rows, np.ones(50), MiningConfig(**{**cfg.__dict__, "seed": 8}))
    assert (other != got).any()


def test_settings_that_cannot_mine_are_named():
    with pytest.raises(ValueError, match="num_negatives=0"):
        MiningConfig(num_negatives=0)
    with pytest.raises(ValueError, match="only 2 candidates remain"):
        MiningConfig(num_negatives=3, range_min=8, range_max=10)
    with pytest.raises(ValueError, match="range_max=5: must exceed range_min=5"):
        MiningConfig(range_min=5, range_max=5)
    assert MiningConfig(num_negatives=3).window() == 3 and MiningConfig(num_negatives=3, range_min=2, relative_margin=0.05).window() == 32
    assert MiningConfig(num_negatives=3).window(2) == 5 and MiningConfig(range_max=9).window(2) == 9  # room for an anchor's positives
