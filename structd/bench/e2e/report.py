"""`structd bench e2e`: the phases' metric deltas, aggregates, comparisons, targets, the plot and the markdown tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from inference_svc.metrics import HOST_PHASES, LM_HEAD_PATHS
from structd.bench.harness import pyplot, save_figure
from structd.bench.harness.metrics import delta, histogram_delta, histogram_mean, histogram_quantile, share_above
from structd.bench.stats import summarize

MS = 1e3


def merged(samples: list[dict[str, float]]) -> dict[str, float]:
    """The replicas' samples as one tier's: counters and histogram buckets add up."""
    out: dict[str, float] = {}
    for one in samples:
        for key, value in one.items():
            out[key] = out.get(key, 0.0) + value
    return out


def steps_each(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[int]:
    """Step messages each replica answered between two snapshots: how the tier's load was spread."""
    key = "grammar_svc_step_duration_seconds_count"
    return [int(a.get(key, 0.0) - b.get(key, 0.0)) for b, a in zip(before, after)]


def server_deltas(before: dict, after: dict, wall: float) -> dict:
    fwd = histogram_delta(before, after, "inference_svc_forward_duration_seconds")
    mw = histogram_delta(before, after, "inference_svc_mask_wait_seconds")
    rpc = histogram_delta(before, after, "inference_svc_grammar_rpc_duration_seconds")
    batch = histogram_delta(before, after, "inference_svc_batch_size")
    steps = fwd["count"]
    out = {
        "steps": int(steps),
        "steps_with_grammar": int(mw["count"]),
        "forward_seconds_sum": fwd["sum"],
        "forward_mean_seconds": fwd["sum"] / steps if steps else None,
        "mask_wait_seconds_sum": mw["sum"],
        "mask_wait_share": mw["sum"] / fwd["sum"] if fwd["sum"] > 0 else None,
        "mask_wait_mean_seconds": mw["sum"] / mw["count"] if mw["count"] else None,
        "mask_wait_p50_seconds": histogram_quantile(mw, 0.5),
        "mask_wait_p90_seconds": histogram_quantile(mw, 0.9),
        "mask_wait_p99_seconds": histogram_quantile(mw, 0.99),
        "steps_mask_wait_over_1ms_share": share_above(mw, 1e-3),
        "grammar_rpc_mean_seconds": rpc["sum"] / rpc["count"] if rpc["count"] else None,
        "grammar_rpc_p50_seconds": histogram_quantile(rpc, 0.5),
        "grammar_rpc_p90_seconds": histogram_quantile(rpc, 0.9),
        "mean_batch": batch["sum"] / batch["count"] if batch["count"] else None,
        "generation_tokens_constrained": delta(before, after, "inference_svc_generation_tokens_total{constrained=true}"),
        "generation_tokens_unconstrained": delta(before, after,
                                                  "inference_svc_generation_tokens_total{constrained=false}"),
        "forced_tokens": delta(before, after, "inference_svc_forced_tokens_total"),
        "preemptions": delta(before, after, "inference_svc_preemptions_total"),
        # How each step's LM head ran (--sparse-head): sparse, partial, full_late, full_needed, full.
        "lm_head_steps": {path: delta(before, after, f"inference_svc_lm_head_steps_total{{path={path}}}")
                          for path in LM_HEAD_PATHS},
        # The step loop's host work per step, by phase (inference_svc_step_host_seconds): mean seconds per
        # step that ran the phase, and per row of the mean batch.
        "host_phase_mean_seconds": {phase: histogram_mean(before, after, "inference_svc_step_host_seconds", f"phase={phase}")
                                    for phase in HOST_PHASES},
    }
    if batch["count"] and batch["sum"]:
        rows = batch["sum"] / batch["count"]
        out["host_phase_per_row_seconds"] = {k: v / rows for k, v in out["host_phase_mean_seconds"].items()
                                             if v is not None}
    if steps:
        # What one step costs beyond the forward and the mask wait: scheduling, sampling, streaming,
        # the event loop (an upper bound: the phase's ramp-up and tail are in the wall time too).
        out["wall_per_step_seconds"] = wall / steps
        out["overhead_per_step_seconds"] = (wall - fwd["sum"] - mw["sum"]) / steps
    return out


