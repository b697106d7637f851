"""BERT / RoBERTa model: head shapes, the masked-only MLM head, sizes, padding, config errors, features."""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ctxmodels import bert, ops
from ctxmodels.bert import PRESETS, BertConfig, BertForPreTraining, BertModel, Packing, length_groups
from ctxmodels.flops import train_flops_per_step
from ctxmodels.features import mean_pool, token_embeddings
from ctxmodels.outputs import PretrainOutput

B, T = 3, 16


def make_batch(cfg: BertConfig, seed: int = 0, mask_every: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, cfg.vocab_size, (B, T), generator=g)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[1, 11:] = 0  # one padded row
    ids[attn == 0] = cfg.pad_token_id
    types = torch.zeros(B, T, dtype=torch.long)
    if cfg.type_vocab_size > 1:
        types[:, T // 2 :] = 1
    labels = torch.full((B, T), -100)
    labels[:, 1::mask_every] = ids[:, 1::mask_every]
    labels[attn == 0] = -100
    nsp = torch.tensor([0, 1, 0])
    return dict(input_ids=ids, attention_mask=attn, token_type_ids=types, labels=labels, next_sentence_label=nsp)


def tiny(preset: str = "tiny", **kw) -> BertForPreTraining:
    torch.manual_seed(0)
    return BertForPreTraining(dataclasses.replace(PRESETS[preset], **kw)).eval()


@pytest.mark.parametrize("preset", ["tiny", "roberta-tiny"])
def test_shapes_of_every_head(preset):
    model = tiny(preset)
    cfg = model.cfg
    batch = make_batch(cfg)
    x = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"])
    states = model.backbone.hidden_states(**x)
    assert len(states) == cfg.n_layer + 1
    assert all(s.shape == (B, T, cfg.d_model) for s in states)
    last, pooled = model.backbone(**x)
    assert last.shape == (B, T, cfg.d_model) and pooled.shape == (B, cfg.d_model)
    torch.testing.assert_close(last, states[-1])
    assert model.mlm_logits(**x).shape == (B, T, cfg.vocab_size)

    if cfg.nsp:
        assert model.nsp_logits(**x).shape == (B, 2)
        out = model(**batch)
        assert set(out.metrics) == {"mlm_loss", "mlm_acc", "n_pred", "nsp_loss", "nsp_acc"}
    else:
        assert model.nsp is None
        with pytest.raises(ValueError, match="NSP"):
            model(**batch)
        batch.pop("next_sentence_label")
        out = model(**batch)
        assert set(out.metrics) == {"mlm_loss", "mlm_acc", "n_pred"}
    assert isinstance(out, PretrainOutput)
    assert out.loss.shape == () and out.loss.requires_grad
    for name, value in out.metrics.items():
        assert value.shape == () and not value.requires_grad, name
    assert int(out.metrics["n_pred"]) == int((batch["labels"] != -100).sum())


def test_hidden_state_zero_is_layer_normed_embedding():
    model = tiny()
    ids = make_batch(model.cfg)["input_ids"]
    emb = model.backbone.embeddings
    expected = F.layer_norm(
        emb.word(ids) + emb.position.weight[:T] + emb.token_type.weight[0], (model.cfg.d_model,), emb.ln.weight, emb.ln.bias,
        model.cfg.layer_norm_eps,
    )
    torch.testing.assert_close(model.backbone.hidden_states(ids)[0], expected)


def test_forward_backward_tiny_is_fast_and_reaches_every_parameter():
    model = tiny().train()
    batch = make_batch(model.cfg)
    for k in ("input_ids", "attention_mask", "token_type_ids", "labels"):
        batch[k] = batch[k].repeat(4, 4)  # (12, 64): a realistic small batch
    batch["next_sentence_label"] = batch["next_sentence_label"].repeat(4)
    model(**batch).loss.backward()  # warm-up
    model.zero_grad()
    start = time.perf_counter()
    out = model(**batch)
    out.loss.backward()
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"tiny forward+backward took {elapsed:.2f} s"
    assert torch.isfinite(out.loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reaches {name}"


@pytest.mark.parametrize("preset", ["tiny", "roberta-tiny"])
def test_masked_only_logits_equal_full_logits_at_those_positions(preset):
    model = tiny(preset)
    batch = make_batch(model.cfg)
    batch.pop("next_sentence_label")
    x = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    labels = batch["labels"]
    selected = labels != -100

    rows_seen = []
    hook = model.mlm.dense.register_forward_hook(lambda m, inp, out: rows_seen.append(inp[0].shape))
    out = model(**batch)
    hook.remove()
    assert rows_seen == [(int(selected.sum()), model.cfg.d_model)], "the MLM head must run on masked rows only"

    full = model.mlm_logits(**x)  # (B, T, V)
    last = model.backbone.hidden_states(**x)[-1]
    gathered = model.mlm(last[selected], model.backbone.embeddings.word.weight)
    torch.testing.assert_close(gathered, full[selected], atol=1e-5, rtol=1e-5)
    expected_loss = F.cross_entropy(full[selected], labels[selected])
    torch.testing.assert_close(out.metrics["mlm_loss"], expected_loss, atol=1e-5, rtol=1e-5)
    expected_acc = (full[selected].argmax(-1) == labels[selected]).float().mean()
    torch.testing.assert_close(out.metrics["mlm_acc"], expected_acc)


def test_loss_is_mlm_plus_nsp_and_no_masked_positions_gives_zero_mlm_loss():
    model = tiny()
    batch = make_batch(model.cfg)
    out = model(**batch)
    torch.testing.assert_close(out.loss.detach(), out.metrics["mlm_loss"] + out.metrics["nsp_loss"])
    pooled = model.backbone(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])[1]
    expected_nsp = F.cross_entropy(model.nsp(pooled), batch["next_sentence_label"])
    torch.testing.assert_close(out.metrics["nsp_loss"], expected_nsp)

    batch["labels"] = torch.full((B, T), -100)
    del batch["next_sentence_label"]
    out = model(**batch)
    assert out.loss.item() == 0.0 and int(out.metrics["n_pred"]) == 0
    out.loss.backward()  # graph stays connected


@pytest.mark.parametrize(("preset", "expected"), [("base", 110e6), ("roberta-base", 125e6)])
def test_parameter_count_of_paper_sizes(preset, expected):
    with torch.device("meta"):  # sizes only: no memory, no init cost
        model = BertForPreTraining(PRESETS[preset])
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - expected) / expected < 0.02, f"{preset}: {n / 1e6:.1f}M parameters"


