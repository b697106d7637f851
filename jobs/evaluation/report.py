"""``ctx report RUN``: one HTML page (plus its PNGs) that shows how a training run went.

Reads what the run left behind, wherever it lives (local, file://, s3://):

    {run}/metrics/metrics.jsonl      the logged steps (jobs/training/metrics.py)
    {run}/checkpoint_*/              trainer_state.json, config.json, model.safetensors (header only)
    data reports                     pipelines/datareport.py, when that module exists

and writes ``loss.png``, ``perplexity.png``, ``throughput.png``, ``lr.png`` (each only when the
metrics have its series) and ``index.html``, a self-contained page: the images are embedded, so it
can be mailed or copied anywhere. Every metric is optional: a run that logged only some keys gets
the plots and lines those keys allow.
"""

from __future__ import annotations

import base64
import html
import json
import math
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from jobs.training.metrics import read_metrics
from pipelines import storage
from pipelines.storage import Store, as_store

# The family's own objective, in the order train.py picks the loss behind ``ppl``.
MAIN_LOSSES = ("mlm_loss", "lm_loss", "plm_loss")
HIDDEN_ROWS = ("step", "max_steps", "time")  # not listed among the final metrics
# Held-out scores: pretraining's eval set (accuracy of the main objective) and fine-tuning's
# validation metrics (val_*, pipelines.metrics.task_metrics names).
HELD_OUT_SCORES = ["eval_acc", "val_accuracy", "val_f1", "val_exact_match"]


# ----------------------------------------------------------------------------------------------
# Reading the run
# ----------------------------------------------------------------------------------------------


# Each ``store`` below is the command's Store (its endpoint and ``--retry-deadline``), or an endpoint URL.


def _read_json(uri: str, store: Store | str | None) -> dict[str, Any] | None:
    data = as_store(store).read_bytes(uri, missing_ok=True)
    if data is None:
        return None
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise storage.StorageError(f"{uri} is not valid JSON: {e}") from e


def count_parameters(weights_uri: str, store: Store | str | None = None) -> int | None:
    """Number of stored weights of a safetensors file, from its header alone (8-byte length +
    JSON), so a remote checkpoint is not downloaded. Tied tensors are stored, and counted, once."""
    store = as_store(store)
    fs, path = store.filesystem(weights_uri)
    if store.retry(lambda: fs.get_file_info(path), f"stat {weights_uri}").type != pafs.FileType.File:
        return None

    def read_header() -> dict[str, Any]:
        with fs.open_input_file(path) as f:
            (size,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(size))

    header = store.retry(read_header, f"read {weights_uri}")
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


def list_checkpoints(run_uri: str, store: Store | str | None = None) -> list[dict[str, Any]]:
    """The run's ``checkpoint_*`` folders, oldest first: name, uri, complete (has its manifest),
    and step (from trainer_state.json, when complete)."""
    store = as_store(store)
    fs, path = store.filesystem(run_uri)
    selector = pafs.FileSelector(path, recursive=False, allow_not_found=True)
    infos = store.retry(lambda: fs.get_file_info(selector), f"list {run_uri}")
    names = sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_"))
    out = []
    for name in names:
        uri = storage.join(run_uri, name)
        manifest = storage.join(uri, "MANIFEST.json")
        complete = store.retry(lambda: fs.get_file_info(f"{path}/{name}/MANIFEST.json"), f"stat {manifest}").type == pafs.FileType.File
        state = _read_json(storage.join(uri, "trainer_state.json"), store) if complete else None
        out.append({"name": name, "uri": uri, "complete": complete, "step": (state or {}).get("step")})
    return out


