"""The manifests in infra/ are what a cluster accepts and run commands this project has.

* Core kinds (CronJob, Deployment, Service, PersistentVolumeClaim, NetworkPolicy, ServiceAccount,
  Role, RoleBinding, ConfigMap) against Kubernetes' own schemas with kubernetes-validate, strict (an
  unknown field fails, as `kubectl apply` with server-side field validation does). A manifest held
  in a ConfigMap (the RayJob the plain schedule CronJob creates) is checked like a file.
* KubeRay kinds (RayCluster, RayJob, RayService, RayCronJob) against the openAPIV3Schema of the
  matching version in the CRDs of ../shared/kuberay-crds, closed the way the API server closes a
  structural schema: an object with `properties` takes no other keys unless it says
  x-kubernetes-preserve-unknown-fields; x-kubernetes-int-or-string takes both; a required field with
  a `default` counts as present (the server fills it in first). CEL rules (x-kubernetes-validations)
  are not evaluated.
* The Ray cluster launcher YAML with Ray's own validator, after Ray's own defaults, as `ray up` does.
* Every command in them (container command/args, RayJob entrypoints, launcher shell lines): `ctx ...`
  and `python -m jobs.cli ...` parse with the real `ctx` parser (a nested `ctx submit -- ...` too),
  recipes load with their --set overrides, `mlflow` and `ray` commands parse with their own CLIs.
* A broken copy of each manifest (an unknown key in its spec and in its first container) is
  rejected, so the checks above can fail.
* Every `ctx submit` / `ctx jobs` (and every container pointing RAY_ADDRESS at a dashboard) would
  be let through by jobs/operations/submit.py's own address and token-transport checks.
* The plain schedule CronJob's kubectl script parses (bash -n), creates the RayJob it mounts, and
  its ServiceAccount may do exactly that in its namespace.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
# The CRDs sit in the shared folder beside the repository (../shared from the repo root, in CI too).
CRD_DIR = REPO.parent / "shared" / "kuberay-crds"
K8S_VERSION = "1.37"
IMAGE_ROOT = "/app"  # infra/Dockerfile's WORKDIR: /app/configs/x.yaml in a manifest is configs/x.yaml here

# Kubernetes' kubectl image: the plain schedule CronJob's container, which only creates and follows
# a RayJob; its script is checked on its own (test_the_plain_cronjob_has_kuberay_run_the_round).
KUBECTL_IMAGE = re.compile(r"registry\.k8s\.io/kubectl:v\d+\.\d+\.\d+$")

KUBERAY_KINDS = {"RayCluster": "rayclusters", "RayJob": "rayjobs", "RayService": "rayservices", "RayCronJob": "raycronjobs"}


def _manifest_files() -> list[Path]:
    return sorted(p for d in ("k8s", "kuberay") for p in (INFRA / d).glob("*.yaml"))


def _name(doc: dict) -> str | None:
    meta = doc.get("metadata", {})
    return meta.get("name") or meta.get("generateName")


def _embedded(doc: dict) -> list[tuple[str, dict]]:
    """(key, manifest) for every manifest a ConfigMap holds (a `*.yaml` key with a kind), e.g. the
    RayJob the schedule CronJob creates at each tick: checked like the files themselves."""
    if doc.get("kind") != "ConfigMap":
        return []
    out = []
    for key, text in (doc.get("data") or {}).items():
        inner = yaml.safe_load(text) if key.endswith((".yaml", ".yml")) else None
        if isinstance(inner, dict) and "kind" in inner and "apiVersion" in inner:
            out.append((key, inner))
    return out


def _documents() -> list[tuple[str, dict]]:
    """(file:index kind/name, document) for every document of every manifest file, and for every
    manifest held in a ConfigMap of one (file:index ConfigMap/name[key] kind/name)."""
    out = []
    for path in _manifest_files():
        for i, doc in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d is not None):
            where = f"{path.relative_to(REPO)}#{i} {doc.get('kind')}/{_name(doc)}"
            out.append((where, doc))
            out += [(f"{where}[{key}] {inner['kind']}/{_name(inner)}", inner) for key, inner in _embedded(doc)]
    return out


DOCS = _documents()


# ----------------------------------------------------------------------------- schemas


def _close(schema: dict) -> dict:
    """An openAPIV3Schema as the API server applies it, written as plain JSON schema (in place)."""
    if not isinstance(schema, dict):
        return schema
    for key in ("properties", "patternProperties"):
        for sub in (schema.get(key) or {}).values():
            _close(sub)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            _close(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            _close(sub)
    if schema.get("x-kubernetes-int-or-string"):
        schema.pop("type", None)
        schema.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if schema.get("nullable") and "type" in schema:
        schema["type"] = [schema["type"], "null"]
    if schema.get("x-kubernetes-embedded-resource"):
        props = schema.setdefault("properties", {})
        props.setdefault("apiVersion", {"type": "string"})
        props.setdefault("kind", {"type": "string"})
        props.setdefault("metadata", {"type": "object"})
    props = schema.get("properties")
    if props is not None and "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False  # pruned, or refused under strict field validation
    if "required" in schema and props:
        schema["required"] = [k for k in schema["required"] if "default" not in props.get(k, {})]
    return schema


_CRD_SCHEMAS: dict[tuple[str, str], dict] = {}


def crd_schema(kind: str, api_version: str) -> dict:
    if not CRD_DIR.is_dir():
        pytest.skip(f"the KubeRay CRDs are not at {CRD_DIR} (the shared folder beside the repository)")
    key = (kind, api_version)
    if key not in _CRD_SCHEMAS:
        # 0.8-1.4 MB each: libyaml's loader reads them ~5x faster than the pure-Python one.
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        crd = yaml.load((CRD_DIR / f"ray.io_{KUBERAY_KINDS[kind]}.yaml").read_text(), Loader=loader)
        group, version = api_version.split("/")
        assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind, crd["metadata"]["name"]
        versions = {v["name"]: v for v in crd["spec"]["versions"]}
        assert version in versions, f"{kind} has no version {version} (has {sorted(versions)})"
        assert versions[version]["served"], f"{kind} {version} is not served"
        _CRD_SCHEMAS[key] = _close(copy.deepcopy(versions[version]["schema"]["openAPIV3Schema"]))
    return _CRD_SCHEMAS[key]


def schema_errors(doc: dict) -> list[str]:
    """Every way ``doc`` breaks its kind's schema (empty when it is valid)."""
    import jsonschema
    import kubernetes_validate

    kind = doc.get("kind")
    if kind in KUBERAY_KINDS:
        validator = jsonschema.Draft7Validator(crd_schema(kind, doc["apiVersion"]))
        errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]
        # The CRD leaves metadata open; the API server checks it as ObjectMeta, as for any kind.
        meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata")}
        try:
            kubernetes_validate.validate(meta, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"metadata: {e.message}")
        return errors
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}"]
    return []


