"""Generate end to end through gRPC on the embedded model: every constraint kind's output is valid.

The model has random weights, so only the grammar gives the output its
structure: a constrained output that validates is the grammar tier's masks
applied by the engine, step after step. Schemas bound their strings, numbers
and arrays so that a random model finishes.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "role", "tags"],
}
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
         "required": ["x", "y"]}
REGEX = r"[a-z]{3}-[0-9]{2,4}"
EBNF = 'root ::= answer " " digit\nanswer ::= "yes" | "no" | "maybe"\ndigit ::= [0-9]'
CHOICES = ["red", "green", "blue", "ünïcödé 😀"]
TAG = {"type": "structural_tag",
       "format": {"type": "tag", "begin": "<point>", "content": {"type": "json_schema", "json_schema": POINT,
                                                      "max_whitespace_cnt": 1},
                  "end": "</point>"}}


def _json_schema_ok(schema):
    def check(text):
        jsonschema.validate(json.loads(text), schema)
    return check


def _regex_ok(pattern):
    def check(text):
        assert re.fullmatch(pattern, text), text
    return check


def _choice_ok(text):
    assert text in CHOICES, text


def _tag_ok(text):
    m = re.fullmatch(r"<point>(.*)</point>", text, re.S)
    assert m, text
    jsonschema.validate(json.loads(m.group(1)), POINT)


def _object_ok(text):
    assert isinstance(json.loads(text), dict), text


KINDS = [
    pytest.param(dict(json_schema=PERSON), _json_schema_ok(PERSON), id="json-schema"),
    pytest.param(dict(json_schema=POINT, disable_jump_forward=True), _json_schema_ok(POINT),
                 id="json-schema-no-jump-forward"),
    pytest.param(dict(regex=REGEX), _regex_ok(REGEX), id="regex"),
    pytest.param(dict(ebnf=EBNF), _regex_ok(r"(yes|no|maybe) [0-9]"), id="ebnf"),
    pytest.param(dict(choice=CHOICES), _choice_ok, id="choice"),
    pytest.param(dict(structural_tag=TAG), _tag_ok, id="structural-tag"),
]


@pytest.mark.parametrize("constraint, check", KINDS)
@pytest.mark.parametrize("sampling", [pytest.param(dict(temperature=0.0), id="greedy"),
                                      pytest.param(dict(temperature=1.0, seed=7), id="sampled")])
def test_constrained_output_is_valid(inference_client, constraint, check, sampling):
    out = inference_client.complete("Answer:", max_tokens=96, **constraint, **sampling)
    assert out.finish_reason == "stop", out
    check(out.text)
    assert out.usage.completion_tokens == len(out.token_ids)
    assert out.usage.prompt_tokens > 0


def test_json_object_output_is_json_or_a_prefix_the_grammar_accepts(inference_client, xgr_tokenizer_info):
    """json_object is unbounded: a random model may run out of tokens, but never leaves the grammar."""
    import xgrammar as xgr

    out = inference_client.complete("JSON:", json_object=True, max_tokens=64, temperature=1.0, seed=3)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(xgr_tokenizer_info).compile_builtin_json_grammar())
    for t in out.token_ids:
        assert matcher.accept_token(t), (t, out.text)
    if out.finish_reason == "stop":
        _object_ok(out.text)
    else:
        assert out.finish_reason == "length"


def test_jump_forward_appends_forced_tokens(inference_client):
    """Keys of a strict schema are forced: they arrive as forced tokens and count in usage."""
    out = inference_client.complete("P:", json_schema=POINT, max_tokens=64)
    assert out.finish_reason == "stop"
    assert out.usage.forced_tokens > 0
    jsonschema.validate(json.loads(out.text), POINT)
    off = inference_client.complete("P:", json_schema=POINT, max_tokens=64, disable_jump_forward=True)
    assert off.usage.forced_tokens == 0
    jsonschema.validate(json.loads(off.text), POINT)


def test_mixed_batch_of_constrained_and_unconstrained(inference_client):
    jobs = [dict(json_schema=PERSON), dict(), dict(regex=REGEX), dict(choice=CHOICES), dict(), dict(json_schema=POINT),
            dict(ebnf=EBNF), dict()]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda kw: inference_client.complete("Go:", max_tokens=64, temperature=0.8, seed=1, **kw),
                             jobs))
    for kw, out in zip(jobs, outs):
        if "json_schema" in kw:
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), kw["json_schema"])
        elif "regex" in kw:
            assert re.fullmatch(REGEX, out.text)
        elif "choice" in kw:
            assert out.text in CHOICES
        elif "ebnf" in kw:
            assert re.fullmatch(r"(yes|no|maybe) [0-9]", out.text)
        else:
            assert out.finish_reason in ("length", "stop")
            assert out.usage.completion_tokens == len(out.token_ids) > 0


def test_max_tokens_finishes_with_length(inference_client):
    out = inference_client.complete("Hello", max_tokens=5, ignore_eos=True, temperature=1.0, seed=1)
    assert out.finish_reason == "length"
    assert len(out.token_ids) == out.usage.completion_tokens == 5


def test_stop_string_cuts_the_text(inference_client):
    out = inference_client.complete("x", regex="hello world, hello world", stop=["world"])
    assert out.finish_reason == "stop_string"
    assert out.text == "hello "


def test_stop_string_on_unconstrained_text(inference_client):
    base = inference_client.complete("Once upon a time", max_tokens=24, ignore_eos=True)
    assert len(base.text) > 6
    stop = base.text[3:6]
    cut = inference_client.complete("Once upon a time", max_tokens=24, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop_string"
    assert cut.text == base.text[:base.text.index(stop)]


@pytest.mark.parametrize("constraint", [
    pytest.param(dict(choice=["日本語のテキスト", "😀😃😄 emoji", "ℵ₀ ∑ ∫ math"]), id="choice-multibyte"),
    pytest.param(dict(), id="unconstrained"),
])
def test_text_deltas_are_whole_utf8_characters(inference_client, hf_tokenizer, constraint):
    chunks = list(inference_client.generate("Text:", max_tokens=40, temperature=1.0, seed=11, **constraint))
    ids = [t for c in chunks for t in c.token_ids]
    full = hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(c.text for c in chunks) == full
    if constraint:
        assert full in constraint["choice"]
        # Whole characters only: no delta carries a replacement character the full text lacks.
        assert all("\ufffd" not in c.text for c in chunks)
        assert any(len(c.token_ids) and not c.text for c in chunks), "expected a token that ends mid-character"
