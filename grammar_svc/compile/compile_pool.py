"""A supervised pool of compile worker processes with real deadlines.

Each job takes an idle worker, sends it the spec and waits for the reply up to
the deadline. A job past its deadline, or one nobody waits for any more, kills
its worker (SIGKILL: the compile stops burning a core at once). Workers that
die on their own (segfault, OOM killer, a SIGKILL from outside) are noticed,
busy or idle. A supervisor task keeps `num_workers` alive, respawning what is
lost with back-off when spawning fails, and every restart is counted by
reason.

Workers are forked by a zygote process that has imported xgrammar once
(milliseconds per worker instead of seconds for a fresh interpreter, far more
on a loaded machine: docs/benchmarks.md, "Hand-timed figures behind code
choices", "Compile workers"), so replacing a killed worker or opening a lane
costs almost nothing.

Head-of-line blocking: a job that has held its worker for `lane_after_seconds`
no longer counts against the pool's capacity. While jobs wait, the pool opens
an extra worker (a lane) for each such job, up to `max_workers` in all, and
retires extra workers that stay idle for `idle_retire_seconds`. A compile
that has used `lane_after_seconds` of CPU is reniced below the short ones
(LONG_COMPILE_NICE), so the lanes' fast compiles keep the CPU they need. So a
schema that runs to its deadline holds one worker and a low-priority share of
a core, not the queue (docs/design.md has the measurements).

Everything here runs on the event loop thread except the blocking pipe I/O,
spawns and reaps, which go to the pool's own thread pool: a kill never waits
for the process on the loop, and a burst of busy workers never starves the
loop's default executor.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable

from grammar_svc.compile.compile_worker import MEMORY_LIMIT_FLAG
from grammar_svc.compile.spec import GrammarSpec
from shared.errors import CompileTimeoutError, InvalidGrammarError, RequestTooLargeError, UnavailableError

log = logging.getLogger(__name__)

# Why a worker left the pool (label values of grammar_svc_compile_worker_restarts_total); MEMORY: a compile
# ran out of the worker's address-space cap.
DEADLINE, ABANDONED, CRASHED, MEMORY = "deadline", "abandoned", "crashed", "memory"
# A compile that waited for a worker for less than this share of its deadline and then timed out is
# remembered as if it had not waited (for the whole deadline); a longer wait, for the seconds it compiled.
SHORT_WAIT_SHARE = 0.1
# CPU priorities: the step path (the server, nice 0) before compiles (workers start at
# WORKER_NICE), and short compiles before those that have run past lane_after_seconds
# (LONG_COMPILE_NICE). Lowering niceness again needs privileges, so a worker that ran a
# long compile is replaced by a fresh one afterwards (a fork: milliseconds).
WORKER_NICE = 5
LONG_COMPILE_NICE = 15


@dataclass(frozen=True)
class CompileOutput:
    # CompiledGrammar.serialize_json(), or None: recompile in-process (fast).
    serialized: str | None
    warnings: tuple[str, ...]
    duration_seconds: float
    memory_bytes: int
    # Spent loading the tokenizer into the worker first: outside the compile's deadline.
    tokenizer_seconds: float = 0.0


class WorkersBusyError(CompileTimeoutError):
    """No worker became free in time, or the wait for one left the compile less than half its deadline: the
    queue's doing, not the grammar's, so this is not cached."""


class WorkerCrashedError(UnavailableError):
    """The worker died under a job (segfault, OOM killer, killed from outside).

    `during_compile` is True when it died while compiling the spec (the spec may
    be what crashes it), False while it was loading a tokenizer.
    """

    def __init__(self, message: str, during_compile: bool):
        super().__init__(message)
        self.during_compile = during_compile


_WORKER_ENV = {
    # Compile workers need no BLAS threads, and the zygote must be single-threaded to fork safely
    # (numpy's OpenBLAS starts a thread pool on import otherwise).
    "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
}


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _worker_command(memory_limit_bytes: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "grammar_svc.compile.compile_worker", *args,
            MEMORY_LIMIT_FLAG, str(memory_limit_bytes)]


def _worker_env() -> dict[str, str]:
    return {**os.environ, **_WORKER_ENV}


def _set_nice(pid: int, nice: int) -> None:
    """Raises a process's niceness; best effort (a sandbox may forbid it, or it may have died)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except (ProcessLookupError, PermissionError) as e:  # the OS's answer; priorities are an optimisation
        log.debug("setpriority(%d, %d) failed: %r", pid, nice, e)


