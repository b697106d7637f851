"""jobs.serving.passes: a request's chunks tokenized on the replica's threads, in order, with the same ids and
the same refusals as on one thread."""

from __future__ import annotations

import threading
import time

import pytest

from jobs.serving.passes import ordered_map, tokenizing_pool


def test_ordered_map_keeps_the_order_whatever_finishes_first_and_runs_on_the_pool():
    pool = tokenizing_pool(3)
    threads = set()

    def slow_first(i: int) -> int:
        threads.add(threading.current_thread().name)
        time.sleep(0.02 * (5 - i % 5))  # earlier items finish later
        return i * i

    try:
        assert list(ordered_map(pool, slow_first, range(12))) == [i * i for i in range(12)]
        assert threads and all(name.startswith("ctx-tokenize") for name in threads) and len(threads) > 1
        assert tokenizing_pool(1) is None and list(ordered_map(None, str, [1, 2])) == ["1", "2"]
    finally:
        pool.shutdown()


def test_ordered_map_stops_early_without_running_the_rest_and_passes_errors_on():
    pool = tokenizing_pool(2)
    started = []

    def work(i: int) -> int:
        started.append(i)
        if i == 7:
            raise ValueError("item 7")
        time.sleep(0.01)
        return i

    try:
        results = ordered_map(pool, work, range(1000))
        assert [next(results) for _ in range(3)] == [0, 1, 2]
        results.close()  # the consumer stops (a request refused at its token budget)
        pool.shutdown(wait=True)
        assert len(started) <= 3 + 2 * 2  # what it had asked for and at most two per thread ahead
    finally:
        pool.shutdown()
    pool = tokenizing_pool(2)
    try:
        with pytest.raises(ValueError, match="item 7"):
            list(ordered_map(pool, work, range(20)))
    finally:
        pool.shutdown()


def test_a_replica_tokenizes_a_bulk_request_on_its_threads_with_the_same_ids_and_refusals(minilm_dir):
    """A replica with 3 torch threads (Ray sets those from its num_cpus) tokenizes the 64-text chunks of
    a request on 3 threads: the same ids and offsets as a one-thread replica, the same refusal of a text
    too long (named by its index, in a late chunk) and of a request over its token budget."""
    import torch

    from jobs.serving.replica import EmbeddingReplica
    from jobs.serving.serve_config import InputError, LimitError, Limits, ModelConfig

    words = "the river bank was wet after the long rain fell on the quiet town".split()
    texts = [" ".join(words[: 1 + i % len(words)]) + f" {i}" for i in range(300)]  # 5 chunks of 64
    from pipelines.tokenizers import load_tokenizer

    budget = sum(len(row) for row in load_tokenizer(minilm_dir).ids_for_model(texts, 512)) + 10  # texts, not twice
    from jobs.serving.passes import on_forward_thread

    before = on_forward_thread(torch.get_num_threads)  # the replica reads its threads where its passes run
    replicas = {}
    try:
        for threads in (1, 3):
            on_forward_thread(torch.set_num_threads, threads)
            replicas[threads] = EmbeddingReplica("m", str(minilm_dir), None, ModelConfig(uri=str(minilm_dir)),
                                                 Limits(max_tokens_per_request=budget))
    finally:
        on_forward_thread(torch.set_num_threads, before)
    one, three = replicas[1], replicas[3]
    assert one._tokenizing is None and three._tokenizing._max_workers == 3
    submitted = []
    submit = three._tokenizing.submit
    three._tokenizing.submit = lambda fn, chunk: submitted.append(len(chunk)) or submit(fn, chunk)
    ids_one, ids_three = one._encode_ids(texts, truncate=False), three._encode_ids(texts, truncate=False)
    assert submitted == [64, 64, 64, 64, 44]
    assert len(ids_three) == 300 and all((a == b).all() for a, b in zip(ids_one, ids_three))
    (ids_a, offsets_a, tokens_a), (ids_b, offsets_b, tokens_b) = (r._encode(texts[:130], truncate=False) for r in (one, three))
    assert all((a == b).all() for a, b in zip(ids_a, ids_b)) and (offsets_a, tokens_a) == (offsets_b, tokens_b)
    assert len(tokens_b) == 130
    long = list(texts)
    long[250] = "bank " * 600
    for replica in (one, three):
        with pytest.raises(InputError, match=r"input\[250\] is longer than the 256 tokens"):  # MiniLM's max_seq_length
            replica._encode_ids(long, truncate=False)
        with pytest.raises(LimitError) as refused:
            replica._encode_ids(texts * 2, truncate=False)
        assert f"{budget} tokens" in str(refused.value)
    messages = set()
    for replica in (one, three):
        try:
            replica._encode_ids(texts * 2, truncate=False)
        except LimitError as e:
            messages.add(str(e))
    assert len(messages) == 1  # counted over the same texts
    three._tokenizing.shutdown()


