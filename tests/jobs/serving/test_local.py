"""``jobs.serving.local.LocalModel``: a model in the caller's process, checked against independent
computations. MiniLM's vectors against sentence-transformers on the same folder; a tiny pair classifier's
labels against its logits by hand; masked tokens and greedy generation against the model's own outputs;
token vectors against the sentence vector; inputs refused as the routes refuse them. No Ray, no server."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tests.jobs.serving.test_serve_tasks import V, _encode, _logits, _task_ckpt

TOL = 1e-5
TEXTS = ["the river bank was muddy after the rain", "the bank raised its interest rates",
         "a quick word", "she sat on the bank of the river and watched the boats go by for hours"]


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    from jobs.serving.local import LocalModel

    with LocalModel(str(minilm_dir)) as model:
        yield model


@pytest.fixture(scope="module")
def tok(minilm_dir):
    from pipelines.tokenizers import load_tokenizer

    return load_tokenizer(minilm_dir)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, minilm_dir):
    """(LocalModel, in-process model) of a tiny BERT pair classifier with MiniLM's vocabulary."""
    from ctxmodels.tasks import TaskConfig
    from jobs.serving.local import LocalModel

    path = tmp_path_factory.mktemp("local") / "pair"
    model = _task_ckpt(path, "bert", TaskConfig(kind="classification", num_labels=2, labels=["no", "yes"]), minilm_dir, seed=1)
    with LocalModel(str(path), max_batch_size=2) as local:
        yield local, model


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, minilm_dir):
    """{family: (LocalModel, in-process model)} of untrained tiny BERT and GPT with MiniLM's vocabulary."""
    from ctxmodels.checkpoint import load_checkpoint, save_checkpoint
    from ctxmodels.registry import build_model
    from jobs.serving.local import LocalModel

    root, out = tmp_path_factory.mktemp("local-lm"), {}
    for family in ("bert", "gpt"):
        cfg, model = build_model(family, "tiny", V, seed=6)
        save_checkpoint(root / family, model, family, cfg, tokenizer_dir=minilm_dir)
        out[family] = (LocalModel(str(root / family)), load_checkpoint(root / family).model.eval())
    yield out
    for local, _ in out.values():
        local.close()


def test_encode_equals_sentence_transformers_on_the_same_folder(minilm, minilm_dir):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_dir), device="cpu")
    want = reference.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    got = minilm.encode(TEXTS, normalize=True)
    assert got.shape == (4, 384) == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=TOL)
    one = minilm.encode(TEXTS[2], normalize=True)  # one string: one vector, as sentence-transformers gives
    assert one.shape == (384,)
    np.testing.assert_allclose(one, want[2], atol=TOL)
    np.testing.assert_allclose(minilm.encode(tuple(TEXTS), normalize=True), want, atol=TOL)  # any iterable of texts
    unnormalised = minilm.encode(TEXTS)
    np.testing.assert_allclose(unnormalised / np.linalg.norm(unnormalised, axis=1, keepdims=True), want, atol=TOL)


@pytest.fixture(scope="module")
def st_minilm(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


ST_CALLS = [{}, {"normalize_embeddings": True}, {"prompt": "query: ", "batch_size": 3}, {"truncate_dim": 64},
            {"truncate_dim": 48, "normalize_embeddings": True}, {"convert_to_tensor": True}, {"convert_to_numpy": False},
            {"output_value": "token_embeddings"}, {"show_progress_bar": True, "batch_size": 2},
            {"precision": "int8"}, {"precision": "uint8", "normalize_embeddings": True}, {"precision": "binary"},
            {"precision": "ubinary", "convert_to_tensor": True}]


@pytest.mark.parametrize("keywords", ST_CALLS, ids=lambda k: ",".join(k) or "defaults")
def test_sentence_transformers_encode_keywords_give_its_answers(minilm, st_minilm, keywords):
    """A script written for sentence-transformers runs on a LocalModel and gets the same values and
    types: its keywords, its folder's pooling, Normalize module and max_seq_length (256 tokens: the
    long text is cut there, not at the 512 positions the model has)."""
    texts = TEXTS + ["word " * 400]
    want, got = st_minilm.encode(texts, **keywords), minilm.encode(texts, **keywords)
    assert type(got) is type(want)
    if isinstance(want, list):  # of tensors: per text, or per text its tokens' vectors
        assert [type(g) for g in got] == [type(w) for w in want] and [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.numpy(), w.numpy(), atol=1e-5)
    else:
        assert got.shape == want.shape and got.dtype == want.dtype
        # int8 levels: a vector 1e-7 away from theirs may sit one level over a boundary
        levels = keywords.get("precision", "").endswith("int8")
        np.testing.assert_allclose(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64), atol=1 if levels else TOL)
    if keywords.get("precision", "float32").endswith("int8"):  # ranges from one vector: refused, as there
        with pytest.raises(ValueError, match="one vector has none"):
            minilm.encode(texts[0], **keywords)
        return
    one, one_want = minilm.encode(texts[0], **keywords), st_minilm.encode(texts[0], **keywords)
    assert type(one) is type(one_want) and tuple(one.shape) == tuple(one_want.shape)


