"""The grammar service's per-caller limits, each hit through the real server over gRPC.

--max-sessions-per-stream (a session past it fails alone, RESOURCE_EXHAUSTED),
--max-tokenizers (the least recently used unused tokenizer is evicted; when
every slot is in use, RESOURCE_EXHAUSTED), --max-compile-timeout-seconds (a
compile the cap cut short is INVALID_ARGUMENT: asking again cannot help; one
within the client's own deadline DEADLINE_EXCEEDED) and --max-compiles-per-caller. Every refusal names
its flag and is counted in grammar_svc_limit_rejections_total.

Three module servers: one for sessions and tokenizers, on tiny tokenizers made
here (registering is instant, and each test makes its own so the LRU order is
the test's); one with a single compile worker and a short cap, on the real
tokenizer (the slow schema needs its 129k tokens to be slow); and the same
behind mutual TLS, where a caller is its client certificate.
"""

from __future__ import annotations

import asyncio
import uuid
import zlib

import grpc
import pytest
import xgrammar as xgr

from grammar_svc import config as gconfig
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient
from shared.tls import ClientTls, ServerTls
from shared.tokenizer import fingerprint as fingerprint_of
from structd.cli import build_parser
from tests.conftest import run, start_grammar_server, wait_until
from tests.test_grammar_rpcs import call as with_client
from tests.test_grammar_rpcs import end_stream, fast_spec, salt, slow_schema
from tests.tls_material import Authority

PER_STREAM = 2
TOKENIZERS = 2
COMPILE_CAP_SECONDS = 3.0
LOCAL_CALLER = "peer 127.0.0.1"


class TinyTokenizer:
    """A four-token vocabulary unique to the test (the salt is one token), stop token last."""

    def __init__(self):
        self.word = f"w{uuid.uuid4().hex[:8]}"
        info = xgr.TokenizerInfo(["a", "b", self.word, "</s>"], stop_token_ids=[3])
        self.info_json = info.serialize_json()
        self.fingerprint = fingerprint_of(self.info_json)
        self.vocab_size = 4

    def request(self) -> pb.RegisterTokenizerRequest:
        return pb.RegisterTokenizerRequest(tokenizer_fingerprint=self.fingerprint,
                                           tokenizer_info_json_zlib=zlib.compress(self.info_json.encode()))


def register(target: str, tok: TinyTokenizer) -> pb.RegisterTokenizerResponse:
    return with_client(target, lambda c: c.stub.RegisterTokenizer(tok.request(), timeout=60))


def compile_regex(target: str, tok: TinyTokenizer, regex: str = "a+b") -> pb.CompileResponse:
    return with_client(target, lambda c: c.compile(tok.fingerprint, pb.GrammarSpec(regex=regex), rpc_timeout=60))


def rpc_error(fn) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        fn()
    return info.value


def rejections(srv, limit: str) -> float:
    return srv.server.metrics.registry.get_sample_value("grammar_svc_limit_rejections_total", {"limit": limit})


def metric(srv, name: str) -> float:
    return srv.server.metrics.registry.get_sample_value(name) or 0.0


def sessions_closed(srv) -> None:
    wait_until(lambda: metric(srv, "grammar_svc_active_sessions") == 0, "every session closed")


def open_step(session_id: int, grammar_id: str) -> pb.SessionStep:
    return pb.SessionStep(session_id=session_id, open=pb.OpenSession(grammar_id=grammar_id), skip_mask=True)


@pytest.fixture(scope="module")
def tiny_server():
    srv = start_grammar_server(compile_workers=1, max_sessions_per_stream=PER_STREAM, max_tokenizers=TOKENIZERS)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def compile_server(tokenizer_desc):
    srv = start_grammar_server(compile_workers=1, max_compiles_per_caller=1, compile_timeout_seconds=1.0,
                               max_compile_timeout_seconds=COMPILE_CAP_SECONDS)
    with_client(srv.target, lambda c: c.register_tokenizer(tokenizer_desc))
    yield srv
    srv.stop()


# ---------------------------------------------------------------- flags


def test_each_limit_is_a_flag_with_an_env_twin():
    env = {"STRUCTD_GRAMMAR_MAX_SESSIONS_PER_STREAM": "7", "STRUCTD_GRAMMAR_MAX_TOKENIZERS": "3",
           "STRUCTD_GRAMMAR_MAX_COMPILES_PER_CALLER": "5"}
    cfg = gconfig.from_args(build_parser(env).parse_args(["grammar"]))
    assert (cfg.max_sessions_per_stream, cfg.max_tokenizers, cfg.max_compiles_per_caller) == (7, 3, 5)
    cfg = gconfig.from_args(build_parser(env).parse_args(["grammar", "--max-tokenizers", "9"]))
    assert cfg.max_tokenizers == 9


