"""The engine in its own process (`--engine-process on`): the same service, through the real servers.

An API server whose engine core runs as a child process (engine_core.py)
must answer exactly as the one-process server does: the same tokens, text,
logprobs, finish reasons, compile warnings and schema checks for the same
requests on the same embedded model, the same statuses for bad requests; a
client that goes away frees its request in the core; the core serves the
metrics; drain and stop end the core; and a core that dies fails what is in
flight with UNAVAILABLE and turns the server NOT_SERVING, as a dead step loop
does in one process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from shared.inference_client import InferenceClient, InferenceError
from structd.bench.harness import ServiceThread, free_port
from tests.conftest import (TEST_COMPILE_TIMEOUT_SECONDS, InferenceServerThread, assert_engine_gone,
                            background_complete, inference_config, wait_until)
from tests.test_schema_check import PIGEONHOLE

POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}},
         "required": ["x", "y"]}

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
WEATHER_TOOL = {"name": "get_weather", "description": "Weather forecast for a city", "parameters": WEATHER}


# These servers start in 5-20 s here: a start that takes minutes is stuck, and the error says where it waits.
START_TIMEOUT_SECONDS = 180.0


def _config(grammar, **overrides):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    # The conftest inference_server's settings, so both servers draw the same tokens.
    base = dict(host="127.0.0.1", port=0, metrics_port=free_port(), grammar_targets=(grammar.target,), num_threads=1,
                kv_cache_bytes=64 * 1024**2, block_size=16, engine_process="on",
                engine=EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_waiting=64, default_max_tokens=32,
                                    compile_timeout_seconds=TEST_COMPILE_TIMEOUT_SECONDS))
    return InferenceServiceConfig(**{**base, **overrides})


def _split(grammar, **overrides):
    """A split server on a fresh free port for its metrics. free_port() only says the port was free: the core
    binds it seconds later (after its imports), and a port taken meanwhile fails the start with "Address
    already in use"; that start is retried on another port (the test below takes a port on purpose)."""
    for attempt in range(3):
        try:
            return InferenceServerThread(_config(grammar, **overrides), engine_process="on",
                                         start_timeout=START_TIMEOUT_SECONDS)
        except RuntimeError as e:  # the port's, when someone else bound it first; anything else is the test's failure
            if "Address already in use" not in str(e) or attempt == 2:
                raise


@pytest.fixture(scope="module")
def split_server(grammar_server):
    srv = _split(grammar_server)
    yield srv
    srv.stop()


def _core_pid(srv) -> int:
    return srv.server.engine._process.pid


def _metric(srv, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample from the server's /metrics endpoint (served by the core)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    want = "" if not labels else "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    for line in text.splitlines():
        if line.startswith(name + want + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("prompt, options", [
    pytest.param("Once upon a time", dict(max_tokens=24, ignore_eos=True), id="unconstrained"),
    pytest.param("point:", dict(json_schema=POINT, max_tokens=32), id="json_schema"),
    pytest.param("code:", dict(regex=r"[a-z]{3}-[0-9]{2,4}", max_tokens=16), id="regex"),
    pytest.param("color:", dict(choice=["red", "green", "blue"], max_tokens=8), id="choice"),
    pytest.param("tags:", dict(json_schema=PIGEONHOLE, max_tokens=48, temperature=1.0, seed=3), id="warnings-check"),
    pytest.param("Hello", dict(max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3, temperature=0.8,
                               seed=5), id="logprobs-seeded"),
    pytest.param([{"role": "user", "content": "Say hi"}], dict(max_tokens=8, ignore_eos=True), id="chat"),
    pytest.param([{"role": "user", "content": "Weather in Oslo?"}], dict(tools=[WEATHER_TOOL], tool_choice="required",
                                                                         max_tokens=64), id="tool-call"),
    pytest.param("stop here", dict(max_tokens=40, ignore_eos=True, stop=["e"], temperature=1.0, seed=1),
                 id="stop-string"),
])
def test_same_answers_as_one_process(split_server, inference_server, prompt, options):
    with InferenceClient(split_server.target) as split, InferenceClient(inference_server.target) as one:
        got = list(split.generate(prompt, **options))
        want = list(one.generate(prompt, **options))
    assert _without_call_ids(got) == _without_call_ids(want)


def test_tokenize_answers_as_in_one_process(split_server, inference_server):
    """Tokenize and Detokenize run in the API process, on the tokenizer it loads beside the core's."""
    from shared.gen.inference.v1 import inference_service_pb2 as pb
    from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc

    chat = pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="Say hi")])
    answers = []
    for target in (split_server.target, inference_server.target):
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)
            ids = stub.Tokenize(chat, timeout=60).token_ids
            answers.append((list(ids), stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=60).text))
    assert answers[0] == answers[1] and answers[0][0]


