"""Every family learns a shipped downstream task: a tiny model of each family, from fresh weights,
fine-tuned on the gloss -> lexicographer-file task (data/tasks/lexname, 20 classes) with the head
of its paper (ctxmodels.tasks) and the rows ``ctx finetune`` builds (``pipelines.finetune.encode_task``
under the family's input style), beats the majority class on held-out glosses.

In-process (no Ray): what is under test is the task model and its data, not the distributed loop
(tests/jobs/training/test_finetune.py runs that)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from ctxmodels.registry import FAMILIES, make_config
from ctxmodels.tasks import TaskConfig, build_task_model
from jobs.training.finetune import elmo_char_table
from jobs.training.finetune_config import INPUT_STYLES
from pipelines.finetune import TaskDataConfig, encode_task
from pipelines.tokenizers import train_tokenizer

REPO = Path(__file__).resolve().parents[3]
TASK = REPO / "data" / "tasks" / "lexname"
N_TRAIN, N_VAL, STEPS, BATCH = 10**6, 10**6, 300, 32  # whole splits (train is grouped by label)
LR = {"albert": 1e-3}  # else 2e-3; ALBERT's one shared layer, updated n_layer times a step, wants a smaller one


def read(split: str, n: int) -> dict[str, list]:
    rows = [json.loads(x) for x in (TASK / f"{split}.jsonl").read_text().splitlines()[:n]]
    return {k: [r[k] for r in rows] for k in rows[0]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    train, val = read("train", N_TRAIN), read("validation", N_VAL)
    tok = train_tokenizer("wordpiece", train["sentence1"], 2000)
    tok_dir = tmp_path_factory.mktemp("tok")
    tok.save(tok_dir)
    labels = tuple(sorted(set(train["label"])))
    majority = Counter(train["label"]).most_common(1)[0][0]
    baseline = float(np.mean([y == majority for y in val["label"]]))
    return tok, tok_dir, labels, train, val, baseline


def rows(records, tok, labels, family) -> dict[str, torch.Tensor]:
    cfg = TaskDataConfig(kind="classification", max_len=48, input_style=INPUT_STYLES.get(family, "bert"), labels=labels,
                         text_field="sentence1")
    enc = encode_task(records, tok, cfg)
    keep = ("input_ids", "attention_mask", "token_type_ids", "labels")
    return {k: torch.as_tensor(np.asarray(v)) for k, v in enc.items() if k in keep}


@pytest.mark.parametrize("family", [pytest.param(f, marks=[] if f == "bert" else [pytest.mark.extended]) for f in sorted(FAMILIES)])
@pytest.mark.slow  # ~2-4 min for the 8 families on 2 cores (ELMo's BiLSTM the most)
def test_each_family_beats_the_majority_class_on_held_out_glosses(family, data):
    tok, tok_dir, labels, train, val, baseline = data
    cfg = make_config(family, "tiny", {"vocab_size": tok.vocab_size})
    model = build_task_model(family, cfg, TaskConfig(kind="classification", num_labels=len(labels), labels=list(labels),
                                                     input_style=INPUT_STYLES.get(family, "bert")),
                             torch.Generator().manual_seed(0))
    if family == "elmo":
        model.set_char_table(torch.as_tensor(elmo_char_table(tok_dir, cfg.max_chars)))
    tr, va = rows(train, tok, labels, family), rows(val, tok, labels, family)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR.get(family, 2e-3), weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    model.train()
    with torch.random.fork_rng(devices=[]):  # dropout draws from the global generator: seed it, leave it as it was
        torch.manual_seed(2)
        for _ in range(STEPS):
            idx = torch.randint(0, len(tr["labels"]), (BATCH,), generator=g)
            loss = model(**{k: v[idx] for k, v in tr.items()}).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(**{k: v[i : i + 100] for k, v in va.items() if k != "labels"}).logits.argmax(-1)
                          for i in range(0, len(va["labels"]), 100)])
    accuracy = float((pred == va["labels"]).float().mean())
    print(f"{family}: accuracy {accuracy:.3f}, majority class {baseline:.3f}")
    assert accuracy > baseline + 0.03, f"{family}: accuracy {accuracy:.3f}, majority class {baseline:.3f}"