@pytest.mark.parametrize("preset", ["tiny", "roberta-tiny"])
def test_padding_at_the_end_does_not_change_real_tokens(preset):
    model = tiny(preset)
    cfg = model.cfg
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, cfg.vocab_size, (2, 9), generator=g)
    types = torch.zeros_like(ids)
    short = model.backbone.hidden_states(ids, torch.ones_like(ids), types)

    pad = 7
    ids_p = torch.cat([ids, torch.full((2, pad), cfg.pad_token_id)], dim=1)
    attn_p = torch.cat([torch.ones_like(ids), torch.zeros(2, pad, dtype=torch.long)], dim=1)
    long = model.backbone.hidden_states(ids_p, attn_p, torch.zeros_like(ids_p))
    for layer, (a, b) in enumerate(zip(short, long)):
        torch.testing.assert_close(b[:, :9], a, atol=1e-5, rtol=1e-5, msg=f"layer {layer}")
    # and the attention mask really matters: without it the padding changes real tokens
    unmasked = model.backbone.hidden_states(ids_p, torch.ones_like(ids_p), torch.zeros_like(ids_p))
    assert (unmasked[-1][:, :9] - short[-1]).abs().max() > 1e-3


def test_roberta_positions_start_after_padding_id():
    model = tiny("roberta-tiny")
    ids = torch.tensor([[0, 10, 11, 2, 1, 1]])  # <s> a b </s> <pad> <pad>; pad_token_id = 1
    assert model.backbone.embeddings.position_ids(ids).tolist() == [[2, 3, 4, 5, 1, 1]]
    bert = tiny("tiny")
    assert bert.backbone.embeddings.position_ids(ids).tolist() == [0, 1, 2, 3, 4, 5]


def test_too_long_input_is_refused_with_the_limit():
    model = tiny("roberta-tiny")  # max_seq_len 130 = 128 tokens + pad_token_id + 1
    model.backbone.hidden_states(torch.full((1, 128), 5))
    with pytest.raises(ValueError, match="at most 128 tokens"):
        model.backbone.hidden_states(torch.full((1, 129), 5))


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (dict(d_model=65), "d_model"),
        (dict(n_head=0), "n_head"),
        (dict(dropout=1.5), "dropout"),
        (dict(attn_dropout=-0.1), "attn_dropout"),
        (dict(activation="swish"), "activation"),
        (dict(position_style="relative"), "position_style"),
        (dict(pad_token_id=8000), "pad_token_id"),
        (dict(vocab_size=2.5), "vocab_size"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps"),
    ],
)
def test_bad_config_names_the_field(override, field):
    with pytest.raises(ValueError, match=rf"BertConfig\.{field}\b"):
        dataclasses.replace(PRESETS["tiny"], **override)


def test_presets_are_values():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["tiny"].d_model = 128
    small = dataclasses.replace(PRESETS["tiny"], n_layer=1)
    assert small.n_layer == 1 and PRESETS["tiny"].n_layer == 2
    assert PRESETS["roberta-base"].nsp is False and PRESETS["base"].nsp is True


