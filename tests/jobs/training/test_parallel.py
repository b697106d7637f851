"""jobs.training.parallel: DDP and FSDP2 on two CPU processes (gloo) reproduce the single-process step.

One pair of processes runs every distributed scenario (starting them costs ~5-10 s on 2 shared
cores, the scenarios ~1 s each) and saves what it computed; the tests compare that with a
single-process reference computed here. Tiny BERT without NSP and without dropout; every row of a
batch has the same number of masked positions, so the mean of per-rank (or per-micro-batch) mean
losses is the mean over the whole batch and gradients must match the one-process ones.

Measured on 2 shared cores: ~16 s for the file with a warm inductor cache, ~28 s with a cold one
(the compile test takes 4 s warm, 18-36 s cold; the two gloo processes 6-8 s, more under load).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ctxmodels.compiling import is_compiled
from ctxmodels.registry import FAMILIES, build_model
from jobs.training import parallel
from jobs.training.parallel import (
    ParallelPlan,
    autocast,
    clip_grad_norm,
    clipped_step,
    compile_scope,
    cpu_has_native_bf16,
    grad_norm,
    fsdp_units,
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    no_sync,
    step_precision,
    unwrap,
    wrap_model,
)
from tests.conftest import run_gloo_workers
from tests.ctxmodels.test_flops import family_batch

B, T = 4, 16  # global batch: 2 rows per rank
WORLD = 2
LR, MAX_NORM = 1e-2, 0.5  # a max_norm small enough that clipping is active
# AdamW's first update is lr * g / (|g| + eps): with the default eps (1e-8) a gradient near zero
# turns float noise (1e-9) into an lr-sized difference. eps = 1e-4 bounds that by lr * 1e-9 / eps.
EPS = 1e-4
OVERRIDES = {"nsp": False, "dropout": 0.0, "attn_dropout": 0.0}
CPU = torch.device("cpu")
STRATEGIES = ("ddp", "fsdp")


def fresh_bert():
    """Tiny BERT, pooler frozen: MLM never reaches it, and jobs.training.loop.freeze_unused freezes it
    before wrapping (DDP runs without find_unused_parameters)."""
    model = build_model("bert", "tiny", OVERRIDES, seed=0)[1]
    model.backbone.pooler.requires_grad_(False)
    return model


def make_batch(cfg, seed: int) -> dict[str, torch.Tensor]:
    """As tests/ctxmodels/test_bert.py builds them, with 3 masked positions in every row (1, 6,
    11) and padding (rows 1 and 3, from 12 on) after the last one."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1::2, 12:] = 0
    ids[attn == 0] = cfg.pad_token_id
    types = torch.zeros(B, T, dtype=torch.long)
    types[:, T // 2 :] = 1
    labels = torch.full((B, T), -100)
    labels[:, 1::5] = ids[:, 1::5]
    labels[attn == 0] = -100
    return dict(input_ids=ids, attention_mask=attn, token_type_ids=types, labels=labels)


def rows(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in batch.items()}


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in unwrap(model).parameters() if p.requires_grad]


def adamw(model) -> torch.optim.AdamW:
    """Two parameter groups, as jobs.training.loop.param_groups builds them (no decay on vectors)."""
    params = trainable(model)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, eps=EPS)


def reference_steps(batches: list[dict[str, torch.Tensor]]):
    """One process, whole batches: AdamW steps with clipping. Returns (model, optimizer, norms)."""
    model = fresh_bert()
    opt = adamw(model)
    norms = []
    for batch in batches:
        model(**batch).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, norms


