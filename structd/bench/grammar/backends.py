"""`structd bench grammar --backend-coverage`: what each grammar backend choice serves, and at what cost.

Issue 26's figures. For each backend choice (--backends: xgrammar,
llguidance, auto, sent as CompileRequest.backend to a server on
--grammar-backend auto with the benchmark's --fallback-after-seconds) and
each number of requests in flight (--coverage-concurrency: 1,16), a fresh
grammar server gets every schema of the sample once, seeded-shuffled (the
categories are contiguous in the file). A request is what the inference
service does for a schema it has not seen: Compile, then open a session and
read its first mask. Per pass:

- served within 1, 5 and 10 s: the share of schemas whose first mask came
  back within that long (the Compile deadline is --compile-timeout);
- first-mask latency p50/p99 over the served ones, and the statuses of the
  rest (invalid: INVALID_ARGUMENT, timeout: DEADLINE_EXCEEDED);
- which backend served each schema and why (CompileResponse.backend_reason);
- memory per compiled grammar (CompileResponse.memory_bytes) by backend.

Then, on the one-at-a-time pass of each backend named alone (xgrammar,
llguidance), random walks over the grammars it served: one session per step
(the step's fill time is that row's fill) and --coverage-batch sessions per
step (the step's fill time is bounded below by its slowest row; the fill
threads share the rows).

Writes <out>/backend-coverage.json and <out>/backend-coverage.png.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import grpc

from structd.bench.grammar.server import start_server
from structd.bench.grammar.walks import json_schema_spec, server_default_compile_workers, walk_phase
from structd.bench.harness import machine, progress, pyplot, save_figure
from structd.bench.schema_samples import read_jsonl
from structd.bench.stats import summarize

WITHIN_SECONDS = (1.0, 5.0, 10.0)
CHOICES = ("xgrammar", "llguidance", "auto")


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    for n in names:
        if n not in CHOICES:
            raise ValueError(f"unknown backend {n!r} (one of {', '.join(CHOICES)})")
    return names


def add_arguments(parser) -> None:
    parser.add_argument("--backend-coverage", action="store_true",
                        help="run only the backend coverage benchmark (each backend choice, one at a time and "
                             "many in flight) and write backend-coverage.json/png")
    parser.add_argument("--backends", type=_names, default=list(CHOICES),
                        help="backend choices to measure, e.g. xgrammar,llguidance,auto")
    parser.add_argument("--coverage-concurrency", type=lambda t: [int(x) for x in t.split(",") if x.strip()],
                        default=[1, 16], help="requests in flight per pass, e.g. 1,16")
    parser.add_argument("--fallback-after-seconds", type=float, default=1.5,
                        help="the server's --fallback-after-seconds in the coverage passes")
    parser.add_argument("--coverage-walk-steps", type=int, default=300,
                        help="measured walk steps per backend and batch size (0: no walks)")
    parser.add_argument("--coverage-batch", type=int, default=16, help="sessions per step of the batched walks")


async def _first_mask(client, stream_vocab: int, fp: str, text: str, backend: int, timeout: float) -> dict:
    """Compile, open a session, read its first mask: the request's wait before its first constrained token."""
    from shared.gen.grammar.v1 import grammar_service_pb2 as pb

    start = time.perf_counter()
    try:
        resp = await client.stub.Compile(pb.CompileRequest(tokenizer_fingerprint=fp, spec=json_schema_spec(text),
                                                           timeout_seconds=timeout, backend=backend),
                                         timeout=timeout + 60)
    except grpc.aio.AioRpcError as e:  # the outcome measured
        code = e.code()
        status = {grpc.StatusCode.INVALID_ARGUMENT: "invalid",
                  grpc.StatusCode.DEADLINE_EXCEEDED: "timeout"}.get(code, code.name.lower())
        return {"status": status, "seconds": time.perf_counter() - start, "error": (e.details() or "")[:200]}
    compiled = time.perf_counter() - start
    stream = client.open_stream(stream_vocab)
    try:
        out = await stream.step([pb.SessionStep(session_id=1, open=pb.OpenSession(grammar_id=resp.grammar_id))])
        await stream.write([pb.SessionStep(session_id=1, close=True)])
        await stream.read()
        await stream.close()
    finally:
        stream.cancel()
    ok = out.results[0].status == pb.SESSION_STATUS_OK
    return {"status": "ok" if ok else "open_failed", "seconds": time.perf_counter() - start,
            "compile_seconds": compiled, "grammar_id": resp.grammar_id,
            "backend": pb.GrammarBackend.Name(resp.backend).removeprefix("GRAMMAR_BACKEND_").lower(),
            "reason": resp.backend_reason, "memory_bytes": resp.memory_bytes, "warnings": len(resp.warnings)}


