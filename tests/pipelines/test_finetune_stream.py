"""The fine-tuning stream without Ray: epoch order keyed by (seed, epoch), work units that cover
every usable record once per epoch, rows named by (record index, window), bad records named with
their reason, committed rows dropped on resume; and, through Ray Data, split files compressed whole
read as the plain ones."""

from __future__ import annotations

import bz2
import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from pipelines import storage
from pipelines.finetune import LabelSet, TaskDataConfig
from pipelines.finetune_stream import (
    SPLIT_COMPRESSIONS,
    SPLIT_SUFFIXES,
    WINDOW_BITS,
    EncodeUnits,
    encode_rows,
    epoch_order,
    label_set,
    label_values,
    read_split,
    references,
    split_format,
    with_split_widths,
    work_units,
)
from pipelines.position import DataPosition
from pipelines.sources import sample_text
from pipelines.tokenizers import train_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer("wordpiece", sample_text([str(REPO / "data/sample/wordnet-0000-of-0008.txt.gz")], 200_000), 800)


def test_epoch_order_is_a_permutation_keyed_by_seed_and_epoch():
    a = epoch_order(50, seed=1, epoch=0)
    assert sorted(a.tolist()) == list(range(50))
    np.testing.assert_array_equal(a, epoch_order(50, seed=1, epoch=0))
    assert not np.array_equal(a, epoch_order(50, seed=1, epoch=1))
    assert not np.array_equal(a, epoch_order(50, seed=2, epoch=0))


def test_work_units_cover_every_usable_record_once_per_epoch():
    usable = np.array([0, 1, 2, 4, 5, 7, 8, 9, 11, 12], dtype=np.int64)  # 3, 6, 10 rejected
    units = work_units(usable, seed=0, first_epoch=1, epochs=3, unit_records=4)
    assert [(u["epoch"], u["unit"]) for u in units] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    for epoch in (1, 2):
        got = np.concatenate([u["records"] for u in units if u["epoch"] == epoch])
        assert sorted(got.tolist()) == usable.tolist()
    assert [len(u["records"]) for u in units[:3]] == [4, 4, 2]


def test_bad_records_are_named_and_usable_ones_keep_their_index(tok):
    cfg = TaskDataConfig(kind="classification", max_len=16, labels=("neg", "pos"))
    texts = [
        json.dumps({"sentence1": "a good film", "label": "pos"}),
        '{"sentence1": "cut',
        json.dumps({"sentence1": "no label here"}),
        json.dumps({"sentence1": "an unknown label", "label": "meh"}),
        json.dumps(["not", "an", "object"]),
        json.dumps({"sentence1": "a bad film that goes on and on and on for far too many words to fit", "label": "neg"}),
    ]
    rows, ok, problems = encode_rows(texts, np.arange(10, 16), tok, cfg)
    assert ok.tolist() == [True, False, False, False, False, True]
    assert "malformed JSON" in problems[1] and "JSON object" in problems[4]
    assert problems[2].field == "label" and problems[3].field == "label" and "meh" in str(problems[3])
    assert (rows["sample_id"] >> WINDOW_BITS).tolist() == [10, 15] and (rows["sample_id"] & 0xFFFF).tolist() == [0, 0]
    assert rows["labels"].tolist() == [1, 0] and rows["truncated"].tolist() == [False, True]
    assert rows["input_ids"].shape == (2, 16)


def test_label_set_comes_from_the_training_split_tags():
    cfg = TaskDataConfig(kind="token-classification", max_len=16)
    table = pa.table({"_json": [json.dumps({"tokens": ["a", "b"], "tags": ["B-x", "O"]}), "{bad", json.dumps({"tokens": ["c"], "tags": ["I-x"]})]})
    assert label_set(table, cfg).names == LabelSet(["B-x", "I-x", "O"]).names


def test_question_answering_windows_are_numbered_per_record(tok):
    context = " ".join(f"word{i}" for i in range(80)) + " the answer is here"
    rec = {"id": "q", "question": "where is it", "context": context,
           "answers": {"text": ["here"], "answer_start": [context.index("here")]}}
    cfg = TaskDataConfig(kind="question-answering", max_len=32, max_query_len=8, doc_stride=8)
    rows, ok, _ = encode_rows([json.dumps(rec), json.dumps({**rec, "id": "r"})], np.array([3, 9]), tok, cfg)
    record, window = rows["sample_id"] >> WINDOW_BITS, rows["sample_id"] & ((1 << WINDOW_BITS) - 1)
    k = int((record == 3).sum())
    assert k > 2 and record.tolist() == [3] * k + [9] * k
    assert window.tolist() == list(range(k)) * 2
    assert rows["example_index"].tolist() == [3] * k + [9] * k  # split indices: what decode_qa merges by
    assert len(set(rows["sample_id"].tolist())) == 2 * k


def test_a_unit_drops_the_rows_the_checkpoint_committed(tok):
    cfg = TaskDataConfig(kind="classification", max_len=16, labels=("0", "1"))
    texts = [json.dumps({"sentence1": f"text {i}", "label": i % 2}) for i in range(6)]
    enc = EncodeUnits.__new__(EncodeUnits)
    enc.texts, enc.tok, enc.cfg, enc.run_uri, enc.store = texts, tok, cfg, None, None
    enc._position = DataPosition()
    enc._position.add([0, 0], [1, 1], [2 << WINDOW_BITS, 5 << WINDOW_BITS], [3, 3])
    batch = {"epoch": np.array([0, 0]), "unit": np.array([0, 1]), "records": np.array([[0, 1, 4], [2, 3, 5]])}
    out = list(enc(batch))
    assert [(b["sample_id"] >> WINDOW_BITS).tolist() for b in out] == [[0, 1, 4], [3]]
    assert out[1]["_shard"].tolist() == [1] and out[1]["_shard_total"].tolist() == [3] and out[1]["epoch"].tolist() == [0]
    enc._position.add([0], [1], [3 << WINDOW_BITS], [3])  # unit 1 complete: not read at all
    assert [(b["sample_id"] >> WINDOW_BITS).tolist() for b in enc(batch)] == [[0, 1, 4]]


