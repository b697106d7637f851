"""``ctx eval --model URI --data URI [--output FILE]``: score a fine-tuned model on a split.

``--model`` is a fine-tuned checkpoint or its run folder (the run's best checkpoint, ``best.json``).
The checkpoint carries its task, label names and tokenizer, and its ``trainer_state.json`` the
fine-tuning recipe (field names, ``max_len``, ...), so the split is encoded exactly as training
encoded validation data. Prints one JSON object: ``metrics`` named as the task fits (``accuracy``,
``f1``, ``mcc``, ``pearson``, ``spearman``, ``precision``, ``recall``, ``token_accuracy``,
``exact_match``), plus ``confusion_matrix`` for classification and multiple choice and
``per_tag`` precision/recall/F1 for tagging; ``--output FILE`` writes it, and an HTML page beside it
(``FILE`` with ``.html``) with the confusion-matrix picture and the per-tag table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def load_recipe_of(checkpoint: str, store=None):
    """The fine-tuning recipe stored in a checkpoint's trainer_state.json. ``store``: a
    ``pipelines.storage.Store``, or an endpoint URL."""
    from jobs.training.finetune_config import FinetuneRecipe
    from pipelines import storage

    raw = storage.as_store(store).read_bytes(storage.join(checkpoint, "trainer_state.json"), missing_ok=True)  # not the whole checkpoint
    if raw is None:
        raise ValueError(f"{checkpoint}: no trainer_state.json; ctx eval scores fine-tuned checkpoints (ctx finetune), "
                         "or any model's sentence vectors on retrieval records with --task embedding")
    state = json.loads(raw)
    if "recipe" not in state or "task" not in state:
        raise ValueError(f"{checkpoint}: not a fine-tuned checkpoint (its trainer_state.json has no task); "
                         f"for pretrained models use `ctx eval wic --model ...`, or `--task embedding` on retrieval records")
    return FinetuneRecipe.model_validate(state["recipe"])


def reads_as_scored_pairs(table, sample: int = 100) -> bool:
    """Whether a split's first ``sample`` records (``table``: as ``pipelines.finetune_stream.read_split``
    reads it) are pairs scored for similarity: a number under ``label`` or ``score`` and no hard
    negatives (STS-B's layout; a 0/1 pair classification too)."""
    from pipelines import finetune_stream as fs
    from pipelines.finetune import NEGATIVE_FIELDS, SCORE_FIELDS

    records = [r for r in fs.parse_records(table.column("_json").to_pylist()[:sample])[0] if r is not None]

    def scored(r: dict) -> bool:
        value = next((r[f] for f in SCORE_FIELDS if f in r), None)
        return isinstance(value, (int, float)) and not isinstance(value, bool) and not any(f in r for f in NEGATIVE_FIELDS)

    return bool(records) and all(scored(r) for r in records)


def evaluate(model_uri: str, data_uri: str | list[str], store=None, language: str | int | None = None,
             task: str | None = None) -> dict[str, Any]:
    """The scores of ``model_uri`` on ``data_uri`` (module docstring). ``store``: the command's
    ``pipelines.storage.Store`` (endpoint and ``--retry-deadline``), or an endpoint URL. ``language``:
    a multilingual XLM reads the texts as this language (a name or a row; None: its task's).
    ``task="embedding"``: any model (pretrained, a Hugging Face or sentence-transformers folder) is
    scored as the embedding model ``ctx serve`` makes of it, texts as long as the server reads them: a
    baseline before fine-tuning. On retrieval records (anchor, positive, negatives), retrieval's
    metrics; on pairs scored for similarity (``reads_as_scored_pairs``), spearman_cosine and pearson_cosine."""
    from jobs.training.finetune import score_split
    from jobs.runs import resolve_checkpoint
    from jobs.session import init_ray
    from pipelines.storage import as_store

    store = as_store(store)
    checkpoint = resolve_checkpoint(model_uri, store)
    table = None  # the split, when read here already
    try:
        recipe = load_recipe_of(checkpoint, store)
    except ValueError:
        if task != "embedding":
            raise
        from jobs.training.finetune_config import FinetuneRecipe
        from pipelines.finetune_stream import read_split

        init_ray()
        table = read_split(data_uri, "auto", store)
        # pairs scored for similarity (a score or label each, no negatives) as a pair loss's run reads them: scored by
        # spearman_cosine; else retrieval records
        loss = "cosent" if reads_as_scored_pairs(table) else None
        recipe = FinetuneRecipe.model_validate({"model": {"init": checkpoint}, "data": {"train": data_uri},
                                                "task": {"kind": "embedding", "max_len": 512, "loss": loss}})  # cut to what the model serves
    if task is not None and recipe.task.kind != task:
        raise ValueError(f"{checkpoint} is fine-tuned for {recipe.task.kind}, not {task}")
    init_ray()
    details: dict[str, Any] = {}
    scored = score_split(checkpoint, recipe, data_uri, store, details, language, table)
    kind = recipe.task.kind
    result: dict[str, Any] = {
        "model": checkpoint, "data": data_uri, "task": kind, **({"language": details["language"]} if "language" in details else {}),
        "examples": int(details["records"]) - int(details["rejected"]), "rejected": int(details["rejected"]),
        "metrics": {k.removeprefix("val_"): v for k, v in scored.items()},
    }
    report = DETAILS.get(kind)
    if report is not None:
        result.update(report(details["rows"], details["logits"], list(details["labels"]), recipe))
    return result


def _confusion(pred: np.ndarray, gold: np.ndarray, names: list[str]) -> dict[str, Any]:
    from pipelines.metrics import confusion_matrix

    cm = confusion_matrix(pred, gold, labels=np.arange(len(names)))
    return {"confusion_matrix": {"labels": names, "matrix": cm.tolist()}}


def class_details(rows: dict, logits: np.ndarray, labels: list[str], recipe) -> dict[str, Any]:
    """Classification: the confusion matrix over the label names."""
    return _confusion(logits.argmax(-1), rows["labels"], labels)


def choice_details(rows: dict, logits: np.ndarray, labels: list[str], recipe) -> dict[str, Any]:
    """Multiple choice: the confusion matrix over option positions."""
    return _confusion(logits.argmax(-1), rows["labels"], [f"option {i}" for i in range(logits.shape[-1])])


def tag_details(rows: dict, logits: np.ndarray, labels: list[str], recipe) -> dict[str, Any]:
    """Token classification: precision, recall and F1 per entity type."""
    from pipelines.metrics import entity_report, tags_from_token_arrays

    word_ids = rows["word_ids"] if recipe.task.label_all_subtokens else None
    pred, ref = tags_from_token_arrays(logits, rows["labels"], labels, word_ids)
    return {"per_tag": entity_report(pred, ref)}


# What ``ctx eval`` adds to a kind's metrics (regression and QA: the metrics say it all).
DETAILS = {
    "classification": class_details,
    "multiple-choice": choice_details,
    "token-classification": tag_details,
}


def write_result(result: dict[str, Any], output: str | None) -> str:
    """The JSON text; with ``output``, also the file and its HTML page (``output`` with .html)."""
    from jobs.evaluation.evalpage import write_eval_page

    text = json.dumps(result, indent=2)
    if output:
        out = Path(output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        write_eval_page(result, out.with_suffix(".html"), title=f"ctx eval: {result.get('task', 'wic')}")
    return text
