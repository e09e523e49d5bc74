"""A stand-in model runner for benchmarks: random logits after a fixed step time.

It lets the grammar path be measured at GPU-like step times (a few
milliseconds, --simulate-step-ms) on a CPU machine. It is a benchmark tool, never the default: its text is noise.

It keeps the real runner's contract: the same batch validation against a
block manager (so the scheduler's KV accounting, back-pressure and preemption
run as they would), one float32 row per chunk with needs_logits, and a call
that returns no sooner than step_time_s (+ per_token_time_s per token) after
it started. Rows are copied from a pool drawn once at start-up, because
drawing 32 x 129k normals per step would itself take longer than a
simulated GPU step. The copy goes into one of two buffers kept across steps
(a step's logits stay valid through the next step's forward, and callers may
mask them in place): a fresh 16 MB tensor a step costs page faults, which
kept the observed step well above its nominal time (docs/benchmarks.md, "The
simulated runner's copy").
"""

from __future__ import annotations

import time

import torch

from inference_svc.model.model_runner import DEFAULT_BLOCK_SIZE, StepBatch, validate_batch
from inference_svc.model.paged_kv import BlockManager

DEFAULT_VOCAB_SIZE = 129_280


class SimulatedRunner:
    def __init__(
        self,
        step_time_s: float,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        *,
        per_token_time_s: float = 0.0,
        num_blocks: int = 16_384,
        block_size: int = DEFAULT_BLOCK_SIZE,
        seed: int = 0,
        pool_rows: int = 64,
        prefix_caching: bool = False,
    ):
        if step_time_s < 0 or per_token_time_s < 0:
            raise ValueError("step times must be >= 0")
        self.step_time_s = step_time_s
        self.per_token_time_s = per_token_time_s
        self._vocab_size = vocab_size
        self._blocks = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self._generator = torch.Generator().manual_seed(seed)
        self._pool = torch.randn(pool_rows, vocab_size, generator=self._generator)
        self._buffers = [torch.empty(0, vocab_size), torch.empty(0, vocab_size)]
        self._turn = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def embedding_rows(self) -> int:
        return self._vocab_size

    @property
    def kv_cache_bytes(self) -> int:
        return 0  # block accounting only: no keys or values are stored

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def block_manager(self) -> BlockManager:
        return self._blocks

    def forward(self, batch: StepBatch) -> torch.Tensor:
        started = time.perf_counter()
        validate_batch(batch, self._blocks)
        rows = sum(1 for c in batch.chunks if c.needs_logits)
        pick = torch.randint(self._pool.shape[0], (rows,), generator=self._generator)
        self._turn ^= 1
        if self._buffers[self._turn].shape[0] < rows:
            self._buffers[self._turn] = torch.empty(rows, self._vocab_size)
        logits = torch.index_select(self._pool, 0, pick, out=self._buffers[self._turn][:rows])
        deadline = started + self.step_time_s + self.per_token_time_s * batch.num_tokens
        while (remaining := deadline - time.perf_counter()) > 0:
            time.sleep(remaining)
        return logits