def _exited(pidfd: int, timeout_ms: int | None) -> bool:
    """Whether the pidfd's process has exited (a pidfd turns readable then); waits up to timeout_ms."""
    poller = select.poll()  # not select(): pidfds can be numbered past FD_SETSIZE in a busy server
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(timeout_ms))


class _ForkedProcess:
    """The Popen-like handle of a worker forked by the zygote: not our child, so watched through a pidfd."""

    def __init__(self, pid: int, pidfd: int):
        self.pid = pid
        self._pidfd = pidfd
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None and self._pidfd >= 0 and _exited(self._pidfd, 0):
                self.returncode = -1  # unknown: only the zygote could wait for it, and the kernel reaped it
            return self.returncode

    def kill(self) -> None:
        with self._lock:
            if self._pidfd >= 0:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def wait(self) -> int:
        with self._lock:
            pidfd = self._pidfd
        if pidfd >= 0:
            _exited(pidfd, None)
        with self._lock:
            if self.returncode is None:
                self.returncode = -1
            if self._pidfd >= 0:
                os.close(self._pidfd)
                self._pidfd = -1
        return self.returncode


class _NoPidfdError(RuntimeError):
    """This kernel or sandbox has no pidfds: workers cannot be forked by a zygote here."""


# How long the zygote may take to answer a fork (it answers in milliseconds; a hung one is replaced).
ZYGOTE_TIMEOUT_SECONDS = 30.0


class _Zygote:
    """`python -m grammar_svc.compile.compile_worker --zygote`: forks ready workers in milliseconds.

    A fresh interpreter takes seconds of CPU to import xgrammar (and torch,
    which xgrammar imports), far more on a loaded machine (docs/benchmarks.md,
    "Compile workers"): far too slow to open a worker lane for compiles that
    are already waiting, and a cost paid again for every worker killed at its
    deadline.
    """

    def __init__(self, memory_limit_bytes: int = 0):
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(_worker_command(memory_limit_bytes, "--zygote", str(child.fileno())),
                                     pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=_worker_env())
        child.close()
        _set_nice(self.proc.pid, WORKER_NICE)  # inherited by every worker it forks
        self.sock = parent
        self.sock.settimeout(ZYGOTE_TIMEOUT_SECONDS)
        self._lock = threading.Lock()
        try:
            ready = self.sock.recv(64)
        except OSError:  # the zygote's failure: it died before saying ready
            ready = b""
        if ready != b"ready":
            self.close()
            raise RuntimeError(f"compile worker zygote failed to start (said {ready!r})")

    def fork(self) -> tuple[_ForkedProcess, Connection]:
        """A new worker process and our end of its pipe (blocking; safe from several threads)."""
        parent, child = socket.socketpair()
        try:
            with self._lock:
                socket.send_fds(self.sock, [b"fork"], [child.fileno()])
                msg, fds, _, _ = socket.recv_fds(self.sock, 1024, 1)
        except OSError as e:  # the zygote's failure: it died (or was killed)
            parent.close()
            raise RuntimeError(f"compile worker zygote is gone ({e!r})") from None
        finally:
            child.close()
        if not msg or not fds:
            for fd in fds:
                os.close(fd)
            parent.close()
            text = msg.decode(errors="replace") or "EOF"
            raise (_NoPidfdError if text.startswith("error:pidfd_open") else RuntimeError)(
                f"compile worker zygote could not fork: {text}")
        return _ForkedProcess(int(msg), fds[0]), Connection(parent.detach())

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Kills the zygote (blocking: it waits for the process). Workers it forked live on."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.sock.close()


