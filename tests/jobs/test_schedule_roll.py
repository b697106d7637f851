"""Rolling the Serve app to a new version (jobs.schedule.roll_serve): a client sending requests
throughout sees only 200s, and the version in the answers switches exactly once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import requests

from ctxmodels.checkpoint import save_checkpoint
from ctxmodels.registry import build_model
from jobs.schedule import roll_serve
from jobs.serve import checkpoint_version
from pipelines.sources import sample_text
from pipelines.tokenizers import train_tokenizer
from tests.conftest import serving

REPO = Path(__file__).resolve().parents[2]


def tiny_versions(root: Path, n: int) -> list[Path]:
    """n tiny BERT checkpoints with one tokenizer and different weights."""
    tok = train_tokenizer("wordpiece", sample_text([str(REPO / "data/sample/wordnet-0007-of-0008.txt.gz")], 50_000), 400)
    tok.save(root / "tok")
    out = []
    for seed in range(n):
        cfg, model = build_model("bert", "tiny", {"vocab_size": tok.vocab_size, "nsp": False, "n_layer": 1}, seed=seed)
        out.append(save_checkpoint(root / f"v{seed + 1}", model, "bert", cfg, tokenizer_dir=root / "tok"))
    return out


@pytest.mark.slow
def test_roll_has_no_failed_request_and_one_switch(ray_session, tmp_path):
    old, new = tiny_versions(tmp_path, 2)
    app = {"models": {"bert": {"uri": str(old), "num_cpus": 0.1}}, "gateway": {"num_cpus": 0.1}}
    with serving(app) as url:
        from ray import serve

        statuses, versions, stop = [], [], threading.Event()

        def client():
            with requests.Session() as s:
                while not stop.is_set():
                    r = s.post(f"{url}/v1/embeddings", json={"model": "bert", "input": ["the river bank"]}, timeout=60)
                    statuses.append(r.status_code)
                    if r.status_code == 200:
                        versions.append(r.json()["model_version"])

        thread = threading.Thread(target=client)
        thread.start()
        try:
            time.sleep(1.0)
            status = serve.status().applications["ctx-embeddings"]
            served = roll_serve({**app, "port": int(url.rsplit(":", 1)[1])}, "bert", str(new))
            time.sleep(1.0)
        finally:
            stop.set()
            thread.join(60)
        assert status.status == "RUNNING"
        assert served == checkpoint_version(str(new))
    assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    switches = [(a, b) for a, b in zip(versions, versions[1:]) if a != b]
    assert switches == [(checkpoint_version(str(old)), checkpoint_version(str(new)))], switches
    assert versions.count(checkpoint_version(str(new))) >= 1
