"""Bad data in corpus shards: every record is used or rejected with a reason, and the per-epoch
data report adds up, for shards on a local disk and in a real S3 bucket (moto).

Each broken shard is built here byte by byte, with the documents a reader must still deliver
and the exact counts it must report.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import random
import tracemalloc
import zlib
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from backports import zstd

from pipelines.datareport import epoch_report, format_report, list_epochs, write_shard_report
from pipelines.storage import Store
from pipelines.sources import _BLOCK, CorpusError, ReadStats, iter_documents, sample_text

MAX_CHARS = 1000  # data.max_record_chars for these tests: the long line below is 2000x that


def sentences(seed: int, n: int) -> list[str]:
    """Sentences of random words: compress poorly, so gzip streams span several read blocks."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(100_000)}" for _ in range(rng.randrange(3, 12))) + "." for _ in range(n)]


def text_docs(seed: int, n_docs: int) -> list[str]:
    """Documents of 1-4 sentences (one per line), as a text shard's reader delivers them."""
    rng = random.Random(seed)
    return ["\n".join(sentences(seed * 1000 + i, rng.randrange(1, 5))) for i in range(n_docs)]


def text_shard(docs: list[str]) -> bytes:
    return ("\n\n".join(docs) + "\n\n").encode()


def records(docs: list[str]) -> int:
    """Records of a text shard holding ``docs``: its non-blank lines."""
    return sum(len(d.split("\n")) for d in docs)


def gzip_then(good: bytes, rest: bytes, damage: str) -> bytes:
    """One gzip stream of ``good + rest``, flushed to a byte boundary after ``good``, then damaged
    right after ``good``: ``corrupt`` overwrites compressed bytes, ``truncated`` cuts the file."""
    co = zlib.compressobj(6, zlib.DEFLATED, 31)
    head = co.compress(good) + co.flush(zlib.Z_FULL_FLUSH)  # a decoder reaching here has emitted all of `good`
    tail = co.compress(rest) + co.flush()
    if damage == "truncated":
        return head
    # 0xFF reads as a deflate block header of reserved type 3, which every decoder rejects at once
    return head + b"\xff" * 16 + tail[16:]


def zstd_then(good: bytes, rest: bytes, damage: str) -> bytes:
    """``good`` as one zstd frame, then ``rest`` as a second frame whose first 16 bytes are overwritten
    (``corrupt``: no frame starts so); ``truncated``: one frame of ``good + rest``, flushed to a
    block boundary after ``good`` and cut there."""
    if damage == "corrupt":
        return zstd.compress(good) + b"\xff" * 16 + zstd.compress(rest)[16:]
    co = zstd.ZstdCompressor()
    return co.compress(good, mode=co.FLUSH_BLOCK)


def long_window(data: bytes) -> bytes:
    """``data`` as `zstd --long=28` streams it: size unknown, so the frame declares a 256 MiB window (over the
    128 MiB a zstd decoder takes by default; Reddit's Pushshift dumps declare 2 GiB with --long=31)."""
    co = zstd.ZstdCompressor(options={zstd.CompressionParameter.window_log: 28, zstd.CompressionParameter.enable_long_distance_matching: True})
    frame = co.compress(data, mode=co.CONTINUE) + co.flush(mode=co.FLUSH_FRAME)
    with pytest.raises(zstd.ZstdError, match="too much memory"):  # what a default decoder says of it
        zstd.ZstdDecompressor().decompress(frame)
    return frame


@dataclass
class Case:
    """A shard file, what must come out of it, and how strict reading must fail (None: it passes)."""

    data: bytes
    docs: list[str]
    used: int
    reasons: dict[str, int] = field(default_factory=dict)
    strict: str | None = None

    @property
    def rejected(self) -> int:
        return sum(self.reasons.values())

    @property
    def read(self) -> int:
        return self.used + self.rejected


def parquet_bytes(table: pa.Table, **kw) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **kw)
    return sink.getvalue().to_pybytes()


