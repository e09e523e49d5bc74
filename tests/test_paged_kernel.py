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

from inference_svc.model.attention import KERNEL_MAX_QUERY, PagedAttentionContext
from inference_svc.model.paged_kernel import AttentionBackendError, resolve_backend, split_count, triton_unavailable
from inference_svc.model.paged_kv import KVCacheSpec, PagedKVCache
from tests.conftest import inference_config, untestable_here
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
    if (missing := triton_unavailable()) is not None:
        untestable_here(f"the paged kernel's cases need triton: {missing}")
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


def test_the_layers_of_a_split_step_share_one_set_of_buffers(interpreted):
    """The split variant's partial results are allocated by a step's first layer and reused by the others (not
    allocated by every layer), and every layer still equals SDPA."""
    result = interpreted["split-buffers-shared-by-the-layers"]
    assert result["buffer_sets"] == 1 and result["error"] <= result["tolerance"], result


def test_a_triton_runner_runs_both_kernel_variants_when_made(interpreted):
    """The warm-up that compiles the kernel at start on a GPU (here interpreted: nothing compiles, but the path
    runs): one unsplit and one split launch while the runner is made, before any step."""
    assert interpreted["warm-up"]["launches"] == ["unsplit", "split"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (scripts/device/check runs these on a GPU "
                    "machine)")
def test_on_cuda_the_split_buffers_are_shared_and_the_warm_up_runs_both_variants(on_cuda):
    shared = on_cuda["split-buffers-shared-by-the-layers"]
    assert shared["buffer_sets"] == 1 and shared["error"] <= shared["tolerance"], shared
    assert on_cuda["warm-up"]["launches"] == ["unsplit", "split"]


@pytest.mark.parametrize("programs, longest, target, want", [
    pytest.param(2, 8192, 264, 32, id="one-sequence-long-context-capped"),
    pytest.param(2, 2048, 264, 8, id="one-sequence-parts-of-256-keys"),
    pytest.param(64, 8192, 264, 5, id="a-few-sequences-fill-the-device"),
    pytest.param(264, 8192, 264, 1, id="the-step-fills-the-device"),
    pytest.param(2, 511, 264, 1, id="too-short-to-split"),
    pytest.param(2, 512, 264, 2, id="two-parts-of-256"),
])
def test_the_context_is_split_only_where_the_programs_leave_the_device_idle(programs, longest, target, want):
    assert split_count(programs, longest, target) == want


@pytest.mark.parametrize("requested, device, expected", [
    pytest.param("auto", "cpu", "sdpa", id="auto-on-cpu"),
    pytest.param("auto", "cuda", "triton", id="auto-on-cuda"),
    pytest.param("sdpa", "cuda", "sdpa", id="sdpa-on-cuda"),
    pytest.param("triton", "cuda:1", "triton", id="triton-on-cuda-1"),
])
def test_the_backend_follows_the_flag_and_the_device(requested, device, expected):
    if expected == "triton" and (missing := triton_unavailable()) is not None:
        untestable_here(f"auto picks triton only where it imports: {missing}")
    backend, why = resolve_backend(requested, torch.device(device))
    assert backend == expected and why


def test_triton_asked_for_off_cuda_is_refused_naming_the_flag():
    with pytest.raises(AttentionBackendError, match="--attention-backend triton needs a CUDA device"):
        resolve_backend("triton", torch.device("cpu"))


def test_a_long_chunk_over_cached_context_goes_to_sdpa():
    """The kernel reads the context once per query token: a decode and a short extend go to it, a chunk of
    more than KERNEL_MAX_QUERY tokens after cached ones (chunked prefill, a prefix-cache hit) to SDPA."""
    cache = PagedKVCache(KVCacheSpec(1, 2, 16, torch.float32, 4), 32)
    tables = torch.arange(30).view(3, 10)
    long = KERNEL_MAX_QUERY + 1
    ctx = PagedAttentionContext.build(cache, [1, 3, long], [5, 6, 7], tables, torch.device("cpu"),
                                      paged_kernel=True)
    assert ctx.kernel.token_index.tolist() == [0, 1, 2, 3] and ctx.decodes is None
    (chunk,) = ctx.chunks
    assert (chunk.q_start, chunk.q_end) == (4, 4 + long) and chunk.slots is not None


def test_triton_on_a_cpu_device_is_refused_before_anything_loads():
    with pytest.raises(SystemExit, match="--attention-backend triton needs a CUDA device, and --device is cpu"):
        inference_config(["--attention-backend", "triton", "--device", "cpu"])


def test_an_unknown_backend_is_refused_at_start():
    with pytest.raises(SystemExit, match="--attention-backend flash: use auto, sdpa, triton"):
        inference_config(["--attention-backend", "flash"])


def test_the_ints_that_change_step_to_step_are_not_specialised():
    """Triton compiles a variant per specialisation (1, multiple of 16) of an int argument and per alignment of a
    pointer; a name in do_not_specialize that is not a parameter is ignored silently, so the names are checked
    here."""
    if (missing := triton_unavailable()) is not None:
        untestable_here(f"the paged kernel needs triton: {missing}")
    from inference_svc.model.paged_kernel import _kernel

    unspecialised = {p.name for p in _kernel().params if p.do_not_specialize}
    assert unspecialised == {"keys_per_split", "num_heads", "num_splits", "stride_tb", "stride_qt", "stride_qh",
                             "stride_ot", "stride_oh"}
    # Views at any 8-byte offset of the step's one index copy: 16-byte aligned or not from step to step.
    unaligned = {p.name for p in _kernel().params if p.do_not_specialize_on_alignment}
    assert unaligned == {"tables_ptr", "seq_ptr", "pos_ptr"}
