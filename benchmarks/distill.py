"""What distillation kept and what it bought: a student run of ``ctx distill`` against its teacher.

Run: ``python benchmarks/distill.py RUN`` (RUN: a ``ctx distill`` run folder or checkpoint, e.g.
``runs/minilm-l3`` after ``ctx distill --config configs/distill/minilm-l3.yaml``; 1 to 2 minutes).

- Sentence vectors kept: the mean cosine between the teacher's and the student's normalised
  mean-pooled vectors (what ``/v1/embeddings`` serves) over ``--texts`` held-out sentences of the
  bundled corpus's 8th shard (the one ``minilm-l3.yaml`` evaluates on and never trains on),
  unmasked, beside the same figure for the untrained student: the teacher's layers the recipe
  named, copied (``ctxmodels.distill.init_student``), before any step.
- Speed: sentence vectors per second of teacher and student, in-process, the same texts sorted by
  length in batches of 32 (what a serving pass runs), ``--threads`` torch threads, the two taking
  turns for ``--rounds`` rounds; medians.
- Served speed (``--serve``): each model behind ``ctx serve`` in a fresh server process of its own
  (``benchmarks/serving.py``'s: a Ray of its own, HAProxy ingress, one replica of ``--threads``
  CPUs), loaded by 8 clients sending 64 held-out sentences a request (an indexing job's batches) for
  ``--serve-seconds``; the two servers take turns for ``--rounds`` rounds, medians of texts/s.

The last lines are ``sentence_cos_student: X``, ``sentence_cos_untrained: X``,
``student_speedup: X`` and with ``--serve`` ``served_student_speedup: X``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ctxmodels.checkpoint import load_checkpoint  # noqa: E402
from ctxmodels.distill import every_other_layer, init_student, mean_pooled  # noqa: E402
from finetune_throughput import sentences  # noqa: E402 (the benchmarks' corpus reader)
from pipelines.tokenizers import load_tokenizer  # noqa: E402

HELD_OUT = 7  # the bundled corpus's shard that minilm-l3.yaml evaluates on and never trains on


@torch.inference_mode()
def vectors(model, tok, texts: list[str], batch: int = 32, max_len: int = 128) -> torch.Tensor:
    """(N, D) normalised mean-pooled last hidden states, in the texts' order."""
    ids = tok.ids_for_model(texts, max_len)
    order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
    out = torch.empty(len(texts), model.cfg.d_model)
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        width = max(len(ids[i]) for i in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):
            x[r, : len(ids[i])] = torch.as_tensor(ids[i])
            mask[r, : len(ids[i])] = 1
        last = model.backbone.hidden_states(x, mask)[-1]
        out[rows] = F.normalize(mean_pooled(last, mask), dim=-1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a ctx distill run folder or one of its checkpoints")
    parser.add_argument("--texts", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--serve", action="store_true", help="also time both behind ctx serve (see above)")
    parser.add_argument("--serve-seconds", type=float, default=15.0, help="timed load per server and round (default 15)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from jobs.runs import resolve_checkpoint

    ckpt = Path(resolve_checkpoint(args.run, None))
    state = json.loads((ckpt / "trainer_state.json").read_text())
    recipe = state.get("recipe") or {}
    teacher_ref = recipe["teacher"]["init"]
    teacher_path = Path(resolve_checkpoint(teacher_ref, None))
    teacher = load_checkpoint(teacher_path).model.eval()
    student = load_checkpoint(ckpt).model.eval()
    layers = recipe["teacher"].get("student_layers") or every_other_layer(teacher.cfg.n_layer)
    untrained = init_student(teacher, layers).eval()
    tok = load_tokenizer(ckpt / "tokenizer")
    texts = sentences(args.texts, HELD_OUT)
    print(f"teacher {teacher_ref} ({teacher.cfg.n_layer} layers), student {ckpt} ({student.cfg.n_layer} layers, "
          f"step {state.get('step')}), untrained student: teacher layers {layers}; {len(texts)} held-out sentences")

    t_vec = vectors(teacher, tok, texts)
    cos = {name: float((vectors(m, tok, texts) * t_vec).sum(-1).mean()) for name, m in (("student", student), ("untrained", untrained))}
    print(f"mean cosine to the teacher's sentence vectors: distilled student {cos['student']:.4f}, "
          f"untrained student {cos['untrained']:.4f}")

    sides = {"teacher": teacher, "student": student}
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            t0 = time.perf_counter()
            vectors(sides[name], tok, texts)
            seconds[name].append(time.perf_counter() - t0)
    rate = {k: len(texts) / statistics.median(v) for k, v in seconds.items()}
    print(f"sentence vectors per second ({args.threads} threads): teacher {rate['teacher']:,.0f}, student {rate['student']:,.0f}")
    print(f"sentence_cos_student: {cos['student']:.4f}")
    print(f"sentence_cos_untrained: {cos['untrained']:.4f}")
    print(f"student_speedup: {rate['student'] / rate['teacher']:.2f}")
    if args.serve:
        served = served_rates({"teacher": teacher_path, "student": ckpt}, texts, tok, args)
        print(f"served sentence vectors per second (ctx serve, 8 clients x 64 texts, {args.threads} CPUs): "
              f"teacher {served['teacher']:,.0f}, student {served['student']:,.0f}")
        print(f"served_student_speedup: {served['student'] / served['teacher']:.2f}")


def served_rates(folders: dict[str, Path], texts: list[str], tok, args) -> dict[str, float]:
    """Median texts/s of each model behind its own ``ctx serve`` process, the servers taking turns."""
    import asyncio
    import tempfile

    import serving  # benchmarks/serving.py: the server process, its readiness check and the load

    n_tokens = [len(ids) for ids in tok.ids_for_model(texts, 128)]
    rates: dict[str, list[float]] = {name: [] for name in folders}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-distill-"))
    me = [sys.executable, str(REPO / "benchmarks" / "serving.py")]
    for r in range(args.rounds):
        for name in (list(folders) if r % 2 == 0 else list(folders)[::-1]):
            side = serving.Side(name, "/v1/embeddings", {"normalize": True},
                                me + ["--serve-ours", "{port}", "--threads", str(args.threads), "--model-dir", str(folders[name])])
            running = serving.Running(side, log_dir, args.threads)
            try:
                running.wait_ready()
                load = asyncio.run(serving.generate_load(running, texts, n_tokens, serving.BULK_CLIENTS, args.serve_seconds,
                                                         per_request=serving.BULK_PER_REQUEST))
            finally:
                running.stop()
            if load.errors:
                raise SystemExit(f"{name}: failed requests {load.errors}:\n{running.tail()}")
            rates[name].append(load.texts / load.seconds)
            print(f"round {r + 1}/{args.rounds} served {name}: {rates[name][-1]:,.0f} texts/s", flush=True)
    return {name: statistics.median(v) for name, v in rates.items()}


if __name__ == "__main__":
    main()
