"""Build four downstream tasks from WordNet 3.0 (stdlib only, deterministic).

Tasks, written to ``<out>/<task>/{train,validation,test}.jsonl`` (UTF-8, one JSON object a line,
sorted by ``id``):

* ``lexname`` (classification): a synset's definition -> its lexicographer file (``noun.animal``,
  ``verb.motion``, ``adj.all``, ...), the 20 most frequent files only. Fields ``id``,
  ``sentence1``, ``label``.
* ``wic`` (pair classification; Pilehvar & Camacho-Collados 2019, "WiC: the Word-in-Context
  Dataset"): two WordNet example sentences that both contain one lemma; label 1 if they illustrate
  the same synset, 0 if different synsets of that lemma. Fields ``id``, ``word``, ``pos``,
  ``sentence1``, ``sentence2``, ``start1``, ``end1``, ``start2``, ``end2`` (character spans of the
  word in each sentence), ``label``. Split by lemma: test lemmas are unseen in training.
* ``supersense`` (token classification; supersenses as in Ciaramita & Johnson 2003): an example
  sentence of a noun or verb synset, CoNLL style ``tokens`` and IOB2 ``tags``: ``B-noun.animal``
  (``I-...`` for further words of a multi-word lemma) on the synset's lemma, ``O`` elsewhere; plus
  ``target_start``/``target_end`` (token indices of the tagged span, end exclusive).
* ``qa`` (extractive QA, SQuAD v1.1 flat records as Hugging Face ``datasets`` has them): ``id``,
  ``title``, ``context`` (a short WordNet document: 3-6 synsets of one lexicographer file rendered
  as in ``data/sample``), ``question`` ("What is a bank?", "What is another word for bank?"),
  ``answers: {text: [...], answer_start: [...]}``. The validation split is also written as SQuAD's
  nested official JSON, ``qa/validation-squad.json``.

Splits are keyed by a SHA-256 of the synset id (``<offset>-<pos>``, as WordNet names synsets), the
same for every task, so a synset is in the same split everywhere; ``wic`` hashes the lemma instead.
Within a split, records are taken in the order of a second hash up to a cap per split, so the
output does not depend on random state, only on WordNet's files.

Target words are found in example sentences by WordNet's own morphology ("morphy", ``morphy(7WN)``):
a word form matches a lemma when it equals it or one of its base forms by the exception lists
(``noun.exc``, ``verb.exc``, ``adj.exc``, ``adv.exc``) or the detachment rules (dogs -> dog,
ran -> run via verb.exc, taking -> take). Only sentences in which the lemma occurs exactly once are
used, so the target is never ambiguous.

Usage (from the repository root, after ``apt-get install wordnet-base``)::

    python data/build_tasks.py --wordnet /usr/share/wordnet --out data/tasks
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_sample import _COUNTABLE_START, _DOMAIN, POS_FILES, Synset, groups, parse_line, render  # noqa: E402  (a sibling script, not a package)

# The lexicographer files by number (WordNet's ``lexnames(5WN)``); Debian's package omits that file.
LEXNAMES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event",
    "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object",
    "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process",
    "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance", "noun.time",
    "verb.body", "verb.change", "verb.cognition", "verb.communication", "verb.competition",
    "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather", "adj.ppl",
)
SPLITS = ("train", "validation", "test")
# Share of the hash space per split (percent), then a cap per split: small enough to commit and to
# train on in tests, large enough that baselines separate.
SPLIT_PERCENT = {"train": 80, "validation": 10, "test": 10}
CAPS = {
    "lexname": {"train": 4000, "validation": 500, "test": 500},
    "wic": {"train": 2400, "validation": 500, "test": 500},
    "supersense": {"train": 2500, "validation": 500, "test": 500},
    "qa": {"train": 700, "validation": 300, "test": 300},  # records repeat their context: ~750 bytes each
}
LEXNAME_CLASSES = 20  # the most frequent lexicographer files
WIC_PAIRS_PER_LEMMA = 3  # at most this many positive and as many negative pairs per lemma

# Word tokens for example sentences: letters/digits with inner apostrophes, hyphens or periods
# (don't, well-known, U.S.), else any single non-space character (punctuation).
_TOKEN = re.compile(r"[A-Za-z0-9]+(?:['.\-][A-Za-z0-9]+)*|\S")

# morphy's detachment rules (suffix, ending) per part of speech, ``morphy(7WN)``.
_RULES = {
    "n": (("s", ""), ("ses", "s"), ("xes", "x"), ("zes", "z"), ("ches", "ch"), ("shes", "sh"), ("men", "man"), ("ies", "y")),
    "v": (("s", ""), ("ies", "y"), ("es", "e"), ("es", ""), ("ed", "e"), ("ed", ""), ("ing", "e"), ("ing", "")),
    "a": (("er", ""), ("est", ""), ("er", "e"), ("est", "e")),
    "r": (),
}
_EXC_FILES = {"n": "noun.exc", "v": "verb.exc", "a": "adj.exc", "r": "adv.exc"}


# ---------------------------------------------------------------------------------------------
# WordNet: synsets, ids, splits, morphology.


def read_all_synsets(wordnet_dir: Path) -> list[Synset]:
    """Every synset, in file order (noun, verb, adj, adv; by offset)."""
    out = []
    for pos in POS_FILES:
        path = wordnet_dir / f"data.{pos}"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: install WordNet 3.0 (apt-get install wordnet-base) or pass --wordnet")
        with open(path, encoding="utf-8") as f:
            out.extend(s for s in map(parse_line, f) if s is not None)
    return out


def synset_id(s: Synset) -> str:
    """WordNet's name of a synset: 8-digit offset and part of speech (offsets repeat across files)."""
    return f"{s.offset:08d}-{s.pos}"


