"""Import and export Hugging Face folders (config.json + safetensors weights) for every family
transformers has: BERT, RoBERTa, ALBERT, GPT (``openai-gpt`` and ``gpt2``), XLNet and XLM;
pretraining models and the fine-tuned task heads of ``ctxmodels.tasks``.

Only safetensors are read: a folder holding only ``pytorch_model.bin`` (a pickle) is refused, so
loading a downloaded folder never runs code from it.

``CONVERTERS`` has one entry per family of ours, all of one shape (as litgpt's
``copy_weights_<family>``): the HF ``model_type``(s) it reads, two config translators, one
function ``weights(config, head) -> Weights`` giving the name table of one HF class, and the
task kinds transformers has a class for. Everything else (reading, shape checks, reporting,
writing) is shared code below the tables.

A name table row is ``(our name, HF name, how)``. HF names are full names in HF's head classes
("bert.encoder.layer.0...."); a bare base-model folder (``BertModel``, ``GPT2Model``) has them
without the prefix and is read as if it had it. A tuple of HF names means our tensor is their
concatenation along dim 0 (our fused QKV = query; key; value). ``how`` says how the tensor changes:

    copy        the same tensor
    transpose   HF's Conv1D keeps (in, out), nn.Linear (out, in)                 (GPT)
    heads_in    HF (D, H, Dh) used as x @ W   <->  our Linear weight (H * Dh, D)  (XLNet q, k, v, r)
    heads_out   HF (D, H, Dh) used as W vec   <->  our Linear weight (D, H * Dh)  (XLNet o)
    vector      HF (1, 1, D)                  <->  our (D,)                       (XLNet mask_emb)

Task heads (``ctxmodels.tasks``) and the transformers classes they equal (same function, same
logits, checked by tests/ctxmodels/test_hf_heads.py):
- BERT, RoBERTa, ALBERT: ``*ForSequenceClassification`` (classification and regression),
  ``*ForMultipleChoice``, ``*ForTokenClassification``, ``*ForQuestionAnswering``. Our pooler is
  BERT's and ALBERT's pooler; for RoBERTa's sequence classification it is ``classifier.dense``
  (dense + tanh on ``<s>``, the same function).
- GPT: we read the last real token; HF's ``*ForSequenceClassification`` reads the rightmost token
  that is not ``pad_token_id``: the same token when padding uses the tokenizer's padding id, which
  export writes into config.json. GPT-2 also has token classification and extractive QA.
  Multiple choice has no equal (``*DoubleHeadsModel`` reads a given token through a biased
  projection and adds an LM head), nor do similarity pairs read in both orders (``symmetric``).
- XLNet: sequence summary (dense + tanh) on the last token, ``logits_proj``; HF's summary reads
  the last position, which is the last real token because XLNet's tokenizer pads on the left.
  Ours pads on the right and reads the last real token: per example the same logits.
  QA is ``XLNetForQuestionAnsweringSimple`` (start/end logits), not the beam-search head.
- XLM: ``XLMWithLMHeadModel`` (our ``token_type_ids`` are its ``langs``), ``XLMForSequenceClassification``
  (its ``XLMSequenceSummary`` projects the first token straight to the labels, no pooler, no
  activation: our ``classifier`` on the ``first-state`` read), ``XLMForMultipleChoice``,
  ``XLMForTokenClassification`` and ``XLMForQuestionAnsweringSimple``. ``XLMForMultipleChoice``
  projects the first token to ``num_labels`` values and those to one score (``logits_proj``), with
  no activation between: on import the two products fold into our one (``W = P S``,
  ``b = P b_S + b_P``); on export ours is the summary of one label and ``logits_proj`` the
  identity. A causal XLM (``causal``: XLM's CLM) converts both ways as ``XLMWithLMHeadModel``; a
  sinusoidal or adaptive-softmax XLM is refused on import.
- An embedding model (task kind ``embedding``: no head, its pooled last layer is its output) exports
  as transformers' base model (``BertModel``, ``GPT2Model``, ...): the backbone's tensors without a
  prefix, as sentence-transformers' Transformer module loads them. A BERT backbone's pooler goes
  with it only where the BERT pretraining class has one (``nsp``); no pooling reads it.
- SpanBERT exports as BERT (same backbone and heads), without its span-boundary pretraining head.
- Never exported: feature-based task models (layer mixes, BiLSTMs); ELMo and Transformer-XL
  (transformers 5 has neither).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ctxmodels.albert import AlbertConfig
from ctxmodels.bert import BertConfig
from ctxmodels.gpt import GPTConfig
from ctxmodels.registry import family_spec, new_model
from ctxmodels.task_kinds import TASKS, label_names, task_of
from ctxmodels.tasks import TaskConfig, TaskModel, build_task_model
from ctxmodels.xlnet import XLNetConfig

log = logging.getLogger(__name__)

HfName = str | tuple[str, ...]
How = Literal["copy", "transpose", "heads_in", "heads_out", "vector"]
Row = tuple[str, HfName, How]
Head = str  # "pretraining" or a ctxmodels.tasks task kind


@dataclass(frozen=True)
class Weights:
    """How the tensors of one transformers class map onto one of our models."""

    hf_class: str  # the transformers class (config.json "architectures")
    prefix: str  # the base model's attribute in HF's head classes; absent from bare base-model folders
    required: list[Row]  # must be in the folder on import
    optional: list[Row] = field(default_factory=list)  # written on export; on import loaded when present
    load_only: list[Row] = field(default_factory=list)  # loaded when present, never written (the class lacks it)
    tied: dict[str, str] = field(default_factory=dict)  # HF copies of tied tensors -> what they equal
    skip: tuple[str, ...] = ()  # suffixes of HF buffers that older checkpoints saved
    unmatched: tuple[str, ...] = ()  # prefixes of our tensors the class has no counterpart of (XLM's pooler)
    # HF tensors our model has no counterpart of, written on export with these values (XLM's
    # multiple-choice logits_proj, the identity), and how an imported folder's tensors are brought
    # to the rows above first (that logits_proj folded into the projection before it).
    constants: dict[str, Tensor] = field(default_factory=dict)
    fold: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None


@dataclass(frozen=True)
class Converter:
    """One family's conversion, in the same four pieces for every family."""

    model_types: tuple[str, ...]  # HF config.json "model_type" values read as this family
    config_from_hf: Callable[[dict, str], Any]  # (config.json, folder for messages) -> our config
    config_to_hf: Callable[[Any], dict]  # our config -> config.json fields, "model_type" included
    weights: Callable[[Any, Head], Weights]  # (our config, head) -> the name table of that head's class
    tasks: dict[str, dict[str, str]]  # model_type -> {task kind: transformers class}


def expand(rows: list[Row], n: int) -> list[Row]:
    """Instantiate the rows with "{i}" once per layer (or layer group) 0..n-1; others once."""
    out: list[Row] = []
    for ours, hf, how in rows:
        if "{i}" not in ours:
            out.append((ours, hf, how))
            continue
        for i in range(n):
            name = tuple(h.format(i=i) for h in hf) if isinstance(hf, tuple) else hf.format(i=i)
            out.append((ours.format(i=i), name, how))
    return out


def under(rows: list[Row], ours: str, hf: str) -> list[Row]:
    """Rows with our prefix (e.g. "backbone.") and HF's (e.g. "bert.") put in front of the names."""
    return [
        (ours + o, tuple(hf + x for x in h) if isinstance(h, tuple) else hf + h, how) for o, h, how in rows
    ]


def linear(ours: str, hf: str, bias: bool = True) -> list[Row]:
    """The rows of one nn.Linear (or LayerNorm) copied as it is."""
    rows: list[Row] = [(f"{ours}.weight", f"{hf}.weight", "copy")]
    return rows + [(f"{ours}.bias", f"{hf}.bias", "copy")] if bias else rows


# ----------------------------------------------------------------------------------------------
# BERT / RoBERTa: our BertModel names (under "backbone.") -> HF names (under "bert." / "roberta.")
# ----------------------------------------------------------------------------------------------

