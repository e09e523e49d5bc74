"""Fuzzing the grammar service's JSON-Schema path: any schema text is admitted and normalised within the work
budget, or refused with the service's named client error.

hypothesis draws JSON Schemas: every keyword the normaliser rewrites
(properties, items, anyOf/oneOf/allOf, not, additionalProperties, required,
enum, $ref into $defs, existing or not, cycles included), with wrong types
where a schema or a number belongs, huge and non-finite numbers, and the
two shapes issue 24 found exponential (nested anyOf beside properties,
allOf chains of $refs) at random depths, plus nesting around the limit and
text that is not JSON at all. Each runs in-process through what a compile
runs before xgrammar: admission (GrammarSpec.validate), normalisation and the
schema warnings scan. The answer must be a normalised schema no larger than
the budget, or an InvalidRequestError (RequestTooLargeError for limits, which
the status table answers INVALID_ARGUMENT); anything else (RecursionError,
KeyError, TypeError...) would be an INTERNAL from a worker.

In `make test` it runs a fixed, derandomized set of examples in a few
seconds. The longer run draws new examples each time:

    STRUCTD_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/test_schema_fuzz.py -p no:cacheprovider

Every failure it has found is a named case in test_found_by_the_fuzzer; the limits issue 24
found by hand are named cases in test_found_by_the_limits.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grammar_svc.compile.spec import GrammarSpec
from grammar_svc.schema import schema_warnings
from grammar_svc.schema.json_grammar import normalised_schema_text
from shared.json_nesting import MAX_NESTING
from grammar_svc.schema.schema_normalise import MAX_DEPTH, _count_nodes, node_budget
from grammar_svc.types import Kind
from shared.errors import InvalidGrammarError, InvalidRequestError, RequestTooLargeError

MAX_SPEC_BYTES = 1 << 20
LONG_RUN_EXAMPLES = int(os.environ.get("STRUCTD_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=LONG_RUN_EXAMPLES or 120, derandomize=not LONG_RUN_EXAMPLES, database=None,
                deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

names = st.sampled_from(["a", "b", "p", "x", "", "~1", "a/b"])
DEFS = [f"d{i}" for i in range(4)]
numbers = st.sampled_from([0, 1, -1, 3, 2**63, 2**70, -(2**70), 1e308, 0.5, float("inf"), float("nan")]) | \
    st.integers(-10, 10)
types = st.sampled_from(["object", "array", "string", "number", "integer", "boolean", "null", "bogus"])
type_values = types | st.lists(types, max_size=3) | numbers | st.none()
scalars = st.none() | st.booleans() | numbers | st.text(max_size=4)
leaves = st.one_of(
    st.booleans(),
    st.builds(lambda t: {"type": t}, type_values),
    st.builds(lambda v: {"enum": v}, st.lists(scalars, max_size=4) | scalars),
    st.builds(lambda v: {"const": v}, scalars),
    st.builds(lambda k, n: {k: n}, st.sampled_from(["minLength", "maxLength", "minimum", "maximum", "minItems",
                                                   "maxItems", "minProperties", "exclusiveMinimum"]), numbers),
    st.builds(lambda p, lo, hi: {"type": "string", "pattern": p, "minLength": lo, "maxLength": hi},
              st.sampled_from(["^[a-z]+$", "^\\d*$", "(", "^.{2,}$"]), numbers, numbers),
    st.builds(lambda d: {"$ref": f"#/$defs/{d}"}, st.sampled_from(DEFS + ["missing"])),
    st.builds(lambda r: {"$ref": r}, st.sampled_from(["#", "#/", "http://x/y", "#/properties/a", 3])),
    st.builds(lambda r: {"required": r}, st.lists(names, max_size=3) | numbers),
)


def _extend(children):
    lists = st.lists(children, min_size=0, max_size=3)
    return st.one_of(
        st.builds(lambda ps, r: {"type": "object", "properties": ps, "required": r},
                  st.dictionaries(names, children, max_size=3), st.lists(names, max_size=2)),
        st.builds(lambda i: {"type": "array", "items": i}, children | lists),
        st.builds(lambda k, bs, sib: {k: bs, **sib}, st.sampled_from(["anyOf", "oneOf", "allOf"]), lists,
                  st.dictionaries(st.sampled_from(["type", "properties", "required", "minProperties",
                                                   "additionalProperties", "enum"]), children, max_size=2)),
        st.builds(lambda c: {"not": c}, children),
        st.builds(lambda c, ps: {"properties": ps, "additionalProperties": c}, children,
                  st.dictionaries(names, children, max_size=3)),
        st.builds(lambda d: {"dependencies": d}, st.dictionaries(names, st.lists(names, max_size=2), max_size=2)),
        st.builds(lambda k, v: {k: v}, st.sampled_from(["properties", "anyOf", "items", "allOf", "$defs"]),
                  scalars),  # wrong types where schemas belong
    )


schemas = st.recursive(leaves, _extend, max_leaves=16)


def nested_any_of(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"p": schema}, "anyOf": [{"required": ["p"]}, {"minProperties": 0}]}
    return schema


def ref_chain(levels: int) -> dict:
    defs = {"e0": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    for i in range(1, levels + 1):
        ref = {"$ref": f"#/$defs/e{i - 1}"}
        defs[f"e{i}"] = {"type": "object", "properties": {"a": {"allOf": [ref, {"type": "object"}]},
                                                          "b": {"allOf": [ref, {"minProperties": 1}]}}}
    return {"$defs": defs, "allOf": [{"$ref": f"#/$defs/e{levels}"}, {"type": "object"}]}


def nested_items(levels: int) -> dict:
    schema: dict = {}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


roots = st.one_of(
    st.builds(lambda root, defs, draft: {**root, "$defs": defs, **draft} if isinstance(root, dict) else root,
              schemas, st.dictionaries(st.sampled_from(DEFS), schemas, max_size=4),
              st.sampled_from([{}, {"$schema": "https://json-schema.org/draft/2020-12/schema"}])),
    st.builds(nested_any_of, st.integers(1, 20)),
    st.builds(ref_chain, st.integers(1, 20)),
    st.builds(nested_items, st.integers(MAX_NESTING // 2 - 4, MAX_NESTING // 2 + 4)),
)


def schema_texts():
    as_json = roots.map(lambda s: json.dumps(s, allow_nan=True))
    # Not JSON, or not all of it: truncated, deep brackets, an extra comma.
    broken = st.one_of(
        as_json.flatmap(lambda t: st.integers(0, max(0, len(t) - 1)).map(lambda n: t[:n])),
        st.integers(1, 3 * MAX_NESTING).map(lambda n: "[" * n + "]" * n),
        st.integers(1, 2000).map(lambda n: "[" * n),
        st.sampled_from(["", "{", "{}}", '{"a":1,}', "NaN", '"\\ud800"', "1e400", "[]", "null"]),
    )
    return as_json | broken


def check(text: str) -> None:
    """Admission, normalisation and the warnings scan, as a compile runs them: a result within the budget or
    a client error."""
    spec = GrammarSpec(Kind.JSON_SCHEMA, text)
    try:
        spec.validate(MAX_SPEC_BYTES)
        schema = json.loads(text)
        out = normalised_schema_text(text)
        schema_warnings.scan(schema)
    except InvalidRequestError as e:
        assert str(e)
        return
    normalised = json.loads(out)
    assert _count_nodes(normalised) <= node_budget(schema)
    assert _depth(normalised) <= MAX_DEPTH + 1


def _depth(value) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


@FUZZ
@given(schema_texts())
def test_any_schema_text_normalises_within_budget_or_is_a_client_error(text):
    check(text)


@pytest.mark.parametrize("text, refused", [
    # Its first random run (3,000 examples): a non-finite length bound, which Python's json reads, reached the
    # normaliser's int() (OverflowError: an INTERNAL from the worker). Not JSON: refused at admission.
    pytest.param('{"type": "string", "pattern": "^[a-z]+$", "minLength": 0, "maxLength": NaN}', InvalidGrammarError,
                 id="nan-length-beside-pattern"),
    pytest.param('{"type": "string", "pattern": "^[a-z]+$", "minLength": Infinity, "maxLength": 0}',
                 InvalidGrammarError, id="infinite-length-beside-pattern"),
    pytest.param('{"type": "string", "pattern": "^[a-z]+$", "maxLength": 1e400}', InvalidGrammarError,
                 id="length-past-a-double-beside-pattern"),
])
def test_found_by_the_fuzzer(text, refused):
    with pytest.raises(refused):
        GrammarSpec(Kind.JSON_SCHEMA, text).validate(MAX_SPEC_BYTES)
    check(text)


def test_found_by_the_fuzzer_an_all_of_of_false_is_false():
    # A random run of 20,000: the merged allOf came back as the boolean schema and the next rewrite called
    # .get on it (AttributeError: an INTERNAL from the worker).
    text = '{"type": "object", "properties": {}, "required": [], "$defs": {"d0": {"allOf": [false]}}}'
    check(text)
    assert json.loads(normalised_schema_text(text))["$defs"]["d0"] is False


@pytest.mark.parametrize("text, refused", [
    pytest.param(json.dumps(nested_any_of(16)), RequestTooLargeError, id="issue-24-nested-anyof-16"),
    pytest.param(json.dumps(ref_chain(16)), RequestTooLargeError, id="issue-24-allof-ref-chain-16"),
    pytest.param("[" * 1000 + "]" * 1000, RequestTooLargeError, id="issue-24-nested-1000-deep"),
    # A property shared by reference between many places: what json.dumps writes is larger than what was built.
    pytest.param(json.dumps({"$defs": {"e0": {"type": "integer"}, **{
        f"e{i}": {"allOf": [{"properties": {n: {} for n in "abcd"}},
                            {"additionalProperties": {"allOf": [{"$ref": f"#/$defs/e{i - 1}"}]}}]}
        for i in range(1, 13)}}, "allOf": [{"$ref": "#/$defs/e12"}]}), RequestTooLargeError,
        id="shared-subtrees-written-out"),
])
def test_found_by_the_limits(text, refused):
    with pytest.raises(refused):
        spec = GrammarSpec(Kind.JSON_SCHEMA, text)
        spec.validate(MAX_SPEC_BYTES)
        normalised_schema_text(text)
    check(text)


def test_large_finite_numbers_are_kept():
    out = json.loads(normalised_schema_text('{"type": "number", "maximum": 1e308, "allOf": [{"minimum": 1}]}'))
    assert out["maximum"] == 1e308 and out["minimum"] == 1