async def _pass(target: str, desc, texts: list[str], backend: str, concurrency: int, args) -> dict:
    from shared.gen.grammar.v1 import grammar_service_pb2 as pb
    from shared.grammar_client import GrammarClient
    from structd.bench.grammar.walks import warm_up_compile_workers

    code = pb.GrammarBackend.Value(f"GRAMMAR_BACKEND_{backend.upper()}")
    client = GrammarClient(target)
    try:
        await client.register_tokenizer(desc)
        await warm_up_compile_workers(client, desc.fingerprint, args.compile_workers or server_default_compile_workers())
        sem = asyncio.Semaphore(max(1, concurrency))
        t0 = time.perf_counter()
        done = 0

        async def one(text: str) -> dict:
            nonlocal done
            async with sem:
                r = await _first_mask(client, desc.vocab_size, desc.fingerprint, text, code, args.compile_timeout)
            done += 1
            if done % 25 == 0 or done == len(texts):
                progress(f"  {backend} x{concurrency}: {done}/{len(texts)} ({time.perf_counter() - t0:.0f} s)")
            return r

        records = await asyncio.gather(*[one(t) for t in texts])
        out = {"backend": backend, "concurrency": concurrency, "wall_seconds": time.perf_counter() - t0,
               "records": records}
        if concurrency == 1 and backend != "auto" and args.coverage_walk_steps > 0:
            ids = [r["grammar_id"] for r in records if r["status"] == "ok"][:64]
            out["walks"] = await _walks(client, ids, desc.vocab_size, args)
        for r in records:
            r.pop("grammar_id", None)
        return out
    finally:
        await client.close()


async def _walks(client, grammar_ids: list[str], vocab_size: int, args) -> dict:
    out = {}
    for batch in (1, args.coverage_batch):
        if not grammar_ids:
            break
        run = await walk_phase(client, grammar_ids, vocab_size, batch, args.coverage_walk_steps, 10,
                               args.max_session_tokens, args.seed, mask_cache_slots=0)
        out[str(batch)] = {"sessions": len(run.sessions), "statuses": run.statuses,
                           "step_fill_seconds": summarize(run.fill), "step_server_seconds": summarize(run.server)}
    return out


def pass_aggregates(p: dict) -> dict:
    records = p["records"]
    n = len(records)
    served = [r for r in records if r["status"] == "ok"]
    statuses: dict[str, int] = {}
    choices: dict[str, int] = {}
    memory: dict[str, list[int]] = {}
    for r in records:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
        if r["status"] == "ok":
            key = f"{r['backend']}/{r['reason']}"
            choices[key] = choices.get(key, 0) + 1
            memory.setdefault(r["backend"], []).append(r["memory_bytes"])
    return {
        "backend": p["backend"], "concurrency": p["concurrency"], "schemas": n, "wall_seconds": p["wall_seconds"],
        "served_within": {f"{t:g}": (sum(r["seconds"] <= t for r in served) / n if n else 0.0)
                          for t in WITHIN_SECONDS},
        "served": len(served) / n if n else 0.0,
        "first_mask_seconds": summarize([r["seconds"] for r in served]),
        "statuses": statuses, "choices": choices,
        "memory_bytes": {b: summarize(v) for b, v in memory.items()},
        "walks": p.get("walks", {}),
        "refusals": sorted({r["error"] for r in records if r["status"] != "ok"})[:40],
        # Each schema's outcome, in the order sent (the file's, seeded-shuffled).
        "records": [{k: r.get(k) for k in ("schema", "status", "seconds", "backend", "reason")} for r in records],
    }


