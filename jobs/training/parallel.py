"""How a model is wrapped for multi-worker training: DDP or FSDP2, bf16 autocast, torch.compile.

Model code is single-device (STYLE rule 7); this module is the one place that knows how a model is
replicated or sharded across the workers of ``jobs/training/train.py``. The training loop uses it as::

    model = wrap_model(model, plan, device)          # after freeze_unused, before the optimizer
    optimizer = AdamW(param_groups(unwrap(model)))   # FSDP replaces every Parameter: build it after
    for micro, batch in enumerate(micro_batches):
        with no_sync(model, active=micro < len(micro_batches) - 1), autocast(plan, device):
            loss = model(**batch).loss / len(micro_batches)
            loss.backward()
    clipped_step(model, optimizer, grad_norm(model), max_norm)  # clip_grad_norm + step, fused
    state = full_state_dict(model)                   # every rank calls; rank 0 gets the dict

Strategies:
- ``"ddp"``: ``torch.nn.parallel.DistributedDataParallel``; every rank holds the whole model and
  gradients are all-reduced (averaged) during backward.
- ``"fsdp"``: FSDP2 (``torch.distributed.fsdp.fully_shard``, Zhao et al. "PyTorch FSDP", VLDB
  2023; the per-parameter DTensor sharding of torchtitan). Each child of an ``nn.ModuleList``
  (the transformer blocks / LSTM layers of every family here) is its own unit, gathered just
  before its forward and freed after; the root unit holds the rest (embeddings, heads). Tied
  softmax weights stay tied because the word embedding and every head that reads it live in the
  root unit. Works on CPU with the gloo backend in this torch build (tests/jobs/training/test_parallel.py)
  and is meant for CUDA with NCCL (not exercised by the tests, which run without a GPU).

With one worker, or without an initialised process group, nothing is wrapped.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Iterator, Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor, nn

Strategy = Literal["ddp", "fsdp"]
Precision = Literal["fp32", "bf16"]


@dataclass(frozen=True)
class ParallelPlan:
    strategy: Strategy = "ddp"  # replicate (DDP) or shard (FSDP2) the model across the workers
    precision: Precision = "fp32"  # bf16: autocast on CUDA and native-bf16 CPUs (bf16 matmuls, fp32 master weights/optimizer)
    # True: each Transformer block under torch.compile (ctxmodels.compiling); "graphs": on CUDA replayed
    # as CUDA graphs (mode reduce-overhead), the whole model where its step has static shapes on one GPU
    compile: bool | Literal["graphs"] = False

    def __post_init__(self) -> None:
        if self.strategy not in get_args(Strategy):
            raise ValueError(f"ParallelPlan.strategy must be one of {get_args(Strategy)}, got {self.strategy!r}")
        if self.precision not in get_args(Precision):
            raise ValueError(f"ParallelPlan.precision must be one of {get_args(Precision)}, got {self.precision!r}")
        if not isinstance(self.compile, bool) and self.compile != "graphs":
            raise ValueError(f"ParallelPlan.compile must be true, false or 'graphs', got {self.compile!r}")


def world_size() -> int:
    """Workers in the default process group; 1 when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def gather_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Every worker's ``x`` (the same shape on each: a training micro-batch's rows), concatenated in
    rank order with the gradient flowing back to each worker's own rows (the loss of every worker
    that read them adds to it), and where this worker's rows start: the candidates an embedding
    model's anchors rank against (``ctxmodels.tasks.Gather``)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

    # (torch's functional collective with a backward, which torch.distributed.nn's deprecated all_gather now points to)
    return wait_tensor(all_gather_single_autograd(x, gather_dim=0, group=dist.group.WORLD)), _rank() * x.shape[0]


# ---------------------------------------------------------------------------------------------
# Wrapping