def _data_reports(run_uri: str, store: Store) -> tuple[list[dict[str, Any]], str | None]:
    """([{epoch, report, text}], error): the run's per-epoch data reports (pipelines.datareport)."""
    from pipelines import datareport

    try:
        out = []
        for epoch in datareport.list_epochs(run_uri, store) or []:
            report = datareport.epoch_report(run_uri, epoch, store)
            out.append({"epoch": epoch, "report": report, "text": datareport.format_report(report)})
        return out, None
    except Exception as e:  # the rest of the report is still worth having
        print(f"report: data report of {run_uri} unavailable: {e}", file=sys.stderr)
        return [], f"{type(e).__name__}: {e}"


def _totals(report: dict[str, Any]) -> dict[str, float]:
    """read / used / rejected counts of one epoch's data report."""
    return {k: report[k] for k in ("read", "used", "rejected") if isinstance(report.get(k), (int, float))}


# ----------------------------------------------------------------------------------------------
# Plots (matplotlib's object API with the Agg canvas: no pyplot, no global backend switch)
# ----------------------------------------------------------------------------------------------


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pts], [p[1] for p in pts]


def _has(rows: list[dict[str, Any]], key: str) -> bool:
    return bool(_series(rows, key)[0])


def _figure():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    return fig, ax


def _plot(rows: list[dict[str, Any]], out: Path, name: str, title: str, left: list[str], ylabel: str,
          right: tuple[str, str, float] | None = None, log_y: bool = False, from_zero: bool = False) -> Path | None:
    """One PNG of the ``left`` series (and a ``right``-axis series: key, label, scale); None when
    the metrics have none of them."""
    left = [k for k in left if _has(rows, k)]
    if not left and not (right and _has(rows, right[0])):
        return None
    fig, ax = _figure()
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    for key in left:
        ax.plot(*_series(rows, key), label=key, linewidth=1.2)
    if log_y and left and all(v > 0 for k in left for v in _series(rows, k)[1]):
        ax.set_yscale("log")
    if from_zero:
        ax.set_ylim(bottom=0)
    if right and _has(rows, right[0]):
        key, label, scale = right
        steps, values = _series(rows, key)
        twin = ax.twinx()
        twin.plot(steps, [v * scale for v in values], color="tab:red", linewidth=1.2, label=label)
        twin.set_ylabel(label, color="tab:red")
        twin.set_ylim(bottom=0)
    if len(left) > 1:
        ax.legend(loc="best", fontsize=8)
    path = out / name
    fig.savefig(path)
    return path


def _plots(rows: list[dict[str, Any]], out: Path) -> dict[str, Path]:
    losses = ["loss"] + sorted({k for r in rows for k in r if k.endswith("_loss")}, key=lambda k: (k not in MAIN_LOSSES, k))
    made = {
        "loss": _plot(rows, out, "loss.png", "Loss", losses, "loss (nats)"),
        "perplexity": _plot(rows, out, "perplexity.png", "Perplexity of the main objective (training, held out)", ["ppl", "eval_ppl"], "perplexity", log_y=True),
        "held_out": _plot(rows, out, "held_out.png", "Held-out metrics", HELD_OUT_SCORES + sorted({k for r in rows for k in r if k.startswith("val_")} - set(HELD_OUT_SCORES) - {"val_loss"}),
                          "score"),
        "throughput": _plot(rows, out, "throughput.png", "Throughput", ["tokens_per_s"], "tokens / s", right=("mfu", "MFU (%)", 100.0),
                            from_zero=True),
        "lr": _plot(rows, out, "lr.png", "Learning rate", ["lr"], "learning rate"),
    }
    return {k: v for k, v in made.items() if v is not None}


# ----------------------------------------------------------------------------------------------
# Page
# ----------------------------------------------------------------------------------------------


def fmt_num(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "—" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    return f"{value:,.{digits}g}" if abs(value) < 1e6 else f"{value:,.0f}"


def _count(n: int | None) -> str:
    if n is None:
        return "—"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit} ({n:,})"
    return f"{n:,}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def html_table(pairs: list[tuple[str, str]]) -> str:
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in pairs)
    return f"<table>{rows}</table>"


