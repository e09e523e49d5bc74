"""`structd bench compiled-body`: the compiled model body (--compile) against the eager one, in one process, interleaved.

Loads the embedded model once per variant (eager, and each --modes compile
mode; `--modes ''`: eager only), gives each runner the same sequences of
64 cached tokens, then times `PagedModelRunner.forward` at decode N = 1, 5
(padded to 8), 8 and 32 (--decodes) and a 128-token prefill, the variants
alternating rep by rep so machine noise hits them alike. With --small-head
the 129k-wide LM head (identical in every variant, and most of a CPU step)
is replaced by a 16-wide one, so the times are the body's. With --host-model
the model is the 0.5B shape's 24 layers at tiny widths instead, whose
arithmetic is negligible: a step's time is then its host work (Python,
torch's dispatch; on a GPU, launches too), what an eager step on a GPU is
bound by. --mixed adds a step of decodes beside an extend and two prefill
chunks. Reports medians per step and variant, eager/variant ratios, the eager
step's aten ops, and whether each variant's greedy tokens equal eager's;
writes <out>/compiled-body.json and .png. Compiling is cold the first time
(minutes for the default buckets on CPU), cached after.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

from structd.bench.harness import UsageError, progress, pyplot, save_figure

CONTEXT = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default="default", help="compile modes, comma-separated ('': eager only)")
    p.add_argument("--buckets", default="1,8,32,128", help="token buckets compiled, comma-separated")
    p.add_argument("--reps", type=int, default=40, help="timed calls per step and variant")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--small-head", action="store_true", help="time the body: a 16-wide LM head")
    p.add_argument("--decodes", default="1,5,8,32", help="decode batch sizes, comma-separated")
    p.add_argument("--mixed", action="store_true",
                   help="also a mixed step: 30 decodes, a 3-token extend, a 64-token prefill and a 32-token "
                        "chunk over 64 cached tokens")
    p.add_argument("--host-model", action="store_true",
                   help="instead of the embedded model, 24 layers of width 64 (4 heads, 2 KV heads, intermediate "
                        "128) over 512 ids, random: the arithmetic is negligible, a step's time is its host work")
    p.add_argument("--cache-dir", type=Path, default=None, help="inductor cache (default: --compile's)")


def measure(args) -> list[dict]:
    """Medians per step and variant, interleaved rep by rep, with each variant's greedy agreement."""
    import torch

    from inference_svc.model.compiled_forward import CompiledBody, CompileSettings, default_compile_cache_dir
    from inference_svc.model.embedded_model import ensure_embedded_model
    from inference_svc.model.model_loading import load_model
    from inference_svc.model.model_runner import PagedModelRunner, SequenceChunk, StepBatch

    torch.set_num_threads(args.threads)
    model_dir = None if args.host_model else ensure_embedded_model()
    buckets = tuple(int(b) for b in args.buckets.split(","))
    decodes = [int(n) for n in args.decodes.split(",")]
    sequences = max(*decodes, 32 if args.mixed else 0)

    def runner(mode: str) -> PagedModelRunner:
        model = host_model() if args.host_model else load_model(model_dir, "cpu")[0]
        if args.small_head:
            # Before the runner: it computes the head itself, from the model's at creation.
            model.lm_head = torch.nn.Linear(model.config.hidden_size, 16, bias=False)
        r = PagedModelRunner.create(model, num_blocks=max(512, 8 * sequences))
        if mode != "eager":
            settings = CompileSettings(mode, buckets, args.cache_dir or default_compile_cache_dir())
            CompiledBody.install(model, settings, progress=progress)
        for i in range(sequences):
            r.block_manager.allocate(i, CONTEXT)
            r.forward(StepBatch.of([SequenceChunk(i, tokens(r, 100 + i, CONTEXT), 0)]))
        return r

    modes = [m for m in args.modes.split(",") if m]
    runners = {mode: runner(mode) for mode in ("eager", *modes)}

    # Each case reserves its step's KV slots, and gives them back after, outside what is timed and counted.
    def decode(r: PagedModelRunner, n: int):
        for i in range(n):
            r.block_manager.extend(i, 1)
        return (StepBatch.of([SequenceChunk(i, tokens(r, 500 + i), CONTEXT) for i in range(n)]),
                lambda: [r.block_manager.truncate(i, CONTEXT) for i in range(n)])

    def prefill(r: PagedModelRunner, n: int = 128):
        r.block_manager.allocate("p", n)
        return StepBatch.of([SequenceChunk("p", tokens(r, 1000, n), 0)]), lambda: r.block_manager.free("p")

    def mixed(r: PagedModelRunner):
        blocks = r.block_manager
        for i in range(30):
            blocks.extend(i, 1)
        blocks.extend(30, 3)
        blocks.extend(31, 32)
        blocks.allocate("p", 64)

        def undo() -> None:
            for i in range(32):
                blocks.truncate(i, CONTEXT)
            blocks.free("p")
        return StepBatch.of([*(SequenceChunk(i, tokens(r, 500 + i), CONTEXT) for i in range(30)),
                             SequenceChunk(30, tokens(r, 7, 3), CONTEXT), SequenceChunk("p", tokens(r, 1000, 64), 0),
                             SequenceChunk(31, tokens(r, 2000, 32), CONTEXT)]), undo

    def padding(n: int) -> str:
        bucket = min((b for b in buckets if b >= n), default=n)
        return f" (pads to {bucket})" if bucket != n else ""

    def forward(r: PagedModelRunner, case, counter=None) -> tuple[torch.Tensor, tuple[float, float]]:
        """The case's logits, and the forward's wall and thread CPU seconds (the CPU time leaves out the
        waits for a core on a loaded machine; with one torch thread the forward's work is all this thread's)."""
        batch, undo = case(r)
        started, cpu_started = time.perf_counter(), time.thread_time()
        with counter or contextlib.nullcontext():
            out = r.forward(batch)
        seconds = time.perf_counter() - started, time.thread_time() - cpu_started
        undo()
        return out, seconds

    cases = {f"decode N={n}{padding(n)}": lambda r, n=n: decode(r, n) for n in decodes}
    cases["prefill 128"] = prefill
    if args.mixed:
        cases["mixed: 30 decodes, extend 3, prefill 64, chunk 32"] = mixed
    rows = []
    for name, case in cases.items():
        want = forward(runners["eager"], case)[0].argmax(-1)
        greedy_equal = {mode: torch.equal(forward(r, case)[0].argmax(-1), want) for mode, r in runners.items()}
        counter = aten_counter()
        forward(runners["eager"], case, counter)
        times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in runners}
        for _ in range(args.reps):
            for mode, r in runners.items():
                times[mode].append(forward(r, case)[1])
        med = {mode: round(statistics.median(w for w, _ in t) * 1e3, 3) for mode, t in times.items()}
        cpu = {mode: round(statistics.median(c for _, c in t) * 1e3, 3) for mode, t in times.items()}
        rows.append({"step": name, "median_ms": med, "median_cpu_ms": cpu,
                     "eager_over": {mode: round(med["eager"] / ms, 3) for mode, ms in med.items()},
                     "greedy_equal": greedy_equal, "eager_aten_ops": counter.ops})
        progress(f"{name}: " + ", ".join(f"{m} {ms:.2f} ms (CPU {cpu[m]:.2f})" for m, ms in med.items())
                 + f"; eager {counter.ops} aten ops")
    return rows