def run_backend_coverage(args) -> dict:
    schemas = read_jsonl(args.schemas, args.limit)
    order = list(range(len(schemas)))
    random.Random(args.seed).shuffle(order)
    from shared.tokenizer import default_description

    desc = default_description()
    tag = f"{int(time.time())}"
    passes = []
    for backend in args.backends:
        for concurrency in args.coverage_concurrency:
            # A per-pass title: no pass is answered from another's cache (or its remembered timeouts).
            title = f"structd-backends-{backend}-{concurrency}-{tag}"
            texts = [json.dumps({**s["schema"], "title": title} if isinstance(s["schema"], dict) else s["schema"])
                     for s in (schemas[i] for i in order)]
            server = None
            if not args.server:
                server = start_server(args, args.out / f"server-{backend}-{concurrency}.log",
                                      ("--grammar-backend", "auto",
                                       "--fallback-after-seconds", str(args.fallback_after_seconds)))
            target = server.target if server else args.server
            progress(f"{backend} x{concurrency}: {len(texts)} schemas on {target}")
            try:
                p = asyncio.run(_pass(target, desc, texts, backend, concurrency, args))
            finally:
                if server is not None:
                    server.stop()
            for rec, i in zip(p["records"], order):
                rec["schema"] = f"{schemas[i].get('dataset', '')}/{schemas[i].get('name', i)}"
            agg = pass_aggregates(p)
            progress(f"{backend} x{concurrency}: served {agg['served']:.1%}, {agg['statuses']}")
            passes.append(agg)
    m = machine()
    return {"passes": passes, "compile_timeout_seconds": args.compile_timeout,
            "fallback_after_seconds": args.fallback_after_seconds,
            "title": (f"structd bench grammar --backend-coverage: {len(schemas)} schemas, deadline "
                      f"{args.compile_timeout:g} s, fallback after {args.fallback_after_seconds:g} s, "
                      f"{m['cpu_model']} x{m['logical_cpus']}")}


def _ms(s: dict, key: str) -> str:
    return f"{s[key] * 1e3:.3g}" if s.get("n") else "-"


def coverage_summary_text(r: dict) -> str:
    lines = [f"## {r['title']}", "",
             "| backend | in flight | within 1 s | within 5 s | within 10 s | first mask p50 (ms) | p99 (ms) | "
             "refused (invalid / timeout / other) | served by |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for p in r["passes"]:
        w, st = p["served_within"], p["statuses"]
        other = sum(v for k, v in st.items() if k not in ("ok", "invalid", "timeout"))
        by = ", ".join(f"{k} {v}" for k, v in sorted(p["choices"].items()))
        lines.append(f"| {p['backend']} | {p['concurrency']} | {w['1']:.1%} | {w['5']:.1%} | {w['10']:.1%} | "
                     f"{_ms(p['first_mask_seconds'], 'p50')} | {_ms(p['first_mask_seconds'], 'p99')} | "
                     f"{st.get('invalid', 0)} / {st.get('timeout', 0)} / {other} | {by} |")
    lines += ["", "| sessions on | sessions per step | step fill p50 (ms) | p99 (ms) | max (ms) | memory per grammar "
                  "p50 / max (bytes) |", "|---|---:|---:|---:|---:|---|"]
    for p in r["passes"]:
        for batch, w in p["walks"].items():
            mem = p["memory_bytes"].get(p["backend"], {"n": 0})
            mem_text = f"{mem['p50']:.0f} / {mem['max']:.0f}" if mem.get("n") else "-"
            f = w["step_fill_seconds"]
            lines.append(f"| {p['backend']} | {batch} | {_ms(f, 'p50')} | {_ms(f, 'p99')} | {_ms(f, 'max')} | "
                         f"{mem_text} |")
    return "\n".join(lines) + "\n"


def plot_coverage(result: dict, path: Path) -> None:
    fig, axes = pyplot().subplots(1, 2, figsize=(14, 5))
    passes = result["passes"]
    labels = [f"{p['backend']}\nx{p['concurrency']}" for p in passes]
    ax = axes[0]
    width = 0.8 / len(WITHIN_SECONDS)
    for k, t in enumerate(WITHIN_SECONDS):
        ax.bar([i + k * width for i in range(len(passes))], [p["served_within"][f"{t:g}"] * 100 for p in passes],
               width, label=f"within {t:g} s")
    ax.set_xticks([i + width for i in range(len(passes))], labels, fontsize=8)
    ax.axhline(98, color="grey", ls="--", lw=0.8, label="target 98%")
    ax.set(ylabel="% of schemas served (first mask back)", ylim=(0, 100), title="Served within")
    ax.legend(fontsize=7)
    ax = axes[1]
    for p, label in zip(passes, labels):
        s = p["first_mask_seconds"]
        if s.get("n"):
            ax.scatter([s["p50"], s["p99"]], [label.replace("\n", " ")] * 2, c=["tab:blue", "tab:red"], s=20)
    ax.axvline(2.0, color="grey", ls="--", lw=0.8)
    ax.set(xscale="log", xlabel="first mask latency, served schemas (s): p50 blue, p99 red (target p99 2 s)",
           title="First mask")
    fig.suptitle(result.get("title", "backend coverage"), fontsize=10)
    save_figure(fig, path)
