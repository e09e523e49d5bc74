"""`structd bench grammar --compile-burst`: head-of-line blocking in the compile pool.

What a new user does on day one: send a burst of distinct JSONSchemaBench
schemas, many at a time, to one replica with the default compile workers. A
few schemas in any such set run to the compile deadline; the question is what
that does to everyone else's compiles.

Three passes, each on a fresh server (or, with --server, on the running one
with a per-pass title so no pass hits another's cache):

1. solo: one Compile at a time: each schema's own outcome and latency;
2. burst: all of them, --burst-concurrency in flight;
3. fast_only: the control, the burst again with only the fast schemas: what
   sharing the cores costs them with no slow schema in the way.

A burst failure whose schema compiled solo is a head-of-line failure: that
request failed because of the others. "Fast" schemas are those that compiled
solo within --burst-fast-seconds; their latency in the burst against solo
and against the fast-only burst are the figures of merit. During the burst the server's compile-worker gauge is
sampled for the plot.

Writes <out>/compile-burst.json and <out>/compile-burst.png.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

from structd.bench.grammar.server import start_server
from structd.bench.grammar.walks import (CompileRecord, compile_once, server_default_compile_workers,
                                         warm_up_compile_workers)
from structd.bench.harness import machine, progress, pyplot, save_figure
from structd.bench.harness.metrics import parse_metrics
from structd.bench.schema_samples import read_jsonl
from structd.bench.stats import summarize


def add_arguments(parser) -> None:
    parser.add_argument("--compile-burst", action="store_true",
                        help="run only the compile burst benchmark (solo pass, then a concurrent burst) "
                             "and write compile-burst.json/png")
    parser.add_argument("--burst-schemas", type=int, default=64,
                        help="schemas in the burst, evenly spaced over --schemas (default 64)")
    parser.add_argument("--burst-concurrency", type=int, default=16, help="Compile calls in flight during the burst")
    parser.add_argument("--burst-fast-seconds", type=float, default=1.0,
                        help="a schema whose solo compile took at most this long counts as fast")


def _titled(schema, title: str):
    """The same language under another grammar id: JSON Schema's title is an annotation."""
    if isinstance(schema, dict):
        return {**schema, "title": title}
    return schema


def _records(schemas: list[dict], title: str | None) -> list[CompileRecord]:
    return [CompileRecord(name=s.get("name", str(i)), dataset=s.get("dataset", ""),
                          schema_text=json.dumps(_titled(s["schema"], title) if title else s["schema"]))
            for i, s in enumerate(schemas)]


class _GaugeSampler:
    """Polls the server's /metrics for grammar_svc_compile_workers{state} while a pass runs."""

    def __init__(self, server, t0: float, interval: float = 0.25):
        self.server, self.t0, self.interval = server, t0, interval
        self.samples: list[dict] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.server is not None:
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        prefix = "grammar_svc_compile_workers{state="
        while True:
            try:
                samples = parse_metrics(await asyncio.to_thread(self.server.metrics_text))
            except OSError:  # the server's metrics endpoint: a missed sample is only a gap in the plot
                samples = {}
            row: dict = {"t": time.perf_counter() - self.t0}
            row.update({k[len(prefix):-1]: v for k, v in samples.items() if k.startswith(prefix)})
            self.samples.append(row)
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def _pass(target: str, desc, records: list[CompileRecord], timeout: float, concurrency: int, workers: int,
                server=None) -> dict:
    from shared.grammar_client import GrammarClient

    client = GrammarClient(target)
    try:
        await client.register_tokenizer(desc)
        await warm_up_compile_workers(client, desc.fingerprint, workers)
        sem = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()
        sampler = _GaugeSampler(server, t0)
        sampler.start()
        done = 0

        async def one(rec: CompileRecord):
            nonlocal done
            async with sem:
                start = time.perf_counter() - t0
                status, seconds, resp, err = await compile_once(client, desc.fingerprint, rec.schema_text, timeout)
            rec.status, rec.cold_seconds, rec.error = status, seconds, err
            rec.server_compile_seconds = resp.compile_duration_seconds if resp is not None else None
            rec.cold_cache_hit = bool(resp is not None and resp.cache_hit)
            done += 1
            if done % 8 == 0 or done == len(records):
                progress(f"  {done}/{len(records)} ({time.perf_counter() - t0:.0f} s)")
            return start

        starts = await asyncio.gather(*[one(r) for r in records])
        wall = time.perf_counter() - t0
        await sampler.stop()
        return {"wall_seconds": wall, "starts": starts, "workers": sampler.samples}
    finally:
        await client.close()