class _Worker:
    """A compile worker process (`grammar_svc.compile.compile_worker`) on a socketpair.

    Forked by the zygote, or, where that is not possible, started as a plain
    subprocess (never multiprocessing: the child must not re-import the
    parent's __main__). Either way it says "ready" once xgrammar is loaded.
    """

    def __init__(self, proc, conn: Connection):
        self.proc = proc
        self.conn = conn
        self.tokenizers: set[str] = set()
        # Monotonic start of the job it is running; None while idle.
        self.job_started: float | None = None
        # Whether it is compiling (not loading a tokenizer), its CPU time when that compile
        # started, and whether the compile has used lane_after_seconds of CPU since (a long compile).
        self.compiling = False
        self.compile_cpu_start: float | None = None
        self.long = False
        self.idle_since = time.monotonic()
        # The thread reading its reply, if any: the pipe is closed only after it returned.
        self.reader: concurrent.futures.Future | None = None
        self.reniced = False
        # Holds a tokenizer the registry evicted: replaced once free, so its memory goes with it.
        self.stale = False

    @classmethod
    def spawn(cls, memory_limit_bytes: int = 0) -> "_Worker":
        """A plain subprocess worker, ready (blocking: a fresh interpreter imports xgrammar first)."""
        parent, child = socket.socketpair()
        proc = subprocess.Popen(_worker_command(memory_limit_bytes, str(child.fileno())), pass_fds=(child.fileno(),),
                                stdin=subprocess.DEVNULL, env=_worker_env())
        child.close()
        _set_nice(proc.pid, WORKER_NICE)
        return cls._ready(proc, Connection(parent.detach()))

    @classmethod
    def _ready(cls, proc, conn: Connection) -> "_Worker":
        worker = cls(proc, conn)
        try:
            ready = worker.conn.recv()
        except (EOFError, OSError) as e:  # the child's failure: it exited before saying ready
            worker.signal_kill()
            worker.reap()
            raise RuntimeError(f"compile worker exited during start-up ({e!r})") from None
        if ready != ("ready",):
            worker.signal_kill()
            worker.reap()
            raise RuntimeError(f"compile worker sent {ready!r} instead of ready")
        return worker

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the process so far (Linux /proc; None where unreadable)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        except (OSError, IndexError, ValueError):  # the OS's answer: the process is gone, or no /proc here
            return None

    def start_compile(self) -> None:
        self.job_started = time.monotonic()
        self.compiling = True
        self.compile_cpu_start = self.cpu_seconds()
        self.long = False

    def compile_seconds_used(self, now: float) -> float:
        """CPU seconds the running compile has used (wall seconds where CPU time is unreadable)."""
        cpu = self.cpu_seconds() if self.compile_cpu_start is not None else None
        if cpu is None:
            return now - (self.job_started or now)
        return cpu - self.compile_cpu_start

    def load_tokenizer(self, fingerprint: str, info_json: str) -> None:
        if fingerprint not in self.tokenizers:
            self.conn.send(("tokenizer", fingerprint, info_json))
            self.conn.recv()
            self.tokenizers.add(fingerprint)

    def compile(self, fingerprint: str, spec: GrammarSpec, ship_above_seconds: float):
        self.conn.send(("compile", fingerprint, spec, ship_above_seconds))
        return self.conn.recv()

    def renice(self, nice: int) -> None:
        """Lowers the process's CPU priority (raising niceness needs no privilege)."""
        self.reniced = True
        _set_nice(self.proc.pid, nice)

    def signal_kill(self) -> None:
        """SIGKILL without waiting (safe on the event loop)."""
        try:
            if self.proc.poll() is None:
                self.proc.kill()
        except ProcessLookupError:  # the OS's answer: it is already gone, which is what we want
            pass

    def reap(self) -> None:
        """Waits for the process to exit and for its reader thread, then closes the pipe (blocking)."""
        self.proc.wait()
        if self.reader is not None:
            concurrent.futures.wait([self.reader])
        self.conn.close()


class WorkerFactory:
    """Starts workers: forked by a zygote when the platform has pidfds, else as plain subprocesses.

    A zygote that dies is started again on the next spawn. Every worker's address space is capped at
    memory_limit_bytes (0: not capped).
    """

    def __init__(self, use_zygote: bool = True, memory_limit_bytes: int = 0):
        self._use_zygote = use_zygote
        self.memory_limit_bytes = memory_limit_bytes
        self._zygote: _Zygote | None = None
        self._lock = threading.Lock()

    def __call__(self) -> _Worker:
        zygote = self._current_zygote() if self._use_zygote else None
        if zygote is None:
            return _Worker.spawn(self.memory_limit_bytes)
        try:
            proc, conn = zygote.fork()
        except RuntimeError as e:  # the zygote's failure: drop it, so the next spawn starts another
            with self._lock:
                if self._zygote is zygote:
                    self._zygote = None
            if isinstance(e, _NoPidfdError):
                log.warning("compile workers start as plain processes: %s", e)
                self._use_zygote = False
            zygote.close()
            raise
        return _Worker._ready(proc, conn)

    def _current_zygote(self) -> _Zygote | None:
        with self._lock:
            if self._zygote is not None and not self._zygote.alive:
                log.warning("compile worker zygote %d died; starting another", self._zygote.proc.pid)
                self._zygote.close()
                self._zygote = None
            if self._zygote is None:
                if not hasattr(os, "pidfd_open"):
                    self._use_zygote = False
                    return None
                self._zygote = _Zygote(self.memory_limit_bytes)
            return self._zygote

    def close(self) -> None:
        with self._lock:
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None


