"""FLOP counts from the config against torch.utils.flop_counter.FlopCounterMode on a real forward
and backward of every family's tiny model, and the peak-FLOP/s helpers.

What FlopCounterMode can and cannot see, and how the test copes:
- On CPU, ``F.scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention_for_cpu``,
  which has no FLOP formula (it counts 0). The test forces the math backend, whose ``bmm``s it
  counts, so the attention products of BERT/ALBERT/GPT are checked too.
- LSTMs: ELMo's tiny preset clips its cell, so it steps in Python (``mm``s, all visible). The fused
  ``nn.LSTM`` path with projections also decomposes into visible ``mm``s on CPU (oneDNN does not
  support projections); on CUDA cuDNN's fused RNN kernel is invisible to FlopCounterMode, so a
  GPU count of a fused ELMo would miss the LSTMs: ``train_flops_per_step`` does not.
- Elementwise work (softmax, LayerNorm, GELU) is not counted by either side.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ctxmodels.flops import FAMILY_FLOPS, known_peak_flops, measure_matmul_peak, step_flops, train_flops_per_step
from ctxmodels.registry import FAMILIES, build_model

# torch.backends.mkldnn.flags (counted_flops) also sets oneDNN's TF32 switch, which warns on CPU builds.
pytestmark = pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")

torch.set_num_threads(1)

B, T = 4, 24
REL = 1e-9  # the count follows autograd's products one by one: equal, not just close


def _ids(vocab: int, shape: tuple[int, ...], seed: int, low: int = 5) -> torch.Tensor:
    return torch.randint(low, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _masked_labels(ids: torch.Tensor) -> torch.Tensor:
    """Every 5th position from the 2nd predicted (20%, never the first or last token)."""
    labels = torch.full_like(ids, -100)
    labels[:, 1:-1:5] = ids[:, 1:-1:5]
    return labels


def family_batch(family: str, cfg) -> tuple[dict[str, torch.Tensor], int]:
    """(a valid training batch for the tiny model, rows that reach its vocabulary projection)."""
    if family == "elmo":
        ids = _ids(cfg.vocab_size, (B, T), 0)
        chars = _ids(cfg.char_vocab_size, (B, T, cfg.max_chars), 1, low=1)
        return {"char_ids": chars, "input_ids": ids, "reset_memory": torch.ones(B, dtype=torch.long)}, B * (T - 1)
    ids = _ids(cfg.vocab_size, (B, T), 0)
    if family == "awd-lstm":
        return {"input_ids": ids, "reset_memory": torch.ones(B, dtype=torch.long)}, B * (T - 1)
    if family in ("gpt",):
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, B * (T - 1)
    if family == "transformer-xl":
        return {"input_ids": ids, "reset_memory": torch.zeros(B, dtype=torch.long)}, B * (T - 1)
    if family == "xlnet":
        P = math.ceil(T / 6)
        order = torch.stack([torch.randperm(T, generator=torch.Generator().manual_seed(10 + b)) for b in range(B)])
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(T).expand(B, T))  # (B, T)
        perm_mask = (rank[:, None, :] >= rank[:, :, None]).float()  # (B, T, T): j not before i
        targets = order[:, -P:]  # (B, P)
        batch = {
            "input_ids": ids,
            "perm_mask": perm_mask,
            "target_mapping": torch.nn.functional.one_hot(targets, T).float(),  # (B, P, T)
            "labels": ids.gather(1, targets),
            "token_type_ids": (torch.arange(T) >= T // 2).long().expand(B, T),
            "reset_memory": torch.zeros(B, dtype=torch.long),
        }
        return batch, B * P
    labels = _masked_labels(ids)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    n_pred = int((labels != -100).sum())
    if getattr(cfg, "nsp", False) or getattr(cfg, "sop", False):
        batch["next_sentence_label"] = torch.tensor([0, 1] * (B // 2))
        batch["token_type_ids"] = (torch.arange(T) >= T // 2).long().expand(B, T)
    if getattr(cfg, "sbo", False):
        pos = torch.arange(T).expand(B, T)
        batch.update(sbo_left=pos - 1, sbo_right=(pos + 1).clamp(max=T - 1), sbo_pos=torch.zeros_like(ids))
    return batch, n_pred


def counted_flops(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    # oneDNN's fused CPU LSTM (AWD-LSTM's layers) is one op the counter has no formula for: count
    # the products of ATen's own LSTM, which computes the same.
    with sdpa_kernel(SDPBackend.MATH), torch.backends.mkldnn.flags(enabled=False), FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    return counter.get_total_flops()


def test_every_registry_family_has_a_count():
    assert set(FAMILY_FLOPS) == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_count_matches_flop_counter_on_tiny_model(family):
    overrides = {"max_seq_len": T, "mem_len": T} if family in ("transformer-xl", "xlnet") else None
    if family == "awd-lstm":
        overrides = {"bptt": 0}  # one BPTT window: the windows are drawn per batch (test_awd_lstm_count_with_windows)
    cfg, model = build_model(family, "tiny", overrides)
    model.train()
    batch, n_pred = family_batch(family, cfg)
    memory_len = None
    if family in ("transformer-xl", "xlnet"):
        # One step first, so the measured one attends over a full memory (the steady state).
        model(**{**batch, "reset_memory": torch.ones(B, dtype=torch.long)})
        assert model.memory.length == cfg.mem_len
        memory_len = cfg.mem_len
    measured = counted_flops(model, batch)
    ours = train_flops_per_step(family, cfg, B, T, n_predicted=n_pred, memory_len=memory_len)
    assert measured > 0
    assert ours == pytest.approx(measured, rel=REL), (family, ours, measured)


def test_memory_free_first_step_of_transformer_xl():
    cfg, model = build_model("transformer-xl", "tiny", {"max_seq_len": T, "mem_len": T})
    batch, n_pred = family_batch("transformer-xl", cfg)
    measured = counted_flops(model, {**batch, "reset_memory": torch.ones(B, dtype=torch.long)})
    assert train_flops_per_step("transformer-xl", cfg, B, T, n_pred, memory_len=0) == pytest.approx(measured, rel=REL)
    assert train_flops_per_step("transformer-xl", cfg, B, T, n_pred) > measured  # full memory costs more


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported")
def test_fused_elmo_lstm_is_counted_the_same():
    cfg, model = build_model("elmo", "tiny", {"cell_clip": None, "proj_clip": None})
    batch, n_pred = family_batch("elmo", cfg)
    measured = counted_flops(model, batch)
    assert train_flops_per_step("elmo", cfg, B, T, n_pred) == pytest.approx(measured, rel=REL)


def test_backward_is_twice_forward_except_for_constant_operands():
    cfg, _ = build_model("bert", "tiny")
    c = step_flops("bert", cfg, B, T)
    assert c.backward == 2 * c.forward
    cfg, _ = build_model("xlnet", "tiny")
    c = step_flops("xlnet", cfg, B, T)
    assert c.forward < c.backward < 2 * c.forward  # sinusoid projection and target_mapping products


def test_defaults_and_errors():
    cfg, _ = build_model("bert", "tiny")
    assert train_flops_per_step("bert", cfg, 8, 100) == train_flops_per_step("bert", cfg, 8, 100, n_predicted=120)
    # a larger preset costs more per step: ALBERT's shared layers still compute n_layer times
    base = train_flops_per_step("albert", build_model("albert", "tiny", {"n_layer": 8})[0], B, T)
    assert base > train_flops_per_step("albert", build_model("albert", "tiny", {"n_layer": 4})[0], B, T)
    with pytest.raises(ValueError, match="no FLOP count for model family 'bart'"):
        train_flops_per_step("bart", cfg, 8, 100)
    with pytest.raises(ValueError, match="n_predicted"):
        train_flops_per_step("bert", cfg, 8, 100, n_predicted=-1)


def test_known_peaks():
    assert known_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989.5e12)
    assert known_peak_flops("NVIDIA H100 PCIe", torch.float16) == pytest.approx(756e12)
    assert known_peak_flops("NVIDIA H200", "bf16") == pytest.approx(989.5e12)
    assert known_peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == pytest.approx(156e12)
    assert known_peak_flops("NVIDIA A100 80GB PCIe", "fp32") == pytest.approx(19.5e12)
    assert known_peak_flops("NVIDIA A10G", torch.bfloat16) == pytest.approx(125e12)
    assert known_peak_flops("NVIDIA L4", "fp16") == pytest.approx(121e12)
    assert known_peak_flops("Tesla V100-SXM2-16GB", torch.float16) == pytest.approx(125e12)
    assert known_peak_flops("Tesla V100-PCIE-32GB", "fp32") == pytest.approx(14e12)
    assert known_peak_flops("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # Volta has no BF16
    assert known_peak_flops("AMD Instinct MI300X", torch.bfloat16) is None
    # torch.float32 means TF32 once PyTorch may use it for matmuls
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert known_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32) == pytest.approx(19.5e12)
        torch.set_float32_matmul_precision("high")
        assert known_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32) == pytest.approx(156e12)
    finally:
        torch.set_float32_matmul_precision(previous)
    with pytest.raises(ValueError, match="fp8"):
        known_peak_flops("NVIDIA H100", "fp8")


def test_measured_cpu_peak_is_plausible():
    peak = measure_matmul_peak("cpu", torch.float32, n=256, seconds=0.2)
    assert 1e8 < peak < 1e13  # a CPU core does more than 0.1 GFLOP/s and less than 10 TFLOP/s


def test_awd_lstm_count_with_windows(monkeypatch):
    """Each BPTT window's first recurrent product has a constant h_0: counted once per window."""
    from ctxmodels import awd_lstm

    cfg, model = build_model("awd-lstm", "tiny", {"bptt": 8})
    model.train()
    monkeypatch.setattr(awd_lstm, "bptt_windows", lambda T, bptt: [8, 8, 8])  # ceil(24 / 8) windows
    batch, n_pred = family_batch("awd-lstm", cfg)
    measured = counted_flops(model, batch)
    assert train_flops_per_step("awd-lstm", cfg, B, T, n_pred) == pytest.approx(measured, rel=REL)