BERT_BACKBONE: list[Row] = [
    ("embeddings.word.weight", "embeddings.word_embeddings.weight", "copy"),
    ("embeddings.position.weight", "embeddings.position_embeddings.weight", "copy"),
    ("embeddings.token_type.weight", "embeddings.token_type_embeddings.weight", "copy"),
    ("embeddings.ln.weight", "embeddings.LayerNorm.weight", "copy"),
    ("embeddings.ln.bias", "embeddings.LayerNorm.bias", "copy"),
    ("layers.{i}.attn.qkv.weight", (
        "encoder.layer.{i}.attention.self.query.weight",
        "encoder.layer.{i}.attention.self.key.weight",
        "encoder.layer.{i}.attention.self.value.weight",
    ), "copy"),
    ("layers.{i}.attn.qkv.bias", (
        "encoder.layer.{i}.attention.self.query.bias",
        "encoder.layer.{i}.attention.self.key.bias",
        "encoder.layer.{i}.attention.self.value.bias",
    ), "copy"),
    ("layers.{i}.attn.proj.weight", "encoder.layer.{i}.attention.output.dense.weight", "copy"),
    ("layers.{i}.attn.proj.bias", "encoder.layer.{i}.attention.output.dense.bias", "copy"),
    ("layers.{i}.ln1.weight", "encoder.layer.{i}.attention.output.LayerNorm.weight", "copy"),
    ("layers.{i}.ln1.bias", "encoder.layer.{i}.attention.output.LayerNorm.bias", "copy"),
    ("layers.{i}.ffn.fc_in.weight", "encoder.layer.{i}.intermediate.dense.weight", "copy"),
    ("layers.{i}.ffn.fc_in.bias", "encoder.layer.{i}.intermediate.dense.bias", "copy"),
    ("layers.{i}.ffn.fc_out.weight", "encoder.layer.{i}.output.dense.weight", "copy"),
    ("layers.{i}.ffn.fc_out.bias", "encoder.layer.{i}.output.dense.bias", "copy"),
    ("layers.{i}.ln2.weight", "encoder.layer.{i}.output.LayerNorm.weight", "copy"),
    ("layers.{i}.ln2.bias", "encoder.layer.{i}.output.LayerNorm.bias", "copy"),
]
BERT_POOLER: list[Row] = linear("pooler", "pooler.dense")

BERT_PRETRAINING_HEADS: list[Row] = [  # full names of BertForPreTraining
    *linear("mlm.dense", "cls.predictions.transform.dense"),
    *linear("mlm.ln", "cls.predictions.transform.LayerNorm"),
    ("mlm.bias", "cls.predictions.bias", "copy"),
]
BERT_NSP: list[Row] = linear("nsp", "cls.seq_relationship")
ROBERTA_LM_HEAD: list[Row] = [  # full names of RobertaForMaskedLM
    *linear("mlm.dense", "lm_head.dense"),
    *linear("mlm.ln", "lm_head.layer_norm"),
    ("mlm.bias", "lm_head.bias", "copy"),
]

# Our BertConfig field -> HF config.json key. Fields with None as default are required in config.json.
BERT_CONFIG_KEYS: dict[str, tuple[str, object]] = {
    "vocab_size": ("vocab_size", None),
    "d_model": ("hidden_size", None),
    "n_layer": ("num_hidden_layers", None),
    "n_head": ("num_attention_heads", None),
    "d_ff": ("intermediate_size", None),
    "max_seq_len": ("max_position_embeddings", None),
    "type_vocab_size": ("type_vocab_size", 2),
    "layer_norm_eps": ("layer_norm_eps", 1e-12),
    "pad_token_id": ("pad_token_id", 0),
    "dropout": ("hidden_dropout_prob", 0.1),
    "attn_dropout": ("attention_probs_dropout_prob", 0.1),
    "init_std": ("initializer_range", 0.02),
}

HF_ACT_TO_OURS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
OURS_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}

BERT_TASKS = {
    "bert": {
        "classification": "BertForSequenceClassification",
        "regression": "BertForSequenceClassification",
        "multiple-choice": "BertForMultipleChoice",
        "token-classification": "BertForTokenClassification",
        "question-answering": "BertForQuestionAnswering",
    },
}
ROBERTA_TASKS = {
    "roberta": {
        "classification": "RobertaForSequenceClassification",
        "regression": "RobertaForSequenceClassification",
        "multiple-choice": "RobertaForMultipleChoice",
        "token-classification": "RobertaForTokenClassification",
        "question-answering": "RobertaForQuestionAnswering",
    },
}


def _bert_config(hf: dict, where: str, family: str) -> BertConfig:
    kwargs: dict[str, object] = {}
    for ours, (key, default) in BERT_CONFIG_KEYS.items():
        if key in hf and hf[key] is not None:
            kwargs[ours] = hf[key]
        elif default is None:
            raise ValueError(f"{where}: config.json has no {key!r} (needed for BertConfig.{ours})")
        else:
            kwargs[ours] = default
    act = hf.get("hidden_act", "gelu")
    if act not in HF_ACT_TO_OURS:
        raise ValueError(f"{where}: config.json hidden_act={act!r} is not supported; expected one of {sorted(HF_ACT_TO_OURS)}")
    pos = hf.get("position_embedding_type", "absolute")
    if pos != "absolute":
        raise ValueError(f"{where}: config.json position_embedding_type={pos!r}; only 'absolute' is supported")
    kwargs["activation"] = HF_ACT_TO_OURS[act]
    if family == "roberta":
        kwargs.update(position_style="roberta", nsp=False)
        if act != "gelu":
            log.warning("%s: RoBERTa's HF lm_head always uses exact gelu; ours will use %s", where, act)
    try:
        return BertConfig(**kwargs)
    except ValueError as e:
        raise ValueError(f"{where}: config.json gives an invalid model: {e}") from e


def bert_config_from_hf(hf: dict, where: str) -> BertConfig:
    return _bert_config(hf, where, "bert")


def roberta_config_from_hf(hf: dict, where: str) -> BertConfig:
    return _bert_config(hf, where, "roberta")


def _bert_config_to_hf(cfg: BertConfig, model_type: str, style: str) -> dict:
    if cfg.position_style != style:
        raise ValueError(f"export as {model_type!r} needs config.position_style={style!r}, got {cfg.position_style!r}")
    out: dict[str, object] = {"model_type": model_type}
    for ours, (key, _) in BERT_CONFIG_KEYS.items():
        out[key] = getattr(cfg, ours)
    out["hidden_act"] = OURS_ACT_TO_HF[cfg.activation]
    out["position_embedding_type"] = "absolute"
    out["tie_word_embeddings"] = True
    return out


def bert_config_to_hf(cfg: BertConfig) -> dict:
    return _bert_config_to_hf(cfg, "bert", "absolute")


def roberta_config_to_hf(cfg: BertConfig) -> dict:
    return _bert_config_to_hf(cfg, "roberta", "roberta")


def _bert_like_weights(cfg: BertConfig, head: Head, model_type: str) -> Weights:
    p = model_type + "."
    backbone = under(expand(BERT_BACKBONE, cfg.n_layer), "backbone.", p)
    pooler = under(BERT_POOLER, "backbone.", p)
    tasks = (BERT_TASKS if model_type == "bert" else ROBERTA_TASKS)[model_type]
    skip = ("embeddings.position_ids", "embeddings.token_type_ids")  # non-persistent buffers, once saved
    if head == "pretraining" and model_type == "bert":
        if cfg.nsp:  # BertForPreTraining = BertModel with pooler + MLM + NSP
            hf_class, heads = "BertForPreTraining", pooler + BERT_PRETRAINING_HEADS + BERT_NSP
        else:  # the masked-LM class has no pooler
            hf_class, heads = "BertForMaskedLM", BERT_PRETRAINING_HEADS
        tied = {"cls.predictions.decoder.weight": p + "embeddings.word_embeddings.weight",
                "cls.predictions.decoder.bias": "cls.predictions.bias"}
        return Weights(hf_class, model_type, backbone, optional=heads, tied=tied, skip=skip)
    if head == "pretraining":  # RoBERTa
        if cfg.activation != "gelu":
            raise ValueError(
                f"RobertaForMaskedLM's lm_head always applies exact gelu; config.activation={cfg.activation!r} "
                "would export a different model"
            )
        if cfg.nsp:
            log.warning("RobertaForMaskedLM has no NSP head and no pooler; they are not exported")
        tied = {"lm_head.decoder.weight": p + "embeddings.word_embeddings.weight", "lm_head.decoder.bias": "lm_head.bias"}
        # RobertaForMaskedLM has no pooler; bare RobertaModel folders do, and fine-tuning reads it.
        return Weights("RobertaForMaskedLM", model_type, backbone, optional=ROBERTA_LM_HEAD, load_only=pooler,
                       tied=tied, skip=skip)
    task = TASKS[head]
    if task.reads == "tokens":  # no pooler in these classes
        heads = linear(task.head, task.head)
    elif task.reads == "sequence" and model_type == "roberta":
        # RobertaClassificationHead: dense + tanh on <s>, then out_proj: our pooler and classifier.
        heads = linear("backbone.pooler", "classifier.dense") + linear("classifier", "classifier.out_proj")
    else:
        heads = pooler + linear("classifier", "classifier")
    return Weights(tasks[head], model_type, backbone + heads, skip=skip)


