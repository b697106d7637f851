"""Fine-tuned task heads <-> transformers' head classes, both ways, for every (family, task kind)
pair transformers has: tiny random models (every weight perturbed), then the real MiniLM for BERT;
the refusals name the family, the kind and what is supported; ``ctx export`` end to end."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from ctxmodels.checkpoint import save_checkpoint
from ctxmodels.hf import CONVERTERS, export_hf_folder, load_hf_folder, load_hf_task_folder
from ctxmodels.registry import make_config
from ctxmodels.tasks import TASK_KINDS, TaskConfig, build_task_model, load_backbone

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

torch.set_num_threads(1)
B, K, T, V, PAD = 3, 2, 12, 99, 0
LABELS = ["neg", "neutral", "pos"]
SIZE = dict(vocab_size=V, d_model=32, n_layer=2, n_head=4, d_ff=37, max_seq_len=40)

# HF model_type -> (our family, preset, overrides): tiny models of each kind transformers has.
VARIANTS = {
    "bert": ("bert", "tiny", SIZE),
    "roberta": ("roberta", "tiny", SIZE),
    "albert": ("albert", "tiny", {**SIZE, "embedding_size": 16}),
    "openai-gpt": ("gpt", "tiny", {**SIZE, "d_ff": 128}),  # HF's openai-gpt hard-codes 4 * d_model
    "gpt2": ("gpt", "gpt2-tiny", SIZE),
    "xlnet": ("xlnet", "tiny", {**SIZE, "mem_len": 0}),
    "xlm": ("xlm", "tiny", {**SIZE, "d_ff": 128, "type_vocab_size": 0}),  # HF's XLM hard-codes 4 * d_model
}
# The same sizes as transformers configs, written independently of our export.
HF_CONFIGS = {
    "bert": ("BertConfig", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=37, max_position_embeddings=40, pad_token_id=PAD)),
    "roberta": ("RobertaConfig", dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=37, max_position_embeddings=40, type_vocab_size=1,
                                      pad_token_id=1, bos_token_id=0, eos_token_id=2)),
    "albert": ("AlbertConfig", dict(vocab_size=V, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=37, max_position_embeddings=40,
                                    pad_token_id=PAD)),
    "openai-gpt": ("OpenAIGPTConfig", dict(vocab_size=V, n_positions=40, n_embd=32, n_layer=2, n_head=4, pad_token_id=PAD)),
    "gpt2": ("GPT2Config", dict(vocab_size=V, n_positions=40, n_embd=32, n_layer=2, n_head=4, n_inner=37,
                                pad_token_id=PAD, bos_token_id=1, eos_token_id=1)),
    "xlnet": ("XLNetConfig", dict(vocab_size=V, d_model=32, n_layer=2, n_head=4, d_inner=37, pad_token_id=PAD)),
    "xlm": ("XLMConfig", dict(vocab_size=V, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=40, pad_token_id=PAD)),
}
AUTO = {
    "classification": "AutoModelForSequenceClassification",
    "regression": "AutoModelForSequenceClassification",
    "multiple-choice": "AutoModelForMultipleChoice",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
}
SUPPORTED = [(t, k) for t, (family, _, _) in VARIANTS.items() for k in TASK_KINDS if k in CONVERTERS[family].tasks[t]]
UNSUPPORTED = [(t, k) for t, (family, _, _) in VARIANTS.items() for k in TASK_KINDS
               if k not in CONVERTERS[family].tasks[t] and k != "embedding"]  # an embedding model exports as the base model


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Every weight moved off its initial value, so a wrong or missing mapping shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def pad_of(model_type: str) -> int:
    return 1 if model_type == "roberta" else PAD


def inputs(model_type: str, kind: str) -> dict[str, torch.Tensor]:
    """Right-padded rows (as our data stage writes them); real ids never equal the padding id."""
    g = torch.Generator().manual_seed(0)
    shape = (B, K, T) if kind == "multiple-choice" else (B, T)
    ids = torch.randint(3, V, shape, generator=g)
    mask = torch.ones(shape, dtype=torch.long)
    mask[1, ..., 7:] = 0
    mask[2, ..., 10:] = 0
    out = {"input_ids": ids.masked_fill(mask == 0, pad_of(model_type)), "attention_mask": mask}
    if model_type in ("bert", "albert", "xlnet"):  # RoBERTa has one segment type, GPT none
        out["token_type_ids"] = (torch.arange(T) >= 4).long().expand(shape) * mask
    return out


def left_padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same rows padded on the left, as XLNet's tokenizer pads (its heads read the last position)."""
    n = batch["attention_mask"].reshape(-1, T).sum(1)
    return {k: torch.stack([torch.roll(row, int(T - m)) for row, m in zip(v.reshape(-1, T), n)]).view(v.shape)
            for k, v in batch.items()}


