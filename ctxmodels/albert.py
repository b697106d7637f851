"""ALBERT: BERT with factorized embeddings, cross-layer parameter sharing and sentence order prediction.

Paper: Lan, Chen, Goodman, Gimpel, Sharma, Soricut (2020), "ALBERT: A Lite BERT for Self-supervised
Learning of Language Representations", ICLR. Three changes to BERT's post-LN encoder (§3.1):
- factorized embedding parameterization: tokens are looked up in a V x E table and projected to
  d_model by an E x C matrix, so the vocabulary no longer grows with the hidden size;
- cross-layer parameter sharing: one block applied ``n_layer`` times (``share="all"``), or only its
  attention or feed-forward sub-layer shared (the paper's Table 4 ablation);
- sentence-order prediction (SOP) on the pooled [CLS] vector instead of next-sentence prediction.

Parity checked (tests/ctxmodels/test_albert.py) against Hugging Face transformers 5.x
``AlbertForPreTraining``: ``share="all"`` is its ``num_hidden_groups=1, inner_group_num=1`` and
``share="none"`` its ``num_hidden_groups=n_layer``; weights copied through
``ctxmodels.hf.CONVERTERS["albert"]``, hidden states, MLM and SOP logits equal to 1e-4.

Shape legend
    B  batch size
    T  sequence length (<= max_seq_len)
    E  embedding_size
    C  d_model (the paper's H)
    H  n_head
    D  head size, C // H
    F  d_ff
    V  vocab_size
    N  number of predicted (masked) positions in the batch, labels != -100
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ctxmodels.ops import Dropout, Embedding, predicted_positions, prediction_count
from ctxmodels.outputs import PretrainOutput

IGNORE_INDEX = -100  # label value of positions that are not predicted (HF convention)

Activation = Literal["gelu", "gelu_tanh"]
Share = Literal["all", "attention", "ffn", "none"]


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass
class AlbertConfig:
    vocab_size: int
    embedding_size: int  # E: the factorized embedding width, 128 for every paper size
    d_model: int
    n_layer: int
    n_head: int
    d_ff: int
    max_seq_len: int
    type_vocab_size: int = 2  # segment A / B
    dropout: float = 0.0  # §4.8: removing dropout raised MLM accuracy; the released v2 models use 0
    attn_dropout: float = 0.0
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0  # its embedding row starts at zero and gets no gradient from lookups
    activation: Activation = "gelu_tanh"  # the reference code's gelu is the tanh approximation
    share: Share = "all"  # which sub-layers all layers share: all (paper default), attention, ffn, none
    init_std: float = 0.02
    sop: bool = True  # sentence-order prediction head and loss; False = MLM only

    def __post_init__(self) -> None:
        name = type(self).__name__
        positive = ("vocab_size", "embedding_size", "d_model", "n_layer", "n_head", "d_ff", "max_seq_len",
                    "type_vocab_size")
        for key in positive:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}.{key} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"{name}.d_model ({self.d_model}) must be divisible by {name}.n_head ({self.n_head})"
            )
        for key in ("dropout", "attn_dropout"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"{name}.{key} must be in [0, 1), got {getattr(self, key)!r}")
        for key in ("layer_norm_eps", "init_std"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{name}.{key} must be > 0, got {getattr(self, key)!r}")
        if not isinstance(self.pad_token_id, int) or not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"{name}.pad_token_id must be in [0, vocab_size), got {self.pad_token_id!r}")
        if self.activation not in get_args(Activation):
            raise ValueError(
                f"{name}.activation must be one of {get_args(Activation)}, got {self.activation!r}"
            )
        if self.share not in get_args(Share):
            raise ValueError(f"{name}.share must be one of {get_args(Share)}, got {self.share!r}")
        if not isinstance(self.sop, bool):
            raise ValueError(f"{name}.sop must be true or false, got {self.sop!r}")


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


def padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) 1/0 padding mask -> (B, 1, 1, T) bool, True on the keys every query may attend.

    A row of padding only (an empty sample) attends to all of it: a query with no key at all
    would get a NaN softmax.
    """
    real = attention_mask.bool()  # (B, T)
    real = real | ~real.any(dim=1, keepdim=True)
    return real[:, None, None, :]  # (B, 1, 1, T)


class AlbertAttention(nn.Module):
    """Self-attention sub-layer, with its residual add and LayerNorm (post-LN, as BERT)."""

    compile_region = True  # ctxmodels.compiling.compile_blocks compiles each sub-layer

    def __init__(self, cfg: AlbertConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.query = nn.Linear(cfg.d_model, cfg.d_model)
        self.key = nn.Linear(cfg.d_model, cfg.d_model)
        self.value = nn.Linear(cfg.d_model, cfg.d_model)
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_dropout = cfg.attn_dropout
        self.dropout = Dropout(cfg.dropout)
        self.ln = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor, attn_mask: Tensor | None) -> Tensor:
        """x (B, T, C); attn_mask (B, 1, 1, T) bool, or None when nothing is padded."""
        B, T, C = x.shape
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.ln(x + self.dropout(self.dense(y)))


