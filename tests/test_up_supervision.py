"""`structd up` supervises its services like a process manager (issue 8, item 5).

The back-off policy on its own (a child that fails at start-up keeps backing
off, one that ran a while starts again from the initial delay), then one real
`structd up --grammar-replicas 2` (what `make run` starts), started once for the
module: every address it prints serves; a grammar replica SIGKILLed
mid-generation is restarted on its port and rejoins while the request goes on
elsewhere; the inference service SIGKILLed is restarted; SIGINT still stops
everything and exits 0.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared.inference_client import InferenceClient
from shared.ports import free_ports
from structd.up import Backoff, Child, Supervisor, describe_exit
from tests.conftest import REPO
from tests.test_cli import PYTHON, Proc, children_of, clean_env, health, running, serving

RESTART_TIMEOUT = 120.0  # bounds a broken run: a grammar replica starts in ~5 s, the inference service in ~10 s
GENERATE_TIMEOUT = 120.0
LONG_REGEX = "[a-z ]{2000}"  # never completes: the request runs to max_tokens
LONG_TOKENS = 150  # a few seconds on the embedded model: the replica is killed after its 5th token


# ---------------------------------------------------------------- the back-off policy alone


def test_backoff_doubles_to_its_cap_and_resets():
    b = Backoff(0.5, 30.0)
    assert [b.next() for _ in range(9)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    b.reset()
    assert b.next() == 0.5
    with pytest.raises(ValueError):
        Backoff(0.0, 1.0)
    assert describe_exit(-9) == "code -9 (SIGKILL)" and describe_exit(3) == "code 3"


def _supervise(command: list[str], seconds: float, stable_seconds: float) -> tuple[Child, list[str]]:
    out = io.StringIO()
    stop = threading.Event()
    child = Child("flaky", "127.0.0.1:1", command, Backoff(0.05, 0.4))
    sup = Supervisor([child], None, stop, stable_seconds=stable_seconds, stop_timeout=5.0, startup_timeout=5.0,
                     out=out)
    child.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sup.tick(time.monotonic())
        time.sleep(0.01)
    stop.set()
    sup.stop_all()
    return child, [line for line in out.getvalue().splitlines() if "exited" in line]


def test_child_failing_at_start_keeps_backing_off_without_spinning():
    child, lines = _supervise(["sh", "-c", "exit 3"], 1.6, stable_seconds=60.0)
    delays = [float(re.search(r"in ([0-9.]+) s", line).group(1)) for line in lines]
    assert all("exited with code 3" in line for line in lines), lines
    # 0.05, 0.1, 0.2, 0.4, 0.4, ...: 1.6 s hold at most 7 restarts; a spinning loop would make hundreds.
    assert delays[:4] == [0.05, 0.1, 0.2, 0.4], lines
    assert set(delays[4:]) <= {0.4} and 4 <= len(delays) <= 7, lines
    assert child.restarts == len(lines) and not child.running()


def test_child_that_ran_a_while_restarts_after_the_initial_delay():
    _, lines = _supervise(["sleep", "0.3"], 1.2, stable_seconds=0.2)
    delays = [float(re.search(r"in ([0-9.]+) s", line).group(1)) for line in lines]
    assert len(delays) >= 2 and set(delays) == {0.05}, lines


# ---------------------------------------------------------------- a real `structd up`


@dataclass
class Up:
    proc: Proc
    grammar_port: int
    grammar_metrics_port: int
    port: int
    metrics_port: int
    gateway_port: int
    pids: dict[str, int] = field(default_factory=dict)  # "grammar replica 1" / "inference service" / "gateway" -> pid

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def grammar_target(self, i: int) -> str:
        return f"127.0.0.1:{self.grammar_port + i}"

    def grammar_metric(self, i: int, prefix: str) -> float:
        """Sum of the samples of replica i's metrics whose name starts with prefix."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.grammar_metrics_port + i}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(prefix) and not line.startswith("#"))

    def wait_restart(self, name: str, old_pid: int) -> int:
        """Waits for up's exit line and its SERVING again line for `name`; returns the new pid."""
        line = self.proc.wait_for_line(f"{name} (pid {old_pid}) exited", timeout=RESTART_TIMEOUT)
        assert "with code -9 (SIGKILL)" in line and "restart 1 in 0.5 s" in line, line
        line = self.proc.wait_for_line(f"{name} SERVING again", timeout=RESTART_TIMEOUT)
        pid = int(re.search(r"\(pid (\d+)\)", line).group(1))
        assert pid != old_pid and running(pid)
        self.pids[name] = pid
        return pid


