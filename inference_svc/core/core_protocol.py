"""The frames between the API server and its engine core process (`--engine-process on`).

One Unix socket pair, one frame per message: a 4-byte big-endian length,
then a pickle. Both ends are this same program at the same version (the API
server starts the core as its own child), so pickle carries the engine's own
dataclasses (prompts, sampling options, outputs) without a schema of its
own. A frame is a tuple whose first item says what it is:

    API server -> core                   core -> API server
    (START, config, rank, source, s)     (READY, ServedModel, metrics port)
    (SUBMIT, key, EngineSubmit)          (START_FAILED, message)
    (CANCEL, key)                        (SUBMITTED, key, error or None)
    (DRAIN, grace seconds)               (OUTPUTS, [(key, Output, warnings or None), ...])
    (CLOSE,)                             (DRAINED,)
                                         (FATAL, message)

`s` is how long the core waits for a grammar replica before it gives up;
`key` is the API server's number for a request. OUTPUTS batches every output
the core made since its last frame: one frame per step, not one per request,
is what keeps the core's event loop free of the clients' streams.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass

from inference_svc.engine.engine import Prompt
from inference_svc.engine.sampling import SamplingOptions
from inference_svc.types import Constraint, ToolCallReader

START, SUBMIT, CANCEL, DRAIN, CLOSE = "start", "submit", "cancel", "drain", "close"
READY, START_FAILED, SUBMITTED = "ready", "start_failed", "submitted"
OUTPUTS, DRAINED, FATAL = "outputs", "drained", "fatal"

_LENGTH = struct.Struct("!I")
# Far above any real frame (a step's outputs are kilobytes; a prompt is capped by --max-prompt-bytes).
MAX_FRAME_BYTES = 1 << 30


class ProtocolError(ConnectionError):
    """The other end sent something that is not a frame of this protocol."""


@dataclass(frozen=True, kw_only=True)
class EngineSubmit:
    """Engine.submit's arguments, as the API server's EngineClient received them."""

    prompt: Prompt
    options: SamplingOptions
    constraint: Constraint | None
    jump_forward: bool
    request_id: str
    reasoning: bool | None
    max_thinking_tokens: int
    tool_parser: ToolCallReader | None
    end_client: str


def encode(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def send(writer: asyncio.StreamWriter, message: tuple) -> None:
    """Queues one frame on the socket (written as the event loop gets to it; never blocks)."""
    writer.write(encode(message))


async def receive(reader: asyncio.StreamReader) -> tuple | None:
    """The next frame, or None when the other end closed the socket."""
    try:
        header = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ProtocolError("the socket closed inside a frame header") from None
        return None
    (length,) = _LENGTH.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {length} bytes announced (at most {MAX_FRAME_BYTES})")
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ProtocolError("the socket closed inside a frame") from None
    message = pickle.loads(body)
    if not isinstance(message, tuple) or not message:
        raise ProtocolError(f"not a frame of this protocol: {type(message).__name__}")
    return message
