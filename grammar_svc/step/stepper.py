"""Applies one step message to a stream's sessions: the grammar service's hot path.

For each session, in message order: open, rollback, accept, jump-forward;
then every row that wants a mask is filled (in a loop; rows that were slow
last time on helper threads, see mask_filler.py) and encoded; then closes.
Failures are per session (a SessionOutcome with an error), never per step,
so one bad request cannot fail the batch: a row whose fill outlives
--max-row-fill-seconds fails its session and the step answers without it.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from enum import Enum
from typing import Sequence

from grammar_svc.compile.backend import GrammarBackend
from grammar_svc.step.mask_filler import MaskFiller
from grammar_svc.metrics import GrammarMetrics
from grammar_svc.step.sessions import StreamSessions
from shared.codec import EncodedMask, StreamMaskCache, assign_wire_forms
from shared.errors import InvalidRequestError, LimitExceededError


# Steps whose rows are expected to fill faster than this run on the calling (event loop) thread:
# the hop to a thread and back costs more than such a step's masks (docs/benchmarks.md, "Hand-timed figures
# behind code choices", "The grammar replica's step path").
INLINE_STEP_SECONDS = 1e-3


class Status(Enum):
    OK = 1
    TERMINATED = 2
    REJECTED = 3
    CLOSED = 4
    ERROR = 5


@dataclass(slots=True)
class SessionOp:
    session_id: int
    open_grammar_id: str | None = None
    terminate_without_stop_token: bool = False
    rollback_tokens: int = 0
    accept_token_ids: Sequence[int] = ()
    jump_forward: bool = False
    skip_mask: bool = False
    close: bool = False


@dataclass(slots=True)
class SessionOutcome:
    session_id: int
    status: Status = Status.OK
    accepted_count: int = 0
    mask: EncodedMask | None = None
    forced_text: str = ""
    forced_token_ids: list[int] = field(default_factory=list)
    # Mapped to a status code by shared.status when the response is built.
    error: Exception | None = None


@dataclass(slots=True)
class StepOutcome:
    results: list[SessionOutcome]
    server_seconds: float
    fill_seconds: float
    row_fill_seconds: list[float]


class Stepper:
    def __init__(self, *, backend: GrammarBackend, sessions: StreamSessions, filler: MaskFiller,
                 metrics: GrammarMetrics, max_tokens_per_step: int):
        self.backend = backend
        self.sessions = sessions
        self.filler = filler
        self.metrics = metrics
        self.max_tokens_per_step = max_tokens_per_step
        # Set from the stream's first request (StepRequest.mask_cache_slots).
        self.mask_cache: StreamMaskCache | None = None

    def enable_mask_cache(self, slots: int) -> None:
        if slots > 0 and self.mask_cache is None:
            self.mask_cache = StreamMaskCache(slots)

    def expected_fill_seconds(self, ops: Sequence[SessionOp]) -> float:
        """Sum of the last fill times of the sessions a step names (new sessions count
        as a typical row): what the step will cost, for choosing where to run it."""
        return self.sessions.expected_fill_seconds(op.session_id for op in ops)

    async def run(self, ops: Sequence[SessionOp], executor: Executor) -> StepOutcome:
        """Applies one step: a cheap one right here, an expensive one on `executor` (the event loop
        goes on serving other streams meanwhile)."""
        if self.expected_fill_seconds(ops) < INLINE_STEP_SECONDS:
            return self.step(ops)
        return await asyncio.get_running_loop().run_in_executor(executor, self.step, ops)

    def step(self, ops: Sequence[SessionOp]) -> StepOutcome:
        start = time.perf_counter()
        with self.sessions.lock:
            results, to_fill, to_close = self._advance(ops)
            fill_start = time.perf_counter()
            filled, late = self.filler.fill(to_fill, self.mask_cache)
            fill_seconds = time.perf_counter() - fill_start
            masks = assign_wire_forms(filled, self.mask_cache)
            for row in late:
                # That session's grammar alone: it fails, the step answers on time for the others.
                out = results[row.index]
                out.status = Status.ERROR
                out.error = LimitExceededError(
                    f"this grammar's token mask took longer than {self.filler.max_row_fill_seconds:g} s to "
                    "compute at this point of the output (--max-row-fill-seconds), so its session was closed; "
                    "simplify the constraint (long pattern or length-bounded strings in a large schema are "
                    "the usual cause)")
                self.metrics.session_events.labels("fill_timeout").inc()
                to_close.append(out.session_id)
            for sid in to_close:
                self.sessions.close(sid)
        for row, enc in zip(filled, masks):
            results[row.index].mask = enc
        return StepOutcome(results, time.perf_counter() - start, fill_seconds, [row.fill_seconds for row in filled])

    def observe(self, outcome: StepOutcome) -> None:
        """Records a step's metrics; called after its response is on its way."""
        m = self.metrics
        m.mask_fill_duration.observe_many(outcome.row_fill_seconds)
        by_encoding: dict[str, list[int]] = {}
        for r in outcome.results:
            if r.mask is not None:
                by_encoding.setdefault(r.mask.field, []).append(r.mask.wire_bytes)
        for field, sizes in by_encoding.items():
            m.mask_bytes.observe_many(sizes, field)
        m.step_duration.observe(outcome.server_seconds)
        m.step_sessions.observe(len(outcome.results))

    def _advance(self, ops: Sequence[SessionOp]):
        results: list[SessionOutcome] = []
        to_fill = []
        to_close: list[int] = []
        seen: set[int] = set()
        for index, op in enumerate(ops):
            out = SessionOutcome(op.session_id)
            results.append(out)
            opened = False
            try:
                if op.session_id in seen:
                    raise InvalidRequestError(f"session {op.session_id} appears twice in one step")
                seen.add(op.session_id)
                if len(op.accept_token_ids) > self.max_tokens_per_step:
                    raise InvalidRequestError(
                        f"{len(op.accept_token_ids)} tokens in one step exceed the limit of {self.max_tokens_per_step}"
                    )
                if op.open_grammar_id:
                    session = self.sessions.open(op.session_id, self.backend.lookup(op.open_grammar_id),
                                                 op.terminate_without_stop_token)
                    opened = True
                else:
                    session = self.sessions.get(op.session_id)
                # An ERROR result means nothing of the step was applied: check
                # the tokens before rolling back.
                session.check_tokens(op.accept_token_ids)
                if op.rollback_tokens:
                    session.rollback(op.rollback_tokens)
                out.accepted_count = session.accept(op.accept_token_ids)
                if out.accepted_count < len(op.accept_token_ids):
                    out.status = Status.REJECTED
                    self.metrics.session_events.labels("rejected").inc()
                elif op.jump_forward and not op.close and not session.is_terminated:
                    out.forced_text, out.forced_token_ids = session.jump_forward()
                    if out.forced_token_ids:
                        self.metrics.jump_forward_tokens.inc(len(out.forced_token_ids))
            except Exception as e:  # noqa: BLE001 - one session's failure must not fail the step
                if opened:
                    # The client sees an error, not an open session: do not keep it.
                    self.sessions.close(op.session_id)
                out.status = Status.ERROR
                out.error = e
                self.metrics.session_events.labels("error").inc()
                continue
            if op.close:
                to_close.append(op.session_id)
                if out.status is Status.OK:
                    out.status = Status.CLOSED
            elif out.status is Status.OK:
                if session.is_terminated:
                    out.status = Status.TERMINATED
                elif not op.skip_mask:
                    to_fill.append((index, session))
        return results, to_fill, to_close
