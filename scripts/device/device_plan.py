"""What the device check runs: its phases, each a list of steps, each one command with its own time budget.

Every step is a subprocess driven through a command line that outlives
refactors of the code behind it (`pytest -m cuda`, `structd bench e2e`,
`structd bench grammar`, random_llama.py, hf_peer.py), so the plan only names flags.
The GPU plan and the CPU smoke's are the same steps on different sizes: the
smoke runs each kind of step once on tiny shapes, so a flag that a bench
drops or renames fails `make test` rather than the next rare GPU run.

Budgets are seconds of the whole run's (the issue's 8 minutes): a step may
also use what the steps before it left unused, never what the steps after it
were given (scripts/device/check's `step_timeout`). They come from the first
GPU run (H200, 2026-11-27), where a plan whose guesses summed to 480 s ran out
after its first model run: setup, correctness and the 0.5B shape fit one call;
the 8B shape (`--only large`) and the host path (`--only host`) are each a
second call's work (DEFAULT_CALL: what a call without --only runs). Within a
phase the steps go most telling first (the compiled body is what `--compile
auto` serves on CUDA; eager and four grammar replicas after), so what a short
run cuts is what matters least.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

GiB = 1024**3
# The targets for the simulated 2 ms host path (docs/benchmarks.md, "On a GPU").
TPOT_RATIO_TARGET = {1: 1.10, 2: 1.05}
MASK_WAIT_TARGET = 0.03
# Fewer seconds than this left for a step: it is recorded as skipped rather than started to be killed.
MIN_STEP_SECONDS = 10.0


@dataclass
class Step:
    phase: str
    name: str
    argv: list[str]
    budget: float  # seconds of the run's budget this step may use (plus what earlier steps left)
    env: dict[str, str] = field(default_factory=dict)
    kind: str = "command"  # versions, pytest, build, e2e, peer, grammar, attention: how its output is summarised
    needs: str | None = None  # a step that must have succeeded first (a model build)
    skip: str | None = None  # why the step is not run here (set before the run)
    label: str = ""


@dataclass(frozen=True)
class Phase:
    name: str
    title: str
    what: str


PHASES = (
    Phase("setup", "Versions", "the carried wheels import; torch, transformers, triton, xgrammar and the device"),
    Phase("correctness", "Correctness on CUDA",
          "`pytest -m cuda` with CUDA_LAUNCH_BLOCKING=1 (tests/test_batched_sampling.py, tests/test_paged_kernel.py, "
          "tests/test_cuda_paths.py): the batched sampler, Triton's paged attention kernel vs SDPA, the paged runner "
          "vs the CPU reference in fp32 and bf16, the compiled body's CUDA graphs warmed and replayed on the device "
          "thread, xgrammar's mask kernel vs the CPU path, the step sampler, the LM head's choice, servers on "
          "cuda:N (greedy and logprobs as the CPU's, ids past the embedding refused, compiled with the KV cache "
          "sized from the device), sparse vs full head, the engine-core process end to end, --tp 2 on two GPUs"),
    Phase("realistic", "Realistic shapes",
          "one layer's decode attention, SDPA vs Triton's paged kernel (`structd bench attention`); a "
          "random-weight 0.5B Llama config on the 129k tokenizer through `structd bench e2e` (compiled with two "
          "buckets, then eager with 1 and 4 grammar replicas), 1/32/128 concurrent; transformers + xgrammar on "
          "the same GPU and shape (scripts/device/hf_peer.py) at 1 and 32"),
    Phase("large", "The 8B shape",
          "the same for a random-weight 8B Llama config: compiled (one bucket), transformers + xgrammar, eager "
          "with 1 grammar replica"),
    Phase("host", "Host path",
          "the simulated 2 ms and 5 ms runners at N = 32, 64 with 1 and 2 grammar replicas; the grammar "
          "replica's round trip at 32/128/256 sessions with 1, 4 and 8 fill threads"),
)


# What a GPU run's call does without --only: the phases one call's budget holds (the others: --only large,
# --only host, or --only all for everything in one call, later steps cut where time runs out).
DEFAULT_CALL = ("setup", "correctness", "realistic")


def phases_for(only: str, smoke: bool) -> set[str] | None:
    """The phases a call runs for its --only value (None: every phase; setup always): the smoke runs every
    phase, a GPU call without --only DEFAULT_CALL's. ValueError naming what is not a phase."""
    names = {p.strip() for p in only.split(",") if p.strip()}
    if "all" in names or (not names and smoke):
        return None
    if not names:
        return set(DEFAULT_CALL)
    if unknown := names - {p.name for p in PHASES}:
        raise ValueError(f"no phase {', '.join(sorted(unknown))} (phases: {', '.join(p.name for p in PHASES)}, "
                         "or all)")
    return names | {"setup"}


def python() -> list[str]:
    return [sys.executable]


def structd(*args: str) -> list[str]:
    return [*python(), "-m", "structd", *args]


