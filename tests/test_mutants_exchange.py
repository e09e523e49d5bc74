"""gateway/exchange.py in process: a request's life between the client and its gRPC call, without a server.

The gateway's own tests (tests/test_gateway_sse.py, tests/test_gateway_disconnect.py) drive the exchange
through a real gateway and inference service; mutation testing needs a selection that runs in a moment,
so here the exchange's functions and classes run on real replies (ChatReply, CompletionReply), real
metrics (GatewayMetrics on its own registry), real gRPC errors and ASGI receive/send callables. The
upstream call is `Upstream`: the two methods of a grpc.aio call the exchange uses (read, cancel) over a
script of responses and failures (a real call needs a server and a channel, which mutmut's forked
workers cannot share). Checked: what a disconnect cancels and raises, the metrics a request leaves
(in flight, duration, status class, disconnects, time to first token, once each), the server-sent events'
bytes, the stream's error event and [DONE] after a failure past its headers, and the stream's end.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from gateway import errors as api_errors
from gateway.exchange import (
    CLIENT_GONE,
    ClientGone,
    EventStream,
    Record,
    collect,
    read,
    sse,
    until_disconnect,
)
from gateway.metrics import GatewayMetrics
from gateway.translation.request import Translated
from gateway.translation.response import ChatReply, CompletionReply
from shared import errors
from shared.gen.inference.v1 import inference_service_pb2 as pb

ROUTE = "/v1/chat/completions"
HANG = object()  # in an Upstream script: a read that never answers


class Upstream:
    """A grpc.aio unary-stream call as the exchange sees it: read() answers the script in turn (an exception
    is raised, HANG never answers, past the end grpc.aio.EOF), cancel() is counted."""

    def __init__(self, *script):
        self.script = list(script)
        self.cancels = 0
        self.reads = 0

    async def read(self):
        self.reads += 1
        await asyncio.sleep(0)
        item = self.script.pop(0) if self.script else grpc.aio.EOF
        if item is HANG:
            await asyncio.Event().wait()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        self.cancels += 1
        return True


class Client:
    """The ASGI side: receive() answers the events put in `inbox` (waiting for the next), send() keeps what
    is sent; `fail_on` makes the send of that message number raise OSError (the connection is gone)."""

    def __init__(self, *events, fail_on: int | None = None):
        self.inbox: asyncio.Queue = asyncio.Queue()
        for e in events:
            self.inbox.put_nowait(e)
        self.sent: list[dict] = []
        self.fail_on = fail_on
        self.receives = 0

    async def receive(self) -> dict:
        self.receives += 1
        return await self.inbox.get()

    async def send(self, message: dict) -> None:
        if self.fail_on is not None and len(self.sent) == self.fail_on:
            raise OSError("connection reset by peer")
        self.sent.append(message)

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


def run(coro):
    async def guarded():
        # The guard turns a hang (a mutant waiting for an event that never comes) into a failure; in this task
        # (asyncio.timeout), so that the tests see every task there is.
        async with asyncio.timeout(10):
            return await coro
    return asyncio.run(guarded())


def sample(metrics: GatewayMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def counts(metrics: GatewayMetrics, route: str = ROUTE) -> dict[str, float]:
    return {"in_flight": sample(metrics, "gateway_requests_in_flight", route=route),
            "durations": sample(metrics, "gateway_request_duration_seconds_count", route=route),
            "2xx": sample(metrics, "gateway_requests_total", route=route, status_class="2xx"),
            "4xx": sample(metrics, "gateway_requests_total", route=route, status_class="4xx"),
            "5xx": sample(metrics, "gateway_requests_total", route=route, status_class="5xx"),
            "disconnects": sample(metrics, "gateway_client_disconnects_total", route=route),
            "ttft": sample(metrics, "gateway_time_to_first_token_seconds_count", route=route)}


def translated(n: int = 1, include_usage: bool = False) -> Translated:
    req = pb.GenerateRequest()
    req.sampling.n = n
    return Translated(grpc_request=req, model="m", stream=True, include_usage=include_usage, top_logprobs=None)


def token(text: str, index: int = 0, finish: int = pb.FINISH_REASON_UNSPECIFIED, tokens=(7,)) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(text=text, index=index, finish_reason=finish, token_ids=list(tokens))
    if finish:
        resp.usage.prompt_tokens, resp.usage.completion_tokens = 3, 2
    return resp


# ---------------------------------------------------------------- until_disconnect


def test_work_that_ends_first_is_the_answer_and_nothing_outlives_it():
    async def go():
        client = Client()
        result = await until_disconnect(client.receive, asyncio.sleep(0, result="done"))
        await asyncio.sleep(0)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return result, others
    result, others = run(go())
    assert result == "done" and others == []  # the disconnect watch was cancelled


def test_a_disconnect_cancels_the_work_and_raises_client_gone():
    async def go():
        client = Client({"type": "http.request", "body": b""}, {"type": "http.disconnect"})
        cancelled = asyncio.Event()

        async def work():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
        with pytest.raises(ClientGone):
            await until_disconnect(client.receive, work())
        return cancelled.is_set(), client.receives
    assert run(go()) == (True, 2)  # other events are read past, up to the disconnect


def test_work_that_fails_as_it_is_stopped_still_raises_client_gone(caplog):
    caplog.set_level(logging.DEBUG, logger="gateway.exchange")

    async def go():
        client = Client({"type": "http.disconnect"})

        async def work():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise RuntimeError("failed while stopping") from None
        with pytest.raises(ClientGone):
            await until_disconnect(client.receive, work())
    run(go())
    (logged,) = [r for r in caplog.records if r.name == "gateway.exchange"]
    assert logged.getMessage() == "work failed after its client left" and logged.levelno == logging.DEBUG
    assert logged.exc_info[0] is RuntimeError  # with its traceback


def test_cancelling_the_wait_cancels_the_work_and_the_watch():
    async def go():
        client = Client()
        work = asyncio.ensure_future(asyncio.Event().wait())
        waiter = asyncio.ensure_future(until_disconnect(client.receive, work))
        for _ in range(3):
            await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return work.cancelled(), others
    assert run(go()) == (True, [])


# ---------------------------------------------------------------- Record


def test_a_record_counts_one_request_once():
    m = GatewayMetrics()
    before = time.monotonic()
    record = Record(m, ROUTE)
    assert counts(m)["in_flight"] == 1
    record.first_token()
    record.done(200)
    record.done(500)  # a second done changes nothing
    elapsed = time.monotonic() - before
    assert counts(m) == {"in_flight": 0, "durations": 1, "2xx": 1, "4xx": 0, "5xx": 0, "disconnects": 0, "ttft": 1}
    for name in ("gateway_request_duration_seconds_sum", "gateway_time_to_first_token_seconds_sum"):
        assert 0 <= sample(m, name, route=ROUTE) <= elapsed
    assert sample(m, "gateway_requests_in_flight", route="/v1/completions") == 0


def test_a_client_gone_is_counted_as_a_disconnect_in_4xx():
    m = GatewayMetrics()
    Record(m, ROUTE).done(CLIENT_GONE)
    Record(m, ROUTE).done(404)
    assert counts(m) == {"in_flight": 0, "durations": 2, "2xx": 0, "4xx": 2, "5xx": 0, "disconnects": 1, "ttft": 0}


# ---------------------------------------------------------------- read, collect, sse


def test_read_returns_the_next_response_and_refuses_an_unfinished_end():
    async def go():
        call = Upstream(token("a"))
        first = await read(call)
        with pytest.raises(errors.UnavailableError) as e:
            await read(call)
        return first, str(e.value)
    first, message = run(go())
    assert first.text == "a"
    assert message == "The inference service ended the response stream without finishing it: retry the request."


def test_collect_reads_until_every_choice_finished():
    async def go():
        call = Upstream(token("He", index=1), token("llo", index=0, finish=pb.FINISH_REASON_STOP),
                        token("!", index=1, finish=pb.FINISH_REASON_LENGTH), token("never read"))
        return await collect(call, ChatReply(translated(n=2), "chatcmpl-1", 5)), call.reads
    result, reads = run(go())
    assert reads == 3
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in result["choices"]] == [
        (0, "llo", "stop"), (1, "He!", "length")]


def test_sse_frames_one_event():
    assert sse({"a": "é", "b": [1, None]}) == {"type": "http.response.body", "more_body": True,
                                              "body": 'data: {"a": "é", "b": [1, null]}\n\n'.encode()}
    assert sse("[DONE]") == {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True}


# ---------------------------------------------------------------- EventStream


def stream(call: Upstream, reply, m: GatewayMetrics, headers=None) -> EventStream:
    first = run(read(call))
    return EventStream(call, reply, first, Record(m, ROUTE), api_errors.from_exception, headers or {})


def events(client: Client) -> list[bytes]:
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert all(msg["more_body"] is True for msg in client.sent[1:-1])
    return [e for e in client.body().split(b"\n\n") if e]


def test_a_stream_sends_its_chunks_then_done_and_counts_once():
    m = GatewayMetrics()
    call = Upstream(token("Hel"), token("lo"), token("", finish=pb.FINISH_REASON_STOP, tokens=()), token("unread"))
    s = stream(call, CompletionReply(translated(include_usage=True), "cmpl-1", 5), m,
               {"x-request-id": "r1", "cache-control": "no-store"})
    client = Client()
    run(s(None, client.receive, client.send))
    assert client.sent[0] == {"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-store"),
        (b"x-accel-buffering", b"no"), (b"x-request-id", b"r1")]}
    got = events(client)
    assert got[-1] == b"data: [DONE]"
    texts = [e for e in got if b'"text": "' in e]
    assert [t.split(b'"text": "')[1].split(b'"')[0] for t in texts] == [b"Hel", b"lo", b""]
    assert b'"finish_reason": "stop"' in texts[-1] and b'"total_tokens": 5' in got[-2]
    assert call.reads == 3 and call.cancels == 1 and s.status == 200
    assert counts(m) == {"in_flight": 0, "durations": 1, "2xx": 1, "4xx": 0, "5xx": 0, "disconnects": 0, "ttft": 1}


def test_the_first_token_is_timed_when_it_arrives():
    m = GatewayMetrics()
    call = Upstream(token("", tokens=()), token("", tokens=()), token("a"), token("b", finish=pb.FINISH_REASON_STOP))
    s = stream(call, ChatReply(translated(), "chatcmpl-1", 5), m)
    client = Client()
    run(s(None, client.receive, client.send))
    assert client.sent[0]["headers"] == [(b"content-type", b"text/event-stream; charset=utf-8"),
                                         (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
    assert counts(m)["ttft"] == 1 and call.reads == 4
    assert sample(m, "gateway_time_to_first_token_seconds_sum", route=ROUTE) <= sample(
        m, "gateway_request_duration_seconds_sum", route=ROUTE)


def test_a_stream_whose_upstream_fails_ends_with_an_error_event_then_done():
    m = GatewayMetrics()
    failure = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="engine gone")
    call = Upstream(token("Hi"), failure)
    s = stream(call, ChatReply(translated(), "chatcmpl-1", 5), m)
    client = Client()
    run(s(None, client.receive, client.send))
    got = events(client)
    assert got[-2:] == [b'data: {"error": {"message": "engine gone", "type": "service_unavailable_error", '
                        b'"param": null, "code": "unavailable"}}', b"data: [DONE]"]
    assert s.status == 503 and call.cancels == 1
    assert counts(m) == {"in_flight": 0, "durations": 1, "2xx": 0, "4xx": 0, "5xx": 1, "disconnects": 0, "ttft": 1}


def test_a_stream_that_ends_unfinished_ends_with_an_error_event():
    m = GatewayMetrics()
    s = stream(Upstream(token("Hi")), ChatReply(translated(), "chatcmpl-1", 5), m)
    client = Client()
    run(s(None, client.receive, client.send))
    got = events(client)
    assert b'"type": "service_unavailable_error"' in got[-2] and b"without finishing it" in got[-2]
    assert got[-1] == b"data: [DONE]" and s.status == 503


def test_a_client_that_leaves_mid_stream_is_counted_gone_and_its_call_cancelled():
    m = GatewayMetrics()
    call = Upstream(token("Hi"), HANG)
    s = stream(call, ChatReply(translated(), "chatcmpl-1", 5), m)
    client = Client({"type": "http.disconnect"})
    run(s(None, client.receive, client.send))
    assert s.status == CLIENT_GONE and call.cancels == 1
    assert client.sent[-1].get("more_body") is True  # nothing more was sent: no [DONE] to a closed connection
    assert counts(m) == {"in_flight": 0, "durations": 1, "2xx": 0, "4xx": 1, "5xx": 0, "disconnects": 1, "ttft": 1}


@pytest.mark.parametrize("fail_on", [pytest.param(0, id="headers"), pytest.param(2, id="chunk")])
def test_a_connection_that_fails_while_written_to_is_counted_gone(fail_on):
    m = GatewayMetrics()
    call = Upstream(token("Hi"), token("there"), token("!", finish=pb.FINISH_REASON_STOP))
    s = stream(call, ChatReply(translated(), "chatcmpl-1", 5), m)
    client = Client(fail_on=fail_on)
    run(s(None, client.receive, client.send))
    assert s.status == CLIENT_GONE and call.cancels == 1 and len(client.sent) == fail_on
    assert counts(m)["disconnects"] == 1 and counts(m)["in_flight"] == 0


def test_a_stream_cancelled_by_the_server_still_cancels_its_call_and_counts():
    m = GatewayMetrics()
    call = Upstream(token("Hi"), HANG)
    s = stream(call, ChatReply(translated(), "chatcmpl-1", 5), m)

    async def go():
        client = Client()
        task = asyncio.ensure_future(s(None, client.receive, client.send))
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    run(go())
    assert call.cancels == 1 and s.status == 200
    assert counts(m)["in_flight"] == 0 and counts(m)["2xx"] == 1
