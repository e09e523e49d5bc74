"""The chat side of inference.v1 through the real server: messages, token-id prompts, reasoning, JSON options, tools.

The embedded model ships a DeepSeek-V3.1-style chat template on the real
DeepSeek tokenizer, so rendering, thinking and tool calls run on the real
special tokens. Its weights are random: only the grammar gives the answer a
structure, and greedy decoding makes two runs of one prompt comparable.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from shared.gen.inference.v1 import inference_service_pb2 as pb
from tests.conftest import inference_stub

THINK_END = "</think>"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [pb.Tool(name="get_weather", description="Weather forecast for a city",
                 parameters_json_schema=json.dumps(WEATHER)),
         pb.Tool(name="get_time", description="Current time", parameters_json_schema=json.dumps(CLOCK))]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 99}},
          "required": ["ok", "n"]}
CHAT = [pb.ChatMessage(role="system", content="You are terse."), pb.ChatMessage(role="user", content="Weather?")]


@pytest.fixture(scope="module")
def stub(inference_server):
    with inference_stub(inference_server.target) as stub:
        yield stub


@pytest.fixture(scope="module")
def template_tokenizer(inference_server):
    """The served model's own tokenizer, with the chat template it carries."""
    from transformers import AutoTokenizer

    from inference_svc.model.embedded_model import ensure_embedded_model

    return AutoTokenizer.from_pretrained(str(ensure_embedded_model()))


def generate(stub, **fields) -> tuple[list[pb.GenerateResponse], pb.GenerateResponse]:
    fields.setdefault("sampling", pb.SamplingParams(max_tokens=12, temperature=0))
    responses = list(stub.Generate(pb.GenerateRequest(**fields), timeout=120))
    return responses, responses[-1]


def joined(responses, field: str):
    if field in ("text", "reasoning_text"):
        return "".join(getattr(r, field) for r in responses)
    return [x for r in responses for x in getattr(r, field)]


def status_of(stub, **fields) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, **fields)
    return e.value.code(), e.value.details()


def test_model_info_names_the_model_its_template_and_family(stub):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_id == "structd-tiny-llama"
    assert info.has_chat_template and info.model_family == "deepseek"
    assert info.vocab_size == 129280 and info.max_model_len > 0 and info.loaded_unix_seconds > 0


def test_messages_prompt_and_token_ids_give_the_same_tokens(stub, template_tokenizer):
    messages = [{"role": m.role, "content": m.content} for m in CHAT]
    rendered = template_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = template_tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == template_tokenizer.bos_token_id  # the template spells out its BOS: none is added
    by_messages = joined(generate(stub, messages=CHAT)[0], "token_ids")
    by_ids = joined(generate(stub, prompt_token_ids=ids)[0], "token_ids")
    by_text = joined(generate(stub, prompt=rendered)[0], "token_ids")
    assert len(by_messages) == 12 and by_messages == by_ids == by_text


