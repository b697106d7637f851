"""How far an embedding space moved between two model versions, from their vectors of the same
probe texts: what the people who keep vector indexes need to decide whether to re-embed.

- ``knn_overlap``: for each probe, the share of its k nearest neighbours (cosine, itself excluded)
  that both versions agree on, averaged over probes. 1.0 = every neighbourhood kept; an index built
  with the old vectors answers queries embedded with the new ones about that well.
- ``linear_cka``: linear centred kernel alignment (Kornblith et al. 2019, "Similarity of Neural
  Network Representations Revisited", eq. 5 in feature space). 1.0 for representations equal up to
  an orthogonal rotation and an isotropic scale; it allows different widths.

Pure NumPy: no torch, no Ray.
"""

from __future__ import annotations

import numpy as np


def _check_pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"expected two (n, d) matrices, got shapes {a.shape} and {b.shape}")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"the two matrices must hold the same probes: {a.shape[0]} rows vs {b.shape[0]}")
    return a, b


def knn_indices(x: np.ndarray, k: int) -> np.ndarray:
    """int64 (n, k): each row's k nearest other rows by cosine similarity, nearest first (ties by
    lower index, so the answer is deterministic)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    if not 1 <= k < n:
        raise ValueError(f"k={k}: need 1 <= k < number of probes ({n})")
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)  # (n, d)
    sim = unit @ unit.T  # (n, n)
    np.fill_diagonal(sim, -np.inf)  # a probe is not its own neighbour
    # Stable sort on -sim keeps lower indices first among equal similarities.
    return np.argsort(-sim, axis=1, kind="stable")[:, :k]  # (n, k)


def knn_overlap(a: np.ndarray, b: np.ndarray, k: int = 10) -> float:
    """Mean over probes of |kNN_a(i) & kNN_b(i)| / k, with ``k`` capped at n - 1."""
    a, b = _check_pair(a, b)
    k = min(k, a.shape[0] - 1)
    na, nb = knn_indices(a, k), knn_indices(b, k)  # (n, k) each
    # (n, k, k) membership test, vectorised over probes
    shared = (na[:, :, None] == nb[:, None, :]).any(axis=2).sum(axis=1)  # (n,)
    return float(shared.mean() / k)


def linear_cka(a: np.ndarray, b: np.ndarray) -> float:
    """||B_c^T A_c||_F^2 / (||A_c^T A_c||_F ||B_c^T B_c||_F) with column-centred A_c, B_c."""
    a, b = _check_pair(a, b)
    a = a - a.mean(axis=0, keepdims=True)  # (n, d_a)
    b = b - b.mean(axis=0, keepdims=True)  # (n, d_b)
    cross = np.linalg.norm(b.T @ a, "fro") ** 2
    norm = np.linalg.norm(a.T @ a, "fro") * np.linalg.norm(b.T @ b, "fro")
    if norm == 0.0:
        raise ValueError("linear CKA is undefined for a representation that is constant across probes")
    return float(cross / norm)


def drift(a: np.ndarray, b: np.ndarray, k: int = 10) -> dict[str, float]:
    """``{"knn_overlap@k": ..., "cka": ...}`` of old vectors ``a`` and new vectors ``b``."""
    return {f"knn_overlap@{min(k, len(a) - 1)}": knn_overlap(a, b, k), "cka": linear_cka(a, b)}