def test_sentence_vectors_from_bucket_padded_passes_equal_the_eager_ones_and_other_features_stay_eager(minilm_dir, caplog):
    """What a GPU replica replays from CUDA graphs (``cuda_graphs``), run eagerly on the CPU
    (``record=False``): the same vectors as plain passes; a strategy other than "last" reads every
    layer and so runs eagerly; a replay that disagrees with the eager pass at start-up turns graphs off."""
    import numpy as np
    import torch

    from ctxmodels.graphs import GraphedPasses
    from jobs.serving.replica import EmbeddingReplica
    from jobs.serving.serve_config import Limits, ModelConfig

    replica = EmbeddingReplica("m", str(minilm_dir), None, ModelConfig(uri=str(minilm_dir), max_batch_size=8), Limits())
    assert replica._graphed is None  # the CPU: every pass eager
    words = "the river bank was wet after the long rain fell on the quiet town".split()
    texts = [" ".join(words[: 1 + (7 * i) % len(words)]) for i in range(21)]
    plain = np.stack(replica.embed_now(texts, normalize=True)["embeddings"])
    last = replica._forward_check()[-1]
    graphed = replica._graphed_passes(last, record=False)
    assert isinstance(graphed, GraphedPasses)
    replica._graphed = graphed
    got = np.stack(replica.embed_now(texts, normalize=True)["embeddings"])
    np.testing.assert_allclose(got, plain, atol=1e-5)
    assert {R for R, _ in graphed.buckets} <= {1, 2, 4, 8} and len(graphed.buckets) >= 2
    seen = len(graphed.buckets)
    replica.embed_now(texts, features="sum-last-four")
    assert len(graphed.buckets) == seen  # no bucket used: every layer was read, eagerly

    def wrong(self, ids, mask):
        return torch.zeros(*ids.shape, replica.dim)

    def unrecordable(self, ids, mask):
        raise RuntimeError("operation not permitted when stream is capturing")

    call = GraphedPasses.__call__
    try:
        GraphedPasses.__call__ = wrong
        assert replica._graphed_passes(last, record=False) is None
        GraphedPasses.__call__ = unrecordable
        assert replica._graphed_passes(last, record=False) is None
    finally:
        GraphedPasses.__call__ = call
    assert "differs from the eager pass" in caplog.text and "recording a pass as a CUDA graph failed" in caplog.text


def test_task_routes_through_bucket_padded_passes_answer_as_eager_ones(minilm_dir, tmp_path):
    """A GPU replica of a fine-tuned checkpoint replays its task routes' passes from CUDA graphs
    (``_task_graphed``); on the CPU ``record=False`` runs what a replay computes, eagerly, on the
    bucket's padded rows: /v1/classify (texts and pairs), /v1/rerank, /v1/tag and /v1/answer give
    the eager passes' answers, through (rows, length) buckets; the CPU itself never graphs."""
    import asyncio

    import numpy as np
    import torch

    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import TaskConfig, build_task_model
    from jobs.serving.replica import EmbeddingReplica
    from jobs.serving.serve_config import Limits, ModelConfig

    tasks = {
        "pair": ("bert", TaskConfig(kind="classification", num_labels=2, labels=["no", "yes"])),
        "ner": ("albert", TaskConfig(kind="token-classification", num_labels=3, labels=["O", "B-LOC", "I-LOC"])),
        "qa": ("bert", TaskConfig(kind="question-answering", num_labels=1)),
    }
    words = "the river bank was wet after the long rain fell on the quiet town of paris".split()
    texts = [" ".join(words[: 1 + (5 * i) % len(words)]) for i in range(13)]
    calls = {
        "pair": [("/v1/classify", {"texts": texts, "pairs": None, "truncate": False}),
                 ("/v1/classify", {"texts": texts[:5], "pairs": texts[5:10], "truncate": False}),
                 ("/v1/rerank", {"query": "where is the bank?", "texts": texts, "raw_scores": False, "return_text": False, "truncate": False})],
        "ner": [("/v1/tag", {"texts": texts, "words": None, "scheme": None, "truncate": False})],
        "qa": [("/v1/answer", {"questions": ["where is the bank?", "what fell?"], "contexts": [" ".join(words * 12), texts[4]], "truncate": False})],
    }

    def numbers(x):  # every float of an answer, in order, and the answer without them
        if isinstance(x, dict):
            pairs = [(k, numbers(v)) for k, v in sorted(x.items())]
            return {k: v[0] for k, v in pairs}, [f for _, v in pairs for f in v[1]]
        if isinstance(x, list):
            pairs = [numbers(v) for v in x]
            return [v[0] for v in pairs], [f for v in pairs for f in v[1]]
        return (None, [x]) if isinstance(x, float) else (x, [])

    for name, (family, task) in tasks.items():
        cfg = make_config(family, "tiny", {"vocab_size": 30522})  # MiniLM's vocabulary
        save_checkpoint(tmp_path / name, build_task_model(family, cfg, task, torch.Generator().manual_seed(1)), family, cfg,
                        tokenizer_dir=minilm_dir, task=task)
        replica = EmbeddingReplica(name, str(tmp_path / name), None, ModelConfig(uri=str(tmp_path / name), max_batch_size=4), Limits())
        assert replica._task_graphed is None  # the CPU: every pass eager

        async def answers():
            return [await replica.task(route, args) for route, args in calls[name]]

        eager = asyncio.run(answers())
        replica._task_graphed = replica._task_graphed_passes(record=False)
        graphed = asyncio.run(answers())
        for (route, _), want, got in zip(calls[name], eager, graphed):
            assert "error" not in got, got
            (want_shape, want_numbers), (got_shape, got_numbers) = numbers(want["body"]), numbers(got["body"])
            assert got_shape == want_shape, route
            np.testing.assert_allclose(got_numbers, want_numbers, atol=1e-5, err_msg=route)
        buckets = list(replica._task_graphed.buckets)
        assert len(buckets) >= 2 and {key[0] for key in buckets} <= {1, 2, 4}, (name, buckets)
        assert all(key[-1] % 32 == 0 for key in buckets)


