"""Grammar-replica failover: a request whose replica dies mid-generation finishes on another one.

A matcher is a pure function of (grammar, accepted tokens), so the engine
compiles the grammar on a live replica and reopens the session with every
token it already has. The output proves the replay: a JSON array of exactly
40 digits cannot come out valid if the new session started anywhere but
where the old one stopped; and the survivor's check of the finished output
against its schema sees the whole document.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from shared.inference_client import InferenceClient
from tests.conftest import InferenceServerThread, background_complete, start_grammar_server, wait_until

DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 40, "maxItems": 40}


@pytest.fixture(scope="module")
def replicas():
    servers = [start_grammar_server(), start_grammar_server()]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def two_replica_server(replicas):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    cfg = InferenceServiceConfig(host="127.0.0.1", port=0, metrics_port=0,
                                 grammar_targets=tuple(s.target for s in replicas), simulate_step_ms=10.0,
                                 engine=EngineConfig(max_num_seqs=8, default_max_tokens=200))
    srv = InferenceServerThread(cfg)
    yield srv
    srv.stop()


def test_lost_replica_is_replayed_on_another(two_replica_server, replicas):
    server = two_replica_server
    engine = server.server.engine
    t, box = background_complete(server.target, prompt="digits", json_schema=DIGITS, max_tokens=200, temperature=1.0,
                         seed=5)

    def decoding():
        reqs = [r for r in engine.scheduler.running if r.constrained and r.num_output >= 10]
        return reqs[0].grammar.replica if reqs else None

    wait_until(lambda: server.run_sync(decoding) is not None, "the request is decoding")
    replica = server.run_sync(decoding)
    victim = next(s for s in replicas if s.target == engine.grammar.target(replica))
    victim.stop()
    t.join(60)
    assert "err" not in box, box.get("err")
    out = box["out"]
    assert out.finish_reason == "stop"
    values = json.loads(out.text)
    assert len(values) == 40 and all(0 <= v <= 9 for v in values)
    # Checked on the survivor, whole: any tail of the array alone would not even be JSON.
    assert out.schema_check == "valid" and out.schema_violations == []
    get = server.server.metrics.registry.get_sample_value
    assert get("inference_svc_grammar_replays_total") >= 1
    # New constrained requests go to the survivor.
    with InferenceClient(server.target) as client:
        again = client.complete("more", json_schema=DIGITS, max_tokens=200)
    assert again.finish_reason == "stop" and len(json.loads(again.text)) == 40
    deadline = time.monotonic() + 10
    while server.run_sync(lambda: engine.num_active):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_dns_target_stands_for_every_address(grammar_server):
    """dns:///name:port (a headless Service) becomes one replica per resolved address."""
    from inference_svc.grammar.grammar_tier import GrammarTier
    from shared.tokenizer import default_description

    port = grammar_server.target.rsplit(":", 1)[1]  # the session's replica: the test above stops one of its own

    async def targets():
        # grpc.aio channels belong to an event loop: build the tier on one, as the server does.
        tier = GrammarTier((f"dns:///localhost:{port}",), default_description())
        try:
            assert await tier.connect() >= 1
            return tier.targets
        finally:
            await tier.close()

    assert f"127.0.0.1:{port}" in asyncio.run(targets())