def fsdp_units(model: nn.Module) -> list[str]:
    """Names of the sub-modules that FSDP shards as units of their own, in the order to shard them.

    Every child of an ``nn.ModuleList`` that holds parameters: the blocks of BERT, GPT,
    Transformer-XL and XLNet, ALBERT's (possibly shared) attention and feed-forward layers, ELMo's
    LSTM layers, convolutions and highways. A module object reached under several names (a shared
    layer) is listed once. Nested units come before the unit that contains them (fully_shard must
    see the inner one first). Everything else (embeddings, heads, the final LayerNorm) stays in
    the root unit, so a softmax tied to the input embedding stays one parameter. Raises
    ValueError when a unit's parameter is also registered outside it (a weight tied across units).
    """
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    seen: set[int] = set()
    units: list[str] = []
    for list_name, module_list in lists:
        for child_name, child in module_list.named_children():
            if id(child) in seen or next(child.parameters(), None) is None:
                continue
            seen.add(id(child))
            units.append(f"{list_name}.{child_name}" if list_name else child_name)
    units.sort(key=lambda name: -name.count("."))  # deepest first; ties keep the model's order
    _check_units_do_not_share_parameters(model, units)
    return units


def _check_units_do_not_share_parameters(model: nn.Module, units: list[str]) -> None:
    """FSDP gathers a unit's parameters only around that unit's forward: a parameter that is also
    registered outside the unit (a weight tied across units, or to the root) would be read while
    sharded. Refuse it up front, naming both places."""
    modules = dict(model.named_modules())
    owner: dict[int, str] = {}  # parameter -> innermost unit holding it (units come deepest first)
    for unit in units:
        for p in modules[unit].parameters():
            owner.setdefault(id(p), unit)
    inside = {unit: {id(m) for m in modules[unit].modules()} for unit in units}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            unit = owner.get(id(p))
            if unit is not None and id(module) not in inside[unit]:
                raise ValueError(
                    f"parameter {module_name}.{pname} is also a parameter of {unit}, which FSDP shards "
                    "as a unit of its own: tied weights must live outside nn.ModuleList children "
                    "(in the root unit)"
                )


def _fully_shard(model: nn.Module, plan: ParallelPlan, device: torch.device) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"FSDP here supports cpu (gloo) and cuda (nccl) devices, got {device}")
    if device.type == "cpu" and "gloo" not in str(dist.get_backend()):
        raise ValueError(
            f"FSDP on CPU needs the gloo backend, but the process group uses {dist.get_backend()!r}; "
            "use strategy='ddp' or a gloo (or 'cpu:gloo,cuda:nccl') process group"
        )
    units = fsdp_units(model)
    mesh = init_device_mesh(device.type, (world_size(),))
    if plan.precision == "bf16" and device.type == "cuda":
        # Gather bf16 copies for compute; reduce gradients in fp32; the sharded master stays fp32.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()  # fp32 gathers on CPU: autocast() alone casts the products there
    modules = dict(model.named_modules())
    for name in units:
        fully_shard(modules[name], mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def wrap_model(model: nn.Module, plan: ParallelPlan, device: torch.device) -> nn.Module:
    """The model as the training loop should call it: moved to ``device``, then DDP- or
    FSDP2-wrapped when more than one worker trains, then compiled if ``plan.compile``.

    Call it after freezing unused parameters (DDP runs without ``find_unused_parameters``) and
    before building the optimizer: FSDP swaps every parameter for a sharded one in place, so
    ``unwrap(result).parameters()`` (or the result's) are the ones to optimise.

    Compiling is regional (``ctxmodels.compiling.compile_blocks``): each Transformer block is
    compiled in place, before wrapping, as FSDP2's per-block recipe does; the embeddings, heads
    and loss stay eager. A family with no block marked for it (ELMo, Transformer-XL, XLNet) is
    compiled whole, around the wrapper, as the DDP and FSDP2 documentation recommend. With
    ``compile: graphs`` on one GPU, a model whose step has static shapes
    (``ctxmodels.compiling.has_static_step``: the masked-LM families) is compiled whole as CUDA
    graphs, forward and backward each one replay; with several workers its blocks are (the
    gradient hooks of DDP and FSDP2 run between a backward's pieces).
    """
    from ctxmodels.compiling import compile_blocks

    model = model.to(device)
    n = world_size()
    how = compile_scope(model, plan, device, n)
    whole = how == "whole graphs"
    if how in ("blocks", "block graphs"):
        whole = compile_blocks(model, **({"mode": "reduce-overhead"} if how == "block graphs" else {})) == 0
    if n > 1 and plan.strategy == "ddp":
        ids = None
        if device.type == "cuda":
            ids = [device.index if device.index is not None else torch.cuda.current_device()]
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    elif n > 1 and plan.strategy == "fsdp":
        model = _fully_shard(model, plan, device)
    if whole:
        model = torch.compile(model, **({"mode": "reduce-overhead"} if how == "whole graphs" else {}))
    return model


def compile_scope(model: nn.Module, plan: ParallelPlan, device: torch.device, workers: int) -> str | None:
    """What ``wrap_model`` compiles: None (``compile: false``), ``"blocks"`` (``true``: each block,
    or the whole model for a family with none), ``"block graphs"`` (``graphs``: each block replayed
    as CUDA graphs) or ``"whole graphs"`` (``graphs`` on one GPU for a model whose step has static
    shapes, ``ctxmodels.compiling.has_static_step``: forward and backward each one CUDA graph).
    CUDA graphs exist on CUDA only: ``graphs`` compiles blocks elsewhere."""
    from ctxmodels.compiling import has_static_step

    if not plan.compile:
        return None
    if plan.compile != "graphs" or device.type != "cuda":
        return "blocks"
    return "whole graphs" if workers == 1 and has_static_step(model) else "block graphs"


def _strip_compile(model: nn.Module) -> nn.Module:
    from torch._dynamo.eval_frame import OptimizedModule

    while isinstance(model, OptimizedModule):
        model = model._orig_mod
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The original module, without the compile and DDP wrappers. FSDP2 shards a module in place,
    so for it this is the same (sharded) object: its parameter names are the original ones."""
    model = _strip_compile(model)
    while isinstance(model, nn.parallel.DistributedDataParallel):
        model = _strip_compile(model.module)
    return model


def _is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap(model), FSDPModule)


# ---------------------------------------------------------------------------------------------
# The step: precision, gradient accumulation, clipping


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16, or AMX tiles), where oneDNN's bf16
    products run about twice as fast as fp32 ones; elsewhere they are emulated, slower than fp32."""
    cpu = torch.cpu
    return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())


