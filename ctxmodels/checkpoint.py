"""Our checkpoint format (see docs/ARCHITECTURE.md, "Checkpoints"): a local directory of

    model.safetensors   state dict of the pretraining model; tied tensors stored once
    config.json         {"format": "ctxmodels", "family": ..., "model": {config fields}}
    tokenizer/          tokenizer files
    <name>.json         extra JSON files (trainer_state.json, ...)
    <name>.safetensors  extra tensor files (optimizer.safetensors, ...)
    MANIFEST.json       written last: every file above with its size and sha256

Every file is written to a temporary name and renamed into place, and MANIFEST.json comes last, so
a directory without a manifest (or whose files do not match it) is an interrupted save or copy
(``checkpoint_problem`` says which). Loading reads safetensors and JSON only: nothing is unpickled.
Directories are local; the jobs layer copies them to and from object storage
(``pipelines.storage.Store.copy_dir`` copies the manifest last too).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ctxmodels import hf, registry
from ctxmodels.files import CONFIG, MANIFEST, WEIGHTS, file_sha256, first_problem, manifest_entries  # noqa: F401 (re-exported)

TOKENIZER = "tokenizer"
RESERVED = {WEIGHTS, CONFIG, MANIFEST, TOKENIZER}


@dataclass
class LoadedModel:
    family: str
    config: Any
    model: nn.Module  # the pretraining model, in eval mode (call .train() to keep training)
    tokenizer_dir: Path | None = None  # where the tokenizer files are, if the checkpoint has them
    task: Any = None  # ctxmodels.tasks.TaskConfig of a fine-tuned model (then ``model`` is its TaskModel)
    untrained: tuple[str, ...] = ()  # weights a Hugging Face folder lacked (freshly initialised), e.g. "mlm.bias"


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def _publish(tmp: Path, final: Path) -> None:
    """Atomic rename: a reader sees either the old file, the whole new file, or none."""
    os.replace(tmp, final)


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    _publish(tmp, path)


def _write_safetensors(path: Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, tmp, metadata=metadata)
    _publish(tmp, path)


def split_tied(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tensors to store, {alias: stored name}) for a state dict whose entries may share storage.

    safetensors refuses tensors that share memory. Entries that are the same tensor (same storage,
    offset, shape and stride: tied weights) are stored once and re-tied on load; other overlapping
    views are stored as independent copies.
    """
    unique: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        t = t.detach()
        if t.numel() == 0:  # empty tensors have no meaningful storage address
            unique[name] = t
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
            unique[name] = t
    by_storage: dict[tuple, list[str]] = {}
    for name, t in unique.items():
        if t.numel():
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(name)
    out = {}
    for name, t in unique.items():
        shared = t.numel() and len(by_storage[(t.device, t.untyped_storage().data_ptr())]) > 1
        out[name] = t.cpu().clone() if shared else t.cpu().contiguous()
    return out, tied


