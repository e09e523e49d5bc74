"""The inference client (shared.inference_client) and `structd generate`.

Request building is checked field by field; streaming, error mapping,
cancellation, health polling and the CLI run against the real inference
service (the session's server on the embedded model) or a port nothing
listens on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest

from structd import generate as generate_cli
from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.inference_client import (AsyncInferenceClient, Completion, InferenceClient, InferenceError,
                                     RequestOptions, Usage, build_request, finish_reason_name)
from tests.conftest import REPO

PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
# Bounds a broken test only: every RPC here answers in milliseconds.
RPC_TIMEOUT = 10.0


# ---------------------------------------------------------------- helpers


def closed_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="structd generate")
    generate_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


# ---------------------------------------------------------------- build_request


@pytest.mark.parametrize("kwargs, expected", [
    pytest.param({}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams()), id="unconstrained"),
    pytest.param({"json_schema": '{"type": "string"}'},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(),
                                    constraint=pb.Constraint(json_schema='{"type": "string"}')), id="json_schema"),
    pytest.param({"regex": "[a-z]+"},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(),
                                    constraint=pb.Constraint(regex="[a-z]+")), id="regex"),
    pytest.param({"ebnf": 'root ::= "a"'},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(),
                                    constraint=pb.Constraint(ebnf='root ::= "a"')), id="ebnf"),
    pytest.param({"choice": ["red", "green"]},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(),
                                    constraint=pb.Constraint(choice=pb.ChoiceList(choices=["red", "green"]))),
                 id="choice"),
    pytest.param({"json_object": True},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(),
                                    constraint=pb.Constraint(json_object=True)), id="json_object"),
    pytest.param({"structural_tag": '{"type": "structural_tag"}'},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(),
                                    constraint=pb.Constraint(structural_tag='{"type": "structural_tag"}')),
                 id="structural_tag"),
    pytest.param({"regex": "a", "disable_jump_forward": True},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(),
                                    constraint=pb.Constraint(regex="a", disable_jump_forward=True)),
                 id="disable_jump_forward"),
    pytest.param({"disable_jump_forward": True}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams()),
                 id="disable_jump_forward-without-constraint-ignored"),
    pytest.param({"json_object": False}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams()),
                 id="json_object-false-is-no-constraint"),
    pytest.param({"max_tokens": 64}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(max_tokens=64)),
                 id="max_tokens"),
    pytest.param({"temperature": 0.5},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(temperature=0.5)), id="temperature"),
    pytest.param({"top_p": 0.25}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(top_p=0.25)),
                 id="top_p"),
    pytest.param({"top_k": 40}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(top_k=40)), id="top_k"),
    pytest.param({"seed": 7}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(seed=7)), id="seed"),
    pytest.param({"seed": 2**64 - 1},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(seed=2**64 - 1)), id="seed-max"),
    # OpenAI's and vLLM's seeds are int64: a negative one is its 64-bit two's complement, as at the gateway.
    pytest.param({"seed": -1}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(seed=2**64 - 1)),
                 id="seed-negative"),
    pytest.param({"presence_penalty": 0.5, "frequency_penalty": -1.0, "min_p": 0.1, "logit_bias": {5: -100.0},
                  "stop_token_ids": [2, 3], "include_stop_str_in_output": True},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(
                     presence_penalty=0.5, frequency_penalty=-1.0, min_p=0.1, logit_bias={5: -100.0},
                     stop_token_ids=[2, 3], include_stop_str_in_output=True)), id="openai-sampling"),
    pytest.param({"stop": ["\n", "END"]},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(stop=["\n", "END"])), id="stop"),
    pytest.param({"stop": "END"}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(stop=["END"])),
                 id="stop-single-string"),
    pytest.param({"ignore_eos": True},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(ignore_eos=True)), id="ignore_eos"),
    pytest.param({"logprobs": True, "top_logprobs": 5},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(logprobs=True, top_logprobs=5)),
                 id="logprobs"),
    pytest.param({"min_tokens": 3, "repetition_penalty": 1.25},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(min_tokens=3, repetition_penalty=1.25)),
                 id="min_tokens-repetition_penalty"),
    pytest.param({"request_id": "r-1"},
                 pb.GenerateRequest(request_id="r-1", prompt="p", sampling=pb.SamplingParams()), id="request_id"),
    pytest.param({"n": 4}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(n=4)), id="n"),
    pytest.param({"n": 1}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams()), id="n-1-is-the-default"),
])
def test_build_request(kwargs, expected):
    assert build_request("p", **kwargs) == expected


_P = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.mark.parametrize("prompt, kwargs, expected", [
    pytest.param([{"role": "user", "content": "hi"}], {},
                 pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")], sampling=pb.SamplingParams()),
                 id="messages"),
    pytest.param([5, 6, 7], {}, pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams()),
                 id="token-ids"),
    pytest.param([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}], {},
        pb.GenerateRequest(messages=[pb.ChatMessage(role="assistant", tool_calls=[
            pb.ToolCall(id="call_1", name="f", arguments_json='{"a":1}')])], sampling=pb.SamplingParams()),
        id="openai-tool-call-history"),
    pytest.param("p", {"tools": [{"type": "function", "function": {"name": "w", "parameters": _P}}],
                       "tool_choice": "required"},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(),
                                    tools=[pb.Tool(name="w", parameters_json_schema=json.dumps(_P))],
                                    tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)),
                 id="openai-tools-required"),
    pytest.param("p", {"tools": [{"name": "w", "description": "d"}], "tool_choice": "w"},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(), tools=[pb.Tool(name="w", description="d")],
                                    tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NAMED, name="w")),
                 id="named-tool"),
    pytest.param("p", {"reasoning": True, "max_thinking_tokens": 9},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(), reasoning=True, max_thinking_tokens=9),
                 id="reasoning"),
    pytest.param([{"role": "user", "content": "hi"}], {"chat_template_kwargs": {"style": ["a", 1]}},
                 pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")], sampling=pb.SamplingParams(),
                                    chat_template_kwargs_json='{"style": ["a", 1]}'), id="chat_template_kwargs"),
    pytest.param("p", {"parallel_tool_calls": False},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(), parallel_tool_calls=False),
                 id="parallel_tool_calls-false"),
    pytest.param("p", {"parallel_tool_calls": None, "chat_template_kwargs": {}},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams()), id="unset-sends-neither"),
    pytest.param("p", {"json_object": True, "json_options": {"whitespace": "indented", "indent": 4}},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(), constraint=pb.Constraint(
                     json_object=True, json_options=pb.JsonOptions(whitespace=pb.JSON_WHITESPACE_INDENTED, indent=4))),
                 id="json-options"),
])
def test_build_request_chat_and_tools(prompt, kwargs, expected):
    assert build_request(prompt, **kwargs) == expected


def test_reasoning_unset_is_not_sent():
    assert not build_request([{"role": "user", "content": "x"}]).HasField("reasoning")


@pytest.mark.parametrize("kind, value", [
    pytest.param("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}, id="json_schema"),
    pytest.param("structural_tag", {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}},
                 id="structural_tag"),
])
def test_dict_constraints_are_sent_as_json(kind, value):
    request = build_request("p", **{kind: value})
    assert request.constraint.WhichOneof("kind") == kind
    assert json.loads(getattr(request.constraint, kind)) == value


def test_seed_presence_unset_vs_zero():
    # proto3 `optional`: unset means a random seed, 0 is a real seed.
    assert not build_request("p").sampling.HasField("seed")
    assert not build_request("p", seed=None).sampling.HasField("seed")
    zero = build_request("p", seed=0)
    assert zero.sampling.HasField("seed") and zero.sampling.seed == 0
    wire = pb.GenerateRequest.FromString(zero.SerializeToString())
    assert wire.sampling.HasField("seed")


@pytest.mark.parametrize("kwargs, named", [
    pytest.param({"json_schema": "{}", "regex": "a"}, ["json_schema", "regex"], id="schema+regex"),
    pytest.param({"ebnf": "x", "choice": ["a"]}, ["ebnf", "choice"], id="ebnf+choice"),
    pytest.param({"json_object": True, "structural_tag": "{}"}, ["json_object", "structural_tag"],
                 id="json_object+structural_tag"),
    pytest.param({"regex": "", "ebnf": ""}, ["regex", "ebnf"], id="empty-strings-count"),
    pytest.param({"json_schema": "{}", "regex": "a", "choice": []}, ["json_schema", "regex", "choice"],
                 id="three"),
])
def test_conflicting_constraints(kwargs, named):
    with pytest.raises(ValueError) as info:
        build_request("p", **kwargs)
    for name in named:
        assert name in str(info.value)


def test_choice_must_not_be_a_string():
    with pytest.raises(TypeError):
        build_request("p", choice="red")


def test_request_options_match_build_request():
    # RequestOptions types the clients' **options: it must list exactly build_request's keywords.
    params = inspect.signature(build_request).parameters
    keywords = {name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(RequestOptions.__annotations__) == keywords


@pytest.mark.parametrize("value, name", [
    pytest.param(pb.FINISH_REASON_UNSPECIFIED, None, id="unspecified"),
    pytest.param(pb.FINISH_REASON_STOP, "stop", id="stop"),
    pytest.param(pb.FINISH_REASON_LENGTH, "length", id="length"),
    pytest.param(pb.FINISH_REASON_STOP_STRING, "stop_string", id="stop_string"),
    pytest.param(pb.FINISH_REASON_CANCELLED, "cancelled", id="cancelled"),
    pytest.param(pb.FINISH_REASON_ERROR, "error", id="error"),
    pytest.param(pb.FINISH_REASON_TOOL_CALLS, "tool_calls", id="tool_calls"),
    pytest.param(99, "unknown_99", id="newer-than-client"),
])
def test_finish_reason_name(value, name):
    assert finish_reason_name(value) == name


def test_every_finish_reason_is_mapped():
    # A value added to the proto must get a test row above.
    assert sorted(pb.FinishReason.values()) == [0, 1, 2, 3, 4, 5, 6]


def test_inference_error_str():
    error = InferenceError(grpc.StatusCode.INVALID_ARGUMENT, "bad schema")
    assert str(error) == "INVALID_ARGUMENT: bad schema"
    assert isinstance(error, Exception) and error.code is grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------- sync client against the real service


def _idle(server, timeout: float = 30.0) -> bool:
    """True once the engine holds no request (KV and grammar state freed)."""
    deadline = time.monotonic() + timeout
    while server.run_sync(lambda: server.server.engine.num_active):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_generate_streams_chunks(inference_client):
    chunks = list(inference_client.generate("hello", regex="[a-z]{5}", seed=0, temperature=1.0, timeout=RPC_TIMEOUT))
    *body, last = chunks
    assert all(c.finish_reason is None and c.usage is None for c in body)
    assert last.finish_reason == "stop"
    ids = [t for c in chunks for t in c.token_ids]
    assert last.usage == Usage(last.usage.prompt_tokens, len(ids), last.usage.forced_tokens)
    text = "".join(c.text for c in chunks)
    assert len(text) == 5 and text.isalpha()


def test_complete_collects(inference_client):
    chunks = list(inference_client.generate("hello", choice=["Hello", "Bye"], timeout=RPC_TIMEOUT))
    done = inference_client.complete("hello", choice=["Hello", "Bye"], timeout=RPC_TIMEOUT)
    assert done == Completion("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                              chunks[-1].finish_reason, chunks[-1].usage)
    assert done.text in ("Hello", "Bye")


def test_chat_with_tools_and_thinking_comes_back_parsed(inference_client):
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    chat = [{"role": "user", "content": "Weather in Paris?"}]
    done = inference_client.complete(chat, tools=tools, tool_choice="required", reasoning=True, max_thinking_tokens=3,
                                     max_tokens=80, temperature=0, timeout=RPC_TIMEOUT)
    assert done.finish_reason == "tool_calls" and done.usage.reasoning_tokens == 4 and done.reasoning_text
    assert done.tool_calls and all(c.name == "get_weather" and "city" in c.arguments for c in done.tool_calls)
    follow_up = chat + [{"role": "assistant", "tool_calls": done.tool_calls},
                        {"role": "tool", "tool_call_id": done.tool_calls[0].id, "content": "sunny"}]
    assert inference_client.complete(follow_up, max_tokens=4, timeout=RPC_TIMEOUT).usage.completion_tokens == 4


def test_status_becomes_inference_error(inference_client):
    with pytest.raises(InferenceError) as info:
        inference_client.complete("hello", regex="[a-", timeout=RPC_TIMEOUT)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert str(info.value).startswith("INVALID_ARGUMENT: constraint:")


def test_invalid_arguments_fail_before_the_rpc(inference_client, inference_server):
    requests = inference_server.server.metrics.registry.get_sample_value
    before = requests("inference_svc_prompt_tokens_total")
    with pytest.raises(ValueError):
        inference_client.generate("hello", regex="a", ebnf="b")
    assert requests("inference_svc_prompt_tokens_total") == before


def test_breaking_out_cancels_the_rpc(inference_client, inference_server):
    for chunk in inference_client.generate("endless", max_tokens=500, ignore_eos=True, timeout=60):
        break
    # The channel is still open: only leaving the loop can have cancelled the RPC.
    assert _idle(inference_server)


def test_unavailable():
    with InferenceClient(f"127.0.0.1:{closed_port()}") as client:
        with pytest.raises(InferenceError) as info:
            client.complete("hello", timeout=RPC_TIMEOUT)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE


def test_wait_ready(inference_server):
    with InferenceClient(inference_server.target) as client:
        client.wait_ready(RPC_TIMEOUT)
    with InferenceClient(f"127.0.0.1:{closed_port()}") as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.wait_ready(0.3)
        assert time.monotonic() - start < 5.0


# ---------------------------------------------------------------- async client against the real service


def test_async_client(inference_server):
    async def go():
        async with AsyncInferenceClient(inference_server.target) as client:
            await client.wait_ready(RPC_TIMEOUT)
            chunks = [c async for c in client.generate("hello", choice=["Hello"], timeout=RPC_TIMEOUT)]
            assert "".join(c.text for c in chunks) == "Hello" and chunks[-1].finish_reason == "stop"
            done = await client.complete("hello", choice=["Hello"], timeout=RPC_TIMEOUT)
            assert (done.text, done.finish_reason) == ("Hello", "stop")
            with pytest.raises(InferenceError) as info:
                await client.complete("hello", regex="[a-", timeout=RPC_TIMEOUT)
            assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(ValueError):
                client.generate("hello", json_object=True, regex="a")

            async with contextlib.aclosing(client.generate("endless", max_tokens=500, ignore_eos=True,
                                                           timeout=60)) as stream:
                async for chunk in stream:
                    break
            assert await asyncio.to_thread(_idle, inference_server)

        async with AsyncInferenceClient(f"127.0.0.1:{closed_port()}") as client:
            with pytest.raises(InferenceError) as info:
                await client.complete("hello", timeout=RPC_TIMEOUT)
            assert info.value.code is grpc.StatusCode.UNAVAILABLE
            with pytest.raises(TimeoutError):
                await client.wait_ready(0.3)

    asyncio.run(go())


# ---------------------------------------------------------------- structd generate


def test_cli_streams_text(inference_server, capsys):
    code = generate_cli.run(cli_args("--target", inference_server.target, "--choice", "Hello", "--choice", "Bye",
                                     "--seed", "0", "--temperature", "1", "--stop", "END", "--stop", "\n",
                                     "--no-jump-forward", "--timeout-seconds", str(RPC_TIMEOUT), "hello"))
    out, err = capsys.readouterr()
    assert (code, err) == (0, "") and out in ("Hello", "Bye")


def test_cli_json(inference_server, capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, '
                      '"required": ["n"]}')
    code = generate_cli.run(cli_args("--target", inference_server.target, "--json-schema", str(schema), "--json",
                                     "--max-tokens", "20", "--temperature", "0.7", "--top-p", "0.9",
                                     "--top-k", "3", "--timeout-seconds", str(RPC_TIMEOUT), "hello"))
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert out.count("\n") == 1
    line = json.loads(out)
    assert set(line) == {"text", "finish_reason", "usage", "schema_check", "schema_violations",
                         "schema_check_detail"} and line["finish_reason"] == "stop"
    assert (line["schema_check"], line["schema_violations"]) == ("valid", [])  # no warnings: every keyword enforced
    assert 0 <= json.loads(line["text"])["n"] <= 9
    assert set(line["usage"]) == {"prompt_tokens", "completion_tokens", "forced_tokens"}
    assert line["usage"]["completion_tokens"] >= line["usage"]["forced_tokens"] > 0


def test_cli_json_logprobs(inference_server, capsys):
    code = generate_cli.run(cli_args("--target", inference_server.target, "--json", "--max-tokens", "5",
                                     "--ignore-eos", "--logprobs", "3", "--min-tokens", "5",
                                     "--repetition-penalty", "1.5", "--timeout-seconds", str(RPC_TIMEOUT), "hi"))
    out, err = capsys.readouterr()
    line = json.loads(out)
    assert (code, err) == (0, "") and line["usage"]["completion_tokens"] == 5
    assert len(line["logprobs"]) == 5
    for lp in line["logprobs"]:
        assert set(lp) == {"token_id", "token", "bytes", "logprob", "forced", "top_logprobs"}
        assert bytes(lp["bytes"]).decode("utf-8", "replace") == lp["token"] and lp["logprob"] <= 0
        assert [t["logprob"] for t in lp["top_logprobs"]] == sorted((t["logprob"] for t in lp["top_logprobs"]),
                                                                     reverse=True)
        assert len(lp["top_logprobs"]) == 3 and lp["top_logprobs"][0]["token_id"] == lp["token_id"]  # greedy


def test_cli_stream_logprobs_go_to_stderr_after_the_text(inference_server, capsys):
    code = generate_cli.run(cli_args("--target", inference_server.target, "--choice", "yes", "--choice", "no",
                                     "--logprobs", "2", "--timeout-seconds", str(RPC_TIMEOUT), "Well?"))
    out, err = capsys.readouterr()
    assert code == 0 and out in ("yes", "no")
    lines = err.splitlines()
    assert lines and all(float(line.split("\t")[0]) <= 0 for line in lines)
    assert "".join(json.loads(line.split("\t")[1]) for line in lines).startswith(out)


def test_cli_length_finish(inference_server, capsys):
    code = generate_cli.run(cli_args("--target", inference_server.target, "--json", "--max-tokens", "3",
                                     "--ignore-eos", "hi"))
    line = json.loads(capsys.readouterr().out)
    assert code == 0 and line["finish_reason"] == "length" and line["usage"]["completion_tokens"] == 3


def test_cli_reads_file_from_stdin(inference_server, capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO('root ::= "Hello"'))
    code = generate_cli.run(cli_args("--target", inference_server.target, "--ebnf", "-", "--json", "hello"))
    assert code == 0 and json.loads(capsys.readouterr().out)["text"] == "Hello"


def test_cli_rpc_error(inference_server, capsys):
    code = generate_cli.run(cli_args("--target", inference_server.target, "--regex", "[a-", "hello"))
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.startswith("error: INVALID_ARGUMENT: constraint:") and "Traceback" not in err


def test_cli_unavailable(capsys):
    code = generate_cli.run(cli_args("--target", f"127.0.0.1:{closed_port()}", "--timeout-seconds",
                                     str(RPC_TIMEOUT), "hello"))
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.startswith("error: UNAVAILABLE: ") and "Traceback" not in err


def test_cli_unavailable_subprocess():
    proc = subprocess.run([PYTHON, "-m", "structd.generate", "--target", f"127.0.0.1:{closed_port()}",
                           "--timeout-seconds", str(RPC_TIMEOUT), "--json", "hello"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: UNAVAILABLE: ") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag", ["--json-schema", "--ebnf", "--structural-tag"])
def test_cli_missing_file(capsys, tmp_path, flag):
    missing = tmp_path / "nope.json"
    code = generate_cli.run(cli_args("--target", f"127.0.0.1:{closed_port()}", flag, str(missing), "hello"))
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == f"error: cannot read {missing}: No such file or directory\n"


@pytest.mark.parametrize("argv", [
    pytest.param(["--regex", "a", "--json-object"], id="regex+json-object"),
    pytest.param(["--json-schema", "s.json", "--ebnf", "g.ebnf"], id="json-schema+ebnf"),
    pytest.param(["--choice", "a", "--structural-tag", "t.json"], id="choice+structural-tag"),
    pytest.param(["--seed", str(-(2**63) - 1)], id="seed-below-int64"),
    pytest.param(["--seed", str(2**64)], id="seed-above-uint64"),
    pytest.param(["--max-tokens", "lots"], id="non-int-max-tokens"),
    pytest.param(["--logprobs", "21"], id="logprobs-over-20"),
    pytest.param(["--min-tokens", "-1"], id="negative-min-tokens"),
    pytest.param([], id="no-prompt"),
])
def test_cli_usage_errors(capsys, argv):
    with pytest.raises(SystemExit) as info:
        cli_args(*argv, *(["hello"] if argv else []))
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_cli_choice_repeats_and_defaults():
    args = cli_args("--choice", "a", "--choice", "b", "hello")
    assert args.choice == ["a", "b"] and args.target == "127.0.0.1:50051"
    assert args.seed is None and args.stop is None and args.timeout_seconds is None


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_cli_ctrl_c_subprocess(inference_server):
    proc = subprocess.Popen([PYTHON, "-m", "structd.generate", "--target", inference_server.target,
                             "--max-tokens", "2000", "--ignore-eos", "--temperature", "1",
                             "--regex", "x[a-z]+", "endless"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # As from a terminal: a test run started in the background (`make test &`) has
                            # SIGINT ignored, which its children would inherit, so Python installs no handler.
                            preexec_fn=_default_sigint)
    try:
        assert proc.stdout.read(1) == "x"  # streaming has started
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert _idle(inference_server)
