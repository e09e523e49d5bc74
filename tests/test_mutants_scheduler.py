"""The scheduler's edges that mutation testing found untested by its own test file (docs/mutation.md).

Whether it has work, removing a request that is still waiting, a running
request with nothing to compute this step (its next token not sampled yet)
not holding up the ones after it, and a budget used up by running requests
admitting nobody with an empty chunk.
"""

from __future__ import annotations

from inference_svc.engine.scheduler import Scheduler
from inference_svc.model.paged_kv import BlockManager
from tests.test_inference_scheduler import _req, _run_step


def test_has_work_while_anything_runs_or_waits():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    assert not sched.has_work()
    a, b = _req("a", 3), _req("b", 3)
    sched.add(a)
    assert sched.has_work()  # waiting only
    _run_step(sched)
    assert sched.has_work() and sched.running == [a] and not sched.waiting  # running only
    sched.add(b)
    sched.remove(a)
    assert sched.has_work()  # waiting only again
    sched.remove(b)
    assert not sched.has_work()


def test_a_removed_waiting_request_is_never_admitted():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    a, b = _req("a", 3), _req("b", 3)
    sched.add(a)
    sched.add(b)
    sched.remove(a)
    assert list(sched.waiting) == [b]
    step = _run_step(sched)
    assert [s.request.request_id for s in step.chunks] == ["b"]


def test_a_running_request_with_nothing_to_compute_does_not_hold_up_the_next():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    a, b = _req("a", 3), _req("b", 3)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    sched.commit(step)
    b.all_ids.append(7)  # b's next token is sampled, a's is not (yet)
    nxt = sched.schedule()
    assert [(s.request.request_id, s.chunk.token_ids) for s in nxt.chunks] == [("b", (7,))]


def test_a_budget_used_up_by_running_requests_admits_nobody():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=2)
    a, b, c = _req("a", 1), _req("b", 1), _req("c", 1)
    sched.add(a)
    sched.add(b)
    _run_step(sched)
    sched.add(c)
    step = _run_step(sched)
    assert [(s.request.request_id, len(s.chunk.token_ids)) for s in step.chunks] == [("a", 1), ("b", 1)]
    assert list(sched.waiting) == [c]
