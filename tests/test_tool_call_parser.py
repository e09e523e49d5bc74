"""ToolCallParser: streamed answer text split into content and whole tool calls, for both bundled formats."""

from __future__ import annotations

import json
import math
import re
import time

import pytest

from inference_svc.api.model_family import ModelFamily, load_family
from inference_svc.api.tool_calls import ToolCallParser
from shared.errors import InvalidRequestError

DEEPSEEK = load_family("deepseek")
QWEN = load_family("qwen")
LLAMA3 = load_family("llama3")  # its end marker is "}": every brace inside the arguments looks like it


def call_text(family, name: str, arguments: str) -> str:
    fmt = family.tool_calls
    return fmt.begin_for(name) + arguments + fmt.call_end


def block(family, *calls: str) -> str:
    fmt = family.tool_calls
    return fmt.block_begin + fmt.separator.join(calls) + fmt.block_end


def run(parser: ToolCallParser, pieces) -> tuple[str, list[tuple[str, str]]]:
    content, calls = [], []
    for piece in pieces:
        text, found = parser.push(piece)
        content.append(text)
        calls += found
    text, found = parser.finish()
    content.append(text)
    calls += found
    return "".join(content), [(c.name, c.arguments_json) for c in calls]


CASES = [
    pytest.param(DEEPSEEK, "Let me look. " + block(DEEPSEEK, call_text(DEEPSEEK, "get_weather", '{"city": "Paris"}'),
                                                   call_text(DEEPSEEK, "get_time", "{}")),
                 "Let me look. ", [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")], id="deepseek-two-calls"),
    pytest.param(DEEPSEEK, block(DEEPSEEK, call_text(DEEPSEEK, "f", '{"a":1}')) + "\nAnd text after.",
                 "\nAnd text after.", [("f", '{"a":1}')], id="deepseek-text-after-block"),
    pytest.param(DEEPSEEK, "no markup at all, only < and ｜ characters",
                 "no markup at all, only < and ｜ characters", [], id="deepseek-plain-text"),
    pytest.param(DEEPSEEK, block(DEEPSEEK, call_text(DEEPSEEK, "f", '{"s":"a<｜tool▁call▁end｜>b","n":[1, 2]}')),
                 "", [("f", '{"s":"a<｜tool▁call▁end｜>b","n":[1,2]}')], id="deepseek-end-marker-inside-a-string"),
    pytest.param(DEEPSEEK, "A" + block(DEEPSEEK, call_text(DEEPSEEK, "bad name", "{}")) + "B",
                 "A" + block(DEEPSEEK, call_text(DEEPSEEK, "bad name", "{}")) + "B", [], id="deepseek-bad-name-is-text"),
    pytest.param(DEEPSEEK, block(DEEPSEEK, call_text(DEEPSEEK, "f", "[1]")),
                 block(DEEPSEEK, call_text(DEEPSEEK, "f", "[1]")), [], id="deepseek-arguments-not-an-object"),
    pytest.param(DEEPSEEK, block(DEEPSEEK, call_text(DEEPSEEK, "f", '{"x":NaN}')),
                 block(DEEPSEEK, call_text(DEEPSEEK, "f", '{"x":NaN}')), [], id="deepseek-nan-is-not-json"),
    pytest.param(DEEPSEEK, block(DEEPSEEK, call_text(DEEPSEEK, "f", '{"a":1}')).removesuffix("<｜tool▁calls▁end｜>")
                 + "tail", "tail", [("f", '{"a":1}')], id="deepseek-block-never-closed"),
    pytest.param(DEEPSEEK, "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\":",
                 "x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\":", [], id="deepseek-cut-off-call"),
    pytest.param(DEEPSEEK, "ends with a marker start <｜tool▁calls", "ends with a marker start <｜tool▁calls", [],
                 id="deepseek-held-tail-released-at-finish"),
    pytest.param(QWEN, "Checking.\n" + call_text(QWEN, "get_weather", '{"city": "Paris"}') + "\n"
                 + call_text(QWEN, "get_time", "{}") + "\n",
                 "Checking.\n", [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")], id="qwen-two-calls"),
    pytest.param(QWEN, call_text(QWEN, "f", '{"a":{"b":{}}}') + "\n\nThen words.", "\n\nThen words.",
                 [("f", '{"a":{"b":{}}}')], id="qwen-text-after-call"),
    pytest.param(QWEN, '<tool_call>\n{"name": "f", "args": {}}\n</tool_call>',
                 '<tool_call>\n{"name": "f", "args": {}}\n</tool_call>', [], id="qwen-wrong-shape-is-text"),
    pytest.param(QWEN, "<tool_call> is how I call tools", "<tool_call> is how I call tools", [],
                 id="qwen-trigger-prefix-only"),
    pytest.param(QWEN, call_text(QWEN, "f", '{"a":[1}'), call_text(QWEN, "f", '{"a":[1}'), [],
                 id="qwen-unbalanced-brackets-are-text"),
    pytest.param(LLAMA3, call_text(LLAMA3, "f", r'{"code": "if (a) { b(\"}\"); }", "p": "\\", "q": [{}]}'), "",
                 [("f", r'{"code":"if (a) { b(\"}\"); }","p":"\\","q":[{}]}')],
                 id="llama3-braces-quotes-and-backslashes-in-strings"),
    pytest.param(DEEPSEEK, block(DEEPSEEK, call_text(DEEPSEEK, "f", '{"a": 1} \n ')), "", [("f", '{"a":1}')],
                 id="deepseek-space-before-the-end-marker"),
    pytest.param(DEEPSEEK, block(DEEPSEEK, call_text(DEEPSEEK, "f", '{"a": 1} x')),
                 block(DEEPSEEK, call_text(DEEPSEEK, "f", '{"a": 1} x')), [], id="deepseek-text-after-the-object"),
]


@pytest.mark.parametrize("family, text, content, calls", CASES)
def test_one_push(family, text, content, calls):
    assert run(ToolCallParser(family), [text]) == (content, calls)


@pytest.mark.parametrize("family, text, content, calls", CASES)
def test_split_at_every_position_gives_the_same_result(family, text, content, calls):
    for cut in range(1, len(text)):
        assert run(ToolCallParser(family), [text[:cut], text[cut:]]) == (content, calls), cut


@pytest.mark.parametrize("family, text, content, calls", CASES)
def test_character_by_character(family, text, content, calls):
    assert run(ToolCallParser(family), list(text)) == (content, calls)


@pytest.mark.parametrize("family", [pytest.param(DEEPSEEK, id="deepseek"), pytest.param(QWEN, id="qwen")])
def test_no_delta_holds_part_of_the_markup(family):
    """Content streams out up to a possible marker start, and a call arrives whole with its end marker."""
    before = "Some text "
    call = call_text(family, "f", '{"a":1}')
    text = before + block(family, call)
    parser = ToolCallParser(family)
    seen, calls_at = "", []
    for i, ch in enumerate(text):
        delta, calls = parser.push(ch)
        seen += delta
        if calls:
            calls_at.append(i)
        assert family.tool_calls.trigger[:2] not in delta, (i, delta)
    assert seen == before
    end_of_call = len(before) + len(family.tool_calls.block_begin) + len(call) - 1
    assert calls_at == [end_of_call]
    assert parser.finish() == ("", [])


def test_ids_are_unique_call_ids():
    text = block(DEEPSEEK, *[call_text(DEEPSEEK, "f", "{}")] * 3)
    calls = ToolCallParser(DEEPSEEK).push(text)[1]
    assert len({c.id for c in calls}) == 3
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)


def test_arguments_become_compact_json_with_their_key_order_and_unicode():
    (call,) = ToolCallParser(DEEPSEEK).push(block(DEEPSEEK, call_text(
        DEEPSEEK, "f", '{ "z" : 1 , "a" : [ true , null ] , "é" : "ü\\n" }')))[1]
    assert call.arguments_json == '{"z":1,"a":[true,null],"é":"ü\\n"}'
    assert json.loads(call.arguments_json) == {"z": 1, "a": [True, None], "é": "ü\n"}


def test_with_tool_names_an_unknown_name_is_text():
    text = block(DEEPSEEK, call_text(DEEPSEEK, "other", "{}"))
    assert run(ToolCallParser(DEEPSEEK, tool_names={"f"}), [text]) == (text, [])
    assert run(ToolCallParser(DEEPSEEK, tool_names={"other"}), [text]) == ("", [("other", "{}")])


def test_a_family_without_a_tool_format_cannot_parse():
    with pytest.raises(InvalidRequestError, match="model family 'plain' has none"):
        ToolCallParser(ModelFamily("plain"))
    with pytest.raises(InvalidRequestError, match="family is unknown"):
        ToolCallParser(None)


def deltas_by_call(parser: ToolCallParser, pieces) -> tuple[list, dict[int, list]]:
    """The whole calls, and each call's deltas (by index), pushing `pieces` one by one."""
    calls, by_index = [], {}
    for piece in [*pieces, None]:
        _, found = parser.push(piece) if piece is not None else parser.finish()
        for d in parser.take_deltas():
            assert d.index not in {i for i, _ in enumerate(calls)}, "a call's pieces come no later than the call"
            by_index.setdefault(d.index, []).append(d)
        calls += found
    return calls, by_index


@pytest.mark.parametrize("family, text, content, calls", CASES)
def test_streamed_deltas_make_up_each_call(family, text, content, calls):
    # Every split: one push per character, and the whole text at once.
    for pieces in (list(text), [text]):
        found, by_index = deltas_by_call(ToolCallParser(family), pieces)
        assert [(c.name, c.arguments_json) for c in found] == calls
        for i, c in enumerate(found):
            first, *rest = by_index[i]
            assert (first.id, first.name, first.arguments_fragment) == (c.id, c.name, "")
            assert all(not d.id and not d.name for d in rest)
            assert json.loads("".join(d.arguments_fragment for d in rest)) == json.loads(c.arguments_json)


def test_arguments_arrive_in_pieces_as_they_are_written():
    text = block(DEEPSEEK, call_text(DEEPSEEK, "f", '{"s":"a<｜tool▁call▁end｜>b","n":[1,2]}'))
    parser = ToolCallParser(DEEPSEEK)
    pieces = []
    for ch in text:
        parser.push(ch)
        pieces += [d.arguments_fragment for d in parser.take_deltas() if d.arguments_fragment]
    assert len(pieces) > 10, "the arguments stream as they arrive, not in one piece at the end"
    assert "".join(pieces) == '{"s":"a<｜tool▁call▁end｜>b","n":[1,2]}'


def test_a_call_cut_off_gives_its_pieces_so_far_and_returns_its_markup_as_content():
    text = 'x<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a":'
    parser = ToolCallParser(DEEPSEEK)
    content, calls = parser.push(text)
    rest, more = parser.finish()
    deltas = parser.take_deltas()
    assert (content + rest, calls + more) == (text, [])
    assert deltas[0].name == "f" and "".join(d.arguments_fragment for d in deltas) == '{"a":'


def _parse_seconds(family: ModelFamily, characters: int) -> float:
    """CPU seconds to parse one call whose code argument has about `characters` characters, 4 at a time."""
    code = "".join(f"fn f{i}() {{ if (x) {{ return {{a: {i}}}; }} }}\n" for i in range(characters // 40))
    text = block(family, call_text(family, "f", json.dumps({"code": code})))
    best = math.inf
    for _ in range(2):
        parser, calls, start = ToolCallParser(family), [], time.process_time()
        for at in range(0, len(text), 4):
            calls += parser.push(text[at:at + 4])[1]
        calls += parser.finish()[1]
        best = min(best, time.process_time() - start)
        assert json.loads(calls[0].arguments_json) == {"code": code}
    return best


@pytest.mark.parametrize("family", [pytest.param(LLAMA3, id="llama3"), pytest.param(DEEPSEEK, id="deepseek")])
def test_a_long_argument_streamed_costs_time_in_proportion_to_its_length(family):
    # A ratio of one run, not a time: four times the text may cost at most about four times as much (linear),
    # where re-reading the arguments per token made it 16 times (quadratic) or, with Llama 3's "}" marker, 64.
    assert _parse_seconds(family, 64_000) < 8 * _parse_seconds(family, 16_000)