def _first_container(node) -> dict | None:
    if isinstance(node, dict):
        if isinstance(node.get("containers"), list) and node["containers"]:
            return node["containers"][0]
        for v in node.values():
            found = _first_container(v)
            if found is not None:
                return found
    elif isinstance(node, list):
        for v in node:
            found = _first_container(v)
            if found is not None:
                return found
    return None


def _broken_copies(doc: dict) -> list[tuple[str, dict]]:
    """Copies of ``doc`` with one misspelt field each: in its spec, and in its first container."""
    out = []
    spec_key = "spec" if "spec" in doc else next((k for k in doc if k not in ("apiVersion", "kind", "metadata")), "metadata")
    broken = copy.deepcopy(doc)
    if spec_key == "spec":
        first = next(iter(doc[spec_key]))
        broken[spec_key][first + "s"] = broken[spec_key][first]  # e.g. replicass, schedules, headGroupSpecs
        out.append((f"{spec_key}.{first}s", broken))
    else:  # kinds without a spec (Role rules, RoleBinding roleRef, ConfigMap data, ServiceAccount)
        broken[spec_key + "s"] = broken[spec_key]  # e.g. ruless, datas
        out.append((f"{spec_key}s", broken))
    broken = copy.deepcopy(doc)
    container = _first_container(broken)
    if container is not None:
        container["imagee"] = container.get("image", "x")
        out.append(("containers[0].imagee", broken))
    return out


