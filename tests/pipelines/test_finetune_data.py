"""Fine-tuning data (pipelines/finetune.py) against transformers' fast BERT tokenizer and HF's recipes.

References: ``BertTokenizerFast(texts, pairs, truncation="longest_first", padding="max_length")``
for sentence pairs; ``run_ner.py``'s ``tokenize_and_align_labels`` for token classification;
``run_qa.py``'s ``prepare_train_features`` for SQuAD windows and answer positions (copied below).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from pipelines.finetune import (
    IGNORE_INDEX,
    LabelSet,
    RecordError,
    TaskDataConfig,
    check_records,
    drop_bad_records,
    encode_classification,
    encode_embedding,
    encode_multiple_choice,
    encode_question_answering,
    encode_regression,
    encode_task,
    encode_text_pairs,
    encode_token_classification,
    flatten_squad,
    pick_embedding_texts,
    read_squad_json,
)
from pipelines.rng import stable_hash64
from pipelines.tokenizers import load_tokenizer, train_tokenizer

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"
transformers = pytest.importorskip("transformers")


def _lines(n: int) -> list[str]:
    with gzip.open(SAMPLE / "wordnet-0001-of-0008.txt.gz", "rt", encoding="utf-8") as f:
        return [line for line in f.read().split("\n") if line][:n]


@pytest.fixture(scope="module")
def tok(minilm_dir):
    return load_tokenizer(minilm_dir)


@pytest.fixture(scope="module")
def hf(minilm_dir):
    return transformers.BertTokenizerFast.from_pretrained(minilm_dir)


# ----------------------------------------------------------------------------- text pairs


def test_pairs_equal_bert_tokenizer_fast(tok, hf):
    lines = _lines(400) + ["", "Café naïve 東京 😀 [MASK] x² ﬁ", "a " * 60]
    rng = np.random.default_rng(0)
    texts = lines
    pairs = [lines[i] for i in rng.permutation(len(lines))]
    for max_len in (3, 4, 7, 12, 24, 64, 128):
        for b in (None, pairs):
            ours = encode_text_pairs(tok, texts, b, max_len, "bert")
            ref = hf(texts, b, truncation="longest_first", max_length=max_len, padding="max_length")
            for key in ("input_ids", "token_type_ids", "attention_mask"):
                assert ours[key].dtype == np.int64 and ours[key].shape == (len(texts), max_len)
                np.testing.assert_array_equal(ours[key], np.array(ref[key]), err_msg=f"{key} max_len={max_len} pairs={b is not None}")
            full = hf(texts, b)["input_ids"]
            np.testing.assert_array_equal(ours["truncated"], np.array([len(x) > max_len for x in full]))


def test_longest_first_every_length_combination(tok, hf):
    """Ties and odd budgets, where HF's Rust and Python truncations differ: we follow the fast one."""
    texts, pairs = [], []
    for la in range(0, 10):
        for lb in range(0, 10):
            texts.append("a " * la)
            pairs.append("b " * lb)
    for max_len in range(3, 16):
        ours = encode_text_pairs(tok, texts, pairs, max_len, "bert")
        ref = hf(texts, pairs, truncation="longest_first", max_length=max_len, padding="max_length")
        np.testing.assert_array_equal(ours["input_ids"], np.array(ref["input_ids"]), err_msg=f"max_len={max_len}")


