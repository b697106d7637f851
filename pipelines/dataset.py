"""The Ray Data stream that feeds pretraining, for every objective of the model zoo.

::

    work units {shard, shard_key, epoch}      one row per (epoch, shard), shard order keyed by (seed, epoch)
      -> map_batches(TokenizePack)             actor pool, stage 1: read the shard, tokenize (Rust batch
                                               encoder), build the objective's rows (OBJECTIVES[...].rows)
      -> map_batches(transform_rows)           stateless tasks, stage 2: the objective's transform, keyed
                                               by (seed, epoch, sample_id)
      -> Ray Train: get_dataset_shard("train")

Stage 1 builds one of five kinds of rows:

* ``packed``: RoBERTa FULL-SENTENCES rows ``[CLS] ... [SEP]`` (``pipelines.packing``): whole
  sentences up to ``seq_len``, [SEP] between documents, right-padded;
  ``sample_id = shard_key << 32 | index of the row in the shard``;
* ``nsp-pairs`` / ``sop-pairs``: BERT / ALBERT sentence pairs (``pipelines.pairs``). ``sample_id`` as above;
* ``translations``: XLM's translation pairs ``[CLS] a [SEP] [CLS] b [SEP]``, one per record of a
  parallel JSONL shard, each half with its language and positions from 0 (``pipelines.languages``);
  ``sample_id`` as above. XLM's MLM + TLM streams both: its packed rows come from the languages'
  shards and its translation rows from the parallel shards among them (``PARALLEL_SHARD``), every
  row then with ``position_ids`` so the two kinds share their columns;
* ``stream``: stream-ordered batches (``pipelines.streams``) for models with memory: row r of a
  batch continues row r of the previous batch of its *block*. Documents are joined by [SEP].

For packed rows and pairs a document's sentences are its lines: text shards already hold one
sentence per line (documents are separated by blank lines), JSON and Parquet documents are split
on newlines.

Stream-ordered batches under Ray Data. Ray re-batches rows and splits them between workers as it
likes, which would tear row r of one batch away from row r of the next. So a Ray Data row holds a
whole per-worker batch: every column is (B_worker, ...) in one row, B_worker =
``StreamSpec.stream_rows`` = ``train.micro_batch_size`` (fixed whatever the worker count), plus two bookkeeping columns:
``_stream_block`` (a stable id of the block of consecutive batches: a hash of shard key, epoch and
block index) and ``_stream_index`` (the batch's position in its block). One Ray block holds one
stream block, so its batches go to one worker in order; the training loop iterates with
``batch_size=1`` and sets ``reset_memory`` itself (``jobs.training.train.stream_resets``): 1 unless this
batch is the successor of the previous batch *that worker* processed, whatever order Ray delivers
blocks in. ``local_batches`` yields the same batches in order, with the batcher's ``reset_memory``.

Batch columns equal the model's ``forward`` keywords; ``sample_id``, ``epoch`` and ``_``-prefixed
columns are bookkeeping (``doc_start`` of the stream batcher travels as ``_doc_start``).

A shard is the unit of work and ``sample_id`` names a sample by (shard, position in the shard), so
ids and every random choice keyed by them do not depend on how Ray splits or orders the work. The
same functions run without Ray (``local_batches``) for evaluation and tests.
"""

from __future__ import annotations

import posixpath
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Iterator

import numpy as np

from pipelines import storage
from pipelines.char_ids import build_char_table
from pipelines.masking import MlmConfig, VocabInfo
from pipelines.objectives import OBJECTIVES, Objective, RowKind, TransformContext, objective  # noqa: F401 (re-exported)
from pipelines.packing import Packer
from pipelines.pairs import build_nsp_pairs, build_sop_pairs
from pipelines.permutation import PlmConfig
from pipelines.position import DataPosition, load_position
from pipelines.rng import keyed_uniform, mix64, stable_hash64
from pipelines.datareport import write_shard_report
from pipelines.languages import kept_rows, tlm_rows
from pipelines.sources import Format, ReadStats, iter_documents, iter_translations
from pipelines.spans import NgramConfig, SpanConfig
from pipelines.streams import StreamBatcher
from pipelines.tokenizers import ROLES, Tokenizer, load_tokenizer