@pytest.mark.parametrize("where,doc", DOCS, ids=[w for w, _ in DOCS])
def test_manifest_matches_its_kinds_schema(where, doc):
    errors = schema_errors(doc)
    assert not errors, f"{where}:\n  " + "\n  ".join(errors)


@pytest.mark.parametrize("where,doc", DOCS, ids=[w for w, _ in DOCS])
def test_a_misspelt_field_is_rejected(where, doc):
    for what, broken in _broken_copies(doc):
        assert schema_errors(broken), f"{where}: a copy with {what} passed the schema check"


def test_every_kind_the_operations_guide_uses_is_here():
    kinds = sorted(doc["kind"] for _, doc in DOCS)
    for kind in ("RayCluster", "RayService", "RayCronJob", "CronJob", "Deployment", "Service", "PersistentVolumeClaim", "NetworkPolicy",
                 "ServiceAccount", "Role", "RoleBinding", "ConfigMap"):
        assert kind in kinds, f"no {kind} in infra/: {kinds}"
    assert kinds.count("RayJob") >= 3  # pretraining, fine-tuning, and the plain CronJob's schedule round


# ----------------------------------------------------------------------------- security properties


def _ray_cluster_specs() -> list[tuple[str, dict]]:
    out = []
    for where, doc in DOCS:
        spec = doc.get("spec", {})
        if doc["kind"] == "RayCluster":
            out.append((where, spec))
        elif doc["kind"] == "RayJob" and "rayClusterSpec" in spec:
            out.append((where, spec["rayClusterSpec"]))
        elif doc["kind"] == "RayService":
            out.append((where, spec["rayClusterConfig"]))
        elif doc["kind"] == "RayCronJob" and "rayClusterSpec" in spec["jobTemplate"]:
            out.append((where, spec["jobTemplate"]["rayClusterSpec"]))
    return out


def test_every_ray_cluster_uses_token_auth_keeps_its_head_inside_and_is_under_the_network_policy():
    specs = _ray_cluster_specs()
    assert len(specs) >= 3
    policy_label = {"app.kubernetes.io/name": "ctx-ray"}
    for where, spec in specs:
        assert spec.get("authOptions", {}).get("mode") == "token" and spec["authOptions"].get("secretName") == "ctx-ray-token", where
        head = spec["headGroupSpec"]
        assert head.get("serviceType") == "ClusterIP", f"{where}: the head Service must stay inside the cluster"
        for group in [head, *spec.get("workerGroupSpecs", [])]:
            labels = group["template"].get("metadata", {}).get("labels", {})
            assert policy_label.items() <= labels.items(), f"{where}: a pod template without {policy_label}: the NetworkPolicy would miss it"
    for where, doc in DOCS:
        if doc["kind"] == "Service":
            assert doc["spec"].get("type", "ClusterIP") == "ClusterIP", f"{where} is reachable from outside the cluster"
        assert doc["kind"] != "Ingress", f"{where}: nothing is exposed through an Ingress"


