"""ELMo: a character-CNN token encoder under a bidirectional LSTM language model.

Peters et al. 2018, "Deep contextualized word representations" (NAACL), built on the biLM of
Jozefowicz et al. 2016, "Exploring the limits of language modeling". Checked against the
reference code allenai/bilm-tf (``bilm/model.py``, ``bilm/training.py``) and AllenNLP's
``modules/elmo.py`` / ``modules/scalar_mix.py``.

Shape legend:
    B  batch                      T  tokens per row
    C  chars per token (max_chars) E  char embedding dim (char_embed_dim)
    F  total conv filters          D  d_model (LSTM projection and token representation width)
    H  LSTM cell size (lstm_dim)   V  vocab_size (softmax)
    L  n_layer (biLSTM layers per direction)

Project-specific choices:
* ELMo's "words" are the tokenizer's pieces. Character ids per piece come from
  ``pipelines.char_ids`` (``table[input_ids]``); the model stores nothing about the vocabulary but
  ``vocab_size``, so serving rebuilds the same table from the checkpoint's tokenizer.
* Full softmax over the piece vocabulary (the paper used a sampled softmax over 793k words).
* ``hidden_states`` returns tensors of width 2*D ([forward; backward]); index 0 is the token
  representation duplicated, [x; x], so every layer has the same width, as in the paper.
* Attention masks must be right-padded (real tokens first): the backward LM reverses each row
  within its real length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from ctxmodels.ops import Dropout
from ctxmodels.outputs import PretrainOutput

# (width, n_filters) of the paper's char CNN: 2048 filters in all (bilm-tf options file).
PAPER_FILTERS = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))


@dataclass
class ElmoConfig:
    vocab_size: int  # softmax size: the tokenizer's vocabulary (pieces, not words)
    max_chars: int = 50  # chars per token incl. word markers; must equal the char table's width
    char_vocab_size: int = 262  # 256 bytes + 5 markers + masking id 0 (pipelines.char_ids)
    char_embed_dim: int = 16
    filters: tuple[tuple[int, int], ...] = PAPER_FILTERS  # (width, n_filters) per convolution
    n_highway: int = 2
    activation: Literal["relu", "tanh"] = "relu"  # after max-pooling; the released ELMo uses relu
    d_model: int = 512  # projection of the char CNN and of every LSTM (paper: 512)
    lstm_dim: int = 4096  # LSTM cell size (paper: 4096)
    n_layer: int = 2  # LSTM layers per direction
    dropout: float = 0.1
    cell_clip: float | None = 3.0  # clip the LSTM cell to [-3, 3] as bilm-tf; None: fused kernel
    proj_clip: float | None = 3.0  # clip the projected output; both None selects nn.LSTM's kernel
    tie_softmax: bool = True  # one softmax for both directions (paper Sec. 3.1)

    def __post_init__(self) -> None:
        # config.json stores tuples as lists: normalise so equality and hashing behave.
        self.filters = tuple((int(w), int(n)) for w, n in self.filters)
        for key in ("vocab_size", "max_chars", "char_vocab_size", "char_embed_dim", "d_model", "lstm_dim", "n_layer"):
            if getattr(self, key) < 1:
                raise ValueError(f"ElmoConfig.{key}={getattr(self, key)} must be positive")
        if not self.filters:
            raise ValueError("ElmoConfig.filters is empty: give at least one (width, n_filters)")
        for width, n in self.filters:
            if not 1 <= width <= self.max_chars or n < 1:
                raise ValueError(f"ElmoConfig.filters has ({width}, {n}): need 1 <= width <= max_chars and n >= 1")
        if self.activation not in ("relu", "tanh"):
            raise ValueError(f"ElmoConfig.activation={self.activation!r}: expected 'relu' or 'tanh'")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ElmoConfig.dropout={self.dropout} must be in [0, 1)")


# ----------------------------------------------------------------------------- token encoder


class Highway(nn.Module):
    """y = t * relu(W_h x) + (1 - t) * x with t = sigmoid(W_t x) (Srivastava et al. 2015)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 2 * dim)
        with torch.no_grad():
            self.proj.bias[dim:].fill_(-2.0)  # transform gate starts mostly closed: a near-identity layer (bilm-tf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, t = self.proj(x).chunk(2, dim=-1)  # (N, F) each
        t = torch.sigmoid(t)
        return t * F.relu(h) + (1.0 - t) * x


