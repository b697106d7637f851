"""Metrics (pipelines/metrics.py) against sklearn, scipy, seqeval and the official SQuAD scripts."""

from __future__ import annotations

import collections
import re
import string
import warnings

import numpy as np
import pytest

from pipelines.metrics import (
    accuracy,
    confusion_matrix,
    entities,
    entity_report,
    entity_scores,
    macro_f1,
    matthews_corrcoef,
    normalize_answer,
    pearson,
    rankdata,
    retrieval_metrics,
    retrieval_ranks,
    spearman,
    squad_exact_match,
    squad_f1,
    squad_scores,
    tags_from_token_arrays,
    task_metrics,
    token_accuracy,
)

sklearn_metrics = pytest.importorskip("sklearn.metrics")
stats = pytest.importorskip("scipy.stats")
seqeval_metrics = pytest.importorskip("seqeval.metrics")
seqeval_scheme = pytest.importorskip("seqeval.scheme")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::RuntimeWarning")


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ------------------------------------------------------------------------------ classification


@pytest.mark.parametrize("seed", range(20))
def test_classification_metrics_equal_sklearn(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 60)), int(rng.integers(1, 6))
    ref = rng.integers(0, k, n)
    pred = np.where(rng.random(n) < 0.6, ref, rng.integers(0, k + 1, n))  # sometimes a label the references lack
    assert accuracy(pred, ref) == sklearn_metrics.accuracy_score(ref, pred)
    assert macro_f1(pred, ref) == pytest.approx(_quiet(sklearn_metrics.f1_score, ref, pred, average="macro"), abs=1e-12)
    assert matthews_corrcoef(pred, ref) == pytest.approx(_quiet(sklearn_metrics.matthews_corrcoef, ref, pred), abs=1e-12)
    np.testing.assert_array_equal(confusion_matrix(pred, ref), sklearn_metrics.confusion_matrix(ref, pred))
    labels = [3, 0, 1]
    np.testing.assert_array_equal(confusion_matrix(pred, ref, labels=labels), sklearn_metrics.confusion_matrix(ref, pred, labels=labels))
    assert macro_f1(pred, ref, labels=range(k + 2)) == pytest.approx(_quiet(sklearn_metrics.f1_score, ref, pred, average="macro", labels=list(range(k + 2))), abs=1e-12)


def test_classification_edge_cases():
    ref = np.array([0, 1, 1, 0])
    for pred in (np.zeros(4, int), np.ones(4, int), ref, 1 - ref):  # constant, perfect, inverted
        assert matthews_corrcoef(pred, ref) == _quiet(sklearn_metrics.matthews_corrcoef, ref, pred)
        assert macro_f1(pred, ref) == pytest.approx(_quiet(sklearn_metrics.f1_score, ref, pred, average="macro"))
    assert matthews_corrcoef(np.zeros(4, int), ref) == 0.0  # constant predictions: MCC 0, as sklearn
    assert matthews_corrcoef([2, 2], [2, 2]) == 0.0 and macro_f1([2, 2], [2, 2]) == 1.0
    strings = (["a", "b", "c", "a"], ["a", "c", "c", "b"])
    assert macro_f1(*strings) == pytest.approx(sklearn_metrics.f1_score(strings[1], strings[0], average="macro"))
    with pytest.raises(ValueError, match="no examples"):
        accuracy([], [])
    with pytest.raises(ValueError, match="3 predictions but 2 references"):
        accuracy([1, 2, 3], [1, 2])


@pytest.mark.parametrize("seed", range(20))
def test_correlations_equal_scipy(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 50))
    x = rng.normal(size=n)
    y = 0.5 * x + rng.normal(size=n)
    if seed % 3 == 0:  # ties, as on STS-B's 0.2-step gold scores
        x, y = np.round(x, 0), np.round(y * 2) / 2
    if len(set(x)) > 1 and len(set(y)) > 1:
        assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y).statistic, abs=1e-12)
        assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)
    np.testing.assert_allclose(rankdata(x), stats.rankdata(x))


