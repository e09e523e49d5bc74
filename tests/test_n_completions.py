"""n completions of one prompt (issue 25) through the real inference service: SamplingParams.n validated
against --max-n, one stream carrying every completion under its index until each has finished, seeds that
differ per completion, one cancel for all, a constraint applied to each, the prompt's prefix-cache hits in
usage, and the clients' complete_all and `structd generate --n`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re

import grpc
import pytest

from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from shared.inference_client import AsyncInferenceClient, InferenceError, build_request
from structd import generate as generate_cli
from tests.conftest import wait_until

# Bounds a broken test only.
RPC_TIMEOUT = 60.0
CODE = "[a-z]{3}-[0-9]{3}"


def generate(server, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    """The raw responses of one Generate call."""
    with grpc.insecure_channel(server.target) as channel:
        return list(pb_grpc.InferenceServiceStub(channel).Generate(request, timeout=RPC_TIMEOUT))


def assert_idle(server) -> None:
    """Waits for the engine to hold no request (every completion's KV and grammar state freed)."""
    wait_until(lambda: not server.run_sync(lambda: server.server.engine.num_active), "every completion freed")


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("n, completions", [
    pytest.param(0, 1, id="zero-is-one"),
    pytest.param(1, 1, id="one"),
    pytest.param(16, 16, id="the-max"),
])
def test_n_within_the_max_gives_n_completions(inference_server, n, completions):
    responses = generate(inference_server, build_request("Count:", n=n, max_tokens=2, ignore_eos=True))
    finished = [r.index for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(finished) == list(range(completions))


@pytest.mark.parametrize("n", [
    pytest.param(17, id="above-max-n"),
    pytest.param(-1, id="negative"),
    pytest.param(2**31 - 1, id="int32-max"),
])
def test_n_outside_the_range_is_invalid_naming_the_flag(inference_client, n):
    with pytest.raises(InferenceError) as e:
        inference_client.complete_all("Count:", n=n, max_tokens=2, timeout=RPC_TIMEOUT)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-n" in e.value.message and "16" in e.value.message and str(n) in e.value.message


# ---------------------------------------------------------------- the stream


def test_each_completion_streams_under_its_index_and_finishes_once(inference_server):
    responses = generate(inference_server, build_request("Once upon a time", n=4, temperature=1.0, seed=3,
                                                         max_tokens=6, ignore_eos=True))
    finishes = [r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(r.index for r in finishes) == [0, 1, 2, 3]
    assert responses[-1] is finishes[-1], "the stream ends with the last completion's finish"
    for r in finishes:
        tokens = [t for x in responses if x.index == r.index for t in x.token_ids]
        assert r.finish_reason == pb.FINISH_REASON_LENGTH and r.usage.completion_tokens == len(tokens) == 6
        assert r.usage.prompt_tokens == finishes[0].usage.prompt_tokens, "one prompt"
        later = [x for x in responses[responses.index(r) + 1:] if x.index == r.index]
        assert not later, f"completion {r.index} sent responses after its finish"
    assert all(not r.HasField("usage") for r in responses if r.finish_reason == pb.FINISH_REASON_UNSPECIFIED)


def test_warnings_only_on_the_calls_first_response(inference_server):
    # uniqueItems is not enforced by the grammar: a warning.
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "uniqueItems": True,
              "maxItems": 3}
    responses = generate(inference_server, build_request("Digits:", json_schema=schema, n=3, temperature=1.0,
                                                         seed=1, max_tokens=12))
    assert [w.keyword for w in responses[0].warnings] == ["uniqueItems"]
    assert all(not r.warnings for r in responses[1:])
    checked = [r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
    assert sorted(r.index for r in checked) == [0, 1, 2]


def test_seeded_completions_differ_and_repeat(inference_client):
    def sample():
        return [c.token_ids for c in inference_client.complete_all("The weather today is", n=4, temperature=1.0,
                                                                   seed=11, max_tokens=12, ignore_eos=True,
                                                                   timeout=RPC_TIMEOUT)]

    first = sample()
    assert len({tuple(ids) for ids in first}) > 1, "each completion samples with its own seed"
    assert sample() == first, "the same seed gives the same completions"


def test_a_constraint_holds_for_every_completion(inference_client):
    completions = inference_client.complete_all("A code:", regex=CODE, n=5, temperature=1.0, seed=5,
                                                timeout=RPC_TIMEOUT)
    assert [c.index for c in completions] == [0, 1, 2, 3, 4]
    for c in completions:
        assert c.finish_reason == "stop" and re.fullmatch(CODE, c.text), c


def test_leaving_the_stream_cancels_every_completion(inference_client, inference_server):
    seen = set()
    for chunk in inference_client.generate("endless", n=3, max_tokens=500, ignore_eos=True, temperature=1.0,
                                           timeout=RPC_TIMEOUT):
        seen.add(chunk.index)
        if seen == {0, 1, 2}:
            break
    assert_idle(inference_server)


def test_a_shared_prompt_is_served_from_the_prefix_cache(inference_client):
    # Four full 16-token blocks and more: the second request finds the first's blocks.
    prompt = "Extract the fields of the following record as JSON. " * 8
    first = inference_client.complete(prompt + "Record one.", max_tokens=2, ignore_eos=True, timeout=RPC_TIMEOUT)
    again = inference_client.complete(prompt + "Record two.", max_tokens=2, ignore_eos=True, timeout=RPC_TIMEOUT)
    assert again.usage.prompt_tokens > 64
    assert 64 <= again.usage.cached_prompt_tokens < again.usage.prompt_tokens
    assert first.usage.cached_prompt_tokens <= again.usage.cached_prompt_tokens


# ---------------------------------------------------------------- the clients


def test_complete_is_for_one_completion(inference_client):
    with pytest.raises(ValueError, match="complete_all"):
        inference_client.complete("hi", n=2)
    (only,) = inference_client.complete_all("hi", max_tokens=2, timeout=RPC_TIMEOUT)
    assert only.index == 0 and only.finish_reason in ("stop", "length")


def test_async_complete_all(inference_server):
    async def go():
        async with AsyncInferenceClient(inference_server.target) as client:
            completions = await client.complete_all("A code:", regex=CODE, n=3, temperature=1.0, seed=2,
                                                    timeout=RPC_TIMEOUT)
            assert [c.index for c in completions] == [0, 1, 2]
            assert all(re.fullmatch(CODE, c.text) for c in completions)
            with pytest.raises(ValueError, match="complete_all"):
                await client.complete("hi", n=3)
            with pytest.raises(InferenceError) as e:
                await client.complete_all("hi", n=17, timeout=RPC_TIMEOUT)
            assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT
            seen = set()
            async with contextlib.aclosing(client.generate("endless", n=2, max_tokens=500, ignore_eos=True,
                                                           timeout=RPC_TIMEOUT)) as stream:
                async for chunk in stream:
                    seen.add(chunk.index)
                    if seen == {0, 1}:
                        break
        await asyncio.to_thread(assert_idle, inference_server)

    asyncio.run(go())


def cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="structd generate")
    generate_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_json_prints_one_line_per_completion(inference_server, capsys):
    code = generate_cli.run(cli_args("--target", inference_server.target, "--regex", CODE, "--n", "3",
                                     "--temperature", "1", "--seed", "4", "--json", "--timeout-seconds",
                                     str(RPC_TIMEOUT), "A code:"))
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2]
    assert all(line["finish_reason"] == "stop" and re.fullmatch(CODE, line["text"]) for line in lines)


def test_cli_text_labels_each_completion(inference_server, capsys):
    code = generate_cli.run(cli_args("--target", inference_server.target, "--choice", "yes", "--choice", "no",
                                     "--n", "2", "--temperature", "1", "--timeout-seconds", str(RPC_TIMEOUT),
                                     "Well?"))
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert [lines[0], lines[2]] == ["--- completion 0 (stop) ---", "--- completion 1 (stop) ---"]
    assert {lines[1], lines[3]} <= {"yes", "no"} and len(lines) == 4


def test_cli_n_above_the_servers_max_fails(inference_server, capsys):
    code = generate_cli.run(cli_args("--target", inference_server.target, "--n", "17", "--timeout-seconds",
                                     str(RPC_TIMEOUT), "hi"))
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and "INVALID_ARGUMENT" in err and "--max-n" in err
