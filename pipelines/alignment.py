"""Words <-> sub-tokens: which word each token of a text belongs to, and back.

Fine-tuning data comes in words (CoNLL-2003 ``tokens``, Tjong Kim Sang & De Meulder 2003) or in
plain text with character positions (SQuAD ``answer_start``, Rajpurkar et al. 2016), while models
read sub-tokens. BERT (Devlin et al. 2019, sec. 5.3) labels a word by its first sub-token; SQuAD
answers are token spans mapped back to characters. Both need each token's character span and its
word, which this module computes for any tokenizer kind from the character offsets the backend
reports (``tok._backend.encode_offsets``: WordPiece, SentencePiece, byte-level BPE alike), never
from kind-specific markers such as ``##`` or ``▁``.

How a token finds its word: words are character spans of the text (words given as a list are
joined by single spaces; a plain text's words are its whitespace-separated runs), and a token
belongs to the last word that starts at or before the token's start, if the token starts no later
than that word's end. Tokenizers never emit a token across whitespace, so a token lies inside its
word (the one exception, a SentencePiece piece that swallows a deleted zero-width character before
a space, is trimmed to what follows the space). Tokens outside every word (byte-level BPE's whitespace-only tokens) get word -1. A given word
that yields no token at all (an empty string, or only characters the normaliser deletes, such as
a zero-width space under BERT's normaliser) gets one ``[UNK]`` token spanning it, so that every
word can carry a label; plain texts are left as the tokenizer made them (QA must match it).

Everything is vectorised over the whole batch: the per-row character positions are shifted by a
running base so that one ``searchsorted`` assigns every token of every text. Results are ragged
arrays (a flat array plus row boundaries) in ``Aligned``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Pool = Literal["first", "last", "mean", "max"]

_NON_SPACE = re.compile(r"\S+")
_SPACE = re.compile(r"\s")


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields have no truth value for ==
class Aligned:
    """Sub-tokens of N texts and the words they belong to, as ragged arrays.

    Token k of text i is flat element ``splits[i] + k``; word w of text i is ``word_splits[i] + w``.
    ``word_ids`` are indices within the text (0 = its first word), -1 for a token in no word.
    """

    texts: list[str]  # what was tokenized (given words: joined by single spaces)
    ids: np.ndarray  # int64 (M,) token ids, no special tokens
    offsets: np.ndarray  # int64 (M, 2) character span of each token in its text
    word_ids: np.ndarray  # int64 (M,) word of each token within its text, -1 if none
    splits: np.ndarray  # int64 (N + 1,) row boundaries of the token arrays
    word_spans: np.ndarray  # int64 (W, 2) character span of each word in its text
    word_splits: np.ndarray  # int64 (N + 1,) row boundaries of word_spans

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def lengths(self) -> np.ndarray:
        """int64 (N,): tokens per text."""
        return np.diff(self.splits)

    @property
    def n_words(self) -> np.ndarray:
        """int64 (N,): words per text."""
        return np.diff(self.word_splits)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, offsets, word_ids) of text ``i``."""
        lo, hi = self.splits[i], self.splits[i + 1]
        return self.ids[lo:hi], self.offsets[lo:hi], self.word_ids[lo:hi]

    def word_tokens(self, i: int) -> list[np.ndarray]:
        """For each word of text ``i``, the indices (within the text) of its tokens, in order."""
        _, _, wids = self.row(i)
        return [np.flatnonzero(wids == w) for w in range(int(self.n_words[i]))]


