"""``ctx embed`` / ``jobs.embed.reembed``: stored texts re-embedded with Ray Data give every id once,
with the vectors the serving code computes (and sentence-transformers' for all-MiniLM-L6-v2), into a
new folder; a second run into a folder that holds vectors is refused and leaves them as they were."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from jobs.embed import reembed
from jobs.registry import Registry
from jobs.serve import EmbeddingModel, checkpoint_version
from jobs.serve_config import Limits, ModelConfig
from pipelines import storage
from tests.conftest import MIXED_TEXTS

TEXTS = [
    *MIXED_TEXTS,
    "bank",
    "The bank raised its interest rates again this quarter, which worried the small savers.",
]
IDS = [907, 3, 41, 1000000007, 12, 5, 88]  # not in row order: rows must keep their own id


def _input_table() -> pa.Table:
    return pa.table({"id": pa.array(IDS, pa.int64()), "text": TEXTS, "lang": ["en"] * len(TEXTS)})


def _serving_vectors(minilm_dir, normalize: bool) -> np.ndarray:
    """What a /v1/embeddings replica computes for TEXTS (the Serve deployment's class, in-process)."""
    model = EmbeddingModel.func_or_class("ref", str(minilm_dir), None, ModelConfig(uri=str(minilm_dir)), Limits())
    return np.stack(model.embed_now(TEXTS, pooling="mean", normalize=normalize, truncate=True)["embeddings"])


def _read(uri: str) -> pa.Table:
    fs, path = storage.filesystem(uri)
    return pads.dataset(path, filesystem=fs, format="parquet").to_table()


def _check_rows(table: pa.Table, expected: np.ndarray, version: str) -> None:
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)  # fixed-size list<float32>[384]
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(IDS)  # every id once
    got = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    by_id = dict(zip(ids, got))
    np.testing.assert_allclose(np.stack([by_id[i] for i in IDS]), expected, atol=1e-5)
    assert set(table.column("model_version").to_pylist()) == {version}
    assert len(set(table.column("tokenizer_hash").to_pylist())) == 1


@pytest.mark.slow
def test_reembed_local_gives_the_serving_vectors_once_per_id_and_never_overwrites(ray_session, minilm_dir, tmp_path):
    src = tmp_path / "texts.parquet"
    pq.write_table(_input_table(), src)
    out = tmp_path / "vectors" / "minilm"
    # the model named as a registry version (the session's SQLite registry), as a scheduled round does
    registry = Registry()
    registered = registry.register("embed-minilm", str(minilm_dir))
    registry.promote("embed-minilm", registered.version)
    summary = reembed("models:/embed-minilm@production", str(src), str(out), batch_size=3)  # 3 batches, the last one short
    version = checkpoint_version(str(minilm_dir))
    assert summary["rows"] == len(IDS) and summary["dim"] == 384 and summary["model_version"] == version
    assert summary["checkpoint"] == str(minilm_dir) and summary["registry_version"] == registered.ref
    _check_rows(_read(str(out)), _serving_vectors(minilm_dir, normalize=False), version)

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(FileExistsError, match="never over them"):
        reembed(str(minilm_dir), str(src), str(out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old vectors are untouched

    with pytest.raises(ValueError, match="no column 'body'.*--text-column"):
        reembed(str(minilm_dir), str(src), str(tmp_path / "other"), text_column="body")


@pytest.mark.slow
def test_reembed_on_s3_normalized_matches_sentence_transformers(ray_session, minilm_dir, s3_bucket):
    st = pytest.importorskip("sentence_transformers")
    fs, _ = storage.filesystem(f"s3://{s3_bucket}")
    with fs.open_output_stream(f"{s3_bucket}/index/texts/part-0.parquet") as f:
        pq.write_table(_input_table(), f)
    out = f"s3://{s3_bucket}/index/vectors/minilm-v1"
    summary = reembed(str(minilm_dir), f"s3://{s3_bucket}/index/texts/", out, normalize=True, batch_size=4)
    assert summary["output"] == out and summary["rows"] == len(IDS)
    expected = _serving_vectors(minilm_dir, normalize=True)
    _check_rows(_read(out), expected, checkpoint_version(str(minilm_dir)))
    reference = st.SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS, batch_size=4, convert_to_numpy=True)
    np.testing.assert_allclose(expected, reference, atol=2e-5)

    with pytest.raises(FileExistsError):  # a second run into the same prefix
        reembed(str(minilm_dir), f"s3://{s3_bucket}/index/texts/", out)


def test_refuses_an_output_that_holds_files_before_starting_ray(tmp_path, minilm_dir):
    from jobs.cli import main

    out = tmp_path / "old-vectors"
    out.mkdir()
    (out / "part-0.parquet").write_bytes(b"old")
    with pytest.raises(FileExistsError, match="old-vectors"):
        reembed(str(minilm_dir), str(tmp_path / "nothing.parquet"), str(out))
    with pytest.raises(SystemExit, match="ctx embed: .*never over them"):  # the command says why, no traceback
        main(["embed", "--model", str(minilm_dir), "--input", str(tmp_path / "nothing.parquet"), "--output", str(out),
              "--id-column", "doc", "--text-column", "body", "--pooling", "cls", "--normalize", "--batch-size", "8"])
    assert (out / "part-0.parquet").read_bytes() == b"old"
