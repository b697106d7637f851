"""Reading corpus shards into documents.

Formats (picked by suffix, or forced by ``fmt``):

- ``.txt`` / ``.txt.gz``: one sentence per line, a blank line between documents (the convention of
  BERT's ``create_pretraining_data.py``); a file without blank lines is one document per line
  group, which is harmless for packed objectives.
- ``.jsonl`` / ``.json`` (+ ``.gz``): one JSON object per line; the document is ``record[text_field]``.
- ``.parquet``: the document is column ``text_field``, read row group by row group.

A shard is read as a stream of document chunks, so a multi-GB shard never sits in memory whole.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Iterator, Literal

import pyarrow.fs as pafs

from pipelines.storage import filesystem, with_retries

Format = Literal["auto", "text", "jsonl", "parquet"]


class CorpusError(ValueError):
    """A shard that cannot be read as asked; the message names the shard and the place."""


@dataclass
class ReadStats:
    """Per-shard counts: ``read == used + rejected`` always holds."""

    read: int = 0
    used: int = 0
    rejected: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def reject(self, reason: str) -> None:
        self.read += 1
        self.rejected += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def use(self) -> None:
        self.read += 1
        self.used += 1


def detect_format(path: str) -> Format:
    p = path.lower()
    if p.endswith((".txt", ".txt.gz")):
        return "text"
    if p.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        return "jsonl"
    if p.endswith(".parquet"):
        return "parquet"
    raise CorpusError(f"{path}: unknown corpus format (use .txt, .jsonl, .parquet, optionally .gz, or set data.format)")


def iter_documents(
    uri: str,
    fmt: Format = "auto",
    text_field: str = "text",
    chunk_docs: int = 2048,
    endpoint_url: str | None = None,
    stats: ReadStats | None = None,
) -> Iterator[list[str]]:
    """Yield lists of up to ``chunk_docs`` documents from one shard."""
    fmt = detect_format(uri) if fmt == "auto" else fmt
    stats = stats if stats is not None else ReadStats()
    fs, path = filesystem(uri, endpoint_url)
    if fmt == "parquet":
        yield from _parquet_docs(fs, path, uri, text_field, chunk_docs, stats)
        return
    compression = "gzip" if path.endswith(".gz") else None
    stream = with_retries(lambda: fs.open_input_stream(path, compression=compression), f"open {uri}")
    with stream:
        text = io.TextIOWrapper(stream, encoding="utf-8", errors="strict", newline="\n")
        lines = _lines(text, uri)
        docs = _text_docs(lines) if fmt == "text" else _jsonl_docs(lines, uri, text_field, stats)
        chunk: list[str] = []
        for doc in docs:
            if fmt == "text":
                stats.use()
            chunk.append(doc)
            if len(chunk) >= chunk_docs:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def _lines(text: io.TextIOWrapper, uri: str) -> Iterator[tuple[int, str]]:
    n = 0
    try:
        for n, line in enumerate(text, 1):
            yield n, line.rstrip("\n").rstrip("\r")
    except UnicodeDecodeError as e:
        raise CorpusError(f"{uri}: invalid UTF-8 after line {n}: {e.reason}") from None
    except (OSError, EOFError) as e:  # gzip truncated or corrupt
        raise CorpusError(f"{uri}: cannot read after line {n}: {e}") from None


def _text_docs(lines: Iterator[tuple[int, str]]) -> Iterator[str]:
    doc: list[str] = []
    for _, line in lines:
        if line.strip():
            doc.append(line.strip())
        elif doc:
            yield "\n".join(doc)
            doc = []
    if doc:
        yield "\n".join(doc)


def _jsonl_docs(lines: Iterator[tuple[int, str]], uri: str, text_field: str, stats: ReadStats) -> Iterator[str]:
    for n, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{uri}:{n}: malformed JSON: {e.msg}") from None
        if not isinstance(record, dict) or text_field not in record:
            raise CorpusError(f"{uri}:{n}: record has no {text_field!r} field (set data.text_field)")
        value = record[text_field]
        if not isinstance(value, str):
            raise CorpusError(f"{uri}:{n}: field {text_field!r} is {type(value).__name__}, not a string")
        if value.strip():
            stats.use()
            yield value
        else:
            stats.reject("empty text")


def _parquet_docs(fs: pafs.FileSystem, path: str, uri: str, text_field: str, chunk_docs: int, stats: ReadStats) -> Iterator[list[str]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(with_retries(lambda: fs.open_input_file(path), f"open {uri}"))
    except Exception as e:  # pyarrow raises ArrowInvalid for corrupt footers
        raise CorpusError(f"{uri}: not a readable Parquet file: {e}") from None
    if text_field not in pf.schema_arrow.names:
        raise CorpusError(f"{uri}: no column {text_field!r} (columns: {pf.schema_arrow.names}; set data.text_field)")
    for rg in range(pf.num_row_groups):
        col = pf.read_row_group(rg, columns=[text_field]).column(0).to_pylist()
        chunk = []
        for value in col:
            if isinstance(value, str) and value.strip():
                stats.use()
                chunk.append(value)
            else:
                stats.reject("empty or null text")
            if len(chunk) >= chunk_docs:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def sample_text(uris: list[str], max_chars: int, fmt: Format = "auto", text_field: str = "text", endpoint_url: str | None = None) -> Iterator[str]:
    """Documents from the first shards until ``max_chars`` characters: what tokenizers train on.

    Shards are visited round-robin (one chunk from each in turn) so a sample of a large corpus
    is not all from its first file.
    """
    iters = [iter_documents(u, fmt, text_field, chunk_docs=256, endpoint_url=endpoint_url) for u in uris]
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