def test_a_pass_is_read_off_the_device_only_once_the_next_is_queued_and_every_vector_is_its_own(minilm_dir, monkeypatch, tmp_path):
    """A replica copies each pass's output off the device without waiting (``jobs.serving.passes.HostCopy``)
    and reads it only after the next pass is queued, so on a GPU the host prepares and launches pass
    i + 1 while pass i runs. The order of launches and reads, for sentence vectors (``_pool``), token
    vectors (``_token_vectors``) and a task route's rows (``_rows_forward``); and each text's vectors
    are those of a pass over it alone, each row's logits those of the task model over it alone."""
    import numpy as np
    import torch

    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import make_config
    from ctxmodels.tasks import TaskConfig, build_task_model
    from jobs.serving import passes as passes_module
    from jobs.serving import replica as replica_module
    from jobs.serving.passes import HostCopy
    from jobs.serving.replica import EmbeddingReplica
    from jobs.serving.serve_config import Limits, ModelConfig

    log: list[tuple[str, int]] = []

    class Logged(HostCopy):
        def __init__(self, tensor):
            super().__init__(tensor)
            self.index = sum(1 for what, _ in log if what == "launch") - 1  # the pass it copies

        def numpy(self):
            log.append(("read", self.index))
            return super().numpy()

    monkeypatch.setattr(replica_module, "HostCopy", Logged)
    monkeypatch.setattr(passes_module, "HostCopy", Logged)  # what the task routes import
    replica = EmbeddingReplica("m", str(minilm_dir), None, ModelConfig(uri=str(minilm_dir), max_batch_size=4), Limits())
    passes = replica._passes

    def logged(rows, last_only=False, languages=None, max_rows=None):
        for i, one in enumerate(passes(rows, last_only, languages, max_rows)):
            log.append(("launch", i))
            yield one

    monkeypatch.setattr(replica, "_passes", logged)
    words = "the river bank was wet after the long rain fell on the quiet town".split()
    rows = replica._encode_ids([" ".join(words[: 1 + (5 * i) % len(words)]) for i in range(11)], truncate=True)
    with torch.inference_mode():
        alone = [replica.backbone.hidden_states(torch.from_numpy(r)[None])[-1][0].numpy() for r in rows]  # (T_i, D)
    for run in ("sentence", "token"):
        log.clear()
        if run == "sentence":
            vectors, sizes = replica._pool([(r, None, "last", 0) for r in rows])
            want = [a.mean(axis=0) for a in alone]
        else:
            vectors, sizes = replica._token_vectors(rows, [replica.n_hidden - 1], None)
            want = alone
        n = len(sizes)
        assert n == 3  # 11 rows, at most 4 a pass
        assert log == [("launch", 0)] + [x for i in range(1, n) for x in (("launch", i), ("read", i - 1))] + [("read", n - 1)], run
        for got, expected in zip(vectors, want):
            np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=run)

    task = TaskConfig(kind="classification", num_labels=2, labels=["no", "yes"])
    cfg = make_config("bert", "tiny", {"vocab_size": 30522})  # MiniLM's vocabulary
    model = build_task_model("bert", cfg, task, torch.Generator().manual_seed(1)).eval()
    save_checkpoint(tmp_path / "pair", model, "bert", cfg, tokenizer_dir=minilm_dir, task=task)
    tasks = EmbeddingReplica("pair", str(tmp_path / "pair"), None, ModelConfig(uri=str(tmp_path / "pair"), max_batch_size=4), Limits())
    group_forward = tasks._group_forward

    def logged_group(group_rows, width):
        log.append(("launch", sum(1 for what, _ in log if what == "launch")))
        return group_forward(group_rows, width)

    monkeypatch.setattr(tasks, "_group_forward", logged_group)
    task_rows = [{"input_ids": np.pad(r, (0, 128 - len(r))), "attention_mask": np.pad(np.ones_like(r), (0, 128 - len(r))),
                  "token_type_ids": np.zeros(128, dtype=np.int64)} for r in rows]  # right-padded to the fine-tuning width
    log.clear()
    results = tasks._rows_forward(task_rows)
    n = sum(1 for _, size in results if size is not None)
    assert n == 3 and log == [("launch", 0)] + [x for i in range(1, n) for x in (("launch", i), ("read", i - 1))] + [("read", n - 1)]
    with torch.inference_mode():
        for (logits, _), r in zip(results, rows):
            np.testing.assert_allclose(logits, model(torch.from_numpy(r)[None]).logits[0].numpy(), atol=1e-5)


