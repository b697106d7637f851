"""Transformer-XL: a causal language model with segment-level recurrence and relative positions.

Paper: Dai, Yang, Yang, Carbonell, Le, Salakhutdinov. "Transformer-XL: Attentive Language Models
Beyond a Fixed-Length Context", ACL 2019 (arXiv:1901.02860), Sections 3.2-3.3 and Appendix B.

Reference read while writing: the authors' code, kimiyoung/transformer-xl
(``pytorch/mem_transformer.py``: ``RelPartialLearnableMultiHeadAttn``, ``_rel_shift``,
``_update_mems``; ``tf/scripts/wt103_base_gpu.sh`` for the base sizes). transformers 5 no longer
ships Transformer-XL, so there is no parity test; tests/ctxmodels/test_transformer_xl.py checks
the model independently: shifted scores against the paper's formula evaluated with loops,
recurrence against one pass over the concatenated segments, causality, stop-gradient, resets.

What differs from the paper's WikiText-103 setup, on purpose:
- a plain softmax tied to the input embedding (plus an output bias) replaces the adaptive
  input/softmax; with the base sizes and the WT103 vocabulary this happens to give ~151M
  parameters too, because WT103 base uses ``div_val=1`` (all clusters at full width);
- ``u`` and ``v`` (the global content and position biases) are separate per layer, as in the
  authors' scripts (``--untie_r=True``) and in XLNet;
- the evaluation-only ``same_length`` trick is not implemented; ``clamp_len`` is.

Incremental decoding (``TransfoXLForPreTraining.decode_step``, what serving's generation runs): the
same recurrence, with a memory that keeps every position read so far (no ``mem_len`` cut), so each
step feeds only the new token and attends to the stored layer inputs of the ones before it. Causal
attention makes those states independent of later tokens, so the step's scores equal the last
position's of one pass over the whole sequence without memory.

Memory contract with the data pipeline: batches are stream-ordered (row r of batch b+1 continues
row r of batch b) and carry ``reset_memory`` (1 where a row starts a new stream). The pretraining
model keeps, per layer, the last ``mem_len`` hidden states of every row as detached state between
calls, drops (zeroes and masks out) the memory of reset rows, and lets evaluation change
``mem_len``.

XLNet (ctxmodels/xlnet.py) builds on this file: it imports the sinusoid, the relative shift, the
relative score terms (a)-(d), the feed-forward block and the memory helpers, which are the same.

Shape legend:
    B  batch size                 T  current segment length (queries)
    M  memory length              K  key length = M + T
    R  number of relative distances (K for causal attention)
    D  d_model                    H  n_head          Dh  d_head
    F  d_ff                       V  vocab_size      L  n_layer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ctxmodels.ops import Dropout, Embedding
from ctxmodels.outputs import PretrainOutput

LayerNormPlace = Literal["post", "pre"]
Activation = Literal["relu", "gelu"]
IGNORE_INDEX = -100  # label value of positions that are not predicted (HF convention)


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransfoXLConfig:
    vocab_size: int  # WT103 word vocabulary: 267735
    d_model: int  # hidden size of every block (and of the tied embedding)
    n_layer: int  # number of blocks
    n_head: int  # attention heads
    d_ff: int  # inner size of the feed-forward sub-layer
    max_seq_len: int  # segment length the pipeline packs (tgt_len); positions are relative, so any
    # length runs, but this is the length training sees
    mem_len: int  # hidden states kept per layer from previous segments during training
    d_head: int | None = None  # per-head size; None means d_model // n_head (WT103 base: 41)
    dropout: float = 0.1  # on embeddings, positions, sub-layer outputs and the final hidden state
    dropatt: float = 0.0  # on attention probabilities (0 in the paper's WT103 runs)
    layer_norm: LayerNormPlace = "post"  # "pre" is the code's pre_lnorm option (no final LayerNorm)
    activation: Activation = "relu"  # feed-forward non-linearity (the paper: ReLU)
    clamp_len: int | None = None  # clamp relative distances above this (eval trick); None = never
    layer_norm_eps: float = 1e-5
    init_std: float = 0.02  # std of the normal init of weights, embeddings and u, v

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TransfoXLConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.mem_len, int) or isinstance(self.mem_len, bool) or self.mem_len < 0:
            raise ValueError(f"TransfoXLConfig.mem_len must be an integer >= 0, got {self.mem_len!r}")
        if self.d_model % 2:
            raise ValueError(f"TransfoXLConfig.d_model must be even (sin/cos halves), got {self.d_model}")
        if self.d_head is None and self.d_model % self.n_head:
            raise ValueError(
                f"TransfoXLConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head}) "
                "when d_head is not given"
            )
        if self.d_head is not None and (not isinstance(self.d_head, int) or self.d_head < 1):
            raise ValueError(f"TransfoXLConfig.d_head must be a positive integer or None, got {self.d_head!r}")
        for name in ("dropout", "dropatt"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"TransfoXLConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.layer_norm not in get_args(LayerNormPlace):
            raise ValueError(
                f"TransfoXLConfig.layer_norm must be one of {get_args(LayerNormPlace)}, got {self.layer_norm!r}"
            )
        if self.activation not in get_args(Activation):
            raise ValueError(
                f"TransfoXLConfig.activation must be one of {get_args(Activation)}, got {self.activation!r}"
            )
        if self.clamp_len is not None and (not isinstance(self.clamp_len, int) or self.clamp_len < 1):
            raise ValueError(f"TransfoXLConfig.clamp_len must be a positive integer or None, got {self.clamp_len!r}")
        for name in ("layer_norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TransfoXLConfig.{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        return self.d_head if self.d_head is not None else self.d_model // self.n_head


# ----------------------------------------------------------------------------------------------
# Relative positions (shared with XLNet)
# ----------------------------------------------------------------------------------------------


def sinusoid_embedding(distances: Tensor, d_model: int) -> Tensor:
    """R_d of the paper: [sin(d * f), cos(d * f)] with f_k = 10000^(-2k / D). (R,) -> (R, D)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d_model, 2, device=distances.device, dtype=torch.float32) / d_model))
    angles = distances.float()[:, None] * inv_freq[None, :]  # (R, D/2)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)  # (R, D)


