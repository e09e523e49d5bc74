"""Hostile request bodies at the gateway (issue 24), through the real server: each is refused with a 4xx
that names the limit or the field, overload is a 503, and ordinary requests go on.

The session's gateway (tests/conftest.py) runs with the default limits; the
budget and concurrency cases start a small gateway of their own in front of
the session's inference service, and the model-info case puts a TCP relay
that can stop forwarding (a black-holed replica) between a gateway and it.
"""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import uuid

import httpx2
import pytest

from gateway.body import MAX_NESTING, MAX_VALUES
from gateway.config import GatewayConfig
from gateway.server import GatewayServer
from structd.bench.harness import ServiceThread
from tests.conftest import wait_until


def post(gateway_url: str, route: str, raw: bytes) -> httpx2.Response:
    return httpx2.post(f"{gateway_url}/{route}", content=raw, headers={"content-type": "application/json"},
                       timeout=120)


def assert_refused(r: httpx2.Response, status: int, param: str | None, *words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error["message"]


def assert_ordinary_request_works(gateway_url: str, served_model: str) -> None:
    r = httpx2.post(f"{gateway_url}/completions", json={"model": served_model, "prompt": "Hi", "max_tokens": 2},
                    timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def held_request(target: str, content_length: int) -> socket.socket:
    """A connection that sent a completion request's headers and all of its body but the last byte, and waits."""
    host, port = target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    start = b'{"prompt": "'
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % content_length + start + b"x" * (content_length - len(start) - 1))
    return sock


# --------------------------------------------------------------------------- size and shape


def test_a_body_declared_larger_than_the_limit_is_413_before_it_is_read(gateway_server):
    host, port = gateway_server.target.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % (16 << 20))
        answer = b""
        while chunk := sock.recv(65536):  # the gateway closes the connection after the answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 ") and b"larger than 4194304 bytes" in answer
    # Closed with the answer: the body it never read is not taken for the next request.
    assert b"\r\nconnection: close\r\n" in answer.lower()


def test_many_small_values_are_413_naming_the_limit(gateway_url, served_model):
    """`[{},{},...]` parses to about 25 times its size: refused before it is parsed."""
    raw = b'{"prompt": "Hi", "junk": [' + b"{}," * MAX_VALUES + b"{}]}"
    assert len(raw) < 4 << 20, "under the byte limit: refused for its shape"
    assert_refused(post(gateway_url, "completions", raw), 413, None, f"more than {MAX_VALUES} JSON values")
    assert_ordinary_request_works(gateway_url, served_model)


@pytest.mark.parametrize("route, raw, param", [
    pytest.param("completions", b'{"prompt": "Hi", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}", None,
                 id="body-1000-deep"),
    pytest.param("chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "response_format": '
                 b'{"type": "json_schema", "json_schema": {"name": "s", "schema": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1000
                 + b"}}}", None, id="schema-object-1000-deep"),
    pytest.param("chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], "response_format": '
                 b'{"type": "json_schema", "json_schema": {"name": "s", "schema": "' + b"[" * 1000 + b"]" * 1000 + b'"}}}',
                 "response_format.json_schema.schema", id="schema-text-1000-deep"),
])
def test_deep_nesting_is_400_naming_the_limit(gateway_url, served_model, route, raw, param):
    assert_refused(post(gateway_url, route, raw), 400, param, f"deeper than {MAX_NESTING} levels")
    assert_ordinary_request_works(gateway_url, served_model)


def test_the_parsed_body_is_not_kept_while_its_generation_runs(gateway_url, served_model, inference_server):
    """Unknown fields (and the rest of the parsed body) are gone once the request is translated: the generation
    keeps only its GenerateRequest."""
    marker = f"unknown_{uuid.uuid4().hex}"
    # Written as text: no dict in this process holds the marker but the gateway's parsed body.
    raw = (f'{{"model": "{served_model}", "prompt": "Once", "max_tokens": 256, "ignore_eos": true, '
           f'"{marker}": [1]}}').encode()
    running = lambda: inference_server.server.metrics.registry.get_sample_value(  # noqa: E731
        "inference_svc_num_requests_running") or 0
    box = {}
    t = threading.Thread(target=lambda: box.update(r=post(gateway_url, "completions", raw)), daemon=True)
    t.start()
    wait_until(lambda: running() >= 1 or not t.is_alive(), "the request reached the engine")
    kept = [o for o in gc.get_objects() if type(o) is dict and marker in o]
    still_generating = running() >= 1 and t.is_alive()
    t.join(120)
    assert box["r"].status_code == 200
    assert still_generating, "the generation ended before the look at the gateway's objects: give it more tokens"
    assert not kept
    assert_ordinary_request_works(gateway_url, served_model)


# --------------------------------------------------------------------------- numbers and strings


