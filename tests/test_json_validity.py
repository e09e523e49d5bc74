"""structd's JSON-Schema grammar admits only documents valid against the schema (grammar_svc/schema/json_grammar.py).

Each fix is checked at the mask level: the compiled grammar (real xgrammar,
real tokenizer) takes a document token by token, every token inside the
mask of a real GrammarMatcher, and ends where the stop token is allowed; or
refuses it at some token. Schemas from the JSONSchemaBench sample where
xgrammar alone admits invalid documents are regression cases: seeded random
walks through their masks write documents that validate with `jsonschema`.
"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from grammar_svc.schema.json_grammar import GRAMMAR_REVISION, compile_json_schema, normalised_schema_text
from grammar_svc.schema.schema_normalise import normalise_schema
from grammar_svc.compile.spec import GrammarSpec
from grammar_svc.types import JsonOptions, Kind
from structd.bench.validity import CLOSING, walk
from tests.conftest import load_jsonl, shared_data


@pytest.fixture(scope="module")
def compiler(xgr_tokenizer_info):
    return xgr.GrammarCompiler(xgr_tokenizer_info, max_threads=2)


def structd_grammar(compiler, schema, rewrite: bool = True):
    return compile_json_schema(compiler, json.dumps(schema), JsonOptions(), rewrite=rewrite)


def admits(grammar, hf_tokenizer, text: str) -> bool:
    """Whether the grammar takes `text` token by token (each token in its mask) and may then stop."""
    matcher = xgr.GrammarMatcher(grammar)
    vocab = grammar.tokenizer_info.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    words = bitmask[0].numpy().view(np.uint32)
    for t in hf_tokenizer.encode(text, add_special_tokens=False) + [hf_tokenizer.eos_token_id]:
        matcher.fill_next_token_bitmask(bitmask)
        if not (int(words[t >> 5]) >> (t & 31)) & 1:
            return False
        assert matcher.accept_token(t), "a token inside the mask must be accepted"
    return matcher.is_terminated()


# ----------------------------------------------------------------------------- JSON strings

BOUNDED = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
           "required": ["s"]}
LONG_BOUND = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 500}}, "required": ["s"]}
MIN_ONLY = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2}}, "required": ["s"]}
ONE_CHAR = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 1}},
            "required": ["s"]}

STRING_CASES = [
    # (schema, the string value as it appears in the document, admitted)
    pytest.param(BOUNDED, '"ab"', True, id="plain"),
    pytest.param(BOUNDED, '"a\tb"', False, id="raw-tab"),
    pytest.param(BOUNDED, '"a\nb"', False, id="raw-newline"),
    pytest.param(BOUNDED, '"a\x01b"', False, id="raw-control"),
    pytest.param(BOUNDED, '"a\\tb"', True, id="escaped-tab"),
    pytest.param(BOUNDED, '"\\"\\\\"', True, id="escaped-quote-and-backslash"),
    pytest.param(BOUNDED, '"\\u00e9\\/"', True, id="unicode-escape"),
    pytest.param(BOUNDED, '"\\n\\n\\n\\n"', True, id="four-escapes-are-four-characters"),
    pytest.param(BOUNDED, '"\\n\\n\\n\\n\\n"', False, id="five-escapes-are-too-many"),
    pytest.param(BOUNDED, '"\\n"', False, id="one-escape-is-too-few"),
    pytest.param(BOUNDED, '"abcde"', False, id="too-long"),
    pytest.param(BOUNDED, '"\\ud83d\\ude00x"', True, id="surrogate-pair-is-one-character"),
    pytest.param(BOUNDED, '"\\ud83dx"', False, id="lone-surrogate"),
    pytest.param(BOUNDED, '"\\q"', False, id="unknown-escape"),
    pytest.param(LONG_BOUND, '"a\tb"', False, id="long-bound-raw-tab"),
    pytest.param(LONG_BOUND, '"a\\tb\\""', True, id="long-bound-escapes"),
    pytest.param(MIN_ONLY, '"\\t\\u0041"', True, id="min-only-escapes"),
    pytest.param(MIN_ONLY, '"x\ty"', False, id="min-only-raw-tab"),
    pytest.param(ONE_CHAR, '"\\""', True, id="one-character-escape"),
    pytest.param(ONE_CHAR, '"\t"', False, id="one-character-raw-tab"),
]


@pytest.mark.parametrize("rewrite", [pytest.param(True, id="tail-form"), pytest.param(False, id="xgrammar-form")])
@pytest.mark.parametrize("schema, value, admitted", STRING_CASES)
def test_bounded_strings_are_json_strings(compiler, hf_tokenizer, schema, value, admitted, rewrite):
    doc = '{"s":' + value + "}"
    assert admits(structd_grammar(compiler, schema, rewrite), hf_tokenizer, doc) is admitted
    if admitted:
        jsonschema.validate(json.loads(doc), schema)


UNBOUNDED = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}


@pytest.mark.parametrize("schema", [pytest.param(UNBOUNDED, id="unbounded"), pytest.param(BOUNDED, id="bounded")])
def test_strings_never_hold_an_encoded_surrogate(compiler, hf_tokenizer, xgr_tokenizer_info, token_bytes, schema):
    """Byte tokens: after ED, A0 would start U+D800 (not UTF-8, no parser reads it); 80 starts U+D000."""
    byte_token = {t: i for i, t in enumerate(token_bytes) if len(t) == 1}
    grammar = structd_grammar(compiler, schema)
    matcher = xgr.GrammarMatcher(grammar)
    for t in hf_tokenizer.encode('{"s":"', add_special_tokens=False) + [byte_token[b"\xed"]]:
        assert matcher.accept_token(t)
    bitmask = xgr.allocate_token_bitmask(1, xgr_tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    words = bitmask[0].numpy().view(np.uint32)
    allowed = {b: bool((int(words[byte_token[b] >> 5]) >> (byte_token[b] & 31)) & 1) for b in (b"\xa0", b"\x80")}
    assert allowed == {b"\xa0": False, b"\x80": True}


# ----------------------------------------------------------------------------- pattern and format strings

# A literal backslash, then the letter d (a schema author's over-escaped `\d`, as in Github_medium/o36798).
BACKSLASH_D = {"type": "string", "pattern": "^\\\\d+/\\\\d+$"}
BACKSLASH_ANY = {"type": "string", "pattern": "^\\\\.$"}  # a literal backslash, then any one character
QUOTE_INSIDE = {"type": "string", "pattern": '^a"b$'}
JSON_POINTER = {"type": "string", "format": "json-pointer"}
EMAIL = {"type": "string", "format": "email"}

REGEX_STRING_CASES = [
    # (schema, the string as it appears in the document, admitted)
    pytest.param(BACKSLASH_D, r'"\\dd/\\d"', True, id="pattern-backslash-escaped"),
    pytest.param(BACKSLASH_D, r'"\dd/\d"', False, id="pattern-backslash-raw"),
    pytest.param(BACKSLASH_ANY, r'"\\x"', True, id="dot-plain"),
    pytest.param(BACKSLASH_ANY, r'"\\""', False, id="dot-raw-quote"),
    pytest.param(BACKSLASH_ANY, r'"\\\""', True, id="dot-escaped-quote"),
    pytest.param(BACKSLASH_ANY, '"\\\\\t"', False, id="dot-raw-tab"),
    pytest.param(BACKSLASH_ANY, r'"\\\t"', True, id="dot-escaped-tab"),
    pytest.param(BACKSLASH_ANY, r'"\\\u0001"', True, id="dot-unicode-escape"),
    pytest.param(QUOTE_INSIDE, '"a"b"', False, id="pattern-quote-raw"),
    pytest.param(QUOTE_INSIDE, r'"a\"b"', True, id="pattern-quote-escaped"),
    pytest.param(JSON_POINTER, r'"/a\"b"', True, id="json-pointer-escaped-quote"),
    pytest.param(JSON_POINTER, '"/a"b"', False, id="json-pointer-raw-quote"),
    pytest.param(JSON_POINTER, r'"/a\\b"', True, id="json-pointer-escaped-backslash"),
    pytest.param(EMAIL, r'"\"a b\"@x.com"', True, id="email-quoted-local-part"),
]


@pytest.mark.parametrize("schema, value, admitted", REGEX_STRING_CASES)
def test_pattern_and_format_strings_are_json_strings(compiler, hf_tokenizer, schema, value, admitted):
    assert admits(structd_grammar(compiler, schema), hf_tokenizer, value) is admitted
    if admitted:
        jsonschema.validate(json.loads(value), schema)


# ----------------------------------------------------------------------------- declared types kept

OBJECT_WITH_ANY_OF = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                      "additionalProperties": False, "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}
ALL_OF = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"properties": {"b": {"type": "string"}}}]}
REF_TO_ALL_OF = {"$ref": "#/definitions/config", "definitions": {
    "base": {"type": "object", "properties": {"a": {"type": "integer"}}},
    "config": {"allOf": [{"$ref": "#/definitions/base"}, {"properties": {"b": {"type": "boolean"}}}]}}}
CLOSED_ALL_OF = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                           {"properties": {"b": {"type": "string"}}}]}
TYPED_ENUM = {"type": "string", "enum": ["a", 1, None]}
REQUIRED_UNLISTED = {"type": "object", "required": ["a"]}
# `dependencies` is draft 7's (2020-12, read where no $schema is named, has dependentRequired instead).
DEPENDENCIES = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a"], "dependencies": {"a": ["b"]}}
IF_THEN_PARTS = {"type": "object", "properties": {"m": {"type": "string"}}, "additionalProperties": False,
                 "allOf": [{"if": {"properties": {"m": {"const": "x"}}}, "then": {"required": ["m"]}},
                           {"if": {"properties": {"m": {"const": "y"}}}, "then": {"required": ["m"]}}]}
NOT_NUMBER = {"type": "object", "properties": {"foo": {"not": {"type": "number"}}}, "required": ["foo"]}
PATTERN_AND_LENGTH = {"type": "string", "pattern": "^[a-z_.]+$", "maxLength": 4, "minLength": 2}
# Each bound is tighter in one part than in the other: the merge keeps the larger lower and the smaller upper bound.
ALL_OF_NUMBER_BOUNDS = {"allOf": [{"type": "integer", "minimum": 2, "maximum": 7},
                                  {"minimum": 4, "maximum": 9, "exclusiveMaximum": 6}]}
ALL_OF_LENGTH_BOUNDS = {"allOf": [{"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
                                  {"minItems": 2, "maxItems": 5}]}
# xgrammar writes a known format and drops the pattern beside it: the pattern is what structd keeps.
URI_AND_PATTERN = {"type": "string", "format": "uri", "pattern": "^https?://[a-z.]+$"}
DATE_AND_PATTERN = {"type": "string", "format": "date", "pattern": "^20[0-9]{2}-[0-9]{2}-[0-9]{2}$"}
# MaskBench's Github_easy/o13129: oneOf branches told apart by `t`, which neither requires.
ONE_OF_TAGGED = {"type": "object", "oneOf": [
    {"properties": {"t": {"enum": ["a"]}, "v": {"type": "string"}}},
    {"properties": {"t": {"enum": ["b"]}, "v": {"type": ["string", "null"]}}}]}
# JsonSchemaStore's dart-test: closed oneOf branches with no name in common, which `{}` matches both of.
ONE_OF_CLOSED = {"type": "object", "oneOf": [{"properties": {"e": {"type": "integer"}}, "additionalProperties": False},
                                             {"properties": {"o": {"type": "integer"}}, "additionalProperties": False}]}
# JsonSchemaStore's semgrep: a property named additionalProperties whose schema is false (xgrammar refuses that).
FALSE_PROPERTY = {"type": "object", "properties": {"a": {"type": "integer"}, "additionalProperties": False},
                  "additionalProperties": False}
# JsonSchemaStore's gradle-enterprise-config-schema-7: a union written as if/then on a required `k`.
IF_THEN_TAGGED = {"type": "object", "properties": {"k": {"enum": ["daily", "weekly"]}}, "required": ["k"], "allOf": [
    {"if": {"properties": {"k": {"const": "daily"}}},
     "then": {"required": ["t"], "properties": {"k": {"const": "daily"}, "t": {"type": "integer"}},
              "additionalProperties": False}},
    {"if": {"properties": {"k": {"const": "weekly"}}},
     "then": {"required": ["d"], "properties": {"k": {"const": "weekly"}, "d": {"type": "string"}},
              "additionalProperties": False}}]}

DOCUMENT_CASES = [
    pytest.param(OBJECT_WITH_ANY_OF, "5", False, id="any-of-root-bare-number"),
    pytest.param(OBJECT_WITH_ANY_OF, '"x"', False, id="any-of-root-string"),
    pytest.param(OBJECT_WITH_ANY_OF, '{"a":1}', True, id="any-of-root-first-branch"),
    pytest.param(OBJECT_WITH_ANY_OF, '{"b":"x"}', True, id="any-of-root-second-branch"),
    pytest.param(OBJECT_WITH_ANY_OF, '{"a":"x"}', False, id="any-of-root-keeps-property-types"),
    pytest.param(ALL_OF, "5", False, id="all-of-bare-number"),
    pytest.param(ALL_OF, '{"a":1,"b":"x"}', True, id="all-of-both-parts"),
    pytest.param(ALL_OF, '{"b":"x"}', False, id="all-of-required-of-one-part"),
    pytest.param(ALL_OF, '{"a":1,"b":2}', False, id="all-of-property-type-of-other-part"),
    pytest.param(REF_TO_ALL_OF, "[]", False, id="ref-target-all-of-array"),
    pytest.param(REF_TO_ALL_OF, '{"a":1,"b":true}', True, id="ref-target-all-of-object"),
    pytest.param(REF_TO_ALL_OF, '{"a":1,"b":"x"}', False, id="ref-target-all-of-property-type"),
    pytest.param(CLOSED_ALL_OF, '{"a":1}', True, id="closed-all-of"),
    pytest.param(CLOSED_ALL_OF, '{"a":1,"b":"x"}', False, id="closed-all-of-forbids-the-other-part"),
    pytest.param(TYPED_ENUM, '"a"', True, id="enum-value-of-the-type"),
    pytest.param(TYPED_ENUM, "1", False, id="enum-value-of-another-type"),
    pytest.param(TYPED_ENUM, "null", False, id="enum-null-of-another-type"),
    pytest.param(REQUIRED_UNLISTED, "{}", False, id="required-not-in-properties-missing"),
    pytest.param(REQUIRED_UNLISTED, '{"a":[1]}', True, id="required-not-in-properties-present"),
    pytest.param(DEPENDENCIES, '{"a":1}', False, id="dependency-of-a-required-property-missing"),
    pytest.param(DEPENDENCIES, '{"a":1,"b":2}', True, id="dependency-of-a-required-property-present"),
    pytest.param(IF_THEN_PARTS, "5", False, id="all-of-if-then-parts-keep-the-type"),
    pytest.param(IF_THEN_PARTS, '{"m":"x"}', True, id="all-of-if-then-parts-object"),
    pytest.param(NOT_NUMBER, '{"foo":12}', False, id="not-type-number"),
    pytest.param(NOT_NUMBER, '{"foo":1.5}', False, id="not-type-number-fraction"),
    pytest.param(NOT_NUMBER, '{"foo":"x"}', True, id="not-type-other-type"),
    pytest.param(PATTERN_AND_LENGTH, '"a_b"', True, id="pattern-within-lengths"),
    pytest.param(PATTERN_AND_LENGTH, '"abcde"', False, id="pattern-over-max-length"),
    pytest.param(PATTERN_AND_LENGTH, '"a"', False, id="pattern-under-min-length"),
    pytest.param(ALL_OF_NUMBER_BOUNDS, "3", False, id="all-of-under-the-larger-minimum"),
    pytest.param(ALL_OF_NUMBER_BOUNDS, "4", True, id="all-of-within-both-ranges"),
    pytest.param(ALL_OF_NUMBER_BOUNDS, "6", False, id="all-of-at-the-exclusive-maximum"),
    pytest.param(ALL_OF_NUMBER_BOUNDS, "8", False, id="all-of-over-the-smaller-maximum"),
    pytest.param(ALL_OF_LENGTH_BOUNDS, "[1]", False, id="all-of-under-the-larger-min-items"),
    pytest.param(ALL_OF_LENGTH_BOUNDS, "[1,2]", True, id="all-of-within-both-item-counts"),
    pytest.param(ALL_OF_LENGTH_BOUNDS, "[1,2,3,4]", False, id="all-of-over-the-smaller-max-items"),
    pytest.param(URI_AND_PATTERN, '"https://x.org"', True, id="format-and-pattern-matching"),
    pytest.param(URI_AND_PATTERN, '"ftp://x.org"', False, id="format-and-pattern-a-uri-not-matching"),
    pytest.param(DATE_AND_PATTERN, '"2024-01-01"', True, id="date-and-pattern-matching"),
    pytest.param(DATE_AND_PATTERN, '"1999-01-01"', False, id="date-and-pattern-a-date-not-matching"),
    pytest.param(ONE_OF_TAGGED, '{"t":"a","v":"x"}', True, id="one-of-first-tag"),
    pytest.param(ONE_OF_TAGGED, '{"t":"b","v":null}', True, id="one-of-second-tag"),
    pytest.param(ONE_OF_TAGGED, "{}", False, id="one-of-both-branches-match-empty"),
    pytest.param(ONE_OF_TAGGED, '{"v":"x"}', False, id="one-of-both-branches-match-untagged"),
    pytest.param(FALSE_PROPERTY, '{"a":1}', True, id="false-property-absent"),
    pytest.param(FALSE_PROPERTY, '{"additionalProperties":1}', False, id="false-property-present"),
    pytest.param(ONE_OF_CLOSED, '{"e":1}', True, id="one-of-closed-first"),
    pytest.param(ONE_OF_CLOSED, "{}", False, id="one-of-closed-both-branches-match-empty"),
    pytest.param(IF_THEN_TAGGED, '{"k":"daily","t":1}', True, id="if-then-daily"),
    pytest.param(IF_THEN_TAGGED, '{"k":"weekly","d":"x"}', True, id="if-then-weekly"),
    pytest.param(IF_THEN_TAGGED, '{"k":"daily"}', False, id="if-then-required-by-then"),
    pytest.param(IF_THEN_TAGGED, '{"k":"weekly","t":1}', False, id="if-then-closed-by-then"),
]


@pytest.mark.parametrize("schema, doc, admitted", DOCUMENT_CASES)
def test_declared_constraints_are_kept(compiler, hf_tokenizer, schema, doc, admitted):
    assert admits(structd_grammar(compiler, schema), hf_tokenizer, doc) is admitted
    valid = jsonschema.Draft7Validator(schema).is_valid(json.loads(doc))
    assert valid is admitted, "each case's verdict is the validator's"


# ----------------------------------------------------------------------------- normalisation left alone

UNCHANGED = [
    pytest.param({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, id="two-patterns"),
    pytest.param({"type": "object", "anyOf": [{"minProperties": 1}], "oneOf": [{"maxProperties": 2}]},
                 id="any-of-and-one-of"),
    pytest.param({"$ref": "#/definitions/n", "definitions": {"n": {"allOf": [{"$ref": "#/definitions/n"}]}}},
                 id="ref-cycle"),
    pytest.param({"allOf": [{"$ref": "https://example.com/s.json"}, {"type": "object"}]}, id="remote-ref"),
    pytest.param({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}}, id="nothing-to-do"),
    pytest.param({"type": "string", "pattern": "^[a-z]+@x$", "maxLength": 4}, id="pattern-not-one-class"),
]


@pytest.mark.parametrize("schema", UNCHANGED)
def test_what_cannot_be_merged_exactly_is_left_as_written(schema):
    assert normalise_schema(schema) == schema
    assert normalised_schema_text(json.dumps(schema)) == json.dumps(schema)


NO_VALUE = {"type": "string", "enum": [1]}  # normalised to `false`


@pytest.mark.parametrize("schema, xgrammar_properties", [
    pytest.param({"type": "object", "properties": {"a": NO_VALUE, "b": {}}}, {"b": {}}, id="unlisted"),
    pytest.param({"properties": {"a": NO_VALUE, "b": {}}, "required": "a"}, {"b": {}},
                 id="required-not-a-list-unlisted"),
    # Through a `$ref` to a definition no value satisfies (it stayed a `$ref` to `false`: xgrammar refused the schema).
    pytest.param({"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}, "b": {}}, "$defs": {"n": NO_VALUE}},
                 {"b": {}}, id="through-a-ref-unlisted"),
    pytest.param({"properties": {"a": {"$ref": "#/$defs/n"}}, "additionalProperties": {}, "$defs": {"n": NO_VALUE}},
                 {"a": False}, id="through-a-ref-beside-additionalProperties-kept"),
    # (An untyped node requiring a `false` property admits every type but object: a type name JSON does not
    # have keeps it as written.)
    pytest.param({"type": ["object", "strin"], "properties": {"a": NO_VALUE, "b": {}}, "required": ["a"]},
                 {"a": False, "b": {}}, id="required-kept"),
    *(pytest.param({"properties": {"a": NO_VALUE}, k: {}}, {"a": False}, id=f"beside-{k}-kept")
      for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")),
])
def test_a_false_property_on_an_object_strict_mode_closes_is_unlisted_for_xgrammar(schema, xgrammar_properties):
    # xgrammar refuses a `false` property schema; its strict mode closes an object that names no other properties.
    assert json.loads(normalised_schema_text(json.dumps(schema), for_xgrammar=True))["properties"] == \
        xgrammar_properties
    assert "a" in json.loads(normalised_schema_text(json.dumps(schema)))["properties"]  # llguidance's: the `false`

def test_all_of_bounds_merge_to_the_tighter_of_each():
    merged = normalise_schema({"allOf": [{"type": "string", "minLength": 1, "maxLength": 9, "exclusiveMinimum": 0},
                                         {"minLength": 3, "maxLength": 5, "exclusiveMinimum": 2}]})
    assert (merged["minLength"], merged["maxLength"], merged["exclusiveMinimum"]) == (3, 5, 2)


def test_draft_2019_ref_siblings_are_merged():
    schema = {"$schema": "https://json-schema.org/draft/2019-09/schema", "allOf": [
        {"$ref": "#/$defs/a", "required": ["x"]}], "$defs": {"a": {"type": "object"}}}
    assert normalise_schema(schema)["required"] == ["x"]
    assert normalise_schema(schema)["type"] == "object"


def test_the_grammar_revision_is_part_of_a_json_schema_grammar_id():
    spec = GrammarSpec(Kind.JSON_SCHEMA, '{"type":"string"}')
    assert GRAMMAR_REVISION in spec.cache_key("fp")
    assert GRAMMAR_REVISION not in GrammarSpec(Kind.REGEX, "a+").cache_key("fp")


# ----------------------------------------------------------------------------- regression: real schemas

REGRESSIONS = [
    pytest.param("Github_ultra", "o65415.json", id="object-root-with-any-of"),
    pytest.param("JsonSchemaStore", "dart-test.json", id="ref-root-to-all-of"),
    pytest.param("Github_trivial", "o10018.json", id="pattern-with-max-length"),
    pytest.param("Github_trivial", "o23153.json", id="not-type"),
    pytest.param("Github_medium", "o36798.json", id="pattern-with-a-literal-backslash"),
]


@pytest.fixture(scope="module")
def sample():
    return {(r["dataset"], r["name"]): r["schema"] for r in load_jsonl(shared_data("jsonschemabench-sample.jsonl"))}


@pytest.mark.parametrize("dataset, name", REGRESSIONS[:2])
def test_sample_schema_root_is_only_its_declared_type(compiler, hf_tokenizer, sample, dataset, name):
    grammar = structd_grammar(compiler, sample[(dataset, name)])
    for doc in ("5", '"x"', "[]", "true", "null"):
        assert not admits(grammar, hf_tokenizer, doc), doc


@pytest.mark.parametrize("dataset, name", REGRESSIONS)
def test_random_walks_over_sample_schemas_validate(compiler, xgr_tokenizer_info, token_bytes, sample, dataset, name):
    schema = sample[(dataset, name)]
    grammar = structd_grammar(compiler, schema)
    vocab = token_bytes
    closing = np.array([bool(t) and set(t.decode("utf-8", "ignore")) <= CLOSING for t in vocab])
    rng = random.Random(7)
    validator = jsonschema.validators.validator_for(schema)(schema)
    # Their required properties make long documents: a walk gets up to 1,024 tokens.
    documents = [d for d in (walk(grammar, vocab, set(xgr_tokenizer_info.stop_token_ids), closing, rng, 1024)
                             for _ in range(4)) if d is not None]
    assert documents, "some walks must finish"
    for doc in documents:
        errors = [e.message for e in validator.iter_errors(json.loads(doc.decode("utf-8")))]
        assert not errors, (doc, errors)
