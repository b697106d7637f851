"""Bulk re-embedding: recompute stored embeddings for a new model version with Ray Data.

    ctx embed --model runs/minilm-pairs --input s3://index/texts/ --output s3://index/vectors/minilm-v7/

    Parquet, JSON lines or CSV (id, text) --read (the driver, up to DRIVER_READ_BYTES; else Ray Data's
    read_parquet / read_json / read_csv)--> blocks of
    --actor-batch-size rows --map_batches(Embedder, a fixed pool of --actors)--> (id, embedding,
    model_version, tokenizer_hash) --write_parquet--> a NEW folder

On a machine with no cluster to use, an input the driver reads runs on the local engine instead
(``engine``, ``reembed``'s docstring): one ``Embedder`` in this process over the same chunks, no Ray.

Each actor loads the model once, through the serving code (``jobs.serving.replica.EmbeddingReplica.embed_now``),
so a stored vector equals what /v1/embeddings answers for that text with the same ``pooling`` and
``normalize`` (and ``"truncate": true``: a stored text longer than the model reads is cut, not
refused). The output is written beside the old embeddings, never over them: a folder that already
holds files is refused before anything is read. Every row carries the model version (folder name +
MANIFEST.json hash) and the tokenizer hash, as the server's answers do, so an index never mixes two
embedding spaces unknowingly.

Two batch sizes: Ray Data hands an actor ``actor_batch_size`` rows (1024) at a time, and ``embed_now``
sorts them by length into forward passes of at most ``batch_size`` rows (32, the server's
``max_batch_size``) and ``max_batch_tokens`` padded tokens (``jobs.serving.passes.token_budget_groups``): the
more rows one call sorts, the less padding its passes carry, while each pass stays small.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Iterator, Literal

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from jobs.serving.precision import CALIBRATION_ROWS, PRECISIONS, quantize, ranges_of
from jobs.runlock import RunLock
from pipelines import storage

Pooling = Literal["mean", "cls", "last"]
POOLINGS: tuple[str, ...] = ("mean", "cls", "last")
Engine = Literal["auto", "ray", "local"]
ENGINES: tuple[str, ...] = ("auto", "ray", "local")
DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")  # jobs.serving.serve_config.ModelSettings.dtype
LOCAL_FILE_ROWS = 16384  # rows per Parquet file the local engine writes (~25 MB of 384-dim vectors)
# A bulk job bounds its work by the pass sizes below; the server's per-request token cap protects a
# server from one client and would only refuse a large batch of long texts here.
UNBOUNDED_TOKENS = 2**62
PASS_ROWS = 32  # rows per forward pass: the server's max_batch_size (jobs.serving.serve_config.ModelSettings)
PASS_TOKENS = 16384  # padded tokens (rows x longest row) per forward pass: the server's max_batch_tokens
# Rows an actor is handed per call and sorts by length into passes. Sorting 512 or more rows leaves little
# padding (one actor, one thread: 296 rows/s sorting 128 rows at a time, 347 at 512, 344 at 1024); more rows
# per call means fewer, longer calls and a longer tail at the end of a run.
ACTOR_BATCH_ROWS = 1024
# One torch thread per actor, as many actors as the CPUs hold. On 2 cores 2 actors x 1 thread ran a steady
# 729 rows/s and 0.62 of the in-process limit end to end (16,384 rows), 1 actor x 2 threads 559 rows/s and
# 0.55 (it starts 2 s sooner); at load 2-3, 588 rows/s against 205-300 (README, Benchmarks). One actor's
# OpenMP threads wait for each other at every operation, and Ray's own processes keep taking a core from one.
CPUS_PER_ACTOR = 1.0
# Ray Data's listing, reading, repartitioning and writing tasks each ask for a whole CPU (ListFiles and
# StreamingRepartition cannot be told less): a pool that held every CPU would leave them waiting, and itself
# waiting for their blocks, forever. The pool leaves this many CPUs to them, and a local Ray that ctx embed
# starts counts that many more than the machine's cores: those tasks spend little of one.
IO_CPUS = 1
# An input this small (its Parquet files' bytes) is read by the driver, which has its footers open already, and
# handed to Ray Data as in-memory blocks of actor_batch_size rows (ray.data.from_arrow): no listing, reading
# or repartitioning task, each of which starts a Ray worker process first. On 2 cores that took a no-op
# pipeline over 1,024 rows from 13.4-13.7 s to 9.7-10.3 s (Ray's start and shutdown included). A larger
# input streams from storage through Ray Data's read tasks, as before.
DRIVER_READ_BYTES = 64 << 20
# What an input file is read as, by its name's ending: pyarrow.dataset's format for the driver, and the Ray Data
# reader that streams a larger input. JSON is JSON lines, one object a line (what Ray Data and pyarrow read).
INPUT_FORMATS: dict[str, str] = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
# A JSON lines or CSV file may be compressed whole, as corpora often ship (``docs.jsonl.gz``): these endings are
# the codecs Ray Data's readers (pyarrow.Codec.detect) take from the name and undo as they read. pyarrow.dataset,
# the driver's reader, undoes all but ".zst" (it knows zstd only as ".zstd", which Ray Data does not): an input
# holding STREAMED_COMPRESSIONS is read by the driver as a stream instead (``_StreamedInput``), and the endings
# neither reads (UNREAD_COMPRESSIONS) are refused with a message. Parquet compresses inside, by column.
COMPRESSIONS = storage.ARROW_COMPRESSIONS
STREAMED_COMPRESSIONS: tuple[str, ...] = (".zst",)
UNREAD_COMPRESSIONS: tuple[str, ...] = (".zstd", ".br")
RAY_READERS: dict[str, str] = {"parquet": "read_parquet", "json": "read_json", "csv": "read_csv"}
# Written into the output folder before its first vector: the model version and every setting the vectors depend
# on, so a resumed run (--resume) adds to a folder only vectors made the same way. Its "_" keeps it out of what
# Parquet readers (pyarrow, Ray Data, pandas) read as the folder's data.
RUN_FILE = "_embed.json"
# The output folder's lock while a run writes there (jobs.runlock.RunLock), also named so Parquet readers
# skip it; the lock's temporary files start with ".", as skipped.
RUN_LOCK = "_embed.lock.json"
EMBED_CLASH = ("Two runs into one folder would write the same rows twice. Wait for it to finish, stop it, or give another "
               "--output (resume a run only once it has stopped).")
# A run file of an earlier version lacks the settings added since: read as these (the vectors were made so).
RUN_DEFAULTS: dict[str, Any] = {"precision": "float32"}
PROGRESS_EVERY_S = 30.0  # the local engine's progress where stderr is no terminal (job logs): a line this often
# A SPLADE model's stored vector: its nonzero weights by token id, ascending
SPARSE_TYPE = pa.struct([("indices", pa.list_(pa.int32())), ("values", pa.list_(pa.float32()))])


class Embedder:
    """Ray Data actor: one model per actor, loaded once; a pyarrow batch of (id, text) -> vectors.

    ``batch_size`` and ``max_batch_tokens`` bound each forward pass (``embed_now`` sorts the batch it is
    handed by length into such passes); ``threads``: torch's intra-op threads, the CPUs Ray gave the actor;
    ``dtype``: the forward passes' (``ctx serve``'s ``dtype``: "auto" is float16 on a GPU, float32 on the CPU);
    ``cuda_graphs``: on a GPU, passes replayed from CUDA graphs (``ctx serve``'s ``cuda_graphs``);
    ``language``: what a multilingual XLM reads the texts as (``ctx serve``'s ``language``).
    ``dimensions``, ``prompt_name``, ``prompt``: as /v1/embeddings' (``EmbeddingReplica.embed_now``): the first
    ``dimensions`` components, re-normalised when the vectors are; a text put before every text, the
    folder's prompt ``prompt_name`` names or ``prompt`` itself (None and None: the folder's default prompt).
    ``precision``: the stored vectors', sentence-transformers' names (``jobs.serving.precision``); int8 and
    uint8 take their levels from ``ranges`` ((2, dim): minima, maxima; ``calibrate`` gives them)."""

    def __init__(self, checkpoint: str, version: str | None, id_column: str | None, text_column: str, pooling: str | None,
                 normalize: bool | None,
                 batch_size: int = PASS_ROWS, max_batch_tokens: int = PASS_TOKENS, threads: int | None = None,
                 dtype: str = "auto", cuda_graphs: bool = True, language: int | str | None = None, *,
                 dimensions: int | None = None, prompt_name: str | None = None, prompt: str | None = None,
                 precision: str = "float32", ranges: list[list[float]] | None = None):
        import torch

        from jobs.serving.replica import EmbeddingReplica  # the serving replica's class, without Ray Serve
        from jobs.serving.serve_config import Limits, ModelConfig

        if threads is not None:
            torch.set_num_threads(threads)
        settings = ModelConfig(uri=checkpoint, max_batch_size=batch_size, max_batch_tokens=max_batch_tokens, dtype=dtype,
                               cuda_graphs=cuda_graphs, language=language)
        # The Serve deployment's own class: same loading, version check, tokenizer and pooling as a replica.
        # Named by its checkpoint: a refusal (a prompt_name the folder lacks) names the model the user gave.
        self.model = EmbeddingReplica(checkpoint, checkpoint, version, settings, Limits(max_tokens_per_request=UNBOUNDED_TOKENS))
        self.id_column, self.text_column = id_column, text_column
        self.pooling, self.normalize = pooling, normalize
        # A SPLADE model (a SparseEncoder folder) stores its sparse vectors unless a pooling asks for its backbone's dense ones.
        self.sparse = self.model.splade is not None and pooling is None
        self.options = {"dimensions": dimensions, "prompt_name": prompt_name, "prompt": prompt}
        self.store_as(precision, ranges)

    def store_as(self, precision: str, ranges: list[list[float]] | None = None) -> None:
        """Vectors from now on stored at ``precision``, int8/uint8's levels cut in ``ranges``."""
        if self.sparse and precision != "float32":
            raise ValueError(self._sparse_refusal(f"--precision {precision}"))
        if precision.endswith("int8") and ranges is None:
            raise ValueError(f"precision {precision!r} needs the ranges of its levels: Embedder.calibrate gives them")
        self.precision, self.ranges = precision, None if ranges is None else np.asarray(ranges, np.float32)
        if self.ranges is not None and self.ranges.shape[-1] != self.dim:
            raise ValueError(f"ranges for {self.ranges.shape[-1]} dimensions: the vectors have {self.dim}")

    @property
    def dim(self) -> int:
        """Components of a float32 vector: ``dimensions``, else the model's width (a sparse one's: its vocabulary)."""
        return self.model.tokenizer.vocab_size if self.sparse else self.options["dimensions"] or self.model.dim

    def _sparse_refusal(self, what: str) -> str:
        return (f"model {self.model.name!r} is a SPLADE model: its vectors are stored sparse, as their float32 weights by token id, "
                f"and {what} is for dense vectors; leave it out, or give --pooling for its backbone's dense vectors")

    def calibrate(self, texts: list[str]) -> list[list[float]]:
        """int8/uint8's ranges: each dimension's minimum and maximum over ``texts``' float32 vectors."""
        if self.sparse:
            raise ValueError(self._sparse_refusal("an int8 or uint8 --precision"))
        out = self.model.embed_now(texts, pooling=self.pooling, normalize=self.normalize, truncate=True, **self.options)
        return ranges_of(np.stack(out["embeddings"]).astype(np.float32)).tolist()

    def check(self, precision: str = "float32") -> None:
        """ValueError (the replica's InputError) for options this model cannot take: a ``prompt_name`` its
        folder does not have, ``dimensions`` above its width, a prompt given both ways; for a SPLADE model's
        sparse vectors, ``dimensions`` or a ``precision`` other than float32. Nothing is embedded."""
        if self.sparse:
            if self.options["dimensions"] is not None:
                raise ValueError(self._sparse_refusal("--dimensions"))
            if precision != "float32":
                raise ValueError(self._sparse_refusal(f"--precision {precision}"))
            self.model.sparse_now([], prompt_name=self.options["prompt_name"], prompt=self.options["prompt"])
            return
        self.model.embed_now([], pooling=self.pooling, normalize=self.normalize, truncate=True, **self.options)

    def __call__(self, batch: pa.Table) -> pa.Table:
        vectors, out = self._vectors(batch)
        n = batch.num_rows
        return pa.table({
            "id": batch.column(self.id_column),
            "embedding": vectors,
            "model_version": pa.array([out["version"]] * n, pa.string()),
            "tokenizer_hash": pa.array([out["tokenizer_hash"]] * n, pa.string()),
        })

    def _vectors(self, batch: pa.Table) -> tuple[pa.Array, dict]:
        """The batch's text column embedded: (n, dim) float32 (or at ``precision``) as a fixed-size list column,
        and embed_now's stamp; a SPLADE model's sparse vectors as a struct column (``sparse_column``)."""
        texts = batch.column(self.text_column).to_pylist()
        missing = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if missing:
            where = f"with {self.id_column}={batch.column(self.id_column)[missing[0]].as_py()!r}" if self.id_column else f"{missing[0]} of a batch"
            raise ValueError(f"row {where} has no text in column {self.text_column!r} ({len(missing)} such rows in this batch)")
        if self.sparse:
            sparse = self.model.sparse_now(texts, truncate=True, prompt_name=self.options["prompt_name"], prompt=self.options["prompt"])
            return sparse_column(sparse), self.model._stamp()
        out = self.model.embed_now(texts, pooling=self.pooling, normalize=self.normalize, truncate=True, **self.options)
        vectors = np.stack(out["embeddings"]).astype(np.float32) if texts else np.zeros((0, self.dim), np.float32)
        stored = quantize(vectors, self.precision, self.ranges)  # (n, dim), or (n, dim / 8) bytes of sign bits
        return pa.FixedSizeListArray.from_arrays(pa.array(stored.reshape(-1)), stored.shape[1]), out


def sparse_column(vectors: list[dict[str, np.ndarray]]) -> pa.StructArray:
    """SPLADE vectors ({"indices", "values"} each: a text's nonzero weights by token id) as one column of
    ``SPARSE_TYPE``: what Qdrant's and Pinecone's sparse vectors take ({indices, values})."""
    sizes = np.array([len(v["indices"]) for v in vectors], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32))
    indices = np.concatenate([v["indices"] for v in vectors]).astype(np.int32) if vectors else np.zeros(0, np.int32)
    values = np.concatenate([v["values"] for v in vectors]).astype(np.float32) if vectors else np.zeros(0, np.float32)
    return pa.StructArray.from_arrays([pa.ListArray.from_arrays(offsets, pa.array(indices)), pa.ListArray.from_arrays(offsets, pa.array(values))],
                                      fields=list(SPARSE_TYPE))


