"""``ctx finetune`` with task kind ``embedding``: all-MiniLM-L6-v2 trained on the shipped definitions
retrieval task (configs/finetune/minilm-definitions.yaml) through Ray Train retrieves better than it
did, and the checkpoint it keeps serves the vectors its validation scored."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ctxmodels.tasks import TaskConfig
from jobs.training.finetune import task_config_fields
from jobs.training.finetune_config import FinetuneRecipe, RecipeError, load_finetune_recipe
from pipelines.metrics import retrieval_metrics
from pipelines.rng import stable_hash64

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "configs/finetune/minilm-definitions.yaml"
VALIDATION = REPO / "data/tasks/definitions/validation.jsonl"


def definitions_benchmark(folder: Path) -> Path:
    """The definitions test split in the BEIR layout: each question's definition is relevant."""
    records = [json.loads(line) for line in (REPO / "data/tasks/definitions/test.jsonl").read_text().splitlines()]
    texts = list(dict.fromkeys(t for r in records for t in (r["positive"], r["negative"])))
    doc_id = {t: f"d{i}" for i, t in enumerate(texts)}
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps({"_id": doc_id[t], "text": t}) + "\n" for t in texts))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": r["anchor"]}) + "\n" for i, r in enumerate(records)))
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\t{doc_id[r['positive']]}\t1\n" for i, r in enumerate(records)))
    return folder


def test_validation_scores_a_retrieval_benchmark_as_sentence_transformers_evaluator(minilm_dir, tmp_path):
    """data.validation_retrieval: the workers' validation scores the benchmark as sentence-transformers'
    InformationRetrievalEvaluator does (here in one process, MiniLM as the run starts from it)."""
    st = pytest.importorskip("sentence_transformers")
    import torch
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    from ctxmodels.checkpoint import load_checkpoint
    from jobs.training.finetune import as_embedding_model, retrieval_rows, validate
    from jobs.training.parallel import ParallelPlan
    from pipelines.dataset import tokenizer_files
    from pipelines.retrieval import read_beir

    folder = definitions_benchmark(tmp_path / "beir")
    recipe = load_finetune_recipe(RECIPE, [f"model.init={minilm_dir}", f"data.validation_retrieval={folder}",
                                           "data.validation_retrieval_split=test", "train.micro_batch_size=16", "task.metric=null"])
    assert recipe.best_metric == "retrieval_ndcg_at_10"  # the benchmark picks the best checkpoint unless task.metric says
    loaded = load_checkpoint(minilm_dir)
    model = as_embedding_model(loaded, recipe, minilm_dir).model
    logs: list[str] = []
    bench = retrieval_rows(recipe, tokenizer_files(loaded.tokenizer_dir), None, logs.append)
    assert logs[0].startswith(f"data: retrieval benchmark {folder} (test): 200 queries, ")
    got = validate(model, {"retrieval": bench}, recipe, (), ParallelPlan(), torch.device("cpu"), 0, 1)

    split = read_beir(str(folder), "test")
    evaluator = InformationRetrievalEvaluator(dict(zip(split.query_ids, split.queries)), dict(zip(split.corpus_ids, split.corpus)),
                                              {q: {split.corpus_ids[r] for r in rel} for q, rel in zip(split.query_ids, split.relevant)},
                                              precision_recall_at_k=[1, 10, 100], write_csv=False)
    want = evaluator(st.SentenceTransformer(str(minilm_dir), device="cpu"))
    for ours, theirs in [("ndcg_at_10", "ndcg@10"), ("mrr_at_10", "mrr@10"), ("map_at_100", "map@100"), ("recall_at_1", "recall@1"),
                         ("recall_at_10", "recall@10"), ("precision_at_10", "precision@10")]:
        assert got[f"val_retrieval_{ours}"] == pytest.approx(want[f"cosine_{theirs}"], abs=1e-4), ours


def test_a_retrieval_benchmark_is_checked_against_the_task():
    for overrides, words in ((["task.kind=classification", "task.metric=null", "data.validation_retrieval=/b"], "scores sentence vectors"),
                             (["task.metric=retrieval_ndcg_at_10"], "set data.validation_retrieval"),
                             (["task.metric=retrieval_ndcg_at_11", "data.validation_retrieval=/b"], "not a metric of embedding")):
        with pytest.raises(RecipeError, match=words):
            load_finetune_recipe(RECIPE, overrides)
    both = load_finetune_recipe(RECIPE, ["data.validation_retrieval=/b", "task.metric=loss", "train.patience=2"])
    assert both.best_metric == "loss" and both.validated
    alone = load_finetune_recipe(RECIPE, ["data.validation=null", "data.validation_retrieval=/b", "train.patience=2", "task.metric=null"])
    assert alone.best_metric == "retrieval_ndcg_at_10"


