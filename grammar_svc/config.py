"""The grammar service's one typed configuration, built from CLI flags and env."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from shared.flags import FlagSet
from shared.tls import ServerTls, add_server_flags, server_tls_from_args

ENV_PREFIX = "STRUCTD_GRAMMAR_"
GRAMMAR_BACKENDS = ("auto", "xgrammar", "llguidance")


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
    # Which library compiles grammars when a request names none: xgrammar, llguidance, or auto (xgrammar,
    # falling back to llguidance for what xgrammar refuses or has not compiled after fallback_after_seconds, or
    # cannot start at once for want of a free compile worker; xgrammar alone where llguidance does not import:
    # server.py).
    grammar_backend: str = "auto"
    # Under issue 26's first-token target, not at it: at the budget llguidance's grammar is ready, and the
    # session's open and first mask still come after it (docs/benchmarks.md, "Backend coverage").
    fallback_after_seconds: float = 1.5
    # Upper bound on the compile deadline a client may ask for (CompileRequest.timeout_seconds).
    max_compile_timeout_seconds: float = 60.0
    # How long a compile timeout is answered from the cache (it may have been the load's doing).
    compile_timeout_cache_seconds: float = 30.0
    # Helper threads for the rows whose last fill was slow (bounded strings); the rest of a step's rows are
    # filled in a loop on the step's own thread (mask_filler.py says why).
    fill_threads: int = max(1, os.cpu_count() or 2)
    # A row on a helper thread gets this long to fill; past it that session fails alone and the step
    # answers without it (below the inference service's --grammar-step-timeout-seconds, 2 s by default,
    # so one slow grammar does not cost the replica its stream and every other request with it).
    max_row_fill_seconds: float = 1.0
    cache_bytes: int = 1 << 30
    max_spec_bytes: int = 1 << 20
    max_sessions: int = 4096
    # Per-caller limits (a multi-tenant replica): one step stream may hold a quarter of the sessions,
    # a caller (client certificate, else peer IP) may wait on this many distinct compiles at once.
    max_sessions_per_stream: int = 1024
    max_compiles_per_caller: int = 64
    # Registered tokenizers; a new one evicts the least recently used one no session or compile uses.
    max_tokenizers: int = 16
    session_idle_ttl_seconds: float = 600.0
    max_tokens_per_step: int = 4096
    # Upper bound on a stream's mask cache (16 KB per slot on each side at 129k tokens).
    max_mask_cache_slots: int = 1024
    # Worker processes validating finished JSON-Schema outputs (CheckOutput), off every step's path.
    check_workers: int = 2
    # Address-space cap (RLIMIT_AS) of each compile and check worker, 0: none. Virtual memory, so it sits
    # well above what a worker maps once its imports are done (torch and xgrammar map a lot they never
    # touch): docs/benchmarks.md, "Hostile input at the grammar service", says how it was chosen.
    worker_memory_limit_bytes: int = 2 << 30
    preload_file: Path | None = None
    # Tokenizer directory the preload file is compiled for (None: the embedded default).
    preload_tokenizer: Path | None = None
    grace_seconds: float = 5.0
    log_level: str = "INFO"
    # None: plaintext gRPC (make run); else TLS, mutual when it names a client CA.
    tls: ServerTls | None = None
    # A plaintext port answering grpc.health.v1 only, for probes without a client certificate (0: none).
    health_port: int = 0

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
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            problems.append(f"--grammar-backend must be one of {', '.join(GRAMMAR_BACKENDS)}")
        if not self.fallback_after_seconds > 0:
            problems.append("--fallback-after-seconds must be positive")
        if self.compile_timeout_cache_seconds < 0:
            problems.append("--compile-timeout-cache-seconds must not be negative")
        if self.fill_threads < 1:
            problems.append("--fill-threads must be at least 1")
        if not self.max_row_fill_seconds > 0:
            problems.append("--max-row-fill-seconds must be positive")
        if self.compile_timeout_seconds <= 0:
            problems.append("--compile-timeout-seconds must be positive")
        if self.max_sessions < 1:
            problems.append("--max-sessions must be at least 1")
        if self.check_workers < 1:
            problems.append("--check-workers must be at least 1")
        if self.worker_memory_limit_bytes < 0:
            problems.append("--worker-memory-limit-bytes must not be negative (0: no limit)")
        if self.max_sessions_per_stream < 1:
            problems.append("--max-sessions-per-stream must be at least 1")
        if self.max_compiles_per_caller < 1:
            problems.append("--max-compiles-per-caller must be at least 1")
        if self.max_tokenizers < 1:
            problems.append("--max-tokenizers must be at least 1")
        if self.preload_file is not None and not self.preload_file.is_file():
            problems.append(f"--preload-file {self.preload_file} does not exist")
        if self.tls is not None:
            problems.extend(self.tls.problems())
        if problems:
            raise SystemExit("invalid grammar service configuration: " + "; ".join(problems))
        return self


def add_arguments(parser: argparse.ArgumentParser, env: dict[str, str]) -> None:
    """Flags for `structd grammar`; each defaults to STRUCTD_GRAMMAR_<NAME> when set."""
    d = GrammarServiceConfig()
    f = FlagSet(parser, env, ENV_PREFIX)
    f.add("--host", d.host)
    f.add("--port", d.port)
    f.add("--metrics-port", d.metrics_port, "Prometheus /metrics port (0 disables)")
    f.add("--compile-workers", d.compile_workers)
    f.add("--max-compile-workers", d.max_compile_workers,
          "upper bound on compile workers including extra lanes (default 0: 4 x --compile-workers, at least 16)")
    f.add("--compile-lane-after-seconds", d.compile_lane_after_seconds,
          "a compile running this long opens an extra worker for the compiles waiting behind it")
    f.add("--compile-timeout-seconds", d.compile_timeout_seconds, "compile deadline when the request sets none")
    f.add("--grammar-backend", d.grammar_backend,
          "library that compiles a constraint whose request names none: xgrammar, llguidance, or auto (xgrammar, "
          "falling back to llguidance for what xgrammar refuses, crashes on or has not compiled after "
          "--fallback-after-seconds, or cannot start because every compile worker is busy). Where llguidance does "
          "not import, auto serves from xgrammar alone and llguidance refuses to start the replica")
    f.add("--fallback-after-seconds", d.fallback_after_seconds,
          "with --grammar-backend auto: how long a compile waits for xgrammar before llguidance serves the "
          "constraint (keep it well under --compile-timeout-seconds)")
    f.add("--max-compile-timeout-seconds", d.max_compile_timeout_seconds,
          "cap on the compile deadline a request may ask for")
    f.add("--compile-timeout-cache-seconds", d.compile_timeout_cache_seconds,
          "how long a compile timeout is answered from the cache")
    f.add("--fill-threads", d.fill_threads, "helper threads for rows whose last mask fill was slow")
    f.add("--max-row-fill-seconds", d.max_row_fill_seconds,
          "a row's mask fill past this fails its session alone (keep it below the inference service's "
          "--grammar-step-timeout-seconds)")
    f.add("--cache-bytes", d.cache_bytes)
    f.add("--max-spec-bytes", d.max_spec_bytes)
    f.add("--max-sessions", d.max_sessions)
    f.add("--max-sessions-per-stream", d.max_sessions_per_stream,
          "live sessions one step stream may hold (RESOURCE_EXHAUSTED for the session past it)")
    f.add("--max-compiles-per-caller", d.max_compiles_per_caller,
          "distinct uncached compiles one caller (client certificate, else peer IP) may wait on at once")
    f.add("--max-tokenizers", d.max_tokenizers,
          "registered tokenizers; a new one evicts the least recently used unused one")
    f.add("--max-mask-cache-slots", d.max_mask_cache_slots,
          "upper bound on the per-stream mask cache the client may ask for")
    f.add("--session-idle-ttl-seconds", d.session_idle_ttl_seconds)
    f.add("--check-workers", d.check_workers,
          "worker processes that validate finished JSON-Schema outputs against their schema")
    f.add("--worker-memory-limit-bytes", d.worker_memory_limit_bytes,
          "address-space cap (RLIMIT_AS) of each compile and check worker: a constraint that needs more fails "
          "alone (INVALID_ARGUMENT naming this flag); 0: no cap")
    f.add("--preload-file", None, "JSON Lines of constraints to compile at start-up (see docs/commands.md)", kind=Path)
    f.add("--preload-tokenizer", None,
          "Hugging Face tokenizer directory for --preload-file (default: the embedded tokenizer)", kind=Path)
    f.add("--grace-seconds", d.grace_seconds)
    f.add("--log-level", d.log_level)
    add_server_flags(f)
    f.add("--health-port", d.health_port, "plaintext port answering grpc.health.v1 only, for probes that cannot "
                                          "present a client certificate (0: none)")


def from_args(args: argparse.Namespace) -> GrammarServiceConfig:
    return GrammarServiceConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        compile_workers=args.compile_workers,
        max_compile_workers=args.max_compile_workers,
        compile_lane_after_seconds=args.compile_lane_after_seconds,
        compile_timeout_seconds=args.compile_timeout_seconds,
        grammar_backend=args.grammar_backend,
        fallback_after_seconds=args.fallback_after_seconds,
        max_compile_timeout_seconds=args.max_compile_timeout_seconds,
        compile_timeout_cache_seconds=args.compile_timeout_cache_seconds,
        fill_threads=args.fill_threads,
        max_row_fill_seconds=args.max_row_fill_seconds,
        cache_bytes=args.cache_bytes,
        max_spec_bytes=args.max_spec_bytes,
        max_sessions=args.max_sessions,
        max_sessions_per_stream=args.max_sessions_per_stream,
        max_compiles_per_caller=args.max_compiles_per_caller,
        max_tokenizers=args.max_tokenizers,
        max_mask_cache_slots=args.max_mask_cache_slots,
        session_idle_ttl_seconds=args.session_idle_ttl_seconds,
        check_workers=args.check_workers,
        worker_memory_limit_bytes=args.worker_memory_limit_bytes,
        preload_file=Path(args.preload_file) if args.preload_file else None,
        preload_tokenizer=Path(args.preload_tokenizer) if args.preload_tokenizer else None,
        grace_seconds=args.grace_seconds,
        log_level=args.log_level,
        tls=server_tls_from_args(args),
        health_port=args.health_port,
    ).validate()
