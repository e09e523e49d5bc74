"""A service's Prometheus text as numbers: every sample by name and labels, and a histogram's change
between two snapshots (what a benchmark phase read from the servers' own metrics)."""

from __future__ import annotations

import math


def parse_metrics(text: str) -> dict[str, float]:
    """{'name{label=value,...}': value} for every sample (histogram buckets, sums, counts, counters)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def delta(before: dict, after: dict, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def histogram_mean(before: dict, after: dict, histogram: str, labels: str) -> float | None:
    """A histogram's mean over the phase (None when it was not observed)."""
    count = delta(before, after, f"{histogram}_count{{{labels}}}")
    return delta(before, after, f"{histogram}_sum{{{labels}}}") / count if count else None


def histogram_delta(before: dict, after: dict, name: str) -> dict:
    """An unlabelled histogram's change: cumulative buckets, sum, count."""
    buckets = []
    prefix = f"{name}_bucket{{le="
    for key in after:
        if key.startswith(prefix):
            le = key[len(prefix):-1]
            buckets.append((math.inf if le == "+Inf" else float(le), delta(before, after, key)))
    buckets.sort()
    return {"buckets": buckets, "sum": delta(before, after, f"{name}_sum"),
            "count": delta(before, after, f"{name}_count")}


def histogram_quantile(h: dict, q: float) -> float | None:
    """Prometheus' histogram_quantile over the delta (linear inside the bucket)."""
    total = h["count"]
    if not h["buckets"] or total <= 0:
        return None
    rank = q * total
    prev_le, prev_cum = 0.0, 0.0
    for le, cum in h["buckets"]:
        if cum >= rank:
            if math.isinf(le):
                return prev_le
            if cum == prev_cum:
                return le
            return prev_le + (le - prev_le) * (rank - prev_cum) / (cum - prev_cum)
        prev_le, prev_cum = le, cum
    return prev_le


def share_above(h: dict, bound: float) -> float | None:
    """Fraction of observations above `bound` (a bucket edge)."""
    if h["count"] <= 0:
        return None
    below = max((cum for le, cum in h["buckets"] if le <= bound), default=0.0)
    return 1.0 - below / h["count"]
