"""What XLM's translation LM buys: cross-lingual sentence retrieval after MLM alone and after MLM + TLM.

Run: ``python benchmarks/xlm_alignment.py`` (defaults: 1,500 steps a model; a few minutes on 2 cores).

Lample & Conneau (2019, sec. 3.3) add TLM to MLM so that a masked word of one language can be read
off its translation, which aligns the languages' representations. ``data/`` holds one language, so
the second ("xx") is English spelt backwards word by word: the same grammar, a vocabulary of its
own (words that read the same both ways aside). The two models differ only in their data:

- monolingual text for MLM: English from the bundled shards 0-1 and xx made from shards 2-3, so
  the two languages' monolingual corpora are not translations of each other;
- ``mlm``: batches alternate English and xx masked-LM rows;
- ``mlm+tlm``: batches alternate English, xx, and translation rows of shard 4's sentences paired
  with their xx (``data.translations``' rows; XLM alternates its objectives batch by batch too).

Both are tiny XLMs (``--d-model``, ``--layers``) from the same initial weights, with the same
tokenizer (trained on both languages), steps, batch and learning rate. Measured on ``--pairs``
held-out sentences of shard 7, seen by neither: each xx sentence's vector (its last layer's mean
over real tokens, language id xx) retrieves the nearest English vector by cosine among all of them
(P@1, and the other way; also with each language's mean vector taken off first), and each language's masked-token accuracy on held-out rows, so that
alignment is not bought with worse language modelling. Chance is 1 / ``--pairs``.

Then XLM's cross-lingual transfer (sec. 5.1, XNLI's setting): each model is fine-tuned (``--ft-steps``)
to classify WordNet glosses by lexicographer file (``data/tasks/lexname``, 20 classes) on English
training glosses only, its texts read as language en (``task.language``), and scored on the
validation glosses in English and, zero-shot, spelt backwards and read as xx. Both fine-tunings start
from the same head weights and draw the same batches.

The last lines are ``mlm_p_at_1: X``, ``mlm_tlm_p_at_1: X`` (xx -> en) and ``tlm_gain: X`` (their
difference), then ``mlm_transfer_xx: X``, ``mlm_tlm_transfer_xx: X`` (xx validation accuracy of the
English-trained classifier) and ``tlm_transfer_gain: X``.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ctxmodels.registry import build_model  # noqa: E402
from ctxmodels.tasks import TaskConfig, TaskModel, load_backbone  # noqa: E402
from jobs.training.loop import param_groups  # noqa: E402
from pipelines.dataset import StreamSpec, local_batches  # noqa: E402
from pipelines.masking import MlmConfig  # noqa: E402
from pipelines.sources import iter_documents, sample_text  # noqa: E402
from pipelines.tokenizers import Tokenizer, train_tokenizer  # noqa: E402

SHARDS = sorted(str(p) for p in (REPO / "data" / "sample").glob("*.txt.gz"))
LEXNAME = REPO / "data" / "tasks" / "lexname"
KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels")


def backwards(line: str) -> str:
    return " ".join(w[::-1] for w in line.split(" "))


def sentences(shard: str) -> list[str]:
    return [s for chunk in iter_documents(shard) for doc in chunk for s in doc.split("\n") if s.strip()]


def write_corpus(root: Path) -> dict[str, Any]:
    """English and xx monolingual shards, the parallel pairs, and the held-out sentences."""
    en, xx, pairs = root / "en.txt.gz", root / "xx.txt.gz", root / "en-xx.jsonl"
    with gzip.open(en, "wt") as f:
        f.write("\n".join(s for shard in SHARDS[0:2] for s in sentences(shard)) + "\n")
    with gzip.open(xx, "wt") as f:
        f.write("\n".join(backwards(s) for shard in SHARDS[2:4] for s in sentences(shard)) + "\n")
    pairs.write_text("".join(json.dumps({"en": s, "xx": backwards(s)}) + "\n" for s in sentences(SHARDS[4])))
    return {"en": str(en), "xx": str(xx), "pairs": str(pairs), "held_out": sentences(SHARDS[7])}


def batches(spec: StreamSpec, tok: Tokenizer, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """One source's masked batches, epoch after epoch (each epoch masks anew)."""
    return itertools.chain.from_iterable(local_batches(spec, tok, batch_size, epoch=e) for e in itertools.count())


