"""BERT and RoBERTa: a post-LayerNorm Transformer encoder pretrained by masked language modelling.

Papers:
- Devlin, Chang, Lee, Toutanova. "BERT: Pre-training of Deep Bidirectional Transformers for Language
  Understanding", NAACL 2019 (MLM + next-sentence prediction).
- Liu et al. "RoBERTa: A Robustly Optimized BERT Pretraining Approach", 2019 (same network: no NSP,
  positions offset by ``pad_token_id + 1``, one segment type). RoBERTa is a set of presets here.
- Joshi et al. "SpanBERT: Improving Pre-training by Representing and Predicting Spans", TACL 2020
  (arXiv:1907.10529): span masking (``pipelines.spans``) plus the Span Boundary Objective head
  (``SBOHead``, on when ``cfg.sbo``), no NSP. SpanBERT is a set of presets here (registry "spanbert").
- Lample, Conneau. "Cross-lingual Language Model Pretraining", NeurIPS 2019 (XLM): the same
  post-LayerNorm encoder with a language embedding in place of the segment one
  (``type_vocab_size`` = number of languages, ``token_type_ids`` = language ids; 0 rows for a
  monolingual model, which has none), a prediction layer without the dense + LayerNorm transform
  (``mlm_transform=False``), and positions given per token (``position_ids``: translation LM
  restarts them at the second sentence). XLM is a set of presets here (registry "xlm"). XLM's
  causal LM (CLM, sec. 3.1: the next token from the ones before it) is the same network with
  ``causal``: every position attends to itself and the positions before it, and the prediction
  layer at position t is scored against token t + 1 (``labels`` come unshifted, as GPT's).

Reference checked for parity: Hugging Face ``transformers`` ``BertModel`` / ``BertForPreTraining``,
``RobertaForMaskedLM`` and ``XLMWithLMHeadModel`` (tests/ctxmodels/test_hf.py and test_xlm.py copy
weights both ways and compare every layer's hidden states and the head logits), and the real
``all-MiniLM-L6-v2`` checkpoint. The SBO
head was read against facebookresearch/SpanBERT ``pretraining/fairseq/models/pair_bert.py``
(``BertPairTargetPredictionHead``); there is no HF class to compare it with.

Speed (training on CPU, ``benchmarks/train_throughput.py``): the MLM loss runs the decoder only at
the masked rows and never materialises their (N, V) logits (``ops.masked_lm_loss``), dropout
draws 16-bit numbers (``ops.dropout``), and training attention with dropout is written out
(``SelfAttention.attend_with_dropout``) instead of SDPA's CPU reference path. Batches padded to
their longest row (fine-tuning) compute nothing for padding (``Packing``): the embeddings and
token-wise layers run on the real tokens, attention on length groups (in training one autograd
Function per layer, ``PackedAttention``, and the feed-forward layer's backward written out); the
word embedding's gradient goes into a buffer kept across steps (``ops.Embedding``). Same math
throughout.

Shape legend:
    B  batch size              T  sequence length          D  d_model
    H  n_head                  Dh head size = D // H       F  d_ff
    V  vocab_size              N  number of predicted (masked) positions in the batch
    S  SBO_MAX_SPAN (rows of the SBO position table)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ctxmodels.ops import (
    Dropout,
    Embedding,
    LayerNorm,
    drawable,
    dropout,
    keep_mask,
    masked_lm_loss,
    predicted_positions,
    prediction_count,
)
from ctxmodels.outputs import PretrainOutput

PositionStyle = Literal["absolute", "roberta"]
Activation = Literal["gelu", "gelu_tanh", "relu"]
IGNORE_INDEX = -100  # label value of positions that are not predicted (HF convention)
# Rows of the SBO relative-position table. Spans are at most 10 words (SpanBERT's clip); 32 word
# pieces cover those words in practice, and a longer span's tail shares the last row (clamped).
SBO_MAX_SPAN = 32


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int  # word-piece (BERT) or byte-BPE (RoBERTa) vocabulary, incl. special tokens
    d_model: int  # hidden size of every block
    n_layer: int  # number of encoder blocks
    n_head: int  # attention heads; must divide d_model
    d_ff: int  # inner size of the feed-forward sub-layer (4 * d_model in the paper)
    max_seq_len: int  # rows of the position table (RoBERTa: usable length + pad_token_id + 1)
    # Segment A/B embeddings; 1 for RoBERTa (no sentence pairs). XLM: one row per language, 0 for a
    # model without language embeddings (one language, or HF's use_lang_emb=False): ids are ignored.
    type_vocab_size: int = 2
    dropout: float = 0.1  # on embeddings and on each sub-layer output before the residual add
    attn_dropout: float = 0.1  # on attention probabilities
    layer_norm_eps: float = 1e-12  # BERT's TF value; RoBERTa (fairseq) uses 1e-5
    pad_token_id: int = 0  # RoBERTa derives positions from it (padding keeps position pad_token_id)
    position_style: PositionStyle = "absolute"  # "roberta": positions start at pad_token_id + 1
    activation: Activation = "gelu"  # "gelu" is the exact erf form used by BERT
    init_std: float = 0.02  # std of the normal init of every weight matrix and embedding
    nsp: bool = True  # whether the pretraining model has the next-sentence-prediction head
    sbo: bool = False  # whether it has SpanBERT's span-boundary head (then sbo_* batch columns are read)
    mlm_transform: bool = True  # MLM head's dense + activation + LayerNorm before the decoder; XLM has none
    # XLM's causal LM (HF XLMConfig.causal): attention to earlier positions only, next-token targets.
    # Causal passes always run padded, with an explicit (T, T) mask: the length groups (Packing) and
    # nested jagged tensors are written for bidirectional attention.
    causal: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layer", "n_head", "d_ff", "max_seq_len", "type_vocab_size"):
            value = getattr(self, name)
            least = 0 if name == "type_vocab_size" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"BertConfig.{name} must be an integer >= {least}, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"BertConfig.d_model ({self.d_model}) must be divisible by BertConfig.n_head ({self.n_head})"
            )
        for name in ("dropout", "attn_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"BertConfig.{name} must be in [0, 1), got {value!r}")
        for name in ("layer_norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"BertConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"BertConfig.pad_token_id ({self.pad_token_id}) must be in [0, vocab_size={self.vocab_size})"
            )
        if self.position_style not in get_args(PositionStyle):
            raise ValueError(
                f"BertConfig.position_style must be one of {get_args(PositionStyle)}, got {self.position_style!r}"
            )
        if self.position_style == "roberta" and self.max_seq_len <= self.pad_token_id + 1:
            raise ValueError(
                f"BertConfig.max_seq_len ({self.max_seq_len}) must exceed pad_token_id + 1 "
                f"({self.pad_token_id + 1}) with position_style='roberta'"
            )
        if self.activation not in get_args(Activation):
            raise ValueError(f"BertConfig.activation must be one of {get_args(Activation)}, got {self.activation!r}")
        for name in ("nsp", "sbo", "mlm_transform", "causal"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"BertConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.causal and (self.nsp or self.sbo):
            raise ValueError("BertConfig.causal: a causal LM predicts the next token; it has no next-sentence "
                             "or span-boundary head (set nsp and sbo to False)")

    @property
    def max_tokens(self) -> int:
        """Longest input the position table allows (RoBERTa spends pad_token_id + 1 rows on offsets)."""
        if self.position_style == "roberta":
            return self.max_seq_len - self.pad_token_id - 1
        return self.max_seq_len


def activation_fn(name: Activation) -> Callable[[Tensor], Tensor]:
    if name == "gelu":
        return F.gelu
    if name == "gelu_tanh":
        return partial(F.gelu, approximate="tanh")
    if name == "relu":
        return F.relu
    raise ValueError(f"unknown activation {name!r}; expected one of {get_args(Activation)}")


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------


class BertEmbeddings(nn.Module):
    """word + position + segment (XLM: language) embeddings, then LayerNorm and dropout."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.word = Embedding(cfg.vocab_size, cfg.d_model)  # ops.Embedding: CPU gradient buffer reused
        self.position = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        # None: no segment / language table (XLM with one language); token_type_ids are then ignored.
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.ln = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.drop = Dropout(cfg.dropout)

    def position_ids(self, input_ids: Tensor) -> Tensor:
        T = input_ids.shape[1]
        if T > self.cfg.max_tokens:
            raise ValueError(
                f"sequence length {T} exceeds the position table: at most {self.cfg.max_tokens} tokens "
                f"(max_seq_len={self.cfg.max_seq_len}, position_style={self.cfg.position_style!r})"
            )
        if self.cfg.position_style == "absolute":
            return torch.arange(T, device=input_ids.device)  # (T,), broadcast over the batch
        # RoBERTa (fairseq make_positions): real tokens count from pad_token_id + 1, padding keeps
        # pad_token_id. Derived from input_ids, not attention_mask, exactly as HF RobertaEmbeddings.
        not_pad = input_ids.ne(self.cfg.pad_token_id).long()  # (B, T)
        return torch.cumsum(not_pad, dim=1) * not_pad + self.cfg.pad_token_id  # (B, T)

    def forward(
        self, input_ids: Tensor, token_type_ids: Tensor | None, keep: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """(B, T, D); with ``keep`` (N,), indices into the B * T positions (``Packing.keep``): (N, D),
        those tokens only (a padded batch's padding is never embedded). ``position_ids`` (B, T):
        each token's row of the position table (XLM's translation LM restarts them at the second
        sentence); None: counted from the start of the row (RoBERTa: from ``pad_token_id + 1``)."""
        if position_ids is None:
            positions = self.position_ids(input_ids)  # (T,) or (B, T)
        else:
            if position_ids.shape != input_ids.shape:
                raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}; input_ids has {tuple(input_ids.shape)}")
            positions = position_ids  # (B, T); rows beyond the table fail in the lookup below
        if keep is not None:
            T = input_ids.shape[1]
            input_ids = input_ids.reshape(-1)[keep]  # (N,)
            positions = keep % T if positions.dim() == 1 else positions.reshape(-1)[keep]  # (N,)
            token_type_ids = None if token_type_ids is None else token_type_ids.reshape(-1)[keep]  # (N,)
        x = self.word(input_ids) + self.position(positions)  # (B, T, D) or (N, D)
        if self.token_type is None:
            pass  # no segment / language table: ids are ignored, as HF XLM ignores langs without one
        elif token_type_ids is None:
            x = x + self.token_type.weight[0]  # segment 0 everywhere, without a (B, T) lookup
        else:
            x = x + self.token_type(token_type_ids)
        return self.drop(self.ln(x))


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused QKV projection (one matmul instead of three)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.attn_dropout = cfg.attn_dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # rows: [query; key; value]
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(
        self, x: Tensor, attn_mask: Tensor | None, packing: "Unpadded | None" = None, rows: Tensor | None = None
    ) -> Tensor:
        """``x`` (B, T, D), or (N, D) real tokens only when ``packing`` says where they sit.

        ``rows`` (M,): the output at those tokens only, (M, D), indices into the N packed rows (or
        the B * T positions without packing); every token still serves as a key and a value.
        """
        qkv = self.qkv(x)  # (B, T, 3D) or (N, 3D)
        if isinstance(packing, JaggedPacking):
            return self.proj(packing.attend(qkv, self.n_head, self.attn_dropout if self.training else 0.0, rows))  # (N or M, D)
        if packing is None:
            y = self.attend(qkv, attn_mask)  # (B, T, D)
            if rows is not None:
                y = y.reshape(-1, y.shape[-1]).index_select(0, rows)  # (M, D)
            return self.proj(y)
        # (a p that 16-bit draws cannot keep, next to 1, takes SDPA's and ops.dropout's fallback)
        written_out = self.training and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
        if written_out and drawable(self.attn_dropout):
            layout = packing.head_layout(self.n_head, qkv.dtype)
            return self.proj(PackedAttention.apply(qkv, layout, self.attn_dropout, rows))  # (N or M, D)
        ys = [self.attend(group, mask) for group, mask in packing.groups(qkv)]  # (b, t, D) per length group
        return self.proj(packing.ungroup(ys, rows))  # (N or M, D): padding queries are dropped before the projection

    def attend(self, qkv: Tensor, attn_mask: Tensor | None) -> Tensor:
        """(B, T, 3D) projected queries, keys and values -> (B, T, D) attention output."""
        B, T, D = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        qkv = qkv.view(B, T, 3, self.n_head, D // self.n_head)  # (B, T, 3, H, Dh)
        if self.training and self.attn_dropout > 0 and qkv.device.type == "cpu":
            y = self.attend_with_dropout(qkv, attn_mask)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, T, Dh), views, no copy
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=self.attn_dropout if self.training else 0.0
            )  # (B, H, T, Dh)
        return y.transpose(1, 2).reshape(B, T, D)  # (B, T, H, Dh) -> (B, T, D)

    def first_query(self, x: Tensor, attn_mask: Tensor | None, packing: "Unpadded | None" = None) -> Tensor:
        """(B, D): the attention output at position 0 alone, every position as keys and values.

        ``x`` as in ``forward``. The query projection runs for one row per sequence and the keys
        and values for all: what the last block costs when only [CLS] is read (classification).
        """
        if isinstance(packing, JaggedPacking):  # every query, then the first rows' outputs
            return self.forward(x, attn_mask, packing, rows=packing.starts)
        D = x.shape[-1]
        w_q, w_kv = self.qkv.weight[:D], self.qkv.weight[D:]  # rows: [query; key; value]
        b_q, b_kv = self.qkv.bias[:D], self.qkv.bias[D:]
        kv = F.linear(x, w_kv, b_kv)  # (B, T, 2D) or (N, 2D)
        q = F.linear(x[:, 0] if packing is None else packing.first(x), w_q, b_q)  # (B, D)
        if packing is None:
            return self.proj(self.attend_one(q, kv, attn_mask))
        ys = [self.attend_one(q_g, kv_g, mask) for q_g, (kv_g, mask) in zip(packing.group_rows(q), packing.groups(kv))]
        return self.proj(packing.ungroup_rows(ys))  # (B, D)

    def attend_one(self, q: Tensor, kv: Tensor, attn_mask: Tensor | None) -> Tensor:
        """One query per sequence: q (B, D) over keys and values kv (B, T, 2D) -> (B, D)."""
        B, T, D = kv.shape[0], kv.shape[1], q.shape[-1]
        H, Dh = self.n_head, D // self.n_head
        k, v = kv.view(B, T, 2, H, Dh).permute(2, 0, 3, 1, 4).unbind(0)  # 2 x (B, H, T, Dh)
        if attn_mask is not None and attn_mask.shape[-2] > 1:  # a causal mask: the first query's row
            attn_mask = attn_mask[..., :1, :]  # (B, 1, 1, T)
        y = F.scaled_dot_product_attention(
            q.view(B, H, 1, Dh), k, v, attn_mask=attn_mask, dropout_p=self.attn_dropout if self.training else 0.0
        )  # (B, H, 1, Dh)
        return y.reshape(B, D)

    def attend_with_dropout(self, qkv: Tensor, attn_mask: Tensor | None) -> Tensor:
        """What SDPA computes, spelled out for CPU training: with dropout, SDPA on CPU takes its
        reference ("math") path and draws the attention dropout with ``bernoulli_``; here the
        dropout is ``ops.dropout``, and the mask is added by the score product itself."""
        B, T, _, H, Dh = qkv.shape
        q, k, v = qkv.permute(2, 0, 3, 1, 4).reshape(3, B * H, T, Dh)  # one copy; 3 x (B*H, T, Dh)
        if attn_mask is None:
            scores = torch.bmm(q, k.transpose(1, 2)).mul_(1.0 / math.sqrt(Dh))  # (B*H, T, T)
        else:
            # True = may attend. finfo.min, not -inf: a row with no key left stays finite (uniform).
            bias = q.new_zeros(attn_mask.shape).masked_fill_(~attn_mask, torch.finfo(q.dtype).min)  # (B, 1, 1 or T, T)
            Tq = attn_mask.shape[-2]  # 1: padding only, broadcast over queries; T: causal
            bias = bias.expand(B, H, Tq, T).reshape(B * H, Tq, T)  # (B*H, 1 or T, T)
            scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=1.0 / math.sqrt(Dh))  # (B*H, T, T)
        probs = dropout(scores.softmax(dim=-1), self.attn_dropout)  # (B*H, T, T)
        return torch.bmm(probs, v).view(B, H, T, Dh)  # (B, H, T, Dh)