class ColumnEmbedder(Embedder):
    """Ray Data actor of ``embed_dataset``: every batch comes back whole, with a column of vectors added."""

    def __init__(self, checkpoint: str, version: str | None, text_column: str, output_column: str, *args, **kwargs):
        super().__init__(checkpoint, version, None, text_column, *args, **kwargs)
        self.output_column = output_column

    def __call__(self, batch: pa.Table) -> pa.Table:
        vectors, _ = self._vectors(batch)
        return batch.append_column(self.output_column, vectors)


def embed_dataset(
    ds,
    model: str,
    *,
    text_column: str = "text",
    output_column: str = "embedding",
    pooling: Pooling | None = None,
    normalize: bool | None = None,
    batch_size: int = PASS_ROWS,
    max_batch_tokens: int = PASS_TOKENS,
    actor_batch_size: int = ACTOR_BATCH_ROWS,
    actors: int | None = None,
    cpus_per_actor: float = CPUS_PER_ACTOR,
    num_gpus: float = 0.0,
    dtype: str = "auto",
    cuda_graphs: bool = True,
    language: int | str | None = None,
    dimensions: int | None = None,
    prompt_name: str | None = None,
    prompt: str | None = None,
    precision: str = "float32",
    ranges: Any = None,
):
    """A Ray Dataset's rows with their text embedded: ``ds`` (any ``ray.data.Dataset``, read from
    anywhere Ray Data reads) with ``output_column`` added, (dim,) float32 per row, the vector
    /v1/embeddings answers for that text with the same ``pooling`` and ``normalize`` (texts longer
    than the model reads are cut; None: the model's, as /v1/embeddings' defaults). Lazy, as
    ``map_batches``: nothing runs until the dataset is consumed (``write_parquet``, ``iter_batches``, ``take``...).

        ds = ray.data.read_json("s3://corpus/docs/")
        embed_dataset(ds, "models:/minilm@production", text_column="body").write_parquet("s3://index/v7/")

    What ``ctx embed`` runs, for a pipeline of one's own: the model is resolved here, once, so every
    actor loads the same version (checked on load); a fixed pool of ``actors`` (default: as many as
    the cluster's CPUs hold at ``cpus_per_actor`` each, one CPU left to Ray Data's own tasks), each
    handed ``actor_batch_size`` rows at a time and sorting them by length into passes of at most
    ``batch_size`` rows and ``max_batch_tokens`` padded tokens. ``dimensions``, ``prompt_name``, ``prompt``:
    as /v1/embeddings' (``Embedder``), checked against the model here, in a Ray task, when given.
    ``precision``: the vectors' (``jobs.serving.precision``), int8/uint8 in the levels of ``ranges`` ((2, dim):
    each dimension's minimum and maximum, ``ranges_of`` of a sample's vectors, e.g. ``LocalModel.encode``'s). Ray
    must be running (``ray.init``)."""
    import ray

    from jobs.identity import checkpoint_version
    from jobs.runs import model_checkpoint

    _check_settings(pooling, dtype, batch_size, max_batch_tokens, actor_batch_size, actors, cpus_per_actor, dimensions, prompt_name, prompt,
                    precision)
    if precision.endswith("int8"):
        if ranges is None:
            raise ValueError(f"precision {precision!r} needs ranges: each dimension's minimum and maximum over a sample's "
                             "vectors, (2, dim) (jobs.serving.precision.ranges_of); queries are quantized with the same")
        ranges = np.asarray(ranges, np.float32)
        if ranges.ndim != 2 or ranges.shape[0] != 2:
            raise ValueError(f"ranges of shape {ranges.shape}: give (2, dim), the minima then the maxima")
        ranges = ranges.tolist()
    columns = ds.columns()  # the schema: read from the plan, or from the first block
    if text_column not in columns:
        raise ValueError(f"no column {text_column!r} in the dataset (columns: {', '.join(columns)}); name it with text_column")
    if output_column in columns:
        raise ValueError(f"the dataset already has a column {output_column!r}; name another with output_column")
    checkpoint, _ = model_checkpoint(model)
    pool = actors or pool_size(cpus_per_actor, num_gpus)
    _check_pool(pool, cpus_per_actor)
    version = checkpoint_version(checkpoint)
    options = {"dimensions": dimensions, "prompt_name": prompt_name, "prompt": prompt,
               "precision": precision, "ranges": ranges if precision.endswith("int8") else None}
    if any(v is not None for k, v in options.items() if k != "precision") or precision != "float32":  # the ranges' width too
        _check_on_ray((checkpoint, version, None, text_column, pooling, normalize, batch_size, max_batch_tokens), language, options)
    return ds.map_batches(  # --- Ray seam: an actor pool over the user's dataset ---
        ColumnEmbedder,
        fn_constructor_args=(checkpoint, version, text_column, output_column, pooling, normalize,
                             batch_size, max_batch_tokens, max(1, int(cpus_per_actor)), dtype, cuda_graphs, language),
        fn_constructor_kwargs=options,
        batch_size=actor_batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=pool),
        num_cpus=cpus_per_actor,
        num_gpus=num_gpus,
    )