# ---------------------------------------------------------------------------------------------
# The two worker processes


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        torch.save(_scenarios(rank), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _scenarios(rank: int) -> dict:
    cfg = fresh_bert().cfg
    batch1, batch2 = make_batch(cfg, 1), make_batch(cfg, 2)
    per_rank = B // WORLD
    mine1 = rows(batch1, rank * per_rank, (rank + 1) * per_rank)
    mine2 = rows(batch2, rank * per_rank, (rank + 1) * per_rank)
    out: dict = {}
    for strategy in STRATEGIES:
        plan = ParallelPlan(strategy=strategy)
        res = out[strategy] = {}

        # (a) one clipped AdamW step on this rank's half of the batch
        model = wrap_model(fresh_bert(), plan, CPU)
        opt = adamw(model)
        res["opt_before_step"] = full_optimizer_state(model, opt)
        model(**mine1).loss.backward()
        res["norm"] = clip_grad_norm(model, MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        res["step"] = full_state_dict(model)
        res["opt"] = full_optimizer_state(model, opt)
        with torch.no_grad():
            res["eval_loss"] = model(**batch2).loss  # the same rows on both ranks

        # (b) the same step as 2 micro-batches of 1 row, the first without gradient sync
        model = wrap_model(fresh_bert(), plan, CPU)
        opt = adamw(model)
        for micro in range(per_rank):
            with no_sync(model, active=micro < per_rank - 1):
                (model(**rows(mine1, micro, micro + 1)).loss / per_rank).backward()
            if micro == 0 and strategy == "ddp":  # not all-reduced: differs between ranks
                res["local_grad"] = unwrap(model).backbone.layers[0].ffn.fc_in.weight.grad.clone()
            if micro == 0 and strategy == "fsdp":  # not reduce-scattered: no sharded grad yet
                res["sharded_grads"] = sum(p.grad is not None for p in trainable(model))
        clip_grad_norm(model, MAX_NORM)
        opt.step()
        res["accumulated"] = full_state_dict(model)

        # resume: the reference weights and optimizer state after step 1, then step 2 here
        ref_model, ref_opt, _ = reference_steps([batch1])
        model = fresh_bert()
        model.load_state_dict(ref_model.state_dict())
        model = wrap_model(model, plan, CPU)
        opt = adamw(model)
        load_full_optimizer_state(model, opt, ref_opt.state_dict())
        model(**mine2).loss.backward()
        clip_grad_norm(model, MAX_NORM)
        opt.step()
        res["resumed"] = full_state_dict(model)

    # ALBERT runs its one shared layer n_layer times per forward: FSDP gathers it each time
    albert_cfg, albert = build_model("albert", "tiny", {"sop": False, "dropout": 0.0}, seed=0)
    albert.backbone.pooler.requires_grad_(False)  # read by SOP only
    batch = make_batch(albert_cfg, 3)
    model = wrap_model(albert, ParallelPlan(strategy="fsdp"), CPU)
    opt = adamw(model)
    model(**rows(batch, rank * per_rank, (rank + 1) * per_rank)).loss.backward()
    opt.step()
    out["albert_fsdp_step"] = full_state_dict(model)
    return out


@pytest.fixture(scope="module")
def distributed(tmp_path_factory) -> list[dict]:
    """What each of the 2 gloo ranks computed (rank 0's full state dicts; None on rank 1)."""
    return run_gloo_workers(_worker, tmp_path_factory.mktemp("parallel"), WORLD)


@pytest.fixture(scope="module")
def reference():
    cfg = fresh_bert().cfg
    batch1, batch2 = make_batch(cfg, 1), make_batch(cfg, 2)
    one, one_opt, norms = reference_steps([batch1])
    two, _, _ = reference_steps([batch1, batch2])
    return {"batch2": batch2, "step": one, "opt": one_opt, "norm": norms[0], "two_steps": two.state_dict()}


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name in expected:
        torch.testing.assert_close(
            got[name], expected[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


# ---------------------------------------------------------------------------------------------
# Distributed: (a) one step, (b) accumulation, (c) state dicts, optimizer state, resume


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_step_on_two_workers_equals_one_process_on_the_whole_batch(distributed, reference, strategy):
    """Also the tied softmax: the word embedding gets the decoder's gradient under FSDP too."""
    res = distributed[0][strategy]
    assert_same_weights(res["step"], reference["step"].state_dict())
    # float32 sums of squares over the 8000 x 64 embedding gradient are off by up to ~1e-4
    # (relative, against float64) on CPU; FSDP sums two shards separately: 2e-5 apart measured.
    torch.testing.assert_close(res["norm"], reference["norm"], atol=0.0, rtol=1e-4)
    assert distributed[1][strategy]["step"] is None  # the full state lives on rank 0 only
    assert res["norm"] > MAX_NORM  # clipping was exercised


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_accumulating_micro_batches_under_no_sync_equals_one_big_batch(distributed, reference, strategy):
    assert_same_weights(distributed[0][strategy]["accumulated"], reference["step"].state_dict())


def test_no_sync_really_skips_the_gradient_reduction(distributed):
    a, b = distributed[0]["ddp"]["local_grad"], distributed[1]["ddp"]["local_grad"]
    assert (a - b).abs().max() > 1e-6, "DDP: the micro-step under no_sync was all-reduced"
    # FSDP2 keeps the unsharded gradient to itself until a synced backward reduce-scatters it
    assert distributed[0]["fsdp"]["sharded_grads"] == 0, "FSDP: the micro-step under no_sync was reduce-scattered"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_state_dict_loads_into_a_single_device_model(distributed, reference, strategy):
    res = distributed[0][strategy]
    model = fresh_bert()
    assert list(res["step"]) == list(model.state_dict())  # no "module." / "_orig_mod." prefixes
    model.load_state_dict(res["step"], strict=True)
    with torch.no_grad():
        loss = model(**reference["batch2"]).loss
    torch.testing.assert_close(loss, res["eval_loss"], atol=1e-6, rtol=1e-6)
    assert all(t.device.type == "cpu" for t in res["step"].values())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_full_optimizer_state_is_the_single_device_one(distributed, reference, strategy):
    got, expected = distributed[0][strategy]["opt"], reference["opt"].state_dict()
    assert distributed[0][strategy]["opt_before_step"]["state"] == {}  # no hidden zero-lr step
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    assert sorted(got["state"]) == sorted(expected["state"])
    for i, values in expected["state"].items():
        assert set(got["state"][i]) == set(values)
        for key, value in values.items():
            torch.testing.assert_close(got["state"][i][key], value, atol=1e-6, rtol=1e-5, msg=f"{i}.{key}")
    assert distributed[1][strategy]["opt"] is None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resuming_from_a_full_optimizer_state_continues_the_run(distributed, reference, strategy):
    assert_same_weights(distributed[0][strategy]["resumed"], reference["two_steps"])


def test_fsdp_shards_albert_shared_layer_once_and_matches_one_process(distributed):
    cfg, model = build_model("albert", "tiny", {"sop": False, "dropout": 0.0}, seed=0)
    model.backbone.pooler.requires_grad_(False)
    opt = adamw(model)
    model(**make_batch(cfg, 3)).loss.backward()
    opt.step()
    assert_same_weights(distributed[0]["albert_fsdp_step"], model.state_dict())


# ---------------------------------------------------------------------------------------------
# Single process: structure, no-ops, compile, autocast


@pytest.mark.parametrize(
    ("family", "units", "root_keeps"),
    [
        ("bert", ["backbone.layers.0", "backbone.layers.1"], "backbone.embeddings.word"),
        ("gpt", ["backbone.blocks.0", "backbone.blocks.1"], "backbone.tok_emb"),
        ("albert", ["backbone.attention.0", "backbone.ffn.0"], "backbone.word_emb"),  # shared: once
        ("transformer-xl", ["backbone.layers.0", "backbone.layers.1"], "backbone.word_emb"),
        ("xlnet", ["backbone.layers.0", "backbone.layers.1"], "backbone.word_emb"),
        (
            "elmo",
            [f"backbone.token_embedder.convs.{i}" for i in range(3)]
            + ["backbone.token_embedder.highways.0"]
            + [f"backbone.{d}_lstms.{i}" for d in ("fwd", "bwd") for i in range(2)],
            "lm_head",
        ),
    ],
)
def test_fsdp_units_are_the_module_list_children_and_tied_embeddings_stay_in_the_root(family, units, root_keeps):
    _, model = build_model(family, "tiny")
    got = fsdp_units(model)
    assert sorted(got) == sorted(units)
    assert not any(root_keeps.startswith(u + ".") for u in got)


def test_fsdp_units_refuse_a_weight_tied_across_units():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 10), torch.nn.Linear(4, 4)])
            self.blocks[0].weight = self.emb.weight  # a decoder inside a unit, tied to the root

    with pytest.raises(ValueError, match=r"emb\.weight is also a parameter of blocks\.0"):
        fsdp_units(Tied())


def test_without_a_process_group_nothing_is_wrapped():
    assert not dist.is_initialized()
    model = fresh_bert()
    for strategy in STRATEGIES:
        assert wrap_model(model, ParallelPlan(strategy=strategy), CPU) is model
    assert unwrap(model) is model
    batch = make_batch(model.cfg, 1)
    with no_sync(model, active=True):
        model(**batch).loss.backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in trainable(model)])
    torch.testing.assert_close(clip_grad_norm(model, MAX_NORM), expected)
    assert full_state_dict(model).keys() == model.state_dict().keys()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    opt.step()
    state = full_optimizer_state(model, opt)
    load_full_optimizer_state(model, opt, state)
    assert opt.state_dict()["state"].keys() == state["state"].keys()