def test_similarity_dimension_and_length_are_sentence_transformers(minilm, st_minilm):
    vectors = minilm.encode(TEXTS)
    want = st_minilm.similarity(vectors, vectors[:2]).numpy()
    np.testing.assert_allclose(minilm.similarity(vectors, vectors[:2]).numpy(), want, atol=TOL)
    assert minilm.similarity(vectors[0], vectors[1]).shape == (1, 1)
    assert minilm.get_embedding_dimension() == minilm.get_sentence_embedding_dimension() == st_minilm.get_embedding_dimension() == 384
    assert minilm.max_seq_length == st_minilm.max_seq_length == 256
    assert minilm.info["sentence_transformers"] == {"pooling": "mean", "normalize": True, "max_seq_length": 256, "similarity": "cosine"}
    unnormalised = minilm.encode(TEXTS, normalize=False)  # ours: the pooled vector before the Normalize module
    np.testing.assert_allclose(unnormalised / np.linalg.norm(unnormalised, axis=1, keepdims=True), vectors, atol=TOL)
    with pytest.raises(ValueError, match="dimensions and truncate_dim: give one of them"):
        minilm.encode(TEXTS, dimensions=8, truncate_dim=8)
    with pytest.raises(ValueError, match="prompt and prompt_name: give one of them"):
        minilm.encode(TEXTS, prompt="a", prompt_name="b")


def test_the_deployments_pooling_and_normalize_settings_come_before_the_folders(minilm, minilm_dir, pretrained):
    from jobs.serving.local import LocalModel

    with LocalModel(str(minilm_dir), pooling="cls", normalize=False) as cls:
        np.testing.assert_allclose(cls.encode(TEXTS), minilm.encode(TEXTS, pooling="cls", normalize=False), atol=TOL)
        np.testing.assert_allclose(cls.encode(TEXTS, pooling="mean", normalize=True), minilm.encode(TEXTS), atol=TOL)
        assert (cls.info["pooling"], cls.info["normalize"]) == ("cls", False)
    assert (minilm.info["pooling"], minilm.info["normalize"]) == ("mean", True)
    assert (pretrained["gpt"][0].info["pooling"], pretrained["gpt"][0].info["normalize"]) == ("mean", False)
    gpt_folder = pretrained["gpt"][0].info["checkpoint"]
    with pytest.raises(ValueError, match="pooling 'cls' is set, but it is a causal gpt model"):
        LocalModel(gpt_folder, pooling="cls")


def test_a_folders_prompts_and_similarity_are_used_as_sentence_transformers_uses_them(minilm_dir, tmp_path):
    import json

    from sentence_transformers import SentenceTransformer

    from jobs.serving.local import LocalModel

    folder = tmp_path / "prompted"
    folder.mkdir()
    for item in minilm_dir.iterdir():  # the weights linked, not copied
        (folder / item.name).symlink_to(item)
    (folder / "config_sentence_transformers.json").unlink()
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "passage", "similarity_fn_name": "dot"}))
    reference = SentenceTransformer(str(folder), device="cpu")
    with LocalModel(str(folder)) as model:
        for keywords in ({}, {"prompt_name": "query"}, {"prompt": "title: "}):
            np.testing.assert_allclose(model.encode(TEXTS, **keywords), reference.encode(TEXTS, **keywords), atol=TOL)
        for method in ("encode_query", "encode_document"):  # the "query" and "passage" prompts
            np.testing.assert_allclose(getattr(model, method)(TEXTS), getattr(reference, method)(TEXTS), atol=TOL)
        assert not np.allclose(model.encode_query(TEXTS), model.encode_document(TEXTS), atol=1e-3)
        assert not np.allclose(model.encode(TEXTS), model.encode(TEXTS, prompt=""), atol=1e-3)  # the default prompt is used
        vectors = model.encode(TEXTS)
        np.testing.assert_allclose(model.similarity(vectors, vectors).numpy(), reference.similarity(vectors, vectors).numpy(), atol=TOL)
        np.testing.assert_allclose(model.similarity(vectors, vectors).numpy(), vectors @ vectors.T, atol=TOL)  # dot
        with pytest.raises(ValueError, match=r"prompt_name 'title': model 'local' has no such prompt \(its prompts: 'query', 'passage'\)"):
            model.encode(TEXTS, prompt_name="title")


