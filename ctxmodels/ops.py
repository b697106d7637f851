"""Training kernels: dropout, the embedding gradient and the masked-LM loss, faster on CPU.

These are ops, not model blocks: each computes what its plain PyTorch counterpart does (the same
distribution; the same loss and gradients up to float rounding) with fewer passes over memory.
Profiles of a BERT-mini training step (4 x 256, batch 32 x 128, ``benchmarks/train_throughput.py``)
on this project's 2-core CPU machine showed where the plain versions lose time (one core):

* ``F.dropout`` draws one float per element through ``bernoulli_``: about 7 ns per element, 17M
  elements per step (hidden states and attention probabilities), over 100 ms. ``dropout`` below
  draws 16 bits per element, four elements per 64-bit random word: about 1.3 ns per element.
* ``cross_entropy(F.linear(h, E, b), target)`` at the N = 610 masked rows makes (N, V) logits,
  their log-softmax, the gradients of both and a zero-filled scatter target: five tensors of 74 MB.
  Each is a fresh ``mmap`` (glibc maps blocks over 32 MB) whose pages fault in on first touch,
  about 30 ms per tensor. And MKL runs the logits product ``h @ E^T`` at half the speed of
  ``E @ h^T`` taken in blocks of 2048 vocabulary rows (45 against 73 GFLOP/s; K = D = 256 is short).
  ``masked_lm_loss`` computes the logits transposed, (V, n), for at most 256 rows at a time in one
  reused buffer, turns them into their gradient in place and multiplies that out at once: 0.45 s
  instead of 0.6 s for loss, gradients and accuracy, three products of 9.5 GFLOP included.

* The word embedding's dense gradient (``embedding_dense_backward``): a zeroed (V, D) tensor, the
  batch's rows added into it. At V = 30522, D = 384 it is 47 MB, above glibc's largest mmap
  threshold (32 MB), so every step maps fresh pages and faults them in while zeroing, and
  ``zero_grad(set_to_none=True)`` unmaps them again: 40-48 ms a step of MiniLM fine-tuning
  (``aten::fill_`` in torch.profiler), more than its 6 layers' GELUs, LayerNorms and softmaxes
  together. ``Embedding`` writes that gradient into one buffer kept across steps whenever no
  other tensor holds it any more (the last step's ``.grad`` was set to None).

Reference: Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024, arXiv:2410.10989) likewise
computes the loss's gradients during the forward pass, chunk by chunk, on GPUs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100  # a target that is not predicted (cross_entropy's default ignore_index)
DRAW_BITS = 16  # bits of one dropout draw: p is rounded to a multiple of 2**-16
LOSS_CHUNK_ROWS = 256  # rows of one logits chunk: (V, 256) float32 is 31 MB at V = 30522
VOCAB_BLOCK = 2048  # vocabulary rows per logits product (2 MB of a D = 256 weight)


# ----------------------------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------------------------


def drawable(p: float) -> bool:
    """Whether ``keep_mask`` can draw dropout ``p``: not when p is within 2**-17 of 1, where the
    16-bit draws would keep nothing and the scale divide by zero (``F.dropout`` takes those)."""
    return round(p * 2**DRAW_BITS) < 2**DRAW_BITS


def keep_mask(shape: torch.Size, p: float, dtype: torch.dtype) -> Tensor:
    """Inverted-dropout mask on CPU: ``1 / (1 - q)`` with probability ``1 - q``, else 0, where
    ``q = round(p * 2**16) / 2**16`` (p to within 1.5e-5); E[mask] = 1 exactly.

    One 64-bit word of the global CPU generator gives four 16-bit draws (``torch.manual_seed``
    makes it reproducible, as for ``nn.Dropout``; the stream differs from ``bernoulli_``'s).
    """
    n = shape.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)  # full 64-bit range
    draws = words.view(torch.int16)[:n]  # (n,) uniform on [-2**15, 2**15)
    n_drop = round(p * 2**DRAW_BITS)
    mask = torch.ge(draws, n_drop - 2 ** (DRAW_BITS - 1), out=torch.empty(n, dtype=dtype))  # 1 = keep
    return mask.mul_(2**DRAW_BITS / (2**DRAW_BITS - n_drop)).view(shape)


class _CpuDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        mask = keep_mask(x.shape, p, x.dtype)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (mask,) = ctx.saved_tensors
        return grad * mask, None


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)``; on CPU with 16-bit draws (see ``keep_mask``). On other
    devices ``F.dropout`` itself, whose fused kernels are already fast there."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or not drawable(p):  # off CPU, or p ~ 1
        return F.dropout(x, p, True)
    return _CpuDropout.apply(x, p)


class Dropout(nn.Dropout):
    """``nn.Dropout`` (same constructor, still an instance of it) computed by ``dropout`` above."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)


# ----------------------------------------------------------------------------------------------
# LayerNorm: its output in the autocast dtype, when asked
# ----------------------------------------------------------------------------------------------


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same constructor and state dict, still an instance of it). Under autocast
    it normalises in float32, as autocast's LayerNorm does; when ``low_precision_output`` is set it
    then returns the autocast dtype (bf16) instead of float32.

    In a post-LN Transformer (BERT) the LayerNorm output is the residual stream: under plain
    autocast it is float32, so every block boundary writes (B, T, D) float32, casts it to bf16 for
    the next products and keeps both for the backward. With a bf16 output the stream stays bf16
    between blocks (the statistics are still float32), as in Megatron-LM's bf16 training (its
    ``fp32_residual_connection`` off, the default): half the memory traffic of the element-wise
    work around the products, which is what bounds a large-batch GPU step once they are fast.
    ``low_precision_output`` is set per module (``low_precision_layernorms(model)``, which
    ``train.residual: bf16`` runs); outside autocast it changes nothing.
    """

    low_precision_output = False  # the default of every instance

    def forward(self, x: Tensor) -> Tensor:
        if not (self.low_precision_output and torch.is_autocast_enabled(x.device.type)):
            return super().forward(x)
        low = torch.get_autocast_dtype(x.device.type)
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        y = F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps)  # float32 statistics
        return y.to(low)


def low_precision_layernorms(model: nn.Module, on: bool = True) -> int:
    """Set ``low_precision_output`` on every ``LayerNorm`` of ``model`` (see there); returns how
    many (0 for a family built on ``nn.LayerNorm`` alone, which then keeps float32 outputs)."""
    norms = [m for m in model.modules() if isinstance(m, LayerNorm)]
    for m in norms:
        m.low_precision_output = on
    return len(norms)


# ----------------------------------------------------------------------------------------------
# Embedding: the weight's dense gradient in a buffer kept across steps
# ----------------------------------------------------------------------------------------------


def _storage_uses(t: Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# What _storage_uses reads for a tensor no other tensor shares memory with (the tensor itself and
# the storage object made to ask); None where this PyTorch cannot tell, and Embedding stays plain.
try:
    _LONE_STORAGE_USES: int | None = _storage_uses(torch.empty(1))
except (AttributeError, RuntimeError):  # pragma: no cover - a PyTorch without the private counter
    _LONE_STORAGE_USES = None


class _EmbeddingReusingGrad(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)``; the weight's gradient is ``owner``'s buffer,
    zeroed and the rows added into it, as ``embedding_dense_backward`` computes it."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, padding_idx: int | None, owner: "Embedding") -> Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.owner = padding_idx, owner
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor | None, None, None]:
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        (ids,) = ctx.saved_tensors
        owner = ctx.owner
        buf = owner.grad_buffer(grad.dtype)
        buf.index_add_(0, ids.reshape(-1), grad.reshape(-1, buf.shape[1]))  # (V, D) += (B*T, D) at ids
        if ctx.padding_idx is not None:
            buf[ctx.padding_idx] = 0  # the padding row gets no gradient (nn.Embedding's padding_idx)
        # A fresh tensor object over the buffer's memory: AccumulateGrad takes it as the .grad
        # itself (no copy), since no other tensor object refers to it.
        return None, buf.detach(), None, None


class Embedding(nn.Embedding):
    """``nn.Embedding`` (same constructor, parameters and state dict, still an instance of it)
    whose weight gradient, in CPU training, is written into one buffer reused step after step
    (see the module docstring: a large fresh gradient page-faults every step).

    The buffer is reused only when nothing else holds it: not the ``.grad`` of the last step
    (accumulating micro-batches, ``zero_grad(set_to_none=False)``), not a second use of the table
    in the same graph, not a reference a caller kept. Otherwise a new one is made, exactly as
    ``nn.Embedding`` would. ``sparse``, ``max_norm`` and ``scale_grad_by_freq`` take the plain path.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._grad_buffer: Tensor | None = None

    def forward(self, ids: Tensor) -> Tensor:
        plain = (
            _LONE_STORAGE_USES is None
            or not (torch.is_grad_enabled() and self.weight.requires_grad)
            or self.weight.device.type != "cpu"
            or self.sparse
            or self.max_norm is not None
            or self.scale_grad_by_freq
            or torch.compiler.is_compiling()
        )
        if plain:
            return super().forward(ids)
        return _EmbeddingReusingGrad.apply(ids, self.weight, self.padding_idx, self)

    def grad_buffer(self, dtype: torch.dtype) -> Tensor:
        """A zeroed tensor of the weight's shape: the kept buffer when no other tensor holds its
        memory, else a new one (which is kept from then on)."""
        buf, w = self._grad_buffer, self.weight
        if (
            buf is None
            or buf.shape != w.shape
            or buf.dtype != dtype
            or buf.device != w.device
            or _storage_uses(buf) > _LONE_STORAGE_USES
        ):
            buf = torch.zeros(w.shape, dtype=dtype, device=w.device)
            self._grad_buffer = buf
            return buf
        return buf.zero_()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()  # copies and pickles carry no gradient buffer
        state["_grad_buffer"] = None
        return state


