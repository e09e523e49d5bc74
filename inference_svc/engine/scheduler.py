"""Continuous-batching scheduler: which requests run in the next step, and which tokens each feeds.

Every step: running requests first (one decode token, or a jump-forward run,
or the next prefill chunk), then waiting requests in arrival order while the
token budget, the batch size and the KV cache allow. KV slots are reserved
here, before the step, in the runner's `BlockManager`; when a running request
cannot grow, the most recently admitted one is preempted (its blocks freed;
it recomputes its tokens when readmitted, and its grammar session is kept,
since a matcher's state does not depend on the KV cache).

Requests whose grammar is still compiling are never here: the engine adds
them to `waiting` only once it is ready, so no step waits on a compile.

With prefix caching (paged_kv.py) an admitted request maps the cached
blocks of its longest cached prefix and starts computing after them
(`num_computed`), and a step's full blocks are registered once its forward
has written them (`commit`). The other completions of an `n` > 1 request wait
until the first has computed its prompt, then map its blocks: the prompt is
computed once.

A request whose bookkeeping fails while it is scheduled leaves the scheduler
(blocks freed) and is reported in `ScheduledStep.failed`: its failure is its
own, the rest of the step goes on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inference_svc.model.model_runner import SequenceChunk, StepBatch
from inference_svc.model.paged_kv import BlockManager, chain_block_hashes
from inference_svc.engine.request import GenerationRequest, Phase


@dataclass(frozen=True)
class ScheduledChunk:
    request: GenerationRequest
    chunk: SequenceChunk


@dataclass(frozen=True)
class ScheduledStep:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[GenerationRequest, ...]
    # Requests that could not be scheduled, with why; they are no longer in the scheduler.
    failed: tuple[tuple[GenerationRequest, Exception], ...] = ()
    # Tokens of the admitted requests looked up in the prefix cache, and how many of them were there.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def batch(self) -> StepBatch:
        return StepBatch.of([s.chunk for s in self.chunks])

    @property
    def sampled(self) -> list[GenerationRequest]:
        """Requests that get a logits row this step, in row order."""
        return [s.request for s in self.chunks if s.chunk.needs_logits]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[GenerationRequest] = []

    def add(self, req: GenerationRequest) -> None:
        if req.phase is Phase.FINISHED:
            # A request finished by an error handler (or cancelled) must never run again.
            raise ValueError(f"request {req.request_id!r} (seq {req.seq_id}) is finished; it cannot be re-admitted")
        req.phase = Phase.WAITING
        self.waiting.append(req)

    def remove(self, req: GenerationRequest) -> None:
        """Drops a finished or cancelled request and frees its KV blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req.seq_id)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[GenerationRequest] = []
        failed: list[tuple[GenerationRequest, Exception]] = []

        # Running requests, oldest first; a request that cannot grow preempts the newest.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            try:
                n = min(req.num_uncomputed, budget)
                if n <= 0:
                    i += 1
                    continue
                while not self.blocks.can_allocate(req.seq_id, n) and self.running[-1] is not req:
                    preempted.append(self._preempt(self.running[-1]))
                if not self.blocks.can_allocate(req.seq_id, n):
                    preempted.append(self._preempt(req))
                    continue
                self.blocks.extend(req.seq_id, n)
                chunks.append(self._chunk(req, n))
            except Exception as e:  # noqa: BLE001 - this request's bookkeeping is broken: it fails alone
                failed.append((req, e))
                self.remove(req)
                continue
            budget -= n
            i += 1

        # Then admissions, in arrival order (preempted requests went back to the front).
        queried = hit = 0
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[i]
            if self._held_back(req):
                i += 1
                continue
            cached = self._cached_prefix(req)
            num_cached = len(cached) * self.blocks.block_size
            n = min(len(req.all_ids) - num_cached, budget)
            if not self.blocks.can_allocate(None, num_cached + n, cached):
                break
            del self.waiting[i]
            try:
                self.blocks.allocate(req.seq_id, num_cached + n, cached)
                req.num_computed = num_cached
                chunk = self._chunk(req, n)
            except Exception as e:  # noqa: BLE001 - this request's bookkeeping is broken: it fails alone
                failed.append((req, e))
                self.blocks.free(req.seq_id)
                req.num_computed = 0
                continue
            if self.blocks.prefix_caching:
                queried += len(req.all_ids)
                hit += num_cached
            if req.cached_prompt_tokens is None:
                req.cached_prompt_tokens = min(num_cached, req.num_prompt)
            req.phase = Phase.RUNNING
            self.running.append(req)
            chunks.append(chunk)
            budget -= n
        return ScheduledStep(tuple(chunks), tuple(preempted), tuple(failed), queried, hit)

    def _held_back(self, req: GenerationRequest) -> bool:
        """A later completion of an n > 1 request whose first has not computed the prompt yet (with prefix
        caching: it will map those blocks rather than compute the prompt again)."""
        leader = req.leader
        return (self.blocks.prefix_caching and leader is not None and not leader.prefilled
                and leader.phase in (Phase.WAITING, Phase.RUNNING))

    def _cached_prefix(self, req: GenerationRequest) -> list[int]:
        if not self.blocks.prefix_caching:
            return []
        chain_block_hashes(req.all_ids, req.block_hashes, self.blocks.block_size)
        return self.blocks.cached_prefix(req.block_hashes, len(req.all_ids))

    def commit(self, step: ScheduledStep) -> None:
        """Marks the step's tokens as being in the KV cache (after its forward ran): the full blocks among
        them join the prefix cache."""
        caching, bs = self.blocks.prefix_caching, self.blocks.block_size
        for s in step.chunks:
            req = s.request
            before = req.num_computed
            req.num_computed += len(s.chunk.token_ids)
            if req.num_computed >= req.num_prompt:
                req.prefilled = True
            # Only a step that filled a block has one to register (most decode steps do not): no hashing then.
            if caching and req.num_computed // bs > before // bs and req.seq_id in self.blocks:
                chain_block_hashes(req.all_ids, req.block_hashes, bs)
                self.blocks.cache_computed(req.seq_id, req.block_hashes, req.num_computed)

    def _chunk(self, req: GenerationRequest, n: int) -> ScheduledChunk:
        start = req.num_computed
        ids = tuple(req.all_ids[start:start + n])
        return ScheduledChunk(req, SequenceChunk(req.seq_id, ids, start, needs_logits=start + n == len(req.all_ids)))

    def _preempt(self, req: GenerationRequest) -> GenerationRequest:
        self.running.remove(req)
        self.blocks.free(req.seq_id)
        req.num_computed = 0
        req.phase = Phase.WAITING
        self.waiting.appendleft(req)
        return req
