"""API keys and CORS on the gateway (issue 27, item 4), through a real gateway in front of the real inference service.

A gateway started with keys answers a request without one, or with another,
401 in OpenAI's shape (the official SDK raises AuthenticationError), serves
one that bears any of its keys, and keeps /health and /metrics open. With
--allowed-origins, a browser's preflight is answered without a key and the
answers (a 401 included) carry the CORS headers; the default gateway sends
none. The flags read keys from the command line, the environment (comma-
separated) and a file. Behind mutual TLS, the key's identity reaches the
inference service as the request's end client, which the grammar tier's
per-caller limit counts apart.
"""

from __future__ import annotations

import threading

import httpx2
import openai
import pytest

from gateway import config
from gateway.auth import ApiKeys, fingerprint
from gateway.config import GatewayConfig
from gateway.server import GatewayServer
from structd.bench.harness import ServiceThread
from structd.cli import build_parser
from tests.conftest import SLOW_SCHEMA, wait_until
from tests.test_tls import pki  # noqa: F401 - a fixture
from tests.test_tls_authorisation import CLIENT, GATEWAY, allowed_grammar, allowed_inference  # noqa: F401 - fixtures

KEYS = ("sk-structd-one", "sk-structd-two")
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def keyed_gateway(inference_server):
    srv = ServiceThread(GatewayServer(GatewayConfig(host="127.0.0.1", port=0, target=inference_server.target,
                                                    api_keys=KEYS, allowed_origins=(ORIGIN,))),
                        "keyed-gateway", start_timeout=60.0)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def base(keyed_gateway) -> str:
    return f"http://{keyed_gateway.target}"


def _sdk(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120.0)


