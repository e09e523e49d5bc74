"""Each rewrite of the JSON Schema normalisation, schema in, schema out (grammar_svc/schema/schema_normalise.py).

tests/test_json_validity.py checks documents against compiled grammars end to
end; this file pins every rewrite on its own, in process, so that mutation
testing (docs/mutation.md) can run it for each mutant of the module. Each
expected schema is the input's meaning written the way the module's
docstring says it writes it (allOf merged, siblings distributed into
anyOf/oneOf branches, `not: {type}` as the other types, required names
listed, lengths in a one-class pattern, enum values of other types dropped),
or the input itself where the module says it leaves a node as written.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest

from grammar_svc.schema.schema_normalise import MAX_DEPTH, node_budget, normalise_schema, ref_siblings_ignored
from shared.errors import InvalidGrammarError, RequestTooLargeError


@pytest.fixture(autouse=True)
def mutmut_frames():
    """Room for mutmut's trampolines (frames on every call) under schemas nested to MAX_DEPTH; a plain run keeps
    Python's default limit, which MAX_DEPTH must stay inside."""
    if "MUTANT_UNDER_TEST" not in os.environ:
        yield
        return
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit * 4)
    yield
    sys.setrecursionlimit(limit)


STRING_MIN_1 = {"allOf": [{"type": "string"}, {"minLength": 1}]}  # a subschema the normaliser rewrites
MERGED = {"type": "string", "minLength": 1}
ALL_BUT_STRING = ["object", "array", "number", "boolean", "null"]
NO_NUMBERS = ["object", "array", "string", "boolean", "null"]
D4, D7 = "http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-07/schema#"


def case(schema, expected, id):
    return pytest.param(schema, expected, id=id)


# ----------------------------------------------------------------------------- allOf merged into its node

NOT_OBJECT = {"type": ["array", "boolean", "null", "number", "string"]}  # what no object satisfies becomes


def every_type_but(*types):
    """What an untyped node that no value of `types` satisfies becomes."""
    return [t for t in ("array", "boolean", "null", "number", "object", "string") if t not in types]