def test_the_standing_cluster_autoscales_gpu_workers():
    (spec,) = [doc["spec"] for _, doc in DOCS if doc["kind"] == "RayCluster"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["headGroupSpec"]["rayStartParams"].get("num-gpus") == "0"
    (gpu,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "gpu"]
    assert gpu["minReplicas"] < gpu["maxReplicas"]
    assert gpu["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_network_policy_opens_gcs_dashboard_and_serve_to_the_namespace_only():
    policies = {doc["metadata"]["name"]: doc["spec"] for _, doc in DOCS if doc["kind"] == "NetworkPolicy"}
    head = policies["ctx-ray-head"]
    assert head["podSelector"]["matchLabels"]["ray.io/node-type"] == "head"
    namespace_rule = next(r for r in head["ingress"] if r["from"] == [{"podSelector": {}}])
    assert sorted(p["port"] for p in namespace_rule["ports"]) == [6379, 8000, 8265]
    for name, spec in policies.items():
        for rule in spec["ingress"]:
            for peer in rule["from"]:
                assert "ipBlock" not in peer, f"{name}: no address ranges from outside the cluster"


# ----------------------------------------------------------------------------- commands


def _env_assignment(word: str) -> bool:
    return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word) is not None


def _shell_commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line: split at && || ; | &, without redirections, `nohup` or
    leading VAR=value assignments."""
    line = re.sub(r"\d*>>?&?\s*\S+", " ", line)  # > file, 2>&1, >> log
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, current = [], []
    for word in lexer:
        if word in (";", "&", "&&", "|", "||"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    commands.append(current)
    out = []
    for words in commands:
        while words and (_env_assignment(words[0]) or words[0] in ("nohup", "exec")):
            words = words[1:]
        if words:
            out.append(words)
    return out


def _container_argvs(container: dict) -> list[list[str]]:
    """A container's commands: its command + args, or the simple commands of its `sh -c` line."""
    argv = [str(a) for a in container.get("command", []) + container.get("args", [])]
    if argv[:1] in (["sh"], ["bash"], ["/bin/sh"], ["/bin/bash"]) and "-c" in argv:
        return _shell_commands(argv[argv.index("-c") + 1])
    return [argv] if argv else []


def _commands_of(node, where: str) -> list[tuple[str, list[str]]]:
    """(where, argv) for every command in a manifest document."""
    out = []
    if isinstance(node, dict):
        if KUBECTL_IMAGE.match(str(node.get("image", ""))):  # its script runs kubectl: test_the_plain_cronjob_...
            return out
        if "image" in node and ("command" in node or "args" in node):  # a container
            out += [(where, c) for c in _container_argvs(node)]
        for key, value in node.items():
            if key == "entrypoint" and isinstance(value, str):  # RayJob / RayCronJob jobTemplate
                out += [(where, c) for c in _shell_commands(value)]
            elif key.endswith("_commands") and isinstance(value, list):  # the cluster launcher's shell lines
                out += [(where, c) for line in value for c in _shell_commands(line)]
            else:
                out += _commands_of(value, where)
    elif isinstance(node, list):
        for value in node:
            out += _commands_of(value, where)
    return out


def _all_commands() -> list[tuple[str, list[str]]]:
    out = []
    for where, doc in DOCS:
        out += _commands_of(doc, where)
    for path in sorted((INFRA / "cluster").glob("*.yaml")):
        out += _commands_of(yaml.safe_load(path.read_text()), str(path.relative_to(REPO)))
    return out


COMMANDS = _all_commands()


def _ctx_argv(argv: list[str]) -> list[str] | None:
    if argv[:1] == ["ctx"]:
        return argv[1:]
    if len(argv) >= 3 and Path(argv[0]).name.startswith("python") and argv[1:3] == ["-m", "jobs.cli"]:
        return argv[3:]
    return None


def _local(path: str) -> Path:
    return REPO / path[len(IMAGE_ROOT) + 1:] if path.startswith(IMAGE_ROOT + "/") else Path(path)


def check_ctx(argv: list[str], where: str) -> None:
    """``argv`` (after `ctx`) parses with the real parser; recipes load with their overrides; a
    `submit -- ...` carries a ctx command that passes the same check."""
    from jobs.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{where}: `ctx {shlex.join(argv)}` is not a ctx command (exit {e.code}): {err.getvalue().strip()}")
    command = argv[0]
    if command == "submit":
        rest = list(args.ctx_args)
        rest = rest[1:] if rest[:1] == ["--"] else rest
        assert rest, f"{where}: `ctx submit` without a command after --"
        check_ctx(rest, f"{where} (submitted)")
    if command in ("pretrain", "finetune"):
        from jobs.training.config import RecipeError, load_recipe
        from jobs.training.finetune_config import load_finetune_recipe

        config = _local(args.config)
        assert config.is_file(), f"{where}: --config {args.config} is not in the image ({config} is missing)"
        try:
            (load_recipe if command == "pretrain" else load_finetune_recipe)(config, args.set)
        except RecipeError as e:
            pytest.fail(f"{where}: `ctx {shlex.join(argv)}`: {e}")


def check_click(group, argv: list[str], where: str) -> None:
    """A `mlflow ...` / `ray ...` command line parses with that tool's own click CLI."""
    import click

    command = group.commands.get(argv[0])
    assert command is not None, f"{where}: `{group.name} {argv[0]}` is not a {group.name} command"
    try:
        command.make_context(argv[0], list(argv[1:]))
    except click.ClickException as e:
        pytest.fail(f"{where}: `{group.name} {shlex.join(argv)}`: {e.format_message()}")


def test_commands_were_found():
    ctx = [argv for _, argv in COMMANDS if _ctx_argv(argv) is not None]
    assert len(ctx) >= 4, COMMANDS  # pretrain, finetune (RayJobs), schedule (RayCronJob, and the plain CronJob's RayJob)
    assert any(argv[0] == "mlflow" for _, argv in COMMANDS)


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w} {shlex.join(a)[:60]}" for w, a in COMMANDS])
def test_every_command_is_real(where, argv):
    ctx = _ctx_argv(argv)
    if ctx is not None:
        check_ctx(ctx, where)
    elif argv[0] == "mlflow":
        from mlflow.cli import cli

        check_click(cli, argv[1:], where)
    elif argv[0] == "ray":
        from ray.scripts.scripts import cli

        check_click(cli, argv[1:], where)
    else:
        pytest.fail(f"{where}: `{shlex.join(argv)}` is neither ctx, python -m jobs.cli, mlflow nor ray")