def base_pos(s: Synset) -> str:
    """n, v, a, r: adjective satellites (s) are adjectives."""
    return "a" if s.pos == "s" else s.pos


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def split_of(key: str) -> str:
    """The split of a synset id (or of a lemma, for wic): a fixed function of the key."""
    bucket = _hash(key) % 100
    if bucket < SPLIT_PERCENT["train"]:
        return "train"
    return "validation" if bucket < SPLIT_PERCENT["train"] + SPLIT_PERCENT["validation"] else "test"


def rank(key: str, salt: str) -> int:
    """Order in which records of a split are taken up to its cap (independent of the split hash)."""
    return _hash(f"{salt}\t{key}")


class Morphy:
    """WordNet's base forms of a word form (``morphy(7WN)``) without the index check: we only ask
    whether a form can be an inflection of a given lemma."""

    def __init__(self, wordnet_dir: Path) -> None:
        self.exceptions: dict[str, dict[str, set[str]]] = {}
        for pos, name in _EXC_FILES.items():
            table: dict[str, set[str]] = defaultdict(set)
            with open(wordnet_dir / name, encoding="utf-8") as f:
                for line in f:
                    form, *bases = line.split()
                    table[form].update(b.replace("_", " ") for b in bases)
            self.exceptions[pos] = dict(table)

    def bases(self, form: str, pos: str) -> set[str]:
        """Candidate lemmas of a word form: itself, its exceptions, its detachments. Detachments
        leave at least two letters, or "is" would be a plural of the noun "i" (iodine)."""
        out = {form} | self.exceptions[pos].get(form, set())
        for suffix, ending in _RULES[pos]:
            if form.endswith(suffix) and len(form) - len(suffix) >= 2:
                out.add(form[: len(form) - len(suffix)] + ending)
        return out


def tokenize(text: str) -> list[tuple[str, int, int]]:
    """(word, start, end) character spans of the words and punctuation of ``text``."""
    return [(m.group(), m.start(), m.end()) for m in _TOKEN.finditer(text)]


def find_lemma(tokens: list[tuple[str, int, int]], lemma: str, pos: str, morphy: Morphy) -> list[tuple[int, int]]:
    """Token spans [i, j) where ``lemma`` (one or more words) occurs, inflected or not.

    Every word of a multi-word lemma may be inflected (``took off`` for ``take off``); a hyphenated
    lemma is one token. Lower-case lemma words match whatever the case of the text ("Bank on it");
    words with capitals (names, acronyms: "US", "Mars") match only that spelling, not "us".
    """
    words = [w for w, _, _ in tokenize(lemma)]

    def matches(word: str, token: str) -> bool:
        form = token.lower() if word.islower() else token
        return word == form or word in morphy.bases(form, pos)

    n = len(words)
    return [(i, i + n) for i in range(len(tokens) - n + 1) if all(matches(w, tokens[i + k][0]) for k, w in enumerate(words))]


def sentence_occurrences(s: Synset, morphy: Morphy) -> list[tuple[str, str, list[tuple[str, int, int]], int, int]]:
    """(lemma, example, tokens, i, j) for each example of ``s`` in which exactly one of its lemmas
    occurs exactly once, at tokens [i, j). Examples where none or several do are skipped."""
    out = []
    for example in s.examples:
        tokens = tokenize(example)
        found = []
        for lemma in dict.fromkeys(s.lemmas):
            found.extend((lemma, i, j) for i, j in find_lemma(tokens, lemma, base_pos(s), morphy))
        # Overlapping hits of nested lemmas ("bank", "bank building") count as several: skipped too.
        if len(found) == 1:
            lemma, i, j = found[0]
            out.append((lemma, example, tokens, i, j))
    return out


