"""One generation request's state as the engine sees it, and what it streams back.

The token bookkeeping is one list and two counters, so that decodes, chunked
prefill, jump-forward runs and preemption by recompute are the same thing:
`all_ids` is prompt + output; the KV cache holds the first `num_computed` of
them; the next forward feeds the rest (or a chunk of it). What the grammar
has not been told yet is `grammar.pending_accept`.

Everything that tracks a request inside the engine (KV blocks, scheduler
entries, grammar sessions) is keyed by `seq_id`, an id the engine assigns; the
client's `request_id` is only for logs, so two requests that carry the same
one (a client retrying with its own id) never share state.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from dataclasses import dataclass, field

from inference_svc.grammar_session import GrammarSession
from inference_svc.sampling import RowSampler, SamplingOptions
from inference_svc.text_stream import TextStream

# Process-wide, so ids never repeat across engines in one process (tests run several).
_seq_ids = itertools.count(1)


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    STOP_STRING = "stop_string"
    CANCELLED = "cancelled"
    ERROR = "error"


class Phase(enum.Enum):
    COMPILING = "compiling"  # waiting for its grammar; never in a batch
    WAITING = "waiting"  # ready, not admitted (new or preempted)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    forced_tokens: int = 0


@dataclass
class Output:
    """One streamed piece: the tokens of a step and their text delta; the last one has finish_reason."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: BaseException | None = None  # set instead of finish_reason when the request failed


# Identity semantics: a request is itself, whatever its fields say (sets, `in`, remove).
@dataclass(eq=False)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    options: SamplingOptions
    sampler: RowSampler
    text: TextStream
    grammar: GrammarSession | None = None  # None: unconstrained
    arrival: float = field(default_factory=time.monotonic)
    seq_id: int = field(default_factory=lambda: next(_seq_ids))

    # Engine-owned state.
    phase: Phase = Phase.COMPILING
    all_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    forced_tokens: int = 0
    cancelled: bool = False
    admitted_at: float | None = None
    grammar_ready_at: float | None = None
    first_token_at: float | None = None
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)

    def __post_init__(self) -> None:
        if not self.all_ids:
            self.all_ids = list(self.prompt_ids)

    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.all_ids) - len(self.prompt_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.all_ids) - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.all_ids[len(self.prompt_ids):]

    def usage(self) -> Usage:
        return Usage(self.num_prompt, self.num_output, self.forced_tokens)
