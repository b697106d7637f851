"""The HTML page ``ctx eval`` writes beside its JSON: metrics, a confusion matrix picture for
classification and multiple choice, per-tag precision/recall/F1 for tagging.

``result`` is the dict ``ctx eval`` prints: ``metrics`` (name -> number), and optionally
``confusion_matrix`` ``{"labels": [...], "matrix": [[...]]}`` (rows: reference, columns:
prediction) and ``per_tag`` ``{tag: {"precision", "recall", "f1", "support"}}``. The page is
self-contained (the picture is embedded), like ``ctx report``'s.
"""

from __future__ import annotations

import base64
import html
import io
import time
from pathlib import Path
from typing import Any

from jobs.evaluation.report import PAGE_STYLE, fmt_num, html_table


def confusion_png(labels: list[str], matrix: list[list[int]]) -> bytes:
    """A confusion matrix as a PNG: counts in the cells, row-normalised colours (recall per class)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    m = np.asarray(matrix, dtype=np.float64)  # (n, n) rows: reference, columns: prediction
    n = len(labels)
    size = min(3.0 + 0.45 * n, 16.0)
    fig = Figure(figsize=(size, size), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    rows = m.sum(axis=1, keepdims=True)
    ax.imshow(np.divide(m, rows, out=np.zeros_like(m), where=rows > 0), cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(n), labels=labels, rotation=90, fontsize=8)
    ax.set_yticks(range(n), labels=labels, fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("reference")
    if n <= 30:  # counts stay legible up to about this many classes
        for i in range(n):
            for j in range(n):
                if m[i, j]:
                    share = m[i, j] / rows[i, 0]
                    ax.text(j, i, f"{int(m[i, j])}", ha="center", va="center", fontsize=7, color="white" if share > 0.5 else "black")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def render_eval_page(result: dict[str, Any], title: str) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{PAGE_STYLE}</style></head><body>", f"<h1>{html.escape(title)}</h1>",
             f"<p class='muted'>written {html.escape(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>"]
    about = [(k, str(result[k])) for k in ("model", "data", "task", "examples") if k in result]
    if about:
        parts += ["<h2>What</h2>", html_table(about)]
    parts += ["<h2>Metrics</h2>", html_table([(k, fmt_num(v)) for k, v in result.get("metrics", {}).items()])]
    cm = result.get("confusion_matrix")
    if cm:
        png = base64.b64encode(confusion_png(cm["labels"], cm["matrix"])).decode("ascii")
        parts += ["<h2>Confusion matrix</h2>", f"<p><img alt='confusion matrix' src='data:image/png;base64,{png}'></p>"]
    per_tag = result.get("per_tag")
    if per_tag:
        rows = "".join(
            f"<tr><td>{html.escape(tag)}</td><td>{fmt_num(s.get('precision'))}</td><td>{fmt_num(s.get('recall'))}</td>"
            f"<td>{fmt_num(s.get('f1'))}</td><td>{fmt_num(s.get('support'))}</td></tr>"
            for tag, s in sorted(per_tag.items())
        )
        parts += ["<h2>Per tag</h2>", f"<table><tr><th>tag</th><th>precision</th><th>recall</th><th>F1</th><th>support</th></tr>{rows}</table>"]
    parts.append("</body></html>")
    return "\n".join(parts)


def write_eval_page(result: dict[str, Any], path: str | Path, title: str = "evaluation") -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_eval_page(result, title), encoding="utf-8")
    return out