class CharCNN(nn.Module):
    """Context-independent token representation x from the characters of each token."""

    def __init__(self, cfg: ElmoConfig):
        super().__init__()
        self.char_embed = nn.Embedding(cfg.char_vocab_size, cfg.char_embed_dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(cfg.char_embed_dim, n, width) for width, n in cfg.filters)
        self.act = F.relu if cfg.activation == "relu" else torch.tanh
        n_filters = sum(n for _, n in cfg.filters)
        self.highways = nn.ModuleList(Highway(n_filters) for _ in range(cfg.n_highway))
        self.proj = nn.Linear(n_filters, cfg.d_model)

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        B, T, C = char_ids.shape
        e = self.char_embed(char_ids.reshape(B * T, C))  # (B*T, C, E)
        e = e.transpose(1, 2)  # (B*T, E, C): Conv1d wants channels first
        # Max over char positions, then the activation (monotone, so the order does not matter).
        h = torch.cat([self.act(conv(e).amax(dim=-1)) for conv in self.convs], dim=-1)  # (B*T, F)
        for highway in self.highways:
            h = highway(h)
        return self.proj(h).reshape(B, T, -1)  # (B, T, D)


# ----------------------------------------------------------------------------- biLSTM


class ProjectedLSTM(nn.Module):
    """One unidirectional LSTM layer with an output projection (LSTMP, Sak et al. 2014) and the
    optional cell/projection clipping of bilm-tf.

    The parameters are those of ``nn.LSTM(proj_size=...)``. Without clipping we call its fused
    kernel; with clipping we step through time in Python (clipping sits inside the recurrence),
    using the same parameters, so a checkpoint loads either way. State is carried unchanged over
    padding, so the returned final state is the state after each row's last real token.
    """

    def __init__(self, d_in: int, cell: int, proj: int, cell_clip: float | None, proj_clip: float | None):
        super().__init__()
        self.lstm = nn.LSTM(d_in, cell, batch_first=True, proj_size=proj)
        self.cell_clip, self.proj_clip = cell_clip, proj_clip
        with torch.no_grad():  # forget-gate bias 1, as TF's LSTMCell adds (gate order i, f, g, o)
            self.lstm.bias_ih_l0[cell : 2 * cell].fill_(1.0)
            self.lstm.bias_hh_l0[cell : 2 * cell].zero_()

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x (B, T, d_in), mask (B, T) bool, state (h (B, D), c (B, H)) -> out (B, T, D), state."""
        B = x.shape[0]
        if state is None:
            state = (x.new_zeros(B, self.lstm.proj_size), x.new_zeros(B, self.lstm.hidden_size))
        if self.cell_clip is None and self.proj_clip is None:
            return self._fused(x, mask, state)
        return self._stepwise(x, mask, state)

    def _fused(self, x, mask, state):
        h0, c0 = state[0].unsqueeze(0), state[1].unsqueeze(0)  # (1, B, D), (1, B, H)
        if bool(mask.all()):
            out, (h, c) = self.lstm(x, (h0, c0))  # (B, T, D)
            return out, (h[0], c[0])
        lengths = mask.sum(dim=1)  # (B,)
        # pack_padded_sequence rejects empty rows: run them for one step and keep their input state.
        packed = pack_padded_sequence(x, lengths.clamp(min=1).cpu(), batch_first=True, enforce_sorted=False)
        out, (h, c) = self.lstm(packed, (h0, c0))
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])  # (B, T, D)
        empty = (lengths == 0)[:, None]  # (B, 1)
        return out * mask[..., None], (torch.where(empty, state[0], h[0]), torch.where(empty, state[1], c[0]))

    def _stepwise(self, x, mask, state):
        lstm = self.lstm
        h, c = state  # (B, D), (B, H)
        gates_x = F.linear(x, lstm.weight_ih_l0, lstm.bias_ih_l0 + lstm.bias_hh_l0)  # (B, T, 4H), all steps at once
        outs = []
        for t in range(x.shape[1]):
            i, f, g, o = (gates_x[:, t] + h @ lstm.weight_hh_l0.T).chunk(4, dim=-1)  # (B, H) each
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            if self.cell_clip is not None:
                c_new = c_new.clamp(-self.cell_clip, self.cell_clip)
            h_new = (torch.sigmoid(o) * torch.tanh(c_new)) @ lstm.weight_hr_l0.T  # (B, D)
            if self.proj_clip is not None:
                h_new = h_new.clamp(-self.proj_clip, self.proj_clip)
            m = mask[:, t, None]  # (B, 1)
            h, c = torch.where(m, h_new, h), torch.where(m, c_new, c)
            outs.append(h_new * m)
        return torch.stack(outs, dim=1), (h, c)  # (B, T, D)


def reverse_within_length(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Reverse each row's first ``lengths[b]`` positions, leaving the padding in place.

    x (B, T, ...) right-padded, lengths (B,). Its own inverse.
    """
    T = x.shape[1]
    t = torch.arange(T, device=x.device)[None, :]  # (1, T)
    n = lengths[:, None]  # (B, 1)
    idx = torch.where(t < n, n - 1 - t, t)  # (B, T)
    idx = idx.reshape(*idx.shape, *([1] * (x.dim() - 2))).expand_as(x)  # (B, T, ...)
    return x.gather(1, idx)


