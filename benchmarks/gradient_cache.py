"""A gradient-cached embedding step (``task.gradient_cache``) on CPU: ours against
sentence-transformers' CachedMultipleNegativesRankingLoss, side by side, with the memory each one's
step takes beyond its resting weights, and the plain one-forward step of the same batch on both
sides (the memory the cache saves).

Run: ``python benchmarks/gradient_cache.py`` (about 2 minutes on 2 cores). The last lines are
``key: value``, the very last ``speedup_vs_sentence_transformers: X`` (sentence-transformers'
cached step's median seconds over ours').

Model: the real all-MiniLM-L6-v2 (dropout 0.1, train mode), on both sides as
``benchmarks/embedding_finetune.py`` builds it. Batch: the first ``--batch`` (default 128) records of
``data/tasks/definitions/train.jsonl``, three texts each (anchor, definition, hard negative), cut to
64 tokens; ours encoded as ``ctx finetune``'s data stage encodes them, theirs as their collator does.

Steps (``--micro``, default 16 rows a forward):
* ``ours_cached``: ``jobs.training.loop.Stepper`` itself with ``batch / micro`` micro-batches and the
  embedding model's ``texts_loss`` as its cached loss (what ``ctx finetune`` runs with
  ``train.micro_batch_size`` below the batch): a forward of each micro-batch without a graph, the
  loss on all their vectors, then each micro-batch's forward again and its backward; clipping to
  norm 1.0 and a fused AdamW step.
* ``theirs_cached``: ``CachedMultipleNegativesRankingLoss(model, mini_batch_size=micro)``, backward,
  ``clip_grad_norm_``, fused AdamW step (their trainer's step).
* ``ours_plain`` and ``theirs_plain``: the whole batch in one forward with the loss
  (MultipleNegativesRankingLoss on their side): the same gradients, the memory of every activation at once.

Each step runs in a fresh process (so one step's freed memory does not hide another's peak), after
one warm-up step: peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``) over
the timed steps minus the resident memory before them is the step's memory. The sides run in turn,
``--rounds`` times (ABBA order); seconds are medians. The machine is shared: compare the ratios.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

SIDES = ("ours_cached", "theirs_cached", "ours_plain", "theirs_plain")


def memory_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def one_side(side: str, batch: int, micro: int, steps: int, threads: int) -> dict:
    """Build ``side``'s model, optimizer and batch; one warm-up step, then ``steps`` timed ones."""
    import torch
    from torch import nn

    import embedding_finetune as ef
    from jobs.training import parallel

    torch.set_num_threads(threads)
    torch.manual_seed(ef.SEED)
    records = ef.read_records("train")[:batch]
    if side.startswith("ours"):
        from jobs.training.finetune_inputs import train_inputs
        from jobs.training.loop import StepMeter, Stepper, TrainState
        from pipelines.tokenizers import load_tokenizer

        model = ef.build_ours().train()
        tok = load_tokenizer(ef.minilm_dir())
        optimizer = torch.optim.AdamW(ef.param_groups(model), lr=ef.LR, fused=True)
        n = batch // micro if side == "ours_cached" else 1
        stepper = Stepper(model, optimizer, parallel.ParallelPlan(strategy="ddp"), torch.device("cpu"), n, batch, ef.LR,
                          lambda samples: 1.0, grad_clip=ef.MAX_NORM, inputs=train_inputs,
                          cached_loss=model.texts_loss if side == "ours_cached" else None)
        size = batch // n
        micro_batches = [dict(ef.our_batch(records[i : i + size], tok), sample_id=list(range(size))) for i in range(0, batch, size)]
        state = TrainState()

        def step() -> float:
            meter = StepMeter()
            assert not stepper.step(iter(micro_batches), state, meter).skipped
            return meter.counts["loss"] / meter.counts["micro"]
    else:
        from sentence_transformers.sentence_transformer.losses import (CachedMultipleNegativesRankingLoss,
                                                                      MultipleNegativesRankingLoss)

        model = ef.build_theirs().train()
        loss_fn = CachedMultipleNegativesRankingLoss(model, mini_batch_size=micro) if side == "theirs_cached" \
            else MultipleNegativesRankingLoss(model)
        optimizer = torch.optim.AdamW(ef.param_groups(model), lr=ef.LR, fused=True)
        features = ef.their_batch(model, records)

        def step() -> float:
            loss = loss_fn(features, None)
            loss.backward()
            nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], ef.MAX_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss.detach())

    step()  # warm-up: the optimizer's state exists from here on, on both sides
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident size starts again from the current one
    rest = memory_kb("VmRSS")
    seconds, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        seconds.append(time.perf_counter() - t0)
    return {"side": side, "seconds": statistics.median(seconds), "step_mb": (memory_kb("VmHWM") - rest) / 1024,
            "loss": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=128, help="records a step (3 texts each)")
    parser.add_argument("--micro", type=int, default=16, help="records a forward of the cached steps")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one process's part
    args = parser.parse_args()
    if args.batch % args.micro:
        raise SystemExit(f"--batch {args.batch} is not a multiple of --micro {args.micro}")
    if args.side:
        print(json.dumps(one_side(args.side, args.batch, args.micro, args.steps, args.threads)))
        return
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    got: dict[str, list[dict]] = {side: [] for side in SIDES}
    print(f"threads {args.threads}, {args.batch} records x 3 texts a step (max 64 tokens), cached steps forward {args.micro} records "
          f"at a time; {args.steps} timed steps a process, {args.rounds} rounds")
    for r in range(args.rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            cmd = [sys.executable, __file__, "--side", side, "--batch", str(args.batch), "--micro", str(args.micro),
                   "--steps", str(args.steps), "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
            if out.returncode != 0:
                raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            got[side].append(result)
            print(f"round {r + 1}/{args.rounds} {side}: {3 * args.batch / result['seconds']:,.1f} texts/s, "
                  f"step memory {result['step_mb']:,.0f} MB, loss {result['loss']:.4f}")
    med = {side: statistics.median(x["seconds"] for x in runs) for side, runs in got.items()}
    mem = {side: max(x["step_mb"] for x in runs) for side, runs in got.items()}
    for side in SIDES:
        print(f"texts_per_s_{side}: {3 * args.batch / med[side]:.1f}")
        print(f"step_mb_{side}: {mem[side]:.0f}")
    print(f"memory_cached_vs_plain_ours: {mem['ours_cached'] / mem['ours_plain']:.2f}")
    print(f"memory_vs_sentence_transformers_cached: {mem['ours_cached'] / mem['theirs_cached']:.2f}")
    print(f"cached_cost_vs_plain_ours: {med['ours_cached'] / med['ours_plain']:.2f}")
    print(f"speedup_vs_sentence_transformers: {med['theirs_cached'] / med['ours_cached']:.2f}")


if __name__ == "__main__":
    main()
