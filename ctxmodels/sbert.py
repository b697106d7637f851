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

``read_sentence_settings`` reads such a folder back (anyone's, not only ours, in the layout of
sentence-transformers up to 5.x or of 6.x, which names modules by their modules and writes the pooling
mode as a string): its pooling, whether it normalises, its max_seq_length and prompts are what serving
uses by default for it, as sentence-transformers, TEI and Infinity do. A SparseEncoder folder
(MLMTransformer, SpladePooling) says its vectors are SPLADE's (``Splade``). A checkpoint of ours fine-tuned as an embedding model
(``ctx finetune`` with task kind ``embedding``) says the same in its task config
(``checkpoint_sentence_settings``), so it is served and exported with the pooling it was trained with.

Pooling is ours exactly: ``mean`` averages every position whose attention mask is 1 (special tokens
included, as ``ctxmodels.features.mean_pool``), ``cls`` takes position 0, ``last`` the last real
token (sentence-transformers' ``lasttoken`` finds it from the attention mask too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import nn

from ctxmodels import hf

Pooling = Literal["mean", "cls", "last"]
POOLING_MODES: dict[str, str] = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}
# sentence-transformers' pooling flags up to 5.x, and the mode each stands for (6.x writes the mode: ``pooling_mode``)
LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
                "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens": "weightedmean",
                "pooling_mode_lasttoken": "lasttoken"}
ALL_MODES = tuple(LEGACY_MODES)


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
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
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
        hf_config, tensors = hf.base_model_only(hf_config, tensors)
    hf.write_hf_folder(out, hf_config, tensors, tokenizer_dir)
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
    (out / "config_sentence_transformers.json").write_text(json.dumps(
        {"similarity_fn_name": "cosine", "prompts": dict(prompts or {}), "default_prompt_name": default_prompt_name}, indent=2))
    return out


SIMILARITIES = ("cosine", "dot", "euclidean", "manhattan")  # sentence-transformers' SimilarityFunction


@dataclass(frozen=True)
class Splade:
    """SPLADE (Formal et al. 2021, "SPLADE v2"): a text's vector over the vocabulary, each token's weight
    log(1 + relu(its masked-LM score)) at the text's positions, max-pooled (``sum``: SPLADE v1), as
    sentence-transformers' ``SpladePooling`` and TEI's ``--pooling splade`` compute it
    (``ctxmodels.features.splade_pool``). ``log1p_relu`` takes log1p once more (OpenSearch's models);
    ``max_active_dims`` keeps a vector's largest weights only (a SparseEncoder's setting)."""

    pooling: Literal["max", "sum"] = "max"
    activation: Literal["relu", "log1p_relu"] = "relu"
    max_active_dims: int | None = None

    def shown(self) -> dict[str, Any]:
        return {"pooling": self.pooling, "activation": self.activation, "max_active_dims": self.max_active_dims}


@dataclass(frozen=True)
class SentenceSettings:
    """What a sentence-transformers folder says its vectors are: the defaults a served model takes."""

    pooling: Pooling = "mean"
    normalize: bool = False  # a Normalize module follows the pooling
    max_seq_length: int | None = None  # tokens a text keeps, special tokens included; None: the model's own limit
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put before a text ("query": "query: ")
    default_prompt_name: str | None = None  # the prompt every text gets unless another is asked
    similarity: str = "cosine"  # similarity_fn_name: cosine | dot | euclidean | manhattan
    problems: tuple[str, ...] = ()  # the folder's steps this project does not run: its vectors differ there
    splade: Splade | None = None  # a SparseEncoder folder's SpladePooling: its vectors are sparse (POST /embed_sparse)

    @property
    def default_prompt(self) -> str:
        return self.prompts.get(self.default_prompt_name, "") if self.default_prompt_name else ""

    def shown(self) -> dict[str, Any]:
        """For /v1/models and ``LocalModel.info``."""
        out: dict[str, Any] = {"pooling": self.pooling, "normalize": self.normalize, "max_seq_length": self.max_seq_length,
                               "similarity": self.similarity}
        if self.prompts:
            out.update(prompts=dict(self.prompts), default_prompt_name=self.default_prompt_name)
        if self.splade is not None:
            out["splade"] = self.splade.shown()
        if self.problems:
            out["not_reproduced"] = list(self.problems)
        return out


def sentence_defaults(settings: SentenceSettings | None, pooling: Pooling | None, normalize: bool | None,
                      max_len: int) -> tuple[Pooling, bool, int]:
    """(pooling, normalize, tokens a text keeps) of a model: those given, else its sentence-transformers
    folder's (``settings``; None: it has none), else mean pooling, not normalised; ``max_len`` (the
    model's positions) cut to the folder's max_seq_length. What ``ctx serve`` and ``ctx export`` share."""
    if settings is not None:
        max_len = min(max_len, settings.max_seq_length or max_len)
        pooling = pooling or settings.pooling
        normalize = settings.normalize if normalize is None else normalize
    return pooling or "mean", bool(normalize), max_len


def checkpoint_sentence_settings(folder: str | Path, task: Any = None) -> SentenceSettings | None:
    """A model folder's sentence settings: its sentence-transformers files (``read_sentence_settings``),
    else those of the embedding task it was fine-tuned for (``task``, its ``ctxmodels.tasks.TaskConfig``:
    the pooling it was trained with, unit vectors, its max_seq_length), else None."""
    own = read_sentence_settings(folder)
    if own is not None or task is None or task.kind != "embedding":
        return own
    return SentenceSettings(pooling=task.pooling, normalize=task.normalize, max_seq_length=task.max_seq_length)


