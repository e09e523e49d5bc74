"""Tool calls whose arguments are parameter tags (Qwen3-Coder, GLM, MiniMax, DeepSeek DSML) read back as JSON.

xgrammar's XML styles write a value as raw text where its property takes a
string and as JSON otherwise; the parser must give the client the JSON
object the model meant ("5" for an integer property is 5, for a string
property "5"), the same whether the text arrives whole or a character at a
time, and its streamed fragments must add up to the call's arguments.
"""

from __future__ import annotations

import json

import pytest

from inference_svc.api.model_family import ModelFamilyError, load_family, parse_family
from inference_svc.api.tool_calls import ToolCallParser

QWEN_CODER = load_family("qwen3_coder")
GLM = load_family("glm")
MINIMAX = load_family("minimax")
DSML = load_family("deepseek_v32")

SCHEMA = {"type": "object", "$defs": {"N": {"type": "integer"}}, "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]},
    "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]}, "scale": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}}, "flag": {"type": ["boolean", "null"]},
    "ref": {"$ref": "#/$defs/N"}, "all": {"allOf": [{"type": "integer"}, {"minimum": 0}]},
    "code": {"type": "string"}, "short": {"type": "string", "maxLength": 4}, "a>b": {"type": "string"}}}


def qwen_call(name: str, *params: tuple[str, str]) -> str:
    """A call as Qwen3-Coder's chat template writes it: each value on its own line."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(family, text: str, split: bool = False) -> tuple[str, list[tuple[str, dict]], dict[int, str]]:
    parser = ToolCallParser(family, ["get_weather", "f"], {"get_weather": SCHEMA, "f": {"type": "object"}})
    content, calls, streamed = [], [], {}
    for piece in [*(list(text) if split else [text]), None]:
        out, found = parser.push(piece) if piece is not None else parser.finish()
        content.append(out)
        calls += [(c.name, c.arguments_json) for c in found]
        for d in parser.take_deltas():
            streamed[d.index] = streamed.get(d.index, "") + d.arguments_fragment
    for i, (_, arguments) in enumerate(calls):
        assert streamed[i] == arguments  # the fragments make up the call's arguments exactly
    return "".join(content), [(n, json.loads(a)) for n, a in calls], streamed


TYPED = [
    pytest.param(("city", "Paris"), {"city": "Paris"}, id="string"),
    pytest.param(("city", "5"), {"city": "5"}, id="digits-in-a-string-property-stay-text"),
    pytest.param(("city", '"quoted"'), {"city": '"quoted"'}, id="quotes-in-a-string-are-text"),
    pytest.param(("city", "a </function> b"), {"city": "a </function> b"}, id="call-end-inside-a-string"),
    pytest.param(("days", "5"), {"days": 5}, id="integer"),
    pytest.param(("unit", "c"), {"unit": "c"}, id="enum-of-strings-is-text"),
    pytest.param(("either", "7"), {"either": 7}, id="string-or-integer-takes-the-integer"),
    pytest.param(("either", "seven"), {"either": "seven"}, id="string-or-integer-takes-text"),
    pytest.param(("scale", "2"), {"scale": 2}, id="integer-for-a-number"),
    pytest.param(("tags", '["a", "b"]'), {"tags": ["a", "b"]}, id="array"),
    pytest.param(("flag", "null"), {"flag": None}, id="null"),
    pytest.param(("other", "[1, 2]"), {"other": [1, 2]}, id="undeclared-array-is-json"),
    pytest.param(("other", "12"), {"other": "12"}, id="undeclared-scalar-is-text"),
    pytest.param(("ref", "5"), {"ref": 5}, id="ref-to-an-integer"),
    pytest.param(("all", "5"), {"all": 5}, id="allof-integer"),
    pytest.param(("code", "    def f():\n        pass\n"), {"code": "    def f():\n        pass\n"},
                 id="code-keeps-its-indentation-and-last-newline"),
    pytest.param(("short", "  ab  "), {"short": "ab"}, id="bounded-string-whitespace-is-layout"),
    pytest.param(("a>b", "x"), {"a>b": "x"}, id="declared-name-with-a-bracket"),
    pytest.param(("scale", "1e400"), {"scale": "1e400"}, id="number-past-json-stays-text"),
]


@pytest.mark.parametrize("param, expected", TYPED)
@pytest.mark.parametrize("split", [pytest.param(False, id="whole"), pytest.param(True, id="char-by-char")])
def test_qwen_values_are_read_by_their_propertys_type(param, expected, split):
    content, calls, _ = parse(QWEN_CODER, "Checking. " + qwen_call("get_weather", param), split)
    assert content == "Checking. "
    assert calls == [("get_weather", expected)]


FAMILY_CALLS = [
    pytest.param(GLM, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                      "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", id="glm"),
    pytest.param(MINIMAX, '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                          '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>', id="minimax"),
    pytest.param(DSML, '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
                       '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                       '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
                       '</｜DSML｜invoke>\n</｜DSML｜function_calls>', id="deepseek-dsml"),
]


@pytest.mark.parametrize("family, text", FAMILY_CALLS)
@pytest.mark.parametrize("split", [pytest.param(False, id="whole"), pytest.param(True, id="char-by-char")])
def test_each_xml_family_reads_its_documented_form(family, text, split):
    content, calls, _ = parse(family, text, split)
    assert (content, calls) == ("", [("get_weather", {"city": "Paris", "days": 3})])


def test_glm_raw_values_keep_their_whitespace():
    """GLM's template writes no layout inside <arg_value>: a plain string's spaces and newlines are its own."""
    text = "<tool_call>get_weather<arg_key>code</arg_key><arg_value>  x = 1\n</arg_value></tool_call>"
    assert parse(GLM, text)[1] == [("get_weather", {"code": "  x = 1\n"})]


def test_dsml_says_which_values_are_text():
    """DeepSeek's string= attribute decides, not the schema: a JSON number written as string="true" is text."""
    text = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n'
            '<｜DSML｜parameter name="a" string="true">3</｜DSML｜parameter>'
            '<｜DSML｜parameter name="b" string="false">{"x": [1]}</｜DSML｜parameter>'
            '</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    assert parse(DSML, text)[1] == [("f", {"a": "3", "b": {"x": [1]}})]