class AlbertFeedForward(nn.Module):
    """Position-wise feed-forward sub-layer, with its residual add and LayerNorm."""

    compile_region = True

    def __init__(self, cfg: AlbertConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.act = nn.GELU(approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
        self.out = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = Dropout(cfg.dropout)
        self.ln = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.ln(x + self.dropout(self.out(self.act(self.fc(x)))))  # (B, T, C)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


class AlbertModel(nn.Module):
    """Factorized embeddings, ``n_layer`` post-LN layers built from shared sub-layers, pooler.

    Sharing is stored, not aliased: ``attention`` and ``ffn`` hold one module when shared and
    ``n_layer`` otherwise, and layer ``i`` uses ``attention[i % len(attention)]``. So with
    ``share="all"`` a single block is applied ``n_layer`` times, and each weight appears once in
    the state dict.
    """

    def __init__(self, cfg: AlbertConfig):
        super().__init__()
        self.config = cfg
        self.word_emb = Embedding(cfg.vocab_size, cfg.embedding_size, padding_idx=cfg.pad_token_id)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.embedding_size)
        self.type_emb = nn.Embedding(cfg.type_vocab_size, cfg.embedding_size)
        self.emb_ln = nn.LayerNorm(cfg.embedding_size, eps=cfg.layer_norm_eps)
        self.emb_drop = Dropout(cfg.dropout)
        self.emb_proj = nn.Linear(cfg.embedding_size, cfg.d_model)  # the E -> C factorization
        n_attention = 1 if cfg.share in ("all", "attention") else cfg.n_layer
        n_ffn = 1 if cfg.share in ("all", "ffn") else cfg.n_layer
        self.attention = nn.ModuleList(AlbertAttention(cfg) for _ in range(n_attention))
        self.ffn = nn.ModuleList(AlbertFeedForward(cfg) for _ in range(n_ffn))
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model)

    def layer(self, i: int) -> tuple[AlbertAttention, AlbertFeedForward]:
        """The sub-layers that layer ``i`` applies (the same objects for every i when shared)."""
        return self.attention[i % len(self.attention)], self.ffn[i % len(self.ffn)]

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> list[Tensor]:
        """``n_layer + 1`` tensors (B, T, C): the projected embeddings, then each layer's output."""
        B, T = input_ids.shape
        if T > self.config.max_seq_len:
            raise ValueError(
                f"ALBERT input has {T} tokens but max_seq_len is {self.config.max_seq_len}: positions "
                "are learned up to there only; truncate or split the input"
            )
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        e = self.word_emb(input_ids) + self.pos_emb(pos) + self.type_emb(token_type_ids)  # (B, T, E)
        x = self.emb_proj(self.emb_drop(self.emb_ln(e)))  # (B, T, C)
        attn_mask = None  # no padding: let SDPA pick its fastest kernel
        # A mask of all ones is dropped on the CPU (eager) only, as BERT's: on a GPU the check would
        # wait for the device (``jobs.training.loop.to_device`` finds unpadded batches on the host instead),
        # and under torch.compile it would break the graph.
        cpu_eager = attention_mask is not None and attention_mask.device.type == "cpu" and not torch.compiler.is_compiling()
        if attention_mask is not None and not (cpu_eager and bool(attention_mask.all())):
            attn_mask = padding_mask(attention_mask)
        states = [x]
        for i in range(self.config.n_layer):
            attention, ffn = self.layer(i)
            x = ffn(attention(x, attn_mask))
            states.append(x)
        return states

    def pool(self, last_hidden: Tensor) -> Tensor:
        """(B, T, C) last hidden state -> (B, C): tanh(W h_[CLS] + b), as BERT."""
        return torch.tanh(self.pooler(last_hidden[:, 0]))

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        return self.hidden_states(input_ids, attention_mask, token_type_ids)[-1]  # (B, T, C)


# ---------------------------------------------------------------------------------------------
# Heads
# ---------------------------------------------------------------------------------------------


