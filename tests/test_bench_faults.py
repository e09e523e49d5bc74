"""`structd bench faults` through the CLI in a short run (not a timing test): a killed grammar replica
costs the requests in flight nothing but time, and the JSON, PNG and table say so."""

from __future__ import annotations

import json

from structd import cli


def test_sigkill_scenario_through_the_cli(tmp_path, capsys):
    rc = cli.main(["bench", "faults", "--out", str(tmp_path), "--faults", "sigkill", "--requests", "3",
                   "--fault-after-seconds", "0.3", "--request-timeout-seconds", "60"])
    assert rc == 0
    result = json.loads((tmp_path / "faults-bench.json").read_text())
    [s] = result["scenarios"]
    assert s["scenario"] == "sigkill" and len(s["requests"]) == 3
    # A JSON array of exactly 40 digits only comes out of a session replayed exactly where it stopped.
    assert s["statuses"] == {"OK": 3} and s["valid"] == 3, s
    assert 0 < s["median_latency_seconds"] <= s["max_latency_seconds"]
    assert (tmp_path / "faults-bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "| sigkill | 3 | 3 | OK 3 |" in table


def test_unknown_scenario_is_refused(tmp_path, capsys):
    assert cli.main(["bench", "faults", "--out", str(tmp_path), "--faults", "sigfoo"]) == 2
    assert "--faults" in capsys.readouterr().err
