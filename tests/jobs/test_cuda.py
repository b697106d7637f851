"""The GPU path: every family trains on CUDA as it does on the CPU (skipped without a GPU; CI has none).

Run on a machine with a GPU: ``python -m pytest tests/jobs/test_cuda.py``. Checked:
- fp32 forward and backward on CUDA equal the CPU's (loss, every gradient), TF32 off;
- under ``jobs.training.parallel.autocast`` (bf16, as ``train.precision: bf16`` trains) each family's loss is
  finite and falls over steps of fused AdamW on one batch, the weights stay float32;
- the masked-LM loss of ``ctxmodels.ops`` equals cross-entropy on CUDA (its plain version there;
  padding rows skipped), gradients included, under autocast too;
- cached decoding (GPT's key-value cache, Transformer-XL's memory) on CUDA equals the CPU's full forward;
- each block compiled (``ctxmodels.compiling``) equals eager CUDA; SDPA's flash and
  memory-efficient kernels equal its math path under bf16 autocast, for every family and mask
  kind, XLM's causal mask too; ``jobs.training.loop.to_device`` pins, copies and finds unpadded batches on the host;
- a BERT, SpanBERT and ALBERT step with the masked positions found on the host makes no
  synchronizing call; the bf16 residual stream (``train.residual: bf16``) compiles like eager and learns;
- ``train.compile: graphs`` on one GPU (``jobs.training.parallel.wrap_model``): BERT, SpanBERT and ALBERT
  compiled whole, forward and backward replayed as CUDA graphs, train like eager over AdamW steps
  whose padded position counts change; so does a fine-tuning task model on those backbones, on
  batches cut to two trim lengths;
- a serving replica's passes replayed from CUDA graphs (``ctxmodels.graphs``), float32 and float16,
  equal eager passes at the real tokens, over buckets recorded, replayed, dropped and recorded again;
  so do a task model's logits (classification, token labels, answer spans, symmetric pairs) in
  float16, each recording passing its own check against its eager pass; a replica's passes then
  queue without any synchronizing call but the wait for each pass's copy off the device;
- ``train.unpad: true``: a fine-tuning step on the real tokens only, attention over nested jagged
  tensors (FlashAttention's variable-length kernel), equals the padded step, fp32 and bf16, and
  finding a batch's sequences waits for the GPU once.
No Ray: jobs.training.parallel and ctxmodels only.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ctxmodels import ops
from ctxmodels.compiling import compile_blocks, compile_regions
from ctxmodels.registry import FAMILIES, build_model
from tests.ctxmodels.test_compiling import BLOCK_FAMILIES, SDPA_FAMILIES, _assert_same, _loss_and_grads, _padded
from tests.ctxmodels.test_flops import family_batch
from tests.jobs.training.test_parallel import LEARNS_WITH, assert_bf16_training_learns

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_fp32():
    """fp32 products in fp32: TF32 (cuDNN's default for convolutions, ELMo's character CNN) would
    make the CUDA numbers differ from the CPU's at 1e-3."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _tiny(family: str):
    cfg, model = build_model(family, "tiny", {"vocab_size": 128, **LEARNS_WITH.get(family, {})}, seed=0)
    batch, _ = family_batch(family, cfg)
    if "reset_memory" in batch:  # every call starts a new segment: no memory carried between calls
        batch["reset_memory"] = torch.ones_like(batch["reset_memory"])
    return cfg, model, batch


