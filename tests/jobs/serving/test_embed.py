"""``ctx embed`` / ``jobs.serving.embed.reembed``: stored texts re-embedded with Ray Data give every id once,
with the vectors the serving code computes (and sentence-transformers' for all-MiniLM-L6-v2), into a
new folder; a second run into a folder that holds vectors is refused and leaves them as they were.
An actor sorts the rows Ray Data hands it into small length-sorted forward passes; the command prints
rows, seconds and rows/s, and none of Ray Data's own log lines without --verbose."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from jobs.serving.embed import Embedder, reembed
from jobs.registry import Registry
from jobs.identity import checkpoint_version
from jobs.serving.serve import EmbeddingModel
from jobs.serving.serve_config import Limits, ModelConfig
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


def _check_quantized(out: Path | str, expected: np.ndarray, precision: str, calibration_rows: int | None = None) -> np.ndarray:
    """The vectors at ``out`` are sentence-transformers' ``quantize_embeddings`` of the float32 serving vectors
    ``expected``: sign bits for binary; for int8/uint8, levels cut in the ranges ``_embed.json`` keeps, which
    are the minima and maxima of ``calibration_rows`` of the rows' vectors. Returns those ranges (None for binary)."""
    from itertools import combinations

    from sentence_transformers.quantization import quantize_embeddings

    table = _read(str(out))
    kind = pa.int8() if precision in ("int8", "binary") else pa.uint8()
    width = 384 // 8 if precision.endswith("binary") else 384
    assert table.schema.field("embedding").type == pa.list_(kind, width)
    by_id = dict(zip(table.column("id").to_pylist(), np.asarray(table.column("embedding").to_pylist())))
    assert sorted(by_id) == sorted(IDS)
    got = np.stack([by_id[i] for i in IDS])
    ranges = None
    if precision.endswith("binary"):
        offset = 128 if precision == "binary" else 0  # binary: the bytes offset by -128 into int8

        def bits(packed: np.ndarray) -> np.ndarray:
            return np.unpackbits((packed.astype(np.int16) + offset).astype(np.uint8), axis=-1)

        same = bits(got) == bits(quantize_embeddings(expected, precision))
        assert np.all(same | (np.abs(expected) < 1e-5))  # a sign may differ only where the value is all but 0
    else:
        ranges = np.asarray(json.loads((Path(str(out)) / "_embed.json").read_text())["ranges"], np.float32)
        assert ranges.shape == (2, 384)
        subsets = [np.vstack([expected[list(c)].min(0), expected[list(c)].max(0)]) for c in combinations(range(len(IDS)), calibration_rows)]
        assert any(np.allclose(ranges, r, atol=2e-6) for r in subsets)  # the ranges of that many of the rows' vectors
        ref = quantize_embeddings(expected, precision, ranges=ranges)
        # a value 1e-6 from theirs may sit a level over; the calibration rows' own extremes sit on the first and last level's edge
        assert np.abs(got.astype(np.int16) - ref.astype(np.int16)).max() <= 1
        assert np.mean(got == ref) > 0.95
    return ranges