def kv_cache_bytes(device_memory: int | None, weight_bytes: int) -> int:
    """Half of what the weights and a working margin leave of the device's memory, 1 to 16 GiB."""
    if not device_memory:
        return GiB
    return int(min(16 * GiB, max(GiB, 0.5 * (device_memory - weight_bytes - 6 * GiB))))


@dataclass(frozen=True)
class Sizes:
    """The knobs that differ between the GPU run and the CPU smoke."""

    shapes: tuple[str, ...]
    dtype: str
    device: str
    concurrency: str
    replicas: dict  # shape -> grammar replica counts of its eager runs
    max_tokens: int
    requests: int
    waves: int
    peer_concurrency: str
    compiled: dict  # shape -> compile buckets (empty: no compiled run of that shape)
    sims: str
    sim_concurrency: str
    sim_replicas: tuple[int, ...]
    sim_requests: int
    sim_waves: int
    grammar_batches: str
    grammar_steps: int
    grammar_limit: int
    fill_threads: tuple[int, ...]
    budgets: dict  # step name prefix -> seconds


# Measured on the first run (H200): versions 9 s, pytest 136 s (its compiled servers failing at once),
# attention 16 s, build-0.5b 20 s, build-8b 32 s, 0.5b eager with 1 replica 93 s at 8 requests (N = 1 runs
# them one by one, at a 36 ms eager forward: 4 requests halve that part). A budget of 0: only with time to spare.
GPU = Sizes(shapes=("0.5b", "8b"), dtype="bfloat16", device="cuda", concurrency="1,32,128",
            replicas={"0.5b": (1, 4), "8b": (1,)}, max_tokens=32, requests=4, waves=1, peer_concurrency="1,32",
            compiled={"0.5b": "32,128", "8b": "128"},
            sims="sim2,sim5", sim_concurrency="32,64", sim_replicas=(1, 2), sim_requests=32, sim_waves=2,
            grammar_batches="32,128,256", grammar_steps=100, grammar_limit=32, fill_threads=(1, 4, 8),
            budgets={"versions": 20, "pytest": 170, "attention": 20, "build-0.5b": 25, "e2e-0.5b-compiled": 120,
                     "peer-0.5b": 45, "e2e-0.5b-eager-g1": 70, "e2e-0.5b-eager-g4": 0,
                     "build-8b": 35, "e2e-8b-compiled": 120, "peer-8b": 60, "e2e-8b-eager": 0,
                     "e2e-sim": 30, "grammar": 16})
# The smoke runs no simulated-runner e2e step: the tiny model's e2e step runs `structd bench e2e` out of
# process, tests/test_bench_e2e.py runs the simulated runners, and tests/test_device_check.py parses every
# structd step's flags of the GPU plan, the sims' included.
SMOKE = Sizes(shapes=("tiny",), dtype="float32", device="cpu", concurrency="2", replicas={"tiny": (1,)},
              max_tokens=4, requests=2, waves=1, peer_concurrency="2", compiled={}, sims="sim2", sim_concurrency="2",
              sim_replicas=(), sim_requests=2, sim_waves=1, grammar_batches="2", grammar_steps=3, grammar_limit=2,
              fill_threads=(1,),
              budgets={"versions": 60, "pytest": 120, "build": 60, "e2e": 120, "peer": 60, "grammar": 120})


def budget(sizes: Sizes, name: str) -> float:
    for prefix in sorted(sizes.budgets, key=len, reverse=True):
        if name.startswith(prefix):
            return float(sizes.budgets[prefix])
    return 30.0


