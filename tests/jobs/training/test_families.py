"""Every family pretrains through the same `ctx pretrain` path: its tiny recipe, shortened, runs
through Ray Data and Ray Train and its loss falls. Plus the Ray side of stream-ordered batches.

Measured on 2 shared cores: 30-45 s per family (Ray Train worker start ~10 s, tokenizer, 30
steps, checkpoint), ~5 min for the file.
"""

from pathlib import Path

import numpy as np
import pytest

from jobs.training.config import load_recipe
from jobs.training.train import pretrain, stream_resets

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow

SHARD = "data/sample/wordnet-0000-of-0008.txt.gz"
# Shorter than the shipped recipes: 1 worker, 1 shard, a small vocabulary and short rows.
SHORT = [
    f"data.input={SHARD}",
    "tokenizer.vocab_size=2000",
    "tokenizer.sample_chars=300000",
    "data.seq_len=64",
    "data.stream_block_batches=16",
    "train.batch_size=16",
    "train.max_steps=30",
    "train.warmup_steps=5",
    "train.lr=2e-3",
    "train.log_every=5",
    "train.checkpoint_every=30",
    "scaling.num_workers=1",
    "scaling.cpus_per_worker=1",
]
# The metric that shows the family's own objective ran.
OBJECTIVE_METRIC = {
    "elmo": "fwd_loss",
    "gpt": "lm_loss",
    "bert": "mlm_loss",
    "roberta": "mlm_loss",
    "spanbert": "sbo_loss",
    "albert": "sop_loss",
    "transformer-xl": "lm_loss",
    "xlnet": "plm_loss",
    "awd-lstm": "lm_loss",
    "xlm": "mlm_loss",
    "xlm-clm": "lm_loss",  # XLM's causal LM: configs/xlm-tiny.yaml with data.objective clm
}
RECIPES = {"awd-lstm": "ulmfit-tiny", "xlm-clm": "xlm-tiny"}  # configs/<family>-tiny.yaml otherwise


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f == "bert" else [pytest.mark.extended]) for f in OBJECTIVE_METRIC])
def test_tiny_recipe_pretrains_and_loss_falls(ray_session, tmp_path, family):
    overrides = SHORT + [f"output_dir={tmp_path}"]
    if family in ("transformer-xl", "xlnet"):
        overrides.append("model.max_seq_len=64")
    if family.startswith("xlm"):  # the recipe names its language: data.input has one entry per language
        overrides += [f"data.input=[{SHARD}]", *(["data.objective=clm"] if family == "xlm-clm" else [])]
    recipe = REPO / "configs" / f"{RECIPES.get(family, family + '-tiny')}.yaml"
    result = pretrain(load_recipe(recipe, overrides), progress=False, log=lambda *_: None)
    assert result.checkpoint_uri is not None
    assert [m["step"] for m in result.history] == [5, 10, 15, 20, 25, 30]
    losses = [m["loss"] for m in result.history]
    assert all(np.isfinite(losses)) and all(OBJECTIVE_METRIC[family] in m for m in result.history), losses
    assert losses[-1] < losses[0] - 0.3, (family, losses)