def train(model: torch.nn.Module, sources: list[Iterator[dict[str, np.ndarray]]], steps: int, lr: float) -> float:
    """``steps`` AdamW steps, one batch of each source in turn; returns the seconds taken."""
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=lr, betas=(0.9, 0.98))
    model.train()
    t0 = time.perf_counter()
    for step, source in zip(range(steps), itertools.cycle(sources)):
        batch = next(source)
        warm = min(1.0, (step + 1) / (steps // 10 + 1))  # linear warm-up over the first tenth
        for group in opt.param_groups:
            group["lr"] = lr * warm
        out = model(**{k: torch.as_tensor(batch[k]) for k in KEYS if k in batch})
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return time.perf_counter() - t0


def encode(tok: Tokenizer, texts: list[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), (N, seq_len): ``[CLS] s [SEP]`` per text, cut to fit, right-padded."""
    ids = tok.encode_batch(texts)
    rows = np.full((len(ids), seq_len), tok.pad_id, dtype=np.int64)
    for k, s in enumerate(ids):
        s = s[: seq_len - 2]
        rows[k, : len(s) + 2] = [tok.cls_id, *s, tok.sep_id]
    x = torch.as_tensor(rows)
    return x, (x != tok.pad_id).long()


@torch.no_grad()
def sentence_vectors(model: torch.nn.Module, tok: Tokenizer, texts: list[str], language: int, seq_len: int) -> torch.Tensor:
    """(N, D) unit vectors: the last layer's mean over each sentence's real tokens, ``[CLS] s [SEP]``."""
    model.eval()
    out = []
    for i in range(0, len(texts), 128):
        x, mask = encode(tok, texts[i : i + 128], seq_len)
        h = model.backbone.hidden_states(x, mask, torch.full_like(x, language) * mask)[-1]  # (B, T, D)
        v = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        out.append(torch.nn.functional.normalize(v, dim=-1))
    return torch.cat(out)


def p_at_1(queries: torch.Tensor, keys: torch.Tensor) -> float:
    """Share of queries whose nearest key (cosine) is their own translation (row i <-> row i)."""
    return float((queries @ keys.T).argmax(1).eq(torch.arange(len(queries))).float().mean())


def centred(v: torch.Tensor) -> torch.Tensor:
    """Unit vectors less their language's mean vector, normalised again: what is left once the
    direction every sentence of a language shares is removed."""
    return torch.nn.functional.normalize(v - v.mean(0, keepdim=True), dim=-1)


@torch.no_grad()
def masked_accuracy(model: torch.nn.Module, spec: StreamSpec, tok: Tokenizer, n_batches: int = 4) -> float:
    model.eval()
    accs = [model(**{k: torch.as_tensor(b[k]) for k in KEYS if k in b}).metrics["mlm_acc"].item()
            for b in itertools.islice(local_batches(spec, tok, 64, epoch=99), n_batches)]
    return float(np.mean(accs))


def transfer(pretrained: torch.nn.Module, tok: Tokenizer, seq_len: int, steps: int, seed: int, lr: float = 1e-3,
             batch_size: int = 32) -> dict[str, float]:
    """Fine-tune on English lexname glosses (language en), score English and backwards (xx) validation.
    The global RNG (dropout's draws) is left as it was, so the models trained after this one are not
    moved by it."""
    with torch.random.fork_rng(devices=[]):
        return _transfer(pretrained, tok, seq_len, steps, seed, lr, batch_size)


def _transfer(pretrained: torch.nn.Module, tok: Tokenizer, seq_len: int, steps: int, seed: int, lr: float,
              batch_size: int) -> dict[str, float]:
    split = {name: [json.loads(line) for line in (LEXNAME / f"{name}.jsonl").read_text().splitlines()] for name in ("train", "validation")}
    labels = sorted({r["label"] for r in split["train"]})
    x, mask = encode(tok, [r["sentence1"] for r in split["train"]], seq_len)
    y = torch.tensor([labels.index(r["label"]) for r in split["train"]])
    model = TaskModel("xlm", pretrained.cfg, TaskConfig(kind="classification", num_labels=len(labels), labels=labels, language=0),
                      torch.Generator().manual_seed(seed))  # the same head weights for every pretrained model
    load_backbone(model, pretrained)
    opt = torch.optim.AdamW(param_groups(model, 0.01), lr=lr)
    draws = torch.Generator().manual_seed(seed)  # the same batches for every pretrained model
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(y), (batch_size,), generator=draws)
        loss = model(x[pick], mask[pick], labels=y[pick]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    gold = torch.tensor([labels.index(r["label"]) if r["label"] in labels else -1 for r in split["validation"]])
    out = {"majority": float(gold.eq(gold.mode().values).float().mean())}
    for name, row, texts in (("en", 0, [r["sentence1"] for r in split["validation"]]),
                             ("xx", 1, [backwards(r["sentence1"]) for r in split["validation"]])):
        model.task.language = row  # every token read as this language: XLM's zero-shot transfer
        vx, vmask = encode(tok, texts, seq_len)
        with torch.no_grad():
            out[f"transfer_{name}_acc"] = float(model(vx, vmask).logits.argmax(-1).eq(gold).float().mean())
    return out


def run(steps: int = 1500, seed: int = 0, pairs: int = 500, seq_len: int = 64, batch_size: int = 32, lr: float = 2e-3,
        d_model: int = 128, layers: int = 4, vocab: int = 4000, ft_steps: int = 400, log=print) -> dict[str, dict[str, float]]:
    """Train both models and measure them (module docstring); {"mlm": {...}, "mlm+tlm": {...}}."""
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="xlm-align-") as d:
        corpus = write_corpus(Path(d))
        tok = train_tokenizer("wordpiece", sample_text([corpus["en"], corpus["xx"]], 2_000_000), vocab)
        mlm = MlmConfig(mlm_probability=0.15)
        mono = [StreamSpec(shards=(corpus[name],), seq_len=seq_len, seed=seed, shard_languages=(i,), mlm=mlm)
                for i, name in enumerate(("en", "xx"))]
        tlm = StreamSpec(shards=(corpus["pairs"],), seq_len=seq_len, seed=seed, objective="tlm", language_names=("en", "xx"), mlm=mlm)
        rng = np.random.default_rng(seed)
        held = [corpus["held_out"][i] for i in rng.choice(len(corpus["held_out"]), size=pairs, replace=False)]
        held_specs = []
        for i, name in enumerate(("en", "xx")):
            path = Path(d) / f"held-{name}.txt.gz"
            with gzip.open(path, "wt") as f:
                f.write("\n".join(held if name == "en" else [backwards(s) for s in held]) + "\n")
            held_specs.append(StreamSpec(shards=(str(path),), seq_len=seq_len, seed=seed, shard_languages=(i,), mlm=mlm))
        overrides = {"vocab_size": tok.vocab_size, "type_vocab_size": 2, "max_seq_len": seq_len, "d_model": d_model,
                     "n_layer": layers, "n_head": max(2, d_model // 64), "d_ff": 4 * d_model}
        results = {}
        for name, sources in (("mlm", mono), ("mlm+tlm", [*mono, tlm])):
            _, model = build_model("xlm", "tiny", overrides, seed=seed)  # the same initial weights for both
            seconds = train(model, [batches(s, tok, batch_size) for s in sources], steps, lr)
            en = sentence_vectors(model, tok, held, 0, seq_len)
            xx = sentence_vectors(model, tok, [backwards(s) for s in held], 1, seq_len)
            results[name] = {
                "p_at_1_xx_en": p_at_1(xx, en), "p_at_1_en_xx": p_at_1(en, xx),
                "centred_p_at_1_xx_en": p_at_1(centred(xx), centred(en)),
                "mlm_acc_en": masked_accuracy(model, held_specs[0], tok), "mlm_acc_xx": masked_accuracy(model, held_specs[1], tok),
                "train_s": seconds,
                **transfer(model, tok, seq_len, ft_steps, seed),  # (on a forked RNG: the next model trains as without it)
            }
            log(f"{name:8s} " + "  ".join(f"{k} {v:.3f}" for k, v in results[name].items()))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pairs", type=int, default=500, help="held-out sentence pairs to retrieve among")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ft-steps", type=int, default=400, help="fine-tuning steps of the transfer test")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; {args.steps} steps a model, chance P@1 {1 / args.pairs:.3f}")
    r = run(args.steps, args.seed, args.pairs, args.seq_len, d_model=args.d_model, layers=args.layers, ft_steps=args.ft_steps)
    print(f"mlm_p_at_1: {r['mlm']['p_at_1_xx_en']:.3f}")
    print(f"mlm_tlm_p_at_1: {r['mlm+tlm']['p_at_1_xx_en']:.3f}")
    print(f"tlm_gain: {r['mlm+tlm']['p_at_1_xx_en'] - r['mlm']['p_at_1_xx_en']:.3f}")
    print(f"mlm_transfer_xx: {r['mlm']['transfer_xx_acc']:.3f}")
    print(f"mlm_tlm_transfer_xx: {r['mlm+tlm']['transfer_xx_acc']:.3f}")
    print(f"tlm_transfer_gain: {r['mlm+tlm']['transfer_xx_acc'] - r['mlm']['transfer_xx_acc']:.3f}")


if __name__ == "__main__":
    main()
