"""One request body, from the socket to a Translated request, within the gateway's bounds.

A body is read up to --max-body-bytes (413 beyond), and the bodies being
read or parsed at once hold at most --max-body-bytes-in-flight between them
(503 beyond: overloaded now, so the SDKs retry). Parsing and translation run
in one call on a worker thread, at most PARSE_SLOTS at a time: the parsed
JSON (unknown fields and all) lives only inside that call, and what comes
out is the GenerateRequest and how to shape its answer. json.loads does not
let go of the GIL while it runs, so the thread does not keep the event loop
going during a parse; body.check_shape's limits are what keep each parse
short (docs/benchmarks.md, "Hostile input at the gateway").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request

from gateway.body import Fields, parse_object
from gateway.errors import ApiError, InvalidParameterError
from gateway.translation.request import Translated

# (body, served model id, request id) -> a Translated completion request, or another call's request message.
Translate = Callable[[Fields, str, str], Translated | Any]
# Parses at a time: more would not run sooner (the GIL), only hold more parsed bodies in memory.
PARSE_SLOTS = 2


class Intake:
    """Build it inside the running event loop."""

    def __init__(self, max_body_bytes: int, max_body_bytes_in_flight: int):
        self.max_body_bytes = max_body_bytes
        self.max_in_flight = max_body_bytes_in_flight
        self.in_flight = 0
        self._slots = asyncio.Semaphore(PARSE_SLOTS)

    async def translated(self, request: Request, translate: Translate, served_model: str,
                         request_id: str) -> Translated:
        """The request's body as `translate` makes it; raises ApiError or InvalidParameterError (the client's)."""
        length = request.headers.get("content-length", "")
        if length.isdigit():
            self._check_size(int(length))
        async with self._reserved() as reserve:
            parts, size = [], 0
            async for part in request.stream():
                size += len(part)
                self._check_size(size)
                reserve(size)
                parts.append(part)
            raw = b"".join(parts)
            del parts
            async with self._slots:
                return await asyncio.to_thread(translate_body, raw, translate, served_model, request_id)

    def _check_size(self, size: int) -> None:
        if size > self.max_body_bytes:
            raise ApiError(413, f"The request body is larger than {self.max_body_bytes} bytes.",
                           "invalid_request_error", None, "request_too_large")

    @contextlib.asynccontextmanager
    async def _reserved(self) -> AsyncIterator[Callable[[int], None]]:
        """A reservation of in-flight body bytes, grown to each size received (not the size a client declares, so
        a slow client holds only what it has sent), and given back at the end."""
        held = 0

        def reserve(size: int) -> None:
            nonlocal held
            if self.in_flight + size - held > self.max_in_flight:
                raise ApiError(503, "The gateway is reading too many request bodies at once; retry shortly.",
                               "service_unavailable_error", None, "overloaded")
            self.in_flight += size - held
            held = size

        try:
            yield reserve
        finally:
            self.in_flight -= held


def translate_body(raw: bytes, translate: Translate, served_model: str, request_id: str) -> Translated:
    """A whole body parsed and translated; raises what the error table answers with a 4xx (the client's)."""
    try:
        return translate(parse_object(raw), served_model, request_id)
    except UnicodeEncodeError:  # the client's: protobuf refuses a string that is not valid Unicode
        raise InvalidParameterError(None, "The request body holds a string that is not valid Unicode (an unpaired "
                                          "UTF-16 surrogate escape such as \\ud800).") from None
