"""An embedding model trained on two DDP workers (gloo, two CPU processes) with its texts gathered
across them (``task.gather_across_workers``, ``jobs.training.parallel.gather_rows``) computes the
loss and the gradients one process computes on the whole batch: every anchor ranks against every
worker's texts, whatever the worker count, and so does a gradient-cached step that forwards each
worker's rows one at a time, and so does every direction of the loss (``task.directions``). Without the
gather each worker ranks against its own half, another loss."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ctxmodels.bert import PRESETS
from ctxmodels.tasks import TaskConfig, build_task_model
from jobs.training import parallel
from jobs.training.loop import StepMeter, Stepper, freeze_unused
from tests.conftest import run_gloo_workers

WORLD, B, K, T = 2, 6, 3, 10
ALL_DIRECTIONS = ["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]  # each needs the gathered rows


def model_and_batch():
    cfg = dataclasses.replace(PRESETS["tiny"], dropout=0.0, attn_dropout=0.0)  # the two runs must see the same function
    model = build_task_model("bert", cfg, TaskConfig(kind="embedding", dropout=0.0), torch.Generator().manual_seed(0)).train()
    ids = torch.randint(5, PRESETS["tiny"].vocab_size, (B, K, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:, :, 7:] = torch.randint(0, 2, (B, K, 3), generator=torch.Generator().manual_seed(2))
    mask[:, :, 7:] = mask[:, :, 7:].cummin(-1).values  # right padding only
    return model, ids, mask


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        out = {}
        for case in ("gathered", "alone", "cached", "all directions"):
            model, ids, mask = model_and_batch()
            if case != "alone":
                model.gather = parallel.gather_rows
            if case == "all directions":
                model.task.directions = ALL_DIRECTIONS
            mine = slice(rank * B // WORLD, (rank + 1) * B // WORLD)
            # As the loop does: the probe step (gathered too) freezes what the loss never reaches (the pooler).
            frozen = freeze_unused(model, {"input_ids": ids[mine], "attention_mask": mask[mine]})
            assert frozen and all(n.startswith("backbone.pooler") for n in frozen), frozen
            wrapped = parallel.wrap_model(model, parallel.ParallelPlan(strategy="ddp"), torch.device("cpu"))
            if case == "cached":  # the worker's rows one at a time (a gradient-cached step: task.gradient_cache)
                rows = [{"input_ids": ids[i : i + 1], "attention_mask": mask[i : i + 1], "sample_id": [i]} for i in range(B)[mine]]
                stepper = Stepper(wrapped, None, parallel.ParallelPlan(strategy="ddp"), torch.device("cpu"), len(rows), B, 0.0,
                                  lambda samples: 1.0, cached_loss=model.texts_loss)
                loss = torch.tensor(stepper._cached(iter(rows), StepMeter(), poisoned=False)[1][0][0])
            else:
                loss = wrapped(ids[mine], attention_mask=mask[mine]).loss
                loss.backward()  # DDP averages the gradients over the workers
            losses = [torch.zeros(()) for _ in range(WORLD)]
            dist.all_gather(losses, loss.detach())
            out[case] = {"loss": torch.stack(losses).mean(),
                             "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory) -> dict:
    return run_gloo_workers(_worker, tmp_path_factory.mktemp("gather"), WORLD)[0]


@pytest.mark.parametrize("cases", [("gathered", "cached"), ("all directions",)])
def test_gathered_workers_compute_the_whole_batchs_loss_and_gradients(two_workers, cases):
    model, ids, mask = model_and_batch()
    if cases == ("all directions",):
        model.task.directions = ALL_DIRECTIONS
    loss = model(ids, attention_mask=mask).loss
    loss.backward()
    # Gathered, each worker's rows at once or one at a time behind a gradient cache: the same.
    for case in cases:
        got = two_workers[case]
        torch.testing.assert_close(got["loss"], loss.detach(), atol=1e-5, rtol=1e-5)
        assert set(got["grads"]) == {n for n, p in model.named_parameters() if p.grad is not None}
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, dict(model.named_parameters())[name].grad, atol=1e-5, rtol=1e-4, msg=f"{case}: {name}")
    if cases == ("gathered", "cached"):  # each worker alone: a softmax over half the candidates, another (smaller) loss
        assert float(two_workers["alone"]["loss"]) < float(loss.detach()) - 0.05


def test_validation_never_gathers():
    """Evaluation shares of a split differ in size between workers: an eval forward must not call it."""
    model, ids, mask = model_and_batch()

    def refuse(_):
        raise AssertionError("gathered in eval")

    model.gather = refuse
    with torch.no_grad():
        assert model.eval()(ids, attention_mask=mask).loss is not None
