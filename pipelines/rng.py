"""Counter-based randomness keyed by (seed, epoch, sample_id, position, stream).

Data transforms must give the same result for a sample whatever batch, worker or rerun it lands
in, and a different one each epoch (fairseq keys its masks by ``(seed, epoch, index)`` for the same
reason). A stateful generator per batch cannot do that; a hash of the key can. We hash with the
SplitMix64 finaliser (Steele, Lea & Flood 2014), which passes BigCrush when fed a counter, and do
it on whole ``uint64`` arrays so a batch costs a handful of vectorised NumPy ops.
"""

from __future__ import annotations

import hashlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_TO_UNIT = 1.0 / float(1 << 53)


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, elementwise on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
        return z ^ (z >> _S31)


def _key(seed: int, epoch: np.ndarray | int, sample_ids: np.ndarray, stream: int) -> np.ndarray:
    """One uint64 key per row from (seed, epoch, sample_id, stream)."""
    sid = np.asarray(sample_ids).astype(np.uint64, copy=False)
    ep = np.broadcast_to(np.asarray(epoch).astype(np.uint64), sid.shape)
    k = mix64(np.full(sid.shape, np.uint64(seed & 0xFFFFFFFFFFFFFFFF)) ^ np.uint64(stream * 0x100000001B3 & 0xFFFFFFFFFFFFFFFF))
    k = mix64(k ^ ep)
    return mix64(k ^ sid)


def keyed_bits(seed: int, epoch: np.ndarray | int, sample_ids: np.ndarray, length: int, stream: int) -> np.ndarray:
    """uint64 random bits of shape (B, length); row b depends only on (seed, epoch[b], sample_ids[b])."""
    k = _key(seed, epoch, sample_ids, stream)  # (B,)
    pos = np.arange(length, dtype=np.uint64)  # (T,)
    with np.errstate(over="ignore"):
        return mix64(k[:, None] + pos[None, :] * _GOLDEN)  # (B, T)


def keyed_uniform(seed: int, epoch: np.ndarray | int, sample_ids: np.ndarray, length: int, stream: int) -> np.ndarray:
    """float64 uniforms in [0, 1) of shape (B, length), keyed as :func:`keyed_bits`."""
    bits = keyed_bits(seed, epoch, sample_ids, length, stream)
    return (bits >> np.uint64(11)).astype(np.float64) * _TO_UNIT


def row_generator(seed: int, epoch: int, sample_id: int, stream: int) -> np.random.Generator:
    """A NumPy generator for one row, for draws that are awkward to express as uniforms."""
    key = int(_key(seed, np.int64(epoch), np.array([sample_id], dtype=np.int64), stream)[0])
    return np.random.Generator(np.random.Philox(key=key))


def stable_hash64(text: str) -> int:
    """A 63-bit hash of a string that is the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF
