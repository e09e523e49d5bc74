"""Every RPC path and status code of grammar.v1.GrammarService, over real gRPC.

RegisterTokenizer, Compile for every constraint kind (each checked to really
constrain, by feeding a valid and an invalid string through a Step session),
the status-code table, the compile cache (successes and failures), deadlines
that kill the compile worker, concurrency, health, reflection and /metrics.

Most tests use the session's shared server. One extra module server (one
compile worker, small max_spec_bytes, long default compile timeout, a real
metrics port) covers what needs different limits: first-time registration,
the spec-size limit, worker kills (with a single worker the replacement is the
only one left, so the compile after a kill provably runs on it) and /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.request
import uuid
import zlib

import grpc
import numpy as np
import pytest

from shared.codec import words_for_vocab
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient, decode_masks
from structd.bench.harness import free_port
from tests.conftest import require_tool, run, start_grammar_server

SERVICE = "grammar.v1.GrammarService"
VOCAB = 129_280

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}
OBJ_VALUE = {"a": 1, "b": "x"}


# ---------------------------------------------------------------- helpers


def salt() -> str:
    return uuid.uuid4().hex[:12]


def json_schema(schema, **options) -> pb.GrammarSpec:
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return pb.GrammarSpec(json_schema=pb.JsonSchema(schema=text, options=pb.JsonSchemaOptions(**options)))


def slow_schema(tag: str, n: int = 200) -> pb.GrammarSpec:
    """Many distinct length-bounded strings: xgrammar 0.2.8 needs tens of seconds
    for this with the 129k tokenizer (seconds already at n=10). `tag` (a title,
    which does not change the language) makes the grammar id unique per test."""
    props = {f"p{i}": {"type": "string", "minLength": i % 7 + 1, "maxLength": i % 11 + 10} for i in range(n)}
    return json_schema({"title": tag, "type": "object", "properties": props, "required": list(props)})


def fast_spec() -> pb.GrammarSpec:
    """A regex nobody compiled before: a cache miss that compiles in milliseconds."""
    return pb.GrammarSpec(regex=f"{salt()}[0-9]+")


def call(target: str, fn):
    """Runs `await fn(client)` with a fresh asyncio client."""

    async def go():
        client = GrammarClient(target)
        try:
            return await fn(client)
        finally:
            await client.close()

    return run(go())


def rpc_error(target: str, fn) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        call(target, fn)
    return info.value


def compile_(target, fingerprint, spec, **kw) -> pb.CompileResponse:
    return call(target, lambda c: c.compile(fingerprint, spec, **kw))


def sample(srv, name: str, **labels) -> float:
    return srv.server.metrics.registry.get_sample_value(name, labels) or 0.0


def wait_until(pred, what: str, timeout: float = 120.0, interval: float = 0.05):
    """Polls pred() until truthy; the timeout only bounds a broken run."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def pool_state(srv) -> dict:
    async def read():
        pool = srv.server.backend.pool
        workers = list(pool._all)
        return {
            "pids": {w.proc.pid for w in workers},
            "workers": workers,
            "idle": pool.idle_workers,
            "busy": pool.busy_workers,
            "kills": pool.kills,
        }

    return srv.call(read())


def wait_pool_ready(srv, n: int) -> dict:
    """Every compile worker alive and idle (after a kill, the replacement spawns in the background)."""
    return wait_until(lambda: (lambda s: s if len(s["pids"]) == n and s["idle"] == n else None)(pool_state(srv)),
                      f"{n} idle compile workers")


