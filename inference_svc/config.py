"""The inference service's one typed configuration, built from CLI flags and env."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from inference_svc.api.model_family import bundled_names
from inference_svc.model.model_loading import DTYPES, reference_problem
from shared.flags import FlagSet
from shared.tls import (ClientTls, ServerTls, add_client_flags, add_server_flags, client_tls_from_args,
                        server_tls_from_args)

ENV_PREFIX = "STRUCTD_INFERENCE_"
# The KV cache's defaults, here once: the runners take them as theirs.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_BYTES = 256 * 1024**2
# --compile: the modes compiled_forward.py runs, and auto (picked per device by compile_mode()).
COMPILE_MODES = ("off", "default", "max-autotune")
COMPILE_CHOICES = ("auto", *COMPILE_MODES)
ENGINE_PROCESS_CHOICES = ("auto", "on", "off")
LM_HEAD_KERNEL_CHOICES = ("auto", "plain")
# Here rather than beside the kernel: every `structd` command builds this parser, and the kernel imports torch.
ATTENTION_BACKENDS = ("auto", "sdpa", "triton")


# (max_num_seqs, max_num_batched_tokens) where the flags are 0. A CPU step's cost grows with its tokens (the
# sizes its benchmarks were run at); a GPU's forward costs about the same from 1 to hundreds of tokens, so it
# takes vLLM's OpenAI-server sizes, larger on a GPU of 70 GiB or more that is not an A100 (vLLM measured large
# token budgets lowering an A100's throughput, its PR 17885).
CPU_BATCH = (64, 512)
GPU_BATCH = (256, 2048)
LARGE_GPU_BATCH = (1024, 8192)
LARGE_GPU_BYTES = 70 * 2**30
# The largest compile bucket by default: a step of more tokens (a prefill) runs eagerly, where its compute,
# not its kernel launches, is what it costs; each bucket more is one more compile at start.
MAX_DEFAULT_BUCKET = 512


@dataclass(frozen=True)
class EngineConfig:
    """What the step loop and scheduler need (no network, no model loading)."""

    # Requests in the running batch at once (0: sized by the device at start, see sized_for).
    max_num_seqs: int = 0
    # Tokens fed to one forward pass (prefill chunks + decodes + jump-forward runs; 0: sized by the device).
    max_num_batched_tokens: int = 0
    # Requests waiting for admission (grammar compiling included) before RESOURCE_EXHAUSTED.
    max_waiting: int = 1024
    default_max_tokens: int = 256
    # Upper bound on prompt + completion, per request (0: the model's context length).
    max_model_len: int = 0
    # Grammar compile deadline asked of the grammar tier (0: its default).
    compile_timeout_seconds: float = 0.0
    # How long a finished json_schema output's last response waits for its schema check (then: UNCHECKED).
    schema_check_timeout_seconds: float = 5.0
    # Prompts longer than this (UTF-8 bytes) are refused before they are tokenized.
    max_prompt_bytes: int = 1 << 20
    # The tools' parameters schemas of one request, together (UTF-8 bytes), refused before any is parsed: as
    # much as the grammar tier takes in one spec (its --max-spec-bytes default), which the tool grammar is.
    max_tool_bytes: int = 1 << 20
    # The LM head over the allowed ids only, for steps whose every sampled row has a short allowed-id list
    # (sparse_head.py; docs/benchmarks.md, "LM head at the allowed ids", measures it).
    sparse_head: bool = True
    # Greedy rows without logprobs computed at the ids a bfloat16 screen of the head keeps (greedy_head.py:
    # the float32 argmax exactly, on CPUs with bfloat16 oneDNN; needs the sparse head's split).
    greedy_head: bool = True
    # Completions one request may ask for (sampling n): its prompt is prefilled once and shared.
    max_n: int = 16
    # Full KV blocks keep their computed prefix for later requests with the same tokens (paged_kv.py).
    prefix_caching: bool = True

    def sized_for(self, device_type: str, memory_bytes: int = 0, device_name: str = "") -> "EngineConfig":
        """This config with a 0 max_num_seqs / max_num_batched_tokens replaced by the device's sizes: a
        CPU's, a GPU's, or a large GPU's (memory_bytes at least LARGE_GPU_BYTES, not an A100), as vLLM's
        OpenAI server sizes them; the ones given are kept."""
        if self.max_num_seqs and self.max_num_batched_tokens:
            return self
        if device_type != "cuda":
            seqs, tokens = CPU_BATCH
        elif memory_bytes >= LARGE_GPU_BYTES and "a100" not in device_name.lower():
            seqs, tokens = LARGE_GPU_BATCH
        else:
            seqs, tokens = GPU_BATCH
        return replace(self, max_num_seqs=self.max_num_seqs or seqs,
                       max_num_batched_tokens=self.max_num_batched_tokens or tokens)


@dataclass(frozen=True)
class InferenceServiceConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9401
    grammar_targets: tuple[str, ...] = ("127.0.0.1:50052",)
    # A grammar replica silent this long after a step's forward finished is hung: its requests move elsewhere.
    grammar_step_timeout_seconds: float = 2.0
    # A Hugging Face causal LM directory or hub id (org/name, through the HF cache); None: the embedded model.
    model: str | None = None
    # The name clients see (GetModelInfo, the gateway's model); None: the hub id, the directory's name, or
    # the embedded model's name.
    served_model_name: str | None = None
    # Where the embedded model is built and cached, and the tokenizer's description (None: ~/.cache/structd/models).
    model_cache_dir: Path | None = None
    tp: int = 1
    device: str | None = None  # None: cuda when present, else cpu
    # auto: the checkpoint's dtype where the device computes it natively, else float32 (model_loading.pick_dtype).
    dtype: str = "auto"
    # torch intra-op threads on CPU (0: half the cores, leaving the rest to co-located grammar replicas).
    num_threads: int = 0
    # The KV cache's bytes (per rank); 0: on CUDA sized from the device's memory (--gpu-memory-utilization,
    # inference_svc/model/kv_budget.py), elsewhere DEFAULT_KV_CACHE_BYTES.
    kv_cache_bytes: int = 0
    gpu_memory_utilization: float = 0.9
    block_size: int = DEFAULT_BLOCK_SIZE
    # torch.compile of the model body: auto (default on CUDA, off on CPU, where it gains too little to pay
    # its compile: docs/benchmarks.md, "Compiled body"), off, default or max-autotune.
    compile: str = "auto"
    # Token-count buckets the body is compiled for (empty: powers of two up to --max-num-batched-tokens).
    compile_buckets: tuple[int, ...] = ()
    # Inductor's on-disk cache of compiled kernels (None: ~/.cache/structd/inductor).
    compile_cache_dir: Path | None = None
    # Benchmarks only: replace the model by random logits after this many ms per step.
    simulate_step_ms: float = 0.0
    # The engine (model, grammar tier link, step loop) in a core process of its own, this one serving the API
    # (engine_core.py): on, off (one process; what tests that read the engine's state use), or auto (on where
    # the model runs on CUDA, off on the CPU: see engine_in_own_process).
    engine_process: str = "auto"
    # The LM head's kernel (lm_head.py): auto = oneDNN over a reordered copy of the head weight on the CPU in
    # float32 (faster there from a few rows on, a little slower at 1-2: docs/benchmarks.md, "The LM head's
    # kernel"; one more copy of the head in memory), F.linear elsewhere; plain: F.linear.
    lm_head_kernel: str = "auto"
    # Decode and extend attention (attention.py): auto = Triton's paged kernel on CUDA, SDPA elsewhere.
    attention_backend: str = "auto"
    engine: EngineConfig = field(default_factory=EngineConfig)
    # A Jinja chat template file that replaces the model's own (None: the tokenizer's template).
    chat_template: Path | None = None
    # Thinking and tool-call format: "auto" (detected from the vocabulary), "none", a bundled family or a JSON file.
    model_family: str = "auto"
    grace_seconds: float = 10.0
    log_level: str = "INFO"
    # None: plaintext gRPC (make run); else TLS, mutual when it names a client CA.
    tls: ServerTls | None = None
    # How the grammar tier is dialled: None: plaintext; else TLS with this CA and client certificate.
    grammar_tls: ClientTls | None = None
    # A plaintext port answering grpc.health.v1 only, for probes without a client certificate (0: none).
    health_port: int = 0
    # RPCs the gRPC server runs at once (streams included); past it new calls get RESOURCE_EXHAUSTED. Twice the
    # default --max-waiting: past the running batch and the queue, more calls would only wait to be refused.
    max_concurrent_rpcs: int = 2048

    def validate(self) -> "InferenceServiceConfig":
        problems = []
        e = self.engine
        if not self.grammar_targets:
            problems.append("--grammar-target needs at least one HOST:PORT")
        if self.tp < 1:
            problems.append("--tp must be at least 1")
        if self.chat_template is not None and not self.chat_template.is_file():
            problems.append(f"--chat-template {self.chat_template}: no such file")
        if self.tp > 1 and self.simulate_step_ms:
            problems.append("the simulated runner has no model to shard: use --tp 1 with --simulate-step-ms")
        if (problem := reference_problem(self.model)) is not None:
            problems.append(problem)
        if self.served_model_name is not None and not self.served_model_name.strip():
            problems.append("--served-model-name must not be empty")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            problems.append(f"--device {self.device}: use cpu or cuda")
        if self.dtype not in ("auto", *DTYPES):
            problems.append(f"--dtype {self.dtype}: use auto, {', '.join(DTYPES)}")
        if self.engine_process not in ENGINE_PROCESS_CHOICES:
            problems.append(f"--engine-process {self.engine_process}: use {', '.join(ENGINE_PROCESS_CHOICES)}")
        if self.lm_head_kernel not in LM_HEAD_KERNEL_CHOICES:
            problems.append(f"--lm-head-kernel {self.lm_head_kernel}: use {', '.join(LM_HEAD_KERNEL_CHOICES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            problems.append(f"--attention-backend {self.attention_backend}: use {', '.join(ATTENTION_BACKENDS)}")
        elif self.attention_backend == "triton" and self.device == "cpu":
            problems.append("--attention-backend triton needs a CUDA device, and --device is cpu: use "
                            "--attention-backend auto or sdpa")
        if self.compile not in COMPILE_CHOICES:
            problems.append(f"--compile {self.compile}: use {', '.join(COMPILE_CHOICES)}")
        elif self.compile not in ("auto", "off") and self.tp > 1:
            problems.append(f"--compile {self.compile} needs --tp 1 (a sharded model is run eagerly)")
        if any(b < 1 for b in self.compile_buckets):
            problems.append("--compile-buckets must be positive token counts")
        if self.num_threads < 0:
            problems.append("--num-threads must be >= 0")
        if self.block_size < 1 or self.kv_cache_bytes < 0:
            problems.append("--block-size must be positive and --kv-cache-bytes at least 0 (0: sized by device)")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"--gpu-memory-utilization {self.gpu_memory_utilization:g}: use a fraction in (0, 1]")
        if self.simulate_step_ms < 0:
            problems.append("--simulate-step-ms must be >= 0")
        if e.max_num_seqs < 0 or e.max_num_batched_tokens < 0:
            problems.append("--max-num-seqs and --max-num-batched-tokens must be at least 0 (0: sized by device)")
        if self.grammar_step_timeout_seconds <= 0:
            problems.append("--grammar-step-timeout-seconds must be positive")
        if e.schema_check_timeout_seconds <= 0:
            problems.append("--schema-check-timeout-seconds must be positive")
        if e.max_prompt_bytes < 1 or e.max_tool_bytes < 1:
            problems.append("--max-prompt-bytes and --max-tool-bytes must be at least 1")
        if self.max_concurrent_rpcs < 1:
            problems.append("--max-concurrent-rpcs must be at least 1")
        if e.max_waiting < 0 or e.default_max_tokens < 1 or e.max_model_len < 0:
            problems.append("--max-waiting, --default-max-tokens and --max-model-len must be positive")
        if e.max_n < 1:
            problems.append("--max-n must be at least 1")
        for tls in (self.tls, self.grammar_tls):
            if tls is not None:
                problems.extend(tls.problems())
        if problems:
            raise SystemExit("invalid inference service configuration: " + "; ".join(problems))
        return self

    def compile_mode(self, device: str) -> str:
        """The --compile mode in force on device: auto is off on CPU and under --tp, default on CUDA."""
        if self.compile != "auto":
            return self.compile
        return "default" if device.startswith("cuda") and self.tp == 1 else "off"

    def engine_in_own_process(self) -> bool:
        """--engine-process in force. auto is on where the model runs on CUDA: there a step takes a few
        milliseconds and the clients' streams, on the step loop's event loop in one process, are what delays
        it. On the CPU the split measured no gain (docs/benchmarks.md, "Host path, second round"): a step's
        129k-wide logits, copied, masked and drawn on the host, outweigh the streams, which overlap the forward
        anyway."""
        if self.engine_process != "auto":
            return self.engine_process == "on"
        from inference_svc.model.model_loading import default_device

        return (self.device or default_device()).startswith("cuda")

    def bucket_sizes(self) -> tuple[int, ...]:
        budget = self.engine.max_num_batched_tokens  # 0 (by device) is MAX_DEFAULT_BUCKET or more everywhere
        return tuple(sorted(set(self.compile_buckets))) or bucket_sizes(min(budget or MAX_DEFAULT_BUCKET,
                                                                            MAX_DEFAULT_BUCKET))

    def torch_threads(self) -> int:
        return self.num_threads or max(1, (os.cpu_count() or 2) // 2)


def bucket_sizes(max_tokens: int) -> tuple[int, ...]:
    """Powers of two up to max_tokens, and max_tokens itself: a step pads to at most twice its tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    sizes.append(max_tokens)
    return tuple(sizes)


