"""The grammar tier of one `structd bench e2e --grammar-replicas` point: K grammar servers seen as one.

The inference server is given every replica's address and spreads its
sessions over them (inference_svc/grammar/grammar_tier.py). The benchmark reads the
tier as a whole: the replicas' Prometheus samples are summed (counters and
histogram buckets add up across replicas) and their CPU seconds added, so a
phase's grammar numbers mean the same with one replica or several.
"""

from __future__ import annotations

from pathlib import Path

from structd.bench.harness import ChildService, ServiceThread
from structd.bench.harness.metrics import parse_metrics


class InProcessService(ServiceThread):
    """A server on a thread of this process (structd.bench.harness), with the ChildService interface."""

    def cpu_seconds(self, with_children: bool = False) -> float | None:
        return None  # shares this process with the client

    def metrics_text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.server.metrics.registry).decode("utf-8")


def merged(samples: list[dict[str, float]]) -> dict[str, float]:
    """The replicas' samples as one tier's: counters and histogram buckets add up."""
    out: dict[str, float] = {}
    for one in samples:
        for key, value in one.items():
            out[key] = out.get(key, 0.0) + value
    return out


def steps_each(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[int]:
    """Step messages each replica answered between two snapshots: how the tier's load was spread."""
    key = "grammar_svc_step_duration_seconds_count"
    return [int(a.get(key, 0.0) - b.get(key, 0.0)) for b, a in zip(before, after)]


def start_one(in_process: bool, log_path: Path):
    if in_process:
        from grammar_svc.config import GrammarServiceConfig
        from grammar_svc.server import GrammarServer

        server = GrammarServer(GrammarServiceConfig(host="127.0.0.1", port=0, metrics_port=0, max_sessions=65536))
        return InProcessService(server, f"bench-{log_path.stem}")
    return ChildService(["grammar", "--max-sessions", "65536"], log_path)


class GrammarReplicas:
    """K running grammar servers: their addresses, summed metrics, added CPU time."""

    def __init__(self, count: int, in_process: bool, out: Path):
        self.services = []
        try:
            for i in range(count):
                # One replica keeps the log name the benchmark always had.
                name = "grammar-server.log" if count == 1 else f"grammar-server-{count}x-{i}.log"
                self.services.append(start_one(in_process, out / name))
        except BaseException:  # a replica's start failed (or was interrupted): the ones up are stopped
            self.stop()
            raise

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
        for s in self.services:
            s.stop()