async def end_stream(stream) -> None:
    """Half-closes and waits for the server to end the stream, so the call is
    complete before the test's event loop closes (a cancelled call would be
    finished by grpc's poller on a closed loop)."""
    await stream.close()
    with pytest.raises(ConnectionError):
        await stream.read()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Prober:
    """Feeds strings through Step sessions to see what a compiled grammar accepts."""

    def __init__(self, hf_tokenizer, stop_token_ids, vocab_size: int):
        self.tok = hf_tokenizer
        self.stop = list(stop_token_ids)
        self.vocab_size = vocab_size

    def tokens(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        assert self.tok.decode(ids) == text
        return ids

    async def probe(self, client: GrammarClient, grammar_id: str, texts: list[str]):
        """One session per text, all in one step; returns [(result, tokens, stop allowed)]."""
        toks = [self.tokens(t) for t in texts]
        stream = client.open_stream(self.vocab_size)
        try:
            resp = await stream.step([
                pb.SessionStep(session_id=i + 1, open=pb.OpenSession(grammar_id=grammar_id), accept_token_ids=t)
                for i, t in enumerate(toks)])
            bitmask = np.zeros((len(texts), words_for_vocab(self.vocab_size)), dtype=np.int32)
            with_mask = set(decode_masks(resp, stream.decoder, bitmask))
            closed = await stream.step([pb.SessionStep(session_id=i + 1, close=True) for i in range(len(texts))])
            await end_stream(stream)
        except BaseException:
            stream.cancel()
            raise
        assert [r.status for r in closed.results] == [pb.SESSION_STATUS_CLOSED] * len(texts)
        out = []
        for i, r in enumerate(resp.results):
            words = bitmask[i].view(np.uint32)
            stop_ok = i in with_mask and any((int(words[s >> 5]) >> (s & 31)) & 1 for s in self.stop)
            out.append((r, toks[i], stop_ok))
        return out

    async def assert_constrains(self, client, grammar_id: str, valid: list[str], invalid: list[str]) -> None:
        results = await self.probe(client, grammar_id, valid + invalid)
        for text, (r, toks, stop_ok) in zip(valid, results):
            assert r.status == pb.SESSION_STATUS_OK, (text, r)
            assert r.accepted_count == len(toks), text
            # Complete: the stop token is allowed right after the last character.
            assert stop_ok, f"{text!r} accepted but not complete"
        for text, (r, toks, _) in zip(invalid, results[len(valid):]):
            assert r.status == pb.SESSION_STATUS_REJECTED, (text, r)
            assert r.accepted_count < len(toks), text


@pytest.fixture(scope="module")
def prober(hf_tokenizer, xgr_tokenizer_info):
    return Prober(hf_tokenizer, xgr_tokenizer_info.stop_token_ids, xgr_tokenizer_info.vocab_size)


class Limited:
    """The module's extra server and what its first RegisterTokenizer calls answered."""

    def __init__(self, srv, fingerprint, check_only_error, first, repeat):
        self.srv = srv
        self.target = srv.target
        self.fingerprint = fingerprint
        self.check_only_error = check_only_error
        self.first = first
        self.repeat = repeat


LIMITED_MAX_SPEC_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def limited(tokenizer_desc):
    srv = start_grammar_server(compile_workers=1, max_spec_bytes=LIMITED_MAX_SPEC_BYTES,
                               compile_timeout_seconds=300.0, max_compile_timeout_seconds=300.0,
                               metrics_port=free_port())
    try:
        d = tokenizer_desc

        async def handshake(client: GrammarClient):
            try:
                await client.stub.RegisterTokenizer(pb.RegisterTokenizerRequest(tokenizer_fingerprint=d.fingerprint))
                check_only = None
            except grpc.aio.AioRpcError as e:
                check_only = e
            full = pb.RegisterTokenizerRequest(tokenizer_fingerprint=d.fingerprint,
                                               tokenizer_info_json_zlib=d.compressed_info(),
                                               hf_tokenizer_json_zlib=d.compressed_hf())
            first = await client.stub.RegisterTokenizer(full)
            repeat = await client.stub.RegisterTokenizer(full)
            return check_only, first, repeat

        check_only, first, repeat = call(srv.target, handshake)
        yield Limited(srv, d.fingerprint, check_only, first, repeat)
    finally:
        srv.stop()


# ---------------------------------------------------------------- RegisterTokenizer


def test_register_check_only_unknown_is_not_found(limited):
    # Before the replica knew the tokenizer, a fingerprint-only request said NOT_FOUND.
    assert limited.check_only_error is not None
    assert limited.check_only_error.code() == grpc.StatusCode.NOT_FOUND
    assert "tokenizer_info_json_zlib" in limited.check_only_error.details()


def test_register_full_then_already_registered(limited, tokenizer_desc):
    first, repeat = limited.first, limited.repeat
    assert first.tokenizer_fingerprint == tokenizer_desc.fingerprint
    assert first.vocab_size == 129_280
    assert not first.already_registered
    assert first.jump_forward_supported  # the HF tokenizer.json was sent
    assert repeat.already_registered
    assert repeat.tokenizer_fingerprint == first.tokenizer_fingerprint
    # Afterwards a check-only request succeeds.
    again = call(limited.target, lambda c: c.stub.RegisterTokenizer(
        pb.RegisterTokenizerRequest(tokenizer_fingerprint=tokenizer_desc.fingerprint)))
    assert again.already_registered and again.vocab_size == 129_280


def test_register_without_hf_json_has_no_jump_forward(limited, hf_tokenizer, prober):
    """A tokenizer sent without tokenizer.json: registered, but jump-forward answers empty."""
    from shared.tokenizer import describe

    # The same tokenizer padded to a larger logits width: a distinct fingerprint.
    desc = describe(hf_tokenizer, vocab_size=len(hf_tokenizer) + 64, with_hf_json=False)
    assert desc.hf_tokenizer_json is None
    spec = json_schema({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})

    async def go(client: GrammarClient):
        reg = await client.register_tokenizer(desc)
        plain = await client.compile(desc.fingerprint, spec)
        with_hf = await client.compile(limited.fingerprint, spec)
        stream = client.open_stream(VOCAB)
        try:
            resp = await stream.step([
                pb.SessionStep(session_id=1, open=pb.OpenSession(grammar_id=plain.grammar_id), jump_forward=True),
                pb.SessionStep(session_id=2, open=pb.OpenSession(grammar_id=with_hf.grammar_id), jump_forward=True),
            ])
            await end_stream(stream)
        except BaseException:
            stream.cancel()
            raise
        return reg, plain, with_hf, resp

    reg, plain, with_hf, resp = call(limited.target, go)
    assert not reg.already_registered
    assert reg.vocab_size == len(hf_tokenizer) + 64
    assert not reg.jump_forward_supported
    assert plain.grammar_id != with_hf.grammar_id  # the tokenizer is part of the grammar id
    no_jf, jf = resp.results
    assert no_jf.status == jf.status == pb.SESSION_STATUS_OK
    assert not no_jf.jump_forward.forced_token_ids
    assert jf.jump_forward.forced_text.startswith('{"')
    assert "".join(hf_tokenizer.decode([t]) for t in jf.jump_forward.forced_token_ids) == jf.jump_forward.forced_text


@pytest.mark.parametrize(
    "make_request, match",
    [
        pytest.param(lambda d: pb.RegisterTokenizerRequest(tokenizer_fingerprint="ab" * 32,
                                                           tokenizer_info_json_zlib=d.compressed_info()),
                     "does not match the SHA-256", id="fingerprint-mismatch"),
        pytest.param(lambda d: pb.RegisterTokenizerRequest(tokenizer_fingerprint="cd" * 32,
                                                           tokenizer_info_json_zlib=b"certainly not zlib"),
                     "not zlib-compressed", id="garbage-zlib"),
        pytest.param(lambda d: pb.RegisterTokenizerRequest(
            tokenizer_fingerprint=__import__("shared.tokenizer").tokenizer.fingerprint('{"not": "a tokenizer"}'),
            tokenizer_info_json_zlib=zlib.compress(b'{"not": "a tokenizer"}')),
                     "not an xgrammar TokenizerInfo", id="not-a-tokenizer-info"),
        pytest.param(lambda d: pb.RegisterTokenizerRequest(tokenizer_fingerprint="ef" * 32,
                                                           tokenizer_info_json_zlib=zlib.compress(b"\xff\xfe\x00")),
                     "not UTF-8", id="not-utf8"),
        pytest.param(lambda d: pb.RegisterTokenizerRequest(
            tokenizer_fingerprint=d.fingerprint[::-1], tokenizer_info_json_zlib=d.compressed_info(),
            hf_tokenizer_json_zlib=zlib.compress(b"{}")),
                     "does not match", id="mismatch-with-hf"),
    ],
)
def test_register_invalid_argument(registered, tokenizer_desc, make_request, match):
    req = make_request(tokenizer_desc)
    err = rpc_error(registered.target, lambda c: c.stub.RegisterTokenizer(req))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in err.details()
    # Nothing was registered under the fingerprint that was sent.
    err = rpc_error(registered.target, lambda c: c.stub.RegisterTokenizer(
        pb.RegisterTokenizerRequest(tokenizer_fingerprint=req.tokenizer_fingerprint)))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_register_bad_hf_json_is_invalid_argument(limited, hf_tokenizer):
    from shared.tokenizer import describe

    desc = describe(hf_tokenizer, vocab_size=len(hf_tokenizer) + 128, with_hf_json=False)
    err = rpc_error(limited.target, lambda c: c.stub.RegisterTokenizer(pb.RegisterTokenizerRequest(
        tokenizer_fingerprint=desc.fingerprint, tokenizer_info_json_zlib=desc.compressed_info(),
        hf_tokenizer_json_zlib=zlib.compress(b'{"model": "nope"}'))))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokenizer.json" in err.details()


# ---------------------------------------------------------------- Compile: every kind really constrains

CHOICES = ['say "hi"', "back\\slash", "ünïcödé 😀", "line\nbreak", "tab\there"]
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<call>",
        "content": {"type": "json_schema",
                    "json_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"]}},
        "end": "</call>",
    },
}

