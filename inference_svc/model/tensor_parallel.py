"""Tensor parallelism: one inference replica on N ranks (one process, one GPU each), as a LeaderWorkerSet runs it.

Every rank loads the model with transformers' `tp_plan="auto"` (each weight
sharded over the ranks; the sharded layers all-reduce inside the forward)
and keeps its own share of the KV heads in its paged cache. Rank 0 alone
runs the scheduler, the grammar stream, masking and sampling: each step it
broadcasts the step (the batch and its block tables, which only its
BlockManager decides) and every rank runs the forward. Masks and sampled
tokens never leave rank 0: the next step's batch carries the tokens.

Ranks come from the environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK: what the LeaderWorkerSet manifest sets, and what
torchrun sets); without it, `structd inference --tp N` starts ranks 1..N-1
itself as child processes on this machine.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from inference_svc.model.model_runner import PagedModelRunner, StepBatch, validate_batch
from shared.ports import free_port

log = logging.getLogger(__name__)

# Set on ranks that `structd inference --tp N` started itself (they share rank 0's host and ports).
SPAWNED_ENV = "STRUCTD_TP_SPAWNED"
# A rank that waits longer than this for the next step has lost its group (rank 0 died): exit.
GROUP_TIMEOUT = timedelta(hours=2)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int


def rank_from_env(env: dict[str, str], tp: int) -> RankInfo | None:
    """This process's rank when the environment names one (LeaderWorkerSet, torchrun); None otherwise."""
    if "WORLD_SIZE" not in env:
        return None
    info = RankInfo(int(env.get("RANK", "0")), int(env["WORLD_SIZE"]), env.get("MASTER_ADDR", "127.0.0.1"),
                    int(env.get("MASTER_PORT", "29500")), int(env.get("LOCAL_RANK", "0")))
    if info.world_size != tp:
        raise SystemExit(f"--tp {tp} but WORLD_SIZE={info.world_size} in the environment: they must agree")
    if not 0 <= info.rank < tp:
        raise SystemExit(f"RANK={info.rank} is outside 0..{tp - 1}")
    return info


def spawn_local_ranks(tp: int, argv: Sequence[str]) -> tuple[RankInfo, list[subprocess.Popen]]:
    """Rank 0 is this process; ranks 1..tp-1 are `python -m inference_svc <argv>` children with rank env set
    (argv: the service's flags, as `python -m inference_svc` takes them)."""
    # Below the ephemeral range: this rank binds the rendezvous only in init_group, and a port-0 pick could be
    # handed to another socket by then.
    port = free_port()
    children = []
    for rank in range(1, tp):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), LOCAL_RANK=str(rank), **{SPAWNED_ENV: "1"})
        children.append(subprocess.Popen([sys.executable, "-m", "inference_svc", *argv], env=env,
                                         preexec_fn=_die_with_parent))
    return RankInfo(0, tp, "127.0.0.1", port, 0), children


def _die_with_parent() -> None:
    """In a spawned rank: the kernel kills it when rank 0 dies (else it would wait for steps for hours)."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # Ctrl-C reaches the whole process group: rank 0 alone decides when the group stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def init_group(info: RankInfo, device_type: str) -> None:
    import torch.distributed as dist

    # transformers' tp_plan reads the rank layout from the environment; rank 0 of a locally started
    # group has none of it (its children got theirs from spawn_local_ranks).
    for name, value in (("RANK", info.rank), ("WORLD_SIZE", info.world_size), ("LOCAL_RANK", info.local_rank),
                        ("MASTER_ADDR", info.master_addr), ("MASTER_PORT", info.master_port)):
        os.environ.setdefault(name, str(value))
    # device_id binds NCCL's communicator to this rank's GPU at once; without it NCCL guesses the device
    # from the current one on first use, which may be cuda:0 on a thread that never set it.
    device_id = None
    if device_type == "cuda":
        device_id = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device_id)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=info.rank,
                            world_size=info.world_size, init_method=f"tcp://{info.master_addr}:{info.master_port}",
                            timeout=GROUP_TIMEOUT, device_id=device_id)
    log.info("tensor-parallel rank %d of %d joined", info.rank, info.world_size)


def agree_on_least(value: int, device: torch.device) -> int:
    """The least of every rank's value (each rank must call it): sizes the ranks must share, like the KV
    cache's blocks, which rank 0's block tables address on every rank."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class TensorParallelRunner:
    """Rank 0's runner: broadcasts each step, then runs its own shard of the forward."""

    def __init__(self, runner: PagedModelRunner):
        self.runner = runner
        self._closed = False

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def embedding_rows(self) -> int:
        return self.runner.embedding_rows

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def block_manager(self):
        return self.runner.block_manager

    def forward(self, batch: StepBatch) -> torch.Tensor:
        import torch.distributed as dist

        blocks = self.runner.block_manager
        validate_batch(batch, blocks)
        tables = blocks.block_tables([c.seq_id for c in batch.chunks])
        dist.broadcast_object_list([(batch, tables)], src=0)
        return self.runner.forward_with_tables(batch, tables)

    def close(self) -> None:
        """Tells the other ranks to stop (call from the thread that runs forwards, after the last one)."""
        import torch.distributed as dist

        if not self._closed:
            self._closed = True
            try:
                dist.broadcast_object_list([None], src=0)
            except RuntimeError as e:  # a rank already gone: nothing left to stop
                log.warning("could not tell the other tensor-parallel ranks to stop: %s", e)


def worker_loop(runner: PagedModelRunner) -> int:
    """Ranks 1..N-1: run every step rank 0 broadcasts until it says stop; returns the steps run."""
    import torch.distributed as dist

    steps = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return steps
        batch, tables = box[0]
        runner.forward_with_tables(batch, tables)
        steps += 1
