"""Every objective's batches fit its family's pretraining model, without Ray; stream-ordered
batches keep each row's text contiguous, and the training loop's reset rule marks exactly the
discontinuities."""

from __future__ import annotations

import dataclasses
import gzip
import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ctxmodels.registry import build_model
from jobs.training.config import FAMILY_OBJECTIVES
from jobs.training.loop import model_inputs
from jobs.training.train import stream_resets
from pipelines.dataset import (
    OBJECTIVES,
    StreamSpec,
    apply_objective,
    local_batches,
    row_kind,
    stack_stream_rows,
    stream_shard,
    transform_context,
    transform_rows,
)
from pipelines.sources import iter_documents, sample_text
from pipelines.tokenizers import train_tokenizer

REPO = Path(__file__).resolve().parents[2]
SHARD = str(sorted((REPO / "data" / "sample").glob("*.txt.gz"))[0])
ROWS, SEQ = 4, 32
PAIRS = [(family, objective) for family, objectives in FAMILY_OBJECTIVES.items() for objective in objectives]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer("wordpiece", sample_text([SHARD], 300_000), 1000)


@pytest.fixture(scope="module")
def translations(tmp_path_factory) -> str:
    """A parallel JSONL shard for the translation LM: the sample's sentences and the same spelt backwards."""
    path = tmp_path_factory.mktemp("tlm") / "en-xx.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for doc in next(iter_documents(SHARD)):
            for line in doc.split("\n"):
                f.write(json.dumps({"en": line, "xx": " ".join(w[::-1] for w in line.split())}) + "\n")
    return str(path)


def spec_for(objective: str, **kw) -> StreamSpec:
    return StreamSpec(shards=(SHARD,), seq_len=SEQ, objective=objective, stream_rows=ROWS, **kw)


def test_every_objective_is_trained_by_some_family():
    assert {o for _, o in PAIRS} == set(OBJECTIVES)


@pytest.mark.parametrize("family,objective", PAIRS, ids=[f"{f}-{o}" for f, o in PAIRS])
def test_batches_fit_the_model_and_give_a_finite_loss(tok, translations, family, objective):
    torch.manual_seed(0)
    languages = {"type_vocab_size": 2} if objective == "tlm" else {}
    _, model = build_model(family, "tiny", {"vocab_size": tok.vocab_size, **FAMILY_OBJECTIVES[family][objective], **languages})
    accepted = set(inspect.signature(model.forward).parameters)
    spec = spec_for(objective)
    if objective == "tlm":
        spec = dataclasses.replace(spec, shards=(translations,), language_names=("en", "xx"))
    batches = list(local_batches(spec, tok, batch_size=ROWS, epoch=0, max_batches=3))
    assert len(batches) == 3
    for batch in batches:
        inputs = {k: torch.as_tensor(v) for k, v in model_inputs(batch).items()}
        assert set(inputs) <= accepted, sorted(set(inputs) - accepted)
        assert all(len(v) == ROWS for v in inputs.values())
        out = model(**inputs)
        assert torch.isfinite(out.loss), (family, objective)
        assert int(out.metrics["n_pred"]) > 0
    out.loss.backward()


def test_pair_objectives_build_two_segments_and_both_labels(tok):
    for objective in ("nsp", "sop"):
        batch = next(local_batches(spec_for(objective), tok, batch_size=64, epoch=0))
        assert set(np.unique(batch["next_sentence_label"])) == {0, 1}
        assert (batch["token_type_ids"].max(axis=1) == 1).all()  # every pair has a segment B
        assert ((batch["labels"] != -100).sum(axis=1) > 0).mean() > 0.9


def test_xlnet_on_packed_rows_never_reuses_memory(tok):
    spec = spec_for("plm", plm_stream=False)
    assert row_kind(spec) == "packed"
    batch = next(local_batches(spec, tok, batch_size=ROWS, epoch=0))
    assert (batch["reset_memory"] == 1).all() and "_stream_block" not in batch
    assert (batch["input_ids"][:, 0] == tok.cls_id).all()  # [CLS] ... [SEP] rows