def _check_settings(pooling: str | None, dtype: str, batch_size: int, max_batch_tokens: int, actor_batch_size: int,
                    actors: int | None, cpus_per_actor: float, dimensions: int | None = None, prompt_name: str | None = None,
                    prompt: str | None = None, precision: str = "float32", calibration_rows: int = CALIBRATION_ROWS) -> None:
    """ValueError naming the first setting of ``reembed`` / ``embed_dataset`` out of its range (the model's
    own limits, its width and its prompts, are ``Embedder.check``'s)."""
    if pooling is not None and pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r}: use one of {', '.join(POOLINGS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    for name, value in (("batch_size", batch_size), ("max_batch_tokens", max_batch_tokens), ("actor_batch_size", actor_batch_size)):
        if value < 1:
            raise ValueError(f"{name} ({value}) must be at least 1")
    if (actors is not None and actors < 1) or cpus_per_actor <= 0:
        raise ValueError(f"actors ({actors}) must be at least 1 and cpus_per_actor ({cpus_per_actor}) above 0")
    if dimensions is not None and dimensions < 1:
        raise ValueError(f"dimensions ({dimensions}) must be at least 1")
    if prompt is not None and prompt_name is not None:
        raise ValueError("prompt and prompt_name: give one of them")
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if calibration_rows < 2:
        raise ValueError(f"calibration_rows ({calibration_rows}) must be at least 2: int8's ranges need two vectors or more")


def _check_on_ray(model_args: tuple, language: int | str | None, options: dict[str, Any],
                  calibration: list[str] | None = None, precision: str = "float32") -> list[list[float]] | None:
    """``Embedder.check`` in a Ray task, on a CPU, before the pool starts: an actor that cannot take the
    options would fail each of its batches, and Ray Data's error on the driver keeps only the traceback's
    text. A ValueError of the model's comes back as itself (one line from ``ctx embed``). With ``calibration``
    texts, also their ranges (``Embedder.calibrate``): the driver loads no model."""
    import ray

    @ray.remote(num_cpus=1)
    def check() -> list[list[float]] | None:
        embedder = Embedder(*model_args, threads=1, language=language, **options)
        embedder.check(precision)
        return None if calibration is None else embedder.calibrate(calibration)

    try:
        return ray.get(check.remote())
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ValueError):
            raise ValueError(str(e.cause)) from None
        raise


def refuse_existing(output: str, store: "storage.Store | str | None" = None) -> None:
    """Raise FileExistsError when ``output`` is a file or a folder holding anything but a run's lock (an empty
    or absent folder is written into). ``store``: the endpoint and retry deadline (or an endpoint URL, with the
    default deadline)."""
    store = store if isinstance(store, storage.Store) else storage.Store(store)
    fs, path = store.filesystem(output)
    info = store.retry(lambda: fs.get_file_info(path), f"stat {output}")
    if info.type != pafs.FileType.File:
        # A prefix with objects under it can read as NotFound on some S3 stores (no folder markers): list it.
        listed = store.retry(lambda: fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)), f"list {output}")
        if not _without_lock(listed):
            return
    raise FileExistsError(
        f"--output {output} already holds embeddings or other files: re-embedding writes a new folder "
        f"beside the old ones and never over them; give a new folder (e.g. one named after the model version), "
        f"or resume (--resume) a run of the same model and settings that stopped there"
    )


