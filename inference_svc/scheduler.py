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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from inference_svc.model_runner import SequenceChunk, StepBatch
from inference_svc.paged_kv import BlockManager
from inference_svc.request import GenerationRequest, Phase


@dataclass(frozen=True)
class ScheduledChunk:
    request: GenerationRequest
    chunk: SequenceChunk


@dataclass(frozen=True)
class ScheduledStep:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[GenerationRequest, ...]

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
        req.phase = Phase.WAITING
        self.waiting.append(req)

    def remove(self, req: GenerationRequest) -> None:
        """Drops a finished or cancelled request and frees its KV blocks at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req.request_id)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[GenerationRequest] = []

        # Running requests, oldest first; a request that cannot grow preempts the newest.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_uncomputed, budget)
            if n <= 0:
                i += 1
                continue
            while not self.blocks.can_allocate(req.request_id, n) and self.running[-1] is not req:
                preempted.append(self._preempt(self.running[-1]))
            if not self.blocks.can_allocate(req.request_id, n):
                preempted.append(self._preempt(req))
                continue
            self.blocks.extend(req.request_id, n)
            chunks.append(self._chunk(req, n))
            budget -= n
            i += 1

        # Then admissions, in arrival order (preempted requests went back to the front).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            n = min(req.num_uncomputed, budget)
            if not self.blocks.can_allocate(None, n):
                break
            self.waiting.popleft()
            self.blocks.allocate(req.request_id, n)
            req.phase = Phase.RUNNING
            self.running.append(req)
            chunks.append(self._chunk(req, n))
            budget -= n
        return ScheduledStep(tuple(chunks), tuple(preempted))

    def commit(self, step: ScheduledStep) -> None:
        """Marks the step's tokens as being in the KV cache (after its forward ran)."""
        for s in step.chunks:
            s.request.num_computed += len(s.chunk.token_ids)

    def _chunk(self, req: GenerationRequest, n: int) -> ScheduledChunk:
        start = req.num_computed
        ids = tuple(req.all_ids[start:start + n])
        return ScheduledChunk(req, SequenceChunk(req.request_id, ids, start, needs_logits=start + n == len(req.all_ids)))

    def _preempt(self, req: GenerationRequest) -> GenerationRequest:
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.num_computed = 0
        req.phase = Phase.WAITING
        self.waiting.appendleft(req)
        return req
