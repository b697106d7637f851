"""`ctx demo` / `make demo`: the whole path on embedded defaults, on a laptop-sized machine.

1. train a WordPiece tokenizer on the bundled WordNet corpus (7 shards; the 8th is held out),
2. pretrain a tiny BERT with dynamic masking through Ray Data + Ray Train (2 workers),
3. masked-token accuracy on the held-out shard, before and after,
4. serve the checkpoint with Ray Serve and show that "bank" gets a different vector by context.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "bert-tiny.yaml"
SENTENCES = ["we sat on the river bank and watched the water", "the bank approved the loan for the new house"]


def evaluate_mlm(model, batches) -> float:
    """Masked-token accuracy of a pretraining model over prepared (masked) NumPy batches."""
    import torch

    correct = total = 0.0
    model.eval()
    with torch.inference_mode():
        for b in batches:
            inputs = {k: torch.as_tensor(v) for k, v in b.items() if k not in ("sample_id", "epoch")}
            out = model(**inputs)
            n = float(out.metrics["n_pred"])
            correct += float(out.metrics["mlm_acc"]) * n
            total += n
    return correct / max(total, 1.0)


def main(steps: int = 300, port: int = 8000, verbose: bool = False) -> int:
    import httpx

    from ctxmodels.checkpoint import load_checkpoint
    from ctxmodels.registry import build_model
    from jobs import serve
    from jobs.config import load_recipe, model_overrides_with_vocab
    from jobs.train import pretrain, stream_spec
    from pipelines import storage
    from pipelines.dataset import local_batches
    from pipelines.tokenizers import load_tokenizer

    out = Path(tempfile.mkdtemp(prefix="ctx-demo-"))
    recipe = load_recipe(RECIPE, [f"train.max_steps={steps}", f"output_dir={out}"])
    print(f"== 1-2. tokenizer + pretraining: {recipe.model.family}/{recipe.model.preset}, {steps} steps, "
          f"{recipe.scaling.num_workers} Ray Train workers, output {out}")
    result = pretrain(recipe, verbose=verbose)
    ckpt = Path(result.checkpoint_uri)

    print("== 3. masked-token accuracy on the held-out shard")
    tok = load_tokenizer(ckpt / "tokenizer")
    eval_spec = stream_spec(recipe, storage.list_files(recipe.data.eval_input))
    batches = list(local_batches(eval_spec, tok, batch_size=32, epoch=10_000, max_batches=20))
    overrides = model_overrides_with_vocab(recipe, tok.vocab_size)
    overrides.setdefault("nsp", False)
    _, initial = build_model(recipe.model.family, recipe.model.preset, overrides, seed=recipe.train.seed)  # the trainers' initial weights
    trained = load_checkpoint(ckpt).model
    before, after = evaluate_mlm(initial, batches), evaluate_mlm(trained, batches)
    print(f"   before: {before:.1%}   after: {after:.1%}   ({sum(int((b['labels'] != -100).sum()) for b in batches):,} masked tokens)")
    from jobs.report import write_report

    report = write_report(result.run_uri, out_dir=Path("runs") / "demo-report")  # outlives the demo's temp folder
    print(f"   report (plots of loss, perplexity, throughput and MFU; data report): {report}")

    print(f"== 4. serving {ckpt.name} on http://127.0.0.1:{port}")
    serve.run({"bert-tiny": str(ckpt)}, host="127.0.0.1", port=port, blocking=False, verbose=verbose)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/token-embeddings", json={"model": "bert-tiny", "input": SENTENCES, "layers": "last"}, timeout=60)
        r.raise_for_status()
        vecs = []
        for sent, item in zip(SENTENCES, r.json()["data"]):
            i = next(i for i, (s, e) in enumerate(item["offsets"]) if sent[s:e] == "bank")
            vecs.append(np.asarray(item["embeddings"][i]))
        cos = float(vecs[0] @ vecs[1] / (np.linalg.norm(vecs[0]) * np.linalg.norm(vecs[1])))
        for sent in SENTENCES:
            print(f"   {sent!r}")
        print(f"   cosine('bank' in river sense, 'bank' in finance sense) = {cos:.3f}  (1.0 would mean one static vector)")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"model": "bert-tiny", "input": SENTENCES}, timeout=60)
        r.raise_for_status()
        print(f"   /v1/embeddings: {len(r.json()['data'])} sentence vectors of {len(r.json()['data'][0]['embedding'])} dims")
    finally:
        serve.shutdown()
    shutil.rmtree(out, ignore_errors=True)
    return 0
