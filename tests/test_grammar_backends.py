"""Two grammar backends behind one service (issue 26): llguidance beside xgrammar, over real gRPC.

- The same constraint compiled by each backend (CompileRequest.backend) gives sessions whose masks are
  the same over seeded random walks, rollbacks included, where both libraries are exact (regexes,
  choices, EBNF); for JSON Schema llguidance's masks are never wider than xgrammar's (it also keeps a
  forced string to the tokenizer's own tokenization of it, where xgrammar allows any split; the one
  exception seen is -0, a JSON integer llguidance writes and xgrammar does not).
- auto (a dedicated server with a small --fallback-after-seconds): a schema xgrammar compiles for tens of
  seconds is served by llguidance (reason xgrammar_slow), remembered in the cache; a pattern xgrammar
  refuses is served by llguidance (xgrammar_refused); one both refuse keeps xgrammar's INVALID_ARGUMENT; one
  llguidance refuses and xgrammar has not compiled by the budget is INVALID_ARGUMENT then, naming llguidance's reason;
  grammar_svc_backend_choices_total counts each choice. No path (feature, busy, budget) trades xgrammar for an
  llguidance grammar that ignores a keyword xgrammar's enforces (llguidance_ignores). The hedge built before the
  budget is no fallback until the budget decides, and an id it served stays valid; an outlived compile is stopped
  for its worker as the shared compile, only while nobody but outlived requests waits for it.
- A compile's deadline covers loading its grammar into the service.
- A grammar replica on --grammar-backend llguidance serves constrained requests end to end through the
  inference service: the outputs are valid and checked.
- Constraint.backend (a request's choice) overrides that replica's flag and reaches its Compile; the
  inference service's compile memo keeps the two backends' grammars apart; tools with llguidance are refused.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time

import grpc
import numpy as np
import pytest

from shared.codec import words_for_vocab
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient, decode_masks
from tests.conftest import SLOW_SCHEMA, TOO_SLOW_SCHEMA, InferenceServerThread, run, start_grammar_server, wait_until
from tests.test_grammar_rpcs import call, end_stream, json_schema, salt

XGRAMMAR, LLGUIDANCE = pb.GRAMMAR_BACKEND_XGRAMMAR, pb.GRAMMAR_BACKEND_LLGUIDANCE


def compile_on(client: GrammarClient, fingerprint: str, spec: pb.GrammarSpec, backend: int,
               timeout_seconds: float = 20.0) -> pb.CompileResponse:
    return client.stub.Compile(pb.CompileRequest(tokenizer_fingerprint=fingerprint, spec=spec, backend=backend,
                                                 timeout_seconds=timeout_seconds), timeout=120)


def bits(row: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


async def walk_both(target: str, fingerprint: str, vocab: int, stop_ids: set[int], spec: pb.GrammarSpec,
                    seed: int, steps: int = 40) -> list[tuple[np.ndarray, np.ndarray]]:
    """One session per backend, fed the same tokens (drawn from llguidance's mask, with a rollback now and
    then); the masks of every step, (xgrammar's, llguidance's)."""
    client = GrammarClient(target)
    try:
        x = await compile_on(client, fingerprint, spec, XGRAMMAR)
        g = await compile_on(client, fingerprint, spec, LLGUIDANCE)
        assert (x.backend, g.backend) == (XGRAMMAR, LLGUIDANCE)
        assert (x.backend_reason, g.backend_reason) == ("requested", "requested")
        assert x.grammar_id != g.grammar_id  # the backend is part of the grammar id
        stream = client.open_stream(vocab)
        rng = random.Random(seed)
        bitmask = np.zeros((2, words_for_vocab(vocab)), dtype=np.int32)
        masks = []
        accepted = 0
        ops = [pb.SessionStep(session_id=1, open=pb.OpenSession(grammar_id=x.grammar_id)),
               pb.SessionStep(session_id=2, open=pb.OpenSession(grammar_id=g.grammar_id))]
        try:
            for _ in range(steps):
                resp = await stream.step(ops)
                assert [r.status for r in resp.results] == [pb.SESSION_STATUS_OK] * 2, resp
                bitmask[:] = 0
                assert decode_masks(resp, stream.decoder, bitmask) == [0, 1]
                xm, gm = bits(bitmask[0], vocab), bits(bitmask[1], vocab)
                masks.append((xm, gm))
                # Text tokens only: a stop token would end the walk.
                allowed = [int(t) for t in np.flatnonzero(gm) if int(t) not in stop_ids]
                if not allowed:
                    break
                if accepted >= 2 and rng.random() < 0.15:
                    # The next masks are those of two tokens ago.
                    accepted -= 2
                    ops = [pb.SessionStep(session_id=s, rollback_tokens=2) for s in (1, 2)]
                    continue
                token = allowed[rng.randrange(len(allowed))]
                accepted += 1
                ops = [pb.SessionStep(session_id=s, accept_token_ids=[token]) for s in (1, 2)]
            resp = await stream.step([pb.SessionStep(session_id=s, close=True) for s in (1, 2)])
            await end_stream(stream)
        except BaseException:
            stream.cancel()
            raise
        return masks
    finally:
        await client.close()


EXACT = [
    pytest.param(pb.GrammarSpec(regex="[a-c]+x"), id="regex-class"),
    pytest.param(pb.GrammarSpec(regex="(ab|cd){2,5}"), id="regex-repeat"),
    pytest.param(pb.GrammarSpec(regex="[0-9]{3}-[a-z]+"), id="regex-digits-letters"),
    pytest.param(pb.GrammarSpec(choice=pb.ChoiceList(choices=["yes", "no", 'a"b\\c'])), id="choice-escapes"),
    pytest.param(pb.GrammarSpec(ebnf=pb.Ebnf(grammar='root ::= "a" b+\nb ::= [0-9] | "x"')), id="ebnf"),
]


@pytest.mark.parametrize("spec", EXACT)
def test_llguidance_masks_equal_xgrammar_masks(registered, xgr_tokenizer_info, spec):
    stops = set(xgr_tokenizer_info.stop_token_ids)
    for seed in range(3):
        masks = run(walk_both(registered.target, registered.fingerprint, registered.vocab_size, stops, spec, seed))
        for step, (xm, gm) in enumerate(masks):
            assert np.array_equal(xm, gm), (seed, step, np.flatnonzero(xm ^ gm)[:10])


@pytest.mark.parametrize("schema", [
    # Non-negative: llguidance writes -0, a JSON integer xgrammar never writes.
    pytest.param({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}, "b": {"type": "boolean"}},
                  "required": ["a", "b"]}, id="object"),
    pytest.param({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 5},
                 id="array"),
    pytest.param({"enum": ["red", "green", "blue"]}, id="enum"),
])
def test_llguidance_json_masks_within_xgrammar_masks(registered, xgr_tokenizer_info, schema):
    spec = json_schema({"title": salt(), **schema})
    masks = run(walk_both(registered.target, registered.fingerprint, registered.vocab_size,
                          set(xgr_tokenizer_info.stop_token_ids), spec, 7, steps=25))
    equal = 0
    for step, (xm, gm) in enumerate(masks):
        assert not (gm & ~xm).any(), (step, np.flatnonzero(gm & ~xm)[:10])
        equal += np.array_equal(xm, gm)
    assert equal, "no step where both backends agree exactly"


def test_llguidance_refuses_what_it_cannot_lay_out(registered):
    async def go():
        client = GrammarClient(registered.target)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await compile_on(client, registered.fingerprint, json_schema(
                    {"type": "object"}, whitespace=pb.WHITESPACE_STYLE_INDENTED), LLGUIDANCE)
            return info.value
        finally:
            await client.close()

    err = run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "indented" in err.details()


def test_llguidance_names_what_it_ignores(registered):
    # Draft 7: `dependencies` is its keyword (a schema naming no draft is 2020-12's, where it is none).
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "title": salt(), "type": "object",
              "properties": {"a": {"type": "string"}},
              "dependencies": {"a": ["b"]}, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}

    async def go():
        client = GrammarClient(registered.target)
        try:
            return await compile_on(client, registered.fingerprint, json_schema(schema), LLGUIDANCE)
        finally:
            await client.close()

    out = run(go())
    assert {w.keyword for w in out.warning_details} == {"dependencies", "oneOf"}, out.warnings


# ---------------------------------------------------------------- auto: the fallback


@pytest.fixture(scope="module")
def auto_server(tokenizer_desc):
    srv = start_grammar_server(grammar_backend="auto", fallback_after_seconds=0.5, compile_workers=1)
    call(srv.target, lambda client: client.register_tokenizer(tokenizer_desc))
    # The worker loads the tokenizer on its first compile: paid here, not inside a test's fallback budget.
    call(srv.target, lambda client: client.compile(tokenizer_desc.fingerprint, pb.GrammarSpec(regex="[0-9]"),
                                                   timeout_seconds=60.0, rpc_timeout=120,
                                                   backend=XGRAMMAR))
    yield srv
    srv.stop()


async def worker_held(pool, holder: asyncio.Future, timeout: float = 120.0) -> None:
    """Until the holder's compile has the pool's one worker (a holder that ends first, or never gets it, fails)."""
    deadline = time.monotonic() + timeout
    while pool.idle_workers or not pool.busy_workers:
        if holder.done() or time.monotonic() > deadline:
            raise AssertionError(f"the holder compile never held the worker ({holder})")
        await asyncio.sleep(0.02)


def choices(srv, backend: str, reason: str) -> float:
    return srv.server.metrics.registry.get_sample_value(
        "grammar_svc_backend_choices_total", {"backend": backend, "reason": reason}) or 0.0


def auto_compile(srv, fingerprint: str, spec: pb.GrammarSpec) -> pb.CompileResponse:
    return call(srv.target, lambda client: client.compile(fingerprint, spec, timeout_seconds=20.0, rpc_timeout=120))


def test_a_pattern_xgrammar_refuses_is_served_by_llguidance(auto_server, tokenizer_desc):
    spec = json_schema({"title": salt(), "type": "string", "pattern": r"\p{L}+"})
    out = auto_compile(auto_server, tokenizer_desc.fingerprint, spec)
    assert (out.backend, out.backend_reason) == (LLGUIDANCE, "xgrammar_refused")


def test_a_constraint_both_refuse_keeps_xgrammars_refusal(auto_server, tokenizer_desc):
    with pytest.raises(grpc.RpcError) as info:
        auto_compile(auto_server, tokenizer_desc.fingerprint, pb.GrammarSpec(regex=r"\w+\b" + salt()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Regex parsing error" in info.value.details()


@pytest.mark.parametrize("schema, backend, reason", [
    pytest.param({"type": "number", "multipleOf": 0.25}, LLGUIDANCE, "feature", id="multipleOf-number"),
    pytest.param({"type": "array", "items": {"type": ["number", "null"], "multipleOf": 0.5}}, LLGUIDANCE, "feature",
                 id="multipleOf-number-nested"),
    pytest.param({"type": "integer", "multipleOf": 3}, XGRAMMAR, "default", id="multipleOf-integer"),
    # llguidance would drop propertyNames (beside properties, structd does not write it as patternProperties):
    # the multipleOf is not worth that.
    pytest.param({"type": "object", "properties": {"a": {"type": "number"}}, "propertyNames": {"pattern": "^[a-z]+$"},
                  "additionalProperties": {"type": "number", "multipleOf": 0.5}}, XGRAMMAR, "llguidance_ignores",
                 id="llguidance-would-ignore-more"),
    # Alone, propertyNames' pattern is written as patternProperties for llguidance: nothing is dropped.
    pytest.param({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                  "additionalProperties": {"type": "number", "multipleOf": 0.5}}, LLGUIDANCE, "feature",
                 id="property-names-kept-by-llguidance"),
])
def test_auto_serves_what_only_llguidance_enforces_from_llguidance(auto_server, tokenizer_desc, schema, backend,
                                                                    reason):
    """xgrammar drops multipleOf on numbers (warning); llguidance enforces it: auto chooses llguidance for it
    (reason feature), and a repeat is answered from llguidance's cached grammar. Where llguidance would drop more,
    xgrammar serves it and says why (llguidance_ignores); a repeat finds xgrammar's grammar cached (default)."""
    spec = json_schema({"title": salt(), **schema})
    first = auto_compile(auto_server, tokenizer_desc.fingerprint, spec)
    assert (first.backend, first.backend_reason) == (backend, reason), first.warnings
    again = auto_compile(auto_server, tokenizer_desc.fingerprint, spec)
    assert (again.backend, again.backend_reason, again.cache_hit) == (
        backend, "default" if backend == XGRAMMAR else reason, True)


