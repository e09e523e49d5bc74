"""A client that goes away cancels its gRPC call: the inference service stops generating and frees the request.

Seen from the inference service itself: its engine's active requests drop
back to zero long before the request's 3,000 tokens, and its requests counter
records the request as cancelled. The gateway counts the disconnect; a constrained request's grammar session is closed on its replica.
"""

from __future__ import annotations

import json
import socket

import httpx2
import pytest

from tests.conftest import wait_until

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 1.0}


def active(inference_server) -> int:
    return inference_server.run_sync(lambda: inference_server.server.engine.num_active)


def cancelled(inference_server) -> float:
    return inference_server.server.metrics.registry.get_sample_value(
        "inference_svc_requests_total", {"constrained": "false", "finish_reason": "cancelled"}) or 0.0


def disconnects(gateway_server, route: str) -> float:
    return gateway_server.server.metrics.registry.get_sample_value(
        "gateway_client_disconnects_total", {"route": route}) or 0.0


@pytest.fixture
def idle(inference_server):
    wait_until(lambda: active(inference_server) == 0, "the engine is idle before the test", timeout=120)


def test_closing_a_stream_cancels_the_call(gateway_server, gateway_url, inference_server, served_model, idle):
    before, gone = cancelled(inference_server), disconnects(gateway_server, "/v1/completions")
    body = {"model": served_model, "prompt": "Go on:", "stream": True, **LONG}
    with httpx2.stream("POST", f"{gateway_url}/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # generating now
        assert active(inference_server) == 1
    wait_until(lambda: active(inference_server) == 0, "the engine dropped the request", timeout=60)
    wait_until(lambda: cancelled(inference_server) == before + 1, "counted as cancelled by the inference service")
    wait_until(lambda: disconnects(gateway_server, "/v1/completions") == gone + 1, "counted by the gateway")


def test_leaving_a_non_streamed_request_cancels_the_call(gateway_server, inference_server, served_model, idle):
    before, gone = cancelled(inference_server), disconnects(gateway_server, "/v1/chat/completions")
    body = json.dumps({"model": served_model, "messages": [{"role": "user", "content": "Go on"}], **LONG}).encode()
    host, port = gateway_server.target.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: active(inference_server) == 1, "the request is generating", timeout=60)
    wait_until(lambda: active(inference_server) == 0, "the engine dropped the request", timeout=60)
    wait_until(lambda: cancelled(inference_server) == before + 1, "counted as cancelled by the inference service")
    wait_until(lambda: disconnects(gateway_server, "/v1/chat/completions") == gone + 1, "counted by the gateway")


DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1000,
          "maxItems": 1000}


def test_closing_a_constrained_stream_frees_its_grammar_session(gateway_server, gateway_url, inference_server,
                                                                 grammar_server, served_model, idle):
    sessions = lambda: grammar_server.server.metrics.registry.get_sample_value("grammar_svc_active_sessions")  # noqa: E731
    get = inference_server.server.metrics.registry.get_sample_value
    labels = {"constrained": "true", "finish_reason": "cancelled"}
    wait_until(lambda: sessions() == 0, "earlier tests' grammar sessions closed", timeout=10)
    before = get("inference_svc_requests_total", labels) or 0.0
    body = {"model": served_model, "messages": [{"role": "user", "content": "Digits"}], "stream": True,
            "max_tokens": 3000, "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "digits", "schema": DIGITS}}}
    with httpx2.stream("POST", f"{gateway_url}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_raw())  # generating now, under its grammar session
        assert active(inference_server) == 1 and sessions() == 1
    wait_until(lambda: active(inference_server) == 0, "the engine dropped the request", timeout=60)
    wait_until(lambda: (get("inference_svc_requests_total", labels) or 0.0) == before + 1,
               "counted as a cancelled constrained request")
    wait_until(lambda: sessions() == 0, "the grammar session was closed on the replica", timeout=10)
