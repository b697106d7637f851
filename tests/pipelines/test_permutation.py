"""XLNet permutation-LM targets: one order per row, no leaks, keyed randomness, speed."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from pipelines.permutation import PlmConfig, plm_targets

V = 1000
PAD, CLS, SEP, MASK = 0, 1, 2, 3
VOCAB = SimpleNamespace(vocab_size=V, pad_id=PAD, cls_id=CLS, sep_id=SEP, mask_id=MASK, special_ids=np.array([0, 1, 2, 3, 4]))


def make_batch(n_rows: int, length: int, seed: int = 0, min_len: int = 8, epoch: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, V, size=(n_rows, length))
    lens = rng.integers(min(min_len, length), length + 1, size=n_rows)
    pos = np.arange(length)
    ids[pos[None, :] >= lens[:, None]] = PAD
    ids[:, 0] = CLS
    ids[np.arange(n_rows), lens - 1] = SEP
    return {
        "input_ids": ids,
        "attention_mask": (pos[None, :] < lens[:, None]).astype(np.int64),
        "sample_id": np.arange(n_rows, dtype=np.int64) + 977 * seed,
        "epoch": np.full(n_rows, epoch, dtype=np.int64),
    }


def targets_of(out) -> list[np.ndarray]:
    """Per row, the positions of the targets (from target_mapping)."""
    tm = out["target_mapping"]
    return [np.nonzero(tm[b])[1] for b in range(tm.shape[0])]


@pytest.fixture(scope="module")
def batch():
    return make_batch(48, 96, seed=1)


@pytest.fixture(scope="module")
def out(batch):
    return plm_targets(batch, 5, PlmConfig(), VOCAB)


def test_shapes_and_dtypes(batch, out):
    B, T = batch["input_ids"].shape
    P = -(-T // 6)
    assert out["perm_mask"].shape == (B, T, T) and out["perm_mask"].dtype == np.bool_  # 1 byte a pair; models cast
    assert out["target_mapping"].shape == (B, P, T) and out["target_mapping"].dtype == np.float32
    assert out["labels"].shape == (B, P) and out["labels"].dtype == np.int64
    assert out["input_ids"] is batch["input_ids"]  # unchanged, passed through


def test_targets_are_the_last_ceil_m_over_k_and_predicted_once(batch, out):
    ids, att = batch["input_ids"], batch["attention_mask"]
    tm = out["target_mapping"]
    for b, pos in enumerate(targets_of(out)):
        m = int(((att[b] == 1) & (ids[b] > 4)).sum())
        n_t = -(-m // 6)
        assert len(pos) == n_t
        assert len(np.unique(pos)) == n_t  # each target exactly once
        assert (np.diff(pos) > 0).all()  # slots in position order
        used = tm[b].sum(axis=1)
        np.testing.assert_array_equal(used, (np.arange(tm.shape[1]) < n_t).astype(np.float32))  # one-hot, used first
        assert (ids[b, pos] > 4).all() and (att[b, pos] == 1).all()  # never special or padding
        np.testing.assert_array_equal(out["labels"][b, :n_t], ids[b, pos])
        assert (out["labels"][b, n_t:] == -100).all()


def test_perm_mask_follows_one_order(batch, out):
    att = batch["attention_mask"]
    pm = out["perm_mask"]  # True: may not attend
    for b, tgt in enumerate(targets_of(out)):
        real = np.flatnonzero(att[b])
        pad = np.flatnonzero(att[b] == 0)
        context = np.setdiff1d(real, tgt)
        assert pm[b][:, pad].all()  # padding is never attended
        sub = pm[b][np.ix_(tgt, tgt)]  # target i vs target j
        assert sub.diagonal().all()  # a target never sees itself
        # Steps: a target's step in z = number of targets it sees; the sets must be a chain.
        sees = ~sub
        step = sees.sum(axis=1)
        np.testing.assert_array_equal(np.sort(step), np.arange(len(tgt)))
        np.testing.assert_array_equal(sees, step[None, :] < step[:, None])  # sees exactly the earlier ones
        # Targets are last in the order: they see the whole context, and no context token sees a target.
        assert not pm[b][np.ix_(tgt, context)].any()
        assert pm[b][np.ix_(context, tgt)].all()
        assert not pm[b][np.ix_(context, context)].any()  # context sees context both ways


def test_targets_are_uniform_over_positions():
    batch = make_batch(3000, 40, seed=2, min_len=40)  # 38 eligible tokens, 7 targets per row
    out = plm_targets(batch, 0, PlmConfig(), VOCAB)
    freq = out["target_mapping"].sum(axis=(0, 1))[1:-1] / 3000
    np.testing.assert_allclose(freq, 7 / 38, atol=0.03)
    # The order of the targets is uniform too: each target is the first one about 1/7 of the time.
    pm = out["perm_mask"]
    firsts = []
    for b, tgt in enumerate(targets_of(out)[:1000]):
        sees_none = pm[b][np.ix_(tgt, tgt)].all(axis=1)
        firsts.append(np.flatnonzero(sees_none)[0])
    assert abs(np.mean(np.bincount(firsts, minlength=7)[0]) / 1000 - 1 / 7) < 0.04


def test_max_predict_caps_targets(batch):
    out = plm_targets(batch, 5, PlmConfig(max_predict=4), VOCAB)
    assert out["labels"].shape == (batch["input_ids"].shape[0], 4)
    assert ((out["labels"] != -100).sum(axis=1) <= 4).all()
    assert out["target_mapping"].sum(axis=(1, 2)).max() == 4


def test_keyed_by_seed_epoch_sample_id(batch, out):
    perm = np.random.default_rng(0).permutation(48)
    wide = {k: (np.pad(v[perm], ((0, 0), (0, 30))) if v.ndim == 2 else v[perm]) for k, v in batch.items()}
    parts = [plm_targets({k: v[s] for k, v in wide.items()}, 5, PlmConfig(), VOCAB) for s in (slice(0, 17), slice(17, 48))]
    pm = np.concatenate([p["perm_mask"] for p in parts])
    T = batch["input_ids"].shape[1]
    np.testing.assert_array_equal(pm[:, :T, :T], out["perm_mask"][perm])
    assert pm[:, :, T:].all()  # the extra padding is hidden
    tgt_wide = [t for p in parts for t in targets_of(p)]
    tgt = targets_of(out)
    for i, b in enumerate(perm):
        np.testing.assert_array_equal(tgt_wide[i], tgt[b])
    again = plm_targets(batch, 5, PlmConfig(), VOCAB)
    np.testing.assert_array_equal(again["perm_mask"], out["perm_mask"])
    other = plm_targets({**batch, "epoch": batch["epoch"] + 1}, 5, PlmConfig(), VOCAB)
    changed = [not np.array_equal(a, b) for a, b in zip(targets_of(other), tgt)]
    assert np.mean(changed) > 0.9


def test_no_attention_mask_column_uses_pad_id():
    batch = make_batch(6, 32, seed=4)
    with_mask = plm_targets(batch, 1, PlmConfig(), VOCAB)
    without = plm_targets({k: v for k, v in batch.items() if k != "attention_mask"}, 1, PlmConfig(), VOCAB)
    np.testing.assert_array_equal(with_mask["perm_mask"], without["perm_mask"])


def test_no_content_leak_through_xlnet():
    """Through transformers' XLNet: a target's prediction ignores its own id and later targets'."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.XLNetConfig(vocab_size=V, d_model=32, n_layer=2, n_head=2, d_inner=64, dropout=0.0)
    model = transformers.XLNetLMHeadModel(cfg).eval()
    batch = make_batch(4, 24, seed=6, min_len=18)
    out = plm_targets(batch, 3, PlmConfig(partial_k=3), VOCAB)

    # Variants of the batch, all run in one forward pass: (row, slot checked, input ids, must equal?)
    cases = []
    pm = out["perm_mask"]
    for b, tgt in enumerate(targets_of(out)):
        step = (~pm[b][np.ix_(tgt, tgt)]).sum(axis=1)
        for p in range(len(tgt)):
            hidden = tgt[step >= step[p]]  # itself and the later targets
            ids = batch["input_ids"][b].copy()
            ids[hidden] = 5 + (ids[hidden] - 4) % (V - 5)
            cases.append((b, p, ids, True))
        # Sanity: changing a context token does change the predictions.
        context = np.setdiff1d(np.flatnonzero(batch["attention_mask"][b]), tgt)
        ids = batch["input_ids"][b].copy()
        ids[context[1]] = 5 + (ids[context[1]] - 4) % (V - 5)
        cases.append((b, slice(0, len(tgt)), ids, False))
    rows = np.array([c[0] for c in cases])
    with torch.no_grad():
        def run(input_ids, rows):
            return model(
                input_ids=torch.as_tensor(input_ids),
                attention_mask=torch.as_tensor(batch["attention_mask"][rows]).float(),
                perm_mask=torch.as_tensor(out["perm_mask"][rows]).float(),  # HF documents a float mask
                target_mapping=torch.as_tensor(out["target_mapping"][rows]),
            ).logits.numpy()  # (N, P, V)

        base = run(batch["input_ids"], np.arange(4))
        varied = run(np.stack([c[2] for c in cases]), rows)
    for i, (b, p, _, same) in enumerate(cases):
        if same:
            np.testing.assert_allclose(varied[i, p], base[b, p], atol=1e-5, err_msg=f"row {b} slot {p} leaks")
        else:
            assert not np.allclose(varied[i, p], base[b, p], atol=1e-5)


