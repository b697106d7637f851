"""Build the sample pretraining corpus from WordNet 3.0 glosses (stdlib only, deterministic).

WordNet's data files (``data.noun``, ``data.verb``, ``data.adj``, ``data.adv``) hold one synset per
line: ``offset lex_filenum ss_type w_cnt word lex_id ... p_cnt ptrs ... | gloss``, where the gloss
is definitions and quoted example sentences separated by semicolons (format: wndb(5WN)). We keep
the synsets that have at least one example, turn each into a few English sentences::

    A bank is a building in which the business of banking transacted.
    Another word for it is bank building.
    The bank is on the corner of Nassau and Witherspoon.

and group 3-6 consecutive synsets of the same lexicographer file (so of one topic: noun.animal,
verb.motion, ...) into a document. Output follows BERT's ``create_pretraining_data.py``: one
sentence per line, a blank line between documents; documents go round-robin to gzip shards
written with ``mtime=0`` so a rebuild gives byte-identical files.

Usage (from the repository root, after ``apt-get install wordnet-base``)::

    python data/build_sample.py --wordnet /usr/share/wordnet --out data/sample --shards 8
"""

from __future__ import annotations

import argparse
import gzip
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

POS_FILES = ("noun", "verb", "adj", "adv")
_ADJ_MARKER = re.compile(r"\((a|p|ip)\)$")  # syntactic markers on adjective lemmas: able(a)
_SPACES = re.compile(r"\s+")
_COUNTABLE_START = ("a ", "an ", "the ", "one ", "any ", "someone ", "something ")
# A noun gloss may open with its domain, "(baseball) a successful stroke ...": we write "In baseball,
# a hit is ...", but only for labels that name a field, not usage notes like "(usually plural)".
_DOMAIN = re.compile(r"^\(([A-Za-z][A-Za-z ]*)\)\s+(.*)$")
_NOT_A_DOMAIN = frozenset(
    "usually often frequently plural used only slang slur informal colloquial figurative of with in always "
    "formerly formal archaic literary poetic metaphor metonymy trademark briticism dated an hi game games".split()
)


@dataclass(frozen=True)
class Synset:
    offset: int
    lex_filenum: int
    pos: str  # n, v, a, s, r
    lemmas: tuple[str, ...]
    definitions: tuple[str, ...]
    examples: tuple[str, ...]


def split_gloss(gloss: str) -> tuple[list[str], list[str]]:
    """Split a gloss into (definitions, examples) at semicolons that are outside double quotes."""
    parts, buf, in_quote = [], [], False
    for ch in gloss:
        if ch == '"':
            in_quote = not in_quote
        if ch == ";" and not in_quote:
            parts.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
    parts.append("".join(buf))
    definitions, examples = [], []
    for part in (p.strip() for p in parts):
        if not part:
            continue
        if part.startswith('"'):
            # Drop an attribution after the closing quote ("to be or not to be" - Shakespeare).
            end = part.rfind('"')
            text = part[1:end] if end > 0 else part[1:]
            if text.strip():
                examples.append(text.strip())
        else:
            definitions.append(part)
    return definitions, examples


def parse_line(line: str) -> Synset | None:
    """One data-file line to a Synset; None for the licence header (lines starting with spaces)."""
    if line.startswith(" ") or "|" not in line:
        return None
    head, gloss = line.split(" | ", 1) if " | " in line else line.split("|", 1)
    fields = head.split()
    n_words = int(fields[3], 16)
    lemmas = tuple(_ADJ_MARKER.sub("", fields[4 + 2 * i]).replace("_", " ") for i in range(n_words))
    definitions, examples = split_gloss(clean(gloss))
    return Synset(int(fields[0]), int(fields[1]), fields[2], lemmas, tuple(definitions), tuple(examples))


def clean(text: str) -> str:
    """Whitespace runs to one space; WordNet's `quoted' words to 'quoted'."""
    return _SPACES.sub(" ", text.replace("`", "'")).strip()


def sentence(text: str) -> str:
    """Capitalise the first letter and end with punctuation."""
    text = text.strip()
    if not text:
        return text
    text = text[0].upper() + text[1:]
    return text if text[-1] in ".!?" else text + "."


