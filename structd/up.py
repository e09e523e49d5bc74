"""`structd up`: run the grammar replica(s), the inference service and the HTTP gateway locally as supervised
child processes.

Each service runs as its own `structd <service>` process, exactly as it would
in a container. All of them start at once (the inference service loads its
model while the grammar replicas start, then waits for the grammar tier as it
does in a cluster). Once every one reports SERVING on grpc.health.v1, `up` prints
where they listen (and each child's pid); the gateway, which speaks HTTP,
is ready once its /health answers 200. From then on it supervises them as
a process manager would: a child that exits, whatever its exit code, is
started again with the same command line (so on the same ports) after an
exponential back-off, and one line says which service exited, how, and when
it comes back. A restarted grammar replica rejoins by itself: the inference
service's grammar tier hands it the tokenizer again (`GrammarTier.maintain`).
On SIGINT/SIGTERM/SIGHUP `up` forwards SIGTERM (graceful drain) to the gateway
first, then the inference service, waits for each, then to the grammar replicas.

A child that fails during the first start-up is a configuration error, not a
crash: `up` stops everything and exits 1 instead of retrying it forever.

With --tls-cert-file/--tls-key-file/--tls-ca-file both gRPC services serve
that certificate and require client certificates signed by the CA, the
inference service and the gateway present that same certificate as their
client identity, and the gateway serves HTTPS with it; `up`'s own health
checks present it too.
"""

from __future__ import annotations

import argparse
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.grpc_options import POLL_CHANNEL_OPTIONS
from shared.tls import ClientTls, sync_channel

STARTUP_TIMEOUT_SECONDS = 600.0
INITIAL_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0
# A child that stayed up this long had a real run rather than a start-up failure, so its next restart
# starts again from the initial back-off; a child that keeps failing soon after start keeps doubling it.
STABLE_SECONDS = 30.0
# How often the supervisor looks at its children (the cost of a look is one waitpid per child), and a start
# at whether its service is ready.
POLL_SECONDS = 0.2
# The inference service drains in-flight requests for its grace period (10 s by default) before it exits.
STOP_TIMEOUT_SECONDS = 30.0


def _poll(ready: Callable[[], bool], what: str, proc: subprocess.Popen, timeout: float,
          stop: threading.Event | None) -> bool:
    """Polls ready() until it is true (True) or stop is set (False); fails early if proc exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            return False
        if proc.poll() is not None:
            raise RuntimeError(f"service for {what} exited with code {proc.returncode} during start-up")
        if ready():
            return True
        time.sleep(POLL_SECONDS)
    raise TimeoutError(f"{what} did not become ready within {timeout:.0f} s")


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = STARTUP_TIMEOUT_SECONDS,
                 stop: threading.Event | None = None, tls: ClientTls | None = None) -> bool:
    """Blocks until target answers SERVING (True) or stop is set (False); fails early if proc exits.
    tls: how to dial it (None: plaintext)."""
    with sync_channel(target, tls, POLL_CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def serving() -> bool:
            try:
                return stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == \
                    health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False  # the child's: not listening yet, or still loading; polled again until the deadline

        return _poll(serving, target, proc, timeout, stop)


def wait_http_ok(url: str, proc: subprocess.Popen, timeout: float = STARTUP_TIMEOUT_SECONDS,
                 stop: threading.Event | None = None, tls: ClientTls | None = None) -> bool:
    """wait_serving for an HTTP service: blocks until GET url answers 200 (True) or stop is set (False).
    tls: the CA an https url's certificate must come from."""
    context = ssl.create_default_context(cafile=str(tls.ca_file)) if tls is not None and tls.ca_file else None

    def ok() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2.0, context=context) as r:
                return r.status == 200
        except OSError:
            return False  # the child's: not listening yet, or its upstream not SERVING yet (503); polled again

    return _poll(ok, url, proc, timeout, stop)


