"""Bad data through the whole pipeline: a bucket of good and broken shards (moto S3) feeds
``ctx pretrain``; every record is used or rejected, and the run's data report reconciles to the
numbers the shards were built with. In strict mode the run stops at the first bad record, naming
the shard and line."""

import re
from pathlib import Path

import boto3
import pytest

from jobs.training.config import load_recipe
from jobs.training.train import pretrain
from pipelines.datareport import epoch_report, list_epochs
from tests.pipelines.test_bad_data import CASES, MAX_CHARS

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def recipe(bucket: str, *extra: str):
    return load_recipe(REPO / "configs" / "bert-tiny.yaml", [
        f"data.input=s3://{bucket}/corpus/", f"output_dir=s3://{bucket}/runs", "name=mixed",
        "data.eval_input=null", f"data.max_record_chars={MAX_CHARS}", "data.max_epochs=1",
        "tokenizer.vocab_size=500", "data.seq_len=32", "model.max_seq_len=32",
        "train.batch_size=64", "train.max_steps=100000", "train.log_every=10", "train.checkpoint_every=50",
        "scaling.num_workers=1", "scaling.cpus_per_worker=0.5", *extra,
    ])


@pytest.fixture()
def mixed_bucket(s3_server, s3_bucket):
    s3 = boto3.client("s3", endpoint_url=s3_server)
    for name, case in CASES.items():
        s3.put_object(Bucket=s3_bucket, Key=f"corpus/{name}", Body=case.data)
    return s3_bucket


def test_mixed_bucket_trains_and_reconciles(ray_session, s3_server, mixed_bucket):
    lines = []
    result = pretrain(recipe(mixed_bucket), progress=False, log=lines.append)
    assert result.checkpoint_uri is not None  # the stream ended; what was trained is committed
    run = f"s3://{mixed_bucket}/runs/mixed"
    assert list_epochs(run) == [0]
    report = epoch_report(run, 0)
    assert report["reconciled"], report["problems"]
    assert report["n_shards"] == len(CASES)
    assert report["read"] == sum(c.read for c in CASES.values())
    assert report["used"] == sum(c.used for c in CASES.values())
    assert report["rejected"] == sum(c.rejected for c in CASES.values()) == 21
    for row in report["shards"]:
        case = CASES[row["shard"].rsplit("/", 1)[1]]
        assert (row["read"], row["used"], row["rejected"], row["reasons"]) == (case.read, case.used, case.rejected, case.reasons), row["shard"]
        assert (row["samples"] == 0) == (case.used == 0), row  # a used record makes at least one sample
    # the driver printed the report, naming a broken shard and its first bad line
    assert any("21 rejected" in x for x in lines), lines
    assert any("corrupt.txt.gz: 1 of" in x and "corrupt gzip after line" in x for x in lines), lines


def test_strict_mode_stops_at_the_first_bad_record(ray_session, s3_server, mixed_bucket, tmp_path):
    """The Ray Data stream of a strict recipe fails at the first bad record of the first broken
    shard in the epoch's order, naming the shard and line (the same error a run's workers get)."""
    from jobs.training.train import stream_spec
    from pipelines import storage
    from pipelines.dataset import build_dataset, work_units
    from pipelines.tokenizers import train_tokenizer

    rec = recipe(mixed_bucket, "data.strict=true")
    shards = storage.Store().list_files(rec.data.input)
    train_tokenizer("wordpiece", ["a few words to build a vocabulary from"] * 10, 100).save(tmp_path / "tok")
    spec = stream_spec(rec, shards)
    first_bad = next(u["shard"].rsplit("/", 1)[1] for u in work_units(spec) if CASES[u["shard"].rsplit("/", 1)[1]].strict)
    with pytest.raises(Exception) as e:
        for _ in build_dataset(spec, tmp_path / "tok").iter_batches(batch_size=None):
            pass
    message = str(e.value)
    assert "CorpusError" in message and re.search(CASES[first_bad].strict, message), message[-2000:]
