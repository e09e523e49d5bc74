"""The block manager's and the KV cache's rules that mutation testing found untested (docs/mutation.md).

Block tables are padded with -1 past each sequence's blocks (on a fresh
manager, after a rollback, in a row a freed sequence left, and after the
table tensor grows for more sequences or longer tables), and every sequence
keeps a row of its own however many there are; the smallest cache is one
block of one token; errors name the sequence and the numbers; a partial
block has no hash; growing inside the last block needs no free block, and a
cached prefix another sequence maps needs none either; only computed blocks
join the prefix cache; a rollback inside a shared cached block swaps it for
an own one (from the blocks it gives back when none is free), the block
table saying so, and a block cut inside is registered again once
recomputed; the KV tensors have the spec's dtype and the cache's device, and
a spec follows the model's config.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from inference_svc.model.paged_kv import BlockManager, KVCacheSpec, OutOfBlocksError, PagedKVCache, chain_block_hashes
from tests.test_prefix_cache import _computed  # blocks of 4 tokens


def test_a_truncated_table_is_padded_with_minus_one():
    bm = BlockManager(64, 4)
    bm.allocate("a", 12)
    bm.allocate("b", 12)
    assert bm.truncate("a", 5) == 5
    tables = bm.block_tables(["a", "b"])
    assert tables[0, 2].item() == -1 and tables[0, :2].tolist() == bm.block_table("a")
    assert tables[1].tolist() == bm.block_table("b")


def test_tables_grown_for_more_and_longer_sequences_are_padded_with_minus_one():
    bm = BlockManager(256, 2)
    for i in range(9):  # past the eight rows the tensor starts with
        bm.allocate(i, 2)
    bm.allocate("long", 2 * 12)  # past its eight columns
    tables = bm.block_tables([8, "long"])
    assert tables.dtype == torch.int64 and tables.shape == (2, 12)
    assert tables[0, 0].item() == bm.block_table(8)[0] and (tables[0, 1:] == -1).all()
    assert tables[1].tolist() == bm.block_table("long")


def test_truncating_past_the_end_names_both_lengths():
    bm = BlockManager(16, 4)
    bm.allocate("a", 10)
    with pytest.raises(ValueError, match=r"^sequence 'a': cannot truncate 10 tokens to 11$"):
        bm.truncate("a", 11)


def test_tables_are_padded_with_minus_one_on_a_fresh_manager_and_in_a_freed_sequences_row():
    bm = BlockManager(64, 4)
    bm.allocate("short", 4)
    bm.allocate("long", 12)
    assert bm.block_tables(["short", "long"])[0].tolist() == bm.block_table("short") + [-1, -1]
    bm.free("long")
    bm.allocate("reuses-its-row", 4)
    bm.allocate("longer", 16)
    tables = bm.block_tables(["reuses-its-row", "longer"])
    assert tables[0].tolist() == bm.block_table("reuses-its-row") + [-1, -1, -1]


def test_every_sequence_keeps_a_table_row_of_its_own_however_many_there_are():
    bm = BlockManager(128, 2)
    ids = list(range(40))  # past the eight rows the tensor starts with, and past twice and four times that
    for i in ids:
        bm.allocate(i, 2 * (1 + i % 3))
    tables = bm.block_tables(ids)
    for i in ids:
        width = len(bm.block_table(i))
        assert tables[i, :width].tolist() == bm.block_table(i) and (tables[i, width:] == -1).all()


def test_the_smallest_cache_is_one_block_of_one_token():
    bm = BlockManager(1, 1)
    bm.allocate("a", 1)
    assert bm.block_table("a") == [0] and bm.num_free_blocks == 0
    with pytest.raises(ValueError, match=r"^need num_blocks >= 1 and block_size >= 1, got 0 and 4$"):
        BlockManager(0, 4)


def test_refusals_name_the_sequence_and_the_numbers():
    bm = BlockManager(4, 4)
    bm.allocate("a", 8)
    with pytest.raises(OutOfBlocksError, match=r"^KV cache out of blocks: sequence 'b' needs 3 more block\(s\) of 4 "
                                               r"tokens, 2 of 4 free$"):
        bm.allocate("b", 12)
    with pytest.raises(OutOfBlocksError, match=r"sequence 'a' needs 3 more block"):
        bm.extend("a", 12)
    with pytest.raises(ValueError, match=r"^num_tokens must be >= 0, got -1$"):
        bm.allocate("c", -1)
    with pytest.raises(ValueError, match=r"^num_new_tokens must be >= 0, got -1$"):
        bm.extend("a", -1)
    with pytest.raises(ValueError, match=r"^sequence 'a': positions 6\.\.9 are outside its 8 reserved token slots$"):
        bm.slot_mapping("a", 6, 4)


@pytest.mark.parametrize("start, count", [pytest.param(-1, 2, id="negative-start"),
                                          pytest.param(2, -1, id="negative-count")])
def test_slot_mapping_refuses_negative_positions_and_counts(start, count):
    bm = BlockManager(4, 4)
    bm.allocate("a", 8)
    with pytest.raises(ValueError, match="reserved token slots"):
        bm.slot_mapping("a", start, count)


def test_extending_by_nothing_changes_nothing():
    bm = BlockManager(4, 4)
    bm.allocate("a", 4)
    bm.extend("a", 0)
    assert bm.num_tokens("a") == 4 and bm.block_table("a") == [0] and bm.num_free_blocks == 3


def test_a_partial_block_has_no_hash_however_close_to_full():
    assert len(chain_block_hashes(list(range(7)), [], 4)) == 1
    assert len(chain_block_hashes(list(range(8)), [], 4)) == 2


def test_growing_inside_the_last_block_needs_no_free_block():
    bm = BlockManager(2, 4)
    bm.allocate("a", 5)  # both blocks, three slots of the second left
    assert bm.can_allocate("a", 3) and not bm.can_allocate("a", 4)


def test_a_cached_prefix_another_sequence_maps_needs_no_free_block():
    bm = BlockManager(4, 4, prefix_caching=True)
    hashes = _computed(bm, "a", list(range(9)))  # three blocks, two of them full and cached
    cached = bm.cached_prefix(hashes, 9)
    assert len(cached) == 2 and bm.num_free_blocks == 1
    assert bm.can_allocate(None, 10, cached) and not bm.can_allocate(None, 13, cached)


def test_cached_blocks_must_leave_a_token_to_compute_with_one_token_blocks():
    bm = BlockManager(4, 1, prefix_caching=True)
    hashes = chain_block_hashes([5, 6], [], 1)
    bm.allocate("a", 2)
    bm.cache_computed("a", hashes, 2)
    with pytest.raises(ValueError, match="cached blocks"):
        bm.allocate("b", 1, bm.cached_prefix(hashes, 2)[:1])


def test_only_computed_blocks_join_the_prefix_cache():
    bm = BlockManager(8, 4, prefix_caching=True)
    tokens = list(range(16))
    hashes = chain_block_hashes(tokens, [], 4)
    bm.allocate("a", 16)
    bm.cache_computed("a", hashes, 9)  # a first prefill chunk: two full blocks written, the rest not yet
    assert bm.cached_prefix(hashes, 16) == bm.block_table("a")[:2]


def test_a_rollback_inside_the_last_block_keeps_its_blocks():
    bm = BlockManager(4, 4)
    bm.allocate("a", 10)
    before = bm.block_table("a")
    assert bm.truncate("a", 9) == 9 and bm.block_table("a") == before


def test_a_mapping_sequence_rolling_back_inside_a_shared_block_swaps_it_and_its_table_says_so():
    bm = BlockManager(8, 4, prefix_caching=True)
    hashes = _computed(bm, "a", list(range(8)))
    bm.allocate("b", 9, bm.cached_prefix(hashes, 9))  # maps a's two blocks
    shared = bm.block_table("a")
    assert bm.truncate("b", 2) == 0, "the cut falls in the first block: nothing of it can be kept"
    own = bm.block_table("b")
    assert len(own) == 1 and own[0] not in shared and bm.block_table("a") == shared
    assert bm.block_tables(["b"])[0].tolist()[:1] == own
    bm.check_invariants()


def test_a_rollback_into_a_shared_block_with_no_block_free_takes_one_it_gave_back():
    bm = BlockManager(3, 4, prefix_caching=True)
    hashes = _computed(bm, "a", list(range(8)))
    bm.allocate("b", 12, bm.cached_prefix(chain_block_hashes(list(range(12)), [], 4), 12))  # a's two + its own
    assert bm.num_free_blocks == 0
    assert bm.truncate("b", 6) == 4
    assert bm.block_table("b")[1] not in bm.block_table("a") and bm.cached_prefix(hashes, 9) == bm.block_table("a")
    bm.check_invariants()


@pytest.mark.parametrize("shared_tokens", [pytest.param(8, id="cut-in-the-last-block"),
                                           pytest.param(12, id="shared-blocks-past-the-cut")])
def test_a_rollback_that_needs_a_block_when_none_can_be_had_is_refused_and_changes_nothing(shared_tokens):
    num_blocks = shared_tokens // 4 + 1
    bm = BlockManager(num_blocks, 4, prefix_caching=True)
    _computed(bm, "a", list(range(shared_tokens)))
    _computed(bm, "b", list(range(shared_tokens + 1)))  # a's blocks and one of its own
    assert bm.truncate("b", shared_tokens) == shared_tokens  # its own block given back: b maps a's only
    bm.allocate("c", 4)  # and c takes the last free block: giving back shared blocks frees none
    table = bm.block_table("b")
    with pytest.raises(OutOfBlocksError, match=r"^KV cache out of blocks: sequence 'b' needs 1 more block\(s\) of 4 "
                                               rf"tokens, 0 of {num_blocks} free$"):
        bm.truncate("b", 6)
    assert bm.num_tokens("b") == shared_tokens and bm.block_table("b") == table
    bm.check_invariants()


def test_a_block_cut_inside_is_registered_again_once_recomputed():
    bm = BlockManager(8, 4, prefix_caching=True)
    _computed(bm, "a", list(range(12)))
    bm.truncate("a", 6)  # inside its own second block: the block leaves the cache
    bm.extend("a", 2)
    tokens = list(range(6)) + [60, 61]
    hashes = chain_block_hashes(tokens, [], 4)
    bm.cache_computed("a", hashes, 8)
    assert bm.cached_prefix(hashes, 9) == bm.block_table("a")


def test_blocks_for_bytes_is_a_whole_number_and_at_least_one():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
    assert spec.blocks_for_bytes(0) == 1
    blocks = spec.blocks_for_bytes(spec.bytes_per_block * 5 // 2)
    assert blocks == 2 and isinstance(blocks, int)


def test_the_kv_tensors_have_the_specs_dtype_and_the_caches_device():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.bfloat16, block_size=4)
    cache = PagedKVCache(spec, 4)
    assert {t.dtype for t in cache.key + cache.value} == {torch.bfloat16}
    cache.blocks.allocate("s", 2)
    slots = torch.tensor(cache.blocks.slot_mapping("s", 0, 2))
    key, value = torch.full((2, 1, 4), 1.5), torch.full((2, 1, 4), -2.5)  # float32, exact in bfloat16
    cache.write(0, slots, key, value)
    assert torch.equal(cache.flat(0)[0][slots].float(), key) and torch.equal(cache.flat(0)[1][slots].float(), value)
    meta = PagedKVCache(spec, 4, "meta")
    assert meta.device == torch.device("meta") and {t.device.type for t in meta.key + meta.value} == {"meta"}


def test_the_cache_has_prefix_caching_only_when_asked():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4)
    assert not PagedKVCache(spec, 4).blocks.prefix_caching
    assert PagedKVCache(spec, 4, prefix_caching=True).blocks.prefix_caching is True


@pytest.mark.parametrize("config, tp_size, expected", [
    pytest.param(dict(num_attention_heads=8, hidden_size=1024, num_hidden_layers=3, head_dim=32,
                      num_key_value_heads=4), 2, (3, 2, 32), id="explicit-head-dim-and-kv-heads-split"),
    pytest.param(dict(num_attention_heads=8, hidden_size=1024, num_hidden_layers=3), 1, (3, 8, 128),
                 id="derived-head-dim-and-kv-heads"),
    pytest.param(dict(num_attention_heads=8, hidden_size=1024, num_hidden_layers=3, head_dim=None,
                      num_key_value_heads=None), 4, (3, 2, 128), id="none-means-derived"),
])
def test_a_spec_follows_the_models_config(config, tp_size, expected):
    spec = KVCacheSpec.from_model_config(SimpleNamespace(**config), torch.bfloat16, 8, tp_size)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == expected
    assert (spec.dtype, spec.block_size) == (torch.bfloat16, 8)
    assert PagedKVCache(spec, 2).key[0].shape == (2, 8, expected[1], expected[2])  # whole numbers: a shape


def test_a_spec_is_for_one_rank_and_blocks_of_16_tokens_unless_told():
    config = SimpleNamespace(num_attention_heads=8, hidden_size=1024, num_hidden_layers=3, num_key_value_heads=4)
    spec = KVCacheSpec.from_model_config(config, torch.float16)
    assert (spec.num_kv_heads, spec.block_size) == (4, 16)


def test_a_spec_refuses_kv_heads_that_do_not_split_over_the_ranks():
    config = SimpleNamespace(num_attention_heads=8, hidden_size=1024, num_hidden_layers=3, num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"^the model's 4 KV heads do not split over 3 tensor-parallel ranks$"):
        KVCacheSpec.from_model_config(config, torch.float32, 16, tp_size=3)
