"""Subword tokenizers: WordPiece, SentencePiece and byte-level BPE, behind one class.

* WordPiece (Wu et al. 2016, "Google's Neural Machine Translation System"; as used by BERT, Devlin
  et al. 2019): BERT's normaliser (clean text, split CJK characters, lowercase and strip accents),
  BERT's pre-tokenizer (whitespace and punctuation), continuation pieces prefixed by ``##``.
* SentencePiece (Kudo & Richardson 2018) with the unigram LM model (Kudo 2018; ALBERT, XLNet) or
  BPE (Sennrich et al. 2016): no pre-tokenizer, a word starts with a piece beginning with ``▁``,
  byte fallback so no character is ever unknown, lowercasing by the ``nmt_nfkc_cf`` normalisation
  rule so that training and encoding lowercase the same way.
* Byte-level BPE (GPT-2, Radford et al. 2019, sec. 2.2; RoBERTa, Liu et al. 2019): BPE over the
  UTF-8 bytes of GPT-2's pre-tokenizer words (a regex split into letters, digits, other symbols and
  spaces, each word carrying the space before it, shown as ``Ġ``), so no text is ever unknown; a
  space is put before the text (``add_prefix_space``, as RoBERTa's tokenizer for pre-split words)
  so that the first word is encoded as it is everywhere else. Lowercasing by a ``Lowercase``
  normaliser when asked (GPT-2 and RoBERTa are cased: train with ``lowercase=False`` for them).

All kinds we train put the special tokens at ids 0..4: ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (byte-level
BPE keeps ``[UNK]`` at 1 although it never produces it, so that every kind we train numbers alike).
Training is reproducible: the same texts and settings give byte-identical files on any machine and
thread count. WordPiece pieces are learned by SentencePiece's BPE trainer and numbered by a rule
(special tokens, then by frequency, ties by the string; ``_train_wordpiece``); SentencePiece trains
with a fixed thread count; byte-level BPE merges are learned here (``_learn_merges``) and numbered
by a rule: the special tokens, the 256 byte symbols in byte order, then each merge's new token in
the order learned; the most frequent pair is merged first, ties by the pair's token strings.

``load_tokenizer`` also reads Hugging Face folders (``tokenizer.json``, ``vocab.txt``, or GPT-2's
``vocab.json`` + ``merges.txt``), finding the special tokens by the folder's configuration
(``tokenizer_config.json`` / ``special_tokens_map.json``), else by token string: BERT-style
(``[PAD]``...), RoBERTa-style (``<pad> <s> </s> <mask> <unk>``) or GPT-2's ``<|endoftext|>`` (its
end-of-text, unknown and beginning token). A folder needs only the special tokens its model uses:
a GPT-2 folder has no pad, cls, sep or mask token, and loads. Asking a tokenizer for a token it
lacks (``tok.mask_id`` of GPT-2's, for masked-LM data) raises an error naming the token and the
folder; ``special_id(role)`` returns None instead, for callers with a fallback (GPT inputs in
``pipelines.finetune``). Parity with ``transformers``' pure-Python ``BertTokenizerLegacy`` and its
``tokenizers``-backed ``BertTokenizer`` is tested on the all-MiniLM-L6-v2 vocabulary, with
``GPT2Tokenizer`` on GPT-2 folders built by the tests.

Folder layout written by ``Tokenizer.save``::

    wordpiece:       tokenizer.json  vocab.txt                tokenizer_config.json
    sentencepiece:   spm.model       tokenizer.json           tokenizer_config.json
    byte-level-bpe:  tokenizer.json  vocab.json  merges.txt   tokenizer_config.json

``tokenizer_config.json`` holds ``kind``, ``lowercase`` and the special token strings, plus the
keys ``transformers`` reads (a ``BertTokenizer`` for WordPiece, a ``PreTrainedTokenizerFast`` on
tokenizer.json for byte-level BPE and SentencePiece), so every folder we write loads there with the
same ids. A SentencePiece folder's tokenizer.json is written from spm.model (``_sentencepiece_as_hf``)
and only read by transformers: we read spm.model.
"""

from __future__ import annotations

import heapq
import io
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import sentencepiece as spm
from tokenizers import Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

TrainKind = Literal["wordpiece", "sentencepiece-unigram", "sentencepiece-bpe", "byte-level-bpe"]
# Kinds ``load_tokenizer`` can also return for Hugging Face folders whose model is not WordPiece
# (RoBERTa/GPT-2 byte-level BPE, T5-style unigram).
Kind = Literal["wordpiece", "sentencepiece-unigram", "sentencepiece-bpe", "byte-level-bpe", "hf-bpe", "hf-unigram"]

