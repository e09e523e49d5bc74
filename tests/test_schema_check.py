"""Generate tells the client what its schema's grammar does not enforce, and whether the output broke it.

Through the real inference service (embedded model, random weights) and the
real grammar service. The pigeonhole schema makes the violation certain:
three items from two values under `uniqueItems`, which the grammar does not
enforce (min/maxItems it does), so every finished output repeats an item.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from shared.inference_client import InferenceError
from tests.conftest import background_complete

PIGEONHOLE = {"type": "object",
              "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                      "minItems": 3, "maxItems": 3, "uniqueItems": True}},
              "required": ["tags"]}
# The grammar forces the string (pattern is enforced); it ignores `not`, which Python's re would take hours to
# evaluate (a|aa)+$ against: far past the test server's --schema-check-timeout-seconds (5 s), where its worker
# is stopped.
SLOW = {"type": "string", "pattern": "^a{60}!$", "not": {"pattern": "^(a|aa)+$"}}
ENFORCED = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                             "ok": {"type": "boolean"}},
            "required": ["x", "ok"]}


def sample(name: str, labels: dict, server) -> float:
    return server.server.metrics.registry.get_sample_value(name, labels) or 0.0


def test_an_output_that_breaks_an_unenforced_keyword_carries_the_violation(inference_client, inference_server,
                                                                           grammar_server):
    invalid = sample("inference_svc_schema_checks_total", {"result": "invalid"}, inference_server)
    unique = sample("grammar_svc_output_violations_total", {"keyword": "uniqueItems"}, grammar_server)
    chunks = list(inference_client.generate("tags:", json_schema=PIGEONHOLE, max_tokens=48, temperature=1.0,
                                            seed=7))
    last = chunks[-1]
    assert last.finish_reason == "stop"
    text = "".join(c.text for c in chunks)
    tags = json.loads(text)["tags"]
    assert len(tags) == 3 and len(set(tags)) < 3  # what the grammar let through
    assert last.schema_check == "invalid"
    assert [(v.keyword, v.instance_pointer) for v in last.schema_violations] == [("uniqueItems", "/tags")]
    assert "non-unique" in last.schema_violations[0].message
    assert sample("inference_svc_schema_checks_total", {"result": "invalid"}, inference_server) == invalid + 1
    assert sample("grammar_svc_output_violations_total", {"keyword": "uniqueItems"}, grammar_server) == unique + 1


def test_warnings_arrive_in_the_first_response_only(inference_client):
    chunks = list(inference_client.generate("tags:", json_schema=PIGEONHOLE, max_tokens=48, temperature=1.0,
                                            seed=3))
    assert len(chunks) > 1
    assert [(w.keyword, w.json_pointer) for w in chunks[0].warnings] == [("uniqueItems", "/properties/tags")]
    assert "uniqueItems" in chunks[0].warnings[0].message
    assert all(not c.warnings for c in chunks[1:])
    assert all(c.schema_check is None for c in chunks[:-1])


def test_a_valid_output_carries_no_violation(inference_client, inference_server):
    valid = sample("inference_svc_schema_checks_total", {"result": "valid"}, inference_server)
    out = inference_client.complete("point:", json_schema=ENFORCED, max_tokens=48, temperature=1.0, seed=11)
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), ENFORCED)
    assert out.schema_check == "valid" and out.schema_violations == [] and out.warnings == []
    assert sample("inference_svc_schema_checks_total", {"result": "valid"}, inference_server) == valid + 1


@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(json_schema=ENFORCED, max_tokens=2), id="length-no-document"),
    pytest.param(dict(regex="[a-z]{3}", max_tokens=16), id="not-a-schema"),
    pytest.param(dict(max_tokens=4), id="unconstrained"),
])
def test_nothing_to_check_is_not_checked(inference_client, kwargs):
    out = inference_client.complete("x", temperature=1.0, seed=5, **kwargs)
    assert out.schema_check is None and out.schema_violations == []


def test_strict_schema_refuses_unenforced_keywords_by_name(inference_client):
    schema = {"type": "object", "properties": {"tags": PIGEONHOLE["properties"]["tags"],
                                               "day": {"type": "string", "format": "color"}},
              "required": ["tags", "day"]}
    with pytest.raises(InferenceError) as err:
        inference_client.complete("tags:", json_schema=schema, strict_schema=True, max_tokens=32)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "strict_schema" in err.value.message
    assert "uniqueItems at /properties/tags" in err.value.message
    assert "format at /properties/day" in err.value.message


def test_strict_schema_generates_what_the_grammar_enforces(inference_client):
    out = inference_client.complete("point:", json_schema=ENFORCED, strict_schema=True, max_tokens=48,
                                    temperature=1.0, seed=2)
    assert out.finish_reason == "stop" and out.schema_check == "valid"


# An if/then on a required discriminator: structd's normalisation applies it (one anyOf case per kind).
DISCRIMINATED = {"type": "object", "properties": {"kind": {"enum": ["point", "label"]}, "x": {"type": "integer"},
                                                  "text": {"type": "string", "maxLength": 8}},
                 "required": ["kind"], "additionalProperties": False,
                 "if": {"properties": {"kind": {"const": "point"}}}, "then": {"required": ["x"]},
                 "else": {"required": ["text"]}}


def test_strict_schema_serves_an_if_then_the_grammar_applies(inference_client):
    """xgrammar ignores if/then, but where normalisation rewrites it into cases the grammar enforces it: no
    warning names it, and a strict_schema request is generated, not refused."""
    out = inference_client.complete("shape:", json_schema=DISCRIMINATED, strict_schema=True, max_tokens=64,
                                    temperature=1.0, seed=3)
    assert out.warnings == []
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), DISCRIMINATED)
        assert out.schema_check == "valid"


@pytest.mark.parametrize("kwargs, needle", [
    pytest.param(dict(regex="[a-z]+"), "strict_schema applies to json_schema only", id="regex"),
    pytest.param(dict(json_schema=ENFORCED, tools=[{"name": "f", "parameters": {"type": "object"}}]),
                 "strict_schema cannot be combined with tools", id="tools"),
])
def test_strict_schema_is_for_json_schema_alone(inference_client, kwargs, needle):
    prompt = [{"role": "user", "content": "hi"}] if "tools" in kwargs else "x"
    with pytest.raises(InferenceError) as err:
        inference_client.complete(prompt, strict_schema=True, max_tokens=8, **kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.message


@pytest.fixture
def pigeonhole_file(tmp_path):
    path = tmp_path / "pigeonhole.json"
    path.write_text(json.dumps(PIGEONHOLE))
    return str(path)


def test_generate_json_line_carries_the_check_and_exits_3(inference_server, pigeonhole_file, capsys):
    from structd import generate

    code = generate.main(["--target", inference_server.target, "--json", "--json-schema", pigeonhole_file,
                          "--max-tokens", "48", "--temperature", "1", "--seed", "4", "tags:"])
    line = json.loads(capsys.readouterr().out)
    assert code == generate.EXIT_SCHEMA_VIOLATED
    assert line["schema_check"] == "invalid"
    assert [(v["keyword"], v["instance_pointer"]) for v in line["schema_violations"]] == [("uniqueItems", "/tags")]
    assert [(w["keyword"], w["json_pointer"]) for w in line["warnings"]] == [("uniqueItems", "/properties/tags")]


def test_generate_text_reports_the_check_on_stderr(inference_server, pigeonhole_file, capsys):
    from structd import generate

    code = generate.main(["--target", inference_server.target, "--json-schema", pigeonhole_file,
                          "--max-tokens", "48", "--temperature", "1", "--seed", "4", "tags:"])
    out = capsys.readouterr()
    assert code == generate.EXIT_SCHEMA_VIOLATED
    json.loads(out.out)  # stdout stays exactly the text
    assert "warning: /properties/tags: uniqueItems" in out.err
    assert "schema violation: uniqueItems at /tags" in out.err


def test_generate_strict_schema_refuses(inference_server, pigeonhole_file, capsys):
    from structd import generate

    code = generate.main(["--target", inference_server.target, "--json-schema", pigeonhole_file, "--strict-schema",
                          "tags:"])
    assert code == 1
    assert "uniqueItems at /properties/tags" in capsys.readouterr().err


def test_generate_strict_schema_needs_a_schema(inference_server, capsys):
    from structd import generate

    assert generate.main(["--target", inference_server.target, "--regex", "[a-z]+", "--strict-schema", "x"]) == 2
    assert "--strict-schema needs --json-schema" in capsys.readouterr().err


def test_a_check_past_its_deadline_says_unchecked_and_holds_up_no_one(inference_client, inference_server):
    unchecked = sample("inference_svc_schema_checks_total", {"result": "unchecked"}, inference_server)
    slow, box = background_complete(inference_server.target, prompt="x", json_schema=SLOW, max_tokens=64)
    other = inference_client.complete("point:", json_schema=ENFORCED, max_tokens=48, temperature=1.0, seed=1)
    assert other.schema_check == "valid"
    assert "out" not in box, "the slow check's request answered before a request started after it"
    slow.join(120)
    out = box["out"]
    assert out.text == '"' + "a" * 60 + '!"' and out.finish_reason == "stop"
    assert out.schema_check == "unchecked" and out.schema_violations == []
    assert "--schema-check-timeout-seconds" in out.schema_check_detail
    assert sample("inference_svc_schema_checks_total", {"result": "unchecked"}, inference_server) == unchecked + 1
