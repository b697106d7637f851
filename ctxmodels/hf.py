"""Import and export Hugging Face checkpoint folders (config.json + safetensors weights).

Only safetensors are read: a folder holding only ``pytorch_model.bin`` (a pickle) is refused, so
loading a downloaded folder never runs code from it.

One entry of ``HF_FAMILIES`` per Hugging Face ``model_type``; each names our family and gives a
loader and an exporter. BERT and RoBERTa share one weight-name table (``BERT_BACKBONE``) and differ
in their prefix, their heads (``BERT_HEADS`` / ``ROBERTA_HEADS``) and their position scheme. Other
families add their own table, loader and exporter below and one line to ``HF_FAMILIES``.

Name tables map our parameter name -> the Hugging Face name. A tuple of HF names means our
tensor is their concatenation along dim 0 (our fused QKV projection = query; key; value).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ctxmodels.bert import BertConfig, BertForPreTraining

log = logging.getLogger(__name__)

HfName = str | tuple[str, ...]

# ----------------------------------------------------------------------------------------------
# BERT / RoBERTa weight names. HF names are relative to the base model (after "bert." / "roberta.").
# ----------------------------------------------------------------------------------------------

BERT_BACKBONE: dict[str, HfName] = {
    "embeddings.word.weight": "embeddings.word_embeddings.weight",
    "embeddings.position.weight": "embeddings.position_embeddings.weight",
    "embeddings.token_type.weight": "embeddings.token_type_embeddings.weight",
    "embeddings.ln.weight": "embeddings.LayerNorm.weight",
    "embeddings.ln.bias": "embeddings.LayerNorm.bias",
}

BERT_LAYER: dict[str, HfName] = {  # "{i}" is the layer index
    "layers.{i}.attn.qkv.weight": (
        "encoder.layer.{i}.attention.self.query.weight",
        "encoder.layer.{i}.attention.self.key.weight",
        "encoder.layer.{i}.attention.self.value.weight",
    ),
    "layers.{i}.attn.qkv.bias": (
        "encoder.layer.{i}.attention.self.query.bias",
        "encoder.layer.{i}.attention.self.key.bias",
        "encoder.layer.{i}.attention.self.value.bias",
    ),
    "layers.{i}.attn.proj.weight": "encoder.layer.{i}.attention.output.dense.weight",
    "layers.{i}.attn.proj.bias": "encoder.layer.{i}.attention.output.dense.bias",
    "layers.{i}.ln1.weight": "encoder.layer.{i}.attention.output.LayerNorm.weight",
    "layers.{i}.ln1.bias": "encoder.layer.{i}.attention.output.LayerNorm.bias",
    "layers.{i}.ffn.fc_in.weight": "encoder.layer.{i}.intermediate.dense.weight",
    "layers.{i}.ffn.fc_in.bias": "encoder.layer.{i}.intermediate.dense.bias",
    "layers.{i}.ffn.fc_out.weight": "encoder.layer.{i}.output.dense.weight",
    "layers.{i}.ffn.fc_out.bias": "encoder.layer.{i}.output.dense.bias",
    "layers.{i}.ln2.weight": "encoder.layer.{i}.output.LayerNorm.weight",
    "layers.{i}.ln2.bias": "encoder.layer.{i}.output.LayerNorm.bias",
}

BERT_POOLER: dict[str, HfName] = {  # optional: masked-LM checkpoints have no pooler
    "pooler.weight": "pooler.dense.weight",
    "pooler.bias": "pooler.dense.bias",
}

# Heads: names relative to our BertForPreTraining and to the full HF model (no base prefix).
BERT_HEADS: dict[str, HfName] = {
    "mlm.dense.weight": "cls.predictions.transform.dense.weight",
    "mlm.dense.bias": "cls.predictions.transform.dense.bias",
    "mlm.ln.weight": "cls.predictions.transform.LayerNorm.weight",
    "mlm.ln.bias": "cls.predictions.transform.LayerNorm.bias",
    "mlm.bias": "cls.predictions.bias",
    "nsp.weight": "cls.seq_relationship.weight",
    "nsp.bias": "cls.seq_relationship.bias",
}

ROBERTA_HEADS: dict[str, HfName] = {
    "mlm.dense.weight": "lm_head.dense.weight",
    "mlm.dense.bias": "lm_head.dense.bias",
    "mlm.ln.weight": "lm_head.layer_norm.weight",
    "mlm.ln.bias": "lm_head.layer_norm.bias",
    "mlm.bias": "lm_head.bias",
}

# HF tensors we never need: non-persistent buffers older checkpoints saved, and the decoder, which
# both HF and we tie to the word embeddings (its bias is tied to the head bias).
BERT_SKIP = {
    "embeddings.position_ids",
    "embeddings.token_type_ids",
    "cls.predictions.decoder.weight",
    "cls.predictions.decoder.bias",
    "lm_head.decoder.weight",
    "lm_head.decoder.bias",
}

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


# ----------------------------------------------------------------------------------------------
# Generic helpers
# ----------------------------------------------------------------------------------------------


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


def expand_layers(table: dict[str, HfName], n_layer: int) -> dict[str, HfName]:
    """Instantiate a per-layer table ("{i}") for layers 0..n_layer-1."""
    out: dict[str, HfName] = {}
    for i in range(n_layer):
        for ours, hf in table.items():
            out[ours.format(i=i)] = tuple(h.format(i=i) for h in hf) if isinstance(hf, tuple) else hf.format(i=i)
    return out


def strip_prefix(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """Drop the base-model prefix ("bert.") where present; base-model-only folders have none."""
    dotted = prefix + "."
    return {k[len(dotted):] if k.startswith(dotted) else k: v for k, v in tensors.items()}


def hf_to_state_dict(
    table: dict[str, HfName], hf: dict[str, Tensor], expected: dict[str, Tensor], where: str
) -> tuple[dict[str, Tensor], list[str]]:
    """Gather our tensors from HF ones by ``table``; returns (state dict, our names not found).

    Raises ValueError naming the HF key when a tensor exists with a shape that does not fit.
    """
    state: dict[str, Tensor] = {}
    missing: list[str] = []
    for ours, name in table.items():
        names = name if isinstance(name, tuple) else (name,)
        if not all(n in hf for n in names):
            missing.append(ours)
            continue
        want = expected[ours].shape
        part = (want[0] // len(names), *want[1:])
        for n in names:
            if tuple(hf[n].shape) != tuple(part):
                raise ValueError(
                    f"{where}: tensor {n!r} has shape {tuple(hf[n].shape)} but the model built from "
                    f"config.json needs {tuple(part)} (for our {ours!r}); config.json and weights disagree"
                )
        state[ours] = hf[names[0]] if len(names) == 1 else torch.cat([hf[n] for n in names], dim=0)
    return state, missing


def state_dict_to_hf(table: dict[str, HfName], state: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """Our tensors renamed (and fused ones split) to HF names; fresh contiguous CPU copies."""
    out: dict[str, Tensor] = {}
    for ours, name in table.items():
        t = state[ours].detach().cpu()
        if isinstance(name, tuple):
            for n, chunk in zip(name, t.chunk(len(name), dim=0)):
                out[prefix + n] = chunk.clone()
        else:
            out[prefix + name] = t.clone()
    return out


def write_hf_weights(tensors: dict[str, Tensor], out_dir: Path) -> None:
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})  # HF requires "format"


# Files of a tokenizer folder worth copying: everything except weights, model config and our metadata.
NOT_TOKENIZER_FILES = {"config.json", "MANIFEST.json", "trainer_state.json", "generation_config.json"}
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx"}


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
# BERT / RoBERTa
# ----------------------------------------------------------------------------------------------


def bert_config_from_hf(hf_config: dict, family: str, where: str) -> BertConfig:
    kwargs: dict[str, object] = {}
    for ours, (key, default) in BERT_CONFIG_KEYS.items():
        if key in hf_config and hf_config[key] is not None:
            kwargs[ours] = hf_config[key]
        elif default is None:
            raise ValueError(f"{where}: config.json has no {key!r} (needed for BertConfig.{ours})")
        else:
            kwargs[ours] = default
    act = hf_config.get("hidden_act", "gelu")
    if act not in HF_ACT_TO_OURS:
        raise ValueError(f"{where}: config.json hidden_act={act!r} is not supported; expected one of {sorted(HF_ACT_TO_OURS)}")
    pos = hf_config.get("position_embedding_type", "absolute")
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


def _load_bert_like(
    family: str, prefix: str, heads: dict[str, HfName], hf_config: dict, tensors: dict[str, Tensor], where: str
) -> tuple[str, BertConfig, BertForPreTraining, list[str]]:
    cfg = bert_config_from_hf(hf_config, family, where)
    model = BertForPreTraining(cfg)
    expected = model.state_dict()
    hf = strip_prefix(tensors, prefix)

    backbone_table = {**BERT_BACKBONE, **expand_layers(BERT_LAYER, cfg.n_layer)}
    optional_table = {f"backbone.{k}": v for k, v in BERT_POOLER.items()}
    required = {f"backbone.{k}": v for k, v in backbone_table.items()}
    head_table = {k: v for k, v in heads.items() if k in expected}  # no "nsp.*" without an NSP head

    state, missing = hf_to_state_dict(required, hf, expected, where)
    if missing:
        raise ValueError(
            f"{where}: backbone tensors missing from the weights: {[required[m] for m in missing][:5]} "
            f"({len(missing)} in all); is this a {family} checkpoint?"
        )
    opt_state, missing_heads = hf_to_state_dict({**optional_table, **head_table}, hf, expected, where)
    state.update(opt_state)

    decoder = hf.get("cls.predictions.decoder.weight", hf.get("lm_head.decoder.weight"))
    if decoder is not None and not torch.equal(decoder, state["backbone.embeddings.word.weight"]):
        log.warning("%s: the checkpoint's MLM decoder is not tied to the word embeddings; using the embeddings", where)
    if "mlm.bias" in missing_heads:  # very old checkpoints kept the bias only on the decoder
        bias = hf.get("cls.predictions.decoder.bias", hf.get("lm_head.decoder.bias"))
        if bias is not None:
            state["mlm.bias"] = bias
            missing_heads.remove("mlm.bias")

    used = set()
    for table in (required, optional_table, head_table):
        for name in table.values():
            used.update(name if isinstance(name, tuple) else (name,))
    ignored = sorted(k for k in hf if k not in used and k not in BERT_SKIP)
    if ignored:
        log.warning("%s: ignoring %d tensors we do not use: %s", where, len(ignored), ignored[:10])

    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    return family, cfg, model, missing_heads


def load_bert(
    hf_config: dict, tensors: dict[str, Tensor], where: str
) -> tuple[str, BertConfig, BertForPreTraining, list[str]]:
    return _load_bert_like("bert", "bert", BERT_HEADS, hf_config, tensors, where)


def load_roberta(
    hf_config: dict, tensors: dict[str, Tensor], where: str
) -> tuple[str, BertConfig, BertForPreTraining, list[str]]:
    return _load_bert_like("roberta", "roberta", ROBERTA_HEADS, hf_config, tensors, where)


def bert_config_to_hf(cfg: BertConfig, model_type: str, architectures: list[str]) -> dict:
    out: dict[str, object] = {"model_type": model_type, "architectures": architectures}
    for ours, (key, _) in BERT_CONFIG_KEYS.items():
        out[key] = getattr(cfg, ours)
    out["hidden_act"] = OURS_ACT_TO_HF[cfg.activation]
    out["position_embedding_type"] = "absolute"
    out["tie_word_embeddings"] = True
    return out


def _check_style(model: BertForPreTraining, family: str, style: str) -> BertConfig:
    if not isinstance(model, BertForPreTraining):
        raise TypeError(f"export as {family!r} needs a BertForPreTraining, got {type(model).__name__}")
    cfg = model.cfg
    if cfg.position_style != style:
        raise ValueError(f"export as {family!r} needs config.position_style={style!r}, got {cfg.position_style!r}")
    return cfg


def export_bert(model: BertForPreTraining, out_dir: Path) -> None:
    cfg = _check_style(model, "bert", "absolute")
    state = model.state_dict()
    table = {f"backbone.{k}": v for k, v in {**BERT_BACKBONE, **expand_layers(BERT_LAYER, cfg.n_layer)}.items()}
    heads = {k: v for k, v in BERT_HEADS.items() if k in state}
    if cfg.nsp:  # BertForPreTraining = BertModel with pooler + MLM + NSP
        arch = ["BertForPreTraining"]
        table.update({f"backbone.{k}": v for k, v in BERT_POOLER.items()})
    else:  # no NSP head: the masked-LM class, which has no pooler either
        arch = ["BertForMaskedLM"]
    tensors = state_dict_to_hf(table, state, prefix="bert.")
    tensors.update(state_dict_to_hf(heads, state))
    (out_dir / "config.json").write_text(json.dumps(bert_config_to_hf(cfg, "bert", arch), indent=2))
    write_hf_weights(tensors, out_dir)


def export_roberta(model: BertForPreTraining, out_dir: Path) -> None:
    cfg = _check_style(model, "roberta", "roberta")
    if cfg.activation != "gelu":
        raise ValueError(
            f"RobertaForMaskedLM's lm_head always applies exact gelu; config.activation={cfg.activation!r} "
            "would export a different model"
        )
    if cfg.nsp:
        log.warning("RobertaForMaskedLM has no NSP head and no pooler; they are not exported")
    state = model.state_dict()
    table = {f"backbone.{k}": v for k, v in {**BERT_BACKBONE, **expand_layers(BERT_LAYER, cfg.n_layer)}.items()}
    tensors = state_dict_to_hf(table, state, prefix="roberta.")
    tensors.update(state_dict_to_hf(ROBERTA_HEADS, state))
    hf_config = bert_config_to_hf(cfg, "roberta", ["RobertaForMaskedLM"])
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    write_hf_weights(tensors, out_dir)


# ----------------------------------------------------------------------------------------------
# Registry of HF model types and the public entry points
# ----------------------------------------------------------------------------------------------

Loader = Callable[[dict, dict[str, Tensor], str], tuple[str, object, torch.nn.Module, list[str]]]
Exporter = Callable[[torch.nn.Module, Path], None]


@dataclass(frozen=True)
class HfFamily:
    family: str  # our family name (ctxmodels.registry.FAMILIES key)
    load: Loader  # (config.json dict, tensors, folder for messages) -> (family, config, model, missing heads)
    export: Exporter  # (model, out_dir) -> writes config.json and model.safetensors


HF_FAMILIES: dict[str, HfFamily] = {  # HF config.json "model_type" -> how to convert
    "bert": HfFamily(family="bert", load=load_bert, export=export_bert),
    "roberta": HfFamily(family="roberta", load=load_roberta, export=export_roberta),
    # other families (albert, openai-gpt, transfo-xl, xlnet) add their line here
}


def load_hf_folder(path: str | Path) -> tuple[str, BertConfig, BertForPreTraining]:
    """Load an HF folder -> (our family name, config, pretraining model with weights).

    Heads absent from the weights (e.g. a bare ``BertModel`` folder has no MLM/NSP head) stay freshly
    initialised; a warning on logger ``ctxmodels.hf`` names them.
    """
    folder = Path(path)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{folder} is not a Hugging Face folder: no config.json")
    hf_config = json.loads(config_path.read_text())
    model_type = hf_config.get("model_type")
    if model_type not in HF_FAMILIES:
        raise ValueError(
            f"{config_path}: model_type={model_type!r} is not supported; known: {sorted(HF_FAMILIES)}"
        )
    tensors = read_safetensors_folder(folder)
    family, cfg, model, missing_heads = HF_FAMILIES[model_type].load(hf_config, tensors, str(folder))
    if missing_heads:
        log.warning(
            "%s: no weights for %s; these stay freshly initialised (fine for feature extraction, "
            "train them before using their outputs)", folder, missing_heads,
        )
    return family, cfg, model


def export_hf_folder(
    model: torch.nn.Module, family: str, out_dir: str | Path, tokenizer_dir: str | Path | None = None
) -> Path:
    """Write an HF folder (config.json, model.safetensors, tokenizer files) that transformers loads."""
    entries = [e for e in HF_FAMILIES.values() if e.family == family]
    if not entries:
        raise ValueError(f"no Hugging Face export for family {family!r}; known: {sorted(e.family for e in HF_FAMILIES.values())}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries[0].export(model, out)
    if tokenizer_dir is not None:
        for f in tokenizer_files(tokenizer_dir):
            shutil.copy2(f, out / f.name)
    return out