@pytest.mark.parametrize("argv", [
    ["ctx", "pretrain", "--confg", "configs/bert-tiny.yaml"],
    ["ctx", "pretrain", "--config", "/app/configs/bert-tiny.yaml", "--set", "train.lrr=1"],
    ["ctx", "submit", "--address", "http://h:8265", "--", "pretrian", "--config", "x.yaml"],
    ["python", "-m", "jobs.cli", "serve", "--modle", "a=b"],
])
def test_the_command_check_rejects_what_is_not_a_ctx_command(argv):
    with pytest.raises(pytest.fail.Exception):
        check_ctx(_ctx_argv(argv), "test")


def test_the_command_check_rejects_a_bad_mlflow_flag():
    from mlflow.cli import cli

    with pytest.raises(pytest.fail.Exception):
        check_click(cli, ["server", "--backend-store-url", "sqlite:///x.db"], "test")


def test_shell_lines_split_into_commands():
    line = "cd /app && FOO=1 nohup ctx embed --model m --input i --output o > /tmp/log 2>&1 & echo 'a b'"
    assert _shell_commands(line) == [["cd", "/app"], ["ctx", "embed", "--model", "m", "--input", "i", "--output", "o"], ["echo", "a b"]]


def test_the_image_puts_the_project_where_the_manifests_look():
    """Manifests name /app/configs/...: the Dockerfile's WORKDIR, and every folder it copies exists here."""
    lines = [line.split() for line in (INFRA / "Dockerfile").read_text().splitlines() if line and not line.startswith("#")]
    assert [w[1] for w in lines if w[0] == "WORKDIR"] == [IMAGE_ROOT]
    copied = [src for w in lines if w[0] == "COPY" for src in [a for a in w[1:] if not a.startswith("--")][:-1]]
    for source in copied:
        assert (REPO / source).exists(), f"infra/Dockerfile copies {source}, which is not in the repository"
    assert {"jobs", "configs", "data"} <= set(copied)


# ----------------------------------------------------------------------------- the cluster launcher


def _launcher_errors(config: dict) -> str | None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        validate_config(prepare_config(copy.deepcopy(config)))  # what `ray up` runs, defaults first
    except Exception as e:  # jsonschema.ValidationError, ValueError
        return str(e).splitlines()[0]
    return None


def test_cluster_launcher_yaml_is_valid_for_ray_up():
    config = yaml.safe_load((INFRA / "cluster" / "aws.yaml").read_text())
    assert _launcher_errors(config) is None
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu"]["max_worker"] = 8
    assert _launcher_errors(broken) is not None
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])


# ----------------------------------------------------------------------------- RayService


