"""``ctx eval wic --model URI``: the word-in-context test on a model's contextual vectors.

For each pair of sentences that share a target word (``data/tasks/wic``: ``sentence1``,
``sentence2``, ``label`` 1 = same WordNet sense, and the target's character spans ``start1``,
``end1``, ``start2``, ``end2``), the word's vector in each sentence is the mean of its sub-token
vectors under a feature strategy (``last``, ``sum-last-four``, ``scalar-mix`` with equal weights,
...), and the two vectors' cosine is compared with one threshold fit on the development split
(Pilehvar & Camacho-Collados 2019). The same is done with the model's context-free input layer
(hidden state 0 of the word encoded alone, with no sentence around it): the gap between the two is
what context adds. Runs in-process on CPU; no Ray.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from pipelines.sources import json_lines
from pipelines.storage import Store, as_store
from pipelines.wic import accuracy_at, cosine_rows, fit_threshold

STRATEGIES = ("first", "last", "second-to-last", "sum-last-four", "concat-last-four", "sum-all", "scalar-mix")
CONTEXT_FREE = "context-free"
# The shipped WiC split (data/README.md), found from this file, so `ctx eval wic` reads it from any folder
DEFAULT_DATA = str(Path(__file__).resolve().parents[2] / "data" / "tasks" / "wic")
FIELDS = ("sentence1", "sentence2", "label", "start1", "end1", "start2", "end2")


def read_split(uri: str, store: Store | str | None = None) -> dict[str, list]:
    """A WiC split (JSONL) as columns; a record without one of ``FIELDS`` is an error naming its line."""
    data = as_store(store).read_bytes(uri, missing_ok=True)
    if data is None:
        raise ValueError(f"{uri}: no such file; a WiC folder holds validation.jsonl and test.jsonl (--data)")
    cols: dict[str, list] = {k: [] for k in FIELDS}
    for n, rec in json_lines(data, uri):
        missing = [k for k in FIELDS if k not in rec]
        if missing:
            raise ValueError(f"{uri}:{n}: a WiC record needs {list(FIELDS)}; missing {missing}")
        for k in FIELDS:
            cols[k].append(rec[k])
    if not cols["label"]:
        raise ValueError(f"{uri}: no records")
    return cols


class WordVectors:
    """A loaded model's per-word vectors: sub-token vectors of a character span, averaged."""

    def __init__(self, model_uri: str, max_len: int = 128, batch_size: int = 32, store: Store | str | None = None):
        import torch

        from ctxmodels.checkpoint import load_checkpoint
        from jobs.runs import local_copy, resolve_checkpoint
        from jobs.serving.replica import char_ids_backbone
        from pipelines.tokenizers import load_tokenizer

        store = as_store(store)
        resolved = resolve_checkpoint(model_uri, store)  # a run folder: its best checkpoint
        with tempfile.TemporaryDirectory(prefix="ctx-wic-") as tmp:  # a remote model's copy, gone once loaded
            loaded = load_checkpoint(local_copy(resolved, Path(tmp), store), verify_hashes=True)
            if loaded.tokenizer_dir is None:
                raise ValueError(f"{model_uri}: the checkpoint has no tokenizer folder")
            self.tok = load_tokenizer(loaded.tokenizer_dir)
        self.family = loaded.family
        backbone = loaded.model.backbone
        if loaded.family == "elmo":
            backbone = char_ids_backbone(backbone, self.tok, loaded.config.max_chars)
        self.backbone = backbone.eval()
        self.max_len, self.batch_size, self.torch = max_len, batch_size, torch

    def _states(self, texts: list[str]) -> tuple[list[Any], list[list[tuple[int, int]]]]:
        torch = self.torch
        ids, offsets, _ = self.tok.encode_for_model(texts, self.max_len)
        width = max(len(r) for r in ids)
        batch = np.full((len(ids), width), self.tok.padding_id, dtype=np.int64)  # masked out: a GPT-2 tokenizer has no [PAD]
        mask = np.zeros((len(ids), width), dtype=np.int64)
        for i, row in enumerate(ids):
            batch[i, : len(row)] = row
            mask[i, : len(row)] = 1
        with torch.inference_mode():
            states = self.backbone.hidden_states(torch.from_numpy(batch), attention_mask=torch.from_numpy(mask))
        return [s.float() for s in states], offsets

    def span_vectors(self, texts: list[str], starts: list[int], ends: list[int], strategies: tuple[str, ...]) -> dict[str, np.ndarray]:
        """{strategy: (N, D)} vectors of the character spans ``[start, end)`` of each text."""
        from ctxmodels.features import combine_layers

        out: dict[str, list[np.ndarray]] = {s: [] for s in strategies}
        for lo in range(0, len(texts), self.batch_size):
            chunk = slice(lo, lo + self.batch_size)
            states, offsets = self._states(texts[chunk])
            combined = {s: combine_layers(states, s).numpy() for s in strategies}  # (B, T, D'); scalar-mix: equal weights
            for row, (offs, start, end) in enumerate(zip(offsets, starts[chunk], ends[chunk])):
                picks = [t for t, (s, e) in enumerate(offs) if e > s and s < end and e > start]
                if not picks:
                    raise ValueError(f"the target span [{start}, {end}) of {texts[lo + row]!r} has no token within the first {self.max_len}")
                for s in strategies:
                    out[s].append(combined[s][row, picks].mean(axis=0))
        return {s: np.stack(v) for s, v in out.items()}

    def context_free(self, words: list[str]) -> np.ndarray:
        """(N, D): each word encoded alone, its input-layer (hidden state 0) vectors averaged."""
        vecs = []
        for lo in range(0, len(words), self.batch_size):
            chunk = words[lo : lo + self.batch_size]
            states, offsets = self._states(chunk)
            for row, offs in enumerate(offsets):
                picks = [t for t, (s, e) in enumerate(offs) if e > s]
                vecs.append(states[0][row, picks].mean(dim=0).numpy())
        return np.stack(vecs)


