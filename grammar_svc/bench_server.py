"""`structd bench grammar`: the grammar server under test, as a child process.

A separate process (`python -m shared.cli grammar`), so the benchmark client
and the server never share a GIL: client-side sampling and mask decoding do
not show up as server time, and server threads do not slow the client.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"grammar service listening on (\S+):(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Starts `structd grammar` on a free loopback port; `stop` drains it."""

    def __init__(self, *, compile_workers: int | None, fill_threads: int | None, compile_timeout_seconds: float,
                 log_path: Path, extra_args: list[str] | None = None):
        self.metrics_port = free_port()
        cmd = [sys.executable, "-m", "shared.cli", "grammar", "--host", "127.0.0.1", "--port", "0",
               "--metrics-port", str(self.metrics_port), "--compile-timeout-seconds", str(compile_timeout_seconds),
               "--max-sessions", "65536", "--log-level", "WARNING", "--grace-seconds", "1"]
        if compile_workers:
            cmd += ["--compile-workers", str(compile_workers)]
        if fill_threads:
            cmd += ["--fill-threads", str(fill_threads)]
        cmd += extra_args or []
        self.cmd = cmd
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "wb")
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self._log,
                                     stdin=subprocess.DEVNULL)
        self.target = self._wait_listening(timeout=180.0)

    def _wait_listening(self, timeout: float) -> str:
        found: list[str] = []

        def reader():
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", "replace")
                self._log.write(raw)
                self._log.flush()
                m = _LISTENING.search(line)
                if m and not found:
                    found.append(f"{m.group(1)}:{m.group(2)}")

        threading.Thread(target=reader, daemon=True, name="bench-server-stdout").start()
        deadline = time.monotonic() + timeout
        while not found:
            if self.proc.poll() is not None:
                raise SystemExit(f"grammar server exited with {self.proc.returncode} before listening; "
                                 f"see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"grammar server did not start within {timeout:g} s; see {self.log_path}")
            time.sleep(0.05)
        return found[0]

    def scrape_metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode("utf-8")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()


def histogram_from_metrics(text: str, name: str) -> dict:
    """{bucket upper bound: cumulative count, "sum", "count"} of one unlabelled histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {"buckets": {}}
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                out["buckets"][s.labels["le"]] = s.value
            elif s.name.endswith("_sum"):
                out["sum"] = s.value
            elif s.name.endswith("_count"):
                out["count"] = s.value
    return out
