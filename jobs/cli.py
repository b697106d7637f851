"""The ``ctx`` command line. Every command is a line in ``COMMANDS``.

    ctx tokenizer train --kind wordpiece --input data/sample --vocab-size 8000 --output runs/tok
    ctx pretrain --config configs/bert-tiny.yaml --set train.max_steps=50
    ctx finetune --config configs/finetune/minilm-pairs.yaml --set train.epochs=1
    ctx serve --model bert=runs/bert-tiny --model minilm=/path/to/hf-folder
    ctx serve --config serve.yaml
    ctx serve build --config serve.yaml -o deploy.yaml   # for `serve deploy deploy.yaml`
    ctx submit --address http://127.0.0.1:8265 -- pretrain --config configs/bert-tiny.yaml
    ctx jobs list | status ID | logs ID [--follow] | stop ID      (--address or RAY_ADDRESS)
    ctx demo
    ctx report runs/bert-tiny
    ctx export --model runs/minilm-pairs --format hf --output exported/minilm-pairs
    ctx schedule --config configs/schedule/bert-tiny.yaml [--once]   # scheduled retraining with a gate
    ctx schedule status --config configs/schedule/bert-tiny.yaml
    ctx embed --model runs/minilm-pairs --input s3://index/texts/ --output s3://index/vectors/minilm-v2/
    ctx models list | show NAME[@alias|/N] | promote NAME N --alias production | rollback NAME
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REGISTRATION_FAILED = 3  # exit status of a run that trained and kept its checkpoint but was not registered


class CommandError(Exception):
    """A command's refusal of what it was given (a missing flag, a split it cannot score): ``main``
    prints it as every user error, ``ctx: error: ...``, and exits with 2."""


def _quiet_env(verbose: bool) -> None:
    if not verbose:
        os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
        os.environ.setdefault("RAY_DEDUP_LOGS", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        # MLflow's INFO lines ("Creating initial MLflow database tables...", the first time a registry
        # is used): read when mlflow is first imported, so set before any command imports it
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
        from jobs.operations.submit import QUIET_RAY_ENV

        for name, value in QUIET_RAY_ENV.items():  # a local Ray's processes inherit them
            os.environ.setdefault(name, value)
        import logging

        logging.getLogger("ray").setLevel(logging.ERROR)


def _exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143): `finally` blocks run and the run lock is released
    (``jobs.session.exit_on_sigterm``, which ``init_ray`` calls again after ``ray.init``)."""
    from jobs.session import exit_on_sigterm

    exit_on_sigterm()


def _interrupted(command: str) -> int:
    """Ctrl-C: one line and the shell's status for SIGINT, no traceback. By the time the
    KeyboardInterrupt reaches a command, `finally` blocks have released the run lock and removed
    temporary folders."""
    print(f"ctx {command}: interrupted", file=sys.stderr)
    return 130


def _store(args: argparse.Namespace):
    """The Store of a command without a recipe: --endpoint-url and --retry-deadline."""
    from pipelines.storage import Store

    return Store(args.endpoint_url, args.retry_deadline, "--retry-deadline")


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, got {text}")
    return value


def _add_retry_deadline(p: argparse.ArgumentParser) -> None:
    """--retry-deadline: a recipe's data.retry_deadline_s, for commands without a recipe."""
    from pipelines.storage import DEFAULT_RETRY_DEADLINE_S

    p.add_argument("--retry-deadline", type=_seconds, default=DEFAULT_RETRY_DEADLINE_S, metavar="SECONDS",
                   help=f"how long one object-store call retries through an outage before the command fails (default {DEFAULT_RETRY_DEADLINE_S:g})")


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from pipelines import storage
    from pipelines.sources import sample_text
    from pipelines.tokenizers import train_tokenizer

    _exit_on_sigterm()
    store = _store(args)
    try:
        shards = store.list_files(args.input, storage.corpus_suffixes(args.format))
        texts = sample_text(shards, args.sample_chars, args.format, args.text_field, store)
        tok = train_tokenizer(args.kind, texts, args.vocab_size, lowercase=not args.cased)
        with tempfile.TemporaryDirectory() as d:
            tok.save(d)
            store.copy_dir(d, args.output)
    except KeyboardInterrupt:
        return _interrupted("tokenizer train")
    print(f"{args.kind} tokenizer with {tok.vocab_size} tokens from {len(shards)} shard(s) -> {args.output}")
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    from jobs.training.config import load_recipe

    recipe = load_recipe(args.config, args.set)  # fails before Ray starts
    return _pretrain_run(args, recipe, "pretrain", ("step", "loss", "mlm_acc", "lm_acc", "ppl", "tokens_per_s"))


def _pretrain_run(args: argparse.Namespace, recipe, command: str, shown: tuple[str, ...]):
    """``ctx pretrain`` and ``ctx distill``: run the recipe; the result's ``shown`` metrics, or the
    exit status of a failed registration or an interruption."""
    from jobs.training.tracking import RegistrationError
    from jobs.training.train import pretrain

    _quiet_env(args.verbose)
    _exit_on_sigterm()
    try:
        result = pretrain(recipe, verbose=args.verbose, progress=not args.no_progress)
    except RegistrationError as e:  # trained and checkpointed, not registered: say so, and not with 0
        print(f"ctx {command}: {e}", file=sys.stderr)
        return REGISTRATION_FAILED
    except KeyboardInterrupt:
        return _interrupted(command)
    print(f"done: {({k: round(v, 4) if isinstance(v, float) else v for k, v in result.metrics.items() if k in shown})}")
    if command == "distill":
        print(f"student: {result.checkpoint_uri}")
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    """``ctx pretrain`` with a ``teacher`` section: the student (the teacher's family, fewer layers)
    learns from the teacher on the recipe's corpus (ctxmodels/distill.py)."""
    from jobs.training.config import RecipeError, load_recipe

    recipe = load_recipe(args.config, args.set)  # fails before Ray starts
    if recipe.teacher is None:
        raise RecipeError(f"{args.config}: ctx distill needs a teacher section (teacher.init: the model to distil); "
                          "without one, run ctx pretrain")
    return _pretrain_run(args, recipe, "distill", ("step", "loss", "cos_loss", "sentence_cos", "eval_sentence_cos",
                                                   "mlm_acc", "tokens_per_s"))