def test_our_xlnet_takes_the_batch_as_is():
    """ctxmodels' XLNet consumes the columns unchanged (bool perm_mask included) and the dtype of
    perm_mask changes nothing: same loss as with a float32 copy, and gradients flow."""
    torch = pytest.importorskip("torch")
    from ctxmodels.xlnet import PRESETS, XLNetForPreTraining

    torch.manual_seed(0)
    model = XLNetForPreTraining(PRESETS["tiny"]).eval()  # tiny: vocab_size 1000 = V
    out = plm_targets(make_batch(4, 32, seed=8, min_len=12), 2, PlmConfig(), VOCAB)
    cols = ("input_ids", "attention_mask", "perm_mask", "target_mapping", "labels")
    batch = {k: torch.as_tensor(out[k]) for k in cols}
    assert batch["perm_mask"].dtype == torch.bool
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.backbone.word_emb.weight.grad.abs().sum() > 0
    model.reset_all_memory()
    with torch.no_grad():
        as_float = model(**{**batch, "perm_mask": batch["perm_mask"].float()}).loss
    torch.testing.assert_close(as_float, loss.detach())


def test_faster_than_transformers_collator():
    """Vectorised: clearly faster than DataCollatorForPermutationLanguageModeling (a loop per row
    and per span). The lead's benchmark measures the real ratio; this guards against regressions."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = {f"w{i}": i for i in range(5, V)} | {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[MASK]": 3, "[UNK]": 4}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]")),
        pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", unk_token="[UNK]",
    )
    collator = transformers.DataCollatorForPermutationLanguageModeling(tokenizer=tok, return_tensors="pt")
    batch = make_batch(16, 256, seed=7, min_len=256)
    examples = [{"input_ids": row.tolist()} for row in batch["input_ids"]]

    def best_of(fn, n):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    ours = best_of(lambda: plm_targets(batch, 0, PlmConfig(), VOCAB), 10)
    theirs = best_of(lambda: collator(examples), 3)
    assert theirs / ours > 5, f"plm_targets {ours * 1e3:.2f} ms vs collator {theirs * 1e3:.2f} ms"


def test_errors_name_the_problem(batch):
    with pytest.raises(ValueError, match="partial_k"):
        PlmConfig(partial_k=0)
    with pytest.raises(ValueError, match="max_predict"):
        PlmConfig(max_predict=0)
    with pytest.raises(ValueError, match="sample_id"):
        plm_targets({"input_ids": batch["input_ids"]}, 0, PlmConfig(), VOCAB)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        plm_targets({**batch, "input_ids": batch["input_ids"] + V}, 0, PlmConfig(), VOCAB)
