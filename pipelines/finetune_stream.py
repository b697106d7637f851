"""The Ray Data stream that feeds fine-tuning: task records -> fixed-width rows with stable names.

::

    split files --Ray Data read_text (JSONL) / read_csv / read_parquet--> records, in file order,
        each kept as its JSON text with its file and line (``read_split``; one Arrow table)
    check (map_batches(CheckRecords)): every record parsed and encoded once: used or rejected
        (file, line, field, reason), the rows it makes (QA: one per context window), truncated
        or not -> the split's data report (pipelines.datareport), the training schedule
    work units {epoch, unit, records}: the epoch's order of the usable records, a permutation keyed
        by (seed, epoch), cut into units of ``unit_records``          (``work_units``)
      -> map_batches(EncodeUnits) actor: parse and encode (pipelines.finetune ENCODERS), name
        each row, drop the rows the run's latest checkpoint committed
      -> Ray Train: get_dataset_shard("train")

Every row has a name that does not depend on Ray, worker counts or timing: ``epoch``, ``_shard``
= the unit's number in its epoch, and ``sample_id = record index in the split << 16 | window``
(the context window of a question-answering row, else 0); ``_shard_total`` is the unit's row
count. The data position (``pipelines.position``) and the commit of ``jobs.training.loop.Checkpointer``
then make resume exact as in pretraining (``docs/EXACTLY_ONCE.md``): a unit whose rows are all
committed is skipped, committed rows of the others are dropped.

Records travel as their JSON text (``_json``): a split whose records disagree on a field's type
(a bad record) still reads, and the encoder names the record instead of Arrow failing the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from ctxmodels.task_kinds import TASKS
from pipelines import storage
from pipelines.finetune import (
    NEGATIVE_FIELDS, LabelSet, RecordError, TaskDataConfig, check_records, encode_task, negative_count, read_squad_json,
)
from pipelines.position import DataPosition, load_position
from pipelines.rng import keyed_uniform
from pipelines.sources import ReadStats

# A split file may be compressed whole (``train.jsonl.zst``): Ray Data's readers and read_squad_json undo these by name.
SPLIT_COMPRESSIONS = storage.ARROW_COMPRESSIONS
SPLIT_SUFFIXES = tuple(base + c for base in (".jsonl", ".json", ".csv", ".tsv") for c in ("", *SPLIT_COMPRESSIONS)) + (".parquet",)
WINDOW_BITS = 16  # sample_id = record index << WINDOW_BITS | window
ENCODE_ACTOR_CPUS = 0.5
RECORD_COLUMNS = ("_index", "_file", "_line", "_json")


def split_format(path: str, fmt: str = "auto") -> str:
    """jsonl, csv, tsv, parquet or squad (the official nested SQuAD JSON) for one split file."""
    if fmt != "auto":
        return fmt
    p = path.lower()
    p = p[: len(p) - len(next((c for c in SPLIT_COMPRESSIONS if p.endswith(c)), ""))]
    if p.endswith(".jsonl"):
        return "jsonl"
    if p.endswith(".csv"):
        return "csv"
    if p.endswith(".tsv"):
        return "tsv"
    if p.endswith(".parquet"):
        return "parquet"
    if p.endswith(".json"):  # one JSON document (SQuAD) or JSON lines: the first line tells
        fs, local = storage.filesystem(path)
        with fs.open_input_stream(local, compression="detect") as f:
            head = f.read(1 << 16).decode("utf-8", "replace").lstrip()
        first = head.split("\n", 1)[0]
        try:
            json.loads(first)
            return "jsonl"
        except ValueError:
            return "squad"
    raise ValueError(f"{path}: unknown split format (expected {', '.join(SPLIT_SUFFIXES)} or set data.format)")


def _with_lines(table: pa.Table, path_column: str) -> pa.Table:
    """``_file`` and ``_line`` (1-based position of the record in its file) from Ray's ``path`` column."""
    paths = table.column(path_column).to_pylist()
    lines, seen = [], {}
    for p in paths:
        seen[p] = seen.get(p, 0) + 1
        lines.append(seen[p])
    return table.drop_columns([path_column]).append_column("_file", pa.array(paths, pa.string())).append_column("_line", pa.array(lines, pa.int64()))


