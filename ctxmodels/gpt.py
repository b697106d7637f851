"""GPT: a causal Transformer decoder pretrained by next-token prediction.

Paper: Radford, Narasimhan, Salimans, Sutskever (2018), "Improving Language Understanding by
Generative Pre-Training" (GPT-1: post-LN blocks, learned positions, 40478 BPE tokens, 512
positions, 12 layers x 768, tied input/output embeddings). ``norm="pre"`` gives the block of
Radford et al. (2019), "Language Models are Unsupervised Multitask Learners" (GPT-2): LayerNorm
before each sub-layer, a final LayerNorm, residual projections initialised with a smaller std.

Parity checked (tests/ctxmodels/test_gpt.py) against Hugging Face transformers 5.x
``OpenAIGPTLMHeadModel`` (norm="post") and ``GPT2LMHeadModel`` (norm="pre"): weights copied
through ``ctxmodels.hf.CONVERTERS["gpt"]``, logits and every hidden state equal to 1e-4, and
greedy continuations with the key-value cache equal to ``GPT2LMHeadModel.generate``'s.

Incremental decoding (``GPTForPreTraining.decode_step``): each layer's keys and values of the
positions already read are kept in a ``KVCache``, so a new token is one position through the
model, attending to the cached keys, at position ``cache.length`` (as Hugging Face's
``past_key_values``). Causal attention makes the earlier positions' keys and values independent
of what follows, so the step's scores are those of the last position of a full forward pass.

Shape legend
    B  batch size
    T  sequence length (<= max_seq_len); in decoding, the new positions
    S  positions already in the key-value cache (decoding)
    C  d_model
    H  n_head
    D  head size, C // H
    F  d_ff
    V  vocab_size
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ctxmodels.ops import Dropout, Embedding
from ctxmodels.outputs import PretrainOutput

IGNORE_INDEX = -100  # label value of positions that are not predicted (HF convention)

Norm = Literal["post", "pre"]
Activation = Literal["gelu", "gelu_tanh"]


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    vocab_size: int  # 40478 (BPE + specials) for GPT-1, 50257 (byte-level BPE) for GPT-2
    d_model: int
    n_layer: int
    n_head: int
    d_ff: int  # 4 * d_model in both papers
    max_seq_len: int  # positions are learned, so the model cannot read anything longer
    dropout: float = 0.1  # on embeddings, attention probabilities and residual branches alike
    layer_norm_eps: float = 1e-5
    norm: Norm = "post"  # "post": GPT-1, LayerNorm after each residual add; "pre": GPT-2
    activation: Activation = "gelu_tanh"  # both papers' code uses the tanh approximation
    init_std: float = 0.02

    def __post_init__(self) -> None:
        name = type(self).__name__
        for key in ("vocab_size", "d_model", "n_layer", "n_head", "d_ff", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}.{key} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"{name}.d_model ({self.d_model}) must be divisible by {name}.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{name}.dropout must be in [0, 1), got {self.dropout!r}")
        for key in ("layer_norm_eps", "init_std"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{name}.{key} must be > 0, got {getattr(self, key)!r}")
        if self.norm not in get_args(Norm):
            raise ValueError(f"{name}.norm must be one of {get_args(Norm)}, got {self.norm!r}")
        if self.activation not in get_args(Activation):
            raise ValueError(
                f"{name}.activation must be one of {get_args(Activation)}, got {self.activation!r}"
            )


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


def causal_padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) 1/0 padding mask -> (B, 1, T, T) bool, True where query t may attend key s.

    Query t sees the real keys s <= t, and always itself: a padded query (left padding, an empty
    row) must not be left with no key at all, whose softmax would be NaN and spread to the next
    layer. Real queries are unaffected, since their own key is real.
    """
    T = attention_mask.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()  # (T, T)
    itself = torch.eye(T, dtype=torch.bool, device=attention_mask.device)  # (T, T)
    real_keys = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
    return causal & (real_keys | itself)  # (B, 1, T, T)


@dataclass
class LayerCache:
    """One layer's keys and values of the S positions read so far; None before the first."""

    k: Tensor | None = None  # (B, H, S, D)
    v: Tensor | None = None  # (B, H, S, D)

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new positions' k, v (B, H, T, D); returns all of them, (B, H, S + T, D)."""
        if self.k is not None:
            k = torch.cat([self.k, k], dim=2)  # (B, H, S + T, D)
            v = torch.cat([self.v, v], dim=2)  # (B, H, S + T, D)
        self.k, self.v = k, v
        return k, v


