"""How many bytes the KV cache gets: a fixed `--kv-cache-bytes`, or on CUDA what the device has left.

On a GPU the KV cache is most of what decides throughput (how many sequences
fit at once), and a fixed default is either a waste of the device or an
out-of-memory at the first long batch. As vLLM's `gpu_memory_utilization`
does, the service may use `--gpu-memory-utilization` of the device's memory
in all: what is already in use after the model loaded (its weights, the CUDA
context, anything another process holds) and the activations of the largest
step, measured by one profiling forward of `--max-num-batched-tokens`
tokens, come off first; the rest is the KV cache. On the CPU there is no
device to measure: the fixed default applies.
"""

from __future__ import annotations

import inspect
import logging

log = logging.getLogger(__name__)


class KVBudgetError(RuntimeError):
    """The device has no room left for a KV cache (the server's configuration, not a request)."""


def kv_budget_bytes(total_bytes: int, free_bytes: int, peak_activation_bytes: int, utilization: float) -> int:
    """Bytes for the KV cache: utilization × total, less what is in use now and the profiled step's peak."""
    in_use = total_bytes - free_bytes
    budget = int(utilization * total_bytes) - in_use - peak_activation_bytes
    if budget <= 0:
        raise KVBudgetError(
            f"no room for a KV cache: --gpu-memory-utilization {utilization:g} of {total_bytes / 2**30:.1f} GiB "
            f"allows {utilization * total_bytes / 2**30:.1f} GiB, and {in_use / 2**30:.1f} GiB are in use after "
            f"loading the model, {peak_activation_bytes / 2**30:.1f} GiB more for the largest step's activations; "
            "raise --gpu-memory-utilization, lower --max-num-batched-tokens, or set --kv-cache-bytes")
    return budget


def profile_step_peak_bytes(model, num_tokens: int) -> int:
    """Peak device memory one forward of num_tokens tokens adds (the model's own attention, before the runner
    switches it to paged attention: an upper bound on a paged step of as many tokens)."""
    import torch

    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    # Every token's hidden state, one row of logits where the model can slice (the engine's logits rows are
    # added by the caller).
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with torch.inference_mode():
        ids = torch.zeros(1, num_tokens, dtype=torch.long, device=device)
        model(input_ids=ids, use_cache=False, **extra)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


def cuda_kv_cache_bytes(model, utilization: float, max_num_batched_tokens: int, logits_rows: int,
                        vocab_size: int, *, graphs: bool) -> int:
    """The KV cache's bytes on the model's CUDA device, measured now (after the model loaded, before the
    body is compiled); graphs: CUDA graphs will be captured, whose memory pool holds about one more step's
    activations."""
    import torch

    device = next(model.parameters()).device
    peak = profile_step_peak_bytes(model, max_num_batched_tokens) * (2 if graphs else 1)
    # The engine's float32 logits for a full batch (and the sampler's copy of them), which the profiling
    # forward's one row does not show.
    peak += 2 * logits_rows * vocab_size * 4
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget_bytes(total, free, peak, utilization)
    log.info("KV cache: %.2f GiB (--gpu-memory-utilization %g of %.1f GiB; %.2f GiB in use after loading, "
             "%.2f GiB for a %d-token step)", budget / 2**30, utilization, total / 2**30, (total - free) / 2**30,
             peak / 2**30, max_num_batched_tokens)
    return budget
