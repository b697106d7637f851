"""A Hugging Face GPT-2 folder (random tiny weights and a GPT-2-style byte-level BPE whose only
special token is <|endoftext|>, both built here) reads as the server reads a model (jobs/serving/serve.py
EmbeddingModel: load_checkpoint, the tokenizer's encode_for_model, right padding with
``padding_id``, the last layer, last-token or mean pooling): texts get GPT2Tokenizer's ids (no
[CLS]/[SEP] to add) and transformers' GPT2Model vectors. /v1/generate's prompt and stop token on
such a folder, /tokenize without special tokens, and pretraining's check of the tokenizer against the
objective. In-process, without Serve."""

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


def test_generate_on_a_gpt2_lm_folder_opens_and_stops_with_end_of_text_as_transformers_does(gpt2_folder, tmp_path):
    """/v1/generate's prompt for a GPT-2 tokenizer (no [CLS]/[SEP]) opens with <|endoftext|> and
    stops at it, as GPT-2 samples; greedy tokens from a GPT2LMHeadModel folder equal
    ``generate(do_sample=False)`` of transformers on the same ids."""
    import shutil

    from ctxmodels.checkpoint import load_checkpoint
    from jobs.serving.serve_tasks import generate_ids, generation_prompt
    from pipelines.tokenizers import load_tokenizer

    folder, ref = gpt2_folder
    torch.manual_seed(1)
    lm = transformers.GPT2LMHeadModel(ref.config).eval()
    with torch.no_grad():  # wide weights: at the default init every step repeats one token
        for p in lm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    lm.save_pretrained(tmp_path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folder / name).exists():
            shutil.copy(folder / name, tmp_path / name)
    loaded = load_checkpoint(tmp_path)
    tok = load_tokenizer(loaded.tokenizer_dir)
    eot = tok.special_id("eos")
    ids, stop, placeholder = generation_prompt(tok, "The river bank")
    assert ids[0] == eot and stop == eot and ids[1:] == transformers.GPT2TokenizerFast.from_pretrained(folder)("The river bank")["input_ids"]
    new, finish = generate_ids(loaded.family, loaded.model, ids, 20, stop, placeholder, 0.0, None, None, 0, torch.device("cpu"))
    with torch.no_grad():
        want = lm.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=20,
                           do_sample=False, eos_token_id=eot, pad_token_id=eot)[0, len(ids):].tolist()
    if finish == "stop":  # transformers keeps the end-of-text token it stopped at; the answer does not
        assert want[len(new)] == eot
        want = want[: len(new)]
    assert new == want and len(set(new)) > 1


def test_pretraining_with_a_gpt2_tokenizer_is_checked_against_the_objective_before_ray(gpt2_folder, tmp_path, capsys, monkeypatch):
    """A GPT-2 tokenizer folder suits the causal objectives (pipelines/dataset.py vocab_info);
    masked-LM pretraining with it stops before Ray starts, naming the missing token and the objective."""
    from jobs.training import train
    from jobs.cli import main
    from pipelines.tokenizers import load_tokenizer

    folder, _ = gpt2_folder
    tok = load_tokenizer(folder)
    for name in ("clm", "clm-stream", "plm"):
        train.check_tokenizer_for_objective(tok, name)  # <|endoftext|> stands in for [CLS]/[SEP]/[PAD]
    monkeypatch.setattr(train, "init_ray", lambda *a: pytest.fail("Ray started"))
    code = main(["pretrain", "--config", "configs/bert-tiny.yaml", "--set", f"tokenizer.path={folder}", "--set", f"output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "no mask token" in err and "data.objective 'mlm' writes it" in err, err
    code = main(["pretrain", "--config", "configs/elmo-tiny.yaml", "--set", f"tokenizer.path={folder}", "--set", f"output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "no pad token" in err and "'bilm' gives it its own characters" in err, err


def test_tokenize_without_special_tokens_keeps_every_token_of_a_gpt2_tokenizer(gpt2_folder):
    """A GPT-2 tokenizer adds no [CLS]/[SEP]: add_special_tokens false takes nothing off (it cut the
    first and last real tokens), in this server's /tokenize shape and TEI's alike."""
    import asyncio

    from jobs.serving.serve import EmbeddingModel
    from jobs.serving.serve_config import Limits, ModelConfig
    from jobs.serving.serve_tasks import TokenizeRequest

    folder, _ = gpt2_folder
    want = transformers.GPT2TokenizerFast.from_pretrained(folder)(TEXTS)["input_ids"]
    model = EmbeddingModel.func_or_class("gpt2", str(folder), None, ModelConfig(uri=str(folder)), Limits())

    def ask(**body):
        return asyncio.run(model.task("/tokenize", TokenizeRequest(model="gpt2", **body).payload()))["body"]

    for special in (True, False):
        assert [row["ids"] for row in ask(input=TEXTS, add_special_tokens=special)["data"]] == want
        tei = ask(inputs=TEXTS, add_special_tokens=special)
        assert [[t["id"] for t in row] for row in tei] == want and not any(t["special"] for row in tei for t in row)
