"""The step context built with tensor ops equals the straightforward per-token reference, field by field.

Layouts come from a real BlockManager driven through random steps: prefills
(whole and chunked), decodes, multi-token extends, rollbacks (truncate),
preemptions (free, then recompute from position 0) and finishes, so the block
tables have the holes, reuse and growth the engine produces. Equal index
tensors (slots, positions, masks, gather rows) mean equal attention, hence
equal logits; test_inference_model_runner checks those against plain
transformers.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from inference_svc.model.attention import CONTEXT_KWARG, PagedAttentionContext, paged_attention_forward
from inference_svc.model.paged_kv import KVCacheSpec, PagedKVCache
from tests.paged_context_reference import reference_context

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=1)


def random_steps(seed: int, block_size: int, num_blocks: int = 96, steps: int = 40):
    """(cache, query_lens, context_lens, seq_ids) of each step of a random workload over a real BlockManager."""
    rng = random.Random(seed)
    cache = PagedKVCache(KVCacheSpec(SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim, block_size=block_size),
                         num_blocks)
    blocks = cache.blocks
    written: dict[int, int] = {}  # tokens of each live sequence already in the cache
    next_id = 0
    for _ in range(steps):
        plan: dict[int, tuple[int, int]] = {}  # seq -> (context_len, query_len)
        for seq in list(written):
            action = rng.choice(["decode", "decode", "decode", "extend", "rollback", "preempt", "finish", "skip"])
            if action == "finish":
                blocks.free(seq)
                del written[seq]
            elif action == "preempt":
                # Recompute: everything it had is fed again from position 0.
                blocks.free(seq)
                n = written[seq] + 1
                if blocks.can_allocate(None, n):
                    blocks.allocate(seq, n)
                    plan[seq] = (0, n)
                else:
                    del written[seq]
            elif action != "skip":
                if action == "rollback" and written[seq] > 1:
                    written[seq] = rng.randrange(1, written[seq])
                    blocks.truncate(seq, written[seq])
                n = 1 if action == "decode" else rng.randint(1, 3 * block_size)
                if blocks.can_allocate(seq, n):
                    blocks.extend(seq, n)
                    plan[seq] = (written[seq], n)
        for _ in range(rng.randint(0 if plan else 1, 3)):
            n = rng.randint(1, 5 * block_size)
            if blocks.can_allocate(None, n):
                blocks.allocate(next_id, n)
                plan[next_id] = (0, n)
                next_id += 1
        if not plan:
            continue
        order = list(plan)
        rng.shuffle(order)
        yield cache, [plan[s][1] for s in order], [plan[s][0] for s in order], order
        for seq in order:
            written[seq] = sum(plan[seq])


def assert_same_context(got: PagedAttentionContext, want: PagedAttentionContext) -> None:
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables", "positions"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.decodes is None) == (want.decodes is None)
    if want.decodes is not None:
        for name in ("token_index", "slots", "mask"):
            a, b = getattr(got.decodes, name), getattr(want.decodes, name)
            assert a.dtype == b.dtype and torch.equal(a, b), f"decodes.{name}"
    assert len(got.chunks) == len(want.chunks)
    for c, r in zip(got.chunks, want.chunks):
        assert (c.q_start, c.q_end) == (r.q_start, r.q_end)
        for name in ("slots", "mask"):
            a, b = getattr(c, name), getattr(r, name)
            assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b))), name


@pytest.mark.parametrize("seed, block_size, num_blocks", [
    pytest.param(1, 1, 96, id="block-1"),
    pytest.param(2, 4, 96, id="block-4"),
    pytest.param(3, 16, 96, id="block-16"),
    # Few blocks: allocations are refused, sequences dropped, freed blocks reused at once.
    pytest.param(4, 4, 20, id="block-4-tight"),
])
def test_context_equals_list_reference(seed, block_size, num_blocks):
    cpu = torch.device("cpu")
    steps = 0
    for cache, query_lens, context_lens, seq_ids in random_steps(seed, block_size, num_blocks):
        tables = [cache.blocks.block_table(s) for s in seq_ids]
        got = PagedAttentionContext.build(cache, query_lens, context_lens, cache.blocks.block_tables(seq_ids), cpu)
        assert_same_context(got, reference_context(cache, query_lens, context_lens, tables, cpu))
        steps += 1
    assert steps >= 20


def test_block_table_rows_follow_the_lists():
    # More sequences and longer tables than the preallocated rows hold: both grow.
    cache = PagedKVCache(SPEC, num_blocks=64)
    blocks = cache.blocks
    for i in range(20):
        blocks.allocate(i, 3 * i)
    blocks.extend(19, 16 * 5)
    blocks.truncate(19, 5)
    for i in range(0, 20, 3):
        blocks.free(i)
    blocks.allocate("late", 40)
    live = [s for s in [*range(20), "late"] if s in blocks]
    rows = blocks.block_tables(live)
    width = max(len(blocks.block_table(s)) for s in live)
    assert rows.dtype == torch.long and rows.shape == (len(live), width)
    for s, row in zip(live, rows.tolist()):
        table = blocks.block_table(s)
        assert row == table + [-1] * (width - len(table))


@pytest.mark.parametrize("seed, block_size", [
    pytest.param(1, 1, id="block-1"),
    pytest.param(2, 4, id="block-4"),
    pytest.param(3, 16, id="block-16"),
])
def test_an_all_decode_step_attends_as_the_general_path_does(seed, block_size):
    """A step of decodes alone returns the decode group's attention as is; the general path (the group's query
    rows gathered, its output rows scattered into the step's) gives the same bits."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    cache = PagedKVCache(KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, block_size=block_size), 256)
    blocks = cache.blocks
    lens = [rng.randint(1, 40) for _ in range(7)]
    for seq, n in enumerate(lens):
        blocks.allocate(seq, n + 1)
        slots = torch.tensor(blocks.slot_mapping(seq, 0, n))
        cache.write(0, slots, torch.randn(n, 2, 8, generator=gen), torch.randn(n, 2, 8, generator=gen))
    order = list(range(len(lens)))
    rng.shuffle(order)
    ctx = PagedAttentionContext.build(cache, [1] * len(order), [lens[s] for s in order],
                                      blocks.block_tables(order), torch.device("cpu"))
    general = dataclasses.replace(ctx, decodes=dataclasses.replace(ctx.decodes, whole_step=False))
    assert ctx.decodes.whole_step
    q = torch.randn(1, len(order), 4, 8, generator=gen).transpose(1, 2)  # transformers' layout: a view
    k, v = (torch.randn(1, len(order), 2, 8, generator=gen).transpose(1, 2) for _ in range(2))
    layer = SimpleNamespace(layer_idx=0)
    got, _ = paged_attention_forward(layer, q, k, v, None, **{CONTEXT_KWARG: ctx})
    want, _ = paged_attention_forward(layer, q, k, v, None, **{CONTEXT_KWARG: general})
    assert got.shape == want.shape == (1, len(order), 4, 8) and torch.equal(got, want)