# ---------------------------------------------------------------------------------------------
# Writing.


def capped(records_by_split: dict[str, list[tuple[int, dict]]], caps: dict[str, int]) -> dict[str, list[dict]]:
    """Each split's (rank, record) pairs: the ``caps[split]`` lowest ranks, sorted by id."""
    out = {}
    for split in SPLITS:
        chosen = sorted(records_by_split.get(split, []), key=lambda p: (p[0], p[1]["id"]))[: caps[split]]
        out[split] = sorted((r for _, r in chosen), key=lambda r: r["id"])
    return out


def capped_groups(groups_by_split: dict[str, list[tuple[int, str, list[dict]]]], caps: dict[str, int]) -> dict[str, list[dict]]:
    """Each split's (rank, key, records) groups, taken whole in rank order while the split's records
    stay within its cap; the records sorted by id."""
    out = {}
    for split in SPLITS:
        records: list[dict] = []
        for _, _, group in sorted(groups_by_split.get(split, []), key=lambda g: g[:2]):
            if len(records) + len(group) > caps[split]:
                break
            records.extend(group)
        out[split] = sorted(records, key=lambda r: r["id"])
    return out


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")


# ---------------------------------------------------------------------------------------------
# lexname: definition -> lexicographer file.


def build_lexname(synsets: list[Synset]) -> dict[str, list[dict]]:
    """Definitions (all of a synset's, joined by "; ", no lemma, no examples) of the synsets of the
    ``LEXNAME_CLASSES`` most frequent lexicographer files. A definition text shared by several
    synsets is dropped, so no text has two labels or sits in two splits."""
    counts = Counter(s.lex_filenum for s in synsets)
    classes = {n for n, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:LEXNAME_CLASSES]}
    texts = Counter("; ".join(s.definitions) for s in synsets)
    by_split: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for s in synsets:
        text = "; ".join(s.definitions)
        if s.lex_filenum not in classes or not text or texts[text] > 1:
            continue
        key = synset_id(s)
        by_split[split_of(key)].append((rank(key, "lexname"), {"id": key, "sentence1": text, "label": LEXNAMES[s.lex_filenum]}))
    return capped(by_split, CAPS["lexname"])


# ---------------------------------------------------------------------------------------------
# wic: same lemma in two example sentences, same synset or not.


@dataclass(frozen=True)
class Occurrence:
    synset: str  # synset id
    sentence: str
    start: int  # character span of the lemma in the sentence
    end: int


def lemma_occurrences(synsets: list[Synset], morphy: Morphy) -> dict[tuple[str, str], list[Occurrence]]:
    """(lower-cased lemma, pos) -> the example sentences in which it occurs once, per synset."""
    out: dict[tuple[str, str], list[Occurrence]] = defaultdict(list)
    for s in synsets:
        for lemma, example, tokens, i, j in sentence_occurrences(s, morphy):
            out[(lemma.lower(), base_pos(s))].append(Occurrence(synset_id(s), example, tokens[i][1], tokens[j - 1][2]))
    return out


def wic_pairs(word: str, pos: str, occs: list[Occurrence]) -> list[dict]:
    """Up to ``WIC_PAIRS_PER_LEMMA`` same-synset pairs and as many different-synset pairs (equal
    numbers, so labels are balanced per lemma), chosen by hash."""
    synsets_of = defaultdict(set)
    for o in occs:
        synsets_of[o.sentence].add(o.synset)
    occs = [o for o in occs if len(synsets_of[o.sentence]) == 1]  # one sentence under two synsets: contradictory
    occs = list({(o.synset, o.sentence): o for o in occs}.values())
    same, diff = [], []
    for a in range(len(occs)):
        for b in range(a + 1, len(occs)):
            x, y = sorted((occs[a], occs[b]), key=lambda o: rank(o.sentence, "wic-order"))
            (same if x.synset == y.synset else diff).append((x, y))
    n = min(len(same), len(diff), WIC_PAIRS_PER_LEMMA)
    records = []
    for label, pairs in ((1, same), (0, diff)):
        pairs.sort(key=lambda p: rank(f"{p[0].sentence}\t{p[1].sentence}", "wic-pick"))
        for x, y in pairs[:n]:
            pair_id = f"{word.replace(' ', '_')}.{pos}.{rank(x.sentence + chr(9) + y.sentence, 'wic-id'):016x}"
            records.append({
                "id": pair_id, "word": word, "pos": pos,
                "sentence1": x.sentence, "sentence2": y.sentence,
                "start1": x.start, "end1": x.end, "start2": y.start, "end2": y.end,
                "label": label,
            })
    return records


