"""The command-line entry both services share: `python -m grammar_svc` and `python -m inference_svc`.

`structd grammar` / `structd inference` (structd/cli.py) build the same flags
into their subcommand and call the same `run(args)` of the service's
`__main__`, so either way of starting a service behaves alike.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT)


def run_service(serve: Callable[..., Awaitable[None]], config: Any, *serve_args: Any) -> int:
    """Logging at the config's log_level, then the service's serve(config, *serve_args) until it returns
    (SIGTERM/SIGINT)."""
    setup_logging(config.log_level)
    asyncio.run(serve(config, *serve_args))
    return 0


def service_main(package: str, description: str,
                 add_arguments: Callable[[argparse.ArgumentParser, dict[str, str]], None],
                 run: Callable[[argparse.Namespace, list[str]], int], argv: list[str] | None = None) -> int:
    """`python -m <package> [flags]`: the service's flags (defaults from the environment), then run(args, flags)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog=f"python -m {package}", description=description)
    add_arguments(parser, dict(os.environ))
    args = parser.parse_args(argv)
    try:
        return run(args, argv) or 0
    except KeyboardInterrupt:
        return 130
