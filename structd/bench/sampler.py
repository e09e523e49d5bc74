"""`structd bench sampler`: host time of one step's sampling on the CPU, old sampler vs current.

The old sampler is inference_svc/engine/sampling.py and step_sampler.py as of
--old-rev (default d83242f, before the numpy greedy paths), loaded from git;
the new one is the working tree's. Both sample the same steps (greedy rows of
129,280 random logits: unconstrained, every row an allowed-id list of 2-300
ids, two rows in three allowed lists with the third a disallowed list of
40 ids, and string interiors: half the rows a disallowed list of 20,000 ids,
half a dense mask allowing a random half of the vocabulary), alternating call
by call in one process so machine noise hits them
alike; every step's tokens must agree. Reports medians in milliseconds and
new/old ratios; writes <out>/sampler.json and .png.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from structd.bench.harness import UsageError, old_new, progress

OLD_REV = "d83242f"
VOCAB = 129_280
KINDS = ("unconstrained", "allowed lists", "allowed + disallowed lists", "long disallowed lists + dense masks")
# String interiors (the last kind): the ids a row's disallowed list holds.
LONG_DISALLOWED = 20_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    old_new.add_old_rev(p, OLD_REV, "inference_svc/engine/sampling.py and step_sampler.py are the old sampler")
    p.add_argument("--rows", type=int, default=24, help="sampled rows per step")
    p.add_argument("--rounds", type=int, default=200, help="steps each sampler samples per kind")


def load_old_sampler(rev: str):
    """The old StepSampler class, importing the old sampling module (not the working tree's)."""
    # Before 43f705f the sampler and the masks were at the top of inference_svc/; the old sampler writes masks
    # with the working tree's apply_masks, as it always has.
    old_new.module_at_revision(rev, ("inference_svc/engine/sampling.py", "inference_svc/sampling.py"), "old_sampling")
    return old_new.module_at_revision(
        rev, ("inference_svc/engine/step_sampler.py", "inference_svc/step_sampler.py"), "old_step_sampler",
        (("from inference_svc.engine.sampling import", "from old_sampling import"),
         ("from inference_svc.sampling import", "from old_sampling import"),
         ("from inference_svc.masking import", "from inference_svc.engine.masking import"))).StepSampler


def _plan(kind: str, rows: int, rng, bitmask):
    """The step's masks; a dense row's mask goes into its row of `bitmask` (both samplers read it)."""
    import numpy as np
    import torch

    from inference_svc.engine.step_sampler import RowPlan
    from shared.codec import SparseMask

    plan = RowPlan(sample=list(range(rows)))
    for i in range(rows):
        if kind == KINDS[3] and i % 2:
            bits = np.packbits(rng.random(bitmask.shape[1] * 32) < 0.5, bitorder="little")
            bitmask[i] = torch.from_numpy(bits.view(np.int32).copy())
            plan.masked.append((i, None))
        elif kind == KINDS[3]:
            ids = np.sort(rng.choice(VOCAB, size=LONG_DISALLOWED, replace=False)).astype(np.int64)
            plan.masked.append((i, SparseMask(False, ids)))
        elif kind == KINDS[1] or (kind == KINDS[2] and i % 3):
            ids = np.sort(rng.choice(VOCAB, size=int(rng.integers(2, 300)), replace=False)).astype(np.int64)
            plan.masked.append((i, SparseMask(True, ids)))
        elif kind == KINDS[2]:
            plan.masked.append((i, SparseMask(False, np.sort(rng.choice(VOCAB, size=40, replace=False)).astype(np.int64))))
    return plan


def time_kind(old_cls, kind: str, rows: int, rounds: int, seed: int) -> dict:
    """Both samplers on the same steps (fresh logits each step: a sampler may write -inf into them),
    alternating which goes first; medians in ms. Raises if their tokens ever differ."""
    import copy

    import numpy as np
    import torch

    from inference_svc.engine.sampling import RowSampler, SamplingOptions
    from inference_svc.engine.step_sampler import StepSampler

    rng = np.random.default_rng(seed)
    bitmask = torch.zeros((max(rows, 1), (VOCAB + 31) // 32), dtype=torch.int32)
    samplers = {"old": old_cls(VOCAB, [1], bitmask, bitmask), "new": StepSampler(VOCAB, [1], bitmask, bitmask)}
    greedy = SamplingOptions.validated(max_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=(),
                                       ignore_eos=False, default_max_tokens=16, max_max_tokens=4096)
    rows_of = [RowSampler(greedy, torch.device("cpu")) for _ in range(rows)]
    times: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(rounds):
        logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed + r))
        plan = _plan(kind, rows, rng, bitmask)
        tokens = {}
        for which in old_new.order(r):
            x = logits.clone()
            t0 = time.perf_counter()
            tokens[which] = samplers[which].sample(x, copy.deepcopy(plan), rows_of)
            times[which].append(time.perf_counter() - t0)
        if tokens["old"] != tokens["new"]:
            raise RuntimeError(f"{kind}: the samplers drew different tokens at step {r}")
    o, n = (statistics.median(times[k]) * 1e3 for k in ("old", "new"))
    return {"kind": kind, "rows": rows, "old_ms": round(o, 3), "new_ms": round(n, 3), "new_over_old": round(n / o, 3)}


def result_name(args) -> str:
    return "sampler"


def run(args) -> dict:
    import torch

    if args.rounds < 1 or args.rows < 1:
        raise UsageError("--rounds and --rows must be at least 1")
    old_cls = old_new.load_old(load_old_sampler, args.old_rev, "the sampler")
    torch.set_num_threads(1)
    results = []
    for k, kind in enumerate(KINDS):
        results.append(time_kind(old_cls, kind, args.rows, args.rounds, seed=k * 100_003))
        progress(f"{kind}: old {results[-1]['old_ms']} ms, new {results[-1]['new_ms']} ms")
    return {"kinds": results}


def markdown(result: dict) -> str:
    return old_new.markdown(result["kinds"], "kind", "old_ms", "new_ms", f"rows ({result['arguments']['rows']} a step)",
                            "ms")


def plot(result: dict, png: Path) -> None:
    old_new.plot(result["kinds"], "kind", "old_ms", "new_ms", f"median ms per step ({result['arguments']['rows']} rows)",
                 png, width=7.0)
