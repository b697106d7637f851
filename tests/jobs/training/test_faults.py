"""Training survives faults, the numbers-and-disk half (issue 11), without Ray Train:

* a step with a non-finite loss or gradient norm is skipped on every rank alike (one process, and
  two gloo processes where only rank 0's loss is NaN), counted, and ``train.max_bad_steps`` in a
  row stop the run with a message that says so;
* a checkpoint with non-finite weights is never written; a checkpoint is not started without the
  free disk space for it;
* resuming from object storage leaves no temporary folder behind, also when loading fails;
* serving refuses a checkpoint whose bytes differ from its manifest's hashes.

The real Ray Train run (the run stops, its newest good checkpoint kept) is tests/jobs/training/test_faults_run.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ctxmodels.checkpoint import save_checkpoint
from ctxmodels.registry import build_model
from jobs.training.loop import Checkpointer, NonFiniteError, Stepper, StepMeter, TrainState, build_optimizer, ensure_free_space, resume
from jobs.training.parallel import ParallelPlan, all_finite, unwrap, wrap_model
from pipelines import storage
from pipelines.position import DataPosition
from tests.conftest import run_gloo_workers

B, T = 4, 16
OVERRIDES = {"nsp": False, "dropout": 0.0, "attn_dropout": 0.0, "vocab_size": 256}  # small: every test here is cheap
CPU = torch.device("cpu")


def tiny_bert():
    model = build_model("bert", "tiny", OVERRIDES, seed=0)[1]
    model.backbone.pooler.requires_grad_(False)  # MLM never reaches it (jobs.training.loop.freeze_unused)
    return model


def batches(vocab: int, n: int, rows: int = B, seed: int = 0):
    """``n`` MLM micro-batches with the bookkeeping columns the loop reads (sample_id, epoch)."""
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        ids = torch.randint(5, vocab, (rows, T), generator=g)
        labels = torch.full((rows, T), -100)
        labels[:, 1::5] = ids[:, 1::5]
        yield {"input_ids": ids, "attention_mask": torch.ones(rows, T, dtype=torch.long), "labels": labels,
               "sample_id": torch.arange(i * rows, (i + 1) * rows), "epoch": torch.zeros(rows, dtype=torch.long)}


def stepper(model, wrapped=None, accumulation: int = 1, **kw) -> Stepper:
    wrapped = wrapped if wrapped is not None else model
    # strategy "ddp" on CPU: the fused AdamW the runs use
    opt = build_optimizer(model, wrapped, "ddp", CPU, lr=1e-3, weight_decay=0.01)
    return Stepper(wrapped, opt, ParallelPlan(), CPU, accumulation, B * accumulation, 1e-3, lambda s: 1.0, grad_clip=1.0, **kw)


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in unwrap(model).state_dict().items()}


def test_a_nan_step_is_skipped_counted_and_training_finishes_with_finite_weights():
    torch.manual_seed(0)
    model = tiny_bert()
    s = stepper(model, accumulation=2, debug_nan_steps=(2,))
    state, meter, stream = TrainState(), StepMeter(), batches(model.cfg.vocab_size, 10)
    assert not s.step(stream, state, meter).skipped
    before, lr = weights(model), s.current_lr
    taken = s.step(stream, state, meter)  # attempt 2: rank 0's loss is NaN, so are its gradients
    assert taken.skipped and len(taken.batches) == 2  # consumed (the caller commits them), not trained on
    assert (state.step, state.bad_steps, state.samples_seen) == (1, 1, 2 * B)
    after = weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step changed the weights"
    assert all(p.grad is None for p in model.parameters()), "the NaN gradients must not reach the next step"
    assert s.current_lr == lr and all(int(st["step"]) == 1 for st in s.optimizer.state.values())  # no optimizer step
    for _ in range(3):
        assert not s.step(stream, state, meter).skipped
    assert (state.step, state.bad_steps, state.attempts) == (4, 1, 5)
    assert all_finite(model)
    assert any(not torch.equal(before[k], v) for k, v in weights(model).items())  # it did train afterwards
    m = meter.reduce(1)
    assert math.isfinite(m["loss"]) and m["samples_per_s"] > 0  # the skipped micro-batches are not metered


def test_max_bad_steps_in_a_row_stop_with_a_message_that_says_so():
    model = tiny_bert()
    s = stepper(model, debug_nan_steps=(2, 3, 4, 5), max_bad_steps=3)
    state, meter, stream = TrainState(), StepMeter(), batches(model.cfg.vocab_size, 10)
    s.step(stream, state, meter)
    assert s.step(stream, state, meter).skipped and s.step(stream, state, meter).skipped
    with pytest.raises(NonFiniteError) as e:
        s.step(stream, state, meter)
    message = str(e.value)
    assert "train.max_bad_steps=3" in message and "the last 3 optimizer steps" in message and "step 1" in message
    assert (state.step, state.bad_steps) == (1, 3) and all_finite(model)


def test_a_good_step_resets_the_count_in_a_row():
    model = tiny_bert()
    s = stepper(model, debug_nan_steps=(1, 2, 4, 5), max_bad_steps=3)
    state, meter, stream = TrainState(), StepMeter(), batches(model.cfg.vocab_size, 10)
    results = [s.step(stream, state, meter).skipped for _ in range(6)]  # never 3 in a row
    assert results == [True, True, False, True, True, False]
    assert (state.step, state.bad_steps) == (2, 4)


# ---------------------------------------------------------------------------------------------
# Two gloo processes: only rank 0's loss is NaN, both ranks skip, the weights stay equal


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        out = {}
        for strategy in ("ddp", "fsdp"):
            model = tiny_bert()
            wrapped = wrap_model(model, ParallelPlan(strategy=strategy), CPU)
            opt = build_optimizer(model, wrapped, strategy, CPU, lr=1e-3, weight_decay=0.01)
            s = Stepper(wrapped, opt, ParallelPlan(strategy=strategy), CPU, 2, 4 * B, 1e-3, lambda n: 1.0,
                        grad_clip=1.0 if strategy == "ddp" else 0.0, debug_nan_steps=(2,))
            state, meter, stream = TrainState(), StepMeter(), batches(model.cfg.vocab_size, 20, seed=rank)
            skipped = [s.step(stream, state, meter).skipped for _ in range(4)]
            out[strategy] = {"skipped": skipped, "step": state.step, "bad": state.bad_steps, "finite": all_finite(wrapped),
                             "weights": {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                                         for k, v in unwrap(wrapped).state_dict().items()}}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_ranks_take_the_same_decision_when_one_rank_sees_nan(tmp_path):
    ranks = run_gloo_workers(_worker, tmp_path, 2, hint="a rank skipped alone and the other waits?")
    for strategy in ("ddp", "fsdp"):
        r0, r1 = ranks[0][strategy], ranks[1][strategy]
        assert r0["skipped"] == r1["skipped"] == [False, True, False, False], strategy
        assert (r0["step"], r0["bad"]) == (r1["step"], r1["bad"]) == (3, 1)
        assert r0["finite"] and r1["finite"]
        for k, v in r0["weights"].items():
            torch.testing.assert_close(v, r1["weights"][k], rtol=0, atol=0, msg=f"{strategy}: {k} differs between ranks")


# ---------------------------------------------------------------------------------------------
# Checkpoints: never with non-finite weights, never without the disk space


def _checkpointer(run: Path, saved: list) -> Checkpointer:
    return Checkpointer(str(run), storage.Store(), [0], 0, 1, DataPosition(), save=lambda *a: saved.append(a), fresh_model=tiny_bert)


def test_a_checkpoint_with_non_finite_weights_is_never_written(tmp_path):
    model = tiny_bert()
    opt = build_optimizer(model, model, "ddp", CPU, lr=1e-3, weight_decay=0.0)
    with torch.no_grad():
        model.backbone.embeddings.word.weight[3, 0] = float("inf")
    saved: list = []
    with pytest.raises(NonFiniteError, match="not all finite: no checkpoint written"):
        _checkpointer(tmp_path / "run", saved).commit(TrainState(step=7), model, opt, {"step": 7})
    assert saved == [] and not (tmp_path / "run").exists()


def test_free_space_is_checked_before_writing(tmp_path):
    ensure_free_space({str(tmp_path): 1 << 20, str(tmp_path / "not-yet" / "run"): 1 << 20})  # a few MiB fit
    with pytest.raises(OSError, match="not enough free disk space") as e:
        ensure_free_space({str(tmp_path / "run"): 1 << 60})  # an exbibyte does not
    assert str(tmp_path / "run") in str(e.value) and "TMPDIR" in str(e.value)


# ---------------------------------------------------------------------------------------------
# Resume leaves no temporary folder


def _trained_checkpoint(folder: Path, step: int) -> Path:
    model = tiny_bert()
    s = stepper(model)
    state = TrainState()
    s.step(batches(model.cfg.vocab_size, 1), state, StepMeter())
    from ctxmodels.checkpoint import optimizer_state_to_tensors

    tensors, meta = optimizer_state_to_tensors(s.optimizer)
    position = DataPosition()
    position.add([0] * B, [0] * B, list(range(B)))
    save_checkpoint(folder, model, "bert", model.cfg,
                    extra_json={"trainer_state": TrainState(step=step).to_json(optimizer=meta)},
                    extra_tensors={"optimizer": tensors, "data_position": {k: torch.from_numpy(v) for k, v in position.to_arrays().items()}})
    return folder


def test_resume_from_object_storage_removes_its_temporary_folder(tmp_path, s3_bucket, monkeypatch):
    import tempfile

    local = _trained_checkpoint(tmp_path / "src" / "checkpoint_a", step=5)
    run = f"s3://{s3_bucket}/runs/r"
    storage.Store().copy_dir(local, storage.join(run, "checkpoint_a"))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where TemporaryDirectory puts its folders

    model = tiny_bert()
    resumed = resume(run, storage.Store(), model)
    assert resumed.state.step == 5 and resumed.position.committed(0) == B
    assert resumed.optimizer_tensors and all(t.numel() for t in resumed.optimizer_tensors.values())
    expected = weights(build_model("bert", "tiny", OVERRIDES, seed=0)[1])
    assert any(not torch.equal(expected[k], v) for k, v in weights(model).items())  # the trained weights were loaded
    assert list(scratch.iterdir()) == []

    wrong = build_model("bert", "tiny", {**OVERRIDES, "n_layer": 1}, seed=0)[1]  # fails while loading
    with pytest.raises(RuntimeError):
        resume(run, storage.Store(), wrong)
    assert list(scratch.iterdir()) == []


def test_tokenizer_copies_and_warm_start_copies_leave_no_temporary_folder(tmp_path, s3_bucket, monkeypatch):
    """What every worker and data actor writes at every start (the tokenizer's files, a warm start's
    checkpoint) is removed again: a long run restarted many times does not fill /tmp."""
    import tempfile

    from jobs.training.train import warm_start_model
    from pipelines.dataset import tokenizer_files, tokenizer_from_files
    from pipelines.tokenizers import train_tokenizer

    tok_dir = tmp_path / "tok"
    train_tokenizer("wordpiece", ["the river bank", "a loan from the bank"] * 50, 60).save(tok_dir)
    local = _trained_checkpoint(tmp_path / "src" / "checkpoint_a", step=5)
    remote = f"s3://{s3_bucket}/runs/warm/checkpoint_a"
    storage.Store().copy_dir(local, remote)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where TemporaryDirectory puts its folders

    from ctxmodels.checkpoint import load_checkpoint
    from pipelines.tokenizers import load_tokenizer

    tok = tokenizer_from_files(tokenizer_files(tok_dir))
    [got], [want] = tok.encode_batch(["the river bank"]), load_tokenizer(tok_dir).encode_batch(["the river bank"])
    assert got.tolist() == want.tolist()
    _, model = warm_start_model(remote, None)
    expected = weights(load_checkpoint(local).model)
    assert weights(model).keys() == expected.keys() and all(torch.equal(v, expected[k]) for k, v in weights(model).items())
    assert list(scratch.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Serving checks the manifest's hashes


def test_serving_refuses_a_checkpoint_whose_bytes_differ_from_the_manifest(tmp_path):
    from jobs.serving.replica import _load_noting_untrained_heads

    folder = _trained_checkpoint(tmp_path / "checkpoint_a", step=1)
    _load_noting_untrained_heads(folder)  # intact: loads
    weights_file = folder / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 0x01  # one bit of one weight: same size, so only the hash can tell
    weights_file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors: sha256 differs from the manifest"):
        _load_noting_untrained_heads(folder)