def bert_weights(cfg: BertConfig, head: Head) -> Weights:
    return _bert_like_weights(cfg, head, "bert")


def roberta_weights(cfg: BertConfig, head: Head) -> Weights:
    return _bert_like_weights(cfg, head, "roberta")


# ----------------------------------------------------------------------------------------------
# ALBERT. An HF layer group holds one layer (inner_group_num=1) applied to n_layer / num_hidden_groups
# consecutive layers: share="all" is one group, share="none" one group per layer. Sharing only
# attention or only the FFN has no HF equivalent.
# ----------------------------------------------------------------------------------------------

ALBERT_GROUP = "encoder.albert_layer_groups.{i}.albert_layers.0."
ALBERT_BACKBONE: list[Row] = [  # our AlbertModel (under "backbone.") -> HF (under "albert.")
    ("word_emb.weight", "embeddings.word_embeddings.weight", "copy"),
    ("pos_emb.weight", "embeddings.position_embeddings.weight", "copy"),
    ("type_emb.weight", "embeddings.token_type_embeddings.weight", "copy"),
    *linear("emb_ln", "embeddings.LayerNorm"),
    *linear("emb_proj", "encoder.embedding_hidden_mapping_in"),
    *linear("attention.{i}.query", ALBERT_GROUP + "attention.query"),
    *linear("attention.{i}.key", ALBERT_GROUP + "attention.key"),
    *linear("attention.{i}.value", ALBERT_GROUP + "attention.value"),
    *linear("attention.{i}.dense", ALBERT_GROUP + "attention.dense"),
    *linear("attention.{i}.ln", ALBERT_GROUP + "attention.LayerNorm"),
    *linear("ffn.{i}.fc", ALBERT_GROUP + "ffn"),
    *linear("ffn.{i}.out", ALBERT_GROUP + "ffn_output"),
    *linear("ffn.{i}.ln", ALBERT_GROUP + "full_layer_layer_norm"),
]
ALBERT_POOLER: list[Row] = linear("pooler", "pooler")
ALBERT_MLM: list[Row] = [
    *linear("mlm_head.dense", "predictions.dense"),
    *linear("mlm_head.ln", "predictions.LayerNorm"),
    ("mlm_head.bias", "predictions.bias", "copy"),
]
ALBERT_SOP: list[Row] = linear("sop_head", "sop_classifier.classifier")

ALBERT_ACT_TO_OURS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
ALBERT_ACT_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}

ALBERT_TASKS = {
    "albert": {
        "classification": "AlbertForSequenceClassification",
        "regression": "AlbertForSequenceClassification",
        "multiple-choice": "AlbertForMultipleChoice",
        "token-classification": "AlbertForTokenClassification",
        "question-answering": "AlbertForQuestionAnswering",
    },
}


def albert_config_from_hf(hf: dict, where: str) -> AlbertConfig:
    n_layer, n_groups = hf["num_hidden_layers"], hf.get("num_hidden_groups", 1)
    if hf.get("inner_group_num", 1) != 1 or n_groups not in (1, n_layer):
        raise ValueError(
            f"{where}: HF ALBERT with num_hidden_groups={n_groups}, inner_group_num={hf.get('inner_group_num')} "
            f"is not supported: use inner_group_num 1 and num_hidden_groups 1 (share='all') "
            f"or {n_layer} (share='none')"
        )
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{where}: config.json position_embedding_type={hf['position_embedding_type']!r}; only 'absolute' is supported")
    act = hf.get("hidden_act", "gelu_new")
    if act not in ALBERT_ACT_TO_OURS:
        raise ValueError(f"{where}: config.json hidden_act={act!r} is not supported; use one of {sorted(ALBERT_ACT_TO_OURS)}")
    return AlbertConfig(
        vocab_size=hf["vocab_size"],
        embedding_size=hf["embedding_size"],
        d_model=hf["hidden_size"],
        n_layer=n_layer,
        n_head=hf["num_attention_heads"],
        d_ff=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        type_vocab_size=hf.get("type_vocab_size", 2),
        dropout=hf.get("hidden_dropout_prob", 0.0),
        attn_dropout=hf.get("attention_probs_dropout_prob", 0.0),
        layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        pad_token_id=hf.get("pad_token_id", 0),
        activation=ALBERT_ACT_TO_OURS[act],
        share="all" if n_groups == 1 else "none",
        init_std=hf.get("initializer_range", 0.02),
        sop=True,
    )


def _albert_groups(cfg: AlbertConfig) -> int:
    if cfg.share == "all":
        return 1
    if cfg.share == "none":
        return cfg.n_layer
    raise ValueError(f"AlbertConfig.share={cfg.share!r} has no Hugging Face equivalent (only 'all', 'none')")


def albert_config_to_hf(cfg: AlbertConfig) -> dict:
    return {
        "model_type": "albert",
        "vocab_size": cfg.vocab_size,
        "embedding_size": cfg.embedding_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layer,
        "num_hidden_groups": _albert_groups(cfg),
        "inner_group_num": 1,
        "num_attention_heads": cfg.n_head,
        "intermediate_size": cfg.d_ff,
        "hidden_act": ALBERT_ACT_TO_HF[cfg.activation],
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attn_dropout,
        "classifier_dropout_prob": cfg.dropout,
        "max_position_embeddings": cfg.max_seq_len,
        "type_vocab_size": cfg.type_vocab_size,
        "initializer_range": cfg.init_std,
        "layer_norm_eps": cfg.layer_norm_eps,
        "position_embedding_type": "absolute",
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": True,
    }


def albert_weights(cfg: AlbertConfig, head: Head) -> Weights:
    backbone = under(expand(ALBERT_BACKBONE, _albert_groups(cfg)), "backbone.", "albert.")
    pooler = under(ALBERT_POOLER, "backbone.", "albert.")
    skip = ("embeddings.position_ids", "embeddings.token_type_ids")
    if head == "pretraining":
        tied = {"predictions.decoder.weight": "albert.embeddings.word_embeddings.weight",
                "predictions.decoder.bias": "predictions.bias"}
        if cfg.sop:  # hub checkpoints may lack the SOP head: optional, as every head
            return Weights("AlbertForPreTraining", "albert", backbone, optional=pooler + ALBERT_MLM + ALBERT_SOP,
                           tied=tied, skip=skip)
        return Weights("AlbertForMaskedLM", "albert", backbone, optional=ALBERT_MLM, load_only=pooler, tied=tied, skip=skip)
    task = TASKS[head]
    if task.reads == "tokens":  # no pooler in these classes
        heads = linear(task.head, task.head)
    else:
        heads = pooler + linear("classifier", "classifier")
    return Weights(ALBERT_TASKS["albert"][head], "albert", backbone + heads, skip=skip)


# ----------------------------------------------------------------------------------------------
# GPT: "openai-gpt" (norm="post") and "gpt2" (norm="pre"). ``ln_1`` is the attention sub-layer's
# LayerNorm in both (after the residual add in GPT-1, before it in GPT-2).
# ----------------------------------------------------------------------------------------------

GPT_LAYER: list[Row] = [  # our GPTModel (under "backbone.") -> HF (under "transformer.")
    ("blocks.{i}.attn.qkv.weight", "h.{i}.attn.c_attn.weight", "transpose"),
    ("blocks.{i}.attn.qkv.bias", "h.{i}.attn.c_attn.bias", "copy"),
    ("blocks.{i}.attn.proj.weight", "h.{i}.attn.c_proj.weight", "transpose"),
    ("blocks.{i}.attn.proj.bias", "h.{i}.attn.c_proj.bias", "copy"),
    *linear("blocks.{i}.ln_attn", "h.{i}.ln_1"),
    ("blocks.{i}.mlp.fc.weight", "h.{i}.mlp.c_fc.weight", "transpose"),
    ("blocks.{i}.mlp.fc.bias", "h.{i}.mlp.c_fc.bias", "copy"),
    ("blocks.{i}.mlp.proj.weight", "h.{i}.mlp.c_proj.weight", "transpose"),
    ("blocks.{i}.mlp.proj.bias", "h.{i}.mlp.c_proj.bias", "copy"),
    *linear("blocks.{i}.ln_mlp", "h.{i}.ln_2"),
]
GPT_BACKBONE: dict[str, list[Row]] = {  # HF model_type -> backbone rows
    "openai-gpt": [
        ("tok_emb.weight", "tokens_embed.weight", "copy"),
        ("pos_emb.weight", "positions_embed.weight", "copy"),
        *GPT_LAYER,
    ],
    "gpt2": [
        ("tok_emb.weight", "wte.weight", "copy"),
        ("pos_emb.weight", "wpe.weight", "copy"),
        *GPT_LAYER,
        *linear("ln_f", "ln_f"),
    ],
}

