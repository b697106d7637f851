"""The embedding task kind (``ctxmodels.tasks``: no head, ``text_vector``, ``in_batch_negatives``):
its loss equals sentence-transformers' MultipleNegativesRankingLoss on the real all-MiniLM-L6-v2, its
vectors are the ones ``ctx serve`` and sentence-transformers compute, and an embedding checkpoint
serves and exports with the pooling it was trained with."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxmodels.checkpoint import load_checkpoint, save_checkpoint
from ctxmodels.registry import build_model
from ctxmodels.sbert import SentenceSettings, checkpoint_sentence_settings, read_sentence_settings
from ctxmodels.tasks import TaskConfig, build_task_model, in_batch_negatives, load_backbone
from jobs.cli import main
from pipelines.tokenizers import load_tokenizer, train_tokenizer
from tests.conftest import MIXED_TEXTS

st = pytest.importorskip("sentence_transformers")

# (anchor, positive, negative): the positives shuffled against the anchors in RECORDS_SWAPPED, so
# the loss is far from 0 (near 0 its float32 cancellation differs between implementations).
RECORDS = [
    ("how do cats sleep", "cats sleep most of the day", "dogs bark at night"),
    ("capital of france", "Paris is the capital of France", "Berlin is in Germany"),
    ("best pasta recipe", "boil pasta in salted water, then add sauce", "the stock market fell"),
    ("who wrote hamlet", "Shakespeare wrote Hamlet around 1600", "a hamlet is a small village"),
]
RECORDS_SWAPPED = [(a, RECORDS[(i + 1) % 4][1], n) for i, (a, _, n) in enumerate(RECORDS)]


def batch(tok, records, max_len: int = 64):
    """(B, K, T) ids and mask, each text as the server encodes it."""
    flat = [t for r in records for t in r]
    ids = tok.ids_for_model(flat, max_len)
    T = max(len(r) for r in ids)
    x = torch.full((len(ids), T), tok.padding_id, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, r in enumerate(ids):
        x[i, : len(r)] = torch.as_tensor(r)
        mask[i, : len(r)] = 1
    K = len(records[0])
    return x.view(len(records), K, T), mask.view(len(records), K, T)


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    loaded = load_checkpoint(minilm_dir)
    model = build_task_model(loaded.family, loaded.config, TaskConfig(kind="embedding"), torch.Generator().manual_seed(0))
    load_backbone(model, loaded.model)
    return model.eval(), load_tokenizer(minilm_dir), st.SentenceTransformer(str(minilm_dir), device="cpu").eval()


@pytest.mark.parametrize("records", [RECORDS, RECORDS_SWAPPED, [r[:2] for r in RECORDS_SWAPPED]], ids=["triplets", "hard", "pairs"])
def test_the_loss_is_sentence_transformers_multiple_negatives_ranking_loss(minilm, records):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    model, tok, reference = minilm
    ids, mask = batch(tok, records)
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
        features = [reference.tokenize([r[k] for r in records]) for k in range(len(records[0]))]
        want = MultipleNegativesRankingLoss(reference)(features, None)
    assert out.logits.shape == (len(records), len(records[0]), 384)
    torch.testing.assert_close(out.loss, want, rtol=1e-4, atol=1e-6)
    assert float(out.loss) > (0.5 if records is not RECORDS else 0.0)


@pytest.mark.parametrize("directions,mode", [
    (["query_to_doc", "doc_to_query"], "per_direction"),  # the symmetric loss (Jina)
    (["query_to_doc", "doc_to_query"], "joint"),
    (["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"], "joint"),  # GTE's improved contrastive loss
    (["query_to_doc", "doc_to_doc"], "joint"),
])
@pytest.mark.parametrize("records", [RECORDS_SWAPPED, [r[:2] for r in RECORDS_SWAPPED]], ids=["triplets", "pairs"])
def test_directions_give_sentence_transformers_loss_with_the_same_directions(minilm, records, directions, mode):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    model, tok, reference = minilm
    ids, mask = batch(tok, records)
    with torch.no_grad():
        vectors = model(ids, attention_mask=mask, with_loss=False).logits
        features = [reference.tokenize([r[k] for r in records]) for k in range(len(records[0]))]
        want = MultipleNegativesRankingLoss(reference, directions=tuple(directions), partition_mode=mode)(features, None)
        got = in_batch_negatives(vectors, directions=directions, partition_mode=mode)[0]
        other = torch.randn(4, len(records[0]), 8, generator=torch.Generator().manual_seed(0))
        assert abs(float(in_batch_negatives(other, directions=directions, partition_mode=mode)[0] - in_batch_negatives(other)[0])) > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    model.task.directions, model.task.partition_mode = directions, mode  # the model's own loss reads them
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(ids, attention_mask=mask).loss, want, rtol=1e-4, atol=1e-6)
    finally:
        model.task.directions, model.task.partition_mode = ["query_to_doc"], "joint"


@pytest.mark.parametrize("mode,strength,directions", [
    ("in_batch_negatives", 9.0, ["query_to_doc"]),  # Lan et al. 2025
    ("hard_negatives", 5.0, ["query_to_doc"]),  # Schechter Vera et al. 2025
    ("all_negatives", 3.0, ["query_to_doc", "doc_to_query", "doc_to_doc"]),
])
def test_hardness_weighting_gives_sentence_transformers_loss(minilm, mode, strength, directions):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    model, tok, reference = minilm
    ids, mask = batch(tok, RECORDS_SWAPPED)
    with torch.no_grad():
        vectors = model(ids, attention_mask=mask, with_loss=False).logits
        features = [reference.tokenize([r[k] for r in RECORDS_SWAPPED]) for k in range(3)]
        want = MultipleNegativesRankingLoss(reference, directions=tuple(directions), hardness_mode=mode,
                                            hardness_strength=strength)(features, None)
        got, metrics = in_batch_negatives(vectors, directions=directions, hardness_mode=mode, hardness_strength=strength)
        plain = in_batch_negatives(vectors, directions=directions)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert float(got) > float(plain[0]) + 1e-3 and metrics["acc"] == plain[1]["acc"]  # harder, the same ranking read
    # the weighting carries no gradient itself: the gradient is the plain loss's with the weighted softmax
    v = vectors.clone().requires_grad_()
    in_batch_negatives(v, hardness_mode=mode, hardness_strength=strength)[0].backward()
    assert torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


def test_directions_are_checked_as_sentence_transformers_checks_them():
    for mode, strength, match in [("hard_negatives", 0.0, "needs a positive hardness_strength"), ("softest", 1.0, "expected one of"),
                                  (None, 2.0, "set hardness_mode too"), ("all_negatives", -1.0, "non-negative")]:
        with pytest.raises(ValueError, match=match):
            TaskConfig(kind="embedding", hardness_mode=mode, hardness_strength=strength)
    for directions, mode, match in [(["doc_to_query"], "joint", "query_to_doc"), (["query_to_doc", "sideways"], "joint", "unknown"),
                                    (["query_to_doc", "doc_to_doc"], "per_direction", "use partition_mode=joint"),
                                    (["query_to_doc"], "sum", "joint or per_direction")]:
        with pytest.raises(ValueError, match=match):
            TaskConfig(kind="embedding", directions=directions, partition_mode=mode)


@pytest.mark.parametrize("dims,weights", [([384, 128, 32], []), ([256, 64], [1.0, 0.5])])
def test_matryoshka_dims_give_sentence_transformers_matryoshka_loss(minilm, dims, weights):
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    model, tok, reference = minilm
    ids, mask = batch(tok, RECORDS_SWAPPED)
    model.task.matryoshka_dims, model.task.matryoshka_weights = dims, weights or [1.0] * len(dims)
    try:
        with torch.no_grad():
            got = model(ids, attention_mask=mask).loss
            features = [reference.tokenize([r[k] for r in RECORDS_SWAPPED]) for k in range(3)]
            want = MatryoshkaLoss(reference, MultipleNegativesRankingLoss(reference), dims, weights or None)(features, None)
    finally:
        model.task.matryoshka_dims, model.task.matryoshka_weights = [], []
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="one weight per width"):
        TaskConfig(kind="embedding", matryoshka_dims=[64, 32], matryoshka_weights=[1.0])


# Pairs scored for similarity (sentence1, sentence2, score), with ties and every order of scores
# against the model's: STS-B's 0-5 scale, and 0-1 for CosineSimilarityLoss (which reads the score as a cosine).
SCORED = [(a, p, s) for (a, p, _), s in zip(RECORDS, (4.0, 1.5, 4.0, 0.0))] + [
    (a, RECORDS[(i + 1) % 4][1], s) for i, ((a, _, _), s) in enumerate(zip(RECORDS, (3.0, 5.0, 0.5, 2.5)))]


@pytest.mark.parametrize("loss,matryoshka", [("cosent", None), ("angle", None), ("cosine_similarity", None),
                                             ("cosent", ([384, 96, 33], [1.0, 0.5, 0.25])), ("angle", ([384, 33], [1.0, 1.0]))])
def test_pair_losses_are_sentence_transformers_losses(minilm, loss, matryoshka):
    from sentence_transformers.sentence_transformer import losses

    model, tok, reference = minilm
    pairs = [r[:2] for r in SCORED]
    scores = torch.tensor([r[2] for r in SCORED]) / (5.0 if loss == "cosine_similarity" else 1.0)
    ids, mask = batch(tok, pairs)
    dims, weights = matryoshka or ([], [])
    model.task.loss, model.task.matryoshka_dims, model.task.matryoshka_weights = loss, dims, weights
    try:
        with torch.no_grad():
            got = model(ids, attention_mask=mask, labels=scores)
            inner = {"cosent": losses.CoSENTLoss, "angle": losses.AnglELoss, "cosine_similarity": losses.CosineSimilarityLoss}[loss](reference)
            st_loss = losses.MatryoshkaLoss(reference, inner, dims, weights) if matryoshka else inner
            want = st_loss([reference.tokenize([p[k] for p in pairs]) for k in range(2)], scores)
            without = model(ids, attention_mask=mask, labels=scores.flip(0)).loss  # other scores, another loss
    finally:
        model.task.loss, model.task.matryoshka_dims, model.task.matryoshka_weights = "multiple_negatives_ranking", [], []
    torch.testing.assert_close(got.loss, want, rtol=1e-4, atol=1e-6)
    assert float(got.loss) > 0.05 and abs(float(without) - float(got.loss)) > 1e-3
    assert got.logits.shape == (len(pairs), 2, 384)


def test_cosent_counts_each_wrongly_ordered_two_pairs_once_and_is_zero_free_with_equal_scores():
    from ctxmodels.tasks import pair_loss, pair_similarities, ranked_pairs

    s, labels = torch.tensor([0.2, 0.9, 0.5]), torch.tensor([3.0, 1.0, 1.0])
    # pair 0 ranks above 1 and 2: exp(s1 - s0) + exp(s2 - s0); 1 and 2 are tied, never compared
    want = torch.log(1 + torch.exp(s[1] - s[0]) + torch.exp(s[2] - s[0]))
    torch.testing.assert_close(ranked_pairs(s, labels), want)
    assert float(ranked_pairs(s, torch.ones(3))) == 0.0  # no two scores differ: nothing to order
    v = torch.randn(5, 2, 7, generator=torch.Generator().manual_seed(0))  # odd width: AnglE pads a zero dimension
    angle = pair_similarities(v, "angle")
    assert angle.shape == (5,) and (angle >= 0).all()
    torch.testing.assert_close(pair_similarities(v), torch.nn.functional.cosine_similarity(v[:, 0], v[:, 1]))
    with pytest.raises(ValueError, match="one score each"):
        pair_loss(v, torch.ones(4))
    with pytest.raises(ValueError, match="belong to the in-batch loss"):
        TaskConfig(kind="embedding", loss="cosent", directions=["query_to_doc", "doc_to_query"])
    with pytest.raises(ValueError, match="expected one of"):
        TaskConfig(kind="embedding", loss="triplet")


def test_its_vectors_are_sentence_transformers_and_its_gradient_reaches_every_text(minilm):
    model, tok, reference = minilm
    ids, mask = batch(tok, RECORDS)
    with torch.no_grad():
        vectors = model(ids, attention_mask=mask).logits.reshape(-1, 384)
    want = reference.encode([t for r in RECORDS for t in r], convert_to_tensor=True)  # MiniLM's Normalize module
    torch.testing.assert_close(torch.nn.functional.normalize(vectors, dim=-1), want, atol=2e-6, rtol=0)
    # One (B, K, D) batch: every anchor sees every candidate (a gradient on all of them).
    v = torch.randn(3, 3, 8, requires_grad=True)
    loss, metrics = in_batch_negatives(v)
    loss.backward()
    assert (v.grad.abs().sum(-1) > 0).all() and 0 <= float(metrics["acc"]) <= 1


def test_the_right_candidate_is_the_anchors_own_positive_in_sentence_transformers_order():
    # Anchors equal to their positives, negatives orthogonal: perfect ranking, loss near 0; moving
    # each anchor onto the NEXT record's positive makes the loss large.
    eye = torch.eye(6)
    anchors, positives, negatives = eye[:3], eye[:3], eye[3:]
    good, m = in_batch_negatives(torch.stack([anchors, positives, negatives], dim=1), scale=20.0)
    assert float(good) < 1e-6 and float(m["acc"]) == 1.0
    bad, m = in_batch_negatives(torch.stack([anchors.roll(1, 0), positives, negatives], dim=1))
    assert float(bad) > 10 and float(m["acc"]) == 0.0


def test_an_embedding_model_has_no_head_and_refuses_what_it_cannot_train():
    from ctxmodels.gpt import PRESETS as GPT
    from ctxmodels.bert import PRESETS as BERT

    model = build_task_model("bert", BERT["tiny"], TaskConfig(kind="embedding"))
    assert not hasattr(model, "classifier") and all(n.startswith("backbone.") for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match="first position has seen no text"):
        build_task_model("gpt", GPT["tiny"], TaskConfig(kind="embedding", pooling="cls"))
    with pytest.raises(ValueError, match="features and freeze"):
        build_task_model("bert", BERT["tiny"], TaskConfig(kind="embedding", features="sum-last-four"))
    with pytest.raises(ValueError, match="scale"):
        TaskConfig(kind="embedding", scale=0.0)
    # A left-to-right model reads its last real token: padding on the right leaves it alone.
    gpt = build_task_model("gpt", GPT["tiny"], TaskConfig(kind="embedding", pooling="last"), torch.Generator().manual_seed(0)).eval()
    ids = torch.randint(5, GPT["tiny"].vocab_size, (1, 2, 6), generator=torch.Generator().manual_seed(1))
    padded, mask = torch.cat([ids, torch.zeros(1, 2, 3, dtype=torch.long)], -1), torch.cat([torch.ones(1, 2, 6), torch.zeros(1, 2, 3)], -1).long()
    with torch.no_grad():
        torch.testing.assert_close(gpt(padded, attention_mask=mask).logits, gpt(ids, attention_mask=torch.ones(1, 2, 6).long()).logits,
                                   atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def embedding_checkpoint(tmp_path_factory):
    """A tiny BERT of ours fine-tuned (as if) for embeddings with cls pooling and unit vectors."""
    root = tmp_path_factory.mktemp("embedding")
    tok = train_tokenizer("wordpiece", [t.lower() for t in MIXED_TEXTS] * 20, 120)
    tok.save(root / "tok")
    cfg, pre = build_model("bert", "tiny", {"vocab_size": tok.vocab_size, "max_seq_len": 64, "nsp": False}, seed=3)
    task = TaskConfig(kind="embedding", pooling="cls", normalize=True, max_seq_length=48)
    model = build_task_model("bert", cfg, task, torch.Generator().manual_seed(1))
    load_backbone(model, pre)
    with torch.no_grad():
        for p in model.backbone.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return save_checkpoint(root / "ckpt", model, "bert", cfg, tokenizer_dir=root / "tok", task=task), model, tok


def test_an_embedding_checkpoint_serves_and_exports_its_trained_pooling(embedding_checkpoint, tmp_path):
    from jobs.serving.local import LocalModel

    ckpt, model, tok = embedding_checkpoint
    loaded = load_checkpoint(ckpt)
    assert checkpoint_sentence_settings(ckpt, loaded.task) == SentenceSettings(pooling="cls", normalize=True, max_seq_length=48)
    ids, mask = batch(tok, [tuple(t.lower() for t in MIXED_TEXTS)], max_len=48)
    with torch.no_grad():
        trained = torch.nn.functional.normalize(model.eval()(ids, attention_mask=mask).logits[0], dim=-1).numpy()
    lowered = [t.lower() for t in MIXED_TEXTS]
    with LocalModel(str(ckpt)) as local:  # ctx serve's replica, in-process
        assert (local.info["pooling"], local.info["normalize"]) == ("cls", True)
        assert local.info["task"] == "embedding" and "sentence_transformers" not in local.info  # not such a folder
        np.testing.assert_allclose(local.encode(lowered), trained, atol=2e-5)
    out = tmp_path / "st"
    assert main(["export", "--model", str(ckpt), "--format", "sentence-transformers", "--output", str(out)]) == 0
    assert read_sentence_settings(out) == SentenceSettings(pooling="cls", normalize=True, max_seq_length=48)
    np.testing.assert_allclose(st.SentenceTransformer(str(out), device="cpu").encode(lowered), trained, atol=2e-5)


def test_an_embedding_checkpoint_exports_as_transformers_base_model(embedding_checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")

    ckpt, model, tok = embedding_checkpoint
    out = tmp_path / "hf"
    assert main(["export", "--model", str(ckpt), "--format", "hf", "--output", str(out)]) == 0
    hf_model = transformers.AutoModel.from_pretrained(str(out)).eval()
    assert type(hf_model).__name__ == "BertModel"
    ids, mask = batch(tok, [("the cat sat on the mat", "a dog")])
    with torch.no_grad():
        ours = model.eval()(ids, attention_mask=mask).logits[0]  # cls pooling: position 0 of the last layer
        theirs = hf_model(input_ids=ids[0], attention_mask=mask[0]).last_hidden_state[:, 0]
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)