class _GeluFeedForward(torch.autograd.Function):
    """``fc_out(gelu(fc_in(x)))`` on (N, D) rows, the backward written out: the activation's
    gradient is computed in place of the incoming one, where autograd would allocate a fresh
    (N, F) tensor for it (pages faulted in anew each step on CPU), and the two layers' five
    products and two bias sums run without a recorded node apiece."""

    @staticmethod
    def forward(ctx, x: Tensor, w_in: Tensor, b_in: Tensor, w_out: Tensor, b_out: Tensor, approximate: str) -> Tensor:
        u = torch.addmm(b_in, x, w_in.t())  # (N, F)
        a = F.gelu(u, approximate=approximate)  # (N, F)
        ctx.save_for_backward(x, w_in, w_out, u, a)
        ctx.approximate = approximate
        return torch.addmm(b_out, a, w_out.t())  # (N, D)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w_in, w_out, u, a = ctx.saved_tensors
        need_x, need_w_in, need_b_in, need_w_out, need_b_out = ctx.needs_input_grad[:5]
        grad_w_out = torch.mm(grad.t(), a) if need_w_out else None  # (D, F)
        grad_b_out = grad.sum(0) if need_b_out else None
        grad_u = torch.mm(grad, w_out)  # (N, F), d loss / d a, then d loss / d u in place
        torch.ops.aten.gelu_backward.grad_input(grad_u, u, approximate=ctx.approximate, grad_input=grad_u)
        grad_w_in = torch.mm(grad_u.t(), x) if need_w_in else None  # (F, D)
        grad_b_in = grad_u.sum(0) if need_b_in else None
        grad_x = torch.mm(grad_u, w_in) if need_x else None  # (N, D)
        return grad_x, grad_w_in, grad_b_in, grad_w_out, grad_b_out, None