def reembed(
    model: str,
    input: str,
    output: str,
    *,
    id_column: str = "id",
    text_column: str = "text",
    pooling: Pooling | None = None,
    normalize: bool | None = None,
    store: storage.Store = storage.Store(),
    batch_size: int = PASS_ROWS,
    max_batch_tokens: int = PASS_TOKENS,
    actor_batch_size: int = ACTOR_BATCH_ROWS,
    actors: int | None = None,
    cpus_per_actor: float = CPUS_PER_ACTOR,
    num_gpus: float = 0.0,
    verbose: bool = False,
    started: float | None = None,
    driver_read_bytes: int = DRIVER_READ_BYTES,
    engine: Engine = "auto",
    dtype: str = "auto",
    cuda_graphs: bool = True,
    language: int | str | None = None,
    dimensions: int | None = None,
    prompt_name: str | None = None,
    prompt: str | None = None,
    resume: bool = False,
    progress: bool = False,
    precision: str = "float32",
    calibration_rows: int = CALIBRATION_ROWS,
) -> dict[str, Any]:
    """Embed every (id, text) row at ``input`` (Parquet, JSON lines or CSV: ``INPUT_FORMATS``) with ``model``
    into new Parquet at ``output``.

    ``model``: a checkpoint, a training run folder (its best or newest complete checkpoint), a Hugging
    Face folder or ``pkg:PACKAGE/PATH``, local or ``s3://``, or a registry version ``models:/NAME@alias``
    / ``models:/NAME/N`` (looked up once, in $MLFLOW_TRACKING_URI's registry) (a model on S3 is read with
    AWS_ENDPOINT_URL, as ``ctx serve`` reads it). ``store``: the endpoint and retry deadline of ``input``
    and ``output`` (``ctx embed --endpoint-url --retry-deadline``); every wait on them is said and bounded.

    ``batch_size`` / ``max_batch_tokens``: rows and padded tokens per forward pass; ``actor_batch_size``:
    rows handed to an actor per call, sorted by length into those passes. ``actors``: a fixed pool of that
    many model actors, each with ``cpus_per_actor`` CPUs (its torch threads) and ``num_gpus``; default as
    many as the cluster's CPUs hold (its GPUs, when ``num_gpus`` is set). Ray is started (``jobs.training.loop.
    init_ray``, quiet unless ``verbose``) only after the input, output and model have been checked.
    An input of at most ``driver_read_bytes`` (its files' sizes) is read here and handed to Ray Data in
    memory (``DRIVER_READ_BYTES``); a larger one streams through Ray Data's read tasks.

    ``engine``: "ray" runs the Ray Data pipeline above; "local" embeds in this process, one model with a
    torch thread per core over the same ``actor_batch_size`` chunks, and writes the Parquet itself (no Ray
    started: its start and shutdown alone take 10 s on 2 cores, ``benchmarks/embed.py --floor``); "auto"
    (the default) is "local" where there is no cluster to use (no Ray running here, no RAY_ADDRESS), the
    input is one the driver reads (at most ``driver_read_bytes``) and no ``actors`` or ``num_gpus`` were
    asked for, else "ray". ``dtype``: the forward passes' ("auto": float16 on a GPU, float32 on the CPU).
    ``cuda_graphs``: on a GPU, each pass of a BERT-family model replayed from a CUDA graph (False: eager).
    ``language``: the language a multilingual XLM reads the texts as (``ctx serve``'s model setting).
    ``dimensions``, ``prompt_name``, ``prompt``: /v1/embeddings' options (``Embedder``); the model is asked
    whether it takes them before a vector is written (in a Ray task, for the Ray engine), so a prompt its
    folder lacks is a ValueError naming its prompts, not a failed pool.

    ``resume``: an ``output`` that holds the vectors of an earlier run that stopped (its ``RUN_FILE`` says the
    same model version and settings) gets the rows whose ids it lacks, in new files beside its own; an
    ``output`` that is absent or empty is a first run. Without it, a folder that holds files is refused.
    ``progress``: the local engine shows rows done, rows/s and time left on stderr (``ctx embed``; the Ray
    engine's progress is Ray Data's own).

    ``precision``: the stored vectors', as sentence-transformers' ``encode(precision=...)`` and
    ``quantize_embeddings`` give them (``jobs.serving.precision``): float32; int8 / uint8, each dimension's
    range cut into 256 levels, the range that of ``calibration_rows`` input rows' vectors (a seeded sample,
    embedded first; kept in ``RUN_FILE`` as "ranges", for a resumed run and for quantizing queries alike);
    binary / ubinary, the sign bits packed 8 a byte.

    A SPLADE model (``EmbeddingReplica.splade``) with ``pooling`` None stores its sparse vectors (``SPARSE_TYPE``:
    its nonzero weights by token id, as /embed_sparse answers them); ``dimensions`` and a ``precision`` other than
    float32 are refused for them.

    Returns {"rows", "dim", "sparse", "model_version", "tokenizer_hash", "checkpoint", "input", "output",
    "registry_version", "engine", "actors", "resumed", "precision", "seconds", "rows_per_s"}, read back from what
    was written (``rows``: all of the output's, ``dim``: a stored vector's components, bytes for binary, None
    for sparse vectors;
    ``resumed``: those an earlier run wrote); ``seconds`` is wall time from
    ``started`` (a ``time.perf_counter()`` value, default this call's start), ``rows_per_s`` this run's rows over it.
    """
    started = time.perf_counter() if started is None else started
    import ray

    from jobs.identity import checkpoint_version  # not jobs.serving.serve: the driver needs neither torch nor Ray Serve
    from jobs.runs import model_checkpoint
    from jobs.session import init_ray

    _check_settings(pooling, dtype, batch_size, max_batch_tokens, actor_batch_size, actors, cpus_per_actor, dimensions, prompt_name, prompt,
                    precision, calibration_rows)
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: use one of {', '.join(ENGINES)}")
    if not resume:
        refuse_existing(output, store)  # before any work: old vectors stay as they are
    in_fs, in_path = store.filesystem(input)
    out_fs, out_path = store.filesystem(output)
    files, fmt, rows_in, size = _input_rows(input, in_fs, in_path, id_column, text_column, store)  # no Ray yet
    checkpoint, registered = model_checkpoint(model)  # models:/NAME@alias -> the version's checkpoint, once
    version = checkpoint_version(checkpoint)  # replicas of the same version check it on load
    options = {"dimensions": dimensions, "prompt_name": prompt_name, "prompt": prompt}  # Embedder's, /v1/embeddings' own
    run = {"model_version": version, "id_column": id_column, "text_column": text_column, "pooling": pooling, "normalize": normalize,
           **options, "language": language, "dtype": dtype, "precision": precision}
    # One run writes into a folder at a time (jobs.runlock: an exclusive create, a heartbeat, a stale lock
    # taken over): two runs into one new folder, or a --resume of a run still going, would write rows twice.
    with RunLock(output, store, command="ctx embed", name=RUN_LOCK, folder="output folder", clash=EMBED_CLASH):
        if not resume:
            refuse_existing(output, store)  # again, holding the lock: a run may have written there since the check above
        done, earlier = _embedded_ids(output, out_fs, out_path, run, store) if resume else (None, None)  # None: nothing there yet
        calibrate = False  # int8/uint8's ranges from a sample of the input, unless an earlier run's are there
        if precision.endswith("int8"):
            if earlier is not None and earlier.get("ranges"):  # a resumed run keeps the levels (whatever calibration_rows says now)
                run.update(calibration_rows=earlier.get("calibration_rows"), ranges=earlier["ranges"])
            elif rows_in < 2:
                raise ValueError(f"--input {input}: precision {precision!r} takes each dimension's range from the input's vectors, "
                                 "and one row has none; embed two rows or more, or store float32")
            else:
                run["calibration_rows"] = calibration_rows
                calibrate = True

        if engine == "auto":
            no_cluster = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
            engine = "local" if no_cluster and size <= driver_read_bytes and actors is None and num_gpus == 0 else "ray"
        chunks = whole = None  # the input in actor_batch_size rows, and whole, where this process reads it (DRIVER_READ_BYTES)
        if engine == "local" or size <= driver_read_bytes:
            whole = store.retry(lambda: _input_dataset(files, in_fs, fmt).to_table(columns=[id_column, text_column]),
                                f"read {input}")
            table = _without(whole, done, id_column)
            chunks = [table.slice(i, actor_batch_size) for i in range(0, table.num_rows, actor_batch_size)]
        # the texts whose vectors' ranges int8/uint8's levels cut
        calibration = _calibration_texts(input, files, fmt, in_fs, rows_in, calibration_rows, text_column, store, whole) if calibrate else None
        model_args = (checkpoint, version, id_column, text_column, pooling, normalize, batch_size, max_batch_tokens)
        resumed = 0 if done is None else len(done)
        if engine == "local":
            embedder = Embedder(*model_args, threads=os.cpu_count() or 1, dtype=dtype, cuda_graphs=cuda_graphs, language=language, **options)
            embedder.check(precision)  # before a file is written
            if calibration is not None:
                run["ranges"] = embedder.calibrate(calibration)
            embedder.store_as(precision, run.get("ranges"))
            if done is None:
                _write_run_file(out_fs, out_path, run, output, store)
            parts = map(embedder, chunks)
            _write_local(out_fs, out_path, _shown(parts, rows_in - resumed) if progress else parts, output, store)
            pool = 0
        elif resumed == rows_in:
            pool = 0  # an earlier run wrote every row: nothing to start
        else:
            # --- Ray seam: Ray Data read -> actor pool -> write ---
            init_ray(verbose, num_cpus=(os.cpu_count() or 1) + IO_CPUS)  # a no-op where Ray is up (tests, the scheduler's actor)
            pool = actors or pool_size(cpus_per_actor, num_gpus)
            _check_pool(pool, cpus_per_actor)
            if any(v is not None for v in options.values()) or calibration is not None or precision != "float32":
                ranges = _check_on_ray(model_args, language, options, calibration, precision)
                if calibration is not None:
                    run["ranges"] = ranges
            if chunks is not None:  # small: read here, no Ray Data read tasks
                ds = ray.data.from_arrow(chunks)
            else:
                read = getattr(ray.data, RAY_READERS[fmt])
                # the files chosen above, whatever their ending (the readers' default file_extensions leave out some of COMPRESSIONS)
                ds = read(files, filesystem=in_fs, file_extensions=None).select_columns([id_column, text_column])  # keep only these two
                if done is not None:  # the ids an earlier run wrote go to the read tasks through the object store
                    ds = ds.map_batches(_without, fn_kwargs={"done": done, "id_column": id_column}, batch_format="pyarrow")
                # One file can be one block, and a block goes to one actor whole: cut blocks to a batch each so
                # every actor of the pool gets work (streaming: no barrier before the model starts).
                ds = ds.repartition(target_num_rows_per_block=actor_batch_size)
            threads = max(1, int(cpus_per_actor))  # torch's threads: the CPUs Ray reserves for the actor
            vectors = ds.map_batches(
                Embedder,
                fn_constructor_args=(*model_args, threads, dtype, cuda_graphs, language),
                fn_constructor_kwargs={**options, "precision": precision, "ranges": run.get("ranges")},
                batch_size=actor_batch_size,
                batch_format="pyarrow",
                compute=ray.data.ActorPoolStrategy(size=pool),
                num_cpus=cpus_per_actor,
                num_gpus=num_gpus,
            )
            if done is None:
                _write_run_file(out_fs, out_path, run, output, store)
            vectors.write_parquet(out_path, filesystem=out_fs, mode=ray.data.SaveMode.APPEND)  # beside RUN_FILE

        summary = _summary(out_fs, out_path, rows_in, checkpoint=checkpoint, input=input, output=output)
        seconds = time.perf_counter() - started
        return {**summary, "registry_version": registered.ref if registered else None, "engine": engine, "actors": pool,
                "resumed": resumed, "precision": precision, "seconds": round(seconds, 2), "rows_per_s": round((rows_in - resumed) / seconds, 1)}


