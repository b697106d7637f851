"""Reading corpus shards into documents, accounting for every record that is not used.

Formats (picked by suffix, or forced by ``fmt``):

- ``.txt``: one sentence per line, a blank line between documents (the convention of BERT's
  ``create_pretraining_data.py``); a file without blank lines is one document per line group,
  which is harmless for packed objectives.
- ``.jsonl`` / ``.json``: one JSON object per line; the document is ``record[text_field]``.
- Either of those compressed whole, as corpora ship, by the name's last ending
  (``pipelines.storage.CORPUS_COMPRESSIONS``): ``.gz`` (C4, Dolma), ``.zst`` / ``.zstd`` (the Pile,
  SlimPajama), ``.xz`` (CC-100), ``.bz2``; concatenated members / frames / streams are read on.
- ``.parquet``: the document is column ``text_field``, read row group by row group.
- Parallel text (XLM's translation LM, ``iter_translations``): JSONL records holding one sentence
  in each of two languages under the languages' names, ``{"en": "...", "fr": "..."}``.

A shard is read as a stream of document chunks, so a multi-GB shard never sits in memory whole.

Bad data. A *record* is a non-blank line of a text shard (blank lines separate documents and are
not records), a non-blank line of a JSONL shard, or a row of a Parquet shard. Every record is
either used or rejected with a reason, so ``read == used + rejected`` for every shard
(``ReadStats``). By default a bad record is skipped and counted; ``strict=True`` raises
``CorpusError`` at the first one instead, naming ``shard:line`` (``shard:row R`` for Parquet).

What is rejected, by reason (the short category; ``ReadStats.examples`` keeps the details):

- ``invalid UTF-8``: the line, and reading goes on with the next line (each line's bytes are
  decoded on their own, so one bad byte costs one line).
- ``line too long`` / ``value too long``: more than ``max_record_chars`` characters. A long line
  is skipped as it streams by: no more than about ``max_record_chars`` of it is held in memory.
- ``corrupt gzip`` / ``truncated gzip`` (``zstd``, ``xz``, ``bzip2`` alike): everything decoded
  before the damage is used (a gzip shard's to the byte; the others' up to the last piece of at most
  64 KiB decoded before it: their decoders cannot be replayed byte by byte); the unreadable
  remainder of the shard counts as one rejected record.
- ``malformed JSON``, ``not an object``, ``missing field``, ``not a string``: JSONL lines.
- ``empty text`` (blank text) and ``null text`` (a Parquet null).
- ``unreadable Parquet``: a file pyarrow cannot open counts as one record; a row group it cannot
  read counts as its rows.

An empty file (or one with only blank lines) has no records: it is not an error, even in strict
mode, and ``ReadStats.empty`` says so for the data report (``pipelines.datareport``).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Collection, Iterator, Literal, TypeVar

import pyarrow.fs as pafs

from pipelines.storage import CORPUS_COMPRESSIONS, Store, StorageError, filesystem, is_transient

T = TypeVar("T")

Format = Literal["auto", "text", "jsonl", "parquet"]

MAX_RECORD_CHARS = 1_000_000  # default of data.max_record_chars: a bound on one record, not a tokenizer limit
_BLOCK = 1 << 16  # bytes read (or inflated) at a time: the unit of memory while reading a shard
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # zlib expects a gzip header and trailer (CRC32, size)
_CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 continuation bytes: every other byte starts a character
_BOM = b"\xef\xbb\xbf"


class CorpusError(ValueError):
    """A shard that cannot be read as asked; the message names the shard and the place."""


@dataclass
class ReadStats:
    """What became of the records of one shard: ``read == used + rejected`` always holds.

    ``reasons`` counts rejections by short category (see the module docstring); ``examples``
    keeps the first ``MAX_EXAMPLES`` rejections as ``(line, message)``, where ``line`` is the
    1-based line (the 0-based row for Parquet) or None when the whole file is concerned.
    """

    read: int = 0
    used: int = 0
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    examples: list[tuple[int | None, str]] = field(default_factory=list)

    MAX_EXAMPLES: ClassVar[int] = 5

    @property
    def empty(self) -> bool:
        """True when the shard held no record at all (an empty file, or only blank lines)."""
        return self.read == 0

    def use(self, count: int = 1) -> None:
        self.read += count
        self.used += count

    def reject(self, reason: str, message: str | None = None, line: int | None = None, count: int = 1) -> None:
        """Count ``count`` records rejected for ``reason``; ``message`` says what exactly was wrong."""
        self.read += count
        self.rejected += count
        self.reasons[reason] = self.reasons.get(reason, 0) + count
        if len(self.examples) < self.MAX_EXAMPLES:
            self.examples.append((line, message or reason))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values; ``from_dict`` reads them back."""
        return {
            "read": self.read,
            "used": self.used,
            "rejected": self.rejected,
            "reasons": dict(self.reasons),
            "examples": [[line, message] for line, message in self.examples],
            "empty": self.empty,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReadStats:
        return cls(
            read=int(d["read"]),
            used=int(d["used"]),
            rejected=int(d["rejected"]),
            reasons={str(k): int(v) for k, v in d.get("reasons", {}).items()},
            examples=[(line, str(message)) for line, message in d.get("examples", [])],
        )


def detect_format(path: str) -> Format:
    p = path.lower()
    base = p[: len(p) - len(_compressed_ending(p))]
    if base.endswith(".txt"):
        return "text"
    if base.endswith((".jsonl", ".json")):
        return "jsonl"
    if p.endswith(".parquet"):
        return "parquet"
    raise CorpusError(f"{path}: unknown corpus format (use .txt, .jsonl or .parquet, the first two optionally compressed "
                      f"as {', '.join(CORPUS_COMPRESSIONS)}, or set data.format)")


def _compressed_ending(path: str) -> str:
    """The ending of ``CORPUS_COMPRESSIONS`` that ``path`` has (any case), "" for a plain file."""
    p = path.lower()
    return next((end for end in CORPUS_COMPRESSIONS if p.endswith(end)), "")


@dataclass
class _Shard:
    """Where rejections of one shard go: counted in ``stats``, or raised when ``strict``."""

    uri: str
    stats: ReadStats
    strict: bool

    def reject(self, reason: str, message: str, line: int | None, count: int = 1, row: bool = False) -> None:
        self.stats.reject(reason, message, line, count)
        if self.strict:
            where = self.uri if line is None else f"{self.uri}:row {line}" if row else f"{self.uri}:{line}"
            raise CorpusError(f"{where}: {message}")


def iter_documents(
    uri: str,
    fmt: Format = "auto",
    text_field: str = "text",
    chunk_docs: int = 2048,
    store: Store = Store(),
    stats: ReadStats | None = None,
    strict: bool = False,
    max_record_chars: int = MAX_RECORD_CHARS,
) -> Iterator[list[str]]:
    """Yield lists of up to ``chunk_docs`` documents from one shard.

    Bad records are skipped and counted in ``stats`` (pass one to read the counts when the
    iterator is exhausted), or raise ``CorpusError`` at the first one when ``strict``.
    Records longer than ``max_record_chars`` characters are rejected.

    The store failing mid-way (a dropped connection, an endpoint restarting) is not bad data: a
    read that fails transiently is retried until ``store``'s deadline, reopening the shard
    at the byte it stopped at (a Parquet row group is read again whole), so every record is
    read once and in order whatever the network did.
    """
    fmt = detect_format(uri) if fmt == "auto" else fmt
    shard = _Shard(uri, stats if stats is not None else ReadStats(), strict)
    fs, path = filesystem(uri, store.endpoint_url)
    if fmt == "parquet":
        yield from _parquet_docs(fs, path, shard, text_field, chunk_docs, max_record_chars, store)
        return
    lines = _shard_lines(fs, path, uri, store, shard, max_record_chars)
    yield from _chunks(_text_docs(lines, shard.stats) if fmt == "text" else _jsonl_docs(lines, shard, text_field), chunk_docs)


Translation = tuple[int, str, int, str]  # (language id, sentence, language id, its translation)


def iter_translations(
    uri: str,
    languages: tuple[str, ...],
    chunk_pairs: int = 2048,
    store: Store = Store(),
    stats: ReadStats | None = None,
    strict: bool = False,
    max_record_chars: int = MAX_RECORD_CHARS,
) -> Iterator[list[Translation]]:
    """Lists of up to ``chunk_pairs`` translation pairs from one JSONL shard (``.gz`` or not).

    A record names two of ``languages`` (their index is the language id), in the order the
    record gives them; a record with other keys beside them is fine, one with fewer or more of
    the languages, a value that is not a string, or a blank one is rejected (and counted), as
    ``iter_documents`` rejects bad records, with the store's retries around every read."""
    shard = _Shard(uri, stats if stats is not None else ReadStats(), strict)
    fs, path = filesystem(uri, store.endpoint_url)
    ids = {name: i for i, name in enumerate(languages)}

    def pairs() -> Iterator[Translation]:
        for n, record in _json_objects(_shard_lines(fs, path, uri, store, shard, max_record_chars), shard):
            named = [k for k in record if k in ids]
            if len(named) != 2:
                shard.reject("not a pair", f"record names {len(named)} of data.languages {list(languages)} "
                             f"({named}); a translation pair names two", n)
                continue
            texts = [record[k] for k in named]
            bad = [k for k, t in zip(named, texts) if not isinstance(t, str) or not t.strip()]
            if bad:
                shard.reject("empty text", f"field {bad[0]!r} is not a non-blank string", n)
                continue
            shard.stats.use()
            yield ids[named[0]], texts[0].strip(), ids[named[1]], texts[1].strip()

    yield from _chunks(pairs(), chunk_pairs)


def _shard_lines(fs: pafs.FileSystem, path: str, uri: str, store: Store, shard: "_Shard", max_chars: int) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a text or JSONL shard, read through the store's retries (decompressed
    by the codec its name ends with, ``CORPUS_COMPRESSIONS``); unreadable lines are rejected
    (``_decoded_lines``)."""
    codec = CORPUS_COMPRESSIONS.get(_compressed_ending(path))
    with _ResumableReader(fs, path, uri, store) as reader:
        blocks = reader.blocks()
        pieces = blocks if codec is None else _gunzip(blocks) if codec == "gzip" else _unpack(blocks, codec)
        yield from _decoded_lines(pieces, shard, max_chars)


# ---------------------------------------------------------------------------------------------
# Bytes -> lines, with bounded memory and damage confined to what it damaged.


class _Damage(Exception):
    """Compressed data that stops making sense: ``reason`` is ``corrupt <codec>`` or ``truncated <codec>``."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _ResumableReader:
    """The raw bytes of one file, ``_BLOCK`` at a time. A read that fails transiently closes the
    stream and, on the next attempt, reopens the file at the byte offset reached, so the bytes
    come out exactly once and in order across any number of reconnections."""

    def __init__(self, fs: pafs.FileSystem, path: str, uri: str, store: Store):
        self.fs, self.path, self.uri, self.store = fs, path, uri, store
        self.offset = 0
        self.stream: pafs.NativeFile | None = None
        self.reopened = 0  # reconnections after a failed read (for tests and logs)

    def _read(self) -> bytes:
        if self.stream is None:
            if self.offset == 0:
                self.stream = self.fs.open_input_stream(self.path, compression=None)
            else:  # random access only to resume: a plain stream is what every filesystem offers
                self.stream = self.fs.open_input_file(self.path)
                self.stream.seek(self.offset)
                self.reopened += 1
        try:
            return self.stream.read(_BLOCK)
        except OSError:
            self.close()  # a broken connection: the next attempt starts a new one at self.offset
            raise

    def blocks(self) -> Iterator[bytes]:
        while True:
            try:
                block = self.store.retry(self._read, f"read {self.uri} at byte {self.offset}")
            except OSError as e:  # the store, not the data (a missing or forbidden object): not a bad record
                raise StorageError(f"read {self.uri} at byte {self.offset}: {e}") from e
            if not block:
                return
            self.offset += len(block)
            yield block

    def close(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            try:
                stream.close()
            except OSError:
                pass  # closing a broken connection can fail too; nothing is lost

    def __enter__(self) -> "_ResumableReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _gunzip(blocks: Iterator[bytes]) -> Iterator[bytes]:
    """Inflate gzip members (``cat a.gz b.gz`` is valid gzip) in pieces of at most ``_BLOCK`` bytes.

    Raises ``_Damage`` where the data stops making sense, after yielding every byte that
    was decoded before that point (an error inside one zlib call would otherwise drop the whole
    call's output, so the failing block is replayed one byte at a time from a copy of the
    decoder's state).
    """
    d = zlib.decompressobj(_GZIP_WBITS)
    fed = False  # has the current member received any input?
    for block in blocks:
        while block:
            fed = True
            before = d.copy()
            done = 0
            try:
                for piece in _inflate(d, block):
                    done += len(piece)
                    yield piece
            except zlib.error as e:
                yield from _replay(before, block, skip=done)
                raise _Damage("corrupt gzip", str(e)) from None
            if not d.eof:
                break
            block = d.unused_data.lstrip(b"\0")  # next member; zero padding after a member is allowed
            d, fed = zlib.decompressobj(_GZIP_WBITS), False
    if fed and not d.eof:
        raise _Damage("truncated gzip", "the compressed data ends before the end of the gzip stream")


def _decoder(codec: str) -> tuple[Any, tuple[type[Exception], ...]]:
    """A new decoder of one zstd frame, xz stream or bzip2 stream, in the standard library's shape
    (``decompress(data, max_length)``, ``eof``, ``needs_input``, ``unused_data``), and the errors it
    raises on bad data."""
    if codec == "zstd":
        try:
            from compression import zstd  # Python 3.14's standard library
        except ImportError:
            from backports import zstd  # the same module, for earlier Pythons
        # A frame written with `zstd --long=31` (Reddit's Pushshift dumps) declares a window of up to 2 GiB, which
        # the decoder's default (128 MiB) refuses as "too much memory": such a shard is valid, so it is read (the
        # window's pages are touched only as far as the data reaches).
        return zstd.ZstdDecompressor(options={zstd.DecompressionParameter.window_log_max: 31}), (zstd.ZstdError,)
    if codec == "xz":
        import lzma

        return lzma.LZMADecompressor(), (lzma.LZMAError,)
    if codec == "bzip2":
        import bz2

        return bz2.BZ2Decompressor(), (OSError,)
    raise ValueError(f"unknown codec {codec!r} (CORPUS_COMPRESSIONS names gzip, zstd, xz, bzip2)")


def _unpack(blocks: Iterator[bytes], codec: str) -> Iterator[bytes]:
    """Decode a zstd, xz or bzip2 shard in pieces of at most ``_BLOCK`` bytes, one frame (stream)
    after another: ``cat a.zst b.zst`` is valid, as for gzip.

    Raises ``_Damage`` where the data stops making sense, after yielding every piece decoded before
    the failing call. These decoders cannot be copied, so the failing call's own output (at most
    ``_BLOCK`` bytes, within the damaged compressed block) is lost with it; zstd's and xz's checksums
    are checked where a frame ends, so damage they alone catch is found after its bytes went by.
    """
    d, errors = _decoder(codec)
    fed = False  # has the current frame received any input?
    for block in blocks:
        while block:
            fed = True
            while True:
                try:
                    piece = d.decompress(block, _BLOCK)
                except errors as e:
                    raise _Damage(f"corrupt {codec}", str(e)) from None
                block = b""  # taken in: the decoder holds what it has not used yet
                if piece:
                    yield piece
                if d.eof or d.needs_input:
                    break
            if not d.eof:
                break
            block = d.unused_data.lstrip(b"\0")  # the next frame; xz allows zero padding between streams
            (d, _), fed = _decoder(codec), False
    if fed and not d.eof:
        raise _Damage(f"truncated {codec}", f"the compressed data ends before the end of the {codec} {'frame' if codec == 'zstd' else 'stream'}")


def _inflate(d: Any, data: bytes) -> Iterator[bytes]:
    while True:
        out = d.decompress(data, _BLOCK)
        if out:
            yield out
        if d.eof:
            return
        data = d.unconsumed_tail
        if not data and len(out) < _BLOCK:  # input used up and no output held back
            return


def _replay(d: Any, block: bytes, skip: int) -> Iterator[bytes]:
    """The output of ``block`` decodable before its damaged byte, minus ``skip`` bytes already given."""
    try:
        for i in range(len(block)):
            for piece in _inflate(d, block[i : i + 1]):
                if skip >= len(piece):
                    skip -= len(piece)
                    continue
                yield piece[skip:]
                skip = 0
    except zlib.error:
        return


def _split_lines(pieces: Iterator[bytes], max_chars: int) -> Iterator[tuple[bytes | None, str]]:
    """``(line, "")`` for each line (without its newline), or ``(None, length)`` for a line longer
    than ``max_chars`` characters, which is measured as it streams past instead of being held."""
    max_bytes = 4 * max_chars  # no valid UTF-8 line of max_chars characters is longer
    held: list[bytes] = []  # the start of the current line: at most max_chars characters, max_bytes bytes
    chars = nbytes = 0
    overflow = False  # the current line is too long: only its length is still tracked
    for piece in pieces:
        parts = piece.split(b"\n")
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if not held and not overflow and not last:  # the common case: a whole line inside one piece
                n = len(part) if len(part) <= max_chars else _chars(part)
                yield (part, "") if n <= max_chars else (None, _length(n, len(part)))
                continue
            chars += _chars(part)
            nbytes += len(part)
            if not overflow and (chars > max_chars or nbytes > max_bytes):
                overflow, held = True, []
            if not overflow:
                held.append(part)
            if not last:
                yield (None, _length(chars, nbytes)) if overflow else (b"".join(held), "")
                held, chars, nbytes, overflow = [], 0, 0, False
    if nbytes:  # a last line without a newline
        yield (None, _length(chars, nbytes)) if overflow else (b"".join(held), "")


def _length(chars: int, nbytes: int) -> str:
    return f"{chars} characters" if chars * 4 >= nbytes else f"{chars} characters ({nbytes} bytes, not UTF-8)"


def _chars(b: bytes) -> int:
    return len(b.translate(None, _CONTINUATION))


def _decoded_lines(pieces: Iterator[bytes], shard: _Shard, max_chars: int) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of every readable line, blank ones included; the rest is rejected."""
    n = 0
    try:
        for raw, length in _split_lines(pieces, max_chars):
            n += 1
            if raw is None:
                shard.reject("line too long", f"line of {length} exceeds data.max_record_chars={max_chars}", n)
                continue
            if n == 1 and raw.startswith(_BOM):
                raw = raw[len(_BOM) :]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                shard.reject("invalid UTF-8", f"invalid UTF-8 at byte {e.start} of the line: {e.reason}", n)
                continue
            yield n, text.rstrip("\r")
    except _Damage as e:
        shard.reject(e.reason, f"{e.reason} after line {n}: {e.detail}", n + 1)


# ---------------------------------------------------------------------------------------------
# Lines -> documents.


def _text_docs(lines: Iterator[tuple[int, str]], stats: ReadStats) -> Iterator[str]:
    doc: list[str] = []
    for _, line in lines:
        if line.strip():
            stats.use()
            doc.append(line.strip())
        elif doc:
            yield "\n".join(doc)
            doc = []
    if doc:
        yield "\n".join(doc)


def json_lines(data: bytes, uri: str, error: type[ValueError] = ValueError) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` of every line of a small JSONL file read whole (a benchmark's or a
    test set's), blank lines skipped; the first line that is not a JSON object raises ``error``
    naming the file and line (a corpus shard rejects such lines and goes on instead: ``_json_objects``)."""
    for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise error(f"{uri}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise error(f"{uri}:{n}: a JSON {type(record).__name__}, not an object")
        yield n, record


def _json_objects(lines: Iterator[tuple[int, str]], shard: _Shard) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` of every JSON object line; blank lines skipped, the rest rejected."""
    for n, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            shard.reject("malformed JSON", f"malformed JSON: {e.msg} (column {e.colno})", n)
            continue
        if not isinstance(record, dict):
            shard.reject("not an object", f"record is a JSON {type(record).__name__}, not an object", n)
            continue
        yield n, record


def _jsonl_docs(lines: Iterator[tuple[int, str]], shard: _Shard, text_field: str) -> Iterator[str]:
    for n, record in _json_objects(lines, shard):
        if text_field not in record:
            shard.reject("missing field", f"record has no {text_field!r} field (set data.text_field)", n)
            continue
        value = record[text_field]
        if not isinstance(value, str):
            shard.reject("not a string", f"field {text_field!r} is {type(value).__name__}, not a string", n)
        elif not value.strip():
            shard.reject("empty text", f"field {text_field!r} is blank", n)
        else:
            shard.stats.use()
            yield value


def _parquet_docs(fs: pafs.FileSystem, path: str, shard: _Shard, text_field: str, chunk_docs: int, max_chars: int,
                  store: Store) -> Iterator[list[str]]:
    import pyarrow.parquet as pq

    def network_safe(fn: Callable[[], Any]) -> Any:
        return _unless_the_store_is_down(fn, fs, path, shard.uri, store)

    with store.retry(lambda: fs.open_input_file(path), f"open {shard.uri}") as f:
        if f.size() == 0:
            return  # an empty file: no records
        try:
            pf = network_safe(lambda: pq.ParquetFile(f))
        except StorageError:
            raise
        except Exception as e:  # pyarrow raises ArrowInvalid for corrupt footers
            shard.reject("unreadable Parquet", f"not a readable Parquet file: {e}", None)
            return
        if text_field not in pf.schema_arrow.names:
            message = f"no column {text_field!r} (columns: {pf.schema_arrow.names}; set data.text_field)"
            if pf.metadata.num_rows:
                shard.reject("missing field", message, None, count=pf.metadata.num_rows)
            return
        start = 0  # row index of the row group's first row
        for rg in range(pf.num_row_groups):
            yield from _row_group_docs(pf, rg, start, shard, text_field, chunk_docs, max_chars, network_safe)
            start += pf.metadata.row_group(rg).num_rows


def _unless_the_store_is_down(fn: Callable[[], T], fs: pafs.FileSystem, path: str, uri: str, store: Store) -> T:
    """``fn()``, a read through a Parquet reader, tried again while the store is unreachable.

    pyarrow raises the same errno-less OSError for a damaged page as for a dropped connection, so
    the error alone cannot tell bad data from a bad network. The store can: after a failure, the
    file's metadata is asked for (with retries until ``store``'s deadline). If the store answered at
    once, the failure was the data's and is raised for the caller to count as rejected records;
    if it had to be waited for, ``fn`` is tried again (a row group is read again whole).
    """
    while True:
        try:
            return fn()
        except OSError as e:
            if not is_transient(e):
                raise
            tries = []

            def stat() -> None:
                tries.append(1)
                fs.get_file_info(path)

            store.retry(stat, f"read {uri}")
            if len(tries) == 1:
                raise


def _row_group_docs(pf: Any, rg: int, start: int, shard: _Shard, text_field: str, chunk_docs: int, max_chars: int,
                    network_safe: Callable[[Callable[[], Any]], Any] = lambda fn: fn()) -> Iterator[list[str]]:
    try:
        values = network_safe(lambda: pf.read_row_group(rg, columns=[text_field])).column(0).to_pylist()
    except StorageError:
        raise  # the store stayed unreachable past the deadline: not bad data
    except Exception as e:  # a damaged page or column chunk: the footer said how many rows are lost
        rows = pf.metadata.row_group(rg).num_rows
        shard.reject("unreadable Parquet", f"row group {rg} (rows {start}-{start + rows - 1}) unreadable: {e}", start, count=rows, row=True)
        return
    chunk: list[str] = []
    for row, value in enumerate(values, start):
        if value is None:
            shard.reject("null text", f"column {text_field!r} is null", row, row=True)
        elif not isinstance(value, str):
            shard.reject("not a string", f"column {text_field!r} holds {type(value).__name__}, not a string", row, row=True)
        elif not value.strip():
            shard.reject("empty text", f"column {text_field!r} is blank", row, row=True)
        elif len(value) > max_chars:
            shard.reject("value too long", f"value of {len(value)} characters exceeds data.max_record_chars={max_chars}", row, row=True)
        else:
            shard.stats.use()
            chunk.append(value)
            if len(chunk) >= chunk_docs:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _chunks(items: Iterator[T], size: int) -> Iterator[list[T]]:
    """Lists of ``size`` items (the last one shorter)."""
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def sample_text(uris: list[str], max_chars: int, fmt: Format = "auto", text_field: str = "text",
                store: Store = Store(), translations: tuple[str, ...] = (), parallel: Collection[str] | None = None) -> Iterator[str]:
    """Documents from the first shards until ``max_chars`` characters: what tokenizers train on.

    Shards are visited round-robin (one chunk from each in turn) so a sample of a large corpus
    is not all from its first file. Bad records are skipped. ``translations``: parallel text in
    these languages (``iter_translations``), each pair giving both sentences, in the shards
    ``parallel`` names (every shard when None; XLM's MLM + TLM has both kinds).
    """

    def chunks(uri: str) -> Iterator[list[str]]:
        if translations and (parallel is None or uri in parallel):
            pairs = iter_translations(uri, translations, chunk_pairs=256, store=store)
            return _chunks((f"{a}\n{b}" for chunk in pairs for _, a, _, b in chunk), 256)
        return iter_documents(uri, fmt, text_field, chunk_docs=256, store=store)

    iters = [chunks(u) for u in uris]
    total = 0
    while iters and total < max_chars:
        for it in list(iters):
            chunk = next(it, None)
            if chunk is None:
                iters.remove(it)
                continue
            for doc in chunk:
                yield doc
                total += len(doc)
                if total >= max_chars:
                    return
