"""FULL-SENTENCES packing (RoBERTa sec. 4.2): whole sentences, document separators, every token once
in order, rows <= seq_len; equal to a plain-Python greedy reference; streaming == one-shot."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.packing import COLUMNS, Packer, block_starts, concat_rows, pack_documents, split_long

PAD, CLS, SEP = 0, 101, 102
FIRST_ID = 1000  # document tokens never collide with the special ids


def random_docs(seed: int, n_docs: int = 120, max_sents: int = 8, max_len: int = 40) -> list[list[np.ndarray]]:
    """Documents of sentences whose token ids are FIRST_ID + the token's position in the whole input,
    so every token names its sentence and document. Some sentences and documents are empty."""
    rng = np.random.default_rng(seed)
    docs, next_id = [], FIRST_ID
    for _ in range(n_docs):
        n_sents = int(rng.integers(0, max_sents + 1))
        lengths = rng.integers(1, max_len, size=n_sents)
        lengths[rng.random(n_sents) < 0.1] = 0  # empty sentences
        lengths[rng.random(n_sents) < 0.05] *= 6  # some sentences longer than small blocks
        doc = []
        for n in lengths:
            doc.append(np.arange(next_id, next_id + n, dtype=np.int32))
            next_id += n
        docs.append(doc)
    return docs


def reference_pack(docs: list[list[np.ndarray]], seq_len: int) -> list[list[int]]:
    """The rows' bodies (between [CLS] and [SEP]) by the definition, one sentence at a time."""
    body = seq_len - 2
    rows, cur, seen_doc = [], [], False
    for doc in docs:
        sents = [list(map(int, s)) for s in doc if len(s)]
        for k, sent in enumerate(sents):
            sep = [SEP] if (k == 0 and seen_doc) else []
            pieces = [sent[i : i + body] for i in range(0, len(sent), body)]
            for p, piece in enumerate(pieces):
                lead = sep if p == 0 else []
                if cur and len(cur) + len(lead) + len(piece) <= body:
                    cur += lead + piece
                else:
                    if cur:
                        rows.append(cur)
                    cur = list(piece)  # a block's first sentence drops its separator
        seen_doc = seen_doc or bool(sents)
    if cur:
        rows.append(cur)
    return rows