def _shown(parts: Iterator[pa.Table], total: int) -> Iterator[pa.Table]:
    """``parts`` as they come, with the rows embedded so far, their rate and the time left on stderr: a bar
    redrawn in place on a terminal, else a line every ``PROGRESS_EVERY_S`` and one at the end."""
    from jobs.session import clock

    terminal, start, done, shown = sys.stderr.isatty(), time.perf_counter(), 0, 0.0
    for part in parts:
        done += part.num_rows
        now = time.perf_counter() - start
        if terminal or now - shown >= PROGRESS_EVERY_S or done == total:
            rate = done / max(now, 1e-9)
            line = f"embed: {done:,}/{total:,} rows ({100 * done / max(total, 1):.0f}%) | {rate:,.0f} rows/s | ETA {clock((total - done) / max(rate, 1e-9))}"
            print(f"\r{line}" if terminal else line, end="\n" if not terminal or done == total else "", file=sys.stderr, flush=True)
            shown = now
        yield part


def _write_run_file(fs: pafs.FileSystem, path: str, run: dict[str, Any], output: str, store: storage.Store) -> None:
    """``RUN_FILE`` in a new or empty output folder, before its first vector."""
    import json

    body = json.dumps(run, indent=2).encode()
    store.retry(lambda: fs.create_dir(path, recursive=True), f"create {output}")

    def write() -> None:
        with fs.open_output_stream(f"{path.rstrip('/')}/{RUN_FILE}") as f:
            f.write(body)

    store.retry(write, f"write {storage.join(output, RUN_FILE)}")


