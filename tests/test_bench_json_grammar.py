"""`structd bench json-grammar` through the CLI on two small schemas (not a timing test): both paths compile,
the paired walk fills both matchers, and the JSON, PNG and table carry the ratios."""

from __future__ import annotations

import json

from structd import cli

SCHEMAS = [
    {"dataset": "Tiny", "name": "bounded.json", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 6}}, "required": ["s"]}},
    {"dataset": "Tiny", "name": "any-of-root.json", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "additionalProperties": False, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}},
]


def test_small_run_through_the_cli(tmp_path, capsys):
    sample = tmp_path / "jsb.jsonl"
    sample.write_text("".join(json.dumps(r) + "\n" for r in SCHEMAS))
    rc = cli.main(["bench", "json-grammar", "--out", str(tmp_path), "--max-tokens", "32",
                   "--jsonschemabench", str(sample), "--limit", "0"])
    assert rc == 0
    result = json.loads((tmp_path / "json-grammar-cost.json").read_text())
    summary = result["summary"]
    assert summary["counted"] == 2, summary["errors"]
    # The second schema is rewritten by normalisation (its anyOf takes the object's properties), the first is not.
    assert [r["normalised"] for r in result["schemas"]] == [False, True]
    for record in result["schemas"]:
        assert len(record["fill_us"]["before"]) == len(record["fill_us"]["after"]) > 0
        assert record["compile_seconds"]["before"] > 0 and record["compile_seconds"]["after"] > 0
    assert summary["compile"]["ratio_of_sums"] > 0
    assert summary["fill_normalised"]["schemas"] == 1 and summary["fill_unchanged"]["schemas"] == 1
    assert (tmp_path / "json-grammar-cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| compile, sum |" in capsys.readouterr().out