ROLES = ("pad", "unk", "cls", "sep", "mask")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0..4 in every tokenizer we train
# An end-of-text token: GPT-2's only special token (it stands in for the others in GPT inputs,
# ``pipelines.finetune``). Optional, never written by our training.
EXTRA_ROLES = ("eos",)
# Token strings tried, in order, for each role of a folder we did not write (BERT, RoBERTa, GPT-2).
_ALIASES = {
    "pad": ("[PAD]", "<pad>"),
    "unk": ("[UNK]", "<unk>", "<|endoftext|>"),  # GPT-2's tokenizer names <|endoftext|> its unk token
    "cls": ("[CLS]", "<s>"),
    "sep": ("[SEP]", "</s>"),
    "mask": ("[MASK]", "<mask>"),
    "eos": ("<|endoftext|>",),
}
# Roles whose place the end-of-text token takes in rows and prompts of a tokenizer without them.
_STAND_IN_FOR = ("cls", "sep", "pad")
_SPM_FILE, _HF_FILE, _VOCAB_FILE, _CONFIG_FILE = "spm.model", "tokenizer.json", "vocab.txt", "tokenizer_config.json"
_BPE_VOCAB_FILE, _BPE_MERGES_FILE = "vocab.json", "merges.txt"  # GPT-2's files
_MAX_CHARS_PER_WORD = 100  # BERT's WordpieceTokenizer: longer words become [UNK]
_SPM_THREADS = 8  # fixed (see train_tokenizer): the same model whatever the machine's core count
_SPM_MAX_SENTENCES = 2_000_000  # reservoir sample for SentencePiece training: bounds memory on big corpora


def _skip_space(text: str, span: tuple[int, int]) -> tuple[int, int]:
    """A token span without the whitespace it starts with."""
    start, end = span
    while start < end and text[start].isspace():
        start += 1
    return start, end


class MissingSpecialToken(ValueError):
    """A caller needs a special token (say [MASK]) that the tokenizer does not have."""


class _HFBackend:
    """A Hugging Face ``tokenizers.Tokenizer`` (Rust): WordPiece, or BPE/unigram from tokenizer.json."""

    def __init__(self, tok: HFTokenizer):
        # HF folders may ship fixed padding/truncation (MiniLM pads to 128): we want raw sequences.
        tok.no_padding()
        tok.no_truncation()
        self.tok = tok
        self.model_type = type(tok.model).__name__  # "WordPiece", "BPE", "Unigram"

    def tokens(self) -> list[str]:
        out = [""] * self.tok.get_vocab_size(with_added_tokens=True)
        for token, i in self.tok.get_vocab(with_added_tokens=True).items():
            out[i] = token
        return out

    def word_start(self, tokens: list[str]) -> np.ndarray:
        if self.model_type == "WordPiece":
            prefix = self.tok.model.continuing_subword_prefix
            return np.fromiter((not t.startswith(prefix) for t in tokens), dtype=np.bool_, count=len(tokens))
        # Byte-level BPE marks a preceding space with "Ġ", Metaspace models with "▁".
        return np.fromiter((t.startswith(("Ġ", "▁")) for t in tokens), dtype=np.bool_, count=len(tokens))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def encode_ids(self, texts: list[str]) -> list[np.ndarray]:
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # _fast skips offsets (tokenizers>=0.20)
        return [np.asarray(e.ids, dtype=np.int32) for e in encode(texts, add_special_tokens=False)]

    def encode_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]], list[str]]]:
        # tokenizers reports offsets in characters of the original (un-normalised) string.
        encodings = self.tok.encode_batch(texts, add_special_tokens=False)
        if self.model_type == "WordPiece":  # the pre-tokenizer already dropped whitespace
            return [(e.ids, e.offsets, e.tokens) for e in encodings]
        # "Ġbank" / "▁bank" spans start at the space they encode; drop it, as SentencePiece below.
        return [(e.ids, [_skip_space(text, span) for span in e.offsets], e.tokens) for text, e in zip(texts, encodings)]

    def save(self, folder: Path, tokens: list[str]) -> None:
        self.tok.save(str(folder / _HF_FILE))
        if self.model_type == "WordPiece":
            (folder / _VOCAB_FILE).write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
        elif self.model_type == "BPE":  # GPT-2's vocab.json + merges.txt, for readers without tokenizer.json
            self.tok.model.save(str(folder))


class _SPBackend:
    """A SentencePiece model (C++)."""

    def __init__(self, model_proto: bytes):
        self.model_proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)

    def tokens(self) -> list[str]:
        return [self.sp.id_to_piece(i) for i in range(self.sp.get_piece_size())]

    def word_start(self, tokens: list[str]) -> np.ndarray:
        # Byte-fallback pieces (<0xE6>) continue whatever precedes them; a word opens with "▁...".
        return np.fromiter((t.startswith("▁") for t in tokens), dtype=np.bool_, count=len(tokens))

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def encode_ids(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int32) for ids in self.sp.encode(texts, out_type=int)]

    def encode_offsets(self, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]], list[str]]]:
        # SentencePiece maps each piece back to a character span of the input (through its
        # normaliser); the span of a "▁" piece starts at the whitespace it stands for, which we drop so
        # that text[start:end] is the word itself. Of a character split into byte pieces, the last
        # byte piece carries the character's span and the others are empty.
        out = []
        for text, enc in zip(texts, self.sp.encode(texts, out_type="offset_mapping", return_bytes=False)):
            out.append((enc["ids"], [_skip_space(text, span) for span in enc["offsets"]], enc["pieces"]))
        return out

    # Explicit pickling (Ray ships tokenizers to actors): the serialized model is the whole state.
    def __getstate__(self) -> bytes:
        return self.model_proto

    def __setstate__(self, model_proto: bytes) -> None:
        self.__init__(model_proto)

    def save(self, folder: Path, tokens: list[str]) -> None:
        (folder / _SPM_FILE).write_bytes(self.model_proto)
        # The same tokenizer for transformers (AutoTokenizer reads tokenizer.json); we read spm.model.
        if set(SPECIAL_TOKENS) <= set(tokens):  # ours always; a model without them has no [CLS] a [SEP]
            _sentencepiece_as_hf(self.model_proto).save(str(folder / _HF_FILE))


