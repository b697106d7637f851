"""What a fine-tuning step feeds the task model, as plain functions of a batch: the forward's keywords
(``task_inputs``, ``train_inputs``) and the length a batch is cut to (``trim_length``).

Apart from ``jobs.training.finetune`` so that what needs only these (``benchmarks/finetune_throughput.py``,
``tests/jobs/test_cuda.py`` on a borrowed GPU machine) imports neither pydantic nor Ray: torch alone,
and only inside the functions.
"""

from __future__ import annotations

from typing import Any

# The task model's forward keywords (CONTRACT.md section 3); everything else in a batch is bookkeeping.
FORWARD_KEYS = ("input_ids", "attention_mask", "token_type_ids", "labels", "start_positions", "end_positions")
# The length a batch's (.., T) columns are cut to (``task_inputs``), found on the host before the
# batch travels (``trim_length``); on a GPU rounded up to a multiple of CUDA_LENGTH_MULTIPLE, so a
# run takes at most task.max_len / 32 shapes: a model compiled whole keeps a graph for each (CUDA
# graphs record one per shape) instead of one per longest row.
TRIM_LENGTH = "_length"
CUDA_LENGTH_MULTIPLE = 32


def trim_length(attention_mask, device) -> int:
    """Where ``task_inputs`` cuts a batch's (.., T) columns: its longest real row, on ``device``'s
    GPU rounded up to a multiple of ``CUDA_LENGTH_MULTIPLE`` (at most T). Call it on the host mask,
    before the batch moves: on a GPU the sum would make the host wait. On the CPU the longest row
    itself (padding inside the batch costs little there: ``ctxmodels.bert.Packing`` skips it)."""
    import torch

    T = int(attention_mask.shape[-1])
    longest = int(attention_mask.sum(-1).max())
    multiple = CUDA_LENGTH_MULTIPLE if torch.device(device).type == "cuda" else 1
    return min(T, -(-longest // multiple) * multiple)


def task_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The model's keywords, every (.., T) column trimmed to the batch's ``TRIM_LENGTH`` (found
    on the host by ``trim_length``), else to its longest real row (the data stage pads to a fixed
    task.max_len). The batch keeps its full width: sample digests read it whatever the device."""
    length = batch.get(TRIM_LENGTH)
    if length is None:
        length = int(batch["attention_mask"].sum(-1).max())
    out = {}
    for k in FORWARD_KEYS:
        if k not in batch:
            continue
        v = batch[k]
        if k in ("input_ids", "attention_mask", "token_type_ids") or (k == "labels" and v.dim() >= 2):
            v = v[..., :length]
        out[k] = v
    return out


def train_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """``task_inputs`` for a training step: token classification computes its head (and a BERT
    family's last block) at the labelled positions only (``TaskModel.forward``); the loss and the
    gradients are the same, and training reads no logits."""
    out = task_inputs(batch)
    if "labels" in out and out["labels"].dim() >= 2:  # token labels: (B, T)
        out["labelled_positions_only"] = True
    return out