def assert_same_logits(ours, ref, model_type: str, kind: str) -> None:
    batch = inputs(model_type, kind)
    hf_batch = left_padded(batch) if model_type == "xlnet" and kind not in ("token-classification", "question-answering") else batch
    with torch.no_grad():
        got = ours(**batch).logits
        out = ref(**hf_batch)
    real = batch["attention_mask"].bool()
    if kind == "question-answering":
        want = torch.stack([out.start_logits, out.end_logits], dim=-1)
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)
    elif kind == "token-classification":
        torch.testing.assert_close(got[real], out.logits[real], atol=1e-4, rtol=0)
    elif kind == "regression":
        torch.testing.assert_close(got, out.logits.squeeze(-1), atol=1e-4, rtol=0)
    else:
        torch.testing.assert_close(got, out.logits, atol=1e-4, rtol=0)


def our_task_model(model_type: str, kind: str):
    family, preset, overrides = VARIANTS[model_type]
    cfg = make_config(family, preset, overrides)
    task = TaskConfig(kind=kind, num_labels=3, labels=LABELS if kind in ("classification", "token-classification") else [])
    model = build_task_model(family, cfg, task, torch.Generator().manual_seed(0))
    perturb(model)
    return family, model.eval()


@pytest.mark.parametrize(("model_type", "kind"), SUPPORTED)
def test_export_loads_in_transformers_with_equal_logits(model_type, kind, tmp_path):
    family, ours = our_task_model(model_type, kind)
    export_hf_folder(ours, family, tmp_path, pad_token_id=pad_of(model_type))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == model_type
    assert config["architectures"] == [CONVERTERS[family].tasks[model_type][kind]]
    ref, info = getattr(transformers, AUTO[kind]).from_pretrained(tmp_path, output_loading_info=True)
    assert type(ref).__name__ == config["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    if kind == "classification":
        assert ref.config.id2label == dict(enumerate(LABELS)) and ref.config.label2id == {n: i for i, n in enumerate(LABELS)}
        assert ref.config.problem_type == "single_label_classification"
    if kind == "regression":
        assert ref.config.num_labels == 1 and ref.config.problem_type == "regression"
    assert_same_logits(ours, ref.eval(), model_type, kind)


@pytest.mark.parametrize(("model_type", "kind"), SUPPORTED)
def test_transformers_head_imports_as_our_task_model(model_type, kind, tmp_path):
    config_cls, fields = HF_CONFIGS[model_type]
    if kind in ("classification", "token-classification"):
        fields = {**fields, "id2label": dict(enumerate(LABELS)), "label2id": {n: i for i, n in enumerate(LABELS)}}
    elif kind == "regression":
        fields = {**fields, "num_labels": 1, "problem_type": "regression"}
    cls_name = CONVERTERS[VARIANTS[model_type][0]].tasks[model_type][kind]
    torch.manual_seed(0)
    ref = getattr(transformers, cls_name)(getattr(transformers, config_cls)(**fields))
    perturb(ref)
    ref.save_pretrained(tmp_path)
    family, _, ours = load_hf_task_folder(tmp_path)
    assert family == VARIANTS[model_type][0] and ours.task.kind == kind
    if kind in ("classification", "token-classification"):
        assert ours.task.labels == LABELS and ours.task.num_labels == 3
    assert_same_logits(ours, ref.eval(), model_type, kind)


@pytest.mark.parametrize("model_type", list(VARIANTS))
def test_an_embedding_model_exports_as_the_base_model_with_equal_hidden_states(model_type, tmp_path):
    family, ours = our_task_model(model_type, "embedding")
    export_hf_folder(ours, family, tmp_path, pad_token_id=pad_of(model_type))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == model_type and "id2label" not in config
    ref = transformers.AutoModel.from_pretrained(tmp_path).eval()
    assert [type(ref).__name__] == config["architectures"] and type(ref).__name__.endswith("Model")
    ids = torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ours.backbone.hidden_states(ids, torch.ones_like(ids), None)[-1]
        got = ref(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("model_type", "kind"), UNSUPPORTED)
def test_export_refuses_heads_transformers_lacks(model_type, kind, tmp_path):
    family, ours = our_task_model(model_type, kind)
    with pytest.raises(ValueError, match=rf"family '{family}' \({model_type}\) and task kind '{kind}'.*has {model_type} heads for \["):
        export_hf_folder(ours, family, tmp_path, pad_token_id=PAD)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("family", ["elmo", "transformer-xl"])
def test_export_refuses_families_transformers_lacks(family, tmp_path):
    cfg = make_config(family, "tiny")
    model = build_task_model(family, cfg, TaskConfig(kind="classification"), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"no Hugging Face export for family '{family}'.*\['albert', 'bert', 'gpt', 'roberta', 'spanbert', 'xlm', 'xlnet'\]"):
        export_hf_folder(model, family, tmp_path)


def test_export_refuses_what_no_head_computes(tmp_path):
    cfg = make_config("bert", "tiny")
    feature_based = build_task_model("bert", cfg, TaskConfig(kind="token-classification", freeze=True,
                                                             features="sum-last-four", task_model="bilstm"))
    with pytest.raises(ValueError, match="feature-based bert task model.*sum-last-four"):
        export_hf_folder(feature_based, "bert", tmp_path)
    _, gpt = our_task_model("gpt2", "classification")
    gpt.task.symmetric = True
    with pytest.raises(ValueError, match="symmetric=True"):
        export_hf_folder(gpt, "gpt", tmp_path, pad_token_id=PAD)
    gpt.task.symmetric = False
    with pytest.raises(ValueError, match="GPT2ForSequenceClassification finds each row's last token by pad_token_id"):
        export_hf_folder(gpt, "gpt", tmp_path)
    with pytest.raises(ValueError, match="export as family 'xlnet' got a 'gpt' task model"):
        export_hf_folder(gpt, "xlnet", tmp_path)


def test_spanbert_exports_as_bert(tmp_path):
    cfg = make_config("spanbert", "tiny", SIZE)
    ours = build_task_model("spanbert", cfg, TaskConfig(kind="question-answering"), torch.Generator().manual_seed(0))
    perturb(ours)
    export_hf_folder(ours.eval(), "spanbert", tmp_path)
    ref = transformers.AutoModelForQuestionAnswering.from_pretrained(tmp_path)
    assert type(ref).__name__ == "BertForQuestionAnswering"
    assert_same_logits(ours, ref.eval(), "bert", "question-answering")


def test_task_import_refuses_a_pretraining_folder(tmp_path):
    config_cls, fields = HF_CONFIGS["bert"]
    transformers.BertForPreTraining(getattr(transformers, config_cls)(**fields)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"architectures=\['BertForPreTraining'\] is not a task head.*BertForTokenClassification"):
        load_hf_task_folder(tmp_path)


@pytest.mark.parametrize("model_type", ["albert", "openai-gpt", "gpt2", "xlnet", "xlm"])
def test_pretraining_folders_round_trip_through_transformers(model_type, tmp_path, caplog):
    """Our pretraining model -> folder -> transformers' LM class: equal last hidden state; and back."""
    family, preset, overrides = VARIANTS[model_type]
    cfg = make_config(family, preset, overrides)
    from ctxmodels.registry import new_model

    ours = new_model(family, cfg, seed=0)
    perturb(ours)
    export_hf_folder(ours.eval(), family, tmp_path / "out")
    ref, info = transformers.AutoModel.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    batch = inputs(model_type, "classification")
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        want = ref.eval()(**batch).last_hidden_state
        got = ours.backbone.hidden_states(**batch)[-1]
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)
    with caplog.at_level(logging.WARNING, logger="ctxmodels.hf"):
        back_family, _, back = load_hf_folder(tmp_path / "out")
    assert back_family == family and "no weights for" not in caplog.text
    unmatched = CONVERTERS[family].weights(cfg, "pretraining").unmatched  # XLM's (absent) pooler
    for name, t in ours.state_dict().items():
        assert name.startswith(unmatched) or torch.equal(t, back.state_dict()[name]), name