# ----------------------------------------------------------------------------------------------
# Predicted positions: the rows a masked-LM head reads
# ----------------------------------------------------------------------------------------------


def predicted_positions(labels: Tensor, given: Tensor | None = None, ignore_index: int = -100) -> Tensor:
    """(N,) flat indices into ``labels``' B * T positions where a target exists (``!= -100``), in
    row-major order: the rows ``h[labels != -100]`` gathers, as indices.

    ``given``: the same indices found on the host (``jobs.training.loop.to_device``), returned as they are.
    On a GPU, finding them there (a boolean gather, its backward likewise) makes the host wait for
    every kernel queued before it, twice a step; with indices, ``index_select`` and its backward
    need no wait, and N is known on the host.
    """
    if given is not None:
        return given
    return labels.reshape(-1).ne(ignore_index).nonzero().squeeze(1)


def padded_positions(labels: Tensor, multiple: int, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """``predicted_positions(labels)`` padded up to a multiple of ``multiple`` indices (at most
    B * T), with the flat index of the first position that has no target.

    A padding index reads a real row of hidden states and gathers ``ignore_index`` as its target, so
    the heads' losses and accuracies, which skip ignored targets, are those of the unpadded
    positions. What it buys: the number of predicted rows, which the masking draws afresh for every
    batch, takes a handful of values over a run instead of one per batch, so a compiled model keeps
    its graphs and CUDA graphs can replay the step (``jobs.training.loop.to_device`` on a GPU). With 15% of
    32 x 128 tokens masked (605 +- 23 targets) and ``multiple`` 128, nearly every batch has 640 rows.
    """
    if multiple < 1:
        raise ValueError(f"padded_positions: multiple must be >= 1, got {multiple}")
    positions = predicted_positions(labels, None, ignore_index)
    n, total = positions.numel(), labels.numel()
    size = min(-(-n // multiple) * multiple, total)
    if size == n:
        return positions
    free = labels.reshape(-1).eq(ignore_index).nonzero()[0]  # (1,): one exists, since n < size <= B * T
    return torch.cat([positions, free.expand(size - n)])


def prediction_count(target: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """How many of the gathered ``target`` ids are real (not ``ignore_index``, the padding of
    ``padded_positions``), as a 0-d long tensor on their device: no wait for the host."""
    return target.ne(ignore_index).sum()


# ----------------------------------------------------------------------------------------------
# Masked-LM loss: decoder product + cross-entropy, fused
# ----------------------------------------------------------------------------------------------


class _MaskedLMLoss(torch.autograd.Function):
    """Mean cross-entropy of ``h @ weight^T + bias`` against ``target`` over the rows whose target
    is not -100 (``padded_positions``' padding), and the count of those rows whose target logit is
    the largest; float32. The gradients are computed chunk by chunk during the forward pass (the
    loss is a scalar: backward only scales them by its incoming gradient). Each row carries a
    weight, 1 / (real rows) or 0, kept on the device: no count is read back to the host."""

    @staticmethod
    def forward(
        ctx, h: Tensor, weight: Tensor, bias: Tensor, target: Tensor, chunk_rows: int, want_grads: bool
    ) -> tuple[Tensor, Tensor]:
        n_rows, vocab = h.shape[0], weight.shape[0]
        # needs_input_grad says True under no_grad too: want_grads is whether autograd will ask
        need_h, need_w, need_b = (want_grads and need for need in ctx.needs_input_grad[:3])
        grad_h = h.new_empty(h.shape) if need_h else None  # (N, D), contiguous for the out= slices
        grad_w = torch.zeros_like(weight) if need_w and n_rows == 0 else None  # (V, D), else set by chunk 1
        grad_b = torch.zeros_like(bias) if need_b and n_rows == 0 else None  # (V,)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.zeros((), dtype=torch.long, device=h.device)
        real = target.ne(IGNORE_INDEX)  # (N,)
        weight_of_row = real.float() / real.sum().clamp(min=1)  # (N,): 1 / n_real, 0 for padding
        target = target.clamp(min=0)  # padding reads any logit; its weight is 0
        n_chunks = max(-(-n_rows // chunk_rows), 1)  # equal chunks: 614 rows -> 204, 205, 205
        bounds = [i * n_rows // n_chunks for i in range(n_chunks + 1)]
        # one buffer for every chunk's logits: a fresh tensor per chunk would page-fault each time
        buffer = h.new_empty(vocab * (bounds[-1] - bounds[-2]))
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            if lo == hi:  # no rows at all
                continue
            hc, tc, wc = h[lo:hi], target[lo:hi], weight_of_row[lo:hi]  # (n, D), (n,), (n,)
            cols = torch.arange(hi - lo, device=h.device)
            # logits transposed, (V, n), the fast operand order here; in blocks of vocabulary rows,
            # each read from memory once (one (V, D) x (D, n) call reads the weight several times)
            z = buffer[: vocab * (hi - lo)].view(vocab, hi - lo)
            for v in range(0, vocab, VOCAB_BLOCK):
                rows = slice(v, v + VOCAB_BLOCK)
                torch.addmm(bias[rows, None], weight[rows], hc.t(), out=z[rows])  # (block, n)
            top = z.amax(dim=0)  # (n,); max(dim=0) with indices is 5x slower
            z_target = z[tc, cols]  # (n,)
            correct += ((z_target == top) & real[lo:hi]).sum()  # the target's logit is the largest (a tie counts)
            z.sub_(top).exp_()  # exp(z - max), in place
            sum_exp = z.sum(dim=0)  # (n,)
            loss += ((sum_exp.log() + top - z_target) * wc).sum()
            if not (need_h or need_w or need_b):
                continue
            # d loss / d z = (softmax(z) - onehot(target)) / n_real (0 for padding), in place of z
            z.mul_(wc / sum_exp)
            z[tc, cols] -= wc
            if need_h:
                torch.mm(z.t(), weight, out=grad_h[lo:hi])  # (n, V) @ (V, D)
            if need_w:  # (V, n) @ (n, D); the out= form, not addmm_, so FlopCounterMode sees it
                grad_w = torch.mm(z, hc) if lo == 0 else torch.addmm(grad_w, z, hc, out=grad_w)
            if need_b:
                grad_b = z.sum(dim=1) if lo == 0 else grad_b.add_(z.sum(dim=1))  # (V,)
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_correct: Tensor | None):
        if ctx.grads is None:
            raise RuntimeError("masked_lm_loss: backward ran twice through one graph (retain_graph is not supported)")
        grads, ctx.grads = ctx.grads, None  # free them with the graph; scale in place
        out = tuple(g.mul_(grad_loss) if g is not None else None for g in grads)
        return (*out, None, None, None)


def _plain_masked_lm_loss(h: Tensor, weight: Tensor, bias: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    logits = F.linear(h, weight, bias)  # (N, V)
    if target.numel() == 0:
        return logits.sum() * 0.0, torch.zeros((), dtype=torch.long, device=h.device)
    loss = F.cross_entropy(logits.float(), target, reduction="sum") / prediction_count(target).clamp(min=1)
    return loss, (logits.argmax(-1) == target).sum()


def masked_lm_loss(h: Tensor, weight: Tensor, bias: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """``F.cross_entropy(F.linear(h, weight, bias), target)`` and the number of rows whose target
    has the largest logit (``(logits.argmax(-1) == target).sum()`` but for exact ties).

    h (N, D) hidden states of the predicted rows, weight (V, D) the decoder (BERT: the tied word
    embeddings), bias (V,), target (N,) ids, -100 for a row that only pads (``padded_positions``):
    such rows count neither in the mean nor in the accuracy. With N = 0 the loss is 0 with zero
    gradients (the graph stays connected, as DDP wants).

    The fused version runs on the CPU, eager, in float32, where it was measured to pay (page
    faults and MKL's operand order, above). Elsewhere the plain one runs: under autocast or for
    other dtypes (the fused one would need casting rules of its own); on a GPU, where
    ``cross_entropy``'s kernels are fast already; and inside ``torch.compile``, which fuses the
    plain one itself. (A whole BERT compiled as CUDA graphs on an H200 trained wrong through the
    fused one in float32: step 1 equal, then the updates fell short of eager's; ALBERT, on the
    plain loss, trained like eager in the same test.)
    """
    plain = (
        h.device.type != "cpu"
        or torch.compiler.is_compiling()
        or torch.is_autocast_enabled(h.device.type)
        or any(t.dtype != torch.float32 for t in (h, weight, bias))
    )
    if plain:
        return _plain_masked_lm_loss(h, weight, bias, target)
    want_grads = torch.is_grad_enabled() and any(t.requires_grad for t in (h, weight, bias))
    return _MaskedLMLoss.apply(h, weight, bias, target, LOSS_CHUNK_ROWS, want_grads)
