"""POST /v1/responses (OpenAI's Responses API) through the official `openai` SDK, and its contract.

The gateway runs in front of the session's real inference service (embedded
random-weight model): free text is noise, but a `text.format` JSON Schema or
a function tool's parameters are exact, so the checks are schema-valid
output_text, function_call items whose arguments validate, and streams
whose deltas add up to the final Response. Every Response and every event,
streamed or not, is validated against the SDK's own pydantic types
(`Response.model_validate`, the `ResponseStreamEvent` union), which the SDK
itself does not do when it parses (it constructs leniently).
"""

from __future__ import annotations

import json
import typing

import httpx2 as httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
PERSON_FORMAT = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
# Each event type's own model (validating against the whole union reports every member's complaint).
EVENTS = {typing.get_args(m.model_fields["type"].annotation)[0]: m
          for m in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


def contract(resp) -> Response:
    """The SDK's parsed Response, validated strictly against its own type (a drifting field fails here)."""
    return Response.model_validate(resp.model_dump(mode="json", exclude_unset=True, by_alias=True))


def events(stream) -> list:
    out = [EVENTS[e.type].model_validate(e.model_dump(mode="json", exclude_unset=True, by_alias=True))
           for e in stream]
    assert [e.sequence_number for e in out] == list(range(len(out)))
    return out


def test_plain_text(openai_client, served_model):
    resp = contract(openai_client.responses.create(
        model=served_model, instructions="You answer briefly.", input="Describe a person.", max_output_tokens=12,
        temperature=0.7, extra_body={"seed": 3}))
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == served_model
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text" and resp.output_text == message.content[0].text
    u = resp.usage
    assert u.output_tokens == 12 and u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens > 0
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0
    assert resp.instructions == "You answer briefly." and resp.max_output_tokens == 12 and resp.tools == []


@pytest.mark.parametrize("input_", [
    pytest.param("Describe a person.", id="string"),
    pytest.param([{"role": "developer", "content": "You answer in JSON."},
                  {"role": "user", "content": [{"type": "input_text", "text": "Describe a person."}]}], id="items"),
])
def test_json_schema_output_validates(openai_client, served_model, input_):
    resp = contract(openai_client.responses.create(
        model=served_model, input=input_, max_output_tokens=64, temperature=0.7, text=PERSON_FORMAT))
    assert resp.status == "completed", "the grammar completes well within 64 tokens"
    jsonschema.validate(json.loads(resp.output_text), PERSON)
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "person"


def test_json_object(openai_client, served_model):
    resp = contract(openai_client.responses.create(
        model=served_model, input="Some JSON.", max_output_tokens=48, temperature=0.7,
        text={"format": {"type": "json_object"}}, extra_body={"seed": 4}))
    if resp.status == "completed":
        assert isinstance(json.loads(resp.output_text), dict)
    else:
        assert resp.output_text.lstrip().startswith("{")


def test_the_sdk_parses_a_pydantic_text_format(openai_client, served_model):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=120)

    resp = openai_client.responses.parse(model=served_model, input="Describe a person.", max_output_tokens=64,
                                         temperature=0.7, text_format=Person)
    assert isinstance(resp.output_parsed, Person)


def test_tool_choice_required_gives_function_calls_whose_arguments_validate(openai_client, served_model):
    resp = contract(openai_client.responses.create(
        model=served_model, input="Weather in Oslo?", max_output_tokens=96, temperature=0.8,
        tools=[WEATHER], tool_choice="required", extra_body={"seed": 5}))
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and resp.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert resp.tools[0].name == "get_weather" and resp.tool_choice == "required"