# Ray resources of the data stages: fractional so that, on a small machine, tokenization and
# masking share cores with the training workers instead of waiting for a whole free CPU.
TOKENIZE_ACTOR_CPUS = 0.5
TRANSFORM_TASK_CPUS = 0.25
PACKED_ROWS_PER_BATCH = 512

STREAM_KEYS = ("_stream_block", "_stream_index")  # bookkeeping of stream-ordered batches
PARALLEL_SHARD = -1  # StreamSpec.shard_languages of a parallel shard among XLM's languages (MLM + TLM)


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
    store: storage.Store = storage.Store()  # the recipe's data.endpoint_url and data.retry_deadline_s
    objective: str = "mlm"  # a key of OBJECTIVES
    mlm: MlmConfig = field(default_factory=MlmConfig)  # "mlm", "nsp"
    span: SpanConfig = field(default_factory=SpanConfig)  # "span"
    ngram: NgramConfig = field(default_factory=NgramConfig)  # "sop"
    plm: PlmConfig = field(default_factory=PlmConfig)  # "plm"
    short_seq_prob: float = 0.1  # "nsp", "sop": share of pairs cut shorter than seq_len (BERT: 0.1)
    plm_stream: bool = True  # "plm": stream-ordered batches (XLNet's memory); False: packed rows
    stream_rows: int = 0  # stream objectives: rows per worker micro-batch (train.micro_batch_size)
    stream_block_batches: int | None = 32  # stream objectives: batches per block (None: a shard)
    char_max_chars: int = 50  # "bilm": characters per token (ElmoConfig.max_chars)
    tokenize_actors: int = 1
    strict: bool = False  # fail at the first bad record instead of counting it (pipelines.sources)
    max_record_chars: int = 1_000_000  # longer records are rejected as bad data
    # XLM (pipelines.languages): the language id of each shard, in the order of ``shards`` (its
    # packed rows carry it as token_type_ids), and the share of each language's rows an epoch
    # keeps (alpha sampling). Empty: one language, every row kept. ``PARALLEL_SHARD``: a shard of
    # translation records, whose rows are the translation LM's (XLM's MLM + TLM), every row kept.
    shard_languages: tuple[int, ...] = ()
    language_keep: tuple[float, ...] = ()
    language_names: tuple[str, ...] = ()  # "tlm" and MLM + TLM: data.languages, the field names of parallel records
    # The run this stream feeds. Its latest committed checkpoint holds the data position
    # (pipelines.position): samples listed there are dropped when the stream starts. Each shard's
    # read/used/rejected counts go to <run_uri>/data_reports/ (pipelines.datareport).
    # None: a stream from scratch, no reports.
    run_uri: str | None = None


# ---------------------------------------------------------------------------------------------
# The objectives (pipelines.objectives): stage 1 rows and stage 2 transform of each.


def shard_language(spec: StreamSpec, uri: str) -> int | None:
    """The language id of shard ``uri`` (``StreamSpec.shard_languages``), None without languages."""
    if not spec.shard_languages:
        return None
    return spec.shard_languages[spec.shards.index(uri)]


def mixes_translations(spec: StreamSpec) -> bool:
    """XLM's MLM + TLM: some shards are parallel ones, whose translation rows join the packed rows."""
    return PARALLEL_SHARD in spec.shard_languages


def row_kind(spec: StreamSpec) -> RowKind:
    """The rows stage 1 builds for ``spec``: the objective's, or packed rows for XLNet without memory."""
    kind = objective(spec.objective).rows
    if spec.objective == "plm" and not spec.plm_stream:
        return "packed"
    return kind


def char_table(tok: Tokenizer, max_chars: int) -> np.ndarray:
    """ELMo's characters of every token id, built as serving builds them (``jobs.serving.serve``)."""
    tokens = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    return build_char_table(tokens, max_chars, {role: getattr(tok, f"{role}_id") for role in ROLES})


