"""`structd bench grammar`: the grammar service benchmark (docs/benchmarks.md).

Starts a real grammar server as a child process (so client and server do not
share a GIL), registers the default 129,280-token tokenizer, then over the
JSONSchemaBench sample measures

1. Compile, client-observed: cold (first Compile) and cached (the same spec
   again), with success / invalid / timeout counts;
2. random valid walks at each batch size (sessions per step message): every
   session picks a compiled schema, and at each step samples a uniformly
   random allowed token from the mask it received (decoded as the inference
   side decodes it); sessions that terminate, fail or reach
   --max-session-tokens are closed and replaced in the next step, so the batch
   stays full. Per step: client round trip (write to read), the server's own
   step and fill times from the StepResponse, bytes of every mask;
3. a local pass with xgrammar directly over the same sessions: the per-row
   fill time the wire does not carry, the class of each row (inside a
   maxLength string or not), and the bounded-string rewrite on the same
   tokens (grammar_svc.schema.bounded_strings), checked mask by mask;
4. the bounded-string micro-benchmark (structd.bench.grammar.bounded).

Writes <out>/grammar-bench.json (every aggregate, the machine, the command
line) and <out>/grammar-bench.png. Progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from structd.bench.grammar import report
from structd.bench.grammar.backends import add_arguments as add_backend_arguments
from structd.bench.grammar.backends import coverage_summary_text, plot_coverage, run_backend_coverage
from structd.bench.grammar.burst import add_arguments as add_burst_arguments
from structd.bench.grammar.burst import burst_summary_text, plot_burst, run_burst
from structd.bench.grammar.server import start_server
from structd.bench.grammar.walks import server_default_compile_workers
from structd.bench.harness import machine, progress
from structd.bench.harness.metrics import histogram_delta, parse_metrics
from structd.bench.schema_samples import default_data, read_jsonl
from structd.bench.stats import summarize


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser):
    parser.add_argument("--schemas", type=Path, default=default_data("jsonschemabench-sample.jsonl"),
                        help="JSON Lines of {dataset, name, schema} (default: the JSONSchemaBench sample)")
    parser.add_argument("--limit", type=int, default=0,
                        help="use N schemas, evenly spaced over the file (keeps every category); 0 = all")
    parser.add_argument("--compile-timeout", type=float, default=10.0, help="per-schema compile deadline (s)")
    parser.add_argument("--compile-concurrency", type=int, default=0,
                        help="Compile calls in flight (default: the server's compile workers)")
    parser.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 32, 128], help="sessions per step, e.g. 1,8,32,128")
    parser.add_argument("--steps", type=int, default=1000, help="measured steps per batch size")
    parser.add_argument("--warmup-steps", type=int, default=20, help="unmeasured steps before those")
    parser.add_argument("--max-session-tokens", type=int, default=256,
                        help="close and replace a session after this many tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mask-cache-slots", type=int, default=-1,
                        help="stream mask cache slots the client announces (-1: the client's default; 0: off)")
    parser.add_argument("--compile-workers", type=int, default=0,
                        help="server --compile-workers (default: the server's default)")
    parser.add_argument("--fill-threads", type=int, default=0, help="server --fill-threads (default: the server's default)")
    parser.add_argument("--server", default="",
                        help="benchmark a running server at HOST:PORT instead of starting one (no metrics scrape)")
    parser.add_argument("--no-local", action="store_true", help="skip the local per-row pass")
    parser.add_argument("--no-rewrite-check", action="store_true",
                        help="local pass without the bounded-string rewrite comparison")
    parser.add_argument("--local-grammar", choices=("xgrammar", "served"), default="xgrammar",
                        help="what the local pass replays on: xgrammar's own form of each schema (rows classified "
                             "by its rules; inside strings longer than 128 characters a row takes seconds) or the "
                             "grammar the service serves (its per-row times; no classes, no rewrite check)")
    parser.add_argument("--bounded-lengths", type=_int_list, default=[4, 8, 16, 20, 32, 64, 128, 256, 0],
                        help="maxLength values of the bounded-string micro-benchmark (0: no maxLength); empty skips it")
    parser.add_argument("--bounded-walks", type=int, default=12, help="walks per maxLength in the micro-benchmark")

    add_burst_arguments(parser)
    add_backend_arguments(parser)


def result_name(args) -> str:
    if args.backend_coverage:
        return "backend-coverage"
    return "compile-burst" if args.compile_burst else "grammar-bench"


def run(args) -> dict:
    if args.backend_coverage:
        return run_backend_coverage(args)
    if args.compile_burst:
        return run_burst(args)
    result: dict = {}
    schemas = read_jsonl(args.schemas, args.limit)
    progress(f"{len(schemas)} schemas from {args.schemas}")
    server = None
    if not args.server:
        progress("starting the grammar server (child process)")
        # The bounded-string micro-benchmark asks for 120 s compile deadlines. Spawned first: it starts while
        # this process loads the tokenizer.
        server = start_server(args, args.out / "server.log",
                              ("--cache-bytes", str(8 << 30), "--max-compile-timeout-seconds", "600"), wait=False)
        result["server_command"] = " ".join(server.cmd[1:])
    progress("loading the default tokenizer")
    try:
        from shared.tokenizer import default_description

        desc = default_description()
        if server is not None:
            server.wait_listening()
    except BaseException:  # this process's tokenizer load, or the server's start, failed: the child goes too
        if server is not None:
            server.stop()
        raise
    target = server.target if server is not None else args.server
    progress(f"grammar server at {target}")
    try:
        state = asyncio.run(_remote(args, target, desc, schemas, result))
        if server is not None:
            try:
                samples = parse_metrics(server.metrics_text())
                result["server_metrics"] = {
                    name: histogram_delta({}, samples, name)
                    for name in ("grammar_svc_mask_fill_duration_seconds", "grammar_svc_step_duration_seconds")}
            except OSError as e:
                progress(f"metrics scrape failed: {e}")
    finally:
        if server is not None:
            progress("stopping the grammar server")
            server.stop()
    records, runs, walk_keys = state
    local_grammars, local_rows = None, {}
    if not args.no_local and runs:
        import xgrammar as xgr

        from structd.bench.grammar import local as bench_local

        used = sorted({walk_keys[s.grammar] for r in runs for s in r.sessions})
        progress(f"local pass: compiling {len(used)} grammars here"
                 + ("" if args.no_rewrite_check else " (and their bounded-string rewrites)"))
        info = xgr.TokenizerInfo.deserialize_json(desc.info_json)
        local_grammars = bench_local.compile_locally(info, {k: records[k].schema_text for k in used},
                                                     rewrite=not args.no_rewrite_check,
                                                     served=args.local_grammar == "served")
        for r in runs:
            t = time.perf_counter()
            local_rows[r.batch] = bench_local.replay(r, local_grammars, walk_keys, desc.vocab_size)
            progress(f"local replay batch={r.batch}: {len(r.row_step)} rows ({time.perf_counter() - t:.0f} s)")
    result["compile"] = report.compile_aggregates(records, local_grammars)
    result["compile_records"] = [r.summary() for r in records]
    result["walks"] = [report.walk_aggregates(r, local_rows.get(r.batch)) for r in runs]
    result["targets"] = _targets(result)
    m = machine()
    result["title"] = (f"structd bench grammar: {len(schemas)} schemas, {m['cpu_model']} x"
                       f"{m['logical_cpus']}, xgrammar {m['versions']['xgrammar']}")
    return result


def markdown(result: dict) -> str:
    if result["arguments"]["backend_coverage"]:
        return coverage_summary_text(result)
    return burst_summary_text(result) if result["arguments"]["compile_burst"] else _summary_text(result)


def plot(result: dict, png: Path) -> None:
    if result["arguments"]["backend_coverage"]:
        plot_coverage(result, png)
    else:
        (plot_burst if result["arguments"]["compile_burst"] else report.plot)(result, png)


async def _remote(args, target: str, desc, schemas, result: dict):
    from structd.bench.grammar import walks as bw
    from shared.grammar_client import GrammarClient

    client = GrammarClient(target)
    try:
        t = time.perf_counter()
        reg = await client.register_tokenizer(desc)
        result["register_tokenizer_seconds"] = time.perf_counter() - t
        result["vocab_size"] = reg.vocab_size
        workers = args.compile_workers or server_default_compile_workers()
        concurrency = args.compile_concurrency or workers
        result["compile_concurrency"] = concurrency
        progress(f"tokenizer registered ({reg.vocab_size} tokens); warming up {workers} compile worker(s)")
        t = time.perf_counter()
        await bw.warm_up_compile_workers(client, desc.fingerprint, workers)
        result["compile_worker_warmup_seconds"] = time.perf_counter() - t
        records = [bw.CompileRecord(name=s.get("name", str(i)), dataset=s.get("dataset", ""),
                                    schema_text=json.dumps(s["schema"])) for i, s in enumerate(schemas)]
        progress(f"compile phase: {len(records)} schemas, timeout {args.compile_timeout:g} s, {concurrency} in flight")
        await bw.compile_phase(client, desc.fingerprint, records, args.compile_timeout, concurrency)
        ok = [i for i, r in enumerate(records) if r.status == "ok"]
        seen: dict[str, int] = {}
        walk_keys = [seen.setdefault(records[i].grammar_id, i) for i in ok]
        walk_keys = sorted(set(walk_keys))
        grammar_ids = [records[i].grammar_id for i in walk_keys]
        progress("transport floor: empty step messages")
        floor = await bw.floor_phase(client, reg.vocab_size, max(100, args.steps))
        result["empty_step"] = {"rtt_seconds": summarize(floor["rtt"]), "server_seconds": summarize(floor["server"])}
        runs = []
        if grammar_ids:
            for b in args.batch_sizes:
                progress(f"walks: batch {b}, {args.warmup_steps} + {args.steps} steps over {len(grammar_ids)} grammars")
                runs.append(await bw.walk_phase(client, grammar_ids, reg.vocab_size, b, args.steps, args.warmup_steps,
                                                args.max_session_tokens, seed=args.seed * 1000 + b,
                                                mask_cache_slots=_slots(args)))
                w = runs[-1]
                progress(f"walks: batch {b} done: RTT p50 {_p(w.rtt, 50) * 1e3:.3f} ms, "
                         f"p99 {_p(w.rtt, 99) * 1e3:.3f} ms, {len(w.sessions)} sessions")
        if args.bounded_lengths:
            import xgrammar as xgr

            from structd.bench.grammar.bounded import run_bounded

            progress(f"bounded-string micro-benchmark: maxLength {args.bounded_lengths}")
            info = xgr.TokenizerInfo.deserialize_json(desc.info_json)
            result["bounded"] = await run_bounded(client, desc.fingerprint, info, args.bounded_lengths,
                                                  args.bounded_walks, args.seed, local=not args.no_local,
                                                  mask_cache_slots=_slots(args))
        return records, runs, walk_keys
    finally:
        await client.close()


def _slots(args) -> int | None:
    return None if args.mask_cache_slots < 0 else args.mask_cache_slots


def _p(xs, q) -> float:
    import numpy as np

    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def _targets(result: dict) -> dict:
    t: dict = {}
    w32 = next((w for w in result["walks"] if w["batch"] == 32), None)
    if w32:
        v = w32["step_rtt_seconds"]["p50"]
        t["step_rtt_p50_at_32_le_1ms"] = {"value_seconds": v, "met": v <= 1e-3}
    medians = {w["batch"]: w["mask_bytes_median_vs_dense"] for w in result["walks"] if w["mask_bytes_median_vs_dense"]}
    if medians:
        t["median_wire_bytes_le_10pct_dense"] = {"by_batch": medians, "met": all(v <= 0.10 for v in medians.values())}
    c = result["compile"].get("cached_seconds_ok", {})
    if c.get("n"):
        t["cached_compile_le_1ms"] = {"p50_seconds": c["p50"], "p99_seconds": c["p99"], "met_p50": c["p50"] <= 1e-3,
                                      "met_p99": c["p99"] <= 1e-3}
    return t


def _summary_text(r: dict) -> str:
    ms = 1e3
    lines = []
    c = r["compile"]
    lines.append(f"compile: {c['schemas']} schemas {c['statuses']}; cold ok p50 {c['cold_seconds_ok'].get('p50', 0) * ms:.1f} ms "
                 f"p99 {c['cold_seconds_ok'].get('p99', 0) * ms:.0f} ms; cached p50 "
                 f"{c['cached_seconds_ok'].get('p50', 0) * ms:.3f} ms p99 {c['cached_seconds_ok'].get('p99', 0) * ms:.3f} ms")
    lines.append("batch  rtt_p50  rtt_p99  srv_p50  srv_p99 fill_p50 fill_p99  row_p50  row_p99 slowest_p99  bytes_med  "
                 "%dense  encodings")
    for w in r["walks"]:
        loc = w.get("local", {}).get("fill_seconds", {})
        # The slowest row of each step (what a step with a thread per row would wait on), p99 over steps.
        slowest = w.get("local", {}).get("step_row_max_seconds", {})
        lines.append(
            f"{w['batch']:5d} {w['step_rtt_seconds']['p50'] * ms:8.3f} {w['step_rtt_seconds']['p99'] * ms:8.3f} "
            f"{w['server_step_seconds']['p50'] * ms:8.3f} {w['server_step_seconds']['p99'] * ms:8.3f} "
            f"{w['server_fill_seconds']['p50'] * ms:8.3f} {w['server_fill_seconds']['p99'] * ms:8.3f} "
            f"{loc.get('p50', float('nan')) * ms:8.4f} {loc.get('p99', float('nan')) * ms:8.3f} "
            f"{slowest.get('p99', float('nan')) * ms:11.3f} {w['mask_bytes']['p50']:10.0f} {w['mask_bytes_median_vs_dense'] * 100:6.2f}  "
            + " ".join(f"{k.split('_')[0]}={v * 100:.1f}%" for k, v in w["encoding_share"].items()))
    for k, v in r["targets"].items():
        lines.append(f"target {k}: {v}")
    return "\n".join(lines)
