"""The layering of docs/ARCHITECTURE.md, read from every import statement (lazy ones inside
functions too) without importing anything:

* ``ctxmodels/`` never imports ray, ``pipelines/`` never imports torch;
* ``jobs/`` by role: the shared modules (runs, identity, registry, session, runlock), then ``training``,
  ``serving``, ``evaluation``, ``operations``, then ``jobs/cli.py``; each imports only its own layer
  or one below it;
* training imports no web framework and no Ray Serve; serving imports nothing of training but the
  fine-tuning recipe (``jobs.training.finetune_config``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = ("jobs.runs", "jobs.identity", "jobs.registry", "jobs.session", "jobs.runlock")  # and the package jobs itself
RANKS = {"shared": 0, "training": 1, "serving": 2, "evaluation": 3, "operations": 4, "cli": 5}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every dotted name ``path`` imports: ``from jobs.training import loop`` gives ``jobs.training``
    and ``jobs.training.loop``; ``from ray import serve`` gives ``ray`` and ``ray.serve``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # a module or a name in one
    return names


def sources(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def layer(name: str) -> str:
    """The layer of a module of jobs/, or of a name defined in one."""
    if name == "jobs" or any(name == m or name.startswith(m + ".") for m in SHARED):
        return "shared"
    if name == "jobs.cli" or name.startswith("jobs.cli."):
        return "cli"
    return name.split(".")[1]


def layer_module(name: str) -> str:
    """``jobs.training.finetune_config`` of ``jobs.training.finetune_config.task_data_config``."""
    return ".".join(name.split(".")[:3])


def test_every_jobs_module_has_a_layer():
    for path in sources("jobs"):
        assert layer(module_name(path)) in RANKS, f"{path.relative_to(REPO)}: not in a layer of docs/ARCHITECTURE.md"


def test_the_scan_sees_plain_lazy_and_package_imports():
    """Not vacuous: the scanner finds imports of each kind the rules below judge."""
    assert "jobs.serving.replica" in imports(REPO / "jobs/serving/serve.py")  # from jobs.serving.replica import ...
    assert "jobs.operations.schedule" in imports(REPO / "jobs/cli.py")  # from jobs.operations import schedule, in a function
    assert "torch" in imports(REPO / "ctxmodels/bert.py")
    assert "ray" in imports(REPO / "jobs/session.py")  # inside init_ray
    assert "ray.serve" in imports(REPO / "jobs/serving/serve.py")  # from ray import serve


@pytest.mark.parametrize("package, banned", [("ctxmodels", "ray"), ("pipelines", "torch")])
def test_the_model_code_never_imports_ray_and_the_data_code_never_torch(package, banned):
    found = [f"{path.relative_to(REPO)} imports {name}" for path in sources(package) for name in imports(path)
             if name == banned or name.startswith(banned + ".")]
    assert not found, found


def test_each_jobs_layer_imports_only_itself_and_the_layers_below():
    found = []
    for path in sources("jobs"):
        here = layer(module_name(path))
        for name in imports(path):
            if name.startswith("jobs.") and RANKS[layer(name)] > RANKS[here]:
                found.append(f"{path.relative_to(REPO)} ({here}) imports {name} ({layer(name)})")
    assert not found, found


def test_training_needs_no_web_server_and_serving_reads_only_the_finetuning_recipe_of_training():
    found = []
    for path in sources("jobs/training"):
        found += [f"{path.relative_to(REPO)} imports {name}" for name in imports(path)
                  if name.split(".")[0] in ("fastapi", "starlette", "uvicorn") or name.startswith("ray.serve")]
    for path in sources("jobs/serving"):
        found += [f"{path.relative_to(REPO)} imports {name}" for name in imports(path)
                  if name.startswith("jobs.training.") and layer_module(name) != "jobs.training.finetune_config"]
    assert not found, found
