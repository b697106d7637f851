"""Recipes fail before Ray starts, with a message that names the key."""

import re
from pathlib import Path

import pytest

from jobs.training.config import Recipe, RecipeError, load_recipe, parse_override

REPO = Path(__file__).resolve().parents[3]
RECIPES = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_loads(path):
    recipe = load_recipe(path)
    assert recipe.name and recipe.train.max_steps > 0


def test_bert_tiny_exists_and_keeps_the_documented_keys():
    r = load_recipe(REPO / "configs" / "bert-tiny.yaml")
    assert r.model.family == "bert"
    for key in ("input",):
        assert hasattr(r.data, key)
    assert r.output_dir and r.train.max_steps and r.scaling.num_workers


def test_overrides_reach_every_section_with_types():
    r = load_recipe(REPO / "configs" / "bert-tiny.yaml", ["train.lr=3e-4", "data.input=s3://bucket/corpus/", "train.max_steps=7", "scaling.num_workers=4", "model.d_model=128", "model.n_head=4", "train.betas=[0.9, 0.999]"])
    assert r.train.lr == pytest.approx(3e-4)
    assert r.data.input == "s3://bucket/corpus/"
    assert r.train.max_steps == 7 and r.scaling.num_workers == 4
    assert r.model.overrides["d_model"] == 128
    assert r.train.betas == (0.9, 0.999)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lrr=1e-3", "train.lrr"),
        ("train.max_steps=many", "train.max_steps"),
        ("data.seq_len=4", "data.seq_len"),
        ("model.d_modle=64", "d_modle"),
        ("model.d_model=sixty", "d_model"),
        ("model.family=bort", "family"),
        ("model.preset=huge", "preset"),
        ("scaling.num_workers=3", "train.batch_size"),
        ("data.objective=guess", "data.objective"),
        ("train.max_bad_steps=0", "train.max_bad_steps"),
        ("train.debug_nan_steps=[0, 3]", "train.debug_nan_steps"),
        ("train.residual=bf16", "train.residual: bf16 needs train.precision: bf16"),
        ("train.residual=fp16", "train.residual"),
        ("nonsense=1", "nonsense"),
        ("data.input=[data/part-[0-6].gz]", "the value of data.input is not valid YAML (expected ',' or ']'"),  # not a traceback
    ],
)
def test_bad_keys_and_values_are_named(override, key):
    with pytest.raises(RecipeError) as e:
        load_recipe(REPO / "configs" / "bert-tiny.yaml", [override])
    assert key in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.family=bert"], "data.languages: only family 'xlm' has language embeddings, not 'bert'"),
        (["data.languages=[en, fr]"], "data.input: with data.languages, a list of 2 entries"),
        (["data.languages=[en, fr]", "data.input=[a, b]"], "data.eval_input: with data.languages, a list of 2 entries"),
        (["data.languages=[en, en]", "data.input=[a, b]", "data.eval_input=null"], "data.languages: distinct"),
        (["model.type_vocab_size=1"], "model.type_vocab_size: data.languages lists 1 language(s), which needs type_vocab_size=0"),
        (["data.language_alpha=0"], "data.language_alpha"),
        (["data.objective=tlm"], "data.languages: the translation LM (objective tlm) reads records that name two"),
        (["data.translations=p.jsonl"], "data.translations: XLM's MLM + TLM adds translation rows"),
        (["data.translations=p.jsonl", "data.objective=tlm", "data.languages=[en, fr]"], "it needs objective mlm and at least two languages"),
        (["model.causal=true"], "model.causal: objective 'mlm' needs causal=False"),
        (["data.objective=clm", "model.causal=false"], "model.causal: objective 'clm' needs causal=True"),
    ],
)
def test_xlm_languages_are_checked_against_inputs_and_the_model(overrides, message):
    with pytest.raises(RecipeError) as e:
        load_recipe(REPO / "configs" / "xlm-tiny.yaml", overrides)
    assert message in str(e.value)
    two = load_recipe(REPO / "configs" / "xlm-tiny.yaml", ["data.languages=[en, fr]", "data.input=[a, b]", "data.eval_input=[c, d]"])
    assert two.data.languages == ["en", "fr"] and two.data.language_alpha == 0.5
    tlm = load_recipe(REPO / "configs" / "xlm-tiny.yaml", ["data.objective=tlm", "data.languages=[en, fr]", "data.input=s3://p/"])
    assert tlm.data.input == "s3://p/"  # parallel records name their languages: no entry per language
    both = load_recipe(REPO / "configs" / "xlm-tiny.yaml", ["data.languages=[en, fr]", "data.input=[a, b]", "data.eval_input=null",
                                                             "data.translations=[s3://p/, s3://q/]"])
    assert both.data.translations == ["s3://p/", "s3://q/"]  # MLM + TLM: the languages' shards and parallel ones
    clm = load_recipe(REPO / "configs" / "xlm-tiny.yaml", ["data.objective=clm", "data.languages=[en, fr]", "data.input=[a, b]",
                                                            "data.eval_input=null"])
    assert clm.data.objective == "clm"  # XLM's causal LM, one language a row


