"""Training-step throughput: our BERT against transformers' ``BertForMaskedLM``, side by side.

Run: ``python benchmarks/train_throughput.py`` (2 to 4 minutes on 2 cores). Options: ``--threads``,
``--rounds``, ``--dropout``, ``--adamw``, ``--device``, ``--precision``, ``--preset``, ``--batch``,
``--compile`` (blocks, whole, none), ``--compile-mode``, ``--residual``, ``--profile`` (see ``--help``).
The last two lines are ``speedup_vs_transformers: X`` (our tokens/s over theirs) and ``mfu: X`` (ours).

On a GPU (``--device cuda``): both models and batches on the device, ``--precision bf16`` runs both
forwards and losses under ``torch.autocast(bfloat16)`` (fp32 weights and AdamW, as
``jobs.training.parallel.autocast`` in training), every timed step ends with ``torch.cuda.synchronize``, and
MFU is against the GPU's datasheet dense peak for that precision (``ctxmodels.flops.device_peak_flops``).
On a CPU with native bf16 products (AVX512-BF16 or AMX, where ``jobs.training.parallel.autocast`` trains in
bf16), ``--precision bf16`` autocasts both sides the same way and MFU is against measured bf16 products.

The same network on both sides: 4 layers, d_model 256, 4 heads, d_ff 1024, vocab 30522, exact GELU,
post-LN, the decoder tied to the word embeddings, dropout 0.1 on hidden states and attention
probabilities (BERT's, and our config's default; ``--dropout 0`` turns it off on both sides).
Ours is ``ctxmodels.bert.BertForPreTraining`` without NSP; its weights are copied into the
transformers model through ``ctxmodels.hf``'s name tables, and before timing the script checks that
both give the same loss and the same word-embedding gradient on a batch (dropout off).

One timed step, on both sides: ``model(input_ids, attention_mask, labels).loss``, its backward,
clipping to gradient norm 1.0, ``AdamW.step()``, ``zero_grad(set_to_none=True)``; transformers
clips with ``clip_grad_norm_`` as its ``Trainer`` does, ours as ``ctx pretrain`` does
(``jobs.training.parallel.clipped_step``, the same clipping folded into a fused step). AdamW: lr 1e-4,
weight decay 0.01 on matrices, none on biases and LayerNorm (as ``jobs.training.loop.param_groups``), and
``fused=True``, which transformers' ``Trainer`` uses by default with this PyTorch;
``--adamw default`` gives both sides the Python loop over parameters that ``AdamW()`` runs on CPU
without the flag (0.1 s or more per step, the same for both). Batches: 32 rows of 128 random
word-piece ids, ``[CLS] ... [SEP]``, no padding (packed rows), masked by
``pipelines.masking.mask_tokens`` (15% of the non-special tokens become targets, 80/10/10);
``labels`` is -100 elsewhere. Both sides see the same batches in the same order. transformers runs
as a user would run it: eager mode, its default attention implementation (``sdpa``).

The objective is the same: mean cross-entropy over the masked positions. transformers computes the
vocabulary logits at all B*T positions and ignores the unmasked ones; ours computes them only at the
masked rows. Model FLOPs (``ctxmodels.flops.train_flops_per_step``) count the matrix products of
the objective as ours runs it: ``2 m n k`` per product forward, twice that backward, attention's
score and context products included, the vocabulary projection at the masked positions only,
embedding lookups free; checked against ``torch.utils.flop_counter.FlopCounterMode`` on one step of
our model. MFU = model FLOPs per step / median step time / the matmul peak: the best FLOP/s of
2048 x 2048 fp32 products on the same threads (``ctxmodels.flops.measure_matmul_peak``), measured
after every round, so it sees about the same machine load.

Timing: a round times one step of each model on every batch of the set, the two models taking
turns step by step (ABBA), so that both run under the same machine load; tokens/s are medians over
rounds. After the rounds each side takes one more step on the first batch and both losses are
printed: the two trained from the same weights on the same batches, so they agree up to dropout's
draws, and a warning says when they are over 5% apart (a compiled step that trains wrong). The machine is shared: compare the ratio, not the absolute numbers, with other runs. Under
heavy load two OpenMP threads wait for each other at every operation, which costs a step of many
short operations (ours) more than one of fewer long ones (theirs): ``--threads 1`` shows the
comparison without that effect.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from ctxmodels.bert import PRESETS, BertConfig, BertForPreTraining  # noqa: E402
from ctxmodels.compiling import compile_blocks  # noqa: E402
from ctxmodels.flops import device_peak_flops, measure_matmul_peak, train_flops_per_step  # noqa: E402
from ctxmodels.hf import to_hf  # noqa: E402
from ctxmodels.ops import low_precision_layernorms  # noqa: E402
from jobs.training.loop import POSITIONS_MULTIPLE, model_inputs, to_device  # noqa: E402
from jobs.training.parallel import cpu_has_native_bf16  # noqa: E402
from pipelines.masking import MlmConfig, VocabInfo, mask_tokens  # noqa: E402

BATCH, SEQ_LEN = 32, 128  # rows per batch (--batch), tokens per row
N_BATCHES = 3  # distinct batches, cycled; a round times each once per model
ROUNDS = 7
WARMUP_STEPS = 2 * N_BATCHES  # per model, before the first round: twice over the batches, so a compiled step
# has met every shape twice (CUDA graphs: one warm-up run, then the recording) before it is timed
CHECK_ROWS = 8  # rows of the first batch on which the two models' losses, gradients and FLOPs are checked (CPU, fp32)
SEED = 1234
LR, WEIGHT_DECAY, MAX_NORM = 1e-4, 0.01, 1.0
# bert-base-uncased's special ids: [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103
VOCAB = VocabInfo(vocab_size=30522, pad_id=0, mask_id=103, cls_id=101, sep_id=102, special_ids=(0, 100, 101, 102, 103))


def model_config(dropout: float, preset: str = "mini") -> BertConfig:
    """BERT-mini of the issue: 4 x 256, 4 heads, d_ff 1024, vocab 30522; MLM only. ``--preset base``:
    BERT-base (12 x 768), a size that keeps a GPU busy."""
    return replace(PRESETS[preset], nsp=False, dropout=dropout, attn_dropout=dropout)


def make_batches(n: int, seed: int, rows: int = BATCH) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    batches = []
    for i in range(n):
        ids = rng.integers(999, VOCAB.vocab_size, size=(rows, SEQ_LEN))  # ordinary word pieces
        ids[:, 0], ids[:, -1] = VOCAB.cls_id, VOCAB.sep_id
        raw = dict(
            input_ids=ids,
            attention_mask=np.ones((rows, SEQ_LEN), dtype=np.int64),
            sample_id=np.arange(i * rows, (i + 1) * rows),
            epoch=np.zeros(rows, dtype=np.int64),
        )
        masked = mask_tokens(raw, seed, MlmConfig(), VOCAB)
        batches.append({k: torch.from_numpy(masked[k]) for k in ("input_ids", "attention_mask", "labels")})
    return batches


def hf_twin(ours: BertForPreTraining):
    """transformers' BertForMaskedLM with the same config and our weights."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = ours.cfg
    hf_cfg = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, intermediate_size=cfg.d_ff, max_position_embeddings=cfg.max_seq_len,
        type_vocab_size=cfg.type_vocab_size, hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.attn_dropout, layer_norm_eps=cfg.layer_norm_eps, hidden_act="gelu",
        pad_token_id=cfg.pad_token_id,
    )
    hf = transformers.BertForMaskedLM(hf_cfg)
    _, tensors = to_hf(ours, "bert")  # BertForMaskedLM's names when ours has no NSP head
    result = hf.load_state_dict(tensors, strict=False)
    tied = {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise RuntimeError(f"weight copy into transformers failed: {result}")
    if hf.cls.predictions.decoder.weight.data_ptr() != hf.bert.embeddings.word_embeddings.weight.data_ptr():
        raise RuntimeError("transformers' decoder is not tied to its word embeddings")
    return hf


def check_same_objective(ours: nn.Module, hf: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """Loss of each and the largest word-embedding gradient difference, dropout off."""
    ours.eval(), hf.eval()
    loss_ours = ours(**batch).loss
    loss_ours.backward()
    loss_hf = hf(**batch).loss
    loss_hf.backward()
    grad_diff = (ours.backbone.embeddings.word.weight.grad - hf.bert.embeddings.word_embeddings.weight.grad).abs().max()
    ours.zero_grad(set_to_none=True), hf.zero_grad(set_to_none=True)
    ours.train(), hf.train()
    return loss_ours.item(), loss_hf.item(), grad_diff.item()


def counted_flops(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """FLOPs of one forward + backward as FlopCounterMode sees them. SDPA's CPU flash kernel (our
    attention without dropout) has no FLOP formula: the math backend's bmm products are counted."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def param_groups(model: nn.Module) -> list[dict]:
    """Weight decay on matrices only, as ``jobs.training.loop.param_groups``."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def make_step(model: nn.Module, fused_adamw: bool = True, autocast=contextlib.nullcontext, ours: bool = False):
    """Ours clips as ``ctx pretrain`` does (``jobs.training.parallel.clipped_step``: folded into the fused
    step), transformers' as its ``Trainer`` does (``clip_grad_norm_``, then ``step()``)."""
    from jobs.training import parallel

    optimizer = torch.optim.AdamW(param_groups(model), lr=LR, fused=fused_adamw or None)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with autocast():
            loss = model(**batch).loss
        loss.backward()
        if ours:
            parallel.clipped_step(model, optimizer, parallel.grad_norm(model), MAX_NORM)
        else:
            nn.utils.clip_grad_norm_(params, MAX_NORM)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()  # read only after timing (a CUDA graph's output: read before the next step)

    return step


def timed(step, batch, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # kernels are queued: the step ends when the GPU is done
    return time.perf_counter() - start


def products_floor(cfg: BertConfig, rows: int, n_pred: int, dtype: torch.dtype, device: torch.device, repeats: int = 20) -> float:
    """Seconds of one training step's matrix products and attention kernels alone, on ``device``:
    every product of ours (forward, and the two of each backward) at its exact shape, and SDPA's
    forward and backward (flash, no mask), in ``dtype``, back to back, nothing else. The best a
    step could do if every other op (LayerNorm, GELU, dropout, adds, the optimizer, launches) were
    free: model FLOPs / this / peak is the MFU ceiling of this batch shape on this device."""
    g = torch.Generator(device=device).manual_seed(0)
    D, F, V, H = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_head
    M = rows * SEQ_LEN

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    # (m, k, n): x (m, k) @ w (k, n); backward: dy (m, n) @ w^T, and x^T (k, m) @ dy (m, n)
    layer = [(M, D, 3 * D), (M, D, D), (M, D, F), (M, F, D)]
    head = [(n_pred, D, D), (n_pred, D, V)]
    shapes = layer * cfg.n_layer + head
    ops = []
    for m, k, n in {s: None for s in shapes}:  # each distinct shape once, weighted below
        x, w, dy = rand(m, k), rand(k, n), rand(m, n)
        ops.append(((m, k, n), lambda x=x, w=w, dy=dy: (x @ w, dy @ w.T, x.T @ dy)))
    q, k_, v = (rand(rows, H, SEQ_LEN, D // H).requires_grad_() for _ in range(3))
    dout = rand(rows, H, SEQ_LEN, D // H)

    def attention():
        out = torch.nn.functional.scaled_dot_product_attention(q, k_, v)
        torch.autograd.grad(out, (q, k_, v), dout)

    def time_of(fn) -> float:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, (time.perf_counter() - start) / repeats)
        return best

    count = {shape: shapes.count(shape) for shape in set(shapes)}
    total = sum(count[shape] * time_of(fn) for shape, fn in ops)
    return total + cfg.n_layer * time_of(attention)


# kernel name -> what it is, first match wins (cuBLAS/CUTLASS products, flash attention, inductor's
# fused Triton kernels, eager element-wise and reduction kernels, the fused optimizer, copies)
KERNEL_KINDS = [
    ("attention", ("flash", "fmha", "attention", "efficient_attention")),
    ("products", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "ampere_", "hopper")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("inductor fused", ("triton",)),
    ("copies, fills", ("memcpy", "memset", "copy", "fill")),
    ("loss, softmax", ("softmax", "cross_entropy", "nll", "log_softmax")),
    ("reductions, norms", ("reduce", "norm", "welford")),
    ("embedding, gathers", ("embedding", "index", "gather", "scatter", "nonzero", "sort", "radix", "cub::")),
    ("element-wise", ("elementwise", "vectorized", "unrolled", "dropout", "fused_dropout")),
]


def kernel_kind(name: str) -> str:
    lower = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in lower for n in needles):
            return kind
    return "other"


def is_annotation(event) -> bool:
    """Whether a profiler event on the GPU's timeline is a ``record_function`` range (a user
    annotation, such as the optimizer's ``Optimizer.step#AdamW.step``), not a kernel or a copy."""
    return bool(getattr(event, "is_user_annotation", False)) or event.name.startswith("Optimizer.")


def gpu_busy(step, batches, device: torch.device, steps: int = 3) -> tuple[float, float, list[tuple[str, float, int]]]:
    """(GPU kernel seconds per step, wall seconds per step, kernels) over ``steps`` steps under
    torch.profiler: where the first is much smaller, the GPU waits on the host (launches, syncs).
    ``kernels``: (name, seconds per step, launches per step) of each distinct kernel."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for i in range(steps):
            step(batches[i % len(batches)])
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    # the GPU's own events, less the ranges the profiler draws on the GPU's timeline for a
    # record_function (Optimizer.step#AdamW.step spans the optimizer's kernels: not one itself)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and not is_annotation(e)]
    # union of kernel intervals: overlapping kernels (several streams) count once
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    per_name: dict[str, list[float]] = {}
    for e in kernels:
        per_name.setdefault(e.name, []).append((e.time_range.end - e.time_range.start) / 1e6)
    table = [(name, sum(ts) / steps, round(len(ts) / steps)) for name, ts in per_name.items()]
    return busy / 1e6 / steps, wall / steps, sorted(table, key=lambda row: -row[1])


def print_kernels(name: str, table: list[tuple[str, float, int]], top: int = 12) -> None:
    """Kernel time per step by kind, then the ``top`` kernels: where a GPU-bound step goes."""
    kinds: dict[str, list[float]] = {}
    for kernel, seconds, launches in table:
        k = kinds.setdefault(kernel_kind(kernel), [0.0, 0])
        k[0] += seconds
        k[1] += launches
    total = sum(seconds for _, seconds, _ in table)
    print(f"kernels {name}: {total * 1e3:.1f} ms/step in {sum(n for _, _, n in table)} launches; by kind: "
          + "; ".join(f"{kind} {t * 1e3:.1f} ms ({n})" for kind, (t, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])))
    for kernel, seconds, launches in table[:top]:
        print(f"  {seconds * 1e3:7.2f} ms {launches:4d}x  [{kernel_kind(kernel)}] {kernel[:110]}")


def host_syncs(step, batch) -> list[str]:
    """Where one step makes the host wait for the GPU (``torch.cuda.set_sync_debug_mode``): for
    each synchronizing call, the innermost line of this repository's code on the stack and the
    library line that synchronized, with their counts. Each one drains the GPU's queue."""
    import traceback
    import warnings

    repo = str(Path(__file__).resolve().parents[1])
    lines: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" not in str(message):  # not the mode's own "prototype feature" notice
            return
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if f.filename.startswith(repo) and not f.filename.endswith("train_throughput.py")]
        frames = ours[-1:] or [f for f in stack if "warnings" not in f.filename][-3:]  # else the innermost lines
        where = " < ".join(f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno}" for f in reversed(frames))
        lib = "/".join(Path(filename).parts[-2:])
        key = f"{where} ({lib}:{lineno})"
        lines[key] = lines.get(key, 0) + 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{where} x{n}" for where, n in lines.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both (default 2)")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout of both (default 0.1)")
    parser.add_argument("--adamw", choices=("fused", "default"), default="fused",
                        help="AdamW implementation of both: fused (default), or what AdamW() picks without the "
                             "flag (on CPU a Python loop over the parameters)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: both forwards under torch.autocast(bfloat16), on CUDA or a native-bf16 CPU (default fp32)")
    parser.add_argument("--preset", choices=("mini", "base"), default="mini", help="BERT size (default mini, 4 x 256)")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"rows of {SEQ_LEN} tokens per step (default {BATCH})")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode of ours' blocks (default: PyTorch's; e.g. reduce-overhead: CUDA graphs)")
    parser.add_argument("--profile", action="store_true",
                        help="CUDA: after timing, profile 3 steps of each side; print the GPU's kernel time per step "
                             "against the step's wall time (gpu_busy)")
    parser.add_argument("--residual", choices=("fp32", "bf16"), default="fp32",
                        help="ours under bf16 autocast: the LayerNorm outputs (the residual stream between blocks) "
                             "in float32 (default, as plain autocast) or bf16 (ops.low_precision_layernorms, as train.residual: bf16 does)")
    parser.add_argument("--compile", choices=("auto", "blocks", "whole", "none"), default="auto",
                        help="ours: each Transformer block under torch.compile (ctxmodels.compiling, as train.compile), "
                             "the whole model in one graph (with --compile-mode reduce-overhead: forward and backward "
                             "each one CUDA graph, as train.compile: graphs on one GPU), or eager; auto (default): "
                             "blocks on CUDA, eager on the CPU. transformers runs eager")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.precision == "bf16" and not (device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())):
        raise SystemExit(f"--precision bf16 needs CUDA or a CPU with AVX512-BF16 or AMX (training runs fp32 on {device} here)")
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    rows = args.batch

    torch.manual_seed(SEED)
    ours = BertForPreTraining(model_config(args.dropout, args.preset)).train()
    hf = hf_twin(ours).train()
    if args.residual == "bf16":
        low_precision_layernorms(ours)  # as train.residual: bf16 does
    batches = make_batches(N_BATCHES, SEED, rows)
    n_pred = [int((b["labels"] != -100).sum()) for b in batches]
    where = f"device {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    print(f"{where}, BERT-{args.preset}, threads {torch.get_num_threads()}, batch {rows} x {SEQ_LEN}, dropout {args.dropout}, "
          f"AdamW {args.adamw}, precision {args.precision} (residual {args.residual}), masked positions per batch {n_pred}")

    check = {k: v[:CHECK_ROWS] for k, v in batches[0].items()}  # on the CPU: a few rows say it
    loss_ours, loss_hf, grad_diff = check_same_objective(ours, hf, check)
    print(f"same objective: loss ours {loss_ours:.6f} transformers {loss_hf:.6f}; "
          f"word-embedding gradient max diff {grad_diff:.2e}")
    if abs(loss_ours - loss_hf) > 1e-4 or grad_diff > 1e-5:
        raise SystemExit("the two models disagree: the comparison would be meaningless")

    cfg = ours.cfg
    flops_ours = [train_flops_per_step("bert", cfg, rows, SEQ_LEN, n) for n in n_pred]
    flops_hf = train_flops_per_step("bert", cfg, rows, SEQ_LEN, rows * SEQ_LEN)  # logits everywhere
    seen = counted_flops(ours, check)
    expected = train_flops_per_step("bert", cfg, len(check["input_ids"]), SEQ_LEN, int((check["labels"] != -100).sum()))
    print(f"model FLOPs per step, ours: {flops_ours[0] / 1e9:.2f} G; on the {len(check['input_ids'])} rows checked "
          f"{expected / 1e9:.2f} G (FlopCounterMode: {seen / 1e9:.2f} G)")
    if abs(seen - expected) > 1e-6 * seen:
        raise SystemExit("ctxmodels.flops and FlopCounterMode disagree on our model's FLOPs")

    # Checked on the CPU in fp32 above; from here on both run where and how they are timed.
    ours.to(device), hf.to(device)
    options = {} if args.compile_mode is None else {"mode": args.compile_mode}
    stepped = ours  # what ours' step calls
    if args.compile == "blocks" or (args.compile == "auto" and device.type == "cuda"):
        print(f"ours: {compile_blocks(ours, **options)} blocks under torch.compile {options or ''} "
              "(compiled during the warm-up steps)")
    elif args.compile == "whole":
        stepped = torch.compile(ours, **options)
        print(f"ours: the whole model under torch.compile {options or ''} (compiled during the warm-up steps; "
              f"masked positions padded to a multiple of {POSITIONS_MULTIPLE} by to_device)")
    # Ours gets its batches as ctx pretrain moves them (jobs.training.loop.to_device: pinned, asynchronous,
    # an all-ones mask found on the host and left out, the masked positions found on the host); transformers gets the mask, as users pass it.
    batches_ours = [model_inputs(to_device(b, device, label_positions=True)) for b in batches]
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
    autocast = contextlib.nullcontext
    if args.precision == "bf16":
        autocast = functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    fused = args.adamw == "fused"
    sides = {"ours": make_step(stepped, fused, autocast, ours=True), "transformers": make_step(hf, fused, autocast)}
    inputs = {"ours": batches_ours, "transformers": batches}
    for name, step in sides.items():
        start = time.perf_counter()
        for i in range(WARMUP_STEPS):
            step(inputs[name][i % N_BATCHES])
        print(f"warm-up, {name}: {time.perf_counter() - start:.1f} s for {WARMUP_STEPS} steps")

    tokens_per_round = N_BATCHES * rows * SEQ_LEN
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    peaks: list[float] = []
    for r in range(args.rounds):
        # step by step, ours and theirs in turn (ABBA), so that both see the same machine load
        spent = dict.fromkeys(sides, 0.0)
        for i in range(N_BATCHES):
            order = list(sides) if (r + i) % 2 == 0 else list(sides)[::-1]
            for name in order:
                spent[name] += timed(sides[name], inputs[name][i], device)
        for name in sides:
            seconds[name].append(spent[name])
        if device.type == "cpu":  # the CPU is shared: its peak is measured under the same load
            peaks.append(measure_matmul_peak("cpu", dtype, n=2048, seconds=1.0))
        else:
            peaks.append(device_peak_flops(device, dtype))
        print(f"round {r + 1}/{args.rounds}: "
              + ", ".join(f"{name} {tokens_per_round / seconds[name][-1]:,.0f} tokens/s" for name in sides)
              + f", peak {peaks[-1] / 1e9:.1f} GFLOP/s")

    # Both trained from the same weights on the same batches with the same optimizer: their losses
    # on the next batch should agree up to dropout's draws. A compiled step that trained wrong shows here.
    steps_done = WARMUP_STEPS + args.rounds * N_BATCHES
    trained = {name: float(sides[name](inputs[name][0])) for name in sides}
    print(f"loss after {steps_done} steps: ours {trained['ours']:.4f}, transformers {trained['transformers']:.4f}")
    if abs(trained["ours"] - trained["transformers"]) > 0.05 * trained["transformers"]:
        print("warning: the two trained apart (losses over 5% apart): check ours' step before reading its speed")
    med = {name: statistics.median(s) for name, s in seconds.items()}
    tps = {name: tokens_per_round / med[name] for name in sides}
    round_ratios = [theirs / ours for ours, theirs in zip(seconds["ours"], seconds["transformers"])]
    peak = max(peaks)
    achieved = sum(flops_ours) / med["ours"]
    achieved_hf = N_BATCHES * flops_hf / med["transformers"]
    print(f"ours:         {tps['ours']:,.0f} tokens/s, {med['ours'] / N_BATCHES * 1e3:.1f} ms/step, "
          f"{achieved / 1e9:.1f} GFLOP/s (medians over {args.rounds} rounds)")
    print(f"transformers: {tps['transformers']:,.0f} tokens/s, {med['transformers'] / N_BATCHES * 1e3:.1f} ms/step; "
          f"its own products, logits at all {rows * SEQ_LEN} positions: {flops_hf / 1e9:.1f} GFLOP/step, "
          f"{achieved_hf / 1e9:.1f} GFLOP/s")
    print(f"per-round speedups: {', '.join(f'{x:.2f}' for x in round_ratios)} "
          f"(median {statistics.median(round_ratios):.2f})")
    if device.type == "cpu":
        print(f"matmul peak:  {peak / 1e9:.1f} GFLOP/s ({args.precision} 2048^3 products, {torch.get_num_threads()} threads, "
              f"best of {len(peaks)} rounds)")
    else:
        print(f"peak:         {peak / 1e12:.1f} TFLOP/s ({args.precision}, the GPU's dense peak)")
    print(f"model FLOPs per step (ours, vocabulary projection at the masked positions only): "
          f"{statistics.mean(flops_ours) / 1e9:.2f} G")
    if device.type == "cuda":
        floor = products_floor(cfg, rows, round(statistics.mean(n_pred)), dtype, device)
        print(f"products floor: {floor * 1e3:.1f} ms/step (this step's matrix products and attention kernels alone, "
              f"{args.precision}); ours takes {med['ours'] / N_BATCHES / floor:.2f}x that; "
              f"mfu_ceiling: {statistics.mean(flops_ours) / floor / peak:.2f}")
    if args.profile and device.type == "cuda":
        for name in sides:
            try:
                busy, wall, table = gpu_busy(sides[name], inputs[name], device)
                syncs = host_syncs(sides[name], inputs[name][0])
            except Exception as e:  # the profiler is a diagnostic: the figures above stand without it
                print(f"gpu_busy {name}: profiler failed: {type(e).__name__}: {e}")
                continue
            print(f"gpu_busy {name}: {busy / wall:.2f} (kernels {busy * 1e3:.1f} ms of a {wall * 1e3:.1f} ms step)")
            print_kernels(name, table)
            print(f"host syncs {name}: {len(syncs) and ', '.join(syncs) or 'none'}")
    print(f"speedup_vs_transformers: {tps['ours'] / tps['transformers']:.2f}")
    print(f"mfu: {achieved / peak:.2f}")


if __name__ == "__main__":
    main()
