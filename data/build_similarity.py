"""Build ``tasks/similarity``: pairs scored for similarity (STS-B's layout), from the committed ``tasks/definitions``.

Each definitions record (a question "What does acknowledged mean?", its definition, and the
definition of another synset of the same short document) gives three pairs of the question and a
definition, with a graded score in [0, 1] (the scale of sentence-transformers' STS-B copy):

- 1.0: its own definition (``<id>.own``);
- 0.5: the other definition of the same document, so of the same lexicographer file (topic)
  (``<id>.topic``);
- 0.0: the definition of the record half the split away, of another document (``<id>.other``).

The fields are ``sentence1``, ``sentence2`` and ``score``, what ``ctx finetune`` with task kind
``embedding`` and a pair loss (``task.loss: cosent``, ``angle`` or ``cosine_similarity``) reads by
default; validation is the Spearman correlation of the pairs' cosine similarities with the scores.
Split as definitions is (by synset). Nothing here needs WordNet: from the repository root,

    python data/build_similarity.py [--out data/tasks/similarity]

rewrites ``data/tasks/similarity/{train,validation,test}.jsonl`` byte for byte.
"""

from __future__ import annotations

from build_definitions import build_from  # this folder, as the script runs from it

SCORES = {"own": 1.0, "topic": 0.5, "other": 0.0}


def similarity_records(definitions: list[dict]) -> list[dict]:
    """The split's scored pairs, three per definitions record, in its order."""
    n = len(definitions)
    out = []
    for i, r in enumerate(definitions):
        other = definitions[(i + n // 2) % n]["positive"]
        if other in (r["positive"], r["negative"]):  # never a pair scored 0 that is in fact the same text
            other = definitions[(i + n // 2 + 1) % n]["positive"]
        for kind, text in (("own", r["positive"]), ("topic", r["negative"]), ("other", other)):
            out.append({"id": f"{r['id']}.{kind}", "sentence1": r["anchor"], "sentence2": text, "score": SCORES[kind]})
    return out


if __name__ == "__main__":
    build_from("definitions", similarity_records, __doc__, "similarity")
