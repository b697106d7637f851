"""Rolling the Serve app to a new version (jobs.operations.schedule.roll_serve), a pinned model and then a
multiplexed one: a client sending requests throughout sees only 200s, and the version in each
model's answers switches exactly once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import requests

from ctxmodels.checkpoint import save_checkpoint
from ctxmodels.registry import build_model
from jobs.operations.schedule import roll_serve, serve_config_with
from jobs.identity import checkpoint_version
from pipelines.sources import sample_text
from pipelines.tokenizers import train_tokenizer
from tests.conftest import serving

REPO = Path(__file__).resolve().parents[3]


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
    """One app, a pinned model and a multiplexed one: the pinned one rolls, then the multiplexed
    one; requests to both go on throughout."""
    old, new = tiny_versions(tmp_path, 2)
    app = {"models": {"bert": {"uri": str(old), "num_cpus": 0.1}}, "multiplexed": {"models": {"mx": str(old)}, "num_cpus": 0.1},
           "gateway": {"num_cpus": 0.1}}
    with serving(app) as url:
        from ray import serve

        statuses, versions, stop = [], {"bert": [], "mx": []}, threading.Event()

        def client():
            with requests.Session() as s:
                while not stop.is_set():
                    for model in versions:
                        r = s.post(f"{url}/v1/embeddings", json={"model": model, "input": ["the river bank"]}, timeout=60)
                        statuses.append(r.status_code)
                        if r.status_code == 200:
                            versions[model].append(r.json()["model_version"])

        thread = threading.Thread(target=client)
        thread.start()
        try:
            time.sleep(1.0)
            status = serve.status().applications["ctx-embeddings"]
            app = {**app, "port": int(url.rsplit(":", 1)[1])}
            served = roll_serve(app, "bert", str(new))
            time.sleep(1.0)
            mx_at_bert_roll = len(versions["mx"])
            served_mx = roll_serve(serve_config_with(app, "bert", str(new)).model_dump(mode="json", exclude={"defaults"}), "mx", str(new))
            time.sleep(1.0)
        finally:
            stop.set()
            thread.join(60)
        assert status.status == "RUNNING"
        assert served == served_mx == checkpoint_version(str(new))
    assert statuses and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    v_old, v_new = checkpoint_version(str(old)), checkpoint_version(str(new))
    for model, seen in versions.items():
        switches = [(a, b) for a, b in zip(seen, seen[1:]) if a != b]
        assert switches == [(v_old, v_new)], (model, switches)
        assert seen.count(v_new) >= 1
    assert set(versions["mx"][:mx_at_bert_roll]) == {v_old}  # rolling the pinned model left the multiplexed one alone
