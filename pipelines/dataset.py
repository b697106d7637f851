"""The Ray Data stream that feeds pretraining.

::

    work units {shard, shard_key, epoch}      one row per (epoch, shard), shard order keyed by (seed, epoch)
      -> map_batches(TokenizePack)             actor pool: read shard, tokenize (Rust batch encoder),
                                               pack FULL-SENTENCES blocks; sample_id = shard_key<<32 | index
      -> map_batches(apply_objective)          stateless tasks: MLM masking keyed by (seed, epoch, sample_id)
      -> Ray Train: get_dataset_shard("train")

A shard is the unit of work and ``sample_id`` names a packed sequence by (shard, position in the
shard), so ids and masks do not depend on how Ray splits or orders the work. The same functions
run without Ray (``local_batches``) for evaluation and tests.
"""

from __future__ import annotations

import posixpath
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from pipelines.masking import MlmConfig, VocabInfo, mask_tokens
from pipelines.packing import Packer
from pipelines.rng import keyed_uniform, stable_hash64
from pipelines.sources import Format, iter_documents
from pipelines.tokenizers import Tokenizer, load_tokenizer

# Ray resources of the data stages: fractional so that, on a small machine, tokenization and
# masking share cores with the training workers instead of waiting for a whole free CPU.
TOKENIZE_ACTOR_CPUS = 0.5
TRANSFORM_TASK_CPUS = 0.25
PACKED_ROWS_PER_BATCH = 512


@dataclass(frozen=True)
class StreamSpec:
    """Everything the stream needs, as plain values (shipped to Ray workers)."""

    shards: tuple[str, ...]
    seq_len: int
    seed: int = 0
    first_epoch: int = 0
    max_epochs: int = 1
    shuffle_files: bool = True
    fmt: Format = "auto"
    text_field: str = "text"
    endpoint_url: str | None = None
    objective: str = "mlm"
    mlm: MlmConfig = field(default_factory=MlmConfig)
    tokenize_actors: int = 1


def shard_keys(shards: tuple[str, ...] | list[str]) -> list[int]:
    """31-bit key of each shard: a hash of its path relative to the corpus root (the folder all
    shards share), so moving a corpus between a local folder and a bucket keeps its sample ids,
    and with them its masks."""
    paths = [s.split("://", 1)[-1] for s in shards]
    root = posixpath.commonpath(paths) if len(paths) > 1 else posixpath.dirname(paths[0])
    if root in paths:  # a single file, or one shard that is the prefix of the others
        root = posixpath.dirname(root)
    return [stable_hash64(p[len(root):].lstrip("/")) & 0x7FFFFFFF for p in paths]