# ---------------------------------------------------------------------------------------------
# The real all-MiniLM-L6-v2 (a BertModel): its backbone under each of our BERT heads


def minilm_task(minilm_dir, kind: str):
    _, cfg, pretrained = load_hf_folder(minilm_dir)
    labels = LABELS if kind in ("classification", "token-classification") else []
    ours = build_task_model("bert", cfg, TaskConfig(kind=kind, num_labels=3, labels=labels), torch.Generator().manual_seed(0))
    load_backbone(ours, pretrained)
    head = ours.qa_outputs if kind == "question-answering" else ours.classifier
    perturb(head)
    return ours.eval()


def minilm_batch(tok, kind: str) -> dict[str, torch.Tensor]:
    texts = ["the bank of the river", "he cashed a check at the bank on the corner", "a bank"]
    enc = dict(tok(texts, ["money", "water flows", "a building"], padding=True, return_tensors="pt"))
    if kind == "multiple-choice":
        enc = {k: torch.stack([v, v.flip(0)], dim=1) for k, v in enc.items()}  # (B, 2, T)
    return enc


@pytest.mark.parametrize("kind", [k for k in TASK_KINDS if k != "embedding"])  # headless: tests/ctxmodels/test_embedding_task.py
def test_minilm_heads_export_with_tokenizer(minilm_dir, kind, tmp_path, caplog):
    with caplog.at_level(logging.ERROR):
        ours = minilm_task(minilm_dir, kind)
    export_hf_folder(ours, "bert", tmp_path, tokenizer_dir=minilm_dir)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)  # the tokenizer went along
    ref = getattr(transformers, AUTO[kind]).from_pretrained(tmp_path).eval()
    enc = minilm_batch(tok, kind)
    real = enc["attention_mask"].bool()
    with torch.no_grad():
        got, out = ours(**enc).logits, ref(**enc)
    if kind == "question-answering":
        torch.testing.assert_close(got[real], torch.stack([out.start_logits, out.end_logits], -1)[real], atol=1e-4, rtol=0)
    elif kind == "token-classification":
        torch.testing.assert_close(got[real], out.logits[real], atol=1e-4, rtol=0)
    else:
        torch.testing.assert_close(got, out.logits.squeeze(-1) if kind == "regression" else out.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["classification", "token-classification"])