KINDS = [
    pytest.param(json_schema(OBJ), ['{"a":1,"b":"x"}'],
                 ['{"a": 1,"b":"x"}', '{"b":"x","a":1}', '{"a":1,"b":"x","c":2}', '{"a":"1","b":"x"}'],
                 id="json-schema-default-compact"),
    pytest.param(json_schema(OBJ, whitespace=pb.WHITESPACE_STYLE_COMPACT), ['{"a":-7,"b":"é"}'],
                 ['{"a":1, "b":"x"}', '{ "a":1,"b":"x"}', '{"a":1,"b":"x"}\n'], id="json-schema-compact"),
    pytest.param(json_schema(OBJ, whitespace=pb.WHITESPACE_STYLE_INDENTED), [json.dumps(OBJ_VALUE, indent=2)],
                 ['{"a":1,"b":"x"}', json.dumps(OBJ_VALUE, indent=4)], id="json-schema-indented-default-2"),
    pytest.param(json_schema(OBJ, whitespace=pb.WHITESPACE_STYLE_INDENTED, indent=4),
                 [json.dumps(OBJ_VALUE, indent=4)], [json.dumps(OBJ_VALUE, indent=2)], id="json-schema-indented-4"),
    pytest.param(json_schema(OBJ, whitespace=pb.WHITESPACE_STYLE_FLEXIBLE),
                 ['{"a":1,"b":"x"}', '{ "a" : 1 ,\n "b": "x" }', '{"a":1,"b":"x"  }'],
                 ['{"a":   1,"b":"x"}', '{"a":1,"b":"x","c":2}'], id="json-schema-flexible-max-2"),
    pytest.param(json_schema(OBJ, whitespace=pb.WHITESPACE_STYLE_FLEXIBLE, max_whitespace_count=4),
                 ['{"a":    1,"b":"x"}'], ['{"a":     1,"b":"x"}'], id="json-schema-flexible-max-4"),
    pytest.param(json_schema(OBJ, any_key_order=True), ['{"b":"x","a":1}', '{"a":1,"b":"x"}'],
                 ['{"b":"x","c":1}', '{"b": "x","a":1}'], id="json-schema-any-key-order"),
    pytest.param(json_schema(OBJ, lenient=True), ['{"a":1,"b":"x","c":true}', '{"a":1,"b":"x","c":"s","d":null}',
                                                  '{"a":1,"b":"x"}'],
                 ['{"a":"1","b":"x"}', '{"b":"x","a":1}'], id="json-schema-lenient"),
    # A part no value satisfies (an enum none of whose values is a string) is `false`: never written.
    pytest.param(json_schema({"type": "object", "properties": {"a": {"type": "string", "enum": [1, 2]},
                                                               "b": {"type": "integer"}}, "required": ["b"]}),
                 ['{"b":1}'], ['{"a":"x","b":1}', '{"a":1,"b":1}', '{"b":1,"a":1}'],
                 id="json-schema-unsatisfiable-optional-property"),
    # The same through a `$ref` (it was a `$ref` to a `false` definition, which xgrammar refused: the whole schema).
    pytest.param(json_schema({"type": "object", "properties": {"a": {"$ref": "#/$defs/bad"}, "b": {"type": "integer"}},
                              "required": ["b"], "$defs": {"bad": {"type": "integer", "minimum": 5, "maximum": 2}}}),
                 ['{"b":1}'], ['{"a":3,"b":1}', '{"b":1,"a":3}'], id="json-schema-unsatisfiable-optional-property-ref"),
    pytest.param(json_schema({"type": "array", "items": {"type": "integer", "const": "a"}}), ["[]"],
                 ['["a"]', "[1]"], id="json-schema-unsatisfiable-items"),
    pytest.param(json_schema({"anyOf": [{"type": "string", "enum": [1]}, {"type": "integer"}]}), ["5"],
                 ['"a"', '"1"'], id="json-schema-unsatisfiable-branch"),
    pytest.param(pb.GrammarSpec(regex=r"[0-9]{3}-[0-9]{4}"), ["555-1234"], ["55a-1234", "555-12345", "5551234"],
                 id="regex"),
    pytest.param(pb.GrammarSpec(ebnf=pb.Ebnf(grammar='root ::= "a" ("," "a")*')), ["a", "a,a,a"], ["a,,", "b", "aa"],
                 id="ebnf-default-root"),
    pytest.param(pb.GrammarSpec(ebnf=pb.Ebnf(grammar='start ::= "yes" | "no" | "maybe " num\nnum ::= [0-9]+',
                                             root_rule="start")),
                 ["yes", "no", "maybe 42"], ["yes!", "maybe x", "nope"], id="ebnf-root-rule"),
    pytest.param(pb.GrammarSpec(choice=pb.ChoiceList(choices=CHOICES)), CHOICES,
                 ["say hi", "back/slash", "line\\nbreak", "ünïcödé 😁", 'say "hi"!', "tab\\there"], id="choice"),
    pytest.param(pb.GrammarSpec(json_object=pb.JsonObject()), ['{"x":{"y":null}}', '{"x":"w"}', "{}"],
                 ["[1,2]", '"str"', '{"x": 1}'], id="json-object-compact"),
    pytest.param(pb.GrammarSpec(json_object=pb.JsonObject(options=pb.JsonSchemaOptions(
        whitespace=pb.WHITESPACE_STYLE_FLEXIBLE))), ['{ "x": [1, 2] }'], ["[1]"], id="json-object-flexible"),
    pytest.param(pb.GrammarSpec(structural_tag=json.dumps(TAG)), ['<call>{"city":"Paris"}</call>'],
                 ['<call>{"town":"Paris"}</call>', '<call>{"city":"Paris"}</cal>x', "hello"], id="structural-tag"),
]


