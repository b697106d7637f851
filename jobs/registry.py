"""The model registry: MLflow's Model Registry, reached through ``mlflow.MlflowClient``.

Where it lives (``tracking_uri``): an explicit URI (a recipe's ``registry.tracking_uri``, ``ctx models
--tracking-uri``) > ``$MLFLOW_TRACKING_URI`` (a real ``mlflow server`` in production) > the embedded
SQLite store ``~/.ctxmodels/mlflow.db`` (``DEFAULT_DB``).

What a version is: a registered model version whose ``source`` is the checkpoint URI a run wrote
(a local folder or ``s3://...``); the weights are never copied. Its tags (``ctx.*``) say what the
model is: tokenizer hash, family, task, the shards it trained on, its evaluation metrics, its parent.

References: ``NAME@alias``, ``NAME/3`` and the same behind ``models:/`` (MLflow's own model URI form).

Promotion uses aliases (``production``, ``candidate``), never the deprecated stages. Rollback needs
to know what an alias named before, and MLflow has no compare-and-swap on aliases, so:

* Every promotion and rollback is appended to a promotion log: the model versions of a companion
  registered model ``<NAME>.promotions`` (tagged ``ctx.promotion_log_of``). Appending is atomic and
  totally ordered: MLflow gives each new version of a model the next number under the table's
  primary key (``create_model_version`` retries on a conflict), so two writers never get the same
  number and everyone agrees on the order.
* An alias's value is a function of the log: replay it in order, a promotion pushes its version
  (unless it is already on top), a rollback pops (not below one entry). The alias names the top.
* After appending, a writer "settles": read the log, set every alias to what the replay says,
  read the log again, and repeat until no entry arrived in between. The last alias write of all
  comes from a writer whose later re-read saw no newer entry, so once the writers are done every
  alias names what the whole log says, whatever the interleaving; a writer that died mid-way is
  repaired by the next promote/rollback (or ``Registry.settle``).

Changing aliases by hand in MLflow's UI bypasses the log; the next ``promote``/``rollback`` puts
the aliases back to what the log says.
"""

from __future__ import annotations

import getpass
import json
import os
import random
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_DB = Path.home() / ".ctxmodels" / "mlflow.db"
MODELS_SCHEME = "models:/"
LOG_SUFFIX = ".promotions"
# A unique-key collision in the registry's SQL store, as SQLite, PostgreSQL and MySQL word it
_KEY_COLLISION = re.compile(r"IntegrityError|UNIQUE constraint|duplicate key|Duplicate entry")
LOG_TAG = "ctx.promotion_log_of"  # on the companion model: which model's promotions it holds
PARENT_TAG = "ctx.parent"  # on a version: "NAME/N" of the version it started from
# Model names end up inside MLflow filter strings ("name = '...'"): keep them to plain characters.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")
REF_RE = re.compile(r"^(?P<name>[^@/]+)(?:@(?P<alias>[^@/]+)|/(?P<version>\d+))$")


class RegistryError(ValueError):
    """A registry request that cannot be done; the message says what, where and what to do."""


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: int
    source: str  # the checkpoint URI (local path or s3://...), never a copy of the weights
    aliases: tuple[str, ...]
    tags: dict[str, str] = field(default_factory=dict)
    run_id: str | None = None

    @property
    def ref(self) -> str:
        """``NAME/N``: how answers and tags name this version."""
        return f"{self.name}/{self.version}"


@dataclass(frozen=True)
class LogEntry:
    """One promotion-log entry: ``op`` "promote" (of ``version``) or "rollback" (asked while ``version``
    was live), in log order ``seq``; ``effective`` says whether the replay applied it."""

    seq: int
    op: str
    alias: str
    version: int
    at_ms: int
    by: str
    effective: bool = True


def tracking_uri(explicit: str | None = None) -> str:
    """explicit > $MLFLOW_TRACKING_URI > the embedded SQLite default (its folder is created)."""
    if explicit:
        return explicit
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    DEFAULT_DB.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{DEFAULT_DB}"


_resolve_uri = tracking_uri  # Registry's argument has the function's name


