"""Shared fixtures: each real service starts once per test session (under `make test`'s pytest-xdist, once per
worker that runs a test needing it).

The grammar server runs in-process on its own event loop thread (so tests can
look at its internals, e.g. killed compile workers) and is reached over real
gRPC on loopback. Tests talk to it with the asyncio client through `run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Each pytest-xdist worker gets its share of the cores for OpenMP (torch's intra-op threads, numpy's BLAS):
# with as many threads as cores in every worker, the threads of one spin at barriers on cores the other worker
# needs. Read by those libraries when they load, so set before anything imports them (in the workers only:
# the controller runs no test, and its environment is theirs).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402

from grammar_svc.config import GrammarServiceConfig  # noqa: E402
from structd.bench.harness import ServiceThread  # noqa: E402

# Every gateway a test starts is checked against the openai SDK's types (issue 27, item 7); under xdist the
# longest files start first (tests/scheduling.py).
pytest_plugins = ["tests.openai_contract", "tests.scheduling"]
REPO = Path(__file__).resolve().parent.parent
# Reference data lives beside the working checkout (../shared/data); a clone made elsewhere on the same
# machine (CI's clean clone) finds it through STRUCTD_SHARED_DATA or the workspace's fixed location.
SHARED_DATA_CANDIDATES = [Path(p) for p in (os.environ.get("STRUCTD_SHARED_DATA"),) if p] + [
    REPO.parent / "shared" / "data", Path("/work/shared/data")]
IN_CI = os.environ.get("STRUCTD_CI") == "1"


def require_tool(name: str) -> str:
    """Path of an external tool; skips (or fails in CI, where it must be installed) without it."""
    path = shutil.which(name)
    if path is None:
        untestable_here(f"{name} is not installed (Debian package; .ci/run installs it)")
    return path


def untestable_here(msg: str) -> None:
    """Skips a test this machine cannot run (a tool, reference data, a CPU feature a default code path needs);
    in CI fails instead, so a runner without it says what went untested rather than skipping quietly."""
    if IN_CI:
        pytest.fail(msg)
    pytest.skip(msg)


def shared_data(name: str) -> Path:
    path = next((d / name for d in SHARED_DATA_CANDIDATES if (d / name).is_file()), SHARED_DATA_CANDIDATES[0] / name)
    if not path.is_file():
        untestable_here(f"reference data {name} is missing (looked in {', '.join(map(str, SHARED_DATA_CANDIDATES))})")
    return path


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ServerThread(config: GrammarServiceConfig) -> ServiceThread:
    """A GrammarServer on a private event loop in a daemon thread."""
    # Imported here: xdist's controller loads this file too and runs no test (xgrammar and torch cost it
    # seconds before any worker starts).
    from grammar_svc.server import GrammarServer

    return ServiceThread(GrammarServer(config), "grammar-server", start_timeout=120.0)


def start_grammar_server(**overrides) -> ServerThread:
    # xgrammar alone unless a test asks for auto or llguidance: the suites pin xgrammar's compile deadlines,
    # refusals and masks (tests/test_grammar_backends.py covers the fallback).
    cfg = dict(host="127.0.0.1", port=0, metrics_port=0, compile_workers=2, fill_threads=2,
               session_idle_ttl_seconds=600.0, grammar_backend="xgrammar")
    cfg.update(overrides)
    return ServerThread(GrammarServiceConfig(**cfg))


@pytest.fixture(scope="session", autouse=True)
def one_compile_zygote_per_test_process():
    """In-process grammar servers fork their compile workers from one zygote per memory cap, started once per
    test process rather than once per server start (each imports xgrammar and torch: seconds of CPU, and the
    server's start waits for it). Each server's pool still starts, kills and replaces its own workers, and a
    zygote that dies is replaced as in a service; only closing a pool leaves the zygote to the session."""
    from grammar_svc.compile import compile_pool

    real = compile_pool.WorkerFactory
    made: dict[tuple[bool, int], compile_pool.WorkerFactory] = {}
    lock = threading.Lock()

    class SessionFactory(real):
        def close(self) -> None:
            pass  # the session's: closed once, below

    def factory(use_zygote: bool = True, memory_limit_bytes: int = 0):
        with lock:
            key = (use_zygote, memory_limit_bytes)
            if key not in made:
                made[key] = SessionFactory(use_zygote=use_zygote, memory_limit_bytes=memory_limit_bytes)
            return made[key]

    compile_pool.WorkerFactory = factory
    yield
    compile_pool.WorkerFactory = real
    for f in made.values():
        real.close(f)


@pytest.fixture(scope="session")
def grammar_server():
    # The mask-equality suites compare every mask with xgrammar's, the slow ones of a loaded machine included:
    # no row budget here (test_slow_rows.py covers --max-row-fill-seconds).
    srv = start_grammar_server(max_row_fill_seconds=600.0)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules running tiny models in-process: a second intra-op thread only adds barrier waits, which
    cost whole scheduler time slices when the machine is busy (measured: 0.2 s vs 8 s here)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer_desc():
    from shared.tokenizer import default_description

    return default_description()


@pytest.fixture(scope="session")
def hf_tokenizer():
    from shared.tokenizer import load_hf_tokenizer

    return load_hf_tokenizer()


@pytest.fixture(scope="session")
def xgr_tokenizer_info(tokenizer_desc):
    import xgrammar as xgr

    return xgr.TokenizerInfo.deserialize_json(tokenizer_desc.info_json)


@pytest.fixture(scope="session")
def token_bytes(xgr_tokenizer_info) -> list[bytes]:
    """Each token's bytes, read once: decoded_vocab answers through one FFI call per token."""
    return [bytes(t) for t in xgr_tokenizer_info.decoded_vocab]


def run(coro):
    """Runs a coroutine to completion on a fresh loop in the test's thread."""
    return asyncio.run(coro)


@dataclass
class Grammar:
    """Handle for tests: a registered tokenizer on the session's server."""

    target: str
    fingerprint: str
    vocab_size: int


@pytest.fixture(scope="session")
def registered(grammar_server, tokenizer_desc) -> Grammar:
    from shared.grammar_client import GrammarClient

    async def go():
        client = GrammarClient(grammar_server.target)
        try:
            await client.register_tokenizer(tokenizer_desc)
        finally:
            await client.close()

    run(go())
    return Grammar(grammar_server.target, tokenizer_desc.fingerprint, tokenizer_desc.vocab_size)


def InferenceServerThread(config, *, engine_process: str = "off", start_timeout: float = 600.0) -> ServiceThread:
    """An InferenceServer on a private event loop in a daemon thread; its engine in this process (tests read its
    state: scheduler, metrics, grammar tier) unless `engine_process` (tests/test_engine_process.py)."""
    import dataclasses

    from inference_svc.server import InferenceServer

    config = dataclasses.replace(config, engine_process=engine_process)
    return ServiceThread(InferenceServer(config), "inference-server", start_timeout=start_timeout,
                         grammar_connect_timeout=60.0)


# Compiles in a few seconds on the service (bounded strings are xgrammar's slow case): the "slow grammar".
SLOW_SCHEMA = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 40 + i} for i in range(4)},
               "required": [f"k{i}" for i in range(4)]}
