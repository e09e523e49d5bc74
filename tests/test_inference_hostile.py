"""Hostile input at the inference service (issue 24, items 3 and 4), through the real server.

Tools past --max-tool-bytes are refused before any schema is parsed, naming
the limit and the tool; a chat whose messages pass --max-prompt-bytes is
refused before the template renders it; requests being prepared (tools,
template) count against --max-waiting, so a flood of slow renders is refused
at the door while the ones admitted finish; --max-concurrent-rpcs bounds the
calls in progress; the tool-grammar cache holds digests and a bounded number
of bytes, never the clients' schema texts.
"""

from __future__ import annotations

import gc
import json
import threading
import uuid

import grpc
import pytest

from inference_svc.api import tool_calls
from inference_svc.api.tool_calls import _EbnfCache
from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from shared.json_nesting import MAX_NESTING
from tests.conftest import InferenceServerThread, inference_stub, wait_until

LIMIT_BYTES = 64 * 1024
MAX_WAITING = 2
MAX_RPCS = 4
CHAT = [pb.ChatMessage(role="user", content="Weather?")]
# A template that takes seconds to render when the last message asks for it (a slow but legitimate template
# is what a flood of chats costs: here it makes "being prepared" last long enough to be seen).
SLOW_TEMPLATE = ("{% if 'SLOW' in messages[-1]['content'] %}{% for i in range(100000) %}{% for j in range(40) %}"
                 "{% endfor %}{% endfor %}{% endif %}"
                 "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>")