class BiLMOutput(NamedTuple):
    x: torch.Tensor  # (B, T, D) token representation, zero at padding
    fwd: list[torch.Tensor]  # L tensors (B, T, D): forward LM layers
    bwd: list[torch.Tensor]  # L tensors (B, T, D): backward LM layers, in original token order
    fwd_state: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (h (B, D), c (B, H)) after the last real token


class ElmoModel(nn.Module):
    """The biLM backbone: shared char CNN, then L LSTM layers per direction (separate parameters)."""

    def __init__(self, cfg: ElmoConfig):
        super().__init__()
        self.config = cfg
        self.token_embedder = CharCNN(cfg)

        def stack() -> nn.ModuleList:
            return nn.ModuleList(
                ProjectedLSTM(cfg.d_model, cfg.lstm_dim, cfg.d_model, cfg.cell_clip, cfg.proj_clip) for _ in range(cfg.n_layer)
            )

        self.fwd_lstms, self.bwd_lstms = stack(), stack()
        self.drop = Dropout(cfg.dropout)

    def _direction(self, lstms: nn.ModuleList, x, mask, state):
        outs, new_state, h = [], [], x
        for k, lstm in enumerate(lstms):
            y, s = lstm(self.drop(h), mask, None if state is None else state[k])  # (B, T, D)
            if k > 0:
                y = y + h  # residual from layer k's input to its output (paper Sec. 3.4 / bilm-tf skip connections)
            outs.append(y)
            new_state.append(s)
            h = y
        return outs, new_state

    def forward(
        self,
        char_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        fwd_state: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> BiLMOutput:
        """char_ids (B, T, C), attention_mask (B, T) right-padded; fwd_state: initial forward state."""
        B, T, _ = char_ids.shape
        if attention_mask is None:
            mask = torch.ones(B, T, dtype=torch.bool, device=char_ids.device)
        else:
            mask = attention_mask.bool()
            if bool((mask[:, 1:] > mask[:, :-1]).any()):
                raise ValueError("ELMo needs right-padded attention_mask (real tokens first, then padding)")
        lengths = mask.sum(dim=1)  # (B,)
        x = self.token_embedder(char_ids) * mask[..., None]  # (B, T, D)
        fwd, fwd_state = self._direction(self.fwd_lstms, x, mask, fwd_state)
        # The backward LM reads each row right to left from its last real token. It cannot carry state
        # across batches: its initial state would have to come from the *next* chunk of the stream.
        bwd_rev, _ = self._direction(self.bwd_lstms, reverse_within_length(x, lengths), mask, None)
        bwd = [reverse_within_length(h, lengths) for h in bwd_rev]
        return BiLMOutput(x, fwd, bwd, fwd_state)

    def hidden_states(
        self, char_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """L + 1 tensors (B, T, 2D): [x; x], then [h_fwd_k; h_bwd_k]. ``token_type_ids`` is ignored."""
        out = self(char_ids, attention_mask)
        return [torch.cat([out.x, out.x], dim=-1)] + [torch.cat([f, b], dim=-1) for f, b in zip(out.fwd, out.bwd)]

    def elmo_representation(
        self, char_ids: torch.Tensor, attention_mask: torch.Tensor | None, mix: ScalarMix
    ) -> torch.Tensor:
        """The task-specific ELMo vector (paper eq. 1): (B, T, 2D)."""
        return mix(self.hidden_states(char_ids, attention_mask))


class ScalarMix(nn.Module):
    """ELMo_k = gamma * sum_j softmax(s)_j h_{k,j} (paper eq. 1), s and gamma learned by the task.

    ``do_layer_norm`` normalises each layer per token over its features (Ba et al. 2016) before the
    weighted sum. AllenNLP normalises with statistics over the whole batch instead; per-token keeps a
    token's vector independent of the rest of the batch.
    """

    def __init__(self, n_layers: int, do_layer_norm: bool = False):
        super().__init__()
        self.scalars = nn.Parameter(torch.zeros(n_layers))  # uniform weights at start
        self.gamma = nn.Parameter(torch.ones(()))
        self.do_layer_norm = do_layer_norm

    def forward(self, hidden_states: list[torch.Tensor]) -> torch.Tensor:
        if len(hidden_states) != self.scalars.numel():
            raise ValueError(f"ScalarMix built for {self.scalars.numel()} layers got {len(hidden_states)}")
        weights = torch.softmax(self.scalars, dim=0)  # (L+1,)
        if self.do_layer_norm:
            hidden_states = [F.layer_norm(h, h.shape[-1:]) for h in hidden_states]
        return self.gamma * sum(w * h for w, h in zip(weights, hidden_states))  # (B, T, 2D)


# ----------------------------------------------------------------------------- pretraining


def init_elmo_weights(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """PyTorch's default initialisations, which the biLM was always trained from, drawn from
    ``generator``: Linear and Conv1d U(-1/sqrt(fan_in), +) for weights and biases (what
    kaiming_uniform(a=sqrt(5)) gives), Embedding N(0, 1) with the padding row zero, LSTM
    U(-1/sqrt(hidden), +) everywhere; then the highway gates' bias -2 (bilm-tf)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d)):
            bound = 1.0 / math.sqrt(m.weight[0].numel())  # fan_in: in_features, or in_channels * width
            nn.init.uniform_(m.weight, -bound, bound, generator=generator)
            if m.bias is not None:
                nn.init.uniform_(m.bias, -bound, bound, generator=generator)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, generator=generator)
            if m.padding_idx is not None:
                nn.init.zeros_(m.weight[m.padding_idx])
        elif isinstance(m, nn.LSTM):
            bound = 1.0 / math.sqrt(m.hidden_size)
            for p in m.parameters():
                nn.init.uniform_(p, -bound, bound, generator=generator)
    for m in model.modules():
        if isinstance(m, Highway):
            with torch.no_grad():
                m.proj.bias[m.proj.bias.shape[0] // 2 :].fill_(-2.0)


class ElmoForPreTraining(nn.Module):
    """Forward LM predicts token t+1 from tokens <= t; backward LM predicts t-1 from tokens >= t.

    loss = forward NLL + backward NLL (each a mean over predicted tokens); metrics ``lm_loss`` (their
    mean), ``fwd_loss``, ``bwd_loss``, ``lm_acc``, ``n_pred`` (predictions per direction).

    With ``reset_memory`` (B,) given, the forward LSTM state is carried from the previous call
    (truncated BPTT, as bilm-tf trains on a stream in 20-token windows): rows with
    ``reset_memory == 1`` start from zero state. Without it every call starts from zero. The first
    token of a call is never a forward target (its predictor was the previous call's last position),
    nor the last token a backward target. Call ``clear_memory`` before evaluating on other data.
    """

    def __init__(self, cfg: ElmoConfig, generator: torch.Generator | None = None):
        super().__init__()
        self.config = cfg
        self.backbone = ElmoModel(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)
        self.lm_head_bwd = None if cfg.tie_softmax else nn.Linear(cfg.d_model, cfg.vocab_size)
        self.drop = Dropout(cfg.dropout)
        self.fwd_memory: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # not a parameter: never saved
        init_elmo_weights(self, generator)

    def clear_memory(self) -> None:
        """Forget the carried forward state (e.g. before evaluation or when the data stream restarts)."""
        self.fwd_memory = None

    def _initial_state(self, reset_memory: torch.Tensor):
        if self.fwd_memory is None or bool((reset_memory != 0).all()):  # nothing carried over: zero state
            return None
        B = reset_memory.shape[0]
        if self.fwd_memory[0][0].shape[0] != B:
            raise ValueError(
                f"reset_memory has {B} rows but the carried state has {self.fwd_memory[0][0].shape[0]}: "
                "stream-ordered batches need a constant batch size (or reset_memory=1 on every row)"
            )
        keep = (reset_memory == 0)[:, None]  # (B, 1)
        # the state is a plain attribute, not a buffer: after model.to(device) it is still where it was made
        return [(torch.where(keep, h.to(keep.device), 0.0), torch.where(keep, c.to(keep.device), 0.0)) for h, c in self.fwd_memory]

    def forward(
        self,
        char_ids: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        reset_memory: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> PretrainOutput:
        """char_ids (B, T, C), input_ids (B, T) targets, attention_mask (B, T), reset_memory (B,)."""
        state = None if reset_memory is None else self._initial_state(reset_memory)
        out = self.backbone(char_ids, attention_mask, fwd_state=state)
        if reset_memory is not None:
            self.fwd_memory = [(h.detach(), c.detach()) for h, c in out.fwd_state]

        B, T = input_ids.shape
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        valid = mask[:, 1:]  # (B, T-1): right padding, so t+1 real implies t real
        n_pred = valid.sum()
        denom = n_pred.clamp(min=1)
        head_bwd = self.lm_head if self.lm_head_bwd is None else self.lm_head_bwd

        def nll_and_correct(head: nn.Linear, h: torch.Tensor, targets: torch.Tensor):
            logits = head(self.drop(h)[valid])  # (N, V): only predicted positions reach the softmax
            target = targets[valid]  # (N,)
            nll = F.cross_entropy(logits.float(), target, reduction="sum") / denom
            return nll, (logits.argmax(dim=-1) == target).sum()

        fwd_loss, fwd_correct = nll_and_correct(self.lm_head, out.fwd[-1][:, :-1], input_ids[:, 1:])
        bwd_loss, bwd_correct = nll_and_correct(head_bwd, out.bwd[-1][:, 1:], input_ids[:, :-1])
        loss = fwd_loss + bwd_loss
        metrics = {
            "lm_loss": (loss / 2).detach(),
            "fwd_loss": fwd_loss.detach(),
            "bwd_loss": bwd_loss.detach(),
            "lm_acc": ((fwd_correct + bwd_correct).float() / (2 * denom)).detach(),
            "n_pred": n_pred.detach(),
        }
        return PretrainOutput(loss, metrics)


# ----------------------------------------------------------------------------- presets

PRESETS: dict[str, ElmoConfig] = {
    "tiny": ElmoConfig(
        vocab_size=1000, filters=((1, 8), (2, 8), (3, 16)), n_highway=1, d_model=32, lstm_dim=64, n_layer=2
    ),
    # The paper's biLM (ELMo "Original", 2x4096_512_2048cnn_2xhighway) with BERT's 30522 WordPiece
    # vocabulary for the softmax; recipes set vocab_size from the tokenizer. Without the softmax it has
    # 93.67M parameters: the 93.6M AllenNLP quotes for its release, which ships no softmax (nn.LSTM
    # keeps two bias vectors per layer, +65k). The paper's 793,471-word softmax adds 407M; ours 15.7M.
    "base": ElmoConfig(vocab_size=30522),
}
