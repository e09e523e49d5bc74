"""Which test file `make test` starts first: the longest ones, so the run does not end on one worker.

`make test` runs pytest-xdist with `--dist loadfile` (a file's module servers
start once, on the worker that runs it) and `--no-loadscope-reorder`: files
are handed out in collection order, the next one whenever a worker is nearly
out of work. xdist's own order (most tests first) put the files with a few
long tests last (the device check's smoke, the soak, `structd up`), where one
worker ran them while the other had nothing left. Each worker sorts its
collection here, longest file first, so what is handed out last is short.

A file's seconds are the last measured ones: the pytest cache's
`structd/file_seconds` (written at the end of a run, for the files it ran
whole), else tests/file_seconds.json (committed, for a fresh clone; refresh it
from the cache after a full run). A file in neither goes after those with a
figure, in collection order. The figures only order the files: a stale one
costs balance at the end of a run, never a test.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

COMMITTED = Path(__file__).with_name("file_seconds.json")
CACHE_KEY = "structd/file_seconds"


def _seconds(config: pytest.Config) -> dict[str, float]:
    seconds = json.loads(COMMITTED.read_text()) if COMMITTED.is_file() else {}
    cache = getattr(config, "cache", None)
    if cache is not None:
        seconds.update(cache.get(CACHE_KEY, {}))
    return seconds


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):
        return  # only xdist's workers: a run in one process keeps the order pytest collected
    seconds = _seconds(config)
    # A stable sort: the tests of a file stay together and in their order.
    items.sort(key=lambda item: -seconds.get(item.path.name, 0.0))


class _Timer:
    """Adds up each file's setup, call and teardown seconds as the reports come in (from every worker)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[Path(report.nodeid.split("::", 1)[0]).name] += report.duration


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Timer(), "structd-file-timer")


def _whole_files(config: pytest.Config) -> bool:
    """Whether the run ran every test of each file it started (no -k, -m, --lf or node ids)."""
    opt = config.option
    return not (getattr(opt, "keyword", "") or getattr(opt, "markexpr", "") or getattr(opt, "lf", False)
                or any("::" in str(arg) for arg in config.args))


def pytest_sessionfinish(session: pytest.Session) -> None:
    timer = session.config.pluginmanager.get_plugin("structd-file-timer")
    cache = getattr(session.config, "cache", None)
    if timer is None or cache is None or not timer.seconds or not _whole_files(session.config):
        return
    known = cache.get(CACHE_KEY, {})
    known.update({name: round(s, 1) for name, s in timer.seconds.items()})
    cache.set(CACHE_KEY, known)
