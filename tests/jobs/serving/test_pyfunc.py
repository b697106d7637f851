"""``jobs.serving.pyfunc``: a checkpoint folder is an MLflow model. ``mlflow.pyfunc.load_model`` (MLflow's
own loader, reading the ``MLmodel`` file ``jobs.registry.mlmodel_text`` writes) gives what
``LocalModel`` gives: sentence vectors with the declared params, a classifier's labels for text pairs, a
reader's answers. A registered version loads by ``models:/`` in ``tests/jobs/training/test_tracking.py``."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from tests.jobs.serving.test_serve_tasks import V

TEXTS = ["the river bank was muddy", "the bank raised its rates", "a quick word"]


def _checkpoint(path, family, minilm_dir, task=None, seed=1):
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import build_task_model
    from jobs.registry import MLMODEL, mlmodel_text

    cfg = make_config(family, "tiny", V)
    if task is None:
        from ctxmodels.registry import build_model

        cfg, model = build_model(family, "tiny", V, seed=seed)
    else:
        model = build_task_model(family, cfg, task, torch.Generator().manual_seed(seed))
    return save_checkpoint(path, model, family, cfg, tokenizer_dir=minilm_dir, task=task,
                           extra_text={MLMODEL: mlmodel_text(family, task.kind if task else None)})


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, minilm_dir):
    import mlflow

    from jobs.serving.local import LocalModel

    path = _checkpoint(tmp_path_factory.mktemp("pyfunc") / "bert", "bert", minilm_dir)
    with LocalModel(str(path)) as local:
        yield path, mlflow.pyfunc.load_model(str(path)), local


def test_the_mlmodel_file_is_mlflows_and_listed_in_the_manifest(pretrained):
    from mlflow.models import Model

    from ctxmodels.checkpoint import checkpoint_problem, load_checkpoint

    path, _, _ = pretrained
    model = Model.load(str(path / "MLmodel"))
    assert model.flavors["python_function"]["loader_module"] == "jobs.serving.pyfunc"
    assert model.flavors["ctxmodels"] == {"family": "bert"}
    assert [p.name for p in model.signature.params] == ["task", "pooling", "normalize", "dimensions", "prompt_name"]
    assert "MLmodel" in [f["path"] for f in json.loads((path / "MANIFEST.json").read_text())["files"]]
    assert checkpoint_problem(path, verify_hashes=True) is None and load_checkpoint(path).family == "bert"  # still complete
    # no time or uuid in it: two identical runs write identical checkpoints
    assert (path / "MLmodel").read_text() == _mlmodel_again()


def _mlmodel_again() -> str:
    from jobs.registry import mlmodel_text

    return mlmodel_text("bert")


def test_predict_gives_localmodels_vectors_for_every_input_form(pretrained):
    _, model, local = pretrained
    want = local.encode(TEXTS)
    for given in (TEXTS, pd.Series(TEXTS), pd.DataFrame({"text": TEXTS}), pd.DataFrame({"body": TEXTS}), np.array(TEXTS)):
        got = model.predict(given)
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=1e-6)
    unit = model.predict(TEXTS, params={"normalize": True, "dimensions": 16})
    np.testing.assert_allclose(unit, want[:, :16] / np.linalg.norm(want[:, :16], axis=1, keepdims=True), atol=1e-6)
    np.testing.assert_allclose(model.predict(TEXTS, params={"pooling": "cls"}), local.encode(TEXTS, pooling="cls"), atol=1e-6)
    assert model.unwrap_python_model().dim == want.shape[1]


@pytest.mark.parametrize("given, params, words", [
    (pd.DataFrame({"a": ["x"], "b": ["y"]}), None, "one column, or a 'text' column"),
    (["ok", "  "], None, "item 1 is empty"),
    (TEXTS, {"task": "translate"}, "task 'translate': give embed, classify, tag, answer"),
    (TEXTS, {"task": "classify"}, "serves /v1/embeddings"),
])
def test_a_bad_input_or_param_is_a_value_error_naming_it(pretrained, given, params, words):
    _, model, _ = pretrained
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        model.predict(given, params=params)


def test_a_classifier_and_a_reader_answer_as_their_routes(tmp_path, minilm_dir):
    import mlflow

    from ctxmodels.tasks import TaskConfig
    from jobs.serving.local import LocalModel

    pair = _checkpoint(tmp_path / "pair", "bert", minilm_dir, TaskConfig(kind="classification", num_labels=2, labels=["no", "yes"]))
    reader = _checkpoint(tmp_path / "qa", "bert", minilm_dir, TaskConfig(kind="question-answering", num_labels=2))
    frame = pd.DataFrame({"text": ["a bank", "the river"], "text_pair": ["the bank", "a stream"]})
    with LocalModel(str(pair)) as local:
        want = local.classify([["a bank", "the bank"], ["the river", "a stream"]])
    got = mlflow.pyfunc.load_model(str(pair)).predict(frame)  # a classifier's own route, unasked
    assert list(got["label"]) == [w["label"] for w in want] and set(got["label"]) <= {"no", "yes"}
    np.testing.assert_allclose(got["score"], [w["score"] for w in want], atol=1e-6)

    questions = pd.DataFrame({"question": ["where is the bank?"], "context": ["the bank is by the river"]})
    with LocalModel(str(reader)) as local:
        want = local.answer(["where is the bank?"], ["the bank is by the river"])
    qa = mlflow.pyfunc.load_model(str(reader))
    got = qa.predict(questions)
    assert got.to_dict("records") == want
    assert qa.predict({"question": "where is the bank?", "context": "the bank is by the river"}).to_dict("records") == want
    with pytest.raises(ValueError, match=r"columns \['context'\] missing: give question, context"):
        qa.predict(pd.DataFrame({"question": ["where?"]}))
    vectors = qa.predict(["the bank", "a river"], params={"task": "embed"})  # any model embeds when asked
    assert vectors.shape == (2, qa.unwrap_python_model().dim)
