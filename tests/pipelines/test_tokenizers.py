"""Tokenizers (pipelines/tokenizers.py) and the WordNet sample corpus (data/).

Parity: our loader on the real all-MiniLM-L6-v2 folder must give the ids of transformers' pure-Python
``BertTokenizerLegacy`` and of its tokenizers-backed ``BertTokenizer`` / ``AutoTokenizer``.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import pickle
import re
import shutil
import sys
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from pipelines.tokenizers import SPECIAL_TOKENS, MissingSpecialToken, _byte_symbols, Tokenizer, load_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "sample"
KINDS = ("wordpiece", "sentencepiece-unigram", "sentencepiece-bpe", "byte-level-bpe")

HARD_CASES = [
    "",
    "   ",
    "Café naïve résumé Ångström façade Über ÉCOLE",
    "e\u0301 combining acute, o\u0308 umlaut",
    "東京は日本の首都です。中文字符测试，标点！",
    "한국어 문장 and ภาษาไทย mixed with English",
    "Ελληνικά Русский العربية हिन्दी עברית",
    "Hello!!! What??? ... --- ,,, ;;; (((nested))) [[brackets]] {{braces}}",
    "Numbers 3.14159 1,000,000 42nd 1e-10 0x1F 007 -273.15°C",
    "emoji 😀👍🏽 flags 🇫🇷 family 👨‍👩‍👧 heart ❤️",
    "control\x00chars\x07here \x1b[31m ansi",
    "zero\u200bwidth \ufeffbom soft\u00adhyphen line\u2028sep",
    "tab\there newline\nthere carriage\r\nreturn",
    "MiXeD CaSe WoRdS iPhone McDonald's NASA's eBay",
    "a" * 150,
    "pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
    "[MASK] in text [CLS] and [SEP] and [UNK] [PAD] [mask]",
    "don't can't won't ''quoted'' “smart quotes” ‘single’ — em dash – en dash …",
    "ﬁ ligature, full-width ＡＢＣ１２３, circled ① ② ③",
    "https://example.com/path?x=1&y=2#frag user@example.org @handle #hashtag",
    "$100 €50 ¥1000 £5 ½ ¾ x² + y² = z² ∑∫√∞≠≤",
    "The bank of the river flooded; the bank raised its interest rates.",
    "  leading and trailing spaces   ",
]


def read_shard(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().split("\n")


@pytest.fixture(scope="module")
def corpus_lines() -> list[str]:
    """Every sentence of the first shard (about 12k lines)."""
    return [line for line in read_shard(SAMPLE / "wordnet-0000-of-0008.txt.gz") if line]


# ------------------------------------------------------------------------------------ corpus


def test_corpus_shards_gunzip_and_are_bert_style_documents():
    paths = sorted(SAMPLE.glob("wordnet-*-of-0008.txt.gz"))
    assert [p.name for p in paths] == [f"wordnet-{k:04d}-of-0008.txt.gz" for k in range(8)]
    total_chars, total_docs = 0, 0
    for path in paths:
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
        total_chars += len(text)
        assert text.endswith("\n") and not text.endswith("\n\n"), path
        assert not text.startswith("\n"), path
        assert "\n\n\n" not in text, f"{path}: documents must be separated by exactly one blank line"
        docs = text.rstrip("\n").split("\n\n")
        total_docs += len(docs)
        sizes = np.array([len(d.split("\n")) for d in docs])
        assert sizes.min() >= 2 and np.median(sizes) >= 6, path  # NSP/SOP need several sentences per document
        for line in text.split("\n"):
            assert line == line.strip(), f"{path}: stray whitespace in {line!r}"
    assert 3_000_000 < total_chars < 6_000_000
    assert total_docs > 5000


def test_corpus_has_bank_in_river_and_finance_senses():
    lines = [line for p in sorted(SAMPLE.glob("*.txt.gz")) for line in read_shard(p)]
    bank = [line for line in lines if re.search(r"\bbanks?\b", line, re.IGNORECASE)]
    assert any(re.search(r"\b(river|water|canoe)\b", line) for line in bank)
    assert any(re.search(r"\b(money|deposits?|check|mortgage|financial)\b", line) for line in bank)
    assert "Bank is sloping land (especially the slope beside a body of water)." in lines
    assert "He cashed a check at the bank." in lines


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_sample", REPO / "data" / "build_sample.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_build_sample_is_deterministic_on_a_tiny_wordnet(tmp_path):
    """The builder on a hand-written 4-file WordNet: format, sentences, byte-identical rebuild."""
    build = _load_builder()
    wn = tmp_path / "wn"
    wn.mkdir()
    header = "  1 This software and database is being provided to you, the LICENSEE, by  \n"
    (wn / "data.noun").write_text(
        header
        + '09213565 17 n 01 bank 1 001 @ 09437454 n 0000 | sloping land (especially the slope beside a body of water); "they pulled the canoe up on the bank"  \n'
        + '08420278 17 n 02 depository_financial_institution 0 bank 0 000 | a financial institution that accepts deposits; "he cashed a check at the bank"  \n'
        + "09213434 17 n 01 ridge 0 000 | a long ridge or pile  \n"
        + '00169305 17 n 01 hit 0 000 | (baseball) a successful stroke; "he got a hit"  \n'
    )
    (wn / "data.verb").write_text(header + '01587723 35 v 01 bank 0 000 | tip laterally; "the pilot had to bank the aircraft"  \n')
    (wn / "data.adj").write_text(header + '00001740 00 a 01 able(a) 0 000 | having the necessary means or skill; "able to swim"  \n')
    (wn / "data.adv").write_text(header + '00001740 02 r 01 well 0 000 | in a good way; "she sings well"; "the children behaved well"  \n')
    docs = build.documents(build.read_synsets(wn))
    sentences = [s for d in docs for s in d]
    assert "Bank is sloping land (especially the slope beside a body of water)." in sentences
    assert "They pulled the canoe up on the bank." in sentences
    assert "Another word for it is bank." in sentences
    assert "In baseball, a hit is a successful stroke." in sentences
    assert "To bank is to tip laterally." in sentences
    assert "Able means having the necessary means or skill." in sentences
    assert not any("ridge" in s for s in sentences)  # no example sentence: left out
    out1, out2 = build.write_shards(docs, tmp_path / "a", 2), build.write_shards(docs, tmp_path / "b", 2)
    assert [p.read_bytes() for p in out1] == [p.read_bytes() for p in out2]
    text = "".join(gzip.decompress(p.read_bytes()).decode() for p in out1)
    assert text.count("\n\n") == len(docs) - 2  # blank line between documents inside each of the 2 shards


# ----------------------------------------------------------------------------- MiniLM parity


@pytest.fixture(scope="module")
def parity_texts() -> list[str]:
    """A few thousand sentences: every 40th corpus line across all shards, plus the hard cases."""
    lines = [line for p in sorted(SAMPLE.glob("*.txt.gz")) for line in read_shard(p) if line]
    return lines[::40] + HARD_CASES + [c.upper() for c in HARD_CASES] + [" ".join(HARD_CASES)]


def _reference_tokenizers(minilm_dir):
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    return {
        "BertTokenizerLegacy (pure Python)": BertTokenizerLegacy.from_pretrained(minilm_dir),
        "BertTokenizer (tokenizers)": transformers.BertTokenizer.from_pretrained(minilm_dir),
        "AutoTokenizer": transformers.AutoTokenizer.from_pretrained(minilm_dir),
    }


def _assert_parity(ours: Tokenizer, refs: dict, texts: list[str], max_len: int = 512):
    ids, _, tokens = ours.encode_for_model(texts, max_len)
    for name, ref in refs.items():
        expected = ref(texts, truncation=True, max_length=max_len)["input_ids"]
        bad = [i for i in range(len(texts)) if ids[i] != expected[i]]
        assert not bad, f"{name}: {len(bad)} of {len(texts)} differ, first {texts[bad[0]]!r}: ours {tokens[bad[0]]} vs {ref.convert_ids_to_tokens(expected[bad[0]])}"


def test_minilm_parity_with_transformers(minilm_dir, parity_texts):
    assert len(parity_texts) > 2000
    ours = load_tokenizer(minilm_dir)
    assert ours.kind == "wordpiece" and ours.vocab_size == 30522 and ours.lowercase
    assert (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id) == (0, 100, 101, 102, 103)
    refs = _reference_tokenizers(minilm_dir)
    _assert_parity(ours, refs, parity_texts)
    _assert_parity(ours, refs, parity_texts[:300] + HARD_CASES, max_len=8)  # truncation keeps [SEP]


def test_minilm_parity_from_vocab_txt_only(minilm_dir, parity_texts, tmp_path):
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, tmp_path / name)
    ours = load_tokenizer(tmp_path)
    assert ours.kind == "wordpiece" and ours.vocab_size == 30522
    assert (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id) == (0, 100, 101, 102, 103)
    _assert_parity(ours, _reference_tokenizers(minilm_dir), parity_texts)
    bare = tmp_path / "bare"  # vocab.txt alone: BERT defaults (lowercase, [PAD]... specials)
    bare.mkdir()
    shutil.copy(minilm_dir / "vocab.txt", bare / "vocab.txt")
    assert load_tokenizer(bare).encode_batch(parity_texts[:50])[7].tolist() == ours.encode_batch(parity_texts[:50])[7].tolist()


def test_minilm_word_start_and_offsets(minilm_dir):
    tok = load_tokenizer(minilm_dir)
    assert tok.word_start.shape == (30522,) and tok.word_start.dtype == np.bool_
    assert tok.word_start[tok.token_to_id("bank")] and not tok.word_start[tok.token_to_id("##ing")]
    assert tok.word_start[tok.special_ids].all() and tok.special_ids.dtype == np.int64
    text = "Héllo, Wörld! The BANKS"
    ids, offsets, tokens = tok.encode_for_model([text], 64)
    assert tokens[0] == ["[CLS]", "hello", ",", "world", "!", "the", "banks", "[SEP]"]
    assert [text[s:e] for s, e in offsets[0]] == ["", "Héllo", ",", "Wörld", "!", "The", "BANKS", ""]


# ------------------------------------------------------------------- trained tokenizers


@pytest.fixture(scope="module", params=KINDS)
def trained(request, corpus_lines) -> Tokenizer:
    return train_tokenizer(request.param, corpus_lines, vocab_size=2000)


def test_special_ids_are_0_to_4(trained):
    assert trained.special_ids.tolist() == [0, 1, 2, 3, 4]
    assert (trained.pad_id, trained.unk_id, trained.cls_id, trained.sep_id, trained.mask_id) == (0, 1, 2, 3, 4)
    assert [trained.id_to_token(i) for i in range(5)] == list(SPECIAL_TOKENS)
    assert 1000 < trained.vocab_size <= 2000 + 5
    if trained.kind == "wordpiece":  # the size asked for, as HF's trainer gives when the text has enough words
        assert trained.vocab_size == 2000
    assert trained.word_start.shape == (trained.vocab_size,) and trained.word_start[:5].all()


def test_word_start_known_tokens(trained):
    if trained.kind == "wordpiece":
        starts, inside = ["the", "bank", ",", "."], ["##s", "##ing", "##ed"]
    elif trained.kind == "byte-level-bpe":  # "Ġ" is the space before a word; bytes are tokens of their own
        starts, inside = ["Ġthe", "Ġbank", "Ġa"], ["s", "ing", "ed", ",", "A", "æ"]
    else:
        starts, inside = ["▁the", "▁bank", "▁a"], ["s", "ing", "<0x41>", "<0xE6>"]
    for token in starts:
        assert trained.token_to_id(token) is not None, token
        assert trained.word_start[trained.token_to_id(token)], token
    for token in inside:
        assert trained.token_to_id(token) is not None, token
        assert not trained.word_start[trained.token_to_id(token)], token
    assert trained.token_to_id("no-such-token-xyz") is None


def test_save_load_round_trip(trained, corpus_lines, tmp_path):
    trained.save(tmp_path)
    expected_files = {
        "wordpiece": {"tokenizer.json", "vocab.txt", "tokenizer_config.json"},
        "byte-level-bpe": {"tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"},
    }.get(trained.kind, {"spm.model", "tokenizer.json", "tokenizer_config.json"})  # tokenizer.json: for transformers
    assert {p.name for p in tmp_path.iterdir()} == expected_files
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["kind"] == trained.kind and config["lowercase"] is True and config["mask_token"] == "[MASK]"
    loaded = load_tokenizer(tmp_path)
    assert (loaded.kind, loaded.vocab_size, loaded.lowercase) == (trained.kind, trained.vocab_size, True)
    assert loaded.special_ids.tolist() == trained.special_ids.tolist()
    assert np.array_equal(loaded.word_start, trained.word_start)
    texts = corpus_lines[:1000] + HARD_CASES
    for a, b in zip(trained.encode_batch(texts), loaded.encode_batch(texts)):
        assert a.tolist() == b.tolist()


def test_pickle_round_trip(trained, corpus_lines):
    """Ray pickles tokenizers into actors."""
    clone = pickle.loads(pickle.dumps(trained))
    assert [a.tolist() for a in clone.encode_batch(corpus_lines[:50])] == [a.tolist() for a in trained.encode_batch(corpus_lines[:50])]


def test_wordpiece_folder_reads_in_transformers(corpus_lines, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = train_tokenizer("wordpiece", corpus_lines[:3000], vocab_size=1000)
    tok.save(tmp_path)
    texts = corpus_lines[:200] + HARD_CASES
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.encode_for_model(texts, 128)[0] == ref(texts, truncation=True, max_length=128)["input_ids"]


def test_encode_batch_equals_encode_for_model_without_specials(trained, corpus_lines):
    texts = corpus_lines[:500] + HARD_CASES
    batch = trained.encode_batch(texts)
    ids, offsets, tokens = trained.encode_for_model(texts, 10_000)
    assert len(batch) == len(ids) == len(offsets) == len(tokens) == len(texts)
    for arr, row, offs, toks in zip(batch, ids, offsets, tokens):
        assert arr.dtype == np.int32 and arr.ndim == 1
        assert row[0] == trained.cls_id and row[-1] == trained.sep_id
        assert arr.tolist() == row[1:-1]
        assert len(offs) == len(toks) == len(row) and offs[0] == offs[-1] == (0, 0)
        assert toks[1:-1] == [trained.id_to_token(i) for i in row[1:-1]]
    short, _, _ = trained.encode_for_model(texts, 6)
    for row, full in zip(short, ids):
        assert len(row) <= 6 and row[-1] == trained.sep_id and row[:-1] == full[: len(row) - 1]


def test_ids_for_model_are_encode_for_models_ids(trained, corpus_lines):
    """The ids-only path sentence vectors take: the same ids, truncation included, as int64 arrays."""
    texts = corpus_lines[:300] + HARD_CASES
    for max_len in (10_000, 6, 2):
        ids, _, _ = trained.encode_for_model(texts, max_len)
        fast = trained.ids_for_model(texts, max_len)
        assert all(a.dtype == np.int64 for a in fast)
        assert [a.tolist() for a in fast] == ids


def _normal(kind: str, s: str) -> str:
    """What the tokenizer's normaliser makes of a surface string (lowercase=True)."""
    if kind == "wordpiece":  # BERT: lowercase, then drop combining marks
        return "".join(c for c in unicodedata.normalize("NFD", s.lower()) if unicodedata.category(c) != "Mn")
    if kind == "byte-level-bpe":  # a Lowercase normaliser only
        return s.lower()
    return unicodedata.normalize("NFKC", s).casefold()  # SentencePiece nmt_nfkc_cf