def step_precision(plan: ParallelPlan, device: torch.device) -> str:
    """The precision the step really runs in: ``"bf16"`` where :func:`autocast` turns autocast on,
    else ``"fp32"``. Say it where a run starts (and measure the MFU peak in it)."""
    if plan.precision != "bf16" or device.type not in ("cuda", "cpu"):
        return "fp32"
    return "bf16" if device.type == "cuda" or cpu_has_native_bf16() else "fp32"


def autocast(plan: ParallelPlan, device: torch.device, allow_cpu: bool | None = None) -> ContextManager:
    """bf16 autocast around forward (and loss) when ``plan.precision == "bf16"``: on CUDA, and on
    a CPU that multiplies bf16 in hardware (:func:`cpu_has_native_bf16`).

    On another CPU it is a no-op and the step runs in fp32: bf16 products are emulated there, slower
    than fp32 ones, so a recipe written for GPUs runs as fast as it can when it is smoke-tested on
    a laptop. ``allow_cpu`` overrides the hardware check either way. Parameters, gradients and
    optimizer state stay fp32 (autocast casts per op). Under FSDP on CUDA, wrap_model's
    MixedPrecisionPolicy also gathers bf16 parameter copies and reduces gradients in fp32; autocast
    still runs the ops on its fp32 list (softmax, LayerNorm, losses) in fp32.
    """
    if plan.precision != "bf16":
        return nullcontext()
    if device.type == "cpu" and (cpu_has_native_bf16() if allow_cpu is None else allow_cpu):
        return torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return nullcontext()


def lower_residual(model: nn.Module, residual: str, precision: str) -> str | None:
    """``train.residual: bf16``: every ``ctxmodels.ops.LayerNorm`` of ``model`` returns bf16 under
    autocast (``low_precision_layernorms``) when the step runs in bf16 (``step_precision``);
    returns a warning where that changes nothing (the step runs fp32 here, or the family's
    LayerNorms are torch's own), else None."""
    if residual != "bf16":
        return None
    if precision != "bf16":
        return "warning: train.residual is 'bf16', but the step runs in fp32 here: the residual stream stays float32"
    from ctxmodels.ops import low_precision_layernorms

    if not low_precision_layernorms(model):
        return f"warning: train.residual is 'bf16', but {type(model).__name__}'s LayerNorms are torch's own: their outputs stay float32"
    return None


