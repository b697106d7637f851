"""The GPU path's kernels, checked on the CPU (CI has no GPU; tests/jobs/test_cuda.py repeats the
checks on one): regional compilation equals eager, SDPA's fused kernels equal its reference (math)
path for every family that attends through it and every mask kind, a batch with no padding
gives the same loss with its mask left out (what ``jobs.training.loop.to_device`` lets the model do), and a
masked-LM model with padded positions traces whole in one graph (``train.compile: graphs``)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ctxmodels.compiling import compile_blocks, compile_regions, is_compiled
from ctxmodels.registry import build_model
from tests.ctxmodels.test_flops import family_batch

SDPA_FAMILIES = ["albert", "bert", "gpt", "roberta", "spanbert"]  # attention through F.scaled_dot_product_attention
BLOCK_FAMILIES = ["albert", "bert", "gpt"]  # one of each block class marked compile_region


def _tiny(family: str, dropout: float | None = None):
    overrides = {"vocab_size": 128}
    cfg, model = build_model(family, "tiny", overrides, seed=0)
    batch, _ = family_batch(family, cfg)
    return cfg, model, batch


def _padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with rows of 24, 17, 9 and 24 real tokens (padding at the end, labels -100 there)."""
    out = dict(batch)
    B, T = batch["input_ids"].shape
    lengths = torch.tensor([T, T - 7, T - 15, T])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    out["attention_mask"] = mask
    out["input_ids"] = batch["input_ids"].masked_fill(mask == 0, 0)
    if "labels" in batch and batch["labels"].shape == mask.shape:
        out["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    return out


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_same(got, want, family: str, what: str, rtol=1e-5, atol=1e-5) -> None:
    (loss_got, grads_got), (loss_want, grads_want) = got, want
    torch.testing.assert_close(loss_got, loss_want, rtol=rtol, atol=atol, msg=lambda m: f"{family} {what} loss: {m}")
    assert grads_got.keys() == grads_want.keys() and grads_want
    for name, g in grads_want.items():
        torch.testing.assert_close(grads_got[name], g, rtol=rtol * 10, atol=atol, msg=lambda m: f"{family} {what} {name}: {m}")


def test_the_regions_are_each_familys_repeated_blocks():
    for family, where in [("bert", "backbone.layers"), ("gpt", "backbone.blocks")]:
        cfg, model, _ = _tiny(family)
        blocks = list(model.get_submodule(where))
        assert compile_regions(model) == blocks and len(blocks) == cfg.n_layer
    _, albert, _ = _tiny("albert")
    backbone = albert.backbone
    assert compile_regions(albert) == [*backbone.attention, *backbone.ffn]
    for family in ("elmo", "transformer-xl", "xlnet"):  # eager (ParallelPlan.compile compiles them whole)
        _, model, _ = _tiny(family)
        assert compile_regions(model) == []


@pytest.mark.parametrize("family", SDPA_FAMILIES)
@pytest.mark.parametrize("padding", [False, True], ids=["packed", "padded"])
def test_sdpa_fused_kernels_equal_the_math_path(family, padding):
    """Every mask kind the families pass: none (packed rows; GPT's is_causal) and key padding
    ((B, 1, 1, T) bool, GPT's causal-and-padding (B, 1, T, T)). BERT's CPU unpadding is off so
    the (B, T) layout, the one a GPU runs, is the one checked."""
    _, model, batch = _tiny(family)
    model.eval()  # no dropout: the kernels draw their own masks
    if hasattr(model, "backbone") and hasattr(model.backbone, "skip_padding"):
        model.backbone.skip_padding = False
    if padding:
        batch = _padded(batch)
    fused = _loss_and_grads(model, batch)  # CPU: the flash kernel where it applies
    with sdpa_kernel(SDPBackend.MATH):
        reference = _loss_and_grads(model, batch)
    _assert_same(fused, reference, family, "padded" if padding else "packed")


@pytest.mark.parametrize("family", SDPA_FAMILIES)
def test_an_unpadded_batch_gives_the_same_loss_without_its_mask(family):
    """``to_device`` drops an all-ones mask on the host; the model then attends with no mask."""
    _, model, batch = _tiny(family)
    model.eval()
    if hasattr(model.backbone, "skip_padding"):
        model.backbone.skip_padding = False
    assert bool(batch["attention_mask"].all())
    without = {k: v for k, v in batch.items() if k != "attention_mask"}
    _assert_same(_loss_and_grads(model, without), _loss_and_grads(model, batch), family, "no mask")


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_compiled_blocks_equal_eager_ones(family):
    """Loss and every gradient of a step, eager and with each block compiled by inductor (the CPU
    backend: the same graphs a GPU compiles, other kernels), fp32."""
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        pytest.skip("torch.compile's CPU backend (inductor) needs a C++ compiler; none on PATH")
    import torch._dynamo
    import torch._inductor.config

    _, model, batch = _tiny(family)
    model.eval()
    eager = _loss_and_grads(model, batch)
    names = list(model.state_dict())
    n = compile_blocks(model)
    assert n == len(compile_regions(model)) > 0 and all(is_compiled(m) for m in compile_regions(model))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        # One compile worker: a pool of subprocesses costs more than it saves on a tiny graph.
        with torch._inductor.config.patch(compile_threads=1):
            compiled = _loss_and_grads(model, batch)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the blocks ran compiled
            again = _loss_and_grads(model, _padded(batch))  # a second shape: recompiled, still right
            for m in compile_regions(model):
                m._compiled_call_impl = None  # back to eager for the reference
            reference = _loss_and_grads(model, _padded(batch))
    finally:
        torch._dynamo.reset()
    _assert_same(compiled, eager, family, "compiled", rtol=1e-4, atol=1e-5)
    _assert_same(again, reference, family, "compiled, padded", rtol=1e-4, atol=1e-5)
    assert list(model.state_dict()) == names  # in place: the same parameter names


def test_the_masked_lm_families_have_a_static_step_and_the_others_not():
    from ctxmodels.compiling import has_static_step
    from ctxmodels.registry import FAMILIES

    static = {family for family in FAMILIES if has_static_step(_tiny(family)[1])}
    assert static == {"albert", "bert", "roberta", "spanbert", "xlm"}


@pytest.mark.parametrize("family", ["bert", "spanbert", "albert"])
def test_a_masked_lm_model_with_padded_positions_traces_whole_in_one_graph(family):
    """``train.compile: graphs`` on one GPU compiles these models whole, as CUDA graphs: with the
    positions ``jobs.training.loop.to_device`` gives (``ops.padded_positions``, no attention mask for packed
    rows) the forward and backward trace as one graph each, with no break (``fullgraph=True``; the
    ``aot_eager`` backend traces as inductor does, without compiling kernels, so this runs on any
    CPU), and give eager's loss, metrics and gradients."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    from ctxmodels import ops

    _, model, batch = _tiny(family)
    model.eval()  # no dropout: the same draws on both sides would need the same RNG use
    inputs = {k: v for k, v in batch.items() if k != "attention_mask"}
    inputs["label_positions"] = ops.padded_positions(batch["labels"], 64)
    torch._dynamo.maybe_mark_dynamic(inputs["label_positions"], 0)  # as jobs.training.loop.to_device marks them
    eager = _loss_and_grads(model, inputs)
    want_metrics = {k: v.item() for k, v in model(**inputs).metrics.items()}
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    try:
        loss = compiled(**inputs).loss
        loss.backward()
        got = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        got_metrics = {k: v.item() for k, v in compiled(**inputs).metrics.items()}
        # another padded count (a multiple of 32 here) runs the same graph: no recompile per count
        other = dict(inputs, label_positions=ops.padded_positions(batch["labels"], 32))
        assert other["label_positions"].numel() != inputs["label_positions"].numel()
        torch._dynamo.maybe_mark_dynamic(other["label_positions"], 0)
        compiled(**other).loss.backward()
        assert counter.frame_count == 1
    finally:
        torch._dynamo.reset()
    _assert_same(got, eager, family, "whole graph")
    assert got_metrics == pytest.approx(want_metrics, rel=1e-6)


def test_a_task_model_has_a_static_step_on_a_masked_lm_backbone_only():
    """``train.compile: graphs`` compiles a fine-tuning model whole where its backbone's step keeps
    its shapes (the masked-LM families), not with a BiLSTM task model (its packed sequences read
    their lengths on the host) nor on the other families."""
    from ctxmodels.compiling import has_static_step
    from ctxmodels.registry import FAMILIES
    from tests.ctxmodels.test_tasks import tiny_task

    static = {family for family in FAMILIES if has_static_step(tiny_task(family, "classification"))}
    assert static == {"albert", "bert", "roberta", "spanbert", "xlm"}
    assert not has_static_step(tiny_task("bert", "token-classification", features="last", task_model="bilstm"))
    assert has_static_step(tiny_task("bert", "token-classification", features="scalar-mix"))


@pytest.mark.parametrize("family, kind", [("bert", "classification"), ("bert", "token-classification"),
                                          ("roberta", "multiple-choice"), ("albert", "question-answering"),
                                          ("spanbert", "regression"), ("bert", "embedding")])
def test_a_task_model_traces_whole_in_one_graph_for_every_trimmed_length(family, kind):
    """A fine-tuning step compiled whole (``train.compile: graphs`` on one GPU): the forward and
    backward trace as one graph each (``fullgraph=True``, ``aot_eager``), with ``ctx finetune``'s
    keywords (token classification asks for the labelled positions only, which a compiled model
    reads at every position: the same loss), give eager's loss and gradients (eager skips the
    padding on the CPU: ``Packing``), and batches trimmed to other lengths (``jobs.training.finetune``
    rounds them to a multiple of 32 on a GPU) compile once more, with dynamic sizes, then no more."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    from tests.ctxmodels.test_tasks import batch_for, tiny_task

    model = tiny_task(family, kind).eval()  # no dropout: the same draws on both sides would need the same RNG use
    batch = batch_for(kind)
    inputs = dict(batch, labelled_positions_only=True) if kind == "token-classification" else batch
    eager = _loss_and_grads(model, inputs)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    try:
        loss, grads = _loss_and_grads(compiled, inputs)
        got = loss, {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
        for cut in (8, 7):  # two shorter trims of the same rows (row 1 has 7 real tokens)
            shorter = {k: (v[..., :cut] if k in ("input_ids", "attention_mask") or (k == "labels" and v.dim() > 1) else v)
                       for k, v in inputs.items()}
            _loss_and_grads(compiled, shorter)
        assert counter.frame_count == 2  # static at the first length, dynamic at the second, reused at the third
    finally:
        torch._dynamo.reset()
    _assert_same(got, eager, f"{family} {kind}", "whole graph")
