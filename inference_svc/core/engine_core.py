"""The engine core process: the step loop, the model and the grammar tier, away from the clients' streams.

With `--engine-process on` the API server (server.py) starts this module as
its child (`python -m inference_svc.core.engine_core FD`, FD one end of a Unix
socket pair) and talks to it in core_protocol.py's frames, as vLLM V1 splits
its API server from its EngineCore. Here run the scheduler, the grammar
tier's streams and compiles, the forward, the draw and detokenization;
there run gRPC, the Generate handlers, chat templates and tools. The point
is the event loop: in one process every step woke one Generate handler per
request, and their protobuf and gRPC writes held the GIL and the loop while
the forward ran, so a finished forward was noticed late and grammar answers
were read late. Here a step's outputs leave as one frame.

The core serves the service's Prometheus metrics (every metric of the
service is the engine's). It ignores SIGINT and SIGTERM: the API server
decides when to drain and when to stop (DRAIN, CLOSE), and when the API
server dies its end of the socket closes, which ends the core too.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import pickle
import signal
import socket
import sys

from inference_svc.core import core_protocol as p
from inference_svc.core.assembly import GIL_SWITCH_INTERVAL_SECONDS, EngineAssembly
from inference_svc.metrics import InferenceMetrics
from inference_svc.engine.request import GenerationRequest, Output
from shared import errors
from shared.entry import end_stopped_process, setup_logging
from shared.metrics_http import MetricsHttp
from shared.status import error_for_code, status_for

log = logging.getLogger(__name__)


def portable(error: BaseException) -> BaseException:
    """`error` as it can cross to the API server: a domain error as it is; anything else (a bug) is logged
    here with its traceback and an incident id, and crosses as InternalError carrying that id."""
    if isinstance(error, errors.StructdError):
        try:
            pickle.dumps(error)
            return error
        except Exception:  # noqa: BLE001 - this error's own state does not pickle: send its status instead
            pass
    code, message = status_for(error)
    return error_for_code(code.value[0], message, errors.InternalError)


class _Outputs:
    """Stands in for a request's output queue in the core: outputs join the next OUTPUTS frame."""

    def __init__(self, core: "EngineCore", key: int, req: GenerationRequest):
        self.core, self.key, self.req = core, key, req
        self.first = True

    def put_nowait(self, output: Output) -> None:
        warnings = None
        if self.first:
            self.first = False
            warnings = self.req.warnings
        if output.error is not None:
            output.error = portable(output.error)
        self.core.queue_output(self.key, output, warnings)


class EngineCore:
    """One engine behind a socket: runs what the API server sends, sends back what the engine makes."""

    def __init__(self, writer: asyncio.StreamWriter, stack: EngineAssembly):
        self.writer = writer
        self.stack = stack
        self._requests: dict[int, GenerationRequest] = {}
        self._submitting: set[int] = set()
        self._cancel_after_submit: set[int] = set()
        self._batch: list[tuple[int, Output, tuple | None]] = []
        self._flush_pending = False
        self.ended = asyncio.Event()
        self.exit_code = 0

    @property
    def engine(self):
        return self.stack.engine

    # --- outputs --------------------------------------------------------------

    def queue_output(self, key: int, output: Output, warnings) -> None:
        self._batch.append((key, output, warnings))
        if output.ends_stream:
            self._requests.pop(key, None)
        if not self._flush_pending:
            # Everything queued until the loop next turns goes in one frame: a step's outputs are made
            # in one go (Engine._flush_outputs), so that is one frame a step.
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._flush_pending = False
        if self._batch:
            batch, self._batch = self._batch, []
            p.send(self.writer, (p.OUTPUTS, batch))

    # --- messages -------------------------------------------------------------

    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == p.SUBMIT:
            _, key, submit = message
            self._submitting.add(key)
            asyncio.create_task(self._submit(key, submit), name=f"submit-{key}")
        elif kind == p.CANCEL:
            key = message[1]
            if (req := self._requests.get(key)) is not None:
                self.engine.cancel(req)
            elif key in self._submitting:
                self._cancel_after_submit.add(key)
        elif kind == p.DRAIN:
            asyncio.create_task(self._drain(message[1]), name="drain")
        elif kind == p.CLOSE:
            asyncio.create_task(self._close(0), name="close")
        else:
            raise p.ProtocolError(f"unknown frame {kind!r}")

    async def _submit(self, key: int, s: p.EngineSubmit) -> None:
        try:
            req = await self.engine.submit(s.prompt, s.options, constraint=s.constraint, jump_forward=s.jump_forward,
                                           request_id=s.request_id, reasoning=s.reasoning,
                                           max_thinking_tokens=s.max_thinking_tokens, tool_parser=s.tool_parser,
                                           end_client=s.end_client)
        except Exception as e:  # noqa: BLE001 - the request's (its input, or the engine refusing it): its client hears
            self._cancel_after_submit.discard(key)
            p.send(self.writer, (p.SUBMITTED, key, portable(e)))
            return
        finally:
            self._submitting.discard(key)
        # No output can exist yet: submit only enqueued it, and the step loop has not run since.
        req.outputs = _Outputs(self, key, req)
        self._requests[key] = req
        p.send(self.writer, (p.SUBMITTED, key, None))
        if key in self._cancel_after_submit:
            self._cancel_after_submit.discard(key)
            self.engine.cancel(req)

    async def _drain(self, grace_seconds: float) -> None:
        await self.engine.drain(grace_seconds)
        self.flush()
        p.send(self.writer, (p.DRAINED,))

    async def _close(self, exit_code: int) -> None:
        if self.ended.is_set():
            return
        await self.stack.close()
        self.flush()
        self.exit_code = exit_code
        self.ended.set()

    def engine_died(self, cause: BaseException | None) -> None:
        """The step loop ended (a bug): it has failed every request in flight; tell the API server, then exit."""
        self.flush()
        p.send(self.writer, (p.FATAL, f"the engine's step loop ended: {cause!r}"))
        asyncio.ensure_future(self._close(1))


