"""Prometheus metrics of the grammar service (names are part of the ops contract).

Each service instance owns its own CollectorRegistry, so tests can run a
server in-process without colliding with the global default registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from grammar_svc.schema.schema_warnings import IGNORED_KEYWORDS
from grammar_svc.types import Kind
from shared.metrics import BatchHistogram

# Mask fills: a few microseconds typical, tens of milliseconds worst case.
MASK_FILL_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                     1e-2, 2.5e-2, 5e-2, 0.1)
# Whole steps: tens of microseconds to tens of milliseconds.
STEP_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
# Compiles: sub-millisecond to the deadline and beyond.
COMPILE_BUCKETS = (1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Bytes per mask on the wire: a same-as reference (4) up to dense (16 KB for 129k tokens).
MASK_BYTES_BUCKETS = (4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
# Label values of grammar_svc_backend_choices_total: each backend and the reasons it can be chosen for.
BACKEND_CHOICES = {
    "xgrammar": ("requested", "configured", "default", "llguidance_ignores"),
    "llguidance": ("requested", "configured", "feature", "xgrammar_refused", "xgrammar_slow", "xgrammar_crashed",
                   "xgrammar_busy"),
}
# Label values of grammar_svc_limit_rejections_total.
LIMITS = ("sessions", "sessions_per_stream", "tokenizers", "compiles_per_caller", "compile_timeout_cap")
# Label values of grammar_svc_compile_failures_total's reason.
COMPILE_FAILURE_REASONS = ("invalid", "timeout", "busy", "too_large", "crash", "error")
# Label values of grammar_svc_session_events_total.
SESSION_EVENTS = ("opened", "closed", "expired", "stream_ended", "rejected", "error", "fill_timeout")
# Violation keywords known in advance: "json" (not one JSON document) and the keywords the grammar does not enforce.
VIOLATION_KEYWORDS = ("json", *IGNORED_KEYWORDS)


class GrammarMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.compile_duration = Histogram(
            "grammar_svc_compile_duration_seconds", "Wall time of grammar compilations (cache misses that succeeded).",
            ["kind"], buckets=COMPILE_BUCKETS, registry=r)
        self.backend_choices = Counter(
            "grammar_svc_backend_choices_total",
            "Compile requests answered, by the grammar backend that serves them (xgrammar, llguidance) and why: "
            "requested (CompileRequest.backend), configured (--grammar-backend), default (auto: xgrammar in "
            "time), feature (auto: what only llguidance enforces), xgrammar_refused, xgrammar_slow (past "
            "--fallback-after-seconds), xgrammar_crashed, xgrammar_busy (no compile worker free: auto's fallbacks "
            "to llguidance), llguidance_ignores (auto: xgrammar, where llguidance's grammar would ignore a "
            "keyword xgrammar's enforces).", ["backend", "reason"], registry=r)
        for backend, reasons in BACKEND_CHOICES.items():
            for reason in reasons:
                self.backend_choices.labels(backend, reason)  # every possible choice exported from the start, at 0
        self.backend_available = Gauge(
            "grammar_svc_backend_available",
            "Whether each grammar backend's library imports on this replica: 1, or 0 where the image lacks it "
            "(llguidance: auto then serves every constraint from xgrammar, and a request naming llguidance is "
            "refused with UNIMPLEMENTED).", ["backend"], registry=r)
        self.compile_failures = Counter(
            "grammar_svc_compile_failures_total",
            "Compilations that failed, by reason (invalid, timeout, busy, too_large, crash, error).",
            ["kind", "reason"], registry=r)
        for kind in Kind:
            for reason in COMPILE_FAILURE_REASONS:
                self.compile_failures.labels(kind.value, reason)  # exported from the start, at 0
        self.compile_worker_restarts = Counter(
            "grammar_svc_compile_worker_restarts_total",
            "Compile workers replaced, by reason: deadline (killed past its compile deadline), abandoned "
            "(killed because every caller went away), crashed (died on its own or killed from outside), memory "
            "(a compile ran out of --worker-memory-limit-bytes).",
            ["reason"], registry=r)
        for reason in ("deadline", "abandoned", "crashed", "memory"):
            self.compile_worker_restarts.labels(reason)  # every reason exported from the start, at 0
        self.compile_worker_spawn_failures = Counter(
            "grammar_svc_compile_worker_spawn_failures_total",
            "Compile worker processes that failed to start (retried with back-off).", registry=r)
        self.compile_workers = Gauge(
            "grammar_svc_compile_workers",
            "Compile worker processes by state (idle, busy, starting); more than --compile-workers while "
            "extra lanes are open.", ["state"], registry=r)
        self.compile_waiting = Gauge(
            "grammar_svc_compile_waiting", "Compiles waiting for a free compile worker.", registry=r)
        self.cache_hits = Counter(
            "grammar_svc_cache_hits_total", "Compile requests answered from the cache (successes and cached failures).",
            ["kind"], registry=r)
        self.cache_misses = Counter(
            "grammar_svc_cache_misses_total", "Compile requests that were not in the cache.", ["kind"], registry=r)
        # Every kind exported from the start: the hit ratio panel reads 0, not "No data", while the inference
        # leaders' own memo of compiled grammars answers every repeat and no hit reaches this cache.
        for kind in Kind:
            self.cache_hits.labels(kind.value)
            self.cache_misses.labels(kind.value)
        self.cache_bytes = Gauge(
            "grammar_svc_cache_bytes", "Bytes held by the compiled-grammar cache.", registry=r)
        self.active_sessions = Gauge(
            "grammar_svc_active_sessions", "Open matcher sessions across all step streams.", registry=r)
        self.active_streams = Gauge(
            "grammar_svc_active_streams", "Open step streams (one per inference replica).", registry=r)
        # Per-row hot-path histograms take a whole step's values at once.
        self.mask_fill_duration = BatchHistogram(
            "grammar_svc_mask_fill_duration_seconds", "Time to fill one token mask row.",
            buckets=MASK_FILL_BUCKETS, registry=r)
        self.step_duration = Histogram(
            "grammar_svc_step_duration_seconds", "Server time for one step message: accept, jump-forward, fill, encode.",
            buckets=STEP_BUCKETS, registry=r)
        self.step_sessions = Histogram(
            "grammar_svc_step_sessions", "Sessions carried by one step message.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.mask_bytes = BatchHistogram(
            "grammar_svc_mask_bytes", "Bytes on the wire per token mask, by encoding.",
            buckets=MASK_BYTES_BUCKETS, labelnames=["encoding"], registry=r)
        self.jump_forward_tokens = Counter(
            "grammar_svc_jump_forward_tokens_total", "Tokens forced and accepted by jump-forward.", registry=r)
        self.output_checks = Counter(
            "grammar_svc_output_checks_total",
            "Finished JSON-Schema outputs checked against their schema (CheckOutput), by result: valid, "
            "invalid, timeout, error (jsonschema cannot apply the schema), worker_died (the check's worker died under "
            "it: out of --worker-memory-limit-bytes, or killed).", ["result"], registry=r)
        for result in ("valid", "invalid", "timeout", "error", "worker_died"):
            self.output_checks.labels(result)  # every result exported from the start, at 0
        self.output_violations = Counter(
            "grammar_svc_output_violations_total",
            "Schema violations found in finished outputs, by JSON Schema keyword (\"json\": not one JSON "
            "document); at most 16 counted per output.", ["keyword"], registry=r)
        for keyword in VIOLATION_KEYWORDS:
            self.output_violations.labels(keyword)  # the keywords known in advance exported from the start, at 0
        self.limit_rejections = Counter(
            "grammar_svc_limit_rejections_total",
            "Requests refused with RESOURCE_EXHAUSTED by a per-caller or replica limit, by limit: sessions "
            "(--max-sessions), sessions_per_stream, tokenizers (--max-tokenizers, every slot in use), "
            "compiles_per_caller, compile_timeout_cap (a compile cut by --max-compile-timeout-seconds).",
            ["limit"], registry=r)
        for limit in LIMITS:
            self.limit_rejections.labels(limit)  # every limit exported from the start, at 0
        self.tokenizers = Gauge(
            "grammar_svc_tokenizers", "Tokenizers registered on this replica (at most --max-tokenizers).", registry=r)
        self.tokenizer_evictions = Counter(
            "grammar_svc_tokenizer_evictions_total",
            "Unused tokenizers evicted (least recently used first) to register another.", registry=r)
        self.session_events = Counter(
            "grammar_svc_session_events_total",
            "Session lifecycle events (opened, closed, expired, stream_ended, rejected, error, fill_timeout).",
            ["event"], registry=r)
        for event in SESSION_EVENTS:
            self.session_events.labels(event)  # every event exported from the start, at 0
