"""The step context built the straightforward way, from Python lists, token by token.

This is how `PagedAttentionContext.build` computed it before it moved to
tensor ops over the whole step (issue 13): tests pin the two equal field by
field, and `structd bench step-context` times the old builder against the new.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inference_svc.model.attention import ChunkPlan, DecodeGroup, PagedAttentionContext
from inference_svc.model.paged_kv import PagedKVCache


def reference_context(kv_cache: PagedKVCache, query_lens: Sequence[int], context_lens: Sequence[int],
                      tables: Sequence[Sequence[int]], device: torch.device) -> PagedAttentionContext:
    """Sequence i: query_lens[i] new tokens after context_lens[i] cached ones, blocks tables[i]."""
    bs = kv_cache.spec.block_size
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.full((len(tables), max_blocks), -1, dtype=torch.long)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)

    q_starts, positions, slots = [], [], []
    q_start = 0
    for i, (n, cached) in enumerate(zip(query_lens, context_lens)):
        q_starts.append(q_start)
        for p in range(cached, cached + n):
            positions.append(p)
            slots.append(tables[i][p // bs] * bs + p % bs)
        q_start += n
    seq_lens = [c + n for n, c in zip(query_lens, context_lens)]

    decode_ids = [i for i, n in enumerate(query_lens) if n == 1]
    decodes = None
    if decode_ids:
        max_len = max(seq_lens[i] for i in decode_ids)
        rows, mask = [], []
        for i in decode_ids:
            rows.append([tables[i][p // bs] * bs + p % bs if p < seq_lens[i] else 0 for p in range(max_len)])
            mask.append([p < seq_lens[i] for p in range(max_len)])
        decodes = DecodeGroup(
            token_index=torch.tensor([q_starts[i] for i in decode_ids], device=device),
            slots=torch.tensor(rows, dtype=torch.long, device=device),
            mask=torch.tensor(mask, device=device)[:, None, None, :],
        )

    chunks = []
    for i, (n, cached) in enumerate(zip(query_lens, context_lens)):
        if n == 1:
            continue
        if cached == 0:
            chunks.append(ChunkPlan(q_starts[i], q_starts[i] + n, None, None))
            continue
        seq_slots = [tables[i][p // bs] * bs + p % bs for p in range(cached + n)]
        mask = [[k <= q for k in range(cached + n)] for q in range(cached, cached + n)]
        chunks.append(ChunkPlan(q_starts[i], q_starts[i] + n, torch.tensor(seq_slots, device=device),
                                torch.tensor(mask, device=device)))

    return PagedAttentionContext(
        kv_cache=kv_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor([0, *(s + n for s, n in zip(q_starts, query_lens))], device=device),
        seq_lens=torch.tensor(seq_lens, device=device),
        block_tables=block_tables.to(device),
        decodes=decodes,
        chunks=tuple(chunks),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
    )
