"""The inference client (shared.inference_client) and `structd generate`, without the real service.

Request building is checked field by field; streaming, error mapping,
cancellation, health polling and the CLI run against a scripted in-process
InferenceService (FakeInference) or a port nothing listens on. End-to-end
tests against the real inference service live with that service.
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
import threading
import time
from concurrent import futures
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared import generate_cli
from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from shared.inference_client import (AsyncInferenceClient, Chunk, Completion, InferenceClient, InferenceError,
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


class FakeInference(pb_grpc.InferenceServiceServicer):
    """Answers by prompt: "hello" streams two chunks then STOP; "abort" fails
    with INVALID_ARGUMENT; "endless" streams until cancelled; "error" ends
    with FINISH_REASON_ERROR; "unfinished" ends without a finish reason."""

    def __init__(self):
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled = threading.Event()

    def Generate(self, request, context) -> Iterator[pb.GenerateResponse]:
        self.requests.append(request)
        if request.prompt == "abort":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the schema does not parse")
        if request.prompt == "endless":
            context.add_callback(self.cancelled.set)
            deadline = time.monotonic() + RPC_TIMEOUT
            while context.is_active() and time.monotonic() < deadline:
                yield pb.GenerateResponse(token_ids=[1], text="x")
                time.sleep(0.01)
            return
        yield pb.GenerateResponse(token_ids=[11, 12], text="Hel")
        yield pb.GenerateResponse(token_ids=[13], text="lo")
        if request.prompt == "unfinished":
            return
        reason = pb.FINISH_REASON_ERROR if request.prompt == "error" else pb.FINISH_REASON_STOP
        yield pb.GenerateResponse(finish_reason=reason,
                                  usage=pb.Usage(prompt_tokens=4, completion_tokens=3, forced_tokens=1))


@pytest.fixture(scope="module")
def fake():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = FakeInference()
    pb_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.target = f"127.0.0.1:{port}"
    yield servicer
    server.stop(grace=None)


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
    pytest.param({"stop": ["\n", "END"]},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(stop=["\n", "END"])), id="stop"),
    pytest.param({"stop": "END"}, pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(stop=["END"])),
                 id="stop-single-string"),
    pytest.param({"ignore_eos": True},
                 pb.GenerateRequest(prompt="p", sampling=pb.SamplingParams(ignore_eos=True)), id="ignore_eos"),
    pytest.param({"request_id": "r-1"},
                 pb.GenerateRequest(request_id="r-1", prompt="p", sampling=pb.SamplingParams()), id="request_id"),
])
def test_build_request(kwargs, expected):
    assert build_request("p", **kwargs) == expected


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
    pytest.param(99, "unknown_99", id="newer-than-client"),
])
def test_finish_reason_name(value, name):
    assert finish_reason_name(value) == name


def test_every_finish_reason_is_mapped():
    # A value added to the proto must get a test row above.
    assert sorted(pb.FinishReason.values()) == [0, 1, 2, 3, 4, 5]


def test_inference_error_str():
    error = InferenceError(grpc.StatusCode.INVALID_ARGUMENT, "bad schema")
    assert str(error) == "INVALID_ARGUMENT: bad schema"
    assert isinstance(error, Exception) and error.code is grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------- sync client against the fake


def test_generate_streams_chunks(fake):
    with InferenceClient(fake.target) as client:
        chunks = list(client.generate("hello", regex="[a-z]+", seed=0, timeout=RPC_TIMEOUT))
    assert chunks == [
        Chunk([11, 12], "Hel", None, None),
        Chunk([13], "lo", None, None),
        Chunk([], "", "stop", Usage(4, 3, 1)),
    ]
    sent = fake.requests[-1]
    assert sent.constraint.regex == "[a-z]+" and sent.sampling.HasField("seed")


def test_complete_collects(fake):
    with InferenceClient(fake.target) as client:
        assert client.complete("hello", timeout=RPC_TIMEOUT) == Completion("Hello", [11, 12, 13], "stop",
                                                                           Usage(4, 3, 1))
        assert client.complete("error", timeout=RPC_TIMEOUT).finish_reason == "error"
        with pytest.raises(InferenceError, match="without a finish reason"):
            client.complete("unfinished", timeout=RPC_TIMEOUT)


def test_status_becomes_inference_error(fake):
    with InferenceClient(fake.target) as client:
        with pytest.raises(InferenceError) as info:
            client.complete("abort", timeout=RPC_TIMEOUT)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert str(info.value) == "INVALID_ARGUMENT: the schema does not parse"


def test_invalid_arguments_fail_before_the_rpc(fake):
    before = len(fake.requests)
    with InferenceClient(fake.target) as client:
        with pytest.raises(ValueError):
            client.generate("hello", regex="a", ebnf="b")
    assert len(fake.requests) == before


def test_breaking_out_cancels_the_rpc(fake):
    fake.cancelled.clear()
    with InferenceClient(fake.target) as client:
        for chunk in client.generate("endless", timeout=RPC_TIMEOUT):
            break
        # The channel is still open: only leaving the loop can have cancelled the RPC.
        assert fake.cancelled.wait(RPC_TIMEOUT)


def test_unavailable(fake):
    with InferenceClient(f"127.0.0.1:{closed_port()}") as client:
        with pytest.raises(InferenceError) as info:
            client.complete("hello", timeout=RPC_TIMEOUT)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE


def test_wait_ready(fake):
    with InferenceClient(fake.target) as client:
        client.wait_ready(RPC_TIMEOUT)
    with InferenceClient(f"127.0.0.1:{closed_port()}") as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.wait_ready(0.3)
        assert time.monotonic() - start < 5.0


# ---------------------------------------------------------------- async client against the fake


def test_async_client(fake):
    async def go():
        async with AsyncInferenceClient(fake.target) as client:
            await client.wait_ready(RPC_TIMEOUT)
            chunks = [c async for c in client.generate("hello", choice=["Hello"], timeout=RPC_TIMEOUT)]
            assert [c.text for c in chunks] == ["Hel", "lo", ""]
            assert await client.complete("hello", timeout=RPC_TIMEOUT) == Completion(
                "Hello", [11, 12, 13], "stop", Usage(4, 3, 1))
            with pytest.raises(InferenceError) as info:
                await client.complete("abort", timeout=RPC_TIMEOUT)
            assert str(info.value) == "INVALID_ARGUMENT: the schema does not parse"
            with pytest.raises(ValueError):
                client.generate("hello", json_object=True, regex="a")

            fake.cancelled.clear()
            async with contextlib.aclosing(client.generate("endless", timeout=RPC_TIMEOUT)) as stream:
                async for chunk in stream:
                    break
            assert await asyncio.to_thread(fake.cancelled.wait, RPC_TIMEOUT)

        async with AsyncInferenceClient(f"127.0.0.1:{closed_port()}") as client:
            with pytest.raises(InferenceError) as info:
                await client.complete("hello", timeout=RPC_TIMEOUT)
            assert info.value.code is grpc.StatusCode.UNAVAILABLE
            with pytest.raises(TimeoutError):
                await client.wait_ready(0.3)

    asyncio.run(go())


# ---------------------------------------------------------------- structd generate


def test_cli_streams_text(fake, capsys):
    code = generate_cli.run(cli_args("--target", fake.target, "--choice", "Hello", "--choice", "Bye",
                                     "--seed", "0", "--stop", "END", "--stop", "\n", "--no-jump-forward",
                                     "--timeout-seconds", str(RPC_TIMEOUT), "hello"))
    out, err = capsys.readouterr()
    assert (code, out, err) == (0, "Hello", "")
    sent = fake.requests[-1]
    assert list(sent.constraint.choice.choices) == ["Hello", "Bye"] and sent.constraint.disable_jump_forward
    assert sent.sampling.HasField("seed") and list(sent.sampling.stop) == ["END", "\n"]


def test_cli_json(fake, capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "string"}')
    code = generate_cli.run(cli_args("--target", fake.target, "--json-schema", str(schema), "--json",
                                     "--max-tokens", "5", "--temperature", "0.7", "--top-p", "0.9",
                                     "--top-k", "3", "--ignore-eos", "--timeout-seconds", str(RPC_TIMEOUT),
                                     "hello"))
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert out.count("\n") == 1
    assert json.loads(out) == {"text": "Hello", "finish_reason": "stop",
                               "usage": {"prompt_tokens": 4, "completion_tokens": 3, "forced_tokens": 1}}
    sent = fake.requests[-1]
    assert sent.constraint.json_schema == '{"type": "string"}' and not sent.sampling.HasField("seed")
    assert (sent.sampling.max_tokens, sent.sampling.top_k, sent.sampling.ignore_eos) == (5, 3, True)
    assert sent.sampling.temperature == pytest.approx(0.7) and sent.sampling.top_p == pytest.approx(0.9)


def test_cli_reads_file_from_stdin(fake, capsys, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO('root ::= "Hello"'))
    code = generate_cli.run(cli_args("--target", fake.target, "--ebnf", "-", "--json", "hello"))
    assert code == 0 and json.loads(capsys.readouterr().out)["text"] == "Hello"
    assert fake.requests[-1].constraint.ebnf == 'root ::= "Hello"'


def test_cli_rpc_error(fake, capsys):
    code = generate_cli.run(cli_args("--target", fake.target, "--json-object", "abort"))
    out, err = capsys.readouterr()
    assert (code, out, err) == (1, "", "error: INVALID_ARGUMENT: the schema does not parse\n")


@pytest.mark.parametrize("prompt", ["error", "unfinished"])
def test_cli_generation_ended_early(fake, capsys, prompt):
    code = generate_cli.run(cli_args("--target", fake.target, prompt))
    out, err = capsys.readouterr()
    assert code == 1 and out == "Hello" and err.startswith("error: generation ended early")


def test_cli_unavailable(capsys):
    code = generate_cli.run(cli_args("--target", f"127.0.0.1:{closed_port()}", "--timeout-seconds",
                                     str(RPC_TIMEOUT), "hello"))
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert err.startswith("error: UNAVAILABLE: ") and "Traceback" not in err


def test_cli_unavailable_subprocess():
    proc = subprocess.run([PYTHON, "-m", "shared.generate_cli", "--target", f"127.0.0.1:{closed_port()}",
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
    pytest.param(["--seed", "-1"], id="negative-seed"),
    pytest.param(["--max-tokens", "lots"], id="non-int-max-tokens"),
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


def test_cli_ctrl_c_subprocess(fake):
    fake.cancelled.clear()
    proc = subprocess.Popen([PYTHON, "-m", "shared.generate_cli", "--target", fake.target,
                             "--timeout-seconds", str(RPC_TIMEOUT), "endless"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.read(1) == "x"  # streaming has started
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert fake.cancelled.wait(RPC_TIMEOUT)
