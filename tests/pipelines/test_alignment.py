"""Words <-> sub-tokens (pipelines/alignment.py) on hard text, for every tokenizer kind.

Round trips: every word maps to >= 1 token, every token lies inside its word, in order, and the
tokens' spans cover the word up to characters the normaliser deletes (combining marks, format and
control characters), so the words reassemble from their tokens.
"""

from __future__ import annotations

import gzip
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from pipelines.alignment import encode_texts, encode_words, first_subtokens, pool_words, whitespace_words
from pipelines.tokenizers import load_tokenizer, train_tokenizer

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"

HARD_TEXTS = [
    "Café naïve résumé Ångström façade Über ÉCOLE",
    "e\u0301 combining acute, o\u0308 umlaut",
    "東京は日本の首都です。中文字符测试，标点！",
    "한국어 문장 and ภาษาไทย mixed with English",
    "Ελληνικά Русский العربية हिन्दी עברית",
    "Hello!!! What??? ... --- ,,, ;;; (((nested))) [[brackets]] {{braces}}",
    "Numbers 3.14159 1,000,000 42nd 1e-10 0x1F 007 -273.15°C",
    "emoji 😀👍🏽 flags 🇫🇷 family 👨‍👩‍👧 heart ❤️",
    "zero\u200bwidth \ufeffbom soft\u00adhyphen",
    "MiXeD CaSe WoRdS iPhone McDonald's NASA's eBay",
    "pneumonoultramicroscopicsilicovolcanoconiosis antidisestablishmentarianism",
    "don't can't won't ''quoted'' “smart quotes” ‘single’ — em dash – en dash …",
    "ﬁ ligature, full-width ＡＢＣ１２３, circled ① ② ③",
    "https://example.com/path?x=1&y=2#frag user@example.org @handle #hashtag",
    "$100 €50 ¥1000 £5 ½ ¾ x² + y² = z² ∑∫√∞≠≤",
    "[MASK] in text [CLS] and [SEP] and [UNK] [PAD] [mask]",
    "The bank of the river flooded; the bank raised its interest rates.",
]
# Words a tokenizer may turn into nothing, or into one [UNK]: each must still get a token.
ODD_WORDS = [["", "a", "\u200b", "b", "\x00", "e\u0301", "", "😀", "\ufeff"], [], [""], ["\u200b"], ["x" * 150, "y"]]


def _lines(n: int) -> list[str]:
    with gzip.open(SAMPLE / "wordnet-0000-of-0008.txt.gz", "rt", encoding="utf-8") as f:
        return [line for line in f.read().split("\n") if line][:n]


def _byte_level_bpe(lines: list[str], tmp: Path):
    """Our byte-level BPE (test_finetune_data imports this helper; ``tmp`` is no longer needed)."""
    return train_tokenizer("byte-level-bpe", lines, vocab_size=800)


def _gpt2_folder(lines: list[str], tmp: Path):
    """A GPT-2-style folder (<|endoftext|> only, no prefix space), built here: nothing is downloaded."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(lines, trainer)
    hf.model.save(str(tmp))  # vocab.json + merges.txt
    return load_tokenizer(tmp)


@pytest.fixture(scope="module", params=["minilm", "wordpiece", "sentencepiece-unigram", "sentencepiece-bpe", "byte-level-bpe", "gpt2-folder"])
def tok(request, minilm_dir, tmp_path_factory):
    if request.param == "minilm":
        return load_tokenizer(minilm_dir)
    lines = _lines(2000)
    if request.param == "gpt2-folder":
        return _gpt2_folder(lines, tmp_path_factory.mktemp("gpt2"))
    if request.param == "byte-level-bpe":
        return _byte_level_bpe(lines, tmp_path_factory.mktemp("bbpe"))
    return train_tokenizer(request.param, lines, vocab_size=800)


def _droppable(c: str) -> bool:
    """Characters a normaliser may delete (so no token covers them)."""
    return unicodedata.category(c) in ("Mn", "Me", "Cf", "Cc") or c.isspace() or c == "\ufffd"


def _check_round_trip(al, words_per_text: list[list[str]]):
    assert len(al) == len(words_per_text)
    for i, words in enumerate(words_per_text):
        text = al.texts[i]
        ids, offsets, wids = al.row(i)
        assert al.n_words[i] == len(words)
        assert np.all(ids >= 0)
        assigned = wids[wids >= 0]
        assert np.all(np.diff(assigned) >= 0), (text, wids)  # tokens come in word order
        assert np.all(np.diff(offsets[:, 0]) >= 0), (text, offsets)
        for w, (word, toks) in enumerate(zip(words, al.word_tokens(i))):
            s0, e0 = al.word_spans[al.word_splits[i] + w]
            assert text[s0:e0] == word
            assert toks.size >= 1, f"word {word!r} of {text!r} has no token"
            spans = offsets[toks]
            assert np.all(spans[:, 0] >= s0) and np.all(spans[:, 1] <= e0) and np.all(spans[:, 0] <= spans[:, 1]), (word, spans, s0, e0)
            covered = np.zeros(e0 - s0, dtype=bool)
            for s, e in spans:
                covered[s - s0 : e - s0] = True
            rebuilt = "".join(text[s0 + k] for k in np.flatnonzero(covered))
            assert rebuilt == "".join(c for k, c in enumerate(word) if covered[k] or not _droppable(c)), (word, spans)
        for s, e in offsets[wids < 0]:  # tokens in no word: whitespace only (byte-level BPE)
            assert text[s:e].isspace() or s == e, (text, s, e)


def test_words_round_trip_on_hard_text(tok):
    words = [t.split() for t in HARD_TEXTS] + ODD_WORDS + [[w.upper() for w in t.split()] for t in HARD_TEXTS[:5]]
    al = encode_words(tok, words)
    _check_round_trip(al, words)
    assert np.all(al.word_ids >= 0)  # given words: every token belongs to one


def test_words_split_into_many_pieces(tok):
    long_words = [["Pneumonoultramicroscopicsilicovolcanoconiosis", "x", "Supercalifragilisticexpialidocious!", "東京都庁舎"]]
    al = encode_words(tok, long_words)
    _check_round_trip(al, long_words)
    counts = [len(t) for t in al.word_tokens(0)]
    assert counts[0] >= 3 and counts[1] >= 1


def test_byte_pieces_of_one_character_share_its_word(tok):
    """Byte-level BPE splits a character it has no token for into byte pieces, each spanning the
    whole character: they all belong to its word, and only the first is the word's first sub-token."""
    if tok.kind not in ("byte-level-bpe", "hf-bpe"):
        pytest.skip("byte-level BPE only")
    words = [["Emoji", "😀👍🏽", "東京", "façade", "🇫🇷!"]]
    al = encode_words(tok, words)
    _check_round_trip(al, words)
    ids, offsets, wids = al.row(0)
    per_word = al.word_tokens(0)
    assert [len(t) for t in per_word[1:3]] >= [8, 2]  # 3 emoji of 4 bytes each, 2 CJK characters of 3
    assert wids.tolist() == sorted(wids.tolist()) and set(wids.tolist()) == set(range(5))
    first = first_subtokens(wids[None, :])[0]
    assert first.sum() == 5 and all(first[t[0]] and not first[t[1:]].any() for t in per_word)
    text = al.texts[0]
    emoji_spans = {(int(s), int(e)) for s, e in offsets[per_word[1]]}
    # Whole characters, never halves; "" for the space before the word when it is a piece of its own ("Ġ").
    assert {text[s:e] for s, e in emoji_spans} <= {"", "😀", "👍", "🏽", "👍🏽", "😀👍", "😀👍🏽"}


