"""A pool of compile worker processes with real deadlines.

Each job waits for an idle worker, sends it the spec, and waits for the reply
up to the deadline. A job past its deadline kills its worker (SIGKILL: the
compile stops burning a core at once) and a fresh worker takes its place in
the background. Calls are asyncio-friendly: the blocking pipe I/O runs on a
thread per busy worker, so the event loop and other compiles never wait.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from dataclasses import dataclass
from typing import Callable

from grammar_svc.spec import GrammarSpec
from shared.errors import CompileTimeoutError, InvalidGrammarError, UnavailableError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileOutput:
    # CompiledGrammar.serialize_json(), or None: recompile in-process (fast).
    serialized: str | None
    warnings: tuple[str, ...]
    duration_seconds: float
    memory_bytes: int


class _Worker:
    """A `python -m grammar_svc.compile_worker` child on a socketpair.

    A plain subprocess rather than multiprocessing: the child never re-imports
    the parent's __main__, and it says "ready" only once xgrammar is loaded.
    """

    def __init__(self):
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grammar_svc.compile_worker", str(child.fileno())],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        child.close()
        self.conn = Connection(parent.detach())
        if self.conn.recv() != ("ready",):
            raise RuntimeError("compile worker failed to start")
        self.tokenizers: set[str] = set()

    def load_tokenizer(self, fingerprint: str, info_json: str) -> None:
        if fingerprint not in self.tokenizers:
            self.conn.send(("tokenizer", fingerprint, info_json))
            self.conn.recv()
            self.tokenizers.add(fingerprint)

    def compile(self, fingerprint: str, spec: GrammarSpec, ship_above_seconds: float):
        self.conn.send(("compile", fingerprint, spec, ship_above_seconds))
        return self.conn.recv()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=5)
        self.conn.close()


def _consume(task: asyncio.Future) -> None:
    """Retrieves an abandoned job's outcome (the worker was killed under it)."""
    if not task.cancelled():
        task.exception()


class WorkersBusyError(CompileTimeoutError):
    """No worker became free in time: the grammar never ran, so this is not cached."""


class CompilePool:
    """Killable compile workers.

    A worker ships the compiled grammar back only when compiling took longer
    than `ship_above_seconds`: serializing xgrammar's token-mask cache as JSON
    costs 10-40x the compile itself (68 MB and 5.7 s for a schema compiled in
    0.11 s), so for fast compiles the caller recompiles in-process instead,
    which the worker has just shown to finish quickly (`CompileOutput.serialized`
    is None then).
    """

    def __init__(self, num_workers: int, known_tokenizers: Callable[[], list[tuple[str, str]]],
                 ship_above_seconds: float = 1.0):
        self._num_workers = num_workers
        self._known_tokenizers = known_tokenizers
        self.ship_above_seconds = ship_above_seconds
        self._idle: asyncio.Queue[_Worker] | None = None
        self._all: set[_Worker] = set()
        self._closed = False
        self.kills = 0

    def _new_worker(self) -> _Worker:
        """Starts a worker that already holds every registered tokenizer (blocking)."""
        worker = _Worker()
        for fingerprint, info_json in self._known_tokenizers():
            worker.load_tokenizer(fingerprint, info_json)
        return worker

    async def start(self) -> None:
        self._idle = asyncio.Queue()
        workers = await asyncio.gather(*[asyncio.to_thread(self._new_worker) for _ in range(self._num_workers)])
        for w in workers:
            self._all.add(w)
            self._idle.put_nowait(w)

    @property
    def busy_workers(self) -> int:
        return len(self._all) - (self._idle.qsize() if self._idle else 0)

    async def compile(self, fingerprint: str, info_json: str, spec: GrammarSpec, timeout_seconds: float) -> CompileOutput:
        """Compiles on a worker; timeout_seconds bounds the wait for a free worker and,
        separately, the compilation itself (loading a tokenizer into a worker does not count)."""
        if self._closed or self._idle is None:
            raise UnavailableError("grammar service is shutting down")
        try:
            worker = await asyncio.wait_for(self._idle.get(), timeout_seconds)
        except asyncio.TimeoutError:
            raise WorkersBusyError(
                f"no compile worker became free within {timeout_seconds:g} s (all busy); retry later"
            ) from None
        task = None
        try:
            if fingerprint not in worker.tokenizers:
                await asyncio.to_thread(worker.load_tokenizer, fingerprint, info_json)
            task = asyncio.ensure_future(asyncio.to_thread(worker.compile, fingerprint, spec, self.ship_above_seconds))
            reply = await asyncio.wait_for(asyncio.shield(task), timeout_seconds)
        except asyncio.TimeoutError:
            # The killed worker's pipe read ends in EOFError: retrieve it, or
            # asyncio logs "Task exception was never retrieved" per timeout.
            task.add_done_callback(_consume)
            self._replace(worker)
            raise CompileTimeoutError(
                f"{spec.kind.value} compilation exceeded its {timeout_seconds:g} s deadline and was stopped; "
                "simplify the constraint or raise timeout_seconds"
            ) from None
        except (EOFError, OSError, BrokenPipeError) as e:
            self._replace(worker)
            raise UnavailableError(f"compile worker died ({e!r}); retry") from None
        except asyncio.CancelledError:
            # The caller went away mid-compile: the worker's answer is stale.
            if task is not None:
                task.add_done_callback(_consume)
            self._replace(worker)
            raise
        self._idle.put_nowait(worker)
        status = reply[0]
        if status == "ok":
            _, serialized, warnings, duration, memory = reply
            return CompileOutput(serialized, tuple(warnings), duration, memory)
        if status == "invalid":
            raise InvalidGrammarError(f"{spec.kind.value}: {reply[1]}")
        raise RuntimeError(f"compile worker failed: {reply[1]}")

    def _replace(self, worker: _Worker) -> None:
        self.kills += 1
        self._all.discard(worker)
        worker.kill()
        if self._closed:
            return
        loop = asyncio.get_running_loop()

        def spawn():
            fresh = self._new_worker()

            def hand_over():
                if self._closed:
                    fresh.kill()
                else:
                    self._all.add(fresh)
                    self._idle.put_nowait(fresh)
            loop.call_soon_threadsafe(hand_over)

        threading.Thread(target=spawn, daemon=True, name="structd-compile-respawn").start()

    async def close(self) -> None:
        self._closed = True
        for w in list(self._all):
            await asyncio.to_thread(w.kill)
        self._all.clear()
