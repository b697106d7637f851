"""Exactly-once data across failures and worker-count changes (Ray Train + Ray Data, 2 CPUs).

Every worker writes the samples it trained on (``train.sample_log``). A sample counts as consumed
when its optimizer step was committed: an attempt's lines up to the step the next attempt resumed
from (steps after that were rolled back with the model). Over a whole epoch every sample of the
corpus must then be consumed exactly once, with the tokens and mask the pure NumPy pipeline gives
it (``local_batches``): none lost, none repeated, whatever failed or changed in between.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from jobs.config import load_recipe
from jobs.train import pretrain, row_digests, stream_spec
from pipelines.dataset import local_batches
from pipelines.tokenizers import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Four small text shards (~520 samples of 32 tokens per epoch: about 65 steps of 8; whole
    sentences per block, so a block holds two or three of these one-line documents)."""
    lines = [x.strip() for x in gzip.open(REPO / "data/sample/wordnet-0000-of-0008.txt.gz", "rt") if x.strip()]
    root = tmp_path_factory.mktemp("corpus")
    for i in range(4):
        (root / f"part-{i}.txt").write_text("\n\n".join(lines[i * 160 : (i + 1) * 160]) + "\n")
    return root


def recipe(corpus: Path, out: Path, *extra: str):
    return load_recipe(REPO / "configs" / "bert-tiny.yaml", [
        f"data.input={corpus}", f"output_dir={out}", "name=once", "data.eval_input=null",
        "tokenizer.vocab_size=1000", "data.seq_len=32", "model.max_seq_len=32", "data.max_epochs=2",
        "train.batch_size=8", "train.micro_batch_size=4", "train.warmup_steps=5", "train.log_every=5",
        "train.checkpoint_every=10", "train.sample_log=true", "scaling.cpus_per_worker=0.5", *extra,
    ])


def committed(run: Path) -> list[dict]:
    """Sample-log lines whose step was committed, over all attempts."""
    files = sorted((run / "sample_log").glob("*.jsonl"))
    attempts: dict[int, list[list[dict]]] = {}
    for f in files:
        head, *lines = [json.loads(x) for x in f.read_text().splitlines()]
        attempts.setdefault(head["resumed_step"], []).append(lines)
    starts = sorted(attempts)
    out = []
    for i, start in enumerate(starts):
        until = starts[i + 1] if i + 1 < len(starts) else 1 << 62
        for lines in attempts[start]:
            out.extend(x for x in lines if x["step"] <= until)
    return out, starts


def reference_digests(rec, run: Path, epoch: int) -> dict[int, str]:
    """sample id -> digest of the tokens and mask the pure NumPy pipeline gives it in ``epoch``."""
    from pipelines import storage

    shards = storage.list_files(rec.data.input)
    spec = stream_spec(rec, shards)
    tok = load_tokenizer(run / "tokenizer")
    out = {}
    for b in local_batches(spec, tok, batch_size=1, epoch=epoch):  # 1: no tail left unbatched
        tensors = {k: torch.as_tensor(v) for k, v in b.items()}
        out.update(zip(b["sample_id"].tolist(), row_digests(tensors)))
    return out


def assert_epoch_exactly_once(rec, run: Path, epoch: int = 0) -> int:
    lines, _ = committed(run)
    seen = Counter()
    digests = {}
    for x in lines:
        for e, sid, d in zip(x["epoch"], x["ids"], x["digests"]):
            if e == epoch:
                seen[sid] += 1
                digests[sid] = d
    ref = reference_digests(rec, run, epoch)
    repeated = {s: n for s, n in seen.items() if n > 1}
    assert not repeated, f"{len(repeated)} samples of epoch {epoch} trained on more than once"
    missing = ref.keys() - seen.keys()
    assert not missing, f"{len(missing)} of {len(ref)} samples of epoch {epoch} never trained on"
    assert seen.keys() == ref.keys()
    wrong = [s for s in ref if digests[s] != ref[s]]
    assert not wrong, f"{len(wrong)} samples got other tokens or masks than the NumPy pipeline gives them"
    return len(ref)


def state(run: Path) -> dict:
    from pipelines import storage

    return json.loads(Path(storage.latest_complete_checkpoint(str(run)), "trainer_state.json").read_text())