class FeedForward(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model)
        self.act = activation_fn(cfg.activation)
        self.approximate = {"gelu": "none", "gelu_tanh": "tanh"}.get(cfg.activation)  # None: not a GELU

    def forward(self, x: Tensor) -> Tensor:
        written_out = (
            self.approximate is not None
            and x.dim() == 2  # packed rows: CPU fine-tuning (Packing)
            and self.training
            and torch.is_grad_enabled()
            and x.device.type == "cpu"
            and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()
        )
        if written_out:
            w_in, w_out = self.fc_in, self.fc_out
            return _GeluFeedForward.apply(x, w_in.weight, w_in.bias, w_out.weight, w_out.bias, self.approximate)
        return self.fc_out(self.act(self.fc_in(x)))  # (B, T, D) -> (B, T, F) -> (B, T, D)


class BertBlock(nn.Module):
    """Post-LN block (as in the paper, unlike GPT-2's pre-LN): LayerNorm after each residual add."""

    compile_region = True  # ctxmodels.compiling.compile_blocks compiles each block

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.ln1 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)
        self.ln2 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor, attn_mask: Tensor | None, packing: "Unpadded | None" = None) -> Tensor:
        x = self.ln1(x + self.drop(self.attn(x, attn_mask, packing)))
        x = self.ln2(x + self.drop(self.ffn(x)))
        return x

    def at_rows(self, x: Tensor, attn_mask: Tensor | None, packing: "Unpadded | None", rows: Tensor) -> Tensor:
        """(M, D): this block's output at ``rows`` only (see ``SelfAttention.forward``): the output
        projection, feed-forward layer and LayerNorms run for those tokens alone."""
        h = x.reshape(-1, x.shape[-1]).index_select(0, rows)  # (M, D), the residual stream at rows
        h = self.ln1(h + self.drop(self.attn(x, attn_mask, packing, rows)))
        return self.ln2(h + self.drop(self.ffn(h)))

    def first_row(self, x: Tensor, attn_mask: Tensor | None, packing: "Unpadded | None" = None) -> Tensor:
        """(B, D): this block's output at position 0 only (see ``SelfAttention.first_query``)."""
        first = x[:, 0] if packing is None else packing.first(x)  # (B, D)
        h = self.ln1(first + self.drop(self.attn.first_query(x, attn_mask, packing)))
        return self.ln2(h + self.drop(self.ffn(h)))


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


# What one more attention group costs, in query-key pairs of attention work: its own dozen or so
# calls forward and backward (gathers, products, softmax, dropout). On the 2-core CPU, values from
# 256 to 4096 timed alike on real fine-tuning batches (benchmarks/finetune_throughput.py); 0 (a
# group per length) was 15% slower.
GROUP_PAIRS = 1024


def length_groups(lengths: list[int], group_pairs: int) -> list[int]:
    """Cut sequence lengths sorted longest first into runs; returns the runs' sizes.

    Each run is padded to its first (longest) length for attention, which then computes
    ``size * length**2`` query-key pairs; the cut minimises the pairs of all runs plus
    ``group_pairs`` per run (``GROUP_PAIRS`` in ``Packing``): dynamic programming over the places
    where the length changes.
    """
    if any(a < b for a, b in zip(lengths, lengths[1:])):
        raise ValueError("length_groups: lengths must be sorted longest first")
    cuts = [i for i in range(len(lengths)) if i == 0 or lengths[i] != lengths[i - 1]] + [len(lengths)]
    best = {0: 0}  # cut position -> least cost of the rows before it
    prev: dict[int, int] = {}
    for j in cuts[1:]:
        best[j], prev[j] = min((best[i] + (j - i) * lengths[i] ** 2 + group_pairs, i) for i in cuts if i < j)
    sizes, j = [], len(lengths)
    while j > 0:
        sizes.append(j - prev[j])
        j = prev[j]
    return sizes[::-1]


