"""`structd bench validity` through the CLI on three small schemas (not a timing test): every document
structd's grammar (and the grammar service's llguidance backend) lets a random walk write validates, and the
JSON, PNG and table say so by category."""

from __future__ import annotations

import json

from structd import cli

SCHEMAS = [
    {"dataset": "Tiny", "name": "bounded.json", "schema": {
        "type": "object", "properties": {"s": {"type": "string", "maxLength": 6}}, "required": ["s"],
        "additionalProperties": False}},
    {"dataset": "Tiny", "name": "any-of-root.json", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "additionalProperties": False, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}},
]
MASKBENCH = [{"group": "Handwritten", "name": "enum.json", "schema": {"type": "string", "enum": ["x", 1]},
              "tests": []}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_small_run_through_the_cli(tmp_path, capsys):
    rc = cli.main(["bench", "validity", "--out", str(tmp_path), "--walks", "3", "--max-tokens", "64",
                   "--workers", "1", "--jsonschemabench", _jsonl(tmp_path / "jsb.jsonl", SCHEMAS),
                   "--maskbench", _jsonl(tmp_path / "mb.jsonl", MASKBENCH), "--llguidance-backend"])
    assert rc == 0
    result = json.loads((tmp_path / "validity-bench.json").read_text())
    assert result["command"] and result["machine"]
    assert [s["status"] for s in result["schemas"]] == ["ok", "ok", "ok"]
    assert result["summary"]["engines"] == ["xgrammar", "structd", "llguidance", "structd-llguidance"]
    # structd's grammar and the grammar service's llguidance backend (validity by backend, issue 26).
    for engine in ("structd", "structd-llguidance"):
        ours = result["summary"][engine]
        assert set(ours["by_category"]) == {"jsonschemabench/Tiny", "maskbench/Handwritten"}
        for share in ours["by_source"].values():
            assert share["documents"] > 0 and share["valid"] == share["documents"], result["summary"]
        assert ours["causes"] == {}
    assert (tmp_path / "validity-bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "| jsonschemabench/Tiny |" in table and "| maskbench/Handwritten |" in table


def test_a_walk_count_below_one_is_refused(tmp_path, capsys):
    assert cli.main(["bench", "validity", "--out", str(tmp_path), "--walks", "0"]) == 2
    assert "--walks must be at least 1" in capsys.readouterr().err


def test_end_to_end_outputs_are_valid_or_reported(tmp_path, capsys):
    """Two schemas through real grammar + inference services: each finished output is judged, none silent."""
    rc = cli.main(["bench", "validity", "--out", str(tmp_path), "--no-walks", "--e2e-requests", "2",
                   "--e2e-max-tokens", "64", "--e2e-concurrency", "2",
                   "--jsonschemabench", _jsonl(tmp_path / "jsb.jsonl", SCHEMAS), "--maskbench", ""])
    assert rc == 0
    result = json.loads((tmp_path / "validity-bench.json").read_text())
    e2e = result["end_to_end"]
    assert e2e["summary"]["requests"] == 2
    assert {r["name"] for r in e2e["records"]} == {"bounded.json", "any-of-root.json"}
    for record in e2e["records"]:
        assert record["outcome"] in {"valid", "reported", "unchecked", "unfinished"}, record
    # Seeded sampling: the bounded string's document finishes, validates, and the server's check agrees.
    bounded = next(r for r in e2e["records"] if r["name"] == "bounded.json")
    assert bounded["outcome"] == "valid" and bounded["server_agrees"], bounded
    assert (tmp_path / "validity-e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| invalid, silent | 0 |" in capsys.readouterr().out


def test_an_output_jsonschema_cannot_divide_is_not_judged():
    """A finished output whose integer is past float range, under multipleOf: jsonschema raises OverflowError on
    it (it ended a 3072-token run). Counted as not judged, the run goes on."""
    import asyncio
    from types import SimpleNamespace

    from structd.bench.validity_e2e import _one

    class Client:  # the inference service's answer, as the stream hands it over (the bench's input here)
        def generate(self, *args, **kwargs):
            async def stream():
                yield SimpleNamespace(text='{"n": ' + "9" * 400 + "}", finish_reason="stop", schema_check="unchecked",
                                      schema_violations=[], schema_check_detail="")
            return stream()

    row = {"source": "t", "category": "t", "name": "huge",
           "schema": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3.5}}}}
    args = SimpleNamespace(e2e_max_tokens=8, e2e_timeout_seconds=5.0)
    rec = asyncio.run(_one(Client(), row, args, 0))
    assert rec["outcome"] == "not-judged" and "OverflowError" in rec["error"], rec