def _ordered(ds) -> pa.Table:
    """A Ray Dataset's rows in order, as one Arrow table (Ray seam)."""
    import ray

    tables = [t for t in ray.get(ds.to_arrow_refs()) if t.num_rows]
    return pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})


def read_split(uris: str | list[str], fmt: str = "auto", store: storage.Store = storage.Store()) -> pa.Table:
    """Every record of a split, in file order: ``_index`` (position in the split: the record's
    stable id), ``_file``, ``_line`` and ``_json`` (the record as JSON text). Empty JSONL lines
    are not records. Ray seam: Ray Data reads the files (any URI pyarrow opens)."""
    import ray
    from ray.data.context import DataContext

    files = store.list_files(uris, suffixes=SPLIT_SUFFIXES)
    parts = []
    ctx = DataContext.get_current()
    saved = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True  # rows in file order: the index is the record's name
    try:
        for path in files:
            kind = split_format(path, fmt)
            fs, local = storage.filesystem(path, store.endpoint_url)
            if kind == "squad":
                cols = read_squad_json(path, store)
                n = len(cols["id"])
                texts = [json.dumps({k: cols[k][i] for k in cols}, ensure_ascii=False) for i in range(n)]
                parts.append(pa.table({"_file": [path] * n, "_line": list(range(1, n + 1)), "_json": texts}))
                continue
            if kind == "jsonl":
                t = _ordered(ray.data.read_text(local, filesystem=fs, include_paths=True, drop_empty_lines=False))
                if not t.num_rows:
                    continue
                t = _with_lines(t.rename_columns(["_json" if c == "text" else c for c in t.column_names]), "path")
                keep = pa.array([bool(x.strip()) for x in t.column("_json").to_pylist()])
                parts.append(t.filter(keep).select(["_file", "_line", "_json"]).replace_schema_metadata(None))
                continue
            if kind in ("csv", "tsv"):
                from pyarrow import csv as pacsv

                parse = pacsv.ParseOptions(delimiter="\t" if kind == "tsv" else ",")
                t = _ordered(ray.data.read_csv(local, filesystem=fs, include_paths=True, parse_options=parse))
            elif kind == "parquet":
                t = _ordered(ray.data.read_parquet(local, filesystem=fs, include_paths=True))
            else:
                raise ValueError(f"data.format: unknown format {kind!r}")
            if not t.num_rows:
                continue
            t = _with_lines(t, "path")
            fields = [c for c in t.column_names if c not in ("_file", "_line")]
            rows = t.select(fields).to_pylist()
            parts.append(pa.table({"_file": t.column("_file"), "_line": t.column("_line"),
                                   "_json": [json.dumps(r, ensure_ascii=False, default=str) for r in rows]}))
    finally:
        ctx.execution_options.preserve_order = saved
    if not parts:
        return pa.table({c: pa.array([], t) for c, t in zip(RECORD_COLUMNS, (pa.int64(), pa.string(), pa.int64(), pa.string()))})
    table = pa.concat_tables(parts)
    return table.add_column(0, "_index", pa.array(np.arange(table.num_rows, dtype=np.int64)))


# ---------------------------------------------------------------------------------------------
# Records -> columns


def parse_records(texts: list[str]) -> tuple[list[dict[str, Any] | None], list[str | None]]:
    """Each JSON text as a dict, or None with the reason it is not one."""
    out, why = [], []
    for text in texts:
        try:
            value = json.loads(text)
        except ValueError as e:
            out.append(None)
            why.append(f"malformed JSON: {e}")
            continue
        if not isinstance(value, dict):
            out.append(None)
            why.append(f"a record is a JSON object, got {type(value).__name__}")
            continue
        out.append(value)
        why.append(None)
    return out, why


