"""`ctx demo` / `make demo`: the project's whole path, on embedded defaults, on a laptop-sized machine.

1. train a WordPiece tokenizer on the bundled WordNet corpus and pretrain a tiny BERT with dynamic
   masking through Ray Data + Ray Train (2 workers; 7 shards, the 8th held out),
2. masked-token accuracy on the held-out shard, before and after, and the run's report page,
3. fine-tune the shipped all-MiniLM-L6-v2 on lexname (gloss -> lexicographer file, 20 classes;
   1 Ray Train worker with 2 threads, bf16 where the CPU has native bf16 products),
4. its accuracy on lexname's test records beside a TF-IDF + logistic regression baseline and the
   majority class, fitted on the same training records,
5. register the fine-tuned checkpoint in an MLflow registry and promote it to ``@production``,
6. serve the pretrained BERT and ``models:/minilm-lexname@production`` side by side with Ray Serve:
   "bank" gets a different vector by context, one /v1/classify and one /v1/embeddings answer with
   their ``X-Registry-Version`` header,
7. one scheduled round (``ctx schedule --once``, ``jobs.operations.schedule.run_round``) on labelled records
   that land under the trigger's watch folder during the demo: production continued on them,
   both versions scored on the same held-out records, and the gate's decision.

Everything it makes (runs, checkpoints, the registry's SQLite file, the schedule's state, Ray's
session folder, every process's temporary files) lives in one temporary folder, removed at the end,
also after Ctrl-C or SIGTERM; one Ray session serves every step and is shut down in a ``finally``.
Only the report page stays (``runs/demo-report/`` under the working directory). Each step prints
one line; ``--verbose`` adds the commands' own lines and Ray's logs.

The MLflow registry is MLflow's SQLite store in that folder (what ``ctx models`` uses by default,
``jobs/registry.py``), not an ``mlflow server``: a server accepts only object-store URIs as version
sources, and the demo's checkpoints are local folders.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "bert-tiny.yaml"
FINETUNE_RECIPE = REPO / "configs" / "finetune" / "minilm-lexname.yaml"
SCHEDULE = REPO / "configs" / "schedule" / "tiny-lexname.yaml"  # its gates; the demo's paths and recipe replace the rest
LEXNAME = REPO / "data" / "tasks" / "lexname"
MODEL_NAME = "minilm-lexname"  # the registered model: the fine-tuning recipe's name
SERVED = "lexname"  # its name on the server
SENTENCES = ["we sat on the river bank and watched the water", "the bank approved the loan for the new house"]
GLOSSES = ["a small furry animal with long ears that lives in a burrow", "to move quickly on foot across a field"]


@dataclass(frozen=True)
class DemoSettings:
    """How big each step is. The defaults are `make demo`'s (5.2 minutes on a shared 2-core machine); the test
    runs every step with a few steps and rows."""

    steps: int = 300  # pretraining steps of the tiny BERT
    finetune_epochs: int = 3  # over train_rows; after 2, macro-F1 was still under the TF-IDF baseline's
    finetune_steps: int | None = None  # a cap on fine-tuning steps (tests)
    train_rows: int = 3600  # lexname training records fine-tuned on (a seeded draw); new_rows others land for the scheduled round
    new_rows: int = 400
    test_rows: int = 500  # lexname test records both the fine-tuned model and the baseline are scored on
    probes: int = 200  # texts the round measures the embedding space's drift on
    seed: int = 0  # which records go where
    port: int = 8000


def main(settings: DemoSettings = DemoSettings(), verbose: bool = False) -> int:
    """Run every step in one temporary folder and one Ray session; both are gone when it returns or
    raises (KeyboardInterrupt and the SystemExit of SIGTERM included)."""
    import ray

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="ctx-demo-"))
    saved_env = {k: os.environ.get(k) for k in ("TMPDIR", "MLFLOW_TRACKING_URI", "MLFLOW_LOGGING_LEVEL")}
    try:
        # Every process of the demo (this one, Ray's, the workers') writes its temporary files here.
        (work / "tmp").mkdir()
        os.environ["TMPDIR"] = str(work / "tmp")
        tempfile.tempdir = None  # read TMPDIR again
        # The registry every step uses, also Serve's models:/ lookup (it reads $MLFLOW_TRACKING_URI).
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
        print(f"ctx demo: the whole path on {os.cpu_count()} CPU(s); everything it makes goes to {work} (removed at the end)", flush=True)
        with _quiet_console(work / "native-stderr.log", verbose):
            try:
                _start_ray(work, verbose)
                _run(settings, work, verbose)
            finally:
                ray.shutdown()  # the raylet, GCS and workers this process started: training, serving, the round
        print(f"done in {(time.perf_counter() - started) / 60:.1f} min; Ray stopped, {work} removed; "
              "the report page stays: runs/demo-report/index.html", flush=True)
        return 0
    finally:
        ray_link = work / "ray"
        if ray_link.is_symlink():
            shutil.rmtree(ray_link.resolve(), ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        tempfile.tempdir = None


@contextlib.contextmanager
def _quiet_console(native_log: Path, verbose: bool):
    """The steps' own lines only on the console (``--verbose``: everything).

    * File descriptor 2 goes to ``native_log`` while Python's ``sys.stderr`` keeps the console: what
      C++ writes there (Ray's core worker: "core_worker.cc ... E ..." lines; the processes Ray starts
      inherit it) and the library log handlers made meanwhile, which write to the original stream.
      If a step fails, the file's last lines are shown with the error.
    * Ray's driver prints what the raylet pushes to it (worker-pool warnings, retried tasks) on stdout
      with a "(raylet)" prefix whatever ``log_to_driver`` says: ``listen_error_messages`` in
      ``ray._private.worker`` (Ray 2.60) calls that module's ``print_to_stdstream``, wrapped here to
      drop them.
    * Loggers: Ray's and Ray Serve's driver lines, MLflow's ("Creating initial MLflow database
      tables"), ours (the MiniLM folder's unused pretraining heads), up to warnings or errors."""
    if verbose:
        yield
        return
    import ray._private.worker as ray_worker

    os.environ["MLFLOW_LOGGING_LEVEL"] = "WARNING"
    levels = {name: logging.getLogger(name).level for name in ("ray", "ray.serve", "alembic", "mlflow", "ctxmodels", "jobs")}
    for name in levels:
        logging.getLogger(name).setLevel(logging.ERROR)
    shown = ray_worker.print_to_stdstream

    def without_raylet(data, ignore_prefix):
        if data.get("pid") != "raylet":
            shown(data, ignore_prefix)

    ray_worker.print_to_stdstream = without_raylet
    sys.stderr.flush()
    console_fd = os.dup(2)
    console = sys.stderr
    sys.stderr = open(console_fd, "w", buffering=1, encoding=console.encoding, errors="backslashreplace", closefd=True)
    with open(native_log, "ab", buffering=0) as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    except Exception:
        lines = native_log.read_text(errors="replace").splitlines()[-30:]
        if lines:
            print("ctx demo: the last lines Ray and the libraries wrote:\n  " + "\n  ".join(lines), file=sys.stderr, flush=True)
        raise
    finally:
        sys.stderr.flush()
        os.dup2(console_fd, 2)
        sys.stderr.close()
        sys.stderr = console
        ray_worker.print_to_stdstream = shown
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _start_ray(work: Path, verbose: bool) -> None:
    """One local Ray for every step, its session folder inside the demo's. Logical CPUs: the machine's,
    at least 3, so the fine-tuning worker (2 CPUs: its 2 torch threads) and Ray Data's reading task
    (1 CPU) are both placed on 2 cores."""
    import ray

    from jobs.session import exit_on_sigterm, quiet_ray_data

    quiet = {} if verbose else {"log_to_driver": False, "logging_level": "ERROR"}
    # --- Ray seam: the session every later step finds initialised (jobs.session.init_ray returns at once) ---
    ray.init(address="local", include_dashboard=False, num_cpus=max(3, os.cpu_count() or 1),
             object_store_memory=1 << 30, _temp_dir=str(_ray_folder(work)), **quiet)
    exit_on_sigterm()  # ray.init put its own SIGTERM handler in place: Python's again, so finally blocks run and the status is 143
    if not verbose:
        quiet_ray_data()


