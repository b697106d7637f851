"""Knowledge distillation as DistilBERT did it: a shallower student of the teacher's family.

Paper: Sanh, Debut, Chaumond, Wolf. "DistilBERT, a distilled version of BERT: smaller, faster,
cheaper and lighter", 2019 (arXiv:1910.01108), and its reference code in Hugging Face's
``transformers/examples/research_projects/distillation`` (``distiller.py``), read for the losses'
exact forms.

- The student is the teacher's architecture with fewer layers, initialised from teacher layers
  (DistilBERT: every other one, ``student_layers = [0, 2, 4, ...]``); the embeddings and heads are
  copied whole (``init_student``). DistilBERT also drops the token-type embeddings and the pooler;
  here the student keeps the teacher's shape apart from its depth, so it loads, serves, fine-tunes
  and exports wherever the teacher does.
- The loss (``Distiller``) is a weighted sum of
  * ``soft``: the soft-target cross-entropy at temperature ``T`` between the teacher's and the
    student's masked-LM distributions at the masked positions, as KL divergence scaled by ``T**2``
    (the reference's ``KLDivLoss(reduction="batchmean")`` times ``T**2``; the same gradients as
    the cross-entropy, the teacher's entropy being a constant);
  * ``mlm``: the student's own masked-LM loss on the true tokens;
  * ``cos``: ``1 - cos`` between the student's and the teacher's last hidden states at every real
    token (the reference's ``CosineEmbeddingLoss`` with target 1);
  * ``sentence``: ``1 - cos`` between their mean-pooled sentence vectors (the vectors
    ``/v1/embeddings`` serves), for teachers whose use is sentence embeddings.
  The reference's weights are soft 5, mlm 2, cos 1 at ``T = 2``. A teacher with no trained MLM
  head (an embedding model such as all-MiniLM-L6-v2) is distilled through ``cos`` and ``sentence``
  alone: ``soft`` and ``mlm`` must be 0 then (``jobs.training.config.TeacherSection`` checks).
- The teacher runs in inference mode beside the student, on the student's device; it is not a
  submodule of the ``Distiller`` (not trained, not in the state dict, not DDP's), and the
  ``Distiller``'s state dict is the student's own, so checkpoints hold a plain student.

Families: those of ``ctxmodels.bert.BertForPreTraining`` (bert, roberta, spanbert).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ctxmodels.bert import IGNORE_INDEX, BertForPreTraining
from ctxmodels.ops import masked_lm_loss
from ctxmodels.outputs import PretrainOutput


@dataclass(frozen=True)
class DistillWeights:
    """The loss's terms and temperature (see the module docstring)."""

    temperature: float = 2.0
    soft: float = 5.0
    mlm: float = 2.0
    cos: float = 1.0
    sentence: float = 0.0


def every_other_layer(n_layer: int) -> list[int]:
    """DistilBERT's choice: teacher layers 0, 2, 4, ... (half the depth, rounded up)."""
    return list(range(0, n_layer, 2))


def init_student(teacher: nn.Module, layers: list[int]) -> BertForPreTraining:
    """A student with ``len(layers)`` blocks: block ``i`` a copy of teacher block ``layers[i]``, the
    embeddings, pooler and heads copies of the teacher's. ``layers``: distinct, ascending, each in
    ``[0, teacher n_layer)``."""
    if not isinstance(teacher, BertForPreTraining):
        raise ValueError(f"distillation takes a BERT-family teacher (bert, roberta, spanbert), not {type(teacher).__name__}")
    if teacher.cfg.causal:
        raise ValueError("distillation trains on masked-LM batches; a causal XLM teacher (objective clm) predicts the next token")
    n = teacher.cfg.n_layer
    if not layers or sorted(set(layers)) != list(layers) or layers[0] < 0 or layers[-1] >= n:
        raise ValueError(f"student layers must be distinct teacher layers in ascending order, each in [0, {n}); got {layers}")
    student = BertForPreTraining(replace(teacher.cfg, n_layer=len(layers)))
    state = {}
    for name, value in teacher.state_dict().items():
        if name.startswith("backbone.layers."):
            index, rest = name[len("backbone.layers."):].split(".", 1)
            if int(index) not in layers:
                continue
            name = f"backbone.layers.{layers.index(int(index))}.{rest}"
        state[name] = value.detach().clone()
    student.load_state_dict(state, strict=True)
    return student


