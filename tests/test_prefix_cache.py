"""The prefix cache in the block manager: chained block hashes, mapping cached blocks, reference counts, eviction
order, truncation of shared blocks, and the bookkeeping invariants under random operations."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_svc.model.paged_kv import BlockManager, OutOfBlocksError, chain_block_hashes

BS = 4


def _computed(bm: BlockManager, seq, tokens: list[int], hashes: list[bytes] | None = None) -> list[bytes]:
    """Allocates `seq` for `tokens` with whatever prefix is cached, as the scheduler does, and marks every token
    computed (the forward wrote them); returns the tokens' block hashes."""
    hashes = chain_block_hashes(tokens, hashes if hashes is not None else [], BS)
    cached = bm.cached_prefix(hashes, len(tokens))
    bm.allocate(seq, len(tokens), cached)
    bm.cache_computed(seq, hashes, len(tokens))
    return hashes


def test_a_block_hash_names_the_whole_prefix_not_just_its_tokens():
    a = chain_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], [], BS)
    b = chain_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], [], BS)
    assert len(a) == 2 and a[1] != b[1], "the same tokens after another prefix are another block"
    assert chain_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 1], [], BS) == a, "a partial block has no hash"
    grown = chain_block_hashes([1, 2, 3, 4], [], BS)
    assert chain_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], grown, BS) == a, "extending a chain equals hashing anew"


def test_a_later_sequence_maps_the_cached_prefix_and_leaves_one_token_to_compute():
    bm = BlockManager(16, BS, prefix_caching=True)
    prompt = list(range(100, 112))  # three full blocks
    hashes = _computed(bm, "a", prompt)
    assert bm.num_cached_blocks == 3
    # The same 12 tokens: at most 11 may come from the cache, so two blocks do (one token is computed).
    assert bm.cached_prefix(hashes, 12) == bm.block_table("a")[:2]
    longer = chain_block_hashes(prompt + [7, 7, 7], [], BS)
    cached = bm.cached_prefix(longer, 15)
    assert cached == bm.block_table("a")
    bm.allocate("b", 15, cached)
    assert bm.block_table("b")[:3] == bm.block_table("a") and bm.num_free_blocks == 16 - 4
    bm.check_invariants()
    bm.free("a")
    assert bm.num_cached_free_blocks == 0, "blocks b still maps are not free"
    bm.free("b")
    assert bm.usage_ratio == 0.0 and bm.num_cached_free_blocks == 3
    bm.check_invariants()


def test_freed_cached_blocks_survive_until_an_allocation_needs_them_and_go_least_recent_first():
    bm = BlockManager(6, BS, prefix_caching=True)
    first = _computed(bm, "a", list(range(8)))  # two blocks
    second = _computed(bm, "b", list(range(50, 58)))  # two more
    bm.free("a")
    bm.free("b")
    assert bm.num_cached_free_blocks == 4 and bm.num_free_blocks == 6
    bm.allocate("c", 12)  # three blocks: the two never cached, then the least recently freed cached one
    assert bm.num_cached_blocks == 3
    # a's last block went first (a was freed first, and a sequence's last block before its first).
    assert bm.cached_prefix(first, 9) == bm.cached_prefix(first, 9)[:1] and len(bm.cached_prefix(first, 9)) == 1
    assert len(bm.cached_prefix(second, 9)) == 2
    bm.check_invariants()


def test_the_cache_is_off_unless_asked():
    bm = BlockManager(8, BS)
    hashes = _computed(bm, "a", list(range(8)))
    bm.free("a")
    assert bm.cached_prefix(hashes, 9) == [] and bm.num_cached_blocks == 0


def test_a_prefix_computed_twice_at_once_is_cached_once():
    bm = BlockManager(8, BS, prefix_caching=True)
    tokens = list(range(8))
    hashes = chain_block_hashes(tokens, [], BS)
    bm.allocate("a", 8)
    bm.allocate("b", 8)  # admitted in the same step: nothing cached yet
    bm.cache_computed("a", hashes, 8)
    bm.cache_computed("b", hashes, 8)
    assert bm.num_cached_blocks == 2 and bm.cached_prefix(hashes, 9) == bm.block_table("a")
    bm.free("b")
    assert bm.num_cached_free_blocks == 0, "b's duplicates are plain free blocks"
    bm.check_invariants()


