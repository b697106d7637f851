"""The Ray Serve app over real HTTP: the real all-MiniLM-L6-v2 folder checked against transformers'
BertModel, plus a tiny BERT checkpoint served from a training run folder on S3 (moto).

Serve starts once for the module (two model deployments and the gateway) and is shut down at the end.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests.conftest import serving

pytestmark = pytest.mark.slow

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny_run(s3_server, minilm_dir):
    """s3://bucket/runs/tiny holding a complete checkpoint_000001 and an incomplete checkpoint_000002.

    Yields (run URI, the tiny model's backbone) so tests can compute expected vectors locally."""
    import boto3

    from ctxmodels.checkpoint import load_checkpoint, save_checkpoint
    from ctxmodels.registry import build_model
    from pipelines import storage

    bucket = "serve-tests"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    tmp = Path(tempfile.mkdtemp(prefix="serve-tiny-"))
    try:
        torch.manual_seed(0)
        config, model = build_model("bert", "tiny", {"vocab_size": 30522})  # MiniLM's vocabulary
        ckpt = save_checkpoint(tmp / "checkpoint_000001", model, "bert", config, tokenizer_dir=minilm_dir)
        partial = tmp / "checkpoint_000002"  # newer, but its MANIFEST.json never landed
        partial.mkdir()
        shutil.copy(ckpt / "config.json", partial / "config.json")
        run_uri = f"s3://{bucket}/runs/tiny"
        storage.Store().copy_dir(tmp, run_uri)
        backbone = load_checkpoint(ckpt).model.backbone.eval()
        yield run_uri, backbone
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def client(ray_session, minilm_dir, tiny_run):
    config = {"models": {"minilm": str(minilm_dir), "tiny": tiny_run[0]}, "defaults": {"num_cpus": 0.5, "max_batch_size": 8}}
    with serving(config) as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """Mean-pooled sentence vectors and per-token hidden states from transformers' BertModel."""
    from transformers import AutoTokenizer, BertModel

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    model = BertModel.from_pretrained(str(minilm_dir)).eval()

    def encode(texts: list[str]) -> dict:
        enc = tok(texts, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = model(**enc, output_hidden_states=True)
        mask = enc["attention_mask"][..., None].float()  # (B, T, 1)
        mean = (out.last_hidden_state * mask).sum(1) / mask.sum(1)  # (B, D)
        return {
            "mean": mean.numpy(),
            # what sentence-transformers gives for the folder: mean pooling, then its Normalize module
            "unit": torch.nn.functional.normalize(mean, dim=-1).numpy(),
            "cls": out.last_hidden_state[:, 0].numpy(),
            "hidden": [h.numpy() for h in out.hidden_states],  # n_layer + 1 of (B, T, D)
            "n_tokens": enc["attention_mask"].sum(1).tolist(),
        }

    return encode


def _vectors(body: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])], dtype=np.float32)


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_healthz_and_models(client):
    r = client.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "models": ["minilm", "tiny"]}
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["minilm", "tiny"]


