"""Character ids per token for ELMo's character CNN (Peters et al. 2018, "Deep contextualized word
representations"), checked against the encoding of the reference code (allenai/bilm-tf
``UnicodeCharsVocabulary`` and AllenNLP's ``ELMoCharacterMapper``).

A token becomes ``max_chars`` character ids::

    [begin-of-word, utf-8 byte, utf-8 byte, ..., end-of-word, pad, pad, ...]

Raw ids: bytes are 0..255, then 256 begin-of-sentence, 257 end-of-sentence, 258 begin-of-word,
259 end-of-word, 260 padding char. Every id is shifted by +1 so that 0 is free to mean "no token"
(masked positions), which gives the paper's character vocabulary of 262 (``CHAR_VOCAB_SIZE``).
A token's bytes are cut to ``max_chars - 2`` so the end-of-word marker always fits.

Design choices of this project:

* ELMo's "words" are the tokenizer's pieces, so one vocabulary serves every family. The table is
  computed once per vocabulary, and a batch is a single lookup ``table[input_ids]``.
* WordPiece's continuation prefix ``##`` and SentencePiece's word-start marker ``▁`` are stripped
  before encoding: the character CNN sees the characters of the piece, as ELMo saw the characters
  of a word. The cost is that ``ing`` and ``##ing`` (or ``▁the`` and ``the``) get the same
  characters; the biLSTMs tell them apart from context, and the softmax still predicts distinct
  token ids.
* Special tokens get marker rows like ELMo's sentence markers ``<S>``/``</S>``
  (``[bow, marker, eow, pad, ...]``): ``cls`` uses begin-of-sentence, ``sep`` end-of-sentence,
  ``unk`` and ``mask`` use byte values that never occur in UTF-8 (0xF5, 0xF6), so the character
  vocabulary stays at the paper's 262. ``pad`` gets an all-zero row.
"""

from __future__ import annotations

import numpy as np

CHAR_VOCAB_SIZE = 262  # 256 bytes + 5 markers, +1 for the masking id 0

# Raw ids as in the reference, before the +1 shift.
_BOS_CHAR = 256  # begin of sentence, used for [CLS]
_EOS_CHAR = 257  # end of sentence, used for [SEP]
_BOW_CHAR = 258  # begin of word
_EOW_CHAR = 259  # end of word
_PAD_CHAR = 260  # fills the row after end-of-word

# Marker char per special-token role. 0xF5 and 0xF6 are never produced by UTF-8 encoding, so a
# marker cannot collide with the characters of a real token.
_ROLE_MARKER = {"cls": _BOS_CHAR, "sep": _EOS_CHAR, "unk": 0xF5, "mask": 0xF6}
_ROLES = ("pad", *_ROLE_MARKER)

_PREFIXES = ("##", "\u2581")  # WordPiece continuation, SentencePiece word start ("▁")


def _strip_prefix(token: str) -> str:
    for prefix in _PREFIXES:
        if token.startswith(prefix):
            return token[len(prefix):]
    return token


def build_char_table(
    tokens: list[str], max_chars: int = 50, special_ids: dict[str, int | None] | None = None
) -> np.ndarray:
    """Character ids of every vocabulary entry: int32 array (V, max_chars), ids in [0, 262).

    ``tokens[i]`` is the string of token id ``i``. ``special_ids`` maps a role to its token id, with
    roles ``pad``, ``cls``, ``sep``, ``unk``, ``mask`` (the special ids a ``Tokenizer`` exposes);
    a ``None`` id is skipped. Run once per vocabulary (a Python loop over ``V`` strings).
    """
    if max_chars < 3:
        raise ValueError(f"max_chars={max_chars}: need at least 3 (begin-of-word, a char, end-of-word)")
    n_vocab = len(tokens)
    table = np.full((n_vocab, max_chars), _PAD_CHAR + 1, dtype=np.int32)  # (V, C)
    table[:, 0] = _BOW_CHAR + 1
    for i, token in enumerate(tokens):
        raw = _strip_prefix(token).encode("utf-8", "ignore")[: max_chars - 2]
        table[i, 1 : 1 + len(raw)] = np.frombuffer(raw, dtype=np.uint8).astype(np.int32) + 1
        table[i, 1 + len(raw)] = _EOW_CHAR + 1

    seen: dict[int, str] = {}
    for role, token_id in (special_ids or {}).items():
        if role not in _ROLES:
            raise ValueError(f"special_ids: unknown role {role!r}; expected some of {list(_ROLES)}")
        if token_id is None:
            continue
        if not 0 <= token_id < n_vocab:
            raise ValueError(f"special_ids[{role!r}]={token_id} is outside the vocabulary of {n_vocab} tokens")
        if token_id in seen:
            raise ValueError(f"special_ids: roles {seen[token_id]!r} and {role!r} share token id {token_id}")
        seen[token_id] = role
        if role == "pad":
            table[token_id] = 0
        else:
            table[token_id] = _PAD_CHAR + 1
            table[token_id, :3] = (_BOW_CHAR + 1, _ROLE_MARKER[role] + 1, _EOW_CHAR + 1)
    return table


def add_char_ids(batch: dict[str, np.ndarray], table: np.ndarray) -> dict[str, np.ndarray]:
    """Return ``batch`` plus ``char_ids`` int64 (B, T, max_chars) looked up from ``input_ids``.

    Positions where ``attention_mask == 0`` get all-zero rows (the char embedding's masking id).
    The input dict is not modified.
    """
    input_ids = np.asarray(batch["input_ids"])  # (B, T)
    if input_ids.size and (input_ids.min() < 0 or input_ids.max() >= table.shape[0]):
        raise ValueError(
            f"add_char_ids: input_ids range [{input_ids.min()}, {input_ids.max()}] does not fit the char "
            f"table of {table.shape[0]} tokens; build the table from the same tokenizer as the batch"
        )
    char_ids = table.take(input_ids, axis=0).astype(np.int64)  # (B, T, C)
    mask = batch.get("attention_mask")
    if mask is not None:
        char_ids *= (np.asarray(mask) != 0)[..., None]  # (B, T, 1) broadcast over chars
    return {**batch, "char_ids": char_ids}
