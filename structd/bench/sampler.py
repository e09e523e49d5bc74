"""`structd bench sampler`: host time of one step's sampling on the CPU, old sampler vs current.

The old sampler is inference_svc/engine/sampling.py and step_sampler.py as of
--old-rev (default b49e54e, the last row-by-row sampler; d83242f is the one
before the numpy greedy paths), loaded from git; the new one is the working
tree's. Both sample the same steps over 129,280 random logits: greedy rows
(unconstrained, every row an allowed-id list of 2-300 ids, two rows in three
allowed lists with the third a disallowed list of 40 ids, and string
interiors: half the rows a disallowed list of 20,000 ids, half a dense mask
allowing a random half of the vocabulary), then sampled rows, each seeded
(temperature 0.8 alone, with top_k 50, top_p 0.9, min_p 0.05, allowed lists,
and a mix with logprobs; their logits are scaled by SAMPLED_SCALE so that a
nucleus holds tens to hundreds of tokens, as a model's does, rather than
most of the vocabulary), alternating call by call in one process so machine
noise hits them alike. Greedy steps' tokens must agree; seeded draws of the
same distribution agree too except where float rounding moves a CDF boundary
past the draw, so a sampled kind may differ in at most 1% of its tokens
(`differing` counts them). Reports medians in milliseconds and new/old
ratios; writes <out>/sampler.json and .png.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from structd.bench.harness import UsageError, old_new, progress

OLD_REV = "b49e54e"
VOCAB = 129_280
KINDS = ("unconstrained", "allowed lists", "allowed + disallowed lists", "long disallowed lists + dense masks")
# Sampled kinds: name -> (every row's options, whether rows have allowed-id lists); "mixed" varies by row.
SAMPLED = {
    "T 0.8": (dict(temperature=0.8), False),
    "T 0.8, top_k 50": (dict(temperature=0.8, top_k=50), False),
    "T 0.8, top_p 0.9": (dict(temperature=0.8, top_p=0.9), False),
    "T 0.8, min_p 0.05": (dict(temperature=0.8, min_p=0.05), False),
    "T 0.8, allowed lists": (dict(temperature=0.8), True),
    "mixed, logprobs": (None, False),
}
MIXED = (dict(temperature=0.0), dict(temperature=1.0, top_logprobs=5), dict(temperature=0.7, top_k=40, top_p=0.95),
         dict(temperature=0.6, top_p=0.8, logprobs=True))
SAMPLED_SCALE = 4.0
# A sampled kind's tokens may differ in this share (float rounding at a CDF boundary); a wrong sampler differs
# in most.
MAX_DIFFERING = 0.01
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
    if kind in SAMPLED:
        kind = KINDS[1] if SAMPLED[kind][1] else KINDS[0]
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


def _row_options(kind: str, rows: int) -> list[dict]:
    if kind not in SAMPLED:
        return [dict(temperature=0.0)] * rows
    opts = SAMPLED[kind][0]
    return [MIXED[i % len(MIXED)] for i in range(rows)] if opts is None else [opts] * rows


def time_kind(old_cls, kind: str, rows: int, rounds: int, seed: int) -> dict:
    """Both samplers on the same steps (fresh logits each step: a sampler may write -inf into them),
    alternating which goes first, each with its own samplers seeded alike; medians in ms. Raises if their
    tokens differ (beyond MAX_DIFFERING for a sampled kind)."""
    import copy

    import numpy as np
    import torch

    from inference_svc.engine.sampling import RowSampler, SamplingOptions
    from inference_svc.engine.step_sampler import StepSampler

    rng = np.random.default_rng(seed)
    bitmask = torch.zeros((max(rows, 1), (VOCAB + 31) // 32), dtype=torch.int32)
    samplers = {"old": old_cls(VOCAB, [1], bitmask, bitmask), "new": StepSampler(VOCAB, [1], bitmask, bitmask)}
    options = [SamplingOptions.validated(**{**dict(max_tokens=16, top_p=1.0, top_k=0, seed=seed + i, stop=(),
                                                   ignore_eos=False, default_max_tokens=16, max_max_tokens=4096), **o})
               for i, o in enumerate(_row_options(kind, rows))]
    rows_of = {k: [RowSampler(o, torch.device("cpu")) for o in options] for k in ("old", "new")}
    scale = SAMPLED_SCALE if kind in SAMPLED else 1.0
    times: dict[str, list[float]] = {"old": [], "new": []}
    differing = 0
    for r in range(rounds):
        logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed + r)) * scale
        plan = _plan(kind, rows, rng, bitmask)
        tokens = {}
        for which in old_new.order(r):
            x = logits.clone()
            t0 = time.perf_counter()
            tokens[which] = [t[0] for t in samplers[which].sample(x, copy.deepcopy(plan), rows_of[which])]
            times[which].append(time.perf_counter() - t0)
        differing += sum(a != b for a, b in zip(tokens["old"], tokens["new"]))
        if differing and (kind not in SAMPLED or differing > MAX_DIFFERING * rounds * rows):
            raise RuntimeError(f"{kind}: the samplers drew different tokens ({differing} by step {r})")
    o, n = (statistics.median(times[k]) * 1e3 for k in ("old", "new"))
    return {"kind": kind, "rows": rows, "old_ms": round(o, 3), "new_ms": round(n, 3), "new_over_old": round(n / o, 3),
            "differing": differing}


def result_name(args) -> str:
    return "sampler"


def run(args) -> dict:
    import torch

    if args.rounds < 1 or args.rows < 1:
        raise UsageError("--rounds and --rows must be at least 1")
    old_cls = old_new.load_old(load_old_sampler, args.old_rev, "the sampler")
    torch.set_num_threads(1)
    results = []
    for k, kind in enumerate(KINDS + tuple(SAMPLED)):
        results.append(time_kind(old_cls, kind, args.rows, args.rounds, seed=k * 100_003))
        progress(f"{kind}: old {results[-1]['old_ms']} ms, new {results[-1]['new_ms']} ms")
    return {"kinds": results}


def markdown(result: dict) -> str:
    return old_new.markdown(result["kinds"], "kind", "old_ms", "new_ms", f"rows ({result['arguments']['rows']} a step)",
                            "ms")


def plot(result: dict, png: Path) -> None:
    old_new.plot(result["kinds"], "kind", "old_ms", "new_ms", f"median ms per step ({result['arguments']['rows']} rows)",
                 png, width=7.0)
