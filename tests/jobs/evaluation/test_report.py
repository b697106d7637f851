"""Metrics files (JSON lines + TensorBoard) locally and on S3 (moto), their restart semantics, the
HTML report and ``ctx report``, and the progress line. No Ray: runs are built by hand."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest

from jobs.cli import main
from jobs.training.metrics import MetricsLog, read_metrics
from jobs.training.progress import describe
from jobs.evaluation.report import count_parameters, write_report
from pipelines import storage


def step_metrics(step: int, **extra) -> dict:
    loss = 7.0 * math.exp(-step / 40) + 1.0
    return {
        "step": step, "max_steps": 100, "epoch": 0, "lr": 1e-3 * min(1.0, step / 20), "loss": loss,
        "mlm_loss": loss - 0.1, "mlm_acc": 0.1 + step / 200, "nsp_loss": 0.69, "ppl": math.exp(loss - 0.1),
        "tokens_per_s": 1000.0 + step, "samples_seen": 32 * step, "tokens_seen": 4096 * step, "eta_s": 100.0 - step,
        "mfu": 0.2 + step / 1000, "data_wait": 0.05, **extra,
    }


def tb_scalars(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = []
    for events in sorted(tb_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        points += [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []
    return sorted(points)


def make_run(run: Path, steps=range(10, 101, 10), checkpoint_step: int | None = 100) -> Path:
    """A run folder as pretraining leaves it: metrics and (optionally) one complete checkpoint."""
    with MetricsLog(str(run)) as log:
        for step in steps:
            log.log(step_metrics(step))
    if checkpoint_step is not None:
        from ctxmodels.checkpoint import save_checkpoint
        from ctxmodels.registry import build_model

        cfg, model = build_model("bert", "tiny")
        state = {"step": checkpoint_step, "samples_seen": 3200, "tokens_seen": 409600, "epoch": 0,
                 "recipe": {"name": run.name, "model": {"family": "bert", "preset": "tiny"}, "train": {"max_steps": 100}}}
        save_checkpoint(run / f"checkpoint_{checkpoint_step:06d}", model, "bert", cfg, extra_json={"trainer_state.json": state})
        (run / "checkpoint_999999").mkdir()  # an interrupted save: no MANIFEST.json
    return run


# ----------------------------------------------------------------------------------------------
# MetricsLog and read_metrics
# ----------------------------------------------------------------------------------------------


def test_local_log_writes_jsonl_and_tensorboard(tmp_path):
    run = tmp_path / "bert-tiny"
    with MetricsLog(str(run)) as log:
        log.log(step_metrics(10))
        # a line is on disk as soon as it is logged (a report during training sees it)
        assert json.loads((run / "metrics" / "metrics.jsonl").read_text())["step"] == 10
        import torch

        log.log({**step_metrics(20), "loss": torch.tensor(2.5), "note": "text is kept in JSON only"})
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [10, 20]
    assert rows[1]["loss"] == 2.5 and rows[1]["note"] == "text is kept in JSON only" and "time" in rows[1]
    assert tb_scalars(run / "metrics" / "tb", "loss") == [(10, pytest.approx(step_metrics(10)["loss"])), (20, 2.5)]
    assert tb_scalars(run / "metrics" / "tb", "mfu")[0] == (10, pytest.approx(0.21))
    assert tb_scalars(run / "metrics" / "tb", "step") == []  # the x axis, not a scalar


def test_log_needs_a_step(tmp_path):
    with MetricsLog(str(tmp_path / "run")) as log, pytest.raises(ValueError, match="'step'"):
        log.log({"loss": 1.0})


def test_restarted_run_keeps_the_last_line_of_each_step(tmp_path):
    run = tmp_path / "run"
    with MetricsLog(str(run)) as log:
        for step in (10, 20, 30):
            log.log({"step": step, "loss": float(step)})
    # killed mid-write: a torn line without its newline
    with open(run / "metrics" / "metrics.jsonl", "a") as f:
        f.write('{"step": 40, "lo')
    with MetricsLog(str(run)) as log:  # resumed from the checkpoint at step 20
        for step in (30, 40, 50):
            log.log({"step": step, "loss": step + 0.5})
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:4: skipped"):
        rows = read_metrics(str(run))
    assert [(r["step"], r["loss"]) for r in rows] == [(10, 10.0), (20, 20.0), (30, 30.5), (40, 40.5), (50, 50.5)]
    assert read_metrics(str(tmp_path / "nothing-logged")) == []


def test_s3_log_uploads_on_flush_and_close_and_resumes(s3_bucket, s3_server, tmp_path):
    run = f"s3://{s3_bucket}/runs/bert-tiny"
    log = MetricsLog(run, storage.Store(s3_server), flush_every_s=3600)
    log.log(step_metrics(10))
    assert read_metrics(run, s3_server) == []  # not uploaded before a flush
    log.flush()
    assert [r["step"] for r in read_metrics(run, s3_server)] == [10]
    log.log(step_metrics(20))
    log.close()
    log.close()  # twice is fine
    assert [r["step"] for r in read_metrics(run, s3_server)] == [10, 20]

    with MetricsLog(run, storage.Store(s3_server), flush_every_s=0) as resumed:  # flush_every_s=0: upload every log
        resumed.log({**step_metrics(20), "loss": 0.25})
        resumed.log(step_metrics(30))
        assert [r["step"] for r in read_metrics(run, s3_server)] == [10, 20, 30]
    rows = read_metrics(run, s3_server)
    assert [(r["step"], r["loss"]) for r in rows][1] == (20, 0.25)

    local = storage.Store(s3_server).download_dir(f"{run}/metrics", tmp_path / "metrics")
    assert len(list((local / "tb").glob("events.out.tfevents.*"))) == 2  # one per writer, none overwritten
    assert [s for s, _ in tb_scalars(local / "tb", "loss")] == [10, 20, 20, 30]


# ----------------------------------------------------------------------------------------------
# Report and CLI
# ----------------------------------------------------------------------------------------------


def test_write_report_local_run(tmp_path):
    run = make_run(tmp_path / "bert-tiny")
    index = write_report(str(run))
    assert index == run / "report" / "index.html"
    for name in ("loss.png", "perplexity.png", "throughput.png", "lr.png"):
        assert (index.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    page = index.read_text()
    final = step_metrics(100)
    assert f"{final['loss']:,.4g}" in page and "final loss" in page
    assert "bert / tiny" in page and "100 / 100" in page
    assert "best 30.0%" in page  # MFU as a percentage
    assert "1,100 tokens/s" in page  # best throughput
    assert "checkpoint_000100" in page and "incomplete" in page
    assert page.count("data:image/png;base64,") == 4  # self-contained
    from ctxmodels.registry import build_model

    n_params = sum(p.numel() for p in build_model("bert", "tiny")[1].state_dict().values())
    assert count_parameters(str(run / "checkpoint_000100" / "model.safetensors")) <= n_params
    assert f"({count_parameters(str(run / 'checkpoint_000100' / 'model.safetensors')):,})" in page


def test_report_with_missing_keys_and_no_checkpoint(tmp_path):
    run = tmp_path / "gpt-run"
    with MetricsLog(str(run)) as log:
        for step in (5, 10):
            log.log({"step": step, "loss": 3.0 / step})  # nothing else
    index = write_report(str(run), out_dir=tmp_path / "out")
    assert sorted(p.name for p in index.parent.glob("*.png")) == ["loss.png"]
    page = index.read_text()
    assert "0.3" in page and "none yet" in page and "gpt-run" in page


def test_report_includes_the_data_reports(tmp_path):
    from pipelines.datareport import write_shard_report
    from pipelines.sources import ReadStats

    run = make_run(tmp_path / "run", checkpoint_step=None)
    for epoch in (0, 1):
        stats = ReadStats()
        stats.use(90)
        stats.reject("malformed JSON", "bad <json>", line=7, count=10 + epoch)
        write_shard_report(str(run), epoch, "s3://b/corpus/part-0.jsonl", 1, stats, samples=30)
    page = write_report(str(run)).read_text()
    assert "epoch 1" in page and "malformed JSON" in page and "bad &lt;json&gt;" in page  # escaped
    assert "201" in page and "rejected (all epochs)" in page  # totals summed over epochs: 100 + 101 read


def test_report_on_s3_run(s3_bucket, s3_server, tmp_path, monkeypatch):
    local = make_run(tmp_path / "bert-tiny")
    run = f"s3://{s3_bucket}/runs/bert-tiny"
    storage.Store(s3_server).copy_dir(local, run)
    monkeypatch.chdir(tmp_path)
    index = write_report(run, store=s3_server)
    assert index == tmp_path / "report-bert-tiny" / "index.html"
    assert "bert / tiny" in index.read_text() and (index.parent / "throughput.png").exists()


def test_cli_report(tmp_path, capsys):
    run = make_run(tmp_path / "bert-tiny", checkpoint_step=None)
    assert main(["report", str(run), "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(tmp_path / "r" / "index.html") and Path(out).exists()


def test_cli_report_unknown_or_empty_run(tmp_path, capsys):
    missing = tmp_path / "no-such-run"
    assert main(["report", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "empty" in err and "neither metrics/metrics.jsonl nor a checkpoint_*" in err


# ----------------------------------------------------------------------------------------------
# Progress line
# ----------------------------------------------------------------------------------------------


def test_progress_line_shows_mfu_and_data_wait():
    line = describe(step_metrics(50))
    assert line.startswith("step 50/100 | loss ")
    assert "1,050 tok/s" in line and "MFU 25.0%" in line and "data wait 5%" in line and "ETA 00:50" in line
    bare = describe({"step": 1, "max_steps": 2, "loss": 1.0, "tokens_per_s": 10.0})
    assert "MFU" not in bare and "data wait" not in bare


def test_progress_line_counts_skipped_steps_only_when_there_are_some():
    assert "skipped 2 non-finite steps" in describe({**step_metrics(50), "bad_steps": 2})
    assert "skipped 1 non-finite step |" in describe({**step_metrics(50), "bad_steps": 1})
    assert "skipped" not in describe({**step_metrics(50), "bad_steps": 0})
