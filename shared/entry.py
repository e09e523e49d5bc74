"""The command-line entry both services share: `python -m grammar_svc` and `python -m inference_svc`.

`structd grammar` / `structd inference` (structd/cli.py) build the same flags
into their subcommand and call the same `run(args)` of the service's
`__main__`, so either way of starting a service behaves alike.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT)


def run_service(serve: Callable[..., Awaitable[None]], config: Any, *serve_args: Any) -> NoReturn:
    """Logging at the config's log_level, then the service's serve(config, *serve_args) until it returns
    (SIGTERM/SIGINT), then the process ends (end_stopped_process). A start that fails raises as usual."""
    setup_logging(config.log_level)
    asyncio.run(serve(config, *serve_args))
    end_stopped_process(0)


def end_stopped_process(code: int) -> NoReturn:
    """Ends a process whose service has stopped cleanly: its servers closed, its children and pools stopped and
    waited for. The exit handlers run as on any exit (the log flushed; torch's caches and compile pools,
    multiprocessing's children and semaphores released), then the interpreter's own teardown is skipped: with
    torch and a model loaded it spends up to a second freeing what the OS frees at once, and a drain, a restart
    by `structd up` or an orchestrator, and every test's server stop waited on it. Threads still running end
    with the process, and work still queued in a thread pool is dropped (a normal exit would join them first):
    after the stop nothing is left that a client waits for."""
    atexit._run_exitfuncs()  # what Py_FinalizeEx runs before its teardown; CPython's, stable since 3.0
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader's end: a closed pipe or stream has nothing left to flush
            pass
    os._exit(code)


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
