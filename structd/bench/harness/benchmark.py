"""The `Benchmark` protocol and the one driver every `structd bench` subcommand runs through.

A benchmark module says what it measures (`run`: its fields of the result),
how to print them (`markdown`) and how to draw them (`plot`); the driver
owns the rest: the output directory (`--out`), the header every result
starts with (harness/output.py), the JSON, the PNG, the printed table, and
turning a `UsageError` into exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Protocol, runtime_checkable

from structd.bench.harness.output import arguments, header, load_average, progress, write_json


class UsageError(SystemExit):
    """Arguments a benchmark cannot run with: the message goes to stderr, the exit status is 2."""


@runtime_checkable
class Benchmark(Protocol):
    """A benchmark module (structd/cli.py's BENCHMARKS table lists them)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Its own flags (the driver adds --out)."""

    def result_name(self, args: argparse.Namespace) -> str:
        """The stem of <out>/<stem>.json and <out>/<stem>.png."""

    def run(self, args: argparse.Namespace) -> dict:
        """Measures; returns the result's fields beyond the header. Raises UsageError before measuring."""

    def markdown(self, result: dict) -> str:
        """What is printed on stdout once the result is written (the whole result, header included)."""

    def plot(self, result: dict, png: Path) -> None:
        """Draws the result into `png` (and, where it has more figures, beside it)."""


def add_arguments(parser: argparse.ArgumentParser, bench: Benchmark, name: str) -> None:
    parser.add_argument("--out", type=Path, default=Path("bench-results") / name,
                        help="output directory (JSON, PNG and the logs of the services it starts)")
    bench.add_arguments(parser)


def run(bench: Benchmark, args: argparse.Namespace) -> int:
    """Runs `bench` and writes <out>/<result_name>.json (header + its fields) and .png; prints its markdown."""
    started = time.time()
    args.out = Path(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    head = header(args, started)
    try:
        fields = bench.run(args)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    # The arguments as the benchmark ran with them (it may resolve a default, e.g. e2e's --quick and threads).
    result = {**head, "arguments": arguments(args), **fields, "load_average_end": load_average(),
              "duration_seconds": round(time.time() - started, 1)}
    name = bench.result_name(args)
    write_json(result, args.out / f"{name}.json")
    bench.plot(result, args.out / f"{name}.png")
    text = bench.markdown(result)
    if text:
        print(text)
    progress(f"wrote {args.out / name}.json and its plot ({result['duration_seconds']:.0f} s in all)")
    return 0