def columns(records: list[dict[str, Any]]) -> dict[str, list]:
    """Records -> columns; a field a record lacks is None there (the encoder names it)."""
    names: dict[str, None] = {}
    for r in records:
        names.update(dict.fromkeys(r))
    return {k: [r.get(k) for r in records] for k in names}


def label_values(table: pa.Table, cfg: TaskDataConfig) -> list:
    """Every label (classification) or tag (token classification) of a split: what ``LabelSet``
    is built from. Records that do not parse or lack the field are left out (they are rejected later)."""
    task = TASKS[cfg.kind]
    if not task.labelled:
        return []
    records, _ = parse_records(table.column("_json").to_pylist())
    out = []
    for r in records:
        if r is None:
            continue
        if task.reads == "tokens":  # a tag per word
            tags = r.get(cfg.tags_field)
            if isinstance(tags, list):
                out.extend(t for t in tags if isinstance(t, (str, int)) and not isinstance(t, bool))
        else:
            v = r.get(cfg.label_field)
            if isinstance(v, (str, int)) and not isinstance(v, bool) or (isinstance(v, float) and v.is_integer()):
                out.append(v)
    return out


def label_set(table: pa.Table, cfg: TaskDataConfig) -> LabelSet:
    values = label_values(table, cfg)
    if not values:
        key = "tags_field" if TASKS[cfg.kind].reads == "tokens" else "label_field"
        raise ValueError(f"the training split has no usable {getattr(cfg, key)!r} values: check task.{key}")
    return LabelSet.from_values(np.asarray(values, dtype=object))


def encode_rows(texts: list[str], index: np.ndarray, tok, cfg: TaskDataConfig) -> tuple[dict[str, np.ndarray], np.ndarray, list[RecordError | str | None]]:
    """Encode records (their JSON texts and split indices): (rows of the usable ones, named;
    bool (n,) usable; per record None or why it was rejected). A field no record has is a
    configuration error (ValueError naming it), not a bad record."""
    parsed, why = parse_records(texts)
    problems: list[RecordError | str | None] = list(why)
    ok = np.array([p is not None for p in parsed], dtype=bool)
    names: dict[str, None] = {}
    for p in parsed:
        names.update(dict.fromkeys(p or {}))

    def cols(which: np.ndarray) -> dict[str, list]:
        return {k: [parsed[i].get(k) for i in which] for k in names}

    good = np.flatnonzero(ok)
    if good.size:
        for err in check_records(cols(good), cfg):
            ok[good[err.index]] = False
            problems[good[err.index]] = err
    good = np.flatnonzero(ok)
    if not good.size:
        return {}, ok, problems
    rows = encode_task(cols(good), tok, cfg)
    return name_rows(rows, np.asarray(index, dtype=np.int64)[good], cfg), ok, problems


def name_rows(rows: dict[str, np.ndarray], index: np.ndarray, cfg: TaskDataConfig) -> dict[str, np.ndarray]:
    """``sample_id`` (and, for QA, ``example_index``) in split terms: record index << 16 | window."""
    n_rows = len(rows["input_ids"])
    if cfg.kind == "question-answering":
        local = rows["example_index"]  # (F,) record of each window, within this batch
        starts = np.searchsorted(local, local, side="left")  # windows of a record are contiguous
        window = np.arange(n_rows) - starts
        record = index[local]
        rows["example_index"] = record.astype(np.int64)  # the split's record index: what decode_qa merges by
    else:
        window = np.zeros(n_rows, dtype=np.int64)
        record = index
    if (window >= 1 << WINDOW_BITS).any():
        raise ValueError(f"a record made more than {1 << WINDOW_BITS} windows: raise task.doc_stride or task.max_len")
    rows["sample_id"] = (record.astype(np.int64) << WINDOW_BITS) | window.astype(np.int64)
    return rows


