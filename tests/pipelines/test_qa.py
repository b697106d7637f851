"""QA decoding (pipelines/qa.py): exact best span against brute force, windows, SQuAD 2.0 null answers."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.finetune import TaskDataConfig, encode_question_answering
from pipelines.qa import best_spans, decode_qa
from pipelines.tokenizers import load_tokenizer


def _brute_force(s, e, valid, ex, n_ex, max_answer_len):
    """Every (window, i, j) with i <= j < i + max_answer_len, both context tokens; best per example."""
    best = [(-np.inf, None)] * n_ex
    for f in range(s.shape[0]):
        for i in range(s.shape[1]):
            for j in range(i, min(s.shape[1], i + max_answer_len)):
                if valid[f, i] and valid[f, j] and s[f, i] + e[f, j] > best[ex[f]][0]:
                    best[ex[f]] = (s[f, i] + e[f, j], (f, i, j))
    return best


def _random_features(rng, n_ex, length):
    """Windows with a question block, a context block of random size, then padding; char offsets 5*t."""
    n_win = rng.integers(1, 4, size=n_ex)
    ex = np.repeat(np.arange(n_ex), n_win)
    offsets = np.full((len(ex), length, 2), -1, dtype=np.int64)
    for f in range(len(ex)):
        q = rng.integers(1, min(5, length - 1))
        c = rng.integers(0, length - q)  # context tokens at q + 1 .. q + c <= length - 1
        t = np.arange(c)
        offsets[f, q + 1 : q + 1 + c, 0] = 5 * t
        offsets[f, q + 1 : q + 1 + c, 1] = 5 * t + 4
    return ex, offsets


@pytest.mark.parametrize("seed", range(30))
def test_decode_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n_ex, length = int(rng.integers(1, 5)), int(rng.integers(4, 24))
    ex, offsets = _random_features(rng, n_ex, length)
    s, e = rng.normal(size=(2, len(ex), length)) * 3
    max_answer_len = int(rng.integers(1, 8))
    contexts = ["".join(f"w{t:03d} " for t in range(length)) for _ in range(n_ex)]
    preds = decode_qa(s, e, {"example_index": ex, "context_offsets": offsets}, contexts, max_answer_len=max_answer_len)
    ref = _brute_force(s, e, offsets[..., 0] >= 0, ex, n_ex, max_answer_len)
    for k in range(n_ex):
        score, where = ref[k]
        if where is None:
            assert preds[k]["text"] == "" and preds[k]["score"] == -np.inf and preds[k]["start"] == -1
            continue
        f, i, j = where
        assert preds[k]["score"] == score
        assert (preds[k]["start"], preds[k]["end"]) == (offsets[f, i, 0], offsets[f, j, 1])
        assert preds[k]["text"] == contexts[k][offsets[f, i, 0] : offsets[f, j, 1]]
        assert preds[k]["null_score"] == min(s[g, 0] + e[g, 0] for g in np.flatnonzero(ex == k))


def test_best_spans_respects_length_cap_and_context():
    s = np.array([[9.0, 0, 1, 0, 0, 0, 0]])
    e = np.array([[9.0, 0, 0, 0, 0, 3, 0]])
    valid = np.array([[False, True, True, True, True, True, False]])
    assert [x.tolist() for x in best_spans(s, e, valid, 10)] == [[2], [5], [4.0]]  # [CLS] (9 + 9) is not a span
    assert [x.tolist() for x in best_spans(s, e, valid, 3)] == [[5], [5], [3.0]]  # 2..5 is 4 tokens long
    assert [x.tolist() for x in best_spans(s, e, np.zeros_like(valid), 3)] == [[-1], [-1], [-np.inf]]
    assert best_spans(np.array([[0.0, 5.0, 1.0]]), np.array([[0.0, 0.0, 1.0]]), np.ones((1, 3), bool), 5)[1].tolist() == [2]  # i <= j


CONTEXT = "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon."


@pytest.fixture(scope="module")
def windows(minilm_dir):
    tok = load_tokenizer(minilm_dir)
    answer = "kappa lambda mu"
    cfg = TaskDataConfig(kind="question-answering", max_len=16, max_query_len=4, doc_stride=4)
    records = {"question": ["Which letters?"], "context": [CONTEXT], "answers": [{"text": [answer], "answer_start": [CONTEXT.index(answer)]}]}
    return tok, encode_question_answering(records, tok, cfg), answer


def test_answer_across_window_borders_is_taken_from_the_window_holding_it(windows):
    tok, feats, answer = windows
    n = len(feats["input_ids"])
    assert n >= 3
    holding = np.flatnonzero(feats["start_positions"] > 0)
    assert holding.size >= 1
    # Windows that hold part of the answer: give them a high score on what they see of it.
    s = np.zeros((n, 16))
    e = np.zeros((n, 16))
    a0, a1 = CONTEXT.index(answer), CONTEXT.index(answer) + len(answer)
    partial = 0
    for f in range(n):
        offs = feats["context_offsets"][f]
        inside = np.flatnonzero((offs[:, 0] >= a0) & (offs[:, 1] <= a1) & (offs[:, 0] >= 0))
        if inside.size == 0:
            continue
        s[f, inside[0]] += 2.0
        e[f, inside[-1]] += 2.0
        if f in holding:
            s[f, inside[0]] += 1.0  # the whole answer: one more point
        else:
            partial += 1
    assert partial >= 1  # the answer does cross a border
    (pred,) = decode_qa(s, e, feats, [CONTEXT], max_answer_len=30)
    assert pred["text"] == answer and pred["score"] == 5.0
    # The windows' own labels point at the same tokens.
    f = holding[0]
    assert CONTEXT[feats["context_offsets"][f, feats["start_positions"][f], 0] : feats["context_offsets"][f, feats["end_positions"][f], 1]] == answer


def test_squad2_null_answer_and_threshold(windows):
    _, feats, answer = windows
    n = len(feats["input_ids"])
    f = int(np.flatnonzero(feats["start_positions"] > 0)[0])
    s = np.zeros((n, 16))
    e = np.zeros((n, 16))
    s[f, feats["start_positions"][f]] = 2.0
    e[f, feats["end_positions"][f]] = 2.0  # best span: 4.0
    s[:, 0] = 3.0
    e[:, 0] = 2.0  # null 5.0 in every window ...
    s[n - 1, 0] = 2.5  # ... but 4.5 in the last: the minimum counts
    v1 = decode_qa(s, e, feats, [CONTEXT], null_threshold=None)[0]
    assert v1["text"] == answer and v1["null_score"] == 4.5 and v1["null_score_diff"] == 0.5
    assert decode_qa(s, e, feats, [CONTEXT], null_threshold=0.0)[0]["text"] == ""  # 4.5 - 4.0 > 0
    assert decode_qa(s, e, feats, [CONTEXT], null_threshold=0.5)[0]["text"] == answer  # not > 0.5
    none = decode_qa(s, e, feats, [CONTEXT], null_threshold=0.49)[0]
    assert (none["text"], none["start"], none["end"]) == ("", -1, -1)


def test_trimmed_batches_and_bad_inputs(windows):
    _, feats, answer = windows
    n = len(feats["input_ids"])
    s = np.zeros((n, 12))  # the loop trimmed the batch to 12 columns
    e = np.zeros((n, 12))
    preds = decode_qa(s, e, feats, [CONTEXT])
    assert len(preds) == 1 and preds[0]["text"] != ""
    with pytest.raises(ValueError, match="example_index holds 0 but there are 0 contexts"):
        decode_qa(s, e, feats, [])
    with pytest.raises(ValueError, match="max_answer_len"):
        decode_qa(s, e, feats, [CONTEXT], max_answer_len=0)


HARD_CONTEXT = (
    "Le café naïve résumé of Ångström's façade: 東京は日本の首都です。 Emoji 😀👍🏽 and flags 🇫🇷 appear; "
    "pneumonoultramicroscopicsilicovolcanoconiosis is long, (((nested))) and “smart quotes” too. 3.14159 ends it."
)
HARD_ANSWERS = ["naïve résumé", "Ångström's", "東京", "😀👍🏽", "🇫🇷", "pneumonoultramicroscopicsilicovolcanoconiosis", "nested", "smart quotes", "3.14159"]


def _gpt2_folder(lines, tmp):
    """A GPT-2-style folder (<|endoftext|> only), built here: nothing is downloaded."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(lines, trainer)
    hf.model.save(str(tmp))
    return load_tokenizer(tmp)


