"""The in-process launcher tests and benchmarks start servers with (structd.bench.harness.ServiceThread).

A server that cannot start says why with SystemExit (no grammar replica, a
taken port, an engine core that did not come up). asyncio lets SystemExit out
of the event loop, which ends the loop's thread before the starter hears of
it: the launcher must turn that into an error with the reason at once, not a
wait for its whole start timeout, and leave nothing of the server behind.
"""

from __future__ import annotations

import threading

import pytest

from structd.bench.harness import ServiceThread, free_port


@pytest.mark.parametrize("engine_process", [
    pytest.param("off", id="one-process"),
    pytest.param("on", id="engine-process"),
])
def test_a_server_that_cannot_start_fails_its_starter_at_once_with_the_reason(engine_process):
    from inference_svc.config import InferenceServiceConfig
    from inference_svc.server import InferenceServer

    nobody = free_port()  # no grammar replica listens there
    cfg = InferenceServiceConfig(host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(f"127.0.0.1:{nobody}",),
                                 num_threads=1, simulate_step_ms=5.0, engine_process=engine_process)
    name = f"cannot-start-{engine_process}"
    # Before the fix this waited out the start timeout and raised TimeoutError, with no reason.
    with pytest.raises(RuntimeError, match=f"no grammar replica reachable at 127.0.0.1:{nobody}"):
        ServiceThread(InferenceServer(cfg), name, start_timeout=180.0, grammar_connect_timeout=1.0)
    assert not any(t.name == name for t in threading.enumerate()), "the server's loop thread is still running"


def test_a_server_that_does_not_start_in_time_says_where_it_waits():
    from inference_svc.config import InferenceServiceConfig
    from inference_svc.server import InferenceServer

    cfg = InferenceServiceConfig(host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(f"127.0.0.1:{free_port()}",),
                                 num_threads=1, simulate_step_ms=5.0)
    # It would wait ten minutes for a grammar replica: the starter gives up first (as soon as the start waits
    # for the grammar tier; past start_timeout, while it may still be loading the model), and names the await
    # it gave up on, down to the innermost coroutine.
    def waits_for_the_grammar_tier(waits: list[str]) -> bool:
        return len(waits) > 2 and waits[1].endswith(" in connect")

    with pytest.raises(TimeoutError, match=r"slow-start did not start within \d+ s; its start\(\) waits at "
                                           r"server\.py:\d+ in start -> assembly\.py:\d+ in (build|connect) -> "):
        ServiceThread(InferenceServer(cfg), "slow-start", start_timeout=60.0, give_up=waits_for_the_grammar_tier,
                      grammar_connect_timeout=600.0)
    assert not any(t.name == "slow-start" for t in threading.enumerate()), "the server's loop thread is still running"