def served_metrics(model: str, dimensions: int | None = None) -> dict[str, float]:
    """The validation split's retrieval metrics from the vectors ``ctx serve`` gives (in-process)."""
    from jobs.serving.local import LocalModel

    records = [json.loads(line) for line in VALIDATION.read_text().splitlines()]
    with LocalModel(model) as local:
        info = local.info
        vectors = local.encode([t for r in records for t in (r["anchor"], r["positive"], r["negative"])], truncate_dim=dimensions)
    assert (info["pooling"], info["normalize"]) == ("mean", True)
    if dimensions is None:  # (truncate_dim cuts unit vectors, as sentence-transformers does; cosine does not mind)
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    doc_ids = np.array([[stable_hash64(r["positive"]), stable_hash64(r["negative"])] for r in records])
    return retrieval_metrics(vectors.reshape(len(records), 3, -1), doc_ids)


def test_the_recipe_keys_of_an_embedding_task_are_checked():
    recipe = load_finetune_recipe(RECIPE)
    assert recipe.task.kind == "embedding" and recipe.best_metric == "ndcg_at_10"
    for bad, key in [("task.pooling=max", "pooling"), ("task.scale=0", "scale"), ("model.freeze=true", "model.freeze"),
                     ("task.metric=accuracy", "metric"), ("task.matryoshka_dims=[64,0]", "matryoshka_dims"),
                     ("task.matryoshka_weights=[1.0]", "matryoshka_weights"), ("task.directions=[doc_to_query]", "directions"),
                     ("task.partition_mode=both", "partition_mode"), ("task.hardness_mode=hard_negatives", "hardness_strength")]:
        with pytest.raises(RecipeError, match=key):
            load_finetune_recipe(RECIPE, [bad])
    recipe = load_finetune_recipe(RECIPE, ["task.directions=[query_to_doc,doc_to_query]", "task.partition_mode=per_direction",
                                           "task.hardness_mode=hard_negatives", "task.hardness_strength=5"])
    task = TaskConfig(**task_config_fields(recipe, "bert", ()))  # what the workers build the model's loss from
    assert (task.directions, task.partition_mode) == (["query_to_doc", "doc_to_query"], "per_direction")
    assert (task.hardness_mode, task.hardness_strength) == ("hard_negatives", 5.0)
    assert TaskConfig(**task_config_fields(load_finetune_recipe(RECIPE), "bert", ())).directions == ["query_to_doc"]
    # what the workers validate again: every recipe's dump, whatever its kind (task.gradient_cache: false too)
    for path, sets in [(RECIPE, ["task.gradient_cache=false"]), (REPO / "configs/finetune/minilm-pairs.yaml", [])]:
        dumped = load_finetune_recipe(path, sets).model_dump(mode="json")
        assert FinetuneRecipe.model_validate(dumped).model_dump(mode="json") == dumped
    for key in ("task.pooling=cls", "task.gradient_cache=false", "task.directions=[query_to_doc]", "task.hardness_strength=5"):
        with pytest.raises(RecipeError, match="only for embedding"):
            load_finetune_recipe(REPO / "configs/finetune/minilm-pairs.yaml", [key])


@pytest.mark.slow  # Ray Data reads the split
def test_ctx_eval_scores_any_model_as_the_embedding_model_it_serves(ray_session, minilm_dir, tmp_path):
    from jobs.cli import main

    out = tmp_path / "minilm.json"
    assert main(["eval", "--task", "embedding", "--model", str(minilm_dir), "--data", str(VALIDATION), "--output", str(out)]) == 0
    scored = json.loads(out.read_text())
    assert scored["task"] == "embedding" and scored["examples"] == 206
    for name, value in served_metrics(str(minilm_dir)).items():
        assert scored["metrics"][name] == pytest.approx(value, abs=2e-3), name
    # pairs scored for similarity (a score each, no negatives): their correlations, not retrieval
    assert main(["eval", "--task", "embedding", "--model", str(minilm_dir), "--data", str(SIMILARITY_VALIDATION), "--output", str(out)]) == 0
    scored = json.loads(out.read_text())
    assert scored["examples"] == 618 and "ndcg_at_10" not in scored["metrics"]
    for name, value in served_similarity(str(minilm_dir), SIMILARITY_VALIDATION).items():
        assert scored["metrics"][name] == pytest.approx(value, abs=2e-3), name
    from jobs.evaluation.evaluate import evaluate

    with pytest.raises(ValueError, match="--task embedding"):
        evaluate(str(minilm_dir), str(VALIDATION))