def _ray_folder(work: Path) -> Path:
    """Ray's session folder: inside the demo's, unless that path is too long for the Unix sockets Ray
    makes in it (107 bytes; "/session_<date>_<time>_<us>_<pid>/sockets/dash_MetricsHead" takes up
    to 68): then a link from the demo's folder to a short one under /tmp, removed with it."""
    inside = work / "ray"
    if len(str(inside)) + 68 <= 107 or not Path("/tmp").is_dir():
        return inside
    short = Path(tempfile.mkdtemp(prefix="ctx-demo-ray-", dir="/tmp"))
    inside.symlink_to(short)
    return short


def _run(s: DemoSettings, work: Path, verbose: bool) -> None:
    log = print if verbose else (lambda *_: None)
    progress = sys.stdout.isatty()  # a bar on a terminal; no line per step in a log or a pipe
    ckpt = _pretrain(s, work, verbose, progress, log)
    split = _lexname_splits(s, work)
    result = _finetune(s, work, split, verbose, progress, log)
    _compare(result, split, s)
    version = _register(result)
    _serve(s, ckpt, version, verbose)
    _scheduled_round(s, work, split, log)


# ---------------------------------------------------------------------------------------------
# 1-2. Pretraining


def evaluate_mlm(model, batches) -> float:
    """Masked-token accuracy of a pretraining model over prepared (masked) NumPy batches."""
    import torch

    correct = total = 0.0
    model.eval()
    with torch.inference_mode():
        for b in batches:
            inputs = {k: torch.as_tensor(v) for k, v in b.items() if k not in ("sample_id", "epoch")}
            out = model(**inputs)
            n = float(out.metrics["n_pred"])
            correct += float(out.metrics["mlm_acc"]) * n
            total += n
    return correct / max(total, 1.0)


