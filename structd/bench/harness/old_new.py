"""The old-revision-vs-working-tree driver: a module as of a git revision beside the working tree's, timed
alternately in one process so machine noise hits both alike.

Used by the benchmarks that ask whether a rewrite paid off (`structd bench
step-context`, `structd bench sampler`): --old-rev names the revision, the
old module is loaded from `git show`, and the results are rows with an old
and a new median, drawn side by side and printed as one table.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from structd.bench.harness.benchmark import UsageError
from structd.bench.harness.output import pyplot, save_figure
from structd.bench.harness.services import REPO


def add_old_rev(parser: argparse.ArgumentParser, default: str, what: str) -> None:
    parser.add_argument("--old-rev", default=default, help=f"git revision whose {what}")


def module_at_revision(rev: str, paths: tuple[str, ...], name: str, replace: tuple[tuple[str, str], ...] = ()):
    """The module as of git revision `rev`, imported as `name` (after the text substitutions in `replace`, e.g.
    to point its imports at other old modules or where a module lives now). `paths`: where it may be at `rev`
    (relative to the repository), the first found is read: a module that moved has one path before the move
    and one after. Raises subprocess.CalledProcessError when the revision or the file is unknown."""
    for i, path in enumerate(paths):
        try:
            source = subprocess.run(["git", "show", f"{rev}:{path}"], check=True, cwd=REPO, capture_output=True,
                                    text=True).stdout
            break
        except subprocess.CalledProcessError:
            if i == len(paths) - 1:
                raise
    for old, new in replace:
        source = source.replace(old, new)
    tmp = tempfile.NamedTemporaryFile("w", suffix=f"_{name}.py", delete=False)
    tmp.write(source)
    tmp.close()
    try:
        spec = importlib.util.spec_from_file_location(name, tmp.name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        os.unlink(tmp.name)
    return module


def load_old(load: Callable[[str], object], rev: str, what: str):
    """load(rev), a usage error where the revision or the file is not in this clone."""
    try:
        return load(rev)
    except subprocess.CalledProcessError as e:
        raise UsageError(f"cannot read {what} at --old-rev {rev}: {e.stderr.strip()}") from None


def order(round_: int) -> tuple[str, str]:
    """Which goes first in this round: the order swaps every round."""
    return ("old", "new") if round_ % 2 else ("new", "old")


def markdown(rows: list[dict], label: str, old: str, new: str, heading: str, unit: str) -> str:
    lines = [f"| {heading} | old {unit} | new {unit} | new / old |", "|---|---|---|---|"]
    lines += [f"| {r[label]} | {r[old]} | {r[new]} | {r['new_over_old']:.2f} |" for r in rows]
    return "\n".join(lines)


def plot(rows: list[dict], label: str, old: str, new: str, ylabel: str, path: Path, width: float = 8.0) -> None:
    """Old and new medians side by side per row."""
    fig, ax = pyplot().subplots(figsize=(width, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[old] for r in rows], width=0.4, label="old")
    ax.bar([i + 0.2 for i in x], [r[new] for r in rows], width=0.4, label="new")
    ax.set_xticks(list(x), [r[label] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend()
    save_figure(fig, path)