def rel_shift(x: Tensor, klen: int) -> Tensor:
    """Turn scores against a list of distances into scores against key positions, with no gather.

    ``x[..., i, r]`` scores query i against distance ``K - 1 - r`` (distances listed from K - 1
    downwards). Query i sits at key position M + i, so key j is at distance M + i - j, i.e.
    ``r = T - 1 - i + j``: row i must slide left by T - 1 - i. Padding one zero column (rows of
    R + 1), skipping T elements and re-reading the buffer in rows of R does exactly that, one
    element more per row (the code's ``_rel_shift``).
    Entries with j > M + i (future keys) read a neighbouring row when R == K: callers mask them.
    (..., T, R) -> (..., T, K), R >= K.
    """
    *lead, T, R = x.shape
    x = F.pad(x, (1, 0))  # (..., T, R + 1), zero column first
    x = x.reshape(*lead, R + 1, T)  # (..., R + 1, T): the same buffer read with rows of T
    x = x[..., 1:, :]  # (..., R, T): drop the first T elements (row 0's pad and T - 1 scores)
    x = x.reshape(*lead, T, R)  # (..., T, R): row i now starts at its distance M + i
    return x[..., :klen]  # (..., T, K)


def relative_scores(q: Tensor, k: Tensor, r: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """The paper's A^rel_ij without scaling: (a) q.k + (b) q.W_R R + (c) u.k + (d) v.W_R R.

    q (B, T, H, Dh) queries; k (B, K, H, Dh) keys of [memory; current]; r (R, H, Dh) the
    projected sinusoids W_R R_d for distances K - 1, K - 2, ... (R >= K); u, v (H, Dh).
    Returns (B, H, T, K). Terms (a)+(c) and (b)+(d) are each one product, as in the code.
    """
    content = torch.einsum("bthd,bkhd->bhtk", q + u, k)  # (B, H, T, K): (a) + (c)
    position = torch.einsum("bthd,rhd->bhtr", q + v, r)  # (B, H, T, R): (b) + (d) per distance
    return content + rel_shift(position, k.shape[1])  # (B, H, T, K)


# ----------------------------------------------------------------------------------------------
# Memory (shared with XLNet)
# ----------------------------------------------------------------------------------------------


@dataclass
class Memory:
    """Hidden states of the previous segments of every row, one tensor per layer input."""

    states: list[Tensor]  # L x (B, M, D), detached: the stop-gradient of the paper
    valid: Tensor  # (B, M) bool: False for padding and for rows whose stream was reset

    @property
    def length(self) -> int:
        return self.valid.shape[1]


def reset_memory_rows(memory: Memory, reset_memory: Tensor) -> Memory:
    """Zero and mask out the memory of rows with reset_memory == 1 (a new stream starts there).

    Zeroing alone is not enough: a zero key still scores v.W_R R through the position terms, so
    the rows are also marked invalid and masked out of attention.
    """
    keep = reset_memory.to(memory.valid.device) == 0  # (B,)
    states = [s * keep[:, None, None].to(s.dtype) for s in memory.states]  # (B, M, D) each
    return Memory(states, memory.valid & keep[:, None])


def extend_memory(memory: Memory | None, layer_inputs: list[Tensor], valid: Tensor, mem_len: int) -> Memory | None:
    """Append this segment's layer inputs (L x (B, T, D)) and keep the last mem_len, detached."""
    if mem_len == 0:
        return None
    if memory is not None:
        layer_inputs = [torch.cat([m, h], dim=1) for m, h in zip(memory.states, layer_inputs)]  # (B, M + T, D)
        valid = torch.cat([memory.valid, valid], dim=1)  # (B, M + T)
    return Memory([h[:, -mem_len:].detach() for h in layer_inputs], valid[:, -mem_len:])


class StreamMemory:
    """The memory a pretraining model carries from one ``forward`` to the next.

    A plain attribute, not a registered buffer: it is not part of the weights, its shape changes,
    and DDP's ``broadcast_buffers`` would overwrite every rank's memory with rank 0's.
    """

    def __init__(self, mem_len: int):
        self.memory: Memory | None = None
        self.set_mem_len(mem_len)

    def set_mem_len(self, mem_len: int) -> None:
        if not isinstance(mem_len, int) or isinstance(mem_len, bool) or mem_len < 0:
            raise ValueError(f"mem_len must be an integer >= 0, got {mem_len!r}")
        self.mem_len = mem_len
        if self.memory is not None:  # a shorter memory keeps the most recent states
            m = self.memory
            self.memory = Memory([s[:, -mem_len:] for s in m.states], m.valid[:, -mem_len:]) if mem_len else None

    def reset_all(self) -> None:
        self.memory = None

    def before(self, input_ids: Tensor, reset_memory: Tensor | None) -> Memory | None:
        """The memory to use for this batch: on the batch's device, reset rows dropped."""
        memory = self.memory
        if memory is None:
            return None
        if reset_memory is not None and bool((reset_memory != 0).all()):
            return None  # every row starts a new stream: the batch size may change here
        if memory.valid.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"batch has {input_ids.shape[0]} rows but the recurrent memory has {memory.valid.shape[0]}: "
                "stream-ordered batches must keep their size; pass reset_memory=1 for every row or call "
                "reset_all_memory() before changing it (e.g. before evaluation)"
            )
        device = input_ids.device
        memory = Memory([s.to(device) for s in memory.states], memory.valid.to(device))
        if reset_memory is not None:
            memory = reset_memory_rows(memory, reset_memory)
        return memory

    def after(self, memory: Memory | None, layer_inputs: list[Tensor], valid: Tensor) -> None:
        self.memory = extend_memory(memory, layer_inputs, valid, self.mem_len)