def _pretrain(s: DemoSettings, work: Path, verbose: bool, progress: bool, log) -> Path:
    from ctxmodels.checkpoint import load_checkpoint
    from ctxmodels.registry import build_model
    from jobs.training.config import load_recipe, model_overrides_with_vocab
    from jobs.evaluation.report import write_report
    from jobs.training.train import pretrain, stream_spec
    from pipelines import storage
    from pipelines.dataset import local_batches
    from pipelines.tokenizers import load_tokenizer

    t0 = time.perf_counter()
    recipe = load_recipe(RECIPE, [f"train.max_steps={s.steps}", f"output_dir={work / 'runs'}",
                                  f"data.input={REPO / 'data/sample/wordnet-000[0-6]-of-0008.txt.gz'}",
                                  f"data.eval_input={REPO / 'data/sample/wordnet-0007-of-0008.txt.gz'}"])
    result = pretrain(recipe, verbose=verbose, progress=progress, log=log)
    ckpt = Path(result.checkpoint_uri)
    tok = load_tokenizer(ckpt / "tokenizer")
    print(f"1. tokenizer + pretraining: WordPiece ({tok.vocab_size:,} tokens) and {recipe.model.family}/{recipe.model.preset}, "
          f"{s.steps} steps on {recipe.scaling.num_workers} Ray Train workers in {time.perf_counter() - t0:.0f} s -> run {result.run_uri}"
          + (f", registry {result.registered.ref}" if result.registered else ""), flush=True)

    eval_spec = stream_spec(recipe, storage.Store.of(recipe.data).list_files(recipe.data.eval_input))
    batches = list(local_batches(eval_spec, tok, batch_size=32, epoch=10_000, max_batches=20))
    overrides = model_overrides_with_vocab(recipe, tok.vocab_size)
    overrides.setdefault("nsp", False)
    _, initial = build_model(recipe.model.family, recipe.model.preset, overrides, seed=recipe.train.seed)  # the trainers' initial weights
    before, after = evaluate_mlm(initial, batches), evaluate_mlm(load_checkpoint(ckpt).model, batches)
    report = write_report(result.run_uri, out_dir=Path("runs") / "demo-report")  # outlives the demo's folder
    masked = sum(int((b["labels"] != -100).sum()) for b in batches)
    print(f"2. held-out masked-token accuracy: {before:.1%} before, {after:.1%} after ({masked:,} masked tokens of the 8th shard); "
          f"report page {report}", flush=True)
    return ckpt