def summarize(rows: list[dict[str, Any]], state: dict[str, Any] | None, config: dict[str, Any] | None,
              n_params: int | None, run_uri: str) -> list[tuple[str, str]]:
    """(label, value) lines of the summary table; only what the run recorded."""
    recipe = (state or {}).get("recipe") or {}
    model = recipe.get("model") or {}
    last = rows[-1] if rows else {}
    family = model.get("family") or (config or {}).get("family")
    pairs = [("run", recipe.get("name") or run_name(run_uri)), ("location", run_uri)]
    if family:
        pairs.append(("model", f"{family} / {model.get('preset', '?')}" if model.get("preset") else family))
    if n_params is not None:
        pairs.append(("parameters", _count(n_params)))
    step = last.get("step", (state or {}).get("step"))
    max_steps = last.get("max_steps") or (recipe.get("train") or {}).get("max_steps")
    if step is not None:
        pairs.append(("steps", f"{step:,} / {max_steps:,}" if isinstance(max_steps, int) else f"{step:,}"))
    for key, label in (("epoch", "epoch"), ("tokens_seen", "tokens seen"), ("samples_seen", "samples seen")):
        value = last.get(key, (state or {}).get(key))
        if value is not None:
            pairs.append((label, fmt_num(value)))
    times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
    if len(times) > 1:
        pairs.append(("wall time logged", _duration(times[-1] - times[0])))
    if "loss" in last:
        pairs.append(("final loss", fmt_num(last["loss"])))
    main = next((k for k in MAIN_LOSSES if k in last), None)
    if main:
        pairs.append((f"final {main}", fmt_num(last[main])))
    if "ppl" in last:
        pairs.append(("final perplexity", fmt_num(last["ppl"])))
    for key in sorted(k for k in last if k.endswith("_acc") and not k.startswith("eval_")):
        pairs.append((f"final {key}", fmt_num(last[key])))
    held = next((r for r in reversed(rows) if "eval_loss" in r), None)
    if held is not None:  # pretraining's held-out evaluation (data.eval_input)
        pairs.append(("held-out loss", f"{fmt_num(held['eval_loss'])} (step {held['step']:,}, {fmt_num(held.get('eval_samples'))} samples)"))
        for key, label in (("eval_ppl", "held-out perplexity"), ("eval_acc", "held-out accuracy")):
            if key in held:
                pairs.append((label, fmt_num(held[key])))
    val = next((r for r in reversed(rows) if any(k.startswith("val_") for k in r)), None)
    if val is not None:  # fine-tuning's validation split
        shown = ", ".join(f"{k[4:]} {fmt_num(v)}" for k, v in sorted(val.items()) if k.startswith("val_") and isinstance(v, (int, float)))
        pairs.append(("last validation", f"{shown} (step {val['step']:,})"))
    best = (state or {}).get("best_score")
    if best is not None:
        pairs.append(("best validation score", f"{fmt_num(best)} at step {fmt_num((state or {}).get('best_step'))}"))
    _, tps = _series(rows, "tokens_per_s")
    if tps:
        pairs.append(("best throughput", f"{max(tps):,.0f} tokens/s (last {tps[-1]:,.0f})"))
    _, mfu = _series(rows, "mfu")
    if mfu:
        pairs.append(("MFU", f"best {100 * max(mfu):.1f}%, last {100 * mfu[-1]:.1f}%"))
    _, wait = _series(rows, "data_wait")
    if wait:
        pairs.append(("data wait", f"mean {100 * sum(wait) / len(wait):.1f}% of step time, last {100 * wait[-1]:.1f}%"))
    return pairs


def run_name(run_uri: str) -> str:
    return run_uri.rstrip("/").rsplit("/", 1)[-1] or "run"


def default_out_dir(run_uri: str) -> Path:
    """``<run>/report`` for a local run, ``./report-<name>`` for an object-store one."""
    if storage.is_remote(run_uri):
        return Path.cwd() / f"report-{run_name(run_uri)}"
    return Path(storage.filesystem(run_uri)[1]) / "report"


