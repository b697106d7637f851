"""MLM masking: rates, invariants, keyed reproducibility, whole words, config errors."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pipelines.masking import IGNORE_INDEX, MlmConfig, VocabInfo, mask_tokens

V = 1000
PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
SPECIAL = (PAD, UNK, CLS, SEP, MASK)
SEED = 17


def make_vocab(word_start_fraction: float = 0.7) -> VocabInfo:
    rng = np.random.default_rng(0)
    word_start = rng.random(V) < word_start_fraction
    word_start[list(SPECIAL)] = False  # VocabInfo must treat specials as word starts anyway
    return VocabInfo(vocab_size=V, pad_id=PAD, mask_id=MASK, cls_id=CLS, sep_id=SEP, special_ids=SPECIAL, word_start=word_start)


def make_batch(n_rows: int = 2048, length: int = 128, seed: int = 0, first_id: int = 0) -> dict[str, np.ndarray]:
    """[CLS] tokens (with a few inner [SEP]/[UNK]) [SEP] pad..., random lengths."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(len(SPECIAL), V, size=(n_rows, length))
    ids[rng.random((n_rows, length)) < 0.01] = SEP  # document separators inside packed rows
    ids[rng.random((n_rows, length)) < 0.005] = UNK
    lengths = rng.integers(8, length + 1, size=n_rows)
    pos = np.arange(length)[None, :]
    ids[:, 0] = CLS
    ids[pos == lengths[:, None] - 1] = SEP
    ids[pos >= lengths[:, None]] = PAD
    return {
        "input_ids": ids.astype(np.int64),
        "attention_mask": (pos < lengths[:, None]).astype(np.int64),
        "token_type_ids": np.zeros((n_rows, length), dtype=np.int64),
        "sample_id": np.arange(first_id, first_id + n_rows, dtype=np.int64),
        "epoch": np.zeros(n_rows, dtype=np.int64),
    }


def eligible_of(batch: dict[str, np.ndarray]) -> np.ndarray:
    ids = batch["input_ids"]
    return ~np.isin(ids, SPECIAL) & (batch["attention_mask"] == 1)


def word_ids_reference(ids: np.ndarray, eligible: np.ndarray, vocab: VocabInfo) -> np.ndarray:
    """Word index per token, -1 for ineligible tokens; a plain loop, independent of the code under test."""
    out = np.full(ids.shape, -1, dtype=np.int64)
    word = -1
    for r in range(ids.shape[0]):
        prev_ok = False
        for t in range(ids.shape[1]):
            if not eligible[r, t]:
                prev_ok = False
                continue
            if not prev_ok or vocab.word_start[ids[r, t]]:
                word += 1
            out[r, t] = word
            prev_ok = True
    return out


@pytest.fixture(scope="module")
def vocab() -> VocabInfo:
    return make_vocab()


@pytest.fixture(scope="module")
def batch() -> dict[str, np.ndarray]:
    b = make_batch()
    assert eligible_of(b).sum() >= 100_000
    return b


@pytest.fixture(scope="module")
def masked(batch, vocab) -> dict[str, np.ndarray]:
    return mask_tokens(batch, SEED, MlmConfig(), vocab)


def test_selection_rate_is_15_percent(batch, masked):
    selected = masked["labels"] != IGNORE_INDEX
    rate = selected.sum() / eligible_of(batch).sum()
    assert abs(rate - 0.15) < 0.005, rate


def test_split_80_10_10(batch, masked):
    selected = masked["labels"] != IGNORE_INDEX
    orig, new = batch["input_ids"][selected], masked["input_ids"][selected]
    n = selected.sum()
    masked_frac = (new == MASK).sum() / n
    kept_frac = (new == orig).sum() / n  # includes the 1-in-995 random draw that hits the original id
    random_frac = ((new != MASK) & (new != orig)).sum() / n
    assert abs(masked_frac - 0.8) < 0.01, masked_frac
    assert abs(random_frac - 0.1) < 0.01, random_frac
    assert abs(kept_frac - 0.1) < 0.01, kept_frac


def test_never_selects_special_or_padding(batch, masked):
    ineligible = ~eligible_of(batch)
    assert (masked["labels"][ineligible] == IGNORE_INDEX).all()
    assert (masked["input_ids"][ineligible] == batch["input_ids"][ineligible]).all()


