"""A Triton kernel for paged attention: each query token attends over its sequence's keys read in place from the blocks.

The SDPA path (attention.py) gathers a padded [batch, longest sequence, kv
heads, head dim] copy of K and V per layer and masks the padding; this
kernel reads each key and value once from the paged cache through the
block table, so a decode step's memory traffic is what the contexts hold
and no host-built [batch, longest] slot or mask tensor is needed.

One program per (query token, KV head) handles the token's query heads of
that KV head group (grouped-query attention reads each key once for the
group) with an online softmax in fp32 over tiles of BLOCK_N keys: the
token attends to positions 0..its own position, so one kernel serves
decodes and chunks that extend cached context (causal within the chunk,
full over the cache).

Split context (flash-decoding): a step of few tokens launches few programs
(one sequence on a 2-KV-head model: two, on a GPU of 132 SMs), each walking
its whole context (the first GPU run measured it well behind SDPA for one
long sequence: docs/benchmarks.md, "On a GPU"). When the step's programs are fewer than
twice the device's SMs and its longest context is long, each program's keys
are split into parts run by programs of their own (a third grid axis); each
part writes its unnormalised output, running maximum and denominator, and
the parts are combined in torch (weights exp(m - max m)): the same softmax,
summed in another order. A fresh prefill (nothing cached) stays with SDPA,
whose flash kernels reuse each key tile across many queries; a
per-token program would read the keys once per query (so would a long chunk
over cached context: attention.py sends those to SDPA too).

Triton compiles for the GPU, a variant per dtype and head shape for the
unsplit and the split kernel, which a runner on this backend compiles when
it is made (warm_up), not on the first step that needs each; the same
kernel runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 in
the environment of a process before it imports triton: triton's own library
functions are built then), which is how tests/test_paged_kernel.py checks it
against SDPA here.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from inference_svc.config import ATTENTION_BACKENDS as BACKENDS

# Keys per tile: a power of two, enough to keep a warp's loads wide on a GPU.
BLOCK_N = 32
# Split context: a part has at least this many keys (below it, writing, reading and combining a part's
# results costs more than the parallelism buys), and a program's keys go into at most MAX_SPLITS parts.
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 32


class AttentionBackendError(RuntimeError):
    """--attention-backend names a backend this device cannot run (the server's configuration, not a request)."""


def triton_unavailable() -> str | None:
    """Why the Triton kernel cannot run in this process (None: it can)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError as e:  # this install's: triton missing or broken
        return f"triton cannot be imported ({e})"
    return None


def resolve_backend(requested: str, device: torch.device) -> tuple[str, str]:
    """(the attention backend to use, why) for --attention-backend `requested` on `device`.

    auto: Triton's kernel on CUDA when triton imports, SDPA otherwise.
    An explicit triton that cannot run is the operator's configuration:
    AttentionBackendError naming the flag.
    """
    if requested not in BACKENDS:
        raise AttentionBackendError(f"--attention-backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    missing = triton_unavailable()
    if requested == "sdpa":
        return "sdpa", "asked for (--attention-backend sdpa)"
    if requested == "triton":
        if device.type != "cuda":
            raise AttentionBackendError(f"--attention-backend triton needs a CUDA device, and this server runs on "
                                        f"{device}: use --attention-backend auto or sdpa")
        if missing:
            raise AttentionBackendError(f"--attention-backend triton: {missing}; use --attention-backend auto or sdpa")
        return "triton", "asked for (--attention-backend triton)"
    if device.type != "cuda":
        return "sdpa", f"auto on {device.type}: the Triton kernel is for CUDA"
    if missing:
        return "sdpa", f"auto on CUDA, but {missing}"
    return "triton", "auto on CUDA"


@functools.cache
def _kernel():
    """The jitted kernel, built on first use (not at import: a server that never runs it never imports triton)."""
    import triton
    import triton.language as tl

    # Triton compiles a variant per specialisation of an int argument (1, a multiple of 16) and of a pointer's
    # alignment (16 bytes), and a variant compiled on the forward thread is a stall in serving, so what may change
    # from step to step is not specialised: stride_tb with the longest block table, the query's and output's
    # strides with how the model (or the compiled body) laid out the query, and the alignment of the block
    # tables, sequence rows and positions, views at any 8-byte offset of the step's one index copy (host_copy.py).
    # What is left (dtypes, head shape, the cache's strides, block_size, PARTIAL) is fixed for a server, so its
    # variants are warm_up's two.
    @triton.jit(do_not_specialize=["keys_per_split", "num_heads", "num_splits", "stride_tb", "stride_qt",
                                   "stride_qh", "stride_ot", "stride_oh"],
                do_not_specialize_on_alignment=["tables_ptr", "seq_ptr", "pos_ptr"])
    def paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_ptr, pos_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_tb,
        scale, block_size, keys_per_split, num_heads, num_splits,
        GROUPS: tl.constexpr, GROUPS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
        BLOCK: tl.constexpr, PARTIAL: tl.constexpr,
    ):
        token = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq = tl.load(seq_ptr + token)
        last = tl.load(pos_ptr + token)  # the token's own position: it attends to 0..last
        # This program's part of 0..last (all of it unsplit); a part past `last` is empty: m -inf, denom 0.
        lo = split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, last + 1)
        g = tl.arange(0, GROUPS_P2)
        d = tl.arange(0, HEAD_DIM_P2)
        g_ok = g < GROUPS
        d_ok = d < HEAD_DIM
        heads = kv_head * GROUPS + g
        q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        m = tl.full((GROUPS_P2,), float("-inf"), tl.float32)
        denom = tl.zeros((GROUPS_P2,), tl.float32)
        acc = tl.zeros((GROUPS_P2, HEAD_DIM_P2), tl.float32)
        for start in range(lo, hi, BLOCK):
            pos = start + tl.arange(0, BLOCK)
            live = pos < hi
            block = tl.load(tables_ptr + seq * stride_tb + pos // block_size, mask=live, other=0)
            slot = block.to(tl.int64) * block_size + pos % block_size
            kv_mask = live[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :], mask=kv_mask,
                        other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GROUPS_P2, BLOCK]
            scores = tl.where(live[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        if PARTIAL:
            row = (token * num_heads + heads) * num_splits + split  # [tokens, heads, splits], contiguous
            tl.store(part_m_ptr + row, m, mask=g_ok)
            tl.store(part_l_ptr + row, denom, mask=g_ok)
            tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        else:
            out = acc / denom[:, None]
            tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    return paged_attention_kernel


def paged_attention(
    query: torch.Tensor,  # [tokens, heads, head_dim]
    key_cache: torch.Tensor,  # [slots, kv_heads, head_dim]: the layer's flat cache, new keys already written
    value_cache: torch.Tensor,  # [slots, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [seqs, max_blocks] int
    seq_index: torch.Tensor,  # [tokens] int: each token's row of block_tables
    positions: torch.Tensor,  # [tokens] int: each token's position in its sequence
    block_size: int,
    scale: float,
    longest: int = 0,  # keys of the longest token's context (host-known): what a split is sized by
    splits: int = 1,  # parts per program's keys (splits_for: chosen once per step, not per layer)
    buffers: SplitBuffers | None = None,  # the step's partial results, shared by its layers (None: this call's own)
) -> torch.Tensor:
    """[tokens, heads, head_dim]: each token's attention over its sequence's positions 0..its own, in query's dtype."""
    tokens, heads, head_dim = query.shape
    kv_heads = key_cache.shape[1]
    out = torch.empty_like(query)
    if tokens == 0:
        return out
    if splits > 1 and longest < splits:
        raise ValueError(f"{splits} splits of a longest context of {longest} keys")
    # Parts of whole tiles (a part's loads start on a tile); unsplit, one part covers any context.
    keys_per_split = -(-longest // (splits * BLOCK_N)) * BLOCK_N if splits > 1 else 2**30
    partial = splits > 1
    if partial:
        part_m, part_l, part_acc = (buffers or SplitBuffers()).take(tokens, heads, splits, head_dim, query.device)
    else:
        part_m = part_l = part_acc = out  # never read nor written unsplit
    groups = heads // kv_heads
    # The kernel steps along head_dim and a block-table row by one element.
    query, key_cache, value_cache = (t if t.stride(-1) == 1 else t.contiguous()
                                     for t in (query, key_cache, value_cache))
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    # Triton launches on the current device: the tensors' own, whichever thread calls (cuda:N).
    with torch.cuda.device(query.device) if query.device.type == "cuda" else contextlib.nullcontext():
        _kernel()[(tokens, kv_heads, splits)](
            query, key_cache, value_cache, out, block_tables, seq_index, positions, part_m, part_l, part_acc,
            query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), value_cache.stride(0),
            value_cache.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), scale, block_size,
            keys_per_split, heads, splits,
            GROUPS=groups, GROUPS_P2=_pow2(groups), HEAD_DIM=head_dim, HEAD_DIM_P2=_pow2(head_dim), BLOCK=BLOCK_N,
            PARTIAL=partial,
        )
    if not partial:
        return out
    # Every token's first part holds position 0, so each row's largest m is finite; empty parts weigh 0.
    weight = torch.exp(part_m - part_m.amax(-1, keepdim=True))
    total = (part_acc * weight[..., None]).sum(2) / (part_l * weight).sum(-1, keepdim=True)
    return total.to(query.dtype)