def _sentencepiece_as_hf(model_proto: bytes) -> HFTokenizer:
    """A SentencePiece model as a ``tokenizers`` pipeline that gives the same ids, so an exported
    folder loads in ``transformers.AutoTokenizer`` (transformers' ``SpmConverter`` builds the same):
    the model's precompiled normalisation (``nmt_nfkc``/``nmt_nfkc_cf``), then SentencePiece's
    whitespace rule (ends stripped, runs of spaces to one), ``▁`` before every word, the unigram
    pieces with their scores or the BPE pieces with merges ranked by the merged piece's id, UTF-8
    byte fallback; [CLS] a [SEP] around the pieces. One difference: there the special tokens' own
    strings in a text ("[MASK]") are read as those tokens, as transformers users expect of a mask
    token; our SentencePiece encoder never makes them from text."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto)
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    pieces = [(p.piece, p.score) for p in proto.pieces]
    if trainer.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
        model = models.Unigram(pieces, unk_id=trainer.unk_id, byte_fallback=trainer.byte_fallback)
    elif trainer.model_type == sentencepiece_model_pb2.TrainerSpec.BPE:
        ids = {piece: i for i, (piece, _) in enumerate(pieces)}
        # Every split of a piece into two pieces is a merge, ranked by the id of the piece it makes
        # (SentencePiece numbers BPE pieces in the order their merges were learned).
        merges = sorted(((piece[:k], piece[k:], i) for piece, i in ids.items() for k in range(1, len(piece))
                         if piece[:k] in ids and piece[k:] in ids), key=lambda m: (m[2], ids[m[0]], ids[m[1]]))
        model = models.BPE(ids, [(a, b) for a, b, _ in merges], unk_token=pieces[trainer.unk_id][0],
                           byte_fallback=trainer.byte_fallback, fuse_unk=True)
    else:
        raise ValueError(f"SentencePiece model type {trainer.model_type} has no tokenizers equivalent here (unigram or BPE)")
    tok = HFTokenizer(model)
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always" if spec.add_dummy_prefix else "never")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = _bert_template(tok, "[CLS]", "[SEP]")
    return tok


class Tokenizer:
    """A trained or loaded tokenizer: special ids, word starts, batch encoding, save.

    Build one with ``train_tokenizer`` or ``load_tokenizer``. Attributes:
      kind, lowercase, vocab_size, source (the folder it was loaded from, or "<memory>");
      pad_id, unk_id, cls_id, sep_id, mask_id, eos_id: the special ids; reading one the tokenizer
      lacks raises ``MissingSpecialToken`` naming the token and the folder (``special_id(role)``
      gives None instead);
      special_tokens: {role: token string} of the roles present; special_ids: int64 array of their
      ids (role order, each once);
      word_start: bool array (vocab_size,): True where a token begins a word (not "##..." for
      WordPiece; "▁..." for SentencePiece; "Ġ..." for byte-level BPE; every special token), for
      whole-word and span masking.
    """

    def __init__(
        self,
        backend: _HFBackend | _SPBackend,
        kind: Kind,
        lowercase: bool,
        special_tokens: dict[str, str],
        source: str = "<memory>",
        looked_for: dict[str, list[str]] | None = None,
    ):
        if kind not in get_args(Kind):
            raise ValueError(f"{source}: unknown tokenizer kind {kind!r}; expected one of {get_args(Kind)}")
        self._backend = backend
        self.kind = kind
        self.lowercase = bool(lowercase)
        self.source = source
        self._tokens = backend.tokens()
        self._ids = {t: i for i, t in enumerate(self._tokens) if t}
        self.vocab_size = len(self._tokens)
        unknown = set(special_tokens) - set(ROLES + EXTRA_ROLES)
        if unknown:
            raise ValueError(f"{source}: unknown special token roles {sorted(unknown)}; expected some of {ROLES + EXTRA_ROLES}")
        self.special_tokens = {r: special_tokens[r] for r in ROLES + EXTRA_ROLES if special_tokens.get(r)}
        self._looked_for = {r: list(looked_for.get(r, ())) if looked_for else [] for r in ROLES + EXTRA_ROLES}
        self._special = {}
        for role, token in self.special_tokens.items():
            if token not in self._ids:
                raise ValueError(f"{source}: the {role} token {token!r} is not in the vocabulary")
            self._special[role] = self._ids[token]
        self.special_ids = np.array(list(dict.fromkeys(self._special.values())), dtype=np.int64)
        self.word_start = backend.word_start(self._tokens)
        self.word_start[self.special_ids] = True

    def special_id(self, role: str) -> int | None:
        """The id of the ``role`` token ("pad", "unk", "cls", "sep", "mask", "eos"), None if there is none."""
        if role not in ROLES + EXTRA_ROLES:
            raise ValueError(f"unknown special token role {role!r}; expected one of {ROLES + EXTRA_ROLES}")
        return self._special.get(role)

    def require(self, role: str, why: str = "") -> int:
        """The id of the ``role`` token; ``MissingSpecialToken`` naming it, the folder and ``why`` if there is none."""
        found = self.special_id(role)
        if found is None:
            tried = ", ".join(repr(t) for t in self._looked_for[role] or _ALIASES[role])
            raise MissingSpecialToken(
                f"{self.source}: the tokenizer has no {role} token (looked for {tried}){'; ' + why if why else ''}. "
                f"Use a tokenizer that has one, or name a token of its vocabulary as '{role}_token' in {self.source}/{_CONFIG_FILE}"
            )
        return found

    def row_id(self, role: str, why: str = "") -> int:
        """The id that pretraining rows and generation prompts put in ``role``'s place: the role's
        own token, else, for "cls", "sep" and "pad", the end-of-text token of a GPT-2 tokenizer (its
        only special token: GPT-2 put it between documents and opens unconditional samples with it).
        ``MissingSpecialToken`` naming the role (and ``why``) when there is neither."""
        found = self.special_id(role)
        if found is None and role in _STAND_IN_FOR:
            found = self.special_id("eos")
        return found if found is not None else self.require(role, why)

    pad_id = property(lambda self: self.require("pad"))
    unk_id = property(lambda self: self.require("unk"))
    cls_id = property(lambda self: self.require("cls"))
    sep_id = property(lambda self: self.require("sep"))
    mask_id = property(lambda self: self.require("mask"))
    eos_id = property(lambda self: self.require("eos"))

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, lowercase={self.lowercase})"

    def id_to_token(self, i: int) -> str:
        return self._tokens[i]

    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (a vocabulary entry such as "##ing" or "▁bank"), None if absent."""
        return self._ids.get(token)

    def decode(self, ids: list[int] | np.ndarray, skip_special: bool = True) -> str:
        """The text of token ids, special tokens dropped (``skip_special``; else left to the decoder,
        which writes them as their token strings, but SentencePiece's control symbols as nothing),
        through the tokenizer's own decoder (WordPiece joins "##" pieces; byte-level
        BPE and SentencePiece restore spaces and bytes). Byte-level BPE keeps the space its
        pre-tokenizer puts before a word, also before the first one (" bank"), as GPT-2's tokenizer
        does: what a generated continuation needs."""
        special = set(self.special_ids.tolist()) if skip_special else set()
        return self._backend.decode([int(i) for i in ids if int(i) not in special])

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids (int32) of each text, without special tokens; encoded in one native batch call."""
        return self._backend.encode_ids(list(texts))

    def encode_for_model(self, texts: list[str], max_len: int) -> tuple[list[list[int]], list[list[tuple[int, int]]], list[list[str]]]:
        """``[CLS] tokens [SEP]`` per text, truncated to ``max_len`` ids, with character offsets.

        Returns (ids, offsets, tokens): offsets are (start, end) into the original text, so
        ``text[start:end]`` is the token's surface form; (0, 0) for [CLS] and [SEP]. Tokens are the
        vocabulary strings ("##ing", "▁bank", "<0xE6>"). A tokenizer without [CLS]/[SEP]-like tokens
        (GPT-2's, whose only special token is <|endoftext|>) gives the tokens alone, as
        transformers' GPT2Tokenizer does.
        """
        cls_id, sep_id = self.special_id("cls"), self.special_id("sep")
        plain = not self.wraps_with_cls_sep
        if max_len < (1 if plain else 2):
            raise ValueError(f"max_len={max_len}: need at least {1 if plain else 2} (special tokens included)")
        keep = max_len if plain else max_len - 2
        all_ids, all_offsets, all_tokens = [], [], []
        for ids, offsets, tokens in self._backend.encode_offsets(list(texts)):
            if plain:
                all_ids.append(list(ids[:keep]))
                all_offsets.append(list(offsets[:keep]))
                all_tokens.append(list(tokens[:keep]))
                continue
            cls, sep = self.special_tokens["cls"], self.special_tokens["sep"]
            all_ids.append([cls_id, *ids[:keep], sep_id])
            all_offsets.append([(0, 0), *offsets[:keep], (0, 0)])
            all_tokens.append([cls, *tokens[:keep], sep])
        return all_ids, all_offsets, all_tokens

    def ids_for_model(self, texts: list[str], max_len: int) -> list[np.ndarray]:
        """The ids of ``encode_for_model`` alone, int64 per text, without building offsets and token
        strings: what sentence vectors need (the tokenizers backend's ``encode_batch_fast``)."""
        cls_id, sep_id = self.special_id("cls"), self.special_id("sep")
        plain = not self.wraps_with_cls_sep
        if max_len < (1 if plain else 2):
            raise ValueError(f"max_len={max_len}: need at least {1 if plain else 2} (special tokens included)")
        keep = max_len if plain else max_len - 2
        rows = self._backend.encode_ids(list(texts))
        if plain:
            return [row[:keep].astype(np.int64) for row in rows]
        out = []
        for row in rows:
            ids = np.empty(min(len(row), keep) + 2, dtype=np.int64)  # (T_i,) [CLS] tokens [SEP]
            ids[0], ids[-1] = cls_id, sep_id
            ids[1:-1] = row[:keep]
            out.append(ids)
        return out

    @property
    def wraps_with_cls_sep(self) -> bool:
        """Whether ``encode_for_model`` puts [CLS] and [SEP] around the tokens (False: GPT-2-style)."""
        return self.special_id("cls") is not None and self.special_id("sep") is not None

    @property
    def padding_id(self) -> int:
        """What padding positions hold: [PAD], else the end-of-text token (GPT-2), else 0. The
        attention mask hides them, so any id of the vocabulary serves."""
        for role in ("pad", "eos"):
            found = self.special_id(role)
            if found is not None:
                return found
        return 0

    def save(self, local_dir: str | os.PathLike) -> None:
        """Write the tokenizer files into ``local_dir`` (created if needed); see the module doc."""
        folder = Path(local_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self._backend.save(folder, self._tokens)
        config: dict = {"kind": self.kind, "lowercase": self.lowercase}
        config.update({f"{role}_token": token for role, token in self.special_tokens.items()})
        if self.kind == "wordpiece":
            # What transformers' BertTokenizer reads, so AutoTokenizer.from_pretrained(folder) works.
            config.update(tokenizer_class="BertTokenizer", do_lower_case=self.lowercase, strip_accents=None, tokenize_chinese_chars=True)
        elif self.kind == "byte-level-bpe":
            # tokenizer.json holds the whole pipeline ([CLS] a [SEP] added by its post-processor).
            config.update(tokenizer_class="PreTrainedTokenizerFast")
        else:  # SentencePiece (ALBERT, XLNet): segment ids too, as their transformers tokenizers give
            config.update(tokenizer_class="PreTrainedTokenizerFast", model_input_names=["input_ids", "token_type_ids", "attention_mask"])
        (folder / _CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------- training


def _lines(texts: Iterable[str]) -> Iterator[str]:
    """Non-empty lines of the texts: documents may come whole, SentencePiece wants sentences."""
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line


def _bert_template(tok: HFTokenizer, cls: str, sep: str) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
    )


def _bert_pipeline(tok: HFTokenizer, lowercase: bool, strip_accents: bool | None = None, chinese_chars: bool = True) -> HFTokenizer:
    """BERT's normaliser, pre-tokenizer and decoder on a WordPiece model (strip_accents None: = lowercase)."""
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=chinese_chars, strip_accents=strip_accents, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    return tok


_WORDPIECE_ALPHABET = 1000  # characters kept (most frequent), as BERT's and HF's BertWordPieceTokenizer


def _wordpiece_tokenizer(vocab: dict[str, int], lowercase: bool) -> HFTokenizer:
    tok = HFTokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", continuing_subword_prefix="##", max_input_chars_per_word=_MAX_CHARS_PER_WORD))
    _bert_pipeline(tok, lowercase, strip_accents=lowercase)
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # never split from text
    tok.post_processor = _bert_template(tok, "[CLS]", "[SEP]")
    return tok


def _train_wordpiece(lines: list[str], vocab_size: int, lowercase: bool) -> HFTokenizer:
    """A WordPiece vocabulary learned by BPE merges, reproducibly.

    Word pieces are what BPE merges build within words (Sennrich et al. 2016; HF's
    ``WordPieceTrainer`` is a BPE trainer too). ``tokenizers``' trainer breaks ties between equally
    frequent merges by hash-map order, which changes from process to process, so two runs on the
    same text can keep different pieces. Here SentencePiece's BPE trainer (deterministic for a
    fixed thread count) learns the merges from the text as BERT's normaliser and pre-tokenizer
    see it (words split at whitespace and punctuation, so no piece crosses a word boundary);
    word-initial pieces become ``piece``, inner ones ``##piece``. The 1000 most frequent
    characters (ties by the character) are kept in both forms so every word of them encodes;
    rarer ones become [UNK]. Ids follow a rule: the special tokens (0..4), then every piece by its
    frequency in the training text as the final tokenizer encodes it, most frequent first, ties by
    the string.
    """
    base = _bert_pipeline(HFTokenizer(models.WordPiece(vocab={"[UNK]": 0}, unk_token="[UNK]")), lowercase, strip_accents=lowercase)
    words_per_line = [[w for w, _ in base.pre_tokenizer.pre_tokenize_str(base.normalizer.normalize_str(line))] for line in lines]
    chars: dict[str, int] = {}
    for words in words_per_line:
        for w in words:
            for ch in w:
                chars[ch] = chars.get(ch, 0) + 1
    alphabet = sorted(chars, key=lambda ch: (-chars[ch], ch))[:_WORDPIECE_ALPHABET]
    fixed = [*SPECIAL_TOKENS, *alphabet, *("##" + ch for ch in alphabet)]
    pieces: list[str] = []
    budget = vocab_size - len(fixed)
    if budget > 0:
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter([" ".join(words) for words in words_per_line if words]),
            # SentencePiece's vocabulary also holds every character, alone and word-initial: those
            # duplicate `fixed`, so ask for that many more pieces and cut at vocab_size below.
            model_writer=model, model_type="bpe", vocab_size=budget + 3 + 2 * len(chars) + 1, hard_vocab_limit=False,
            normalization_rule_name="identity", character_coverage=1.0, split_digits=False,
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, input_sentence_size=_SPM_MAX_SENTENCES,
            shuffle_input_sentence=True, num_threads=_SPM_THREADS, minloglevel=2,
        )
        sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
        seen = set(fixed)
        for i in range(sp.get_piece_size()):
            if sp.is_unknown(i) or sp.is_control(i):
                continue
            piece = sp.id_to_piece(i)
            token = piece[1:] if piece.startswith("▁") else "##" + piece
            if token and token != "##" and token not in seen:
                seen.add(token)
                pieces.append(token)
    vocab = {t: i for i, t in enumerate([*fixed, *pieces][:vocab_size])}
    tok = _wordpiece_tokenizer(vocab, lowercase)
    counts = np.zeros(len(vocab), dtype=np.int64)
    for start in range(0, len(lines), 10_000):
        for e in tok.encode_batch(lines[start : start + 10_000], add_special_tokens=False):
            np.add.at(counts, np.asarray(e.ids, dtype=np.int64), 1)
    rest = sorted((t for t in vocab if t not in SPECIAL_TOKENS), key=lambda t: (-int(counts[vocab[t]]), t))
    return _wordpiece_tokenizer({t: i for i, t in enumerate([*SPECIAL_TOKENS, *rest])}, lowercase)


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order (openai/gpt-2 ``bytes_to_unicode``).

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, ...) take the
    characters from U+0100 on, in byte order (space, 0x20, becomes "Ġ"). The ``tokenizers``
    ByteLevel pre-tokenizer maps bytes the same way.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    out, n_other = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + n_other))
            n_other += 1
    return out


