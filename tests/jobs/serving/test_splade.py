"""SPLADE on TEI's ``POST /embed_sparse`` (jobs/serving/serve_tasks.py): each text's weights over the
vocabulary equal sentence-transformers' ``SparseEncoder.encode`` of the same folder (max and sum
pooling, relu and log1p_relu, max_active_dims, prompts), a plain masked-LM folder served with
``splade: true`` answers as TEI's ``--pooling splade`` reads it, /v1/fill-mask's rows batched with
SPLADE's answer as alone, and what is not SPLADE is refused with a message naming why.

No Ray: the Gateway's HTTP app in this process over real HTTP (uvicorn on loopback), its models called
in-process (``InProcessHandle``), as tests/jobs/serving/test_tei_routes.py. The SPLADE model is a tiny
BERT masked LM with MiniLM's vocabulary and seeded weights, saved by sentence-transformers itself."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from jobs.serving.serve import tei_error_type
from tests.conftest import in_process_apps

sparse_encoder = pytest.importorskip("sentence_transformers.sparse_encoder")

TEXTS = ["the bank raised its rates again", "we sat on the bank of the river",
         "a much longer text about the weather, which was cold and wet for the whole of the long week", "hi"]
PROMPTS = {"query": "search query: ", "document": ""}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_dir) -> dict[str, Path]:
    """{name: folder}: a SparseEncoder folder (MLMTransformer + SpladePooling max/relu, with prompts), a copy
    pooling sum of log1p_relu keeping 40 weights, and the plain BertForMaskedLM folder under both."""
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    root = tmp_path_factory.mktemp("splade")
    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                        max_position_embeddings=64)
    mlm = root / "mlm"
    BertForMaskedLM(config).eval().save_pretrained(str(mlm))
    tok.save_pretrained(str(mlm))
    splade = root / "splade"
    sparse_encoder.SparseEncoder(modules=[MLMTransformer(str(mlm)), SpladePooling("max")], prompts=PROMPTS, device="cpu").save(str(splade))
    summed = root / "splade-sum"
    shutil.copytree(splade, summed)
    pool = next(summed.glob("*SpladePooling*")) / "config.json"
    pool.write_text(json.dumps({**json.loads(pool.read_text()), "pooling_strategy": "sum", "activation_function": "log1p_relu"}))
    extra = summed / "config_sentence_transformers.json"
    extra.write_text(json.dumps({**json.loads(extra.read_text()), "max_active_dims": 40}))
    return {"splade": splade, "splade-sum": summed, "mlm": mlm, "mlm-splade": mlm, "minilm": minilm_dir}


SETTINGS = {"mlm-splade": {"splade": True}, "mlm": {}}  # the plain masked LM: TEI's --pooling splade, and not


@pytest.fixture(scope="module")
def urls(folders):
    """{name: base URL}: one Gateway app per model (TEI serves one), each on a loopback port in this process."""
    with in_process_apps({name: (str(path), SETTINGS.get(name, {})) for name, path in folders.items()}) as urls:
        yield urls


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, timeout=60)


def tei_error(r: httpx.Response) -> str:
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == tei_error_type(r.status_code), r.text
    return body["error"]


def dense(answer: list[dict], vocab: int) -> np.ndarray:
    """One /embed_sparse vector as (V,): its entries strictly by token id, every weight > 0."""
    out = np.zeros(vocab, dtype=np.float32)
    indices = [e["index"] for e in answer]
    assert indices == sorted(set(indices)) and all(e["value"] > 0 for e in answer)
    out[indices] = [e["value"] for e in answer]
    return out


def st_encode(folder: Path, texts: list[str], **kwargs) -> np.ndarray:
    model = sparse_encoder.SparseEncoder(str(folder), device="cpu")
    return model.encode(texts, convert_to_tensor=True, convert_to_sparse_tensor=False, batch_size=3, **kwargs).numpy()


def test_embed_sparse_equals_sentence_transformers_sparse_encoder(urls, folders):
    r = post(urls["splade"], "/embed_sparse", {"inputs": TEXTS})
    assert r.status_code == 200, r.text
    expected = st_encode(folders["splade"], TEXTS)
    got = np.stack([dense(row, expected.shape[1]) for row in r.json()])
    np.testing.assert_allclose(got, expected, atol=1e-5)
    # one string: a list of one vector, as TEI (alone, its pass is padded otherwise: equal within float32 rounding);
    # POST / reads a SPLADE model's body as /embed_sparse
    one = post(urls["splade"], "/embed_sparse", {"inputs": TEXTS[1]}).json()
    assert len(one) == 1
    np.testing.assert_allclose(dense(one[0], expected.shape[1]), got[1], atol=1e-6)
    assert post(urls["splade"], "/", {"inputs": TEXTS[1]}).json() == one
    info = httpx.get(f"{urls['splade']}/info", timeout=30).json()
    assert info["model_type"] == {"embedding": {"pooling": "splade"}}
    models = httpx.get(f"{urls['splade']}/v1/models", timeout=30).json()["data"][0]
    assert "/embed_sparse" in models["routes"] and models["sentence_transformers"]["splade"] == {
        "pooling": "max", "activation": "relu", "max_active_dims": None}


def test_prompts_sum_pooling_log1p_relu_and_max_active_dims_as_sentence_transformers(urls, folders):
    r = post(urls["splade"], "/embed_sparse", {"inputs": TEXTS, "prompt_name": "query"})
    expected = st_encode(folders["splade"], TEXTS, prompt_name="query")
    np.testing.assert_allclose(np.stack([dense(row, expected.shape[1]) for row in r.json()]), expected, atol=1e-5)
    r = post(urls["splade"], "/embed_sparse", {"inputs": TEXTS, "prompt_name": "passage"})
    assert r.status_code == 400 and "prompt_name 'passage'" in tei_error(r) and "'query'" in tei_error(r)

    r = post(urls["splade-sum"], "/embed_sparse", {"inputs": TEXTS})
    expected = st_encode(folders["splade-sum"], TEXTS)  # its max_active_dims: 40 read from the folder by both
    assert all(len(row) == 40 for row in r.json()) and ((expected > 0).sum(1) == 40).all()
    np.testing.assert_allclose(np.stack([dense(row, expected.shape[1]) for row in r.json()]), expected, rtol=1e-5, atol=1e-4)


def test_a_masked_lm_folder_with_splade_set_is_teis_pooling_splade(urls):
    ours = post(urls["mlm-splade"], "/embed_sparse", {"inputs": TEXTS}).json()
    st_folder = post(urls["splade"], "/embed_sparse", {"inputs": TEXTS}).json()  # the same weights, saved as a SparseEncoder
    for a, b in zip(ours, st_folder):
        assert [e["index"] for e in a] == [e["index"] for e in b]
        np.testing.assert_allclose([e["value"] for e in a], [e["value"] for e in b], atol=1e-6)
    listed = httpx.get(f"{urls['mlm-splade']}/v1/models", timeout=30).json()["data"][0]
    assert listed["splade"] == {"pooling": "max", "activation": "relu", "max_active_dims": None} and "/embed_sparse" in listed["routes"]
    # Not set, the same folder serves dense vectors and fill-mask only, and says how to get SPLADE's.
    r = post(urls["mlm"], "/embed_sparse", {"inputs": TEXTS})
    assert r.status_code == 400 and "served for dense vectors (splade is not set)" in tei_error(r)
    assert post(urls["mlm"], "/", {"inputs": TEXTS[0]}).status_code == 200  # /embed: its mean-pooled vectors


def test_what_is_not_splade_is_refused_and_named(urls, folders):
    r = post(urls["minilm"], "/embed_sparse", {"inputs": TEXTS[0]})
    assert r.status_code == 400
    assert "whose checkpoint has no trained masked-LM head" in tei_error(r) and "/embed_sparse needs a SPLADE model" in tei_error(r)
    # A SPLADE model's dense vectors need a pooling named: /embed has none to name.
    r = post(urls["splade"], "/embed", {"inputs": TEXTS[0]})
    assert r.status_code == 400 and "POST /embed_sparse" in tei_error(r)
    r = post(urls["splade"], "/v1/embeddings", {"model": "splade", "input": TEXTS[0], "pooling": "mean"})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64
    # too long, not cut: a 400 as on /embed; cut: an answer
    long = " ".join(["word"] * 100)
    r = post(urls["splade"], "/embed_sparse", {"inputs": [TEXTS[0], long]})
    assert r.status_code == 400 and "input[1] is longer than the 64 tokens" in tei_error(r)
    assert post(urls["splade"], "/embed_sparse", {"inputs": [long], "truncate": True}).status_code == 200
    # splade: true on a model without a masked-LM head: refused at load, named
    from jobs.serving.serve import EmbeddingModel
    from jobs.serving.serve_config import Limits, ModelConfig

    with pytest.raises(ValueError, match="splade is set, but model 'bare' is a pretrained bert model whose checkpoint has no trained masked-LM head"):
        EmbeddingModel.func_or_class("bare", str(folders["minilm"]), None, ModelConfig(uri=str(folders["minilm"]), splade=True), Limits())


def test_fill_mask_and_splade_rows_in_one_pass_answer_as_alone(urls):
    url = urls["splade"]
    masked = ["the [MASK] raised its rates", "we sat on the [MASK] of the river"]
    alone_sparse = post(url, "/embed_sparse", {"inputs": TEXTS}).json()
    alone_fill = post(url, "/v1/fill-mask", {"model": "splade", "input": masked, "top_k": 3}).json()["data"]

    async def together():
        async with httpx.AsyncClient(timeout=60) as client:
            calls = []
            for _ in range(3):
                calls.append(client.post(f"{url}/embed_sparse", json={"inputs": TEXTS}))
                calls.append(client.post(f"{url}/v1/fill-mask", json={"model": "splade", "input": masked, "top_k": 3}))
            return await asyncio.gather(*calls)

    answers = asyncio.run(together())
    for k, r in enumerate(answers):
        assert r.status_code == 200, r.text
        if k % 2 == 0:
            for a, b in zip(r.json(), alone_sparse):
                assert [e["index"] for e in a] == [e["index"] for e in b]
                np.testing.assert_allclose([e["value"] for e in a], [e["value"] for e in b], atol=1e-5)
        else:
            got = r.json()["data"]
            assert [[p["token_id"] for p in m["predictions"]] for d in got for m in d["masks"]] == \
                   [[p["token_id"] for p in m["predictions"]] for d in alone_fill for m in d["masks"]]


def test_one_forward_pass_of_fill_mask_and_splade_rows_equals_each_alone(folders):
    """The replica's masked-LM pass with both kinds of row (``_rows_forward``): one pass, each row's output as
    in a pass of its own kind."""
    from jobs.serving.serve import EmbeddingModel
    from jobs.serving.serve_config import Limits, ModelConfig

    uri = str(folders["splade"])
    replica = EmbeddingModel.func_or_class("splade", uri, None, ModelConfig(uri=uri), Limits())
    ids = replica._encode_ids(["the [MASK] raised its rates", *TEXTS], truncate=False)
    fill = {"input_ids": ids[0], "positions": np.flatnonzero(ids[0] == replica.tokenizer.mask_id)}
    sparse = [{"input_ids": row} for row in ids[1:]]
    replica.recent_passes.clear()
    mixed = replica._rows_forward([sparse[0], fill, *sparse[1:]])
    assert len(replica.recent_passes) == 1  # one pass, both kinds
    alone = replica._rows_forward(sparse)
    np.testing.assert_allclose(mixed[1][0], replica._rows_forward([fill])[0][0], atol=1e-6)
    for (got, _), (want, _) in zip([mixed[0], *mixed[2:]], alone):
        np.testing.assert_array_equal(got["indices"], want["indices"])
        np.testing.assert_allclose(got["values"], want["values"], atol=1e-6)


def test_the_head_in_chunks_across_texts_pools_as_in_one(folders, monkeypatch):
    """``splade_rows`` sends 512 positions at a time through the head: a chunk that ends inside a text
    (here 5 positions a chunk) pools to the same vectors as one chunk of everything."""
    import jobs.serving.serve_tasks as tasks
    from jobs.serving.serve import EmbeddingModel
    from jobs.serving.serve_config import Limits, ModelConfig

    uri = str(folders["splade-sum"])  # sum pooling: a position counted twice or lost would show
    replica = EmbeddingModel.func_or_class("splade-sum", uri, None, ModelConfig(uri=uri), Limits())
    rows = [{"input_ids": row} for row in replica._encode_ids(TEXTS, truncate=False)]
    whole = replica._rows_forward(rows)
    monkeypatch.setattr(tasks, "SPLADE_CHUNK_TOKENS", 5)
    for (got, _), (want, _) in zip(replica._rows_forward(rows), whole):
        np.testing.assert_array_equal(got["indices"], want["indices"])
        np.testing.assert_allclose(got["values"], want["values"], rtol=1e-6, atol=1e-6)


def test_local_model_encode_sparse_is_sparse_encoders_encode(folders):
    from jobs.serving.local import LocalModel

    with LocalModel(str(folders["splade"]), dtype="float32") as model:
        got = model.encode_sparse(TEXTS)
        assert got.is_sparse and got.shape == (len(TEXTS), 30522)
        expected = st_encode(folders["splade"], TEXTS, prompt_name="query")
        np.testing.assert_allclose(model.encode_sparse(TEXTS, prompt_name="query", convert_to_sparse_tensor=False).numpy(), expected, atol=1e-5)
        np.testing.assert_allclose(got.to_dense().numpy(), st_encode(folders["splade"], TEXTS), atol=1e-5)
    with LocalModel(str(folders["minilm"])) as dense_model, pytest.raises(ValueError, match="/embed_sparse needs a SPLADE model"):
        dense_model.encode_sparse(TEXTS)


def test_ctx_embed_stores_a_splade_models_sparse_vectors_and_refuses_dense_options(folders, tmp_path, capsys):
    """``ctx embed`` (the local engine) on a SparseEncoder folder: each row's vector as {indices, values}
    (its nonzero weights by token id, SparseEncoder.encode's), the prompt asked taken; --pooling stores the
    backbone's dense vectors instead; int8, binary and --dimensions, dense vectors' options, are refused
    in one line before a file is written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.cli import main
    from jobs.serving.embed import SPARSE_TYPE

    src = tmp_path / "texts.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "text": TEXTS}), src)
    for name, flags, keywords in (("plain", [], {}), ("query", ["--prompt-name", "query"], {"prompt_name": "query"})):
        code = main(["embed", "--model", str(folders["splade"]), "--input", str(src), "--output", str(tmp_path / name), "--engine", "local", *flags])
        assert code == 0, capsys.readouterr().err
        summary = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert summary["sparse"] is True and summary["dim"] is None and summary["rows"] == len(TEXTS)
        table = pq.read_table(tmp_path / name).sort_by("id")
        assert table.schema.field("embedding").type == SPARSE_TYPE
        got = np.zeros((len(TEXTS), 30522), np.float32)
        for i, row in enumerate(table.column("embedding").to_pylist()):
            assert row["indices"] == sorted(row["indices"]) and len(row["indices"]) == len(row["values"]) > 0
            got[i, row["indices"]] = row["values"]
        np.testing.assert_allclose(got, st_encode(folders["splade"], TEXTS, **keywords), atol=1e-5)
    code = main(["embed", "--model", str(folders["splade"]), "--input", str(src), "--output", str(tmp_path / "dense"), "--engine", "local",
                 "--pooling", "mean"])
    assert code == 0 and json.loads(capsys.readouterr().out.splitlines()[-1])["dim"] == 64
    for flags in (["--precision", "int8"], ["--precision", "binary"], ["--dimensions", "8"]):
        out = tmp_path / "refused"
        code = main(["embed", "--model", str(folders["splade"]), "--input", str(src), "--output", str(out), "--engine", "local", *flags])
        err = capsys.readouterr().err
        assert code == 2 and "is a SPLADE model: its vectors are stored sparse" in err and flags[0] in err, err
        assert not out.exists() or not any(out.iterdir())