def shard_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order in which an epoch visits the shards: a function of (seed, epoch) alone."""
    if not shuffle:
        return np.arange(n)
    u = keyed_uniform(seed, epoch, np.zeros(1, dtype=np.int64), n, stream=0x5A4D)[0]
    return np.argsort(u, kind="stable")


def work_units(spec: StreamSpec) -> list[dict[str, Any]]:
    keys = shard_keys(spec.shards)
    units = []
    for epoch in range(spec.first_epoch, spec.first_epoch + spec.max_epochs):
        for i in shard_order(len(spec.shards), spec.seed, epoch, spec.shuffle_files):
            units.append({"shard": spec.shards[i], "shard_key": keys[i], "epoch": epoch})
    return units


# ---------------------------------------------------------------------------------------------
# Stage 1: tokenize and pack one shard (runs in a Ray Data actor; stateful only in the tokenizer).


def tokenizer_files(local_dir: str | Path) -> dict[str, bytes]:
    """A tokenizer folder as bytes, so actors on any node can rebuild it without shared disk."""
    root = Path(local_dir)
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def tokenizer_from_files(files: dict[str, bytes]) -> Tokenizer:
    root = Path(tempfile.mkdtemp(prefix="ctx-tokenizer-"))
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return load_tokenizer(root)


def pack_shard(tok: Tokenizer, uri: str, key: int, epoch: int, spec: StreamSpec) -> Iterator[dict[str, np.ndarray]]:
    """Packed rows of one shard, in shard order, with their sample ids."""
    packer = Packer(spec.seq_len, tok.cls_id, tok.sep_id, tok.pad_id)
    index = 0

    def emit(block: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        nonlocal index
        n = len(block["input_ids"])
        if n == 0:
            return None
        ids = (np.int64(key) << np.int64(32)) | (index + np.arange(n, dtype=np.int64))
        index += n
        return {**block, "sample_id": ids, "epoch": np.full(n, epoch, dtype=np.int64)}

    for docs in iter_documents(uri, spec.fmt, spec.text_field, endpoint_url=spec.endpoint_url):
        out = emit(packer.add(tok.encode_batch(docs)))
        if out is not None:
            yield out
    out = emit(packer.flush())
    if out is not None:
        yield out


class TokenizePack:
    """Ray Data callable class: one input row = one (shard, epoch) work unit."""

    def __init__(self, files: dict[str, bytes], spec: StreamSpec):
        self.tok = tokenizer_from_files(files)
        self.spec = spec

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        for uri, key, epoch in zip(batch["shard"], batch["shard_key"], batch["epoch"]):
            buf: list[dict[str, np.ndarray]] = []
            rows = 0
            for block in pack_shard(self.tok, str(uri), int(key), int(epoch), self.spec):
                buf.append(block)
                rows += len(block["input_ids"])
                if rows >= PACKED_ROWS_PER_BATCH:
                    yield _concat(buf)
                    buf, rows = [], 0
            if buf:
                yield _concat(buf)


def _concat(blocks: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}


# ---------------------------------------------------------------------------------------------
# Stage 2: the objective's transform (pure function of (batch, seed, cfg)).


def apply_objective(batch: dict[str, np.ndarray], seed: int, objective: str, mlm: MlmConfig, vocab: VocabInfo) -> dict[str, np.ndarray]:
    if objective == "mlm":
        return mask_tokens(batch, seed, mlm, vocab)
    raise ValueError(f"data.objective: unknown objective {objective!r}")


# ---------------------------------------------------------------------------------------------
# Assembly.


def build_dataset(spec: StreamSpec, tokenizer_dir: str | Path):
    """The training stream as a lazy Ray Dataset (nothing runs until it is iterated)."""
    import ray

    tok = load_tokenizer(tokenizer_dir)
    units = work_units(spec)
    ds = ray.data.from_items(units, override_num_blocks=len(units))
    ds = ds.map_batches(
        TokenizePack,
        fn_constructor_kwargs={"files": tokenizer_files(tokenizer_dir), "spec": spec},
        batch_size=1,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=spec.tokenize_actors),
        num_cpus=TOKENIZE_ACTOR_CPUS,
    )
    return ds.map_batches(
        apply_objective,
        fn_kwargs={"seed": spec.seed, "objective": spec.objective, "mlm": spec.mlm, "vocab": VocabInfo.from_tokenizer(tok)},
        batch_format="numpy",
        batch_size=None,
        num_cpus=TRANSFORM_TASK_CPUS,
    )


def local_batches(spec: StreamSpec, tok: Tokenizer, batch_size: int, epoch: int, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The same samples without Ray, in shard order: for evaluation and tests."""
    vocab = VocabInfo.from_tokenizer(tok)
    pending: list[dict[str, np.ndarray]] = []
    rows = 0
    produced = 0
    for uri, key in zip(spec.shards, shard_keys(spec.shards)):
        for block in pack_shard(tok, uri, key, epoch, spec):
            pending.append(block)
            rows += len(block["input_ids"])
            while rows >= batch_size:
                merged = _concat(pending)
                yield apply_objective({k: v[:batch_size] for k, v in merged.items()}, spec.seed, spec.objective, spec.mlm, vocab)
                produced += 1
                if max_batches is not None and produced >= max_batches:
                    return
                rest = {k: v[batch_size:] for k, v in merged.items()}
                rows = len(rest["input_ids"])
                pending = [rest] if rows else []
