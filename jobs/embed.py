"""Bulk re-embedding: recompute stored embeddings for a new model version with Ray Data.

    ctx embed --model runs/minilm-pairs --input s3://index/texts/ --output s3://index/vectors/minilm-v7/

    Parquet (id, text) --read_parquet--> rows --map_batches(Embedder, actor pool)--> (id, embedding,
    model_version, tokenizer_hash) --write_parquet--> a NEW folder

Each actor loads the model once, through the serving code (``jobs.serve.EmbeddingModel.embed_now``),
so a stored vector equals what /v1/embeddings answers for that text with the same ``pooling`` and
``normalize`` (and ``"truncate": true``: a stored text longer than the model reads is cut, not
refused). The output is written beside the old embeddings, never over them: a folder that already
holds files is refused before anything is read. Every row carries the model version (folder name +
MANIFEST.json hash) and the tokenizer hash, as the server's answers do, so an index never mixes two
embedding spaces unknowingly.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from pipelines import storage

Pooling = Literal["mean", "cls", "last"]
POOLINGS: tuple[str, ...] = ("mean", "cls", "last")
# A bulk job bounds its work by --batch-size; the server's per-request token cap protects a server from
# one client and would only refuse a large batch of long texts here.
UNBOUNDED_TOKENS = 2**62


class Embedder:
    """Ray Data actor: one model per actor, loaded once; a pyarrow batch of (id, text) -> vectors."""

    def __init__(self, checkpoint: str, version: str | None, id_column: str, text_column: str, pooling: str, normalize: bool, batch_size: int):
        from jobs.serve import EmbeddingModel
        from jobs.serve_config import Limits, ModelConfig

        settings = ModelConfig(uri=checkpoint, max_batch_size=batch_size)
        # The Serve deployment's own class: same loading, version check, tokenizer and pooling as a replica.
        self.model = EmbeddingModel.func_or_class("embed", checkpoint, version, settings, Limits(max_tokens_per_request=UNBOUNDED_TOKENS))
        self.id_column, self.text_column = id_column, text_column
        self.pooling, self.normalize = pooling, normalize

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = batch.column(self.id_column)
        texts = batch.column(self.text_column).to_pylist()
        missing = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if missing:
            bad = ids[missing[0]].as_py()
            raise ValueError(f"row with {self.id_column}={bad!r} has no text in column {self.text_column!r} ({len(missing)} such rows in this batch)")
        out = self.model.embed_now(texts, pooling=self.pooling, normalize=self.normalize, truncate=True)
        vectors = out["embeddings"]
        dim = len(vectors[0]) if vectors else self.model.dim
        flat = pa.array(np.concatenate(vectors).astype(np.float32) if vectors else np.zeros(0, np.float32))
        n = len(texts)
        return pa.table({
            "id": ids,
            "embedding": pa.FixedSizeListArray.from_arrays(flat, dim),  # (n, dim) float32
            "model_version": pa.array([out["version"]] * n, pa.string()),
            "tokenizer_hash": pa.array([out["tokenizer_hash"]] * n, pa.string()),
        })


def refuse_existing(output: str, endpoint_url: str | None = None) -> bool:
    """Raise FileExistsError when ``output`` is a file or a folder holding anything; True when it is
    an empty folder already (the write then adds to it), False when it does not exist."""
    fs, path = storage.filesystem(output, endpoint_url)
    info = storage.with_retries(lambda: fs.get_file_info(path), f"stat {output}")
    if info.type != pafs.FileType.File:
        # A prefix with objects under it can read as NotFound on some S3 stores (no folder markers): list it.
        listed = storage.with_retries(lambda: fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)), f"list {output}")
        if not listed:
            return info.type == pafs.FileType.Directory
    raise FileExistsError(
        f"--output {output} already holds embeddings or other files: re-embedding writes a new folder "
        f"beside the old ones and never over them; give a new folder (e.g. one named after the model version)"
    )


def reembed(
    model: str,
    input: str,
    output: str,
    *,
    id_column: str = "id",
    text_column: str = "text",
    pooling: Pooling = "mean",
    normalize: bool = False,
    endpoint_url: str | None = None,
    batch_size: int = 64,
    actors: int = 1,
    num_gpus: float = 0.0,
) -> dict[str, Any]:
    """Embed every (id, text) row of the Parquet at ``input`` with ``model`` into new Parquet at ``output``.

    ``model``: a checkpoint, a training run folder (its best or newest complete checkpoint), a Hugging
    Face folder or ``pkg:PACKAGE/PATH``, local or ``s3://`` (a model on S3 is read with
    AWS_ENDPOINT_URL, as ``ctx serve`` reads it). ``endpoint_url`` is the S3 endpoint of ``input`` and
    ``output``. Returns {"rows", "dim", "model_version", "tokenizer_hash", "checkpoint", "input",
    "output"}, read back from what was written.
    """
    import ray

    from jobs.serve import checkpoint_version, resolve_checkpoint

    if pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r}: use one of {', '.join(POOLINGS)}")
    if batch_size < 1 or actors < 1:
        raise ValueError(f"batch_size ({batch_size}) and actors ({actors}) must be at least 1")
    existed_empty = refuse_existing(output, endpoint_url)  # before any work: old vectors stay as they are
    in_fs, in_path = storage.filesystem(input, endpoint_url)
    out_fs, out_path = storage.filesystem(output, endpoint_url)
    checkpoint = resolve_checkpoint(model)
    version = checkpoint_version(checkpoint)  # replicas of the same version check it on load

    # --- Ray seam: Ray Data read -> actor pool -> write ---
    ds = ray.data.read_parquet(in_path, filesystem=in_fs, columns=[id_column, text_column])
    schema = ds.schema()
    for col in (id_column, text_column):
        if col not in schema.names:
            raise ValueError(f"--input {input}: no column {col!r} (columns: {', '.join(schema.names)}); name it with --id-column / --text-column")
    rows_in = ds.count()
    if rows_in == 0:
        raise ValueError(f"--input {input}: no rows to embed")
    vectors = ds.map_batches(
        Embedder,
        fn_constructor_args=(checkpoint, version, id_column, text_column, pooling, normalize, batch_size),
        batch_size=batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=actors),
        num_gpus=num_gpus,
    )
    # SaveMode.ERROR: Ray Data refuses too if another writer created the folder since the check above.
    mode = ray.data.SaveMode.APPEND if existed_empty else ray.data.SaveMode.ERROR
    vectors.write_parquet(out_path, filesystem=out_fs, mode=mode)

    return _summary(out_fs, out_path, rows_in, checkpoint=checkpoint, input=input, output=output)


def _summary(fs: pafs.FileSystem, path: str, rows_in: int, **where: str) -> dict[str, Any]:
    """What was written, read back: row count, width and the single model version of the rows."""
    import pyarrow.dataset as pads

    table = pads.dataset(path, filesystem=fs, format="parquet").to_table(columns=["model_version", "tokenizer_hash"])
    if table.num_rows != rows_in:
        raise RuntimeError(f"{where['output']}: wrote {table.num_rows} rows for {rows_in} input rows")
    versions = sorted(set(table.column("model_version").to_pylist()))
    hashes = sorted(set(table.column("tokenizer_hash").to_pylist()))
    if len(versions) > 1 or len(hashes) > 1:
        raise RuntimeError(f"{where['output']}: rows of several model versions {versions} / tokenizers {hashes}")
    dim = pads.dataset(path, filesystem=fs, format="parquet").schema.field("embedding").type.list_size
    return {"rows": rows_in, "dim": dim, "model_version": versions[0], "tokenizer_hash": hashes[0], **where}
