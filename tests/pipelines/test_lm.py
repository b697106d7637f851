"""Causal LM labels and ELMo's shifted biLM targets."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.lm import bilm_targets, causal_lm_targets


def make_batch() -> dict[str, np.ndarray]:
    ids = np.array([[5, 6, 7, 8], [9, 10, 0, 0], [11, 0, 0, 0]])
    return {
        "input_ids": ids,
        "attention_mask": (ids != 0).astype(np.int64),
        "sample_id": np.arange(3),
        "epoch": np.zeros(3, dtype=np.int64),
    }


def test_causal_labels_are_unshifted_ids_with_padding_ignored():
    batch = make_batch()
    before = batch["input_ids"].copy()
    out = causal_lm_targets(batch)
    assert out["labels"].dtype == np.int64
    assert out["labels"].tolist() == [[5, 6, 7, 8], [9, 10, -100, -100], [11, -100, -100, -100]]
    np.testing.assert_array_equal(batch["input_ids"], before)  # input untouched
    assert out["input_ids"] is batch["input_ids"] and out["sample_id"] is batch["sample_id"]
    no_mask = causal_lm_targets({"input_ids": batch["input_ids"]})
    np.testing.assert_array_equal(no_mask["labels"], batch["input_ids"])


def test_bilm_targets_are_the_neighbours():
    out = bilm_targets(make_batch())
    assert out["_fwd_labels"].tolist() == [[6, 7, 8, -100], [10, -100, -100, -100], [-100, -100, -100, -100]]
    assert out["_bwd_labels"].tolist() == [[-100, 5, 6, 7], [-100, 9, -100, -100], [-100, -100, -100, -100]]
    assert "labels" not in out  # bookkeeping only: ElmoForPreTraining(**batch) takes no labels


def test_bilm_targets_match_what_the_elmo_model_predicts():
    # ctxmodels.elmo: forward logits at t (t < T-1) against input_ids[:, t+1] where mask[:, t+1];
    # backward logits at t (t >= 1) against input_ids[:, t-1] where mask[:, t].
    batch = make_batch()
    out = bilm_targets(batch)
    ids, mask = batch["input_ids"], batch["attention_mask"].astype(bool)
    valid = mask[:, 1:]
    np.testing.assert_array_equal(out["_fwd_labels"][:, :-1], np.where(valid, ids[:, 1:], -100))
    np.testing.assert_array_equal(out["_bwd_labels"][:, 1:], np.where(valid, ids[:, :-1], -100))


def test_bilm_targets_need_right_padding():
    batch = make_batch()
    batch["attention_mask"] = batch["attention_mask"][:, ::-1].copy()
    with pytest.raises(ValueError, match="row 1 is not right-padded"):
        bilm_targets(batch)


def test_bad_input_is_reported():
    with pytest.raises(ValueError, match="2-D integer"):
        causal_lm_targets({"input_ids": np.zeros(4, dtype=np.int64)})
    with pytest.raises(ValueError, match="attention_mask has shape"):
        causal_lm_targets({"input_ids": np.zeros((2, 4), dtype=np.int64), "attention_mask": np.ones((2, 3))})