def test_minilm_transformers_head_imports(minilm_dir, kind, tmp_path):
    cls = getattr(transformers, AUTO[kind])
    ref = cls.from_pretrained(minilm_dir, id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)})
    perturb(ref.classifier)
    ref.save_pretrained(tmp_path)
    _, _, ours = load_hf_task_folder(tmp_path)
    assert ours.task.labels == LABELS
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    enc = minilm_batch(tok, kind)
    real = enc["attention_mask"].bool()
    with torch.no_grad():
        got, want = ours(**enc).logits, ref.eval()(**enc).logits
    if kind == "token-classification":
        got, want = got[real], want[real]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# ctx export (jobs/cli.py): a run folder resolves to its best checkpoint


def test_ctx_export_writes_the_best_checkpoint_of_a_run(minilm_dir, tmp_path, capsys):
    from jobs.cli import main
    from jobs.runs import write_best

    run = tmp_path / "run"
    _, best = our_task_model("bert", "classification")
    _, other = our_task_model("bert", "classification")
    perturb(other, seed=7)
    save_checkpoint(run / "checkpoint_a", best, "bert", best.cfg, tokenizer_dir=minilm_dir, task=best.task)
    save_checkpoint(run / "checkpoint_b", other, "bert", other.cfg, tokenizer_dir=minilm_dir, task=other.task)
    write_best(str(run), {"checkpoint": "checkpoint_a", "metric": "accuracy", "value": 0.9, "step": 10})
    assert main(["export", "--model", str(run), "--format", "hf", "--output", str(tmp_path / "hf")]) == 0
    assert "checkpoint_a" in capsys.readouterr().out
    assert (tmp_path / "hf" / "vocab.txt").exists() and (tmp_path / "hf" / "tokenizer.json").exists()
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert ref.config.id2label == dict(enumerate(LABELS))
    assert_same_logits(best, ref, "bert", "classification")


def test_ctx_export_gives_an_old_sentencepiece_checkpoint_the_tokenizer_transformers_reads(tmp_path):
    """A checkpoint whose SentencePiece tokenizer folder predates tokenizer.json (spm.model only)
    exports a folder AutoTokenizer loads, with our ids."""
    from jobs.cli import main
    from pipelines.sources import sample_text
    from pipelines.tokenizers import load_tokenizer, train_tokenizer

    repo = Path(__file__).resolve().parents[2]
    tok = train_tokenizer("sentencepiece-unigram", sample_text([str(repo / "data/sample/wordnet-0000-of-0008.txt.gz")], 200_000), 500)
    tok.save(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer.json").unlink()  # as tokenizers saved before it was written
    family, model = our_task_model("albert", "token-classification")
    save_checkpoint(tmp_path / "ck", model, family, model.cfg, tokenizer_dir=tmp_path / "tok", task=model.task)
    assert main(["export", "--model", str(tmp_path / "ck"), "--format", "hf", "--output", str(tmp_path / "hf")]) == 0
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = ["The bank of the river.", "Café 東京 😀"]
    assert ref(texts)["input_ids"] == load_tokenizer(tmp_path / "hf").encode_for_model(texts, 64)[0]


def test_ctx_export_refusal_names_family_kind_and_supported(tmp_path, capsys):
    from jobs.cli import main

    _, mc = our_task_model("gpt2", "multiple-choice")
    save_checkpoint(tmp_path / "ck", mc, "gpt", mc.cfg, task=mc.task)
    code = main(["export", "--model", str(tmp_path / "ck"), "--format", "hf", "--output", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and re.search(r"^ctx: error: .*family 'gpt' \(gpt2\) and task kind 'multiple-choice'.*"
                                   r"'classification', 'question-answering', 'regression', 'token-classification'", err), err
