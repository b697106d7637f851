"""AWD-LSTM checkpoints in the serving replica class, in process (no Serve): a pretrained one answers
/v1/embeddings (no "cls" pooling: a causal family), /v1/token-embeddings (every LSTM's output, of
their own widths) and /v1/generate; a ULMFiT classifier answers /v1/classify with the logits of its
task model."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

TEXTS = ["the river bank was steep", "she took a loan from the bank"]


def _replica(path):
    from jobs.serving.serve import EmbeddingModel
    from jobs.serving.serve_config import Limits, ModelConfig

    return EmbeddingModel.func_or_class("awd", str(path), None, ModelConfig(uri=str(path)), Limits())


def test_pretrained_awd_lstm_serves_embeddings_token_embeddings_and_generation(tmp_path, minilm_dir):
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model
    from jobs.serving.serve_config import InputError

    cfg, model = build_model("awd-lstm", "tiny", {"vocab_size": 30522}, seed=0)
    save_checkpoint(tmp_path / "lm", model, "awd-lstm", cfg, tokenizer_dir=minilm_dir)
    replica = _replica(tmp_path / "lm")
    assert replica.info()["family"] == "awd-lstm" and replica.info()["n_layer"] == 3 and replica.info()["dim"] == cfg.d_model
    assert "/v1/generate" in replica.routes and "/v1/embeddings" in replica.routes

    vectors = np.stack(replica.embed_now(TEXTS)["embeddings"])
    assert vectors.shape == (2, cfg.d_model) and np.isfinite(vectors).all() and not np.allclose(vectors[0], vectors[1])
    ids = replica._encode_ids(TEXTS[:1], truncate=False)[0]
    with torch.inference_mode():
        states = model.eval().backbone.hidden_states(torch.as_tensor(ids)[None])
    np.testing.assert_allclose(vectors[0], states[-1][0].mean(0).numpy(), rtol=1e-4, atol=1e-5)  # mean of the last LSTM
    with pytest.raises(InputError, match="causal"):
        replica.embed_now(TEXTS, pooling="cls")

    async def routes():
        tokens = await replica.token_embeddings(TEXTS, [0, 1, 2, 3])
        generated = await replica.task("/v1/generate", {"prompt": "the river", "max_tokens": 4, "temperature": 0.0,
                                                        "top_k": None, "top_p": None, "seed": 0})
        return tokens, generated

    tokens, generated = asyncio.run(routes())
    assert "refused" not in tokens and "refused" not in generated, (tokens, generated)
    widths = cfg.d_model + 2 * cfg.lstm_dim + cfg.d_model  # embeddings, two 128-wide LSTMs, the last one
    first = np.asarray(tokens["rows"][0]["embeddings"])  # (T, widths): the layers concatenated
    assert first.shape == (tokens["rows"][0]["n_tokens"], widths)
    choice = generated["body"]["choices"][0]
    assert choice["finish_reason"] in ("length", "stop") and len(choice["token_ids"]) <= 4

    # Strategies that add layers of different widths are refused (a 400 naming them), not a failed
    # forward pass; concatenating works at the layers' own widths, which the size cap counts.
    with pytest.raises(InputError, match=r"'sum-all' adds layers of different widths \(\[64, 128, 128, 64\]\)"):
        replica.embed_now(TEXTS, features="sum-all")
    concat = np.stack(replica.embed_now(TEXTS, features="concat-last-four")["embeddings"])
    assert concat.shape == (2, 3 * cfg.lstm_dim + cfg.d_model)  # three blocks padded to four: the first twice
    n_tokens = tokens["rows"][0]["n_tokens"] + tokens["rows"][1]["n_tokens"]
    replica.limits = replica.limits.model_copy(update={"max_token_embedding_values": n_tokens * widths - 1})
    refused = asyncio.run(replica.token_embeddings(TEXTS, [0, 1, 2, 3]))["refused"]
    assert refused[0] == 413 and f"x {widths} values each" in refused[1], refused


def test_ulmfit_classifier_serves_classify(tmp_path, minilm_dir):
    from ctxmodels.checkpoint import load_checkpoint, save_checkpoint
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import TaskConfig, build_task_model

    cfg = make_config("awd-lstm", "tiny", {"vocab_size": 30522})
    task = TaskConfig(kind="classification", num_labels=3, labels=["a", "b", "c"])
    model = build_task_model("awd-lstm", cfg, task, torch.Generator().manual_seed(0))
    with torch.no_grad():  # batch-norm statistics other than the fresh (0, 1), as training leaves them
        model.pool[0].running_mean.uniform_(-0.1, 0.1)
        model.pool[0].running_var.uniform_(0.5, 2.0)
    save_checkpoint(tmp_path / "clf", model, "awd-lstm", cfg, tokenizer_dir=minilm_dir, task=task)
    loaded = load_checkpoint(tmp_path / "clf").model.eval()
    torch.testing.assert_close(loaded.pool[0].running_var, model.pool[0].running_var)  # buffers saved too
    replica = _replica(tmp_path / "clf")
    assert "/v1/classify" in replica.routes

    answer = asyncio.run(replica.task("/v1/classify", {"texts": TEXTS, "pairs": None, "truncate": False}))
    assert "refused" not in answer, answer
    body = answer["body"]
    assert len(body["data"] if isinstance(body, dict) else body) == 2
    from pipelines.tokenizers import load_tokenizer

    tok = load_tokenizer(minilm_dir)
    ids = [torch.as_tensor(tok.encode_for_model([t], 512)[0][0]) for t in TEXTS]
    with torch.inference_mode():
        logits = torch.stack([loaded(input_ids=i[None]).logits[0] for i in ids])
    best = [["a", "b", "c"][int(k)] for k in logits.argmax(-1)]
    rows = body["data"] if isinstance(body, dict) else body
    assert [r["label"] for r in rows] == best, (rows, logits)
