"""Finished runs in MLflow (jobs/training/tracking.py): shard lists, a failed registration, and the whole path
pretrain -> registered version -> promote -> fine-tune from models:/ (parent recorded) -> ctx serve of
models:/NAME@production answering with the registry version.

The MLflow store is the per-session SQLite file tests/conftest.py points MLFLOW_TRACKING_URI at.
"""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import httpx
import numpy as np
import pandas as pd
import pytest

from jobs.training.config import load_recipe
from jobs.training.tracking import RegistrationError, flatten, record_run, shard_list
from tests.conftest import REPO, free_port, serving


def test_flatten_names_every_key_by_its_path():
    assert flatten({"train": {"lr": 0.001, "betas": [0.9, 0.98]}, "name": "x"}) == {"train.lr": "0.001", "train.betas": "[0.9, 0.98]", "name": "x"}


def test_shard_list_has_sizes_and_the_etags_s3_gives(s3_server, s3_bucket, tmp_path):
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.put_object(Bucket=s3_bucket, Key="corpus/a.txt", Body=b"alpha\n")
    s3.put_object(Bucket=s3_bucket, Key="corpus/sub/b.txt", Body=b"beta beta\n")
    s3.put_object(Bucket=s3_bucket, Key="corpus/c.txt", Body=b"not trained on\n")
    local = tmp_path / "d.txt"
    local.write_text("delta\n")
    uris = [f"s3://{s3_bucket}/corpus/a.txt", f"s3://{s3_bucket}/corpus/sub/b.txt", str(local)]
    got = shard_list(uris)
    assert [g["uri"] for g in got] == uris  # the shards asked for, in order, and only those
    for g, key in zip(got[:2], ["corpus/a.txt", "corpus/sub/b.txt"]):
        head = s3.head_object(Bucket=s3_bucket, Key=key)
        assert (g["size"], g["etag"]) == (head["ContentLength"], head["ETag"].strip('"'))
    assert got[2]["size"] == 6 and got[2]["mtime"]


def test_a_registry_that_fails_keeps_the_checkpoint_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once, not after minutes of backoff
    ckpt = tmp_path / "checkpoint_1"
    ckpt.mkdir()
    recipe = load_recipe(REPO / "configs/bert-tiny.yaml", [f"registry.tracking_uri=http://127.0.0.1:{free_port()}"])
    with pytest.raises(RegistrationError, match=f"checkpoint {ckpt} is kept.*ctx models register bert-tiny {ckpt}"):
        record_run(kind="pretrain", recipe=recipe, checkpoint=str(ckpt), metrics={"step": 1}, history=[], run_uri=str(tmp_path),
                   shards=[], eval_metrics={}, family="bert", store=None, log=lambda *_: None)
    assert ckpt.is_dir()


def test_recipes_refuse_a_name_the_registry_cannot_hold_on_load():
    from jobs.training.config import RecipeError
    from jobs.training.finetune_config import load_finetune_recipe

    with pytest.raises(RecipeError, match="registry.model_name: model name 'x.promotions'"):
        load_recipe(REPO / "configs/bert-tiny.yaml", ["registry.model_name=x.promotions"])
    with pytest.raises(RecipeError, match="name: it is the registered model name too"):
        load_finetune_recipe(REPO / "configs/finetune/tiny-pairs.yaml", ["name=runs/a"])
    assert load_finetune_recipe(REPO / "configs/finetune/tiny-pairs.yaml", ["name=runs/a", "registry.enabled=false"]).name == "runs/a"


def test_registry_disabled_logs_nothing():
    recipe = load_recipe(REPO / "configs/bert-tiny.yaml", ["registry.enabled=false", "registry.tracking_uri=http://127.0.0.1:1"])
    assert record_run(kind="pretrain", recipe=recipe, checkpoint="/nowhere", metrics={}, history=[], run_uri="/nowhere",
                      shards=["/nowhere/x.txt"], eval_metrics={}, family="bert", store=None) is None


