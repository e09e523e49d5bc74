"""Byte-bounded LRU cache of compiled grammars and of compile failures.

Keyed by grammar id (a hash of tokenizer, kind, spec and options). A failure
is cached with its error so a bad spec sent again is answered at once; a
timeout is cached with the deadline it failed under, so only a request
granting more time tries again, and only for a short while (`expires_at`):
a timeout may be the load's doing, not the spec's. Live sessions keep their
own reference to the compiled grammar, so eviction never breaks a running
request.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from shared.errors import StructdError

# A failure costs its message plus bookkeeping.
FAILURE_OVERHEAD_BYTES = 512


@dataclass(frozen=True)
class CompiledEntry:
    grammar_id: str
    compiled: Any  # xgrammar.CompiledGrammar, or llguidance_backend.LlguidanceGrammar
    tokenizer: Any  # grammar_svc.compile.tokenizer_registry.RegisteredTokenizer
    warnings: tuple[str, ...]
    duration_seconds: float
    memory_bytes: int
    # The JSON Schema text for json_schema grammars (what CheckOutput validates against), else None.
    json_schema: str | None = None
    # Which library compiled it ("xgrammar" or "llguidance") and, for a fallback, why xgrammar did not serve it.
    backend: str = "xgrammar"
    backend_reason: str = ""


@dataclass(frozen=True)
class FailedEntry:
    grammar_id: str
    error: StructdError
    # For timeouts: the deadline that was not enough. None for other failures.
    timeout_seconds: float | None = None
    # time.monotonic() after which the entry is forgotten; None: kept until evicted.
    expires_at: float | None = None

    @property
    def memory_bytes(self) -> int:
        return FAILURE_OVERHEAD_BYTES + len(str(self.error))


Entry = CompiledEntry | FailedEntry


class GrammarCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, grammar_id: str) -> Entry | None:
        with self._lock:
            entry = self._entries.get(grammar_id)
            if entry is None:
                return None
            if isinstance(entry, FailedEntry) and entry.expires_at is not None and time.monotonic() >= entry.expires_at:
                del self._entries[grammar_id]
                self._bytes -= entry.memory_bytes
                return None
            self._entries.move_to_end(grammar_id)
            return entry

    def drop(self, grammar_id: str) -> None:
        """Forgets one entry, if cached."""
        with self._lock:
            old = self._entries.pop(grammar_id, None)
            if old is not None:
                self._bytes -= old.memory_bytes

    def drop_tokenizer(self, fingerprint: str) -> int:
        """Forgets the grammars compiled for an evicted tokenizer (live sessions keep their own reference)."""
        with self._lock:
            stale = [gid for gid, e in self._entries.items()
                     if isinstance(e, CompiledEntry) and e.tokenizer.fingerprint == fingerprint]
            for gid in stale:
                self._bytes -= self._entries.pop(gid).memory_bytes
            return len(stale)

    def put(self, entry: Entry) -> None:
        with self._lock:
            old = self._entries.pop(entry.grammar_id, None)
            if old is not None:
                self._bytes -= old.memory_bytes
            if entry.memory_bytes > self.capacity_bytes:
                return  # larger than the whole cache: serve it, never keep it
            self._entries[entry.grammar_id] = entry
            self._bytes += entry.memory_bytes
            while self._bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.memory_bytes
