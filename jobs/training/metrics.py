"""Training metrics kept with the run: a JSON-lines file and TensorBoard scalars.

    {run_uri}/metrics/metrics.jsonl   one JSON object per logged step (what ``ctx report`` reads)
    {run_uri}/metrics/tb/             TensorBoard event files: tensorboard --logdir {run_uri}/metrics/tb

Rank 0 of the training loop owns one ``MetricsLog`` and calls ``log`` with the dict it also sends
to the progress board. A local run is written in place: each line is flushed as it is logged, so
``ctx report`` shows a run while it trains. An object-store run (``s3://``...) is written to a
temporary folder and uploaded every ``flush_every_s`` seconds and on ``close``: the JSON-lines file
is small, so it is rewritten whole; TensorBoard's event files are uploaded as they grow (a
restarted writer starts a new event file, so nothing is overwritten).

A resumed run appends to the same file; ``read_metrics`` resolves the repeated steps.

Metrics are telemetry: writing them is best-effort. A full disk, an unwritable folder or an object
store still down after the ``Store``'s deadline (``data.retry_deadline_s``) is a warning on stderr, and
training goes on; the lines logged meanwhile are lost (each line is appended on its own, so
writing resumes by itself once the disk has room again), and the next upload sends whole files.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any


from pipelines import storage

METRICS_DIR = "metrics"
JSONL = "metrics.jsonl"
TB_DIR = "tb"
NOT_SCALARS = ("step", "max_steps", "time")  # logged in the JSON line, not as TensorBoard scalars


def metrics_uri(run_uri: str) -> str:
    return storage.join(run_uri, METRICS_DIR, JSONL)


def _plain(value: Any) -> Any:
    """Tensors and NumPy scalars -> Python numbers, so json.dumps takes them."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def _read_text(uri: str, store: storage.Store | str | None) -> str | None:
    """The file's text, or None when it does not exist."""
    data = storage.as_store(store).read_bytes(uri, missing_ok=True)
    return None if data is None else data.decode("utf-8")


class MetricsLog:
    """Appends metrics dicts to ``{run_uri}/metrics/``; see the module docstring."""

    def __init__(self, run_uri: str, store: storage.Store = storage.Store(), flush_every_s: float = 30.0):
        from torch.utils.tensorboard import SummaryWriter

        self.run_uri = run_uri
        self.store = store
        self.flush_every_s = flush_every_s
        self.remote = storage.is_remote(run_uri)
        self.uri = storage.join(run_uri, METRICS_DIR)
        self._tmp: tempfile.TemporaryDirectory | None = None
        if self.remote:
            self._tmp = tempfile.TemporaryDirectory(prefix="ctx-metrics-")
            self.local_dir = Path(self._tmp.name)
            # A resumed run continues the file: start from what is already there.
            previous = _read_text(metrics_uri(run_uri), store)
            (self.local_dir / JSONL).write_text(previous or "")
        else:
            self.local_dir = Path(storage.filesystem(self.uri)[1])
            self.local_dir.mkdir(parents=True, exist_ok=True)
        path = self.local_dir / JSONL
        # A run killed mid-write leaves a line without its newline: end it, so the next line
        # stays parseable (read_metrics skips the broken one).
        with open(path, "ab+") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")  # append mode: lands at the end whatever the position
        self.path = path  # opened for each line, so a file replaced or a disk freed meanwhile is written again
        self._writer = SummaryWriter(log_dir=str(self.local_dir / TB_DIR))
        self._last_flush = time.monotonic()
        self._warned = False
        self.lost = 0  # lines not written since the last warning (a full disk, an unwritable file)
        self.closed = False

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one step's metrics (``step`` required): a JSON line and a scalar per number."""
        if self.closed:
            raise RuntimeError(f"MetricsLog for {self.run_uri} is closed")
        row = {k: _plain(v) for k, v in metrics.items()}
        if "step" not in row:
            raise ValueError(f"metrics need a 'step' key to be logged; got keys {sorted(row)}")
        row.setdefault("time", time.time())
        line = json.dumps(row) + "\n"
        step = int(row["step"])
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
            # TensorBoard's writer raises, at a later call, what its background thread failed to write
            for key, value in row.items():
                if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                self._writer.add_scalar(key, value, global_step=step, walltime=row["time"])
        except OSError as e:
            if not self.lost:
                print(f"warning: metrics: cannot write step {step} to {self.path} ({e}); training goes on, "
                      "metrics are lost until it can be written again", file=sys.stderr)
            self.lost += 1
            return
        if self.lost:
            print(f"metrics: writing {self.path} again from step {step} ({self.lost} logged steps lost)", file=sys.stderr)
            self.lost = 0
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self._flush(raise_errors=False)

    def flush(self) -> None:
        """Write TensorBoard's buffer and, for an object-store run, upload the files now."""
        self._flush(raise_errors=True)

    def _flush(self, raise_errors: bool) -> None:
        self._last_flush = time.monotonic()
        try:
            self._writer.flush()
            if self.remote:
                self.store.copy_dir(self.local_dir, self.uri)
        except (storage.StorageError, OSError) as e:  # OSError: access denied, a full disk ..., raised unwrapped
            if raise_errors:
                raise
            # Training goes on; the next flush uploads everything again (the files are whole).
            if not self._warned:
                print(f"warning: metrics: writing {self.uri} failed, will try again at the next flush: {e}", file=sys.stderr)
                self._warned = True

    def close(self) -> None:
        """Flush, upload (object stores) and release the files. Safe to call twice. Best-effort
        like ``log``: a failure is a warning."""
        if self.closed:
            return
        self.closed = True
        try:
            self._writer.close()
            if self.remote:
                self.store.copy_dir(self.local_dir, self.uri)
        except (storage.StorageError, OSError) as e:
            print(f"warning: metrics: the last write of {self.uri} failed: {e}", file=sys.stderr)
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(run_uri: str, store: storage.Store | str | None = None) -> list[dict[str, Any]]:
    """Every logged step of a run, in step order; [] when it has logged nothing yet. ``store``: the
    command's Store, or an endpoint URL.

    A restarted run logs some steps again: the last line of each step wins (the newer attempt).
    Lines that are not JSON objects with a ``step`` (a write cut short) are skipped with a warning
    naming the file and line.
    """
    uri = metrics_uri(run_uri)
    text = _read_text(uri, store)
    if text is None:
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("step"), (int, float)) or not math.isfinite(row["step"]):
            warnings.warn(f"{uri}:{number}: skipped a line that is not a metrics record with a 'step' (an interrupted write?)")
            continue
        by_step[int(row["step"])] = row
    return [by_step[step] for step in sorted(by_step)]