class CarriesStreamMemory:
    """The memory API of a pretraining model that owns a ``StreamMemory`` as ``self.stream``
    (Transformer-XL's and XLNet's): what the training loop and evaluation call."""

    stream: StreamMemory

    @property
    def mem_len(self) -> int:
        return self.stream.mem_len

    def set_mem_len(self, mem_len: int) -> None:
        """Evaluation may use a longer memory than training (Transformer-XL: 150 -> 640 on WT103 base)."""
        self.stream.set_mem_len(mem_len)

    @property
    def memory(self) -> Memory | None:
        return self.stream.memory

    def reset_all_memory(self) -> None:
        """Forget every row's memory: before evaluation, after loading a checkpoint, on a new stream."""
        self.stream.reset_all()


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------


def activation_fn(name: Activation) -> Callable[[Tensor], Tensor]:
    if name == "relu":
        return F.relu
    if name == "gelu":
        return F.gelu  # exact erf form, as XLNet
    raise ValueError(f"unknown activation {name!r}; expected one of {get_args(Activation)}")


class PositionwiseFF(nn.Module):
    """Linear -> activation -> dropout -> Linear -> dropout, residual, LayerNorm after or before."""

    def __init__(self, d_model: int, d_ff: int, dropout: float, activation: Activation,
                 layer_norm: LayerNormPlace, eps: float):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.ln = nn.LayerNorm(d_model, eps=eps)
        self.drop = Dropout(dropout)
        self.act = activation_fn(activation)
        self.pre_ln = layer_norm == "pre"

    def forward(self, x: Tensor) -> Tensor:
        y = self.ln(x) if self.pre_ln else x
        y = self.drop(self.fc2(self.drop(self.act(self.fc1(y)))))
        return x + y if self.pre_ln else self.ln(x + y)