@pytest.mark.parametrize("field, value, words", [
    pytest.param("max_tokens", b"Infinity", ("between 1 and 2147483647", "got inf"), id="max_tokens-Infinity"),
    pytest.param("max_tokens", b"1e400", ("between 1 and 2147483647",), id="max_tokens-1e400"),
    pytest.param("max_tokens", b"3000000000", ("between 1 and 2147483647", "got 3000000000"), id="max_tokens-int32"),
    pytest.param("min_tokens", b"-3000000000", ("between 0 and 2147483647",), id="min_tokens-int32"),
    pytest.param("thinking_token_budget", b"2147483648", ("between 0 and 2147483647",), id="thinking-budget-int32"),
    pytest.param("top_k", b"1e20", ("between -1 and 2147483647",), id="top_k-1e20"),
    pytest.param("n", b"1e400", ("between 1 and 2147483647",), id="n-1e400"),
    pytest.param("temperature", b"NaN", ("a number between 0.0 and", "got nan"), id="temperature-NaN"),
    pytest.param("temperature", b"1e39", ("a number between 0.0 and",), id="temperature-past-float32"),
    pytest.param("seed", b"18446744073709551616", ("between -9223372036854775808 and 18446744073709551615",),
                 id="seed-past-uint64"),
])
def test_numbers_out_of_the_fields_range_are_400_naming_the_field_and_range(gateway_url, served_model, field,
                                                                              value, words):
    raw = b'{"model": "%s", "prompt": "Hi", "%s": %s}' % (served_model.encode(), field.encode(), value)
    assert_refused(post(gateway_url, "completions", raw), 400, field, f"'{field}'", *words)


def test_nan_in_a_schema_is_400(gateway_url):
    raw = (b'{"messages": [{"role": "user", "content": "Hi"}], "response_format": {"type": "json_schema", '
           b'"json_schema": {"name": "s", "schema": {"type": "number", "maximum": NaN}}}}')
    assert_refused(post(gateway_url, "chat/completions", raw), 400, "response_format.json_schema.schema",
                   "not valid JSON")


def test_an_unpaired_surrogate_is_400(gateway_url):
    assert_refused(post(gateway_url, "completions", b'{"prompt": "Hi \\ud800"}'), 400, None, "not valid Unicode")


def test_a_negative_seed_is_its_64_bit_twos_complement(openai_client, served_model):
    """OpenAI and vLLM take negative seeds; the proto's seed is a uint64."""
    def sample(seed: int) -> str:
        return openai_client.completions.create(model=served_model, prompt="Once upon a time", max_tokens=8,
                                                temperature=1.0, seed=seed).choices[0].text

    assert sample(-1) == sample(2**64 - 1)
    assert sample(-(2**63)) == sample(2**63)


# --------------------------------------------------------------------------- overload


@contextlib.contextmanager
def small_gateway(target: str, **config):
    srv = ServiceThread(GatewayServer(GatewayConfig(port=0, target=target, **config)), "gateway-small",
                        start_timeout=60.0)
    try:
        yield srv
    finally:
        srv.stop()


def test_bodies_past_the_in_flight_budget_are_503_until_it_frees(inference_server, served_model):
    with small_gateway(inference_server.target, max_body_bytes=4096, max_body_bytes_in_flight=4096) as srv:
        url = f"http://{srv.target}/v1"
        held = held_request(srv.target, 4096)
        try:
            wait_until(lambda: srv.server.intake.in_flight == 4095, "the held body's bytes are reserved")
            r = httpx2.post(f"{url}/completions", json={"model": served_model, "prompt": "Hi", "max_tokens": 2},
                            timeout=60)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        finally:
            held.close()
        wait_until(lambda: srv.server.intake.in_flight == 0, "the held body's reservation given back")
        assert_ordinary_request_works(url, served_model)


def test_connections_past_limit_concurrency_are_503(inference_server, served_model):
    with small_gateway(inference_server.target, limit_concurrency=2) as srv:
        url = f"http://{srv.target}/v1"
        held = held_request(srv.target, 4000)
        try:
            wait_until(lambda: srv.server.intake.in_flight == 3999, "the held request is being served")
            assert httpx2.get(f"{url}/models", timeout=60).status_code == 503
        finally:
            held.close()
        wait_until(lambda: srv.server.intake.in_flight == 0, "the held request gone")
        assert_ordinary_request_works(url, served_model)


# --------------------------------------------------------------------------- a black-holed upstream


class Relay:
    """A TCP relay to `target` that can stop forwarding (connections stay open, bytes vanish)."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.black_holed = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not self.black_holed.is_set():
                    dst.sendall(data)

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()


def test_a_black_holed_upstream_does_not_stall_requests_while_model_info_is_cached(inference_server):
    """The model info is refreshed on every request here (TTL 0): with the upstream black-holed, requests are
    answered from the cached info while one refresh waits out its deadline; only a gateway with nothing cached
    fails (504: the deadline)."""
    relay = Relay(inference_server.target)
    try:
        with small_gateway(relay.target, model_info_ttl_seconds=0.0) as srv:
            models = f"http://{srv.target}/v1/models"
            served = httpx2.get(models, timeout=30).json()["data"][0]["id"]
            relay.black_holed.set()
            for _ in range(3):
                r = httpx2.get(models, timeout=30)
                assert r.status_code == 200 and r.json()["data"][0]["id"] == served
        with small_gateway(relay.target) as never_answered:
            r = httpx2.get(f"http://{never_answered.target}/v1/models", timeout=30)
            assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
    finally:
        relay.close()
