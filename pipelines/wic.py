"""Word-in-context scoring: one cosine threshold that separates "same sense" from "different sense".

The WiC benchmark (Pilehvar & Camacho-Collados 2019, "WiC: the Word-in-Context Dataset for
Evaluating Context-Sensitive Meaning Representations") scores contextual vectors without training
a classifier: the cosine of the target word's two vectors is compared with one threshold, fit on a
development set, and accuracy is measured on held-out pairs. A context-free representation gives
the same vector in both sentences whenever the word form is the same, so it sits near chance; the
distance above that is what context buys.

Pure NumPy: ``cosine_rows`` and ``fit_threshold`` are functions of arrays, nothing else.
"""

from __future__ import annotations

import numpy as np


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of (N, D) and (N, D) -> (N,); a zero vector gives 0."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    num = (a * b).sum(axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def fit_threshold(scores: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """The threshold t maximising the accuracy of ``scores >= t`` -> label 1, and that accuracy.

    Every distinct split of the sorted scores is tried at once (a cumulative count), so it is exact
    and O(N log N). Candidates are the midpoints between neighbouring distinct scores, plus one
    below the minimum (everything positive) and one above the maximum (everything negative); ties
    between equally good thresholds go to the smallest.
    """
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    labels = np.asarray(labels).astype(bool).reshape(-1)
    if scores.shape != labels.shape or scores.size == 0:
        raise ValueError(f"need as many labels as scores, and at least one: got {scores.size} scores, {labels.size} labels")
    order = np.argsort(scores, kind="stable")
    s, y = scores[order], labels[order]
    distinct = np.flatnonzero(np.diff(s) > 0)  # last index of each run of equal scores but the final one
    # A threshold between s[i] and s[i+1] calls s[:i+1] negative and s[i+1:] positive.
    neg_correct = np.cumsum(~y)  # (N,) negatives at or below each index
    pos_total = int(y.sum())
    pos_above = pos_total - np.cumsum(y)  # (N,) positives strictly above each index
    cut_correct = neg_correct[distinct] + pos_above[distinct]
    candidates = np.concatenate([[s[0] - 1.0], (s[distinct] + s[distinct + 1]) / 2.0, [s[-1] + 1.0]])
    correct = np.concatenate([[pos_total], cut_correct, [int((~y).sum())]])
    best = int(np.argmax(correct))
    return float(candidates[best]), float(correct[best] / s.size)


def accuracy_at(scores: np.ndarray, labels: np.ndarray, threshold: float) -> float:
    """Accuracy of ``scores >= threshold`` against 0/1 labels."""
    pred = np.asarray(scores, dtype=np.float64) >= threshold
    return float((pred == np.asarray(labels).astype(bool)).mean())
