"""Request-level grammar session (MatcherSession): one matcher (xgrammar's, or llguidance's behind xgrammar's
interface: compile/llguidance_backend.py) and what it has accepted.

Its state is a pure function of (grammar, accepted tokens), which is what
makes failover by replay possible: a session reopened elsewhere with the same
tokens is the same session.
"""

from __future__ import annotations

import time

import xgrammar as xgr

from grammar_svc.compile.cache import CompiledEntry
from grammar_svc.compile.llguidance_backend import LLGUIDANCE, LlguidanceMatcher
from grammar_svc.step.jump_forward import forced_tokens
from shared.errors import InvalidRequestError


class MatcherSession:
    __slots__ = ("session_id", "entry", "matcher", "num_accepted", "last_token", "last_used", "last_fill_seconds")

    def __init__(self, session_id: int, entry: CompiledEntry, *, terminate_without_stop_token: bool = False):
        self.session_id = session_id
        self.entry = entry
        matcher = LlguidanceMatcher if entry.backend == LLGUIDANCE else xgr.GrammarMatcher
        self.matcher = matcher(entry.compiled, terminate_without_stop_token=terminate_without_stop_token)
        self.num_accepted = 0
        self.last_token: int | None = None
        self.last_used = time.monotonic()
        # Used to schedule expensive rows first across fill threads.
        self.last_fill_seconds = 0.0

    @property
    def vocab_size(self) -> int:
        return self.entry.tokenizer.vocab_size

    def check_tokens(self, token_ids) -> None:
        """Raises InvalidRequestError if any id is outside the vocabulary (before anything is applied)."""
        if not token_ids:
            return
        vocab = self.vocab_size
        # min/max run in C: this is on the per-step path for every session.
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")

    def accept(self, token_ids) -> int:
        """Accepts tokens in order; returns how many were accepted before a rejection.
        Ids must be inside the vocabulary: the stepper calls check_tokens once,
        before anything of the step is applied; forced ids come from the tokenizer."""
        matcher = self.matcher
        for i, tok in enumerate(token_ids):
            if not matcher.accept_token(tok):
                return i
            self.num_accepted += 1
            self.last_token = tok
        return len(token_ids)

    def rollback(self, k: int) -> None:
        if k < 0:
            raise InvalidRequestError(f"rollback_tokens must not be negative, got {k}")
        if k > self.num_accepted:
            raise InvalidRequestError(f"cannot roll back {k} tokens: the session has accepted {self.num_accepted}")
        if k:
            self.matcher.rollback(k)
            self.num_accepted -= k
            # The boundary token is unknown after a rollback: jump-forward skips
            # its merge check until the next accept.
            self.last_token = None

    def jump_forward(self) -> tuple[str, list[int]]:
        """Accepts the forced continuation, if any, and returns (text, token ids)."""
        text, ids = forced_tokens(self.matcher, self.entry.tokenizer, self.last_token)
        if ids:
            accepted = self.accept(ids)
            if accepted < len(ids):
                # The grammar disagrees with its own forced string: undo and
                # let the model sample instead of reporting tokens not accepted.
                self.rollback(accepted)
                return "", []
        return text, ids

    def fill(self, bitmask, row: int) -> None:
        start = time.perf_counter()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.last_fill_seconds = time.perf_counter() - start

    @property
    def never_filled(self) -> bool:
        # Every fill sets last_fill_seconds, and none takes exactly 0 s.
        return self.last_fill_seconds == 0.0

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
