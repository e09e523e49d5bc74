"""`n` choices at the gateway (issue 25), through the official `openai` SDK and raw server-sent events, in
front of the session's real inference service: n choices each with its index and finish reason, streamed
chunks naming their choice in `choices[0].index`, usage counting the prompt once (with
`prompt_tokens_details.cached_tokens`), a constraint for every choice, and n refused outside 1..--max-n."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import httpx2
import openai
import pytest

USER = [{"role": "user", "content": "Say something."}]
CODE = "[a-z]{3}-[0-9]{3}"
PIGEONHOLE = {"type": "object",
              "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                      "minItems": 3, "maxItems": 3, "uniqueItems": True}},
              "required": ["tags"]}


def events(gateway_url: str, path: str, body: dict) -> list[dict]:
    """The stream's chunks (the [DONE] event checked and dropped)."""
    with httpx2.stream("POST", gateway_url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_raw()).decode()
    data = [f[len("data: "):] for f in raw[:-2].split("\n\n")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_chat_returns_n_choices_and_counts_the_prompt_once(openai_client, served_model):
    one = openai_client.chat.completions.create(model=served_model, messages=USER, max_tokens=5, temperature=1,
                                                seed=1, extra_body={"ignore_eos": True})
    resp = openai_client.chat.completions.create(model=served_model, messages=USER, max_tokens=5, temperature=1,
                                                 seed=1, n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in resp.choices)
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens, "the prompt counted once"
    assert resp.usage.completion_tokens == 3 * 5
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 15
    assert 0 <= resp.usage.prompt_tokens_details.cached_tokens <= resp.usage.prompt_tokens


def test_a_resent_prompt_reports_its_cached_tokens(openai_client, served_model):
    # A system prompt of several full KV blocks: the second request finds them in the prefix cache.
    messages = [{"role": "system", "content": "You extract fields from records as JSON. " * 8},
                {"role": "user", "content": "Record."}]
    openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=2)
    again = openai_client.chat.completions.create(model=served_model, messages=messages, max_tokens=2, n=2)
    assert 64 <= again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens


def test_completions_return_n_choices(openai_client, served_model):
    resp = openai_client.completions.create(model=served_model, prompt="A code:", n=4, temperature=1, seed=2,
                                            max_tokens=12, extra_body={"structured_outputs": {"regex": CODE}})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for c in resp.choices:
        assert c.finish_reason == "stop" and re.fullmatch(CODE, c.text), c
    assert resp.usage.completion_tokens >= 4


@pytest.mark.parametrize("path, body", [
    pytest.param("/chat/completions", {"messages": USER}, id="chat"),
    pytest.param("/completions", {"prompt": "Once"}, id="completions"),
])
def test_streamed_chunks_name_their_choice(gateway_url, served_model, path, body):
    chunks = events(gateway_url, path, {"model": served_model, "max_tokens": 4, "temperature": 1, "seed": 3,
                                        "n": 3, "ignore_eos": True, "stream": True,
                                        "stream_options": {"include_usage": True}, **body})
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3 * 4
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    by_index = defaultdict(list)
    for c in choice_chunks:
        (choice,) = c["choices"]
        assert c["usage"] is None
        by_index[choice["index"]].append(choice)
    assert sorted(by_index) == [0, 1, 2]
    for index, choices in by_index.items():
        reasons = [c["finish_reason"] for c in choices]
        assert reasons[-1] == "length" and reasons.count("length") == 1, f"choice {index} finishes once, last"
        if "chat" in path:
            assert choices[0]["delta"] == {"role": "assistant", "content": ""}, f"choice {index} opens with its role"
            assert sum(1 for c in choices if "role" in c["delta"]) == 1
    finishes = [i for i, c in enumerate(choice_chunks) if c["choices"][0]["finish_reason"]]
    assert finishes[-1] == len(choice_chunks) - 1, "the stream ends with the last choice's finish"


def test_streamed_chat_adds_up_to_each_choice(openai_client, served_model):
    stream = openai_client.chat.completions.create(
        model=served_model, messages=USER, max_tokens=24, temperature=1, seed=4, n=2, stream=True,
        extra_body={"structured_outputs": {"regex": CODE}})
    texts = defaultdict(str)
    finishes = {}
    for chunk in stream:
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "stop", 1: "stop"}
    assert all(re.fullmatch(CODE, t) for t in texts.values()), texts


def test_each_choice_carries_its_own_schema_check(openai_client, served_model):
    resp = openai_client.chat.completions.create(
        model=served_model, messages=USER, max_tokens=32, temperature=1, seed=5, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "tags", "schema": PIGEONHOLE}})
    assert [w["keyword"] for w in resp.structd["warnings"]] == ["uniqueItems"]
    assert "schema_check" not in resp.structd, "with several choices, each has its own check"
    for c in resp.choices:
        assert c.finish_reason == "stop"
        assert c.structd["schema_check"] == "invalid"
        assert [v["keyword"] for v in c.structd["schema_violations"]] == ["uniqueItems"]


def test_best_of_equal_to_n_is_accepted(openai_client, served_model):
    resp = openai_client.completions.create(model=served_model, prompt="Hi", n=2, max_tokens=2,
                                            extra_body={"best_of": 2})
    assert len(resp.choices) == 2


@pytest.mark.parametrize("path, body", [
    pytest.param("/chat/completions", {"messages": USER}, id="chat"),
    pytest.param("/completions", {"prompt": "Hi"}, id="completions"),
])
@pytest.mark.parametrize("stream", [pytest.param(False, id="whole"), pytest.param(True, id="stream")])
@pytest.mark.parametrize("n", [pytest.param(17, id="max-n-plus-one"), pytest.param(2**31 - 1, id="int32-max")])
def test_n_above_the_inference_services_max_is_a_400_naming_the_flag(gateway_url, served_model, path, body,
                                                                     stream, n):
    r = httpx2.post(gateway_url + path, json={"model": served_model, "max_tokens": 2, "n": n, "stream": stream,
                                              **body}, timeout=60)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and "--max-n" in error["message"]


@pytest.mark.parametrize("extra", [
    pytest.param({"n": 0}, id="zero"),
    pytest.param({"n": -2}, id="negative"),
    pytest.param({"n": 2, "best_of": 3}, id="best_of-not-n"),
])
def test_refused_n_names_the_parameter(openai_client, served_model, extra):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=served_model, prompt="Hi", max_tokens=2, extra_body=extra)
    assert e.value.body["param"] in extra
