"""Metric helpers shared by both services.

`BatchHistogram` is a Prometheus histogram fed a whole step's values at
once with numpy: prometheus_client's Histogram.observe costs a few
microseconds per call, which on the per-mask hot path (dozens of rows per
step, thousands of steps per second) is more than the masks themselves.
"""

from __future__ import annotations

import threading
from typing import Iterable, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector


class BatchHistogram(Collector):
    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 labelnames: Sequence[str] = (), registry: CollectorRegistry | None = None):
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = np.asarray(sorted(buckets), dtype=np.float64)
        self._series: dict[tuple[str, ...], list] = {}
        self._lock = threading.Lock()
        if not self.labelnames:
            self._state(())  # exported with zero counts from the start, like prometheus_client's
        if registry is not None:
            registry.register(self)

    def _state(self, labels: tuple[str, ...]) -> list:
        state = self._series.get(labels)
        if state is None:
            # counts per bucket (last: +Inf), sum
            state = self._series.setdefault(labels, [np.zeros(len(self.bounds) + 1, dtype=np.int64), 0.0])
        return state

    def observe_many(self, values: Iterable[float] | np.ndarray, *labels: str) -> None:
        v = np.asarray(values, dtype=np.float64)
        if v.size == 0:
            return
        # side="left": a value equal to a bound falls in that bound's bucket (le semantics).
        idx = np.searchsorted(self.bounds, v, side="left")
        counts = np.bincount(idx, minlength=len(self.bounds) + 1)
        with self._lock:
            state = self._state(tuple(labels))
            state[0] += counts
            state[1] += float(v.sum())

    def observe(self, value: float, *labels: str) -> None:
        self.observe_many((value,), *labels)

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            series = [(labels, state[0].copy(), state[1]) for labels, state in self._series.items()]
        for labels, counts, total in series:
            cumulative = np.cumsum(counts)
            buckets = [(_fmt(b), int(c)) for b, c in zip(self.bounds, cumulative[:-1])]
            buckets.append(("+Inf", int(cumulative[-1])))
            family.add_metric(list(labels), buckets, total)
        yield family


def _fmt(bound: float) -> str:
    return repr(float(bound))
