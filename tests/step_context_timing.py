"""Host time to build one step's inputs and attention context: the old builder against the current one.

Not a test (no wall-clock thresholds in tests): a script for docs/benchmarks.md.
The old builder is inference_svc/attention.py as of --old-rev, loaded from
git, driven by the old runner's per-token input loop (copied below); the new
one is the working tree's. Both run on the same batches, alternating, in one
process; medians in microseconds.

    .venv/bin/python -m tests.step_context_timing --old-rev 08b29cc
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import accumulate, chain

import torch

from inference_svc.attention import PagedAttentionContext
from inference_svc.model_runner import SequenceChunk, StepBatch
from inference_svc.paged_kv import KVCacheSpec, PagedKVCache


def load_old_attention(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:inference_svc/attention.py"], check=True,
                            capture_output=True, text=True).stdout
    path = tempfile.NamedTemporaryFile("w", suffix="_old_attention.py", delete=False)
    path.write(source)
    path.close()
    spec = importlib.util.spec_from_file_location("old_attention", path.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_attention"] = module
    spec.loader.exec_module(module)
    return module


def old_inputs(old, cache, batch, device):
    """The runner's input building before issue 13 (forward + forward_with_tables), verbatim in substance."""
    blocks = cache.blocks
    tables = [blocks.block_table(c.seq_id) for c in batch.chunks]
    layouts, token_ids, positions, last_index = [], [], [], []
    q_start = 0
    for c in batch.chunks:
        n = len(c.token_ids)
        layouts.append(old.SeqLayout(q_start, n, c.start_pos))
        token_ids.extend(c.token_ids)
        positions.extend(range(c.start_pos, c.start_pos + n))
        if c.needs_logits:
            last_index.append(q_start + n - 1)
        q_start += n
    ctx = old.PagedAttentionContext.build(cache, layouts, tables, device)
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    position_ids = torch.tensor([positions], dtype=torch.long, device=device)
    keep = torch.tensor(last_index, dtype=torch.long, device=device)
    return ctx, input_ids, position_ids, keep


def new_inputs(cache, batch, device):
    """What PagedModelRunner.forward builds now (the same calls, without the model)."""
    chunks = batch.chunks
    tables = cache.blocks.block_tables([c.seq_id for c in chunks])
    query_lens = [len(c.token_ids) for c in chunks]
    ctx = PagedAttentionContext.build(cache, query_lens, [c.start_pos for c in chunks], tables, device)
    input_ids = torch.tensor([list(chain.from_iterable(c.token_ids for c in chunks))], dtype=torch.long,
                             device=device)
    position_ids = ctx.positions[None]
    last_index = [end - 1 for c, end in zip(chunks, accumulate(query_lens)) if c.needs_logits]
    keep = torch.tensor(last_index, dtype=torch.long, device=device)
    return ctx, input_ids, position_ids, keep


def make_batch(cache, rng, decodes: int, mixed: bool) -> StepBatch:
    """decodes sequences of 100..600 cached tokens decoding one token; mixed: plus a 256-token prefill
    chunk and a 5-token extend (a jump-forward run)."""
    chunks = []
    for i in range(decodes):
        cached = rng.randint(100, 600)
        cache.blocks.allocate(("d", i), cached + 1)
        chunks.append(SequenceChunk(("d", i), (rng.randrange(1000),), cached))
    if mixed:
        cache.blocks.allocate("prefill", 256)
        chunks.append(SequenceChunk("prefill", tuple(range(256)), 0, needs_logits=False))
        cache.blocks.allocate("extend", 305)
        chunks.append(SequenceChunk("extend", tuple(range(5)), 300))
    return StepBatch.of(chunks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-rev", required=True, help="git revision whose attention.py is the old builder")
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    old = load_old_attention(args.old_rev)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    rng = random.Random(0)
    print(f"{'step':>18} {'old us':>8} {'new us':>8} {'new/old':>8}")
    for decodes in (1, 8, 32):
        for mixed in (False, True):
            cache = PagedKVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1), num_blocks=4096)
            batch = make_batch(cache, rng, decodes, mixed)
            times = {"old": [], "new": []}
            for r in range(args.rounds):
                order = ("old", "new") if r % 2 else ("new", "old")
                for which in order:
                    t0 = time.perf_counter_ns()
                    out = old_inputs(old, cache, batch, device) if which == "old" else new_inputs(cache, batch, device)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times[which].append(time.perf_counter_ns() - t0)
                    del out
            o, n = (statistics.median(times[k]) / 1000 for k in ("old", "new"))
            label = f"{decodes} decode" + (" + prefill/extend" if mixed else "")
            print(f"{label:>18} {o:8.1f} {n:8.1f} {n / o:8.2f}", flush=True)


if __name__ == "__main__":
    main()
