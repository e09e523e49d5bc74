"""The engine as the API server sees it when the engine runs in its own process (`--engine-process on`).

`EngineClient` has the face of `Engine` that the Frontend and the servicer
use (api/frontend.py's `ServingEngine`: submit, cancel, config,
max_model_len; and drain and close for the server) and forwards each
call to the engine core process it started (engine_core.py) over
core_protocol.py's socket. A request comes back as a `RemoteRequest` whose
`outputs` queue the reader task fills from the core's OUTPUTS frames, one
frame a step. Should the core die, every request in flight fails with
UNAVAILABLE and `on_fatal` tells the server, as when an in-process engine's
step loop ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import socket
import subprocess
import sys
from collections.abc import Callable

from inference_svc.core import core_protocol as p
from inference_svc.config import InferenceServiceConfig
from inference_svc.engine.engine import ENGINE_STOPPED, Prompt
from inference_svc.core.assembly import ServedModel
from inference_svc.model.model_loading import ModelSource
from inference_svc.engine.request import Output
from inference_svc.engine.sampling import SamplingOptions
from inference_svc.model.tensor_parallel import RankInfo
from inference_svc.types import Constraint, SchemaWarning, ToolCallReader
from shared import errors

log = logging.getLogger(__name__)
# How long close() waits for the core to finish its own shutdown before it is killed.
CLOSE_TIMEOUT_SECONDS = 30.0
# How long a core stopped during start-up gets to write its stacks (engine_core.main: SIGUSR1) before it is killed.
STACK_DUMP_SECONDS = 0.5


class RemoteRequest:
    """A request running in the engine core, as a Generate handler sees it."""

    def __init__(self, key: int, request_id: str):
        self.key = key
        self.request_id = request_id
        self.outputs: asyncio.Queue[Output] = asyncio.Queue()
        # A constrained request's compile warnings, known with its first output (Generate sends them then).
        self.warnings: tuple[SchemaWarning, ...] = ()
        self.finished = False
        self.cancelled = False


class EngineClient:
    def __init__(self, config: InferenceServiceConfig, *, rank: RankInfo | None, source: ModelSource,
                 on_fatal: Callable[[BaseException | None], None] | None = None):
        self.service_config = config
        self.config = config.engine
        self.rank = rank
        self.source = source
        self.on_fatal = on_fatal
        self.max_model_len = 0  # known once the core is READY
        self.dead = False
        self._keys = itertools.count(1)
        self._requests: dict[int, RemoteRequest] = {}
        self._submits: dict[int, asyncio.Future] = {}
        self._process: subprocess.Popen | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._drained = asyncio.Event()
        self._closing = False
        self._ready = False  # the core said READY (it reads frames only from then on)

    # --- lifecycle -----------------------------------------------------------

    async def launch(self, grammar_connect_timeout_seconds: float) -> None:
        """Starts the core process and tells it what to run (it loads the model meanwhile: see ready); it
        gives up when no grammar replica has answered within `grammar_connect_timeout_seconds`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._process = subprocess.Popen([sys.executable, "-m", "inference_svc.core.engine_core", str(theirs.fileno())],
                                             pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self._reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        p.send(self._writer, (p.START, self.service_config, self.rank, self.source, grammar_connect_timeout_seconds))

    async def ready(self) -> tuple[ServedModel, int]:
        """(the served model, the core's metrics port) once the core has loaded the model and reached a
        grammar replica; SystemExit with the core's reason if it could not."""
        try:
            message = await p.receive(self._reader)
        except (p.ProtocolError, ConnectionError) as e:  # the core's: it broke while starting
            message = (p.START_FAILED, str(e))
        if message is None or message[0] != p.READY:
            reason = "it exited" if message is None else message[1]
            await self._reap()
            raise SystemExit(f"the engine core process did not start: {reason}")
        _, served, metrics_port = message
        self.max_model_len = served.max_model_len
        self._ready = True
        self._reading = asyncio.create_task(self._read(), name="engine-core-reader")
        return served, metrics_port

    @property
    def num_active(self) -> int:
        return len(self._requests)

    async def drain(self, grace_seconds: float) -> None:
        """The core stops admitting, lets requests finish within the grace period and cancels the rest."""
        if self.dead or not self._ready:
            return
        p.send(self._writer, (p.DRAIN, grace_seconds))
        await self._drained.wait()

    async def close(self) -> None:
        self._closing = True
        if self._ready and not self.dead:
            p.send(self._writer, (p.CLOSE,))
        elif self._process is not None and self._process.poll() is None:
            # Stopped while it was still starting (a signal during start-up, or a starter that gave up on
            # it): it has no requests, and it reads no frames before READY. It writes where it was to its
            # log first, so a start that would never have ended can be told from a slow one.
            log.warning("stopping the engine core (pid %d) while it is still starting; its threads' stacks "
                        "follow in its log", self._process.pid)
            self._process.send_signal(signal.SIGUSR1)
            await asyncio.sleep(STACK_DUMP_SECONDS)
            self._process.kill()
        await self._reap()

    async def _reap(self) -> None:
        """Waits for the core process to exit (killing it past CLOSE_TIMEOUT_SECONDS) and closes the socket."""
        if self._process is not None:
            try:
                await asyncio.to_thread(self._process.wait, CLOSE_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                log.error("the engine core did not stop within %.0f s; killing it", CLOSE_TIMEOUT_SECONDS)
                self._process.kill()
                await asyncio.to_thread(self._process.wait)
        if self._reading is not None:
            await asyncio.gather(self._reading, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()

    # --- requests ------------------------------------------------------------

    async def submit(self, prompt: Prompt | str, options: SamplingOptions, *, constraint: Constraint | None = None,
                     jump_forward: bool = True, request_id: str = "", reasoning: bool | None = None,
                     max_thinking_tokens: int = 0, tool_parser: ToolCallReader | None = None,
                     end_client: str = "") -> RemoteRequest:
        """As Engine.submit: the core validates and enqueues; its refusal is raised here."""
        if self.dead:
            raise errors.UnavailableError(ENGINE_STOPPED)
        if isinstance(prompt, str):
            prompt = Prompt(prompt)
        key = next(self._keys)
        req = RemoteRequest(key, request_id)
        accepted = asyncio.get_running_loop().create_future()
        self._submits[key] = accepted
        self._requests[key] = req
        submit = p.EngineSubmit(prompt=prompt, options=options, constraint=constraint, jump_forward=jump_forward,
                                request_id=request_id, reasoning=reasoning, max_thinking_tokens=max_thinking_tokens,
                                tool_parser=tool_parser, end_client=end_client)
        p.send(self._writer, (p.SUBMIT, key, submit))
        try:
            error = await accepted
        except asyncio.CancelledError:
            # The client went away while the core was accepting it: the core cancels it once it has it.
            self.cancel(req)
            raise
        finally:
            self._submits.pop(key, None)
        if error is not None:
            raise error
        return req

    def cancel(self, req: RemoteRequest) -> None:
        """The client went away (or its stream ended): the core frees its KV and grammar session."""
        if req.finished or req.cancelled or self.dead:
            return
        req.cancelled = True
        p.send(self._writer, (p.CANCEL, req.key))

    # --- the core's frames ---------------------------------------------------

    async def _read(self) -> None:
        cause: BaseException | None = None
        try:
            while (message := await p.receive(self._reader)) is not None:
                kind = message[0]
                if kind == p.OUTPUTS:
                    self._deliver(message[1])
                elif kind == p.SUBMITTED:
                    _, key, error = message
                    if error is not None:
                        self._requests.pop(key, None)  # refused: no output will come for it
                    if (accepted := self._submits.get(key)) is not None and not accepted.done():
                        accepted.set_result(error)
                elif kind == p.DRAINED:
                    self._drained.set()
                elif kind == p.FATAL:
                    cause = RuntimeError(message[1])
                else:
                    raise p.ProtocolError(f"unknown frame {kind!r}")
        except (p.ProtocolError, ConnectionError) as e:  # the core's frames broke: as if it died
            cause = e
        if not self._closing or cause is not None:
            self._core_lost(cause or ConnectionError("the engine core process exited"))

    def _deliver(self, batch: list[tuple[int, Output, tuple | None]]) -> None:
        for key, output, warnings in batch:
            req = self._requests.get(key)
            if req is None:
                continue
            if warnings is not None:
                req.warnings = warnings
            if output.ends_stream:
                req.finished = True
                del self._requests[key]
            req.outputs.put_nowait(output)

    def _core_lost(self, cause: BaseException) -> None:
        """Every request in flight fails with UNAVAILABLE; the server hears of it (on_fatal) and exits."""
        if self.dead:
            return
        self.dead = True
        log.critical("the engine core stopped (%s); failing every request in flight", cause)
        error = errors.UnavailableError(ENGINE_STOPPED)
        for accepted in self._submits.values():
            if not accepted.done():
                accepted.set_result(error)
        requests, self._requests = self._requests, {}
        for req in requests.values():
            req.finished = True
            req.outputs.put_nowait(Output([], "", None, None, error, ends_stream=True))
        self._drained.set()
        if self.on_fatal is not None:
            self.on_fatal(cause)
