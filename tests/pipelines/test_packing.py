"""FULL-SENTENCES packing: no token lost or reordered, shapes, streaming == one-shot, padding."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.packing import COLUMNS, Packer, concat_rows, pack_documents

PAD, CLS, SEP = 0, 101, 102
FIRST_ID, VOCAB = 1000, 5000  # document tokens never collide with the special ids


def random_docs(seed: int, n_docs: int = 200, max_len: int = 300) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, size=n_docs)
    lengths[rng.random(n_docs) < 0.1] = 0  # some empty documents
    return [rng.integers(FIRST_ID, VOCAB, size=n).astype(np.int32) for n in lengths]


def unpack(out: dict[str, np.ndarray]) -> np.ndarray:
    """The token stream back: per row, what lies between [CLS] and the last real token ([SEP])."""
    pieces = []
    for ids, mask in zip(out["input_ids"], out["attention_mask"]):
        n = int(mask.sum())
        assert ids[0] == CLS and ids[n - 1] == SEP, ids
        pieces.append(ids[1 : n - 1])
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def expected_stream(docs: list[np.ndarray]) -> np.ndarray:
    parts = []
    for d in (d for d in docs if len(d)):
        if parts:
            parts.append(np.array([SEP]))
        parts.append(d)
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


@pytest.mark.parametrize("seq_len", [3, 16, 128, 512])
def test_every_token_once_in_order(seq_len):
    docs = random_docs(seed=seq_len)
    out = pack_documents(docs, seq_len, CLS, SEP, PAD)
    stream = unpack(out)
    np.testing.assert_array_equal(stream, expected_stream(docs))  # documents joined by exactly one [SEP]
    doc_tokens = stream[stream != SEP]
    np.testing.assert_array_equal(doc_tokens, np.concatenate(docs))


@pytest.mark.parametrize("seq_len", [3, 16, 512])
def test_shapes_and_dtypes(seq_len):
    docs = random_docs(seed=1)
    out = pack_documents(docs, seq_len, CLS, SEP, PAD)
    n_stream = expected_stream(docs).size
    n_rows = -(-n_stream // (seq_len - 2))
    assert set(out) == set(COLUMNS)
    for name in COLUMNS:
        assert out[name].shape == (n_rows, seq_len) and out[name].dtype == np.int64, name
    assert (out["token_type_ids"] == 0).all()


def test_attention_mask_matches_padding():
    docs = random_docs(seed=2)
    seq_len = 64
    out = pack_documents(docs, seq_len, CLS, SEP, PAD)
    ids, mask = out["input_ids"], out["attention_mask"]
    assert set(np.unique(mask)) <= {0, 1}
    assert (mask[:-1] == 1).all()  # only the last row may be padded
    n_real = int(mask[-1].sum())
    assert (mask[-1, :n_real] == 1).all() and (mask[-1, n_real:] == 0).all()  # padding only at the end
    assert (ids[mask == 0] == PAD).all()
    assert not (ids[mask == 1] == PAD).any()
    tail = expected_stream(docs).size % (seq_len - 2)
    assert n_real == (tail + 2 if tail else seq_len)


def test_exact_multiple_has_no_padded_row():
    docs = [np.arange(FIRST_ID, FIRST_ID + 7), np.arange(FIRST_ID, FIRST_ID + 6)]  # 7 + [SEP] + 6 = 14 = 2 x 7
    out = pack_documents(docs, 9, CLS, SEP, PAD)
    assert out["input_ids"].shape == (2, 9) and (out["attention_mask"] == 1).all()


@pytest.mark.parametrize("chunk_seed", [0, 1, 2])
def test_streaming_equals_one_shot(chunk_seed):
    docs = random_docs(seed=3)
    seq_len = 32
    whole = pack_documents(docs, seq_len, CLS, SEP, PAD)
    rng = np.random.default_rng(chunk_seed)
    packer = Packer(seq_len, CLS, SEP, PAD)
    parts, i = [], 0
    while i < len(docs):
        k = int(rng.integers(0, 4))  # 0..3 documents per call, empty calls included
        parts.append(packer.add(docs[i : i + k]))
        i += k
    parts.append(packer.flush())
    streamed = concat_rows(parts, seq_len)
    for name in COLUMNS:
        np.testing.assert_array_equal(streamed[name], whole[name], err_msg=name)
    assert sum(p["input_ids"].shape[0] for p in parts[:-1]) == whole["input_ids"].shape[0] - parts[-1]["input_ids"].shape[0]


def test_add_returns_only_full_rows_and_keeps_the_rest():
    packer = Packer(6, CLS, SEP, PAD)  # 4 tokens per row
    first = packer.add([np.arange(FIRST_ID, FIRST_ID + 6)])
    assert first["input_ids"].shape == (1, 6) and (first["attention_mask"] == 1).all()
    second = packer.add([np.arange(FIRST_ID + 10, FIRST_ID + 11)])  # 2 kept + [SEP] + 1 = 4: one more full row
    np.testing.assert_array_equal(second["input_ids"], [[CLS, FIRST_ID + 4, FIRST_ID + 5, SEP, FIRST_ID + 10, SEP]])
    tail = packer.flush()
    assert tail["input_ids"].shape == (0, 6)


def test_packer_is_reusable_after_flush():
    docs = random_docs(seed=4, n_docs=20)
    packer = Packer(40, CLS, SEP, PAD)
    runs = [concat_rows([packer.add(docs), packer.flush()], 40) for _ in range(2)]
    for name in COLUMNS:
        np.testing.assert_array_equal(runs[0][name], runs[1][name])


def test_empty_inputs():
    for docs in ([], [np.zeros(0, dtype=np.int64)] * 3):
        out = pack_documents(docs, 16, CLS, SEP, PAD)
        for name in COLUMNS:
            assert out[name].shape == (0, 16) and out[name].dtype == np.int64
    packer = Packer(16, CLS, SEP, PAD)
    assert packer.add([])["input_ids"].shape == (0, 16)
    assert packer.flush()["input_ids"].shape == (0, 16)
    assert concat_rows([], 16)["input_ids"].shape == (0, 16)


def test_empty_documents_add_no_separator():
    a, b = np.array([FIRST_ID, FIRST_ID + 1]), np.array([FIRST_ID + 2])
    out = pack_documents([np.zeros(0, int), a, np.zeros(0, int), np.zeros(0, int), b], 8, CLS, SEP, PAD)
    np.testing.assert_array_equal(out["input_ids"], [[CLS, FIRST_ID, FIRST_ID + 1, SEP, FIRST_ID + 2, SEP, PAD, PAD]])


def test_inputs_not_modified():
    docs = random_docs(seed=5, n_docs=10)
    before = [d.copy() for d in docs]
    pack_documents(docs, 16, CLS, SEP, PAD)
    for d, b in zip(docs, before):
        np.testing.assert_array_equal(d, b)


def test_bad_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        Packer(2, CLS, SEP, PAD)
    with pytest.raises(ValueError, match="integer"):
        pack_documents([np.array([1.5, 2.5])], 8, CLS, SEP, PAD)