def read_sentence_settings(folder: str | Path) -> SentenceSettings | None:
    """A sentence-transformers folder's settings (``modules.json`` and the files it points at), or
    None for a folder without ``modules.json``. A module this project does not run (Dense, max or
    weighted pooling, a pooling that leaves the prompt out, lowercasing) is named in ``problems``,
    not refused: the backbone's token vectors are still right. So is a file that is missing or not
    JSON (the message names it), with the defaults (mean pooling, not normalised) in place of it all."""
    root = Path(folder)
    if not (root / "modules.json").is_file():
        return None
    try:
        return _read_settings(root)
    except ValueError as e:
        return SentenceSettings(problems=(f"{e}; its sentence-transformers settings are left out",))


def _read_settings(root: Path) -> SentenceSettings:
    modules = _json(root / "modules.json")
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise ValueError(f"{root / 'modules.json'}: expected a list of modules, each with a 'type'")
    pooling: Pooling = "mean"
    normalize, max_seq_length, splade, problems = False, None, None, []
    for module in sorted(modules, key=lambda m: m.get("idx", 0)):
        kind = module_kind(module["type"])
        where = root / str(module.get("path") or "")
        if kind in ("Transformer", "MLMTransformer"):  # MLMTransformer: a SparseEncoder's, read for its masked-LM scores
            config = _json(where / "sentence_bert_config.json") if (where / "sentence_bert_config.json").is_file() else {}
            max_seq_length = _max_seq_length(config, where)
            if config.get("do_lower_case"):
                problems.append("do_lower_case (texts are tokenized as given)")
        elif kind == "Pooling":
            config = _json(where / "config.json")
            modes = _pooling_modes(config)
            if len(modes) == 1 and modes[0] in ST_POOLING:
                pooling = ST_POOLING[modes[0]]  # type: ignore[assignment]
            else:
                problems.append(f"pooling {'+'.join(modes) or 'none'} (mean is used)")
            if config.get("include_prompt") is False:
                problems.append("a pooling that leaves the prompt's tokens out (they are pooled)")
        elif kind == "Normalize":
            normalize = True
        elif kind == "SpladePooling":
            config = _json(where / "config.json")
            strategy, activation = config.get("pooling_strategy", "max"), config.get("activation_function", "relu")
            if strategy in ("max", "sum") and activation in ("relu", "log1p_relu"):
                splade = Splade(pooling=strategy, activation=activation)
            else:
                problems.append(f"SpladePooling with pooling_strategy {strategy!r} and activation_function {activation!r} "
                                "(max or sum of relu or log1p_relu are run)")
        else:
            problems.append(f"module {kind}")
    extra = _json(root / "config_sentence_transformers.json") if (root / "config_sentence_transformers.json").is_file() else {}
    prompts = {str(k): str(v) for k, v in (extra.get("prompts") or {}).items()}
    default = extra.get("default_prompt_name")
    if default is not None and default not in prompts:
        problems.append(f"default_prompt_name {default!r}, which is not among its prompts")
        default = None
    similarity = str(extra.get("similarity_fn_name") or "cosine")
    if similarity not in SIMILARITIES:
        problems.append(f"similarity_fn_name {similarity!r} (cosine is used)")
        similarity = "cosine"
    if splade is not None and extra.get("max_active_dims") is not None:
        top = extra["max_active_dims"]
        if isinstance(top, int) and not isinstance(top, bool) and top > 0:
            splade = Splade(splade.pooling, splade.activation, top)
        else:
            problems.append(f"max_active_dims {top!r}, not a positive integer (every weight is kept)")
    return SentenceSettings(pooling=pooling, normalize=normalize, max_seq_length=max_seq_length, prompts=prompts,
                            default_prompt_name=default, similarity=similarity, problems=tuple(problems), splade=splade)


# sentence-transformers' pooling modes (Pooling's ``pooling_mode``) that are ours
ST_POOLING: dict[str, str] = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
HUGE = 10**6  # a tokenizer's model_max_length above this is transformers' "no limit" (1e30)


def module_kind(type_name: Any) -> str:
    """A modules.json entry's class name. sentence-transformers up to 5.x names its modules
    ``sentence_transformers.models.Pooling``, 6.x by their modules
    (``sentence_transformers.sentence_transformer.modules.pooling.Pooling``,
    ``sentence_transformers.base.modules.transformer.Transformer``): both are "Pooling" and "Transformer".
    Another package's module keeps its whole name."""
    name = str(type_name)
    return name.rsplit(".", 1)[-1] if name.startswith("sentence_transformers.") else name


def _pooling_modes(config: dict) -> list[str]:
    """A Pooling module's modes: 6.x writes ``pooling_mode`` ("mean", or a list of them), earlier
    versions one ``pooling_mode_<mode>`` flag each (``pooling_mode_lasttoken``: "lasttoken")."""
    mode = config.get("pooling_mode")
    if mode is not None:
        return [mode] if isinstance(mode, str) else [str(m) for m in mode]
    return [mode for flag, mode in LEGACY_MODES.items() if config.get(flag)]


def _max_seq_length(config: dict, where: Path) -> int | None:
    """Tokens a text keeps: the module's ``max_seq_length``, else (as sentence-transformers falls back,
    and as 6.x saves it) the tokenizer's ``model_max_length``; None: the model's positions."""
    if config.get("max_seq_length") is not None:
        return int(config["max_seq_length"])
    tok_config = where / "tokenizer_config.json"
    if tok_config.is_file():
        limit = _json(tok_config).get("model_max_length")
        if isinstance(limit, (int, float)) and not isinstance(limit, bool) and 0 < limit < HUGE:
            return int(limit)
    return None


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: missing (named by the folder's modules.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