def test_auto_keeps_xgrammar_for_what_it_compiles_in_time(auto_server, tokenizer_desc):
    before = choices(auto_server, "xgrammar", "default")
    out = auto_compile(auto_server, tokenizer_desc.fingerprint, pb.GrammarSpec(regex=f"{salt()}[0-9]+"))
    assert (out.backend, out.backend_reason) == (XGRAMMAR, "default")
    assert choices(auto_server, "xgrammar", "default") == before + 1


def restarts(srv, reason: str) -> float:
    return srv.server.metrics.registry.get_sample_value(
        "grammar_svc_compile_worker_restarts_total", {"reason": reason}) or 0.0


def test_a_compile_past_the_budget_finishes_into_the_cache_for_the_next_request(auto_server, tokenizer_desc):
    """xgrammar's compile goes on after the fallback answered (its worker is not killed) and lands in the cache:
    the next request for the schema gets xgrammar's grammar."""
    spec = json_schema({"title": salt(), **SLOW_SCHEMA})
    abandoned = restarts(auto_server, "abandoned")
    # The shared compile runs to the first request's deadline (a joiner does not extend it): 60 s, room for the
    # slow schema on a compile worker starved by make test's load (it ran past 20 s once).
    first = call(auto_server.target, lambda client: client.compile(
        tokenizer_desc.fingerprint, spec, timeout_seconds=60.0, rpc_timeout=120))
    assert (first.backend, first.backend_reason) == (LLGUIDANCE, "xgrammar_slow")
    # Asked for by name, the same grammar joins the compile still in flight (or finds it cached).
    landed = call(auto_server.target, lambda client: client.compile(
        tokenizer_desc.fingerprint, spec, timeout_seconds=60.0, rpc_timeout=120, backend=XGRAMMAR))
    assert restarts(auto_server, "abandoned") == abandoned
    again = auto_compile(auto_server, tokenizer_desc.fingerprint, spec)
    assert (again.grammar_id, again.backend, again.backend_reason, again.cache_hit) == (
        landed.grammar_id, XGRAMMAR, "default", True)


