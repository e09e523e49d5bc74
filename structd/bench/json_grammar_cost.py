"""`structd bench json-grammar`: what structd's JSON grammar costs against the path before it.

"Before" is xgrammar 0.2.8's grammar for the schema as given, with bounded
strings in tail form (the service's path before grammar_svc/schema/json_grammar.py);
"after" is structd's (normalised schema, JSON strings, pattern/format strings,
compact untyped values, tail form). On a shared, noisy machine two runs
minutes apart cannot separate a few percent, so both are measured in one
process, interleaved: each schema is compiled both ways (the order alternating
from schema to schema, xgrammar's cache off), then one seeded random walk
through the *after* grammar fills both matchers at every position (the order
alternating from step to step), the *before* matcher following the same tokens
for as long as its grammar takes them (where the languages differ it stops).

Reports compile time (sum and per-schema median ratio) and per-row fill time
(mean, p50, p99), split by whether normalisation changed the schema. Writes
<out>/json-grammar-cost.json and .png.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from structd.bench.harness import UsageError, progress, pyplot, save_figure
from structd.bench.harness.children import each_in_a_child
from structd.bench.schema_samples import closing_bias, default_data, default_vocab, load_rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jsonschemabench", type=Path, default=default_data("jsonschemabench-sample.jsonl"))
    p.add_argument("--limit", type=int, default=60, help="schemas, spread evenly over the sample (0: all)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per walk")
    p.add_argument("--schema-timeout-seconds", type=float, default=60.0,
                   help="both compiles and the walk of one schema; past it the schema is not counted")
    p.add_argument("--seed", type=int, default=2024)


def _before(compiler, text: str, opts):
    import xgrammar as xgr

    from grammar_svc.schema.bounded_strings import rewrite_bounded_strings

    ebnf = str(xgr.Grammar.from_json_schema(text, **opts.xgrammar_kwargs()))
    return compiler.compile_grammar(rewrite_bounded_strings(ebnf)[0])


def measure(schema: dict, info, vocab: list[bytes], closing, max_tokens: int, seed: int, after_first: bool) -> dict:
    """Compile times and paired per-row fill times of one schema (runs in a child)."""
    import numpy as np
    import xgrammar as xgr

    from grammar_svc.schema.json_grammar import compile_json_schema, normalised_schema_text
    from grammar_svc.compile.spec import JsonOptions
    from shared.codec import allowed_ids

    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    text = json.dumps(schema)
    opts = JsonOptions()
    compiled, compile_s = {}, {}
    for which in (("after", "before") if after_first else ("before", "after")):
        t = time.perf_counter()
        compiled[which] = (compile_json_schema(compiler, text, opts) if which == "after"
                           else _before(compiler, text, opts))
        compile_s[which] = time.perf_counter() - t
    matchers = {k: xgr.GrammarMatcher(g) for k, g in compiled.items()}
    masks = {k: xgr.allocate_token_bitmask(1, len(vocab)) for k in compiled}
    fills: dict[str, list[float]] = {"before": [], "after": []}
    rng = random.Random(seed)
    following = True
    stop_ids = set(info.stop_token_ids)
    for step in range(max_tokens):
        order = ("after", "before") if step % 2 else ("before", "after")
        for which in order:
            if which == "before" and not following:
                continue
            t = time.perf_counter_ns()
            matchers[which].fill_next_token_bitmask(masks[which])
            elapsed = (time.perf_counter_ns() - t) / 1e3
            if which == "after" or following:
                fills[which].append(elapsed)
        if not following:
            fills["after"].pop()  # only rows both grammars filled are compared
        ids = allowed_ids(masks["after"][0].numpy(), len(vocab))
        if len(ids) == 0:
            break
        if rng.random() < closing_bias(step, max_tokens):
            ends = ids[closing[ids]]  # `closing` is a boolean array over the vocabulary
            if len(ends):
                ids = ends
        token = int(ids[rng.randrange(len(ids))])
        if token in stop_ids:
            break
        matchers["after"].accept_token(token)
        if following and not matchers["before"].accept_token(token):
            following = False
        if matchers["after"].is_terminated():
            break
    n = min(len(fills["before"]), len(fills["after"]))
    return {"compile_seconds": compile_s, "fill_us": {k: v[:n] for k, v in fills.items()},
            "normalised": normalised_schema_text(text) != text}


def run_all(args, rows: list[dict]) -> list[dict]:
    info, vocab, closing = default_vocab()
    out = [{"category": row["category"], "name": row["name"]} for row in rows]
    t0 = time.monotonic()
    done = 0

    def finished(i: int, outcome: dict) -> None:
        nonlocal done
        out[i].update({"error": "timeout"} if "timeout" in outcome else outcome)
        done += 1
        if done % 10 == 0 or done == len(rows):
            progress(f"{done}/{len(rows)} schemas ({time.monotonic() - t0:.0f} s)")

    each_in_a_child(measure, [(row["schema"], info, vocab, closing, args.max_tokens, args.seed + i, i % 2 == 1)
                              for i, row in enumerate(rows)], timeout=args.schema_timeout_seconds, on_done=finished)
    return out


def _stats(values: list[float]) -> dict:
    import numpy as np

    if not values:
        return {"n": 0}
    a = np.asarray(values)
    return {"n": len(a), "mean": round(float(a.mean()), 2), "p50": round(float(np.percentile(a, 50)), 2),
            "p99": round(float(np.percentile(a, 99)), 2)}


def summarise(records: list[dict]) -> dict:
    import numpy as np

    ok = [r for r in records if "error" not in r]
    out: dict = {"schemas": len(records), "counted": len(ok),
                 "errors": sorted({r["error"][:80] for r in records if "error" in r})}
    cb = sum(r["compile_seconds"]["before"] for r in ok)
    ca = sum(r["compile_seconds"]["after"] for r in ok)
    ratios = [r["compile_seconds"]["after"] / r["compile_seconds"]["before"] for r in ok
              if r["compile_seconds"]["before"] > 0]
    out["compile"] = {"before_seconds": round(cb, 3), "after_seconds": round(ca, 3),
                      "ratio_of_sums": round(ca / cb, 3) if cb else None,
                      "median_ratio": round(float(np.median(ratios)), 3) if ratios else None}
    for label, group in (("all", ok), ("unchanged", [r for r in ok if not r["normalised"]]),
                         ("normalised", [r for r in ok if r["normalised"]])):
        before = [x for r in group for x in r["fill_us"]["before"]]
        after = [x for r in group for x in r["fill_us"]["after"]]
        b, a = _stats(before), _stats(after)
        ratio = {k: round(a[k] / b[k], 3) for k in ("mean", "p50", "p99") if b.get(k)}
        out[f"fill_{label}"] = {"schemas": len(group), "before_us": b, "after_us": a, "after_over_before": ratio}
    return out


def markdown(result: dict) -> str:
    s = result["summary"]
    c = s["compile"]
    lines = [f"{s['counted']} of {s['schemas']} schemas counted", "",
             "| | before (xgrammar + tail form) | after (structd) | after / before |", "|---|---|---|---|",
             f"| compile, sum | {c['before_seconds']} s | {c['after_seconds']} s | {c['ratio_of_sums']} "
             f"(median per schema {c['median_ratio']}) |"]
    for label in ("all", "unchanged", "normalised"):
        f = s[f"fill_{label}"]
        b, a, r = f["before_us"], f["after_us"], f["after_over_before"]
        if not b.get("n"):
            continue
        lines.append(f"| fill, {label} schemas ({f['schemas']}, {b['n']} rows): mean / p50 / p99 us | "
                     f"{b['mean']} / {b['p50']} / {b['p99']} | {a['mean']} / {a['p50']} / {a['p99']} | "
                     f"{r.get('mean')} / {r.get('p50')} / {r.get('p99')} |")
    return "\n".join(lines)


def plot(result: dict, png: Path) -> None:
    s = result["summary"]
    labels, values = ["compile (sum)"], [s["compile"]["ratio_of_sums"] or 0]
    for label in ("all", "unchanged", "normalised"):
        for k in ("mean", "p50", "p99"):
            labels.append(f"fill {label} {k}")
            values.append(s[f"fill_{label}"]["after_over_before"].get(k) or 0)
    fig, ax = pyplot().subplots(figsize=(9, 3.5))
    ax.bar(labels, values)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(1.05, color="red", lw=0.8, ls="--", label="+5%")
    ax.set_ylabel("after / before")
    ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    ax.legend()
    save_figure(fig, png)


def result_name(args) -> str:
    return "json-grammar-cost"


def run(args) -> dict:
    if args.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    rows = load_rows(args.jsonschemabench, "", args.limit)
    progress(f"{len(rows)} schemas: both compiles and one paired walk each")
    records = run_all(args, rows)
    return {"summary": summarise(records), "schemas": records}
