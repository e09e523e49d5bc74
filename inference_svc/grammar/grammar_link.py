"""One request's link to the grammar tier, as the engine keeps it: one object instead of loose request fields.

A matcher on the grammar tier is a pure function of (grammar id, accepted
tokens), so this is all the engine needs to rebuild a session anywhere:
which replica holds it, under which internal session id, whether it has been
opened there, and the tokens the grammar has not been told yet. The session
id is the engine's own (never the client's request id), so two requests with
the same client id never share a session.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inference_svc.types import Constraint, SchemaWarning

NO_REPLICA = -1


@dataclass(eq=False)
class GrammarLink:
    constraint: Constraint
    jump_forward: bool = True
    grammar_id: str = ""
    replica: int = NO_REPLICA  # NO_REPLICA while compiling (or recompiling after a lost replica)
    session_id: int = 0
    open: bool = False  # the replica holds the session (an OpenSession has been sent and not failed)
    pending_accept: list[int] = field(default_factory=list)
    replays: int = 0  # times the session was rebuilt on another replica
    # What the grammar does not enforce of its schema (from the compile), for the client's first response.
    warnings: tuple[SchemaWarning, ...] = ()
    # Who the request is for (the caller's client, "" when it is its own): sent with uncached compiles.
    end_client: str = ""

    @property
    def placed(self) -> bool:
        return self.replica != NO_REPLICA

    def placed_on(self, replica: int, grammar_id: str, session_id: int) -> None:
        """Compiled on `replica`: the session is opened there with the next step."""
        self.replica, self.grammar_id, self.session_id, self.open = replica, grammar_id, session_id, False

    def released(self) -> None:
        """No replica holds it any more (the request finished, or its session is to be rebuilt)."""
        self.replica, self.open = NO_REPLICA, False

    def rebuild_from(self, output_ids: list[int]) -> None:
        """Its replica lost it: the next replica is told every token generated so far."""
        self.pending_accept = list(output_ids)
        self.replays += 1
