"""ULMFiT's fine-tuning schedules in the one training loop (Howard & Ruder 2018, sec. 3.2), for every
family: the slanted triangular learning rate against the paper's formula, discriminative learning
rates per layer depth, and gradual unfreezing thawing the layers top first. In-process: the
``Stepper`` and the optimizer the worker loop builds."""

from __future__ import annotations

import math

import pytest
import torch

from ctxmodels.registry import build_model
from ctxmodels.tasks import TaskConfig, build_task_model
from jobs.training.loop import StepMeter, Stepper, TrainState, build_optimizer, layer_depths, stlr_factor
from jobs.training.parallel import ParallelPlan
from tests.jobs.training.test_faults import B, batches

CPU = torch.device("cpu")


def test_stlr_is_the_papers_formula_at_every_step():
    T, cut_frac, ratio, batch = 200, 0.1, 32.0, 16
    cut = math.floor(T * cut_frac)
    for t in range(T):
        p = t / cut if t < cut else 1 - (t - cut) / (cut * (1 / cut_frac - 1))
        paper = (1 + p * (ratio - 1)) / ratio  # eta_t / eta_max, eq. 3
        assert stlr_factor(t * batch, batch, T, cut_frac, ratio) == pytest.approx(paper, abs=1e-12), t
    assert stlr_factor(cut * batch, batch, T, cut_frac, ratio) == pytest.approx(1.0)  # the peak at the cut
    assert stlr_factor(T * batch, batch, T, cut_frac, ratio) == pytest.approx(1 / ratio)  # the floor at the end


def _task_model():
    cfg, backbone = build_model("bert", "tiny", {"vocab_size": 128}, seed=0)
    task = TaskConfig(kind="classification", num_labels=3, labels=["a", "b", "c"], input_style="bert")
    return build_task_model("bert", cfg, task, generator=torch.Generator().manual_seed(0))


def test_discriminative_groups_divide_the_rate_by_the_factor_per_layer_down():
    model = _task_model()
    depths = layer_depths(model)
    assert depths["classifier.weight"] == 0  # the head
    assert depths["backbone.layers.1.attn.qkv.weight"] == 1 and depths["backbone.layers.0.attn.qkv.weight"] == 2
    assert depths["backbone.embeddings.word.weight"] == 3
    opt = build_optimizer(model, model, "ddp", CPU, lr=1e-3, weight_decay=0.01, discriminative=2.6)
    seen = set()
    for g in opt.param_groups:
        assert g["lr_scale"] == pytest.approx(2.6 ** -g["depth"])
        for p in g["params"]:
            seen.add(id(p))
        assert all(p.ndim < 2 for p in g["params"]) == (g["weight_decay"] == 0.0)
    assert seen == {id(p) for p in model.parameters() if p.requires_grad}
    # the Stepper sets each group to lr * lr_scale * schedule
    _, bert = build_model("bert", "tiny", {"vocab_size": 128, "nsp": False}, seed=0)
    opt = build_optimizer(bert, bert, "ddp", CPU, lr=1e-3, weight_decay=0.01, discriminative=2.6)
    s = Stepper(bert, opt, ParallelPlan(), CPU, 1, B, 1e-3, lambda n: 0.5)
    s.step(batches(128, 1), TrainState(), StepMeter())
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(1e-3 * 0.5 * 2.6 ** -g["depth"])
    assert s.current_lr == pytest.approx(1e-3 * 0.5)


def test_gradual_unfreezing_thaws_one_depth_per_epoch_head_first():
    torch.manual_seed(0)
    _, model = build_model("bert", "tiny", {"vocab_size": 128, "nsp": False}, seed=0)
    model.backbone.pooler.requires_grad_(False)  # MLM never reaches it (freeze_unused)
    depths = layer_depths(model)
    opt = build_optimizer(model, model, "ddp", CPU, lr=1e-2, weight_decay=0.01, by_depth=True)
    per_epoch = 2
    s = Stepper(model, opt, ParallelPlan(), CPU, 1, B, 1e-2, lambda n: 1.0, grad_clip=1.0,
                trainable_depths=lambda step: 1 + step // per_epoch)
    state, meter, stream = TrainState(), StepMeter(), batches(128, 8)
    for epoch in range(4):
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        for _ in range(per_epoch):
            s.step(stream, state, meter)
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            moved = not torch.equal(p.detach(), before[name])
            trained = depths[name] <= epoch  # epoch e trains depths 0..e
            if trained and p.ndim >= 2:  # a matrix that trains moves (a bias or LayerNorm may have no gradient)
                assert moved, f"epoch {epoch}: {name} (depth {depths[name]}) should train"
            if not trained:
                assert not moved, f"epoch {epoch}: {name} (depth {depths[name]}) should still be frozen"
                assert p not in opt.state or not opt.state[p], f"{name} gathered optimizer state while frozen"
