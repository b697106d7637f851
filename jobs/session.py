"""The Ray session of a ``ctx`` command: started quiet, stopped with everything it started, and
SIGTERM turned into ``SystemExit(143)`` so ``finally`` blocks run.

Training (``jobs.training``), serving's ``ctx embed`` (``jobs.serving.embed``), evaluation and the
demo all start Ray here; nothing in it knows what the session is for.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from functools import partial


def init_ray(verbose: bool = False, num_cpus: int | None = None) -> None:
    """Connect to the cluster in RAY_ADDRESS (set inside `ctx submit` jobs) or start a local one,
    with ``num_cpus`` logical CPUs (default: the machine's cores)."""
    import ray

    if ray.is_initialized():
        return
    quiet = {} if verbose else {"log_to_driver": False, "logging_level": "ERROR"}
    local = not os.environ.get("RAY_ADDRESS")
    before = {p.pid for p in _descendants()} if local else set()
    dropped: list[SystemExit] = []
    unraisable = sys.unraisablehook
    sys.unraisablehook = partial(_keep_dropped_exits, dropped, unraisable)
    try:
        if local:
            ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, **quiet)
        else:
            ray.init(**quiet)
        if dropped:
            raise dropped[0]
    except BaseException as e:
        if local:
            # what ray.init started: ray.shutdown knows of it only once ray.init has built its node,
            # and the rest would die of SIGKILL (Ray's parent-death signal) when the driver exits
            _shutdown_local_ray(before)
        # SIGTERM while Ray starts: ray.init's own handler, in place for the call, raises
        # SystemExit(15) (6 of 10 SIGTERMs timed after the tokenizer, local Ray); the shell's 143
        # as everywhere else
        if isinstance(e, SystemExit) and e.code in (signal.SIGTERM, 128 + signal.SIGTERM):
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    finally:
        sys.unraisablehook = unraisable
    if local:
        atexit.register(_shutdown_local_ray, before)  # runs before Ray's own atexit shutdown (registered at import)
    exit_on_sigterm()  # ray.init put its own SIGTERM handler in place
    if not verbose:
        quiet_ray_data()


def _keep_dropped_exits(dropped: list[SystemExit], unraisable, event) -> None:
    """``sys.unraisablehook`` while ``ray.init`` runs. ray.init starts Ray's processes with
    ``subprocess.Popen``, and after each fork Python runs the parent's at-fork hooks (logging's
    ``_releaseLock``) where an exception cannot propagate: a SIGTERM whose handler ran there raised
    SystemExit that Python printed as "Exception ignored" and dropped, and the command trained on
    (`ctx pretrain --no-progress` on 2 cores: 2 of 23 SIGTERMs drawn 0-6 s after its tokenizer's line,
    both at the same 0.76 s draw, and 1 of 10 at 0.74-0.78 s; after, none of 20 and none of 10). Kept
    here and raised once ray.init returns; other unraisable exceptions go where they went."""
    if isinstance(event.exc_value, SystemExit):
        dropped.append(event.exc_value)
    else:
        unraisable(event)


def _descendants():
    """This process's children, theirs, and so on (psutil.Process objects, which know a reused pid)."""
    import psutil  # Ray's own copy, on the path once ray is imported (as ray._private.process_watcher imports it)

    return psutil.Process().children(recursive=True)


def stop_processes(procs, grace_s: float = 1.0) -> None:
    """SIGTERM to each of ``procs`` still running, SIGKILL to those left after ``grace_s`` (Ray gives
    its own processes a second: a raylet stopped while it is starting takes longer)."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _shutdown_local_ray(before: set[int]) -> None:
    """At exit: ``ray.shutdown`` and then the processes of the local Ray it left running.

    ``ray.shutdown`` stops the raylet and GCS it started, but a raylet that does not leave within
    its second of grace (one stopped while it is still starting) is killed, and its DashboardAgent
    and RuntimeEnvAgent then stay for a minute: they report the raylet's death to a GCS that is gone
    too (Ray looks for "Raylet received SIGTERM" in its log, which Ray 2.60's raylet no longer
    writes). A raylet's children are re-parented once it dies, so they are listed before it stops.
    Measured with SIGTERM 0-3 s or 0-6 s after the tokenizer's line of `ctx pretrain`: agents left
    behind in 8 of 20 stops before, in none of 42 after."""
    import ray

    started = [p for p in _descendants() if p.pid not in before]
    ray.shutdown()
    stop_processes(started)


def exit_on_sigterm() -> None:
    """SIGTERM (`ctx jobs stop`, a pod's shutdown, `kill`) raises SystemExit(143), so `finally` blocks
    run (the run lock released, temporary folders removed) and the status is the shell's for SIGTERM.
    By default SIGTERM kills the process with the lock still held; after ``ray.init`` Ray's C++ failure
    handler has it, which lets Python's handler run and then ends the process with a status of its own
    (15, or an abort's 134), so it is set again after ``ray.init``. Only the main thread can set it."""
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def quiet_ray_data() -> None:
    """Ray Data's own lines off this process's console: "Starting execution of Dataset ...", its
    execution plan, "... execution finished", and the progress board it logs line by line when stdout
    is not a terminal (``ray.data._internal.progress.logging_progress``). ``import ray.data`` gives the
    "ray.data" logger its own console handler at INFO, not propagating to "ray"
    (``ray.data._internal.logging.configure_logging``), so ray.init's logging_level does not reach
    them. Only that handler is raised to ERROR: the session's ray-data.log keeps everything. On a
    terminal the progress bars stay (they are drawn, not logged)."""
    import logging
    import sys

    import ray.data

    for handler in logging.getLogger("ray.data").handlers:
        if handler.name == "console":
            handler.setLevel(logging.ERROR)
    if not sys.stdout.isatty():
        ray.data.DataContext.get_current().enable_progress_bars = False


def clock(seconds: float) -> str:
    """``seconds`` as ``h:mm:ss`` (``mm:ss`` under an hour): how a command's progress line shows time left."""
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"
