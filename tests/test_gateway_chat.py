"""/v1/chat/completions through the official `openai` SDK (a client nobody here wrote) on loopback.

The gateway runs in front of the session's real inference service (embedded
random-weight model, real 129k tokenizer, real grammar tier): its free text is
noise, but what a constraint or a tool schema allows is exact, so the
checks are the ones the issue asks for: schema-valid JSON, tool calls whose
arguments validate, streams that add up to the non-streamed answer, and
logprobs consistent with greedy decoding.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Describe a person."}]


def test_json_schema_strict_returns_json_that_validates(openai_client, served_model):
    resp = openai_client.chat.completions.create(
        model=served_model, messages=ASK, max_tokens=64, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", "the grammar completes well within 64 tokens"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert resp.object == "chat.completion" and resp.model == served_model and resp.id.startswith("chatcmpl-")
    assert resp.usage.completion_tokens > 0 and resp.usage.total_tokens == \
        resp.usage.prompt_tokens + resp.usage.completion_tokens


@pytest.mark.parametrize("extra", [
    pytest.param({}, id="free-text"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
                 id="json-schema"),
])
def test_stream_deltas_add_up_to_the_non_streamed_answer(openai_client, served_model, extra):
    kwargs = dict(model=served_model, messages=ASK, max_tokens=24, temperature=0.9, seed=11, **extra)
    whole = openai_client.chat.completions.create(**kwargs).choices[0]
    chunks = list(openai_client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.finish_reason]
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)


def test_stream_usage_comes_last_when_asked(openai_client, served_model):
    chunks = list(openai_client.chat.completions.create(
        model=served_model, messages=ASK, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    assert all(c.usage is None for c in body)


def test_greedy_logprobs_pick_the_most_likely_token(openai_client, served_model):
    resp = openai_client.chat.completions.create(
        model=served_model, messages=ASK, max_tokens=12, temperature=0, logprobs=True, top_logprobs=5)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    sampled = [t for t in content if t.top_logprobs]
    assert sampled, "every token was forced: nothing to check"
    for t in sampled:
        assert len(t.top_logprobs) == 5
        best = max(t.top_logprobs, key=lambda a: a.logprob)
        assert t.logprob == pytest.approx(best.logprob, abs=1e-5)
        assert t.bytes == best.bytes
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert t.logprob <= 0
    assert "".join(bytes(t.bytes).decode("utf-8", "replace") for t in content).startswith(
        resp.choices[0].message.content[:1])


def test_tool_choice_required_returns_calls_whose_arguments_validate(openai_client, served_model):
    resp = openai_client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=96,
        temperature=0.8, seed=5, tools=[WEATHER], tool_choice="required")
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                   "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def streamed_calls(chunks) -> list[dict]:
    """The stream's tool calls put together from their pieces, checking OpenAI's shape on the way: a call's
    first entry has its id, type, name and empty arguments, the next ones arguments only."""
    calls: list[dict] = []
    for chunk in chunks:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if tc.index == len(calls):
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                assert tc.function.arguments == ""
                calls.append({"id": tc.id, "name": tc.function.name, "pieces": []})
            else:
                assert tc.index == len(calls) - 1, "a call's pieces follow its head, calls in order"
                assert tc.id is None and tc.function.name is None
                calls[-1]["pieces"].append(tc.function.arguments)
    return calls


@pytest.mark.parametrize("tool_choice", [
    pytest.param("required", id="required"),
    pytest.param({"type": "function", "function": {"name": "get_weather"}}, id="named"),
])
@pytest.mark.parametrize("seed", [5, 6])
def test_streamed_tool_call_arguments_come_in_pieces(openai_client, served_model, tool_choice, seed):
    kwargs = dict(model=served_model, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=96,
                  temperature=0.8, seed=seed, tools=[WEATHER, TIME], tool_choice=tool_choice)
    chunks = list(openai_client.chat.completions.create(stream=True, **kwargs))
    calls = streamed_calls(chunks)
    assert calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert any(len(c["pieces"]) > 1 for c in calls), "the arguments stream as they are written"
    whole = openai_client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert [c["name"] for c in calls] == [w.function.name for w in whole]
    for c, w in zip(calls, whole):
        arguments = json.loads("".join(c["pieces"]))
        jsonschema.validate(arguments, SCHEMAS[c["name"]])
        assert arguments == json.loads(w.function.arguments), "the same call as the non-streamed answer"


def _side_by_side(request, seeds) -> list:
    """request(seed) for every seed, all in flight at once: the engine decodes them as one batch, so the table
    costs about as many steps as its longest answer rather than the sum of them."""
    seeds = list(seeds)
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(request, seeds))


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_parallel_tool_calls_false_gives_one_call_at_most(openai_client, served_model, tool_choice):
    counts = []
    for resp in _side_by_side(lambda seed: openai_client.chat.completions.create(
            model=served_model, messages=[{"role": "user", "content": "Weather in Oslo and time in UTC?"}],
            max_tokens=96, temperature=1.0, seed=seed, tools=[WEATHER, TIME], tool_choice=tool_choice,
            parallel_tool_calls=False), range(6)):
        choice = resp.choices[0]
        counts.append(len(choice.message.tool_calls or []))
        if tool_choice == "required":
            assert choice.finish_reason == "tool_calls"
    assert max(counts) <= 1, counts
    if tool_choice == "required":
        assert min(counts) == 1


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_allowed_tools_restrict_what_is_called(openai_client, served_model, mode):
    names = set()
    for resp in _side_by_side(lambda seed: openai_client.chat.completions.create(
            model=served_model, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=96,
            temperature=1.0, seed=seed, tools=[WEATHER, TIME],
            tool_choice={"type": "allowed_tools", "allowed_tools": {
                "mode": mode, "tools": [{"type": "function", "function": {"name": "get_time"}}]}}), range(4)):
        for call in resp.choices[0].message.tool_calls or []:
            names.add(call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])
    assert names <= {"get_time"}
    if mode == "required":
        assert names == {"get_time"}


def test_a_tool_conversation_round_trips(openai_client, served_model):
    """The assistant's tool call and the tool's answer go back in as messages (the chat template renders them)."""
    first = openai_client.chat.completions.create(
        model=served_model, messages=[{"role": "user", "content": "Weather in Oslo?"}], max_tokens=96,
        temperature=0, tools=[WEATHER], tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    resp = openai_client.chat.completions.create(
        model=served_model, max_tokens=8, temperature=0, tools=[WEATHER],
        messages=[{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "4 C, rain"}],
        tool_choice="none")
    assert resp.choices[0].finish_reason in ("stop", "length") and not resp.choices[0].message.tool_calls


def test_reasoning_with_a_thinking_budget(openai_client, served_model):
    """Thinking (unconstrained) comes back apart from the answer (constrained), and stops at the budget."""
    kwargs = dict(model=served_model, messages=ASK, max_tokens=96, temperature=0.7, seed=9,
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 6})
    resp = openai_client.chat.completions.create(**kwargs)
    message = resp.choices[0].message
    reasoning = message.model_dump()["reasoning_content"]
    assert reasoning, "the thinking text"
    assert message.model_dump()["reasoning"] == reasoning, "vLLM's current name, and the older one as an alias"
    jsonschema.validate(json.loads(message.content), PERSON)
    assert 0 < resp.usage.completion_tokens_details.reasoning_tokens <= 6 + 1, "the budget, end token included"
    chunks = list(openai_client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == message.content
