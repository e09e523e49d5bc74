"""`structd bench faults`: what a grammar replica fault costs the requests in flight (docs/benchmarks.md).

For each scenario it starts two `structd grammar` replicas and one `structd
inference` (the simulated runner, so steps take a fixed time) as child
processes on loopback, sends `--requests` concurrent constrained requests (a
JSON array of exactly 40 digits: only a session replayed exactly where it
stopped can produce it), and `--fault-after-seconds` later hits the first
replica: nothing (`none`, the baseline), SIGKILL (`sigkill`: its stream
breaks at once) or SIGSTOP (`sigstop`: it hangs, alive but silent, and is
given up after the inference service's `--grammar-step-timeout-seconds`).
Per request: latency, status, whether the output is valid. Everything stops
by itself (each request has a client deadline).

Writes <out>/faults-bench.json and <out>/faults-bench.png, prints a markdown
table on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time
from pathlib import Path

from structd.bench.harness import UsageError, grammar_and_inference, progress, pyplot, save_figure

DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 40, "maxItems": 40}
FAULTS = {"none": None, "sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--faults", default="none,sigkill,sigstop", help="scenarios, comma-separated: none, sigkill, sigstop")
    p.add_argument("--requests", type=int, default=8, help="concurrent constrained requests per scenario")
    p.add_argument("--simulate-step-ms", type=float, default=10.0)
    p.add_argument("--fault-after-seconds", type=float, default=0.5,
                   help="when the fault hits, after the requests were sent")
    p.add_argument("--grammar-step-timeout-seconds", type=float, default=2.0,
                   help="the inference service's step deadline for a silent replica")
    p.add_argument("--request-timeout-seconds", type=float, default=120.0)


def _valid(text: str) -> bool:
    try:
        values = json.loads(text)
    except ValueError:
        return False
    return isinstance(values, list) and len(values) == 40 and all(isinstance(v, int) and 0 <= v <= 9 for v in values)


async def _requests(target: str, n: int, timeout: float) -> list[dict]:
    from shared.inference_client import AsyncInferenceClient, InferenceError

    async def one(i: int) -> dict:
        started = time.perf_counter()
        try:
            out = await client.complete(f"digits {i}", json_schema=DIGITS, max_tokens=200, temperature=1.0, seed=i,
                                        timeout=timeout)
            status, valid = "OK", _valid(out.text)
        except InferenceError as e:  # the request's outcome, recorded, not raised
            status, valid = e.code.name, False
        return {"latency_seconds": time.perf_counter() - started, "status": status, "valid": valid}

    async with AsyncInferenceClient(target) as client:
        return await asyncio.gather(*(one(i) for i in range(n)))


def run_scenario(name: str, args: argparse.Namespace, logs: Path) -> dict:
    fault = FAULTS[name]
    flags = ("--simulate-step-ms", str(args.simulate_step_ms),
             "--grammar-step-timeout-seconds", str(args.grammar_step_timeout_seconds), "--num-threads", "1")
    with grammar_and_inference(logs, name, replicas=2, grammar_flags=("--compile-workers", "1"),
                               inference_flags=flags) as (grammar, inference):
        first = grammar.services[0]

        async def go() -> list[dict]:
            load = asyncio.ensure_future(_requests(inference.target, args.requests, args.request_timeout_seconds))
            await asyncio.sleep(args.fault_after_seconds)
            if fault is not None and not load.done():
                progress(f"{name}: {signal.Signals(fault).name} to grammar replica {first.target}")
                os.kill(first.proc.pid, fault)
            return await load

        try:
            records = asyncio.run(go())
        finally:
            if fault == signal.SIGSTOP and first.proc.poll() is None:
                os.kill(first.proc.pid, signal.SIGCONT)
    latencies = [r["latency_seconds"] for r in records]
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    summary = {"scenario": name, "requests": records, "statuses": statuses,
               "valid": sum(r["valid"] for r in records), "max_latency_seconds": max(latencies),
               "median_latency_seconds": statistics.median(latencies)}
    progress(f"{name}: {summary['valid']}/{len(records)} valid, median {summary['median_latency_seconds']:.2f} s, "
             f"max {summary['max_latency_seconds']:.2f} s, statuses {statuses}")
    return summary


def markdown(result: dict) -> str:
    lines = ["| scenario | requests | valid | statuses | median latency (s) | max latency (s) |",
             "|---|---|---|---|---|---|"]
    for s in result["scenarios"]:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(s["statuses"].items()))
        lines.append(f"| {s['scenario']} | {len(s['requests'])} | {s['valid']} | {statuses} | "
                     f"{s['median_latency_seconds']:.2f} | {s['max_latency_seconds']:.2f} |")
    return "\n".join(lines)


def plot(result: dict, png: Path) -> None:
    names = [s["scenario"] for s in result["scenarios"]]
    fig, ax = pyplot().subplots(figsize=(7, 4))
    for i, s in enumerate(result["scenarios"]):
        xs = [i] * len(s["requests"])
        ax.scatter(xs, [r["latency_seconds"] for r in s["requests"]], alpha=0.6, color="tab:blue")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("request latency (s)")
    ax.set_title(f"{result['arguments']['requests']} constrained requests; fault on 1 of 2 grammar replicas "
                 f"at {result['arguments']['fault_after_seconds']:g} s", fontsize=9)
    ax.set_ylim(bottom=0)
    save_figure(fig, png)


def result_name(args) -> str:
    return "faults-bench"


def run(args: argparse.Namespace) -> dict:
    names = [x.strip() for x in args.faults.split(",") if x.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown or not names or args.requests < 1:
        raise UsageError(f"error: --faults takes {', '.join(FAULTS)}; --requests must be >= 1")
    scenarios = []
    for name in names:
        progress(f"scenario {name}: starting 2 grammar replicas and the inference service ...")
        scenarios.append(run_scenario(name, args, args.out / "logs"))
    return {"scenarios": scenarios}