@pytest.mark.slow
def test_pretrain_register_promote_finetune_and_serve_from_the_registry(ray_session, s3_server, s3_bucket, tmp_path):
    from mlflow import MlflowClient

    from jobs.training.finetune import finetune
    from jobs.training.finetune_config import load_finetune_recipe
    from jobs.registry import Registry
    from jobs.identity import tokenizer_hash
    from jobs.training.train import pretrain

    s3 = boto3.client("s3", endpoint_url=s3_server)
    shard = REPO / "data/sample/wordnet-0000-of-0008.txt.gz"
    s3.upload_file(str(shard), s3_bucket, f"corpus/{shard.name}")
    base = f"base-{s3_bucket}"
    pre = pretrain(load_recipe(REPO / "configs/bert-tiny.yaml", [
        f"data.input=s3://{s3_bucket}/corpus/", "data.eval_input=null", f"output_dir={tmp_path}", f"registry.model_name={base}",
        "tokenizer.vocab_size=1000", "tokenizer.sample_chars=300000", "data.seq_len=64", "model.max_seq_len=64",
        "train.batch_size=8", "train.max_steps=4", "train.log_every=2", "train.checkpoint_every=4", "train.warmup_steps=1",
        "scaling.num_workers=1", "scaling.cpus_per_worker=0.5",
    ]), progress=False, log=lambda *_: None)

    reg = Registry()  # $MLFLOW_TRACKING_URI: the session's SQLite file
    v = reg.get(f"{base}/1")
    assert v == pre.registered and v.source == pre.checkpoint_uri  # the checkpoint itself, no copy
    assert v.tags["ctx.tokenizer_hash"] == tokenizer_hash(Path(pre.checkpoint_uri) / "tokenizer")  # serving's own hash
    head = s3.head_object(Bucket=s3_bucket, Key=f"corpus/{shard.name}")
    assert json.loads(v.tags["ctx.shards"]) == [{"uri": f"s3://{s3_bucket}/corpus/{shard.name}", "size": shard.stat().st_size,
                                                 "etag": head["ETag"].strip('"')}]
    assert (v.tags["ctx.kind"], v.tags["ctx.family"]) == ("pretrain", "bert") and "ctx.parent" not in v.tags
    run = MlflowClient(reg.uri).get_run(v.run_id)
    assert run.data.params["train.max_steps"] == "4" and run.data.params["registry.model_name"] == base
    loss = MlflowClient(reg.uri).get_metric_history(v.run_id, "loss")
    assert {2, 4} <= {m.step for m in loss}  # the history, not only the final value
    reg.promote(base, 1)

    data = tmp_path / "wic"
    data.mkdir()
    for split, n in (("train", 64), ("validation", 32)):
        lines = (REPO / f"data/tasks/wic/{split}.jsonl").read_text().splitlines()[:n]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    ft_name = f"ft-{s3_bucket}"
    ft = finetune(load_finetune_recipe(REPO / "configs/finetune/tiny-pairs.yaml", [
        f"model.init=models:/{base}@production", f"data.train={data / 'train.jsonl'}", f"data.validation={data / 'validation.jsonl'}",
        "data.test=null", f"output_dir={tmp_path}", f"name={ft_name}", "task.max_len=32", "train.batch_size=16", "train.epochs=1",
        "train.log_every=2", "train.patience=null", "data.unit_records=16", "scaling.num_workers=1",
    ]), progress=False, log=lambda *_: None)
    fv = reg.get(f"models:/{ft_name}/1")
    assert fv.source == ft.best_checkpoint and fv.tags["ctx.parent"] == f"{base}/1"
    assert fv.tags["ctx.task"] == "classification" and len(json.loads(fv.tags["ctx.labels"])) == 2
    assert json.loads(fv.tags["ctx.metrics"])["best_accuracy"] == ft.best["value"]
    assert fv.tags["ctx.tokenizer_hash"] == v.tags["ctx.tokenizer_hash"]  # the same vocabulary, carried over
    assert [json.loads(fv.tags["ctx.shards"])[i]["uri"] for i in (0, 1)] == [str(data / "train.jsonl"), str(data / "validation.jsonl")]
    reg.promote(ft_name, 1)

    with serving({"models": {"wic": f"models:/{ft_name}@production"}}) as url:
        r = httpx.post(f"{url}/v1/classify", json={"model": "wic", "input": [["a bank", "the bank"]]}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["X-Registry-Version"] == f"{ft_name}/1" and r.json()["registry_version"] == f"{ft_name}/1"
        assert r.headers["X-Tokenizer-Hash"] == fv.tags["ctx.tokenizer_hash"]
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [m["registry_version"] for m in models] == [f"{ft_name}/1"]
        served = r.json()["data"][0]

    # Both versions are MLflow models too: MLflow's own loader reads them by their models:/ URIs.
    import mlflow

    from jobs.serving.local import LocalModel

    got = mlflow.pyfunc.load_model(f"models:/{ft_name}@production").predict(pd.DataFrame({"text": ["a bank"], "text_pair": ["the bank"]}))
    assert got.loc[0, "label"] == served["label"] and abs(got.loc[0, "score"] - served["score"]) < 1e-5
    with LocalModel(pre.checkpoint_uri) as local:
        np.testing.assert_allclose(mlflow.pyfunc.load_model(f"models:/{base}/1").predict(["a bank", "the bank"]),
                                   local.encode(["a bank", "the bank"]), atol=1e-6)


def test_a_shard_list_over_mlflows_tag_limit_goes_next_to_the_run(tmp_path, monkeypatch):
    from jobs.training import tracking

    monkeypatch.setattr(tracking, "MAX_TAG_CHARS", 100)  # three shards instead of some thousand
    listed = [{"uri": f"s3://c/corpus/{i:05d}.txt", "size": 100 + i, "etag": f"e{i}"} for i in range(3)]
    tag = json.loads(tracking._shards_tag(listed, str(tmp_path), None))
    assert (tag["count"], tag["bytes"], tag["full_list"]) == (3, 303, str(tmp_path / "shards.json"))
    assert json.loads((tmp_path / "shards.json").read_text()) == listed
    assert json.loads(tracking._shards_tag(listed[:1], str(tmp_path), None)) == listed[:1]