@pytest.mark.parametrize("flag", [
    pytest.param("--max-sessions-per-stream", id="sessions-per-stream"),
    pytest.param("--max-tokenizers", id="tokenizers"),
    pytest.param("--max-compiles-per-caller", id="compiles-per-caller"),
])
def test_a_limit_below_one_is_refused_at_start_up(flag):
    with pytest.raises(SystemExit) as exit_:
        gconfig.from_args(build_parser({}).parse_args(["grammar", flag, "0"]))
    assert flag in str(exit_.value)


# ---------------------------------------------------------------- sessions per stream


def test_sessions_per_stream(tiny_server):
    tok = TinyTokenizer()
    register(tiny_server.target, tok)
    gid = compile_regex(tiny_server.target, tok).grammar_id
    before = rejections(tiny_server, "sessions_per_stream")

    async def go(client: GrammarClient):
        first, second = client.open_stream(tok.vocab_size, 0), client.open_stream(tok.vocab_size, 0)
        full = await first.step([open_step(i, gid) for i in range(PER_STREAM)])
        over = await first.step([open_step(PER_STREAM, gid)])
        # The limit is the stream's: another stream (another caller, or the same) opens its own.
        other = await second.step([open_step(i, gid) for i in range(PER_STREAM)])
        # A closed session frees its slot.
        await first.step([pb.SessionStep(session_id=0, close=True)])
        again = await first.step([open_step(PER_STREAM, gid)])
        await end_stream(first)
        await end_stream(second)
        return full, over, other, again

    full, over, other, again = with_client(tiny_server.target, go)
    assert [r.status for r in full.results] == [pb.SESSION_STATUS_OK] * PER_STREAM
    (refused,) = over.results
    assert refused.status == pb.SESSION_STATUS_ERROR
    assert refused.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "--max-sessions-per-stream" in refused.error_message
    assert [r.status for r in other.results] == [pb.SESSION_STATUS_OK] * PER_STREAM
    assert [r.status for r in again.results] == [pb.SESSION_STATUS_OK]
    assert rejections(tiny_server, "sessions_per_stream") == before + 1
    sessions_closed(tiny_server)


# ---------------------------------------------------------------- tokenizers


def test_least_recently_used_unused_tokenizer_is_evicted(tiny_server):
    a, b, c = TinyTokenizer(), TinyTokenizer(), TinyTokenizer()
    register(tiny_server.target, a)
    register(tiny_server.target, b)
    b_grammar = compile_regex(tiny_server.target, b)
    compile_regex(tiny_server.target, a)  # a is now the more recently used
    evictions = metric(tiny_server, "grammar_svc_tokenizer_evictions_total")

    assert not register(tiny_server.target, c).already_registered
    assert metric(tiny_server, "grammar_svc_tokenizer_evictions_total") == evictions + 1
    assert metric(tiny_server, "grammar_svc_tokenizers") == TOKENIZERS
    assert compile_regex(tiny_server.target, a).cache_hit, "a was used last: it stays, with its grammars"
    err = rpc_error(lambda: compile_regex(tiny_server.target, b))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "RegisterTokenizer" in err.details()
    # Its compiled grammars went with it: registered again, b compiles afresh.
    register(tiny_server.target, b)
    again = compile_regex(tiny_server.target, b)
    assert again.grammar_id == b_grammar.grammar_id and not again.cache_hit


def test_tokenizers_in_use_are_never_evicted(tiny_server):
    x, y, z = TinyTokenizer(), TinyTokenizer(), TinyTokenizer()
    register(tiny_server.target, x)
    register(tiny_server.target, y)
    x_gid, y_gid = compile_regex(tiny_server.target, x).grammar_id, compile_regex(tiny_server.target, y).grammar_id
    before = rejections(tiny_server, "tokenizers")

    async def go(client: GrammarClient):
        stream = client.open_stream(x.vocab_size, 0)
        await stream.step([open_step(1, x_gid), open_step(2, y_gid)])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.stub.RegisterTokenizer(z.request(), timeout=60)
        await stream.step([pb.SessionStep(session_id=1, close=True)])
        # x is free now: it makes room for z, and y's session goes on undisturbed.
        admitted = await client.stub.RegisterTokenizer(z.request(), timeout=60)
        y_step = await stream.step([pb.SessionStep(session_id=2, accept_token_ids=[0, 0, 1])])
        await end_stream(stream)
        return refused.value, admitted, y_step

    refused, admitted, y_step = with_client(tiny_server.target, go)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-tokenizers" in refused.details()
    assert rejections(tiny_server, "tokenizers") == before + 1
    assert not admitted.already_registered
    (r,) = y_step.results
    assert r.status == pb.SESSION_STATUS_OK and r.accepted_count == 3
    err = rpc_error(lambda: compile_regex(tiny_server.target, x))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    sessions_closed(tiny_server)


# ---------------------------------------------------------------- compiles


