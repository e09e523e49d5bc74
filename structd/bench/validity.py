"""`structd bench validity`: do the documents a JSON-Schema grammar admits validate against the schema?

For every schema of the JSONSchemaBench and MaskBench samples (../shared/data)
and for each grammar, xgrammar 0.2.8 as-is, structd's
(grammar_svc/schema/json_grammar.py: normalised schema, JSON strings, tail form) and,
as a reference, llguidance's (--reference), seeded random walks through the
compiled grammar's own token masks (a real matcher on the real tokenizer)
write documents; every complete one is
validated with `jsonschema` under the schema's own draft. A failure's cause is
the keyword of jsonschema's best-matching error (`type`, `required`,
`maxLength`, ...), or `not-json` with the parser's complaint.

The walk draws a uniformly random allowed token, except that, with a
probability growing along the walk, it picks a closing token (`"`, `}`, `]`
or the end) where one is allowed, so most walks finish within
--max-tokens. Each schema runs in its own forked process (compile + walks),
killed at --schema-timeout-seconds; --time-budget-seconds stops starting
new schemas.

With --e2e-requests N, N schemas also go through the whole stack (real
services, the embedded model): structd/bench/validity_e2e.py.

Writes <out>/validity-bench.json, <out>/validity-bench.png (and
validity-e2e.png) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter, defaultdict
from pathlib import Path

from structd.bench import validity_e2e
from structd.bench.harness import UsageError, progress, pyplot, save_figure
from structd.bench.harness.children import each_in_a_child
from structd.bench.schema_samples import CLOSING  # noqa: F401 - what tests/test_json_validity.py walks with
from structd.bench.schema_samples import closing_bias, default_data, default_vocab, load_rows, validation_cause

ENGINES = ("xgrammar", "structd")
# The reference the issue names: another library's grammar for the same schema, on the same tokenizer.
REFERENCE = "llguidance"
# structd's second grammar backend (grammar_svc/compile/llguidance_backend.py): llguidance's grammar for the
# normalised schema, walked through the service's own LlguidanceMatcher (issue 26: validity by backend).
LLGUIDANCE_BACKEND = "structd-llguidance"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--jsonschemabench", type=Path, default=default_data("jsonschemabench-sample.jsonl"),
                   help="JSON Lines of {dataset, name, schema}")
    p.add_argument("--maskbench", type=Path, default=default_data("maskbench-sample.jsonl"),
                   help="JSON Lines of {group, name, schema, tests} ('' to skip)")
    p.add_argument("--limit", type=int, default=0, help="schemas per file, spread evenly over it (0: all)")
    p.add_argument("--walks", type=int, default=6, help="random walks per schema and grammar")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per walk; a longer walk is not a document")
    p.add_argument("--schema-timeout-seconds", type=float, default=30.0,
                   help="compile + walks of one schema (both grammars); past it the schema counts as timed out")
    p.add_argument("--time-budget-seconds", type=float, default=0.0, help="stop starting schemas after this (0: none)")
    p.add_argument("--workers", type=int, default=2, help="schemas in parallel (one process each)")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--no-walks", action="store_true", help="skip the random walks (with --e2e-requests)")
    validity_e2e.add_arguments(p)
    p.add_argument("--reference", choices=[REFERENCE, "none"], default=REFERENCE,
                   help="also walk llguidance's grammar for each schema, as a reference (bench extra)")
    p.add_argument("--llguidance-backend", action="store_true",
                   help=f"also walk the grammar service's llguidance backend ({LLGUIDANCE_BACKEND}: the normalised "
                        "schema, the service's matcher)")


# ----------------------------------------------------------------------------- one schema (in a child)


class _XgrammarWalker:
    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def mask(self):
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return self.bitmask[0].numpy()

    def accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class _ServiceWalker(_XgrammarWalker):
    """The grammar service's llguidance matcher, which has xgrammar's matcher interface."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar as xgr

        from grammar_svc.compile.llguidance_backend import LlguidanceMatcher

        self.matcher = LlguidanceMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)


