"""Stop `ctx pretrain` with SIGTERM at random moments and count how it ends.

What `ctx jobs stop`, a pod's shutdown or `kill` do to a driver: the README promises status 143 with
the run lock released. The moments that break such promises are short (Ray starting, Ray Train's
`fit` starting), so this draws the signal's time after the tokenizer's line, over and over:

    python benchmarks/stop_fuzz.py --trials 20 --after 0 4                  # a local Ray per run
    python benchmarks/stop_fuzz.py --trials 20 --after 2 4.5 --address 127.0.0.1:6379   # a driver on a running head

Each trial prints the delay, the exit status (negative: the signal that killed it), the seconds
from SIGTERM to exit and whether LOCK.json was left; the last line counts the statuses. A trial
that does not exit within 60 s is killed and counted as "hung". The run is tiny (a 600-token
WordPiece vocabulary, 32-token rows), so a trial takes some 10-20 s on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CTX = Path(sys.executable).parent / "ctx"
TINY = ["--set", "data.input=data/sample/wordnet-0000-of-0008.txt.gz", "--set", "data.eval_input=null",
        "--set", "tokenizer.vocab_size=600", "--set", "tokenizer.sample_chars=100000", "--set", "data.seq_len=32",
        "--set", "model.max_seq_len=32", "--set", "train.batch_size=8", "--set", "train.warmup_steps=1",
        "--set", "train.checkpoint_every=1000", "--set", "train.max_steps=100000", "--set", "scaling.num_workers=1",
        "--set", "scaling.cpus_per_worker=0.5"]  # fmt: skip


def trial(after: float, address: str | None) -> tuple[str, float, bool, list[str]]:
    out = Path(tempfile.mkdtemp(prefix="stop-fuzz-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if address:
        env["RAY_ADDRESS"] = address
    else:
        env.pop("RAY_ADDRESS", None)
    cmd = [str(CTX), "pretrain", "--config", "configs/bert-tiny.yaml", "--no-progress", *TINY, "--set", f"output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    tokenizer_done = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if " tokens in " in line:
                tokenizer_done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not tokenizer_done.wait(180):
        proc.kill()
        raise SystemExit("no tokenizer line within 180 s:\n" + "\n".join(lines[-20:]))
    time.sleep(after)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        status: str = str(proc.wait(timeout=60))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = "hung"
    reader.join(5)
    return status, time.monotonic() - sent, (out / "bert-tiny" / "LOCK.json").exists(), lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--after", type=float, nargs=2, default=(0.0, 4.0), metavar=("MIN_S", "MAX_S"),
                        help="the signal comes this many seconds after the tokenizer's line, drawn uniformly")
    parser.add_argument("--address", help="a running Ray head's GCS address (as a job's driver sees RAY_ADDRESS); default: a local Ray per run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    draw = random.Random(args.seed)
    counts: collections.Counter[str] = collections.Counter()
    locks_left = 0
    for i in range(args.trials):
        after = draw.uniform(*args.after)
        status, took, lock_left, lines = trial(after, args.address)
        counts[status] += 1
        locks_left += lock_left
        print(f"trial {i}: signal {after:.2f} s after the tokenizer, status {status}, exit {took:.1f} s later, lock left: {lock_left}", flush=True)
        if status != "143" or lock_left:
            print("    " + "\n    ".join(line[:200] for line in lines[-12:]), flush=True)
    print(f"stop_statuses: {dict(counts.most_common())} of {args.trials}; locks left: {locks_left}")


if __name__ == "__main__":
    main()