def parse_ref(ref: str) -> tuple[str, str | None, int | None]:
    """``[models:/]NAME@alias`` or ``[models:/]NAME/N`` -> (name, alias or None, version or None)."""
    body = ref[len(MODELS_SCHEME):] if ref.startswith(MODELS_SCHEME) else ref
    m = REF_RE.match(body)
    if m is None:
        raise RegistryError(f"model reference {ref!r}: expected NAME@ALIAS or NAME/VERSION (optionally after models:/), e.g. models:/bert-tiny@production")
    version = m.group("version")
    return m.group("name"), m.group("alias"), int(version) if version is not None else None


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a registered model name here, or None (recipes check it on load)."""
    if not NAME_RE.match(name) or name.endswith(LOG_SUFFIX):
        return (f"model name {name!r}: use letters, digits, '.', '_' and '-' (starting with a letter or digit), "
                f"not ending in {LOG_SUFFIX!r} (that suffix names promotion logs)")
    return None


def _check_name(name: str) -> None:
    problem = name_problem(name)
    if problem:
        raise RegistryError(problem)


def _is_local(source: str) -> bool:
    return "://" not in source or source.startswith("file://")


def replay(entries: list[LogEntry]) -> tuple[dict[str, list[int]], list[LogEntry]]:
    """The alias stacks a log gives (alias -> versions, live one last) and the entries marked effective
    or not: a promotion of the live version and a rollback with nothing below change nothing."""
    stacks: dict[str, list[int]] = {}
    marked = []
    for e in sorted(entries, key=lambda e: e.seq):
        stack = stacks.setdefault(e.alias, [])
        if e.op == "promote":
            effective = not stack or stack[-1] != e.version
            if effective:
                stack.append(e.version)
        else:
            effective = len(stack) >= 2
            if effective:
                stack.pop()
        marked.append(LogEntry(e.seq, e.op, e.alias, e.version, e.at_ms, e.by, effective))
    return {a: s for a, s in stacks.items() if s}, marked


class Registry:
    """Model versions, aliases and promotion history in one MLflow registry."""

    def __init__(self, tracking_uri: str | None = None):
        from mlflow import MlflowClient

        self.uri = _resolve_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    # ------------------------------------------------------------------ reading

    def _call(self, what: str, fn, *args, **kwargs):
        """Run one MLflow call; its errors become RegistryErrors naming the request and the registry."""
        from mlflow.exceptions import MlflowException

        try:
            return fn(*args, **kwargs)
        except MlflowException as e:
            raise RegistryError(f"{what} at {self.uri}: {e.message}") from e
        except OSError as e:  # connection refused, DNS, ...: the server is not there
            raise RegistryError(f"{what}: cannot reach the registry at {self.uri} ({e}); is the MLflow server up?") from e

    def _exists(self, name: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
            return True
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise RegistryError(f"read model {name!r} at {self.uri}: {e.message}") from e

    def _aliases(self, name: str) -> dict[int, tuple[str, ...]]:
        rm = self._call(f"read model {name!r}", self.client.get_registered_model, name)
        by_version: dict[int, list[str]] = {}
        for alias, version in (rm.aliases or {}).items():
            by_version.setdefault(int(version), []).append(alias)
        return {v: tuple(sorted(a)) for v, a in by_version.items()}

    def _search(self, name: str) -> list:
        out, token = [], None
        while True:
            page = self._call(f"list versions of {name!r}", self.client.search_model_versions, f"name = '{name}'", page_token=token)
            out.extend(page)
            token = page.token
            if not token:
                return out

    def _wrap(self, mv, aliases: tuple[str, ...]) -> ModelVersion:
        return ModelVersion(mv.name, int(mv.version), mv.source, aliases, dict(mv.tags or {}), mv.run_id or None)

    def models(self) -> list[str]:
        """Registered model names, without promotion logs."""
        names = []
        for rm in self._call("list models", lambda: list(self._all_models())):
            if LOG_TAG not in (rm.tags or {}):
                names.append(rm.name)
        return sorted(names)

    def _all_models(self):
        token = None
        while True:
            page = self.client.search_registered_models(page_token=token)
            yield from page
            token = page.token
            if not token:
                return

    def versions(self, name: str) -> list[ModelVersion]:
        """Every version of ``name``, oldest first, with their aliases."""
        _check_name(name)
        if not self._exists(name):
            raise RegistryError(f"no model {name!r} in the registry at {self.uri}: `ctx models list` shows what is there")
        aliases = self._aliases(name)
        found = sorted(self._search(name), key=lambda mv: int(mv.version))
        return [self._wrap(mv, aliases.get(int(mv.version), ())) for mv in found]

    def get(self, ref: str) -> ModelVersion:
        """``NAME@alias``, ``NAME/3``, ``models:/NAME@alias`` or ``models:/NAME/3``."""
        from mlflow.exceptions import MlflowException

        name, alias, version = parse_ref(ref)
        _check_name(name)
        try:  # one request: MLflow fills in the version's aliases
            mv = self.client.get_model_version_by_alias(name, alias) if alias else self.client.get_model_version(name, str(version))
        except MlflowException as e:
            if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise RegistryError(f"{ref} at {self.uri}: {e.message}") from e
            if not self._exists(name):
                raise RegistryError(f"{ref}: no model {name!r} in the registry at {self.uri}: `ctx models list` shows what is there") from e
            hint = f"promote one: ctx models promote {name} VERSION --alias {alias}" if alias else f"`ctx models show {name}` lists its versions"
            raise RegistryError(f"{ref}: model {name!r} has no {'alias ' + repr(alias) if alias else 'version ' + str(version)} at {self.uri}; {hint}") from e
        except OSError as e:
            raise RegistryError(f"{ref}: cannot reach the registry at {self.uri} ({e}); is the MLflow server up?") from e
        return self._wrap(mv, tuple(sorted(mv.aliases or ())))

    # ------------------------------------------------------------------ writing

    def register(self, name: str, source: str, *, tags: dict[str, str] | None = None, run_id: str | None = None,
                 parent: ModelVersion | None = None) -> ModelVersion:
        """A new version of ``name`` (created if new) whose source is ``source`` itself: no copy.

        A local folder is recorded as its absolute path. An MLflow tracking server refuses a local
        path outside the MLflow run's artifact folder (its guard against reading the server's disk),
        so with a server, checkpoints must live on shared storage (``s3://``)."""
        from mlflow.exceptions import MlflowException

        _check_name(name)
        if _is_local(source):
            source = str(Path(source.removeprefix("file://")).resolve())
        tags = {k: str(v) for k, v in (tags or {}).items()}
        if parent is not None:
            tags[PARENT_TAG] = parent.ref
        try:
            self.client.create_registered_model(name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":  # another writer created it first: fine
                raise RegistryError(f"create model {name!r} at {self.uri}: {e.message}") from e
        try:
            # await_creation_for=0: SQL stores create versions READY at once; waiting only logs a line
            mv = self.client.create_model_version(name, source, run_id=run_id, tags=tags, await_creation_for=0)
        except MlflowException as e:
            hint = ""
            if _is_local(source) and self.uri.startswith(("http://", "https://")):
                hint = " (an MLflow server accepts no local path as a source: write checkpoints to s3:// or use a sqlite:/// tracking URI)"
            raise RegistryError(f"register {source} as a version of {name!r} at {self.uri}: {e.message}{hint}") from e
        return self._wrap(mv, ())

    def set_tags(self, name: str, version: int, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self._call(f"tag {name}/{version}", self.client.set_model_version_tag, name, str(version), key, str(value))

    def promote(self, name: str, version: int, alias: str = "production") -> ModelVersion:
        """Point ``alias`` at ``name``/``version`` and record it in the promotion log (see the module
        docstring for why concurrent promotions stay consistent)."""
        target = self.get(f"{name}/{int(version)}")  # refuses a version that does not exist
        self._append(name, "promote", alias, target.version)
        return self.get(f"{name}/{self.settle(name)[alias]}")

    def rollback(self, name: str, alias: str = "production") -> ModelVersion:
        """Point ``alias`` back at the version it named before its latest effective promotion."""
        stacks, _ = replay(self.history(name))
        stack = stacks.get(alias, [])
        if len(stack) < 2:
            live = f"it names {name}/{stack[-1]}" if stack else "it was never promoted"
            raise RegistryError(f"rollback {name}@{alias}: no earlier version to go back to ({live})")
        seq = self._append(name, "rollback", alias, stack[-1])
        live = self.get(f"{name}/{self.settle(name)[alias]}")
        if not next(e for e in self.history(name) if e.seq == seq).effective:  # concurrent rollbacks used up the history
            raise RegistryError(f"rollback {name}@{alias}: other rollbacks at the same time left no earlier version; it names {live.ref}")
        return live

    def history(self, name: str, alias: str | None = None) -> list[LogEntry]:
        """The promotion log of ``name`` (of one alias if given), oldest first, marked by the replay."""
        _check_name(name)
        entries = []
        for mv in self._search(name + LOG_SUFFIX):  # none while the log does not exist
            t = mv.tags or {}
            entries.append(LogEntry(int(mv.version), t.get("ctx.op", "promote"), t.get("ctx.alias", "production"),
                                    int(t.get("ctx.version", 0)), int(mv.creation_timestamp or 0), t.get("ctx.by", "")))
        _, marked = replay(entries)
        return [e for e in marked if alias is None or e.alias == alias]

    def settle(self, name: str) -> dict[str, int]:
        """Set every alias of ``name`` to what its promotion log says, until the log stops growing
        under us; returns alias -> version."""
        while True:
            entries = self.history(name)
            stacks, _ = replay(entries)
            for alias, stack in stacks.items():
                self._set_alias(name, alias, stack[-1])
            if self._last_seq(name) == max((e.seq for e in entries), default=0):
                return {a: s[-1] for a, s in stacks.items()}

    def _set_alias(self, name: str, alias: str, version: int, attempts: int = 6) -> None:
        """Point ``name@alias`` at ``version``. MLflow's SQL store sets an alias by reading it, then
        inserting or updating: two writers setting the same new alias at the same moment make the
        second insert break the unique key (an IntegrityError the server answers as an internal
        error; seen with two racing promoters on SQLite). Setting an alias is idempotent and
        ``settle`` reads the log again afterwards, so such a collision is simply tried again."""
        from mlflow.exceptions import MlflowException

        for attempt in range(attempts):
            try:
                self.client.set_registered_model_alias(name, alias, str(version))
                return
            except MlflowException as e:
                if attempt + 1 == attempts or not _KEY_COLLISION.search(str(e.message)):
                    raise RegistryError(f"set {name}@{alias} at {self.uri}: {e.message}") from e
            except OSError as e:
                raise RegistryError(f"set {name}@{alias}: cannot reach the registry at {self.uri} ({e}); is the MLflow server up?") from e
            time.sleep(random.uniform(0.05, 0.2) * 2**attempt)

    def _last_seq(self, name: str) -> int:
        """The newest log entry's number (one small request)."""
        page = self._call(f"read the promotion log of {name!r}", self.client.search_model_versions, f"name = '{name}{LOG_SUFFIX}'",
                          max_results=1, order_by=["version_number DESC"])
        return max((int(mv.version) for mv in page), default=0)

    def _append(self, name: str, op: str, alias: str, version: int) -> int:
        """One log entry; its number is its place in the log."""
        from mlflow.exceptions import MlflowException

        log = name + LOG_SUFFIX
        try:
            self.client.create_registered_model(log, tags={LOG_TAG: name}, description=f"promotion log of {name} (ctx models)")
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise RegistryError(f"create promotion log {log!r} at {self.uri}: {e.message}") from e
        tags = {"ctx.op": op, "ctx.alias": alias, "ctx.version": str(version), "ctx.by": _who()}
        # The source points at the version the entry is about (MLflow needs one; models:/ is no path).
        mv = self._call(f"record {op} of {name}@{alias}", self.client.create_model_version, log, f"models:/{name}/{version}",
                        tags=tags, await_creation_for=0)
        return int(mv.version)


PYFUNC_LOADER = "jobs.serving.pyfunc"  # MLflow's python_function loader of a checkpoint folder
MLMODEL = "MLmodel"
# predict's params (jobs/serving/pyfunc.py) and their MLflow types
PYFUNC_PARAMS = {"task": "string", "pooling": "string", "normalize": "boolean", "dimensions": "long", "prompt_name": "string"}


def mlmodel_text(family: str, task: str | None = None) -> str:
    """The ``MLmodel`` file that makes a checkpoint folder an MLflow model (MLflow's "MLmodel format":
    a ``python_function`` flavour whose ``loader_module`` is ``PYFUNC_LOADER``), so
    ``mlflow.pyfunc.load_model`` loads the folder, or a registered version whose source it is. Written
    with the checkpoint (``save_checkpoint``'s ``extra_text``), without importing MLflow in the
    training workers, and with no creation time or uuid: identical runs still write identical
    checkpoints."""
    import platform

    import yaml

    flavors = {
        "python_function": {"loader_module": PYFUNC_LOADER, "python_version": platform.python_version()},
        "ctxmodels": {"family": family, **({"task": task} if task else {})},
    }
    # The params predict takes (MLflow passes only those a signature declares); inputs are free-form.
    params = [{"name": name, "default": None, "shape": None, "type": kind} for name, kind in PYFUNC_PARAMS.items()]
    signature = {"inputs": None, "outputs": None, "params": json.dumps(params)}
    return yaml.safe_dump({"flavors": flavors, "signature": signature}, sort_keys=False)


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()} pid {os.getpid()}"


def resolve(uri: str, tracking_uri: str | None = None) -> tuple[str, ModelVersion | None]:
    """Any model reference -> (checkpoint URI, version or None): ``models:/...`` through the registry,
    anything else unchanged."""
    if not uri.startswith(MODELS_SCHEME):
        return uri, None
    version = Registry(tracking_uri).get(uri)
    return version.source, version


def describe(version: ModelVersion) -> dict[str, Any]:
    """A version as a person reads it (``ctx models show``): JSON-looking tags decoded."""
    tags = {}
    for k, v in sorted(version.tags.items()):
        try:
            tags[k] = json.loads(v) if v[:1] in "[{" else v
        except ValueError:
            tags[k] = v
    return {"ref": version.ref, "source": version.source, "aliases": list(version.aliases), "run_id": version.run_id, "tags": tags}
