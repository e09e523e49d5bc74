"""`structd bench prefix`: a phase's aggregates, the issue's targets, the markdown tables and the plot."""

from __future__ import annotations

from pathlib import Path

from inference_svc.config import DEFAULT_BLOCK_SIZE
from structd.bench.harness import pyplot, save_figure
from structd.bench.stats import summarize

MS = 1e3
# Issue 25's targets, at 32 concurrent requests sharing a 1,500-token prefix.
TARGET_N = 32
TARGET_TTFT_RATIO = 1 / 5  # TTFT p50 with caching over without: at most
TARGET_THROUGHPUT_RATIO = 2.0  # tokens/s with caching over without: at least
TARGET_VS_VLLM_THROUGHPUT = 1.5  # structd's (caching on) tokens/s over vLLM's (its prefix caching on): at least
TARGET_N_TIME_RATIO = 1 / 4  # n completions in one call over n calls one after another: under
TARGET_NO_SHARED_RATIO = 0.98  # with nothing shared, tokens/s with caching over without: at least


def phase_aggregates(records: list[dict], wall: float, server: dict | None) -> dict:
    """One phase's figures from its requests' records and (structd) its server's counters' change."""
    ok = [r for r in records if r.get("finish_reason") != "error"]
    tokens = sum(r["tokens"] for r in ok)
    p: dict = {"requests": len(records), "errors": len(records) - len(ok), "wall_seconds": wall, "tokens": tokens,
               "throughput_tokens_per_second": tokens / wall if wall > 0 else None,
               "ttft_seconds": summarize(r.get("ttft_seconds") for r in ok),
               "e2e_seconds": summarize(r.get("e2e_seconds") for r in ok),
               "prompt_tokens": sum(r.get("prompt_tokens", 0) for r in records),
               "finish_reasons": {}, "records": records}
    for r in records:
        p["finish_reasons"][r["finish_reason"]] = p["finish_reasons"].get(r["finish_reason"], 0) + 1
    if server is not None:
        p["server"] = server
        p["cached_prompt_tokens"] = sum(r.get("cached_prompt_tokens", 0) for r in records)
        queried = server["prefix_cache_queried_tokens"]
        # With caching off the server looks nothing up: no query, no hit, a hit rate of 0.
        p["hit_rate"] = server["prefix_cache_hit_tokens"] / queried if queried > 0 else 0.0
    if any("turn" in r for r in records):
        turns = sorted({r["turn"] for r in records})
        p["ttft_p50_by_turn_seconds"] = [summarize(r.get("ttft_seconds") for r in ok if r["turn"] == t).get("p50")
                                         for t in turns]
    return p


def _phase(result: dict, phase: str, caching: str, concurrency: int | None = None) -> dict | None:
    phases = result["phases"] if caching != "vllm" else result.get("vllm", {}).get("phases", [])
    return next((p for p in phases if p["phase"] == phase and p["caching"] == caching
                 and (concurrency is None or p["concurrency"] == concurrency)), None)


def _verdict(value: float | None, bound: float, at_most: bool, why_not: str = "") -> dict:
    if value is None:
        return {"status": why_not or "not measured", "value": None, "bound": bound}
    met = value <= bound if at_most else value >= bound
    return {"status": "met" if met else "missed", "value": value, "bound": bound}