_MIN_PAIR_COUNT = 2  # a pair seen once is not worth a token: training stops there, below vocab_size


def _learn_merges(word_counts: dict[str, int], symbols: list[str], n_new: int) -> list[tuple[str, str]]:
    """BPE merges (Sennrich et al. 2016) learned from ``word_counts``, in order, until they have made
    ``n_new`` new tokens.

    Words are strings of the base ``symbols`` (one character each). Each step merges, in every word,
    the adjacent pair of symbols seen most often (counted over words times their counts; an
    overlapping "a a a" counts "a a" twice), left to right; ties go to the smallest (left, right)
    pair of token strings, so the result never depends on hash or thread order. Stops early when no
    pair is seen ``_MIN_PAIR_COUNT`` times. Should a merge remake a token an earlier one made
    ("ab"+"c" after "a"+"bc"), both stay merge rules and the token counts once.

    Incremental: pair counts and the words holding each pair are kept up to date, and only the
    words holding the merged pair are rewritten; a heap ordered by (-count, left, right) finds the
    best pair (entries whose count has changed since they were pushed are skipped).
    """
    names = list(symbols)  # symbol id -> token string
    index = {t: i for i, t in enumerate(names)}
    words = [[index[ch] for ch in w] for w in word_counts]  # (U,) symbol ids of each distinct word
    counts = list(word_counts.values())
    pair_count: dict[tuple[int, int], int] = {}
    holders: dict[tuple[int, int], set[int]] = {}  # pair -> words that held it (a superset: stale ones skipped)
    for w, (word, c) in enumerate(zip(words, counts)):
        for pair in zip(word, word[1:]):
            pair_count[pair] = pair_count.get(pair, 0) + c
            holders.setdefault(pair, set()).add(w)
    heap = [(-c, names[a], names[b], a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    made = 0  # new tokens: a merge may remake an existing one
    while heap and made < n_new:
        neg, _, _, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -neg:
            continue  # stale: the pair's count changed since this entry was pushed
        if -neg < _MIN_PAIR_COUNT:
            break
        merges.append((names[a], names[b]))
        token = names[a] + names[b]
        new = index.get(token)
        if new is None:
            new = index[token] = len(names)
            names.append(token)
            made += 1
        delta: dict[tuple[int, int], int] = {}
        for w in holders.pop((a, b)):
            old, c = words[w], counts[w]
            merged, i = [], 0
            while i < len(old):
                if i + 1 < len(old) and old[i] == a and old[i + 1] == b:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(old[i])
                    i += 1
            if len(merged) == len(old):
                continue  # a stale holder: the pair left this word in an earlier merge
            for pair in zip(old, old[1:]):
                delta[pair] = delta.get(pair, 0) - c
            for pair in zip(merged, merged[1:]):
                delta[pair] = delta.get(pair, 0) + c
                holders.setdefault(pair, set()).add(w)
            words[w] = merged
        for pair, d in delta.items():
            if d:
                c = pair_count[pair] = pair_count.get(pair, 0) + d
                if c > 0:
                    heapq.heappush(heap, (-c, names[pair[0]], names[pair[1]], *pair))
                else:
                    pair_count.pop(pair)
                    holders.pop(pair, None)
    return merges


def _byte_level_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]], lowercase: bool) -> HFTokenizer:
    """GPT-2's byte-level BPE pipeline on ``vocab`` + ``merges``, with RoBERTa's ``[CLS] a [SEP]`` template."""
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # never split from text
    # trim_offsets: a "Ġword" token's span starts at the word, not at the space before it.
    tok.post_processor = processors.RobertaProcessing(("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"]), trim_offsets=True, add_prefix_space=True)
    return tok