BYTE_OF_SYMBOL = {c: b for b, c in enumerate(_byte_symbols())}  # "Ġ" -> 0x20 ...


def _token_bytes(token: str) -> bytes:
    """The UTF-8 bytes a byte-level BPE token stands for."""
    return bytes(BYTE_OF_SYMBOL[c] for c in token)


OFFSET_TEXTS = [
    "Café naïve résumé Ångström façade",
    "東京は日本の首都です。",
    "emoji 😀👍🏽 and 한국어",
    "Numbers 3.14159 1,000,000 -- (nested) [[brackets]]",
    "MiXeD CaSe   with   runs of spaces ",
    "The bank of the river; the bank of England.",
]


def test_offsets_reproduce_surface_forms(trained, corpus_lines):
    texts = corpus_lines[:500] + OFFSET_TEXTS
    ids, offsets, tokens = trained.encode_for_model(texts, 10_000)
    checked = 0
    if trained.kind == "byte-level-bpe":
        for text, offs, toks in zip(texts, offsets, tokens):
            # Every byte of the text is in exactly one token, after the prefix space.
            assert b"".join(_token_bytes(t) for t in toks[1:-1]) == (" " + _normal(trained.kind, text)).encode(), text
            for (start, end), token in zip(offs[1:-1], toks[1:-1]):
                assert 0 <= start <= end <= len(text), (text, token, start, end)
                raw = _token_bytes(token).lstrip(b" ")  # "Ġbank": the span starts at the word
                surface = _normal(trained.kind, text[start:end]).encode()
                if start == end:
                    assert raw.isspace() or not raw, (text, token)  # whitespace runs: no surface
                elif _is_utf8(raw):
                    assert raw == surface, (text, token, text[start:end])  # whole characters: their own span
                else:
                    assert raw in surface, (text, token, text[start:end])  # bytes of characters: their span
                checked += 1
        assert checked > 5000
        return
    for text, offs, toks in zip(texts, offsets, tokens):
        byte_run, run_start = b"", None  # SentencePiece byte-fallback pieces of one character
        for (start, end), token in zip(offs[1:-1], toks[1:-1]):
            assert 0 <= start <= end <= len(text), (text, token, start, end)
            surface = text[start:end]
            if re.fullmatch(r"<0x[0-9A-F]{2}>", token):
                byte_run += bytes([int(token[3:5], 16)])
                run_start = start if run_start is None else run_start
                if end > start:  # the last byte piece carries the character's span
                    assert byte_run.decode("utf-8") == _normal(trained.kind, text[run_start:end]), (text, token)
                    byte_run, run_start = b"", None
                    checked += 1
                continue
            if token == "[UNK]":
                continue
            assert token.removeprefix("##").removeprefix("▁") == _normal(trained.kind, surface), (text, token, surface)
            checked += 1
        assert byte_run == b"", text
    assert checked > 5000


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_lowercase_option(corpus_lines):
    for kind in ("wordpiece", "sentencepiece-bpe", "byte-level-bpe"):
        cased = train_tokenizer(kind, corpus_lines[:3000], vocab_size=800, lowercase=False)
        uncased = train_tokenizer(kind, corpus_lines[:3000], vocab_size=800, lowercase=True)
        assert not cased.lowercase and uncased.lowercase
        a, b = cased.encode_batch(["The Bank", "the bank"])
        assert a.tolist() != b.tolist(), kind
        a, b = uncased.encode_batch(["The Bank", "the bank"])
        assert a.tolist() == b.tolist(), kind


