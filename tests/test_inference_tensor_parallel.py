"""Tensor parallelism on the CPU (gloo): `structd inference --tp 2` gives the tokens one rank gives.

The two ranks are real processes (rank 0 starts rank 1 itself, as it does
without LeaderWorkerSet variables); each holds half of every sharded weight
and half of the KV heads. Greedy decoding is compared with the session's
single-rank server, constrained and not; with `--engine-process on` rank 0's
engine is its core process, which joins the group. The one-process group
serves the session server's weights by hub id from an offline Hugging Face
cache (tests/test_model_loading.py builds it): both ranks resolve it there,
so one group start covers `--model <hub id>` on two ranks too.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from inference_svc.model.embedded_model import ensure_embedded_model
from inference_svc.model.paged_kv import KVCacheSpec
from inference_svc.model.tensor_parallel import rank_from_env
from shared.inference_client import InferenceClient
from structd.bench.harness import free_port
from tests.conftest import REPO
from tests.test_cli import children_of, running
from tests.test_model_loading import REPO_ID, fake_hub_cache, offline_env

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"type": "string", "maxLength": 6}}, "required": ["a", "b"]}
PROMPTS = [
    pytest.param(dict(prompt="Hello world", max_tokens=16, ignore_eos=True), id="unconstrained"),
    pytest.param(dict(prompt="J:", json_schema=SCHEMA, max_tokens=40), id="json-schema"),
    pytest.param(dict(prompt="Pick:", choice=["alpha", "beta", "gamma"]), id="choice"),
]


@pytest.fixture(scope="module", params=["off", "on"], ids=["one-process", "engine-process"])
def tp2(grammar_server, request, tmp_path_factory):
    """(process, target, engine in its own process, hub id or None): the one-process group is started by hub id,
    offline."""
    from structd.up import wait_serving

    port = free_port()
    hub = request.param == "off"
    flags, env = [], None
    if hub:
        cache = fake_hub_cache(tmp_path_factory.mktemp("hf-hub"), REPO_ID, ensure_embedded_model())
        flags, env = ["--model", REPO_ID], offline_env(cache)
    proc = subprocess.Popen([sys.executable, "-m", "structd", "inference", "--host", "127.0.0.1", "--port", str(port),
                             "--metrics-port", "0", "--grammar-target", grammar_server.target, "--tp", "2", *flags,
                             "--num-threads", "1", "--log-level", "WARNING", "--engine-process", request.param],
                            cwd=REPO, env=env)
    try:
        wait_serving(f"127.0.0.1:{port}", proc, timeout=300)
        yield proc, f"127.0.0.1:{port}", request.param == "on", REPO_ID if hub else None
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("request_args", PROMPTS)
def test_two_ranks_decode_like_one(tp2, inference_client, request_args):
    target = tp2[1]
    kwargs = dict(request_args)
    prompt = kwargs.pop("prompt")
    one = inference_client.complete(prompt, **kwargs)
    with InferenceClient(target) as client:
        two = client.complete(prompt, **kwargs)
    assert two.token_ids == one.token_ids
    assert (two.text, two.finish_reason) == (one.text, one.finish_reason)


def test_model_info_names_what_the_group_was_started_with(tp2):
    """A hub id resolved offline on both ranks is what GetModelInfo names (the weights are the session
    server's, as the decoding above shows)."""
    import grpc

    from shared.gen.inference.v1 import inference_service_pb2 as pb
    from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc

    _, target, _, hub_id = tp2
    with grpc.insecure_channel(target) as channel:
        info = pb_grpc.InferenceServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.model_id == (hub_id or "structd-tiny-llama")
    assert time.time() - 600 < info.loaded_unix_seconds <= time.time()


def test_sigterm_stops_every_rank(tp2):
    proc, _, engine_process, _ = tp2
    children = children_of(proc.pid)
    # Rank 0 starts rank 1 itself (and, with --engine-process on, its engine core).
    assert len(children) == 1 + engine_process
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    deadline = time.monotonic() + 10
    while any(running(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(c) for c in children), "a rank (or the engine core) outlived rank 0"


@pytest.mark.parametrize("env, message", [
    pytest.param({"WORLD_SIZE": "4", "RANK": "0"}, "must agree", id="world-size-mismatch"),
    pytest.param({"WORLD_SIZE": "2", "RANK": "2"}, "outside", id="rank-out-of-range"),
])
def test_rank_environment_is_checked(env, message):
    with pytest.raises(SystemExit, match=message):
        rank_from_env(env, 2)


def test_rank_environment_absent_means_local_ranks():
    assert rank_from_env({}, 2) is None
    info = rank_from_env({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "leader", "MASTER_PORT": "29501"}, 2)
    assert (info.rank, info.world_size, info.master_addr, info.master_port) == (1, 2, "leader", 29501)


def test_kv_heads_split_over_ranks():
    import torch
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    assert KVCacheSpec.from_model_config(config, torch.float32, 16, tp_size=2).num_kv_heads == 1
    with pytest.raises(ValueError, match="do not split"):
        KVCacheSpec.from_model_config(config, torch.float32, 16, tp_size=4)
