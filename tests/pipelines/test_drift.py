import numpy as np
import pytest

from pipelines.drift import drift, knn_indices, knn_overlap, linear_cka


def _hsic_cka(a: np.ndarray, b: np.ndarray) -> float:
    """CKA in its kernel (HSIC) form: HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L)) with linear kernels and
    the centring matrix H = I - 11^T/n (Kornblith et al. 2019, eq. 3-4): independent of linear_cka's
    feature-space formula."""
    n = a.shape[0]
    h = np.eye(n) - np.ones((n, n)) / n
    k, l = a @ a.T, b @ b.T

    def hsic(x, y):
        return np.trace(x @ h @ y @ h) / (n - 1) ** 2

    return hsic(k, l) / np.sqrt(hsic(k, k) * hsic(l, l))


def test_cka_is_one_for_identical_rotated_and_scaled():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(50, 16))
    q, _ = np.linalg.qr(rng.normal(size=(16, 16)))  # a random orthogonal matrix
    assert linear_cka(a, a) == pytest.approx(1.0)
    assert linear_cka(a, a @ q) == pytest.approx(1.0)
    assert linear_cka(a, 7.5 * a @ q + 3.0) == pytest.approx(1.0)  # isotropic scale and a shift


def test_cka_matches_the_hsic_form_and_drops_for_unrelated_vectors():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(40, 8)), rng.normal(size=(40, 12))
    assert linear_cka(a, b) == pytest.approx(_hsic_cka(a, b), rel=1e-10)
    assert linear_cka(a, b) < 0.6
    # not invariant to an anisotropic scale: stretching one axis changes it
    stretched = a * np.array([10.0] + [1.0] * 7)
    assert linear_cka(a, stretched) < 0.99
    assert linear_cka(a, stretched) == pytest.approx(_hsic_cka(a, stretched), rel=1e-10)


def test_knn_known_small_case():
    # four points on a line (as 2-d vectors with cosine): angles 0, 10, 80, 90 degrees
    angles = np.deg2rad([0, 10, 80, 90])
    x = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    assert knn_indices(x, 1).ravel().tolist() == [1, 0, 3, 2]
    # swap which points are close: 0 and 2 at 0/10 degrees, 1 and 3 at 80/90
    y = x[[0, 2, 1, 3]]
    # neighbours in y: 0<->2, 1<->3; in x: 0<->1, 2<->3: no probe keeps its nearest neighbour
    assert knn_overlap(x, y, k=1) == 0.0
    assert knn_overlap(x, x, k=1) == 1.0
    # k=2 of 3 others: x's pairs {1,2},{0,2},{3,1},{2,1}; y's {2,1},{3,2},{0,1},{1,2}: 2+1+1+2 of 8
    assert knn_overlap(x, y, k=2) == pytest.approx(0.75)


def test_knn_overlap_invariant_to_scale_of_rows_and_k_capped():
    rng = np.random.default_rng(2)
    a = rng.normal(size=(12, 5))
    assert knn_overlap(a, a * rng.uniform(0.5, 3.0, size=(12, 1)), k=10) == 1.0  # cosine ignores row norms
    out = drift(a, a, k=50)
    assert out == {"knn_overlap@11": 1.0, "cka": pytest.approx(1.0)}


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="same probes"):
        linear_cka(np.ones((3, 2)), np.ones((4, 2)))
    with pytest.raises(ValueError, match="constant"):
        linear_cka(np.ones((3, 2)), np.random.default_rng(0).normal(size=(3, 2)))
