"""`structd bench grammar --backend-coverage` through the CLI on two schemas (not a timing test): one server, one
backend, one request in flight; the JSON carries the coverage, first-mask, choice and walk aggregates, the PNG
and the table come out."""

from __future__ import annotations

import json

from structd import cli
from tests.conftest import shared_data


def test_small_run_through_the_cli(tmp_path, capsys):
    rc = cli.main(["bench", "grammar", "--backend-coverage", "--out", str(tmp_path), "--limit", "2",
                   "--schemas", str(shared_data("jsonschemabench-sample.jsonl")),
                   "--backends", "llguidance", "--coverage-concurrency", "1", "--coverage-walk-steps", "3",
                   "--coverage-batch", "2", "--compile-timeout", "30"])
    assert rc == 0
    result = json.loads((tmp_path / "backend-coverage.json").read_text())
    (p,) = result["passes"]
    assert (p["backend"], p["concurrency"], p["schemas"]) == ("llguidance", 1, 2)
    assert set(p["served_within"]) == {"1", "5", "10"} and p["served"] == 1.0
    assert p["choices"] == {"llguidance/requested": 2} and p["memory_bytes"]["llguidance"]["n"] == 2
    assert set(p["walks"]) == {"1", "2"} and all(w["step_fill_seconds"]["n"] == 3 for w in p["walks"].values())
    assert [r["status"] for r in p["records"]] == ["ok", "ok"]
    assert (tmp_path / "backend-coverage.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| llguidance | 1 |" in capsys.readouterr().out
