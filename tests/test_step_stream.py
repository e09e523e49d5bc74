"""Step stream semantics over real gRPC: open, accept, reject, rollback,
terminate, close, per-session errors, mask references, session lifetime
(stream end, close, idle TTL, session limit, churn), jump-forward and
failover by replay.

Every mask the service sends is decoded with the stream's decoder and
compared with a local xgrammar matcher on the same grammar (compiled with the
options the service uses), so "the mask is right" always means "equal to
xgrammar's own mask at that position".
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import numpy as np
import pytest
import xgrammar as xgr

from grammar_svc.schema.json_grammar import compile_json_schema
from grammar_svc.types import JsonOptions
from shared.codec import allowed_ids, words_for_vocab
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient, decode_masks
from tests.conftest import run, start_grammar_server

OK = pb.SESSION_STATUS_OK
TERMINATED = pb.SESSION_STATUS_TERMINATED
REJECTED = pb.SESSION_STATUS_REJECTED
CLOSED = pb.SESSION_STATUS_CLOSED
ERROR = pb.SESSION_STATUS_ERROR
INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED = 3, 5, 8

NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags"],
}
PERSON = '{"name":"Ada Lovelace","age":36,"tags":["math","poetry of science"]}'


def spec_for(schema) -> pb.GrammarSpec:
    return pb.GrammarSpec(json_schema=pb.JsonSchema(schema=json.dumps(schema)))


def open_step(sid: int, grammar_id: str, **kw) -> pb.SessionStep:
    terminate = kw.pop("terminate_without_stop_token", False)
    return pb.SessionStep(session_id=sid, open=pb.OpenSession(grammar_id=grammar_id,
                                                              terminate_without_stop_token=terminate), **kw)


def step(sid: int, **kw) -> pb.SessionStep:
    return pb.SessionStep(session_id=sid, **kw)


class Conn:
    """A client and one step stream; every response is decoded in order."""

    def __init__(self, target: str, vocab_size: int):
        self.client = GrammarClient(target)
        self.stream = self.client.open_stream(vocab_size)
        self.words = words_for_vocab(vocab_size)
        self.vocab_size = vocab_size

    async def step(self, *sessions: pb.SessionStep):
        """(response, {result index: decoded mask row}) for one step message."""
        resp = await self.stream.step(list(sessions))
        bitmask = np.zeros((max(1, len(resp.results)), self.words), dtype=np.int32)
        with_mask = decode_masks(resp, self.stream.decoder, bitmask)
        assert [r.session_id for r in resp.results] == [s.session_id for s in sessions]
        return resp, {i: bitmask[i].copy() for i in with_mask}

    async def close(self) -> None:
        try:
            await self.stream.close()
        finally:
            await self.client.close()


class Local:
    """A local xgrammar matcher: the reference for every mask."""

    def __init__(self, compiled, terminate_without_stop_token: bool = False):
        self.matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=terminate_without_stop_token)
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self._buf = xgr.allocate_token_bitmask(1, self.vocab_size)

    def accept(self, ids) -> None:
        for t in ids:
            assert self.matcher.accept_token(t), f"reference matcher rejected token {t}"

    def rollback(self, k: int) -> None:
        self.matcher.rollback(k)

    def mask(self) -> np.ndarray:
        self.matcher.fill_next_token_bitmask(self._buf)
        return self._buf[0].numpy().copy()

    def allows(self, token: int) -> bool:
        return token in set(self.allowed())

    def allowed(self) -> np.ndarray:
        return allowed_ids(self.mask(), self.vocab_size)


def same_mask(remote: np.ndarray, local: np.ndarray, vocab_size: int) -> bool:
    return np.array_equal(allowed_ids(remote, vocab_size), allowed_ids(local, vocab_size))


async def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def compiler(xgr_tokenizer_info):
    return xgr.GrammarCompiler(xgr_tokenizer_info)


def compile_local(compiler, schema):
    """The service's grammar for a schema, with bounded strings as xgrammar writes them (not in tail form)."""
    return compile_json_schema(compiler, json.dumps(schema), JsonOptions(), rewrite=False)


@pytest.fixture(scope="module")
def grammars(registered, compiler):
    """name -> (service grammar id, local compiled grammar)."""
    schemas = {"name": NAME_SCHEMA, "person": PERSON_SCHEMA}

    async def go():
        client = GrammarClient(registered.target)
        try:
            return {k: (await client.compile(registered.fingerprint, spec_for(s), rpc_timeout=60)).grammar_id
                    for k, s in schemas.items()}
        finally:
            await client.close()

    ids = run(go())
    return {k: (ids[k], compile_local(compiler, s)) for k, s in schemas.items()}