def test_compile_cut_by_the_cap_names_the_flag(compile_server, tokenizer_desc):
    before = rejections(compile_server, "compile_timeout_cap")
    err = rpc_error(lambda: with_client(compile_server.target, lambda c: c.compile(
        tokenizer_desc.fingerprint, slow_schema(f"cap-{salt()}"), timeout_seconds=60.0, rpc_timeout=120)))
    # Asking again cannot help: INVALID_ARGUMENT, not the RESOURCE_EXHAUSTED clients retry.
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-compile-timeout-seconds" in err.details() and f"{COMPILE_CAP_SECONDS:g} s" in err.details()
    assert rejections(compile_server, "compile_timeout_cap") == before + 1


def test_compile_past_the_clients_own_deadline_is_deadline_exceeded(compile_server, tokenizer_desc):
    before = rejections(compile_server, "compile_timeout_cap")
    err = rpc_error(lambda: with_client(compile_server.target, lambda c: c.compile(
        tokenizer_desc.fingerprint, slow_schema(f"own-{salt()}"), timeout_seconds=0.5, rpc_timeout=120)))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert rejections(compile_server, "compile_timeout_cap") == before


def test_compiles_per_caller(compile_server, tokenizer_desc):
    fp = tokenizer_desc.fingerprint
    cached = fast_spec()
    with_client(compile_server.target, lambda c: c.compile(fp, cached, rpc_timeout=60))
    before = rejections(compile_server, "compiles_per_caller")

    def waiting() -> int:
        async def read():
            return compile_server.server.backend.callers.waiting(LOCAL_CALLER)
        return compile_server.call(read())

    async def go(client: GrammarClient):
        slow = asyncio.ensure_future(client.compile(fp, slow_schema(f"caller-{salt()}"), timeout_seconds=60.0,
                                                    rpc_timeout=120))
        while waiting() < 1:
            assert not slow.done(), slow
            await asyncio.sleep(0.02)
        # Another connection from the same address is the same caller.
        other = GrammarClient(compile_server.target)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await other.compile(fp, fast_spec(), rpc_timeout=60)
            hit = await other.compile(fp, cached, rpc_timeout=60)  # a cache hit waits on nothing
        finally:
            await other.close()
        with pytest.raises(grpc.aio.AioRpcError):
            await slow  # cut by the cap
        after = await client.compile(fp, fast_spec(), rpc_timeout=60)
        return refused.value, hit, after

    refused, hit, after = with_client(compile_server.target, go)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-compiles-per-caller" in refused.details() and LOCAL_CALLER in refused.details()
    assert hit.cache_hit
    assert after.grammar_id and not after.cache_hit, "the slot is free again once the compile ended"
    assert rejections(compile_server, "compiles_per_caller") == before + 1


# ---------------------------------------------------------------- callers under mutual TLS


class Tenants:
    """A grammar server behind mutual TLS and two tenants' client certificates from its CA."""

    def __init__(self, srv, ca: Authority):
        self.srv = srv
        self.ca = ca
        self.a = ca.issue("tenant-a", server=False)
        self.b = ca.issue("tenant-b", server=False)

    def client(self, issued) -> GrammarClient:
        return GrammarClient(self.srv.target, tls=ClientTls(self.ca.cert_file, issued.cert_file, issued.key_file))


@pytest.fixture(scope="module")
def tenants(tmp_path_factory, tokenizer_desc):
    ca = Authority(tmp_path_factory.mktemp("grammar-limits-pki"), "limits")
    server = ca.issue("server", client=False)
    srv = start_grammar_server(compile_workers=1, max_compiles_per_caller=1,
                               max_compile_timeout_seconds=COMPILE_CAP_SECONDS,
                               tls=ServerTls(server.cert_file, server.key_file, ca.cert_file))
    t = Tenants(srv, ca)

    async def register():
        client = t.client(t.a)
        try:
            await client.register_tokenizer(tokenizer_desc)
        finally:
            await client.close()

    run(register())
    yield t
    srv.stop()


def test_under_mutual_tls_a_caller_is_its_certificate(tenants, tokenizer_desc):
    """Tenant a's second connection shares a's limit; tenant b, from the same address, has its own."""
    fp = tokenizer_desc.fingerprint

    def waiting(caller: str) -> int:
        async def read():
            return tenants.srv.server.backend.callers.waiting(caller)
        return tenants.srv.call(read())

    async def go():
        a1, a2, b = tenants.client(tenants.a), tenants.client(tenants.a), tenants.client(tenants.b)
        try:
            slow = asyncio.ensure_future(a1.compile(fp, slow_schema(f"tenant-{salt()}"), timeout_seconds=60.0,
                                                    rpc_timeout=120))
            while waiting("certificate structd test tenant-a") < 1:
                assert not slow.done(), slow
                await asyncio.sleep(0.02)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await a2.compile(fp, fast_spec(), rpc_timeout=60)
            other = await b.compile(fp, fast_spec(), rpc_timeout=60)
            with pytest.raises(grpc.aio.AioRpcError):
                await slow  # cut by the cap
            return refused.value, other
        finally:
            for c in (a1, a2, b):
                await c.close()

    refused, other = run(go())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "certificate structd test tenant-a" in refused.details()
    assert other.grammar_id and not other.cache_hit