def test_a_schema_asked_for_while_every_worker_is_busy_goes_to_llguidance_at_once(auto_server, tokenizer_desc):
    """No compile worker free: xgrammar could not start within the budget, so llguidance answers (xgrammar_busy)
    without the request queueing; asked again once a worker is free, xgrammar compiles it."""
    pool = auto_server.server.backend.pool
    wait_until(lambda: pool.idle_workers == 1, "the compile worker is free")
    spec = pb.GrammarSpec(regex=f"{salt()}[0-9]+")
    busy = choices(auto_server, "llguidance", "xgrammar_busy")

    async def while_busy():
        client = GrammarClient(auto_server.target)
        # Asked for by name, a compile of tens of seconds holds the one worker.
        holder = asyncio.ensure_future(compile_on(client, tokenizer_desc.fingerprint,
                                                  json_schema({"title": salt(), **TOO_SLOW_SCHEMA}), XGRAMMAR, 60.0))
        try:
            await worker_held(pool, holder)
            return await client.compile(tokenizer_desc.fingerprint, spec, timeout_seconds=20.0, rpc_timeout=120)
        finally:
            holder.cancel()  # its worker is killed and replaced
            await asyncio.gather(holder, return_exceptions=True)
            await client.close()

    first = run(while_busy())
    assert (first.backend, first.backend_reason) == (LLGUIDANCE, "xgrammar_busy")
    assert choices(auto_server, "llguidance", "xgrammar_busy") == busy + 1
    wait_until(lambda: pool.idle_workers == 1, "the compile worker is replaced", timeout=120.0)
    again = auto_compile(auto_server, tokenizer_desc.fingerprint, spec)
    assert (again.backend, again.backend_reason) == (XGRAMMAR, "default")