@pytest.fixture(scope="module")
def tok(hf_tokenizer):
    def encode(text: str) -> list[int]:
        return hf_tokenizer.encode(text, add_special_tokens=False)
    return encode


@pytest.fixture(scope="module")
def eos(xgr_tokenizer_info):
    return xgr_tokenizer_info.stop_token_ids[0]


# ---------------------------------------------------------------- basic flow


def test_open_accept_reject_then_continue(registered, grammars, tok, eos):
    gid, compiled = grammars["name"]
    local = Local(compiled)
    head, tail = tok('{"name":"Al'), tok('ice"')
    bad = tok("x")[0]

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            resp, masks = await c.step(open_step(1, gid))
            r = resp.results[0]
            assert (r.status, r.accepted_count) == (OK, 0)
            assert same_mask(masks[0], local.mask(), c.vocab_size)

            resp, masks = await c.step(step(1, accept_token_ids=head))
            r = resp.results[0]
            assert (r.status, r.accepted_count) == (OK, len(head))
            local.accept(head)
            assert same_mask(masks[0], local.mask(), c.vocab_size)

            # After the closing quote only "}" may follow: `bad` is rejected,
            # the tokens before it are accepted, the ones after it are not.
            resp, masks = await c.step(step(1, accept_token_ids=tail + [bad] + tok("}")))
            r = resp.results[0]
            local.accept(tail)
            assert not local.allows(bad)
            assert (r.status, r.accepted_count) == (REJECTED, len(tail))
            assert r.mask.WhichOneof("encoding") is None and not masks

            # The session stays usable from where the rejection left it.
            resp, masks = await c.step(step(1, accept_token_ids=tok("}")))
            r = resp.results[0]
            assert (r.status, r.accepted_count) == (OK, 1)
            local.accept(tok("}"))
            assert same_mask(masks[0], local.mask(), c.vocab_size)
            assert list(allowed_ids(masks[0], c.vocab_size)) == [eos]

            resp, masks = await c.step(step(1, accept_token_ids=[eos]))
            r = resp.results[0]
            assert (r.status, r.accepted_count) == (TERMINATED, 1)
            assert not masks
        finally:
            await c.close()

    run(go())


def test_rollback_then_accept_reproduces_masks(registered, grammars, tok):
    gid, compiled = grammars["person"]
    ids = tok(PERSON)[:12]

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            _, masks = await c.step(open_step(1, gid))
            history = [masks[0]]
            for t in ids:
                resp, masks = await c.step(step(1, accept_token_ids=[t]))
                assert resp.results[0].status == OK
                history.append(masks[0])
            n = len(ids)
            # Roll back 5 and replay them one by one: the same masks again.
            resp, masks = await c.step(step(1, rollback_tokens=5))
            assert (resp.results[0].status, resp.results[0].accepted_count) == (OK, 0)
            assert same_mask(masks[0], history[n - 5], c.vocab_size)
            for i in range(n - 5, n):
                _, masks = await c.step(step(1, accept_token_ids=[ids[i]]))
                assert same_mask(masks[0], history[i + 1], c.vocab_size)
            # Rollback and accept in one step: rollback first, then accept.
            resp, masks = await c.step(step(1, rollback_tokens=3, accept_token_ids=ids[n - 3:n - 1]))
            assert (resp.results[0].status, resp.results[0].accepted_count) == (OK, 2)
            assert same_mask(masks[0], history[n - 1], c.vocab_size)
            # Back to the very start.
            _, masks = await c.step(step(1, rollback_tokens=n - 1))
            assert same_mask(masks[0], history[0], c.vocab_size)
        finally:
            await c.close()

    local = Local(compiled)
    assert local.mask() is not None  # the grammar compiles locally too
    run(go())


