"""The data position of a run: which samples of which epochs the model has been trained on.

Ray Data iterators keep no state, so the position lives in the checkpoint instead. Every sample
has a stable name, ``(epoch, shard_key, sample_id)`` (``pipelines.dataset``), and the same name
always carries the same tokens and the same mask (both are functions of ``(seed, epoch,
sample_id)``). Training records the names of the samples whose optimizer step is done; rank 0
commits their union with each checkpoint. When the stream is (re)started -- a rerun, a worker
failure, a different number of workers -- the stage that reads shards drops every committed sample
and skips shards whose every sample is committed. What a worker had prefetched, or trained on
after the last checkpoint, was never committed and comes again; what was committed never does.

The set is kept per ``(epoch, shard)`` as sorted unique ids, with the shard's row count once its
last row has been consumed (``total``); a shard is complete when all of its rows are committed.
An epoch is closed, and forgotten, when every shard of the corpus is complete for it.

Stored as plain arrays (``to_arrays``; safetensors in the checkpoint, no pickle)::

    epoch, shard, total   (K,)     one entry per (epoch, shard) touched; total -1 = not yet known
    offsets               (K+1,)   ids of entry k are ids[offsets[k]:offsets[k+1]], sorted
    ids                   (N,)     int64 sample ids
    first_epoch           (1,)     the oldest epoch not closed
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

if TYPE_CHECKING:
    from pipelines.storage import Store

Key = tuple[int, int]  # (epoch, shard_key)


@dataclass
class DataPosition:
    first_epoch: int = 0
    consumed: dict[Key, np.ndarray] = field(default_factory=dict)  # sorted unique int64 ids
    totals: dict[Key, int] = field(default_factory=dict)

    # -- recording ----------------------------------------------------------------------------

    def add(self, epoch, shard, sample_id, shard_total=None) -> None:
        """Record consumed samples: (n,) arrays of epoch, shard key, sample id, and the shard's
        row count where known (-1 elsewhere)."""
        epoch = np.asarray(epoch, dtype=np.int64).reshape(-1)
        shard = np.asarray(shard, dtype=np.int64).reshape(-1)
        ids = np.asarray(sample_id, dtype=np.int64).reshape(-1)
        if not (epoch.size == shard.size == ids.size):
            raise ValueError(f"DataPosition.add: {epoch.size} epochs, {shard.size} shards, {ids.size} ids")
        pairs = np.stack([epoch, shard], axis=1)  # (n, 2)
        uniq, inverse = np.unique(pairs, axis=0, return_inverse=True)
        for j, (e, s) in enumerate(uniq):
            key = (int(e), int(s))
            new = ids[inverse.reshape(-1) == j]
            old = self.consumed.get(key)
            self.consumed[key] = np.unique(new if old is None else np.concatenate([old, new]))
        if shard_total is not None:
            total = np.asarray(shard_total, dtype=np.int64).reshape(-1)
            known = total >= 0
            for e, s, t in zip(epoch[known], shard[known], total[known]):
                self.totals[(int(e), int(s))] = int(t)

    def merge(self, other: "DataPosition") -> None:
        for key, ids in other.consumed.items():
            old = self.consumed.get(key)
            self.consumed[key] = ids.copy() if old is None else np.union1d(old, ids)
        self.totals.update(other.totals)
        self.first_epoch = max(self.first_epoch, other.first_epoch)

    # -- queries ------------------------------------------------------------------------------

    def is_consumed(self, epoch: int, shard: int, sample_ids: np.ndarray) -> np.ndarray:
        """bool (n,): which of one shard's samples are committed."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        if epoch < self.first_epoch:
            return np.ones(ids.shape, dtype=bool)
        done = self.consumed.get((int(epoch), int(shard)))
        if done is None or done.size == 0:
            return np.zeros(ids.shape, dtype=bool)
        pos = np.searchsorted(done, ids).clip(max=done.size - 1)
        return done[pos] == ids

    def shard_complete(self, epoch: int, shard: int) -> bool:
        if epoch < self.first_epoch:
            return True
        key = (int(epoch), int(shard))
        total = self.totals.get(key)
        return total is not None and key in self.consumed and self.consumed[key].size >= total

    def committed(self, epoch: int) -> int:
        return sum(int(v.size) for (e, _), v in self.consumed.items() if e == epoch)

    def close_epochs(self, shard_keys: Iterable[int], sampleless: Callable[[int], set[int]] | None = None) -> list[int]:
        """Forget epochs whose every shard is complete, oldest first; returns the closed epochs.

        ``sampleless(epoch)``: keys of shards that were read whole in that epoch and made no
        samples (empty, or all records rejected): complete although none of their rows arrive.
        """
        keys = [int(k) for k in shard_keys]
        closed = []
        while keys:
            e = self.first_epoch
            open_keys = [k for k in keys if not self.shard_complete(e, k)]
            # A shard with samples committed is not sampleless: ask (a listing) only when none is.
            if open_keys and sampleless is not None and not any((e, k) in self.consumed for k in open_keys):
                none = sampleless(e)
                open_keys = [k for k in open_keys if k not in none]
            if open_keys:
                break
            closed.append(e)
            for d in (self.consumed, self.totals):
                for key in [key for key in d if key[0] == e]:
                    del d[key]
            self.first_epoch += 1
        return closed

    def summary(self) -> dict[str, int]:
        return {
            "first_epoch": self.first_epoch,
            "open_shards": len(self.consumed),
            "committed_samples": int(sum(v.size for v in self.consumed.values())),
        }

    # -- storage ------------------------------------------------------------------------------

    def to_arrays(self) -> dict[str, np.ndarray]:
        keys = sorted(set(self.consumed) | set(self.totals))
        chunks = [self.consumed.get(k, np.zeros(0, dtype=np.int64)) for k in keys]
        sizes = np.array([c.size for c in chunks], dtype=np.int64)
        return {
            "epoch": np.array([k[0] for k in keys], dtype=np.int64),
            "shard": np.array([k[1] for k in keys], dtype=np.int64),
            "total": np.array([self.totals.get(k, -1) for k in keys], dtype=np.int64),
            "offsets": np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
            "ids": np.concatenate(chunks).astype(np.int64) if chunks else np.zeros(0, dtype=np.int64),
            "first_epoch": np.array([self.first_epoch], dtype=np.int64),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "DataPosition":
        missing = {"epoch", "shard", "total", "offsets", "ids", "first_epoch"} - set(arrays)
        if missing:
            raise ValueError(f"data position: missing arrays {sorted(missing)}")
        pos = cls(first_epoch=int(arrays["first_epoch"][0]))
        off = arrays["offsets"]
        for k, (e, s, t) in enumerate(zip(arrays["epoch"], arrays["shard"], arrays["total"])):
            key = (int(e), int(s))
            ids = np.asarray(arrays["ids"][off[k] : off[k + 1]], dtype=np.int64)
            if ids.size:
                pos.consumed[key] = ids
            if t >= 0:
                pos.totals[key] = int(t)
        return pos


POSITION_FILE = "data_position.safetensors"


def load_position(ckpt_uri: str | None, store: Store) -> DataPosition:
    """The position committed with a checkpoint (an empty one for None or an older checkpoint),
    read through the run's ``store``."""
    if ckpt_uri is None:
        return DataPosition()
    from safetensors.numpy import load

    from pipelines import storage

    data = store.read_bytes(storage.join(ckpt_uri.rstrip("/"), POSITION_FILE), missing_ok=True)
    return DataPosition() if data is None else DataPosition.from_arrays(load(data))
