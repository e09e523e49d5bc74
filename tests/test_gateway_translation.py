"""OpenAI request bodies -> inference.v1 GenerateRequest (gateway/translation/request.py), field by field.

No service runs here: these pin the translation decisions docs/openai.md
documents, and that every refused field is a 400 naming its
parameter. The HTTP tests (tests/test_gateway_*.py) run the same paths end
to end.
"""

from __future__ import annotations

import json

import pytest

from gateway.body import Fields, parse_object
from gateway.errors import InvalidParameterError, ModelNotFoundError, from_exception
from gateway.translation.request import chat_request, completion_request
from gateway.translation.response import CompletionReply
from shared.gen.inference.v1 import inference_service_pb2 as pb

MODEL = "structd-embedded"
USER = [{"role": "user", "content": "Hi"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def chat(**body):
    return chat_request(Fields({"model": MODEL, "messages": USER, **body}), MODEL, "req-1")


def completion(**body):
    return completion_request(Fields({"model": MODEL, "prompt": "Hi", **body}), MODEL, "req-1")


def test_defaults_follow_openai():
    t = chat()
    s = t.grpc_request.sampling
    assert s.temperature == 1.0, "OpenAI's default temperature is 1 (the proto's 0 would be greedy)"
    assert s.top_p == 1.0 and s.max_tokens == 0 and not s.HasField("seed") and not s.logprobs
    assert not t.grpc_request.HasField("constraint") and not t.stream and t.top_logprobs is None
    assert t.grpc_request.request_id == "req-1" and t.model == MODEL
    assert [(m.role, m.content) for m in t.grpc_request.messages] == [("user", "Hi")]
    assert completion().grpc_request.sampling.max_tokens == 16, "OpenAI's (and vLLM's) legacy completions default"


@pytest.mark.parametrize("body, field, value", [
    pytest.param({"temperature": 0}, "temperature", 0.0, id="temperature-0-is-greedy"),
    pytest.param({"top_k": -1}, "top_k", 0, id="top_k-minus-one-disables"),
    pytest.param({"top_k": 5}, "top_k", 5, id="top_k"),
    pytest.param({"seed": 7}, "seed", 7, id="seed"),
    # OpenAI and vLLM take negative seeds; the proto's is a uint64: two's complement in 64 bits.
    pytest.param({"seed": -1}, "seed", 2**64 - 1, id="seed-negative"),
    pytest.param({"seed": -(2**63)}, "seed", 2**63, id="seed-int64-min"),
    pytest.param({"stop": "\n"}, "stop", ["\n"], id="stop-string"),
    pytest.param({"stop": ["a", "b"]}, "stop", ["a", "b"], id="stop-list"),
    pytest.param({"max_tokens": 9}, "max_tokens", 9, id="max_tokens"),
    pytest.param({"max_completion_tokens": 5, "max_tokens": 9}, "max_tokens", 5, id="max_completion_tokens-wins"),
    pytest.param({"min_tokens": 3}, "min_tokens", 3, id="min_tokens"),
    pytest.param({"repetition_penalty": 1.3}, "repetition_penalty", pytest.approx(1.3), id="repetition_penalty"),
    pytest.param({"ignore_eos": True}, "ignore_eos", True, id="ignore_eos"),
    pytest.param({"presence_penalty": 0, "frequency_penalty": 0.0, "n": 1}, "max_tokens", 0, id="zero-penalties-n1"),
    pytest.param({"presence_penalty": 0.5}, "presence_penalty", 0.5, id="presence_penalty"),
    pytest.param({"frequency_penalty": -2}, "frequency_penalty", -2.0, id="frequency_penalty"),
    # OpenAI's token ids are the object's keys, hence strings.
    pytest.param({"logit_bias": {"42": 3, "7": -100}}, "logit_bias", {42: 3.0, 7: -100.0}, id="logit_bias"),
    pytest.param({"min_p": 0.25}, "min_p", 0.25, id="min_p"),
    pytest.param({"stop_token_ids": [5, 9.0]}, "stop_token_ids", [5, 9], id="stop_token_ids"),
    pytest.param({"include_stop_str_in_output": True}, "include_stop_str_in_output", True,
                 id="include_stop_str_in_output"),
])
def test_sampling_parameters(body, field, value):
    s = chat(**body).grpc_request.sampling
    got = getattr(s, field)
    assert (dict(got) if field == "logit_bias" else list(got) if field in ("stop", "stop_token_ids") else got) == value


@pytest.mark.parametrize("body, param", [
    pytest.param({"n": 0}, "n", id="n-zero"),
    pytest.param({"presence_penalty": 2.5}, "presence_penalty", id="presence_penalty-range"),
    pytest.param({"frequency_penalty": -2.1}, "frequency_penalty", id="frequency_penalty-range"),
    pytest.param({"logit_bias": {"forty": 3}}, "logit_bias", id="logit_bias-key"),
    pytest.param({"logit_bias": {"-1": 3}}, "logit_bias", id="logit_bias-negative-id"),
    pytest.param({"logit_bias": {"42": 101}}, "logit_bias.42", id="logit_bias-range"),
    pytest.param({"logit_bias": [1]}, "logit_bias", id="logit_bias-type"),
    pytest.param({"min_p": 1.5}, "min_p", id="min_p-range"),
    pytest.param({"stop_token_ids": [-1]}, "stop_token_ids", id="stop_token_ids-negative"),
    pytest.param({"stop_token_ids": "5"}, "stop_token_ids", id="stop_token_ids-type"),
    pytest.param({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output",
                 id="include_stop_str_in_output-type"),
    pytest.param({"temperature": "hot"}, "temperature", id="temperature-type"),
    pytest.param({"temperature": -0.1}, "temperature", id="temperature-range"),
    pytest.param({"top_p": 1.5}, "top_p", id="top_p-range"),
    pytest.param({"seed": -(2**63) - 1}, "seed", id="seed-below-int64"),
    pytest.param({"seed": 2**64}, "seed", id="seed-above-uint64"),
    pytest.param({"max_tokens": 0}, "max_tokens", id="max_tokens-zero"),
    pytest.param({"max_tokens": 2.5}, "max_tokens", id="max_tokens-fraction"),
    pytest.param({"stop": [1]}, "stop", id="stop-type"),
    pytest.param({"stream_options": {"include_usage": True}}, "stream_options", id="stream_options-without-stream"),
    pytest.param({"top_logprobs": 3}, "top_logprobs", id="top_logprobs-without-logprobs"),
    pytest.param({"logprobs": True, "top_logprobs": 21}, "top_logprobs", id="top_logprobs-range"),
    pytest.param({"messages": []}, "messages", id="messages-empty"),
    pytest.param({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", id="role"),
    pytest.param({"messages": [{"role": "user"}]}, "messages[0].content", id="content-missing"),
    pytest.param({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type",
                 id="image-part"),
    pytest.param({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id", id="tool-without-id"),
    pytest.param({"response_format": {"type": "yaml"}}, "response_format.type", id="response_format-type"),
    pytest.param({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
                 id="json_schema-missing"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{nope"}}},
                 "response_format.json_schema.schema", id="schema-not-json"),
    pytest.param({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", id="two-kinds"),
    pytest.param({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
                 "response_format", id="response_format-and-structured_outputs"),
    pytest.param({"structured_outputs": {"choice": []}}, "structured_outputs.choice", id="choice-empty"),
    pytest.param({"structured_outputs": {"regex": "a", "whitespace": "flexible"}}, "structured_outputs.whitespace",
                 id="json-option-on-regex"),
    pytest.param({"structured_outputs": {"json": SCHEMA, "whitespace": "wide"}}, "structured_outputs.whitespace",
                 id="whitespace-value"),
    pytest.param({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
                 "structured_outputs.whitespace_pattern", id="whitespace_pattern"),
    pytest.param({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs.jsn", id="unknown-key"),
    pytest.param({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend",
                 id="backend-unknown"),
    pytest.param({"structured_outputs": {"backend": "xgrammar"}}, "structured_outputs.backend",
                 id="backend-without-constraint"),
    pytest.param({"structured_outputs": {"json": SCHEMA, "max_whitespace_count": 99}},
                 "structured_outputs.max_whitespace_count", id="max_whitespace_count-range"),
    pytest.param({"tools": [{"type": "retrieval"}]}, "tools[0].type", id="tool-type"),
    pytest.param({"tools": [{"type": "function", "function": {}}]}, "tools[0].function", id="tool-name"),
    pytest.param({"tool_choice": "required"}, "tool_choice", id="tool_choice-without-tools"),
    pytest.param({"tools": [{"type": "function", "function": {"name": "f"}}],
                  "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", id="unknown-tool"),
    pytest.param({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"},
                 "tool_choice", id="tool_choice-value"),
    pytest.param({"reasoning_effort": "extreme"}, "reasoning_effort", id="reasoning_effort-value"),
    pytest.param({"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "none"}, "reasoning_effort",
                 id="reasoning-contradiction"),
    pytest.param({"messages": [{"role": "assistant", "content": "x", "reasoning": "a", "reasoning_content": "b"}]},
                 "messages[0].reasoning", id="reasoning-aliases-differ"),
    pytest.param({"tools": [{"type": "function", "function": {"name": "f"}}],
                  "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
                      {"type": "function", "function": {"name": "g"}}]}}},
                 "tool_choice.allowed_tools.tools[0].function", id="allowed_tools-unknown"),
    pytest.param({"tools": [{"type": "function", "function": {"name": "f"}}],
                  "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "none", "tools": [
                      {"type": "function", "function": {"name": "f"}}]}}},
                 "tool_choice.allowed_tools.mode", id="allowed_tools-mode"),
    pytest.param({"tools": [{"type": "function", "function": {"name": "f"}}],
                  "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
                 "tool_choice.allowed_tools.tools", id="allowed_tools-empty"),
    pytest.param({"parallel_tool_calls": "no"}, "parallel_tool_calls", id="parallel_tool_calls-type"),
    pytest.param({"thinking_token_budget": -5}, "thinking_token_budget", id="thinking_token_budget-negative"),
])
def test_refused_chat_fields_name_their_parameter(body, param):
    with pytest.raises(InvalidParameterError) as e:
        chat(**body)
    assert e.value.param == param
    error = from_exception(e.value)
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param)
    assert param.split(".")[0].split("[")[0] in error.message


@pytest.mark.parametrize("body, param", [
    pytest.param({"echo": True}, "echo", id="echo"),
    pytest.param({"suffix": "end"}, "suffix", id="suffix"),
    pytest.param({"best_of": 2}, "best_of", id="best_of"),
    pytest.param({"prompt": ""}, "prompt", id="prompt-empty"),
    pytest.param({"prompt": ["a", "b"]}, "prompt", id="prompt-batch"),
    pytest.param({"prompt": [1, -2]}, "prompt", id="prompt-negative-id"),
    pytest.param({"prompt": {"text": "x"}}, "prompt", id="prompt-type"),
    pytest.param({"logprobs": 21}, "logprobs", id="logprobs-range"),
])
def test_refused_completion_fields_name_their_parameter(body, param):
    with pytest.raises(InvalidParameterError) as e:
        completion(**body)
    assert e.value.param == param


def test_unknown_model_is_404_like_vllm():
    with pytest.raises(ModelNotFoundError) as e:
        chat(model="gpt-4o")
    error = from_exception(e.value)
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert error.message == "The model `gpt-4o` does not exist."
    assert chat_request(Fields({"messages": USER}), MODEL, "r").model == MODEL, "model may be left out"


@pytest.mark.parametrize("response_format", [
    pytest.param({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}, id="strict"),
    pytest.param({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": False}},
                 id="not-strict"),
    pytest.param({"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}, id="strict-absent"),
])
def test_json_schema_is_always_decoded_strictly(response_format):
    c = chat(response_format=response_format).grpc_request.constraint
    assert json.loads(c.json_schema) == SCHEMA
    assert not c.json_options.lenient, "strict or not, no properties beyond the schema's (docs/openai.md)"


@pytest.mark.parametrize("body, check", [
    pytest.param({"response_format": {"type": "text"}}, lambda c: c is None, id="text"),
    pytest.param({"response_format": {"type": "json_object"}}, lambda c: c.json_object, id="json_object"),
    pytest.param({"structured_outputs": {"json": SCHEMA}}, lambda c: json.loads(c.json_schema) == SCHEMA,
                 id="json-inline"),
    pytest.param({"structured_outputs": {"json": json.dumps(SCHEMA)}}, lambda c: json.loads(c.json_schema) == SCHEMA,
                 id="json-as-text"),
    pytest.param({"structured_outputs": {"regex": "[a-z]+"}}, lambda c: c.regex == "[a-z]+", id="regex"),
    pytest.param({"structured_outputs": {"choice": ["yes", "no"]}}, lambda c: list(c.choice.choices) == ["yes", "no"],
                 id="choice"),
    pytest.param({"structured_outputs": {"grammar": 'root ::= "a"'}}, lambda c: c.ebnf == 'root ::= "a"',
                 id="grammar-is-ebnf"),
    pytest.param({"structured_outputs": {"json_object": True}}, lambda c: c.json_object, id="json_object-flag"),
    pytest.param({"structured_outputs": {"structural_tag": {"type": "structural_tag"}}},
                 lambda c: json.loads(c.structural_tag) == {"type": "structural_tag"}, id="structural_tag"),
    pytest.param({"structured_outputs": {"regex": "a", "disable_jump_forward": True}},
                 lambda c: c.disable_jump_forward, id="disable_jump_forward"),
    pytest.param({"structured_outputs": {"json": SCHEMA, "whitespace": "indented", "indent": 4, "lenient": True,
                                         "any_key_order": True}},
                 lambda c: (c.json_options.whitespace, c.json_options.indent, c.json_options.lenient,
                            c.json_options.any_key_order) == (pb.JSON_WHITESPACE_INDENTED, 4, True, True),
                 id="json-options"),
    pytest.param({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False,
                                         "max_whitespace_count": 3}},
                 lambda c: (c.json_options.whitespace, c.json_options.max_whitespace_count)
                 == (pb.JSON_WHITESPACE_FLEXIBLE, 3), id="vllm-disable_any_whitespace-false"),
    pytest.param({"response_format": {"type": "json_object"}, "structured_outputs": {"whitespace": "flexible"}},
                 lambda c: c.json_object and c.json_options.whitespace == pb.JSON_WHITESPACE_FLEXIBLE,
                 id="options-with-response_format"),
    pytest.param({"structured_outputs": {"regex": "a", "backend": "llguidance"}},
                 lambda c: c.backend == pb.GRAMMAR_BACKEND_LLGUIDANCE, id="backend"),
    pytest.param({"response_format": {"type": "json_object"}, "structured_outputs": {"backend": "guidance"}},
                 lambda c: c.json_object and c.backend == pb.GRAMMAR_BACKEND_LLGUIDANCE, id="backend-vllm-name"),
])
def test_constraints(body, check):
    t = chat(**body)
    assert check(t.grpc_request.constraint if t.grpc_request.HasField("constraint") else None)


def test_messages_tools_and_tool_choice():
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
            {"role": "user", "content": "Weather?", "name": "ann"},
            {"role": "assistant", "content": None, "reasoning_content": "hmm",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}]
    tool = {"type": "function", "function": {"name": "weather", "description": "Current weather",
                                             "parameters": {"type": "object"}}}
    req = chat(messages=msgs, tools=[tool], tool_choice="required").grpc_request
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "tool"]
    assert req.messages[0].content == "Be\nbrief." and req.messages[1].name == "ann"
    call = req.messages[2].tool_calls[0]
    assert (call.id, call.name, call.arguments_json) == ("call_1", "weather", '{"city":"Oslo"}')
    assert req.messages[2].reasoning_content == "hmm" and req.messages[3].tool_call_id == "call_1"
    assert (req.tools[0].name, req.tools[0].description, json.loads(req.tools[0].parameters_json_schema)) == \
           ("weather", "Current weather", {"type": "object"})
    assert req.tool_choice.mode == pb.TOOL_CHOICE_MODE_REQUIRED
    named = chat(tools=[tool], tool_choice={"type": "function", "function": {"name": "weather"}}).grpc_request
    assert (named.tool_choice.mode, named.tool_choice.name) == (pb.TOOL_CHOICE_MODE_NAMED, "weather")
    assert not chat(tools=[tool]).grpc_request.HasField("tool_choice"), "unset: the server's auto"
    assert not chat(tools=[tool]).grpc_request.HasField("parallel_tool_calls"), "unset: the server's (any number)"
    single = chat(tools=[tool], parallel_tool_calls=False).grpc_request
    assert single.HasField("parallel_tool_calls") and not single.parallel_tool_calls
    allowed = chat(tools=[tool, {"type": "function", "function": {"name": "other"}}],
                   tool_choice={"type": "allowed_tools", "allowed_tools": {
                       "mode": "required", "tools": [{"type": "function", "function": {"name": "weather"}}]}}
                   ).grpc_request
    assert (allowed.tool_choice.mode, list(allowed.tool_choice.allowed_tools)) == \
           (pb.TOOL_CHOICE_MODE_REQUIRED, ["weather"])


@pytest.mark.parametrize("fields, thinking", [
    pytest.param({"reasoning": "hmm"}, "hmm", id="reasoning"),
    pytest.param({"reasoning_content": "hmm"}, "hmm", id="reasoning_content"),
    pytest.param({"reasoning": "hmm", "reasoning_content": "hmm"}, "hmm", id="both-agree"),
])
def test_assistant_reasoning_either_name(fields, thinking):
    req = chat(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", **fields}]
               ).grpc_request
    assert req.messages[1].reasoning_content == thinking


def test_chat_template_kwargs_go_to_the_template():
    req = chat(chat_template_kwargs={"enable_thinking": False, "style": "terse", "depth": [1, {"a": None}]}
               ).grpc_request
    assert req.reasoning is False, "enable_thinking still turns thinking off"
    assert json.loads(req.chat_template_kwargs_json) == {"style": "terse", "depth": [1, {"a": None}]}
    assert chat().grpc_request.chat_template_kwargs_json == ""


@pytest.mark.parametrize("body, reasoning, budget", [
    pytest.param({}, None, 0, id="template-default"),
    pytest.param({"chat_template_kwargs": {"enable_thinking": True}}, True, 0, id="enable_thinking"),
    pytest.param({"chat_template_kwargs": {"thinking": False}}, False, 0, id="thinking-off"),
    pytest.param({"reasoning_effort": "none"}, False, 0, id="effort-none"),
    pytest.param({"reasoning_effort": "low", "thinking_token_budget": 64}, True, 64, id="effort-and-budget"),
])
def test_reasoning(body, reasoning, budget):
    req = chat(**body).grpc_request
    assert (req.reasoning if req.HasField("reasoning") else None) == reasoning
    assert req.max_thinking_tokens == budget


@pytest.mark.parametrize("prompt, text, ids", [
    pytest.param("Hello", "Hello", [], id="string"),
    pytest.param(["Hello"], "Hello", [], id="batch-of-one-string"),
    pytest.param([1, 2, 3], "", [1, 2, 3], id="token-ids"),
    pytest.param([[4, 5]], "", [4, 5], id="batch-of-one-token-list"),
])
def test_completion_prompts(prompt, text, ids):
    req = completion(prompt=prompt).grpc_request
    assert (req.prompt, list(req.prompt_token_ids)) == (text, ids)


def test_logprobs_and_streaming_flags():
    t = chat(logprobs=True, top_logprobs=3, stream=True, stream_options={"include_usage": True})
    assert (t.grpc_request.sampling.logprobs, t.grpc_request.sampling.top_logprobs, t.top_logprobs) == (True, 3, 3)
    assert t.stream and t.include_usage
    legacy = completion(logprobs=0)
    assert legacy.grpc_request.sampling.logprobs and legacy.top_logprobs == 0


@pytest.mark.parametrize("raw, message", [
    pytest.param(b"{nope", "not valid JSON", id="malformed"),
    pytest.param(b"[1, 2]", "must be a JSON object", id="not-an-object"),
    pytest.param(b"\xff\xfe", "not valid JSON", id="not-utf8"),
])
def test_body_must_be_a_json_object(raw, message):
    with pytest.raises(InvalidParameterError, match=message) as e:
        parse_object(raw)
    assert e.value.param is None


@pytest.mark.parametrize("stream", [pytest.param(False, id="whole"), pytest.param(True, id="streamed")])
def test_completion_reasoning_has_chat_names(stream):
    """A legacy completion that thought gives its thinking under both of chat's names, `reasoning` and
    `reasoning_content`, whole and streamed."""
    reply = CompletionReply(completion(), "cmpl-1", 0)
    thought = pb.GenerateResponse(text="yes", reasoning_text="hmm", token_ids=[1],
                                  finish_reason=pb.FINISH_REASON_STOP)
    if stream:
        [choice] = [c["choices"][0] for c in reply.chunks(thought) if c["choices"][0]["text"]]
    else:
        assert reply.add(thought)
        [choice] = reply.result()["choices"]
    assert choice["reasoning"] == choice["reasoning_content"] == "hmm" and choice["text"] == "yes"
