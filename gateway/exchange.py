"""One completion request's life: the Generate call, collected or streamed, and the client going away.

Whichever way a request ends, its gRPC call ends with it: a client that
disconnects while the answer is collected, while a stream waits for its first
token or while it streams cancels the call (the inference service frees the
request's KV blocks and grammar session at its next step). A stream sends
its headers only once the first response has arrived, so a request the
inference service refuses (a bad schema, a full queue) still gets its real
HTTP status; a failure after that ends the stream with an error event in
OpenAI's shape, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc
from starlette.types import Receive, Scope, Send

from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics, status_class
from gateway.translation.response import ChatReply, CompletionReply
from shared import errors
from shared.gen.inference.v1 import inference_service_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")
Reply = ChatReply | CompletionReply
# The status a request is counted with when its client went away (nginx's "client closed request").
CLIENT_GONE = 499


class ClientGone(Exception):
    """The client disconnected before its answer was complete."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """work's result, unless the client disconnects first: then work is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # ours: the server is shutting down; nothing may outlive the request
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass  # ours: the cancel just asked for
    except Exception:  # noqa: BLE001 - the work failed as it was stopped; its client is gone, nobody to tell
        log.debug("work failed after its client left", exc_info=True)
    raise ClientGone()


class Record:
    """One API request in the metrics: in flight from construction to done(status)."""

    def __init__(self, metrics: GatewayMetrics, route: str):
        self.metrics = metrics
        self.route = route
        self.started = time.monotonic()
        self._done = False
        metrics.in_flight.labels(route).inc()

    def first_token(self) -> None:
        self.metrics.ttft.labels(self.route).observe(time.monotonic() - self.started)

    def done(self, status: int) -> None:
        if self._done:
            return
        self._done = True
        m = self.metrics
        m.in_flight.labels(self.route).dec()
        m.duration.labels(self.route).observe(time.monotonic() - self.started)
        m.requests.labels(self.route, status_class(status)).inc()
        if status == CLIENT_GONE:
            m.disconnects.labels(self.route).inc()


async def read(call: grpc.aio.UnaryStreamCall) -> pb.GenerateResponse:
    """The call's next response; a stream that ends without a finish reason is the upstream's fault."""
    resp = await call.read()
    if resp is grpc.aio.EOF:
        raise errors.UnavailableError("The inference service ended the response stream without finishing it: "
                                      "retry the request.")
    return resp


async def collect(call: grpc.aio.UnaryStreamCall, reply: Reply) -> dict[str, Any]:
    while not reply.add(await read(call)):
        pass
    return reply.result()


def sse(event: dict[str, Any] | str) -> dict[str, Any]:
    data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False)
    return {"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True}


class EventStream:
    """The ASGI response of a streamed completion: server-sent events, OpenAI's chunks, then [DONE]."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, reply: Reply, first: pb.GenerateResponse, record: Record,
                 to_api_error: Callable[[BaseException], ApiError], headers: dict[str, str]):
        self.call = call
        self.reply = reply
        self.first = first
        self.record = record
        self.to_api_error = to_api_error
        self.headers = [(k.encode(), v.encode()) for k, v in
                        {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                         "x-accel-buffering": "no", **headers}.items()]
        self.status = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            await until_disconnect(receive, self._pump(send))
        except (ClientGone, OSError):
            # The client's: it closed the connection (OSError: while we were writing to it).
            self.status = CLIENT_GONE
        finally:
            self.call.cancel()
            self.record.done(self.status)

    # The wire form of the events: OpenAI's chat and completion streams; /v1/responses has its own (a subclass).
    def frame(self, event: dict[str, Any] | str) -> dict[str, Any]:
        return sse(event)

    def failure(self, error: ApiError) -> dict[str, Any]:
        return error.body()

    def closing(self) -> list[str]:
        return ["[DONE]"]

    async def _pump(self, send: Send) -> None:
        resp, timed = self.first, False
        try:
            while True:
                for chunk in self.reply.chunks(resp):
                    await send(self.frame(chunk))
                if resp.token_ids and not timed:
                    timed = True
                    self.record.first_token()
                if self.reply.done:
                    break
                resp = await read(self.call)
        except OSError:
            raise  # the client went away while we wrote: __call__ counts it
        except Exception as e:  # noqa: BLE001 - the upstream's or ours: ends the stream with an error event
            error = self.to_api_error(e)
            self.status = error.status
            await send(self.frame(self.failure(error)))
        for event in self.closing():
            await send(self.frame(event))
        await send({"type": "http.response.body", "body": b"", "more_body": False})