def _serve_config(args: argparse.Namespace):
    """The ServeConfig from --config and/or the flags (flags win); errors name the file and key."""
    from jobs.serving import serve_config as sc

    def pairs(flag: str, items: list[str]) -> dict[str, str]:
        out = {}
        for item in items or []:
            if "=" not in item:
                raise CommandError(f"{flag} {item!r}: expected NAME=URI")
            name, uri = item.split("=", 1)
            out[name] = uri
        return out

    models, multiplexed = pairs("--model", args.model), pairs("--multiplexed", args.multiplexed)
    flags = {k: getattr(args, k) for k in ("host", "port") if getattr(args, k) is not None}
    defaults = {k: getattr(args, k) for k in ("num_replicas", "max_batch_size", "num_cpus", "num_gpus") if getattr(args, k) is not None}
    if models:
        flags["models"] = models
    if multiplexed:  # added to a config's multiplexed.models, with its settings
        flags["multiplexed"] = {"models": multiplexed}
    if defaults:
        flags["defaults"] = defaults
    keys = sc.read_api_keys(args.api_key_file) if args.api_key_file or os.environ.get(sc.API_KEYS_ENV) else []
    auth = {}
    if keys:
        auth["api_key_sha256"] = [sc.hash_api_key(k) for k in keys]
    if args.insecure_no_auth:
        auth["insecure_no_auth"] = True
    if auth:
        flags["auth"] = auth
    if args.config:
        return sc.load_config(args.config, flags)
    if not models and not multiplexed:
        raise CommandError("give --model NAME=URI or --multiplexed NAME=URI (repeatable), or --config serve.yaml")
    return sc.validate(flags, where="ctx serve")


def cmd_finetune(args: argparse.Namespace) -> int:
    from jobs.training.finetune import finetune
    from jobs.training.finetune_config import load_finetune_recipe
    from jobs.training.tracking import RegistrationError

    recipe = load_finetune_recipe(args.config, args.set)  # fails before Ray starts
    _quiet_env(args.verbose)
    _exit_on_sigterm()
    try:
        result = finetune(recipe, verbose=args.verbose, progress=not args.no_progress)
    except RegistrationError as e:  # trained and checkpointed, not registered: say so, and not with 0
        print(f"ctx finetune: {e}", file=sys.stderr)
        return REGISTRATION_FAILED
    except KeyboardInterrupt:
        return _interrupted("finetune")
    m = result.metrics
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in m.items() if k in ("step", "loss") or k.startswith("val_")}
    print(f"done: {shown}")
    print(f"best checkpoint: {result.best_checkpoint or result.checkpoint_uri}" + (f" {result.best}" if result.best else ""))
    if result.test_metrics is not None:
        print(f"test: {result.test_metrics}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    _quiet_env(args.verbose)
    _exit_on_sigterm()
    try:
        return _run_eval(args)
    except ValueError as e:  # a model or split that cannot be scored: say why, no traceback
        raise CommandError(str(e)) from None
    except KeyboardInterrupt:
        return _interrupted("eval")


def _run_eval(args: argparse.Namespace) -> int:
    if args.suite == "wic":
        from jobs.evaluation.wic import DEFAULT_DATA, evaluate_wic, write_output

        if args.language is not None:
            raise CommandError("--language is for a fine-tuned XLM's split, not the word-in-context test")
        if args.task is not None:
            raise CommandError("--task is for scoring a split, not the word-in-context test")
        if args.split != "test" or args.query_prompt is not None or args.document_prompt is not None:
            raise CommandError("--split, --query-prompt and --document-prompt are for `ctx eval retrieval`")
        print(write_output(evaluate_wic(args.model, args.data or DEFAULT_DATA, store=_store(args)), args.output))
        return 0
    from jobs.evaluation.evaluate import evaluate, write_result

    if args.suite == "retrieval":
        from jobs.evaluation.retrieval import evaluate_retrieval

        if not args.data:
            raise CommandError("--data is required: a BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv), local or s3://")
        if args.task is not None or args.language is not None:
            raise CommandError("--task and --language are for scoring a split, not a retrieval benchmark")
        print(write_result(evaluate_retrieval(args.model, args.data, args.split, _store(args), query_prompt=args.query_prompt,
                                              document_prompt=args.document_prompt), args.output))
        return 0
    if args.split != "test" or args.query_prompt is not None or args.document_prompt is not None:
        raise CommandError("--split, --query-prompt and --document-prompt are for `ctx eval retrieval`")
    if not args.data:
        raise CommandError("--data is required (a split: JSONL, CSV/TSV, Parquet or SQuAD JSON)")
    print(write_result(evaluate(args.model, args.data, _store(args), _language(args.language), args.task), args.output))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from jobs.serving import serve

    config = _serve_config(args)
    _quiet_env(args.verbose)
    serve.run(config, blocking=True, verbose=args.verbose, address=args.address)
    return 0


def cmd_serve_build(args: argparse.Namespace) -> int:
    import yaml

    from jobs.serving.serve_config import deploy_config

    config = _serve_config(args)
    text = yaml.safe_dump(deploy_config(config), sort_keys=False)
    if args.output in (None, "-"):
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.output}: `serve deploy {args.output}` deploys it (the cluster needs this repository on its PYTHONPATH)")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from jobs.operations.submit import submit

    rest = list(args.ctx_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        raise CommandError("give the ctx command to run after --, e.g. -- pretrain --config configs/bert-tiny.yaml")
    return submit(args.address, rest, follow=not args.no_follow, python=args.python, new=args.new)


def cmd_jobs(args: argparse.Namespace) -> int:
    """`ctx jobs list|status|logs|stop`: one Jobs API client, one function of jobs/operations/submit.py each."""
    from jobs.operations import submit as js

    client = js.connect(args.address)
    if args.subcommand == "list":
        return js.list_jobs(client, sys.stdout)
    if args.subcommand == "status":
        return js.job_status(client, args.id, sys.stdout)
    if args.subcommand == "logs":
        return js.job_logs(client, args.id, sys.stdout, follow=args.follow)
    return js.stop_job(client, args.id, sys.stdout)


def _language(value: str | None) -> int | str | None:
    """``--language``: a row number or a name."""
    return int(value) if value is not None and value.isdigit() else value


def cmd_embed(args: argparse.Namespace) -> int:
    import time

    started = time.perf_counter()  # the summary's seconds: wall time from here, Ray's start included
    import json

    import ray

    from jobs.serving.embed import reembed

    _quiet_env(args.verbose)
    try:
        summary = reembed(args.model, args.input, args.output, id_column=args.id_column, text_column=args.text_column,
                          pooling=args.pooling, normalize=args.normalize, store=_store(args),
                          batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens, actor_batch_size=args.actor_batch_size,
                          actors=args.actors, cpus_per_actor=args.cpus_per_actor, num_gpus=args.num_gpus,
                          verbose=args.verbose, started=started, engine=args.engine, dtype=args.dtype,
                          cuda_graphs=args.cuda_graphs, language=_language(args.language), dimensions=args.dimensions,
                          prompt_name=args.prompt_name, prompt=args.prompt, resume=args.resume,
                          progress=not args.no_progress, precision=args.precision, calibration_rows=args.calibration_rows)
        print(json.dumps(summary), flush=True)
    except (FileExistsError, ValueError) as e:  # an output that holds vectors, a missing column: say why, no traceback
        raise CommandError(str(e)) from None
    finally:
        ray.shutdown()  # a local Ray this command started; a cluster's driver just disconnects
    return 0


def cmd_mine_negatives(args: argparse.Namespace) -> int:
    import json

    from jobs.serving.local import LocalModel
    from jobs.session import init_ray
    from jobs.training.mining import mine_hard_negatives
    from pipelines import finetune_stream as fs
    from pipelines.negatives import MiningConfig

    _quiet_env(args.verbose)
    store = _store(args)
    try:
        cfg = MiningConfig(num_negatives=args.num_negatives, range_min=args.range_min, range_max=args.range_max,
                           absolute_margin=args.absolute_margin, relative_margin=args.relative_margin, max_score=args.max_score,
                           min_score=args.min_score, sampling=args.sampling, seed=args.seed)
        init_ray(args.verbose)

        def records(split: str) -> list[dict]:
            parsed, _ = fs.parse_records(fs.read_split(split, "auto", store).column("_json").to_pylist())
            return [r for r in parsed if r is not None]  # a line that is no JSON object is not a record

        corpus = None
        if args.corpus:
            corpus = [r[args.corpus_field] for r in records(args.corpus) if isinstance(r.get(args.corpus_field), str) and r[args.corpus_field].strip()]
        with LocalModel(args.model) as model:
            out, report = mine_hard_negatives(records(args.data), model, cfg, anchor_field=args.anchor_field,
                                              positive_field=args.positive_field, negative_field=args.negative_field, corpus=corpus)
    except ValueError as e:  # a bad setting, a field no record has, no usable record: say why, no traceback
        raise CommandError(str(e)) from None
    store.write_bytes(args.output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out).encode())
    print(json.dumps({"output": args.output, **report}))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from jobs.operations.demo import DemoSettings, main as demo_main

    settings = DemoSettings(steps=args.steps, finetune_epochs=args.finetune_epochs, finetune_steps=args.finetune_steps,
                            train_rows=args.train_rows, new_rows=args.new_rows, test_rows=args.test_rows, probes=args.probes,
                            port=args.port)
    _quiet_env(args.verbose)
    _exit_on_sigterm()
    try:
        return demo_main(settings, verbose=args.verbose)
    except KeyboardInterrupt:  # the demo's temporary folder is gone and its Ray stopped by now
        return _interrupted("demo")


