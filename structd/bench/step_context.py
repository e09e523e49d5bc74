"""`structd bench step-context`: host time to build one step's inputs and attention context, old builder vs current.

The old builder is inference_svc/model/attention.py as of --old-rev (default
08b29cc, the builder before issue 13 part 2), loaded from git, driven by the
old runner's per-token input loop (copied below); the new one is the working
tree's. Both run on the same batches (1, 8, 32 decodes, each alone and with a
256-token prefill chunk and a 5-token extend), alternating call by call in
one process so machine noise hits them alike. Reports medians in
microseconds and new/old ratios; writes <out>/step-context.json and .png.
The model is not run: this is the builder's cost alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from itertools import accumulate, chain
from pathlib import Path

from structd.bench.harness import UsageError, old_new, progress

OLD_REV = "08b29cc"


def add_arguments(p: argparse.ArgumentParser) -> None:
    old_new.add_old_rev(p, OLD_REV, "inference_svc/model/attention.py is the old builder")
    p.add_argument("--rounds", type=int, default=2000, help="calls of each builder per batch")
    p.add_argument("--device", default="cpu")


def load_old_attention(rev: str):
    # Before 43f705f the builder and the KV cache were at the top of inference_svc/.
    return old_new.module_at_revision(rev, ("inference_svc/model/attention.py", "inference_svc/attention.py"),
                                      "old_attention",
                                      (("from inference_svc.paged_kv import", "from inference_svc.model.paged_kv import"),))


def old_inputs(old, cache, batch, device):
    """The runner's input building before issue 13 (forward + forward_with_tables), verbatim in substance."""
    import torch

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
    import torch

    from inference_svc.model.attention import PagedAttentionContext

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


def make_batch(cache, rng, decodes: int, mixed: bool):
    """decodes sequences of 100..600 cached tokens decoding one token; mixed: plus a 256-token prefill
    chunk and a 5-token extend (a jump-forward run)."""
    from inference_svc.model.model_runner import SequenceChunk, StepBatch

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


def time_batch(old, device, rng: random.Random, decodes: int, mixed: bool, rounds: int) -> dict:
    """Both builders on one batch, alternating call by call (the order swapping each round): medians in us."""
    import torch

    from inference_svc.model.paged_kv import KVCacheSpec, PagedKVCache

    cache = PagedKVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1), num_blocks=4096)
    batch = make_batch(cache, rng, decodes, mixed)
    times: dict[str, list[int]] = {"old": [], "new": []}
    for r in range(rounds):
        for which in old_new.order(r):
            t0 = time.perf_counter_ns()
            out = old_inputs(old, cache, batch, device) if which == "old" else new_inputs(cache, batch, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[which].append(time.perf_counter_ns() - t0)
            del out
    o, n = (statistics.median(times[k]) / 1000 for k in ("old", "new"))
    label = f"{decodes} decode{'s' if decodes > 1 else ''}" + (" + prefill/extend" if mixed else "")
    return {"step": label, "decodes": decodes, "mixed": mixed, "old_us": round(o, 1), "new_us": round(n, 1),
            "new_over_old": round(n / o, 3)}


def result_name(args) -> str:
    return "step-context"


def run(args) -> dict:
    import torch

    if args.rounds < 1:
        raise UsageError("--rounds must be at least 1")
    old = old_new.load_old(load_old_attention, args.old_rev, "inference_svc/model/attention.py")
    device = torch.device(args.device)
    torch.set_num_threads(1)
    rng = random.Random(0)
    rows = []
    for decodes in (1, 8, 32):
        for mixed in (False, True):
            rows.append(time_batch(old, device, rng, decodes, mixed, args.rounds))
            progress(f"{rows[-1]['step']}: new/old {rows[-1]['new_over_old']:.2f}")
    return {"steps": rows}


def markdown(result: dict) -> str:
    return old_new.markdown(result["steps"], "step", "old_us", "new_us", "step", "µs")


def plot(result: dict, png: Path) -> None:
    old_new.plot(result["steps"], "step", "old_us", "new_us", "median µs per step", png)
