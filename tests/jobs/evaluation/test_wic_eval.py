"""ctx eval wic on the real all-MiniLM-L6-v2: contextual vectors separate word senses better than
the context-free layer, and every reported accuracy is what its threshold gives (in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jobs.evaluation.wic import CONTEXT_FREE, STRATEGIES, WordVectors, evaluate_wic, pair_scores, read_split
from pipelines.wic import accuracy_at

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def small_wic(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wic")
    for split, n in (("validation", 200), ("test", 200)):
        lines = (REPO / "data/tasks/wic" / f"{split}.jsonl").read_text().splitlines()[:n]
        (root / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_minilm_wic_beats_the_context_free_layer(minilm_dir, small_wic):
    result = evaluate_wic(str(minilm_dir), str(small_wic))
    assert set(result["strategies"]) == {*STRATEGIES, CONTEXT_FREE}
    assert result["n_dev"] == result["n_test"] == 200
    contextual = max(v["dev_accuracy"] for k, v in result["strategies"].items() if k not in ("first", CONTEXT_FREE))
    assert contextual > result["strategies"][CONTEXT_FREE]["dev_accuracy"] + 0.03
    # each test accuracy is the dev-fit threshold applied to the test pairs
    test = read_split(str(small_wic / "test.jsonl"))
    scores = pair_scores(WordVectors(str(minilm_dir)), test, ("last",))
    assert result["strategies"]["last"]["accuracy"] == pytest.approx(
        accuracy_at(scores["last"], np.asarray(test["label"]), result["strategies"]["last"]["threshold"]), abs=1e-9)


def test_a_record_without_spans_is_named(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"sentence1": "a", "sentence2": "b", "label": 1}) + "\n")
    with pytest.raises(ValueError, match=r"x.jsonl:1: .*missing \['start1'"):
        read_split(str(tmp_path / "x.jsonl"))