def soft_target_loss(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tensor:
    """KL(softmax(teacher / T) || softmax(student / T)) summed over the vocabulary, mean over rows,
    times ``T**2``; (N, V) logits each, computed in float32."""
    t = temperature
    log_p = F.log_softmax(student_logits.float() / t, dim=-1)
    q = F.softmax(teacher_logits.float() / t, dim=-1)
    return F.kl_div(log_p, q, reduction="batchmean") * (t * t)


def token_cosine_loss(student: Tensor, teacher: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of ``1 - cos`` between (B, T, D) hidden states at the tokens where ``mask`` (B, T) is 1."""
    cos = F.cosine_similarity(student.float(), teacher.float(), dim=-1)  # (B, T)
    if mask is None:
        return 1.0 - cos.mean()
    m = mask.to(cos.dtype)
    return 1.0 - (cos * m).sum() / m.sum().clamp(min=1.0)


def mean_pooled(hidden: Tensor, mask: Tensor | None) -> Tensor:
    """(B, D) mean of (B, T, D) hidden states over the real tokens (the sentence vector served)."""
    if mask is None:
        return hidden.float().mean(1)
    m = mask.unsqueeze(-1).float()
    return (hidden.float() * m).sum(1) / m.sum(1).clamp(min=1.0)


class Distiller(nn.Module):
    """The student trained against a frozen teacher: ``forward(**batch) -> PretrainOutput`` as a
    pretraining model's, its loss the weighted sum of ``DistillWeights``' terms, its metrics each
    term (``soft_loss``, ``mlm_loss``, ``cos_loss``, ``sentence_cos``: the mean cosine of the two
    sentence vectors) and ``n_pred``. ``state_dict``/``load_state_dict`` are the student's."""

    def __init__(self, student: BertForPreTraining, teacher: BertForPreTraining, weights: DistillWeights):
        super().__init__()
        if teacher.cfg.vocab_size != student.cfg.vocab_size or teacher.cfg.d_model != student.cfg.d_model:
            raise ValueError("teacher and student must share the vocabulary and the hidden size")
        self.student = student
        self.weights = weights
        self._teacher = [teacher.eval().requires_grad_(False)]  # a list: not a submodule

    @property
    def teacher(self) -> BertForPreTraining:
        return self._teacher[0]

    def state_dict(self, *args, **kwargs):
        return self.student.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.student.load_state_dict(state_dict, strict=strict, assign=assign)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                labels: Tensor | None = None, **_unused) -> PretrainOutput:
        w, student = self.weights, self.student
        teacher = self.teacher
        if next(teacher.parameters()).device != input_ids.device:
            teacher.to(input_ids.device)  # follows the student to its device, once
        teacher.eval()
        with torch.no_grad():
            t_last = teacher.backbone.hidden_states(input_ids, attention_mask, token_type_ids)[-1]  # (B, T, D)
        s_last = student.backbone.hidden_states(input_ids, attention_mask, token_type_ids)[-1]  # (B, T, D)
        metrics: dict[str, Tensor] = {}
        loss = s_last.new_zeros((), dtype=torch.float32)

        if labels is not None and (w.soft > 0 or w.mlm > 0):
            selected = labels.ne(IGNORE_INDEX)  # (B, T)
            word = student.backbone.embeddings.word.weight  # (V, D)
            h = student.mlm.transform(s_last[selected])  # (N, D)
            target = labels[selected]  # (N,)
            metrics["n_pred"] = torch.tensor(target.numel(), device=s_last.device)
            if w.mlm > 0:
                mlm, n_correct = masked_lm_loss(h, word, student.mlm.bias, target)
                loss = loss + w.mlm * mlm
                metrics.update(mlm_loss=mlm.detach(), mlm_acc=(n_correct.float() / max(target.numel(), 1)).detach())
            if w.soft > 0:
                with torch.no_grad():
                    t_logits = teacher.mlm(t_last[selected], teacher.backbone.embeddings.word.weight)  # (N, V)
                soft = soft_target_loss(F.linear(h, word, student.mlm.bias), t_logits, w.temperature)
                loss = loss + w.soft * soft
                metrics["soft_loss"] = soft.detach()
        if w.cos > 0:
            cos = token_cosine_loss(s_last, t_last, attention_mask)
            loss = loss + w.cos * cos
            metrics["cos_loss"] = cos.detach()
        s_vec = F.normalize(mean_pooled(s_last, attention_mask), dim=-1)
        t_vec = F.normalize(mean_pooled(t_last, attention_mask), dim=-1)
        sentence_cos = (s_vec * t_vec).sum(-1).mean()
        if w.sentence > 0:
            loss = loss + w.sentence * (1.0 - sentence_cos)
        metrics["sentence_cos"] = sentence_cos.detach()
        metrics["distill_loss"] = loss.detach()
        return PretrainOutput(loss=loss, metrics=metrics)
