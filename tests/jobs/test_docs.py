"""The README and docs/ are true to the code. The `ctx` commands they show are real: each parses with
the CLI's own parser, and each recipe, serving config and schedule such a command names loads with
its overrides. The code they name (`jobs.training.loop.run_worker`, `ctxmodels.bert.JaggedPacking` ...)
exists. A flag, a recipe key or a function renamed in the code fails here, not in the terminal of a
user copying the docs. (The manifests' commands are checked in tests/infra/test_manifests.py.)"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import shlex
import sys

from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
IMAGE_ROOT = "/app/"  # the project's place in the image (infra/Dockerfile)
MOUNTED = ("configs/schedule/cluster/",)  # a ConfigMap in the cluster (infra/kuberay/raycluster.yaml), not in the repo


def shown_commands() -> list[tuple[str, str]]:
    """(where, arguments after `ctx`) for every `ctx` command in the docs' shell blocks: continued
    lines joined, comments dropped, `&&` / `;` / `|` chains split, `VAR=value` prefixes allowed."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in re.finditer(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
            first_line = text.count("\n", 0, match.start()) + 2  # the block's first line, 1-based
            lines = match.group(1).split("\n")
            i = 0
            while i < len(lines):
                start, line = i, lines[i]
                while line.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line[:-1] + " " + lines[i]
                i += 1
                code = line.split(" #", 1)[0].strip()
                for part in re.split(r"&&|\|\||;|\|", code):
                    m = re.match(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*ctx\s+(.*)$", part.strip())
                    if m:
                        found.append((f"{doc.name}:{first_line + start}", " ".join(m.group(1).split())))
    return found


def _parse(args: list[str]):
    """The namespace, or the parser's own error line."""
    from jobs.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return build_parser().parse_args(args)
    except SystemExit as e:
        if e.code:
            return (err.getvalue().strip().splitlines() or [f"exit {e.code}"])[-1]
        return None  # --help


def _local(path: str) -> str:
    return str(REPO / path[len(IMAGE_ROOT):]) if path.startswith(IMAGE_ROOT) else str(REPO / path)


def _load(ns) -> bool:
    """Load what the command names (recipe with --set, serving config with its flags, schedule), as
    the command does before anything starts; False when it names nothing to load."""
    from jobs import cli
    from jobs.training.config import load_recipe
    from jobs.training.finetune_config import load_finetune_recipe
    from jobs.operations.schedule_config import load_schedule

    config = getattr(ns, "config", None)
    if not config or any(m in config for m in MOUNTED):
        return False
    if ns.command in ("pretrain", "distill"):
        load_recipe(_local(config), ns.set)
    elif ns.command == "finetune":
        load_finetune_recipe(_local(config), ns.set)
    elif ns.command == "serve":
        ns.config = _local(config)
        cli._serve_config(ns)
    elif ns.command == "schedule":
        load_schedule(_local(config))
    else:
        return False
    return True


def test_every_ctx_command_the_docs_show_parses():
    commands = shown_commands()
    assert len(commands) >= 40, commands  # the README alone shows some fifty: the search found them
    failures = [f"{where}: ctx {args}\n  -> {result}" for where, args in commands if isinstance(result := _parse(shlex.split(args)), str)]
    assert not failures, "\n".join(failures)


def test_every_recipe_config_and_schedule_the_docs_run_loads_with_its_overrides(monkeypatch):
    monkeypatch.chdir(REPO)  # a recipe's relative paths are the project's, as for a user in the checkout
    loaded, failures = 0, []
    for where, args in shown_commands():
        argv = shlex.split(args)
        if argv[0] == "submit" and "--" in argv:  # `ctx submit -- <command>` runs that command on the cluster
            argv = argv[argv.index("--") + 1:]
        ns = _parse(argv)
        if ns is None or isinstance(ns, str):
            continue
        try:
            loaded += _load(ns)
        except (Exception, SystemExit) as e:
            failures.append(f"{where}: ctx {args}\n  -> {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)
    assert loaded >= 10, loaded  # pretraining, fine-tuning, distillation, serving and schedule files among them


def test_the_search_finds_a_command_split_over_lines_and_chained(tmp_path, monkeypatch):
    doc = tmp_path / "doc.md"
    doc.write_text("text\n```bash\nRAY_ADDRESS=x ctx pretrain --config c.yaml \\\n    --set a=1  # why\n"
                   "ctx jobs list && ctx jobs status ID\n```\n```\nctx demo: output, not a command\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", [doc])
    assert shown_commands() == [("doc.md:3", "pretrain --config c.yaml --set a=1"), ("doc.md:5", "jobs list"),
                                ("doc.md:5", "jobs status ID")]


def named_code() -> list[tuple[str, str]]:
    """(document, dotted name) for every `ctxmodels.` / `pipelines.` / `jobs.` / `benchmarks.` name the
    docs put in backticks, a call's arguments left off."""
    pattern = re.compile(r"`((?:ctxmodels|pipelines|jobs|benchmarks)\.[A-Za-z_][A-Za-z0-9_.]*?)\.?(?:\([^`]*\))?`")
    return sorted({(doc.name, m.group(1)) for doc in DOCS for m in pattern.finditer(doc.read_text())})


def _resolve(name: str):
    """The object a dotted name names: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_every_module_function_and_class_the_docs_name_exists():
    names = named_code()
    assert len(names) >= 60, names  # the README and docs/ARCHITECTURE.md name some eighty
    failures = []
    for where, name in names:
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            failures.append(f"{where}: `{name}` -> {type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)
