"""Launchers for the services under a benchmark or a test: a child process, or a thread of this process.

`ChildService`: a `structd <service>` child process on a free loopback port.
A separate process, so a benchmark's client and the service never share a
GIL: client-side work does not show up as service time, and service threads
do not slow the client. The service picks its gRPC port (port 0) and
announces it on stdout ("... listening on HOST:PORT"); its /metrics port is
chosen here. Output goes to a log file beside the benchmark's results.

`ServiceThread`: a service (anything with async start() and stop(grace)) run
on a private event loop in a daemon thread. Tests and in-process benchmarks
use it to reach a real server over real gRPC on loopback while still being
able to look at its internals: `call` runs a coroutine on the server's loop,
`run_sync` a plain function there (engine state is only touched on that loop).
A server that cannot start raises its reason at once (its SystemExit as
RuntimeError), one that does not start in time says which await it is on,
and either is stopped before the error reaches the starter.

`GrammarTier`: K grammar replicas seen as one (addresses, samples, CPU).
`grammar_and_inference`: the pair most benchmarks need, grammar replica(s)
and an inference service wired to them, as children stopped in order.
Children that do not wait for each other start side by side (each is spawned,
then each waited for): the replicas of a tier, and the inference service
beside its replicas (told their ports up front, it loads its model while they
start, then waits for the grammar tier, as it does in a cluster).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from shared.ports import free_port
from structd.bench.harness.metrics import parse_metrics

REPO = Path(__file__).resolve().parents[3]

log = logging.getLogger(__name__)


def process_and_children(pid: int) -> list[int]:
    """`pid` and the processes it started that still run (an inference service's engine core)."""
    try:
        return [pid, *(int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    except (OSError, ValueError):
        return [pid]  # the process's: it is gone, or has no children file to read


class ChildService:
    """A `python -m structd <service>` child on port 0 (or `port`: a restart on the address clients already
    use); the port comes from its 'listening on' line. Made with wait=False it is only spawned: `wait_listening`
    then waits for that line (children started side by side)."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 600.0, *, port: int = 0,
                 metrics_port: int | None = None, wait: bool = True):
        self.metrics_port = metrics_port or free_port()
        self.cmd = [sys.executable, "-m", "structd", *args, "--host", "127.0.0.1", "--port", str(port),
                    "--metrics-port", str(self.metrics_port), "--log-level", "WARNING", "--grace-seconds", "1"]
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")  # noqa: SIM115 - open for the child's lifetime, closed in stop()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self._log,
                                     stdin=subprocess.DEVNULL)
        self._found: list[str] = []
        pattern = re.compile(r"listening on (\S+):(\d+)")

        def reader():
            for raw in self.proc.stdout:
                self._log.write(raw)
                self._log.flush()
                m = pattern.search(raw.decode("utf-8", "replace"))
                if m and not self._found:
                    self._found.append(f"{m.group(1)}:{m.group(2)}")

        threading.Thread(target=reader, daemon=True, name=f"{args[0]}-stdout").start()
        self._timeout = timeout
        self._deadline = time.monotonic() + timeout
        self.target = ""
        if wait:
            self.wait_listening()

    def wait_listening(self) -> None:
        """Blocks until the child says where it listens (self.target); SystemExit when it exits first or does
        not within its timeout (counted from its spawn)."""
        name = self.cmd[3]
        while not self._found:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} service exited with {self.proc.returncode} before listening; "
                                 f"see {self.log_path}")
            if time.monotonic() > self._deadline:
                self.stop()
                raise SystemExit(f"{name} service did not start within {self._timeout:g} s; see {self.log_path}")
            time.sleep(0.05)
        self.target = self._found[0]

    def cpu_seconds(self, with_children: bool = False) -> float | None:
        """User + system CPU time of the service process so far; with_children: and of the processes it
        started that are still running (an inference server's engine core; a grammar server's compile
        workers come and go, so they are left out there)."""
        pids = process_and_children(self.proc.pid) if with_children else [self.proc.pid]
        total = 0.0
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, IndexError, ValueError):
                if pid == self.proc.pid:
                    return None
        return total

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30) as r:
            return r.read().decode("utf-8")

    def begin_stop(self) -> None:
        """SIGTERM without waiting: several services drain side by side, then `stop` waits for each."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.begin_stop()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()


async def _contained(coro):
    """`coro`, with a SystemExit (a server that cannot start says why that way) raised as RuntimeError: asyncio
    lets SystemExit out of the event loop, which ends the loop's thread before the caller's future is resolved,
    so the caller would wait out its whole timeout and never hear the reason."""
    try:
        return await coro
    except SystemExit as e:
        raise RuntimeError(f"SystemExit: {e}") from None


def _awaiting(coro) -> list[str]:
    """Where a suspended coroutine waits, outermost first ("file:line in function" down its await chain)."""
    chain = []
    while (frame := getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)) is not None:
        chain.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return chain


class ServiceThread:
    def __init__(self, server, name: str, start_timeout: float = 600.0, *,
                 give_up: Callable[[list[str]], bool] | None = None, **start_kwargs):
        """give_up: asked, while the start runs, with where it waits (as in the TimeoutError's message,
        outermost first); once it says so, the start is given up as if start_timeout had passed (a test whose
        server is known to wait for ever there need not wait out a timeout sized for a slow machine)."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()
        self.server = server
        starting = server.start(**start_kwargs)
        started = time.monotonic()
        try:
            if give_up is None:
                self.call(starting, timeout=start_timeout)
            else:
                self._start_unless(starting, start_timeout, give_up)
        except TimeoutError:
            waits = " -> ".join(_awaiting(starting)) or "nothing (its loop is blocked)"
            self._abandon(name)
            raise TimeoutError(f"{name} did not start within {time.monotonic() - started:.0f} s; its start() "
                               f"waits at {waits}") from None
        except Exception:  # the server's: it could not start
            self._abandon(name)
            raise

    def _start_unless(self, starting, timeout: float, give_up: Callable[[list[str]], bool]) -> None:
        future = asyncio.run_coroutine_threadsafe(_contained(starting), self.loop)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return future.result(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                if future.done() or time.monotonic() >= deadline or give_up(_awaiting(starting)):
                    raise

    def _abandon(self, name: str) -> None:
        """After a failed start: whatever the server did start is stopped, so the starter hears the start's
        error and no listener, engine core or loop thread is left behind."""
        try:
            self.stop()
        except Exception:  # noqa: BLE001 - a half-started server's stop; the start's error is the one to see
            log.exception("stopping %s after its failed start", name)

    def call(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(_contained(coro), self.loop).result(timeout)

    def run_sync(self, fn, timeout: float = 30.0):
        async def go():
            return fn()

        return self.call(go(), timeout)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        """Idempotent: a test may stop a server early (a lost replica); its fixture stops it again."""
        if not self._thread.is_alive():
            return
        self.call(self.server.stop(0), timeout=60.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class InProcessService(ServiceThread):
    """A server on a thread of this process, with the ChildService interface."""

    def cpu_seconds(self, with_children: bool = False) -> float | None:
        return None  # shares this process with the client

    def metrics_text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.server.metrics.registry).decode("utf-8")


class GrammarTier:
    """K grammar replicas seen as one: the inference service is given every address and spreads its sessions
    over them (inference_svc/grammar/grammar_tier.py); a benchmark reads each replica's samples and the tier's
    CPU seconds added. By default each replica is a `structd grammar` child with `flags`, all spawned before
    any is waited for, on `ports` where given (0 or none: the child picks); `start(log)` starts one replica
    otherwise (an in-process server, one at a time). wait=False: spawned only (`wait_listening` next)."""

    def __init__(self, logs: list[Path], flags: tuple[str, ...] = (), start=None, *,
                 ports: Sequence[int] | None = None, wait: bool = True):
        self.services: list = []
        try:
            if start is None:
                for log, port in zip(logs, ports if ports is not None else [0] * len(logs), strict=True):
                    self.services.append(ChildService(["grammar", *flags], log, port=port, wait=False))
                if wait:
                    self.wait_listening()
                return
            for log in logs:
                self.services.append(start(log))
        except BaseException:  # a replica's start failed (or was interrupted): the ones up are stopped
            self.stop()
            raise

    def wait_listening(self) -> None:
        """Waits for every child replica to listen (each spawned with wait=False); SystemExit as ChildService's."""
        for s in self.services:
            if isinstance(s, ChildService):
                s.wait_listening()

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(s.target for s in self.services)

    def metrics(self) -> list[dict[str, float]]:
        """Each replica's samples now, in replica order."""
        return [parse_metrics(s.metrics_text()) for s in self.services]

    def cpu_seconds(self) -> float | None:
        seconds = [s.cpu_seconds() for s in self.services]
        return None if any(v is None for v in seconds) else sum(seconds)

    def stop(self) -> None:
        # Child replicas drain and exit side by side (each exit waits on its own process's teardown).
        for s in self.services:
            if isinstance(s, ChildService):
                s.begin_stop()
        for s in self.services:
            s.stop()


@contextmanager
def grammar_and_inference(logs: Path, name: str, *, replicas: int = 1, grammar_flags: tuple[str, ...] = (),
                          inference_flags: tuple[str, ...] = ()) -> Iterator[tuple[GrammarTier, ChildService]]:
    """`replicas` grammar children and an inference child wired to them, started side by side (logs
    <logs>/<name>-grammar[i].log and <name>-inference.log); on leaving, or when a start fails, the inference
    service stops first (it drains while the grammar tier still answers), then the replicas."""
    ports = [free_port() for _ in range(replicas)]
    grammar = GrammarTier([logs / (f"{name}-grammar.log" if replicas == 1 else f"{name}-grammar{i}.log")
                           for i in range(replicas)], grammar_flags, ports=ports, wait=False)
    inference = None
    try:
        inference = ChildService(["inference", "--grammar-target", ",".join(f"127.0.0.1:{p}" for p in ports),
                                  *inference_flags], logs / f"{name}-inference.log", wait=False)
        # The replicas first: the inference service says it listens only once it has a grammar tier.
        grammar.wait_listening()
        inference.wait_listening()
        yield grammar, inference
    finally:
        if inference is not None:
            inference.stop()
        grammar.stop()
