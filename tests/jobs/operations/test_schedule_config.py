"""The gate (MLflow MetricThreshold semantics) and the schedule config's validation."""

from pathlib import Path

import pytest
import yaml

from jobs.operations.schedule_config import MetricGate, ScheduleError, check_gate, decide, load_schedule

REPO = Path(__file__).resolve().parents[3]


def test_threshold_follows_the_metric_direction():
    g = MetricGate(threshold=0.5)
    assert check_gate("eval_acc", g, 0.6, None).passed
    assert not check_gate("eval_acc", g, 0.4, None).passed
    # perplexity: lower is better, so the threshold is a ceiling
    assert check_gate("eval_ppl", MetricGate(threshold=100.0), 80.0, None).passed
    r = check_gate("eval_ppl", MetricGate(threshold=100.0), 120.0, None)
    assert not r.passed and "<= threshold 100" in r.reason
    # an explicit greater_is_better wins over the name
    assert not check_gate("eval_ppl", MetricGate(threshold=100.0, greater_is_better=True), 80.0, None).passed


def test_changes_against_production():
    g = MetricGate(min_absolute_change=0.01)
    assert check_gate("eval_acc", g, 0.52, 0.50).passed
    r = check_gate("eval_acc", g, 0.505, 0.50)
    assert not r.passed and "min_absolute_change 0.01" in r.reason
    # a negative change is a tolerance
    assert check_gate("eval_acc", MetricGate(min_absolute_change=-0.01), 0.495, 0.50).passed
    assert not check_gate("eval_acc", MetricGate(min_absolute_change=-0.01), 0.485, 0.50).passed
    # relative, lower is better: 10% lower perplexity is a +0.1 relative change
    assert check_gate("eval_ppl", MetricGate(min_relative_change=0.05), 90.0, 100.0).passed
    assert not check_gate("eval_ppl", MetricGate(min_relative_change=0.05), 97.0, 100.0).passed
    # without production's value a change cannot be judged: the gate fails, saying so
    r = check_gate("eval_acc", g, 0.9, None)
    assert not r.passed and "no production value" in r.reason


def test_missing_or_nan_candidate_fails_and_decide_needs_every_gate():
    assert not check_gate("eval_acc", MetricGate(threshold=0.0), float("nan"), 0.5).passed
    gates = {"eval_acc": MetricGate(threshold=0.1), "cka": MetricGate(threshold=0.9)}
    ok, results = decide(gates, {"eval_acc": 0.2, "cka": 0.95}, {"eval_acc": 0.1})
    assert ok and all(r.passed for r in results)
    ok, results = decide(gates, {"eval_acc": 0.2, "cka": 0.5}, {})
    assert not ok and [r.metric for r in results if not r.passed] == ["cka"]
    assert decide({}, {}, {})[0]  # no gates: nothing to refuse


def test_gate_needs_a_condition():
    with pytest.raises(ValueError, match="at least one"):
        MetricGate(greater_is_better=True)


def _write(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load((REPO / "configs/schedule/bert-tiny.yaml").read_text())
    for key, value in changes.items():
        node = data
        *parents, last = key.split(".")
        for p in parents:
            node = node[p]
        node[last] = value
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_example_config_loads_with_its_recipe_and_serve_app(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_schedule("configs/schedule/bert-tiny.yaml")
    assert cfg.recipe["train"]["max_steps"] == 100  # train.set applied to the recipe
    assert cfg.serve.app["models"]["bert"]["uri"] == "runs/bert-tiny"
    assert cfg.gates["eval_ppl"].min_relative_change == -0.05


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"gates": {"eval_accuracy": {"threshold": 0.1}}}, "gates.eval_accuracy"),
        ({"gates": {"eval_acc": {"treshold": 0.1}}}, "gates.eval_acc.treshold"),
        ({"trigger": {"poll_s": 5}}, "trigger: give cron, watch or both"),
        ({"trigger.cron": "every day"}, "trigger.cron"),
        ({"train.set": ["train.lr=-1"]}, "train.lr"),
        ({"serve.model": "nope"}, "serve.model"),
        ({"name": "a b"}, "name"),
        ({"gates": {"retrieval_ndcg_at_10": {"min_absolute_change": 0.0}}}, "gates.retrieval_ndcg_at_10: needs evaluate.retrieval"),
        ({"gates": {"retrieval_ndcg_at_5": {"min_absolute_change": 0.0}}, "evaluate.retrieval": "b"}, "gates.retrieval_ndcg_at_5"),
    ],
)
def test_errors_name_the_key(tmp_path, monkeypatch, change, key):
    monkeypatch.chdir(REPO)
    path = _write(tmp_path, **change)
    with pytest.raises(ScheduleError) as e:
        load_schedule(path)
    assert key in str(e.value)