# ---------------------------------------------------------------------------------------------
# 3-5. Fine-tuning, the baseline, the registry


@dataclass(frozen=True)
class Splits:
    train: Path  # train_rows of lexname's training split
    new: list[dict[str, Any]]  # new_rows others: they land under the watch folder before the round
    test: Path  # test_rows of lexname's test split


def _lexname_splits(s: DemoSettings, work: Path) -> Splits:
    """lexname's records are sorted by id, which groups them by class: the demo's subsets are drawn
    in a seeded order instead. The round's new records have only classes of the training subset (a
    continued head cannot learn new ones)."""
    import numpy as np

    rng = np.random.default_rng(s.seed)
    train = (LEXNAME / "train.jsonl").read_text(encoding="utf-8").splitlines()
    test = (LEXNAME / "test.jsonl").read_text(encoding="utf-8").splitlines()
    if s.train_rows + s.new_rows > len(train) or s.test_rows > len(test):
        raise ValueError(f"train_rows + new_rows, test_rows: {s.train_rows} + {s.new_rows}, {s.test_rows} is more than lexname's "
                         f"{len(train)} training and {len(test)} test records")
    train = [train[i] for i in rng.permutation(len(train))]
    test = [test[i] for i in np.sort(rng.permutation(len(test))[: s.test_rows])]
    kept = train[: s.train_rows]
    known = {json.loads(line)["label"] for line in kept}
    new = [r for r in map(json.loads, train[s.train_rows :]) if r["label"] in known][: s.new_rows]
    folder = work / "lexname"
    folder.mkdir()
    (folder / "train.jsonl").write_text("\n".join(kept) + "\n", encoding="utf-8")
    (folder / "test.jsonl").write_text("\n".join(test) + "\n", encoding="utf-8")
    return Splits(folder / "train.jsonl", new, folder / "test.jsonl")


def _finetune_overrides(s: DemoSettings, epochs: int, lr: str) -> list[str]:
    """The shipped MiniLM lexname recipe at the demo's size. No validation split: the newest
    checkpoint is the model (the test split measures it). One worker with two torch threads trains
    faster on 2 cores than two workers with one each: 112 against 84 samples/s, bf16, measured on
    this 2-core machine (no gradient all-reduce of 22M parameters every step)."""
    from jobs.training.parallel import cpu_has_native_bf16

    out = [f"train.epochs={epochs}", f"train.lr={lr}", "data.validation=null", "train.patience=null",
           f"train.precision={'bf16' if cpu_has_native_bf16() else 'fp32'}", "scaling.num_workers=1", "scaling.cpus_per_worker=2"]
    if s.finetune_steps is not None:
        out.append(f"train.max_steps={s.finetune_steps}")
    return out


def _finetune(s: DemoSettings, work: Path, split: Splits, verbose: bool, progress: bool, log):
    from jobs.training.finetune import finetune
    from jobs.training.finetune_config import load_finetune_recipe

    t0 = time.perf_counter()
    recipe = load_finetune_recipe(FINETUNE_RECIPE, [
        *_finetune_overrides(s, s.finetune_epochs, "2e-4"), f"output_dir={work / 'runs'}", f"data.train={split.train}",
        f"data.test={split.test}"])
    result = finetune(recipe, verbose=verbose, progress=progress, log=log)
    t = recipe.train
    print(f"3. fine-tuning: all-MiniLM-L6-v2 ({recipe.model.init}) on lexname, {s.train_rows:,} records, "
          f"{result.metrics.get('step')} steps ({t.epochs} epoch(s), batch {t.batch_size}, {t.precision}) on 1 Ray Train worker "
          f"in {time.perf_counter() - t0:.0f} s -> run {result.run_uri}", flush=True)
    return result