def _on(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def _adamw_losses(model, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """One fused-AdamW step of ``model`` on each batch in turn; the losses, read after each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_forward_and_backward_on_cuda_equal_the_cpu(family):
    _, model, batch = _tiny(family)
    model.eval()  # no dropout: the two devices draw different masks
    loss_cpu = model(**batch).loss
    loss_cpu.backward()
    grads_cpu = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    model.to(CUDA)
    loss_gpu = model(**_on(batch, CUDA)).loss
    loss_gpu.backward()
    assert loss_gpu.device.type == "cuda"
    torch.testing.assert_close(loss_gpu.cpu(), loss_cpu.detach(), rtol=1e-5, atol=1e-5)
    grads_gpu = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
    assert grads_gpu.keys() == grads_cpu.keys() and grads_cpu
    for name, g in grads_cpu.items():
        torch.testing.assert_close(grads_gpu[name], g, rtol=1e-4, atol=1e-5, msg=lambda m: f"{family} {name}: {m}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_autocast_training_on_cuda_learns(family):
    _, model, batch = _tiny(family)
    assert_bf16_training_learns(family, model.to(CUDA), _on(batch, CUDA), CUDA)


def test_masked_lm_loss_on_cuda_equals_cross_entropy():
    """On a GPU ``ops.masked_lm_loss`` runs its plain version (the fused one is the CPU's), padding
    rows (target -100) skipped."""
    g = torch.Generator().manual_seed(0)
    n, d, v = 700, 64, 3000
    h = torch.randn(n, d, generator=g).to(CUDA).requires_grad_()
    w = (0.1 * torch.randn(v, d, generator=g)).to(CUDA).requires_grad_()
    b = torch.randn(v, generator=g).to(CUDA).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g)
    target[-60:] = -100  # padding, as ops.padded_positions gives
    target = target.to(CUDA)

    loss, correct = ops.masked_lm_loss(h, w, b, target)
    loss.backward()
    fused = (loss.detach(), correct, h.grad.clone(), w.grad.clone(), b.grad.clone())
    for t in (h, w, b):
        t.grad = None
    logits = torch.nn.functional.linear(h, w, b)
    ref = torch.nn.functional.cross_entropy(logits, target)
    ref.backward()
    torch.testing.assert_close(fused[0], ref.detach(), rtol=1e-5, atol=1e-6)
    assert int(fused[1]) == int((logits.argmax(-1) == target).sum())
    for got, want in zip(fused[2:], (h.grad, w.grad, b.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)

    with torch.autocast("cuda", dtype=torch.bfloat16):  # the plain version, in fp32 for the loss
        loss_bf16, _ = ops.masked_lm_loss(h, w, b, target)
    assert loss_bf16.dtype == torch.float32
    torch.testing.assert_close(loss_bf16.detach(), ref.detach(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("family", ["gpt", "transformer-xl"])
def test_cached_decoding_on_cuda_equals_the_full_forward_on_the_cpu(family):
    """/v1/generate's decoding: the prompt, then one token at a time with the key-value cache (GPT)
    or the memory (Transformer-XL) on the GPU; each step's scores equal the CPU's full forward pass
    at that position."""
    cfg, model, _ = _tiny(family)
    model.eval()
    ids = torch.randint(5, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        if family == "gpt":
            full = model.logits(ids)  # (B, T, V)
        else:
            full = model.logits(model.backbone(ids, None)[-1])  # (B, T, V): no memory, causal
        model.to(CUDA)
        logits, state = model.decode_step(ids[:, :4].to(CUDA))
        torch.testing.assert_close(logits.cpu(), full[:, 3], rtol=1e-4, atol=1e-5)
        for t in range(4, 20):
            logits, state = model.decode_step(ids[:, t : t + 1].to(CUDA), state)
            torch.testing.assert_close(logits.cpu(), full[:, t], rtol=1e-4, atol=1e-5, msg=lambda m: f"{family} step {t}: {m}")


# ---------------------------------------------------------------------------------------------
# The GPU kernels (issue 25): compiled blocks, SDPA's fused kernels, batches moved by to_device


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_compiled_blocks_on_cuda_equal_eager_ones(family):
    """Each block compiled by inductor into Triton kernels: the loss and every gradient equal
    eager CUDA's in fp32 (TF32 off), for a packed and a padded batch."""
    import torch._dynamo

    _, model, batch = _tiny(family)
    model.to(CUDA).eval()
    for b in (batch, _padded(batch)):
        b = _on(b, CUDA)
        eager = _loss_and_grads(model, b)
        compile_blocks(model)
        try:
            compiled = _loss_and_grads(model, b)
        finally:
            for m in compile_regions(model):
                m._compiled_call_impl = None
            torch._dynamo.reset()
        _assert_same(compiled, eager, family, "compiled on CUDA", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", SDPA_FAMILIES)
@pytest.mark.parametrize("padding", [False, True], ids=["packed", "padded"])
def test_sdpa_fused_kernels_on_cuda_equal_the_math_path(family, padding):
    """Under bf16 autocast, as training runs: no mask takes the flash kernel, a padding mask the
    memory-efficient one; both equal SDPA's math path within bf16 rounding."""
    _, model, batch = _tiny(family)
    model.to(CUDA).eval()
    if hasattr(model.backbone, "skip_padding"):
        model.backbone.skip_padding = False
    batch = _on(_padded(batch) if padding else {k: v for k, v in batch.items() if k != "attention_mask"}, CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = _loss_and_grads(model, batch)
        with sdpa_kernel(SDPBackend.MATH):
            reference = _loss_and_grads(model, batch)
    torch.testing.assert_close(fused[0], reference[0], rtol=2e-2, atol=2e-2)
    # against the largest gradient of the model: some are zero up to rounding (a key bias shifts
    # every score of a query alike, which the softmax ignores), so their own scale means nothing
    scale = max(float(g.abs().max()) for g in reference[1].values())
    for name, g in reference[1].items():
        assert float((fused[1][name] - g).abs().max()) <= 2e-2 * scale, f"{family} {name}"


def test_a_causal_xlm_on_cuda_equals_the_cpu_and_its_fused_kernel_the_math_path():
    """XLM's causal LM runs padded with an explicit (B, 1, T, T) mask: on the GPU its loss and gradients
    equal the CPU's in fp32, and under bf16 autocast SDPA's fused kernel equals its math path."""
    _, model = build_model("xlm", "tiny", {"vocab_size": 128, "type_vocab_size": 2, "causal": True}, seed=0)
    ids = torch.randint(5, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    langs = (torch.arange(4) % 2)[:, None].expand(4, 32).contiguous()
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": langs, "labels": ids.masked_fill(mask == 0, -100)}
    model.eval()  # no dropout: the two devices draw different masks
    on_cpu = _loss_and_grads(model, batch)
    model.to(CUDA)
    _assert_same(_loss_and_grads(model, _on(batch, CUDA)), on_cpu, "xlm", "causal on CUDA", rtol=1e-4, atol=1e-5)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = _loss_and_grads(model, _on(batch, CUDA))
        with sdpa_kernel(SDPBackend.MATH):
            reference = _loss_and_grads(model, _on(batch, CUDA))
    torch.testing.assert_close(fused[0], reference[0], rtol=2e-2, atol=2e-2)
    scale = max(float(g.abs().max()) for g in reference[1].values())
    for name, g in reference[1].items():
        assert float((fused[1][name] - g).abs().max()) <= 2e-2 * scale, name


def test_to_device_pins_copies_and_finds_unpadded_batches_on_the_host():
    from jobs.training.loop import NO_PADDING, model_inputs, to_device

    ids = torch.randint(5, 100, (4, 16))
    packed = to_device({"input_ids": ids, "attention_mask": torch.ones_like(ids), "sample_id": torch.arange(4)}, CUDA)
    assert packed[NO_PADDING] and packed["input_ids"].device.type == "cuda"
    assert set(model_inputs(packed)) == {"input_ids"}  # the all-ones mask left out of the forward
    torch.testing.assert_close(packed["input_ids"].cpu(), ids)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    padded = to_device({"input_ids": ids, "attention_mask": mask}, CUDA)
    assert NO_PADDING not in padded and set(model_inputs(padded)) == {"input_ids", "attention_mask"}


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_blocks_train_like_eager_over_steps(mode):
    """Three AdamW steps of BERT with each block compiled (reduce-overhead: replayed as CUDA graphs)
    give the eager run's losses and weights: the optimizer's in-place updates and the gradients that
    leave the graphs stay right from step to step. fp32, TF32 off, no dropout."""
    import copy

    import torch._dynamo

    _, model, batch = _tiny("bert")
    model.to(CUDA).eval()
    twin = copy.deepcopy(model)
    batches = [_on(batch, CUDA), _on(_padded(batch), CUDA), _on(batch, CUDA)]
    eager = _adamw_losses(model, batches)
    compile_blocks(twin, mode=mode)
    try:
        compiled = _adamw_losses(twin, batches)
    finally:
        torch._dynamo.reset()
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{mode} {name}: {m}")


def test_bf16_residual_stream_on_cuda_compiles_like_eager_and_learns():
    """``ops.low_precision_layernorms`` (``train.residual: bf16``, the stream in bf16 between blocks): BERT's
    compiled blocks give eager's loss within bf16 rounding, and training on one batch learns."""
    import torch._dynamo

    try:
        _, model, batch = _tiny("bert")
        assert ops.low_precision_layernorms(model)
        model.to(CUDA).eval()
        b = _on(batch, CUDA)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eager = model(**b).loss.item()
        compile_blocks(model)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            compiled = model(**b).loss.item()
        for m in compile_regions(model):
            m._compiled_call_impl = None
        assert compiled == pytest.approx(eager, rel=1e-2)
        assert_bf16_training_learns("bert", model, b, CUDA)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("family", ["bert", "spanbert", "albert"])
def test_a_masked_lm_step_with_host_positions_never_waits_for_the_gpu(family):
    """``to_device(..., label_positions=True)`` finds the masked positions on the host; a training
    step (forward, backward, fused AdamW) then makes no synchronizing call at all
    (``torch.cuda.set_sync_debug_mode("error")``), and its loss equals the one found on the GPU."""
    from jobs.training.loop import LABEL_POSITIONS, POSITIONS_MULTIPLE, model_inputs, to_device

    cfg, model, batch = _tiny(family)
    model.to(CUDA).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    moved = to_device(batch, CUDA, label_positions=True)
    assert torch.equal(moved[LABEL_POSITIONS].cpu(), ops.padded_positions(batch["labels"], POSITIONS_MULTIPLE))
    inputs = model_inputs(moved)
    assert "label_positions" in inputs and "attention_mask" not in inputs
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    model.eval()
    with torch.no_grad():
        here = model(**_on(batch, CUDA)).loss
        there = model(**inputs).loss
    torch.testing.assert_close(here, there)


@pytest.mark.parametrize("family", ["bert", "spanbert", "albert"])
def test_whole_model_cuda_graphs_train_like_eager_over_steps(family, monkeypatch):
    """``train.compile: graphs`` on one GPU compiles a masked-LM model whole as CUDA graphs
    (``jobs.training.parallel.wrap_model``, ``ctxmodels.compiling.has_static_step``): four AdamW steps on
    batches moved by ``to_device`` (positions padded to a multiple, then a batch padded to another
    count: a second recording of the same compiled graph) give eager's losses and weights. fp32,
    TF32 off, no dropout."""
    from jobs.training.loop import LABEL_POSITIONS, model_inputs, to_device

    _, model, batch = _tiny(family)
    model.to(CUDA).eval()
    wider = dict(batch)  # about twice the targets: another padded count
    wider["labels"] = torch.where(batch["labels"] == -100, batch["input_ids"], batch["labels"])
    wider["labels"][:, 0] = -100
    monkeypatch.setattr("jobs.training.loop.POSITIONS_MULTIPLE", 16)  # the tiny batch has 4 x 24 positions
    moved = [to_device(b, CUDA, label_positions=True) for b in (batch, batch, wider, batch)]
    counts = [m[LABEL_POSITIONS].numel() for m in moved]
    assert counts[0] % 16 == 0 and counts[0] < counts[2]
    # marked dynamic on the GPU's copy, so the whole model compiles once for both counts
    assert all(0 in getattr(m[LABEL_POSITIONS], "_dynamo_weak_dynamic_indices", ()) for m in moved)
    _whole_graphs_train_like_eager(model, [model_inputs(m) for m in moved], f"{family}, counts {counts}")


def _whole_graphs_train_like_eager(model, inputs: list[dict], what: str) -> None:
    """Four AdamW steps of ``model`` eager, and of a copy as ``train.compile: graphs`` wraps it on
    one GPU (compiled whole: forward and backward replayed as CUDA graphs), give the same losses
    and weights."""
    import copy

    import torch._dynamo

    from jobs.training.parallel import ParallelPlan, wrap_model

    twin = copy.deepcopy(model)
    eager = _adamw_losses(model, inputs)
    compiled = wrap_model(twin, ParallelPlan(compile="graphs"), CUDA)
    assert compiled is not twin and compiled._orig_mod is twin  # whole, not by block
    try:
        got = _adamw_losses(compiled, inputs)
    finally:
        torch._dynamo.reset()
    assert got == pytest.approx(eager, rel=1e-4, abs=1e-5), what
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("family, kind", [("bert", "classification"), ("bert", "token-classification"),
                                          ("albert", "regression")])
def test_a_task_model_as_whole_cuda_graphs_fine_tunes_like_eager(family, kind):
    """``train.compile: graphs`` for ``ctx finetune`` on one GPU: a task model on a masked-LM
    backbone compiled whole (``TaskModel.static_step``), forward and backward replayed as CUDA
    graphs. Four AdamW steps on batches moved as the fine-tuning loop moves them (``to_device``,
    then ``train_inputs`` cuts them to the trim length found on the host: two lengths here, so two
    recordings) give eager's losses and weights; token classification asks for the labelled
    positions only, which eager computes and the compiled model reads at every position. fp32,
    TF32 off, no dropout."""
    from jobs.training.finetune_inputs import TRIM_LENGTH, train_inputs
    from jobs.training.loop import to_device
    from tests.ctxmodels.test_tasks import batch_for, tiny_task

    model = tiny_task(family, kind).to(CUDA).eval()
    batch = batch_for(kind)
    inputs = [train_inputs(to_device({**batch, TRIM_LENGTH: n}, CUDA)) for n in (10, 10, 8, 10)]
    assert [b["input_ids"].shape[-1] for b in inputs] == [10, 10, 8, 10]
    _whole_graphs_train_like_eager(model, inputs, f"{family} {kind}")


@pytest.mark.parametrize("family", ["bert", "albert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_passes_replayed_from_cuda_graphs_equal_eager_ones(family, dtype):
    """``ctxmodels.graphs.GraphedPasses`` as a GPU replica runs it (``ModelSettings.cuda_graphs``): the
    last hidden state of each pass, replayed from its bucket's graph, equals the eager pass at the
    real tokens. The passes go through five buckets, at most three kept, all in one memory pool: a
    bucket replayed with new inputs, buckets replayed after others were recorded, and two dropped
    buckets recorded again."""
    from ctxmodels.graphs import GraphedPasses
    from tests.ctxmodels.test_graphs import _batch

    _, model = build_model(family, "tiny", {"vocab_size": 128}, seed=0)
    backbone = getattr(model, "backbone", model).eval().to(CUDA, dtype)

    def last(ids, mask):
        return backbone.hidden_states(ids, attention_mask=mask)[-1]

    graphed = GraphedPasses(last, max_rows=16, max_len=96, pad_id=0, max_graphs=3)
    passes = [[7], [6], [31, 12, 5], [33, 33, 2, 20, 9], [96] * 3 + [40] * 9, [64] * 16, [7], [30, 12, 5]]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    with torch.inference_mode():
        for seed, lengths in enumerate(passes):
            ids, mask = (t.to(CUDA) for t in _batch(lengths, seed))
            want = last(ids, mask)
            got = graphed(ids, mask).clone()
            real = mask.bool()
            torch.testing.assert_close(got[real].float(), want[real].float(), atol=tol, rtol=tol,
                                       msg=lambda m: f"{family} {dtype} pass {seed} {lengths}: {m}")
    assert graphed.recorded == 7 and len(graphed.buckets) == 3


@pytest.mark.parametrize("family,kind,task", [
    ("bert", "classification", {}),
    ("albert", "token-classification", {}),
    ("bert", "question-answering", {}),
    ("roberta", "classification", {"symmetric": True}),
], ids=["bert-classification", "albert-token-classification", "bert-question-answering", "roberta-symmetric-pairs"])
def test_task_passes_replayed_from_cuda_graphs_equal_eager_ones(family, kind, task):
    """A GPU replica's task routes (``EmbeddingReplica._task_graphed_passes``): a task model's logits
    in float16, replayed from each bucket's graph, equal the eager pass's, for (B, T) and symmetric
    (B, 2, T) inputs; every recording passed its own check against its eager pass (graphs still on)."""
    from ctxmodels.graphs import GraphedPasses
    from tests.ctxmodels.test_graphs import _batch, _task_model

    model = _task_model(family, kind, **task).to(CUDA, torch.float16)
    per_token = kind in ("token-classification", "question-answering")
    graphed = GraphedPasses(lambda ids, mask, **others: model(ids, attention_mask=mask, **others).logits,
                            max_rows=8, max_len=96, pad_id=0, per_token=per_token, max_graphs=2)
    with torch.inference_mode():
        for seed, lengths in enumerate([[7], [31, 12, 5], [40, 40, 33, 9, 2], [6], [30, 30, 3]]):
            ids, mask = (t.to(CUDA) for t in _batch(lengths, seed))
            types = torch.zeros_like(ids)
            if task.get("symmetric"):
                ids, mask, types = (torch.stack([x, x.flip(0)], dim=1) for x in (ids, mask, types))  # (B, 2, T)
            want = model(ids, attention_mask=mask, token_type_ids=types).logits.float()
            got = graphed(ids, mask, token_type_ids=types).float().clone()
            assert got.shape == want.shape
            real = mask.bool() if per_token else slice(None)
            torch.testing.assert_close(got[real], want[real], atol=2e-2, rtol=2e-2, msg=lambda m: f"{family} {kind} pass {seed}: {m}")
    assert graphed.failed is None and graphed.recorded == 5 and len(graphed.buckets) == 2  # two dropped buckets recorded again


def test_a_replicas_passes_queue_without_waiting_for_the_gpu_and_give_the_eager_vectors(tmp_path):
    """A serving replica on the GPU (``jobs.serving.replica.EmbeddingReplica``, a tiny BERT with a WordPiece
    vocabulary trained here): once its buckets are recorded, its sentence-vector passes make no
    synchronizing call but the wait for each pass's copy off the device (``jobs.serving.passes.HostCopy``:
    pinned inputs, graph replays, pooling and non-blocking copies otherwise), and the vectors equal
    those of a replica with ``cuda_graphs: false``."""
    import numpy as np

    from ctxmodels.checkpoint import save_checkpoint
    from jobs.serving import passes
    from jobs.serving.replica import EmbeddingReplica
    from jobs.serving.serve_config import Limits, ModelConfig
    from pipelines.sources import sample_text
    from pipelines.tokenizers import train_tokenizer
    from tests.conftest import REPO, corpus_texts

    shard = str(REPO / "data" / "sample" / "wordnet-0000-of-0008.txt.gz")
    tok = train_tokenizer("wordpiece", sample_text([shard], 200_000), 1000)
    tok.save(tmp_path / "tok")
    cfg, model = build_model("bert", "tiny", {"vocab_size": 1000}, seed=0)
    save_checkpoint(tmp_path / "ckpt", model, "bert", cfg, tokenizer_dir=tmp_path / "tok")
    replicas = {graphs: EmbeddingReplica("m", str(tmp_path / "ckpt"), None, ModelConfig(uri=str(tmp_path / "ckpt"), max_batch_size=8,
                                                                                      dtype="float32", cuda_graphs=graphs), Limits())
                for graphs in (True, False)}
    assert replicas[True]._graphed is not None and replicas[False]._graphed is None
    texts = corpus_texts(40)
    items = [(r, None, "last", 0) for r in replicas[True]._encode_ids(texts, truncate=True)]
    replicas[True]._pool(items)  # every bucket recorded (a recording checks itself: it synchronizes)
    wait = passes.HostCopy.numpy

    def wait_allowed(self):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return wait(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    torch.cuda.synchronize()
    passes.HostCopy.numpy = wait_allowed
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, sizes = replicas[True]._pool(items)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        passes.HostCopy.numpy = wait
    assert len(sizes) >= 5
    want, _ = replicas[False]._pool(items)
    np.testing.assert_allclose(np.stack(got), np.stack(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["bert", "roberta", "spanbert"])
@pytest.mark.parametrize("kind", ["classification", "token-classification"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_unpadded_steps_on_cuda_equal_padded_ones_and_take_a_fused_kernel(family, kind, precision):
    """``train.unpad: true`` on a GPU (``ctxmodels.bert.JaggedPacking``): a fine-tuning step on the
    real tokens only, attention over nested jagged tensors, gives the padded step's loss and
    gradients (fp32: 1e-4; bf16 autocast: within its rounding), its attention in a fused kernel
    (FlashAttention's variable-length one in bf16), not SDPA's math path."""
    from torch.profiler import ProfilerActivity, profile

    from ctxmodels.registry import make_config
    from ctxmodels.tasks import TaskConfig, build_task_model
    from jobs.training import parallel
    from tests.ctxmodels.test_bert import lengths_mask, random_lengths

    cfg = make_config(family, "tiny", {"dropout": 0.0, "attn_dropout": 0.0, "d_model": 64, "n_head": 4})
    model = build_task_model(family, cfg, TaskConfig(kind=kind, num_labels=5), torch.Generator().manual_seed(0)).to(CUDA).train()
    B, T = 16, 48
    mask = lengths_mask(random_lengths(B, T, seed=3), T)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(5, cfg.vocab_size, (B, T), generator=g).masked_fill(mask == 0, cfg.pad_token_id)
    labels = (torch.randint(0, 5, (B, T), generator=g).masked_fill(mask == 0, -100) if kind == "token-classification"
              else torch.randint(0, 5, (B,), generator=g))
    batch = _on({"input_ids": ids, "attention_mask": mask, "labels": labels}, CUDA)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16" else torch.autocast("cuda", enabled=False)
    with autocast:
        padded = _loss_and_grads(model, batch)
        assert parallel.skip_padding(model, True, CUDA) is None and model.backbone.jagged
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            unpadded = _loss_and_grads(model, batch)
    tol = {"fp32": 1e-4, "bf16": 3e-2}[precision]
    torch.testing.assert_close(unpadded[0], padded[0], rtol=tol, atol=tol)
    scale = max(float(g.abs().max()) for g in padded[1].values())
    for name, grad in padded[1].items():
        assert float((unpadded[1][name] - grad).abs().max()) <= tol * scale, f"{family} {kind} {precision} {name}"
    kernels = {e.key for e in prof.key_averages()}
    assert any("flash" in k.lower() or "fmha" in k.lower() or "attention" in k.lower() for k in kernels), sorted(kernels)[:40]
    if precision == "bf16":
        assert any("flash" in k.lower() for k in kernels), sorted(kernels)[:40]


def test_an_unpadded_batch_waits_for_the_gpu_once_to_find_its_sequences():
    """``JaggedPacking`` on a CUDA mask: one synchronizing call (the lengths, which the kernel takes
    as host integers); its real tokens' places are found without another (``nonzero_static``)."""
    import warnings

    from ctxmodels.bert import JaggedPacking
    from tests.ctxmodels.test_bert import lengths_mask, random_lengths

    mask = lengths_mask(random_lengths(16, 48, seed=3), 48).to(CUDA)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            packing = JaggedPacking(mask)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, syncs
    assert packing.keep.tolist() == mask.reshape(-1).nonzero().squeeze(1).tolist()
