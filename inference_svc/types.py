"""The value types that cross the inference service's layers, in one leaf module.

A `Constraint` is built by the API layer (the servicer, the tool-call
grammar), carried by the engine and the engine core's socket, and turned
into grammar.v1 by the grammar link; schema warnings, a schema check and
parsed tool calls come back the other way, to the engine's outputs and the
servicer. Were each type kept in the layer that first needed it, every other
layer would import that one, and the layers would import each other in a
circle. Kept here instead, as vLLM keeps its structured-output types in
`v1/structured_output/backend_types.py`: this module imports nothing of the
service, not even under TYPE_CHECKING (tests/test_import_rules.py counts
those in its cycle check too), so any layer may import it and it closes no
cycle. It holds data and the one interface the engine calls on the API
layer's tool-call parser; behaviour belongs to the layer that owns it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

# ---------------------------------------------------------------- what a request is constrained by

KINDS = ("json_schema", "regex", "ebnf", "choice", "json_object", "structural_tag")
WHITESPACE_STYLES = ("compact", "flexible", "indented")
# Grammar libraries a constraint may ask for (Constraint.backend).
GRAMMAR_BACKENDS = ("auto", "xgrammar", "llguidance")


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
    # The grammar library asked for (one of GRAMMAR_BACKENDS; "": the grammar replica's --grammar-backend).
    # Part of the constraint's identity: the compile memo keys on it.
    backend: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}")
        if self.backend and self.backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"unknown grammar backend {self.backend!r}")


# ---------------------------------------------------------------- what a client is told about its schema


class CheckResult(enum.Enum):
    VALID = "valid"
    INVALID = "invalid"
    UNCHECKED = "unchecked"  # the check could not be had: `detail` says why


@dataclass(frozen=True)
class SchemaWarning:
    """A keyword of the schema the grammar does not enforce (a compile warning)."""

    keyword: str
    json_pointer: str  # "" = the root, or no place known
    message: str


@dataclass(frozen=True)
class SchemaViolation:
    keyword: str  # "json": not one JSON document
    instance_pointer: str
    message: str


@dataclass(frozen=True)
class SchemaCheck:
    """Whether a finished JSON document validates against its schema (engine/schema_check.py says when)."""

    result: CheckResult
    violations: tuple[SchemaViolation, ...] = ()
    detail: str = ""  # UNCHECKED: why; INVALID: how many violations were left out, if any


# ---------------------------------------------------------------- tool calls


@dataclass(frozen=True)
class ParsedToolCall:
    id: str  # "call_" + 24 hex digits
    name: str
    arguments_json: str  # the arguments object as compact JSON text


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a tool call as its text arrives: a call's first has its id and name, the next ones the
    arguments text in order (streamed arguments, as OpenAI clients read them)."""

    index: int  # the call's position among the response's calls
    id: str = ""
    name: str = ""
    arguments_fragment: str = ""


class ToolCallReader(Protocol):
    """What the engine's response text calls on a request's tool-call parser (api/tool_calls.py's).

    `push` each answer text delta and send the content it returns; `finish`
    at the end: each returns (content, whole calls found). `take_deltas`
    then gives the calls' pieces that text added (each call's last piece
    comes no later than the call itself).
    """

    def push(self, text: str) -> tuple[str, list[ParsedToolCall]]: ...

    def finish(self) -> tuple[str, list[ParsedToolCall]]: ...

    def take_deltas(self) -> list[ToolCallDelta]: ...
