"""RoBERTa FULL-SENTENCES packing: documents as one token stream cut into fixed-length rows.

Liu et al. 2019 (RoBERTa), sec. 4.2: "Each input is packed with full sentences sampled
contiguously from one or more documents, such that the total length is at most 512 tokens.
Inputs may cross document boundaries. When we reach the end of one document, we begin sampling
sentences from the next document and add an extra separator token between documents." Reference
code: fairseq ``TokenBlockDataset`` (``break_mode="none"`` over documents joined by a separator).

Here the documents' tokens are concatenated in order with ``sep_id`` between consecutive
documents, cut into blocks of ``seq_len - 2`` tokens, and each block becomes one row
``[CLS] block [SEP]``. The last, shorter block is padded (``attention_mask`` 0) instead of dropped,
so every token is trained on. Empty documents contribute nothing, not even a separator.

Shapes: every output column is int64 (N, seq_len); N = 0 gives arrays of shape (0, seq_len).
"""

from __future__ import annotations

import numpy as np

COLUMNS = ("input_ids", "attention_mask", "token_type_ids")


def _rows(blocks: np.ndarray, cls_id: int, sep_id: int) -> dict[str, np.ndarray]:
    """Wrap full blocks (N, seq_len - 2) as [CLS] block [SEP] rows."""
    n, body = blocks.shape
    ids = np.empty((n, body + 2), dtype=np.int64)  # (N, seq_len)
    ids[:, 0] = cls_id
    ids[:, 1:-1] = blocks
    ids[:, -1] = sep_id
    return {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "token_type_ids": np.zeros_like(ids),
    }


def _empty(seq_len: int) -> dict[str, np.ndarray]:
    return {name: np.zeros((0, seq_len), dtype=np.int64) for name in COLUMNS}


class Packer:
    """Streaming packer: feed documents in any number of ``add`` calls, then ``flush`` once.

    ``add`` returns the rows completed so far and keeps the unfinished block; ``flush`` returns
    the padded last row (or no rows) and resets the packer for a new stream. The rows of a whole
    stream do not depend on how its documents were split among ``add`` calls.
    """

    def __init__(self, seq_len: int, cls_id: int, sep_id: int, pad_id: int) -> None:
        if seq_len < 3:
            raise ValueError(f"Packer: seq_len={seq_len} leaves no room for tokens between [CLS] and [SEP]; use seq_len >= 3")
        self.seq_len, self.cls_id, self.sep_id, self.pad_id = int(seq_len), int(cls_id), int(sep_id), int(pad_id)
        self._body = self.seq_len - 2  # tokens per row between [CLS] and [SEP]
        self._rest = np.zeros(0, dtype=np.int64)  # tokens of the unfinished block
        self._seen_doc = False  # a document came before, so the next one needs a separator

    def add(self, docs: list[np.ndarray]) -> dict[str, np.ndarray]:
        """Append documents (1-D integer arrays of token ids, no special tokens); return full rows."""
        arrays = [np.asarray(d).reshape(-1) for d in docs]
        arrays = [a for a in arrays if a.size]
        if not arrays:
            return _empty(self.seq_len)
        for a in arrays:
            if not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"Packer.add: documents must hold integer token ids, got dtype {a.dtype}")
        lengths = np.array([a.size for a in arrays])  # (D,)
        tokens = np.concatenate(arrays).astype(np.int64, copy=False)  # (sum lengths,)
        # A separator before every document but the stream's first: between documents of this
        # call, and between the previous call's last document and this call's first.
        boundaries = np.cumsum(lengths)[:-1]  # (D-1,) where documents 2..D begin
        if self._seen_doc:
            boundaries = np.concatenate([[0], boundaries])
        stream = np.concatenate([self._rest, np.insert(tokens, boundaries, self.sep_id)])  # (S,)
        self._seen_doc = True
        n_rows = stream.size // self._body
        blocks = stream[: n_rows * self._body].reshape(n_rows, self._body)  # (N, seq_len - 2)
        self._rest = stream[n_rows * self._body :].copy()
        return _rows(blocks, self.cls_id, self.sep_id)

    def flush(self) -> dict[str, np.ndarray]:
        """Return the unfinished block as one padded row (or no rows) and start a new stream."""
        rest, self._rest, self._seen_doc = self._rest, np.zeros(0, dtype=np.int64), False
        if rest.size == 0:
            return _empty(self.seq_len)
        ids = np.full((1, self.seq_len), self.pad_id, dtype=np.int64)  # (1, seq_len)
        ids[0, 0] = self.cls_id
        ids[0, 1 : rest.size + 1] = rest
        ids[0, rest.size + 1] = self.sep_id
        mask = np.zeros_like(ids)
        mask[0, : rest.size + 2] = 1
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def concat_rows(parts: list[dict[str, np.ndarray]], seq_len: int) -> dict[str, np.ndarray]:
    """Stack the outputs of several ``add``/``flush`` calls into one set of columns."""
    if not parts:
        return _empty(seq_len)
    return {name: np.concatenate([p[name] for p in parts]) for name in COLUMNS}


def pack_documents(docs: list[np.ndarray], seq_len: int, cls_id: int, sep_id: int, pad_id: int) -> dict[str, np.ndarray]:
    """Pack a whole list of documents: ``Packer.add`` then ``Packer.flush``."""
    packer = Packer(seq_len, cls_id, sep_id, pad_id)
    return concat_rows([packer.add(docs), packer.flush()], seq_len)
