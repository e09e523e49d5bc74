"""Where the inference service's grammar tier places sessions: on the replica with the fewest, counted from
the moment a compile starts, so requests that arrive together spread evenly over the replicas; and a step
with sessions on several replicas gets every replica's answer.

Two real grammar servers on loopback, the real tier client (inference_svc/grammar/grammar_tier.py).
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

THREE_DIGITS = Constraint("regex", "[0-9]{3}")


@pytest.fixture(scope="module")
def two_replicas():
    servers = [start_grammar_server(), start_grammar_server()]
    yield servers
    for s in servers:
        s.stop()


def _active(server) -> float:
    return server.server.metrics.registry.get_sample_value("grammar_svc_active_sessions")


@pytest.mark.parametrize("sessions", [pytest.param(2, id="two"), pytest.param(8, id="eight"),
                                      pytest.param(9, id="nine-odd")])
def test_sessions_compiled_together_split_evenly_and_a_step_gets_both_answers(two_replicas, tokenizer_desc,
                                                                               sessions):
    targets = tuple(s.target for s in two_replicas)
    before = [_active(s) for s in two_replicas]

    async def go():
        tier = GrammarTier(targets, tokenizer_desc, step_timeout_seconds=30.0)
        try:
            assert await tier.connect() == 2
            batch = [GrammarLink(THREE_DIGITS) for _ in range(sessions)]
            # All at once, as the engine's compile tasks for requests that arrive together.
            await asyncio.gather(*(tier.compile(s) for s in batch))
            per_target = [sum(tier.target(s.replica) == t for s in batch) for t in targets]
            bitmask = np.zeros((sessions, words_for_vocab(tokenizer_desc.vocab_size)), dtype=np.int32)
            step = await tier.send([GrammarRow(s, i) for i, s in enumerate(batch)], bitmask).receive(30.0)
            open_during = [_active(s) for s in two_replicas]
            for s in batch:
                tier.release(s)
            await tier.send([], bitmask).receive(30.0)  # carries the closes
            return per_target, step, bitmask, open_during
        finally:
            await tier.close()

    per_target, step, bitmask, open_during = asyncio.run(go())
    assert sorted(per_target) == [sessions // 2, sessions - sessions // 2]
    assert per_target[0] >= per_target[1]  # a tie goes to the replica listed first
    assert step.lost_replicas == {}
    assert [r.outcome for r in step.rows] == [RowOutcome.OK] * sessions
    # Every row holds its replica's mask: the same grammar in the same state, so the same non-empty mask.
    assert bitmask[0].any()
    assert all(np.array_equal(row, bitmask[0]) for row in bitmask)
    # Each replica really holds its share of the sessions (the step opened them there).
    assert [o - b for o, b in zip(open_during, before)] == per_target


def test_a_released_replica_takes_the_next_sessions(two_replicas, tokenizer_desc):
    """Load is live sessions: after the first replica's sessions finish, new ones go there until even."""
    targets = tuple(s.target for s in two_replicas)

    async def go():
        tier = GrammarTier(targets, tokenizer_desc)
        try:
            await tier.connect()
            first = [GrammarLink(THREE_DIGITS) for _ in range(4)]
            for s in first:
                await tier.compile(s)
            placed = [tier.target(s.replica) for s in first]
            for s, target in zip(first, placed):
                if target == targets[0]:
                    tier.release(s)
            later = [GrammarLink(THREE_DIGITS) for _ in range(3)]
            for s in later:
                await tier.compile(s)
            return placed, [tier.target(s.replica) for s in later]
        finally:
            await tier.close()

    first, later = asyncio.run(go())
    assert first == [targets[0], targets[1], targets[0], targets[1]]
    # Replica 0 now holds none, replica 1 two: two go to replica 0, then the tie goes to replica 0 again.
    assert later == [targets[0], targets[0], targets[0]]


def test_a_refused_compile_gives_its_place_back(two_replicas, tokenizer_desc):
    """A constraint the grammar refuses counts on no replica afterwards."""
    from shared import errors

    targets = tuple(s.target for s in two_replicas)

    async def go():
        tier = GrammarTier(targets, tokenizer_desc)
        try:
            await tier.connect()
            with pytest.raises(errors.InvalidGrammarError):
                await tier.compile(GrammarLink(Constraint("ebnf", "root ::= undefined_rule")))
            ok = GrammarLink(THREE_DIGITS)
            await tier.compile(ok)
            return tier.target(ok.replica)
        finally:
            await tier.close()

    assert asyncio.run(go()) == targets[0]
