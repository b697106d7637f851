"""Export for sentence-transformers (Reimers & Gurevych 2019, "Sentence-BERT"; the library's own
folder layout, as ``SentenceTransformer.save`` writes it): a Hugging Face folder of the backbone
(``ctxmodels.hf``) plus the module list that pools its last layer into one vector per text, so
``SentenceTransformer(folder).encode(texts)`` gives the vectors ``ctx serve`` answers on
``/v1/embeddings`` with the same ``pooling`` and ``normalize``.

Folder::

    config.json, model.safetensors, tokenizer files     module 0: Transformer (AutoModel)
    sentence_bert_config.json                            its max_seq_length, do_lower_case
    1_Pooling/config.json                                module 1: Pooling (mean | cls | lasttoken)
    2_Normalize/                                         module 2, only with normalize=True
    modules.json                                         the list above
    config_sentence_transformers.json                    the similarity function (cosine)

Pooling is ours exactly: ``mean`` averages every position whose attention mask is 1 (special tokens
included, as ``ctxmodels.features.mean_pool``), ``cls`` takes position 0, ``last`` the last real
token (sentence-transformers' ``lasttoken`` finds it from the attention mask too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from torch import nn

from ctxmodels import hf

Pooling = Literal["mean", "cls", "last"]
POOLING_MODES: dict[str, str] = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}
ALL_MODES = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
             "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def export_sentence_transformers_folder(
    model: nn.Module,
    family: str,
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    *,
    dim: int,
    max_seq_length: int,
    pooling: Pooling = "mean",
    normalize: bool = False,
    pad_token_id: int | None = None,
) -> Path:
    """Write ``out_dir`` as a sentence-transformers model folder (module docstring). ``model`` is our
    pretraining model or a fine-tuned ``TaskModel`` (its backbone is what sentence-transformers
    loads; the head's weights are left out). ``max_seq_length``: tokens per text, special tokens
    included, as the server reads them."""
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling {pooling!r}: sentence-transformers export supports {sorted(POOLING_MODES)}")
    out = Path(out_dir)
    hf_config, tensors = hf.to_hf(model, family, pad_token_id)
    if getattr(model, "task", None) is not None:
        # A task model exports its head class; sentence-transformers loads AutoModel, which reads the
        # backbone and would warn about the head. Keep the backbone's tensors and a base config.
        prefix = _base_prefix(tensors)
        tensors = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        for key in ("id2label", "label2id", "problem_type", "num_labels"):
            hf_config.pop(key, None)
        hf_config.pop("architectures", None)
    hf.write_hf_folder(out, hf_config, tensors, tokenizer_dir)
    for leftover in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        (out / leftover).unlink(missing_ok=True)  # an HF source folder's own, copied with its tokenizer

    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": int(max_seq_length), "do_lower_case": False}, indent=2))  # the tokenizer lowercases itself
    pool_dir = out / "1_Pooling"
    pool_dir.mkdir(exist_ok=True)
    modes = {mode: mode == POOLING_MODES[pooling] for mode in ALL_MODES}
    (pool_dir / "config.json").write_text(json.dumps({"word_embedding_dimension": int(dim), **modes, "include_prompt": True}, indent=2))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        (out / "2_Normalize").mkdir(exist_ok=True)
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": "cosine", "prompts": {}, "default_prompt_name": None}, indent=2))
    return out


def _base_prefix(tensors: dict) -> str:
    """'bert.' / 'roberta.' / 'albert.' / 'transformer.': where a head class keeps its base model."""
    for prefix in ("bert.", "roberta.", "albert.", "transformer."):
        if any(k.startswith(prefix) for k in tensors):
            return prefix
    raise ValueError(f"no base-model prefix among the exported tensor names (first: {sorted(tensors)[:3]})")
