"""`structd bench attention`: one layer's decode attention per backend (SDPA's padded gather vs Triton's paged kernel).

At each batch size and context length, sequences with shuffled block tables
over one layer's KV cache; per backend the step's attention context is
built (host work, which the paged kernel mostly skips) and one layer's
attention run, alternating backend by backend rep by rep in one process so
machine noise hits them alike. Reports medians in microseconds (context
build, attention) and triton/sdpa ratios, and the kernel with its context
split off (triton-unsplit) beside its own choice, so what the split buys is
measured in the same run; writes <out>/attention.json and .png. The kernel needs CUDA: on a CPU only SDPA is timed (the kernel's
correctness there is tests/test_paged_kernel.py's, under Triton's
interpreter). Shapes default to a Llama-3-8B layer (32 query heads, 8 KV
heads, head dim 128).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from structd.bench.harness import UsageError, progress, pyplot, save_figure


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="cuda (both backends) or cpu (SDPA only)")
    p.add_argument("--batches", default="1,32,64", help="decode batch sizes, comma-separated")
    p.add_argument("--contexts", default="512,2048,8192", help="cached tokens per sequence, comma-separated")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20, help="timed calls of each backend per shape")


def result_name(args) -> str:
    return "attention"


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:  # the caller's flag value
        raise UsageError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} takes positive integers, got {text!r}")
    return values


def run(args) -> dict:
    import torch

    from inference_svc.model.paged_kernel import AttentionBackendError, resolve_backend

    batches, contexts = _ints(args.batches, "--batches"), _ints(args.contexts, "--contexts")
    if args.reps < 1 or args.heads % args.kv_heads:
        raise UsageError("--reps must be at least 1 and --heads a multiple of --kv-heads")
    device = torch.device(args.device)
    if device.type == "cpu":
        # As the inference service runs on a CPU (--num-threads 0: half the cores).
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here (use --device cpu to time SDPA alone)")
    try:
        # triton-unsplit: the kernel with its context split off (one part per program), beside triton's own
        # choice, so the split's gain is measured in the same run.
        backends = ["sdpa"] + (["triton", "triton-unsplit"] if resolve_backend("auto", device)[0] == "triton"
                               else [])
    except AttentionBackendError as e:  # the caller's --device: no backend runs there
        raise UsageError(str(e)) from None
    rows = []
    for batch in batches:
        for context in contexts:
            progress(f"batch {batch}, context {context}: {', '.join(backends)}")
            rows.append(_shape(args, device, batch, context, backends))
    return {"device": str(device), "backends": backends, "shapes": rows}


def _shape(args, device, batch: int, context: int, backends: list[str]) -> dict:
    import torch

    from inference_svc.model.attention import CONTEXT_KWARG, PagedAttentionContext, paged_attention_forward
    from inference_svc.model.paged_kv import KVCacheSpec, PagedKVCache

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    bs = args.block_size
    per_seq = -(-(context + 1) // bs)
    cache = PagedKVCache(KVCacheSpec(1, args.kv_heads, args.head_dim, dtype, bs), batch * per_seq, device)
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq)
    q = torch.randn(1, args.heads, batch, args.head_dim, device=device, dtype=dtype)
    k = torch.randn(1, args.kv_heads, batch, args.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    layer = SimpleNamespace(layer_idx=0)
    times: dict[str, dict[str, list[float]]] = {b: {"build": [], "attention": []} for b in backends}
    outs = {}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for rep in range(args.reps + 2):  # the first two are warm-up (the kernel compiles on its first call)
        for backend in backends if rep % 2 else backends[::-1]:
            sync()
            t0 = time.perf_counter()
            ctx = PagedAttentionContext.build(cache, [1] * batch, [context] * batch, tables, device,
                                              paged_kernel=backend != "sdpa")
            if backend == "triton-unsplit":
                ctx = replace(ctx, kernel=replace(ctx.kernel, splits=1))
            sync()
            t1 = time.perf_counter()
            out, _ = paged_attention_forward(layer, q, k, v, None, scaling=args.head_dim**-0.5,
                                             **{CONTEXT_KWARG: ctx})
            sync()
            t2 = time.perf_counter()
            if rep >= 2:
                times[backend]["build"].append((t1 - t0) * 1e6)
                times[backend]["attention"].append((t2 - t1) * 1e6)
            outs[backend] = out.float()
    row = {"batch": batch, "context": context}
    for backend in backends:
        row[f"{backend}_build_us"] = round(statistics.median(times[backend]["build"]), 1)
        row[f"{backend}_attention_us"] = round(statistics.median(times[backend]["attention"]), 1)
    if "triton" in backends:
        row["triton_over_sdpa"] = round((row["triton_build_us"] + row["triton_attention_us"])
                                        / (row["sdpa_build_us"] + row["sdpa_attention_us"]), 3)
        row["max_abs_difference"] = float((outs["triton"] - outs["sdpa"]).abs().max())
        row["split_over_unsplit"] = round(row["triton_attention_us"] / row["triton-unsplit_attention_us"], 3)
    return row


def markdown(result: dict) -> str:
    backends = result["backends"]
    head = "| batch | context | " + " | ".join(f"{b} build µs | {b} attention µs" for b in backends)
    lines = [head + (" | triton / sdpa |" if "triton" in backends else " |"),
             "|" + "---|" * (2 + 2 * len(backends) + ("triton" in backends))]
    for r in result["shapes"]:
        cells = [str(r["batch"]), str(r["context"])]
        cells += [f"{r[f'{b}_{k}_us']}" for b in backends for k in ("build", "attention")]
        if "triton" in backends:
            cells.append(f"{r['triton_over_sdpa']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, png: Path) -> None:
    rows, backends = result["shapes"], result["backends"]
    fig, ax = pyplot().subplots(figsize=(8, 3.5))
    width = 0.8 / len(backends)
    for i, b in enumerate(backends):
        ax.bar([x + i * width for x in range(len(rows))],
               [r[f"{b}_build_us"] + r[f"{b}_attention_us"] for r in rows], width=width, label=b)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))],
                  [f"B{r['batch']} ctx{r['context']}" for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("median µs (build + one layer)")
    ax.set_title(f"decode attention on {result['device']}")
    ax.legend()
    save_figure(fig, png)
