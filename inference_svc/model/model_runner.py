"""Model runners: one step of the engine in, next-token logits out.

The engine's step loop hands a runner a `StepBatch`: per sequence, the new
tokens of this step (a prefill chunk, the one sampled token of a decode, or
the sampled token plus a jump-forward run) and how many of its tokens are
already in the KV cache. The scheduler reserves KV slots in the runner's
`block_manager` before the step (that is where back-pressure and preemption
are decided); the runner only fills them.

`PagedModelRunner` runs a transformers causal LM over the engine's paged KV
cache (see attention.py); `SimulatedRunner` (simulated_runner.py) stands in
for a GPU in benchmarks.
"""

from __future__ import annotations

import inspect
import logging
from itertools import accumulate, chain
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from inference_svc.model.attention import CONTEXT_KWARG, PagedAttentionContext, register
from inference_svc.config import DEFAULT_BLOCK_SIZE, DEFAULT_KV_CACHE_BYTES
from inference_svc.model.host_copy import to_device
from inference_svc.model.paged_kernel import warm_up
from inference_svc.model.paged_kv import BlockManager, KVCacheSpec, PagedKVCache, SeqId
from inference_svc.model.head.lm_head import LmHead
from inference_svc.model.head.sparse_head import SparseHead

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's part of a step."""

    seq_id: SeqId
    token_ids: tuple[int, ...]  # new tokens fed this step, at positions start_pos, start_pos+1, ...
    start_pos: int  # tokens of this sequence already in the KV cache
    needs_logits: bool = True  # False for a prefill chunk that is not the prompt's last


@dataclass(frozen=True)
class StepBatch:
    chunks: tuple[SequenceChunk, ...]

    @classmethod
    def of(cls, chunks: Sequence[SequenceChunk]) -> "StepBatch":
        return cls(tuple(chunks))

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def logit_seq_ids(self) -> list[SeqId]:
        """Which sequence each row of the forward's logits belongs to."""
        return [c.seq_id for c in self.chunks if c.needs_logits]


class ModelRunner(Protocol):
    """What the engine needs from a model, real or simulated."""

    @property
    def vocab_size(self) -> int:
        """Width of the logits rows (may exceed the tokenizer's length when the model pads its vocabulary)."""

    @property
    def embedding_rows(self) -> int:
        """Ids the model can take as input (its input embedding's rows)."""

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache's keys and values take on the device (0 where none are stored)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def block_manager(self) -> BlockManager:
        """KV block accounting the scheduler reserves slots in before each step."""

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """float32 logits [rows, vocab_size] on `device`: one row per chunk with needs_logits, in batch order."""


def validate_batch(batch: StepBatch, blocks: BlockManager) -> None:
    """Rejects a malformed step before any KV is written."""
    if not batch.chunks:
        raise ValueError("empty step batch")
    seen = set()
    for c in batch.chunks:
        if c.seq_id in seen:
            raise ValueError(f"sequence {c.seq_id!r} appears twice in one step")
        seen.add(c.seq_id)
        if not c.token_ids:
            raise ValueError(f"sequence {c.seq_id!r}: a step chunk needs at least one token")
        if c.start_pos < 0:
            raise ValueError(f"sequence {c.seq_id!r}: start_pos must be >= 0, got {c.start_pos}")
        reserved = blocks.num_tokens(c.seq_id)
        if c.start_pos + len(c.token_ids) > reserved:
            raise ValueError(
                f"sequence {c.seq_id!r}: step needs KV slots up to {c.start_pos + len(c.token_ids)} tokens but "
                f"only {reserved} are reserved (allocate/extend the block manager first)"
            )


