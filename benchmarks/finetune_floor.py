"""The least an fp32 fine-tuning step of ours can take on this machine, and the ceiling that puts
on ``speedup_vs_transformers`` (``benchmarks/finetune_throughput.py``).

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/finetune_floor.py`` (about 2 minutes on 2 cores).
For each task kind the last lines are ``floor_ms_<kind>``, ``other_ops_ms_<kind>`` and
``speedup_ceiling_<kind>``.

Same model, batches, harness and ABBA timing as ``finetune_throughput.py``. Beside our step and
transformers' step, each round also times, on the same batches and under the same load:

- ``matmuls``: every matrix product of our step (forward and backward: ``mm``, ``addmm``, ``bmm``,
  ``baddbmm``), recorded once per batch with a ``TorchDispatchMode`` and replayed alone on fresh
  tensors of the same sizes and strides. No implementation of the same math can skip these: they
  are the products on the real tokens only (the padding is already skipped).
- ``optimizer``: what our step does after ``backward()``, with gradients in place: the gradient
  norm, fused ``AdamW.step()`` with the clipping folded in, ``zero_grad(set_to_none=True)``
  (``ft.optimizer_step``). Any dense AdamW step pays it; transformers' own is dearer.
- ``embedding grad``: the word embedding's dense gradient on the batch's real tokens (a zeroed
  vocabulary x d_model tensor, then the rows added), which a dense optimizer needs from any model;
  zeroed in place in a tensor kept across steps, as ``ctxmodels.ops.Embedding`` does (a fresh one
  would pay for its page faults too).

``floor`` is their sum: our step with every other op (LayerNorm, GELU, dropout, softmax, residual
adds, gathers, copies, the loss) free. ``speedup_ceiling`` = transformers' step / floor: the speedup
no fp32 implementation of our step reaches on this machine. ``other_ops`` = our step - floor; the
2x target leaves ``transformers / 2 - floor`` for them. The replayed products run on warm caches
with nothing between them, so the floor is, if anything, low and the ceiling high.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import finetune_throughput as ft  # noqa: E402  (benchmarks/finetune_throughput.py: model, batches, harness)
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

aten = torch.ops.aten
PRODUCTS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


@dataclass(frozen=True)
class Call:
    func: Any
    args: tuple  # tensors as (size, stride, dtype), everything else as given
    kwargs: dict
    flops: int


def _flops(func: Any, args: tuple) -> int:
    a, b = (args[1], args[2]) if func in (aten.addmm.default, aten.baddbmm.default) else (args[0], args[1])
    *batch, m, k = a.shape
    n = b.shape[-1]
    return 2 * m * k * n * (batch[0] if batch else 1)


class RecordProducts(TorchDispatchMode):
    """Runs every op as usual and notes each matrix product's op, shapes and strides."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS:
            meta = tuple((tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor) else x for x in args)
            self.calls.append(Call(func, meta, dict(kwargs), _flops(func, args)))
        return func(*args, **kwargs)