# HF activation -> ours, and back. OpenAI GPT's "gelu" is the tanh approximation.
GPT_ACT_TO_OURS: dict[str, dict[str, str]] = {
    "openai-gpt": {"gelu": "gelu_tanh"},
    "gpt2": {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"},
}
GPT_ACT_TO_HF: dict[str, dict[str, str]] = {
    "openai-gpt": {"gelu_tanh": "gelu"},
    "gpt2": {"gelu_tanh": "gelu_new", "gelu": "gelu"},
}

GPT_TASKS = {
    "openai-gpt": {
        "classification": "OpenAIGPTForSequenceClassification",
        "regression": "OpenAIGPTForSequenceClassification",
    },
    "gpt2": {
        "classification": "GPT2ForSequenceClassification",
        "regression": "GPT2ForSequenceClassification",
        "token-classification": "GPT2ForTokenClassification",
        "question-answering": "GPT2ForQuestionAnswering",
    },
}


def gpt_config_from_hf(hf: dict, where: str) -> GPTConfig:
    model_type = hf["model_type"]
    act_key = "afn" if model_type == "openai-gpt" else "activation_function"
    act = hf.get(act_key, "gelu" if model_type == "openai-gpt" else "gelu_new")
    if act not in GPT_ACT_TO_OURS[model_type]:
        raise ValueError(f"{where}: config.json {act_key}={act!r} is not supported; use one of {sorted(GPT_ACT_TO_OURS[model_type])}")
    if model_type == "gpt2":
        for key, ok in {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                        "reorder_and_upcast_attn": False, "add_cross_attention": False}.items():
            if hf.get(key, ok) != ok:
                raise ValueError(f"{where}: config.json {key}={hf[key]!r} is not supported by ctxmodels.gpt (needs {ok})")
    n_embd = hf["n_embd"]
    return GPTConfig(
        vocab_size=hf["vocab_size"],
        d_model=n_embd,
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        d_ff=hf.get("n_inner") or 4 * n_embd,  # OpenAI GPT hard-codes 4 * n_embd; GPT-2's None means the same
        max_seq_len=hf["n_positions"],
        dropout=hf.get("resid_pdrop", 0.1),  # HF has three dropout rates; ours is one
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        norm="post" if model_type == "openai-gpt" else "pre",
        activation=GPT_ACT_TO_OURS[model_type][act],
        init_std=hf.get("initializer_range", 0.02),
    )


def gpt_config_to_hf(cfg: GPTConfig) -> dict:
    model_type = "openai-gpt" if cfg.norm == "post" else "gpt2"
    act = GPT_ACT_TO_HF[model_type].get(cfg.activation)
    if act is None:
        raise ValueError(f"GPTConfig.activation={cfg.activation!r} has no HF {model_type} equivalent")
    out = {
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": cfg.layer_norm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": True,
    }
    if model_type == "openai-gpt":
        if cfg.d_ff != 4 * cfg.d_model:
            raise ValueError(f"GPTConfig.d_ff must be 4 * d_model for HF openai-gpt, got {cfg.d_ff}")
        return {**out, "afn": act}
    return {**out, "n_inner": cfg.d_ff, "activation_function": act}


def gpt_weights(cfg: GPTConfig, head: Head) -> Weights:
    model_type = "openai-gpt" if cfg.norm == "post" else "gpt2"
    backbone = under(expand(GPT_BACKBONE[model_type], cfg.n_layer), "backbone.", "transformer.")
    skip = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old checkpoints
    if head == "pretraining":
        hf_class = "OpenAIGPTLMHeadModel" if model_type == "openai-gpt" else "GPT2LMHeadModel"
        emb = backbone[0][1]
        return Weights(hf_class, "transformer", backbone, tied={"lm_head.weight": emb}, skip=skip)
    task = TASKS[head]
    if task.reads == "tokens":
        heads = linear(task.head, task.head)
    else:  # *ForSequenceClassification's score: no bias
        heads = linear("classifier", "score", bias=False)
    return Weights(GPT_TASKS[model_type][head], "transformer", backbone + heads, skip=skip)


# ----------------------------------------------------------------------------------------------
# XLNet
# ----------------------------------------------------------------------------------------------

XLNET_BACKBONE: list[Row] = [  # our XLNetModel (under "backbone.") -> HF (under "transformer.")
    ("word_emb.weight", "word_embedding.weight", "copy"),
    ("mask_emb", "mask_emb", "vector"),
    ("layers.{i}.attn.q.weight", "layer.{i}.rel_attn.q", "heads_in"),
    ("layers.{i}.attn.k.weight", "layer.{i}.rel_attn.k", "heads_in"),
    ("layers.{i}.attn.v.weight", "layer.{i}.rel_attn.v", "heads_in"),
    ("layers.{i}.attn.r.weight", "layer.{i}.rel_attn.r", "heads_in"),
    ("layers.{i}.attn.o.weight", "layer.{i}.rel_attn.o", "heads_out"),
    ("layers.{i}.attn.u", "layer.{i}.rel_attn.r_w_bias", "copy"),
    ("layers.{i}.attn.v_bias", "layer.{i}.rel_attn.r_r_bias", "copy"),
    ("layers.{i}.attn.s_bias", "layer.{i}.rel_attn.r_s_bias", "copy"),
    ("layers.{i}.attn.seg_embed", "layer.{i}.rel_attn.seg_embed", "copy"),
    *linear("layers.{i}.attn.ln", "layer.{i}.rel_attn.layer_norm"),
    *linear("layers.{i}.ff.fc1", "layer.{i}.ff.layer_1"),
    *linear("layers.{i}.ff.fc2", "layer.{i}.ff.layer_2"),
    *linear("layers.{i}.ff.ln", "layer.{i}.ff.layer_norm"),
]

XLNET_TASKS = {
    "xlnet": {
        "classification": "XLNetForSequenceClassification",
        "regression": "XLNetForSequenceClassification",
        "multiple-choice": "XLNetForMultipleChoice",
        "token-classification": "XLNetForTokenClassification",
        "question-answering": "XLNetForQuestionAnsweringSimple",
    },
}
XLNET_MAX_SEQ_LEN = 512  # HF's XLNet config has no sequence length (positions are relative)


def xlnet_config_from_hf(hf: dict, where: str) -> XLNetConfig:
    for key, expected in (("attn_type", "bi"), ("bi_data", False), ("same_length", False)):
        if hf.get(key, expected) != expected:
            raise ValueError(f"{where}: config.json {key}={hf[key]!r} is not supported (only {expected!r})")
    summary = (hf.get("summary_type", "last"), hf.get("summary_use_proj", True), hf.get("summary_activation", "tanh"))
    if summary != ("last", True, "tanh"):
        raise ValueError(f"{where}: config.json summary_type/use_proj/activation={summary}; our XLNet head is ('last', True, 'tanh')")
    clamp = hf.get("clamp_len", -1)
    return XLNetConfig(
        vocab_size=hf["vocab_size"], d_model=hf["d_model"], n_layer=hf["n_layer"], n_head=hf["n_head"],
        # HF mem_len None means "keep everything"; without a bound we keep no memory
        d_ff=hf["d_inner"], max_seq_len=XLNET_MAX_SEQ_LEN, mem_len=hf.get("mem_len") or 0,
        reuse_len=hf.get("reuse_len"), dropout=hf.get("dropout", 0.1), activation=hf.get("ff_activation", "gelu"),
        clamp_len=None if clamp is None or clamp <= 0 else clamp, layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
        init_std=hf.get("initializer_range", 0.02),
    )


def xlnet_config_to_hf(cfg: XLNetConfig) -> dict:
    if cfg.head_dim * cfg.n_head != cfg.d_model:
        raise ValueError(f"XLNetConfig.d_head={cfg.d_head}: HF XLNet needs d_head = d_model // n_head = {cfg.d_model // cfg.n_head}")
    return {
        "model_type": "xlnet",
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "d_inner": cfg.d_ff,
        "ff_activation": cfg.activation,
        "attn_type": "bi",
        "initializer_range": cfg.init_std,
        "layer_norm_eps": cfg.layer_norm_eps,
        "dropout": cfg.dropout,
        "mem_len": cfg.mem_len,
        "reuse_len": cfg.reuse_len,
        "clamp_len": -1 if cfg.clamp_len is None else cfg.clamp_len,
        "bi_data": False,
        "same_length": False,
        "summary_type": "last",
        "summary_use_proj": True,
        "summary_activation": "tanh",
        "summary_last_dropout": cfg.dropout,
        "tie_word_embeddings": True,
    }


def xlnet_weights(cfg: XLNetConfig, head: Head) -> Weights:
    backbone = under(expand(XLNET_BACKBONE, cfg.n_layer), "backbone.", "transformer.")
    if head == "pretraining":
        return Weights("XLNetLMHeadModel", "transformer", backbone, optional=[("lm_bias", "lm_loss.bias", "copy")],
                       tied={"lm_loss.weight": "transformer.word_embedding.weight"})
    task = TASKS[head]
    if task.reads == "tokens":
        heads = linear(task.head, task.head)
    else:
        heads = linear("summary", "sequence_summary.summary") + linear("classifier", "logits_proj")
    return Weights(XLNET_TASKS["xlnet"][head], "transformer", backbone + heads)


# ----------------------------------------------------------------------------------------------
# XLM (Lample & Conneau 2019): our BERT with XLM's presets (``ctxmodels.bert``) -> XLMModel's names.
# HF's language table (``lang_embeddings``) exists only with n_langs > 1 and use_lang_emb; ours is
# the segment table, and a model without one has type_vocab_size 0. HF's feed-forward layer is
# always 4 * emb_dim wide. XLM has no pooler: its sequence summary is one projection of the first
# token's state to the labels (summary_type "first", summary_proj_to_labels, no activation), which
# is our classifier on that state (``ctxmodels.tasks`` reads "first-state" for XLM).
# ----------------------------------------------------------------------------------------------

XLM_BACKBONE: list[Row] = [  # our BertModel (under "backbone.") -> HF XLMModel (under "transformer.")
    ("embeddings.word.weight", "embeddings.weight", "copy"),
    ("embeddings.position.weight", "position_embeddings.weight", "copy"),
    *linear("embeddings.ln", "layer_norm_emb"),
    ("layers.{i}.attn.qkv.weight", tuple(f"attentions.{{i}}.{n}_lin.weight" for n in "qkv"), "copy"),
    ("layers.{i}.attn.qkv.bias", tuple(f"attentions.{{i}}.{n}_lin.bias" for n in "qkv"), "copy"),
    *linear("layers.{i}.attn.proj", "attentions.{i}.out_lin"),
    *linear("layers.{i}.ln1", "layer_norm1.{i}"),
    *linear("layers.{i}.ffn.fc_in", "ffns.{i}.lin1"),
    *linear("layers.{i}.ffn.fc_out", "ffns.{i}.lin2"),
    *linear("layers.{i}.ln2", "layer_norm2.{i}"),
]
XLM_LANGS: list[Row] = [("embeddings.token_type.weight", "lang_embeddings.weight", "copy")]

XLM_TASKS = {
    "xlm": {
        "classification": "XLMForSequenceClassification",
        "regression": "XLMForSequenceClassification",
        "multiple-choice": "XLMForMultipleChoice",
        "token-classification": "XLMForTokenClassification",
        "question-answering": "XLMForQuestionAnsweringSimple",
    },
}


def xlm_config_from_hf(hf: dict, where: str) -> BertConfig:
    for key, ours_only in (("sinusoidal_embeddings", False), ("asm", False), ("is_encoder", True)):
        if hf.get(key, ours_only) != ours_only:
            raise ValueError(f"{where}: config.json {key}={hf[key]!r} is not supported (only {ours_only!r}): our XLM is "
                             "an encoder with learned positions and a full-softmax prediction layer")
    if not isinstance(hf.get("causal", False), bool):
        raise ValueError(f"{where}: config.json causal={hf['causal']!r} must be true or false")
    for key in ("emb_dim", "n_layers", "n_heads"):
        if key not in hf:
            raise ValueError(f"{where}: config.json has no {key!r} (needed for an XLM model)")
    vocab = hf.get("vocab_size", hf.get("n_words"))
    if vocab is None:
        raise ValueError(f"{where}: config.json has no 'vocab_size' (or 'n_words')")
    n_langs = int(hf.get("n_langs", 1))
    pad = hf.get("pad_token_id", hf.get("pad_index", 2))
    try:
        return BertConfig(
            vocab_size=vocab, d_model=hf["emb_dim"], n_layer=hf["n_layers"], n_head=hf["n_heads"], d_ff=4 * hf["emb_dim"],
            max_seq_len=hf.get("max_position_embeddings", 512),
            type_vocab_size=n_langs if n_langs > 1 and hf.get("use_lang_emb", True) else 0,
            dropout=hf.get("dropout", 0.1), attn_dropout=hf.get("attention_dropout", 0.1),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12), pad_token_id=2 if pad is None else pad,
            activation="gelu" if hf.get("gelu_activation", True) else "relu", init_std=hf.get("init_std", 0.02),
            nsp=False, mlm_transform=False, causal=hf.get("causal", False),
        )
    except ValueError as e:
        raise ValueError(f"{where}: config.json gives an invalid model: {e}") from e


