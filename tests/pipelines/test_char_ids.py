"""ELMo character ids: the reference encoding per token and the vectorised batch lookup."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipelines.char_ids import CHAR_VOCAB_SIZE, add_char_ids, build_char_table

BOW, EOW, PAD = 259, 260, 261  # shifted ids (raw 258, 259, 260)

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "##ing", "\u2581world", "café", "日本", "a", "##"]
SPECIAL = {"pad": 0, "unk": 1, "cls": 2, "sep": 3, "mask": 4}


def decode_row(row: np.ndarray) -> str:
    """Inverse of the encoding of an ordinary token: the bytes between the word markers."""
    assert row[0] == BOW
    end = int(np.flatnonzero(row == EOW)[0])
    assert (row[end + 1 :] == PAD).all()
    return bytes((row[1:end] - 1).astype(np.uint8).tolist()).decode("utf-8")


def test_round_trip_of_known_words_with_prefixes_stripped():
    table = build_char_table(VOCAB, special_ids=SPECIAL)
    expected = {5: "hello", 6: "ing", 7: "world", 8: "café", 9: "日本", 10: "a", 11: ""}
    for token_id, text in expected.items():
        assert decode_row(table[token_id]) == text


def test_reference_layout_of_a_word():
    row = build_char_table(["ab"], max_chars=8)[0]
    assert row.tolist() == [BOW, ord("a") + 1, ord("b") + 1, EOW, PAD, PAD, PAD, PAD]


def test_special_tokens_get_marker_rows():
    table = build_char_table(VOCAB, special_ids=SPECIAL)
    assert (table[0] == 0).all()  # [PAD]: the masking id everywhere
    markers = {2: 257, 3: 258, 1: 0xF5 + 1, 4: 0xF6 + 1}  # cls = <S>, sep = </S>, unk, mask
    for token_id, marker in markers.items():
        assert table[token_id, :3].tolist() == [BOW, marker, EOW]
        assert (table[token_id, 3:] == PAD).all()
    # Without special_ids the same strings are plain text, e.g. "[CLS]".
    assert decode_row(build_char_table(VOCAB)[2]) == "[CLS]"
    # Marker rows differ from every ordinary token's row.
    rows = {tuple(r) for r in table}
    assert len(rows) == len(VOCAB)


def test_truncation_keeps_the_end_of_word_marker():
    long = "x" * 60
    row = build_char_table([long], max_chars=50)[0]
    assert row[0] == BOW and row[-1] == EOW
    assert (row[1:-1] == ord("x") + 1).all()  # 48 bytes kept
    assert decode_row(row) == "x" * 48


def test_shape_dtype_and_range():
    table = build_char_table(VOCAB, max_chars=20, special_ids=SPECIAL)
    assert table.shape == (len(VOCAB), 20) and table.dtype == np.int32
    assert table.min() >= 0 and table.max() < CHAR_VOCAB_SIZE


def test_bad_special_ids_are_reported():
    with pytest.raises(ValueError, match="unknown role 'bos'"):
        build_char_table(VOCAB, special_ids={"bos": 2})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build_char_table(VOCAB, special_ids={"cls": 99})
    with pytest.raises(ValueError, match="share token id"):
        build_char_table(VOCAB, special_ids={"cls": 2, "sep": 2})
    assert (build_char_table(VOCAB, special_ids={"mask": None}) == build_char_table(VOCAB)).all()


def test_add_char_ids_looks_up_and_zeroes_padding():
    table = build_char_table(VOCAB, max_chars=16, special_ids=SPECIAL)
    ids = np.array([[2, 5, 6, 3, 0, 0], [2, 7, 8, 9, 10, 3]], dtype=np.int64)
    mask = np.array([[1, 1, 1, 1, 0, 0], [1] * 6], dtype=np.int64)
    batch = {"input_ids": ids, "attention_mask": mask}
    out = add_char_ids(batch, table)
    assert "char_ids" not in batch  # input untouched
    char_ids = out["char_ids"]
    assert char_ids.shape == (2, 6, 16) and char_ids.dtype == np.int64
    assert (char_ids[mask == 1] == table[ids[mask == 1]]).all()
    assert (char_ids[mask == 0] == 0).all()
    assert out["input_ids"] is ids and out["attention_mask"] is mask


def test_padding_rows_zero_even_for_non_pad_ids():
    table = build_char_table(VOCAB, special_ids=SPECIAL)
    ids = np.array([[5, 5]], dtype=np.int64)
    out = add_char_ids({"input_ids": ids, "attention_mask": np.array([[1, 0]])}, table)
    assert (out["char_ids"][0, 1] == 0).all() and (out["char_ids"][0, 0] != 0).all()


def test_out_of_range_ids_are_reported():
    table = build_char_table(VOCAB)
    with pytest.raises(ValueError, match="does not fit the char table"):
        add_char_ids({"input_ids": np.array([[len(VOCAB)]])}, table)
    with pytest.raises(ValueError, match="does not fit the char table"):
        add_char_ids({"input_ids": np.array([[-100]])}, table)


def test_batch_lookup_is_vectorised():
    rng = np.random.default_rng(0)
    vocab = ["".join(chr(97 + c) for c in rng.integers(0, 26, size=rng.integers(1, 12))) for _ in range(30_000)]
    table = build_char_table(vocab)
    ids = rng.integers(0, len(vocab), size=(256, 128))
    mask = np.ones_like(ids)
    mask[:, 100:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        out = add_char_ids(batch, table)
        best = min(best, time.perf_counter() - start)
    assert out["char_ids"].shape == (256, 128, 50)
    assert best < 0.1, f"256x128 lookup took {best * 1e3:.1f} ms"
