"""A fine-tuning round (train.kind: finetune): continued from the fine-tuned @production version on
the task files that landed under trigger.watch, both versions scored with the task's metrics
(jobs.training.finetune.score_split) on one held-out split, the backbones' drift on its texts, the gate.
Training returns saved checkpoints of known behaviour, so the decisions are tested in seconds;
Ray Data reads the splits (the session's Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from jobs.operations.schedule import ScheduleState, new_shards, run_round
from jobs.operations.schedule_config import ScheduleError, load_schedule, validate

REPO = Path(__file__).resolve().parents[3]
LABELS = ["noun.x", "noun.y"]


def task_versions(root: Path) -> dict[str, Path]:
    """Tiny fine-tuned BERTs sharing a tokenizer: "x" answers noun.x for every input, "y" noun.y
    (a zero classifier and a strong bias), on backbones of different seeds (so the space moves)."""
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model
    from ctxmodels.tasks import TaskConfig, build_task_model
    from pipelines.sources import sample_text
    from pipelines.tokenizers import train_tokenizer

    tok = train_tokenizer("wordpiece", sample_text([str(REPO / "data/sample/wordnet-0007-of-0008.txt.gz")], 50_000), 400)
    tok.save(root / "tok")
    task = TaskConfig(kind="classification", num_labels=2, labels=LABELS)
    out = {}
    for seed, name in enumerate(("x", "y")):
        cfg, _ = build_model("bert", "tiny", {"vocab_size": tok.vocab_size, "nsp": False, "n_layer": 1}, seed=seed)
        model = build_task_model("bert", cfg, task, torch.Generator().manual_seed(seed))
        with torch.no_grad():
            model.classifier.weight.zero_()
            model.classifier.bias.copy_(torch.tensor([5.0, -5.0] if name == "x" else [-5.0, 5.0]))
        out[name] = save_checkpoint(root / name, model, "bert", cfg, tokenizer_dir=root / "tok", task=task)
    return out


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> dict[str, Path]:
    return task_versions(tmp_path_factory.mktemp("task-versions"))


def write_split(path: Path, n_x: int, n_y: int, start: int = 0) -> Path:
    """Records of lexname's texts labelled noun.x then noun.y."""
    lines = (REPO / "data/tasks/lexname/validation.jsonl").read_text().splitlines()[start : start + n_x + n_y]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"sentence1": json.loads(line)["sentence1"], "label": LABELS[i >= n_x]}) + "\n"
                            for i, line in enumerate(lines)))
    return path


def schedule(tmp: Path, model: str, gates: dict) -> dict:
    return {
        "name": "ft", "model": model, "state_uri": str(tmp / "state"),
        "trigger": {"watch": str(tmp / "incoming")},
        "train": {"kind": "finetune", "recipe": "configs/finetune/tiny-lexname.yaml", "set": ["train.epochs=1"],
                  "output_dir": str(tmp / "rounds")},
        "evaluate": {"held_out": str(tmp / "heldout.jsonl"), "n_probes": 12, "k": 3},
        "gates": gates,
    }


class _Trained:
    """What jobs.training.finetune.finetune returns: the run's newest and best checkpoints."""

    def __init__(self, best: Path, recipes: list):
        self.run_uri, self.checkpoint_uri, self.best_checkpoint = str(best.parent), str(best.parent / "newest-unused"), str(best)
        self.recipes = recipes