@pytest.mark.parametrize(
    ("field", "value"), [("strategy", "zero3"), ("precision", "fp16"), ("compile", "yes")]
)
def test_bad_plan_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ParallelPlan\.{field}\b"):
        ParallelPlan(**{field: value})


def test_compile_graphs_takes_the_whole_masked_lm_model_on_one_gpu_only():
    """``train.compile: graphs``: the whole model as CUDA graphs where a step has static shapes (the
    masked-LM families) on one GPU; blocks as CUDA graphs on several GPUs or for other families;
    on the CPU (no CUDA graphs) plain compiled blocks. Decided without a GPU."""
    cuda, cpu = torch.device("cuda", 0), CPU
    bert, gpt = build_model("bert", "tiny", {"vocab_size": 128})[1], build_model("gpt", "tiny", {"vocab_size": 128})[1]
    graphs, blocks, eager = ParallelPlan(compile="graphs"), ParallelPlan(compile=True), ParallelPlan()
    assert compile_scope(bert, graphs, cuda, 1) == "whole graphs"
    assert compile_scope(bert, graphs, cuda, 2) == "block graphs"
    assert compile_scope(gpt, graphs, cuda, 1) == "block graphs"
    assert compile_scope(bert, graphs, cpu, 1) == "blocks"
    assert compile_scope(bert, blocks, cuda, 1) == "blocks"
    assert compile_scope(bert, eager, cuda, 1) is None
    # fine-tuning: a task model on a masked-LM backbone as its backbone, on other families by block
    from ctxmodels.tasks import TaskConfig, build_task_model

    task = TaskConfig(kind="classification", num_labels=2)
    for family, want in (("roberta", "whole graphs"), ("gpt", "block graphs")):
        model = build_task_model(family, build_model(family, "tiny", {"vocab_size": 128})[0], task)
        assert compile_scope(model, graphs, cuda, 1) == want, family