def build_wic(synsets: list[Synset], morphy: Morphy) -> dict[str, list[dict]]:
    """WiC pairs, split by lemma (a hash of "lemma.pos"): test lemmas are unseen in training. Lemmas
    enter their split whole, in hash order, up to its cap; a sentence pair already used by another
    lemma is skipped, so no pair appears twice, let alone in two splits."""
    by_split: dict[str, list[tuple[int, str, list[dict]]]] = defaultdict(list)
    seen: set[frozenset[str]] = set()
    for (word, pos), occs in sorted(lemma_occurrences(synsets, morphy).items()):
        pairs = [r for r in wic_pairs(word, pos, occs) if frozenset((r["sentence1"], r["sentence2"])) not in seen]
        if not pairs or sum(r["label"] for r in pairs) * 2 != len(pairs):
            continue  # no pairs, or a pair used by another lemma broke this lemma's balance
        seen.update(frozenset((r["sentence1"], r["sentence2"])) for r in pairs)
        key = f"{word}.{pos}"
        by_split[split_of(key)].append((rank(key, "wic"), key, pairs))
    return capped_groups(by_split, CAPS["wic"])


# ---------------------------------------------------------------------------------------------
# supersense: IOB2 tags of the target lemma in an example sentence.


def build_supersense(synsets: list[Synset], morphy: Morphy) -> dict[str, list[dict]]:
    """One record per example of a noun or verb synset in which one of its lemmas occurs once."""
    by_split: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for s in synsets:
        if s.pos not in ("n", "v"):
            continue
        key = synset_id(s)
        label = LEXNAMES[s.lex_filenum]
        for k, (lemma, example, tokens, i, j) in enumerate(sentence_occurrences(s, morphy)):
            tags = ["O"] * len(tokens)
            tags[i] = f"B-{label}"
            tags[i + 1 : j] = [f"I-{label}"] * (j - i - 1)
            rid = f"{key}.{k}"
            record = {"id": rid, "tokens": [w for w, _, _ in tokens], "tags": tags, "target_start": i, "target_end": j}
            by_split[split_of(key)].append((rank(rid, "supersense"), record))
    return capped(by_split, CAPS["supersense"])


# ---------------------------------------------------------------------------------------------
# qa: SQuAD v1.1 over short WordNet documents.


def _definition_in(s: Synset, line: str) -> str:
    """The first definition as ``render`` wrote it into the defining sentence ``line``."""
    definition = s.definitions[0]
    m = _DOMAIN.match(definition)
    if s.pos == "n" and m and line.lower().startswith(f"in {m.group(1).lower()}, "):
        definition = m.group(2)
    return definition


def _synonym_spans(s: Synset, line: str) -> list[tuple[str, int]]:
    """(name, offset in ``line``) of the other names of ``s`` if ``line`` is render's "Another word
    for it is X." / "Other words for it are X, Y and Z." sentence, else []. The names are the ones
    render listed, found left to right (splitting at " and " would cut "Bosnia and Herzegovina")."""
    if not line.startswith(("Another word for it is ", "Other words for it are ")):
        return []
    others = [w for w in dict.fromkeys(s.lemmas[1:]) if w != s.lemmas[0]]  # as render lists them
    spans, at = [], len("Another word for it is ")  # == len("Other words for it are ")
    for name in others:
        at = line.index(name, at)
        spans.append((name, at))
        at += len(name)
    return spans


def _question(s: Synset, name: str) -> str:
    """The definition question about ``name`` (one of the synset's lemmas), worded as the defining
    sentence would be."""
    if s.pos == "v":
        return f"What does it mean to {name}?"
    if s.pos != "n":
        return f"What does {name} mean?"
    definition = _definition_in(s, render(s)[0])
    if name[:1].isupper() or not definition.lower().startswith(_COUNTABLE_START):
        return f"What is {name}?"
    return f"What is {'an' if name[:1].lower() in 'aeiou' else 'a'} {name}?"


