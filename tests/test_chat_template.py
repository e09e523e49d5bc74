"""Chat templates: the embedded model's DeepSeek-V3.1-style template on the real tokenizer, overrides, and errors."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from inference_svc.api.chat import NO_TEMPLATE, ChatMessage, ChatTemplate, ChatTemplateError
from inference_svc.model.embedded_model import CHAT_TEMPLATE, EmbeddedModelSpec, ensure_embedded_model
from inference_svc.api.model_family import load_family
from inference_svc.api.tool_calls import ToolCallParser, ToolSpec
from inference_svc.types import ParsedToolCall
from shared.errors import InvalidRequestError

BOS, USER, ASSISTANT, THINK, END_THINK, EOS = 0, 128803, 128804, 128821, 128822, 1
WEATHER = ToolSpec("get_weather", "The weather now", {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CALL = ParsedToolCall("call_0123456789abcdef01234567", "get_weather", '{"city":"Paris"}')
TOOL_CONVERSATION = (
    ChatMessage("system", "Be brief."),
    ChatMessage("user", "Weather in Paris and Rome?"),
    ChatMessage("assistant", "Checking.", tool_calls=(CALL, ParsedToolCall("call_1", "get_weather", '{"city":"Rome"}'))),
    ChatMessage("tool", '{"celsius":21}', tool_call_id=CALL.id),
    ChatMessage("tool", '{"celsius":25}', tool_call_id="call_1"),
)


@pytest.fixture(scope="module")
def template(hf_tokenizer) -> ChatTemplate:
    return ChatTemplate.load(hf_tokenizer, CHAT_TEMPLATE)


def test_a_conversation_renders_in_deepseek_v31_format(template):
    text = template.render([ChatMessage("system", "You are terse."), ChatMessage("user", "Hi"),
                            ChatMessage("assistant", "Hello.", reasoning_content="greet back"),
                            ChatMessage("user", "Bye")])
    assert text == ("<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hi<｜Assistant｜></think>Hello.<｜end▁of▁sentence｜>"
                    "<｜User｜>Bye<｜Assistant｜></think>")  # past thinking is not rendered, as in DeepSeek-V3.1


@pytest.mark.parametrize("reasoning, last_ids", [
    pytest.param(None, [ASSISTANT, END_THINK], id="default-off"),
    pytest.param(False, [ASSISTANT, END_THINK], id="off"),
    pytest.param(True, [ASSISTANT, THINK], id="on-ends-with-think-start"),
])
def test_thinking_decides_the_generation_prompt_tokens(template, hf_tokenizer, reasoning, last_ids):
    ids = hf_tokenizer.encode(template.render([ChatMessage("user", "2+2?")], reasoning=reasoning))
    assert ids[0] == BOS and ids[1] == USER
    assert ids[-2:] == last_ids
    assert ids.count(THINK) + ids.count(END_THINK) == 1


def test_tools_and_tool_call_history(template, hf_tokenizer):
    text = template.render(TOOL_CONVERSATION, tools=[WEATHER])
    system = text[len("<｜begin▁of▁sentence｜>"):text.index("<｜User｜>")]
    assert system.startswith("Be brief.\n\n## Tools\n")
    assert ('### get_weather\nDescription: The weather now\n\nParameters: {"type": "object", "properties": '
            '{"city": {"type": "string"}}, "required": ["city"]}') in system
    assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>" in system  # the format it is taught
    assert text.endswith(
        "<｜User｜>Weather in Paris and Rome?<｜Assistant｜></think>Checking.<｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris"}<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
        '<｜end▁of▁sentence｜><｜tool▁output▁begin｜>{"celsius":21}<｜tool▁output▁end｜>'
        '<｜tool▁output▁begin｜>{"celsius":25}<｜tool▁output▁end｜>')  # after tool results the model goes on: no prompt
    ids = hf_tokenizer.encode(text)
    assert [128806, 128808] == ids[ids.index(128806):ids.index(128806) + 2]  # markup is the tokenizer's own tokens
    assert ids[-1] == 128813


def test_rendered_tool_calls_are_in_the_deepseek_family_format(template):
    """What the template writes for past calls is what the family's parser reads (and the grammar makes)."""
    text = template.render(TOOL_CONVERSATION, tools=[WEATHER])
    turn = text[text.index("<｜Assistant｜></think>") + len("<｜Assistant｜></think>"):text.index("<｜end▁of▁sentence｜>")]
    content, calls = ToolCallParser(load_family("deepseek")).push(turn)
    assert content == "Checking."
    assert [(c.name, c.arguments_json) for c in calls] == [("get_weather", '{"city":"Paris"}'),
                                                           ("get_weather", '{"city":"Rome"}')]


