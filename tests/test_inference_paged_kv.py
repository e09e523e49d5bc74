"""Paged KV cache: block allocation, block tables, slot mapping, errors that leave state unchanged."""

from __future__ import annotations

import pytest
import torch

from inference_svc.model.paged_kv import BlockManager, KVCacheSpec, OutOfBlocksError, PagedKVCache


def test_allocate_extend_free_and_usage():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("a", 5)  # 2 blocks
    assert bm.num_tokens("a") == 5 and len(bm.block_table("a")) == 2
    assert bm.usage_ratio == pytest.approx(2 / 8)
    bm.extend("a", 3)  # 8 tokens: still 2 blocks
    assert len(bm.block_table("a")) == 2
    bm.extend("a", 1)  # 9 tokens: a third block
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 5
    bm.allocate("b", 0)  # a sequence may exist before its first token
    assert bm.block_table("b") == [] and "b" in bm and len(bm) == 2
    bm.free("a")
    bm.free("a")  # freeing twice is harmless (finish and cancel may race)
    assert bm.num_free_blocks == 8 and bm.usage_ratio == 0.0 and "a" not in bm


def test_slot_mapping_spans_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("x", 3)
    bm.allocate("y", 4)
    bm.extend("x", 4)
    table = bm.block_table("x")
    assert len(table) == 2 and set(table).isdisjoint(bm.block_table("y"))
    slots = bm.slot_mapping("x", 2, 4)  # positions 2, 3 | 4, 5
    assert slots == [table[0] * 4 + 2, table[0] * 4 + 3, table[1] * 4 + 0, table[1] * 4 + 1]
    with pytest.raises(ValueError, match="reserved"):
        bm.slot_mapping("x", 5, 3)


def test_out_of_blocks_is_clear_and_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 6)  # 3 blocks
    assert bm.can_allocate("a", 2) and not bm.can_allocate("a", 3)
    assert not bm.can_allocate(None, 3) and bm.blocks_needed(None, 3) == 2
    with pytest.raises(OutOfBlocksError, match=r"needs 2 more block\(s\) of 2 tokens, 1 of 4 free") as err:
        bm.extend("a", 3)
    assert err.value.needed == 2 and err.value.free == 1
    assert bm.num_tokens("a") == 6 and len(bm.block_table("a")) == 3 and bm.num_free_blocks == 1
    with pytest.raises(OutOfBlocksError):
        bm.allocate("b", 3)
    assert "b" not in bm and bm.num_free_blocks == 1


def test_truncate_returns_whole_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("s", 10)  # 3 blocks
    bm.truncate("s", 5)  # 2 blocks
    assert bm.num_tokens("s") == 5 and len(bm.block_table("s")) == 2 and bm.num_free_blocks == 6
    with pytest.raises(ValueError):
        bm.truncate("s", 6)


def test_freed_blocks_are_reused_first():
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.allocate("a", 8)
    a_blocks = bm.block_table("a")
    bm.allocate("b", 4)
    bm.free("a")
    bm.allocate("c", 8)
    assert bm.block_table("c") == a_blocks


def test_unknown_sequence_and_bad_arguments():
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(KeyError, match="no KV blocks"):
        bm.extend("nope", 1)
    bm.allocate("a", 1)
    with pytest.raises(ValueError, match="already"):
        bm.allocate("a", 1)
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)


def test_cache_tensors_and_write():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
    assert spec.bytes_per_token == 2 * 2 * 2 * 8 * 4
    assert spec.blocks_for_bytes(spec.bytes_per_block * 10) == 10
    cache = PagedKVCache(spec, num_blocks=10)
    assert cache.key[0].shape == (10, 4, 2, 8) and cache.num_slots == 40
    cache.blocks.allocate("s", 6)
    slots = torch.tensor(cache.blocks.slot_mapping("s", 0, 6))
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    cache.write(1, slots, k, v)
    k_flat, v_flat = cache.flat(1)
    assert torch.equal(k_flat[slots], k) and torch.equal(v_flat[slots], v)
    assert cache.key[0].abs().sum() == 0  # other layers untouched
    # The attention's write: transformers' [1, kv_heads, n, head_dim] layout, into the same slots.
    other = PagedKVCache(spec, num_blocks=10)
    assert other.write_heads_first(1, slots, k.transpose(0, 1)[None], v.transpose(0, 1)[None]) == other.flat(1)
    assert torch.equal(other.key[1], cache.key[1]) and torch.equal(other.value[1], cache.value[1])
    assert other.key[0].abs().sum() == 0
