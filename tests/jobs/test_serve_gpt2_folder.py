"""A Hugging Face GPT-2 folder (random tiny weights and a GPT-2-style byte-level BPE whose only
special token is <|endoftext|>, both built here) reads as the server reads a model (jobs/serve.py
EmbeddingModel: load_checkpoint, the tokenizer's encode_for_model, right padding with
``padding_id``, the last layer, last-token or mean pooling): texts get GPT2Tokenizer's ids (no
[CLS]/[SEP] to add) and transformers' GPT2Model vectors. In-process: a replica's constructor needs
a Serve context."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

TEXTS = ["The river bank was muddy.", "She went to the bank", "a", "Café 東京 😀"]


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    from pipelines.sources import sample_text

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(list(sample_text(["data/sample/wordnet-0000-of-0008.txt.gz"], 100_000)), trainer)
    folder = tmp_path_factory.mktemp("gpt2")
    eot = "<|endoftext|>"
    transformers.GPT2TokenizerFast(tokenizer_object=hf, bos_token=eot, eos_token=eot, unk_token=eot).save_pretrained(folder)
    config = transformers.GPT2Config(vocab_size=hf.get_vocab_size(), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ref = transformers.GPT2Model(config).eval()
    with torch.no_grad():  # perturb every weight: a zero bias or unit LayerNorm hides a mapping bug
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ref.save_pretrained(folder, safe_serialization=True)
    return folder, ref


def test_a_gpt2_folder_reads_as_transformers_gpt2(gpt2_folder):
    from ctxmodels import features
    from ctxmodels.checkpoint import load_checkpoint
    from pipelines.tokenizers import load_tokenizer

    folder, ref = gpt2_folder
    loaded = load_checkpoint(folder)
    tok = load_tokenizer(loaded.tokenizer_dir)
    ref_tok = transformers.GPT2TokenizerFast.from_pretrained(folder)
    ids, _, _ = tok.encode_for_model(TEXTS, 64)
    assert ids == ref_tok(TEXTS)["input_ids"]
    T = max(len(r) for r in ids)
    batch = torch.full((len(ids), T), tok.padding_id, dtype=torch.long)  # (B, T), as EmbeddingModel._pad
    mask = torch.zeros((len(ids), T), dtype=torch.long)
    for b, row in enumerate(ids):
        batch[b, : len(row)], mask[b, : len(row)] = torch.tensor(row), 1
    with torch.no_grad():
        hidden = features.token_embeddings(loaded.model.backbone, batch, mask, layers="last")  # (B, T, D)
        mean = features.mean_pool(hidden, mask)
        for b, text in enumerate(TEXTS):
            want = ref(**ref_tok(text, return_tensors="pt")).last_hidden_state[0]  # (T_b, D)
            np.testing.assert_allclose(hidden[b, len(ids[b]) - 1].numpy(), want[-1].numpy(), atol=1e-4)  # pooling "last"
            np.testing.assert_allclose(mean[b].numpy(), want.mean(0).numpy(), atol=1e-4)  # pooling "mean"
