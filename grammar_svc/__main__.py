"""`python -m grammar_svc [flags]`: one grammar service replica, the same as `structd grammar [flags]`."""

from __future__ import annotations

import argparse
import sys

from grammar_svc import config
from shared.entry import run_service, service_main

HELP = "run the grammar service"
DESCRIPTION = "Run one grammar service replica (gRPC grammar.v1.GrammarService)."
add_arguments = config.add_arguments


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """argv: the flags it was started with (unused: the configuration is in args)."""
    # The configuration first: a bad flag is refused before the server's imports (xgrammar, torch) are paid.
    service_config = config.from_args(args)
    from grammar_svc.server import serve

    return run_service(serve, service_config)


def main(argv: list[str] | None = None) -> int:
    return service_main("grammar_svc", DESCRIPTION, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
