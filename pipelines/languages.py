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


# ---------------------------------------------------------------------------------------------
# Translation language modelling (TLM, sec. 3.3): a sentence and its translation in one row, each
# with its own language and positions counted from its own start, masked as MLM; a masked word of
# one language can then be read off its translation.

STREAM_SWAP = 0x54534B  # the keyed stream of which sentence of a pair comes first ("TSK")


def translation_lengths(len_a: np.ndarray, len_b: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Lengths (N,), (N,) of two sentences cut to fit ``budget`` tokens together, longest first:
    a sentence shorter than half keeps all of its tokens, else each gets half (BERT's pair rule,
    cutting at the end)."""
    la, lb = np.asarray(len_a, dtype=np.int64), np.asarray(len_b, dtype=np.int64)
    over = la + lb > budget
    half = budget // 2
    a_cap = np.where(lb >= budget - half, half, budget - lb)  # b long: a gets half; else what b leaves
    a = np.where(over, np.minimum(la, np.maximum(a_cap, budget - lb)), la)
    b = np.where(over, np.minimum(lb, budget - a), lb)
    return a, b


def tlm_rows(
    pairs: list[tuple[int, np.ndarray, int, np.ndarray]], seq_len: int, seed: int, epoch: int, sample_ids: np.ndarray,
    cls_id: int, sep_id: int, pad_id: int,
) -> dict[str, np.ndarray]:
    """Rows ``[CLS] a [SEP] [CLS] b [SEP]`` of translation pairs ``(lang, ids, lang, ids)``: as XLM
    wraps each sentence in ``</s>``, each half starts at position 0 with its own ``[CLS]``, and
    ``token_type_ids`` holds each half's language. Which sentence comes first is a keyed coin per
    sample (XLM trains both directions). int64 (N, seq_len) ``input_ids``, ``attention_mask``,
    ``token_type_ids``, ``position_ids`` (0 at padding), plus ``sample_id`` and ``epoch`` (N,)."""
    n = len(pairs)
    if seq_len < 6:
        raise ValueError(f"a translation row needs seq_len >= 6 (two [CLS] ... [SEP] halves), got {seq_len}")
    sample_ids = np.asarray(sample_ids, dtype=np.int64)
    swap = keyed_uniform(seed, epoch, sample_ids, 1, STREAM_SWAP)[:, 0] < 0.5  # (N,)
    first = [(p[2], p[3], p[0], p[1]) if s else p for p, s in zip(pairs, swap)]
    len_a, len_b = translation_lengths([len(p[1]) for p in first], [len(p[3]) for p in first], seq_len - 4)
    input_ids = np.full((n, seq_len), pad_id, dtype=np.int64)  # (N, T)
    for k, (_, a, _, b) in enumerate(first):  # one copy per half; the columns below are vectorised
        la, lb = int(len_a[k]), int(len_b[k])
        input_ids[k, 1 : 1 + la] = a[:la]
        input_ids[k, 3 + la : 3 + la + lb] = b[:lb]
    col = np.arange(seq_len)[None, :]  # (1, T)
    second = (2 + len_a)[:, None]  # (N, 1): where the second half's [CLS] sits
    end = (4 + len_a + len_b)[:, None]  # (N, 1): one past the last [SEP]
    rows = np.arange(n)
    input_ids[rows, 0] = input_ids[rows, 2 + len_a] = cls_id
    input_ids[rows, 1 + len_a] = input_ids[rows, 3 + len_a + len_b] = sep_id
    real = col < end  # (N, T)
    langs = np.where(col < second, np.array([p[0] for p in first])[:, None], np.array([p[2] for p in first])[:, None])
    positions = np.where(col < second, col, col - second)  # (N, T): each half from 0
    return {
        "input_ids": input_ids,
        "attention_mask": real.astype(np.int64),
        "token_type_ids": np.where(real, langs, 0).astype(np.int64),
        "position_ids": np.where(real, positions, 0).astype(np.int64),
        "sample_id": sample_ids,
        "epoch": np.full(n, int(epoch), dtype=np.int64),
    }