def test_message_text_is_data_not_template_code(template):
    text = template.render([ChatMessage("user", "{{ 7 * 7 }}{% raise %}")])
    assert "<｜User｜>{{ 7 * 7 }}{% raise %}<｜Assistant｜>" in text


def test_the_embedded_model_directory_carries_the_template(tmp_path):
    tiny = EmbeddedModelSpec(name="chat-tiny", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=32)
    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model(tmp_path, tiny, progress=None))
    assert tokenizer.chat_template == CHAT_TEMPLATE.read_text()
    own = ChatTemplate.load(tokenizer)
    assert own.available
    assert own.render([ChatMessage("user", "Hi")], reasoning=True).endswith("<｜User｜>Hi<｜Assistant｜><think>")


def write(tmp_path, text: str, name: str = "template.jinja"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_an_override_replaces_the_template_and_sees_both_thinking_names(tmp_path, hf_tokenizer):
    path = write(tmp_path, "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"
                           "{% if add_generation_prompt %}>{{ thinking }}/{{ enable_thinking }}{% endif %}")
    template = ChatTemplate.load(hf_tokenizer, path)
    assert template.origin == str(path)
    assert template.render([ChatMessage("user", "a")], reasoning=True) == "[user:a]>True/True"
    # Unset reasoning passes neither name: the template's own default applies.
    assert template.render([ChatMessage("user", "a")]) == "[user:a]>/"


def test_named_templates_pick_tool_use_for_requests_with_tools(hf_tokenizer):
    template = ChatTemplate(hf_tokenizer, {"default": "plain", "tool_use": "with {{ tools | length }} tools"}, "dict")
    assert template.render([ChatMessage("user", "a")]) == "plain"
    assert template.render([ChatMessage("user", "a")], tools=[WEATHER]) == "with 1 tools"
    no_default = ChatTemplate(hf_tokenizer, {"rag": "x"}, "dict")
    with pytest.raises(InvalidRequestError, match=r"chat templates \(rag\) include no default one"):
        no_default.render([ChatMessage("user", "a")])


def test_a_tokenizer_without_a_template(hf_tokenizer):
    template = ChatTemplate.load(hf_tokenizer)  # the bare DeepSeek tokenizer has none
    assert not template.available
    with pytest.raises(InvalidRequestError) as e:
        template.render([ChatMessage("user", "a")])
    assert str(e.value) == NO_TEMPLATE


@pytest.mark.parametrize("messages, message", [
    pytest.param([], "messages is empty: give at least one message", id="empty"),
    pytest.param([ChatMessage("robot", "a")], "messages[0]: unknown role 'robot' (use one of system, user, assistant, "
                 "tool)", id="unknown-role"),
    pytest.param([ChatMessage("user", "a", tool_calls=(CALL,))], "messages[0]: only assistant messages carry "
                 "tool_calls, not user", id="tool-calls-on-user"),
])
def test_bad_messages_are_refused(template, messages, message):
    with pytest.raises(InvalidRequestError) as e:
        template.render(messages)
    assert str(e.value) == message


@pytest.mark.parametrize("source, message", [
    pytest.param("{{ raise_exception('a system message is required') }}",
                 "the chat template cannot render these messages: a system message is required", id="raise-exception"),
    pytest.param("{{ messages[0].content + 1 }}",
                 "the chat template cannot render these messages: TypeError: can only concatenate str",
                 id="type-error-in-template"),
    pytest.param("{{ ''.__class__.__mro__ }}",
                 "the chat template cannot render these messages: access to attribute '__class__' of 'str' object "
                 "is unsafe", id="sandbox-escape-refused"),
    pytest.param("{{ messages[5].content.upper() }}",
                 "the chat template cannot render these messages: list object has no element 5",
                 id="undefined-message"),
])
def test_template_failures_become_invalid_requests_quoting_the_template(tmp_path, hf_tokenizer, source, message):
    template = ChatTemplate.load(hf_tokenizer, write(tmp_path, source))
    with pytest.raises(InvalidRequestError) as e:
        template.render([ChatMessage("user", "a")])
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("content, message", [
    pytest.param(None, "cannot read it", id="missing"),
    pytest.param("  \n", "the file is empty", id="empty"),
    pytest.param("{% for m in messages %}", "line 1: Unexpected end of template", id="syntax-error"),
])
def test_an_unusable_override_fails_at_load_naming_the_file(tmp_path, hf_tokenizer, content, message):
    path = tmp_path / "t.jinja" if content is None else write(tmp_path, content, "t.jinja")
    with pytest.raises(ChatTemplateError) as e:
        ChatTemplate.load(hf_tokenizer, path)
    assert f"--chat-template {path}" in str(e.value) and message in str(e.value)
