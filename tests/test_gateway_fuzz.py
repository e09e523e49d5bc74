"""Fuzzing the gateway's request translation: any body bytes become a GenerateRequest or a client error.

hypothesis draws request bodies field by field (every field the gateway
reads, each with its right type or anything else), with unknown fields,
deep nesting, huge and non-finite numbers (NaN, Infinity, 1e400), unpaired
surrogate escapes, truncated and raw bytes, and runs each through the same
call the server makes (gateway.intake: parse, then translate). The answer
must be a request protobuf can serialise, or an exception the error table
answers with a 4xx; anything else (a RecursionError, OverflowError,
protobuf's ValueError) would be a 500.

In `make test` it runs a fixed, derandomized set of examples in a few
seconds. The longer run draws new examples each time (docs/openai.md,
"Hostile input"):

    STRUCTD_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/test_gateway_fuzz.py -p no:cacheprovider

Every failure it has found is a named case in test_found_by_the_fuzzer.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import ApiError, from_exception
from gateway.intake import translate_body
from gateway.translation.request import Translated, chat_request, completion_request
from gateway.translation.responses import responses_request
from shared import errors

MODEL = "structd-embedded"
LONG_RUN_EXAMPLES = int(os.environ.get("STRUCTD_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=LONG_RUN_EXAMPLES or 250, derandomize=not LONG_RUN_EXAMPLES, database=None,
                deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TRANSLATE = {"chat": chat_request, "completions": completion_request, "responses": responses_request}

# Every Unicode code point, unpaired surrogates included (json.dumps writes them as \ud800 escapes).
texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=12) | st.sampled_from(
    ["\ud800", "a\udfff", "\udbff\udfff", "\x00", "\u2028", "\U0001F600"])
# The edges of the proto's int32, int64, uint64 and float32 fields, and the non-finite numbers json accepts.
edges = st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63, 2**64, -(2**63), -(2**63) - 1,
                         float("inf"), float("-inf"), float("nan"), 1e39, -1e39, 0.5, 3.0])
numbers = st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True) | edges
scalars = st.none() | st.booleans() | numbers | texts
json_values = st.recursive(scalars, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(texts, children, max_size=4), max_leaves=12)


def nested(depth: int, inner) -> object:
    for i in range(depth):
        inner = [inner] if i % 2 else {"a": inner}
    return inner


# Anything at all: around the nesting limit (body.MAX_NESTING) as often as well inside it (deeper still, past
# Python's recursion limit, only as text: `deep_texts` and `deep_bodies`, so that drawing one does not recurse).
depths = st.integers(0, 80)
anything = json_values | numbers | st.builds(nested, depths, json_values)
deep_texts = st.builds(lambda depth: "[" * depth + "]" * depth, st.integers(60, 3000))
counts = st.integers(1, 40)
unit = st.floats(0, 1)
schemas = st.sampled_from([
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "maxLength": 3}, {"maximum": float("nan")}, {"enum": [float("inf")]},
]) | st.builds(nested, depths, st.just({"type": "string"})) | st.dictionaries(texts, json_values, max_size=3)
schema_texts = schemas.map(json.dumps) | texts | deep_texts
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": texts}, optional={"parameters": schemas | schema_texts, "description": texts})})
content = texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=3)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                                 "content": content}, optional={
    "name": texts, "tool_call_id": st.text(min_size=1, max_size=8), "reasoning_content": texts,
    "tool_calls": st.lists(st.fixed_dictionaries({"id": texts, "function": st.fixed_dictionaries(
        {"name": texts, "arguments": texts})}), max_size=2)})
structured_outputs = st.fixed_dictionaries({}, optional={
    "json": schemas | schema_texts, "regex": texts, "choice": st.lists(texts, max_size=3), "grammar": texts,
    "json_object": st.booleans(), "structural_tag": schemas | schema_texts,
    "whitespace": st.sampled_from(["compact", "flexible", "indented"]), "max_whitespace_count": counts,
    "indent": counts, "lenient": st.booleans(), "any_key_order": st.booleans(),
    "disable_any_whitespace": st.booleans(), "disable_jump_forward": st.booleans(), "strict_schema": st.booleans()})
response_format = st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}, optional={
    "json_schema": st.fixed_dictionaries({"schema": schemas | schema_texts},
                                         optional={"name": texts, "strict": st.booleans()})})
common = {
    "model": st.just(MODEL), "max_tokens": counts, "temperature": st.floats(0, 2), "top_p": unit,
    "top_k": st.integers(-1, 50), "seed": st.integers(-(2**63), 2**64 - 1), "n": st.just(1), "min_tokens": counts,
    "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 255).map(str), st.floats(-100, 100), max_size=4),
    "min_p": unit, "stop_token_ids": st.lists(st.integers(0, 255), max_size=3),
    "include_stop_str_in_output": st.booleans(), "stop": texts | st.lists(texts, max_size=3), "stream": st.booleans(),
    "ignore_eos": st.booleans(), "thinking_token_budget": counts, "structured_outputs": structured_outputs,
    "response_format": response_format,
}
chat_bodies = st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=4)}, optional={
    **common, "max_completion_tokens": counts, "tools": st.lists(tool, max_size=3),
    "tool_choice": st.sampled_from(["auto", "required", "none"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": texts})}),
    "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans(),
                                                                "thinking": st.booleans()}),
    "reasoning_effort": st.sampled_from(["none", "minimal", "low", "medium", "high"]),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)})
completion_bodies = st.fixed_dictionaries({"prompt": texts | st.lists(counts, min_size=1, max_size=4)}, optional={
    **common, "echo": st.just(False), "suffix": st.just(""), "best_of": st.just(1),
    "logprobs": st.integers(0, 20)})

input_item = message | st.fixed_dictionaries({"type": st.sampled_from(["function_call", "function_call_output",
                                                                       "reasoning", "message"])}, optional={
    "call_id": texts, "name": texts, "arguments": texts, "output": content, "role": texts,
    "content": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text",
                                                                        "reasoning_text"]), "text": texts}),
                        max_size=2)})
responses_bodies = st.fixed_dictionaries({"input": texts | st.lists(input_item, min_size=1, max_size=4)}, optional={
    **{k: v for k, v in common.items() if k not in ("max_tokens", "n", "response_format")},
    "instructions": texts, "max_output_tokens": counts, "store": st.booleans(),
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"])},
        optional={"schema": schemas | schema_texts, "name": texts, "strict": st.booleans()})}),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": texts},
                                            optional={"parameters": schemas | schema_texts}), max_size=3),
    "tool_choice": st.sampled_from(["auto", "required", "none"]) | st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "allowed_tools"]), "name": texts},
        optional={"mode": texts, "tools": st.lists(st.fixed_dictionaries({"name": texts}), max_size=2)}),
    "reasoning": st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["none", "low", "high", "x"])})})


@st.composite
def corrupted(draw, bodies):
    """A body with one value somewhere in it (or a new field) replaced by anything."""
    body = copy.deepcopy(draw(bodies))  # drawn values can be shared (st.just, sampled_from): not edited in place
    containers = [body, *_walk(body)]
    target = draw(st.sampled_from(containers))
    if isinstance(target, list) and target:
        target[draw(st.integers(0, len(target) - 1))] = draw(anything)
    elif isinstance(target, dict):
        target[draw(st.sampled_from(sorted(target) + ["an_unknown_field"]))] = draw(anything)
    return body


def _walk(value):
    for child in value.values() if isinstance(value, dict) else value if isinstance(value, list) else ():
        if isinstance(child, (dict, list)):
            yield child
            yield from _walk(child)


def encoded(body) -> bytes:
    # allow_nan: the NaN and Infinity literals Python's json accepts; ensure_ascii: surrogates as \u escapes.
    return json.dumps(body, allow_nan=True).encode()


NUMBER_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens", "top_k", "seed", "n", "temperature", "top_p",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "thinking_token_budget",
                 "top_logprobs", "logprobs", "best_of")


def with_number(bodies):
    """A body with one numeric field set to any number (huge, negative, NaN, Infinity, past int32 and float32)."""
    return st.builds(lambda body, key, number: {**body, key: number}, bodies, st.sampled_from(NUMBER_FIELDS),
                     edges | numbers)


def deep_bodies(bodies):
    """A body with one more field, an array nested `depth` deep, written as text."""
    return st.builds(lambda raw, depth: raw[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}",
                     bodies.map(encoded), st.integers(60, 3000))


def routed(route: str, bodies):
    return st.tuples(st.just(route), st.one_of(bodies.map(encoded), corrupted(bodies).map(encoded),
                                               with_number(bodies).map(encoded), deep_bodies(bodies)))


bodies = st.one_of(
    routed("chat", chat_bodies), routed("completions", completion_bodies), routed("responses", responses_bodies),
    # Raw bytes: a truncated body, and bytes that are not JSON or not UTF-8.
    st.tuples(st.sampled_from(sorted(TRANSLATE)), chat_bodies.map(encoded).flatmap(
        lambda raw: st.integers(0, len(raw)).map(lambda n: raw[:n]))),
    st.tuples(st.sampled_from(sorted(TRANSLATE)), st.binary(max_size=64)),
)


def assert_translates_or_refuses(route: str, raw: bytes) -> None:
    try:
        translated = translate_body(raw, TRANSLATE[route], MODEL, "fuzz-1")
    except (ApiError, errors.InvalidRequestError, errors.NotFoundError) as e:
        status = from_exception(e).status
        assert 400 <= status < 500, f"{type(e).__name__} answered {status}: {e}"
        return
    assert isinstance(translated, Translated)
    translated.grpc_request.SerializeToString()


@FUZZ
@given(bodies)
def test_any_body_translates_or_is_a_client_error(case):
    assert_translates_or_refuses(*case)


@pytest.mark.parametrize("route, raw", [
    # Found by this fuzzer run against the gateway as it was before issue 24's fixes: each was a 500.
    pytest.param("completions", b'{"prompt": "\\ud800"}', id="unpaired-surrogate-prompt"),
    pytest.param("chat", b'{"messages": [{"role": "assistant", "tool_calls": [{"id": "", "function": {"name": '
                 b'"a\\udfff", "arguments": "{}"}}]}]}', id="unpaired-surrogate-tool-call-name"),
    pytest.param("chat", b'{"max_tokens": 3582633631775916.0, "messages": [{"role": "user", "content": "x"}]}',
                 id="max_tokens-past-int32"),
    pytest.param("chat", b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
                 b'"json_schema", "json_schema": {"schema": "' + b"[" * 1000 + b"]" * 1000 + b'"}}}',
                 id="schema-text-past-the-recursion-limit"),
    pytest.param("completions", b'{"prompt": "x", "deep": ' + b"[" * 1000 + b"]" * 1000 + b"}",
                 id="body-past-the-recursion-limit"),
    # Issue 24's own cases of the same kinds.
    pytest.param("completions", b'{"prompt": "x", "max_tokens": Infinity}', id="max_tokens-Infinity"),
    pytest.param("completions", b'{"prompt": "x", "best_of": NaN}', id="best_of-NaN"),
])
def test_found_by_the_fuzzer(route, raw):
    assert_translates_or_refuses(route, raw)
