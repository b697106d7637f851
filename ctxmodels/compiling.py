"""Regional compilation: ``torch.compile`` on each repeated block of a model, in place.

A Transformer is one block class applied ``n_layer`` times. Compiling each block (not the whole
model) gives the same fused kernels, compiles the block's code once for every layer (Dynamo reuses
it: the parameters are inputs of the graph, not constants), keeps the embedding, the heads and the
loss eager (their boolean-mask gathers, ``last[labels != -100]``, have data-dependent shapes that
would break a whole-model graph), and leaves every module where it was: parameter names, state
dicts, DDP and FSDP2 wrapping are those of the eager model. This is PyTorch's "regional
compilation" recipe (the ``torch.compile`` tutorial "Reducing cold start compilation time with
regional compilation").

What compiling a block buys is on a GPU: eager BERT runs some 30 kernels per layer forward (bias
adds, GELU, dropout, residual add, LayerNorm each read and write the (B, T, D) activations), and
inductor fuses the element-wise ones into the products' neighbours, so each activation crosses
memory once or twice instead of five times, and the GPU waits less on Python launching kernels.
Attention stays ``scaled_dot_product_attention``, which inductor lowers to the same flash or
memory-efficient kernel as eager.

Which modules are blocks: those whose class sets ``compile_region = True`` (``BertBlock``,
ALBERT's attention and feed-forward sub-layers, GPT's ``Block``). Transformer-XL's and XLNet's
blocks carry memories and relative-position tensors of changing length between segments; they stay
eager, as does ELMo (LSTMs run as cuDNN kernels already).

Shapes: a compiled block is specialised on its input shapes; a second shape recompiles it once
with dynamic sizes (``dynamic=None``, PyTorch's default). Pretraining rows all have
``data.seq_len`` tokens, so one graph serves the whole run; fine-tuning batches vary in length and
share one dynamic graph after the second.

The whole step as CUDA graphs (``train.compile: graphs`` on one GPU): replaying each block as a
CUDA graph still leaves the embedding, the head, the loss and every launch between blocks to the
host, which bounds a small batch (BERT-base at 32 x 128: the GPU busy a third of the step). A
masked-LM model whose predicted rows come as ``label_positions`` padded to a few fixed counts
(``jobs.training.loop.to_device``, ``ctxmodels.ops.padded_positions``) has the same shapes from step to
step, so it compiles whole in one graph (``has_static_step``): forward and backward each replay
as one CUDA graph (``mode="reduce-overhead"``), and only the optimizer runs eager. Fine-tuning
takes the same step for a task model on such a backbone: ``jobs.training.finetune_inputs.trim_length``
cuts a GPU batch to its longest row rounded up to a multiple of 32 (a handful of lengths a run, a
graph recorded for each), and the head reads every position while compiled
(``labelled_positions_only`` would count the labelled rows on the device).
"""

from __future__ import annotations

import inspect

from torch import nn


def compile_regions(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``compile_blocks`` compiles, in ``modules()`` order."""
    return [m for m in model.modules() if getattr(type(m), "compile_region", False)]


def compile_blocks(model: nn.Module, **options) -> int:
    """``torch.compile`` every block of ``model`` in place (``nn.Module.compile``, ``options``
    passed on: ``mode``, ``dynamic``, ``fullgraph``, ...); returns how many were compiled (0 for a
    family with no block class marked, which then runs eager).

    Idempotent: a block compiled already is compiled again with the new options. The model's
    ``forward``, parameters and state dict are unchanged; the blocks' code compiles on their first
    call.
    """
    regions = compile_regions(model)
    for module in regions:
        module.compile(**options)
    return len(regions)


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` was compiled in place (``nn.Module.compile``)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def has_static_step(model: nn.Module) -> bool:
    """Whether ``model``'s training forward keeps its shapes from batch to batch when given its
    inputs as ``jobs.training.loop.to_device`` moves them to a GPU: its forward takes ``label_positions``
    (BERT, RoBERTa, SpanBERT, ALBERT), so no row count is found on the device and the whole model
    compiles in one graph. Other families find theirs on the device (a boolean gather) and are
    compiled by block. A model that says so itself (``static_step``: a ``ctxmodels.tasks.TaskModel``
    on one of those backbones, whose GPU batches ``jobs.training.finetune_inputs.trim_length`` cuts to a few lengths) is taken at
    its word."""
    own = getattr(model, "static_step", None)
    if own is not None:
        return bool(own)
    return "label_positions" in inspect.signature(model.forward).parameters
