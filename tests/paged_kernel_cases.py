"""The paged kernel's cases: one step of attention through the Triton backend and the SDPA reference, same inputs.

Run as `python -m tests.paged_kernel_cases` with TRITON_INTERPRET=1 (Triton's
interpreter runs the kernel on CPU tensors; it must be set before triton is
imported, so tests/test_paged_kernel.py starts this in a process of its own)
or on a CUDA device (`--device cuda`). Prints one JSON object: case id ->
the largest absolute difference between the two outputs, and the tolerance
for its dtype; then the embedded model stepped on each backend (its greedy
tokens must be the same, its logits within the tolerance), a split step
through several layers (how many sets of split buffers they used), and the
kernel launches of a Triton runner's start-up warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import torch

from inference_svc.model.attention import CONTEXT_KWARG, PagedAttentionContext, paged_attention_forward
from inference_svc.model.paged_kv import KVCacheSpec, PagedKVCache

# id: (query lens, cached context lens, query heads, KV heads, block size, dtype[, head dim])
CASES = {
    "decode-mixed-lengths": ([1, 1, 1, 1], [0, 5, 16, 37], 4, 4, 4, "float32"),
    "decode-gqa4": ([1, 1, 1], [3, 30, 9], 8, 2, 4, "float32"),
    "decode-gqa8": ([1, 1], [11, 2], 8, 1, 8, "float32"),
    "decode-long-many-tiles": ([1, 1], [70, 129], 4, 2, 4, "float32"),
    "decode-exactly-full-blocks": ([1, 1, 1], [7, 8, 15], 4, 2, 8, "float32"),
    "extend-over-cache": ([3, 1, 5], [7, 12, 4], 8, 2, 4, "float32"),
    "fresh-prefill-beside-kernel-rows": ([6, 1, 3], [0, 9, 8], 4, 2, 4, "float32"),
    "decode-gqa4-bf16": ([1, 1, 1], [3, 30, 9], 8, 2, 4, "bfloat16"),
    "extend-bf16": ([4, 1], [13, 6], 4, 1, 4, "bfloat16"),
    "decode-fp16": ([1, 1], [21, 5], 4, 2, 8, "float16"),
    # Group and head sizes that are not powers of two (Qwen2.5's 7 query heads per KV head; head dim 24).
    "decode-gqa7-head-dim-24": ([1, 1, 3], [19, 4, 10], 14, 2, 4, "float32", 24),
    "decode-mha-3-heads": ([1, 1], [9, 33], 3, 3, 4, "float32"),
    # A chunk over cached context longer than KERNEL_MAX_QUERY goes to SDPA beside the kernel's decode.
    "long-extend-beside-a-decode": ([20, 1], [6, 11], 4, 2, 4, "float32"),
    # Split context (SPLITS below): parts past a short context are empty; a last part shorter than a tile.
    "decode-split-context": ([1, 1, 1], [700, 70, 5], 4, 2, 16, "float32"),
    "extend-split-context-bf16": ([3, 1], [400, 90], 8, 2, 16, "bfloat16"),
    "decode-split-uneven-parts": ([1, 1], [129, 40], 14, 2, 4, "float32", 24),
}
# Cases run with the kernel's context split into this many parts (the CPU's own choice is 1).
SPLITS = {"decode-split-context": 4, "extend-split-context-bf16": 3, "decode-split-uneven-parts": 7}
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
# Layers of the step that checks the split buffers are allocated once per step, not once per layer.
SHARED_LAYERS = 2
HEAD_DIM = 16


def run_case(case_id: str, device: str, seed: int = 0, layers: int = 1) -> tuple[float, int]:
    """(the largest difference between the backends over `layers` layers of one step, how many sets of split
    buffers the kernel's layers used: one per step when split, none unsplit)."""
    query_lens, context_lens, heads, kv_heads, block_size, dtype_name, *rest = CASES[case_id]
    head_dim = rest[0] if rest else HEAD_DIM
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    # Shuffled blocks: no sequence's blocks are contiguous or in order.
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.long)
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    cache = PagedKVCache(KVCacheSpec(layers, kv_heads, head_dim, dtype, block_size), num_blocks, device)
    for layer in range(layers):
        for i, cached in enumerate(context_lens):  # what earlier steps wrote
            pos = torch.arange(cached)
            slots = (tables[i, pos // block_size] * block_size + pos % block_size).to(device)
            cache.write(layer, slots, torch.randn(cached, kv_heads, head_dim, generator=gen).to(device),
                        torch.randn(cached, kv_heads, head_dim, generator=gen).to(device))
    tokens = sum(query_lens)
    q = torch.randn(1, heads, tokens, head_dim, generator=gen).to(device, dtype)
    k = torch.randn(1, kv_heads, tokens, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(1, kv_heads, tokens, head_dim, generator=gen).to(device, dtype)
    outs = []
    buffer_sets: list[tuple] = []  # held, so that a set made anew cannot reuse a freed one's identity
    for kernel in (True, False):
        ctx = PagedAttentionContext.build(cache, query_lens, context_lens, tables, torch.device(device),
                                          paged_kernel=kernel)
        assert (ctx.kernel is not None) == kernel  # every case has rows for the kernel
        if kernel and case_id in SPLITS:
            ctx = replace(ctx, kernel=replace(ctx.kernel, splits=SPLITS[case_id]))
        for layer in range(layers):
            out, _ = paged_attention_forward(SimpleNamespace(layer_idx=layer), q, k, v, None,
                                             scaling=head_dim**-0.5, **{CONTEXT_KWARG: ctx})
            outs.append(out.float())
            parts = ctx.kernel.buffers.parts if kernel else None
            if parts is not None and not any(parts is seen for seen in buffer_sets):
                buffer_sets.append(parts)
    return max(float((a - b).abs().max()) for a, b in zip(outs[:layers], outs[layers:])), len(buffer_sets)


def model_steps(device: str, backend: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The embedded model on `backend`: two prompts prefilled, one extended by a 3-token chunk over its cache,
    then greedy decodes of both together. (each sequence's tokens, each step's logits)."""
    from inference_svc.model.embedded_model import ensure_embedded_model
    from inference_svc.model.model_loading import load_model
    from inference_svc.model.model_runner import PagedModelRunner, SequenceChunk, StepBatch

    model, tok = load_model(ensure_embedded_model(), device)
    runner = PagedModelRunner.create(model, block_size=4, num_blocks=64, attention_backend=backend)
    prompts = [tok("The grammar decides", add_special_tokens=False).input_ids,
               tok("A paged kernel reads blocks in place, one", add_special_tokens=False).input_ids]
    seqs = [list(p) for p in prompts]
    for i, p in enumerate(prompts):
        runner.block_manager.allocate(i, len(p))
    logits = runner.forward(StepBatch.of([SequenceChunk(i, tuple(p), 0) for i, p in enumerate(prompts)]))
    extra = [11, 12, 13]  # an extend over cached context (the kernel's chunk path)
    runner.block_manager.extend(0, len(extra))
    logits = torch.cat([runner.forward(StepBatch.of([SequenceChunk(0, tuple(extra), len(seqs[0]))])), logits[1:]])
    seqs[0] += extra
    steps = [logits]
    for _ in range(6):
        nxt = logits.argmax(-1).tolist()
        chunks = []
        for i, t in enumerate(nxt):
            runner.block_manager.extend(i, 1)
            chunks.append(SequenceChunk(i, (t,), len(seqs[i])))
            seqs[i].append(t)
        logits = runner.forward(StepBatch.of(chunks))
        steps.append(logits)
    return seqs, steps


def warm_up_launches(device: str) -> list[str]:
    """The paged kernel's launches ("unsplit" or "split", in order) while a Triton runner of the embedded model
    is made: its warm-up's. Counted by wrapping the jitted kernel, which still runs."""
    from inference_svc.model import paged_kernel
    from inference_svc.model.embedded_model import ensure_embedded_model
    from inference_svc.model.model_loading import load_model
    from inference_svc.model.model_runner import PagedModelRunner

    model, _ = load_model(ensure_embedded_model(), device)
    spec = KVCacheSpec.from_model_config(model.config, next(model.parameters()).dtype, block_size=4)
    jitted = paged_kernel._kernel
    launches = []

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append("split" if kwargs["PARTIAL"] else "unsplit")
                return jitted()[grid](*args, **kwargs)
            return launch

    paged_kernel._kernel = Counted
    try:
        # own_head=False: no LM head to set up, which the warm-up does not need (load_runner's create makes the
        # runner with this same constructor).
        PagedModelRunner(model, PagedKVCache(spec, 8, device), own_head=False, attention_backend="triton")
    finally:
        paged_kernel._kernel = jitted
    return launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    result = {case: {"error": run_case(case, args.device)[0], "tolerance": TOLERANCE[CASES[case][5]]}
              for case in CASES}
    # One split step through several layers: SDPA's output in each, from the one set of buffers.
    error, sets = run_case("decode-split-uneven-parts", args.device, layers=SHARED_LAYERS)
    result["split-buffers-shared-by-the-layers"] = {"error": error, "tolerance": TOLERANCE["float32"],
                                                    "buffer_sets": sets}
    result["warm-up"] = {"launches": warm_up_launches(args.device)}
    with torch.inference_mode():
        triton_seqs, triton_logits = model_steps(args.device, "triton")
        sdpa_seqs, sdpa_logits = model_steps(args.device, "sdpa")
    result["embedded-model-greedy-tokens"] = {"error": float(triton_seqs != sdpa_seqs), "tolerance": 0.0}
    result["embedded-model-logits"] = {
        "error": max(float((a - b).abs().max()) for a, b in zip(triton_logits, sdpa_logits)), "tolerance": 1e-3}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