def test_finetune_round_scores_task_metrics_gates_and_promotes(ray_session, versions, tmp_path):
    from jobs.registry import Registry

    v = versions
    write_split(tmp_path / "heldout.jsonl", 30, 10)  # noun.x answers 3/4 right, noun.y 1/4
    write_split(tmp_path / "incoming/day-1.jsonl", 6, 2, start=100)
    (tmp_path / "incoming/notes.txt").write_text("not a split format: not new task data\n")
    registry = Registry()  # the session's SQLite store (tests/conftest.py)
    name = f"schedft-{tmp_path.name[-12:]}".replace("_", "-")
    prod = registry.register(name, str(v["y"]))
    registry.promote(name, prod.version)
    recipes: list = []

    def train(best: Path):
        def run(recipe, log):
            recipes.append(recipe)
            return _Trained(best, recipes)
        return run

    # noun.x (accuracy 0.75) against production noun.y (0.25): a gain of 0.5 passes min_absolute_change 0.4
    cfg = validate(schedule(tmp_path, name, {"accuracy": {"min_absolute_change": 0.4}, "f1": {"threshold": 0.1},
                                             "cka": {"threshold": -1.0}}), base=REPO)
    assert new_shards(cfg, ScheduleState(cfg.state_uri)) == [str(tmp_path / "incoming/day-1.jsonl")]
    out = run_round(cfg, "watch", log=lambda *_: None, registry=registry, train=train(v["x"]))
    assert out["status"] == "promoted", out.get("reason")
    r = recipes[0]
    assert r.model.init == prod.source and r.data.train == [str(tmp_path / "incoming/day-1.jsonl")]
    assert r.data.test is None and r.registry.enabled is False and r.name == "ft-round-0001"
    assert r.model.head == "continue"  # production's head and label set go on learning
    assert r.data.validation == "data/tasks/lexname/validation.jsonl"  # the recipe's: it picks the best checkpoint
    cand, old = out["metrics"]["candidate"], out["metrics"]["production"]
    assert cand["accuracy"] == pytest.approx(0.75) and old["accuracy"] == pytest.approx(0.25)
    assert set(cand) >= {"loss", "accuracy", "f1", "mcc", "knn_overlap", "cka"} and old["cka"] == 1.0
    assert cand["cka"] < 0.999  # different backbones: the space moved
    assert out["candidate"]["source"] == str(v["x"])  # the run's best checkpoint, not its newest
    new = registry.get(f"{name}@production")
    assert new.version == out["candidate"]["version"] and new.tags["ctx.parent"] == prod.ref
    assert new.tags["metric.accuracy"] == "0.75" and new.tags["gate"] == "passed"

    # the next day's files, and a candidate that answers noun.y: 0.25 against 0.75, gated out
    write_split(tmp_path / "incoming/day-2.jsonl", 6, 2, start=200)
    out = run_round(cfg, "watch", log=lambda *_: None, registry=registry, train=train(v["y"]))
    assert out["status"] == "gated" and recipes[1].model.init == new.source
    assert recipes[1].data.train == [str(tmp_path / "incoming/day-2.jsonl")]
    assert "accuracy: change -0.5 vs production 0.75 < min_absolute_change 0.4" in out["reason"]
    assert "f1:" not in out["reason"] and "cka:" not in out["reason"]  # those gates passed
    assert registry.get(f"{name}@production").version == new.version  # production untouched
    assert registry.get(f"{name}/{out['candidate']['version']}").tags["gate"] == "failed"
    assert [x["status"] for x in ScheduleState(cfg.state_uri).rounds()] == ["promoted", "gated"]