@pytest.mark.parametrize("rollback", [pytest.param("beyond", id="beyond-accepted"), pytest.param(-1, id="negative")])
def test_bad_rollback_is_invalid_argument(registered, grammars, tok, rollback):
    gid, compiled = grammars["name"]
    head = tok('{"name"')
    if rollback == "beyond":
        rollback = len(head) + 1

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            await c.step(open_step(1, gid, accept_token_ids=head))
            resp, masks = await c.step(step(1, rollback_tokens=rollback, accept_token_ids=tok(":")))
            r = resp.results[0]
            assert (r.status, r.error_code) == (ERROR, INVALID_ARGUMENT)
            assert "roll back" in r.error_message or "rollback" in r.error_message
            assert not masks
            # Nothing of the failed step was applied: the session goes on from `head`.
            resp, masks = await c.step(step(1, accept_token_ids=tok(":")))
            assert resp.results[0].status == OK
            local = Local(compiled)
            local.accept(head + tok(":"))
            assert same_mask(masks[0], local.mask(), c.vocab_size)
        finally:
            await c.close()

    run(go())


def test_stop_token_terminates_and_terminated_session_rejects(registered, grammars, tok, eos):
    gid, compiled = grammars["name"]
    doc = tok('{"name":"Bob"}')

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            resp, masks = await c.step(open_step(1, gid, accept_token_ids=doc + [eos]))
            r = resp.results[0]
            assert (r.status, r.accepted_count) == (TERMINATED, len(doc) + 1)
            assert not masks
            resp, _ = await c.step(step(1, accept_token_ids=[eos]))
            assert (resp.results[0].status, resp.results[0].accepted_count) == (REJECTED, 0)
            # Rolling back the stop token reopens the document end.
            resp, masks = await c.step(step(1, rollback_tokens=1))
            assert resp.results[0].status == OK
            assert list(allowed_ids(masks[0], c.vocab_size)) == [eos]
        finally:
            await c.close()

    run(go())


def test_terminate_without_stop_token(registered, grammars, tok, eos):
    gid, compiled = grammars["name"]
    doc = tok('{"name":"Bob"}')

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            resp, masks = await c.step(open_step(1, gid, accept_token_ids=doc, terminate_without_stop_token=True),
                                       open_step(2, gid, accept_token_ids=doc))
            with_flag, without = resp.results
            assert (with_flag.status, with_flag.accepted_count) == (TERMINATED, len(doc))
            assert 0 not in masks
            # Without the flag the grammar waits for the stop token.
            assert (without.status, without.accepted_count) == (OK, len(doc))
            assert list(allowed_ids(masks[1], c.vocab_size)) == [eos]
        finally:
            await c.close()

    run(go())


def test_close_then_session_is_unknown(registered, grammars, tok):
    gid, compiled = grammars["name"]
    head = tok('{"name":"A')

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            await c.step(open_step(1, gid))
            resp, masks = await c.step(step(1, accept_token_ids=head, close=True))
            r = resp.results[0]
            assert (r.status, r.accepted_count) == (CLOSED, len(head))
            assert not masks
            resp, _ = await c.step(step(1, accept_token_ids=tok("b")))
            r = resp.results[0]
            assert (r.status, r.error_code) == (ERROR, NOT_FOUND)
            assert "1" in r.error_message
            # The id can be opened again, from scratch.
            resp, masks = await c.step(open_step(1, gid))
            assert resp.results[0].status == OK
            assert same_mask(masks[0], Local(compiled).mask(), c.vocab_size)
        finally:
            await c.close()

    run(go())


def test_open_unknown_grammar_is_not_found(registered):
    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            resp, masks = await c.step(open_step(1, "0" * 32))
            r = resp.results[0]
            assert (r.status, r.error_code) == (ERROR, NOT_FOUND)
            assert "0" * 32 in r.error_message and not masks
            # The failed open left nothing behind.
            resp, _ = await c.step(step(1))
            assert (resp.results[0].status, resp.results[0].error_code) == (ERROR, NOT_FOUND)
        finally:
            await c.close()

    run(go())


def test_duplicate_session_in_one_step(registered, grammars, tok):
    gid, compiled = grammars["name"]

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            resp, masks = await c.step(open_step(7, gid), step(7, accept_token_ids=tok('{"')))
            first, dup = resp.results
            assert first.status == OK and 0 in masks
            assert (dup.status, dup.error_code) == (ERROR, INVALID_ARGUMENT)
            assert "twice" in dup.error_message and 1 not in masks
            # The duplicate did not touch the session.
            _, masks = await c.step(step(7))
            assert same_mask(masks[0], Local(compiled).mask(), c.vocab_size)
        finally:
            await c.close()

    run(go())


@pytest.mark.parametrize("where", [pytest.param("open", id="with-open"), pytest.param("later", id="open-session")])
@pytest.mark.parametrize("bad", [pytest.param("vocab", id="vocab-size"), pytest.param(-1, id="negative"),
                                 pytest.param(2**31 - 1, id="int32-max")])
