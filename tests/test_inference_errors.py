"""Generate's status codes: every error a client can cause or meet, each with a message that says what to do.

Limits, a lost grammar tier and draining run on a second inference server
with the simulated runner (it starts in seconds and its steps take a fixed
time), wired to a grammar replica of its own that the last tests stop.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest

from shared.inference_client import InferenceClient, InferenceError
from structd.bench.harness import free_port
from tests.conftest import (TOO_SLOW_SCHEMA, InferenceServerThread, background_complete, require_tool,
                            start_grammar_server, wait_until)

BAD = [
    pytest.param(dict(prompt=""), "prompt is empty", id="empty-prompt"),
    pytest.param(dict(temperature=-1.0), "temperature", id="negative-temperature"),
    pytest.param(dict(top_p=1.5), "top_p", id="top-p-above-1"),
    pytest.param(dict(top_k=-3), "top_k", id="negative-top-k"),
    pytest.param(dict(max_tokens=1_000_000), "max_tokens", id="max-tokens-past-context"),
    pytest.param(dict(stop=[""]), "stop", id="empty-stop-string"),
    pytest.param(dict(json_schema="{not json"), "constraint", id="schema-not-json"),
    pytest.param(dict(json_schema='{"type": "no-such-type"}'), "constraint", id="schema-bad-type"),
    pytest.param(dict(regex="[a-"), "constraint", id="regex-unterminated"),
    pytest.param(dict(ebnf="root ::= missing_rule"), "constraint", id="ebnf-undefined-rule"),
    pytest.param(dict(regex=""), "constraint.regex is empty", id="regex-empty"),
    pytest.param(dict(choice=[]), "choice", id="choice-empty"),
    pytest.param(dict(structural_tag="[]"), "constraint", id="structural-tag-not-object"),
]


@pytest.mark.parametrize("kwargs, needle", BAD)
def test_invalid_argument_names_the_problem(inference_client, kwargs, needle):
    prompt = kwargs.pop("prompt", "hi")
    with pytest.raises(InferenceError) as err:
        inference_client.complete(prompt, **kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.message
    assert "Traceback" not in err.value.message


def test_compile_deadline_is_deadline_exceeded(simulated):
    with InferenceClient(simulated.target) as client, pytest.raises(InferenceError) as err:
        client.complete("x", json_schema=TOO_SLOW_SCHEMA)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline" in err.value.message


def test_client_deadline_frees_the_request(inference_client, inference_server):
    with pytest.raises(InferenceError) as err:
        inference_client.complete("long", max_tokens=400, ignore_eos=True, timeout=0.5)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 30
    while inference_server.run_sync(lambda: inference_server.server.engine.num_active):
        assert time.monotonic() < deadline, "the timed-out request still holds engine state"
        time.sleep(0.05)


# Matches nothing the model may write under DESYNC_REGEX: a session switched to it rejects the next token.
OTHER_GRAMMAR = "z"
DESYNC_REGEX = "[0-9]{300}"


def _switch_grammar(grammar_server, grammar_id: str, session_id: int, regex: str) -> int:
    """Gives the request's session on the replica, between two of its steps (under its stream's lock), a matcher
    of another grammar: the replica's state diverges from the mask the engine last sampled under, which no
    correct replica does, and the engine's handling of it is what is tested. Returns how many it switched."""
    import xgrammar as xgr

    switched = 0
    for stream in grammar_server.server.limiter.streams:
        with stream.lock:
            session = stream._sessions.get(session_id)
            if session is not None and session.entry.grammar_id == grammar_id:
                other = xgr.GrammarCompiler(session.entry.tokenizer.info).compile_regex(regex)
                session.matcher = xgr.GrammarMatcher(other)
                switched += 1
    return switched


def test_a_token_the_grammar_rejects_fails_the_request_as_aborted(inference_server, grammar_server):
    """The grammar-rejected-token path: GrammarDesyncError, ABORTED (safe to retry), the message names the token;
    the request's grammar session and engine state are freed."""
    with InferenceClient(inference_server.target) as client:
        stream = client.generate("digits:", regex=DESYNC_REGEX, max_tokens=300, temperature=1.0, seed=7)
        first = next(stream)
        assert first.token_ids, "generating under the grammar"
        engine = inference_server.server.engine
        (link,) = inference_server.run_sync(lambda: [r.grammar for r in engine.scheduler.running if r.constrained])
        assert _switch_grammar(grammar_server, link.grammar_id, link.session_id, OTHER_GRAMMAR) == 1
        with pytest.raises(InferenceError) as err:
            for _ in stream:
                pass
    assert err.value.code == grpc.StatusCode.ABORTED, err.value
    assert "the grammar rejected token" in err.value.message
    wait_until(lambda: inference_server.run_sync(lambda: inference_server.server.engine.num_active) == 0,
               "the rejected request still holds engine state")
    get = grammar_server.server.metrics.registry.get_sample_value
    wait_until(lambda: get("grammar_svc_active_sessions") == 0, "the rejected request's session was closed")