def test_init_follows_bert():
    torch.manual_seed(0)
    model = BertForPreTraining(PRESETS["mini"])
    w = model.backbone.layers[0].ffn.fc_in.weight
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001
    assert torch.all(model.backbone.layers[0].attn.qkv.bias == 0)
    assert torch.all(model.mlm.bias == 0)
    assert torch.all(model.backbone.layers[1].ln2.weight == 1) and torch.all(model.backbone.layers[1].ln2.bias == 0)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a, b = BertModel(PRESETS["tiny"], generator=g1), BertModel(PRESETS["tiny"], generator=g2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ---- features (serving) ----------------------------------------------------------------------


def test_token_embeddings_concatenate_layers_in_order():
    model = tiny()
    batch = make_batch(model.cfg)
    x = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    states = model.backbone.hidden_states(*x)
    D = model.cfg.d_model
    assert torch.equal(token_embeddings(model.backbone, *x), states[-1])
    feats = token_embeddings(model.backbone, *x, layers=[-1, 0, 1])
    assert feats.shape == (B, T, 3 * D)
    assert torch.equal(feats[..., :D], states[2]) and torch.equal(feats[..., D : 2 * D], states[0])
    assert torch.equal(feats[..., 2 * D :], states[1])
    assert token_embeddings(model.backbone, *x, layers="all").shape == (B, T, 3 * D)
    with pytest.raises(ValueError, match="layer 3 out of range"):
        token_embeddings(model.backbone, *x, layers=[3])
    with pytest.raises(ValueError, match="layer -4 out of range"):
        token_embeddings(model.backbone, *x, layers=[-4])


def test_mean_pool_averages_real_tokens_only():
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    pooled = mean_pool(hidden, mask)
    torch.testing.assert_close(pooled[0], hidden[0, :2].mean(0))
    torch.testing.assert_close(pooled[1], hidden[1].mean(0))
    torch.testing.assert_close(mean_pool(hidden, torch.zeros_like(mask)), torch.zeros(2, 3))


# ---- training kernels (ctxmodels.ops) and the FLOP count ------------------------------------


def test_masked_lm_loss_equals_cross_entropy_with_its_gradients(monkeypatch):
    monkeypatch.setattr(ops, "LOSS_CHUNK_ROWS", 7)  # several row chunks ...
    monkeypatch.setattr(ops, "VOCAB_BLOCK", 40)  # ... and vocabulary blocks, one of them short
    g = torch.Generator().manual_seed(0)
    for n, padding in ((0, 0), (1, 0), (19, 0), (19, 6)):  # padding: rows with target -100 (ops.padded_positions)
        h = torch.randn(n, 16, generator=g, requires_grad=True)
        w = torch.randn(150, 16, generator=g, requires_grad=True)
        b = torch.randn(150, generator=g, requires_grad=True)
        target = torch.randint(0, 150, (n,), generator=g)
        target[torch.randperm(n, generator=g)[:padding]] = -100
        loss, correct = ops.masked_lm_loss(h, w, b, target)
        (3.0 * loss).backward()  # the incoming gradient scales all three
        got = [t.grad for t in (h, w, b)]
        for t in (h, w, b):
            t.grad = None
        logits = F.linear(h, w, b)
        ref = F.cross_entropy(logits, target) if n else logits.sum() * 0.0
        (3.0 * ref).backward()
        torch.testing.assert_close(loss, ref)
        assert int(correct) == int((logits.argmax(-1) == target).sum())
        for a, t in zip(got, (h, w, b)):
            torch.testing.assert_close(a, t.grad, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # evaluation: the loss alone
        loss, _ = ops.masked_lm_loss(h, w, b, target)
    torch.testing.assert_close(loss, ref)


def test_training_gradients_equal_those_of_plain_cross_entropy():
    model = tiny(dropout=0.0, attn_dropout=0.0).train()
    batch = make_batch(model.cfg)
    batch.pop("next_sentence_label")
    model(**batch).loss.backward()
    fused = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    x = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    selected = batch["labels"] != -100
    F.cross_entropy(model.mlm_logits(**x)[selected], batch["labels"][selected]).backward()
    plain = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert fused.keys() == plain.keys()
    for name in fused:
        torch.testing.assert_close(fused[name], plain[name], atol=1e-6, rtol=1e-4, msg=name)


def test_dropout_keeps_one_minus_p_and_preserves_the_mean():
    torch.manual_seed(0)
    x = torch.ones(1000, 1000, requires_grad=True)
    y = ops.dropout(x, 0.1, training=True)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.002
    q = round(0.1 * 2**16) / 2**16  # p as the 16-bit draws resolve it
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / (1 - q)))
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # the same mask and scale flow back
    assert ops.dropout(x, 0.1, training=False) is x and ops.dropout(x, 0.0) is x
    torch.manual_seed(1)
    a = ops.dropout(x, 0.3)
    torch.manual_seed(1)
    assert torch.equal(a, ops.dropout(x, 0.3))  # reproducible under torch.manual_seed


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_embedding_gradient_equals_nn_embeddings_and_reuses_its_buffer(padding_idx):
    """ops.Embedding: nn.Embedding's output and weight gradient, written step after step into one
    buffer (the .grad takes it without a copy); never into memory another tensor still holds."""
    torch.manual_seed(0)
    ours = ops.Embedding(50, 8, padding_idx=padding_idx)
    plain = torch.nn.Embedding(50, 8, padding_idx=padding_idx)
    plain.load_state_dict(ours.state_dict())
    ids = torch.tensor([[3, 7, 7, 1], [3, 0, 49, 7]])
    up = torch.randn(2, 4, 8)

    def grads(module, accumulate: int = 1):
        module.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            (module(ids) * up).sum().backward()
        return module.weight.grad

    expected = grads(plain)
    first = grads(ours)
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    memory = first.data_ptr()
    del first
    again = grads(ours)  # the last .grad was dropped: the same memory, zeroed and filled again
    assert again.data_ptr() == memory
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    # Accumulating micro-batches: the .grad holds the buffer, so the next backward writes elsewhere.
    torch.testing.assert_close(grads(ours, accumulate=3), grads(plain, accumulate=3), rtol=0, atol=0)
    # A caller keeping the gradient: the next step does not overwrite it.
    kept = grads(ours)
    kept_copy = kept.clone()
    ours.zero_grad(set_to_none=True)
    ids2 = ids.flip(0)
    (ours(ids2) * up).sum().backward()
    assert torch.equal(kept, kept_copy) and ours.weight.grad.data_ptr() != kept.data_ptr()
    # The table read twice in one graph: the second backward must not overwrite the first's result.
    ours.zero_grad(set_to_none=True), plain.zero_grad(set_to_none=True)
    (ours(ids).sum() + 3 * (ours(ids2) * up).sum()).backward()
    (plain(ids).sum() + 3 * (plain(ids2) * up).sum()).backward()
    torch.testing.assert_close(ours.weight.grad, plain.weight.grad, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), plain(ids), rtol=0, atol=0)
    # Copies carry no buffer; the state dict is nn.Embedding's.
    assert copy.deepcopy(ours)._grad_buffer is None and ours._grad_buffer is not None
    assert ours.state_dict().keys() == plain.state_dict().keys()