def _train_byte_level_bpe(lines: Iterable[str], vocab_size: int, lowercase: bool) -> HFTokenizer:
    """Byte-level BPE (GPT-2 / RoBERTa) learned reproducibly; ids by the rule in the module doc.

    ``tokenizers``' ``BpeTrainer`` is not used: it numbers the 256 byte symbols by their characters'
    code points rather than by byte and breaks ties between equally frequent pairs by those ids;
    we want a rule that does not depend on its internals (version to version) nor on thread count.
    """
    symbols = _byte_symbols()
    base = len(SPECIAL_TOKENS) + len(symbols)
    if vocab_size < base:
        raise ValueError(f"byte-level-bpe: vocab_size={vocab_size} is below the {base} base tokens (5 special + 256 bytes)")
    normalizer = normalizers.Lowercase() if lowercase else None
    pre = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    word_counts: dict[str, int] = {}
    for line in lines:
        text = normalizer.normalize_str(line) if normalizer is not None else line
        for word, _ in pre.pre_tokenize_str(text):
            word_counts[word] = word_counts.get(word, 0) + 1
    merges = _learn_merges(word_counts, symbols, vocab_size - base)
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *symbols])}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return _byte_level_tokenizer(vocab, merges, lowercase)


def train_tokenizer(kind: TrainKind, texts: Iterable[str], vocab_size: int, lowercase: bool = True) -> Tokenizer:
    """Train a tokenizer of ``kind`` on ``texts`` (lines or whole documents), special ids 0..4.

    SentencePiece may stop below ``vocab_size`` on a small corpus (``hard_vocab_limit=False``), and
    byte-level BPE when no pair of tokens is seen twice any more; byte-level BPE needs ``vocab_size``
    of at least 261 (5 special tokens and the 256 bytes).
    """
    specials = dict(zip(ROLES, SPECIAL_TOKENS))
    if kind == "wordpiece":
        return Tokenizer(_HFBackend(_train_wordpiece(list(_lines(texts)), vocab_size, lowercase)), kind, lowercase, specials)
    if kind == "byte-level-bpe":
        return Tokenizer(_HFBackend(_train_byte_level_bpe(_lines(texts), vocab_size, lowercase)), kind, lowercase, specials)
    if kind in ("sentencepiece-unigram", "sentencepiece-bpe"):
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=_lines(texts),
            model_writer=model,
            model_type=kind.removeprefix("sentencepiece-"),
            vocab_size=vocab_size,
            hard_vocab_limit=False,
            byte_fallback=True,  # unseen characters become UTF-8 byte pieces, never [UNK]
            character_coverage=0.9995,
            # nmt_nfkc + case folding: the same lowercasing at training and at encoding time.
            normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
            pad_id=0, pad_piece="[PAD]",
            unk_id=1, unk_piece="[UNK]",
            bos_id=-1, eos_id=-1,
            # Control symbols take the next ids (2, 3, 4) and are never produced from raw text.
            control_symbols=list(SPECIAL_TOKENS[2:]),
            input_sentence_size=_SPM_MAX_SENTENCES,
            shuffle_input_sentence=True,
            # SentencePiece splits its work into num_threads chunks and the result depends on the
            # split (float sums in another order): a fixed count, not the machine's, keeps training
            # reproducible on any machine (taskset or a container's CPU share change nothing).
            num_threads=_SPM_THREADS,
            minloglevel=2,
        )
        return Tokenizer(_SPBackend(model.getvalue()), kind, lowercase, specials)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {get_args(TrainKind)}")


