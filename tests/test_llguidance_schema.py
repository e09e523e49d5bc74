"""The schema llguidance's grammar is built from (grammar_svc/schema/llguidance_schema.py), with real llguidance.

Recursive schemas llguidance refused ("circular references with sibling keys are not supported") compile
after the rewrite, and the grammar accepts what the original schema accepts: each document, checked against
the original with jsonschema (the validator its `$schema` names, as the output check does), is taken token by
token and ended by the service's LlguidanceMatcher exactly when it is valid. A schema whose draft applies the
keywords beside a `$ref` keeps them, and stays refused.
"""

from __future__ import annotations

import json

import pytest

from grammar_svc.compile.llguidance_backend import LlguidanceMatcher, compile_llguidance
from grammar_svc.compile.spec import GrammarSpec
from grammar_svc.schema.llguidance_schema import llguidance_schema
from grammar_svc.types import Kind
from shared.errors import InvalidGrammarError

DRAFT_04 = "http://json-schema.org/draft-04/schema#"

# A tree whose children say `"type": "object"` and `"required": ["children"]` beside their `$ref`: ignored up
# to draft 7, so a leaf without children is valid.
TREE = {
    "$schema": DRAFT_04,
    "definitions": {"node": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 3},
                       "children": {"type": "array", "items": {"$ref": "#/definitions/node", "type": "object",
                                                               "required": ["children"]}}},
        "required": ["name"], "additionalProperties": False}},
    "$ref": "#/definitions/node",
}
# WashingtonPost's shape: a property whose schema is (but for its title) that of the pattern its name matches,
# referring back to the definition being built.
CREDITS = {
    "definitions": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3},
                                                    "credits": {"$ref": "#/definitions/credits"}},
                   "required": ["name"], "additionalProperties": False},
        "credits": {"type": "object",
                    "properties": {"by": {"title": "By", "type": "array", "items": {"$ref": "#/definitions/person"}}},
                    "patternProperties": {"^[a-z_]*": {"type": "array", "items": {"$ref": "#/definitions/person"}}}},
    },
    "$ref": "#/definitions/person",
}


def documents(schema: dict) -> list[tuple[object, bool]]:
    """(document, valid under the original schema) for the schema's test documents."""
    if schema.get("$schema") == DRAFT_04:  # TREE
        docs = [{"name": "a"}, {"name": "a", "children": []}, {"name": "a", "children": [{"name": "b"}]},
                {"name": "a", "children": [{"name": "b", "children": [{"name": "c"}]}]},
                {"name": "abcd"}, {"name": "a", "children": [{"name": "bcde"}]}, {"name": "a", "x": 1},
                {"name": "a", "children": [{}]}, {"children": []}]
    else:  # CREDITS
        docs = [{"name": "a"}, {"name": "a", "credits": {"by": [{"name": "b"}]}},
                {"name": "a", "credits": {"by": [], "photos_by": [{"name": "b", "credits": {}}]}},
                {"name": "a", "credits": {"by": [{"name": "bcde"}]}},
                {"name": "a", "credits": {"photos_by": [{"name": "b", "x": 1}]}},
                {"name": "a", "credits": {"by": [{}]}}]
    from jsonschema import Draft202012Validator, validators

    validator = validators.validator_for(schema, default=Draft202012Validator)(schema)
    return [(d, validator.is_valid(d)) for d in docs]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_desc):
    from grammar_svc.compile.tokenizer_registry import TokenizerRegistry

    tok, _, _ = TokenizerRegistry(1, set).register(tokenizer_desc.fingerprint, tokenizer_desc.compressed_info(),
                                                   tokenizer_desc.compressed_hf())
    return tok


def takes(compiled, hf_tokenizer, stop: int, document) -> bool:
    """Whether the grammar takes the document's tokens, then ends on a stop token."""
    matcher = LlguidanceMatcher(compiled)
    tokens = hf_tokenizer.encode(json.dumps(document, separators=(",", ":")), add_special_tokens=False)
    return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(stop) and matcher.is_terminated()


@pytest.mark.parametrize("schema", [pytest.param(TREE, id="ref-siblings-draft-04"),
                                    pytest.param(CREDITS, id="property-as-its-pattern")])