def cases() -> dict[str, Case]:
    good = text_docs(1, 40)
    before, after = text_docs(2, 1500), text_docs(3, 300)  # `before` spans two 64 KiB read blocks compressed
    n_before = text_shard(before).count(b"\n")  # the line after which the damage starts
    jsonl_good = [f"document {i}: {s}" for i, s in enumerate(sentences(4, 50))]
    jsonl = [json.dumps({"text": t, "id": i}) for i, t in enumerate(jsonl_good)]
    mixed = [
        jsonl[0],
        '{"text": "unterminated',  # malformed JSON
        jsonl[1],
        '["text", "a list"]',  # not an object
        '{"body": "wrong field"}',  # missing field
        "",  # a blank line is not a record
        '{"text": 42}',  # not a string
        '{"text": "   "}',  # empty text
        jsonl[2],
    ]
    utf8_lines = [b"first sentence.", b"caf\xe9 latin-1 slipped in.", b"third sentence.", b"", b"second doc \xff\xfe."]
    long_line = b"x" * 2_000_000
    return {
        "good.txt": Case(text_shard(good), good, records(good)),
        "good.jsonl.gz": Case(gzip.compress(("\n".join(jsonl) + "\n").encode()), jsonl_good, len(jsonl)),
        "corrupt.txt.gz": Case(
            gzip_then(text_shard(before), text_shard(after), "corrupt"),
            before,
            records(before),
            {"corrupt gzip": 1},
            rf"corrupt.txt.gz:{n_before + 1}: corrupt gzip after line {n_before}: .*invalid block type",
        ),
        "truncated.txt.gz": Case(
            gzip_then(text_shard(before), text_shard(after), "truncated"),
            before,
            records(before),
            {"truncated gzip": 1},
            rf"truncated.txt.gz:{n_before + 1}: truncated gzip after line {n_before}",
        ),
        "trailer.jsonl.gz": Case(  # all the text is there, the CRC and size are not
            gzip.compress(("\n".join(jsonl) + "\n").encode())[:-4],
            jsonl_good,
            len(jsonl),
            {"truncated gzip": 1},
            rf"trailer.jsonl.gz:{len(jsonl) + 1}: truncated gzip after line {len(jsonl)}",
        ),
        "good.jsonl.zst": Case(  # two frames, as `cat a.zst b.zst` (or a seekable-zstd writer) leaves them
            zstd.compress(("\n".join(jsonl[:20]) + "\n").encode()) + zstd.compress(("\n".join(jsonl[20:]) + "\n").encode()),
            jsonl_good,
            len(jsonl),
        ),
        "corrupt.txt.zst": Case(
            zstd_then(text_shard(before), text_shard(after), "corrupt"),
            before,
            records(before),
            {"corrupt zstd": 1},
            rf"corrupt.txt.zst:{n_before + 1}: corrupt zstd after line {n_before}: .*Unknown frame descriptor",
        ),
        "truncated.txt.zst": Case(
            zstd_then(text_shard(before), text_shard(after), "truncated"),
            before,
            records(before),
            {"truncated zstd": 1},
            rf"truncated.txt.zst:{n_before + 1}: truncated zstd after line {n_before}: .*end of the zstd frame",
        ),
        "empty.txt.zst": Case(b"", [], 0),
        "window.jsonl.zst": Case(long_window(("\n".join(jsonl) + "\n").encode()), jsonl_good, len(jsonl)),
        "good.txt.xz": Case(  # two streams with the zero padding xz allows between them
            lzma.compress(text_shard(good[:20])) + b"\0" * 4 + lzma.compress(text_shard(good[20:])), good, records(good)
        ),
        "truncated.txt.xz": Case(  # every block is there, the stream's index and footer are not
            lzma.compress(text_shard(before))[:-10],
            before,
            records(before),
            {"truncated xz": 1},
            rf"truncated.txt.xz:{n_before + 1}: truncated xz after line {n_before}",
        ),
        "good.jsonl.bz2": Case(bz2.compress(("\n".join(jsonl) + "\n").encode()), jsonl_good, len(jsonl)),
        "utf8.txt": Case(
            b"\n".join(utf8_lines) + b"\n",
            ["first sentence.\nthird sentence."],
            2,
            {"invalid UTF-8": 2},
            r"utf8.txt:2: invalid UTF-8 at byte 3 of the line",
        ),
        "mixed.jsonl": Case(
            ("\n".join(mixed) + "\n").encode(),
            jsonl_good[:3],
            3,
            {"malformed JSON": 1, "not an object": 1, "missing field": 1, "not a string": 1, "empty text": 1},
            r"mixed.jsonl:2: malformed JSON",
        ),
        "long.txt": Case(
            b"before.\n" + long_line + b"\nafter.\n",
            ["before.\nafter."],
            2,
            {"line too long": 1},
            rf"long.txt:2: line of 2000000 characters exceeds data.max_record_chars={MAX_CHARS}",
        ),
        "long.jsonl": Case(
            (jsonl[0] + "\n" + json.dumps({"text": "y" * 5000}) + "\n" + jsonl[1] + "\n").encode(),
            jsonl_good[:2],
            2,
            {"line too long": 1},
            r"long.jsonl:2: line of 5012 characters exceeds",
        ),
        "empty.txt": Case(b"", [], 0),
        "empty.txt.gz": Case(b"", [], 0),
        "empty-stream.jsonl.gz": Case(gzip.compress(b""), [], 0),
        "blank.jsonl": Case(b"\n  \n\n", [], 0),
        "empty.parquet": Case(b"", [], 0),
        "unreadable.parquet": Case(b"PAR1 this is not parquet", [], 0, {"unreadable Parquet": 1}, r"unreadable.parquet: not a readable Parquet file"),
        "nulls.parquet": Case(
            parquet_bytes(pa.table({"text": ["one.", None, "", "two.", "  ", "three."]}), row_group_size=4),
            ["one.", "two.", "three."],
            3,
            {"null text": 1, "empty text": 2},
            r"nulls.parquet:row 1: column 'text' is null",
        ),
        "nocolumn.parquet": Case(
            parquet_bytes(pa.table({"body": ["a", "b"]})),
            [],
            0,
            {"missing field": 2},
            r"nocolumn.parquet: no column 'text'",
        ),
    }