class Unpadded:
    """Where the real tokens of a padded (B, T) batch sit, to compute nothing for padding.

    Fine-tuning batches are padded to their longest row; the rows' real lengths vary, so a third
    to two thirds of the positions are often padding. Every layer but attention treats tokens
    independently, so it runs on the (N, D) real tokens: N / (B * T) of the work. The embeddings
    are looked up for those tokens alone (``keep``); ``unpack`` scatters (N, C) rows back to
    (B, T, C), zeros at padding. Each sequence's real tokens are consecutive rows, from
    ``starts``. How attention then runs over the sequences is the subclass's: length groups on
    CPU (``Packing``), nested jagged tensors on GPU (``JaggedPacking``). (The idea of
    "unpadding" in NVIDIA's BERT and FlashAttention's varlen kernels.)
    """

    def __init__(self, attention_mask: Tensor):
        B, T = attention_mask.shape
        lengths = attention_mask.ne(0).sum(dim=1)  # (B,)
        self.host_lengths = lengths.tolist()  # the one wait for the device, where the mask is on a GPU
        if min(self.host_lengths) == 0:
            empty = [i for i, n in enumerate(self.host_lengths) if n == 0]
            raise ValueError(f"attention_mask rows {empty} have no real token: every sequence needs one ([CLS])")
        self.batch, self.seq_len = B, T
        self.lengths = lengths
        # (N,) flat indices into B * T; N known on the host, so finding them does not wait again
        self.keep = torch.nonzero_static(attention_mask.reshape(-1), size=sum(self.host_lengths)).squeeze(1)
        # (B,): where each sequence's first real token sits among the packed rows; its other real
        # tokens follow it in order
        self.starts = torch.cumsum(lengths, dim=0) - lengths

    def unpack(self, x: Tensor) -> Tensor:
        full = x.new_zeros(self.batch * self.seq_len, x.shape[-1]).index_copy(0, self.keep, x)  # (B*T, C)
        return full.view(self.batch, self.seq_len, x.shape[-1])  # (B, T, C)

    def first(self, x: Tensor) -> Tensor:
        """(N, C) packed -> (B, C): each sequence's first token (position 0 is never padding)."""
        return x.index_select(0, self.starts)

    def rows_at(self, positions: Tensor) -> Tensor:
        """(M,) indices into the B * T positions, ascending -> (M,) their packed rows."""
        rows = torch.searchsorted(self.keep, positions).clamp_(max=self.keep.numel() - 1)  # keep is ascending
        padding = self.keep[rows] != positions  # (M,)
        if bool(padding.any()):
            bad = [divmod(int(p), self.seq_len) for p in positions[padding][:5]]
            raise ValueError(f"positions {bad} (row, column) are padding (attention_mask 0): only real tokens are computed")
        return rows


