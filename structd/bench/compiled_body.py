"""`structd bench compiled-body`: the compiled model body (--compile) against the eager one, in one process, interleaved.

Loads the embedded model once per variant (eager, and each --modes compile
mode; `--modes ''`: eager only), gives each runner the same 32 sequences of
64 cached tokens, then times `PagedModelRunner.forward` at decode N = 1, 5
(padded to 8), 8 and 32 and a 128-token prefill, the variants alternating
rep by rep so machine noise hits them alike. With --small-head the 129k-wide
LM head (identical in every variant, and most of a CPU step) is replaced by
a 16-wide one, so the times are the body's. Reports medians per step and
variant, eager/variant ratios, and whether each variant's greedy tokens equal
eager's; writes <out>/compiled-body.json and .png. Compiling is cold the
first time (minutes for the default buckets on CPU), cached after.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--cache-dir", type=Path, default=None, help="inductor cache (default: --compile's)")


def measure(args) -> list[dict]:
    """Medians per step and variant, interleaved rep by rep, with each variant's greedy agreement."""
    import torch

    from inference_svc.model.compiled_forward import CompiledBody, CompileSettings, default_compile_cache_dir
    from inference_svc.model.embedded_model import ensure_embedded_model
    from inference_svc.model.model_loading import load_model
    from inference_svc.model.model_runner import PagedModelRunner, SequenceChunk, StepBatch

    torch.set_num_threads(args.threads)
    model_dir = ensure_embedded_model()
    buckets = tuple(int(b) for b in args.buckets.split(","))
    small_head = torch.nn.Linear(256, 16, bias=False)

    def runner(mode: str) -> PagedModelRunner:
        model, _ = load_model(model_dir, "cpu")
        r = PagedModelRunner.create(model, num_blocks=512)
        if mode != "eager":
            settings = CompileSettings(mode, buckets, args.cache_dir or default_compile_cache_dir())
            CompiledBody.install(model, settings, progress=progress)
        if args.small_head:
            model.lm_head = small_head
        for i in range(32):
            r.block_manager.allocate(i, CONTEXT)
            r.forward(StepBatch.of([SequenceChunk(i, tuple(range(100 + i, 100 + i + CONTEXT)), 0)]))
        return r

    modes = [m for m in args.modes.split(",") if m]
    runners = {mode: runner(mode) for mode in ("eager", *modes)}

    def decode(r: PagedModelRunner, n: int) -> torch.Tensor:
        for i in range(n):
            r.block_manager.extend(i, 1)
        out = r.forward(StepBatch.of([SequenceChunk(i, (500 + i,), CONTEXT) for i in range(n)]))
        for i in range(n):
            r.block_manager.truncate(i, CONTEXT)
        return out

    def prefill(r: PagedModelRunner, n: int = 128) -> torch.Tensor:
        r.block_manager.allocate("p", n)
        out = r.forward(StepBatch.of([SequenceChunk("p", tuple(range(1000, 1000 + n)), 0)]))
        r.block_manager.free("p")
        return out

    cases = {"decode N=1": lambda r: decode(r, 1), "decode N=5 (pads to 8)": lambda r: decode(r, 5),
             "decode N=8": lambda r: decode(r, 8), "decode N=32": lambda r: decode(r, 32), "prefill 128": prefill}
    rows = []
    for name, case in cases.items():
        want = case(runners["eager"]).argmax(-1)
        greedy_equal = {mode: torch.equal(case(r).argmax(-1), want) for mode, r in runners.items()}
        times: dict[str, list[float]] = {mode: [] for mode in runners}
        for _ in range(args.reps):
            for mode, r in runners.items():
                started = time.perf_counter()
                case(r)
                times[mode].append(time.perf_counter() - started)
        med = {mode: round(statistics.median(t) * 1e3, 3) for mode, t in times.items()}
        rows.append({"step": name, "median_ms": med,
                     "eager_over": {mode: round(med["eager"] / ms, 3) for mode, ms in med.items()},
                     "greedy_equal": greedy_equal})
        progress(f"{name}: " + ", ".join(f"{m} {ms:.2f} ms" for m, ms in med.items()))
    return rows


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
    try:
        [int(b) for b in args.buckets.split(",")]
    except ValueError:  # the user's --buckets
        raise UsageError(f"--buckets must be comma-separated token counts, got {args.buckets!r}") from None
    progress(f"threads {args.threads}, head {'16' if args.small_head else '129,280'} wide, "
             f"variants eager{''.join(',' + m for m in args.modes.split(',') if m)}")
    return {"steps": measure(args)}


def markdown(result: dict) -> str:
    rows = result["steps"]
    modes = list(rows[0]["median_ms"])
    lines = ["| step | " + " | ".join(f"{m} ms (eager/{m})" for m in modes) + " | greedy equal |",
             "|---|" + "---|" * len(modes) + "---|"]
    for r in rows:
        cells = " | ".join(f"{r['median_ms'][m]:.2f} ({r['eager_over'][m]:.2f}x)" for m in modes)
        lines.append(f"| {r['step']} | {cells} | {all(r['greedy_equal'].values())} |")
    return "\n".join(lines)