def run_burst(args) -> dict:
    """The solo pass, the burst and the burst without the slow schemas: their aggregates."""
    schemas = read_jsonl(args.schemas, args.burst_schemas)
    order = list(range(len(schemas)))
    # Categories are contiguous in the file: shuffle (seeded) so slow and fast schemas interleave.
    random.Random(args.seed).shuffle(order)
    schemas = [schemas[i] for i in order]
    progress(f"compile burst: {len(schemas)} schemas from {args.schemas}, {args.burst_concurrency} in flight, "
             f"deadline {args.compile_timeout:g} s")
    from shared.tokenizer import default_description

    desc = default_description()
    result: dict = {}
    workers = args.compile_workers or server_default_compile_workers()
    passes = {}
    run_tag = f"{int(time.time())}"
    for name, concurrency in (("solo", 1), ("burst", args.burst_concurrency), ("fast_only", args.burst_concurrency)):
        chosen = schemas
        if name == "fast_only":
            # The control: the same burst without the slow schemas, so what is left is plain CPU sharing.
            chosen = [sc for sc, r in zip(schemas, passes["solo"]["records"])
                      if r.status == "ok" and r.cold_seconds <= args.burst_fast_seconds]
        records = _records(chosen, f"structd-burst-{name}-{run_tag}" if args.server else None)
        server = None
        if not args.server:
            server = start_server(args, args.out / f"server-{name}.log")
            result.setdefault("server_command", " ".join(server.cmd[1:]))
        target = server.target if server else args.server
        progress(f"{name} pass: {len(records)} schemas, {concurrency} in flight on {target}")
        try:
            p = asyncio.run(_pass(target, desc, records, args.compile_timeout, concurrency, workers, server))
            if server is not None:
                p["server_metrics_text"] = _compile_metrics(server.metrics_text())
        finally:
            if server is not None:
                server.stop()
        p["records"] = records
        passes[name] = p
        progress(f"{name} pass: {_statuses(records)} in {p['wall_seconds']:.1f} s")
    result.update(burst_aggregates(passes, args.burst_fast_seconds))
    m = machine()
    result["title"] = (f"structd bench grammar --compile-burst: {len(schemas)} schemas, {args.burst_concurrency} "
                       f"in flight, {workers} compile worker(s), {m['cpu_model']} x{m['logical_cpus']}")
    return result


def _compile_metrics(text: str) -> list[str]:
    """The server's compile and worker series at the end of a pass (for the record)."""
    return [line for line in text.splitlines()
            if line.startswith(("grammar_svc_compile_failures_total", "grammar_svc_compile_worker",
                                "grammar_svc_compile_workers"))]


def _statuses(records: list[CompileRecord]) -> dict:
    out: dict[str, int] = {}
    for r in records:
        out[r.status] = out.get(r.status, 0) + 1
    return out


def burst_aggregates(passes: dict, fast_seconds: float) -> dict:
    solo, burst = passes["solo"]["records"], passes["burst"]["records"]
    rows = []
    for s, b, start in zip(solo, burst, passes["burst"]["starts"]):
        rows.append({"name": s.name, "dataset": s.dataset, "schema_bytes": len(s.schema_text),
                     "solo_status": s.status, "solo_seconds": s.cold_seconds, "solo_server_seconds": s.server_compile_seconds,
                     "burst_status": b.status, "burst_seconds": b.cold_seconds, "burst_start_seconds": start,
                     "burst_error": b.error, "solo_error": s.error})
    fast = [r for r in rows if r["solo_status"] == "ok" and r["solo_seconds"] <= fast_seconds]
    ratios = [r["burst_seconds"] / r["solo_seconds"] for r in fast if r["burst_status"] == "ok"]
    # The fast schemas in the control burst (same order, same concurrency, no slow ones).
    control = passes["fast_only"]["records"] if "fast_only" in passes else []
    for r, c in zip(fast, control):  # the control pass ran exactly these schemas, in this order
        r["fast_only_status"] = c.status
        r["fast_only_seconds"] = c.cold_seconds
    vs_control = [r["burst_seconds"] / r["fast_only_seconds"] for r in fast
                  if r["burst_status"] == "ok" and r.get("fast_only_status") == "ok"]
    hol = [r for r in rows if r["burst_status"] != "ok" and r["solo_status"] == "ok"]
    return {
        "solo": {"statuses": _statuses(solo), "wall_seconds": passes["solo"]["wall_seconds"],
                 "seconds_ok": summarize([r.cold_seconds for r in solo if r.status == "ok"])},
        "burst": {"statuses": _statuses(burst), "wall_seconds": passes["burst"]["wall_seconds"],
                  "seconds_ok": summarize([r.cold_seconds for r in burst if r.status == "ok"]),
                  "workers": passes["burst"]["workers"],
                  "server_metrics": passes["burst"].get("server_metrics_text", [])},
        "fast": {"threshold_seconds": fast_seconds, "n": len(fast),
                 "failed_in_burst": sum(1 for r in fast if r["burst_status"] != "ok"),
                 "solo_seconds": summarize([r["solo_seconds"] for r in fast]),
                 "burst_seconds": summarize([r["burst_seconds"] for r in fast if r["burst_status"] == "ok"]),
                 "burst_over_solo": summarize(ratios),
                 # Without the slow schemas: what 16 fast compiles sharing the cores cost by themselves.
                 "fast_only_seconds": summarize([r["fast_only_seconds"] for r in fast
                                                 if r.get("fast_only_status") == "ok"]),
                 "fast_only_statuses": _statuses(control),
                 "burst_over_fast_only": summarize(vs_control)},
        # Failed in the burst although the schema compiled on its own: blocked by the others.
        "head_of_line_failures": len(hol),
        "head_of_line_failed": [{k: r[k] for k in ("name", "solo_seconds", "burst_status", "burst_error")} for r in hol],
        "schemas": rows,
    }