def test_worker_killed_mid_epoch_finishes_and_consumes_each_sample_once(ray_session, corpus, tmp_path):
    rec = recipe(corpus, tmp_path, "train.max_steps=80", "scaling.num_workers=[1, 2]")  # elastic: Ray places what fits
    run = tmp_path / "once"
    killed: dict = {}

    def killer() -> None:
        """SIGKILL a worker process (the highest rank) once it has finished step 25 (after the
        checkpoint at 20). The elastic range may have started 1 or 2 workers."""
        while "pid" not in killed:
            files = sorted((run / "sample_log").glob("*-rank*.jsonl"), key=lambda f: f.name[-7:]) if (run / "sample_log").exists() else []
            for f in files[::-1]:
                lines = f.read_text().splitlines()
                steps = [json.loads(x).get("step", 0) for x in lines[1:]]
                if steps and max(steps) >= 25:
                    killed["pid"] = json.loads(lines[0])["pid"]
                    os.kill(killed["pid"], signal.SIGKILL)
                    return
            time.sleep(0.05)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    result = pretrain(rec, progress=False, log=lambda *_: None)
    killed.setdefault("pid", None)
    assert killed["pid"] is not None, "the run ended before the worker could be killed"
    _, starts = committed(run)
    assert starts[0] == 0 and len(starts) == 2 and 20 <= starts[1] < 30, starts  # resumed from its checkpoint
    assert result.metrics["step"] == 80 and state(run)["samples_seen"] == 80 * 8 and result.metrics["workers"] in (1, 2)
    n = assert_epoch_exactly_once(rec, run, epoch=0)
    assert n > 8 * 40  # the epoch really was longer than the kill point


def test_two_workers_then_one_consumes_each_sample_once(ray_session, corpus, tmp_path):
    run = tmp_path / "once"
    pretrain(recipe(corpus, tmp_path, "train.max_steps=30", "scaling.num_workers=2"), progress=False, log=lambda *_: None)
    first = state(run)
    assert first["step"] == 30 and first["world_size"] == 2 and first["epoch"] == 0  # mid-epoch
    rec = recipe(corpus, tmp_path, "train.max_steps=80", "scaling.num_workers=1")
    result = pretrain(rec, progress=False, log=lambda *_: None)
    assert result.metrics["step"] == 80 and result.metrics["workers"] == 1
    last = state(run)
    # the global batch stayed 8 (one worker ran 2 micro-batches of 4 per step)
    assert last["samples_seen"] == 80 * 8 and last["world_size"] == 1 and last["epoch"] >= 1
    assert_epoch_exactly_once(rec, run, epoch=0)


def test_resume_skips_a_checkpoint_cut_in_half(ray_session, corpus, tmp_path):
    """The newest checkpoint's weights are cut to half their bytes (an upload cut off after the
    manifest landed): the rerun resumes from the one before, and its data position with it."""
    run = tmp_path / "once"
    pretrain(recipe(corpus, tmp_path, "train.max_steps=20", "scaling.num_workers=1"), progress=False, log=lambda *_: None)
    ckpts = sorted(p for p in run.iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))
    assert len(ckpts) == 2
    weights = ckpts[-1] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    lines = []
    rec = recipe(corpus, tmp_path, "train.max_steps=25", "scaling.num_workers=1")
    pretrain(rec, progress=False, log=lines.append)
    assert any("resume: step 10 " in x for x in lines), lines
    heads = [json.loads(f.read_text().splitlines()[0]) for f in (run / "sample_log").glob("*.jsonl")]
    assert sorted(h["resumed_step"] for h in heads) == [0, 10]
    assert {h["resumed_from"] for h in heads if h["resumed_step"] == 10} == {str(ckpts[0])}
    # what steps 11-20 of the first run trained on was rolled back with the weights: trained again
    attempts = {}
    for f in (run / "sample_log").glob("*.jsonl"):
        head, *rest = [json.loads(y) for y in f.read_text().splitlines()]
        attempts[head["resumed_step"]] = rest
    rolled_back = {s for x in attempts[0] if 11 <= x["step"] <= 20 for s in x["ids"]}
    kept = {s for x in attempts[0] if x["step"] <= 10 for s in x["ids"]}
    retrained = {s for x in attempts[10] for s in x["ids"]}
    assert len(rolled_back) == 80 and rolled_back <= retrained and not kept & retrained