def test_embeddings_of_a_string_match_transformers(client, reference):
    """Unasked, a sentence-transformers folder's own pooling and Normalize module make the vector."""
    text = "A man is playing a guitar."
    r = client.post("/v1/embeddings", json={"model": "minilm", "input": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "minilm"
    assert body["data"][0]["object"] == "embedding" and body["data"][0]["index"] == 0
    got = _vectors(body)
    ref = reference([text])
    assert got.shape == (1, 384)
    np.testing.assert_allclose(got, ref["unit"], atol=TOL)
    assert body["usage"] == {"prompt_tokens": ref["n_tokens"][0], "total_tokens": ref["n_tokens"][0]}


def test_embeddings_of_a_list_match_transformers_and_count_tokens(client, reference):
    texts = ["The cat sits outside.", "A man is playing guitar in the rain on a Tuesday evening.", "hi"]
    r = client.post("/v1/embeddings", json={"model": "minilm", "input": texts, "encoding_format": "float"})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = reference(texts)
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose(_vectors(body), ref["unit"], atol=TOL)
    assert body["usage"]["prompt_tokens"] == sum(ref["n_tokens"]) == body["usage"]["total_tokens"]


def test_pooling_normalize_and_base64(client, reference):
    texts = ["The cat sits outside.", "hi"]
    ref = reference(texts)
    r = client.post("/v1/embeddings", json={"model": "minilm", "input": texts, "pooling": "cls", "normalize": False})
    np.testing.assert_allclose(_vectors(r.json()), ref["cls"], atol=TOL)
    r = client.post("/v1/embeddings", json={"model": "minilm", "input": texts, "normalize": False})
    np.testing.assert_allclose(_vectors(r.json()), ref["mean"], atol=TOL)
    r = client.post("/v1/embeddings", json={"model": "tiny", "input": texts})  # a checkpoint of ours: not normalised
    assert not np.allclose(np.linalg.norm(_vectors(r.json()), axis=1), 1.0, atol=1e-3)
    r = client.post("/v1/embeddings", json={"model": "minilm", "input": texts, "normalize": True})
    got = _vectors(r.json())
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got, ref["unit"], atol=TOL)
    r = client.post("/v1/embeddings", json={"model": "minilm", "input": texts, "encoding_format": "base64", "normalize": False})
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]])
    np.testing.assert_allclose(decoded, ref["mean"], atol=TOL)


def test_concurrent_requests_are_batched_without_mixing_results(client, reference):
    texts = [f"sentence number {i} is about {'cats dogs birds fish'.split()[i % 4]}" for i in range(12)]
    ref = reference(texts)["unit"]

    def one(i: int) -> np.ndarray:
        r = client.post("/v1/embeddings", json={"model": "minilm", "input": texts[i]})
        assert r.status_code == 200, r.text
        return _vectors(r.json())[0]

    with ThreadPoolExecutor(6) as pool:
        got = np.stack(list(pool.map(one, range(len(texts)))))
    np.testing.assert_allclose(got, ref, atol=TOL)


def test_token_embeddings_offsets_layers_and_values(client, reference):
    texts = ["Tokenization isn't trivial!", "the river bank"]
    r = client.post("/v1/token-embeddings", json={"model": "minilm", "input": texts, "layers": "last"})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = reference(texts)
    assert body["model"] == "minilm"
    assert body["usage"]["prompt_tokens"] == sum(ref["n_tokens"])
    for text, item, n in zip(texts, body["data"], ref["n_tokens"]):
        tokens, offsets, vecs = item["tokens"], item["offsets"], np.array(item["embeddings"], dtype=np.float32)
        assert len(tokens) == len(offsets) == len(vecs) == n
        assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
        for token, (s, e) in zip(tokens[1:-1], offsets[1:-1]):
            assert text[s:e].lower() == token.removeprefix("##"), (token, text[s:e])
        assert vecs.shape == (n, 384)
        np.testing.assert_allclose(vecs, ref["hidden"][-1][item["index"], :n], atol=TOL)

    r = client.post("/v1/token-embeddings", json={"model": "minilm", "input": texts[:1], "layers": [0, -1]})
    both = np.array(r.json()["data"][0]["embeddings"], dtype=np.float32)
    r = client.post("/v1/token-embeddings", json={"model": "minilm", "input": texts[:1], "layers": [0]})
    first = np.array(r.json()["data"][0]["embeddings"], dtype=np.float32)
    n = ref["n_tokens"][0]
    assert both.shape == (n, 768) and first.shape == (n, 384)
    np.testing.assert_array_equal(both[:, :384], first)
    np.testing.assert_allclose(first, ref["hidden"][0][0, :n], atol=TOL)
    np.testing.assert_allclose(both[:, 384:], ref["hidden"][-1][0, :n], atol=TOL)