def test_a_refused_recursive_schema_compiles_and_accepts_what_the_original_accepts(tokenizer, hf_tokenizer,
                                                                                   schema):
    import llguidance

    # llguidance on the schema as it is.
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_json_schema(schema), None)
    assert is_error and "circular references with sibling keys" in messages[0], messages
    compiled = compile_llguidance(tokenizer, GrammarSpec(Kind.JSON_SCHEMA, json.dumps(schema)))
    stop = min(compiled.stop_token_ids)
    cases = documents(schema)
    assert {valid for _, valid in cases} == {True, False}
    for document, valid in cases:
        assert takes(compiled, hf_tokenizer, stop, document) is valid, document


NAMED = {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "integer"},
         "maxProperties": 2}


def test_property_names_pattern_is_enforced(tokenizer, hf_tokenizer):
    """llguidance ignores propertyNames (xgrammar enforces it): written as patternProperties, it is enforced."""
    from jsonschema import Draft202012Validator

    compiled = compile_llguidance(tokenizer, GrammarSpec(Kind.JSON_SCHEMA, json.dumps(NAMED)))
    assert not any(w.startswith("propertyNames") for w in compiled.warnings), compiled.warnings
    stop = min(compiled.stop_token_ids)
    cases = [({}, True), ({"ab": 1}, True), ({"ab": 1, "c": 2}, True), ({"a b": 1}, False), ({"AB": 1}, False),
             ({"ab": "x"}, False)]
    for document, valid in cases:
        assert Draft202012Validator(NAMED).is_valid(document) is valid, document
        assert takes(compiled, hf_tokenizer, stop, document) is valid, document


def test_where_the_draft_applies_ref_siblings_they_stay_and_llguidance_refuses(tokenizer):
    schema = {**TREE, "$schema": "https://json-schema.org/draft/2020-12/schema"}
    assert llguidance_schema(schema) == schema
    with pytest.raises(InvalidGrammarError, match="circular references with sibling keys"):
        compile_llguidance(tokenizer, GrammarSpec(Kind.JSON_SCHEMA, json.dumps(schema)))


UNCHANGED = None


@pytest.mark.parametrize("schema, expected", [
    pytest.param({"$schema": DRAFT_04, "properties": {"default": {"$ref": "#/x", "type": "string"}},
                  "enum": [{"$ref": "#/x", "type": "string"}]},
                 {"$schema": DRAFT_04, "properties": {"default": {"$ref": "#/x"}},
                  "enum": [{"$ref": "#/x", "type": "string"}]}, id="data-kept-names-walked"),
    pytest.param({"$ref": "#/x", "type": "string"}, UNCHANGED, id="no-draft-kept"),
    pytest.param({"properties": {"by": {"type": "string", "title": "t"}},
                  "patternProperties": {"^c": {"type": "string"}}}, UNCHANGED, id="name-matching-no-pattern-kept"),
    pytest.param({"properties": {"by": {"type": "string", "maxLength": 2}},
                  "patternProperties": {"b": {"type": "string"}}}, UNCHANGED, id="narrower-property-kept"),
    pytest.param({"properties": {"by": {"type": "string"}}, "patternProperties": {"(": {"type": "string"}}},
                 UNCHANGED, id="unreadable-pattern-kept"),
    pytest.param({"properties": {"a" * 40 + "!": {"type": "string"}}, "patternProperties": {"^(a+)+$": {"type": "string"}}},
                 UNCHANGED, id="a-pattern-a-name-could-make-slow-is-not-run"),
    pytest.param({"properties": {"by": {"const": 1}}, "patternProperties": {"^b": {"const": True}}}, UNCHANGED,
                 id="true-is-not-1-kept"),
    pytest.param({"properties": {"by": {"type": "string", "title": "t"}},
                  "patternProperties": {"^[a-zA-Z0-9_]*": {"type": "string"}}},
                 {"properties": {"by": {"title": "t"}}, "patternProperties": {"^[a-zA-Z0-9_]*": {"type": "string"}}},
                 id="one-class-repeated-decides"),
    pytest.param(NAMED, {"type": "object", "patternProperties": {"^[a-z]+$": {"type": "integer"}},
                         "additionalProperties": False, "maxProperties": 2}, id="property-names-pattern"),
    pytest.param({"propertyNames": {"pattern": "^a"}, "properties": {"b": {}}}, UNCHANGED,
                 id="property-names-beside-properties-kept"),
    pytest.param({"propertyNames": {"pattern": "^(?!a)"}}, UNCHANGED, id="property-names-lookaround-kept"),
    pytest.param({"propertyNames": {"pattern": "^a"}, "additionalProperties": False},
                 {"additionalProperties": False}, id="property-names-of-no-property-dropped"),
])
def test_rewrites_only_what_keeps_the_meaning(schema, expected):
    assert llguidance_schema(schema) == (schema if expected is UNCHANGED else expected)


