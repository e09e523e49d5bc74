"""The engine's paged KV cache: fixed-size blocks, a free-block allocator, per-sequence block tables.

Two layers, so that the scheduler's accounting does not depend on where the
tensors live:

- `BlockManager`: which blocks each sequence owns and how many token slots it
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

Every operation checks before it changes anything, so a failed allocation
leaves the cache as it was.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

SeqId = Hashable


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


class BlockManager:
    """Free-block allocator and per-sequence block tables (no tensors)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed block is reused first (still warm in caches).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._seqs: dict[SeqId, _SeqBlocks] = {}
        # Row r holds the table of the sequence given row r, padded with -1. Grown by doubling (rows as
        # sequences arrive, columns as tables lengthen), so a step never allocates it.
        self._rows = torch.full((8, 8), -1, dtype=torch.int32)
        self._free_rows: list[int] = list(range(7, -1, -1))

    # --- queries -----------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage_ratio(self) -> float:
        """Fraction of blocks owned by sequences (the kv_cache_usage_ratio metric)."""
        return 1.0 - len(self._free) / self.num_blocks

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

    def blocks_needed(self, seq_id: SeqId | None, num_new_tokens: int) -> int:
        """Blocks an allocate (seq_id None or unknown) or extend by num_new_tokens would take."""
        seq = self._seqs.get(seq_id) if seq_id is not None else None
        have_tokens = seq.num_tokens if seq else 0
        have_blocks = len(seq.table) if seq else 0
        return max(0, self.blocks_for(have_tokens + num_new_tokens) - have_blocks)

    def can_allocate(self, seq_id: SeqId | None, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_new_tokens) <= len(self._free)

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

    def allocate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Registers a new sequence with slots for num_tokens tokens."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has KV blocks")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        needed = self.blocks_for(num_tokens)
        self._check_free(seq_id, needed)
        seq = _SeqBlocks(self._take(needed), num_tokens, self._take_row())
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

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Shrinks a sequence to its first num_tokens slots (rollback of rejected tokens)."""
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"sequence {seq_id!r}: cannot truncate {seq.num_tokens} tokens to {num_tokens}")
        keep = self.blocks_for(num_tokens)
        self._give_back(seq.table[keep:])
        self._rows[seq.row, keep : len(seq.table)] = -1
        del seq.table[keep:]
        seq.num_tokens = num_tokens

    def free(self, seq_id: SeqId) -> None:
        """Returns all of a sequence's blocks; unknown ids are ignored (finish and cancel may race)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._give_back(seq.table)
            self._rows[seq.row, : len(seq.table)] = -1
            self._free_rows.append(seq.row)

    # --- internals ---------------------------------------------------------

    def _get(self, seq_id: SeqId) -> _SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"sequence {seq_id!r} has no KV blocks")
        return seq

    def _check_free(self, seq_id: SeqId, needed: int) -> None:
        if needed > len(self._free):
            raise OutOfBlocksError(seq_id, needed, len(self._free), self.num_blocks, self.block_size)

    def _take(self, n: int) -> list[int]:
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        return taken

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

    def _give_back(self, blocks: Sequence[int]) -> None:
        # Reversed so that the sequence's first block is the next one handed out.
        self._free.extend(reversed(blocks))


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

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu"):
        self.spec = spec
        self.device = torch.device(device)
        self.blocks = BlockManager(num_blocks, spec.block_size)
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.key = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for _ in range(spec.num_layers)]
        self.value = [torch.zeros(shape, dtype=spec.dtype, device=self.device) for _ in range(spec.num_layers)]

    @property
    def num_slots(self) -> int:
        return self.blocks.num_blocks * self.spec.block_size

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values as [num_slots, num_kv_heads, head_dim] views."""
        tail = (self.spec.num_kv_heads, self.spec.head_dim)
        return self.key[layer].view(-1, *tail), self.value[layer].view(-1, *tail)

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stores key/value [n, num_kv_heads, head_dim] at flat slots [n]."""
        k_flat, v_flat = self.flat(layer)
        k_flat.index_copy_(0, slots, key.to(k_flat.dtype))
        v_flat.index_copy_(0, slots, value.to(v_flat.dtype))
