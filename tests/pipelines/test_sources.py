"""Corpus discovery and reading: local paths, file://, globs, lists and a real S3 endpoint."""

import gzip
import json
import lzma

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from backports import zstd

from pipelines import storage
from pipelines.dataset import shard_keys, shard_order
from pipelines.sources import CorpusError, ReadStats, iter_documents, sample_text

STORE = storage.Store()  # the defaults: AWS_ENDPOINT_URL (moto's, in the S3 tests) and data.retry_deadline_s
DOCS = ["the river bank was muddy.\nwe walked along it.", "the bank approved the loan.", "a third document\nwith two lines."]


def write_corpus(root):
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text("\n\n".join(DOCS) + "\n")
    with gzip.open(root / "b.txt.gz", "wt") as f:
        f.write("\n\n".join(DOCS) + "\n")
    (root / "c.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)) + "\n")
    with gzip.open(root / "d.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps({"body": d}) for d in DOCS) + "\n")
    pq.write_table(pa.table({"text": DOCS}), root / "e.parquet", row_group_size=2)
    (root / "f.txt.zst").write_bytes(zstd.compress(("\n\n".join(DOCS) + "\n").encode()))  # the Pile's, SlimPajama's
    (root / "g.jsonl.xz").write_bytes(lzma.compress("".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()))  # CC-100's
    (root / "notes.md").write_text("not a shard")
    return root


def all_docs(uri, **kw):
    return [d for chunk in iter_documents(uri, **kw) for d in chunk]


def test_each_format_yields_the_documents(tmp_path):
    root = write_corpus(tmp_path / "c")
    for name in ("a.txt", "b.txt.gz", "c.jsonl", "e.parquet", "f.txt.zst", "g.jsonl.xz"):
        assert all_docs(str(root / name)) == DOCS, name
    assert all_docs(str(root / "d.jsonl.gz"), text_field="body") == DOCS


def test_listing_folder_glob_list_and_file_scheme(tmp_path):
    root = write_corpus(tmp_path / "c")
    folder = STORE.list_files(str(root))
    assert [p.rsplit("/", 1)[1] for p in folder] == ["a.txt", "b.txt.gz", "c.jsonl", "d.jsonl.gz", "e.parquet", "f.txt.zst", "g.jsonl.xz"]
    assert STORE.list_files(str(root / "*.txt*")) == [folder[0], folder[1], folder[5]]
    assert STORE.list_files([str(root / "a.txt"), str(root / "e.parquet")]) == [folder[0], folder[4]]
    assert STORE.list_files(f"file://{root}") == folder


def test_a_forced_format_lists_a_file_only_its_compression_names(tmp_path):
    """Pushshift's Reddit dumps are ``RC_2019-04.zst``: JSON lines, zstd with a 2 GiB window (``--long=31``), no
    format in the name. With data.format set the listing keeps such a file and it is read in that format."""
    (tmp_path / "RC_2019-04.zst").write_bytes(zstd.compress("".join(json.dumps({"body": d}) + "\n" for d in DOCS).encode()))
    (tmp_path / "a.txt").write_text("\n\n".join(DOCS) + "\n")
    assert [p.rsplit("/", 1)[1] for p in STORE.list_files(str(tmp_path))] == ["a.txt"]
    listed = STORE.list_files(str(tmp_path), storage.corpus_suffixes("jsonl"))
    assert [p.rsplit("/", 1)[1] for p in listed] == ["RC_2019-04.zst", "a.txt"]
    assert all_docs(listed[0], fmt="jsonl", text_field="body") == DOCS
    with pytest.raises(CorpusError, match="unknown corpus format"):  # auto: the name says no format
        all_docs(listed[0])


def test_inputs_that_match_nothing_say_so(tmp_path):
    with pytest.raises(storage.StorageError, match="matches no"):
        STORE.list_files(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(storage.StorageError, match="empty"):
        STORE.list_files(str(tmp_path / "empty"))
    with pytest.raises(storage.StorageError, match=r"\*.zzz"):
        STORE.list_files(str(tmp_path / "*.zzz"))


def test_strict_reading_names_the_shard_and_line_of_the_first_bad_record(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:2: malformed JSON"):
        all_docs(str(bad), strict=True)
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"body": "x"}\n')
    with pytest.raises(CorpusError, match=r"nofield.jsonl:1: record has no 'text' field"):
        all_docs(str(nofield), strict=True)
    trunc = tmp_path / "trunc.txt.gz"
    words = [f"w{i * 7919 % 100003}" for i in range(20000)]  # little redundancy: compresses poorly
    full = gzip.compress(" ".join(words).encode())
    trunc.write_bytes(full[: len(full) // 2])
    with pytest.raises(CorpusError, match=r"trunc.txt.gz:1: truncated gzip after line 0"):
        all_docs(str(trunc), strict=True)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(CorpusError, match="latin.txt:1: invalid UTF-8"):
        all_docs(str(latin), strict=True)


def test_bad_records_are_skipped_and_counted_by_default(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n{"body": "x"}\n')
    stats = ReadStats()
    assert all_docs(str(bad), stats=stats) == ["fine"]
    assert (stats.read, stats.used, stats.rejected) == (3, 1, 2)
    assert stats.reasons == {"malformed JSON": 1, "missing field": 1}
    assert [line for line, _ in stats.examples] == [2, 3]
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9\ntea\n".encode("latin-1"))
    stats = ReadStats()
    assert all_docs(str(latin), stats=stats) == ["tea"]
    assert stats.reasons == {"invalid UTF-8": 1} and stats.read == 2


def test_sample_text_stops_at_budget_and_visits_every_shard(tmp_path):
    root = write_corpus(tmp_path / "c")
    shards = STORE.list_files(str(root / "*.txt*"))
    out = list(sample_text(shards, max_chars=60))
    assert sum(map(len, out)) >= 60 and sum(map(len, out[:-1])) < 60


def test_shard_order_is_a_function_of_seed_and_epoch():
    a = [shard_order(50, 1, e, True).tolist() for e in range(3)]
    assert a == [shard_order(50, 1, e, True).tolist() for e in range(3)]
    assert a[0] != a[1] != a[2] and sorted(a[0]) == list(range(50))
    assert shard_order(50, 2, 0, True).tolist() != a[0]
    assert shard_order(5, 1, 0, False).tolist() == list(range(5))


def test_shard_keys_survive_a_move_to_a_bucket_and_differ_between_folders():
    local = ["/data/corpus/x/part-0.txt", "/data/corpus/y/part-0.txt"]
    bucket = ["s3://bucket/prefix/corpus/x/part-0.txt", "s3://bucket/prefix/corpus/y/part-0.txt"]
    assert shard_keys(local) == shard_keys(bucket)
    assert len(set(shard_keys(local))) == 2


def test_s3_listing_and_reading(s3_server, s3_bucket, tmp_path):
    import boto3

    root = write_corpus(tmp_path / "c")
    s3 = boto3.client("s3", endpoint_url=s3_server)
    for p in root.iterdir():
        s3.upload_file(str(p), s3_bucket, f"corpus/{p.name}")
    files = STORE.list_files(f"s3://{s3_bucket}/corpus/")
    assert [f.rsplit("/", 1)[1] for f in files] == ["a.txt", "b.txt.gz", "c.jsonl", "d.jsonl.gz", "e.parquet", "f.txt.zst", "g.jsonl.xz"]
    assert all(f.startswith(f"s3://{s3_bucket}/") for f in files)
    assert all_docs(files[1]) == all_docs(files[4]) == all_docs(files[5]) == all_docs(files[6]) == DOCS
    assert STORE.list_files(f"s3://{s3_bucket}/corpus/*.jsonl") == [files[2]]
    with pytest.raises(storage.StorageError, match="matches no"):
        STORE.list_files(f"s3://{s3_bucket}/nothing-here/")
    # folders round-trip through the bucket
    STORE.copy_dir(root, f"s3://{s3_bucket}/copy")
    back = STORE.download_dir(f"s3://{s3_bucket}/copy", tmp_path / "back")
    assert (back / "a.txt").read_text() == (root / "a.txt").read_text()


# ---- the store failing mid-read ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["big.txt.gz", "big.txt.zst", "big.parquet"])
def test_a_read_cut_mid_shard_resumes_and_reads_every_record_once(s3_server, s3_bucket, tmp_path, name):
    """Every connection to the S3 endpoint is cut for 2 s after 100 kB of a 200+ kB shard went
    through (a TCP proxy in between): the read reconnects where it stopped (a text shard at its
    byte offset, Parquet by its row group) and yields the same documents and counts as an
    uncut read; nothing is counted as bad data."""
    import boto3

    from tests.proxy import CutProxy

    lines = [f"sentence {i} about the bank of river {i % 97} and its {i * 7919 % 10007} muddy stones." for i in range(30000)]
    docs = ["\n".join(lines[i : i + 3]) for i in range(0, len(lines), 3)]
    local = tmp_path / name
    if name.endswith(".parquet"):
        pq.write_table(pa.table({"text": docs}), local, row_group_size=1000, compression="none")
    elif name.endswith(".zst"):
        local.write_bytes(zstd.compress(("\n\n".join(docs) + "\n").encode(), level=1))
    else:
        with gzip.open(local, "wt", compresslevel=1) as f:
            f.write("\n\n".join(docs) + "\n")
    boto3.client("s3", endpoint_url=s3_server).upload_file(str(local), s3_bucket, name)
    size = local.stat().st_size
    assert size > 200_000  # twice the bytes let through before the cut

    direct_stats, cut_stats = ReadStats(), ReadStats()
    direct = all_docs(f"s3://{s3_bucket}/{name}", store=storage.Store(s3_server), stats=direct_stats)
    with CutProxy(int(s3_server.rsplit(":", 1)[1])) as proxy:
        proxy.cut_after(100_000, seconds=2)
        cut = all_docs(f"s3://{s3_bucket}/{name}", store=storage.Store(proxy.url, 30), stats=cut_stats)
    assert len(proxy.cuts) == 1 and proxy.cuts[0][1] < size  # cut before the shard was through
    assert proxy.connections >= 2  # and read on over a new connection
    assert cut == direct == docs
    assert cut_stats.to_dict() == direct_stats.to_dict() and cut_stats.rejected == 0