def test_compiled_model_gives_the_eager_loss_and_the_original_names():
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        pytest.skip("torch.compile's CPU backend (inductor) needs a C++ compiler; none on PATH")
    import torch._dynamo
    import torch._inductor.config

    model = fresh_bert()
    batch = make_batch(model.cfg, 1)
    with torch.no_grad():
        eager = model(**batch).loss
    compiled = wrap_model(model, ParallelPlan(compile=True), CPU)
    # regional: each block compiled in place, the model itself unwrapped (ctxmodels.compiling)
    assert compiled is model and all(is_compiled(block) for block in model.backbone.layers)
    try:
        # One compile worker: a pool of subprocesses costs more than it saves on a tiny graph.
        with torch._inductor.config.patch(compile_threads=1), torch.no_grad():
            loss = compiled(**batch).loss
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(loss, eager, atol=1e-4, rtol=0)
    assert list(full_state_dict(compiled)) == list(model.state_dict())


def test_bf16_autocast_on_cpu_follows_the_hardware(monkeypatch):
    """train.precision: bf16 autocasts on a CPU with native bf16 products and runs fp32 on one
    without (emulated bf16 is slower than fp32 there); ``allow_cpu`` overrides the check."""
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    bf16 = ParallelPlan(precision="bf16")
    for native in (True, False):
        monkeypatch.setattr(parallel, "cpu_has_native_bf16", lambda: native)
        with autocast(bf16, CPU):
            assert (a @ b).dtype == (torch.bfloat16 if native else torch.float32)
        assert step_precision(bf16, CPU) == ("bf16" if native else "fp32")
        with autocast(bf16, CPU, allow_cpu=not native):
            assert (a @ b).dtype == (torch.float32 if native else torch.bfloat16)
        with autocast(ParallelPlan(), CPU, allow_cpu=True):
            assert (a @ b).dtype == torch.float32
        assert step_precision(ParallelPlan(), CPU) == "fp32"
        assert step_precision(bf16, torch.device("cuda")) == "bf16"
    if torch.cuda.is_available():
        ctx = autocast(bf16, torch.device("cuda"))
    else:
        with pytest.warns(UserWarning, match="CUDA is not available"):
            ctx = autocast(bf16, torch.device("cuda"))
    assert isinstance(ctx, torch.autocast) and ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads Linux's /proc/cpuinfo")