def burst_summary_text(r: dict) -> str:
    f = r["fast"]
    lines = [
        f"solo:  {r['solo']['statuses']} in {r['solo']['wall_seconds']:.1f} s",
        f"burst: {r['burst']['statuses']} in {r['burst']['wall_seconds']:.1f} s",
        f"failed in the burst although they compiled solo: {r['head_of_line_failures']}",
        f"fast schemas (solo <= {f['threshold_seconds']:g} s): {f['n']}, {f['failed_in_burst']} failed in the burst; "
        f"burst/solo latency p50 {f['burst_over_solo'].get('p50', float('nan')):.2f}x "
        f"p90 {f['burst_over_solo'].get('p90', float('nan')):.2f}x max {f['burst_over_solo'].get('max', float('nan')):.2f}x; "
        f"burst latency p50 {f['burst_seconds'].get('p50', float('nan')) * 1e3:.0f} ms "
        f"max {f['burst_seconds'].get('max', float('nan')) * 1e3:.0f} ms",
        f"the same fast schemas in a burst without the slow ones: {f['fast_only_statuses']}, latency p50 "
        f"{f['fast_only_seconds'].get('p50', float('nan')) * 1e3:.0f} ms; with the slow ones / without: p50 "
        f"{f['burst_over_fast_only'].get('p50', float('nan')):.2f}x p90 "
        f"{f['burst_over_fast_only'].get('p90', float('nan')):.2f}x",
    ]
    return "\n".join(lines)


def plot_burst(result: dict, path: Path) -> None:
    fig, axes = pyplot().subplots(1, 3, figsize=(18, 5.5))
    rows = result["schemas"]
    colors = {"ok": "tab:green", "timeout": "tab:red", "invalid": "tab:grey", "error": "tab:purple"}

    ax = axes[0]
    for status, color in colors.items():
        pts = [(r["solo_seconds"], r["burst_seconds"]) for r in rows if r["burst_status"] == status]
        if pts:
            ax.scatter(*zip(*pts), s=14, color=color, label=f"burst {status} ({len(pts)})")
    pts = [(r["solo_seconds"], r["fast_only_seconds"]) for r in rows if r.get("fast_only_status") == "ok"]
    if pts:
        ax.scatter(*zip(*pts), s=10, marker="x", color="tab:blue", alpha=0.6,
                   label=f"same schema, burst without the slow ones ({len(pts)})")
    lo = max(1e-3, min(min(r["solo_seconds"], r["burst_seconds"]) for r in rows) / 2)
    hi = max(max(r["solo_seconds"], r["burst_seconds"]) for r in rows) * 2
    for k, ls in ((1, "-"), (3, "--"), (10, ":")):
        ax.plot([lo, hi], [lo * k, hi * k], color="grey", lw=0.8, ls=ls, label=f"burst = {k}x solo")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="solo Compile latency (s)",
           ylabel="burst Compile latency (s)", title="Each schema: alone vs in the burst")
    ax.legend(fontsize=7)

    ax = axes[1]
    for i, r in enumerate(sorted(rows, key=lambda r: r["burst_start_seconds"])):
        ax.plot([r["burst_start_seconds"], r["burst_start_seconds"] + r["burst_seconds"]], [i, i],
                color=colors.get(r["burst_status"], "black"), lw=2)
    ax.set(xlabel="seconds since the burst started", ylabel="request (by start)",
           title="Burst timeline (green ok, red DEADLINE_EXCEEDED)")

    ax = axes[2]
    samples = result["burst"].get("workers") or []
    if samples:
        t = [s["t"] for s in samples]
        for state in ("busy", "idle", "starting"):
            ax.plot(t, [s.get(state, 0) for s in samples], label=state)
        ax.legend(fontsize=7)
    ax.set(xlabel="seconds since the burst started", ylabel="compile workers",
           title="grammar_svc_compile_workers during the burst")

    fig.suptitle(result.get("title", "compile burst"), fontsize=10)
    save_figure(fig, path)