def tls_of(args: argparse.Namespace) -> ClientTls | None:
    """up's TLS flags as the identity every hop presents and the CA it trusts (None: plaintext everywhere)."""
    if args.tls_cert_file is None and args.tls_key_file is None and args.tls_ca_file is None:
        return None
    return ClientTls(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)


def _serve_flags(tls: ClientTls | None, *, mutual: bool = True) -> list[str]:
    if tls is None:
        return []
    return ["--tls-cert-file", str(tls.cert_file), "--tls-key-file", str(tls.key_file),
            *(["--tls-client-ca-file", str(tls.ca_file)] if mutual else [])]


def _dial_flags(prefix: str, tls: ClientTls | None) -> list[str]:
    if tls is None:
        return []
    return [f"{prefix}-ca-file", str(tls.ca_file), f"{prefix}-cert-file", str(tls.cert_file),
            f"{prefix}-key-file", str(tls.key_file)]


def grammar_command(host: str, port: int, metrics_port: int, log_level: str,
                    tls: ClientTls | None = None) -> list[str]:
    return [sys.executable, "-m", "structd", "grammar", "--host", host, "--port", str(port),
            "--metrics-port", str(metrics_port), "--log-level", log_level, *_serve_flags(tls)]


def inference_command(args: argparse.Namespace, grammar_targets: list[str]) -> list[str]:
    tls = tls_of(args)
    cmd = [sys.executable, "-m", "structd", "inference", "--host", args.host, "--port", str(args.port),
           "--metrics-port", str(args.metrics_port), "--grammar-target", ",".join(grammar_targets),
           "--tp", str(args.tp), "--log-level", args.log_level, *_serve_flags(tls),
           *_dial_flags("--grammar-tls", tls)]
    if args.model:
        cmd += ["--model", str(args.model)]
    return cmd


def gateway_command(args: argparse.Namespace, inference_target: str) -> list[str]:
    tls = tls_of(args)
    # HTTPS without client certificates: the gateway's callers are HTTP clients (SDKs, curl), not the tiers.
    return [sys.executable, "-m", "structd", "gateway", "--target", inference_target, "--host", args.host,
            "--port", str(args.gateway_port), "--log-level", args.log_level, *_serve_flags(tls, mutual=False),
            *_dial_flags("--target-tls", tls)]


def describe_exit(returncode: int | None) -> str:
    """'code 1', 'code -9 (SIGKILL)', or why there was no process at all."""
    if returncode is None:
        return "no exit code (it could not be started)"
    if returncode < 0:
        try:
            return f"code {returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"code {returncode}"
    return f"code {returncode}"


class Backoff:
    """Exponential back-off: initial, doubling up to maximum; reset() goes back to initial."""

    def __init__(self, initial: float = INITIAL_BACKOFF_SECONDS, maximum: float = MAX_BACKOFF_SECONDS):
        if initial <= 0 or maximum < initial:
            raise ValueError("back-off needs 0 < initial <= maximum")
        self.initial = initial
        self.maximum = maximum
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.maximum, self._next * 2)
        return delay

    def reset(self) -> None:
        self._next = self.initial


@dataclass
class Child:
    """One supervised service: how to start it, and where it is in its life."""

    name: str  # "grammar replica 1", "inference service", "gateway"
    target: str  # its gRPC address (for health checks) or, for the gateway, its HTTP address
    command: list[str]
    backoff: Backoff = field(default_factory=Backoff)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restart_at: float | None = None  # set while a back-off runs: when to start it again
    restarts: int = 0
    # An HTTP service's readiness URL (200 = ready); None: grpc.health.v1 on target.
    health_url: str | None = None
    # How its health is checked: the CA and client certificate (None: plaintext).
    tls: ClientTls | None = None

    def start(self) -> None:
        # Its own process group: a terminal's Ctrl-C reaches `up` alone, which then stops the services in
        # order (inference first) instead of all of them draining at once.
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, process_group=0)
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_SECONDS, stop: threading.Event | None = None,
                   proc: subprocess.Popen | None = None) -> bool:
        proc = proc or self.proc
        try:
            if self.health_url is not None:
                return wait_http_ok(self.health_url, proc, timeout, stop, self.tls)
            return wait_serving(self.target, proc, timeout, stop, self.tls)
        except (RuntimeError, TimeoutError) as e:  # the child's: said with its name (they start side by side)
            raise type(e)(f"{self.name}: {e}") from None


