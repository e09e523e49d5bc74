"""The inference service's one typed configuration, built from CLI flags and env."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

ENV_PREFIX = "STRUCTD_INFERENCE_"


@dataclass(frozen=True)
class EngineConfig:
    """What the step loop and scheduler need (no network, no model loading)."""

    # Requests in the running batch at once.
    max_num_seqs: int = 64
    # Tokens fed to one forward pass (prefill chunks + decodes + jump-forward runs).
    max_num_batched_tokens: int = 512
    # Requests waiting for admission (grammar compiling included) before RESOURCE_EXHAUSTED.
    max_waiting: int = 1024
    default_max_tokens: int = 256
    # Upper bound on prompt + completion, per request (0: the model's context length).
    max_model_len: int = 0
    # Grammar compile deadline asked of the grammar tier (0: its default).
    compile_timeout_seconds: float = 0.0
    # Prompts longer than this (UTF-8 bytes) are refused before they are tokenized.
    max_prompt_bytes: int = 1 << 20


@dataclass(frozen=True)
class InferenceServiceConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 9401
    grammar_targets: tuple[str, ...] = ("127.0.0.1:50052",)
    # A grammar replica silent this long after a step's forward finished is hung: its requests move elsewhere.
    grammar_step_timeout_seconds: float = 2.0
    # A Hugging Face causal LM directory; None: the embedded default model.
    model: Path | None = None
    # Where the embedded model is built and cached (None: ~/.cache/structd/models).
    model_cache_dir: Path | None = None
    tp: int = 1
    device: str | None = None  # None: cuda when present, else cpu
    dtype: str = "float32"
    # torch intra-op threads on CPU (0: half the cores, leaving the rest to co-located grammar replicas).
    num_threads: int = 0
    kv_cache_bytes: int = 256 * 1024**2
    block_size: int = 16
    # Benchmarks only: replace the model by random logits after this many ms per step.
    simulate_step_ms: float = 0.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    grace_seconds: float = 10.0
    log_level: str = "INFO"

    def validate(self) -> "InferenceServiceConfig":
        problems = []
        e = self.engine
        if not self.grammar_targets:
            problems.append("--grammar-target needs at least one HOST:PORT")
        if self.tp < 1:
            problems.append("--tp must be at least 1")
        if self.tp > 1 and self.simulate_step_ms:
            problems.append("the simulated runner has no model to shard: use --tp 1 with --simulate-step-ms")
        if self.model is not None and not (self.model / "config.json").is_file():
            problems.append(f"--model {self.model} is not a Hugging Face model directory (no config.json)")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            problems.append(f"--device {self.device}: use cpu or cuda")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            problems.append(f"--dtype {self.dtype}: use float32, bfloat16 or float16")
        if self.num_threads < 0:
            problems.append("--num-threads must be >= 0")
        if self.block_size < 1 or self.kv_cache_bytes < 1:
            problems.append("--block-size and --kv-cache-bytes must be positive")
        if self.simulate_step_ms < 0:
            problems.append("--simulate-step-ms must be >= 0")
        if e.max_num_seqs < 1 or e.max_num_batched_tokens < 1:
            problems.append("--max-num-seqs and --max-num-batched-tokens must be at least 1")
        if self.grammar_step_timeout_seconds <= 0:
            problems.append("--grammar-step-timeout-seconds must be positive")
        if e.max_prompt_bytes < 1:
            problems.append("--max-prompt-bytes must be at least 1")
        if e.max_waiting < 0 or e.default_max_tokens < 1 or e.max_model_len < 0:
            problems.append("--max-waiting, --default-max-tokens and --max-model-len must be positive")
        if problems:
            raise SystemExit("invalid inference service configuration: " + "; ".join(problems))
        return self

    def torch_threads(self) -> int:
        return self.num_threads or max(1, (os.cpu_count() or 2) // 2)


def add_arguments(parser: argparse.ArgumentParser, env: dict[str, str]) -> None:
    """Flags for `structd inference`; each defaults to STRUCTD_INFERENCE_<NAME> when set."""
    d, e = InferenceServiceConfig(), EngineConfig()

    def env_default(name: str, default):
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            return default
        return type(default)(raw) if default is not None and not isinstance(default, tuple) else raw

    parser.add_argument("--host", default=env_default("host", d.host))
    parser.add_argument("--port", type=int, default=env_default("port", d.port))
    parser.add_argument("--metrics-port", type=int, default=env_default("metrics_port", d.metrics_port),
                        help="Prometheus /metrics port (0 disables)")
    parser.add_argument("--grammar-target", default=env_default("grammar_target", ",".join(d.grammar_targets)),
                        help="grammar service replica(s): HOST:PORT[,HOST:PORT...] (gRPC target strings)")
    parser.add_argument("--grammar-step-timeout-seconds", type=float,
                        default=env_default("grammar_step_timeout_seconds", d.grammar_step_timeout_seconds),
                        help="a grammar replica that has not answered a step this long after the forward finished "
                             "is treated as lost: its requests are replayed on another replica")
    parser.add_argument("--model", type=Path, default=env.get(ENV_PREFIX + "MODEL"),
                        help="Hugging Face causal LM directory (default: the embedded model, built on first use)")
    parser.add_argument("--model-cache-dir", type=Path, default=env.get(ENV_PREFIX + "MODEL_CACHE_DIR"),
                        help="where the embedded model is cached (default ~/.cache/structd/models)")
    parser.add_argument("--tp", type=int, default=env_default("tp", d.tp),
                        help="tensor-parallel ranks (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment, "
                             "as a LeaderWorkerSet sets them; without them ranks 1..N-1 are started locally)")
    parser.add_argument("--device", default=env.get(ENV_PREFIX + "DEVICE"), help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--dtype", default=env_default("dtype", d.dtype), help="float32, bfloat16 or float16")
    parser.add_argument("--num-threads", type=int, default=env_default("num_threads", d.num_threads),
                        help="torch CPU threads (0: half the cores)")
    parser.add_argument("--kv-cache-bytes", type=int, default=env_default("kv_cache_bytes", d.kv_cache_bytes))
    parser.add_argument("--block-size", type=int, default=env_default("block_size", d.block_size))
    parser.add_argument("--max-num-seqs", type=int, default=env_default("max_num_seqs", e.max_num_seqs))
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=env_default("max_num_batched_tokens", e.max_num_batched_tokens))
    parser.add_argument("--max-waiting", type=int, default=env_default("max_waiting", e.max_waiting))
    parser.add_argument("--default-max-tokens", type=int, default=env_default("default_max_tokens", e.default_max_tokens))
    parser.add_argument("--max-model-len", type=int, default=env_default("max_model_len", e.max_model_len))
    parser.add_argument("--compile-timeout-seconds", type=float,
                        default=env_default("compile_timeout_seconds", e.compile_timeout_seconds))
    parser.add_argument("--max-prompt-bytes", type=int, default=env_default("max_prompt_bytes", e.max_prompt_bytes),
                        help="longest prompt accepted, in UTF-8 bytes (checked before tokenizing)")
    parser.add_argument("--simulate-step-ms", type=float, default=env_default("simulate_step_ms", d.simulate_step_ms),
                        help=argparse.SUPPRESS)
    parser.add_argument("--grace-seconds", type=float, default=env_default("grace_seconds", d.grace_seconds))
    parser.add_argument("--log-level", default=env_default("log_level", d.log_level))


def parse_targets(raw: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in raw.split(",") if t.strip())


def from_args(args: argparse.Namespace) -> InferenceServiceConfig:
    return InferenceServiceConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        grammar_targets=parse_targets(args.grammar_target),
        grammar_step_timeout_seconds=args.grammar_step_timeout_seconds,
        model=Path(args.model) if args.model else None,
        model_cache_dir=Path(args.model_cache_dir) if args.model_cache_dir else None,
        tp=args.tp,
        device=args.device or None,
        dtype=args.dtype,
        num_threads=args.num_threads,
        kv_cache_bytes=args.kv_cache_bytes,
        block_size=args.block_size,
        simulate_step_ms=args.simulate_step_ms,
        engine=EngineConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting,
            default_max_tokens=args.default_max_tokens,
            max_model_len=args.max_model_len,
            compile_timeout_seconds=args.compile_timeout_seconds,
            max_prompt_bytes=args.max_prompt_bytes,
        ),
        grace_seconds=args.grace_seconds,
        log_level=args.log_level,
    ).validate()