def _config_fields(config: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    if hasattr(config, "model_dump"):  # pydantic
        return config.model_dump()
    raise TypeError(f"config must be a dataclass (or pydantic model), got {type(config).__name__}")


def _extra_name(name: str, suffix: str) -> str:
    file = name if name.endswith(suffix) else name + suffix
    if "/" in file or "\\" in file or file.startswith(".") or file in RESERVED:
        raise ValueError(f"extra file name {name!r} is not allowed (plain name, not one of {sorted(RESERVED)})")
    return file


def save_checkpoint(
    out_dir: str | Path,
    model: nn.Module,
    family: str,
    config: Any,
    tokenizer_dir: str | Path | None = None,
    extra_json: dict[str, dict] | None = None,
    extra_tensors: dict[str, dict[str, Tensor]] | None = None,
    task: Any = None,
    extra_text: dict[str, str] | None = None,
) -> Path:
    """Write a checkpoint directory; returns its path.

    ``extra_json`` maps a file name ("trainer_state" or "trainer_state.json") to a JSON-able dict;
    ``extra_tensors`` maps a file name ("optimizer") to tensors saved as <name>.safetensors;
    ``extra_text`` maps a file name, written as given ("MLmodel"), to its text. Each is listed in the
    manifest with the rest.
    """
    registry.family_spec(family)  # fail before writing anything if the family is unknown
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_files = {_extra_name(k, ".json"): v for k, v in (extra_json or {}).items()}
    tensor_files = {_extra_name(k, ".safetensors"): v for k, v in (extra_tensors or {}).items()}
    text_files = {_extra_name(k, ""): v for k, v in (extra_text or {}).items()}
    if set(text_files) & (set(json_files) | set(tensor_files)):
        raise ValueError(f"extra files named twice: {sorted(set(text_files) & (set(json_files) | set(tensor_files)))}")
    (out / MANIFEST).unlink(missing_ok=True)  # overwriting: incomplete until the new manifest lands
    written: list[Path] = []

    tensors, tied = split_tied(model.state_dict())
    _write_safetensors(out / WEIGHTS, tensors, metadata={"format": "pt", "tied": json.dumps(tied)})
    written.append(out / WEIGHTS)

    payload = {"format": "ctxmodels", "family": family, "model": _config_fields(config)}
    if task is not None:
        payload["task"] = dataclasses.asdict(task)
    _write_text(out / CONFIG, json.dumps(payload, indent=2))
    written.append(out / CONFIG)

    if tokenizer_dir is not None:
        files = hf.tokenizer_files(tokenizer_dir)
        dest = out / TOKENIZER
        if not files or files[0].parent.resolve() != dest.resolve():  # not saving onto itself
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            for f in files:
                tmp = dest / (f.name + ".tmp")
                shutil.copyfile(f, tmp)
                _publish(tmp, dest / f.name)
        written.extend(dest / f.name for f in files)

    for name, data in json_files.items():
        _write_text(out / name, json.dumps(data, indent=2))
        written.append(out / name)
    for name, data in tensor_files.items():
        _write_safetensors(out / name, {k: v.detach().cpu().contiguous() for k, v in data.items()})
        written.append(out / name)
    for name, text in text_files.items():
        _write_text(out / name, text)
        written.append(out / name)

    manifest = {
        "format": "ctxmodels-manifest",
        "files": [
            {"path": p.relative_to(out).as_posix(), "size": p.stat().st_size, "sha256": file_sha256(p)}
            for p in written
        ],
    }
    _write_text(out / MANIFEST, json.dumps(manifest, indent=2))
    return out


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


def checkpoint_problem(ckpt_dir: str | Path, verify_hashes: bool = False) -> str | None:
    """What keeps a local checkpoint folder from being complete, or None when nothing does.

    Complete: MANIFEST.json parses, lists the weights and the config, and every file it lists is
    present with its size (and sha256, with ``verify_hashes``). The same check for a folder in
    object storage is ``pipelines.storage.Store.checkpoint_problem``.
    """
    folder = Path(ckpt_dir)
    try:
        text = (folder / MANIFEST).read_bytes()
    except FileNotFoundError:
        return f"{MANIFEST} missing"
    except OSError as e:
        return f"manifest unreadable ({e})"
    entries, unusable = manifest_entries(text)
    if unusable:
        return unusable
    problems = []
    for entry in entries:
        path = folder / entry["path"]
        if not path.is_file():
            problems.append(f"{entry['path']} missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{entry['path']}: {path.stat().st_size} bytes, manifest says {entry['size']}")
        elif verify_hashes and file_sha256(path) != entry.get("sha256"):
            problems.append(f"{entry['path']}: sha256 differs from the manifest")
    return first_problem(problems)


def is_complete(ckpt_dir: str | Path, verify_hashes: bool = False) -> bool:
    """True when MANIFEST.json exists and every file it lists is present with its size (and hash)."""
    return checkpoint_problem(ckpt_dir, verify_hashes) is None


def load_checkpoint(ckpt_dir: str | Path, verify_hashes: bool = False) -> LoadedModel:
    """Load our checkpoint (through the registry) or a Hugging Face folder (through ctxmodels.hf)."""
    folder = Path(ckpt_dir)
    has_manifest = (folder / MANIFEST).exists()
    if has_manifest:  # ours: check before reading anything the manifest vouches for
        _raise_if_incomplete(folder, verify_hashes)
    config_path = folder / CONFIG
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder}: no {CONFIG}; not a checkpoint directory")
    try:
        payload = json.loads(config_path.read_text())
    except ValueError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from e

    if payload.get("format") != "ctxmodels":
        if "model_type" in payload:
            family, config, model, untrained = hf.load_hf_folder_untrained(folder)
            has_tok = any((folder / n).exists() for n in ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model"))
            return LoadedModel(family, config, model.eval(), folder if has_tok else None, untrained=tuple(untrained))
        raise ValueError(f"{config_path}: neither our format ('format': 'ctxmodels') nor an HF folder ('model_type')")

    if not has_manifest:
        _raise_if_incomplete(folder, verify_hashes)  # names the missing manifest
    family = payload["family"]
    try:
        config = registry.config_from_dict(family, payload["model"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{config_path}: {e}") from e
    task = None
    if "task" in payload:  # a fine-tuned model: its task model; every weight is then loaded from the file
        from ctxmodels.tasks import TaskConfig, build_task_model

        task = TaskConfig(**payload["task"])
        model = build_task_model(family, config, task, torch.Generator().manual_seed(0))
    else:
        model = registry.new_model(family, config, seed=0)  # every weight is then loaded from the file

    tensors = load_file(folder / WEIGHTS)
    with safe_open(folder / WEIGHTS, framework="pt") as f:
        tied: dict[str, str] = json.loads((f.metadata() or {}).get("tied", "{}"))
    result = model.load_state_dict(tensors, strict=False)
    missing = sorted(set(result.missing_keys) - set(tied))
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{folder / WEIGHTS} does not fit the {family} model built from {CONFIG}: "
            f"missing {missing[:5]}, unexpected {sorted(result.unexpected_keys)[:5]}"
        )
    if tied:  # the constructor ties them again; copy where it did not (stays correct either way)
        state = model.state_dict()
        with torch.no_grad():
            for alias, source in tied.items():
                if state[alias].data_ptr() != state[source].data_ptr():
                    state[alias].copy_(tensors[source])

    tok = folder / TOKENIZER
    return LoadedModel(family, config, model.eval(), tok if tok.is_dir() else None, task)


def _raise_if_incomplete(folder: Path, verify_hashes: bool) -> None:
    problem = checkpoint_problem(folder, verify_hashes)
    if problem is not None:
        raise ValueError(
            f"{folder} is an incomplete checkpoint: {problem} (an interrupted save or copy?); "
            "use an earlier checkpoint"
        )


def read_extra_json(ckpt_dir: str | Path, name: str) -> dict:
    return json.loads((Path(ckpt_dir) / _extra_name(name, ".json")).read_text())


def read_extra_tensors(ckpt_dir: str | Path, name: str) -> dict[str, Tensor]:
    return load_file(Path(ckpt_dir) / _extra_name(name, ".safetensors"))


# ----------------------------------------------------------------------------------------------
# Optimizer state without pickle: tensors -> safetensors, everything else -> JSON
# ----------------------------------------------------------------------------------------------


def _to_json(value: Any) -> Any:
    if isinstance(value, tuple):  # e.g. AdamW betas; restored as a tuple
        return {"__tuple__": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"optimizer state value of type {type(value).__name__} is neither a tensor nor JSON-able")


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_from_json(v) for v in value["__tuple__"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def optimizer_state_to_tensors(optimizer: torch.optim.Optimizer | dict, name: str | None = None) -> tuple[dict[str, Tensor], dict]:
    """(tensors, meta): tensors named "state.<param index>.<key>" / "param_groups.<group>.<key>"
    (CPU copies, for a safetensors file) and meta (JSON-able: hyper-parameters and scalar state).

    ``optimizer``: an optimizer, or a state dict in its layout (e.g. gathered from FSDP shards)
    with ``name`` the optimizer's class name."""
    if isinstance(optimizer, dict):
        if name is None:
            raise ValueError("optimizer_state_to_tensors: a state dict needs the optimizer's class name")
        sd = optimizer
    else:
        sd, name = optimizer.state_dict(), type(optimizer).__name__
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, param_state in sd["state"].items():
        for key, value in param_state.items():
            if torch.is_tensor(value):
                tensors[f"state.{pid}.{key}"] = value.detach().cpu().clone()
            else:
                scalars.setdefault(str(pid), {})[key] = _to_json(value)
    groups = []
    for g, group in enumerate(sd["param_groups"]):
        plain = {}
        for key, value in group.items():
            if torch.is_tensor(value):  # e.g. a tensor learning rate
                tensors[f"param_groups.{g}.{key}"] = value.detach().cpu().clone()
            else:
                plain[key] = _to_json(value)
        groups.append(plain)
    meta = {"optimizer": name, "state": scalars, "param_groups": groups}
    return tensors, meta


def load_optimizer_state(optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], meta: dict) -> None:
    """Inverse of ``optimizer_state_to_tensors``: load into an optimizer over the same parameters."""
    optimizer.load_state_dict(optimizer_state_from_tensors(tensors, meta, type(optimizer).__name__))


def optimizer_state_from_tensors(tensors: dict[str, Tensor], meta: dict, expect: str | None = None) -> dict[str, Any]:
    """The optimizer state dict saved by ``optimizer_state_to_tensors`` (``expect``: the class
    name of the optimizer it is for; a mismatch is refused)."""
    if expect is not None and meta.get("optimizer") != expect:
        raise ValueError(f"optimizer state was saved from {meta.get('optimizer')!r}, cannot load into {expect}")
    groups = [_from_json(g) for g in meta["param_groups"]]
    state: dict[int, dict[str, Any]] = {}
    for pid, values in meta["state"].items():
        state.setdefault(int(pid), {}).update(_from_json(values))
    for name, tensor in tensors.items():
        kind, index, key = name.split(".", 2)
        if kind == "state":
            state.setdefault(int(index), {})[key] = tensor
        elif kind == "param_groups":
            groups[int(index)][key] = tensor
        else:
            raise ValueError(f"unexpected optimizer tensor name {name!r}")
    return {"state": state, "param_groups": groups}