def _consume(fut) -> None:
    """Retrieves an abandoned reader's outcome (the worker was killed under it)."""
    if not fut.cancelled():
        fut.exception()


class CompilePool:
    """Killable, supervised compile workers with overflow lanes.

    A worker ships the compiled grammar back only when compiling took longer
    than `ship_above_seconds`: serializing xgrammar's token-mask cache as JSON
    costs many times the compile itself (docs/benchmarks.md, "Compile
    workers"), so for fast compiles the caller recompiles in-process instead,
    which the worker has just shown to finish quickly (`CompileOutput.serialized`
    is None then).

    `metrics` (optional) has `compile_worker_restarts` (Counter by reason),
    `compile_worker_spawn_failures` (Counter), `compile_workers` (Gauge by
    state) and `compile_waiting` (Gauge).
    """

    def __init__(self, num_workers: int, known_tokenizers: Callable[[], list[tuple[str, str]]], *,
                 max_workers: int = 0, lane_after_seconds: float = 0.5, ship_above_seconds: float = 1.0,
                 idle_retire_seconds: float = 60.0, metrics=None, supervise_interval_seconds: float = 0.05,
                 respawn_backoff_seconds: tuple[float, float] = (0.5, 30.0),
                 spawn: Callable[[], _Worker] | None = None, memory_limit_bytes: int = 0):
        self._base = num_workers
        self._max = max(max_workers, num_workers)
        self._known_tokenizers = known_tokenizers
        self.lane_after_seconds = lane_after_seconds
        self.ship_above_seconds = ship_above_seconds
        self.idle_retire_seconds = idle_retire_seconds
        self._metrics = metrics
        self._tick = supervise_interval_seconds
        self._backoff_min, self._backoff_max = respawn_backoff_seconds
        self.memory_limit_bytes = memory_limit_bytes
        self._factory = WorkerFactory(memory_limit_bytes=memory_limit_bytes) if spawn is None else None
        self._spawn = spawn or self._factory
        self._all: set[_Worker] = set()
        self._idle: collections.deque[_Worker] = collections.deque()
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._starting = 0
        self._spawn_failures_in_row = 0
        self._next_spawn_at = 0.0
        self._closed = False
        self._started = False
        self._supervisor: asyncio.Task | None = None
        self._background: set[asyncio.Future] = set()
        # Threads for pipe reads, spawns and reaps; enough that none of them ever queues behind another.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=4 * self._max + 4, thread_name_prefix="structd-compile")
        self._executor_closed = False
        # Workers the pool killed (deadline or abandoned).
        self.kills = 0

    # ------------------------------------------------------------------ state

    @property
    def base_workers(self) -> int:
        return self._base

    @property
    def idle_workers(self) -> int:
        return len(self._idle)

    @property
    def busy_workers(self) -> int:
        return len(self._all) - len(self._idle)

    @property
    def starting_workers(self) -> int:
        return self._starting

    @property
    def waiting_jobs(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    def _held_long(self, now: float) -> int:
        """Workers held by one job for lane_after_seconds or more (wall time: what the queue waits on)."""
        return sum(1 for w in self._all
                   if w.job_started is not None and now - w.job_started >= self.lane_after_seconds)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Starts the base workers; fails if not one of them starts (a broken install)."""
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*[loop.run_in_executor(self._executor, self._new_worker)
                                         for _ in range(self._base)], return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for w in results:
            if isinstance(w, _Worker):
                self._add(w)
        if len(errors) == len(results):
            if self._factory is not None:
                await loop.run_in_executor(self._executor, self._factory.close)
            raise RuntimeError(f"no compile worker could start: {errors[0]!r}")
        for e in errors:
            self._spawn_failed(e)
        self._started = True
        self._supervisor = asyncio.create_task(self._supervise(), name="structd-compile-supervisor")

    async def close(self) -> None:
        self._closed = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(UnavailableError("grammar service is shutting down"))
        workers = list(self._all)
        self._all.clear()
        self._idle.clear()
        for w in workers:
            w.signal_kill()
            self._reap_later(w)
        # Until none is left: a spawn that finishes now kills its new worker and adds that worker's reap
        # to _background, and no worker may outlive the service.
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._factory is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._factory.close)
        self._executor_closed = True
        self._executor.shutdown(wait=False)

    def _new_worker(self) -> _Worker:
        """Starts a worker that already holds every registered tokenizer (blocking)."""
        worker = self._spawn()
        try:
            for fingerprint, info_json in self._known_tokenizers():
                worker.load_tokenizer(fingerprint, info_json)
        except (EOFError, OSError) as e:  # the new child's failure: it died while loading a tokenizer
            worker.signal_kill()
            worker.reap()
            raise RuntimeError(f"compile worker died while loading a tokenizer ({e!r})") from None
        return worker

    def _add(self, worker: _Worker) -> None:
        self._all.add(worker)
        self._release(worker)

    # ------------------------------------------------------------------ compile

    async def compile(self, fingerprint: str, info_json: str, spec: GrammarSpec, timeout_seconds: float) -> CompileOutput:
        """Compiles on a worker; timeout_seconds bounds the wait for a free worker and the
        compilation together (loading a tokenizer into a worker does not count).

        Raises WorkersBusyError, CompileTimeoutError, WorkerCrashedError (the caller
        decides whether to retry), InvalidGrammarError or UnavailableError.
        """
        if self._closed:
            raise UnavailableError("grammar service is shutting down")
        if not self._started:
            raise UnavailableError("grammar service is starting: its compile workers are not up yet; retry shortly")
        asked = time.monotonic()
        queued = not self._idle
        worker = await self._acquire(timeout_seconds)
        loop = asyncio.get_running_loop()
        stage = "tokenizer"
        tokenizer_seconds = 0.0
        try:
            worker.job_started = time.monotonic()
            if fingerprint not in worker.tokenizers:
                await self._read(loop, worker, worker.load_tokenizer, fingerprint, info_json)
                tokenizer_seconds = time.monotonic() - worker.job_started
            stage = "compile"
            # What the wait for a worker left of the deadline: a compile queued for most of it is not given the
            # whole again (the request's deadline would pass before its answer).
            left = timeout_seconds - (time.monotonic() - asked - tokenizer_seconds)
            if left <= 0:
                # The wait took it all: sent, the compile would be stopped at once and the worker killed with it.
                self._release(worker)
                raise WorkersBusyError(
                    f"{spec.kind.value} compilation's {timeout_seconds:g} s deadline passed waiting for a free "
                    "compile worker (all busy); retry later")
            worker.start_compile()
            reply = await asyncio.wait_for(
                asyncio.shield(self._read(loop, worker, worker.compile, fingerprint, spec, self.ship_above_seconds)),
                max(0.0, left))
        except asyncio.TimeoutError:
            self._remove(worker, DEADLINE)
            if not queued:
                raise CompileTimeoutError(
                    f"{spec.kind.value} compilation exceeded its {timeout_seconds:g} s deadline and was stopped; "
                    "simplify the constraint or raise timeout_seconds") from None
            if left < timeout_seconds / 2:
                raise WorkersBusyError(
                    f"{spec.kind.value} compilation ran out of its {timeout_seconds:g} s deadline, most of it spent "
                    "waiting for a free compile worker (all busy); retry later") from None
            # Queued, but compiled for most of its deadline: the grammar is slow, and the caller may remember
            # that for as long as it compiled; a wait of a moment counts as none (remembered for the deadline,
            # as an unqueued timeout is: the same deadline asked again is answered from the cache).
            waited = timeout_seconds - left
            raise CompileTimeoutError(
                f"{spec.kind.value} compilation exceeded its {timeout_seconds:g} s deadline and was stopped after "
                f"compiling for {left:.3g} s of it (it waited for a free compile worker first); simplify the "
                "constraint or raise timeout_seconds",
                ran_seconds=left if waited > SHORT_WAIT_SHARE * timeout_seconds else None) from None
        except (EOFError, OSError) as e:  # the worker process's failure: it died under this job
            self._remove(worker, CRASHED)
            if self._closed:
                raise UnavailableError("grammar service is shutting down") from None
            raise WorkerCrashedError(f"compile worker died during {stage} ({e!r})",
                                     during_compile=stage == "compile") from None
        except asyncio.CancelledError:
            # Nobody waits for this compile any more: its answer would be stale, and the core is wanted.
            self._remove(worker, ABANDONED)
            raise
        status = reply[0]
        if status == "memory":
            self._remove(worker, MEMORY)  # it exits after answering
            raise RequestTooLargeError(
                f"{spec.kind.value}: compiling it needed more than the compile worker's "
                f"{self.memory_limit_bytes} bytes of address space (--worker-memory-limit-bytes); simplify the "
                "constraint")
        self._release(worker)
        if status == "ok":
            _, serialized, warnings, duration, memory = reply
            return CompileOutput(serialized, tuple(warnings), duration, memory, tokenizer_seconds)
        if status == "invalid":
            raise InvalidGrammarError(f"{spec.kind.value}: {reply[1]}")
        if status == "too_large":
            raise RequestTooLargeError(f"{spec.kind.value}: {reply[1]}")
        raise RuntimeError(f"compile worker failed: {reply[1]}")

    def _read(self, loop, worker: _Worker, fn, *args) -> asyncio.Future:
        """Runs one blocking request/reply on the pool's threads; the worker remembers the reader."""
        cfut = self._executor.submit(fn, *args)
        worker.reader = cfut
        fut = asyncio.wrap_future(cfut, loop=loop)
        fut.add_done_callback(_consume)
        return fut

    async def _acquire(self, timeout: float) -> _Worker:
        while self._idle:
            worker = self._idle.pop()  # the most recently used: extras left idle age out
            if worker.alive:
                worker.job_started = time.monotonic()
                return worker
            self._remove(worker, CRASHED)
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._ensure_capacity()
        self._set_gauges()
        try:
            async with asyncio.timeout(timeout):
                return await fut
        except (TimeoutError, asyncio.CancelledError) as e:  # this job gave up: its deadline, or its caller left
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Handed a worker just as it gave up: pass the worker on.
                self._release(fut.result())
            else:
                fut.cancel()
            try:
                self._waiters.remove(fut)
            except ValueError:  # our own bookkeeping: _release already took it off the list
                pass
            self._set_gauges()
            if isinstance(e, TimeoutError):
                raise WorkersBusyError(
                    f"no compile worker became free within {timeout:g} s (all busy); retry later") from None
            raise

    def _release(self, worker: _Worker) -> None:
        """A worker is free: to the first live waiter, else to the idle list."""
        worker.job_started = None
        worker.compiling = False
        worker.compile_cpu_start = None
        worker.long = False
        worker.reader = None
        if not worker.alive:
            self._remove(worker, CRASHED)
            return
        if worker.reniced or worker.stale:
            # Stuck at low priority (and often bloated by a big grammar), or holding an evicted
            # tokenizer: a fresh fork takes its place.
            self._retire(worker)
            self._ensure_capacity()
            self._set_gauges()
            return
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                worker.job_started = time.monotonic()
                fut.set_result(worker)
                self._set_gauges()
                return
        worker.idle_since = time.monotonic()
        self._idle.append(worker)
        self._set_gauges()

    def _remove(self, worker: _Worker, reason: str) -> None:
        """Takes a worker out of the pool (killed here or found dead) and reaps it off the loop."""
        self._all.discard(worker)
        try:
            self._idle.remove(worker)
        except ValueError:  # our own bookkeeping: it was busy, not idle
            pass
        if self._closed:
            # Shutting down: close() killed it; not a restart.
            worker.signal_kill()
            self._reap_later(worker)
            return
        if reason in (DEADLINE, ABANDONED):
            self.kills += 1
        else:
            log.warning("compile worker %d died; starting another", worker.proc.pid)
        if self._metrics is not None:
            self._metrics.compile_worker_restarts.labels(reason).inc()
        worker.signal_kill()
        self._reap_later(worker)
        self._ensure_capacity()
        self._set_gauges()

    def _retire(self, worker: _Worker) -> None:
        """An extra worker that stayed idle, or one that ran a long compile: not a restart."""
        self._all.discard(worker)
        try:
            self._idle.remove(worker)
        except ValueError:  # our own bookkeeping: it was just released, not idle
            pass
        worker.signal_kill()
        self._reap_later(worker)

    def forget_tokenizer(self, fingerprint: str) -> None:
        """An evicted tokenizer: workers holding it are replaced (idle ones now, busy ones when free);
        new workers load only the registered tokenizers. Call on the event loop."""
        for worker in list(self._all):
            if fingerprint not in worker.tokenizers:
                continue
            worker.stale = True
            if worker in self._idle:
                self._retire(worker)
        self._ensure_capacity()
        self._set_gauges()

    def _reap_later(self, worker: _Worker) -> None:
        if self._executor_closed:
            # After close(): the process is killed already; a daemon thread collects it.
            threading.Thread(target=worker.reap, daemon=True, name="structd-compile-reap").start()
            return
        fut = asyncio.wrap_future(self._executor.submit(worker.reap))
        self._background.add(fut)
        fut.add_done_callback(self._background.discard)
        fut.add_done_callback(_consume)

    # ------------------------------------------------------------------ supervision

    def _ensure_capacity(self) -> None:
        """Spawns what the pool lacks: the base workers always, lanes while jobs wait behind long compiles."""
        if self._closed or not self._started:
            return
        now = time.monotonic()
        if now < self._next_spawn_at:
            return
        have = len(self._all) + self._starting
        target = min(self._max, self._base + self._held_long(now))
        want = max(self._base - have, min(target - have, self.waiting_jobs - self._starting))
        for _ in range(max(0, want)):
            self._start_spawn()

    def _start_spawn(self) -> None:
        self._starting += 1
        t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor, self._new_worker)
        self._background.add(fut)

        def done(f: asyncio.Future) -> None:
            self._background.discard(f)
            self._starting -= 1
            if f.cancelled():
                return
            e = f.exception()
            if e is not None:
                self._spawn_failed(e)
                return
            worker = f.result()
            if self._closed:
                worker.signal_kill()
                self._reap_later(worker)
                return
            self._spawn_failures_in_row = 0
            log.info("compile worker %d started in %.1f s (%d workers)", worker.proc.pid, time.monotonic() - t0,
                     len(self._all) + 1)
            self._add(worker)

        fut.add_done_callback(done)
        self._set_gauges()

    def _spawn_failed(self, e: BaseException) -> None:
        self._spawn_failures_in_row += 1
        if self._metrics is not None:
            self._metrics.compile_worker_spawn_failures.inc()
        delay = min(self._backoff_max, self._backoff_min * 2 ** (self._spawn_failures_in_row - 1))
        self._next_spawn_at = time.monotonic() + delay
        log.error("compile worker failed to start (%r); retrying in %.1f s", e, delay)

    async def _supervise(self) -> None:
        """Finds workers that died idle, retires idle extras, opens lanes, respawns; keeps the gauges."""
        while True:
            await asyncio.sleep(self._tick)
            try:
                self.check()
            except Exception:  # noqa: BLE001 - our own bug: log it, keep supervising (the pool must not go unwatched)
                log.exception("compile pool supervision failed")

    def check(self) -> None:
        """One supervision pass (the supervisor runs it every tick)."""
        now = time.monotonic()
        for w in [w for w in self._idle if not w.alive]:
            self._remove(w, CRASHED)
        for w in self._all:
            # Lower priority by CPU used, not by age: a short compile slowed by a loaded machine
            # keeps its priority (lanes, above, go by age: the queue waits on wall time).
            if w.compiling and not w.long and w.compile_seconds_used(now) >= self.lane_after_seconds:
                w.long = True
                w.renice(LONG_COMPILE_NICE)
        extra = len(self._all) - self._base
        for w in sorted(self._idle, key=lambda w: w.idle_since):
            if extra <= 0:
                break
            if now - w.idle_since >= self.idle_retire_seconds:
                self._retire(w)
                extra -= 1
        self._ensure_capacity()
        self._set_gauges()

    def _set_gauges(self) -> None:
        m = self._metrics
        if m is None:
            return
        m.compile_workers.labels("idle").set(len(self._idle))
        m.compile_workers.labels("busy").set(len(self._all) - len(self._idle))
        m.compile_workers.labels("starting").set(self._starting)
        m.compile_waiting.set(self.waiting_jobs)
