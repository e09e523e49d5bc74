"""`structd bench soak`: the whole stack under constant churn and grammar replica restarts (docs/benchmarks.md).

Two grammar replicas and an inference server on the simulated runner (random
logits after --simulate-step-ms; the engine, scheduler, KV accounting and
grammar path are the real ones) run as child processes on loopback. --streams
client streams run a closed loop for --duration-seconds: each request has a
random prompt length and max_tokens, is unconstrained or constrained (JSON
schema, regex or choice, some of them distinct grammars that need a compile),
and a --cancel-fraction of them is cancelled by the client part-way. Every
--restart-every-seconds one grammar replica is stopped (SIGKILL or SIGTERM,
alternating, and alternating replicas) and started again on its port.

Measured: requests completed, requests lost to faults (any status other than
OK or the client's own cancel, by status code, and streams the server ended
with finish reason CANCELLED or ERROR), completed constrained outputs that do
not satisfy their constraint (by reason), grammar sessions and KV blocks still
held once the load has stopped and the services settled, the inference
service's RSS (API server and engine core) over time and its growth after
warm-up, every process's peak RSS (soak_memory.py), each request's wait for
its first chunk, and throughput over time. With --hostile-rate, issue 24's
hostile requests are mixed in (soak_hostile.py), counted apart: each must be
refused INVALID_ARGUMENT, and none counts as lost. One progress line every
--progress-seconds on stderr.

Writes <out>/soak.json and <out>/soak.png, prints a markdown summary on stdout.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from structd.bench.e2e.workload import SCHEMAS
from structd.bench.harness import ChildService, UsageError, free_port, machine, process_and_children, progress
from structd.bench.soak_hostile import HostileTally, send_hostile
from structd.bench.soak_memory import MemoryWatch
from structd.bench.soak_report import markdown, plot, summarize  # noqa: F401 - markdown, plot: this Benchmark's
from structd.up import Backoff

STREAMS_PER_CHANNEL = 64  # HTTP/2 streams per client connection
STARTUP_TIMEOUT_SECONDS = 300.0
RESTART_ATTEMPTS = 5
STOP_TIMEOUT_SECONDS = 30.0
FAULT_PAUSE_SECONDS = 0.2

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "under bright orange lamps near old stone bridges").split()
REGEXES = [r"[a-z]{3}-[0-9]{3,6}", r"(0|[1-9][0-9]{0,5})\.[0-9]{1,3}", r"[A-Z][a-z]{2,10}( [A-Z][a-z]{2,10}){0,3}",
           r"#[0-9a-f]{6}", r"(yes|no|maybe), because [a-z ]{5,40}\."]
CHOICES = [["yes", "no"], ["red", "green", "blue", "yellow"], ["north", "south", "east", "west", "up", "down"],
           ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]]


def add_arguments(parser) -> None:
    parser.add_argument("--duration-seconds", type=float, default=600.0, help="how long the load runs")
    parser.add_argument("--streams", type=int, default=256, help="concurrent client streams (closed loop)")
    parser.add_argument("--simulate-step-ms", type=float, default=5.0, help="simulated runner step time")
    parser.add_argument("--restart-every-seconds", type=float, default=60.0,
                        help="restart a grammar replica this often (0: never); replicas and SIGKILL/SIGTERM alternate")
    parser.add_argument("--cancel-fraction", type=float, default=0.1,
                        help="share of requests the client cancels part-way")
    parser.add_argument("--constrained-fraction", type=float, default=0.6,
                        help="share of constrained requests (json schema, regex, choice in equal parts)")
    parser.add_argument("--min-tokens", type=int, default=4, help="smallest max_tokens of a request")
    parser.add_argument("--max-tokens", type=int, default=96, help="largest max_tokens of a request")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="inference server's running batch limit")
    parser.add_argument("--warmup-seconds", type=float, default=60.0,
                        help="RSS growth is measured from here to the end of the load (at most half the duration)")
    parser.add_argument("--sample-seconds", type=float, default=2.0, help="RSS / throughput / gauge sampling period")
    parser.add_argument("--progress-seconds", type=float, default=10.0, help="one progress line this often")
    parser.add_argument("--request-timeout-seconds", type=float, default=120.0,
                        help="client deadline of one request (a request that hangs ends as DEADLINE_EXCEEDED)")
    parser.add_argument("--settle-seconds", type=float, default=30.0,
                        help="after the load, wait at most this long for sessions and KV blocks to return to 0")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--hostile-rate", type=float, default=0.0,
                        help="hostile requests/s mixed in beside the streams, issue 24's cases in turn, each expected "
                             "to be refused INVALID_ARGUMENT and counted apart from the ordinary requests (0: none)")


def check_arguments(args) -> None:
    problems = []
    if args.duration_seconds <= 0 or args.streams < 1:
        problems.append("--duration-seconds must be positive and --streams at least 1")
    if not 0 <= args.cancel_fraction <= 1 or not 0 <= args.constrained_fraction <= 1:
        problems.append("--cancel-fraction and --constrained-fraction are shares in [0, 1]")
    if not 1 <= args.min_tokens <= args.max_tokens:
        problems.append("need 1 <= --min-tokens <= --max-tokens")
    if args.restart_every_seconds < 0 or args.sample_seconds <= 0 or args.progress_seconds <= 0:
        problems.append("--restart-every-seconds must be >= 0, --sample-seconds and --progress-seconds positive")
    if args.hostile_rate < 0:
        problems.append("--hostile-rate must be >= 0")
    if args.simulate_step_ms <= 0:
        problems.append("--simulate-step-ms must be positive (the soak runs on the simulated runner)")
    if problems:
        raise UsageError("structd bench soak: " + "; ".join(problems))


# --- the workload --------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakRequest:
    kind: str  # "unconstrained", "json_schema", "regex", "choice"
    prompt: str
    options: dict
    cancel_after: int  # chunks received before the client cancels; 0: never

    def problem(self, text: str) -> str | None:
        """Why a completion that finished with STOP does not satisfy its constraint; None when it does."""
        if self.kind == "json_schema":
            try:
                json.loads(text)
            except ValueError:
                try:
                    json.loads(text, strict=False)
                except ValueError:
                    return "json_schema: not JSON"
                # RFC 8259 forbids raw U+0000-U+001F inside strings; a lenient parser accepts them.
                return "json_schema: raw control character in a string"
            return None
        if self.kind == "regex" and re.fullmatch(self.options["regex"], text) is None:
            return "regex: no match"
        if self.kind == "choice" and text not in self.options["choice"]:
            return "choice: not one of the choices"
        return None


def next_request(rng: random.Random, args) -> SoakRequest:
    max_tokens = rng.randint(args.min_tokens, args.max_tokens)
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 48))) + ":"
    options: dict = {"max_tokens": max_tokens}
    if rng.random() < 0.5:
        options.update(temperature=1.0, seed=rng.randrange(1 << 31))
    if rng.random() < args.constrained_fraction:
        kind = rng.choice(["json_schema", "regex", "choice"])
        if kind == "json_schema":
            options["json_schema"] = json.dumps(rng.choice(SCHEMAS)[1])
        elif kind == "regex":
            # One in four is one of a few hundred distinct grammars: the replicas keep compiling (and forget
            # everything when restarted), the rest are cache hits.
            options["regex"] = (rng.choice(REGEXES) if rng.random() < 0.75
                                else f"[a-z]{{{rng.randint(1, 16)}}}-[0-9]{{{rng.randint(1, 16)}}}")
        else:
            options["choice"] = rng.choice(CHOICES)
    else:
        kind = "unconstrained"
    cancel_after = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < args.cancel_fraction else 0
    return SoakRequest(kind, prompt, options, cancel_after)


# --- the services --------------------------------------------------------------------------


def metrics_text(port: int, timeout: float = 10.0) -> str | None:
    """A service's /metrics, or None while it is down."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
            return r.read().decode("utf-8")
    except (urllib.error.URLError, OSError):
        return None  # the service's: down or restarting; the sample records it as missing