# ---------------------------------------------------------------------------------------------
# Checking a split (Ray Data), its report


class CheckRecords:
    """Ray Data callable class: records -> ``_index``, ``ok``, ``reason``, ``message``, ``rows``,
    ``truncated`` per record (no model columns)."""

    def __init__(self, files: dict[str, bytes], cfg: TaskDataConfig):
        from pipelines.dataset import tokenizer_from_files

        self.tok = tokenizer_from_files(files)
        self.cfg = cfg

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        index = np.asarray(batch["_index"], dtype=np.int64)
        rows, ok, problems = encode_rows([str(x) for x in batch["_json"]], index, self.tok, self.cfg)
        n = len(index)
        made = np.zeros(n, dtype=np.int64)
        truncated = np.zeros(n, dtype=bool)
        if rows:
            record = rows["sample_id"] >> WINDOW_BITS
            pos = np.searchsorted(index, record)  # index is sorted within a batch (file order)
            np.add.at(made, pos, 1)
            np.logical_or.at(truncated, pos, rows["truncated"])
        reasons = [_category(p) for p in problems]
        return {
            "_index": index, "ok": ok, "rows": made, "truncated": truncated,
            "reason": np.array([r or "" for r in reasons], dtype=object),
            "message": np.array([str(p) if p is not None else "" for p in problems], dtype=object),
        }


def _category(problem: RecordError | str | None) -> str | None:
    if problem is None:
        return None
    if isinstance(problem, RecordError):
        return f"bad field {problem.field!r}"
    return "malformed JSON" if problem.startswith("malformed JSON") else "not a JSON object"


@dataclass
class SplitCheck:
    """What checking a split found: the usable records, the rows each makes, per-file counts."""

    usable: np.ndarray  # int64 (n,) split indices of the usable records, in split order
    rows: np.ndarray  # int64 (n,) rows each makes (QA: windows)
    truncated: int  # usable records cut to task.max_len (QA: questions cut to max_query_len)
    stats: dict[str, ReadStats]  # file -> read / used / rejected with reasons and first examples

    @property
    def total_rows(self) -> int:
        return int(self.rows.sum())


def with_split_widths(table: pa.Table, cfg: TaskDataConfig) -> TaskDataConfig:
    """``cfg`` with ``n_negatives`` pinned to the split's most common count (the embedding kind).
    Records are checked a batch at a time; unpinned, each batch would agree only with itself, and
    batches of different widths cannot be stacked into one dataset. Every usable record then has
    the split's count, so encoding them later without the pin gives the same width."""
    if TASKS[cfg.kind].reads != "texts" or cfg.n_negatives is not None or cfg.scored_pairs:
        return cfg
    records, _ = parse_records(table.column("_json").to_pylist())
    field = cfg.negative_field or next((f for f in NEGATIVE_FIELDS if any(r and f in r for r in records)), None)
    if field is None:
        return replace(cfg, n_negatives=0)
    column = {field: [r.get(field) for r in records if r is not None]}
    return replace(cfg, n_negatives=negative_count(column, replace(cfg, negative_field=field)))


