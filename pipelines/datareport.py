"""The per-epoch data report: what became of every record of every shard read in an epoch.

The stage that reads shards writes one small JSON file per (epoch, shard) when it has read the
shard (``write_shard_report``)::

    {run_uri}/data_reports/epoch-00003/1a2b3c4d.json     # the shard's key, 8 hex digits

    {"epoch": 3, "shard": "s3://bucket/corpus/part-7.jsonl.gz", "shard_key": 439041101,
     "read": 1000, "used": 997, "rejected": 3, "reasons": {"malformed JSON": 3},
     "examples": [[17, "malformed JSON: Expecting value (column 9)"], ...], "empty": false}

A file per shard, named by the shard, so shards read in parallel on any node never write to the
same object, and a shard read twice (a retried task) overwrites its own file with the same
counts. ``epoch_report`` merges the files of an epoch and checks that the counts reconcile;
``format_report`` turns the result into a few lines for a person.

No torch here: pyarrow filesystems only (``pipelines.storage``), so the driver, a Ray Data
actor or a notebook can all read and write reports.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pyarrow.fs as pafs

from pipelines.sources import ReadStats
from pipelines.storage import Store, StorageError, filesystem, join

REPORTS_DIR = "data_reports"
_EPOCH_DIR = re.compile(r"epoch-(\d+)")


def epoch_dir(run_uri: str, epoch: int) -> str:
    """The folder holding the shard reports of one epoch."""
    return join(run_uri, REPORTS_DIR, f"epoch-{epoch:05d}")


def write_shard_report(run_uri: str, epoch: int, shard_uri: str, shard_key: int, stats: ReadStats, store: Store = Store(),
                       samples: int | None = None) -> str:
    """Write the counts of one shard read in one epoch; returns the report's URI. ``samples``:
    how many training samples the shard's used records made (0 tells training that the shard
    is done for the epoch although none of its samples will ever arrive).

    Idempotent: the file is named by ``(epoch, shard_key)`` and holds nothing else, so writing
    it again (a retried task) leaves the same report. Readers never see half a file: on a local
    disk it is written under a temporary name and renamed; on an object store it is one PUT.

    Best-effort (``Store.best_effort``): a store still down after its deadline or a full disk
    is a warning, and the stream goes on. A lost report of a shard that made samples costs only
    the report; one of a shard that made none keeps its epoch open (``sampleless_shards``) until
    the shard is read again after a restart.
    """
    uri = join(epoch_dir(run_uri, epoch), f"{shard_key:08x}.json")
    record = {"epoch": epoch, "shard": shard_uri, "shard_key": shard_key, "samples": samples, **stats.to_dict()}
    data = (json.dumps(record, ensure_ascii=False, indent=1) + "\n").encode("utf-8")
    fs, path = filesystem(uri, store.endpoint_url)
    folder = path.rsplit("/", 1)[0]

    def put() -> None:
        if isinstance(fs, pafs.LocalFileSystem):
            fs.create_dir(folder, recursive=True)
            tmp = f"{folder}/.{path.rsplit('/', 1)[1]}.{uuid.uuid4().hex}.tmp"  # unique: two writers never share it
            with fs.open_output_stream(tmp) as out:
                out.write(data)
            fs.move(tmp, path)  # atomic replace
        else:
            with fs.open_output_stream(path) as out:
                out.write(data)

    store.best_effort(put, f"write data report {uri}")
    return uri


def list_epochs(run_uri: str, store: Store = Store()) -> list[int]:
    """The epochs that have a data report folder under the run, in order ([] when none)."""
    fs, path = filesystem(join(run_uri, REPORTS_DIR), store.endpoint_url)
    sel = pafs.FileSelector(path, recursive=False, allow_not_found=True)
    infos = store.retry(lambda: fs.get_file_info(sel), f"list {join(run_uri, REPORTS_DIR)}")
    matches = (_EPOCH_DIR.fullmatch(i.base_name) for i in infos if i.type == pafs.FileType.Directory)
    return sorted(int(m.group(1)) for m in matches if m)


def epoch_report(run_uri: str, epoch: int, store: Store = Store()) -> dict[str, Any]:
    """Merge the shard reports of one epoch.

    Returns a dict of plain values::

        epoch, n_shards, empty_shards,
        read, used, rejected,            # totals over the shards
        reasons,                         # {category: count}, summed over the shards
        shards,                          # one row per shard, sorted by shard URI: shard, shard_key,
                                         # read, used, rejected, reasons, examples, empty
        reconciled, problems             # see below

    ``reconciled`` is True when every shard has ``read == used + rejected`` and reasons that sum
    to its ``rejected``, and the totals add up the same way; ``problems`` lists what does not,
    one line each. An epoch without reports gives zero shards (and ``reconciled`` True: nothing
    is unaccounted for).
    """
    folder = epoch_dir(run_uri, epoch)
    fs, path = filesystem(folder, store.endpoint_url)
    sel = pafs.FileSelector(path, recursive=False, allow_not_found=True)
    infos = store.retry(lambda: fs.get_file_info(sel), f"list {folder}")
    names = sorted(i.base_name for i in infos if i.type == pafs.FileType.File and i.base_name.endswith(".json") and not i.base_name.startswith("."))
    shards = [_read_shard_report(join(folder, name), store) for name in names]
    shards.sort(key=lambda s: s["shard"])

    reasons: dict[str, int] = {}
    problems: list[str] = []
    for s in shards:
        for reason, n in s["reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + n
        if s["read"] != s["used"] + s["rejected"]:
            problems.append(f"{s['shard']}: read {s['read']} != used {s['used']} + rejected {s['rejected']}")
        if sum(s["reasons"].values()) != s["rejected"]:
            problems.append(f"{s['shard']}: reasons sum to {sum(s['reasons'].values())}, rejected is {s['rejected']}")
    read, used, rejected = (sum(s[k] for s in shards) for k in ("read", "used", "rejected"))
    if read != used + rejected or sum(reasons.values()) != rejected:
        problems.append(f"totals: read {read}, used {used}, rejected {rejected}, reasons {sum(reasons.values())}")
    return {
        "epoch": epoch,
        "n_shards": len(shards),
        "empty_shards": sum(s["empty"] for s in shards),
        "read": read,
        "used": used,
        "rejected": rejected,
        "reasons": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        "shards": shards,
        "reconciled": not problems,
        "problems": problems,
    }


def _read_shard_report(uri: str, store: Store) -> dict[str, Any]:
    try:
        raw = json.loads(store.read_bytes(uri).decode("utf-8"))
        stats = ReadStats.from_dict(raw)
        shard, key = str(raw["shard"]), int(raw["shard_key"])
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise StorageError(f"{uri}: not a shard report ({e}); delete it and read the shard again") from None
    row = {"shard": shard, "shard_key": key, "samples": raw.get("samples"), **stats.to_dict()}
    row["empty"] = stats.empty
    return row


def write_epoch_report(run_uri: str, epoch: int, store: Store = Store()) -> dict[str, Any]:
    """Merge one epoch's shard reports and write them as ``data_reports/epoch-NNNNN.json``
    (best-effort: a failed write is a warning, the merged report is returned all the same)."""
    report = epoch_report(run_uri, epoch, store)
    uri = join(run_uri, REPORTS_DIR, f"epoch-{epoch:05d}.json")
    fs, path = filesystem(uri, store.endpoint_url)
    data = (json.dumps(report, ensure_ascii=False, indent=1) + "\n").encode("utf-8")

    def put() -> None:
        if isinstance(fs, pafs.LocalFileSystem):
            fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with fs.open_output_stream(path) as out:
            out.write(data)

    store.best_effort(put, f"write data report {uri}")
    return report


def sampleless_shards(run_uri: str, epoch: int, store: Store = Store()) -> set[int]:
    """Keys of the shards read whole in ``epoch`` that made no training samples (empty, or every
    record rejected, or too short to pack)."""
    return {s["shard_key"] for s in epoch_report(run_uri, epoch, store)["shards"] if s.get("samples") == 0}


def format_report(report: dict[str, Any]) -> str:
    """A few lines for a person: the totals, then one line per shard that lost records or was
    empty, with its first example."""
    reasons = ", ".join(f"{r}: {n}" for r, n in report["reasons"].items())
    head = (
        f"epoch {report['epoch']}: {report['n_shards']} shards, {report['read']:,} records read, "
        f"{report['used']:,} used, {report['rejected']:,} rejected" + (f" ({reasons})" if reasons else "")
    )
    if report["empty_shards"]:
        head += f", {report['empty_shards']} empty shard{'s' if report['empty_shards'] != 1 else ''}"
    lines = [head + ("" if report["reconciled"] else "; NOT reconciled")]
    lines += [f"  ! {p}" for p in report["problems"]]
    for s in report["shards"]:
        if s["empty"]:
            lines.append(f"  {s['shard']}: empty (no records)")
        elif s["rejected"]:
            why = ", ".join(f"{r}: {n}" for r, n in sorted(s["reasons"].items(), key=lambda kv: -kv[1]))
            line = f"  {s['shard']}: {s['rejected']:,} of {s['read']:,} rejected ({why})"
            if s["examples"]:
                where, message = s["examples"][0]
                unit = "row" if s["shard"].endswith(".parquet") else "line"
                line += f"; first at {unit} {where}: {message}" if where is not None else f"; first: {message}"
            lines.append(line)
    return "\n".join(lines)
