"""Continuous batching behaviour through gRPC: compile isolation, seeded reproducibility, cancellation."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import SLOW_SCHEMA


def test_slow_grammar_does_not_delay_an_unconstrained_request(inference_client, inference_server):
    """Ordering, not wall clock: the unconstrained request sent *after* a slow-compiling one finishes
    before the constrained one has produced its first token."""
    events: list[str] = []
    lock = threading.Lock()

    def slow():
        for chunk in inference_client.generate("S:", json_schema=SLOW_SCHEMA, max_tokens=8):
            with lock:
                events.append("slow-first-token")
            break

    def fast():
        out = inference_client.complete("F:", max_tokens=4, ignore_eos=True)
        with lock:
            events.append("fast-finished")
        return out

    with ThreadPoolExecutor(2) as pool:
        slow_done = pool.submit(slow)
        # The constrained request is in the server (compiling) before the unconstrained one is sent.
        deadline = time.monotonic() + 30
        while inference_server.run_sync(lambda: len(inference_server.server.engine._compiling)) == 0:
            assert time.monotonic() < deadline, "the slow request never started compiling"
            time.sleep(0.01)
        fast_out = pool.submit(fast).result(120)
        slow_done.result(120)
    assert fast_out.finish_reason == "length"
    assert events == ["fast-finished", "slow-first-token"]


@pytest.mark.parametrize("sampling", [
    pytest.param(dict(temperature=1.0, seed=1234), id="seeded"),
    pytest.param(dict(temperature=0.7, top_p=0.9, top_k=50, seed=99), id="seeded-top-p-top-k"),
    pytest.param(dict(temperature=0.0), id="greedy"),
])
def test_seeded_sampling_is_reproducible_whatever_the_batch(inference_client, sampling):
    alone = inference_client.complete("Tell me", max_tokens=16, ignore_eos=True, **sampling)
    companions = [dict(temperature=1.0), dict(temperature=1.0, seed=5), dict(regex="[a-z]{4,9}"), dict()]

    def run(kw):
        return inference_client.complete("Other prompt, longer than the first one", max_tokens=24,
                                         ignore_eos=True, **kw)

    with ThreadPoolExecutor(len(companions) + 1) as pool:
        others = [pool.submit(run, kw) for kw in companions]
        time.sleep(0.05)  # the companions are in the batch first, so our row index differs
        crowded = pool.submit(inference_client.complete, "Tell me", max_tokens=16, ignore_eos=True,
                              **sampling).result(120)
        for f in others:
            f.result(120)
    assert crowded.token_ids == alone.token_ids


def test_different_seeds_differ(inference_client):
    a = inference_client.complete("Seeds", max_tokens=12, ignore_eos=True, temperature=1.0, seed=1)
    b = inference_client.complete("Seeds", max_tokens=12, ignore_eos=True, temperature=1.0, seed=2)
    assert a.token_ids != b.token_ids


def _grammar_sessions(grammar_server) -> float:
    return grammar_server.server.metrics.registry.get_sample_value("grammar_svc_active_sessions")


def _engine_state(server):
    engine = server.server.engine
    return len(engine.runner.block_manager), engine.num_active


def test_cancellation_frees_kv_blocks_and_grammar_sessions(inference_client, inference_server, grammar_server):
    gen = inference_client.generate("Cancel me:", regex="[a-z]{1,400}", max_tokens=300, ignore_eos=True)
    got = [next(gen), next(gen)]
    assert all(c.finish_reason is None for c in got)
    assert inference_server.run_sync(lambda: _engine_state(inference_server)) == (1, 1)
    assert _grammar_sessions(grammar_server) >= 1
    gen.close()  # cancels the RPC
    deadline = time.monotonic() + 30
    while True:
        state = inference_server.run_sync(lambda: _engine_state(inference_server))
        sessions = _grammar_sessions(grammar_server)
        if state == (0, 0) and sessions == 0:
            break
        assert time.monotonic() < deadline, f"after cancel: (kv seqs, active) = {state}, grammar sessions {sessions}"
        time.sleep(0.05)
    # The service goes on.
    assert inference_client.complete("after", max_tokens=3, ignore_eos=True).finish_reason == "length"


def test_unconstrained_and_json_requests_share_steps(inference_server, inference_client):
    """Both kinds are in one forward: the batch-size histogram sees steps with more than one sequence."""
    metrics = inference_server.server.metrics

    def batched_steps():
        get = metrics.registry.get_sample_value
        return get("inference_svc_batch_size_count") - get("inference_svc_batch_size_bucket", {"le": "1.0"})

    before = batched_steps()
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(inference_client.complete, "A", max_tokens=60, ignore_eos=True)
        b = pool.submit(inference_client.complete, "B", json_schema={"type": "object", "properties": {
            "v": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["v"]}, max_tokens=40)
        a.result(120)
        json.loads(b.result(120).text)
    assert batched_steps() > before
