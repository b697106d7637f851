"""Distillation (ctxmodels/distill.py): the losses against hand-written formulas, the student's
initialisation, and the Distiller's contract with the training loop (a student-only state dict, a
frozen teacher, a loss that falls)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ctxmodels.distill import (
    DistillWeights,
    Distiller,
    every_other_layer,
    init_student,
    mean_pooled,
    soft_target_loss,
    token_cosine_loss,
)
from ctxmodels.registry import build_model
from tests.ctxmodels.test_flops import family_batch


def _teacher(n_layer: int = 4, family: str = "bert"):
    cfg, model = build_model(family, "tiny", {"vocab_size": 128, "n_layer": n_layer, "nsp": False}, seed=0)
    batch, _ = family_batch(family, cfg)
    return model, batch


def test_soft_target_loss_is_the_tempered_kl_times_t_squared():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    T = 2.5
    q = [[math.exp(x / T) for x in row] for row in t.tolist()]
    q = [[x / sum(row) for x in row] for row in q]
    p = [[math.exp(x / T) for x in row] for row in s.tolist()]
    p = [[x / sum(row) for x in row] for row in p]
    by_hand = sum(qi * (math.log(qi) - math.log(pi)) for qr, pr in zip(q, p) for qi, pi in zip(qr, pr)) / 5 * T * T
    assert soft_target_loss(s, t, T).item() == pytest.approx(by_hand, rel=1e-5)
    # its gradient is the cross-entropy's against the tempered teacher: (p - q) * T / N per logit
    s.requires_grad_()
    soft_target_loss(s, t, T).backward()
    expected = (F.softmax(s.detach() / T, -1) - F.softmax(t / T, -1)) * T / 5
    torch.testing.assert_close(s.grad, expected, rtol=1e-5, atol=1e-7)
    assert soft_target_loss(t, t, T).item() == pytest.approx(0.0, abs=1e-6)


def test_token_cosine_and_mean_pooling_count_real_tokens_only():
    a = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])  # (1, 3, 2)
    b = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [-5.0, 5.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert token_cosine_loss(a, b, mask).item() == pytest.approx(1.0 - (1.0 + 0.0) / 2)
    torch.testing.assert_close(mean_pooled(a, mask), torch.tensor([[0.5, 0.5]]))


def test_the_student_starts_from_exactly_the_chosen_teacher_layers():
    teacher, batch = _teacher(4)
    layers = every_other_layer(4)
    assert layers == [0, 2]
    student = init_student(teacher, layers)
    assert student.cfg.n_layer == 2
    t_state, s_state = teacher.state_dict(), student.state_dict()
    for i, j in enumerate(layers):
        block = {k: v for k, v in s_state.items() if k.startswith(f"backbone.layers.{i}.")}
        assert block
        for name, value in block.items():
            assert torch.equal(value, t_state[name.replace(f"layers.{i}.", f"layers.{j}.", 1)]), name
    for name in s_state:
        if not name.startswith("backbone.layers."):
            assert torch.equal(s_state[name], t_state[name]), name
    with pytest.raises(ValueError, match="ascending"):
        init_student(teacher, [2, 0])
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        init_student(teacher, [0, 4])


@pytest.mark.parametrize("family", ["bert", "xlm"])  # XLM: no MLM transform in the soft targets' head
def test_a_student_of_every_layer_matches_its_teacher_exactly(family):
    teacher, batch = _teacher(2, family)
    teacher.eval()
    distiller = Distiller(init_student(teacher, [0, 1]), teacher, DistillWeights(sentence=1.0)).eval()
    out = distiller(**batch)
    assert out.metrics["soft_loss"].item() == pytest.approx(0.0, abs=1e-6)
    assert out.metrics["cos_loss"].item() == pytest.approx(0.0, abs=1e-6)
    assert out.metrics["sentence_cos"].item() == pytest.approx(1.0, abs=1e-6)
    # the loss is then the student's own MLM loss, weighted, which the plain model computes too
    assert out.loss.item() == pytest.approx(2.0 * teacher(**batch).metrics["mlm_loss"].item(), rel=1e-5)


def test_the_distiller_trains_the_student_alone_and_saves_only_it():
    teacher, batch = _teacher(4)
    student = init_student(teacher, [0, 2])
    distiller = Distiller(student, teacher, DistillWeights(sentence=1.0))
    assert list(distiller.state_dict()) == list(student.state_dict())
    assert all(not n.startswith("_teacher") for n, _ in distiller.named_parameters())
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    opt = torch.optim.AdamW(distiller.parameters(), lr=3e-3)
    torch.manual_seed(0)
    losses = []
    for _ in range(12):
        out = distiller(**batch)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(v, teacher_before[k]) for k, v in teacher.state_dict().items())
    fresh = init_student(teacher, [0, 2])
    fresh.load_state_dict(distiller.state_dict())  # a checkpoint of the distiller is a plain student's
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, student.state_dict()[k])


def test_a_bert_student_exports_as_distilbert_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from ctxmodels.hf import export_distilbert_folder

    transformers.logging.set_verbosity_error()
    teacher, batch = _teacher(4)
    student = init_student(teacher, [1, 3]).eval()
    with torch.no_grad():  # weights away from init, the segment-0 row included, so that folding it matters
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export_distilbert_folder(student, tmp_path)
    ids, mask = batch["input_ids"], batch["attention_mask"].clone()
    mask[1, 15:] = 0  # a padded row too
    theirs = transformers.DistilBertForMaskedLM.from_pretrained(tmp_path).eval()
    bare = transformers.DistilBertModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ours = student.mlm_logits(ids, mask)
        real = mask.bool()
        torch.testing.assert_close(theirs(input_ids=ids, attention_mask=mask).logits[real], ours[real], rtol=1e-4, atol=1e-4)
        hidden = student.backbone.hidden_states(ids, mask)[-1]
        torch.testing.assert_close(bare(input_ids=ids, attention_mask=mask).last_hidden_state[real], hidden[real],
                                   rtol=1e-4, atol=1e-4)


def test_distilbert_export_refuses_what_it_cannot_hold():
    from ctxmodels.hf import to_distilbert

    _, roberta = build_model("roberta", "tiny", {"vocab_size": 128}, seed=0)
    with pytest.raises(ValueError, match="positions are 'roberta'"):
        to_distilbert(roberta)
