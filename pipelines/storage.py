"""One way to reach files wherever they live: local paths, ``file://``, ``s3://`` and anything
pyarrow or fsspec can open (``gs://``, ``hdfs://``, ``az://`` ...).

S3-compatible endpoints (MinIO, moto, Ceph) are reached by ``endpoint_url`` or the standard
``AWS_ENDPOINT_URL`` variable, so the same code runs against AWS in production and a loopback
server in tests.
"""

from __future__ import annotations

import fnmatch
import os
import time
from pathlib import Path
from typing import Callable, TypeVar

import pyarrow.fs as pafs

T = TypeVar("T")

CORPUS_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


class StorageError(RuntimeError):
    """A URI that cannot be read or written; the message names it."""


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def filesystem(uri: str, endpoint_url: str | None = None) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) for a URI or local path."""
    if uri.startswith("s3://"):
        endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        kwargs = {}
        if endpoint:
            kwargs["endpoint_override"] = endpoint
            kwargs["scheme"] = "https" if endpoint.startswith("https") else "http"
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            kwargs["region"] = region
        return pafs.S3FileSystem(**kwargs), uri[len("s3://"):].rstrip("/")
    if uri.startswith("file://"):
        return pafs.LocalFileSystem(), uri[len("file://"):]
    if "://" in uri:
        try:
            return pafs.FileSystem.from_uri(uri)
        except (ValueError, OSError):  # pyarrow's ArrowInvalid is a ValueError
            import fsspec
            from pyarrow.fs import FSSpecHandler, PyFileSystem

            fs, path = fsspec.core.url_to_fs(uri)
            return PyFileSystem(FSSpecHandler(fs)), path
    return pafs.LocalFileSystem(), str(Path(uri).expanduser().resolve())


def with_retries(fn: Callable[[], T], what: str, attempts: int = 5, base_delay: float = 0.2) -> T:
    """Retry transient object-store errors (OSError from pyarrow/fsspec) with exponential backoff."""
    for i in range(attempts):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except OSError as e:
            if i == attempts - 1:
                raise StorageError(f"{what}: {e} (after {attempts} attempts)") from e
            time.sleep(base_delay * (2**i))
    raise AssertionError("unreachable")


def _has_glob(s: str) -> bool:
    return any(c in s for c in "*?[")


def list_files(uris: str | list[str], endpoint_url: str | None = None, suffixes: tuple[str, ...] = CORPUS_SUFFIXES) -> list[str]:
    """Expand folders/prefixes, globs and files into a sorted list of file URIs.

    Each entry of ``uris`` must match at least one file with one of ``suffixes``; otherwise the
    error names the entry, so a typo in a bucket prefix is caught before any worker starts.
    """
    out: list[str] = []
    for uri in [uris] if isinstance(uris, str) else list(uris):
        fs, path = filesystem(uri, endpoint_url)
        scheme = uri.split("://", 1)[0] + "://" if is_remote(uri) else ""
        if _has_glob(path):
            root = path
            while _has_glob(root):
                root = root.rsplit("/", 1)[0] if "/" in root else ""
            candidates = _walk(fs, root)
            matched = [p for p in candidates if fnmatch.fnmatch(p, path)]
        else:
            info = with_retries(lambda: fs.get_file_info(path), f"stat {uri}")
            if info.type == pafs.FileType.File:
                matched = [path]
            elif info.type == pafs.FileType.Directory:
                matched = _walk(fs, path)
            else:
                raise StorageError(f"input {uri!r} matches no file or folder")
        files = sorted(p for p in matched if p.endswith(suffixes))
        if not files:
            raise StorageError(f"input {uri!r} matches no corpus file (expected one of {', '.join(CORPUS_SUFFIXES)})")
        out.extend(scheme + p for p in files)
    return sorted(dict.fromkeys(out))


def _walk(fs: pafs.FileSystem, root: str) -> list[str]:
    sel = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    infos = with_retries(lambda: fs.get_file_info(sel), f"list {root}")
    return [i.path for i in infos if i.type == pafs.FileType.File]


def download_dir(uri: str, local_dir: str | Path, endpoint_url: str | None = None) -> Path:
    """Copy a folder (any filesystem) into ``local_dir``; returns the local folder."""
    local_dir = Path(local_dir)
    if not is_remote(uri):
        src = Path(filesystem(uri)[1])
        if not src.is_dir():
            raise StorageError(f"{uri!r} is not a folder")
        return src
    fs, path = filesystem(uri, endpoint_url)
    info = with_retries(lambda: fs.get_file_info(path), f"stat {uri}")
    if info.type != pafs.FileType.Directory:
        raise StorageError(f"{uri!r} is not a folder")
    local_dir.mkdir(parents=True, exist_ok=True)
    with_retries(lambda: pafs.copy_files(path, str(local_dir), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem()), f"download {uri}")
    return local_dir


def upload_dir(local_dir: str | Path, uri: str, endpoint_url: str | None = None) -> None:
    fs, path = filesystem(uri, endpoint_url)
    fs.create_dir(path, recursive=True)
    with_retries(lambda: pafs.copy_files(str(local_dir), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs), f"upload to {uri}")


def exists(uri: str, endpoint_url: str | None = None) -> bool:
    fs, path = filesystem(uri, endpoint_url)
    return with_retries(lambda: fs.get_file_info(path), f"stat {uri}").type != pafs.FileType.NotFound


def join(uri: str, *parts: str) -> str:
    if is_remote(uri) or uri.startswith("file://"):
        return "/".join([uri.rstrip("/"), *parts])
    return str(Path(uri).joinpath(*parts))


def latest_complete_checkpoint(run_uri: str, endpoint_url: str | None = None, marker: str = "MANIFEST.json") -> str | None:
    """The newest ``checkpoint_*`` folder under a run that has its manifest (i.e. was committed)."""
    fs, path = filesystem(run_uri, endpoint_url)
    sel = pafs.FileSelector(path, recursive=False, allow_not_found=True)
    infos = with_retries(lambda: fs.get_file_info(sel), f"list {run_uri}")
    names = sorted((i.base_name for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")), reverse=True)
    for name in names:
        if fs.get_file_info(f"{path}/{name}/{marker}").type == pafs.FileType.File:
            return join(run_uri, name)
    return None