def test_token_outside_vocabulary_is_invalid_argument(registered, grammars, tok, where, bad):
    gid, compiled = grammars["name"]
    bad_id = registered.vocab_size if bad == "vocab" else bad
    # A valid token first: a failed step must not apply it either.
    ids = tok('{"') + [bad_id]

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            if where == "open":
                resp, masks = await c.step(open_step(1, gid, accept_token_ids=ids))
            else:
                await c.step(open_step(1, gid))
                resp, masks = await c.step(step(1, accept_token_ids=ids))
            r = resp.results[0]
            assert (r.status, r.error_code) == (ERROR, INVALID_ARGUMENT)
            assert str(bad_id) in r.error_message and not masks
            if where == "open":
                # A step that failed did not open the session.
                resp, masks = await c.step(open_step(1, gid))
            else:
                resp, masks = await c.step(step(1))
            assert resp.results[0].status == OK
            assert same_mask(masks[0], Local(compiled).mask(), c.vocab_size)
        finally:
            await c.close()

    run(go())


def test_skip_mask_advances_without_mask(registered, grammars, tok):
    gid, compiled = grammars["person"]
    ids = tok(PERSON)[:6]

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            resp, masks = await c.step(open_step(1, gid, skip_mask=True))
            assert resp.results[0].status == OK and not masks
            assert resp.results[0].mask.WhichOneof("encoding") is None
            resp, masks = await c.step(step(1, accept_token_ids=ids, skip_mask=True))
            assert (resp.results[0].status, resp.results[0].accepted_count) == (OK, len(ids)) and not masks
            resp, masks = await c.step(step(1))
            local = Local(compiled)
            local.accept(ids)
            assert same_mask(masks[0], local.mask(), c.vocab_size)
        finally:
            await c.close()

    run(go())


def test_identical_masks_reference_the_first(registered, grammars, tok):
    name_id, name_g = grammars["name"]
    person_id, person_g = grammars["person"]
    head = tok('{"name":"x')

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            resp, masks = await c.step(open_step(1, name_id), open_step(2, person_id, accept_token_ids=head),
                                       open_step(3, name_id), open_step(4, person_id, accept_token_ids=head),
                                       open_step(5, name_id))
            fields = [r.mask.WhichOneof("encoding") for r in resp.results]
            assert fields[0] != "same_as_index" and fields[1] != "same_as_index"
            assert resp.results[2].mask.same_as_index == 0 and fields[2] == "same_as_index"
            assert resp.results[3].mask.same_as_index == 1 and fields[3] == "same_as_index"
            assert resp.results[4].mask.same_as_index == 0 and fields[4] == "same_as_index"
            name_mask = Local(name_g).mask()
            inside = Local(person_g)
            inside.accept(head)
            for i in (0, 2, 4):
                assert same_mask(masks[i], name_mask, c.vocab_size)
            for i in (1, 3):
                assert same_mask(masks[i], inside.mask(), c.vocab_size)
        finally:
            await c.close()

    run(go())


def test_many_sessions_results_in_request_order(registered, grammars, tok):
    gid, compiled = grammars["person"]
    ids = tok(PERSON)
    rng = random.Random(7)
    sids = rng.sample(range(1, 10**9), 40)
    prefixes = [rng.randrange(len(ids) + 1) for _ in sids]

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            resp, masks = await c.step(*[open_step(s, gid, accept_token_ids=ids[:p]) for s, p in zip(sids, prefixes)])
            for i, (r, p) in enumerate(zip(resp.results, prefixes)):
                assert (r.session_id, r.status, r.accepted_count) == (sids[i], OK, p)
                local = Local(compiled)
                local.accept(ids[:p])
                assert same_mask(masks[i], local.mask(), c.vocab_size), f"result {i}"
            # The next step, in another order, with one token more each where possible.
            order = list(range(len(sids)))
            rng.shuffle(order)
            resp, masks = await c.step(*[step(sids[i], accept_token_ids=ids[prefixes[i]:prefixes[i] + 1])
                                         for i in order])
            for j, i in enumerate(order):
                r = resp.results[j]
                assert r.session_id == sids[i]
                n = min(prefixes[i] + 1, len(ids))
                local = Local(compiled)
                local.accept(ids[:n])
                assert same_mask(masks[j], local.mask(), c.vocab_size), f"session {sids[i]}"
        finally:
            await c.close()

    run(go())