@pytest.mark.parametrize("spec, valid, invalid", KINDS)
def test_compile_kind_constrains(registered, prober, spec, valid, invalid):
    async def go(client: GrammarClient):
        resp = await client.compile(registered.fingerprint, spec)
        assert len(resp.grammar_id) == 32 and int(resp.grammar_id, 16) >= 0
        assert resp.memory_bytes > 0
        assert resp.compile_duration_seconds >= 0
        await prober.assert_constrains(client, resp.grammar_id, valid, invalid)

    call(registered.target, go)


# xgrammar 0.2.8 hard-codes ', ' between the items of untyped values whatever the separators;
# structd's JSON grammar makes them compact (grammar_svc/schema/json_grammar.py).
@pytest.mark.parametrize(
    "spec, text",
    [
        pytest.param(pb.GrammarSpec(json_object=pb.JsonObject()), '{"a":1,"b":2}', id="json-object-two-keys"),
        pytest.param(json_schema({"type": "array"}), "[1,2]", id="untyped-array"),
        pytest.param(json_schema(OBJ, lenient=True), '{"a":1,"b":"x","c":[true,null]}', id="lenient-extra-array"),
    ],
)
def test_compact_style_applies_to_untyped_values(registered, prober, spec, text):
    resp = compile_(registered.target, registered.fingerprint, spec)
    call(registered.target, lambda c: prober.assert_constrains(c, resp.grammar_id, [text], []))


