"""Concurrent compiles per caller (--max-compiles-per-caller).

A caller is who the servicer says it is: the client certificate's identity
under mutual TLS, else the peer's IP address (servicer.caller_of). Compile is
a unary RPC, so "per stream" cannot apply to it; per caller bounds what one
tenant (one inference replica, or one team's certificate) may queue on the
compile workers, whatever number of connections it opens.

What counts is the distinct grammars a caller waits on that were not in the
cache: a second request for a grammar it already waits on joins that compile
(single flight) and costs nothing more, and cache hits never wait. Event-loop
thread only.
"""

from __future__ import annotations

import collections

from shared.errors import LimitExceededError


class CallerCompiles:
    def __init__(self, max_per_caller: int, metrics):
        self.max_per_caller = max_per_caller
        self.metrics = metrics
        # caller -> grammar id -> how many of its requests wait on that compile.
        self._waiting: dict[str, collections.Counter[str]] = {}

    def waiting(self, caller: str) -> int:
        return len(self._waiting.get(caller, ()))

    def enter(self, caller: str, grammar_id: str) -> None:
        """Counts one request of `caller` waiting on `grammar_id`; RESOURCE_EXHAUSTED past the limit."""
        grammars = self._waiting.setdefault(caller, collections.Counter())
        if grammar_id not in grammars and len(grammars) >= self.max_per_caller:
            self.metrics.limit_rejections.labels("compiles_per_caller").inc()
            raise LimitExceededError(
                f"{caller} already waits on {len(grammars)} compiles on this grammar replica, its limit "
                "(--max-compiles-per-caller); wait for them to finish or compile fewer distinct grammars at once")
        grammars[grammar_id] += 1

    def leave(self, caller: str, grammar_id: str) -> None:
        grammars = self._waiting[caller]
        grammars[grammar_id] -= 1
        if grammars[grammar_id] <= 0:
            del grammars[grammar_id]
        if not grammars:
            del self._waiting[caller]