# ------------------------------------------------------------------------ loading errors


def test_missing_or_empty_folder_gives_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "README.md").write_text("not a tokenizer")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer in .*expected spm\.model.*tokenizer\.json.*vocab\.txt.*vocab\.json \+ merges\.txt; found README\.md"):
        load_tokenizer(tmp_path)


def test_missing_special_token_is_named_when_needed(tmp_path):
    """A folder without [MASK] loads; asking for the mask id names the token and the folder."""
    from pipelines.masking import VocabInfo

    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nhello\n")
    tok = load_tokenizer(tmp_path)
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id) == (0, 1, 2, 3)
    assert tok.special_id("mask") is None and tok.special_ids.tolist() == [0, 1, 2, 3]
    assert tok.encode_for_model(["hello"], 8)[0] == [[2, 4, 3]]
    expected = rf"{re.escape(str(tmp_path))}: the tokenizer has no mask token \(looked for '\[MASK\]', '<mask>'\).*mask_token"
    with pytest.raises(MissingSpecialToken, match=expected):
        tok.mask_id
    with pytest.raises(ValueError, match=expected):  # masked-LM data asks for it
        VocabInfo.from_tokenizer(tok)
    (tmp_path / "vocab.txt").write_text("[PAD]\n[CLS]\n[SEP]\nhello\n")  # WordPiece itself needs [UNK]
    with pytest.raises(ValueError, match=r"vocab\.txt: no unk token.*'\[UNK\]'"):
        load_tokenizer(tmp_path)