def cmd_report(args: argparse.Namespace) -> int:
    from jobs.evaluation.report import write_report

    _exit_on_sigterm()
    try:
        print(write_report(args.run_uri, out_dir=args.out, store=_store(args)))
    except KeyboardInterrupt:
        return _interrupted("report")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    _exit_on_sigterm()
    try:
        return _run_export(args)
    except KeyboardInterrupt:
        return _interrupted("export")


def _run_export(args: argparse.Namespace) -> int:
    from ctxmodels.checkpoint import load_checkpoint
    from ctxmodels.hf import export_distilbert_folder, export_hf_folder
    from jobs.runs import checkpoint_languages, local_copy, resolve_checkpoint
    from pipelines import storage
    from pipelines.tokenizers import load_tokenizer

    store = _store(args)
    checkpoint = resolve_checkpoint(args.model, store)  # a run folder: its best checkpoint
    with tempfile.TemporaryDirectory(prefix="ctx-export-") as work:
        local = local_copy(checkpoint, Path(work) / "in", store)
        loaded = load_checkpoint(local)
        pad_id = None  # GPT's HF sequence heads find the last token by the padding id
        tok = None
        if loaded.tokenizer_dir is not None:
            try:
                tok = load_tokenizer(loaded.tokenizer_dir)
                pad_id = tok.pad_id
            except (OSError, ValueError):
                pad_id = None  # a tokenizer we cannot read is still copied; GPT heads then say what is missing
        out = Path(work) / "out" if storage.is_remote(args.output) else Path(args.output)
        try:
            if args.format == "hf":
                export_hf_folder(loaded.model, loaded.family, out, loaded.tokenizer_dir, pad_id, checkpoint_languages(local))
            elif args.format == "distilbert":
                if loaded.family != "bert" or loaded.task is not None:
                    raise ValueError(f"--format distilbert takes a bert pretraining model, not a {loaded.family} "
                                     + ("task model" if loaded.task is not None else "model"))
                export_distilbert_folder(loaded.model, out, loaded.tokenizer_dir)
            else:
                pooling = _export_sentence_transformers(loaded, local, out, pad_id, args.pooling, args.normalize)
        except ValueError as e:  # a head transformers lacks: say which, no traceback
            raise CommandError(f"{checkpoint}: {e}") from None
        if tok is not None and tok.kind.startswith("sentencepiece") and not (out / "tokenizer.json").exists():
            tok.save(out)  # a checkpoint from before SentencePiece folders held the tokenizer.json transformers reads
        if storage.is_remote(args.output):
            store.copy_dir(out, args.output)
    what = f"{loaded.task.kind} model" if loaded.task is not None else "pretraining model"
    where = {"hf": "Hugging Face folder", "distilbert": "Hugging Face folder, DistilBertForMaskedLM"}.get(
        args.format) or f"sentence-transformers folder, {pooling} pooling"
    print(f"{loaded.family} {what} from {checkpoint} -> {args.output} ({where})")
    return 0