class SplitBuffers:
    """The split variant's partial results (each part's running maximum, denominator and unnormalised output) for
    one step. Every layer of a step splits the same tokens and heads into the same parts, so the layers share one
    set, allocated by the first: each layer's kernel overwrites what the layer before it wrote after that layer's
    combine has read it (one stream on a GPU orders them)."""

    def __init__(self) -> None:
        self.parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (m, l, acc) once taken

    def take(self, tokens: int, heads: int, splits: int, head_dim: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(m [tokens, heads, splits], l like m, acc [tokens, heads, splits, head_dim]), float32 on `device`:
        the step's set, made anew only for a layer of another shape (a model whose layers differ)."""
        if self.parts is None or self.parts[2].shape != (tokens, heads, splits, head_dim) \
                or self.parts[2].device != device:
            m = torch.empty(tokens, heads, splits, dtype=torch.float32, device=device)
            self.parts = (m, torch.empty_like(m), torch.empty(tokens, heads, splits, head_dim, dtype=torch.float32,
                                                              device=device))
        return self.parts


def warm_up(key_cache: torch.Tensor, value_cache: torch.Tensor, heads: int, dtype: torch.dtype,
            block_size: int) -> None:
    """Runs the kernel once unsplit and once split on a layer's cache (`key_cache`, `value_cache`: flat, as
    paged_attention takes them) for queries of `heads` heads in `dtype`, so that Triton compiles both variants
    here, at start, rather than on the first step that uses each, on the forward thread with the whole batch
    waiting. One query at position 0 of block 0: it reads one slot and writes only its own output. Any split
    count is the same variant (num_splits and keys_per_split are not specialised), so two parts stand for all."""
    device = key_cache.device
    query = torch.zeros(1, heads, key_cache.shape[2], dtype=dtype, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)  # the one token's sequence row, position, block
    for splits in (1, 2):
        paged_attention(query, key_cache, value_cache, zero[None], zero, zero, block_size, 1.0, longest=splits,
                        splits=splits)


def split_count(programs: int, longest: int, target_programs: int) -> int:
    """Parts to split each program's keys into: enough programs for `target_programs` (twice the device's
    SMs), each part at least MIN_SPLIT_KEYS keys of the longest context, at most MAX_SPLITS; 1 when the
    step's own programs fill the device or no context is long enough to split."""
    if programs >= target_programs:
        return 1
    return max(1, min(-(-target_programs // programs), longest // MIN_SPLIT_KEYS, MAX_SPLITS))


def splits_for(programs: int, longest: int, device: torch.device) -> int:
    """split_count for a step's `programs` on `device`: 1 off CUDA (the interpreter gains nothing by it)."""
    return split_count(programs, longest, _target_programs(device)) if device.type == "cuda" else 1


@functools.cache
def _target_programs(device: torch.device) -> int:
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