def test_native_bf16_is_what_the_cpu_flags_say():
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    assert cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="needs a CPU with AVX512-BF16 or AMX")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_training_on_a_native_bf16_cpu_learns(family):
    """What train.precision: bf16 runs on such a CPU: under parallel.autocast every matrix product
    of every family runs in bf16, the loss is its fp32 loss to bf16's precision, and it falls over
    steps of fused AdamW on one batch with fp32 weights."""
    from torch.utils._python_dispatch import TorchDispatchMode

    products = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                torch.ops.aten.baddbmm.default}

    class ProductDtypes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: list[torch.dtype] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in products:
                self.seen += [a.dtype for a in args if isinstance(a, torch.Tensor)]
            return func(*args, **(kwargs or {}))

    cfg, model = build_model(family, "tiny", {"vocab_size": 128, **LEARNS_WITH.get(family, {})}, seed=0)
    batch, _ = family_batch(family, cfg)
    if "reset_memory" in batch:  # every call starts a new segment
        batch["reset_memory"] = torch.ones_like(batch["reset_memory"])
    plan = ParallelPlan(precision="bf16")
    model.eval()
    with torch.no_grad():
        fp32 = model(**batch).loss
        with autocast(plan, CPU), ProductDtypes() as dtypes:
            bf16 = model(**batch).loss
    assert dtypes.seen and set(dtypes.seen) == {torch.bfloat16}, f"{family}: products in {set(dtypes.seen)}"
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, fp32, rtol=3e-2, atol=3e-2)
    assert_bf16_training_learns(family, model, batch, CPU)



@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
def test_clipped_step_is_clip_grad_norm_then_step(fused: bool):
    """``clipped_step`` (the training loop's step) folds the clipping into a fused AdamW step
    (``optimizer.grad_scale``): weights, optimizer state and the gradients left behind equal
    ``clip_grad_norm_`` then ``step()``'s, over steps whose norm is far above ``MAX_NORM`` (clipped)
    and under it (untouched). The weights part by float rounding only (1e-8 after three steps at
    lr 1e-2); an unclipped step leaves 8x the gradient and 64x the second moment."""
    ref, ours = fresh_bert(), fresh_bert()
    ref_opt = torch.optim.AdamW(trainable(ref), lr=LR, eps=EPS, fused=fused)
    our_opt = torch.optim.AdamW(trainable(ours), lr=LR, eps=EPS, fused=fused)
    clipped = []
    for i, scale in enumerate((1.0, 1e-4, 1.0)):  # the loss scaled down: a gradient norm under MAX_NORM
        batch = make_batch(ref.cfg, i + 1)
        for model in (ref, ours):
            (model(**batch).loss * scale).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(trainable(ref), MAX_NORM)
        ref_opt.step()
        norm = grad_norm(ours)
        torch.testing.assert_close(norm, ref_norm)
        clipped.append(bool(norm > MAX_NORM))
        clipped_step(ours, our_opt, norm, MAX_NORM)
        assert not hasattr(our_opt, "grad_scale")
        for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
            if a.grad is not None:
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=f"step {i}: {name}'s gradient")
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"step {i}: {name}")
        ref_opt.zero_grad(set_to_none=True)
        our_opt.zero_grad(set_to_none=True)
    assert clipped == [True, False, True]
    for a, b in zip(trainable(ref), trainable(ours)):
        torch.testing.assert_close(our_opt.state[b]["exp_avg_sq"], ref_opt.state[a]["exp_avg_sq"], rtol=1e-3, atol=1e-10)