def xlm_config_to_hf(cfg: BertConfig) -> dict:
    problems = []
    if cfg.mlm_transform:
        problems.append("mlm_transform is True (XLM's prediction layer has no dense + LayerNorm transform)")
    if cfg.d_ff != 4 * cfg.d_model:
        problems.append(f"d_ff={cfg.d_ff} (HF XLM's feed-forward layer is 4 * d_model = {4 * cfg.d_model})")
    if cfg.position_style != "absolute":
        problems.append(f"position_style={cfg.position_style!r} (XLM counts positions from 0)")
    if cfg.activation not in ("gelu", "relu"):
        problems.append(f"activation={cfg.activation!r} (XLM has exact gelu or relu)")
    if cfg.type_vocab_size == 1:
        problems.append("type_vocab_size=1 (HF XLM has no language table for one language: use 0)")
    if cfg.sbo or cfg.nsp:
        problems.append("a span-boundary or next-sentence head (XLM has neither)")
    if problems:
        raise ValueError("this model does not fit XLMWithLMHeadModel: " + "; ".join(problems))
    return {
        "model_type": "xlm", "vocab_size": cfg.vocab_size, "emb_dim": cfg.d_model, "n_layers": cfg.n_layer,
        "n_heads": cfg.n_head, "max_position_embeddings": cfg.max_seq_len, "n_langs": max(cfg.type_vocab_size, 1),
        "use_lang_emb": cfg.type_vocab_size > 1, "dropout": cfg.dropout, "attention_dropout": cfg.attn_dropout,
        "gelu_activation": cfg.activation == "gelu", "sinusoidal_embeddings": False, "causal": cfg.causal, "asm": False,
        "is_encoder": True, "layer_norm_eps": cfg.layer_norm_eps, "init_std": cfg.init_std,
        "embed_init_std": cfg.init_std, "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": True,
    }


def xlm_weights(cfg: BertConfig, head: Head) -> Weights:
    rows = XLM_BACKBONE + (XLM_LANGS if cfg.type_vocab_size else [])
    backbone = under(expand(rows, cfg.n_layer), "backbone.", "transformer.")
    skip = ("position_ids",)  # a non-persistent buffer, once saved
    if head == "pretraining":
        return Weights("XLMWithLMHeadModel", "transformer", backbone, optional=[("mlm.bias", "pred_layer.proj.bias", "copy")],
                       tied={"pred_layer.proj.weight": "transformer.embeddings.weight"}, skip=skip, unmatched=("backbone.pooler.",))
    task = TASKS[head]
    # A sequence head's classifier is HF's summary projection; a token head's keeps its name.
    heads = linear("classifier", "sequence_summary.summary") if task.reads != "tokens" else linear(task.head, task.head)
    # Multiple choice: logits_proj after the summary, the identity on export and folded on import.
    choice = {"constants": {"logits_proj.weight": torch.ones(1, 1), "logits_proj.bias": torch.zeros(1)},
              "fold": _fold_logits_proj} if task.reads == "options" else {}
    return Weights(XLM_TASKS["xlm"][head], "transformer", backbone + heads, skip=skip, unmatched=("backbone.pooler.",), **choice)