@dataclass
class KVCache:
    """Keys and values of every layer for incremental decoding; ``decode_step`` extends it in place."""

    layers: list[LayerCache] = field(default_factory=list)  # n_layer entries

    @classmethod
    def empty(cls, n_layer: int) -> KVCache:
        return cls([LayerCache() for _ in range(n_layer)])

    @property
    def length(self) -> int:
        """S, the positions already read: the position of the next token."""
        k = self.layers[0].k if self.layers else None
        return 0 if k is None else k.shape[2]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_dropout = cfg.dropout
        self.resid_dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor, attn_mask: Tensor | None, cache: LayerCache | None = None) -> Tensor:
        """x (B, T, C); attn_mask (B or 1, 1, T, S + T) bool, or None for plain causal attention over
        the T positions; ``cache``: the keys and values of S earlier positions, extended here."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        if cache is not None:
            k, v = cache.extend(k, v)  # (B, H, S + T, D)
        p = self.attn_dropout if self.training else 0.0
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, D)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.act = nn.GELU(approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    """One Transformer decoder layer; ``ln_attn``/``ln_mlp`` belong to the attention/MLP sub-layer."""

    compile_region = True  # ctxmodels.compiling.compile_blocks compiles each block

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.ln_attn = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, attn_mask: Tensor | None, cache: LayerCache | None = None) -> Tensor:
        if self.pre_norm:  # GPT-2
            x = x + self.attn(self.ln_attn(x), attn_mask, cache)
            return x + self.mlp(self.ln_mlp(x))
        x = self.ln_attn(x + self.attn(x, attn_mask, cache))  # GPT-1
        return self.ln_mlp(x + self.mlp(x))


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


class GPTModel(nn.Module):
    """Token + learned position embeddings, ``n_layer`` causal blocks, (pre-LN only) a final LN."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        # Post-LN outputs are already normalised; pre-LN ones need a last LayerNorm (GPT-2 §2.3).
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.norm == "pre" else nn.Identity()

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> list[Tensor]:
        """``n_layer + 1`` tensors (B, T, C): the embedding output, then each block's output.

        The last one includes the final LayerNorm of pre-LN models (what the LM head reads, as in
        Hugging Face). GPT has no segment embeddings: ``token_type_ids`` is accepted so every
        backbone has one signature, and ignored.
        """
        B, T = input_ids.shape
        if T > self.config.max_seq_len:
            raise ValueError(
                f"GPT input has {T} tokens but max_seq_len is {self.config.max_seq_len}: positions "
                "are learned up to there only; truncate or split the input"
            )
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))  # (B, T, C)
        # Packed batches have no padding; leaving the mask out lets SDPA use its causal kernels.
        attn_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            attn_mask = causal_padding_mask(attention_mask)
        states = [x]
        for block in self.blocks:
            x = block(x, attn_mask)
            states.append(x)
        states[-1] = self.ln_f(states[-1])
        return states

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.hidden_states(input_ids, attention_mask)[-1]  # (B, T, C)

    def decode(self, input_ids: Tensor, cache: KVCache) -> Tensor:
        """Last hidden states (B, T, C) of ``input_ids``, the tokens at positions S..S+T-1 after the
        S that ``cache`` holds; their keys and values are appended to ``cache``.

        Rows have no padding (every row has read the same S positions). The first call reads the
        prompt (S = 0, plain causal attention); later calls usually one new token each.
        """
        B, T = input_ids.shape
        S = cache.length
        if S + T > self.config.max_seq_len:
            raise ValueError(
                f"GPT decoding would reach position {S + T - 1} but max_seq_len is {self.config.max_seq_len}: "
                "positions are learned up to there only"
            )
        pos = torch.arange(S, S + T, device=input_ids.device)  # (T,)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))  # (B, T, C)
        attn_mask = None  # S = 0: square causal attention
        if S:  # query t (position S + t) sees keys 0..S+t
            attn_mask = torch.ones(T, S + T, dtype=torch.bool, device=x.device).tril(S)[None, None]  # (1, 1, T, S + T)
        for block, layer_cache in zip(self.blocks, cache.layers):
            x = block(x, attn_mask, layer_cache)
        return self.ln_f(x)  # (B, T, C)


