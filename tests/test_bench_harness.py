"""The benchmark harness (structd/bench/harness/): every `structd bench` subcommand is a Benchmark, the driver
writes the same header, JSON, PNG and table for each, a usage error is exit status 2, and the per-schema
children keep a result, a failure and a hang apart."""

from __future__ import annotations

import argparse
import importlib
import json
import time

import pytest

from structd import cli
from structd.bench import harness
from structd.bench.harness.children import each_in_a_child

HEADER = ["command", "arguments", "machine", "commit", "modified_files", "started", "load_average_start"]


class Squares:
    """A benchmark that measures nothing: what the driver does around `run`."""

    def add_arguments(self, parser):
        parser.add_argument("--n", type=int, default=3)

    def result_name(self, args):
        return "squares"

    def run(self, args):
        if args.n < 1:
            raise harness.UsageError("--n must be at least 1")
        return {"rows": [{"x": x, "y": x * x} for x in range(args.n)]}

    def markdown(self, result):
        return "\n".join(f"| {r['x']} | {r['y']} |" for r in result["rows"])

    def plot(self, result, png):
        fig, ax = harness.pyplot().subplots()
        ax.plot([r["x"] for r in result["rows"]], [r["y"] for r in result["rows"]])
        harness.save_figure(fig, png)


def _args(tmp_path, *argv):
    parser = argparse.ArgumentParser()
    harness.add_arguments(parser, Squares(), "squares")
    return parser.parse_args(["--out", str(tmp_path / "out"), *argv])


def test_every_subcommand_is_a_benchmark():
    for name, module, _, _ in cli.BENCHMARKS:
        assert isinstance(importlib.import_module(module), harness.Benchmark), name


def test_the_driver_writes_the_header_the_fields_the_png_and_the_table(tmp_path, capsys):
    assert harness.run(Squares(), _args(tmp_path, "--n", "4")) == 0
    result = json.loads((tmp_path / "out" / "squares.json").read_text())
    assert list(result) == [*HEADER, "rows", "load_average_end", "duration_seconds"]
    assert result["arguments"] == {"out": str(tmp_path / "out"), "n": 4}
    assert result["machine"]["logical_cpus"] >= 1 and "numpy" in result["machine"]["versions"]
    assert len(result["commit"]) == 40 and result["duration_seconds"] >= 0
    assert result["rows"][3] == {"x": 3, "y": 9}
    assert (tmp_path / "out" / "squares.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 3 | 9 |" in capsys.readouterr().out


def test_a_usage_error_is_exit_status_2_and_writes_no_result(tmp_path, capsys):
    assert harness.run(Squares(), _args(tmp_path, "--n", "0")) == 2
    assert "--n must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "out" / "squares.json").exists()


def _child_job(kind: str) -> dict:
    if kind == "hang":
        time.sleep(60)
    if kind == "fail":
        raise ValueError("the library refused it")
    return {"kind": kind}


def test_each_item_runs_in_its_own_child_with_a_deadline():
    outcomes: dict[int, dict] = {}
    each_in_a_child(_child_job, [("ok",), ("hang",), ("fail",)], timeout=1.0, workers=2,
                    on_done=outcomes.__setitem__)
    assert outcomes == {0: {"kind": "ok"}, 1: {"timeout": True}, 2: {"error": "ValueError: the library refused it"}}


def test_a_replica_that_cannot_start_stops_the_inference_service_started_beside_it(tmp_path):
    """The inference service starts beside its grammar replicas and would wait for them for ever: a replica that
    exits at start (a bad flag) is reported at once, naming it, and the inference child is stopped with it."""
    spawned = []

    class Recording(harness.services.ChildService):
        def __init__(self, *args, **kwargs):
            spawned.append(self)
            super().__init__(*args, **kwargs)

    started = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness.services, "ChildService", Recording)
        with pytest.raises(SystemExit, match="grammar service exited with 1 before listening"):
            with harness.grammar_and_inference(tmp_path, "bad", replicas=2, grammar_flags=("--compile-workers", "0")):
                pass
    assert [c.cmd[3] for c in spawned] == ["grammar", "grammar", "inference"]
    assert all(c.proc.poll() is not None for c in spawned), "a child outlived the failed start"
    assert time.monotonic() - started < 60
