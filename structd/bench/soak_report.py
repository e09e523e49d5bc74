"""`structd bench soak`: the figures from a run's tallies and samples, the markdown summary and the plot."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from structd.bench.harness import pyplot, save_figure

MIB = 2**20


def with_rates(samples: list[dict]) -> list[dict]:
    """The samples with tokens/s and completed requests/s over the interval before each."""
    out = []
    for prev, s in zip([None] + samples[:-1], samples):
        s = dict(s)
        dt = s["t"] - prev["t"] if prev is not None else 0.0
        s["tokens_per_second"] = (s["tokens"] - prev["tokens"]) / dt if dt > 0 else None
        s["completed_per_second"] = (s["completed"] - prev["completed"]) / dt if dt > 0 else None
        out.append(s)
    return out


def rss_figures(load: list[dict], warmup_seconds: float) -> dict:
    """RSS after warm-up and at the end of the load, each the median of a window (RSS swings by tens of MiB from
    one sample to the next with the batch), the growth in between, and the least-squares slope after warm-up."""
    pts = [(s["t"], s["rss_bytes"] / MIB) for s in load if s["rss_bytes"]]
    if not pts:
        return {"samples": 0}
    after = [(t, r) for t, r in pts if t >= warmup_seconds] or pts[-1:]
    window = min(60.0, (after[-1][0] - after[0][0]) / 5)
    first = float(np.median([r for t, r in after if t <= after[0][0] + window]))
    last = float(np.median([r for t, r in after if t >= after[-1][0] - window]))
    out = {"samples": len(pts), "warmup_seconds": warmup_seconds, "window_seconds": window, "start_mib": pts[0][1],
           "after_warmup_mib": first, "end_mib": last, "max_mib": max(r for _, r in pts),
           "growth_after_warmup_mib": last - first, "slope_after_warmup_mib_per_minute": None}
    if len(after) >= 3 and after[-1][0] > after[0][0]:
        out["slope_after_warmup_mib_per_minute"] = float(
            np.polyfit([t for t, _ in after], [r for _, r in after], 1)[0] * 60.0)
    return out


def summarize(args, run: dict) -> dict:
    tally = run["tally"]
    samples = with_rates(run["samples"])
    load = [s for s in samples if not s.get("settle")]
    final = run["final"]
    lost = dict(sorted(tally.lost.items()))
    unfinished = run["unfinished_at_end"]
    if unfinished:
        lost["UNFINISHED_AT_END"] = unfinished
    load_seconds = run["load_seconds"]
    rates = [s["tokens_per_second"] for s in load if s["tokens_per_second"] is not None]
    sessions = final["grammar_active_sessions"]
    warmup = min(args.warmup_seconds, args.duration_seconds / 2)
    end_state = {
        "kv_cache_usage_ratio": final["kv_cache_usage_ratio"], "running": final["running"],
        "waiting": final["waiting"], "grammar_active_sessions": sessions,
        "leaked_sessions": None if any(x is None for x in sessions) else int(sum(sessions)),
        "seconds_to_idle": run["settle_seconds"], "checked_for_seconds": final["t"] - load[-1]["t"] if load else None,
    }
    requests = {
        "started": tally.started, "completed": tally.completed, "cancelled_by_client": tally.cancelled_by_client,
        "lost": sum(lost.values()), "lost_by_status": lost, "lost_examples": tally.lost_examples,
        "finish_reasons": dict(tally.finish_reasons), "by_kind": dict(tally.by_kind),
        "invalid_outputs": sum(tally.invalid.values()), "invalid_outputs_by_reason": dict(sorted(tally.invalid.items())),
        "invalid_output_examples": tally.invalid_examples,
        "completed_per_second": tally.completed / load_seconds if load_seconds else None,
    }
    restarts = run["restarts"]
    faults = bool(requests["lost"]) or end_state["leaked_sessions"] != 0 or final["kv_cache_usage_ratio"] != 0 \
        or any(not r["restarted"] for r in restarts)
    return {
        "requests": requests,
        "restarts": restarts,
        "end_state": end_state,
        "rss": rss_figures(load, warmup),
        "throughput": {"tokens": tally.tokens, "load_seconds": load_seconds,
                       "tokens_per_second_mean": tally.tokens / load_seconds if load_seconds else None,
                       "tokens_per_second_min_interval": min(rates) if rates else None,
                       "tokens_per_second_max_interval": max(rates) if rates else None},
        "fault_times": tally.fault_times,
        "invalid_output_times": tally.invalid_times,
        "inference_counters": run["inference_counters"],
        "faults_seen": faults,
        "first_chunk_seconds": quantiles(tally.first_chunk_seconds),
        "hostile": run["hostile"],
        "memory": run["memory"],
        "samples": samples,
    }


def quantiles(values: list[float]) -> dict:
    """Count, p50, p95, p99 and max of `values` (None where there are none)."""
    if not values:
        return {"count": 0, "p50": None, "p95": None, "p99": None, "max": None}
    a = np.asarray(values)
    return {"count": len(values), **{f"p{q}": float(np.percentile(a, q)) for q in (50, 95, 99)}, "max": float(a.max())}


def _fmt(x, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(result: dict) -> str:
    q, e, r, tp = result["requests"], result["end_state"], result["rss"], result["throughput"]
    lost = ", ".join(f"{k} {v}" for k, v in q["lost_by_status"].items()) or "none"
    invalid = ", ".join(f"{k}: {v}" for k, v in q["invalid_outputs_by_reason"].items()) or "none"
    kills = [f"{x['signal'].removeprefix('SIG')} r{x['replica']} at {x['t']:.0f} s (down {x['down_seconds']:.1f} s)"
             for x in result["restarts"]]
    lines = [f"## {result.get('title', 'structd bench soak')}", "",
             "| figure | value |", "|---|---|",
             f"| requests started / completed / cancelled by the client | {q['started']} / {q['completed']} / "
             f"{q['cancelled_by_client']} |",
             f"| requests lost to faults | {q['lost']} ({lost}) |",
             f"| completed constrained outputs that break their constraint | {q['invalid_outputs']} ({invalid}) |",
             f"| grammar replica restarts | {len(result['restarts'])}: {'; '.join(kills) or 'none'} |",
             f"| grammar sessions left after the load | {e['grammar_active_sessions']} |",
             f"| KV cache usage after the load | {e['kv_cache_usage_ratio']} (idle after "
             f"{_fmt(e['seconds_to_idle'])} s) |",
             f"| inference RSS: start / after warm-up / end (medians over {_fmt(r.get('window_seconds'), '.0f')} s) / max (MiB) | {_fmt(r.get('start_mib'), '.0f')} / "
             f"{_fmt(r.get('after_warmup_mib'), '.0f')} / {_fmt(r.get('end_mib'), '.0f')} / "
             f"{_fmt(r.get('max_mib'), '.0f')} |",
             f"| RSS growth after warm-up ({_fmt(r.get('warmup_seconds'), '.0f')} s) | "
             f"{_fmt(r.get('growth_after_warmup_mib'))} MiB (slope {_fmt(r.get('slope_after_warmup_mib_per_minute'), '.2f')}"
             " MiB/min) |",
             f"| throughput: mean (min-max per interval) tokens/s | {_fmt(tp['tokens_per_second_mean'], '.0f')} "
             f"({_fmt(tp['tokens_per_second_min_interval'], '.0f')}-{_fmt(tp['tokens_per_second_max_interval'], '.0f')}) |",
             f"| completed requests/s | {_fmt(q['completed_per_second'])} |"]
    fc = result.get("first_chunk_seconds")
    if fc and fc["count"]:
        lines.append(f"| ordinary requests' wait for the first chunk: p50 / p95 / p99 / max (ms) | "
                     f"{fc['p50'] * 1e3:.0f} / {fc['p95'] * 1e3:.0f} / {fc['p99'] * 1e3:.0f} / {fc['max'] * 1e3:.0f} |")
    h = result.get("hostile")
    if h:
        lines.append(f"| hostile requests sent / refused {h['expected_status']} / anything else | {h['sent']} / "
                     f"{h['refused_as_expected']} / {h['unexpected']} |")
        for name, c in h["cases"].items():
            lines.append(f"| hostile: {name} | {c['sent']} sent, {c['refused_as_expected']} refused, "
                         f"{c['unexpected']} else{': ' + '; '.join(c['unexpected_examples']) if c['unexpected'] else ''}"
                         f" (slowest refusal {_fmt(c['refusal_seconds_max'], '.2f')} s) |")
    for service, m in (result.get("memory") or {}).get("by_service", {}).items():
        lines.append(f"| peak RSS, {service}: largest process ({m['peak_process_role']}) / largest worker / "
                     f"all its {m['processes_seen']} processes at once (MiB) | {m['peak_process_mib']:.0f} / "
                     f"{_fmt(m['peak_worker_mib'], '.0f')} / {m['peak_total_mib']:.0f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    samples = result["samples"]
    fig, axes = pyplot().subplots(4, 1, figsize=(13, 14), sharex=True)
    t = [s["t"] for s in samples]

    ax = axes[0]
    ax.plot(t, [s["rss_bytes"] / MIB if s["rss_bytes"] else np.nan for s in samples], "C0-")
    w = result["rss"].get("warmup_seconds")
    if w:
        ax.axvspan(0, w, color="grey", alpha=0.1, label="warm-up")
    ax.set(ylabel="MiB", title="Inference process RSS (VmRSS)")

    ax = axes[1]
    ax.plot(t, [s["tokens_per_second"] if s["tokens_per_second"] is not None else np.nan for s in samples], "C1-",
            label="tokens/s")
    ax2 = ax.twinx()
    ax2.plot(t, [s["completed_per_second"] if s["completed_per_second"] is not None else np.nan for s in samples],
             "C2-", lw=0.8, label="completed requests/s")
    ax2.set_ylabel("requests/s")
    faults = result["fault_times"]
    if faults:
        ax.plot([f[0] for f in faults], [0] * len(faults), "rx", ms=6, label="request lost to a fault")
    invalid = result["invalid_output_times"]
    if invalid:
        ax.plot([f[0] for f in invalid], [0] * len(invalid), "o", color="purple", ms=4, mfc="none",
                label="output breaks its constraint")
    ax.set(ylabel="tokens/s", title="Throughput (client-side, per sampling interval)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")

    ax = axes[2]
    ax.plot(t, [s["kv_cache_usage_ratio"] if s["kv_cache_usage_ratio"] is not None else np.nan for s in samples],
            "C3-", label="KV cache usage ratio")
    ax.set(ylabel="KV usage",
           title="KV cache usage and open grammar sessions (black line: no new requests from here; "
                 "grey: the idle check)")
    ax3 = ax.twinx()
    for i in range(len(samples[0]["grammar_active_sessions"]) if samples else 0):
        ax3.plot(t, [s["grammar_active_sessions"][i] if s["grammar_active_sessions"][i] is not None else np.nan
                     for s in samples], f"C{4 + i}-", lw=0.8, label=f"sessions, replica {i + 1}")
    ax3.set_ylabel("open sessions")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax3.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper right")
    memory_panel(axes[3], result)
    settle = [s["t"] for s in samples if s.get("settle")]
    for a in axes:
        a.axvline(result["arguments"]["duration_seconds"], color="black", lw=0.8)
        if settle:
            a.axvspan(settle[0], settle[-1], color="grey", alpha=0.15)
        for r in result["restarts"]:
            a.axvline(r["t"], color="red" if r["signal"] == "SIGKILL" else "orange", ls="--", lw=0.8)
    for r in result["restarts"]:  # red: SIGKILL, orange: SIGTERM
        axes[0].annotate(f"{r['signal'].removeprefix('SIG')} r{r['replica']}", (r["t"], 1.0),
                         xycoords=("data", "axes fraction"), fontsize=7, rotation=90, va="top", ha="right")
    if w:
        axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(result.get("title", "structd bench soak"), fontsize=10)
    save_figure(fig, path)


def memory_panel(ax, result: dict) -> None:
    """Each service's processes' RSS summed at each sample (its workers included), and hostile requests sent."""
    watched = (result.get("memory") or {}).get("samples", [])
    services = list((result.get("memory") or {}).get("by_service", {}))
    for i, service in enumerate(services):
        ax.plot([s["t"] for s in watched], [s["rss_bytes"].get(service) / MIB if s["rss_bytes"].get(service)
                                            else np.nan for s in watched], f"C{i}-", lw=0.9, label=service)
    rate = result["arguments"].get("hostile_rate")
    ax.set(ylabel="MiB", xlabel="seconds since the load started",
           title="RSS of each service's processes, workers included"
                 + (f" (hostile requests mixed in at {rate:g}/s)" if rate else ""))
    if services:
        ax.legend(fontsize=7, loc="upper left")
