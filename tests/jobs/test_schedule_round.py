"""Pieces of a round without Ray: both versions scored on the same held-out data, the drift of the
embedding space, the history and shards seen under state_uri (on the loopback S3 endpoint), and a
second round refused while one runs."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest

from jobs.schedule import ScheduleState, evaluate_pair, new_shards, probe_texts, run_round
from jobs.schedule_config import validate
from tests.jobs.test_schedule_roll import tiny_versions

REPO = Path(__file__).resolve().parents[2]
HELD_OUT = str(REPO / "data/sample/wordnet-0007-of-0008.txt.gz")


def schedule(state_uri: str, watch: str | None = None, **extra) -> dict:
    return {
        "name": "t", "model": "bert-tiny", "state_uri": state_uri,
        "trigger": {"watch": watch} if watch else {"cron": "0 3 * * *"},
        "train": {"recipe": "configs/bert-tiny.yaml", "set": ["data.seq_len=32", "train.batch_size=8"]},
        "evaluate": {"held_out": HELD_OUT, "max_samples": 16, "n_probes": 12, "k": 5},
        **extra,
    }


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> list[Path]:
    return tiny_versions(tmp_path_factory.mktemp("versions"), 2)


def test_same_version_scores_the_same_and_has_not_moved(versions, tmp_path):
    cfg = validate(schedule(str(tmp_path / "state")), base=REPO)
    cand, prod = evaluate_pair(cfg, str(versions[0]), str(versions[0]), log=lambda *_: None)
    for k in ("eval_loss", "eval_ppl", "eval_acc"):
        assert cand[k] == prod[k], k  # same batches, same masks, same weights
    assert cand["knn_overlap"] == 1.0 and cand["cka"] == pytest.approx(1.0)
    assert prod["knn_overlap"] == prod["cka"] == 1.0
    cand, prod = evaluate_pair(cfg, str(versions[1]), str(versions[0]), log=lambda *_: None)
    assert cand["eval_loss"] != prod["eval_loss"]
    assert cand["knn_overlap"] < 1.0 and cand["cka"] < 0.999
    assert len(probe_texts(cfg)) == 12 and len(set(probe_texts(cfg))) == 12


def test_state_on_s3_new_shards_and_no_overlapping_rounds(s3_bucket):
    s3 = boto3.client("s3")
    bucket = f"s3://{s3_bucket}"
    cfg = validate(schedule(f"{bucket}/state", watch=f"{bucket}/incoming/"), base=REPO)
    state = ScheduleState(cfg.state_uri)
    assert new_shards(cfg, state) == []  # the prefix does not exist yet: nothing new, no error
    s3.put_object(Bucket=s3_bucket, Key="incoming/a.txt", Body=b"a line\\n")
    s3.put_object(Bucket=s3_bucket, Key="incoming/b.txt", Body=b"a line\\n")
    assert new_shards(cfg, state) == [f"{bucket}/incoming/a.txt", f"{bucket}/incoming/b.txt"]
    state.add_seen([f"{bucket}/incoming/a.txt"])
    assert new_shards(cfg, ScheduleState(cfg.state_uri)) == [f"{bucket}/incoming/b.txt"]
    # a round in progress (written by another process) keeps a second one from starting
    import time

    state.save_round({"round": 1, "status": "running", "started": "now", "started_ts": time.time(), "host": "elsewhere"})
    out = run_round(cfg, "once", log=lambda *_: None)
    assert out["status"] == "busy" and "round 1 is running" in out["reason"]
    assert [r["round"] for r in state.rounds()] == [1]
