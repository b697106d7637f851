"""RoBERTa FULL-SENTENCES packing: whole sentences, contiguous, across documents, up to a length.

Liu et al. 2019 (RoBERTa), sec. 4.2: "FULL-SENTENCES: Each input is packed with full sentences
sampled contiguously from one or more documents, such that the total length is at most 512
tokens. Inputs may cross document boundaries. When we reach the end of one document, we begin
sampling sentences from the next document and add an extra separator token between documents."
Reference code: fairseq ``TokenBlockDataset(break_mode="complete")``, whose blocks hold whole
sentences (fairseq lets a sentence longer than a block overflow it; we cut it instead).

Rules, for a block of ``body = seq_len - 2`` tokens between ``[CLS]`` and ``[SEP]``:

* sentences are taken in order and a block takes the next sentence while it still fits, so a
  block never cuts a sentence;
* a sentence longer than ``body`` is cut into pieces of ``body`` tokens (each a block of its own)
  and a shorter remainder, which then packs like any sentence;
* where a new document starts inside a block, ``sep_id`` separates it from the previous one; a
  document that starts a block needs no separator (``[CLS]`` already opens the row);
* each block becomes one row ``[CLS] block [SEP] pad...``; ``attention_mask`` is 1 on the real
  tokens. Empty sentences and documents contribute nothing, not even a separator.

So every input token appears exactly once, in order, and nothing but separators is added.

The greedy fill is sequential in blocks, but each step is a lookup: with per-sentence costs
``w = length + separator`` and their prefix sums ``C``, the block that starts at sentence i ends
before ``next[i] = searchsorted(C, C[i] + sep[i] + body)`` (one vectorised call for all i), and the
block starts are the path 0, next[0], next[next[0]], ... found by pointer doubling.

Shapes: every output column is int64 (N, seq_len); N = 0 gives arrays of shape (0, seq_len).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

COLUMNS = ("input_ids", "attention_mask", "token_type_ids")


def _empty(seq_len: int) -> dict[str, np.ndarray]:
    return {name: np.zeros((0, seq_len), dtype=np.int64) for name in COLUMNS}


def split_long(lengths: np.ndarray, sep: np.ndarray, body: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut sentences longer than ``body`` into pieces of ``body`` tokens and a remainder.

    ``lengths`` (S,) > 0, ``sep`` (S,) bool (a separator precedes the sentence). Returns the pieces'
    lengths (P,) and separator flags (P,): only a sentence's first piece keeps its flag.
    """
    n_pieces = -(-lengths // body)  # (S,) ceil
    first = np.cumsum(n_pieces) - n_pieces  # (S,) index of each sentence's first piece
    piece_len = np.full(int(n_pieces.sum()), body, dtype=np.int64)  # (P,)
    piece_len[first + n_pieces - 1] = lengths - (n_pieces - 1) * body  # the remainders
    piece_sep = np.zeros(piece_len.size, dtype=bool)
    piece_sep[first] = sep
    return piece_len, piece_sep


def block_starts(lengths: np.ndarray, sep: np.ndarray, body: int) -> np.ndarray:
    """Greedy FULL-SENTENCES blocks: indices of the sentences that start a block, ascending.

    ``lengths`` (S,) in [1, body], ``sep`` (S,) bool. Sentence i packs into the block of the sentences
    before it when that block's tokens, the separator (if ``sep[i]``) and sentence i fit in ``body``.
    """
    n = lengths.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if lengths.max() > body or lengths.min() < 1:
        raise ValueError(f"block_starts: sentence lengths must lie in [1, {body}]; cut long ones with split_long")
    w = lengths + sep  # (S,) cost of a sentence inside a block
    c = np.concatenate([[0], np.cumsum(w)])  # (S+1,)
    # A block starting at i drops its leading separator; it holds i..j while C[j+1] - C[i] - sep[i] <= body.
    nxt = np.searchsorted(c, c[:-1] + sep + body, side="right") - 1  # (S,) first sentence of the next block
    nxt = np.concatenate([nxt, [n]])  # (S+1,) n is the end: it maps to itself
    # Pointer doubling: after k rounds ``path`` holds the first 2**k steps of the path from 0.
    path, jump = np.zeros(1, dtype=np.int64), nxt
    while path[-1] < n:
        path = np.concatenate([path, jump[path]])
        jump = jump[jump]
    return np.unique(path[path < n])


class Packer:
    """Streaming packer: feed documents in any number of ``add`` calls, then ``flush`` once.

    A document is a sequence of sentences, each a 1-D integer array of token ids without special
    tokens. ``add`` returns the rows completed so far and keeps the sentences of the open block (the
    only block the next sentence could still join); ``flush`` returns that block as a row (or no
    rows) and resets the packer for a new stream. The rows of a whole stream do not depend on how
    its documents were split among ``add`` calls.
    """

    def __init__(self, seq_len: int, cls_id: int, sep_id: int, pad_id: int) -> None:
        if seq_len < 3:
            raise ValueError(f"Packer: seq_len={seq_len} leaves no room for tokens between [CLS] and [SEP]; use seq_len >= 3")
        self.seq_len, self.cls_id, self.sep_id, self.pad_id = int(seq_len), int(cls_id), int(sep_id), int(pad_id)
        self._body = self.seq_len - 2  # tokens per row between [CLS] and [SEP]
        self._reset()

    def _reset(self) -> None:
        # The open block: its sentences' tokens, lengths and separator flags.
        self._tokens = np.zeros(0, dtype=np.int64)
        self._lengths = np.zeros(0, dtype=np.int64)
        self._sep = np.zeros(0, dtype=bool)
        self._seen_doc = False  # a document came before, so the next one needs a separator

    def add(self, docs: Sequence[Sequence[np.ndarray]]) -> dict[str, np.ndarray]:
        """Append documents (each a list of sentences of token ids); return the completed rows."""
        sentences, sep = [], []
        for d, doc in enumerate(docs):
            if isinstance(doc, np.ndarray):
                raise ValueError(f"Packer.add: document {d} is an array; a document is a list of sentences (1-D arrays of token ids)")
            arrays = [np.asarray(s).reshape(-1) for s in doc]
            arrays = [a for a in arrays if a.size]
            for a in arrays:
                if not np.issubdtype(a.dtype, np.integer):
                    raise ValueError(f"Packer.add: document {d} holds dtype {a.dtype}; sentences must be integer token ids")
            if arrays:
                sentences.extend(arrays)
                sep.extend([self._seen_doc] + [False] * (len(arrays) - 1))  # a separator before every document but the stream's first
                self._seen_doc = True
        if not sentences:
            return _empty(self.seq_len)
        lengths = np.array([a.size for a in sentences], dtype=np.int64)  # (S,)
        lengths, sep_flags = split_long(lengths, np.array(sep, dtype=bool), self._body)
        tokens = np.concatenate([self._tokens, *sentences]).astype(np.int64, copy=False)  # (sum lengths,)
        lengths = np.concatenate([self._lengths, lengths])  # (P,) open block first
        sep_flags = np.concatenate([self._sep, sep_flags])  # (P,)
        starts = block_starts(lengths, sep_flags, self._body)  # (B,) starts[0] == 0
        last = int(starts[-1])  # the open block: later sentences may still join it
        n_done_tokens = int(lengths[:last].sum())
        self._tokens = tokens[n_done_tokens:].copy()
        self._lengths, self._sep = lengths[last:], sep_flags[last:]
        return self._rows(tokens[:n_done_tokens], lengths[:last], sep_flags[:last], starts[:-1])

    def flush(self) -> dict[str, np.ndarray]:
        """Return the open block as one row (or no rows) and start a new stream."""
        tokens, lengths, sep = self._tokens, self._lengths, self._sep
        self._reset()
        return self._rows(tokens, lengths, sep, np.zeros(min(lengths.size, 1), dtype=np.int64))

    def _rows(self, tokens: np.ndarray, lengths: np.ndarray, sep: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
        """Rows ``[CLS] block [SEP] pad...`` of the blocks that start at sentences ``starts``."""
        n_rows = starts.size
        if n_rows == 0:
            return _empty(self.seq_len)
        sep = sep.copy()
        sep[starts] = False  # a block's first sentence needs no separator
        offsets = np.cumsum(lengths) - lengths  # (S,) where each sentence's tokens begin
        stream = np.insert(tokens, offsets[sep], self.sep_id)  # (T,) tokens with document separators
        cost = lengths + sep  # (S,)
        row_len = np.add.reduceat(cost, starts)  # (N,) tokens between [CLS] and [SEP]
        row_start = np.cumsum(row_len) - row_len  # (N,) where each row begins in the stream
        row_of = np.repeat(np.arange(n_rows), row_len)  # (T,)
        col = np.arange(stream.size) - row_start[row_of] + 1  # (T,) after [CLS]
        ids = np.full((n_rows, self.seq_len), self.pad_id, dtype=np.int64)  # (N, seq_len)
        ids[:, 0] = self.cls_id
        ids[row_of, col] = stream
        ids[np.arange(n_rows), row_len + 1] = self.sep_id
        mask = (np.arange(self.seq_len)[None, :] < (row_len + 2)[:, None]).astype(np.int64)  # (N, seq_len)
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def concat_rows(parts: list[dict[str, np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
    """Stack the outputs of several ``add``/``flush`` calls into one set of columns."""
    if not parts:
        return _empty(seq_len)
    return {name: np.concatenate([p[name] for p in parts]) for name in COLUMNS}


def pack_documents(docs: Sequence[Sequence[np.ndarray]], seq_len: int, cls_id: int, sep_id: int, pad_id: int) -> dict[str, np.ndarray]:
    """Pack a whole list of documents (each a list of sentences): ``Packer.add`` then ``Packer.flush``."""
    packer = Packer(seq_len, cls_id, sep_id, pad_id)
    return concat_rows([packer.add(docs), packer.flush()], seq_len)
