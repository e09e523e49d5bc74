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

from inference_svc.grammar.schema_check import SchemaWarning

NO_REPLICA = -1
KINDS = ("json_schema", "regex", "ebnf", "choice", "json_object", "structural_tag")


WHITESPACE_STYLES = ("compact", "flexible", "indented")


@dataclass(frozen=True)
class JsonOptions:
    """How a JSON constraint lays out and bounds its output (the grammar tier checks the ranges).

    The defaults are the grammar tier's: compact separators, no free
    whitespace, schema key order, strict; those finish with weak models.
    """

    whitespace: str = "compact"  # one of WHITESPACE_STYLES
    max_whitespace_count: int = 0  # flexible: longest whitespace run (0: the grammar tier's default)
    indent: int = 0  # indented: spaces per level (0: the grammar tier's default)
    lenient: bool = False  # allow what the schema does not forbid explicitly (not OpenAI strict)
    any_key_order: bool = False

    def __post_init__(self) -> None:
        if self.whitespace not in WHITESPACE_STYLES:
            raise ValueError(f"unknown whitespace style {self.whitespace!r}")


@dataclass(frozen=True)
class Constraint:
    """What a request is constrained by, as the engine keeps it (grammar_tier.py turns it into grammar.v1)."""

    kind: str  # one of KINDS
    text: str = ""  # the schema, pattern, grammar or structural tag (JSON text)
    choices: tuple[str, ...] = ()  # kind "choice"
    json_options: JsonOptions = JsonOptions()  # kinds json_schema and json_object
    # json_schema: refuse a schema whose keywords the grammar does not all enforce (compile warnings).
    strict_schema: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}")


@dataclass(eq=False)
class GrammarSession:
    spec: Constraint
    jump_forward: bool = True
    grammar_id: str = ""
    replica: int = NO_REPLICA  # NO_REPLICA while compiling (or recompiling after a lost replica)
    session_id: int = 0
    open: bool = False  # the replica holds the session (an OpenSession has been sent and not failed)
    pending_accept: list[int] = field(default_factory=list)
    replays: int = 0  # times the session was rebuilt on another replica
    # What the grammar does not enforce of its schema (from the compile), for the client's first response.
    warnings: tuple[SchemaWarning, ...] = ()

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