def _splits(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def tokenize_with_offsets(tok, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ids (M,), character offsets (M, 2) and row splits (N + 1,) of ``texts``, no special tokens.

    The one place that calls ``tok._backend.encode_offsets`` (tokenizers.py's contract for
    ids + offsets); offsets index the original, un-normalised text.
    """
    encoded = tok._backend.encode_offsets(list(texts))
    lengths = np.fromiter((len(ids) for ids, _, _ in encoded), dtype=np.int64, count=len(encoded))
    total = int(lengths.sum())
    ids = np.fromiter((i for e in encoded for i in e[0]), dtype=np.int64, count=total)
    offsets = np.fromiter((x for e in encoded for span in e[1] for x in span), dtype=np.int64, count=2 * total).reshape(total, 2)
    splits = _splits(lengths)
    return ids, _after_last_space(list(texts), offsets, splits), splits


def _after_last_space(texts: list[str], offsets: np.ndarray, splits: np.ndarray) -> np.ndarray:
    """Token spans that start after the last whitespace inside them.

    SentencePiece gives a character its normaliser deletes (a zero-width space) to the next
    piece, so "\u200b b" may come back as one span for "▁b" that crosses the space; the token's
    surface is only what follows the whitespace. Vectorised: the texts are laid end to end and a
    running maximum gives, at every character, the position of the last whitespace so far.
    """
    if offsets.size == 0:
        return offsets
    joined = "\n".join(texts)  # "\n" keeps rows apart and is itself whitespace
    base = _splits(np.fromiter((len(t) + 1 for t in texts), dtype=np.int64, count=len(texts)))[:-1]
    last_space = np.full(len(joined) + 1, -1, dtype=np.int64)
    spaces = np.fromiter((m.start() for m in _SPACE.finditer(joined)), dtype=np.int64)
    last_space[spaces] = spaces
    np.maximum.accumulate(last_space, out=last_space)
    token_row = np.repeat(np.arange(len(texts)), np.diff(splits))
    g_start = offsets[:, 0] + base[token_row]
    g_end = offsets[:, 1] + base[token_row]
    ws = last_space[np.maximum(g_end - 1, 0)]  # (M,) last whitespace at or before the token's last char
    cut = (g_end > g_start) & (ws >= g_start)
    if not cut.any():
        return offsets
    out = offsets.copy()
    out[cut, 0] = ws[cut] + 1 - base[token_row[cut]]
    return out


def whitespace_words(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Character spans (W, 2) of the whitespace-separated words of each text, and row splits (N + 1,)."""
    spans = [[m.span() for m in _NON_SPACE.finditer(t)] for t in texts]
    lengths = np.fromiter((len(s) for s in spans), dtype=np.int64, count=len(spans))
    flat = np.array([x for s in spans for span in s for x in span], dtype=np.int64).reshape(-1, 2)
    return flat, _splits(lengths)


def _assign_words(texts: Sequence[str], offsets: np.ndarray, splits: np.ndarray, word_spans: np.ndarray, word_splits: np.ndarray) -> np.ndarray:
    """int64 (M,): the word (within its text) of each token, -1 for tokens outside every word."""
    n = len(texts)
    # Shift every row's character positions by a running base (text length + 1 apart) so that the
    # words of all rows form one sorted array and one searchsorted serves the whole batch.
    base = _splits(np.fromiter((len(t) + 1 for t in texts), dtype=np.int64, count=n))[:-1]  # (N,)
    token_row = np.repeat(np.arange(n), np.diff(splits))  # (M,)
    word_row = np.repeat(np.arange(n), np.diff(word_splits))  # (W,)
    g_word_start = word_spans[:, 0] + base[word_row]  # (W,) sorted
    g_word_end = word_spans[:, 1] + base[word_row]
    g_start = offsets[:, 0] + base[token_row]  # (M,)
    w = np.searchsorted(g_word_start, g_start, side="right") - 1  # (M,) global word index or -1
    w_safe = np.maximum(w, 0)
    inside = (w >= 0) & (w >= word_splits[token_row]) & (g_start <= g_word_end[w_safe])
    return np.where(inside, w - word_splits[token_row], -1)


def _with_unk_for_empty_words(al: Aligned, unk_id: int) -> Aligned:
    """Insert one ``unk_id`` token (spanning the word) for every word that got no token."""
    token_row = np.repeat(np.arange(len(al)), al.lengths)  # (M,)
    has_word = al.word_ids >= 0
    g_word = np.where(has_word, al.word_ids + al.word_splits[token_row], -1)  # (M,) global word or -1
    counts = np.bincount(g_word[has_word], minlength=len(al.word_spans))  # (W,)
    empty = np.flatnonzero(counts == 0)  # (E,) global indices of token-less words
    if empty.size == 0:
        return al
    empty_row = np.repeat(np.arange(len(al)), al.n_words)[empty]  # (E,)
    # Order inside a row: by word, a token in no word staying after the word before it (running
    # maximum of the global word index), old tokens in their order. A token-less word has no old
    # token with its key, so its [UNK] lands between the words around it.
    key = np.concatenate([np.maximum.accumulate(g_word) if g_word.size else g_word, empty])
    row = np.concatenate([token_row, empty_row])
    seq = np.arange(len(key))
    order = np.lexsort((seq, key, row))
    ids = np.concatenate([al.ids, np.full(empty.size, unk_id, dtype=np.int64)])[order]
    offsets = np.concatenate([al.offsets, al.word_spans[empty]])[order]
    word_ids = np.concatenate([al.word_ids, empty - al.word_splits[empty_row]])[order]
    lengths = al.lengths + np.bincount(empty_row, minlength=len(al))
    return Aligned(al.texts, ids, offsets, word_ids, _splits(lengths), al.word_spans, al.word_splits)


def encode_texts(tok, texts: Sequence[str]) -> Aligned:
    """Tokens of plain texts with character offsets; words are whitespace-separated runs.

    Tokens are exactly the tokenizer's (no ``[UNK]`` is inserted) and their spans what
    ``transformers`` reports for the same tokenizer (SQuAD features are checked against it), but
    for the whitespace trim described in the module doc.
    """
    texts = list(texts)
    ids, offsets, splits = tokenize_with_offsets(tok, texts)
    word_spans, word_splits = whitespace_words(texts)
    word_ids = _assign_words(texts, offsets, splits, word_spans, word_splits)
    return Aligned(texts, ids, offsets, word_ids, splits, word_spans, word_splits)


def joined_words(words: Sequence[Sequence[str]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Pre-split texts as the model reads them: each its words joined by single spaces, the character
    spans (W, 2) of every word in its joined text, and row splits (N + 1,)."""
    lists = [list(ws) for ws in words]
    texts = [" ".join(ws) for ws in lists]
    lengths = np.fromiter((len(ws) for ws in lists), dtype=np.int64, count=len(lists))
    word_len = np.fromiter((len(w) for ws in lists for w in ws), dtype=np.int64, count=int(lengths.sum()))
    word_splits = _splits(lengths)
    # Word w of a row starts after the previous words and one space each: a per-row cumulative sum.
    ends_incl_space = np.cumsum(word_len + 1)  # (W,) running over all rows
    row_first = word_splits[:-1]
    row_base = np.zeros(len(lists), dtype=np.int64)
    nonempty = lengths > 0
    row_base[nonempty] = (ends_incl_space - (word_len + 1))[row_first[nonempty]]
    word_row = np.repeat(np.arange(len(lists)), lengths)
    starts = ends_incl_space - (word_len + 1) - row_base[word_row]  # (W,)
    word_spans = np.stack([starts, starts + word_len], axis=1) if len(starts) else np.zeros((0, 2), dtype=np.int64)
    return texts, word_spans, word_splits


def encode_words(tok, words: Sequence[Sequence[str]]) -> Aligned:
    """Tokens of pre-split texts (CoNLL ``tokens``): each text is its words joined by single spaces.

    Every word gets at least one token (``[UNK]`` spanning the word if the tokenizer produced
    none), and every token lies inside its word, in order.
    """
    texts, word_spans, word_splits = joined_words(words)
    ids, offsets, splits = tokenize_with_offsets(tok, texts)
    word_ids = _assign_words(texts, offsets, splits, word_spans, word_splits)
    al = Aligned(texts, ids, offsets, word_ids, splits, word_spans, word_splits)
    return _with_unk_for_empty_words(al, int(tok.unk_id))


# ----------------------------------------------------------------------------------- per word


def first_subtokens(word_ids: np.ndarray) -> np.ndarray:
    """bool, same shape as ``word_ids`` (..., T): True at the first token of each word in its row.

    ``word_ids`` holds -1 at special tokens and padding; a word's tokens are contiguous.
    """
    w = np.asarray(word_ids)
    first = w >= 0
    first[..., 1:] &= w[..., 1:] != w[..., :-1]
    return first


def pool_words(values: np.ndarray, word_ids: np.ndarray, n_words: int, how: Pool = "first") -> tuple[np.ndarray, np.ndarray]:
    """Token values (N, T, ...) -> word values (N, n_words, ...) and a present mask (N, n_words).

    ``how``: the word's first token (BERT's NER choice, Devlin et al. 2019 sec. 5.3), its last,
    the mean or the max over its tokens. Words with no token in the row (cut by truncation) are
    not present; their values are 0 (``nan`` for "mean"/"max" of floats is avoided on purpose, so
    that argmax over labels stays defined; check ``present``).
    """
    values = np.asarray(values)
    w = np.asarray(word_ids)
    if values.shape[: w.ndim] != w.shape or w.ndim != 2:
        raise ValueError(f"pool_words: values {values.shape} must start with the word_ids shape (N, T), got {w.shape}")
    n_rows, length = w.shape
    tail = values.shape[2:]
    valid = (w >= 0) & (w < n_words)
    key = (np.arange(n_rows)[:, None] * n_words + w)[valid]  # (V,) flat word slot of each token
    vals = values[valid]  # (V, ...)
    out_dtype = np.float64 if how == "mean" else values.dtype
    out = np.zeros((n_rows * n_words, *tail), dtype=out_dtype)  # (N * W, ...)
    present = np.zeros(n_rows * n_words, dtype=bool)
    present[key] = True
    if how == "first":
        pick = first_subtokens(w)[valid]
        out[key[pick]] = vals[pick]
    elif how == "last":
        last = valid.copy()
        last[:, :-1] &= w[:, :-1] != w[:, 1:]
        pick = last[valid]
        out[key[pick]] = vals[pick]
    elif how == "mean":
        np.add.at(out, key, vals)
        counts = np.bincount(key, minlength=n_rows * n_words).reshape(-1, *([1] * len(tail)))
        out = out / np.maximum(counts, 1)
    elif how == "max":
        lowest = -np.inf if np.issubdtype(values.dtype, np.floating) else np.iinfo(values.dtype).min
        out[:] = lowest
        np.maximum.at(out, key, vals)
        out[~present] = 0
    else:
        raise ValueError(f"pool_words: how={how!r}; expected one of first, last, mean, max")
    return out.reshape(n_rows, n_words, *tail), present.reshape(n_rows, n_words)
