"""`structd bench soak` end to end in a very short run (not a timing test), and its pure parts.

Through the CLI entry point, one run for the module: 16 streams for 8 s on the
simulated runner, one grammar replica SIGKILLed at 4 s and started again on
its port, issue 24's hostile requests mixed in at 1/s. Checks the JSON's
structure and that its numbers are plausible (the books balance, KV blocks and
grammar sessions all returned once the load stopped), the hostile requests'
refusals, the memory watch, the PNG and the markdown. The real soak and its
numbers are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import signal
import subprocess
import threading
from collections import Counter
from pathlib import Path

import pytest

from structd.bench import soak as bench_soak
from structd.bench import soak_hostile as bench_soak_hostile
from structd.bench import soak_memory as bench_soak_memory
from structd.bench import soak_report as bench_soak_report
from structd import cli


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> tuple[dict, Path, str, str]:
    """`structd bench soak` through the CLI entry point, sampling every second: (its JSON, its folder, stdout,
    stderr). One run serves both checks below (a stack's start and stop cost as much as the load itself): the
    restart and the hostile requests share it, and losing no ordinary request holds with both (a restart costs
    the requests on the killed replica time only: docs/benchmarks.md, "Soak")."""
    out = tmp_path_factory.mktemp("soak")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = cli.main(["bench", "soak", "--out", str(out), "--sample-seconds", "1", "--settle-seconds", "20",
                       "--duration-seconds", "8", "--streams", "16", "--restart-every-seconds", "4",
                       "--hostile-rate", "1", "--max-tokens", "32", "--warmup-seconds", "3", "--progress-seconds", "3",
                       "--request-timeout-seconds", "60"])
    assert rc == 0, stderr.getvalue()[-3000:]
    return json.loads((out / "soak.json").read_text()), out, stdout.getvalue(), stderr.getvalue()


def test_short_soak_through_the_cli_writes_plausible_json_and_png(soak):
    result, out_dir, out, err = soak
    png = out_dir / "soak.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    q = result["requests"]
    assert q["completed"] > 16 and q["cancelled_by_client"] >= 0
    assert q["started"] == q["completed"] + q["cancelled_by_client"] + q["lost"], q
    assert q["lost"] == sum(q["lost_by_status"].values()) and set(q["lost_examples"]) <= set(q["lost_by_status"])
    # Losses are what the soak measures (docs/benchmarks.md), but one restart must not lose most of the load.
    assert q["lost"] < q["started"] / 2, q
    assert set(q["by_kind"]) <= {"unconstrained", "json_schema", "regex", "choice"} and q["by_kind"]["unconstrained"]
    assert set(q["finish_reasons"]) <= {"stop", "length", "stop_string", "cancelled", "error"}
    assert q["invalid_outputs"] == sum(q["invalid_outputs_by_reason"].values()) < q["completed"]

    [restart] = result["restarts"]
    assert restart["replica"] == 1 and restart["signal"] == "SIGKILL" and restart["exit_code"] == -9
    assert restart["restarted"] and 0 < restart["down_seconds"] < 120 and 3.5 < restart["t"] < 8

    # Once the load has stopped, every KV block and grammar session is back.
    e = result["end_state"]
    assert e["kv_cache_usage_ratio"] == 0 and e["running"] == 0 and e["waiting"] == 0, e
    assert e["leaked_sessions"] == 0 and e["grammar_active_sessions"] == [0, 0], e

    r = result["rss"]
    assert r["samples"] >= 5 and 50 < r["start_mib"] < 16384 and r["max_mib"] >= r["end_mib"] > 50
    assert r["warmup_seconds"] == 3 and r["growth_after_warmup_mib"] == pytest.approx(r["end_mib"] - r["after_warmup_mib"])
    assert r["max_mib"] >= r["after_warmup_mib"]
    t = result["throughput"]
    assert t["tokens"] > 0 and t["tokens_per_second_mean"] > 0 and t["load_seconds"] >= 8
    load = [s for s in result["samples"] if not s.get("settle")]
    assert len(load) >= 6 and any(s["tokens_per_second"] for s in load)
    assert [s["t"] for s in result["samples"]] == sorted(s["t"] for s in result["samples"])
    assert result["machine"]["logical_cpus"] >= 1 and result["inference_counters"]
    assert result["faults_seen"] == bool(q["lost"])

    assert "| requests lost to faults |" in out and "KILL r1 at 4 s" in out
    assert len(re.findall(r"\] t=\d+ s: ", err)) >= 2 and "restart 1: SIGKILL to grammar replica 1" in err


def test_hostile_requests_mixed_in_are_refused_and_lose_no_ordinary_request(soak):
    """Issue 24's hostile cases at 1/s beside the 16 streams: every hostile request is refused INVALID_ARGUMENT
    and counted apart, no ordinary request is lost, and the memory watch reports every process of the stack,
    workers (and the restarted replica's new server) included."""
    result, _, out, _ = soak
    q, h = result["requests"], result["hostile"]
    assert q["lost"] == 0 and q["completed"] > 0, q["lost_examples"]
    assert h["expected_status"] == "INVALID_ARGUMENT" and h["unexpected"] == 0, h["cases"]
    assert set(h["cases"]) == set(bench_soak_hostile.CASES)
    assert all(c["sent"] >= 1 and c["refused_as_expected"] == c["sent"] for c in h["cases"].values()), h["cases"]
    assert h["sent"] == h["refused_as_expected"] >= 6
    servers = Counter(f"grammar replica {r['replica']}" for r in result["restarts"] if r["restarted"])

    m = result["memory"]
    assert set(m["by_service"]) == {"inference", "grammar replica 1", "grammar replica 2"}
    for service, s in m["by_service"].items():
        # The largest process's VmHWM may pass the sum of RSS at any sample: it is its peak between samples too.
        assert s["peak_process_mib"] > 50 and s["peak_total_mib"] > 50, (service, s)
    roles = Counter((p["service"], p["role"]) for p in m["processes"])
    # The inference server (on the simulated runner its engine core runs in it), each replica (a restarted one's
    # second server too) and its workers.
    assert roles[("inference", "server")] == 1
    for replica in ("grammar replica 1", "grammar replica 2"):
        assert roles[(replica, "server")] == 1 + servers[replica] and roles[(replica, "worker")] >= 2, roles
        assert m["by_service"][replica]["peak_worker_mib"] > 0
    assert result["first_chunk_seconds"]["count"] > 0
    assert "| hostile requests sent / refused INVALID_ARGUMENT / anything else |" in out
    assert "| peak RSS, grammar replica 2: largest process" in out


def test_the_memory_watch_finds_children_started_from_any_thread(tmp_path):
    """A pool's worker is started by the thread that submitted to it, and /proc lists it under that thread only."""
    started, done = threading.Event(), threading.Event()
    children: list[subprocess.Popen] = []

    def start_one() -> None:
        children.append(subprocess.Popen(["sleep", "60"]))
        started.set()
        done.wait()  # the thread lives on, as a pool's does

    thread = threading.Thread(target=start_one)
    thread.start()
    try:
        started.wait()
        watch = bench_soak_memory.MemoryWatch()
        watch.sample(0.0, {"this test": os.getpid()})
        roles = {p["pid"]: p["role"] for p in watch.processes.values()}
        assert roles[os.getpid()] == "server" and roles[children[0].pid] == "worker"
        assert watch.figures()["by_service"]["this test"]["processes_seen"] >= 2
    finally:
        children[0].kill()
        children[0].wait()
        done.set()
        thread.join()


def test_restarts_alternate_replicas_and_each_replica_alternates_signals():
    plan = [bench_soak.restart_plan(k) for k in range(6)]
    assert plan == [(0, signal.SIGKILL), (1, signal.SIGTERM), (0, signal.SIGTERM), (1, signal.SIGKILL),
                    (0, signal.SIGKILL), (1, signal.SIGTERM)]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_soak.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_workload_mixes_kinds_lengths_and_cancels():
    args = _args("--min-tokens", "4", "--max-tokens", "40", "--cancel-fraction", "0.25")
    rng = random.Random(1)
    reqs = [bench_soak.next_request(rng, args) for _ in range(2000)]
    kinds = {k: sum(r.kind == k for r in reqs) / len(reqs) for k in ("unconstrained", "json_schema", "regex", "choice")}
    assert 0.35 < kinds["unconstrained"] < 0.45 and all(0.15 < kinds[k] < 0.25 for k in ("json_schema", "regex", "choice"))
    assert 0.2 < sum(bool(r.cancel_after) for r in reqs) / len(reqs) < 0.3
    assert {r.options["max_tokens"] for r in reqs} == set(range(4, 41))
    assert all(r.cancel_after <= max(1, r.options["max_tokens"] // 2) for r in reqs)
    assert len({r.options.get("regex") for r in reqs if r.kind == "regex"}) > 50  # distinct grammars: compiles
    assert len({len(r.prompt.split()) for r in reqs}) > 40
    # Same seed, same workload.
    assert bench_soak.next_request(random.Random(1), args) == reqs[0]


def test_outputs_are_checked_against_their_constraint():
    choice = bench_soak.SoakRequest("choice", "p", {"choice": ["yes", "no"]}, 0)
    assert choice.problem("yes") is None and choice.problem("yes!") == "choice: not one of the choices"
    regex = bench_soak.SoakRequest("regex", "p", {"regex": "[a-z]{3}-[0-9]{3,6}"}, 0)
    assert regex.problem("abc-1234") is None and regex.problem("abc-12") == "regex: no match"
    schema = bench_soak.SoakRequest("json_schema", "p", {"json_schema": "{}"}, 0)
    assert schema.problem('{"a":"b"}') is None and schema.problem('{"a":') == "json_schema: not JSON"
    assert schema.problem('{"a":"\x04"}') == "json_schema: raw control character in a string"
    assert bench_soak.SoakRequest("unconstrained", "p", {}, 0).problem("anything") is None


def test_rss_growth_is_measured_after_warm_up():
    mib = bench_soak_report.MIB
    # 150 MiB during warm-up, then 100 + t MiB, with +-20 MiB noise on every other sample.
    samples = [{"t": float(t), "rss_bytes": (150 if t < 10 else 100 + t + (20 if t % 4 else -20)) * mib}
               for t in range(0, 61, 2)]
    r = bench_soak_report.rss_figures(samples, warmup_seconds=10)
    assert r["start_mib"] == 150 and r["window_seconds"] == 10 and r["max_mib"] == 178
    assert r["after_warmup_mib"] == 115 and r["end_mib"] == 155 and r["growth_after_warmup_mib"] == 40
    assert r["slope_after_warmup_mib_per_minute"] == pytest.approx(60.0, rel=0.15)
    rated = bench_soak_report.with_rates([{"t": 0.0, "tokens": 0, "completed": 0},
                                          {"t": 2.0, "tokens": 100, "completed": 4}])
    assert rated[0]["tokens_per_second"] is None and rated[1]["tokens_per_second"] == 50
    assert rated[1]["completed_per_second"] == 2


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit, match="--min-tokens"):
        bench_soak.check_arguments(_args("--min-tokens", "9", "--max-tokens", "4"))
    with pytest.raises(SystemExit, match="simulated runner"):
        bench_soak.check_arguments(_args("--simulate-step-ms", "0"))