def _fold_logits_proj(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """XLMForMultipleChoice's ``logits_proj(summary(h))`` (two affine maps, nothing between) as one
    summary of one output: ``W = P S`` (1, D), ``b = P b_S + b_P``."""
    names = ("sequence_summary.summary.weight", "sequence_summary.summary.bias", "logits_proj.weight", "logits_proj.bias")
    if not all(n in tensors for n in names):
        return tensors  # load_weights names what is missing
    S, b_s, P, b_p = (tensors[n].double() for n in names)
    out = {k: v for k, v in tensors.items() if k not in names}
    out[names[0]] = (P @ S).to(tensors[names[0]].dtype)  # (1, D)
    out[names[1]] = (P @ b_s + b_p).to(tensors[names[1]].dtype)  # (1,)
    return out


# ----------------------------------------------------------------------------------------------
# The registry: our family -> its converter. ELMo and Transformer-XL have no transformers 5 class.
# SpanBERT is a BERT: it exports as model_type "bert" (its span-boundary head, which HF lacks, is
# left out) and reads no model_type of its own, since HF's SpanBERT folders say "bert".
# ----------------------------------------------------------------------------------------------

CONVERTERS: dict[str, Converter] = {
    "bert": Converter(("bert",), bert_config_from_hf, bert_config_to_hf, bert_weights, BERT_TASKS),
    "spanbert": Converter((), bert_config_from_hf, bert_config_to_hf, bert_weights, BERT_TASKS),
    "roberta": Converter(("roberta",), roberta_config_from_hf, roberta_config_to_hf, roberta_weights, ROBERTA_TASKS),
    "albert": Converter(("albert",), albert_config_from_hf, albert_config_to_hf, albert_weights, ALBERT_TASKS),
    "gpt": Converter(("openai-gpt", "gpt2"), gpt_config_from_hf, gpt_config_to_hf, gpt_weights, GPT_TASKS),
    "xlnet": Converter(("xlnet",), xlnet_config_from_hf, xlnet_config_to_hf, xlnet_weights, XLNET_TASKS),
    "xlm": Converter(("xlm",), xlm_config_from_hf, xlm_config_to_hf, xlm_weights, XLM_TASKS),
}


def family_of(model_type: object, where: str) -> str:
    """Our family for an HF ``model_type``; ValueError naming the known ones otherwise."""
    for family, conv in CONVERTERS.items():
        if model_type in conv.model_types:
            return family
    known = sorted(t for c in CONVERTERS.values() for t in c.model_types)
    raise ValueError(f"{where}: model_type={model_type!r} is not supported; known: {known}")


def supported_heads() -> dict[str, list[str]]:
    """HF model_type -> the task kinds it has a transformers class for (for messages and docs)."""
    return {t: list(kinds) for c in CONVERTERS.values() for t, kinds in c.tasks.items()}


# ----------------------------------------------------------------------------------------------
# Tensors: reading, shape checks, writing
# ----------------------------------------------------------------------------------------------


def _hf_shape(how: How, ours: tuple[int, ...], n_head: int) -> tuple[int, ...]:
    """The HF shape of a tensor of ours of shape ``ours``."""
    if how == "transpose":
        return (ours[1], ours[0])
    if how == "heads_in":  # (H * Dh, D) -> (D, H, Dh)
        return (ours[1], n_head, ours[0] // n_head)
    if how == "heads_out":  # (D, H * Dh) -> (D, H, Dh)
        return (ours[0], n_head, ours[1] // n_head)
    if how == "vector":  # (D,) -> (1, 1, D)
        return (1, 1, ours[0])
    return ours


def _to_ours(t: Tensor, how: How, ours: tuple[int, ...]) -> Tensor:
    if how == "transpose":
        return t.t().contiguous()
    if how == "heads_in":
        return t.reshape(ours[1], ours[0]).t().contiguous()  # (D, H, Dh) -> (D, H * Dh) -> (H * Dh, D)
    return t.reshape(ours)  # copy, heads_out (D, H, Dh) -> (D, H * Dh), vector (1, 1, D) -> (D,)


def _to_hf(t: Tensor, how: How, n_head: int) -> Tensor:
    shape = _hf_shape(how, tuple(t.shape), n_head)
    if how == "transpose":
        return t.t().contiguous().clone()
    if how == "heads_in":
        return t.t().reshape(shape).contiguous().clone()  # (H * Dh, D) -> (D, H * Dh) -> (D, H, Dh)
    return t.reshape(shape).contiguous().clone()


def read_safetensors_folder(folder: Path) -> dict[str, Tensor]:
    """All tensors of an HF folder: model.safetensors, or the shards listed by its index file."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.exists():
        return load_file(single)
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        tensors: dict[str, Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(load_file(folder / shard))
        return tensors
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles:
        raise ValueError(
            f"{folder} has only pickle weights ({', '.join(pickles)}); we load safetensors only, because "
            "unpickling can run arbitrary code. Convert it once in a trusted environment, e.g. "
            "transformers' model.save_pretrained(out, safe_serialization=True)."
        )
    raise FileNotFoundError(f"{folder} has no model.safetensors (nor model.safetensors.index.json)")


def _read_row(ours: str, name: HfName, how: How, hf: dict[str, Tensor], expected: dict[str, Tensor],
              n_head: int, where: str) -> Tensor | None:
    """Our tensor ``ours`` from the HF tensors, None when absent; ValueError naming the HF key when a
    tensor is there with a shape that does not fit the model config.json describes."""
    names = name if isinstance(name, tuple) else (name,)
    if not all(n in hf for n in names):
        return None
    want = tuple(expected[ours].shape)
    part = _hf_shape(how, (want[0] // len(names), *want[1:]), n_head)
    for n in names:
        if tuple(hf[n].shape) != part:
            raise ValueError(
                f"{where}: tensor {n!r} has shape {tuple(hf[n].shape)} but the model built from "
                f"config.json needs {part} (for our {ours!r}); config.json and weights disagree"
            )
    t = hf[names[0]] if len(names) == 1 else torch.cat([hf[n] for n in names], dim=0)
    return _to_ours(t, how, want)


def load_weights(model: nn.Module, weights: Weights, tensors: dict[str, Tensor], n_head: int, where: str) -> list[str]:
    """Copy the HF tensors into ``model`` by ``weights``; returns our tensors the folder did not give
    (they keep their fresh values). Unused HF tensors and untied copies are logged, not fatal."""
    if weights.fold is not None:
        tensors = weights.fold(tensors)
    dotted = weights.prefix + "."
    hf = tensors if any(k.startswith(dotted) for k in tensors) else {dotted + k: v for k, v in tensors.items()}
    expected = model.state_dict()
    state: dict[str, Tensor] = {}
    missing: list[str] = []
    for rows, required in ((weights.required, True), (weights.optional + weights.load_only, False)):
        for ours, name, how in rows:
            t = _read_row(ours, name, how, hf, expected, n_head, where)
            if t is not None:
                state[ours] = t
            elif required:
                missing.extend(name if isinstance(name, tuple) else (name,))
    if missing:
        raise ValueError(
            f"{where}: tensors missing from the weights: {missing[:5]} ({len(missing)} in all); is this a "
            f"{weights.hf_class} checkpoint (or its base model)?"
        )
    for alias, source in weights.tied.items():
        if alias in hf and source in hf and not torch.equal(hf[alias], hf[source]):
            log.warning("%s: %s is not tied to %s as in our model; using %s", where, alias, source, source)
    used = set(weights.tied)
    for _, name, _ in weights.required + weights.optional + weights.load_only:
        used.update(name if isinstance(name, tuple) else (name,))
    ignored = sorted(k for k in hf if k not in used and not k.endswith(weights.skip))
    if ignored:
        log.warning("%s: ignoring %d tensors we do not use: %s", where, len(ignored), ignored[:10])
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    return sorted(k for k in result.missing_keys if not k.startswith(weights.unmatched))


def hf_tensors(model: nn.Module, weights: Weights, n_head: int) -> dict[str, Tensor]:
    """Our model's tensors under HF names (fused ones split), fresh contiguous CPU copies."""
    state = model.state_dict()
    out: dict[str, Tensor] = {}
    for ours, name, how in weights.required + weights.optional:
        t = state[ours].detach().cpu()
        if isinstance(name, tuple):
            for n, chunk in zip(name, t.chunk(len(name), dim=0)):
                out[n] = _to_hf(chunk, how, n_head)
        else:
            out[name] = _to_hf(t, how, n_head)
    out.update({name: t.clone() for name, t in weights.constants.items()})
    return out


# Files of a tokenizer folder worth copying: everything except weights, model config and our metadata.
NOT_TOKENIZER_FILES = {"config.json", "MANIFEST.json", "trainer_state.json", "generation_config.json"}
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx"}
# A sentence-transformers folder's own files beside its tokenizer's: kept with a checkpoint's tokenizer
# (its hash covers them), not copied into an exported folder, which would name module folders it lacks.
SENTENCE_TRANSFORMERS_FILES = {"modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"}


def tokenizer_files(tokenizer_dir: str | Path) -> list[Path]:
    """The tokenizer files of a folder (ours: a checkpoint's tokenizer/; or an HF model folder)."""
    folder = Path(tokenizer_dir)
    if (folder / "tokenizer").is_dir():  # a whole ctxmodels checkpoint was passed
        folder = folder / "tokenizer"
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer_dir {folder} is not a directory")
    return sorted(
        p for p in folder.iterdir()
        if p.is_file() and p.name not in NOT_TOKENIZER_FILES and p.suffix not in WEIGHT_SUFFIXES
    )


# ----------------------------------------------------------------------------------------------
# Task heads: which one a folder holds, and config.json's label fields
# ----------------------------------------------------------------------------------------------

INPUT_STYLES = {"xlnet": "xlnet", "gpt": "gpt"}  # what ctxmodels.tasks.TaskConfig.input_style is; else "bert"


def task_kind_of(hf_config: dict, where: str) -> str:
    """Our task kind for an HF folder of a task head (from "architectures"); ValueError otherwise."""
    model_type = hf_config.get("model_type")
    family = family_of(model_type, where)
    arch = (hf_config.get("architectures") or [None])[0]
    kinds = [k for k, cls in CONVERTERS[family].tasks[model_type].items() if cls == arch]
    if not kinds:
        known = sorted(set(CONVERTERS[family].tasks[model_type].values()))
        raise ValueError(f"{where}: architectures={hf_config.get('architectures')!r} is not a task head we import for "
                         f"model_type={model_type!r}; known: {known}")
    if len(kinds) == 1:
        return kinds[0]
    # *ForSequenceClassification: HF's own rule (problem_type, else one label means regression)
    problem = hf_config.get("problem_type")
    n = len(hf_config.get("id2label") or {}) or hf_config.get("num_labels", 2)
    return "regression" if problem == "regression" or (problem is None and n == 1) else "classification"


def _labels_from_hf(hf_config: dict) -> list[str]:
    id2label = hf_config.get("id2label") or {}
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(len(id2label))]


def _task_config_to_hf(task: TaskConfig) -> dict:
    """config.json fields transformers' head classes read: labels, problem type."""
    kind = task_of(task.kind)
    names = label_names(task)
    out: dict[str, Any] = {"id2label": dict(enumerate(names)), "label2id": {n: i for i, n in enumerate(names)}}
    if kind.hf_problem_type:
        out["problem_type"] = kind.hf_problem_type
    return out


def _check_task_export(family: str, model_type: str, task: TaskConfig, conv: Converter) -> None:
    kinds = conv.tasks[model_type]
    if task.kind not in kinds:
        raise ValueError(
            f"no Hugging Face head for family {family!r} ({model_type}) and task kind {task.kind!r}: transformers "
            f"has {model_type} heads for {sorted(kinds)}; supported (model_type: kinds): {supported_heads()}"
        )
    if task.features is not None:
        raise ValueError(
            f"a feature-based {family} task model (features={task.features!r}, task_model={task.task_model!r}) "
            "has no Hugging Face head: transformers' heads read the last layer directly"
        )
    if task.symmetric:
        raise ValueError(
            f"a {family} {task.kind} model with symmetric=True adds the vectors of both input orders; "
            "no transformers head does that"
        )


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def from_hf(hf_config: dict, tensors: dict[str, Tensor], where: str = "HF weights") -> tuple[str, Any, nn.Module]:
    """An HF config dict and state dict -> (our family, config, pretraining model with weights).

    Any folder of a supported model type loads: its base model always, its pretraining heads when
    present. Tensors we do not use (a task head's classifier) are logged on logger ``ctxmodels.hf``,
    and so are our heads the weights lack, which stay freshly initialised (``from_hf_untrained``
    also returns their names)."""
    family, cfg, model, _ = from_hf_untrained(hf_config, tensors, where)
    return family, cfg, model


def from_hf_untrained(hf_config: dict, tensors: dict[str, Tensor], where: str = "HF weights") -> tuple[str, Any, nn.Module, list[str]]:
    """``from_hf`` plus the names of our weights the HF tensors lacked (e.g. ``mlm.dense.weight`` of
    a bare ``BertModel`` folder): what a server must not answer from."""
    family = family_of(hf_config.get("model_type"), where)
    conv = CONVERTERS[family]
    cfg = conv.config_from_hf(hf_config, where)
    model = new_model(family, cfg, seed=0)
    fresh = load_weights(model, conv.weights(cfg, "pretraining"), tensors, cfg.n_head, where)
    if fresh:
        log.warning(
            "%s: no weights for %s; these stay freshly initialised (fine for feature extraction, "
            "train them before using their outputs)", where, fresh,
        )
    return family, cfg, model, list(fresh)


def task_from_hf(hf_config: dict, tensors: dict[str, Tensor], where: str = "HF weights") -> tuple[str, Any, TaskModel]:
    """An HF config dict and state dict of a task head -> (our family, config, ``TaskModel``) with
    the same logits; its ``.task`` carries the kind and the label names (``id2label``)."""
    family = family_of(hf_config.get("model_type"), where)
    conv = CONVERTERS[family]
    kind = task_kind_of(hf_config, where)
    cfg = conv.config_from_hf(hf_config, where)
    labels = _labels_from_hf(hf_config) if task_of(kind).labelled else []
    task = TaskConfig(kind=kind, num_labels=len(labels) or 2, labels=labels,
                      input_style=INPUT_STYLES.get(family, "bert"))
    model = build_task_model(family, cfg, task, torch.Generator().manual_seed(0))
    fresh = load_weights(model, conv.weights(cfg, kind), tensors, cfg.n_head, where)
    # Token heads never read the pooler (BERT, ALBERT) or the sequence summary (XLNet).
    unused = ("backbone.pooler.", "summary.") if task_of(kind).reads == "tokens" else ()
    fresh = [k for k in fresh if not k.startswith(unused)]
    if fresh:
        raise ValueError(f"{where}: the {kind} model needs {fresh[:5]}, which the weights do not give")
    return family, cfg, model.eval()


# transformers' base model class of each model_type: what an embedding model exports as.
BASE_CLASSES = {"bert": "BertModel", "roberta": "RobertaModel", "albert": "AlbertModel", "xlnet": "XLNetModel",
                "xlm": "XLMModel", "gpt2": "GPT2Model", "openai-gpt": "OpenAIGPTModel"}
BASE_PREFIXES = ("bert.", "roberta.", "albert.", "transformer.")  # where head classes keep their base model


def base_model_only(hf_config: dict, tensors: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """A head class's (config.json, tensors) -> its base model's: the tensors under the base model's
    prefix, without it; the head's labels and problem type dropped, ``architectures`` the base class.
    A base model's own (an embedding model's export) is returned as it is."""
    if hf_config.get("architectures") == [BASE_CLASSES.get(hf_config.get("model_type"))]:
        return hf_config, tensors
    prefix = next((p for p in BASE_PREFIXES if any(k.startswith(p) for k in tensors)), None)
    if prefix is None:
        raise ValueError(f"no base-model prefix among the exported tensor names (first: {sorted(tensors)[:3]})")
    config = {k: v for k, v in hf_config.items() if k not in ("id2label", "label2id", "problem_type", "num_labels")}
    config["architectures"] = [BASE_CLASSES[config["model_type"]]]
    return config, {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}


def to_hf(model: nn.Module, family: str, pad_token_id: int | None = None) -> tuple[dict, dict[str, Tensor]]:
    """Our pretraining model or ``TaskModel`` -> (HF config.json dict, HF state dict) of the
    transformers class with the same function (module docstring). Tied copies are left out;
    transformers ties them on load. ``pad_token_id``: the tokenizer's padding id, written to
    config.json (GPT's sequence heads find the last token by it, so they need it)."""
    if family not in CONVERTERS:
        raise ValueError(f"no Hugging Face export for family {family!r} (transformers has no such model); "
                         f"families with one: {sorted(CONVERTERS)}")
    conv = CONVERTERS[family]
    task = model.task if isinstance(model, TaskModel) else None
    if task is not None and model.family != family:
        raise ValueError(f"export as family {family!r} got a {model.family!r} task model")
    if task is None and not isinstance(model, family_spec(family).pretraining_cls):
        raise ValueError(f"export as family {family!r} needs a {family_spec(family).pretraining_cls.__name__} "
                         f"or a {family} TaskModel, got {type(model).__name__}")
    cfg = model.cfg if hasattr(model, "cfg") else model.config
    if task is not None and task_of(task.kind).head is None:  # an embedding model: its backbone, as the base model
        pretraining = new_model(family, cfg, seed=0)
        pretraining.backbone.load_state_dict(model.backbone.state_dict())
        return base_model_only(*to_hf(pretraining, family, pad_token_id))
    hf_config = conv.config_to_hf(cfg)
    model_type = hf_config["model_type"]
    head = "pretraining"
    if task is not None:
        _check_task_export(family, model_type, task, conv)
        head = task.kind
        hf_config.update(_task_config_to_hf(task))
    if pad_token_id is not None:
        hf_config["pad_token_id"] = int(pad_token_id)
    elif family == "gpt" and head != "pretraining" and TASKS[head].reads != "tokens":
        raise ValueError(
            f"{conv.tasks[model_type][head]} finds each row's last token by pad_token_id; give the tokenizer's "
            "padding id (ctx export reads it from the checkpoint's tokenizer)"
        )
    weights = conv.weights(cfg, head)
    hf_config["architectures"] = [weights.hf_class]
    return hf_config, hf_tensors(model, weights, cfg.n_head)


def load_hf_folder(path: str | Path) -> tuple[str, Any, nn.Module]:
    """Load an HF folder -> (our family name, config, pretraining model with weights); see ``from_hf``."""
    folder = Path(path)
    hf_config = _read_config(folder)
    family_of(hf_config.get("model_type"), str(folder / "config.json"))  # before reading any weights
    return from_hf(hf_config, read_safetensors_folder(folder), str(folder))


def load_hf_folder_untrained(path: str | Path) -> tuple[str, Any, nn.Module, list[str]]:
    """``load_hf_folder`` plus the weights the folder lacked (``from_hf_untrained``)."""
    folder = Path(path)
    hf_config = _read_config(folder)
    family_of(hf_config.get("model_type"), str(folder / "config.json"))
    return from_hf_untrained(hf_config, read_safetensors_folder(folder), str(folder))


def load_hf_task_folder(path: str | Path) -> tuple[str, Any, TaskModel]:
    """Load an HF folder of a task head (``*ForSequenceClassification``, ...) as our ``TaskModel``."""
    folder = Path(path)
    hf_config = _read_config(folder)
    task_kind_of(hf_config, str(folder / "config.json"))  # before reading any weights
    return task_from_hf(hf_config, read_safetensors_folder(folder), str(folder))


def export_hf_folder(
    model: nn.Module, family: str, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
    pad_token_id: int | None = None, languages: list[str] | None = None,
) -> Path:
    """Write an HF folder (config.json, model.safetensors, tokenizer files) that transformers loads:
    the pretraining class for a pretraining model, the task head's class for a ``TaskModel``.
    ``languages``: an XLM's language names, in the order of its rows (its run's ``data.languages``),
    written as config.json's ``lang2id`` / ``id2lang``."""
    hf_config, tensors = to_hf(model, family, pad_token_id)
    if family == "xlm" and languages:
        if len(languages) != hf_config["n_langs"]:
            raise ValueError(f"{len(languages)} language names {languages} for a model of {hf_config['n_langs']} language row(s)")
        hf_config["lang2id"] = {name: i for i, name in enumerate(languages)}
        hf_config["id2lang"] = dict(enumerate(languages))
    return write_hf_folder(out_dir, hf_config, tensors, tokenizer_dir)


def write_hf_folder(out_dir: str | Path, hf_config: dict, tensors: dict[str, Tensor], tokenizer_dir: str | Path | None = None) -> Path:
    """config.json, model.safetensors and the tokenizer's files in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})  # HF requires "format"
    if tokenizer_dir is not None:
        for f in tokenizer_files(tokenizer_dir):
            if f.name not in SENTENCE_TRANSFORMERS_FILES:  # a module list whose module folders stay behind
                shutil.copy2(f, out / f.name)
    return out


def _read_config(folder: Path) -> dict:
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{folder} is not a Hugging Face folder: no config.json")
    try:
        return json.loads(config_path.read_text())
    except ValueError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from e


# ----------------------------------------------------------------------------------------------
# DistilBERT: a BERT without token types and pooler (what ctx distill's students are short of)
# ----------------------------------------------------------------------------------------------


def to_distilbert(model: nn.Module) -> tuple[dict, dict[str, Tensor]]:
    """Our BERT pretraining model -> (config.json dict, state dict) of transformers'
    ``DistilBertForMaskedLM`` computing the same masked-LM logits for inputs of one segment.

    DistilBERT is BERT's post-LN block with separate query, key and value projections, no token-type
    embeddings, no pooler and the same MLM head (``vocab_transform``, GELU, ``vocab_layer_norm``,
    ``vocab_projector`` tied to the word embeddings). Our segment-0 embedding, added to every token,
    is folded into the position embeddings, so every input whose ``token_type_ids`` are all 0 (or
    absent) gives the same logits; the NSP head and the pooler are left out. Fits when the family is
    bert (absolute positions), the activation GELU (exact) or ReLU, and the LayerNorm epsilon
    DistilBERT's fixed 1e-12. Sanh et al. 2019; transformers' ``modeling_distilbert.py``.
    """
    from ctxmodels.bert import BertForPreTraining

    if not isinstance(model, BertForPreTraining):
        raise ValueError(f"DistilBERT export takes a BERT pretraining model, got {type(model).__name__}")
    cfg = model.cfg
    problems = []
    if cfg.position_style != "absolute":
        problems.append(f"positions are {cfg.position_style!r} (RoBERTa's), DistilBERT's count from 0")
    if cfg.activation not in ("gelu", "relu"):
        problems.append(f"activation {cfg.activation!r}: DistilBERT has exact gelu or relu")
    if cfg.layer_norm_eps != 1e-12:
        problems.append(f"layer_norm_eps {cfg.layer_norm_eps}: DistilBERT's LayerNorms use 1e-12")
    if problems:
        raise ValueError("this model does not fit DistilBertForMaskedLM: " + "; ".join(problems))
    s = {k: v.detach() for k, v in model.state_dict().items()}
    D = cfg.d_model
    out = {
        "distilbert.embeddings.word_embeddings.weight": s["backbone.embeddings.word.weight"],
        # segment 0, which our embeddings add to every token, folded into each position's row
        "distilbert.embeddings.position_embeddings.weight": s["backbone.embeddings.position.weight"]
        + s["backbone.embeddings.token_type.weight"][0],
        "distilbert.embeddings.LayerNorm.weight": s["backbone.embeddings.ln.weight"],
        "distilbert.embeddings.LayerNorm.bias": s["backbone.embeddings.ln.bias"],
        "vocab_transform.weight": s["mlm.dense.weight"],
        "vocab_transform.bias": s["mlm.dense.bias"],
        "vocab_layer_norm.weight": s["mlm.ln.weight"],
        "vocab_layer_norm.bias": s["mlm.ln.bias"],
        "vocab_projector.bias": s["mlm.bias"],
    }
    for i in range(cfg.n_layer):
        ours, hf = f"backbone.layers.{i}.", f"distilbert.transformer.layer.{i}."
        w, b = s[ours + "attn.qkv.weight"], s[ours + "attn.qkv.bias"]  # rows: [query; key; value]
        for j, name in enumerate(("q_lin", "k_lin", "v_lin")):
            out[hf + f"attention.{name}.weight"] = w[j * D : (j + 1) * D]
            out[hf + f"attention.{name}.bias"] = b[j * D : (j + 1) * D]
        for ours_name, hf_name in (("attn.proj", "attention.out_lin"), ("ln1", "sa_layer_norm"), ("ffn.fc_in", "ffn.lin1"),
                                   ("ffn.fc_out", "ffn.lin2"), ("ln2", "output_layer_norm")):
            out[hf + hf_name + ".weight"] = s[ours + ours_name + ".weight"]
            out[hf + hf_name + ".bias"] = s[ours + ours_name + ".bias"]
    hf_config = {
        "model_type": "distilbert", "architectures": ["DistilBertForMaskedLM"], "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len, "sinusoidal_pos_embds": False, "n_layers": cfg.n_layer,
        "n_heads": cfg.n_head, "dim": D, "hidden_dim": cfg.d_ff, "dropout": cfg.dropout,
        "attention_dropout": cfg.attn_dropout, "activation": cfg.activation, "initializer_range": cfg.init_std,
        "qa_dropout": 0.1, "seq_classif_dropout": 0.2, "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": True,
    }
    return hf_config, {k: v.contiguous().clone() for k, v in out.items()}


def export_distilbert_folder(model: nn.Module, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """``to_distilbert`` written as a folder transformers loads (``DistilBertForMaskedLM``, or
    ``DistilBertModel`` for its hidden states)."""
    hf_config, tensors = to_distilbert(model)
    return write_hf_folder(out_dir, hf_config, tensors, tokenizer_dir)
