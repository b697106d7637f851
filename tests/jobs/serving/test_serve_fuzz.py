"""A property-based fuzz of the server's own OpenAPI spec (schemathesis): no request, valid or not,
gets a 5xx, and every answer the spec declares a body for has that body.

One Serve app for the module, reached over real HTTP on loopback: a tiny pretrained BERT (embeddings,
fill-mask), a tiny BERT pair classifier (classify, rerank) and a tiny pretrained GPT (generate), all
built here from seeded weights with MiniLM's vocabulary. The spec is read from the server's
/openapi.json; every operation gets a bounded, derandomized run of examples (positive and negative
generation), so CI draws the same requests.

Generated model names are mostly strings no server has: a body hook maps each one to a served
model or leaves it unknown (chosen by its length), so the fuzz reaches the models' own code too.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest
import torch

from tests.conftest import serving

pytestmark = pytest.mark.slow

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import response_schema_conformance  # noqa: E402

V = {"vocab_size": 30522}  # MiniLM's vocabulary
MODELS = ("mlm", "pair", "gpt")
SERVES = {"/v1/classify": "pair", "/v1/rerank": "pair", "/rerank": "pair", "/predict": "pair", "/v1/fill-mask": "mlm", "/v1/generate": "gpt",
          "/embed_sparse": "sparse"}
TEI_ROUTES = ("/embed", "/rerank", "/predict", "/similarity", "/embed_all", "/embed_sparse", "/decode", "/tokenize")  # "model" optional: TEI serves one
# Routes some served model answers with a 200 (no model here tags or answers questions).
SERVED = ("POST /v1/embeddings", "POST /embeddings", "POST /embed", "POST /v1/token-embeddings", "POST /v1/classify", "POST /v1/rerank", "POST /rerank",
          "POST /v1/fill-mask", "POST /v1/generate", "POST /tokenize", "POST /predict", "POST /similarity", "POST /embed_all", "POST /embed_sparse",
          "POST /decode", "GET /info")
LIMITS = {  # small, so a generated list or number reaches each limit quickly instead of running long
    "max_inputs": 16,
    "max_chars_per_text": 2_000,
    "max_chars_per_request": 8_000,
    "max_tokens_per_request": 1_024,
    "max_token_embedding_values": 50_000,
    "max_new_tokens": 64,  # the tiny GPT reads 128 tokens: prompts and max_tokens can reach both limits
    "request_timeout_s": 60,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, minilm_dir) -> dict[str, Path]:
    from ctxmodels.checkpoint import save_checkpoint
    from ctxmodels.registry import build_model, make_config
    from ctxmodels.tasks import TaskConfig, build_task_model

    root = tmp_path_factory.mktemp("serve-fuzz")
    out = {}
    for name, family in (("mlm", "bert"), ("gpt", "gpt")):
        cfg, model = build_model(family, "tiny", V, seed=0)
        out[name] = save_checkpoint(root / name, model, family, cfg, tokenizer_dir=minilm_dir)
    task = TaskConfig(kind="classification", num_labels=2, labels=["no", "yes"])
    cfg = make_config("bert", "tiny", V)
    model = build_task_model("bert", cfg, task, torch.Generator().manual_seed(1))
    out["pair"] = save_checkpoint(root / "pair", model, "bert", cfg, tokenizer_dir=minilm_dir, task=task)
    return out


@pytest.fixture(scope="module")
def server(ray_session, checkpoints) -> str:
    with serving({
        # "sparse": the masked LM served for SPLADE (TEI's --pooling splade), reached by /embed_sparse's requests
        "models": {**{name: str(checkpoints[name]) for name in MODELS}, "sparse": {"uri": str(checkpoints["mlm"]), "splade": True}},
        "defaults": {"num_cpus": 0.25, "max_batch_size": 8},
        "limits": LIMITS,
    }) as url:
        yield url


def map_body(context, body):
    """A generated model name becomes the model that serves the route, any served one, or stays as
    generated (an unknown model), chosen by its length: deterministic, and every kind is drawn.
    Texts sent to the masked LM get its mask token, else fill-mask would only ever answer 400."""
    path = context.operation.path if context.operation is not None else ""
    if path in ("/v1/rerank", "/rerank") and isinstance(body, dict):  # one of its two bodies, TEI's or Cohere's, as a client sends it
        other = ("documents", "top_n", "return_documents") if "texts" in body else ("raw_scores", "return_text")
        body = {k: v for k, v in body.items() if k not in other}
    if path in TEI_ROUTES and isinstance(body, dict) and "model" not in body:  # TEI's clients name none; this server serves several
        return {**body, "model": SERVES.get(path, "mlm")}
    if not (isinstance(body, dict) and isinstance(body.get("model"), str)):
        return body
    choices = (SERVES.get(path, "mlm"), *MODELS, body["model"])
    body = {**body, "model": choices[len(body["model"]) % len(choices)]}
    if path == "/v1/fill-mask" and body["model"] == "mlm":
        texts = body.get("input")
        if isinstance(texts, str):
            body["input"] = texts + " [MASK]"
        elif isinstance(texts, list):
            body["input"] = [t + " [MASK]" if isinstance(t, str) else t for t in texts]
    return body


def map_query(context, query):
    """GET /info's ``model``, mapped as a body's is: a served model, or left unknown, by its length."""
    path = context.operation.path if context.operation is not None else ""
    if path != "/info" or not isinstance(query, dict):
        return query
    name = query.get("model")
    choices = (*MODELS, name) if isinstance(name, str) else MODELS
    return {**query, "model": choices[len(name if isinstance(name, str) else "") % len(choices)]}


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json", timeout=60)
    schema.hook(map_body)
    schema.hook(map_query)
    return schema


FUZZ = settings(
    max_examples=40,
    deadline=None,  # a forward pass on a loaded 2-core machine takes what it takes
    derandomize=True,  # the same requests on every run and in CI
    database=None,
    suppress_health_check=list(HealthCheck),
)


def test_no_request_gets_a_5xx_and_declared_bodies_conform(api_schema, server):
    """Every operation of the spec, positive and negative generation: no 5xx, and every status the spec
    declares a body for (the error body, FastAPI's 422) answers with that body.

    Hypothesis runs per operation here rather than through ``schema.parametrize()``: its pytest plugin
    reads ``Function._nodeid``, which pytest 9.2 no longer has."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert {"POST /v1/embeddings", "POST /v1/generate", "POST /tokenize", "GET /readyz"} <= labels, labels
    statuses: dict[str, Counter] = defaultdict(Counter)
    failures = []
    for operation in operations:
        modes = [GenerationMode.POSITIVE]
        if len(operation.body) > 0:  # a GET without parameters has no invalid request to make
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:

            @FUZZ
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case):
                response = case.call_and_validate(base_url=server, timeout=120, checks=[not_a_server_error, response_schema_conformance])
                statuses[operation.label][response.status_code] += 1

            try:
                fuzz()
            except (Exception, BaseExceptionGroup) as e:  # every operation runs; the report lists all of them
                failures.append(f"{operation.label} ({mode.value}):\n{e}")
    assert not failures, "\n\n".join(failures)
    # The fuzz reached the models, not only the request validation in front of them.
    for label in SERVED:
        assert statuses[label][200] > 0, f"{label}: no 200 in {json.dumps(statuses)}"