def test_unknown_kind_is_rejected(corpus_lines):
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        train_tokenizer("bpe-dropout", corpus_lines[:10], vocab_size=100)


def test_checkpoint_folder_and_roberta_style_hf_folder(corpus_lines, tmp_path):
    """A byte-level BPE tokenizer.json with <s> </s> <pad> <mask> <unk>, inside a checkpoint's tokenizer/."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(corpus_lines[:2000], trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"], show_progress=False))
    (tmp_path / "tokenizer").mkdir()
    hf.save(str(tmp_path / "tokenizer" / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.kind == "hf-bpe"
    assert (tok.cls_id, tok.pad_id, tok.sep_id, tok.unk_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert tok.word_start[tok.token_to_id("Ġthe")] and not tok.word_start[tok.token_to_id("s")]
    ids, offsets, tokens = tok.encode_for_model(["the bank"], 16)
    assert ids[0][0] == 0 and ids[0][-1] == 2 and tokens[0][0] == "<s>"
    assert ["the bank"[s:e] for s, e in offsets[0]][1:-1] == [t.removeprefix("Ġ") for t in tokens[0][1:-1]]


_TRAIN_AND_HASH = """
import hashlib, os, sys, tempfile
from pipelines.sources import sample_text
from pipelines.tokenizers import train_tokenizer
texts = list(sample_text([sys.argv[1]], 150_000))
for kind, size in (("wordpiece", 1200), ("sentencepiece-unigram", 1200), ("sentencepiece-bpe", 1200), ("byte-level-bpe", 1200), ("byte-level-bpe", 3000)):
    d = tempfile.mkdtemp()
    train_tokenizer(kind, texts, size).save(d)
    for f in sorted(os.listdir(d)):
        print(kind, size, f, hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest())