def skip_padding(model: nn.Module, unpad: bool, device: torch.device) -> str | None:
    """``train.unpad: true``: on CUDA, every BERT-family encoder of ``model`` (BERT, RoBERTa,
    SpanBERT) runs its eager passes on the real tokens only (``ctxmodels.bert.JaggedPacking``).
    On CPU they skip padding anyway (length groups, faster there). Returns a warning where the
    model has no such encoder, else None."""
    if not unpad:
        return None
    from ctxmodels.bert import BertModel

    encoders = [m for m in model.modules() if isinstance(m, BertModel)]
    if not encoders:
        return (f"warning: train.unpad is true, but {type(model).__name__} has no BERT, RoBERTa or SpanBERT encoder: "
                "its batches stay padded")
    for encoder in encoders:
        encoder.jagged = device.type == "cuda"
    return None


@contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def no_sync(model: nn.Module, active: bool) -> ContextManager:
    """Skip the gradient all-reduce / reduce-scatter while ``active`` (the accumulation
    micro-steps before the last): gradients accumulate locally and the next synced backward
    reduces their sum. Put the micro-step's forward and backward inside it (DDP needs both).
    FSDP2 keeps unsharded gradients between micro-steps (memory of one full copy)."""
    if not active:
        return nullcontext()
    inner = _strip_compile(model)
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        return inner.no_sync()
    if _is_fsdp(inner):
        return _fsdp_no_sync(unwrap(inner))
    return nullcontext()


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float) -> Tensor:
    """Scale gradients so that their global L2 norm is at most ``max_norm``; returns the norm
    before clipping (a plain tensor, the same on every rank).

    With DDP the gradients are already averaged, whole tensors. With FSDP2 each rank holds a shard
    (DTensor) of every gradient: the per-rank sums of squares are combined across ranks before the
    square root, so the norm is that of the full gradient, not of one shard.
    """
    params = [p for p in unwrap(model).parameters() if p.grad is not None]
    total = grad_norm(model)
    nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def clipped_step(model: nn.Module, optimizer: torch.optim.Optimizer, norm: Tensor, max_norm: float) -> None:
    """``optimizer.step()`` on the gradients clipped to global L2 norm ``max_norm`` (0: no
    clipping), ``norm`` being their norm before clipping (``grad_norm``): what ``clip_grad_norm``
    then ``optimizer.step()`` do, with the clipping folded into a fused step.

    A fused torch optimizer (``fused=True`` Adam, AdamW, SGD, ...) divides each gradient by
    ``optimizer.grad_scale`` as it reads it: the hook ``torch.amp.GradScaler`` unscales through
    (``_step_supports_amp_scaling``). Passing it 1 / the clipping factor spares the pass of
    ``clip_grads_with_norm_``, which reads and writes every gradient before the step reads them
    again (3 ms of a 215 ms all-MiniLM-L6-v2 fine-tuning step on 2 cores, half of it the word
    embedding's). The weights, and the gradients left in ``.grad``, are the same up to float
    rounding (tests/jobs/training/test_parallel.py). Other optimizers clip first, then step.
    """
    if max_norm <= 0:
        optimizer.step()
        return
    if getattr(optimizer, "_step_supports_amp_scaling", False) and not hasattr(optimizer, "grad_scale"):
        # clip_grads_with_norm_ multiplies by min(1, max_norm / (norm + 1e-6)); the step divides by its inverse
        optimizer.grad_scale = ((norm.detach().float() + 1e-6) / max_norm).clamp(min=1.0)
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
        return
    nn.utils.clip_grads_with_norm_([p for p in unwrap(model).parameters() if p.grad is not None], max_norm, norm)
    optimizer.step()