class GPTForPreTraining(nn.Module):
    """Next-token prediction; the output projection is the token embedding matrix (tied)."""

    def __init__(self, cfg: GPTConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.config = cfg
        self.backbone = GPTModel(cfg)
        for module in self.modules():
            self._init_weights(module, generator)
        if cfg.norm == "pre":
            # GPT-2 §2.3: scale the weights of residual layers by 1/sqrt(N), N residual layers.
            for block in self.backbone.blocks:
                for proj in (block.attn.proj, block.mlp.proj):
                    nn.init.normal_(proj.weight, std=cfg.init_std / math.sqrt(2 * cfg.n_layer), generator=generator)

    def _init_weights(self, module: nn.Module, generator: torch.Generator | None = None) -> None:
        # GPT-1 §4.1: "a simple weight initialization of N(0, 0.02) was sufficient".
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.init_std, generator=generator)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def logits(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """(B, T, V) scores; position t predicts token t + 1."""
        h = self.backbone.hidden_states(input_ids, attention_mask)[-1]  # (B, T, C)
        return F.linear(h, self.backbone.tok_emb.weight)  # (B, T, V)

    def decode_step(self, input_ids: Tensor, cache: KVCache | None = None) -> tuple[Tensor, KVCache]:
        """Scores (B, V) of the token after ``input_ids`` (B, T), which continue what ``cache`` read
        (None: nothing yet, ``input_ids`` is the prompt), and the cache, extended in place.

        The same scores as ``logits(whole sequence)[:, -1]``, for T positions of work instead of S + T.
        """
        if cache is None:
            cache = KVCache.empty(self.config.n_layer)
        h = self.backbone.decode(input_ids, cache)  # (B, T, C)
        return F.linear(h[:, -1], self.backbone.tok_emb.weight), cache  # (B, V)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> PretrainOutput:
        """``labels`` (B, T) are shifted here: logits at t predict ``labels[:, t + 1]``.

        Without labels, the targets are ``input_ids`` with padding (attention_mask == 0) ignored.
        """
        if labels is None:
            labels = input_ids
            if attention_mask is not None:
                labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        h = self.backbone.hidden_states(input_ids, attention_mask)[-1]  # (B, T, C)
        # The last position has nothing to predict; slicing before the head saves a (B, T, V) copy.
        logits = F.linear(h[:, :-1], self.backbone.tok_emb.weight)  # (B, T-1, V)
        targets = labels[:, 1:]  # (B, T-1)
        predicted = targets != IGNORE_INDEX  # (B, T-1)
        n_pred = predicted.sum()
        denom = n_pred.clamp(min=1)  # a batch with nothing to predict gives loss 0, not NaN
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),  # (B*(T-1), V)
            targets.reshape(-1),  # (B*(T-1),)
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        ) / denom
        with torch.no_grad():
            correct = ((logits.argmax(-1) == targets) & predicted).sum()
        metrics = {
            "lm_loss": loss.detach(),
            "lm_acc": correct / denom,
            "n_pred": n_pred.detach(),
        }
        return PretrainOutput(loss=loss, metrics=metrics)


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------

PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=1000, d_model=64, n_layer=2, n_head=4, d_ff=256, max_seq_len=128),
    # GPT-1 (Radford et al. 2018, §4.1): 40478 tokens, 512 positions, 12 x 768, 12 heads, 3072 -> 117M.
    "base": GPTConfig(vocab_size=40478, d_model=768, n_layer=12, n_head=12, d_ff=3072, max_seq_len=512),
    "gpt2-tiny": GPTConfig(
        vocab_size=1000, d_model=64, n_layer=2, n_head=4, d_ff=256, max_seq_len=128, norm="pre"
    ),
    # GPT-2 small (Radford et al. 2019, Table 2, listed there as 117M): 50257 tokens, 1024
    # positions, 12 x 768 -> 124M counted.
    "gpt2-small": GPTConfig(
        vocab_size=50257, d_model=768, n_layer=12, n_head=12, d_ff=3072, max_seq_len=1024, norm="pre"
    ),
}