def _embedded_ids(output: str, fs: pafs.FileSystem, path: str, run: dict[str, Any],
                  store: storage.Store) -> tuple[pa.Array | None, dict[str, Any] | None]:
    """The ids an earlier run of the same model version and settings (``run``) wrote to ``output``, for
    ``reembed(resume=True)``, and that run's ``RUN_FILE``; (None, None) when ``output`` is absent or empty.
    FileExistsError for a folder whose
    files another kind of run wrote (no ``RUN_FILE``, or one that differs). A vector file cut short by the stop
    is deleted (``_without_cut_short``): its rows are embedded again."""
    import json

    import pyarrow.dataset as pads

    if store.retry(lambda: fs.get_file_info(path), f"stat {output}").type == pafs.FileType.File:
        raise FileExistsError(f"--output {output} is a file: the vectors go to a folder")
    listed = store.retry(lambda: fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)), f"list {output}")
    if not [i for i in _without_lock(listed) if i.type == pafs.FileType.File]:
        return None, None
    try:
        with store.retry(lambda: fs.open_input_stream(f"{path.rstrip('/')}/{RUN_FILE}"), f"read {storage.join(output, RUN_FILE)}") as f:
            earlier = json.loads(f.read())
    except FileNotFoundError:
        raise FileExistsError(f"--output {output} holds files but no {RUN_FILE}: not the output of a ctx embed run this version "
                              "can resume; give a new folder") from None
    earlier = {**RUN_DEFAULTS, **earlier}
    changed = {k: (earlier.get(k), v) for k, v in run.items() if earlier.get(k) != v}
    if changed:
        said = "; ".join(f"{k}: {a!r} then, {b!r} now" for k, (a, b) in changed.items())
        raise FileExistsError(f"--output {output} holds vectors made otherwise ({said}); resuming would mix them: "
                              "run with the same model and settings, or give a new folder")
    vectors = [i.path for i in listed if i.type == pafs.FileType.File and i.path.endswith(".parquet")
               and not i.path[len(path.rstrip("/")) + 1:].startswith((".", "_"))]
    if not vectors:  # stopped before its first file: RUN_FILE alone
        return pa.array([], pa.int64()), earlier

    def read_ids(files: list[str]) -> pa.Array:
        if not files:
            return pa.array([], pa.int64())
        table = store.retry(lambda: pads.dataset(files, filesystem=fs, format="parquet").to_table(columns=["id"]), f"read {output}")
        return table.column("id").combine_chunks()

    try:
        return read_ids(vectors), earlier
    except pa.ArrowInvalid:
        try:
            return read_ids(_without_cut_short(vectors, fs, output, store)), earlier
        except pa.ArrowInvalid as e:
            raise FileExistsError(f"--output {output}: a file of the earlier run cannot be read ({e}); give a new folder") from None


def _without_lock(listed: list[pafs.FileInfo]) -> list[pafs.FileInfo]:
    """A folder's listing less the ``RUN_LOCK`` of the run writing there and that lock's temporary files."""
    return [i for i in listed if i.base_name != RUN_LOCK and not i.base_name.startswith(f".{RUN_LOCK}.")]


