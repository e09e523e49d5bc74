"""The end-to-end half of `structd bench validity`: finished outputs through the whole stack.

Real grammar and inference services (child processes on loopback; the
embedded model on the real tokenizer) take one `Generate` per schema, the
schema as a `json_schema` constraint, temperature 1, at most
--e2e-max-tokens tokens. Every output that finished its document (finish
reason `stop`) is validated with `jsonschema` under the schema's own draft
and sorted by what the client was told:

- valid: the document validates (the server's schema_check should say
  "valid" too; a disagreement is counted);
- reported: it does not validate and the last response says "invalid" with
  schema_violations;
- unchecked: it does not validate and the server said "unchecked" (why is
  in schema_check_detail, e.g. the check's deadline passed);
- silent: it does not validate and the client was told nothing. The issue's
  target is none.

Outputs cut by max_tokens are counted but not judged (no document), and a
schema the service refuses (INVALID_ARGUMENT etc.) is counted by status.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path

from structd.bench.harness import grammar_and_inference, progress, pyplot, save_figure
from structd.bench.harness.closed_loop import closed_loop
from structd.bench.schema_samples import validation_cause
from structd.bench.stats import summarize

PROMPT = "Write one JSON document that follows this JSON Schema, and nothing else.\n"


def add_arguments(p) -> None:
    p.add_argument("--e2e-requests", type=int, default=0,
                   help="also run this many schemas through real grammar + inference services (0: skip)")
    p.add_argument("--e2e-max-tokens", type=int, default=256, help="max_tokens of each end-to-end request")
    p.add_argument("--e2e-concurrency", type=int, default=8, help="end-to-end requests in flight")
    p.add_argument("--e2e-timeout-seconds", type=float, default=300.0, help="deadline of each end-to-end request")


async def _one(client, row: dict, args, seed: int) -> dict:
    from jsonschema.exceptions import SchemaError

    from shared.inference_client import InferenceError

    rec = {"source": row["source"], "category": row["category"], "name": row["name"]}
    text, final = [], None
    start = time.perf_counter()
    try:
        stream = client.generate(PROMPT, json_schema=json.dumps(row["schema"]), temperature=1.0, seed=seed,
                                 max_tokens=args.e2e_max_tokens, timeout=args.e2e_timeout_seconds)
        try:
            async for chunk in stream:
                if not text:
                    # The request's first piece: the constraint compiled, its first mask and the prefill.
                    rec["first_token_seconds"] = time.perf_counter() - start
                text.append(chunk.text)
                if chunk.finish_reason is not None:
                    final = chunk
        finally:
            await stream.aclose()
    except InferenceError as e:  # the service's answer for this schema (refused, too slow): counted by status
        rec.update(outcome="error", status=e.code.name, error=e.message[:200])
        return rec
    rec.update(finish_reason=final.finish_reason, schema_check=final.schema_check,
               violations=[v.keyword for v in final.schema_violations])
    if final.finish_reason != "stop":
        rec["outcome"] = "unfinished"
        return rec
    document = "".join(text)
    try:
        cause = validation_cause(document, row["schema"])
    # jsonschema's failure on the schema itself (remote $ref), or on a number it cannot divide (multipleOf of an
    # integer past float range: OverflowError ended a 3072-token run).
    except (SchemaError, ValueError, LookupError, ArithmeticError) as e:
        rec.update(outcome="not-judged", error=f"{type(e).__name__}: {str(e)[:160]}")
        return rec
    rec["cause"] = cause
    if cause is None:
        rec["outcome"] = "valid"
        rec["server_agrees"] = final.schema_check == "valid"
    elif final.schema_check == "invalid" and final.schema_violations:
        rec["outcome"] = "reported"
    elif final.schema_check == "unchecked":
        rec.update(outcome="unchecked", detail=final.schema_check_detail[:200])
    else:
        rec.update(outcome="silent", document=document[:300])
    return rec


async def _run(target: str, rows: list[dict], args) -> list[dict]:
    from shared.inference_client import AsyncInferenceClient

    records: list[dict | None] = [None] * len(rows)
    t0 = time.monotonic()

    def finished() -> None:
        done = sum(r is not None for r in records)
        if done % 10 == 0 or done == len(rows):
            progress(f"end to end: {done}/{len(rows)} requests ({time.monotonic() - t0:.0f} s): "
                     f"{dict(Counter(r['outcome'] for r in records if r))}")

    async with AsyncInferenceClient(target) as client:
        await closed_loop(records, args.e2e_concurrency, lambda i: _one(client, rows[i], args, args.seed + i),
                          finished)
    return [r for r in records if r is not None]


def pick(rows: list[dict], n: int, seed: int) -> list[dict]:
    """n schemas drawn at random (seeded) from both samples."""
    if n >= len(rows):
        return list(rows)
    return random.Random(seed).sample(rows, n)


def run_e2e(args, rows: list[dict], out: Path) -> dict:
    """Starts the services, runs the requests, stops the services; the records and their summary."""
    chosen = pick(rows, args.e2e_requests, args.seed)
    progress(f"end to end: starting a grammar and an inference service for {len(chosen)} schemas")
    flags = ("--num-threads", "1", "--max-num-seqs", str(max(8, args.e2e_concurrency)))
    with grammar_and_inference(out, "validity", inference_flags=flags) as (_, inference):
        records = asyncio.run(_run(inference.target, chosen, args))
    return {"records": records, "summary": summarise(records)}


def summarise(records: list[dict]) -> dict:
    outcomes = Counter(r["outcome"] for r in records)
    finished = sum(outcomes[k] for k in ("valid", "reported", "unchecked", "silent"))
    return {
        "requests": len(records),
        "outcomes": dict(outcomes),
        "errors_by_status": dict(Counter(r["status"] for r in records if r["outcome"] == "error")),
        "finished": finished,
        "valid_share": round(outcomes["valid"] / finished, 5) if finished else None,
        "valid_or_reported_share": (round((outcomes["valid"] + outcomes["reported"]) / finished, 5)
                                    if finished else None),
        "server_disagrees_on_valid": sum(1 for r in records if r["outcome"] == "valid" and not r["server_agrees"]),
        "causes": dict(Counter(r["cause"] for r in records if r.get("cause"))),
        "first_token_seconds": summarize([r["first_token_seconds"] for r in records if "first_token_seconds" in r]),
    }


def markdown(summary: dict) -> str:
    o = summary["outcomes"]
    share = summary["valid_share"]
    told = summary["valid_or_reported_share"]
    return "\n".join([
        "| end to end | count |", "|---|---|",
        f"| requests | {summary['requests']} |",
        f"| finished documents | {summary['finished']} |",
        f"| valid | {o.get('valid', 0)}" + (f" ({100 * share:.1f}%)" if share is not None else "") + " |",
        f"| invalid, reported to the client (schema_violations) | {o.get('reported', 0)} |",
        f"| invalid, check not run (unchecked) | {o.get('unchecked', 0)} |",
        f"| invalid, silent | {o.get('silent', 0)} |",
        "| valid or reported | " + (f"{100 * told:.1f}%" if told is not None else "-") + " |",
        f"| cut by max_tokens | {o.get('unfinished', 0)} |",
        f"| refused / failed (by status) | {summary['errors_by_status'] or 0} |",
        *_first_token_row(summary.get("first_token_seconds", {})),
    ])


def _first_token_row(s: dict) -> list[str]:
    return [f"| first token p50 / p99 / max (s) | {s['p50']:.2f} / {s['p99']:.2f} / {s['max']:.2f} |"] if s.get("n") else []


def plot(summary: dict, path: Path) -> None:
    o = summary["outcomes"]
    labels = ["valid", "reported", "unchecked", "silent", "unfinished", "error"]
    values = [o.get(k, 0) for k in labels]
    fig, ax = pyplot().subplots(figsize=(7, 3))
    ax.bar(labels, values, color=["tab:green", "tab:orange", "tab:gray", "tab:red", "tab:blue", "black"])
    ax.set_ylabel("requests")
    ax.set_title(f"end to end: {summary['finished']} finished documents of {summary['requests']} requests")
    save_figure(fig, path)
