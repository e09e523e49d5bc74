"""Tools and tool choice: validation, and the structural tag compiled by real xgrammar on the real tokenizer.

For every tool_choice mode and both bundled families, the compiled grammar
must accept well-formed calls and refuse invalid arguments, unknown tools,
text before a required call, and whitespace the compact layout does not
allow. Seeded random walks through the grammar's own token masks produce
answers whose parsed calls validate against their tool's schema.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import xgrammar as xgr

from grammar_svc.compile.spec import GrammarSpec, compile_spec
from grammar_svc.types import Kind

from inference_svc.types import Constraint, JsonOptions
from inference_svc.api.model_family import ModelFamily, load_family
from inference_svc.api.tool_calls import (
    MAX_TOOLS,
    ToolCallParser,
    ToolChoice,
    ToolSpec,
    tool_call_structural_tag,
    validate_tools,
)
from shared.codec import allowed_ids
from shared.errors import InvalidGrammarError, InvalidRequestError

WEATHER = ToolSpec("get_weather", "The weather now", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
})
TIME = ToolSpec("get_time", "", None)  # any object
BOOK = ToolSpec("book-table", "Reserve", {
    "properties": {"people": {"type": "integer", "minimum": 1, "maximum": 12}, "outside": {"type": "boolean"},
                   "tags": {"type": "array", "items": {"enum": ["quiet", "view"]}, "maxItems": 2}},
    "required": ["people", "outside"],
})  # no "type": an object is implied
TOOLS = [WEATHER, TIME, BOOK]
FAMILIES = [pytest.param(load_family("deepseek"), id="deepseek"), pytest.param(load_family("qwen"), id="qwen")]


@pytest.fixture(scope="module")
def compiler(xgr_tokenizer_info):
    return xgr.GrammarCompiler(xgr_tokenizer_info)


def compiled(compiler, family, choice, tools=TOOLS, answer=None, parallel=True):
    """The tag as the grammar tier compiles it (its json_schema parts through structd's JSON grammar)."""
    tag = tool_call_structural_tag(family, tools, choice, answer, parallel=parallel)
    return compile_spec(compiler, GrammarSpec(Kind.STRUCTURAL_TAG, json.dumps(tag)))


def accepts(grammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.is_completed()


def call(family, name, arguments):
    fmt = family.tool_calls
    return fmt.begin_for(name) + arguments + fmt.call_end


def calls(family, *items):
    fmt = family.tool_calls
    return fmt.block_begin + fmt.separator.join(call(family, n, a) for n, a in items) + fmt.block_end


WEATHER_CALL = ("get_weather", '{"city":"Paris"}')
TIME_CALL = ("get_time", '{"zone":"UTC"}')
BOOK_CALL = ("book-table", '{"people":2,"outside":true,"tags":["view"]}')

# (answer text builder, accepted under auto, required, named get_weather)
ANSWERS = [
    pytest.param(lambda f: calls(f, WEATHER_CALL), True, True, True, id="one-call"),
    pytest.param(lambda f: calls(f, WEATHER_CALL, BOOK_CALL, TIME_CALL), True, True, False, id="three-calls"),
    pytest.param(lambda f: "Hello, no tools needed.", True, False, False, id="text-only"),
    pytest.param(lambda f: "", True, False, False, id="nothing"),
    pytest.param(lambda f: "Let me check. " + calls(f, WEATHER_CALL), True, False, False, id="text-before-call"),
    pytest.param(lambda f: calls(f, ("get_weather", '{"town":"Paris"}')), False, False, False, id="unknown-property"),
    pytest.param(lambda f: calls(f, ("get_weather", '{"unit":"c"}')), False, False, False, id="missing-required"),
    pytest.param(lambda f: calls(f, ("get_weather", '{"city":"Paris, France"}')), False, False, False,
                 id="string-too-long"),
    pytest.param(lambda f: calls(f, ("book-table", '{"people":20,"outside":true}')), False, False, False,
                 id="integer-out-of-range"),
    pytest.param(lambda f: calls(f, ("send_email", '{}')), False, False, False, id="unknown-tool"),
    pytest.param(lambda f: calls(f, ("get_weather", '{"city": "Paris"}')), False, False, False,
                 id="not-compact"),
    # Arguments compile through structd's JSON grammar (grammar_svc/compile/structural_tags.py): bounded strings
    # are JSON strings, as in a json_schema constraint (xgrammar alone takes the raw tab, refuses the escape).
    pytest.param(lambda f: calls(f, ("get_weather", '{"city":"Pa\tris"}')), False, False, False,
                 id="raw-tab-in-a-bounded-string"),
    pytest.param(lambda f: calls(f, ("get_weather", '{"city":"Pa\\"ris"}')), True, True, True,
                 id="escaped-quote-in-a-bounded-string"),
    pytest.param(lambda f: calls(f, ("get_weather", '{"city":"Paris"}')) + " All done.", True, False, False,
                 id="text-after-calls"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("answer, auto, required, named", ANSWERS)
def test_the_tool_grammar_of_each_mode(compiler, family, answer, auto, required, named):
    text = answer(family)
    assert accepts(compiled(compiler, family, ToolChoice("auto")), text) == auto
    assert accepts(compiled(compiler, family, ToolChoice("required")), text) == required
    assert accepts(compiled(compiler, family, ToolChoice("named", "get_weather")), text) == named


@pytest.mark.parametrize("family", FAMILIES)
def test_named_is_exactly_that_tool(compiler, family):
    grammar = compiled(compiler, family, ToolChoice("named", "book-table"))
    assert accepts(grammar, calls(family, BOOK_CALL))
    assert not accepts(grammar, calls(family, WEATHER_CALL))
    assert not accepts(grammar, calls(family, BOOK_CALL, BOOK_CALL))


# (answer text builder, accepted under auto, required) with parallel_tool_calls false
ONE_CALL_ANSWERS = [
    pytest.param(lambda f: calls(f, WEATHER_CALL), True, True, id="one-call"),
    pytest.param(lambda f: calls(f, WEATHER_CALL, BOOK_CALL), False, False, id="two-calls-one-block"),
    pytest.param(lambda f: calls(f, WEATHER_CALL) + calls(f, BOOK_CALL), False, False, id="two-blocks"),
    pytest.param(lambda f: "Let me check. " + calls(f, WEATHER_CALL), True, False, id="text-then-call"),
    pytest.param(lambda f: calls(f, WEATHER_CALL) + " done", False, False, id="text-after-the-call"),
    pytest.param(lambda f: "No tools needed.", True, False, id="text-only"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("answer, auto, required", ONE_CALL_ANSWERS)
def test_parallel_tool_calls_false_allows_one_call_at_most(compiler, family, answer, auto, required):
    text = answer(family)
    assert accepts(compiled(compiler, family, ToolChoice("auto"), parallel=False), text) == auto
    assert accepts(compiled(compiler, family, ToolChoice("required"), parallel=False), text) == required


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["auto", "required"])
def test_allowed_tools_restrict_the_calls(compiler, family, mode):
    grammar = compiled(compiler, family, ToolChoice(mode, allowed=("book-table", "get_time")))
    assert accepts(grammar, calls(family, BOOK_CALL))
    assert accepts(grammar, calls(family, BOOK_CALL, TIME_CALL))
    assert not accepts(grammar, calls(family, WEATHER_CALL))
    assert not accepts(grammar, calls(family, BOOK_CALL, WEATHER_CALL))
    assert accepts(grammar, "Just text.") == (mode == "auto")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(8))
def test_random_answers_with_parallel_tool_calls_false_have_one_call(compiler, xgr_tokenizer_info, hf_tokenizer,
                                                                    family, seed):
    walk_tools = [WEATHER, BOOK]
    grammar = compiled(compiler, family, ToolChoice("required"), tools=walk_tools, parallel=False)
    ids = random_answer(grammar, xgr_tokenizer_info.vocab_size, seed)
    assert ids[-1] == hf_tokenizer.eos_token_id
    parser = ToolCallParser(family, tool_names={t.name for t in walk_tools})
    content, found = parser.push(hf_tokenizer.decode(ids[:-1]))
    rest, more = parser.finish()
    assert (content + rest, len(found + more)) == ("", 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_text_may_not_write_think_markers(compiler, family):
    grammar = compiled(compiler, family, ToolChoice("auto"))
    assert accepts(grammar, "plain answer")
    assert not accepts(grammar, "plain answer </think> more")


def test_none_and_auto_without_tools_add_no_constraint():
    family = load_family("deepseek")
    assert tool_call_structural_tag(family, TOOLS, ToolChoice("none")) is None
    assert tool_call_structural_tag(family, [], ToolChoice("auto")) is None
    assert tool_call_structural_tag(None, [], ToolChoice("auto")) is None  # no family needed when nothing is called
    answer = Constraint("regex", "[a-z]+")
    assert tool_call_structural_tag(family, TOOLS, ToolChoice("none"), answer) is None  # the answer applies as it is


ANSWER_CONSTRAINTS = [
    pytest.param(Constraint("json_schema", '{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}'),
                 '{"n":3}', ['{"n": 3}', '{"m":3}', "free text"], id="json_schema"),
    pytest.param(Constraint("json_schema", '{"type":"object","properties":{"n":{"type":"integer"}}}',
                            json_options=JsonOptions(lenient=True)),
                 '{"n":3,"extra":true}', ['{"n":"x"}'], id="json_schema-lenient"),
    pytest.param(Constraint("json_object"), '{"a":1}', ["[1]", "text"], id="json_object"),
    pytest.param(Constraint("regex", "[0-9]{3}"), "123", ["12", "abc"], id="regex"),
    pytest.param(Constraint("ebnf", 'root ::= "yes" | "no"'), "no", ["maybe"], id="ebnf"),
    pytest.param(Constraint("choice", choices=("red", "green")), "green", ["blue"], id="choice"),
    pytest.param(Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<a>", "content": {"type": "const_string", "value": "x"}, "end": "</a>"}})),
                 "<a>x</a>", ["<a>y</a>"], id="structural_tag"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("answer, good, bad", ANSWER_CONSTRAINTS)
def test_auto_with_an_answer_constraint_is_that_answer_or_tool_calls(compiler, family, answer, good, bad):
    grammar = compiled(compiler, family, ToolChoice("auto"), answer=answer)
    assert accepts(grammar, good)
    assert accepts(grammar, calls(family, WEATHER_CALL, TIME_CALL))
    assert not accepts(grammar, good + calls(family, WEATHER_CALL))  # one or the other
    for text in bad:
        assert not accepts(grammar, text), text


def test_required_ignores_the_answer_constraint(compiler):
    family = load_family("deepseek")
    answer = Constraint("regex", "[0-9]+")
    grammar = compiled(compiler, family, ToolChoice("required"), answer=answer)
    assert accepts(grammar, calls(family, WEATHER_CALL))
    assert not accepts(grammar, "123")


@pytest.mark.parametrize("answer, error, message", [
    pytest.param(Constraint("json_schema", "{", ), InvalidGrammarError, "json_schema is not valid JSON",
                 id="schema-not-json"),
    pytest.param(Constraint("json_schema", '{"type":"object","properties":{"a":{"$ref":"#/$defs/missing"}}}'),
                 InvalidGrammarError, "json_schema cannot be used as a JSON Schema", id="schema-bad-ref"),
    pytest.param(Constraint("json_schema", '{"type":"object"}', json_options=JsonOptions(whitespace="indented")),
                 InvalidRequestError, "indented whitespace cannot be combined with tools", id="indented-json"),
    pytest.param(Constraint("structural_tag", '{"structures": [], "triggers": []}'), InvalidRequestError,
                 "the legacy form (structures and triggers) cannot be combined", id="legacy-structural-tag"),
    pytest.param(Constraint("structural_tag", "[1"), InvalidGrammarError, "structural_tag is not valid JSON",
                 id="structural-tag-not-json"),
])
def test_unsupported_answer_combinations_are_named(answer, error, message):
    with pytest.raises(error, match=re.escape(message)):
        tool_call_structural_tag(load_family("deepseek"), TOOLS, ToolChoice("auto"), answer)


def test_a_tool_schema_xgrammar_refuses_is_reported_with_its_tool():
    bad = ToolSpec("f", "", {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}})
    with pytest.raises(InvalidGrammarError) as e:
        tool_call_structural_tag(load_family("deepseek"), [bad], ToolChoice("required"))
    assert "tool 'f': parameters cannot be used as a JSON Schema" in str(e.value)
    assert "/project/" not in str(e.value)  # xgrammar's source location is cleaned off


def test_tools_need_a_family_with_a_tool_format():
    with pytest.raises(InvalidRequestError, match="--model-family"):
        tool_call_structural_tag(None, TOOLS, ToolChoice("auto"))
    with pytest.raises(InvalidRequestError, match="model family 'plain' has none"):
        tool_call_structural_tag(ModelFamily("plain", "<think>", "</think>"), TOOLS, ToolChoice("required"))


@pytest.mark.parametrize("tools, choice, message", [
    pytest.param([ToolSpec("get weather")], ToolChoice(), "name 'get weather' is not valid", id="space-in-name"),
    pytest.param([ToolSpec("")], ToolChoice(), "name '' is not valid", id="empty-name"),
    pytest.param([ToolSpec("x" * 65)], ToolChoice(), "1 to 64 letters", id="name-too-long"),
    pytest.param([ToolSpec("f"), ToolSpec("f")], ToolChoice(), "'f' is used by more than one tool", id="duplicate"),
    pytest.param([ToolSpec("f", "", {"type": "array"})], ToolChoice(), 'must describe a JSON object',
                 id="array-parameters"),
    pytest.param([ToolSpec("f", "", [1])], ToolChoice(), "must be a JSON Schema object, got list",
                 id="parameters-not-an-object"),
    pytest.param([ToolSpec("f")], ToolChoice("sometimes"), "mode 'sometimes' is not one of", id="unknown-mode"),
    pytest.param([ToolSpec("f")], ToolChoice("named"), "names no tool", id="named-without-name"),
    pytest.param([ToolSpec("f")], ToolChoice("named", "g"), "'g', which is not among the request's tools (f)",
                 id="named-unknown-tool"),
    pytest.param([ToolSpec("f")], ToolChoice("auto", "f"), "a name goes with mode named only", id="name-with-auto"),
    pytest.param([], ToolChoice("required"), "tool_choice required needs at least one tool", id="required-no-tools"),
    pytest.param([], ToolChoice("named", "f"), "not among the request's tools", id="named-no-tools"),
    pytest.param([ToolSpec(f"t{i}") for i in range(MAX_TOOLS + 1)], ToolChoice(), f"at most {MAX_TOOLS}",
                 id="too-many-tools"),
    pytest.param([ToolSpec("f")], ToolChoice("auto", allowed=("g",)),
                 "allowed_tools names 'g', which is not among the request's tools (f)", id="allowed-unknown"),
    pytest.param([ToolSpec("f")], ToolChoice("none", allowed=("f",)), "allowed_tools goes with mode auto or required",
                 id="allowed-with-none"),
])
def test_invalid_tools_are_refused_with_what_to_fix(tools, choice, message):
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        validate_tools(tools, choice)


@pytest.mark.parametrize("text, message", [
    pytest.param("{", "parameters is not valid JSON: Expecting property name", id="not-json"),
    pytest.param("[]", "must be a JSON Schema object, got list", id="not-an-object"),
])
def test_parameters_from_json_text(text, message):
    with pytest.raises(InvalidRequestError, match=message):
        ToolSpec.from_json("f", "", text)


def test_parameters_from_json_text_accepts_an_object_or_nothing():
    assert ToolSpec.from_json("f", "d", "").parameters is None
    assert ToolSpec.from_json("f", "d", '{"type":"object"}').parameters == {"type": "object"}


def random_answer(grammar, vocab_size: int, seed: int, limit: int = 2000) -> list[int]:
    """Token ids drawn uniformly from the grammar's own mask until it ends (the stop token) or `limit`."""
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    rng = random.Random(seed)
    ids: list[int] = []
    while not matcher.is_terminated() and len(ids) < limit:
        matcher.fill_next_token_bitmask(bitmask)
        token = rng.choice(allowed_ids(bitmask[0].numpy(), vocab_size).tolist())
        if not matcher.accept_token(token):
            raise AssertionError(f"the matcher refused token {token}, which its own mask allowed")
        ids.append(token)
    return ids


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("choice", [pytest.param(ToolChoice("required"), id="required"),
                                    pytest.param(ToolChoice("named", "book-table"), id="named")])
@pytest.mark.parametrize("seed", range(3))
def test_random_answers_under_the_grammar_parse_into_calls_that_validate(compiler, xgr_tokenizer_info, hf_tokenizer,
                                                                         family, choice, seed):
    # Bounded schemas only (an any-object tool lets a uniform walk write keys forever).
    walk_tools = [WEATHER, BOOK]
    grammar = compiled(compiler, family, choice, tools=walk_tools)
    ids = random_answer(grammar, xgr_tokenizer_info.vocab_size, seed)
    eos = hf_tokenizer.eos_token_id
    assert ids[-1] == eos, "the walk must end with the stop token"
    text = hf_tokenizer.decode(ids[:-1])
    parser = ToolCallParser(family, tool_names={t.name for t in walk_tools})
    content, found = parser.push(text)
    rest, more = parser.finish()
    assert content + rest == ""
    parsed = found + more
    assert parsed, text
    if choice.mode == "named":
        assert [c.name for c in parsed] == ["book-table"]
    schemas = {t.name: t.arguments_schema() for t in walk_tools}
    for c in parsed:
        jsonschema.validate(json.loads(c.arguments_json), schemas[c.name])
