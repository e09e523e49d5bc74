"""Triton's paged attention kernel against the SDPA reference, and how --attention-backend picks between them.

The kernel runs here on CPU tensors under Triton's interpreter, which must
be switched on before triton is imported: the cases run in a process of
their own (tests/paged_kernel_cases.py, one start for all of them), each
one step of attention through both backends on the same random KV blocks
(shuffled block tables, grouped-query attention, block crossings, mixed
lengths, extends over cached context beside a fresh prefill, float32,
bfloat16, float16), then the embedded model stepped on each. On a GPU the
same cases run compiled (`-m cuda`, in the device check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_svc.model.paged_kernel import AttentionBackendError, resolve_backend
from tests.conftest import inference_config
from tests.paged_kernel_cases import CASES

ROOT = Path(__file__).resolve().parent.parent
IDS = [*CASES, "embedded-model-greedy-tokens", "embedded-model-logits"]


def run_cases(device: str, env: dict[str, str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tests.paged_kernel_cases", "--device", device], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted():
    return run_cases("cpu", {"TRITON_INTERPRET": "1"})


@pytest.mark.parametrize("case", IDS)
def test_the_interpreted_kernel_equals_sdpa(interpreted, case):
    result = interpreted[case]
    assert result["error"] <= result["tolerance"], result


@pytest.fixture(scope="module")
def on_cuda():
    return run_cases("cuda", {})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (scripts/device/check runs these on a GPU "
                    "machine)")
@pytest.mark.parametrize("case", IDS)
def test_the_compiled_kernel_equals_sdpa_on_cuda(on_cuda, case):
    result = on_cuda[case]
    assert result["error"] <= result["tolerance"], result


@pytest.mark.parametrize("requested, device, expected", [
    pytest.param("auto", "cpu", "sdpa", id="auto-on-cpu"),
    pytest.param("auto", "cuda", "triton", id="auto-on-cuda"),
    pytest.param("sdpa", "cuda", "sdpa", id="sdpa-on-cuda"),
    pytest.param("triton", "cuda:1", "triton", id="triton-on-cuda-1"),
])
def test_the_backend_follows_the_flag_and_the_device(requested, device, expected):
    backend, why = resolve_backend(requested, torch.device(device))
    assert backend == expected and why


def test_triton_asked_for_off_cuda_is_refused_naming_the_flag():
    with pytest.raises(AttentionBackendError, match="--attention-backend triton needs a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))


def test_an_unknown_backend_is_refused_at_start():
    with pytest.raises(SystemExit, match="--attention-backend flash: use auto, sdpa, triton"):
        inference_config(["--attention-backend", "flash"])