def test_n_completions_come_back_as_from_one_process(split_server, inference_server):
    options = dict(n=3, max_tokens=6, ignore_eos=True, temperature=1.0, seed=2, timeout=60)
    with InferenceClient(split_server.target) as split, InferenceClient(inference_server.target) as one:
        got = split.complete_all("Once upon", **options)
        want = one.complete_all("Once upon", **options)
    assert [c.index for c in got] == [0, 1, 2] and got == want


def _without_call_ids(chunks):
    """Tool-call ids are random per call, and the cached prompt tokens depend on what earlier tests left in
    each session-shared server's prefix cache; everything else must be equal."""
    return [dataclasses.replace(c, tool_calls=[dataclasses.replace(t, id="") for t in c.tool_calls],
                                usage=c.usage and dataclasses.replace(c.usage, cached_prompt_tokens=0))
            for c in chunks]


@pytest.mark.parametrize("prompt, options, code, message", [
    pytest.param([1, 10**7], dict(max_tokens=2), grpc.StatusCode.INVALID_ARGUMENT, "not a token id", id="token-id"),
    pytest.param("x", dict(regex="(", max_tokens=2), grpc.StatusCode.INVALID_ARGUMENT, "", id="bad-regex"),
    pytest.param("x", dict(max_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens", id="too-long"),
])
def test_refusals_carry_the_same_status(split_server, inference_server, prompt, options, code, message):
    errors = []
    for srv in (split_server, inference_server):
        with InferenceClient(srv.target) as client, pytest.raises(InferenceError) as err:
            client.complete(prompt, **options)
        errors.append((err.value.code, err.value.message))
    assert errors[0] == errors[1]
    assert errors[0][0] == code and message in errors[0][1]


def test_a_client_that_goes_away_frees_its_request_in_the_core(split_server):
    cancelled = _metric(split_server, "inference_svc_requests_total",
                        {"constrained": "false", "finish_reason": "cancelled"})
    with InferenceClient(split_server.target) as client:
        stream = client.generate("go on", max_tokens=2000, ignore_eos=True)
        next(stream)
        stream.close()  # cancels the call
    wait_until(lambda: _metric(split_server, "inference_svc_requests_total",
                               {"constrained": "false", "finish_reason": "cancelled"}) == cancelled + 1,
               "the core finished the request as cancelled")
    wait_until(lambda: _metric(split_server, "inference_svc_num_requests_running") == 0, "nothing left running")
    assert split_server.run_sync(lambda: split_server.server.engine.num_active) == 0


def test_many_requests_at_once_each_get_their_own_stream(split_server):
    results: dict[int, str] = {}

    def one(i: int) -> None:
        with InferenceClient(split_server.target) as client:
            results[i] = client.complete("count:", regex=f"{i}-[a-z]{{2}}", max_tokens=8).text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(12))
    for i, text in results.items():
        assert re.fullmatch(f"{i}-[a-z]{{2}}", text), (i, text)


# ------------------------------------------------------------ the core's lifecycle (own servers)

def _simulated(grammar):
    return _split(grammar, simulate_step_ms=5.0, grace_seconds=1.0, num_threads=1)


def test_stop_cancels_what_is_in_flight_and_ends_the_core(grammar_server):
    srv = _simulated(grammar_server)
    pid = _core_pid(srv)
    # The client's own deadline bounds the wait, so a stream that never ends fails as DEADLINE_EXCEEDED here
    # rather than as an empty box (a CI run once found neither an answer nor an error 30 s after the stop).
    t, box = background_complete(srv.target, prompt="in flight", max_tokens=5000, ignore_eos=True, timeout=90)
    wait_until(lambda: srv.run_sync(lambda: srv.server.engine.num_active) == 1, "request running")
    stopping = time.monotonic()
    srv.stop()
    stopped = time.monotonic()
    t.join(100)
    assert not t.is_alive(), "the client's stream outlived its own deadline"
    assert "out" in box, (f"stop took {stopped - stopping:.1f} s; the client heard {box['err']!r} "
                          f"{time.monotonic() - stopped:.1f} s after it")
    assert box["out"].finish_reason == "cancelled"
    assert srv.server.engine._process.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_dead_core_fails_what_is_in_flight_and_turns_not_serving(split_server):
    """On the module's split server, after every other test that uses it (it kills that server's core; the
    fixture's stop then stops what is left): a core start fewer than a server of its own."""
    srv = split_server
    t, box = background_complete(srv.target, prompt="in flight", max_tokens=3000, ignore_eos=True)
    wait_until(lambda: srv.run_sync(lambda: srv.server.engine.num_active) == 1, "request running")
    os.kill(_core_pid(srv), signal.SIGKILL)
    t.join(30)
    assert box["err"].code == grpc.StatusCode.UNAVAILABLE and "retry on another replica" in box["err"].message
    assert_engine_gone(srv)


def test_a_core_that_cannot_start_says_why(grammar_server):
    from inference_svc.core.engine_client import EngineClient
    from inference_svc.core.assembly import resolve_source

    # Its metrics port is taken (a listener of the test's own): the core cannot serve the metrics, and the API
    # server must not hang.
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        cfg = _config(grammar_server, simulate_step_ms=5.0, metrics_port=taken.getsockname()[1])
        client = EngineClient(cfg, rank=None, source=resolve_source(cfg))

        async def start():
            await client.launch(30.0)
            await client.ready()

        with pytest.raises(SystemExit, match="engine core process did not start: .*Address already in use"):
            asyncio.run(start())
        assert client._process.returncode == 1
    finally:
        taken.close()


def test_a_core_stopped_while_starting_writes_where_it_was_first(grammar_server, capfd):
    from inference_svc.server import InferenceServer

    # No grammar replica: the core waits for one until the starter gives up, once the API server waits for
    # the core's READY and the core has its SIGUSR1 handler set (a SIGUSR1 before its faulthandler is set would
    # end it without a word); start_timeout only bounds a start that never gets there.
    nobody = f"127.0.0.1:{free_port()}"
    cfg = _config(grammar_server, grammar_targets=(nobody,), simulate_step_ms=5.0, metrics_port=0)
    server = InferenceServer(cfg)

    def core_stuck(waits: list[str]) -> bool:
        return (len(waits) > 2 and waits[1].endswith(" in ready")
                and _handles_sigusr1(server.engine._process.pid))

    with pytest.raises(TimeoutError, match=r"engine_client\.py:\d+ in ready"):
        ServiceThread(server, "stuck-core", start_timeout=START_TIMEOUT_SECONDS, give_up=core_stuck,
                      grammar_connect_timeout=600.0)
    # faulthandler's dump, from the core (its main() is at the bottom of its main thread's stack).
    assert re.search(r'File ".*engine_core\.py", line \d+ in main', capfd.readouterr().err)


def _handles_sigusr1(pid: int) -> bool:
    """The process has a handler for SIGUSR1 (the core's faulthandler, set once its imports are done)."""
    caught = re.search(r"^SigCgt:\s*([0-9a-f]+)$", Path(f"/proc/{pid}/status").read_text(), re.M)
    return bool(int(caught.group(1), 16) & (1 << (signal.SIGUSR1 - 1)))


@pytest.mark.parametrize("argv, env, device, want", [
    pytest.param([], {}, "cpu", False, id="auto-off-on-the-cpu"),
    pytest.param([], {}, "cuda", True, id="auto-on-with-cuda"),
    pytest.param(["--engine-process", "on"], {}, "cpu", True, id="on"),
    pytest.param([], {"STRUCTD_INFERENCE_ENGINE_PROCESS": "off"}, "cuda", False, id="env-off"),
    pytest.param(["--engine-process", "on"], {"STRUCTD_INFERENCE_ENGINE_PROCESS": "off"}, "cpu", True,
                 id="flag-wins"),
])
def test_the_flag(argv, env, device, want):
    from inference_svc.config import InferenceServiceConfig

    config = inference_config([*argv, "--device", device], env)
    assert config.engine_in_own_process() is want
    assert inference_config([]).engine_process == InferenceServiceConfig().engine_process == "auto"


def test_a_bad_flag_value_says_what_to_use():
    with pytest.raises(SystemExit, match="--engine-process yes: use auto, on, off"):
        inference_config(["--engine-process", "yes"])


def test_both_engines_have_the_face_the_frontend_talks_to():
    """The Frontend is typed ServingEngine and handed Engine or EngineClient: both take submit's arguments the
    same way, and both requests carry their outputs and compile warnings where the servicer reads them."""
    import inspect

    from inference_svc.api.frontend import ServingEngine, SubmittedRequest
    from inference_svc.core.engine_client import EngineClient, RemoteRequest
    from inference_svc.engine.engine import Engine
    from inference_svc.engine.request import GenerationRequest

    def parameters(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    for engine in (Engine, EngineClient):
        for method in ("submit", "cancel"):
            assert parameters(getattr(engine, method))[1:] == parameters(getattr(ServingEngine, method))[1:], \
                f"{engine.__name__}.{method}"
    wanted = {name for name, _ in inspect.getmembers(SubmittedRequest, lambda m: isinstance(m, property))}
    assert wanted == {"outputs", "warnings"}
    remote = RemoteRequest(1, "r")
    assert all(hasattr(remote, name) for name in wanted) and remote.warnings == ()
    assert isinstance(GenerationRequest.warnings, property) and "outputs" in GenerationRequest.__dataclass_fields__
