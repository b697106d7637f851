"""Model FLOPs of one training step, and the peak FLOP/s to divide them by (MFU).

MFU, model FLOPs utilisation (Chowdhery et al. 2022, "PaLM", Appendix B), is the FLOPs the model
needs per step times steps per second, over the hardware's peak. The count here comes from the
config alone, family by family, following each family file's ``forward``:

- only matrix products count, ``2 * m * n * k`` each; embedding lookups, softmax, LayerNorm,
  activations, dropout and the loss are free (they are a few percent and memory-bound anyway);
- attention counts its score product ``Q K^T`` and its context product ``P V`` in full, also for
  causal attention (as PaLM and ``torch.utils.flop_counter`` do);
- backward is twice the forward for a product whose two operands both need a gradient (one
  product for each gradient), once the forward when one operand is a constant: the sinusoids of
  Transformer-XL / XLNet, XLNet's ``target_mapping``, an LSTM's initial state. So "3x forward"
  with those exceptions, and none at all for XLNet's last content-stream layer, which the loss
  does not read. So the count equals what autograd actually runs (checked product for product
  against ``FlopCounterMode`` in tests/ctxmodels/test_flops.py);
- no activation recomputation: the models do not checkpoint activations.

Where the counts depend on the data rather than the config, ``n_predicted`` says how many tokens
reach the vocabulary projection (BERT's masked positions, XLNet's B * P prediction slots, ...),
and ``memory_len`` how long the memory of Transformer-XL / XLNet is (by default full, ``mem_len``:
the steady state after the first steps of a stream).

Shape legend:
    B  batch size          T  sequence length         N  tokens through the output layer
    D  d_model             F  d_ff                    V  vocab_size
    H  n_head              Dh head size               L  n_layer
    M  memory length       K  key length = M + T      R  relative distances
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

# Defaults for the data-dependent counts, from the pipelines' defaults.
MLM_FRACTION = 0.15  # pipelines.masking.MlmConfig.mlm_probability (also SpanBERT's and ALBERT's budget)
PLM_PARTIAL_K = 6  # pipelines.permutation.PlmConfig.partial_k: XLNet predicts ceil(T / K) per row


def mm(m: float, n: float, k: float) -> float:
    """FLOPs of an (m, k) @ (k, n) product: one multiply and one add per term."""
    return 2.0 * m * n * k


@dataclass
class StepFlops:
    """Forward and backward FLOPs of one step, summed product by product."""

    forward: float = 0.0
    backward: float = 0.0

    def add(self, flops: float, grads: int = 2) -> None:
        """One product of ``flops`` forward FLOPs; ``grads`` of its operands need a gradient (0, 1
        or 2; 0 for a product whose result the loss does not depend on)."""
        self.forward += flops
        self.backward += grads * flops

    @property
    def total(self) -> float:
        return self.forward + self.backward


# ----------------------------------------------------------------------------------------------
# Families. Each adds its products to ``c`` in the order its forward runs them.
# ----------------------------------------------------------------------------------------------


def _bert(
    c: StepFlops, cfg: Any, B: int, T: int, N: int, memory_len: int | None,
    real_tokens: int | None = None, attention_pairs: int | None = None,
) -> None:
    """ctxmodels/bert.py: post-LN encoder, MLM head on the N masked rows, NSP and SBO heads.

    ``real_tokens``: the batch's non-padding tokens when it is padded; on CPU the token-wise
    products run on those alone, and attention on length groups (``bert.Packing``), which
    compute ``attention_pairs`` query-key pairs (``Packing.attention_pairs``) instead of B * T^2."""
    D, F, BT = cfg.d_model, cfg.d_ff, B * T
    R = BT if real_tokens is None else real_tokens
    P = B * T * T if attention_pairs is None else attention_pairs
    for _ in range(cfg.n_layer):
        c.add(mm(R, 3 * D, D))  # fused QKV
        c.add(mm(P, 1, D))  # scores Q K^T, all heads: a D-long product per query-key pair
        c.add(mm(P, D, 1))  # context P V: a D-wide sum over the pairs
        c.add(mm(R, D, D))  # output projection
        c.add(mm(R, F, D))  # feed-forward in
        c.add(mm(R, D, F))  # feed-forward out
    if cfg.mlm_transform:  # XLM decodes the last hidden state as it is
        c.add(mm(N, D, D))  # MLM transform
    c.add(mm(N, cfg.vocab_size, D))  # decoder tied to the word embeddings
    if cfg.sbo:
        c.add(mm(N, D, 3 * D))  # SBO fc1 over [left; right; position]
        c.add(mm(N, D, D))  # SBO fc2
        c.add(mm(N, cfg.vocab_size, D))  # SBO decoder
    if cfg.nsp:
        c.add(mm(B, D, D))  # pooler on [CLS]
        c.add(mm(B, 2, D))  # NSP classifier


def _albert(c: StepFlops, cfg: Any, B: int, T: int, N: int, memory_len: int | None) -> None:
    """ctxmodels/albert.py: E -> C projection; shared layers still run n_layer times."""
    C, E, F, BT = cfg.d_model, cfg.embedding_size, cfg.d_ff, B * T
    c.add(mm(BT, C, E))  # factorized embedding projection
    for _ in range(cfg.n_layer):
        c.add(3 * mm(BT, C, C))  # query, key, value
        c.add(mm(BT, T, C))  # scores
        c.add(mm(BT, C, T))  # context
        c.add(mm(BT, C, C))  # attention output dense
        c.add(mm(BT, F, C))  # ffn
        c.add(mm(BT, C, F))  # ffn output
    c.add(mm(N, E, C))  # MLM transform C -> E
    c.add(mm(N, cfg.vocab_size, E))  # decoder tied to the E-wide word embeddings
    if cfg.sop:
        c.add(mm(B, C, C))  # pooler
        c.add(mm(B, 2, C))  # SOP classifier


def _gpt(c: StepFlops, cfg: Any, B: int, T: int, N: int, memory_len: int | None) -> None:
    """ctxmodels/gpt.py: causal decoder; logits at every position but the last."""
    D, F, BT = cfg.d_model, cfg.d_ff, B * T
    for _ in range(cfg.n_layer):
        c.add(mm(BT, 3 * D, D))  # fused QKV
        c.add(mm(BT, T, D))  # scores (full T x T: the causal half is computed too)
        c.add(mm(BT, D, T))  # context
        c.add(mm(BT, D, D))  # output projection
        c.add(mm(BT, F, D))  # MLP
        c.add(mm(BT, D, F))
    c.add(mm(N, cfg.vocab_size, D))  # softmax tied to the token embeddings


def _relative_attention(c: StepFlops, B: int, T: int, K: int, R: int, HDh: int, grads: int = 2) -> None:
    """Transformer-XL's scores over K keys for T queries: (a)+(c) against the keys, (b)+(d)
    against the R distances (then shifted, free), and the context product."""
    c.add(mm(B * T, K, HDh), grads)  # content terms (q + u) . k
    c.add(mm(B * T, R, HDh), grads)  # position terms (q + v) . W_R R
    c.add(mm(B * T, HDh, K), grads)  # context P V


def _transformer_xl(c: StepFlops, cfg: Any, B: int, T: int, N: int, memory_len: int | None) -> None:
    """ctxmodels/transformer_xl.py: relative attention over [memory; segment], tied softmax."""
    D, F, HDh = cfg.d_model, cfg.d_ff, cfg.n_head * cfg.head_dim
    M = cfg.mem_len if memory_len is None else memory_len
    K = M + T  # keys; causal distances K - 1 .. 0, so R = K
    for _ in range(cfg.n_layer):
        c.add(mm(B * T, HDh, D))  # W_q on the segment
        c.add(2 * mm(B * K, HDh, D))  # W_k, W_v on [memory; segment] (the concatenation needs grad)
        c.add(mm(K, HDh, D), grads=1)  # W_R on the sinusoids: a constant, only the weight's gradient
        _relative_attention(c, B, T, K, K, HDh)
        c.add(mm(B * T, D, HDh))  # output projection
        c.add(mm(B * T, F, D))  # feed-forward
        c.add(mm(B * T, D, F))
    c.add(mm(N, cfg.vocab_size, D))  # softmax tied to the input embedding


def _xlnet(c: StepFlops, cfg: Any, B: int, T: int, N: int, memory_len: int | None) -> None:
    """ctxmodels/xlnet.py: two-stream attention; the query stream runs its attention at all T
    positions (targets scattered there by target_mapping), its projections and FFN on the N = B * P
    prediction slots only."""
    D, F, HDh = cfg.d_model, cfg.d_ff, cfg.n_head * cfg.head_dim
    M = cfg.mem_len if memory_len is None else memory_len
    K = M + T
    R = K + T - 1  # bidirectional distances K - 1 .. -(T - 1)
    for layer in range(cfg.n_layer):
        # The last layer's content stream feeds nothing the loss reads (the memory caches layer
        # inputs; predictions come from the query stream): autograd runs no backward for it.
        h_grads = 0 if layer == cfg.n_layer - 1 else 2
        # shared by both streams: keys, values, positions
        c.add(2 * mm(B * K, HDh, D))  # W_k, W_v
        c.add(mm(R, HDh, D), grads=1)  # W_R on the sinusoids
        # content stream
        c.add(mm(B * T, HDh, D), h_grads)  # W_q
        _relative_attention(c, B, T, K, R, HDh, h_grads)
        c.add(mm(B * T, 2, HDh), h_grads)  # relative segment term (q + b) . [s_same, s_diff]
        c.add(mm(B * T, D, HDh), h_grads)  # output projection
        c.add(mm(B * T, F, D), h_grads)
        c.add(mm(B * T, D, F), h_grads)
        # query stream
        c.add(mm(N, HDh, D))  # W_q on g
        c.add(mm(N, T, HDh), grads=1)  # scatter the P queries to their positions (target_mapping)
        _relative_attention(c, B, T, K, R, HDh)
        c.add(mm(B * T, 2, HDh))  # segment term
        c.add(mm(N, T, HDh), grads=1)  # gather the P results back
        c.add(mm(N, D, HDh))  # output projection
        c.add(mm(N, F, D))
        c.add(mm(N, D, F))
    c.add(mm(N, cfg.vocab_size, D))  # softmax tied to the word embedding


def _elmo(c: StepFlops, cfg: Any, B: int, T: int, N: int, memory_len: int | None) -> None:
    """ctxmodels/elmo.py: char CNN, highway, projection, two LSTMP stacks, a softmax per direction.
    ``N`` counts the predictions of one direction; both directions make as many."""
    BT, D, Hc = B * T, cfg.d_model, cfg.lstm_dim
    n_filters = sum(n for _, n in cfg.filters)
    for width, n in cfg.filters:  # Conv1d over the chars of each token, no padding
        c.add(mm(BT * (cfg.max_chars - width + 1), n, cfg.char_embed_dim * width))
    for _ in range(cfg.n_highway):
        c.add(mm(BT, 2 * n_filters, n_filters))  # [transform; gate] in one product
    c.add(mm(BT, D, n_filters))  # projection to d_model
    for _ in range(2 * cfg.n_layer):  # forward and backward LM, n_layer LSTMs each
        c.add(mm(BT, 4 * Hc, D))  # input to gates
        c.add(mm(B * (T - 1), 4 * Hc, D))  # recurrent h_{t-1} to gates
        c.add(mm(B, 4 * Hc, D), grads=1)  # the first step's h_0 is a constant (zeros or carried state)
        c.add(mm(BT, D, Hc))  # cell to projection
    c.add(2 * mm(N, cfg.vocab_size, D))  # forward and backward softmax


def _awd_lstm(c: StepFlops, cfg: Any, B: int, T: int, N: int, memory_len: int | None) -> None:
    """ctxmodels/awd_lstm.py: an LSTM stack D -> H -> ... -> D, a softmax tied to the embedding.

    Variable-length BPTT detaches the state at each window's start, whose recurrent product then
    has a constant operand; the windows are drawn per batch, so the count takes ``ceil(T / bptt)``
    of them (exact with ``bptt`` 0 or >= T: one window)."""
    windows = min(T, math.ceil(T / cfg.bptt)) if cfg.bptt else 1
    for d_in, d_out in cfg.widths():
        c.add(mm(B * T, 4 * d_out, d_in))  # input to gates
        c.add(mm(B * (T - windows), 4 * d_out, d_out))  # recurrent h_{t-1} to gates
        c.add(windows * mm(B, 4 * d_out, d_out), grads=1)  # a window's first step: its h_0 is a constant
    c.add(mm(N, cfg.vocab_size, cfg.d_model))  # softmax tied to the embedding


# family -> (counter, default n_predicted(B, T)); the registry's names
FAMILY_FLOPS: dict[str, tuple[Callable[..., None], Callable[[int, int], int]]] = {
    "bert": (_bert, lambda B, T: round(MLM_FRACTION * B * T)),
    "roberta": (_bert, lambda B, T: round(MLM_FRACTION * B * T)),
    "spanbert": (_bert, lambda B, T: round(MLM_FRACTION * B * T)),
    "albert": (_albert, lambda B, T: round(MLM_FRACTION * B * T)),
    "xlm": (_bert, lambda B, T: round(MLM_FRACTION * B * T)),
    "gpt": (_gpt, lambda B, T: B * (T - 1)),
    "transformer-xl": (_transformer_xl, lambda B, T: B * (T - 1)),
    "xlnet": (_xlnet, lambda B, T: B * math.ceil(T / PLM_PARTIAL_K)),
    "elmo": (_elmo, lambda B, T: B * (T - 1)),
    "awd-lstm": (_awd_lstm, lambda B, T: B * (T - 1)),
}


def step_flops(
    family: str, cfg: Any, batch_size: int, seq_len: int, n_predicted: int | None = None, memory_len: int | None = None,
    real_tokens: int | None = None, attention_pairs: int | None = None,
) -> StepFlops:
    """Forward and backward FLOPs of one training step; see ``train_flops_per_step``."""
    if family not in FAMILY_FLOPS:
        raise ValueError(f"no FLOP count for model family {family!r}; known families: {sorted(FAMILY_FLOPS)}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    count, default_n = FAMILY_FLOPS[family]
    n = default_n(batch_size, seq_len) if n_predicted is None else n_predicted
    if n < 0:
        raise ValueError(f"n_predicted must be >= 0, got {n_predicted}")
    c = StepFlops()
    if real_tokens is None and attention_pairs is None:
        count(c, cfg, batch_size, seq_len, n, memory_len)
    elif count is _bert:
        count(c, cfg, batch_size, seq_len, n, memory_len, real_tokens=real_tokens, attention_pairs=attention_pairs)
    else:
        raise ValueError(
            f"real_tokens / attention_pairs: family {family!r} runs every position of a padded batch; count it without them"
        )
    return c


def train_flops_per_step(
    family: str,
    cfg: Any,
    batch_size: int,
    seq_len: int,
    n_predicted: int | None = None,
    memory_len: int | None = None,
    real_tokens: int | None = None,
    attention_pairs: int | None = None,
) -> float:
    """Model FLOPs of one forward + backward pass over a (batch_size, seq_len) batch.

    ``n_predicted``: rows that reach the vocabulary projection in the whole batch. Defaults:
    15% of the tokens for bert/roberta/spanbert/albert (their heads run only at masked
    positions), ``B * (T - 1)`` for gpt/transformer-xl and per direction for elmo (every position
    but the one with no next token), ``B * ceil(T / 6)`` prediction slots for xlnet (its P).
    ``memory_len``: Transformer-XL / XLNet memory length; None means ``cfg.mem_len``.
    ``real_tokens``: non-padding tokens of a padded batch, for the BERT families, whose token-wise
    layers skip padding on CPU; None counts every position. ``attention_pairs``: the query-key
    pairs their attention computes then, on length groups (``bert.Packing.attention_pairs``);
    None counts ``B * T^2``.
    The optimizer step is not included (it is elementwise).
    """
    return step_flops(family, cfg, batch_size, seq_len, n_predicted, memory_len, real_tokens, attention_pairs).total


# ----------------------------------------------------------------------------------------------
# Peak FLOP/s
# ----------------------------------------------------------------------------------------------


def measure_matmul_peak(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, n: int = 2048,
                        seconds: float = 1.0) -> float:
    """FLOP/s of repeated (n, n) @ (n, n) products on ``device``: the best of several timed runs
    within about ``seconds``. A practical peak where no datasheet applies (CPUs, unknown GPUs)."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(reps: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        sync()
        return time.perf_counter() - start

    timed(1)  # warm-up: kernel selection, first-touch allocation
    one = max(timed(1), 1e-6)
    reps = max(1, int(seconds / 5 / one))  # about five runs fit in the budget
    best, runs, deadline = 0.0, 0, time.perf_counter() + seconds
    while runs < 3 or time.perf_counter() < deadline:
        best = max(best, mm(n, n, n) * reps / max(timed(reps), 1e-9))
        runs += 1
    return best


