"""Model families as data: the bundled files, detection from a vocabulary, and the errors of a bad file."""

from __future__ import annotations

import json

import pytest

from inference_svc.api.model_family import (
    ModelFamily,
    ModelFamilyError,
    ToolCallFormat,
    bundled_names,
    detect_family,
    load_family,
)

DEEPSEEK_TOOL_TOKENS = {"<｜tool▁calls▁begin｜>": 128806, "<｜tool▁calls▁end｜>": 128807,
                        "<｜tool▁call▁begin｜>": 128808, "<｜tool▁call▁end｜>": 128809, "<｜tool▁sep｜>": 128814}
QWEN_TOKENS = {"<tool_call>": 151657, "</tool_call>": 151658, "<think>": 151667, "</think>": 151668}


def test_bundled_families_load():
    assert bundled_names() == ["deepseek", "deepseek_r1", "deepseek_v32", "deepseek_v4", "deepseek_v41", "exaone", "glm",
                               "gpt_oss", "kimi_k2", "llama3", "mimo", "minimax", "qwen", "qwen3_coder"]
    deepseek = load_family("deepseek")
    assert (deepseek.think_start, deepseek.think_end) == ("<think>", "</think>")
    assert deepseek.tool_calls == ToolCallFormat(
        block_begin="<｜tool▁calls▁begin｜>", call_begin="<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>",
        call_end="<｜tool▁call▁end｜>", separator="", block_end="<｜tool▁calls▁end｜>")
    assert deepseek.tool_calls.begin_for("f") == "<｜tool▁call▁begin｜>f<｜tool▁sep｜>"
    assert deepseek.tool_calls.trigger == "<｜tool▁calls▁begin｜>"
    qwen = load_family("qwen")
    assert qwen.tool_calls.begin_for("f") == '<tool_call>\n{"name": "f", "arguments": '
    assert qwen.tool_calls.trigger == '<tool_call>\n{"name": "'  # no block: a call's own start marks it


def test_the_real_deepseek_vocabulary_is_detected_as_deepseek(hf_tokenizer):
    vocab = hf_tokenizer.get_vocab()
    family = detect_family(vocab)
    assert family is not None and family.name == "deepseek"
    assert family.think_token_ids(vocab) == (128821, 128822)


@pytest.mark.parametrize("vocab, expected", [
    pytest.param(QWEN_TOKENS, "qwen", id="qwen-tokens"),
    pytest.param({**QWEN_TOKENS, **DEEPSEEK_TOOL_TOKENS}, "deepseek", id="both-deepseek-first"),
    pytest.param({"<tool_call>": 1, "<think>": 2}, None, id="incomplete-qwen"),
    pytest.param({"hello": 0}, None, id="plain-vocabulary"),
])
def test_detection_needs_every_listed_token_and_takes_the_first_family(vocab, expected):
    family = detect_family(vocab)
    assert (family.name if family else None) == expected


def test_think_ids_need_both_markers_as_tokens():
    family = load_family("qwen")
    assert family.think_token_ids(QWEN_TOKENS) == (151667, 151668)
    assert family.think_token_ids({"<tool_call>": 1, "</tool_call>": 2, "<think>": 3}) is None  # Qwen2.5: no think
    assert ModelFamily("plain").think_token_ids(QWEN_TOKENS) is None


def test_a_family_file_given_by_path(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "tool_calls": {"call_begin": "[[{name}]]", "call_end": "[[/]]"}}))
    family = load_family(str(path))
    assert family == ModelFamily("mine", tool_calls=ToolCallFormat(call_begin="[[{name}]]", call_end="[[/]]"))
    assert family.tool_calls.trigger == "[["


VALID_TOOLS = {"call_begin": "<c>{name}:", "call_end": "</c>"}


@pytest.mark.parametrize("content, message", [
    pytest.param("{", "not valid JSON", id="not-json"),
    pytest.param("[]", "the file must be a JSON object", id="not-an-object"),
    pytest.param({"tool_calls": VALID_TOOLS}, "field 'name' is required", id="no-name"),
    pytest.param({"name": "x", "colour": "red"}, "unknown field 'colour'", id="unknown-field"),
    pytest.param({"name": "x", "think": {"start": "<t>"}}, "'think.start' and 'think.end' are both required",
                 id="half-think"),
    pytest.param({"name": "x", "think": {"start": "<t>", "stop": "</t>"}}, "unknown field 'think.stop'",
                 id="think-typo"),
    pytest.param({"name": "x", "detect_tokens": "abc"}, "field 'detect_tokens' must be a list", id="detect-not-list"),
    pytest.param({"name": "x", "detect_tokens": [""]}, "list of non-empty strings", id="detect-empty-string"),
    pytest.param({"name": "x", "tool_calls": {"call_begin": "<c>", "call_end": "</c>"}},
                 "must contain {name} exactly once", id="no-name-placeholder"),
    pytest.param({"name": "x", "tool_calls": {"call_begin": "<c>{name}", "call_end": "</c>"}},
                 "must have text after {name}", id="name-runs-into-arguments"),
    pytest.param({"name": "x", "tool_calls": {"call_begin": "<c>{name}{index}:", "call_end": "</c>"}},
                 "must have text after {name}", id="name-runs-into-index"),
    pytest.param({"name": "x", "tool_calls": {"call_begin": "<c>{index}:{name}:", "call_end": "</c>"}},
                 "{index} may appear once, in 'tool_calls.call_begin' after {name}", id="index-before-name"),
    pytest.param({"name": "x", "tool_calls": {"call_begin": "<c>{name}:{index}:{index}", "call_end": "</c>"}},
                 "{index} may appear once", id="two-indexes"),
    pytest.param({"name": "x", "tool_calls": {**VALID_TOOLS, "call_end": "</c{index}>"}},
                 "{index} may appear once, in 'tool_calls.call_begin'", id="index-in-call-end"),
    pytest.param({"name": "x", "tool_calls": {"call_begin": "{name}:", "call_end": "</c>"}},
                 "must start with text before {name}", id="nothing-marks-a-call"),
    pytest.param({"name": "x", "tool_calls": {**VALID_TOOLS, "block_begin": "<b>"}},
                 "'tool_calls.block_begin' and 'tool_calls.block_end' go together", id="half-block"),
    pytest.param({"name": "x", "tool_calls": {"call_begin": "<c>{name}:"}}, "'tool_calls.call_end' is required",
                 id="no-call-end"),
    pytest.param({"name": "x", "tool_calls": {**VALID_TOOLS, "separator": 1}},
                 "field 'tool_calls.separator' must be a string, got int", id="wrong-type"),
])
def test_a_bad_family_file_is_refused_naming_the_file_and_field(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ModelFamilyError) as e:
        load_family(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)


def test_an_unknown_family_name_lists_the_bundled_ones():
    with pytest.raises(ModelFamilyError, match="unknown model family 'llama9': give one of deepseek, deepseek_r1, "):
        load_family("llama9")