# Shapes schema_normalise.py rewrites for both backends (llguidance applies oneOf as anyOf and ignores if/then):
# oneOf branches told apart by `t` (MaskBench's Github_easy/o13129), a union written as if/then on a required
# `k` (JsonSchemaStore's gradle-enterprise-config-schema-7); and a pattern beside a format, which llguidance
# enforces both of (xgrammar's schema loses the format: json_grammar.py).
TAGGED = {"type": "object", "oneOf": [{"properties": {"t": {"const": 1}, "v": {"type": "string"}}},
                                      {"properties": {"t": {"const": 2}, "v": {"type": ["string", "integer"]}}}]}
CASES_BY_IF = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"],
               "if": {"properties": {"k": {"const": "a"}}}, "then": {"required": ["n"]},
               "else": {"properties": {"n": False}}}
DATE_20 = {"type": "string", "format": "date", "pattern": "^20"}


@pytest.mark.parametrize("schema, cases", [
    pytest.param(TAGGED, [({"t": 1, "v": "x"}, True), ({"t": 2, "v": 3}, True), ({}, False), ({"v": "x"}, False),
                          ({"t": 3}, False)], id="one-of-told-apart"),
    pytest.param({"type": "object", "oneOf": [{"properties": {"e": {}}, "additionalProperties": False},
                                              {"properties": {"o": {}}, "additionalProperties": False}]},
                 [({"e": 1}, True), ({"o": []}, True), ({}, False)], id="one-of-closed-branches"),
    pytest.param(CASES_BY_IF, [({"k": "a", "n": 1}, True), ({"k": "b"}, True), ({"k": "a"}, False),
                               ({"k": "b", "n": 1}, False)], id="if-then-cases"),
    pytest.param(DATE_20, [("2024-01-01", True), ("1999-01-01", False), ("20240101", False)],
                 id="format-and-pattern"),
])
def test_normalised_shapes_are_enforced(tokenizer, hf_tokenizer, schema, cases):
    from jsonschema import Draft202012Validator, FormatChecker

    compiled = compile_llguidance(tokenizer, GrammarSpec(Kind.JSON_SCHEMA, json.dumps(schema)))
    stop = min(compiled.stop_token_ids)
    for document, valid in cases:
        assert Draft202012Validator(schema, format_checker=FormatChecker()).is_valid(document) is valid, document
        assert takes(compiled, hf_tokenizer, stop, document) is valid, document


def test_a_stop_token_is_allowed_only_where_the_document_may_end(tokenizer, hf_tokenizer):
    """A stop token's text fits in a JSON string: llguidance must read it as a special token, never as text
    (the validity run's unterminated document, JsonSchemaStore's dart-test)."""
    import numpy as np
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    compiled = compile_llguidance(tokenizer, GrammarSpec(Kind.JSON_SCHEMA, json.dumps(schema)))
    matcher = LlguidanceMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, tokenizer.vocab_size)
    words = bitmask[0].numpy().view(np.uint32)
    allowed = []
    for token in hf_tokenizer.encode('{"a":"x"}', add_special_tokens=False):
        matcher.fill_next_token_bitmask(bitmask)
        allowed.append([bool(int(words[s >> 5]) >> (s & 31) & 1) for s in compiled.stop_token_ids])
        assert matcher.accept_token(token)
    matcher.fill_next_token_bitmask(bitmask)
    assert not any(any(a) for a in allowed), allowed
    assert all(int(words[s >> 5]) >> (s & 31) & 1 for s in compiled.stop_token_ids)
