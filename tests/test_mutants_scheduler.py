"""The scheduler's rules that mutation testing found untested by its own test file (docs/mutation.md).

Whether it has work, removing a request that is still waiting, a running
request with nothing to compute this step (its next token not sampled yet)
not holding up the ones after it, and a budget used up by running requests
admitting nobody with an empty chunk; which request is preempted when the
cache is full (the newest, itself when it is the newest), a request that
does not fit waiting in line, a request whose bookkeeping breaks failing
alone; with prefix caching, a computed prompt's blocks registered and
mapped by the next request with the same prefix (and counted), and the
other completions of an n > 1 request waiting for the first to compute
the prompt.
"""

from __future__ import annotations

from inference_svc.engine.request import GenerationRequest, Phase
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


def _scheduler(blocks: BlockManager, budget: int, *requests: GenerationRequest) -> Scheduler:
    """A scheduler of up to 8 sequences and `budget` tokens a step, with `requests` added in order."""
    sched = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=budget)
    for r in requests:
        sched.add(r)
    return sched


def _chunks(step) -> list[tuple[str, int, tuple[int, ...]]]:
    """(request, start position, tokens) of each chunk of a step."""
    return [(s.request.request_id, s.chunk.start_pos, s.chunk.token_ids) for s in step.chunks]


def _group(rid: str, prompt_len: int, n: int) -> list[GenerationRequest]:
    """The n completions of one request, as the engine links them: the first leads."""
    group = [_req(f"{rid}{i}", prompt_len) for i in range(n)]
    group[0].siblings = group[1:]
    for i, sibling in enumerate(group[1:], 1):
        sibling.index, sibling.leader = i, group[0]
    return group


def test_each_running_request_gets_at_most_one_chunk_of_its_own_sequence_a_step():
    a, b, c = _req("a", 3), _req("b", 3), _req("c", 3)
    sched = _scheduler(BlockManager(64, 4), 16, a, b, c)
    sched.commit(sched.schedule())
    a.all_ids.append(7)
    b.all_ids.append(8)  # c's next token is not sampled yet
    step = sched.schedule()
    assert _chunks(step) == [("a", 3, (7,)), ("b", 3, (8,))]
    assert step.batch.logit_seq_ids == [a.seq_id, b.seq_id]


def test_a_request_that_cannot_grow_preempts_the_newest_and_only_as_many_as_it_needs():
    # 4 blocks of 4: three 4-token prompts take one each; every one's 5th token needs a second, one is free.
    a, b, c = _req("a", 4), _req("b", 4), _req("c", 4)
    sched = _scheduler(BlockManager(4, 4), 64, a, b, c)
    _run_step(sched)
    step = _run_step(sched)  # a takes the free block; b needs one: c, the newest, gives its block back
    assert step.preempted == (c,) and not step.failed
    assert _chunks(step) == [("a", 4, (7,)), ("b", 4, (7,))]
    assert sched.running == [a, b] and list(sched.waiting) == [c] and c.phase is Phase.WAITING


def test_the_newest_request_that_cannot_grow_preempts_itself_and_waits():
    # 3 blocks of 4: a's 3-token prompt grows inside its block; b's 8 tokens fill two, its 9th has no block.
    a, b = _req("a", 3), _req("b", 8)
    sched = _scheduler(BlockManager(3, 4), 64, a, b)
    _run_step(sched)
    step = _run_step(sched)
    assert step.preempted == (b,) and not step.failed
    assert _chunks(step) == [("a", 3, (7,))]
    assert list(sched.waiting) == [b] and b.phase is Phase.WAITING and b.seq_id not in sched.blocks


def test_a_failed_request_does_not_stop_the_running_ones_after_it():
    bad, good = _req("bad", 3), _req("good", 3)
    sched = _scheduler(BlockManager(16, 4), 64, bad, good)
    _run_step(sched)
    sched.blocks.free(bad.seq_id)  # its blocks vanish under it: extending it raises inside schedule()
    step = sched.schedule()
    assert [r for r, _ in step.failed] == [bad] and _chunks(step) == [("good", 3, (7,))]


def test_a_request_that_does_not_fit_waits_in_line_until_blocks_are_freed():
    # 4 blocks of 4: a's 12 tokens take three; b's 8 need two; c's 2 would fit but are behind b.
    a, b, c = _req("a", 12), _req("b", 8), _req("c", 2)
    sched = _scheduler(BlockManager(4, 4), 64, a)
    _run_step(sched)
    sched.add(b)
    sched.add(c)
    step = _run_step(sched)
    assert _chunks(step) == [("a", 12, (7,))] and not step.failed
    assert list(sched.waiting) == [b, c] and b.phase is Phase.WAITING
    sched.remove(a)
    assert _chunks(_run_step(sched)) == [("b", 0, tuple(range(1, 9))), ("c", 0, (1, 2))]