def test_embedding_records_are_checked_against_the_splits_negative_count(tok):
    """Batches are checked one by one; the split's count of negatives is pinned first, so every
    usable record has it and every batch of the split stacks to one width."""
    cfg = TaskDataConfig(kind="embedding", max_len=16)
    recs = [{"anchor": f"q{i}", "positive": f"d{i}", "negatives": ["n1", "n2"]} for i in range(3)]
    recs += [{"anchor": "q3", "positive": "d3", "negatives": "n1"}, {"anchor": "q4", "positive": "d4"}]
    texts = [json.dumps(r) for r in recs] + ["{bad"]
    table = pa.table({"_json": texts})
    assert label_values(table, cfg) == [] and references(table, np.arange(5), cfg) == {}  # no labels: the rows' doc_ids are the references
    pinned = with_split_widths(table, cfg)
    assert pinned.n_negatives == 2 and with_split_widths(table, pinned) is pinned
    late = texts[3:5]  # a batch of its own would agree with itself (one negative), not with the split
    assert encode_rows(late, np.array([3, 4]), tok, cfg)[1].tolist() == [True, False]
    rows, ok, problems = encode_rows(late, np.array([3, 4]), tok, pinned)
    assert ok.tolist() == [False, False] and {p.field for p in problems} == {"negatives"}
    rows, ok, _ = encode_rows(texts[:3], np.array([0, 1, 2]), tok, cfg)  # the usable ones, encoded later without the pin
    assert ok.all() and rows["input_ids"].shape == (3, 4, 16) and rows["doc_ids"].shape == (3, 3)
    assert (rows["sample_id"] >> WINDOW_BITS).tolist() == [0, 1, 2]
    pairs = pa.table({"_json": [json.dumps({"query": "q", "document": "d"})]})
    assert with_split_widths(pairs, cfg).n_negatives == 0
    classes = TaskDataConfig(kind="classification", labels=("0",))
    assert with_split_widths(table, classes) is classes


def test_split_files_compressed_whole_read_as_the_plain_ones(ray_session, tmp_path):
    """``train.jsonl.zst`` (and .gz, .bz2, .lz4; CSV and TSV alike, one codec each here) gives the plain file's records,
    files and lines; a SQuAD JSON compressed whole too; an ending Arrow cannot undo (.xz) is no split."""
    import pyarrow as pa
    from backports import zstd

    compress = {".gz": gzip.compress, ".bz2": bz2.compress, ".zst": zstd.compress,
                ".lz4": lambda b: pa.compress(b, "lz4", asbytes=True)}  # Arrow's "lz4" is the LZ4 frame format
    assert set(compress) == set(SPLIT_COMPRESSIONS)
    records = [{"text": f"sentence {i} \u00e9\u6f22", "label": "ab"[i % 2]} for i in range(7)]
    plain = {
        "train.jsonl": "".join(json.dumps(r) + "\n" for r in records).encode(),
        "dev.csv": ("text,label\n" + "".join(f"\"{r['text']}, and more\",{r['label']}\n" for r in records)).encode(),
        "dev.tsv": ("text\tlabel\n" + "".join(f"{r['text']}\t{r['label']}\n" for r in records)).encode(),
    }

    def records_of(path):
        t = read_split(str(path))
        return t.column("_line").to_pylist(), [json.loads(x) for x in t.column("_json").to_pylist()]

    endings = {"train.jsonl": list(compress), "dev.csv": [".zst"], "dev.tsv": [".bz2"]}  # each read is a Ray Data run
    for name, data in plain.items():
        (tmp_path / name).write_bytes(data)
        want = records_of(tmp_path / name)
        assert len(want[1]) == 7
        for ending in endings[name]:
            (tmp_path / (name + ending)).write_bytes(compress[ending](data))
            assert (name + ending).endswith(SPLIT_SUFFIXES)  # a folder's listing picks it up
            assert records_of(tmp_path / (name + ending)) == want, name + ending
    squad = {"data": [{"title": "T", "paragraphs": [{"context": "Rollo ruled Normandy.", "qas": [
        {"id": "1", "question": "Who?", "answers": [{"text": "Rollo", "answer_start": 0}]}]}]}]}
    (tmp_path / "dev.json").write_text(json.dumps(squad, indent=2))  # over lines, as SQuAD ships: not JSON lines
    (tmp_path / "dev.json.zst").write_bytes(zstd.compress(json.dumps(squad, indent=2).encode()))
    assert split_format(str(tmp_path / "dev.json.zst")) == "squad"
    flat = {"id": "1", "title": "T", "context": "Rollo ruled Normandy.", "question": "Who?", "answers": {"text": ["Rollo"], "answer_start": [0]}}
    assert records_of(tmp_path / "dev.json.zst") == records_of(tmp_path / "dev.json") == ([1], [flat])
    (tmp_path / "xz").mkdir()
    (tmp_path / "xz" / "train.jsonl.xz").write_bytes(b"")
    with pytest.raises(storage.StorageError, match=r"matches no .*\.jsonl\.zst"):
        read_split(str(tmp_path / "xz"))
