"""Sentence-pair construction for next sentence prediction (BERT) and sentence order prediction (ALBERT).

BERT (Devlin et al. 2019, sec. 3.1 and appendix A.2; google-research/bert
``create_pretraining_data.py``, ``create_instances_from_document``): walk each document, gather
sentences until a target length is reached (the full ``seq_len - 3`` tokens, or with probability
``short_seq_prob`` a random shorter one), cut the gathered chunk at a random sentence boundary
into segment A and the rest; half the time segment B is that rest (true next, label 0), half the
time a run of sentences from a random other document (label 1), in which case the unused
sentences of the chunk are put back for the next pair. ALBERT (Lan et al. 2020, sec. 3.1 and
their ``create_pretraining_data.py``) keeps both segments from the chunk and swaps them half the
time (label 1 = swapped). A pair that does not fit loses tokens from its longer segment, one at
a time, each from the front or the back at random (``truncate_seq_pair``). The row is
``[CLS] A [SEP] B [SEP]`` then padding; token types are 0 up to and including the first [SEP].

Choices of this project:

* one call sees one shard (or one chunk of a shard): random-next segments come from another
  document of the same call, not from the whole corpus;
* a chunk of a single sentence is not forced to be a random-next pair (BERT does that, which
  tilts the labels towards 1 when sentences are long): if the label says "in order", the
  sentence is cut at a random token into A and B, which are still consecutive text. A chunk made
  of a one-token sentence that cannot be cut is skipped;
* with a single non-empty document there is no "other document": NSP then makes only true-next
  pairs (rather than fail on a tiny last shard);
* every random decision of pair k is keyed by ``(seed, epoch, base_sample_id + k)``: the same
  documents give the same pairs on any worker and rerun, and a new segmentation each epoch (what
  BERT's ``dupe_factor`` copies gave offline).

The walk is a Python loop per pair: each chunk starts where the previous pair stopped (after
putting sentences back), so the pairs are sequential by construction. The random draws are
vectorised (one keyed matrix for all pairs) and the cost is one slice copy per segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from pipelines.rng import keyed_uniform

STREAM_PAIR = 0x50414952  # per-pair decisions (columns below)
STREAM_TRUNC = 0x50414953  # front/back coins of truncation

# Columns of the per-pair draw matrix.
_SHORT, _TARGET, _SPLIT, _LABEL, _DOC, _SENT, _CUT = range(7)
_N_DRAWS = 7

_I64_MASK = (1 << 64) - 1


def _sample_ids(base_sample_id: int, n: int) -> np.ndarray:
    """int64 (n,): base + k, wrapping like uint64 so a 63-bit hash base never overflows."""
    base = np.uint64(int(base_sample_id) & _I64_MASK)
    with np.errstate(over="ignore"):
        return (base + np.arange(n, dtype=np.uint64)).view(np.int64)


def _trimmed_lengths(len_a: int, len_b: int, max_tokens: int) -> tuple[int, int]:
    """Lengths left by BERT's truncate_seq_pair: trim the longer segment (B on ties) until they fit."""
    if len_a + len_b <= max_tokens:
        return len_a, len_b
    new_a = min(len_a, max(max_tokens - len_b, -(-max_tokens // 2)))
    return new_a, max_tokens - new_a


def _clean_docs(docs: Sequence[Sequence[np.ndarray]], vocab_size: int, caller: str) -> list[list[np.ndarray]]:
    """Documents as lists of non-empty 1-D int64 arrays; empty documents dropped."""
    out = []
    for d, doc in enumerate(docs):
        sentences = []
        for s, sent in enumerate(doc):
            arr = np.asarray(sent)
            if arr.size == 0:
                continue
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{caller}: document {d}, sentence {s} must be a 1-D integer array of token ids, got {arr.dtype} {arr.shape}")
            if arr.min() < 0 or arr.max() >= vocab_size:
                bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
                raise ValueError(f"{caller}: document {d}, sentence {s} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
            sentences.append(arr.astype(np.int64, copy=False))
        if sentences:
            out.append(sentences)
    return out


def _build_pairs(
    docs, seq_len: int, seed: int, epoch: int, base_sample_id: int, vocab, short_seq_prob: float,
    objective: Literal["nsp", "sop"], caller: str,
) -> dict[str, np.ndarray]:
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 5:
        raise ValueError(f"{caller}: seq_len must be an int >= 5 ([CLS] A [SEP] B [SEP] with one token each), got {seq_len!r}")
    if not 0.0 <= short_seq_prob <= 1.0:
        raise ValueError(f"{caller}: short_seq_prob must be in [0, 1], got {short_seq_prob!r}")
    seq_len = int(seq_len)
    max_tokens = seq_len - 3  # room for [CLS], [SEP], [SEP]
    docs = _clean_docs(docs, int(vocab.vocab_size), caller)
    n_docs = len(docs)
    # Every pair consumes at least one sentence, so there are at most as many pairs as sentences.
    max_pairs = sum(len(doc) for doc in docs)
    all_ids = _sample_ids(base_sample_id, max_pairs)  # (max_pairs,)
    draws = keyed_uniform(seed, epoch, all_ids, _N_DRAWS, STREAM_PAIR)  # (max_pairs, 7)

    def target_length(k: int) -> int:
        if draws[k, _SHORT] < short_seq_prob:
            return 2 + int(draws[k, _TARGET] * (max_tokens - 1))  # BERT: randint(2, max_num_tokens)
        return max_tokens

    segments: list[tuple[np.ndarray, np.ndarray, int]] = []  # (A, B, label) per pair
    for d, doc in enumerate(docs):
        chunk: list[np.ndarray] = []
        chunk_len = 0
        target = target_length(len(segments)) if len(segments) < max_pairs else max_tokens
        i = 0
        while i < len(doc):
            chunk.append(doc[i])
            chunk_len += doc[i].size
            if i == len(doc) - 1 or chunk_len >= target:
                u = draws[len(segments)]
                if len(chunk) >= 2:
                    a_end = 1 + int(u[_SPLIT] * (len(chunk) - 1))  # BERT: randint(1, len(chunk) - 1)
                    seg_a, rest = np.concatenate(chunk[:a_end]), chunk[a_end:]
                else:
                    a_end, seg_a, rest = 1, chunk[0], []
                flip = bool(u[_LABEL] < 0.5)
                seg_b = None
                if objective == "nsp" and flip and n_docs >= 2:
                    other = int(u[_DOC] * (n_docs - 1))
                    other += other >= d  # uniform over the other documents
                    other_doc = docs[other]
                    j = int(u[_SENT] * len(other_doc))
                    want = max(1, target - seg_a.size)
                    parts, got = [], 0
                    while j < len(other_doc) and got < want:
                        parts.append(other_doc[j])
                        got += other_doc[j].size
                        j += 1
                    seg_b, label = np.concatenate(parts), 1
                    i -= len(rest)  # BERT puts the unused sentences back
                else:
                    if rest:
                        seg_b = np.concatenate(rest)
                    elif seg_a.size >= 2:  # one sentence: cut it into two consecutive pieces
                        cut = 1 + int(u[_CUT] * (seg_a.size - 1))
                        seg_a, seg_b = seg_a[:cut], seg_a[cut:]
                    label = 0
                    if seg_b is not None and objective == "sop" and flip:
                        seg_a, seg_b, label = seg_b, seg_a, 1
                if seg_b is not None:
                    segments.append((seg_a, seg_b, label))
                chunk, chunk_len = [], 0
                target = target_length(len(segments)) if len(segments) < max_pairs else max_tokens
            i += 1

    n = len(segments)
    sample_id = all_ids[:n].copy()
    input_ids = np.full((n, seq_len), int(vocab.pad_id), dtype=np.int64)  # (N, T)
    attention_mask = np.zeros((n, seq_len), dtype=np.int64)  # (N, T)
    token_type_ids = np.zeros((n, seq_len), dtype=np.int64)  # (N, T)
    labels = np.zeros(n, dtype=np.int64)  # (N,)
    cls_id, sep_id = int(vocab.cls_id), int(vocab.sep_id)
    for k, (seg_a, seg_b, label) in enumerate(segments):
        len_a, len_b = _trimmed_lengths(seg_a.size, seg_b.size, max_tokens)
        cut_a, cut_b = seg_a.size - len_a, seg_b.size - len_b
        if cut_a or cut_b:
            # One coin per removed token (front or back), as truncate_seq_pair.
            coins = keyed_uniform(seed, epoch, sample_id[k : k + 1], cut_a + cut_b, STREAM_TRUNC)[0] < 0.5
            front_a, front_b = int(coins[:cut_a].sum()), int(coins[cut_a:].sum())
            seg_a = seg_a[front_a : front_a + len_a]
            seg_b = seg_b[front_b : front_b + len_b]
        row = input_ids[k]
        row[0] = cls_id
        row[1 : 1 + len_a] = seg_a
        row[1 + len_a] = sep_id
        row[2 + len_a : 2 + len_a + len_b] = seg_b
        row[2 + len_a + len_b] = sep_id
        attention_mask[k, : 3 + len_a + len_b] = 1
        token_type_ids[k, 2 + len_a : 3 + len_a + len_b] = 1
        labels[k] = label
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": token_type_ids,
        "next_sentence_label": labels,
        "sample_id": sample_id,
        "epoch": np.full(n, int(epoch), dtype=np.int64),
    }


def build_nsp_pairs(
    docs: Sequence[Sequence[np.ndarray]], seq_len: int, seed: int, epoch: int, base_sample_id: int, vocab,
    *, short_seq_prob: float = 0.1,
) -> dict[str, np.ndarray]:
    """BERT next-sentence-prediction pairs from one shard's documents.

    ``docs``: documents, each a list of sentences, each a 1-D integer array of token ids (no
    special tokens). ``vocab``: needs ``vocab_size, pad_id, cls_id, sep_id``. Returns a batch of
    N pairs, all int64: ``input_ids``, ``attention_mask``, ``token_type_ids`` (N, seq_len),
    ``next_sentence_label`` (N,) (0 = B follows A in the document, 1 = B is from another
    document), ``sample_id`` (N,) = ``base_sample_id + k`` for the k-th pair, ``epoch`` (N,).
    """
    return _build_pairs(docs, seq_len, seed, epoch, base_sample_id, vocab, short_seq_prob, "nsp", "build_nsp_pairs")


def build_sop_pairs(
    docs: Sequence[Sequence[np.ndarray]], seq_len: int, seed: int, epoch: int, base_sample_id: int, vocab,
    *, short_seq_prob: float = 0.1,
) -> dict[str, np.ndarray]:
    """ALBERT sentence-order-prediction pairs: same columns as :func:`build_nsp_pairs`, with
    ``next_sentence_label`` 0 = A then B as in the document, 1 = the two segments swapped."""
    return _build_pairs(docs, seq_len, seed, epoch, base_sample_id, vocab, short_seq_prob, "sop", "build_sop_pairs")
