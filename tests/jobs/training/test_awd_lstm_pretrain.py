"""AWD-LSTM through ``ctx pretrain`` (Ray Data + Ray Train): stream-ordered batches, carried LSTM
state, and exactly-once data over an interrupted and resumed run, as the other stream families.

The run stops at step 30 (checkpoints at 10, 20, 30) and is started again to step 80, past the end
of epoch 0: every sample (stream row) of that epoch must be trained on once, with the tokens the
pure NumPy pipeline gives it, and the resumed attempt's first batch starts without carried state.
About 1.5 min on 2 shared cores.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from jobs.training.config import load_recipe
from jobs.training.loop import row_digests
from jobs.training.train import pretrain, stream_spec
from pipelines.dataset import local_batches
from pipelines.tokenizers import load_tokenizer
from tests.jobs.training.exactly_once import committed, overrides, state, write_corpus

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]


def recipe(corpus: Path, out: Path, *extra: str):
    sets = [x for x in overrides(corpus, out, *extra) if not x.startswith("model.max_seq_len")]  # an LSTM reads any length
    return load_recipe(REPO / "configs" / "ulmfit-tiny.yaml", sets + ["model.bptt=16"])


def stream_digests(rec, run: Path, epoch: int) -> dict[int, str]:
    """sample id -> digest of each stream row the NumPy pipeline builds in ``epoch``, cut into
    batches of the micro-batch's rows as the data stage cuts them."""
    from pipelines import storage

    spec = stream_spec(rec, storage.Store().list_files(rec.data.input))
    out = {}
    for b in local_batches(spec, load_tokenizer(run / "tokenizer"), batch_size=spec.stream_rows, epoch=epoch):
        tensors = {k: torch.as_tensor(v) for k, v in b.items()}
        out.update(zip(b["sample_id"].tolist(), row_digests(tensors)))
    return out


def test_interrupted_awd_lstm_run_resumes_and_trains_each_stream_row_once(ray_session, tmp_path):
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus")
    run = tmp_path / "out" / "once"
    first = pretrain(recipe(corpus, tmp_path / "out", "train.max_steps=30", "scaling.num_workers=1"), progress=False, log=lambda *_: None)
    assert first.metrics["step"] == 30 and "lm_loss" in first.metrics and "tar" in first.metrics
    rec = recipe(corpus, tmp_path / "out", "train.max_steps=80", "scaling.num_workers=1")
    lines = []
    result = pretrain(rec, progress=False, log=lines.append)
    assert any("resume: step 30 " in x for x in lines), lines
    assert result.metrics["step"] == 80 and state(run)["samples_seen"] == 80 * 8 and state(run)["epoch"] >= 1

    got, starts = committed(run)
    assert starts == [0, 30]
    seen, digests = Counter(), {}
    for x in got:
        for e, sid, d in zip(x["epoch"], x["ids"], x["digests"]):
            if e == 0:
                seen[sid] += 1
                digests[sid] = d
    ref = stream_digests(rec, run, 0)
    assert not {s for s, n in seen.items() if n > 1}, "stream rows of epoch 0 trained on twice"
    assert seen.keys() == ref.keys(), f"{len(ref.keys() - seen.keys())} of {len(ref)} rows never trained on"
    assert all(digests[s] == ref[s] for s in ref), "rows with other tokens than the NumPy pipeline gives them"
    losses = [m["lm_loss"] for m in first.history + result.history if "lm_loss" in m]
    assert losses[-1] < losses[0]
