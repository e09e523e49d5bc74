"""The `structd` command line: one console script, one subcommand per tool."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _cmd_grammar(args: argparse.Namespace) -> int:
    from grammar_svc import config as gconfig
    from grammar_svc.server import serve

    cfg = gconfig.from_args(args)
    _setup_logging(cfg.log_level)
    asyncio.run(serve(cfg))
    return 0


def _cmd_inference(args: argparse.Namespace) -> int:
    from inference_svc import config as iconfig
    from inference_svc.server import serve

    cfg = iconfig.from_args(args)
    _setup_logging(cfg.log_level)
    asyncio.run(serve(cfg))
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from shared.up import run_up

    _setup_logging(args.log_level)
    return run_up(args)


def _cmd_bench_grammar(args: argparse.Namespace) -> int:
    from structd.bench.grammar.run import run_bench

    _setup_logging(args.log_level)
    return run_bench(args)


def _cmd_bench_e2e(args: argparse.Namespace) -> int:
    from structd.bench.e2e.run import run_bench

    _setup_logging(args.log_level)
    return run_bench(args)


def _cmd_bench_soak(args: argparse.Namespace) -> int:
    from structd.bench.soak import run_bench

    _setup_logging(args.log_level)
    return run_bench(args)


def _cmd_bench_faults(args: argparse.Namespace) -> int:
    from structd.bench.faults import run_bench

    _setup_logging(args.log_level)
    return run_bench(args)


def build_parser(env: dict[str, str]) -> argparse.ArgumentParser:
    from grammar_svc import config as gconfig
    from inference_svc import config as iconfig
    from shared import generate_cli

    parser = argparse.ArgumentParser(prog="structd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("grammar", help="run the grammar service",
                       description="Run one grammar service replica (gRPC grammar.v1.GrammarService).")
    gconfig.add_arguments(p, env)
    p.set_defaults(func=_cmd_grammar)

    p = sub.add_parser("inference", help="run the inference service",
                       description="Run one inference service replica (gRPC inference.v1.InferenceService): "
                                   "continuous batching with masks from the grammar tier.")
    iconfig.add_arguments(p, env)
    p.set_defaults(func=_cmd_inference)

    p = sub.add_parser("up", help="run the services locally, restarting any that exits, until SIGINT/SIGTERM",
                       description="Start grammar replica(s) and the inference service locally, print where they "
                                   "listen once all are SERVING, restart any that exits (exponential back-off, "
                                   "same ports), stop them cleanly on SIGINT/SIGTERM.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="inference service gRPC port")
    p.add_argument("--metrics-port", type=int, default=9401, help="inference service /metrics port")
    p.add_argument("--grammar-port", type=int, default=50052)
    p.add_argument("--grammar-metrics-port", type=int, default=9402)
    p.add_argument("--grammar-replicas", type=int, default=1,
                   help="replicas take consecutive ports from --grammar-port and --grammar-metrics-port")
    p.add_argument("--model", default=None, help="Hugging Face causal LM directory (default: the embedded model)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the inference service")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser("generate", help="generate a completion from a running inference service",
                       description="Stream one (optionally grammar-constrained) completion from "
                                   "inference.v1.InferenceService.")
    generate_cli.add_arguments(p)
    p.set_defaults(func=generate_cli.run)

    bench = sub.add_parser("bench", help="benchmarks (write JSON and a PNG plot)")
    bsub = bench.add_subparsers(dest="bench", required=True)
    p = bsub.add_parser("grammar", help="grammar service: fill time, step round trip, wire bytes, compile time")
    from structd.bench.grammar.run import add_arguments as add_bench_arguments

    add_bench_arguments(p)
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=_cmd_bench_grammar)
    p = bsub.add_parser("e2e", help="end to end: constrained vs unconstrained TPOT, mask wait, throughput vs peers")
    from structd.bench.e2e.run import add_arguments as add_e2e_arguments

    add_e2e_arguments(p)
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=_cmd_bench_e2e)
    p = bsub.add_parser("soak", help="soak: hundreds of streams with churn, cancels and grammar replica restarts",
                        description="Soak the whole stack on the simulated runner: concurrent streams with churn, "
                                    "client cancels and a grammar replica restarted periodically; reports requests "
                                    "lost to faults, leaked sessions and KV blocks, RSS growth and throughput.")
    from structd.bench.soak import add_arguments as add_soak_arguments

    add_soak_arguments(p)
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=_cmd_bench_soak)
    p = bsub.add_parser("faults", help="faults: latency of in-flight requests when a grammar replica is killed or hung",
                        description="Constrained requests in flight while one of two grammar replicas is killed "
                                    "(SIGKILL) or frozen (SIGSTOP): per-request latency, status and validity.")
    from structd.bench.faults import add_arguments as add_faults_arguments

    add_faults_arguments(p)
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=_cmd_bench_faults)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(dict(os.environ))
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