@pytest.mark.slow  # ~80 s: 15 steps of MiniLM on 3 texts x 32 records (2 micro-batches, a gradient cache), two validations
def test_minilm_learns_to_retrieve_definitions_and_serves_what_was_scored(ray_session, minilm_dir, tmp_path):
    from jobs.training.finetune import finetune

    from jobs.evaluation.retrieval import evaluate_retrieval

    before = served_metrics(str(minilm_dir))
    logs: list[str] = []
    benchmark = definitions_benchmark(tmp_path / "beir")  # scored at every validation beside the split
    recipe = load_finetune_recipe(RECIPE, [f"output_dir={tmp_path}", "name=emb", "train.epochs=1", "data.test=null",
                                           "registry.enabled=false", "task.matryoshka_dims=[384,64]", "train.micro_batch_size=16",
                                           f"data.validation_retrieval={benchmark}", "data.validation_retrieval_split=test",
                                           "task.metric=ndcg_at_10"])
    result = finetune(recipe, progress=False, log=logs.append)
    # One validation (the epoch's end): the kept checkpoint, scored by `ctx eval retrieval`, gives what the run measured.
    offline = evaluate_retrieval(result.best_checkpoint, str(benchmark), "test")["metrics"]
    for name in ("ndcg_at_10", "mrr_at_10", "recall_at_10"):
        assert result.metrics[f"val_retrieval_{name}"] == pytest.approx(offline[name], abs=2e-3), name
    assert "embedding: mean pooling, unit vectors, 256 tokens served" in logs  # MiniLM's own settings, kept
    # two micro-batches a step behind a gradient cache: the anchors rank against all 32 rows (tests/jobs/training/test_gradient_cache.py)
    assert any(line.startswith("embedding: gradient cache, each anchor ranks against the step's 32 rows") for line in logs), logs
    assert result.best["metric"] == "ndcg_at_10"
    assert result.metrics["val_ndcg_at_10"] > before["ndcg_at_10"] + 0.02, (before, result.metrics)
    losses = [r["loss"] for r in result.history if "loss" in r]
    assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses
    config = json.loads(Path(result.best_checkpoint, "config.json").read_text())
    assert {k: config["task"][k] for k in ("kind", "pooling", "normalize", "max_seq_length", "matryoshka_dims")} == {
        "kind": "embedding", "pooling": "mean", "normalize": True, "max_seq_length": 256, "matryoshka_dims": [384, 64]}
    # The kept checkpoint, served, gives the vectors its validation scored.
    after = served_metrics(result.best_checkpoint)
    for name, value in after.items():
        assert value == pytest.approx(result.best["value"] if name == "ndcg_at_10" else result.metrics[f"val_{name}"], abs=2e-3), name
    # A client's `dimensions: 64` is the Matryoshka width the run trained and scored.
    assert served_metrics(result.best_checkpoint, 64)["ndcg_at_10"] == pytest.approx(result.metrics["val_ndcg_at_10_dim64"], abs=2e-3)
    assert served_metrics(str(minilm_dir), 64)["ndcg_at_10"] < result.metrics["val_ndcg_at_10_dim64"] - 0.02


# --------------------------------------------------------------------- pairs scored for similarity

SIMILARITY = REPO / "configs/finetune/minilm-similarity.yaml"
SIMILARITY_VALIDATION = REPO / "data/tasks/similarity/validation.jsonl"


def similarity_split(path: Path, n: int | None = None) -> tuple[list[str], list[str], list[float]]:
    records = [json.loads(line) for line in path.read_text().splitlines()][:n]
    return [r["sentence1"] for r in records], [r["sentence2"] for r in records], [r["score"] for r in records]