class PagedModelRunner:
    """A transformers causal LM driven one packed step at a time over the engine's paged KV cache.

    The model is switched to the `structd_paged` attention implementation, so
    it must only be called through this runner afterwards.
    """

    def __init__(self, model, kv_cache: PagedKVCache, *, own_head: bool = True, packed_head: bool = True,
                 greedy_screen: bool = True, attention_backend: str = "sdpa"):
        """own_head=False: the model's forward computes its LM head (a tensor-parallel model's head is
        sharded, its output gathered by the layer's own hooks), and there is no sparse head; packed_head=False:
        the head never uses the oneDNN-packed kernel (--lm-head-kernel plain); greedy_screen=False: no
        bfloat16 screen of the head (--greedy-head off); attention_backend "triton": decodes and extends
        attend through Triton's paged kernel (attention.py; resolved from --attention-backend by the caller),
        whose variants are compiled here (warm_up_kernel)."""
        self.model = model
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend
        model.set_attn_implementation(register())
        model.eval()
        self._device = next(model.parameters()).device
        self._vocab_size = model.get_output_embeddings().weight.shape[0]
        # num_embeddings, not the weight's rows: a tensor-parallel plan may shard the weight, never the count.
        self._embedding_rows = model.get_input_embeddings().num_embeddings
        # Slicing hidden states before the LM head avoids 129k-wide logits for
        # every prompt token; models whose forward lacks it get full logits, sliced after.
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # The head computed here rather than by the model's forward (a faster kernel on the CPU, lm_head.py),
        # unless the model does more after it; the sparse head where its columns are exact.
        self.lm_head = _lm_head_for(model, packed_head, greedy_screen) if own_head else None
        self._head = SparseHead(self.lm_head, max_rows=64) if self.lm_head and self.lm_head.exact_columns else None
        if attention_backend == "triton":
            self.warm_up_kernel()

    @classmethod
    def create(
        cls,
        model,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        kv_dtype: torch.dtype | None = None,
        tp_size: int = 1,
        packed_head: bool = True,
        greedy_screen: bool = True,
        prefix_caching: bool = False,
        attention_backend: str = "sdpa",
    ) -> "PagedModelRunner":
        """A runner with a KV cache of num_blocks blocks, or as many as fit in kv_cache_bytes (per rank:
        under tensor parallelism each rank caches its own share of the KV heads); prefix_caching: full
        computed blocks are kept for later sequences with the same prefix (paged_kv.py)."""
        param = next(model.parameters())
        spec = KVCacheSpec.from_model_config(model.config, kv_dtype or param.dtype, block_size, tp_size)
        blocks = num_blocks if num_blocks is not None else spec.blocks_for_bytes(kv_cache_bytes)
        return cls(model, PagedKVCache(spec, blocks, param.device, prefix_caching=prefix_caching), own_head=tp_size == 1, packed_head=packed_head,
                   greedy_screen=greedy_screen, attention_backend=attention_backend)

    def warm_up_kernel(self) -> None:
        """Compiles the paged kernel's unsplit and split variants for this model's query heads and dtype and
        this KV cache (paged_kernel.warm_up): made here, on the thread that loads the model (the engine's device
        thread), rather than on the first decode and the first long-context step, which would stall the batch."""
        config, spec = self.model.config, self.kv_cache.spec
        # Query heads per KV head is the model's; the cache holds this rank's share of the KV heads.
        groups = config.num_attention_heads // (getattr(config, "num_key_value_heads", None)
                                                or config.num_attention_heads)
        key, value = self.kv_cache.flat(0)  # every layer's cache has the same dtype and layout
        warm_up(key, value, groups * spec.num_kv_heads, next(self.model.parameters()).dtype, spec.block_size)
        log.info("paged attention kernel: unsplit and split variants ready")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def embedding_rows(self) -> int:
        """Ids the input embedding has a row for: a prompt id at or past it is out of range on the device."""
        return self._embedding_rows

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.blocks.num_blocks * self.kv_cache.spec.bytes_per_block

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def block_manager(self) -> BlockManager:
        return self.kv_cache.blocks

    def forward(self, batch: StepBatch) -> torch.Tensor:
        blocks = self.kv_cache.blocks
        validate_batch(batch, blocks)
        return self.forward_with_tables(batch, blocks.block_tables([c.seq_id for c in batch.chunks]))

    @property
    def splits_head(self) -> bool:
        """Whether `forward_body` + `head` (or `sparse_head`) compute what `forward` does: the logits are the
        output embedding of the body's last hidden states, with nothing after it (no softcapping, scaling)."""
        return self._head is not None

    def forward_body(self, batch: StepBatch) -> torch.Tensor:
        """The body of `forward`: the final hidden states of the logit rows [rows, hidden]; `head` finishes it."""
        blocks = self.kv_cache.blocks
        validate_batch(batch, blocks)
        return self.forward_with_tables(batch, blocks.block_tables([c.seq_id for c in batch.chunks]), head=False)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of `forward_body`'s rows: `forward`'s output, split in two."""
        return self.lm_head.full(hidden)

    @property
    def partial_head(self) -> bool:
        """Whether `sparse_head` may compute some rows in full (the head's rows are independent)."""
        return self._head is not None and self.lm_head.rows_independent

    @property
    def greedy_screen(self) -> bool:
        """Whether `sparse_head` may screen greedy rows (a bfloat16 screen on this machine, greedy_head.py)."""
        return self.partial_head and self.lm_head.screen is not None

    def sparse_head(self, hidden: torch.Tensor, ids, full_rows=None, screened=(), vocab_limit=None) -> torch.Tensor:
        """`head` computed at the sorted int64 token ids `ids` alone, -inf elsewhere, in full for the logit
        rows `full_rows`, and at the screen's candidates for `screened` rows (see sparse_head.py)."""
        return self._head.logits(hidden, ids, full_rows, screened, vocab_limit)

    @torch.inference_mode()
    def forward_with_tables(self, batch: StepBatch, tables: torch.Tensor, head: bool = True) -> torch.Tensor:
        """The step with block tables given as BlockManager.block_tables returns them (tensor-parallel
        workers get them from rank 0's scheduler); head=False: the logit rows' final hidden states
        instead of their logits."""
        chunks = batch.chunks
        query_lens = [len(c.token_ids) for c in chunks]
        ctx = PagedAttentionContext.build(self.kv_cache, query_lens, [c.start_pos for c in chunks], tables,
                                          self._device, paged_kernel=self.attention_backend == "triton")
        # chain/accumulate run per token and per sequence in C, not in a Python loop.
        last_index = [end - 1 for c, end in zip(chunks, accumulate(query_lens)) if c.needs_logits]
        input_ids, keep = to_device(
            self._device, torch.tensor([list(chain.from_iterable(c.token_ids for c in chunks))], dtype=torch.long),
            torch.tensor(last_index, dtype=torch.long))
        position_ids = ctx.positions[None]
        kwargs = {CONTEXT_KWARG: ctx}
        if not head or self.lm_head is not None:
            hidden = self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                                              use_cache=False, **kwargs).last_hidden_state[0]
            hidden = hidden.index_select(0, keep)
            return self.lm_head.full(hidden) if head else hidden
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = keep
        logits = self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False, **kwargs
        ).logits[0]
        if not self._logits_to_keep:
            logits = logits.index_select(0, keep)
        return logits.float()


# Config attributes of models whose logits are more than the output embedding of the body's hidden states.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _lm_head_for(model, packed: bool, screen: bool) -> LmHead | None:
    """The model's output embedding as an LmHead, or None when its forward does more than that (or its
    layout is not the usual body + lm_head), so the runner keeps to the model's own forward."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or not hasattr(model, "get_decoder"):
        return None
    if any(getattr(model.config, name, None) not in (None, 1.0) for name in _LOGIT_POSTPROCESSING):
        return None
    lm_head = LmHead.create(head.weight, head.bias, packed=packed, screen=screen)
    log.info("LM head: %s kernel%s%s", lm_head.name, "" if lm_head.exact_columns else " (no sparse head)",
             ", bfloat16 greedy screen" if lm_head.screen is not None else "")
    return lm_head