def test_plain_texts_round_trip_and_match_the_tokenizer(tok):
    texts = HARD_TEXTS + ["  leading and trailing spaces   ", "tab\there newline\nthere", "", "   "]
    al = encode_texts(tok, texts)
    _check_round_trip(al, [t.split() for t in texts])
    for i, (ids, offsets, _) in enumerate(tok._backend.encode_offsets(texts)):  # no [UNK] added for plain text
        assert al.row(i)[0].tolist() == list(ids)
        assert al.row(i)[1].tolist() == [list(o) for o in offsets]  # no span crosses whitespace here


def test_corpus_words_round_trip(tok):
    lines = _lines(300)
    words = [line.split() for line in lines]
    _check_round_trip(encode_words(tok, words), words)


def test_minilm_word_ids_equal_transformers_is_split_into_words(minilm_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.BertTokenizerFast.from_pretrained(minilm_dir)
    ours = load_tokenizer(minilm_dir)
    words = [t.split() for t in HARD_TEXTS] + [line.split() for line in _lines(200)]
    al = encode_words(ours, words)
    enc = ref(words, is_split_into_words=True, add_special_tokens=False)
    for i in range(len(words)):
        if "\u200b" in " ".join(words[i]) or "\ufeff" in " ".join(words[i]):
            continue  # HF keeps such words without tokens; we give them [UNK] (checked above)
        assert al.row(i)[0].tolist() == enc["input_ids"][i], words[i]
        assert al.row(i)[2].tolist() == enc.word_ids(i), words[i]


def test_whitespace_words():
    spans, splits = whitespace_words(["a bc  d", "", "  x "])
    assert splits.tolist() == [0, 3, 3, 4]
    assert spans.tolist() == [[0, 1], [2, 4], [6, 7], [2, 3]]


def test_first_subtokens_and_pool_words():
    word_ids = np.array([[-1, 0, 0, 1, 2, 2, 2, -1, -1], [-1, 0, 1, 1, -1, -1, -1, -1, -1]])
    assert first_subtokens(word_ids).astype(int).tolist() == [[0, 1, 0, 1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0, 0]]
    rng = np.random.default_rng(0)
    values = rng.normal(size=(2, 9, 4))
    for how in ("first", "last", "mean", "max"):
        out, present = pool_words(values, word_ids, 3, how)
        assert out.shape == (2, 3, 4)
        assert present.tolist() == [[True, True, True], [True, True, False]]
        for r in range(2):
            for w in range(3):
                pos = np.flatnonzero(word_ids[r] == w)
                if pos.size == 0:
                    assert np.all(out[r, w] == 0)
                    continue
                expected = {"first": values[r, pos[0]], "last": values[r, pos[-1]], "mean": values[r, pos].mean(0), "max": values[r, pos].max(0)}[how]
                np.testing.assert_allclose(out[r, w], expected, rtol=1e-12)
    with pytest.raises(ValueError, match="how="):
        pool_words(values, word_ids, 3, "median")
