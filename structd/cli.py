"""The `structd` command line: one console script, one subcommand per tool.

`structd grammar`, `structd inference` and `structd gateway` are the services'
own entries (grammar_svc/__main__.py, inference_svc/__main__.py,
gateway/__main__.py: `structd grammar FLAGS` is `python -m grammar_svc
FLAGS`); `up`, `generate` and `bench` are this package's. A subcommand whose
code is not installed is left out: each image installs only its own service
and this module (grammar_svc/Dockerfile, inference_svc/Dockerfile,
gateway/Dockerfile).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path

from shared.entry import setup_logging
from shared.flags import FlagSet

# Subcommand -> the service entry module it runs.
SERVICES = {"grammar": "grammar_svc.__main__", "inference": "inference_svc.__main__", "gateway": "gateway.__main__"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its package is not installed
        return False


def _cmd_up(args: argparse.Namespace) -> int:
    from structd.up import run_up

    setup_logging(args.log_level)
    return run_up(args)


def _bench_command(module: str):
    def run(args: argparse.Namespace) -> int:
        from structd.bench import harness

        setup_logging(args.log_level)
        return harness.run(importlib.import_module(module), args)

    return run


def _add_up(sub, env: dict[str, str]) -> None:
    p = sub.add_parser("up", help="run the services locally, restarting any that exits, until SIGINT/SIGTERM",
                       description="Start grammar replica(s), the inference service and the HTTP gateway locally, "
                                   "print where they listen once all are SERVING, restart any that exits "
                                   "(exponential back-off, same ports), stop them cleanly on SIGINT/SIGTERM.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="inference service gRPC port")
    p.add_argument("--metrics-port", type=int, default=9401, help="inference service /metrics port")
    p.add_argument("--grammar-port", type=int, default=50052)
    p.add_argument("--grammar-metrics-port", type=int, default=9402)
    p.add_argument("--gateway-port", type=int, default=8000,
                   help="the OpenAI-compatible HTTP gateway's port (0: no gateway)")
    p.add_argument("--grammar-replicas", type=int, default=1,
                   help="replicas take consecutive ports from --grammar-port and --grammar-metrics-port")
    p.add_argument("--model", default=None,
                   help="Hugging Face causal LM directory or hub id (org/name) (default: the embedded model)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the inference service")
    p.add_argument("--log-level", default="INFO")
    tls = FlagSet(p, env, "STRUCTD_UP_")
    tls.add("--tls-cert-file", None, "mutual TLS on both hops: the PEM certificate both gRPC services (and the "
                                     "gateway's HTTPS) serve and the inference service and gateway present as "
                                     "clients; it must name --host", kind=Path)
    tls.add("--tls-key-file", None, "the PEM private key of --tls-cert-file", kind=Path)
    tls.add("--tls-ca-file", None, "the PEM CA that signed --tls-cert-file: every gRPC client must present a "
                                   "certificate it signed", kind=Path)
    p.set_defaults(func=_cmd_up)


# (name, its module: a structd.bench.harness.Benchmark, help, description)
BENCHMARKS = [
    ("grammar", "structd.bench.grammar.run", "grammar service: fill time, step round trip, wire bytes, compile time",
     None),
    ("e2e", "structd.bench.e2e.run", "end to end: constrained vs unconstrained TPOT, mask wait, throughput vs peers",
     None),
    ("prefix", "structd.bench.prefix",
     "prefix: prefix caching on vs off on a shared 1,500-token prefix, multi-turn resends, n completions",
     "Two inference servers, --prefix-caching on and off, taking turns: constrained requests sharing one long "
     "instruction prefix at each concurrency (TTFT p50/p99, tokens/s, the prefix cache's hit rate from the "
     "server's counters), conversations resending their history each turn, n completions in one call against "
     "n calls one after another, and the e2e workload (nothing shared) for what caching costs; --vllm-python adds "
     "vLLM's CPU engine with its prefix caching."),
    ("soak", "structd.bench.soak", "soak: hundreds of streams with churn, cancels and grammar replica restarts",
     "Soak the whole stack on the simulated runner: concurrent streams with churn, client cancels and a grammar "
     "replica restarted periodically; reports requests lost to faults, leaked sessions and KV blocks, RSS growth "
     "and throughput."),
    ("faults", "structd.bench.faults", "faults: latency of in-flight requests when a grammar replica is killed or hung",
     "Constrained requests in flight while one of two grammar replicas is killed (SIGKILL) or frozen (SIGSTOP): "
     "per-request latency, status and validity."),
    ("validity", "structd.bench.validity", "validity: share of random-walk JSON documents that validate, xgrammar vs structd",
     "Seeded random walks through each JSON-Schema grammar's own token masks over the JSONSchemaBench and MaskBench "
     "samples, xgrammar as-is, structd's grammar and llguidance's as a reference: share of complete documents valid "
     "against their schema (its own draft), by category and by cause; with --e2e-requests, finished outputs through "
     "the whole stack: valid, reported to the client, or silent."),
    ("json-grammar", "structd.bench.json_grammar_cost",
     "json-grammar: compile and mask-fill cost of structd's JSON grammar vs the path before it, interleaved",
     "Each schema compiled both ways (xgrammar + tail form before, structd's JSON grammar after) in alternating "
     "order, then both matchers filled at every position of one seeded walk, alternating: compile and per-row fill "
     "ratios measured in one process."),
    ("compiled-body", "structd.bench.compiled_body",
     "compiled-body: the compiled model body (--compile) vs the eager one, interleaved",
     "The embedded model's forward (or --host-model's, whose time is host work) at decode N = 1, 5, 8, 32 "
     "(--decodes), a 128-token prefill and with --mixed a mixed step, eager and each compile mode alternating rep by "
     "rep in one process: medians (wall and thread CPU), eager/compiled ratios, the eager step's aten ops and greedy "
     "agreement."),
    ("lm-head", "structd.bench.lm_head",
     "lm-head: the LM head's kernels (F.linear vs oneDNN over the reordered weight) at 1 to 64 rows, interleaved",
     "The embedded model's 129,280 x 256 head at 1 to 64 rows with each kernel of inference_svc/model/head/lm_head.py, "
     "alternating in blocks of calls in one process: medians, the ratio, whether each column form is bitwise its "
     "full head, the greedy head's screen, and each column form at 1,000-20,000 ids (the sparse head's cost); "
     "--vllm-python adds vLLM's own CPU kernel for reference."),
    ("step-context", "structd.bench.step_context",
     "step-context: host time to build a step's inputs and attention context, old builder vs current",
     "The builder of --old-rev (loaded from git) and the working tree's on the same batches, alternating call by "
     "call in one process: medians in microseconds and new/old ratios."),
    ("attention", "structd.bench.attention",
     "attention: one layer's decode attention, SDPA's padded gather vs Triton's paged kernel, interleaved",
     "Decode batches of 1 to 64 at 512 to 8k cached tokens over shuffled KV blocks: per backend the step's "
     "attention context built and one layer's attention run, alternating rep by rep in one process: medians in "
     "microseconds and triton/sdpa ratios. Triton needs CUDA; on a CPU only SDPA is timed."),
    ("sampler", "structd.bench.sampler",
     "sampler: host time of one step's sampling on the CPU, old sampler vs current",
     "The sampler of --old-rev (loaded from git) and the working tree's on the same steps, greedy (unconstrained, "
     "allowed-id lists, allowed and disallowed lists, string interiors) and sampled with seeded rows "
     "(temperature, top_k, top_p, min_p, allowed lists, a mix with logprobs), alternating call by call in one "
     "process: medians in milliseconds, new/old ratios, and the same tokens from both (a few of a sampled kind's "
     "tokens may differ where float rounding moves a boundary)."),
]


def _add_bench(sub) -> None:
    from structd.bench import harness

    bench = sub.add_parser("bench", help="benchmarks (write JSON and a PNG plot)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, module, help_text, description in BENCHMARKS:
        p = bsub.add_parser(name, help=help_text, **({"description": description} if description else {}))
        harness.add_arguments(p, importlib.import_module(module), name)
        p.add_argument("--log-level", default="WARNING")
        p.set_defaults(func=_bench_command(module))


def _add_docs(sub) -> None:
    from structd import cli_reference

    docs = sub.add_parser("docs", help="documentation written from the code")
    dsub = docs.add_subparsers(dest="docs", required=True)
    p = dsub.add_parser("cli", help="docs/cli.md, this command line's reference, from its parsers",
                        description="Print, write or check docs/cli.md: every command with its usage, "
                                    "description and flags (default, help, environment variable).")
    cli_reference.add_arguments(p)
    p.set_defaults(func=lambda args: cli_reference.run(args, build_parser))


def build_parser(env: dict[str, str], only: str | None = None) -> argparse.ArgumentParser:
    """Every command's parser; with `only` (a command name), that command's alone, which is what parsing
    `structd <command> ...` needs: the benchmarks' parsers import every benchmark module, which each service
    process would pay for at every start. A name that is not an installed command gets the whole parser (and
    argparse's list of the commands there are)."""
    parser = argparse.ArgumentParser(prog="structd", description=__doc__.split("\n\n")[0].strip())
    sub = parser.add_subparsers(dest="command", required=True)
    added: list[str] = []

    def wanted(name: str) -> bool:
        if only is None or name == only:
            added.append(name)
            return True
        return False

    for name, module in SERVICES.items():
        if _installed(module) and wanted(name):
            entry = importlib.import_module(module)
            p = sub.add_parser(name, help=entry.HELP, description=entry.DESCRIPTION)
            entry.add_arguments(p, env)
            p.set_defaults(func=entry.run, service=True)
    if all(_installed(m) for m in (*SERVICES.values(), "structd.up")) and wanted("up"):
        _add_up(sub, env)
    if _installed("structd.generate") and wanted("generate"):
        from structd import generate

        p = sub.add_parser("generate", help="generate a completion from a running inference service",
                           description="Stream one (optionally grammar-constrained) completion from "
                                       "inference.v1.InferenceService.")
        generate.add_arguments(p, env)
        p.set_defaults(func=generate.run)
    if _installed("structd.bench") and wanted("bench"):
        _add_bench(sub)
    # Not in the images (each copies only the CLI modules its service needs).
    if _installed("structd.cli_reference") and wanted("docs"):
        _add_docs(sub)
    if only is not None and not added:
        return build_parser(env)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    args = build_parser(dict(os.environ), only=command).parse_args(argv)
    try:
        if getattr(args, "service", False):
            # A service gets the flags it was started with (a tensor-parallel rank 0 starts its other ranks with them).
            return args.func(args, argv[argv.index(args.command) + 1:]) or 0
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
