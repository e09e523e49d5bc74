"""Finds JSON Schema keywords that xgrammar 0.2.8 ignores or approximates.

xgrammar prints a warning for some of these (multipleOf on numbers, pattern
with length bounds, allOf, overlapping oneOf); those are captured from the
compile worker's stderr. The ones below it drops silently; this scanner names
each with its JSON pointer so the client sees them in CompileResponse.warnings.
The table was established by compiling each keyword with and without it and
is pinned by tests/test_schema_warnings.py (which proves each one is really
not enforced), so an xgrammar upgrade that starts enforcing one fails there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Formats xgrammar 0.2.8 turns into a grammar; any other format is ignored.
ENFORCED_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})

IGNORED_KEYWORDS: dict[str, str] = {
    "uniqueItems": "uniqueItems is not enforced: arrays may repeat items",
    "not": "not is ignored: instances matching the negated schema are allowed",
    "if": "if/then/else is ignored: the conditional subschemas are not applied",
    "dependencies": "dependencies is ignored",
    "dependentRequired": "dependentRequired is ignored",
    "dependentSchemas": "dependentSchemas is ignored",
    "unevaluatedProperties": "unevaluatedProperties is approximated: a schema applies like additionalProperties, `false` is ignored",
    "unevaluatedItems": "unevaluatedItems is approximated: it applies like items, blind to items that subschemas evaluate",
    "additionalItems": "additionalItems is ignored",
    "contains": "contains is not enforced: with items, any array of them is allowed; without, only an empty array, which the schema rejects",
    "minContains": "minContains is applied as minItems: shorter arrays are rejected, what they contain is not checked",
    "maxContains": "maxContains is not enforced",
}

# Keywords whose values are schemas, or maps/lists of schemas, to descend into.
_SCHEMA_VALUED = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
                  "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")

MAX_WARNINGS = 64
FORMAT_BESIDE_PATTERN = "format {fmt!r} beside a pattern is not enforced: the pattern is"


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def scan(schema, served=None) -> list[str]:
    """Warnings for ignored keywords, each with its JSON pointer, deduplicated, bounded.

    served: the schema the backend was given (schema_normalise's form). A keyword it no longer has anywhere was
    applied by the rewrite (an if/then on a discriminator becomes one anyOf case per value) and is not named:
    a strict_schema request for it is served, not refused.
    """
    still_there = None if served is None else _ignored_keywords_in(served)
    found: list[str] = []
    seen: set[str] = set()
    for pointer, node in _nodes(schema):
        if len(found) >= MAX_WARNINGS:
            break
        for key, message in IGNORED_KEYWORDS.items():
            if key in node and (still_there is None or key in still_there):
                line = f"{pointer or '/'}: {message}"
                if line not in seen:
                    seen.add(line)
                    found.append(line)
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS:
            found.append(f"{pointer or '/'}: format {fmt!r} is not enforced: any string is allowed")
        elif isinstance(fmt, str) and isinstance(node.get("pattern"), str):
            # xgrammar writes one of the two; structd gives it the pattern (grammar_svc/schema/json_grammar.py).
            found.append(f"{pointer or '/'}: {FORMAT_BESIDE_PATTERN.format(fmt=fmt)}")
    return found[:MAX_WARNINGS]


def _ignored_keywords_in(schema) -> set[str]:
    return {key for _, node in _nodes(schema) for key in IGNORED_KEYWORDS if key in node}


def _nodes(schema):
    """(JSON pointer, node) of every schema object in `schema`, depth first."""
    stack = [("", schema)]
    while stack:
        pointer, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield pointer, node
        for key in _SCHEMA_VALUED:
            if isinstance(node.get(key), dict):
                stack.append((f"{pointer}/{_escape(key)}", node[key]))
        for key in _SCHEMA_MAPS:
            sub = node.get(key)
            if isinstance(sub, dict):
                for name, child in sub.items():
                    stack.append((f"{pointer}/{_escape(key)}/{_escape(str(name))}", child))
        for key in _SCHEMA_LISTS:
            sub = node.get(key)
            if isinstance(sub, list):
                for i, child in enumerate(sub):
                    stack.append((f"{pointer}/{_escape(key)}/{i}", child))


@dataclass(frozen=True)
class SchemaWarning:
    """One warning line as a record: what strict_schema names and Generate returns."""

    keyword: str
    json_pointer: str  # "" = the root, or no place known (xgrammar's own warnings name none)
    message: str  # the whole line


_KEYWORD_OF_MESSAGE = {message: key for key, message in IGNORED_KEYWORDS.items()}
# xgrammar's own stderr lines: "pattern combined with minLength/maxLength ...; ignoring minLength/maxLength".
_IGNORING = re.compile(r"ignoring (\S+)\s*$")


def parse(line: str) -> SchemaWarning:
    """The record for a warning line: scan()'s "POINTER: MESSAGE", or xgrammar's own."""
    pointer, sep, message = line.partition(": ")
    if sep and pointer.startswith("/"):
        keyword = _KEYWORD_OF_MESSAGE.get(message) or message.split(" ", 1)[0]
        return SchemaWarning(keyword, "" if pointer == "/" else pointer, line)
    ignoring = _IGNORING.search(line)
    return SchemaWarning(ignoring.group(1) if ignoring else line.split(" ", 1)[0], "", line)