class JaggedPacking(Unpadded):
    """Attention of the packed (N, D) rows over nested jagged tensors: each sequence's queries,
    keys and values are its own consecutive rows (``offsets``), so no score is computed for
    padding and nothing is padded again for attention. On CUDA, SDPA on jagged tensors runs
    FlashAttention's variable-length kernel (``cu_seqlens``, with attention dropout); elsewhere
    its reference path (the CPU tests check it equals the padded layout).

    Building it waits for the device once (for the lengths, which the kernel takes as host
    integers), so it is for eager steps; compiled and graph-captured steps keep the padded layout.
    """

    def __init__(self, attention_mask: Tensor):
        super().__init__(attention_mask)
        self.offsets = torch.cat([self.starts, self.starts[-1:] + self.lengths[-1:]])  # (B + 1,)
        self.max_len, self.min_len = max(self.host_lengths), min(self.host_lengths)

    def _jagged(self, x: Tensor) -> Tensor:
        """(N, H, Dh) -> (B, H, j, Dh), a nested jagged tensor over the sequences."""
        nested = torch.nested.nested_tensor_from_jagged(x.contiguous(), self.offsets, min_seqlen=self.min_len, max_seqlen=self.max_len)
        return nested.transpose(1, 2)

    def attend(self, qkv: Tensor, n_head: int, dropout_p: float, rows: Tensor | None = None) -> Tensor:
        """qkv (N, 3D) projected queries, keys and values -> (N, D), or (M, D) at ``rows``."""
        N, D = qkv.shape[0], qkv.shape[1] // 3
        q, k, v = (self._jagged(part) for part in qkv.view(N, 3, n_head, D // n_head).unbind(1))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)  # (B, H, j, Dh)
        y = y.transpose(1, 2).values().reshape(N, D)  # (N, D), the rows' order
        return y if rows is None else y.index_select(0, rows)


class Packing(Unpadded):
    """Attention of a packed batch on length groups (CPU): the sequences sorted by length and cut
    into groups (``length_groups``), each padded only to its own longest, its padding keys
    masked as in the (B, T) layout. The scores then cost sum(b_g * T_g^2) query-key pairs instead
    of B * T^2, and each real token's output is exactly what the (B, T) layout gives it (the idea
    of length-bucketed batches, around the ordinary attention).
    """

    def __init__(self, attention_mask: Tensor):
        super().__init__(attention_mask)
        lengths = self.lengths
        # Attention groups, longest sequences first. A group's layout (b, t) holds slots; slot
        # (i, j) reads packed row starts[i] + j, the sequence's j-th real token (attention does not
        # care where padding sat), or, past its end, its first token: a finite value hidden as a
        # key, whose own output is dropped (so it gets no gradient).
        self.order = torch.argsort(lengths, descending=True, stable=True)  # (B,)
        self.order_inverse = torch.argsort(self.order)  # (B,)
        self.group_sizes = length_groups(lengths[self.order].tolist(), GROUP_PAIRS)
        self.group_shapes: list[tuple[int, int]] = []  # (b, t) of each group
        self.masks: list[Tensor | None] = []  # (b, 1, 1, t) True = may attend; None: no padding
        slots, real = [], []
        for rows in self.order.split(self.group_sizes):
            t = int(lengths[rows[0]])
            pos = torch.arange(t, device=attention_mask.device)  # (t,)
            is_real = pos < lengths[rows, None]  # (b, t)
            first = self.starts[rows, None]  # (b, 1)
            slots.append(torch.where(is_real, first + pos, first).reshape(-1))  # (b * t,)
            real.append(is_real.reshape(-1))
            self.group_shapes.append((len(rows), t))
            self.masks.append(None if bool(is_real.all()) else is_real[:, None, None, :])
        self.slots = torch.cat(slots)  # (S,) packed row of every slot of every group
        real_slots = torch.cat(real).nonzero().squeeze(1)  # (N,)
        # (N,): the slot of each packed row (its own position in its group)
        self.slot_of_row = torch.empty_like(self.keep).index_copy_(0, self.slots[real_slots], real_slots)
        self._head_layouts: dict[tuple[int, torch.dtype], HeadLayout] = {}

    def head_layout(self, n_head: int, dtype: torch.dtype) -> "HeadLayout":
        """The groups laid out head by head for ``PackedAttention`` (made once per batch: every
        layer shares it)."""
        key = (n_head, dtype)
        if key not in self._head_layouts:
            self._head_layouts[key] = HeadLayout(self, n_head, dtype)
        return self._head_layouts[key]

    @property
    def attention_pairs(self) -> int:
        """Query-key pairs attention computes over the groups: sum of b * t^2."""
        return sum(b * t * t for b, t in self.group_shapes)

    def groups(self, x: Tensor) -> list[tuple[Tensor, Tensor | None]]:
        """(N, C) packed -> per group (its slots (b, t, C), its key mask or None)."""
        slots = x.index_select(0, self.slots)  # (S, C)
        sizes = [b * t for b, t in self.group_shapes]
        views = [g.view(b, t, x.shape[-1]) for g, (b, t) in zip(slots.split(sizes), self.group_shapes)]
        return list(zip(views, self.masks))

    def ungroup(self, ys: list[Tensor], rows: Tensor | None = None) -> Tensor:
        """Per group (b, t, C) -> (N, C) packed: each real token's slot; padding slots dropped.
        With ``rows`` (M,), packed row indices: those rows only, (M, C)."""
        slots = torch.cat([y.reshape(-1, y.shape[-1]) for y in ys])  # (S, C)
        return slots.index_select(0, self.slot_of_row if rows is None else self.slot_of_row[rows])

    def group_rows(self, x: Tensor) -> list[Tensor]:
        """(B, C), one row per sequence -> per group (b, C), in the groups' order."""
        return list(x.index_select(0, self.order).split(self.group_sizes))

    def ungroup_rows(self, ys: list[Tensor]) -> Tensor:
        """Per group (b, C) -> (B, C) in batch order."""
        return torch.cat(ys).index_select(0, self.order_inverse)


class HeadLayout:
    """Index tables that move a packed batch's attention between its (N, 3D) projections and its
    length groups head by head, each in one gather (``PackedAttention``).

    Rows are head vectors (Dh floats). A group (b, t) holds its queries, keys and values as
    (3, b * H, t, Dh), the layout ``bmm`` reads, one group after another ("grouped"); its outputs
    as (b * H, t, Dh), likewise ("outputs"). ``to_grouped`` (S * 3H,) gives the projected row of
    every grouped row (padding slots read their sequence's first token, as ``Packing.groups``);
    ``from_grouped`` (N * 3H,) the grouped row of each token's (part, head) at its own slot;
    ``outputs`` (N, H) the output row of each token's head. ``biases``: per group (b * H, 1, t),
    0 for real keys and the dtype's lowest value for padding keys, so one ``baddbmm`` adds it.
    """

    def __init__(self, packing: Packing, n_head: int, dtype: torch.dtype):
        H = n_head
        device = packing.slots.device
        self.shapes = packing.group_shapes
        self.n_head = H
        to_grouped, grouped_of_slot, output_of_slot, self.biases = [], [], [], []
        slot0, grouped0, output0 = 0, 0, 0
        parts, heads = torch.arange(3, device=device), torch.arange(H, device=device)
        for (b, t), mask in zip(self.shapes, packing.masks):
            rows = packing.slots[slot0 : slot0 + b * t].view(b, t)  # packed row of each slot
            # grouped (3, b, H, t) <- projected row (row * 3 + part) * H + head
            src = (rows[None, :, None, :] * 3 + parts[:, None, None, None]) * H + heads[None, None, :, None]
            to_grouped.append(src.reshape(-1))
            here = torch.arange(3 * b * H * t, device=device).view(3, b, H, t) + grouped0
            grouped_of_slot.append(here.permute(1, 3, 0, 2).reshape(b * t, 3 * H))  # slot -> its (part, head) rows
            out = torch.arange(b * H * t, device=device).view(b, H, t) + output0
            output_of_slot.append(out.permute(0, 2, 1).reshape(b * t, H))  # slot -> its heads' output rows
            bias = torch.zeros(b, 1, t, dtype=dtype, device=device)
            if mask is not None:
                bias.masked_fill_(~mask.view(b, 1, t), torch.finfo(dtype).min)
            self.biases.append(bias.repeat_interleave(H, dim=0))  # (b * H, 1, t)
            slot0, grouped0, output0 = slot0 + b * t, grouped0 + 3 * b * H * t, output0 + b * H * t
        self.to_grouped = torch.cat(to_grouped)  # (S * 3H,)
        self.n_outputs = output0  # rows of the outputs layout
        self.from_grouped = torch.cat(grouped_of_slot)[packing.slot_of_row].reshape(-1)  # (N * 3H,)
        self.outputs = torch.cat(output_of_slot)[packing.slot_of_row]  # (N, H)


class PackedAttention(torch.autograd.Function):
    """Attention of a packed batch over its length groups, forward and backward written out: what
    ``SelfAttention.attend_with_dropout`` computes on each of ``Packing.groups`` (and SDPA without
    dropout), for every group of a layer at once.

    Autograd would record some 40 ops per layer here (gathers, per-group copies to and from the
    head-major layout, masks, products, softmax, dropout) for a few MFLOP of attention: on CPU
    their overhead, not the arithmetic, was most of the attention's time. Here the projections
    reach the grouped layout in one gather and leave it in one; the padding biases are made once
    per batch (``HeadLayout``); one dropout draw covers every group; the backward writes each
    group's gradients straight into place.
    """

    @staticmethod
    def forward(ctx, qkv: Tensor, layout: HeadLayout, p: float, rows: Tensor | None) -> Tensor:
        """qkv (N, 3D) -> (N, D), or (M, D) at ``rows`` (packed row indices)."""
        N, D = qkv.shape[0], qkv.shape[1] // 3
        H = layout.n_head
        Dh = D // H
        scale = 1.0 / math.sqrt(Dh)
        grouped = qkv.reshape(N * 3 * H, Dh).index_select(0, layout.to_grouped)  # (S * 3H, Dh)
        sizes = [b * H * t * t for b, t in layout.shapes]
        masks = keep_mask(torch.Size([sum(sizes)]), p, qkv.dtype).split(sizes) if p > 0 else [None] * len(sizes)
        probs, kepts, outs, g0 = [], [], [], 0
        for (b, t), bias, mask in zip(layout.shapes, layout.biases, masks):
            q, k, v = grouped[g0 : g0 + 3 * b * H * t].view(3, b * H, t, Dh).unbind(0)
            g0 += 3 * b * H * t
            prob = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=scale).softmax(dim=-1)  # (bH, t, t)
            probs.append(prob)
            kept = prob if mask is None else prob * mask.view(b * H, t, t)
            kepts.append(kept)
            outs.append(torch.bmm(kept, v).view(b * H * t, Dh))
        picked = layout.outputs if rows is None else layout.outputs[rows]  # (N or M, H)
        ctx.picked = picked.reshape(-1)
        ctx.save_for_backward(grouped)
        ctx.probs, ctx.kepts, ctx.masks, ctx.layout, ctx.scale, ctx.n_rows = probs, kepts, masks, layout, scale, N
        return torch.cat(outs).index_select(0, ctx.picked).view(-1, D)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        if ctx.probs is None:
            raise RuntimeError("PackedAttention: backward ran twice through one graph (retain_graph is not supported)")
        (grouped,) = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        H, Dh = layout.n_head, grouped.shape[1]
        grad_out = grad.new_zeros(layout.n_outputs, Dh).index_copy_(0, ctx.picked, grad.reshape(-1, Dh))
        grad_grouped = grouped.new_empty(grouped.shape)  # (S * 3H, Dh), every row written below
        g0, o0 = 0, 0
        for (b, t), prob, kept, mask in zip(layout.shapes, ctx.probs, ctx.kepts, ctx.masks):
            q, k, v = grouped[g0 : g0 + 3 * b * H * t].view(3, b * H, t, Dh).unbind(0)
            gq, gk, gv = grad_grouped[g0 : g0 + 3 * b * H * t].view(3, b * H, t, Dh).unbind(0)
            go = grad_out[o0 : o0 + b * H * t].view(b * H, t, Dh)
            g0, o0 = g0 + 3 * b * H * t, o0 + b * H * t
            mask = None if mask is None else mask.view(b * H, t, t)
            torch.bmm(kept.transpose(1, 2), go, out=gv)
            grad_kept = torch.bmm(go, v.transpose(1, 2))  # (bH, t, t)
            if mask is not None:
                grad_kept.mul_(mask)
            grad_scores = torch.ops.aten._softmax_backward_data(grad_kept, prob, -1, prob.dtype).mul_(scale)
            torch.bmm(grad_scores, k, out=gq)
            torch.bmm(grad_scores.transpose(1, 2), q, out=gk)
        ctx.probs = ctx.kepts = ctx.masks = None
        grad_qkv = grad_grouped.index_select(0, layout.from_grouped).view(ctx.n_rows, 3 * H * Dh)
        return grad_qkv, None, None, None


def init_bert_weights(module: nn.Module, std: float, generator: torch.Generator | None = None) -> None:
    """BERT init: every Linear/Embedding weight ~ N(0, std), biases 0, LayerNorm weight 1 / bias 0."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=std, generator=generator)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class BertModel(nn.Module):
    """The encoder: embeddings, ``n_layer`` blocks, and the [CLS] pooler (dense + tanh)."""

    def __init__(self, cfg: BertConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertBlock(cfg) for _ in range(cfg.n_layer))
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model)
        # On CPU (eager), padded batches compute nothing for padding (``Packing``); False runs the
        # plain (B, T) layout, as on GPU. The results are the same: tests compare the two.
        self.skip_padding = True
        # True: eager passes on any device skip padding with attention over nested jagged tensors
        # (``JaggedPacking``: FlashAttention's variable-length kernel on GPU; ``train.unpad``).
        self.jagged = False
        init_bert_weights(self, cfg.init_std, generator)

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> list[Tensor]:
        """``n_layer + 1`` tensors (B, T, D); index 0 is the embedding output after LayerNorm.

        Rows padded by ``attention_mask`` hold zeros in the block outputs on CPU (they are computed
        only where a real token sits; see ``Packing``) and meaningless values elsewhere: read
        hidden states at real tokens only.
        """
        # Batches padded to their longest row (packing): the embeddings, projections, feed-forward
        # layers and LayerNorms run on the (N, D) real tokens only; attention on length groups.
        x, attn_mask, packing = self._embed(input_ids, attention_mask, token_type_ids, position_ids)
        out = [x if packing is None else packing.unpack(x)]
        for block in self.layers:
            x = block(x, attn_mask, packing)
            out.append(x if packing is None else packing.unpack(x))  # (B, T, D), zeros at padding
        return out

    def first_token_state(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """(B, D): the last hidden state at position 0 ([CLS] / <s>), what the pooler reads.

        Equal to ``hidden_states(...)[-1][:, 0]``; the last block runs its queries, output
        projection and feed-forward layer for that one row per sequence (sequence classification
        reads nothing else), which saves most of a block's work.
        """
        x, attn_mask, packing = self._embed(input_ids, attention_mask, token_type_ids)
        for block in self.layers[:-1]:
            x = block(x, attn_mask, packing)
        return self.layers[-1].first_row(x, attn_mask, packing)

    def last_hidden_at(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        where: Tensor | None = None,
    ) -> Tensor:
        """(M, D): the last hidden state at the (B, T) positions where ``where`` is True, in
        row-major order; ``hidden_states(...)[-1][where]``.

        The last block runs its output projection, feed-forward layer and LayerNorms for those
        positions only (keys and values come from every token): token classification trains on
        the labelled positions, and a word's other pieces, [CLS] and [SEP] carry no label.
        Positions must hold real tokens (``attention_mask`` 1).
        """
        x, attn_mask, packing = self._embed(input_ids, attention_mask, token_type_ids)
        positions = where.reshape(-1).nonzero().squeeze(1)  # (M,) indices into B * T
        rows = positions if packing is None else packing.rows_at(positions)  # (M,)
        for block in self.layers[:-1]:
            x = block(x, attn_mask, packing)
        return self.layers[-1].at_rows(x, attn_mask, packing, rows)

    def _embed(
        self, input_ids: Tensor, attention_mask: Tensor | None, token_type_ids: Tensor | None, position_ids: Tensor | None = None
    ):
        """(embedding output, attention mask for SDPA or None, Packing, JaggedPacking or None);
        the output is (N, D), the real tokens only, with a packing, else (B, T, D)."""
        if self.cfg.causal:  # XLM's CLM: key <= query, and never a padding key
            T = input_ids.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()  # (T, T), True = may attend
            attn_mask = causal[None, None] if attention_mask is None else causal & attention_mask.bool()[:, None, None, :]
            return self.embeddings(input_ids, token_type_ids, None, position_ids), attn_mask, None  # (B, T, D), (B or 1, 1, T, T)
        attn_mask, packing = None, None
        # A mask of all ones (packed rows) is dropped on CPU, where it would cost passes over the
        # (B, H, T, T) scores in every layer, and padding is skipped (Packing); on
        # GPU either check would wait for the device, and under torch.compile it would break the
        # graph: there padding is skipped only when asked (``jagged``), in eager passes.
        on_cpu = attention_mask is not None and attention_mask.device.type == "cpu"
        # (is_compiling first: under torch.compile the capture check is never traced)
        eager = attention_mask is not None and not torch.compiler.is_compiling() and not (
            attention_mask.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        if attention_mask is not None and not (on_cpu and eager and bool(attention_mask.all())):
            if eager and self.jagged:
                packing = JaggedPacking(attention_mask)
            else:
                # True = may attend. Padding keys are hidden from every query; padding queries still see
                # the real tokens, so their rows stay finite (they are ignored downstream anyway).
                attn_mask = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T), broadcast over H and queries
                packing = Packing(attention_mask) if on_cpu and eager and self.skip_padding else None
        keep = None if packing is None else packing.keep
        return self.embeddings(input_ids, token_type_ids, keep, position_ids), attn_mask, packing  # (N or B, (T,) D), ...

    def pool(self, last_hidden: Tensor) -> Tensor:
        return torch.tanh(self.pooler(last_hidden[:, 0]))  # (B, D) from the [CLS] / <s> position

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Returns (last hidden state (B, T, D), pooled output (B, D))."""
        last = self.hidden_states(input_ids, attention_mask, token_type_ids, position_ids)[-1]
        return last, self.pool(last)


# ----------------------------------------------------------------------------------------------
# Heads
# ----------------------------------------------------------------------------------------------


class MLMHead(nn.Module):
    """dense + activation + LayerNorm, then the decoder tied to the word embeddings, plus a bias.
    XLM's prediction layer (``cfg.mlm_transform`` False) is the decoder and bias alone.

    The decoder weight is not a parameter of the head: ``forward`` receives the word-embedding
    matrix, so the state dict holds it once (nothing to re-tie when loading).
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        if cfg.mlm_transform:
            self.dense = nn.Linear(cfg.d_model, cfg.d_model)
            self.act = activation_fn(cfg.activation)
            self.ln = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.has_transform = cfg.mlm_transform
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def transform(self, h: Tensor) -> Tensor:
        if not self.has_transform:
            return h  # (..., D): XLM decodes the last hidden state as it is
        return self.ln(self.act(self.dense(h)))  # (..., D)

    def forward(self, h: Tensor, word_embeddings: Tensor) -> Tensor:
        return F.linear(self.transform(h), word_embeddings, self.bias)  # (..., V)


class SBOHead(nn.Module):
    """SpanBERT's Span Boundary Objective (Joshi et al. 2020, sec. 3.2).

    Every token x_i of a masked span (s..e) is predicted from the two tokens just outside the span
    and its position in it: ``y_i = f(x_{s-1}, x_{e+1}, p_{i-s+1})``, f a 2-layer feed-forward
    network with GeLU and LayerNorm after each layer; ``y_i`` is scored against the same output
    embeddings as MLM (the tied word embeddings) with its own output bias, as the reference's
    ``BertPairTargetPredictionHead``. The relative position embeddings are ``d_model`` wide here
    (the reference: 200) with ``SBO_MAX_SPAN`` rows (the reference: 20).
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.position = nn.Embedding(SBO_MAX_SPAN, cfg.d_model)
        self.fc1 = nn.Linear(3 * cfg.d_model, cfg.d_model)
        self.ln1 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.fc2 = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.act = activation_fn(cfg.activation)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def transform(self, left: Tensor, right: Tensor, pos: Tensor) -> Tensor:
        """left, right (N, D): hidden states of the boundary tokens; pos (N,) 0-based position in
        the span -> y (N, D), the vector scored against the output embeddings."""
        p = self.position(pos.clamp(0, SBO_MAX_SPAN - 1))  # (N, D)
        h = torch.cat([left, right, p], dim=-1)  # (N, 3D)
        h = self.ln1(self.act(self.fc1(h)))  # (N, D)
        return self.ln2(self.act(self.fc2(h)))  # (N, D)

    def forward(self, left: Tensor, right: Tensor, pos: Tensor, word_embeddings: Tensor) -> Tensor:
        """-> logits (N, V)."""
        return F.linear(self.transform(left, right, pos), word_embeddings, self.bias)  # (N, V)


class BertForPreTraining(nn.Module):
    """Backbone + MLM head (+ NSP head when ``cfg.nsp``, + SBO head when ``cfg.sbo``);
    ``forward(**batch) -> PretrainOutput``."""

    def __init__(self, cfg: BertConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.backbone = BertModel(cfg, generator)
        self.mlm = MLMHead(cfg)
        self.nsp = nn.Linear(cfg.d_model, 2) if cfg.nsp else None
        self.sbo = SBOHead(cfg) if cfg.sbo else None
        init_bert_weights(self.mlm, cfg.init_std, generator)
        if self.nsp is not None:
            init_bert_weights(self.nsp, cfg.init_std, generator)
        if self.sbo is not None:
            init_bert_weights(self.sbo, cfg.init_std, generator)

    def mlm_logits(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> Tensor:
        """Full vocabulary logits (B, T, V) at every position: for inference and tests."""
        last = self.backbone.hidden_states(input_ids, attention_mask, token_type_ids, position_ids)[-1]
        return self.mlm(last, self.backbone.embeddings.word.weight)

    def nsp_logits(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
    ) -> Tensor:
        """Next-sentence logits (B, 2); index 0 = "B follows A"."""
        if self.nsp is None:
            raise ValueError("this model has no NSP head (config.nsp is False)")
        _, pooled = self.backbone(input_ids, attention_mask, token_type_ids)
        return self.nsp(pooled)

    def sbo_logits(self, last: Tensor, selected: Tensor, sbo_left: Tensor, sbo_right: Tensor, sbo_pos: Tensor) -> Tensor:
        """SBO logits (N, V) at the ``selected`` (B, T) positions, in row-major order, from the
        last hidden states (B, T, D): each target reads only its span's two boundary states."""
        y = self.sbo_hidden(last, selected, sbo_left, sbo_right, sbo_pos)  # (N, D)
        return F.linear(y, self.backbone.embeddings.word.weight, self.sbo.bias)  # (N, V)

    def sbo_hidden(
        self, last: Tensor, selected: Tensor, sbo_left: Tensor, sbo_right: Tensor, sbo_pos: Tensor
    ) -> Tensor:
        """The SBO head before its decoder: (N, D), rows as in ``sbo_logits``."""
        return self._sbo_at(last, selected.reshape(-1).nonzero().squeeze(1), sbo_left, sbo_right, sbo_pos)

    def _sbo_at(self, last: Tensor, positions: Tensor, sbo_left: Tensor, sbo_right: Tensor, sbo_pos: Tensor) -> Tensor:
        """``sbo_hidden`` at the flat (B * T) ``positions`` (``ops.predicted_positions``)."""
        if self.sbo is None:
            raise ValueError("this model has no SBO head (config.sbo is False)")
        T = last.shape[1]
        rows = torch.div(positions, T, rounding_mode="floor")  # (N,) sequence of each target
        flat = last.reshape(-1, last.shape[-1])  # (B * T, D)
        left = flat.index_select(0, rows * T + sbo_left.reshape(-1).index_select(0, positions).clamp(min=0))  # (N, D)
        right = flat.index_select(0, rows * T + sbo_right.reshape(-1).index_select(0, positions).clamp(min=0))  # (N, D)
        return self.sbo.transform(left, right, sbo_pos.reshape(-1).index_select(0, positions))

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,
        next_sentence_label: Tensor | None = None,
        sbo_left: Tensor | None = None,
        sbo_right: Tensor | None = None,
        sbo_pos: Tensor | None = None,
        label_positions: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> PretrainOutput:
        """``sbo_left``/``sbo_right``/``sbo_pos`` (B, T), read where ``labels != -100``: positions of
        the tokens just before / after the token's span and its 0-based position in the span
        (``pipelines.spans.span_mask``). Given together, and only to a model with ``cfg.sbo``.
        ``label_positions`` (N,): where ``labels != -100``, as flat indices found on the host
        (``ops.predicted_positions``; ``jobs.training.loop.to_device`` on a GPU, padded to a few fixed
        counts by ``ops.padded_positions``: padding rows count in no loss or metric); found here
        when None. ``position_ids`` (B, T): XLM's translation LM (``pipelines.xlm``); None counts
        positions from each row's start."""
        if labels is None and next_sentence_label is None:
            raise ValueError(
                "BertForPreTraining.forward needs labels (MLM) and/or next_sentence_label (NSP); "
                "use mlm_logits() or .backbone for inference"
            )
        if next_sentence_label is not None and self.nsp is None:
            raise ValueError("next_sentence_label given but this model has no NSP head (config.nsp is False)")
        sbo_given = [t is not None for t in (sbo_left, sbo_right, sbo_pos)]
        if any(sbo_given) and not all(sbo_given):
            raise ValueError("sbo_left, sbo_right and sbo_pos go together: give all three or none")
        if all(sbo_given) and (self.sbo is None or labels is None):
            raise ValueError(
                "sbo_left/sbo_right/sbo_pos given but "
                + ("this model has no SBO head (config.sbo is False)" if self.sbo is None else "labels is missing")
            )
        last = self.backbone.hidden_states(input_ids, attention_mask, token_type_ids, position_ids)[-1]  # (B, T, D)
        metrics: dict[str, Tensor] = {}
        losses: list[Tensor] = []

        word = self.backbone.embeddings.word.weight  # (V, D), the decoder of both MLM and SBO
        if self.cfg.causal:  # XLM's CLM: position t is scored against labels[t + 1]
            return self._next_token_loss(last, labels, word)
        if labels is not None:
            # The speed trick: run the head (and its D x V matmul) only where a label exists,
            # typically 15% of the positions, instead of B*T rows. masked_lm_loss is
            # cross_entropy(F.linear(h, word, bias), target) without materialising the (N, V)
            # logits; with N = 0 it is a zero loss whose graph stays connected (DDP needs every
            # parameter used).
            positions = predicted_positions(labels, label_positions, IGNORE_INDEX)  # (N,) into B * T
            h = self.mlm.transform(last.reshape(-1, last.shape[-1]).index_select(0, positions))  # (N, D)
            target = labels.reshape(-1).index_select(0, positions)  # (N,), -100 where positions only pad
            n_pred = prediction_count(target, IGNORE_INDEX)  # on the device: no wait for the host
            mlm_loss, n_correct = masked_lm_loss(h, word, self.mlm.bias, target)
            mlm_acc = n_correct.float() / n_pred.clamp(min=1)
            losses.append(mlm_loss)
            metrics.update(mlm_loss=mlm_loss.detach(), mlm_acc=mlm_acc.detach(), n_pred=n_pred)

        if self.sbo is not None and sbo_left is not None:
            y = self._sbo_at(last, positions, sbo_left, sbo_right, sbo_pos)  # (N, D), same N as MLM
            sbo_loss, sbo_correct = masked_lm_loss(y, word, self.sbo.bias, target)
            sbo_acc = sbo_correct.float() / n_pred.clamp(min=1)
            losses.append(sbo_loss)
            metrics.update(sbo_loss=sbo_loss.detach(), sbo_acc=sbo_acc.detach())

        if next_sentence_label is not None:
            nsp_logits = self.nsp(self.backbone.pool(last))  # (B, 2)
            nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label)
            losses.append(nsp_loss)
            metrics.update(
                nsp_loss=nsp_loss.detach(),
                nsp_acc=(nsp_logits.argmax(-1) == next_sentence_label).float().mean().detach(),
            )

        loss = losses[0]
        for extra in losses[1:]:  # SpanBERT: L_MLM + L_SBO; BERT: L_MLM + L_NSP
            loss = loss + extra
        return PretrainOutput(loss=loss, metrics=metrics)

    def _next_token_loss(self, last: Tensor, labels: Tensor | None, word: Tensor) -> PretrainOutput:
        """The causal LM's loss: every position but the last predicts the next label (-100: none), as
        ``ctxmodels.gpt`` does. All B * T rows go through the prediction layer (nearly all are
        predicted), so no positions are looked up and ``label_positions`` is not read."""
        if labels is None:
            raise ValueError("a causal XLM trains on labels (the next token); next_sentence_label has no head here")
        target = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)  # (B * T,): labels[t + 1] at t
        h = self.mlm.transform(last.reshape(-1, last.shape[-1]))  # (B * T, D)
        n_pred = prediction_count(target, IGNORE_INDEX)
        loss, n_correct = masked_lm_loss(h, word, self.mlm.bias, target)
        acc = n_correct.float() / n_pred.clamp(min=1)
        return PretrainOutput(loss=loss, metrics={"lm_loss": loss.detach(), "lm_acc": acc.detach(), "n_pred": n_pred})


# ----------------------------------------------------------------------------------------------
# Presets (values: derive variants with dataclasses.replace)
# ----------------------------------------------------------------------------------------------

_ROBERTA = dict(type_vocab_size=1, pad_token_id=1, position_style="roberta", layer_norm_eps=1e-5, nsp=False)
# XLM (Lample & Conneau 2019; facebookresearch/XLM): no NSP, no MLM transform, d_ff = 4 * d_model
# (HF XLM fixes it), type_vocab_size = languages with an embedding (0: none). The three large
# presets have the shapes of the released xlm-mlm-en-2048, xlm-mlm-xnli15-1024 and xlm-mlm-100-1280.
_XLM = dict(nsp=False, mlm_transform=False)

PRESETS: dict[str, BertConfig] = {
    "tiny": BertConfig(vocab_size=8000, d_model=64, n_layer=2, n_head=2, d_ff=256, max_seq_len=128),
    "mini": BertConfig(vocab_size=30522, d_model=256, n_layer=4, n_head=4, d_ff=1024, max_seq_len=512),
    "base": BertConfig(vocab_size=30522, d_model=768, n_layer=12, n_head=12, d_ff=3072, max_seq_len=512),
    "large": BertConfig(vocab_size=30522, d_model=1024, n_layer=24, n_head=16, d_ff=4096, max_seq_len=512),
    "roberta-tiny": BertConfig(
        vocab_size=8000, d_model=64, n_layer=2, n_head=2, d_ff=256, max_seq_len=130, **_ROBERTA
    ),
    "roberta-base": BertConfig(
        vocab_size=50265, d_model=768, n_layer=12, n_head=12, d_ff=3072, max_seq_len=514, **_ROBERTA
    ),
    "roberta-large": BertConfig(
        vocab_size=50265, d_model=1024, n_layer=24, n_head=16, d_ff=4096, max_seq_len=514, **_ROBERTA
    ),
    "xlm-tiny": BertConfig(vocab_size=8000, d_model=64, n_layer=2, n_head=2, d_ff=256, max_seq_len=128, type_vocab_size=0, **_XLM),
    "xlm-en-2048": BertConfig(
        vocab_size=30145, d_model=2048, n_layer=12, n_head=16, d_ff=8192, max_seq_len=512, type_vocab_size=0, **_XLM
    ),
    "xlm-xnli15-1024": BertConfig(
        vocab_size=95000, d_model=1024, n_layer=12, n_head=8, d_ff=4096, max_seq_len=512, type_vocab_size=15, **_XLM
    ),
    "xlm-100-1280": BertConfig(
        vocab_size=200000, d_model=1280, n_layer=16, n_head=16, d_ff=5120, max_seq_len=512, type_vocab_size=0, **_XLM
    ),
}
