"""The device check's record: each step's summary from its bench output, and the JSON, markdown, PNG and tarball.

The bench results are read from their JSON by key with defaults (a key a
bench renames shows as "–", it does not stop the report) rather than through
the benches' own report helpers: nothing outside structd/ and tests/ imports
structd/, and the check must still report when a bench changes under it. The
markdown is laid out to be pasted under docs/benchmarks.md's "On a GPU"
section as it is.
"""

from __future__ import annotations

import json
import re
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

from device_plan import MASK_WAIT_TARGET, PHASES, TPOT_RATIO_TARGET

HOST_PHASES = ("schedule", "grammar_send", "plan", "sample", "emit")
FILES = ("device-check.json", "device-check.md", "device-check.png", "device-check-results.tar.gz")


def _get(d, *path, default=None):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def _ms(x) -> str:
    return "–" if x is None else f"{x * 1e3:.2f}"


def _pct(x) -> str:
    return "–" if x is None else f"{x * 100:.1f}%"


def _num(x, fmt="{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


# --- summaries of each kind of step's output -------------------------------------------------------


# A test's outcome line in `pytest -v` output: "tests/x.py::name[id] PASSED  [ 10%]", a skip's reason after it.
_VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \((.*)\))?")


def summarize_pytest(junit: Path, stdout: Path | None = None) -> dict:
    """Counts and the names of failed and skipped tests (with the skip reason) from pytest's JUnit XML; without
    it (pytest cut off at the step's timeout writes none), from the `-v` lines of what it printed so far."""
    if not junit.is_file():
        if stdout is not None and stdout.is_file():
            return _summarize_verbose(stdout.read_text(errors="replace"))
        return {"note": "no junit.xml (pytest did not get to write it)"}
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": []}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".rsplit(".", 1)[-1]
        if (f := case.find("failure")) is not None or (f := case.find("error")) is not None:
            out["failed" if f.tag == "failure" else "errors"] += 1
            out["failures"].append({"test": name, "message": (f.get("message") or "")[:400]})
        elif (s := case.find("skipped")) is not None:
            out["skipped"] += 1
            out["skips"].append({"test": name, "reason": (s.get("message") or "")[:200]})
        else:
            out["passed"] += 1
    return out


def _summarize_verbose(text: str) -> dict:
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": [],
           "note": "from pytest's output: it was cut off before writing junit.xml"}
    for line in text.splitlines():
        if not (m := _VERBOSE_LINE.match(line.strip())):
            continue
        name, outcome, reason = m.groups()
        test = name.rsplit("/", 1)[-1]
        if outcome in ("PASSED", "XFAIL", "XPASS"):
            out["passed"] += 1
        elif outcome == "SKIPPED":
            out["skipped"] += 1
            out["skips"].append({"test": test, "reason": (reason or "")[:200]})
        else:
            out["failed" if outcome == "FAILED" else "errors"] += 1
            out["failures"].append({"test": test, "message": outcome})
    return out


def summarize_e2e(result: Path) -> dict:
    """Per (runner, grammar replicas, N): constrained vs unconstrained TPOT, throughput, TTFT, mask-wait share,
    the forward and the host work per step."""
    if not result.is_file():
        return {"note": f"no {result.name}"}
    data = json.loads(result.read_text())
    rows: dict[tuple, dict] = {}
    for p in data.get("phases", []):
        key = (p.get("runner"), p.get("grammar_replicas", 1), p.get("concurrency"))
        row = rows.setdefault(key, {"runner": p.get("runner_label") or p.get("runner"), "grammar_replicas": key[1],
                                    "concurrency": key[2]})
        kind = p.get("kind")
        if kind not in ("constrained", "unconstrained") or not p.get("jump_forward", True):
            continue
        server = p.get("server") or {}
        host = server.get("host_phase_mean_seconds") or {}
        row[kind] = {
            "tpot_mean_seconds": _get(p, "tpot_seconds", "mean"),
            "ttft_p50_seconds": _get(p, "ttft_seconds", "p50"),
            "tokens_per_second": p.get("throughput_tokens_per_second"),
            "errors": p.get("errors", 0),
            "mask_wait_share": server.get("mask_wait_share"),
            "forward_mean_seconds": server.get("forward_mean_seconds"),
            "overhead_per_step_seconds": server.get("overhead_per_step_seconds"),
            "mean_batch": server.get("mean_batch"),
            "host_seconds": {k: host.get(k) for k in HOST_PHASES if host.get(k) is not None},
        }
    out = []
    for row in rows.values():
        c, u = _get(row, "constrained", "tpot_mean_seconds"), _get(row, "unconstrained", "tpot_mean_seconds")
        row["tpot_ratio"] = c / u if c and u else None
        out.append(row)
    return {"rows": out, "duration_seconds": data.get("duration_seconds")}