def test_one_sessions_error_never_affects_others(registered, grammars, tok):
    gid, compiled = grammars["person"]
    ids = tok(PERSON)

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            await c.step(open_step(1, gid), open_step(2, gid), open_step(3, gid))
            resp, masks = await c.step(
                step(1, accept_token_ids=ids[:3]),
                step(99, accept_token_ids=ids[:1]),                        # never opened
                open_step(4, "f" * 32),                                    # unknown grammar
                step(2, accept_token_ids=[ids[0], registered.vocab_size]),  # outside the vocabulary
                step(3, rollback_tokens=1),                                # nothing to roll back
                open_step(1, gid),                                         # already open
                step(3, accept_token_ids=[tok("]")[0]]),                   # duplicate id (and rejected)
                open_step(5, gid, accept_token_ids=ids[:4]),
            )
            st = [(r.status, r.error_code) for r in resp.results]
            assert st == [(OK, 0), (ERROR, NOT_FOUND), (ERROR, NOT_FOUND), (ERROR, INVALID_ARGUMENT),
                          (ERROR, INVALID_ARGUMENT), (ERROR, INVALID_ARGUMENT), (ERROR, INVALID_ARGUMENT), (OK, 0)]
            assert sorted(masks) == [0, 7]
            for i, n in ((0, 3), (7, 4)):
                local = Local(compiled)
                local.accept(ids[:n])
                assert same_mask(masks[i], local.mask(), c.vocab_size)
            # Sessions 1, 2, 3 are where they were before the failed steps.
            resp, masks = await c.step(step(1), step(2), step(3))
            for i, n in ((0, 3), (1, 0), (2, 0)):
                assert resp.results[i].status == OK
                local = Local(compiled)
                local.accept(ids[:n])
                assert same_mask(masks[i], local.mask(), c.vocab_size)
        finally:
            await c.close()

    run(go())


# ------------------------------------------------------------- bounded strings

BOUNDED = {"type": "object", "properties": {
    "code": {"type": "string", "minLength": 2, "maxLength": 6},
    "note": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["code", "note", "tags"]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bounded_strings_mask_like_xgrammar(registered, compiler, token_bytes, eos, seed):
    """The service compiles bounded strings in tail form (grammar_svc/schema/bounded_strings.py): every mask of a
    random walk, short tokens preferred so every length is visited, equals xgrammar's own form's mask."""
    rng = random.Random(seed)
    reference = Local(compile_local(compiler, BOUNDED))
    one_byte = np.array([len(t) == 1 for t in token_bytes])

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            gid = (await c.client.compile(registered.fingerprint, spec_for(BOUNDED))).grammar_id
            resp, masks = await c.step(open_step(1, gid))
            for _ in range(80):
                assert resp.results[0].status == OK
                assert same_mask(masks[0], reference.mask(), c.vocab_size)
                allowed = reference.allowed()
                if allowed.tolist() == [eos]:
                    break  # the object is complete
                rest = allowed[allowed != eos]
                short = rest[one_byte[rest]]
                token = int(rng.choice(short if len(short) else rest))
                reference.accept([token])
                resp, masks = await c.step(step(1, accept_token_ids=[token]))
            else:
                pytest.fail("the walk should reach the end of the object")
        finally:
            await c.close()

    run(go())


# ------------------------------------------------------------- jump-forward


def test_jump_forward_tokens_are_accepted_before_the_mask(registered, grammars, hf_tokenizer, tokenizer_desc):
    gid, compiled = grammars["name"]

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            resp, masks = await c.step(open_step(1, gid, jump_forward=True))
            r = resp.results[0]
            forced = list(r.jump_forward.forced_token_ids)
            assert r.status == OK and r.accepted_count == 0 and forced
            assert r.jump_forward.forced_text == hf_tokenizer.decode(forced)
            assert '{"name":"'.startswith(r.jump_forward.forced_text)
            local = Local(compiled)
            local.accept(forced)
            assert same_mask(masks[0], local.mask(), c.vocab_size)
            # Forced tokens count as accepted: rolling them back restarts.
            resp, masks = await c.step(step(1, rollback_tokens=len(forced)))
            assert resp.results[0].status == OK
            assert same_mask(masks[0], Local(compiled).mask(), c.vocab_size)
            # Without jump_forward nothing is forced.
            resp, _ = await c.step(open_step(2, gid))
            assert not resp.results[0].jump_forward.forced_token_ids
        finally:
            await c.close()

    run(go())


def test_jump_forward_inside_a_multibyte_character_samples_instead(registered, compiler, token_bytes):
    """After a token that ends mid-character the forced bytes are not valid UTF-8: no jump, no error."""
    choice = "🎉 party"
    spec = pb.GrammarSpec(choice=pb.ChoiceList(choices=[choice]))
    first = token_bytes.index("🎉".encode()[:3])

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            gid = (await c.client.compile(registered.fingerprint, spec)).grammar_id
            resp, masks = await c.step(open_step(1, gid, accept_token_ids=[first], jump_forward=True))
            r = resp.results[0]
            assert r.status == OK and r.accepted_count == 1, r
            assert not r.jump_forward.forced_token_ids
            assert 0 in masks
        finally:
            await c.close()

    run(go())


# Schemas whose instances mix forced text (keys, punctuation, consts, enum
# tails) with free text (strings, numbers) at many kinds of boundaries.
JF_SCHEMAS = {
    "name": NAME_SCHEMA,
    "record": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "kind": {"enum": ["alpha", "beta gamma", "\u03b4elta"]},
            "active": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "note": {"type": "string"},
        },
        "required": ["id", "kind", "active", "tags", "note"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"first_name": {"type": "string"}, "last_name": {"type": "string"}},
                     "required": ["first_name", "last_name"]},
            "score": {"type": "number"},
            "status": {"const": "all systems nominal"},
            "comment": {"type": "string"},
        },
        "required": ["user", "score", "status"],
    },
    "enum_prefix": {
        "type": "object",
        "properties": {"choice": {"enum": ["hello world", "hello there", "help", "hel"]},
                       "n": {"type": "integer"}, "s": {"type": "string"}},
        "required": ["choice", "n", "s"],
    },
    "const_tail": {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"const": "  spaced  out  "}, "c": {"type": "string"},
                       "d": {"const": "x"}},
        "required": ["a", "b", "c", "d"],
    },
    "items": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"key": {"type": "string"}, "value": {"type": "integer"}},
                  "required": ["key", "value"]},
    },
}