def test_scored_pairs_validate_as_sentence_transformers_embedding_similarity_evaluator(minilm_dir):
    """A pair loss's run (task.loss cosent) reads (sentence1, sentence2, score) records and its
    validation gives sentence-transformers' EmbeddingSimilarityEvaluator's spearman_cosine and
    pearson_cosine (here in one process, MiniLM as the run starts from it), and the loss on the
    split is CoSENTLoss's."""
    st = pytest.importorskip("sentence_transformers")
    import torch
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator
    from sentence_transformers.sentence_transformer.losses import CoSENTLoss

    from ctxmodels.checkpoint import load_checkpoint
    from jobs.training.finetune import as_embedding_model, validate
    from jobs.training.finetune_config import task_data_config
    from jobs.training.parallel import ParallelPlan
    from pipelines.finetune import encode_task
    from pipelines.tokenizers import load_tokenizer

    recipe = load_finetune_recipe(SIMILARITY, [f"model.init={minilm_dir}", "train.batch_size=64"])
    assert (recipe.task.loss, recipe.best_metric) == ("cosent", "spearman_cosine")
    loaded = load_checkpoint(minilm_dir)
    model = as_embedding_model(loaded, recipe, minilm_dir).model
    assert model.task.loss == "cosent"
    first, second, scores = similarity_split(SIMILARITY_VALIDATION, 150)
    records = {"sentence1": first, "sentence2": second, "score": scores}
    rows = encode_task(records, load_tokenizer(minilm_dir), task_data_config(recipe, "bert"))
    assert rows["input_ids"].shape == (150, 2, 64) and rows["labels"].dtype == np.float32 and "doc_ids" not in rows
    rows["sample_id"] = np.arange(150)
    got = validate(model, {"rows": rows}, recipe, (), ParallelPlan(), torch.device("cpu"), 0, 1)

    reference = st.SentenceTransformer(str(minilm_dir), device="cpu")
    want = EmbeddingSimilarityEvaluator(first, second, scores)(reference)
    assert got["val_spearman_cosine"] == pytest.approx(want["spearman_cosine"], abs=1e-4)
    assert got["val_pearson_cosine"] == pytest.approx(want["pearson_cosine"], abs=1e-4)
    # Matryoshka widths: each width's first dimensions, as the evaluator's truncate_dim reads them
    widths = recipe.model_copy(update={"task": recipe.task.model_copy(update={"matryoshka_dims": [384, 64]})})
    got64 = validate(model, {"rows": rows}, widths, (), ParallelPlan(), torch.device("cpu"), 0, 1)["val_spearman_cosine_dim64"]
    assert got64 == pytest.approx(EmbeddingSimilarityEvaluator(first, second, scores, truncate_dim=64)(reference)["spearman_cosine"], abs=1e-4)
    with torch.no_grad():  # the split's loss: each micro-batch of 64 pairs' CoSENTLoss, weighted by its pairs
        parts = [(CoSENTLoss(reference)([reference.tokenize(t[i:i + 64]) for t in (first, second)], torch.tensor(scores[i:i + 64])), len(first[i:i + 64]))
                 for i in range(0, 150, 64)]
    assert got["val_loss"] == pytest.approx(sum(float(v) * n for v, n in parts) / 150, rel=1e-4)


def test_the_recipe_keys_of_a_pair_loss_are_checked():
    recipe = load_finetune_recipe(SIMILARITY)
    assert TaskConfig(**task_config_fields(recipe, "bert", ())).loss == "cosent"  # what the workers build the loss from
    assert TaskConfig(**task_config_fields(load_finetune_recipe(RECIPE), "bert", ())).loss == "multiple_negatives_ranking"
    assert load_finetune_recipe(SIMILARITY, ["task.metric=null"]).best_metric == "spearman_cosine"
    assert load_finetune_recipe(SIMILARITY, ["task.metric=pearson_cosine", "task.loss=angle"]).best_metric == "pearson_cosine"
    for bad, match in [("task.loss=triplet", "loss"), ("task.metric=ndcg_at_10", "not a metric of embedding"),
                       ("task.negative_field=negative", "the in-batch loss's"), ("task.hardness_mode=hard_negatives", "the in-batch loss's"),
                       ("task.directions=[query_to_doc,doc_to_query]", "the in-batch loss's"),
                       ("task.gradient_cache=true", "gradient_cache: the in-batch loss's")]:
        with pytest.raises(RecipeError, match=match):
            load_finetune_recipe(SIMILARITY, [bad])
    with pytest.raises(RecipeError, match="not a metric of embedding"):  # the in-batch loss is scored by retrieval
        load_finetune_recipe(RECIPE, ["task.metric=spearman_cosine"])
    with pytest.raises(RecipeError, match="only for embedding"):
        load_finetune_recipe(REPO / "configs/finetune/minilm-pairs.yaml", ["task.loss=cosent"])
    dumped = recipe.model_dump(mode="json")
    assert FinetuneRecipe.model_validate(dumped).model_dump(mode="json") == dumped


