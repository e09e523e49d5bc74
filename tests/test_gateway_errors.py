"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with HTTP statuses mapped from
the gRPC codes (gateway/errors.py): through the `openai` SDK (the exceptions its users catch) and as raw HTTP."""

from __future__ import annotations

import grpc
import httpx2
import openai
import pytest

from gateway.errors import ApiError, from_exception, from_status

USER = [{"role": "user", "content": "Hi"}]


def assert_openai_shaped(body: dict, status_type: str, param=None) -> None:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == status_type and error["param"] == param


def test_invalid_schema_is_a_bad_request(openai_client, served_model):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(
            model=served_model, messages=USER, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {
                "name": "broken", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}})
    assert e.value.status_code == 400
    assert_openai_shaped(e.value.response.json(), "invalid_request_error")
    assert e.value.body["code"] == "invalid_argument"


def test_unknown_model_is_404(openai_client):
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)
    body = e.value.response.json()
    assert_openai_shaped(body, "invalid_request_error", "model")
    assert body["error"]["message"] == "The model `gpt-4o` does not exist."
    assert body["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("extra, param", [
    pytest.param({"n": 0}, "n", id="n-zero"),
    pytest.param({"presence_penalty": 2.5}, "presence_penalty", id="presence_penalty-range"),
    pytest.param({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", id="two-constraints"),
])
def test_refused_parameters_are_named(openai_client, served_model, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=served_model, messages=USER, max_tokens=2, extra_body=extra)
    assert_openai_shaped(e.value.response.json(), "invalid_request_error", param)


def test_a_stream_refused_upstream_gets_its_status_not_an_event(gateway_url, served_model):
    """A stream's headers go out with its first token: a refusal before it is a plain HTTP error."""
    body = {"model": served_model, "prompt": "x", "stream": True, "max_tokens": 4,
            "structured_outputs": {"regex": "("}}
    r = httpx2.post(f"{gateway_url}/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert_openai_shaped(r.json(), "invalid_request_error")


@pytest.mark.parametrize("method, path, content, status", [
    pytest.param("POST", "/completions", b"{not json", 400, id="malformed-json"),
    pytest.param("POST", "/completions", b"[1]", 400, id="not-an-object"),
    pytest.param("GET", "/no-such-route", None, 404, id="unknown-route"),
    pytest.param("GET", "/completions", None, 405, id="wrong-method"),
])
def test_raw_http_errors_are_openai_shaped(gateway_url, method, path, content, status):
    r = httpx2.request(method, gateway_url + path, content=content, headers={"content-type": "application/json"},
                       timeout=30)
    assert r.status_code == status
    assert_openai_shaped(r.json(), "invalid_request_error")


# One rule (issue 24): a request that can never succeed is a 4xx the OpenAI SDKs do not retry; "try later"
# (overloaded, a replica gone, a token the two tiers disagreed on) is a status they retry (408, 409, 429, 5xx).
NEVER_SUCCEEDS, TRY_LATER = "never succeeds", "try later"


@pytest.mark.parametrize("code, status, kind", [
    pytest.param(grpc.StatusCode.INVALID_ARGUMENT, 400, NEVER_SUCCEEDS, id="invalid-argument"),
    pytest.param(grpc.StatusCode.FAILED_PRECONDITION, 400, NEVER_SUCCEEDS, id="failed-precondition"),
    pytest.param(grpc.StatusCode.OUT_OF_RANGE, 400, NEVER_SUCCEEDS, id="out-of-range"),
    pytest.param(grpc.StatusCode.UNAUTHENTICATED, 401, NEVER_SUCCEEDS, id="unauthenticated"),
    pytest.param(grpc.StatusCode.PERMISSION_DENIED, 403, NEVER_SUCCEEDS, id="permission-denied"),
    pytest.param(grpc.StatusCode.NOT_FOUND, 404, NEVER_SUCCEEDS, id="not-found"),
    pytest.param(grpc.StatusCode.ABORTED, 409, TRY_LATER, id="aborted-is-retried-by-the-sdks"),
    pytest.param(grpc.StatusCode.ALREADY_EXISTS, 409, TRY_LATER, id="already-exists"),
    pytest.param(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, TRY_LATER, id="resource-exhausted"),
    pytest.param(grpc.StatusCode.CANCELLED, 499, NEVER_SUCCEEDS, id="cancelled-only-logs-see-it"),
    pytest.param(grpc.StatusCode.UNIMPLEMENTED, 501, TRY_LATER, id="unimplemented-a-deployment-fault"),
    pytest.param(grpc.StatusCode.UNAVAILABLE, 503, TRY_LATER, id="unavailable"),
    pytest.param(grpc.StatusCode.DEADLINE_EXCEEDED, 504, TRY_LATER, id="deadline-exceeded"),
    pytest.param(grpc.StatusCode.INTERNAL, 500, TRY_LATER, id="internal"),
    pytest.param(grpc.StatusCode.UNKNOWN, 500, TRY_LATER, id="unknown"),
    pytest.param(grpc.StatusCode.DATA_LOSS, 500, TRY_LATER, id="data-loss"),
])
def test_grpc_codes_map_to_http_statuses(openai_sdk, code, status, kind):
    error = from_status(code, "internal error (incident 0123456789ab); see the server log")
    assert error.status == status and error.code == code.name.lower()
    assert error.message == "internal error (incident 0123456789ab); see the server log", "passed on as it is"
    retried = openai_sdk._should_retry(httpx2.Response(status))
    assert retried == (kind == TRY_LATER), f"the OpenAI SDKs {'retry' if retried else 'do not retry'} {status}"


def test_every_grpc_code_has_a_row():
    rows = {p.values[0] for p in test_grpc_codes_map_to_http_statuses.pytestmark[0].args[1]}
    assert rows == set(grpc.StatusCode) - {grpc.StatusCode.OK}


@pytest.mark.parametrize("error, status", [
    pytest.param(ApiError(413, "too large", "invalid_request_error"), 413, id="too-large-never-succeeds"),
    pytest.param(ApiError(503, "overloaded", "service_unavailable_error"), 503, id="overloaded-try-later"),
])
def test_the_gateways_own_answers_follow_the_rule(openai_sdk, error, status):
    assert from_exception(error).status == status
    assert openai_sdk._should_retry(httpx2.Response(status)) == (status >= 500)


@pytest.fixture(scope="module")
def openai_sdk():
    """An OpenAI SDK client, for its own retry rule (no request is made)."""
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused")
    yield client
    client.close()


def test_a_gateway_bug_is_a_500_with_an_incident_id():
    error = from_exception(RuntimeError("secret internals"))
    assert (error.status, error.type) == (500, "server_error")
    assert "incident" in error.message and "secret" not in error.message


def test_an_engine_that_dies_mid_stream_ends_the_stream_with_an_error_event(grammar_server):
    """After the headers (200, text/event-stream) the status can no longer change: the stream's last chunk is an
    OpenAI error object, then [DONE]. Its own servers: the engine's core process is killed (SIGKILL) under it."""
    import json
    import os
    import signal

    from gateway.config import GatewayConfig
    from gateway.server import GatewayServer
    from inference_svc.config import EngineConfig, InferenceServiceConfig
    from structd.bench.harness import ServiceThread
    from tests.conftest import InferenceServerThread, wait_until

    cfg = InferenceServiceConfig(host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar_server.target,),
                                 simulate_step_ms=5.0, grace_seconds=1.0, served_model_name="dying-engine",
                                 engine=EngineConfig(max_num_seqs=4, default_max_tokens=32))
    inference = InferenceServerThread(cfg, engine_process="on", start_timeout=180.0)
    gateway = None
    try:
        gateway = ServiceThread(GatewayServer(GatewayConfig(host="127.0.0.1", port=0, target=inference.target)),
                                "gateway", start_timeout=60.0)
        body = {"model": "dying-engine", "prompt": "Go on:", "stream": True, "max_tokens": 5000, "ignore_eos": True}
        with httpx2.stream("POST", f"http://{gateway.target}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # streaming now
            wait_until(lambda: inference.run_sync(lambda: inference.server.engine.num_active) == 1, "generating")
            os.kill(inference.server.engine._process.pid, signal.SIGKILL)
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert_openai_shaped(last, "service_unavailable_error")
        assert "retry" in last["error"]["message"]
        assert all("error" not in json.loads(e) for e in events[:-2])
    finally:
        if gateway is not None:
            gateway.stop()
        inference.stop()