def qa_document(group: list[Synset]) -> tuple[str, list[dict]]:
    """A context (the group's rendered sentences joined by spaces) and its questions, per synset:

    * "what is it" about one of its names, chosen by hash (answer: its first definition). Asked
      about another name than the first, the question needs a hop: "What is a depository financial
      institution?" is answered by "A bank is ...", linked by "Another word for it is ...";
    * "what is another word for <its first name>" if it has other names (answers: those names).

    A question is left out when its name also names another synset of the group (two answers).
    """
    context, offsets = "", []  # offsets: per synset, per rendered line, where the line starts
    for s in group:
        lines = render(s)
        starts = []
        for line in lines:
            if context:
                context += " "
            starts.append(len(context))
            context += line
        offsets.append((lines, starts))
    names = Counter(w.lower() for s in group for w in set(s.lemmas))
    questions = []
    for s, (lines, starts) in zip(group, offsets):
        key = synset_id(s)
        own = list(dict.fromkeys(s.lemmas))
        name = own[rank(key, "qa-name") % len(own)]
        if s.definitions and names[name.lower()] == 1:
            answer = _definition_in(s, lines[0])
            start = starts[0] + lines[0].rindex(answer)
            questions.append({"id": f"{key}.def", "question": _question(s, name), "answers": {"text": [answer], "answer_start": [start]}})
        for line, line_start in zip(lines, starts):
            spans = _synonym_spans(s, line)
            if spans and names[s.lemmas[0].lower()] == 1:
                questions.append({
                    "id": f"{key}.syn", "question": f"What is another word for {s.lemmas[0]}?",
                    "answers": {"text": [n for n, _ in spans], "answer_start": [line_start + a for _, a in spans]},
                })
                break
    for q in questions:
        for text, start in zip(q["answers"]["text"], q["answers"]["answer_start"]):
            if context[start : start + len(text)] != text:
                raise AssertionError(f"qa {q['id']}: answer {text!r} is not at {start} of its context")
    return context, questions


def build_qa(synsets: list[Synset]) -> dict[str, list[dict]]:
    """Documents as in ``data/sample`` (synsets with examples, ``build_sample.groups``), split by their
    first synset and taken whole: every question of a context sits in one split, and a context
    usually has several questions, as SQuAD's paragraphs do. Flat records, one per question."""
    by_split: dict[str, list[tuple[int, str, list[dict]]]] = defaultdict(list)
    for group in groups([s for s in synsets if s.examples]):
        context, questions = qa_document(group)
        if not questions:
            continue
        key = synset_id(group[0])
        title = LEXNAMES[group[0].lex_filenum]
        records = [{"id": q["id"], "title": title, "context": context, "question": q["question"], "answers": q["answers"]} for q in questions]
        by_split[split_of(key)].append((rank(key, "qa"), key, records))
    return capped_groups(by_split, CAPS["qa"])


def squad_nested(records: list[dict]) -> dict:
    """Flat records as SQuAD v1.1's official JSON: data -> articles (title) -> paragraphs -> qas."""
    articles: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        answers = [{"text": t, "answer_start": a} for t, a in zip(r["answers"]["text"], r["answers"]["answer_start"])]
        articles[r["title"]][r["context"]].append({"id": r["id"], "question": r["question"], "answers": answers})
    data = [
        {"title": title, "paragraphs": [{"context": c, "qas": qas} for c, qas in paragraphs.items()]}
        for title, paragraphs in sorted(articles.items())
    ]
    return {"version": "1.1", "data": data}


# ---------------------------------------------------------------------------------------------


TASKS = ("lexname", "wic", "supersense", "qa")


def build(wordnet_dir: Path) -> dict[str, dict[str, list[dict]]]:
    synsets = read_all_synsets(wordnet_dir)
    morphy = Morphy(wordnet_dir)
    return {
        "lexname": build_lexname(synsets),
        "wic": build_wic(synsets, morphy),
        "supersense": build_supersense(synsets, morphy),
        "qa": build_qa(synsets),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wordnet", type=Path, default=Path("/usr/share/wordnet"), help="folder holding WordNet 3.0 data.* and *.exc files")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "tasks")
    args = ap.parse_args()
    tasks = build(args.wordnet)
    total = 0
    for task, splits in tasks.items():
        for split, records in splits.items():
            path = args.out / task / f"{split}.jsonl"
            write_jsonl(path, records)
            total += path.stat().st_size
            print(f"{task}/{split}: {len(records)} records, {path.stat().st_size} bytes")
    squad = args.out / "qa" / "validation-squad.json"
    squad.write_text(json.dumps(squad_nested(tasks["qa"]["validation"]), ensure_ascii=False) + "\n", encoding="utf-8")
    total += squad.stat().st_size
    print(f"qa/validation-squad.json: {squad.stat().st_size} bytes; total {total} bytes -> {args.out}")


if __name__ == "__main__":
    main()
