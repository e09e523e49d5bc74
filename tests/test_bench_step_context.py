"""`structd bench step-context` through the CLI with few rounds (not a timing test): the old builder loads from
git, both builders run on every batch, and the JSON, PNG and table carry the medians and ratios."""

from __future__ import annotations

import json

from structd import cli


def test_small_run_through_the_cli(tmp_path, capsys):
    rc = cli.main(["bench", "step-context", "--out", str(tmp_path), "--rounds", "3"])
    assert rc == 0
    result = json.loads((tmp_path / "step-context.json").read_text())
    assert result["arguments"]["old_rev"] == "08b29cc" and result["machine"]["logical_cpus"] > 0
    steps = result["steps"]
    assert [s["step"] for s in steps] == ["1 decode", "1 decode + prefill/extend", "8 decodes",
                                          "8 decodes + prefill/extend", "32 decodes", "32 decodes + prefill/extend"]
    for s in steps:
        assert s["old_us"] > 0 and s["new_us"] > 0 and s["new_over_old"] > 0
    assert (tmp_path / "step-context.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 32 decodes |" in capsys.readouterr().out


def test_unknown_revision_is_a_usage_error(tmp_path, capsys):
    rc = cli.main(["bench", "step-context", "--out", str(tmp_path), "--old-rev", "no-such-rev", "--rounds", "1"])
    assert rc == 2
    assert "--old-rev no-such-rev" in capsys.readouterr().err