def grammar_deltas(before: dict, after: dict) -> dict:
    step = histogram_delta(before, after, "grammar_svc_step_duration_seconds")
    fill = histogram_delta(before, after, "grammar_svc_mask_fill_duration_seconds")
    return {
        "steps": int(step["count"]),
        "step_mean_seconds": step["sum"] / step["count"] if step["count"] else None,
        "step_p50_seconds": histogram_quantile(step, 0.5),
        "step_p90_seconds": histogram_quantile(step, 0.9),
        "fill_rows": int(fill["count"]),
        "fill_mean_seconds": fill["sum"] / fill["count"] if fill["count"] else None,
        "fill_p99_seconds": histogram_quantile(fill, 0.99),
        "jump_forward_tokens": delta(before, after, "grammar_svc_jump_forward_tokens_total"),
    }


# --- aggregates -------------------------------------------------------------------------------


def phase_aggregates(records: list[dict], wall: float, before, after) -> dict:
    ok = [r for r in records if r and not r.get("error")]
    tokens = sum(r["tokens"] for r in ok)
    forced = sum(r.get("forced_tokens", 0) for r in ok)
    finish: dict[str, int] = {}
    for r in records:
        finish[r["finish_reason"]] = finish.get(r["finish_reason"], 0) + 1
    out = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_examples": sorted({r["error"] for r in records if r.get("error")})[:3],
        "wall_seconds": wall,
        "tokens": tokens,
        "forced_tokens": forced,
        "forced_share": forced / tokens if tokens else None,
        "throughput_tokens_per_second": tokens / wall if wall > 0 else None,
        "tokens_per_request": summarize([r["tokens"] for r in ok]),
        "ttft_seconds": summarize([r["ttft_seconds"] for r in ok]),
        "tpot_seconds": summarize([r["tpot_seconds"] for r in ok if r.get("tpot_seconds") is not None]),
        "e2e_seconds": summarize([r["e2e_seconds"] for r in ok]),
        "finish_reasons": finish,
        "by_schema_tokens": _by_schema(ok),
    }
    if before is not None and after is not None:
        out["server"] = server_deltas(before[0], after[0], wall)
        out["grammar_server"] = grammar_deltas(before[1], after[1])
    return out


def cpu_usage(before: tuple, after: tuple, wall: float, *, in_process: bool) -> dict:
    """CPU seconds of the inference server, the grammar server and the benchmark client over a phase,
    and how many cores they kept busy together (the machine is shared by all three)."""
    import os

    seconds = {name: (None if a is None or b is None else a - b)
               for name, b, a in zip(("inference", "grammar", "client"), before, after)}
    busy = sum(v for v in seconds.values() if v is not None)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    out = {"seconds": seconds, "cores_busy": busy / wall if wall > 0 else None, "cpus": cpus}
    if in_process:
        out["note"] = "in-process: the client's figure includes both services"
    return out


def _by_schema(records: list[dict]) -> dict:
    by: dict[str, list[int]] = {}
    for r in records:
        by.setdefault(r.get("schema") or "none", []).append(r["tokens"])
    return {k: float(np.mean(v)) for k, v in sorted(by.items())}


def _g(d: dict | None, *path, default=None):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def _fmt_ms(x) -> str:
    return "–" if x is None else f"{x * MS:.2f}"


def _fmt_pct(x) -> str:
    return "–" if x is None else f"{x * 100:.1f}%"


def phase_line(p: dict) -> str:
    s = p.get("server", {})
    line = (f"{p['tokens']} tokens in {p['wall_seconds']:.1f} s = {p['throughput_tokens_per_second']:.0f} tok/s; "
            f"TTFT p50 {_fmt_ms(_g(p, 'ttft_seconds', 'p50'))} ms, TPOT mean {_fmt_ms(_g(p, 'tpot_seconds', 'mean'))}"
            f" ms p50 {_fmt_ms(_g(p, 'tpot_seconds', 'p50'))} ms")
    if s:
        line += (f"; mask wait {_fmt_pct(s.get('mask_wait_share'))} of forward, grammar step (server) "
                 f"{_fmt_ms(_g(p, 'grammar_server', 'step_mean_seconds'))} ms, forward {_fmt_ms(s.get('forward_mean_seconds'))} ms,"
                 f" overhead/step {_fmt_ms(s.get('overhead_per_step_seconds'))} ms, forced {_fmt_pct(p['forced_share'])}")
        host = s.get("host_phase_mean_seconds") or {}
        if any(v is not None for v in host.values()):
            line += "; host per step: " + ", ".join(f"{k} {v * 1e6:.0f} µs" for k, v in host.items() if v is not None)
    if len(p.get("grammar_steps_per_replica", [])) > 1:
        line += f"; grammar steps per replica {p['grammar_steps_per_replica']}"
    cpu = p.get("cpu", {}).get("seconds")
    if cpu and p["wall_seconds"] > 0:
        line += "; CPU cores busy: " + ", ".join(f"{k} {v / p['wall_seconds']:.2f}" for k, v in cpu.items()
                                                if v is not None)
    if p["errors"]:
        line += f"; {p['errors']} errors: {p['error_examples']}"
    return line