class Supervisor:
    """Restarts children that exit, with back-off; stops them all, gateway and inference first, on request."""

    def __init__(self, grammar: list[Child], inference: Child | None, stop: threading.Event, *,
                 stable_seconds: float = STABLE_SECONDS, stop_timeout: float = STOP_TIMEOUT_SECONDS,
                 startup_timeout: float = STARTUP_TIMEOUT_SECONDS, out: TextIO | None = None,
                 gateway: Child | None = None):
        self.grammar = grammar
        self.inference = inference
        self.gateway = gateway
        self.stop = stop
        self.stable_seconds = stable_seconds
        self.stop_timeout = stop_timeout
        self.startup_timeout = startup_timeout
        self.out = out or sys.stdout
        self._watchers: list[threading.Thread] = []

    @property
    def children(self) -> list[Child]:
        return self.grammar + [c for c in (self.inference, self.gateway) if c is not None]

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def run(self) -> None:
        """Supervises until stop is set."""
        while not self.stop.is_set():
            self.tick(time.monotonic())
            self.stop.wait(POLL_SECONDS)

    def tick(self, now: float) -> None:
        """One look at every child: schedules the restart of one that exited, starts one whose back-off is over."""
        for c in self.children:
            if self.stop.is_set():
                return  # stop_all() takes over; a child that exits now is not restarted
            if c.restart_at is None:
                if c.proc is not None and c.proc.poll() is None:
                    continue
                self._exited(c, now)
            elif now >= c.restart_at:
                self._restart(c)

    def _exited(self, c: Child, now: float) -> None:
        code = c.proc.returncode if c.proc is not None else None
        uptime = now - c.started_at
        if uptime >= self.stable_seconds:
            c.backoff.reset()
        delay = c.backoff.next()
        c.restart_at = now + delay
        c.restarts += 1
        self.say(f"{c.name} (pid {c.pid}) exited with {describe_exit(code)} after {uptime:.1f} s; "
                 f"restart {c.restarts} in {delay:g} s on {c.target}")

    def _restart(self, c: Child) -> None:
        c.restart_at = None
        try:
            c.start()
        except OSError as e:
            # The machine's (no memory, no process slots): counted as an exit, so the back-off grows.
            self.say(f"{c.name} could not be started: {e}")
            c.proc = None
            c.started_at = time.monotonic()
            return
        proc = c.proc
        watcher = threading.Thread(target=self._announce, args=(c, proc), daemon=True,
                                   name=f"up-watch-{c.name}")
        self._watchers = [w for w in self._watchers if w.is_alive()] + [watcher]
        watcher.start()

    def _announce(self, c: Child, proc: subprocess.Popen) -> None:
        """Says when a restarted child serves again (the loop in run() never blocks on a start-up)."""
        try:
            if c.wait_ready(self.startup_timeout, self.stop, proc):
                self.say(f"{c.name} SERVING again on {c.target} (pid {proc.pid})")
        except RuntimeError:
            pass  # the child's: it exited during start-up; run() reports the exit and backs off further
        except TimeoutError as e:  # named by wait_ready
            self.say(f"warning: {e}")

    def stop_all(self) -> None:
        """SIGTERM to the gateway, then the inference service, and wait for each (each drains while what it
        calls still answers), then to the grammar replicas; a child that outlives stop_timeout is killed."""
        for group in ([self.gateway] if self.gateway is not None else [],
                      [self.inference] if self.inference is not None else [], self.grammar):
            procs = [c.proc for c in group if c.proc is not None]
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout
            for p in procs:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)
        for w in self._watchers:
            w.join(timeout=5)


