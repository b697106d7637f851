"""SpanBERT span masking and ALBERT n-gram masking: distributions, word integrity, SBO, keying."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pipelines.spans import NgramConfig, SpanConfig, ngram_mask, span_mask

V = 1000
PAD, CLS, SEP, MASK = 0, 1, 2, 3
SPECIALS = np.array([0, 1, 2, 3, 4])
WORD_START = np.ones(V, dtype=bool)
WORD_START[700:] = False  # ids >= 700 continue a word (~30% of pieces): words of 1-3+ pieces
VOCAB = SimpleNamespace(vocab_size=V, pad_id=PAD, cls_id=CLS, sep_id=SEP, mask_id=MASK, special_ids=SPECIALS, word_start=WORD_START)


def make_batch(n_rows: int, length: int, seed: int = 0, min_len: int = 32, epoch: int = 0) -> dict[str, np.ndarray]:
    """[CLS] pieces ... [SEP] then padding, random lengths."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, V, size=(n_rows, length))
    lens = rng.integers(min(min_len, length), length + 1, size=n_rows)
    pos = np.arange(length)
    ids[pos[None, :] >= lens[:, None]] = PAD
    ids[:, 0] = CLS
    ids[np.arange(n_rows), lens - 1] = SEP
    return {
        "input_ids": ids,
        "attention_mask": (pos[None, :] < lens[:, None]).astype(np.int64),
        "token_type_ids": np.zeros_like(ids),
        "sample_id": np.arange(n_rows, dtype=np.int64) + 1000 * seed,
        "epoch": np.full(n_rows, epoch, dtype=np.int64),
    }


def runs(masked: np.ndarray):
    """(row, start, end) of every maximal run of True, end exclusive."""
    padded = np.pad(masked, ((0, 0), (1, 1)))
    edges = np.diff(padded.astype(np.int8), axis=1)
    rs, starts = np.nonzero(edges == 1)
    re, ends = np.nonzero(edges == -1)
    assert (rs == re).all()
    return rs, starts, ends


def word_starts(ids: np.ndarray) -> np.ndarray:
    """The module's word starts: word_start, special tokens, and the token after a special/pad."""
    special = ids <= 4
    after = np.ones_like(special)
    after[:, 1:] = special[:, :-1]
    return WORD_START[ids] | special | after


def words_in(starts_row: np.ndarray, start: int, end: int) -> int:
    return int(starts_row[start:end].sum())


@pytest.fixture(scope="module")
def big_batch():
    return make_batch(1200, 512, seed=1, min_len=256)


@pytest.fixture(scope="module")
def span_out(big_batch):
    return span_mask(big_batch, 7, SpanConfig(), VOCAB)


@pytest.fixture(scope="module")
def ngram_out(big_batch):
    return ngram_mask(big_batch, 7, NgramConfig(), VOCAB)


def test_span_lengths_follow_clipped_geometric(big_batch, span_out):
    ws = word_starts(big_batch["input_ids"])
    rs, starts, ends = runs(span_out["labels"] != -100)
    n_words = np.array([words_in(ws[r], s, e) for r, s, e in zip(rs, starts, ends)])
    pmf = SpanConfig().length_pmf()
    assert abs(pmf @ np.arange(1, 11) - 3.8) < 0.01  # the paper's mean
    assert len(n_words) > 10_000
    assert n_words.min() >= 1 and n_words.max() <= 10
    assert abs(n_words.mean() - 3.8) < 0.1
    freq = np.bincount(n_words, minlength=11)[1:] / len(n_words)
    np.testing.assert_allclose(freq, pmf, atol=0.012)


def test_masked_fraction_and_budget(big_batch, span_out, ngram_out):
    ids, att = big_batch["input_ids"], big_batch["attention_mask"]
    eligible = (att == 1) & (ids > 4)
    n_eligible = eligible.sum(axis=1)
    budget = np.maximum(np.floor(0.15 * n_eligible + 0.5), 1)
    for out in (span_out, ngram_out):
        masked = out["labels"] != -100
        assert abs(masked.sum() / eligible.sum() - 0.15) < 0.01
        assert not (masked & ~eligible).any()  # never specials or padding
        # A row overshoots its budget by less than its longest span (only the last one may cross).
        rs, starts, ends = runs(masked)
        longest = np.zeros(len(ids), dtype=np.int64)
        np.maximum.at(longest, rs, ends - starts)
        assert (masked.sum(axis=1) < budget + longest).all()


