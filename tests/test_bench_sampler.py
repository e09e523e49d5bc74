"""`structd bench sampler` through the CLI with few rounds (not a timing test): the old sampler loads from git,
both sample every kind of step (greedy and seeded sampled rows) and agree on every token, and the JSON, PNG
and table carry the medians."""

from __future__ import annotations

import json

from structd import cli


def test_small_run_through_the_cli(tmp_path, capsys):
    rc = cli.main(["bench", "sampler", "--out", str(tmp_path), "--rounds", "3", "--rows", "5"])
    assert rc == 0
    result = json.loads((tmp_path / "sampler.json").read_text())
    assert result["arguments"]["old_rev"] == "b49e54e" and result["machine"]["logical_cpus"] > 0
    kinds = result["kinds"]
    assert [k["kind"] for k in kinds] == ["unconstrained", "allowed lists", "allowed + disallowed lists",
                                         "long disallowed lists + dense masks", "T 0.8", "T 0.8, top_k 50",
                                         "T 0.8, top_p 0.9", "T 0.8, min_p 0.05", "T 0.8, allowed lists",
                                         "mixed, logprobs"]
    for k in kinds:
        assert k["rows"] == 5 and k["old_ms"] > 0 and k["new_ms"] > 0 and k["new_over_old"] > 0
        assert k["differing"] == 0  # seeded alike: the batch draws the row path's tokens
    assert (tmp_path / "sampler.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| allowed lists |" in capsys.readouterr().out


def test_unknown_revision_is_a_usage_error(tmp_path, capsys):
    rc = cli.main(["bench", "sampler", "--out", str(tmp_path), "--old-rev", "no-such-rev", "--rounds", "1"])
    assert rc == 2
    assert "--old-rev no-such-rev" in capsys.readouterr().err