def _baselines(train: Path, test: Path) -> dict[str, tuple[float, float]]:
    """(accuracy, macro-F1) of the majority class and of TF-IDF word 1-2 grams + logistic regression
    (benchmarks/baselines.py's, same settings), fitted on ``train``, on ``test``. Without
    scikit-learn (the dev extra), the majority class only."""
    import numpy as np

    rows = {name: [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] for name, path in (("train", train), ("test", test))}
    y_train, y_test = [r["label"] for r in rows["train"]], np.asarray([r["label"] for r in rows["test"]])
    majority = max(set(y_train), key=y_train.count)
    try:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression
        from sklearn.metrics import f1_score
    except ImportError:
        return {"majority class": (float(np.mean(y_test == majority)), float("nan"))}
    vec = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1)
    clf = LogisticRegression(C=10.0, max_iter=2000).fit(vec.fit_transform([r["sentence1"] for r in rows["train"]]), y_train)
    out = {}
    for name, pred in (("TF-IDF + logistic regression", clf.predict(vec.transform([r["sentence1"] for r in rows["test"]]))),
                       ("majority class", np.full(len(y_test), majority))):
        out[name] = (float(np.mean(pred == y_test)), float(f1_score(y_test, pred, average="macro", zero_division=0)))
    return out


def _compare(result, split: Splits, s: DemoSettings) -> None:
    m = result.test_metrics or {}
    shown = ", ".join(f"{k} {acc:.1%} (macro-F1 {f1:.1%})" for k, (acc, f1) in _baselines(split.train, split.test).items())
    print(f"4. held-out accuracy on {s.test_rows} lexname test records: fine-tuned {m.get('val_accuracy', float('nan')):.1%} "
          f"(macro-F1 {m.get('val_f1', float('nan')):.1%}) vs {shown}, fitted on the same {s.train_rows:,} records", flush=True)


def _register(result):
    """Promote the version the run registered (a ctx finetune run registers its checkpoint itself)."""
    from jobs.registry import Registry

    reg = Registry()
    v = result.registered
    if v is None:
        raise RuntimeError(f"the fine-tuning run {result.run_uri} registered no version")
    live = reg.promote(v.name, v.version, "production")
    print(f"5. registry: {v.ref} registered ({v.source}) and promoted: {v.name}@production -> {live.ref} (MLflow at {reg.uri})", flush=True)
    return live


# ---------------------------------------------------------------------------------------------
# 6. Serving