def test_a_request_whose_admission_fails_leaves_without_blocks_and_the_next_is_admitted():
    broken, good = _req("broken", 3), _req("good", 3)
    blocks = BlockManager(16, 4)
    blocks.allocate(broken.seq_id, 5)  # blocks left under its sequence id: allocating it again fails
    sched = _scheduler(blocks, 64, broken, good)
    step = sched.schedule()
    assert [r for r, _ in step.failed] == [broken] and isinstance(step.failed[0][1], ValueError)
    assert _chunks(step) == [("good", 0, (1, 2, 3))]
    assert broken.seq_id not in sched.blocks and broken.num_computed == 0 and not sched.waiting
    assert sched.blocks.num_free_blocks == 15


def test_without_prefix_caching_nothing_is_looked_up_or_counted():
    a, b = _req("a", 9), _req("b", 9)
    sched = _scheduler(BlockManager(16, 4), 64, a)
    _run_step(sched)
    sched.add(b)
    step = _run_step(sched)
    assert _chunks(step)[1] == ("b", 0, tuple(range(1, 10)))
    assert (step.prefix_queried_tokens, step.prefix_hit_tokens) == (0, 0)
    assert (a.cached_prompt_tokens, b.cached_prompt_tokens) == (0, 0)


def test_a_computed_prompt_is_mapped_by_later_requests_with_its_prefix_and_counted():
    a = _req("a", 10)  # two full blocks and two tokens
    sched = _scheduler(BlockManager(16, 4, prefix_caching=True), 64, a)
    first = _run_step(sched)
    assert (first.prefix_queried_tokens, first.prefix_hit_tokens, a.cached_prompt_tokens) == (10, 0, 0)
    same, longer = _req("same", 10), _req("longer", list(range(1, 9)) + [50, 51, 52])
    sched.add(same)
    sched.add(longer)
    step = _run_step(sched)
    # Both map a's two full blocks and compute the rest only.
    assert _chunks(step) == [("a", 10, (7,)), ("same", 8, (9, 10)), ("longer", 8, (50, 51, 52))]
    assert (step.prefix_queried_tokens, step.prefix_hit_tokens) == (21, 16)
    assert (same.cached_prompt_tokens, longer.cached_prompt_tokens) == (8, 8)
    assert same.phase is Phase.RUNNING and longer.phase is Phase.RUNNING
    a_blocks = sched.blocks.block_table(a.seq_id)
    assert sched.blocks.block_table(same.seq_id)[:2] == sched.blocks.block_table(longer.seq_id)[:2] == a_blocks[:2]


def test_a_cached_prefix_needs_free_blocks_only_for_the_rest():
    # 4 blocks of 4: a's 9-token prompt takes three (two full, cached); one is free, and b, sharing a's first
    # eight tokens, needs just one more.
    a = _req("a", 9)
    sched = _scheduler(BlockManager(4, 4, prefix_caching=True), 64, a)
    _run_step(sched)
    b = _req("b", list(range(1, 9)) + [99, 98])
    sched.add(b)
    step = _run_step(sched)
    assert _chunks(step) == [("a", 9, (7,)), ("b", 8, (99, 98))] and not step.failed
    assert sched.blocks.num_free_blocks == 0


def test_a_request_removed_while_its_forward_runs_registers_nothing():
    a = _req("a", 9)
    sched = _scheduler(BlockManager(16, 4, prefix_caching=True), 64, a)
    step = sched.schedule()
    sched.remove(a)  # finished or cancelled while the forward ran
    sched.commit(step)
    assert sched.blocks.num_cached_blocks == 0


def test_other_completions_wait_for_the_first_to_compute_the_prompt_and_then_map_it():
    group = _group("n", 10, 4)
    x, y = _req("x", 3), _req("y", 3)
    sched = _scheduler(BlockManager(32, 4, prefix_caching=True), 8, *group, x, y)
    assert _chunks(_run_step(sched)) == [("n0", 0, tuple(range(1, 9)))]
    # The first's last chunk; the others wait for it, and the requests behind them go ahead.
    step = _run_step(sched)
    assert _chunks(step) == [("n0", 8, (9, 10)), ("x", 0, (1, 2, 3)), ("y", 0, (1, 2, 3))]
    assert list(sched.waiting) == group[1:]
    # Its prompt computed, they map its two full blocks, each computing the rest (the last as much as the
    # budget leaves after three decodes and two chunks).
    step = _run_step(sched)
    assert _chunks(step)[3:] == [("n1", 8, (9, 10)), ("n2", 8, (9, 10)), ("n3", 8, (9,))]
    assert step.prefix_hit_tokens == 24 and not sched.waiting


def test_other_completions_compute_the_prompt_themselves_when_the_first_finished_before():
    leader, other = _group("n", 10, 2)
    sched = _scheduler(BlockManager(32, 4, prefix_caching=True), 64, leader, other)
    leader.phase = Phase.FINISHED  # cancelled before it ran
    sched.remove(leader)
    assert _chunks(_run_step(sched)) == [("n1", 0, tuple(range(1, 11)))]


def test_without_prefix_caching_completions_compute_the_prompt_together():
    sched = _scheduler(BlockManager(32, 4), 64, *_group("n", 5, 3))
    assert [(rid, start) for rid, start, _ in _chunks(_run_step(sched))] == [("n0", 0), ("n1", 0), ("n2", 0)]