def test_a_call_without_parameters_is_an_empty_object():
    assert parse(QWEN_CODER, qwen_call("f"))[1:] == ([("f", {})], {0: "{}"})
    assert parse(GLM, "<tool_call>f</tool_call>")[1] == [("f", {})]


def test_parameters_stream_one_by_one_as_each_closes():
    parser = ToolCallParser(QWEN_CODER, ["get_weather"], {"get_weather": SCHEMA})
    text = qwen_call("get_weather", ("city", "Paris"), ("days", "3"))
    fragments = []
    for ch in text:
        parser.push(ch)
        fragments += [d.arguments_fragment for d in parser.take_deltas() if d.arguments_fragment]
    assert fragments == ['{"city":"Paris"', ',"days":3', "}"]


def test_text_that_is_not_a_call_stays_content():
    text = "<tool_call>\n<function=get_weather>\nnot a parameter"
    assert parse(QWEN_CODER, text)[:2] == (text, [])
    unknown = qwen_call("send_email", ("to", "x"))
    assert parse(QWEN_CODER, unknown)[:2] == (unknown, [])


def test_a_written_call_reads_back_as_its_arguments():
    """call_text writes JSON arguments as the family's parameter tags; the parser reads them back."""
    arguments = '{"city":"Paris","days":3,"tags":["a"],"flag":true}'
    for family in (QWEN_CODER, GLM, MINIMAX, DSML):
        fmt = family.tool_calls
        text = fmt.block_begin + fmt.call_text("get_weather", arguments) + fmt.block_end
        assert parse(family, text)[1] == [("get_weather", json.loads(arguments))], family.name


BAD_ARGUMENTS = [
    pytest.param({"style": "yaml", "parameter_begin": "<p={key}>", "parameter_end": "</p>"}, "style", id="style"),
    pytest.param({"style": "qwen_xml", "parameter_begin": "<p>", "parameter_end": "</p>"}, "{key}", id="no-key"),
    pytest.param({"style": "qwen_xml", "parameter_begin": "<p={key}>"}, "parameter_end", id="no-end"),
    pytest.param({"style": "qwen_xml", "parameter_begin": "{string}<p={key}>", "parameter_end": "</p>"}, "{string}",
                 id="string-before-key"),
]


@pytest.mark.parametrize("arguments, named", BAD_ARGUMENTS)
def test_a_bad_arguments_field_is_refused_naming_it(arguments, named):
    data = {"name": "x", "tool_calls": {"call_begin": "<c={name}>", "call_end": "</c>", "arguments": arguments}}
    with pytest.raises(ModelFamilyError, match="tool_calls.arguments") as e:
        parse_family(data, "x.json")
    assert named in str(e.value)


def test_the_parameter_tags_are_markup_that_decoding_keeps():
    """GLM's <arg_key> and <arg_value> are special tokens of its tokenizer: they must stay in the answer's text."""
    tokens = {1: "<arg_key>", 2: "</arg_value>", 3: "<tool_call>", 4: "hello"}
    assert GLM.markup_ids(tokens) == {1, 2, 3}


def test_the_templates_layout_is_in_the_grammar_and_endless_whitespace_is_not(xgr_tokenizer_info):
    """Qwen3-Coder's template puts each value on its own line: the grammar takes that, and whitespace inside a
    text value, but not a run of whitespace between tags past MAX_XML_WHITESPACE (a model writing blanks there
    would never finish its call)."""
    import xgrammar as xgr

    from grammar_svc.compile.spec import GrammarSpec, compile_spec
    from grammar_svc.types import Kind
    from inference_svc.api.tool_calls import MAX_XML_WHITESPACE, ToolChoice, ToolSpec, tool_call_structural_tag

    tag = tool_call_structural_tag(QWEN_CODER, [ToolSpec("get_weather", "", SCHEMA)], ToolChoice("required"))
    grammar = compile_spec(xgr.GrammarCompiler(xgr_tokenizer_info), GrammarSpec(Kind.STRUCTURAL_TAG, json.dumps(tag)))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(grammar)
        return matcher.accept_string(text) and matcher.is_completed()

    assert accepts(qwen_call("get_weather", ("city", "Paris"), ("days", "3")))
    assert accepts(qwen_call("get_weather", ("city", "Pa" + " " * 12 + "ris")))
    assert not accepts(qwen_call("get_weather", ("days", " " * (MAX_XML_WHITESPACE + 1) + "3")))