def summarize_peer(result: Path) -> dict:
    """hf_peer.py writes its rows as summarize_e2e returns structd's."""
    if not result.is_file():
        return {"note": f"no {result.name}"}
    return json.loads(result.read_text())


def summarize_grammar(result: Path) -> dict:
    if not result.is_file():
        return {"note": f"no {result.name}"}
    data = json.loads(result.read_text())
    fill_threads = _get(data, "arguments", "fill_threads")
    rows = [{"batch": w.get("batch"), "fill_threads": fill_threads,
             "rtt_p50_seconds": _get(w, "step_rtt_seconds", "p50"),
             "rtt_p99_seconds": _get(w, "step_rtt_seconds", "p99"),
             "server_step_p50_seconds": _get(w, "server_step_seconds", "p50"),
             "fill_p50_seconds": _get(w, "server_fill_seconds", "p50")} for w in data.get("walks", [])]
    return {"rows": rows, "compile": _get(data, "compile", "counts", default=None)}


def summarize_attention(result: Path) -> dict:
    """structd bench attention's shapes: per backend, the context build and one layer's attention (µs)."""
    if not result.is_file():
        return {"note": f"no {result.name}"}
    data = json.loads(result.read_text())
    return {"backends": data.get("backends", []), "rows": data.get("shapes", [])}