def reference_stream(tok) -> np.ndarray:
    """The shard's tokens with [SEP] after every document: what stream rows must tile."""
    parts = []
    for docs in iter_documents(SHARD):
        for ids in tok.encode_batch(docs):
            if ids.size:
                parts += [ids.astype(np.int64), np.array([tok.sep_id])]
    return np.concatenate(parts)


def test_stream_rows_continue_each_other_and_tile_the_shard(tok):
    spec = spec_for("clm-stream", stream_block_batches=3)
    batches = list(local_batches(spec, tok, batch_size=ROWS, epoch=0))
    blocks: dict[int, list[dict[str, np.ndarray]]] = {}
    for batch in batches:
        blocks.setdefault(int(batch["_stream_block"][0]), []).append(batch)
    assert len(blocks) > 10
    text = []
    for group in blocks.values():  # in stream order (dicts keep insertion order)
        assert [int(b["_stream_index"][0]) for b in group] == list(range(len(group)))
        for r in range(ROWS):  # row r of consecutive batches is one contiguous piece of the stream
            row = np.concatenate([b["input_ids"][r][b["attention_mask"][r] == 1] for b in group])
            text.append(row)
            mask = np.concatenate([b["attention_mask"][r] for b in group])
            assert (np.diff(mask) <= 0).all()  # padding only at the end of the row's piece
    np.testing.assert_array_equal(np.concatenate(text), reference_stream(tok))
    # The loop's rule, run over the batches in order, gives the batcher's own resets.
    resets, _ = stream_resets(None, [b["_stream_block"][0] for b in batches], [b["_stream_index"][0] for b in batches])
    np.testing.assert_array_equal(resets, [b["reset_memory"][0] for b in batches])
    assert all((b["reset_memory"] == b["reset_memory"][0]).all() for b in batches)
    # Every stream objective shares these rows (stage 1) and keeps input_ids as they are.
    for objective in ("plm", "bilm"):
        other = list(local_batches(spec_for(objective, stream_block_batches=3), tok, batch_size=ROWS, epoch=0, max_batches=5))
        for a, b in zip(batches, other):
            np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
            assert a["_stream_block"][0] == b["_stream_block"][0]


def test_ray_rows_hold_whole_batches_and_fold_back(tok):
    """Stage 2 on Ray rows (n, B, ...) equals stage 2 on each batch: the stacking is transparent."""
    for objective in ("clm-stream", "plm", "bilm"):
        spec = spec_for(objective, stream_block_batches=3)
        ctx = transform_context(spec, tok)
        group = next(stream_shard(tok, SHARD, 7, 0, spec, ROWS))
        rows = transform_rows(stack_stream_rows(group), ctx, objective)
        assert rows["input_ids"].shape == (len(group), ROWS, SEQ)
        assert "reset_memory" not in rows and rows["_stream_index"][:, 0].tolist() == list(range(len(group)))
        for i, batch in enumerate(group):
            single = apply_objective(batch, ctx, objective)
            single.pop("reset_memory")
            assert set(single) == set(rows)
            for k, v in single.items():
                np.testing.assert_array_equal(rows[k][i], v, err_msg=k)


def test_stream_resets_mark_exactly_the_discontinuities():
    a, b = 11, 22
    seq = [(a, 0), (a, 1), (a, 3), (b, 0), (a, 4), (a, 5), (b, 1), (b, 2), (b, 2)]
    resets, last = stream_resets(None, [x for x, _ in seq], [i for _, i in seq])
    assert resets.tolist() == [1, 0, 1, 1, 1, 0, 1, 0, 1]
    assert last == (b, 2)
    # One batch at a time, as the loop calls it: the previous batch carries over.
    prev, out = None, []
    for block, index in seq:
        r, prev = stream_resets(prev, [block], [index])
        out.append(int(r[0]))
    assert out == resets.tolist()
    # A worker that resumes mid-block (index 5) must not trust a memory it never built.
    assert stream_resets(None, [a], [5])[0].tolist() == [1]
    assert stream_resets((a, 4), [], [])[1] == (a, 4)