def test_allocation_counts_the_free_cached_blocks_it_revives():
    bm = BlockManager(3, BS, prefix_caching=True)
    hashes = _computed(bm, "a", list(range(8)))
    bm.free("a")
    cached = bm.cached_prefix(chain_block_hashes(list(range(12)), [], BS), 12)
    assert len(cached) == 2
    assert bm.can_allocate(None, 12, cached), "two cached blocks and one new: three of three"
    assert not bm.can_allocate(None, 16, cached)
    with pytest.raises(OutOfBlocksError):
        bm.allocate("b", 16, cached)
    bm.check_invariants()
    bm.allocate("b", 12, cached)
    assert bm.num_free_blocks == 0 and bm.cached_prefix(hashes, 9) == cached
    bm.check_invariants()


def test_cached_blocks_must_start_the_sequence_and_leave_a_token():
    bm = BlockManager(8, BS, prefix_caching=True)
    hashes = _computed(bm, "a", list(range(8)))
    with pytest.raises(ValueError, match="cached blocks"):
        bm.allocate("b", 8, bm.block_table("a"))  # every token cached: nothing left to give logits
    with pytest.raises(ValueError, match="cached blocks"):
        bm.allocate("c", 9, [7])  # not a cached block
    assert "b" not in bm and "c" not in bm and bm.cached_prefix(hashes, 9) == bm.block_table("a")


@pytest.mark.parametrize("cut, shared, valid", [
    pytest.param(6, False, 6, id="inside-an-own-cached-block"),
    pytest.param(6, True, 4, id="inside-a-shared-block"),
    pytest.param(8, True, 8, id="at-a-block-boundary"),
])
def test_truncation_never_leaves_a_shared_or_cached_block_to_be_written(cut, shared, valid):
    bm = BlockManager(8, BS, prefix_caching=True)
    tokens = list(range(12))
    hashes = _computed(bm, "a", tokens)
    if shared:
        bm.allocate("b", 12, bm.cached_prefix(hashes, 12))
    before = bm.block_table("a")
    assert bm.truncate("a", cut) == valid
    table = bm.block_table("a")
    assert bm.num_tokens("a") == cut and len(table) == bm.blocks_for(cut)
    if cut % BS:
        last = table[-1]
        assert (last != before[cut // BS]) == shared, "a shared block is swapped for an own one"
        assert last not in bm.cached_prefix(hashes, 12), "the block the sequence writes next is not cached"
    if shared:
        assert bm.block_table("b")[:2] == before[:2], "the other sequence keeps its blocks"
    bm.check_invariants()


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_random_operations_keep_the_books_and_the_cache_honest(seed):
    """Random allocations over a few shared prefixes, extends, truncations and frees under KV pressure: the
    invariants hold after every operation, and every cached block a sequence maps holds what its hash says
    (tracked in a shadow of the slots: a slot's KV depends on its token and every token before it)."""
    rng = random.Random(seed)
    bm = BlockManager(12, BS, prefix_caching=True)
    shadow: dict[int, tuple[int, ...]] = {}  # slot -> the tokens up to the one whose KV it holds
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    seqs: dict[int, tuple[list[int], list[bytes], int]] = {}  # seq -> (tokens, hashes, computed)
    for step in range(60):
        op = rng.random()
        if op < 0.4 or not seqs:
            tokens = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
            hashes = chain_block_hashes(tokens, [], BS)
            cached = bm.cached_prefix(hashes, len(tokens))
            for i, block in enumerate(cached):
                assert [shadow[block * BS + j] for j in range(BS)] == [tuple(tokens[:i * BS + j + 1])
                                                                      for j in range(BS)]
            if not bm.can_allocate(None, len(tokens), cached):
                continue
            bm.allocate(step, len(tokens), cached)
            seqs[step] = (tokens, hashes, len(cached) * BS)
        seq = rng.choice(list(seqs))
        tokens, hashes, computed = seqs[seq]
        if op < 0.6:  # the forward writes the uncomputed tokens
            for p, slot in enumerate(bm.slot_mapping(seq, computed, len(tokens) - computed), computed):
                shadow[slot] = tuple(tokens[:p + 1])
            bm.cache_computed(seq, hashes, len(tokens))
            seqs[seq] = (tokens, hashes, len(tokens))
        elif op < 0.75 and bm.can_allocate(seq, 2):
            bm.extend(seq, 2)
            tokens = tokens + [rng.randrange(5), rng.randrange(5)]
            seqs[seq] = (tokens, chain_block_hashes(tokens, hashes, BS), computed)
        elif op < 0.85 and computed == len(tokens):
            keep = rng.randrange(len(tokens) + 1)
            try:
                valid = bm.truncate(seq, keep)
            except OutOfBlocksError:
                continue
            del tokens[keep:]
            seqs[seq] = (tokens, chain_block_hashes(tokens, [], BS), valid)
        else:
            bm.free(seq)
            del seqs[seq]
        bm.check_invariants()
