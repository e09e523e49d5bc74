"""vLLM's /tokenize and /detokenize on the gateway, through the inference service's Tokenize and Detokenize RPCs
(issue 27, item 3), on the session's real services.

The counts are the ones a completion charges: a prompt's and a conversation's
token count equals the prompt_tokens of a completion of the same input.
Token ids outside the vocabulary are the client's error, a 400 (the RPCs'
INVALID_ARGUMENT).
"""

from __future__ import annotations

import grpc
import httpx2
import pytest

from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc

CHAT = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def base(gateway_url) -> str:
    return gateway_url.removesuffix("/v1")


@pytest.fixture(scope="module")
def stub(inference_server):
    with grpc.insecure_channel(inference_server.target) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


def _post(base: str, path: str, body: dict) -> httpx2.Response:
    return httpx2.post(base + path, json=body, timeout=60)


def test_a_prompt_counts_what_a_completion_charges(base, openai_client, served_model):
    prompt = "The quick brown fox jumps over the lazy dog."
    r = _post(base, "/tokenize", {"model": served_model, "prompt": prompt})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == openai_client.models.list().data[0].model_dump()["max_model_len"]
    used = openai_client.completions.create(model=served_model, prompt=prompt, max_tokens=1).usage
    assert used.prompt_tokens == body["count"]


def test_a_conversation_counts_what_a_chat_completion_charges(base, openai_client, served_model):
    r = _post(base, "/tokenize", {"model": served_model, "messages": CHAT})
    assert r.status_code == 200, r.text
    used = openai_client.chat.completions.create(model=served_model, messages=CHAT, max_tokens=1).usage
    assert used.prompt_tokens == r.json()["count"]
    without = _post(base, "/tokenize", {"model": served_model, "messages": CHAT, "add_generation_prompt": False})
    assert without.status_code == 200
    tokens, fewer = r.json()["tokens"], without.json()["tokens"]
    assert len(fewer) < len(tokens) and tokens[:len(fewer)] == fewer


def test_detokenize_gives_back_the_text(base, served_model):
    text = "Structured outputs, { \"json\": true } and ünïcödé."
    tokens = _post(base, "/tokenize", {"model": served_model, "prompt": text, "add_special_tokens": False}
                   ).json()["tokens"]
    r = _post(base, "/detokenize", {"model": served_model, "tokens": tokens})
    assert r.status_code == 200 and r.json() == {"prompt": text}


@pytest.mark.parametrize("path, body, param", [
    pytest.param("/tokenize", {"prompt": "a", "messages": CHAT}, None, id="prompt-and-messages"),
    pytest.param("/tokenize", {}, None, id="neither"),
    pytest.param("/tokenize", {"prompt": ""}, "prompt", id="empty-prompt"),
    pytest.param("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs", id="token-strs"),
    pytest.param("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role", id="bad-role"),
    pytest.param("/detokenize", {}, "tokens", id="no-tokens"),
    pytest.param("/detokenize", {"tokens": [-1]}, "tokens", id="negative-id"),
    pytest.param("/detokenize", {"tokens": ["a"]}, "tokens", id="not-an-id"),
    pytest.param("/detokenize", {"tokens": [2**31]}, "tokens", id="past-int32"),
])
def test_bad_bodies_are_400(base, path, body, param):
    r = _post(base, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_an_id_outside_the_vocabulary_is_400(base, served_model):
    r = _post(base, "/detokenize", {"model": served_model, "tokens": [1, 2**31 - 1]})
    assert r.status_code == 400
    assert "is not a token id of this model" in r.json()["error"]["message"]


def test_another_model_is_404(base):
    assert _post(base, "/tokenize", {"model": "gpt-4o", "prompt": "a"}).status_code == 404


def test_the_rpcs_refuse_bad_input_with_invalid_argument(stub):
    for call, request in ((stub.Tokenize, pb.TokenizeRequest()),
                          (stub.Tokenize, pb.TokenizeRequest(prompt="a", messages=[pb.ChatMessage(role="user")])),
                          (stub.Detokenize, pb.DetokenizeRequest(token_ids=[-5]))):
        with pytest.raises(grpc.RpcError) as refused:
            call(request, timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()


def test_the_rpcs_answer(stub, inference_server):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    ids = stub.Tokenize(pb.TokenizeRequest(prompt="hello world", add_special_tokens=False), timeout=30)
    assert ids.max_model_len == info.max_model_len and all(0 <= t < info.vocab_size for t in ids.token_ids)
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=ids.token_ids), timeout=30).text == "hello world"