CASES = cases()


def read(uri: str, store: Store = Store(), **kw) -> tuple[list[str], ReadStats]:
    stats = ReadStats()
    docs = [d for chunk in iter_documents(uri, store=store, stats=stats, max_record_chars=MAX_CHARS, chunk_docs=7, **kw) for d in chunk]
    return docs, stats


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_record_is_used_or_rejected_with_its_reason(tmp_path, name):
    case = CASES[name]
    (tmp_path / name).write_bytes(case.data)
    docs, stats = read(str(tmp_path / name))
    assert docs == case.docs
    assert (stats.read, stats.used, stats.rejected) == (case.read, case.used, case.rejected)
    assert stats.read == stats.used + stats.rejected
    assert stats.reasons == case.reasons
    assert stats.empty == (case.read == 0)
    assert bool(stats.examples) == bool(case.rejected) and len(stats.examples) <= ReadStats.MAX_EXAMPLES


@pytest.mark.parametrize("name", sorted(CASES))
def test_strict_reading_stops_at_the_first_bad_record_naming_shard_and_line(tmp_path, name):
    case = CASES[name]
    (tmp_path / name).write_bytes(case.data)
    if case.strict is None:  # good and empty shards read the same in strict mode
        assert read(str(tmp_path / name), strict=True)[0] == case.docs
        return
    with pytest.raises(CorpusError, match=case.strict) as err:
        read(str(tmp_path / name), strict=True)
    assert str(err.value).startswith(str(tmp_path / name))


def test_examples_say_where_and_what(tmp_path):
    (tmp_path / "corrupt.txt.gz").write_bytes(CASES["corrupt.txt.gz"].data)
    _, stats = read(str(tmp_path / "corrupt.txt.gz"))
    [(line, message)] = stats.examples
    assert message.startswith(f"corrupt gzip after line {line - 1}: ")
    (tmp_path / "mixed.jsonl").write_bytes(CASES["mixed.jsonl"].data)
    _, stats = read(str(tmp_path / "mixed.jsonl"))
    assert [line for line, _ in stats.examples] == [2, 4, 5, 7, 8]  # line 6 is blank: not a record
    assert stats.examples[2] == (5, "record has no 'text' field (set data.text_field)")


def test_damage_inside_a_zstd_frame_loses_at_most_one_decoded_piece(tmp_path):
    """A zstd decoder cannot be replayed byte by byte as zlib's can: what the failing call decoded
    (at most one ``_BLOCK``) goes with the damaged rest; every document before it comes out whole
    and in order, and the remainder counts as one rejected record."""
    before, after = text_docs(2, 1500), text_docs(3, 300)
    co = zstd.ZstdCompressor()
    head = co.compress(text_shard(before), mode=co.FLUSH_BLOCK)
    tail = co.compress(text_shard(after), mode=co.FLUSH_FRAME)
    (tmp_path / "inframe.txt.zst").write_bytes(head + b"\xff" * 16 + tail[16:])  # 0xFF: a block of reserved type
    docs, stats = read(str(tmp_path / "inframe.txt.zst"))
    assert stats.reasons == {"corrupt zstd": 1} and stats.read == stats.used + 1
    *whole, last = docs
    assert whole == before[: len(whole)] and before[len(whole)].startswith(last)  # a prefix, cut at a line
    assert stats.used == records(whole) + records([last])
    lost = len(text_shard(before)) - len(text_shard(whole)) - len(last)
    assert 0 <= lost <= _BLOCK + 200, lost  # one decoded piece, and the line it cut