def test_spans_are_whole_words(big_batch, span_out, ngram_out):
    starts_word = word_starts(big_batch["input_ids"])
    for out in (span_out, ngram_out):
        rs, starts, ends = runs(out["labels"] != -100)
        assert starts_word[rs, starts].all()  # a span starts at a word start
        assert starts_word[rs, ends].all()  # and the token after it starts a new word
        # Neighbouring spans are separated by at least one unmasked token (ends < next start).
        same_row = rs[1:] == rs[:-1]
        assert (starts[1:][same_row] > ends[:-1][same_row]).all()


def test_labels_hold_original_ids(big_batch, span_out):
    masked = span_out["labels"] != -100
    np.testing.assert_array_equal(span_out["labels"][masked], big_batch["input_ids"][masked])
    np.testing.assert_array_equal(span_out["input_ids"][~masked], big_batch["input_ids"][~masked])


def test_80_10_10_is_decided_per_span(big_batch, span_out):
    orig, new = big_batch["input_ids"], span_out["input_ids"]
    rs, starts, ends = runs(span_out["labels"] != -100)
    kinds = []
    for r, s, e in zip(rs, starts, ends):
        o, n = orig[r, s:e], new[r, s:e]
        if (n == MASK).all():
            kinds.append(0)
        elif (n == o).all():
            kinds.append(2)
        else:
            assert not (n == MASK).any(), "a span mixes [MASK] with other tokens"
            assert (n > 4).all(), "random replacements are never special ids"
            kinds.append(1)
    freq = np.bincount(kinds, minlength=3) / len(kinds)
    np.testing.assert_allclose(freq, [0.8, 0.1, 0.1], atol=0.02)


def test_sbo_targets(big_batch, span_out):
    labels = span_out["labels"]
    masked = labels != -100
    left, right, pos = span_out["sbo_left"], span_out["sbo_right"], span_out["sbo_pos"]
    for name in ("sbo_left", "sbo_right", "sbo_pos"):
        assert span_out[name].dtype == np.int64 and span_out[name].shape == labels.shape
    assert (left[~masked] == -1).all() and (right[~masked] == -1).all() and (pos[~masked] == 0).all()
    rs, starts, ends = runs(masked)
    for r, s, e in zip(rs[:3000], starts[:3000], ends[:3000]):
        assert (left[r, s:e] == s - 1).all()
        assert (right[r, s:e] == e).all()  # the token after the last one of the span
        np.testing.assert_array_equal(pos[r, s:e], np.arange(e - s))
    # The boundary tokens are real and not masked.
    rows = np.nonzero(masked)[0]
    att = big_batch["attention_mask"]
    assert (att[rows, left[masked]] == 1).all() and (att[rows, right[masked]] == 1).all()
    assert not masked[rows, left[masked]].any() and not masked[rows, right[masked]].any()


def test_ngram_lengths_and_per_token_split(big_batch, ngram_out):
    ids, new = big_batch["input_ids"], ngram_out["input_ids"]
    masked = ngram_out["labels"] != -100
    rs, starts, ends = runs(masked)
    ws = word_starts(ids)
    n_words = np.array([words_in(ws[r], s, e) for r, s, e in zip(rs, starts, ends)])
    assert n_words.min() >= 1 and n_words.max() <= 3
    freq = np.bincount(n_words, minlength=4)[1:] / len(n_words)
    np.testing.assert_allclose(freq, np.array([6, 3, 2]) / 11, atol=0.02)
    # 80/10/10 per token: [MASK], kept, or a random non-special id.
    is_mask = new[masked] == MASK
    kept = new[masked] == ids[masked]
    assert abs(is_mask.mean() - 0.8) < 0.02
    assert abs(kept.mean() - 0.1) < 0.02  # random == original has probability ~1/995
    assert abs((~is_mask & ~kept).mean() - 0.1) < 0.02
    # Per token, not per n-gram: some multi-token n-grams mix [MASK] with other ids.
    mixed = sum(1 for r, s, e in zip(rs, starts, ends) if e - s > 1 and 0 < (new[r, s:e] == MASK).sum() < e - s)
    assert mixed > 100