def test_matryoshka_dimensions_keep_the_first_values_renormalised(minilm):
    full = minilm.encode(TEXTS)
    cut = minilm.encode(TEXTS, dimensions=64, normalize=True)
    np.testing.assert_allclose(cut, full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True), atol=TOL)


def test_token_vectors_average_to_the_sentence_vector(minilm, tok):
    rows = minilm.token_embeddings(TEXTS)
    sentence = minilm.encode(TEXTS, normalize=False)  # mean pooling over every token, [CLS] and [SEP] included
    ids, _, tokens = tok.encode_for_model(TEXTS, 512)
    for row, vec, want_tokens in zip(rows, sentence, tokens):
        assert row["tokens"] == list(want_tokens) and row["n_tokens"] == len(want_tokens)
        assert row["embeddings"].shape == (len(want_tokens), 384)
        np.testing.assert_allclose(np.asarray(row["embeddings"]).mean(0), vec, atol=TOL)
    words = minilm.token_embeddings("the river bank", granularity="word")[0]
    assert words["words"] == ["the", "river", "bank"] and np.asarray(words["embeddings"]).shape == (3, 384)


def test_a_long_text_is_cut_to_the_model_unless_truncate_is_false(minilm):
    long = "word " * 2000
    assert minilm.encode(long).shape == (384,)
    with pytest.raises(ValueError, match="longer than the 256 tokens"):  # its folder's max_seq_length, not its 512 positions
        minilm.encode(long, truncate=False)


@pytest.mark.parametrize("texts, words", [([], "must not be empty"), (["ok", 3], "item 1 is int"), (["ok", "  "], "item 1 is empty"),
                                          (7, "got int")])
def test_bad_texts_raise_a_value_error_naming_the_problem(minilm, texts, words):
    with pytest.raises(ValueError, match=words):
        minilm.encode(texts)


def test_a_route_the_model_does_not_serve_names_the_ones_it_does(minilm):
    with pytest.raises(ValueError, match="/v1/classify needs") as e:
        minilm.classify("a text")
    assert "/v1/embeddings" in str(e.value)


def test_classify_texts_and_pairs_equal_the_logits_by_hand(pair, tok):
    from jobs.serving.serve_tasks import softmax

    local, model = pair
    pairs = [("A man plays a guitar.", "Someone makes music."), ("The cat sleeps.", "Stocks fell sharply today."),
             ("It rains.", "The streets are wet.")]
    data = local.classify(pairs)
    cols = _encode(tok, {"text": [a for a, _ in pairs], "text_pair": [b for _, b in pairs]}, kind="classification", max_len=128,
                   labels=("no", "yes"), text_field="text", pair_field="text_pair")
    probs = softmax(_logits(model, cols))
    assert [d["index"] for d in data] == [0, 1, 2]
    for d, p in zip(data, probs):
        assert d["label"] == ["no", "yes"][int(p.argmax())]
        got = {x["label"]: x["score"] for x in d["labels"]}
        np.testing.assert_allclose([got["no"], got["yes"]], p, atol=TOL)
    ranked = local.rerank("A man plays a guitar.", ["Stocks fell.", "Someone makes music."], return_text=True)
    assert sorted(r["index"] for r in ranked) == [0, 1] and ranked[0]["score"] >= ranked[1]["score"]
    assert ranked[0]["text"] == ["Stocks fell.", "Someone makes music."][ranked[0]["index"]]
    with pytest.raises(ValueError, match="a pair is"):
        local.classify([("only one",)])


