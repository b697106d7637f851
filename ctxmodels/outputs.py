"""What every pretraining model returns, so one training loop serves every family."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PretrainOutput:
    """``loss`` carries the gradient; ``metrics`` holds detached 0-d tensors for logging.

    Conventional metric names: ``mlm_loss``, ``mlm_acc``, ``nsp_loss``, ``nsp_acc``, ``sop_acc``,
    ``sbo_loss``, ``lm_loss``, and ``n_pred`` (number of predicted tokens in the batch), which the
    loop uses to weight token-level metrics when it averages over steps and workers.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