def test_attention_mask_zero_is_never_selected(vocab):
    b = make_batch(n_rows=256, length=64)
    b["input_ids"] = np.where(b["input_ids"] == PAD, 500, b["input_ids"])  # padding that is not pad_id
    out = mask_tokens(b, SEED, MlmConfig(mlm_probability=1.0), vocab)
    assert (out["labels"][b["attention_mask"] == 0] == IGNORE_INDEX).all()
    assert (out["labels"] != IGNORE_INDEX).sum() == eligible_of(b).sum()  # p=1 selects every eligible token


def test_labels_hold_originals_at_targets_only(batch, masked):
    selected = masked["labels"] != IGNORE_INDEX
    assert masked["labels"].dtype == np.int64 and masked["input_ids"].dtype == np.int64
    assert masked["labels"].shape == batch["input_ids"].shape
    assert (masked["labels"][selected] == batch["input_ids"][selected]).all()
    assert (masked["input_ids"][~selected] == batch["input_ids"][~selected]).all()


def test_random_replacements_are_never_special(batch, masked):
    selected = masked["labels"] != IGNORE_INDEX
    orig, new = batch["input_ids"][selected], masked["input_ids"][selected]
    replaced = new[(new != MASK) & (new != orig)]
    assert not np.isin(replaced, SPECIAL).any()
    # ...and spread over the vocabulary rather than a few ids
    assert np.unique(replaced).size > 0.8 * min(replaced.size, V - len(SPECIAL))


def test_other_columns_pass_through(batch, masked):
    for name in ("attention_mask", "token_type_ids", "sample_id", "epoch"):
        assert masked[name] is batch[name]
    assert set(masked) == set(batch) | {"labels"}


def test_input_is_not_modified(vocab):
    b = make_batch(n_rows=64)
    before = {k: v.copy() for k, v in b.items()}
    for whole_word in (False, True):
        out = mask_tokens(b, SEED, MlmConfig(whole_word=whole_word), vocab)
        assert out["input_ids"] is not b["input_ids"]
        for k in before:
            np.testing.assert_array_equal(b[k], before[k])


def test_same_key_same_row_whatever_the_batch(vocab):
    for whole_word in (False, True):
        cfg = MlmConfig(whole_word=whole_word)
        a = make_batch(n_rows=32, seed=1, first_id=100)
        other = make_batch(n_rows=32, seed=2, first_id=900)
        full = mask_tokens(a, SEED, cfg, vocab)
        # The same rows, shuffled and mixed with other rows, in a bigger batch.
        order = np.random.default_rng(3).permutation(64)
        mixed = {k: np.concatenate([a[k], other[k]])[order] for k in a}
        out = mask_tokens(mixed, SEED, cfg, vocab)
        back = np.argsort(order)[:32]  # where each row of `a` went
        np.testing.assert_array_equal(out["input_ids"][back], full["input_ids"])
        np.testing.assert_array_equal(out["labels"][back], full["labels"])
        # One row alone.
        one = mask_tokens({k: v[5:6] for k, v in a.items()}, SEED, cfg, vocab)
        np.testing.assert_array_equal(one["labels"][0], full["labels"][5])
        # The same rows padded to a longer T (dynamic padding): same targets on the common part.
        extra = 40
        wide = dict(a)
        wide["input_ids"] = np.pad(a["input_ids"], ((0, 0), (0, extra)), constant_values=PAD)
        wide["attention_mask"] = np.pad(a["attention_mask"], ((0, 0), (0, extra)))
        out = mask_tokens(wide, SEED, cfg, vocab)
        np.testing.assert_array_equal(out["input_ids"][:, :-extra], full["input_ids"])
        np.testing.assert_array_equal(out["labels"][:, :-extra], full["labels"])


def test_rerun_is_identical(batch, vocab, masked):
    again = mask_tokens(batch, SEED, MlmConfig(), vocab)
    np.testing.assert_array_equal(again["input_ids"], masked["input_ids"])
    np.testing.assert_array_equal(again["labels"], masked["labels"])


def test_epoch_and_seed_change_the_masks(batch, vocab, masked):
    next_epoch = dict(batch, epoch=np.ones_like(batch["epoch"]))
    for other in (mask_tokens(next_epoch, SEED, MlmConfig(), vocab), mask_tokens(batch, SEED + 1, MlmConfig(), vocab)):
        a, b = masked["labels"] != IGNORE_INDEX, other["labels"] != IGNORE_INDEX
        # Independent 15% draws overlap on ~15% of the targets; identical ones on 100%.
        overlap = (a & b).sum() / a.sum()
        assert overlap < 0.2, overlap
        assert abs(b.sum() / a.sum() - 1) < 0.05