def test_callers_on_several_threads_get_their_own_answers(pair):
    """Eight threads at once share the replica's passes (max_batch_size 2: rows from different callers
    run together) and each gets what it gets alone."""
    local, _ = pair
    texts = [f"text number {i} is about {'rivers' if i % 2 else 'banks'}" for i in range(8)]
    alone = [local.classify(t)[0]["labels"] for t in texts]
    together: list = [None] * len(texts)

    def ask(i: int) -> None:
        together[i] = local.classify(texts[i])[0]["labels"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(alone, together):
        assert [x["label"] for x in a] == [x["label"] for x in b]
        np.testing.assert_allclose([x["score"] for x in a], [x["score"] for x in b], atol=TOL)


def test_fill_mask_and_greedy_generation_equal_the_models_own(pretrained, tok):
    local, model = pretrained["bert"]
    text = "the [MASK] flows past the bank."
    (item,) = local.fill_mask(text, top_k=3)
    ids, _, _ = tok.encode_for_model([text], 512)
    with torch.inference_mode():
        probs = torch.softmax(model.mlm_logits(torch.tensor([ids[0]]))[0], dim=-1)
    position = int(np.flatnonzero(np.asarray(ids[0]) == tok.mask_id)[0])
    top = torch.topk(probs[position], 3)
    assert [p["token_id"] for p in item["masks"][0]["predictions"]] == top.indices.tolist()
    with pytest.raises(ValueError, match="no mask token"):
        local.fill_mask("no mask here")

    local, model = pretrained["gpt"]
    out = local.generate("the river bank", max_tokens=6, temperature=0)
    prompt = [tok.cls_id, *tok.encode_batch(["the river bank"])[0].tolist()]
    new = []
    for _ in range(6):
        with torch.inference_mode():
            nxt = int(model.logits(torch.tensor([prompt + new]))[0, -1].argmax())
        if nxt == tok.sep_id:
            break
        new.append(nxt)
    assert out["choices"][0]["token_ids"] == new
    sampled = local.generate("the river bank", max_tokens=6, seed=3)
    assert local.generate("the river bank", max_tokens=6, seed=3)["choices"] == sampled["choices"]
    with pytest.raises(ValueError, match="temperature"):
        local.generate("the river bank", temperature=-1)


def test_tokenize_info_and_a_closed_model(pretrained, minilm_dir):
    from jobs.serving.local import LocalModel

    local, _ = pretrained["bert"]
    (row,) = local.tokenize("the river bank", add_special_tokens=False)
    assert row["tokens"] == ["the", "river", "bank"] and row["fits"]
    assert local.info["family"] == "bert" and "/v1/fill-mask" in local.info["routes"]
    model = LocalModel(str(minilm_dir))
    model.close()
    with pytest.raises(RuntimeError, match="closed"):
        model.classify("a text")


def test_a_missing_folder_or_a_bad_setting_is_named_and_leaves_no_thread(minilm_dir, tmp_path):
    from jobs.serving.local import LocalModel

    before = set(threading.enumerate())
    with pytest.raises(Exception, match="does not exist"):
        LocalModel(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="dtype"):
        LocalModel(str(minilm_dir), dtype="float8")
    assert set(threading.enumerate()) <= before


@pytest.fixture(scope="module")
def families(tmp_path_factory, minilm_dir):
    """{family: checkpoint folder} of every family's untrained tiny preset with MiniLM's vocabulary."""
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import FAMILIES, build_model

    root = tmp_path_factory.mktemp("local-families")
    for family in FAMILIES:
        cfg, model = build_model(family, "tiny", V, seed=0)
        save_checkpoint(root / family, model, family, cfg, tokenizer_dir=minilm_dir)
    return {family: root / family for family in FAMILIES}


@pytest.mark.parametrize("family", ["bert", "roberta", "spanbert", "albert", "xlm", "elmo", "gpt", "transformer-xl", "xlnet", "awd-lstm"])
def test_every_familys_vector_of_a_text_is_the_same_alone_and_padded_among_others(families, family):
    """Texts of different lengths share a pass (padded, or packed on the CPU); each one's vector equals
    the one it gets in a pass of its own, for every family (the causal ones read at their last token)."""
    from ctxmodels.registry import FAMILIES
    from jobs.serving.local import LocalModel

    assert sorted(families) == sorted(FAMILIES)  # the parametrization names every family
    texts = ["bank", "the river bank after the long rain", "a bank raised its rates again this quarter and savers worried"]
    pooling = "last" if family in ("gpt", "transformer-xl", "awd-lstm") else "mean"
    with LocalModel(str(families[family])) as model:
        together = model.encode(texts, pooling=pooling)
        alone = np.stack([model.encode(t, pooling=pooling) for t in texts])
        assert max(n for n, _ in model._replica.recent_passes) == len(texts)  # the three did share a pass
    assert together.shape == (3, 64) and np.isfinite(together).all()
    np.testing.assert_allclose(together, alone, atol=TOL)
