"""AWD-LSTM: a 3-layer LSTM language model and its regularisers, the encoder ULMFiT fine-tunes.

Merity, Keskar, Socher 2017, "Regularizing and Optimizing LSTM Language Models" (arXiv:1708.02182),
Sections 2-4; Howard & Ruder 2018, "Universal Language Model Fine-tuning for Text Classification"
(ACL), Sections 3 and 4 (sizes, dropouts, the concat-pooling classifier in ``ctxmodels.tasks``).
Written from the papers' descriptions; no reference code was copied.

The model: an embedding (V, D), ``n_layer`` single-layer LSTMs (D -> H -> ... -> H -> D: the last
projects back to the embedding width), a softmax tied to the embedding (Inan et al. 2017; Press &
Wolf 2017) with its own bias. The regularisers, as the AWD-LSTM paper defines them:

* weight dropout (DropConnect, Wan et al. 2013; paper sec. 2) on each LSTM's hidden-to-hidden
  matrix ``weight_hh``: one mask per forward call, rescaled by 1 / (1 - p). The dropped matrix is
  computed and handed to torch's fused LSTM (``torch.lstm``, what ``nn.LSTM.forward`` calls), so
  no Python loop over time steps and no module attribute is overwritten;
* embedding dropout (Gal & Ghahramani 2016; paper sec. 4.3): whole rows of the embedding, i.e.
  every occurrence of a word type in the batch, dropped and the rest rescaled;
* locked (variational) dropout (paper sec. 4.2) on the LSTM inputs, between the layers and on the
  last layer's output: one mask per sequence (row), the same at every time step;
* activation regularisation AR ``alpha * mean(m * h_T^2)`` on the dropped output of the last layer
  and temporal activation regularisation TAR ``beta * mean((h_t - h_{t+1})^2)`` on its undropped
  output (paper sec. 4.6; alpha 2, beta 1).

Variable-length BPTT (paper sec. 4.1) here. Batches come stream-ordered from the data pipeline, all
of one shape (B, T) (``pipelines.streams``): row r of a batch continues row r of the previous one
and the LSTM state is carried across (detached; reset rows start from zero). Inside a training
batch the model cuts time into windows whose lengths are drawn as the paper draws its sequence
lengths (base ``bptt`` with probability 0.95, else bptt / 2; then ``max(5, N(that, 5))``) and
detaches the state at each cut, so gradients reach back a varying number of steps and no position
of the stream is always a window start. The paper scales the learning rate by seq_len / bptt so
that every token weighs the same whatever its window's length; here the loss is one mean over all
the batch's tokens, every token already weighs the same, and the rate needs no scaling. The
window lengths are drawn from torch's global generator, as the dropout masks are (seeded per
worker by ``jobs.training.loop.seed_worker_rng``). With ``bptt`` 0, or outside training, a batch is one
window.

Shape legend:
    B  batch           T  tokens per row         V  vocab_size
    D  d_model: embedding width and the last LSTM's output (tied softmax)
    H  lstm_dim: the other LSTMs' width            L  n_layer
    G  4 * (an LSTM's output width): its gates i, f, g, o
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ctxmodels.ops import dropout
from ctxmodels.outputs import PretrainOutput

IGNORE_INDEX = -100  # label value of positions that are not predicted (HF convention)
State = list[tuple[Tensor, Tensor]]  # per layer (h (B, width), c (B, width))


@dataclass
class AwdLstmConfig:
    vocab_size: int
    d_model: int = 400  # embedding width = the last LSTM's output width (the softmax is tied to it)
    lstm_dim: int = 1150  # width of every LSTM but the last
    n_layer: int = 3
    dropout: float = 0.4  # locked dropout on the last LSTM's output (ULMFiT: "0.4 to layers")
    dropout_hidden: float = 0.3  # locked dropout between LSTM layers (ULMFiT: "0.3 to RNN layers")
    dropout_input: float = 0.4  # locked dropout on the embedding output (ULMFiT: "0.4 to input embedding layers")
    dropout_embed: float = 0.05  # embedding dropout, whole words (ULMFiT: "0.05 to embedding layers")
    dropout_weight: float = 0.5  # DropConnect on weight_hh (ULMFiT: 0.5 "to the RNN hidden-to-hidden matrix")
    ar_alpha: float = 2.0  # activation regularisation (AWD-LSTM sec. 4.6)
    tar_beta: float = 1.0  # temporal activation regularisation
    bptt: int = 70  # base window of variable-length BPTT inside a batch (ULMFiT: 70); 0: one window per batch

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "lstm_dim", "n_layer"):
            if getattr(self, key) < 1:
                raise ValueError(f"AwdLstmConfig.{key}={getattr(self, key)} must be positive")
        for key in ("dropout", "dropout_hidden", "dropout_input", "dropout_embed", "dropout_weight"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"AwdLstmConfig.{key}={getattr(self, key)} must be in [0, 1)")
        for key in ("ar_alpha", "tar_beta"):
            if getattr(self, key) < 0:
                raise ValueError(f"AwdLstmConfig.{key}={getattr(self, key)} must be >= 0")
        if self.bptt < 0:
            raise ValueError(f"AwdLstmConfig.bptt={self.bptt} must be >= 0 (0: no windows inside a batch)")

    def widths(self) -> list[tuple[int, int]]:
        """(input, output) width of each LSTM: D -> H -> ... -> H -> D."""
        outs = [self.lstm_dim] * (self.n_layer - 1) + [self.d_model]
        return list(zip([self.d_model] + outs[:-1], outs))


# ----------------------------------------------------------------------------- the three dropouts


def embedding_dropout(weight: Tensor, input_ids: Tensor, p: float, training: bool) -> Tensor:
    """(B, T) ids -> (B, T, D) embeddings with whole rows of ``weight`` (V, D) dropped: a dropped word
    type is zero at every position of the batch, the kept ones scaled by 1 / (1 - p). The (V, 1)
    mask is applied to the looked-up rows, which equals masking the table (V, D) first."""
    emb = F.embedding(input_ids, weight)  # (B, T, D)
    if not training or p == 0.0:
        return emb
    keep = dropout(weight.new_ones(weight.shape[0], 1), p)  # (V, 1): 0 or 1 / (1 - p) per word type
    return emb * keep[input_ids]  # (B, T, 1) broadcast over D


def locked_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """x (B, T, C) with one (B, 1, C) mask: each row drops the same units at every time step."""
    if not training or p == 0.0:
        return x
    return x * dropout(x.new_ones(x.shape[0], 1, x.shape[2]), p)  # (B, 1, C) broadcast over T


class WeightDropLSTM(nn.Module):
    """One LSTM layer whose hidden-to-hidden matrix is under DropConnect (AWD-LSTM sec. 2).

    The parameters are ``nn.LSTM``'s (gate order i, f, g, o; two biases), without the ``_l0``
    suffix. ``dropped_weight_hh`` draws a new mask each call in training and is the plain matrix in
    evaluation; ``forward`` takes the dropped matrix, so the windows of one batch share one mask.
    """

    def __init__(self, d_in: int, d_out: int, weight_p: float):
        super().__init__()
        self.d_out, self.weight_p = d_out, weight_p
        self.weight_ih = nn.Parameter(torch.empty(4 * d_out, d_in))  # (G, d_in)
        self.weight_hh = nn.Parameter(torch.empty(4 * d_out, d_out))  # (G, d_out)
        self.bias_ih = nn.Parameter(torch.empty(4 * d_out))
        self.bias_hh = nn.Parameter(torch.empty(4 * d_out))

    def dropped_weight_hh(self) -> Tensor:
        return dropout(self.weight_hh, self.weight_p, self.training)  # (G, d_out), elements rescaled

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor], weight_hh: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x (B, T, d_in), state (h, c) each (B, d_out) -> out (B, T, d_out), final (h, c)."""
        weights = [self.weight_ih, weight_hh, self.bias_ih, self.bias_hh]
        if x.is_cuda:
            # cuDNN runs from one flat buffer; weights that are not views of one warn ("not part of a
            # single contiguous chunk") and are copied anyway. One differentiable copy, made here.
            flat = torch.cat([w.reshape(-1) for w in weights])
            weights = [v.view_as(w) for v, w in zip(flat.split([w.numel() for w in weights]), weights)]
        h0, c0 = state[0].unsqueeze(0), state[1].unsqueeze(0)  # (1, B, d_out): one layer, one direction
        # torch.lstm is nn.LSTM's own fused kernel: (input, hx, weights, has_biases, num_layers,
        # dropout, train, bidirectional, batch_first). Its dropout is 0, so ``train`` changes no
        # output: it makes cuDNN keep what its backward reads, wanted whenever gradients are (an
        # eval-mode backward: gradient saliency, the CUDA-equals-CPU test), else "cudnn RNN
        # backward can only be called in training mode".
        train = self.training or torch.is_grad_enabled()
        out, h, c = torch.lstm(x, (h0, c0), weights, True, 1, 0.0, train, False, True)
        return out, (h[0], c[0])  # (B, T, d_out)


