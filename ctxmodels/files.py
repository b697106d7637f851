"""File helpers that need no torch: what a driver process (``ctx embed``, ``ctx serve build``)
reads about a checkpoint without paying torch's import (over a second)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# A checkpoint folder's files (ctxmodels.checkpoint writes them; pipelines.storage checks copies of them).
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
MANIFEST = "MANIFEST.json"  # written last: a folder without it is an interrupted save or copy


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_entries(text: bytes) -> tuple[list[dict[str, Any]], str | None]:
    """A checkpoint manifest's file entries and None, or [] and what makes it unusable: it must parse
    as ``{"files": [{"path": str, "size": int, "sha256": ...}, ...]}`` and list the weights and the
    config. The one reading of a manifest, for a local folder and for one in object storage alike."""
    try:
        manifest = json.loads(text)
    except ValueError as e:  # half a JSON document, or not UTF-8
        return [], f"manifest unreadable ({e})"
    entries = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("path"), str) and type(e.get("size")) is int for e in entries
    ):
        return [], 'manifest unreadable (expected {"files": [{"path": ..., "size": ..., "sha256": ...}, ...]})'
    listed = {e["path"] for e in entries}
    for name in (WEIGHTS, CONFIG):
        if name not in listed:
            return [], f"manifest does not list {name}"
    return entries, None


def first_problem(problems: list[str]) -> str | None:
    """The first of a folder's problems, saying how many more there are; None for none."""
    if not problems:
        return None
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