def run_up(args: argparse.Namespace) -> int:
    if args.grammar_replicas < 1:
        print("error: --grammar-replicas must be at least 1", file=sys.stderr)
        return 2
    if not 0 <= args.gateway_port <= 65535:
        print("error: --gateway-port must be 0..65535 (0: no gateway)", file=sys.stderr)
        return 2
    tls = tls_of(args)
    if tls is not None:
        problems = tls.problems()
        if tls.ca_file is None or tls.cert_file is None:
            problems.insert(0, "--tls-cert-file, --tls-key-file and --tls-ca-file go together (mutual TLS on "
                               "both hops)")
        if problems:
            print(f"error: {'; '.join(problems)}", file=sys.stderr)
            return 2
    stop = threading.Event()
    # SIGHUP too: the children are in their own process groups, so a closed terminal reaches only `up`.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    grammar = [Child(f"grammar replica {i + 1}", f"{args.host}:{args.grammar_port + i}",
                     grammar_command(args.host, args.grammar_port + i, args.grammar_metrics_port + i, args.log_level,
                                     tls), tls=tls)
               for i in range(args.grammar_replicas)]
    inference_target = f"{args.host}:{args.port}"
    inference = Child("inference service", inference_target,
                      inference_command(args, [c.target for c in grammar]), tls=tls)
    gateway_address = f"{args.host}:{args.gateway_port}"
    gateway_url = f"{'https' if tls else 'http'}://{gateway_address}"
    gateway = Child("gateway", gateway_address, gateway_command(args, inference_target),
                    health_url=f"{gateway_url}/health", tls=tls) if args.gateway_port else None
    sup = Supervisor(grammar, inference, stop, gateway=gateway)
    try:
        # Every service at once: the inference service loads its model while the grammar replicas start (it
        # waits for the grammar tier itself), and the gateway says ready once the inference service serves. Up
        # in the time of the slowest start rather than the sum of them; waited for in order, so a failure is
        # reported for the service it is in.
        for c in sup.children:
            c.start()
        for i, c in enumerate(grammar):
            print(f"starting grammar replica {i + 1}/{len(grammar)} on {c.target} ...", flush=True)
            if not c.wait_ready(stop=stop):
                return 0
        print(f"starting inference service on {inference_target} (loads the model; the embedded one is built "
              "on first use) ...", flush=True)
        if not inference.wait_ready(stop=stop):
            return 0
        if gateway is not None:
            print(f"starting the gateway on {gateway_url} ...", flush=True)
            if not gateway.wait_ready(stop=stop):
                return 0
        for i, c in enumerate(grammar):
            print(f"grammar replica {i + 1}: grpc {c.target}  metrics "
                  f"http://{args.host}:{args.grammar_metrics_port + i}/metrics  pid {c.pid}", flush=True)
        print(f"inference service: grpc {inference_target}  metrics http://{args.host}:{args.metrics_port}/metrics  "
              f"pid {inference.pid}", flush=True)
        if gateway is not None:
            print(f"gateway (OpenAI API): {gateway_url}/v1  metrics {gateway_url}/metrics  "
                  f"pid {gateway.pid}", flush=True)
        dial = " ".join(_dial_flags("--tls", tls))
        print(f"try: structd generate --target {inference_target}{' ' + dial if dial else ''} "
              "--regex '[a-z]{3}-[0-9]{3}' 'A code:'", flush=True)
        print("all services SERVING; a service that exits is restarted; Ctrl-C to stop", flush=True)
        sup.run()
        return 0
    except (RuntimeError, TimeoutError) as e:
        # A child's, during the first start-up (bad flags, port taken, model missing): reported, not retried.
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        sup.stop_all()
        print("stopped", flush=True)