# ----------------------------------------------------------------------------- the encoder


class AwdLstmOutput(NamedTuple):
    embedded: Tensor  # (B, T, D): embeddings after embedding and input dropout
    raw: list[Tensor]  # L tensors: each LSTM's output before its locked dropout
    dropped: list[Tensor]  # L tensors: after it (hidden dropout between layers, output dropout on the last)
    state: State  # per layer, after the last position


def bptt_windows(T: int, bptt: int, generator: torch.Generator | None = None) -> list[int]:
    """Window lengths summing to T, drawn as AWD-LSTM draws its BPTT lengths (sec. 4.1): base
    ``bptt`` with probability 0.95, else ``bptt / 2``; the length ``max(5, int(N(base, 5)))``. The
    last window takes what is left. ``bptt`` 0: one window."""
    if bptt <= 0:
        return [T]
    out, left = [], T
    while left > 0:  # one iteration per window
        base = bptt if float(torch.rand((), generator=generator)) < 0.95 else bptt / 2
        n = max(5, int(base + 5.0 * float(torch.randn((), generator=generator))))
        out.append(min(n, left))
        left -= out[-1]
    return out


class AwdLstmModel(nn.Module):
    """Embedding, the LSTM stack and its dropouts; ``hidden_states`` is what serving and tasks read."""

    def __init__(self, cfg: AwdLstmConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(WeightDropLSTM(i, o, cfg.dropout_weight) for i, o in cfg.widths())

    def zero_state(self, B: int, like: Tensor) -> State:
        return [(like.new_zeros(B, layer.d_out), like.new_zeros(B, layer.d_out)) for layer in self.layers]

    def forward(self, input_ids: Tensor, state: State | None = None, windows: list[int] | None = None) -> AwdLstmOutput:
        """input_ids (B, T); ``state`` the carried per-layer state (None: zeros); ``windows`` lengths
        summing to T at whose ends the state is detached (None: one window)."""
        cfg = self.config
        B, T = input_ids.shape
        emb = embedding_dropout(self.embed.weight, input_ids, cfg.dropout_embed, self.training)  # (B, T, D)
        x = embedded = locked_dropout(emb, cfg.dropout_input, self.training)
        state = self.zero_state(B, emb) if state is None else state
        windows = windows or [T]
        raw, dropped, new_state = [], [], []
        for k, layer in enumerate(self.layers):
            w_hh = layer.dropped_weight_hh()  # one DropConnect mask for the whole batch
            s, outs, t = state[k], [], 0
            for i, n in enumerate(windows):  # one iteration per BPTT window
                if i > 0:
                    s = (s[0].detach(), s[1].detach())  # truncate: no gradient into the previous window
                out, s = layer(x[:, t : t + n], s, w_hh)  # (B, n, width)
                outs.append(out)
                t += n
            h = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # (B, T, width)
            last = k == len(self.layers) - 1
            x = locked_dropout(h, cfg.dropout if last else cfg.dropout_hidden, self.training)
            raw.append(h)
            dropped.append(x)
            new_state.append(s)
        return AwdLstmOutput(embedded, raw, dropped, new_state)

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None) -> list[Tensor]:
        """L + 1 tensors: the embeddings (B, T, D), then each LSTM's output ((B, T, H), last (B, T, D)),
        with their dropouts in training mode (what a fine-tuned head reads). Right padding cannot
        change the real positions (the LSTMs run left to right); ``token_type_ids`` is ignored."""
        out = self(input_ids)
        return [out.embedded] + out.dropped