def test_rayservice_serves_what_ctx_serve_build_writes(tmp_path, monkeypatch):
    """serveConfigV2 is `ctx serve build --config configs/serve/production.yaml`, byte for byte in
    YAML terms, so the cluster runs the app `ctx serve` would (app_builder validates the same args)."""
    from jobs.cli import main

    monkeypatch.delenv("CTX_API_KEYS", raising=False)  # keys from the environment would change the build
    out = tmp_path / "serve.yaml"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["serve", "build", "--config", str(REPO / "configs" / "serve" / "production.yaml"), "-o", str(out)]) == 0
    (service,) = [doc for _, doc in DOCS if doc["kind"] == "RayService"]
    deployed = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert deployed == yaml.safe_load(out.read_text()), "regenerate serveConfigV2 with `ctx serve build --config configs/serve/production.yaml`"
    assert deployed["applications"][0]["args"]["models"]["minilm"]["uri"] == "models:/minilm@production"


def test_every_cluster_node_starts_serve_as_ctx_serve_starts_its_own_ray():
    """Serve's controller and proxies read these when a node's Ray starts, not per app: every container
    of the RayService, and every node of the cluster launcher's cluster, sets SERVE_ENV and HAProxy
    ingress as jobs.serving.serve does for the Ray it starts."""
    from jobs.serving.serve import INGRESS_ENV, SERVE_ENV

    (service,) = [doc for _, doc in DOCS if doc["kind"] == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    containers = [c for pod in pods for c in pod["template"]["spec"]["containers"]]
    want = {**SERVE_ENV, "RAY_SERVE_ENABLE_HA_PROXY": INGRESS_ENV["RAY_SERVE_ENABLE_HA_PROXY"]}
    assert len(containers) == 2
    for container in containers:
        env = _container_env(container)
        assert {k: env.get(k) for k in want} == want, container["name"]
    # the cluster launcher's nodes too: their containers start with `docker run --env NAME=VALUE ...`
    launcher = yaml.safe_load((INFRA / "cluster" / "aws.yaml").read_text())
    options = dict(o.removeprefix("--env ").split("=", 1) for o in launcher["docker"]["run_options"] if o.startswith("--env "))
    assert {k: options.get(k) for k in want} == want


# ----------------------------------------------------------------------------- the cluster token's way

# What makes `ctx submit` / `ctx jobs` send the cluster token (jobs/operations/submit.py auth_headers and
# check_token_transport): one of these set, or RAY_AUTH_MODE=token.
TOKEN_VARIABLES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
DASHBOARD_VARIABLES = ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
# What KubeRay sets in every container of a cluster with authOptions {mode: token} (and so what a
# RayJob's entrypoint, run on the head, has).
KUBERAY_TOKEN_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "<from the Secret>"}


def _container_env(container: dict) -> dict[str, str]:
    """A container's variables; a value taken from a Secret, ConfigMap or field counts as set."""
    return {e["name"]: str(e["value"]) if "value" in e else f"<from {e['name']}'s valueFrom>" for e in container.get("env", [])}


def _jobs_api_addresses(argvs: list[list[str]]) -> list[str | None]:
    """The --address (None: not given) of each `ctx submit` / `ctx jobs ...` among ``argvs``: the
    commands that talk to the Jobs API through jobs/operations/submit.py's connect()."""
    from jobs.cli import build_parser

    out = []
    for argv in argvs:
        ctx = _ctx_argv(argv)
        if ctx and ctx[0] in ("submit", "jobs"):
            with contextlib.redirect_stderr(io.StringIO()):
                args, _ = build_parser().parse_known_args(ctx)
            out.append(args.address)
    return out


