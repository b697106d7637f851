"""What `ctx submit` and `ctx jobs` decide before talking to a cluster: the submission id, the
project root, the address, the token's transport and the upload excludes. No Ray head needed (the
upload itself is tested against a real head in test_submit.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jobs.operations.submit import (
    EXCLUDES,
    SubmitError,
    check_token_transport,
    named_config_files,
    project_root,
    resolve_address,
    submission_id,
)
from tests.conftest import REPO

ADDRESS = "http://127.0.0.1:8265"


def test_submission_id_is_the_same_for_the_same_run_and_changes_with_what_defines_it(tmp_path):
    (tmp_path / "configs").mkdir()
    config = tmp_path / "configs" / "run.yaml"
    config.write_text("name: a\n")
    args = ["pretrain", "--config", "configs/run.yaml", "--set", "train.max_steps=5"]
    first = submission_id(args, ADDRESS, tmp_path)
    assert first.startswith("ctx-pretrain-") and first == submission_id(list(args), ADDRESS + "/", tmp_path)
    assert submission_id(args[:-1] + ["train.max_steps=6"], ADDRESS, tmp_path) != first  # another argument
    assert submission_id(args, "http://127.0.0.1:9999", tmp_path) != first  # another cluster
    config.write_text("name: b\n")
    assert submission_id(args, ADDRESS, tmp_path) != first  # the same file name with other contents
    assert submission_id(["tokenizer", "train", "--kind", "wordpiece"], ADDRESS, tmp_path).startswith("ctx-tokenizer-train-")


def test_a_config_the_job_cannot_see_is_refused(tmp_path):
    outside = tmp_path / "elsewhere.yaml"
    outside.write_text("name: a\n")
    root = tmp_path / "project"
    root.mkdir()
    with pytest.raises(SubmitError, match="not a file in the project root"):
        named_config_files(["pretrain", "--config", str(outside)], root)
    with pytest.raises(SubmitError, match="not a file in the project root"):
        named_config_files(["finetune", "--config=missing.yaml"], root)
    assert named_config_files(["serve", "--model", "m=s3://b/x.yaml"], root) == []  # remote: not ours to hash


def test_the_project_root_comes_from_the_package_not_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert project_root() == REPO and (project_root() / "pyproject.toml").is_file()


def test_address_and_environment_must_agree(monkeypatch):
    env = {"RAY_ADDRESS": "http://10.0.0.5:8265"}
    with pytest.raises(SubmitError) as e:
        resolve_address("http://127.0.0.1:8265", env)
    assert "http://127.0.0.1:8265" in str(e.value) and "RAY_ADDRESS=http://10.0.0.5:8265" in str(e.value)
    with pytest.raises(SubmitError, match="RAY_API_SERVER_ADDRESS"):  # the one Ray reads first
        resolve_address("http://127.0.0.1:8265", {"RAY_API_SERVER_ADDRESS": "http://127.0.0.1:1", "RAY_ADDRESS": "http://127.0.0.1:8265"})
    assert resolve_address("http://10.0.0.5:8265/", env) == "http://10.0.0.5:8265/"  # the same, spelled with a slash
    assert resolve_address(None, env) == "http://10.0.0.5:8265"
    with pytest.raises(SubmitError, match="pass --address"):
        resolve_address(None, {})
    with pytest.raises(SubmitError, match="RAY_ADDRESS=10.0.0.5:6379: expected the dashboard's URL"):
        resolve_address(None, {"RAY_ADDRESS": "10.0.0.5:6379"})


def test_a_token_is_never_sent_over_plain_http_off_loopback():
    bearer = {"Authorization": "Bearer secret"}
    with pytest.raises(SubmitError, match="plain HTTP to 10.1.2.3"):
        check_token_transport("http://10.1.2.3:8265", bearer, {})
    with pytest.raises(SubmitError, match="plain HTTP to head.example.com"):
        check_token_transport("http://head.example.com:8265", {}, {"RAY_AUTH_MODE": "token"})  # Ray's client would add it
    for ok in ("https://head.example.com", "http://127.0.0.1:8265", "http://localhost:8265", "http://[::1]:8265"):
        check_token_transport(ok, bearer, {})
    check_token_transport("http://10.1.2.3:8265", {}, {"RAY_AUTH_MODE": "disabled"})  # no token, nothing to leak


def test_ctx_jobs_refuses_before_connecting(tmp_path):
    """The CLI's exit code and message for both refusals (the address is unroutable: a connection
    attempt would hang, a refusal is immediate)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_TOKEN": "secret", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_API_SERVER_ADDRESS", None)
    cmd = [sys.executable, "-m", "jobs.cli", "jobs", "list", "--address", "http://203.0.113.7:8265"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "refusing to send the cluster token over plain HTTP" in proc.stderr, proc.stderr
    proc = subprocess.run(cmd, cwd=tmp_path, env={**env, "RAY_ADDRESS": "http://203.0.113.8:8265"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "disagrees with RAY_ADDRESS=http://203.0.113.8:8265" in proc.stderr, proc.stderr


def test_excludes_cover_secrets_and_build_output_and_keep_the_code():
    from ray._private.thirdparty.pathspec import PathSpec  # what Ray matches runtime_env excludes with

    spec = PathSpec.from_lines("gitwildmatch", EXCLUDES)
    for secret in (".env", ".env.production", "configs/.env", "deploy/tls.key", "server.pem", "id_rsa", "id_ed25519.pub",
                   ".aws/credentials", ".ssh/config", ".gcp/key.json", ".azure/config", "kubeconfig", ".kube/config",
                   "credentials.json", "gcs-credentials.json", ".netrc"):
        assert spec.match_file(secret), secret
    for built in (".venv/bin/python", ".venv-infinity/x", "runs/bert-tiny/LOCK.json", ".git/HEAD", "jobs/__pycache__/cli.cpython-311.pyc",
                  "ctxmodels.egg-info/PKG-INFO", "build/lib/x.py"):
        assert spec.match_file(built), built
    for kept in ("jobs/cli.py", "pyproject.toml", "configs/bert-tiny.yaml", "data/sample/wordnet-0000-of-0008.txt.gz",
                 "ctxmodels/bert.py", "infra/k8s/raycluster.yaml", "data/tasks/qa/train.jsonl"):
        assert not spec.match_file(kept), kept