@pytest.mark.slow
def test_reembed_local_gives_the_serving_vectors_once_per_id_and_never_overwrites(ray_session, minilm_dir, tmp_path):
    src = tmp_path / "texts.parquet"
    pq.write_table(_input_table(), src)
    out = tmp_path / "vectors" / "minilm"
    # the model named as a registry version (the session's SQLite registry), as a scheduled round does
    registry = Registry()
    registered = registry.register("embed-minilm", str(minilm_dir))
    registry.promote("embed-minilm", registered.version)
    # Ray Data hands the actor 3 rows at a time (the last call 1 row), run in passes of at most 2; the input is
    # small, so the driver reads it and hands Ray Data in-memory blocks (DRIVER_READ_BYTES)
    summary = reembed("models:/embed-minilm@production", str(src), str(out), actor_batch_size=3, batch_size=2)
    version = checkpoint_version(str(minilm_dir))
    assert summary["rows"] == len(IDS) and summary["dim"] == 384 and summary["model_version"] == version
    assert summary["checkpoint"] == str(minilm_dir) and summary["registry_version"] == registered.ref
    assert summary["actors"] >= 1 and summary["seconds"] > 0
    assert summary["rows_per_s"] == pytest.approx(summary["rows"] / summary["seconds"], rel=0.02, abs=0.06)  # rounded to 0.1
    _check_rows(_read(str(out)), _serving_vectors(minilm_dir, normalize=True), version)  # unasked: the folder's Normalize module

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(FileExistsError, match="never over them"):
        reembed(str(minilm_dir), str(src), str(out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the old vectors are untouched

    # a run that lost a file's rows (as one stopped before writing them): --resume embeds those rows only, through the pool
    lost = sorted(out.glob("*.parquet"))[0]
    lost_rows = pq.read_metadata(lost).num_rows
    lost.unlink()
    resumed = reembed("models:/embed-minilm@production", str(src), str(out), actor_batch_size=3, batch_size=2, resume=True)
    assert resumed["engine"] == "ray" and resumed["resumed"] == len(IDS) - lost_rows and resumed["rows"] == len(IDS)
    _check_rows(_read(str(out)), _serving_vectors(minilm_dir, normalize=True), version)

    with pytest.raises(ValueError, match="no column 'body'.*--text-column"):
        reembed(str(minilm_dir), str(src), str(tmp_path / "other"), text_column="body")


@pytest.mark.slow
def test_reembed_on_s3_normalized_matches_sentence_transformers(ray_session, minilm_dir, s3_bucket):
    st = pytest.importorskip("sentence_transformers")
    fs, _ = storage.filesystem(f"s3://{s3_bucket}")
    with fs.open_output_stream(f"{s3_bucket}/index/texts/part-0.parquet") as f:
        pq.write_table(_input_table(), f)
    out = f"s3://{s3_bucket}/index/vectors/minilm-v1"
    # streamed from the store by Ray Data's read tasks, as an input over DRIVER_READ_BYTES is
    summary = reembed(str(minilm_dir), f"s3://{s3_bucket}/index/texts/", out, normalize=True, actor_batch_size=4, driver_read_bytes=0)
    assert summary["output"] == out and summary["rows"] == len(IDS)
    expected = _serving_vectors(minilm_dir, normalize=True)
    _check_rows(_read(out), expected, checkpoint_version(str(minilm_dir)))
    # JSON lines streamed the same way, by Ray Data's read_json: one file as it is, one gzipped, one zstd (.zst,
    # which the driver reads as a stream: pyarrow.dataset does not undo it)
    lines = [json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(IDS, TEXTS)]
    with fs.open_output_stream(f"{s3_bucket}/index/docs/part-0.jsonl") as f:
        f.write("".join(lines[:3]).encode())
    with fs.open_output_stream(f"{s3_bucket}/index/docs/part-1.jsonl.gz", compression="gzip") as f:
        f.write("".join(lines[3:5]).encode())
    with fs.open_output_stream(f"{s3_bucket}/index/docs/part-2.jsonl.zst", compression="zstd") as f:
        f.write("".join(lines[5:]).encode())
    summary = reembed(str(minilm_dir), f"s3://{s3_bucket}/index/docs/", out + "-jsonl", actor_batch_size=4, driver_read_bytes=0)
    assert summary["engine"] == "ray" and summary["rows"] == len(IDS)
    _check_rows(_read(out + "-jsonl"), expected, checkpoint_version(str(minilm_dir)))
    # an object of it lost, then --resume: the streamed input's read tasks leave out the ids already there
    written = sorted(i.path for i in fs.get_file_info(pafs.FileSelector(f"{s3_bucket}/index/vectors/minilm-v1-jsonl")) if i.path.endswith(".parquet"))
    lost_rows = pq.read_metadata(written[0], filesystem=fs).num_rows
    fs.delete_file(written[0])
    summary = reembed(str(minilm_dir), f"s3://{s3_bucket}/index/docs/", out + "-jsonl", actor_batch_size=4, driver_read_bytes=0, resume=True)
    assert summary["resumed"] == len(IDS) - lost_rows and summary["rows"] == len(IDS)
    _check_rows(_read(out + "-jsonl"), expected, checkpoint_version(str(minilm_dir)))
    reference = st.SentenceTransformer(str(minilm_dir), device="cpu").encode(TEXTS, batch_size=4, convert_to_numpy=True)
    np.testing.assert_allclose(expected, reference, atol=2e-5)

    with pytest.raises(FileExistsError):  # a second run into the same prefix
        reembed(str(minilm_dir), f"s3://{s3_bucket}/index/texts/", out)


@pytest.mark.slow
def test_embed_dataset_adds_the_serving_vectors_to_any_dataset_keeping_its_columns(ray_session, minilm_dir):
    """A user's own Ray Dataset (here from items, with columns of its own): every row back once, its
    columns as they were, and the /v1/embeddings vector of its text in a new column."""
    from jobs.serving.embed import embed_dataset

    rows = [{"doc": i, "body": t, "lang": "en"} for i, t in zip(IDS, TEXTS)]
    ds = ray_session.data.from_items(rows, override_num_blocks=3)
    with pytest.raises(ValueError, match="no column 'text'.*body"):
        embed_dataset(ds, str(minilm_dir))
    with pytest.raises(ValueError, match="already has a column 'lang'"):
        embed_dataset(ds, str(minilm_dir), text_column="body", output_column="lang")
    out = embed_dataset(ds, str(minilm_dir), text_column="body", normalize=True, actor_batch_size=3, batch_size=2).to_arrow_refs()
    table = pa.concat_tables(ray_session.get(out))
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 384)
    assert sorted(table.column("doc").to_pylist()) == sorted(IDS) and set(table.column("lang").to_pylist()) == {"en"}
    by_id = dict(zip(table.column("doc").to_pylist(), np.asarray(table.column("embedding").to_pylist(), np.float32)))
    assert all(dict(zip(IDS, TEXTS))[d] == b for d, b in zip(table.column("doc").to_pylist(), table.column("body").to_pylist()))
    np.testing.assert_allclose(np.stack([by_id[i] for i in IDS]), _serving_vectors(minilm_dir, normalize=True), atol=1e-5)


@pytest.mark.slow
def test_the_ray_engine_takes_prompts_and_dimensions_and_refuses_a_prompt_the_model_lacks_in_one_line(ray_session, minilm_dir, tmp_path):
    """The options reach every actor of the pool (``reembed`` and ``embed_dataset``), and a model that
    cannot take them is refused before the pool starts with the model's own message, not Ray's
    traceback text of an actor's failed batch."""
    from sentence_transformers import SentenceTransformer

    from jobs.serving.embed import embed_dataset

    folder = _prompted_folder(minilm_dir, tmp_path)
    src = tmp_path / "texts.parquet"
    pq.write_table(_input_table(), src)
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, prompt_name="passage", truncate_dim=32, normalize_embeddings=True)
    summary = reembed(str(folder), str(src), str(tmp_path / "v"), prompt_name="passage", dimensions=32, actor_batch_size=3)
    assert summary["engine"] == "ray" and summary["dim"] == 32
    table = _read(str(tmp_path / "v"))
    by_id = dict(zip(table.column("id").to_pylist(), np.asarray(table.column("embedding").to_pylist(), np.float32)))
    np.testing.assert_allclose(np.stack([by_id[i] for i in IDS]), expected, atol=2e-5)

    ds = ray_session.data.from_items([{"body": t} for t in TEXTS])
    out = pa.concat_tables(ray_session.get(embed_dataset(ds, str(folder), text_column="body", prompt_name="passage", dimensions=32).to_arrow_refs()))
    by_text = dict(zip(out.column("body").to_pylist(), np.asarray(out.column("embedding").to_pylist(), np.float32)))
    np.testing.assert_allclose(np.stack([by_text[t] for t in TEXTS]), expected, atol=2e-5)

    # int8: the ranges from 4 rows' vectors, embedded by a Ray task (the driver loads no model), reach every actor
    summary = reembed(str(minilm_dir), str(src), str(tmp_path / "int8"), precision="int8", calibration_rows=4, actor_batch_size=3)
    assert summary["engine"] == "ray" and summary["precision"] == "int8" and summary["dim"] == 384
    ranges = _check_quantized(tmp_path / "int8", _serving_vectors(minilm_dir, normalize=True), "int8", calibration_rows=4)
    # embed_dataset takes the ranges (what a user quantizes queries with too); ones of another width are refused up front
    ds_texts = ray_session.data.from_items([{"body": t} for t in TEXTS])
    out = pa.concat_tables(ray_session.get(embed_dataset(ds_texts, str(minilm_dir), text_column="body", precision="int8",
                                                         ranges=ranges).to_arrow_refs()))
    by_text = dict(zip(out.column("body").to_pylist(), np.asarray(out.column("embedding").to_pylist())))
    assert out.schema.field("embedding").type == pa.list_(pa.int8(), 384)
    stored = _read(str(tmp_path / "int8"))
    for i, vector in zip(stored.column("id").to_pylist(), stored.column("embedding").to_pylist()):
        assert np.abs(by_text[TEXTS[IDS.index(i)]].astype(np.int16) - np.asarray(vector, np.int16)).max() <= 1
    with pytest.raises(ValueError, match=r"^precision 'int8' needs ranges"):
        embed_dataset(ds_texts, str(minilm_dir), text_column="body", precision="int8")
    with pytest.raises(ValueError, match=r"^ranges for 32 dimensions: the vectors have 384$"):
        embed_dataset(ds_texts, str(minilm_dir), text_column="body", precision="int8", ranges=ranges[:, :32])

    with pytest.raises(ValueError, match=r"^prompt_name 'document': model '.*prompted' has no such prompt \(its prompts: 'query', 'passage'\)$"):
        reembed(str(folder), str(src), str(tmp_path / "refused"), prompt_name="document")
    assert not (tmp_path / "refused").exists()
    with pytest.raises(ValueError, match=r"^dimensions 500: model"):
        embed_dataset(ds, str(folder), text_column="body", dimensions=500)


