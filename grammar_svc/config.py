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
    # Compilation runs in worker processes so a compile past its deadline can be killed.
    compile_workers: int = max(1, (os.cpu_count() or 2) // 2)
    compile_timeout_seconds: float = 10.0
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

    def validate(self) -> "GrammarServiceConfig":
        problems = []
        if self.compile_workers < 1:
            problems.append("--compile-workers must be at least 1")
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
    parser.add_argument("--compile-timeout-seconds", type=float,
                        default=env_default("compile_timeout_seconds", d.compile_timeout_seconds))
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
        compile_timeout_seconds=args.compile_timeout_seconds,
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
