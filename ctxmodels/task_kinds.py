"""The task kinds fine-tuning knows, named once for every layer.

No torch here (nothing is imported): ``pipelines`` (which never imports torch) encodes a kind's
rows, ``ctxmodels.tasks`` builds its head and loss, ``jobs`` validates recipes and serves it, and
each imports the one ``TaskKind`` from this module.
"""

from __future__ import annotations

from typing import Literal, get_args

TaskKind = Literal["classification", "regression", "multiple-choice", "token-classification", "question-answering"]
TASK_KINDS: tuple[str, ...] = get_args(TaskKind)