def test_bert_training_gradients_are_unchanged_by_the_embedding_buffer():
    """A whole model's step: every gradient equals the one nn.Embedding gives, on the second step too."""
    model = tiny(dropout=0.0, attn_dropout=0.0).train()
    batch = make_batch(model.cfg)
    word = model.backbone.embeddings.word
    assert isinstance(word, ops.Embedding) and isinstance(word, torch.nn.Embedding)
    plain = torch.nn.Embedding(word.num_embeddings, word.embedding_dim)
    plain.weight = word.weight

    def step():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours = [step(), step()]
    model.backbone.embeddings.word = plain
    reference = step()
    for got in ours:
        assert got.keys() == reference.keys()
        for name in reference:
            torch.testing.assert_close(got[name], reference[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("padded", [False, True])
def test_cpu_training_attention_equals_sdpa(padded):
    model = tiny(attn_dropout=1e-6)  # rounds to no dropped draw: the explicit path, nothing dropped
    attn = model.backbone.layers[0].attn
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, model.cfg.d_model, generator=g)
    mask = None
    if padded:
        mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
        mask[1, ..., 11:] = False
    attn.eval()
    expected = attn(x, mask)  # F.scaled_dot_product_attention
    attn.train()
    torch.testing.assert_close(attn(x, mask), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("train", [False, True])
def test_flop_count_equals_flop_counter(train, monkeypatch):
    """ctxmodels.flops counts the products this model runs: masked rows only through the decoder."""
    monkeypatch.setattr(bert, "GROUP_PAIRS", 0)  # attention in two length groups (16 and 11 tokens)
    model = tiny(nsp=False).train(train)
    batch = make_batch(model.cfg)
    batch.pop("next_sentence_label")
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # CPU flash has no formula
        model(**batch).loss.backward()
    n_pred = int((batch["labels"] != -100).sum())
    real = int(batch["attention_mask"].sum())  # the padded row's padding skips the token-wise layers
    assert real < B * T
    pairs = Packing(batch["attention_mask"]).attention_pairs  # attention on length groups
    assert pairs == 2 * 16**2 + 11**2
    expected = train_flops_per_step("bert", model.cfg, B, T, n_pred, real_tokens=real, attention_pairs=pairs)
    assert counter.get_total_flops() == expected


@pytest.mark.parametrize("padded", [False, True])
def test_packed_encoder_and_first_token_state_equal_the_plain_path(padded):
    """Skipping padding (bert.Packing) and running only [CLS] through the last block change no
    value a caller reads: the real tokens' states, and their gradients."""
    model = tiny(nsp=False, dropout=0.0, attn_dropout=0.0).train()
    batch = make_batch(model.cfg)
    mask = batch["attention_mask"] if padded else torch.ones_like(batch["attention_mask"])
    ids, types = batch["input_ids"], batch["token_type_ids"]
    real = mask.bool()
    packed = model.backbone.hidden_states(ids, mask, types)
    attn_mask = mask.bool()[:, None, None, :] if padded else None
    x = model.backbone.embeddings(ids, types)
    plain = [x]
    for block in model.backbone.layers:  # the (B, T) path, padding included
        x = block(x, attn_mask)
        plain.append(x)
    for a, b in zip(packed, plain):
        torch.testing.assert_close(a[real], b[real], atol=1e-5, rtol=1e-5)
    first = model.backbone.first_token_state(ids, mask, types)
    torch.testing.assert_close(first, plain[-1][:, 0], atol=1e-5, rtol=1e-5)
    (g_fast,) = torch.autograd.grad(first.square().sum(), model.backbone.embeddings.word.weight)
    (g_plain,) = torch.autograd.grad(plain[-1][:, 0].square().sum(), model.backbone.embeddings.word.weight)
    torch.testing.assert_close(g_fast, g_plain, atol=1e-4, rtol=1e-3)  # float rounding of two summation orders


# ----------------------------------------------------------------------------------------------
# Padding skipped on CPU (bert.Packing): token-wise layers on real tokens, attention in length groups
# ----------------------------------------------------------------------------------------------


def test_length_groups_trade_padding_against_calls():
    lengths = [20, 19, 18, 5, 4, 1]
    assert length_groups(lengths, 0) == [1, 1, 1, 1, 1, 1]  # groups cost nothing: no padding at all
    assert length_groups(lengths, 10**9) == [6]  # groups cost everything: one, padded to the longest
    # 3 * 20^2 + 3 * 5^2 + 2 * 100 = 1475 pairs; one group 2500, [2, 1, 3] 1499, each alone 1727
    assert length_groups(lengths, 100) == [3, 3]
    assert length_groups([7, 7, 7], 0) == [3]  # equal lengths are never cut apart
    with pytest.raises(ValueError, match="sorted longest first"):
        length_groups([1, 2], 0)


def lengths_mask(lengths: list[int], T: int) -> torch.Tensor:
    return (torch.arange(T) < torch.tensor(lengths)[:, None]).long()  # (B, T), right-padded


def test_packing_groups_hold_every_real_token_once(monkeypatch):
    monkeypatch.setattr(bert, "GROUP_PAIRS", 0)  # one group per distinct length
    packing = Packing(lengths_mask([3, 1, 5, 5, 2], 5))
    assert packing.group_shapes == [(2, 5), (1, 3), (1, 2), (1, 1)]
    assert packing.attention_pairs == 2 * 25 + 9 + 4 + 1
    x = torch.arange(16.0)[:, None]  # (N, 1): each packed row holds its own index
    groups = packing.groups(x)
    assert [m is None for _, m in groups] == [True, True, True, True]  # each group's rows are full
    torch.testing.assert_close(groups[0][0][:, :, 0], torch.tensor([[4.0, 5, 6, 7, 8], [9, 10, 11, 12, 13]]))
    assert torch.equal(packing.ungroup([g for g, _ in groups]), x)
    rows = torch.arange(5.0)[:, None]  # (B, 1)
    assert [g[:, 0].tolist() for g in packing.group_rows(rows)] == [[2.0, 3.0], [0.0], [4.0], [1.0]]
    assert torch.equal(packing.ungroup_rows(packing.group_rows(rows)), rows)

    monkeypatch.setattr(bert, "GROUP_PAIRS", 10**9)  # one group: the (B, T) layout, padding masked
    (group, mask), = Packing(lengths_mask([3, 1, 5, 5, 2], 5)).groups(x)
    assert group.shape == (5, 5, 1) and mask.shape == (5, 1, 1, 5) and int(mask.sum()) == 16
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        Packing(lengths_mask([3, 0], 5))


def random_lengths(B: int, T: int, seed: int) -> list[int]:
    lengths = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [1, T, *lengths[4:], 1, T]  # length-1 rows and full rows among random ones


@pytest.mark.parametrize("family", ["bert", "roberta", "spanbert"])
@pytest.mark.parametrize("kind", ["token-classification", "classification"])
@pytest.mark.parametrize("attn_dropout", [0.0, 1e-6])  # SDPA; the explicit CPU training attention (drops nothing)
@pytest.mark.parametrize("group_pairs", [0, 10**9])  # one group per length; one group padded to the longest
@pytest.mark.parametrize("rows", ["random", "full"])
def test_skipping_padding_changes_no_loss_logit_or_gradient(family, kind, attn_dropout, group_pairs, rows, monkeypatch):
    """A training step with padding skipped equals the plain (B, T) step (``skip_padding=False``,
    the GPU path): the loss, the logits a caller reads, every parameter's gradient."""
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import TaskConfig, build_task_model

    monkeypatch.setattr(bert, "GROUP_PAIRS", group_pairs)
    cfg = make_config(family, "tiny", {"dropout": 0.0, "attn_dropout": attn_dropout})
    model = build_task_model(family, cfg, TaskConfig(kind=kind, num_labels=5), torch.Generator().manual_seed(0)).train()
    Bn, Tn = 9, 12
    lengths = random_lengths(Bn, Tn, seed=3) if rows == "random" else [Tn] * Bn
    g = torch.Generator().manual_seed(4)
    mask = lengths_mask(lengths, Tn)
    ids = torch.randint(5, cfg.vocab_size, (Bn, Tn), generator=g).masked_fill(mask == 0, cfg.pad_token_id)
    types = (torch.arange(Tn) >= 4).long().expand(Bn, Tn) * mask if cfg.type_vocab_size > 1 else None
    if kind == "token-classification":
        labels = torch.randint(0, 5, (Bn, Tn), generator=g).masked_fill(mask == 0, -100)
    else:
        labels = torch.randint(0, 5, (Bn,), generator=g)
    batch = dict(input_ids=ids, attention_mask=mask, token_type_ids=types, labels=labels)

    def step(skip_padding: bool):
        model.backbone.skip_padding = skip_padding
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    real = mask.bool() if kind == "token-classification" else slice(None)  # padding's logits are read by no one
    assert_same_step(step(True), step(False), real)


def assert_same_step(got, want, real) -> None:
    """Two steps' (output, gradients) agree to 1e-5: the loss, the logits at ``real``, every gradient."""
    (out, grads), (ref, ref_grads) = got, want
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[real], ref.logits[real], atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys() and len(ref_grads) > 0
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")  # SDPA's CPU path for jagged tensors
@pytest.mark.parametrize("family", ["bert", "roberta", "spanbert"])
@pytest.mark.parametrize("kind", ["token-classification", "classification", "question-answering"])
@pytest.mark.parametrize("attn_dropout", [0.0, 1e-6])
@pytest.mark.parametrize("rows", ["random", "full", "holes"])
def test_jagged_attention_changes_no_loss_logit_or_gradient(family, kind, attn_dropout, rows):
    """Padding skipped with attention over nested jagged tensors (``jagged``: what ``train.unpad``
    runs on a GPU, FlashAttention's variable-length kernel there, SDPA's reference path here)
    equals the plain (B, T) step: the loss, the logits a caller reads, every gradient; also for
    masks with padding between real tokens, whose real tokens still form one sequence each."""
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import TaskConfig, build_task_model

    cfg = make_config(family, "tiny", {"dropout": 0.0, "attn_dropout": attn_dropout})
    model = build_task_model(family, cfg, TaskConfig(kind=kind, num_labels=5), torch.Generator().manual_seed(0)).train()
    Bn, Tn = 9, 12
    lengths = random_lengths(Bn, Tn, seed=3) if rows != "full" else [Tn] * Bn
    g = torch.Generator().manual_seed(4)
    mask = lengths_mask(lengths, Tn)
    if rows == "holes":
        mask[:, 2] = 0  # no row's third position is real
        mask[:, 0] = 1
    ids = torch.randint(5, cfg.vocab_size, (Bn, Tn), generator=g).masked_fill(mask == 0, cfg.pad_token_id)
    if kind == "token-classification":
        labels = {"labels": torch.randint(0, 5, (Bn, Tn), generator=g).masked_fill(mask == 0, -100)}
    elif kind == "question-answering":  # the loss below, at real tokens (padding's logits differ: zeros in, bias out)
        labels = {}
    else:
        labels = {"labels": torch.randint(0, 5, (Bn,), generator=g)}
    batch = dict(input_ids=ids, attention_mask=mask, **labels)

    def step(jagged: bool):
        model.backbone.jagged = jagged
        model.backbone.skip_padding = False
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        if kind == "question-answering":
            out.loss = F.cross_entropy(out.logits.masked_fill(mask[..., None] == 0, -1e4).flatten(1), answers)
        out.loss.backward()
        return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    answers = torch.stack([mask[i].nonzero()[int(torch.randint(0, int(mask[i].sum()), (1,), generator=g))] * 2 for i in range(Bn)]).squeeze(1)
    # padding's logits are read by no one; answer spans' (B, T, 2) logits are compared at real tokens
    real = mask.bool() if kind in ("token-classification", "question-answering") else slice(None)
    assert_same_step(step(True), step(False), real)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")  # SDPA's CPU path for jagged tensors
@pytest.mark.parametrize("family", ["bert", "roberta", "spanbert"])
def test_jagged_pretraining_step_equals_the_length_groups_one(family):
    """A padded pretraining step (masked LM; BERT's next-sentence head, SpanBERT's span-boundary
    head) with jagged attention equals the CPU's unpadded step on length groups: loss and every
    gradient (``train.unpad`` is a key of every job's train section)."""
    from ctxmodels.registry import build_model
    from tests.ctxmodels.test_compiling import _loss_and_grads, _padded
    from tests.ctxmodels.test_flops import family_batch

    cfg, model = build_model(family, "tiny", {"vocab_size": 128, "dropout": 0.0, "attn_dropout": 0.0}, seed=0)
    batch = _padded(family_batch(family, cfg)[0])
    model.train()
    groups = _loss_and_grads(model, batch)
    model.backbone.jagged = True
    jagged = _loss_and_grads(model, batch)
    torch.testing.assert_close(jagged[0], groups[0], atol=1e-5, rtol=1e-5)
    assert jagged[1].keys() == groups[1].keys() and groups[1]
    for name, grad in groups[1].items():
        torch.testing.assert_close(jagged[1][name], grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_jagged_packing_offsets_and_lengths_are_the_sequences():
    packing = bert.JaggedPacking(lengths_mask([3, 1, 5], 5))
    assert packing.offsets.tolist() == [0, 3, 4, 9] and (packing.min_len, packing.max_len) == (1, 5)
    assert packing.keep.tolist() == [0, 1, 2, 5, 10, 11, 12, 13, 14]
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        bert.JaggedPacking(lengths_mask([3, 0, 5], 5))


@pytest.mark.parametrize("family", ["bert", "roberta", "albert", "gpt", "xlnet"])
@pytest.mark.parametrize("rows", ["random", "full"])
@pytest.mark.parametrize("skip_padding", [True, False, "jagged"])
@pytest.mark.parametrize("attn_dropout", [0.0, 1e-6])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_labelled_positions_only_changes_no_loss_logit_or_gradient(family, rows, skip_padding, attn_dropout):
    """Token classification trained on its labelled positions only (the last block and the head
    computed there, BertModel.last_hidden_at; other families read the full states) gives the full
    computation's loss, its logits at those positions and every gradient."""
    from ctxmodels import registry
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import TaskConfig, build_task_model

    fields = {f.name for f in dataclasses.fields(registry.family_spec(family).config_cls)}
    if attn_dropout and "attn_dropout" not in fields:
        pytest.skip(f"{family} has no attn_dropout")
    overrides = {"dropout": 0.0, "attn_dropout": attn_dropout}
    cfg = make_config(family, "tiny", {k: v for k, v in overrides.items() if k in fields})
    task = TaskConfig(kind="token-classification", num_labels=5)
    model = build_task_model(family, cfg, task, torch.Generator().manual_seed(0)).train()
    if hasattr(model.backbone, "skip_padding"):
        model.backbone.skip_padding = skip_padding is True
        model.backbone.jagged = skip_padding == "jagged"
    elif skip_padding is not True:
        pytest.skip("only BERT-family backbones skip padding")
    Bn, Tn = 9, 12
    lengths = random_lengths(Bn, Tn, seed=5) if rows == "random" else [Tn] * Bn
    g = torch.Generator().manual_seed(6)
    mask = lengths_mask(lengths, Tn)
    pad_id = getattr(cfg, "pad_token_id", 0)
    ids = torch.randint(5, cfg.vocab_size, (Bn, Tn), generator=g).masked_fill(mask == 0, pad_id)
    labels = torch.randint(0, 5, (Bn, Tn), generator=g)
    unlabelled = torch.rand(Bn, Tn, generator=g) < 0.3  # a word's later pieces, [CLS], [SEP]
    labels = labels.masked_fill(unlabelled | (mask == 0), -100)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)

    def step(**flag):
        model.zero_grad(set_to_none=True)
        out = model(**batch, **flag)
        out.loss.backward()
        return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    fast, fast_grads = step(labelled_positions_only=True)
    full, full_grads = step()
    where = labels != -100
    assert fast.logits.shape == (int(where.sum()), 5)
    torch.testing.assert_close(fast.loss, full.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.logits, full.logits[where], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.metrics["token_acc"], full.metrics["token_acc"])
    assert fast_grads.keys() == full_grads.keys() and len(full_grads) > 0
    for name, grad in full_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")
    if family == "bert" and skip_padding and rows == "random":
        labels_at_padding = labels.masked_fill(mask == 0, 1)
        with pytest.raises(ValueError, match=r"are padding \(attention_mask 0\)"):
            model(**{**batch, "labels": labels_at_padding}, labelled_positions_only=True)


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("subset", [False, True])
def test_packed_attention_equals_its_groups_written_out(p, subset):
    """PackedAttention (every group of a layer in one autograd Function, backward written out)
    equals attention over Packing.groups by plain autograd ops, dropout draws included (the same
    keep_mask over all groups' scores), forward and gradient, for all rows or a subset."""
    H, Dh = 4, 8
    D = H * Dh
    lengths = random_lengths(11, 9, seed=7)
    packing = Packing(lengths_mask(lengths, 9))
    N = sum(lengths)
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(N, 3 * D, generator=g, requires_grad=True)
    rows = torch.tensor(sorted(torch.randperm(N, generator=g)[: N // 2].tolist())) if subset else None
    up = torch.randn(N // 2 if subset else N, D, generator=g)

    torch.manual_seed(1)
    got = bert.PackedAttention.apply(qkv, packing.head_layout(H, torch.float32), p, rows)
    got.backward(up)

    ref_qkv = qkv.detach().clone().requires_grad_()
    torch.manual_seed(1)
    sizes = [b * H * t * t for b, t in packing.group_shapes]
    masks = ops.keep_mask(torch.Size([sum(sizes)]), p, torch.float32).split(sizes) if p > 0 else [None] * len(sizes)
    ys = []
    for (group, mask), drop, (b, t) in zip(packing.groups(ref_qkv), masks, packing.group_shapes):
        q, k, v = group.view(b, t, 3, H, Dh).permute(2, 0, 3, 1, 4)  # 3 x (b, H, t, Dh)
        scores = q @ k.transpose(-1, -2) / Dh**0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = scores.softmax(-1)
        if drop is not None:
            probs = probs * drop.view(b, H, t, t)
        ys.append((probs @ v).transpose(1, 2).reshape(b, t, D))
    ref = packing.ungroup(ys, rows)
    ref.backward(up)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(qkv.grad, ref_qkv.grad, atol=1e-5, rtol=1e-5)
    if p > 0:
        assert not torch.allclose(got, bert.PackedAttention.apply(qkv, packing.head_layout(H, torch.float32), 0.0, rows))


def test_attention_dropout_next_to_one_stays_finite_on_packed_rows():
    """p within 2**-17 of 1 cannot be drawn in 16 bits: packed training attention falls back to
    the path ops.dropout takes there, and nothing turns NaN."""
    attn = bert.SelfAttention(dataclasses.replace(PRESETS["tiny"], attn_dropout=1 - 2**-18)).train()
    packing = Packing(lengths_mask([5, 3, 1], 5))
    y = attn(torch.randn(9, attn.qkv.in_features), None, packing)
    assert y.shape == (9, attn.qkv.in_features) and bool(torch.isfinite(y).all())


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_written_out_feed_forward_equals_autograds(activation):
    """FeedForward on packed (N, D) rows in CPU training (_GeluFeedForward, backward written out,
    the GELU gradient in place) gives autograd's output and gradients."""
    cfg = dataclasses.replace(PRESETS["tiny"], activation=activation)
    torch.manual_seed(0)
    ffn = bert.FeedForward(cfg).train()
    x = torch.randn(37, cfg.d_model, requires_grad=True)
    up = torch.randn(37, cfg.d_model)
    got = ffn(x)
    assert got.grad_fn.name().endswith("_GeluFeedForwardBackward")
    got.backward(up)
    ours = [t.grad.clone() for t in (x, *ffn.parameters())]
    x.grad = None
    ffn.zero_grad()
    ref = ffn.fc_out(ffn.act(ffn.fc_in(x)))
    ref.backward(up)
    torch.testing.assert_close(got, ref)
    for a, b in zip(ours, [t.grad for t in (x, *ffn.parameters())]):
        torch.testing.assert_close(a, b)


def test_full_rows_build_no_packing(monkeypatch):
    """Pretraining packs full rows: a mask of all ones is dropped and nothing is gathered."""
    def refuse(attention_mask):
        raise AssertionError("Packing built for a batch without padding")

    monkeypatch.setattr(bert, "Packing", refuse)
    model = tiny(nsp=False).train()
    batch = make_batch(model.cfg)
    batch.pop("next_sentence_label")
    padded = dict(batch)
    batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
    model(**batch).loss.backward()
    with pytest.raises(AssertionError, match="Packing built"):  # and the spy does see a padded batch
        model(**padded)


# ---------------------------------------------------------------------------------------------
# ops.LayerNorm: the residual stream in bf16 under autocast (issue 25)


def test_layernorm_low_precision_output_normalises_in_fp32_and_returns_the_autocast_dtype():
    torch.manual_seed(0)
    ln = ops.LayerNorm(48, eps=1e-12)
    assert ops.low_precision_layernorms(ln) == 1 and ln.low_precision_output
    torch.nn.init.normal_(ln.weight), torch.nn.init.normal_(ln.bias)
    x = torch.randn(4, 7, 48) * 3 + 1
    want = F.layer_norm(x, (48,), ln.weight, ln.bias, 1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for given in (x, x.bfloat16()):  # the embeddings' fp32 sum, then a bf16 residual stream
            y = ln(given)
            assert y.dtype == torch.bfloat16
            assert torch.equal(y, F.layer_norm(given.float(), (48,), ln.weight, ln.bias, 1e-12).bfloat16())
    assert torch.equal(ln(x), want)  # outside autocast: nn.LayerNorm itself
    ops.low_precision_layernorms(ln, on=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ln(x).dtype == torch.float32  # the switch off: autocast's own (float32) LayerNorm


def test_bert_under_autocast_keeps_a_bf16_residual_stream_and_learns():
    model = tiny()
    assert ops.low_precision_layernorms(model) == 2 * model.cfg.n_layer + 2  # blocks, embeddings, MLM head
    batch = make_batch(model.cfg)
    seen = []
    hooks = [block.register_forward_hook(lambda m, i, out: seen.append(out.dtype)) for block in model.backbone.layers]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(**batch).loss
    for h in hooks:
        h.remove()
    assert seen == [torch.bfloat16] * len(model.backbone.layers)
    ops.low_precision_layernorms(model, on=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(**batch).loss
    ops.low_precision_layernorms(model)
    assert low.item() == pytest.approx(plain.item(), rel=2e-2)  # bf16 rounding of the stream, no more
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    assert all(p.dtype == torch.float32 for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# label_positions: the masked-LM rows as indices found on the host (issue 25)


def _output_and_grads(model, batch, positions, autocast=None):
    """The output of one forward with ``label_positions=positions`` (under ``autocast`` if given)
    and the gradients of its loss; the model's gradients are cleared again."""
    import contextlib

    with autocast or contextlib.nullcontext():
        out = model(**batch, label_positions=positions)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


@pytest.mark.parametrize("family", ["bert", "roberta", "spanbert", "albert"])
def test_label_positions_found_on_the_host_give_the_same_loss_and_gradients(family):
    from ctxmodels.registry import build_model
    from tests.ctxmodels.test_flops import family_batch

    cfg, model = build_model(family, "tiny", {"vocab_size": 128}, seed=0)
    model.eval()
    batch, n_pred = family_batch(family, cfg)
    positions = ops.predicted_positions(batch["labels"])
    assert positions.tolist() == (batch["labels"].reshape(-1) != -100).nonzero().squeeze(1).tolist()
    (found, grads_found), (given, grads_given) = (_output_and_grads(model, batch, p) for p in (None, positions))
    assert torch.equal(found.loss, given.loss)
    assert {k: v.item() for k, v in found.metrics.items()} == {k: v.item() for k, v in given.metrics.items()}
    assert given.metrics["n_pred"].item() == n_pred
    assert grads_found.keys() == grads_given.keys()
    assert all(torch.equal(grads_found[n], grads_given[n]) for n in grads_found)


def test_padded_positions_pad_to_a_multiple_with_a_position_that_has_no_target():
    labels = torch.full((4, 8), -100)
    labels[0, 1], labels[2, 5], labels[3, 7] = 7, 9, 11
    positions = ops.padded_positions(labels, 8)
    assert positions.tolist() == [1, 21, 31] + [0] * 5  # flat index 0 is the first without a target
    assert labels.reshape(-1)[positions].tolist() == [7, 9, 11] + [-100] * 5
    assert ops.padded_positions(labels, 3).tolist() == [1, 21, 31]  # a multiple already
    assert ops.padded_positions(labels, 1).tolist() == [1, 21, 31]
    assert ops.padded_positions(torch.full((2, 4), -100), 8).numel() == 0  # nothing to predict: nothing to pad
    full = torch.arange(6).reshape(2, 3)
    assert ops.padded_positions(full, 4).tolist() == list(range(6))  # never more than B * T, never a target twice
    labels[0, 0] = 5
    assert ops.padded_positions(labels, 8)[4:].tolist() == [2] * 4  # the first position without a target
    with pytest.raises(ValueError, match="multiple must be >= 1"):
        ops.padded_positions(labels, 0)


@pytest.mark.parametrize("family", ["bert", "roberta", "spanbert", "albert"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_padded_label_positions_give_the_unpadded_loss_metrics_and_gradients(family, precision):
    """The positions ``jobs.training.loop.to_device`` gives on a GPU (``ops.padded_positions``: padded with a
    position whose label is -100, so the step's shapes repeat): the same loss, accuracy, count and
    gradients as the unpadded ones, through the fused masked-LM loss (fp32) and the plain one (bf16
    autocast, as on a GPU)."""
    from ctxmodels.registry import build_model
    from tests.ctxmodels.test_flops import family_batch

    cfg, model = build_model(family, "tiny", {"vocab_size": 128}, seed=0)
    model.eval()
    batch, n_pred = family_batch(family, cfg)
    exact = ops.predicted_positions(batch["labels"])
    padded = ops.padded_positions(batch["labels"], 64)
    assert padded.numel() % 64 == 0 and padded.numel() > exact.numel() and torch.equal(padded[: exact.numel()], exact)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else None
    (plain, grads_plain), (pad, grads_pad) = (_output_and_grads(model, batch, p, autocast) for p in (exact, padded))
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(pad.loss, plain.loss, **tol)
    assert pad.metrics["n_pred"].item() == plain.metrics["n_pred"].item() == n_pred
    for name in plain.metrics:
        torch.testing.assert_close(pad.metrics[name].float(), plain.metrics[name].float(), **tol, msg=name)
    assert grads_pad.keys() == grads_plain.keys()
    for name, grad in grads_plain.items():
        torch.testing.assert_close(grads_pad[name], grad, **tol, msg=name)