def test_grammar_id_depends_on_every_option(registered):
    specs = [
        json_schema(OBJ),
        json_schema(OBJ, whitespace=pb.WHITESPACE_STYLE_INDENTED),
        json_schema(OBJ, whitespace=pb.WHITESPACE_STYLE_INDENTED, indent=4),
        json_schema(OBJ, whitespace=pb.WHITESPACE_STYLE_FLEXIBLE),
        json_schema(OBJ, whitespace=pb.WHITESPACE_STYLE_FLEXIBLE, max_whitespace_count=4),
        json_schema(OBJ, any_key_order=True),
        json_schema(OBJ, lenient=True),
        pb.GrammarSpec(json_object=pb.JsonObject()),
        pb.GrammarSpec(ebnf=pb.Ebnf(grammar='start ::= "a"\nroot ::= "b"', root_rule="start")),
        pb.GrammarSpec(ebnf=pb.Ebnf(grammar='start ::= "a"\nroot ::= "b"')),
    ]

    async def go(client):
        return [(await client.compile(registered.fingerprint, s)).grammar_id for s in specs]

    ids = call(registered.target, go)
    assert len(set(ids)) == len(ids)
    # ...and UNSPECIFIED whitespace is the COMPACT default: the same grammar.
    same = compile_(registered.target, registered.fingerprint,
                    json_schema(OBJ, whitespace=pb.WHITESPACE_STYLE_COMPACT))
    assert same.grammar_id == ids[0]


# ---------------------------------------------------------------- Compile: status codes

BAD_SPECS = [
    pytest.param(json_schema('{"type": "object",'), "not valid JSON", id="malformed-json-schema"),
    pytest.param(json_schema("[1, 2]"), "must be a JSON object or boolean", id="json-schema-not-object"),
    pytest.param(json_schema("false"), "matches nothing", id="json-schema-false"),
    pytest.param(json_schema({"type": "array", "minItems": 3, "maxItems": 1}),
                 "json_schema matches nothing: at the root, its minItems 3 is greater than its maxItems 1",
                 id="unsatisfiable-min-items"),
    # Normalisation finds the schema matches nothing, and says where and why.
    pytest.param(json_schema({"type": "string", "enum": [1, 2]}),
                 "json_schema matches nothing: at the root, none of its enum values is of its type 'string'",
                 id="enum-of-no-value-of-its-type"),
    pytest.param(json_schema({"allOf": [{"type": "string"}, {"const": 1}]}),
                 "at the root, its const 1 is not of its type 'string'", id="all-of-const-not-of-the-type"),
    pytest.param(json_schema({"type": "object", "properties": {"a": {"type": "integer", "const": "a"}},
                              "required": ["a"]}),
                 "at the root, its required property 'a' accepts no value; at /properties/a, its const 'a' is not of "
                 "its type 'integer'", id="required-property-of-no-value"),
    pytest.param(json_schema({"type": "array", "items": {"type": "string", "enum": [1]}, "minItems": 1}),
                 "its items accept no value and its minItems is 1", id="items-of-no-value"),
    # xgrammar said "Invalid range: minimum greater than maximum", naming no place.
    pytest.param(json_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 2}},
                              "required": ["n"]}),
                 "at the root, its required property 'n' accepts no value; at /properties/n, its minimum 5 is greater "
                 "than its maximum 2", id="required-property-of-contradictory-bounds"),
    pytest.param(json_schema({"type": "object", "properties": {"n": {"$ref": "#/$defs/bad"}}, "required": ["n"],
                              "$defs": {"bad": {"type": "integer", "minimum": 5, "maximum": 2}}}),
                 "at the root, its required property 'n' accepts no value; at /properties/n, its $ref '#/$defs/bad' "
                 "accepts no value; at /properties/n/#/$defs/bad, its minimum 5 is greater than its maximum 2",
                 id="required-property-through-a-ref"),
    # Its refusal names the property twice, 72 KB as gRPC sends it: past the client's header limit the call ended
    # RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit"). Capped, it keeps its code.
    pytest.param(json_schema({"type": "object", "properties": {"\u00e9" * 6000: {"enum": []}}, "required": ["\u00e9" * 6000]}),
                 "more characters cut", id="a-long-refusal-keeps-its-code"),
    # A name with a lone surrogate (JSON "\ud800"), repeated in the refusal: grpc could not encode the details and
    # the call was never answered. Written as its escape.
    pytest.param(json_schema({"type": "object", "properties": {"\ud800": {"enum": []}}, "required": ["\ud800"]}),
                 "'\\ud800' accepts no value", id="a-refusal-naming-a-lone-surrogate"),
    pytest.param(json_schema(OBJ, whitespace=pb.WHITESPACE_STYLE_INDENTED, indent=99), "indent", id="indent-too-large"),
    pytest.param(json_schema(OBJ, whitespace=99), "whitespace style", id="unknown-whitespace-style"),
    pytest.param(pb.GrammarSpec(regex="[a-"), "Regex parsing error", id="bad-regex"),
    pytest.param(pb.GrammarSpec(regex=""), "regex is empty", id="empty-regex"),
    pytest.param(pb.GrammarSpec(ebnf=pb.Ebnf(grammar='root ::= "a" |')), "EBNF parser error", id="bad-ebnf"),
    pytest.param(pb.GrammarSpec(ebnf=pb.Ebnf(grammar="root ::= undefined_rule")), "not defined",
                 id="ebnf-undefined-rule"),
    pytest.param(pb.GrammarSpec(ebnf=pb.Ebnf(grammar='start ::= "a"')), 'name "root" is not found',
                 id="ebnf-missing-root"),
    pytest.param(pb.GrammarSpec(ebnf=pb.Ebnf(grammar='root ::= "a"', root_rule="no-such rule")), "not a valid rule name",
                 id="ebnf-bad-root-rule-name"),
    pytest.param(pb.GrammarSpec(choice=pb.ChoiceList()), "at least one", id="empty-choice"),
    pytest.param(pb.GrammarSpec(choice=pb.ChoiceList(choices=["a", ""])), "non-empty", id="choice-empty-option"),
    pytest.param(pb.GrammarSpec(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}'),
                 "Format type not recognized", id="bad-structural-tag"),
    pytest.param(pb.GrammarSpec(structural_tag="[]"), "must be a JSON object", id="structural-tag-not-object"),
    pytest.param(pb.GrammarSpec(), "no kind set", id="no-kind-set"),
]


