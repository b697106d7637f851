"""The committed WordNet tasks (data/tasks, built by data/build_tasks.py, and definitions by
data/build_definitions.py from qa) keep their promises: spans point at their words, answers at their
text, labels balanced, splits disjoint, IOB2 valid, and a rebuild gives the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "data" / "tasks"
SPLITS = ("train", "validation", "test")
WORDNET = Path("/usr/share/wordnet")


def load(task: str, split: str) -> list[dict]:
    with open(TASKS / task / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("task", ["lexname", "wic", "supersense", "qa", "definitions"])
def test_files_sorted_unique_ids_disjoint_splits(task):
    ids = {}
    for split in SPLITS:
        records = load(task, split)
        assert records, f"{task}/{split} is empty"
        split_ids = [r["id"] for r in records]
        assert split_ids == sorted(split_ids) and len(set(split_ids)) == len(split_ids)
        ids[split] = set(split_ids)
    assert not (ids["train"] & ids["validation"]) and not (ids["train"] & ids["test"]) and not (ids["validation"] & ids["test"])


def test_lexname():
    labels = set()
    texts = {}
    for split in SPLITS:
        for r in load("lexname", split):
            assert set(r) == {"id", "sentence1", "label"} and r["sentence1"]
            labels.add(r["label"])
            assert texts.setdefault(r["sentence1"], split) == split  # a text never in two splits
    assert len(labels) == 20


def test_wic_spans_balance_and_lemma_split():
    lemmas, pairs = {}, {}
    for split in SPLITS:
        records = load("wic", split)
        assert Counter(r["label"] for r in records) == {0: len(records) // 2, 1: len(records) // 2}
        for r in records:
            for k in ("1", "2"):  # the span is whole words: "bank", "banks", "was" (be), "took off"
                text, start, end = r[f"sentence{k}"], r[f"start{k}"], r[f"end{k}"]
                assert 0 <= start < end <= len(text) and len(text[start:end].split()) == len(r["word"].split()), r["id"]
                assert (start == 0 or not text[start - 1].isalnum()) and (end == len(text) or not text[end].isalnum()), r["id"]
            key = frozenset((r["sentence1"], r["sentence2"]))
            assert key not in pairs, f"pair {r['id']} appears twice"
            pairs[key] = split
            assert lemmas.setdefault((r["word"], r["pos"]), split) == split  # test lemmas unseen in train


def test_supersense_iob2():
    for split in SPLITS:
        for r in load("supersense", split):
            tokens, tags, i, j = r["tokens"], r["tags"], r["target_start"], r["target_end"]
            assert len(tokens) == len(tags) and 0 <= i < j <= len(tokens)
            label = tags[i][2:]
            assert tags[i] == f"B-{label}" and label.split(".")[0] in ("noun", "verb")
            assert tags[i + 1 : j] == [f"I-{label}"] * (j - i - 1)
            assert all(t == "O" for k, t in enumerate(tags) if not i <= k < j)


def test_qa_answers_point_at_their_text_and_nested_equals_flat():
    for split in SPLITS:
        for r in load("qa", split):
            a = r["answers"]
            assert a["text"] and len(a["text"]) == len(a["answer_start"])
            for text, start in zip(a["text"], a["answer_start"]):
                assert r["context"][start : start + len(text)] == text, r["id"]
    nested = json.loads((TASKS / "qa" / "validation-squad.json").read_text(encoding="utf-8"))
    assert nested["version"] == "1.1"
    flat = []
    for article in nested["data"]:
        for p in article["paragraphs"]:
            for q in p["qas"]:
                answers = {"text": [x["text"] for x in q["answers"]], "answer_start": [x["answer_start"] for x in q["answers"]]}
                flat.append({"id": q["id"], "title": article["title"], "context": p["context"], "question": q["question"], "answers": answers})
    assert sorted(flat, key=lambda r: r["id"]) == load("qa", "validation")


def test_definitions_are_qas_definition_questions_with_a_same_topic_negative(tmp_path):
    for split in SPLITS:
        qa = {r["id"]: r for r in load("qa", split)}
        records = load("definitions", split)
        assert len(records) >= 0.95 * sum(i.endswith(".def") for i in qa)
        for r in records:
            source = qa[r["id"]]
            assert r["anchor"] == source["question"] and r["positive"] == source["answers"]["text"][0]
            assert r["negative"] != r["positive"] and r["negative"] in source["context"]  # the same document: the same topic
    subprocess.run([sys.executable, str(REPO / "data" / "build_definitions.py"), "--out", str(tmp_path)], check=True, capture_output=True)
    for split in SPLITS:
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (TASKS / "definitions" / f"{split}.jsonl").read_bytes(), split


def test_similarity_pairs_score_a_questions_own_definition_above_its_topics_above_another_documents(tmp_path):
    for split in SPLITS:
        definitions = load("definitions", split)
        records = load("similarity", split)
        assert len(records) == 3 * len(definitions)
        for i, d in enumerate(definitions):
            own, topic, other = records[3 * i: 3 * i + 3]
            assert [x["id"] for x in (own, topic, other)] == [f"{d['id']}.{k}" for k in ("own", "topic", "other")]
            assert own["sentence1"] == topic["sentence1"] == other["sentence1"] == d["anchor"]
            assert (own["sentence2"], topic["sentence2"]) == (d["positive"], d["negative"])
            assert other["sentence2"] not in (d["positive"], d["negative"])
            assert (own["score"], topic["score"], other["score"]) == (1.0, 0.5, 0.0)
    subprocess.run([sys.executable, str(REPO / "data" / "build_similarity.py"), "--out", str(tmp_path)], check=True, capture_output=True)
    for split in SPLITS:
        assert (tmp_path / f"{split}.jsonl").read_bytes() == (TASKS / "similarity" / f"{split}.jsonl").read_bytes(), split


def test_total_size_small_enough_to_commit():
    assert sum(p.stat().st_size for p in TASKS.rglob("*") if p.is_file()) < 3_700_000  # similarity (scored pairs) added 0.37 MB


@pytest.mark.skipif(not (WORDNET / "data.noun").exists(), reason="WordNet 3.0 not installed (apt-get install wordnet-base)")
def test_rebuild_is_byte_identical(tmp_path):
    subprocess.run([sys.executable, str(REPO / "data" / "build_tasks.py"), "--wordnet", str(WORDNET), "--out", str(tmp_path)], check=True, capture_output=True)
    for p in TASKS.rglob("*"):
        if p.is_file() and p.parent.name not in ("definitions", "similarity"):  # built from qa and definitions by their scripts
            assert (tmp_path / p.relative_to(TASKS)).read_bytes() == p.read_bytes(), p
