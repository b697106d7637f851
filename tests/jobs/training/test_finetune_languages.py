"""A multilingual XLM fine-tuned in one language and scored or served in another (XLM's
cross-lingual transfer, Lample & Conneau 2019 sec. 5.1): ``task.language`` names the language of the
training texts among model.init's, the fine-tuned checkpoint keeps the row and the names,
``ctx eval --language`` scores a split read as another language, and a served checkpoint reads its
texts as its task's language unless its settings name another."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from jobs.training.config import RecipeError, load_recipe
from jobs.training.finetune_config import FinetuneRecipe

REPO = Path(__file__).resolve().parents[3]
LABELS = ["noun.x", "noun.y"]
TEXTS = ["the river bank was steep", "she took a loan from the bank", "a cheque deposited yesterday"]


def _recipe(*overrides: str) -> FinetuneRecipe:
    return load_recipe(REPO / "configs/finetune/tiny-lexname.yaml", ["model.init=runs/x", *overrides], cls=FinetuneRecipe)


def test_the_languages_of_a_checkpoint_come_from_its_run_its_task_or_its_lang2id(tmp_path):
    from jobs.runs import checkpoint_languages

    pretrained, fine_tuned, hf, bare = (tmp_path / n for n in ("pretrained", "fine-tuned", "hf", "bare"))
    for folder in (pretrained, fine_tuned, hf, bare):
        folder.mkdir()
    (pretrained / "trainer_state.json").write_text(json.dumps({"recipe": {"data": {"languages": ["en", "xx"]}}}))
    (fine_tuned / "trainer_state.json").write_text(json.dumps({"recipe": {"task": {"kind": "classification"}}}))
    (fine_tuned / "config.json").write_text(json.dumps({"task": {"kind": "classification", "language": 1, "languages": ["en", "fr"]}}))
    (hf / "config.json").write_text(json.dumps({"model_type": "xlm", "lang2id": {"fr": 1, "de": 0}}))
    (bare / "config.json").write_text(json.dumps({"model_type": "xlm"}))
    assert checkpoint_languages(pretrained) == ["en", "xx"]
    assert checkpoint_languages(fine_tuned) == ["en", "fr"]
    assert checkpoint_languages(hf) == ["de", "fr"]  # in row order
    assert checkpoint_languages(bare) == []


def test_task_language_is_a_row_of_the_init_models_table():
    from ctxmodels.tasks import TaskConfig
    from jobs.training.finetune import task_language

    xlm = {"type_vocab_size": 3}
    names = ["en", "fr", "de"]
    assert task_language(_recipe(), "xlm", xlm, names, None) == (0, names)  # unset: the first language
    assert task_language(_recipe("task.language=de"), "xlm", xlm, names, None) == (2, names)
    assert task_language(_recipe("task.language=1"), "xlm", xlm, [], None) == (1, [])
    continued = TaskConfig(kind="classification", language=1, languages=names)
    assert task_language(_recipe(), "xlm", xlm, names, continued) == (1, names)  # a continued head keeps its language
    assert task_language(_recipe(), "bert", {"type_vocab_size": 2}, [], None) == (0, [])  # BERT's rows are segments
    for recipe, family, fields, message in (
        (_recipe("task.language=es"), "xlm", xlm, r"task.language: language 'es' is not one of the model's; its languages are \['en', 'fr', 'de'\]"),
        (_recipe("task.language=3"), "xlm", xlm, r"task.language: language 3 is not a row of its language table \(0..2\)"),
        (_recipe("task.language=en"), "xlm", {"type_vocab_size": 0}, "task.language: language 'en': the model has no language embeddings"),
        (_recipe("task.language=en"), "bert", {"type_vocab_size": 2}, "task.language: only an XLM reads its texts as a language; model.init is a bert model"),
    ):
        with pytest.raises(RecipeError, match=message):
            task_language(recipe, family, fields, names, None)


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory, minilm_dir) -> tuple[Path, torch.nn.Module]:
    """A fine-tuned two-language XLM classifier (MiniLM's vocabulary) trained, as its task says, on "xx"
    (row 1), with its recipe in trainer_state.json as ctx finetune writes it."""
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import TaskConfig, build_task_model

    cfg = make_config("xlm", "tiny", {"vocab_size": 30522, "type_vocab_size": 2})
    task = TaskConfig(kind="classification", num_labels=2, labels=LABELS, language=1, languages=["en", "xx"])
    model = build_task_model("xlm", cfg, task, torch.Generator().manual_seed(0)).eval()
    with torch.no_grad():
        model.backbone.embeddings.token_type.weight.normal_(0, 1.0)  # rows far apart: a wrong row shows
        model.classifier.weight.normal_(0, 1.0)
    recipe = _recipe("task.language=xx").model_dump(mode="json")
    state = {"trainer_state": {"step": 1, "recipe": recipe, "task": {"kind": "classification"}}}
    path = save_checkpoint(tmp_path_factory.mktemp("xlm-task") / "ckpt", model, "xlm", cfg, tokenizer_dir=minilm_dir, task=task, extra_json=state)
    return path, model


def _logits(model, minilm_dir, language: int) -> np.ndarray:
    """The classifier's logits over TEXTS encoded as ctx finetune encodes them, every token read as ``language``."""
    from pipelines.tokenizers import load_tokenizer

    tok = load_tokenizer(minilm_dir)
    out = []
    for ids in tok.encode_batch(TEXTS):
        x = torch.as_tensor([tok.cls_id, *ids, tok.sep_id])[None]
        with torch.no_grad():
            h = model.backbone.hidden_states(x, torch.ones_like(x), torch.full_like(x, language))[-1][:, 0]
            out.append(model.classifier(h)[0].numpy())
    return np.stack(out)


def test_ctx_eval_scores_a_fine_tuned_xlm_read_as_another_language(ray_session, fine_tuned, minilm_dir, tmp_path):
    from jobs.evaluation.evaluate import evaluate, load_recipe_of
    from jobs.training.finetune import score_split

    path, model = fine_tuned
    want = {row: _logits(model, minilm_dir, row) for row in (0, 1)}
    assert np.abs(want[0] - want[1]).max() > 0.1  # the two languages' logits differ
    gold = want[0].argmax(1)  # what the model answers reading English
    split = tmp_path / "split.jsonl"
    split.write_text("".join(json.dumps({"sentence1": t, "label": LABELS[g]}) + "\n" for t, g in zip(TEXTS, gold)))
    for language, row in ((None, 1), ("en", 0), (0, 0), ("xx", 1)):
        details: dict = {}
        score_split(str(path), load_recipe_of(str(path)), str(split), None, details, language)
        np.testing.assert_allclose(details["logits"], want[row], atol=1e-5, err_msg=str(language))
        result = evaluate(str(path), str(split), language=language)
        assert result["language"] == ["en", "xx"][row]
        assert result["metrics"]["accuracy"] == pytest.approx(float((want[row].argmax(1) == gold).mean())), language
    with pytest.raises(ValueError, match=r"language 'fr' is not one of the model's; its languages are \['en', 'xx'\]"):
        evaluate(str(path), str(split), language="fr")


def test_a_served_fine_tuned_xlm_reads_its_tasks_language_unless_its_settings_or_a_request_name_another(fine_tuned, minilm_dir):
    from jobs.serving.replica import EmbeddingReplica
    from jobs.serving.serve_config import Limits, ModelConfig

    path, model = fine_tuned
    for setting, row, shown in ((None, 1, "xx"), ("en", 0, "en"), ("xx", 1, "xx")):
        replica = EmbeddingReplica("m", str(path), None, ModelConfig(uri=str(path), language=setting), Limits())
        assert replica.info()["language"] == shown and replica.info()["languages"] == ["en", "xx"]
        answer = asyncio.run(replica.task("/v1/classify", {"texts": TEXTS, "pairs": None, "truncate": False}))
        assert "error" not in answer and "refused" not in answer, answer
        got = np.array([[next(x["score"] for x in d["labels"] if x["label"] == name) for name in LABELS] for d in answer["body"]["data"]])
        want = _logits(model, minilm_dir, row)
        np.testing.assert_allclose(got, np.exp(want) / np.exp(want).sum(1, keepdims=True), atol=1e-5, err_msg=str(setting))

    # A request may name another language: requests of both languages at once, each read as its own
    replica = EmbeddingReplica("m", str(path), None, ModelConfig(uri=str(path)), Limits())

    async def both():
        asks = [{"texts": TEXTS, "pairs": None, "truncate": False, "language": lang} for lang in ("en", None, "xx", "fr")]
        return await asyncio.gather(*(replica.task("/v1/classify", ask) for ask in asks))

    *answers, unknown = asyncio.run(both())
    for answer, row in zip(answers, (0, 1, 1)):
        got = np.array([[next(x["score"] for x in d["labels"] if x["label"] == name) for name in LABELS] for d in answer["body"]["data"]])
        want = _logits(model, minilm_dir, row)
        np.testing.assert_allclose(got, np.exp(want) / np.exp(want).sum(1, keepdims=True), atol=1e-5, err_msg=str(row))
    assert "language 'fr' is not one of the model's" in unknown["refused"][1], unknown
