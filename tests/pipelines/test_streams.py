"""Stream-ordered batches: rows continue across batches, nothing lost or duplicated, resets right."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.streams import StreamBatcher

PAD, SEP = 0, 2


def make_stream(n_docs: int, seed: int = 0) -> np.ndarray:
    """Documents of unique ids (>= 10) each followed by [SEP]."""
    rng = np.random.default_rng(seed)
    parts, next_id = [], 10
    for _ in range(n_docs):
        n = int(rng.integers(1, 60))
        parts += [np.arange(next_id, next_id + n), np.array([SEP])]
        next_id += n
    return np.concatenate(parts)


def feed(batcher: StreamBatcher, stream: np.ndarray, seed: int = 0) -> list[dict]:
    """add() the stream in random pieces, then flush()."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, len(stream), size=len(stream) // 37))
    out = []
    for piece in np.split(stream, cuts):
        out += batcher.add(piece)
    return out + batcher.flush()


def blocks_of(batches: list[dict]) -> list[list[dict]]:
    """Group batches into blocks (a block starts where reset_memory is 1)."""
    blocks = []
    for batch in batches:
        if batch["reset_memory"].all():
            blocks.append([])
        else:
            assert not batch["reset_memory"].any()
        blocks[-1].append(batch)
    return blocks


def row_streams(block: list[dict]) -> list[np.ndarray]:
    """Concatenate each row across the block's batches, real tokens only."""
    ids = np.concatenate([b["input_ids"] for b in block], axis=1)
    mask = np.concatenate([b["attention_mask"] for b in block], axis=1).astype(bool)
    for r in range(ids.shape[0]):  # right padding only
        n = mask[r].sum()
        assert mask[r, :n].all() and not mask[r, n:].any() and (ids[r, n:] == PAD).all()
    return [ids[r][mask[r]] for r in range(ids.shape[0])]


def test_whole_shard_is_split_like_transformer_xl():
    stream = make_stream(80)
    batches = feed(StreamBatcher(4, 16, pad_id=PAD, doc_sep_id=SEP), stream)
    (block,) = blocks_of(batches)
    row_len = -(-len(stream) // 4)
    assert len(block) == -(-row_len // 16)
    rows = row_streams(block)
    for r in range(4):
        np.testing.assert_array_equal(rows[r], stream[r * row_len : (r + 1) * row_len])
    np.testing.assert_array_equal(np.concatenate(rows), stream)  # nothing lost or duplicated
    for batch in batches:
        for col in ("input_ids", "attention_mask", "doc_start"):
            assert batch[col].shape == (4, 16) and batch[col].dtype == np.int64
        for col in ("reset_memory", "sample_id", "epoch"):
            assert batch[col].shape == (4,) and batch[col].dtype == np.int64


def test_blocks_are_emitted_while_adding():
    stream = make_stream(200, seed=1)
    batcher = StreamBatcher(3, 8, pad_id=PAD, doc_sep_id=SEP, block_batches=5)
    emitted_by_add = batcher.add(stream[:500])
    assert len(emitted_by_add) == 5 * (500 // (3 * 5 * 8))
    batches = emitted_by_add + batcher.add(stream[500:]) + batcher.flush()
    blocks = blocks_of(batches)
    got = []
    for i, block in enumerate(blocks):
        rows = row_streams(block)
        if i < len(blocks) - 1:
            assert len(block) == 5 and all(len(r) == 40 for r in rows)
        got += rows
    np.testing.assert_array_equal(np.concatenate(got), stream)


def test_rows_continue_across_batches_and_chunking_does_not_matter():
    stream = make_stream(120, seed=2)
    a = feed(StreamBatcher(5, 12, pad_id=PAD, doc_sep_id=SEP, block_batches=3, base_sample_id=77), stream, seed=0)
    b = feed(StreamBatcher(5, 12, pad_id=PAD, doc_sep_id=SEP, block_batches=3, base_sample_id=77), stream, seed=1)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for col in x:
            np.testing.assert_array_equal(x[col], y[col], err_msg=col)
    # Row r of batch k+1 starts where row r of batch k stopped (within a block).
    for block in blocks_of(a):
        for prev, nxt in zip(block, block[1:]):
            for r in range(5):
                if nxt["attention_mask"][r, 0]:
                    assert nxt["input_ids"][r, 0] > 0
                    last = prev["input_ids"][r, -1]
                    first = nxt["input_ids"][r, 0]
                    pos = np.flatnonzero(stream == last)
                    assert last == SEP or (len(pos) == 1 and stream[pos[0] + 1] == first)


def test_doc_start_marks_tokens_after_a_separator():
    stream = make_stream(60, seed=3)
    batches = feed(StreamBatcher(4, 10, pad_id=PAD, doc_sep_id=SEP, block_batches=2), stream)
    got_starts = []
    for block in blocks_of(batches):
        ds = np.concatenate([b["doc_start"] for b in block], axis=1)
        mask = np.concatenate([b["attention_mask"] for b in block], axis=1).astype(bool)
        assert not ds[~mask].any()
        got_starts += [ds[r][mask[r]] for r in range(ds.shape[0])]
    got_starts = np.concatenate(got_starts)
    expected = np.zeros(len(stream), dtype=np.int64)
    expected[0] = 1
    expected[1:] = stream[:-1] == SEP
    np.testing.assert_array_equal(got_starts, expected)
    # Without a separator id, only the stream start is a document start.
    plain = feed(StreamBatcher(4, 10, pad_id=PAD), stream)
    assert sum(int(b["doc_start"].sum()) for b in plain) == 1


def test_sample_ids_and_epoch():
    stream = make_stream(100, seed=4)
    batches = feed(StreamBatcher(4, 8, pad_id=PAD, block_batches=2, base_sample_id=5, epoch=3), stream)
    ids = np.concatenate([b["sample_id"] for b in batches])
    assert len(np.unique(ids)) == len(ids) and (ids >= 0).all()
    assert all((b["epoch"] == 3).all() for b in batches)
    other = feed(StreamBatcher(4, 8, pad_id=PAD, block_batches=2, base_sample_id=6, epoch=3), stream)
    assert not np.intersect1d(ids, np.concatenate([b["sample_id"] for b in other])).size


def test_flush_starts_a_new_stream_and_empty_flush():
    batcher = StreamBatcher(2, 4, pad_id=PAD, doc_sep_id=SEP)
    assert batcher.flush() == []
    assert batcher.add(np.array([11, 12, 13])) == []
    first = batcher.flush()
    assert len(first) == 1 and first[0]["reset_memory"].tolist() == [1, 1]
    # 3 tokens over 2 rows: [11, 12] and [13], right-padded.
    assert first[0]["input_ids"].tolist() == [[11, 12, 0, 0], [13, 0, 0, 0]]
    second = batcher.add(np.array([21, 22])) + batcher.flush()
    assert second[0]["doc_start"][0, 0] == 1  # a new shard starts a new document
    assert not np.intersect1d(first[0]["sample_id"], second[0]["sample_id"]).size


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="batch_rows"):
        StreamBatcher(0, 8, pad_id=PAD)
    with pytest.raises(ValueError, match="block_batches"):
        StreamBatcher(2, 8, pad_id=PAD, block_batches=0)
    with pytest.raises(ValueError, match="1-D integer"):
        StreamBatcher(2, 8, pad_id=PAD).add(np.zeros((2, 2), dtype=np.int64))