@torch.no_grad()
def grad_norm(model: nn.Module) -> Tensor:
    """The global L2 norm of the gradients (a plain tensor, the same on every rank; a collective
    under FSDP), without clipping: what the step's finiteness check reads when nothing clips."""
    from torch.distributed.tensor import DTensor

    total = nn.utils.get_total_norm([p.grad for p in unwrap(model).parameters() if p.grad is not None], norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # the pending cross-rank reduction of the shards' norms
    return total


@torch.no_grad()
def all_finite(model: nn.Module) -> bool:
    """Whether every weight of the model is finite, on every rank (a collective when a process group
    is up: under FSDP each rank checks its own shards, and all must agree before a checkpoint)."""
    from torch.distributed.tensor import DTensor

    params = [p.to_local() if isinstance(p, DTensor) else p for p in unwrap(model).parameters()]
    bad = torch.zeros(1, device=params[0].device if params else "cpu")
    for p in params:
        bad += (~torch.isfinite(p)).any()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


# ---------------------------------------------------------------------------------------------
# Checkpoints: full (unsharded) CPU state on rank 0, with the single-device names


def full_state_dict(model: nn.Module) -> dict[str, Tensor] | None:
    """The original module's state dict, unsharded, on CPU, names without ``module.`` or
    ``_orig_mod.``: on rank 0; None on the other ranks. With FSDP every rank must call it (each
    sharded tensor is all-gathered, in the same order everywhere)."""
    from torch.distributed.tensor import DTensor

    keep = _rank() == 0
    out: dict[str, Tensor] = {}
    for name, value in unwrap(model).state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()  # collective: every rank takes part
        if keep:
            out[name] = value.detach().to("cpu", copy=True)
    return out if keep else None


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the optimizer's parameters, in the order ``optimizer.state_dict()`` numbers them."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    "the optimizer holds a parameter that is not the model's: with FSDP, build the "
                    "optimizer after wrap_model (fully_shard replaces every parameter)"
                )
            out.append(names[id(p)])
    return out


def _cpu_copy(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cpu_copy(v) for v in value]
    return value


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The optimizer state as a single-device ``optimizer.state_dict()`` would hold it (parameters
    numbered 0, 1, ... in param-group order, full tensors on CPU): on rank 0, None elsewhere. So a
    checkpoint from a DDP, FSDP or single-worker run resumes under any of them. Every rank calls it.

    With FSDP the sharded DTensor states are gathered by
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(full_state_dict=True,
    cpu_offload=True)``, which names parameters by FQN; they are renumbered here.
    """
    keep = _rank() == 0
    names = _param_names(model, optimizer)
    if not _is_fsdp(model) or not optimizer.state:
        # Nothing is sharded (or there is no state yet: get_optimizer_state_dict would take a
        # zero-lr step to create it, which would advance AdamW's step count).
        return _cpu_copy(optimizer.state_dict()) if keep else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    by_name = get_optimizer_state_dict(
        unwrap(model), optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not keep:
        return None
    index = {name: i for i, name in enumerate(names)}
    groups = []
    for group in by_name["param_groups"]:
        groups.append({**group, "params": [index[name] for name in group["params"]]})
    state = {index[name]: _cpu_copy(values) for name, values in by_name["state"].items()}
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Inverse of ``full_optimizer_state``: every rank passes the same full state (as read from the
    checkpoint; parameter ids 0, 1, ... as ints); with FSDP each rank keeps its shard of every
    tensor. Build ``optimizer`` after ``wrap_model``, with the same parameter groups as the saved one."""
    if not _is_fsdp(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _param_names(model, optimizer)
    n_saved = sum(len(g["params"]) for g in state["param_groups"])
    if n_saved != len(names):
        raise ValueError(
            f"the optimizer state holds {n_saved} parameters but this optimizer has {len(names)}: "
            "was it saved with other frozen parameters or another model?"
        )
    groups = [{**group, "params": [names[int(i)] for i in group["params"]]} for group in state["param_groups"]]
    by_name = {"state": {names[int(i)]: values for i, values in state["state"].items()}, "param_groups": groups}
    # strict=False: as with Optimizer.load_state_dict, a parameter without saved state (it never
    # had a gradient) is allowed. It keeps the zero state set_optimizer_state_dict creates by a
    # zero-lr step, so its AdamW step count starts at 1 instead of 0 (a tiny bias-correction change).
    set_optimizer_state_dict(
        unwrap(model), optimizer, by_name, options=StateDictOptions(full_state_dict=True, strict=False)
    )
