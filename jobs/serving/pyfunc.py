"""MLflow's ``python_function`` flavour of a checkpoint: what MLflow users load a registered model with.

    import mlflow

    model = mlflow.pyfunc.load_model("models:/minilm-lexname@production")
    vectors = model.predict(["the river bank", "the bank raised rates"])          # a model without a task
    labels = model.predict(pd.DataFrame({"text": ["a small dog"]}))               # a classifier: its labels

Every checkpoint a run writes holds an ``MLmodel`` file (``jobs.registry.mlmodel_text``, listed in its
manifest) naming this module as its loader, so a registered version, whose source is the checkpoint
itself, loads with MLflow's own ``mlflow.pyfunc.load_model`` (MLflow copies the folder first, as it
does any model's) and is served by ``mlflow models serve --env-manager local``. MLflow calls
``_load_pyfunc`` with the folder's local copy; the model is a ``jobs.serving.local.LocalModel`` of it,
so ``predict`` gives what the server's routes give.

``predict(model_input, params)``: ``params["task"]`` picks what is asked (default: a fine-tuned model's
own route, else ``embed``):

* ``embed``: texts -> float32 (N, dim) sentence vectors, as /v1/embeddings (``pooling``, ``normalize``,
  ``dimensions``, ``prompt_name`` params; a sentence-transformers folder's settings by default);
* ``classify``: texts, or text pairs (columns ``text`` and ``text_pair``) -> a DataFrame of ``label``,
  ``score`` and ``scores`` per input, as /v1/classify;
* ``tag``: texts -> per text its tags, as /v1/tag's ``data``;
* ``answer``: ``question`` and ``context`` columns -> a DataFrame of ``answer``, ``start``, ``end``,
  ``score``, as /v1/answer.

Texts come as MLflow hands them: a string, a list, a pandas Series, a one-column DataFrame (or its
``text`` column), a NumPy array. A wrong input or param raises ``ValueError`` naming it, which
``mlflow models serve`` answers with a 400."""

from __future__ import annotations

from typing import Any

import numpy as np

from jobs.registry import PYFUNC_PARAMS
from jobs.serving.local import LocalModel

TASK_OF_ROUTE = {"/v1/classify": "classify", "/v1/tag": "tag", "/v1/answer": "answer"}
EMBED_PARAMS = tuple(name for name in PYFUNC_PARAMS if name != "task")  # those the MLmodel signature declares


def _load_pyfunc(path: str) -> CheckpointPyfunc:
    """MLflow's entry point: ``path`` is the local copy of the checkpoint folder."""
    return CheckpointPyfunc(LocalModel(path, name="mlflow"))


class CheckpointPyfunc:
    """What ``mlflow.pyfunc.load_model`` wraps (module docstring)."""

    def __init__(self, model: LocalModel):
        self.model = model
        self.python_model = model  # what MLflow's ``unwrap_python_model`` hands back
        routes = model.info["routes"]
        self.default_task = next((task for route, task in TASK_OF_ROUTE.items() if route in routes), "embed")

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        params = {k: v for k, v in (params or {}).items() if v is not None}  # MLflow fills undeclared ones with None
        task = params.pop("task", None) or self.default_task
        if task == "embed":
            unknown = sorted(set(params) - set(EMBED_PARAMS))
            if unknown:
                raise ValueError(f"params {unknown}: embed takes {', '.join(EMBED_PARAMS)}")
            return self.model.encode(_texts(model_input), **params)
        if task not in TASK_OF_ROUTE.values():
            raise ValueError(f"task {task!r}: give embed, {', '.join(TASK_OF_ROUTE.values())}")
        if params:
            raise ValueError(f"params {sorted(params)}: {task} takes none")
        import pandas as pd

        if task == "classify":
            return pd.DataFrame(self.model.classify(_pairs_or_texts(model_input)))
        if task == "tag":
            return self.model.tag(_texts(model_input))
        questions, contexts = _columns(model_input, "question", "context")
        return pd.DataFrame(self.model.answer(questions, contexts))


def _texts(data: Any) -> Any:
    """A DataFrame's text column; anything else as MLflow hands it (a string, list, Series, array),
    which LocalModel lists and checks as /v1/embeddings does."""
    import pandas as pd

    if isinstance(data, pd.DataFrame):
        if "text" in data.columns:
            return data["text"]
        if len(data.columns) == 1:
            return data.iloc[:, 0]
        raise ValueError(f"a DataFrame of texts has one column, or a 'text' column; this one has {list(data.columns)}")
    return data


def _pairs_or_texts(data: Any) -> Any:
    """A classifier's inputs: texts, or (text, text_pair) pairs from those two columns."""
    import pandas as pd

    if isinstance(data, pd.DataFrame) and "text_pair" in data.columns:
        texts, pairs = _columns(data, "text", "text_pair")
        return [[a, b] for a, b in zip(texts, pairs)]
    if isinstance(data, list) and data and all(isinstance(x, (list, tuple)) for x in data):
        return [list(x) for x in data]
    return _texts(data)


def _columns(data: Any, *names: str) -> list[list[Any]]:
    """The named columns of a DataFrame (or of a list of dicts, or one dict of lists)."""
    import pandas as pd

    if isinstance(data, dict) and not any(isinstance(v, (list, tuple, np.ndarray, pd.Series)) for v in data.values()):
        data = [data]  # one row
    try:
        frame = data if isinstance(data, pd.DataFrame) else pd.DataFrame(data)
    except (ValueError, TypeError) as e:
        raise ValueError(f"give a DataFrame with columns {', '.join(names)} ({e})") from None
    missing = [n for n in names if n not in frame.columns]
    if missing:
        raise ValueError(f"columns {missing} missing: give {', '.join(names)} (got {list(frame.columns)})")
    return [frame[n].tolist() for n in names]
