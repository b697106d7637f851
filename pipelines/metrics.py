"""Fine-tuning metrics in NumPy, equal to the references the papers report with.

* GLUE (Wang et al. 2019): accuracy, macro-F1 (``sklearn.metrics.f1_score(average="macro")``),
  Matthews correlation (CoLA; ``sklearn.metrics.matthews_corrcoef``), Pearson and Spearman
  correlation (STS-B; ``scipy.stats.pearsonr`` / ``spearmanr``, ties ranked by their average).
* NER (CoNLL-2003, Tjong Kim Sang & De Meulder 2003): entity-level precision, recall and F1 with
  ``seqeval``'s span semantics. Default mode is conlleval's (``seqeval.metrics.f1_score(y_true,
  y_pred)``: a type change or ``I-`` after ``O`` starts an entity); ``scheme="IOB2" | "IOE2" |
  "IOBES" | "BILOU"`` is seqeval's strict mode (``mode="strict", scheme=IOB2``: only well-formed
  spans count; an invalid prefix for the scheme raises ValueError, as seqeval).
* SQuAD (Rajpurkar et al. 2016, 2018): exact match and token F1 after the official scripts'
  normalisation (lowercase, drop punctuation, drop the articles a/an/the, collapse whitespace),
  max over the gold answers; SQuAD 2.0's ``HasAns``/``NoAns`` split, where an unanswerable question
  has the gold answer "" (``evaluate-v2.0.py``). SQuAD scores are percentages (0-100), as the
  official scripts print them; every other metric is a fraction.
* Retrieval (sentence embeddings): MTEB's ``ndcg_at_10``, ``mrr_at_10``, ``map_at_100``,
  ``recall_at_1``, ``recall_at_10`` (Muennighoff et al. 2023) by cosine similarity, as
  sentence-transformers' ``InformationRetrievalEvaluator.compute_metrics`` computes them for a query
  with one relevant document; the anchors are the queries, their positives and negatives the corpus.

Argument order is ``(predictions, references)`` everywhere, as ``task_metrics`` and Hugging Face
``evaluate`` (sklearn's is ``(y_true, y_pred)``). Degenerate inputs follow the references:
MCC is 0 when either side is constant (sklearn); Pearson and Spearman are ``nan`` when either side
is constant (scipy; a correlation is undefined then, and we do not pretend it is 0); precision,
recall and F1 are 0 where their denominator is 0 (sklearn's and seqeval's ``zero_division``
default); empty inputs raise ValueError (sklearn), except the entity metrics (seqeval gives 0).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# ------------------------------------------------------------------------------ classification


def _pair(predictions: Any, references: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    p, r = np.asarray(predictions).reshape(-1), np.asarray(references).reshape(-1)
    if p.shape != r.shape:
        raise ValueError(f"{what}: {p.size} predictions but {r.size} references")
    if p.size == 0:
        raise ValueError(f"{what}: no examples")
    return p, r


def accuracy(predictions: Any, references: Any) -> float:
    p, r = _pair(predictions, references, "accuracy")
    return float(np.mean(p == r))


def confusion_matrix(predictions: Any, references: Any, labels: Sequence | None = None) -> np.ndarray:
    """int64 (K, K): row = reference label, column = predicted label (sklearn's layout), over
    ``labels`` (default: the sorted labels seen on either side); other labels are not counted."""
    p, r = _pair(predictions, references, "confusion_matrix")
    labels = np.unique(np.concatenate([p, r])) if labels is None else np.asarray(labels)
    k = len(labels)
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]

    def index(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = np.clip(np.searchsorted(sorted_labels, x), 0, max(k - 1, 0))
        return order[pos] if k else pos, (sorted_labels[pos] == x) if k else np.zeros(len(x), bool)

    pi, p_ok = index(p)
    ri, r_ok = index(r)
    ok = p_ok & r_ok
    return np.bincount(ri[ok] * k + pi[ok], minlength=k * k).reshape(k, k).astype(np.int64)


def _per_class_f1(cm: np.ndarray) -> np.ndarray:
    tp = np.diag(cm).astype(np.float64)
    denom = cm.sum(axis=0) + cm.sum(axis=1)  # 2 tp + fp + fn
    return np.divide(2 * tp, denom, out=np.zeros_like(tp), where=denom > 0)


def macro_f1(predictions: Any, references: Any, labels: Sequence | None = None) -> float:
    """Unweighted mean of the per-class F1 over ``labels`` (default: every label on either side)."""
    return float(np.mean(_per_class_f1(confusion_matrix(predictions, references, labels))))


def matthews_corrcoef(predictions: Any, references: Any) -> float:
    """Multi-class MCC (Gorodkin 2004) from the confusion matrix, as sklearn; 0 if undefined."""
    cm = confusion_matrix(predictions, references).astype(np.float64)
    t_sum, p_sum = cm.sum(axis=1), cm.sum(axis=0)
    n_correct, n = np.trace(cm), p_sum.sum()
    cov_ytyp = n_correct * n - np.dot(t_sum, p_sum)
    cov_ypyp = n**2 - np.dot(p_sum, p_sum)
    cov_ytyt = n**2 - np.dot(t_sum, t_sum)
    if cov_ypyp * cov_ytyt == 0:
        return 0.0
    return float(cov_ytyp / np.sqrt(cov_ytyt * cov_ypyp))


def pearson(predictions: Any, references: Any) -> float:
    """Pearson's r, computed as scipy.stats.pearsonr; nan if either side is constant."""
    x, y = _pair(predictions, references, "pearson")
    if x.size < 2:
        raise ValueError("pearson: need at least 2 examples")
    x, y = x.astype(np.float64), y.astype(np.float64)
    xm, ym = x - x.mean(), y - y.mean()
    if np.all(xm == 0) or np.all(ym == 0) or np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")
    xm /= np.abs(xm).max()  # scale first, as scipy, so the norms cannot overflow
    ym /= np.abs(ym).max()
    r = np.dot(xm / np.linalg.norm(xm), ym / np.linalg.norm(ym))
    return float(np.clip(r, -1.0, 1.0))


def rankdata(x: Any) -> np.ndarray:
    """Ranks 1..n, ties given their average rank (scipy.stats.rankdata's default)."""
    x = np.asarray(x).reshape(-1)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    new = np.ones(len(x), dtype=bool)
    new[1:] = sorted_x[1:] != sorted_x[:-1]
    group = np.cumsum(new) - 1  # (n,) tie group of each sorted position
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(x))  # one past each group's last position
    avg = (starts + 1 + ends) / 2.0  # mean of the 1-based ranks starts+1 .. ends
    out = np.empty(len(x), dtype=np.float64)
    out[order] = avg[group]
    return out