@pytest.mark.parametrize("name, compress", [("huge.txt", bytes), ("huge.txt.gz", gzip.compress), ("huge.txt.zst", zstd.compress),
                                           ("huge.txt.xz", lzma.compress), ("huge.txt.bz2", bz2.compress)])
def test_a_long_line_is_skipped_without_being_held(tmp_path, name, compress):
    """Also where a few kB of compressed data decode to the 20 MB line (a ratio of thousands): the decoders
    give it out in pieces of at most 64 KiB, each dropped as the line streams by. What a decoder holds
    whatever the data (xz's 8 MiB dictionary) is measured on a two-line shard and left out."""
    (tmp_path / "small").mkdir()
    small, path = tmp_path / "small" / name, tmp_path / name
    small.write_bytes(compress(b"a.\nb.\n"))
    path.write_bytes(compress(b"a.\n" + b"z" * 20_000_000 + b"\nb.\n"))
    peaks = []
    for shard in (small, path):
        tracemalloc.start()
        try:
            docs, stats = read(str(shard))
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert docs == ["a.\nb."] and stats.reasons == {"line too long": 1}
    assert peaks[1] - peaks[0] < 1_000_000, peaks  # read blocks are 64 KiB; the 20 MB line never sits in memory


def test_line_limit_counts_characters_across_read_blocks(tmp_path):
    limit = 100_000
    lines = ["é" * 60_000, "a" * limit, "ü" * limit, "b" * (limit + 1), "ß" * (limit + 1), "end"]  # cross 64 KiB blocks
    (tmp_path / "edge.txt").write_text("\n".join(lines) + "\n")
    stats = ReadStats()
    docs = [d for c in iter_documents(str(tmp_path / "edge.txt"), stats=stats, max_record_chars=limit) for d in c]
    assert docs == ["\n".join(lines[:3] + lines[5:])]
    assert stats.reasons == {"line too long": 2}
    assert [m for _, m in stats.examples] == [f"line of {limit + 1} characters exceeds data.max_record_chars={limit}"] * 2