# The two below leave the one compile worker killed (a compile cancelled or timed out): after the ones that need
# xgrammar to answer within the fallback budget, which a worker still restarting would miss.


def test_a_schema_xgrammar_compiles_slowly_is_served_by_llguidance(auto_server, tokenizer_desc, hf_tokenizer,
                                                                    xgr_tokenizer_info):
    schema = {"title": salt(), **TOO_SLOW_SCHEMA}
    before = choices(auto_server, "llguidance", "xgrammar_slow")
    # Within the 20 s deadline, where xgrammar needs tens of seconds (conftest.TOO_SLOW_SCHEMA).
    first = auto_compile(auto_server, tokenizer_desc.fingerprint, json_schema(schema))
    assert (first.backend, first.backend_reason, first.cache_hit) == (LLGUIDANCE, "xgrammar_slow", False)
    again = auto_compile(auto_server, tokenizer_desc.fingerprint, json_schema(schema))
    assert (again.grammar_id, again.backend, again.cache_hit) == (first.grammar_id, LLGUIDANCE, True)
    assert choices(auto_server, "llguidance", "xgrammar_slow") == before + 2
    # The session is a real one: a valid document is accepted whole and may end there.
    document = json.dumps({f"k{i}": "v" * i for i in range(40)}, separators=(",", ":"))
    tokens = hf_tokenizer.encode(document, add_special_tokens=False)
    eos = xgr_tokenizer_info.stop_token_ids[0]

    async def feed():
        client = GrammarClient(auto_server.target)
        stream = client.open_stream(tokenizer_desc.vocab_size)
        try:
            resp = await stream.step([pb.SessionStep(session_id=1, open=pb.OpenSession(grammar_id=first.grammar_id),
                                                     accept_token_ids=tokens + [eos])])
            await end_stream(stream)
            return resp.results[0]
        except BaseException:
            stream.cancel()
            raise
        finally:
            await client.close()

    result = run(feed())
    assert result.status == pb.SESSION_STATUS_TERMINATED, result
    assert result.accepted_count == len(tokens) + 1


def test_a_compile_that_outlived_its_budget_gives_its_worker_up_to_the_next_request(auto_server, tokenizer_desc):
    """The one worker still compiling a grammar whose request llguidance answered is no reason to send the next
    schema to llguidance as busy: that compile is stopped and its worker replaced for the new request."""
    first = call(auto_server.target, lambda client: client.compile(
        tokenizer_desc.fingerprint, json_schema({"title": salt(), **TOO_SLOW_SCHEMA}), timeout_seconds=60.0,
        rpc_timeout=120))
    assert (first.backend, first.backend_reason) == (LLGUIDANCE, "xgrammar_slow")
    pool = auto_server.server.backend.pool
    wait_until(lambda: pool.busy_workers == 1 and not pool.waiting_jobs, "the compile is on the worker", 120.0)
    abandoned = restarts(auto_server, "abandoned")
    out = auto_compile(auto_server, tokenizer_desc.fingerprint, pb.GrammarSpec(regex=f"{salt()}[0-9]+"))
    assert out.backend_reason != "xgrammar_busy"
    assert restarts(auto_server, "abandoned") == abandoned + 1


def worker_free(srv):
    """The server's compile pool, once its one worker is idle (a test before may have left it being replaced)."""
    pool = srv.server.backend.pool
    wait_until(lambda: pool.idle_workers == 1, "the compile worker is free", timeout=120.0)
    return pool


async def behind_a_held_worker(srv, fingerprint: str, ask):
    """ask(client)'s answer, asked while a compile of tens of seconds holds the server's one worker, which is let
    go (killed and replaced) once the ask waits for a worker, or was answered without one."""
    pool = srv.server.backend.pool
    client = GrammarClient(srv.target)
    holder = asyncio.ensure_future(compile_on(client, fingerprint, json_schema({"title": salt(), **TOO_SLOW_SCHEMA}),
                                              XGRAMMAR, 60.0))
    asked = None
    try:
        await worker_held(pool, holder)
        asked = asyncio.ensure_future(ask(client))
        while not pool.waiting_jobs and not asked.done():
            await asyncio.sleep(0.02)
        holder.cancel()  # its worker is killed and replaced: a queued compile gets the new one
        return await asked
    finally:
        for fut in (holder, asked):
            if fut is not None:
                fut.cancel()
                await asyncio.gather(fut, return_exceptions=True)
        await client.close()


def inflight_waiters(srv, spec: pb.GrammarSpec, fingerprint: str) -> int:
    """How many requests wait on the xgrammar compile of `spec` in flight (0: none in flight)."""
    from grammar_svc.servicer import spec_from_proto

    flight = srv.server.backend._inflight.get(spec_from_proto(spec).grammar_id(fingerprint))
    return flight.waiters if flight is not None else 0


