"""Shared checks of the exactly-once tests (``test_exactly_once.py``, ``test_elastic_cluster.py``).

Every worker writes the samples it trained on (``train.sample_log``). A sample counts as consumed
when its optimizer step was committed: an attempt's lines up to the step the next attempt resumed
from (steps after that were rolled back with the model). Over a whole epoch every sample of the
corpus must then be consumed exactly once, with the tokens and mask the pure NumPy pipeline gives
it (``local_batches``): none lost, none repeated, whatever failed or changed in between.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from jobs.training.config import load_recipe
from jobs.training.loop import row_digests
from jobs.training.train import stream_spec
from pipelines.dataset import local_batches
from pipelines.tokenizers import load_tokenizer

REPO = Path(__file__).resolve().parents[3]


def write_corpus(root: Path) -> Path:
    """Four small text shards (~520 samples of 32 tokens per epoch: about 65 steps of 8; whole
    sentences per block, so a block holds two or three of these one-line documents)."""
    lines = [x.strip() for x in gzip.open(REPO / "data/sample/wordnet-0000-of-0008.txt.gz", "rt") if x.strip()]
    for i in range(4):
        (root / f"part-{i}.txt").write_text("\n\n".join(lines[i * 160 : (i + 1) * 160]) + "\n")
    return root


RECIPE = REPO / "configs" / "bert-tiny.yaml"


def overrides(corpus: Path, out: Path, *extra: str) -> list[str]:
    """The ``--set`` overrides of the tests' tiny runs of ``RECIPE`` (later ones win)."""
    return [
        f"data.input={corpus}", f"output_dir={out}", "name=once", "data.eval_input=null",
        "tokenizer.vocab_size=1000", "data.seq_len=32", "model.max_seq_len=32", "data.max_epochs=2",
        "train.batch_size=8", "train.micro_batch_size=4", "train.warmup_steps=5", "train.log_every=5",
        "train.checkpoint_every=10", "train.sample_log=true", "scaling.cpus_per_worker=0.5", *extra,
    ]


def recipe(corpus: Path, out: Path, *extra: str):
    return load_recipe(RECIPE, overrides(corpus, out, *extra))


def attempts(run: Path) -> dict[int, list[tuple[dict, list[dict]]]]:
    """resumed step -> [(head line, step lines)] of each worker's sample-log file."""
    out: dict[int, list[tuple[dict, list[dict]]]] = {}
    for f in sorted((run / "sample_log").glob("*.jsonl")):
        head, *lines = [json.loads(x) for x in f.read_text().splitlines()]
        out.setdefault(head["resumed_step"], []).append((head, lines))
    return out


def committed(run: Path) -> tuple[list[dict], list[int]]:
    """Sample-log lines whose step was committed, over all attempts, and the attempts' resumed
    steps."""
    by_start = attempts(run)
    starts = sorted(by_start)
    out = []
    for i, start in enumerate(starts):
        until = starts[i + 1] if i + 1 < len(starts) else 1 << 62
        for _, lines in by_start[start]:
            out.extend(x for x in lines if x["step"] <= until)
    return out, starts


def reference_digests(rec, run: Path, epoch: int, tokenizer: Path | None = None) -> dict[int, str]:
    """sample id -> digest of the tokens and mask the pure NumPy pipeline gives it in ``epoch``, with
    ``tokenizer`` (default: the run's own, trained by it; a distillation's is its checkpoints')."""
    from pipelines import storage

    shards = storage.Store().list_files(rec.data.input)
    spec = stream_spec(rec, shards)
    tok = load_tokenizer(tokenizer or run / "tokenizer")
    out = {}
    for b in local_batches(spec, tok, batch_size=1, epoch=epoch):  # 1: no tail left unbatched
        tensors = {k: torch.as_tensor(v) for k, v in b.items()}
        out.update(zip(b["sample_id"].tolist(), row_digests(tensors)))
    return out


def assert_epoch_exactly_once(rec, run: Path, epoch: int = 0, tokenizer: Path | None = None) -> int:
    lines, _ = committed(run)
    seen = Counter()
    digests = {}
    for x in lines:
        for e, sid, d in zip(x["epoch"], x["ids"], x["digests"]):
            if e == epoch:
                seen[sid] += 1
                digests[sid] = d
    ref = reference_digests(rec, run, epoch, tokenizer)
    repeated = {s: n for s, n in seen.items() if n > 1}
    assert not repeated, f"{len(repeated)} samples of epoch {epoch} trained on more than once"
    missing = ref.keys() - seen.keys()
    assert not missing, f"{len(missing)} of {len(ref)} samples of epoch {epoch} never trained on"
    assert seen.keys() == ref.keys()
    wrong = [s for s in ref if digests[s] != ref[s]]
    assert not wrong, f"{len(wrong)} samples got other tokens or masks than the NumPy pipeline gives them"
    return len(ref)


def state(run: Path) -> dict:
    from pipelines import storage

    return json.loads(Path(storage.Store().latest_complete_checkpoint(str(run)), "trainer_state.json").read_text())


class WorkerKiller:
    """SIGKILLs the highest-rank Ray Train worker of ``run`` once its sample log shows ``after_step``
    done (a thread, started at once; ``pid`` is the killed worker's, None until then)."""

    def __init__(self, run: Path, after_step: int):
        self.run, self.after_step, self.pid = run, after_step, None
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            logs = sorted((self.run / "sample_log").glob("*-rank*.jsonl"), key=lambda f: f.name[-7:]) if (self.run / "sample_log").exists() else []
            for f in logs[::-1]:
                lines = f.read_text().splitlines()
                steps = [json.loads(x).get("step", 0) for x in lines[1:]]
                if steps and max(steps) >= self.after_step:
                    self.pid = json.loads(lines[0])["pid"]
                    os.kill(self.pid, signal.SIGKILL)
                    return
            time.sleep(0.05)

    def killed(self) -> int:
        """The killed worker's pid; fails the test when the run ended first."""
        self._stop.set()
        assert self.pid is not None, "the run ended before the worker could be killed"
        return self.pid
