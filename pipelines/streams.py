"""Stream-ordered batches for models that carry state across batches (Transformer-XL, XLNet with
memory, ELMo's truncated BPTT, GPT optionally).

Transformer-XL (Dai et al. 2019; kimiyoung/transformer-xl ``pytorch/data_utils.py``,
``LMOrderedIterator``) cuts the token stream into ``batch_rows`` contiguous parts, one per row,
and walks them ``seq_len`` tokens at a time, so row r of batch b+1 continues row r of batch b and
the model's memory of row r is the text right before it. bilm-tf trains ELMo the same way.

:class:`StreamBatcher` does this for a shard that arrives piece by piece (``add``, then
``flush`` at the end of the shard), like a packer. A *block* is the stretch of stream that is
split into the rows:

* ``block_batches=None`` (default, exactly Transformer-XL): the whole shard is one block, cut at
  ``flush``; rows get ``ceil(N / batch_rows)`` tokens each (the last rows fewer).
* ``block_batches=n``: every ``batch_rows * n * seq_len`` tokens form a block, emitted by ``add``
  as soon as they are there (bounded memory); ``flush`` cuts the remainder as above.

Every token is emitted exactly once; the Transformer-XL iterator drops the tail that does not
divide evenly, here it becomes right padding of the block's last batch(es) (attention_mask 0).
Each block starts fresh streams: ``reset_memory`` is 1 for every row of a block's first batch.

Columns of each batch (B = batch_rows, T = seq_len), all int64:

* ``input_ids`` (B, T): stream tokens, ``pad_id`` after a row's end;
* ``attention_mask`` (B, T): 1 for stream tokens, 0 for padding (always right padding);
* ``reset_memory`` (B,): 1 where the row starts a new stream (first batch of a block), else 0;
* ``doc_start`` (B, T): 1 where a document begins: the token after ``doc_sep_id`` in the stream
  (also across a row or batch boundary) and the first token after construction or ``flush``;
* ``sample_id`` (B,): a hash of (``base_sample_id``, stream id, batch index in the stream), the
  stream id being ``block_index * B + r``: stable for a given shard, worker-independent;
* ``epoch`` (B,).

No labels here: the causal LM models shift ``input_ids`` themselves (``pipelines.lm``).
"""

from __future__ import annotations

import numpy as np

from pipelines.rng import mix64

_ID_MASK = np.uint64(0x7FFFFFFFFFFFFFFF)  # sample ids are non-negative int64


class StreamBatcher:
    """Cut a token stream into ``batch_rows`` parallel contiguous streams of ``seq_len`` windows."""

    def __init__(
        self,
        batch_rows: int,
        seq_len: int,
        *,
        pad_id: int,
        doc_sep_id: int | None = None,
        block_batches: int | None = None,
        base_sample_id: int = 0,
        epoch: int = 0,
    ):
        for name, value in (("batch_rows", batch_rows), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"StreamBatcher: {name} must be an int >= 1, got {value!r}")
        if block_batches is not None and (isinstance(block_batches, bool) or not isinstance(block_batches, (int, np.integer)) or block_batches < 1):
            raise ValueError(f"StreamBatcher: block_batches must be None or an int >= 1, got {block_batches!r}")
        self.batch_rows = int(batch_rows)
        self.seq_len = int(seq_len)
        self.pad_id = int(pad_id)
        self.doc_sep_id = None if doc_sep_id is None else int(doc_sep_id)
        self.block_batches = None if block_batches is None else int(block_batches)
        self.base_sample_id = int(base_sample_id)
        self.epoch = int(epoch)
        self._pieces: list[np.ndarray] = []
        self._buffered = 0
        self._blocks = 0  # blocks emitted so far: gives the stream ids
        self._prev_token: int | None = None  # last token emitted; None = a document starts next

    def add(self, tokens: np.ndarray) -> list[dict[str, np.ndarray]]:
        """Append stream tokens (1-D ids); returns the batches of every block completed by them."""
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"StreamBatcher.add: tokens must be a 1-D integer array, got {arr.dtype} {arr.shape}")
        if arr.size:
            self._pieces.append(arr.astype(np.int64, copy=False))
            self._buffered += arr.size
        if self.block_batches is None:
            return []
        block_size = self.batch_rows * self.block_batches * self.seq_len
        if self._buffered < block_size:
            return []
        stream = np.concatenate(self._pieces)
        n_blocks = stream.size // block_size
        batches = []
        for i in range(n_blocks):  # one iteration per block of B * n * T tokens
            batches.extend(self._emit(stream[i * block_size : (i + 1) * block_size]))
        rest = stream[n_blocks * block_size :]
        self._pieces = [rest] if rest.size else []
        self._buffered = rest.size
        return batches

    def flush(self) -> list[dict[str, np.ndarray]]:
        """Emit what is buffered as a last block; the next ``add`` starts a new stream (new shard)."""
        batches = self._emit(np.concatenate(self._pieces)) if self._buffered else []
        self._pieces, self._buffered = [], 0
        self._prev_token = None
        return batches

    def _emit(self, block: np.ndarray) -> list[dict[str, np.ndarray]]:
        n_rows, seq_len = self.batch_rows, self.seq_len
        row_len = -(-block.size // n_rows)  # tokens per row, the last rows may get fewer
        n_batches = -(-row_len // seq_len)
        width = n_batches * seq_len

        # doc_start from the stream itself, before cutting it into rows.
        starts = np.zeros(block.size, dtype=np.int64)  # (N,)
        if self.doc_sep_id is not None:
            starts[1:] = block[:-1] == self.doc_sep_id
        starts[0] = self._prev_token is None or self._prev_token == self.doc_sep_id
        self._prev_token = int(block[-1])

        def to_rows(flat: np.ndarray, fill: int) -> np.ndarray:
            out = np.full(n_rows * row_len, fill, dtype=np.int64)
            out[: flat.size] = flat
            out = out.reshape(n_rows, row_len)  # (B, L): row r = stream[r * L : (r + 1) * L]
            return np.pad(out, ((0, 0), (0, width - row_len)), constant_values=fill)  # (B, n * T)

        ids = to_rows(block, self.pad_id)
        mask = to_rows(np.ones(block.size, dtype=np.int64), 0)
        doc_start = to_rows(starts, 0)

        stream_id = (np.uint64(self._blocks) * np.uint64(n_rows) + np.arange(n_rows, dtype=np.uint64))  # (B,)
        stream_key = mix64(mix64(np.full(n_rows, self.base_sample_id & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)) ^ stream_id)  # (B,)
        self._blocks += 1

        batches = []
        for b in range(n_batches):  # one iteration per emitted batch
            cols = slice(b * seq_len, (b + 1) * seq_len)
            sample_id = (mix64(stream_key ^ np.uint64(b)) & _ID_MASK).astype(np.int64)  # (B,)
            batches.append({
                "input_ids": ids[:, cols].copy(),
                "attention_mask": mask[:, cols].copy(),
                "reset_memory": np.full(n_rows, int(b == 0), dtype=np.int64),
                "doc_start": doc_start[:, cols].copy(),
                "sample_id": sample_id,
                "epoch": np.full(n_rows, self.epoch, dtype=np.int64),
            })
        return batches