ALL_OF = [
    case({"allOf": [{"type": "string"}, {"minLength": 2}]}, {"type": "string", "minLength": 2}, "disjoint-keywords"),
    case({"title": "t", "allOf": [{"type": "integer"}]}, {"title": "t", "type": "integer"}, "one-part-into-the-node"),
    case({"allOf": [True, {"type": "null"}, {}]}, {"type": "null"}, "true-and-empty-parts"),
    case({"allOf": [False]}, False, "false-part-is-false"),
    case({"type": "string", "allOf": [False]}, False, "false-beside-keywords-is-false"),
    case({"type": "string", "allOf": []}, {"type": "string", "allOf": []}, "empty-all-of-left"),
    case({"allOf": {"type": "string"}}, {"allOf": {"type": "string"}}, "all-of-not-a-list-left"),
    case({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]},
         {"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]}, "two-patterns-left"),
    case({"allOf": [{"allOf": [{"pattern": "a"}, {"pattern": "b"}]}, {"type": "string"}]},
         {"allOf": [{"allOf": [{"pattern": "a"}, {"pattern": "b"}]}, {"type": "string"}]},
         "unmerged-inner-all-of-leaves-the-outer"),
    case({"allOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, {"type": "string", "maxLength": 3},
         "equal-values-kept-once"),
    case({"allOf": [{"type": "string"}, {"type": "integer"}]}, False, "disjoint-types-are-false"),
    case({"allOf": [{"type": "strin"}, {"type": "integer"}]}, {"allOf": [{"type": "strin"}, {"type": "integer"}]},
         "a-name-that-is-no-type-left"),
    case({"allOf": [{"type": "string"}, {"type": ["intgr"]}]}, {"allOf": [{"type": "string"}, {"type": ["intgr"]}]},
         "a-second-name-that-is-no-type-left"),
    case({"allOf": [{"type": []}, {"type": "integer"}]}, {"allOf": [{"type": []}, {"type": "integer"}]},
         "no-type-names-left"),
    case({"allOf": [{"type": "integer"}, {"type": []}]}, {"allOf": [{"type": "integer"}, {"type": []}]},
         "no-second-type-names-left"),
    case({"allOf": [{"type": "object"}, {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}]},
         {"anyOf": [{"type": "object", "required": ["a"], "properties": {"a": {}}},
                    {"type": "object", "required": ["b"], "properties": {"b": {}}}]},
         "merged-any-of-is-distributed"),
    case({"properties": {"p": {"allOf": [{"minimum": 1}, {"maximum": 2}]}}},
         {"properties": {"p": {"minimum": 1, "maximum": 2}}}, "inside-a-property"),
]

TYPES = [
    case({"allOf": [{"type": "string"}, {"type": ["string", "null"]}]}, {"type": "string"}, "one-common-type"),
    case({"allOf": [{"type": ["string", "null", "integer"]}, {"type": ["null", "string"]}]},
         {"type": ["string", "null"]}, "common-types-in-the-first-order"),
    case({"allOf": [{"type": "number"}, {"type": "integer"}]}, {"type": "integer"}, "number-and-integer"),
    case({"allOf": [{"type": "integer"}, {"type": "number"}]}, {"type": "integer"}, "integer-and-number"),
    case({"allOf": [{"type": ["number", "string"]}, {"type": ["integer", "string"]}]},
         {"type": ["string", "integer"]}, "integer-from-number-beside-a-common-type"),
    case({"allOf": [{"type": ["integer", "string"]}, {"type": ["number", "string"]}]},
         {"type": ["string", "integer"]}, "integer-common-once"),
]

BOUNDS = [
    *(case({"allOf": [{k: 2}, {k: 5}]}, {k: 5}, f"{k}-larger") for k in
      ("minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum")),
    *(case({"allOf": [{k: 5}, {k: 2}]}, {k: 5}, f"{k}-larger-first") for k in ("minimum", "exclusiveMinimum")),
    *(case({"allOf": [{k: 2}, {k: 5}]}, {k: 2}, f"{k}-smaller") for k in
      ("maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum")),
    *(case({"allOf": [{k: 5}, {k: 2}]}, {k: 2}, f"{k}-smaller-second") for k in ("maximum", "exclusiveMaximum")),
    case({"allOf": [{"minimum": 1.5}, {"minimum": 1}]}, {"minimum": 1.5}, "float-bound"),
    *(case({"allOf": [{k: a}, {k: b}]}, {"allOf": [{k: a}, {k: b}]}, f"{k}-{'first' if a == '2' else 'second'}-"
           "not-a-number-left") for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
      for a, b in (("2", 5), (5, "2"))),
    case({"allOf": [{"minLength": True}, {"minLength": 2}]}, {"allOf": [{"minLength": True}, {"minLength": 2}]},
         "boolean-bound-left"),
    case({"allOf": [{"exclusiveMinimum": True, "minimum": 1}, {"exclusiveMinimum": False, "minimum": 1}]},
         {"allOf": [{"exclusiveMinimum": True, "minimum": 1}, {"exclusiveMinimum": False, "minimum": 1}]},
         "draft-4-boolean-exclusive-left"),
    case({"allOf": [{"exclusiveMaximum": True}, {"exclusiveMaximum": 3}]},
         {"allOf": [{"exclusiveMaximum": True}, {"exclusiveMaximum": 3}]}, "boolean-exclusive-maximum-left"),
    # Draft 4's flag qualifies its own part's bound: merged beside the other part's, it would move onto that one.
    case({"$schema": D4, "allOf": [{"minimum": 1, "exclusiveMinimum": True}, {"minimum": 2}]},
         {"$schema": D4, "allOf": [{"minimum": 1, "exclusiveMinimum": True}, {"minimum": 2}]},
         "draft-4-flag-beside-the-other-parts-minimum-left"),
    case({"$schema": D4, "maximum": -2, "allOf": [{"exclusiveMaximum": True}]},
         {"$schema": D4, "maximum": -2, "allOf": [{"exclusiveMaximum": True}]}, "draft-4-flag-without-its-bound-left"),
    case({"$schema": D4, "allOf": [{"minimum": 1, "exclusiveMinimum": True}, {"type": "integer", "maximum": 2}]},
         {"$schema": D4, "minimum": 1, "exclusiveMinimum": True, "type": "integer", "maximum": 2},
         "draft-4-flag-with-its-bound-merged"),
    case({"$schema": D4, "allOf": [{"maximum": 3, "exclusiveMaximum": True}, {"maximum": 3, "exclusiveMaximum": True}]},
         {"$schema": D4, "maximum": 3, "exclusiveMaximum": True}, "draft-4-equal-flagged-bounds-merged"),
    case({"$schema": D7, "allOf": [{"minimum": 1, "exclusiveMinimum": 1}, {"minimum": 2}]},
         {"$schema": D7, "minimum": 2, "exclusiveMinimum": 1}, "draft-7-exclusive-bound-merged"),
]

KEYWORDS = [
    case({"allOf": [{"required": ["a", "b"]}, {"required": ["b", "c"]}]},
         {"required": ["a", "b", "c"], "properties": {"a": {}, "b": {}, "c": {}}}, "required-united"),
    case({"allOf": [{"required": "a"}, {"required": ["b"]}]},
         {"allOf": [{"required": "a"}, {"required": ["b"], "properties": {"b": {}}}]}, "required-not-a-list-left"),
    case({"allOf": [{"required": ["b"]}, {"required": "a"}]},
         {"allOf": [{"required": ["b"], "properties": {"b": {}}}, {"required": "a"}]},
         "required-second-not-a-list-left"),
    case({"allOf": [{"enum": [1, 2, 3]}, {"enum": [3, 2, 5]}]}, {"enum": [2, 3]}, "enum-intersected-in-first-order"),
    case({"allOf": [{"enum": [1, 2]}, {"enum": [3]}]}, False, "disjoint-enums-are-false"),
    case({"allOf": [{"enum": "a"}, {"enum": ["a"]}]}, {"allOf": [{"enum": "a"}, {"enum": ["a"]}]},
         "enum-not-a-list-left"),
    case({"allOf": [{"enum": ["a"]}, {"enum": "a"}]}, {"allOf": [{"enum": ["a"]}, {"enum": "a"}]},
         "enum-second-not-a-list-left"),
    case({"allOf": [{"uniqueItems": False}, {"uniqueItems": True}]}, {"uniqueItems": True}, "unique-items-either"),
    case({"allOf": [{"uniqueItems": True}, {"uniqueItems": False}]}, {"uniqueItems": True},
         "unique-items-either-first"),
    case({"allOf": [{"uniqueItems": 1}, {"uniqueItems": False}]}, {"allOf": [{"uniqueItems": 1}, {"uniqueItems": False}]},
         "unique-items-not-boolean-left"),
    case({"allOf": [{"uniqueItems": False}, {"uniqueItems": "x"}]},
         {"allOf": [{"uniqueItems": False}, {"uniqueItems": "x"}]}, "unique-items-second-not-boolean-left"),
    case({"allOf": [{"const": 1}, {"const": 2}]}, False, "two-consts-are-false"),
    case({"allOf": [{"const": 1}, {"const": True}]}, False, "true-is-not-1"),
    case({"allOf": [{"const": [1, {"a": False}]}, {"const": [1.0, {"a": False}]}]}, {"const": [1, {"a": False}]},
         "1-and-1.0-are-one-number"),
    case({"allOf": [{"enum": [1, True, "a", 0]}, {"enum": [True, 2, "a", False]}]}, {"enum": [True, "a"]},
         "enum-false-is-not-0"),
    case({"allOf": [{"enum": [1, 2]}, {"enum": [2.0, 3]}]}, {"enum": [2]}, "enum-2-and-2.0-are-one-number"),
    case({"allOf": [{"const": [1]}, {"const": [True]}]}, False, "true-in-an-array-is-not-1"),
    case({"allOf": [{"enum": [[1], {"a": [True]}, "x"]}, {"enum": [{"a": [True]}, [1.0]]}]},
         {"enum": [[1], {"a": [True]}]}, "enum-arrays-and-objects-intersected"),
    case({"allOf": [{"properties": {"a": {"type": "string"}, "b": {}}},
                    {"properties": {"a": {"maxLength": 3}, "c": {"type": "null"}}}]},
         {"properties": {"a": {"type": "string", "maxLength": 3}, "b": {}, "c": {"type": "null"}}},
         "properties-merged-by-name"),
    case({"allOf": [{"patternProperties": {"^x": {"minimum": 0}}}, {"patternProperties": {"^x": {"maximum": 9},
                                                                                        "^y": {}}}]},
         {"patternProperties": {"^x": {"minimum": 0, "maximum": 9}, "^y": {}}}, "pattern-properties-merged"),
    case({"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"a": {"type": "integer"}}}]},
         {"properties": {"a": False}}, "property-conflict-is-a-false-property"),
    case({"allOf": [{"properties": {"a": True}}, {"properties": {"a": {"type": "string"}}}]},
         {"properties": {"a": {"type": "string"}}}, "property-true-and-a-schema"),
    case({"allOf": [{"properties": {"a": False}}, {"properties": {"a": {"type": "string"}}}]},
         {"properties": {"a": False}}, "property-false-and-a-schema"),
    case({"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"a": False}}]},
         {"properties": {"a": False}}, "property-a-schema-and-false"),
    case({"allOf": [{"properties": {"a": 1}}, {"properties": {"a": {"type": "string"}}}]},
         {"allOf": [{"properties": {"a": 1}}, {"properties": {"a": {"type": "string"}}}]},
         "property-not-a-schema-left"),
    case({"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"a": 1}}]},
         {"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"a": 1}}]},
         "property-second-not-a-schema-left"),
    case({"allOf": [{"properties": []}, {"properties": {"a": {}}}]},
         {"allOf": [{"properties": []}, {"properties": {"a": {}}}]}, "properties-not-a-map-left"),
    case({"allOf": [{"properties": {"a": {}}}, {"properties": []}]},
         {"allOf": [{"properties": {"a": {}}}, {"properties": []}]}, "properties-second-not-a-map-left"),
    *(case({"allOf": [{k: {"type": "string"}}, {k: {"maxLength": 2}}]}, {k: {"type": "string", "maxLength": 2}},
           f"{k}-merged") for k in ("items", "additionalProperties", "propertyNames")),
    # ["abc", 1] has an item for each contains, and none for both: left (it was merged, narrower).
    case({"allOf": [{"contains": {"type": "string"}}, {"contains": {"maxLength": 2}}]},
         {"allOf": [{"contains": {"type": "string"}}, {"contains": {"maxLength": 2}}]}, "two-contains-left"),
    case({"allOf": [{"contains": {"type": "string"}, "minContains": 2, "maxContains": 6},
                    {"contains": {"type": "string"}, "minContains": 3, "maxContains": 4}]},
         {"contains": {"type": "string"}, "minContains": 3, "maxContains": 4}, "one-contains-counts-merged"),
    # A part's minContains counts its own contains' items: none, it says nothing (it counted the other part's).
    case({"allOf": [{"contains": {"type": "string"}}, {"minContains": 0, "maxContains": 0}]},
         {"contains": {"type": "string"}}, "counts-without-contains-dropped"),
    case({"allOf": [{"minContains": 0}, {"contains": {"type": "string"}, "maxContains": 2}]},
         {"contains": {"type": "string"}, "maxContains": 2}, "first-counts-without-contains-dropped"),
    case({"allOf": [{"items": [{"type": "string"}]}, {"items": {"type": "string", "maxLength": 1}}]},
         {"allOf": [{"items": [{"type": "string"}]}, {"items": {"type": "string", "maxLength": 1}}]},
         "tuple-items-left"),
    case({"allOf": [{"items": {"type": "string", "maxLength": 1}}, {"items": [{"type": "string"}]}]},
         {"allOf": [{"items": {"type": "string", "maxLength": 1}}, {"items": [{"type": "string"}]}]},
         "tuple-items-second-left"),
    case({"allOf": [{"items": {"type": "string"}}, {"items": {"type": "integer"}}]}, {"items": False},
         "items-conflict-are-false-items"),
    # A part's items past its prefix govern the elements past its own prefix only: beside another prefix, left.
    case({"allOf": [{"prefixItems": [True]}, {"items": False}]}, {"allOf": [{"prefixItems": [True]}, {"items": False}]},
         "prefix-items-beside-the-other-parts-items-left"),
    case({"allOf": [{"items": {"type": "integer"}}, {"prefixItems": [{}], "items": False}]},
         {"allOf": [{"items": {"type": "integer"}}, {"prefixItems": [{}], "items": False}]},
         "items-beside-the-other-parts-closed-tuple-left"),
    case({"allOf": [{"prefixItems": [{"type": "string"}], "items": False}, {"prefixItems": [{"type": "string"}]}]},
         {"prefixItems": [{"type": "string"}], "items": False}, "the-same-prefix-merged"),
    case({"allOf": [{"prefixItems": [{"type": "string"}]}, {"minItems": 1}]},
         {"prefixItems": [{"type": "string"}], "minItems": 1}, "prefix-items-beside-no-items-merged"),
    case({"$schema": D7, "allOf": [{"items": [True]}, {"additionalItems": False}]},
         {"$schema": D7, "allOf": [{"items": [True]}, {"additionalItems": False}]},
         "draft-7-items-array-beside-the-other-parts-additional-items-left"),
    case({"$schema": D7, "allOf": [{"items": {"type": "integer"}}, {"additionalItems": False}]},
         {"$schema": D7, "items": {"type": "integer"}, "additionalItems": False},
         "draft-7-items-schema-beside-additional-items-merged"),
]

# Keywords that constrain nothing: where two parts disagree the first part's stays, and they stay on a node whose
# anyOf gets its siblings.
ANNOTATIONS = ("$schema", "$id", "id", "$comment", "title", "description", "default", "examples", "definitions",
               "$defs", "deprecated", "readOnly", "writeOnly", "$anchor", "$vocabulary", "$dynamicAnchor",
               "$recursiveAnchor")
# Keywords xgrammar does not enforce: where two parts disagree the first part's stays (the module's docstring).
IGNORED = [("if", {"minimum": 1}, {"minimum": 2}), ("then", {"minimum": 1}, {"minimum": 2}),
           ("else", {"minimum": 1}, {"minimum": 2}), ("not", {"minimum": 1}, {"minimum": 2}),
           ("dependencies", {"a": ["b"]}, {"a": ["c"]}), ("dependentRequired", {"a": ["b"]}, {"a": ["c"]}),
           ("dependentSchemas", {"a": {"minimum": 1}}, {"a": {"minimum": 2}}),
           ("unevaluatedProperties", {"minimum": 1}, {"minimum": 2}),
           ("unevaluatedItems", {"minimum": 1}, {"minimum": 2}), ("contentEncoding", "base64", "7bit"),
           ("contentMediaType", "text/plain", "application/json"),
           ("contentSchema", {"type": "string"}, {"type": "integer"})]
FIRST_STAYS = [
    *(case({"allOf": [{k: "a"}, {k: "b"}]}, {k: "a"}, f"annotation-{k}") for k in ANNOTATIONS if k != "$id"),
    # A part with its own base is not merged: its `$ref`s would be read against the other part's base.
    case({"allOf": [{"$id": "a"}, {"$id": "b"}]}, {"allOf": [{"$id": "a"}, {"$id": "b"}]}, "annotation-$id-left"),
    *(case({"allOf": [{k: a}, {k: b}]}, {k: a}, f"ignored-{k}") for k, a, b in IGNORED),
]

ADDITIONAL_PROPERTIES = [
    case({"allOf": [{"properties": {"x": {"type": "string"}}, "additionalProperties": False},
                    {"properties": {"y": {"type": "integer"}}}]},
         {"properties": {"x": {"type": "string"}}, "additionalProperties": False}, "false-drops-the-others-names"),
    case({"allOf": [{"properties": {"y": {"type": "integer"}}},
                    {"properties": {"x": {"type": "string"}}, "additionalProperties": False}]},
         {"properties": {"x": {"type": "string"}}, "additionalProperties": False}, "false-second-drops-the-first"),
    case({"allOf": [{"properties": {"x": {}}, "additionalProperties": {"type": "integer"}},
                    {"properties": {"y": {"minimum": 0}}}]},
         {"properties": {"x": {}, "y": {"minimum": 0, "type": "integer"}}, "additionalProperties": {"type": "integer"}},
         "schema-governs-the-others-names"),
    case({"allOf": [{"type": "object", "properties": {"x": {}}, "additionalProperties": False},
                    {"properties": {"y": {}}, "required": ["y"]}]},
         False, "required-and-forbidden-is-false"),
    # Untyped, no object satisfies both parts but a string or a number does (properties and required ignore
    # them): every type but object (left as written, xgrammar compiled it as any object with y).
    case({"allOf": [{"properties": {"x": {}}, "additionalProperties": False},
                    {"properties": {"y": {}}, "required": ["y"]}]},
         NOT_OBJECT, "required-and-forbidden-untyped-no-object"),
    case({"type": ["object", "string"], "allOf": [{"properties": {"x": {}}, "additionalProperties": False},
                                                  {"required": ["y"]}]},
         {"type": "string"}, "required-and-forbidden-the-other-type-kept"),
    case({"type": ["array", "boolean", "integer", "null", "number", "object", "string"],
          "allOf": [{"properties": {"x": {}}, "additionalProperties": False}, {"required": ["y"]}]},
         {"type": ["array", "boolean", "integer", "null", "number", "string"]}, "required-and-forbidden-every-type-named"),
    case({"allOf": [{"properties": {"x": {}}, "patternProperties": {"^y": {}}, "additionalProperties": False},
                    {"properties": {"y": {}}}]},
         {"properties": {"x": {}, "y": {}}, "patternProperties": {"^y": {}}, "additionalProperties": False},
         "a-pattern-may-govern-them"),
    case({"allOf": [{"patternProperties": {"^y": {}, "id$": {}, "^tag$": {}, "mid": {}}, "additionalProperties": False},
                    {"properties": {"yes": {}, "uuid": {}, "tag": {}, "amidst": {}, "tags": {}, "z": {}}}]},
         {"patternProperties": {"^y": {}, "id$": {}, "^tag$": {}, "mid": {}}, "additionalProperties": False,
          "properties": {"yes": {}, "uuid": {}, "tag": {}, "amidst": {}}}, "literal-patterns-decide-the-names"),
    case({"allOf": [{"patternProperties": {"^y": {}, "id$": {}}, "additionalProperties": False},
                    {"properties": {"yak": {}, "may": {}, "paid": {}, "idle": {}}}]},
         {"patternProperties": {"^y": {}, "id$": {}}, "additionalProperties": False,
          "properties": {"yak": {}, "paid": {}}}, "an-anchored-literal-matches-at-its-anchor-only"),
    case({"allOf": [{"patternProperties": ["^y"], "additionalProperties": False}, {"properties": {"z": {}}}]},
         {"patternProperties": ["^y"], "additionalProperties": False, "properties": {"z": {}}},
         "pattern-properties-not-a-map-leaves-the-names"),
    case({"allOf": [{"patternProperties": {"^y+": {}}, "additionalProperties": False}, {"properties": {"z": {}}}]},
         {"patternProperties": {"^y+": {}}, "additionalProperties": False, "properties": {"z": {}}},
         "a-regex-is-not-run-on-the-names"),
    case({"allOf": [{"properties": {"x": {}}, "additionalProperties": True}, {"properties": {"y": {}}}]},
         {"properties": {"x": {}, "y": {}}, "additionalProperties": True}, "true-changes-nothing"),
    case({"allOf": [{"additionalProperties": False}, {"properties": {"y": {}}}]},
         {"properties": {}, "additionalProperties": False}, "no-own-properties"),
    # y may not appear (a string and an integer at once): false, exact. xgrammar refuses a false property (auto
    # goes to llguidance); left as written, xgrammar's grammar let y in as an integer.
    case({"allOf": [{"properties": {"x": {}}, "additionalProperties": {"type": "string"}},
                    {"properties": {"y": {"type": "integer"}}}]},
         {"properties": {"x": {}, "y": False}, "additionalProperties": {"type": "string"}},
         "other-name-contradicting-the-schema-is-false"),
    # The same with the property in the part without the schema; that part's own dict is not written into
    # (the caller's schema is checked unchanged by every row).
    case({"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}},
                                      {"additionalProperties": {"type": "integer"}}]},
         {"type": "object", "properties": {"a": False}, "additionalProperties": {"type": "integer"}},
         "own-name-contradicting-the-others-schema-is-false"),
    # No object has a property and none: what else the node admits (_within_bounds).
    case({"allOf": [{"additionalProperties": False}, {"minProperties": 1}]}, NOT_OBJECT, "no-properties-at-all"),
    # A pattern of one part names properties the other's additionalProperties governs too: the pattern's schema
    # meets it (false: the names are forbidden), not a node that lets them past it ({"kind": 1, "x": 1}).
    case({"allOf": [{"properties": {"kind": {}}, "additionalProperties": False},
                    {"patternProperties": {"^x": {"type": "integer"}}}]},
         {"properties": {"kind": {}}, "additionalProperties": False, "patternProperties": {}},
         "the-others-pattern-beside-false-goes"),
    case({"allOf": [{"properties": {"xa": {}}, "additionalProperties": False},
                    {"patternProperties": {"^x": {"type": "integer"}}}]},
         {"allOf": [{"properties": {"xa": {}}, "additionalProperties": False},
                    {"patternProperties": {"^x": {"type": "integer"}}}]}, "a-listed-name-it-matches-left"),
    case({"allOf": [{"properties": {"kind": {}}, "additionalProperties": False},
                    {"patternProperties": {"x+": {"type": "integer"}}}]},
         {"allOf": [{"properties": {"kind": {}}, "additionalProperties": False},
                    {"patternProperties": {"x+": {"type": "integer"}}}]}, "a-regex-that-may-match-a-listed-name-left"),
    case({"allOf": [{"patternProperties": {"^y": {}}, "additionalProperties": False},
                    {"patternProperties": {"^x": {}}}]},
         {"allOf": [{"patternProperties": {"^y": {}}, "additionalProperties": False},
                    {"patternProperties": {"^x": {}}}]}, "beside-the-parts-own-patterns-left"),
    case({"allOf": [{"additionalProperties": {"type": "string"}}, {"patternProperties": {"^x": {"maxLength": 3}}}]},
         {"additionalProperties": {"type": "string"}, "patternProperties": {"^x": {"maxLength": 3, "type": "string"}}},
         "the-others-pattern-meets-the-schema"),
    case({"allOf": [{"patternProperties": {"^x": {}}, "additionalProperties": False},
                    {"patternProperties": {"^x": {"type": "integer"}}}]},
         {"patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False}, "the-same-pattern-merged"),
    case({"type": "object", "allOf": [{"properties": {"k": {}}, "additionalProperties": False}, {"required": ["x"]}]},
         False, "required-unlisted-and-forbidden-is-false"),
    case({"allOf": [{"properties": {"k": {}}, "additionalProperties": False}, {"required": ["x"]}]},
         NOT_OBJECT, "required-unlisted-and-forbidden-untyped-no-object"),
    # properties that is no map names no property (an invalid schema: not a crash, nor an INTERNAL answer).
    case({"allOf": [{"properties": 5, "additionalProperties": False},
                    {"required": ["a"], "additionalProperties": False}]},
         {"properties": 5, "additionalProperties": False, **NOT_OBJECT}, "properties-not-a-map-names-none"),
    case({"properties": None, "required": ["b"]}, {"properties": None, "required": ["b"]},
         "required-beside-properties-not-a-map-left"),
    case({"allOf": [{"required": ["x-a"]}, {"patternProperties": {"^x-": {"type": "string"}}, "additionalProperties": False}]},
         {"required": ["x-a"], "properties": {"x-a": {}}, "patternProperties": {"^x-": {"type": "string"}},
          "additionalProperties": False}, "a-required-name-its-pattern-admits"),
]

REFS = [
    case({"definitions": {"s": {"type": "string"}}, "allOf": [{"$ref": "#/definitions/s"}]},
         {"definitions": {"s": {"type": "string"}}, "type": "string"}, "local-ref-inlined"),
    case({"definitions": {"s": {"allOf": [{"type": "string"}, {"maxLength": 2}]}}, "allOf": [{"$ref": "#/definitions/s"}]},
         {"definitions": {"s": {"type": "string", "maxLength": 2}}, "type": "string", "maxLength": 2},
         "ref-target-normalised"),
    case({"definitions": {"a": {"$ref": "#/definitions/b"}, "b": {"type": "integer"}},
          "allOf": [{"$ref": "#/definitions/a"}]},
         {"definitions": {"a": {"$ref": "#/definitions/b"}, "b": {"type": "integer"}}, "type": "integer"},
         "ref-to-a-ref"),
    case({"definitions": {"a": {"$ref": "#/definitions/a"}}, "allOf": [{"$ref": "#/definitions/a"}]},
         {"definitions": {"a": {"$ref": "#/definitions/a"}}, "allOf": [{"$ref": "#/definitions/a"}]},
         "ref-to-itself-left"),
    case({"$ref": "#/definitions/n", "definitions": {"n": {"allOf": [{"$ref": "#/definitions/n"}]}}},
         {"$ref": "#/definitions/n", "definitions": {"n": {"allOf": [{"$ref": "#/definitions/n"}]}}}, "ref-cycle-left"),
    case({"allOf": [{"$ref": "https://example.com/s.json"}, {"type": "object"}]},
         {"allOf": [{"$ref": "https://example.com/s.json"}, {"type": "object"}]}, "remote-ref-left"),
    case({"allOf": [{"$ref": 5}, {"type": "object"}]}, {"allOf": [{"$ref": 5}, {"type": "object"}]},
         "ref-not-a-string-left"),
    case({"allOf": [{"$ref": "#/definitions/none"}]}, {"allOf": [{"$ref": "#/definitions/none"}]},
         "ref-to-nothing-left"),
    case({"definitions": {"a~b": {"type": "string"}, "a/b": {"type": "integer"}, "x~1": {"type": "null"}},
          "properties": {"p": {"allOf": [{"$ref": "#/definitions/a~1b"}]}, "q": {"allOf": [{"$ref": "#/definitions/a~0b"}]},
                         "r": {"allOf": [{"$ref": "#/definitions/x~01"}]}}},
         {"definitions": {"a~b": {"type": "string"}, "a/b": {"type": "integer"}, "x~1": {"type": "null"}},
          "properties": {"p": {"type": "integer"}, "q": {"type": "string"}, "r": {"type": "null"}}},
         "pointer-escapes"),
    case({"items": [{"type": "string"}, {"type": "integer"}],
          "properties": {"p": {"allOf": [{"$ref": "#/items/1"}]}, "q": {"allOf": [{"$ref": "#/items/2"}]},
                         "r": {"allOf": [{"$ref": "#/items/x"}]}}},
         {"items": [{"type": "string"}, {"type": "integer"}],
          "properties": {"p": {"type": "integer"}, "q": {"allOf": [{"$ref": "#/items/2"}]},
                         "r": {"allOf": [{"$ref": "#/items/x"}]}}},
         "pointer-into-a-list"),
    case({"definitions": {"n": 3}, "properties": {"p": {"allOf": [{"$ref": "#/definitions/n/0"}]}}},
         {"definitions": {"n": 3}, "properties": {"p": {"allOf": [{"$ref": "#/definitions/n/0"}]}}},
         "pointer-past-a-scalar-left"),
    case({"definitions": {"n": {"$id": "#num", "type": "number"}}, "type": "object",
          "properties": {"x": {"allOf": [{"$ref": "#num"}]}}},
         {"definitions": {"n": {"$id": "#num", "type": "number"}}, "type": "object",
          "properties": {"x": {"allOf": [{"$ref": "#num"}]}}}, "plain-name-fragment-left"),
    case({"definitions": {"a": {"type": "string"}}, "a": {"type": "integer"},
          "properties": {"x": {"allOf": [{"$ref": "#definitions/a"}]}}},
         {"definitions": {"a": {"type": "string"}}, "a": {"type": "integer"},
          "properties": {"x": {"allOf": [{"$ref": "#definitions/a"}]}}}, "fragment-without-a-slash-left"),
    case({"type": "object", "properties": {"c": {"allOf": [{"$ref": "#"}]}}},
         {"type": "object", "properties": {"c": {"type": "object", "properties": {"c": {"allOf": [{"$ref": "#"}]}}}}},
         "ref-to-the-root-unrolled-once"),
    case({"definitions": {"s": {"type": "string"}},
          "allOf": [{"properties": {"p": {"$ref": "#/definitions/s"}}}, {"properties": {"p": {"maxLength": 3}}}]},
         {"definitions": {"s": {"type": "string"}}, "properties": {"p": {"type": "string", "maxLength": 3}}},
         "ref-inside-a-merged-property"),
    case({"definitions": {"s": {"type": "string"}},
          "allOf": [{"properties": {"p": {"maxLength": 3}}}, {"properties": {"p": {"$ref": "#/definitions/s"}}}]},
         {"definitions": {"s": {"type": "string"}}, "properties": {"p": {"maxLength": 3, "type": "string"}}},
         "ref-second-inside-a-merged-property"),
    case({"definitions": {"s": {"type": "string"}},
          "properties": {"a": {"allOf": [{"$ref": "#/definitions/s"}]},
                         "b": {"allOf": [{"$ref": "#/definitions/s"}, {"maxLength": 2}]}}},
         {"definitions": {"s": {"type": "string"}},
          "properties": {"a": {"type": "string"}, "b": {"type": "string", "maxLength": 2}}}, "same-ref-twice"),
    case({"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": {"t": True},
          "allOf": [{"$ref": "#/$defs/t", "minLength": 1}]},
         {"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": {"t": True}, "minLength": 1},
         "ref-to-true-beside-keywords"),
    case({"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": {"f": False},
          "allOf": [{"$ref": "#/$defs/f", "minLength": 1}]},
         False, "ref-to-false-beside-keywords-is-false"),
    case({"$schema": "http://json-schema.org/draft-07/schema#",
          "allOf": [{"$ref": "#/definitions/s", "required": ["x"]}], "definitions": {"s": {"type": "object"}}},
         {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"s": {"type": "object"}},
          "type": "object"}, "draft-7-ref-siblings-ignored"),
    # A `$ref` replacing its node up to draft 7: what sits beside it makes nothing `false` (the schema was refused).
    *(case({"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"a": {}}, "type": "object",
            "properties": {"p": {"$ref": "#/definitions/a", **siblings}}, "required": ["p"]},
           {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"a": {}}, "type": "object",
            "properties": {"p": {"$ref": "#/definitions/a", **siblings}}, "required": ["p"]},
           f"draft-7-ref-siblings-{name}-left") for name, siblings in (
        ("of-no-value", {"type": "string", "enum": [1]}), ("any-of-false", {"anyOf": [False]}),
        ("all-of-false", {"allOf": [False]}))),
    # No `$schema`: read as 2020-12, as the output check's validator reads it (its siblings apply).
    case({"allOf": [{"$ref": "#/definitions/s", "required": ["x"]}], "definitions": {"s": {"type": "object"}}},
         {"definitions": {"s": {"type": "object"}}, "type": "object", "required": ["x"], "properties": {"x": {}}},
         "no-draft-ref-siblings-merged"),
    case({"$schema": "https://json-schema.org/draft/2019-09/schema", "$defs": {"s": {"type": "object"}},
          "allOf": [{"$ref": "#/$defs/s", "required": ["x"]}]},
         {"$schema": "https://json-schema.org/draft/2019-09/schema", "$defs": {"s": {"type": "object"}},
          "type": "object", "required": ["x"], "properties": {"x": {}}}, "draft-2019-ref-siblings-merged"),
    case({"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": {"s": {"type": "object"}},
          "allOf": [{"$ref": "#/$defs/s", "minProperties": 1}]},
         {"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": {"s": {"type": "object"}},
          "type": "object", "minProperties": 1}, "draft-2020-ref-siblings-merged"),
    case({"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": {"s": {"type": "object"}},
          "allOf": [{"$ref": "#/$defs/s"}]},
         {"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": {"s": {"type": "object"}},
          "type": "object"}, "draft-2020-ref-alone"),
    case({"definitions": {"s": {"type": "string"}}, "type": "string",
          "anyOf": [{"$ref": "#/definitions/s"}, {"maxLength": 0}]},
         {"definitions": {"s": {"type": "string"}}, "anyOf": [{"type": "string"}, {"type": "string", "maxLength": 0}]},
         "ref-branch-resolved"),
    # A `$ref` to `true` or `false` met inside a merge (a property both parts name, an anyOf's sibling): merged as
    # that schema (it raised TypeError: a boolean read as an object).
    case({"definitions": {"t": True},
          "allOf": [{"properties": {"p": {"$ref": "#/definitions/t"}}}, {"properties": {"p": {"maxLength": 3}}}]},
         {"definitions": {"t": True}, "properties": {"p": {"maxLength": 3}}}, "ref-to-true-inside-a-merged-property"),
    case({"definitions": {"t": True},
          "allOf": [{"properties": {"p": {"maxLength": 3}}}, {"properties": {"p": {"$ref": "#/definitions/t"}}}]},
         {"definitions": {"t": True}, "properties": {"p": {"maxLength": 3}}},
         "ref-to-true-second-inside-a-merged-property"),
    case({"definitions": {"f": False},
          "allOf": [{"properties": {"p": {"$ref": "#/definitions/f"}}}, {"properties": {"p": {"maxLength": 3}}}]},
         {"definitions": {"f": False}, "properties": {"p": False}}, "ref-to-false-inside-a-merged-property"),
    case({"$ref": "#/definitions/t", "anyOf": [{"type": "string"}, {"type": "null"}], "definitions": {"t": True}},
         {"definitions": {"t": True}, "anyOf": [{"type": "string"}, {"type": "null"}]}, "ref-to-true-beside-an-any-of"),
]

# A `$ref` whose target normalises to `false` is an inline `false` (it stayed a `$ref` to a `false` definition, which
# xgrammar refuses: the whole schema, where `a` is optional and `{}` valid).
BAD = {"type": "integer", "minimum": 5, "maximum": 2}
REF_BAD = {"$ref": "#/$defs/bad"}
EXT = "https://example.com/ext.json"
REFS_FALSE = [
    case({"type": "object", "properties": {"a": REF_BAD}, "$defs": {"bad": BAD}},
         {"type": "object", "properties": {"a": False}, "$defs": {"bad": False}}, "optional-property"),
    case({"$defs": {"bad": BAD}, "type": "object", "properties": {"a": REF_BAD}},
         {"$defs": {"bad": False}, "type": "object", "properties": {"a": False}}, "optional-property-defs-first"),
    # On a closed object it is unlisted (forbidden all the same); the others stay listed, closed.
    case({"type": "object", "properties": {"a": REF_BAD, "b": {"type": "string"}}, "additionalProperties": False,
          "$defs": {"bad": BAD}},
         {"type": "object", "properties": {"b": {"type": "string"}}, "additionalProperties": False,
          "$defs": {"bad": False}}, "optional-property-of-a-closed-object"),
    case({"type": "array", "items": REF_BAD, "$defs": {"bad": BAD}},
         {"type": "array", "items": False, "$defs": {"bad": False}}, "items-of-an-array-that-may-be-empty"),
    case({"anyOf": [REF_BAD, {"type": "null"}], "$defs": {"bad": BAD}},
         {"anyOf": [{"type": "null"}], "$defs": {"bad": False}}, "any-of-branch-dropped"),
    case({"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "$defs": {"a": REF_BAD, "bad": BAD}},
         {"type": "object", "properties": {"a": False}, "$defs": {"a": False, "bad": False}}, "ref-to-a-ref"),
    case({"type": "object", "properties": {"a": {"$ref": "#/$defs/f"}}, "$defs": {"f": False}},
         {"type": "object", "properties": {"a": False}, "$defs": {"f": False}}, "ref-to-false"),
    # A definition that is `false` for a required property of its own, reached through two `$ref`s.
    case({"type": "object", "properties": {"o": {"$ref": "#/$defs/o"}},
          "$defs": {"o": {"type": "object", "properties": {"n": REF_BAD}, "required": ["n"]}, "bad": BAD}},
         {"type": "object", "properties": {"o": False}, "$defs": {"o": False, "bad": False}}, "through-a-required-one"),
    # Up to draft 7 the `$ref` replaces its node; from 2019-09 its siblings apply: `false` either way.
    *(case({"$schema": draft, "type": "object", "properties": {"a": {"$ref": "#/definitions/bad", "type": "integer"}},
            "definitions": {"bad": BAD}},
           {"$schema": draft, "type": "object", "properties": {"a": False}, "definitions": {"bad": False}},
           f"beside-siblings-{name}")
      for name, draft in (("draft-7", D7), ("2020-12", "https://json-schema.org/draft/2020-12/schema"))),
    case({"type": "object", "properties": {"a": {"$ref": "#/$defs/a%25"}}, "$defs": {"a%25": {}, "a%": BAD}},
         {"type": "object", "properties": {"a": False}, "$defs": {"a%25": {}, "a%": False}},
         "percent-decoded-as-the-output-check-reads-it"),
    # Where it is not known to be `false`, the `$ref` stays.
    case({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}},
         {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}, "ref-to-nothing-left"),
    # A fragment not starting `#/` is a plain name as written (the output check: NoSuchAnchor), whatever it decodes to.
    case({"type": "object", "properties": {"a": {"$ref": "#%2F%24defs%2Fbad"}}, "$defs": {"bad": BAD}},
         {"type": "object", "properties": {"a": {"$ref": "#%2F%24defs%2Fbad"}}, "$defs": {"bad": False}},
         "an-encoded-pointer-is-a-plain-name-left"),
    # An index that is no ASCII number, or longer than any array, points nowhere (int() refused both).
    *(case({"type": "object", "properties": {"a": {"$ref": f"#/$defs/l/anyOf/{index}"}},
            "$defs": {"l": {"anyOf": [BAD, {"type": "null"}]}}},
           {"type": "object", "properties": {"a": {"$ref": f"#/$defs/l/anyOf/{index}"}},
            "$defs": {"l": {"anyOf": [{"type": "null"}]}}}, f"index-{name}-points-nowhere")
      for name, index in (("superscript", "\u00b2"), ("arabic-indic", "\u0660"), ("of-5000-digits", "0" * 5000))),
    case({"type": "object", "properties": {"a": {"$ref": "https://example.com/bad.json"}}},
         {"type": "object", "properties": {"a": {"$ref": "https://example.com/bad.json"}}}, "remote-ref-left"),
    case({"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
          "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}},
         {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
          "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}}, "cycle-left"),
    # Inside a resource with its own `$id`, `#/$defs/bad` is that resource's (a string here): the root's namesake
    # is not looked up, nor inlined in an allOf (it was: a string where the output check reads an integer).
    case({"$defs": {"bad": BAD}, "type": "object",
          "properties": {"p": {"$id": "https://example.com/p", "$defs": {"bad": {"type": "string"}},
                               "properties": {"a": REF_BAD}}}},
         {"$defs": {"bad": False}, "type": "object",
          "properties": {"p": {"$id": "https://example.com/p", "$defs": {"bad": {"type": "string"}},
                               "properties": {"a": REF_BAD}}}}, "another-resource-s-ref-left"),
    case({"$defs": {"s": {"type": "string"}},
          "properties": {"p": {"$id": "https://example.com/p", "$defs": {"s": {"type": "integer"}},
                               "allOf": [{"$ref": "#/$defs/s"}]}}},
         {"$defs": {"s": {"type": "string"}},
          "properties": {"p": {"$id": "https://example.com/p", "$defs": {"s": {"type": "integer"}},
                               "allOf": [{"$ref": "#/$defs/s"}]}}}, "another-resource-s-ref-not-inlined"),
    case({"$schema": D4, "definitions": {"s": {"type": "string"}},
          "properties": {"p": {"id": "http://example.com/p", "definitions": {"s": {"type": "integer"}},
                               "allOf": [{"$ref": "#/definitions/s"}]}}},
         {"$schema": D4, "definitions": {"s": {"type": "string"}},
          "properties": {"p": {"id": "http://example.com/p", "definitions": {"s": {"type": "integer"}},
                               "allOf": [{"$ref": "#/definitions/s"}]}}}, "draft-4-id-not-inlined"),
    # Only `$ref`s in or to a resource, or where one's keywords may be merged, are not looked up: one unused
    # elsewhere left every allOf of `$ref`s unmerged.
    case({"type": "object", "allOf": [{"$ref": "#/$defs/b"}, {"$ref": "#/$defs/c"}],
          "$defs": {"b": {"required": ["x"]}, "c": {"properties": {"y": {"type": "string"}}}, "ext": {"$id": EXT}}},
         {"type": "object", "required": ["x"], "properties": {"x": {}, "y": {"type": "string"}},
          "$defs": {"b": {"required": ["x"], "properties": {"x": {}}}, "c": {"properties": {"y": {"type": "string"}}},
                    "ext": {"$id": EXT}}}, "a-resource-elsewhere-leaves-other-refs-looked-up"),
    case({"$defs": {"t": {"type": "string"}, "ext": {"$id": EXT, "$defs": {"s": {"$ref": "#/$defs/t"}, "t": {}}}},
          "allOf": [{"$ref": "#/$defs/ext/$defs/s"}, {"type": "integer"}]},
         {"$defs": {"t": {"type": "string"}, "ext": {"$id": EXT, "$defs": {"s": {"$ref": "#/$defs/t"}, "t": {}}}},
          "allOf": [{"$ref": "#/$defs/ext/$defs/s"}, {"type": "integer"}]}, "a-target-in-a-resource-not-inlined"),
    case({"$defs": {"s": {"type": "string"}}, "minimum": 1,
          "allOf": [{"$id": EXT, "$defs": {"s": {"type": "integer"}}, "anyOf": [{"$ref": "#/$defs/s"}, {"type": "null"}]}]},
         {"$defs": {"s": {"type": "string"}}, "minimum": 1,
          "allOf": [{"$id": EXT, "$defs": {"s": {"type": "integer"}}, "anyOf": [{"$ref": "#/$defs/s"}, {"type": "null"}]}]},
         "a-resource-part-not-merged-into-its-node"),
    # A plain-name `$id` changes no base, nor does a property named `$id` or an `$id` in data.
    case({"$defs": {"s": {"type": "string"}, "t": {"$id": "#t"}},
          "properties": {"$id": {"const": {"$id": "x"}}, "p": {"allOf": [{"$ref": "#/$defs/s"}]}}},
         {"$defs": {"s": {"type": "string"}, "t": {"$id": "#t"}},
          "properties": {"$id": {"const": {"$id": "x"}}, "p": {"type": "string"}}}, "no-other-resource-inlined"),
]

DISTRIBUTE = [
    case({"prefixItems": [True], "oneOf": [{"items": False}, {"type": "string"}]},
         {"prefixItems": [True], "oneOf": [{"items": False}, {"type": "string"}]},
         "prefix-items-beside-a-branchs-items-left"),
    case({"type": "object", "title": "T", "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
         {"title": "T", "anyOf": [{"type": "object", "required": ["a"], "properties": {"a": {}}},
                                  {"type": "object", "required": ["b"], "properties": {"b": {}}}]},
         "siblings-into-any-of"),
    case({"type": "integer", "oneOf": [{"minimum": 0}, {"maximum": -5}]},
         {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": -5}]}, "siblings-into-one-of"),
    case({"type": "string", "anyOf": [True, {"minLength": 1}]},
         {"anyOf": [{"type": "string"}, {"type": "string", "minLength": 1}]}, "true-branch"),
    case({"type": "string", "anyOf": [False, {"minLength": 1}]},
         {"anyOf": [{"type": "string", "minLength": 1}]}, "false-branch-dropped"),
    case({"type": "string", "anyOf": [{"type": "integer"}, {"minLength": 1}]},
         {"anyOf": [{"type": "string", "minLength": 1}]}, "contradicting-branch-dropped"),
    case({"title": "T", "anyOf": [{"type": "string"}, {"type": "null"}]},
         {"title": "T", "anyOf": [{"type": "string"}, {"type": "null"}]}, "only-annotations-beside"),
    case({"type": "object", "anyOf": [{"minProperties": 1}], "oneOf": [{"maxProperties": 2}]},
         {"type": "object", "anyOf": [{"minProperties": 1}], "oneOf": [{"maxProperties": 2}]},
         "any-of-and-one-of-left"),
    case({"type": "string", "anyOf": []}, {"type": "string", "anyOf": []}, "empty-any-of-left"),
    case({"type": "string", "oneOf": {"minLength": 1}}, {"type": "string", "oneOf": {"minLength": 1}},
         "one-of-not-a-list-left"),
    case({"pattern": "^[a-z]+$", "anyOf": [{"maxLength": 3}, {"minLength": 5}]},
         {"anyOf": [{"pattern": "^[a-z]{1,3}$"}, {"pattern": "^[a-z]{5,}$"}]}, "branches-shaped"),
    case({"type": "string", "anyOf": [{"allOf": [{"pattern": "a"}, {"pattern": "b"}]}, {"minLength": 1}]},
         {"type": "string", "anyOf": [{"allOf": [{"pattern": "a"}, {"pattern": "b"}]}, {"minLength": 1}]},
         "unmerged-all-of-branch-left"),
]

# A discriminated union written as `if`/`then` on one required property with an enum: one anyOf branch per set
# of its values that the same `then`/`else` schemas apply to (xgrammar and llguidance ignore `if`).
K_ABC = {"type": "object", "properties": {"k": {"enum": ["a", "b", "c"]}}, "required": ["k"]}
IF_K = {"if": {"properties": {"k": {"const": "a"}}}, "then": {"required": ["x"]}}
# K_ABC's cases under IF_K: k "a" requires x, "b" and "c" do not.
A_CASE = {"type": "object", "properties": {"k": {"enum": ["a"]}, "x": {}}, "required": ["k", "x"]}
BC_CASE = {"type": "object", "properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"]}

IF_THEN_CASES = [
    # Drafts 4 and 6 have no if: left as written.
    case({"$schema": "http://json-schema.org/draft-06/schema#", **K_ABC, **IF_K},
         {"$schema": "http://json-schema.org/draft-06/schema#", **K_ABC, "if": IF_K["if"],
          "then": {"required": ["x"], "properties": {"x": {}}}}, "draft-6-has-no-if"),
    case({"$schema": D4, **K_ABC,
          "allOf": [{"if": {"properties": {"k": {"enum": ["a"]}}}, "then": {"maxProperties": 1}}]},
         {"$schema": D4, **K_ABC, "if": {"properties": {"k": {"enum": ["a"]}}}, "then": {"maxProperties": 1}},
         "draft-4-has-no-if-its-part-merged-as-written"),
    case({"$schema": D7, **K_ABC, **IF_K}, {"$schema": D7, "anyOf": [A_CASE, BC_CASE]}, "draft-7-has-if"),
    # The node's annotations ($defs among them) stay once, at the node, not copied into every case.
    case({**K_ABC, "title": "T", "$defs": {"d": {"type": "string"}}, "allOf": [IF_K]},
         {"title": "T", "$defs": {"d": {"type": "string"}}, "anyOf": [A_CASE, BC_CASE]}, "annotations-once-at-the-node"),
    # A case contradicting the node's own keywords (x an integer, then a string) matches nothing: dropped.
    case({"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "x": {"type": "integer"}},
          "required": ["kind", "x"], "if": {"properties": {"kind": {"const": "a"}}},
          "then": {"properties": {"x": {"type": "string"}}}},
         {"anyOf": [{"type": "object", "properties": {"kind": {"enum": ["b"]}, "x": {"type": "integer"}},
                     "required": ["kind", "x"]}]}, "a-case-contradicting-the-node-dropped"),
    case({"type": "object", "properties": {"kind": {"enum": ["c", "a"]}}, "required": ["kind", "x"],
          "if": {"properties": {"kind": {"const": "a"}}},
          "then": {"properties": {"kind": {}}, "additionalProperties": False}},
         {"anyOf": [{"type": "object", "properties": {"kind": {"enum": ["c"]}, "x": {}}, "required": ["kind", "x"]}]},
         "a-case-forbidding-a-required-name-dropped"),
    case({**K_ABC, "allOf": [IF_K, {"if": {"properties": {"k": {"const": "b"}}, "required": ["k"]},
                                    "then": {"required": ["y"]}, "else": {"maxProperties": 2}}]},
         {"anyOf": [{"type": "object", "properties": {"k": {"enum": ["a"]}, "x": {}}, "required": ["k", "x"],
                     "maxProperties": 2},
                    {"type": "object", "properties": {"k": {"enum": ["b"]}, "y": {}}, "required": ["k", "y"]},
                    {"type": "object", "properties": {"k": {"enum": ["c"]}}, "required": ["k"], "maxProperties": 2}]},
         "one-branch-per-value"),
    case({**K_ABC, "allOf": [{"if": {"properties": {"k": {"enum": ["a", "b"]}}}, "then": {"minProperties": 2}}]},
         {"anyOf": [{"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"],
                     "minProperties": 2},
                    {"type": "object", "properties": {"k": {"enum": ["c"]}}, "required": ["k"]}]},
         "values-with-the-same-schemas-share-a-branch"),
    case({**K_ABC, **IF_K}, {"anyOf": [{"type": "object", "properties": {"k": {"enum": ["a"]}, "x": {}},
                                        "required": ["k", "x"]},
                                       {"type": "object", "properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"]}]},
         "the-node's-own-if"),
    case({"type": "object", "properties": {"k": {"const": "s3"}}, "required": ["k"], "title": "T",
          "allOf": [{"$ref": "#/definitions/min"}, IF_K | {"if": {"properties": {"k": {"const": "s3"}}}}],
          "definitions": {"min": {"minProperties": 1}}},
         {"type": "object", "properties": {"k": {"const": "s3"}, "x": {}}, "required": ["k", "x"],
          "title": "T", "minProperties": 1, "definitions": {"min": {"minProperties": 1}}},
         "one-case-merged-with-the-other-parts"),
    case({"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "allOf": [IF_K]},
         {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "if": IF_K["if"],
          "then": {"required": ["x"], "properties": {"x": {}}}}, "discriminator-not-required-left"),
    case({**K_ABC, "type": ["object", "null"], "allOf": [IF_K]},
         {**K_ABC, "type": ["object", "null"], "if": IF_K["if"], "then": {"required": ["x"], "properties": {"x": {}}}},
         "not-only-objects-left"),
    case({**K_ABC, "allOf": [{"if": {"properties": {"k": {"const": "a", "type": "string"}}}, "then": {"maxProperties": 1}}]},
         {**K_ABC, "if": {"properties": {"k": {"const": "a", "type": "string"}}}, "then": {"maxProperties": 1}},
         "if-more-than-the-values-left"),
    case({**K_ABC, "properties": {"k": {"enum": ["a"]}, "j": {"enum": [1]}}, "required": ["k", "j"],
          "allOf": [IF_K, {"if": {"properties": {"j": {"const": 1}}}, "then": {"maxProperties": 3}}]},
         {**K_ABC, "properties": {"k": {"enum": ["a"]}, "j": {"enum": [1]}}, "required": ["k", "j"], "if": IF_K["if"],
          "then": {"required": ["x"], "properties": {"x": {}}}}, "two-discriminators-left"),
    case({**K_ABC, "anyOf": [{"minProperties": 1}], "allOf": [IF_K]},
         {"anyOf": [{"anyOf": [{"type": "object", "properties": {"k": {"enum": ["a"]}, "x": {}}, "required": ["k", "x"],
                                "minProperties": 1},
                               {"type": "object", "properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"],
                                "minProperties": 1}]}]},
         "beside-an-any-of-in-its-branch"),
    case({**K_ABC, **IF_K, "else": {"maxProperties": 1}},
         {"anyOf": [A_CASE, {**BC_CASE, "maxProperties": 1}]}, "the-node's-own-else"),
    case({**K_ABC, **IF_K, "allOf": {"minProperties": 1}},
         {**K_ABC, "if": IF_K["if"], "then": {"required": ["x"], "properties": {"x": {}}}, "allOf": {"minProperties": 1}},
         "all-of-not-a-list-left"),
    *(case({**K_ABC, "allOf": [IF_K, {key: [{"minProperties": 1}, {"maxProperties": 3}]}]},
           {key: [{"anyOf": [{**A_CASE, "minProperties": 1}, {**BC_CASE, "minProperties": 1}]},
                  {"anyOf": [{**A_CASE, "maxProperties": 3}, {**BC_CASE, "maxProperties": 3}]}]},
           f"{key}-in-another-part-merged-first") for key in ("anyOf", "oneOf")),
    case({"allOf": [IF_K, False]}, False, "false-part-is-false"),
    case({**K_ABC, "allOf": [{"if": True, "then": {"required": ["x"]}}]},
         {**K_ABC, "if": True, "then": {"required": ["x"], "properties": {"x": {}}}}, "if-not-an-object-left"),
    case({**K_ABC, "allOf": [{"if": {"properties": {"k": {"const": "a"}}, "minProperties": 2}, "then": {"maxProperties": 1}}]},
         {**K_ABC, "if": {"properties": {"k": {"const": "a"}}, "minProperties": 2}, "then": {"maxProperties": 1}},
         "if-beside-other-keywords-left"),
    case({**K_ABC, "allOf": [{"if": {"properties": {"k": {"const": "a"}}, "required": "k"}, "then": {"maxProperties": 1}}]},
         {**K_ABC, "if": {"properties": {"k": {"const": "a"}}, "required": "k"}, "then": {"maxProperties": 1}},
         "if-required-not-a-list-left"),
    # Each case shaped whole: a name the node requires is listed in every case, as in the node it replaces.
    case({**K_ABC, "required": ["k", "n"], "allOf": [IF_K]},
         {"anyOf": [{"type": "object", "properties": {"k": {"enum": ["a"]}, "x": {}, "n": {}}, "required": ["k", "n", "x"]},
                    {"type": "object", "properties": {"k": {"enum": ["b", "c"]}, "n": {}}, "required": ["k", "n"]}]},
         "each-case-shaped"),
]

CLOSED = {"additionalProperties": False}
# oneOf branches, objects told apart by one property's values, which some branch does not require: required in
# each, so no document matches two (one without it is no longer written: narrower, never looser).
ONE_OF_TOLD_APART = [
    case({"type": "object", "oneOf": [{"properties": {"t": {"type": "string", "enum": ["a"]}, "v": {"type": "string"}}},
                                      {"properties": {"t": {"enum": ["b", "c"]}}, "required": ["v"]}]},
         {"oneOf": [{"type": "object", "properties": {"t": {"type": "string", "enum": ["a"]}, "v": {"type": "string"}},
                     "required": ["t"]},
                    {"type": "object", "properties": {"t": {"enum": ["b", "c"]}, "v": {}}, "required": ["v", "t"]}]},
         "discriminator-required-in-each"),
    case({"oneOf": [{"type": "object", "properties": {"u": {}, "t": {"const": 1}}, "required": ["t"]},
                    {"type": "object", "properties": {"t": {"const": 2}}}]},
         {"oneOf": [{"type": "object", "properties": {"u": {}, "t": {"const": 1}}, "required": ["t"]},
                    {"type": "object", "properties": {"t": {"const": 2}}, "required": ["t"]}]}, "const-values"),
    case({"oneOf": [{"type": "object", "properties": {"t": {"const": 1}}, "required": ["t"]},
                    {"type": "object", "properties": {"t": {"const": 2}}, "required": ["t"]}]},
         {"oneOf": [{"type": "object", "properties": {"t": {"const": 1}}, "required": ["t"]},
                    {"type": "object", "properties": {"t": {"const": 2}}, "required": ["t"]}]}, "already-required"),
    case({"oneOf": [{"type": "object", "properties": {"t": {"enum": [1, 2]}}},
                    {"type": "object", "properties": {"t": {"enum": [2.0]}}}]},
         {"oneOf": [{"type": "object", "properties": {"t": {"enum": [1, 2]}}},
                    {"type": "object", "properties": {"t": {"enum": [2.0]}}}]}, "a-value-in-two-branches-left"),
    case({"oneOf": [{"type": "object", "properties": {"t": {"const": 1}}}, {"properties": {"t": {"const": 2}}}]},
         {"oneOf": [{"type": "object", "properties": {"t": {"const": 1}}}, {"properties": {"t": {"const": 2}}}]},
         "a-branch-not-only-objects-left"),
    case({"oneOf": [{"type": "object", "properties": {"t": {"const": 1}}},
                    {"type": "object", "properties": {"t": {"type": "integer"}}}]},
         {"oneOf": [{"type": "object", "properties": {"t": {"const": 1}}},
                    {"type": "object", "properties": {"t": {"type": "integer"}}}]}, "no-values-in-a-branch-left"),
    case({"anyOf": [{"type": "object", "properties": {"t": {"const": 1}}},
                    {"type": "object", "properties": {"t": {"const": 2}}}]},
         {"anyOf": [{"type": "object", "properties": {"t": {"const": 1}}},
                    {"type": "object", "properties": {"t": {"const": 2}}}]}, "any-of-left"),
    case({"oneOf": [{"type": "object", "properties": {"a": {"const": 1}, "b": {"const": "x"}}},
                    {"type": "object", "properties": {"b": {"const": "y"}, "a": {"const": 2}}}]},
         {"oneOf": [{"type": "object", "properties": {"a": {"const": 1}, "b": {"const": "x"}}, "required": ["a"]},
                    {"type": "object", "properties": {"b": {"const": "y"}, "a": {"const": 2}}, "required": ["a"]}]},
         "the-first-branch's-first-property-told-apart"),
    case({"oneOf": [{"type": "object", "properties": {"a": {"const": 1}, "b": {"const": "x"}}},
                    {"type": "object", "properties": {"a": {"const": 1}, "b": {"const": "y"}}}]},
         {"oneOf": [{"type": "object", "properties": {"a": {"const": 1}, "b": {"const": "x"}}, "required": ["b"]},
                    {"type": "object", "properties": {"a": {"const": 1}, "b": {"const": "y"}}, "required": ["b"]}]},
         "a-shared-value-then-the-next-property"),
    # Closed branches with no name in common (JsonSchemaStore's dart-test): `{}` is the one shared document.
    case({"type": "object", "oneOf": [{"properties": {"except": {}}, **CLOSED}, {"properties": {"only": {}}, **CLOSED},
                                      {"properties": {"x": {}}, "required": ["x"], **CLOSED}]},
         {"oneOf": [{"type": "object", "properties": {"except": {}}, **CLOSED, "minProperties": 1},
                    {"type": "object", "properties": {"only": {}}, **CLOSED, "minProperties": 1},
                    {"type": "object", "properties": {"x": {}}, "required": ["x"], **CLOSED}]},
         "closed-branches-without-a-common-name"),
    case({"type": "object", "oneOf": [{"properties": {"a": {}}, **CLOSED},
                                      {"properties": {"b": {}}, "minProperties": 1, **CLOSED}]},
         {"oneOf": [{"type": "object", "properties": {"a": {}}, **CLOSED},
                    {"type": "object", "properties": {"b": {}}, "minProperties": 1, **CLOSED}]},
         "closed-branches-one-takes-the-empty-object-left"),
    case({"type": "object", "oneOf": [{"properties": {"a": {}}, **CLOSED}, {"properties": {"a": {}, "b": {}}, **CLOSED}]},
         {"oneOf": [{"type": "object", "properties": {"a": {}}, **CLOSED},
                    {"type": "object", "properties": {"a": {}, "b": {}}, **CLOSED}]},
         "closed-branches-a-common-name-left"),
    case({"type": "object", "oneOf": [{"properties": {"a": {}}, **CLOSED}, {"properties": {"b": {}}}]},
         {"oneOf": [{"type": "object", "properties": {"a": {}}, **CLOSED}, {"type": "object", "properties": {"b": {}}}]},
         "an-open-branch-left"),
    case({"type": "object", "oneOf": [{"properties": {"a": {}}, "patternProperties": {"^b": {}}, **CLOSED},
                                      {"properties": {"b": {}}, **CLOSED}]},
         {"oneOf": [{"type": "object", "properties": {"a": {}}, "patternProperties": {"^b": {}}, **CLOSED},
                    {"type": "object", "properties": {"b": {}}, **CLOSED}]}, "a-pattern-may-share-a-name-left"),
    case({"type": "object", "oneOf": [{"properties": {"a": {}}, **CLOSED},
                                      {"properties": {"b": {}}, "minProperties": 1, **CLOSED}]},
         {"oneOf": [{"type": "object", "properties": {"a": {}}, **CLOSED},
                    {"type": "object", "properties": {"b": {}}, "minProperties": 1, **CLOSED}]},
         "closed-branches-one-has-min-properties-1-left"),
]

NOT_TYPE = [
    case({"not": {"type": "string"}}, {"type": ALL_BUT_STRING}, "not-string"),
    # Non-integral numbers are left, which no type names: left as written where the node admits number.
    case({"not": {"type": "integer"}}, {"not": {"type": "integer"}}, "not-integer-untyped-left"),
    case({"type": "number", "not": {"type": "integer"}}, {"type": "number", "not": {"type": "integer"}},
         "not-integer-beside-number-left"),
    case({"type": ["integer", "string"], "not": {"type": "integer"}}, {"type": "string"},
         "not-integer-beside-integer-and-string"),
    case({"type": "integer", "not": {"type": "integer"}}, False, "not-integer-beside-integer"),
    case({"not": {"type": "number"}}, {"type": NO_NUMBERS}, "not-number"),
    case({"not": {"type": ["string", "null"]}}, {"type": ["object", "array", "number", "boolean"]}, "not-two-types"),
    case({"not": {"type": ["string", "integer"]}}, {"not": {"type": ["string", "integer"]}},
         "not-a-type-and-integer-left"),
    case({"type": ["string", "integer", "null"], "not": {"type": ["string", "integer"]}}, {"type": "null"},
         "not-a-type-and-integer-beside-no-number"),
    case({"not": {"type": ["object", "array", "string", "boolean", "null"]}}, {"type": ["number"]},
         "only-numbers-left"),
    case({"minimum": 1, "not": {"type": "object"}}, {"minimum": 1, "type": ["array", "string", "number", "boolean",
                                                                           "null"]}, "other-keywords-kept"),
    case({"type": ["string", "integer"], "not": {"type": "string"}}, {"type": "integer"}, "intersected-with-the-node"),
    case({"type": "string", "not": {"type": "string"}}, False, "nothing-left-is-false"),
    case({"type": "strin", "not": {"type": "string"}}, {"type": "strin", "not": {"type": "string"}},
         "a-name-that-is-no-type-left"),
    case({"not": {"type": "string", "minLength": 1}}, {"not": {"type": "string", "minLength": 1}},
         "not-more-than-a-type-left"),
    case({"not": {"minLength": 1}}, {"not": {"minLength": 1}}, "not-without-type-left"),
]

FALSE_PROPERTIES = [
    case({"type": "object", "properties": {"a": {}, "additionalProperties": False}, "additionalProperties": False},
         {"type": "object", "properties": {"a": {}}, "additionalProperties": False}, "unlisted-on-a-closed-object"),
    case({"properties": {"a": False}}, {"properties": {"a": False}}, "open-object-left"),
    case({"properties": {"a": False}, "additionalProperties": False, "patternProperties": {"^a": {}}},
         {"properties": {"a": False}, "additionalProperties": False, "patternProperties": {"^a": {}}},
         "beside-pattern-properties-left"),
    # (A type name JSON does not have: not made `false`, nor narrowed to the other types, for its required `a`.)
    case({"type": ["object", "strin"], "properties": {"a": False, "b": False}, "additionalProperties": False,
          "required": ["a"]},
         {"type": ["object", "strin"], "properties": {"a": False}, "additionalProperties": False, "required": ["a"]},
         "required-one-left"),
]

REQUIRED = [
    case({"type": "object", "required": ["a"]}, {"type": "object", "required": ["a"], "properties": {"a": {}}},
         "listed"),
    case({"required": ["a"], "properties": {"b": {"type": "string"}}},
         {"required": ["a"], "properties": {"b": {"type": "string"}, "a": {}}}, "listed-beside-others"),
    case({"required": ["a"], "additionalProperties": {"type": "integer"}},
         {"required": ["a"], "additionalProperties": {"type": "integer"}, "properties": {"a": {"type": "integer"}}},
         "listed-with-additional-properties"),
    case({"required": ["a"], "additionalProperties": False}, NOT_OBJECT, "additional-false-is-no-object"),
    case({"required": ["a"], "additionalProperties": False, "patternProperties": {"^a+": {}}},
         {"required": ["a"], "additionalProperties": False, "patternProperties": {"^a+": {}}},
         "additional-false-beside-a-pattern-left"),
    case({"required": ["a"], "patternProperties": {"^a": {"type": "string"}}},
         {"required": ["a"], "patternProperties": {"^a": {"type": "string"}}}, "pattern-properties-left"),
    case({"required": ["a"], "properties": []}, {"required": ["a"], "properties": []}, "properties-not-a-map-left"),
    case({"required": ["a"], "properties": {"a": {"type": "string"}}},
         {"required": ["a"], "properties": {"a": {"type": "string"}}}, "already-listed"),
    # Each in its own drafts: dependencies up to draft 7, dependentRequired after (no $schema: 2020-12).
    case({"$schema": D7, "required": ["a"], "dependencies": {"a": ["b"], "b": ["c"], "d": ["e"]},
          "properties": {"a": {}, "b": {}, "c": {}}},
         {"$schema": D7, "required": ["a", "b", "c"], "dependencies": {"a": ["b"], "b": ["c"], "d": ["e"]},
          "properties": {"a": {}, "b": {}, "c": {}}}, "draft-7-dependencies-of-dependencies"),
    case({"type": "object", "required": ["a"], "dependencies": {"a": ["b"]}},
         {"type": "object", "required": ["a"], "dependencies": {"a": ["b"]}, "properties": {"a": {}}},
         "2020-12-has-no-dependencies"),
    case({"$schema": D7, "type": "object", "required": ["a"], "dependentRequired": {"a": ["b"]}},
         {"$schema": D7, "type": "object", "required": ["a"], "dependentRequired": {"a": ["b"]},
          "properties": {"a": {}}}, "draft-7-has-no-dependent-required"),
    case({"required": ["a"], "dependentRequired": {"a": ["b", "a"]}, "properties": {"a": {}, "b": {}}},
         {"required": ["a", "b"], "dependentRequired": {"a": ["b", "a"]}, "properties": {"a": {}, "b": {}}},
         "dependent-required"),
    case({"required": ["a"], "dependencies": {"a": {"required": ["b"]}}, "properties": {"a": {}}},
         {"required": ["a"], "dependencies": {"a": {"required": ["b"]}}, "properties": {"a": {}}},
         "schema-dependency-not-followed"),
    case({"required": ["a"], "dependencies": ["a"], "properties": {"a": {}}},
         {"required": ["a"], "dependencies": ["a"], "properties": {"a": {}}}, "dependencies-not-a-map"),
    case({"$schema": D4, "required": ["a"], "dependencies": {"a": ["b", 7]}}, {"$schema": D4, "required": ["a", "b"],
         "dependencies": {"a": ["b", 7]}, "properties": {"a": {}, "b": {}}}, "draft-4-dependency-names-only"),
    case({"required": ["a", 7], "properties": {"a": {}}}, {"required": ["a"], "properties": {"a": {}}},
         "names-only"),
    case({"required": "a"}, {"required": "a"}, "required-not-a-list"),
]

PATTERN_LENGTHS = [
    case({"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 5},
         {"type": "string", "pattern": "^[a-z]{2,5}$"}, "plus"),
    # Unanchored (at either end), a match may sit within a longer string: left as written.
    case({"pattern": "[a-z]*", "maxLength": 3}, {"pattern": "[a-z]*", "maxLength": 3}, "star-unanchored-left"),
    case({"maxLength": 3, "pattern": "[ab]+"}, {"maxLength": 3, "pattern": "[ab]+"}, "plus-unanchored-left"),
    case({"minLength": 2, "pattern": "^[ab]{2,}"}, {"minLength": 2, "pattern": "^[ab]{2,}"}, "no-end-anchor-left"),
    case({"minLength": 2, "pattern": "[ab]{2,}$"}, {"minLength": 2, "pattern": "[ab]{2,}$"}, "no-start-anchor-left"),
    # A maxLength with room for the fewest repeats only: a match is the whole string, anchored or not.
    case({"pattern": "[a-zA-Z]{3}", "minLength": 3, "maxLength": 3}, {"pattern": "^[a-zA-Z]{3,3}$"},
         "unanchored-at-the-fewest-repeats"),
    case({"pattern": "^[ab]{2,}", "maxLength": 2.5}, {"pattern": "^[ab]{2,2}$"}, "no-end-anchor-at-the-fewest-repeats"),
    case({"pattern": "[ab]{2,5}", "maxLength": 3}, {"pattern": "[ab]{2,5}", "maxLength": 3},
         "unanchored-past-the-fewest-repeats-left"),
    case({"pattern": "^[a-z]+$", "maxLength": float("inf")}, {"pattern": "^[a-z]+$", "maxLength": float("inf")},
         "infinite-max-left"),
    # Counts past what the regex engines take (xgrammar refused the pattern: "Integer is too large"): left.
    case({"pattern": "^[a-z]+$", "maxLength": 1e300}, {"pattern": "^[a-z]+$", "maxLength": 1e300}, "huge-max-left"),
    case({"pattern": "^[a-z]+$", "minLength": 1e20}, {"pattern": "^[a-z]+$", "minLength": 1e20}, "huge-min-left"),
    case({"pattern": "^[a-z]+$", "maxLength": 2**32 - 2}, {"pattern": f"^[a-z]{{1,{2**32 - 2}}}$"},
         "largest-count-written"),
    case({"pattern": "^\\d{2,}$", "maxLength": 4}, {"pattern": "^\\d{2,4}$"}, "at-least"),
    case({"pattern": "^.{1,10}$", "minLength": 3, "maxLength": 20}, {"pattern": "^.{3,10}$"}, "range-tightened"),
    case({"pattern": "^.{4,10}$", "minLength": 3, "maxLength": 6}, {"pattern": "^.{4,6}$"}, "range-min-from-pattern"),
    case({"pattern": "^[ab]{4}$", "minLength": 1}, {"pattern": "^[ab]{4,4}$"}, "exactly"),
    case({"pattern": "^[ab]{2}$", "maxLength": 7}, {"pattern": "^[ab]{2,2}$"}, "exactly-under-max"),
    case({"pattern": "^[ab]{2,}$", "minLength": 5}, {"pattern": "^[ab]{5,}$"}, "at-least-min"),
    case({"pattern": "^[a-z]+$", "minLength": 1}, {"pattern": "^[a-z]{1,}$"}, "min-only"),
    case({"pattern": "^[a-z]*$", "minLength": 0}, {"pattern": "^[a-z]{0,}$"}, "min-zero"),
    case({"pattern": "^[a-z]+$", "minLength": 3, "maxLength": 3}, {"pattern": "^[a-z]{3,3}$"}, "min-equals-max"),
    case({"pattern": "^\\w*$", "maxLength": 8}, {"pattern": "^\\w{0,8}$"}, "escape-class"),
    case({"pattern": "^[\\]x]+$", "maxLength": 2}, {"pattern": "^[\\]x]{1,2}$"}, "escaped-bracket-in-class"),
    case({"pattern": "^[a-z]{1,3}$", "minLength": 5}, {"pattern": "^[a-z]{1,3}$", "minLength": 5},
         "unsatisfiable-left"),
    case({"pattern": "^[a-z]+$", "minLength": 2.5, "maxLength": 4.5}, {"pattern": "^[a-z]{3,4}$"},
         "fractional-lengths-inside"),
    case({"pattern": "^[a-z]+$", "maxLength": 0}, {"type": every_type_but("string")},
         "max-under-plus-is-every-other-type"),
    case({"pattern": "^[a-z]+$", "minLength": "2"}, {"pattern": "^[a-z]+$", "minLength": "2"}, "min-not-a-number-left"),
    case({"pattern": "^[a-z]+$", "maxLength": "x"}, {"pattern": "^[a-z]+$", "maxLength": "x"}, "max-not-a-number-left"),
    case({"pattern": "^[a-z]+@x$", "maxLength": 4}, {"pattern": "^[a-z]+@x$", "maxLength": 4}, "not-one-class-left"),
    case({"pattern": "^[a-z]+$"}, {"pattern": "^[a-z]+$"}, "no-lengths"),
    case({"pattern": 5, "maxLength": 4}, {"pattern": 5, "maxLength": 4}, "pattern-not-a-string"),
    case({"pattern": "^[a-z]{2,4}x$", "maxLength": 3}, {"pattern": "^[a-z]{2,4}x$", "maxLength": 3},
         "more-after-the-repetition-left"),
    case({"pattern": "^\\d$", "maxLength": 3}, {"pattern": "^\\d$", "maxLength": 3}, "no-quantifier-left"),
]

ENUM_TYPES = [
    # xgrammar enforces one of a const and an enum on one node: the const alone where the enum allows it.
    case({"allOf": [{"enum": ["a", "b"]}, {"const": "a"}]}, {"const": "a"}, "a-const-the-enum-allows"),
    case({"allOf": [{"enum": [1]}, {"const": "a"}]}, False, "a-const-the-enum-does-not-allow-is-false"),
    case({"type": "integer", "enum": [1, 1.0, 1.5, "1", True, None]}, {"type": "integer", "enum": [1, 1.0]},
         "integer"),
    case({"type": "number", "enum": [1, 1.5, "x", False]}, {"type": "number", "enum": [1, 1.5]}, "number"),
    case({"type": "string", "enum": ["a", 1, None]}, {"type": "string", "enum": ["a"]}, "string"),
    case({"type": "boolean", "enum": [True, 0, "true"]}, {"type": "boolean", "enum": [True]}, "boolean"),
    case({"type": "null", "enum": [None, 0, ""]}, {"type": "null", "enum": [None]}, "null"),
    case({"type": "object", "enum": [{}, [], "x"]}, {"type": "object", "enum": [{}]}, "object"),
    case({"type": "array", "enum": [[], {}]}, {"type": "array", "enum": [[]]}, "array"),
    case({"type": ["string", "null"], "enum": ["a", None, 1]}, {"type": ["string", "null"], "enum": ["a", None]},
         "two-types"),
    case({"type": ["strin", "integer"], "enum": ["a", 1]}, {"type": ["strin", "integer"], "enum": [1]},
         "unknown-type-name"),
    case({"type": "string", "enum": [1, 2]}, False, "none-kept-is-false"),
    case({"type": 5, "enum": [1, "a"]}, {"type": 5, "enum": [1, "a"]}, "type-not-a-name"),
    case({"enum": [1, "a"]}, {"enum": [1, "a"]}, "no-type"),
    case({"type": "string", "enum": "a"}, {"type": "string", "enum": "a"}, "enum-not-a-list"),
]


# A node no value satisfies is `false`, exactly (never where some value may satisfy it), and `false` goes up where
# it certainly makes its parent match nothing. Rows expecting False are refused (UNSATISFIABLE_REFUSED).
NO_STRING = {"type": "string", "enum": [1, 2]}
UNSATISFIABLE = [
    case({"type": "integer", "const": "a"}, False, "const-not-of-the-type"),
    case({"type": "integer", "const": True}, False, "true-is-no-integer"),
    case({"type": "integer", "const": 1.5}, False, "1.5-is-no-integer"),
    case({"type": "integer", "const": 1.0}, {"type": "integer", "const": 1.0}, "1.0-is-an-integer"),
    case({"type": "number", "const": 3}, {"type": "number", "const": 3}, "an-integer-is-a-number"),
    case({"type": ["string", "null"], "const": None}, {"type": ["string", "null"], "const": None}, "one-of-two-types"),
    case({"type": "strin", "const": 1}, {"type": "strin", "const": 1}, "a-name-that-is-no-type-left"),
    case({"type": "strin", "enum": [1]}, {"type": "strin", "enum": [1]}, "enum-beside-a-name-that-is-no-type-left"),
    case({"type": [], "const": 1}, {"type": [], "const": 1}, "no-type-names-left"),
    case({"const": 1}, {"const": 1}, "no-type"),
    case({"enum": []}, False, "empty-enum"),
    case({"enum": [], "type": "string"}, False, "empty-enum-beside-a-type"),
    # Other keywords beside the enum are kept: only the type narrows it.
    case({"type": "string", "enum": ["a", 1], "maxLength": 3, "pattern": "^a"},
         {"type": "string", "enum": ["a"], "maxLength": 3, "pattern": "^a"}, "other-keywords-kept"),
    case({"type": "string", "const": "a", "pattern": "^b"}, {"type": "string", "const": "a", "pattern": "^b"},
         "a-pattern-not-checked"),
    case({"allOf": [{"type": "string"}, {"const": 1}]}, False, "an-all-of-s-const-not-of-the-other-s-type"),
    case({"type": "object", "properties": {"a": NO_STRING}, "required": ["a"]}, False, "a-required-property"),
    case({"type": ["object"], "properties": {"a": NO_STRING}, "required": ["b", 7, ["a"], "a"]}, False,
         "a-required-property-listed-later"),
    case({"type": "object", "properties": {"a": NO_STRING, "b": {}}},
         {"type": "object", "properties": {"a": False, "b": {}}}, "an-optional-property-on-an-open-object"),
    case({"type": "object", "properties": {"a": NO_STRING, "b": {}}, "additionalProperties": False},
         {"type": "object", "properties": {"b": {}}, "additionalProperties": False},
         "an-optional-property-on-a-closed-object-unlisted"),
    # Other types ignore `required`: the node admits them (and no object).
    case({"properties": {"a": NO_STRING}, "required": ["a"]}, NOT_OBJECT, "untyped-node-is-every-other-type"),
    case({"type": ["object", "null"], "properties": {"a": NO_STRING}, "required": ["a"]}, {"type": "null"},
         "another-type-kept"),
    case({"type": "object", "properties": {"a": NO_STRING}, "required": "a"},
         {"type": "object", "properties": {"a": False}, "required": "a"}, "required-not-a-list-left"),
    case({"type": "object", "properties": [], "required": ["a"]}, {"type": "object", "properties": [], "required": ["a"]},
         "properties-not-a-map-left"),
    case({"type": "object", "properties": {"o": {"type": "object", "properties": {"a": NO_STRING}, "required": ["a"]}}},
         {"type": "object", "properties": {"o": False}}, "an-optional-object-with-a-required-false-property"),
    case({"type": "object", "properties": {"o": {"type": "object", "properties": {"a": NO_STRING}, "required": ["a"]}},
          "required": ["o"]}, False, "required-all-the-way-up"),
    case({"type": "array", "items": {"type": "integer", "const": "a"}, "minItems": 1}, False, "items-and-min-items"),
    case({"type": "array", "items": NO_STRING}, {"type": "array", "items": False}, "items-without-min-items"),
    case({"type": "array", "items": NO_STRING, "minItems": 0}, {"type": "array", "items": False, "minItems": 0},
         "items-min-items-0"),
    case({"type": "array", "items": NO_STRING, "minItems": "1"}, {"type": "array", "items": False, "minItems": "1"},
         "min-items-not-a-number-left"),
    case({"items": NO_STRING, "minItems": 2}, {"type": ["boolean", "null", "number", "object", "string"]},
         "untyped-node-is-every-other-type-than-array"),
    case({"type": "array", "prefixItems": [{}, NO_STRING], "minItems": 2}, False, "prefix-item-within-min-items"),
    case({"type": "array", "prefixItems": [{}, NO_STRING], "minItems": 1},
         {"type": "array", "prefixItems": [{}, False], "minItems": 1}, "prefix-item-past-min-items-left"),
    # The prefix is the draft's: an items array up to 2019-09, prefixItems from 2020-12 (no $schema: 2020-12).
    case({"$schema": D7, "type": "array", "items": [NO_STRING], "minItems": 1}, False,
         "draft-7-tuple-item-within-min-items"),
    case({"type": "array", "items": [NO_STRING], "minItems": 1}, {"type": "array", "items": [False], "minItems": 1},
         "2020-12-has-no-items-array"),
    case({"$schema": D7, "type": "array", "prefixItems": [False], "minItems": 1},
         {"$schema": D7, "type": "array", "minItems": 1}, "draft-7-has-no-prefix-items"),
    case({"$schema": D7, "type": ["array", "null"], "prefixItems": [False], "minItems": 1},
         {"$schema": D7, "type": ["array", "null"], "minItems": 1}, "draft-7-prefix-items-on-a-type-list"),
    case({"$schema": D7, "type": "array", "prefixItems": [True], "items": False, "minItems": 1}, False,
         "draft-7-items-false-past-no-prefix"),
    case({"type": "array", "prefixItems": [0, False], "minItems": 1},
         {"type": "array", "prefixItems": [0, False], "minItems": 1}, "0-is-not-false"),
    case({"$schema": D7, "type": "array", "prefixItems": [{}], "items": [{}, NO_STRING], "minItems": 2}, False,
         "draft-7-tuple-items-beside-prefix-items"),
    case({"type": "array", "prefixItems": [{}], "items": [{}, NO_STRING], "minItems": 2},
         {"type": "array", "prefixItems": [{}], "items": [{}, False], "minItems": 2},
         "2020-12-items-array-beside-prefix-items-left"),
    # 2020-12's closed tuple: items governs the elements past prefixItems only.
    case({"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False, "minItems": 2},
         {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False, "minItems": 2},
         "closed-tuple-within-its-prefix-left"),
    case({"type": "array", "prefixItems": [{"type": "number"}], "items": False, "minItems": 2}, False,
         "closed-tuple-past-its-prefix"),
    # The untyped allOf branch is satisfied by any non-object (3, "x"): kept as that, not dropped.
    case({"anyOf": [{"type": "string"}, {"allOf": [{"properties": {"a": {}}, "additionalProperties": False},
                                                   {"required": ["b"]}]}]},
         {"anyOf": [{"type": "string"}, NOT_OBJECT]}, "untyped-required-forbidden-branch-kept-as-no-object"),
    # Distributed: the branch requiring b is every non-object; the one requiring a stays exact.
    case({"properties": {"a": {"type": "integer"}}, "additionalProperties": False,
          "anyOf": [{"required": ["b"]}, {"required": ["a"]}]},
         {"anyOf": [NOT_OBJECT, {"properties": {"a": {"type": "integer"}}, "additionalProperties": False,
                                 "required": ["a"]}]}, "distributed-branch-no-object"),
    case({"anyOf": [NO_STRING, {"type": "null", "const": 0}]}, False, "every-any-of-branch"),
    case({"oneOf": [NO_STRING, {"type": "null"}]}, {"oneOf": [{"type": "null"}]}, "a-one-of-branch-dropped"),
    case({"type": "object", "anyOf": [{"properties": {"a": NO_STRING}, "required": ["a"]}, {"required": ["b"]}]},
         {"anyOf": [{"type": "object", "required": ["b"], "properties": {"b": {}}}]},
         "a-distributed-branch-dropped"),
    # Exact, but xgrammar refuses a `false` pattern: left as written.
    case({"allOf": [{"additionalProperties": {"type": "string"}}, {"patternProperties": {"^x": {"type": "integer"}}}]},
         {"allOf": [{"additionalProperties": {"type": "string"}}, {"patternProperties": {"^x": {"type": "integer"}}}]},
         "a-pattern-the-others-additional-properties-contradict-left"),
    case({"allOf": [{"type": "object", "properties": {"a": {}}, "required": ["a"]},
                    {"properties": {"a": {"type": "string"}}}, {"properties": {"a": {"type": "integer"}}}]}, False,
         "a-property-the-parts-disagree-on-required"),
    case({**K_ABC, "allOf": [{"if": {"properties": {"k": {"const": "a"}}}, "then": False, "else": False}]}, False,
         "every-if-then-case"),
]


# Bounds no value of a type meets: that type goes from the node (untyped: every other type), its keywords with
# it; none left, the node is `false`. Enum values outside the bounds go; a const outside them is `false`. Only
# bounds the schema's draft has, read as the output check (jsonschema) reads them; the neighbours that some value
# meets are kept as they are.
NAN = float("nan")  # one object: NaN equals only itself


STRINGS = [
    case({"type": "string", "minLength": 5, "maxLength": 2}, False, "min-length-past-max-length"),
    case({"type": "string", "minLength": 2, "maxLength": 2}, {"type": "string", "minLength": 2, "maxLength": 2},
         "equal-lengths-kept"),
    case({"type": "string", "maxLength": -1}, False, "negative-max-length"),
    case({"type": "string", "maxLength": 0}, {"type": "string", "maxLength": 0}, "max-length-0-kept"),
    case({"type": "string", "minLength": 2.5, "maxLength": 2.7}, False, "no-whole-length-between"),
    case({"type": "string", "minLength": 2.5, "maxLength": 3}, {"type": "string", "minLength": 2.5, "maxLength": 3},
         "a-whole-length-between-kept"),
    case({"type": ["string", "number"], "minLength": 5, "maxLength": 2}, {"type": "number"},
         "string-dropped-from-a-type-list"),
    case({"minLength": 5, "maxLength": 2}, {"type": every_type_but("string")}, "untyped-is-every-other-type"),
    case({"type": ["string", "null"], "minLength": 5, "maxLength": 2, "pattern": "^a", "format": "email"},
         {"type": "null", "format": "email"}, "string-keywords-go-with-the-type"),
    case({"type": "string", "minLength": 5, "maxLength": "2"}, {"type": "string", "minLength": 5, "maxLength": "2"},
         "max-length-not-a-number-left"),
    case({"type": "string", "minLength": float("inf"), "maxLength": 2},
         {"type": "string", "minLength": float("inf"), "maxLength": 2}, "infinite-bound-not-read"),
    case({"type": "string", "minLength": True, "maxLength": 0}, {"type": "string", "minLength": True, "maxLength": 0},
         "boolean-bound-not-read"),
    case({"type": "strin", "minLength": 5, "maxLength": 2}, {"type": "strin", "minLength": 5, "maxLength": 2},
         "a-type-name-that-is-no-type-left"),
    case({"type": ["string", "integer", *every_type_but("string")], "minLength": 5, "maxLength": 2},
         {"type": ["integer", *every_type_but("string")]}, "every-type-name-but-string-kept"),
    # A one-atom pattern's fewest repeats past maxLength (its most are not read: Python's `$` takes a last "\n").
    case({"type": "string", "pattern": "^[a-z]{5}$", "maxLength": 2}, False, "pattern-repeats-past-max-length"),
    case({"type": "string", "pattern": "^[a-z]+$", "maxLength": 0}, False, "pattern-plus-past-max-length-0"),
    case({"type": ["string", "null"], "pattern": "[a-z]{3,}", "maxLength": 2}, {"type": "null"},
         "unanchored-pattern-repeats-past-max-length"),
    case({"type": "string", "pattern": "^[a-z]{2}$", "maxLength": 2}, {"type": "string", "pattern": "^[a-z]{2,2}$"},
         "pattern-repeats-at-max-length-kept"),
    case({"type": "string", "pattern": "^[a-z]*$", "maxLength": 0}, {"type": "string", "pattern": "^[a-z]{0,0}$"},
         "pattern-star-at-max-length-0-kept"),
    case({"type": "string", "pattern": "^[a-z]{2}$", "minLength": 3}, {"type": "string", "pattern": "^[a-z]{2}$",
                                                                       "minLength": 3},
         "pattern-most-repeats-not-read"),
    case({"type": "string", "pattern": "^[a-z]{5}$|x", "maxLength": 2},
         {"type": "string", "pattern": "^[a-z]{5}$|x", "maxLength": 2}, "another-pattern-not-read"),
    case({"type": "string", "pattern": "^[a-z]{5}$", "maxLength": "2"},
         {"type": "string", "pattern": "^[a-z]{5}$", "maxLength": "2"}, "pattern-beside-max-length-not-a-number-left"),
    case({"type": [], "minLength": 5, "maxLength": 2}, {"type": [], "minLength": 5, "maxLength": 2},
         "no-type-names-left"),
]

NUMBERS = [
    case({"type": "number", "minimum": 5, "maximum": 2}, False, "minimum-past-maximum"),
    case({"type": "number", "minimum": 2, "maximum": 2}, {"type": "number", "minimum": 2, "maximum": 2},
         "equal-bounds-kept"),
    case({"type": "number", "exclusiveMinimum": 3, "exclusiveMaximum": 3}, False, "equal-exclusive-bounds"),
    case({"type": "number", "minimum": 3, "exclusiveMaximum": 3}, False, "minimum-at-exclusive-maximum"),
    case({"type": "number", "exclusiveMinimum": 3, "maximum": 3}, False, "exclusive-minimum-at-maximum"),
    case({"type": "number", "minimum": 1, "exclusiveMinimum": 3, "maximum": 3}, False, "the-tighter-minimum-read"),
    case({"type": "number", "minimum": 3, "exclusiveMinimum": 1, "maximum": 3},
         {"type": "number", "minimum": 3, "exclusiveMinimum": 1, "maximum": 3}, "the-tighter-minimum-inclusive"),
    case({"type": "number", "minimum": 3, "exclusiveMinimum": 3, "maximum": 3}, False,
         "exclusive-where-both-minimums-are-equal"),
    case({"type": "number", "minimum": 3, "exclusiveMaximum": 3, "maximum": 3}, False,
         "exclusive-where-both-maximums-are-equal"),
    case({"type": "number", "exclusiveMinimum": 2, "exclusiveMaximum": 3},
         {"type": "number", "exclusiveMinimum": 2, "exclusiveMaximum": 3}, "a-fraction-between-kept"),
    case({"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 3}, False, "no-integer-between"),
    case({"type": "integer", "minimum": 1.2, "maximum": 1.8}, False, "no-integer-between-fractions"),
    case({"type": "integer", "minimum": 1.2, "maximum": 2}, {"type": "integer", "minimum": 1.2, "maximum": 2},
         "an-integer-at-the-maximum-kept"),
    case({"type": "integer", "minimum": 2, "exclusiveMaximum": 3}, {"type": "integer", "minimum": 2, "exclusiveMaximum": 3},
         "an-integer-at-the-minimum-kept"),
    case({"type": "integer", "multipleOf": 5, "minimum": 1, "maximum": 4}, False, "no-multiple-between"),
    case({"type": "integer", "multipleOf": 5, "minimum": 1, "maximum": 5},
         {"type": "integer", "multipleOf": 5, "minimum": 1, "maximum": 5}, "a-multiple-at-the-maximum-kept"),
    case({"type": "integer", "multipleOf": 5, "exclusiveMinimum": 0, "exclusiveMaximum": 5}, False,
         "no-multiple-between-exclusive-bounds"),
    case({"type": "integer", "multipleOf": 5, "minimum": 0, "exclusiveMaximum": 5},
         {"type": "integer", "multipleOf": 5, "minimum": 0, "exclusiveMaximum": 5}, "a-multiple-at-the-minimum-kept"),
    case({"type": "integer", "multipleOf": 5, "minimum": -4, "maximum": -1}, False, "no-negative-multiple-between"),
    case({"type": "number", "multipleOf": 1, "minimum": 1.2, "maximum": 1.8}, False, "a-multiple-of-1-is-an-integer"),
    case({"type": "integer", "minimum": 3, "maximum": 3}, {"type": "integer", "minimum": 3, "maximum": 3},
         "one-odd-integer-kept"),
    case({"type": "number", "multipleOf": 5, "minimum": 1, "maximum": 4}, False, "a-number-multiple-is-an-integer"),
    case({"type": "number", "multipleOf": 0.5, "minimum": 1.1, "maximum": 1.4},
         {"type": "number", "multipleOf": 0.5, "minimum": 1.1, "maximum": 1.4}, "a-fractional-multiple-of-not-read"),
    case({"type": "integer", "multipleOf": 0, "minimum": 1, "maximum": 4},
         {"type": "integer", "multipleOf": 0, "minimum": 1, "maximum": 4}, "multiple-of-0-not-read"),
    case({"type": "integer", "multipleOf": True, "minimum": 1.5, "maximum": 1.7}, False,
         "boolean-multiple-of-not-read"),
    case({"type": "integer", "minimum": 2**70 + 1, "maximum": 2**70 + 3, "multipleOf": 4}, False,
         "large-integers-exact"),
    case({"type": "integer", "minimum": 2**70 + 1, "maximum": 2**70 + 4, "multipleOf": 4},
         {"type": "integer", "minimum": 2**70 + 1, "maximum": 2**70 + 4, "multipleOf": 4}, "large-multiple-kept"),
    case({"type": "integer", "minimum": 0.5, "maximum": 0.9999999999999999}, False, "floats-exact"),
    case({"type": ["number", "integer"], "minimum": 1.2, "maximum": 1.8},
         {"type": "number", "minimum": 1.2, "maximum": 1.8}, "integer-dropped-beside-number"),
    case({"type": ["integer", "string"], "minimum": 5, "maximum": 2, "multipleOf": 2}, {"type": "string"},
         "number-keywords-go-with-the-type"),
    case({"minimum": 5, "maximum": 2}, {"type": every_type_but("number")}, "untyped-is-every-other-type"),
    case({"minimum": 1.2, "maximum": 1.8}, {"minimum": 1.2, "maximum": 1.8}, "untyped-fractions-kept"),
    case({"type": "number", "minimum": 5}, {"type": "number", "minimum": 5}, "one-bound-kept"),
    case({"type": "number", "maximum": 5, "exclusiveMaximum": 7}, {"type": "number", "maximum": 5, "exclusiveMaximum": 7},
         "upper-bounds-alone-kept"),
    case({"type": "number", "minimum": NAN, "maximum": 2}, {"type": "number", "minimum": NAN, "maximum": 2},
         "nan-not-read"),
    case({"$schema": D4, "type": "number", "exclusiveMinimum": 3, "exclusiveMaximum": 3},
         {"$schema": D4, "type": "number", "exclusiveMinimum": 3, "exclusiveMaximum": 3},
         "draft-4-exclusive-bounds-not-read"),
    case({"$schema": D4, "type": "number", "minimum": 3, "maximum": 3, "exclusiveMinimum": True},
         {"$schema": D4, "type": "number", "minimum": 3, "maximum": 3, "exclusiveMinimum": True},
         "draft-4-exclusive-flag-not-read"),
    case({"$schema": D4, "type": "number", "minimum": 5, "maximum": 2}, False, "draft-4-minimum-past-maximum"),
]

ARRAYS = [
    case({"type": "array", "minItems": 3, "maxItems": 1}, False, "min-items-past-max-items"),
    case({"type": "array", "minItems": 1, "maxItems": 1}, {"type": "array", "minItems": 1, "maxItems": 1},
         "equal-counts-kept"),
    case({"type": ["array", "null"], "minItems": 3, "maxItems": 1, "items": {"type": "string"}, "uniqueItems": True},
         {"type": "null"}, "array-keywords-go-with-the-type"),
    case({"minItems": 3, "maxItems": 1}, {"type": every_type_but("array")}, "untyped-is-every-other-type"),
    case({"type": "array", "contains": False}, False, "contains-false"),
    case({"type": "array", "contains": {"type": "string", "enum": [1]}}, False, "contains-of-no-value"),
    case({"type": "array", "contains": False, "minContains": 0}, {"type": "array", "contains": False, "minContains": 0},
         "contains-false-min-contains-0-kept"),
    case({"$schema": D7, "type": "array", "contains": False, "minContains": 0}, False,
         "draft-7-has-no-min-contains"),
    case({"$schema": D4, "type": "array", "contains": False}, {"$schema": D4, "type": "array"},
         "draft-4-has-no-contains"),
    case({"type": "array", "contains": {"type": "string"}, "maxItems": 0}, False, "contains-beside-max-items-0"),
    case({"type": "array", "contains": {"type": "string"}, "maxItems": 1},
         {"type": "array", "contains": {"type": "string"}, "maxItems": 1}, "contains-beside-max-items-1-kept"),
    case({"type": "array", "contains": {"type": "string"}, "minContains": 3, "maxItems": 2}, False,
         "min-contains-past-max-items"),
    case({"type": "array", "contains": {"type": "string"}, "minContains": 2, "maxItems": 2},
         {"type": "array", "contains": {"type": "string"}, "minContains": 2, "maxItems": 2},
         "min-contains-at-max-items-kept"),
    case({"type": "array", "contains": {"type": "string"}, "minContains": 3, "maxContains": 2}, False,
         "min-contains-past-max-contains"),
    case({"type": "array", "contains": {"type": "string"}, "minContains": 2, "maxContains": 2},
         {"type": "array", "contains": {"type": "string"}, "minContains": 2, "maxContains": 2},
         "equal-contains-counts-kept"),
    case({"type": "array", "contains": {"type": "string"}, "maxContains": 0}, False, "max-contains-0"),
    case({"$schema": D7, "type": "array", "contains": {}, "minContains": 3, "maxContains": 2},
         {"$schema": D7, "type": "array", "contains": {}}, "draft-7-has-no-contains-counts"),
    case({"type": "array", "contains": {}, "minContains": "2", "maxItems": 0},
         {"type": "array", "contains": {}, "minContains": "2", "maxItems": 0}, "min-contains-not-a-number-not-read"),
    case({"type": "array", "minContains": 3, "maxItems": 2}, {"type": "array", "minContains": 3, "maxItems": 2},
         "min-contains-without-contains-kept"),
    case({"$schema": D7, "type": "array", "contains": {}, "minContains": 2, "maxItems": 1},
         {"$schema": D7, "type": "array", "contains": {}, "maxItems": 1},
         "draft-7-min-contains-not-read-beside-max-items"),
    case({"$schema": D7, "type": "array", "contains": {}, "maxContains": 0},
         {"$schema": D7, "type": "array", "contains": {}}, "draft-7-max-contains-not-read"),
]

OBJECTS = [
    case({"type": "object", "minProperties": 3, "maxProperties": 1}, False, "min-properties-past-max-properties"),
    case({"type": "object", "minProperties": 1, "maxProperties": 1},
         {"type": "object", "minProperties": 1, "maxProperties": 1}, "equal-counts-kept"),
    case({"type": "object", "required": ["a", "b", "c"], "maxProperties": 2}, False, "more-required-than-max"),
    case({"type": "object", "required": ["a", "b", "a", 7], "maxProperties": 2},
         {"type": "object", "required": ["a", "b", "a"], "maxProperties": 2, "properties": {"a": {}, "b": {}}},
         "a-required-name-counted-once"),
    case({"type": "object", "properties": {"a": {}}, "required": ["b"], "additionalProperties": False}, False,
         "required-and-closed-out"),
    case({"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": False},
         {"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": False},
         "required-and-listed-kept"),
    case({"type": "object", "patternProperties": {"^b": {}}, "required": ["b"], "additionalProperties": False},
         {"type": "object", "patternProperties": {"^b": {}}, "required": ["b"], "additionalProperties": False},
         "required-and-matched-by-a-pattern-kept"),
    case({"type": "object", "patternProperties": {"^c": {}}, "required": ["b"], "additionalProperties": False}, False,
         "required-and-matched-by-no-literal-pattern"),
    case({"type": "object", "properties": {"a": {}}, "minProperties": 2, "additionalProperties": False}, False,
         "more-properties-than-it-allows"),
    case({"type": "object", "properties": {"a": {}, "b": NO_STRING}, "minProperties": 2, "additionalProperties": False},
         False, "a-false-property-not-allowed"),
    case({"type": "object", "properties": {"a": {}}, "minProperties": 1, "additionalProperties": False},
         {"type": "object", "properties": {"a": {}}, "minProperties": 1, "additionalProperties": False},
         "as-many-properties-as-it-allows-kept"),
    case({"type": "object", "properties": {"a": {}}, "minProperties": 2, "additionalProperties": False,
          "patternProperties": {"^x": {}}},
         {"type": "object", "properties": {"a": {}}, "minProperties": 2, "additionalProperties": False,
          "patternProperties": {"^x": {}}}, "a-pattern-allows-more-kept"),
    case({"type": "object", "properties": {"a": {}}, "minProperties": 2, "additionalProperties": {"type": "string"}},
         {"type": "object", "properties": {"a": {}}, "minProperties": 2, "additionalProperties": {"type": "string"}},
         "open-object-kept"),
    case({"type": "object", "properties": [], "required": ["b"], "additionalProperties": False},
         {"type": "object", "properties": [], "required": ["b"], "additionalProperties": False},
         "properties-not-a-map-left"),
    case({"type": ["object", "string"], "minProperties": 3, "maxProperties": 1, "required": ["a"]}, {"type": "string"},
         "object-keywords-go-with-the-type"),
]

CONST_ENUM = [
    case({"type": "string", "const": "a", "minLength": 5}, False, "const-shorter-than-min-length"),
    case({"type": "string", "const": "abcde", "minLength": 5}, {"type": "string", "const": "abcde", "minLength": 5},
         "const-at-min-length-kept"),
    case({"const": "abc", "maxLength": 2}, False, "untyped-const-longer-than-max-length"),
    case({"const": 3, "maxLength": 2}, {"const": 3, "maxLength": 2}, "a-length-says-nothing-of-a-number"),
    case({"type": "integer", "enum": [1, 10], "maximum": 5}, {"type": "integer", "enum": [1], "maximum": 5},
         "enum-values-past-the-maximum-dropped"),
    case({"type": "integer", "enum": [10, 20], "maximum": 5}, False, "every-enum-value-past-the-maximum"),
    case({"enum": [10, "abc"], "maximum": 5, "maxLength": 2}, False, "every-enum-value-outside-its-bounds"),
    case({"type": "string", "enum": [1, "abc"], "maxLength": 2}, False, "one-of-another-type-one-too-long"),
    case({"enum": [[1, 2], [1]], "maxItems": 1}, {"enum": [[1]], "maxItems": 1}, "enum-arrays-with-too-many-items"),
    case({"enum": [[]], "minItems": 1}, False, "enum-array-with-too-few-items"),
    case({"enum": [{"a": 1}, {"b": 1}], "required": ["a"]},
         {"enum": [{"a": 1}], "required": ["a"], "properties": {"a": {}}}, "enum-objects-without-a-required-name"),
    case({"enum": [{"a": 1, "b": 2}], "maxProperties": 1}, False, "enum-object-with-too-many-properties"),
    case({"enum": [{}], "minProperties": 1}, False, "enum-object-with-too-few-properties"),
    case({"enum": [5, 6], "multipleOf": 3}, {"enum": [6], "multipleOf": 3}, "enum-values-not-multiples-dropped"),
    case({"enum": [5.5, 6.0], "multipleOf": 3}, {"enum": [6.0], "multipleOf": 3}, "a-float-multiple"),
    case({"enum": [5.5], "multipleOf": 0.5}, {"enum": [5.5], "multipleOf": 0.5}, "fractional-multiple-of-not-read"),
    case({"enum": [5], "multipleOf": 0}, {"enum": [5], "multipleOf": 0}, "multiple-of-0-not-read"),
    case({"enum": [1.5, 2], "multipleOf": 1}, {"enum": [2], "multipleOf": 1}, "a-fraction-is-no-multiple-of-1"),
    case({"enum": [1, 2, 3], "exclusiveMinimum": 1, "exclusiveMaximum": 3},
         {"enum": [2], "exclusiveMinimum": 1, "exclusiveMaximum": 3}, "enum-values-at-exclusive-bounds-dropped"),
    case({"enum": [1, 2, 3], "minimum": 2}, {"enum": [2, 3], "minimum": 2}, "enum-values-below-the-minimum-dropped"),
    case({"enum": [True, None, "a"], "maximum": 0, "maxItems": 0}, {"enum": [True, None, "a"], "maximum": 0, "maxItems": 0},
         "bounds-say-nothing-of-other-types"),
    case({"const": [], "contains": False}, False, "a-const-of-a-type-its-bounds-leave-none-of"),
    case({"enum": ["a", 1], "minLength": 5, "maxLength": 2}, {"enum": [1], "type": every_type_but("string")},
         "enum-values-of-a-dropped-type-dropped"),
    case({"type": "string", "enum": ["a"], "minLength": True}, {"type": "string", "enum": ["a"], "minLength": True},
         "boolean-bound-not-read"),
    # Draft 4 has no const: dropped (both backends would enforce it), before a merge reads it.
    case({"$schema": D4, "type": "string", "const": "a", "minLength": 5},
         {"$schema": D4, "type": "string", "minLength": 5}, "draft-4-has-no-const"),
    case({"$schema": D4, "type": "integer", "const": "a"}, {"$schema": D4, "type": "integer"},
         "draft-4-const-not-of-the-type-dropped"),
    case({"$schema": D4, "allOf": [{"const": 1, "enum": [2]}]}, {"$schema": D4, "enum": [2]},
         "draft-4-const-beside-an-enum-in-a-part"),
    case({"$schema": D4, "allOf": [{"const": 1}, {"const": 2}]}, {"$schema": D4}, "draft-4-two-parts-consts"),
    case({"$schema": D4, "properties": {"const": {"const": 1}}}, {"$schema": D4, "properties": {"const": {}}},
         "draft-4-a-property-named-const-stays"),
    case({"$schema": D7, "allOf": [{"const": 1, "enum": [2]}]}, False, "draft-7-const-beside-an-enum-in-a-part"),
    case({"$schema": D7, "allOf": [{"const": 1}, {"const": 1}]}, {"$schema": D7, "const": 1}, "draft-7-equal-consts"),
    case({"$schema": D4, "type": "integer", "enum": [1, 10], "maximum": 5, "exclusiveMaximum": 1},
         {"$schema": D4, "type": "integer", "enum": [1], "maximum": 5, "exclusiveMaximum": 1},
         "draft-4-exclusive-maximum-not-read-for-enum-values"),
]

# What no value satisfies goes up as before: a required property, an item within minItems, a branch dropped.
BOUNDS_NESTED = [
    case({"type": "object", "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["s"]},
         False, "a-required-property"),
    case({"type": "object", "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 2}, "t": {}}},
         {"type": "object", "properties": {"s": False, "t": {}}}, "an-optional-property"),
    case({"anyOf": [{"type": "string", "minLength": 5, "maxLength": 2}, {"type": "null"}]}, {"anyOf": [{"type": "null"}]},
         "an-any-of-branch-dropped"),
    case({"allOf": [{"type": "string", "minLength": 5}, {"maxLength": 2}]}, False, "merged-bounds"),
    case({"type": "array", "items": {"type": "integer", "minimum": 5, "maximum": 2}, "minItems": 1}, False,
         "items-within-min-items"),
    case({"type": "string", "anyOf": [{"minLength": 5}, {"maxLength": 3}], "maxLength": 2},
         {"anyOf": [{"type": "string", "maxLength": 2}]}, "distributed-siblings-contradict-a-branch"),
]

MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
       "unevaluatedProperties", "unevaluatedItems")
LISTS = ("anyOf", "oneOf", "prefixItems", "items")
# Every place a subschema can be is normalised; annotations stay on a node whose anyOf gets its siblings.
SUBSCHEMAS = [
    *(case({k: {"x": STRING_MIN_1, "y": True}}, {k: {"x": MERGED, "y": True}}, f"map-{k}") for k in MAPS),
    *(case({k: STRING_MIN_1}, {k: MERGED}, f"one-{k}") for k in ONE),
    # (a `false` anyOf/oneOf branch is dropped: UNSATISFIABLE)
    *(case({k: [STRING_MIN_1, False]}, {k: [MERGED] if k in ("anyOf", "oneOf") else [MERGED, False]}, f"list-{k}")
      for k in LISTS),
    *(case({k: "a", "anyOf": [{"type": "string"}, {"type": "null"}]},
           {k: "a", "anyOf": [{"type": "string"}, {"type": "null"}]}, f"annotation-beside-any-of-{k}")
      for k in ANNOTATIONS),
]
REWRITES = {"all-of": ALL_OF + TYPES + BOUNDS + KEYWORDS + FIRST_STAYS, "additional-properties": ADDITIONAL_PROPERTIES,
            "ref": REFS, "ref-false": REFS_FALSE, "distribute": DISTRIBUTE, "not-type": NOT_TYPE, "required": REQUIRED,
            "pattern-lengths": PATTERN_LENGTHS, "enum-types": ENUM_TYPES, "subschemas": SUBSCHEMAS,
            "if-then-cases": IF_THEN_CASES, "false-properties": FALSE_PROPERTIES, "one-of-told-apart": ONE_OF_TOLD_APART,
            "unsatisfiable": UNSATISFIABLE, "strings": STRINGS, "numbers": NUMBERS, "arrays": ARRAYS,
            "objects": OBJECTS, "const-enum": CONST_ENUM, "bounds-nested": BOUNDS_NESTED}


@pytest.mark.parametrize("schema, expected", [pytest.param(*p.values, id=f"{rewrite}-{p.id}")
                                              for rewrite, cases in REWRITES.items() for p in cases])
def test_each_rewrite(schema, expected):
    given = copy.deepcopy(schema)
    if expected is False:  # the schema matches nothing: refused (UNSATISFIABLE_REFUSED says how)
        with pytest.raises(InvalidGrammarError, match="^json_schema matches nothing: at the root, "):
            normalise_schema(schema)
    else:
        assert normalise_schema(schema) == expected
    # The caller's schema is not written into (a merge that gave up once left a part with a property false).
    assert schema == given


def why(schema, reason, id):
    return pytest.param(schema, reason, id=id)


# What a refusal for bounds says (after "json_schema matches nothing: at the root, ").
BOUNDS_REFUSED = [
    why({"type": "string", "minLength": 5, "maxLength": 2}, "its minLength 5 is greater than its maxLength 2",
        "min-past-max"),
    why({"type": "string", "maxLength": -1}, "its maxLength -1 is negative", "negative-max"),
    why({"type": "string", "pattern": "^[a-z]{5}$", "maxLength": 2},
        "its pattern '^[a-z]{5}$' matches no string of fewer than 5 characters, and its maxLength is 2", "pattern"),
    why({"type": "string", "minLength": 2.5, "maxLength": 2.7},
        "no whole number is within its minLength 2.5 and its maxLength 2.7", "no-whole-count"),
    why({"type": "object", "required": ["a", "b", "c"], "maxProperties": 2},
        "its maxProperties 2 is less than the number of properties it requires (3)", "required-past-max"),
    why({"type": "number", "minimum": 5, "maximum": 2}, "its minimum 5 is greater than its maximum 2", "minimum-past"),
    why({"type": "number", "exclusiveMinimum": 3, "exclusiveMaximum": 3},
        "its exclusiveMinimum 3 equals its exclusiveMaximum 3", "exclusive-equal"),
    why({"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 3},
        "no integer is within its exclusiveMinimum 2 and its exclusiveMaximum 3", "no-integer"),
    why({"type": "integer", "multipleOf": 5, "minimum": 1, "maximum": 4},
        "no multiple of its multipleOf 5 is within its minimum 1 and its maximum 4", "no-multiple"),
    why({"type": "array", "contains": False}, "its contains accepts no item", "contains-false"),
    why({"type": "array", "contains": {}, "maxItems": 0}, "its maxItems 0 is less than the item its contains needs",
        "contains-past-max-items"),
    why({"type": "array", "contains": {}, "minContains": 2, "maxItems": 1},
        "its maxItems 1 is less than its minContains 2", "min-contains-past-max-items"),
    why({"type": "array", "contains": {}, "minContains": 2, "maxContains": 1},
        "its maxContains 1 is less than its minContains 2", "min-contains-past-max-contains"),
    why({"type": "object", "required": ["b"], "additionalProperties": False},
        "its required property 'b' is one its additionalProperties false forbids", "required-forbidden"),
    why({"type": "object", "properties": {"a": {}}, "minProperties": 2, "additionalProperties": False},
        "its minProperties 2 is more than the number of properties it allows (1)", "more-than-allowed"),
    # On a closed object too, the count's reason, and a false property's, come first.
    why({"type": "object", "required": ["a", "b"], "maxProperties": 1, "additionalProperties": False},
        "its maxProperties 1 is less than the number of properties it requires (2)", "closed-required-past-max"),
    why({"type": ["object", "null"], "properties": {"a": False}, "required": ["a"], "additionalProperties": False,
         "enum": [{"a": 1}]},
        "none of its enum values is of its type and within its bounds ({'a': 1} is of type object, and its required "
        "property 'a' accepts no value)", "closed-required-false"),
    why({"enum": [{"a": 1, "b": 2}], "maxProperties": 1},
        "none of its enum values is of its type and within its bounds ({'a': 1, 'b': 2} has more properties than its "
        "maxProperties 1)", "enum-object-too-many-properties"),
    # Each type's reason, in the order of its type.
    why({"type": ["object", "string"], "properties": {"a": False}, "required": ["a"], "minLength": 5, "maxLength": 2},
        "its required property 'a' accepts no value and its minLength 5 is greater than its maxLength 2",
        "two-types"),
    why({"type": ["array", "null"], "items": False, "minItems": 1, "enum": [[1]]},
        "none of its enum values is of its type and within its bounds ([1] is of type array, and its items accept no "
        "value and its minItems is 1)", "of-a-type-left-out"),
    why({"type": "string", "const": "a", "minLength": 5}, "its const 'a' has fewer characters than its minLength 5",
        "const-too-short"),
    why({"const": [1, 2], "maxItems": 1}, "its const [1, 2] has more items than its maxItems 1", "const-too-long"),
    why({"const": [], "contains": False}, "its const [] is of type array, and its contains accepts no item",
        "const-of-a-type-left-out"),
    why({"const": {"b": 1}, "required": ["a"]}, "its const {'b': 1} lacks its required property 'a'",
        "const-without-a-required-name"),
    why({"enum": [1, "abc", 9, 4], "maxLength": 2, "exclusiveMinimum": 2, "exclusiveMaximum": 9, "multipleOf": 3},
        "none of its enum values is of its type and within its bounds (1 is not above its exclusiveMinimum 2; 'abc' "
        "has more characters than its maxLength 2; 9 is not below its exclusiveMaximum 9)", "enum-first-three"),
    why({"enum": [2, 5, 4.5], "minimum": 3, "maximum": 5, "multipleOf": 2},
        "none of its enum values is of its type and within its bounds (2 is below its minimum 3; 5 is not a multiple "
        "of its multipleOf 2; 4.5 is not a multiple of its multipleOf 2)", "enum-minimum-multiple-of"),
    why({"enum": [6], "maximum": 5}, "none of its enum values is of its type and within its bounds (6 is above its "
        "maximum 5)", "enum-maximum"),
    why({"type": "string", "enum": [1, "abc"], "maxLength": 2},
        "none of its enum values is of its type and within its bounds (1 is not of its type 'string'; 'abc' has more "
        "characters than its maxLength 2)", "enum-of-another-type"),
]


@pytest.mark.parametrize("schema, reason", BOUNDS_REFUSED)
def test_a_refusal_names_the_bounds(schema, reason):
    with pytest.raises(InvalidGrammarError) as refused:
        normalise_schema(schema)
    assert str(refused.value) == f"json_schema matches nothing: at the root, {reason}; correct the part named last"


@pytest.mark.parametrize("schema", [
    pytest.param({"const": STRING_MIN_1}, id="const"),
    pytest.param({"enum": [STRING_MIN_1]}, id="enum"),
    pytest.param({"default": STRING_MIN_1}, id="default"),
    pytest.param({"properties": [STRING_MIN_1]}, id="properties-not-a-map"),
    pytest.param({"anyOf": {"x": STRING_MIN_1}}, id="any-of-not-a-list"),
    pytest.param({"examples": [STRING_MIN_1]}, id="examples"),
])
def test_values_that_are_not_schemas_are_left(schema):
    assert normalise_schema(schema) == schema


@pytest.mark.parametrize("schema", [pytest.param(True, id="true"), pytest.param(False, id="false"),
                                    pytest.param([1], id="not-a-schema")])
def test_a_schema_that_is_not_an_object_is_itself(schema):
    assert normalise_schema(schema) is schema


@pytest.mark.parametrize("schema, ignored", [
    pytest.param({"$schema": "http://json-schema.org/draft-07/schema#"}, True, id="draft-07"),
    pytest.param({"$schema": "http://json-schema.org/draft-04/schema#"}, True, id="draft-04"),
    pytest.param({"$schema": "https://json-schema.org/draft/2020-12/schema"}, False, id="2020-12"),
    pytest.param({}, False, id="no-draft-named"),
    pytest.param({"$schema": 7}, False, id="draft-not-a-string"),
    # The draft is what the output check (jsonschema's validator_for) reads: the exact URL, not a substring of it.
    pytest.param({"$schema": "http://json-schema.org/draft-07/schema"}, True, id="draft-07-without-fragment"),
    pytest.param({"$schema": "https://json-schema.org/draft-07/schema#"}, False, id="https-draft-07-is-2020-12"),
    pytest.param({"$schema": "http://example.com/draft-04-ext"}, False, id="url-containing-draft-04-is-2020-12"),
    # llguidance_schema asks it of a normalised schema, which may be true or false (`{"allOf": [false]}`).
    pytest.param(True, False, id="true"),
    pytest.param(False, False, id="false"),
])
def test_which_schemas_ignore_the_keywords_beside_a_ref(schema, ignored):
    assert ref_siblings_ignored(schema) is ignored


@pytest.mark.parametrize("draft, kept", [
    pytest.param(D4, False, id="draft-04-has-no-const"),
    pytest.param("http://json-schema.org/draft-04/schema", False, id="draft-04-without-fragment"),
    # Read as 2020-12 by the output check, which then enforces the const: so does the grammar.
    pytest.param("https://json-schema.org/draft-04/schema#", True, id="https-draft-04-is-2020-12"),
    pytest.param("http://example.com/draft-04-ext", True, id="url-containing-draft-04-is-2020-12"),
])
def test_a_const_is_dropped_only_in_a_schema_the_output_check_reads_as_draft_4(draft, kept):
    out = normalise_schema({"$schema": draft, "type": "object", "properties": {"k": {"const": "a"}},
                            "required": ["k"]})
    assert ("const" in out["properties"]["k"]) is kept, out


def test_the_input_is_not_changed():
    schema = {"allOf": [{"properties": {"x": {}}, "additionalProperties": False}, {"properties": {"y": {}}}],
              "required": ["x"], "anyOf": [{"minProperties": 1}, {"maxProperties": 3}]}
    before = repr(schema)
    normalise_schema(schema)
    assert repr(schema) == before


# ----------------------------------------------------------------------------- the work budget and the depth limit

def message(what: str, at: str | None) -> str:
    return (f"json_schema is too complex to compile: {what}{'' if at is None else f' (at {at})'}; nested anyOf/oneOf "
            "beside other keywords and allOf of $refs multiply; simplify the schema")


def nested(keyword: str, levels: int) -> dict:
    schema: dict = {}
    for _ in range(levels):
        schema = {keyword: schema}
    return schema


def nested_lists(levels: int) -> object:
    value: object = 0
    for _ in range(levels):
        value = [value]
    return value


def ref_to_enum(levels: int) -> dict:
    return {"definitions": {"a": {"enum": [nested_lists(levels)]}}, "allOf": [{"$ref": "#/definitions/a"}]}


TWO_PROPERTIES = {"properties": {"a": {}, "b": {}}}
ANY_OF_TWO = {"type": "string", "anyOf": [{"minLength": 1}, {"maxLength": 3}]}
ALL_OF_IN_P = {"properties": {"p": {"allOf": [{"type": "string"}, {"minLength": 1}]}}}
REF_ONLY = {"definitions": {"s": {"type": "string"}}, "allOf": [{"$ref": "#/definitions/s"}]}
ALL_OF_THEN_ANY_OF = {"properties": {"p": {"allOf": [{"type": "string"}], "anyOf": [{"minLength": 1}, {"maxLength": 3}]},
                                     "q": {}}}
# Each node produced counts once: the root and each subschema as it is walked, a merge, each dict or list copied
# (a $ref target, an anyOf's siblings for each branch).
REFUSED = [
    pytest.param({"type": "string"}, 0, message("normalising it produced more than 0 schema nodes", "the root"),
                 id="at-the-root"),
    pytest.param(TWO_PROPERTIES, 2, message("normalising it produced more than 2 schema nodes", "/properties/b"),
                 id="second-property"),
    pytest.param(TWO_PROPERTIES, 3, message("normalising it would write more than 3 schema nodes", None),
                 id="the-result-tree"),
    pytest.param({"properties": {"a/b~c": {}}}, 1,
                 message("normalising it produced more than 1 schema nodes", "/properties/a~1b~0c"),
                 id="escaped-name"),
    pytest.param({"items": [{}, {}]}, 2, message("normalising it produced more than 2 schema nodes", "/items/1"),
                 id="tuple-item"),
    pytest.param({"anyOf": [{}, {}]}, 2, message("normalising it produced more than 2 schema nodes", "/anyOf/1"),
                 id="list-item"),
    pytest.param({"not": {}}, 1, message("normalising it produced more than 1 schema nodes", "/not"),
                 id="one-subschema"),
    pytest.param(ALL_OF_IN_P, 4, message("normalising it produced more than 4 schema nodes", "/properties/p/allOf/1"),
                 id="merging-an-all-of"),
    pytest.param(ANY_OF_TWO, 4, message("normalising it produced more than 4 schema nodes", "/anyOf/0"),
                 id="first-branch"),
    pytest.param(ANY_OF_TWO, 6, message("normalising it produced more than 6 schema nodes", "/anyOf/1"),
                 id="second-branch"),
    pytest.param(REF_ONLY, 3, message("normalising it produced more than 3 schema nodes", "/allOf/0/#/definitions/s"),
                 id="ref-target"),
    pytest.param(REF_ONLY, 4, message("normalising it produced more than 4 schema nodes", "/allOf/0"),
                 id="ref-target-copied"),
    pytest.param(ALL_OF_THEN_ANY_OF, 9,
                 message("normalising it produced more than 9 schema nodes", "/properties/p/anyOf/1"),
                 id="branch-after-an-all-of"),
    pytest.param({"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"a": {"maxLength": 1}}}]}, 6,
                 message("normalising it produced more than 6 schema nodes", "/allOf/1/properties/a"),
                 id="merging-a-property"),
    pytest.param({"properties": {"p": {"allOf": [{"properties": {"a": {"type": "string"}, "b": {"type": "string"}}},
                                                 {"properties": {"a": {"maxLength": 1}, "b": {"maxLength": 1}}}]}}}, 10,
                 message("normalising it produced more than 10 schema nodes", "/properties/p/allOf/1/properties/b"),
                 id="merging-the-next-property"),
    pytest.param({"allOf": [{"items": {"type": "string"}}, {"items": {"maxLength": 1}}]}, 6,
                 message("normalising it produced more than 6 schema nodes", "/allOf/1/items"), id="merging-items"),
    pytest.param({"enum": [[1], [2]]}, 3, message("normalising it would write more than 3 schema nodes", None),
                 id="values-in-the-result"),
    pytest.param(nested("items", MAX_DEPTH + 1), 10_000,
                 message(f"normalising it nests deeper than {MAX_DEPTH} levels", "/" + "/".join(["items"] * MAX_DEPTH)),
                 id="nested-past-the-limit"),
    pytest.param(nested("items", MAX_DEPTH), 10_000,
                 message(f"normalising it would nest deeper than {MAX_DEPTH} levels", None),
                 id="result-nested-past-the-limit"),
    pytest.param({"enum": [nested_lists(MAX_DEPTH - 1)]}, 10_000,
                 message(f"normalising it would nest deeper than {MAX_DEPTH} levels", None), id="deep-value"),
    pytest.param(ref_to_enum(MAX_DEPTH), 10_000,
                 message(f"normalising it nests deeper than {MAX_DEPTH} levels", "/allOf/0"), id="deep-copy"),
    pytest.param(ref_to_enum(MAX_DEPTH - 1), 10_000,
                 message(f"normalising it would nest deeper than {MAX_DEPTH} levels", None), id="copy-within-the-limit"),
]


@pytest.mark.parametrize("schema, budget, refusal", REFUSED)
def test_past_the_budget_or_the_depth_the_schema_is_refused_naming_where(schema, budget, refusal):
    with pytest.raises(RequestTooLargeError) as refused:
        normalise_schema(schema, budget)
    assert str(refused.value) == refusal


@pytest.mark.parametrize("schema, budget", [
    pytest.param({"type": "string"}, 1, id="one-node"),
    pytest.param(TWO_PROPERTIES, 4, id="two-properties"),
    pytest.param({"enum": [[1], [2]]}, 4, id="values"),
    pytest.param(ANY_OF_TWO, 7, id="two-branches"),
    pytest.param(REF_ONLY, 6, id="ref"),
    pytest.param({"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": {"s": {"type": "string"}},
                  "allOf": [{"$ref": "#/$defs/s"}]}, 6, id="ref-without-siblings-copied-once"),
    # An anyOf/oneOf beside an `if` leaves the node before its other parts are merged: the allOf merge after merges
    # them once (merged first for the `if` as well, the same schema takes more nodes).
    *(pytest.param({**K_ABC, key: branches, "allOf": [IF_K, {"maxProperties": 5}]}, budget, id=f"{key}-beside-an-if")
      for key, branches, budget in (("anyOf", [{"minProperties": 1}], 38),
                                    ("oneOf", [{"minProperties": 1}, {"maxProperties": 0}], 67))),
    # A target looked at for a `$ref` (is it `false`?), with no cycle cut there, is not normalised again where the
    # walk writes it nor where an allOf inlines it (254 nodes: each was normalised twice).
    pytest.param({"type": "object", "properties": {"p": {"$ref": "#/$defs/d"}},
                  "$defs": {k: {"type": "object", "properties": {k * 2: {"type": "integer"}},
                                "anyOf": [{"properties": {f"f{i}": {"type": "string"}}, "required": [f"f{i}"]}
                                          for i in range(4)]} for k in "ab"} |
                  {"d": {"allOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]}}}, 150, id="a-target-looked-at-once"),
    pytest.param(nested("items", MAX_DEPTH - 1), 10_000, id="nested-to-the-limit"),
    pytest.param({"enum": [nested_lists(MAX_DEPTH - 2)]}, 10_000, id="value-nested-to-the-limit"),
])
def test_within_the_budget_and_the_depth_the_schema_is_normalised(schema, budget):
    normalise_schema(schema, budget)


def test_a_shared_subtree_is_counted_where_it_is_written():
    # Both listed names share one object (the additionalProperties schema): written out, it is there three times.
    schema = {"required": ["a", "b"], "additionalProperties": {"type": "integer"}}
    assert normalise_schema(schema, 6) == {**schema, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    with pytest.raises(RequestTooLargeError, match="would write more than 5 schema nodes"):
        normalise_schema(schema, 5)


def test_the_default_budget_counts_the_input():
    # 100 branches each get a copy of 1,002 siblings' nodes: past the base budget, within 4 per input node more.
    schema = {"properties": {f"p{i}": {} for i in range(1000)}, "anyOf": [{}] * 100}
    assert len(normalise_schema(schema)["anyOf"]) == 100
    with pytest.raises(RequestTooLargeError, match="produced more than 100000 schema nodes"):
        normalise_schema(schema, 100_000)


def test_the_default_budget_grows_with_the_schema():
    assert node_budget({"a": [1, {"b": 2}], "c": "d"}) == 100_000 + 4 * 3
    assert node_budget(7) == 100_000


# ----------------------------------------------------------------------------- a schema that matches nothing

def refusal(*notes: str) -> str:
    return f"json_schema matches nothing: {'; '.join(notes)}; correct the part named last"


def backward_chain(levels: int) -> dict:
    """A required property whose `$ref` reaches, through `levels` definitions each a `$ref` to the next, one whose
    bounds leave no value; written last first, so each target is walked where it is written before its `$ref`."""
    defs: dict = {f"d{levels}": {"type": "string", "minLength": 3, "maxLength": 1}}
    for i in range(levels - 1, -1, -1):
        defs[f"d{i}"] = {"$ref": f"#/$defs/d{i + 1}"}
    return {"$defs": defs, "type": "object", "required": ["p"], "properties": {"p": {"$ref": "#/$defs/d0"}}}


UNSATISFIABLE_REFUSED = [
    pytest.param({"type": "string", "enum": [1, 2]}, refusal("at the root, none of its enum values is of its type 'string'"),
                 id="enum"),
    pytest.param({"enum": []}, refusal("at the root, its enum lists no value"), id="empty-enum"),
    pytest.param({"type": ["integer"], "const": "a"}, refusal("at the root, its const 'a' is not of its type ['integer']"),
                 id="const"),
    pytest.param({"type": "object", "properties": {"o": {"type": "object", "properties": {"a~/b": NO_STRING},
                                                         "required": ["a~/b"]}}, "required": ["o"]},
                 refusal("at the root, its required property 'o' accepts no value",
                         "at /properties/o, its required property 'a~/b' accepts no value",
                         "at /properties/o/properties/a~0~1b, none of its enum values is of its type 'string'"),
                 id="required-properties-named-by-path"),
    pytest.param({"type": "array", "items": {"type": "null", "const": 0}, "minItems": 2},
                 refusal("at the root, its items accept no value and its minItems is 2",
                         "at /items, its const 0 is not of its type 'null'"), id="items"),
    pytest.param({"type": "array", "prefixItems": [{}, {}, False], "minItems": 3},
                 refusal("at the root, its prefixItems item 2 accepts no value and its minItems is 3"),
                 id="prefix-items"),
    pytest.param({"type": "array", "prefixItems": [{"type": "null", "const": 0}], "minItems": 1},
                 refusal("at the root, its prefixItems item 0 accepts no value and its minItems is 1",
                         "at /prefixItems/0, its const 0 is not of its type 'null'"), id="prefix-items-named"),
    pytest.param({"anyOf": [False, False]}, refusal("at the root, every branch of its anyOf accepts no value"),
                 id="any-of-of-false"),
    pytest.param({"anyOf": [{"type": "string", "const": 1}, {"not": {"type": "null"}, "type": "null"}]},
                 refusal("at the root, every branch of its anyOf accepts no value",
                         "at /anyOf/0, its const 1 is not of its type 'string'"), id="any-of"),
    pytest.param({"type": "null", "not": {"type": "null"}},
                 refusal("at the root, its not excludes every type its type admits"), id="not-type"),
    pytest.param({"allOf": [{"const": "a"}, {"const": "b"}]},
                 refusal("at the root, its allOf parts have no value in common",
                         "at /allOf/1, its parts' consts 'a' and 'b' differ"), id="all-of-consts"),
    pytest.param({"allOf": [{"enum": [1]}, {"const": 2}]},
                 refusal("at the root, its allOf parts have no value in common", "at /allOf/1, its const 2 is not in its enum"),
                 id="all-of-const-and-enum"),
    pytest.param({"allOf": [{"type": "string"}, {"type": ["null", "integer"]}]},
                 refusal("at the root, its allOf parts have no value in common",
                         "at /allOf/1, its parts' types 'string' and ['null', 'integer'] have no value in common"),
                 id="all-of-types"),
    pytest.param({"allOf": [{"enum": ["a"]}, {"enum": ["b"]}]},
                 refusal("at the root, its allOf parts have no value in common",
                         "at /allOf/1, its parts' enums have no value in common"), id="all-of-enums"),
    pytest.param({"type": "object", "allOf": [{"additionalProperties": False}, {"required": ["x"]}]},
                 refusal("at the root, its allOf parts have no value in common",
                         "at /allOf/1, a property one part requires the other forbids"), id="all-of-required-forbidden"),
    pytest.param({"type": "object", "allOf": [{"properties": {"x": {}}, "additionalProperties": False},
                                              {"properties": {"y": {}}, "required": ["y"]}]},
                 refusal("at the root, its allOf parts have no value in common",
                         "at /allOf/1, a property one part requires the other forbids"), id="all-of-listed-forbidden"),
    pytest.param({"$defs": {"f": False}, "allOf": [{"$ref": "#/$defs/f"}]},
                 refusal("at the root, its allOf parts have no value in common",
                         "at /allOf/0, its $ref '#/$defs/f' accepts no value"), id="all-of-a-false-part"),
    pytest.param({"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"],
                  "if": {"properties": {"k": {"const": "a"}}}, "then": {"properties": {"k": {"const": "b"}}}},
                 refusal("at the root, no case of its if/then accepts a value",
                         "at the root, its required property 'k' accepts no value",
                         "at /properties/k, its const 'b' is not in its enum"), id="if-then"),
    pytest.param({"type": "object", "properties": {"k": {"const": "a"}, "x": {"enum": []}}, "required": ["k"],
                  "if": {"properties": {"k": {"const": "a"}}}, "then": False},
                 refusal("at the root, no case of its if/then accepts a value"), id="if-then-an-earlier-note-not-named"),
    pytest.param({"anyOf": [{"enum": []}, False]}, refusal("at the root, every branch of its anyOf accepts no value",
                                                           "at /anyOf/0, its enum lists no value"), id="any-of-first"),
    pytest.param({"properties": {"a": {"enum": []}}, "$defs": {"f": False}, "allOf": [{"$ref": "#/$defs/f"}]},
                 refusal("at the root, its allOf parts have no value in common",
                         "at /allOf/0, its $ref '#/$defs/f' accepts no value"), id="an-earlier-note-not-named"),
    # Through a `$ref`: the place of the `$ref`, then its target's, where the walk reached it first (its own place)
    # or through the `$ref` (the `$ref`'s place, then the pointer).
    pytest.param({"$defs": {"bad": BAD}, "type": "object", "properties": {"a": REF_BAD}, "required": ["a"]},
                 refusal("at the root, its required property 'a' accepts no value",
                         "at /properties/a, its $ref '#/$defs/bad' accepts no value",
                         "at /$defs/bad, its minimum 5 is greater than its maximum 2"), id="required-through-a-ref"),
    pytest.param({"type": "object", "properties": {"a": REF_BAD}, "required": ["a"], "$defs": {"bad": BAD}},
                 refusal("at the root, its required property 'a' accepts no value",
                         "at /properties/a, its $ref '#/$defs/bad' accepts no value",
                         "at /properties/a/#/$defs/bad, its minimum 5 is greater than its maximum 2"),
                 id="required-through-a-ref-defs-last"),
    pytest.param({"$ref": "#/$defs/bad", "$defs": {"bad": BAD}},
                 refusal("at the root, its $ref '#/$defs/bad' accepts no value",
                         "at /$defs/bad, its minimum 5 is greater than its maximum 2"), id="root-a-ref"),
    pytest.param({"$schema": D7, "$ref": "#/definitions/bad", "type": "string", "definitions": {"bad": BAD}},
                 refusal("at the root, its $ref '#/definitions/bad' accepts no value",
                         "at /definitions/bad, its minimum 5 is greater than its maximum 2"),
                 id="root-a-ref-whose-siblings-are-ignored"),
    pytest.param({"type": "array", "items": REF_BAD, "minItems": 1, "$defs": {"bad": BAD}},
                 refusal("at the root, its items accept no value and its minItems is 1",
                         "at /items, its $ref '#/$defs/bad' accepts no value",
                         "at /items/#/$defs/bad, its minimum 5 is greater than its maximum 2"),
                 id="items-through-a-ref"),
    pytest.param({"type": "object", "properties": {"a": {"$ref": "#/$defs/f"}}, "required": ["a"], "$defs": {"f": False}},
                 refusal("at the root, its required property 'a' accepts no value",
                         "at /properties/a, its $ref '#/$defs/f' accepts no value"), id="required-ref-to-false"),
    pytest.param({"allOf": [{"type": "string"}, {"allOf": [{"const": 1}, {"const": 2}]}]},
                 refusal("at the root, its allOf parts have no value in common",
                         "at /allOf/1, its allOf parts have no value in common",
                         "at /allOf/1/allOf/1, its parts' consts 1 and 2 differ"), id="a-part-s-own-note"),
    # A chain past NOTES_NAMED_FIRST + NOTES_NAMED_LAST notes: the first ones, how many were left out, the last ones.
    pytest.param(backward_chain(10),
                 refusal("at the root, its required property 'p' accepts no value",
                         "at /properties/p, its $ref '#/$defs/d0' accepts no value",
                         "at /$defs/d0, its $ref '#/$defs/d1' accepts no value",
                         "at /$defs/d1, its $ref '#/$defs/d2' accepts no value", "... 7 more ...",
                         "at /$defs/d9, its $ref '#/$defs/d10' accepts no value",
                         "at /$defs/d10, its minLength 3 is greater than its maxLength 1"), id="a-long-chain-shortened"),
]


def test_a_chain_as_long_as_the_schema_is_named_in_a_refusal_of_bounded_length():
    # Each note named all of its causes: 4,000 such definitions (142 KB) built 481 MB of notes, quadratic in the
    # schema. Each note is now a link to its cause, and the refusal names a bounded number of them.
    with pytest.raises(InvalidGrammarError) as e:
        normalise_schema(backward_chain(2000))
    assert len(str(e.value)) < 1000 and "... 1997 more ..." in str(e.value)


@pytest.mark.parametrize("schema, refused", UNSATISFIABLE_REFUSED)
def test_a_schema_that_matches_nothing_is_refused_naming_where_and_why(schema, refused):
    with pytest.raises(InvalidGrammarError) as e:
        normalise_schema(schema)
    assert str(e.value) == refused


def test_a_false_part_inside_is_not_a_refusal():
    # Only the root: a `false` in $defs, an optional property or a branch left is part of a schema some document
    # satisfies.
    assert normalise_schema({"$defs": {"f": {"allOf": [False]}}, "anyOf": [{"enum": []}, {"type": "null"}]}) == \
        {"$defs": {"f": False}, "anyOf": [{"type": "null"}]}


def ref_chain(levels: int) -> dict:
    """`levels` definitions each with an optional property `x` that is a `$ref` to the next; the last one's bounds
    leave no value."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(levels)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{levels}": BAD}}


def test_a_ref_looked_at_past_the_depth_limit_stays():
    # Looking at d0's target follows the chain past MAX_DEPTH: the `$ref` there stays as written (as before), and
    # the schema, which normalises within the limit where each definition is written, is not refused.
    levels = MAX_DEPTH
    out = normalise_schema(ref_chain(levels))
    assert out["$defs"][f"d{levels}"] is False
    assert out["$defs"][f"d{levels - 1}"]["properties"]["x"] is False  # its target was walked first
    assert out["$defs"]["d0"]["properties"]["x"] == {"$ref": "#/$defs/d1"}
