"""Extractive QA decoding: start/end logits of context windows -> one answer per question.

BERT (Devlin et al. 2019, sec. 4.2): the score of the span from token i to token j is
``S_i + E_j``; the prediction is the best span with ``i <= j``. SQuAD 2.0 (sec. 4.3): the
no-answer score is ``S_0 + E_0`` at the ``[CLS]`` position (``finetune.NO_ANSWER_POSITION``), and
the question is declared unanswerable when ``null_score - best_span_score > null_threshold``
(tuned on the dev set; google-research/bert ``null_score_diff_threshold``, Hugging Face
``utils_qa.postprocess_qa_predictions``).

Unlike the reference code, which only tries the ``n_best_size`` (20) largest starts and ends, the
maximum here is exact: for each span length d < ``max_answer_len`` one vectorised pass over all
windows scores every start i with end i + d, keeping the best (ties: the shorter span, then the
earlier start). Only spans whose both ends are context tokens (``context_offsets >= 0``) count.
A question's windows are merged by taking the best-scoring span of any window; its null score is
the smallest null score of its windows (as the references).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipelines.finetune import NO_ANSWER_POSITION


def best_spans(start_logits: np.ndarray, end_logits: np.ndarray, valid: np.ndarray, max_answer_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per window (F rows): the best (start, end) with ``valid`` ends, ``0 <= end - start < max_answer_len``.

    Returns start (F,), end (F,) int64 and score (F,) float64 (``-inf`` and (-1, -1) where the window
    has no valid span).
    """
    s = np.asarray(start_logits, dtype=np.float64)
    e = np.asarray(end_logits, dtype=np.float64)
    valid = np.asarray(valid, dtype=bool)
    if s.shape != e.shape or s.shape != valid.shape or s.ndim != 2:
        raise ValueError(f"best_spans: start {s.shape}, end {e.shape} and valid {valid.shape} must all be (F, T)")
    n, length = s.shape
    best = np.full(n, -np.inf)
    best_i = np.full(n, -1, dtype=np.int64)
    best_d = np.full(n, -1, dtype=np.int64)
    rows = np.arange(n)
    s_valid = np.where(valid, s, -np.inf)
    for d in range(min(max_answer_len, length)):
        cand = s_valid[:, : length - d] + e[:, d:]  # (F, T - d): span (i, i + d)
        cand[~valid[:, d:]] = -np.inf
        i = np.argmax(cand, axis=1)  # (F,) earliest of the row's best
        score = cand[rows, i]
        better = score > best
        best = np.where(better, score, best)
        best_i = np.where(better, i, best_i)
        best_d = np.where(better, d, best_d)
    end = np.where(best_i >= 0, best_i + best_d, -1)
    return best_i, end, best


def decode_qa(
    start_logits: np.ndarray,
    end_logits: np.ndarray,
    features: dict[str, np.ndarray],
    contexts: Sequence[str],
    max_answer_len: int = 30,
    null_threshold: float | None = None,
) -> list[dict]:
    """One prediction per context (example), merged over its windows.

    ``start_logits``, ``end_logits``: (F, T) per window; ``features``: the QA encoder's
    ``example_index`` (F,) and ``context_offsets`` (F, T, 2) (T may be shorter than the encoder's
    ``max_len`` if the batch was trimmed). ``null_threshold`` None: SQuAD 1.1, always a span.
    A float: SQuAD 2.0, answer "" when ``null_score - score > null_threshold``.

    Returns, for example k = 0..len(contexts)-1, a dict: ``text`` (the answer, "" for no answer),
    ``start``/``end`` (character span in the context, -1 for no answer), ``score`` (best span's
    ``S_i + E_j``, -inf if no window had a context token), ``null_score`` (``min S_0 + E_0``) and
    ``null_score_diff`` (``null_score - score``, what the threshold is compared with).
    """
    if max_answer_len < 1:
        raise ValueError(f"decode_qa: max_answer_len must be >= 1, got {max_answer_len}")
    s = np.asarray(start_logits, dtype=np.float64)
    e = np.asarray(end_logits, dtype=np.float64)
    ex = np.asarray(features["example_index"], dtype=np.int64).reshape(-1)
    offsets = np.asarray(features["context_offsets"], dtype=np.int64)
    n_feat, length = s.shape
    if ex.shape != (n_feat,) or offsets.shape[0] != n_feat or offsets.shape[1] < length:
        raise ValueError(f"decode_qa: logits {s.shape}, example_index {ex.shape} and context_offsets {offsets.shape} disagree")
    offsets = offsets[:, :length]  # (F, T, 2)
    n_ex = len(contexts)
    if n_feat and (ex.min() < 0 or ex.max() >= n_ex):
        raise ValueError(f"decode_qa: example_index holds {int(ex.max())} but there are {n_ex} contexts")

    start, end, score = best_spans(s, e, offsets[:, :, 0] >= 0, max_answer_len)  # (F,) each
    # Best window of each example: sort windows by (example, -score) and take each example's first.
    order = np.lexsort((-score, ex))
    first = np.ones(len(order), dtype=bool)
    first[1:] = ex[order][1:] != ex[order][:-1]
    best_feat = np.full(n_ex, -1, dtype=np.int64)
    best_feat[ex[order][first]] = order[first]
    null = np.full(n_ex, np.inf)
    np.minimum.at(null, ex, s[:, NO_ANSWER_POSITION] + e[:, NO_ANSWER_POSITION])

    predictions = []
    for k in range(n_ex):
        f = best_feat[k]
        span_score = float(score[f]) if f >= 0 else -np.inf
        null_score = float(null[k]) if np.isfinite(null[k]) else float("nan")
        diff = null_score - span_score
        no_answer = span_score == -np.inf or (null_threshold is not None and diff > null_threshold)
        if no_answer:
            c0 = c1 = -1
        else:
            c0, c1 = int(offsets[f, start[f], 0]), int(offsets[f, end[f], 1])
        predictions.append(
            {
                "text": "" if no_answer else contexts[k][c0:c1],
                "start": c0,
                "end": c1,
                "score": span_score,
                "null_score": null_score,
                "null_score_diff": diff,
            }
        )
    return predictions
