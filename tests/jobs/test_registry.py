"""The model registry against a real ``mlflow server`` (SQLite backend) on loopback.

One server for the module (~10 s to start); every test uses its own model names.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from jobs.registry import Registry, RegistryError, parse_ref, replay, resolve
from tests.conftest import REPO, free_port


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server --backend-store-uri sqlite:///F`` on a free loopback port; yields its URL and
    stops the process group it started (the CLI and the uvicorn it runs)."""
    d = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{d / 'mlflow.db'}",
           "--default-artifact-root", str(d / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    log = open(d / "server.log", "wb")
    # No job executor: it starts seven huey consumer processes the registry never uses.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=d, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(d / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this fixture started, nothing else
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_parse_ref():
    assert parse_ref("models:/bert-tiny@production") == ("bert-tiny", "production", None)
    assert parse_ref("bert-tiny/3") == ("bert-tiny", None, 3)
    with pytest.raises(RegistryError, match="NAME@ALIAS or NAME/VERSION"):
        parse_ref("models:/bert-tiny")


def test_replay_is_a_stack_per_alias():
    from jobs.registry import LogEntry

    ops = [("promote", "production", 1), ("promote", "candidate", 3), ("promote", "production", 2),
           ("promote", "production", 2), ("rollback", "production", 2), ("rollback", "production", 1)]
    stacks, marked = replay([LogEntry(i + 1, op, a, v, 0, "") for i, (op, a, v) in enumerate(ops)])
    assert stacks == {"production": [1], "candidate": [3]}
    # promoting the live version again, and a rollback with nothing below, change nothing
    assert [e.effective for e in marked] == [True, True, True, False, True, False]


def test_register_get_resolve(mlflow_server, tmp_path):
    reg = Registry(mlflow_server)
    name = _name("reg")
    v1 = reg.register(name, "s3://ckpts/run-a/checkpoint_1", tags={"ctx.tokenizer_hash": "abc"}, run_id=None)
    v2 = reg.register(name, "s3://ckpts/run-b/checkpoint_7", tags={"ctx.tokenizer_hash": "def"}, parent=v1)
    assert (v1.version, v2.version) == (1, 2)
    got = reg.get(f"models:/{name}/2")
    assert got.source == "s3://ckpts/run-b/checkpoint_7"  # the checkpoint URI itself, not a copy
    assert got.tags["ctx.parent"] == f"{name}/1" and got.tags["ctx.tokenizer_hash"] == "def"
    assert [v.version for v in reg.versions(name)] == [1, 2]
    assert name in reg.models() and f"{name}.promotions" not in reg.models()
    # anything but models:/ passes through resolve untouched, without asking the registry
    assert resolve("runs/bert-tiny", "http://127.0.0.1:1") == ("runs/bert-tiny", None)
    with pytest.raises(RegistryError, match="no alias 'production'"):
        resolve(f"models:/{name}@production", mlflow_server)
    # a tracking server refuses local paths (MLflow's guard); the error says what to do instead
    with pytest.raises(RegistryError, match="s3://"):
        reg.register(name, str(tmp_path))


def test_promote_and_rollback(mlflow_server):
    reg = Registry(mlflow_server)
    name = _name("promo")
    for i in range(3):
        reg.register(name, f"s3://ckpts/{name}/checkpoint_{i}")
    assert reg.promote(name, 1).version == 1
    assert reg.promote(name, 3).version == 3
    assert reg.promote(name, 2, alias="candidate").aliases == ("candidate",)
    assert reg.promote(name, 2).aliases == ("candidate", "production")
    assert reg.rollback(name).version == 3
    assert reg.get(f"{name}@production").version == 3
    assert reg.rollback(name).version == 1
    with pytest.raises(RegistryError, match="no earlier version"):
        reg.rollback(name)
    assert reg.get(f"{name}@candidate").version == 2  # another alias is untouched
    with pytest.raises(RegistryError, match="has no version 9"):
        reg.promote(name, 9)
    assert [(e.op, e.version) for e in reg.history(name, "production")] == [("promote", 1), ("promote", 3), ("promote", 2), ("rollback", 2), ("rollback", 3)]


RACER = textwrap.dedent("""
    import sys, time
    from jobs.registry import Registry
    uri, name, start, versions = sys.argv[1], sys.argv[2], float(sys.argv[3]), [int(v) for v in sys.argv[4].split(",")]
    reg = Registry(uri)
    while time.time() < start:  # both processes begin together
        time.sleep(0.005)
    for i in range(int(sys.argv[5])):
        reg.promote(name, versions[i % len(versions)])
    print("done")
""")


def test_two_racing_promoters_leave_a_consistent_registry(mlflow_server, tmp_path):
    """Two processes promote different versions at once; afterwards the alias names exactly the version
    the promotion log's replay gives, every promotion is in the log, and rollback goes to the version
    production had before."""
    reg = Registry(mlflow_server)
    name = _name("race")
    for i in range(4):
        reg.register(name, f"s3://ckpts/{name}/checkpoint_{i}")
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.time() + 8  # after both interpreters have imported mlflow
    n = 6
    procs = [subprocess.Popen([sys.executable, str(script), mlflow_server, name, str(start), vs, str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for vs in ("1,2", "3,4")]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs

    history = reg.history(name, "production")
    assert len(history) == 2 * n
    by_pid: dict[str, list[int]] = {}
    for e in history:
        by_pid.setdefault(e.by, []).append(e.version)
    assert sorted(sorted(v) for v in by_pid.values()) == [[1, 1, 1, 2, 2, 2], [3, 3, 3, 4, 4, 4]]
    # the two writers' entries interleave in the log (the race happened), yet the alias agrees with it
    switches = sum(a.by != b.by for a, b in zip(history, history[1:]))
    assert switches >= 2, "the racers ran one after the other; the test proved nothing"
    stacks, _ = replay(history)
    live = reg.get(f"{name}@production")
    assert live.version == stacks["production"][-1]
    assert [v.version for v in reg.versions(name) if "production" in v.aliases] == [live.version]
    assert reg.rollback(name).version == stacks["production"][-2]


def test_ctx_models_cli(mlflow_server, capsys):
    """`ctx models` in-process against the server: promote, show (versions, tags, history), rollback,
    list; mistakes are exit 2 with a message that says what to do."""
    from jobs.cli import main

    reg = Registry(mlflow_server)
    name = _name("cli")
    reg.register(name, f"s3://ckpts/{name}/checkpoint_a", tags={"ctx.family": "bert", "ctx.kind": "pretrain", "ctx.tokenizer_hash": "0123abcd",
                                                               "ctx.metrics": json.dumps({"eval_loss": 2.5}),
                                                               "ctx.shards": json.dumps([{"uri": "s3://c/a", "size": 1000, "etag": "e1"},
                                                                                         {"uri": "s3://c/b", "size": 234, "etag": "e2"}])})
    reg.register(name, f"s3://ckpts/{name}/checkpoint_b", tags={"ctx.family": "bert", "ctx.task": "classification"}, parent=reg.get(f"{name}/1"))
    uri = ["--tracking-uri", mlflow_server]

    assert main(["models", "promote", name, "1", *uri]) == 0
    assert main(["models", "promote", name, "2", "--alias", "production", *uri]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{name}@production -> {name}/2 (s3://ckpts/{name}/checkpoint_b)"

    assert main(["models", "show", name, *uri]) == 0
    out = capsys.readouterr().out
    assert f"{name}/1 bert pretrain tokenizer 0123abcd eval_loss=2.5, 2 shard(s) 1,234 bytes" in out
    assert f"{name}/2 [production] bert classification tokenizer - parent {name}/1" in out
    assert f"production: promote {name}/1" in out and f"production: promote {name}/2" in out

    assert main(["models", "show", f"models:/{name}@production", *uri]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["ref"] == f"{name}/2" and shown["tags"]["ctx.parent"] == f"{name}/1" and shown["aliases"] == ["production"]

    assert main(["models", "rollback", name, *uri]) == 0
    assert capsys.readouterr().out.startswith(f"{name}@production -> {name}/1 ")
    assert main(["models", "list", *uri]) == 0
    assert f"{name}: 2 version(s), latest 2; production -> 1" in capsys.readouterr().out.splitlines()

    assert main(["models", "rollback", name, *uri]) == 2
    assert "no earlier version to go back to" in capsys.readouterr().err
    assert main(["models", "show", f"{name}@candidate", *uri]) == 2
    assert f"promote one: ctx models promote {name} VERSION --alias candidate" in capsys.readouterr().err


def test_ctx_models_register_an_s3_checkpoint_by_hand(mlflow_server, s3_server, s3_bucket, tmp_path, capsys):
    """What a failed registration tells people to run: the checkpoint registered as it is, with the
    tokenizer hash serving will answer and the parent given."""
    import boto3

    from jobs.cli import main
    from jobs.identity import tokenizer_hash

    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nbank\n")
    boto3.client("s3", endpoint_url=s3_server).upload_file(str(tok / "vocab.txt"), s3_bucket, "runs/r/checkpoint_9/tokenizer/vocab.txt")
    name = _name("byhand")
    reg = Registry(mlflow_server)
    reg.register(name, f"s3://{s3_bucket}/runs/r/checkpoint_1")
    source = f"s3://{s3_bucket}/runs/r/checkpoint_9"
    assert main(["models", "register", name, source, "--parent", f"{name}/1", "--tag", "ctx.note=after an outage",
                 "--tracking-uri", mlflow_server]) == 0
    assert capsys.readouterr().out.strip() == f"{name}/2 <- {source}"
    v = reg.get(f"{name}/2")
    assert v.source == source and v.tags["ctx.parent"] == f"{name}/1" and v.tags["ctx.note"] == "after an outage"
    assert v.tags["ctx.tokenizer_hash"] == tokenizer_hash(tok)


def test_an_alias_collision_in_the_store_is_tried_again(tmp_path):
    """Two writers setting one new alias at once can break the SQL store's unique key on the server
    (seen in the suite: an IntegrityError from SQLite); setting an alias again is safe, so it is
    retried. Any other error is a RegistryError at once."""
    from mlflow.exceptions import MlflowException

    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    calls = []

    def flaky(name, alias, version):
        calls.append(version)
        if len(calls) < 3:
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: registered_model_aliases.name")

    reg.client.set_registered_model_alias = flaky
    reg._set_alias("m", "production", 2)
    assert calls == ["2", "2", "2"]

    def broken(name, alias, version):
        calls.append(version)
        raise MlflowException("Registered Model with name=m not found")

    calls.clear()
    reg.client.set_registered_model_alias = broken
    with pytest.raises(RegistryError, match="set m@production .*not found"):
        reg._set_alias("m", "production", 2)
    assert calls == ["2"]