def test_correlation_edge_cases():
    # Constant on either side: nan, as scipy (which warns); a correlation is undefined there.
    assert np.isnan(pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])) and np.isnan(_quiet(stats.pearsonr, [1.0, 1.0, 1.0], [1.0, 2.0, 3.0]).statistic)
    assert np.isnan(spearman([1, 2, 3], [5, 5, 5])) and np.isnan(_quiet(stats.spearmanr, [1, 2, 3], [5, 5, 5]).statistic)
    assert pearson([1, 2], [2, 1]) == pytest.approx(-1.0) and spearman([1, 2], [2, 1]) == pytest.approx(-1.0)
    assert pearson([1e-300, 2e-300, 3e-300], [1e300, 2e300, 4e300]) == pytest.approx(stats.pearsonr([1e-300, 2e-300, 3e-300], [1e300, 2e300, 4e300]).statistic)
    with pytest.raises(ValueError, match="at least 2"):
        pearson([1.0], [2.0])


# ---------------------------------------------------------------------------------- entities

EDGE_SEQUENCES = [
    (["O", "I-PER", "I-PER", "O"], ["O", "B-PER", "I-PER", "O"]),  # I- without B-
    (["B-PER", "I-LOC", "I-LOC"], ["B-PER", "I-PER", "I-LOC"]),  # type switches inside a chunk
    (["B-PER", "B-PER", "O", "B-LOC"], ["B-PER", "I-PER", "O", "B-LOC"]),  # single-token entities
    (["O", "O", "O"], ["B-MISC", "I-MISC", "O"]),  # empty predictions
    (["B-ORG", "O"], ["O", "O"]),  # no reference entities
    (["S-PER", "B-LOC", "E-LOC", "O", "E-PER"], ["S-PER", "B-LOC", "I-LOC", "E-LOC", "S-PER"]),  # E-/S- tags
    (["B-X", "E-X", "S-X", "I-X", "E-X"], ["B-X", "I-X", "E-X", "B-X", "E-X"]),
    (["I-PER"], ["I-PER"]),
    ([], []),
    (["B", "I", "O", "B-"], ["B", "O", "I", "I-"]),  # types missing: "_"
]


def _seqeval(pred, ref, scheme=None):
    kw = {} if scheme is None else {"mode": "strict", "scheme": getattr(seqeval_scheme, scheme)}
    p = _quiet(seqeval_metrics.precision_score, ref, pred, **kw)
    r = _quiet(seqeval_metrics.recall_score, ref, pred, **kw)
    f = _quiet(seqeval_metrics.f1_score, ref, pred, **kw)
    report = _quiet(seqeval_metrics.classification_report, ref, pred, output_dict=True, zero_division=0, **kw)
    per_type = {t: v for t, v in report.items() if not t.endswith(" avg")}
    return {"precision": p, "recall": r, "f1": f}, per_type


def _assert_equal_to_seqeval(pred, ref, scheme=None):
    ours = entity_scores(pred, ref, scheme)
    theirs, per_type = _seqeval(pred, ref, scheme)
    for key in ("precision", "recall", "f1"):
        assert ours[key] == pytest.approx(theirs[key], abs=1e-12), (key, pred, ref)
    report = entity_report(pred, ref, scheme)
    if any(len(s) for s in ref) or any(len(s) for s in pred):
        assert set(report) == set(per_type), (pred, ref)
        for t, row in report.items():
            assert row["precision"] == pytest.approx(per_type[t]["precision"]) and row["recall"] == pytest.approx(per_type[t]["recall"])
            assert row["f1"] == pytest.approx(per_type[t]["f1-score"]) and row["support"] == per_type[t]["support"]


@pytest.mark.parametrize("pred,ref", EDGE_SEQUENCES)
def test_entity_edge_cases_default_mode(pred, ref):
    _assert_equal_to_seqeval([pred], [ref])
    _assert_equal_to_seqeval([pred, ref], [ref, pred])


def test_entity_spans_default_mode_equal_get_entities():
    from seqeval.metrics.sequence_labeling import get_entities

    for pred, ref in EDGE_SEQUENCES:
        for seq in (pred, ref):
            ours = entities([seq])
            assert list(zip(ours[0].tolist(), ours[1].tolist(), ours[2].tolist())) == _quiet(get_entities, list(seq)), seq