@pytest.mark.parametrize("spec, match", BAD_SPECS)
def test_compile_invalid_argument(registered, spec, match):
    err = rpc_error(registered.target, lambda c: c.compile(registered.fingerprint, spec))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert match in err.details()
    assert "Traceback" not in err.details() and ".cc:" not in err.details()


def test_compile_negative_timeout_is_invalid_argument(registered):
    err = rpc_error(registered.target, lambda c: c.compile(registered.fingerprint, fast_spec(), timeout_seconds=-1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "timeout_seconds" in err.details()


def test_compile_unknown_tokenizer_is_failed_precondition(registered):
    err = rpc_error(registered.target, lambda c: c.compile("0" * 64, json_schema(OBJ)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "RegisterTokenizer" in err.details()


def test_compile_spec_too_large_is_invalid_argument(limited):
    spec = pb.GrammarSpec(regex="a" * (LIMITED_MAX_SPEC_BYTES + 1))
    before = sample(limited.srv, "grammar_svc_compile_failures_total", kind="regex", reason="too_large")
    err = rpc_error(limited.target, lambda c: c.compile(limited.fingerprint, spec))
    # It can never pass: not RESOURCE_EXHAUSTED, which clients retry.
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(LIMITED_MAX_SPEC_BYTES) in err.details() and "--max-spec-bytes" in err.details()
    assert sample(limited.srv, "grammar_svc_compile_failures_total", kind="regex", reason="too_large") == before + 1
    # Exactly at the limit is admitted.
    ok = compile_(limited.target, limited.fingerprint, pb.GrammarSpec(regex="a" * LIMITED_MAX_SPEC_BYTES))
    assert ok.grammar_id


# ---------------------------------------------------------------- cache


def test_cache_hit_returns_same_grammar_id(grammar_server, registered):
    spec = json_schema({"type": "object", "properties": {salt(): {"type": "boolean"}}})
    hits = sample(grammar_server, "grammar_svc_cache_hits_total", kind="json_schema")
    misses = sample(grammar_server, "grammar_svc_cache_misses_total", kind="json_schema")

    async def go(client):
        return [await client.compile(registered.fingerprint, spec) for _ in range(3)]

    first, second, third = call(registered.target, go)
    assert not first.cache_hit
    assert second.cache_hit and third.cache_hit
    assert first.grammar_id == second.grammar_id == third.grammar_id
    assert second.compile_duration_seconds == first.compile_duration_seconds  # the original compile's time
    assert second.memory_bytes == first.memory_bytes
    assert sample(grammar_server, "grammar_svc_cache_misses_total", kind="json_schema") == misses + 1
    assert sample(grammar_server, "grammar_svc_cache_hits_total", kind="json_schema") == hits + 2


@pytest.mark.parametrize(
    "make_spec, kind",
    [
        pytest.param(lambda s: pb.GrammarSpec(regex=f"{s}[a-"), "regex", id="bad-regex"),
        pytest.param(lambda s: json_schema({"title": s, "type": "array", "minItems": 2, "maxItems": 1}),
                     "json_schema", id="unsatisfiable-schema"),
    ],
)
def test_failed_compile_is_cached(grammar_server, registered, make_spec, kind):
    spec = make_spec(salt())
    hits = sample(grammar_server, "grammar_svc_cache_hits_total", kind=kind)
    failures = sample(grammar_server, "grammar_svc_compile_failures_total", kind=kind, reason="invalid")
    first = rpc_error(registered.target, lambda c: c.compile(registered.fingerprint, spec))
    assert sample(grammar_server, "grammar_svc_compile_failures_total", kind=kind, reason="invalid") == failures + 1
    second = rpc_error(registered.target, lambda c: c.compile(registered.fingerprint, spec))
    assert first.code() == second.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert first.details() == second.details()
    # The second answer came from the cache: a hit, and no second compile failure.
    assert sample(grammar_server, "grammar_svc_cache_hits_total", kind=kind) == hits + 1
    assert sample(grammar_server, "grammar_svc_compile_failures_total", kind=kind, reason="invalid") == failures + 1


def test_warnings_name_ignored_keywords(registered, prober):
    schema = {"type": "object",
              "properties": {"n": {"type": "number", "multipleOf": 0.5},
                             "l": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
              "required": ["n", "l"]}
    resp = compile_(registered.target, registered.fingerprint, json_schema(schema))
    text = "\n".join(resp.warnings)
    assert "multipleOf" in text
    assert any("uniqueItems" in w and w.startswith("/properties/l") for w in resp.warnings), resp.warnings
    # Ignored really means ignored: a repeated item and a non-multiple are accepted.
    call(registered.target, lambda c: prober.assert_constrains(
        c, resp.grammar_id, ['{"n":0.3,"l":[1,1]}'], ['{"n":"x","l":[]}']))
    # A cache hit carries the same warnings.
    again = compile_(registered.target, registered.fingerprint, json_schema(schema))
    assert again.cache_hit and list(again.warnings) == list(resp.warnings)
    # A clean schema has none.
    assert not compile_(registered.target, registered.fingerprint, json_schema(OBJ)).warnings


# ---------------------------------------------------------------- deadlines kill the worker


def test_compile_deadline_kills_worker(limited):
    srv = limited.srv
    # Warm the single worker (it loads the tokenizer on first use) so the
    # deadline below is spent on the compile itself.
    compile_(limited.target, limited.fingerprint, fast_spec())
    before = wait_pool_ready(srv, 1)
    (old_pid,) = before["pids"]
    assert pid_alive(old_pid)
    failures = sample(srv, "grammar_svc_compile_failures_total", kind="json_schema", reason="timeout")
    spec = slow_schema(f"kill-{salt()}")

    err = rpc_error(limited.target, lambda c: c.compile(limited.fingerprint, spec, timeout_seconds=0.3))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline" in err.details() and "0.3" in err.details()
    assert pool_state(srv)["kills"] == before["kills"] + 1
    assert sample(srv, "grammar_svc_compile_failures_total", kind="json_schema", reason="timeout") == failures + 1
    # The worker that ran it is gone (killed and reaped), and a fresh one takes its place.
    wait_until(lambda: not pid_alive(old_pid), f"worker {old_pid} to exit")
    after = wait_pool_ready(srv, 1)
    (new_pid,) = after["pids"]
    assert new_pid != old_pid and pid_alive(new_pid)

    # The same spec with no more time is answered from the failure cache: no new kill.
    hits = sample(srv, "grammar_svc_cache_hits_total", kind="json_schema")
    again = rpc_error(limited.target, lambda c: c.compile(limited.fingerprint, spec, timeout_seconds=0.3))
    assert again.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sample(srv, "grammar_svc_cache_hits_total", kind="json_schema") == hits + 1
    assert pool_state(srv)["kills"] == before["kills"] + 1

    # A following compile works, on the fresh worker (the only one).
    ok = compile_(limited.target, limited.fingerprint, fast_spec())
    assert ok.grammar_id and not ok.cache_hit
    (worker,) = pool_state(srv)["workers"]
    assert worker.proc.pid == new_pid and limited.fingerprint in worker.tokenizers

    # Granting more time retries the compile (and, still too short, kills again).
    err = rpc_error(limited.target, lambda c: c.compile(limited.fingerprint, spec, timeout_seconds=0.6))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert pool_state(srv)["kills"] == before["kills"] + 2
    wait_until(lambda: not pid_alive(new_pid), f"worker {new_pid} to exit")
    wait_pool_ready(srv, 1)


def test_grpc_deadline_caps_compile(limited):
    """No timeout_seconds, server default 300 s: the call's own gRPC deadline stops the compile."""
    srv = limited.srv
    compile_(limited.target, limited.fingerprint, fast_spec())  # warm the worker
    before = wait_pool_ready(srv, 1)
    (old_pid,) = before["pids"]
    spec = slow_schema(f"grpc-deadline-{salt()}")
    err = rpc_error(limited.target, lambda c: c.compile(limited.fingerprint, spec, rpc_timeout=1.0))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Without the cap the worker would run for the 300 s default; it is killed instead.
    wait_until(lambda: pool_state(srv)["kills"] == before["kills"] + 1, "the compile worker to be killed", timeout=60)
    wait_until(lambda: not pid_alive(old_pid), f"worker {old_pid} to exit")
    wait_pool_ready(srv, 1)
    assert compile_(limited.target, limited.fingerprint, fast_spec()).grammar_id


def test_slow_compile_does_not_block_fast_one(grammar_server, registered):
    srv = grammar_server
    n_workers = srv.server.config.compile_workers
    assert n_workers >= 2
    wait_pool_ready(srv, n_workers)
    # Warm both workers with the tokenizer.
    call(registered.target, lambda c: asyncio.gather(*[c.compile(registered.fingerprint, fast_spec())
                                                       for _ in range(n_workers)]))
    wait_pool_ready(srv, n_workers)
    slow = slow_schema(f"concurrency-{salt()}")
    fast = fast_spec()
    kills = pool_state(srv)["kills"]

    async def go(client: GrammarClient):
        slow_task = asyncio.ensure_future(client.compile(registered.fingerprint, slow, timeout_seconds=3.0))
        # Wait until the slow compile holds a worker.
        while pool_state(srv)["busy"] < 1:
            assert not slow_task.done(), slow_task
            await asyncio.sleep(0.02)
        fast_resp = await client.compile(registered.fingerprint, fast)
        slow_done_first = slow_task.done()
        try:
            await slow_task
            slow_error = None
        except grpc.aio.AioRpcError as e:
            slow_error = e
        return fast_resp, slow_done_first, slow_error

    fast_resp, slow_done_first, slow_error = call(registered.target, go)
    assert not fast_resp.cache_hit
    assert not slow_done_first, "the fast compile waited for the slow one"
    assert slow_error is not None and slow_error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert pool_state(srv)["kills"] == kills + 1
    wait_pool_ready(srv, n_workers)


# ---------------------------------------------------------------- health, reflection


@pytest.mark.parametrize("service", [pytest.param("", id="server"), pytest.param(SERVICE, id="grammar-service")])
def test_health_serving(grammar_server, service):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(grammar_server.target) as channel:
        resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_health_unknown_service_not_found(grammar_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(grammar_server.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="no.such.Service"),
                                                      timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_grammar_service(grammar_server):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(grammar_server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert SERVICE in services
        assert "grpc.health.v1.Health" in services
        desc = DescriptorPool(db).FindServiceByName(SERVICE)
        assert {m.name for m in desc.methods} == {"RegisterTokenizer", "Compile", "Step", "CheckOutput"}
        step = desc.methods_by_name["Step"]
        assert step.client_streaming and step.server_streaming


# ---------------------------------------------------------------- metrics

METRIC_NAMES = [
    "grammar_svc_compile_duration_seconds",
    "grammar_svc_compile_failures_total",
    "grammar_svc_cache_hits_total",
    "grammar_svc_cache_misses_total",
    "grammar_svc_cache_bytes",
    "grammar_svc_active_sessions",
    "grammar_svc_mask_fill_duration_seconds",
    "grammar_svc_step_duration_seconds",
    "grammar_svc_mask_bytes",
    "grammar_svc_jump_forward_tokens_total",
]


def test_metrics_endpoint(limited, prober):
    srv = limited.srv
    assert srv.server.metrics_port == srv.server.config.metrics_port != 0
    spec = json_schema({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
                        "title": salt()})

    async def traffic(client: GrammarClient):
        resp = await client.compile(limited.fingerprint, spec)
        await client.compile(limited.fingerprint, spec)  # hit
        with pytest.raises(grpc.aio.AioRpcError):
            await client.compile(limited.fingerprint, pb.GrammarSpec(regex=f"{salt()}("))  # failure
        stream = client.open_stream(VOCAB)
        try:
            r = await stream.step([pb.SessionStep(session_id=1, open=pb.OpenSession(grammar_id=resp.grammar_id),
                                                  jump_forward=True),
                                   pb.SessionStep(session_id=2, open=pb.OpenSession(grammar_id=resp.grammar_id))])
            live = sample(srv, "grammar_svc_active_sessions")
            await stream.step([pb.SessionStep(session_id=1, close=True), pb.SessionStep(session_id=2, close=True)])
            await end_stream(stream)
        except BaseException:
            stream.cancel()
            raise
        return r, live

    step, live = call(limited.target, traffic)
    assert step.results[0].jump_forward.forced_token_ids
    assert live >= 2

    url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
        body = r.read().decode()
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            samples[name_labels] = float(value)
    names = {k.split("{")[0] for k in samples}
    for name in METRIC_NAMES:
        assert f"# TYPE {name} " in body, name
        assert any(n == name or n.startswith(name + "_") for n in names), f"{name} has no samples"
    # The traffic above shows up.
    assert sum(v for k, v in samples.items() if k.startswith("grammar_svc_jump_forward_tokens_total")) >= \
        len(step.results[0].jump_forward.forced_token_ids)
    assert sum(v for k, v in samples.items() if k.startswith("grammar_svc_compile_duration_seconds_count")) >= 1
    assert sum(v for k, v in samples.items() if k.startswith("grammar_svc_cache_hits_total")) >= 1
    assert sum(v for k, v in samples.items() if k.startswith("grammar_svc_compile_failures_total")) >= 1
    assert sum(v for k, v in samples.items() if k.startswith("grammar_svc_mask_fill_duration_seconds_count")) >= 2
    assert sum(v for k, v in samples.items() if k.startswith("grammar_svc_step_duration_seconds_count")) >= 2
    assert sum(v for k, v in samples.items() if k.startswith("grammar_svc_mask_bytes_count")) >= 2
    assert samples["grammar_svc_cache_bytes"] > 0

    promtool = require_tool("promtool")
    check = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