def test_a_request_auto_answered_does_not_compile_again_when_the_compile_it_joined_stops(auto_server, tokenizer_desc):
    """A request naming xgrammar starts a compile with a 3 s deadline; an auto request for the same schema (20 s)
    joins it and at its budget is answered from llguidance. When the shared compile stops at 3 s, the auto
    request, answered already, does not compile again, as a joiner with time left would: nobody waits for that
    compile, which would hold a worker for the rest of the 20 s where no request could take it back."""
    fingerprint = tokenizer_desc.fingerprint
    worker_free(auto_server)
    spec = json_schema({"title": salt(), **TOO_SLOW_SCHEMA})

    async def go():
        client = GrammarClient(auto_server.target)
        try:
            named = asyncio.ensure_future(compile_on(client, fingerprint, spec, XGRAMMAR, 3.0))
            while inflight_waiters(auto_server, spec, fingerprint) != 1:
                await asyncio.sleep(0.01)
            auto = await client.compile(fingerprint, spec, timeout_seconds=20.0, rpc_timeout=120)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await named
            return auto, info.value
        finally:
            await client.close()

    auto, stopped = run(go())
    assert (auto.backend, auto.backend_reason) == (LLGUIDANCE, "xgrammar_slow")
    assert stopped.code() == grpc.StatusCode.DEADLINE_EXCEEDED, stopped.details()
    # A compile again would be in flight before the stopped one's answer reached this client.
    assert inflight_waiters(auto_server, spec, fingerprint) == 0
    worker_free(auto_server)


def test_a_compile_two_outlived_requests_share_gives_its_worker_up(auto_server, tokenizer_desc):
    """Two requests for one schema share one xgrammar compile and both outlive their budget: the compile is
    stopped for the next request's worker (it follows the shared compile, not one request's share of it, which
    stopped alone left the worker compiling and the next request queued behind it)."""
    pool, fingerprint = worker_free(auto_server), tokenizer_desc.fingerprint
    spec = json_schema({"title": salt(), **TOO_SLOW_SCHEMA})

    async def both():
        client = GrammarClient(auto_server.target)
        try:
            return await asyncio.gather(*(client.compile(fingerprint, spec, timeout_seconds=60.0, rpc_timeout=120)
                                          for _ in range(2)))
        finally:
            await client.close()

    outs = run(both())
    assert [(out.backend, out.backend_reason) for out in outs] == [(LLGUIDANCE, "xgrammar_slow")] * 2
    assert inflight_waiters(auto_server, spec, fingerprint) == 2  # both went on waiting: one compile, two shares
    wait_until(lambda: pool.busy_workers == 1 and not pool.waiting_jobs, "the compile is on the worker", 120.0)
    abandoned = restarts(auto_server, "abandoned")
    out = auto_compile(auto_server, fingerprint, pb.GrammarSpec(regex=f"{salt()}[0-9]+"))
    assert out.backend_reason != "xgrammar_busy"
    assert restarts(auto_server, "abandoned") == abandoned + 1
    assert inflight_waiters(auto_server, spec, fingerprint) == 0


def test_a_compile_a_request_still_waits_for_is_not_stopped_for_the_next(auto_server, tokenizer_desc):
    """A compile that outlived one request's budget but that a request naming xgrammar also waits for goes on:
    the next schema goes to llguidance as busy (its worker is not coming free). Once only outlived requests
    wait for it, it is stopped for the next request's worker."""
    pool, fingerprint = worker_free(auto_server), tokenizer_desc.fingerprint
    spec = json_schema({"title": salt(), **TOO_SLOW_SCHEMA})

    async def go():
        client = GrammarClient(auto_server.target)
        named = None
        try:
            first = await client.compile(fingerprint, spec, timeout_seconds=60.0, rpc_timeout=120)
            named = asyncio.ensure_future(compile_on(client, fingerprint, spec, XGRAMMAR, 60.0))
            while inflight_waiters(auto_server, spec, fingerprint) < 2:
                assert not named.done(), named
                await asyncio.sleep(0.02)
            abandoned = restarts(auto_server, "abandoned")
            busy = await client.compile(fingerprint, pb.GrammarSpec(regex=f"{salt()}[0-9]+"), timeout_seconds=20.0,
                                        rpc_timeout=120)
            kept = (restarts(auto_server, "abandoned") == abandoned, inflight_waiters(auto_server, spec, fingerprint))
            named.cancel()
            await asyncio.gather(named, return_exceptions=True)
            while inflight_waiters(auto_server, spec, fingerprint) > 1:
                await asyncio.sleep(0.02)
            after = await client.compile(fingerprint, pb.GrammarSpec(regex=f"{salt()}[0-9]+"), timeout_seconds=20.0,
                                         rpc_timeout=120)
            return first, busy, kept, after, restarts(auto_server, "abandoned") - abandoned
        finally:
            if named is not None:
                named.cancel()
                await asyncio.gather(named, return_exceptions=True)
            await client.close()

    first, busy, kept, after, stopped = run(go())
    assert (first.backend, first.backend_reason) == (LLGUIDANCE, "xgrammar_slow")
    assert (busy.backend, busy.backend_reason) == (LLGUIDANCE, "xgrammar_busy")
    assert kept == (True, 2)
    assert after.backend_reason != "xgrammar_busy" and stopped == 1


