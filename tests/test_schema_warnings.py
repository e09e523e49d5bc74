"""Pins grammar_svc/schema/schema_warnings.py to what xgrammar 0.2.8 really does.

For every keyword the scanner calls ignored (and every format it calls not
enforced) a schema using it is compiled with xgrammar directly, with the
options the service would use, and an instance that violates the keyword is
shown to be accepted anyway; for `contains`, a valid instance is rejected.
Each violating instance is first checked to really be invalid with the
`jsonschema` reference validator, so the test cannot pass on a wrong example.
For every enforced format an invalid string is rejected (and a valid one
accepted). An xgrammar upgrade that starts enforcing a keyword fails here,
which is the signal to drop it from the table.

Through the service, Compile reports the scanner's warnings with the right
JSON pointers for a nested schema, plus xgrammar's own stderr warnings.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from grammar_svc.schema.schema_warnings import (ENFORCED_FORMATS, FORMAT_BESIDE_PATTERN, IGNORED_KEYWORDS,
                                                MAX_WARNINGS, scan)
from grammar_svc.types import JsonOptions
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient
from tests.conftest import run

STRICT = JsonOptions()  # the service default: compact, strict
# Some keywords only matter where extra properties/items are allowed at all,
# i.e. with JsonSchemaOptions.lenient (strict mode forbids them anyway).
LENIENT = JsonOptions(lenient=True)

INT = {"type": "integer"}


@pytest.fixture(scope="module")
def compiler(xgr_tokenizer_info):
    return xgr.GrammarCompiler(xgr_tokenizer_info)


@pytest.fixture(scope="module")
def stop_token(xgr_tokenizer_info):
    return xgr_tokenizer_info.stop_token_ids[0]


def compile_schema(compiler, schema, options: JsonOptions):
    return compiler.compile_json_schema(json.dumps(schema), **options.xgrammar_kwargs())


def accepts(compiled, instance, stop_token) -> bool:
    """Whether the grammar accepts the compact serialization of instance, then stops."""
    matcher = xgr.GrammarMatcher(compiled)
    text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
    return matcher.accept_string(text) and matcher.accept_token(stop_token) and matcher.is_terminated()


def spec_valid(schema, instance, validator=jsonschema.Draft202012Validator) -> bool:
    return validator(schema, format_checker=validator.FORMAT_CHECKER).is_valid(instance)


# keyword -> (schema, instance that violates the keyword, options, reference validator)
IGNORED_CASES = {
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, [1, 1], STRICT,
                    jsonschema.Draft202012Validator),
    "not": ({"type": "integer", "not": {"const": 3}}, 3, STRICT, jsonschema.Draft202012Validator),
    "if": ({"type": "object", "properties": {"a": INT, "b": {"type": "string"}},
            "if": {"properties": {"a": {"const": 1}}, "required": ["a"]}, "then": {"required": ["b"]}},
           {"a": 1}, STRICT, jsonschema.Draft202012Validator),
    "dependencies": ({"type": "object", "properties": {"a": INT, "b": INT}, "dependencies": {"a": ["b"]}},
                     {"a": 1}, STRICT, jsonschema.Draft7Validator),
    "dependentRequired": ({"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
                          {"a": 1}, STRICT, jsonschema.Draft202012Validator),
    "dependentSchemas": ({"type": "object", "properties": {"a": INT, "b": INT},
                          "dependentSchemas": {"a": {"required": ["b"]}}},
                         {"a": 1}, STRICT, jsonschema.Draft202012Validator),
    # A schema value does act like additionalProperties; `false` is dropped.
    "unevaluatedProperties": ({"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False},
                              {"a": 1, "x": 2}, LENIENT, jsonschema.Draft202012Validator),
    # Items a subschema evaluates are not tracked: the second item is unevaluated.
    "unevaluatedItems": ({"type": "array", "allOf": [{"prefixItems": [INT]}], "unevaluatedItems": False},
                         [1, 2], LENIENT, jsonschema.Draft202012Validator),
    # The tuple spelling it belongs to (items: [...]) does not compile at all
    # (see test_additional_items_tuple_form_is_refused); next to prefixItems
    # it does not bound the array either.
    "additionalItems": ({"type": "array", "prefixItems": [INT], "additionalItems": False},
                        [1, "x"], LENIENT, None),
    # Ignored where items are given (without them strict mode allows only []).
    "contains": ({"type": "array", "items": INT, "contains": {"const": 5}}, [1, 2], STRICT,
                 jsonschema.Draft202012Validator),
    "minContains": ({"type": "array", "items": INT, "contains": {"const": 5}, "minContains": 2}, [1, 1], STRICT,
                    jsonschema.Draft202012Validator),
    "maxContains": ({"type": "array", "items": INT, "contains": {"const": 5}, "maxContains": 1}, [5, 5], STRICT,
                    jsonschema.Draft202012Validator),
}


def test_every_ignored_keyword_has_a_case():
    assert set(IGNORED_CASES) == set(IGNORED_KEYWORDS)


@pytest.mark.parametrize("keyword", [pytest.param(k, id=k) for k in IGNORED_CASES])
def test_ignored_keyword_is_not_enforced(compiler, stop_token, keyword):
    schema, instance, options, validator = IGNORED_CASES[keyword]
    if validator is not None:
        assert not spec_valid(schema, instance, validator), "the example must violate the keyword"
    compiled = compile_schema(compiler, schema, options)
    assert accepts(compiled, instance, stop_token), f"xgrammar now enforces {keyword}: drop it from IGNORED_KEYWORDS"
    # The scanner names it at the root with the table's message.
    assert f"/: {IGNORED_KEYWORDS[keyword]}" in scan(schema)


def test_additional_items_tuple_form_is_refused(compiler, stop_token):
    tuple_schema = {"type": "array", "items": [INT], "additionalItems": False}
    assert not spec_valid(tuple_schema, [1, "x"], jsonschema.Draft201909Validator)
    with pytest.raises(RuntimeError, match="items must be a boolean or an object"):
        compile_schema(compiler, tuple_schema, LENIENT)


def test_contains_rejects_a_valid_instance(compiler, stop_token):
    # Without `items`, strict mode generates only the empty array, which
    # `contains` forbids, and rejects every array that satisfies it.
    schema = {"type": "array", "contains": {"const": 5}}
    compiled = compile_schema(compiler, schema, STRICT)
    assert spec_valid(schema, [5])
    assert not accepts(compiled, [5], stop_token)
    assert not spec_valid(schema, [])
    assert accepts(compiled, [], stop_token)


def test_unevaluated_schemas_act_like_additional(compiler, stop_token):
    # Why the table says "approximated" rather than "ignored" for these two.
    string = {"type": "string"}
    props = compile_schema(compiler, {"type": "object", "properties": {"a": INT}, "unevaluatedProperties": string},
                           LENIENT)
    assert accepts(props, {"a": 1, "x": "s"}, stop_token)
    assert not accepts(props, {"a": 1, "x": 2}, stop_token)
    items = compile_schema(compiler, {"type": "array", "prefixItems": [INT], "unevaluatedItems": string}, LENIENT)
    assert accepts(items, [1, "x"], stop_token)
    assert not accepts(items, [1, 2], stop_token)


def test_min_contains_acts_as_min_items(compiler, stop_token):
    # Without `contains`, minContains has no effect by the spec; xgrammar
    # applies it as minItems, so this valid instance is rejected.
    schema = {"type": "array", "items": INT, "minContains": 2}
    compiled = compile_schema(compiler, schema, STRICT)
    assert spec_valid(schema, [1])
    assert not accepts(compiled, [1], stop_token)
    assert accepts(compiled, [1, 1], stop_token)


# format -> (a valid string, an invalid string)
ENFORCED_CASES = {
    "email": ("a@example.com", "not an email"),
    "date": ("2024-01-31", "31/01/2024"),
    "time": ("12:34:56Z", "noon"),
    "date-time": ("2024-01-31T12:34:56Z", "yesterday"),
    "duration": ("P3D", "3 days"),
    "ipv4": ("192.168.0.1", "1.2.3"),
    "ipv6": ("::1", "gggg::1"),
    "hostname": ("example.com", "bad host name"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "123e4567"),
    "uri": ("https://example.com/x", "not a uri"),
    "uri-reference": ("/path/x", "a b"),
    "uri-template": ("https://example.com/{id}", "https://example.com/{id"),
    "json-pointer": ("/a/b", "a/b"),
    "relative-json-pointer": ("0/a", "/a"),
}

# Formats xgrammar ignores -> a string that violates them.
NOT_ENFORCED_CASES = {
    "idn-email": "not an email",
    "idn-hostname": "bad host name",
    "iri": "not an iri",
    "iri-reference": "a b",
    "regex": "(unclosed",
    "color": "not a color",
    "phone": "call me",
    "int32": "x",
}


def test_every_enforced_format_has_a_case():
    assert set(ENFORCED_CASES) == set(ENFORCED_FORMATS)
    assert not set(NOT_ENFORCED_CASES) & ENFORCED_FORMATS


@pytest.mark.parametrize("fmt", [pytest.param(f, id=f) for f in ENFORCED_CASES])
def test_enforced_format_rejects_invalid_strings(compiler, stop_token, fmt):
    good, bad = ENFORCED_CASES[fmt]
    schema = {"type": "string", "format": fmt}
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    if fmt in checker.checkers:
        assert checker.conforms(good, fmt) and not checker.conforms(bad, fmt)
    compiled = compile_schema(compiler, schema, STRICT)
    assert accepts(compiled, good, stop_token)
    assert not accepts(compiled, bad, stop_token)
    assert not [w for w in scan(schema) if "format" in w]


@pytest.mark.parametrize("fmt", [pytest.param(f, id=f) for f in NOT_ENFORCED_CASES])
def test_unenforced_format_accepts_anything(compiler, stop_token, fmt):
    bad = NOT_ENFORCED_CASES[fmt]
    schema = {"type": "string", "format": fmt}
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    if fmt in checker.checkers:
        assert not checker.conforms(bad, fmt)
    compiled = compile_schema(compiler, schema, STRICT)
    assert accepts(compiled, bad, stop_token), f"xgrammar now enforces format {fmt}: add it to ENFORCED_FORMATS"
    assert scan(schema) == [f"/: format {fmt!r} is not enforced: any string is allowed"]


def test_enforced_format_beside_a_pattern_is_named_and_not_enforced(compiler, stop_token):
    from grammar_svc.schema.json_grammar import compile_json_schema

    schema = {"type": "string", "format": "date", "pattern": "^[0-9]{2}$"}
    assert scan(schema) == [f"/: {FORMAT_BESIDE_PATTERN.format(fmt='date')}"]
    assert not spec_valid(schema, "99") and not spec_valid(schema, "2024-01-31")
    compiled = compile_json_schema(compiler, json.dumps(schema), STRICT)
    assert accepts(compiled, "99", stop_token)  # the pattern's, not a date
    assert not accepts(compiled, "2024-01-31", stop_token)


def test_xgrammar_warned_keywords_are_really_not_enforced(compiler, stop_token):
    # The two stderr warnings the service forwards describe real gaps.
    number = {"type": "number", "multipleOf": 0.5}
    assert not spec_valid(number, 0.3)
    assert accepts(compile_schema(compiler, number, STRICT), 0.3, stop_token)
    bounded = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}
    assert not spec_valid(bounded, "abcdef")
    assert accepts(compile_schema(compiler, bounded, STRICT), "abcdef", stop_token)


def test_scan_is_bounded_and_deduplicated():
    many = {"type": "object", "properties": {f"p{i}": {"type": "array", "uniqueItems": True} for i in range(200)}}
    found = scan(many)
    assert len(found) == MAX_WARNINGS
    assert len(set(found)) == len(found)
    assert scan({"type": "object", "properties": {"a": INT}}) == []


NESTED = {
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "format": "color"}, "uniqueItems": True},
        "a/b~c": {"type": "integer", "not": {"const": 0}},
        "meta": {"anyOf": [{"type": "string"}, {"type": "array", "items": INT, "maxContains": 2,
                                                "contains": {"const": 1}}]},
        "price": {"type": "number", "multipleOf": 0.01},
        "code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 4},
    },
    "required": ["tags"],
    "dependentRequired": {"tags": ["code"]},
    "$defs": {"when": {"type": "string", "format": "date"}, "site": {"type": "string", "format": "iri"}},
}

NESTED_EXPECTED = {
    f"/properties/tags: {IGNORED_KEYWORDS['uniqueItems']}",
    "/properties/tags/items: format 'color' is not enforced: any string is allowed",
    f"/properties/a~1b~0c: {IGNORED_KEYWORDS['not']}",
    f"/properties/meta/anyOf/1: {IGNORED_KEYWORDS['contains']}",
    f"/properties/meta/anyOf/1: {IGNORED_KEYWORDS['maxContains']}",
    f"/: {IGNORED_KEYWORDS['dependentRequired']}",
    "/$defs/site: format 'iri' is not enforced: any string is allowed",
    # xgrammar's own, from the compile worker's stderr
    "multipleOf is not supported for type:number; ignoring multipleOf",
    # Not xgrammar's "pattern combined with minLength/maxLength ... ignoring minLength/maxLength": structd folds
    # /properties/code's maxLength into its one-class pattern before xgrammar sees it, so both are enforced.
}


def test_compile_reports_warnings_with_json_pointers(registered):
    async def go():
        client = GrammarClient(registered.target)
        try:
            spec = pb.GrammarSpec(json_schema=pb.JsonSchema(schema=json.dumps(NESTED)))
            first = await client.compile(registered.fingerprint, spec, rpc_timeout=60)
            again = await client.compile(registered.fingerprint, spec, rpc_timeout=60)
            return first, again
        finally:
            await client.close()

    first, again = run(go())
    warnings = list(first.warnings)
    assert len(warnings) == len(set(warnings))
    assert set(warnings) == NESTED_EXPECTED
    assert again.cache_hit and list(again.warnings) == warnings


def compiled(registered, schema: dict):
    """The grammar server's CompileResponse for `schema`."""

    async def go():
        client = GrammarClient(registered.target)
        try:
            spec = pb.GrammarSpec(json_schema=pb.JsonSchema(schema=json.dumps(schema)))
            return await client.compile(registered.fingerprint, spec, rpc_timeout=60)
        finally:
            await client.close()

    return run(go())


def test_compile_without_gaps_has_no_warnings(registered):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3},
                                               "d": {"type": "string", "format": "date"}}}
    assert list(compiled(registered, schema).warnings) == []


# normalise applies this if/then (the discriminator is required: one anyOf case per value); not that one (its
# condition is on a property that may be absent), which stays as written for xgrammar to ignore.
APPLIED_IF = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "x": {"type": "string"}},
              "required": ["kind"], "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["x"]}}
IGNORED_IF = {"type": "object", "properties": {"x": {"type": "string"}},
              "if": {"required": ["x"]}, "then": {"properties": {"x": {"maxLength": 3}}}}


@pytest.mark.parametrize("schema, expected", [
    pytest.param(APPLIED_IF, [], id="applied-if-not-named"),
    pytest.param(IGNORED_IF, [f"/: {IGNORED_KEYWORDS['if']}"], id="ignored-if-named"),
    pytest.param({**APPLIED_IF, "uniqueItems": True}, [f"/: {IGNORED_KEYWORDS['uniqueItems']}"],
                 id="applied-if-beside-an-ignored-keyword"),
])
def test_compile_names_an_if_only_where_the_grammar_ignores_it(registered, schema, expected):
    assert list(compiled(registered, schema).warnings) == expected