# Dense (no structured sparsity) tensor-core peaks in TFLOP/s from NVIDIA's datasheets, and the
# plain FP32 (CUDA core) peak. Matched in order against torch.cuda.get_device_name(): the first
# pattern found wins, so variants come before the plain name.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"H200.*NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H200", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),  # H200 SXM
    (r"H100.*NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100.*PCIE", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (r"H100", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),  # SXM5 ("H100 80GB HBM3")
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),  # SXM4 and PCIe alike
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    # NVIDIA publishes no A10G datasheet (it is AWS's part); these are the A10's, the same GA102.
    (r"\bA10G?\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    # Volta has no BF16 and no TF32: FP32 matmuls run at the FP32 rate.
    (r"V100S", {"fp16": 130.0, "tf32": 16.4, "fp32": 16.4}),
    (r"V100.*PCIE", {"fp16": 112.0, "tf32": 14.0, "fp32": 14.0}),
    (r"V100", {"fp16": 125.0, "tf32": 15.7, "fp32": 15.7}),  # SXM2
]

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _precision_key(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        if dtype not in ("bf16", "fp16", "tf32", "fp32"):
            raise ValueError(f"precision {dtype!r}: expected a torch dtype or one of 'bf16', 'fp16', 'tf32', 'fp32'")
        return dtype
    if dtype not in _DTYPE_KEYS:
        raise ValueError(f"no peak FLOP/s for dtype {dtype}; expected torch.bfloat16, torch.float16 or torch.float32")
    key = _DTYPE_KEYS[dtype]
    # FP32 matmuls run on TF32 tensor cores when PyTorch is allowed to ("high" or "medium").
    if key == "fp32" and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return key


def known_peak_flops(device_name: str, dtype: torch.dtype | str) -> float | None:
    """Datasheet dense peak FLOP/s of an NVIDIA GPU (A100, H100 SXM/PCIe/NVL, H200, L4, A10/A10G,
    V100) for ``dtype``, or None for an unknown device or a precision it lacks.

    ``dtype`` is a torch dtype or 'bf16' / 'fp16' / 'tf32' / 'fp32'; torch.float32 means TF32
    when ``torch.get_float32_matmul_precision()`` allows it, else FP32.
    """
    key = _precision_key(dtype)
    name = device_name.upper()
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, name):
            return peaks[key] * 1e12 if key in peaks else None
    return None


def device_peak_flops(device: str | torch.device, dtype: torch.dtype = torch.float32, measure_seconds: float = 1.0) -> float:
    """Peak FLOP/s to compute MFU against: the datasheet's for a known GPU, else measured."""
    device = torch.device(device)
    if device.type == "cuda":
        known = known_peak_flops(torch.cuda.get_device_name(device), dtype)
        if known is not None:
            return known
    return measure_matmul_peak(device, dtype, seconds=measure_seconds)
