"""Prometheus metrics of the inference service (names are part of the ops contract).

One CollectorRegistry per service instance, as in the grammar service, so
tests can run servers in-process. Per-step values go to plain histograms
(one observation per step, not per row).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Request-level latencies on a CPU or GPU: milliseconds to minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Per-token and per-step times: sub-millisecond (GPU decode) to a second (CPU, large batches).
STEP_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)
# Mask wait is ideally zero: resolve microseconds.
MASK_WAIT_BUCKETS = (0.0, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# The step loop's own work between forwards: tens of microseconds (GPU, few rows) to tens of ms (CPU, a batch).
HOST_PHASE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
# inference_svc_step_host_seconds{phase}: what the step loop does on the host, in step order.
HOST_PHASES = ("schedule", "grammar_send", "plan", "sample", "emit")


# inference_svc_lm_head_steps_total's paths (the benchmark's report reads the same list).
LM_HEAD_PATHS = ("sparse", "screened", "partial", "full_late", "full_needed", "full")


class InferenceMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "inference_svc_time_to_first_token_seconds", "Arrival to first streamed token.",
            ["constrained"], buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(
            "inference_svc_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            ["constrained"], buckets=STEP_BUCKETS, registry=r)
        self.e2e = Histogram(
            "inference_svc_e2e_request_latency_seconds", "Arrival to the last response of a request.",
            ["constrained"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "inference_svc_request_queue_time_seconds",
            "Time a ready request waited for admission to the running batch (grammar compile excluded).",
            buckets=LATENCY_BUCKETS, registry=r)
        self.grammar_wait = Histogram(
            "inference_svc_grammar_wait_seconds", "Time a constrained request waited for its grammar to compile.",
            buckets=LATENCY_BUCKETS, registry=r)
        self.forward_duration = Histogram(
            "inference_svc_forward_duration_seconds", "Wall time of one forward pass (one engine step).",
            buckets=STEP_BUCKETS, registry=r)
        self.mask_wait = Histogram(
            "inference_svc_mask_wait_seconds",
            "Per step: time sampling waited for grammar masks after the forward finished (0 when hidden).",
            buckets=MASK_WAIT_BUCKETS, registry=r)
        self.grammar_rpc_duration = Histogram(
            "inference_svc_grammar_rpc_duration_seconds",
            "Per step: grammar step round trip, from writing the step to its last answer.",
            buckets=STEP_BUCKETS, registry=r)
        self.running = Gauge("inference_svc_num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge(
            "inference_svc_num_requests_waiting",
            "Requests not running: compiling their grammar, queued or preempted.", registry=r)
        self.kv_usage = Gauge(
            "inference_svc_kv_cache_usage_ratio",
            "Fraction of KV cache blocks mapped by requests (free blocks that still hold a cached prefix are "
            "not in use: inference_svc_kv_cache_cached_free_ratio).", registry=r)
        self.kv_cache_bytes = Gauge(
            "inference_svc_kv_cache_bytes",
            "Bytes of the KV cache (per tensor-parallel rank): --kv-cache-bytes, or on CUDA what "
            "--gpu-memory-utilization left; 0 for the simulated runner.", registry=r)
        self.kv_cached_free = Gauge(
            "inference_svc_kv_cache_cached_free_ratio",
            "Fraction of KV cache blocks no request maps that still hold a cached prefix (reclaimed when needed).",
            registry=r)
        self.prefix_cached_blocks = Gauge(
            "inference_svc_prefix_cache_blocks",
            "KV cache blocks registered in the prefix cache, mapped by a request or free.", registry=r)
        self.prefix_cache_queries = Counter(
            "inference_svc_prefix_cache_queries_total",
            "Tokens of admitted requests looked up in the prefix cache (readmissions after preemption included).",
            registry=r)
        self.prefix_cache_hits = Counter(
            "inference_svc_prefix_cache_hits_total",
            "Tokens of admitted requests whose KV the prefix cache held (not computed again).", registry=r)
        self.batch_size = Histogram(
            "inference_svc_batch_size", "Sequences in one forward pass.", buckets=BATCH_BUCKETS, registry=r)
        self.prompt_tokens = Counter("inference_svc_prompt_tokens_total", "Prompt tokens of admitted requests.",
                                     registry=r)
        self.generation_tokens = Counter(
            "inference_svc_generation_tokens_total", "Completion tokens (sampled and forced).",
            ["constrained"], registry=r)
        self.forced_tokens = Counter(
            "inference_svc_forced_tokens_total", "Completion tokens appended by jump-forward rather than sampled.",
            registry=r)
        self.thinking_tokens = Counter(
            "inference_svc_reasoning_tokens_total",
            "Completion tokens spent thinking, the end-of-thinking token included (never constrained); the rest "
            "of inference_svc_generation_tokens_total is answer.", registry=r)
        self.requests = Counter(
            "inference_svc_requests_total", "Finished requests by finish reason.",
            ["constrained", "finish_reason"], registry=r)
        self.grammar_replays = Counter(
            "inference_svc_grammar_replays_total",
            "Grammar sessions rebuilt on another replica by replaying their tokens (a replica was lost).",
            registry=r)
        self.schema_checks = Counter(
            "inference_svc_schema_checks_total",
            "Finished json_schema outputs by what their last response told the client: valid, invalid "
            "(schema_violations), unchecked (the check timed out or the grammar tier could not run it).",
            ["result"], registry=r)
        for result in ("valid", "invalid", "unchecked"):
            self.schema_checks.labels(result)  # every result exported from the start, at 0
        self.grammar_replica_losses = Counter(
            "inference_svc_grammar_replica_losses_total",
            "Grammar replica step streams given up: broken (or answering out of order), or silent past the step "
            "deadline (timeout). Their requests are replayed on other replicas.",
            ["reason"], registry=r)
        for reason in ("timeout", "broken"):  # exported from the start: dashboards see zeros, not gaps
            self.grammar_replica_losses.labels(reason)
        self.grammar_replicas = Gauge(
            "inference_svc_grammar_replicas",
            "Grammar replicas this inference service knows, by state: registered (holds the tokenizer, takes new "
            "sessions), unregistered (down, hung or restarted without the tokenizer: the tier's maintenance "
            "registers it again), retired (its address left DNS: no new sessions, gone once its sessions end).",
            ["state"], registry=r)
        self.step_failures = Counter(
            "inference_svc_step_failures_total",
            "Engine steps that failed as a whole (e.g. the forward raised): their requests failed, the loop went on.",
            registry=r)
        self.row_failures = Counter(
            "inference_svc_row_failures_total",
            "Requests failed alone by an error in the step loop (scheduling, sampling, decoding, no allowed token).",
            registry=r)
        self.lm_head_steps = Counter(
            "inference_svc_lm_head_steps_total",
            "Steps by how their LM head ran: sparse (allowed ids only), screened (greedy rows at the ids a "
            "bfloat16 screen keeps, the others at their allowed ids), partial (the rows that need the whole "
            "vocabulary in full, the others at their allowed ids), full_late (the grammar had not answered "
            "when the model body finished), full_needed (too many rows need the whole vocabulary, or the allowed "
            "ids are too many), full (no split tried: no constrained row, --sparse-head off, or the model "
            "does not split).", ["path"], registry=r)
        for path in LM_HEAD_PATHS:
            self.lm_head_steps.labels(path)
        self.step_host = Histogram(
            "inference_svc_step_host_seconds",
            "The step loop's host work per step, by phase: schedule (batch and KV), grammar_send (the step's "
            "grammar message built and handed to its writer), plan (grammar answers turned into each row's mask), "
            "sample (penalties, masks, the draw), emit (tokens appended, text, outputs). The forward and the mask "
            "wait have their own metrics.", ["phase"], buckets=HOST_PHASE_BUCKETS, registry=r)
        self.host_phase = {phase: self.step_host.labels(phase) for phase in HOST_PHASES}
        self.preemptions = Counter(
            "inference_svc_preemptions_total", "Running requests preempted (KV freed, recomputed later).", registry=r)
        # Children resolved once (a labels() lookup per token is measurable on the hot path); this also
        # exports both label values from the start, so dashboards and rates see zeros, not gaps.
        self.by_kind = {constrained: KindMetrics(self, "true" if constrained else "false")
                        for constrained in (True, False)}


class KindMetrics:
    """The constrained="true" or "false" children of the labelled request metrics."""

    FINISH_REASONS = ("stop", "length", "stop_string", "cancelled", "error", "tool_calls")

    def __init__(self, m: InferenceMetrics, label: str):
        self.ttft = m.ttft.labels(label)
        self.tpot = m.tpot.labels(label)
        self.e2e = m.e2e.labels(label)
        self.generation_tokens = m.generation_tokens.labels(label)
        self.requests = {reason: m.requests.labels(label, reason) for reason in self.FINISH_REASONS}
