"""Pieces of a round without Ray: both versions scored on the same held-out data, the drift of the
embedding space, the history and shards seen under state_uri (on the loopback S3 endpoint), and a
second round refused while one runs."""

from __future__ import annotations

from pathlib import Path

import boto3
import pytest

from jobs.operations.schedule import ScheduleState, evaluate_pair, new_shards, probe_texts, run_round
from jobs.operations.schedule_config import validate
from tests.jobs.operations.test_schedule_roll import tiny_versions

REPO = Path(__file__).resolve().parents[3]
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


def test_a_retrieval_benchmark_scores_both_versions_for_its_gates(versions, tmp_path):
    from tests.jobs.evaluation.test_retrieval_eval import write_beir

    docs = {f"d{i}": t for i, t in enumerate(["the river bank", "a bank loan", "a fish swims", "the stock market", "a cat sleeps"])}
    bench = write_beir(tmp_path / "beir", docs, {"q1": "money at the bank", "q2": "a pet"}, [("q1", "d1", 1), ("q2", "d4", 1)])
    cfg = validate(schedule(str(tmp_path / "state"), evaluate={"held_out": HELD_OUT, "max_samples": 8, "n_probes": 6, "k": 3,
                                                                "retrieval": str(bench)},
                            gates={"retrieval_ndcg_at_10": {"min_absolute_change": 0.0}}), base=REPO)
    cand, prod = evaluate_pair(cfg, str(versions[1]), str(versions[0]), log=lambda *_: None)
    for m in (cand, prod):
        assert {"retrieval_ndcg_at_10", "retrieval_recall_at_1", "retrieval_map_at_100"} <= set(m) and 0 < m["retrieval_ndcg_at_10"] <= 1
    assert cand["retrieval_ndcg_at_10"] != prod["retrieval_ndcg_at_10"] or cand["retrieval_mrr_at_10"] != prod["retrieval_mrr_at_10"]
    same, _ = evaluate_pair(cfg, str(versions[0]), str(versions[0]), log=lambda *_: None)
    assert same["retrieval_ndcg_at_10"] == prod["retrieval_ndcg_at_10"]  # the same version, the same score


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


class _Trained:
    """What jobs.training.train.pretrain returns, for a checkpoint of known weights: the decisions of a round
    are tested here in seconds; the e2e test trains for real."""

    def __init__(self, checkpoint: Path):
        self.run_uri, self.checkpoint_uri = str(checkpoint.parent), str(checkpoint)


def test_decisions_failed_gated_promoted(versions, tmp_path):
    from jobs.registry import Registry

    incoming = tmp_path / "incoming"
    incoming.mkdir()
    (incoming / "new-0.txt").write_text("the river bank\n")
    registry = Registry()  # the session's SQLite store (tests/conftest.py)
    name = f"sched-{tmp_path.name[-12:]}".replace("_", "-")
    v1 = registry.register(name, str(versions[0]))
    registry.promote(name, v1.version)
    base = schedule(str(tmp_path / "state"), watch=str(incoming), model=name)
    seen: list = []

    def boom(recipe, log):
        seen.append(recipe)
        raise RuntimeError("the cluster is gone")

    cfg = validate(base, base=REPO)
    out = run_round(cfg, "watch", log=lambda *_: None, registry=registry, train=boom)
    assert out["status"] == "failed" and "the cluster is gone" in out["reason"]
    assert seen[0].model.init == v1.source and seen[0].data.input == [str(incoming / "new-0.txt")]
    assert seen[0].name == "t-round-0001" and seen[0].tokenizer.path is None
    assert registry.get(f"{name}@production").version == v1.version and len(registry.versions(name)) == 1
    assert new_shards(cfg, ScheduleState(cfg.state_uri)) == [str(incoming / "new-0.txt")]  # tried again next time

    gated = validate({**base, "gates": {"eval_acc": {"min_absolute_change": 0.5}, "cka": {"threshold": 0.0}}}, base=REPO)
    out = run_round(gated, "watch", log=lambda *_: None, registry=registry, train=lambda r, log: _Trained(versions[1]))
    assert out["status"] == "gated" and out["round"] == 2
    assert "eval_acc" in out["reason"] and "min_absolute_change 0.5" in out["reason"] and "cka" not in out["reason"]
    v2 = registry.get(f"{name}/{out['candidate']['version']}")
    assert v2.tags["gate"] == "failed" and "production" not in v2.aliases and v2.tags["ctx.parent"] == v1.ref
    assert registry.get(f"{name}@production").version == v1.version
    assert new_shards(gated, ScheduleState(gated.state_uri)) == []  # judged: not trained on again

    (incoming / "new-1.txt").write_text("a loan from the bank\n")
    passing_gates = {"eval_acc": {"min_absolute_change": -1.0}}
    passing = validate({**base, "gates": passing_gates}, base=REPO)
    out = run_round(passing, "watch", log=lambda *_: None, registry=registry, train=lambda r, log: _Trained(versions[1]))
    assert out["status"] == "promoted" and out["shards"] == [str(incoming / "new-1.txt")]
    assert registry.get(f"{name}@production").version == out["candidate"]["version"]
    assert [r["status"] for r in ScheduleState(passing.state_uri).rounds()] == ["failed", "gated", "promoted"]
    # nothing new now: a watch round is not even recorded
    assert run_round(passing, "watch", log=lambda *_: None, registry=registry)["status"] == "skipped"
    assert len(ScheduleState(passing.state_uri).rounds()) == 3

    # train.data_from: all -- a new shard starts the round, which trains on everything under the watch
    (incoming / "new-2.txt").write_text("the bank of the river\n")
    everything = validate({**base, "train": {**base["train"], "data_from": "all"}, "gates": passing_gates}, base=REPO)
    out = run_round(everything, "watch", log=lambda *_: None, registry=registry,
                    train=lambda r, log: seen.append(r) or _Trained(versions[1]))
    assert out["status"] == "promoted" and out["shards"] == [str(incoming / "new-2.txt")] and out["trained_on"] == 3
    assert sorted(seen[-1].data.input) == sorted(str(incoming / f"new-{i}.txt") for i in range(3))