def test_a_served_xlm_reads_its_texts_as_the_language_its_settings_name(minilm_dir, tmp_path):
    """ModelSettings.language: an XLM of two languages served as "xx" gives the vectors of its
    texts read with language id 1, by name (the checkpoint's data.languages) or by row; unset, the
    first language's; a language the model lacks, or one given to a model without a language table,
    fails the replica's start naming it."""
    import numpy as np
    import torch

    import json

    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model
    from jobs.serving.replica import EmbeddingReplica
    from jobs.serving.serve_config import InputError, Limits, ModelConfig
    from pipelines.tokenizers import load_tokenizer

    cfg, model = build_model("xlm", "tiny", {"vocab_size": 30522, "type_vocab_size": 2}, seed=0)  # MiniLM's vocabulary
    with torch.no_grad():
        model.backbone.embeddings.token_type.weight.normal_(0, 1.0)  # rows far apart: a wrong row shows
    state = {"trainer_state": {"step": 1, "recipe": {"data": {"languages": ["en", "xx"]}}}}
    ckpt = save_checkpoint(tmp_path / "xlm", model, "xlm", cfg, tokenizer_dir=minilm_dir, extra_json=state)
    texts = ["the river bank", "a cheque deposited at the bank yesterday"]
    tok = load_tokenizer(minilm_dir)

    def expected(language: int) -> np.ndarray:
        out = []
        for ids in tok.encode_batch(texts):
            x = torch.as_tensor([tok.cls_id, *ids, tok.sep_id])[None]  # as the replica encodes a text
            with torch.no_grad():
                h = model.eval().backbone.hidden_states(x, torch.ones_like(x), torch.full_like(x, language))[-1]
            out.append(h.mean(1)[0].numpy())
        return np.stack(out)

    def served(language) -> tuple[np.ndarray, EmbeddingReplica]:
        replica = EmbeddingReplica("m", str(ckpt), None, ModelConfig(uri=str(ckpt), language=language), Limits())
        return np.stack(replica.embed_now(texts)["embeddings"]), replica

    for language, row, shown in ((None, 0, "en"), ("xx", 1, "xx"), (1, 1, "xx"), ("en", 0, "en")):
        got, replica = served(language)
        np.testing.assert_allclose(got, expected(row), atol=1e-5, err_msg=str(language))
        assert replica.info()["language"] == shown and replica.info()["languages"] == ["en", "xx"]
        # a request may name another language (/v1/embeddings' "language"), the deployment's own swapped aside
        for asked, asked_row in (("en", 0), ("xx", 1), (0, 0), (1, 1)):
            np.testing.assert_allclose(np.stack(replica.embed_now(texts, language=asked)["embeddings"]), expected(asked_row),
                                       atol=1e-5, err_msg=f"{language} then {asked}")
        # one forward pass of rows in both languages gives each row its own language's vector
        ids = replica._encode_ids(texts, truncate=False)
        rows = [replica.language.table_row(r) for r in (1, 0)]
        vectors, sizes = replica._pool([(ids[0], None, "last", rows[0]), (ids[1], None, "last", rows[1])])
        assert len(sizes) == 1  # one pass
        np.testing.assert_allclose(np.stack(vectors), np.stack([expected(1)[0], expected(0)[1]]), atol=1e-5)
    with pytest.raises(InputError, match=r"language 'fr' is not one of the model's"):
        replica.embed_now(texts, language="fr")
    assert np.abs(expected(0) - expected(1)).max() > 0.1  # the two languages' vectors differ
    # /v1/token-embeddings takes a request's language too: each token's last state read as "xx"
    import asyncio

    for asked, asked_row in (("xx", 1), (None, 0)):
        answer = asyncio.run(replica.token_embeddings(texts, "last", False, None, "token", asked))
        for text, row in zip(texts, answer["rows"]):
            x = torch.as_tensor([tok.cls_id, *tok.encode_batch([text])[0], tok.sep_id])[None]
            with torch.no_grad():
                h = model.backbone.hidden_states(x, torch.ones_like(x), torch.full_like(x, asked_row))[-1][0]
            np.testing.assert_allclose(np.asarray(row["embeddings"]), h.numpy(), atol=1e-5, err_msg=str(asked))
    assert "refused" in asyncio.run(replica.token_embeddings(texts, "last", False, None, "token", "fr"))
    # /v1/fill-mask too: the masked word's scores read as the request's language, rows of two languages in one pass
    masked = "the river [MASK] was steep"
    x = torch.as_tensor([tok.cls_id, *tok.encode_batch([masked])[0], tok.sep_id])[None]
    at = int((x[0] == tok.mask_id).nonzero()[0, 0])

    async def fill(*languages):
        return await asyncio.gather(*(replica.task("/v1/fill-mask", {"texts": [masked], "top_k": 3, "truncate": False, "language": lang})
                                      for lang in languages))

    for (asked, asked_row), answer in zip((("xx", 1), (None, 0)), asyncio.run(fill("xx", None))):
        with torch.no_grad():
            probs = torch.softmax(model.mlm_logits(x, torch.ones_like(x), torch.full_like(x, asked_row))[0, at], -1)
        top = answer["body"]["data"][0]["masks"][0]["predictions"]
        assert [p["token_id"] for p in top] == probs.argsort(descending=True)[:3].tolist(), asked
        np.testing.assert_allclose([p["score"] for p in top], probs.sort(descending=True).values[:3].numpy(), atol=1e-5)
    # ctx embed (its local engine: no Ray) with --language gives the same vectors
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jobs.serving.embed import reembed

    pq.write_table(pa.table({"id": [7, 8], "text": texts}), tmp_path / "texts.parquet")
    reembed(str(ckpt), str(tmp_path / "texts.parquet"), str(tmp_path / "out"), engine="local", language="xx")
    rows = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "out").glob("*.parquet"))]).sort_by("id").to_pydict()
    np.testing.assert_allclose(np.array(rows["embedding"]), expected(1), atol=1e-5)
    # the exported HF folder names its rows in lang2id, which a replica reads the same names from
    from ctxmodels.hf import export_hf_folder

    hf = export_hf_folder(model, "xlm", tmp_path / "hf", minilm_dir, languages=["en", "xx"])
    assert json.loads((hf / "config.json").read_text())["lang2id"] == {"en": 0, "xx": 1}
    from jobs.cli import main

    assert main(["export", "--model", str(ckpt), "--format", "hf", "--output", str(tmp_path / "exported")]) == 0
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["id2lang"] == {"0": "en", "1": "xx"}  # the run's names
    replica = EmbeddingReplica("m", str(hf), None, ModelConfig(uri=str(hf), language="xx"), Limits())
    np.testing.assert_allclose(np.stack(replica.embed_now(texts)["embeddings"]), expected(1), atol=1e-5)
    with pytest.raises(InputError, match=r"language 'fr' is not one of the model's; its languages are \['en', 'xx'\]"):
        served("fr")
    with pytest.raises(InputError, match=r"language 2 is not a row of its language table \(0..1\)"):
        served(2)
    with pytest.raises(InputError, match="the model has no language embeddings"):
        EmbeddingReplica("m", str(minilm_dir), None, ModelConfig(uri=str(minilm_dir), language="en"), Limits())
    minilm = EmbeddingReplica("m", str(minilm_dir), None, ModelConfig(uri=str(minilm_dir)), Limits())
    with pytest.raises(InputError, match="language 'en': model 'm' has no language embeddings"):
        minilm.embed_now(texts, language="en")
