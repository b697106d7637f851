"""Training survives storage faults (issue 11): an S3 outage in the middle of an epoch, and a metrics
file that can no longer be written.

The outage is real: a TCP proxy (``tests.proxy``) stands between the run and moto's S3 endpoint and
cuts every connection, and resets new ones, for 20 s after the first checkpoint. The run must
finish on its own with ``max_failures: 0`` (so any failure at all would end it) and every sample
of the epoch must be trained on exactly once (the check of ``test_exactly_once``).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
import time
from pathlib import Path

import boto3
import pytest

from jobs.training.config import load_recipe
from jobs.training.metrics import MetricsLog, read_metrics
from jobs.training.train import pretrain
from pipelines import storage
from tests.jobs.training.test_exactly_once import assert_epoch_exactly_once, committed
from tests.proxy import CutProxy

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Four small text shards: about 190 samples of 32 tokens, 24 steps of 8, per epoch."""
    lines = [x.strip() for x in gzip.open(REPO / "data/sample/wordnet-0000-of-0008.txt.gz", "rt") if x.strip()]
    root = tmp_path_factory.mktemp("corpus")
    for i in range(4):
        (root / f"part-{i}.txt").write_text("\n\n".join(lines[i * 60 : (i + 1) * 60]) + "\n")
    return root


def recipe(data: str, out: str, *extra: str):
    """``test_exactly_once``'s run on a smaller corpus, 1 worker, a checkpoint every 5 steps."""
    return load_recipe(REPO / "configs" / "bert-tiny.yaml", [
        f"data.input={data}", f"output_dir={out}", "name=faults", "data.eval_input=null",
        "tokenizer.vocab_size=1000", "data.seq_len=32", "model.max_seq_len=32", "data.max_epochs=2",
        "train.batch_size=8", "train.micro_batch_size=4", "train.warmup_steps=5", "train.log_every=5",
        "train.checkpoint_every=5", "scaling.num_workers=1", "scaling.cpus_per_worker=0.5", *extra,
    ])


def wait_for(condition, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_20s_s3_outage_mid_epoch_is_ridden_out_with_each_sample_once(ray_session, s3_server, s3_bucket, corpus, tmp_path):
    s3 = boto3.client("s3", endpoint_url=s3_server)  # straight to moto: the test's own view is never cut
    for f in sorted(corpus.iterdir()):
        s3.upload_file(str(f), s3_bucket, f"corpus/{f.name}")
    run = f"s3://{s3_bucket}/runs/faults"

    def first_checkpoint_done() -> bool:
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix="runs/faults/checkpoint_").get("Contents", [])]
        return any(k.endswith("/MANIFEST.json") for k in keys)

    with CutProxy(int(s3_server.rsplit(":", 1)[1])) as proxy:
        rec = recipe(f"s3://{s3_bucket}/corpus/", f"s3://{s3_bucket}/runs", f"data.endpoint_url={proxy.url}",
                     "data.retry_deadline_s=60", "scaling.max_failures=0", "train.max_steps=30", "train.sample_log=true")
        outage: dict = {}

        def cutter() -> None:
            try:
                wait_for(first_checkpoint_done, 600, "the first checkpoint")
                outage["start"] = time.monotonic()
                proxy.cut(20)
            except AssertionError as e:
                outage["error"] = str(e)

        thread = threading.Thread(target=cutter, daemon=True)
        thread.start()
        result = pretrain(rec, progress=False, log=lambda *_: None)
        thread.join(1)
        assert "error" not in outage and "start" in outage, outage
        # the run was still going when the network went, tried the endpoint while it was down and
        # finished only after it came back
        assert proxy.refused > 0 and time.monotonic() - outage["start"] > 20

    assert result.metrics["step"] == 30
    local = storage.Store(s3_server).download_dir(run, tmp_path / "run")  # the whole run folder, for the checks
    _, starts = committed(local)
    assert starts == [0], starts  # one attempt: no worker failed, nothing was resumed
    logs = [[json.loads(x) for x in f.read_text().splitlines()] for f in (local / "sample_log").glob("*.jsonl")]
    assert len(logs) == 1 and logs[0][-1]["step"] == 30  # every step's line reached the bucket in the end
    # the reference pipeline reads the shards straight from moto (the proxy is gone)
    direct = recipe(f"s3://{s3_bucket}/corpus/", f"s3://{s3_bucket}/runs", f"data.endpoint_url={s3_server}")
    assert assert_epoch_exactly_once(direct, local, epoch=0) > 8 * 15  # epoch 0 ran through the outage
    ckpts = [p.name for p in local.iterdir() if p.is_dir() and p.name.startswith("checkpoint_")]
    assert ckpts and all(storage.Store().checkpoint_problem(str(local / c)) is None for c in ckpts)