TAG_SETS = {
    None: ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "E-LOC", "S-LOC", "I-MISC"],
    "IOB2": ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-MISC", "I-MISC"],
    "IOE2": ["O", "I-PER", "E-PER", "I-LOC", "E-LOC"],
    "IOBES": ["O", "B-PER", "I-PER", "E-PER", "S-PER", "B-LOC", "I-LOC", "E-LOC", "S-LOC"],
    "BILOU": ["O", "B-PER", "I-PER", "L-PER", "U-PER", "B-LOC", "I-LOC", "L-LOC", "U-LOC"],
}


@pytest.mark.parametrize("scheme", list(TAG_SETS))
@pytest.mark.parametrize("seed", range(8))
def test_entities_equal_seqeval_on_random_tags(scheme, seed):
    rng = np.random.default_rng(seed)
    tags = TAG_SETS[scheme]
    ref = [[tags[t] for t in rng.integers(0, len(tags), rng.integers(0, 12))] for _ in range(30)]
    pred = [[t if rng.random() < 0.7 else tags[rng.integers(0, len(tags))] for t in s] for s in ref]
    _assert_equal_to_seqeval(pred, ref, scheme)


def test_strict_schemes_on_edge_cases_and_invalid_tags():
    iob2 = [(p, r) for p, r in EDGE_SEQUENCES[:5]]
    for pred, ref in iob2:
        _assert_equal_to_seqeval([pred], [ref], "IOB2")
    # strict IOB2: "I-PER" without "B-PER" is no entity at all (default mode counts it)
    assert entity_scores([["O", "I-PER", "I-PER"]], [["O", "B-PER", "I-PER"]], "IOB2")["precision"] == 0.0
    assert entity_scores([["O", "I-PER", "I-PER"]], [["O", "B-PER", "I-PER"]])["f1"] == 1.0
    iobes = EDGE_SEQUENCES[5:8]
    for pred, ref in iobes:
        _assert_equal_to_seqeval([pred], [ref], "IOBES")
    with pytest.raises(ValueError, match=r"invalid tag 'S-PER' for the IOB2 scheme"):
        entity_scores([["S-PER"]], [["O"]], "IOB2")
    with pytest.raises(ValueError, match="unknown tagging scheme"):
        entity_scores([["O"]], [["O"]], "IOB9")
    with pytest.raises(ValueError, match="sequence 0: 2 predicted tags but 1 reference tags"):
        entity_scores([["O", "O"]], [["O"]])


def test_token_accuracy_and_model_arrays():
    ref = [["B-PER", "I-PER", "O"], ["O"]]
    pred = [["B-PER", "O", "O"], ["B-LOC"]]
    assert token_accuracy(pred, ref) == seqeval_metrics.accuracy_score(ref, pred) == 0.5
    names = ["B-LOC", "B-PER", "I-PER", "O"]
    labels = np.array([[-100, 1, 2, -100, 3, -100], [-100, 3, -100, -100, -100, -100]])
    logits = np.zeros((2, 6, 4))
    logits[0, 1, 1] = logits[0, 2, 3] = logits[0, 4, 3] = logits[1, 1, 0] = 1.0
    p, r = tags_from_token_arrays(logits, labels, names)
    assert r == ref and p == pred
    word_ids = np.array([[-1, 0, 1, 1, 2, -1], [-1, 0, -1, -1, -1, -1]])
    all_sub = np.array([[-100, 1, 2, 2, 3, -100], [-100, 3, -100, -100, -100, -100]])
    assert tags_from_token_arrays(logits, all_sub, names, word_ids)[1] == ref
    out = task_metrics("token-classification", logits, labels, label_names=names)
    assert out == pytest.approx({"precision": 0.0, "recall": 0.0, "f1": 0.0, "token_accuracy": 0.5})
    out = task_metrics("token-classification", [["B-PER", "I-PER"]], [["B-PER", "I-PER"]], scheme="IOB2")
    assert out == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "token_accuracy": 1.0}


# -------------------------------------------------------------------------------------- SQuAD


