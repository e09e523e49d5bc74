"""Hostile input at the grammar service (issue 24), each finding through the real server over gRPC.

- a schema whose normalisation is exponential (sixteen nested
  `{properties, anyOf}` levels; `allOf` chains of `$ref`s) is refused by the
  normaliser's work budget, INVALID_ARGUMENT naming the keyword path, in
  about a second of one worker, and the replica goes on serving;
- compile and check workers run under an address-space cap
  (--worker-memory-limit-bytes): a compile that needs more fails alone,
  naming the flag, and the next compile runs on a fresh worker; a check
  that needs more fails alone and its worker checks the next;
- a document nested a thousand deep is INVALID_ARGUMENT naming the nesting
  limit (it was RecursionError: INTERNAL), and so are NaN, Infinity and
  1e400, which Python's json reads (the schema fuzzer's finding: a NaN length
  bound was an OverflowError in the worker);
- a check worker that dies (killed here for real) fails the check it was
  running, UNAVAILABLE saying so, and the checks after it run on a new pool
  (the broken pool used to answer every later check with an error).

Most tests use the session's server; the memory cap's own tests start a
server (compiles) and check workers (checks) with a cap barely above what a
worker maps, since they must make a worker run out of address space.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import signal
import uuid
from concurrent.futures import ProcessPoolExecutor

import grpc
import pytest
import xgrammar as xgr

from grammar_svc import output_check
from shared.json_nesting import MAX_NESTING
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient
from shared.tokenizer import fingerprint as fingerprint_of
from tests.conftest import run, start_grammar_server
from tests.test_grammar_rpcs import call, json_schema, rpc_error, salt, sample, wait_until
from tests.test_output_check import SLOW, spec, tokens


def nested_any_of(levels: int, title: str = "") -> dict:
    """The issue's schema: each level an object whose `p` is the level below, beside an anyOf (1.5 KB at 16)."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"p": schema}, "anyOf": [{"required": ["p"]}, {"minProperties": 0}]}
    return {"title": title, **schema}