# Far past the test server's compile deadline, on a fast machine too (the replica stops it at the deadline).
TOO_SLOW_SCHEMA = {"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 40 + i} for i in range(40)},
                   "required": [f"k{i}" for i in range(40)]}
# Room for the slow grammar (and the tests' long bounded strings) on a compile worker that starts cold, with make
# test's two workers and anything else busy on the cores: at three times less, they missed it under such load.
TEST_COMPILE_TIMEOUT_SECONDS = 20.0


@pytest.fixture(scope="session")
def inference_server(grammar_server):
    """The real inference service on the embedded model, wired to the session's grammar server."""
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    cfg = InferenceServiceConfig(
        host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar_server.target,), num_threads=1,
        kv_cache_bytes=64 * 1024**2, block_size=16,
        engine=EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_waiting=64, default_max_tokens=32,
                            compile_timeout_seconds=TEST_COMPILE_TIMEOUT_SECONDS))
    srv = InferenceServerThread(cfg)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def inference_client(inference_server):
    from shared.inference_client import InferenceClient

    client = InferenceClient(inference_server.target)
    yield client
    client.close()


def background_complete(target, **kwargs):
    """Streams a request on its own thread; returns (thread, result box with "out" or "err")."""
    from shared.inference_client import InferenceClient, InferenceError

    box: dict = {}

    def go():
        with InferenceClient(target) as client:
            try:
                box["out"] = client.complete(**kwargs)
            except InferenceError as e:
                box["err"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, box


def inference_config(argv: list[str], env: dict[str, str] | None = None):
    """The inference service's config as `structd inference ARGV` (with env as its environment) builds it."""
    import argparse

    from inference_svc import config as iconfig

    parser = argparse.ArgumentParser()
    iconfig.add_arguments(parser, env or {})
    return iconfig.from_args(parser.parse_args(argv))


@contextlib.contextmanager
def inference_stub(target: str):
    """An InferenceService stub on a plaintext channel to target, closed on exit."""
    import grpc

    from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as channel:
        yield pb_grpc.InferenceServiceStub(channel)


def wait_until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)

def assert_engine_gone(srv) -> None:
    """What a server whose engine died shows: it knows (failed), health says NOT_SERVING, new requests get
    UNAVAILABLE."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shared.inference_client import InferenceClient, InferenceError

    wait_until(lambda: srv.server.failed.is_set(), "server told the engine died")
    with grpc.insecure_channel(srv.target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    with InferenceClient(srv.target) as client, pytest.raises(InferenceError) as err:
        client.complete("after", max_tokens=2)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="session")
def gateway_server(inference_server):
    """The OpenAI-compatible HTTP gateway, in-process on its own loop, in front of the session's inference service."""
    from gateway.config import GatewayConfig
    from gateway.server import GatewayServer

    srv = ServiceThread(GatewayServer(GatewayConfig(host="127.0.0.1", port=0, target=inference_server.target,
                                                    model_info_ttl_seconds=1.0)), "gateway", start_timeout=60.0)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def gateway_url(gateway_server) -> str:
    """The gateway's OpenAI base URL (…/v1)."""
    return f"http://{gateway_server.target}/v1"


@pytest.fixture(scope="session")
def openai_client(gateway_url):
    """The official OpenAI SDK pointed at the gateway (no retries: a test sees the first answer)."""
    import openai

    client = openai.OpenAI(base_url=gateway_url, api_key="unused", max_retries=0, timeout=120.0)
    yield client
    client.close()


@pytest.fixture(scope="session")
def served_model(openai_client) -> str:
    """The model id the gateway serves (from the inference service's GetModelInfo)."""
    return openai_client.models.list().data[0].id