ALPHABET = list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789") + [" ", " ", "  ", "-", "_", ".", ",", ":", "{",
                                                                  "}", "[", "]", "\"", "\\", "\n", "\t", "é", "ß",
                                                                  "中文", "日本", "🙂", "name", "value", "\u2028"]


def random_string(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 10)))


def random_instance(schema, rng: random.Random):
    """A random instance of the small schema subset used above (schema order, strict)."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    t = schema["type"]
    if t == "object":
        required = set(schema.get("required", ()))
        return {k: random_instance(s, rng) for k, s in schema["properties"].items()
                if k in required or rng.random() < 0.5}
    if t == "array":
        n = rng.randint(schema.get("minItems", 0), schema.get("maxItems", 3))
        return [random_instance(schema["items"], rng) for _ in range(n)]
    if t == "string":
        return random_string(rng)
    if t == "integer":
        return rng.choice([0, 7, -3, 42, 1234567, -99999])
    if t == "number":
        return rng.choice([0, 1.5, -2.25, 3.0, 1e-3, 12345.678])
    if t == "boolean":
        return rng.random() < 0.5
    raise AssertionError(t)


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in JF_SCHEMAS])
def test_jump_forward_keeps_canonical_tokenization(registered, compiler, hf_tokenizer, token_bytes, eos, name):
    """With jump-forward on every step, the session's tokens are always a
    prefix of the canonical tokenization of the finished text, for random
    valid continuations: forced tokens never create a boundary the tokenizer
    would not produce, so the model only ever sees canonical sequences."""
    schema = JF_SCHEMAS[name]
    rng = random.Random(f"jf-{name}")
    docs = [json.dumps(random_instance(schema, rng), separators=(",", ":"), ensure_ascii=False) for _ in range(8)]
    compiled = compile_local(compiler, schema)

    async def go():
        c = Conn(registered.target, registered.vocab_size)
        try:
            gid = (await c.client.compile(registered.fingerprint, spec_for(schema), rpc_timeout=60)).grammar_id
            canon = [hf_tokenizer.encode(d, add_special_tokens=False) + [eos] for d in docs]
            have: list[list[int]] = [[] for _ in docs]
            forced_total = 0
            pending = [open_step(i, gid, jump_forward=True) for i in range(len(docs))]
            while pending:
                resp, _ = await c.step(*pending)
                pending = []
                for r in resp.results:
                    i = r.session_id
                    assert r.status in (OK, TERMINATED), (docs[i], r)
                    forced = list(r.jump_forward.forced_token_ids)
                    if forced:
                        forced_total += len(forced)
                        text = b"".join(token_bytes[t] for t in forced).decode("utf-8")
                        assert r.jump_forward.forced_text == text
                    have[i] += forced
                    assert have[i] == canon[i][:len(have[i])], (
                        f"non-canonical boundary in {docs[i]!r}: session has "
                        f"{[hf_tokenizer.decode([t]) for t in have[i]]}, canonical is "
                        f"{[hf_tokenizer.decode([t]) for t in canon[i][:len(have[i]) + 2]]}")
                    if r.status == TERMINATED:
                        assert have[i] == canon[i]
                        continue
                    nxt = canon[i][len(have[i])]
                    have[i].append(nxt)
                    pending.append(step(i, accept_token_ids=[nxt], jump_forward=True))
            return forced_total
        finally:
            await c.close()

    forced_total = run(go())
    assert forced_total > 0
    # And the local matcher agrees that every document is complete.
    for d in docs:
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(d) and m.accept_token(eos)


# ------------------------------------------------ second replica: lifetime


@pytest.fixture(scope="module")
def replica(tokenizer_desc):
    """A second grammar server, limited to two live sessions."""
    srv = start_grammar_server(compile_workers=1, max_sessions=2)

    async def go():
        client = GrammarClient(srv.target)
        try:
            await client.register_tokenizer(tokenizer_desc)
        finally:
            await client.close()

    try:
        run(go())
        yield srv
    finally:
        srv.stop()


def compile_on(target: str, fingerprint: str, schema) -> str:
    async def go():
        client = GrammarClient(target)
        try:
            return (await client.compile(fingerprint, spec_for(schema), rpc_timeout=60)).grammar_id
        finally:
            await client.close()

    return run(go())


def active_gauge(server) -> float:
    return server.metrics.registry.get_sample_value("grammar_svc_active_sessions")


def test_failover_by_replay(registered, replica, grammars, tok):
    gid, compiled = grammars["person"]
    ids = tok(PERSON)
    n = len(ids) * 2 // 3
    # The grammar id is the same on every replica.
    assert compile_on(replica.target, registered.fingerprint, PERSON_SCHEMA) == gid

    async def go():
        first = Conn(registered.target, registered.vocab_size)
        second = Conn(registered.target, registered.vocab_size)
        other = Conn(replica.target, registered.vocab_size)
        try:
            await first.step(open_step(1, gid))
            for t in ids[:n]:
                resp, masks = await first.step(step(1, accept_token_ids=[t]))
                assert resp.results[0].status == OK
            reference = masks[0]
            for conn in (second, other):
                resp, replayed = await conn.step(open_step(1, gid, accept_token_ids=ids[:n]))
                assert (resp.results[0].status, resp.results[0].accepted_count) == (OK, n)
                assert same_mask(replayed[0], reference, registered.vocab_size)
                # And they stay in step afterwards.
                _, a = await first.step(step(1, accept_token_ids=[ids[n]], rollback_tokens=0))
                _, b = await conn.step(step(1, accept_token_ids=[ids[n]]))
                assert same_mask(a[0], b[0], registered.vocab_size)
                await first.step(step(1, rollback_tokens=1))
        finally:
            for conn in (first, second, other):
                await conn.close()

    run(go())


def test_session_limit_is_resource_exhausted(registered, replica, grammars):
    gid = compile_on(replica.target, registered.fingerprint, NAME_SCHEMA)
    limiter = replica.server.limiter

    async def go():
        await wait_until(lambda: limiter.count == 0, what="earlier sessions to be released")
        c = Conn(replica.target, registered.vocab_size)
        try:
            resp, _ = await c.step(open_step(1, gid), open_step(2, gid), open_step(3, gid))
            st = [(r.status, r.error_code) for r in resp.results]
            assert st == [(OK, 0), (OK, 0), (ERROR, RESOURCE_EXHAUSTED)]
            assert "2 live sessions" in resp.results[2].error_message
            assert limiter.count == 2
            # Closing one makes room.
            resp, _ = await c.step(step(1, close=True))
            assert resp.results[0].status == CLOSED
            resp, _ = await c.step(open_step(3, gid))
            assert resp.results[0].status == OK
        finally:
            await c.close()

    run(go())


@pytest.mark.parametrize("how", [pytest.param("done_writing", id="half-close"), pytest.param("cancel", id="cancel"),
                                 pytest.param("channel", id="channel-close")])
def test_sessions_released_when_stream_ends(registered, replica, grammars, how):
    gid = compile_on(replica.target, registered.fingerprint, NAME_SCHEMA)
    srv = replica.server

    async def go():
        await wait_until(lambda: srv.limiter.count == 0, what="earlier sessions to be released")
        c = Conn(replica.target, registered.vocab_size)
        try:
            resp, _ = await c.step(open_step(1, gid), open_step(2, gid))
            assert [r.status for r in resp.results] == [OK, OK]
            assert srv.limiter.count == 2 and active_gauge(srv) == 2
            if how == "done_writing":
                await c.stream.close()
            elif how == "cancel":
                c.stream.cancel()
            else:
                await c.client.close()
            await wait_until(lambda: srv.limiter.count == 0 and not srv.limiter.streams, what="stream end cleanup")
            assert active_gauge(srv) == 0
        finally:
            await c.client.close()

    run(go())


def test_memory_bounded_under_churn(registered, replica, grammars, tok):
    """1000 sessions opened and closed over one stream, two live at a time."""
    gid = compile_on(replica.target, registered.fingerprint, NAME_SCHEMA)
    srv = replica.server
    head = tok('{"name":"')

    async def go():
        await wait_until(lambda: srv.limiter.count == 0, what="earlier sessions to be released")
        opened0 = srv.metrics.registry.get_sample_value("grammar_svc_session_events_total", {"event": "opened"}) or 0
        c = Conn(replica.target, registered.vocab_size)
        try:
            prev = None
            for k in range(1000):
                # Ids are reused (seven of them): a closed id can be opened again.
                ops = [open_step(k % 7 + 1, gid, accept_token_ids=head, skip_mask=k % 2 == 0)]
                if prev is not None:
                    ops.append(step(prev, close=True))
                resp, _ = await c.step(*ops)
                assert [r.status for r in resp.results] == [OK] + [CLOSED] * (prev is not None), k
                prev = ops[0].session_id
                assert srv.limiter.count == 1
            resp, _ = await c.step(step(prev, close=True))
            assert resp.results[0].status == CLOSED
            assert srv.limiter.count == 0 and active_gauge(srv) == 0
            (stream,) = srv.limiter.streams
            assert len(stream) == 0
        finally:
            await c.close()
        await wait_until(lambda: not srv.limiter.streams, what="stream end cleanup")
        opened = srv.metrics.registry.get_sample_value("grammar_svc_session_events_total", {"event": "opened"})
        assert opened - opened0 == 1000

    run(go())


# ------------------------------------------------------------ idle TTL


@pytest.fixture(scope="module")
def short_ttl(tokenizer_desc):
    srv = start_grammar_server(compile_workers=1, session_idle_ttl_seconds=0.5)

    async def go():
        client = GrammarClient(srv.target)
        try:
            await client.register_tokenizer(tokenizer_desc)
        finally:
            await client.close()

    try:
        run(go())
        yield srv
    finally:
        srv.stop()


def test_idle_session_expires_but_stream_stays_open(registered, short_ttl, grammars, tok):
    gid, compiled = grammars["name"]
    assert compile_on(short_ttl.target, registered.fingerprint, NAME_SCHEMA) == gid
    srv = short_ttl.server

    async def go():
        c = Conn(short_ttl.target, registered.vocab_size)
        try:
            resp, _ = await c.step(open_step(1, gid, accept_token_ids=tok('{"')))
            assert resp.results[0].status == OK and srv.limiter.count == 1
            # Not touching the session: the sweeper expires it.
            await wait_until(lambda: srv.limiter.count == 0, what="the idle session to expire")
            assert active_gauge(srv) == 0
            resp, _ = await c.step(step(1, accept_token_ids=tok("name")))
            r = resp.results[0]
            assert (r.status, r.error_code) == (ERROR, NOT_FOUND)
            assert "expired" in r.error_message
            # The stream itself is fine: replay the session and go on.
            resp, masks = await c.step(open_step(1, gid, accept_token_ids=tok('{"name')))
            assert resp.results[0].status == OK
            local = Local(compiled)
            local.accept(tok('{"name'))
            assert same_mask(masks[0], local.mask(), c.vocab_size)
        finally:
            await c.close()
        expired = srv.metrics.registry.get_sample_value("grammar_svc_session_events_total", {"event": "expired"})
        assert expired >= 1

    run(go())