# ----------------------------------------------------------------------------------------- loading


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _token_string(value) -> str | None:
    """A special token as tokenizer_config / special_tokens_map write it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _resolve_specials(config: dict, has_token) -> tuple[dict[str, str], dict[str, list[str]]]:
    """({role: token string} of the roles found, {role: the candidates looked for}).

    A role's token is the folder's configured one (``{role}_token``) if it is in the vocabulary, else
    the first alias that is; a role with neither is left out: a folder needs only the special
    tokens its model uses (GPT-2's has none but ``<|endoftext|>``), and ``Tokenizer`` names a missing
    one when a caller asks for it. Our own folders (``kind`` in the config) name every special
    token they have, so no alias is tried there: a byte-level BPE token that happens to read
    "<|endoftext|>" stays an ordinary token.
    """
    ours = "kind" in config
    found, looked_for = {}, {}
    for role in ROLES + EXTRA_ROLES:
        configured = [t for t in (_token_string(config.get(f"{role}_token")),) if t]
        candidates = configured if ours else list(dict.fromkeys(configured + list(_ALIASES[role])))
        looked_for[role] = candidates
        token = next((t for t in candidates if has_token(t)), None)
        if token is not None:
            found[role] = token
    return found, looked_for


def _normalizer_lowercases(tok_json: dict) -> bool:
    """Whether a tokenizer.json normaliser lowercases (BertNormalizer or a Lowercase step)."""
    norm = tok_json.get("normalizer") or {}
    steps = norm.get("normalizers", [norm]) if norm.get("type") == "Sequence" else [norm]
    return any(s.get("type") == "Lowercase" or (s.get("type") == "BertNormalizer" and s.get("lowercase")) for s in steps)


def _wordpiece_from_vocab(vocab_file: Path, config: dict, folder: Path) -> HFTokenizer:
    """A BERT tokenizer from a bare vocab.txt (one token per line, line number = id), as BertTokenizer builds it."""
    vocab: dict[str, int] = {}
    with open(vocab_file, encoding="utf-8") as f:
        for i, line in enumerate(f):
            vocab[line.rstrip("\n")] = i
    specials, looked_for = _resolve_specials(config, vocab.__contains__)
    if "unk" not in specials:  # WordPiece turns words it cannot split into the unk token: it needs one
        raise ValueError(f"{vocab_file}: no unk token in the vocabulary (looked for {looked_for['unk']}); WordPiece needs one: set 'unk_token' in {folder / _CONFIG_FILE}")
    tok = HFTokenizer(models.WordPiece(vocab, unk_token=specials["unk"], max_input_chars_per_word=_MAX_CHARS_PER_WORD))
    lowercase = bool(config.get("do_lower_case", config.get("lowercase", True)))
    _bert_pipeline(tok, lowercase, strip_accents=config.get("strip_accents"), chinese_chars=config.get("tokenize_chinese_chars", True))
    # As in BERT, special tokens written in the text are matched whole and never split or lowercased.
    tok.add_special_tokens(list(dict.fromkeys(specials.values())))
    if "cls" in specials and "sep" in specials:
        tok.post_processor = _bert_template(tok, specials["cls"], specials["sep"])
    return tok


def _byte_level_from_vocab(folder: Path, config: dict) -> HFTokenizer:
    """GPT-2's tokenizer from vocab.json + merges.txt, as transformers' GPT2Tokenizer builds it.

    No normaliser; the ByteLevel pre-tokenizer with the folder's ``add_prefix_space`` (GPT-2's
    default: False); the special tokens of the configuration matched whole in text.
    """
    if not (folder / _BPE_MERGES_FILE).is_file():
        raise FileNotFoundError(f"{folder}: {_BPE_VOCAB_FILE} without {_BPE_MERGES_FILE}; a GPT-2 style BPE folder needs both (or a {_HF_FILE})")
    try:
        bpe = models.BPE.from_file(str(folder / _BPE_VOCAB_FILE), str(folder / _BPE_MERGES_FILE), fuse_unk=False)
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{folder}: cannot read {_BPE_VOCAB_FILE} / {_BPE_MERGES_FILE} as a BPE model ({e})") from e
    tok = HFTokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space", False)), use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    specials, _ = _resolve_specials(config, lambda t: tok.token_to_id(t) is not None)
    tok.add_special_tokens(list(dict.fromkeys(specials.values())))
    return tok


def load_tokenizer(local_dir: str | os.PathLike) -> Tokenizer:
    """Load our tokenizer folder, a Hugging Face one (tokenizer.json, vocab.txt, or vocab.json + merges.txt),
    or a checkpoint's ``tokenizer/``."""
    folder = Path(local_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {folder} does not exist")
    names = {p.name for p in folder.iterdir()}
    if not names & {_SPM_FILE, _HF_FILE, _VOCAB_FILE, _BPE_VOCAB_FILE} and (folder / "tokenizer").is_dir():
        return load_tokenizer(folder / "tokenizer")
    config = _read_json(folder / _CONFIG_FILE)
    for key, value in _read_json(folder / "special_tokens_map.json").items():
        config.setdefault(key, value)
    source = str(folder)

    if _SPM_FILE in names:
        kind = config.get("kind")
        if kind not in ("sentencepiece-unigram", "sentencepiece-bpe"):
            raise ValueError(f"{folder}: {_SPM_FILE} needs {_CONFIG_FILE} with kind 'sentencepiece-unigram' or 'sentencepiece-bpe' (found kind={kind!r})")
        backend = _SPBackend((folder / _SPM_FILE).read_bytes())
        pieces = set(backend.tokens())
        specials, looked_for = _resolve_specials(config, pieces.__contains__)
        return Tokenizer(backend, kind, config.get("lowercase", True), specials, source, looked_for)

    if _HF_FILE in names:
        tok = HFTokenizer.from_file(str(folder / _HF_FILE))
        tok_json = _read_json(folder / _HF_FILE)
        lowercase = config.get("lowercase", config.get("do_lower_case", _normalizer_lowercases(tok_json)))
        backend = _HFBackend(tok)
        kind = {"WordPiece": "wordpiece", "BPE": "hf-bpe", "Unigram": "hf-unigram"}.get(backend.model_type)
        if kind is None:
            raise ValueError(f"{folder / _HF_FILE}: model type {backend.model_type} is not supported (WordPiece, BPE or Unigram)")
        if kind == "hf-bpe" and config.get("kind") == "byte-level-bpe":  # one we trained
            kind = "byte-level-bpe"
        specials, looked_for = _resolve_specials(config, lambda t: tok.token_to_id(t) is not None)
        return Tokenizer(backend, kind, lowercase, specials, source, looked_for)

    if _VOCAB_FILE in names:
        tok = _wordpiece_from_vocab(folder / _VOCAB_FILE, config, folder)
        specials, looked_for = _resolve_specials(config, lambda t: tok.token_to_id(t) is not None)
        return Tokenizer(_HFBackend(tok), "wordpiece", config.get("do_lower_case", config.get("lowercase", True)), specials, source, looked_for)

    if _BPE_VOCAB_FILE in names:
        tok = _byte_level_from_vocab(folder, config)
        specials, looked_for = _resolve_specials(config, lambda t: tok.token_to_id(t) is not None)
        return Tokenizer(_HFBackend(tok), "hf-bpe", config.get("lowercase", config.get("do_lower_case", False)), specials, source, looked_for)

    found = ", ".join(sorted(names)) or "nothing"
    raise FileNotFoundError(
        f"no tokenizer in {folder}: expected {_SPM_FILE} (+{_CONFIG_FILE}), {_HF_FILE}, {_VOCAB_FILE} or {_BPE_VOCAB_FILE} + {_BPE_MERGES_FILE}; found {found}"
    )
