"""A finished run in MLflow: its parameters and metrics as an MLflow run, its checkpoint as a model version.

Called on the driver after ``fit`` (``jobs.training.train.pretrain``, ``jobs.training.finetune.finetune``) when the
recipe's ``registry.enabled`` is true (the default):

* MLflow run in the experiment named after the model: params = the recipe flattened
  (``train.lr``), metrics = the run's metrics history (every logged step of rank 0) and its final
  metrics; tags ``ctx.run_uri``, ``ctx.checkpoint``.
* Model version of ``registry.model_name`` (default: the recipe's ``name``) whose source is the
  checkpoint the run produced (fine-tuning: its best checkpoint, else its newest): the URI itself,
  nothing is copied. Tags, enough for ``ctx models show`` to say what the model is:
  ``ctx.kind`` (pretrain/finetune), ``ctx.family``, ``ctx.task`` and ``ctx.labels`` (fine-tuning),
  ``ctx.tokenizer_hash`` (what serving answers as ``X-Tokenizer-Hash``, computed by the same
  function from the checkpoint's own tokenizer files), ``ctx.shards`` (JSON list of
  ``{uri, size, etag}`` for object storage, ``{uri, size, mtime}`` for local files: hashing a
  corpus would cost a full read; past MLflow's 100k-character tag limit a summary, the list then
  in ``<run>/shards.json``), ``ctx.metrics`` (JSON: evaluation metrics), ``ctx.parent``
  (``NAME/N`` of the registered version it started from, when ``model.init`` was ``models:/``),
  ``ctx.run_uri``.

A registry that fails after a good run does not lose the run: the checkpoint stays where it is,
``RegistrationError`` says which checkpoint was not registered and why, and ``ctx pretrain``/
``ctx finetune`` exit with status 3 (not 0: a scheduler must notice).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections import defaultdict
from typing import Any

from jobs.registry import ModelVersion, Registry, RegistryError
from pipelines import storage
from pipelines.storage import Store, as_store

# MLflow's limit on a model version tag's value (MAX_MODEL_REGISTRY_TAG_VALUE_LENGTH): a longer
# shard list (some thousand shards) goes to <run>/shards.json and the tag keeps a summary.
MAX_TAG_CHARS = 100_000


class RegistrationError(RuntimeError):
    """A run that finished and kept its checkpoint, but could not be logged or registered."""


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"train": {"lr": 1e-3}}`` -> ``{"train.lr": "0.001"}``; lists as JSON."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        else:
            out[path] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return out


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}


def shard_list(uris: list[str], store: Store | str | None = None) -> list[dict[str, Any]]:
    """``{uri, size, etag}`` per object (one LIST per folder, not a HEAD per object), ``{uri, size,
    mtime}`` per local file."""
    store = as_store(store)
    out: dict[str, dict[str, Any]] = {}
    folders: dict[tuple[str, str], set[str]] = defaultdict(set)
    for uri in uris:
        if uri.startswith("s3://"):
            bucket, _, key = uri[len("s3://"):].partition("/")
            folders[(bucket, key.rsplit("/", 1)[0] + "/" if "/" in key else "")].add(key)
        else:
            fs, path = store.filesystem(uri)
            info = store.retry(lambda: fs.get_file_info(path), f"stat {uri}")
            out[uri] = {"uri": uri, "size": info.size, "mtime": info.mtime.isoformat() if info.mtime else None}
    if folders:
        s3 = storage.s3_client(store.endpoint_url)
        for (bucket, prefix), keys in folders.items():
            def listing() -> list[dict[str, Any]]:  # one folder's pages, retried whole
                pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                return storage.boto_call(lambda: [obj for page in pages for obj in page.get("Contents", [])])

            for obj in store.retry(listing, f"list s3://{bucket}/{prefix}"):
                if obj["Key"] in keys:
                    uri = f"s3://{bucket}/{obj['Key']}"
                    out[uri] = {"uri": uri, "size": obj["Size"], "etag": obj["ETag"].strip('"')}
    return [out.get(u, {"uri": u, "size": None}) for u in uris]


def _shards_tag(listed: list[dict[str, Any]], run_uri: str, store: Store | str | None) -> str:
    text = json.dumps(listed)
    if len(text) <= MAX_TAG_CHARS:
        return text
    where = storage.join(run_uri, "shards.json")
    store = as_store(store)
    fs, path = store.filesystem(where)

    def put() -> None:
        with fs.open_output_stream(path) as out:
            out.write(json.dumps(listed, indent=1).encode("utf-8"))

    store.retry(put, f"write {where}")
    return json.dumps({"count": len(listed), "bytes": sum(s["size"] or 0 for s in listed), "first": listed[:5], "full_list": where})


def checkpoint_tokenizer_hash(checkpoint: str, store: Store | str | None = None) -> str | None:
    """What serving sends as X-Tokenizer-Hash for this checkpoint (``jobs.identity.tokenizer_hash`` of its
    ``tokenizer/``), reading only the tokenizer files; None when it has none."""
    from jobs.identity import tokenizer_hash

    store = as_store(store)
    uri = storage.join(checkpoint, "tokenizer")
    if not store.exists(uri):
        return None
    with tempfile.TemporaryDirectory(prefix="ctx-tokhash-") as d:
        return tokenizer_hash(store.download_dir(uri, d))


def record_run(*, kind: str, recipe, checkpoint: str | None, metrics: dict[str, Any], history: list[dict[str, Any]],
               run_uri: str, shards: list[str], eval_metrics: dict[str, Any], family: str, store: Store | str | None,
               parent: ModelVersion | None = None, extra_tags: dict[str, str] | None = None, log=print) -> ModelVersion | None:
    """Log the finished run and register its checkpoint (module docstring); None when the recipe's
    ``registry.enabled`` is false. Raises ``RegistrationError`` (the checkpoint is kept). ``store``:
    the recipe's (its endpoint and retry deadline), for the tokenizer hash and the shard list."""
    section = recipe.registry
    if not section.enabled:
        return None
    store = as_store(store)
    name = section.model_name or recipe.name
    try:
        reg = Registry(section.tracking_uri)
        run_id = _log_mlflow_run(reg, name, recipe, kind, metrics, history, run_uri, checkpoint)
        if checkpoint is None:
            log(f"registry: MLflow run {run_id} at {reg.uri}; no checkpoint to register")
            return None
        tags = {"ctx.kind": kind, "ctx.family": family, "ctx.run_uri": run_uri, **(extra_tags or {})}
        tok = checkpoint_tokenizer_hash(checkpoint, store)
        if tok:
            tags["ctx.tokenizer_hash"] = tok
        tags["ctx.shards"] = _shards_tag(shard_list(shards, store), run_uri, store)
        tags["ctx.metrics"] = json.dumps(_numbers(eval_metrics), sort_keys=True)
        version = reg.register(name, checkpoint, tags=tags, run_id=run_id, parent=parent)
    except (RegistryError, OSError) as e:
        raise RegistrationError(
            f"the run finished and its checkpoint {checkpoint} is kept, but registering it as a version of {name!r} failed: {e}. "
            f"Once the registry is back, `ctx models register {name} {checkpoint}` registers it "
            f"(registry.tracking_uri / $MLFLOW_TRACKING_URI say where)"
        ) from e
    except Exception as e:  # MlflowException from the run logging, a boto3 error listing shards, ...
        raise RegistrationError(f"the run finished and its checkpoint {checkpoint} is kept, but logging it to MLflow failed: "
                                f"{type(e).__name__}: {e}. `ctx models register {name} {checkpoint}` registers it later") from e
    log(f"registry: {version.ref} <- {checkpoint} (MLflow run {run_id} at {reg.uri})")
    return version