def vocab_info(tok: Tokenizer, objective_name: str) -> VocabInfo:
    """The special ids of ``objective_name``'s rows. [CLS], [SEP] and [PAD] are ``tok.row_id``: a
    GPT-2 tokenizer's <|endoftext|> stands in for them, so its rows are ``eot doc eot doc ...`` as
    GPT-2 was trained. An objective that writes [MASK] needs the tokenizer's own (else
    ``MissingSpecialToken`` naming the objective); for the others the slot holds [SEP]'s id, which
    they never place and which is special anyway."""
    why = f"data.objective {objective_name!r} needs it"
    sep = tok.row_id("sep", why)
    if objective(objective_name).places_mask:
        mask = tok.require("mask", f"data.objective {objective_name!r} writes it into its inputs (a tokenizer without one suits clm, clm-stream or plm)")
    else:
        mask = tok.special_id("mask")
        mask = sep if mask is None else mask
    return VocabInfo(
        vocab_size=int(tok.vocab_size),
        pad_id=tok.row_id("pad", why),
        mask_id=int(mask),
        cls_id=tok.row_id("cls", why),
        sep_id=sep,
        special_ids=tuple(int(t) for t in tok.special_ids),
        word_start=tok.word_start,
    )


def transform_context(spec: StreamSpec, tok: Tokenizer) -> TransformContext:
    return TransformContext(
        seed=spec.seed,
        mlm=spec.mlm,
        span=spec.span,
        ngram=spec.ngram,
        plm=spec.plm,
        vocab=vocab_info(tok, spec.objective),
        char_table=char_table(tok, spec.char_max_chars) if objective(spec.objective).uses_chars else None,
        languages=bool(spec.shard_languages),
    )


def apply_objective(batch: dict[str, np.ndarray], ctx: TransformContext, name: str) -> dict[str, np.ndarray]:
    """Stage 2 on plain rows (B, ...): the objective's transform."""
    return objective(name).transform(batch, ctx)