def spearman(predictions: Any, references: Any) -> float:
    """Spearman's rho: Pearson's r of the average ranks (scipy.stats.spearmanr); nan if constant."""
    x, y = _pair(predictions, references, "spearman")
    return pearson(rankdata(x), rankdata(y))


# ---------------------------------------------------------------------------------- entities

_SCHEMES = ("IOB2", "IOE2", "IOBES", "BILOU")
_PREFIX_BIT = {c: 1 << i for i, c in enumerate("IOBESUL")}
_ANY = sum(_PREFIX_BIT.values())


def _bits(chars: str) -> int:
    return sum(_PREFIX_BIT[c] for c in chars)


# seqeval.scheme's patterns: (previous prefixes, current prefixes, tag condition) with condition
# "same" / "diff" / "any" comparing the two entity types.
_PATTERNS: dict[str, dict[str, tuple[tuple[int, int, str], ...]]] = {
    "IOB2": {
        "allowed": ((_bits("IOB"), 0, ""),),
        "start": ((_ANY, _bits("B"), "any"),),
        "inside": ((_bits("B"), _bits("I"), "same"), (_bits("I"), _bits("I"), "same")),
        "end": (
            (_bits("I"), _bits("O"), "any"), (_bits("I"), _bits("I"), "diff"), (_bits("I"), _bits("B"), "any"),
            (_bits("B"), _bits("O"), "any"), (_bits("B"), _bits("I"), "diff"), (_bits("B"), _bits("B"), "any"),
        ),
    },
    "IOE2": {
        "allowed": ((_bits("IOE"), 0, ""),),
        "start": (
            (_bits("O"), _bits("I"), "any"), (_bits("O"), _bits("E"), "any"), (_bits("E"), _bits("I"), "any"),
            (_bits("E"), _bits("E"), "any"), (_bits("I"), _bits("I"), "diff"), (_bits("I"), _bits("E"), "diff"),
        ),
        "inside": ((_bits("I"), _bits("E"), "same"), (_bits("I"), _bits("I"), "same")),
        "end": ((_bits("E"), _ANY, "any"),),
    },
    "IOBES": {
        "allowed": ((_bits("IOBES"), 0, ""),),
        "start": ((_ANY, _bits("B"), "any"), (_ANY, _bits("S"), "any")),
        "inside": ((_bits("B"), _bits("I"), "same"), (_bits("B"), _bits("E"), "same"), (_bits("I"), _bits("I"), "same"), (_bits("I"), _bits("E"), "same")),
        "end": ((_bits("S"), _ANY, "any"), (_bits("E"), _ANY, "any")),
    },
    "BILOU": {
        "allowed": ((_bits("BILOU"), 0, ""),),
        "start": ((_ANY, _bits("B"), "any"), (_ANY, _bits("U"), "any")),
        "inside": ((_bits("B"), _bits("I"), "same"), (_bits("B"), _bits("L"), "same"), (_bits("I"), _bits("I"), "same"), (_bits("I"), _bits("L"), "same")),
        "end": ((_bits("U"), _ANY, "any"), (_bits("L"), _ANY, "any")),
    },
}