def check_split(table: pa.Table, files: dict[str, bytes], cfg: TaskDataConfig, batch_size: int = 256) -> SplitCheck:
    """Parse and encode every record once (Ray Data map_batches over an actor pool), under the
    split's widths (``with_split_widths``)."""
    import ray

    if table.num_rows == 0:
        return SplitCheck(np.zeros(0, np.int64), np.zeros(0, np.int64), 0, {})
    cfg = with_split_widths(table, cfg)
    ds = ray.data.from_arrow(table.select(["_index", "_json"])).map_batches(
        CheckRecords, fn_constructor_kwargs={"files": files, "cfg": cfg}, batch_size=batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=1), num_cpus=ENCODE_ACTOR_CPUS,
    )
    parts = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    got = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(got["_index"], kind="stable")
    got = {k: v[order] for k, v in got.items()}
    files_col = table.column("_file").to_pylist()
    lines = table.column("_line").to_numpy()
    stats: dict[str, ReadStats] = {}
    for i, ok in enumerate(got["ok"]):
        s = stats.setdefault(files_col[i], ReadStats())
        if ok:
            s.use()
        else:
            s.reject(str(got["reason"][i]), str(got["message"][i]), line=int(lines[i]))
    ok = got["ok"].astype(bool)
    return SplitCheck(got["_index"][ok].astype(np.int64), got["rows"][ok].astype(np.int64), int(got["truncated"][ok].sum()), stats)


def write_split_report(run_uri: str, split: str, check: SplitCheck, store: storage.Store = storage.Store()) -> dict[str, Any]:
    """The split's records read / used / rejected per file, as pretraining's shard reports
    (``data_reports/epoch-00000/``, one file per split file), merged; ``truncated`` added."""
    from pipelines import datareport
    from pipelines.rng import stable_hash64

    for path, stats in check.stats.items():
        key = stable_hash64(f"{split}:{path}") & 0x7FFFFFFF
        datareport.write_shard_report(run_uri, 0, path, key, stats, store, samples=stats.used)
    report = datareport.epoch_report(run_uri, 0, store)
    return {**report, "split": split, "truncated": check.truncated}


# ---------------------------------------------------------------------------------------------
# The training stream


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of an epoch's records: a permutation of range(n), a function of (seed, epoch)."""
    u = keyed_uniform(seed, epoch, np.zeros(1, dtype=np.int64), n, stream=0xF17E)[0]
    return np.argsort(u, kind="stable")


def work_units(usable: np.ndarray, seed: int, first_epoch: int, epochs: int, unit_records: int) -> list[dict[str, Any]]:
    """``{epoch, unit, records}`` for every epoch from ``first_epoch``: the epoch's order cut into
    units of ``unit_records`` split indices."""
    out = []
    n = len(usable)
    for epoch in range(first_epoch, epochs):
        order = usable[epoch_order(n, seed, epoch)]
        for u, start in enumerate(range(0, n, unit_records)):
            out.append({"epoch": epoch, "unit": u, "records": order[start : start + unit_records]})
    return out


def n_units(n_records: int, unit_records: int) -> int:
    return -(-n_records // unit_records)


class EncodeUnits:
    """Ray Data callable class: one input row = one (epoch, unit) work unit -> its named rows.

    Rows already committed in the run's latest checkpoint are dropped (its data position is read
    when the stream starts running, so also after Ray Train restarts failed workers)."""

    def __init__(self, table: pa.Table, files: dict[str, bytes], cfg: TaskDataConfig, run_uri: str | None, store: storage.Store):
        from pipelines.dataset import tokenizer_from_files

        self.texts = table.column("_json").to_pylist()
        self.tok = tokenizer_from_files(files)
        self.cfg = cfg
        self.run_uri, self.store = run_uri, store
        self._position: DataPosition | None = None

    def position(self) -> DataPosition:
        if self._position is None:
            latest = self.store.latest_complete_checkpoint(self.run_uri) if self.run_uri else None
            self._position = load_position(latest, self.store)
        return self._position

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
        pos = self.position()
        for epoch, unit, records in zip(batch["epoch"], batch["unit"], batch["records"]):
            epoch, unit = int(epoch), int(unit)
            if pos.shard_complete(epoch, unit):
                continue
            index = np.asarray(records, dtype=np.int64)
            rows, ok, problems = encode_rows([self.texts[i] for i in index], index, self.tok, self.cfg)
            if not ok.all():  # the records were checked on the driver with the same config
                bad = next(p for p in problems if p is not None)
                raise RuntimeError(f"record {int(index[~ok][0])} no longer encodes: {bad}")
            n = len(rows["sample_id"])
            rows["epoch"] = np.full(n, epoch, dtype=np.int64)
            rows["_shard"] = np.full(n, unit, dtype=np.int64)
            rows["_shard_total"] = np.full(n, n, dtype=np.int64)
            keep = ~pos.is_consumed(epoch, unit, rows["sample_id"])
            if keep.any():
                yield {k: v[keep] for k, v in rows.items()}


def build_train_dataset(table: pa.Table, usable: np.ndarray, files: dict[str, bytes], cfg: TaskDataConfig, *, seed: int,
                        first_epoch: int, epochs: int, unit_records: int, run_uri: str | None, store: storage.Store):
    """The training stream as a lazy Ray Dataset (nothing runs until it is iterated)."""
    import ray

    units = work_units(usable, seed, first_epoch, epochs, unit_records)
    if not units:
        raise ValueError("no training records left to stream (every epoch is done, or the split is empty)")
    ds = ray.data.from_items(units, override_num_blocks=len(units))
    return ds.map_batches(
        EncodeUnits,
        fn_constructor_kwargs={"table": table.select(["_json"]), "files": files, "cfg": cfg, "run_uri": run_uri, "store": store},
        batch_size=1, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=1), num_cpus=ENCODE_ACTOR_CPUS,
    )