def test_the_sdk_with_a_wrong_key_gets_401(base):
    with _sdk(base, "sk-wrong") as client, pytest.raises(openai.AuthenticationError) as refused:
        client.models.list()
    assert refused.value.status_code == 401
    assert refused.value.code == "invalid_api_key" and refused.value.type == "invalid_request_error"
    assert refused.value.response.headers["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize("key", KEYS)
def test_the_sdk_with_a_key_is_served(base, key):
    with _sdk(base, key) as client:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("headers", [
    pytest.param({}, id="no-header"),
    pytest.param({"authorization": "Basic c2stc3RydWN0ZC1vbmU="}, id="basic-scheme"),
    pytest.param({"authorization": "Bearer"}, id="empty-bearer"),
    pytest.param({"authorization": f"Bearer {KEYS[0]}x"}, id="longer-key"),
    pytest.param({"authorization": f"Bearer {KEYS[0][:-1]}"}, id="prefix-of-a-key"),
])
@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/v1/nowhere", "/tokenize"])
def test_every_api_path_needs_a_key(base, headers, path):
    r = httpx2.post(base + path, json={}, headers=headers, timeout=30)
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key")
    assert KEYS[0] not in r.text


def test_the_scheme_is_case_insensitive(base):
    r = httpx2.get(base + "/v1/models", headers={"authorization": f"bearer {KEYS[1]}"}, timeout=30)
    assert r.status_code == 200


def test_with_a_key_an_unknown_path_is_404(base):
    r = httpx2.get(base + "/v1/nowhere", headers={"authorization": f"Bearer {KEYS[0]}"}, timeout=30)
    assert r.status_code == 404


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_health_and_metrics_stay_open(base, path):
    assert httpx2.get(base + path, timeout=30).status_code == 200


def test_a_preflight_needs_no_key(base):
    r = httpx2.options(base + "/v1/chat/completions", timeout=30, headers={
        "origin": ORIGIN, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type, x-stainless-os"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    allowed = r.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed and "x-stainless-os" in allowed
    assert "POST" in r.headers["access-control-allow-methods"]


def test_a_preflight_from_another_origin_is_refused(base):
    r = httpx2.options(base + "/v1/chat/completions", timeout=30, headers={
        "origin": "https://evil.example", "access-control-request-method": "POST"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_answers_to_an_allowed_origin_carry_cors_headers(base):
    served = httpx2.get(base + "/v1/models", headers={"origin": ORIGIN, "authorization": f"Bearer {KEYS[0]}"},
                        timeout=30)
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == ORIGIN
    # A page can read why it was refused.
    refused = httpx2.get(base + "/v1/models", headers={"origin": ORIGIN}, timeout=30)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ORIGIN


def test_the_default_gateway_sends_no_cors_headers(gateway_url):
    r = httpx2.get(gateway_url + "/models", headers={"origin": ORIGIN}, timeout=30)
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
    preflight = httpx2.options(gateway_url + "/chat/completions", timeout=30,
                               headers={"origin": ORIGIN, "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_any_origin(inference_server):
    srv = ServiceThread(GatewayServer(GatewayConfig(host="127.0.0.1", port=0, target=inference_server.target,
                                                    allowed_origins=("*",))), "any-origin-gateway", start_timeout=60)
    try:
        r = httpx2.get(f"http://{srv.target}/v1/models", headers={"origin": "https://anywhere.example"}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    finally:
        srv.stop()


# --------------------------------------------------------------------------- configuration


def _config(argv: list[str], env: dict[str, str] | None = None) -> GatewayConfig:
    return config.from_args(build_parser(env or {}).parse_args(["gateway", *argv]))


def test_keys_come_from_flags_the_environment_and_a_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# the operator's keys\nsk-file-1\n\n  sk-file-2  \n")
    env = {"STRUCTD_GATEWAY_API_KEY": "sk-env-1, sk-env-2"}
    assert _config([]).api_keys == ()
    assert _config([], env).api_keys == ("sk-env-1", "sk-env-2")
    # Flags replace the environment's keys, as every flag replaces its variable.
    assert _config(["--api-key", "sk-a", "--api-key", "sk-b"], env).api_keys == ("sk-a", "sk-b")
    assert _config(["--api-key", "sk-a", "--api-key-file", str(keys)]).api_keys == ("sk-a", "sk-file-1", "sk-file-2")
    assert _config([], {"STRUCTD_GATEWAY_API_KEY_FILE": str(keys)}).api_keys == ("sk-file-1", "sk-file-2")
    assert _config(["--allowed-origins", "https://a.example, https://b.example"]).allowed_origins == (
        "https://a.example", "https://b.example")


def test_keys_are_never_printed():
    cfg = _config(["--api-key", "sk-secret-value"])
    assert "sk-secret-value" not in repr(cfg)


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--api-key-file", "/nonexistent/keys"], "cannot read", id="missing-file"),
    pytest.param(["--api-key", "sk a"], "whitespace", id="space-in-key"),
    pytest.param(["--api-key", "sk-\u00e9"], "printable ASCII", id="non-ascii"),
    pytest.param(["--retries", "5"], "--retries", id="retries-past-grpc-limit"),
])
def test_bad_keys_are_refused_at_start(argv, message):
    with pytest.raises(SystemExit, match=message):
        _config(argv)


def test_an_empty_key_file_is_refused(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# none yet\n\n")
    with pytest.raises(SystemExit, match="holds no key"):
        _config(["--api-key-file", str(empty)])


def test_identity_is_a_fingerprint_not_the_key():
    keys = ApiKeys(KEYS)
    assert keys.identity(KEYS[1]) == fingerprint(KEYS[1]) != fingerprint(KEYS[0])
    assert KEYS[1] not in keys.identity(KEYS[1])
    assert keys.identity("sk-other") is None and keys.identity(None) is None
    assert keys.identity("sk-\udc80") is None  # a header cannot carry it, and it must not raise either


# --------------------------------------------------------------------------- the key's identity upstream


def test_the_key_identity_is_the_end_client_behind_mutual_tls(pki, allowed_inference, allowed_grammar):  # noqa: F811
    """The gateway (its certificate allowed by the inference service) names the key's identity in
    x-structd-end-client; the grammar tier counts `certificate <replica> for <gateway>/<key identity>`."""
    srv = ServiceThread(GatewayServer(GatewayConfig(host="127.0.0.1", port=0, target=allowed_inference.target,
                                                    target_tls=pki.client_tls(pki.gateway), api_keys=KEYS)),
                        "mtls-keyed-gateway", start_timeout=60.0)
    callers = allowed_grammar.server.backend.callers
    box: dict = {}
    try:
        client = _sdk(f"http://{srv.target}", KEYS[1])
        model = client.models.list().data[0].id

        def slow():
            box["out"] = client.completions.create(
                model=model, prompt="Fill in:", max_tokens=8,
                extra_body={"structured_outputs": {"json": {**SLOW_SCHEMA, "title": "from the gateway"}}})

        t = threading.Thread(target=slow, daemon=True)
        t.start()
        who = f"certificate {CLIENT} for {GATEWAY}/{fingerprint(KEYS[1])}"
        wait_until(lambda: allowed_grammar.run_sync(lambda: callers.waiting(who)) == 1, "the key's slow compile")
        t.join(120)
        assert box["out"].choices[0].finish_reason in ("stop", "length")
        client.close()
    finally:
        srv.stop()
