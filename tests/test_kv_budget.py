"""The KV cache's size: --kv-cache-bytes, or on CUDA what --gpu-memory-utilization leaves (kv_budget.py)."""

from __future__ import annotations

import pytest

from inference_svc.config import DEFAULT_KV_CACHE_BYTES
from inference_svc.model.kv_budget import KVBudgetError, kv_budget_bytes
from tests.conftest import inference_config

GiB = 2**30


@pytest.mark.parametrize("total, free, peak, utilization, want", [
    pytest.param(80 * GiB, 64 * GiB, 2 * GiB, 0.9, 72 * GiB - 16 * GiB - 2 * GiB, id="h100-8b-model"),
    pytest.param(80 * GiB, 40 * GiB, 2 * GiB, 0.9, 72 * GiB - 40 * GiB - 2 * GiB, id="another-process-holds-half"),
    pytest.param(80 * GiB, 64 * GiB, 2 * GiB, 0.5, 40 * GiB - 16 * GiB - 2 * GiB, id="lower-utilization"),
])
def test_budget_is_utilization_less_what_is_in_use_and_the_step(total, free, peak, utilization, want):
    assert kv_budget_bytes(total, free, peak, utilization) == want


def test_no_room_names_the_flags():
    with pytest.raises(KVBudgetError) as refused:
        kv_budget_bytes(80 * GiB, 10 * GiB, 2 * GiB, 0.9)
    for flag in ("--gpu-memory-utilization", "--max-num-batched-tokens", "--kv-cache-bytes"):
        assert flag in str(refused.value)


def test_cpu_keeps_the_fixed_default_and_the_server_exports_its_size(inference_server):
    """On the CPU nothing measures the device: --kv-cache-bytes 0 is the fixed default there, a given size is
    kept, and inference_svc_kv_cache_bytes says what the cache holds (the session's server: 64 MiB)."""
    from inference_svc.config import InferenceServiceConfig
    from inference_svc.core.assembly import kv_cache_bytes

    srv = inference_server.server
    runner = srv.stack.runner
    assert kv_cache_bytes(InferenceServiceConfig(kv_cache_bytes=0), runner.model, None) == DEFAULT_KV_CACHE_BYTES
    assert kv_cache_bytes(InferenceServiceConfig(kv_cache_bytes=12345), runner.model, None) == 12345
    assert runner.kv_cache_bytes == 64 * 2**20
    assert srv.metrics.registry.get_sample_value("inference_svc_kv_cache_bytes") == 64 * 2**20


@pytest.mark.parametrize("argv, problem", [
    pytest.param(["--gpu-memory-utilization", "0"], "--gpu-memory-utilization 0", id="zero-utilization"),
    pytest.param(["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5", id="over-one"),
    pytest.param(["--kv-cache-bytes", "-1"], "--kv-cache-bytes", id="negative-bytes"),
])
def test_flag_problems(argv, problem):
    with pytest.raises(SystemExit, match=problem.replace(".", r"\.")):
        inference_config(argv)