# ------------------------------------------------ a simulated-runner server with tight limits

# TOO_SLOW_SCHEMA compiles for tens of seconds, these tests' regexes in well under one: the deadline test
# need not wait out the session server's deadline, sized for the slow grammars other files compile.
COMPILE_TIMEOUT_SECONDS = 6.0

@pytest.fixture(scope="module")
def own_grammar():
    srv = start_grammar_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def simulated(own_grammar):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    cfg = InferenceServiceConfig(
        host="127.0.0.1", port=0, metrics_port=free_port(), grammar_targets=(own_grammar.target,),
        simulate_step_ms=5.0, grace_seconds=1.0,
        engine=EngineConfig(max_num_seqs=1, max_waiting=2, default_max_tokens=16,
                            compile_timeout_seconds=COMPILE_TIMEOUT_SECONDS))
    srv = InferenceServerThread(cfg)
    yield srv
    srv.stop()


def test_waiting_queue_limit_is_resource_exhausted(simulated):
    engine = simulated.server.engine
    # One runs (max_num_seqs=1), two wait (max_waiting=2): the next is refused. One at a time, since
    # a request still being tokenized counts as waiting too. The running one is long (the other two wait
    # behind it until the refusal is seen); the waiting ones need not be.
    admitted = []
    for i in range(3):
        admitted.append(background_complete(simulated.target, prompt=f"p{i}", max_tokens=400 if i == 0 else 20,
                                            ignore_eos=True))
        wait_until(lambda: simulated.run_sync(lambda: engine.num_active) == i + 1, f"request {i + 1} admitted")
    with InferenceClient(simulated.target) as client, pytest.raises(InferenceError) as err:
        client.complete("one too many", max_tokens=2)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waiting" in err.value.message
    for t, box in admitted:
        t.join(60)
        assert box["out"].finish_reason == "length", box


def test_live_metrics_exposition_passes_promtool(simulated):
    promtool = require_tool("promtool")
    with InferenceClient(simulated.target) as client:
        client.complete("m", regex="[0-9]{3}", max_tokens=8)
        client.complete("m", max_tokens=3, ignore_eos=True)
    port = simulated.server.metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    for name in ("inference_svc_time_to_first_token_seconds_bucket", "inference_svc_mask_wait_seconds_count",
                 'inference_svc_requests_total{constrained="true",finish_reason="stop"}',
                 "inference_svc_kv_cache_usage_ratio", "inference_svc_grammar_rpc_duration_seconds_count"):
        assert name.encode() in text, name
    # Every host phase of the step loop ran for these two requests (grammar_send for the constrained one).
    for phase in ("schedule", "grammar_send", "plan", "sample", "emit"):
        count = re.search(rf'inference_svc_step_host_seconds_count{{phase="{phase}"}} (\S+)'.encode(), text)
        assert count is not None and float(count.group(1)) > 0, phase


def test_lost_grammar_replica_fails_its_requests_alone(simulated, own_grammar):
    constrained = background_complete(simulated.target, prompt="c", regex="[a-z]{1,2000}", max_tokens=1500)
    unconstrained = background_complete(simulated.target, prompt="u", max_tokens=60, ignore_eos=True)
    engine = simulated.server.engine
    wait_until(lambda: simulated.run_sync(lambda: any(r.constrained and r.num_output > 2
                                                       for r in engine.scheduler.running)),
                "the constrained request is decoding")
    own_grammar.stop()
    for t, _ in (constrained, unconstrained):
        t.join(60)
    err = constrained[1]["err"]
    assert err.code == grpc.StatusCode.UNAVAILABLE
    assert "grammar" in err.message
    assert unconstrained[1]["out"].finish_reason == "length"
    # With the grammar tier gone, new constrained requests are refused, unconstrained ones served.
    with InferenceClient(simulated.target) as client:
        with pytest.raises(InferenceError) as refused:
            client.complete("c2", regex="[0-9]+", max_tokens=4)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        assert client.complete("u2", max_tokens=3, ignore_eos=True).finish_reason == "length"


def test_drain_finishes_streams_and_refuses_new_requests(simulated):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    t, box = background_complete(simulated.target, prompt="drain", max_tokens=5000, ignore_eos=True)
    engine = simulated.server.engine
    wait_until(lambda: simulated.run_sync(lambda: len(engine.scheduler.running)) == 1, "request running")
    stopping = threading.Thread(target=lambda: simulated.call(simulated.server.stop(grace=0.5)), daemon=True)
    stopping.start()
    with grpc.insecure_channel(simulated.target) as ch:
        wait_until(lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status
                    == health_pb2.HealthCheckResponse.NOT_SERVING, "health turns NOT_SERVING")
        with pytest.raises(InferenceError) as err:
            InferenceClient(simulated.target, channel=ch).complete("late", max_tokens=2)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "draining" in err.value.message
    t.join(60)
    stopping.join(60)
    assert box["out"].finish_reason == "cancelled"
    assert box["out"].usage.completion_tokens == len(box["out"].token_ids) > 0
