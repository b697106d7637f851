"""The Ray Data stream gives exactly the samples and masks of the pure NumPy path."""

from pathlib import Path

import numpy as np
import pytest

from pipelines.dataset import StreamSpec, build_dataset, local_batches, work_units
from pipelines.masking import MlmConfig
from pipelines.tokenizers import train_tokenizer
from pipelines.sources import sample_text

REPO = Path(__file__).resolve().parents[2]
SHARDS = tuple(str(p) for p in sorted((REPO / "data" / "sample").glob("*.txt.gz"))[:2])


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    tok = train_tokenizer("wordpiece", sample_text(list(SHARDS), 1_000_000), 2000)
    d = tmp_path_factory.mktemp("tok")
    tok.save(d)
    return d


def rows_by_id(batches):
    out = {}
    for b in batches:
        for i, sid in enumerate(b["sample_id"]):
            out[(int(b["epoch"][i]), int(sid))] = (b["input_ids"][i].copy(), b["labels"][i].copy())
    return out


def test_work_units_cover_every_shard_once_per_epoch():
    spec = StreamSpec(shards=tuple(f"/c/s{i}.txt" for i in range(5)), seq_len=32, max_epochs=3, first_epoch=2)
    units = work_units(spec)
    assert len(units) == 15
    for e in (2, 3, 4):
        assert sorted(u["shard"] for u in units if u["epoch"] == e) == sorted(spec.shards)


def test_ray_stream_equals_local_path(ray_session, tok_dir):
    from pipelines.tokenizers import load_tokenizer

    spec = StreamSpec(shards=SHARDS, seq_len=64, seed=3, max_epochs=2, mlm=MlmConfig())
    tok = load_tokenizer(tok_dir)
    ray_rows = rows_by_id(build_dataset(spec, tok_dir).iter_batches(batch_size=256, batch_format="numpy"))
    local = {}
    for epoch in (0, 1):
        local.update(rows_by_id(local_batches(spec, tok, batch_size=1, epoch=epoch)))
    assert len(ray_rows) > 100
    assert ray_rows.keys() == local.keys()  # every sample once per epoch, none lost
    for key in list(local)[:500]:
        np.testing.assert_array_equal(ray_rows[key][0], local[key][0])
        np.testing.assert_array_equal(ray_rows[key][1], local[key][1])
    # dynamic masking: the same sample is masked differently in epochs 0 and 1
    sids = [k[1] for k in local if k[0] == 0][:200]
    differ = sum(not np.array_equal(local[(0, s)][1], local[(1, s)][1]) for s in sids)
    assert differ > 0.9 * len(sids)