def targets(result: dict) -> dict:
    """Issue 25's targets as far as this run measured them (each: status, value, bound)."""
    levels = sorted({p["concurrency"] for p in result["phases"] if p["phase"] == "shared_prefix"})
    top = levels[-1] if levels else None
    on = _phase(result, "shared_prefix", "on", top)
    off = _phase(result, "shared_prefix", "off", top)
    vllm = _phase(result, "shared_prefix", "vllm", top)
    note = f"at N={top}" + ("" if top == TARGET_N else f" (the target is at N={TARGET_N})")
    out: dict = {}
    both = on is not None and off is not None and not on["errors"] and not off["errors"]
    t_on, t_off = (on or {}).get("ttft_seconds", {}).get("p50"), (off or {}).get("ttft_seconds", {}).get("p50")
    out["ttft_p50_on_over_off"] = dict(_verdict(t_on / t_off if both and t_on and t_off else None,
                                                TARGET_TTFT_RATIO, True, "not measured (needs --caching on,off)"),
                                       at=note)
    r_on, r_off = (on or {}).get("throughput_tokens_per_second"), (off or {}).get("throughput_tokens_per_second")
    out["throughput_on_over_off"] = dict(_verdict(r_on / r_off if both and r_on and r_off else None,
                                                  TARGET_THROUGHPUT_RATIO, False,
                                                  "not measured (needs --caching on,off)"), at=note)
    has_vllm = on is not None and vllm is not None and not vllm["errors"]
    v_rate = (vllm or {}).get("throughput_tokens_per_second")
    out["throughput_vs_vllm"] = dict(_verdict(r_on / v_rate if has_vllm and r_on and v_rate else None,
                                              TARGET_VS_VLLM_THROUGHPUT, False, "not measured (no --vllm-python)"),
                                     at=note)
    v_ttft = (vllm or {}).get("ttft_seconds", {}).get("p50")
    out["ttft_p50_vs_vllm"] = dict(_verdict(t_on / v_ttft if has_vllm and t_on and v_ttft else None, 1.0, True,
                                            "not measured (no --vllm-python)"), at=note)
    n_on = next((n for n in result.get("n_phase", []) if n["caching"] == "on"), None)
    if n_on is None:
        out["n_time_ratio"] = _verdict(None, TARGET_N_TIME_RATIO, True, "not measured (needs --n and caching on)")
    else:
        v = _verdict(n_on["time_ratio"], TARGET_N_TIME_RATIO, True)
        if v["status"] == "met" and v["value"] >= TARGET_N_TIME_RATIO:
            v["status"] = "missed"  # the bound is strict: under 1/4
        out["n_time_ratio"] = dict(v, n=n_on["n"])
        # Another reading of "eight separate requests": each computing its prompt (the caching-off server's).
        n_off = next((n for n in result.get("n_phase", []) if n["caching"] == "off"), None)
        if n_off is not None:
            apart = n_off["one_after_another"]["wall_seconds"]
            v = _verdict(n_on["one_call"]["wall_seconds"] / apart if apart > 0 else None, TARGET_N_TIME_RATIO, True)
            if v["status"] == "met" and v["value"] >= TARGET_N_TIME_RATIO:
                v["status"] = "missed"
            out["n_time_ratio_vs_uncached_requests"] = dict(v, n=n_on["n"])
        # The prompt computed once: every completion but the first found it cached (all but its last
        # partial block, and at least one token is always computed).
        each = n_on["one_call"]["cached_prompt_tokens_each"]
        full = (n_on["prompt_tokens"] - 1) // DEFAULT_BLOCK_SIZE * DEFAULT_BLOCK_SIZE
        once = len(each) == n_on["n"] and sorted(each)[1:] == [full] * (n_on["n"] - 1)
        out["n_prefill_once"] = {"status": "met" if once else "missed", "cached_prompt_tokens_each": each,
                                 "expected_for_later_completions": full}
    rates = no_shared_rates(result)
    out["no_shared_prefix_on_over_off"] = dict(
        _verdict(rates["on"] / rates["off"] if rates.get("on") and rates.get("off") else None,
                 TARGET_NO_SHARED_RATIO, False, "not measured (needs --no-shared-rounds and --caching on,off)"),
        at=f"tokens/s over {rates.get('rounds', 0)} round(s)")
    return out


def no_shared_rates(result: dict) -> dict:
    """The no-shared-prefix phase's tokens/s per server, all its rounds together (tokens over wall time)."""
    out: dict = {}
    phases = [p for p in result["phases"] if p["phase"] == "no_shared_prefix" and not p["errors"]]
    for caching in ("on", "off"):
        ps = [p for p in phases if p["caching"] == caching]
        wall = sum(p["wall_seconds"] for p in ps)
        if ps and wall > 0:
            out[caching] = sum(p["tokens"] for p in ps) / wall
    out["rounds"] = len({p["round"] for p in phases})
    return out


# --- markdown ------------------------------------------------------------------------------


def _ms(summary: dict, key: str) -> str:
    v = summary.get(key)
    return "-" if v is None else f"{v * MS:,.0f}"


