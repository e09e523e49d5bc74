"""Constraint specs: the domain form of grammar.v1.GrammarSpec.

Holds admission validation (cheap checks answered before any compile work),
the cache key, and `compile_spec`, the single place that knows which xgrammar
call compiles which kind (it runs inside the compile worker processes).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

from grammar_svc.compile.llguidance_backend import GRAMMAR_REVISION as LLGUIDANCE_GRAMMAR_REVISION, LLGUIDANCE
from grammar_svc.schema.json_grammar import GRAMMAR_REVISION
from grammar_svc.types import JsonOptions, Kind
from shared.errors import InvalidGrammarError, RequestTooLargeError
from shared.json_nesting import check_nesting


@dataclass(frozen=True)
class GrammarSpec:
    kind: Kind
    # The constraint text: schema / regex / EBNF / structural tag JSON; for
    # choices, the JSON list of choices; for json_object, empty.
    text: str
    json_options: JsonOptions = JsonOptions()
    root_rule: str = "root"

    @staticmethod
    def choice(choices: list[str]) -> "GrammarSpec":
        return GrammarSpec(Kind.CHOICE, json.dumps(list(choices), ensure_ascii=False))

    def size_bytes(self) -> int:
        return len(self.text.encode("utf-8"))

    def validate(self, max_spec_bytes: int) -> None:
        """Cheap admission checks; xgrammar's own parse errors come from the worker."""
        size = self.size_bytes()
        if size > max_spec_bytes:
            raise RequestTooLargeError(
                f"{self.kind.value} spec is {size} bytes; this server accepts at most {max_spec_bytes} "
                "(--max-spec-bytes)")
        if self.kind in (Kind.JSON_SCHEMA, Kind.JSON_OBJECT):
            self.json_options.validate()
        if self.kind is Kind.JSON_SCHEMA:
            schema = _parse_json(self.text, "json_schema")
            if not isinstance(schema, (dict, bool)):
                raise InvalidGrammarError(
                    f"json_schema must be a JSON object or boolean, got {type(schema).__name__}"
                )
            if schema is False:
                raise InvalidGrammarError("json_schema `false` matches nothing")
        elif self.kind is Kind.REGEX:
            if not self.text:
                raise InvalidGrammarError("regex is empty")
        elif self.kind is Kind.EBNF:
            if not self.text.strip():
                raise InvalidGrammarError("ebnf grammar is empty")
            if not self.root_rule.isidentifier():
                raise InvalidGrammarError(f"root rule name {self.root_rule!r} is not a valid rule name")
        elif self.kind is Kind.CHOICE:
            choices = json.loads(self.text)
            if not choices:
                raise InvalidGrammarError("choice needs at least one option")
            if any(c == "" for c in choices):
                raise InvalidGrammarError("choice options must be non-empty strings")
        elif self.kind is Kind.STRUCTURAL_TAG:
            tag = _parse_json(self.text, "structural_tag")
            if not isinstance(tag, dict):
                raise InvalidGrammarError("structural_tag must be a JSON object")

    def cache_key(self, tokenizer_fingerprint: str, backend: str = "xgrammar") -> str:
        """Stable across processes and replicas: the grammar id is derived from it. The backend is part of it
        (another library is another grammar), named only for llguidance, with the revision of its grammar path, so
        xgrammar's ids stay as they were."""
        o = self.json_options
        parts = [
            tokenizer_fingerprint,
            self.kind.value,
            # A JSON Schema's grammar (also inside a structural tag) is structd's, not xgrammar's alone:
            # a new revision is a new grammar.
            GRAMMAR_REVISION if self.kind in (Kind.JSON_SCHEMA, Kind.JSON_OBJECT, Kind.STRUCTURAL_TAG) else "",
            self.root_rule,
            o.whitespace.value,
            str(o.indent),
            str(o.max_whitespace_count),
            str(int(o.any_key_order)),
            str(int(o.lenient)),
            self.text,
        ]
        if backend != "xgrammar":
            parts.insert(1, backend if backend != LLGUIDANCE else LLGUIDANCE_GRAMMAR_REVISION)
        return "\x1f".join(parts)

    def grammar_id(self, tokenizer_fingerprint: str, backend: str = "xgrammar") -> str:
        return hashlib.sha256(self.cache_key(tokenizer_fingerprint, backend).encode("utf-8")).hexdigest()[:32]


def _parse_json(text: str, what: str):
    check_nesting(text, what)  # before json.loads, which recurses once per level
    try:
        # NaN, Infinity and numbers past a double (1e400) are not JSON, though Python's json reads them: a
        # bound of NaN or infinity would reach the normaliser and xgrammar as a number.
        return json.loads(text, parse_constant=_not_json, parse_float=_finite)
    except json.JSONDecodeError as e:
        raise InvalidGrammarError(f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except _NotJsonError as e:
        raise InvalidGrammarError(f"{what} is not valid JSON: {e}") from None


class _NotJsonError(ValueError):
    """A number Python's json reads and JSON does not have."""


def _not_json(name: str):
    raise _NotJsonError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _NotJsonError(f"{text} is past the largest number a JSON Schema bound can hold")
    return value


def choice_ebnf(choices: list[str]) -> str:
    # json.dumps escapes quotes, backslashes and control characters the way
    # xgrammar's EBNF string literals read them.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_spec(compiler, spec: GrammarSpec):
    """Compiles a spec with an xgrammar GrammarCompiler (runs in a worker)."""
    from grammar_svc.schema.json_grammar import compile_json_schema

    if spec.kind is Kind.JSON_SCHEMA:
        # Normalised schema, JSON strings, bounded strings in tail form (json_grammar.py).
        return compile_json_schema(compiler, spec.text, spec.json_options)
    if spec.kind is Kind.JSON_OBJECT:
        return compile_json_schema(compiler, '{"type": "object"}', spec.json_options)
    if spec.kind is Kind.REGEX:
        return compiler.compile_regex(spec.text)
    if spec.kind is Kind.EBNF:
        return compiler.compile_grammar(spec.text, root_rule_name=spec.root_rule)
    if spec.kind is Kind.CHOICE:
        return compiler.compile_grammar(choice_ebnf(json.loads(spec.text)))
    if spec.kind is Kind.STRUCTURAL_TAG:
        from grammar_svc.compile.structural_tags import structd_structural_tag

        # Its json_schema parts through structd's JSON grammar, with the request's JSON options.
        return compiler.compile_structural_tag(structd_structural_tag(spec.text, spec.json_options))
    raise InvalidGrammarError(f"unsupported grammar kind {spec.kind!r}")
