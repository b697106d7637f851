"""XLM's language sampling (pipelines.languages) and language-tagged packed rows (pipelines.dataset).

There is no second language in data/: the tests write one, the sample corpus with every word
spelt backwards, a quarter of its size. Its rows must carry language id 1, and the epoch's kept
rows must follow q_i ~ p_i^alpha."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from pipelines.dataset import PARALLEL_SHARD, StreamSpec, local_batches, pack_shard, shard_keys
from pipelines.languages import keep_fractions, kept_rows, sampling_probs, tlm_rows, translation_lengths
from pipelines.masking import MlmConfig
from pipelines.sources import sample_text
from pipelines.tokenizers import train_tokenizer

REPO = Path(__file__).resolve().parents[2]
ENGLISH = str(REPO / "data" / "sample" / "wordnet-0000-of-0008.txt.gz")


def test_sampling_probs_are_xlm_formula():
    n = np.array([900.0, 90.0, 10.0])
    p = n / n.sum()
    np.testing.assert_allclose(sampling_probs(n, 1.0), p)
    q = sampling_probs(n, 0.5)
    np.testing.assert_allclose(q, np.sqrt(p) / np.sqrt(p).sum())
    assert q[2] > p[2] and q[0] < p[0]  # small languages up, large ones down
    np.testing.assert_allclose(sampling_probs(n, 1e-9), np.full(3, 1 / 3), atol=1e-6)  # alpha -> 0: uniform
    for bad in ([], [1.0, 0.0], [[1.0, 2.0]]):
        with pytest.raises(ValueError, match="positive numbers"):
            sampling_probs(bad, 0.5)
    with pytest.raises(ValueError, match="alpha"):
        sampling_probs([1.0, 2.0], 1.5)


def test_kept_rows_give_each_language_its_share():
    """Keep fractions applied to the rows of each language: the kept proportions are q (to 1%),
    the smallest language keeps all of its rows, and each epoch keeps other rows."""
    sizes = np.array([60_000, 12_000, 3_000])
    keep = keep_fractions(sizes, 0.5)
    assert keep[2] == 1.0 and np.all(keep[:2] < 1)
    kept = np.array([kept_rows(7, 0, np.arange(n, dtype=np.int64) + (i << 32), keep[i]).sum() for i, n in enumerate(sizes)])
    np.testing.assert_allclose(kept / kept.sum(), sampling_probs(sizes, 0.5), atol=0.01)
    ids = np.arange(60_000, dtype=np.int64)
    a, b = kept_rows(7, 0, ids, keep[0]), kept_rows(7, 1, ids, keep[0])
    np.testing.assert_array_equal(a, kept_rows(7, 0, ids, keep[0]))  # keyed: the same again
    assert (a != b).mean() > 0.2  # another epoch, other rows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(english shard, "backwards" shard, tokenizer over both)."""
    root = tmp_path_factory.mktemp("langs")
    with gzip.open(ENGLISH, "rt") as f:
        lines = f.read().split("\n")
    quarter = lines[: len(lines) // 4]
    backwards = root / "xx" / "backwards-0000.txt.gz"
    backwards.parent.mkdir()
    with gzip.open(backwards, "wt") as f:
        f.write("\n".join(" ".join(w[::-1] for w in line.split(" ")) for line in quarter).strip("\n") + "\n")
    tok = train_tokenizer("wordpiece", sample_text([ENGLISH, str(backwards)], 600_000), 3000)
    return ENGLISH, str(backwards), tok


def test_packed_rows_carry_their_language_and_keep_their_ids(corpus):
    english, backwards, tok = corpus
    shards = (english, backwards)
    plain = StreamSpec(shards=shards, seq_len=64)
    tagged = StreamSpec(shards=shards, seq_len=64, seed=3, shard_languages=(0, 1), language_keep=(0.5, 1.0))
    for uri, key, lang, share in zip(shards, shard_keys(shards), (0, 1), (0.5, 1.0)):
        every = {k: np.concatenate([b[k] for b in pack_shard(tok, uri, key, 0, plain)]) for k in ("sample_id", "input_ids")}
        rows = {k: np.concatenate([b[k] for b in pack_shard(tok, uri, key, 0, tagged)]) for k in ("sample_id", "input_ids", "token_type_ids")}
        assert np.all(rows["token_type_ids"] == lang)
        where = np.searchsorted(every["sample_id"], rows["sample_id"])  # kept rows keep their ids and tokens
        np.testing.assert_array_equal(every["sample_id"][where], rows["sample_id"])
        np.testing.assert_array_equal(every["input_ids"][where], rows["input_ids"])
        assert abs(len(rows["sample_id"]) / len(every["sample_id"]) - share) < 0.05
        np.testing.assert_array_equal(rows["sample_id"], every["sample_id"][kept_rows(3, 0, every["sample_id"], share)])


def test_masked_batches_keep_the_language_ids(corpus):
    english, backwards, tok = corpus
    spec = StreamSpec(shards=(backwards, english), seq_len=64, shard_languages=(1, 0), language_keep=(1.0, 0.3),
                      mlm=MlmConfig(mlm_probability=0.15), shuffle_files=False)
    seen = set()
    for b in local_batches(spec, tok, batch_size=32, epoch=0, max_batches=200):
        assert "token_type_ids" in b and (b["labels"] != -100).any()
        shard = b["sample_id"] >> 32
        for key, lang in zip(shard_keys(spec.shards), (1, 0)):
            rows = shard == key
            assert np.all(b["token_type_ids"][rows] == lang)
            if rows.any():
                seen.add(lang)
    assert seen == {0, 1}


def test_causal_lm_batches_keep_the_language_ids_only_with_languages(corpus):
    """XLM's CLM (objective clm with data.languages): next-token rows keep their language as
    token_type_ids; GPT's rows (no languages) carry none, as GPT's forward takes none."""
    english, backwards, tok = corpus
    shards = (backwards, english)
    spec = StreamSpec(shards=shards, seq_len=64, objective="clm", shard_languages=(1, 0), shuffle_files=False)
    seen = set()
    for b in local_batches(spec, tok, batch_size=32, epoch=0, max_batches=100):
        np.testing.assert_array_equal(b["labels"], np.where(b["attention_mask"] == 1, b["input_ids"], -100))  # unshifted
        assert not np.isin(b["input_ids"], [tok.mask_id]).any()
        for key, lang in zip(shard_keys(shards), (1, 0)):
            rows = (b["sample_id"] >> 32) == key
            assert np.all(b["token_type_ids"][rows] == lang)
            seen |= {lang} if rows.any() else set()
    assert seen == {0, 1}
    gpt = StreamSpec(shards=shards, seq_len=64, objective="clm")
    assert "token_type_ids" not in next(iter(local_batches(gpt, tok, batch_size=32, epoch=0, max_batches=1)))


# ---------------------------------------------------------------------------------------------
# Translation LM rows


def test_translation_lengths_cut_the_longest_first():
    rng = np.random.default_rng(0)
    la, lb = rng.integers(0, 80, 2000), rng.integers(0, 80, 2000)
    a, b = translation_lengths(la, lb, 60)
    assert np.all(a + b <= 60) and np.all(a <= la) and np.all(b <= lb)
    fits = la + lb <= 60
    np.testing.assert_array_equal(a[fits], la[fits])
    np.testing.assert_array_equal(b[fits], lb[fits])
    over = ~fits
    assert np.all(a[over] + b[over] == 60)  # nothing wasted
    short = over & (np.minimum(la, lb) <= 30)  # the shorter one is whole, the longer takes the rest
    assert np.all(np.minimum(a, b)[short] == np.minimum(la, lb)[short])
    both = over & (np.minimum(la, lb) > 30)
    assert np.all((a[both] == 30) & (b[both] == 30))


def test_tlm_rows_restart_positions_and_carry_both_languages():
    g = np.random.default_rng(1)
    pairs = [(0, g.integers(10, 99, int(n)), 2, g.integers(100, 199, int(m))) for n, m in g.integers(1, 40, (400, 2))]
    rows = tlm_rows(pairs, 48, seed=5, epoch=0, sample_ids=np.arange(400), cls_id=2, sep_id=3, pad_id=0)
    again = tlm_rows(pairs, 48, seed=5, epoch=0, sample_ids=np.arange(400), cls_id=2, sep_id=3, pad_id=0)
    for k in rows:
        np.testing.assert_array_equal(rows[k], again[k])  # keyed: the same rows again
    ids, langs, pos, mask = rows["input_ids"], rows["token_type_ids"], rows["position_ids"], rows["attention_mask"]
    swapped = langs[:, 0] == 2
    assert 0.4 < swapped.mean() < 0.6  # both directions, about equally
    for k in range(400):
        n = int(mask[k].sum())
        starts = np.flatnonzero(pos[k, :n] == 0)  # each half starts at position 0 with [CLS]
        assert len(starts) == 2 and starts[0] == 0 and np.all(ids[k, starts] == 2)
        second = starts[1]
        assert ids[k, second - 1] == 3 and ids[k, n - 1] == 3  # each half ends with [SEP]
        np.testing.assert_array_equal(pos[k, :second], np.arange(second))
        np.testing.assert_array_equal(pos[k, second:n], np.arange(n - second))
        first_lang, other = (2, 0) if swapped[k] else (0, 2)
        assert np.all(langs[k, :second] == first_lang) and np.all(langs[k, second:n] == other)
        lang_of_token = np.where(ids[k, 1 : second - 1] >= 100, 2, 0)  # the generator's id ranges
        assert np.all(lang_of_token == first_lang)
        assert np.all(ids[k, n:] == 0) and np.all(pos[k, n:] == 0)


def test_translation_records_are_read_and_bad_ones_counted(tmp_path):
    from pipelines.sources import CorpusError, ReadStats, iter_translations

    lines = [
        {"en": "the bank", "fr": "la banque"},
        {"fr": "le chat", "en": "the cat", "id": 7},  # order as given; other keys are fine
        {"en": "only one"},
        {"en": "x", "fr": "y", "de": "z"},
        {"en": "  ", "fr": "vide"},
        {"en": 3, "fr": "trois"},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\nnot json\n")
    stats = ReadStats()
    pairs = [p for chunk in iter_translations(str(path), ("en", "fr", "de"), stats=stats) for p in chunk]
    assert pairs == [(0, "the bank", 1, "la banque"), (1, "le chat", 0, "the cat")]
    assert stats.to_dict()["used"] == 2 and stats.to_dict()["rejected"] == 5
    with pytest.raises(CorpusError, match=r"p.jsonl:3: record names 1 of data.languages"):
        list(iter_translations(str(path), ("en", "fr"), strict=True))
    # what a tokenizer trains on: both sentences of every good pair
    assert list(sample_text([str(path)], 10_000, translations=("en", "fr", "de"))) == ["the bank\nla banque", "le chat\nthe cat"]


def test_language_sizes_and_translations_read_from_a_bucket(s3_server, s3_bucket):
    """What a multilingual run reads from object storage: each shard's stored bytes (the p of
    alpha sampling) and parallel records through s3:// URIs, gzip included."""
    import boto3

    from pipelines.sources import iter_translations
    from pipelines.storage import Store

    s3 = boto3.client("s3", endpoint_url=s3_server)
    records = [{"en": f"sentence {i}", "fr": f"phrase {i}"} for i in range(300)]
    bodies = {"en/a.txt": b"one\ntwo\n", "fr/b.txt": b"un\n" * 50,
              "pairs/p.jsonl.gz": gzip.compress("\n".join(json.dumps(r) for r in records).encode())}
    for key, body in bodies.items():
        s3.put_object(Bucket=s3_bucket, Key=key, Body=body)
    store = Store(s3_server)
    uris = [f"s3://{s3_bucket}/{key}" for key in bodies]
    assert store.file_sizes(uris) == [len(b) for b in bodies.values()]
    pairs = [p for chunk in iter_translations(uris[2], ("en", "fr"), chunk_pairs=64, store=store) for p in chunk]
    assert pairs == [(0, r["en"], 1, r["fr"]) for r in records]


# ---------------------------------------------------------------------------------------------
# MLM + TLM: the languages' packed rows and the parallel shards' translation rows in one stream


def test_mlm_and_tlm_rows_share_one_stream_with_their_own_languages_and_positions(corpus, tmp_path):
    """XLM's MLM + TLM (``PARALLEL_SHARD``): every batch has the same columns; packed rows keep
    one language and positions 0..n-1, translation rows their two languages with positions restarting
    at the second [CLS]; only the languages' rows are sampled; no sample id comes twice."""

    english, backwards, tok = corpus
    with gzip.open(english, "rt") as f:
        lines = [x for x in f.read().split("\n") if x.strip()][:400]
    pairs = tmp_path / "pairs" / "en-xx.jsonl"
    pairs.parent.mkdir()
    pairs.write_text("\n".join(json.dumps({"en": x, "xx": " ".join(w[::-1] for w in x.split(" "))}) for x in lines) + "\n")
    shards = (str(pairs), english, backwards)  # in this order (the last shard's rows past the last whole batch are left)
    spec = StreamSpec(shards=shards, seq_len=64, seed=5, shard_languages=(PARALLEL_SHARD, 0, 1), language_keep=(0.5, 1.0),
                      language_names=("en", "xx"), mlm=MlmConfig(mlm_probability=0.15), shuffle_files=False)
    keys = dict(zip(shard_keys(shards), ("pairs", "en", "xx")))
    ids, columns = [], set()
    for b in local_batches(spec, tok, batch_size=64, epoch=0):
        columns.add(tuple(sorted(b)))
        ids.append(b["sample_id"])
        real = b["attention_mask"].astype(bool)
        for k, key in enumerate(b["sample_id"] >> 32):
            n, pos, langs = int(real[k].sum()), b["position_ids"][k], b["token_type_ids"][k]
            if keys[int(key)] == "pairs":
                second = int(np.flatnonzero(pos[:n] == 0)[1])  # the second half starts at position 0 again
                np.testing.assert_array_equal(pos[:n], np.r_[np.arange(second), np.arange(n - second)])
                assert set(langs[:second]) | set(langs[second:n]) == {0, 1} and len(set(langs[:second])) == 1
            else:
                np.testing.assert_array_equal(pos[:n], np.arange(n))
                assert np.all(langs[:n] == {"en": 0, "xx": 1}[keys[int(key)]])
    assert len(columns) == 1 and "position_ids" in columns.pop()
    ids = np.concatenate(ids)
    assert len(np.unique(ids)) == len(ids)
    per = {name: int(np.sum((ids >> 32) == key)) for key, name in keys.items()}
    assert per["pairs"] == len(lines)  # every pair kept
    every_en = sum(len(b["sample_id"]) for b in pack_shard(tok, english, shard_keys(shards)[1], 0, StreamSpec(shards=shards, seq_len=64)))
    assert abs(per["en"] / every_en - 0.5) < 0.05 and per["xx"] > 0  # the languages' rows sampled as before


def test_tokenizer_sample_reads_text_shards_and_parallel_shards_each_their_own_way(tmp_path):
    text = tmp_path / "en.txt"
    text.write_text("a plain line\n")
    pairs = tmp_path / "p.jsonl"
    pairs.write_text(json.dumps({"en": "the bank", "fr": "la banque"}) + "\n")
    got = list(sample_text([str(text), str(pairs)], 10_000, translations=("en", "fr"), parallel={str(pairs)}))
    assert got == ["a plain line", "the bank\nla banque"]