def _serve(s: DemoSettings, ckpt: Path, version, verbose: bool) -> None:
    import httpx
    import numpy as np

    from jobs.serving import serve

    if not verbose:  # Ray Serve gives its driver logger a level of its own
        logging.getLogger("ray.serve").setLevel(logging.ERROR)
    url = f"http://127.0.0.1:{s.port}"
    t0 = time.perf_counter()
    served = {"bert-tiny": str(ckpt), SERVED: f"models:/{version.name}@production"}
    serve.run(served, host="127.0.0.1", port=s.port, blocking=False, verbose=verbose)
    try:
        print(f"6. serving on {url} in {time.perf_counter() - t0:.0f} s: bert-tiny ({ckpt.name}) and {SERVED} "
              f"({served[SERVED]} = {version.ref})", flush=True)
        r = httpx.post(f"{url}/v1/token-embeddings", json={"model": "bert-tiny", "input": SENTENCES, "layers": "last"}, timeout=60)
        r.raise_for_status()
        vecs = []
        for sent, item in zip(SENTENCES, r.json()["data"]):
            i = next(i for i, (a, b) in enumerate(item["offsets"]) if sent[a:b] == "bank")
            vecs.append(np.asarray(item["embeddings"][i]))
        cos = float(vecs[0] @ vecs[1] / (np.linalg.norm(vecs[0]) * np.linalg.norm(vecs[1])))
        print(f"   bert-tiny /v1/token-embeddings: cosine of 'bank' in {SENTENCES[0]!r} and in {SENTENCES[1]!r} = {cos:.3f} "
              "(1.0 would be one static vector)", flush=True)
        r = httpx.post(f"{url}/v1/classify", json={"model": SERVED, "input": GLOSSES[0]}, timeout=60)
        r.raise_for_status()
        top = r.json()["data"][0]
        print(f"   {SERVED} /v1/classify {GLOSSES[0]!r} -> {top['label']} ({top['score']:.2f}); "
              f"X-Registry-Version: {r.headers.get(serve.REGISTRY_HEADER)}", flush=True)
        r = httpx.post(f"{url}/v1/embeddings", json={"model": SERVED, "input": GLOSSES}, timeout=60)
        r.raise_for_status()
        data = r.json()["data"]
        print(f"   {SERVED} /v1/embeddings {len(GLOSSES)} texts -> {len(data)} vectors of {len(data[0]['embedding'])} dims; "
              f"X-Registry-Version: {r.headers.get(serve.REGISTRY_HEADER)}", flush=True)
    finally:
        serve.shutdown()  # the app's replicas give their CPUs back to the round's training worker


# ---------------------------------------------------------------------------------------------
# 7. A scheduled round


def _scheduled_round(s: DemoSettings, work: Path, split: Splits, log) -> None:
    import yaml

    from jobs.operations.schedule import run_round
    from jobs.operations.schedule_config import validate

    spec = yaml.safe_load(SCHEDULE.read_text(encoding="utf-8"))
    spec.update({
        "name": "demo-lexname", "model": MODEL_NAME, "state_uri": str(work / "schedule"),
        "trigger": {"watch": str(work / "incoming") + "/"},
        "train": {"kind": "finetune", "recipe": str(FINETUNE_RECIPE), "output_dir": str(work / "rounds"),
                  "set": _finetune_overrides(s, 1, "5e-5")},
        "evaluate": {**spec["evaluate"], "held_out": str(split.test), "n_probes": min(s.probes, s.test_rows)},
    })
    cfg = validate(spec, where="ctx demo's schedule", base=REPO)
    landed = work / "incoming" / "lexname-0001.jsonl"  # a new shard of labelled records arrives
    landed.parent.mkdir()
    landed.write_text("".join(json.dumps(r) + "\n" for r in split.new), encoding="utf-8")
    t0 = time.perf_counter()
    record = run_round(cfg, "once", log=log)  # what `ctx schedule --config ... --once` runs
    took = time.perf_counter() - t0
    if record.get("status") == "failed":
        raise RuntimeError(f"the scheduled round failed: {record.get('reason')}\n{record.get('error', '')}")
    cand, prod = record["metrics"]["candidate"], record["metrics"]["production"]
    print(f"7. scheduled round ({SCHEDULE.relative_to(REPO)}'s gates, `ctx schedule --once`): {len(split.new)} records landed in "
          f"{landed}; {MODEL_NAME}@production (version {record['production']['version']}) continued on them in {took:.0f} s -> "
          f"candidate version {record['candidate']['version']}, run {record['run']}", flush=True)
    print("   on the same held-out records: " + ", ".join(
        f"{k} {cand[k]:.3f} (production {prod[k]:.3f})" for k in ("accuracy", "f1", "cka", "knn_overlap") if k in cand), flush=True)
    for g in record["gates"]:
        print(f"   gate {'passed' if g['passed'] else 'FAILED'}: {g['reason']}", flush=True)
    decision = (f"promoted: {MODEL_NAME}@production -> {MODEL_NAME}/{record['candidate']['version']}" if record["status"] == "promoted"
                else f"refused ({record['status']}): {MODEL_NAME}@production stays {MODEL_NAME}/{record['production']['version']}")
    print(f"   decision: {decision}", flush=True)
