"""The grammar tier client remembers what a replica answered to Compile (inference_svc/grammar/grammar_tier.py).

A second request with the same constraint on the same replica is placed
without a Compile RPC, with the same grammar id and warnings; a replay always
compiles by RPC; and a grammar the replica has evicted meanwhile costs a
replay, not the request. Real grammar servers on loopback, the real tier.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from inference_svc.grammar.grammar_link import GrammarLink
from inference_svc.grammar.grammar_tier import GrammarRow, GrammarTier, RowOutcome
from inference_svc.types import Constraint
from shared.codec import words_for_vocab
from tests.conftest import start_grammar_server

LETTERS = Constraint("regex", "[a-c]{3}")
DIGITS = Constraint("regex", "[0-7]{3}")
UNIQUE = Constraint("json_schema", '{"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2, '
                                   '"uniqueItems": true}')


def _compiles(server) -> float:
    """Compile RPCs the replica answered (from its cache or not)."""
    get = server.server.metrics.registry.get_sample_value
    return sum(get(f"grammar_svc_cache_{outcome}_total", {"kind": kind}) or 0.0
               for outcome in ("hits", "misses") for kind in ("json_schema", "regex"))


def _cache_bytes(server) -> float:
    return server.server.metrics.registry.get_sample_value("grammar_svc_cache_bytes")


async def _step(tier: GrammarTier, sessions: list[GrammarLink], vocab: int):
    bitmask = np.zeros((len(sessions), words_for_vocab(vocab)), dtype=np.int32)
    return (await tier.send([GrammarRow(s, i) for i, s in enumerate(sessions)], bitmask).receive(30.0)).rows


@pytest.fixture
def replica(grammar_server):
    """The session's server: the test counts the Compile RPCs it answers during the test, whatever it cached
    before."""
    return grammar_server


@pytest.mark.parametrize("constraint", [pytest.param(LETTERS, id="regex"), pytest.param(UNIQUE, id="schema-warnings")])
def test_the_same_constraint_again_is_placed_without_a_compile(replica, tokenizer_desc, constraint):
    async def go():
        tier = GrammarTier((replica.target,), tokenizer_desc, step_timeout_seconds=30.0)
        try:
            assert await tier.connect() == 1
            first, second, replay = GrammarLink(constraint), GrammarLink(constraint), GrammarLink(constraint)
            await tier.compile(first)
            after_first = _compiles(replica)
            await tier.compile(second)
            after_second = _compiles(replica)
            replay.rebuild_from([])  # a replayed session: always compiled by RPC
            await tier.compile(replay)
            rows = await _step(tier, [first, second, replay], tokenizer_desc.vocab_size)
            for s in (first, second, replay):
                tier.release(s)
            return first, second, replay, after_first, after_second, _compiles(replica), rows
        finally:
            await tier.close()

    first, second, replay, after_first, after_second, after_replay, rows = asyncio.run(go())
    assert after_second == after_first  # no RPC for the second
    assert after_replay == after_second + 1
    assert second.grammar_id == first.grammar_id == replay.grammar_id
    assert second.warnings == first.warnings == replay.warnings
    assert bool(first.warnings) == (constraint is UNIQUE)
    assert second.session_id != first.session_id
    assert [r.outcome for r in rows] == [RowOutcome.OK] * 3


def test_a_grammar_evicted_by_the_replica_is_replayed_not_failed(tokenizer_desc):
    sizing = start_grammar_server()
    try:
        async def size_of(constraint):
            tier = GrammarTier((sizing.target,), tokenizer_desc)
            try:
                await tier.connect()
                before = _cache_bytes(sizing)
                await tier.compile(GrammarLink(constraint))
                return _cache_bytes(sizing) - before
            finally:
                await tier.close()

        sizes = [asyncio.run(size_of(constraint)) for constraint in (LETTERS, DIGITS)]
    finally:
        sizing.stop()
    # Room for one of the two grammars, not both: compiling the second evicts the first.
    small = start_grammar_server(cache_bytes=int(max(sizes) * 1.5))
    try:
        async def go():
            tier = GrammarTier((small.target,), tokenizer_desc, step_timeout_seconds=30.0)
            try:
                await tier.connect()
                await tier.compile(GrammarLink(LETTERS))
                await tier.compile(GrammarLink(DIGITS))  # LETTERS leaves the replica's cache
                stale = GrammarLink(LETTERS)
                await tier.compile(stale)  # remembered: placed without asking
                lost = await _step(tier, [stale], tokenizer_desc.vocab_size)
                tier.release(stale)
                stale.rebuild_from([])  # what the engine does with a LOST row
                await tier.compile(stale)
                again = await _step(tier, [stale], tokenizer_desc.vocab_size)
                tier.release(stale)
                return lost, again
            finally:
                await tier.close()

        lost, again = asyncio.run(go())
    finally:
        small.stop()
    assert lost[0].outcome is RowOutcome.LOST and "not" in str(lost[0].error).lower()
    assert again[0].outcome is RowOutcome.OK