"""


def test_tokenizer_training_is_byte_identical_across_runs_and_thread_counts():
    """The same text and settings give the same files, run after run, with 1 or 2 threads.

    Fresh processes with different PYTHONHASHSEED: string hashes (so set and dict-of-set orders)
    change between them, as Rust's hash maps do in ``tokenizers``.
    """
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    shard = str(repo / "data" / "sample" / "wordnet-0000-of-0008.txt.gz")
    outs = []
    for threads, hash_seed in (("1", "0"), ("2", "1"), ("2", "random")):
        env = {**os.environ, "RAYON_NUM_THREADS": threads, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(repo)}
        outs.append(subprocess.run([sys.executable, "-c", _TRAIN_AND_HASH, shard], env=env, cwd=repo,
                                   capture_output=True, text=True, check=True).stdout)
    assert outs[0].count("\n") == 3 + 3 + 3 + 4 + 4  # wordpiece: 3 files, sentencepiece: 3, byte-level BPE: 4
    assert outs[0] == outs[1] == outs[2]


# ------------------------------------------------------------------------- byte-level BPE


def _naive_merges(word_counts: dict[str, int], n_new: int) -> list[tuple[str, str]]:
    """BPE as Sennrich et al. (2016) write it: recount every pair of every word before each merge."""
    words = {tuple(w): c for w, c in word_counts.items()}
    merges, made = [], set()
    while len(made) < n_new:
        pairs: dict[tuple[str, str], int] = {}
        for word, c in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] = pairs.get(pair, 0) + c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        made.add(best[0] + best[1])
        merged = {}
        for word, c in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + c
        words = merged
    return merges


def test_learned_merges_equal_naive_bpe(corpus_lines):
    from tokenizers import pre_tokenizers

    from pipelines.tokenizers import _learn_merges

    symbols = _byte_symbols()
    pre = pre_tokenizers.ByteLevel(add_prefix_space=True)
    counts: dict[str, int] = {}
    for line in corpus_lines[:300] + HARD_CASES:
        for word, _ in pre.pre_tokenize_str(line):
            counts[word] = counts.get(word, 0) + 1
    assert _learn_merges(counts, symbols, 300) == _naive_merges(counts, 300)
    # Ties everywhere and overlapping pairs ("aaaa").
    toy = {"aaaa": 3, "abc": 2, "ab": 2, "bc": 2, "xabcx": 1, "cab": 2, "ba": 2}
    ours = _learn_merges(toy, symbols, 100)
    assert ours == _naive_merges(toy, 100)
    assert ours[:2] == [("a", "a"), ("a", "b")]  # 6 "a a" (overlapping), then a tie of 5s broken by the strings
    rng = np.random.default_rng(0)
    for _ in range(100):  # small random corpora over 3 letters: ties and overlaps at every step
        words = {"".join(rng.choice(list("abc"), size=rng.integers(1, 8))): int(rng.integers(1, 5)) for _ in range(12)}
        assert _learn_merges(words, symbols, 30) == _naive_merges(words, 30), words


def test_byte_level_ids_follow_the_rule(corpus_lines, tmp_path):
    tok = train_tokenizer("byte-level-bpe", corpus_lines[:2000], vocab_size=700, lowercase=False)
    assert [tok.id_to_token(i) for i in range(5)] == list(SPECIAL_TOKENS)
    assert [_token_bytes(tok.id_to_token(5 + b)) for b in range(256)] == [bytes([b]) for b in range(256)]
    tok.save(tmp_path)
    merges = [tuple(line.split(" ")) for line in (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]]
    expected, seen = [], set(SPECIAL_TOKENS) | set(_byte_symbols())
    for left, right in merges:
        if left + right not in seen:
            seen.add(left + right)
            expected.append(left + right)
    assert [tok.id_to_token(i) for i in range(261, tok.vocab_size)] == expected and tok.vocab_size == 700
    vocab = json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8"))
    assert vocab == {tok.id_to_token(i): i for i in range(tok.vocab_size)}
    with pytest.raises(ValueError, match=r"vocab_size=200 is below the 261 base tokens"):
        train_tokenizer("byte-level-bpe", corpus_lines[:10], vocab_size=200)


@pytest.mark.parametrize("lowercase", [True, False])
def test_byte_level_round_trip_on_hard_text(corpus_lines, lowercase):
    tok = train_tokenizer("byte-level-bpe", corpus_lines[:3000], vocab_size=1000, lowercase=lowercase)
    texts = HARD_CASES + [c.upper() for c in HARD_CASES] + [" ".join(HARD_CASES)]
    texts = [t for t in texts if not any(s in t.upper() for s in SPECIAL_TOKENS)]  # those are matched whole
    assert len(texts) > 40
    for text, ids in zip(texts, tok.encode_batch(texts)):
        assert 1 not in ids.tolist()  # nothing is unknown to a byte-level model
        decoded = tok._backend.tok.decode(ids.tolist(), skip_special_tokens=False)
        normal = text.lower() if lowercase else text
        assert decoded == (" " + normal if text and not text.startswith(" ") else normal), text  # with the prefix space
    ids = tok.encode_batch(["pneumonoultramicroscopicsilicovolcanoconiosis 😀"])[0]
    assert len(ids) >= 8  # a rare word and an emoji: many pieces


def test_byte_level_folder_reads_in_transformers(corpus_lines, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = train_tokenizer("byte-level-bpe", corpus_lines[:3000], vocab_size=1000, lowercase=False)
    tok.save(tmp_path)
    texts = corpus_lines[:200] + HARD_CASES
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok.encode_for_model(texts, 128)[0] == ref(texts, truncation=True, max_length=128)["input_ids"]
    loaded = load_tokenizer(tmp_path)
    assert loaded.kind == "byte-level-bpe" and loaded.special_tokens == tok.special_tokens


@pytest.mark.parametrize("kind", ["sentencepiece-unigram", "sentencepiece-bpe"])
def test_sentencepiece_folder_reads_in_transformers(kind, corpus_lines, tmp_path):
    """The tokenizer.json written beside spm.model gives our ids in transformers: single texts and
    pairs, hard cases (accents, CJK, emoji through byte fallback, extra spaces), and decodes back."""
    transformers = pytest.importorskip("transformers")
    tok = train_tokenizer(kind, corpus_lines[:6000], vocab_size=1500)
    tok.save(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = corpus_lines[:2000] + HARD_CASES + ["  Hello   World  ", "\u3000full\u3000width ", "a\u00a0b", "x\n\ny"]
    # Special tokens' own strings ("[MASK]") in a text are the one difference: transformers reads them as the tokens
    texts = [t for t in texts if not any(s in t for s in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"))]
    assert len(texts) == 2000 + len(HARD_CASES) - 1 + 4
    assert tok.encode_for_model(texts, 128)[0] == ref(texts, truncation=True, max_length=128)["input_ids"]
    pairs = ref(texts[:50], texts[50:100])
    assert pairs["input_ids"] == [[tok.cls_id, *a, tok.sep_id, *b, tok.sep_id] for a, b in
                                  zip(map(list, tok.encode_batch(texts[:50])), map(list, tok.encode_batch(texts[50:100])))]
    assert all(t == 1 for row, types in zip(pairs["input_ids"], pairs["token_type_ids"])
               for t in types[row.index(tok.sep_id) + 1 :])
    assert ref.mask_token == "[MASK]" and ref("the [MASK] flows")["input_ids"].count(tok.mask_id) == 1
    for text in corpus_lines[:200]:
        assert ref.decode(tok.encode_batch([text])[0]) == tok.decode(list(tok.encode_batch([text])[0]))
    loaded = load_tokenizer(tmp_path)  # ours still reads spm.model
    assert loaded.kind == kind and loaded.encode_batch(texts[:20])[5].tolist() == tok.encode_batch(texts[:20])[5].tolist()


# ------------------------------------------------------------------------ GPT-2 folders


GPT2_TEXTS = [
    "Hello world", " leading space", "The bank of the river.", "<|endoftext|>two documents<|endoftext|>",
    "Café naïve 東京 😀👍🏽 ﬁ ＡＢＣ", "tab\there  two  spaces\nnewline", "don't can't 3.14159 1,000,000", "",
]


@pytest.fixture(scope="module")
def gpt2_folders(corpus_lines, tmp_path_factory) -> dict[str, Path]:
    """GPT-2-style folders built here (no hub): a byte-level BPE with <|endoftext|> as its only special token,
    saved by transformers (tokenizer.json + tokenizer_config.json) and as bare vocab.json + merges.txt."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(corpus_lines[:3000], trainer)
    root = tmp_path_factory.mktemp("gpt2")
    eot = "<|endoftext|>"
    fast = transformers.GPT2TokenizerFast(tokenizer_object=hf, bos_token=eot, eos_token=eot, unk_token=eot)
    fast.save_pretrained(root / "saved")
    (root / "bare").mkdir()
    hf.model.save(str(root / "bare"))
    return {"saved": root / "saved", "bare": root / "bare"}


