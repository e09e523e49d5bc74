"""`structd bench grammar`: the grammar server under test, as a child process.

A separate process (`structd grammar`, started by `harness.ChildService`), so the benchmark client
and the server never share a GIL: client-side sampling and mask decoding do
not show up as server time, and server threads do not slow the client.
"""

from __future__ import annotations

from pathlib import Path

from structd.bench.harness import ChildService


def start_server(args, log_path: Path, extra_args: tuple[str, ...] = (), *, wait: bool = True) -> ChildService:
    """`structd grammar` on a free loopback port with the benchmark's --compile-timeout, --compile-workers and
    --fill-threads (0: the server's defaults); `stop` drains it. wait=False: spawned only (`wait_listening`)."""
    flags = ["grammar", "--compile-timeout-seconds", str(args.compile_timeout), "--max-sessions", "65536"]
    if args.compile_workers:
        flags += ["--compile-workers", str(args.compile_workers)]
    if args.fill_threads:
        flags += ["--fill-threads", str(args.fill_threads)]
    return ChildService(flags + list(extra_args), log_path, timeout=180.0, wait=wait)