@pytest.fixture(scope="module")
def up():
    port, mport = free_ports(2), free_ports(2)
    iport, imetrics, gport = free_ports(), free_ports(), free_ports()
    proc = Proc([PYTHON, "-m", "structd", "up", "--host", "127.0.0.1", "--grammar-port", str(port),
                 "--grammar-metrics-port", str(mport), "--grammar-replicas", "2", "--port", str(iport),
                 "--metrics-port", str(imetrics), "--gateway-port", str(gport), "--log-level", "WARNING"])
    services: set[int] = set()
    try:
        proc.wait_for_line("all services SERVING")
        services = children_of(proc.popen.pid)
        u = Up(proc, port, mport, iport, imetrics, gport)
        for line in proc.lines:
            m = re.match(r"(grammar replica \d|inference service|gateway)\b.*  pid (\d+)$", line)
            if m:
                u.pids[m.group(1)] = int(m.group(2))
        assert set(u.pids) == {"grammar replica 1", "grammar replica 2", "inference service", "gateway"}, proc.output
        assert set(u.pids.values()) == services
        yield u
    finally:
        proc.kill()
        # up itself was SIGKILLed only if a test failed: its children must not outlive the module.
        for pid in services | children_of(proc.popen.pid):
            if running(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # the child's own exit won the race


def _long_generation(target: str, result: dict, first_chunks: threading.Event) -> None:
    try:
        with InferenceClient(target) as client:
            chunks = 0
            for chunk in client.generate("Spell it:", regex=LONG_REGEX, max_tokens=LONG_TOKENS, timeout=GENERATE_TIMEOUT):
                chunks += 1
                if chunks == 5:
                    first_chunks.set()
                if chunk.finish_reason is not None:
                    result["finish_reason"] = chunk.finish_reason
                    result["tokens"] = chunk.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 - the server's or the transport's; the test reports it
        result["error"] = e
    finally:
        first_chunks.set()


def test_up_serves_both_tiers_where_it_says(up):
    """Two grammar replicas, the inference service and the gateway, at the addresses it printed, reachable with
    `structd generate` and over HTTP (before any test below kills one of them)."""
    out = up.proc.output
    for i in range(2):
        assert (f"grammar replica {i + 1}: grpc {up.grammar_target(i)}  "
                f"metrics http://127.0.0.1:{up.grammar_metrics_port + i}/metrics") in out, out
    assert f"inference service: grpc {up.target}  metrics http://127.0.0.1:{up.metrics_port}/metrics" in out, out
    assert (f"gateway (OpenAI API): http://127.0.0.1:{up.gateway_port}/v1  "
            f"metrics http://127.0.0.1:{up.gateway_port}/metrics") in out, out
    for i in range(2):
        assert health(up.grammar_target(i), "grammar.v1.GrammarService") == serving()
    assert health(up.target, "inference.v1.InferenceService") == serving()
    for mp in (up.grammar_metrics_port, up.grammar_metrics_port + 1, up.metrics_port, up.gateway_port):
        with urllib.request.urlopen(f"http://127.0.0.1:{mp}/metrics", timeout=30) as r:
            assert r.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{up.gateway_port}/health", timeout=30) as r:
        assert r.status == 200
    gen = subprocess.run([PYTHON, "-m", "structd", "generate", "--target", up.target, "--json",
                          "--choice", "yes", "--choice", "no", "Well?"],
                         cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=GENERATE_TIMEOUT)
    assert gen.returncode == 0, gen.stderr
    line = json.loads(gen.stdout)
    assert line["text"] in ("yes", "no") and line["finish_reason"] == "stop"


def test_killed_grammar_replica_is_restarted_on_its_port_and_rejoins(up):
    # A long constrained generation; the replica that holds its session is the one killed.
    result: dict = {}
    first_chunks = threading.Event()
    gen = threading.Thread(target=_long_generation, args=(up.target, result, first_chunks), daemon=True)
    gen.start()
    assert first_chunks.wait(GENERATE_TIMEOUT) and "error" not in result, result
    sessions = [up.grammar_metric(i, "grammar_svc_active_sessions") for i in range(2)]
    assert sorted(sessions) == [0, 1], sessions
    i = sessions.index(1)
    name = f"grammar replica {i + 1}"

    old = up.pids[name]
    os.kill(old, signal.SIGKILL)
    up.wait_restart(name, old)
    assert health(up.grammar_target(i), "grammar.v1.GrammarService") == serving()

    # The in-flight request was replayed on replica 2 and ran to its end.
    gen.join(GENERATE_TIMEOUT)
    assert result.get("finish_reason") == "length" and result.get("tokens") == LONG_TOKENS, result

    # Later constrained requests are served; within a few maintenance rounds the tier has handed the restarted
    # replica its tokenizer again and compiles there (an idle tier picked it for the first request, and does again).
    with InferenceClient(up.target) as client:
        deadline = time.monotonic() + 30.0
        n = 0
        while up.grammar_metric(i, "grammar_svc_cache_") == 0:
            assert time.monotonic() < deadline, "the restarted replica never got a compile\n" + up.proc.output
            n += 1
            done = client.complete("A code:", regex=f"[a-z]{{3}}-[0-9]{{{n}}}", max_tokens=16,
                                   timeout=GENERATE_TIMEOUT)
            assert done.finish_reason == "stop" and re.fullmatch(f"[a-z]{{3}}-[0-9]{{{n}}}", done.text), done
            time.sleep(0.5)
    assert up.proc.popen.poll() is None
    assert up.pids[f"grammar replica {2 - i}"] in children_of(up.proc.popen.pid)


def test_killed_inference_service_is_restarted(up):
    old = up.pids["inference service"]
    os.kill(old, signal.SIGKILL)
    up.wait_restart("inference service", old)
    with InferenceClient(up.target) as client:
        done = client.complete("Well?", choice=["yes", "no"], timeout=GENERATE_TIMEOUT)
    assert done.text in ("yes", "no") and done.finish_reason == "stop"
    assert up.proc.popen.poll() is None


def test_killed_gateway_is_restarted(up):
    old = up.pids["gateway"]
    os.kill(old, signal.SIGKILL)
    up.wait_restart("gateway", old)
    with urllib.request.urlopen(f"http://127.0.0.1:{up.gateway_port}/health", timeout=30) as r:
        assert r.status == 200
    assert up.proc.popen.poll() is None


def test_sigint_stops_everything_and_exits_zero(up):
    """Runs last in this module: it stops the module's `structd up`."""
    services = children_of(up.proc.popen.pid)
    assert services == set(up.pids.values())
    up.proc.popen.send_signal(signal.SIGINT)
    assert up.proc.wait() == 0, up.proc.output
    assert "stopped" in up.proc.lines
    assert not [p for p in services if running(p)]
    # No restart was scheduled while stopping.
    assert len([line for line in up.proc.lines if " exited with " in line]) == 3, up.proc.output


def _processes_with(fragment: str) -> list[int]:
    """Pids of the processes whose command line holds `fragment` (children outlive `up` only as orphans)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if fragment in cmdline.read_bytes().replace(b"\0", b" ").decode("utf-8", "replace"):
                found.append(int(cmdline.parent.name))
        except OSError:  # the process ended while we looked
            continue
    return found


def test_a_replica_that_fails_at_start_stops_everything_up_started_beside_it(tmp_path):
    """Every service starts at once: when a grammar replica cannot start (its port is taken), `up` says so and
    exits 1, and the inference service and the gateway it started beside it are stopped too."""
    port, mport = free_ports(2), free_ports(2)
    iport, imetrics, gport = free_ports(), free_ports(), free_ports()
    out = tmp_path / "up.log"
    # Into a file, not a pipe: a child that outlived `up` would hold a pipe open and the run would never end.
    left: list[int] = []
    try:
        with socket.socket() as taken, out.open("w") as log:
            taken.bind(("127.0.0.1", port + 1))
            taken.listen()
            code = subprocess.run([PYTHON, "-m", "structd", "up", "--host", "127.0.0.1", "--grammar-port", str(port),
                                   "--grammar-metrics-port", str(mport), "--grammar-replicas", "2", "--port",
                                   str(iport), "--metrics-port", str(imetrics), "--gateway-port", str(gport),
                                   "--log-level", "WARNING"], cwd=REPO, env=clean_env(), stdout=log,
                                  stderr=subprocess.STDOUT, timeout=300).returncode
    finally:
        left = _processes_with(f"--port {iport} ") + _processes_with(f"--port {gport} ") + \
            _processes_with(f"--port {port} ")
        for pid in left:  # they must not outlive the test, whatever it finds
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"children outlived up: {left}"
    text = out.read_text()
    assert code == 1, text
    said = f"error: grammar replica 2: service for 127.0.0.1:{port + 1} exited with code 1 during start-up"
    assert said in text, text