def ref_chain(levels: int) -> dict:
    """Each definition holds the one below twice, each time merged through an allOf with its $ref."""
    defs = {"d0": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    for i in range(1, levels + 1):
        ref = {"$ref": f"#/$defs/d{i - 1}"}
        defs[f"d{i}"] = {"type": "object", "properties": {"a": {"allOf": [ref, {"type": "object"}]},
                                                          "b": {"allOf": [ref, {"minProperties": 1}]}}}
    return {"title": salt(), "$defs": defs, "allOf": [{"$ref": f"#/$defs/d{levels}"}, {"type": "object"}]}


def deep(levels: int) -> str:
    return '{"type": "array", "items": ' * levels + "{}" + "}" * levels


def process_limits(pid: int) -> str:
    with open(f"/proc/{pid}/limits") as f:
        return next(line for line in f if line.startswith("Max address space"))


def vm_size_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


@pytest.mark.parametrize("schema, path", [
    pytest.param(nested_any_of(16, "16 levels"), "/properties/p/properties/p/properties/p/anyOf/1",
                 id="nested-anyof-16-levels"),
    pytest.param(ref_chain(16), "/$defs/d13/properties/a/allOf/0", id="allof-ref-chain-16-levels"),
])
def test_an_exponential_schema_is_refused_by_the_work_budget(grammar_server, registered, schema, path):
    before = sample(grammar_server, "grammar_svc_compile_failures_total", kind="json_schema", reason="too_large")
    err = rpc_error(registered.target, lambda c: c.compile(registered.fingerprint, json_schema(schema),
                                                           timeout_seconds=120, rpc_timeout=180))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "schema nodes" in err.details() and f"(at {path})" in err.details()
    assert sample(grammar_server, "grammar_svc_compile_failures_total", kind="json_schema",
                  reason="too_large") == before + 1
    # The replica goes on serving: a schema within the budget (eight levels, 40 KB normalised) compiles.
    ok = call(registered.target, lambda c: c.compile(registered.fingerprint, json_schema(nested_any_of(8, salt())),
                                                     timeout_seconds=120, rpc_timeout=180))
    assert ok.grammar_id


def test_compile_and_check_workers_run_under_the_address_space_cap(grammar_server, registered, hf_tokenizer):
    limit = grammar_server.server.config.worker_memory_limit_bytes
    assert limit > 0  # on by default
    pool = grammar_server.server.backend.pool
    compile_pids = grammar_server.run_sync(lambda: [w.proc.pid for w in pool._all])
    checks = grammar_server.server.checks
    # A check first, so the check pool's workers exist.
    call(registered.target, lambda c: _compile_and_check(c, registered, {"type": "integer"}, tokens(hf_tokenizer, "1")))
    check_pids = list(checks._pool._processes)
    assert compile_pids and check_pids
    for pid in compile_pids + check_pids:
        assert process_limits(pid).split()[3:5] == [str(limit), str(limit)], pid


async def _compile_and_check(client, registered, schema, token_ids, rpc_timeout=60.0):
    compiled = await client.compile(registered.fingerprint, spec(schema), rpc_timeout=60)
    return await client.check_output(compiled.grammar_id, token_ids, rpc_timeout=rpc_timeout)


class TinyTokenizer:
    def __init__(self):
        info = xgr.TokenizerInfo(["a", "b", f"w{uuid.uuid4().hex[:8]}", "</s>"], stop_token_ids=[3])
        self.info_json = info.serialize_json()
        self.fingerprint = fingerprint_of(self.info_json)

    def request(self) -> pb.RegisterTokenizerRequest:
        import zlib

        return pb.RegisterTokenizerRequest(tokenizer_fingerprint=self.fingerprint,
                                           tokenizer_info_json_zlib=zlib.compress(self.info_json.encode()))


def test_a_compile_past_the_memory_cap_fails_alone(grammar_server):
    """A cap 48 MiB above what a compile worker maps once its imports are done (read from the session
    server's zygote): a regex compiles, the twelve-level schema (70+ MiB more) cannot, and names the flag."""
    zygote = grammar_server.server.backend.pool._factory._zygote
    cap = vm_size_bytes(zygote.proc.pid) + (48 << 20)
    srv = start_grammar_server(compile_workers=1, check_workers=1, worker_memory_limit_bytes=cap)
    try:
        tok = TinyTokenizer()
        call(srv.target, lambda c: c.stub.RegisterTokenizer(tok.request(), timeout=60))
        err = rpc_error(srv.target, lambda c: c.compile(tok.fingerprint, json_schema(nested_any_of(12, salt())),
                                                        timeout_seconds=120, rpc_timeout=180))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert f"{cap} bytes" in err.details() and "--worker-memory-limit-bytes" in err.details()
        assert sample(srv, "grammar_svc_compile_worker_restarts_total", reason="memory") == 1
        # Refused from the failure cache the second time, without a worker.
        again = rpc_error(srv.target, lambda c: c.compile(tok.fingerprint, json_schema(nested_any_of(12, "x")),
                                                          rpc_timeout=180))
        assert again.code() == grpc.StatusCode.INVALID_ARGUMENT
        # The replica serves on: a small compile runs on the fresh worker.
        ok = call(srv.target, lambda c: c.compile(tok.fingerprint, pb.GrammarSpec(regex="(a|b)+"), rpc_timeout=120))
        assert ok.grammar_id
    finally:
        srv.stop()


def test_a_check_past_the_memory_cap_fails_alone():
    """The check side of the cap, on check workers built as the server builds them (a 10 MB document cannot
    reach a check through the server: its token ids would pass gRPC's message limit). 64 MiB above what a
    warm check worker maps, parsing ten million numbers runs out; the worker lives on and checks the next."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=output_check._warm) as pool:
        # Read from here: a function of this module would import it, and all it imports, into the worker.
        cap = vm_size_bytes(pool.submit(os.getpid).result()) + (64 << 20)
    with ProcessPoolExecutor(1, mp_context=context, initializer=output_check._warm, initargs=(cap,)) as pool:
        with pytest.raises(output_check.CheckOutOfMemoryError):
            pool.submit(output_check.check_document, '{"type": "array"}', b"[" + b"1," * 10_000_000 + b"1]").result()
        assert pool.submit(output_check.check_document, '{"type": "array"}', b"[1]").result().total == 0


@pytest.mark.parametrize("make_spec", [
    pytest.param(lambda: json_schema(deep(1000)), id="json-schema"),
    pytest.param(lambda: pb.GrammarSpec(structural_tag='{"type": "structural_tag", "format": ' + "[" * 1000 + "]" * 1000
                                        + "}"), id="structural-tag"),
    pytest.param(lambda: json_schema("[" * 1000), id="unbalanced"),
])
def test_a_document_nested_a_thousand_deep_is_invalid_argument(registered, make_spec):
    err = rpc_error(registered.target, lambda c: c.compile(registered.fingerprint, make_spec(), rpc_timeout=60))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert f"limit of {MAX_NESTING} levels" in err.details()


def test_refused_compiles_leave_nothing_behind(registered):
    """A refused Compile does not keep its request alive: raised through grpc's frames (context.abort), each
    one stayed in reference cycles until a full collection, which a replica of millions of objects seldom runs.
    Sent as bytes, so the only CompileRequest objects in this process are the server's."""
    marker = salt()
    with grpc.insecure_channel(registered.target) as channel:
        compile_bytes = channel.unary_unary("/grammar.v1.GrammarService/Compile")
        for i in range(6):
            spec = json_schema('{"$comment": "' + f"{marker}-{i}" + '", ' + deep(1000)[1:])
            with pytest.raises(grpc.RpcError) as refused:
                compile_bytes(pb.CompileRequest(tokenizer_fingerprint=registered.fingerprint,
                                                spec=spec).SerializeToString(), timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    # Waited for: the server's handler may still be unwinding the last one as its status arrives.
    wait_until(lambda: not [o for o in gc.get_objects()
                            if type(o) is pb.CompileRequest and marker in o.spec.json_schema.schema],
               "no refused CompileRequest reachable", timeout=30)


@pytest.mark.parametrize("schema", [
    pytest.param('{"type": "string", "pattern": "^[a-z]+$", "maxLength": NaN}', id="nan"),
    pytest.param('{"type": "string", "pattern": "^[a-z]+$", "minLength": Infinity}', id="infinity"),
    pytest.param('{"type": "integer", "maximum": 1e400}', id="past-a-double"),
])
def test_numbers_json_does_not_have_are_invalid_argument(registered, schema):
    # Found by tests/test_schema_fuzz.py: a non-finite length bound was an OverflowError in the worker (INTERNAL).
    err = rpc_error(registered.target, lambda c: c.compile(registered.fingerprint, json_schema(schema), rpc_timeout=60))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "is not valid JSON" in err.details()


def test_nesting_at_the_limit_compiles(registered):
    # `deep(n)` nests n + 1 objects: the root's items chain, then the empty schema.
    ok = call(registered.target, lambda c: c.compile(registered.fingerprint, json_schema(deep(MAX_NESTING - 1)),
                                                     rpc_timeout=120))
    assert ok.grammar_id


def test_a_check_whose_worker_dies_fails_alone_and_later_checks_run(grammar_server, registered, hf_tokenizer):
    checks = grammar_server.server.checks

    async def go():
        client = GrammarClient(registered.target)
        try:
            slow = (await client.compile(registered.fingerprint, spec(SLOW), rpc_timeout=60)).grammar_id
            # Hours of backtracking: only the kill ends it.
            pending = asyncio.ensure_future(client.check_output(
                slow, tokens(hf_tokenizer, '"' + "a" * 60 + '!"'), rpc_timeout=300))
            pool = await asyncio.to_thread(wait_until, lambda: checks._pool if checks._pool._pending_work_items
                                           else None, "the check to reach the pool")
            for pid in list(pool._processes):
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as died:
                await pending
            later = await _compile_and_check(client, registered, {"type": "integer"}, tokens(hf_tokenizer, "7"))
            return died.value, later, pool
        finally:
            await client.close()

    before = sample(grammar_server, "grammar_svc_output_checks_total", result="worker_died")
    died, later, broken_pool = run(go())
    assert died.code() == grpc.StatusCode.UNAVAILABLE
    assert "died" in died.details()
    assert sample(grammar_server, "grammar_svc_output_checks_total", result="worker_died") == before + 1
    assert later.total_violations == 0
    assert checks._pool is not broken_pool


def test_a_check_of_a_document_nested_too_deep_is_invalid_argument(registered, hf_tokenizer):
    document = "[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        call(registered.target, lambda c: _compile_and_check(c, registered, {}, tokens(hf_tokenizer, document)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"deeper than {MAX_NESTING} levels" in err.value.details()