def test_bank_depends_on_context(client):
    texts = ["the river bank", "the bank approved the loan", "the river bank"]
    r = client.post("/v1/token-embeddings", json={"model": "minilm", "input": texts})
    assert r.status_code == 200, r.text
    bank = []
    for text, item in zip(texts, r.json()["data"]):
        i = next(i for i, (s, e) in enumerate(item["offsets"]) if text[s:e] == "bank")
        bank.append(np.array(item["embeddings"][i], dtype=np.float32))
    assert _cos(bank[0], bank[1]) < 0.99  # one word, two senses, two vectors
    np.testing.assert_array_equal(bank[0], bank[2])  # same sentence, same vector


def test_tiny_checkpoint_from_an_s3_run_folder(client, tiny_run, minilm_dir):
    """The run folder resolves to its newest complete checkpoint; vectors equal the local model's."""
    from transformers import AutoTokenizer

    _, backbone = tiny_run
    texts = ["the river bank", "the bank approved the loan"]
    r = client.post("/v1/embeddings", json={"model": "tiny", "input": texts})
    assert r.status_code == 200, r.text
    got = _vectors(r.json())
    enc = AutoTokenizer.from_pretrained(str(minilm_dir))(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = backbone.hidden_states(enc["input_ids"], attention_mask=enc["attention_mask"])[-1]
    mask = enc["attention_mask"][..., None].float()
    expected = ((hidden * mask).sum(1) / mask.sum(1)).numpy()
    assert got.shape == (2, 64)  # the tiny preset's d_model
    np.testing.assert_allclose(got, expected, atol=TOL)


def test_the_run_folder_was_resolved_once_and_the_version_says_which(client, tiny_run):
    """A newer complete checkpoint landing in the run folder after the app was built is not served:
    every answer names checkpoint_000001 and its manifest hash, in the header and in the body."""
    import boto3

    from pipelines import storage

    run_uri, _ = tiny_run
    manifest = boto3.client("s3").get_object(Bucket="serve-tests", Key="runs/tiny/checkpoint_000001/MANIFEST.json")["Body"].read()
    version = f"checkpoint_000001@{hashlib.sha256(manifest).hexdigest()[:16]}"
    with tempfile.TemporaryDirectory() as d:
        storage.Store().download_dir(f"{run_uri}/checkpoint_000001", Path(d) / "c")
        storage.Store().copy_dir(Path(d) / "c", f"{run_uri}/checkpoint_000003")  # newer and complete
    for path, body in [("/v1/embeddings", {"model": "tiny", "input": "x"}), ("/v1/token-embeddings", {"model": "tiny", "input": ["x"]})]:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-model-version"] == r.json()["model_version"] == version
        assert r.headers["x-tokenizer-hash"] == r.json()["tokenizer_hash"]
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["tiny"]["version"] == version and models["tiny"]["dim"] == 64 and models["tiny"]["family"] == "bert"
    assert models["minilm"]["version"].startswith("model@") and models["minilm"]["max_len"] == 256  # its max_seq_length
    own = {"pooling": "mean", "normalize": True, "max_seq_length": 256, "similarity": "cosine"}
    assert models["minilm"]["sentence_transformers"] == own
    assert "sentence_transformers" not in models["tiny"]
    assert (models["minilm"]["pooling"], models["minilm"]["normalize"]) == ("mean", True)  # what a request gets unasked
    assert (models["tiny"]["pooling"], models["tiny"]["normalize"]) == ("mean", False)


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, ["'nope'", "minilm", "tiny"]),
        ("/v1/token-embeddings", {"model": "nope", "input": ["x"]}, 404, ["'nope'", "minilm"]),
        ("/v1/embeddings", {"model": "minilm", "input": []}, 422, ["input", "empty"]),
        ("/v1/embeddings", {"model": "minilm", "input": 42}, 422, ["input", "string", "int"]),
        ("/v1/embeddings", {"model": "minilm", "input": ["ok", None]}, 422, ["input", "item 1"]),
        ("/v1/embeddings", {"input": "x"}, 422, ["model", "missing"]),
        ("/v1/embeddings", {"model": "minilm", "input": "x", "pooling": "max"}, 422, ["pooling"]),
        ("/v1/embeddings", {"model": "minilm", "input": "x", "dimension": 3}, 422, ["dimension", "unknown field"]),
        ("/v1/embeddings", {"model": "minilm", "input": "word " * 600}, 400, ["input[0]", "256 tokens"]),
        ("/v1/embeddings", {"model": "minilm", "input": "x", "language": "fr"}, 400, ["language 'fr'", "no language embeddings"]),
        ("/v1/embeddings", {"model": "minilm", "input": "x", "language": [1]}, 422, ["language"]),
        ("/v1/token-embeddings", {"model": "minilm", "input": ["x"], "layers": [7]}, 400, ["layer 7", "out of range"]),
        ("/v1/token-embeddings", {"model": "minilm", "input": ["x"], "layers": [-8]}, 400, ["layer -8"]),
        ("/v1/token-embeddings", {"model": "minilm", "input": ["x"], "layers": "first"}, 422, ["layers", "last"]),
        ("/v1/token-embeddings", {"model": "minilm", "input": ["x"], "layers": []}, 422, ["layers"]),
        ("/v1/token-embeddings", {"model": "minilm", "input": [1, 2]}, 422, ["input"]),
        ("/v1/embeddings", "{not json", 422, ["JSON"]),
        ("/v1/nothing-here", {}, 404, ["/v1/nothing-here"]),
    ],
)
def test_malformed_requests_get_a_4xx_json_error_naming_the_problem(client, path, body, status, words):
    if isinstance(body, str):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["type"], str) and error["type"]
    for word in words:
        assert word.lower() in error["message"].lower(), (word, error["message"])