@pytest.mark.parametrize("layout", ["saved", "bare"])
def test_gpt2_folder_loads_and_encodes_as_transformers(gpt2_folders, corpus_lines, layout):
    import transformers

    folder = gpt2_folders[layout]
    tok = load_tokenizer(folder)
    ref = transformers.GPT2TokenizerFast.from_pretrained(folder)
    eot = ref.convert_tokens_to_ids("<|endoftext|>")
    assert tok.kind == "hf-bpe" and tok.vocab_size == len(ref) and not tok.lowercase
    assert tok.special_tokens == {"unk": "<|endoftext|>", "eos": "<|endoftext|>"} and tok.eos_id == tok.unk_id == eot
    assert tok.special_ids.tolist() == [eot]
    texts = corpus_lines[:300] + GPT2_TEXTS + HARD_CASES
    expected = ref(texts, add_special_tokens=False)["input_ids"]
    assert [ids.tolist() for ids in tok.encode_batch(texts)] == expected
    # Offsets as alignment wants them: a "Ġword" token spans the word, not the space before it.
    text = "The bank  of the river"
    _, offsets, tokens = tok._backend.encode_offsets([text])[0]
    assert "Ġthe" in tokens and "Ġ" in tokens  # the double space leaves one alone
    assert [text[s:e] for s, e in offsets] == [_token_bytes(t).decode().lstrip(" ") for t in tokens]
    for role, token in (("mask", "<mask>"), ("cls", "<s>"), ("pad", "<pad>")):
        with pytest.raises(MissingSpecialToken, match=rf"{re.escape(str(folder))}: the tokenizer has no {role} token \(looked for .*'{token}'"):
            getattr(tok, f"{role}_id")
    # What the server reads: the tokens alone (no [CLS]/[SEP] to add), padded with <|endoftext|>.
    ids, offsets, tokens = tok.encode_for_model(["The bank of the river", "hi"], 3)
    assert ids == [expected_ids[:3] for expected_ids in ref(["The bank of the river", "hi"], add_special_tokens=False)["input_ids"]]
    assert len(offsets[0]) == len(tokens[0]) == 3 and tok.padding_id == eot
    assert [a.tolist() for a in tok.ids_for_model(["The bank of the river", "hi"], 3)] == ids  # the sentence-vector path