def test_the_hedge_is_no_fallback_until_the_budget_decides(auto_server, tokenizer_desc):
    """auto builds llguidance's grammar from half the budget on, beside xgrammar's compile. Until the budget
    decides, that grammar is no fallback: a second auto request for the schema waits for xgrammar too (it was
    answered from it as xgrammar_slow), and a request naming llguidance that was served from it keeps a valid
    id once xgrammar answers within the budget (it was dropped then)."""
    from grammar_svc.compile.cache import CompiledEntry
    from grammar_svc.servicer import spec_from_proto

    backend = auto_server.server.backend
    pool, fingerprint = worker_free(auto_server), tokenizer_desc.fingerprint
    spec = pb.GrammarSpec(regex=f"{salt()}[0-9]+")
    llguidance_id = spec_from_proto(spec).grammar_id(fingerprint, "llguidance")

    async def go():
        client = GrammarClient(auto_server.target)
        holder = asyncio.ensure_future(compile_on(client, fingerprint, json_schema({"title": salt(), **TOO_SLOW_SCHEMA}),
                                                  XGRAMMAR, 60.0))
        pending = []
        try:
            await worker_held(pool, holder)
            # Named, the schema's compile queues for the worker; auto's requests join it (no worker taken), so the
            # hedge is built, and xgrammar answers as soon as the holder lets the worker go.
            pending.append(asyncio.ensure_future(compile_on(client, fingerprint, spec, XGRAMMAR, 60.0)))
            while not pool.waiting_jobs:
                await asyncio.sleep(0.02)
            auto = asyncio.ensure_future(client.compile(fingerprint, spec, timeout_seconds=60.0, rpc_timeout=120))
            pending.append(auto)
            while not isinstance(backend.cache.get(llguidance_id), CompiledEntry):
                assert not auto.done(), auto
                await asyncio.sleep(0.02)
            named = await compile_on(client, fingerprint, spec, LLGUIDANCE)
            again = asyncio.ensure_future(client.compile(fingerprint, spec, timeout_seconds=60.0, rpc_timeout=120))
            pending.append(again)
            while inflight_waiters(auto_server, spec, fingerprint) < 3 and not again.done():
                await asyncio.sleep(0.02)
            holder.cancel()  # its worker is killed and replaced: the named compile gets the new one
            answers = await asyncio.gather(auto, again)
            stream = client.open_stream(tokenizer_desc.vocab_size)
            try:
                opened = await stream.step([pb.SessionStep(session_id=1, open=pb.OpenSession(
                    grammar_id=named.grammar_id))])
                await end_stream(stream)
            except BaseException:
                stream.cancel()
                raise
            return named, answers, opened.results[0]
        finally:
            for fut in [holder, *pending]:
                fut.cancel()
            await asyncio.gather(holder, *pending, return_exceptions=True)
            await client.close()

    # Test-only settings: a budget with room for the holder's worker to be replaced before it ends (the fixture's is
    # short), and no lane beside the holder (the queued compile would answer before the hedge is built).
    kept = backend.fallback_after_seconds, pool.lane_after_seconds
    backend.fallback_after_seconds, pool.lane_after_seconds = 4.0, 600.0
    try:
        named, answers, opened = run(go())
    finally:
        backend.fallback_after_seconds, pool.lane_after_seconds = kept
    assert (named.backend, named.backend_reason, named.cache_hit) == (LLGUIDANCE, "requested", True)
    assert [(out.backend, out.backend_reason) for out in answers] == [(XGRAMMAR, "default")] * 2
    assert opened.status == pb.SESSION_STATUS_OK, opened


# llguidance drops propertyNames beside properties; xgrammar enforces it. No feature only llguidance enforces.
NAMES_LLGUIDANCE_DROPS = {"type": "object", "properties": {"a": {"type": "string"}},
                          "propertyNames": {"pattern": "^[a-z]+$"}}


def test_a_busy_moment_does_not_trade_a_keyword_xgrammar_enforces(auto_server, tokenizer_desc):
    """No worker free, but llguidance's grammar would drop a keyword xgrammar's enforces: the request waits for
    xgrammar (llguidance_ignores), as the feature path does, rather than go to llguidance as busy."""
    fingerprint = tokenizer_desc.fingerprint
    worker_free(auto_server)
    spec = json_schema({"title": salt(), **NAMES_LLGUIDANCE_DROPS})
    before = choices(auto_server, "xgrammar", "llguidance_ignores")
    out = run(behind_a_held_worker(auto_server, fingerprint, lambda client: client.compile(
        fingerprint, spec, timeout_seconds=60.0, rpc_timeout=120)))
    assert (out.backend, out.backend_reason) == (XGRAMMAR, "llguidance_ignores")
    assert choices(auto_server, "xgrammar", "llguidance_ignores") == before + 1


OVERLAPPING_PATTERNS = {".*": {"type": "string"}, "^x": {"type": "string", "maxLength": 3}}  # llguidance refuses


@pytest.mark.parametrize("extra, code, named", [
    pytest.param({"patternProperties": OVERLAPPING_PATTERNS}, grpc.StatusCode.INVALID_ARGUMENT,
                 ("not disjoint", "xgrammar did not compile it"), id="llguidance-refuses"),
    # llguidance drops propertyNames beside properties, which xgrammar enforces: not traded at the budget.
    pytest.param({"propertyNames": {"pattern": "^k[0-9]+$"}}, grpc.StatusCode.DEADLINE_EXCEEDED,
                 ("ignores propertyNames", "backend llguidance"), id="llguidance-would-ignore"),
])
def test_a_schema_not_served_in_time_is_refused_naming_why(auto_server, tokenizer_desc, extra, code, named):
    """xgrammar compiles the schema for tens of seconds. llguidance refuses overlapping patternProperties: at the
    3 s deadline that is INVALID_ARGUMENT naming the refused feature, not DEADLINE_EXCEEDED. llguidance would
    ignore propertyNames, which xgrammar enforces: past the budget xgrammar is waited for, and at the deadline
    DEADLINE_EXCEEDED names the keyword and the way out, not llguidance's looser grammar. Asked again (the
    timeout remembered) the same answer comes at once, xgrammar not tried again."""
    schema = {"title": salt(), **TOO_SLOW_SCHEMA, **extra}
    slow = choices(auto_server, "llguidance", "xgrammar_slow")
    timeouts = []
    # Asked with the worker free: a timeout after a wait for one (its replacement after the test before, under
    # load) is remembered only for the seconds it compiled, and the second ask would rightly compile again.
    worker_free(auto_server)
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as info:
            call(auto_server.target, lambda client: client.compile(
                tokenizer_desc.fingerprint, json_schema(schema), timeout_seconds=3.0, rpc_timeout=60))
        assert info.value.code() == code, info.value.details()
        assert all(part in info.value.details() for part in named), info.value.details()
        timeouts.append(auto_server.server.metrics.registry.get_sample_value(
            "grammar_svc_compile_failures_total", {"kind": "json_schema", "reason": "timeout"}))
    assert timeouts[1] == timeouts[0]
    assert choices(auto_server, "llguidance", "xgrammar_slow") == slow


