"""Span masking (SpanBERT) and n-gram masking (ALBERT), vectorised over a whole batch.

SpanBERT (Joshi et al. 2019, "SpanBERT: Improving Pre-training by Representing and Predicting
Spans", sec. 3.1): span lengths in *words* are drawn from Geo(p=0.2) clipped at 10 (renormalised,
mean 3.8 words), each span covers complete words and starts at a word start, spans are added until
15% of the tokens are masked, and the 80/10/10 split ([MASK] / random / kept) is decided once per
span. The Span Boundary Objective predicts every token of a span from the two tokens just outside
it and the token's position inside the span. Checked against facebookresearch/SpanBERT
(``pretraining/fairseq/data/masking.py``, ``PairWithSpanMaskingScheme``).

ALBERT (Lan et al. 2020, sec. 4.1; google-research/albert ``create_pretraining_data.py``,
``create_masked_lm_predictions``): n-grams of 1..3 complete words with p(n) proportional to 1/n,
15% budget, 80/10/10 decided per token.

How spans are placed without a loop per token (or per span). In word space, per row:

1. draw ``S`` span lengths from the length distribution (inverse CDF of keyed uniforms);
2. tile the row's maskable word range ``[w_lo, w_hi)`` with the longest prefix of those spans that
   fits with at least one unmasked word between neighbours (cumulative sums), and spread the
   remaining free words over the gaps (sorted keyed uniforms = random cut points);
3. visit the tiled spans in a keyed random order and accept them while the tokens accepted so
   far are below a stop threshold: the budget minus the expected overshoot of the last span (the
   first span of a row is always kept). The decision never looks at the offered span's own
   length, so accepted lengths follow the drawn distribution, the masked fraction averages the
   budget, and a row exceeds its budget by at most (part of) its last span.

Every accepted span is a random span of the tiling. Neighbouring spans are separated by at least
one unmasked word, so a masked run is exactly one span and the SBO neighbours are never masked.

Choices of this project:

* eligible tokens are real (``attention_mask == 1``), non-special, and have a real neighbour on
  both sides (so ``sbo_left``/``sbo_right`` always point at real tokens; rows framed by
  ``[CLS] ... [SEP]`` lose nothing). A word is maskable when all its pieces are eligible; a tiled
  span that contains an unmaskable word (a ``[SEP]`` in the middle of a packed row) is dropped;
* a word starts at a token with ``vocab.word_start``, at a special token, after a special token,
  after padding and at position 0 (a row may begin mid-word after packing);
* a row whose maskable range is shorter than a drawn span clips that span to the range (only
  rows of a few words are affected), so every row with a budget gets at least one span;
* the budget is ``round(ratio * n)`` with ``n`` the real non-special tokens of the row, at least 1;
* random replacement ids are drawn uniformly from the non-special ids (one per token).

Randomness: keyed by ``(seed, epoch, sample_id)`` through :mod:`pipelines.rng`, one stream per
decision (the constants below). Slot ``k``'s draws do not depend on how many slots the batch
width implies, so a row gets the same spans whatever batch (and padding width) it lands in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipelines.rng import keyed_uniform

IGNORE_INDEX = -100  # label of positions without a target (Hugging Face convention)

STREAM_LENGTH = 0x5350414E01  # span / n-gram length per slot
STREAM_GAPS = 0x5350414E02  # cut points that spread the free words over the gaps
STREAM_ORDER = 0x5350414E03  # order in which tiled spans are offered to the budget
STREAM_SPLIT = 0x5350414E04  # mask / random / keep (per span for SpanBERT, per token for ALBERT)
STREAM_REPLACE = 0x5350414E05  # random replacement id per token
STREAM_STOP = 0x5350414E06  # dithering of the per-row stop threshold


def _check_fraction(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{owner}.{name} must be a number in [0, 1], got {value!r}")


def _check_split(owner: str, mask_fraction: float, random_fraction: float) -> None:
    _check_fraction(owner, "mask_fraction", mask_fraction)
    _check_fraction(owner, "random_fraction", random_fraction)
    if mask_fraction + random_fraction > 1.0 + 1e-12:
        raise ValueError(
            f"{owner}.mask_fraction + {owner}.random_fraction must not exceed 1 "
            f"(got {mask_fraction} + {random_fraction}); the remainder is the kept fraction"
        )


@dataclass(frozen=True)
class SpanConfig:
    mask_ratio: float = 0.15  # token budget per row (SpanBERT: 15%, as BERT)
    geometric_p: float = 0.2  # span length in words ~ Geo(p), clipped; p=0.2 gives mean 3.8 words
    max_span_words: int = 10  # clip (renormalised, as SpanBERT's len_distrib)
    mask_fraction: float = 0.8  # of the spans, replaced by [MASK] entirely
    random_fraction: float = 0.1  # of the spans, replaced by random ids; the rest stay as they are

    def __post_init__(self) -> None:
        _check_fraction("SpanConfig", "mask_ratio", self.mask_ratio)
        p = self.geometric_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise ValueError(f"SpanConfig.geometric_p must be a number in (0, 1], got {p!r}")
        if isinstance(self.max_span_words, bool) or not isinstance(self.max_span_words, int) or self.max_span_words < 1:
            raise ValueError(f"SpanConfig.max_span_words must be an int >= 1, got {self.max_span_words!r}")
        _check_split("SpanConfig", self.mask_fraction, self.random_fraction)

    def length_pmf(self) -> np.ndarray:
        """float64 (max_span_words,): P(span has l words), l = 1..max_span_words."""
        lengths = np.arange(1, self.max_span_words + 1)
        pmf = self.geometric_p * (1.0 - self.geometric_p) ** (lengths - 1)
        return pmf / pmf.sum()


@dataclass(frozen=True)
class NgramConfig:
    mask_ratio: float = 0.15  # token budget per row (ALBERT: 15%)
    max_ngram: int = 3  # n in 1..max_ngram words, p(n) proportional to 1/n (ALBERT: 3)
    mask_fraction: float = 0.8  # of the tokens, replaced by [MASK]
    random_fraction: float = 0.1  # of the tokens, replaced by a random id; the rest stay

    def __post_init__(self) -> None:
        _check_fraction("NgramConfig", "mask_ratio", self.mask_ratio)
        if isinstance(self.max_ngram, bool) or not isinstance(self.max_ngram, int) or self.max_ngram < 1:
            raise ValueError(f"NgramConfig.max_ngram must be an int >= 1, got {self.max_ngram!r}")
        _check_split("NgramConfig", self.mask_fraction, self.random_fraction)

    def length_pmf(self) -> np.ndarray:
        """float64 (max_ngram,): P(n-gram has n words), proportional to 1/n."""
        pmf = 1.0 / np.arange(1, self.max_ngram + 1)
        return pmf / pmf.sum()


@dataclass(frozen=True)
class _VocabTables:
    is_special: np.ndarray  # bool (V,)
    starts_word: np.ndarray  # bool (V,): word_start | special
    replacement_ids: np.ndarray  # int64 (R,): non-special ids
    mask_id: int


def _vocab_tables(vocab, caller: str) -> _VocabTables:
    """Lookup tables from a duck-typed vocabulary (see the module docstring of pipelines.masking)."""
    v = int(vocab.vocab_size)
    is_special = np.zeros(v, dtype=bool)
    is_special[np.asarray(vocab.special_ids, dtype=np.int64).reshape(-1)] = True
    is_special[[int(vocab.pad_id), int(vocab.cls_id), int(vocab.sep_id), int(vocab.mask_id)]] = True
    word_start = getattr(vocab, "word_start", None)
    if word_start is None:
        raise ValueError(f"{caller}: the vocabulary has no word_start table; span masking needs word boundaries")
    word_start = np.asarray(word_start, dtype=bool).reshape(-1)
    if word_start.shape != (v,):
        raise ValueError(f"{caller}: vocab.word_start has {word_start.shape[0]} entries, expected vocab_size={v}")
    replacement_ids = np.flatnonzero(~is_special).astype(np.int64)
    if replacement_ids.size == 0:
        raise ValueError(f"{caller}: every id of the vocabulary is special; nothing to replace with")
    return _VocabTables(is_special, word_start | is_special, replacement_ids, int(vocab.mask_id))


def _read_batch(batch: dict, caller: str, vocab_size: int):
    """(ids int64 (B, T), real bool (B, T), sample_id (B,), epoch (B,)) with clear errors."""
    ids = np.asarray(batch["input_ids"])
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{caller}: input_ids must be a 2-D integer array (B, T), got {ids.dtype} {ids.shape}")
    if "sample_id" not in batch or "epoch" not in batch:
        raise ValueError(f"{caller}: the batch needs sample_id and epoch columns to key the randomness; it has {sorted(batch)}")
    n_rows = ids.shape[0]
    sample_id = np.asarray(batch["sample_id"]).reshape(-1)
    epoch = np.broadcast_to(np.asarray(batch["epoch"]).reshape(-1), (n_rows,))
    if sample_id.shape != (n_rows,):
        raise ValueError(f"{caller}: sample_id must have shape ({n_rows},), got {sample_id.shape}")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"{caller}: input_ids holds {bad}, outside the vocabulary [0, {vocab_size})")
    mask = batch.get("attention_mask")
    real = np.ones(ids.shape, dtype=bool) if mask is None else np.asarray(mask) != 0  # (B, T)
    if real.shape != ids.shape:
        raise ValueError(f"{caller}: attention_mask has shape {real.shape}, input_ids {ids.shape}")
    return ids, real, sample_id, epoch


@dataclass
class _Spans:
    """Accepted spans, seen from the tokens. Arrays are (B, T) unless said otherwise."""

    inside: np.ndarray  # bool: token is in an accepted span
    slot: np.ndarray  # int64: slot index of the token's span (valid where inside)
    start: np.ndarray  # int64: first token of the token's span (valid where inside)
    end: np.ndarray  # int64: one past the last token of the token's span (valid where inside)
    n_slots: int  # S: draws per row for per-span decisions


def _place_spans(ids, real, sample_id, epoch, seed, tables: _VocabTables, pmf: np.ndarray, ratio: float) -> _Spans:
    n_rows, length = ids.shape
    rows = np.arange(n_rows)[:, None]  # (B, 1)
    pos = np.arange(length)  # (T,)
    special = tables.is_special[ids]  # (B, T)

    # Eligible tokens: real, non-special, with a real token on both sides (SBO neighbours).
    real_left = np.zeros_like(real)
    real_left[:, 1:] = real[:, :-1]
    real_right = np.zeros_like(real)
    real_right[:, :-1] = real[:, 1:]
    eligible = real & ~special & real_left & real_right  # (B, T)

    # Word starts among real tokens; words never cross a special token or padding.
    after_break = np.ones_like(real)
    after_break[:, 1:] = ~real[:, :-1] | special[:, :-1]
    is_start = real & (tables.starts_word[ids] | after_break)  # (B, T)
    n_words = is_start.sum(axis=1)  # (B,)
    # word_pos[b, w]: first token of word w; T for w >= n_words (so a span's end gathers T).
    word_pos = np.full((n_rows, length + 1), length, dtype=np.int64)  # (B, T+1)
    word_pos[:, :length] = np.sort(np.where(is_start, pos, length), axis=1)
    # bad_before[b, t]: tokens before t that may not be masked; a token range [s, e) is clean when
    # bad_before[e] == bad_before[s]. Padding is "bad", so a word followed by padding is not clean.
    bad_before = np.zeros((n_rows, length + 1), dtype=np.int64)  # (B, T+1)
    np.cumsum(~eligible, axis=1, out=bad_before[:, 1:])

    # Maskable word range [w_lo, w_hi): first and one past the last clean word.
    word_idx = np.arange(length)  # (T,) candidate word indices
    w_tok_lo = word_pos[:, :length]  # (B, T)
    w_tok_hi = word_pos[:, 1:]  # (B, T)
    clean_word = (np.take_along_axis(bad_before, w_tok_hi, axis=1) == np.take_along_axis(bad_before, w_tok_lo, axis=1)) & (
        word_idx < n_words[:, None]
    )  # (B, T)
    has_clean = clean_word.any(axis=1)  # (B,)
    w_lo = np.where(has_clean, np.argmax(clean_word, axis=1), 0)  # (B,)
    w_hi = np.where(has_clean, length - np.argmax(clean_word[:, ::-1], axis=1), 0)  # (B,)
    region = w_hi - w_lo  # (B,) words

    # Slots: at most ceil(T/2) spans fit with a gap between neighbours; one more keeps it loose.
    n_slots = length // 2 + 2
    slot_idx = np.arange(n_slots)  # (S,)
    cdf = np.cumsum(pmf)
    u_len = keyed_uniform(seed, epoch, sample_id, n_slots, STREAM_LENGTH)  # (B, S)
    span_words = np.minimum(np.searchsorted(cdf, u_len * cdf[-1], side="right"), pmf.size - 1) + 1  # (B, S)
    # A row shorter than a drawn span would get no span at all; clip to the row (tiny rows only).
    span_words = np.minimum(span_words, np.maximum(region, 1)[:, None])
    words_through = np.cumsum(span_words, axis=1)  # (B, S): words of spans 0..k
    fits = words_through + slot_idx <= region[:, None]  # (B, S): spans 0..k plus k gaps fit
    n_tiled = fits.sum(axis=1)  # (B,) prefix length (fits is monotone)
    used = np.where(n_tiled > 0, np.take_along_axis(words_through, np.maximum(n_tiled - 1, 0)[:, None], axis=1)[:, 0] + n_tiled - 1, 0)
    free = region - used  # (B,) words to spread over the n_tiled + 1 gaps
    tiled = slot_idx < n_tiled[:, None]  # (B, S)

    # Sorted random cut points in [0, free]: extra words before span k.
    u_gap = keyed_uniform(seed, epoch, sample_id, n_slots, STREAM_GAPS)  # (B, S)
    cuts = np.where(tiled, np.floor(u_gap * (free[:, None] + 1)).astype(np.int64), free[:, None])  # (B, S)
    cuts.sort(axis=1)
    start_w = w_lo[:, None] + words_through - span_words + slot_idx + cuts  # (B, S)
    end_w = start_w + span_words  # (B, S)
    start_w = np.where(tiled, start_w, length)
    end_w = np.where(tiled, end_w, length)
    tok_start = np.take_along_axis(word_pos, start_w, axis=1)  # (B, S)
    tok_end = np.take_along_axis(word_pos, end_w, axis=1)  # (B, S)
    clean = tiled & (np.take_along_axis(bad_before, tok_end, axis=1) == np.take_along_axis(bad_before, tok_start, axis=1))
    n_tok = np.where(clean, tok_end - tok_start, 0)  # (B, S)

    # Offer the clean spans to the budget in a keyed random order.
    n_budget = (real & ~special).sum(axis=1)  # (B,)
    budget = np.where(n_budget > 0, np.maximum(np.floor(ratio * n_budget + 0.5), 1), 0).astype(np.int64)[:, None]  # (B, 1)
    u_order = np.where(clean, keyed_uniform(seed, epoch, sample_id, n_slots, STREAM_ORDER), 2.0)  # (B, S)
    order = np.argsort(u_order, axis=1, kind="stable")  # (B, S)
    tok_sorted = np.take_along_axis(n_tok, order, axis=1)  # (B, S)
    after = np.cumsum(tok_sorted, axis=1)  # (B, S) tokens masked once this span is in
    before = after - tok_sorted  # (B, S)
    # Stop rule: offer span k while the tokens already accepted are below a threshold. It looks
    # only at earlier spans (a stopping time), so accepted lengths keep their distribution
    # (Wald's identity); judging the budget-crossing span by its own length would bias against
    # long spans. The threshold is the budget minus the expected overshoot of the last span,
    # (E[X^2]/E[X] - 1) / 2 for span token counts X estimated from the row's clean spans, with
    # keyed dithering of the rounding, so the masked count averages the budget.
    n_clean = np.maximum(clean.sum(axis=1), 1)  # (B,)
    mean_tok = n_tok.sum(axis=1) / n_clean  # (B,)
    mean_sq = (n_tok * n_tok).sum(axis=1) / n_clean  # (B,)
    overshoot = np.where(mean_tok > 0, (mean_sq / np.maximum(mean_tok, 1) - 1.0) / 2.0, 0.0)  # (B,)
    dither = keyed_uniform(seed, epoch, sample_id, 1, STREAM_STOP)[:, 0]  # (B,)
    stop_at = np.floor(budget[:, 0] - overshoot + dither)[:, None]  # (B, 1)
    take = (tok_sorted > 0) & (budget > 0) & ((before < stop_at) | (before == 0))
    accepted = np.zeros_like(clean)
    np.put_along_axis(accepted, order, take, axis=1)

    # Back to tokens: the slot of the latest tiled start at or before t (starts increase with k).
    marker = np.zeros((n_rows, length + 1), dtype=np.int32)  # (B, T+1); column T collects unused slots
    marker[rows, np.where(tiled, tok_start, length)] = 1
    slot = np.cumsum(marker[:, :length], axis=1, dtype=np.int64) - 1  # (B, T)
    slot_c = np.maximum(slot, 0)
    start = np.take_along_axis(tok_start, slot_c, axis=1)  # (B, T)
    end = np.take_along_axis(tok_end, slot_c, axis=1)  # (B, T)
    inside = (slot >= 0) & np.take_along_axis(accepted, slot_c, axis=1) & (pos < end)  # (B, T)
    return _Spans(inside=inside, slot=slot_c, start=start, end=end, n_slots=n_slots)


def _random_ids(seed, epoch, sample_id, length: int, tables: _VocabTables) -> np.ndarray:
    """int64 (B, T): a random non-special id per position."""
    u = keyed_uniform(seed, epoch, sample_id, length, STREAM_REPLACE)  # (B, T)
    pick = np.minimum((u * tables.replacement_ids.size).astype(np.int64), tables.replacement_ids.size - 1)
    return tables.replacement_ids[pick]


def _corrupt(ids, inside, split_u, mask_fraction, random_fraction, random_ids, mask_id):
    """New input_ids and labels from a (B, T) split draw that is constant per span or per token."""
    labels = np.where(inside, ids, IGNORE_INDEX)  # (B, T)
    to_mask = inside & (split_u < mask_fraction)
    to_random = inside & (split_u >= mask_fraction) & (split_u < mask_fraction + random_fraction)
    new_ids = np.where(to_mask, mask_id, np.where(to_random, random_ids, ids))  # (B, T)
    return new_ids, labels


def span_mask(batch: dict[str, np.ndarray], seed: int, cfg: SpanConfig, vocab) -> dict[str, np.ndarray]:
    """SpanBERT span masking plus Span Boundary Objective targets; a new dict, inputs untouched.

    Reads ``input_ids`` (B, T), ``sample_id`` (B,), ``epoch`` (B,) and, if present,
    ``attention_mask`` (B, T). Returns every input column plus (all int64, (B, T)):

    * ``input_ids``: corrupted copy (per span: all [MASK], all random, or all kept);
    * ``labels``: original id inside spans, -100 elsewhere;
    * ``sbo_left`` / ``sbo_right``: position of the token just before / after the token's span
      (``start - 1`` and ``end + 1`` for a span covering ``start..end``); -1 where labels == -100;
    * ``sbo_pos``: 0-based position of the token inside its span; 0 where labels == -100.

    Positions are row-local indices into T, ready for ``torch.gather`` once the -1 fill is
    clamped (those positions carry no loss anyway).
    """
    tables = _vocab_tables(vocab, "span_mask")
    ids, real, sample_id, epoch = _read_batch(batch, "span_mask", tables.is_special.size)
    out = dict(batch)
    if ids.size == 0:
        minus_one = np.full(ids.shape, -1, dtype=np.int64)
        out.update(input_ids=ids.copy(), labels=np.full(ids.shape, IGNORE_INDEX, dtype=np.int64),
                   sbo_left=minus_one, sbo_right=minus_one.copy(), sbo_pos=np.zeros(ids.shape, dtype=np.int64))
        return out
    spans = _place_spans(ids, real, sample_id, epoch, seed, tables, cfg.length_pmf(), cfg.mask_ratio)
    per_span_u = keyed_uniform(seed, epoch, sample_id, spans.n_slots, STREAM_SPLIT)  # (B, S)
    split_u = np.take_along_axis(per_span_u, spans.slot, axis=1)  # (B, T): one draw per span
    random_ids = _random_ids(seed, epoch, sample_id, ids.shape[1], tables)
    new_ids, labels = _corrupt(ids, spans.inside, split_u, cfg.mask_fraction, cfg.random_fraction, random_ids, tables.mask_id)
    pos = np.arange(ids.shape[1])  # (T,)
    out["input_ids"] = new_ids
    out["labels"] = labels
    out["sbo_left"] = np.where(spans.inside, spans.start - 1, -1)
    out["sbo_right"] = np.where(spans.inside, spans.end, -1)
    out["sbo_pos"] = np.where(spans.inside, pos - spans.start, 0)
    return out


def ngram_mask(batch: dict[str, np.ndarray], seed: int, cfg: NgramConfig, vocab) -> dict[str, np.ndarray]:
    """ALBERT n-gram masking; a new dict with every input column plus ``labels``, inputs untouched.

    Reads the same columns as :func:`span_mask`. Returns ``input_ids`` (int64 (B, T), corrupted
    per token: 80% [MASK], 10% random, 10% kept) and ``labels`` (int64 (B, T): original id at the
    targets, -100 elsewhere).
    """
    tables = _vocab_tables(vocab, "ngram_mask")
    ids, real, sample_id, epoch = _read_batch(batch, "ngram_mask", tables.is_special.size)
    out = dict(batch)
    if ids.size == 0:
        out.update(input_ids=ids.copy(), labels=np.full(ids.shape, IGNORE_INDEX, dtype=np.int64))
        return out
    spans = _place_spans(ids, real, sample_id, epoch, seed, tables, cfg.length_pmf(), cfg.mask_ratio)
    split_u = keyed_uniform(seed, epoch, sample_id, ids.shape[1], STREAM_SPLIT)  # (B, T): one draw per token
    random_ids = _random_ids(seed, epoch, sample_id, ids.shape[1], tables)
    out["input_ids"], out["labels"] = _corrupt(
        ids, spans.inside, split_u, cfg.mask_fraction, cfg.random_fraction, random_ids, tables.mask_id
    )
    return out
