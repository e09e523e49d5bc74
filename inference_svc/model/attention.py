"""Paged attention registered with transformers' AttentionInterface.

The engine owns the step loop and the KV cache but reuses transformers' model
code unchanged: the runner sets the model's attention implementation to
`structd_paged` and passes a `PagedAttentionContext` as a forward kwarg;
transformers v5 hands model-forward kwargs down to every attention call, and
this function, called once per layer, writes the step's new keys/values into
the engine's blocks (`module.layer_idx` picks the layer) and attends per
sequence over the cache.

transformers builds no attention mask for an implementation registered in
`AttentionInterface` but not in `AttentionMaskInterface`
(`masking_utils._preprocess_mask_arguments` exits early with None), so a
packed step costs no [tokens x tokens] mask; causality and sequence
boundaries come from the context instead.

Two backends (--attention-backend). SDPA, the reference and the CPU's: all
single-token decodes of a step in one padded call (a key-padding mask hides
the padding), every prefill chunk or multi-token extend in its own call
(causal, offset by what is already cached). Triton's paged kernel
(paged_kernel.py), the CUDA default: decodes and short chunks over cached
context (KERNEL_MAX_QUERY) read K/V in place from the blocks, with no padded
gather and no host-built slot or mask tensors; a fresh prefill and a long
chunk still go to SDPA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from inference_svc.model.host_copy import to_device
from inference_svc.model.paged_kernel import SplitBuffers, paged_attention, splits_for
from inference_svc.model.paged_kv import PagedKVCache, as_dtype

ATTN_IMPLEMENTATION = "structd_paged"
# Query tokens of a chunk over cached context that the paged kernel takes (decodes, jump-forward extends);
# a longer chunk (chunked prefill, a prompt after a prefix-cache hit) goes to SDPA: the kernel reads the
# context once per query token, SDPA's kernels share each key tile between many queries.
KERNEL_MAX_QUERY = 16
# Name of the model-forward kwarg that carries the step context to each layer.
CONTEXT_KWARG = "structd_paged_context"


@dataclass(frozen=True)
class DecodeGroup:
    """All single-token sequences of a step, attended in one padded SDPA call."""

    token_index: torch.Tensor  # [B] their tokens' indices in the packed row
    slots: torch.Tensor  # [B, max_len] flat KV slots of each context (padding points at slot 0)
    mask: torch.Tensor  # [B, 1, 1, max_len] bool, True = attend (hides the padding)
    whole_step: bool = False  # they are all the step's tokens, in order (token_index is 0..B-1)


@dataclass(frozen=True)
class ChunkPlan:
    """A prefill chunk or multi-token extend, attended on its own."""

    q_start: int
    q_end: int
    slots: torch.Tensor | None  # [seq_len] flat slots of the whole context; None: attend to the chunk's own keys
    mask: torch.Tensor | None  # [query_len, seq_len] bool causal mask offset by context_len; None: plain causal


@dataclass(frozen=True)
class KernelPlan:
    """The tokens Triton's paged kernel attends: decodes, and chunks over cached context of at most
    KERNEL_MAX_QUERY tokens."""

    token_index: torch.Tensor  # [K] their indices in the packed row
    seq_index: torch.Tensor  # [K] their sequences' rows of block_tables
    positions: torch.Tensor  # [K] their positions (each attends to 0..its own)
    longest: int = 0  # keys the longest of them attends to (sizes the kernel's context split)
    splits: int = 1  # parts per program's keys (paged_kernel.splits_for), chosen once for every layer
    whole_step: bool = False  # they are all the step's tokens, in order (token_index is 0..K-1)
    # The split variant's partial results, allocated by the step's first layer and reused by the rest (empty
    # unsplit: the unsplit kernel writes its output directly).
    buffers: SplitBuffers = field(default_factory=SplitBuffers)


@dataclass(frozen=True)
class PagedAttentionContext:
    """Everything the attention layers need for one step, built once and shared by all layers.

    slot_mapping, query_start_loc, seq_lens and block_tables are the standard
    paged-attention inputs (what a varlen/paged GPU kernel consumes); decodes
    and chunks are the SDPA plan derived from them.
    """

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's key/value is written
    query_start_loc: torch.Tensor  # [num_seqs + 1] cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] context + new tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int, padded with -1
    decodes: DecodeGroup | None
    chunks: tuple[ChunkPlan, ...]

    positions: torch.Tensor  # [num_tokens] each new token's position in its sequence (the model's position_ids)
    kernel: KernelPlan | None = None  # paged_kernel: what the kernel attends (decodes and chunks are SDPA's rest)

    @classmethod
    def build(
        cls,
        kv_cache: PagedKVCache,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: torch.Tensor,
        device: torch.device,
        paged_kernel: bool = False,
    ) -> "PagedAttentionContext":
        """Context for sequences packed in order, sequence i with query_lens[i] new tokens after
        context_lens[i] cached ones, its blocks in row i of block_tables (int64, padded with -1);
        paged_kernel: the tokens of decodes and of chunks over cached context of at most KERNEL_MAX_QUERY
        tokens go to Triton's kernel, the rest to SDPA.

        Per-token indices come from tensor ops over the whole step (a token's sequence by
        repeat_interleave, its position and slot by gather); Python loops only over the
        multi-token chunks, which attend one SDPA call each anyway.
        """
        bs = kv_cache.spec.block_size
        num_seqs, max_blocks = block_tables.shape
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        ctx_lens = torch.tensor(context_lens, dtype=torch.long)
        seq_lens = ctx_lens + q_lens
        ends = q_lens.cumsum(0)
        decode_ids = [i for i, n in enumerate(query_lens) if n == 1]
        if len(decode_ids) == num_seqs:
            # All decodes (the common step): one token per sequence, at its context length.
            positions = ctx_lens
            seq_of = torch.arange(num_seqs)
            slot_mapping = block_tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        else:
            # Per token: its sequence, and its position = context_len + offset within the sequence's chunk.
            seq_of = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
            positions = torch.arange(seq_of.shape[0]) + (ctx_lens + q_lens - ends)[seq_of]
            slot_mapping = block_tables[seq_of, positions // bs] * bs + positions % bs
        query_start_loc = torch.cat((ends.new_zeros(1), ends))

        # Everything bound for the device is gathered here and crosses in one copy (host_copy.py): the kernel's
        # plan, the decode group's and chunks' slots, and the context's own tensors.
        shipped: list[torch.Tensor] = [slot_mapping, query_start_loc, seq_lens, block_tables.long(), positions]
        kernel_parts = None
        if paged_kernel:
            to_sdpa = torch.tensor([n > 1 and (cached == 0 or n > KERNEL_MAX_QUERY)
                                    for n, cached in zip(query_lens, context_lens)])
            index = (~to_sdpa[seq_of]).nonzero()[:, 0]
            if len(index):
                at = positions[index]
                longest = int(at.max()) + 1
                kernel_parts = (len(shipped), longest, len(index) == len(seq_of))
                shipped += [index, seq_of[index], at]
            decode_ids = []  # the kernel has them

        decode_parts = None
        if decode_ids:
            all_decode = len(decode_ids) == num_seqs
            ids = torch.tensor(decode_ids)
            lens = seq_lens if all_decode else seq_lens[ids]
            max_len = int(lens.max())
            pos = torch.arange(max_len)
            valid = pos[None, :] < lens[:, None]
            block_index = (pos // bs).clamp(max=max_blocks - 1).expand(len(decode_ids), -1)
            blocks = (block_tables if all_decode else block_tables[ids]).gather(1, block_index)
            slots = torch.where(valid, blocks * bs + pos % bs, 0)
            decode_parts = (len(shipped), max_len, all_decode)
            shipped += [ids if all_decode else ends[ids] - 1, slots.long(), lens]

        chunk_parts = []
        q_start = 0
        for i, (n, cached) in enumerate(zip(query_lens, context_lens)):
            if n > 1 and cached == 0:
                chunk_parts.append((q_start, n, None, None))
            elif n > 1 and (not paged_kernel or n > KERNEL_MAX_QUERY):
                pos = torch.arange(cached + n)
                chunk_parts.append((q_start, n, len(shipped), cached))
                shipped.append((block_tables[i, pos // bs] * bs + pos % bs).long())
            q_start += n

        on_device = to_device(device, *shipped)
        kernel = None
        if kernel_parts is not None:
            at_, longest, whole = kernel_parts
            k_index, k_seq, k_at = on_device[at_:at_ + 3]
            kernel = KernelPlan(k_index, k_seq, k_at, longest,
                                splits_for(len(k_index) * kv_cache.spec.num_kv_heads, longest, torch.device(device)),
                                whole_step=whole)
        decodes = None
        if decode_parts is not None:
            # Masks are made where they are used, from the lengths already there: no bool tensor to copy.
            at_, max_len, whole = decode_parts
            valid = torch.arange(max_len, device=device)[None, :] < on_device[at_ + 2][:, None]
            decodes = DecodeGroup(token_index=on_device[at_], slots=on_device[at_ + 1], mask=valid[:, None, None, :],
                                  whole_step=whole)
        chunks = tuple(ChunkPlan(q, q + n, None, None) if at_ is None else
                       ChunkPlan(q, q + n, on_device[at_], _causal_after(cached, n, device))
                       for q, n, at_, cached in chunk_parts)
        slot_mapping, query_start_loc, seq_lens, block_tables, positions = on_device[:5]
        return cls(
            kv_cache=kv_cache,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            decodes=decodes,
            chunks=chunks,
            positions=positions,
            kernel=kernel,
        )


def _causal_after(cached: int, n: int, device) -> torch.Tensor:
    """[n, cached + n] bool: query token j (at position cached + j) attends to keys 0..cached + j."""
    pos = torch.arange(cached + n, device=device)
    return pos[None, :] <= pos[cached:, None]


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim], RoPE applied
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim], RoPE applied
    value: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    ctx: PagedAttentionContext | None = kwargs.get(CONTEXT_KWARG)
    if ctx is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs a step context: "
            "call this model through inference_svc.model.model_runner.PagedModelRunner"
        )
    if attention_mask is not None:
        raise ValueError("paged attention takes no attention_mask: sequence boundaries come from the step context")
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(f"paged attention does not support {unsupported} (full causal attention only)")

    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    num_kv_heads = key.shape[1]
    groups = num_heads // num_kv_heads
    k_all, v_all = ctx.kv_cache.write_heads_first(module.layer_idx, ctx.slot_mapping, key, value)
    # This runs once per layer of every step, each op a dispatch (and a launch on a GPU): a step that one plan
    # covers whole (all decodes, one prefill) returns that plan's attention as is, with no output tensor to
    # scatter rows into nor query rows to gather (docs/benchmarks.md, "Host work of an eager step"). Every
    # token is in one plan, so a plan alone in the step holds all its tokens.
    kp, d = ctx.kernel, ctx.decodes
    if kp is not None and kp.whole_step:
        return _kernel_attention(query[0].transpose(0, 1), k_all, v_all, ctx, kp, scaling)[None], None
    if d is not None and d.whole_step:
        od = _decode_attention(query.transpose(1, 2), k_all, v_all, d, num_kv_heads, scaling)
        return od.reshape(1, num_tokens, num_heads, head_dim), None
    if kp is None and d is None and len(ctx.chunks) == 1:
        return _chunk_attention(query, key, value, k_all, v_all, ctx.chunks[0], groups, scaling, whole=True), None

    q = query[0].transpose(0, 1)  # [T, H, D]
    out = query.new_empty(num_tokens, num_heads, head_dim)
    if kp is not None:
        out[kp.token_index] = _kernel_attention(q.index_select(0, kp.token_index), k_all, v_all, ctx, kp, scaling)
    if d is not None:
        od = _decode_attention(q.index_select(0, d.token_index), k_all, v_all, d, num_kv_heads, scaling)
        out[d.token_index] = od.reshape(-1, num_heads, head_dim)
    for c in ctx.chunks:
        out[c.q_start : c.q_end] = _chunk_attention(query, key, value, k_all, v_all, c, groups, scaling)[0]
    return out[None], None


def _kernel_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, ctx: PagedAttentionContext,
                      kp: KernelPlan, scaling: float | None) -> torch.Tensor:
    """[K, H, D] Triton's paged attention of the kernel plan's K queries (q: their rows in order)."""
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    return paged_attention(q, k_all, v_all, ctx.block_tables, kp.seq_index, kp.positions,
                           ctx.kv_cache.spec.block_size, scale, longest=kp.longest, splits=kp.splits,
                           buffers=kp.buffers)


def _decode_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, d: DecodeGroup,
                      num_kv_heads: int, scaling: float | None) -> torch.Tensor:
    """[B, kvH, groups, D] attention of the decode group's B queries (q: their [..., H, D] rows in order) over
    their padded contexts."""
    batch, head_dim = d.slots.shape[0], q.shape[-1]
    # One query per sequence: fold the query heads of each KV head group
    # into the query-length axis, so SDPA needs neither repeat_kv nor GQA
    # support ([B, kvH, groups, D] against [B, kvH, L, D]).
    qd = q.reshape(batch, num_kv_heads, -1, head_dim)
    # index_select over the flat slots, not k_all[d.slots]: the same rows, and on the CPU the row copy
    # beats advanced indexing's per-element gather several times over.
    rows = d.slots.view(-1)
    kd = as_dtype(k_all.index_select(0, rows), q.dtype).view(batch, -1, num_kv_heads, head_dim).permute(0, 2, 1, 3)
    vd = as_dtype(v_all.index_select(0, rows), q.dtype).view(batch, -1, num_kv_heads, head_dim).permute(0, 2, 1, 3)
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=d.mask, scale=scaling)


def _chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_all: torch.Tensor,
                     v_all: torch.Tensor, c: ChunkPlan, groups: int, scaling: float | None,
                     whole: bool = False) -> torch.Tensor:
    """[1, n, H, D] attention of one chunk's n queries, causal over its context; whole: the chunk is the
    step's every token (no rows to slice out)."""
    rows = slice(c.q_start, c.q_end)
    qc = query if whole else query[:, :, rows]
    if c.slots is None:
        kc, vc = (key, value) if whole else (key[:, :, rows], value[:, :, rows])
    else:
        kc = as_dtype(k_all.index_select(0, c.slots), query.dtype).transpose(0, 1)[None]
        vc = as_dtype(v_all.index_select(0, c.slots), query.dtype).transpose(0, 1)[None]
    oc = F.scaled_dot_product_attention(
        qc, kc, vc, attn_mask=c.mask, is_causal=c.mask is None, scale=scaling, enable_gqa=groups > 1
    )
    return oc.transpose(1, 2)


def register() -> str:
    """Registers the paged attention function (idempotent); returns its implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