def _flatten(sequences: Sequence[Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
    """Tags of all sentences end to end with an "O" after each (as seqeval), and sentence lengths."""
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    flat = [t for s in sequences for t in (*s, "O")]
    return np.array(flat, dtype=object), lengths


def _parse_default(tag: str) -> tuple[str, str]:
    """seqeval.get_entities: prefix = first character, type = after the first "-" (or "_")."""
    return tag[0], tag[1:].split("-", maxsplit=1)[-1] or "_"


def _parse_strict(tag: str) -> tuple[str, str]:
    """seqeval.scheme.Token: prefix = first character, type = the rest without "-" at its ends."""
    if tag[:1] not in _PREFIX_BIT:
        raise ValueError(f"invalid tag {tag!r}: its prefix must be one of {list(_PREFIX_BIT)}")
    return tag[0], tag[1:].strip("-") or "_"


def _match(patterns, prev_bit, cur_bit, same) -> np.ndarray:
    out = np.zeros(len(cur_bit), dtype=bool)
    for prev_mask, cur_mask, cond in patterns:
        hit = ((prev_bit & prev_mask) != 0) & ((cur_bit & cur_mask) != 0)
        if cond == "same":
            hit &= same
        elif cond == "diff":
            hit &= ~same
        out |= hit
    return out


def entities(sequences: Sequence[Sequence[str]], scheme: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Entities of tag sequences as (type names (K,), start (K,), end (K,)), end inclusive.

    Positions index the sentences laid end to end with one separator after each (sentence s's
    token t is at ``sum(len + 1 for earlier sentences) + t``), so two calls on sequences of the
    same lengths give comparable spans. ``scheme`` None: seqeval's default mode; else its strict
    mode with that scheme. Vectorised: per-position rules on (previous, current) tags.
    """
    flat, _ = _flatten(sequences)
    n = len(flat)
    if n == 0:
        return np.zeros(0, dtype=object), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    uniq, inv = np.unique(flat.astype(str), return_inverse=True)
    if scheme is None:
        parsed = [_parse_default(t) if t else ("", "_") for t in uniq.tolist()]
    else:
        if scheme not in _PATTERNS:
            raise ValueError(f"unknown tagging scheme {scheme!r}; expected None (conlleval) or one of {_SCHEMES}")
        parsed = [_parse_strict(t) for t in uniq.tolist()]
    type_names = np.array(sorted({ty for _, ty in parsed} | {""}), dtype=object)
    type_of = {ty: i for i, ty in enumerate(type_names.tolist())}
    prefix = np.array([p for p, _ in parsed], dtype=object)[inv]  # (n,) one character each
    ty = np.array([type_of[t] for _, t in parsed], dtype=np.int64)[inv]  # (n,)

    if scheme is None:
        # seqeval.get_entities: the previous tag of position 0 is "O" with type "".
        prev = np.concatenate([["O"], prefix[:-1]])
        prev_ty = np.concatenate([[type_of[""]], ty[:-1]])
        t, p = prefix, prev
        diff_type = prev_ty != ty
        end = (
            np.isin(p, ("E", "S"))
            | (np.isin(p, ("B", "I")) & np.isin(t, ("B", "S", "O")))
            | (~np.isin(p, ("O", ".")) & diff_type)
        )  # a chunk ended at i - 1
        start = (
            np.isin(t, ("B", "S"))
            | (np.isin(p, ("E", "S", "O")) & np.isin(t, ("E", "I")))
            | (~np.isin(t, ("O", ".")) & diff_type)
        )  # a chunk starts at i
        starts = np.flatnonzero(start)
        ends = np.flatnonzero(end)  # chunk (prev type, last start before i, i - 1)
        k = np.searchsorted(starts, ends, side="left") - 1
        begin = np.where(k >= 0, starts[np.maximum(k, 0)], 0)
        return type_names[prev_ty[ends]], begin, ends - 1

    pat = _PATTERNS[scheme]
    bit = np.array([_PREFIX_BIT[p] for p in prefix.tolist()], dtype=np.int64)  # (n,)
    allowed = pat["allowed"][0][0]
    if np.any((bit & allowed) == 0):
        bad = flat[np.argmax((bit & allowed) == 0)]
        raise ValueError(f"invalid tag {bad!r} for the {scheme} scheme")
    prev_bit = np.concatenate([[_PREFIX_BIT["O"]], bit[:-1]])
    same = np.concatenate([[ty[0] == type_of["_"]], ty[1:] == ty[:-1]])
    start = _match(pat["start"], prev_bit, bit, same)
    inside = _match(pat["inside"], prev_bit, bit, same)
    end_ok = _match(pat["end"], prev_bit, bit, same)  # the chunk before i may end at i - 1
    # seqeval.scheme.Tokens.entities: from a start, walk while tokens are "inside"; the chunk is an
    # entity if the first token after it closes it. In these schemes no start is also "inside",
    # so the chunks never overlap and every start can be walked at once.
    starts = np.flatnonzero(start)
    outside = np.flatnonzero(~inside)  # the separator "O" after every sentence is never inside
    stop = outside[np.searchsorted(outside, starts, side="right")]  # first non-inside after each start
    keep = end_ok[stop]
    return type_names[ty[starts[keep]]], starts[keep], stop[keep] - 1


def _check_lengths(predictions: Sequence[Sequence], references: Sequence[Sequence]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predicted sequences but {len(references)} reference sequences")
    for i, (p, r) in enumerate(zip(predictions, references)):
        if len(p) != len(r):
            raise ValueError(f"sequence {i}: {len(p)} predicted tags but {len(r)} reference tags")


def _entity_counts(predictions, references, scheme) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Entity types (sorted) and per type: true positives, predicted, reference counts."""
    _check_lengths(predictions, references)
    p_type, p_start, p_end = entities(predictions, scheme)
    r_type, r_start, r_end = entities(references, scheme)
    names = sorted(set(p_type.tolist()) | set(r_type.tolist()))
    index = {t: i for i, t in enumerate(names)}
    p_ti = np.array([index[t] for t in p_type.tolist()], dtype=np.int64)
    r_ti = np.array([index[t] for t in r_type.tolist()], dtype=np.int64)
    span = int(max(p_end.max(initial=0), r_end.max(initial=0))) + 2
    p_key = (p_ti * span + p_start) * span + p_end  # (P,) one integer per (type, start, end)
    r_key = (r_ti * span + r_start) * span + r_end
    tp_type = np.intersect1d(p_key, r_key) // (span * span)
    k = len(names)
    return names, np.bincount(tp_type, minlength=k), np.bincount(p_ti, minlength=k), np.bincount(r_ti, minlength=k)


def _prf(tp, n_pred, n_ref) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tp, n_pred, n_ref = (np.asarray(x, dtype=np.float64) for x in (tp, n_pred, n_ref))
    p = np.divide(tp, n_pred, out=np.zeros_like(tp), where=n_pred > 0)
    r = np.divide(tp, n_ref, out=np.zeros_like(tp), where=n_ref > 0)
    f = np.divide(2 * p * r, p + r, out=np.zeros_like(tp), where=(p + r) > 0)
    return p, r, f


def entity_scores(predictions: Sequence[Sequence[str]], references: Sequence[Sequence[str]], scheme: str | None = None) -> dict[str, float]:
    """Micro-averaged entity ``precision``, ``recall``, ``f1`` (seqeval's default average)."""
    _, tp, n_pred, n_ref = _entity_counts(predictions, references, scheme)
    p, r, f = _prf(tp.sum(), n_pred.sum(), n_ref.sum())
    return {"precision": float(p), "recall": float(r), "f1": float(f)}


def entity_report(predictions: Sequence[Sequence[str]], references: Sequence[Sequence[str]], scheme: str | None = None) -> dict[str, dict[str, float]]:
    """Per entity type: precision, recall, f1, support (seqeval ``classification_report``)."""
    names, tp, n_pred, n_ref = _entity_counts(predictions, references, scheme)
    p, r, f = _prf(tp, n_pred, n_ref)
    return {t: {"precision": float(p[i]), "recall": float(r[i]), "f1": float(f[i]), "support": int(n_ref[i])} for i, t in enumerate(names)}


def token_accuracy(predictions: Sequence[Sequence], references: Sequence[Sequence]) -> float:
    """Fraction of tags equal to the reference's, over all tokens (seqeval ``accuracy_score``)."""
    _check_lengths(predictions, references)
    p = np.array([t for s in predictions for t in s], dtype=object)
    r = np.array([t for s in references for t in s], dtype=object)
    if r.size == 0:
        raise ValueError("token_accuracy: no tokens")
    return float(np.mean(p == r))


def tags_from_token_arrays(
    predictions: np.ndarray, references: np.ndarray, label_names: Sequence[str], word_ids: np.ndarray | None = None
) -> tuple[list[list[str]], list[list[str]]]:
    """Token-level model output -> word-level tag sequences for the entity metrics.

    ``predictions``: (N, T) label ids or (N, T, C) logits; ``references``: the encoder's ``labels``
    (N, T), -100 where not predicted. Kept positions: where ``references != -100`` or, if
    ``word_ids`` is given (needed with ``label_all_subtokens``), the first sub-token of each word.
    """
    pred = np.asarray(predictions)
    if pred.ndim == 3:
        pred = pred.argmax(-1)
    ref = np.asarray(references)
    if word_ids is not None:
        from pipelines.alignment import first_subtokens

        keep = first_subtokens(np.asarray(word_ids)) & (ref != -100)
    else:
        keep = ref != -100
    names = np.array(list(label_names), dtype=object)
    return [names[pred[i][keep[i]]].tolist() for i in range(len(ref))], [names[ref[i][keep[i]]].tolist() for i in range(len(ref))]


# -------------------------------------------------------------------------------------- SQuAD

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(s: str) -> str:
    """The official SQuAD normalisation: lowercase, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _f1(prediction: str, gold: str, empty_matches_empty: bool) -> float:
    pred_toks, gold_toks = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if empty_matches_empty and (not pred_toks or not gold_toks):
        return float(pred_toks == gold_toks)  # evaluate-v2.0.py: "" is the answer to "no answer"
    same = sum((Counter(pred_toks) & Counter(gold_toks)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_toks), same / len(gold_toks)
    return 2 * precision * recall / (precision + recall)


def squad_exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer, else 0.0."""
    return float(max(normalize_answer(prediction) == normalize_answer(g) for g in golds))


def squad_f1(prediction: str, golds: Sequence[str], version_2: bool = False) -> float:
    """Best bag-of-tokens F1 against the gold answers (v1.1 rules; ``version_2``: v2.0 rules,
    where empty gold answers are dropped and "" is the gold answer of an unanswerable question)."""
    if version_2:
        golds = [g for g in golds if normalize_answer(g)] or [""]
    return max(_f1(prediction, g, version_2) for g in golds)


def _answer_texts(ref: Any) -> list[str]:
    if isinstance(ref, dict):
        ref = ref.get("text", [])
    if isinstance(ref, str):
        return [ref]
    return [str(t) for t in ref]


def squad_scores(predictions: Sequence, references: Sequence, version_2: bool = False) -> dict[str, float]:
    """``exact_match`` and ``f1`` in percent (official evaluate-v1.1.py / evaluate-v2.0.py).

    ``predictions``: answer strings (or ``decode_qa``'s dicts); ``references``: per question the
    gold answer texts (a list, or SQuAD's ``{"text": [...], ...}``). ``version_2``: also
    ``has_answer_*`` / ``no_answer_*`` scores and counts (the script's HasAns / NoAns).
    """
    if len(predictions) != len(references):
        raise ValueError(f"squad_scores: {len(predictions)} predictions but {len(references)} questions")
    if not references:
        raise ValueError("squad_scores: no questions")
    preds = [p["text"] if isinstance(p, dict) else str(p) for p in predictions]
    golds = [_answer_texts(r) for r in references]
    if not version_2:
        if any(not g for g in golds):
            raise ValueError("squad_scores: a question without gold answers; use version_2=True for SQuAD 2.0")
        em = np.array([squad_exact_match(p, g) for p, g in zip(preds, golds)])
        f1 = np.array([squad_f1(p, g) for p, g in zip(preds, golds)])
        return {"exact_match": 100.0 * em.mean(), "f1": 100.0 * f1.mean()}
    has_answer = np.array([bool(g) for g in golds])
    kept = [[a for a in g if normalize_answer(a)] or [""] for g in golds]
    em = np.array([max(float(normalize_answer(a) == normalize_answer(p)) for a in g) for p, g in zip(preds, kept)])
    f1 = np.array([max(_f1(p, a, True) for a in g) for p, g in zip(preds, kept)])
    out = {"exact_match": 100.0 * em.mean(), "f1": 100.0 * f1.mean()}
    for name, mask in (("has_answer", has_answer), ("no_answer", ~has_answer)):
        out[f"{name}_total"] = float(mask.sum())
        if mask.any():
            out[f"{name}_exact_match"] = 100.0 * em[mask].mean()
            out[f"{name}_f1"] = 100.0 * f1[mask].mean()
    return {k: float(v) for k, v in out.items()}


# ---------------------------------------------------------------------------------- per task


def _labels_of(predictions: Any) -> np.ndarray:
    """Class predictions: ids as they are, logits (N, K) argmax-ed."""
    p = np.asarray(predictions)
    return p.argmax(-1) if p.ndim == 2 else p


def classification_metrics(predictions: Any, references: Any) -> dict[str, float]:
    """``accuracy``, ``f1`` (macro), ``mcc``; predictions are ids or (N, K) logits."""
    p = _labels_of(predictions)
    return {"accuracy": accuracy(p, references), "f1": macro_f1(p, references), "mcc": matthews_corrcoef(p, references)}


def regression_metrics(predictions: Any, references: Any) -> dict[str, float]:
    """``pearson``, ``spearman``; predictions (N,) or (N, 1)."""
    p = np.asarray(predictions, dtype=np.float64).reshape(-1)
    return {"pearson": pearson(p, references), "spearman": spearman(p, references)}


def choice_metrics(predictions: Any, references: Any) -> dict[str, float]:
    """``accuracy``; predictions are ids or (N, K) scores."""
    return {"accuracy": accuracy(_labels_of(predictions), references)}


def tagging_metrics(predictions: Any, references: Any, label_names: Sequence[str] | None = None,
                    word_ids: Any = None, scheme: str | None = None) -> dict[str, float]:
    """Entity ``precision``, ``recall``, ``f1`` and ``token_accuracy``: predictions/references are tag
    sequences, or the model's (N, T[, C]) arrays with the encoder's labels and ``label_names``
    (and ``word_ids`` with all-sub-token labels); ``scheme`` selects seqeval's strict mode."""
    if isinstance(predictions, np.ndarray) or isinstance(references, np.ndarray):
        if label_names is None:
            raise ValueError("task_metrics(token-classification): model arrays need label_names= (the LabelSet names)")
        predictions, references = tags_from_token_arrays(predictions, references, label_names, word_ids)
    out = entity_scores(predictions, references, scheme)
    out["token_accuracy"] = token_accuracy(predictions, references)
    return out


def qa_metrics(predictions: Any, references: Any, version_2: bool | None = None) -> dict[str, float]:
    """SQuAD's ``exact_match`` and ``f1`` (percent); ``version_2=True`` adds the HasAns/NoAns split
    (on by default when some question has no gold answer)."""
    if version_2 is None:
        version_2 = any(not _answer_texts(r) for r in references)
    return squad_scores(predictions, references, version_2=bool(version_2))


# ------------------------------------------------------------------------------- retrieval

RETRIEVAL_SCORE_CELLS = 1 << 24  # query x document scores held at once (128 MiB of float64)
TIE_TOLERANCE = 1e-9  # cosines closer than this to the relevant document's tie with it (float rounding of equal vectors)


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1; zero and non-finite rows become 0 (a cosine of 0 with everything)."""
    x = np.where(np.isfinite(x).all(axis=-1, keepdims=True), x, 0.0)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, norm, out=np.zeros_like(x), where=norm > 0)


def retrieval_ranks(predictions: Any, references: Any) -> np.ndarray:
    """int64 (N,): the rank (1 = best) of each anchor's positive among the unique documents.

    ``predictions`` float (N, K, D): each record's vectors, anchor first, then its K-1 candidates
    (positive, negatives); ``references`` int64 (N, K-1): the candidates' document ids (the
    encoder's ``doc_ids``). The corpus is the unique ids, each with the vector of its first
    occurrence; anchor i's one relevant document is ``references[i, 0]``. The rank counts the
    documents scoring at least as high as the relevant one (the relevant one included), so ties
    rank pessimistically: a collapsed model whose vectors are all equal ranks every positive
    last, never first. sentence-transformers orders ties by corpus id instead, which can credit a
    collapsed model with perfect scores. Scores are computed a block of anchors at a time
    (``RETRIEVAL_SCORE_CELLS``), so the full N x corpus matrix never exists.
    """
    p = np.asarray(predictions, dtype=np.float64)
    r = np.asarray(references, dtype=np.int64)
    if len(p) == 0:
        raise ValueError("retrieval metrics: no queries")
    if p.ndim != 3 or p.shape[1] < 2:
        raise ValueError(f"retrieval metrics: predictions must be (N, K, D) with the anchor and at least one candidate, got shape {p.shape}")
    n, k, d = p.shape
    if r.shape != (n, k - 1):
        raise ValueError(f"retrieval metrics: references must be the candidates' doc ids, shape ({n}, {k - 1}), got {r.shape}")
    ids, first, inverse = np.unique(r.reshape(-1), return_index=True, return_inverse=True)
    corpus = unit_rows(p[:, 1:, :].reshape(-1, d)[first])  # (C, D) one vector per document
    queries = unit_rows(p[:, 0, :])  # (N, D)
    relevant = inverse.reshape(n, k - 1)[:, 0]  # (N,) each anchor's positive, as a corpus row
    ranks = np.empty(n, dtype=np.int64)
    step = max(1, min(1024, RETRIEVAL_SCORE_CELLS // len(ids)))
    for start in range(0, n, step):
        stop = min(start + step, n)
        scores = queries[start:stop] @ corpus.T  # (B, C)
        own = scores[np.arange(stop - start), relevant[start:stop]]  # (B,)
        ranks[start:stop] = (scores >= own[:, None] - TIE_TOLERANCE).sum(axis=1)
    return ranks


def retrieval_metrics(predictions: Any, references: Any) -> dict[str, float]:
    """MTEB's retrieval metrics of each anchor's positive among all candidate documents (see
    ``retrieval_ranks``), averaged over the anchors. With one relevant document at rank r:
    nDCG@10 = 1/log2(r + 1), MRR@10 = 1/r and MAP@100 = 1/r within the cutoff, else 0; recall@k =
    [r <= k] (sentence-transformers' accuracy@k and, for k = 1, precision@1 are the same numbers)."""
    rank = retrieval_ranks(predictions, references).astype(np.float64)
    return {
        "ndcg_at_10": float(np.mean(np.where(rank <= 10, 1.0 / np.log2(rank + 1), 0.0))),
        "mrr_at_10": float(np.mean(np.where(rank <= 10, 1.0 / rank, 0.0))),
        "map_at_100": float(np.mean(np.where(rank <= 100, 1.0 / rank, 0.0))),
        "recall_at_1": float(np.mean(rank <= 1)),
        "recall_at_10": float(np.mean(rank <= 10)),
    }


def pair_cosines(vectors: Any) -> np.ndarray:
    """float64 (N,): the cosine similarity of each pair's two vectors, (N, 2, D)."""
    v = np.asarray(vectors, dtype=np.float64)
    if v.ndim != 3 or v.shape[1] != 2:
        raise ValueError(f"pair_cosines: pairs of vectors (N, 2, D), got {v.shape}")
    norms = np.maximum(np.linalg.norm(v, axis=-1), 1e-12)  # (N, 2)
    return np.einsum("nd,nd->n", v[:, 0], v[:, 1]) / (norms[:, 0] * norms[:, 1])


def similarity_metrics(predictions: Any, references: Any) -> dict[str, float]:
    """An embedding model on pairs scored for similarity, as sentence-transformers'
    EmbeddingSimilarityEvaluator scores it with the cosine: ``spearman_cosine`` and ``pearson_cosine``
    between each pair's cosine similarity (``predictions``: its two vectors, (N, 2, D)) and its score
    (``references``)."""
    cosines = pair_cosines(predictions)
    return {"spearman_cosine": spearman(cosines, references), "pearson_cosine": pearson(cosines, references)}


# The metrics of each task kind (ctxmodels.task_kinds.TASKS[kind].metrics names what each returns).
METRICS: dict[str, Callable[..., dict[str, float]]] = {
    "classification": classification_metrics,
    "regression": regression_metrics,
    "multiple-choice": choice_metrics,
    "token-classification": tagging_metrics,
    "question-answering": qa_metrics,
    "embedding": retrieval_metrics,
}


def task_metrics(kind: str, predictions: Any, references: Any, **extra: Any) -> dict[str, float]:
    """The metrics of a task kind, by name (``METRICS[kind]``; ``extra`` are its keyword arguments)."""
    if kind not in METRICS:
        raise ValueError(f"task_metrics: unknown task kind {kind!r}")
    return METRICS[kind](predictions, references, **extra)