@pytest.mark.parametrize("fields, needle", [
    pytest.param({}, "exactly one of prompt, messages and prompt_token_ids", id="no-input"),
    pytest.param({"prompt": "x", "prompt_token_ids": [5]}, "exactly one", id="prompt-and-ids"),
    pytest.param({"prompt": "x", "messages": CHAT}, "exactly one", id="prompt-and-messages"),
    pytest.param({"prompt_token_ids": [5, 129280]}, "129280 is not a token id", id="id-past-vocab"),
    pytest.param({"prompt_token_ids": [-1]}, "-1 is not a token id", id="negative-id"),
    pytest.param({"messages": [pb.ChatMessage(role="wizard", content="hi")]}, "wizard", id="unknown-role"),
    pytest.param({"prompt": "Hi", "tools": TOOLS}, "tools need messages", id="tools-without-messages"),
    pytest.param({"messages": CHAT, "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)},
                 "needs tools", id="required-without-tools"),
    pytest.param({"messages": CHAT, "tools": TOOLS,
                  "tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NAMED, name="nope")}, "nope",
                 id="named-tool-missing"),
    pytest.param({"messages": CHAT, "tools": [pb.Tool(name="bad name!")]}, "bad name!", id="bad-tool-name"),
    pytest.param({"messages": CHAT, "tools": TOOLS, "tool_choice": pb.ToolChoice(
        mode=pb.TOOL_CHOICE_MODE_AUTO, allowed_tools=["nope"])}, "allowed_tools names 'nope'",
        id="allowed-tool-missing"),
    pytest.param({"messages": CHAT, "chat_template_kwargs_json": '{"messages": 1}'},
                 "'messages' is one of the chat template's own variables", id="template-kwarg-collides"),
    pytest.param({"messages": CHAT, "chat_template_kwargs_json": "[1]"}, "chat_template_kwargs must be a JSON object",
                 id="template-kwargs-not-an-object"),
    pytest.param({"messages": CHAT, "chat_template_kwargs_json": '{"a b": 1}'}, "not a template variable name",
                 id="template-kwarg-name"),
    pytest.param({"messages": CHAT, "tools": [pb.Tool(name="t", parameters_json_schema="{")]},
                 "tool 't': parameters is not valid JSON", id="tool-schema-not-json"),
    pytest.param({"prompt": "Hi", "reasoning": True}, "does not open a think block", id="reasoning-raw-prompt"),
    pytest.param({"prompt": "Hi", "constraint": pb.Constraint(regex="a+", json_options=pb.JsonOptions(indent=2))},
                 "json_options apply to json_schema and json_object only", id="json-options-on-regex"),
    pytest.param({"prompt": "Hi", "constraint": pb.Constraint(json_object=True, json_options=pb.JsonOptions(
        whitespace=pb.JSON_WHITESPACE_FLEXIBLE, max_whitespace_count=1000))}, "max_whitespace_count",
        id="whitespace-bound-too-large"),
])
def test_bad_input_is_invalid_argument_naming_the_problem(stub, fields, needle):
    code, details = status_of(stub, **fields)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert needle in details


def test_reasoning_ends_exactly_at_the_thinking_budget_and_the_answer_validates(stub, template_tokenizer):
    budget = 7
    responses, last = generate(
        stub, messages=CHAT, reasoning=True, max_thinking_tokens=budget,
        constraint=pb.Constraint(json_schema=json.dumps(ANSWER)),
        sampling=pb.SamplingParams(max_tokens=80, temperature=0))
    ids = joined(responses, "token_ids")
    end = template_tokenizer.convert_tokens_to_ids(THINK_END)
    assert ids.index(end) == budget  # budget thinking tokens, then the forced end of thinking
    assert last.usage.reasoning_tokens == budget + 1
    assert last.finish_reason == pb.FINISH_REASON_STOP
    thought = joined(responses, "reasoning_text")
    assert thought == template_tokenizer.decode(ids[:budget], skip_special_tokens=True)
    jsonschema.validate(json.loads(joined(responses, "text")), ANSWER)


def test_thinking_that_runs_out_of_tokens_has_no_answer(stub):
    responses, last = generate(stub, messages=CHAT, reasoning=True,
                               constraint=pb.Constraint(json_schema=json.dumps(ANSWER)))
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert joined(responses, "text") == "" and joined(responses, "reasoning_text")
    assert last.usage.reasoning_tokens == last.usage.completion_tokens == 12


def test_reasoning_off_is_the_templates_default_and_answers_at_once(stub):
    responses, last = generate(stub, messages=CHAT, constraint=pb.Constraint(json_schema=json.dumps(ANSWER)),
                               sampling=pb.SamplingParams(max_tokens=40, temperature=0))
    assert last.usage.reasoning_tokens == 0 and joined(responses, "reasoning_text") == ""
    jsonschema.validate(json.loads(joined(responses, "text")), ANSWER)


@pytest.mark.parametrize("options, layout", [
    pytest.param(pb.JsonOptions(), lambda v: json.dumps(v, separators=(",", ":")), id="compact-default"),
    pytest.param(pb.JsonOptions(whitespace=pb.JSON_WHITESPACE_INDENTED, indent=3),
                 lambda v: json.dumps(v, indent=3), id="indented-3"),
])
def test_json_options_lay_out_the_answer_as_documented(stub, options, layout):
    responses, _ = generate(stub, prompt="JSON:", sampling=pb.SamplingParams(max_tokens=60, temperature=0),
                            constraint=pb.Constraint(json_schema=json.dumps(ANSWER), json_options=options))
    text = joined(responses, "text")
    value = json.loads(text)
    jsonschema.validate(value, ANSWER)
    assert text == layout(value)


@pytest.mark.parametrize("choice, names", [
    pytest.param(pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), set(SCHEMAS), id="required"),
    pytest.param(pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NAMED, name="get_time"), {"get_time"}, id="named"),
])
def test_tool_calls_come_back_parsed_and_valid(stub, choice, names):
    responses, last = generate(stub, messages=CHAT, tools=TOOLS, tool_choice=choice,
                               sampling=pb.SamplingParams(max_tokens=120, temperature=0.8, seed=3))
    calls = joined(responses, "tool_calls")
    assert calls and last.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert joined(responses, "text") == ""  # no markup leaks into the text
    for call in calls:
        assert call.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("seed", [3, 4])