def test_a_scored_pair_without_a_number_is_a_record_error_naming_its_field():
    from pipelines.finetune import TaskDataConfig, check_records

    cfg = TaskDataConfig(kind="embedding", loss="cosent")
    records = {"sentence1": ["a", "b", "c", ""], "sentence2": ["x", "y", "z", "w"], "score": [0.5, "high", None, 1.0]}
    assert [(e.index, e.field) for e in check_records(records, cfg)] == [(1, "score"), (2, "score"), (3, "sentence1")]
    labelled = {"anchor": ["a"], "positive": ["x"], "label": [2.0], "score": ["ignored"]}  # label first, as the default says
    assert check_records(labelled, cfg) == []
    with pytest.raises(ValueError, match="an embedding task's loss"):
        TaskDataConfig(kind="regression", loss="cosent")
    # CosineSimilarityLoss fits the cosine to the score: STS-B's 0-5 scale is a record error there, not under CoSENT
    sts = {"sentence1": ["a", "b", "c"], "sentence2": ["x", "y", "z"], "score": [4.2, 0.8, -1.0]}
    errors = check_records(sts, TaskDataConfig(kind="embedding", loss="cosine_similarity"))
    assert [(e.index, e.field) for e in errors] == [(0, "score")] and "divide by 5" in str(errors[0])
    assert check_records(sts, cfg) == []


def served_similarity(model: str, split: Path) -> dict[str, float]:
    """``split``'s spearman_cosine and pearson_cosine from the vectors ``ctx serve`` gives (in-process)."""
    from jobs.serving.local import LocalModel
    from pipelines.metrics import similarity_metrics

    first, second, scores = similarity_split(split)
    with LocalModel(model) as local:
        vectors = local.encode([t for pair in zip(first, second) for t in pair])
    return similarity_metrics(vectors.reshape(len(first), 2, -1), scores)


@pytest.mark.slow  # ~35 s: 4 epochs of MiniLM on 96 scored pairs, 16 a step, a validation each epoch
def test_minilm_learns_scored_similarity_with_cosent_and_serves_what_was_scored(ray_session, minilm_dir, tmp_path):
    """CoSENT teaches MiniLM the order of the pairs it trains on (its validation here is its training
    split: a held-out gain takes longer; the 275 steps of configs/finetune/minilm-similarity.yaml lift
    the test split's spearman_cosine from 0.595 to 0.668), and the checkpoint it keeps serves the
    vectors its validation scored."""
    from jobs.training.finetune import finetune

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(SIMILARITY_VALIDATION.read_text().splitlines(keepends=True)[:96]))
    before = served_similarity(str(minilm_dir), pairs)
    logs: list[str] = []
    recipe = load_finetune_recipe(SIMILARITY, [f"output_dir={tmp_path}", "name=sts", f"data.train={pairs}", f"data.validation={pairs}",
                                               "train.epochs=4", "train.log_every=3", "data.test=null", "registry.enabled=false"])
    result = finetune(recipe, progress=False, log=logs.append)
    assert "embedding: mean pooling, unit vectors, 256 tokens served, cosent loss on scored pairs" in logs
    assert result.best["metric"] == "spearman_cosine" and result.best["step"] == 24
    assert result.metrics["val_spearman_cosine"] > before["spearman_cosine"] + 0.1, (before, result.metrics)  # 0.78 -> 0.94
    val_losses = [r["val_loss"] for r in result.history if "val_loss" in r]
    assert len(val_losses) == 4 and val_losses[-1] < val_losses[0], val_losses
    config = json.loads(Path(result.best_checkpoint, "config.json").read_text())
    assert (config["task"]["kind"], config["task"]["loss"]) == ("embedding", "cosent")
    # The kept checkpoint, served, gives the vectors its validation scored.
    after = served_similarity(result.best_checkpoint, pairs)
    for name, value in after.items():
        assert value == pytest.approx(result.metrics[f"val_{name}"], abs=2e-3), name