@pytest.mark.slow
def test_a_metrics_file_that_fills_up_mid_run_is_a_warning_and_training_goes_on(ray_session, corpus, tmp_path):
    """After the first checkpoint the metrics file becomes /dev/full (every write: ENOSPC, "No
    space left on device"): the run still reaches max_steps, and rank 0 warns."""
    run = tmp_path / "faults"
    metrics_file = run / "metrics" / "metrics.jsonl"

    def fill_up() -> None:
        wait_for(lambda: any((p / "MANIFEST.json").exists() for p in run.glob("checkpoint_*")), 600, "the first checkpoint")
        full = metrics_file.with_name("full")
        full.symlink_to("/dev/full")
        os.replace(full, metrics_file)

    thread = threading.Thread(target=fill_up, daemon=True)
    thread.start()
    result = pretrain(recipe(str(corpus), str(tmp_path), "train.max_steps=15", "scaling.max_failures=0"), progress=False, log=lambda *_: None)
    thread.join(1)
    assert result.metrics["step"] == 15 and metrics_file.is_symlink()
    logs = Path(ray_session._private.worker._global_node.get_logs_dir_path())
    texts = [f.read_text(errors="replace") for f in logs.glob("*.err")]
    warned = [t for t in texts if "warning: metrics: cannot write step" in t and str(metrics_file) in t]
    assert warned, "no worker warned about the metrics it could not write"


def test_metrics_log_warns_on_a_full_disk_and_writes_again_when_there_is_room(tmp_path, capsys):
    run = tmp_path / "run"
    with MetricsLog(str(run)) as log:
        log.log({"step": 1, "loss": 3.0})
        path = run / "metrics" / "metrics.jsonl"
        saved = path.read_text()
        path.unlink()
        path.symlink_to("/dev/full")
        log.log({"step": 2, "loss": 2.5})  # ENOSPC: a warning, not an error
        log.log({"step": 3, "loss": 2.0})
        path.unlink()
        path.write_text(saved)  # room again
        log.log({"step": 4, "loss": 1.5})
    err = capsys.readouterr().err
    assert "cannot write step 2" in err and "No space left on device" in err
    assert "cannot write step 3" not in err  # one warning per streak
    assert "again from step 4 (2 logged steps lost)" in err
    assert [m["step"] for m in read_metrics(str(run))] == [1, 4]


def checkpointer(run: str, endpoint_url: str, deadline_s: float):
    from jobs.training.loop import Checkpointer
    from pipelines.position import DataPosition

    return Checkpointer(run, storage.Store(endpoint_url, deadline_s), [0], 0, 1, DataPosition(), save=None, fresh_model=None)


def test_a_checkpoint_upload_rides_out_an_outage_then_gives_up_at_the_deadline_naming_object_and_endpoint(s3_server, s3_bucket, tmp_path):
    """``Checkpointer.upload`` (Ray's checkpoint_upload_fn) through the cutting proxy: a 3 s outage
    within a 30 s deadline is waited out and the checkpoint lands complete; an endpoint that stays
    down past a 2 s deadline fails with the object's URI and the endpoint in the message."""
    from ray.train import Checkpoint

    from tests.ctxmodels.test_checkpoint import write_small_checkpoint

    local = write_small_checkpoint(tmp_path / "ckpt")
    run = f"s3://{s3_bucket}/runs/up"
    with CutProxy(int(s3_server.rsplit(":", 1)[1])) as proxy:
        proxy.cut(3)
        t0 = time.monotonic()
        done = checkpointer(run, proxy.url, 30).upload(Checkpoint.from_directory(str(local)), "checkpoint_a")
        assert time.monotonic() - t0 > 2.5 and proxy.refused > 0  # it did wait for the endpoint
        assert done.path == f"{s3_bucket}/runs/up/checkpoint_a"
        assert storage.Store(s3_server).checkpoint_problem(f"{run}/checkpoint_a") is None

        proxy.cut(3600)
        with pytest.raises(storage.StorageError) as e:
            checkpointer(run, proxy.url, 2).upload(Checkpoint.from_directory(str(local)), "checkpoint_b")
    message = str(e.value)
    assert f"{run}/checkpoint_b/" in message and f"(endpoint {proxy.url})" in message and "data.retry_deadline_s=2" in message, message
