"""Data-parallel scaling of a BERT pretraining step: DDP and FSDP2 on 1..N devices, side by side.

Run (a machine with several GPUs): ``python benchmarks/gpu_scaling.py --device cuda --preset base``.
Options: ``--strategies ddp fsdp``, ``--worlds 1 2 4 8`` (default: 1 and every power of two up to
the GPUs there), ``--batch`` rows of 128 tokens per device (default 32), ``--steps``, ``--compile``
(``none``, ``blocks``, ``graphs``: as ``train.compile`` false, true, graphs). A smoke run on the CPU:
``python benchmarks/gpu_scaling.py --device cpu --preset mini --worlds 1 2 --steps 3`` (gloo).

Each world size runs in its own processes (``torch.multiprocessing``, one per device, NCCL on CUDA
and gloo on the CPU), and each process trains as ``ctx pretrain``'s workers do: the model wrapped by
``jobs.training.parallel.wrap_model`` (DDP, or FSDP2 with bf16 gathers and fp32 gradient reductions), bf16
autocast on CUDA (``--precision``), batches moved by ``jobs.training.loop.to_device`` (the masked positions
found on the host, padded), the clipped fused AdamW step of ``jobs.training.parallel.clipped_step``. Weak
scaling: every device takes ``--batch`` rows per step (parameters the loss never reaches, the
pooler without NSP, frozen first by ``jobs.training.loop.freeze_unused``, as there), so N devices train N times the tokens of one
in a step; its time grows by what the gradient all-reduce (DDP) or the parameter all-gathers and
gradient reduce-scatters (FSDP2) cost beyond what overlaps the computation. A world of 1 is the
single device with no wrapper at all, the baseline of both strategies.

Printed per strategy and world: tokens/s in all, per device, the median step, and the scaling
efficiency, tokens/s over (N x the one device's); last, ``scaling_efficiency_<strategy>: X`` for
the largest world. The steps are timed after ``--warmup`` steps (compilation, NCCL's first
collectives), each ending with a synchronize and a barrier, so the slowest rank sets the time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SEED = 1234


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from jobs.training import parallel
    from jobs.training.loop import freeze_unused, model_inputs, to_device
    from train_throughput import MAX_NORM, SEQ_LEN, make_batches, model_config, param_groups

    from ctxmodels.bert import BertForPreTraining

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, args.threads // world))
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(SEED)  # the same initial weights on every rank, as a checkpoint would give
        model = BertForPreTraining(model_config(args.dropout, args.preset)).train()
        compile_ = {"none": False, "blocks": True, "graphs": "graphs"}[args.compile]
        plan = parallel.ParallelPlan(strategy=args.strategy, precision=args.precision, compile=compile_)
        if args.precision == "bf16" and args.residual == "bf16":
            from ctxmodels.ops import low_precision_layernorms

            low_precision_layernorms(model)
        host_batches = make_batches(3, SEED + rank, args.batch)  # each rank its own rows, as Ray Data's shards
        freeze_unused(model, {k: v[:2] for k, v in host_batches[0].items()})  # the pooler, without NSP: as ctx pretrain
        model = parallel.wrap_model(model, plan, device)
        optimizer = torch.optim.AdamW(param_groups(parallel.unwrap(model)), lr=1e-4, fused=True)
        autocast = parallel.autocast(plan, device)
        batches = [model_inputs(to_device(b, device, label_positions=True)) for b in host_batches]

        def step(batch) -> None:
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            parallel.clipped_step(model, optimizer, parallel.grad_norm(model), MAX_NORM)
            optimizer.zero_grad(set_to_none=True)

        times = []
        for i in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            step(batches[i % len(batches)])
            if cuda:
                torch.cuda.synchronize(device)
            dist.barrier()  # the step ends when the slowest rank is done
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        if rank == 0:
            Path(out).write_text(f"{statistics.median(times)} {world * args.batch * SEQ_LEN}")
    finally:
        dist.destroy_process_group()


def run(world: int, args: argparse.Namespace) -> tuple[float, int]:
    """(median step seconds, tokens per step) of ``world`` processes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.start_processes(_worker, args=(world, free_port(), args, out), nprocs=world, start_method="spawn")
        seconds, tokens = Path(out).read_text().split()
    return float(seconds), int(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--preset", choices=("mini", "base"), default="base")
    parser.add_argument("--batch", type=int, default=32, help="rows of 128 tokens per device and step (default 32)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per world (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    parser.add_argument("--strategies", nargs="+", choices=("ddp", "fsdp"), default=["ddp", "fsdp"])
    parser.add_argument("--worlds", nargs="+", type=int, default=None,
                        help="world sizes (default: 1 and the powers of two up to the GPUs there)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--residual", choices=("fp32", "bf16"), default="bf16", help="with bf16: train.residual (default bf16)")
    parser.add_argument("--compile", choices=("none", "blocks", "graphs"), default=None,
                        help="as train.compile (default: blocks on CUDA, none on the CPU; graphs compiles the whole model "
                             "on one device only, blocks on several)")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU: threads shared by the ranks")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: PyTorch sees no GPU here (--device cpu runs the smoke check on gloo)")
    args.precision = args.precision or ("bf16" if cuda else "fp32")
    args.compile = args.compile or ("blocks" if cuda else "none")
    n_devices = torch.cuda.device_count() if cuda else 2
    worlds = sorted(set(args.worlds or [1, *[2**k for k in range(1, 4) if 2**k <= n_devices]]))
    if cuda and max(worlds) > n_devices:
        raise SystemExit(f"--worlds {worlds}: this machine has {n_devices} GPU(s)")
    where = (f"{n_devices} x {torch.cuda.get_device_name(0)}" if cuda
             else f"CPU, gloo, {args.threads} threads shared by the ranks (a smoke check: not a scaling figure)")
    print(f"{where}; BERT-{args.preset}, {args.batch} x 128 per device, precision "
          f"{args.precision}, compile {args.compile}, {args.steps} timed steps after {args.warmup}; torch {torch.__version__}")
    if len(worlds) == 1 and worlds[0] == 1:
        print("one device only: no scaling to measure (the world of 1 is still timed)")

    args.strategy = args.strategies[0]
    baseline = run(1, args) if 1 in worlds else None  # a world of 1 has no wrapper: one run for every strategy
    single = baseline[1] / baseline[0] if baseline else None  # tokens/s of one device
    for strategy in args.strategies:
        args.strategy = strategy
        efficiency = float("nan")
        for world in worlds:
            seconds, tokens = baseline if world == 1 else run(world, args)
            tps = tokens / seconds
            efficiency = tps / (world * single) if single else float("nan")
            print(f"{strategy} world {world}: {tps:,.0f} tokens/s ({tps / world:,.0f} per device), "
                  f"step {seconds * 1e3:.1f} ms, scaling efficiency {efficiency:.2f}")
        if worlds[-1] > 1:
            print(f"scaling_efficiency_{strategy}: {efficiency:.2f} (world {worlds[-1]})")


if __name__ == "__main__":
    main()
