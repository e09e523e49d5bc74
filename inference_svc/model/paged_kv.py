"""The engine's paged KV cache: fixed-size blocks, a block allocator with a prefix cache, per-sequence block tables.

Two layers, so that the scheduler's accounting does not depend on where the
tensors live:

- `BlockManager`: which blocks each sequence maps and how many token slots it
  has reserved. The scheduler asks it `can_allocate` before admitting or
  extending a sequence (back-pressure / preemption), and every runner has
  one, the simulated runner included. Beside the Python lists it keeps every
  table as a row of one preallocated int32 tensor, updated where a table
  changes (allocate, a new block on extend, truncate, free), so a step's
  block tables are one row gather rather than a tensor built per sequence.
- `PagedKVCache`: a `BlockManager` plus the key/value tensors, one pair per
  layer shaped [num_blocks, block_size, num_kv_heads, head_dim] (the layout
  paged attention kernels read). Token `p` of a sequence lives in slot
  `table[p // block_size] * block_size + p % block_size` of the flattened
  [num_blocks * block_size, num_kv_heads, head_dim] view.

Prefix caching (vLLM V1's automatic prefix caching, on unless
`--prefix-caching off`): a full block whose tokens have been computed is
registered under the hash of its tokens chained with its parent block's
hash, so the hash names the whole prefix up to the block's end (the same
tokens at the same positions give the same KV: one model, and under tensor
parallelism every rank maps the blocks rank 0's tables say). A sequence
admitted with a cached prefix maps those blocks (reference-counted) and
computes only the rest. A freed block that is registered stays cached, free
but evictable; an allocation takes never-cached free blocks first, then
evicts cached ones least recently freed first (a sequence's last blocks
before its first, whose loss would strand the rest). The hash is SHA-256: a
prompt crafted to collide with another client's prefix would read that
client's KV, so a fast non-cryptographic hash is not enough (vLLM moved to
SHA-256 for the same reason). A sequence never writes into a block it does
not own alone: cached blocks are full, writes go past them, and truncate
gives a shared block back rather than write into it.

Every operation checks before it changes anything, so a failed allocation
leaves the cache as it was.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

SeqId = Hashable
BlockHash = bytes
# The parent of a sequence's first block.
_ROOT_HASH = hashlib.sha256(b"structd paged KV prefix").digest()


def chain_block_hashes(token_ids: Sequence[int], hashes: list[BlockHash], block_size: int) -> list[BlockHash]:
    """Extends `hashes`, the chain of hashes of token_ids' first full blocks that the caller keeps between
    calls (its token list only grows), to every full block of token_ids; returns it."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else _ROOT_HASH
        tokens = array("i", token_ids[start:start + block_size]).tobytes()
        hashes.append(hashlib.sha256(parent + tokens).digest())
    return hashes


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation needs more free blocks than the cache has."""

    def __init__(self, seq_id: SeqId, needed: int, free: int, total: int, block_size: int):
        self.seq_id, self.needed, self.free, self.total = seq_id, needed, free, total
        super().__init__(
            f"KV cache out of blocks: sequence {seq_id!r} needs {needed} more block(s) of {block_size} tokens, "
            f"{free} of {total} free"
        )


@dataclass
class _SeqBlocks:
    table: list[int]
    num_tokens: int  # token slots reserved (positions 0 .. num_tokens-1)
    row: int  # its row of BlockManager._rows
    num_hashed: int = 0  # leading blocks of table registered in the prefix cache (or found there)


class BlockManager:
    """Block allocator, per-sequence block tables and the prefix cache (no tensors)."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # Free blocks no hash names, a stack: the most recently freed is reused first (still warm in caches).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks that are cached, least recently freed first: taken only when _free is empty.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks  # sequences mapping each block
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self._seqs: dict[SeqId, _SeqBlocks] = {}
        # Row r holds the table of the sequence given row r, padded with -1. Grown by doubling (rows as
        # sequences arrive, columns as tables lengthen), so a step never allocates it.
        self._rows = torch.full((8, 8), -1, dtype=torch.int32)
        self._free_rows: list[int] = list(range(7, -1, -1))

    # --- queries -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence maps, cached ones included (they are reclaimed when an allocation needs them)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, mapped by a sequence or not."""
        return len(self._block_of)

    @property
    def usage_ratio(self) -> float:
        """Fraction of blocks mapped by sequences (the kv_cache_usage_ratio metric)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._get(seq_id).num_tokens

    def block_table(self, seq_id: SeqId) -> list[int]:
        return list(self._get(seq_id).table)

    def block_tables(self, seq_ids: Sequence[SeqId]) -> torch.Tensor:
        """int64 [len(seq_ids), longest table] of their block tables, padded with -1."""
        seqs = [self._get(s) for s in seq_ids]
        width = max(len(s.table) for s in seqs)
        rows = torch.tensor([s.row for s in seqs], dtype=torch.long)
        return self._rows[:, :width].index_select(0, rows).long()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq_id: SeqId | None, num_new_tokens: int, cached: Sequence[int] = ()) -> int:
        """Free blocks an allocate (seq_id None or unknown; mapping the `cached` prefix blocks first) or an
        extend by num_new_tokens would take: new blocks, and cached blocks that are free now."""
        seq = self._seqs.get(seq_id) if seq_id is not None else None
        have_tokens = seq.num_tokens if seq else 0
        have_blocks = len(seq.table) if seq else len(cached)
        revived = sum(1 for b in cached if self._refs[b] == 0) if seq is None else 0
        return max(0, self.blocks_for(have_tokens + num_new_tokens) - have_blocks) + revived

    def can_allocate(self, seq_id: SeqId | None, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        return self.blocks_needed(seq_id, num_new_tokens, cached) <= self.num_free_blocks

    def cached_prefix(self, hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        """The blocks holding the longest cached prefix of a sequence of num_tokens tokens whose full blocks
        hash to `hashes` (chain_block_hashes): at most num_tokens - 1 tokens, so that one is left to compute
        and give the next token's logits. Empty with prefix caching off."""
        if not self.prefix_caching:
            return []
        blocks = []
        for h in hashes[: (num_tokens - 1) // self.block_size]:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def slot_mapping(self, seq_id: SeqId, start: int, count: int) -> list[int]:
        """Flat slot index of positions start .. start+count-1 (which must be reserved)."""
        seq = self._get(seq_id)
        if start < 0 or count < 0 or start + count > seq.num_tokens:
            raise ValueError(
                f"sequence {seq_id!r}: positions {start}..{start + count - 1} are outside its "
                f"{seq.num_tokens} reserved token slots"
            )
        bs, table = self.block_size, seq.table
        return [table[p // bs] * bs + p % bs for p in range(start, start + count)]

    # --- changes -----------------------------------------------------------

    def allocate(self, seq_id: SeqId, num_tokens: int, cached: Sequence[int] = ()) -> None:
        """Registers a new sequence with slots for num_tokens tokens, its first blocks the `cached` prefix
        blocks (cached_prefix's answer, taken in this same step), which must hold fewer than num_tokens."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has KV blocks")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if len(cached) * self.block_size >= max(num_tokens, 1) or any(b not in self._hash_of for b in cached):
            raise ValueError(f"sequence {seq_id!r}: {len(cached)} cached blocks do not start {num_tokens} tokens")
        self._check_free(seq_id, self.blocks_needed(None, num_tokens, cached))
        for b in cached:
            if self._refs[b] == 0:
                del self._evictable[b]
            self._refs[b] += 1
        table = list(cached) + self._take(self.blocks_for(num_tokens) - len(cached))
        seq = _SeqBlocks(table, num_tokens, self._take_row(), num_hashed=len(cached))
        self._seqs[seq_id] = seq
        self._write_row(seq, 0)

    def extend(self, seq_id: SeqId, num_new_tokens: int) -> None:
        """Reserves slots for num_new_tokens more tokens of an existing sequence."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        seq = self._get(seq_id)
        needed = self.blocks_needed(seq_id, num_new_tokens)
        self._check_free(seq_id, needed)
        if needed:
            have = len(seq.table)
            seq.table.extend(self._take(needed))
            self._write_row(seq, have)
        seq.num_tokens += num_new_tokens

    def cache_computed(self, seq_id: SeqId, hashes: Sequence[BlockHash], num_computed: int) -> None:
        """Registers the sequence's full blocks among its first num_computed tokens (computed: their KV is
        written) under `hashes` (chain_block_hashes of its tokens). A block whose hash another block holds
        already (the same prefix computed twice at once) stays unregistered and is freed as usual."""
        seq = self._get(seq_id)
        if not self.prefix_caching:
            return
        full = min(num_computed // self.block_size, len(seq.table), len(hashes))
        for i in range(seq.num_hashed, full):
            block, h = seq.table[i], hashes[i]
            if h not in self._block_of and block not in self._hash_of:
                self._block_of[h] = block
                self._hash_of[block] = h
        seq.num_hashed = max(seq.num_hashed, full)

    def truncate(self, seq_id: SeqId, num_tokens: int) -> int:
        """Shrinks a sequence to its first num_tokens slots (rollback of rejected tokens); returns how many of
        them still hold their KV: num_tokens, or fewer when the block the cut falls in was shared with
        another sequence (it is given back rather than written into; the tokens from its start must be
        computed again, into a block of the sequence's own)."""
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"sequence {seq_id!r}: cannot truncate {seq.num_tokens} tokens to {num_tokens}")
        keep = self.blocks_for(num_tokens)
        # The sequence writes past the cut next: a cached block the cut falls inside must leave the cache, and
        # when another sequence maps it too, it is swapped for a block of this sequence's own.
        cut = seq.table[keep - 1] if num_tokens % self.block_size and keep <= seq.num_hashed else None
        swap = cut is not None and self._refs[cut] > 1
        if swap and not self.num_free_blocks and all(self._refs[b] > 1 for b in seq.table[keep:]):
            raise OutOfBlocksError(seq_id, 1, 0, self.num_blocks, self.block_size)
        self._release(seq.table[keep:])
        self._rows[seq.row, keep : len(seq.table)] = -1
        del seq.table[keep:]
        seq.num_hashed = min(seq.num_hashed, keep if cut is None else keep - 1)
        seq.num_tokens = num_tokens
        if cut is None:
            return num_tokens
        if not swap:
            self._forget(cut)
            return num_tokens
        seq.table[keep - 1] = self._take(1)[0]
        self._release([cut])
        self._write_row(seq, keep - 1)
        return (keep - 1) * self.block_size

    def free(self, seq_id: SeqId) -> None:
        """Returns all of a sequence's blocks; unknown ids are ignored (finish and cancel may race)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._release(seq.table)
            self._rows[seq.row, : len(seq.table)] = -1
            self._free_rows.append(seq.row)

    # --- internals ---------------------------------------------------------

    def _get(self, seq_id: SeqId) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} has no KV blocks")
        return seq

    def _check_free(self, seq_id: SeqId, needed: int) -> None:
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(seq_id, needed, self.num_free_blocks, self.num_blocks, self.block_size)

    def _take(self, n: int) -> list[int]:
        """n free blocks, mapped once each: never-cached ones first, then the least recently freed cached."""
        if n == 0:
            return []
        plain = min(n, len(self._free))
        taken = self._free[len(self._free) - plain:]
        del self._free[len(self._free) - plain:]
        taken.reverse()
        for _ in range(n - plain):
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            taken.append(block)
        for b in taken:
            self._refs[b] = 1
        return taken

    def _forget(self, block: int) -> None:
        """Takes a block out of the prefix cache (it is about to be written)."""
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]

    def _release(self, blocks: Sequence[int]) -> None:
        # Last block first: the first of a sequence's blocks is the next handed out (or, when cached, the
        # last evicted, since every later block's hash depends on it).
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = self._rows.shape[0]
            self._grow(2 * rows, self._rows.shape[1])
            self._free_rows.extend(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _write_row(self, seq: _SeqBlocks, start: int) -> None:
        """Copies seq.table[start:] into its row."""
        end = len(seq.table)
        if end == start:
            return
        if end > self._rows.shape[1]:
            self._grow(self._rows.shape[0], max(end, 2 * self._rows.shape[1]))
        self._rows[seq.row, start:end] = torch.tensor(seq.table[start:], dtype=torch.int32)

    def _grow(self, rows: int, cols: int) -> None:
        grown = torch.full((rows, cols), -1, dtype=torch.int32)
        old_rows, old_cols = self._rows.shape
        grown[:old_rows, :old_cols] = self._rows
        self._rows = grown

    def check_invariants(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent (tests call it after every step): every
        block is free, evictable or mapped, never two; reference counts match the tables; the cache's two
        maps agree; evictable blocks are cached."""
        refs = [0] * self.num_blocks
        for seq in self._seqs.values():
            if len(seq.table) != self.blocks_for(seq.num_tokens):
                raise AssertionError(f"a table of {len(seq.table)} blocks for {seq.num_tokens} tokens")
            for b in seq.table:
                refs[b] += 1
        if refs != self._refs:
            raise AssertionError("reference counts differ from the tables")
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free) or free & evictable:
            raise AssertionError("a block is free twice")
        mapped = {b for b, r in enumerate(refs) if r}
        if mapped & (free | evictable) or len(mapped | free | evictable) != self.num_blocks:
            raise AssertionError("a mapped block is free, or a block is neither mapped nor free")
        if {self._block_of[h] for h in self._hash_of.values()} != set(self._hash_of) or \
                len(self._block_of) != len(self._hash_of):
            raise AssertionError("the prefix cache's maps disagree")
        if not evictable <= set(self._hash_of):
            raise AssertionError("an evictable block is not cached")


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one model's KV cache (per rank: num_kv_heads is the local count under tensor parallelism)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    block_size: int = 16

    @classmethod
    def from_model_config(cls, config, dtype: torch.dtype, block_size: int = 16, tp_size: int = 1) -> "KVCacheSpec":
        """The spec of one rank's cache: tensor parallelism splits the KV heads over tp_size ranks."""
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        if num_kv_heads % tp_size:
            raise ValueError(f"the model's {num_kv_heads} KV heads do not split over {tp_size} tensor-parallel ranks")
        return cls(config.num_hidden_layers, num_kv_heads // tp_size, head_dim, dtype, block_size)

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for_bytes(self, num_bytes: int) -> int:
        return max(1, num_bytes // self.bytes_per_block)


class PagedKVCache:
    """Key/value tensors for every layer, addressed through a BlockManager."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu", *,
                 prefix_caching: bool = False):
        self.spec = spec
        self.device = torch.device(device)
        self.blocks = BlockManager(num_blocks, spec.block_size, prefix_caching=prefix_caching)
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.key = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for _ in range(spec.num_layers)]
        self.value = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for _ in range(spec.num_layers)]
        # The views made once: every layer of every step uses them, and making a view is a dispatched op.
        tail = (spec.num_kv_heads, spec.head_dim)
        self._flat = [(k.view(-1, *tail), v.view(-1, *tail)) for k, v in zip(self.key, self.value)]
        # [1, num_kv_heads, num_slots, head_dim]: transformers' layout of a layer's keys and values.
        self._heads_first = [(k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None]) for k, v in self._flat]

    @property
    def num_slots(self) -> int:
        return self.blocks.num_blocks * self.spec.block_size

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values as [num_slots, num_kv_heads, head_dim] views."""
        return self._flat[layer]

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stores key/value [n, num_kv_heads, head_dim] at flat slots [n]."""
        k_flat, v_flat = self._flat[layer]
        k_flat.index_copy_(0, slots, key.to(k_flat.dtype))
        v_flat.index_copy_(0, slots, value.to(v_flat.dtype))

    def write_heads_first(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """`write` for key/value as transformers' attention gets them, [1, num_kv_heads, n, head_dim], with no
        view or copy to the flat layout first (a layer's write is then two ops); returns flat(layer)."""
        k_heads, v_heads = self._heads_first[layer]
        k_heads.index_copy_(2, slots, as_dtype(key, k_heads.dtype))
        v_heads.index_copy_(2, slots, as_dtype(value, v_heads.dtype))
        return self._flat[layer]


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype: a same-dtype .to() returns t but still costs a dispatch, and this runs per layer (the cache's
    dtype is usually the model's)."""
    return t if t.dtype == dtype else t.to(dtype)
