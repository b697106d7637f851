"""The data position: committed samples are never produced again, the rest are produced unchanged."""

import gzip
from pathlib import Path

import numpy as np
import pytest

from pipelines.dataset import StreamSpec, TokenizePack, shard_keys, tokenizer_files, work_units
from pipelines.position import DataPosition
from pipelines.sources import sample_text
from pipelines.tokenizers import train_tokenizer

REPO = Path(__file__).resolve().parents[2]
LINES = [line.strip() for line in gzip.open(sorted((REPO / "data" / "sample").glob("*.txt.gz"))[0], "rt") if line.strip()]


def test_add_query_and_round_trip():
    pos = DataPosition()
    pos.add([0, 0, 0, 1], [7, 7, 9, 7], [3, 1, 5, 3], [-1, -1, 2, -1])
    pos.add([0], [7], [1])  # a repeat is one sample
    assert pos.committed(0) == 3 and pos.committed(1) == 1
    np.testing.assert_array_equal(pos.is_consumed(0, 7, np.array([0, 1, 2, 3])), [False, True, False, True])
    assert not pos.is_consumed(0, 8, np.array([1])).any()
    assert not pos.shard_complete(0, 9)  # 1 of its 2 rows
    pos.add([0], [9], [6])
    assert pos.shard_complete(0, 9)
    back = DataPosition.from_arrays(pos.to_arrays())
    assert back.consumed.keys() == pos.consumed.keys() and back.totals == pos.totals
    for k in pos.consumed:
        np.testing.assert_array_equal(back.consumed[k], pos.consumed[k])


def test_epochs_close_only_when_every_shard_is_complete():
    pos = DataPosition()
    pos.add([0, 0], [1, 1], [10, 11], [-1, 2])
    assert pos.close_epochs([1, 2]) == []  # shard 2 of epoch 0 never seen
    pos.add([0], [2], [20], [1])
    pos.add([1], [1], [10])  # epoch 1 has started meanwhile
    assert pos.close_epochs([1, 2]) == [0]
    assert pos.first_epoch == 1 and (0, 1) not in pos.consumed and (1, 1) in pos.consumed
    assert pos.is_consumed(0, 5, np.array([123])).all()  # everything of a closed epoch is consumed


def test_merge_is_a_union():
    a, b = DataPosition(), DataPosition()
    a.add([0, 0], [1, 1], [1, 2])
    b.add([0, 0], [1, 3], [2, 9], [-1, 4])
    a.merge(b)
    np.testing.assert_array_equal(a.consumed[(0, 1)], [1, 2])
    assert a.totals == {(0, 3): 4}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    shards = []
    for i in range(3):
        p = root / f"part-{i}.txt"
        p.write_text("\n\n".join(LINES[i * 400 : (i + 1) * 400]) + "\n")
        shards.append(str(p))
    tok = train_tokenizer("wordpiece", sample_text(shards, 300_000), 1000)
    tok.save(root / "tok")
    return tuple(shards), tokenizer_files(root / "tok")


def run_stage(spec, files, position):
    stage = TokenizePack(files, spec)
    stage._position = position  # what the actor would read from the run's latest checkpoint
    units = work_units(spec)
    batch = {k: np.array([u[k] for u in units]) for k in ("shard", "shard_key", "epoch")}
    rows = list(stage(batch))
    return {k: np.concatenate([r[k] for r in rows]) for k in rows[0]} if rows else {}


@pytest.mark.parametrize("objective", ["mlm", "clm-stream"])
def test_stage_drops_exactly_the_committed_samples(corpus, objective, monkeypatch):
    shards, files = corpus
    spec = StreamSpec(shards=shards, seq_len=32, objective=objective, stream_rows=4, stream_block_batches=4)
    full = run_stage(spec, files, DataPosition())
    ids, shard = full["sample_id"], full["_shard"]
    if objective == "clm-stream":  # one row per (B,) batch
        ids, shard = ids.reshape(-1), shard.reshape(-1)
    keys = shard_keys(shards)
    assert set(np.unique(shard)) == set(keys)
    totals = {k: int(full["_shard_total"][full["_shard"] == k].max()) for k in keys}
    assert totals == {k: int((shard == k).sum()) for k in keys}  # the last batch of a shard carries its count

    # Commit all of shard 0 and every other batch's worth of shard 1.
    pos = DataPosition()
    first = shard == keys[0]
    pos.add(np.zeros(first.sum()), shard[first], ids[first], np.full(first.sum(), totals[keys[0]]))
    rows_of_1 = np.flatnonzero(shard == keys[1])
    half = rows_of_1[: len(rows_of_1) // 2] if objective == "mlm" else rows_of_1[: 4 * (len(rows_of_1) // 8)]
    pos.add(np.zeros(half.size), shard[half], ids[half])
    assert pos.shard_complete(0, keys[0])

    read = []
    import pipelines.dataset as dataset

    real = dataset.iter_documents
    monkeypatch.setattr(dataset, "iter_documents", lambda uri, *a, **k: (read.append(uri), real(uri, *a, **k))[1])
    rest = run_stage(spec, files, pos)
    assert shards[0] not in read  # a complete shard is not even opened
    rest_ids = rest["sample_id"].reshape(-1)
    expected = np.setdiff1d(ids, ids[np.concatenate([np.flatnonzero(first), half])])
    np.testing.assert_array_equal(np.sort(rest_ids), np.sort(expected))
    # the samples that remain are the same samples (tokens) as before
    where = {int(s): i for i, s in enumerate(ids)}
    full_tokens = full["input_ids"].reshape(len(ids), -1)
    rest_tokens = rest["input_ids"].reshape(len(rest_ids), -1)
    for j, s in enumerate(rest_ids):
        np.testing.assert_array_equal(rest_tokens[j], full_tokens[where[int(s)]])


def test_a_shard_without_samples_does_not_hold_its_epoch_open():
    pos = DataPosition()
    pos.add([0, 0], [1, 1], [10, 11], [-1, 2])  # shard 1 complete; shard 2 was empty: no rows ever
    asked = []

    def sampleless(epoch):
        asked.append(epoch)
        return {2} if epoch == 0 else set()

    assert pos.close_epochs([1, 2]) == []
    assert pos.close_epochs([1, 2], sampleless) == [0] and asked == [0, 1]  # epoch 1: nothing started yet
    pos.add([1], [1], [10])
    assert pos.close_epochs([1, 2], sampleless) == [] and asked == [0, 1]  # a started shard: no listing