def bodies(out: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Per row, the tokens between [CLS] and the last real token ([SEP]); checks the frame."""
    out_rows = []
    for ids, mask in zip(out["input_ids"], out["attention_mask"]):
        n = int(mask.sum())
        assert (mask[:n] == 1).all() and (mask[n:] == 0).all()  # right-padded
        assert ids[0] == CLS and ids[n - 1] == SEP and (ids[n:] == PAD).all(), ids
        out_rows.append(ids[1 : n - 1])
    return out_rows


def doc_and_sentence_of(docs: list[list[np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token id - FIRST_ID: its document, its sentence and its sentence's length."""
    doc_of, sent_of, len_of = [], [], []
    s = 0
    for d, doc in enumerate(docs):
        for sent in doc:
            doc_of += [d] * len(sent)
            sent_of += [s] * len(sent)
            len_of += [len(sent)] * len(sent)
            s += 1
    return np.array(doc_of), np.array(sent_of), np.array(len_of)


SEQ_LENS = [3, 8, 16, 64, 512]


@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_equals_reference_greedy(seq_len):
    docs = random_docs(seed=seq_len)
    out = pack_documents(docs, seq_len, CLS, SEP, PAD)
    got = [list(map(int, b)) for b in bodies(out)]
    assert got == reference_pack(docs, seq_len)


@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_every_token_once_in_order_and_rows_fit(seq_len):
    docs = random_docs(seed=10 + seq_len)
    out = pack_documents(docs, seq_len, CLS, SEP, PAD)
    assert out["input_ids"].shape[1] == seq_len and (out["attention_mask"].sum(1) <= seq_len).all()
    stream = np.concatenate(bodies(out))
    everything = np.concatenate([s for d in docs for s in d]).astype(np.int64)
    np.testing.assert_array_equal(stream[stream != SEP], everything)


@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_no_sentence_cut_unless_longer_than_a_block(seq_len):
    body = seq_len - 2
    docs = random_docs(seed=20 + seq_len)
    _, sent_of, len_of = doc_and_sentence_of(docs)
    rows = [b[b != SEP] - FIRST_ID for b in bodies(pack_documents(docs, seq_len, CLS, SEP, PAD))]
    row_of = np.concatenate([np.full(r.size, i) for i, r in enumerate(rows)])  # (tokens,)
    sent = sent_of[np.concatenate(rows)]
    for s in np.unique(sent):
        in_rows = np.unique(row_of[sent == s])
        n = int(len_of[sent == s][0])
        if n <= body:
            assert in_rows.size == 1, f"sentence {s} of {n} tokens cut across rows {in_rows}"
        else:  # cut into full blocks, each a row of its own, and a remainder
            assert in_rows.size == -(-n // body)
            for r in in_rows[:-1]:
                assert rows[r].size == body and (sent_of[rows[r]] == s).all()


@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_separators_exactly_between_documents_inside_a_row(seq_len):
    docs = random_docs(seed=30 + seq_len)
    doc_of, _, _ = doc_and_sentence_of(docs)
    for b in bodies(pack_documents(docs, seq_len, CLS, SEP, PAD)):
        is_sep = b == SEP
        assert not is_sep[0] and not is_sep[-1]  # [CLS] / [SEP] frame the row: no separator at its edges
        assert not (is_sep[1:] & is_sep[:-1]).any()  # empty documents add none
        tok_doc = doc_of[b[~is_sep] - FIRST_ID]
        # one separator exactly where the document changes, none inside a document
        changes = np.flatnonzero(tok_doc[1:] != tok_doc[:-1])  # index in the token-only view
        np.testing.assert_array_equal(np.flatnonzero(is_sep) - np.arange(is_sep.sum()) - 1, changes)


@pytest.mark.parametrize("seq_len", SEQ_LENS)
def test_blocks_are_greedy(seq_len):
    """A row ends only when the next sentence (with its separator) does not fit."""
    body = seq_len - 2
    docs = random_docs(seed=40 + seq_len)
    doc_of, sent_of, len_of = doc_and_sentence_of(docs)
    rows = bodies(pack_documents(docs, seq_len, CLS, SEP, PAD))
    for a, b in zip(rows[:-1], rows[1:]):
        last, first = int(a[-1]) - FIRST_ID, int(b[0]) - FIRST_ID
        if sent_of[first] == sent_of[last]:
            continue  # a sentence longer than a block, cut
        sep = int(doc_of[first] != doc_of[last])
        assert a.size + sep + min(int(len_of[first]), body) > body


def test_small_example():
    a = [np.array([1001, 1002]), np.array([1003])]  # document 1: two sentences
    b = [np.array([1004, 1005, 1006])]  # document 2
    c = [np.array([1007] * 9)]  # document 3: one sentence longer than a block
    out = pack_documents([a, b, c], 8, CLS, SEP, PAD)  # 6 tokens per row
    np.testing.assert_array_equal(out["input_ids"], [
        [CLS, 1001, 1002, 1003, SEP, PAD, PAD, PAD],  # 2 + 1 + [SEP] + 3 = 7 > 6: document 2 starts a row
        [CLS, 1004, 1005, 1006, SEP, PAD, PAD, PAD],  # the long sentence does not fit: a row of its own
        [CLS, 1007, 1007, 1007, 1007, 1007, 1007, SEP],
        [CLS, 1007, 1007, 1007, SEP, PAD, PAD, PAD],
    ])
    out = pack_documents([a, b], 9, CLS, SEP, PAD)  # 7 tokens: both documents, one separator
    np.testing.assert_array_equal(out["input_ids"], [[CLS, 1001, 1002, 1003, SEP, 1004, 1005, 1006, SEP]])
    assert (out["attention_mask"] == 1).all() and (out["token_type_ids"] == 0).all()


def test_shapes_and_dtypes():
    out = pack_documents(random_docs(seed=1), 32, CLS, SEP, PAD)
    assert set(out) == set(COLUMNS)
    n = out["input_ids"].shape[0]
    for name in COLUMNS:
        assert out[name].shape == (n, 32) and out[name].dtype == np.int64, name
    assert (out["token_type_ids"] == 0).all()


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
    assert parts[-1]["input_ids"].shape[0] == 1  # only the open block waits for flush


def test_add_returns_only_completed_rows():
    packer = Packer(6, CLS, SEP, PAD)  # 4 tokens per row
    first = packer.add([[np.array([1001, 1002]), np.array([1003])]])
    assert first["input_ids"].shape == (0, 6)  # 3 tokens: the block may still take a 1-token sentence
    second = packer.add([[np.array([1004])]])  # 3 + [SEP] + 1 = 5 > 4: the first block is complete
    np.testing.assert_array_equal(second["input_ids"], [[CLS, 1001, 1002, 1003, SEP, PAD]])
    np.testing.assert_array_equal(packer.flush()["input_ids"], [[CLS, 1004, SEP, PAD, PAD, PAD]])


def test_packer_is_reusable_after_flush():
    docs = random_docs(seed=4, n_docs=20)
    packer = Packer(40, CLS, SEP, PAD)
    runs = [concat_rows([packer.add(docs), packer.flush()], 40) for _ in range(2)]
    for name in COLUMNS:
        np.testing.assert_array_equal(runs[0][name], runs[1][name])


def test_empty_inputs():
    for docs in ([], [[]] * 2, [[np.zeros(0, dtype=np.int64)]] * 3):
        out = pack_documents(docs, 16, CLS, SEP, PAD)
        for name in COLUMNS:
            assert out[name].shape == (0, 16) and out[name].dtype == np.int64
    packer = Packer(16, CLS, SEP, PAD)
    assert packer.add([])["input_ids"].shape == (0, 16)
    assert packer.flush()["input_ids"].shape == (0, 16)
    assert concat_rows([], 16)["input_ids"].shape == (0, 16)


def test_empty_documents_add_no_separator():
    a, b = [np.array([1001, 1002])], [np.zeros(0, int), np.array([1003])]
    out = pack_documents([[], a, [np.zeros(0, int)], [], b], 8, CLS, SEP, PAD)
    np.testing.assert_array_equal(out["input_ids"], [[CLS, 1001, 1002, SEP, 1003, SEP, PAD, PAD]])


def test_helpers():
    lengths, sep = split_long(np.array([3, 10, 4]), np.array([False, True, True]), 4)
    np.testing.assert_array_equal(lengths, [3, 4, 4, 2, 4])
    np.testing.assert_array_equal(sep, [False, True, False, False, True])
    np.testing.assert_array_equal(block_starts(lengths, sep, 4), [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(block_starts(np.array([1, 1, 1, 1, 1]), np.array([0, 1, 0, 1, 0], bool), 3), [0, 2, 4])
    with pytest.raises(ValueError, match="split_long"):
        block_starts(np.array([5]), np.array([False]), 4)


def test_inputs_not_modified():
    docs = random_docs(seed=5, n_docs=10)
    before = [[s.copy() for s in d] for d in docs]
    pack_documents(docs, 16, CLS, SEP, PAD)
    for d, b in zip(docs, before):
        for s, t in zip(d, b):
            np.testing.assert_array_equal(s, t)


def test_bad_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        Packer(2, CLS, SEP, PAD)
    with pytest.raises(ValueError, match="integer"):
        pack_documents([[np.array([1.5, 2.5])]], 8, CLS, SEP, PAD)
    with pytest.raises(ValueError, match="list of sentences"):
        pack_documents([np.array([1, 2])], 8, CLS, SEP, PAD)