def add_arguments(parser: argparse.ArgumentParser, env: dict[str, str]) -> None:
    """Flags for `structd inference`; each defaults to STRUCTD_INFERENCE_<NAME> when set."""
    d, e = InferenceServiceConfig(), EngineConfig()
    f = FlagSet(parser, env, ENV_PREFIX)
    f.add("--host", d.host)
    f.add("--port", d.port)
    f.add("--metrics-port", d.metrics_port, "Prometheus /metrics port (0 disables)")
    f.add("--grammar-target", ",".join(d.grammar_targets),
          "grammar service replica(s): HOST:PORT[,HOST:PORT...] (gRPC target strings)")
    f.add("--grammar-step-timeout-seconds", d.grammar_step_timeout_seconds,
          "a grammar replica that has not answered a step this long after the forward finished is treated as "
          "lost: its requests are replayed on another replica")
    f.add("--model", None, "Hugging Face causal LM directory, or hub id (org/name) resolved through the Hugging "
                           "Face cache (HF_HOME, HF_HUB_CACHE, HF_TOKEN, HF_HUB_OFFLINE=1 respected; downloaded "
                           "when missing); default: the embedded model, built on first use")
    f.add("--served-model-name", None, "the model name clients see (default: the hub id, the directory's name, or "
                                       "structd-tiny-llama for the embedded model)")
    f.add("--model-cache-dir", None, "where the embedded model is cached, and the tokenizer's description for "
                                     "the grammar tier in its tokenizers/ (default ~/.cache/structd/models)",
          kind=Path)
    f.add("--tp", d.tp, "tensor-parallel ranks (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment, "
                        "as a LeaderWorkerSet sets them; without them ranks 1..N-1 are started locally)")
    f.add("--device", None, "cpu or cuda (default: cuda if present)")
    f.add("--dtype", d.dtype, "auto (the checkpoint's dtype where the device computes it natively, else "
                              "float32), float32, bfloat16 or float16")
    f.add("--num-threads", d.num_threads, "torch CPU threads (0: half the cores)")
    f.add("--compile", d.compile, "torch.compile (inductor) of the model body: auto (default on CUDA, with CUDA "
                                  "graphs; off on CPU, where it gains a few percent of a step for minutes of "
                                  "compiling), off, default or max-autotune; compiled once per bucket at start-up")
    f.add("--compile-buckets", "", "token counts the body is compiled for, comma-separated; a step pads to the "
                                   "next one (default: powers of two up to --max-num-batched-tokens, at most "
                                   f"{MAX_DEFAULT_BUCKET}; a larger step runs eagerly)")
    f.add("--compile-cache-dir", None, "inductor's on-disk cache of compiled kernels, reused across restarts "
                                       "(default ~/.cache/structd/inductor)", kind=Path)
    f.add("--kv-cache-bytes", d.kv_cache_bytes, "the KV cache's bytes per rank; 0: on CUDA what "
                                                 "--gpu-memory-utilization leaves after the model and the largest "
                                                 f"step's activations, on CPU {DEFAULT_KV_CACHE_BYTES // 2**20} MiB")
    f.add("--gpu-memory-utilization", d.gpu_memory_utilization,
          "with --kv-cache-bytes 0 on CUDA: the fraction of the device's memory this service may use in all")
    f.add("--block-size", d.block_size)
    f.add("--max-num-seqs", e.max_num_seqs,
          f"requests in the running batch at once; 0: by device (CPU {CPU_BATCH[0]}, GPU {GPU_BATCH[0]}, "
          f"{LARGE_GPU_BATCH[0]} on a GPU of {LARGE_GPU_BYTES // 2**30} GiB or more other than an A100)")
    f.add("--max-num-batched-tokens", e.max_num_batched_tokens,
          f"tokens in one forward; 0: by device (CPU {CPU_BATCH[1]}, GPU {GPU_BATCH[1]}, large GPU "
          f"{LARGE_GPU_BATCH[1]})")
    f.add("--max-waiting", e.max_waiting)
    f.add("--default-max-tokens", e.default_max_tokens)
    f.add("--max-model-len", e.max_model_len)
    f.add("--compile-timeout-seconds", e.compile_timeout_seconds)
    f.add("--schema-check-timeout-seconds", e.schema_check_timeout_seconds,
          "how long the last response of a finished json_schema output waits for its check against the schema "
          "(past it the response says SCHEMA_CHECK_UNCHECKED)")
    f.add("--sparse-head", "on" if e.sparse_head else "off",
          "on: a step whose every sampled row is constrained to a short allowed-id list computes the LM head at "
          "those ids only, when the grammar answered before the model body finished (same distribution); off: "
          "always the full head")
    f.add("--greedy-head", "on" if e.greedy_head else "off",
          "on: greedy rows without logprobs get the LM head only at the ids a bfloat16 screen of it keeps (the "
          "same argmax; CPUs with bfloat16 oneDNN, with --sparse-head on); off: the float32 head for them")
    f.add("--prefix-caching", "on" if e.prefix_caching else "off",
          "on: full KV blocks keep their computed tokens, so a later request whose prompt starts with the same "
          "tokens (a shared instruction, a resent conversation, the n completions of one prompt) computes only "
          "the rest; cached blocks are reclaimed least recently used when an allocation needs them; off: every "
          "prompt is computed from its first token")
    f.add("--max-n", e.max_n, "most completions one request may ask for (sampling n; OpenAI's n)")
    f.add("--max-prompt-bytes", e.max_prompt_bytes, "longest prompt accepted, in UTF-8 bytes (checked before tokenizing; "
                                                    "a chat's messages are checked before the template renders them)")
    f.add("--max-tool-bytes", e.max_tool_bytes, "most bytes of tool parameters schemas one request may carry, all "
                                                "its tools together (checked before any is parsed)")
    f.add("--chat-template", None, "Jinja chat template file used for messages instead of the model's own",
          kind=Path)
    f.add("--model-family", d.model_family,
          "thinking and tool-call format: auto (detected from the tokenizer), none, a bundled family "
          f"({', '.join(bundled_names())}) or a family JSON file")
    f.add("--lm-head-kernel", d.lm_head_kernel,
          "auto: on the CPU in float32 the LM head runs through oneDNN over a copy of its weight reordered at "
          "start-up (faster; one more copy of the head in memory), elsewhere F.linear; plain: always F.linear")
    f.add("--attention-backend", d.attention_backend,
          "decode and extend attention: triton reads keys and values in place from the KV blocks (Triton's "
          "paged kernel, CUDA only), sdpa gathers them into a padded copy for torch's SDPA (the reference); "
          "auto: triton on CUDA when triton imports, else sdpa. A fresh prefill, and a chunk of more than 16 "
          "tokens over cached context, always run on SDPA")
    f.add("--engine-process", d.engine_process,
          "on: the engine (model, grammar tier streams, step loop, sampling, detokenization, metrics) runs in a "
          "core process of its own and this one serves gRPC, chat templates and tools, so the clients' streams "
          "never hold up a step; off: one process; auto: on with CUDA, off on the CPU (no gain measured there)")
    f.add("--simulate-step-ms", d.simulate_step_ms, argparse.SUPPRESS)
    f.add("--grace-seconds", d.grace_seconds)
    f.add("--log-level", d.log_level)
    add_server_flags(f)
    add_client_flags(f, "--grammar-tls", "the grammar tier")
    f.add("--health-port", d.health_port, "plaintext port answering grpc.health.v1 only, for probes that cannot "
                                          "present a client certificate (0: none)")
    f.add("--max-concurrent-rpcs", d.max_concurrent_rpcs,
          "gRPC calls served at once, streams included; past it a new call is refused with RESOURCE_EXHAUSTED "
          "(retried by clients)")


