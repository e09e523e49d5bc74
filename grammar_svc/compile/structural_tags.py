"""Structural tags whose JSON-Schema parts compile through structd's JSON grammar.

A structural tag (xgrammar's `{"type": "structural_tag", "format": ...}`) may
hold `json_schema` parts: tool-call arguments are one. xgrammar 0.2.8 compiles
each with its own schema converter, so the mistakes grammar_svc/schema/json_grammar.py
fixes for a `json_schema` constraint (raw control characters in bounded
strings, keywords dropped beside `anyOf`, an object root that admits a bare
number, ...) would come back inside tool calls. Each `json_schema` part in
the JSON style becomes a `grammar` part holding structd's EBNF for it, with
the spec's JSON options (a structural tag's are the defaults: compact ","
and ":" separators, strict; xgrammar alone would allow free whitespace):
the same JSON the tool-call parser reads and a `json_schema` constraint
writes. Other styles (XML-like tool formats) and the legacy form
(`structures` and `triggers`) stay xgrammar's.
"""

from __future__ import annotations

import json
from typing import Any

from grammar_svc.schema.bounded_strings import rewrite_bounded_strings
from grammar_svc.schema.json_grammar import json_schema_ebnf


def structd_structural_tag(text: str, json_options) -> str:
    """The structural tag with its JSON-style `json_schema` parts as structd grammars (`text` if none)."""
    tag = json.loads(text)
    if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
        return text
    changed = [0]
    fmt = _rewrite(tag["format"], json_options, changed)
    return json.dumps({**tag, "format": fmt}, ensure_ascii=False) if changed[0] else text


def _rewrite(node: Any, json_options, changed: list[int]) -> Any:
    if isinstance(node, list):
        return [_rewrite(n, json_options, changed) for n in node]
    if not isinstance(node, dict):
        return node
    schema = node.get("json_schema")
    if node.get("type") == "json_schema" and node.get("style", "json") == "json" and isinstance(schema, dict):
        changed[0] += 1
        ebnf = json_schema_ebnf(json.dumps(schema, ensure_ascii=False), json_options)
        return {"type": "grammar", "grammar": rewrite_bounded_strings(ebnf)[0]}
    return {k: _rewrite(v, json_options, changed) for k, v in node.items()}
