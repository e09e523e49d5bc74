"""The scheduler alone (no model, no server): admission, chunked prefill, KV reservation, preemption."""

from __future__ import annotations

import pytest

from inference_svc.model.paged_kv import BlockManager
from inference_svc.engine.request import GenerationRequest, Phase
from inference_svc.engine.sampling import RowSampler, SamplingOptions
from inference_svc.engine.scheduler import Scheduler
from inference_svc.engine.text_stream import TextStream


def _req(rid: str, prompt: int | list[int]) -> GenerationRequest:
    """A request whose prompt is `prompt`, or 1 .. prompt when it is a length."""
    opts = SamplingOptions.validated(max_tokens=8, temperature=0.0, top_p=0.0, top_k=0, seed=None, stop=(),
                                     ignore_eos=False, default_max_tokens=8, max_max_tokens=4096)
    prompt_ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    return GenerationRequest(rid, prompt_ids, opts, RowSampler(opts, "cpu"), TextStream([b"x"] * 64, (), ()))


def _run_step(sched: Scheduler, sampled_token: int = 7):
    """Schedules, pretends the forward ran, and appends a sampled token to rows with logits."""
    step = sched.schedule()
    sched.commit(step)
    for req in step.sampled:
        req.all_ids.append(sampled_token)
    return step


def test_chunked_prefill_then_decode():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=6)
    a = _req("a", 10)
    sched.add(a)
    s1 = _run_step(sched)
    assert [(c.chunk.start_pos, len(c.chunk.token_ids), c.chunk.needs_logits) for c in s1.chunks] == [(0, 6, False)]
    s2 = _run_step(sched)
    assert [(c.chunk.start_pos, len(c.chunk.token_ids), c.chunk.needs_logits) for c in s2.chunks] == [(6, 4, True)]
    s3 = _run_step(sched)
    assert [(c.chunk.start_pos, c.chunk.token_ids) for c in s3.chunks] == [(10, (7,))]
    assert sched.blocks.num_tokens(a.seq_id) == 11


def test_running_requests_go_first_and_admissions_fill_the_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a, b, c = _req("a", 3), _req("b", 5), _req("c", 5)
    sched.add(a)
    _run_step(sched)
    sched.add(b)
    sched.add(c)
    step = _run_step(sched)
    # a decodes (1 token), b is admitted whole (5), c gets the 2 tokens left as a first chunk.
    assert [(s.request.request_id, len(s.chunk.token_ids), s.chunk.needs_logits) for s in step.chunks] == [
        ("a", 1, True), ("b", 5, True), ("c", 2, False)]


def test_batch_size_limit():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    reqs = [_req(f"r{i}", 2) for i in range(3)]
    for r in reqs:
        sched.add(r)
    step = _run_step(sched)
    assert [s.request.request_id for s in step.chunks] == ["r0", "r1"]
    assert reqs[2].phase is Phase.WAITING


def test_full_cache_preempts_the_newest_and_readmits_it_with_its_tokens():
    # 4 blocks of 4 tokens: two 7-token prompts fill 2 blocks each; the 9th token of either needs a fifth.
    sched = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b = _req("a", 7), _req("b", 7)
    sched.add(a)
    sched.add(b)
    _run_step(sched)  # both prefilled, 8 tokens each now (7 + sampled)
    step = _run_step(sched)  # both feed their 8th token: fits exactly
    assert len(step.chunks) == 2
    step = _run_step(sched)  # a's 9th token needs a block: b, the newest, is preempted
    assert step.preempted == (b,)
    assert [s.request.request_id for s in step.chunks] == ["a"]
    assert b.phase is Phase.WAITING and b.num_computed == 0 and "b" not in sched.blocks
    assert list(sched.waiting) == [b]
    sched.remove(a)  # a finishes: its blocks come back and b recomputes all its tokens at once
    step = _run_step(sched)
    assert [(s.request.request_id, s.chunk.start_pos, len(s.chunk.token_ids)) for s in step.chunks] == [("b", 0, 9)]


def test_remove_frees_blocks_at_once():
    blocks = BlockManager(8, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    a = _req("a", 10)
    sched.add(a)
    _run_step(sched)
    assert blocks.num_free_blocks == 5
    sched.remove(a)
    assert blocks.num_free_blocks == 8 and not sched.has_work()


@pytest.mark.parametrize("prompt_len", [pytest.param(1, id="one-token"), pytest.param(16, id="block-multiple")])
def test_edge_prompt_lengths(prompt_len):
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=16)
    a = _req("a", prompt_len)
    sched.add(a)
    step = _run_step(sched)
    assert step.chunks[0].chunk.needs_logits and len(step.chunks[0].chunk.token_ids) == prompt_len


def test_same_client_id_twice_gets_two_sequences():
    """A client retrying with its own request_id: each request owns its KV blocks (keyed by seq_id)."""
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    first, second = _req("retry-me", 6), _req("retry-me", 6)
    sched.add(first)
    sched.add(second)
    step = _run_step(sched)
    assert {s.request.seq_id for s in step.chunks} == {first.seq_id, second.seq_id}
    assert first.seq_id != second.seq_id
    sched.remove(first)
    assert second.seq_id in blocks and first.seq_id not in blocks
    assert blocks.num_tokens(second.seq_id) == 6
    assert [s.request for s in _run_step(sched).chunks] == [second]


def test_a_request_whose_bookkeeping_breaks_fails_alone():
    blocks = BlockManager(16, 4)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    good, bad = _req("good", 3), _req("bad", 3)
    sched.add(good)
    sched.add(bad)
    _run_step(sched)
    blocks.free(bad.seq_id)  # its blocks vanish under it: extending it now raises inside schedule()
    step = sched.schedule()
    assert [s.request for s in step.chunks] == [good]
    assert [r for r, _ in step.failed] == [bad] and isinstance(step.failed[0][1], KeyError)
    assert bad not in sched.running and good in sched.running


def test_a_finished_request_is_never_readmitted():
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a = _req("a", 3)
    a.phase = Phase.FINISHED
    with pytest.raises(ValueError, match="finished"):
        sched.add(a)
    assert not sched.has_work()
