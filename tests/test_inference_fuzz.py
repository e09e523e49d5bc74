"""Property test: any GenerateRequest on the wire ends with a finish reason or a named status, never a hang,
a crash or an INTERNAL, and the service still serves afterwards with nothing left behind.

hypothesis draws every field: ids (duplicates included), prompts, sampling
values (out-of-range, NaN, infinities), stop strings, each constraint kind with
well-formed and garbage specs. Requests run against the simulated runner (fast
steps) and a grammar replica of their own with a short compile deadline, so a
pathological spec costs its own DEADLINE_EXCEEDED, not the suite's time.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from tests.conftest import InferenceServerThread, start_grammar_server, wait_until

# A request may fail, but only with a status that names what went wrong.
NAMED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.ABORTED}
CALL_TIMEOUT_SECONDS = 30.0

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8)
schemas = st.one_of(
    st.sampled_from([
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        {"type": "string", "pattern": "^[a-c]{2}$"},
        {"enum": [1, "two", None]},
        {"type": "no-such-type"},
        {"$ref": "#/definitions/missing"},
        {"type": "integer", "minimum": 5, "maximum": 1},
    ]),
    st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "minLength", "required", "anyOf"]),
                    json_values, max_size=3),
).map(json.dumps) | st.text(max_size=40)
constraints = st.one_of(
    st.none(),
    st.builds(lambda s, jf: pb.Constraint(json_schema=s, disable_jump_forward=jf), schemas, st.booleans()),
    st.builds(lambda s: pb.Constraint(regex=s), st.sampled_from(["[a-z]{1,4}", "(ab|cd)+", "[", "a{2,1}", ".*", ""])
              | st.text(max_size=12)),
    st.builds(lambda s: pb.Constraint(ebnf=s), st.sampled_from(['root ::= "x" | "y"', "root ::= missing", "::=", ""])
              | st.text(max_size=20)),
    st.builds(lambda c: pb.Constraint(choice=pb.ChoiceList(choices=c)), st.lists(st.text(max_size=6), max_size=4)),
    st.builds(lambda b: pb.Constraint(json_object=b), st.booleans()),
    st.builds(lambda s: pb.Constraint(structural_tag=s), st.sampled_from(["[]", "{}", '{"type": "nope"}'])
              | st.text(max_size=20)),
)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
sampling = st.builds(
    lambda max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos: pb.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
        ignore_eos=ignore_eos),
    max_tokens=st.integers(-3, 24) | st.sampled_from([2**31 - 1, -(2**31), 100_000]),
    temperature=st.sampled_from([0.0, 0.7, 1.0]) | floats,
    top_p=st.sampled_from([0.0, 0.9, 1.0]) | floats,
    top_k=st.integers(-2, 60) | st.sampled_from([2**31 - 1, -(2**31)]),
    seed=st.none() | st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(max_size=4), max_size=3) | st.lists(st.just("x" * 300), max_size=1),
    ignore_eos=st.booleans(),
)
requests = st.builds(
    lambda rid, prompt, s, c: pb.GenerateRequest(request_id=rid, prompt=prompt, sampling=s,
                                                 **({"constraint": c} if c is not None else {})),
    rid=st.sampled_from(["", "dup", "dup"]) | st.text(max_size=10),
    prompt=st.sampled_from(["", "hi", "JSON:"]) | st.text(max_size=30),
    s=st.none().map(lambda _: pb.SamplingParams()) | sampling,
    c=constraints,
)


@pytest.fixture(scope="module")
def fuzz_server():
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    grammar = start_grammar_server(compile_timeout_seconds=2.0, compile_workers=1)
    cfg = InferenceServiceConfig(host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar.target,),
                                 simulate_step_ms=1.0, grammar_step_timeout_seconds=5.0,
                                 engine=EngineConfig(max_num_seqs=8, default_max_tokens=16, max_waiting=16,
                                                     compile_timeout_seconds=2.0))
    srv = InferenceServerThread(cfg)
    yield srv, grammar
    srv.stop()
    grammar.stop()


def _call(target: str, request: pb.GenerateRequest) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        finished = False
        try:
            for resp in stub.Generate(request, timeout=CALL_TIMEOUT_SECONDS):
                if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    finished = True
                    assert resp.finish_reason != pb.FINISH_REASON_ERROR
        except grpc.RpcError as e:
            assert e.code() in NAMED, (e.code(), e.details(), request)
            assert e.details() and "Traceback" not in e.details()
            # The server's own deadlines name what ran out; the client's (a hang) does not.
            assert e.details() != "Deadline Exceeded", ("the request hung", request)
            return
        assert finished, request


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(batch=st.lists(requests, min_size=1, max_size=4), same_id=st.booleans())
def test_any_requests_get_an_answer_or_a_named_status(fuzz_server, batch, same_id):
    """A few requests at once, often all with one client id (a client retrying with its own id)."""
    srv, _ = fuzz_server
    if same_id:
        for r in batch:
            r.request_id = "retry"
    with ThreadPoolExecutor(len(batch)) as pool:
        for f in [pool.submit(_call, srv.target, r) for r in batch]:
            f.result()


def test_after_the_fuzz_nothing_is_left_and_it_still_serves(fuzz_server):
    srv, grammar = fuzz_server
    engine = srv.server.engine
    wait_until(lambda: srv.run_sync(lambda: engine.num_active) == 0, "requests left in the engine")
    assert srv.run_sync(lambda: engine.runner.block_manager.usage_ratio) == 0.0
    wait_until(lambda: grammar.server.metrics.registry.get_sample_value("grammar_svc_active_sessions") == 0,
               "grammar sessions left open")
    with grpc.insecure_channel(srv.target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        out = list(pb_grpc.InferenceServiceStub(ch).Generate(
            pb.GenerateRequest(prompt="ok", constraint=pb.Constraint(regex="[0-9]{3}")), timeout=30))
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP
    assert len("".join(r.text for r in out)) == 3
