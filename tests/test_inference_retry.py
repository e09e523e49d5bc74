"""gRPC's retry policy on calls to inference replicas (issue 27, item 5): the Python client's `retries=`, `structd
generate --retries` and the gateway's channel, against two real inference services, one of them draining; and
the gateway's client-side health checking (a NOT_SERVING replica leaves its pick list, /health stays steady).

A draining replica (health NOT_SERVING, refusing new requests with
UNAVAILABLE before any response) is what a rolling update leaves behind a
name for a moment: round robin still sends it calls. With retries, every
request ends on the other replica; without, some fail, which shows the
requests did reach the draining one. A stream that already sent output and
then breaks (its replica's server stops) is not sent again: the client
sees the failure, never a second answer.

The gateway's channel health-checks each replica: one that says NOT_SERVING
gets no calls at all (no retry needed) and /health answers 200 while any
replica serves. Its retries are for the moment before the health watch
reports: a replica that refuses while still SERVING (`refusing`).
"""

from __future__ import annotations

import subprocess
import sys
import threading

import grpc
import httpx2
import openai
import pytest

from gateway.config import GatewayConfig
from gateway.server import GatewayServer
from shared.inference_client import InferenceClient, InferenceError
from structd.bench.harness import ServiceThread
from tests.conftest import REPO, InferenceServerThread, wait_until


def _replica(grammar_server) -> ServiceThread:
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    cfg = InferenceServiceConfig(host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar_server.target,),
                                 simulate_step_ms=2.0, grace_seconds=0.5,
                                 engine=EngineConfig(max_num_seqs=8, default_max_tokens=8))
    return InferenceServerThread(cfg)


def _both(*servers: ServiceThread) -> str:
    """A target that resolves to every server's address (round robin spreads calls over them)."""
    return "ipv4:" + ",".join(s.target for s in servers)


@pytest.fixture(scope="module")
def healthy(grammar_server):
    srv = _replica(grammar_server)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def draining(grammar_server):
    """A replica in the state its SIGTERM puts it in first: NOT_SERVING, and refusing new requests with
    UNAVAILABLE (the engine drains; with nothing in flight it stays so until the process would exit)."""
    srv = _replica(grammar_server)
    srv.call(srv.server.host.set_serving(False))
    srv.call(srv.server.engine.drain(0.0))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def refusing(grammar_server):
    """A replica between its engine starting to drain and its health saying so: it refuses new requests with
    UNAVAILABLE while still SERVING, so health checking keeps it in the pick list (what retries are for)."""
    srv = _replica(grammar_server)
    srv.call(srv.server.engine.drain(0.0))
    yield srv
    srv.stop()


def _gateway(*replicas: ServiceThread, retries: int = 0) -> ServiceThread:
    return ServiceThread(GatewayServer(GatewayConfig(host="127.0.0.1", port=0, target=_both(*replicas),
                                                     retries=retries)), "retrying-gateway", start_timeout=60.0)


def test_the_draining_replica_refuses(draining):
    with InferenceClient(draining.target) as client, pytest.raises(InferenceError) as refused:
        client.complete("hello", max_tokens=2, timeout=30)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in refused.value.message


def test_client_retries_on_the_other_replica(healthy, draining):
    with InferenceClient(_both(healthy, draining), retries=2) as client:
        outs = [client.complete(f"request {i}", max_tokens=2, timeout=30) for i in range(8)]
    assert all(o.finish_reason == "length" for o in outs)


def test_retries_are_bounded(draining):
    """Only the draining replica behind the name: every attempt is refused, and the call ends with its status."""
    with InferenceClient(draining.target, retries=4) as client, pytest.raises(InferenceError) as refused:
        client.complete("hello", max_tokens=2, timeout=30)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE


def test_retries_past_grpc_limit_are_refused():
    with pytest.raises(ValueError, match="retries"):
        InferenceClient("127.0.0.1:1", retries=5)


