"""Fuzzing the inference service's chat and tool path: any conversation, tools and answer text are served or
refused with the service's client error.

hypothesis draws what a Generate call's chat carries once the servicer has
read it: messages of any role (known or not) with any Unicode text, huge
text around --max-prompt-bytes, past tool calls and tool results, the
families' own markup and Jinja syntax inside the text; tools whose
parameters are any JSON text (schemas, wrong types, NaN, nesting around and
far past Python's recursion limit, not JSON at all) around --max-tool-bytes;
any tool choice, thinking on or off, and an answer constraint beside the
tools. Each runs in-process through what the server runs before the engine,
in its order (servicer.client_request's byte check and tool parsing,
Frontend's admission by size, its tool conversion, the embedded model's chat
template on the real tokenizer), then the family's ToolCallParser reads
drawn answer text (markup, arguments nested deep, split anywhere) as the
engine streams it. Each step must succeed or raise InvalidRequestError (or
a subclass: the status table answers INVALID_ARGUMENT); anything else
(RecursionError, KeyError, TypeError...) would be an INTERNAL, and from the
parser a failed stream.

In `make test` it runs a fixed, derandomized set of examples in a few
seconds. The longer run draws new examples each time:

    STRUCTD_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/test_chat_fuzz.py -p no:cacheprovider

Every failure it has found is a named case in test_found_by_the_fuzzer.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_svc.api.chat import ROLES, ChatMessage, ChatTemplate
from inference_svc.api.model_family import load_family
from inference_svc.api.tool_calls import (
    MODES,
    ToolCallParser,
    ToolChoice,
    ToolSpec,
    check_tool_bytes,
    tool_call_structural_tag,
)
from inference_svc.config import EngineConfig
from inference_svc.model.embedded_model import CHAT_TEMPLATE
from inference_svc.types import KINDS, Constraint, JsonOptions, ParsedToolCall
from shared.errors import InvalidRequestError, RequestTooLargeError

LONG_RUN_EXAMPLES = int(os.environ.get("STRUCTD_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=LONG_RUN_EXAMPLES or 150, derandomize=not LONG_RUN_EXAMPLES, database=None,
                deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# The server's own defaults for the limits admission applies.
LIMITS = EngineConfig()
FAMILIES = {name: load_family(name) for name in ("deepseek", "qwen")}
MARKUP = sorted({m for f in FAMILIES.values() for m in (
    f.think_start, f.think_end, f.tool_calls.block_begin, f.tool_calls.call_prefix, f.tool_calls.name_suffix,
    f.tool_calls.call_end, f.tool_calls.block_end, f.tool_calls.separator) if m})

# Every Unicode code point (unpaired surrogates included), the families' markup, and template syntax.
texts = st.text(st.characters(codec=None, exclude_categories=()), max_size=12) | st.sampled_from(
    MARKUP + ["\ud800", "\x00", "\u2028", "\U0001F600", "{{ 7*7 }}", "{% raw %}", "{#", "<｜User｜>",
              "<｜end▁of▁sentence｜>", "get_weather", "{}", '{"a": 1}'])
# Past --max-prompt-bytes and near --max-tool-bytes: in one message and the tools' schemas only (drawn for
# every text field, a random run's examples held 16 GiB in the test process).
huge_texts = st.builds(lambda unit, size: unit * (size // len(unit.encode())),
                       st.sampled_from(["x", "é", "<｜User｜>"]),
                       st.sampled_from([LIMITS.max_prompt_bytes + 64, LIMITS.max_tool_bytes // 2]))
names = st.sampled_from(["get_weather", "get_time", "a", "-", "x" * 64, "x" * 65, "", "bad name", "é"]) | texts


def nested_text(depth: int, inner: str = "{}") -> str:
    """An object `depth` arrays deep, as text (built as text: drawing it recurses nowhere)."""
    return "[" * depth + inner + "]" * depth


depths = st.sampled_from([1, 60, 64, 65, 500, 900, 1000, 1100, 5000, 100_000])
json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | texts
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(texts, c, max_size=3),
                           max_leaves=8)
schemas = st.one_of(
    st.just({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    st.builds(lambda t: {"type": t}, st.sampled_from(["object", "string", "bogus", 3]) | json_values),
    st.builds(lambda p: {"type": "object", "properties": p}, st.dictionaries(texts, json_values, max_size=3)),
    st.builds(lambda depth: {"type": "object", "properties": {"p": json.loads(nested_text(depth))}},
              st.integers(1, 80)),
    st.dictionaries(texts, json_values, max_size=3),
)
schema_texts = st.one_of(
    schemas.map(lambda s: json.dumps(s, allow_nan=True)),
    json_values.map(lambda v: json.dumps(v, allow_nan=True)),
    depths.map(lambda d: '{"type": "object", "properties": {"p": ' + nested_text(d) + "}}"),
    depths.map(nested_text), depths.map(lambda d: "[" * d),
    st.sampled_from(["", " ", "{", "NaN", '{"type": "object", "maximum": NaN}', "1e400", "null", '"\\ud800"']),
    texts,
)
tool_schema_texts = schema_texts | huge_texts.map(lambda t: json.dumps({"type": "object", "description": t}))
tools = st.tuples(names, texts, tool_schema_texts)  # (name, description, parameters JSON text), as a pb.Tool has them
tool_calls = st.builds(ParsedToolCall, texts, names, texts | schema_texts)
messages = st.builds(
    ChatMessage, role=st.sampled_from(ROLES) | st.sampled_from(["developer", "function", ""]) | texts,
    content=texts, name=texts, tool_call_id=texts,
    tool_calls=st.lists(tool_calls, max_size=3).map(tuple), reasoning_content=texts)
answers = st.none() | st.builds(
    Constraint, kind=st.sampled_from(sorted(KINDS)), text=schema_texts | texts,
    choices=st.lists(texts, max_size=3).map(tuple),
    json_options=st.builds(JsonOptions, whitespace=st.sampled_from(["compact", "flexible", "indented"]),
                           lenient=st.booleans(), any_key_order=st.booleans()))
huge_message = st.builds(ChatMessage, role=st.sampled_from(ROLES), content=huge_texts)
chats = st.fixed_dictionaries({
    "messages": st.builds(lambda ms, huge: ms + huge, st.lists(messages, max_size=5),
                          st.lists(huge_message, max_size=1)),
    "tools": st.lists(tools, max_size=4),
    "choice": st.builds(ToolChoice, st.sampled_from(MODES + ("bogus",)), names | st.just("")),
    "reasoning": st.sampled_from([None, True, False]), "answer": answers,
    "family": st.sampled_from(sorted(FAMILIES)),
})


@st.composite
def answer_texts(draw, family_name: str) -> list[str]:
    """Answer text as a model might write it (markup, calls with any arguments, text), cut into stream pieces."""
    fmt = FAMILIES[family_name].tool_calls
    arguments = st.one_of(json_values.map(lambda v: json.dumps(v, allow_nan=True)), depths.map(nested_text),
                          depths.map(lambda d: '{"a": ' + nested_text(d) + "}"), texts)
    call = st.builds(lambda name, args, end: fmt.begin_for(name) + args + (fmt.call_end if end else ""),
                     names, arguments, st.booleans())
    parts = draw(st.lists(st.sampled_from(MARKUP) | call | texts, max_size=8))
    text = "".join(parts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.fixture(scope="module")
def template(hf_tokenizer) -> ChatTemplate:
    return ChatTemplate.load(hf_tokenizer, CHAT_TEMPLATE)


def prepare(template: ChatTemplate, chat: dict) -> None:
    """What the server runs on a chat before the engine, in its order; client errors propagate."""
    tools = chat["tools"]
    check_tool_bytes([(name, text) for name, _, text in tools], LIMITS.max_tool_bytes)  # servicer.client_request
    specs = [ToolSpec.from_json(name, description, text) for name, description, text in tools]
    size = sum(m.text_bytes() for m in chat["messages"])  # Frontend._admit
    if size > LIMITS.max_prompt_bytes:
        raise RequestTooLargeError(f"{size} bytes of messages")
    family = FAMILIES[chat["family"]]
    if specs:  # Frontend._tools
        tag = tool_call_structural_tag(family, specs, chat["choice"], chat["answer"])
        if tag is not None:
            json.dumps(tag)
    template.render(chat["messages"], specs, chat["reasoning"])


def assert_served_or_refused(template: ChatTemplate, chat: dict) -> None:
    try:
        prepare(template, chat)
    except InvalidRequestError as e:
        assert str(e)


def assert_parses(family_name: str, pieces: list[str], tool_names: list[str] | None) -> None:
    """The parser never raises on answer text; what it returns as calls is well formed, and nothing is lost."""
    parser = ToolCallParser(FAMILIES[family_name], tool_names)
    calls: list[ParsedToolCall] = []
    for piece in pieces:
        calls += parser.push(piece)[1]
    calls += parser.finish()[1]
    for c in calls:
        assert isinstance(json.loads(c.arguments_json), dict)
        assert tool_names is None or c.name in tool_names


@FUZZ
@given(chats)
def test_any_chat_renders_or_is_a_client_error(template, chat):
    assert_served_or_refused(template, chat)


@FUZZ
@given(st.sampled_from(sorted(FAMILIES)).flatmap(
    lambda f: st.tuples(st.just(f), answer_texts(f), st.none() | st.lists(names, max_size=3))))
def test_any_answer_text_parses(case):
    assert_parses(*case)


DEEP = 100_000
WEATHER = ("get_weather", "", '{"type": "object", "properties": {"city": {"type": "string"}}}')


@pytest.mark.parametrize("chat", [
    pytest.param({"tools": [("deep", "", nested_text(DEEP))]}, id="tool-parameters-past-the-recursion-limit"),
    pytest.param({"tools": [WEATHER], "answer": Constraint("json_schema", nested_text(DEEP))},
                 id="answer-schema-past-the-recursion-limit"),
    pytest.param({"tools": [WEATHER], "answer": Constraint("structural_tag", nested_text(DEEP))},
                 id="answer-structural-tag-past-the-recursion-limit"),
])
def test_found_by_the_fuzzer(template, chat):
    full = {"messages": [ChatMessage("user", "hi")], "tools": [], "choice": ToolChoice("auto"), "reasoning": None,
            "answer": None, "family": "deepseek", **chat}
    with pytest.raises(InvalidRequestError):
        prepare(template, full)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_found_by_the_fuzzer_deep_call_arguments_are_content(family):
    fmt = FAMILIES[family].tool_calls
    text = fmt.block_begin + fmt.begin_for("a") + '{"a": ' + nested_text(DEEP) + "}" + fmt.call_end + fmt.block_end
    assert_parses(family, [text], None)