def _shown(key: str, value: str) -> str:
    """A recipe value as the registry keeps it: an endpoint without a ``user:password@`` part."""
    return storage.shown_endpoint(value) if key.endswith("endpoint_url") and value != "None" else value


def _log_mlflow_run(reg: Registry, experiment: str, recipe, kind: str, metrics: dict[str, Any], history: list[dict[str, Any]],
                    run_uri: str, checkpoint: str | None) -> str:
    """One MLflow run with the recipe as params and the metrics history; returns its id. Through the
    client (no mlflow.start_run: that keeps the active run in a module global)."""
    from mlflow.entities import Metric, Param, RunStatus
    from mlflow.exceptions import MlflowException

    client = reg.client
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        exp_id = exp.experiment_id
    else:
        try:
            exp_id = client.create_experiment(experiment)
        except MlflowException:  # another run created it first
            exp_id = client.get_experiment_by_name(experiment).experiment_id
    run = client.create_run(exp_id, run_name=recipe.name, tags={"ctx.kind": kind, "ctx.run_uri": run_uri, "ctx.checkpoint": checkpoint or ""})
    run_id = run.info.run_id
    params = [Param(k, _shown(k, v)[:6000]) for k, v in flatten(recipe.model_dump(mode="json")).items()]
    now = int(time.time() * 1000)  # the history rows carry steps, not clock times
    points: list = []
    for row in history:
        step = int(row.get("step", 0) or 0)
        points += [Metric(k, v, now, step) for k, v in _numbers(row).items() if k != "step"]
    final_step = int(metrics.get("step", 0) or 0)
    points += [Metric(k, v, now, final_step) for k, v in _numbers(metrics).items() if k != "step"]
    for i in range(0, len(params), 100):  # MLflow's per-request limits: 100 params, 1000 metrics
        client.log_batch(run_id, params=params[i:i + 100])
    for i in range(0, len(points), 1000):
        client.log_batch(run_id, metrics=points[i:i + 1000])
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))
    return run_id