def record_products(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[Call]:
    """The matrix products of one forward and backward of ``model`` on ``batch`` (its keywords)."""
    with RecordProducts() as rec:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return rec.calls


def replayer(calls: list[Call]) -> Callable[[Any], None]:
    """Runs ``calls`` again on fresh random tensors of the recorded sizes and strides."""
    g = torch.Generator().manual_seed(0)

    def fresh(x: Any) -> Any:
        if isinstance(x, tuple) and len(x) == 3 and isinstance(x[2], torch.dtype):
            size, stride, dtype = x
            return torch.empty_strided(size, stride, dtype=dtype).normal_(generator=g)
        return x

    ready = [(c.func, tuple(fresh(x) for x in c.args), c.kwargs) for c in calls]

    def run(_batch: Any) -> None:
        for func, args, kwargs in ready:
            func(*args, **kwargs)

    return run


def optimizer_only(model: nn.Module) -> Callable[[Any], None]:
    """Our step after ``backward()`` (``ft.optimizer_step``), on a copy of ``model`` with random
    gradients put in place before each call."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    optimizer = torch.optim.AdamW(ft.param_groups(model), lr=ft.LR, fused=True)

    def run(_batch: Any) -> None:
        for p, gr in zip(params, grads):
            p.grad = gr
        ft.optimizer_step(model, optimizer, ours=True)

    return run


def embedding_grad(vocab: int, d_model: int) -> Callable[[dict[str, torch.Tensor]], None]:
    """The word embedding's dense gradient for the batch's real tokens, in a kept tensor."""
    kept = torch.zeros(vocab, d_model)

    def run(batch: dict[str, torch.Tensor]) -> None:
        ids = batch["input_ids"][batch["attention_mask"].bool()]
        kept.zero_().index_add_(0, ids, torch.ones(ids.numel(), d_model))

    return run


def floor(kind: str, rounds: int, dropout: float) -> dict[str, float]:
    batches, ours, theirs = ft.prepare(kind, dropout)
    inputs = ft.our_inputs(kind)  # ctx finetune's keywords (token classification: labelled positions only)
    calls = [record_products(ours, inputs(b)) for b in batches]
    flops = sum(c.flops for cs in calls for c in cs) / len(batches)
    products = [replayer(cs) for cs in calls]
    by_batch = {id(b): run for b, run in zip(batches, products)}
    words = next(m for m in ours.modules() if isinstance(m, nn.Embedding))  # the first: word pieces
    sides = {
        "ours": ft.make_step(ours, inputs, ours=True),
        "transformers": ft.make_step(theirs, lambda b: b),
        "matmuls": lambda b: by_batch[id(b)](b),
        "optimizer": optimizer_only(ours),
        "embedding grad": embedding_grad(words.num_embeddings, words.embedding_dim),
    }
    seconds = ft.time_rounds(sides, batches, rounds)
    ms = {name: statistics.median(s) / len(batches) * 1e3 for name, s in seconds.items()}
    out = {
        "ours": ms["ours"],
        "transformers": ms["transformers"],
        "speedup": ms["transformers"] / ms["ours"],
        "matmuls": ms["matmuls"],
        "gflop": flops / 1e9,
        "optimizer": ms["optimizer"],
        "embedding_grad": ms["embedding grad"],
    }
    out["floor"] = out["matmuls"] + out["optimizer"] + out["embedding_grad"]
    out["other_ops"] = out["ours"] - out["floor"]
    out["ceiling"] = out["transformers"] / out["floor"]
    out["budget_2x"] = out["transformers"] / 2 - out["floor"]
    return out


def matmul_peak(n: int = 1024, repeats: int = 20) -> float:
    """GFLOP/s of square fp32 products at the current thread count (median of ``repeats``)."""
    import time

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=ft.ROUNDS)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--kind", choices=["classification", "token-classification", "both"], default="both")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = ["classification", "token-classification"] if args.kind == "both" else [args.kind]
    print(f"threads {torch.get_num_threads()}, square 1024 fp32 products: {matmul_peak():.0f} GFLOP/s")
    results = {kind: floor(kind, args.rounds, args.dropout) for kind in kinds}
    for kind, r in results.items():
        print(
            f"\n{kind} (ms/step, medians): ours {r['ours']:.0f}, transformers {r['transformers']:.0f} "
            f"(speedup {r['speedup']:.2f}); our matrix products {r['matmuls']:.0f} "
            f"({r['gflop']:.1f} GFLOP, {r['gflop'] / r['matmuls'] * 1e3:.0f} GFLOP/s), optimizer {r['optimizer']:.0f}, "
            f"embedding grad {r['embedding_grad']:.0f}; other ops {r['other_ops']:.0f}, "
            f"of which a 2x step could spend {r['budget_2x']:.0f}"
        )
    print()
    for kind, r in results.items():
        key = kind.replace("-", "_")
        print(f"floor_ms_{key}: {r['floor']:.1f}")
        print(f"other_ops_ms_{key}: {r['other_ops']:.1f}")
        print(f"speedup_ceiling_{key}: {r['ceiling']:.2f}")


if __name__ == "__main__":
    main()
