"""`python -m gateway [flags]`: the OpenAI-compatible HTTP gateway, the same as `structd gateway [flags]`."""

from __future__ import annotations

import argparse
import sys

from gateway import config
from shared.entry import run_service, service_main

HELP = "run the OpenAI-compatible HTTP gateway in front of an inference service"
DESCRIPTION = ("Serve the OpenAI HTTP API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, "
               "/tokenize, /detokenize) plus /health and /metrics, translated to inference.v1 gRPC calls on "
               "--target.")
add_arguments = config.add_arguments


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """argv: the flags it was started with (unused: the configuration is in args)."""
    from gateway.server import serve

    return run_service(serve, config.from_args(args))


def main(argv: list[str] | None = None) -> int:
    return service_main("gateway", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