def gauge(text: str | None, name: str) -> float | None:
    if text is None:
        return None
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def rss_bytes(pid: int) -> int | None:
    """Resident memory of `pid` and its children (the inference service's API server and engine core)."""
    total = None
    for one in process_and_children(pid):
        try:
            for line in Path(f"/proc/{one}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total = (total or 0) + int(line.split()[1]) * 1024
        except OSError:
            pass  # the process's: it is gone
    return total


class GrammarReplica:
    """One grammar replica that can be stopped and started again on the same gRPC and metrics ports."""

    def __init__(self, index: int, out: Path):
        self.index = index
        self.out = out
        self.starts = 0
        # Chosen here rather than by the child, so the inference server can be told before the replica is up.
        self.port = free_port()
        self.metrics_port = free_port()
        self.svc: ChildService | None = None

    @property
    def name(self) -> str:
        return f"grammar replica {self.index + 1}"

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> None:
        """wait=False: spawned only (self.svc.wait_listening next)."""
        self.starts += 1
        self.svc = ChildService(["grammar", "--max-sessions", "65536"],
                                self.out / f"grammar-{self.index + 1}.{self.starts}.log", STARTUP_TIMEOUT_SECONDS,
                                port=self.port, metrics_port=self.metrics_port, wait=wait)

    def restart(self, sig: signal.Signals) -> dict:
        """Stops the replica with sig, waits for it to exit and starts it again on its ports (blocking)."""
        began = time.monotonic()
        event: dict = {"replica": self.index + 1, "signal": sig.name}
        svc, self.svc = self.svc, None
        if svc is not None:
            svc.proc.send_signal(sig)
            try:
                svc.proc.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                svc.proc.kill()  # the replica's: it did not drain within its grace period
                svc.proc.wait(timeout=10)
            event["exit_code"] = svc.proc.returncode
            svc.stop()  # closes its log
        event["exit_seconds"] = time.monotonic() - began
        backoff = Backoff(0.5, 5.0)
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            try:
                self.start()
                break
            except SystemExit as e:
                # The new child's: it exited before listening (e.g. the port not free yet); tried again.
                event.setdefault("start_failures", []).append(str(e))
                if attempt < RESTART_ATTEMPTS:
                    time.sleep(backoff.next())
        event["down_seconds"] = time.monotonic() - began
        event["restarted"] = self.svc is not None
        return event

    def stop(self) -> None:
        if self.svc is not None:
            self.svc.stop()


class Services:
    """The two grammar replicas and the inference server, started and stopped together."""

    def __init__(self, args, out: Path):
        self.grammar = [GrammarReplica(i, out) for i in range(2)]
        self.inference: ChildService | None = None
        flags = ["inference", "--grammar-target", ",".join(r.target for r in self.grammar),
                 "--simulate-step-ms", str(args.simulate_step_ms), "--num-threads", "1",
                 "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(max(1024, 4 * args.streams)),
                 "--default-max-tokens", str(args.max_tokens)]

        # All three spawned before any is waited for: each loads the 129k tokenizer, and the inference server
        # waits for the grammar tier by itself.
        try:
            for r in self.grammar:
                r.start(wait=False)
            self.inference = ChildService(flags, out / "inference.log", STARTUP_TIMEOUT_SECONDS, wait=False)
            for r in self.grammar:
                r.svc.wait_listening()
            self.inference.wait_listening()
        except SystemExit as e:  # a child's start failed: whatever started is stopped
            self.stop()
            raise SystemExit(f"the services did not start: {e}") from None

    def stop(self) -> None:
        """The inference server first (it drains while the grammar tier answers), then both replicas."""
        if self.inference is not None:
            self.inference.stop()
        # Both replicas drain side by side.
        for r in self.grammar:
            if r.svc is not None:
                r.svc.begin_stop()
        for r in self.grammar:
            r.stop()


# --- the load ------------------------------------------------------------------------------


@dataclass
class Tally:
    """Everything counted while the load runs (one event loop: no locks)."""

    started: int = 0
    completed: int = 0  # finished with a finish reason the client accepts (not cancelled by the server)
    cancelled_by_client: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    lost: Counter = field(default_factory=Counter)  # status code (or FINISH_<reason>, NO_FINISH) -> requests
    lost_examples: dict = field(default_factory=dict)  # code -> a few messages
    fault_times: list = field(default_factory=list)  # (seconds since start, code)
    # Completed requests whose output does not satisfy their constraint (they count as completed too).
    invalid: Counter = field(default_factory=Counter)  # reason -> requests
    invalid_examples: dict = field(default_factory=dict)  # reason -> a few outputs
    invalid_times: list = field(default_factory=list)  # (seconds since start, reason)
    tokens: int = 0
    in_flight: int = 0
    first_chunk_seconds: list = field(default_factory=list)  # per request that got a chunk: its wait for the first

    def fault(self, t: float, code: str, message: str) -> None:
        self.lost[code] += 1
        self.fault_times.append((round(t, 3), code))
        _example(self.lost_examples, code, message)

    def invalid_output(self, t: float, reason: str, message: str) -> None:
        self.invalid[reason] += 1
        self.invalid_times.append((round(t, 3), reason))
        _example(self.invalid_examples, reason, message)


def _example(examples: dict, key: str, message: str) -> None:
    kept = examples.setdefault(key, [])
    if len(kept) < 5:
        kept.append(message[:1000])


async def one_request(client, req: SoakRequest, timeout: float, tally: Tally, t0: float) -> bool:
    """Runs one request to its end (or the client's cancel); True when it was lost to a fault."""
    from shared.inference_client import InferenceError

    tally.started += 1
    tally.in_flight += 1
    tally.by_kind[req.kind] += 1
    chunks = 0
    texts: list[str] = []
    fault: tuple[str, str] | None = None
    stream = client.generate(req.prompt, timeout=timeout, **req.options)
    began = time.monotonic()
    try:
        async for chunk in stream:
            if not chunks:
                tally.first_chunk_seconds.append(time.monotonic() - began)
            chunks += 1
            tally.tokens += len(chunk.token_ids)
            texts.append(chunk.text)
            if chunk.finish_reason is not None:
                tally.finish_reasons[chunk.finish_reason] += 1
                if chunk.finish_reason in ("cancelled", "error"):
                    fault = (f"FINISH_{chunk.finish_reason.upper()}",
                             f"{req.kind}: the server ended the stream with finish_reason {chunk.finish_reason}")
                else:
                    tally.completed += 1
                    text = "".join(texts)
                    if chunk.finish_reason == "stop" and (problem := req.problem(text)) is not None:
                        tally.invalid_output(time.monotonic() - t0, problem, f"{text!r} for {req.options}")
                break
            if req.cancel_after and chunks >= req.cancel_after:
                tally.cancelled_by_client += 1
                break  # aclose() below cancels the RPC
        else:
            fault = ("NO_FINISH", f"{req.kind}: the stream ended without a finish reason")
    except InferenceError as e:
        # The server's (or the transport's): exactly what this benchmark counts.
        fault = (e.code.name, f"{req.kind}: {e.message}")
    finally:
        tally.in_flight -= 1
        await stream.aclose()
    if fault is not None:
        tally.fault(time.monotonic() - t0, *fault)
    return fault is not None


def restart_plan(k: int) -> tuple[int, signal.Signals]:
    """Restart k (0, 1, ...): replicas alternate, and each replica alternates SIGKILL and SIGTERM."""
    return k % 2, (signal.SIGKILL, signal.SIGTERM)[(k + k // 2) % 2]


async def run_soak(args, services: Services) -> dict:
    from shared.inference_client import AsyncInferenceClient

    grammar, inference = services.grammar, services.inference

    tally = Tally()
    hostile = HostileTally()
    memory = MemoryWatch()
    samples: list[dict] = []
    restarts: list[dict] = []
    rng = random.Random(args.seed)
    clients = [AsyncInferenceClient(inference.target)
               for _ in range(math.ceil(args.streams / STREAMS_PER_CHANNEL))]
    t0 = time.monotonic()
    deadline = t0 + args.duration_seconds
    load_over = asyncio.Event()

    async def worker(i: int) -> None:
        client = clients[i % len(clients)]
        while time.monotonic() < deadline:
            if await one_request(client, next_request(rng, args), args.request_timeout_seconds, tally, t0):
                # A client backs off after a failure: with the service down, 256 streams would otherwise spin.
                await asyncio.sleep(FAULT_PAUSE_SECONDS)

    async def sample() -> dict:
        t = time.monotonic() - t0
        memory.sample(t, {"inference": inference.proc.pid,
                          **{r.name: r.svc.proc.pid if r.svc is not None else None for r in grammar}})
        imetrics = await asyncio.to_thread(metrics_text, inference.metrics_port)
        gmetrics = await asyncio.gather(*(asyncio.to_thread(metrics_text, r.metrics_port) for r in grammar))
        return {"t": round(t, 3), "rss_bytes": rss_bytes(inference.proc.pid), "tokens": tally.tokens,
                "started": tally.started, "completed": tally.completed,
                "cancelled_by_client": tally.cancelled_by_client, "lost": sum(tally.lost.values()),
                "in_flight": tally.in_flight,
                "kv_cache_usage_ratio": gauge(imetrics, "inference_svc_kv_cache_usage_ratio"),
                "running": gauge(imetrics, "inference_svc_num_requests_running"),
                "waiting": gauge(imetrics, "inference_svc_num_requests_waiting"),
                "grammar_active_sessions": [gauge(g, "grammar_svc_active_sessions") for g in gmetrics]}

    async def sampler() -> None:
        last_line = t0
        while True:
            s = await sample()
            samples.append(s)
            if time.monotonic() - last_line >= args.progress_seconds - 1e-3 or load_over.is_set():
                last_line = time.monotonic()
                progress(progress_line(s, samples, len(restarts), load_over.is_set()))
            if load_over.is_set():
                return
            await asyncio.sleep(args.sample_seconds)

    async def restarter() -> None:
        if not args.restart_every_seconds:
            return
        k = 0
        while (at := t0 + (k + 1) * args.restart_every_seconds) < deadline:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            i, sig = restart_plan(k)
            progress(f"restart {k + 1}: {sig.name} to {grammar[i].name} ({grammar[i].target})")
            began = time.monotonic() - t0
            event = await asyncio.to_thread(grammar[i].restart, sig)
            event.update(k=k + 1, t=round(began, 3))
            restarts.append(event)
            progress(f"restart {k + 1}: {grammar[i].name} exited with {event.get('exit_code')}, "
                     + (f"serving again after {event['down_seconds']:.1f} s" if event["restarted"]
                        else f"NOT restarted: {event.get('start_failures')}"))
            k += 1

    sampling = asyncio.create_task(sampler())
    restarting = asyncio.create_task(restarter())
    workers = [asyncio.create_task(worker(i)) for i in range(args.streams)]
    hostile_sender = asyncio.create_task(
        send_hostile(inference.target, args.hostile_rate, deadline, args.request_timeout_seconds, hostile)
        if args.hostile_rate else asyncio.sleep(0))
    # The workers stop starting requests at the deadline; the last ones end within their own deadline.
    done, pending = await asyncio.wait(workers, timeout=args.duration_seconds + args.request_timeout_seconds + 30)
    for w in pending:
        w.cancel()
    unfinished = len(pending)
    await asyncio.gather(*pending, return_exceptions=True)
    for w in done:
        if w.exception() is not None:
            raise w.exception()  # the benchmark's own bug: not a service fault, so not counted as one
    await hostile_sender  # its last requests end within their own deadline
    load_seconds = time.monotonic() - t0
    await restarting  # a restart in progress completes before the services are asked to settle
    load_over.set()
    await sampling
    for c in clients:
        await c.close()

    # After the load: every session and KV block must come back (checked until --settle-seconds).
    settle_began = time.monotonic()
    settled = None
    while True:
        s = await sample()
        s["settle"] = True
        samples.append(s)
        idle = (s["kv_cache_usage_ratio"] == 0 and s["running"] == 0 and s["waiting"] == 0
                and all(x == 0 for x in s["grammar_active_sessions"]))
        if idle and settled is None:
            settled = time.monotonic() - settle_began
        # A few seconds even once idle: a late release would show up as a gauge going up again.
        if time.monotonic() - settle_began >= min(args.settle_seconds, 3.0) and idle:
            break
        if time.monotonic() - settle_began >= args.settle_seconds:
            break
        await asyncio.sleep(0.5)
    final = samples[-1]
    imetrics = await asyncio.to_thread(metrics_text, inference.metrics_port)
    counters = {}
    for line in (imetrics or "").splitlines():
        if line.startswith("inference_svc_") and "_total" in line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            counters[name] = float(value)
    return {"tally": tally, "samples": samples, "restarts": restarts, "unfinished_at_end": unfinished,
            "load_seconds": load_seconds, "settle_seconds": settled, "final": final,
            "inference_counters": counters, "hostile": hostile.figures() if args.hostile_rate else None,
            "memory": memory.figures()}


def progress_line(s: dict, samples: list[dict], restarts: int, over: bool) -> str:
    prev = next((p for p in reversed(samples[:-1]) if s["t"] - p["t"] >= 5.0), samples[0])
    dt = s["t"] - prev["t"]
    rate = (s["tokens"] - prev["tokens"]) / dt if dt > 0 else 0.0
    rss = f"{s['rss_bytes'] / 2**20:.0f} MiB" if s["rss_bytes"] else "?"
    sessions = "/".join("down" if x is None else f"{x:.0f}" for x in s["grammar_active_sessions"])
    kv = s["kv_cache_usage_ratio"]
    return (f"{'load over, ' if over else ''}t={s['t']:.0f} s: {s['started']} started, {s['completed']} ok, "
            f"{s['cancelled_by_client']} cancelled by us, {s['lost']} lost; {s['in_flight']} in flight; "
            f"{rate:.0f} tok/s; RSS {rss}; KV {'?' if kv is None else f'{kv:.3f}'}; sessions {sessions}; "
            f"{restarts} restart(s)")


# --- the whole run -------------------------------------------------------------------------


def result_name(args) -> str:
    return "soak"


def run(args) -> dict:
    check_arguments(args)
    progress(f"{args.streams} streams for {args.duration_seconds:g} s on the simulated runner "
             f"({args.simulate_step_ms:g} ms/step), a grammar replica restarted every "
             f"{args.restart_every_seconds:g} s; starting 2 grammar replicas and the inference server")
    services = Services(args, args.out)
    try:
        progress(f"grammar replicas at {', '.join(r.target for r in services.grammar)}, inference at "
                 f"{services.inference.target} (pid {services.inference.proc.pid})")
        soaked = asyncio.run(run_soak(args, services))
    finally:
        progress("stopping the services")
        services.stop()
    m = machine()
    return {**summarize(args, soaked),
            "title": f"structd bench soak: {args.streams} streams, {args.duration_seconds:g} s, simulated "
                     f"{args.simulate_step_ms:g} ms/step, {m['cpu_model']} x{m['logical_cpus']}"}