def summarize_json_line(stdout: Path) -> dict:
    """The last JSON object a step printed on stdout (versions.py, random_llama.py)."""
    if stdout.is_file():
        for line in reversed(stdout.read_text(errors="replace").splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    break
    return {}


# --- markdown ----------------------------------------------------------------------------------------


def _versions_line(record: dict) -> str:
    v = record.get("environment", {})
    versions = v.get("versions", {})
    device = v.get("device_name") or "no CUDA device"
    memory = f", {v['device_memory_bytes'] / 1024**3:.0f} GiB" if v.get("device_memory_bytes") else ""
    libs = ", ".join(f"{k} {versions.get(k)}" for k in ("torch", "transformers", "triton", "xgrammar", "grpcio",
                                                         "protobuf") if versions.get(k))
    return (f"{device}{memory}, {v.get('cpus', '?')} CPUs, Python {v.get('python', '?')}, CUDA "
            f"{v.get('torch_cuda') or '–'}; {libs}")


def _runner(step: dict, row: dict) -> str:
    # The bench names its model runner after the embedded model; the check serves its random one instead.
    return "the random model" if "STRUCTD_INFERENCE_MODEL" in (step.get("env") or {}) else str(row.get("runner"))


def _e2e_table(steps: list[dict]) -> list[str]:
    lines = ["| run | runner | grammar replicas | N | TPOT c / u ms | ratio | tok/s c / u | TTFT p50 c ms | "
             "mask-wait share | forward ms | host µs/step (sample) | overhead/step ms | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in steps:
        for row in _get(s, "summary", "rows", default=[]):
            runner = _runner(s, row)
            c, u = row.get("constrained") or {}, row.get("unconstrained") or {}
            host = c.get("host_seconds") or {}
            host_us = sum(host.values()) * 1e6 if host else None
            sample_us = host["sample"] * 1e6 if host.get("sample") is not None else None
            lines.append(
                f"| {s.get('label') or s['name']} | {runner} | {row.get('grammar_replicas')} | "
                f"{row.get('concurrency')} | {_ms(c.get('tpot_mean_seconds'))} / {_ms(u.get('tpot_mean_seconds'))} | "
                f"{_num(row.get('tpot_ratio'))} | {_num(c.get('tokens_per_second'), '{:.0f}')} / "
                f"{_num(u.get('tokens_per_second'), '{:.0f}')} | {_ms(c.get('ttft_p50_seconds'))} | "
                f"{_pct(c.get('mask_wait_share'))} | {_ms(c.get('forward_mean_seconds'))} | "
                f"{_num(host_us, '{:.0f}')} ({_num(sample_us, '{:.0f}')}) | "
                f"{_ms(c.get('overhead_per_step_seconds'))} | {c.get('errors', 0) + u.get('errors', 0)} |")
    return lines


def host_targets(steps: list[dict]) -> list[str]:
    """The issue's simulated-2 ms targets, met or not, from the host phase's runs."""
    lines = []
    for s in steps:
        for row in _get(s, "summary", "rows", default=[]):
            if "2 ms" not in str(row.get("runner")) or row.get("grammar_replicas") not in TPOT_RATIO_TARGET:
                continue
            target = TPOT_RATIO_TARGET[row["grammar_replicas"]]
            ratio, wait = row.get("tpot_ratio"), _get(row, "constrained", "mask_wait_share")
            verdict = ("met" if ratio is not None and ratio <= target and wait is not None and wait <= MASK_WAIT_TARGET
                       else "missed" if ratio is not None else "not measured")
            lines.append(f"- simulated 2 ms, {row['grammar_replicas']} grammar replica(s), "
                         f"N = {row.get('concurrency')}:"
                         f" TPOT ratio {_num(ratio)} (target ≤ {target:.2f}), mask-wait {_pct(wait)} (target ≤ "
                         f"{MASK_WAIT_TARGET:.0%}): **{verdict}**")
    return lines


def markdown(record: dict) -> str:
    steps = record["steps"]
    out = [f"#### Device check, {record['started'][:10]} ({record['mode']})", "",
           f"Machine: {_versions_line(record)}. Commit {record.get('commit') or '?'}; run "
           f"{record.get('seconds', 0):.0f} s of a {record['budget_seconds']:.0f} s budget.", "",
           "| phase | step | status | seconds | note |", "|---|---|---|---|---|"]
    for s in steps:
        out.append(f"| {s['phase']} | {s.get('label') or s['name']} | {s['status']} | {s.get('seconds', 0):.0f} | "
                   f"{(s.get('note') or '').replace('|', '/')[:160]} |")
    for phase in PHASES[1:]:
        mine = [s for s in steps if s["phase"] == phase.name]
        if not mine:
            continue
        out += ["", f"##### {phase.title}", "", phase.what + ".", ""]
        if phase.name == "correctness":
            for s in mine:
                sm = s.get("summary") or {}
                out.append(f"{sm.get('passed', 0)} passed, {sm.get('failed', 0)} failed, {sm.get('errors', 0)} errors,"
                           f" {sm.get('skipped', 0)} skipped.")
                out += [f"- FAILED {f['test']}: {f['message']}" for f in sm.get("failures", [])]
                reasons = sorted({k["reason"] for k in sm.get("skips", [])})
                out += [f"- skipped: {r}" for r in reasons]
        for s in (s for s in mine if s.get("kind") == "attention"):
            out += _attention_table(s.get("summary") or {})
        e2e = [s for s in mine if s.get("kind") in ("e2e", "peer")]
        if e2e:
            out += _e2e_table(e2e)
        if phase.name == "host":
            targets = host_targets(e2e)
            if targets:
                out += ["", *targets]
            grammar = [s for s in mine if s.get("kind") == "grammar"]
            if grammar:
                out += ["", "| fill threads | sessions per step | RTT p50 ms | RTT p99 ms | server step p50 ms | "
                        "fill p50 ms |", "|---|---|---|---|---|---|"]
                for s in grammar:
                    for r in _get(s, "summary", "rows", default=[]):
                        out.append(f"| {r.get('fill_threads')} | {r.get('batch')} | {_ms(r.get('rtt_p50_seconds'))} | "
                                   f"{_ms(r.get('rtt_p99_seconds'))} | {_ms(r.get('server_step_p50_seconds'))} | "
                                   f"{_ms(r.get('fill_p50_seconds'))} |")
    return "\n".join(out) + "\n"


def _attention_table(summary: dict) -> list[str]:
    backends = summary.get("backends") or ["sdpa"]
    lines = ["", "| batch | context | " + " | ".join(f"{b} build + attention µs" for b in backends) + " |",
             "|---|---|" + "---|" * len(backends)]
    for r in summary.get("rows", []):
        cells = [f"{r.get(f'{b}_build_us')} + {r.get(f'{b}_attention_us')}" for b in backends]
        lines.append(f"| {r.get('batch')} | {r.get('context')} | " + " | ".join(cells) + " |")
    return lines


# --- the PNG -------------------------------------------------------------------------------------


def plot(record: dict, path: Path) -> None:
    """Each step's seconds by status, and the constrained/unconstrained TPOT ratio of every e2e row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = record["steps"]
    colors = {"ok": "tab:green", "failed": "tab:red", "timeout": "tab:orange", "skipped": "tab:gray"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, max(3.0, 0.32 * len(steps) + 1)))
    names = [s["name"] for s in steps][::-1]
    a.barh(names, [s.get("seconds", 0) for s in steps][::-1],
           color=[colors.get(s["status"], "tab:blue") for s in steps][::-1])
    a.set_xlabel("seconds (green ok, red failed, orange timeout, grey skipped)")
    a.set_title(f"device check: {record.get('environment', {}).get('device_name') or record['mode']}")
    labels, ratios = [], []
    for s in steps:
        for row in _get(s, "summary", "rows", default=[]):
            if row.get("tpot_ratio") is not None:
                labels.append(f"{s['name']} {_runner(s, row)} N={row.get('concurrency')}")
                ratios.append(row["tpot_ratio"])
    if ratios:
        b.barh(labels[::-1], ratios[::-1], color="tab:blue")
        for target in sorted(set(TPOT_RATIO_TARGET.values())):
            b.axvline(target, color="tab:red", lw=0.8, ls="--")
        b.tick_params(axis="y", labelsize=6)
    b.set_xlabel("TPOT constrained / unconstrained (dashed: the host-path targets)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(record: dict, out: Path, work: Path) -> None:
    """Writes every output file (each time a step ends, so a run cut off still leaves what it finished)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / FILES[0]).write_text(json.dumps(record, indent=1, default=str))
    (out / FILES[1]).write_text(markdown(record))
    try:
        plot(record, out / FILES[2])
    except Exception as e:  # noqa: BLE001 - a missing matplotlib or a bad figure must not lose the JSON
        record["plot_error"] = f"{type(e).__name__}: {e}"[:300]
    # The benches' own JSON, PNG and logs, and each step's output: everything but model weights and caches.
    tmp = out / (FILES[3] + ".part")
    with tarfile.open(tmp, "w:gz") as tar:
        for step in record["steps"]:
            folder = work / step["name"]
            if folder.is_dir():
                for f in sorted(folder.rglob("*")):
                    if f.is_file() and f.suffix in (".json", ".png", ".log", ".xml", ".md", ".txt", ".stdout"):
                        tar.add(f, arcname=str(f.relative_to(work)))
    tmp.replace(out / FILES[3])