def _dashboard_clients(node, where: str, env: dict[str, str] | None = None) -> list[tuple[str, str | None, dict[str, str]]]:
    """(where, --address or None, environment) of every command in ``node`` that talks to a Ray
    dashboard: `ctx submit` and `ctx jobs ...` (nested in a shell line too), and any container that
    points RAY_ADDRESS / RAY_API_SERVER_ADDRESS at one (http(s)://...). ``env`` is what the place
    inherits: inside a Ray cluster spec with token auth, what KubeRay adds to every container."""
    env = env or {}
    out = []
    if isinstance(node, dict):
        if node.get("authOptions", {}).get("mode") == "token":  # a RayCluster spec: KubeRay adds the token
            env = {**env, **KUBERAY_TOKEN_ENV}
        if "image" in node and isinstance(node.get("env", []), list):  # a container
            cenv = {**env, **_container_env(node)}
            clients = [(f"{where} container {node.get('name')}", a, cenv) for a in _jobs_api_addresses(_container_argvs(node))]
            if not clients and any(cenv.get(k, "").startswith(("http://", "https://")) for k in DASHBOARD_VARIABLES):
                clients.append((f"{where} container {node.get('name')}", None, cenv))
            out += clients
        for key, value in node.items():
            if key == "entrypoint" and isinstance(value, str):  # a RayJob's, run on a token-auth cluster's head
                out += [(f"{where} entrypoint", a, {**env, **KUBERAY_TOKEN_ENV}) for a in _jobs_api_addresses(_shell_commands(value))]
            else:
                out += _dashboard_clients(value, where, env)
    elif isinstance(node, list):
        for value in node:
            out += _dashboard_clients(value, where, env)
    return out


def token_transport_error(address: str | None, env: dict[str, str]) -> str | None:
    """What `ctx submit --address ADDRESS` would refuse with, run in ``env`` (None: it goes ahead).
    The real checks of jobs/operations/submit.py: the address it resolves, and whether the token may travel there."""
    from jobs.operations.submit import SubmitError, check_token_transport, resolve_address

    try:
        resolved = resolve_address(address, env)
        headers = {"Authorization": "Bearer <the token>"} if any(env.get(k) for k in TOKEN_VARIABLES) else {}
        check_token_transport(resolved, headers, env)
    except SubmitError as e:
        return str(e)
    return None


def test_every_dashboard_client_in_the_manifests_would_be_allowed_to_send_its_token():
    """A `ctx submit` in a manifest that jobs/operations/submit.py refuses (a token over plain HTTP to a
    cluster Service, no address at all) fails at every run: the schemas and the parser cannot see it."""
    for where, address, env in [c for w, doc in DOCS for c in _dashboard_clients(doc, w)]:
        error = token_transport_error(address, env)
        assert error is None, f"{where}: `ctx submit` would refuse to run: {error}"


