"""`structd bench soak --hostile-rate`: issue 24's hostile requests, mixed in beside the soak's ordinary streams.

The soak runs no gateway, so each case goes to the inference service over
gRPC, as raw GenerateRequests (the Python client would refuse some of them
before sending): a 4 MiB `[{},{},...]` document as a JSON schema, a schema
nested 1,000 deep, max_tokens 2^31-1 (1e400, a gateway case, has no gRPC
form: this is the largest max_tokens the wire carries), the sixteen-level
exponential anyOf schema, an allOf/$ref chain, and a tool schema past
--max-tool-bytes. Each must be refused with INVALID_ARGUMENT (it can never
succeed); any other answer, a stream included, is counted as unexpected and
kept as an example. Schemas carry a fresh title each time, so every one is
normalised again rather than refused from the replica's failure cache.
Hostile requests are counted apart: they never count as lost.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from shared.grpc_options import CHANNEL_OPTIONS

EXPECTED = grpc.StatusCode.INVALID_ARGUMENT
BIG_BODY_BYTES = 4 << 20
# Twice the inference service's default --max-tool-bytes, which the soak leaves as it is.
TOOL_BYTES = 2 << 20
NESTING = 1000
LEVELS = 16


def nested_any_of(levels: int, title: str) -> dict:
    """Each level an object whose `p` is the level below, beside an anyOf (normalisation is exponential in it)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"p": schema}, "anyOf": [{"required": ["p"]}, {"minProperties": 0}]}
    return {"title": title, **schema}


def ref_chain(levels: int, title: str) -> dict:
    """Each definition holds the one below twice, each time merged through an allOf with its $ref."""
    defs: dict = {"d0": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    for i in range(1, levels + 1):
        ref = {"$ref": f"#/$defs/d{i - 1}"}
        defs[f"d{i}"] = {"type": "object", "properties": {"a": {"allOf": [ref, {"type": "object"}]},
                                                          "b": {"allOf": [ref, {"minProperties": 1}]}}}
    return {"title": title, "$defs": defs, "allOf": [{"$ref": f"#/$defs/d{levels}"}, {"type": "object"}]}


def _request(title: str, **fields) -> pb.GenerateRequest:
    fields.setdefault("sampling", pb.SamplingParams(max_tokens=4))
    return pb.GenerateRequest(prompt=f"hostile {title}:", **fields)


def _schema(text: str, title: str) -> pb.GenerateRequest:
    return _request(title, constraint=pb.Constraint(json_schema=text))


_BIG_BODY = "[" + "{}," * ((BIG_BODY_BYTES - 2) // 3) + "{}]"
_DEEP = '{"type": "array", "items": ' * NESTING + "{}" + "}" * NESTING
_TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "description": "x" * TOOL_BYTES}}}

# name -> a request built afresh each time from a fresh title.
CASES: dict[str, Callable[[str], pb.GenerateRequest]] = {
    "4 MiB [{},{},...] schema": lambda t: _schema(f'{{"title": "{t}", "enum": {_BIG_BODY}}}', t),
    f"schema nested {NESTING} deep": lambda t: _schema(f'{{"title": "{t}", ' + _DEEP[1:], t),
    "max_tokens 2^31-1": lambda t: _request(t, sampling=pb.SamplingParams(max_tokens=2**31 - 1)),
    f"{LEVELS}-level exponential anyOf schema": lambda t: _schema(json.dumps(nested_any_of(LEVELS, t)), t),
    f"{LEVELS}-level allOf/$ref chain": lambda t: _schema(json.dumps(ref_chain(LEVELS, t)), t),
    "tool schema past --max-tool-bytes": lambda t: _request(
        t, messages=[pb.ChatMessage(role="user", content=f"hostile {t}")],
        tools=[pb.Tool(name="huge", parameters_json_schema=json.dumps({"title": t, **_TOOL_SCHEMA}))]),
}


@dataclass
class HostileTally:
    """Per case: sent, refused as expected, anything else (by what came back, with a few examples)."""

    sent: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)
    unexpected: Counter = field(default_factory=Counter)
    unexpected_examples: dict = field(default_factory=dict)  # case -> a few answers
    refusal_seconds: dict = field(default_factory=dict)  # case -> seconds from send to the refusal, each

    def figures(self) -> dict:
        cases = {}
        for name in CASES:
            seconds = sorted(self.refusal_seconds.get(name, []))
            cases[name] = {"sent": self.sent[name], "refused_as_expected": self.refused[name],
                           "unexpected": self.unexpected[name],
                           "unexpected_examples": self.unexpected_examples.get(name, []),
                           "refusal_seconds_max": seconds[-1] if seconds else None}
        return {"expected_status": EXPECTED.name, "sent": sum(self.sent.values()),
                "refused_as_expected": sum(self.refused.values()), "unexpected": sum(self.unexpected.values()),
                "cases": cases}


async def send_one(stub, name: str, timeout: float, tally: HostileTally) -> None:
    tally.sent[name] += 1
    began = time.monotonic()
    answer = None
    try:
        call = stub.Generate(CASES[name](uuid.uuid4().hex[:12]), timeout=timeout)
        async for _ in call:
            answer = "answered with a stream instead of a refusal"
            call.cancel()
            break
    except grpc.aio.AioRpcError as e:
        if e.code() == EXPECTED:
            tally.refused[name] += 1
            tally.refusal_seconds.setdefault(name, []).append(round(time.monotonic() - began, 3))
            return
        answer = f"{e.code().name}: {(e.details() or '')[:300]}"
    if answer is None:
        answer = "ended without a status or a response"
    tally.unexpected[name] += 1
    kept = tally.unexpected_examples.setdefault(name, [])
    if len(kept) < 5:
        kept.append(answer)


async def send_hostile(target: str, rate: float, deadline: float, timeout: float, tally: HostileTally) -> None:
    """`rate` requests/s until `deadline` (monotonic), the cases in turn; each one's answer is awaited apart,
    so a slow refusal does not slow the rate."""
    sent: list[asyncio.Task] = []
    names = list(CASES)
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        k = 0
        start = time.monotonic()
        while (at := start + k / rate) < deadline:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            sent.append(asyncio.create_task(send_one(stub, names[k % len(names)], timeout, tally)))
            k += 1
        await asyncio.gather(*sent)