def test_tool_call_deltas_make_up_each_whole_call(stub, seed):
    """gRPC clients keep whole calls in tool_calls; tool_call_deltas give the same calls in pieces, each call's
    last piece no later than the call itself."""
    responses, last = generate(stub, messages=CHAT, tools=TOOLS,
                               tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
                               sampling=pb.SamplingParams(max_tokens=120, temperature=0.8, seed=seed))
    pieces: dict[int, list[pb.ToolCallDelta]] = {}
    whole: list[pb.ToolCall] = []
    for r in responses:
        for d in r.tool_call_deltas:
            assert d.index >= len(whole), "no piece after its whole call"
            pieces.setdefault(d.index, []).append(d)
        whole += r.tool_calls
    assert whole and sorted(pieces) == list(range(len(whole)))
    for i, call in enumerate(whole):
        head, *rest = pieces[i]
        assert (head.id, head.name, head.arguments_fragment) == (call.id, call.name, "")
        assert len(rest) > 1, "the arguments come as they are written"
        assert json.loads("".join(d.arguments_fragment for d in rest)) == json.loads(call.arguments_json)


@pytest.mark.parametrize("seed", range(4))
def test_parallel_tool_calls_false_writes_one_call(stub, seed):
    responses, last = generate(stub, messages=CHAT, tools=TOOLS, parallel_tool_calls=False,
                               tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
                               sampling=pb.SamplingParams(max_tokens=120, temperature=1.0, seed=seed))
    assert len(joined(responses, "tool_calls")) == 1 and last.finish_reason == pb.FINISH_REASON_TOOL_CALLS


def test_allowed_tools_are_the_only_ones_called(stub):
    for seed in range(3):
        responses, _ = generate(stub, messages=CHAT, tools=TOOLS, tool_choice=pb.ToolChoice(
            mode=pb.TOOL_CHOICE_MODE_REQUIRED, allowed_tools=["get_time"]),
            sampling=pb.SamplingParams(max_tokens=120, temperature=1.0, seed=seed))
        assert {c.name for c in joined(responses, "tool_calls")} == {"get_time"}


def test_tool_choice_none_calls_nothing(stub):
    responses, last = generate(stub, messages=CHAT, tools=TOOLS,
                               tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE),
                               constraint=pb.Constraint(regex="[a-z]{4}"))
    assert not joined(responses, "tool_calls") and last.finish_reason == pb.FINISH_REASON_STOP
    assert len(joined(responses, "text")) == 4


def test_an_old_client_sees_no_new_fields(stub):
    responses, last = generate(stub, prompt="Hello", sampling=pb.SamplingParams(max_tokens=5, temperature=0))
    assert sum(len(r.token_ids) for r in responses) == 5 and last.finish_reason == pb.FINISH_REASON_LENGTH
    for r in responses:
        assert not r.reasoning_text and not r.tool_calls and not r.logprobs
    assert last.usage.reasoning_tokens == 0


def test_template_kwargs_past_their_limit_are_refused_naming_it(stub):
    from inference_svc.api.chat import MAX_TEMPLATE_KWARGS_BYTES

    code, details = status_of(stub, messages=CHAT,
                              chat_template_kwargs_json=json.dumps({"style": "x" * MAX_TEMPLATE_KWARGS_BYTES}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "chat_template_kwargs" in details and str(MAX_TEMPLATE_KWARGS_BYTES) in details