def parse_targets(raw: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in raw.split(",") if t.strip())


def parse_buckets(raw: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in raw.split(",") if b.strip())
    except ValueError:  # the operator's flag value
        raise SystemExit(f"invalid inference service configuration: --compile-buckets {raw}: use token counts "
                         "separated by commas, e.g. 1,8,32,128") from None


def parse_on_off(flag: str, raw: str) -> bool:
    if raw not in ("on", "off"):
        raise SystemExit(f"invalid inference service configuration: {flag} {raw}: use on or off")
    return raw == "on"


def from_args(args: argparse.Namespace) -> InferenceServiceConfig:
    return InferenceServiceConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        grammar_targets=parse_targets(args.grammar_target),
        grammar_step_timeout_seconds=args.grammar_step_timeout_seconds,
        model=args.model or None,
        served_model_name=args.served_model_name,
        model_cache_dir=Path(args.model_cache_dir) if args.model_cache_dir else None,
        tp=args.tp,
        device=args.device or None,
        dtype=args.dtype,
        num_threads=args.num_threads,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        compile=args.compile,
        compile_buckets=parse_buckets(args.compile_buckets),
        compile_cache_dir=Path(args.compile_cache_dir) if args.compile_cache_dir else None,
        simulate_step_ms=args.simulate_step_ms,
        engine_process=args.engine_process,
        lm_head_kernel=args.lm_head_kernel,
        attention_backend=args.attention_backend,
        engine=EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting,
            default_max_tokens=args.default_max_tokens,
            max_model_len=args.max_model_len,
            compile_timeout_seconds=args.compile_timeout_seconds,
            schema_check_timeout_seconds=args.schema_check_timeout_seconds,
            max_prompt_bytes=args.max_prompt_bytes,
            max_tool_bytes=args.max_tool_bytes,
            sparse_head=parse_on_off("--sparse-head", args.sparse_head),
            greedy_head=parse_on_off("--greedy-head", args.greedy_head),
            max_n=args.max_n,
            prefix_caching=parse_on_off("--prefix-caching", args.prefix_caching),
        ),
        chat_template=Path(args.chat_template) if args.chat_template else None,
        model_family=args.model_family,
        grace_seconds=args.grace_seconds,
        log_level=args.log_level,
        tls=server_tls_from_args(args),
        grammar_tls=client_tls_from_args(args, "--grammar-tls"),
        health_port=args.health_port,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
    ).validate()
