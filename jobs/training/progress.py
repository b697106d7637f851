"""Rank-0 progress shown on the driver.

Ray Train's callbacks run in its controller actor, not in the driver the user watches, so rank 0
pushes its aggregated metrics to a zero-CPU actor and the driver polls it while ``fit()`` runs
in a thread. (Ray seam: this is the only cross-process channel we add, and it is a Ray actor.)
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import ray

from jobs.session import clock


@ray.remote(num_cpus=0)
class ProgressBoard:
    def __init__(self) -> None:
        self.latest: dict[str, Any] | None = None
        self.logged: list[dict[str, Any]] = []

    def update(self, metrics: dict[str, Any]) -> None:
        self.latest = metrics
        self.logged.append(metrics)

    def get(self) -> dict[str, Any] | None:
        return self.latest

    def history(self) -> list[dict[str, Any]]:
        """Every metrics dict rank 0 logged, in order (a restarted run logs its steps again)."""
        return self.logged


# Held-out metrics shown on the line when a step carries them: pretraining's eval set
# (jobs/training/train.py) and fine-tuning's validation split (jobs/training/finetune.py).
HELD_OUT = ("eval_loss", "eval_ppl", "eval_acc", "val_loss", "val_accuracy", "val_f1", "val_exact_match", "val_pearson")


def describe(m: dict[str, Any]) -> str:
    """One line: step/max, loss, accuracies, held-out metrics, tokens/s, MFU and data-wait share
    (fractions, shown as percentages) when the metrics carry them, ETA. Missing keys are left out."""
    parts = [f"step {m.get('step', '?')}/{m.get('max_steps', '?')}"]
    if m.get("loss") is not None:
        parts.append(f"loss {m['loss']:.3f}")
    for key in ("mlm_acc", "lm_acc"):
        if m.get(key) is not None:
            parts.append(f"{key} {m[key]:.3f}")
    if m.get("ppl") is not None:
        parts.append(f"ppl {m['ppl']:.1f}")
    held = [f"{k.split('_', 1)[1]} {m[k]:.{1 if k == 'eval_ppl' else 3}f}" for k in HELD_OUT if isinstance(m.get(k), (int, float))]
    if held:
        parts.append(("eval " if any(k.startswith("eval_") and k in m for k in HELD_OUT) else "val ") + " ".join(held))
    if m.get("tokens_per_s") is not None:
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if m.get("data_wait") is not None:
        parts.append(f"data wait {100 * m['data_wait']:.0f}%")
    if m.get("bad_steps"):  # steps skipped for a non-finite loss or gradient norm: rare, so shown only then
        parts.append(f"skipped {m['bad_steps']} non-finite step{'s' if m['bad_steps'] != 1 else ''}")
    if m.get("eta_s") is not None:
        parts.append(f"ETA {clock(m['eta_s'])}")
    return " | ".join(parts)


FIT_THREAD = "ctx-fit"  # the thread ``run_with_progress`` waits in


def fit_running() -> bool:
    """Whether a ``run_with_progress`` thread is still inside Ray Train's ``fit``: only after the
    caller was interrupted (SIGTERM, Ctrl-C) while it ran. That thread waits in ``ray.get``, which
    nothing but the run's end releases (not ``ray.shutdown``), and which takes the GIL every so often
    to check for signals: a process that finalizes Python around it crashes (SIGSEGV in
    ``PyGILState_Ensure``) instead of exiting with its status. ``jobs.cli.main`` ends such a process
    without finalizing."""
    return any(t.name == FIT_THREAD and t.is_alive() for t in threading.enumerate())


def run_with_progress(fit: Callable[[], Any], board: Any, max_steps: int, enabled: bool = True, label: str = "pretrain") -> Any:
    """Run ``fit`` in a thread and render the board's latest metrics until it returns; ``label``
    opens each line (the command: pretrain, finetune)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fit()
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name=FIT_THREAD, daemon=True)
    thread.start()
    if enabled and not sys.stdout.isatty():  # job logs, CI: one plain line per logged step
        shown = -1
        while thread.is_alive():
            thread.join(timeout=1.0)
            latest = ray.get(board.get.remote())
            if latest and latest["step"] != shown:
                shown = latest["step"]
                print(f"{label}: {describe(latest)}", flush=True)
    elif enabled:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn(f"[bold]{label}"), BarColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=False) as bar:
            task = bar.add_task("starting Ray Train workers...", total=max_steps)
            while thread.is_alive():
                thread.join(timeout=0.5)
                latest = ray.get(board.get.remote())
                if latest:
                    bar.update(task, completed=latest["step"], description=describe(latest))
    # Timed joins only: a signal the OS hands to another thread runs its Python handler when the main
    # thread next wakes, which an untimed join does not do before Ray Train returns
    while thread.is_alive():
        thread.join(timeout=0.5)
    if "error" in box:
        raise box["error"]
    return box.get("result")
