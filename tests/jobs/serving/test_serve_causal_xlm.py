"""An XLM pretrained as a causal LM (objective clm) in the serving replica class, in process (no
Serve): it serves /v1/generate, not /v1/fill-mask, greedy tokens are the prediction layer's argmax at
the last position in the served language, and "cls" pooling is refused as for every causal family."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

TEXTS = ["the river bank was steep", "she took a loan from the bank"]


def test_a_causal_xlm_generates_in_its_language_and_fills_no_mask(tmp_path, minilm_dir):
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model
    from jobs.serving.serve import EmbeddingModel
    from jobs.serving.serve_config import InputError, Limits, ModelConfig
    from jobs.serving.serve_tasks import cannot_serve
    from pipelines.tokenizers import load_tokenizer

    cfg, model = build_model("xlm", "tiny", {"vocab_size": 30522, "type_vocab_size": 2, "causal": True}, seed=0)
    save_checkpoint(tmp_path / "clm", model, "xlm", cfg, tokenizer_dir=minilm_dir)
    replica = EmbeddingModel.func_or_class("clm", str(tmp_path / "clm"), None, ModelConfig(uri=str(tmp_path / "clm"), language=1), Limits())
    info = replica.info()
    assert info["routes"] == ["/v1/embeddings", "/v1/token-embeddings", "/v1/generate", "/tokenize"]
    message = cannot_serve("clm", info, "/v1/fill-mask")
    assert message.startswith("model 'clm' is a pretrained xlm model pretrained as a causal LM (objective clm)"), message

    with pytest.raises(InputError, match="causal xlm model"):
        replica.embed_now(TEXTS, pooling="cls")
    tok = load_tokenizer(minilm_dir)
    ids = replica._encode_ids(TEXTS[:1], truncate=False)[0]
    last = np.stack(replica.embed_now(TEXTS[:1], pooling="last")["embeddings"])[0]
    with torch.inference_mode():
        states = model.eval().backbone.hidden_states(torch.as_tensor(ids)[None], None, torch.ones(1, len(ids), dtype=torch.long))
    np.testing.assert_allclose(last, states[-1][0, -1].numpy(), rtol=1e-4, atol=1e-5)  # language 1, the deployment's

    generated = asyncio.run(replica.task("/v1/generate", {"prompt": "the river", "max_tokens": 6, "temperature": 0.0,
                                                          "top_k": None, "top_p": None, "seed": 0}))
    assert "refused" not in generated, generated
    prompt = [tok.cls_id, *tok.encode_batch(["the river"])[0].tolist()]
    new = []
    with torch.inference_mode():
        for _ in range(6):
            x = torch.tensor([prompt + new])
            nxt = int(model.mlm_logits(x, None, torch.ones_like(x))[0, -1].argmax())
            if nxt == tok.sep_id:
                break
            new.append(nxt)
    assert generated["body"]["choices"][0]["token_ids"] == new
    # a request may name the other language: the greedy tokens of language row 0 (swapped aside by the deployment's)
    in_row_0 = asyncio.run(replica.task("/v1/generate", {"prompt": "the river", "max_tokens": 6, "temperature": 0.0,
                                                         "top_k": None, "top_p": None, "seed": 0, "language": 0}))
    new = []
    with torch.inference_mode():
        for _ in range(6):
            x = torch.tensor([prompt + new])
            nxt = int(model.mlm_logits(x)[0, -1].argmax())
            if nxt == tok.sep_id:
                break
            new.append(nxt)
    assert in_row_0["body"]["choices"][0]["token_ids"] == new != generated["body"]["choices"][0]["token_ids"]  # the two languages write apart