class _LlguidanceWalker:
    def __init__(self, matcher, vocab_size: int):
        import llguidance.numpy as lnp

        self.matcher = matcher
        self.lnp = lnp
        self.bitmask = lnp.allocate_token_bitmask(1, vocab_size)

    def mask(self):
        self.lnp.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        return self.bitmask[0]

    def accept(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    def terminated(self) -> bool:
        return self.matcher.is_stopped()


# llguidance's tokenizer, built once in the parent (1-2 s) and inherited by every forked child.
_LLG: dict = {}


def walk(compiled, vocab: list[bytes], stop_ids: set[int], closing, rng: random.Random,
         max_tokens: int) -> bytes | None:
    """One random walk's document (None: not finished within max_tokens).

    `compiled` is an xgrammar CompiledGrammar, or an llguidance LLMatcher (used up by the walk).
    """
    from shared.codec import allowed_ids

    kind = type(compiled).__name__
    walker = (_LlguidanceWalker(compiled, len(vocab)) if kind == "LLMatcher"
              else _ServiceWalker(compiled, len(vocab)) if kind == "LlguidanceGrammar"
              else _XgrammarWalker(compiled, len(vocab)))
    out = bytearray()
    for step in range(max_tokens + 1):
        ids = allowed_ids(walker.mask(), len(vocab))
        if len(ids) == 0:
            return None
        if rng.random() < closing_bias(step, max_tokens):
            ends = ids[closing[ids]]  # `closing` is a boolean array over the vocabulary
            if len(ends):
                ids = ends
        token = int(ids[rng.randrange(len(ids))])
        if token in stop_ids:
            return bytes(out)
        if not walker.accept(token):
            raise RuntimeError(f"the matcher refused token {token}, which its own mask allowed")
        out += vocab[token]
        if walker.terminated():
            return bytes(out)
    return None


def run_schema(row: dict, info, vocab, closing, args, seed: int) -> dict:
    """Both grammars of one schema: compile outcome, documents, valid ones, causes (runs in a child)."""
    import xgrammar as xgr

    from grammar_svc.schema.json_grammar import compile_json_schema
    from grammar_svc.compile.spec import JsonOptions

    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    text = json.dumps(row["schema"])
    opts = JsonOptions()
    out = {}
    for engine in engines(args):
        res = {"status": "ok", "documents": 0, "valid": 0, "unfinished": 0, "causes": {}, "examples": []}
        out[engine] = res
        try:
            if engine == "xgrammar":
                compiled = compiler.compile_json_schema(text, **opts.xgrammar_kwargs())
            elif engine == REFERENCE:
                compiled = _llguidance_matcher(text)
            elif engine == LLGUIDANCE_BACKEND:
                from grammar_svc.compile.llguidance_backend import compile_llguidance
                from grammar_svc.compile.spec import GrammarSpec
                from grammar_svc.types import Kind

                compiled = compile_llguidance(_LLG["registered"], GrammarSpec(Kind.JSON_SCHEMA, text, opts))
            else:
                compiled = compile_json_schema(compiler, text, opts)
        except Exception as e:  # noqa: BLE001 - the schema's failure (the library refuses it): recorded
            res["status"], res["error"] = "compile-error", str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            continue
        rng = random.Random(seed)
        stop_ids = set(info.stop_token_ids)
        for _ in range(args.walks):
            if engine == REFERENCE:
                compiled.reset()
            doc = walk(compiled, vocab, stop_ids, closing, rng, args.max_tokens)
            if doc is None:
                res["unfinished"] += 1
                continue
            res["documents"] += 1
            try:
                cause = validation_cause(doc.decode("utf-8"), row["schema"])
            except UnicodeDecodeError:
                cause = "not-json: invalid UTF-8"
            except Exception as e:  # noqa: BLE001 - jsonschema's failure on this schema (e.g. a remote $ref)
                res["status"], res["error"] = "validator-error", f"{type(e).__name__}: {str(e)[:160]}"
                break
            if cause is None:
                res["valid"] += 1
            else:
                res["causes"][cause] = res["causes"].get(cause, 0) + 1
                if len(res["examples"]) < 2:
                    res["examples"].append({"cause": cause, "document": doc.decode("utf-8", "replace")[:300]})
    return out


def _llguidance_matcher(schema_text: str):
    """llguidance's matcher for a schema (compact separators, as structd's default); raises where it refuses."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(_LLG["tokenizer"], grammar)
    if matcher.is_error():
        raise ValueError(matcher.get_error())
    return matcher


def engines(args) -> list[str]:
    return (list(ENGINES) + ([REFERENCE] if args.reference == REFERENCE else [])
            + ([LLGUIDANCE_BACKEND] if args.llguidance_backend else []))


# ----------------------------------------------------------------------------- driver


def run_all(args, rows: list[dict]) -> list[dict]:
    # Imported before the children fork: every schema runs the code the run started with.
    import grammar_svc.schema.json_grammar  # noqa: F401

    info, vocab, closing = default_vocab()
    if args.reference == REFERENCE:
        import llguidance.hf

        from shared.tokenizer import load_hf_tokenizer

        _LLG["tokenizer"] = llguidance.hf.from_tokenizer(load_hf_tokenizer(), n_vocab=len(vocab))
    if args.llguidance_backend:
        from grammar_svc.compile.llguidance_backend import llguidance_tokenizer
        from grammar_svc.compile.tokenizer_registry import TokenizerRegistry
        from shared.tokenizer import default_description

        desc = default_description()
        registered, _, _ = TokenizerRegistry(1, set).register(desc.fingerprint, desc.compressed_info(),
                                                              desc.compressed_hf())
        llguidance_tokenizer(registered)  # built here once, inherited by every child
        _LLG["registered"] = registered
    results: list[dict] = [dict(source=r["source"], category=r["category"], name=r["name"], status="skipped")
                           for r in rows]
    t0 = time.monotonic()
    done = 0

    def finished(i: int, outcome: dict) -> None:
        nonlocal done
        r = results[i]
        if "timeout" in outcome:
            r["status"] = "timeout"
        elif "error" in outcome:
            r["status"], r["error"] = "error", outcome["error"]
        else:
            r["status"] = "ok"
            r.update(outcome)
        done += 1
        if done % 25 == 0 or done == len(rows):
            progress(f"{done}/{len(rows)} schemas ({time.monotonic() - t0:.0f} s): {_rates_line(results)}")

    each_in_a_child(run_schema, [(row, info, vocab, closing, args, args.seed + i) for i, row in enumerate(rows)],
                    timeout=args.schema_timeout_seconds, workers=args.workers,
                    budget_seconds=args.time_budget_seconds, on_done=finished)
    return results


def _rates_line(results: list[dict]) -> str:
    parts = []
    for e in [k for k in (*ENGINES, REFERENCE, LLGUIDANCE_BACKEND) if any(k in r for r in results)]:
        docs = sum(r[e]["documents"] for r in results if r.get("status") == "ok" and r[e]["status"] == "ok")
        valid = sum(r[e]["valid"] for r in results if r.get("status") == "ok" and r[e]["status"] == "ok")
        parts.append(f"{e} {valid}/{docs} valid")
    return ", ".join(parts)


def summarise(results: list[dict], names: list[str]) -> dict:
    """Valid share per engine, overall / by source / by category, and failures by cause."""
    out: dict = {"schemas": Counter(r["status"] for r in results), "engines": names}
    for e in names:
        agg: dict = {"by_source": defaultdict(lambda: [0, 0]), "by_category": defaultdict(lambda: [0, 0]),
                     "causes": Counter(), "cause_schemas": defaultdict(list), "compile_errors": 0,
                     "validator_errors": 0, "unfinished": 0}
        for r in results:
            if r["status"] != "ok":
                continue
            res = r[e]
            if res["status"] == "compile-error":
                agg["compile_errors"] += 1
                continue
            if res["status"] == "validator-error":
                agg["validator_errors"] += 1
                continue
            agg["unfinished"] += res["unfinished"]
            for key in (("by_source", r["source"]), ("by_category", f"{r['source']}/{r['category']}")):
                agg[key[0]][key[1]][0] += res["valid"]
                agg[key[0]][key[1]][1] += res["documents"]
            for cause, n in res["causes"].items():
                agg["causes"][cause] += n
                agg["cause_schemas"][cause].append(f"{r['category']}/{r['name']}")
        out[e] = {
            "by_source": {k: _share(*v) for k, v in sorted(agg["by_source"].items())},
            "by_category": {k: _share(*v) for k, v in sorted(agg["by_category"].items())},
            "causes": dict(agg["causes"].most_common()),
            "cause_schemas": {k: sorted(set(v))[:20] for k, v in agg["cause_schemas"].items()},
            "compile_errors": agg["compile_errors"], "validator_errors": agg["validator_errors"],
            "unfinished_walks": agg["unfinished"],
        }
    return out


def _share(valid: int, docs: int) -> dict:
    return {"valid": valid, "documents": docs, "share": round(valid / docs, 5) if docs else None}


def _walks_markdown(summary: dict) -> str:
    names = summary["engines"]
    empty = {"valid": 0, "documents": 0, "share": None}
    first = summary[names[0]]
    lines = ["| source / category | " + " | ".join(f"{e} valid" for e in names) + " |",
             "|---|" + "---|" * len(names)]
    for key in list(first["by_source"]) + list(first["by_category"]):
        cells = [_fmt(summary[e]["by_source"].get(key) or summary[e]["by_category"].get(key) or empty) for e in names]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines.append("| schemas refused at compile | " + " | ".join(str(summary[e]["compile_errors"]) for e in names) + " |")
    lines += ["", "| cause | " + " | ".join(f"{e} documents" for e in names) + " |", "|---|" + "---|" * len(names)]
    causes = sorted({c for e in names for c in summary[e]["causes"]}, key=lambda c: -first["causes"].get(c, 0))
    for cause in causes:
        lines.append(f"| {cause} | " + " | ".join(str(summary[e]["causes"].get(cause, 0)) for e in names) + " |")
    return "\n".join(lines)


def _fmt(a: dict) -> str:
    return f"{a['valid']}/{a['documents']} ({100 * a['share']:.2f}%)" if a["share"] is not None else "-"


def plot(result: dict, png: Path) -> None:
    if "summary" in result:
        _plot_walks(result["summary"], png)
    if "end_to_end" in result:
        validity_e2e.plot(result["end_to_end"]["summary"], png.with_name("validity-e2e.png"))


def _plot_walks(summary: dict, png: Path) -> None:
    import numpy as np

    names = summary["engines"]
    cats = list(summary[names[0]]["by_category"])
    fig, ax = pyplot().subplots(figsize=(10, 0.35 * len(cats) + 1.5))
    y = np.arange(len(cats))
    height = 0.8 / len(names)
    for k, e in enumerate(names):
        vals = [100 * (summary[e]["by_category"].get(c, {}).get("share") or 0) for c in cats]
        ax.barh(y + height * k, vals, height=height, label=e)
    ax.set_yticks(y + 0.4 - height / 2, cats, fontsize=7)
    ax.set_xlabel("complete random-walk documents that validate (%)")
    ax.set_xlim(0, 100)
    ax.legend()
    save_figure(fig, png)


def result_name(args) -> str:
    return "validity-bench"


def run(args) -> dict:
    if args.no_walks and args.e2e_requests < 1:
        raise UsageError("--no-walks leaves nothing to run without --e2e-requests")
    for flag in ("walks", "max_tokens", "workers"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1")
    rows = load_rows(args.jsonschemabench, args.maskbench, args.limit)
    result: dict = {}
    if not args.no_walks:
        progress(f"{len(rows)} schemas, {args.walks} walks each per grammar, {args.workers} workers")
        results = run_all(args, rows)
        result.update(summary=summarise(results, engines(args)), schemas=results)
    if args.e2e_requests > 0:
        result["end_to_end"] = validity_e2e.run_e2e(args, rows, args.out)
    return result


def markdown(result: dict) -> str:
    tables = []
    if "summary" in result:
        tables.append(_walks_markdown(result["summary"]))
    if "end_to_end" in result:
        tables.append(validity_e2e.markdown(result["end_to_end"]["summary"]))
    return "\n\n".join(tables)
