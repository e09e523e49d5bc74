"""The compiled model body (--compile) against the eager one, in one process, interleaved.

Loads the embedded model once per variant (eager, and each --compile mode
asked for), gives each runner the same 32 sequences of 64 cached tokens, then
times `PagedModelRunner.forward` at decode N = 1, 5 (padded to 8), 8 and 32
and a 128-token prefill, the variants alternating rep by rep so machine noise
hits them alike. With --small-head the 129k-wide LM head (identical in every
variant, and most of a CPU step) is replaced by a 16-wide one, so the times
are the body's. Prints medians and eager/compiled ratios, and the greedy
agreement of each variant with eager.

    .venv/bin/python -m structd.bench.compiled_body --threads 1 [--small-head] [--modes default,max-autotune]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

CONTEXT = 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="default", help="compile modes, comma-separated")
    parser.add_argument("--buckets", default="1,8,32,128")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--small-head", action="store_true", help="time the body: a 16-wide LM head")
    parser.add_argument("--cache-dir", type=Path, default=None, help="inductor cache (default: --compile's)")
    args = parser.parse_args(argv)

    import torch

    from inference_svc.compiled_forward import CompiledBody, CompileSettings, default_compile_cache_dir
    from inference_svc.embedded_model import ensure_embedded_model
    from inference_svc.model_loading import load_model
    from inference_svc.model_runner import PagedModelRunner, SequenceChunk, StepBatch

    torch.set_num_threads(args.threads)
    model_dir = ensure_embedded_model()
    buckets = tuple(int(b) for b in args.buckets.split(","))
    small_head = torch.nn.Linear(256, 16, bias=False)

    def runner(mode: str) -> PagedModelRunner:
        model, _ = load_model(model_dir, "cpu")
        r = PagedModelRunner.create(model, num_blocks=512)
        if mode != "eager":
            settings = CompileSettings(mode, buckets, args.cache_dir or default_compile_cache_dir())
            CompiledBody.install(model, settings, progress=print)
        if args.small_head:
            model.lm_head = small_head
        for i in range(32):
            r.block_manager.allocate(i, CONTEXT)
            r.forward(StepBatch.of([SequenceChunk(i, tuple(range(100 + i, 100 + i + CONTEXT)), 0)]))
        return r

    runners = {mode: runner(mode) for mode in ("eager", *args.modes.split(","))}

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
    print(f"threads {args.threads}, head {'16' if args.small_head else '129,280'} wide, load {os.getloadavg()}")
    for name, case in cases.items():
        want = case(runners["eager"]).argmax(-1)
        same = all(torch.equal(case(r).argmax(-1), want) for r in runners.values())
        times: dict[str, list[float]] = {mode: [] for mode in runners}
        for _ in range(args.reps):
            for mode, r in runners.items():
                started = time.perf_counter()
                case(r)
                times[mode].append(time.perf_counter() - started)
        med = {mode: statistics.median(t) * 1e3 for mode, t in times.items()}
        cells = "  ".join(f"{mode} {ms:6.2f} ms ({med['eager'] / ms:.2f}x)" for mode, ms in med.items())
        print(f"{name:24s} {cells}  greedy equal: {same}")
    print(f"load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