def test_the_token_check_catches_a_submit_over_plain_http_with_the_token():
    """The shape of the CronJob that failed at every tick: ctx submit to http://ctx-head-svc:8265
    with RAY_AUTH_TOKEN from the Secret. And the same to a loopback address or over https passes."""
    def cronjob(address: str) -> dict:
        container = {"name": "submit", "image": "ctxmodels:latest",
                     "command": ["ctx", "submit", "--address", address, "--new", "--", "schedule", "--config", "s.yaml", "--once"],
                     "env": [{"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "ctx-ray-token", "key": "auth_token"}}}]}
        return {"kind": "CronJob", "spec": {"jobTemplate": {"spec": {"template": {"spec": {"containers": [container]}}}}}}

    (client,) = _dashboard_clients(cronjob("http://ctx-head-svc:8265"), "old")
    assert "plain HTTP" in token_transport_error(client[1], client[2])
    for ok in ("https://ctx-head-svc:8265", "http://127.0.0.1:8265"):
        (client,) = _dashboard_clients(cronjob(ok), "ok")
        assert token_transport_error(client[1], client[2]) is None
    # A token that KubeRay puts into a Ray container counts, and RAY_ADDRESS is read like --address.
    head = {"authOptions": {"mode": "token"}, "containers": [
        {"name": "head", "image": "ctxmodels:latest", "env": [{"name": "RAY_ADDRESS", "value": "http://ctx-head-svc:8265"}]}]}
    (client,) = _dashboard_clients(head, "head")
    assert "plain HTTP" in token_transport_error(client[1], client[2])


# ----------------------------------------------------------------------------- the plain schedule CronJob

# kubectl's verb -> the RBAC verb it needs on the named resource (`kubectl get NAME` reads one object).
KUBECTL_RBAC_VERBS = {"create": "create", "get": "get", "delete": "delete", "patch": "patch", "apply": "patch", "wait": "get"}


def _one(kind: str, name: str) -> dict:
    found = [d for _, d in DOCS if d["kind"] == kind and d.get("metadata", {}).get("name") == name]
    assert len(found) == 1, f"expected one {kind} named {name} in infra/, found {len(found)}"
    return found[0]


def _mounted_file(pod: dict, container: dict, path: str) -> tuple[dict, str]:
    """(ConfigMap, key) that ``path`` in ``container`` is, through its volumeMounts and the pod's volumes."""
    for mount in container.get("volumeMounts", []):
        folder = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(folder):
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert "configMap" in volume, f"{path} is on volume {volume['name']}, which is not a ConfigMap"
            config_map = _one("ConfigMap", volume["configMap"]["name"])
            key = path[len(folder):]
            assert key in config_map["data"], f"{path}: ConfigMap {config_map['metadata']['name']} has no key {key}"
            return config_map, key
    pytest.fail(f"{path} is not under any volumeMount of container {container['name']}")


def test_the_plain_cronjob_has_kuberay_run_the_round(tmp_path):
    """The CronJob runs kubectl, not `ctx submit`: it creates the round's RayJob (mounted from its
    ConfigMap, a new name per tick) on the standing cluster, the same round the RayCronJob runs, as a
    ServiceAccount allowed exactly the kubectl verbs its script uses, on RayJobs, in its namespace."""
    import subprocess

    cronjob = _one("CronJob", "ctx-schedule")
    assert cronjob["spec"]["concurrencyPolicy"] == "Forbid"
    pod = cronjob["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert KUBECTL_IMAGE.match(container["image"]), container["image"]
    # kubectl is supported within one minor version of the API server the manifests are written for.
    kubectl_minor = int(container["image"].rsplit(":v", 1)[1].split(".")[1])
    assert abs(kubectl_minor - int(K8S_VERSION.split(".")[1])) <= 1, f"{container['image']} is too far from Kubernetes {K8S_VERSION}"
    assert not any(e["name"].startswith("RAY_") for e in container.get("env", [])), "the kubectl pod needs no Ray token or address"
    assert container["command"][0] == "bash" and len(container["command"]) == 2, container["command"]
    config_map, key = _mounted_file(pod, container, container["command"][1])
    script = config_map["data"][key]
    (tmp_path / key).write_text(script)
    check = subprocess.run(["bash", "-n", str(tmp_path / key)], capture_output=True, text=True)
    assert check.returncode == 0, f"{key} is not valid bash: {check.stderr}"

    # The RayJob it creates: generateName (kubectl create, one per tick), on the standing cluster,
    # running what the RayCronJob runs.
    created = re.findall(r"kubectl create -f (\S+)", script)
    assert len(created) == 1, created
    config_map, key = _mounted_file(pod, container, created[0])
    ((_, rayjob),) = [(k, d) for k, d in _embedded(config_map) if k == key]
    assert rayjob["kind"] == "RayJob" and rayjob["metadata"].get("generateName") and "name" not in rayjob["metadata"]
    (cluster,) = [d for _, d in DOCS if d["kind"] == "RayCluster"]
    assert rayjob["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    raycronjob = next(d for _, d in DOCS if d["kind"] == "RayCronJob")
    assert rayjob["spec"]["entrypoint"] == raycronjob["spec"]["jobTemplate"]["entrypoint"]

    # RBAC: the pod's ServiceAccount, bound by a RoleBinding (namespaced) to a Role that grants the
    # verbs the script uses on rayjobs.ray.io and nothing else.
    account = pod["serviceAccountName"]
    _one("ServiceAccount", account)
    bindings = [d for _, d in DOCS if d["kind"] == "RoleBinding" and {"kind": "ServiceAccount", "name": account} in d["subjects"]]
    assert [b["roleRef"]["kind"] for b in bindings] == ["Role"], bindings
    role = _one("Role", bindings[0]["roleRef"]["name"])
    needed = {KUBECTL_RBAC_VERBS[v] for v in re.findall(r"kubectl (\w+)", script)}
    assert needed == {"create", "get"}, needed
    for rule in role["rules"]:
        assert rule["apiGroups"] == ["ray.io"] and rule["resources"] == ["rayjobs"], rule
    assert {v for rule in role["rules"] for v in rule["verbs"]} == needed
    assert not any(d["kind"] in ("ClusterRole", "ClusterRoleBinding") for _, d in DOCS)