def test_text_shards_count_records_per_line_and_good_data_is_unchanged(tmp_path):
    docs = ["one.\ntwo.", "three.", "four.\nfive.\nsix."]
    (tmp_path / "t.txt").write_text("\n\n\n".join(docs) + "\n")  # extra blank lines change nothing
    (tmp_path / "crlf.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "bom"}\r\n{"text": "crlf"}\r\n')
    out, stats = read(str(tmp_path / "t.txt"))
    assert out == docs and (stats.read, stats.used) == (6, 6)
    out, stats = read(str(tmp_path / "crlf.jsonl"))
    assert out == ["bom", "crlf"] and stats.rejected == 0


def test_a_concatenated_gzip_is_read_whole(tmp_path):
    (tmp_path / "cat.txt.gz").write_bytes(gzip.compress(b"one.\n\n") + gzip.compress(b"two.\n"))
    out, stats = read(str(tmp_path / "cat.txt.gz"))
    assert out == ["one.", "two."] and stats.rejected == 0


def test_read_stats_round_trip_and_keep_five_examples():
    stats = ReadStats()
    stats.use(3)
    for line in range(1, 9):
        stats.reject("malformed JSON", f"malformed JSON on {line}", line)
    stats.reject("unreadable Parquet", "whole file", None)
    back = ReadStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert back == stats and not back.empty
    assert (back.read, back.used, back.rejected) == (12, 3, 9)
    assert back.examples == [(i, f"malformed JSON on {i}") for i in range(1, 6)]
    assert ReadStats().to_dict()["empty"] is True


def test_sample_text_skips_bad_records(tmp_path):
    for name in ("mixed.jsonl", "corrupt.txt.gz"):
        (tmp_path / name).write_bytes(CASES[name].data)
    out = list(sample_text([str(tmp_path / "mixed.jsonl"), str(tmp_path / "corrupt.txt.gz")], max_chars=10**9))
    assert sorted(out) == sorted(CASES["mixed.jsonl"].docs + CASES["corrupt.txt.gz"].docs)


def test_local_shard_reports_are_idempotent_and_leave_no_temporary_files(tmp_path):
    stats = ReadStats()
    stats.use(4)
    stats.reject("empty text", "field 'text' is blank", 2)
    run = tmp_path / "run"
    for _ in range(2):  # a retried task writes the same report again
        uri = write_shard_report(str(run), 3, "/corpus/a.jsonl", 0xABC, stats)
    assert uri == str(run / "data_reports" / "epoch-00003" / "00000abc.json")
    assert [p.name for p in (run / "data_reports" / "epoch-00003").iterdir()] == ["00000abc.json"]
    report = epoch_report(str(run), 3)
    assert (report["read"], report["used"], report["rejected"], report["reconciled"]) == (5, 4, 1, True)
    assert report["shards"][0]["examples"] == [[2, "field 'text' is blank"]]
    assert list_epochs(str(run)) == [3] and list_epochs(str(tmp_path / "nothing")) == []
    assert epoch_report(str(run), 4)["n_shards"] == 0


def test_epoch_report_flags_counts_that_do_not_add_up(tmp_path):
    write_shard_report(str(tmp_path), 0, "/corpus/ok.txt", 1, ReadStats(read=2, used=2))
    write_shard_report(str(tmp_path), 0, "/corpus/bad.txt", 2, ReadStats(read=5, used=3, rejected=1, reasons={"invalid UTF-8": 1}))
    report = epoch_report(str(tmp_path), 0)
    assert not report["reconciled"]
    assert report["problems"][0] == "/corpus/bad.txt: read 5 != used 3 + rejected 1"
    assert "NOT reconciled" in format_report(report)


def test_a_mixed_bucket_reconciles_exactly(s3_server, s3_bucket):
    """Good and broken shards in a real bucket, read through s3:// URIs, reported per epoch into an
    s3:// run folder: the epoch's report adds up to the numbers the shards were built with."""
    import boto3

    from pipelines.dataset import shard_keys

    s3 = boto3.client("s3", endpoint_url=s3_server)
    for name, case in CASES.items():
        s3.put_object(Bucket=s3_bucket, Key=f"corpus/{name}", Body=case.data)
    shards = [f"s3://{s3_bucket}/corpus/{name}" for name in sorted(CASES)]
    run = f"s3://{s3_bucket}/runs/r1"
    store = Store(s3_server)
    for epoch in (0, 1):
        for uri, key in zip(shards, shard_keys(shards)):
            docs, stats = read(uri, store)
            assert docs == CASES[uri.rsplit("/", 1)[1]].docs, uri
            write_shard_report(run, epoch, uri, key, stats, store)

    assert list_epochs(run, store) == [0, 1]
    report = epoch_report(run, 1, store)
    assert report["reconciled"] and report["problems"] == []
    assert report["n_shards"] == len(CASES)
    assert report["read"] == sum(c.read for c in CASES.values())
    assert report["used"] == sum(c.used for c in CASES.values())
    assert report["rejected"] == sum(c.rejected for c in CASES.values()) == 21
    assert report["read"] == report["used"] + report["rejected"]
    reasons: dict[str, int] = {}
    for c in CASES.values():
        for r, n in c.reasons.items():
            reasons[r] = reasons.get(r, 0) + n
    assert report["reasons"] == reasons
    assert report["empty_shards"] == 6
    for row in report["shards"]:
        case = CASES[row["shard"].rsplit("/", 1)[1]]
        assert (row["read"], row["used"], row["rejected"], row["reasons"], row["empty"]) == (case.read, case.used, case.rejected, case.reasons, case.read == 0)

    text = format_report(report)
    lines = text.splitlines()
    assert lines[0].startswith(f"epoch 1: {len(CASES)} shards, ") and "6 empty shards" in lines[0]
    broken = [n for n, c in CASES.items() if c.rejected or c.read == 0]
    assert len(lines) == 1 + len(broken)
    assert any("corrupt.txt.gz: 1 of " in line and "corrupt gzip after line" in line for line in lines)
    assert any(line.endswith("empty.parquet: empty (no records)") for line in lines)