def encode_split(table: pa.Table, usable: np.ndarray, files: dict[str, bytes], cfg: TaskDataConfig) -> dict[str, np.ndarray]:
    """The usable records of a (validation/test) split, encoded in split order, as one dict of
    arrays (Ray Data map_batches, then gathered on the driver)."""
    import ray

    if len(usable) == 0:
        return {}
    sub = table.take(pa.array(usable)).select(["_index", "_json"])
    ds = ray.data.from_arrow(sub).map_batches(
        _EncodeGood, fn_constructor_kwargs={"files": files, "cfg": cfg}, batch_size=256, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=1), num_cpus=ENCODE_ACTOR_CPUS,
    )
    parts = [p for p in ds.iter_batches(batch_size=None, batch_format="numpy") if len(p.get("sample_id", ()))]
    rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(rows["sample_id"], kind="stable")
    return {k: v[order] for k, v in rows.items()}


class _EncodeGood:
    def __init__(self, files: dict[str, bytes], cfg: TaskDataConfig):
        from pipelines.dataset import tokenizer_from_files

        self.tok = tokenizer_from_files(files)
        self.cfg = cfg

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows, _, _ = encode_rows([str(x) for x in batch["_json"]], np.asarray(batch["_index"], dtype=np.int64), self.tok, self.cfg)
        return rows


def references(table: pa.Table, usable: np.ndarray, cfg: TaskDataConfig) -> dict[str, Any]:
    """What validation metrics compare with, for QA: ``contexts`` (every record of the split, by
    index; "" for unusable ones) and ``answers`` (texts per usable record, in ``usable`` order).
    Other kinds compare with columns of the encoded rows: ``labels``; embedding: ``doc_ids``."""
    if cfg.kind != "question-answering":
        return {}
    parsed, _ = parse_records(table.column("_json").to_pylist())
    contexts = [str((p or {}).get(cfg.context_field) or "") for p in parsed]
    answers = []
    for i in usable:
        a = parsed[i].get(cfg.answers_field)
        if isinstance(a, list):  # official SQuAD [{"text", "answer_start"}]
            a = {"text": [x.get("text") for x in a if isinstance(x, dict)]}
        answers.append([str(t) for t in (a or {}).get("text", [])])
    return {"contexts": contexts, "answers": answers}


def with_labels(cfg: TaskDataConfig, labels: LabelSet | None) -> TaskDataConfig:
    return replace(cfg, labels=tuple(labels.names) if labels is not None else ())