@pytest.mark.parametrize("fn,cfg", [(span_mask, SpanConfig()), (ngram_mask, NgramConfig())])
def test_keyed_by_seed_epoch_sample_id(fn, cfg):
    batch = make_batch(64, 128, seed=3)
    out = fn(batch, 11, cfg, VOCAB)
    # Same rows in another order, in two smaller batches, padded wider: same result per row.
    perm = np.random.default_rng(0).permutation(64)
    wide = {k: (np.pad(v[perm], ((0, 0), (0, 40))) if v.ndim == 2 else v[perm]) for k, v in batch.items()}
    out_wide = fn({k: v[:20] for k, v in wide.items()}, 11, cfg, VOCAB)
    out_wide2 = fn({k: v[20:] for k, v in wide.items()}, 11, cfg, VOCAB)
    for col in ("input_ids", "labels", *(("sbo_left", "sbo_right", "sbo_pos") if fn is span_mask else ())):
        got = np.concatenate([out_wide[col], out_wide2[col]])[:, :128]
        np.testing.assert_array_equal(got, out[col][perm], err_msg=col)
    np.testing.assert_array_equal(fn(batch, 11, cfg, VOCAB)["labels"], out["labels"])  # rerun
    other_epoch = fn({**batch, "epoch": batch["epoch"] + 1}, 11, cfg, VOCAB)
    other_seed = fn(batch, 12, cfg, VOCAB)
    assert (other_epoch["labels"] != out["labels"]).any(axis=1).mean() > 0.9
    assert (other_seed["labels"] != out["labels"]).any(axis=1).mean() > 0.9


def test_inputs_untouched_and_columns_passed_through():
    batch = make_batch(8, 64)
    before = {k: v.copy() for k, v in batch.items()}
    out = span_mask(batch, 0, SpanConfig(), VOCAB)
    for k, v in before.items():
        np.testing.assert_array_equal(batch[k], v)
    assert out["token_type_ids"] is batch["token_type_ids"]
    assert out["input_ids"].dtype == np.int64 and out["labels"].dtype == np.int64


def test_spans_never_cross_a_separator():
    # Packed rows: [CLS] a [SEP] b [SEP]; a span may not contain the middle [SEP].
    batch = make_batch(400, 64, seed=5, min_len=64)
    batch["input_ids"][:, 30] = SEP
    for fn, cfg in ((span_mask, SpanConfig()), (ngram_mask, NgramConfig())):
        out = fn(batch, 0, cfg, VOCAB)
        masked = out["labels"] != -100
        assert not masked[:, 30].any()
        assert masked[:, :30].any() and masked[:, 31:].any()


def test_short_and_empty_rows():
    batch = make_batch(4, 16, min_len=16)
    batch["attention_mask"][0] = 0
    batch["input_ids"][0] = PAD
    batch["attention_mask"][1, 3:] = 0  # [CLS] x y: y has no real right neighbour
    batch["input_ids"][1, 3:] = PAD
    out = span_mask(batch, 0, SpanConfig(), VOCAB)
    assert (out["labels"][0] == -100).all()
    assert (out["labels"][1, 2:] == -100).all()
    assert (out["labels"][2:] != -100).any(axis=1).all()  # a row with a budget masks something
    empty = {k: v[:0] for k, v in batch.items()}
    assert span_mask(empty, 0, SpanConfig(), VOCAB)["labels"].shape == (0, 16)
    assert ngram_mask(empty, 0, NgramConfig(), VOCAB)["labels"].shape == (0, 16)


def test_errors_name_the_problem():
    batch = make_batch(2, 16)
    with pytest.raises(ValueError, match="mask_ratio"):
        SpanConfig(mask_ratio=1.5)
    with pytest.raises(ValueError, match="max_ngram"):
        NgramConfig(max_ngram=0)
    with pytest.raises(ValueError, match="random_fraction"):
        SpanConfig(mask_fraction=0.9, random_fraction=0.2)
    with pytest.raises(ValueError, match="word_start"):
        span_mask(batch, 0, SpanConfig(), SimpleNamespace(**{**vars(VOCAB), "word_start": None}))
    with pytest.raises(ValueError, match="sample_id"):
        span_mask({"input_ids": batch["input_ids"]}, 0, SpanConfig(), VOCAB)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        span_mask({**batch, "input_ids": batch["input_ids"] + V}, 0, SpanConfig(), VOCAB)