async def serve(sock: socket.socket) -> int:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    start = await p.receive(reader)
    if start is None or start[0] != p.START:
        raise p.ProtocolError("the API server did not start the core")
    _, config, rank, source, grammar_connect_timeout_seconds = start
    setup_logging(config.log_level)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)  # see core/assembly.py
    metrics = InferenceMetrics()
    core = EngineCore(writer, EngineAssembly(config, metrics, rank=rank, source=source))
    core.stack.on_fatal = core.engine_died
    metrics_http = None
    try:
        metrics_port = 0
        if config.metrics_port:
            metrics_http = MetricsHttp(config.host, config.metrics_port, metrics.registry)
            metrics_port = metrics_http.port
        served = await core.stack.build()
        await core.stack.connect(grammar_connect_timeout_seconds)
        core.stack.start()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - start-up failed (the model, a port, no grammar tier)
        log.exception("the engine core could not start")
        p.send(writer, (p.START_FAILED, str(e) or type(e).__name__))
        await writer.drain()
        return 1
    p.send(writer, (p.READY, served, metrics_port))
    reading = asyncio.ensure_future(_read(reader, core))
    ended = asyncio.ensure_future(core.ended.wait())
    await asyncio.wait({reading, ended}, return_when=asyncio.FIRST_COMPLETED)
    if not core.ended.is_set():
        # The API server is gone (its end closed) or spoke nonsense: nobody is left to stream to.
        if reading.exception() is not None:
            log.error("the API server's frames broke: %r; stopping", reading.exception())
        else:
            log.warning("the API server closed the engine core's socket; stopping")
        await core._close(1)
    reading.cancel()
    try:
        await writer.drain()
        writer.close()
    except ConnectionError:  # the API server's end is already gone: nothing left to tell it
        pass
    if metrics_http is not None:
        metrics_http.close()
    return core.exit_code


async def _read(reader: asyncio.StreamReader, core: EngineCore) -> None:
    while (message := await p.receive(reader)) is not None:
        core.handle(message)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m inference_svc.core.engine_core FD (started by the inference service itself)",
              file=sys.stderr)
        return 2
    # The API server drains and stops the core itself; a Ctrl-C or SIGTERM to the whole group must not
    # kill it under the requests it is finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # SIGUSR1 writes every thread's stack to the log, even with the main thread stuck in C: the API server
    # asks for it before it kills a core that has not finished starting, and an operator can send it too.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sock = socket.socket(fileno=int(argv[0]))
    end_stopped_process(asyncio.run(serve(sock)))


if __name__ == "__main__":
    sys.exit(main())
