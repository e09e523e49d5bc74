"""Distribution summaries the benchmarks' results share: percentiles, and log-spaced histograms for CDF plots."""

from __future__ import annotations

import math

import numpy as np


def summarize(xs) -> dict:
    a = np.asarray([x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))], dtype=float)
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "mean": float(a.mean()), "min": float(a.min()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def log_histogram(xs, lo: float = 1e-7, hi: float = 10.0, per_decade: int = 10) -> dict:
    """Counts in log-spaced bins (upper edges), for plotting/recomputing distributions later."""
    a = np.asarray([x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))], dtype=float)
    counts, _ = np.histogram(np.clip(a, lo, hi), bins=log_edges(lo, hi, per_decade))
    return {"lo": lo, "hi": hi, "per_decade": per_decade, "counts": [int(c) for c in counts]}


def log_edges(lo: float, hi: float, per_decade: int) -> np.ndarray:
    return np.logspace(math.log10(lo), math.log10(hi), int(round(math.log10(hi / lo) * per_decade)) + 1)