def test_the_local_engine_gives_the_serving_vectors_in_files_of_local_file_rows(minilm_dir, tmp_path, monkeypatch):
    """engine="local" (what "auto" picks for a small input with no cluster): this process embeds, no Ray."""
    import jobs.serving.embed

    monkeypatch.setattr(jobs.serving.embed, "LOCAL_FILE_ROWS", 4)  # 7 rows in chunks of 3, 3, 1: files of 6 and 1 rows
    src = tmp_path / "texts.parquet"
    pq.write_table(_input_table(), src)
    out = tmp_path / "vectors"
    summary = reembed(str(minilm_dir), str(src), str(out), actor_batch_size=3, batch_size=2, engine="local")
    assert summary["engine"] == "local" and summary["actors"] == 0 and summary["rows"] == len(IDS)
    assert sorted(pq.read_metadata(f).num_rows for f in out.glob("*.parquet")) == [1, 6]
    _check_rows(_read(str(out)), _serving_vectors(minilm_dir, normalize=True), checkpoint_version(str(minilm_dir)))
    raw = reembed(str(minilm_dir), str(src), str(tmp_path / "raw"), normalize=False, engine="local")  # --no-normalize
    _check_rows(_read(raw["output"]), _serving_vectors(minilm_dir, normalize=False), checkpoint_version(str(minilm_dir)))
    with pytest.raises(FileExistsError, match="never over them"):
        reembed(str(minilm_dir), str(src), str(out), engine="local")
    with pytest.raises(ValueError, match="engine 'spark'"):
        reembed(str(minilm_dir), str(src), str(tmp_path / "other"), engine="spark")


def _prompted_folder(minilm_dir: Path, tmp_path: Path) -> Path:
    """all-MiniLM-L6-v2 with E5-style prompts ("query: ", "passage: "), the default one "query", as an
    asymmetric retrieval model's folder says them (the weights linked, not copied)."""
    folder = tmp_path / "prompted"
    folder.mkdir()
    for item in minilm_dir.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "config_sentence_transformers.json").unlink()
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query", "similarity_fn_name": "cosine"}))
    return folder