# ----------------------------------------------------------------------------- pretraining


def init_awd_lstm_weights(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """The AWD-LSTM code's initialisation, drawn from ``generator``: embedding U(-0.1, 0.1), each
    LSTM U(-1/sqrt(width), +) (PyTorch's LSTM default), the softmax bias zero."""
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            nn.init.uniform_(m.weight, -0.1, 0.1, generator=generator)
        elif isinstance(m, WeightDropLSTM):
            bound = 1.0 / math.sqrt(m.d_out)
            for p in m.parameters():
                nn.init.uniform_(p, -bound, bound, generator=generator)


class AwdLstmForPreTraining(nn.Module):
    """Next-token LM over stream-ordered batches, carrying each row's LSTM state from call to call.

    ``forward`` (input_ids, labels, attention_mask, reset_memory): labels unshifted (position t
    predicts ``labels[:, t + 1]``; -100 and padding are not predicted); with ``reset_memory`` (B,)
    the state of the previous call is carried over (rows with 1 start from zero), without it every
    call starts from zero. loss = NLL + AR + TAR; metrics ``lm_loss``, ``lm_acc``, ``n_pred``,
    ``ar``, ``tar``. As Transformer-XL, the last position's target (the next batch's first token)
    is skipped rather than carried over. Call ``clear_memory`` before evaluating on other data.
    """

    def __init__(self, cfg: AwdLstmConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.config = cfg
        self.backbone = AwdLstmModel(cfg)
        self.out_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.memory: State | None = None  # not a parameter: never saved
        init_awd_lstm_weights(self, generator)

    def clear_memory(self) -> None:
        self.memory = None

    def logits(self, h: Tensor) -> Tensor:
        """(..., D) -> (..., V): the softmax tied to the embedding."""
        return F.linear(h, self.backbone.embed.weight, self.out_bias)

    def _initial_state(self, input_ids: Tensor, reset_memory: Tensor | None) -> State | None:
        if reset_memory is None or self.memory is None or bool((reset_memory != 0).all()):
            return None  # every row starts a new stream: the batch size may change here
        B = input_ids.shape[0]
        if self.memory[0][0].shape[0] != B:
            raise ValueError(
                f"reset_memory has {B} rows but the carried state has {self.memory[0][0].shape[0]}: stream-ordered "
                "batches need a constant batch size (or reset_memory=1 on every row)"
            )
        keep = (reset_memory == 0).to(input_ids.device)[:, None]  # (B, 1)
        return [(torch.where(keep, h.to(keep.device), 0.0), torch.where(keep, c.to(keep.device), 0.0)) for h, c in self.memory]

    def decode_step(self, input_ids: Tensor, state: State | None = None) -> tuple[Tensor, State]:
        """Scores (B, V) of the token after ``input_ids`` (B, T), which continue ``state`` (None: the
        prompt), and the state after them. Rows have no padding; the training memory is untouched."""
        out = self.backbone(input_ids, state)
        return self.logits(out.dropped[-1][:, -1]), out.state

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, attention_mask: Tensor | None = None,
                reset_memory: Tensor | None = None, token_type_ids: Tensor | None = None) -> PretrainOutput:
        cfg = self.config
        B, T = input_ids.shape
        state = self._initial_state(input_ids, reset_memory)
        cut = self.training and torch.is_grad_enabled()
        out = self.backbone(input_ids, state, bptt_windows(T, cfg.bptt) if cut else None)
        if reset_memory is not None:
            self.memory = [(h.detach(), c.detach()) for h, c in out.state]

        labels = input_ids if labels is None else labels
        real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()  # (B, T)
        labels = labels.masked_fill(~real, IGNORE_INDEX)
        h = out.dropped[-1]  # (B, T, D)
        targets = labels[:, 1:]  # (B, T - 1)
        picked = targets != IGNORE_INDEX
        n_pred = picked.sum()
        logits = self.logits(h[:, :-1][picked])  # (N, V): only predicted positions reach the softmax
        target = targets[picked]  # (N,)
        nll = F.cross_entropy(logits.float(), target, reduction="sum") / n_pred.clamp(min=1)
        correct = (logits.argmax(-1) == target).sum()

        # AR on the dropped, TAR on the undropped output of the last LSTM, over real positions.
        m = real[..., None].to(h.dtype)  # (B, T, 1)
        ar = (h.pow(2) * m).sum() / (m.sum() * h.shape[-1]).clamp(min=1)
        raw = out.raw[-1]  # (B, T, D)
        pair = m[:, 1:] * m[:, :-1]  # (B, T - 1, 1): both positions real
        tar = ((raw[:, 1:] - raw[:, :-1]).pow(2) * pair).sum() / (pair.sum() * raw.shape[-1]).clamp(min=1)
        loss = nll + cfg.ar_alpha * ar + cfg.tar_beta * tar
        metrics = {
            "lm_loss": nll.detach(),
            "lm_acc": (correct.float() / n_pred.clamp(min=1)).detach(),
            "n_pred": n_pred.detach(),
            "ar": ar.detach(),
            "tar": tar.detach(),
        }
        return PretrainOutput(loss, metrics)


# ----------------------------------------------------------------------------- presets

PRESETS: dict[str, AwdLstmConfig] = {
    "tiny": AwdLstmConfig(vocab_size=1000, d_model=64, lstm_dim=128, n_layer=3, bptt=32),
    # ULMFiT's language model (Howard & Ruder 2018, sec. 4): embedding 400, 3 layers, 1150 hidden,
    # BPTT 70, its dropouts; BERT's 30522 WordPiece vocabulary for the softmax (recipes set
    # vocab_size from the tokenizer; the paper used WikiText-103's 267k words, capped to 60k).
    "base": AwdLstmConfig(vocab_size=30522),
}