def test_gpt2_folder_gives_gpt_inputs_with_endoftext_and_names_what_other_styles_miss(gpt2_folders):
    from pipelines.finetune import encode_text_pairs

    tok = load_tokenizer(gpt2_folders["saved"])
    eot = tok.eos_id
    a, b = (x.tolist() for x in tok.encode_batch(["hello world", "good bye now"]))
    out = encode_text_pairs(tok, ["hello world"], ["good bye now"], len(a) + len(b) + 5, "gpt")
    assert out["input_ids"][0].tolist() == [eot, *a, eot, *b, eot, eot, eot]  # start a delim b extract, padding
    assert out["attention_mask"][0].tolist() == [1] * (len(a) + len(b) + 3) + [0, 0]
    out = encode_text_pairs(tok, ["hello world"], None, len(a) + 2, "gpt", extract_id=7)
    assert out["input_ids"][0].tolist() == [eot, *a, 7]
    with pytest.raises(MissingSpecialToken, match=rf"{re.escape(str(gpt2_folders['saved']))}: the tokenizer has no pad token"):
        encode_text_pairs(tok, ["hello world"], None, 8, "bert")


def test_gpt_inputs_without_endoftext_name_the_missing_token(tmp_path):
    from pipelines.finetune import encode_text_pairs

    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "Ġ": 2, "ab": 3}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    tok = load_tokenizer(tmp_path)
    assert tok.special_tokens == {} and tok.encode_batch(["ab"])[0].tolist() == [3]
    with pytest.raises(MissingSpecialToken, match=r"no pad token.*GPT inputs need a padding token and there is no end-of-text token"):
        encode_text_pairs(tok, ["ab"], None, 4, "gpt")
    (tmp_path / "merges.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"vocab\.json without merges\.txt"):
        load_tokenizer(tmp_path)


# --------------------------------------------------------------------------------- CLI


def test_cli_and_recipe_accept_every_trained_kind(tmp_path):
    from typing import get_args

    from jobs.cli import build_parser
    from jobs.training.config import TokenizerKind
    from pipelines.tokenizers import TrainKind

    assert get_args(TokenizerKind) == get_args(TrainKind)
    args = build_parser().parse_args(["tokenizer", "train", "--kind", "byte-level-bpe", "--input", str(SAMPLE / "wordnet-0000-of-0008.txt.gz"),
                                      "--vocab-size", "400", "--sample-chars", "50000", "--cased", "--output", str(tmp_path / "tok")])
    assert args.run(args) == 0
    tok = load_tokenizer(tmp_path / "tok")
    assert (tok.kind, tok.vocab_size, tok.lowercase) == ("byte-level-bpe", 400, False)


def test_decode_inverts_encode_on_plain_words(trained):
    """Tokenizer.decode (the server's fill-mask and generate text) through each kind's own decoder."""
    texts = ["the river bank was muddy", "she deposited money in the bank", "an unbelievably photosynthetic organism"]
    for text, ids in zip(texts, trained.encode_batch(texts)):
        assert trained.decode(ids).removeprefix(" ") == text
        assert trained.decode([trained.cls_id, *ids.tolist(), trained.sep_id]).removeprefix(" ") == text
        assert trained.decode(ids[-2:]).strip() != text
