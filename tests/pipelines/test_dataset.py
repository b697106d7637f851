"""The Ray Data stream gives exactly the samples and masks of the pure NumPy path."""

from pathlib import Path

import numpy as np
import pytest

from pipelines.dataset import StreamSpec, build_dataset, local_batches, pack_shard, shard_keys, work_units
from pipelines.sources import iter_documents
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


def test_pack_shard_keeps_sentences_whole(tok_dir):
    """RoBERTa FULL-SENTENCES on a real shard: rows end at sentence (line) ends, [SEP] between
    documents, every token once, sample ids = shard key << 32 | row index, the same every time."""
    from pipelines.tokenizers import load_tokenizer

    tok = load_tokenizer(tok_dir)
    spec = StreamSpec(shards=SHARDS, seq_len=128)
    key = shard_keys(SHARDS)[0]
    runs = [list(pack_shard(tok, SHARDS[0], key, 0, spec)) for _ in range(2)]
    rows = {k: np.concatenate([b[k] for b in runs[0]]) for k in runs[0][0]}
    for k in rows:
        np.testing.assert_array_equal(np.concatenate([b[k] for b in runs[1]]), rows[k])
    np.testing.assert_array_equal(rows["sample_id"], (key << 32) | np.arange(len(rows["sample_id"])))
    docs = [d for chunk in iter_documents(SHARDS[0]) for d in chunk]
    sentences = [tok.encode_batch(d.split("\n")) for d in docs]
    assert max(s.size for d in sentences for s in d) <= 126  # so no sentence may be cut
    expected, ends = [], set()  # the token stream with separators; where sentences end in it
    for d, sents in enumerate(sentences):
        for s in sents:
            expected.extend(([tok.sep_id] if d and s is sents[0] else []) + s.tolist())
            ends.add(len(expected))
    body, at = [], 0
    for ids, mask in zip(rows["input_ids"], rows["attention_mask"]):
        n = int(mask.sum())
        assert ids[0] == tok.cls_id and ids[n - 1] == tok.sep_id and (ids[n:] == tok.pad_id).all()
        piece = ids[1 : n - 1].tolist()
        if expected[at] == tok.sep_id:
            at += 1  # a row that starts a document drops the separator
        assert piece == expected[at : at + len(piece)]
        at += len(piece)
        assert at in ends  # the row ends where a sentence ends
    assert at == len(expected)


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


@pytest.fixture(scope="module")
def gpt2_tok_dir(tmp_path_factory):
    """A GPT-2 style tokenizer folder: byte-level BPE whose only special token is <|endoftext|>
    (a tokenizer.json as transformers' GPT2TokenizerFast writes one), trained here."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(list(sample_text(list(SHARDS[:1]), 200_000)), trainer)
    d = tmp_path_factory.mktemp("gpt2tok")
    hf.save(str(d / "tokenizer.json"))
    return d


def test_a_gpt2_tokenizer_packs_causal_rows_with_end_of_text_between_documents(gpt2_tok_dir):
    """GPT-2's tokenizer has no [CLS]/[SEP]/[PAD]: its <|endoftext|> opens each row, separates
    documents and pads, as GPT-2 was trained; every token of the shard still comes once, in order.
    An objective that writes [MASK] is refused, naming the objective."""
    from pipelines.dataset import vocab_info
    from pipelines.tokenizers import MissingSpecialToken, load_tokenizer

    tok = load_tokenizer(gpt2_tok_dir)
    eot = tok.special_id("eos")
    assert eot is not None and tok.special_id("cls") is None and tok.special_id("pad") is None
    vocab = vocab_info(tok, "clm")
    assert (vocab.cls_id, vocab.sep_id, vocab.pad_id, vocab.mask_id) == (eot, eot, eot, eot)
    with pytest.raises(MissingSpecialToken, match=r"no mask token.*data\.objective 'mlm' writes it"):
        vocab_info(tok, "mlm")

    spec = StreamSpec(shards=SHARDS, seq_len=128, objective="clm")
    key = shard_keys(SHARDS)[0]
    rows = list(pack_shard(tok, SHARDS[0], key, 0, spec))
    ids = np.concatenate([b["input_ids"] for b in rows])  # (N, 128)
    mask = np.concatenate([b["attention_mask"] for b in rows])
    docs = [d for chunk in iter_documents(SHARDS[0]) for d in chunk]
    sentences = [tok.encode_batch(d.split("\n")) for d in docs]
    assert max(s.size for d in sentences for s in d) <= 126  # so no sentence may be cut
    expected = [t for d, sents in enumerate(sentences) for s in sents for t in ([eot] if d and s is sents[0] else []) + s.tolist()]
    at = 0
    for row, m in zip(ids, mask):
        n = int(m.sum())
        assert row[0] == eot and row[n - 1] == eot and (row[n:] == eot).all()
        piece = row[1 : n - 1].tolist()
        if expected[at] == eot:
            at += 1  # a row that starts a document drops the separator
        assert piece == expected[at : at + len(piece)]
        at += len(piece)
    assert at == len(expected)  # every token once, in order, <|endoftext|> between documents
    first = next(local_batches(spec, tok, batch_size=4, epoch=0, max_batches=1))
    real = first["attention_mask"] == 1  # unshifted causal targets: the rows themselves, padding ignored
    np.testing.assert_array_equal(first["labels"], np.where(real, first["input_ids"], -100))


def test_tokenizer_files_of_a_model_folder_are_the_tokenizers_only(minilm_dir, tmp_path):
    """An HF model folder is its own tokenizer folder: its weights (88 MB for MiniLM) must not ride
    along to every tokenizer actor and training worker; the files that do load the same tokenizer,
    and are the ones a checkpoint keeps of it (ctxmodels.hf.tokenizer_files)."""
    from ctxmodels.hf import tokenizer_files as checkpoint_tokenizer_files
    from pipelines.dataset import tokenizer_files, tokenizer_from_files
    from pipelines.tokenizers import load_tokenizer

    files = tokenizer_files(minilm_dir)
    assert {"tokenizer.json", "vocab.txt", "tokenizer_config.json"} <= files.keys()
    assert not {"model.safetensors", "config.json"} & files.keys() and sum(map(len, files.values())) < 2_000_000
    assert sorted(files) == [p.name for p in checkpoint_tokenizer_files(minilm_dir)]
    text = ["Tokenizers split naïve words: 東京, 🙂 and unaffable ones."]
    got, want = tokenizer_from_files(files).encode_batch(text), load_tokenizer(minilm_dir).encode_batch(text)
    assert [ids.tolist() for ids in got] == [ids.tolist() for ids in want] and len(want[0]) > 10

    checkpoint = tmp_path / "checkpoint"  # a checkpoint folder: its tokenizer/, not its weights
    (checkpoint / "tokenizer").mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    for name, data in files.items():
        (checkpoint / "tokenizer" / name).write_bytes(data)
    assert tokenizer_files(checkpoint) == files
