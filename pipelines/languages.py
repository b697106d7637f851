"""XLM's multilingual sampling (Lample & Conneau 2019, sec. 3.1), as pure functions of the data.

XLM trains one model on many languages whose corpora differ in size by orders of magnitude. It
draws sentences of language i with probability

    q_i = p_i^alpha / sum_j p_j^alpha,        p_i = n_i / sum_k n_k            (alpha = 0.5 in the paper)

so small languages are seen more often than their share (p_i) and large ones less; alpha = 1 is
the data as it is. Each language gets an id (its embedding row; ``token_type_ids`` of its rows).

Here a stream reads every shard once per epoch, so ``q`` is reached by keeping a fraction
``keep_i = (q_i / p_i) / max_j (q_j / p_j)`` of each language's rows, chosen anew every epoch:
the language with the largest ratio (the smallest one, for alpha < 1) keeps every row, the others
a share that makes their proportions q. Which rows stay is a keyed draw of
``(seed, epoch, sample_id)``, like every other random choice of the data (``pipelines.rng``), so
it does not depend on workers or order, a resumed run keeps the same rows, and another epoch
keeps others. Sizes are what the corpus stores (bytes of each language's shards): a measure known
before any shard is read, and in proportion to sentences for text of one kind.

The proportions hold over an epoch, not within each batch: the stream reads whole shards (in an
order keyed by seed and epoch, ``data.tokenize_actors`` of them at a time), so batches mix
languages as their shards interleave. XLM's own trainer goes further the other way (one language
per batch). Give each language many shards, so that every stretch of the stream sees them all.
"""

from __future__ import annotations

import numpy as np

from pipelines.rng import keyed_uniform

STREAM_LANG = 0x4C414E47  # the keyed stream of the keep draws ("LANG")


def sampling_probs(sizes: np.ndarray | list[float], alpha: float) -> np.ndarray:
    """XLM's q (L,) for languages of ``sizes`` (L,), any positive unit, and exponent ``alpha`` in (0, 1]."""
    n = np.asarray(sizes, dtype=np.float64)
    if n.ndim != 1 or n.size == 0 or not np.all(n > 0):
        raise ValueError(f"language sizes must be a non-empty list of positive numbers, got {n.tolist()}")
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    w = (n / n.sum()) ** alpha
    return w / w.sum()


def keep_fractions(sizes: np.ndarray | list[float], alpha: float) -> np.ndarray:
    """The share (L,) of each language's rows an epoch keeps, so that the kept rows follow
    ``sampling_probs``: 1 for the language most under-represented, below 1 for the others."""
    n = np.asarray(sizes, dtype=np.float64)
    ratio = sampling_probs(n, alpha) / (n / n.sum())  # (L,) q_i / p_i
    return ratio / ratio.max()


def kept_rows(seed: int, epoch: int, sample_ids: np.ndarray, keep: float) -> np.ndarray:
    """bool (N,): which rows of one language (share ``keep``) an epoch trains on."""
    if keep >= 1.0:
        return np.ones(len(sample_ids), dtype=bool)
    return keyed_uniform(seed, epoch, np.asarray(sample_ids, dtype=np.int64), 1, STREAM_LANG)[:, 0] < keep