def test_xlnet_and_gpt_layouts(tok):
    a, b = tok.encode_batch(["hello world"])[0].tolist(), tok.encode_batch(["good bye now"])[0].tolist()
    cls, sep, pad, mask = tok.cls_id, tok.sep_id, tok.pad_id, tok.mask_id
    out = encode_text_pairs(tok, ["hello world"], ["good bye now"], 10, "xlnet")
    assert out["input_ids"][0].tolist() == a + [sep] + b + [sep, cls] + [pad, pad]
    assert out["token_type_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 0, 0]
    assert out["attention_mask"][0].tolist() == [1] * 8 + [0, 0]
    out = encode_text_pairs(tok, ["hello world"], ["good bye now"], 10, "gpt")
    assert out["input_ids"][0].tolist() == [cls] + a + [sep] + b + [mask, pad, pad]
    assert out["token_type_ids"][0].tolist() == [0] * 10
    out = encode_text_pairs(tok, ["hello world"], None, 6, "gpt", extract_id=7)
    assert out["input_ids"][0].tolist() == [cls] + a + [7, pad, pad]
    out = encode_text_pairs(tok, ["hello world", "x"], None, 5, "xlnet")
    assert out["input_ids"].tolist() == [a + [sep, cls, pad], tok.encode_batch(["x"])[0].tolist() + [sep, cls, pad, pad]]
    # Truncation keeps the special tokens in every style.
    for style in ("bert", "xlnet", "gpt"):
        out = encode_text_pairs(tok, ["hello world " * 10], ["good bye now " * 10], 9, style)
        assert out["attention_mask"].sum() == 9 and out["truncated"].all()
        assert (out["input_ids"][0] == (mask if style == "gpt" else cls)).sum() >= 1


# ---------------------------------------------------------------------------------- labels


def test_label_set():
    ls = LabelSet.from_values([2, 10, 1, 2])
    assert ls.names == ("1", "2", "10")
    assert ls.encode(np.array([10, 1, 2])).tolist() == [2, 0, 1]
    assert ls.encode([1.0, "2"]).tolist() == [0, 1]
    assert LabelSet.from_values(["neutral", "entailment", "contradiction"]).names == ("contradiction", "entailment", "neutral")
    with pytest.raises(ValueError, match=r"label 'maybe' is not one of the 3 labels"):
        LabelSet(["a", "b", "c"]).encode(["a", "maybe"])
    with pytest.raises(ValueError, match="neither a string nor an integer"):
        LabelSet.from_values([0.5])
    with pytest.raises(ValueError, match="duplicate"):
        LabelSet(["a", "a"])
    assert LabelSet(["B-PER", "I-PER", "B-MISC", "O"]).continuation().tolist() == [1, 1, 2, 3]
    assert LabelSet(["x", "y"]).decode([1, 0]) == ["y", "x"]


# -------------------------------------------------------------------------- task encoders


def test_classification_glue_fields_and_aliases(tok, hf):
    cfg = TaskDataConfig(kind="classification", max_len=16, labels=("0", "1"))
    records = {"sentence1": ["The cat sat.", "A dog barked loudly at the mailman today."], "sentence2": ["A cat sat.", "No."], "label": [1, 0], "idx": [7, 8]}
    out = encode_classification(records, tok, cfg)
    ref = hf(records["sentence1"], records["sentence2"], truncation=True, max_length=16, padding="max_length")
    np.testing.assert_array_equal(out["input_ids"], ref["input_ids"])
    assert out["labels"].tolist() == [1, 0] and out["labels"].dtype == np.int64
    assert out["example_id"].tolist() == [7, 8]
    alias = encode_task({"text": records["sentence1"], "text_pair": records["sentence2"], "label": [1, 0]}, tok, cfg)
    np.testing.assert_array_equal(alias["input_ids"], out["input_ids"])
    assert alias["example_id"].tolist() == [0, 1]
    single = encode_task({"sentence": ["hello there"], "label": [0]}, tok, cfg)
    assert single["token_type_ids"].sum() == 0 and single["attention_mask"].sum() == 4
    mnli = TaskDataConfig(kind="classification", max_len=16, labels=("contradiction", "entailment", "neutral"), text_field="premise", pair_field="hypothesis")
    out = encode_task({"premise": ["a"], "hypothesis": ["b"], "label": ["neutral"]}, tok, mnli)
    assert out["labels"].tolist() == [2]
    no_labels = encode_task({"sentence1": ["a"], "sentence2": ["b"]}, tok, TaskDataConfig(kind="classification", with_labels=False))
    assert "labels" not in no_labels


def test_symmetric_pairs_hold_both_orders(tok):
    cfg = TaskDataConfig(kind="regression", max_len=12, symmetric=True, input_style="gpt")
    out = encode_regression({"sentence1": ["one two", "a"], "sentence2": ["three", "b c d e f g h i j k"], "label": [4.5, 0]}, tok, cfg)
    assert out["input_ids"].shape == out["attention_mask"].shape == out["token_type_ids"].shape == (2, 2, 12)
    ab = encode_text_pairs(tok, ["one two", "a"], ["three", "b c d e f g h i j k"], 12, "gpt")
    ba = encode_text_pairs(tok, ["three", "b c d e f g h i j k"], ["one two", "a"], 12, "gpt")
    np.testing.assert_array_equal(out["input_ids"][:, 0], ab["input_ids"])
    np.testing.assert_array_equal(out["input_ids"][:, 1], ba["input_ids"])
    assert out["labels"].dtype == np.float32 and out["labels"].tolist() == [4.5, 0.0]
    assert out["truncated"].tolist() == [False, True]


def test_multiple_choice(tok):
    cfg = TaskDataConfig(kind="multiple-choice", max_len=16)
    records = {"context": ["She opened the door", "He sat"], "options": [["and left.", "to the moon.", "quietly."], ["down.", "up.", "around."]], "label": [0, 1]}
    out = encode_multiple_choice(records, tok, cfg)
    assert out["input_ids"].shape == (2, 3, 16) and out["labels"].tolist() == [0, 1]
    ref = encode_text_pairs(tok, ["He sat"], ["up."], 16, "bert")
    np.testing.assert_array_equal(out["input_ids"][1, 1], ref["input_ids"][0])
    race = TaskDataConfig(kind="multiple-choice", max_len=24, mc_question_field="question")
    out = encode_task({**records, "question": ["What then?", "Where?"]}, tok, race)
    ref = encode_text_pairs(tok, ["He sat"], ["Where? up."], 24, "bert")
    np.testing.assert_array_equal(out["input_ids"][1, 1], ref["input_ids"][0])
    bad = {**records, "options": [["a", "b", "c"], ["a", "b"]]}
    with pytest.raises(RecordError, match=r"record 1: field 'options': 2 options where the other records have 3"):
        encode_multiple_choice(bad, tok, cfg)
    with pytest.raises(RecordError, match=r"record 0: field 'label'"):
        encode_multiple_choice({**records, "label": [3, 0]}, tok, cfg)


# ------------------------------------------------------------------------------ embedding

EMBEDDING_RECORDS = {
    "anchor": ["a cat sat on the mat", "where do dogs sleep at night when the whole house is quiet and dark", "cats"],
    "positive": ["the cat is on the mat", "dogs sleep in baskets", "the cat is on the mat"],  # record 2 shares record 0's positive
    "negative": [["dogs sleep in baskets", "a bird"], ["a fish", "the sea"], ["x", "y z"]],  # record 0's negative is record 1's positive
}


def _assert_server_rows(out, texts, tok, max_len):
    """Every (record, text) row is tok.ids_for_model of the text, padded on the right."""
    for i, row in enumerate(texts):
        for j, text in enumerate(row):
            ids = tok.ids_for_model([text], max_len)[0]
            n = len(ids)
            np.testing.assert_array_equal(out["input_ids"][i, j, :n], ids, err_msg=f"record {i} text {j}")
            assert (out["input_ids"][i, j, n:] == tok.padding_id).all()
            assert out["attention_mask"][i, j].tolist() == [1] * n + [0] * (max_len - n)


def test_embedding_rows_are_the_servers_encoding_of_each_text(tok):
    cfg = TaskDataConfig(kind="embedding", max_len=12)
    out = encode_embedding(EMBEDDING_RECORDS, tok, cfg)
    assert {k: (v.shape, v.dtype.name) for k, v in out.items()} == {
        "input_ids": ((3, 4, 12), "int64"), "attention_mask": ((3, 4, 12), "int64"), "token_type_ids": ((3, 4, 12), "int64"),
        "truncated": ((3,), "bool"), "doc_ids": ((3, 3), "int64"), "example_id": ((3,), "int64"),
    }
    texts = pick_embedding_texts(EMBEDDING_RECORDS, cfg)
    assert texts[0] == ["a cat sat on the mat", "the cat is on the mat", "dogs sleep in baskets", "a bird"]
    _assert_server_rows(out, texts, tok, 12)
    assert (out["token_type_ids"] == 0).all() and out["example_id"].tolist() == [0, 1, 2]
    full = [len(tok.encode_batch([t])[0]) + 2 > 12 for row in texts for t in row]
    assert out["truncated"].tolist() == np.array(full).reshape(3, 4).any(axis=1).tolist() == [False, True, False]
    doc = out["doc_ids"]
    assert doc[0, 0] == doc[2, 0] == stable_hash64("the cat is on the mat")  # one text, one document
    assert doc[0, 1] == doc[1, 0] and len(set(doc.reshape(-1).tolist())) == 7
    # Any style, and a tokenizer without [CLS]/[SEP] (GPT-2's): the server's ids all the same.
    out = encode_task(EMBEDDING_RECORDS, tok, TaskDataConfig(kind="embedding", max_len=12, input_style="xlnet"))
    _assert_server_rows(out, texts, tok, 12)


def test_embedding_rows_from_a_gpt2_style_tokenizer(tmp_path):
    from tests.pipelines.test_alignment import _gpt2_folder

    tok = _gpt2_folder(_lines(300), tmp_path)
    assert not tok.wraps_with_cls_sep and tok.padding_id == tok.special_id("eos")  # tokens alone, padded with <|endoftext|>
    cfg = TaskDataConfig(kind="embedding", max_len=6, input_style="gpt")
    out = encode_embedding(EMBEDDING_RECORDS, tok, cfg)
    _assert_server_rows(out, pick_embedding_texts(EMBEDDING_RECORDS, cfg), tok, 6)
    assert out["truncated"][1]


def test_embedding_fields_and_negatives_as_string_or_list(tok):
    cfg = TaskDataConfig(kind="embedding", max_len=16)
    one = {"anchor": ["a", "b"], "positive": ["c", "d"], "negative": ["e", "f"]}
    listed = {"anchor": ["a", "b"], "positive": ["c", "d"], "negatives": [["e"], np.array(["f"], dtype=object)]}
    for key in ("input_ids", "attention_mask", "doc_ids"):
        np.testing.assert_array_equal(encode_embedding(one, tok, cfg)[key], encode_embedding(listed, tok, cfg)[key])
    assert pick_embedding_texts({"query": ["q"], "document": ["d"], "id": ["x"]}, cfg) == [["q", "d"]]  # pairs: in-batch negatives only
    assert encode_embedding({"query": ["q"], "document": ["d"]}, tok, cfg)["doc_ids"].shape == (1, 1)
    assert pick_embedding_texts({"sentence1": ["s"], "sentence2": ["t"], "label": [0]}, cfg) == [["s", "t"]]
    named = TaskDataConfig(kind="embedding", text_field="q", pair_field="p", negative_field="n")
    assert pick_embedding_texts({"q": ["1"], "p": ["2"], "n": [["3", "4"]], "anchor": ["x"], "negative": ["y"]}, named) == [["1", "2", "3", "4"]]
    assert pick_embedding_texts({"anchor": ["a"], "positive": ["p"], "negatives": [[]]}, cfg) == [["a", "p"]]


def test_embedding_record_errors(tok):
    cfg = TaskDataConfig(kind="embedding", max_len=16)
    records = {
        "anchor": ["a", None, "c", "d", "e", "  ", "g"],
        "positive": ["p", "p", "", "p", "p", "p", "p"],
        "negatives": [["n", "m"], ["n", "m"], ["n", "m"], ["n"], "n", ["n", "m"], [3, "m"]],
    }
    errors = check_records(records, cfg)
    assert [(e.index, e.field) for e in errors] == [(1, "anchor"), (2, "positive"), (3, "negatives"), (4, "negatives"), (5, "anchor"), (6, "negatives")]
    assert str(errors[0]) == "record 1: field 'anchor': expected a non-empty string, got nothing (missing)"
    assert str(errors[2]) == "record 3: field 'negatives': 1 negatives where the other records have 2"
    assert "expected a non-empty string or a list of them" in str(errors[5])
    with pytest.raises(RecordError, match=r"record 1: field 'anchor'"):
        encode_embedding(records, tok, cfg)
    kept, _ = drop_bad_records(records, cfg)
    assert encode_embedding(kept, tok, cfg)["input_ids"].shape == (1, 4, 16)
    pinned = TaskDataConfig(kind="embedding", n_negatives=1)  # the split's count, set by finetune_stream.check_split
    assert [str(e) for e in check_records({"anchor": ["a", "b"], "positive": ["p", "q"]}, pinned)] == [
        f"record {i}: field 'negative': 0 negatives where TaskDataConfig.n_negatives (the split's count) is 1" for i in (0, 1)
    ]
    with pytest.raises(ValueError, match=r"no field 'positive' \(nor \['document', 'sentence2', 'text_pair'\]\)") as info:
        check_records({"anchor": ["a"], "answer": ["b"]}, cfg)
    assert not isinstance(info.value, RecordError)  # a missing column is configuration, not a bad record
    with pytest.raises(ValueError, match=r"no field 'anchor' \(nor \['query', 'sentence1', 'text', 'sentence'\]\)"):
        encode_embedding({"positive": ["b"]}, tok, cfg)
    with pytest.raises(ValueError, match=r"no field 'hard'"):
        encode_embedding({"anchor": ["a"], "positive": ["b"]}, tok, TaskDataConfig(kind="embedding", negative_field="hard"))
    with pytest.raises(ValueError, match=r"TaskDataConfig.n_negatives=-1"):
        TaskDataConfig(kind="embedding", n_negatives=-1)


def _hf_tokenize_and_align_labels(hf, words, tags, max_len, label_all_tokens, b_to_i):
    """transformers examples/pytorch/token-classification/run_ner.py, tokenize_and_align_labels."""
    enc = hf(words, truncation=True, max_length=max_len, padding="max_length", is_split_into_words=True)
    labels = []
    for i, label in enumerate(tags):
        word_ids = enc.word_ids(batch_index=i)
        previous_word_idx = None
        label_ids = []
        for word_idx in word_ids:
            if word_idx is None:
                label_ids.append(-100)
            elif word_idx != previous_word_idx:
                label_ids.append(label[word_idx])
            else:
                label_ids.append(b_to_i[label[word_idx]] if label_all_tokens else -100)
            previous_word_idx = word_idx
        labels.append(label_ids)
    return enc, labels


@pytest.mark.parametrize("label_all", [False, True])
def test_token_classification_equals_run_ner(tok, hf, label_all):
    names = ("B-LOC", "B-MISC", "B-ORG", "B-PER", "I-LOC", "I-MISC", "I-ORG", "I-PER", "O")
    ls = LabelSet(names)
    rng = np.random.default_rng(1)
    words = [line.split() for line in _lines(300)] + [["Pneumonoultramicroscopicsilicovolcanoconiosis", "in", "Ångström", "東京", "😀", "!"]]
    tags = [[names[t] for t in rng.integers(0, len(names), len(w))] for w in words]
    cfg = TaskDataConfig(kind="token-classification", max_len=24, labels=names, label_all_subtokens=label_all)
    out = encode_token_classification({"tokens": words, "tags": tags}, tok, cfg)
    enc, ref_labels = _hf_tokenize_and_align_labels(hf, words, [ls.encode(t).tolist() for t in tags], 24, label_all, ls.continuation().tolist())
    np.testing.assert_array_equal(out["input_ids"], enc["input_ids"])
    np.testing.assert_array_equal(out["labels"], np.array(ref_labels))
    np.testing.assert_array_equal(out["word_ids"], np.array([[-1 if w is None else w for w in enc.word_ids(i)] for i in range(len(words))]))
    full = hf(words, is_split_into_words=True)["input_ids"]
    np.testing.assert_array_equal(out["truncated"], np.array([len(x) > 24 for x in full]))


def test_token_classification_int_tags_word_with_no_token_and_styles(tok):
    cfg = TaskDataConfig(kind="token-classification", max_len=12, labels=("0", "1", "2"), input_style="xlnet")
    out = encode_token_classification({"tokens": [["Paris", "\u200b", "rocks"]], "tags": [np.array([1, 2, 0])]}, tok, cfg)
    n = out["attention_mask"][0].sum()
    assert out["input_ids"][0, n - 1] == tok.cls_id and out["input_ids"][0, 1] == tok.unk_id  # the zero-width word got [UNK]
    assert out["labels"][0, :3].tolist() == [1, 2, 0] and (out["labels"][0, 3:] == IGNORE_INDEX).all()
    assert out["word_ids"][0, :5].tolist() == [0, 1, 2, -1, -1]
    with pytest.raises(RecordError, match=r"record 0: field 'tags': 2 tags for 3 tokens"):
        encode_token_classification({"tokens": [["a", "b", "c"]], "tags": [[0, 1]]}, tok, cfg)
    with pytest.raises(RecordError, match=r"record 1: field 'tags': label 7 is not one of the 3 labels"):
        encode_token_classification({"tokens": [["a"], ["b"]], "tags": [[0], [7]]}, tok, cfg)


# ------------------------------------------------------------------------------- SQuAD


def _hf_prepare_train_features(hf, questions, contexts, answers, max_len, doc_stride):
    """transformers examples/pytorch/question-answering/run_qa.py, prepare_train_features (pad_on_right)."""
    questions = [q.lstrip() for q in questions]
    enc = hf(
        questions, contexts, truncation="only_second", max_length=max_len, stride=doc_stride,
        return_overflowing_tokens=True, return_offsets_mapping=True, padding="max_length",
    )
    sample_mapping = enc.pop("overflow_to_sample_mapping")
    offset_mapping = enc.pop("offset_mapping")
    starts, ends = [], []
    for i, offsets in enumerate(offset_mapping):
        input_ids = enc["input_ids"][i]
        cls_index = input_ids.index(hf.cls_token_id)
        sequence_ids = enc.sequence_ids(i)
        ans = answers[sample_mapping[i]]
        if len(ans["answer_start"]) == 0:
            starts.append(cls_index)
            ends.append(cls_index)
        else:
            start_char = ans["answer_start"][0]
            end_char = start_char + len(ans["text"][0])
            token_start_index = 0
            while sequence_ids[token_start_index] != 1:
                token_start_index += 1
            token_end_index = len(input_ids) - 1
            while sequence_ids[token_end_index] != 1:
                token_end_index -= 1
            if not (offsets[token_start_index][0] <= start_char and offsets[token_end_index][1] >= end_char):
                starts.append(cls_index)
                ends.append(cls_index)
            else:
                while token_start_index < len(offsets) and offsets[token_start_index][0] <= start_char:
                    token_start_index += 1
                starts.append(token_start_index - 1)
                while offsets[token_end_index][1] >= end_char:
                    token_end_index -= 1
                ends.append(token_end_index + 1)
    return enc, sample_mapping, offset_mapping, starts, ends


CONTEXT = (
    "The Normans (Norman: Nourmands; French: Normands; Latin: Normanni) were the people who in the 10th and 11th "
    "centuries gave their name to Normandy, a region in France. They were descended from Norse (\"Norman\" comes from "
    "\"Norseman\") raiders and pirates from Denmark, Iceland and Norway who, under their leader Rollo, agreed to swear "
    "fealty to King Charles III of West Francia."
)


def _squad_cases():
    def ans(text, occurrence=0):
        start = -1
        for _ in range(occurrence + 1):
            start = CONTEXT.index(text, start + 1)
        return {"text": [text], "answer_start": [start]}

    questions = ["In what country is Normandy located?", "When were the Normans in Normandy?", "  From which countries did the Norse originate?",
                 "Who was the Norse leader?", "What is France a region of?", "Who gave their name?", "Where?"]
    answers = [ans("France"), ans("10th and 11th centuries"), ans("Denmark, Iceland and Norway"), ans("Rollo"),
               {"text": [], "answer_start": []}, ans("The Normans"), ans("West Francia.")]
    return questions, [CONTEXT] * len(questions), answers


@pytest.mark.parametrize("max_len,doc_stride", [(384, 128), (48, 16), (32, 8), (30, 10), (26, 3)])
def test_squad_features_equal_hf_prepare_train_features(tok, hf, max_len, doc_stride):
    questions, contexts, answers = _squad_cases()
    cfg = TaskDataConfig(kind="question-answering", max_len=max_len, doc_stride=doc_stride, max_query_len=16, version_2=True)
    out = encode_question_answering({"question": questions, "context": contexts, "answers": answers, "id": [f"q{i}" for i in range(7)]}, tok, cfg)
    enc, sample_mapping, offset_mapping, starts, ends = _hf_prepare_train_features(hf, questions, contexts, answers, max_len, doc_stride)
    assert out["example_index"].tolist() == list(sample_mapping)
    for key in ("input_ids", "token_type_ids", "attention_mask"):
        np.testing.assert_array_equal(out[key], np.array(enc[key]), err_msg=key)
    in_context = np.array([[s == 1 for s in enc.sequence_ids(i)] for i in range(len(starts))])
    ref_offsets = np.where(in_context[..., None], np.array(offset_mapping), -1)
    np.testing.assert_array_equal(out["context_offsets"], ref_offsets)
    crossing = 0
    for f, (s_ref, e_ref) in enumerate(zip(starts, ends)):
        s, e = out["start_positions"][f], out["end_positions"][f]
        if s_ref != 0 and not in_context[f, s_ref]:
            # HF's edge case ("we could go after the last offset if the answer is the last word"):
            # its start runs past the window's last context token, which is where the answer starts.
            last = np.flatnonzero(in_context[f])[-1]
            assert (s, e) == (last, e_ref), f
            continue
        assert (s, e) == (s_ref, e_ref), (f, questions[sample_mapping[f]])
        if s > 0:
            ex = sample_mapping[f]
            text = CONTEXT[out["context_offsets"][f, s, 0] : out["context_offsets"][f, e, 1]]
            assert answers[ex]["text"][0] in text and len(text) < len(answers[ex]["text"][0]) + 12
        else:
            crossing += answers[sample_mapping[f]]["text"] != []
    assert out["truncated"].sum() == 0
    if max_len < 64:
        assert crossing > 0  # some windows cut an answer and must point at [CLS]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tests.pipelines.test_alignment import _byte_level_bpe

    lines = _lines(2000)
    out = {kind: train_tokenizer(kind, lines, vocab_size=800) for kind in ("wordpiece", "sentencepiece-unigram", "sentencepiece-bpe")}
    out["byte-level-bpe"] = _byte_level_bpe(lines, tmp_path_factory.mktemp("bbpe"))
    return out


@pytest.mark.parametrize("style", ["bert", "xlnet", "gpt"])
@pytest.mark.parametrize("kind", ["wordpiece", "sentencepiece-unigram", "sentencepiece-bpe", "byte-level-bpe"])
def test_squad_positions_recover_the_answer_any_style_and_tokenizer(style, kind, trained):
    tok = trained[kind]
    questions, contexts, answers = _squad_cases()
    cfg = TaskDataConfig(kind="question-answering", max_len=48, doc_stride=24, max_query_len=8, version_2=True, input_style=style)
    out = encode_question_answering({"question": questions, "context": contexts, "answers": answers}, tok, cfg)
    found = set()
    for f in range(len(out["input_ids"])):
        s, e = out["start_positions"][f], out["end_positions"][f]
        ex = out["example_index"][f]
        if s == 0:
            assert e == 0
            continue
        assert out["context_offsets"][f, s, 0] >= 0 and s <= e
        text = CONTEXT[out["context_offsets"][f, s, 0] : out["context_offsets"][f, e, 1]]
        assert text == answers[ex]["text"][0], (text, answers[ex])
        found.add(int(ex))
    assert found == {0, 1, 2, 3, 5, 6}  # every answerable question, in at least one window
    assert out["truncated"].any()  # questions over 8 tokens were cut and counted


def test_squad_record_errors_and_rejection(tok):
    cfg = TaskDataConfig(kind="question-answering", max_len=64, doc_stride=16, max_query_len=16)
    good = {"text": ["France"], "answer_start": [CONTEXT.index("France")]}
    records = {
        "id": ["a", "b", "c", "d", "e"],
        "question": ["Where?", None, "Where?", "Where?", "Where?"],
        "context": [CONTEXT] * 5,
        "answers": [good, good, {"text": ["France"], "answer_start": [3]}, {"text": [], "answer_start": []}, [{"text": "France", "answer_start": CONTEXT.index("France")}]],
    }
    with pytest.raises(RecordError, match=r"record 1: field 'question': expected a string, got nothing \(missing\)"):
        encode_question_answering(records, tok, cfg)
    errors = check_records(records, cfg)
    assert [(e.index, e.field) for e in errors] == [(1, "question"), (2, "answers"), (3, "answers")]
    assert "answer_start 3 does not match the answer text 'France' in the context (found ' Norma' there)" in str(errors[1])
    assert "version_2" in str(errors[2])
    kept, errors = drop_bad_records(records, cfg)
    assert kept["id"] == ["a", "e"] and len(errors) == 3
    out = encode_question_answering(kept, tok, cfg)
    assert set(out["example_index"][out["start_positions"] > 0].tolist()) == {0, 1}
    with pytest.raises(ValueError, match=r"records have no field 'answers'") as info:
        encode_question_answering({k: v for k, v in kept.items() if k != "answers"}, tok, cfg)
    assert not isinstance(info.value, RecordError)  # a missing column is configuration, not a bad record
    no_labels = encode_question_answering({k: v for k, v in kept.items() if k != "answers"}, tok, TaskDataConfig(kind="question-answering", max_len=64, doc_stride=16, max_query_len=16, with_labels=False))
    assert "start_positions" not in no_labels


def test_other_record_errors(tok):
    cls = TaskDataConfig(kind="classification", labels=("a", "b"))
    records = {"sentence1": ["x", 3, "z", "w"], "sentence2": ["y", "y", None, "y"], "label": ["a", "b", "a", "c"]}
    errors = check_records(records, cls)
    assert [(e.index, e.field) for e in errors] == [(1, "sentence1"), (2, "sentence2"), (3, "label")]
    assert "label 'c' is not one of the 2 labels ['a', 'b']" in str(errors[2])
    kept, _ = drop_bad_records({k: np.array(v, dtype=object) for k, v in records.items()}, cls)
    assert encode_classification(kept, tok, cls)["labels"].tolist() == [0]
    reg = TaskDataConfig(kind="regression")
    with pytest.raises(RecordError, match=r"record 1: field 'label': expected a finite number, got str '2.5'"):
        encode_regression({"sentence1": ["a", "b"], "label": [1.0, "2.5"]}, tok, reg)
    with pytest.raises(RecordError, match=r"record 0: field 'label': expected a finite number"):
        encode_regression({"sentence1": ["a"], "label": [float("nan")]}, tok, reg)
    with pytest.raises(ValueError, match="TaskDataConfig.labels is empty"):
        encode_classification({"sentence1": ["a"], "label": ["a"]}, tok, TaskDataConfig())
    errors = check_records({"sentence1": ["a", "b"], "label": ["a", "b"], "id": ["x", 1.5]}, cls)
    assert [(e.index, e.field) for e in errors] == [(1, "id")]


def test_arrow_numpy_batches_encode_like_python_lists(tok):
    """Ray Data hands encoders pyarrow columns as NumPy (object arrays, nested lists as arrays)."""
    pa = pytest.importorskip("pyarrow")

    def arrow_numpy(records):
        table = pa.table(records)
        return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}

    questions, contexts, answers = _squad_cases()
    cases = [
        (TaskDataConfig(kind="question-answering", max_len=40, doc_stride=8, max_query_len=12, version_2=True),
         {"id": [f"q{i}" for i in range(7)], "question": questions, "context": contexts, "answers": answers}),
        (TaskDataConfig(kind="token-classification", max_len=12, labels=("B-X", "I-X", "O")),
         {"tokens": [["a", "Bb", "c"], ["dd"]], "tags": [["B-X", "I-X", "O"], ["O"]]}),
        (TaskDataConfig(kind="classification", max_len=12, labels=("0", "1")), {"sentence1": ["a b", "c"], "sentence2": ["d", "e f"], "label": [1, 0], "idx": [3, 4]}),
        (TaskDataConfig(kind="multiple-choice", max_len=12), {"context": ["a", "b"], "options": [["x", "y"], ["z", "w"]], "label": [1, 0]}),
        (TaskDataConfig(kind="embedding", max_len=12), {"anchor": ["a b", "c"], "positive": ["d", "e f"], "negatives": [["x", "y"], ["z", "w"]]}),
    ]
    for cfg, records in cases:
        batch = arrow_numpy(records)
        assert check_records(batch, cfg) == []
        ours, ref = encode_task(batch, tok, cfg), encode_task(records, tok, cfg)
        assert ours.keys() == ref.keys()
        for key in ours:
            np.testing.assert_array_equal(ours[key], ref[key], err_msg=f"{cfg.kind} {key}")


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"TaskDataConfig.kind='ner'"):
        TaskDataConfig(kind="ner")
    with pytest.raises(ValueError, match=r"TaskDataConfig.input_style"):
        TaskDataConfig(input_style="t5")
    with pytest.raises(ValueError, match=r"TaskDataConfig.doc_stride=128: windows must advance"):
        TaskDataConfig(kind="question-answering", max_len=128)
    with pytest.raises(ValueError, match=r"TaskDataConfig.max_len=2"):
        TaskDataConfig(max_len=2)
    assert TaskDataConfig(labels=["x", "y"]).labels == ("x", "y")


def test_flatten_squad_v1_and_v2(tmp_path):
    squad = {
        "version": "v2.0",
        "data": [{"title": "Normans", "paragraphs": [{"context": CONTEXT, "qas": [
            {"id": "1", "question": "Where?", "answers": [{"text": "France", "answer_start": CONTEXT.index("France")}, {"text": "France", "answer_start": CONTEXT.index("France")}]},
            {"id": "2", "question": "Who?", "answers": [], "plausible_answers": [{"text": "Rollo", "answer_start": 5}], "is_impossible": True},
        ]}]}],
    }
    flat = flatten_squad(squad)
    assert flat["id"] == ["1", "2"] and flat["title"] == ["Normans"] * 2 and flat["context"] == [CONTEXT] * 2
    assert flat["answers"][0] == {"text": ["France", "France"], "answer_start": [CONTEXT.index("France")] * 2}
    assert flat["answers"][1] == {"text": [], "answer_start": []}
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(squad))
    assert read_squad_json(str(path)) == flat
    with pytest.raises(ValueError, match="expected an object with a 'data' list"):
        flatten_squad({"version": "1.1"})
    with pytest.raises(ValueError, match=r"data\[0\] has no 'paragraphs' list"):
        flatten_squad({"data": [{"title": "x"}]})
