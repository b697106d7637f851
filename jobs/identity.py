"""What training and serving both say about a checkpoint: its version and its tokenizer's hash.

``ctx serve`` answers with them (``X-Model-Version``, ``X-Tokenizer-Hash``), ``ctx embed`` writes
them beside every vector, and registering a training run (``jobs.training.tracking``) tags the version with
the same tokenizer hash; so they live here, apart from the serving module, and neither side imports
the other for them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ctxmodels.files import file_sha256  # torch-free: a driver hashes a checkpoint without importing torch


def _folder_name(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1] or uri


def checkpoint_version(checkpoint: str, local_dir: Path | None = None) -> str | None:
    """``<folder name>@<16 hex>``: the SHA-256 of MANIFEST.json (which holds every file's SHA-256),
    or for a Hugging Face folder of config.json and the weights. None when that needs a download
    (a remote Hugging Face folder): the replica computes it from its copy."""
    from pipelines import storage

    name = _folder_name(checkpoint)
    if local_dir is None:
        if storage.is_remote(checkpoint):
            fs, path = storage.filesystem(checkpoint)
            manifest = storage.join(path, "MANIFEST.json")
            try:
                with fs.open_input_stream(manifest) as f:
                    return f"{name}@{hashlib.sha256(f.read()).hexdigest()[:16]}"
            except (FileNotFoundError, OSError):
                return None
        local_dir = Path(storage.filesystem(checkpoint)[1])
    if (local_dir / "MANIFEST.json").is_file():
        return f"{name}@{hashlib.sha256((local_dir / 'MANIFEST.json').read_bytes()).hexdigest()[:16]}"
    h = hashlib.sha256()
    for p in sorted(local_dir.iterdir()):
        if p.is_file() and (p.name == "config.json" or p.suffix == ".safetensors"):
            h.update(f"{p.name}\0{file_sha256(p)}\n".encode())
    return f"{name}@{h.hexdigest()[:16]}"


def tokenizer_hash(tokenizer_dir: Path) -> str:
    """16 hex of the SHA-256 over the tokenizer's files (names and contents)."""
    from ctxmodels.hf import tokenizer_files

    h = hashlib.sha256()
    for p in tokenizer_files(tokenizer_dir):
        h.update(f"{p.name}\0{file_sha256(p)}\n".encode())
    return h.hexdigest()[:16]
