"""Two fresh `ctx pretrain` runs of one recipe and seed, 1 worker on CPU, end bitwise identical
(tokenizer files and weights after 20 steps); another seed gives other weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from jobs.training.config import load_recipe
from jobs.training.train import pretrain

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def run(out: Path, *extra: str) -> Path:
    recipe = load_recipe(REPO / "configs" / "bert-tiny.yaml", [
        f"data.input={REPO / 'data/sample/wordnet-0000-of-0008.txt.gz'}", f"output_dir={out}", "name=r",
        "data.eval_input=null", "tokenizer.vocab_size=500", "tokenizer.sample_chars=200000", "data.seq_len=32",
        "model.max_seq_len=32", "train.batch_size=8", "train.max_steps=20", "train.log_every=10",
        "train.checkpoint_every=20", "train.warmup_steps=5", "scaling.num_workers=1", "scaling.cpus_per_worker=0.5",
        *extra,
    ])
    return Path(pretrain(recipe, progress=False, log=lambda *_: None).checkpoint_uri)


@pytest.mark.extended  # make test-all
def test_same_seed_same_run_other_seed_other_weights(ray_session, tmp_path):
    a, b = run(tmp_path / "a"), run(tmp_path / "b")
    for f in sorted((a / "tokenizer").iterdir()):
        assert f.read_bytes() == (b / "tokenizer" / f.name).read_bytes(), f"tokenizer file {f.name} differs"
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].equal(wb[name]), f"{name} differs between two runs with the same seed"
    wc = load_file(run(tmp_path / "c", "train.seed=1") / "model.safetensors")
    assert not all(wa[n].equal(wc[n]) for n in wa)
