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


# ---------------------------------------------------------------- chat requests: a tool call, an answer after thinking

@pytest.fixture(scope="module")
def chat_replicas():
    """Three replicas: each test below loses one, and the request's replay needs one left."""
    servers = [start_grammar_server(compile_workers=1, fill_threads=1) for _ in range(3)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def chat_server(chat_replicas):
    """The simulated runner on the embedded model's tokenizer and chat template (its thinking and tool-call
    format), steps slow enough that a replica's stop lands mid-answer (about a hundred steps are left)."""
    from inference_svc.config import EngineConfig, InferenceServiceConfig
    from inference_svc.model.embedded_model import ensure_embedded_model

    cfg = InferenceServiceConfig(host="127.0.0.1", port=0, metrics_port=0, model=str(ensure_embedded_model()),
                                 grammar_targets=tuple(s.target for s in chat_replicas), simulate_step_ms=20.0,
                                 engine=EngineConfig(max_num_seqs=8, default_max_tokens=200))
    srv = InferenceServerThread(cfg)
    yield srv
    srv.stop()


def _lose_replica_of(server, replicas, ready) -> None:
    """Stops the replica of the one constrained request for which ready(request) holds, once it does."""
    engine = server.server.engine

    def replica():
        reqs = [r for r in engine.scheduler.running if r.constrained and ready(r)]
        return reqs[0].grammar.replica if reqs else None

    wait_until(lambda: server.run_sync(replica) is not None, "the request is in its constrained part")
    target = server.run_sync(lambda: engine.grammar.target(replica()))
    next(s for s in replicas if s.target == target).stop()


def _replays(server) -> float:
    return server.server.metrics.registry.get_sample_value("inference_svc_grammar_replays_total") or 0.0


def test_replica_lost_during_a_tool_call(chat_server, chat_replicas):
    """The tool-call grammar (call markers, the name, then the arguments' schema) is replayed mid-arguments: the
    call comes back whole and its arguments are exactly the schema's."""
    tool = {"name": "put_digits", "description": "Stores forty digits",
            "parameters": {"type": "object", "properties": {"digits": DIGITS}, "required": ["digits"]}}
    before = _replays(chat_server)
    t, box = background_complete(chat_server.target, prompt=[{"role": "user", "content": "Store digits"}],
                                 tools=[tool], tool_choice="required", max_tokens=200, temperature=1.0, seed=5)
    _lose_replica_of(chat_server, chat_replicas, lambda r: r.num_output >= 20)
    t.join(60)
    assert "err" not in box, box.get("err")
    out = box["out"]
    assert [c.name for c in out.tool_calls] == ["put_digits"], out
    digits = out.tool_calls[0].arguments["digits"]
    assert len(digits) == 40 and all(0 <= v <= 9 for v in digits)
    assert _replays(chat_server) > before


def test_replica_lost_during_the_answer_after_thinking(chat_server, chat_replicas):
    """The replay carries the answer's tokens only (the grammar never saw the thinking): replayed with the
    thinking it would be refused, or start the array at the wrong place."""
    before = _replays(chat_server)
    t, box = background_complete(chat_server.target, prompt=[{"role": "user", "content": "Digits?"}],
                                 reasoning=True, max_thinking_tokens=12, json_schema=DIGITS, max_tokens=200,
                                 temperature=1.0, seed=9)
    _lose_replica_of(chat_server, chat_replicas, lambda r: r.thinking.done and len(r.answer_ids) >= 10)
    t.join(60)
    assert "err" not in box, box.get("err")
    out = box["out"]
    assert out.finish_reason == "stop" and out.reasoning_text and out.usage.reasoning_tokens == 13
    values = json.loads(out.text)
    assert len(values) == 40 and all(0 <= v <= 9 for v in values)
    assert out.schema_check == "valid"
    assert _replays(chat_server) > before


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