def _tool(name: str, size: int) -> pb.Tool:
    """A tool whose parameters schema is about `size` bytes of JSON (a long description)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "description": "x" * size}}}
    return pb.Tool(name=name, parameters_json_schema=json.dumps(schema))


@pytest.fixture(scope="module")
def hostile_server(grammar_server, tmp_path_factory):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    template = tmp_path_factory.mktemp("template") / "slow.jinja"
    template.write_text(SLOW_TEMPLATE)
    cfg = InferenceServiceConfig(
        host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar_server.target,), simulate_step_ms=20.0,
        chat_template=template, model_family="deepseek", max_concurrent_rpcs=MAX_RPCS, grace_seconds=1.0,
        engine=EngineConfig(max_num_seqs=8, max_waiting=MAX_WAITING, default_max_tokens=8,
                            max_prompt_bytes=LIMIT_BYTES, max_tool_bytes=LIMIT_BYTES))
    srv = InferenceServerThread(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(hostile_server):
    with inference_stub(hostile_server.target) as stub:
        yield stub


def _generate(stub, **fields) -> list[pb.GenerateResponse]:
    fields.setdefault("sampling", pb.SamplingParams(max_tokens=4, temperature=0))
    return list(stub.Generate(pb.GenerateRequest(**fields), timeout=120))


def _refusal(stub, **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        _generate(stub, **fields)
    return e.value


def test_tools_past_the_byte_limit_are_refused_naming_it_and_the_tool(stub, hostile_server):
    refused = _refusal(stub, messages=CHAT, tools=[_tool("small", 100), _tool("huge_tool", LIMIT_BYTES)])
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-tool-bytes" in refused.details() and "'huge_tool'" in refused.details()
    assert str(LIMIT_BYTES) in refused.details()
    assert _generate(stub, messages=CHAT, tools=[_tool("small", 100)])[-1].finish_reason  # the same, small enough


def test_tool_parameters_nested_past_the_limit_are_refused_naming_it(stub):
    """Found by tests/test_chat_fuzz.py: a tool schema nested 1,000 deep was a RecursionError in the API
    process (INTERNAL); it is refused before json.loads reads it, naming the tool and the limit."""
    deep = pb.Tool(name="deep_tool", parameters_json_schema="[" * 1000 + "]" * 1000)
    refused = _refusal(stub, messages=CHAT, tools=[deep])
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.details()
    assert "'deep_tool'" in refused.details() and str(MAX_NESTING) in refused.details()


def test_refused_requests_leave_nothing_behind(hostile_server):
    """The refusal does not keep the refused message alive: raised through grpc's frames (context.abort), each
    one stayed in reference cycles until a full collection, which a big process seldom runs. Sent as bytes and
    counted by a marker of this test's own, so the only such GenerateRequest objects in this process are the
    server's (the client's, held by a refusal's traceback, or other tests' on this worker, would count too)."""
    marker = f"big_{uuid.uuid4().hex[:8]}"
    with grpc.insecure_channel(hostile_server.target) as channel:
        generate_bytes = channel.unary_stream("/inference.v1.InferenceService/Generate")
        for i in range(6):
            request = pb.GenerateRequest(messages=CHAT, tools=[_tool(f"{marker}_{i}", 2 * LIMIT_BYTES)],
                                         sampling=pb.SamplingParams(max_tokens=4, temperature=0))
            data, request = request.SerializeToString(), None
            with pytest.raises(grpc.RpcError) as refused:
                list(generate_bytes(data, timeout=120))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()

    def kept() -> int:  # the server's handler may still be unwinding the last one as its status arrives
        return sum(1 for o in gc.get_objects()
                   if type(o) is pb.GenerateRequest and o.tools and o.tools[0].name.startswith(marker))

    wait_until(lambda: kept() == 0, "refused requests kept alive", timeout=30)


def test_tools_just_under_the_limit_are_served(stub):
    done = _generate(stub, messages=CHAT, tools=[_tool("near_limit", LIMIT_BYTES - 1024)])
    assert done[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


def test_messages_past_the_prompt_limit_are_refused_before_rendering(stub, hostile_server):
    frontend = hostile_server.server.frontend
    big = [pb.ChatMessage(role="user", content="SLOW " + "y" * LIMIT_BYTES)]
    refused = _refusal(stub, messages=big)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-prompt-bytes" in refused.details() and "messages hold" in refused.details()
    # The slow template never ran for it: the refusal came before anything was being prepared.
    assert frontend.preparing == 0


def test_requests_being_prepared_count_against_max_waiting(stub, hostile_server):
    """Two slow renders fill --max-waiting; a third request is refused RESOURCE_EXHAUSTED (retry later) at
    once, naming the limit, and the two admitted ones finish."""
    frontend = hostile_server.server.frontend
    results: list = []

    def slow(i: int) -> None:
        try:
            results.append(_generate(stub, messages=[pb.ChatMessage(role="user", content=f"SLOW {i}")]))
        except grpc.RpcError as e:  # reported through results
            results.append(e)

    threads = [threading.Thread(target=slow, args=(i,), daemon=True) for i in range(MAX_WAITING)]
    for t in threads:
        t.start()
    wait_until(lambda: hostile_server.run_sync(lambda: frontend.preparing) == MAX_WAITING, "renders in progress")
    refused = _refusal(stub, messages=CHAT)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-waiting" in refused.details() and "being prepared" in refused.details()
    for t in threads:
        t.join(120)
    assert len(results) == MAX_WAITING and all(isinstance(r, list) and r[-1].finish_reason for r in results)
    assert _generate(stub, messages=CHAT)[-1].finish_reason  # and the door is open again


def test_calls_past_max_concurrent_rpcs_are_refused(hostile_server):
    """MAX_RPCS long streams are open; one call more is refused RESOURCE_EXHAUSTED by the gRPC server."""
    channel = grpc.insecure_channel(hostile_server.target)
    stub = pb_grpc.InferenceServiceStub(channel)
    engine = hostile_server.server.engine
    streams = []
    try:
        for i in range(MAX_RPCS):  # one at a time, each running before the next (--max-waiting is 2)
            streams.append(stub.Generate(pb.GenerateRequest(prompt=f"long {i}", sampling=pb.SamplingParams(
                max_tokens=2000, ignore_eos=True)), timeout=120))
            next(streams[-1])
        refused = _refusal(stub, prompt="one more")
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        for s in streams:
            s.cancel()
        channel.close()
    wait_until(lambda: hostile_server.run_sync(lambda: engine.num_active) == 0, "cancelled streams freed")


def test_the_tool_grammar_cache_is_keyed_by_digest_and_bounded_in_bytes():
    cache = _EbnfCache(max_entries=8, max_bytes=1000)
    keys = [_EbnfCache.key("schema" * 10_000, i) for i in range(6)]
    assert all(len(k) == 32 for k in keys)
    for k in keys:
        cache.put(k, "g" * 200)
    assert cache.bytes <= 1000 and len(cache) == 5 and cache.get(keys[0]) is None and cache.get(keys[-1])
    cache.put(_EbnfCache.key("huge"), "h" * 300)  # past a quarter of the budget: not kept
    assert cache.get(_EbnfCache.key("huge")) is None and cache.bytes <= 1000
    assert tool_calls._EBNF_CACHE.max_bytes == tool_calls.EBNF_CACHE_BYTES