def test_xlm_pretrains_on_two_languages_and_trains_both_language_rows(ray_session, tmp_path):
    """data.languages through `ctx pretrain`: English (a tenth of a shard) and a second language
    (the same text spelt backwards, a third of that), alpha sampling logged, a language embedding
    per language in the checkpoint, both rows trained (30 steps cover both shards: the stream
    reads whole shards one after the other), and the loss falls. With data.translations (XLM's
    MLM + TLM), a parallel shard's translation rows join the stream: the worker trains on them
    beside the packed rows (sample log)."""
    import gzip
    import json

    import torch

    from pipelines.dataset import shard_keys

    from ctxmodels.checkpoint import load_checkpoint
    from ctxmodels.registry import new_model

    with gzip.open(REPO / SHARD, "rt") as f:
        lines = f.read().split("\n")[:-1]
    english, backwards = tmp_path / "en" / "english.txt.gz", tmp_path / "xx" / "backwards.txt.gz"
    for path, text in ((english, lines[: len(lines) // 10]),
                       (backwards, [" ".join(w[::-1] for w in line.split(" ")) for line in lines[: len(lines) // 30]])):
        path.parent.mkdir()
        with gzip.open(path, "wt") as f:
            f.write("\n".join(text).strip() + "\n")
    parallel = tmp_path / "pairs" / "en-xx.jsonl"
    parallel.parent.mkdir()
    parallel.write_text("".join(json.dumps({"en": x, "xx": " ".join(w[::-1] for w in x.split(" "))}) + "\n"
                                for x in lines[:120] if x.strip()))
    overrides = [o for o in SHORT if not o.startswith("data.input=")] + [
        f"output_dir={tmp_path}", f"data.input=[{english}, {backwards}]", "data.eval_input=null", "data.languages=[en, xx]",
        f"data.translations={parallel}", "model.family=xlm", "tokenizer.kind=sentencepiece-bpe", "train.sample_log=true",
    ]
    lines_logged: list[str] = []
    result = pretrain(load_recipe(REPO / "configs" / "bert-tiny.yaml", overrides), progress=False, log=lines_logged.append)
    languages = next(line for line in lines_logged if line.startswith("data: languages"))
    assert "en (id 0" in languages and "xx (id 1" in languages and "an epoch keeps 100.0% of its rows" in languages, languages
    assert any("1 parallel shard(s)" in line for line in lines_logged), lines_logged
    keys = shard_keys([str(english), str(backwards), str(parallel)])
    trained = [sid >> 32 for f in (Path(result.run_uri) / "sample_log").glob("*.jsonl")
               for line in f.read_text().splitlines()[1:] for sid in json.loads(line)["ids"]]
    assert {k: trained.count(k) > 0 for k in keys} == {k: True for k in keys}, "a shard's rows never reached the worker"
    losses = [m["loss"] for m in result.history]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3, losses
    ckpt = load_checkpoint(result.checkpoint_uri)
    assert ckpt.family == "xlm" and ckpt.config.type_vocab_size == 2 and not ckpt.config.mlm_transform
    table = ckpt.model.backbone.embeddings.token_type.weight
    start = new_model("xlm", ckpt.config, seed=0).backbone.embeddings.token_type.weight  # train.seed 0: the initial weights
    assert torch.all((table - start).abs().amax(dim=1) > 1e-3), "a language row was never trained"


@pytest.mark.extended  # the in-process translation-LM tests (test_learning, test_languages) show the same stages
def test_xlm_translation_lm_pretrains_from_parallel_records(ray_session, tmp_path):
    """objective tlm through `ctx pretrain`: the tokenizer trained on both sides of the records,
    translation rows through Ray Data (positions and languages reach the model), the loss falls."""
    import gzip
    import json

    from ctxmodels.checkpoint import load_checkpoint
    from pipelines.sources import iter_documents

    parallel = tmp_path / "en-xx.jsonl.gz"
    with gzip.open(parallel, "wt") as f:
        for line in (s for chunk in iter_documents(str(REPO / SHARD)) for doc in chunk for s in doc.split("\n")):
            f.write(json.dumps({"en": line, "xx": " ".join(w[::-1] for w in line.split())}) + "\n")
    overrides = [o for o in SHORT if not o.startswith("data.input=")] + [
        f"output_dir={tmp_path}", f"data.input={parallel}", "data.eval_input=null", "data.languages=[en, xx]",
        "data.objective=tlm", "model.family=xlm", "tokenizer.kind=sentencepiece-bpe",
    ]
    result = pretrain(load_recipe(REPO / "configs" / "bert-tiny.yaml", overrides), progress=False, log=lambda *_: None)
    losses = [m["loss"] for m in result.history]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3, losses
    assert load_checkpoint(result.checkpoint_uri).config.type_vocab_size == 2


def test_ray_stream_rows_are_whole_batches_delivered_in_block_order(ray_session, tmp_path):
    """Ray Data rows of a stream objective are exactly the local batches, one per row, and a
    consumer that applies the loop's reset rule resets only where a block starts."""
    from jobs.training.train import stream_spec
    from pipelines.dataset import build_dataset, local_batches
    from pipelines.sources import sample_text
    from pipelines.tokenizers import train_tokenizer

    recipe = load_recipe(REPO / "configs" / "transformer-xl-tiny.yaml", SHORT + ["train.batch_size=8", "model.max_seq_len=64", "data.max_epochs=1"])
    spec = stream_spec(recipe, [str(REPO / SHARD)])
    assert spec.stream_rows == 8
    tok = train_tokenizer("wordpiece", sample_text([str(REPO / SHARD)], 300_000), 2000)
    tok.save(tmp_path / "tok")
    local = {(int(b["_stream_block"][0]), int(b["_stream_index"][0])): b for b in local_batches(spec, tok, 8, epoch=0)}
    seen, blocks, indices = 0, [], []
    for row in build_dataset(spec, tmp_path / "tok").iter_batches(batch_size=1, batch_format="numpy"):
        batch = {k: v[0] for k, v in row.items()}
        key = (int(batch["_stream_block"][0]), int(batch["_stream_index"][0]))
        np.testing.assert_array_equal(batch["input_ids"], local[key]["input_ids"])
        np.testing.assert_array_equal(batch["labels"], local[key]["labels"])
        assert "reset_memory" not in batch
        blocks.append(key[0])
        indices.append(key[1])
        seen += 1
    assert seen == len(local)
    resets, _ = stream_resets(None, blocks, indices)
    assert int(resets.sum()) == len(set(blocks))  # one reset per block: no block was torn apart
