"""Compile pool faults, through the real grammar server over real gRPC (issue 8, items 6 and 7).

- the client's compile deadline is capped by the server's maximum;
- a compile whose every caller went away is cancelled (its worker killed), one
  that another caller still waits for is not;
- a timeout is answered from the cache only for a short while;
- a worker that dies (SIGKILL from outside), busy or idle, is replaced and
  counted; a compile it was running is retried on the fresh worker; a spec
  under which workers die twice is refused from the failure cache; a worker
  that cannot be started is retried with back-off;
- a worker is never waited for on the event loop;
- slow schemas do not starve fast ones (head-of-line blocking): in a burst of
  two schemas far past their deadline and several fast ones on one compile
  worker, every fast one compiles and the slow ones fail with their own
  DEADLINE_EXCEEDED.

Every test asserts outcomes (statuses, counters, which process), never how
long something took; timeouts below only bound a broken run. Workers are
killed with SIGKILL, as the OOM killer or a segfault would end them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import grpc
import pytest

from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient
from tests.conftest import SLOW_SCHEMA, TOO_SLOW_SCHEMA, run, start_grammar_server
from tests.test_grammar_rpcs import pid_alive, salt, sample, wait_until


def json_schema(schema: dict, tag: str) -> pb.GrammarSpec:
    """`tag` (a title: an annotation, the language is the same) makes the grammar id new."""
    return pb.GrammarSpec(json_schema=pb.JsonSchema(schema=json.dumps({**schema, "title": tag})))


def very_slow(tag: str) -> pb.GrammarSpec:
    """Tens of seconds with the 129k tokenizer: always past the deadlines used here."""
    props = {f"p{i}": {"type": "string", "minLength": i % 7 + 1, "maxLength": i % 11 + 10} for i in range(200)}
    return json_schema({"type": "object", "properties": props, "required": list(props)}, tag)


def fast(tag: str) -> pb.GrammarSpec:
    return json_schema({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
                        "required": ["a"]}, tag)


def restarts(srv, reason: str) -> float:
    return sample(srv, "grammar_svc_compile_worker_restarts_total", reason=reason)


def workers(srv) -> list:
    """The pool's live workers (read on the server's loop, which owns the pool)."""
    return srv.run_sync(lambda: list(srv.server.backend.pool._all))


def waiters(srv) -> list[int]:
    """How many callers wait for each compile in flight."""
    backend = srv.server.backend
    return srv.run_sync(lambda: [f.waiters for f in backend._inflight.values()])


def compiling_worker(srv, not_pid: int | None = None):
    """The worker running a compile (not a tokenizer load), if any, other than `not_pid`."""
    return next((w for w in workers(srv) if w.compiling and w.proc.pid != not_pid), None)


def pool_ready(srv, n: int = 1) -> list:
    """Waits until exactly n workers are alive and idle; returns them."""
    def ready():
        pool = srv.server.backend.pool
        ws = srv.run_sync(lambda: list(pool._all) if pool.idle_workers == len(pool._all) else [])
        return ws if len(ws) == n else None

    return wait_until(ready, f"{n} idle compile worker(s)")


async def with_client(srv, fn):
    client = GrammarClient(srv.target)
    try:
        return await fn(client)
    finally:
        await client.close()


def call(srv, fn):
    return run(with_client(srv, fn))


def rpc_error(srv, fn) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        call(srv, fn)
    return info.value


def register(srv, desc) -> None:
    call(srv, lambda c: c.register_tokenizer(desc))
    # Every worker holds the tokenizer before a test looks at compiles.
    call(srv, lambda c: c.compile(desc.fingerprint, fast(f"warm-{salt()}")))


def one_worker_server(desc, **overrides):
    """A grammar server of one compile worker that holds the tokenizer, stopped when the module is done."""
    srv = start_grammar_server(compile_workers=1, **overrides)
    try:
        register(srv, desc)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def capped(tokenizer_desc):
    """One worker; every compile deadline capped at 1 s; timeouts cached for 1 s."""
    yield from one_worker_server(tokenizer_desc, compile_timeout_seconds=1.0, max_compile_timeout_seconds=1.0,
                                 compile_timeout_cache_seconds=1.0)


@pytest.fixture(scope="module")
def roomy(tokenizer_desc):
    """One worker, a minute of deadline: compiles end only when the test ends them."""
    yield from one_worker_server(tokenizer_desc, compile_timeout_seconds=60.0, max_compile_timeout_seconds=60.0)


# ---------------------------------------------------------------- (a) the server caps the deadline


def test_client_deadline_is_capped_by_the_server_maximum(capped, tokenizer_desc):
    before = restarts(capped, "deadline")
    err = rpc_error(capped, lambda c: c.compile(tokenizer_desc.fingerprint, very_slow(f"cap-{salt()}"),
                                                timeout_seconds=600, rpc_timeout=120))
    # The cap, not the client's deadline, ended it: the operator's limit, named; never retried.
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cap of 1 s (--max-compile-timeout-seconds)" in err.details()
    assert restarts(capped, "deadline") == before + 1
    pool_ready(capped)


# ---------------------------------------------------------------- (c) timeouts are cached briefly


def _failed_entries(srv) -> dict:
    from grammar_svc.compile.cache import FailedEntry

    cache = srv.server.backend.cache
    return srv.run_sync(lambda: {k: e for k, e in cache._entries.items() if isinstance(e, FailedEntry)})


def _put(srv, entry) -> None:
    srv.run_sync(lambda: srv.server.backend.cache.put(entry))


def test_a_timeout_is_forgotten_after_the_cache_time(capped, tokenizer_desc):
    """A schema that timed out under load (here: its worker stopped) compiles once the TTL has passed.

    The TTL is checked on the entry the server wrote (it expires the configured 1 s after the failure), and
    its passing is an event the test makes (the entry's expiry moved to now), not a sleep: a busy machine
    could take longer than the window between the failure and the cached answer."""
    import dataclasses

    fp = tokenizer_desc.fingerprint
    spec = fast(f"ttl-{salt()}")
    (worker,) = pool_ready(capped)
    known = set(_failed_entries(capped))
    os.kill(worker.proc.pid, signal.SIGSTOP)  # "under load": the compile cannot make progress
    try:
        started = time.monotonic()
        err = rpc_error(capped, lambda c: c.compile(fp, spec))
        answered = time.monotonic()
    finally:
        if pid_alive(worker.proc.pid):
            os.kill(worker.proc.pid, signal.SIGCONT)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    (entry,) = [e for k, e in _failed_entries(capped).items() if k not in known]
    assert started + 1.0 <= entry.expires_at <= answered + 1.0, "remembered for the configured 1 s"
    pool_ready(capped)
    _put(capped, dataclasses.replace(entry, expires_at=time.monotonic() + 600))  # still within its time
    hits = sample(capped, "grammar_svc_cache_hits_total", kind="json_schema")
    again = rpc_error(capped, lambda c: c.compile(fp, spec))
    assert again.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sample(capped, "grammar_svc_cache_hits_total", kind="json_schema") == hits + 1, "not from the cache"
    _put(capped, dataclasses.replace(entry, expires_at=time.monotonic()))  # its time is up
    resp = call(capped, lambda c: c.compile(fp, spec))
    assert resp.grammar_id and not resp.cache_hit


def queued_behind_a_stopped_worker(srv, worker, fp: str, spec, deadline: float, hold_seconds: float):
    """The error of compiling `spec` (deadline seconds) queued behind a first compile on the one worker, which
    is stopped (SIGSTOP) until the second has waited at least hold_seconds, then let go."""
    pool = srv.server.backend.pool
    os.kill(worker.proc.pid, signal.SIGSTOP)

    async def go(client):
        try:
            first = asyncio.ensure_future(client.compile(fp, fast(f"holder-{salt()}"), timeout_seconds=60))
            while compiling_worker(srv) is None:
                await asyncio.sleep(0.02)
            second = asyncio.ensure_future(client.compile(fp, spec, timeout_seconds=deadline))
            while srv.run_sync(lambda: pool.waiting_jobs) != 1:  # queued behind the first
                await asyncio.sleep(0.02)
            await asyncio.sleep(hold_seconds)  # a lower bound on the wait, whatever the load
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        assert (await first).grammar_id
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await second
        return info.value

    return call(srv, go)


@pytest.fixture(scope="module")
def laneless(tokenizer_desc):
    """One worker and no extra lanes: a job behind a long compile waits for as long as the test holds it."""
    yield from one_worker_server(tokenizer_desc, max_compile_workers=1, compile_timeout_seconds=60.0,
                                 max_compile_timeout_seconds=60.0)


def test_a_compile_that_waited_most_of_its_deadline_and_ran_out_is_the_queues_not_remembered(
        laneless, tokenizer_desc):
    """Held at least 60% of its 3 s deadline behind another compile, then out of time compiling: the queue's
    doing (DEADLINE_EXCEEDED, counted as busy), never remembered against the grammar."""
    fp = tokenizer_desc.fingerprint
    (worker,) = pool_ready(laneless)
    known = set(_failed_entries(laneless))
    busy = sample(laneless, "grammar_svc_compile_failures_total", kind="json_schema", reason="busy")
    err = queued_behind_a_stopped_worker(laneless, worker, fp, very_slow(f"waited-{salt()}"), 3.0, hold_seconds=1.8)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "most of it spent waiting for a free compile worker" in err.details(), err.details()
    assert sample(laneless, "grammar_svc_compile_failures_total", kind="json_schema", reason="busy") == busy + 1
    assert not [k for k in _failed_entries(laneless) if k not in known]
    pool_ready(laneless)


def test_a_queued_compile_that_ran_out_compiling_is_the_grammars_timeout_remembered_for_what_it_ran(
        laneless, tokenizer_desc):
    """A compile that waited a while for the one worker, then compiled past the rest of its deadline: the
    grammar is slow (DEADLINE_EXCEEDED, remembered), not the queue busy (which is never remembered, so a slow
    schema under load cost a worker for its whole deadline at every request). It is remembered for the
    seconds it compiled: a request with no longer a deadline is answered from the cache.

    No lanes: with one, the queued compile would move to a fresh fork half a second after the holder started
    (sooner when the machine is slow to queue it), and a wait that short counts as none."""
    fp = tokenizer_desc.fingerprint
    (worker,) = pool_ready(laneless)
    known = set(_failed_entries(laneless))
    slow = very_slow(f"queued-{salt()}")
    deadline = 6.0
    # At least a sixth of its deadline waited (a lower bound, whatever the load): more than a moment (which
    # would count as no wait), under the half that would make it the queue's.
    err = queued_behind_a_stopped_worker(laneless, worker, fp, slow, deadline, hold_seconds=1.0)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "after compiling for" in err.details(), err.details()
    (entry,) = [e for k, e in _failed_entries(laneless).items() if k not in known]
    assert deadline / 2 <= entry.timeout_seconds < deadline  # what it compiled for, not the whole deadline
    pool_ready(laneless)
    hits = sample(laneless, "grammar_svc_cache_hits_total", kind="json_schema")
    again = rpc_error(laneless, lambda c: c.compile(fp, slow, timeout_seconds=deadline / 2))
    assert again.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sample(laneless, "grammar_svc_cache_hits_total", kind="json_schema") == hits + 1, "not from the cache"


# ---------------------------------------------------------------- (b) abandoned compiles are cancelled


def test_a_compile_nobody_waits_for_is_cancelled(roomy, tokenizer_desc):
    fp = tokenizer_desc.fingerprint
    (worker,) = pool_ready(roomy)
    before = restarts(roomy, "abandoned")

    async def go(client):
        task = asyncio.ensure_future(client.compile(fp, very_slow(f"abandon-{salt()}"), timeout_seconds=60))
        while compiling_worker(roomy) is None:
            assert not task.done(), task
            await asyncio.sleep(0.02)
        task.cancel()  # the caller goes away: the RPC is cancelled
        with pytest.raises(asyncio.CancelledError):
            await task

    call(roomy, go)
    # Killed now, not when the compile would have ended (tens of seconds) or at its deadline (60 s).
    wait_until(lambda: restarts(roomy, "abandoned") == before + 1, "the abandoned compile's worker to be killed",
               timeout=30)
    wait_until(lambda: not pid_alive(worker.proc.pid), "the killed worker to exit")
    (fresh,) = pool_ready(roomy)
    assert fresh.proc.pid != worker.proc.pid
    assert call(roomy, lambda c: c.compile(fp, fast(f"after-abandon-{salt()}"))).grammar_id


def test_a_compile_another_caller_waits_for_goes_on(roomy, tokenizer_desc):
    fp = tokenizer_desc.fingerprint
    pool_ready(roomy)
    before = restarts(roomy, "abandoned")
    spec = json_schema(SLOW_SCHEMA, f"shared-{salt()}")

    async def go(client):
        first = asyncio.ensure_future(client.compile(fp, spec, timeout_seconds=60))
        second = asyncio.ensure_future(client.compile(fp, spec, timeout_seconds=60))
        while waiters(roomy) != [2]:  # both calls have joined the one compile in flight
            await asyncio.sleep(0.02)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        return await second

    resp = call(roomy, go)
    assert resp.grammar_id
    assert restarts(roomy, "abandoned") == before
    pool_ready(roomy)


def test_a_caller_that_joined_a_compile_with_a_shorter_deadline_gets_its_own(roomy, tokenizer_desc):
    """Two callers ask for one grammar, the first with a 1 s deadline, the second with 2.5 s: the second joins the
    first's compile, and when that stops at 1 s it compiles again in the time it has left, rather than hear of a
    1 s deadline it never asked for (the grammar takes tens of seconds, so both answers are DEADLINE_EXCEEDED,
    each naming the deadline its caller asked for, from two compiles)."""
    fp = tokenizer_desc.fingerprint
    pool_ready(roomy)
    before = restarts(roomy, "deadline")
    spec = very_slow(f"join-{salt()}")

    async def go(client):
        first = asyncio.ensure_future(client.compile(fp, spec, timeout_seconds=1.0))
        while waiters(roomy) != [1]:
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(client.compile(fp, spec, timeout_seconds=2.5))
        while waiters(roomy) != [2]:  # joined the compile in flight
            assert not first.done(), first
            await asyncio.sleep(0.01)
        return await asyncio.gather(first, second, return_exceptions=True)

    answers = call(roomy, go)
    deadlines = []
    for answer in answers:
        assert isinstance(answer, grpc.aio.AioRpcError), answer
        assert answer.code() == grpc.StatusCode.DEADLINE_EXCEEDED, answer.details()
        deadlines.append(float(re.search(r"(?:exceeded|within) its ([0-9.]+) s deadline", answer.details()).group(1)))
    assert deadlines == [1.0, 2.5], deadlines
    assert "shared with another request" in answers[1].details()
    wait_until(lambda: restarts(roomy, "deadline") == before + 2, "both compiles' workers stopped at their deadlines")
    pool_ready(roomy)


# ---------------------------------------------------------------- (d) crashed workers


def test_a_worker_killed_mid_compile_is_replaced_and_the_compile_retried(roomy, tokenizer_desc):
    fp = tokenizer_desc.fingerprint
    pool_ready(roomy)
    before = restarts(roomy, "crashed")
    spec = json_schema(SLOW_SCHEMA, f"crash-once-{salt()}")
    killed = []

    async def go(client):
        task = asyncio.ensure_future(client.compile(fp, spec, timeout_seconds=60))
        while (w := compiling_worker(roomy)) is None:
            await asyncio.sleep(0.02)
        os.kill(w.proc.pid, signal.SIGKILL)
        killed.append(w.proc.pid)
        return await task

    resp = call(roomy, go)
    assert resp.grammar_id and not resp.cache_hit
    assert restarts(roomy, "crashed") == before + 1
    (fresh,) = pool_ready(roomy)
    assert fresh.proc.pid != killed[0]


def test_a_spec_that_crashes_workers_twice_is_refused(roomy, tokenizer_desc):
    fp = tokenizer_desc.fingerprint
    pool_ready(roomy)
    crashes = restarts(roomy, "crashed")
    failures = sample(roomy, "grammar_svc_compile_failures_total", kind="json_schema", reason="crash")
    spec = very_slow(f"crash-twice-{salt()}")

    async def go(client):
        task = asyncio.ensure_future(client.compile(fp, spec, timeout_seconds=60))
        killed = None
        for _ in range(2):
            # The first run, then the retry on a fresh worker: kill each mid-compile.
            while (w := compiling_worker(roomy, not_pid=killed)) is None:
                assert not task.done(), task
                await asyncio.sleep(0.02)
            killed = w.proc.pid
            os.kill(killed, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await task
        return info.value

    err = call(roomy, go)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "crashed the grammar compiler 2 times" in err.details()
    assert restarts(roomy, "crashed") == crashes + 2
    assert sample(roomy, "grammar_svc_compile_failures_total", kind="json_schema", reason="crash") == failures + 1
    pool_ready(roomy)
    # Refused from the failure cache: no worker runs it again.
    hits = sample(roomy, "grammar_svc_cache_hits_total", kind="json_schema")
    again = rpc_error(roomy, lambda c: c.compile(fp, spec, timeout_seconds=60))
    assert again.code() == grpc.StatusCode.INVALID_ARGUMENT and "crashed" in again.details()
    assert sample(roomy, "grammar_svc_cache_hits_total", kind="json_schema") == hits + 1
    assert restarts(roomy, "crashed") == crashes + 2


def test_a_worker_that_dies_idle_is_replaced(roomy, tokenizer_desc):
    (worker,) = pool_ready(roomy)
    before = restarts(roomy, "crashed")
    os.kill(worker.proc.pid, signal.SIGKILL)
    # No compile needed to notice: the supervisor replaces it on its own.
    wait_until(lambda: restarts(roomy, "crashed") == before + 1, "the dead idle worker to be noticed")
    (fresh,) = pool_ready(roomy)
    assert fresh.proc.pid != worker.proc.pid and pid_alive(fresh.proc.pid)
    resp = call(roomy, lambda c: c.compile(tokenizer_desc.fingerprint, fast(f"after-idle-death-{salt()}")))
    assert resp.grammar_id and not resp.cache_hit


def test_a_worker_that_fails_to_start_is_retried_with_back_off(roomy, tokenizer_desc):
    pool = roomy.server.backend.pool
    (worker,) = pool_ready(roomy)
    failures = sample(roomy, "grammar_svc_compile_worker_spawn_failures_total")
    crashes = restarts(roomy, "crashed")
    real_spawn = pool._spawn
    attempts = []

    def flaky_spawn():
        attempts.append(time.monotonic())
        if len(attempts) <= 2:
            raise RuntimeError("cannot start a worker (test)")
        return real_spawn()

    roomy.run_sync(lambda: setattr(pool, "_spawn", flaky_spawn))
    try:
        os.kill(worker.proc.pid, signal.SIGKILL)
        wait_until(lambda: restarts(roomy, "crashed") == crashes + 1, "the dead worker to be noticed")
        (fresh,) = pool_ready(roomy)
    finally:
        roomy.run_sync(lambda: setattr(pool, "_spawn", real_spawn))
    assert len(attempts) == 3, "two failed starts, then one that worked"
    assert sample(roomy, "grammar_svc_compile_worker_spawn_failures_total") == failures + 2
    assert fresh.proc.pid != worker.proc.pid
    assert call(roomy, lambda c: c.compile(tokenizer_desc.fingerprint, fast(f"after-spawn-fail-{salt()}"))).grammar_id


# ---------------------------------------------------------------- (e) the event loop never waits for a worker


def test_killed_workers_are_reaped_off_the_event_loop(capped, tokenizer_desc):
    (worker,) = pool_ready(capped)
    loop_thread = capped.run_sync(threading.current_thread)
    waited_in = []
    real_wait = worker.proc.wait

    def recording_wait(*args, **kwargs):
        waited_in.append(threading.current_thread())
        return real_wait(*args, **kwargs)

    worker.proc.wait = recording_wait
    err = rpc_error(capped, lambda c: c.compile(tokenizer_desc.fingerprint, very_slow(f"reap-{salt()}")))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: waited_in, "the killed worker to be reaped")
    assert loop_thread not in waited_in
    pool_ready(capped)


# ---------------------------------------------------------------- 7: head-of-line blocking


def test_slow_schemas_do_not_starve_fast_ones(tokenizer_desc):
    """One compile worker; two schemas that compile for tens of seconds take it first, then eight fast ones
    arrive. Without extra lanes the fast ones wait behind the slow ones past their own 30 s wait and fail
    "all busy". The slow ones' 60 s deadlines leave a lane (a fork, then the 129k tokenizer, at worker nice on
    a loaded machine) all the time it needs: at 4 s, under make test's load, the lanes sometimes came up too
    late. The fast ones must all be answered while both slow ones are still compiling; then those are
    cancelled (their workers killed as abandoned), so the test does not wait out their deadlines."""
    srv = start_grammar_server(compile_workers=1, compile_timeout_seconds=4.0)
    try:
        register(srv, tokenizer_desc)
        fp = tokenizer_desc.fingerprint
        run_tag = salt()
        slow = [very_slow(f"hol-slow-{i}-{run_tag}") for i in range(2)]
        fasts = [fast(f"hol-fast-{i}-{run_tag}") for i in range(8)]

        async def outcome(coro):
            try:
                await coro
                return "ok", ""
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()

        async def go(client):
            slow_tasks = [asyncio.ensure_future(outcome(client.compile(fp, s, timeout_seconds=60, rpc_timeout=120)))
                          for s in slow]
            while compiling_worker(srv) is None:
                await asyncio.sleep(0.02)
            fast_results = await asyncio.gather(*[outcome(client.compile(fp, f, timeout_seconds=30, rpc_timeout=120))
                                                  for f in fasts])
            slow_pending = [not t.done() for t in slow_tasks]
            for t in slow_tasks:
                t.cancel()
            await asyncio.gather(*slow_tasks, return_exceptions=True)
            return slow_pending, fast_results

        slow_pending, fast_results = call(srv, go)
        assert fast_results == [("ok", "")] * len(fasts)
        assert slow_pending == [True, True], "the fast compiles were answered only after a slow one ended"
        assert sample(srv, "grammar_svc_compile_failures_total", kind="json_schema", reason="busy") == 0
    finally:
        srv.stop()
