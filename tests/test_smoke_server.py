"""The session server starts, takes a tokenizer, and compiles over real gRPC."""

import json

from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient
from tests.conftest import run


def test_compile_roundtrip(registered):
    async def go():
        client = GrammarClient(registered.target)
        try:
            spec = pb.GrammarSpec(json_schema=pb.JsonSchema(schema=json.dumps({"type": "integer"})))
            first = await client.compile(registered.fingerprint, spec)
            second = await client.compile(registered.fingerprint, spec)
            return first, second
        finally:
            await client.close()

    first, second = run(go())
    assert first.grammar_id == second.grammar_id
    assert second.cache_hit