def _num(v, fmt: str = "{:,.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def markdown(result: dict) -> str:
    lines = [f"## {result['title']}", "",
             f"Schema `{result['workload']['schema']}`, prefix {result['workload']['prefix_tokens']} tokens, "
             f"suffix {result['workload']['suffix_tokens'][0]}-{result['workload']['suffix_tokens'][1]} tokens, "
             f"{result['workload']['requests']} requests per phase, max_tokens {result['workload']['max_tokens']}; "
             f"load average {result['load_average_start']} at the start, {result['load_average_end']} at the end.",
             "", "### Shared prefix", "",
             "| N | caching | TTFT p50 ms | TTFT p99 ms | tokens/s | hit rate | cached prompt tokens (usage) "
             "| prompt tokens | wall s | errors |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    shared = [p for p in result["phases"] if p["phase"] == "shared_prefix"]
    shared += result.get("vllm", {}).get("phases", [])
    for p in sorted(shared, key=lambda p: (p["concurrency"], ["on", "off", "vllm"].index(p["caching"]))):
        caching = "vLLM (prefix caching on)" if p["caching"] == "vllm" else p["caching"]
        lines.append(f"| {p['concurrency']} | {caching} | {_ms(p['ttft_seconds'], 'p50')} "
                     f"| {_ms(p['ttft_seconds'], 'p99')} | {_num(p['throughput_tokens_per_second'])} "
                     f"| {_num(p.get('hit_rate'), '{:.3f}')} | {p.get('cached_prompt_tokens', '-')} "
                     f"| {p['prompt_tokens']} | {p['wall_seconds']:.1f} | {p['errors']} |")
    multi = [p for p in result["phases"] if p["phase"] == "multi_turn"]
    if multi:
        w = result["workload"]["multi_turn"]
        lines += ["", f"### Multi-turn: {w['conversations']} conversations x {w['turns']} turns, all in flight", "",
                  "| caching | TTFT p50 ms | TTFT p99 ms | TTFT p50 by turn ms | tokens/s | hit rate | wall s "
                  "| errors |", "|---|---:|---:|---|---:|---:|---:|---:|"]
        for p in multi:
            by_turn = ", ".join("-" if v is None else f"{v * MS:,.0f}" for v in p.get("ttft_p50_by_turn_seconds", []))
            lines.append(f"| {p['caching']} | {_ms(p['ttft_seconds'], 'p50')} | {_ms(p['ttft_seconds'], 'p99')} "
                         f"| {by_turn} | {_num(p['throughput_tokens_per_second'])} | {p['hit_rate']:.3f} "
                         f"| {p['wall_seconds']:.1f} | {p['errors']} |")
    if result.get("n_phase"):
        lines += ["", "### n completions of one prompt vs one request after another", "",
                  "| caching | n | prompt tokens | one call s | one after another s | ratio | tokens (one call / "
                  "one after another) | cached prompt tokens each (one call) | cached (one after another) |",
                  "|---|---:|---:|---:|---:|---:|---:|---|---:|"]
        for n in result["n_phase"]:
            a, b = n["one_call"], n["one_after_another"]
            lines.append(f"| {n['caching']} | {n['n']} | {n['prompt_tokens']} | {a['wall_seconds']:.2f} "
                         f"| {b['wall_seconds']:.2f} | {_num(n['time_ratio'], '{:.3f}')} "
                         f"| {a['tokens']} / {b['tokens']} "
                         f"| {', '.join(map(str, a['cached_prompt_tokens_each']))} | {b['cached_prompt_tokens']} |")
    no_shared = [p for p in result["phases"] if p["phase"] == "no_shared_prefix"]
    if no_shared:
        w = result["workload"]["no_shared_prefix"]
        lines += ["", f"### No shared prefix: {w['prompts']}, N={no_shared[0]['concurrency']}, "
                      f"{w['requests']} requests, max_tokens {w['max_tokens']}", "",
                  "| round | caching | tokens/s | TTFT p50 ms | TTFT p99 ms | hit rate | steps | forward s "
                  "| schedule ms/step | wall s | errors |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for p in no_shared:
            d = p["server"].get("detail", {})
            schedule = d.get("host_phase_mean_seconds", {}).get("schedule")
            lines.append(f"| {p['round'] + 1} | {p['caching']} | {_num(p['throughput_tokens_per_second'])} "
                         f"| {_ms(p['ttft_seconds'], 'p50')} | {_ms(p['ttft_seconds'], 'p99')} "
                         f"| {p['hit_rate']:.3f} | {d.get('steps', '-')} | {p['server']['forward_seconds']:.2f} "
                         f"| {_num(None if schedule is None else schedule * MS, '{:.3f}')} "
                         f"| {p['wall_seconds']:.1f} | {p['errors']} |")
        rates = no_shared_rates(result)
        for caching in ("on", "off"):
            if caching in rates:
                lines.append(f"| all | {caching} | {rates[caching]:,.1f} | | | | | | | | |")
    lines += ["", "### Targets (issue 25)", "", "| target | value | bound | status |", "|---|---:|---:|---|"]
    for name, t in result["targets"].items():
        value = t.get("value")
        lines.append(f"| {name}{' ' + t['at'] if 'at' in t else ''} | {_num(value, '{:.3f}')} "
                     f"| {_num(t.get('bound'), '{:.3f}')} | {t['status']} |")
    return "\n".join(lines)


# --- the plot ------------------------------------------------------------------------------


def plot(result: dict, png: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ttft_ax, rate_ax), (turn_ax, n_ax) = axes
    colors = {"on": "tab:blue", "off": "tab:orange", "vllm": "tab:green"}
    labels = {"on": "structd, caching on", "off": "structd, caching off", "vllm": "vLLM, prefix caching on"}
    shared = [p for p in result["phases"] if p["phase"] == "shared_prefix"] + result.get("vllm", {}).get("phases", [])
    for caching in ("on", "off", "vllm"):
        ps = sorted((p for p in shared if p["caching"] == caching), key=lambda p: p["concurrency"])
        if not ps:
            continue
        xs = [p["concurrency"] for p in ps]
        ttft_ax.plot(xs, [(p["ttft_seconds"].get("p50") or 0) * MS for p in ps], "o-", color=colors[caching],
                     label=f"{labels[caching]} p50")
        ttft_ax.plot(xs, [(p["ttft_seconds"].get("p99") or 0) * MS for p in ps], "x--", color=colors[caching],
                     label=f"{labels[caching]} p99")
        rate_ax.plot(xs, [p["throughput_tokens_per_second"] or 0 for p in ps], "o-", color=colors[caching],
                     label=labels[caching])
    levels = sorted({p["concurrency"] for p in shared})
    for ax, title, unit in ((ttft_ax, "shared prefix: time to first token", "ms"),
                            (rate_ax, "shared prefix: completion tokens/s", "tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend(fontsize=7)
    ttft_ax.set_yscale("log")
    for p in (p for p in result["phases"] if p["phase"] == "multi_turn"):
        by_turn = p.get("ttft_p50_by_turn_seconds", [])
        turn_ax.plot(range(1, len(by_turn) + 1), [(v or 0) * MS for v in by_turn], "o-",
                     color=colors[p["caching"]], label=labels[p["caching"]])
    turns = result["workload"]["multi_turn"]["turns"]
    turn_ax.set_xticks(range(1, turns + 1))
    turn_ax.set_title("multi-turn: TTFT p50 by turn (history resent)")
    turn_ax.set_xlabel("turn")
    turn_ax.set_ylabel("ms")
    if turn_ax.lines:
        turn_ax.legend(fontsize=7)
    ns = result.get("n_phase", [])
    for k, n in enumerate(ns):
        n_ax.bar([k * 3, k * 3 + 1], [n["one_call"]["wall_seconds"], n["one_after_another"]["wall_seconds"]],
                 color=[colors[n["caching"]], "tab:gray"])
    n_ax.set_xticks([k * 3 + d for k in range(len(ns)) for d in (0, 1)],
                    [f"{lbl}\ncaching {n['caching']}" for n in ns
                     for lbl in (f"n={n['n']} in one call", f"{n['n']} calls in turn")], fontsize=7)
    n_ax.set_ylabel("s")
    n_ax.set_title("n completions: total time")
    fig.suptitle(result.get("title", "structd bench prefix"), fontsize=9)
    save_figure(fig, png)
