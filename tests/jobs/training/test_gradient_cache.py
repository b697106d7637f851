"""A gradient-cached embedding step (``jobs.training.loop.Stepper._cached``, ``task.gradient_cache``):
its micro-batches' gradients are those of one loss on the whole step's batch. On the real
all-MiniLM-L6-v2 they equal sentence-transformers' CachedMultipleNegativesRankingLoss; with dropout
on, they equal the whole batch's forward drawing the same masks (each micro-batch's second forward
replays its first one's random state); and a plain accumulated step, which ranks each micro-batch
alone, differs. Two DDP workers with the gather: tests/jobs/training/test_embedding_gather.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ctxmodels.bert import PRESETS
from ctxmodels.checkpoint import load_checkpoint
from ctxmodels.tasks import TaskConfig, build_task_model, load_backbone
from jobs.training import parallel
from jobs.training.loop import StepMeter, Stepper, TrainState
from pipelines.tokenizers import load_tokenizer
from tests.ctxmodels.test_embedding_task import RECORDS_SWAPPED, batch

B, K, T = 8, 3, 12


def tiny(dropout: float):
    cfg = dataclasses.replace(PRESETS["tiny"], dropout=dropout, attn_dropout=dropout)
    return build_task_model("bert", cfg, TaskConfig(kind="embedding"), torch.Generator().manual_seed(0)).train()


def tiny_batch():
    ids = torch.randint(5, PRESETS["tiny"].vocab_size, (B, K, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:, :, 8:] = torch.randint(0, 2, (B, K, 4), generator=torch.Generator().manual_seed(2)).cummin(-1).values
    return ids, mask


def micro_batches(ids, mask, n: int) -> list[dict]:
    return [{"input_ids": i, "attention_mask": m, "sample_id": list(range(len(i)))} for i, m in zip(ids.chunk(n), mask.chunk(n))]


def stepper(model, accumulation: int, cached: bool, lr: float = 0.0) -> Stepper:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    return Stepper(model, optimizer, parallel.ParallelPlan(strategy="ddp"), torch.device("cpu"), accumulation, B, lr,
                   schedule=lambda samples: 1.0, cached_loss=model.texts_loss if cached else None)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_cached_step_gradients_are_the_whole_batchs_with_the_same_dropout():
    ids, mask = tiny_batch()
    # The whole batch at once, its micro-batches' dropout drawn in the order the cached step's first forwards draw it.
    whole = tiny(0.1)
    torch.manual_seed(7)
    vectors = torch.cat([whole(i, attention_mask=m, with_loss=False).logits for i, m in zip(ids.chunk(4), mask.chunk(4))])
    loss, metrics = whole.texts_loss(vectors)
    loss.backward()
    want = grads(whole)

    cached = tiny(0.1)
    torch.manual_seed(7)
    taken, measured = stepper(cached, 4, cached=True)._cached(iter(micro_batches(ids, mask, 4)), StepMeter(), poisoned=False)
    assert len(taken) == 4 and all(m == measured[0] for m in measured)
    assert measured[0][0] == pytest.approx(float(loss.detach()), rel=1e-6) and measured[0][1]["acc"] == pytest.approx(float(metrics["acc"]))
    got = grads(cached)
    assert set(got) == set(want) and not any(n.startswith("backbone.pooler") for n in got)  # the pooler is never read
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)

    # Plain accumulation: each micro-batch ranks against its own 2 anchors' candidates, another gradient.
    alone = tiny(0.1)
    torch.manual_seed(7)
    stepper(alone, 4, cached=False)._accumulated(iter(micro_batches(ids, mask, 4)), StepMeter(), poisoned=False)
    assert not torch.allclose(grads(alone)["backbone.embeddings.word.weight"], want["backbone.embeddings.word.weight"], atol=1e-4)


def test_a_cached_step_trains_as_one_step_on_the_whole_batch_and_a_nan_is_skipped():
    ids, mask = tiny_batch()
    one, cached = tiny(0.0), tiny(0.0)
    s1, s4 = stepper(one, 1, cached=False, lr=0.5), stepper(cached, 4, cached=True, lr=0.5)
    s1.step(iter(micro_batches(ids, mask, 1)), TrainState(), StepMeter())
    state, meter = TrainState(), StepMeter()
    assert not s4.step(iter(micro_batches(ids, mask, 4)), state, meter).skipped
    assert state.step == 1 and meter.counts["micro"] == 4 and meter.counts["rows"] == B
    for (name, p), q in zip(one.named_parameters(), cached.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=1e-5, msg=name)
    # A non-finite loss (train.debug_nan_steps) skips the step on the cached path as on the plain one.
    before = [p.detach().clone() for p in cached.parameters()]
    s4.debug_nan_steps = (state.attempts + 1,)
    assert s4.step(iter(micro_batches(ids, mask, 4)), state, StepMeter()).skipped
    assert state.bad_steps == 1 and all(torch.equal(p, q) for p, q in zip(before, cached.parameters()))
    # The stream ending inside the step: nothing trained, no gradient left behind.
    assert s4.step(iter(micro_batches(ids, mask, 4)[:3]), state, StepMeter()) is None
    assert all(p.grad is None for p in cached.parameters())


def test_cached_step_is_sentence_transformers_cached_multiple_negatives_ranking_loss(minilm_dir):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    records = RECORDS_SWAPPED + [(a, p, n) for (p, a, n) in RECORDS_SWAPPED]  # 8 triplets: 2 micro-batches of 4
    loaded = load_checkpoint(minilm_dir)
    model = build_task_model(loaded.family, loaded.config, TaskConfig(kind="embedding"), torch.Generator().manual_seed(0))
    load_backbone(model, loaded.model)
    model.eval()  # no dropout on either side: the two libraries draw their masks differently
    ids, mask = batch(load_tokenizer(minilm_dir), records)
    _, measured = stepper(model, 2, cached=True)._cached(iter(micro_batches(ids, mask, 2)), StepMeter(), poisoned=False)

    reference = st.SentenceTransformer(str(minilm_dir), device="cpu").eval()
    features = [reference.tokenize([r[k] for r in records]) for k in range(3)]
    want = CachedMultipleNegativesRankingLoss(reference, mini_batch_size=4)(features, None)
    want.backward()
    assert measured[0][0] == pytest.approx(float(want.detach()), rel=1e-4)
    theirs = dict(reference[0].auto_model.named_parameters())
    ours = dict(model.named_parameters())
    for mine, hf in [("backbone.embeddings.word.weight", "embeddings.word_embeddings.weight"),
                     ("backbone.layers.0.ffn.fc_out.weight", "encoder.layer.0.output.dense.weight"),
                     ("backbone.layers.5.ffn.fc_out.weight", "encoder.layer.5.output.dense.weight")]:
        torch.testing.assert_close(ours[mine].grad, theirs[hf].grad, atol=2e-6, rtol=1e-3, msg=mine)
