"""The whole path on a real S3 endpoint (moto on loopback), through the same clients users use:

shards in a bucket -> Ray Data -> 2 Ray Train workers -> checkpoint in the bucket -> a rerun
resumes from it -> Ray Serve answers over HTTP with the trained model. On the way, the 2 workers
evaluate on ``data.eval_input`` every ``train.eval_every`` steps and at the end, and log it
(tests/jobs/training/test_pretrain_eval.py checks the numbers in-process).
"""

import json
from pathlib import Path

import boto3
import httpx
import pytest

from tests.conftest import serving
from jobs.training.config import load_recipe
from jobs.training.metrics import read_metrics
from jobs.training.train import pretrain
from pipelines import storage

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def trainer_state(ckpt_uri):
    fs, path = storage.filesystem(ckpt_uri)
    with fs.open_input_stream(f"{path}/trainer_state.json") as f:
        return json.loads(f.read())


def test_s3_pretrain_resume_and_serve(ray_session, s3_server, s3_bucket):
    s3 = boto3.client("s3", endpoint_url=s3_server)
    for p in sorted((REPO / "data" / "sample").glob("*.txt.gz"))[:3]:
        s3.upload_file(str(p), s3_bucket, f"corpus/{p.name}")
    common = [
        f"data.input=s3://{s3_bucket}/corpus/",
        f"output_dir=s3://{s3_bucket}/runs",
        "name=e2e",
        "tokenizer.vocab_size=2000",
        "tokenizer.sample_chars=500000",
        "data.seq_len=64",
        "model.max_seq_len=64",
        "train.batch_size=16",
        "train.log_every=5",
        "train.checkpoint_every=10",
        "train.warmup_steps=5",
        "data.eval_max_samples=64",  # of bert-tiny.yaml's eval_input, a local shard
        "scaling.num_workers=2",
        "scaling.cpus_per_worker=0.5",
    ]
    logs = []
    first = pretrain(load_recipe(REPO / "configs" / "bert-tiny.yaml", common + ["train.max_steps=20", "train.eval_every=8"]), progress=False, log=logs.append)
    assert first.checkpoint_uri.startswith(f"s3://{s3_bucket}/runs/e2e/checkpoint_")
    assert trainer_state(first.checkpoint_uri)["step"] == 20
    assert storage.Store().latest_complete_checkpoint(f"s3://{s3_bucket}/runs/e2e") == first.checkpoint_uri
    assert first.metrics["step"] == 20 and first.metrics["tokens_per_s"] > 0 and 0 <= first.metrics["mlm_acc"] <= 1
    assert any("training wordpiece" in line for line in logs)
    rows = read_metrics(f"s3://{s3_bucket}/runs/e2e")
    assert [r["step"] for r in rows] == [5, 8, 10, 15, 16, 20]
    assert [r["step"] for r in rows if "eval_loss" in r] == [8, 16, 20]  # every eval_every steps and at the end
    assert all(r["eval_samples"] == 64 and 0 <= r["eval_acc"] <= 1 and r["eval_ppl"] > 1 for r in rows if "eval_loss" in r)
    assert "eval_acc" in first.metrics

    logs.clear()
    second = pretrain(load_recipe(REPO / "configs" / "bert-tiny.yaml", common + ["train.max_steps=30"]), progress=False, log=logs.append)
    assert any("resume: step 20" in line for line in logs), logs
    assert any("tokenizer: reusing" in line for line in logs), logs
    state = trainer_state(second.checkpoint_uri)
    assert state["step"] == 30 and state["samples_seen"] == 30 * 16
    assert second.checkpoint_uri != first.checkpoint_uri

    with serving({"models": {"tiny": f"s3://{s3_bucket}/runs/e2e"}}) as url:
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny", "input": ["the river bank", "the bank approved the loan"]}, timeout=60)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert len(data) == 2 and len(data[0]["embedding"]) == 64  # tiny preset: d_model 64