def test_wrong_paths_fail_before_serve_starts(tmp_path):
    from jobs.serving.replica import resolve_checkpoint
    from jobs.serving.serve import run
    from pipelines.storage import StorageError

    with pytest.raises(StorageError, match="does not exist"):
        run({"m": str(tmp_path / "nope")}, blocking=False)
    (tmp_path / "run" / "checkpoint_000001").mkdir(parents=True)  # never completed
    with pytest.raises(StorageError, match="complete checkpoint_"):
        resolve_checkpoint(str(tmp_path / "run"))
    (tmp_path / "run" / "checkpoint_000001" / "MANIFEST.json").write_text("{}")  # lists no weights
    with pytest.raises(StorageError, match="complete checkpoint_"):
        resolve_checkpoint(str(tmp_path / "run"))
    from tests.ctxmodels.test_checkpoint import write_small_checkpoint

    write_small_checkpoint(tmp_path / "run" / "checkpoint_000002")
    assert resolve_checkpoint(str(tmp_path / "run")).endswith("checkpoint_000002")


def test_elmo_backbone_reads_token_ids_through_the_char_table(minilm_dir):
    """ELMo's backbone takes characters; the serving wrapper looks them up from token ids."""
    from ctxmodels.elmo import PRESETS, ElmoModel
    from jobs.serving.replica import char_ids_backbone
    from pipelines.char_ids import add_char_ids, build_char_table
    from pipelines.tokenizers import load_tokenizer

    tok = load_tokenizer(minilm_dir)
    torch.manual_seed(0)
    cfg = PRESETS["tiny"]
    elmo = ElmoModel(cfg).eval()
    wrapped = char_ids_backbone(elmo, tok, cfg.max_chars)
    ids = torch.tensor([[tok.cls_id, 2000, 2001, tok.sep_id], [tok.cls_id, 2002, tok.sep_id, tok.pad_id]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    tokens = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    special = {"pad": tok.pad_id, "unk": tok.unk_id, "cls": tok.cls_id, "sep": tok.sep_id, "mask": tok.mask_id}
    table = build_char_table(tokens, cfg.max_chars, special)
    batch = add_char_ids({"input_ids": ids.numpy(), "attention_mask": mask.numpy()}, table)
    char_ids = torch.from_numpy(batch["char_ids"])  # (B, T, C)
    with torch.inference_mode():
        got, expected = wrapped.hidden_states(ids, mask), elmo.hidden_states(char_ids, mask)
    assert len(got) == len(expected) == cfg.n_layer + 1
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