@pytest.mark.slow
@pytest.mark.extended  # make test-all
def test_real_finetune_round_continues_production_through_ray_train(ray_session, versions, tmp_path):
    """One round with a real ctx finetune run (1 worker, 2 steps): the candidate continues
    production's head (its noun.x bias is still there), is scored and promoted."""
    from safetensors.torch import load_file

    from jobs.registry import Registry

    v = versions
    write_split(tmp_path / "heldout.jsonl", 30, 10)
    write_split(tmp_path / "val.jsonl", 6, 2, start=300)
    write_split(tmp_path / "incoming/day-1.jsonl", 12, 4, start=100)  # 2 steps of 8
    registry = Registry()
    name = f"schedft-real-{tmp_path.name[-8:]}".replace("_", "-")
    prod = registry.register(name, str(v["x"]))
    registry.promote(name, prod.version)
    spec = schedule(tmp_path, name, {"accuracy": {"min_absolute_change": -0.05}})
    spec["train"]["set"] += ["train.batch_size=8", "scaling.num_workers=1", f"data.validation={tmp_path / 'val.jsonl'}"]
    cfg = validate(spec, base=REPO)
    lines: list[str] = []
    out = run_round(cfg, "watch", log=lines.append, registry=registry)
    assert out["status"] == "promoted", (out.get("reason"), out.get("error"), lines[-20:])
    source = out["candidate"]["source"]
    assert source.startswith(str(tmp_path / "rounds" / "ft-round-0001"))
    bias = load_file(str(Path(source) / "model.safetensors"))["classifier.bias"]
    assert torch.allclose(bias, torch.tensor([5.0, -5.0]), atol=0.1)  # continued, not a fresh zero-bias head
    assert out["metrics"]["candidate"]["accuracy"] == pytest.approx(0.75)
    assert registry.get(f"{name}@production").version == out["candidate"]["version"]


def test_continued_head_refuses_a_plain_checkpoint_and_new_classes(ray_session, versions, tmp_path):
    """model.head: continue (what a round sets) fails before Ray Train starts, naming the key."""
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model
    from jobs.training.config import RecipeError
    from jobs.training.finetune import finetune
    from jobs.training.finetune_config import load_finetune_recipe

    cfg, model = build_model("bert", "tiny", {"vocab_size": 400, "nsp": False, "n_layer": 1}, seed=0)
    plain = save_checkpoint(tmp_path / "plain", model, "bert", cfg, tokenizer_dir=versions["x"].parent / "tok")
    train = write_split(tmp_path / "train.jsonl", 6, 2)

    def run(init: str, split: Path):
        recipe = load_finetune_recipe(REPO / "configs/finetune/tiny-lexname.yaml", [
            f"model.init={init}", "model.head=continue", f"data.train={split}", "data.validation=null", "data.test=null",
            "train.patience=null", f"output_dir={tmp_path / 'runs'}", "scaling.num_workers=1", "train.batch_size=8"])
        with pytest.raises(RecipeError) as e:
            finetune(recipe, progress=False, log=lambda *_: None)
        return str(e.value)

    assert "model.head: continue needs a fine-tuned classification checkpoint" in run(str(plain), train)
    lines = train.read_text().splitlines()
    train.write_text("\n".join(lines[:-1] + [json.dumps({"sentence1": "a new class", "label": "noun.z"})]) + "\n")
    msg = run(str(versions["x"]), train)
    assert msg.startswith("data.train: labels ['noun.z'] are not classes of model.init's head") and "model.head: fresh" in msg


def test_finetune_gates_name_task_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ScheduleError) as e:
        validate(schedule(tmp_path, "m", {"eval_ppl": {"threshold": 100}}), base=REPO)
    msg = str(e.value)
    assert "gates.eval_ppl" in msg and "fine-tuning round (classification)" in msg
    assert "'accuracy', 'f1', 'mcc'" in msg and "'cka'" in msg
    # and the other way round: a pretraining round has no task accuracy
    base = yaml.safe_load((REPO / "configs/schedule/bert-tiny.yaml").read_text())
    with pytest.raises(ScheduleError, match=r"gates\.accuracy: not a metric a pretraining round measures"):
        validate({**base, "gates": {"accuracy": {"threshold": 0.5}}}, base=REPO)
    # a bad key in the fine-tuning recipe's overrides is named too
    bad = schedule(tmp_path, "m", {})
    bad["train"]["set"] = ["task.metric=eval_acc"]
    with pytest.raises(ScheduleError, match="task.metric"):
        validate(bad, base=REPO)


def test_example_finetune_schedule_loads(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_schedule("configs/schedule/tiny-lexname.yaml")
    assert cfg.train.kind == "finetune" and cfg.recipe["task"]["kind"] == "classification"
    assert set(cfg.gates) <= {"loss", "accuracy", "f1", "mcc", "knn_overlap", "cka"}