def transform_rows(batch: dict[str, np.ndarray], ctx: TransformContext, name: str) -> dict[str, np.ndarray]:
    """Stage 2 on a Ray Data batch. Stream rows hold a whole batch each, so every column is
    (n, B, ...): they are flattened to (n * B, ...) rows for the transform (which is per row) and
    folded back."""
    if "_stream_block" not in batch or np.ndim(batch["_stream_block"]) < 2:
        return apply_objective(batch, ctx, name)
    n, b = batch["_stream_block"].shape  # (n, B)
    flat = {k: v.reshape(n * b, *v.shape[2:]) for k, v in batch.items()}
    out = apply_objective(flat, ctx, name)
    return {k: v.reshape(n, b, *v.shape[1:]) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# Work units.


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
# Stage 1: one shard -> rows (runs in a Ray Data actor; stateful only in the tokenizer).


# A Hugging Face model folder is its tokenizer's folder too: what tokenizer_files leaves behind
# (the same files ctxmodels.hf.tokenizer_files leaves out of a checkpoint's tokenizer/).
NOT_TOKENIZER_FILES = frozenset({"config.json", "MANIFEST.json", "trainer_state.json", "generation_config.json"})
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx"})


def tokenizer_files(local_dir: str | Path) -> dict[str, bytes]:
    """A tokenizer folder's files as bytes, so actors on any node can rebuild it without shared disk.

    ``local_dir`` is a tokenizer folder, a checkpoint (its ``tokenizer/``) or a Hugging Face model
    folder: only the folder's own files travel, without model weights and configs (MiniLM's folder
    is 88 MB, its tokenizer's files 0.8 MB; every tokenizer actor and training worker gets a copy).
    """
    root = Path(local_dir)
    if (root / "tokenizer").is_dir():
        root = root / "tokenizer"
    return {
        p.name: p.read_bytes() for p in sorted(root.iterdir())
        if p.is_file() and p.name not in NOT_TOKENIZER_FILES and p.suffix not in WEIGHT_SUFFIXES
    }


def tokenizer_dir_from_files(files: dict[str, bytes], root: str | Path) -> Path:
    """``tokenizer_files`` written back to the local folder ``root`` (the caller's temporary folder,
    which it removes: every worker and actor does this at every start)."""
    root = Path(root)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def tokenizer_from_files(files: dict[str, bytes]) -> Tokenizer:
    """The tokenizer of ``tokenizer_files``, loaded into memory from a folder removed right after."""
    with tempfile.TemporaryDirectory(prefix="ctx-tokenizer-") as d:
        return load_tokenizer(tokenizer_dir_from_files(files, d))


def _documents(uri: str, spec: StreamSpec, stats: ReadStats | None) -> Iterator[list[str]]:
    return iter_documents(
        uri, spec.fmt, spec.text_field, store=spec.store,
        stats=stats, strict=spec.strict, max_record_chars=spec.max_record_chars,
    )


def _sentence_ids(tok: Tokenizer, docs: list[str]) -> list[list[np.ndarray]]:
    """Token ids of each document's sentences (its lines, module docstring), in one native batch call."""
    sentences = [doc.split("\n") for doc in docs]
    ids = tok.encode_batch([s for sents in sentences for s in sents])
    bounds = np.cumsum([0] + [len(sents) for sents in sentences])  # (D+1,)
    return [ids[bounds[d] : bounds[d + 1]] for d in range(len(sentences))]


def shard_sample_ids(key: int, start: int, n: int) -> np.ndarray:
    """int64 (n,): ids of a shard's samples ``start .. start + n - 1`` (``shard_key << 32 | index``)."""
    return (np.int64(key) << np.int64(32)) | (start + np.arange(n, dtype=np.int64))


def pack_shard(tok: Tokenizer, uri: str, key: int, epoch: int, spec: StreamSpec, stats: ReadStats | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Packed rows of one shard, in shard order, with their sample ids. A shard of a language
    (XLM) gives its rows the language id as ``token_type_ids`` and keeps the epoch's share of them
    (``pipelines.languages``); the ids of the rest are not reused."""
    vocab = vocab_info(tok, spec.objective)
    packer = Packer(spec.seq_len, vocab.cls_id, vocab.sep_id, vocab.pad_id)
    index = 0
    language = shard_language(spec, uri)
    keep = spec.language_keep[language] if language is not None and spec.language_keep else 1.0

    def emit(block: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        nonlocal index
        n = len(block["input_ids"])
        if n == 0:
            return None
        ids = shard_sample_ids(key, index, n)
        index += n
        out = {**block, "sample_id": ids, "epoch": np.full(n, epoch, dtype=np.int64)}
        if language is None:
            return out
        out["token_type_ids"] = np.full_like(block["input_ids"], language)  # (n, T)
        if mixes_translations(spec):  # the columns of the translation rows beside them: positions counted from 0
            out["position_ids"] = np.where(block["attention_mask"] != 0, np.arange(spec.seq_len), 0).astype(np.int64)
        rows = kept_rows(spec.seed, epoch, ids, keep)  # (n,)
        if not rows.all():
            out = {k: v[rows] for k, v in out.items()}
        return out if len(out["input_ids"]) else None

    for docs in _documents(uri, spec, stats):
        out = emit(packer.add(_sentence_ids(tok, docs)))
        if out is not None:
            yield out
    out = emit(packer.flush())
    if out is not None:
        yield out


def pair_shard(tok: Tokenizer, uri: str, key: int, epoch: int, spec: StreamSpec, kind: RowKind, stats: ReadStats | None = None) -> Iterator[dict[str, np.ndarray]]:
    """NSP or SOP sentence pairs of one shard, chunk by chunk of documents, with their sample ids."""
    build = build_nsp_pairs if kind == "nsp-pairs" else build_sop_pairs
    vocab = vocab_info(tok, spec.objective)
    index = 0
    for docs in _documents(uri, spec, stats):
        tokenized = _sentence_ids(tok, docs)
        base = (int(key) << 32) | index
        block = build(tokenized, spec.seq_len, spec.seed, epoch, base, vocab, short_seq_prob=spec.short_seq_prob)
        index += len(block["input_ids"])
        if len(block["input_ids"]):
            yield block


def translation_shard(tok: Tokenizer, uri: str, key: int, epoch: int, spec: StreamSpec, stats: ReadStats | None = None) -> Iterator[dict[str, np.ndarray]]:
    """XLM's translation-LM rows of one parallel shard, chunk by chunk, with their sample ids."""
    vocab = vocab_info(tok, spec.objective)
    index = 0
    chunks = iter_translations(uri, spec.language_names, store=spec.store, stats=stats, strict=spec.strict,
                               max_record_chars=spec.max_record_chars)
    for chunk in chunks:
        ids = tok.encode_batch([t for _, a, _, b in chunk for t in (a, b)])  # one native call per chunk
        pairs = [(la, ids[2 * k], lb, ids[2 * k + 1]) for k, (la, _, lb, _) in enumerate(chunk)]
        sample_ids = shard_sample_ids(key, index, len(pairs))
        index += len(pairs)
        yield tlm_rows(pairs, spec.seq_len, spec.seed, epoch, sample_ids, vocab.cls_id, vocab.sep_id, vocab.pad_id)


def stream_block_id(key: int, epoch: int, block_index: int) -> int:
    """63-bit id of a block of stream-ordered batches: stable across runs, workers and rows per batch."""
    h = mix64(np.array([(int(key) << 32) | (int(epoch) & 0xFFFFFFFF)], dtype=np.uint64))
    h = mix64(h ^ np.uint64(block_index))
    return int(h[0] & np.uint64(0x7FFFFFFFFFFFFFFF))


def stream_shard(tok: Tokenizer, uri: str, key: int, epoch: int, spec: StreamSpec, batch_rows: int, stats: ReadStats | None = None) -> Iterator[list[dict[str, np.ndarray]]]:
    """Stream-ordered batches (batch_rows, seq_len) of one shard, as a list per block.

    Each batch has ``input_ids``, ``attention_mask``, ``reset_memory`` (the batcher's, valid when
    batches are consumed in order), ``_doc_start``, ``sample_id``, ``epoch``, ``_stream_block``
    and ``_stream_index`` (the last two (B,), constant over the rows).
    """
    if batch_rows < 1:
        raise ValueError(
            f"objective {spec.objective!r} cuts stream-ordered batches and needs their rows per worker "
            f"(StreamSpec.stream_rows = train.micro_batch_size), got {batch_rows}"
        )
    vocab = vocab_info(tok, spec.objective)
    batcher = StreamBatcher(
        batch_rows, spec.seq_len, pad_id=vocab.pad_id, doc_sep_id=vocab.sep_id,
        block_batches=spec.stream_block_batches, base_sample_id=key, epoch=epoch,
    )
    block_index = -1

    def blocks(batches: list[dict[str, np.ndarray]]) -> Iterator[list[dict[str, np.ndarray]]]:
        """Split the batches of one add/flush call (whole blocks, each opened by reset_memory = 1)."""
        nonlocal block_index
        group: list[dict[str, np.ndarray]] = []
        for batch in batches:
            if batch["reset_memory"][0] == 1:
                if group:
                    yield group
                block_index, group = block_index + 1, []
            b = {k: v for k, v in batch.items() if k != "doc_start"}
            b["_doc_start"] = batch["doc_start"]
            b["_stream_block"] = np.full(batch_rows, stream_block_id(key, epoch, block_index), dtype=np.int64)
            b["_stream_index"] = np.full(batch_rows, len(group), dtype=np.int64)
            group.append(b)
        if group:
            yield group

    for docs in _documents(uri, spec, stats):
        ids = [d for d in tok.encode_batch(docs) if d.size]
        if not ids:
            continue
        ends = np.cumsum([d.size for d in ids])  # (D,): [SEP] after every document
        yield from blocks(batcher.add(np.insert(np.concatenate(ids).astype(np.int64), ends, vocab.sep_id)))
    yield from blocks(batcher.flush())


def stack_stream_rows(group: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One Ray Data row per batch: every column (n_batches, B, ...). ``reset_memory`` is dropped:
    the training loop derives it from what each worker actually receives."""
    return {k: np.stack([b[k] for b in group]) for k in group[0] if k != "reset_memory"}


class TokenizePack:
    """Ray Data callable class: one input row = one (shard, epoch) work unit.

    Every row it emits carries ``_shard`` (the shard key) and ``_shard_total`` (the shard's row
    count on the rows of its last output batch, -1 elsewhere), so training can record exactly
    which samples it consumed (``pipelines.position``). Samples already committed in the run's
    latest checkpoint are dropped here, after they are built, so the rest keep their ids and masks;
    shards whose every sample is committed are not read at all.
    """

    def __init__(self, files: dict[str, bytes], spec: StreamSpec):
        self.tok = tokenizer_from_files(files)
        self.spec = spec
        self.kind = row_kind(spec)
        self._position: DataPosition | None = None

    def position(self) -> DataPosition:
        # Read when the stream starts running, not when it is built: after a worker failure Ray
        # Train restarts the workers and re-executes the dataset, and by then the run may have
        # committed newer checkpoints than the driver saw.
        if self._position is None:
            run = self.spec.run_uri
            latest = self.spec.store.latest_complete_checkpoint(run) if run else None
            self._position = load_position(latest, self.spec.store)
        return self._position

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        pos = self.position()
        for uri, key, epoch in zip(batch["shard"], batch["shard_key"], batch["epoch"]):
            uri, key, epoch = str(uri), int(key), int(epoch)
            if pos.shard_complete(epoch, key):
                continue
            stats = ReadStats()
            made = yield from self.rows(uri, key, epoch, pos, stats)
            if self.spec.run_uri:  # the whole shard was read: its counts are final
                write_shard_report(self.spec.run_uri, epoch, uri, key, stats, self.spec.store, samples=made)

    def rows(self, uri: str, key: int, epoch: int, pos: DataPosition, stats: ReadStats) -> Generator[dict[str, np.ndarray], None, int]:
        """One work unit's output batches, committed samples dropped; returns how many samples
        the shard made (dropped ones included)."""
        made = 0
        if self.kind == "stream":
            groups = stream_shard(self.tok, uri, key, epoch, self.spec, self.spec.stream_rows, stats)
            for group, total in _with_total(groups, lambda g: sum(len(b["sample_id"]) for b in g)):
                rows = _tag_shard(stack_stream_rows(group), key, total)  # (n, B, ...)
                made = max(made, total)
                keep = ~pos.is_consumed(epoch, key, rows["sample_id"]).any(axis=1)  # a batch is consumed whole
                if keep.any():
                    yield {k: v[keep] for k, v in rows.items()}  # one Ray block = one stream block
            return made
        buf: list[dict[str, np.ndarray]] = []
        n_buf = 0
        blocks = shard_rows(self.tok, uri, key, epoch, self.spec, self.kind, stats)
        for block, total in _with_total(blocks, lambda b: len(b["input_ids"])):
            block = _tag_shard(block, key, total)
            made = max(made, total)
            keep = ~pos.is_consumed(epoch, key, block["sample_id"])
            if not keep.all():
                block = {k: v[keep] for k, v in block.items()}
            buf.append(block)
            n_buf += len(block["input_ids"])
            if n_buf >= PACKED_ROWS_PER_BATCH:
                yield _concat(buf)
                buf, n_buf = [], 0
        if n_buf:
            yield _concat(buf)
        return made  # total: the last block's row count of the shard (0 if it made none)


def _with_total(items: Iterator[Any], size: Callable[[Any], int]) -> Iterator[tuple[Any, int]]:
    """``(item, -1)`` for every item but the last, which comes with the sum of all sizes."""
    total, prev = 0, None
    for item in items:
        if prev is not None:
            yield prev, -1
        total += size(item)
        prev = item
    if prev is not None:
        yield prev, total


def _tag_shard(rows: dict[str, np.ndarray], key: int, total: int) -> dict[str, np.ndarray]:
    shape = rows["sample_id"].shape  # (n,) or (n, B) for stream rows
    return {**rows, "_shard": np.full(shape, key, dtype=np.int64), "_shard_total": np.full(shape, total, dtype=np.int64)}


def shard_rows(tok: Tokenizer, uri: str, key: int, epoch: int, spec: StreamSpec, kind: RowKind, stats: ReadStats | None = None) -> Iterator[dict[str, np.ndarray]]:
    """Stage 1 for the row kinds whose rows are independent samples (packed rows, pairs)."""
    if kind == "packed" and shard_language(spec, uri) == PARALLEL_SHARD:
        return translation_shard(tok, uri, key, epoch, spec, stats)
    if kind == "packed":
        return pack_shard(tok, uri, key, epoch, spec, stats)
    if kind in ("nsp-pairs", "sop-pairs"):
        return pair_shard(tok, uri, key, epoch, spec, kind, stats)
    if kind == "translations":
        return translation_shard(tok, uri, key, epoch, spec, stats)
    raise ValueError(f"shard_rows: rows of kind {kind!r} are not independent samples")


def _concat(blocks: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}


# ---------------------------------------------------------------------------------------------
# Assembly.


def build_dataset(spec: StreamSpec, tokenizer_dir: str | Path):
    """The training stream as a lazy Ray Dataset (nothing runs until it is iterated).

    For stream objectives every row is one whole worker batch (module docstring): iterate with
    ``batch_size=1``.
    """
    import ray

    tok = load_tokenizer(tokenizer_dir)
    if row_kind(spec) == "stream" and spec.stream_rows < 1:
        raise ValueError(f"data.objective {spec.objective!r}: StreamSpec.stream_rows (rows per worker batch) must be >= 1")
    units = work_units(spec)
    ds = ray.data.from_items(units, override_num_blocks=len(units))
    ds = ds.map_batches(
        TokenizePack,
        fn_constructor_kwargs={"files": tokenizer_files(tokenizer_dir), "spec": spec},
        batch_size=1,
        batch_format="numpy",
        # strict: one work unit at a time per actor, so the first broken shard in epoch order is
        # the one that fails (with several in flight, a later shard's error can surface first).
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=spec.tokenize_actors, max_tasks_in_flight_per_actor=1 if spec.strict else None),
        num_cpus=TOKENIZE_ACTOR_CPUS,
    )
    return ds.map_batches(
        transform_rows,
        fn_kwargs={"ctx": transform_context(spec, tok), "name": spec.objective},
        batch_format="numpy",
        batch_size=None,
        num_cpus=TRANSFORM_TASK_CPUS,
    )


def local_batches(spec: StreamSpec, tok: Tokenizer, batch_size: int, epoch: int, max_batches: int | None = None) -> Iterator[dict[str, np.ndarray]]:
    """The same samples without Ray, in shard order: for evaluation and tests.

    For stream objectives ``batch_size`` is the rows of each stream-ordered batch and the batches
    come in stream order with the batcher's ``reset_memory``.
    """
    ctx = transform_context(spec, tok)
    kind = row_kind(spec)
    produced = 0
    if kind == "stream":
        for uri, key in zip(spec.shards, shard_keys(spec.shards)):
            for group in stream_shard(tok, uri, key, epoch, spec, batch_size):
                for batch in group:
                    yield apply_objective(batch, ctx, spec.objective)
                    produced += 1
                    if max_batches is not None and produced >= max_batches:
                        return
        return
    pending: list[dict[str, np.ndarray]] = []
    rows = 0
    for uri, key in zip(spec.shards, shard_keys(spec.shards)):
        for block in shard_rows(tok, uri, key, epoch, spec, kind):
            pending.append(block)
            rows += len(block["input_ids"])
            while rows >= batch_size:
                merged = _concat(pending)
                yield apply_objective({k: v[:batch_size] for k, v in merged.items()}, ctx, spec.objective)
                produced += 1
                if max_batches is not None and produced >= max_batches:
                    return
                rest = {k: v[batch_size:] for k, v in merged.items()}
                rows = len(rest["input_ids"])
                pending = [rest] if rows else []