def test_the_server_still_answers_after_the_fuzz(server):
    """A server never dies of a client's request: after the fuzz every model still serves."""
    with httpx.Client(base_url=server, timeout=120) as c:
        assert c.get("/readyz").status_code == 200, c.get("/readyz").text
        for name in MODELS:
            r = c.post("/v1/embeddings", content=json.dumps({"model": name, "input": "still here"}), headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
        r = c.post("/embed_sparse", json={"model": "sparse", "inputs": "still here"})
        assert r.status_code == 200 and r.json()[0], r.text


def test_the_spec_declares_the_error_body_the_server_sends(server):
    """FastAPI declared {"detail": [...]} for 422, which this server never sends: conformance passed
    vacuously. Every operation now declares the real error body for 4XX and 5XX: TEI's on TEI's paths,
    OpenAI's elsewhere."""
    from jobs.serving.serve import TEI_ROUTES

    spec = httpx.get(f"{server}/openapi.json", timeout=60).json()
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    assert spec["components"]["schemas"]["ErrorBody"]["required"] == ["error"]
    assert spec["components"]["schemas"]["TeiErrorBody"]["required"] == ["error", "error_type"]
    assert TEI_ROUTES <= set(spec["paths"])
    for path, operations in spec["paths"].items():
        body = "TeiErrorBody" if path in TEI_ROUTES else "ErrorBody"
        for method, op in operations.items():
            for status in ("4XX", "5XX"):
                schema = op["responses"][status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": f"#/components/schemas/{body}"}, (method, path, status)


# ----------------------------------------------------------------------------- what the fuzz found


@pytest.mark.parametrize("temperature, top_k, top_p", [(5e-324, None, None), (1e-45, 5, None), (1.0, None, 5e-324), (5e-324, 1, 5e-324)])
def test_a_vanishing_temperature_or_top_p_picks_the_argmax(temperature, top_k, top_p):
    """Found by the fuzz: temperature 5e-324 (valid JSON, over the schema's 0) made logits / temperature
    inf - inf = nan, and top_p 5e-324 rounded to 0 in float32 emptied the nucleus; both were a 500."""
    from jobs.serving.serve_tasks import pick_token

    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert pick_token(logits, temperature, top_k, top_p, torch.Generator().manual_seed(1)) == int(logits.argmax())


def test_generate_with_a_vanishing_temperature_is_greedy_over_http(server):
    body = {"model": "gpt", "prompt": "the river bank", "max_tokens": 4, "seed": 1}
    with httpx.Client(base_url=server, timeout=120) as c:
        greedy = c.post("/v1/generate", json={**body, "temperature": 0})
        tiny = c.post("/v1/generate", json={**body, "temperature": 5e-324, "top_k": 1, "top_p": 5e-324})
    assert greedy.status_code == 200 and tiny.status_code == 200, (greedy.text, tiny.text)
    assert tiny.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]