def test_a_tool_conversation_round_trips(openai_client, served_model):
    """The function_call item and its output go back in as input items (the chat template renders them)."""
    tool = dict(tools=[WEATHER], max_output_tokens=96, temperature=0, model=served_model)
    first = openai_client.responses.create(input="Weather in Oslo?", tool_choice={"type": "function",
                                                                                  "name": "get_weather"}, **tool)
    call = next(item for item in first.output if item.type == "function_call")
    resp = contract(openai_client.responses.create(
        input=[{"role": "user", "content": "Weather in Oslo?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "4 C, rain"}],
        tool_choice="none", **{**tool, "max_output_tokens": 8}))
    assert [item.type for item in resp.output] == ["message"]


@pytest.mark.parametrize("extra", [
    pytest.param({}, id="free-text"),
    pytest.param({"text": PERSON_FORMAT}, id="json-schema"),
])
def test_stream_events_add_up_to_the_response(openai_client, served_model, extra):
    kwargs = dict(model=served_model, input="Describe a person.", max_output_tokens=24, temperature=0.9, **extra)
    whole = openai_client.responses.create(**kwargs, extra_body={"seed": 11})
    got = events(openai_client.responses.create(stream=True, **kwargs, extra_body={"seed": 11}))
    kinds = [e.type for e in got]
    final = got[-1].response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{final.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text
    assert got[-4].text == text and got[-2].item.content[0].text == text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    assert len({e.response.id for e in got if hasattr(e, "response")}) == 1


def test_the_sdk_stream_helper_gets_the_final_response(openai_client, served_model):
    with openai_client.responses.stream(model=served_model, input="Describe a person.", max_output_tokens=64,
                                        temperature=0.7, text=PERSON_FORMAT) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), PERSON)


def test_streamed_function_call(openai_client, served_model):
    got = events(openai_client.responses.create(
        model=served_model, input="Weather in Oslo?", max_output_tokens=96, temperature=0.8, stream=True,
        tools=[WEATHER], tool_choice="required", extra_body={"seed": 5}))
    final = got[-1].response
    assert got[-1].type == "response.completed"
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls
    for i, call in enumerate(calls):
        index = [item.id for item in final.output].index(call.id)
        pieces = [e.delta for e in got if e.type == "response.function_call_arguments.delta"
                  and e.output_index == index]
        assert "".join(pieces) == call.arguments
        [done] = [e for e in got if e.type == "response.function_call_arguments.done" and e.output_index == index]
        assert done.arguments == call.arguments and done.item_id == call.id
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    added = [e.item.call_id for e in got if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert added == [c.call_id for c in calls], "each call's item is announced with its call_id"


def test_reasoning_item_when_the_model_thinks(openai_client, served_model):
    kwargs = dict(model=served_model, input="Describe a person.", max_output_tokens=24, temperature=0.7,
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 6,
                              "seed": 2})
    resp = contract(openai_client.responses.create(**kwargs))
    reasoning = resp.output[0]
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens <= 6 + 1
    got = events(openai_client.responses.create(stream=True, **kwargs))
    deltas = "".join(e.delta for e in got if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text == got[-1].response.output[0].content[0].text


@pytest.mark.parametrize("body,param", [
    pytest.param({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", id="previous-response"),
    pytest.param({"input": "hi", "store": True}, "store", id="store"),
    pytest.param({"input": "hi", "background": True}, "background", id="background"),
    pytest.param({"input": ""}, "input", id="empty-input"),
    pytest.param({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", id="bad-role"),
    pytest.param({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                 "input[0].content[0].type", id="image-part"),
    pytest.param({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
                 id="schema-missing"),
    pytest.param({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type", id="format-type"),
    pytest.param({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", id="hosted-tool"),
    pytest.param({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "{"}]},
                 "tools[0].parameters", id="bad-parameters"),
    pytest.param({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
                 "tool_choice", id="unknown-tool-choice"),
    pytest.param({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", id="max-output-tokens"),
    pytest.param({"input": "hi", "reasoning": {"effort": "huge"}}, "reasoning.effort", id="effort"),
    pytest.param({"input": "hi", "top_logprobs": 2}, "top_logprobs", id="logprobs"),
    pytest.param({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id",
                 id="call-without-id"),
])
def test_bad_inputs_get_a_400_naming_the_parameter(gateway_url, served_model, body, param):
    r = httpx.post(f"{gateway_url}/responses", json={"model": served_model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in error["message"], error["message"]


def test_the_sdk_raises_bad_request(openai_client, served_model):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(model=served_model, input="hi", previous_response_id="resp_abc")
    assert e.value.param == "previous_response_id"


def test_raw_wire_events_are_named(gateway_url, served_model):
    """OpenAI's wire form: `event: <type>` before each data line, and no [DONE]."""
    with httpx.stream("POST", f"{gateway_url}/responses", timeout=60, json={
            "model": served_model, "input": "hi", "max_output_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and "[DONE]" not in "".join(lines)
    names, data = lines[0::2], lines[1::2]
    for name, payload in zip(names, data):
        assert name == f"event: {json.loads(payload.removeprefix('data: '))['type']}"
    raw = json.loads(data[-1].removeprefix("data: "))
    Response.model_validate(raw["response"])


class _ScriptedCall:
    """An upstream Generate call that answers `responses`, then ends without a finish reason (as a replica that
    went away would): what the stream must turn into an error event after its headers went out."""

    def __init__(self, responses):
        self.responses = list(responses)

    async def read(self):
        import grpc
        return self.responses.pop(0) if self.responses else grpc.aio.EOF

    def cancel(self):
        return True


def _stream_events(responses, body=None) -> tuple[int, list[dict], list[str]]:
    """Runs ResponsesEventStream over a scripted call; (HTTP status, the events, their `event:` names)."""
    import asyncio

    from gateway.body import Fields
    from gateway.errors import from_exception
    from gateway.exchange import Record
    from gateway.metrics import GatewayMetrics
    from gateway.responses_stream import ResponsesEventStream
    from gateway.translation.responses import ResponsesReply, responses_request

    call = responses_request(Fields({"input": "hi", "stream": True, **(body or {})}), "m", "r")
    reply = ResponsesReply(call, "resp_abc", 0)
    scripted = _ScriptedCall(responses[1:])
    stream = ResponsesEventStream(scripted, reply, responses[0], Record(GatewayMetrics(), "/v1/responses"),
                                  from_exception, {})
    sent: list[dict] = []

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(stream(None, receive, send))
    wire = b"".join(m.get("body", b"") for m in sent).decode()
    frames = [f for f in wire.split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    return sent[0]["status"], [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames], names


def test_a_failure_after_the_headers_ends_the_stream_with_an_error_event():
    from shared.gen.inference.v1 import inference_service_pb2 as pb

    status, got, names = _stream_events([pb.GenerateResponse(text="Hel", token_ids=[1]),
                                         pb.GenerateResponse(text="lo", token_ids=[2])])
    assert status == 200 and names == [e["type"] for e in got]
    assert [e["type"] for e in got] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.content_part.added", "response.output_text.delta",
                                        "response.output_text.delta", "error"]
    error = EVENTS["error"].model_validate(got[-1])
    assert error.code and "retry" in error.message and error.sequence_number == len(got) - 1
    for e in got:
        EVENTS[e["type"]].model_validate(e)


def test_reasoning_text_and_calls_stream_as_items_in_order():
    """A thinking model that writes text and then calls a tool: each part its own output item, in order, each
    closed before the next opens; the final Response lists the same items."""
    from shared.gen.inference.v1 import inference_service_pb2 as pb

    call = pb.ToolCall(id="call_1", name="get_weather", arguments_json='{"city": "Oslo", "unit": "celsius"}')
    _, got, _ = _stream_events([
        pb.GenerateResponse(reasoning_text="hmm", token_ids=[1]),
        pb.GenerateResponse(text="Let me look.", token_ids=[2]),
        pb.GenerateResponse(token_ids=[3], tool_call_deltas=[pb.ToolCallDelta(index=0, id="call_1",
                                                                                name="get_weather")]),
        pb.GenerateResponse(token_ids=[4], tool_call_deltas=[pb.ToolCallDelta(
            index=0, arguments_fragment=call.arguments_json)], tool_calls=[call],
            finish_reason=pb.FINISH_REASON_TOOL_CALLS,
            usage=pb.Usage(prompt_tokens=5, completion_tokens=4, reasoning_tokens=1)),
    ], {"tools": [WEATHER]})
    for e in got:
        EVENTS[e["type"]].model_validate(e)
    items = [(e["type"], e["output_index"], e["item"]["type"]) for e in got if "output_item" in e["type"]]
    assert items == [("response.output_item.added", 0, "reasoning"), ("response.output_item.done", 0, "reasoning"),
                     ("response.output_item.added", 1, "message"), ("response.output_item.done", 1, "message"),
                     ("response.output_item.added", 2, "function_call"),
                     ("response.output_item.done", 2, "function_call")]
    final = Response.model_validate(got[-1]["response"])
    assert got[-1]["type"] == "response.completed" and [i.type for i in final.output] == [
        "reasoning", "message", "function_call"]
    assert final.output[2].arguments == call.arguments_json and final.output[2].call_id == "call_1"
    assert final.output_text == "Let me look." and final.usage.output_tokens_details.reasoning_tokens == 1
    done = [e for e in got if e["type"].endswith(".done") and "output_item" not in e["type"]]
    assert [e["type"] for e in done] == ["response.reasoning_text.done", "response.content_part.done",
                                         "response.output_text.done", "response.content_part.done",
                                         "response.function_call_arguments.done"]