def _official_normalize(s):
    """evaluate-v1.1.py / evaluate-v2.0.py normalize_answer."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def _official_v2_f1(a_gold, a_pred):
    """evaluate-v2.0.py compute_f1."""
    gold_toks = _official_normalize(a_gold).split() if a_gold else []
    pred_toks = _official_normalize(a_pred).split() if a_pred else []
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        return int(gold_toks == pred_toks)
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(pred_toks)
    recall = 1.0 * num_same / len(gold_toks)
    return (2 * precision * recall) / (precision + recall)


def test_squad_normalisation_and_hand_cases():
    assert normalize_answer("The  Quick, brown FOX!") == "quick brown fox"
    assert normalize_answer("an apple a day; the end") == "apple day end"
    assert normalize_answer("theater") == "theater"  # articles only as whole words
    assert normalize_answer("Über — café") == "über — café"  # only ASCII punctuation goes
    assert squad_exact_match("the Denver Broncos", ["Denver Broncos", "Broncos"]) == 1.0
    assert squad_exact_match("Denver", ["Denver Broncos"]) == 0.0
    assert squad_f1("Denver", ["Denver Broncos"]) == pytest.approx(2 / 3)
    assert squad_f1("Denver Broncos won", ["Broncos", "Denver Broncos"]) == pytest.approx(0.8)  # max over golds
    assert squad_f1("", ["Broncos"]) == 0.0
    assert squad_f1("the", ["a"]) == 0.0 and squad_exact_match("the", ["a"]) == 1.0  # v1.1: both normalise to ""
    assert squad_f1("the", ["a"], version_2=True) == 1.0  # v2.0: "" is the answer, and it matches
    texts = ["The cat sat.", "a cat", "cats sat", "", "the", "Sat, the cat sat!", "dog"]
    for p in texts:
        for g in texts:
            assert normalize_answer(p) == _official_normalize(p)
            assert squad_f1(p, [g], version_2=True) == pytest.approx(_official_v2_f1(g if _official_normalize(g) else "", p))


def test_squad_v1_and_v2_scores():
    preds = ["Denver Broncos", "Santa Clara", "1990"]
    refs = [{"text": ["Denver Broncos", "Broncos"], "answer_start": [0, 7]}, ["Levi's Stadium", "Santa Clara, California"], ["2016"]]
    out = squad_scores(preds, refs)
    assert out["exact_match"] == pytest.approx(100 / 3)
    assert out["f1"] == pytest.approx(100 * (1 + 2 * (2 / 2 * 2 / 3) / (1 + 2 / 3) + 0) / 3)
    assert task_metrics("question-answering", [{"text": p} for p in preds], refs) == out
    v2 = squad_scores(["Broncos", "", "something", ""], [["Broncos"], [], [], ["Santa Clara"]], version_2=True)
    assert v2["has_answer_total"] == 2 and v2["no_answer_total"] == 2
    assert v2["has_answer_exact_match"] == 50.0 and v2["no_answer_exact_match"] == 50.0 and v2["no_answer_f1"] == 50.0
    assert v2["exact_match"] == 50.0 and v2["f1"] == 50.0
    assert task_metrics("question-answering", ["Broncos", "", "something", ""], [["Broncos"], [], [], ["Santa Clara"]]) == v2  # v2 inferred
    with pytest.raises(ValueError, match="version_2=True"):
        squad_scores([""], [[]])


def test_task_metrics_names():
    logits = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    out = task_metrics("classification", logits, [1, 1, 1])
    assert set(out) == {"accuracy", "f1", "mcc"} and out["accuracy"] == pytest.approx(2 / 3)
    out = task_metrics("regression", np.array([[0.1], [0.5], [0.2]]), [1.0, 3.0, 2.0])
    assert set(out) == {"pearson", "spearman"} and out["spearman"] == pytest.approx(1.0)
    assert task_metrics("multiple-choice", logits, [1, 0, 0]) == {"accuracy": pytest.approx(2 / 3)}
    with pytest.raises(ValueError, match="unknown task kind"):
        task_metrics("ranking", [1], [1])
    with pytest.raises(ValueError, match="label_names"):
        task_metrics("token-classification", np.zeros((1, 2), int), np.zeros((1, 2), int))



# ------------------------------------------------------------------------------------ retrieval

RETRIEVAL = ("ndcg_at_10", "mrr_at_10", "map_at_100", "recall_at_1", "recall_at_10")


def _retrieval_case(seed: int, n: int, k: int, n_docs: int, d: int = 8):
    """Random continuous vectors (no ties): N anchors, each with K-1 candidates drawn from a pool of
    documents (so records share documents), the positive first. Returns (predictions, references,
    the anchors' unit vectors, the corpus's unit vectors (C, D), each anchor's positive as a corpus row)."""
    rng = np.random.default_rng(seed)
    pool = rng.normal(size=(n_docs, d))
    pick = np.stack([rng.choice(n_docs, size=k - 1, replace=False) for _ in range(n)])  # (N, K-1)
    ids = rng.integers(1, 1 << 62, size=n_docs)  # doc ids: any int64s (the encoder's text hashes)
    anchors = rng.normal(size=(n, d)) + 0.8 * pool[pick[:, 0]]  # closer to their positive than chance
    predictions = np.concatenate([anchors[:, None], pool[pick]], axis=1)  # (N, K, D)
    used = np.unique(pick)  # the corpus: the documents some record names
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    return predictions, ids[pick], unit(anchors), unit(pool[used]), np.searchsorted(used, pick[:, 0])


@pytest.mark.parametrize("seed", range(8))
def test_retrieval_metrics_equal_sklearn(seed):
    rng = np.random.default_rng(100 + seed)
    n, k = int(rng.integers(3, 40)), int(rng.integers(2, 5))
    n_docs = int(rng.integers(max(k, 3), 9)) if seed % 2 else int(rng.integers(20, 90))  # <= 10 or <= 100 documents
    predictions, references, queries, corpus, relevant = _retrieval_case(seed, n, k, n_docs)
    scores = queries @ corpus.T  # (N, C)
    if scores.shape[1] < 3:
        pytest.skip("sklearn's top-k accuracy reads 2 classes as binary")
    y_true = np.zeros_like(scores, dtype=int)
    y_true[np.arange(n), relevant] = 1
    ours = retrieval_metrics(predictions, references)
    labels = np.arange(scores.shape[1])
    assert ours["ndcg_at_10"] == pytest.approx(sklearn_metrics.ndcg_score(y_true, scores, k=10), abs=1e-12)
    assert ours["recall_at_1"] == pytest.approx(sklearn_metrics.top_k_accuracy_score(relevant, scores, k=1, labels=labels), abs=1e-12)
    assert ours["recall_at_10"] == pytest.approx(_quiet(sklearn_metrics.top_k_accuracy_score, relevant, scores, k=10, labels=labels), abs=1e-12)
    lrap = sklearn_metrics.label_ranking_average_precision_score(y_true, scores)  # mean 1/rank: no cutoff
    assert ours["map_at_100"] == pytest.approx(lrap, abs=1e-12)  # every rank <= 100 here
    if scores.shape[1] <= 10:
        assert ours["mrr_at_10"] == pytest.approx(lrap, abs=1e-12)


def test_retrieval_metrics_equal_sentence_transformers_evaluator():
    """sentence-transformers' InformationRetrievalEvaluator on the same vectors: a stand-in model
    gives it the anchors' vectors, the corpus vectors are passed precomputed (no model is loaded)."""
    st_eval = pytest.importorskip("sentence_transformers.sentence_transformer.evaluation.information_retrieval")
    torch = pytest.importorskip("torch")
    from sentence_transformers.util import cos_sim

    for seed, n, k, n_docs in ((0, 60, 3, 150), (1, 25, 2, 30), (2, 200, 4, 400)):  # corpora over 100: map@100 and @10 cut
        predictions, references, queries, corpus, relevant = _retrieval_case(seed, n, k, n_docs, d=4)
        evaluator = st_eval.InformationRetrievalEvaluator(
            queries={f"q{i}": "" for i in range(n)}, corpus={f"d{j}": "" for j in range(len(corpus))},
            relevant_docs={f"q{i}": {f"d{relevant[i]}"} for i in range(n)}, score_functions={"cosine": cos_sim}, write_csv=False,
        )

        class Anchors:
            def encode_query(self, *args, **kwargs):
                return torch.as_tensor(queries)

        got = evaluator.compute_all_metrics(Anchors(), corpus_embeddings=torch.as_tensor(corpus))["cosine"]
        ours = retrieval_metrics(predictions, references)
        assert 0 < ours["recall_at_10"] < 1 and ours["map_at_100"] > ours["mrr_at_10"]  # the cutoffs matter in these cases
        expected = {"ndcg_at_10": got["ndcg@k"][10], "mrr_at_10": got["mrr@k"][10], "map_at_100": got["map@k"][100],
                    "recall_at_1": got["recall@k"][1], "recall_at_10": got["recall@k"][10]}
        assert ours == pytest.approx(expected, abs=1e-6)
        assert got["precision@k"][1] == pytest.approx(ours["recall_at_1"]) and got["accuracy@k"][10] == pytest.approx(ours["recall_at_10"])


def test_retrieval_metrics_by_hand_with_a_shared_document():
    """Records 0 and 2 share their positive (one document, doc id 7): the corpus is {7, 8, 9}."""
    e = np.eye(3)
    predictions = np.stack([
        [e[0], e[0], e[1]],  # anchor on doc 7: rank 1
        [e[1] + 0.5 * e[2], e[2], e[1]],  # positive 9 scores below 8: rank 2
        [e[1], 5 * e[0], e[2]],  # its positive 7 (the first occurrence's vector, e0, counts) is orthogonal: 7, 8, 9 -> 0, 1, 0: rank 3 (ties pessimistic)
    ])
    references = np.array([[7, 8], [9, 8], [7, 9]])
    assert retrieval_ranks(predictions, references).tolist() == [1, 2, 3]
    out = retrieval_metrics(predictions, references)
    assert out == pytest.approx({
        "ndcg_at_10": (1 + 1 / np.log2(3) + 1 / np.log2(4)) / 3, "mrr_at_10": (1 + 1 / 2 + 1 / 3) / 3,
        "map_at_100": (1 + 1 / 2 + 1 / 3) / 3, "recall_at_1": 1 / 3, "recall_at_10": 1.0,
    })
    assert task_metrics("embedding", predictions, references) == out
    assert set(RETRIEVAL) == set(out)


def test_a_collapsed_model_scores_worst_never_best(monkeypatch):
    n = 30
    references = np.arange(2 * n).reshape(n, 2)  # 60 documents
    same = np.ones((n, 3, 4), dtype=np.float32)
    assert retrieval_ranks(same, references).tolist() == [2 * n] * n  # every positive ties with every document
    assert retrieval_metrics(same, references) == {**{name: 0.0 for name in RETRIEVAL}, "map_at_100": 1 / (2 * n)}  # the last of 60
    assert retrieval_ranks(np.zeros((n, 3, 4)), references).tolist() == [2 * n] * n  # zero vectors: cosine 0, all ties
    broken = np.random.default_rng(0).normal(size=(n, 3, 4))
    broken[:, 0] = np.nan  # a diverged model's anchors
    assert retrieval_ranks(broken, references).tolist() == [2 * n] * n
    predictions, references, *_ = _retrieval_case(5, 50, 3, 120)
    whole = retrieval_ranks(predictions, references)
    from pipelines import metrics

    monkeypatch.setattr(metrics, "RETRIEVAL_SCORE_CELLS", 7 * 100)  # blocks of 7 anchors: the same ranks
    np.testing.assert_array_equal(retrieval_ranks(predictions, references), whole)


def test_retrieval_input_errors():
    with pytest.raises(ValueError, match="no queries"):
        retrieval_metrics(np.zeros((0, 2, 4)), np.zeros((0, 1), dtype=np.int64))
    with pytest.raises(ValueError, match="no queries"):
        retrieval_metrics([], [])
    with pytest.raises(ValueError, match=r"predictions must be \(N, K, D\)"):
        retrieval_metrics(np.zeros((3, 1, 4)), np.zeros((3, 0), dtype=np.int64))
    with pytest.raises(ValueError, match=r"references must be the candidates' doc ids, shape \(3, 2\)"):
        retrieval_metrics(np.zeros((3, 3, 4)), np.zeros((3, 3), dtype=np.int64))
