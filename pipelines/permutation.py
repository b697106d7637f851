"""Permutation language modeling targets (XLNet), vectorised over a whole batch.

XLNet (Yang et al. 2019, "XLNet: Generalized Autoregressive Pretraining for Language
Understanding", sec. 2.2-2.3) maximises the likelihood of a sequence under a random factorization
order z. With partial prediction only the last tokens of z are targets: split z at c so that
|z>c| / |z| = 1/K (K = 6 or 7 in the paper) and predict x_z>c given x_z<=c. Read while writing:
zihangdai/xlnet ``data_utils.py`` (``_local_perm``) and transformers'
``DataCollatorForPermutationLanguageModeling`` (the ``perm_mask`` / ``target_mapping`` convention
consumed by ``XLNetLMHeadModel``).

The scheme, per row (m = number of real, non-special tokens):

* order: a keyed random permutation z of the m eligible tokens (sorting keyed 64-bit hashes).
  Special tokens ([CLS], [SEP], ...) are context, never targets, like the "functional" tokens of
  xlnet's ``_local_perm``; padding is outside the order.
* targets: the last ``ceil(m / K)`` tokens of z (at most ``max_predict``); everything else
  (non-target eligible tokens and specials) is the context z<=c.
* ``perm_mask[b, i, j]`` True means i may NOT attend to j (bool, 1 byte a pair: at 512 tokens it
  is most of the batch, and float32 would quadruple it; models cast it as they need). A target i sees every context token
  and the targets strictly before it in z, never itself (the query stream must not see its own
  content; XLNet's content stream adds the diagonal back itself) nor later targets. A context
  token i sees every context token (in both directions, as xlnet gives all non-targets the same
  rank -1) and no target. A padding row is treated like a context row; padding is hidden from
  every row.
  Row i is ``key_step >= query_step[i]`` with key_step = -1 for context, T for padding, the step
  in z for targets, and query_step = the step in z for targets, 0 for every other row. All
  non-target rows are therefore one row (hide the targets and the padding), copied T times; only
  the P top-key rows are compared, so writing the (B, T, T) array is the whole cost.
* Because context tokens see each other and no target, only the order of the targets matters:
  ``argpartition`` + a sort of the top P keys replaces a full ``argsort``.
* ``target_mapping[b, p, t] = 1`` when the p-th target of row b (in position order, as xlnet's
  ``target_mapping``) sits at t; ``labels[b, p]`` is its token id, -100 for unused slots.

Not done here (on purpose): xlnet's span-based target selection and ``perm_size`` local
permutations with memory reuse (the collator's even-length two-halves trick); the paper's
partial prediction with a uniformly random order is what this implements.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipelines.rng import keyed_bits

IGNORE_INDEX = -100  # label of unused target slots (Hugging Face convention)

STREAM_ORDER = 0x504C4D01  # factorization order


@dataclass(frozen=True)
class PlmConfig:
    partial_k: int = 6  # predict the last 1/K of the factorization order (paper: K = 6 or 7)
    max_predict: int | None = None  # cap on targets per row; also fixes P. None: P = ceil(T / K)

    def __post_init__(self) -> None:
        if isinstance(self.partial_k, bool) or not isinstance(self.partial_k, int) or self.partial_k < 1:
            raise ValueError(f"PlmConfig.partial_k must be an int >= 1, got {self.partial_k!r}")
        mp = self.max_predict
        if mp is not None and (isinstance(mp, bool) or not isinstance(mp, int) or mp < 1):
            raise ValueError(f"PlmConfig.max_predict must be None or an int >= 1, got {mp!r}")


def _special_table(vocab) -> np.ndarray:
    """bool (V,): ids that are never targets (special_ids plus pad, cls, sep, mask)."""
    is_special = np.zeros(int(vocab.vocab_size), dtype=bool)
    is_special[np.asarray(vocab.special_ids, dtype=np.int64).reshape(-1)] = True
    is_special[[int(vocab.pad_id), int(vocab.cls_id), int(vocab.sep_id), int(vocab.mask_id)]] = True
    return is_special


def plm_targets(batch: dict[str, np.ndarray], seed: int, cfg: PlmConfig, vocab) -> dict[str, np.ndarray]:
    """XLNet permutation-LM targets; a new dict with every input column plus three, inputs untouched.

    Reads ``input_ids`` (B, T), ``sample_id`` (B,), ``epoch`` (B,) and, if present,
    ``attention_mask`` (B, T) (else padding is ``input_ids == vocab.pad_id``). Adds:

    * ``perm_mask`` bool (B, T, T): True where token i may not attend to token j (module docstring);
    * ``target_mapping`` float32 (B, P, T): one-hot position of each target slot, zero rows unused;
    * ``labels`` int64 (B, P): the target ids, -100 in unused slots.

    ``P = cfg.max_predict`` or, when None, ``ceil(T / K)``. ``input_ids`` is passed through.
    """
    ids = np.asarray(batch["input_ids"])
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"plm_targets: input_ids must be a 2-D integer array (B, T), got {ids.dtype} {ids.shape}")
    if "sample_id" not in batch or "epoch" not in batch:
        raise ValueError(f"plm_targets: the batch needs sample_id and epoch columns to key the orders; it has {sorted(batch)}")
    n_rows, length = ids.shape
    sample_id = np.asarray(batch["sample_id"]).reshape(-1)
    epoch = np.broadcast_to(np.asarray(batch["epoch"]).reshape(-1), (n_rows,))
    if sample_id.shape != (n_rows,):
        raise ValueError(f"plm_targets: sample_id must have shape ({n_rows},), got {sample_id.shape}")
    is_special = _special_table(vocab)
    if ids.size and (ids.min() < 0 or ids.max() >= is_special.size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"plm_targets: input_ids holds {bad}, outside the vocabulary [0, {is_special.size})")
    mask = batch.get("attention_mask")
    real = (ids != int(vocab.pad_id)) if mask is None else (np.asarray(mask) != 0)  # (B, T)
    if real.shape != ids.shape:
        raise ValueError(f"plm_targets: attention_mask has shape {real.shape}, input_ids {ids.shape}")
    eligible = real & ~is_special[ids]  # (B, T)

    k = cfg.partial_k
    n_pred = cfg.max_predict if cfg.max_predict is not None else -(-length // k)  # P
    n_top = min(n_pred, length)  # slots that can hold a target
    n_targets = np.minimum(-(-eligible.sum(axis=1) // k), n_top)  # (B,) ceil(m / K), capped

    # z orders the eligible tokens by keyed random bits (| 1 keeps them above the 0 of every other
    # token). Only the last n_targets steps matter (the rest is context that sees itself fully),
    # so a partition plus a sort of the top P' keys replaces a full argsort.
    bits = keyed_bits(seed, epoch, sample_id, length, STREAM_ORDER)  # (B, T) uint64
    key = np.where(eligible, bits | np.uint64(1), np.uint64(0))  # (B, T)
    top = np.argpartition(key, length - n_top, axis=1)[:, length - n_top :]  # (B, P'): the P' largest keys
    top = np.take_along_axis(top, np.argsort(np.take_along_axis(key, top, axis=1), axis=1), axis=1)  # ascending
    steps = np.arange(n_top)  # (P',) order among the top keys; the targets are the last n_targets
    is_target_slot = steps[None, :] >= (n_top - n_targets)[:, None]  # (B, P')
    rows, slots = np.nonzero(is_target_slot)  # (N,), (N,): every target once
    target_at = top[rows, slots]  # (N,) positions of the targets

    # Key side: -1 for non-target real tokens (visible to all), T for padding (visible to none),
    # the target's step otherwise; row i hides key j when key_step[j] >= i's query step, a target's
    # own step or 0 for every other row. Every row outside the top keys has query step 0, so it is
    # one row per batch row, copied; the top-key rows take their slot as query step, which is
    # their step for targets and, for the non-targets among them (slot < every target's step),
    # gives the same row as 0. Writing the (B, T, T) bytes is the cost, so nothing else that big.
    step_dtype = np.int16 if length < 2**15 - 1 else np.int32  # narrow ints: cheaper compares
    key_step = np.where(real, -1, length).astype(step_dtype)  # (B, T)
    key_step[rows, target_at] = slots
    perm_mask = np.empty((n_rows, length, length), dtype=bool)  # (B, T, T)
    perm_mask[...] = (key_step >= 0)[:, None, :]  # every row as a context row: hide targets, padding
    top_rows = key_step[:, None, :] >= steps.astype(step_dtype)[None, :, None]  # (B, P', T)
    perm_mask[np.arange(n_rows)[:, None], top] = top_rows  # the P' top-key rows, targets among them

    # Slots of target_mapping / labels in position order (xlnet's target_mapping order).
    used = np.arange(n_pred)[None, :] < n_targets[:, None]  # (B, P)
    target_pos = np.full((n_rows, n_pred), length, dtype=np.int64)  # (B, P); T marks unused slots
    target_pos[:, :n_top] = np.sort(np.where(is_target_slot, top, length), axis=1)
    target_mapping = np.zeros((n_rows, n_pred, length), dtype=np.float32)  # (B, P, T)
    rows_u, slots_u = np.nonzero(used)
    target_mapping[rows_u, slots_u, target_pos[rows_u, slots_u]] = 1.0
    labels = np.full((n_rows, n_pred), IGNORE_INDEX, dtype=np.int64)  # (B, P)
    labels[rows_u, slots_u] = ids[rows_u, target_pos[rows_u, slots_u]]

    out = dict(batch)
    out["perm_mask"] = perm_mask
    out["target_mapping"] = target_mapping
    out["labels"] = labels
    return out