def pair_scores(wv: WordVectors, split: dict[str, list], strategies: tuple[str, ...]) -> dict[str, np.ndarray]:
    """{strategy: (N,) cosine of the target's two vectors}, plus the context-free baseline."""
    a = wv.span_vectors(split["sentence1"], split["start1"], split["end1"], strategies)
    b = wv.span_vectors(split["sentence2"], split["start2"], split["end2"], strategies)
    scores = {s: cosine_rows(a[s], b[s]) for s in strategies}
    w1 = [t[s:e] for t, s, e in zip(split["sentence1"], split["start1"], split["end1"])]
    w2 = [t[s:e] for t, s, e in zip(split["sentence2"], split["start2"], split["end2"])]
    scores[CONTEXT_FREE] = cosine_rows(wv.context_free(w1), wv.context_free(w2))
    return scores


def evaluate_wic(model_uri: str, data_uri: str = DEFAULT_DATA, strategies: tuple[str, ...] = STRATEGIES,
                 max_len: int = 128, store: Store | str | None = None) -> dict[str, Any]:
    """Fit each strategy's threshold on ``<data>/validation.jsonl``, score on ``<data>/test.jsonl``.
    ``store``: the command's Store (``ctx eval --retry-deadline``), or an endpoint URL."""
    from pipelines import storage

    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown feature strategies {unknown}; known: {list(STRATEGIES)}")
    store = as_store(store)
    dev = read_split(storage.join(data_uri, "validation.jsonl"), store)
    test = read_split(storage.join(data_uri, "test.jsonl"), store)
    wv = WordVectors(model_uri, max_len=max_len, store=store)
    dev_scores, test_scores = pair_scores(wv, dev, strategies), pair_scores(wv, test, strategies)
    y_dev, y_test = np.asarray(dev["label"]), np.asarray(test["label"])
    results = {}
    for name in (*strategies, CONTEXT_FREE):
        t, dev_acc = fit_threshold(dev_scores[name], y_dev)
        results[name] = {"threshold": round(t, 6), "dev_accuracy": dev_acc, "accuracy": accuracy_at(test_scores[name], y_test, t)}
    best = max(strategies, key=lambda s: results[s]["dev_accuracy"])
    return {
        "model": model_uri, "family": wv.family, "data": data_uri,
        "n_dev": int(y_dev.size), "n_test": int(y_test.size), "majority": float(max(y_test.mean(), 1 - y_test.mean())),
        "strategies": results, "best_strategy": best,
        "accuracy": results[best]["accuracy"], "context_free_accuracy": results[CONTEXT_FREE]["accuracy"],
    }


def write_output(result: dict[str, Any], output: str | None) -> str:
    text = json.dumps(result, indent=2)
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text + "\n")
    return text