def tokens(r, start: int, n: int = 1) -> tuple[int, ...]:
    """n consecutive ids from start, wrapped into the model's embedding (--host-model's has 512 rows)."""
    return tuple((start + k) % r.embedding_rows for k in range(n))


def host_model():
    """The --host-model: Qwen2.5-0.5B's layer count and head ratio at tiny widths, random weights."""
    import torch
    from transformers import LlamaForCausalLM

    from inference_svc.model.embedded_model import EmbeddedModelSpec, llama_config

    spec = EmbeddedModelSpec(name="host-work", hidden_size=64, num_hidden_layers=24, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=128)
    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(llama_config(spec, 512, 1, 2, None)).eval()


def aten_counter():
    """A context that counts the aten ops dispatched while it is entered (in .ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class AtenOps(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    return AtenOps()


def plot(result: dict, png: Path) -> None:
    rows = result["steps"]
    modes = list(rows[0]["median_ms"])
    width = 0.8 / len(modes)
    fig, ax = pyplot().subplots(figsize=(8, 3.5))
    for k, mode in enumerate(modes):
        ax.bar([i + (k - (len(modes) - 1) / 2) * width for i in range(len(rows))],
               [r["median_ms"][mode] for r in rows], width=width, label=mode)
    ax.set_xticks(range(len(rows)), [r["step"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("median ms per forward")
    ax.legend()
    save_figure(fig, png)


def result_name(args) -> str:
    return "compiled-body"


def run(args) -> dict:
    if args.reps < 1:
        raise UsageError("--reps must be at least 1")
    for flag, value in (("--buckets", args.buckets), ("--decodes", args.decodes)):
        try:
            counts = [int(b) for b in value.split(",")]
        except ValueError:  # the user's flag
            raise UsageError(f"{flag} must be comma-separated token counts, got {value!r}") from None
        if min(counts) < 1:
            raise UsageError(f"{flag} counts must be at least 1, got {value!r}")
    head = "16" if args.small_head else "512" if args.host_model else "129,280"
    progress(f"threads {args.threads}, {'host-work model' if args.host_model else 'embedded model'}, head {head} "
             f"wide, variants eager{''.join(',' + m for m in args.modes.split(',') if m)}")
    return {"steps": measure(args)}


def markdown(result: dict) -> str:
    rows = result["steps"]
    modes = list(rows[0]["median_ms"])
    lines = ["| step | " + " | ".join(f"{m} ms (eager/{m}), CPU ms" for m in modes)
             + " | eager aten ops | greedy equal |", "|---|" + "---|" * len(modes) + "---|---|"]
    for r in rows:
        cells = " | ".join(f"{r['median_ms'][m]:.2f} ({r['eager_over'][m]:.2f}x), {r['median_cpu_ms'][m]:.2f}"
                           for m in modes)
        lines.append(f"| {r['step']} | {cells} | {r['eager_aten_ops']} | {all(r['greedy_equal'].values())} |")
    return "\n".join(lines)
