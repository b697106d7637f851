"""The one Task table (ctxmodels.task_kinds.TASKS) against every layer that acts on a kind.

Adding a kind is one Task plus its line in TaskKind, and an entry in each per-layer dict where its
behaviour is new: these tests fail, naming the dict, until every layer knows the kind, and check
that what the table says of a kind is what the code does (metric names, targets, routes).
"""

from __future__ import annotations

import dataclasses
from typing import get_args

import numpy as np
import pytest
import torch

from ctxmodels.bert import PRESETS
from ctxmodels.task_kinds import TASK_KINDS, TASKS, TaskKind, task_of
from ctxmodels.tasks import LOSSES, TaskConfig, build_task_model
from jobs.training.finetune_config import FinetuneRecipe, TaskSection
from jobs.serving.serve_tasks import NEEDS
from pipelines.finetune import ENCODERS, RECORD_CHECKS, TaskDataConfig
from pipelines.metrics import METRICS

# Settings of a recipe's task section that encoding does not read (the model, decoding and the
# checkpoint choice do); every other one must reach pipelines.finetune.TaskDataConfig by name.
# language: the XLM task model's row; pooling, normalize, scale: the embedding model's (ctxmodels.tasks.TaskConfig)
RECIPE_ONLY = {"max_answer_len", "null_threshold", "lm_weight", "metric", "language", "pooling", "normalize", "scale",
               "gather_across_workers", "gradient_cache", "matryoshka_dims", "matryoshka_weights",
               "directions", "partition_mode", "hardness_mode", "hardness_strength"}


def test_one_table_names_every_kind_once():
    assert list(TASKS) == list(get_args(TaskKind)) == list(TASK_KINDS)
    assert all(task.kind == kind for kind, task in TASKS.items())
    with pytest.raises(ValueError, match="expected one of"):
        task_of("ranking")


@pytest.mark.parametrize("layer, table", [
    ("pipelines.finetune.ENCODERS", ENCODERS),
    ("pipelines.finetune.RECORD_CHECKS", RECORD_CHECKS),
    ("pipelines.metrics.METRICS", METRICS),
])
def test_every_layer_knows_every_kind(layer, table):
    assert set(table) == set(TASKS), f"{layer} misses {sorted(set(TASKS) - set(table))}, has extra {sorted(set(table) - set(TASKS))}"


def test_every_loss_and_route_named_exists():
    assert {t.loss for t in TASKS.values()} <= set(LOSSES)
    assert {r for t in TASKS.values() for r in t.routes} <= set(NEEDS)


# One tiny case per kind: (predictions, references, keyword arguments) for METRICS[kind].
METRIC_CASES = {
    "classification": (np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), [1, 0, 0], {}),
    "regression": (np.array([0.1, 0.5, 0.2]), [1.0, 3.0, 2.0], {}),
    "multiple-choice": (np.array([[0.1, 0.9], [0.8, 0.2]]), [1, 1], {}),
    "token-classification": ([["B-PER", "O"]], [["B-PER", "O"]], {}),
    "question-answering": (["Denver Broncos"], [["Denver Broncos"]], {}),
    "embedding": (np.random.default_rng(0).normal(size=(3, 2, 4)), np.array([[1], [2], [3]]), {}),
}


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_the_table_names_the_metrics_the_kind_reports(kind):
    predictions, references, extra = METRIC_CASES[kind]
    reported = METRICS[kind](predictions, references, **extra)
    assert set(TASKS[kind].metrics) <= set(reported), f"{kind}: the table names {TASKS[kind].metrics}, METRICS gives {sorted(reported)}"
    recipe = FinetuneRecipe.model_validate({"model": {"init": "m"}, "data": {"train": "t"}, "task": {"kind": kind}})
    assert recipe.best_metric == TASKS[kind].metrics[0]


@pytest.mark.parametrize("kind", TASK_KINDS)
def test_a_model_trains_on_the_targets_the_table_names(kind):
    """The forward's loss needs exactly ``Task.targets``: with all of them a loss, with one missing none."""
    task = TASKS[kind]
    cfg = PRESETS["tiny"]
    model = build_task_model("bert", cfg, TaskConfig(kind=kind, num_labels=3, labels=["a", "b", "c"]), torch.Generator().manual_seed(0))
    B, T, K = 2, 6, 3
    ids = torch.randint(5, cfg.vocab_size, (B, K, T) if task.reads in ("options", "texts") else (B, T), generator=torch.Generator().manual_seed(1))
    targets = {
        "labels": torch.tensor([0, 1]) if task.reads != "tokens" else torch.tensor([[0, 1, 2, -100, 1, 0]] * B),
        "start_positions": torch.tensor([1, 2]),
        "end_positions": torch.tensor([2, 4]),
    }
    if task.loss == "mse":
        targets["labels"] = torch.tensor([0.5, -1.0])
    given = {name: targets[name] for name in task.targets}
    out = model(ids, **given)
    assert out.loss is not None and torch.isfinite(out.loss)
    out.loss.backward()
    width = 3 if task.labelled else len(task.outputs)
    expected = {"options": (B, K), "tokens": (B, T, width), "sequence": (B, width) if width > 1 else (B,),
                "texts": (B, K, cfg.d_model)}[task.reads]
    assert tuple(out.logits.shape) == expected
    for name in task.targets:
        assert model(ids, **{k: v for k, v in given.items() if k != name}).loss is None


def test_task_settings_reach_encoding_by_name():
    """A setting added to the recipe's task section reaches the encoder without a copy line."""
    section = set(TaskSection.model_fields)
    encoding = {f.name for f in dataclasses.fields(TaskDataConfig)}
    assert section - encoding == RECIPE_ONLY, f"task settings the encoder never sees: {sorted(section - encoding - RECIPE_ONLY)}"

    from jobs.training.finetune_config import task_data_config
    from jobs.training.finetune_config import FinetuneRecipe

    recipe = FinetuneRecipe.model_validate({
        "model": {"init": "x"}, "data": {"train": "x"},
        "task": {"kind": "question-answering", "max_len": 200, "doc_stride": 50, "max_query_len": 40, "version_2": True,
                 "question_field": "q", "context_field": "c", "answers_field": "a", "id_field": "qid"},
    })
    cfg = task_data_config(recipe, "xlnet")
    for key in section & encoding:
        assert getattr(cfg, key) == getattr(recipe.task, key), key
    assert cfg.input_style == "xlnet"
