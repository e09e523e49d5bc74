"""chat_template_kwargs through the official `openai` SDK: the request's own variables reach the chat template.

A server started with its own --chat-template (a file written here) whose
template reads two request variables: it refuses to render unless `secret`
is "open" (raise_exception, whose message names the value it got) and writes
`style` into the prompt. A name the template already uses for something of
its own (messages, add_generation_prompt, bos_token, one of
apply_chat_template's parameters) is refused with a 400 naming it.
"""

from __future__ import annotations

import subprocess
import sys

import httpx2
import openai
import pytest

from structd.bench.harness import ServiceThread
from tests.conftest import REPO, InferenceServerThread

TEMPLATE = ("{% if secret != 'open' %}{{ raise_exception('secret is ' ~ secret) }}{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% if m.get('reasoning') %}[thought: {{ m['reasoning'] }}]{% endif %}{% endfor %}"
            "{% if style is defined %}<|style|>{{ style | join(',') if style is sequence and style is not string "
            "else style }}{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
ASK = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def inference_target(grammar_server, tmp_path_factory):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    template = tmp_path_factory.mktemp("template") / "kwargs.jinja"
    template.write_text(TEMPLATE)
    inference = InferenceServerThread(InferenceServiceConfig(
        host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar_server.target,), simulate_step_ms=1.0,
        chat_template=template, engine=EngineConfig(max_num_seqs=4, default_max_tokens=4)))
    yield inference.target
    inference.stop()


@pytest.fixture(scope="module")
def gateway_target(inference_target):
    from gateway.config import GatewayConfig
    from gateway.server import GatewayServer

    gateway = ServiceThread(GatewayServer(GatewayConfig(host="127.0.0.1", port=0, target=inference_target)),
                            "gateway", start_timeout=60.0)
    yield gateway.target
    gateway.stop()


@pytest.fixture(scope="module")
def client(gateway_target):
    sdk = openai.OpenAI(base_url=f"http://{gateway_target}/v1", api_key="unused", max_retries=0, timeout=120.0)
    yield sdk
    sdk.close()


def create(client, **kwargs):
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=kwargs.pop("messages", ASK), max_tokens=2,
                                          temperature=0, **kwargs)


def prompt_tokens(client, kwargs) -> int:
    return create(client, extra_body={"chat_template_kwargs": kwargs}).usage.prompt_tokens


def test_the_template_reads_the_request_variables(client):
    plain = prompt_tokens(client, {"secret": "open"})
    styled = prompt_tokens(client, {"secret": "open", "style": "terse and formal, in five words"})
    listed = prompt_tokens(client, {"secret": "open", "style": ["a", "b", "c", "d", "e", "f", "g", "h"]})
    assert plain < styled and plain < listed, "style was written into the prompt"


def test_tokenize_renders_with_them_too(client, gateway_target):
    kwargs = {"secret": "open", "style": "terse and formal, in five words"}
    model = client.models.list().data[0].id
    counted = httpx2.post(f"http://{gateway_target}/tokenize", timeout=60,
                         json={"model": model, "messages": ASK, "chat_template_kwargs": kwargs})
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == prompt_tokens(client, kwargs)
    refused = httpx2.post(f"http://{gateway_target}/tokenize", timeout=60,
                         json={"model": model, "messages": ASK, "chat_template_kwargs": {"secret": "shut"}})
    assert refused.status_code == 400 and "secret is shut" in refused.text


@pytest.mark.parametrize("kwargs, message", [
    pytest.param({}, "secret is", id="missing"),
    pytest.param({"secret": "shut"}, "secret is shut", id="wrong-value"),
    pytest.param({"secret": "open", "messages": []}, "'messages' is one of the chat template's own variables",
                 id="messages"),
    pytest.param({"secret": "open", "add_generation_prompt": False}, "'add_generation_prompt'",
                 id="add_generation_prompt"),
    pytest.param({"secret": "open", "bos_token": "<x>"}, "'bos_token'", id="special-token"),
    pytest.param({"secret": "open", "tokenize": True}, "'tokenize'", id="apply_chat_template-parameter"),
    pytest.param({"secret": "open", "tools": []}, "'tools'", id="tools"),
])
def test_refusals_name_the_variable(client, kwargs, message):
    with pytest.raises(openai.BadRequestError) as e:
        prompt_tokens(client, kwargs)
    assert message in str(e.value)


def test_assistant_thinking_reaches_the_template_under_either_name(client):
    extra = {"chat_template_kwargs": {"secret": "open"}}
    counts = [create(client, extra_body=extra, messages=[
        *ASK, {"role": "assistant", "content": "Hi", **fields}, {"role": "user", "content": "And?"}]).usage.prompt_tokens
        for fields in ({}, {"reasoning": "a long chain of thought"}, {"reasoning_content": "a long chain of thought"})]
    assert counts[0] < counts[1] == counts[2]


@pytest.mark.parametrize("flags, status, said", [
    pytest.param(["--chat", "--chat-template-kwargs", '{"secret": "open"}'], 0, "", id="read-by-the-template"),
    pytest.param(["--chat", "--chat-template-kwargs", '{"secret": "shut"}'], 1, "secret is shut",
                 id="the-template-refuses"),
    pytest.param(["--chat-template-kwargs", '{"secret": "open"}'], 2, "needs --chat", id="raw-prompt"),
    pytest.param(["--chat", "--chat-template-kwargs", '["secret"]'], 2, "JSON object", id="not-an-object"),
])
def test_structd_generate_passes_them(inference_target, flags, status, said):
    """`structd generate --chat --chat-template-kwargs JSON`: the same variables, over the Python client."""
    out = subprocess.run([sys.executable, "-m", "structd", "generate", "--target", inference_target, "--max-tokens",
                          "2", "--timeout-seconds", "60", "--json", *flags, "Hello"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == status, out.stderr
    assert said in out.stderr