def _without_cut_short(vectors: list[str], fs: pafs.FileSystem, output: str, store: storage.Store) -> list[str]:
    """``vectors`` less the files a run stopped while writing (the Ray engine writes in place: on a local disk a
    stop mid-file leaves one without its Parquet footer, so none of its rows can be read). Each is deleted, with a
    line on stderr: its rows are not among the ids done, so the resumed run embeds them again."""
    import pyarrow.parquet as pq

    kept = []
    for v in vectors:
        name = v.rsplit("/", 1)[-1]
        try:
            store.retry(lambda: pq.read_metadata(v, filesystem=fs), f"read {storage.join(output, name)}")
        except pa.ArrowInvalid as e:  # no footer, or a cut one
            store.retry(lambda: fs.delete_file(v), f"delete {storage.join(output, name)}")
            print(f"ctx embed: deleted {storage.join(output, name)}, cut short when the earlier run stopped ({e}); "
                  "its rows are embedded again", file=sys.stderr, flush=True)
            continue
        kept.append(v)
    return kept


def _calibration_texts(input: str, files: list[str], fmt: str, fs: pafs.FileSystem, rows: int, n: int, text_column: str,
                       store: storage.Store, whole: pa.Table | None = None) -> list[str]:
    """``n`` texts of the input (all of them when it has fewer), a sample seeded by nothing but ``rows``, in
    input order: the same input gives the same calibration, whichever engine runs. ``whole``: the input, where
    the driver has read it already (not read again); else the sampled rows are read from ``files``."""
    picked = np.sort(np.random.default_rng(rows).choice(rows, size=min(n, rows), replace=False))
    if whole is not None:
        return whole.column(text_column).take(picked).to_pylist()
    table = store.retry(lambda: _input_dataset(files, fs, fmt).take(picked, columns=[text_column]),
                        f"read {input}")
    return table.column(text_column).to_pylist()


def _without(table: pa.Table, done: pa.Array | None, id_column: str) -> pa.Table:
    """``table``'s rows whose id is not in ``done`` (all of them for None)."""
    import pyarrow.compute as pc

    if done is None or len(done) == 0:
        return table
    return table.filter(pc.invert(pc.is_in(table.column(id_column), value_set=done.cast(table.schema.field(id_column).type))))


def _write_local(fs: pafs.FileSystem, path: str, parts, output: str, store: storage.Store) -> None:
    """The local engine's output: Parquet files of at least LOCAL_FILE_ROWS rows each (the last one
    fewer), numbered after those an earlier run of a resumed output wrote. On a local disk each file is
    written under a hidden name and then renamed, so a run stopped mid-file leaves no file cut short for
    a resumed run to read (an object store's upload appears whole or not at all)."""
    import re

    import pyarrow.parquet as pq

    store.retry(lambda: fs.create_dir(path, recursive=True), f"create {output}")
    listed = store.retry(lambda: fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)), f"list {output}")
    numbers = [int(m.group(1)) for i in listed if (m := re.fullmatch(r"embeddings-(\d+)\.parquet", i.base_name))]
    pending: list[pa.Table] = []
    folder = path.rstrip("/")
    staged = isinstance(fs, pafs.LocalFileSystem)

    def flush(k: int) -> None:
        table = pa.concat_tables(pending)
        name = f"embeddings-{k:05d}.parquet"
        target = f"{folder}/.{name}.partial" if staged else f"{folder}/{name}"
        store.retry(lambda: pq.write_table(table, target, filesystem=fs), f"write {storage.join(output, name)}")
        if staged:
            fs.move(target, f"{folder}/{name}")
        pending.clear()

    k, rows = max(numbers, default=-1) + 1, 0
    for part in parts:
        pending.append(part)
        rows += part.num_rows
        if rows >= LOCAL_FILE_ROWS:
            flush(k)
            k, rows = k + 1, 0
    if pending:
        flush(k)


