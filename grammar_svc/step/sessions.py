"""Live sessions: per-stream tables under a global and a per-stream limit, with an idle TTL.

A session belongs to the step stream that opened it and ends when it is
closed, when its stream ends, or when it has been idle longer than the TTL;
memory stays bounded under churn because each of those paths releases it.
The per-stream limit (--max-sessions-per-stream) keeps one caller's stream
from taking every session slot of the replica (--max-sessions).
"""

from __future__ import annotations

import threading
import time

from grammar_svc.compile.cache import CompiledEntry
from grammar_svc.metrics import GrammarMetrics
from grammar_svc.step.session import MatcherSession
from shared.errors import InvalidRequestError, LimitExceededError, NotFoundError


class SessionLimiter:
    """Counts live sessions across all streams against max_sessions, and each stream's against
    max_sessions_per_stream."""

    def __init__(self, max_sessions: int, metrics: GrammarMetrics, max_sessions_per_stream: int | None = None):
        self.max_sessions = max_sessions
        self.max_sessions_per_stream = max_sessions if max_sessions_per_stream is None else max_sessions_per_stream
        self.metrics = metrics
        self._count = 0
        self._lock = threading.Lock()
        self._streams: set["StreamSessions"] = set()

    @property
    def count(self) -> int:
        return self._count

    def acquire(self) -> None:
        with self._lock:
            if self._count >= self.max_sessions:
                self.metrics.limit_rejections.labels("sessions").inc()
                raise LimitExceededError(
                    f"this grammar replica holds its limit of {self.max_sessions} live sessions (--max-sessions); "
                    "close finished sessions or add replicas"
                )
            self._count += 1
        self.metrics.active_sessions.inc()

    def release(self, n: int = 1) -> None:
        if n:
            with self._lock:
                self._count -= n
            self.metrics.active_sessions.dec(n)

    @property
    def streams(self) -> frozenset["StreamSessions"]:
        with self._lock:
            return frozenset(self._streams)

    def add_stream(self, stream: "StreamSessions") -> None:
        with self._lock:
            self._streams.add(stream)

    def remove_stream(self, stream: "StreamSessions") -> None:
        with self._lock:
            self._streams.discard(stream)

    def fingerprints_in_use(self) -> set[str]:
        """Tokenizers that live sessions use (never evicted from the registry)."""
        return set().union(*(stream.fingerprints() for stream in self.streams))

    def sweep(self, idle_ttl_seconds: float) -> int:
        """Closes sessions idle longer than the TTL in every stream."""
        cutoff = time.monotonic() - idle_ttl_seconds
        with self._lock:
            streams = list(self._streams)
        return sum(stream.expire_idle(cutoff) for stream in streams)


class StreamSessions:
    """The sessions of one step stream. `lock` serialises steps and sweeps."""

    def __init__(self, limiter: SessionLimiter):
        self.limiter = limiter
        self.lock = threading.Lock()
        self._sessions: dict[int, MatcherSession] = {}
        self._expired: set[int] = set()
        limiter.add_stream(self)

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, session_id: int, entry: CompiledEntry, terminate_without_stop_token: bool) -> MatcherSession:
        if session_id in self._sessions:
            raise InvalidRequestError(f"session {session_id} is already open on this stream; close it before reusing the id")
        if len(self._sessions) >= self.limiter.max_sessions_per_stream:
            self.limiter.metrics.limit_rejections.labels("sessions_per_stream").inc()
            raise LimitExceededError(
                f"this step stream holds its limit of {self.limiter.max_sessions_per_stream} live sessions "
                "(--max-sessions-per-stream); close finished sessions or open another stream")
        self.limiter.acquire()
        try:
            session = MatcherSession(session_id, entry, terminate_without_stop_token=terminate_without_stop_token)
        except BaseException:
            self.limiter.release()
            raise
        self._sessions[session_id] = session
        self._expired.discard(session_id)
        self.limiter.metrics.session_events.labels("opened").inc()
        return session

    def fingerprints(self) -> set[str]:
        # list() of a dict's values is taken without releasing the GIL: safe beside a step's opens and closes.
        return {s.entry.tokenizer.fingerprint for s in list(self._sessions.values())}

    def expected_fill_seconds(self, session_ids, new_session_seconds: float = 20e-6) -> float:
        sessions = self._sessions
        total = 0.0
        for sid in session_ids:
            s = sessions.get(sid)
            total += s.last_fill_seconds if s is not None else new_session_seconds
        return total

    def get(self, session_id: int) -> MatcherSession:
        session = self._sessions.get(session_id)
        if session is None:
            if session_id in self._expired:
                raise NotFoundError(f"session {session_id} expired after being idle; reopen it by replaying its tokens")
            raise NotFoundError(f"session {session_id} is not open on this stream; send `open` first")
        session.last_used = time.monotonic()
        return session

    def close(self, session_id: int, event: str = "closed") -> None:
        if self._sessions.pop(session_id, None) is not None:
            self.limiter.release()
            self.limiter.metrics.session_events.labels(event).inc()

    def expire_idle(self, cutoff: float) -> int:
        with self.lock:
            stale = [sid for sid, s in self._sessions.items() if s.last_used < cutoff]
            for sid in stale:
                self.close(sid, "expired")
                self._expired.add(sid)
            # Remember expired ids only as long as it is useful for the message.
            if len(self._expired) > 10_000:
                self._expired.clear()
            return len(stale)

    def close_all(self) -> None:
        with self.lock:
            n = len(self._sessions)
            self._sessions.clear()
            self.limiter.release(n)
            if n:
                self.limiter.metrics.session_events.labels("stream_ended").inc(n)
        self.limiter.remove_stream(self)
