"""`structd up`: run the grammar replica(s) and the inference service locally as child processes until SIGINT/SIGTERM.

Each service runs as its own `structd <service>` process, exactly as it would
in a container. Once every one reports SERVING on grpc.health.v1, `up` prints
where they listen; on SIGINT/SIGTERM it forwards SIGTERM (graceful drain) and
waits for all of them.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

STARTUP_TIMEOUT_SECONDS = 600.0


def wait_serving(target: str, proc: subprocess.Popen, timeout: float = STARTUP_TIMEOUT_SECONDS) -> None:
    """Blocks until target answers SERVING; fails early if proc exits."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"service for {target} exited with code {proc.returncode} during start-up")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{target} did not become SERVING within {timeout:.0f} s")


def grammar_command(host: str, port: int, metrics_port: int, log_level: str) -> list[str]:
    return [sys.executable, "-m", "shared.cli", "grammar", "--host", host, "--port", str(port),
            "--metrics-port", str(metrics_port), "--log-level", log_level]


def inference_command(args: argparse.Namespace, grammar_targets: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "shared.cli", "inference", "--host", args.host, "--port", str(args.port),
           "--metrics-port", str(args.metrics_port), "--grammar-target", ",".join(grammar_targets),
           "--tp", str(args.tp), "--log-level", args.log_level]
    if args.model:
        cmd += ["--model", str(args.model)]
    return cmd


def run_up(args: argparse.Namespace) -> int:
    if args.grammar_replicas < 1:
        print("error: --grammar-replicas must be at least 1", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    procs: list[tuple[str, subprocess.Popen]] = []
    try:
        for i in range(args.grammar_replicas):
            port, mport = args.grammar_port + i, args.grammar_metrics_port + i
            procs.append((f"{args.host}:{port}",
                          subprocess.Popen(grammar_command(args.host, port, mport, args.log_level))))
        for i, (target, proc) in enumerate(procs):
            print(f"starting grammar replica {i + 1}/{len(procs)} on {target} ...", flush=True)
            wait_serving(target, proc)
        grammar_targets = [target for target, _ in procs]
        inference_target = f"{args.host}:{args.port}"
        print(f"starting inference service on {inference_target} (loads the model; the embedded one is built "
              "on first use) ...", flush=True)
        procs.append((inference_target, subprocess.Popen(inference_command(args, grammar_targets))))
        wait_serving(inference_target, procs[-1][1])
        for i, target in enumerate(grammar_targets):
            print(f"grammar replica {i + 1}: grpc {target}  metrics "
                  f"http://{args.host}:{args.grammar_metrics_port + i}/metrics", flush=True)
        print(f"inference service: grpc {inference_target}  metrics http://{args.host}:{args.metrics_port}/metrics",
              flush=True)
        print(f"try: structd generate --target {inference_target} --regex '[a-z]{{3}}-[0-9]{{3}}' 'A code:'", flush=True)
        print("all services SERVING; Ctrl-C to stop", flush=True)
        while not stop.is_set():
            if any(p.poll() is not None for _, p in procs):
                print("error: a service exited; stopping the others", file=sys.stderr)
                return 1
            stop.wait(0.5)
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        # Inference first: it drains its requests while the grammar tier still answers.
        for _, p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        print("stopped", flush=True)