def test_structd_generate_retries(healthy, draining):
    for _ in range(2):  # round robin: one of the two lands on the draining replica first
        out = subprocess.run([sys.executable, "-m", "structd", "generate", "--target", _both(healthy, draining),
                              "--retries", "2", "--max-tokens", "2", "--timeout-seconds", "60", "--json", "hello"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr


def test_a_stream_that_sent_output_is_not_retried(grammar_server, healthy):
    """The stream's replica stops after it streamed a few chunks: the client gets UNAVAILABLE, not the other
    replica's answer appended to the chunks it already has."""
    doomed = _replica(grammar_server)
    try:
        with InferenceClient(_both(doomed, healthy), retries=4) as client:
            for _ in range(4):  # until round robin puts the stream on the doomed replica
                stream = client.generate("a long answer", max_tokens=8000, ignore_eos=True, timeout=60)
                first = next(stream)
                if doomed.run_sync(lambda: doomed.server.engine.num_active):
                    break
                stream.close()
            else:
                pytest.fail("no stream landed on the doomed replica")
            got = [first]
            threading.Thread(target=lambda: doomed.call(doomed.server.host.server.stop(0)), daemon=True).start()
            with pytest.raises(InferenceError) as broken:
                for chunk in stream:
                    got.append(chunk)
            assert broken.value.code == grpc.StatusCode.UNAVAILABLE
            assert all(c.finish_reason is None for c in got)
    finally:
        doomed.stop()


@pytest.mark.parametrize("retries", [2, 0])
def test_gateway_retries_on_the_other_replica(healthy, refusing, retries):
    srv = _gateway(healthy, refusing, retries=retries)
    try:
        statuses = []
        with openai.OpenAI(base_url=f"http://{srv.target}/v1", api_key="unused", max_retries=0) as client:
            model = client.models.list().data[0].id
            for i in range(8):
                try:
                    reply = client.completions.create(model=model, max_tokens=2, stream=bool(i % 2),
                                                      prompt=f"request {i}")
                    if i % 2:
                        assert list(reply)[-1].choices[0].finish_reason == "length"
                    statuses.append(200)
                except openai.APIStatusError as e:
                    statuses.append(e.status_code)
        if retries:
            assert statuses == [200] * 8
        else:  # the requests do reach the refusing replica: without retries, its refusals are the client's 503s
            assert 503 in statuses and 200 in statuses
    finally:
        srv.stop()


def test_gateway_sends_nothing_to_a_replica_that_is_not_serving(healthy, draining):
    """No retries: the draining replica (NOT_SERVING) left the pick list, so every request is served by the
    other, and /health says 200 at every probe instead of following the replica round robin picked."""
    srv = _gateway(healthy, draining)
    health = f"http://{srv.target}/health"
    try:
        with openai.OpenAI(base_url=f"http://{srv.target}/v1", api_key="unused", max_retries=0) as client:
            model = client.models.list().data[0].id
            for i in range(8):
                assert client.completions.create(model=model, max_tokens=2, prompt=f"request {i}").choices[0].text
        assert [httpx2.get(health, timeout=30).status_code for _ in range(8)] == [200] * 8
    finally:
        srv.stop()


def test_gateway_health_is_503_when_no_replica_serves(draining):
    srv = _gateway(draining)
    try:
        assert [httpx2.get(f"http://{srv.target}/health", timeout=30).status_code for _ in range(4)] == [503] * 4
    finally:
        srv.stop()


def test_a_replica_that_stops_serving_leaves_and_comes_back(grammar_server, healthy):
    """/health stays 200 while one of two replicas goes NOT_SERVING and back; no request reaches it while it
    is out, and requests reach it again once it serves (its health watch put it back in the pick list)."""
    flapping = _replica(grammar_server)
    srv = _gateway(healthy, flapping)
    health = f"http://{srv.target}/health"
    try:
        with openai.OpenAI(base_url=f"http://{srv.target}/v1", api_key="unused", max_retries=0) as client:
            model = client.models.list().data[0].id

            def prompts_seen() -> float:
                return flapping.run_sync(lambda: flapping.server.metrics.prompt_tokens._value.get())

            def reaches_it(requests: int) -> bool:
                before = prompts_seen()
                for i in range(requests):
                    client.completions.create(model=model, max_tokens=1, prompt=f"request {i}")
                return prompts_seen() != before

            flapping.call(flapping.server.host.set_serving(False))
            # The health watch reports asynchronously: once a round of requests misses the replica, it is out.
            wait_until(lambda: not reaches_it(4), "the not-serving replica left the pick list")
            assert not reaches_it(8), "no request reaches the replica while it is not serving"
            assert [httpx2.get(health, timeout=30).status_code for _ in range(6)] == [200] * 6
            flapping.call(flapping.server.host.set_serving(True))
            wait_until(lambda: reaches_it(2), "the replica back in the pick list")
            assert [httpx2.get(health, timeout=30).status_code for _ in range(6)] == [200] * 6
    finally:
        srv.stop()
        flapping.stop()
