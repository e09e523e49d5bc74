"""The grammar service's one typed configuration, built from CLI flags and env."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

ENV_PREFIX = "STRUCTD_GRAMMAR_"


@dataclass(frozen=True)
class GrammarServiceConfig:
    host: str = "127.0.0.1"
    port: int = 50052
    metrics_port: int = 9402
    # Compilation runs in worker processes so a compile past its deadline can be killed. One per
    # core: workers run below the step path's CPU priority, so they cannot starve it.
    compile_workers: int = max(1, os.cpu_count() or 2)
    # Extra workers (lanes) open while compiles that have run longer than compile_lane_after_seconds
    # hold every worker, so fast compiles do not queue behind slow ones; 0: the default bound.
    max_compile_workers: int = 0
    compile_lane_after_seconds: float = 0.5
    compile_timeout_seconds: float = 10.0
    # Upper bound on the compile deadline a client may ask for (CompileRequest.timeout_seconds).
    max_compile_timeout_seconds: float = 60.0
    # How long a compile timeout is answered from the cache (it may have been the load's doing).
    compile_timeout_cache_seconds: float = 30.0
    # Threads that fill one step's masks in parallel.
    fill_threads: int = max(1, os.cpu_count() or 2)
    cache_bytes: int = 1 << 30
    max_spec_bytes: int = 1 << 20
    max_sessions: int = 4096
    session_idle_ttl_seconds: float = 600.0
    max_tokens_per_step: int = 4096
    # Upper bound on a stream's mask cache (16 KB per slot on each side at 129k tokens).
    max_mask_cache_slots: int = 1024
    preload_file: Path | None = None
    # Tokenizer directory the preload file is compiled for (None: the embedded default).
    preload_tokenizer: Path | None = None
    grace_seconds: float = 5.0
    log_level: str = "INFO"

    @property
    def compile_workers_bound(self) -> int:
        """--max-compile-workers, or by default 4 x --compile-workers, at least 16."""
        return self.max_compile_workers or max(16, 4 * self.compile_workers)

    def validate(self) -> "GrammarServiceConfig":
        problems = []
        if self.compile_workers < 1:
            problems.append("--compile-workers must be at least 1")
        if self.max_compile_workers and self.max_compile_workers < self.compile_workers:
            problems.append("--max-compile-workers must be at least --compile-workers (or 0 for the default)")
        if self.compile_lane_after_seconds <= 0:
            problems.append("--compile-lane-after-seconds must be positive")
        if self.max_compile_timeout_seconds <= 0:
            problems.append("--max-compile-timeout-seconds must be positive")
        elif self.compile_timeout_seconds > self.max_compile_timeout_seconds:
            problems.append("--compile-timeout-seconds must not exceed --max-compile-timeout-seconds")
        if self.compile_timeout_cache_seconds < 0:
            problems.append("--compile-timeout-cache-seconds must not be negative")
        if self.fill_threads < 1:
            problems.append("--fill-threads must be at least 1")
        if self.compile_timeout_seconds <= 0:
            problems.append("--compile-timeout-seconds must be positive")
        if self.max_sessions < 1:
            problems.append("--max-sessions must be at least 1")
        if self.preload_file is not None and not self.preload_file.is_file():
            problems.append(f"--preload-file {self.preload_file} does not exist")
        if problems:
            raise SystemExit("invalid grammar service configuration: " + "; ".join(problems))
        return self


def add_arguments(parser: argparse.ArgumentParser, env: dict[str, str]) -> None:
    """Flags for `structd grammar`; each defaults to STRUCTD_GRAMMAR_<NAME> when set."""
    d = GrammarServiceConfig()

    def env_default(name: str, default):
        raw = env.get(ENV_PREFIX + name.upper())
        return type(default)(raw) if raw is not None and default is not None else (raw or default)

    parser.add_argument("--host", default=env_default("host", d.host))
    parser.add_argument("--port", type=int, default=env_default("port", d.port))
    parser.add_argument("--metrics-port", type=int, default=env_default("metrics_port", d.metrics_port),
                        help="Prometheus /metrics port (0 disables)")
    parser.add_argument("--compile-workers", type=int, default=env_default("compile_workers", d.compile_workers))
    parser.add_argument("--max-compile-workers", type=int,
                        default=env_default("max_compile_workers", d.max_compile_workers),
                        help="upper bound on compile workers including extra lanes "
                             "(default 0: 4 x --compile-workers, at least 16)")
    parser.add_argument("--compile-lane-after-seconds", type=float,
                        default=env_default("compile_lane_after_seconds", d.compile_lane_after_seconds),
                        help="a compile running this long opens an extra worker for the compiles waiting behind it")
    parser.add_argument("--compile-timeout-seconds", type=float,
                        default=env_default("compile_timeout_seconds", d.compile_timeout_seconds),
                        help="compile deadline when the request sets none")
    parser.add_argument("--max-compile-timeout-seconds", type=float,
                        default=env_default("max_compile_timeout_seconds", d.max_compile_timeout_seconds),
                        help="cap on the compile deadline a request may ask for")
    parser.add_argument("--compile-timeout-cache-seconds", type=float,
                        default=env_default("compile_timeout_cache_seconds", d.compile_timeout_cache_seconds),
                        help="how long a compile timeout is answered from the cache")
    parser.add_argument("--fill-threads", type=int, default=env_default("fill_threads", d.fill_threads))
    parser.add_argument("--cache-bytes", type=int, default=env_default("cache_bytes", d.cache_bytes))
    parser.add_argument("--max-spec-bytes", type=int, default=env_default("max_spec_bytes", d.max_spec_bytes))
    parser.add_argument("--max-sessions", type=int, default=env_default("max_sessions", d.max_sessions))
    parser.add_argument("--max-mask-cache-slots", type=int,
                        default=env_default("max_mask_cache_slots", d.max_mask_cache_slots),
                        help="upper bound on the per-stream mask cache the client may ask for")
    parser.add_argument("--session-idle-ttl-seconds", type=float,
                        default=env_default("session_idle_ttl_seconds", d.session_idle_ttl_seconds))
    parser.add_argument("--preload-file", type=Path, default=env.get(ENV_PREFIX + "PRELOAD_FILE"),
                        help="JSON Lines of constraints to compile at start-up (see README)")
    parser.add_argument("--preload-tokenizer", type=Path, default=env.get(ENV_PREFIX + "PRELOAD_TOKENIZER"),
                        help="Hugging Face tokenizer directory for --preload-file (default: the embedded tokenizer)")
    parser.add_argument("--grace-seconds", type=float, default=env_default("grace_seconds", d.grace_seconds))
    parser.add_argument("--log-level", default=env_default("log_level", d.log_level))


def from_args(args: argparse.Namespace) -> GrammarServiceConfig:
    return GrammarServiceConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        compile_workers=args.compile_workers,
        max_compile_workers=args.max_compile_workers,
        compile_lane_after_seconds=args.compile_lane_after_seconds,
        compile_timeout_seconds=args.compile_timeout_seconds,
        max_compile_timeout_seconds=args.max_compile_timeout_seconds,
        compile_timeout_cache_seconds=args.compile_timeout_cache_seconds,
        fill_threads=args.fill_threads,
        cache_bytes=args.cache_bytes,
        max_spec_bytes=args.max_spec_bytes,
        max_sessions=args.max_sessions,
        max_mask_cache_slots=args.max_mask_cache_slots,
        session_idle_ttl_seconds=args.session_idle_ttl_seconds,
        preload_file=Path(args.preload_file) if args.preload_file else None,
        preload_tokenizer=Path(args.preload_tokenizer) if args.preload_tokenizer else None,
        grace_seconds=args.grace_seconds,
        log_level=args.log_level,
    ).validate()