def pool_size(cpus_per_actor: float, num_gpus: float = 0.0) -> int:
    """Actors the cluster's CPUs hold beside IO_CPUS for Ray Data's own tasks (and its GPUs, when each
    actor takes some); at least 1."""
    import ray

    resources = ray.cluster_resources()
    n = int((resources.get("CPU", 0) - IO_CPUS) // cpus_per_actor)
    if num_gpus > 0:
        n = min(n, int(resources.get("GPU", 0) // num_gpus))
    return max(1, n)


def _check_pool(actors: int, cpus_per_actor: float) -> None:
    import ray

    cpus = ray.cluster_resources().get("CPU", 0)
    if actors * cpus_per_actor > cpus - IO_CPUS:
        raise ValueError(
            f"{actors} actors x {cpus_per_actor:g} CPUs leave less than {IO_CPUS} of the cluster's {cpus:g} CPUs to Ray Data's "
            f"read and write tasks, which would wait for them forever: ask for fewer --actors or --cpus-per-actor"
        )


def _input_format(input: str, name: str) -> str | None:
    """``INPUT_FORMATS``' format of a file name (any case), also with a ``COMPRESSIONS`` ending after a JSON
    lines or CSV one (``docs.jsonl.gz``; lower case, as the readers match it); None for a name that ends otherwise."""
    codec = next((c for c in COMPRESSIONS if name.endswith(c)), None)
    if codec:
        fmt = _input_format(input, name[: -len(codec)])
        return fmt if fmt in ("json", "csv") else None
    return next((fmt for suffix, fmt in INPUT_FORMATS.items() if name.lower().endswith(suffix)), None)


def _input_rows(input: str, fs: pafs.FileSystem, path: str, id_column: str, text_column: str,
                store: storage.Store) -> tuple[list[str], str, int, int]:
    """The input files at ``path``, their format (``INPUT_FORMATS``), their row count (a Parquet file's from
    its footer; JSON lines and CSV are read for it) and their bytes. The files are ``path`` itself (read as
    Parquet unless its name says JSON lines or CSV), or every file of one format under the folder whose
    path below it starts with neither "." nor "_", as Ray Data's readers skip those."""
    info = store.retry(lambda: fs.get_file_info(path), f"stat {input}")
    if info.type == pafs.FileType.File:
        listed = [info]
    else:
        listed = store.retry(lambda: fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)), f"list {input}")
        base = path.rstrip("/") + "/"
        listed = [i for i in listed if i.type == pafs.FileType.File and not i.path[len(base):].startswith((".", "_"))]
    unread = next((i.base_name for i in listed if i.path.endswith(UNREAD_COMPRESSIONS)), None)
    if unread:
        fix = "rename it .zst" if unread.endswith(".zstd") else "decompress it, or recompress it with gzip or zstd (.zst)"
        raise ValueError(f"--input {input}: {unread} is compressed with a codec read here only as "
                         f"{'/'.join(COMPRESSIONS)}: {fix}")
    if info.type == pafs.FileType.File:
        files, size, fmt = [path], info.size, _input_format(input, path) or "parquet"
    else:
        chosen = [i for i in listed if _input_format(input, i.path)]
        formats = sorted({_input_format(input, i.path) for i in chosen})
        if not formats:
            raise ValueError(f"--input {input}: no Parquet, JSON lines or CSV file ({', '.join('*' + s for s in INPUT_FORMATS)}, "
                             f"JSON lines and CSV also as {'/'.join(COMPRESSIONS)}) there")
        if len(formats) > 1:
            raise ValueError(f"--input {input}: the folder mixes {' and '.join(formats)} files; give a folder of one kind")
        files, size, fmt = sorted(i.path for i in chosen), sum(i.size or 0 for i in chosen), formats[0]
    try:
        dataset = _input_dataset(files, fs, fmt)
        for col in (id_column, text_column):
            if col not in dataset.schema.names:
                raise ValueError(f"--input {input}: no column {col!r} (columns: {', '.join(dataset.schema.names)}); name it with --id-column / --text-column")
        rows = store.retry(dataset.count_rows, f"count rows of {input}")
        if rows == 0:
            raise ValueError(f"--input {input}: no rows to embed")
        _check_texts(input, dataset, id_column, text_column, store)
    except _Undecodable as e:
        raise ValueError(f"--input {input}: {e}") from None
    except pa.ArrowInvalid as e:  # a file that is not what its name says (a JSON array, not JSON lines): the reader's words
        kind = "JSON lines (one object a line)" if fmt == "json" else fmt
        raise ValueError(f"--input {input}: not readable as {kind} ({e})") from None
    return files, fmt, rows, size or 0


def _input_dataset(files: list[str], fs: pafs.FileSystem, fmt: str):
    """What the driver reads ``files`` through: a ``pyarrow.dataset`` of them, or a ``_StreamedInput`` where
    one's ending is one pyarrow.dataset does not undo (``STREAMED_COMPRESSIONS``)."""
    import pyarrow.dataset as pads

    if any(f.lower().endswith(STREAMED_COMPRESSIONS) for f in files):
        return _StreamedInput(files, fs, fmt)
    return pads.dataset(files, filesystem=fs, format=fmt)


class _StreamedInput:
    """JSON lines or CSV files read one after another as record batches, each file decompressed by its name's
    ending (pyarrow's ``Codec.detect``: .gz, .bz2, .lz4, .zst), with the few calls of ``pyarrow.dataset.Dataset``
    the driver makes (``schema``, ``count_rows``, ``head``, ``take``, ``to_table``). Each call reads the files
    again from the start and holds one batch at a time, but for the table it returns."""

    def __init__(self, files: list[str], fs: pafs.FileSystem, fmt: str):
        self.files, self.fs, self.fmt = files, fs, fmt

    def _readers(self) -> Iterator[pa.RecordBatchReader]:
        import pyarrow.csv as pacsv
        import pyarrow.json as pajson

        for path in self.files:
            with self.fs.open_input_stream(path, compression="detect") as stream, _undecodable(path):
                yield pajson.open_json(stream) if self.fmt == "json" else pacsv.open_csv(stream)

    def _batches(self, columns: list[str] | None = None, filter=None) -> Iterator[pa.Table]:
        import pyarrow.dataset as pads

        for path, reader in zip(self.files, self._readers()):
            with _undecodable(path):
                for batch in reader:
                    yield pads.dataset(pa.Table.from_batches([batch])).to_table(columns=columns, filter=filter)

    @property
    def schema(self) -> pa.Schema:
        return next(self._readers()).schema

    def count_rows(self, filter=None) -> int:
        return sum(t.num_rows for t in self._batches([], filter))

    def head(self, n: int, columns: list[str], filter=None) -> pa.Table:
        kept, rows = [], 0
        for t in self._batches(columns, filter):
            kept.append(t.slice(0, n - rows))
            rows += kept[-1].num_rows
            if rows == n:
                break
        return pa.concat_tables(kept, promote_options="permissive")

    def take(self, indices: np.ndarray, columns: list[str]) -> pa.Table:
        """The rows at ``indices`` (sorted, as ``_calibration_texts`` picks them)."""
        kept, start = [], 0
        for t in self._batches(columns):
            inside = indices[(indices >= start) & (indices < start + t.num_rows)]
            kept.append(t.take(pa.array(inside - start)))
            start += t.num_rows
        return pa.concat_tables(kept, promote_options="permissive")

    def to_table(self, columns: list[str]) -> pa.Table:
        return pa.concat_tables(list(self._batches(columns)), promote_options="permissive")


class _Undecodable(ValueError):
    """An input file Arrow's decoder fails on; the message names the file."""


@contextlib.contextmanager
def _undecodable(path: str) -> Iterator[None]:
    """Arrow's decoder failing on ``path`` (an OSError "... decompress failed") as ``_Undecodable``: a damaged
    file, or a zstd frame written with ``zstd --long`` (a window over 128 MiB, which Arrow refuses)."""
    try:
        yield
    except OSError as e:
        if "decompress" not in str(e).lower():
            raise
        raise _Undecodable(f"{path.rsplit('/', 1)[-1]} cannot be decompressed ({e}): a damaged file, or one written with "
                           "zstd --long, whose window Arrow's reader refuses; recompress it without --long") from None


def _check_texts(input: str, dataset, id_column: str, text_column: str, store: storage.Store) -> None:
    """ValueError for a text column that is not text, or that has nulls, before a vector is written:
    found mid-run, such a row failed the run with part of the output written (a folder the next run is
    refused). Counting the nulls reads the footers' statistics only, where they say a row group has none."""
    import pyarrow.compute as pc

    kind = dataset.schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise ValueError(f"--input {input}: column {text_column!r} holds {kind}, not text; name the text column with --text-column")
    missing = pc.field(text_column).is_null()
    empty = store.retry(lambda: dataset.count_rows(filter=missing), f"count the rows of {input} without text")
    if empty:
        first = store.retry(lambda: dataset.head(1, columns=[id_column], filter=missing), f"read {input}").column(0)[0].as_py()
        raise ValueError(f"--input {input}: {empty} row(s) have no text (null) in column {text_column!r}, the first with "
                         f"{id_column}={first!r}; drop or fill them, nothing was embedded")


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
    kind = pads.dataset(path, filesystem=fs, format="parquet").schema.field("embedding").type
    sparse = pa.types.is_struct(kind)  # a SPLADE model's (SPARSE_TYPE): no fixed width
    return {"rows": rows_in, "dim": None if sparse else kind.list_size, "sparse": sparse, "model_version": versions[0],
            "tokenizer_hash": hashes[0], **where}
