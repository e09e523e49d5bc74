"""A response's text split the way a chat client reads it: thinking, answer text and tool calls.

The model writes one token stream; a client wants three things out of it. A
request that starts inside a think block (its prompt ended with the
think-start token) writes thinking until the end-of-thinking token: those
tokens go to `reasoning_text`, the end token to neither channel, everything
after it to the answer. With tools, the answer's tool-call markup is cut out
of the text by the family's `ToolCallParser` and comes back as whole calls,
and as the calls' pieces (for clients that stream arguments) as they arrive.
Stop strings apply to the answer only: thinking about a stop string does not
end the response.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from inference_svc.engine.text_stream import TextStream
from inference_svc.types import ParsedToolCall, ToolCallDelta, ToolCallReader


@dataclass(frozen=True, slots=True)
class Piece:
    """What one push (or the finish) adds to each channel."""

    text: str = ""
    reasoning_text: str = ""
    tool_calls: tuple[ParsedToolCall, ...] = ()
    stopped: bool = False  # a stop string matched in the answer: the response is done
    tool_call_deltas: tuple[ToolCallDelta, ...] = ()

    def __add__(self, other: Piece) -> Piece:
        return Piece(self.text + other.text, self.reasoning_text + other.reasoning_text,
                     self.tool_calls + other.tool_calls, self.stopped or other.stopped,
                     self.tool_call_deltas + other.tool_call_deltas)


class ResponseText:
    """One response's text channels: push each step's token ids, send each returned piece."""

    def __init__(self, token_bytes: Sequence[bytes], skip_token_ids: Collection[int], stop: Sequence[str], *,
                 think_end_id: int | None = None, tool_parser: ToolCallReader | None = None,
                 include_stop: bool = False):
        self._answer = TextStream(token_bytes, skip_token_ids, stop, include_stop=include_stop)
        # None once thinking is over (or when the request never thinks).
        self._thinking = TextStream(token_bytes, skip_token_ids, ()) if think_end_id is not None else None
        self._think_end = think_end_id
        self._tools = tool_parser
        self.num_tool_calls = 0

    @property
    def thinking(self) -> bool:
        return self._thinking is not None

    @property
    def stopped(self) -> bool:
        return self._answer.stopped

    def push(self, token_ids: Sequence[int], *, match_stop: bool = True) -> Piece:
        """match_stop=False: no stop string may end in these tokens (min_tokens not reached yet)."""
        thought = ""
        if self._thinking is not None:
            if self._think_end not in token_ids:
                return Piece(reasoning_text=self._thinking.push(token_ids).text)
            k = list(token_ids).index(self._think_end)
            thought = self._thinking.push(token_ids[:k]).text + self._thinking.finish()
            self._thinking = None
            token_ids = token_ids[k + 1:]
        delta = self._answer.push(token_ids, match_stop=match_stop)
        return self._answer_piece(delta.text, thought, stopped=delta.stopped)

    def finish(self) -> Piece:
        """The rest of every channel at the end of generation (after a stop string: only the parser's rest)."""
        thought = ""
        if self._thinking is not None:
            thought = self._thinking.finish()
            self._thinking = None
        return self._answer_piece(self._answer.finish(), thought, stopped=False, final=True)

    def _answer_piece(self, text: str, thought: str, *, stopped: bool, final: bool = False) -> Piece:
        calls: tuple[ParsedToolCall, ...] = ()
        deltas: tuple[ToolCallDelta, ...] = ()
        if self._tools is not None:
            text, found = self._tools.push(text)
            calls = tuple(found)
            if final or stopped:
                rest, found = self._tools.finish()
                text += rest
                calls += tuple(found)
            deltas = tuple(self._tools.take_deltas())
            self.num_tool_calls += len(calls)
        return Piece(text, thought, calls, stopped, deltas)