def render(s: Synset) -> list[str]:
    """The sentences of one synset: a defining sentence, other names, further notes, examples."""
    head = s.lemmas[0]
    definition = s.definitions[0] if s.definitions else ""
    lines = []
    if definition:
        if s.pos == "n":
            prefix = ""
            m = _DOMAIN.match(definition)
            if m and len(m.group(1).split()) <= 3 and not _NOT_A_DOMAIN & set(m.group(1).lower().split()):
                prefix, definition = f"in {m.group(1)}, ", m.group(2)
            if head[:1].isupper() or not definition.lower().startswith(_COUNTABLE_START):
                lines.append(sentence(f"{prefix}{head} is {definition}"))
            else:
                article = "an" if head[:1].lower() in "aeiou" else "a"
                lines.append(sentence(f"{prefix}{article} {head} is {definition}"))
        elif s.pos == "v":
            lines.append(sentence(f"to {head} is to {definition}"))
        else:
            lines.append(sentence(f"{head} means {definition}"))
    others = [w for w in dict.fromkeys(s.lemmas[1:]) if w != head]
    if len(others) == 1:
        lines.append(f"Another word for it is {others[0]}.")
    elif others:
        lines.append(f"Other words for it are {', '.join(others[:-1])} and {others[-1]}.")
    lines.extend(sentence(d) for d in s.definitions[1:])
    lines.extend(sentence(e) for e in s.examples)
    return [line for line in lines if line]


def groups(synsets: list[Synset]) -> list[list[Synset]]:
    """Consecutive synsets of one lexicographer file in groups of 3-6 (fewer at a file's end).

    The group size comes from a CRC of the first synset's offset: varied, yet fixed across runs.
    """
    out: list[list[Synset]] = []
    i = 0
    while i < len(synsets):
        size = 3 + zlib.crc32(str(synsets[i].offset).encode()) % 4
        group = [synsets[i]]
        j = i + 1
        while j < len(synsets) and len(group) < size and synsets[j].lex_filenum == synsets[i].lex_filenum:
            group.append(synsets[j])
            j += 1
        out.append(group)
        i = j
    return out


def documents(synsets: list[Synset]) -> list[list[str]]:
    """One document per group of synsets (``groups``): their sentences, in order."""
    return [[line for s in group for line in render(s)] for group in groups(synsets)]


def read_synsets(wordnet_dir: Path) -> list[Synset]:
    """Synsets with at least one example sentence, in file order (noun, verb, adj, adv; by offset)."""
    out = []
    for pos in POS_FILES:
        path = wordnet_dir / f"data.{pos}"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: install WordNet 3.0 (apt-get install wordnet-base) or pass --wordnet")
        with open(path, encoding="utf-8") as f:
            for line in f:
                s = parse_line(line)
                if s is not None and s.examples:
                    out.append(s)
    return out


def write_shards(docs: list[list[str]], out_dir: Path, n_shards: int) -> list[Path]:
    """Documents round-robin into ``wordnet-XXXX-of-NNNN.txt.gz``; gzip header without time or name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(n_shards):
        text = "\n\n".join("\n".join(doc) for doc in docs[k::n_shards]) + "\n"
        path = out_dir / f"wordnet-{k:04d}-of-{n_shards:04d}.txt.gz"
        with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
            gz.write(text.encode("utf-8"))
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wordnet", type=Path, default=Path("/usr/share/wordnet"), help="folder holding WordNet 3.0 data.* files")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "sample")
    ap.add_argument("--shards", type=int, default=8)
    args = ap.parse_args()
    synsets = read_synsets(args.wordnet)
    docs = documents(synsets)
    paths = write_shards(docs, args.out, args.shards)
    n_lines = sum(len(d) for d in docs)
    n_bytes = sum(len(gzip.decompress(p.read_bytes())) for p in paths)
    n_words = sum(len(line.split()) for d in docs for line in d)
    gz_bytes = sum(p.stat().st_size for p in paths)
    print(f"synsets={len(synsets)} documents={len(docs)} sentences={n_lines} words={n_words} "
          f"bytes={n_bytes} gzip_bytes={gz_bytes} shards={len(paths)} -> {args.out}")


if __name__ == "__main__":
    main()