def test_whole_word_never_splits_a_word(vocab):
    b = make_batch(n_rows=1024, length=128, seed=5)
    eligible = eligible_of(b)
    words = word_ids_reference(b["input_ids"], eligible, vocab)
    out = mask_tokens(b, SEED, MlmConfig(whole_word=True), vocab)
    selected = out["labels"] != IGNORE_INDEX
    assert not selected[~eligible].any()
    w, s = words[eligible], selected[eligible]
    n_words = w.max() + 1
    per_word_selected = np.bincount(w, weights=s, minlength=n_words)
    per_word_size = np.bincount(w, minlength=n_words)
    assert ((per_word_selected == 0) | (per_word_selected == per_word_size)).all(), "a word was partly selected"
    assert (per_word_size > 1).sum() > 10_000  # the check above had many multi-piece words to break
    word_rate = (per_word_selected > 0).mean()
    token_rate = s.mean()
    assert abs(word_rate - 0.15) < 0.005, word_rate
    assert abs(token_rate - 0.15) < 0.01, token_rate
    # 80/10/10 still applies per token among the targets.
    new = out["input_ids"][selected]
    assert abs((new == MASK).mean() - 0.8) < 0.015


def test_whole_word_continuation_after_special_starts_a_word(vocab):
    cont = np.flatnonzero(~vocab.word_start & ~vocab.is_special)[:3]  # three "##" pieces
    head = np.flatnonzero(vocab.word_start & ~vocab.is_special)[0]
    row = np.array([CLS, cont[0], cont[1], head, cont[2], SEP, cont[0], PAD])
    n = 2000
    b = {
        "input_ids": np.tile(row, (n, 1)),
        "attention_mask": np.tile((row != PAD).astype(np.int64), (n, 1)),
        "sample_id": np.arange(n, dtype=np.int64),
        "epoch": np.zeros(n, dtype=np.int64),
    }
    sel = mask_tokens(b, SEED, MlmConfig(whole_word=True), vocab)["labels"] != IGNORE_INDEX  # (n, 8)
    np.testing.assert_array_equal(sel[:, 1], sel[:, 2])  # ##a ##b after [CLS]: one word
    np.testing.assert_array_equal(sel[:, 3], sel[:, 4])  # word ##c: one word
    assert not sel[:, [0, 5, 7]].any()
    for col in (1, 3, 6):  # a headless word is still a word, selected at the usual rate
        assert 0.11 < sel[:, col].mean() < 0.19, (col, sel[:, col].mean())
    assert 0.0 < (sel[:, 1] != sel[:, 3]).mean()  # different words, different draws


def test_whole_word_headless_word_draws_at_its_first_piece(vocab):
    """A continuation piece after [CLS] starts its own word, decided by its own draw: the same
    decision as a word-start piece at that position (not the draw of the [CLS] before it)."""
    cont = np.flatnonzero(~vocab.word_start & ~vocab.is_special)[:2]
    head = np.flatnonzero(vocab.word_start & ~vocab.is_special)[0]
    n = 2000
    rows = {"headless": [CLS, cont[0], cont[1], SEP], "headed": [CLS, head, cont[1], SEP]}
    sel = {}
    for name, row in rows.items():
        b = {"input_ids": np.tile(row, (n, 1)), "sample_id": np.arange(n), "epoch": np.zeros(n, np.int64)}
        sel[name] = mask_tokens(b, SEED, MlmConfig(whole_word=True), vocab)["labels"] != IGNORE_INDEX
    np.testing.assert_array_equal(sel["headless"], sel["headed"])


