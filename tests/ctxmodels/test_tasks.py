"""Task models: every family x every task kind runs; BERT-family heads equal transformers' heads on
the same weights; GPT's auxiliary LM loss and ELMo's scalar mix behave as their papers say; a task
model learns and round-trips through a checkpoint."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from ctxmodels.checkpoint import load_checkpoint, save_checkpoint
from ctxmodels.features import FEATURE_STRATEGIES, combine_layers, combined_width, n_combined
from ctxmodels.hf import load_hf_folder
from ctxmodels.registry import FAMILIES, make_config
from ctxmodels.tasks import TASK_KINDS, TaskConfig, build_task_model, load_backbone

transformers.logging.set_verbosity_error()
B, T, V = 3, 10, 100


def batch_for(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (B, 4, T) if kind in ("multiple-choice", "embedding") else (B, T)  # embedding: anchor, positive, 2 negatives
    ids = torch.randint(5, V, shape, generator=g)
    mask = torch.ones(shape, dtype=torch.long)
    mask[1, ..., 7:] = 0  # one padded row
    ids = ids.masked_fill(mask == 0, 0)
    out = {"input_ids": ids, "attention_mask": mask}
    if kind == "classification":
        out["labels"] = torch.tensor([0, 2, 1])
    elif kind == "regression":
        out["labels"] = torch.rand(B, generator=g)
    elif kind == "multiple-choice":
        out["labels"] = torch.tensor([0, 1, 3])
    elif kind == "token-classification":
        out["labels"] = torch.randint(0, 3, (B, T), generator=g).masked_fill(mask == 0, -100)
    elif kind == "embedding":
        pass  # each anchor's positive is its own record's; no targets
    else:
        out["start_positions"], out["end_positions"] = torch.tensor([1, 2, 3]), torch.tensor([2, 2, 5])
    return out


def tiny_task(family: str, kind: str, **task) -> torch.nn.Module:
    cfg = make_config(family, "tiny", {"vocab_size": V})
    model = build_task_model(family, cfg, TaskConfig(kind=kind, num_labels=3, **task), torch.Generator().manual_seed(0))
    if family == "elmo":
        model.set_char_table(torch.randint(1, 200, model.char_table.shape, generator=torch.Generator().manual_seed(1)))
    return model


EXPECTED_SHAPES = {"classification": (B, 3), "regression": (B,), "multiple-choice": (B, 4),
                   "token-classification": (B, T, 3), "question-answering": (B, T, 2)}


@pytest.mark.parametrize("kind", TASK_KINDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_and_kind_trains(family, kind):
    if kind == "embedding" and family == "elmo":  # feature-based: its biLM's vectors are not what it trains
        with pytest.raises(ValueError, match="features and freeze"):
            tiny_task(family, kind)
        return
    model = tiny_task(family, kind).train()
    out = model(**batch_for(kind))
    width = getattr(model.cfg, "d_model")
    assert tuple(out.logits.shape) == {**EXPECTED_SHAPES, "embedding": (B, 4, width)}[kind]
    assert torch.isfinite(out.loss) and "task_loss" in out.metrics
    out.loss.backward()
    if kind == "embedding":  # no head: the backbone's own weights learn
        grads = [p.grad for n, p in model.named_parameters() if p.grad is not None]
        assert grads and sum(float(g.abs().sum()) for g in grads) > 0
        return
    head = model.qa_outputs if kind == "question-answering" else model.classifier
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0


def test_symmetric_pairs_add_both_orders():
    model = tiny_task("gpt", "classification", symmetric=True, lm_weight=0.0).eval()
    b = batch_for("classification")
    both = torch.stack([b["input_ids"], b["input_ids"].flip(0)], dim=1)  # (B, 2, T)
    mask = torch.stack([b["attention_mask"], b["attention_mask"].flip(0)], dim=1)
    out = model(input_ids=both, attention_mask=mask)
    v = model.sequence_vector(both.reshape(-1, T), mask.reshape(-1, T)).view(B, 2, -1).sum(1)
    torch.testing.assert_close(out.logits, model.classifier(v))
    swapped = model(input_ids=both.flip(1), attention_mask=mask.flip(1))
    torch.testing.assert_close(out.logits, swapped.logits)  # order-free by construction


def test_gpt_auxiliary_lm_loss_is_added_and_reaches_the_embeddings():
    b = batch_for("classification")
    with_lm = tiny_task("gpt", "classification", lm_weight=0.5, dropout=0.0).eval()
    out = with_lm(**b)
    assert out.loss.item() == pytest.approx(out.metrics["task_loss"].item() + 0.5 * out.metrics["lm_loss"].item(), rel=1e-5)
    without = tiny_task("gpt", "classification", lm_weight=0.0, dropout=0.0).eval()
    out0 = without(**b)
    assert "lm_loss" not in out0.metrics and out0.loss.item() == pytest.approx(out0.metrics["task_loss"].item())
    # the LM term's gradient reaches the (tied) token embedding beyond what the task loss gives
    lm = with_lm._lm_loss(b["input_ids"], b["attention_mask"])
    (g,) = torch.autograd.grad(lm, with_lm.backbone.tok_emb.weight)
    assert g.abs().sum() > 0


def test_elmo_is_feature_based_and_its_scalar_mix_learns():
    model = tiny_task("elmo", "token-classification").train()
    assert model.task.freeze and model.task.features == "scalar-mix" and model.task.task_model == "bilstm"
    assert not any(p.requires_grad for p in model.backbone.parameters())
    before_mix = model.mix.scalars.detach().clone()
    before_lstm = next(model.backbone.parameters()).detach().clone()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    b = batch_for("token-classification")
    for _ in range(5):
        opt.zero_grad()
        model(**b).loss.backward()
        opt.step()
    assert not torch.equal(model.mix.scalars.detach(), before_mix)  # s moved
    assert torch.equal(next(model.backbone.parameters()).detach(), before_lstm)  # biLM frozen


def test_feature_strategies_on_hand_built_states():
    states = [torch.full((1, 2, 3), float(i)) for i in range(7)]  # embeddings + 6 blocks
    expect = {"first": 0.0, "last": 6.0, "second-to-last": 5.0, "sum-last-four": 3 + 4 + 5 + 6.0,
              "sum-all": float(sum(range(7))), "scalar-mix": 3.0}
    for name, value in expect.items():
        got = combine_layers(states, name)
        assert got.shape == (1, 2, 3) and torch.all(got == value), name
    cat = combine_layers(states, "concat-last-four")
    assert cat.shape == (1, 2, 12) and cat[0, 0].tolist() == [3.0] * 3 + [4.0] * 3 + [5.0] * 3 + [6.0] * 3
    assert [n_combined(s) for s in FEATURE_STRATEGIES].count(4) == 1
    with pytest.raises(ValueError, match="unknown feature strategy"):
        combine_layers(states, "middle")


@pytest.mark.parametrize("widths", [[3] * 7, [3, 5, 5, 3], [3, 5]], ids=["equal", "awd-lstm", "one-block"])
def test_combined_width_is_the_width_combine_layers_gives_or_says_why_not(widths):
    states = [torch.full((1, 2, w), float(i)) for i, w in enumerate(widths)]
    for name in FEATURE_STRATEGIES:
        try:
            width = combined_width(name, widths)
        except ValueError as e:
            assert len(set(widths)) > 1 and "adds layers of different widths" in str(e), (name, e)
            with pytest.raises(RuntimeError):  # what the refusal saves the caller from
                combine_layers(states, name)
            continue
        assert combine_layers(states, name).shape[-1] == width, name


@pytest.mark.parametrize("features", ["sum-last-four", "concat-last-four"])
def test_any_family_can_be_used_feature_based(features):
    model = tiny_task("bert", "token-classification", freeze=True, features=features, task_model="bilstm").train()
    out = model(**batch_for("token-classification"))
    out.loss.backward()
    assert all(p.grad is None for p in model.backbone.parameters())
    assert model.encoder.lstm.weight_ih_l0.grad is not None


# ---------------------------------------------------------------------------------------------
# Parity with transformers' heads (same weights, eval mode)


def minilm_task(minilm_dir, kind: str, n: int):
    family, cfg, pretrained = load_hf_folder(minilm_dir)
    ours = build_task_model(family, cfg, TaskConfig(kind=kind, num_labels=n), torch.Generator().manual_seed(0))
    load_backbone(ours, pretrained)
    return ours.eval()


HF_HEADS = {
    "classification": (transformers.BertForSequenceClassification, "classifier"),
    "token-classification": (transformers.BertForTokenClassification, "classifier"),
    "question-answering": (transformers.BertForQuestionAnswering, "qa_outputs"),
    "multiple-choice": (transformers.BertForMultipleChoice, "classifier"),
}


@pytest.mark.parametrize("kind", sorted(HF_HEADS))
def test_bert_heads_equal_transformers_on_minilm(minilm_dir, kind, caplog):
    cls, head = HF_HEADS[kind]
    n = {"classification": 3, "token-classification": 5}.get(kind, 2)
    with caplog.at_level(logging.ERROR):
        ours = minilm_task(minilm_dir, kind, n)
    ref = cls.from_pretrained(minilm_dir, num_labels=n).eval()
    with torch.no_grad():
        getattr(ref, head).weight.copy_(getattr(ours, head).weight)
        getattr(ref, head).bias.copy_(getattr(ours, head).bias)
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    texts = ["the bank of the river", "he cashed a check at the bank on the corner", "a bank"]
    enc = tok(texts, ["money", "water flows", "a building"], padding=True, return_tensors="pt")
    if kind == "multiple-choice":
        enc = {k: torch.stack([v, v.flip(0)], dim=1) for k, v in enc.items()}  # (B, 2, T)
    with torch.no_grad():
        got = ours(**enc).logits
        want = ref(**enc)
    if kind == "question-answering":
        want = torch.stack([want.start_logits, want.end_logits], dim=-1)
        real = enc["attention_mask"].bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)
    elif kind == "token-classification":
        real = enc["attention_mask"].bool()
        torch.testing.assert_close(got[real], want.logits[real], atol=1e-4, rtol=0)
    else:
        torch.testing.assert_close(got, want.logits, atol=1e-4, rtol=0)


def test_roberta_classification_head_equals_transformers(tmp_path, caplog):
    hf_cfg = transformers.RobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=64, max_position_embeddings=40, num_labels=3)
    torch.manual_seed(0)
    ref = transformers.RobertaForSequenceClassification(hf_cfg).eval()
    ref.save_pretrained(tmp_path)
    with caplog.at_level(logging.ERROR):
        family, cfg, pretrained = load_hf_folder(tmp_path)
    assert family == "roberta"
    ours = build_task_model(family, cfg, TaskConfig(kind="classification", num_labels=3)).eval()
    load_backbone(ours, pretrained)
    with torch.no_grad():  # HF's classifier.dense/out_proj are our pooler and classifier
        ours.backbone.pooler.load_state_dict(ref.classifier.dense.state_dict())
        ours.classifier.load_state_dict(ref.classifier.out_proj.state_dict())
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 0
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 7:] = 0
    ids = ids.masked_fill(mask == 0, 1)
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["classification", "token-classification", "question-answering"])
def test_pair_segment_ids_reach_bert_but_not_roberta_or_xlm(kind):
    """Fine-tuning inputs give a pair's second text segment 1 (``pipelines.finetune``). BERT reads
    it; RoBERTa has one segment row (a 1 used to fail with IndexError) and XLM's rows are
    languages, so both read the pair as HF's tokenizers give it to them: without segments."""
    b = batch_for(kind)
    segments = (torch.arange(T) >= 5).long().expand(B, T) * b["attention_mask"]
    for family, preset in (("roberta", "tiny"), ("xlm", "tiny"), ("bert", "tiny")):
        overrides = {"vocab_size": V, "type_vocab_size": 3} if family == "xlm" else {"vocab_size": V}
        cfg = make_config(family, preset, overrides)
        model = build_task_model(family, cfg, TaskConfig(kind=kind, num_labels=3), torch.Generator().manual_seed(0)).eval()
        with torch.no_grad():
            with_segments = model(**b, token_type_ids=segments).logits
            without = model(**b).logits
        if family == "bert":
            assert not torch.allclose(with_segments, without)
        else:
            torch.testing.assert_close(with_segments, without, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# Learning and checkpoints


def test_tiny_bert_learns_a_separable_task():
    """Label = whether token 7 occurs in the row: 30 steps take a fresh tiny BERT past 90%."""
    torch.manual_seed(0)
    model = tiny_task("bert", "classification", dropout=0.0).train()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(10, V, (64, T), generator=g)
    labels = torch.randint(0, 2, (64,), generator=g)
    ids[labels == 1, 3] = 7
    ids[:, 0] = 2
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(30):
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    model.eval()
    acc = (model(input_ids=ids).logits.argmax(-1) == labels).float().mean().item()
    assert acc > 0.9


def test_task_checkpoint_round_trip(tmp_path):
    model = tiny_task("xlnet", "classification", labels=["a", "b", "c"]).eval()
    save_checkpoint(tmp_path / "ck", model, "xlnet", model.cfg, task=model.task)
    loaded = load_checkpoint(tmp_path / "ck", verify_hashes=True)
    assert loaded.task == model.task and loaded.task.labels == ["a", "b", "c"]
    b = batch_for("classification")
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(**b).logits, model(**b).logits)


def test_elmo_checkpoint_keeps_its_char_table(tmp_path):
    model = tiny_task("elmo", "classification").eval()
    save_checkpoint(tmp_path / "ck", model, "elmo", model.cfg, task=model.task)
    loaded = load_checkpoint(tmp_path / "ck")
    assert torch.equal(loaded.model.char_table, model.char_table)