PAGE_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; } th, td { text-align: left; padding: 0.2em 1em 0.2em 0; vertical-align: top; }
th { font-weight: 600; white-space: nowrap; } img { max-width: 100%; } pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; }
.muted { color: #777; }
"""


def render_html(summary: list[tuple[str, str]], images: dict[str, Path], data: list[dict[str, Any]],
                data_error: str | None, checkpoints: list[dict[str, Any]], title: str) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{PAGE_STYLE}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             f"<p class='muted'>report written {html.escape(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>",
             "<h2>Summary</h2>", html_table(summary)]
    parts.append("<h2>Curves</h2>")
    if not images:
        parts.append("<p class='muted'>no metrics logged (no metrics/metrics.jsonl)</p>")
    for key, path in images.items():
        data_uri = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(f"<p><img alt='{html.escape(key)}' src='data:image/png;base64,{data_uri}'></p>")
    if data or data_error:
        parts.append("<h2>Data</h2>")
        if data_error:
            parts.append(f"<p class='muted'>data report unavailable: {html.escape(data_error)}</p>")
        totals: dict[str, float] = {}
        for item in data:
            for k, v in _totals(item["report"]).items():
                totals[k] = totals.get(k, 0) + v
        if totals:
            parts.append(html_table([(f"{k} (all epochs)", fmt_num(v)) for k, v in totals.items()]))
        for item in data:
            parts.append(f"<h3>epoch {html.escape(str(item['epoch']))}</h3><pre>{html.escape(str(item['text']))}</pre>")
    parts.append("<h2>Checkpoints</h2>")
    if checkpoints:
        rows = "".join(
            f"<tr><td>{html.escape(c['name'])}</td><td>{fmt_num(c['step'])}</td>"
            f"<td>{'complete' if c['complete'] else 'incomplete (no MANIFEST.json)'}</td><td>{html.escape(c['uri'])}</td></tr>"
            for c in checkpoints
        )
        parts.append(f"<table><tr><th>name</th><th>step</th><th>state</th><th>location</th></tr>{rows}</table>")
    else:
        parts.append("<p class='muted'>none yet</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(run_uri: str, out_dir: str | Path | None = None, store: Store | str | None = None) -> Path:
    """Write the report of the run at ``run_uri`` (``<output_dir>/<name>``); returns index.html.
    ``store``: where and how long to wait for the run's store (``ctx report --retry-deadline``).

    Raises StorageError naming the URI when there is no run there: no metrics and no checkpoint.
    """
    store = as_store(store)
    if not store.exists(run_uri):
        raise storage.StorageError(f"no run at {run_uri!r}: the folder does not exist (give <output_dir>/<name> of a pretraining run)")
    rows = read_metrics(run_uri, store)
    checkpoints = list_checkpoints(run_uri, store)
    if not rows and not checkpoints:
        raise storage.StorageError(
            f"no run at {run_uri!r}: it has neither metrics/metrics.jsonl nor a checkpoint_* folder "
            "(has training logged a step yet?)"
        )
    latest = store.latest_complete_checkpoint(run_uri)
    state = config = n_params = None
    if latest is not None:
        state = _read_json(storage.join(latest, "trainer_state.json"), store)
        config = _read_json(storage.join(latest, "config.json"), store)
        n_params = count_parameters(storage.join(latest, "model.safetensors"), store)
    out = Path(out_dir) if out_dir is not None else default_out_dir(run_uri)
    out.mkdir(parents=True, exist_ok=True)
    images = _plots(rows, out)
    data, data_error = _data_reports(run_uri, store)
    summary = summarize(rows, state, config, n_params, run_uri)
    title = f"Training report: {summary[0][1]}"
    index = out / "index.html"
    index.write_text(render_html(summary, images, data, data_error, checkpoints, title), encoding="utf-8")
    return index
