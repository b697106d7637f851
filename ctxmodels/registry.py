"""Model families by name: a literal dict, so ``grep '"bert"'`` finds where a family is defined."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ctxmodels import albert, awd_lstm, bert, elmo, gpt, transformer_xl, xlnet


@dataclass(frozen=True)
class FamilySpec:
    config_cls: type  # the family's @dataclass config
    pretraining_cls: type[nn.Module]  # XxxForPreTraining(config, generator); forward(**batch) -> PretrainOutput
    presets: dict[str, Any]  # preset name -> config instance (a value: copy with dataclasses.replace)


FAMILIES: dict[str, FamilySpec] = {
    "bert": FamilySpec(
        config_cls=bert.BertConfig,
        pretraining_cls=bert.BertForPreTraining,
        presets={name: bert.PRESETS[name] for name in ("tiny", "mini", "base", "large")},
    ),
    # RoBERTa is BERT with other presets (no NSP, offset positions, one segment type).
    "roberta": FamilySpec(
        config_cls=bert.BertConfig,
        pretraining_cls=bert.BertForPreTraining,
        presets={
            "tiny": bert.PRESETS["roberta-tiny"],
            "base": bert.PRESETS["roberta-base"],
            "large": bert.PRESETS["roberta-large"],
        },
    ),
    # SpanBERT is BERT pretrained with span masking and the span boundary objective (its own head).
    "spanbert": FamilySpec(config_cls=bert.BertConfig, pretraining_cls=bert.BertForPreTraining, presets={n: dataclasses.replace(bert.PRESETS[n], sbo=True, nsp=False) for n in ("tiny", "base", "large")}),
    # XLM is BERT with a language embedding and no MLM transform (XLM's MLM and TLM).
    "xlm": FamilySpec(
        config_cls=bert.BertConfig,
        pretraining_cls=bert.BertForPreTraining,
        presets={name: bert.PRESETS["xlm-" + name] for name in ("tiny", "en-2048", "xnli15-1024", "100-1280")},
    ),
    "elmo": FamilySpec(config_cls=elmo.ElmoConfig, pretraining_cls=elmo.ElmoForPreTraining, presets=dict(elmo.PRESETS)),
    "gpt": FamilySpec(config_cls=gpt.GPTConfig, pretraining_cls=gpt.GPTForPreTraining, presets=dict(gpt.PRESETS)),
    "albert": FamilySpec(config_cls=albert.AlbertConfig, pretraining_cls=albert.AlbertForPreTraining, presets=dict(albert.PRESETS)),
    "transformer-xl": FamilySpec(
        config_cls=transformer_xl.TransfoXLConfig,
        pretraining_cls=transformer_xl.TransfoXLForPreTraining,
        presets=dict(transformer_xl.PRESETS),
    ),
    "xlnet": FamilySpec(config_cls=xlnet.XLNetConfig, pretraining_cls=xlnet.XLNetForPreTraining, presets=dict(xlnet.PRESETS)),
    # AWD-LSTM (Merity et al. 2017), the language model ULMFiT (Howard & Ruder 2018) fine-tunes.
    "awd-lstm": FamilySpec(config_cls=awd_lstm.AwdLstmConfig, pretraining_cls=awd_lstm.AwdLstmForPreTraining, presets=dict(awd_lstm.PRESETS)),
}


def family_spec(family: str) -> FamilySpec:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known families: {sorted(FAMILIES)}")
    return FAMILIES[family]


def make_config(family: str, preset: str, overrides: dict[str, Any] | None = None) -> Any:
    """The preset's config with ``overrides`` applied (validated by the config class)."""
    spec = family_spec(family)
    if preset not in spec.presets:
        raise ValueError(f"unknown preset {preset!r} for family {family!r}; known presets: {sorted(spec.presets)}")
    overrides = dict(overrides or {})
    known = {f.name for f in dataclasses.fields(spec.config_cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"unknown {spec.config_cls.__name__} field(s) {unknown} in overrides for {family}/{preset}; "
            f"known fields: {sorted(known)}"
        )
    return dataclasses.replace(spec.presets[preset], **overrides)


def config_from_dict(family: str, fields: dict[str, Any]) -> Any:
    """Rebuild a family's config from its JSON fields (checkpoint config.json "model")."""
    spec = family_spec(family)
    known = {f.name for f in dataclasses.fields(spec.config_cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown {spec.config_cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")
    return spec.config_cls(**fields)


def new_model(family: str, config: Any, seed: int | None = None) -> nn.Module:
    """The family's pretraining model with every weight drawn from ``torch.Generator`` seeded with
    ``seed`` (None: a fresh random seed): the same seed gives the same weights, and the global
    random state is neither read for them nor changed.

    ``nn.Linear``/``nn.Embedding``/``nn.LSTM`` constructors draw default values from the global
    generator before the family's init replaces every one of them from ``generator``; those
    throw-away draws run on a forked copy of the global state (``fork_rng``), so it is left as
    it was. tests/ctxmodels/test_reproducible.py checks both properties for every family.
    """
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    with torch.random.fork_rng(devices=[]):
        return family_spec(family).pretraining_cls(config, generator)


def build_model(family: str, preset: str, overrides: dict[str, Any] | None = None, seed: int | None = None) -> tuple[Any, nn.Module]:
    """(config, freshly initialised pretraining model) for ``family``/``preset`` with ``overrides``;
    weights from ``seed`` (``new_model``)."""
    config = make_config(family, preset, overrides)
    return config, new_model(family, config, seed)