def test_prompts_and_dimensions_give_sentence_transformers_vectors_and_a_model_that_lacks_them_is_refused(minilm_dir, tmp_path, capsys):
    """``ctx embed --prompt-name/--prompt/--dimensions`` (the local engine): a document index of an
    E5-style model is embedded with its "passage" prompt, as sentence-transformers'
    ``encode(prompt_name="passage")``, not with the folder's default (query) prompt; ``--dimensions``
    keeps the first components re-normalised, as ``encode(truncate_dim=..., normalize_embeddings=True)``.
    What the model cannot take is one line and status 2, before a file is written."""
    from sentence_transformers import SentenceTransformer

    from jobs.cli import main

    folder = _prompted_folder(minilm_dir, tmp_path)
    src = tmp_path / "texts.parquet"
    pq.write_table(_input_table(), src)
    reference = SentenceTransformer(str(folder), device="cpu")
    version = checkpoint_version(str(folder))
    cases = {
        "default": ([], {}),
        "passage": (["--prompt-name", "passage"], {"prompt_name": "passage"}),
        "title": (["--prompt", "title: "], {"prompt": "title: "}),
        "passage64": (["--prompt-name", "passage", "--dimensions", "64"],
                      {"prompt_name": "passage", "truncate_dim": 64, "normalize_embeddings": True}),
    }
    for name, (flags, keywords) in cases.items():
        code = main(["embed", "--model", str(folder), "--input", str(src), "--output", str(tmp_path / name), "--engine", "local", *flags])
        assert code == 0, capsys.readouterr().err
        summary = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert summary["dim"] == keywords.get("truncate_dim", 384)
        table = _read(str(tmp_path / name))
        assert table.schema.field("embedding").type == pa.list_(pa.float32(), summary["dim"])
        by_id = dict(zip(table.column("id").to_pylist(), np.asarray(table.column("embedding").to_pylist(), np.float32)))
        np.testing.assert_allclose(np.stack([by_id[i] for i in IDS]), reference.encode(TEXTS, **keywords), atol=2e-5)
        assert set(table.column("model_version").to_pylist()) == {version}
    default, passage = (np.asarray(_read(str(tmp_path / n)).sort_by("id").column("embedding").to_pylist()) for n in ("default", "passage"))
    assert not np.allclose(default, passage, atol=1e-3)  # the prompt did change the vectors

    for flags, said in (
        (["--prompt-name", "document"], r"prompt_name 'document': model '.*prompted' has no such prompt \(its prompts: 'query', 'passage'\)"),
        (["--dimensions", "512"], r"dimensions 512: model '.*prompted' gives 384-dimensional vectors"),
        (["--dimensions", "0"], r"dimensions \(0\) must be at least 1"),
    ):
        out = tmp_path / "refused"
        code = main(["embed", "--model", str(folder), "--input", str(src), "--output", str(out), "--engine", "local", *flags])
        err = capsys.readouterr().err
        assert code == 2 and re.search(r"^ctx: error: " + said, err), err
        assert not out.exists() or not any(out.iterdir())  # nothing written
    with pytest.raises(SystemExit):  # argparse: one or the other
        main(["embed", "--model", str(folder), "--input", str(src), "--output", str(tmp_path / "x"), "--prompt", "a", "--prompt-name", "passage"])
    with pytest.raises(ValueError, match="prompt and prompt_name: give one of them"):
        reembed(str(folder), str(src), str(tmp_path / "x"), prompt="a", prompt_name="passage")


