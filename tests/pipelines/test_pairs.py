"""NSP (BERT) and SOP (ALBERT) pair construction: labels, provenance, format, keying.

Every token id of the test corpus is unique, so a token tells its document and its position in
that document's text, and "consecutive text" can be checked exactly.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pipelines.pairs import build_nsp_pairs, build_sop_pairs

PAD, CLS, SEP, MASK = 0, 1, 2, 3
FIRST = 5  # first non-special id


def make_corpus(n_docs: int, seed: int = 0, sent_len=(3, 14), n_sent=(2, 30)):
    """Documents with unique token ids; returns (docs, doc_of_token, pos_of_token, vocab)."""
    rng = np.random.default_rng(seed)
    docs, next_id, doc_of, pos_of = [], FIRST, [], []
    for d in range(n_docs):
        doc, pos = [], 0
        for _ in range(rng.integers(*n_sent)):
            n = int(rng.integers(*sent_len))
            doc.append(np.arange(next_id, next_id + n, dtype=np.int32))
            doc_of += [d] * n
            pos_of += list(range(pos, pos + n))
            next_id, pos = next_id + n, pos + n
        docs.append(doc)
    doc_of = np.array([-1] * FIRST + doc_of)
    pos_of = np.array([-1] * FIRST + pos_of)
    vocab = SimpleNamespace(vocab_size=next_id, pad_id=PAD, cls_id=CLS, sep_id=SEP, mask_id=MASK, special_ids=np.arange(5))
    return docs, doc_of, pos_of, vocab


def segments(batch, k):
    """Segments A and B of pair k, checked against the [CLS] A [SEP] B [SEP] layout."""
    ids, att, tt = batch["input_ids"][k], batch["attention_mask"][k], batch["token_type_ids"][k]
    n = int(att.sum())
    assert (att[:n] == 1).all() and (att[n:] == 0).all() and (ids[n:] == PAD).all()
    seps = np.flatnonzero(ids[:n] == SEP)
    assert ids[0] == CLS and len(seps) == 2 and seps[1] == n - 1
    a, b = ids[1 : seps[0]], ids[seps[0] + 1 : n - 1]
    assert len(a) >= 1 and len(b) >= 1
    np.testing.assert_array_equal(tt[: seps[0] + 1], 0)
    np.testing.assert_array_equal(tt[seps[0] + 1 : n], 1)
    assert (tt[n:] == 0).all()
    return a, b


@pytest.fixture(scope="module")
def corpus():
    return make_corpus(300, seed=1)


@pytest.fixture(scope="module")
def nsp(corpus):
    docs, _, _, vocab = corpus
    return [build_nsp_pairs(docs, 64, 7, epoch, 10_000, vocab) for epoch in range(3)]


@pytest.fixture(scope="module")
def sop(corpus):
    docs, _, _, vocab = corpus
    return [build_sop_pairs(docs, 64, 7, epoch, 10_000, vocab) for epoch in range(3)]


def test_columns_and_lengths(corpus, nsp, sop):
    for batch in nsp + sop:
        n = len(batch["next_sentence_label"])
        assert n > 500
        for col in ("input_ids", "attention_mask", "token_type_ids"):
            assert batch[col].shape == (n, 64) and batch[col].dtype == np.int64
        for col in ("next_sentence_label", "sample_id", "epoch"):
            assert batch[col].shape == (n,) and batch[col].dtype == np.int64
        np.testing.assert_array_equal(batch["sample_id"], 10_000 + np.arange(n))
        assert set(np.unique(batch["next_sentence_label"])) == {0, 1}


@pytest.mark.parametrize("build", [build_nsp_pairs, build_sop_pairs])
def test_labels_are_balanced(build, corpus):
    docs, _, _, vocab = corpus
    labels = np.concatenate([build(docs, 32, 3, epoch, 0, vocab)["next_sentence_label"] for epoch in range(8)])
    assert len(labels) > 10_000
    assert abs(labels.mean() - 0.5) < 0.02


def test_nsp_true_next_is_consecutive_and_random_is_another_document(corpus, nsp):
    _, doc_of, pos_of, _ = corpus
    for batch in nsp:
        for k, label in enumerate(batch["next_sentence_label"]):
            a, b = segments(batch, k)
            # Each segment is a contiguous stretch of one document (truncation only cuts its ends).
            for seg in (a, b):
                assert len(set(doc_of[seg])) == 1
                np.testing.assert_array_equal(np.diff(pos_of[seg]), 1)
            if label == 0:
                assert doc_of[a[0]] == doc_of[b[0]] and pos_of[b[0]] > pos_of[a[-1]]
                if len(a) + len(b) < 61:  # not truncated: B starts right where A ends
                    assert pos_of[b[0]] == pos_of[a[-1]] + 1
            else:
                assert doc_of[a[0]] != doc_of[b[0]]


def test_sop_swapped_pairs_are_the_reversed_consecutive_pair(corpus, sop):
    _, doc_of, pos_of, _ = corpus
    for batch in sop:
        for k, label in enumerate(batch["next_sentence_label"]):
            a, b = segments(batch, k)
            assert len(set(doc_of[np.concatenate([a, b])])) == 1  # one document
            for seg in (a, b):
                np.testing.assert_array_equal(np.diff(pos_of[seg]), 1)
            first, second = (a, b) if label == 0 else (b, a)
            assert pos_of[second[0]] > pos_of[first[-1]]
            if len(a) + len(b) < 61:
                assert pos_of[second[0]] == pos_of[first[-1]] + 1


def test_long_sentences_are_truncated_to_fit():
    docs, _, pos_of, vocab = make_corpus(40, seed=2, sent_len=(40, 90), n_sent=(2, 6))
    for build in (build_nsp_pairs, build_sop_pairs):
        batch = build(docs, 32, 0, 0, 0, vocab)
        assert (batch["attention_mask"].sum(axis=1) <= 32).all()
        for k in range(len(batch["next_sentence_label"])):
            a, b = segments(batch, k)
            assert len(a) + len(b) <= 29
            for seg in (a, b):
                np.testing.assert_array_equal(np.diff(pos_of[seg]), 1)


def test_keyed_by_seed_and_epoch(corpus, nsp):
    docs, _, _, vocab = corpus
    again = build_nsp_pairs(docs, 64, 7, 0, 10_000, vocab)
    for col, value in again.items():
        np.testing.assert_array_equal(value, nsp[0][col], err_msg=col)
    assert not np.array_equal(nsp[0]["next_sentence_label"][:200], nsp[1]["next_sentence_label"][:200])
    assert (nsp[1]["epoch"] == 1).all()
    other_seed = build_nsp_pairs(docs, 64, 8, 0, 10_000, vocab)
    assert not np.array_equal(other_seed["next_sentence_label"][:200], nsp[0]["next_sentence_label"][:200])
    # A different base id (another shard) keys different decisions.
    other_base = build_nsp_pairs(docs, 64, 7, 0, 99, vocab)
    np.testing.assert_array_equal(other_base["sample_id"][:3], [99, 100, 101])
    assert not np.array_equal(other_base["next_sentence_label"][:200], nsp[0]["next_sentence_label"][:200])


def test_large_base_sample_id_wraps_into_int64(corpus):
    docs, _, _, vocab = corpus
    batch = build_sop_pairs(docs[:5], 64, 0, 0, 2**63 - 2, vocab)
    assert batch["sample_id"].dtype == np.int64
    assert batch["sample_id"][0] == 2**63 - 2 and batch["sample_id"][2] == -(2**63)


def test_single_document_gives_only_true_next(corpus):
    docs, _, _, vocab = corpus
    batch = build_nsp_pairs(docs[:1], 64, 0, 0, 0, vocab)
    assert len(batch["sample_id"]) > 0 and (batch["next_sentence_label"] == 0).all()


def test_empty_input_and_errors(corpus):
    _, _, _, vocab = corpus
    empty = build_nsp_pairs([[], [np.array([], dtype=np.int32)]], 64, 0, 0, 0, vocab)
    assert empty["input_ids"].shape == (0, 64) and empty["next_sentence_label"].shape == (0,)
    with pytest.raises(ValueError, match="seq_len"):
        build_nsp_pairs([[np.array([5, 6])]], 4, 0, 0, 0, vocab)
    with pytest.raises(ValueError, match="document 1, sentence 0"):
        build_sop_pairs([[np.array([5, 6])], [np.array([vocab.vocab_size])]], 64, 0, 0, 0, vocab)