def test_a_multiplexed_model_can_be_rolled_and_an_unknown_one_is_named(tmp_path, monkeypatch):
    from jobs.operations.schedule import serve_config_with

    monkeypatch.chdir(REPO)
    app = tmp_path / "app.yaml"
    app.write_text(yaml.safe_dump({"models": {"bert": "runs/bert-tiny"}, "multiplexed": {"models": {"ft": "runs/ft", "other": "runs/o"}}}))
    cfg = load_schedule(_write(tmp_path, **{"serve.config": str(app), "serve.model": "ft"}))
    rolled = serve_config_with(cfg.serve.app, "ft", "runs/ft-v2")
    assert rolled.multiplexed.models == {"ft": "runs/ft-v2", "other": "runs/o"} and rolled.models["bert"].uri == "runs/bert-tiny"
    pinned = serve_config_with(cfg.serve.app, "bert", "runs/bert-v2")
    assert pinned.models["bert"].uri == "runs/bert-v2" and pinned.multiplexed.models["ft"] == "runs/ft"
    with pytest.raises(ScheduleError) as e:
        load_schedule(_write(tmp_path, **{"serve.config": str(app), "serve.model": "nope"}))
    assert "serve.model" in str(e.value) and "'nope' is not a model" in str(e.value) and "['bert', 'ft', 'other']" in str(e.value)


def test_the_schedulers_own_storage_waits_end_at_its_retry_deadline(tmp_path, monkeypatch, closed_port):
    """Watching for new shards against an endpoint that refuses every connection: the scheduler's
    calls take schedule.yaml's retry_deadline_s (not the 300 s default) and the error names it."""
    import time

    from jobs.operations.schedule import ScheduleState, new_shards
    from pipelines.storage import StorageError

    monkeypatch.chdir(REPO)
    cfg = load_schedule(_write(tmp_path, endpoint_url=closed_port, retry_deadline_s=2, **{"trigger.watch": "s3://corp/incoming/"}))
    assert cfg.store.deadline_s == 2
    start = time.monotonic()
    with pytest.raises(StorageError, match=r"in 2 s \(retry_deadline_s=2\)"):
        new_shards(cfg, ScheduleState(str(tmp_path / "state"), cfg.store))
    assert time.monotonic() - start < 10


def test_a_fine_tuning_rounds_gates_are_its_recipes_validation_metrics():
    from jobs.operations.schedule_config import round_metrics

    retrieval = round_metrics("finetune", {"task": {"kind": "embedding"}})
    scored = round_metrics("finetune", {"task": {"kind": "embedding", "loss": "cosent"}})  # pairs scored for similarity
    assert "ndcg_at_10" in retrieval and "spearman_cosine" not in retrieval
    assert {"spearman_cosine", "pearson_cosine", "loss"} <= set(scored) and "ndcg_at_10" not in scored
    assert "accuracy" in round_metrics("finetune", {"task": {"kind": "classification", "loss": "cosent"}})  # (refused by the recipe itself)
