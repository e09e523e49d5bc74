"""A grammar whose mask takes too long fails its own session, never the step (--max-row-fill-seconds).

xgrammar cannot interrupt a fill, and a few grammar states take seconds; a
step waiting for one would miss the inference service's step deadline and
cost the replica its stream, and every other request on it. Rows on helper
threads (a session's first fill, and every row that was slow before) get the
budget; one past it comes back late, its session fails RESOURCE_EXHAUSTED and
is closed, and the step answers for the rest.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest
import xgrammar as xgr

from grammar_svc import config as gconfig
from grammar_svc.compile.cache import CompiledEntry
from grammar_svc.step.mask_filler import MaskFiller
from grammar_svc.step.session import MatcherSession
from grammar_svc.compile.tokenizer_registry import RegisteredTokenizer
from shared.codec import MaskEncoder
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient
from structd.cli import build_parser
from tests.conftest import start_grammar_server
from tests.test_grammar_limits import TinyTokenizer, compile_regex, open_step, register
from tests.test_grammar_rpcs import call as with_client
from tests.test_grammar_rpcs import end_stream

VOCAB = [chr(ord("a") + i) for i in range(26)] + ["</s>"]


@pytest.fixture(scope="module")
def entries():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[len(VOCAB) - 1])
    tok = RegisteredTokenizer("test-slow-rows", info.serialize_json(), info, len(VOCAB), None,
                              tuple(t.encode() for t in VOCAB))
    compiler = xgr.GrammarCompiler(info)
    return {name: CompiledEntry(name, compiler.compile_regex(regex), tok, (), 0.0, 0)
            for name, regex in (("letters", "[a-z]+"), ("abc", "[abc]{2,4}"))}


@pytest.fixture
def slow_grammar(monkeypatch):
    """Fault injection: fills of one grammar (by id) hold until released, standing in for a grammar state whose
    mask takes seconds (xgrammar has them, but not on demand); every other session fills for real."""
    slow_ids: set[str] = set()
    release = threading.Event()
    real_fill = MatcherSession.fill

    def fill(self, bitmask, row):
        if self.entry.grammar_id in slow_ids:
            release.wait(30)
        real_fill(self, bitmask, row)

    monkeypatch.setattr(MatcherSession, "fill", fill)
    yield slow_ids
    release.set()


def test_a_row_past_the_budget_is_late_and_the_others_are_filled(entries, slow_grammar):
    filler = MaskFiller(threads=1, max_row_fill_seconds=0.2)
    slow_grammar.add("abc")
    fast, slow, queued = (MatcherSession(1, entries["letters"]), MatcherSession(2, entries["abc"]),
                          MatcherSession(3, entries["letters"]))
    # Routing follows each session's history: the fast one fills in the step's loop, the others go to the
    # one helper thread, where the third waits behind the stuck one (its budget has not started).
    fast.last_fill_seconds, slow.last_fill_seconds, queued.last_fill_seconds = 1e-6, 1.0, 1.0
    try:
        filled, late = filler.fill([(0, fast), (1, slow), (2, queued)])
        assert [row.index for row in filled] == [0, 2]
        assert [(row.index, row.session) for row in late] == [(1, slow)]
        assert late[0].fill_seconds >= 0.2
        for row, session in zip(filled, (fast, queued)):
            expected = xgr.allocate_token_bitmask(1, len(VOCAB))
            session.matcher.fill_next_token_bitmask(expected, 0)
            assert row.key == MaskEncoder(len(VOCAB)).canonical(expected.numpy()[0]).tobytes()
    finally:
        filler.close()


@pytest.fixture(scope="module")
def impatient_server():
    srv = start_grammar_server(compile_workers=1, fill_threads=1, max_row_fill_seconds=0.2)
    yield srv
    srv.stop()


def test_a_late_row_fails_its_session_alone_through_the_server(impatient_server, slow_grammar):
    tok = TinyTokenizer()
    register(impatient_server.target, tok)
    fast_gid = compile_regex(impatient_server.target, tok).grammar_id
    slow_gid = compile_regex(impatient_server.target, tok, "b+a").grammar_id
    slow_grammar.add(slow_gid)

    async def go(client: GrammarClient):
        stream = client.open_stream(tok.vocab_size, 0)
        first = await stream.step([pb.SessionStep(session_id=1, open=pb.OpenSession(grammar_id=fast_gid)),
                                   pb.SessionStep(session_id=2, open=pb.OpenSession(grammar_id=slow_gid))])
        # The late session is gone; the stream and session 1 go on.
        after = await stream.step([pb.SessionStep(session_id=2, accept_token_ids=[1]),
                                   pb.SessionStep(session_id=1, accept_token_ids=[0])])
        await end_stream(stream)
        return first, after

    first, after = with_client(impatient_server.target, go)
    ok, late = first.results
    assert ok.status == pb.SESSION_STATUS_OK and ok.HasField("mask")
    assert late.status == pb.SESSION_STATUS_ERROR
    assert late.error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "--max-row-fill-seconds" in late.error_message
    gone, alive = after.results
    assert gone.status == pb.SESSION_STATUS_ERROR and alive.status == pb.SESSION_STATUS_OK
    registry = impatient_server.server.metrics.registry
    assert registry.get_sample_value("grammar_svc_session_events_total", {"event": "fill_timeout"}) == 1.0


def test_the_budget_is_a_flag_with_an_env_twin_and_must_be_positive():
    cfg = gconfig.from_args(build_parser({"STRUCTD_GRAMMAR_MAX_ROW_FILL_SECONDS": "0.5"}).parse_args(["grammar"]))
    assert cfg.max_row_fill_seconds == 0.5
    with pytest.raises(SystemExit) as exit_:
        gconfig.from_args(build_parser({}).parse_args(["grammar", "--max-row-fill-seconds", "0"]))
    assert "--max-row-fill-seconds" in str(exit_.value)
