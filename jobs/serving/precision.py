"""Vectors at sentence-transformers' ``precision`` (``quantize_embeddings``): what ``LocalModel.encode``
and ``ctx embed --precision`` store. NumPy only, so the driver of ``ctx embed`` can hold the ranges
without torch.

``int8`` / ``uint8`` cut each dimension's range into 256 levels: the range comes from calibration
vectors (``ranges``: row 0 the minima, row 1 the maxima, as sentence-transformers stacks them), and a
value outside it is clipped to the first or last level. ``binary`` / ``ubinary`` keep the sign bits, 8
a byte (int8 offset by -128, or uint8): a quarter and a thirty-second of float32's bytes.
"""

from __future__ import annotations

import numpy as np

PRECISIONS: tuple[str, ...] = ("float32", "int8", "uint8", "binary", "ubinary")
# ctx embed's int8 / uint8 cut each dimension's range into 256 levels; the range comes from the vectors of this
# many input rows (a seeded sample), embedded before the run and kept in its _embed.json ("ranges"), so every
# file, a resumed run's too, and the user's query vectors (sentence-transformers' quantize_embeddings(q, "int8",
# ranges=...)) use the same levels.
CALIBRATION_ROWS = 4096


def ranges_of(vectors: np.ndarray) -> np.ndarray:
    """(2, D) float32: each dimension's minimum and maximum over ``vectors`` (N, D)."""
    return np.vstack((vectors.min(axis=0), vectors.max(axis=0))).astype(np.float32)


def quantize(vectors: np.ndarray, precision: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """float32 (N, D) ``vectors`` at ``precision`` (``PRECISIONS``). ``ranges``: int8/uint8's per-dimension
    (minimum, maximum), as ``ranges_of`` gives them for calibration vectors; None takes them from
    ``vectors`` themselves, so it needs two vectors or more."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: give one of {', '.join(PRECISIONS)}")
    if precision == "float32":
        return vectors
    if precision.endswith("binary"):
        bits = np.packbits(vectors > 0, axis=-1)  # (N, ceil(D / 8)) uint8
        return bits if precision == "ubinary" else (bits.astype(np.int16) - 128).astype(np.int8)
    if ranges is None:
        if vectors.shape[0] < 2:
            raise ValueError(f"precision {precision!r}: its ranges come from the vectors encoded together, and one "
                             "vector has none; encode two texts or more at once")
        ranges = ranges_of(vectors)
    start = ranges[0]
    step = (ranges[1] - start) / 255
    step = np.where(step == 0, 1, step)
    levels = np.clip(np.floor((vectors - start) / step), 0, 255)  # 0..255 per dimension
    return levels.astype(np.uint8) if precision == "uint8" else (levels - 128).astype(np.int8)

