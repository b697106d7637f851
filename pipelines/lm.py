"""Language-model targets: causal LM (GPT, Transformer-XL) and the two directions of ELMo's biLM.

GPT (Radford et al. 2018) and Transformer-XL (Dai et al. 2019) predict token t+1 from tokens
<= t. Following the Hugging Face convention used by ``ctxmodels.gpt`` and
``ctxmodels.transformer_xl``, ``labels`` are *not* shifted here: the model shifts them (logits at
t against ``labels[:, t + 1]``). ELMo's biLM (Peters et al. 2018; bilm-tf ``next_token_id`` /
``next_token_id_reverse``) predicts t+1 with the forward LSTM and t-1 with the backward one;
``ctxmodels.elmo`` derives both from ``input_ids`` itself, so :func:`bilm_targets` only spells
the same targets out as bookkeeping columns, for evaluation and tests.

No randomness here.
"""

from __future__ import annotations

import numpy as np

IGNORE_INDEX = -100  # label of positions without a target (Hugging Face convention)


def _ids_and_mask(batch: dict[str, np.ndarray], caller: str) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(batch["input_ids"])
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{caller}: input_ids must be a 2-D integer array (B, T), got {ids.dtype} {ids.shape}")
    mask = batch.get("attention_mask")
    real = np.ones(ids.shape, dtype=bool) if mask is None else np.asarray(mask) != 0  # (B, T)
    if real.shape != ids.shape:
        raise ValueError(f"{caller}: attention_mask has shape {real.shape}, input_ids {ids.shape}")
    return ids.astype(np.int64, copy=False), real


def causal_lm_targets(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A new dict with every input column plus ``labels`` int64 (B, T): ``input_ids`` where
    ``attention_mask == 1`` (all positions without a mask), -100 at padding. Unshifted."""
    ids, real = _ids_and_mask(batch, "causal_lm_targets")
    out = dict(batch)
    out["labels"] = np.where(real, ids, IGNORE_INDEX)
    return out


def bilm_targets(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A new dict with every input column plus ELMo's two targets, already shifted, int64 (B, T):

    * ``_fwd_labels[b, t]`` = ``input_ids[b, t + 1]`` (what the forward LM at t predicts);
    * ``_bwd_labels[b, t]`` = ``input_ids[b, t - 1]`` (what the backward LM at t predicts);

    -100 where t or its neighbour is padding or outside the row. The leading underscore makes them
    bookkeeping columns, so ``ElmoForPreTraining(**batch)`` still works. Rows must be right-padded
    (real tokens first), as the ELMo model requires; otherwise a ValueError names the first bad row.
    """
    ids, real = _ids_and_mask(batch, "bilm_targets")
    if real.shape[1] > 1:
        gaps = real[:, 1:] & ~real[:, :-1]  # (B, T-1): a real token right after padding
        if gaps.any():
            row = int(np.flatnonzero(gaps.any(axis=1))[0])
            raise ValueError(f"bilm_targets: row {row} is not right-padded (attention_mask has a 1 after a 0); ELMo reverses rows within their real length")
    fwd = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)  # (B, T)
    bwd = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)  # (B, T)
    both = real[:, :-1] & real[:, 1:]  # (B, T-1): t and t+1 both real
    fwd[:, :-1] = np.where(both, ids[:, 1:], IGNORE_INDEX)
    bwd[:, 1:] = np.where(both, ids[:, :-1], IGNORE_INDEX)
    out = dict(batch)
    out["_fwd_labels"] = fwd
    out["_bwd_labels"] = bwd
    return out
