"""XLNet: permutation language modelling with two-stream attention on a Transformer-XL backbone.

Paper: Yang, Dai, Yang, Carbonell, Salakhutdinov, Le. "XLNet: Generalized Autoregressive
Pretraining for Language Understanding", NeurIPS 2019 (arXiv:1906.08237), Section 2.

Reference checked for parity: Hugging Face ``transformers`` ``XLNetLMHeadModel`` with
``attn_type="bi"`` (tests/ctxmodels/test_xlnet.py copies the weights through
``ctxmodels.hf.CONVERTERS["xlnet"]`` and compares query-stream logits and content-stream hidden
states, with and without memory).
Read while writing: the authors' code, zihangdai/xlnet ``modeling.py`` (``two_stream_rel_attn``,
``rel_attn_core``, ``relative_positional_encoding``) and ``data_utils.py`` (``_local_perm``).

The paper's pieces and where they live:
- Permutation LM (2.2): a factorization order z is sampled per row by the data pipeline and reaches
  the model only as ``perm_mask`` (1 = may not attend). Tokens keep their original positions, so
  the relative distances below are between original positions; only who-sees-whom changes.
- Two-stream attention (2.3): the content stream h_i sees the content of tokens up to and including
  itself in the order (it is the usual representation, and what the memory caches); the query
  stream g_i starts from a learned ``mask_emb`` and sees the content of tokens strictly before it
  in the order, never its own, so it can predict x_{z_t} knowing the position but not the token.
  Both streams share every weight.
- Partial prediction (2.3): only the last 1/K of each order is predicted; the pipeline chooses
  those P positions and sends them as ``target_mapping``, so the loss covers exactly them.
- Transformer-XL backbone (2.4): memory of the content stream and relative positional attention;
  the sinusoid, the relative shift, score terms (a)-(d), the feed-forward block and the memory
  bookkeeping are imported from ctxmodels/transformer_xl.py. Attention is bidirectional, so
  distances run from K - 1 down to -(T - 1).
- Relative segment encoding (2.5): s_ij = s_same or s_diff depending on whether i and j share a
  segment; (q_i + b) . s_ij joins the attention score. Memory counts as segment 0, as in the code.

Not implemented: ``bi_data`` (forward and backward halves of a batch), ``same_length``, the
uni-directional ``attn_type``. ``reuse_len`` is: the code caches only the first ``reuse_len``
tokens of a segment, the part its input pipeline continues in the next batch.

Shape legend:
    B  batch size                 T  current segment length
    M  memory length              K  key length = M + T
    R  relative distances = K + T - 1 (from K - 1 down to -(T - 1))
    P  number of predicted tokens per row (target_mapping.shape[1])
    D  d_model                    H  n_head          Dh  d_head
    F  d_ff                       V  vocab_size      L  n_layer
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ctxmodels.ops import Dropout, Embedding
from ctxmodels.outputs import PretrainOutput
from ctxmodels.transformer_xl import (
    Activation,
    CarriesStreamMemory,
    Memory,
    PositionwiseFF,
    StreamMemory,
    init_weights,
    relative_scores,
    sinusoid_embedding,
)

IGNORE_INDEX = -100  # label value of padding targets (HF convention)


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class XLNetConfig:
    vocab_size: int  # SentencePiece vocabulary: 32000
    d_model: int  # hidden size of every block
    n_layer: int  # number of blocks
    n_head: int  # attention heads
    d_ff: int  # inner size of the feed-forward sub-layer
    max_seq_len: int  # length of the rows the pipeline packs (paper: 512); positions are relative,
    # so the model itself runs at any length
    mem_len: int  # content-stream states kept per layer from previous segments (paper: 384)
    d_head: int | None = None  # per-head size; None means d_model // n_head
    reuse_len: int | None = None  # cache only the first reuse_len tokens (paper: 256); None = all
    dropout: float = 0.1  # on embeddings, positions, attention probabilities and sub-layer outputs
    activation: Activation = "gelu"  # feed-forward non-linearity (exact erf GELU)
    clamp_len: int | None = None  # clamp |distance| above this; None = never
    layer_norm_eps: float = 1e-12
    init_std: float = 0.02  # std of the normal init of weights, embeddings, biases u, v, b, s

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"XLNetConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.mem_len, int) or isinstance(self.mem_len, bool) or self.mem_len < 0:
            raise ValueError(f"XLNetConfig.mem_len must be an integer >= 0, got {self.mem_len!r}")
        if self.d_model % 2:
            raise ValueError(f"XLNetConfig.d_model must be even (sin/cos halves), got {self.d_model}")
        if self.d_head is None and self.d_model % self.n_head:
            raise ValueError(
                f"XLNetConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head}) "
                "when d_head is not given"
            )
        for name in ("d_head", "reuse_len", "clamp_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"XLNetConfig.{name} must be a positive integer or None, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"XLNetConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.activation not in get_args(Activation):
            raise ValueError(f"XLNetConfig.activation must be one of {get_args(Activation)}, got {self.activation!r}")
        for name in ("layer_norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"XLNetConfig.{name} must be > 0, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        return self.d_head if self.d_head is not None else self.d_model // self.n_head


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------


class TwoStreamAttention(nn.Module):
    """Relative attention shared by the content and query streams, with relative segment encoding."""

    def __init__(self, cfg: XLNetConfig):
        super().__init__()
        H, Dh, D = cfg.n_head, cfg.head_dim, cfg.d_model
        self.n_head, self.d_head = H, Dh
        self.q = nn.Linear(D, H * Dh, bias=False)
        self.k = nn.Linear(D, H * Dh, bias=False)
        self.v = nn.Linear(D, H * Dh, bias=False)
        self.r = nn.Linear(D, H * Dh, bias=False)  # W_{k,R}: projects the sinusoids
        self.o = nn.Linear(H * Dh, D, bias=False)
        self.u = nn.Parameter(torch.zeros(H, Dh))  # content bias (code: r_w_bias)
        self.v_bias = nn.Parameter(torch.zeros(H, Dh))  # position bias (code: r_r_bias)
        self.s_bias = nn.Parameter(torch.zeros(H, Dh))  # segment bias b (code: r_s_bias)
        self.seg_embed = nn.Parameter(torch.zeros(2, H, Dh))  # [s_same, s_diff]
        self.ln = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.drop = Dropout(cfg.dropout)
        self.scale = Dh**-0.5

    def attend(self, q: Tensor, k: Tensor, v: Tensor, r: Tensor, seg_diff: Tensor | None,
               blocked: Tensor | None) -> Tensor:
        """q (B, T, H, Dh) for the T positions; k, v (B, K, H, Dh); r (R, H, Dh) -> (B, T, H, Dh)."""
        scores = relative_scores(q, k, r, self.u, self.v_bias)  # (B, H, T, K)
        if seg_diff is not None:
            seg = torch.einsum("bthd,shd->bhts", q + self.s_bias, self.seg_embed)  # (B, H, T, 2)
            scores = scores + torch.where(seg_diff[:, None], seg[..., 1:], seg[..., :1])  # (B, H, T, K)
        scores = scores * self.scale
        if blocked is not None:
            scores = scores.masked_fill(blocked[:, None], torch.finfo(scores.dtype).min)
        prob = self.drop(scores.softmax(dim=-1))  # (B, H, T, K)
        return torch.einsum("bhtk,bkhd->bthd", prob, v)  # (B, T, H, Dh)

    def post(self, x: Tensor, vec: Tensor) -> Tensor:
        """Output projection, dropout, residual and LayerNorm. vec (B, N, H, Dh) -> (B, N, D)."""
        out = self.o(vec.flatten(2))  # (B, N, H * Dh) -> (B, N, D)
        return self.ln(x + self.drop(out))

    def forward(self, h: Tensor, g: Tensor | None, mem: Tensor | None, pos_emb: Tensor,
                seg_diff: Tensor | None, blocked_h: Tensor | None, blocked_g: Tensor | None,
                target_mapping: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """h (B, T, D), g (B, P, D) or None, mem (B, M, D) or None, pos_emb (R, D)."""
        B, T, _ = h.shape
        H, Dh = self.n_head, self.d_head
        cat = h if mem is None else torch.cat([mem, h], dim=1)  # (B, K, D)
        k = self.k(cat).view(B, cat.shape[1], H, Dh)  # (B, K, H, Dh)
        v = self.v(cat).view(B, cat.shape[1], H, Dh)  # (B, K, H, Dh)
        r = self.r(pos_emb).view(-1, H, Dh)  # (R, H, Dh)

        q_h = self.q(h).view(B, T, H, Dh)  # (B, T, H, Dh)
        h_out = self.post(h, self.attend(q_h, k, v, r, seg_diff, blocked_h))  # (B, T, D)
        if g is None:
            return h_out, None
        # Each target's query is placed at its position so that distances and masks are those of
        # the position; positions without a target get a zero query whose result is discarded.
        q_g = self.q(g).view(B, g.shape[1], H, Dh)  # (B, P, H, Dh)
        q_g = torch.einsum("bpt,bphd->bthd", target_mapping, q_g)  # (B, T, H, Dh)
        vec_g = self.attend(q_g, k, v, r, seg_diff, blocked_g)  # (B, T, H, Dh)
        vec_g = torch.einsum("bpt,bthd->bphd", target_mapping, vec_g)  # (B, P, H, Dh)
        return h_out, self.post(g, vec_g)  # (B, P, D)


class XLNetBlock(nn.Module):
    def __init__(self, cfg: XLNetConfig):
        super().__init__()
        self.attn = TwoStreamAttention(cfg)
        self.ff = PositionwiseFF(cfg.d_model, cfg.d_ff, cfg.dropout, cfg.activation, "post", cfg.layer_norm_eps)

    def forward(self, h: Tensor, g: Tensor | None, mem: Tensor | None, pos_emb: Tensor,
                seg_diff: Tensor | None, blocked_h: Tensor | None, blocked_g: Tensor | None,
                target_mapping: Tensor | None) -> tuple[Tensor, Tensor | None]:
        h, g = self.attn(h, g, mem, pos_emb, seg_diff, blocked_h, blocked_g, target_mapping)
        return self.ff(h), None if g is None else self.ff(g)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


def two_stream_blocked(T: int, memory: Memory | None, attention_mask: Tensor | None,
                       perm_mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """(blocked_h, blocked_g), each (B, T, K) bool, True = may not attend; None when nothing is blocked.

    The query stream obeys perm_mask as given (the pipeline sets perm_mask[i, i] = 1 at targets);
    the content stream additionally always sees itself. Padding keys and reset memory are blocked
    for both.
    """
    if memory is None and attention_mask is None and perm_mask is None:
        return None, None
    if perm_mask is not None:
        B, device = perm_mask.shape[0], perm_mask.device
    elif attention_mask is not None:
        B, device = attention_mask.shape[0], attention_mask.device
    else:
        B, device = memory.valid.shape[0], memory.valid.device
    M = 0 if memory is None else memory.length
    current = torch.zeros(B, T, T, dtype=torch.bool, device=device)  # (B, T, T)
    if perm_mask is not None:
        current = current | (perm_mask > 0)
    if attention_mask is not None:
        current = current | (attention_mask == 0)[:, None, :]
    mem_blocked = torch.zeros(B, T, M, dtype=torch.bool, device=device)  # (B, T, M)
    if memory is not None:
        mem_blocked = mem_blocked | ~memory.valid[:, None, :]
    blocked_g = torch.cat([mem_blocked, current], dim=2)  # (B, T, K)
    blocked_h = blocked_g.clone()
    diag = torch.arange(T, device=device)
    blocked_h[:, diag, M + diag] = False
    return blocked_h, blocked_g


class XLNetModel(nn.Module):
    """Word embedding (no scaling), learned query-stream start ``mask_emb``, L two-stream blocks."""

    def __init__(self, cfg: XLNetConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.word_emb = Embedding(cfg.vocab_size, cfg.d_model)
        self.mask_emb = nn.Parameter(torch.zeros(cfg.d_model))  # g^(0), the same for every target
        self.layers = nn.ModuleList([XLNetBlock(cfg) for _ in range(cfg.n_layer)])
        self.drop = Dropout(cfg.dropout)
        init_weights(self, cfg.init_std, generator)  # Linear, Embedding, LayerNorm
        for m in self.modules():
            if isinstance(m, TwoStreamAttention):
                for p in (m.u, m.v_bias, m.s_bias, m.seg_embed):
                    nn.init.normal_(p, mean=0.0, std=cfg.init_std, generator=generator)
        nn.init.normal_(self.mask_emb, mean=0.0, std=cfg.init_std, generator=generator)

    def position_embedding(self, klen: int, qlen: int, like: Tensor) -> Tensor:
        """Sinusoids for distances K - 1 down to -(T - 1): bidirectional attention. (R, D)."""
        distances = torch.arange(klen - 1, -qlen, -1, device=like.device)  # (R,)
        if self.cfg.clamp_len is not None:
            distances = distances.clamp(-self.cfg.clamp_len, self.cfg.clamp_len)
        return self.drop(sinusoid_embedding(distances, self.cfg.d_model).to(like.dtype))  # (R, D)

    def forward(self, input_ids: Tensor, memory: Memory | None = None, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, perm_mask: Tensor | None = None,
                target_mapping: Tensor | None = None) -> tuple[list[Tensor], Tensor | None]:
        """Content stream: L + 1 tensors (B, T, D), block inputs then the last output (the first L
        are what memory caches). Query stream: the last block's g (B, P, D), or None without
        target_mapping."""
        B, T = input_ids.shape
        M = 0 if memory is None else memory.length
        h = self.drop(self.word_emb(input_ids))  # (B, T, D)
        g = None
        if target_mapping is not None:
            target_mapping = target_mapping.to(h.dtype)
            g = self.drop(self.mask_emb.expand(B, target_mapping.shape[1], -1))  # (B, P, D)
        seg_diff = None
        if token_type_ids is not None:
            mem_types = torch.zeros(B, M, dtype=token_type_ids.dtype, device=token_type_ids.device)
            key_types = torch.cat([mem_types, token_type_ids], dim=1)  # (B, K)
            seg_diff = token_type_ids[:, :, None] != key_types[:, None, :]  # (B, T, K)
        pos_emb = self.position_embedding(M + T, T, h)  # (R, D)
        blocked_h, blocked_g = two_stream_blocked(T, memory, attention_mask, perm_mask)
        hiddens = [h]
        for i, layer in enumerate(self.layers):
            mem = None if memory is None else memory.states[i]
            h, g = layer(h, g, mem, pos_emb, seg_diff, blocked_h, blocked_g, target_mapping)
            hiddens.append(h)
        return hiddens, g

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                      token_type_ids: Tensor | None = None) -> list[Tensor]:
        """Serving: content stream over one segment, full bidirectional attention, no memory."""
        return self.forward(input_ids, None, attention_mask, token_type_ids)[0]


# ----------------------------------------------------------------------------------------------
# Pretraining head: predict each target from its query stream, softmax tied to the embedding
# ----------------------------------------------------------------------------------------------


class XLNetForPreTraining(CarriesStreamMemory, nn.Module):
    """Permutation LM over stream-ordered batches; carries each row's memory from call to call."""

    def __init__(self, cfg: XLNetConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.backbone = XLNetModel(cfg, generator)
        self.lm_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.drop = Dropout(cfg.dropout)
        self.stream = StreamMemory(cfg.mem_len)

    def logits(self, g: Tensor) -> Tensor:
        return F.linear(self.drop(g), self.backbone.word_emb.weight, self.lm_bias)  # (B, P, V)

    def forward(self, input_ids: Tensor, perm_mask: Tensor, target_mapping: Tensor, labels: Tensor,
                attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                reset_memory: Tensor | None = None) -> PretrainOutput:
        memory = self.stream.before(input_ids, reset_memory)
        hiddens, g = self.backbone(input_ids, memory, attention_mask, token_type_ids, perm_mask, target_mapping)
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        cached = hiddens[:-1]
        if self.cfg.reuse_len is not None:
            cached = [x[:, : self.cfg.reuse_len] for x in cached]  # (B, reuse_len, D)
            valid = valid[:, : self.cfg.reuse_len]
        self.stream.after(memory, cached, valid)

        logits = self.logits(g)  # (B, P, V)
        picked = labels != IGNORE_INDEX  # (B, P)
        n_pred = picked.sum()
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss_sum / n_pred.clamp(min=1)
        correct = ((logits.argmax(-1) == labels) & picked).sum()
        metrics = {
            "plm_loss": loss.detach(),
            "plm_acc": (correct.float() / n_pred.clamp(min=1)).detach(),
            "n_pred": n_pred.detach(),
        }
        return PretrainOutput(loss=loss, metrics=metrics)


# ----------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------


PRESETS: dict[str, XLNetConfig] = {
    "tiny": XLNetConfig(vocab_size=1000, d_model=64, n_layer=2, n_head=4, d_ff=128, max_seq_len=32, mem_len=32),
    # XLNet-Base (paper Table 7 / the code's base scripts): 12 x (768, 12 heads, 3072), seq 512, mem 384.
    "base": XLNetConfig(vocab_size=32000, d_model=768, n_layer=12, n_head=12, d_ff=3072, max_seq_len=512,
                        mem_len=384),
}