class AlbertMLMHead(nn.Module):
    """C -> E transform (dense, activation, LayerNorm), then scores against the word embeddings."""

    def __init__(self, cfg: AlbertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.embedding_size)
        self.act = nn.GELU(approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
        self.ln = nn.LayerNorm(cfg.embedding_size, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, h: Tensor, word_emb: Tensor) -> Tensor:
        """h (N, C), word_emb (V, E) -> (N, V). The decoder is the embedding table (tied)."""
        return F.linear(self.ln(self.act(self.dense(h))), word_emb, self.bias)


class AlbertForPreTraining(nn.Module):
    """Masked LM + sentence-order prediction (SOP: 0 = segments in order, 1 = swapped)."""

    def __init__(self, cfg: AlbertConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.config = cfg
        self.backbone = AlbertModel(cfg)
        self.mlm_head = AlbertMLMHead(cfg)
        self.sop_dropout = Dropout(cfg.dropout)
        self.sop_head = nn.Linear(cfg.d_model, 2) if cfg.sop else None  # on the pooled [CLS]
        for module in self.modules():
            self._init_weights(module, generator)

    def _init_weights(self, module: nn.Module, generator: torch.Generator | None = None) -> None:
        # The reference code's truncated normal (create_initializer in google-research/albert).
        std = self.config.init_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std, generator=generator)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            nn.init.zeros_(module.weight[module.padding_idx])

    def logits(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,
        label_positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """MLM scores (N, V) at the positions where ``labels != -100`` (every position if labels is
        None), in row-major order; SOP scores (B, 2), or None when ``sop=False``. ``label_positions``:
        those positions as flat indices, found on the host (``ops.predicted_positions``)."""
        last = self.backbone.hidden_states(input_ids, attention_mask, token_type_ids)[-1]  # (B, T, C)
        flat = last.reshape(-1, last.shape[-1])  # (B * T, C)
        if labels is not None:
            # Scoring only the ~15% masked positions saves most of the (B, T, V) logits' memory.
            flat = flat.index_select(0, predicted_positions(labels, label_positions, IGNORE_INDEX))  # (N, C)
        mlm = self.mlm_head(flat, self.backbone.word_emb.weight)  # (N, V)
        sop = None
        if self.sop_head is not None:
            sop = self.sop_head(self.sop_dropout(self.backbone.pool(last)))  # (B, 2)
        return mlm, sop

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        labels: Tensor | None = None,
        next_sentence_label: Tensor | None = None,
        label_positions: Tensor | None = None,
    ) -> PretrainOutput:
        """``labels`` (B, T): target ids at masked positions, -100 elsewhere. ``next_sentence_label``
        (B,) is the project's column for SOP too: 0 = in order, 1 = swapped. ``label_positions``
        (N,): where ``labels != -100`` as flat indices found on the host (``jobs.training.loop.to_device``
        on a GPU, padded by ``ops.padded_positions``: padding rows count in no loss or metric);
        found here when None."""
        if labels is None:
            raise ValueError("AlbertForPreTraining needs `labels` (MLM targets, -100 where not predicted)")
        if self.config.sop and next_sentence_label is None:
            raise ValueError(
                "AlbertForPreTraining with sop=True needs `next_sentence_label` (0 = in order, 1 = swapped); "
                "build batches with the SOP transform or set AlbertConfig.sop=False"
            )
        positions = predicted_positions(labels, label_positions, IGNORE_INDEX)  # (N,) into B * T
        mlm_logits, sop_logits = self.logits(input_ids, attention_mask, token_type_ids, labels, positions)
        targets = labels.reshape(-1).index_select(0, positions)  # (N,), -100 where positions only pad
        n_pred = prediction_count(targets, IGNORE_INDEX)  # on the device: no wait for the host
        denom = n_pred.clamp(min=1)  # a batch with nothing masked gives loss 0, not NaN
        mlm_loss = F.cross_entropy(mlm_logits, targets, reduction="sum") / denom
        metrics = {
            "mlm_loss": mlm_loss.detach(),
            "mlm_acc": (mlm_logits.detach().argmax(-1) == targets).sum() / denom,
            "n_pred": n_pred,
        }
        loss = mlm_loss
        if sop_logits is not None:
            sop_loss = F.cross_entropy(sop_logits, next_sentence_label)
            loss = loss + sop_loss
            metrics["sop_loss"] = sop_loss.detach()
            metrics["sop_acc"] = (sop_logits.detach().argmax(-1) == next_sentence_label).float().mean()
        return PretrainOutput(loss=loss, metrics=metrics)


# ---------------------------------------------------------------------------------------------
# Presets (Lan et al. 2020, Table 1; 30000 SentencePiece tokens, 512 positions)
# ---------------------------------------------------------------------------------------------

PRESETS: dict[str, AlbertConfig] = {
    "tiny": AlbertConfig(
        vocab_size=1000, embedding_size=32, d_model=64, n_layer=4, n_head=4, d_ff=256, max_seq_len=128
    ),
    "base": AlbertConfig(  # 12M parameters
        vocab_size=30000, embedding_size=128, d_model=768, n_layer=12, n_head=12, d_ff=3072, max_seq_len=512
    ),
    "large": AlbertConfig(  # 18M
        vocab_size=30000, embedding_size=128, d_model=1024, n_layer=24, n_head=16, d_ff=4096, max_seq_len=512
    ),
    "xlarge": AlbertConfig(  # 60M
        vocab_size=30000, embedding_size=128, d_model=2048, n_layer=24, n_head=16, d_ff=8192, max_seq_len=512
    ),
    "xxlarge": AlbertConfig(  # the paper says 235M; we count 223M
        vocab_size=30000, embedding_size=128, d_model=4096, n_layer=12, n_head=64, d_ff=16384, max_seq_len=512
    ),
}