def _find(phases: list[dict], runner: str, kind: str, n: int, jf: bool = True) -> dict | None:
    for p in phases:
        if p["runner"] == runner and p["kind"] == kind and p["concurrency"] == n and (
                p["jump_forward"] == jf or runner in ("transformers", "vllm")):
            return p
    return None


def _ratio(a, b):
    return a / b if a is not None and b else None


def comparisons(phases: list[dict], peers: dict) -> list[dict]:
    allp = list(phases)
    for peer in peers.values():
        allp += peer.get("phases", []) if isinstance(peer, dict) else []
    out = []
    seen = []
    for p in allp:
        key = (p["runner"], p["concurrency"])
        if key in seen:
            continue
        seen.append(key)
        runner, n = key
        c, u = _find(allp, runner, "constrained", n), _find(allp, runner, "unconstrained", n)
        if c is None or u is None:
            continue
        row = {"runner": runner, "runner_label": p["runner_label"], "concurrency": n,
               "tpot_ratio_mean": _ratio(_g(c, "tpot_seconds", "mean"), _g(u, "tpot_seconds", "mean")),
               "tpot_ratio_p50": _ratio(_g(c, "tpot_seconds", "p50"), _g(u, "tpot_seconds", "p50")),
               "throughput_ratio": _ratio(c["throughput_tokens_per_second"], u["throughput_tokens_per_second"]),
               "constrained_throughput": c["throughput_tokens_per_second"],
               "unconstrained_throughput": u["throughput_tokens_per_second"]}
        nojf = _find(phases, runner, "constrained", n, jf=False) if runner not in ("transformers", "vllm") else None
        if nojf is not None:
            row["no_jump_forward_tpot_ratio_mean"] = _ratio(_g(nojf, "tpot_seconds", "mean"),
                                                            _g(u, "tpot_seconds", "mean"))
            row["no_jump_forward_throughput"] = nojf["throughput_tokens_per_second"]
            row["no_jump_forward_mask_wait_share"] = _g(nojf, "server", "mask_wait_share")
        if runner == "model":
            for peer in ("transformers", "vllm"):
                same = identical_outputs(nojf, _find(allp, peer, "constrained", n)) if nojf is not None else None
                if same is not None:
                    row[f"identical_outputs_no_jump_forward_vs_{peer}"] = same
                pc = _find(allp, peer, "constrained", n)
                pu = _find(allp, peer, "unconstrained", n)
                if pc is not None:
                    row[f"constrained_throughput_vs_{peer}"] = _ratio(c["throughput_tokens_per_second"],
                                                                      pc["throughput_tokens_per_second"])
                if pu is not None:
                    row[f"unconstrained_throughput_vs_{peer}"] = _ratio(u["throughput_tokens_per_second"],
                                                                        pu["throughput_tokens_per_second"])
        out.append(row)
    return out


