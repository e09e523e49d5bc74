"""Preload file: constraints compiled at start-up, before the replica reports SERVING.

JSON Lines, one constraint per line, keyed by kind, with optional JSON options:
  {"json_schema": {...}, "options": {"whitespace": "compact", "any_key_order": false}}
  {"regex": "[0-9]{3}"}
  {"ebnf": "root ::= \"a\" | \"b\""}
  {"choice": ["yes", "no"]}
  {"json_object": true}
  {"structural_tag": {...}}
They are compiled for the tokenizer at --preload-tokenizer (default: the
embedded 129,280-token tokenizer), so inference replicas using it hit the cache.
"""

from __future__ import annotations

import json
from pathlib import Path

from grammar_svc.compile.spec import GrammarSpec
from grammar_svc.types import JsonOptions, Kind, Whitespace
from shared.errors import InvalidGrammarError


def _options(raw: dict) -> JsonOptions:
    d = JsonOptions()
    try:
        return JsonOptions(
            whitespace=Whitespace(raw.get("whitespace", d.whitespace.value)),
            indent=int(raw.get("indent", d.indent)),
            max_whitespace_count=int(raw.get("max_whitespace_count", d.max_whitespace_count)),
            any_key_order=bool(raw.get("any_key_order", False)),
            lenient=bool(raw.get("lenient", False)),
        )
    except ValueError as e:
        raise InvalidGrammarError(f"bad options {raw!r}: {e}") from None


def parse_line(line: str) -> GrammarSpec:
    item = json.loads(line)
    if not isinstance(item, dict):
        raise InvalidGrammarError("each preload line must be a JSON object")
    opts = _options(item.get("options", {}))
    kinds = [k for k in item if k != "options"]
    if len(kinds) != 1:
        raise InvalidGrammarError(f"each preload line needs exactly one constraint kind, got {kinds}")
    kind = Kind(kinds[0])
    value = item[kinds[0]]
    if kind is Kind.JSON_SCHEMA:
        return GrammarSpec(kind, value if isinstance(value, str) else json.dumps(value), opts)
    if kind is Kind.JSON_OBJECT:
        return GrammarSpec(kind, "", opts)
    if kind is Kind.CHOICE:
        return GrammarSpec.choice(value)
    if kind is Kind.STRUCTURAL_TAG:
        return GrammarSpec(kind, value if isinstance(value, str) else json.dumps(value))
    return GrammarSpec(kind, value)


def read(path: Path) -> list[tuple[int, GrammarSpec | Exception]]:
    """(line number, spec or the error that line has) for each non-blank line."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            out.append((n, parse_line(line)))
        except (ValueError, InvalidGrammarError) as e:
            out.append((n, e))
    return out