def test_whole_word_needs_word_start():
    vocab = VocabInfo(vocab_size=V, pad_id=PAD, mask_id=MASK, cls_id=CLS, sep_id=SEP, special_ids=SPECIAL)
    with pytest.raises(ValueError, match="word_start"):
        mask_tokens(make_batch(n_rows=4), SEED, MlmConfig(whole_word=True), vocab)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mlm_probability": 1.5}, "mlm_probability"),
        ({"mlm_probability": -0.1}, "mlm_probability"),
        ({"mask_fraction": 2.0}, "mask_fraction"),
        ({"random_fraction": -1.0}, "random_fraction"),
        ({"mask_fraction": 0.9, "random_fraction": 0.2}, "random_fraction"),
        ({"mlm_probability": "0.15"}, "mlm_probability"),
        ({"whole_word": 1}, "whole_word"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        MlmConfig(**kwargs)


def test_bad_vocab_names_the_field():
    with pytest.raises(ValueError, match="word_start"):
        VocabInfo(vocab_size=V, pad_id=PAD, mask_id=MASK, cls_id=CLS, sep_id=SEP, special_ids=SPECIAL, word_start=np.ones(V - 1, bool))
    with pytest.raises(ValueError, match="mask_id"):
        VocabInfo(vocab_size=V, pad_id=PAD, mask_id=V, cls_id=CLS, sep_id=SEP, special_ids=SPECIAL)


def test_bad_batch_errors(vocab):
    b = make_batch(n_rows=4)
    with pytest.raises(ValueError, match="sample_id"):
        mask_tokens({k: v for k, v in b.items() if k != "sample_id"}, SEED, MlmConfig(), vocab)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        mask_tokens(dict(b, input_ids=b["input_ids"] + V), SEED, MlmConfig(), vocab)


def test_vocab_from_tokenizer_duck_typed():
    word_start = np.ones(V, dtype=bool)
    tok = SimpleNamespace(
        vocab_size=V, pad_id=PAD, unk_id=UNK, cls_id=CLS, sep_id=SEP, mask_id=MASK, special_ids=np.array(SPECIAL), word_start=word_start
    )
    vocab = VocabInfo.from_tokenizer(tok)
    assert vocab.special_ids == SPECIAL and vocab.mask_id == MASK
    assert vocab.is_special.sum() == len(SPECIAL)
    assert vocab.replacement_ids.size == V - len(SPECIAL) and not np.isin(vocab.replacement_ids, SPECIAL).any()
    assert vocab.starts_word.all()


def test_empty_batch(vocab):
    b = make_batch(n_rows=4)
    empty = {k: v[:0] for k, v in b.items()}
    out = mask_tokens(empty, SEED, MlmConfig(), vocab)
    assert out["input_ids"].shape == (0, b["input_ids"].shape[1]) and out["labels"].shape == out["input_ids"].shape


def test_int32_ids_give_int64_outputs(batch, vocab, masked):
    b32 = dict(batch, input_ids=batch["input_ids"].astype(np.int32))
    out = mask_tokens(b32, SEED, MlmConfig(), vocab)
    assert out["input_ids"].dtype == np.int64
    np.testing.assert_array_equal(out["labels"], masked["labels"])


def test_selects_what_hugging_face_selects_at_p1(minilm_dir):
    """With every eligible token a target and every target masked, the outcome is deterministic:
    our special-token handling must pick the same positions as DataCollatorForLanguageModeling.
    (One deliberate difference is left out of the texts: a literal "[MASK]" typed in the text is a
    target for Hugging Face, whose special_tokens_mask marks only the added [CLS]/[SEP]/[PAD], but
    never for us.)"""
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm_dir))
    texts = ["Whole-word masking doesn't split words.", "A short one.", "Padding fills the rest of this batch, so the three rows differ in length."]
    enc = tok(texts, padding=True, return_special_tokens_mask=True, return_tensors="np")
    vocab = VocabInfo(
        vocab_size=len(tok), pad_id=tok.pad_token_id, mask_id=tok.mask_token_id, cls_id=tok.cls_token_id, sep_id=tok.sep_token_id,
        special_ids=tuple(tok.all_special_ids),
    )
    ours = mask_tokens(
        {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "sample_id": np.arange(3), "epoch": np.zeros(3, np.int64)},
        SEED, MlmConfig(mlm_probability=1.0, mask_fraction=1.0, random_fraction=0.0), vocab,
    )
    collator = transformers.DataCollatorForLanguageModeling(tok, mlm_probability=1.0, mask_replace_prob=1.0, random_replace_prob=0.0, return_tensors="np")
    theirs = collator([{"input_ids": enc["input_ids"][i], "special_tokens_mask": enc["special_tokens_mask"][i]} for i in range(3)])
    np.testing.assert_array_equal(ours["labels"], theirs["labels"])
    np.testing.assert_array_equal(ours["input_ids"], theirs["input_ids"])
