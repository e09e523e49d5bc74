"""`structd bench grammar`: the grammar server under test, as a child process.

A separate process (`structd grammar`, started by `harness.ChildService`), so the benchmark client
and the server never share a GIL: client-side sampling and mask decoding do
not show up as server time, and server threads do not slow the client.
"""

from __future__ import annotations

from pathlib import Path

from structd.bench.harness import ChildService

__all__ = ["ServerProcess", "histogram_from_metrics"]


class ServerProcess(ChildService):
    """Starts `structd grammar` on a free loopback port; `stop` drains it."""

    def __init__(self, *, compile_workers: int | None, fill_threads: int | None, compile_timeout_seconds: float,
                 log_path: Path, extra_args: list[str] | None = None):
        args = ["grammar", "--compile-timeout-seconds", str(compile_timeout_seconds), "--max-sessions", "65536"]
        if compile_workers:
            args += ["--compile-workers", str(compile_workers)]
        if fill_threads:
            args += ["--fill-threads", str(fill_threads)]
        super().__init__(args + (extra_args or []), log_path, timeout=180.0)


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
