"""`structd bench grammar`: aggregates and the plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from structd.bench.harness import pyplot, save_figure
from structd.bench.stats import log_edges, log_histogram, summarize

DENSE_WORDS_BYTES = 16_160  # ceil(129280 / 32) * 4, the raw dense row


def walk_aggregates(run, local=None) -> dict:
    """Everything about one batch size, from the WalkRun (and the LocalRows, if any)."""
    masks = np.asarray(run.masks, dtype=float)
    fill = np.asarray(run.fill)
    per_mask = np.where(masks > 0, fill / np.maximum(masks, 1), np.nan)
    encodings: dict[str, int] = {}
    enc_bytes: dict[str, list[int]] = {}
    for e, b in zip(run.row_encoding, run.row_bytes):
        encodings[e] = encodings.get(e, 0) + 1
        enc_bytes.setdefault(e, []).append(b)
    n_rows = len(run.row_bytes)
    ends: dict[str, int] = {}
    for s in run.sessions:
        ends[s.end] = ends.get(s.end, 0) + 1
    bytes_median = float(np.median(run.row_bytes)) if run.row_bytes else None
    out = {
        "batch": run.batch,
        "steps": len(run.rtt),
        "mask_rows": n_rows,
        "masks_per_step": summarize(run.masks),
        "step_rtt_seconds": summarize(run.rtt),
        "server_step_seconds": summarize(run.server),
        "server_fill_seconds": summarize(run.fill),
        "server_fill_per_mask_seconds": summarize(per_mask),
        "rtt_minus_server_seconds": summarize(np.asarray(run.rtt) - np.asarray(run.server)),
        "server_minus_fill_seconds": summarize(np.asarray(run.server) - np.asarray(run.fill)),
        "client_decode_seconds": summarize(run.decode),
        "client_decode_per_mask_seconds": summarize(np.asarray(run.decode) / np.maximum(masks, 1)),
        "response_bytes": summarize(run.response_bytes),
        "request_bytes": summarize(run.request_bytes),
        "mask_bytes": summarize(run.row_bytes),
        "mask_bytes_median_vs_dense": bytes_median / DENSE_WORDS_BYTES if bytes_median is not None else None,
        "mask_bytes_mean_vs_dense": (float(np.mean(run.row_bytes)) / DENSE_WORDS_BYTES) if run.row_bytes else None,
        "encoding_share": {k: v / n_rows for k, v in sorted(encodings.items())},
        "encoding_median_bytes": {k: float(np.median(v)) for k, v in sorted(enc_bytes.items())},
        "sessions": {"opened": len(run.sessions), "ends": ends,
                     "mean_tokens": float(np.mean([len(s.tokens) for s in run.sessions])) if run.sessions else 0.0},
        "statuses": run.statuses,
        "step_rtt_hist": log_histogram(run.rtt),
    }
    if local is not None:
        fill = np.asarray(local.fill, dtype=float)
        klass = np.asarray(local.klass)
        rew = np.asarray([np.nan if x is None else x for x in local.rewrite_fill], dtype=float)
        loc = {
            "rows": int(np.sum(~np.isnan(fill))),
            "fill_seconds": summarize(fill),
            "fill_hist": log_histogram(fill[~np.isnan(fill)]),
            "matches_server": int(np.sum(local.matches_server)),
            "by_class": {},
        }
        for k in sorted(set(klass)):
            sel = klass == k
            loc["by_class"][k] = {"rows": int(sel.sum()), "share": float(sel.mean()),
                                  "fill_seconds": summarize(fill[sel]),
                                  "fill_time_share": float(np.nansum(fill[sel]) / max(np.nansum(fill), 1e-12)),
                                  "rewrite_fill_seconds": summarize(rew[sel])}
        compared = [x for x in local.rewrite_matches if x is not None]
        loc["rewrite"] = {"rows_compared": len(compared), "mask_mismatches": int(sum(1 for x in compared if not x)),
                          "fill_seconds": summarize(rew), "fill_hist": log_histogram(rew[~np.isnan(rew)])}
        # What a step waits on: the sum of its rows (one thread) and its slowest row (ideal parallelism).
        # Rows timed both ways are compared like for like; without a rewrite pass (--no-rewrite-check,
        # --local-grammar served) every timed row counts.
        steps = np.asarray(run.row_step)
        both = ~np.isnan(fill) & ~np.isnan(rew)
        timed = both if both.any() else ~np.isnan(fill)
        per_step = {"sum": [], "max": [], "rewrite_sum": [], "rewrite_max": []}
        for s in range(len(run.rtt)):
            sel = (steps == s) & timed
            if sel.any():
                per_step["sum"].append(fill[sel].sum())
                per_step["max"].append(fill[sel].max())
            if ((steps == s) & both).any():
                per_step["rewrite_sum"].append(rew[(steps == s) & both].sum())
                per_step["rewrite_max"].append(rew[(steps == s) & both].max())
        loc["step_row_sum_seconds"] = summarize(per_step["sum"])
        loc["step_row_max_seconds"] = summarize(per_step["max"])
        loc["rewrite_step_row_sum_seconds"] = summarize(per_step["rewrite_sum"])
        loc["rewrite_step_row_max_seconds"] = summarize(per_step["rewrite_max"])
        out["local"] = loc
    return out


def compile_aggregates(records, local_grammars=None) -> dict:
    counts: dict[str, int] = {}
    by_dataset: dict[str, dict] = {}
    for r in records:
        counts[r.status] = counts.get(r.status, 0) + 1
        d = by_dataset.setdefault(r.dataset, {"n": 0, "statuses": {}, "cold": []})
        d["n"] += 1
        d["statuses"][r.status] = d["statuses"].get(r.status, 0) + 1
        if r.status == "ok":
            d["cold"].append(r.cold_seconds)
    ok = [r for r in records if r.status == "ok"]
    out = {
        "schemas": len(records),
        "statuses": counts,
        "cold_seconds_ok": summarize([r.cold_seconds for r in ok]),
        "cold_hist_ok": log_histogram([r.cold_seconds for r in ok]),
        "server_compile_seconds_ok": summarize([r.server_compile_seconds for r in ok]),
        "cold_seconds_invalid": summarize([r.cold_seconds for r in records if r.status == "invalid"]),
        "cold_seconds_timeout": summarize([r.cold_seconds for r in records if r.status == "timeout"]),
        "cold_cache_hits": sum(1 for r in records if r.cold_cache_hit),
        "cached_seconds_ok": summarize([r.cached_seconds for r in ok]),
        "cached_hist_ok": log_histogram([r.cached_seconds for r in ok]),
        "cached_seconds_failed": summarize([r.cached_seconds for r in records if r.status != "ok"]),
        "cached_cache_hits_ok": sum(1 for r in ok if r.cached_cache_hit),
        "memory_bytes_ok": summarize([r.memory_bytes for r in ok]),
        "with_warnings": sum(1 for r in ok if r.warnings),
        "by_dataset": {k: {"n": v["n"], "statuses": v["statuses"], "cold_p50_ok": summarize(v["cold"]).get("p50")}
                       for k, v in sorted(by_dataset.items())},
    }
    if local_grammars:
        lg = list(local_grammars.values())
        rew = [g for g in lg if g.rewrite_rules]
        out["local"] = {
            "compiled": sum(1 for g in lg if g.compiled is not None),
            "errors": sum(1 for g in lg if g.error),
            "with_bounded_strings": sum(1 for g in lg if g.bounded_rules or g.long_rules),
            "with_long_bounded_strings": sum(1 for g in lg if g.long_rules),
            "with_rewritten_rules": len(rew),
            "rewrite_compile_errors": sum(1 for g in lg if g.rewrite_error),
            "rewrite_compile_error_examples": sorted({g.rewrite_error for g in lg if g.rewrite_error})[:10],
            "compile_seconds_rewritten_schemas": summarize([g.compile_seconds for g in rew]),
            "rewrite_compile_seconds_rewritten_schemas": summarize(
                [g.rewrite_compile_seconds for g in rew if g.rewrite_compile_seconds is not None]),
        }
    return out


def plot(result: dict, path: Path) -> None:
    fig, axes = pyplot().subplots(2, 3, figsize=(18, 10))
    walks = result.get("walks", [])
    bs = [w["batch"] for w in walks]

    ax = axes[0][0]
    for key, label, style in (("step_rtt_seconds", "step RTT", "o-"), ("server_step_seconds", "server step", "s-"),
                              ("server_fill_seconds", "server fill (wall)", "^-")):
        for q, ls in (("p50", "-"), ("p99", "--")):
            ys = [w[key].get(q, np.nan) * 1e3 for w in walks]
            ax.plot(bs, ys, style[0] + ls, label=f"{label} {q}")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", yscale="log", xlabel="sessions per step", ylabel="ms", title="Step time vs batch size")
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.legend(fontsize=7)

    ax = axes[0][1]
    for w in walks:
        loc = w.get("local")
        if not loc:
            continue
        h = loc["fill_hist"]
        _cdf(ax, h, f"batch {w['batch']} original")
        if loc["rewrite"]["fill_hist"]["counts"] and sum(loc["rewrite"]["fill_hist"]["counts"]):
            _cdf(ax, loc["rewrite"]["fill_hist"], f"batch {w['batch']} rewritten", ls="--")
    ax.set(xscale="log", xlabel="fill time per row (s, local, one thread)", ylabel="CDF",
           title="Per-row mask fill (JSONSchemaBench walks)")
    ax.legend(fontsize=7)

    ax = axes[0][2]
    kinds = sorted({k for w in walks for k in w["encoding_share"]})
    bottom = np.zeros(len(walks))
    for k in kinds:
        vals = np.array([w["encoding_share"].get(k, 0.0) * 100 for w in walks])
        ax.bar([str(b) for b in bs], vals, bottom=bottom, label=k)
        bottom += vals
    ax2 = ax.twinx()
    ax2.plot([str(b) for b in bs], [w["mask_bytes"].get("mean", np.nan) for w in walks], "ko-", label="mean bytes/mask")
    ax2.set_ylabel("mean bytes per mask (dense: 16,160)")
    ax.set(xlabel="sessions per step", ylabel="% of masks", title="Mask encodings on the wire")
    ax.legend(fontsize=7, loc="lower left")
    ax2.legend(fontsize=7, loc="lower right")

    ax = axes[1][0]
    comp = result.get("compile", {})
    if comp.get("cold_hist_ok"):
        _cdf(ax, comp["cold_hist_ok"], "cold (ok)")
        _cdf(ax, comp["cached_hist_ok"], "cached")
    ax.axvline(1e-3, color="grey", lw=0.8, ls=":")
    ax.set(xscale="log", xlabel="client-observed Compile (s)", ylabel="CDF", title="Compile time")
    ax.legend(fontsize=7)

    ax = axes[1][1]
    bounded = [e for e in result.get("bounded", {}).get("lengths", []) if "error" not in e]
    if bounded:
        labels = [str(e["max_length"] or "none") for e in bounded]
        x = np.arange(len(labels))
        o = [e.get("server_fill_inside", {}).get("p50", np.nan) * 1e3 for e in bounded]
        o99 = [e.get("server_fill_inside", {}).get("p99", np.nan) * 1e3 for e in bounded]
        r = [e.get("rewrite_server_fill_inside", {}).get("p50", np.nan) * 1e3 for e in bounded]
        r99 = [e.get("rewrite_server_fill_inside", {}).get("p99", np.nan) * 1e3 for e in bounded]
        ax.bar(x - 0.3, o, 0.2, label="xgrammar form p50")
        ax.bar(x - 0.1, o99, 0.2, label="xgrammar form p99")
        ax.bar(x + 0.1, r, 0.2, label="rewritten p50")
        ax.bar(x + 0.3, r99, 0.2, label="rewritten p99")
        ax.set_xticks(x, labels)
        ax.set(yscale="log", xlabel="maxLength", ylabel="server fill per row (ms)",
               title="Inside a bounded string (batch 1, through the server)")
        ax.legend(fontsize=7)

    ax = axes[1][2]
    for e in bounded:
        if e["max_length"] in (8, 20, 64):
            ch = e.get("fill_by_chars", {})
            ax.plot([int(k) for k in ch], [v * 1e3 for v in ch.values()], "o-", label=f"maxLength {e['max_length']}")
            rch = e.get("rewrite_fill_by_chars", {})
            if rch:
                ax.plot([int(k) for k in rch], [v * 1e3 for v in rch.values()], "x--",
                        label=f"maxLength {e['max_length']} rewritten")
    ax.set(yscale="log", xlabel="characters already in the string", ylabel="server fill (ms, median)",
           title="Fill time along a bounded string")
    ax.legend(fontsize=7)

    fig.suptitle(result.get("title", "structd bench grammar"), fontsize=10)
    save_figure(fig, path)


def _cdf(ax, hist: dict, label: str, ls: str = "-") -> None:
    counts = np.asarray(hist["counts"], dtype=float)
    if counts.sum() == 0:
        return
    edges = log_edges(hist["lo"], hist["hi"], hist["per_decade"])
    ax.plot(edges[1:], np.cumsum(counts) / counts.sum(), ls, label=label)