@pytest.mark.parametrize("which", ["byte-level-bpe", "gpt2-folder"])
def test_byte_level_answer_positions_on_hard_text(which, tmp_path):
    """Answers made of accented, CJK and emoji characters (split into byte pieces) and of words split
    into many pieces: each window holding one labels tokens whose spans give it back, and decoding
    those labels returns it."""
    import gzip
    from pathlib import Path

    from pipelines.tokenizers import train_tokenizer

    shard = Path(__file__).resolve().parents[2] / "data" / "sample" / "wordnet-0000-of-0008.txt.gz"
    with gzip.open(shard, "rt", encoding="utf-8") as f:
        lines = [line for line in f.read().split("\n") if line][:2000]
    if which == "gpt2-folder":
        tok, style = _gpt2_folder(lines, tmp_path), "gpt"
    else:
        tok, style = train_tokenizer("byte-level-bpe", lines, vocab_size=600, lowercase=False), "bert"
    n = len(HARD_ANSWERS)
    cfg = TaskDataConfig(kind="question-answering", max_len=64, max_query_len=8, doc_stride=24, input_style=style)
    records = {
        "question": [f"Where is {a}?" for a in HARD_ANSWERS],
        "context": [HARD_CONTEXT] * n,
        "answers": [{"text": [a], "answer_start": [HARD_CONTEXT.index(a)]} for a in HARD_ANSWERS],
    }
    feats = encode_question_answering(records, tok, cfg)
    holding = np.flatnonzero(feats["start_positions"] > 0)
    assert sorted(set(feats["example_index"][holding].tolist())) == list(range(n))  # every answer fits some window
    length = feats["input_ids"].shape[1]
    s = np.full((len(feats["input_ids"]), length), -10.0)
    e = np.full_like(s, -10.0)
    for f in holding:
        k = feats["example_index"][f]
        i, j = feats["start_positions"][f], feats["end_positions"][f]
        offs = feats["context_offsets"][f]
        assert HARD_CONTEXT[offs[i, 0] : offs[j, 1]] == HARD_ANSWERS[k], (which, HARD_ANSWERS[k])
        s[f, i] = e[f, j] = 10.0
    preds = decode_qa(s, e, feats, [HARD_CONTEXT] * n, max_answer_len=40)
    assert [p["text"] for p in preds] == HARD_ANSWERS
    assert [p["start"] for p in preds] == [HARD_CONTEXT.index(a) for a in HARD_ANSWERS]