def _export_sentence_transformers(loaded, source: Path, out: Path, pad_id: int | None, pooling: str | None,
                                  normalize: bool | None) -> str:
    """The backbone and the server's pooling as a folder sentence-transformers loads (ctxmodels.sbert);
    returns the pooling. What is not given is what ``ctx serve`` gives for ``source`` unasked: a
    sentence-transformers folder's own pooling, Normalize module, max_seq_length and prompts (an
    embedding checkpoint's: those it was fine-tuned with), else mean pooling, not normalised, the
    model's positions."""
    from ctxmodels.sbert import checkpoint_sentence_settings, export_sentence_transformers_folder, sentence_defaults

    if loaded.tokenizer_dir is None:
        raise ValueError("the checkpoint has no tokenizer files; sentence-transformers needs them")
    own = checkpoint_sentence_settings(source, loaded.task)
    max_len = getattr(loaded.config, "max_tokens", None) or getattr(loaded.config, "max_seq_len", None) or 512
    pooling, normalize, max_len = sentence_defaults(own, pooling, normalize, int(max_len))
    export_sentence_transformers_folder(loaded.model, loaded.family, out, loaded.tokenizer_dir, dim=int(loaded.config.d_model),
                                        max_seq_length=max_len, pooling=pooling, normalize=normalize,
                                        pad_token_id=pad_id, prompts=own.prompts if own is not None else None,
                                        default_prompt_name=own.default_prompt_name if own is not None else None)
    return pooling


def _schedule(args: argparse.Namespace):
    from jobs.operations.schedule_config import load_schedule

    if not args.config:
        raise CommandError("--config schedule.yaml is required, e.g. configs/schedule/bert-tiny.yaml")
    return load_schedule(args.config)  # fails before Ray starts, naming the key


def cmd_schedule(args: argparse.Namespace) -> int:
    from jobs.operations import schedule

    cfg = _schedule(args)
    _quiet_env(args.verbose)
    if args.once:  # one round here and now (a Kubernetes CronJob's command)
        record = schedule.run_round(cfg, "once")
        print(f"round {record.get('round', '-')}: {record['status']}: {record.get('reason', '')}")
        return 1 if record["status"] == "failed" else 0
    schedule.start(cfg, args.address)
    print(f"scheduler {cfg.actor_name} runs on the cluster (namespace {cfg.namespace}, detached: it outlives this command); "
          f"`ctx schedule status --config {args.config}` shows its rounds, `ctx schedule stop --config {args.config}` stops it")
    return 0


def cmd_schedule_status(args: argparse.Namespace) -> int:
    import json

    from jobs.operations import schedule

    cfg = _schedule(args)
    _quiet_env(args.verbose)
    out = schedule.status(cfg, args.address, with_actor=not args.no_actor)
    print(json.dumps(out, indent=2) if args.json else schedule.format_status(out))
    return 0


def cmd_schedule_stop(args: argparse.Namespace) -> int:
    from jobs.operations import schedule

    cfg = _schedule(args)
    _quiet_env(args.verbose)
    stopped = schedule.stop(cfg, args.address)
    print(f"scheduler {cfg.actor_name}: {'stopped' if stopped else 'was not running'}")
    return 0


def _add_schedule(p: argparse.ArgumentParser) -> None:
    # not required=True: `ctx schedule status --config ...` gives it to the subcommand, not to `ctx schedule`
    p.add_argument("--config", default=None, help="schedule YAML, e.g. configs/schedule/bert-tiny.yaml (every key: jobs/operations/schedule_config.py)")
    p.add_argument("--address", default=None, help="Ray cluster (default: RAY_ADDRESS, else a running `ray start` on this machine)")


def _add_schedule_run(p: argparse.ArgumentParser) -> None:
    _add_schedule(p)
    p.add_argument("--once", action="store_true", help="run one round now in this process instead of starting the scheduler")


def _add_schedule_status(p: argparse.ArgumentParser) -> None:
    _add_schedule(p)
    p.add_argument("--json", action="store_true", help="the history as JSON")
    p.add_argument("--no-actor", action="store_true", help="only the history from state_uri; do not ask the cluster")


def _registry(args: argparse.Namespace):
    from jobs.registry import Registry

    _quiet_env(args.verbose)  # MLflow's own lines off unless --verbose
    return Registry(args.tracking_uri)


def _version_line(v) -> str:
    t = v.tags
    what = " ".join(x for x in (t.get("ctx.family"), t.get("ctx.task") or t.get("ctx.kind")) if x)
    metrics = json.loads(t["ctx.metrics"]) if t.get("ctx.metrics", "").startswith("{") else {}
    shown = ", ".join(f"{k}={v:.4g}" for k, v in list(metrics.items())[:4])
    aliases = f" [{', '.join(v.aliases)}]" if v.aliases else ""
    parent = f" parent {t['ctx.parent']}" if t.get("ctx.parent") else ""
    data = ""
    if t.get("ctx.shards", "")[:1] in ("[", "{"):
        shards = json.loads(t["ctx.shards"])  # a list, or {count, bytes, ...} when there were many
        count, size = (len(shards), sum(s.get("size") or 0 for s in shards)) if isinstance(shards, list) else (shards["count"], shards["bytes"])
        data = f", {count} shard(s) {size:,} bytes"
    return f"{v.ref}{aliases} {what or '-'} tokenizer {t.get('ctx.tokenizer_hash', '-')}{parent} {shown}{data}\n    {v.source}"


