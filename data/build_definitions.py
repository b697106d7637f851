"""Build ``tasks/definitions``: a retrieval task for sentence embeddings, from the committed ``tasks/qa``.

Each record is an ``anchor`` (a definition question, "What does acknowledged mean?"), its
``positive`` (the definition, "recognized or made known or admitted") and one hard ``negative``:
the definition of another synset of the same short document, so of the same lexicographer file
(topic), where a model that matches on topic alone cannot tell them apart. The field names are
sentence-transformers' (anchor, positive, negative), what ``ctx finetune`` with task kind
``embedding`` reads by default.

The questions are the qa task's "what is it" questions (ids ending in ``.def``), split as qa is (so
by synset, as every task here). A question's negative is the next ``.def`` question's definition
in the same context, in id order, round the end; a question alone in its context has none and is
left out. Nothing here needs WordNet: from the repository root,

    python data/build_definitions.py [--out data/tasks/definitions]

rewrites ``data/tasks/definitions/{train,validation,test}.jsonl`` byte for byte.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent


def definition_records(qa_records: list[dict]) -> list[dict]:
    """The split's retrieval records, in the qa split's order."""
    questions = [r for r in qa_records if r["id"].endswith(".def")]
    by_context: dict[str, list[dict]] = defaultdict(list)
    for r in questions:
        by_context[r["context"]].append(r)
    negative: dict[str, str] = {}
    for group in by_context.values():
        group = sorted(group, key=lambda r: r["id"])
        for i, r in enumerate(group):
            if len(group) > 1:
                negative[r["id"]] = group[(i + 1) % len(group)]["answers"]["text"][0]
    return [{"id": r["id"], "anchor": r["question"], "positive": r["answers"]["text"][0], "negative": negative[r["id"]]}
            for r in questions if r["id"] in negative]


def build_from(source: str, records_of: Callable[[list[dict]], list[dict]], doc: str, default_out: str) -> None:
    """The command line of a task built from another committed one: each split of ``tasks/<source>``
    through ``records_of``, written as compact JSON lines to ``--out`` (default ``tasks/<default_out>``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "tasks" / default_out)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation", "test"):
        given = [json.loads(line) for line in (HERE / "tasks" / source / f"{split}.jsonl").read_text().splitlines()]
        records = records_of(given)
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
        print(f"{split}: {len(records)} records")


if __name__ == "__main__":
    build_from("qa", definition_records, __doc__, "definitions")