# AWD-LSTM's dropouts (five kinds, 0.05-0.5) are made to stop an LSTM memorising: on one repeated
# batch its tiny model then falls by ~7% in 40 steps. Without them, and with 80 steps, it falls by 30%.
LEARNS_WITH: dict[str, dict] = {
    "awd-lstm": {"dropout": 0.0, "dropout_hidden": 0.0, "dropout_input": 0.0, "dropout_embed": 0.0, "dropout_weight": 0.0},
}
LEARNING_STEPS: dict[str, int] = {"awd-lstm": 80}


def assert_bf16_training_learns(family: str, model, batch: dict, device: torch.device, steps: int = 40) -> None:
    """40 steps (``LEARNING_STEPS``) of fused AdamW on one batch under ``autocast`` (bf16): the loss
    stays finite and falls by a fifth, and the weights stay float32 (also tests/jobs/test_cuda.py's)."""
    steps = LEARNING_STEPS.get(family, steps)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    plan = ParallelPlan(precision="bf16")
    losses = []
    for _ in range(steps):
        with autocast(plan, device):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses), f"{family}: non-finite bf16 losses {losses}"
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, f"{family}: bf16 loss did not fall on a repeated batch: {first:.3f} -> {last:.3f}"
    assert all(p.dtype == torch.float32 for p in model.parameters()), "autocast must keep fp32 master weights"


def test_train_residual_bf16_lowers_bert_layernorms_only_where_the_step_runs_bf16():
    from ctxmodels import ops
    from ctxmodels.registry import build_model
    from jobs.training.parallel import lower_residual

    _, bert = build_model("bert", "tiny", {"vocab_size": 128}, seed=0)
    norms = [m for m in bert.modules() if isinstance(m, ops.LayerNorm)]
    assert norms and lower_residual(bert, "fp32", "bf16") is None and not any(m.low_precision_output for m in norms)
    assert "runs in fp32" in lower_residual(bert, "bf16", "fp32") and not any(m.low_precision_output for m in norms)
    assert lower_residual(bert, "bf16", "bf16") is None and all(m.low_precision_output for m in norms)
    _, gpt = build_model("gpt", "tiny", {"vocab_size": 128}, seed=0)  # torch's nn.LayerNorm: nothing to lower
    assert "outputs stay float32" in lower_residual(gpt, "bf16", "bf16")


def test_train_unpad_skips_padding_in_bert_family_encoders_on_cuda_only_and_needs_eager_steps():
    """``train.unpad: true`` switches a BERT-family encoder to jagged attention on CUDA (CPU steps
    skip padding with length groups anyway), says so where a family has no such encoder, and is
    refused beside ``train.compile`` (unpadded shapes change with every batch)."""
    from ctxmodels.registry import build_model, make_config
    from ctxmodels.tasks import TaskConfig, build_task_model
    from jobs.training.config import RecipeError
    from jobs.training.finetune_config import load_finetune_recipe
    from jobs.training.parallel import skip_padding

    task = build_task_model("roberta", make_config("roberta", "tiny", {}), TaskConfig(kind="classification", num_labels=2))
    assert skip_padding(task, False, torch.device("cuda")) is None and task.backbone.jagged is False
    assert skip_padding(task, True, torch.device("cpu")) is None and task.backbone.jagged is False
    assert skip_padding(task, True, torch.device("cuda")) is None and task.backbone.jagged is True
    _, gpt = build_model("gpt", "tiny", {"vocab_size": 128}, seed=0)
    assert "has no BERT, RoBERTa or SpanBERT encoder" in skip_padding(gpt, True, torch.device("cuda"))
    recipe = Path(__file__).resolve().parents[3] / "configs" / "finetune" / "tiny-pairs.yaml"
    assert load_finetune_recipe(recipe, ["train.unpad=true"]).train.unpad is True
    for compile_ in ("true", "graphs"):
        with pytest.raises(RecipeError, match="train.unpad: true needs train.compile: false"):
            load_finetune_recipe(recipe, ["train.unpad=true", f"train.compile={compile_}"])
