"""``ctx export --format sentence-transformers``: the folder loads in sentence-transformers and its
``encode`` gives the vectors the server computes (the tokenizer's ``encode_for_model``, the last
layer, ``features.mean_pool`` / position 0 / the last real token), for the real all-MiniLM-L6-v2,
a tiny BERT of ours with our WordPiece tokenizer, and a fine-tuned task checkpoint's backbone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ctxmodels import features
from ctxmodels.checkpoint import load_checkpoint, save_checkpoint
from ctxmodels.registry import build_model
from ctxmodels.sbert import SentenceSettings, read_sentence_settings
from jobs.cli import main
from pipelines.tokenizers import load_tokenizer, train_tokenizer
from tests.conftest import MIXED_TEXTS

st = pytest.importorskip("sentence_transformers")

TEXTS = MIXED_TEXTS


def server_vectors(checkpoint, texts: list[str], pooling: str, normalize: bool) -> np.ndarray:
    """What /v1/embeddings computes (jobs/serving/replica.py EmbeddingReplica._encode / _pool), in-process."""
    loaded = load_checkpoint(checkpoint)
    tok = load_tokenizer(loaded.tokenizer_dir or checkpoint)
    backbone = getattr(loaded.model, "backbone", loaded.model).eval()
    max_len = getattr(loaded.config, "max_tokens", None) or loaded.config.max_seq_len
    ids, _, _ = tok.encode_for_model(texts, max_len)
    T = max(len(r) for r in ids)
    batch = torch.full((len(ids), T), tok.pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(ids), T), dtype=torch.long)
    for b, row in enumerate(ids):
        batch[b, : len(row)] = torch.tensor(row)
        mask[b, : len(row)] = 1
    with torch.inference_mode():
        hidden = features.token_embeddings(backbone, batch, mask, layers="last")  # (B, T, D)
        if pooling == "mean":
            out = features.mean_pool(hidden, mask)
        elif pooling == "cls":
            out = hidden[:, 0]
        else:
            out = hidden[torch.arange(len(ids)), mask.sum(1) - 1]
    out = out.numpy()
    if normalize:
        out = out / np.linalg.norm(out, axis=1, keepdims=True)
    return out


def st_vectors(folder, texts: list[str]) -> np.ndarray:
    model = st.SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, batch_size=4, convert_to_numpy=True)


def test_minilm_exports_with_the_servers_vectors_and_the_original_folders(minilm_dir, tmp_path):
    out = tmp_path / "st"
    assert main(["export", "--model", str(minilm_dir), "--format", "sentence-transformers", "--output", str(out), "--normalize"]) == 0
    assert json.loads((out / "modules.json").read_text())[-1]["type"] == "sentence_transformers.models.Normalize"
    got = st_vectors(out, TEXTS)
    np.testing.assert_allclose(got, server_vectors(minilm_dir, TEXTS, "mean", True), atol=2e-5)
    # The wheel's folder is sentence-transformers' own all-MiniLM-L6-v2 (mean pooling + Normalize).
    np.testing.assert_allclose(got, st_vectors(minilm_dir, TEXTS), atol=2e-5)
    # Unasked, the export keeps what ctx serve gives the folder unasked: its Normalize module and 256 tokens.
    again = tmp_path / "st-defaults"
    assert main(["export", "--model", str(minilm_dir), "--format", "sentence-transformers", "--output", str(again)]) == 0
    assert read_sentence_settings(again) == read_sentence_settings(minilm_dir)
    np.testing.assert_allclose(st_vectors(again, TEXTS), got, atol=2e-5)
    plain = tmp_path / "st-plain"
    assert main(["export", "--model", str(minilm_dir), "--format", "sentence-transformers", "--output", str(plain), "--no-normalize"]) == 0
    assert read_sentence_settings(plain).normalize is False


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tok = train_tokenizer("wordpiece", [t.lower() for t in TEXTS] * 20 + ["the cat sat on the mat"] * 10, 120)
    tok.save(root / "tok")
    cfg, model = build_model("bert", "tiny", {"vocab_size": tok.vocab_size, "max_seq_len": 64, "nsp": False}, seed=3)
    return save_checkpoint(root / "ckpt", model, "bert", cfg, tokenizer_dir=root / "tok")


@pytest.mark.parametrize("pooling,normalize", [("mean", False), ("cls", True), ("last", False)])
def test_our_checkpoint_and_tokenizer_export_with_each_pooling(tiny_checkpoint, tmp_path, pooling, normalize):
    out = tmp_path / "st"
    args = ["export", "--model", str(tiny_checkpoint), "--format", "sentence-transformers", "--output", str(out), "--pooling", pooling]
    assert main(args + (["--normalize"] if normalize else [])) == 0
    got = st_vectors(out, TEXTS)
    want = server_vectors(tiny_checkpoint, TEXTS, pooling, normalize)
    assert got.shape == want.shape and got.shape[0] == len(TEXTS)
    np.testing.assert_allclose(got, want, atol=2e-5)
    # Served back, the folder's own pooling and Normalize module are its defaults, as in sentence-transformers.
    assert read_sentence_settings(out) == SentenceSettings(pooling=pooling, normalize=normalize, max_seq_length=64)
    from jobs.serving.local import LocalModel

    with LocalModel(str(out)) as local:
        np.testing.assert_allclose(local.encode(TEXTS), got, atol=2e-5)


def test_a_fine_tuned_checkpoint_exports_its_backbone(tiny_checkpoint, tmp_path):
    from ctxmodels.tasks import TaskConfig, build_task_model, load_backbone

    loaded = load_checkpoint(tiny_checkpoint)
    task = TaskConfig(kind="classification", num_labels=2, labels=["no", "yes"])
    model = build_task_model("bert", loaded.config, task, torch.Generator().manual_seed(1))
    load_backbone(model, loaded.model)
    with torch.no_grad():  # as if fine-tuned: the backbone moved away from the pretrained one
        for p in model.backbone.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ckpt = save_checkpoint(tmp_path / "task", model, "bert", loaded.config, tokenizer_dir=loaded.tokenizer_dir, task=task)
    out = tmp_path / "st"
    assert main(["export", "--model", str(ckpt), "--format", "sentence-transformers", "--output", str(out)]) == 0
    assert not any("classifier" in k for k in _tensor_names(out))
    want = server_vectors(ckpt, TEXTS, "mean", False)
    assert not np.allclose(want, server_vectors(tiny_checkpoint, TEXTS, "mean", False), atol=1e-3)
    np.testing.assert_allclose(st_vectors(out, TEXTS), want, atol=2e-5)


def _tensor_names(folder) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_minilm_folders_settings_are_read_as_sentence_transformers_reads_them(minilm_dir, tmp_path):
    settings = read_sentence_settings(minilm_dir)
    model = st.SentenceTransformer(str(minilm_dir), device="cpu")
    assert settings == SentenceSettings(pooling="mean", normalize=True, max_seq_length=model.max_seq_length)
    assert settings.max_seq_length == 256 and settings.default_prompt == ""
    assert read_sentence_settings(tmp_path) is None  # no modules.json: not a sentence-transformers folder


def test_steps_this_project_does_not_run_are_named_and_bad_files_refused(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": True}))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_max_tokens": True, "pooling_mode_cls_token": False, "include_prompt": False}))
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: "}, "default_prompt_name": "passage", "similarity_fn_name": "dot"}))
    settings = read_sentence_settings(tmp_path)
    assert settings.pooling == "mean" and not settings.normalize and settings.max_seq_length == 128
    assert settings.prompts == {"query": "query: "} and settings.default_prompt_name is None and settings.similarity == "dot"
    assert settings.problems == ("do_lower_case (texts are tokenized as given)", "pooling max (mean is used)",
                                 "a pooling that leaves the prompt's tokens out (they are pooled)", "module Dense",
                                 "default_prompt_name 'passage', which is not among its prompts")
    assert settings.shown()["not_reproduced"] == list(settings.problems)
    # A broken folder is served with the defaults and its problem named, not refused: the backbone is fine.
    pool = tmp_path / "1_Pooling" / "config.json"
    breakages = [(lambda: pool.write_text("{not json"), "1_Pooling/config.json: not valid JSON"),
                 (lambda: pool.unlink(), "1_Pooling/config.json: missing (named by the folder's modules.json)"),
                 (lambda: (tmp_path / "modules.json").write_text(json.dumps({"0": "Transformer"})), "modules.json: expected a list of modules")]
    for breaking, words in breakages:
        breaking()
        broken = read_sentence_settings(tmp_path)
        assert (broken.pooling, broken.normalize, broken.max_seq_length, broken.prompts) == ("mean", False, None, {})
        assert len(broken.problems) == 1 and words in broken.problems[0] and "settings are left out" in broken.problems[0]


def test_a_folder_saved_by_sentence_transformers_6_is_read_as_it_reads_it(minilm_dir, tmp_path):
    """sentence-transformers 6 names its modules by their modules (``...base.modules.transformer.Transformer``),
    writes Pooling's mode as ``pooling_mode: "mean"`` and leaves max_seq_length to the tokenizer's
    ``model_max_length``: such a folder is read with its Normalize module and 256 tokens, nothing flagged,
    and served with the vectors sentence-transformers gives it."""
    saved = tmp_path / "st6"
    st.SentenceTransformer(str(minilm_dir), device="cpu").save(str(saved))
    types = [m["type"] for m in json.loads((saved / "modules.json").read_text())]
    if all(t.startswith("sentence_transformers.models.") for t in types):
        pytest.skip("this sentence-transformers writes the 5.x layout")
    settings = read_sentence_settings(saved)
    assert (settings.pooling, settings.normalize, settings.max_seq_length, settings.problems) == ("mean", True, 256, ())
    again = st.SentenceTransformer(str(saved), device="cpu")
    assert settings.max_seq_length == again.max_seq_length
    np.testing.assert_allclose(server_vectors(saved, TEXTS, settings.pooling, settings.normalize), st_vectors(saved, TEXTS), atol=2e-5)


def test_pooling_modes_of_both_layouts(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "my_package.Dense"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    pool = tmp_path / "1_Pooling" / "config.json"
    for config, pooling, problem in [({"pooling_mode": "cls"}, "cls", None), ({"pooling_mode": "lasttoken"}, "last", None),
                                     ({"pooling_mode": ["mean", "max"]}, "mean", "pooling mean+max (mean is used)"),
                                     ({"pooling_mode_lasttoken": True}, "last", None),
                                     ({"pooling_mode_mean_sqrt_len_tokens": True}, "mean", "pooling mean_sqrt_len_tokens (mean is used)")]:
        pool.write_text(json.dumps(config))
        settings = read_sentence_settings(tmp_path)
        assert settings.pooling == pooling
        assert settings.problems == ((problem,) if problem else ()) + ("module my_package.Dense",)
    # no max_seq_length anywhere, and transformers' "no limit": the model's own positions
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": int(1e30)}))
    assert read_sentence_settings(tmp_path).max_seq_length is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 384}))
    assert read_sentence_settings(tmp_path).max_seq_length == 384
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    assert read_sentence_settings(tmp_path).max_seq_length == 128
