"""The WiC threshold fit is exact: it equals trying every threshold by brute force."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.wic import accuracy_at, cosine_rows, fit_threshold


def brute_force(scores: np.ndarray, labels: np.ndarray) -> float:
    cands = np.concatenate([[scores.min() - 1], scores, [scores.max() + 1]])
    return max(accuracy_at(scores, labels, t) for t in cands)


@pytest.mark.parametrize("seed", range(20))
def test_fit_threshold_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    scores = np.round(rng.normal(size=n), 1)  # rounding makes ties
    labels = rng.random(n) < 0.5
    t, acc = fit_threshold(scores, labels)
    assert acc == pytest.approx(brute_force(scores, labels))
    assert accuracy_at(scores, labels, t) == pytest.approx(acc)


def test_separable_scores_reach_one() -> None:
    scores = np.array([0.1, 0.2, 0.3, 0.8, 0.9])
    t, acc = fit_threshold(scores, np.array([0, 0, 0, 1, 1]))
    assert acc == 1.0 and 0.3 < t < 0.8


def test_constant_scores_give_the_majority() -> None:
    t, acc = fit_threshold(np.ones(5), np.array([1, 1, 1, 0, 0]))
    assert acc == pytest.approx(0.6) and accuracy_at(np.ones(5), np.array([1, 1, 1, 0, 0]), t) == pytest.approx(0.6)


def test_cosine_rows() -> None:
    a = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    b = np.array([[0.0, 1.0], [2.0, 2.0], [1.0, 0.0]])
    np.testing.assert_allclose(cosine_rows(a, b), [0.0, 1.0, 0.0])


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="as many labels"):
        fit_threshold(np.zeros(3), np.zeros(2))