def test_parallel_shards_are_listed_and_a_shard_in_both_is_refused(tmp_path):
    from jobs.training.train import parallel_shards
    from pipelines import storage

    (tmp_path / "en.txt").write_text("x\n")
    (tmp_path / "pairs").mkdir()
    (tmp_path / "pairs" / "p.jsonl").write_text("{}\n")
    recipe = load_recipe(REPO / "configs" / "xlm-tiny.yaml", ["data.languages=[en, fr]", "data.input=[a, b]", "data.eval_input=null",
                                                               f"data.translations={tmp_path / 'pairs'}"])
    logged: list[str] = []
    assert parallel_shards(storage.Store(), recipe, [str(tmp_path / "en.txt")], logged.append) == [str(tmp_path / "pairs" / "p.jsonl")]
    assert "1 parallel shard(s)" in logged[0]
    with pytest.raises(RecipeError, match=r"data.translations: .*p.jsonl is also one of data.input's language shards"):
        parallel_shards(storage.Store(), recipe, [str(tmp_path / "pairs" / "p.jsonl")], logged.append)


def test_language_shards_give_each_entry_its_language_and_refuse_a_shard_in_two(tmp_path):
    from jobs.training.train import language_shards
    from pipelines import storage

    for name in ("en/a.txt", "en/b.txt", "fr/c.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("x\n")
    store = storage.Store()
    shards, langs = language_shards(store, [str(tmp_path / "fr"), str(tmp_path / "en")])
    assert [Path(s).name for s in shards] == ["c.txt", "a.txt", "b.txt"] and langs == (0, 1, 1)
    assert store.file_sizes(shards) == [2, 2, 2]
    with pytest.raises(RecipeError, match="listed for two languages"):
        language_shards(store, [str(tmp_path / "en"), str(tmp_path / "en" / "a.txt")])


def test_missing_recipe_file_and_bad_yaml(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)


def test_parse_override_forms():
    assert parse_override("train.lr=3e-4") == (["train", "lr"], 3e-4)
    assert parse_override("data.input=[a, b]") == (["data", "input"], ["a", "b"])
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        parse_override("train.lr")


def test_elastic_worker_range_keeps_the_global_batch():
    r = load_recipe(REPO / "configs" / "bert-tiny.yaml", ["scaling.num_workers=[1, 2]", "train.batch_size=32"])
    assert r.scaling.num_workers == (1, 2) and r.micro_batch_size == 16  # batch / the most workers
    assert (r.accumulation(1), r.accumulation(2)) == (2, 1)
    r = load_recipe(REPO / "configs" / "bert-tiny.yaml", ["scaling.num_workers=[2, 3]", "train.batch_size=48", "train.micro_batch_size=8"])
    assert (r.accumulation(2), r.accumulation(3)) == (3, 2)
    assert all(r.accumulation(w) * w * 8 == 48 for w in (2, 3))
    # 3 workers cannot run whole micro-batches of 8 in a batch of 32: refused, naming the count
    with pytest.raises(RecipeError, match=r"train.batch_size.*\[3\] worker"):
        load_recipe(REPO / "configs" / "bert-tiny.yaml", ["scaling.num_workers=[1, 4]", "train.batch_size=32"])
    for bad in ("[0, 2]", "[3, 2]", "[1, 2, 3]"):
        with pytest.raises(RecipeError, match="scaling.num_workers"):
            load_recipe(REPO / "configs" / "bert-tiny.yaml", [f"scaling.num_workers={bad}"])
    # the range survives the JSON round trip the recipe makes to reach the workers
    again = Recipe.model_validate(r.model_dump(mode="json"))
    assert again.scaling.num_workers == (2, 3)


def test_worker_resources_and_resize_interval_reach_ray_trains_scaling_config():
    from jobs.training.loop import scaling_config

    r = load_recipe(REPO / "configs" / "bert-tiny.yaml", [
        "scaling.num_workers=[1, 2]", "scaling.resources_per_worker={trainer_slot: 1}", "scaling.resize_interval_s=5",
    ])
    again = Recipe.model_validate(r.model_dump(mode="json"))  # as the workers receive it
    assert again.scaling.resources_per_worker == {"trainer_slot": 1.0} and again.scaling.resize_interval_s == 5.0
    sc = scaling_config(again.scaling)
    assert sc.num_workers == (1, 2) and sc.elasticity_enabled
    assert sc.resources_per_worker == {"CPU": 0.5, "trainer_slot": 1.0}
    assert sc.elastic_resize_monitor_interval_s == 5.0
    # defaults: CPUs only, Ray's own 60 s
    plain = scaling_config(load_recipe(REPO / "configs" / "bert-tiny.yaml").scaling)
    assert plain.resources_per_worker == {"CPU": 0.5} and plain.elastic_resize_monitor_interval_s == 60.0
    for bad, words in (("{CPU: 1}", "cpus_per_worker"), ("{GPU: 1}", "use_gpu"), ("{slot: 0}", "> 0"), ("{slot: yes}", "> 0"), ("[slot]", "mapping")):
        with pytest.raises(RecipeError, match=rf"scaling.resources_per_worker: .*{re.escape(words)}"):
            load_recipe(REPO / "configs" / "bert-tiny.yaml", [f"scaling.resources_per_worker={bad}"])
    with pytest.raises(RecipeError, match="scaling.resize_interval_s"):
        load_recipe(REPO / "configs" / "bert-tiny.yaml", ["scaling.resize_interval_s=-1"])