def replica_sweep(phases: list[dict], comps: list[dict]) -> list[dict]:
    """Per runner and N, one row per grammar replica count: what the constraint costs with that many replicas
    (mask-wait share, TPOT ratio, overhead per step) and the grammar tier's CPU (cores busy, per replica)."""
    by_runner = {(c["runner"], c["concurrency"]): c for c in comps}
    rows = []
    for c in phases:
        if c["kind"] != "constrained" or not c["jump_forward"] or "server" not in c:
            continue
        n, runner = c["concurrency"], c["runner"]
        k = c.get("grammar_replicas", 1)
        u = _find(phases, runner, "unconstrained", n)
        comp = by_runner.get((runner, n), {})
        grammar_seconds = _g(c, "cpu", "seconds", "grammar")
        cores = grammar_seconds / c["wall_seconds"] if grammar_seconds is not None and c["wall_seconds"] > 0 else None
        rows.append({
            "runner": runner.split("-g")[0], "runner_label": c["runner_label"], "concurrency": n, "grammar_replicas": k,
            "mask_wait_share": _g(c, "server", "mask_wait_share"),
            "mask_wait_p50_seconds": _g(c, "server", "mask_wait_p50_seconds"),
            "mask_wait_p99_seconds": _g(c, "server", "mask_wait_p99_seconds"),
            "tpot_ratio_mean": comp.get("tpot_ratio_mean"), "tpot_ratio_p50": comp.get("tpot_ratio_p50"),
            "overhead_per_step_constrained_seconds": _g(c, "server", "overhead_per_step_seconds"),
            "overhead_per_step_unconstrained_seconds": _g(u, "server", "overhead_per_step_seconds"),
            "forward_mean_constrained_seconds": _g(c, "server", "forward_mean_seconds"),
            "forward_mean_unconstrained_seconds": _g(u, "server", "forward_mean_seconds"),
            "grammar_rpc_p50_seconds": _g(c, "server", "grammar_rpc_p50_seconds"),
            "grammar_step_mean_seconds": _g(c, "grammar_server", "step_mean_seconds"),
            "constrained_throughput": c["throughput_tokens_per_second"],
            "grammar_cores_busy": cores, "grammar_cores_busy_per_replica": cores / k if cores is not None else None,
        })
    return sorted(rows, key=lambda r: (r["runner"], r["concurrency"], r["grammar_replicas"]))


def identical_outputs(a: dict | None, b: dict | None) -> dict | None:
    """How many requests (same position in the same workload) produced the very same token ids."""
    if a is None or b is None or "records" not in a or "records" not in b:
        return None
    da = {r["index"]: r.get("digest") for r in a["records"]}
    db = {r["index"]: r.get("digest") for r in b["records"]}
    common = [i for i in da if i in db and da[i] and db[i]]
    return {"compared": len(common), "identical": sum(da[i] == db[i] for i in common)}


def targets(result: dict, *, target_runner: str, top_n: int, mask_wait_share: float, tpot_ratio: float,
            throughput_vs_transformers: float, vs_vllm: dict[str, float]) -> dict:
    """Each target of the issues as met or not (or why it was not run). vs_vllm: the throughput ratios to
    vLLM's CPU engine (issue 13): throughput_vs_vllm (constrained, jump-forward on),
    unconstrained_throughput_vs_vllm, no_jump_forward_throughput_vs_vllm."""
    comps = {(c["runner"], c["concurrency"]): c for c in result["comparisons"]}
    t: dict = {}
    p = _find(result["phases"], target_runner, "constrained", top_n)
    if p is not None:
        v = _g(p, "server", "mask_wait_share")
        t["mask_wait_share"] = {"where": f"{target_runner}, N={top_n}, constrained", "value": v,
                                "target": f"<= {mask_wait_share}", "met": v is not None and v <= mask_wait_share}
    else:
        t["mask_wait_share"] = {"status": f"not run ({target_runner} at N={top_n})"}
    c = comps.get((target_runner, top_n))
    if c is not None:
        v = c["tpot_ratio_mean"]
        t["tpot_ratio"] = {"where": f"{target_runner}, N={top_n}, mean TPOT constrained / unconstrained", "value": v,
                           "p50_ratio": c["tpot_ratio_p50"], "target": f"<= {tpot_ratio}",
                           "met": v is not None and v <= tpot_ratio}
    else:
        t["tpot_ratio"] = {"status": f"not run ({target_runner} at N={top_n})"}
    c = comps.get(("model", top_n))
    v = c.get("constrained_throughput_vs_transformers") if c else None
    if v is not None:
        t["throughput_vs_transformers"] = {
            "where": f"embedded model, N={top_n}, constrained tokens/s, structd / transformers+xgrammar",
            "value": v, "target": f">= {throughput_vs_transformers}", "met": v >= throughput_vs_transformers}
    else:
        t["throughput_vs_transformers"] = {"status": f"not run (embedded model and transformers peer at N={top_n})"}
    vllm = _find(result["phases"] + result.get("peers", {}).get("vllm", {}).get("phases", []), "vllm",
                 "constrained", top_n)
    cases = {
        "throughput_vs_vllm": ("constrained tokens/s (jump-forward on)", c and c.get("constrained_throughput_vs_vllm")),
        "unconstrained_throughput_vs_vllm": ("unconstrained tokens/s, against vLLM's unconstrained",
                                             c and c.get("unconstrained_throughput_vs_vllm")),
        "no_jump_forward_throughput_vs_vllm": (
            "constrained tokens/s without jump-forward, against vLLM's constrained",
            _ratio(c.get("no_jump_forward_throughput"), vllm["throughput_tokens_per_second"])
            if c and vllm is not None else None),
    }
    for name, (what, v) in cases.items():
        goal = vs_vllm[name]
        t[name] = ({"where": f"embedded model, N={top_n}, {what}, structd / vLLM", "value": v,
                    "target": f">= {goal}", "met": v >= goal} if v is not None
                   else {"status": f"not run (embedded model and vLLM peer at N={top_n}; vLLM needs --vllm-python)"})
    return t