@pytest.mark.slow
def test_reembed_step_writes_the_new_version_beside_the_old(ray_session, versions, tmp_path):
    """Step 5: a promoted version's vectors go to <output>/v<N>/, next to earlier versions' folders,
    which stay as they were; asking again for the same version (a retried round) resumes its folder:
    nothing is embedded again or overwritten."""
    import pyarrow as pa
    import pyarrow.dataset as pads
    import pyarrow.parquet as pq

    from jobs.registry import ModelVersion
    from jobs.operations.schedule import reembed

    texts = tmp_path / "texts"
    texts.mkdir()
    pq.write_table(pa.table({"id": [7, 3, 11], "text": ["the river bank", "a loan", "bank"]}), texts / "part-0.parquet")
    old = tmp_path / "vectors" / "v1"
    old.mkdir(parents=True)
    (old / "part-0.parquet").write_bytes(b"the old version's vectors")
    step = {"input": str(texts), "output": str(tmp_path / "vectors"), "dimensions": 16, "precision": "ubinary"}  # as ctx embed's flags
    cfg = validate(schedule(str(tmp_path / "state"), reembed=step), base=REPO)
    assert (cfg.reembed.pooling, cfg.reembed.normalize) == (None, None)  # the model's own, as the served model answers
    v2 = ModelVersion("m", 2, str(versions[1]), ("production",), {}, None)
    out = reembed(cfg, v2)
    assert out["status"] == "done" and out["output"] == str(tmp_path / "vectors" / "v2") and out["rows"] == 3
    assert out["precision"] == "ubinary" and out["dim"] == 2  # 16 sign bits: 2 bytes
    table = pads.dataset(str(tmp_path / "vectors" / "v2"), format="parquet").to_table()
    assert sorted(table.column("id").to_pylist()) == [3, 7, 11]
    assert table.schema.field("embedding").type == pa.list_(pa.uint8(), 2)
    assert (old / "part-0.parquet").read_bytes() == b"the old version's vectors"
    written = {p.name: p.read_bytes() for p in (tmp_path / "vectors" / "v2").iterdir()}
    again = reembed(cfg, v2)
    assert again["status"] == "done" and again["resumed"] == 3 and again["rows"] == 3
    assert {p.name: p.read_bytes() for p in (tmp_path / "vectors" / "v2").iterdir()} == written


def test_a_failed_round_is_retried_only_after_retry_after_s():
    from jobs.operations.schedule import retry_wait

    failed = {"round": 1, "status": "failed", "started_ts": 1000.0}
    assert retry_wait([], 3600, 2000.0) == 0.0
    assert retry_wait([failed], 3600, 2000.0) == 2600.0
    assert retry_wait([failed], 3600, 5000.0) == 0.0
    assert retry_wait([failed, {"round": 2, "status": "skipped"}], 3600, 2000.0) == 2600.0  # a skip is not a retry
    assert retry_wait([failed, {"round": 2, "status": "gated", "started_ts": 1500.0}], 3600, 2000.0) == 0.0