def test_a_schema_llguidance_refuses_is_served_by_xgrammar_past_the_budget(auto_server, tokenizer_desc):
    """llguidance refuses overlapping patternProperties in a schema xgrammar compiles at once, but the one worker is
    busy for 3 s with another compile: xgrammar, past the 0.5 s budget only for that, is the only answer left, and
    is waited for: served, not refused at the budget (a burst did that to such a schema)."""
    blocked = {"title": salt(), **TOO_SLOW_SCHEMA}
    errors = []

    def block():
        try:
            call(auto_server.target, lambda client: client.compile(
                tokenizer_desc.fingerprint, json_schema(blocked), timeout_seconds=3.0, rpc_timeout=60,
                backend=XGRAMMAR))
        except grpc.RpcError as e:  # expected: the blocker runs out its 3 s
            errors.append(e.code())

    blocker = threading.Thread(target=block)
    blocker.start()
    pool = auto_server.server.backend.pool
    wait_until(lambda: pool.busy_workers == 1 and not pool.waiting_jobs, "the blocker is on the worker", 120.0)
    schema = {"title": salt(), "type": "object", "patternProperties": OVERLAPPING_PATTERNS}
    out = call(auto_server.target, lambda client: client.compile(
        tokenizer_desc.fingerprint, json_schema(schema), timeout_seconds=60.0, rpc_timeout=120))
    blocker.join()
    assert errors == [grpc.StatusCode.DEADLINE_EXCEEDED]
    assert (out.backend, out.backend_reason) == (XGRAMMAR, "default")


# ---------------------------------------------------------------- end to end: a replica serving llguidance


DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 3, "maxItems": 6}


@pytest.fixture(scope="module")
def llguidance_stack():
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    grammar = start_grammar_server(grammar_backend="llguidance", compile_workers=1)
    cfg = InferenceServiceConfig(host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar.target,),
                                 simulate_step_ms=1.0, engine=EngineConfig(max_num_seqs=4, default_max_tokens=64))
    srv = InferenceServerThread(cfg)
    yield srv, grammar
    srv.stop()
    grammar.stop()


@pytest.mark.parametrize("options", [
    pytest.param(dict(json_schema=DIGITS), id="json-schema"),
    pytest.param(dict(regex="[a-z]{2,5}-[0-9]{2}"), id="regex"),
])
def test_inference_through_an_llguidance_replica(llguidance_stack, options):
    from shared.inference_client import InferenceClient

    srv, grammar = llguidance_stack
    before = choices(grammar, "llguidance", "configured")
    with InferenceClient(srv.target) as client:
        outs = [client.complete("go", max_tokens=64, temperature=1.0, seed=seed, timeout=120, **options)
                for seed in range(3)]
    for out in outs:
        assert out.finish_reason == "stop", out
        if "json_schema" in options:
            values = json.loads(out.text)
            assert 3 <= len(values) <= 6 and all(0 <= v <= 9 for v in values)
            assert out.schema_check == "valid"
        else:
            assert re.fullmatch(options["regex"], out.text), out.text
    assert choices(grammar, "llguidance", "configured") > before


def test_a_request_chooses_its_backend_and_the_memo_keeps_them_apart(llguidance_stack):
    """Constraint.backend overrides the replica's --grammar-backend and reaches its Compile; the inference
    service's compile memo keys on it: the same regex asked of each backend compiles once per backend."""
    from shared.inference_client import InferenceClient, InferenceError

    srv, grammar = llguidance_stack
    pattern = f"{salt()[:6]}[a-c]{{2,4}}"
    asked = {"xgrammar": ("xgrammar", "requested"), "llguidance": ("llguidance", "requested")}
    before = {name: choices(grammar, *labels) for name, labels in asked.items()}
    with InferenceClient(srv.target) as client:
        for backend in ("xgrammar", "xgrammar", "llguidance", "llguidance"):
            out = client.complete("go", max_tokens=32, temperature=1.0, seed=7, timeout=120, regex=pattern,
                                  grammar_backend=backend)
            assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out
        # A tool-call grammar is a structural tag, which llguidance does not serve: refused before any compile.
        with pytest.raises(InferenceError) as info:
            client.complete([{"role": "user", "content": "go"}], max_tokens=8, timeout=120,
                            grammar_backend="llguidance", json_schema=DIGITS,
                            tools=[{"name": "f", "parameters": {"type": "object"}}])
    # One Compile per backend: the second request of each was answered from the memo.
    assert {name: choices(grammar, *labels) - before[name] for name, labels in asked.items()} == {
        "xgrammar": 1, "llguidance": 1}
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "tools" in info.value.message


