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

from inference_svc.engine.response_text import ResponseText
from inference_svc.engine.sampling import RowSampler, SamplingOptions, TokenLogprob
from inference_svc.grammar.grammar_link import GrammarLink
from inference_svc.types import ParsedToolCall, SchemaCheck, SchemaWarning, ToolCallDelta

# Process-wide, so ids never repeat across engines in one process (tests run several).
_seq_ids = itertools.count(1)


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    STOP_STRING = "stop_string"
    CANCELLED = "cancelled"
    ERROR = "error"
    TOOL_CALLS = "tool_calls"


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
    reasoning_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache when the request was first admitted.
    cached_prompt_tokens: int = 0


@dataclass
class Output:
    """One streamed piece: the tokens of a step and their text delta; the last one has finish_reason."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: BaseException | None = None  # set instead of finish_reason when the request failed
    reasoning_text: str = ""
    tool_calls: tuple[ParsedToolCall, ...] = ()
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for logprobs
    # The last output of a json_schema request whose document finished: whether it validates.
    schema_check: SchemaCheck | None = None
    # Which of the request's n completions this output belongs to (0 .. n-1).
    index: int = 0
    # The last output of the client's stream: of its last completion to finish, or an error.
    ends_stream: bool = False
    tool_call_deltas: tuple[ToolCallDelta, ...] = ()  # the tool calls' pieces as their text arrived


@dataclass
class Thinking:
    """A request that starts inside a think block: unconstrained until the end-of-thinking token.

    Its grammar session (if any) opens only after that token, and is told only
    the answer's tokens; `budget` thinking tokens (0: no budget) make the
    engine append the end token itself.
    """

    end_id: int
    budget: int = 0
    tokens: int = 0  # thinking tokens so far, the end token excluded
    done: bool = False

    @property
    def answer_start(self) -> int:
        """Index of the answer's first token among the output tokens (once done)."""
        return self.tokens + 1 if self.done else 0

    @property
    def budget_spent(self) -> bool:
        return not self.done and 0 < self.budget <= self.tokens


# Identity semantics: a request is itself, whatever its fields say (sets, `in`, remove).
@dataclass(eq=False)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    options: SamplingOptions
    sampler: RowSampler
    text: ResponseText
    grammar: GrammarLink | None = None  # None: unconstrained
    thinking: Thinking | None = None  # None: the request does not think (or the model cannot)
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
    # Hashes of all_ids' full KV blocks, extended as it grows (paged_kv.chain_block_hashes).
    block_hashes: list[bytes] = field(default_factory=list)
    # Prompt tokens found in the prefix cache at the first admission (None: not admitted yet).
    cached_prompt_tokens: int | None = None
    prefilled: bool = False  # its prompt has been computed (its full blocks are cached, with prefix caching)

    # The completions of one request with n > 1: the first (index 0) leads; every completion's outputs go
    # to the leader's stream, and the stream ends when all of them have finished (or one failed).
    index: int = 0
    leader: GenerationRequest | None = None
    siblings: list[GenerationRequest] = field(default_factory=list)  # the leader's: the other completions
    open_completions: int = 1  # the leader's: completions not finished yet

    def __post_init__(self) -> None:
        if not self.all_ids:
            self.all_ids = list(self.prompt_ids)

    @property
    def constrained(self) -> bool:
        return self.grammar is not None

    @property
    def warnings(self) -> tuple[SchemaWarning, ...]:
        """What the grammar does not enforce of the request's schema (known once it has compiled)."""
        return self.grammar.warnings if self.grammar is not None else ()

    @property
    def grammar_active(self) -> bool:
        """Constrained, and past any thinking: the grammar masks this request's next token."""
        return self.grammar is not None and (self.thinking is None or self.thinking.done)

    @property
    def answer_ids(self) -> list[int]:
        """The output tokens after thinking: what the grammar has seen."""
        start = self.thinking.answer_start if self.thinking is not None else 0
        return self.output_ids[start:]

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

    @property
    def group(self) -> list[GenerationRequest]:
        """The completions of the request this one belongs to (itself alone when n is 1)."""
        leader = self.leader or self
        return [leader, *leader.siblings]

    def put_output(self, output: Output) -> None:
        """Sends an output to the client's stream, labelled with this completion's index; the output that
        ends the stream (the last completion's last one, or any error) says so."""
        head = self.leader or self
        output.index = self.index
        if output.finish_reason is not None or output.error is not None:
            head.open_completions -= 1
            output.ends_stream = output.error is not None or head.open_completions <= 0
        head.outputs.put_nowait(output)

    def usage(self) -> Usage:
        reasoning = 0 if self.thinking is None else self.thinking.tokens + int(self.thinking.done)
        return Usage(self.num_prompt, self.num_output, self.forced_tokens, reasoning, self.cached_prompt_tokens or 0)
