"""The grammar service's mask filler on a vocabulary whose last bitmask word is part padding.

The real tokenizer's 129,280 tokens fill their words exactly, so the step
tests never see padding bits; here a 37-token vocabulary does. The filler
clears padding in its own buffer rather than masking a copy, and does not
encode a row that repeats an earlier row of the step (it goes out as
same_as): every wire form must still be exactly what the canonical rows give.
"""

from __future__ import annotations

import numpy as np
import pytest
import xgrammar as xgr

from grammar_svc.compile.cache import CompiledEntry
from grammar_svc.step.mask_filler import SLOW_ROW_SECONDS, MaskFiller
from grammar_svc.step.session import MatcherSession
from grammar_svc.compile.tokenizer_registry import RegisteredTokenizer
from shared.codec import SAME_AS, MaskDecoder, MaskEncoder, StreamMaskCache, assign_wire_forms, words_for_vocab

VOCAB = [chr(ord("a") + i) for i in range(26)] + [str(d) for d in range(10)] + ["</s>"]


@pytest.fixture(scope="module")
def entries():
    assert len(VOCAB) % 32, "the vocabulary must leave padding bits in its last word"
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[len(VOCAB) - 1])
    tok = RegisteredTokenizer("test-padding", info.serialize_json(), info, len(VOCAB), None,
                              tuple(t.encode() for t in VOCAB))
    compiler = xgr.GrammarCompiler(info)
    return {name: CompiledEntry(name, compiler.compile_regex(regex), tok, (), 0.0, 0)
            for name, regex in (("letters", "[a-z]+"), ("digits", "[0-9]{2}"), ("any", "[a-z0-9]*"))}


def _dirty_buffers(filler: MaskFiller, vocab: int) -> None:
    """Every bit of the filler's buffer set, padding included: a fill must not leave any of it behind."""
    _, array = filler._buffers.get(vocab, 8)
    array[:] = -1


@pytest.mark.parametrize("cached", [pytest.param(False, id="no-cache"), pytest.param(True, id="stream-cache")])
def test_rows_are_canonical_and_repeats_are_same_as(entries, cached):
    vocab = len(VOCAB)
    filler = MaskFiller(threads=1)
    encoder = MaskEncoder(vocab)
    cache = StreamMaskCache(8) if cached else None
    names = ["letters", "digits", "letters", "any", "digits", "letters"]
    sessions = [MatcherSession(i, entries[n]) for i, n in enumerate(names)]
    decoder = MaskDecoder(vocab, 8 if cached else 0)
    try:
        for step in range(2):  # the second time, the cached rows come back as slots
            _dirty_buffers(filler, vocab)
            filled, late = filler.fill(list(enumerate(sessions)), cache)
            assert late == []
            wire = assign_wire_forms(filled, cache)
            out = np.zeros((len(sessions), words_for_vocab(vocab)), dtype=np.int32)
            decoded: list = []
            for k, (f, enc) in enumerate(zip(filled, wire)):
                decoder.decode_into(enc.field, enc.value, out[k], decoded, enc.store_slot)
                decoded.append(out[k])
            for k, s in enumerate(sessions):
                expected = xgr.allocate_token_bitmask(1, vocab)
                s.matcher.fill_next_token_bitmask(expected, 0)
                canonical = encoder.canonical(expected.numpy()[0])
                assert filled[k].key == canonical.tobytes()  # no padding bit survives
                assert np.array_equal(out[k].view(np.uint32), canonical), (step, names[k])
            assert [enc.field == SAME_AS for enc in wire] == [False, False, True, False, True, True]
            assert all(filled[k].encoding is None for k in (2, 4, 5))  # repeats are never encoded
    finally:
        filler.close()


def test_new_sessions_of_a_grammar_with_a_fast_start_fill_in_the_loop(entries):
    """A session's first fill goes to a helper thread only when nothing vouches for it: a grammar seen
    for the first time, or a replay (tokens accepted before its first fill). Once a grammar's start
    state has filled fast, its new sessions fill in the loop.

    No threshold on this machine's clock here (a fill's time includes taking the GIL back, so a busy machine
    times a few-microsecond start past it): the filler notes what a start fill took, and the decision is
    tested on start times given to it."""
    filler = MaskFiller(threads=1)
    try:
        first = MatcherSession(1, entries["letters"])
        assert filler._slow(first), "a grammar never seen: its start may be slow"
        filled, late = filler.fill([(0, first)])
        assert late == [] and len(filled) == 1
        assert filler._start_fills["letters"] == first.last_fill_seconds > 0, "the start fill's own time is noted"
        assert filler._slow(MatcherSession(2, entries["letters"])) is (first.last_fill_seconds > SLOW_ROW_SECONDS)
        fast, slow = MatcherSession(3, entries["letters"]), MatcherSession(4, entries["any"])
        fast.last_fill_seconds, slow.last_fill_seconds = SLOW_ROW_SECONDS / 2, SLOW_ROW_SECONDS * 2
        filler._note_start_fills([(0, fast), (1, slow)], [0, 1], late_pos=set())
        assert not filler._slow(MatcherSession(5, entries["letters"])), "its start filled fast"
        assert filler._slow(MatcherSession(6, entries["any"])), "its start filled slowly"
        assert filler._slow(MatcherSession(7, entries["digits"])), "another grammar is still unknown"
        replay = MatcherSession(8, entries["letters"])
        assert replay.accept([0, 1]) == 2
        assert filler._slow(replay), "a replayed session starts deep in its document"
        # A start that outlived the row budget keeps its grammar's new sessions on helper threads, however
        # fast its time says it was.
        filler._note_start_fills([(0, fast)], [0], late_pos={0})
        assert filler._slow(MatcherSession(9, entries["letters"]))
    finally:
        filler.close()
