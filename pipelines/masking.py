"""Masked-language-model corruption (BERT / RoBERTa), vectorised over a whole batch.

BERT (Devlin et al. 2019, sec. 3.1 and appendix A.1) selects 15% of the tokens as prediction
targets; of those, 80% become ``[MASK]``, 10% a random token and 10% stay as they are, so the
model cannot rely on seeing ``[MASK]`` at every target. Whole-word masking (the later
google-research/bert release, ``create_pretraining_data.py --do_whole_word_mask``) selects words
instead of word pieces: all pieces of a word are targets or none is. RoBERTa (Liu et al. 2019,
sec. 4.1) draws a fresh mask every time a sequence is seen ("dynamic masking"); here that is a
mask keyed by ``(seed, epoch, sample_id)``, so it changes every epoch yet is reproducible and does
not depend on which batch or worker a row lands in (fairseq keys its masks the same way).
Reference code: google-research/bert ``create_pretraining_data.py`` (80/10/10, whole words) and
``transformers.DataCollatorForLanguageModeling``, whose rates the tests compare with ours on the
same batch (statistics, not bits: the randomness differs on purpose) and which
``benchmarks/masking.py`` times against this function.

How each random decision is drawn. One call per batch,
``keyed_bits(seed, epoch, sample_id, 2 + ceil(T / 4), STREAM_MLM)``, gives per row:

* counters 2, 3, ...: selection. Each 64-bit hash holds four 16-bit draws; position ``t`` uses
  lane ``t % 4`` (little-endian) of counter ``2 + t // 4`` and is selected when the draw is below
  ``round(mlm_probability * 2**16)``. Sixteen bits resolve the probability to 1.5e-5 and cost a
  quarter of a hash per token; hashing is most of this function's time.
* counter 0 and counter 1: the keys of two further streams, hashed only at the selected positions
  as ``mix64(key + t * STRIDE) >> 32`` (a uniform 32-bit draw): the 80/10/10 split (key 0) and
  the random replacement id (key 1, scaled onto the non-special ids by Lemire's multiply-shift;
  bias below ``vocab_size / 2**32``). One ``keyed_bits`` call instead of three saves ~15% of the
  time on a 64 x 512 batch; distinct counters of one stream are as independent as distinct streams.

Every draw depends only on (seed, epoch, sample_id, position) and never on T, so a row padded to a
different length in another batch gets the same targets on its common positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipelines.rng import keyed_bits, mix64

IGNORE_INDEX = -100  # label of positions without a target (Hugging Face / PyTorch convention)

STREAM_MLM = 0x4D4C4D  # the keyed stream of every MLM draw ("MLM"); other transforms use others

_STRIDE = np.uint64(0x9E3779B97F4A7C15)  # odd counter stride (golden ratio), as in SplitMix64
_LANES = 4  # 16-bit selection draws per 64-bit hash
_SHIFT32 = np.uint64(32)


@dataclass(frozen=True, eq=False)  # eq=False: an ndarray field has no truth value for ==
class VocabInfo:
    """What masking needs to know about a vocabulary. Build it once per tokenizer."""

    vocab_size: int
    pad_id: int
    mask_id: int
    cls_id: int
    sep_id: int
    special_ids: tuple[int, ...]  # never selected and never used as a random replacement
    word_start: np.ndarray | None = None  # bool (V,): token begins a word (whole-word masking)
    # Derived in __post_init__:
    is_special: np.ndarray = field(init=False, repr=False)  # bool (V,)
    replacement_ids: np.ndarray = field(init=False, repr=False)  # int64 (R,): non-special ids
    starts_word: np.ndarray | None = field(init=False, repr=False)  # bool (V,): word_start | special

    def __post_init__(self) -> None:
        v = int(self.vocab_size)
        if v <= 0:
            raise ValueError(f"VocabInfo.vocab_size must be positive, got {self.vocab_size}")
        named = {"pad_id": self.pad_id, "mask_id": self.mask_id, "cls_id": self.cls_id, "sep_id": self.sep_id}
        for name, tid in named.items():
            if not 0 <= int(tid) < v:
                raise ValueError(f"VocabInfo.{name}={tid} is outside the vocabulary [0, {v})")
        special = np.asarray(self.special_ids, dtype=np.int64).reshape(-1)
        if special.size and (special.min() < 0 or special.max() >= v):
            raise ValueError(f"VocabInfo.special_ids has ids outside the vocabulary [0, {v}): {sorted(set(special.tolist()))}")
        is_special = np.zeros(v, dtype=bool)
        is_special[special] = True
        # The four named ids are special whatever the tokenizer listed: padding and [CLS]/[SEP]
        # are never targets, and predicting [MASK] itself would teach nothing.
        is_special[[int(t) for t in named.values()]] = True
        replacement_ids = np.flatnonzero(~is_special).astype(np.int64)
        if replacement_ids.size == 0:
            raise ValueError("VocabInfo: every id is special, so there is nothing to mask or to replace with")
        starts_word = None
        if self.word_start is not None:
            ws = np.asarray(self.word_start, dtype=bool).reshape(-1)
            if ws.shape != (v,):
                raise ValueError(f"VocabInfo.word_start must have vocab_size={v} entries, got {ws.shape[0]}")
            starts_word = ws | is_special
        for name, value in (("is_special", is_special), ("replacement_ids", replacement_ids), ("starts_word", starts_word)):
            if value is not None:
                value.flags.writeable = False
            object.__setattr__(self, name, value)

    @classmethod
    def from_tokenizer(cls, tok) -> VocabInfo:
        """From any object with ``vocab_size, pad_id, mask_id, cls_id, sep_id, special_ids`` and
        (optionally) ``word_start``, e.g. ``pipelines.tokenizers.Tokenizer``."""
        missing = [a for a in ("vocab_size", "pad_id", "mask_id", "cls_id", "sep_id", "special_ids") if not hasattr(tok, a)]
        if missing:
            raise TypeError(f"VocabInfo.from_tokenizer: {type(tok).__name__} lacks {missing}")
        return cls(
            vocab_size=int(tok.vocab_size),
            pad_id=int(tok.pad_id),
            mask_id=int(tok.mask_id),
            cls_id=int(tok.cls_id),
            sep_id=int(tok.sep_id),
            special_ids=tuple(int(t) for t in np.asarray(tok.special_ids).reshape(-1)),
            word_start=getattr(tok, "word_start", None),
        )


@dataclass(frozen=True)
class MlmConfig:
    mlm_probability: float = 0.15  # fraction of eligible tokens that become targets (BERT: 15%)
    mask_fraction: float = 0.8  # of the targets, replaced by [MASK]
    random_fraction: float = 0.1  # of the targets, replaced by a random non-special id; the rest stay
    whole_word: bool = False  # select whole words (all pieces or none) instead of pieces

    def __post_init__(self) -> None:
        for name in ("mlm_probability", "mask_fraction", "random_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"MlmConfig.{name} must be a number in [0, 1], got {value!r}")
        if self.mask_fraction + self.random_fraction > 1.0 + 1e-12:
            raise ValueError(
                f"MlmConfig.mask_fraction + MlmConfig.random_fraction must not exceed 1 "
                f"(got {self.mask_fraction} + {self.random_fraction}); the remainder is the kept fraction"
            )
        if not isinstance(self.whole_word, bool):
            raise ValueError(f"MlmConfig.whole_word must be a bool, got {self.whole_word!r}")


def _threshold32(p: float) -> np.uint64:
    """A 32-bit draw ``u`` satisfies ``u < threshold`` with probability ``p`` (up to 2**-32)."""
    return np.uint64(min(round(p * 2**32), 2**32))


def _mlm_bits(seed: int, epoch: np.ndarray, sample_ids: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: split key (B,), replacement key (B,) and 16-bit selection draws (B, length)."""
    words = keyed_bits(seed, epoch, sample_ids, 2 + -(-length // _LANES), STREAM_MLM)  # (B, 2 + ceil(T/4))
    # '<u8' -> '<u2' fixes the lane order on any host; a no-op on little-endian machines.
    lanes = words[:, 2:].astype("<u8", copy=False).view("<u2")  # (B, 4 * ceil(T/4))
    return words[:, 0], words[:, 1], lanes[:, :length]


def _draws_at(row_key: np.ndarray, flat_idx: np.ndarray, length: int) -> np.ndarray:
    """Top 32 bits of a keyed hash at flat positions ``row * length + t`` only: uint64 (N,)."""
    rows, cols = np.divmod(flat_idx, length)  # (N,), (N,)
    with np.errstate(over="ignore"):
        return mix64(row_key[rows] + cols.astype(np.uint64) * _STRIDE) >> _SHIFT32


def _whole_words(chosen: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Give every continuation piece the decision of its word's first piece, in place.

    ``chosen`` and ``starts`` are bool (B*T,) with ``starts`` True at every row start, so a word
    never crosses rows. Only continuation pieces are touched (a few percent of English WordPiece
    tokens): each run of consecutive continuations takes the decision of the position before it.
    """
    cont = np.flatnonzero(~starts)  # (C,) ascending
    if cont.size == 0:
        return chosen
    run_start = np.empty(cont.size, dtype=bool)  # (C,)
    run_start[0] = True
    np.not_equal(np.diff(cont), 1, out=run_start[1:])
    head = cont[run_start] - 1  # (R,): first piece of each run's word
    run_of = np.cumsum(run_start, dtype=np.int32)  # (C,) in [1, R]
    run_of -= 1
    chosen[cont] = chosen[head[run_of]]
    return chosen


def mask_tokens(batch: dict[str, np.ndarray], seed: int, cfg: MlmConfig, vocab: VocabInfo) -> dict[str, np.ndarray]:
    """Select MLM targets and corrupt them; a new dict with every input column plus ``labels``.

    Reads ``input_ids`` (B, T), ``sample_id`` (B,), ``epoch`` (B,) and, if present,
    ``attention_mask`` (B, T). Returns ``input_ids`` (a new int64 array, corrupted) and ``labels``
    (int64: the original id at the targets, -100 elsewhere); the other columns are passed through
    as they are (same objects). The inputs are not modified. Special tokens (``vocab.special_ids``,
    pad, cls, sep, mask) and positions with ``attention_mask == 0`` are never targets.
    """
    ids = np.asarray(batch["input_ids"])
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"mask_tokens: input_ids must be a 2-D integer array (B, T), got {ids.dtype} {ids.shape}")
    n_rows, length = ids.shape
    if "sample_id" not in batch or "epoch" not in batch:
        raise ValueError(f"mask_tokens: the batch needs sample_id and epoch columns to key the masks; it has {sorted(batch)}")
    sample_ids = np.asarray(batch["sample_id"]).reshape(-1)
    epoch = np.asarray(batch["epoch"]).reshape(-1)
    if sample_ids.shape != (n_rows,) or epoch.shape not in ((n_rows,), (1,)):
        raise ValueError(f"mask_tokens: sample_id and epoch must have shape ({n_rows},); got {sample_ids.shape} and {epoch.shape}")
    if cfg.whole_word and vocab.starts_word is None:
        raise ValueError("mask_tokens: MlmConfig.whole_word=True needs VocabInfo.word_start (from the tokenizer)")
    out = dict(batch)
    new_ids = ids.astype(np.int64, copy=True)  # (B, T)
    labels = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)  # (B, T)
    out["input_ids"], out["labels"] = new_ids, labels
    if ids.size == 0:
        return out
    lo, hi = int(new_ids.min()), int(new_ids.max())
    if lo < 0 or hi >= vocab.vocab_size:
        raise ValueError(f"mask_tokens: input_ids holds {lo if lo < 0 else hi}, outside the vocabulary [0, {vocab.vocab_size})")

    flat_ids = new_ids.reshape(-1)  # (B*T,) view: the writes below land in new_ids
    eligible = ~vocab.is_special[flat_ids]  # (B*T,)
    mask = batch.get("attention_mask")
    if mask is not None:
        eligible &= np.asarray(mask).reshape(-1) != 0

    split_key, replace_key, lanes = _mlm_bits(seed, epoch, sample_ids, length)
    chosen = (lanes < round(cfg.mlm_probability * 2**16)).reshape(-1)  # (B*T,) bool
    if cfg.whole_word:
        # A word starts at a word-start token or right after any ineligible position (a special
        # token, padding or the row start): a continuation piece there has no visible head.
        starts = vocab.starts_word[new_ids]  # (B, T)
        starts[:, 0] = True
        starts[:, 1:] |= ~eligible.reshape(n_rows, length)[:, :-1]
        chosen = _whole_words(chosen, starts.reshape(-1))
    chosen &= eligible
    targets = np.flatnonzero(chosen)  # (N,) flat positions of the targets
    originals = flat_ids[targets]  # (N,)
    labels.reshape(-1)[targets] = originals

    split = _draws_at(split_key, targets, length)  # (N,) uint64 in [0, 2**32)
    to_mask = split < _threshold32(cfg.mask_fraction)
    to_random = ~to_mask & (split < _threshold32(cfg.mask_fraction + cfg.random_fraction))
    flat_ids[targets[to_mask]] = vocab.mask_id
    if to_random.any():
        at = targets[to_random]  # (M,)
        u = _draws_at(replace_key, at, length)  # (M,) in [0, 2**32)
        pick = (u * np.uint64(vocab.replacement_ids.size)) >> _SHIFT32  # (M,) in [0, R)
        flat_ids[at] = vocab.replacement_ids[pick]
    return out