def test_the_memo_does_not_keep_a_fallback_chosen_while_every_worker_was_busy(llguidance_stack, tokenizer_desc):
    """A request asking for auto while the replica's one compile worker is busy gets llguidance (xgrammar_busy),
    which the inference service does not remember: the next request for the constraint compiles again, and with
    the worker free gets xgrammar's grammar, which is remembered."""
    from shared.inference_client import InferenceClient

    srv, grammar = llguidance_stack
    pool = grammar.server.backend.pool
    pattern = f"{salt()[:6]}[a-c]{{2,4}}"
    picks = [("llguidance", "xgrammar_busy"), ("xgrammar", "default")]
    before = {labels: choices(grammar, *labels) for labels in picks}

    def complete() -> None:
        with InferenceClient(srv.target) as client:
            out = client.complete("go", max_tokens=32, temperature=1.0, seed=7, timeout=120, regex=pattern,
                                  grammar_backend="auto")
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out

    async def while_busy():
        client = GrammarClient(grammar.target)
        await client.register_tokenizer(tokenizer_desc)
        holder = asyncio.ensure_future(compile_on(client, tokenizer_desc.fingerprint,
                                                  json_schema({"title": salt(), **TOO_SLOW_SCHEMA}), XGRAMMAR, 60.0))
        try:
            await worker_held(pool, holder)
            await asyncio.to_thread(complete)
        finally:
            holder.cancel()  # its worker is killed and replaced
            await asyncio.gather(holder, return_exceptions=True)
            await client.close()

    wait_until(lambda: pool.idle_workers == 1, "the compile worker is free", timeout=120.0)
    run(while_busy())
    wait_until(lambda: pool.idle_workers == 1, "the compile worker is replaced", timeout=120.0)
    complete()
    complete()  # answered from the memo: no third Compile
    assert {labels: choices(grammar, *labels) - before[labels] for labels in picks} == {
        ("llguidance", "xgrammar_busy"): 1, ("xgrammar", "default"): 1}


def test_a_schema_nested_past_json_recursion_has_no_llguidance_only_feature():
    """The feature scan runs before the compile's own checks: a schema nested 1,000 deep must reach those (which
    refuse it, naming the nesting), not end the request INTERNAL on json's RecursionError."""
    from grammar_svc.compile.llguidance_backend import llguidance_only_features

    deep = '{"items": ' * 1000 + "{}" + "}" * 1000
    assert llguidance_only_features(deep) == []


def test_loading_a_compiled_grammar_counts_against_the_deadline(grammar_server, registered):
    """The compile's deadline covers loading its grammar into the service after the worker's compile (a large
    grammar under a burst was answered seconds past it): with every thread that load could run on held, the
    request is DEADLINE_EXCEEDED at its deadline, not answered whenever the load ends; the grammar lands in the
    cache once loaded."""
    from grammar_svc.compile.cache import CompiledEntry
    from grammar_svc.servicer import spec_from_proto

    loop = grammar_server.loop
    release, holding = threading.Event(), threading.Event()

    async def hold_threads():
        # More than the loop's default executor has threads: every one of them waits for the release.
        held = [loop.run_in_executor(None, release.wait) for _ in range(64)]
        holding.set()
        await asyncio.gather(*held)

    held = asyncio.run_coroutine_threadsafe(hold_threads(), loop)
    spec = pb.GrammarSpec(regex=f"{salt()}[0-9]+")
    try:
        assert holding.wait(60)
        with pytest.raises(grpc.RpcError) as info:
            call(registered.target, lambda client: client.compile(registered.fingerprint, spec, timeout_seconds=3.0,
                                                                  rpc_timeout=20))
    finally:
        release.set()
        held.result(60)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "loading the compiled grammar" in info.value.details(), info.value.details()
    grammar_id = spec_from_proto(spec).grammar_id(registered.fingerprint)
    wait_until(lambda: isinstance(grammar_server.server.backend.cache.get(grammar_id), CompiledEntry), "it landed")
    again = call(registered.target, lambda client: client.compile(registered.fingerprint, spec, rpc_timeout=60))
    assert (again.grammar_id, again.cache_hit) == (grammar_id, True)


def test_the_wait_for_a_worker_counts_against_the_compiles_deadline(auto_server, tokenizer_desc):
    """A compile that waited for a worker gets what the wait left of its deadline, not the whole again (the
    request was answered up to twice its deadline late). Having waited briefly (the held worker is let go at
    once) it compiled for most of its deadline: the grammar's timeout, remembered for what it compiled
    (tests/test_compile_pool_faults.py has a wait of most of the deadline: the queue's, busy)."""
    fingerprint = tokenizer_desc.fingerprint
    worker_free(auto_server)
    metric = "grammar_svc_compile_failures_total"

    def failures(reason: str) -> float:
        labels = {"kind": "json_schema", "reason": reason}
        return auto_server.server.metrics.registry.get_sample_value(metric, labels) or 0.0

    before = failures("busy"), failures("timeout")

    with pytest.raises(grpc.aio.AioRpcError) as info:
        run(behind_a_held_worker(auto_server, fingerprint, lambda client: compile_on(
            client, fingerprint, json_schema({"title": salt(), **TOO_SLOW_SCHEMA}), XGRAMMAR, 3.0)))
    err = info.value
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "after compiling for" in err.details() and "waited for a free compile worker" in err.details()
    assert (failures("busy"), failures("timeout")) == (before[0], before[1] + 1)