def test_a_run_stopped_midway_resumes_embedding_only_the_ids_it_lacks(minilm_dir, tmp_path, monkeypatch, capsys):
    """``--resume`` (the local engine): a run that died after its first file goes on with the rows whose
    ids the folder lacks, in new files numbered after its own, and ends with every id once and the
    serving vectors; the model embeds none of the rows written before. A file cut short by the stop is
    deleted and its rows embedded again. A resume with other settings, or into a folder no ctx embed run
    wrote, is refused before anything is embedded."""
    import jobs.serving.embed
    from jobs.cli import main

    monkeypatch.setattr(jobs.serving.embed, "LOCAL_FILE_ROWS", 2)  # 7 rows in chunks of 2: a file per chunk
    src = tmp_path / "texts.parquet"
    pq.write_table(_input_table(), src)
    out = tmp_path / "vectors"
    embedded: list[str] = []
    call = Embedder.__call__
    dies_after = [0]  # rows embedded before the machine goes away: a run stopped before its first file, then after two

    def dies_at_the_third_chunk(self, batch):
        if len(embedded) == dies_after[0]:
            raise RuntimeError("the machine went away")
        embedded.extend(batch.column("text").to_pylist())
        return call(self, batch)

    monkeypatch.setattr(Embedder, "__call__", dies_at_the_third_chunk)
    common = ["embed", "--model", str(minilm_dir), "--input", str(src), "--output", str(out), "--engine", "local", "--actor-batch-size", "2"]
    with pytest.raises(RuntimeError, match="went away"):
        main(common)
    assert [p.name for p in out.iterdir()] == ["_embed.json"]  # stopped before its first file
    dies_after[0] = 4
    with pytest.raises(RuntimeError, match="went away"):
        main([*common, "--resume"])
    assert sorted(p.name for p in out.glob("*.parquet")) == ["embeddings-00000.parquet", "embeddings-00001.parquet"]
    assert json.loads((out / "_embed.json").read_text())["model_version"] == checkpoint_version(str(minilm_dir))
    code = main(common)  # without --resume: refused, as before
    assert code == 2 and "--resume" in capsys.readouterr().err

    for flags, said in ((["--no-normalize"], r"normalize: None then, False now"),
                        (["--dimensions", "64"], r"dimensions: None then, 64 now")):
        code = main([*common, "--resume", *flags])
        err = capsys.readouterr().err
        assert code == 2 and re.search(r"^ctx: error: --output .* holds vectors made otherwise \(" + said, err), err
    assert len(embedded) == 4  # nothing embedded by the refused runs

    # the second file cut short, as a writer that stops mid-file leaves it (the Ray engine writes in place):
    # it is deleted, said, and its rows are embedded again with the rest
    cut = out / "embeddings-00001.parquet"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    embedded.clear()
    dies_after[0] = -1  # the machine stays
    assert main([*common, "--resume"]) == 0
    said = capsys.readouterr()
    summary = json.loads(said.out.splitlines()[-1])
    assert summary["resumed"] == 2 and summary["rows"] == len(IDS)
    deleted, progress = said.err.strip().splitlines()
    assert re.fullmatch(r"ctx embed: deleted .*/vectors/embeddings-00001\.parquet, cut short when the earlier run stopped "
                        r"\(.*\); its rows are embedded again", deleted), deleted
    # the progress line (stderr, no terminal: at the end, and every PROGRESS_EVERY_S) counts this run's rows
    assert re.fullmatch(r"embed: 5/5 rows \(100%\) \| [\d,]+ rows/s \| ETA 00:00", progress), progress
    assert sorted(embedded) == sorted(TEXTS[2:])  # only the rows the folder lacked
    assert sorted(p.name for p in out.glob("*.parquet")) == [f"embeddings-0000{i}.parquet" for i in range(4)]
    _check_rows(_read(str(out)), _serving_vectors(minilm_dir, normalize=True), checkpoint_version(str(minilm_dir)))
    embedded.clear()
    assert main([*common, "--resume"]) == 0 and json.loads(capsys.readouterr().out.splitlines()[-1])["resumed"] == len(IDS)
    assert embedded == []  # a finished folder: nothing left to embed

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    pq.write_table(_input_table(), foreign / "part-0.parquet")
    code = main(["embed", "--model", str(minilm_dir), "--input", str(src), "--output", str(foreign), "--engine", "local", "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and "holds files but no _embed.json" in err, err
    fresh = tmp_path / "fresh"  # --resume of a folder that is not there: a first run
    assert main(["embed", "--model", str(minilm_dir), "--input", str(src), "--output", str(fresh), "--engine", "local", "--resume",
                 "--no-progress"]) == 0
    said = capsys.readouterr()
    assert json.loads(said.out.splitlines()[-1])["resumed"] == 0 and said.err == ""


def test_int8_and_binary_vectors_are_sentence_transformers_quantized_ones_and_a_resume_keeps_the_ranges(minilm_dir, tmp_path,
                                                                                                       monkeypatch, capsys):
    """``--precision`` stores sentence-transformers' quantized vectors: binary/ubinary the sign bits 8 a byte;
    int8/uint8 levels in ranges taken from ``--calibration-rows`` input rows' vectors and kept in _embed.json,
    which a resumed run uses again (its files' levels are the first run's) and a changed precision is refused."""
    import jobs.serving.embed
    from jobs.cli import main

    pytest.importorskip("sentence_transformers")
    monkeypatch.setattr(jobs.serving.embed, "LOCAL_FILE_ROWS", 2)  # 7 rows: files of 2, 2, 2 and 1
    src = tmp_path / "texts.parquet"
    pq.write_table(_input_table(), src)
    expected = _serving_vectors(minilm_dir, normalize=True)
    common = ["embed", "--model", str(minilm_dir), "--input", str(src), "--engine", "local", "--actor-batch-size", "2", "--no-progress"]
    for precision in ("binary", "ubinary"):
        assert main([*common, "--output", str(tmp_path / precision), "--precision", precision]) == 0
        summary = json.loads(capsys.readouterr().out.splitlines()[-1])
        assert summary["precision"] == precision and summary["dim"] == 48 and summary["rows"] == len(IDS)
        _check_quantized(tmp_path / precision, expected, precision)
    assert main([*common, "--output", str(tmp_path / "int8"), "--precision", "int8", "--calibration-rows", "100"]) == 0
    ranges = _check_quantized(tmp_path / "int8", expected, "int8", calibration_rows=len(IDS))  # all 7 rows: fewer than asked
    np.testing.assert_allclose(ranges, np.vstack([expected.min(0), expected.max(0)]), atol=2e-6)

    out = tmp_path / "uint8"
    assert main([*common, "--output", str(out), "--precision", "uint8", "--calibration-rows", "3"]) == 0
    ranges = _check_quantized(out, expected, "uint8", calibration_rows=3)
    assert not np.allclose(ranges, np.vstack([expected.min(0), expected.max(0)]))  # 3 rows' ranges are narrower: values clip
    (out / "embeddings-00001.parquet").unlink()  # a file lost: --resume embeds its rows at the first run's levels
    assert main([*common, "--output", str(out), "--precision", "uint8", "--resume"]) == 0  # --calibration-rows: the first run's stand
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["resumed"] == len(IDS) - 2
    np.testing.assert_array_equal(_check_quantized(out, expected, "uint8", calibration_rows=3), ranges)
    code = main([*common, "--output", str(out), "--precision", "int8", "--calibration-rows", "3", "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and re.search(r"holds vectors made otherwise \(precision: 'uint8' then, 'int8' now\)", err), err
    with pytest.raises(SystemExit, match="2"):
        main([*common, "--output", str(tmp_path / "refused"), "--precision", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"calibration_rows \(1\) must be at least 2"):
        reembed(str(minilm_dir), str(src), str(tmp_path / "refused"), precision="int8", calibration_rows=1, engine="local")
    pq.write_table(_input_table().slice(0, 1), tmp_path / "one.parquet")
    with pytest.raises(ValueError, match=r"precision 'uint8' takes each dimension's range from the input's vectors, and one row has none"):
        reembed(str(minilm_dir), str(tmp_path / "one.parquet"), str(tmp_path / "refused"), precision="uint8", engine="local")
    assert not (tmp_path / "refused").exists()


def test_refuses_an_output_that_holds_files_before_starting_ray(tmp_path, minilm_dir, capsys):
    from jobs.cli import main

    out = tmp_path / "old-vectors"
    out.mkdir()
    (out / "part-0.parquet").write_bytes(b"old")
    with pytest.raises(FileExistsError, match="old-vectors"):
        reembed(str(minilm_dir), str(tmp_path / "nothing.parquet"), str(out))
    code = main(["embed", "--model", str(minilm_dir), "--input", str(tmp_path / "nothing.parquet"), "--output", str(out),
                 "--id-column", "doc", "--text-column", "body", "--pooling", "cls", "--normalize", "--batch-size", "8"])
    err = capsys.readouterr().err
    assert code == 2 and re.search(r"^ctx: error: .*never over them", err), err  # the command says why, no traceback
    assert (out / "part-0.parquet").read_bytes() == b"old"


def test_json_lines_and_csv_inputs_give_the_parquet_inputs_vectors(minilm_dir, tmp_path, capsys):
    """``--input`` of JSON lines (.jsonl, .json) or CSV, a file or a folder of one kind, plain or compressed
    whole (.gz, .bz2, .lz4, .zst: the driver streams this one, pyarrow.dataset does not undo it), is read as
    Parquet is (the local engine here; the Ray engine streams it with read_json / read_csv, on S3 above); a
    folder that mixes kinds, a .json that is one JSON array, a compressed Parquet file or a zstd one ending
    .zstd (which Ray Data's readers do not undo) is refused naming the input."""
    import gzip

    from jobs.cli import main

    rows = [{"id": i, "text": t, "extra": {"lang": "en"}} for i, t in zip(IDS, TEXTS)]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "part-0.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:3]) + "\n")
    (tmp_path / "docs" / "part-1.json").write_text("\n".join(json.dumps(r) for r in rows[3:5]) + "\n")
    with gzip.open(tmp_path / "docs" / "part-2.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows[5:]) + "\n")
    (tmp_path / "docs" / "_SUCCESS").write_text("")
    pa_csv = pytest.importorskip("pyarrow.csv")
    csv_table = _input_table().drop_columns(["lang"])
    pa_csv.write_csv(csv_table, tmp_path / "texts.csv")  # quotes, commas and newlines as CSV says
    for codec, ending in (("bz2", "bz2"), ("lz4", "lz4"), ("zstd", "zst"), ("zstd", "zstd")):
        with pa.CompressedOutputStream(str(tmp_path / f"texts.csv.{ending}"), codec) as f:
            pa_csv.write_csv(csv_table, f)
    (tmp_path / "zdocs").mkdir()  # the Pile's shards are .jsonl.zst; here beside a plain and a gzipped one
    for k, (codec, ending) in enumerate(((None, ""), ("gzip", ".gz"), ("zstd", ".zst"))):
        with pa.output_stream(str(tmp_path / "zdocs" / f"part-{k}.jsonl{ending}"), compression=codec) as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows[3 * k : 3 * k + 3]).encode())
    expected = _serving_vectors(minilm_dir, normalize=True)
    for name, source in (("jsonl", tmp_path / "docs"), ("csv", tmp_path / "texts.csv"), ("csv-bz2", tmp_path / "texts.csv.bz2"),
                         ("csv-lz4", tmp_path / "texts.csv.lz4"), ("csv-zst", tmp_path / "texts.csv.zst"), ("jsonl-zst", tmp_path / "zdocs")):
        code = main(["embed", "--model", str(minilm_dir), "--input", str(source), "--output", str(tmp_path / name), "--engine", "local"])
        assert code == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["rows"] == len(IDS)
        _check_rows(_read(str(tmp_path / name)), expected, checkpoint_version(str(minilm_dir)))

    pq.write_table(_input_table(), tmp_path / "docs" / "more.parquet")
    (tmp_path / "array.json").write_text(json.dumps(rows))
    from backports import zstd  # `zstd --long=28` streaming: a 256 MiB window, over the 128 MiB Arrow's decoder takes

    co = zstd.ZstdCompressor(options={zstd.CompressionParameter.window_log: 28, zstd.CompressionParameter.enable_long_distance_matching: True})
    (tmp_path / "long.jsonl.zst").write_bytes(co.compress(b"".join(json.dumps(r).encode() + b"\n" for r in rows), mode=co.CONTINUE)
                                              + co.flush(mode=co.FLUSH_FRAME))
    (tmp_path / "gz").mkdir()
    with gzip.open(tmp_path / "gz" / "texts.parquet.gz", "wb") as f:
        pq.write_table(_input_table(), f)
    for source, said in ((tmp_path / "docs", r"the folder mixes json and parquet files; give a folder of one kind"),
                         (tmp_path / "array.json", r"not readable as JSON lines \(one object a line\)"),
                         (tmp_path / "gz", r"no Parquet, JSON lines or CSV file \(.*JSON lines and CSV also as \.gz/\.bz2/\.lz4/\.zst\) there"),
                         (tmp_path / "texts.csv.zstd", r"texts\.csv\.zstd is compressed with a codec read here only as \.gz/\.bz2/\.lz4/\.zst: "
                                                       r"rename it \.zst$"),
                         (tmp_path / "long.jsonl.zst", r"long\.jsonl\.zst cannot be decompressed \(.*too much memory.*\): .*"
                                                       r"recompress it without --long$")):
        code = main(["embed", "--model", str(minilm_dir), "--input", str(source), "--output", str(tmp_path / "refused"), "--engine", "local"])
        err = capsys.readouterr().err
        assert code == 2 and re.search(r"^ctx: error: --input .*" + said, err), err


def test_one_run_writes_into_an_output_folder_at_a_time(minilm_dir, tmp_path, capsys):
    """While a run holds the output folder's lock (another ``ctx embed`` still going), a second run into it,
    fresh or ``--resume``, is refused naming the holder before a vector is written; once the lock is released
    the run goes and leaves no lock behind; a lock whose heartbeat stopped an hour ago (its process died) is
    taken over."""
    from jobs.cli import main
    from jobs.serving.embed import RUN_LOCK
    from jobs.runlock import LockInfo, RunLock, RunLockHeld

    src = tmp_path / "texts.parquet"
    pq.write_table(_input_table(), src)
    out = tmp_path / "vectors"
    holder = RunLock(str(out), command="ctx embed", name=RUN_LOCK).acquire()
    try:
        said = rf"the output folder {out} is in use by ctx embed on .*, pid {os.getpid()} .*would write the same rows twice"
        for resume in (False, True):
            with pytest.raises(RunLockHeld, match=said):
                reembed(str(minilm_dir), str(src), str(out), engine="local", resume=resume)
        code = main(["embed", "--model", str(minilm_dir), "--input", str(src), "--output", str(out), "--resume"])
        err = capsys.readouterr().err
        assert code == 2 and re.search(r"^ctx: error: " + said, err), err
        assert sorted(p.name for p in out.iterdir()) == [RUN_LOCK]  # nothing written beside the holder's lock
    finally:
        holder.release()
    summary = reembed(str(minilm_dir), str(src), str(out), engine="local")
    assert summary["rows"] == len(IDS) and not (out / RUN_LOCK).exists()
    expected = _serving_vectors(minilm_dir, normalize=True)  # unasked: the folder's Normalize module
    _check_rows(_read(str(out)), expected, checkpoint_version(str(minilm_dir)))

    dead = tmp_path / "vectors-dead"
    dead.mkdir()
    now = time.time()
    (dead / RUN_LOCK).write_bytes(LockInfo("0" * 32, "elsewhere", 1, "ctx embed", now - 3700, now - 3600).to_bytes())
    summary = reembed(str(minilm_dir), str(src), str(dead), engine="local")
    assert summary["rows"] == len(IDS) and not (dead / RUN_LOCK).exists()
    assert "took over the stale run lock" in capsys.readouterr().err
    _check_rows(_read(str(dead)), expected, checkpoint_version(str(minilm_dir)))


def test_a_streamed_input_answers_the_drivers_calls_as_pyarrow_dataset_does(tmp_path):
    """``_StreamedInput`` (how the driver reads .zst files) gives what pyarrow.dataset gives over the same
    rows: schema, counts with and without a filter, the first rows a filter keeps, sorted picks spanning
    files and batches, the whole table."""
    import pyarrow.compute as pc

    from jobs.serving.embed import _StreamedInput

    n = 5000  # several of the JSON reader's batches per file
    rows = [{"id": i, "text": None if i % 7 == 3 else f"text {i} \u00e9"} for i in range(n)]
    files = []
    for k, (codec, ending) in enumerate(((None, ".jsonl"), ("zstd", ".jsonl.zst"), ("gzip", ".jsonl.gz"))):
        files.append(str(tmp_path / f"part-{k}{ending}"))
        with pa.output_stream(files[-1], compression=codec, buffer_size=None) as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows[k * n // 3 : (k + 1) * n // 3]).encode())
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows))
    streamed = _StreamedInput(files, pafs.LocalFileSystem(), "json")
    reference = pads.dataset(str(plain), format="json")
    missing = pc.field("text").is_null()
    assert streamed.schema.names == reference.schema.names
    assert streamed.count_rows() == reference.count_rows() == n
    assert streamed.count_rows(filter=missing) == reference.count_rows(filter=missing) == len([r for r in rows if r["text"] is None])
    assert streamed.head(3, columns=["id"], filter=missing).equals(reference.head(3, columns=["id"], filter=missing))
    picked = np.sort(np.random.default_rng(0).choice(n, size=700, replace=False))
    assert streamed.take(picked, columns=["text"]).equals(reference.take(picked, columns=["text"]))
    assert streamed.to_table(columns=["id", "text"]).equals(reference.to_table(columns=["id", "text"]))


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_rows_without_text_are_refused_up_front_naming_the_first_id_and_nothing_is_written(minilm_dir, tmp_path, capsys, engine):
    """A null text, or a text column that holds no text, is found from the Parquet footers before the
    model loads or Ray starts (either engine): found mid-run it failed the run with part of the output
    written, a folder the next run is then refused."""
    from jobs.cli import main

    texts = list(TEXTS)
    texts[2] = texts[5] = None
    inputs = {
        "nulls": (pa.table({"id": pa.array(IDS, pa.int64()), "text": pa.array(texts, pa.string())}),
                  rf"2 row\(s\) have no text \(null\) in column 'text', the first with id={IDS[2]}; drop or fill them"),
        "numbers": (pa.table({"id": pa.array(IDS, pa.int64()), "text": pa.array(IDS, pa.int64())}),
                    r"column 'text' holds int64, not text; name the text column with --text-column"),
    }
    for name, (table, said) in inputs.items():
        pq.write_table(table, tmp_path / f"{name}.parquet")
        out = tmp_path / f"vectors-{name}"
        code = main(["embed", "--model", str(minilm_dir), "--input", str(tmp_path / f"{name}.parquet"), "--output", str(out), "--engine", engine])
        err = capsys.readouterr().err
        assert code == 2 and re.search(r"^ctx: error: --input .*" + said, err), err
        assert not out.exists()


def test_an_actor_sorts_the_rows_it_is_handed_into_small_length_sorted_passes(minilm_dir):
    """What Ray Data hands an actor (--actor-batch-size rows, in stored order) runs as several forward passes
    of at most --batch-size rows and --max-batch-tokens padded tokens, shortest texts first, and every id
    keeps its own text's vector."""
    rng = np.random.default_rng(7)
    words = "the river bank was muddy after the flood and she deposited a cheque there".split()
    texts = [" ".join(rng.choice(words, size=int(n))) for n in rng.integers(1, 40, size=45)]  # lengths in no order
    ids = [int(i) for i in rng.permutation(10_000)[: len(texts)]]
    embedder = Embedder(str(minilm_dir), None, "id", "text", "mean", None, batch_size=6, max_batch_tokens=120, threads=1)
    embedder.model.recent_passes.clear()
    out = embedder(pa.table({"id": pa.array(ids, pa.int64()), "text": texts}))

    passes = list(embedder.model.recent_passes)  # (rows, padded length) per forward pass, in order
    n_tokens = embedder.model.embed_now(texts, truncate=True)["n_tokens"]
    assert sum(rows for rows, _ in passes) == len(texts)
    assert len(passes) > len(texts) / 6  # the token budget cuts the passes of long texts shorter still
    for rows, length in passes:
        assert rows <= 6 and (rows * length <= 120 or rows == 1)
    assert [length for _, length in passes] == sorted(length for _, length in passes)  # shortest first
    assert sorted(length for _, length in passes)[-1] == max(n_tokens)
    assert sum(rows * length for rows, length in passes) < len(texts) * max(n_tokens) * 0.7  # little padding left

    assert out.column("id").to_pylist() == ids  # the rows come back in the order given
    one_by_one = np.stack([embedder.model.embed_now([t], truncate=True)["embeddings"][0] for t in texts])
    np.testing.assert_allclose(np.asarray(out.column("embedding").to_pylist(), np.float32), one_by_one, atol=1e-5)


def test_passes_run_in_the_dtype_asked_for_and_vectors_stay_float32(minilm_dir, tmp_path):
    """``dtype`` (``ctx serve``'s model setting, ``ctx embed --dtype``): "auto" is float16 on a GPU
    and float32 on the CPU; a dtype named runs the model's weights and passes in it, pools in float32
    and gives float32 vectors that agree with float32's (cosine > 0.999, as TEI's and Infinity's
    half-precision vectors do). A dtype nobody knows is refused naming the setting. ``cuda_graphs``
    (``ctx embed --no-cuda-graphs``) reaches the replica's settings."""
    import torch
    from pydantic import ValidationError

    from jobs.serving.replica import serving_dtype

    assert serving_dtype("auto", torch.device("cpu")) is torch.float32
    assert serving_dtype("auto", torch.device("cuda", 0)) is torch.float16  # decided without a GPU
    assert serving_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    table = _input_table()
    ref = np.asarray(Embedder(str(minilm_dir), None, "id", "text", "mean", True, threads=1)(table).column("embedding").to_pylist())
    for dtype in ("bfloat16", "float16"):
        embedder = Embedder(str(minilm_dir), None, "id", "text", "mean", True, threads=1, dtype=dtype)
        assert embedder.model.info()["dtype"] == dtype
        assert {p.dtype for p in embedder.model.backbone.parameters()} == {getattr(torch, dtype)}
        out = embedder(table)
        assert out.schema.field("embedding").type == pa.list_(pa.float32(), 384)
        got = np.asarray(out.column("embedding").to_pylist())
        cosine = (got * ref).sum(-1)  # both normalized
        assert cosine.min() > 0.999, (dtype, cosine)
        assert not np.array_equal(got, ref)  # the passes did run in the lower precision
    from jobs.serving.replica import EmbeddingReplica

    asked = []
    setup = EmbeddingReplica._setup
    EmbeddingReplica._setup = lambda self, *args: asked.append(args[3].cuda_graphs) or setup(self, *args)
    try:
        for graphs in (False, True):  # ctx embed --no-cuda-graphs, and its default
            Embedder(str(minilm_dir), None, "id", "text", "mean", True, threads=1, cuda_graphs=graphs)
    finally:
        EmbeddingReplica._setup = setup
    assert asked == [False, True]
    with pytest.raises(ValidationError, match="dtype"):
        ModelConfig(uri=str(minilm_dir), dtype="fp8")
    with pytest.raises(ValueError, match="dtype 'half'"):
        reembed(str(minilm_dir), str(tmp_path / "texts.parquet"), str(tmp_path / "out"), dtype="half")


def _ctx_embed(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    """``ctx embed ARGS`` in a fresh process with its own local Ray, as a user runs it; (result, wall seconds)."""
    ctx = Path(sys.executable).parent / "ctx"
    cmd = [str(ctx)] if ctx.exists() else [sys.executable, "-c", "import sys; from jobs.cli import main; sys.exit(main())"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    start = time.perf_counter()
    done = subprocess.run([*cmd, "embed", *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=Path(__file__).resolve().parents[3])
    return done, time.perf_counter() - start


RAY_DATA_LINES = ("Starting execution of Dataset", "Execution plan of Dataset", "logging_progress", "Total Progress",
                  "Progress will be logged", "execution finished in", "Data sink Parquet finished")


@pytest.mark.slow
def test_ctx_embed_prints_rows_seconds_and_rate_and_no_ray_data_lines_without_verbose(minilm_dir, tmp_path):
    n = 150
    texts = [TEXTS[i % len(TEXTS)] + f" ({i})" for i in range(n)]
    pq.write_table(pa.table({"id": pa.array(range(n), pa.int64()), "text": texts}), tmp_path / "texts.parquet")
    common = ["--model", str(minilm_dir), "--input", str(tmp_path / "texts.parquet"), "--actor-batch-size", "64", "--batch-size", "8"]

    done, wall = _ctx_embed(*common, "--engine", "ray", "--output", str(tmp_path / "quiet"))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout  # the summary, nothing else
    summary = json.loads(lines[0])
    assert summary["rows"] == n and summary["dim"] == 384 and summary["engine"] == "ray" and summary["actors"] >= 1
    assert 0 < summary["seconds"] < wall  # from the command's start, Ray's start included, within the process's life
    assert summary["rows_per_s"] == pytest.approx(n / summary["seconds"], rel=0.02, abs=0.06)  # rounded to 0.1
    assert sorted(_read(str(tmp_path / "quiet")).column("id").to_pylist()) == list(range(n))
    both = done.stdout + done.stderr
    shown = [line for line in both.splitlines() if any(s in line for s in RAY_DATA_LINES) or "\tINFO " in line]
    assert not shown, "\n".join(shown[:20])

    # the control: --verbose shows them, so the check above reads the streams where they would be
    done, _ = _ctx_embed(*common, "--engine", "ray", "--output", str(tmp_path / "verbose"), "--verbose")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Starting execution of Dataset" in done.stdout + done.stderr

    # the default on this small input with no cluster: the local engine, no Ray at all, the same vectors
    done, _ = _ctx_embed(*common, "--output", str(tmp_path / "local"), "--verbose")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["engine"] == "local" and summary["actors"] == 0 and summary["rows"] == n
    assert "Ray instance" not in done.stdout + done.stderr  # --verbose would show Ray's start
    by_ray, local = (_read(str(tmp_path / d)).sort_by("id") for d in ("quiet", "local"))
    assert local.column("id").to_pylist() == list(range(n))
    np.testing.assert_allclose(np.asarray(local.column("embedding").to_pylist()), np.asarray(by_ray.column("embedding").to_pylist()), atol=1e-5)
