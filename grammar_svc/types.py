"""The value types that cross the grammar service's layers, in one leaf module.

A constraint's kind and JSON options are read by the servicer (from
grammar.v1), by compile/spec.py (the cache key, admission) and by
schema/json_grammar.py (how the grammar lays out its JSON), which is the
layer below compile/: kept in compile/, they would make the schema layer
import the one above it, or take its options untyped. Here they are below
every layer: this module imports nothing of the service, not even under
TYPE_CHECKING (the cycle check counts those too), as vLLM keeps its structured-output
types in `v1/structured_output/backend_types.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from shared.errors import InvalidGrammarError


class Kind(str, Enum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    EBNF = "ebnf"
    CHOICE = "choice"
    JSON_OBJECT = "json_object"
    STRUCTURAL_TAG = "structural_tag"


class Whitespace(str, Enum):
    COMPACT = "compact"
    INDENTED = "indented"
    FLEXIBLE = "flexible"


DEFAULT_INDENT = 2
DEFAULT_MAX_WHITESPACE = 2
MAX_INDENT = 16
MAX_WHITESPACE = 64


@dataclass(frozen=True)
class JsonOptions:
    whitespace: Whitespace = Whitespace.COMPACT
    indent: int = DEFAULT_INDENT
    max_whitespace_count: int = DEFAULT_MAX_WHITESPACE
    any_key_order: bool = False
    lenient: bool = False

    def validate(self) -> None:
        if not 0 < self.indent <= MAX_INDENT:
            raise InvalidGrammarError(f"indent must be between 1 and {MAX_INDENT}, got {self.indent}")
        if not 0 < self.max_whitespace_count <= MAX_WHITESPACE:
            raise InvalidGrammarError(
                f"max_whitespace_count must be between 1 and {MAX_WHITESPACE}, got {self.max_whitespace_count}"
            )

    def xgrammar_kwargs(self) -> dict:
        """Keyword arguments for GrammarCompiler.compile_json_schema."""
        kw = {"strict_mode": not self.lenient, "any_order": self.any_key_order}
        if self.whitespace is Whitespace.COMPACT:
            kw.update(any_whitespace=False, separators=(",", ":"))
        elif self.whitespace is Whitespace.INDENTED:
            kw.update(any_whitespace=False, indent=self.indent, separators=(",", ": "))
        else:
            kw.update(any_whitespace=True, max_whitespace_cnt=self.max_whitespace_count)
        return kw