def plan(*, smoke: bool, repo: Path, work: Path, model_root: Path, schemas: Path, device_memory: int | None,
         cuda: bool, only: set[str] | None = None) -> list[Step]:
    """The steps in run order (those of phases not in `only` left out)."""
    from random_llama import parameter_count

    sizes = SMOKE if smoke else GPU
    steps: list[Step] = []

    def add(phase, name, argv, **kw):
        if only is None or phase in only:
            steps.append(Step(phase, name, argv, budget(sizes, name), **kw))

    add("setup", "versions", [*python(), str(repo / "scripts" / "device" / "versions.py")], kind="versions")
    add("correctness", "pytest-cuda",
        # The files without servers first: a step cut off by its budget has run the cheap checks. -v: each test's
        # outcome is in stdout.log as it ends (the summary's source when no junit.xml was written).
        [*python(), "-m", "pytest", "-m", "cuda", "tests/test_batched_sampling.py", "tests/test_paged_kernel.py",
         "tests/test_cuda_paths.py", "-v",
         "-p", "no:cacheprovider",
         # A test that hangs (a CUDA graph, a core that never answers) fails alone; the others still run.
         "-o", "addopts=", "-rs", "--timeout=100", f"--junitxml={work / 'pytest-cuda' / 'junit.xml'}"],
        env={"CUDA_LAUNCH_BLOCKING": "1"}, kind="pytest")

    no_gpu = (None if smoke or cuda
              else "no CUDA device here (the realistic shapes need one; --cpu-smoke runs tiny ones)")
    e2e_common = ["--concurrency", sizes.concurrency, "--max-tokens", str(sizes.max_tokens),
                  "--requests", str(sizes.requests), "--waves", str(sizes.waves), "--no-peers",
                  "--no-jump-forward-phase", "--no-mixed", "--dtype", sizes.dtype]

    def e2e_env(shape: str, compile_buckets: str | None) -> dict[str, str]:
        weight_bytes = parameter_count(shape) * (4 if sizes.dtype == "float32" else 2)
        env = {"STRUCTD_INFERENCE_MODEL": str(model_root / f"llama-{shape}"),
               "STRUCTD_INFERENCE_DEVICE": sizes.device,
               "STRUCTD_INFERENCE_KV_CACHE_BYTES": str(kv_cache_bytes(device_memory, weight_bytes)),
               "STRUCTD_INFERENCE_COMPILE": "default" if compile_buckets else "off",
               "STRUCTD_INFERENCE_COMPILE_CACHE_DIR": str(work / "inductor")}
        if compile_buckets:
            env["STRUCTD_INFERENCE_COMPILE_BUCKETS"] = compile_buckets
        return env

    # One layer's decode attention per backend (SDPA's gather vs Triton's paged kernel): no model needed.
    add("realistic", "attention",
        structd("bench", "attention", "--out", str(work / "attention"), "--device", sizes.device,
                *(["--batches", "2", "--contexts", "32", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                   "--reps", "2"] if smoke else [])),
        kind="attention", skip=no_gpu, label="decode attention, SDPA vs Triton's paged kernel")
    for shape in sizes.shapes:
        # The first shape is the realistic phase's, any larger one the large phase's (a call of its own).
        phase = "realistic" if shape == sizes.shapes[0] else "large"
        add(phase, f"build-{shape}",
            [*python(), str(repo / "scripts" / "device" / "random_llama.py"), "--shape", shape, "--dtype", sizes.dtype,
             "--device", sizes.device, "--out", str(model_root / f"llama-{shape}")], kind="build", skip=no_gpu,
            label=f"{shape}: random {sizes.dtype} weights")
        if shape in sizes.compiled:
            add(phase, f"e2e-{shape}-compiled",
                structd("bench", "e2e", "--out", str(work / f"e2e-{shape}-compiled"), "--runners", "model",
                        "--grammar-replicas", "1", *e2e_common),
                env=e2e_env(shape, sizes.compiled[shape]), kind="e2e", needs=f"build-{shape}", skip=no_gpu,
                label=f"{shape} compiled, buckets {sizes.compiled[shape]}")
        add(phase, f"peer-{shape}",
            [*python(), str(repo / "scripts" / "device" / "hf_peer.py"), "--model", str(model_root / f"llama-{shape}"),
             "--device", sizes.device, "--dtype", sizes.dtype, "--concurrency", sizes.peer_concurrency,
             "--max-tokens", str(sizes.max_tokens), "--out", str(work / f"peer-{shape}")],
            kind="peer", needs=f"build-{shape}", skip=no_gpu, label=f"{shape}: transformers + xgrammar")
        # One bench run per replica count: a run cut off by its budget loses only its own count's figures.
        for replicas in sizes.replicas[shape]:
            add(phase, f"e2e-{shape}-eager-g{replicas}",
                structd("bench", "e2e", "--out", str(work / f"e2e-{shape}-eager-g{replicas}"), "--runners", "model",
                        "--grammar-replicas", str(replicas), *e2e_common),
                env=e2e_env(shape, None), kind="e2e", needs=f"build-{shape}", skip=no_gpu,
                label=f"{shape} eager, {replicas} grammar replica(s)")

    for replicas in sizes.sim_replicas:
        add("host", f"e2e-sim-g{replicas}",
            structd("bench", "e2e", "--out", str(work / f"e2e-sim-g{replicas}"), "--runners", sizes.sims,
                    "--concurrency", sizes.sim_concurrency, "--grammar-replicas", str(replicas),
                    "--max-tokens", str(sizes.max_tokens), "--requests", str(sizes.sim_requests),
                    "--waves", str(sizes.sim_waves), "--no-peers"),
            kind="e2e", label=f"{sizes.sims} at N {sizes.sim_concurrency}, {replicas} grammar replica(s)")
    for threads in sizes.fill_threads:
        add("host", f"grammar-fill{threads}",
            structd("bench", "grammar", "--out", str(work / f"grammar-fill{threads}"), "--schemas", str(schemas),
                    "--limit", str(sizes.grammar_limit), "--batch-sizes", sizes.grammar_batches,
                    "--steps", str(sizes.grammar_steps), "--warmup-steps", "1" if smoke else "10", "--no-local",
                    "--bounded-lengths", "", "--fill-threads", str(threads), "--compile-timeout", "5"),
            kind="grammar", label=f"{threads} fill thread(s)")
    return steps
