"""What every benchmark writes: the result header, the JSON, the plot's figure and progress lines.

The header is the same for every `structd bench` subcommand: how it was run
(command line, parsed arguments), on what (machine, library versions, the
commit and its modified files), how busy the machine was at the start and
the end (load average), and how long the run took.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from structd.bench.harness.services import REPO

# The libraries whose versions a result records (None where one is not installed).
VERSIONED = ("xgrammar", "grpcio", "protobuf", "numpy", "matplotlib", "torch", "transformers", "prometheus-client")


def progress(msg: str) -> None:
    """A benchmark's progress line, on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def command_line() -> str:
    """How this benchmark was invoked (`structd ...` when run through the console script)."""
    return " ".join(["structd"] + sys.argv[1:]) if Path(sys.argv[0]).name == "structd" else " ".join(sys.argv)


def arguments(args) -> dict:
    """A benchmark's parsed arguments as JSON-ready values."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}


def load_average() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []  # the machine's: no /proc (not Linux)


@functools.cache
def machine() -> dict:
    """The CPU, memory, platform and library versions (read once a run: a title and the header both use it)."""
    from importlib import metadata

    info: dict = {"cpu_model": "unknown", "logical_cpus": os.cpu_count(), "platform": platform.platform(),
                  "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass  # the machine's: no /proc (not Linux)
    if hasattr(os, "sched_getaffinity"):
        info["affinity_cpus"] = len(os.sched_getaffinity(0))
    versions = {}
    for dist in VERSIONED:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    info["versions"] = versions
    return info


def commit() -> dict:
    """The checkout's commit and the tracked files modified in it (what the figures were measured on)."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], capture_output=True, text=True, cwd=REPO, timeout=10).stdout

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no").split("\n")
        return {"commit": git("rev-parse", "HEAD").strip(),
                "modified_files": [line[3:] for line in dirty if line.strip()]}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified_files": []}  # not a git checkout, or no git


def header(args, started: float) -> dict:
    """The keys every result starts with (the end's load average and the duration are added at the end)."""
    return {"command": command_line(), "arguments": arguments(args), "machine": machine(), **commit(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "load_average_start": load_average()}


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1, default=str))


def pyplot():
    """matplotlib's pyplot on the file-only backend (benchmarks run without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