def cmd_models_list(args: argparse.Namespace) -> int:
    reg = _registry(args)
    names = reg.models()
    if not names:
        print(f"no models in {reg.uri}")
    for name in names:
        versions = reg.versions(name)
        aliases = ", ".join(f"{a} -> {v.version}" for v in versions for a in v.aliases)
        print(f"{name}: {len(versions)} version(s), latest {versions[-1].version if versions else '-'}" + (f"; {aliases}" if aliases else ""))
    return 0


def cmd_models_show(args: argparse.Namespace) -> int:
    from jobs.registry import describe

    reg = _registry(args)
    if "@" in args.ref or "/" in args.ref.removeprefix("models:/"):  # one version, every tag
        print(json.dumps(describe(reg.get(args.ref)), indent=1))
        return 0
    name = args.ref.removeprefix("models:/")
    for v in reg.versions(name):
        print(_version_line(v))
    history = reg.history(name)
    if history:
        print("promotions (oldest first):")
    for e in history:
        import datetime

        when = datetime.datetime.fromtimestamp(e.at_ms / 1000, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        what = f"promote {name}/{e.version}" if e.op == "promote" else f"rollback (from {name}/{e.version})"
        print(f"  {e.seq}. {when} {e.alias}: {what}{'' if e.effective else ' (no change)'} by {e.by}")
    return 0


def cmd_models_promote(args: argparse.Namespace) -> int:
    v = _registry(args).promote(args.name, args.version, args.alias)
    print(f"{args.name}@{args.alias} -> {v.ref} ({v.source})")
    return 0


def cmd_models_rollback(args: argparse.Namespace) -> int:
    v = _registry(args).rollback(args.name, args.alias)
    print(f"{args.name}@{args.alias} -> {v.ref} ({v.source})")
    return 0


def cmd_models_register(args: argparse.Namespace) -> int:
    """A checkpoint registered by hand (e.g. after a run whose registration failed): source and tokenizer hash."""
    from jobs.training.tracking import checkpoint_tokenizer_hash

    _exit_on_sigterm()
    reg = _registry(args)
    tags = {"ctx.registered_by": "ctx models register"}
    try:
        tok = checkpoint_tokenizer_hash(args.checkpoint, _store(args))
    except KeyboardInterrupt:
        return _interrupted("models register")
    if tok:
        tags["ctx.tokenizer_hash"] = tok
    for item in args.tag:
        key, sep, value = item.partition("=")
        if not sep:
            raise CommandError(f"--tag {item!r}: expected KEY=VALUE")
        tags[key] = value
    parent = reg.get(args.parent) if args.parent else None
    v = reg.register(args.name, args.checkpoint, tags=tags, parent=parent)
    print(f"{v.ref} <- {v.source}")
    return 0


def _add_tracking(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking/registry URI (default: $MLFLOW_TRACKING_URI, else sqlite:///~/.ctxmodels/mlflow.db)")


def _add_models_show(p: argparse.ArgumentParser) -> None:
    _add_tracking(p)
    p.add_argument("ref", metavar="NAME[@ALIAS|/VERSION]", help="a model (its versions and promotions) or one version (all its tags)")


def _add_models_promote(p: argparse.ArgumentParser) -> None:
    _add_tracking(p)
    p.add_argument("name")
    p.add_argument("version", type=int)
    p.add_argument("--alias", default="production", help="production (default), candidate, ...")


def _add_models_rollback(p: argparse.ArgumentParser) -> None:
    _add_tracking(p)
    p.add_argument("name")
    p.add_argument("--alias", default="production", help="the alias to move back to the version it named before")


def _add_models_register(p: argparse.ArgumentParser) -> None:
    _add_tracking(p)
    p.add_argument("name")
    p.add_argument("checkpoint", help="checkpoint folder URI (local or s3://); registered as it is, not copied")
    p.add_argument("--parent", default=None, help="NAME@ALIAS or NAME/VERSION it was trained from")
    p.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (default: AWS_ENDPOINT_URL)")
    _add_retry_deadline(p)


def _add_pretrain(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="recipe YAML, e.g. configs/bert-tiny.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any recipe key, e.g. train.lr=3e-4")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")


def _add_tokenizer_train(p: argparse.ArgumentParser) -> None:
    # pipelines.tokenizers.TrainKind (spelled out: building the parser imports no tokenizer library)
    p.add_argument("--kind", required=True, choices=["wordpiece", "sentencepiece-unigram", "sentencepiece-bpe", "byte-level-bpe"])
    p.add_argument("--input", required=True, nargs="+", help="folder/prefix URI, glob or files (local, file://, s3://)")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output", required=True, help="folder URI for the tokenizer files")
    p.add_argument("--sample-chars", type=int, default=20_000_000, help="characters of corpus to train on")
    p.add_argument("--format", default="auto", choices=["auto", "text", "jsonl", "parquet"])
    p.add_argument("--text-field", default="text")
    p.add_argument("--cased", action="store_true", help="keep case (default: lowercase)")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (default: AWS_ENDPOINT_URL)")
    _add_retry_deadline(p)


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="serve.yaml: models, replicas, autoscaling, batching, limits, auth (see jobs/serving/serve_config.py)")
    p.add_argument("--model", action="append", default=[], metavar="NAME=URI", help="checkpoint, HF or run folder (local or s3://); repeatable")
    p.add_argument("--multiplexed", action="append", default=[], metavar="NAME=URI",
                   help="a model loaded on its first request by the shared multiplexed deployment (Ray Serve model multiplexing); repeatable")
    p.add_argument("--host", default=None, help="default 127.0.0.1; any other host needs API keys or --insecure-no-auth")
    p.add_argument("--port", type=int, default=None, help="default 8000")
    p.add_argument("--num-replicas", type=int, default=None, help="replicas per model (default 1)")
    p.add_argument("--max-batch-size", type=int, default=None, help="texts batched into one forward pass (default 32)")
    p.add_argument("--num-cpus", type=float, default=None, help="CPUs per replica (default 1)")
    p.add_argument("--num-gpus", type=float, default=None, help="GPUs per replica (default 0)")
    p.add_argument("--api-key-file", default=None, help=f"accepted API keys, one a line (default: ${'{'}CTX_API_KEYS{'}'}, comma-separated)")
    p.add_argument("--insecure-no-auth", action="store_true", help="serve a non-loopback host without API keys")


def _add_serve_run(p: argparse.ArgumentParser) -> None:
    _add_serve(p)
    p.add_argument("--address", default=None, help="Ray cluster to join; 'local' starts a private one (default: RAY_ADDRESS, a running `ray start`, else a new local one)")


def _add_serve_build(p: argparse.ArgumentParser) -> None:
    _add_serve(p)
    p.add_argument("-o", "--output", default=None, help="where to write Serve's config (default: stdout)")


_ADDRESS_HELP = "Ray dashboard URL, e.g. http://127.0.0.1:8265 (default: RAY_ADDRESS; the two must agree when both are set)"


def _add_submit(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help=_ADDRESS_HELP)
    p.add_argument("--python", default="python", help="interpreter on the cluster")
    p.add_argument("--no-follow", action="store_true", help="submit (or find the same run) and return without following logs")
    p.add_argument("--new", action="store_true", help="start another run even if this exact one was submitted before (id <id>-rN)")
    p.add_argument("ctx_args", nargs=argparse.REMAINDER, help="-- then the ctx command to run on the cluster")


def _add_jobs_list(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help=_ADDRESS_HELP)


def _add_jobs_id(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", help="the submission id ctx submit printed (ctx jobs list shows them)")
    p.add_argument("--address", default=None, help=_ADDRESS_HELP)


def _add_jobs_logs(p: argparse.ArgumentParser) -> None:
    _add_jobs_id(p)
    p.add_argument("--follow", action="store_true", help="until the job ends; the exit code is then the job's (0 succeeded, 1 failed, 3 stopped)")


def _add_demo(p: argparse.ArgumentParser) -> None:
    from jobs.operations.demo import DemoSettings

    d = DemoSettings()
    p.add_argument("--steps", type=int, default=d.steps, help="pretraining steps of the tiny BERT (default %(default)s)")
    p.add_argument("--finetune-epochs", type=int, default=d.finetune_epochs, help="MiniLM's epochs on lexname (default %(default)s)")
    p.add_argument("--finetune-steps", type=int, default=None, help="a cap on MiniLM's fine-tuning steps")
    p.add_argument("--train-rows", type=int, default=d.train_rows, help="lexname training records fine-tuned on (default %(default)s)")
    p.add_argument("--new-rows", type=int, default=d.new_rows,
                   help="other training records (of classes among those), landing as the scheduled round's new shard (default %(default)s)")
    p.add_argument("--test-rows", type=int, default=d.test_rows, help="lexname test records scored (default %(default)s)")
    p.add_argument("--probes", type=int, default=d.probes, help="texts the round measures the embedding space's drift on (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port)


def _add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", nargs="?", choices=["wic", "retrieval"],
                   help="wic: the word-in-context test on a model's contextual vectors; retrieval: any model's sentence "
                        "vectors on a BEIR-layout benchmark (corpus.jsonl, queries.jsonl, qrels/<split>.tsv), as MTEB scores them")
    p.add_argument("--model", required=True, help="fine-tuned checkpoint or run folder (its best checkpoint); for wic and retrieval any model")
    p.add_argument("--data", default=None, help="the split to score (wic: the folder with validation.jsonl and test.jsonl; default: the shipped data/tasks/wic)")
    p.add_argument("--output", default=None, help="write the JSON here, and an HTML page beside it")
    p.add_argument("--split", default="test", help="retrieval: the judgements to score, qrels/<split>.tsv (default test)")
    p.add_argument("--query-prompt", default=None,
                   help="retrieval: text before each query instead of the model folder's query prompt (E5: 'query: ')")
    p.add_argument("--document-prompt", default=None,
                   help="retrieval: text before each document instead of the folder's document prompt (E5: 'passage: ')")
    p.add_argument("--task", default=None, choices=["embedding"],
                   help="embedding: score any model (pretrained, HF or sentence-transformers folder) as ctx serve embeds "
                        "with it, on retrieval records (anchor, positive, negatives) or on pairs scored for similarity "
                        "(sentence1, sentence2, score: spearman_cosine): the baseline before fine-tuning")
    p.add_argument("--language", default=None,
                   help="a fine-tuned multilingual XLM: read the split's texts as this language, a name of the model's "
                        "languages or a row number (default: the language it was fine-tuned on; XLM's cross-lingual transfer)")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (default: AWS_ENDPOINT_URL)")
    _add_retry_deadline(p)


def _add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint or run folder (its best checkpoint), local or s3://")
    p.add_argument("--format", required=True, choices=["hf", "sentence-transformers", "distilbert"],
                   help="hf: a folder transformers loads (config.json, model.safetensors, tokenizer); "
                        "sentence-transformers: that plus the pooling modules, equal to ctx serve's vectors; "
                        "distilbert: a BERT pretraining model (a ctx distill student) as DistilBertForMaskedLM "
                        "(one segment: the segment-0 embedding folded into the positions)")
    p.add_argument("--pooling", default=None, choices=["mean", "cls", "last"],
                   help="sentence-transformers: as /v1/embeddings' pooling (default: what ctx serve gives the model unasked)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="sentence-transformers: add a Normalize module (unit vectors); default: as ctx serve gives the model")
    p.add_argument("--output", required=True, help="folder to write (local or s3://)")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (default: AWS_ENDPOINT_URL)")
    _add_retry_deadline(p)


def _add_mine_negatives(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the model that ranks the corpus: checkpoint, run folder, HF or sentence-transformers folder, pkg:PACKAGE/PATH")
    p.add_argument("--data", required=True, help="(anchor, positive) records: JSONL, CSV/TSV or Parquet, local or s3://")
    p.add_argument("--output", required=True, help="JSONL to write: the records with their negatives (local or s3://)")
    p.add_argument("--corpus", default=None, help="more texts to mine from besides the positives (a split; --corpus-field)")
    p.add_argument("--corpus-field", default="text")
    p.add_argument("--anchor-field", default=None, help="default: anchor, query, sentence1, text or sentence, as ctx finetune reads them")
    p.add_argument("--positive-field", default=None, help="default: positive, document, sentence2 or text_pair")
    p.add_argument("--negative-field", default="negative", help="where the negatives go, a list per record (default %(default)s)")
    p.add_argument("--num-negatives", type=int, default=3, help="negatives per record (default %(default)s); a record with fewer is not written")
    p.add_argument("--range-min", type=int, default=0, help="skip this many of the most similar candidates (likely unlabelled positives)")
    p.add_argument("--range-max", type=int, default=None,
                   help="candidates kept per anchor, after the top range-max + (most positives of an anchor) lose the positives "
                        "(default: range-min + num-negatives, x10 with a margin or a score bound, + room for the positives)")
    p.add_argument("--absolute-margin", type=float, default=None, help="a negative scores at least this much below the positive")
    p.add_argument("--relative-margin", type=float, default=None, help="... at least this fraction of the positive's score below it (0.05)")
    p.add_argument("--max-score", type=float, default=None)
    p.add_argument("--min-score", type=float, default=None)
    p.add_argument("--sampling", choices=["top", "random"], default="top", help="the best candidates, or a seeded draw among those that qualify")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (default: AWS_ENDPOINT_URL)")
    _add_retry_deadline(p)


def _add_embed(p: argparse.ArgumentParser) -> None:
    from jobs.serving.embed import DTYPES  # the names ModelSettings.dtype takes
    from jobs.serving.precision import CALIBRATION_ROWS, PRECISIONS

    p.add_argument("--model", required=True, help="checkpoint, run folder (its best checkpoint), HF folder or pkg:PACKAGE/PATH, local or s3://")
    p.add_argument("--input", required=True, help="Parquet, JSON lines (.jsonl, .json) or CSV (.csv; these two also as .gz, .bz2, .lz4, .zst) file, or a folder "
                        "of one kind, with an id and a text column (local, file://, s3://)")
    p.add_argument("--output", required=True, help="a new folder for the vectors' Parquet; one that holds files is refused, unless --resume finishes its run")
    p.add_argument("--id-column", default="id")
    p.add_argument("--text-column", default="text")
    p.add_argument("--pooling", default=None, choices=["mean", "cls", "last"],
                   help="as /v1/embeddings' pooling (default: the model's, a sentence-transformers folder's own, else mean)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="unit-length vectors, as /v1/embeddings' normalize (default: the model's, as its "
                        "sentence-transformers Normalize module says, else not normalised)")
    p.add_argument("--dimensions", type=int, default=None,
                   help="keep the first N components (Matryoshka), re-normalised when the vectors are, as /v1/embeddings' dimensions")
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompt-name", default=None,
                         help="put the model folder's prompt of this name before every text, as sentence-transformers' "
                              "encode(prompt_name=...) and /v1/embeddings' prompt_name (an E5-style folder's 'document' or "
                              "'passage'; default: the folder's default prompt, if it names one)")
    prompts.add_argument("--prompt", default=None, help="put this text before every text instead (e.g. 'passage: ')")
    p.add_argument("--precision", default="float32", choices=PRECISIONS,
                   help="the stored vectors', as sentence-transformers' encode(precision=...): int8/uint8, each dimension's "
                        "range in 256 levels (the range from --calibration-rows rows, kept in the output's _embed.json); "
                        "binary/ubinary, sign bits 8 a byte")
    p.add_argument("--calibration-rows", type=int, default=CALIBRATION_ROWS,
                   help="int8/uint8: input rows (a seeded sample) whose vectors give each dimension's range")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress line on stderr (the local engine's rows done, rows/s and time left; Ray Data shows its own)")
    p.add_argument("--resume", action="store_true",
                   help="an --output an earlier run of the same model and settings stopped in gets the rows whose ids it "
                        "lacks, in new files beside its own (an absent or empty --output: a first run)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per forward pass (default %(default)s, as ctx serve's max_batch_size)")
    p.add_argument("--max-batch-tokens", type=int, default=16384,
                   help="padded tokens (rows x longest row) per forward pass (default %(default)s, as ctx serve's)")
    p.add_argument("--actor-batch-size", type=int, default=1024,
                   help="rows Ray Data hands an actor at a time, sorted by length into forward passes (default %(default)s)")
    p.add_argument("--actors", type=int, default=None,
                   help="model actors, each loads the model once (default: as many as the cluster's CPUs hold, one CPU left to Ray Data)")
    p.add_argument("--cpus-per-actor", type=float, default=1.0, help="CPUs per actor, also its torch threads (default %(default)s)")
    p.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per actor")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="the forward passes' dtype, as ctx serve's: auto (default) is float16 on a GPU, float32 on the CPU")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="on a GPU, run every forward pass eagerly instead of replaying it from a CUDA graph (ctx serve's cuda_graphs: false)")
    p.add_argument("--language", default=None,
                   help="a multilingual XLM: the language the texts are read as, a name of its data.languages or a row number "
                        "(default: the first), as ctx serve's language")
    p.add_argument("--engine", default="auto", choices=["auto", "ray", "local"],
                   help="ray: Ray Data's actor pool; local: this process, a torch thread per core, no Ray; auto (default): local "
                        "for an input of at most 64 MiB with no cluster (RAY_ADDRESS) and no --actors/--num-gpus, else ray")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint of input and output (default: AWS_ENDPOINT_URL)")
    _add_retry_deadline(p)


def _add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_uri", metavar="RUN", help="the run folder, <output_dir>/<name> (local, file:// or s3://)")
    p.add_argument("--out", default=None, help="where to write index.html and the PNGs (default: <run>/report, or ./report-<name> for s3://)")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (default: AWS_ENDPOINT_URL)")
    _add_retry_deadline(p)


# command path -> (help, add-arguments, run)
COMMANDS = {
    ("tokenizer", "train"): ("train a WordPiece, SentencePiece or byte-level BPE tokenizer from a corpus", _add_tokenizer_train, cmd_tokenizer_train),
    ("pretrain",): ("pretrain a model from a recipe with Ray Train", _add_pretrain, cmd_pretrain),
    ("finetune",): ("fine-tune a model on a downstream task from a recipe with Ray Train", _add_pretrain, cmd_finetune),
    ("distill",): ("distil a model into a shallower student of its family (DistilBERT's recipe) with Ray Train", _add_pretrain, cmd_distill),
    ("eval",): ("score a fine-tuned model on a split (JSON + HTML), `eval wic` a model's contextual vectors, or `eval retrieval` "
                "its sentence vectors on a BEIR benchmark", _add_eval, cmd_eval),
    ("serve",): ("serve models over HTTP with Ray Serve", _add_serve_run, cmd_serve),
    ("serve", "build"): ("write the Serve config that `serve deploy` accepts", _add_serve_build, cmd_serve_build),
    ("submit",): ("run a ctx command as a job on a Ray cluster (the same run submitted again attaches to it)", _add_submit, cmd_submit),
    ("jobs", "list"): ("list the jobs on a Ray cluster", _add_jobs_list, cmd_jobs),
    ("jobs", "status"): ("a job's status, polled from the cluster", _add_jobs_id, cmd_jobs),
    ("jobs", "logs"): ("a job's log; --follow until it ends", _add_jobs_logs, cmd_jobs),
    ("jobs", "stop"): ("stop a job and wait until it has stopped", _add_jobs_id, cmd_jobs),
    ("demo",): ("the whole path on bundled data: pretraining, fine-tuning, registry, serving, a scheduled round", _add_demo, cmd_demo),
    ("report",): ("write an HTML report of a run: curves, throughput, MFU, data, checkpoints", _add_report, cmd_report),
    ("export",): ("write a model as a Hugging Face or sentence-transformers folder", _add_export, cmd_export),
    ("schedule",): ("start the scheduled retraining of a schedule.yaml (detached actor), or --once: one round now", _add_schedule_run, cmd_schedule),
    ("schedule", "status"): ("past rounds of a schedule: metrics, gate decisions and why", _add_schedule_status, cmd_schedule_status),
    ("schedule", "stop"): ("stop a schedule's scheduler (after the round it runs)", _add_schedule, cmd_schedule_stop),
    ("embed",): ("re-embed stored texts (Parquet, JSON lines or CSV, with ids) with a model into a new Parquet folder", _add_embed, cmd_embed),
    ("mine-negatives",): ("add hard negatives, mined with a model, to (anchor, positive) records for embedding fine-tuning",
                          _add_mine_negatives, cmd_mine_negatives),
    ("models", "list"): ("list the registered models, their versions and aliases (MLflow registry)", _add_tracking, cmd_models_list),
    ("models", "show"): ("show a model's versions and promotion history, or one version's tags", _add_models_show, cmd_models_show),
    ("models", "promote"): ("point an alias (production, candidate) at a version", _add_models_promote, cmd_models_promote),
    ("models", "rollback"): ("move an alias back to the version it named before", _add_models_rollback, cmd_models_rollback),
    ("models", "register"): ("register a checkpoint as a new version (no copy)", _add_models_register, cmd_models_register),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctx", description="Contextual embedding models on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, argparse.ArgumentParser] = {}
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (help_, add, run) in COMMANDS.items():
        if len(path) == 1:
            p = commands[path[0]] = sub.add_parser(path[0], help=help_)
        else:
            if path[0] not in groups:
                if path[0] in commands:  # a command that also has subcommands: `ctx serve` and `ctx serve build`
                    groups[path[0]] = commands[path[0]].add_subparsers(dest="subcommand", required=False, metavar="{" + path[1] + "}")
                else:
                    groups[path[0]] = sub.add_parser(path[0], help=f"{path[0]} commands").add_subparsers(dest="subcommand", required=True)
            p = groups[path[0]].add_parser(path[1], help=help_)
        p.add_argument("--verbose", action="store_true", help="show Ray's own logs")
        add(p)
        p.set_defaults(run=run)
    return parser


def _user_errors() -> tuple[type[Exception], ...]:
    """The errors that are the user's to fix: one line on stderr, no traceback. Imported only once one
    was raised: jobs.training.config imports torch (through ctxmodels), a second and more that a command which
    needs no torch in its driver (`ctx embed`) would otherwise spend before it starts."""
    from jobs.training.config import RecipeError
    from jobs.registry import RegistryError
    from jobs.runlock import RunLockHeld
    from jobs.operations.schedule_config import ScheduleError
    from jobs.serving.serve_config import ConfigError
    from jobs.operations.submit import SubmitError
    from pipelines.storage import StorageError

    return (CommandError, RecipeError, ConfigError, ScheduleError, StorageError, ConnectionError, RunLockHeld, SubmitError, RegistryError)


INTERRUPTED = (130, 128 + 15)  # the statuses of Ctrl-C (_interrupted) and SIGTERM (exit_on_sigterm)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = int(args.run(args) or 0)
    except SystemExit as e:  # SIGTERM (exit_on_sigterm: 143), or a command's own exit
        if not (isinstance(e.code, int) and _leave_without_finalizing(e.code)):
            raise
        status = e.code
    except Exception as e:
        if isinstance(e, _user_errors()):
            print(f"ctx: error: {e}", file=sys.stderr)
            return 2
        raise
    if _leave_without_finalizing(status):
        _exit_without_finalizing(status)
    return status


def _leave_without_finalizing(status: int) -> bool:
    """A command interrupted while connected to Ray, or while Ray Train's ``fit`` ran
    (``jobs.training.progress.fit_running``): threads of the driver may be waiting inside Ray's C++ calls."""
    progress, ray = sys.modules.get("jobs.training.progress"), sys.modules.get("ray")  # not imported: neither ran
    if progress is not None and progress.fit_running():
        return True
    return status in INTERRUPTED and ray is not None and ray.is_initialized()


def _exit_without_finalizing(status: int) -> None:
    """End the process with ``status`` once the `finally` blocks have run (the run lock released,
    temporary folders removed), leaving the thread that waits in ``fit`` (and any other inside Ray's
    calls) where it is. Exiting the usual way, Python finalizes around that thread, which then
    crashes taking the GIL for its next signal check: a stopped driver ended with SIGSEGV instead of
    143 in 4 of 26 stops timed during Ray Train's start (``jobs.training.progress.fit_running``). The atexit
    handlers still run (``ray.shutdown``: a Ray started here stops; logging flushes); then
    ``os._exit``."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