class RelativeAttention(nn.Module):
    """Multi-head attention over [memory; current] with the paper's relative score (Eq. in 3.3)."""

    def __init__(self, cfg: TransfoXLConfig):
        super().__init__()
        H, Dh, D = cfg.n_head, cfg.head_dim, cfg.d_model
        self.n_head, self.d_head = H, Dh
        self.q = nn.Linear(D, H * Dh, bias=False)  # W_q
        self.k = nn.Linear(D, H * Dh, bias=False)  # W_{k,E}
        self.v = nn.Linear(D, H * Dh, bias=False)
        self.r = nn.Linear(D, H * Dh, bias=False)  # W_{k,R}: projects the sinusoids
        self.o = nn.Linear(H * Dh, D, bias=False)
        self.u = nn.Parameter(torch.zeros(H, Dh))  # global content bias, term (c)
        self.v_bias = nn.Parameter(torch.zeros(H, Dh))  # global position bias, term (d)
        self.ln = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.drop = Dropout(cfg.dropout)
        self.dropatt = Dropout(cfg.dropatt)
        self.pre_ln = cfg.layer_norm == "pre"
        self.scale = Dh**-0.5

    def heads(self, h: Tensor, mem: Tensor | None, pos_emb: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Projected q (B, T, H, Dh), k and v (B, K, H, Dh) and r (R, H, Dh)."""
        B, T, _ = h.shape
        cat = h if mem is None else torch.cat([mem, h], dim=1)  # (B, K, D)
        if self.pre_ln:
            cat = self.ln(cat)  # the code normalises memory and current together
        K = cat.shape[1]
        q = self.q(cat[:, -T:]).view(B, T, self.n_head, self.d_head)  # (B, T, H, Dh)
        k = self.k(cat).view(B, K, self.n_head, self.d_head)  # (B, K, H, Dh)
        v = self.v(cat).view(B, K, self.n_head, self.d_head)  # (B, K, H, Dh)
        r = self.r(pos_emb).view(-1, self.n_head, self.d_head)  # (R, H, Dh)
        return q, k, v, r

    def attention_scores(self, h: Tensor, mem: Tensor | None, pos_emb: Tensor) -> Tensor:
        """Unscaled, unmasked A^rel (B, H, T, K); entries with j > M + i are meaningless."""
        q, k, _, r = self.heads(h, mem, pos_emb)
        return relative_scores(q, k, r, self.u, self.v_bias)

    def forward(self, h: Tensor, mem: Tensor | None, pos_emb: Tensor, blocked: Tensor) -> Tensor:
        """h (B, T, D), mem (B, M, D) or None, pos_emb (K, D), blocked (B, T, K) bool -> (B, T, D)."""
        B, T, _ = h.shape
        q, k, v, r = self.heads(h, mem, pos_emb)
        scores = relative_scores(q, k, r, self.u, self.v_bias) * self.scale  # (B, H, T, K)
        scores = scores.masked_fill(blocked[:, None], torch.finfo(scores.dtype).min)
        prob = self.dropatt(scores.softmax(dim=-1))  # (B, H, T, K)
        out = torch.einsum("bhtk,bkhd->bthd", prob, v).reshape(B, T, -1)  # (B, T, H * Dh)
        out = self.drop(self.o(out))  # (B, T, D)
        return h + out if self.pre_ln else self.ln(h + out)


class TransfoXLBlock(nn.Module):
    def __init__(self, cfg: TransfoXLConfig):
        super().__init__()
        self.attn = RelativeAttention(cfg)
        self.ff = PositionwiseFF(cfg.d_model, cfg.d_ff, cfg.dropout, cfg.activation, cfg.layer_norm,
                                 cfg.layer_norm_eps)

    def forward(self, h: Tensor, mem: Tensor | None, pos_emb: Tensor, blocked: Tensor) -> Tensor:
        return self.ff(self.attn(h, mem, pos_emb, blocked))


def init_weights(module: nn.Module, std: float, generator: torch.Generator | None = None) -> None:
    """Normal(0, std) for weight matrices, embeddings and the u, v biases; zeros for biases; LN 1/0."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std, generator=generator)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, RelativeAttention):
            nn.init.normal_(m.u, mean=0.0, std=std, generator=generator)
            nn.init.normal_(m.v_bias, mean=0.0, std=std, generator=generator)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


def causal_blocked(T: int, memory: Memory | None, attention_mask: Tensor | None, device: torch.device) -> Tensor:
    """(B or 1, T, K) bool, True where query i may not attend key j: future keys, padding, reset memory.

    A query always sees itself, so no row is fully blocked (padding rows stay finite).
    """
    M = 0 if memory is None else memory.length
    future = torch.ones(T, M + T, dtype=torch.bool, device=device).triu(M + 1)  # (T, K): j > M + i
    if memory is None and attention_mask is None:
        return future[None]  # (1, T, K)
    B = memory.valid.shape[0] if memory is not None else attention_mask.shape[0]
    mem_ok = memory.valid if memory is not None else torch.ones(B, 0, dtype=torch.bool, device=device)
    cur_ok = attention_mask.bool() if attention_mask is not None else torch.ones(B, T, dtype=torch.bool, device=device)
    key_ok = torch.cat([mem_ok, cur_ok], dim=1)  # (B, K)
    blocked = future[None] | ~key_ok[:, None, :]  # (B, T, K)
    diag = torch.arange(T, device=device)
    blocked[:, diag, M + diag] = False  # a query always sees itself
    return blocked


class TransfoXLModel(nn.Module):
    """Embedding (scaled by sqrt(D), as the code's AdaptiveEmbedding) and L relative-attention blocks."""

    def __init__(self, cfg: TransfoXLConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.word_emb = Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([TransfoXLBlock(cfg) for _ in range(cfg.n_layer)])
        self.drop = Dropout(cfg.dropout)
        self.emb_scale = cfg.d_model**0.5
        init_weights(self, cfg.init_std, generator)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.drop(self.word_emb(input_ids) * self.emb_scale)  # (B, T, D)

    def position_embedding(self, klen: int, like: Tensor) -> Tensor:
        """Sinusoids for distances K - 1 down to 0 (causal attention needs no negative ones). (K, D)."""
        distances = torch.arange(klen - 1, -1, -1, device=like.device)  # (K,)
        if self.cfg.clamp_len is not None:
            distances = distances.clamp(max=self.cfg.clamp_len)
        return self.drop(sinusoid_embedding(distances, self.cfg.d_model).to(like.dtype))  # (K, D)

    def forward(self, input_ids: Tensor, memory: Memory | None = None,
                attention_mask: Tensor | None = None) -> list[Tensor]:
        """L + 1 tensors (B, T, D): the input of every block, then the last block's output.

        The first L are what the next segment's memory holds (the code's ``hids``).
        """
        T = input_ids.shape[1]
        h = self.embed(input_ids)  # (B, T, D)
        M = 0 if memory is None else memory.length
        pos_emb = self.position_embedding(M + T, h)  # (K, D)
        blocked = causal_blocked(T, memory, attention_mask, h.device)  # (B or 1, T, K)
        hiddens = [h]
        for i, layer in enumerate(self.layers):
            h = layer(h, None if memory is None else memory.states[i], pos_emb, blocked)
            hiddens.append(h)
        return hiddens

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                      token_type_ids: Tensor | None = None) -> list[Tensor]:
        """Serving: one segment, no memory. token_type_ids is accepted and ignored (no segments)."""
        return self.forward(input_ids, None, attention_mask)


# ----------------------------------------------------------------------------------------------
# Pretraining head: next-token prediction with a softmax tied to the input embedding
# ----------------------------------------------------------------------------------------------


class TransfoXLForPreTraining(CarriesStreamMemory, nn.Module):
    """Causal LM over stream-ordered batches; carries each row's memory from call to call."""

    def __init__(self, cfg: TransfoXLConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.backbone = TransfoXLModel(cfg, generator)
        self.out_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.drop = Dropout(cfg.dropout)
        self.stream = StreamMemory(cfg.mem_len)

    def logits(self, h: Tensor) -> Tensor:
        return F.linear(self.drop(h), self.backbone.word_emb.weight, self.out_bias)  # (B, T, V)

    def decode_step(self, input_ids: Tensor, memory: Memory | None = None) -> tuple[Tensor, Memory]:
        """Scores (B, V) of the token after ``input_ids`` (B, T), which continue the positions
        ``memory`` holds (None: nothing yet, ``input_ids`` is the prompt), and the memory extended by
        them. Rows have no padding. The training stream's memory (``self.memory``) is not touched.
        """
        hiddens = self.backbone(input_ids, memory)  # L + 1 x (B, T, D)
        M = 0 if memory is None else memory.length
        valid = torch.ones_like(input_ids, dtype=torch.bool)  # (B, T)
        memory = extend_memory(memory, hiddens[:-1], valid, mem_len=M + input_ids.shape[1])  # keeps all
        return self.logits(hiddens[-1][:, -1]), memory  # (B, V)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, attention_mask: Tensor | None = None,
                reset_memory: Tensor | None = None, token_type_ids: Tensor | None = None) -> PretrainOutput:
        """token_type_ids is accepted so that ``model(**batch)`` works; Transformer-XL ignores it."""
        memory = self.stream.before(input_ids, reset_memory)
        hiddens = self.backbone(input_ids, memory, attention_mask)
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        self.stream.after(memory, hiddens[:-1], valid)

        if labels is None:
            labels = input_ids
        if attention_mask is not None:
            labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
        # Position t predicts token t + 1. The last position's target is the first token of the next
        # batch's row; it is skipped (one target per row and segment) rather than carried over.
        logits = self.logits(hiddens[-1][:, :-1])  # (B, T - 1, V)
        targets = labels[:, 1:]  # (B, T - 1)
        picked = targets != IGNORE_INDEX  # (B, T - 1)
        n_pred = picked.sum()
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss_sum / n_pred.clamp(min=1)
        correct = ((logits.argmax(-1) == targets) & picked).sum()
        metrics = {
            "lm_loss": loss.detach(),
            "lm_acc": (correct.float() / n_pred.clamp(min=1)).detach(),
            "n_pred": n_pred.detach(),
        }
        return PretrainOutput(loss=loss, metrics=metrics)


# ----------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------


PRESETS: dict[str, TransfoXLConfig] = {
    "tiny": TransfoXLConfig(vocab_size=1000, d_model=64, n_layer=2, n_head=4, d_ff=128, max_seq_len=32,
                            mem_len=32),
    # WT103 base (tf/scripts/wt103_base_gpu.sh): 16 x (410, 10 heads of 41, 2100), tgt_len = mem_len = 150.
    # With the plain tied softmax: 151,118,605 parameters (see the test for the arithmetic).
    "base": TransfoXLConfig(vocab_size=267735, d_model=410, n_layer=16, n_head=10, d_head=41, d_ff=2100,
                            max_seq_len=150, mem_len=150),
}
