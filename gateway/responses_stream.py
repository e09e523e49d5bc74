"""The streamed answer of `POST /v1/responses`: OpenAI's Responses events as named server-sent events.

Each event goes out as `event: <type>` and `data: <json>`, as OpenAI sends
them; the stream has no `[DONE]` line (the last event, response.completed or
response.incomplete, says it is over). A failure after the headers went out
ends it with an `error` event (its code, message, param and sequence
number) instead of chat's `{"error": ...}` chunk. Everything else (the
first response before the headers, the client going away) is EventStream's.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import ApiError
from gateway.exchange import EventStream
from gateway.translation.responses import ResponsesReply


class ResponsesEventStream(EventStream):
    reply: ResponsesReply

    def frame(self, event: dict[str, Any] | str) -> dict[str, Any]:
        assert isinstance(event, dict)
        body = f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
        return {"type": "http.response.body", "body": body.encode(), "more_body": True}

    def failure(self, error: ApiError) -> dict[str, Any]:
        return self.reply.error_event(error)

    def closing(self) -> list[str]:
        return []
