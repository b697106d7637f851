"""Parity with Hugging Face transformers: the real all-MiniLM-L6-v2, and tiny random models both ways."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from ctxmodels.bert import PRESETS, BertForPreTraining
from ctxmodels.hf import export_hf_folder, load_hf_folder

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello!",
    "Contextual embeddings give every token a vector that depends on the whole sentence around it.",
    "Paris is the capital of France.",
]


def random_batch(vocab_size: int, pad_id: int, lengths=(12, 7, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, vocab_size, (len(lengths), T), generator=g)
    attn = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        attn[row, :n] = 1
    ids[attn == 0] = pad_id
    return ids, attn


def test_minilm_hidden_states_match_transformers_at_every_layer(minilm_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="ctxmodels.hf"):
        family, cfg, ours = load_hf_folder(minilm_dir)
    assert family == "bert" and (cfg.d_model, cfg.n_layer, cfg.n_head) == (384, 6, 12)
    assert "mlm.dense.weight" in caplog.text  # a bare BertModel folder: heads reported as fresh
    ours.eval()
    ref = transformers.BertModel.from_pretrained(minilm_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    assert (batch["attention_mask"] == 0).any(), "the batch must contain padding"
    with torch.no_grad():
        expected = ref(**batch, output_hidden_states=True).hidden_states
        got = ours.backbone.hidden_states(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
        pooled = ours.backbone(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])[1]
        ref_pooled = ref(**batch).pooler_output
    assert len(got) == len(expected) == 7
    real = batch["attention_mask"].bool()
    for layer, (a, b) in enumerate(zip(got, expected)):
        # Real tokens: the contract. Padding rows are don't-care outputs: the blocks skip them on
        # CPU (bert.Packing) and leave zeros there.
        diff = (a - b)[real].abs().max().item()
        assert diff <= 1e-4, f"layer {layer}: max abs diff {diff:.2e} at real tokens"
        if layer > 0:
            assert not a[~real].any(), f"layer {layer}: padding rows are not skipped"
    torch.testing.assert_close(pooled, ref_pooled, atol=1e-4, rtol=0)


def tiny_bert(preset: str, **kw) -> BertForPreTraining:
    torch.manual_seed(0)
    model = BertForPreTraining(dataclasses.replace(PRESETS[preset], **kw)).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorms, so a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def test_bert_export_loads_in_transformers_for_pretraining(tmp_path, minilm_dir):
    model = tiny_bert("tiny", activation="gelu_tanh")
    export_hf_folder(model, "bert", tmp_path, tokenizer_dir=minilm_dir)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "bert" and config["architectures"] == ["BertForPreTraining"]
    assert (tmp_path / "vocab.txt").exists() and (tmp_path / "tokenizer.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) == 1  # the tokenizer folder's weights are not copied

    ref, info = transformers.BertForPreTraining.from_pretrained(tmp_path, output_loading_info=True)
    ref.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids, attn = random_batch(model.cfg.vocab_size, 0)
    types = (torch.arange(ids.shape[1]) >= 5).long().expand_as(ids)
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=attn, token_type_ids=types)
        mlm = model.mlm_logits(ids, attn, types)
        nsp = model.nsp_logits(ids, attn, types)
    real = attn.bool()
    assert (out.prediction_logits - mlm)[real].abs().max() <= 1e-4
    assert (out.seq_relationship_logits - nsp).abs().max() <= 1e-4


def test_bert_without_nsp_exports_as_masked_lm(tmp_path):
    model = tiny_bert("tiny", nsp=False)
    export_hf_folder(model, "bert", tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    ref, info = transformers.BertForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, attn = random_batch(model.cfg.vocab_size, 0)
    with torch.no_grad():
        diff = (ref.eval()(input_ids=ids, attention_mask=attn).logits - model.mlm_logits(ids, attn))[attn.bool()]
    assert diff.abs().max() <= 1e-4


def test_roberta_export_loads_in_transformers_masked_lm(tmp_path):
    model = tiny_bert("roberta-tiny")
    export_hf_folder(model, "roberta", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "roberta" and config["architectures"] == ["RobertaForMaskedLM"]
    ref, info = transformers.RobertaForMaskedLM.from_pretrained(tmp_path, output_loading_info=True)
    ref.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids, attn = random_batch(model.cfg.vocab_size, model.cfg.pad_token_id)
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        states = model.backbone.hidden_states(ids, attn)
        mlm = model.mlm_logits(ids, attn)
    real = attn.bool()
    for a, b in zip(states, out.hidden_states):
        assert (a - b)[real].abs().max() <= 1e-4
    assert (out.logits - mlm)[real].abs().max() <= 1e-4


def test_export_refuses_wrong_family(tmp_path):
    with pytest.raises(ValueError, match="position_style"):
        export_hf_folder(tiny_bert("tiny"), "roberta", tmp_path)
    with pytest.raises(ValueError, match="family 'gpt'"):
        export_hf_folder(tiny_bert("tiny"), "gpt", tmp_path)


HF_TINY = dict(
    vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
    max_position_embeddings=40, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
)


def hf_tiny(cls_name: str, config_cls_name: str, **kw):
    torch.manual_seed(0)
    config = getattr(transformers, config_cls_name)(**{**HF_TINY, **kw})
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def test_load_hf_bert_for_pretraining(tmp_path):
    ref = hf_tiny("BertForPreTraining", "BertConfig", type_vocab_size=3, hidden_act="gelu_new", layer_norm_eps=1e-7)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    family, cfg, ours = load_hf_folder(tmp_path)
    assert family == "bert" and cfg.type_vocab_size == 3 and cfg.activation == "gelu_tanh"
    assert cfg.layer_norm_eps == 1e-7 and cfg.dropout == 0.1
    ours.eval()
    ids, attn = random_batch(99, 0)
    types = torch.randint(0, 3, ids.shape)
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=attn, token_type_ids=types, output_hidden_states=True)
        states = ours.backbone.hidden_states(ids, attn, types)
        mlm, nsp = ours.mlm_logits(ids, attn, types), ours.nsp_logits(ids, attn, types)
    real = attn.bool()
    for a, b in zip(states, out.hidden_states):
        assert (a - b)[real].abs().max() <= 1e-4
    assert (out.prediction_logits - mlm)[real].abs().max() <= 1e-4
    assert (out.seq_relationship_logits - nsp).abs().max() <= 1e-4


def test_load_hf_roberta_masked_lm(tmp_path, caplog):
    ref = hf_tiny("RobertaForMaskedLM", "RobertaConfig", type_vocab_size=1, pad_token_id=1, layer_norm_eps=1e-5)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    with caplog.at_level(logging.WARNING, logger="ctxmodels.hf"):
        family, cfg, ours = load_hf_folder(tmp_path)
    assert family == "roberta" and cfg.position_style == "roberta" and not cfg.nsp and cfg.pad_token_id == 1
    assert "pooler" in caplog.text and "mlm." not in caplog.text  # only the pooler is missing
    ours.eval()
    ids, attn = random_batch(99, 1)
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        states = ours.backbone.hidden_states(ids, attn)
        mlm = ours.mlm_logits(ids, attn)
    real = attn.bool()
    for a, b in zip(states, out.hidden_states):
        assert (a - b)[real].abs().max() <= 1e-4
    assert (out.logits - mlm)[real].abs().max() <= 1e-4


def test_load_bare_backbone_without_prefix_reports_fresh_heads(tmp_path, caplog):
    ref = hf_tiny("BertModel", "BertConfig")
    ref.save_pretrained(tmp_path, safe_serialization=True)
    assert not any(k.startswith("bert.") for k in load_file(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="ctxmodels.hf"):
        _, _, ours = load_hf_folder(tmp_path)
    assert "mlm.dense.weight" in caplog.text and "nsp.weight" in caplog.text
    ids, attn = random_batch(99, 0)
    with torch.no_grad():
        got = ours.eval().backbone(ids, attn)
        exp = ref(input_ids=ids, attention_mask=attn)
    assert (got[0] - exp.last_hidden_state)[attn.bool()].abs().max() <= 1e-4
    assert (got[1] - exp.pooler_output).abs().max() <= 1e-4


def test_shape_mismatch_names_the_key(tmp_path):
    hf_tiny("BertModel", "BertConfig").save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "encoder.layer.1.intermediate.dense.weight"
    tensors[key] = torch.zeros(36, 32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + r".*\(36, 32\).*\(37, 32\)"):
        load_hf_folder(tmp_path)


def test_pickle_only_folder_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", **HF_TINY}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ValueError, match="pytorch_model.bin.*safetensors"):
        load_hf_folder(tmp_path)


def test_unknown_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(ValueError, match="model_type='t5'"):
        load_hf_folder(tmp_path)