# --- output -------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    lines = [f"## {result.get('title', 'structd bench e2e')}", ""]
    lines.append("| runner | N | workload | requests | tokens/req | TTFT p50 ms | TPOT mean ms | TPOT p50 ms | tokens/s "
                 "| mask-wait share | mask wait p50 ms | grammar step ms | forward ms | overhead/step ms | mean batch | forced |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    peer_phases = [p for peer in result["peers"].values() if isinstance(peer, dict) for p in peer.get("phases", [])]
    for p in result["phases"] + peer_phases:
        s = p.get("server", {})
        kind = p["kind"] + ("" if p["jump_forward"] or p["runner"] in ("transformers", "vllm") else ", no JF")
        err = f" ({p['errors']} errors)" if p["errors"] else ""
        if s:
            server_cols = (f"{_fmt_pct(s.get('mask_wait_share'))} | {_fmt_ms(s.get('mask_wait_p50_seconds'))} | "
                           f"{_fmt_ms(_g(p, 'grammar_server', 'step_mean_seconds'))} | "
                           f"{_fmt_ms(s.get('forward_mean_seconds'))} | {_fmt_ms(s.get('overhead_per_step_seconds'))}"
                           f" | {s.get('mean_batch') or 0:.1f} | {_fmt_pct(p['forced_share'])}")
        else:
            server_cols = "– | – | – | – | – | – | –"
        lines.append(
            f"| {p['runner_label']} | {p['concurrency']} | {kind} | {p['requests']}{err} | "
            f"{_g(p, 'tokens_per_request', 'mean', default=0):.1f} | {_fmt_ms(_g(p, 'ttft_seconds', 'p50'))} | "
            f"{_fmt_ms(_g(p, 'tpot_seconds', 'mean'))} | {_fmt_ms(_g(p, 'tpot_seconds', 'p50'))} | "
            f"{p['throughput_tokens_per_second'] or 0:.0f} | {server_cols} |")
    lines += ["", ("| runner | N | TPOT constrained/unconstrained (mean) | (p50) | throughput c/u | "
                   "no-JF TPOT / unconstrained | constrained tok/s vs transformers | vs vLLM |"),
              "|---|---|---|---|---|---|---|---|"]

    def r(x):
        return "–" if x is None else f"{x:.2f}"

    for c in result["comparisons"]:
        lines.append(f"| {c['runner_label']} | {c['concurrency']} | {r(c['tpot_ratio_mean'])} | {r(c['tpot_ratio_p50'])}"
                     f" | {r(c['throughput_ratio'])} | {r(c.get('no_jump_forward_tpot_ratio_mean'))} | "
                     f"{r(c.get('constrained_throughput_vs_transformers'))} | "
                     f"{r(c.get('constrained_throughput_vs_vllm'))} |")
    hosted = [p for p in result["phases"] if p.get("server", {}).get("host_phase_mean_seconds")]
    if hosted:
        # The step loop's own work (inference_svc_step_host_seconds), the "overhead/step" above taken apart.
        lines += ["", "| runner | N | workload | " + " | ".join(f"{k} µs" for k in HOST_PHASES)
                  + " | sum µs/step | µs per row |", "|---|---|---|" + "---|" * (len(HOST_PHASES) + 2)]
        for p in hosted:
            mean = p["server"]["host_phase_mean_seconds"]
            per_row = p["server"].get("host_phase_per_row_seconds")
            kind = p["kind"] + ("" if p["jump_forward"] else ", no JF")
            lines.append(f"| {p['runner_label']} | {p['concurrency']} | {kind} | "
                         + " | ".join("–" if mean[k] is None else f"{mean[k] * 1e6:.0f}" for k in HOST_PHASES)
                         + f" | {sum(v for v in mean.values() if v is not None) * 1e6:.0f} | "
                         + (f"{sum(per_row.values()) * 1e6:.1f} |" if per_row else "– |"))
    sweep = result.get("grammar_replica_sweep", [])
    if len({row["grammar_replicas"] for row in sweep}) > 1:
        lines += ["", ("| runner | N | grammar replicas | mask-wait share | mask wait p99 ms | TPOT c/u (mean) | "
                       "overhead/step c ms | overhead/step u ms | grammar RPC p50 ms | grammar step ms | "
                       "grammar cores busy | per replica | constrained tok/s |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for w in sweep:
            lines.append(
                f"| {w['runner']} | {w['concurrency']} | {w['grammar_replicas']} | {_fmt_pct(w['mask_wait_share'])} | "
                f"{_fmt_ms(w['mask_wait_p99_seconds'])} | {r(w['tpot_ratio_mean'])} | "
                f"{_fmt_ms(w['overhead_per_step_constrained_seconds'])} | "
                f"{_fmt_ms(w['overhead_per_step_unconstrained_seconds'])} | {_fmt_ms(w['grammar_rpc_p50_seconds'])} | "
                f"{_fmt_ms(w['grammar_step_mean_seconds'])} | {r(w['grammar_cores_busy'])} | "
                f"{r(w['grammar_cores_busy_per_replica'])} | {w['constrained_throughput'] or 0:.0f} |")
    vllm = result["peers"].get("vllm", {})
    if vllm.get("status") != "ok":
        ref = vllm.get("reference_tpot_ratio_from_issue")
        lines.append("")
        lines.append(f"vLLM peer: {vllm.get('status')}" + (
            f"; the issue reports its TPOT ratio on this model as {ref} (not measured here)" if ref else ""))
    lines.append("")
    for k, v in result["targets"].items():
        if "value" in v:
            met = v.get("met")
            lines.append(f"- target {k} ({v['where']}): {r(v['value'])} {v['target']}: "
                         + ("met" if met else ("missed" if met is False else "reported")))
        else:
            lines.append(f"- target {k}: {v['status']}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """The four panels into `path`; with several grammar replica counts, their sweep beside it."""
    if len(result["arguments"]["grammar_replicas"]) > 1:
        plot_replica_sweep(result, path.with_name("e2e-grammar-replicas.png"))
    fig, axes = pyplot().subplots(2, 2, figsize=(15, 10))
    phases = result["phases"]
    peers = {k: v for k, v in result["peers"].items() if isinstance(v, dict) and v.get("phases")}
    runners = list(dict.fromkeys(p["runner"] for p in phases)) + list(peers)
    allp = phases + [p for v in peers.values() for p in v["phases"]]
    labels = {p["runner"]: p["runner_label"] for p in allp}
    colors = {r: f"C{i}" for i, r in enumerate(runners)}

    ax = axes[0][0]
    for rn in runners:
        for kind, ls, mk in (("constrained", "-", "o"), ("unconstrained", "--", "s")):
            pts = sorted((p["concurrency"], _g(p, "tpot_seconds", "mean")) for p in allp
                         if p["runner"] == rn and p["kind"] == kind and (p["jump_forward"] or rn in peers))
            pts = [(n, v * MS) for n, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts), ls, marker=mk, color=colors[rn], label=f"{labels[rn]} {kind}")
    ax.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="mean TPOT (ms)",
           title="Time per output token: constrained (solid) vs unconstrained (dashed)")
    from matplotlib.ticker import LogLocator, ScalarFormatter

    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    _xticks(ax, result)
    _legend(ax)

    ax = axes[0][1]
    for rn in runners:
        pts = sorted((c["concurrency"], c["tpot_ratio_mean"]) for c in result["comparisons"]
                     if c["runner"] == rn and c["tpot_ratio_mean"] is not None)
        if pts:
            ax.plot(*zip(*pts), "o-", color=colors[rn], label=labels[rn])
        nojf = [(c["concurrency"], c["no_jump_forward_tpot_ratio_mean"]) for c in result["comparisons"]
                if c["runner"] == rn and c.get("no_jump_forward_tpot_ratio_mean") is not None]
        if nojf:
            ax.plot(*zip(*nojf), "x", ms=10, color=colors[rn], label=f"{labels[rn]} without jump-forward")
    ref = result["peers"].get("vllm", {}).get("reference_tpot_ratio_from_issue")
    if ref and "vllm" not in peers:
        pts = [(int(k), v) for k, v in ref.items() if int(k) in result["arguments"]["concurrency"]]
        if pts:
            ax.plot(*zip(*pts), "k^:", label="vLLM CPU (reported in the issue)")
    ax.axhline(1.05, color="grey", lw=0.8, ls=":")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set(xscale="log", xlabel="concurrent requests", ylabel="mean TPOT constrained / unconstrained",
           title="Cost of the constraint (target <= 1.05)")
    _xticks(ax, result)
    _legend(ax)

    ax = axes[1][0]
    for rn in dict.fromkeys(p["runner"] for p in phases):
        pts = sorted((p["concurrency"], _g(p, "server", "mask_wait_share")) for p in phases
                     if p["runner"] == rn and p["kind"] == "constrained" and p["jump_forward"])
        pts = [(n, v * 100) for n, v in pts if v is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", color=colors[rn], label=labels[rn])
    ax.axhline(3.0, color="grey", lw=0.8, ls=":")
    ax.set_ylim(bottom=0)
    ax.set(xscale="log", xlabel="concurrent requests", ylabel="% of forward time",
           title="Mask wait (constrained workload; target <= 3% at 32 on simulated 5 ms)")
    _xticks(ax, result)
    _legend(ax)

    ax = axes[1][1]
    bar_runners = [r for r in ["model"] + list(peers) if any(p["runner"] == r for p in allp)]
    ns = result["arguments"]["concurrency"]
    x = np.arange(len(ns))
    width = 0.8 / max(1, 2 * len(bar_runners))
    k = 0
    for rn in bar_runners:
        for kind, hatch in (("constrained", ""), ("unconstrained", "//")):
            vals = [(_find(allp, rn, kind, n) or {}).get("throughput_tokens_per_second") or 0.0 for n in ns]
            ax.bar(x - 0.4 + width * (k + 0.5), vals, width, color=colors[rn], hatch=hatch, alpha=0.85,
                   label=f"{labels[rn]} {kind}")
            k += 1
    ax.set_xticks(x, [str(n) for n in ns])
    ax.set(xlabel="concurrent requests", ylabel="output tokens / s",
           title="Throughput on the embedded model: structd vs peers")
    _legend(ax)

    fig.suptitle(result.get("title", "structd bench e2e"), fontsize=10)
    save_figure(fig, path)


def plot_replica_sweep(result: dict, path: Path) -> None:
    """Mask-wait share and TPOT ratio against the number of grammar replicas, one line per runner and N."""
    sweep = result["grammar_replica_sweep"]
    fig, axes = pyplot().subplots(1, 3, figsize=(16, 5))
    lines = sorted({(w["runner"], w["concurrency"]) for w in sweep})
    panels = (("mask_wait_share", 100.0, "mask wait, % of forward time", 3.0),
              ("tpot_ratio_mean", 1.0, "mean TPOT constrained / unconstrained", 1.05),
              ("overhead_per_step_constrained_seconds", MS, "overhead per step, constrained (ms)", None))
    for ax, (key, scale, ylabel, target) in zip(axes, panels):
        for i, (runner, n) in enumerate(lines):
            pts = [(w["grammar_replicas"], w[key] * scale) for w in sweep
                   if (w["runner"], w["concurrency"]) == (runner, n) and w[key] is not None]
            if pts:
                ax.plot(*zip(*sorted(pts)), "o-", color=f"C{i}", label=f"{runner}, N={n}")
        if target is not None:
            ax.axhline(target, color="grey", lw=0.8, ls=":")
        counts = sorted({w["grammar_replicas"] for w in sweep})
        ax.set_xticks(counts, [str(k) for k in counts])
        ax.set(xlabel="grammar replicas", ylabel=ylabel)
        ax.set_ylim(bottom=0)
        _legend(ax)
    fig.suptitle(f"Grammar replicas: {result.get('title', 'structd bench e2e')}", fontsize=10)
    save_figure(fig, path)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _xticks(ax, result: dict) -> None:
    ns = result["arguments"]["concurrency"]
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
