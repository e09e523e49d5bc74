"""structd's JSON-Schema grammar: the one path from a schema to the grammar the service compiles.

xgrammar 0.2.8 writes the EBNF; structd owns what goes in and what comes out:

1. the schema is normalised first (grammar_svc/schema/schema_normalise.py), so that
   keywords xgrammar drops beside `anyOf`/`oneOf`/`allOf` (a root's `type`,
   an object's `properties`) still constrain the document;
2. bounded strings become JSON strings (grammar_svc/schema/json_strings.py): no raw
   control characters, escape sequences counted as one character;
3. `pattern` and `format` strings xgrammar prints as plain EBNF are written as
   JSON strings too (grammar_svc/schema/regex_strings.py: `"`, `\\` and control
   characters escaped);
4. in compact style, values the schema leaves untyped (json_object,
   lenient extras, `{"type": "array"}`) are compact too: xgrammar 0.2.8
   hard-codes ", " between their items whatever the separators;
5. bounded strings are put in tail form (grammar_svc/schema/bounded_strings.py), the
   same language with masks that are cached lookups; bounds past 128 in a
   blocked form, and one-class bounded `pattern`s as bounded strings
   (grammar_svc/schema/bounded_patterns.py);
6. a string with both a `pattern` and a `format` loses its `format`: xgrammar
   writes one of them, the format when it knows it, and drops the pattern.
   The pattern is what the schema's author wrote to constrain the string, and
   the one the validator asserts (`format` is an annotation unless a format
   checker is asked for). Only xgrammar's schema: llguidance enforces both.
7. a property whose schema is `false` (normalisation makes a property no
   value satisfies `false`), not required, on an object that names no
   `additionalProperties` or `patternProperties`, is unlisted for xgrammar,
   which refuses a `false` property schema: its strict mode closes such an
   object, so the name is never written (in lenient mode it may be, as an
   extra property of any value). llguidance is given the `false`.

`GRAMMAR_REVISION` names this path in every JSON grammar's cache key, so a
grammar id never refers to a grammar an older path compiled.
"""

from __future__ import annotations

import functools
import json

from grammar_svc.schema.bounded_strings import rewrite_bounded_strings
from grammar_svc.schema.json_strings import fix_string_characters
from grammar_svc.schema.regex_strings import escape_regex_strings
from grammar_svc.schema.schema_normalise import normalise_schema
from grammar_svc.types import JsonOptions, Whitespace

# Bump whenever this path can compile a schema to a different grammar.
GRAMMAR_REVISION = "json-grammar-20"


# Cached: a compile worker asks again for the form it compiled, to tell which ignored keywords the rewrite applied.
@functools.lru_cache(maxsize=4)
def normalised_schema_text(schema_text: str, *, for_xgrammar: bool = False) -> str:
    """The schema a backend is given: normalised where that makes its grammar right, else as it was.

    for_xgrammar: also a `pattern`'s `format` dropped and `false` properties unlisted (the module docstring, 6
    and 7)."""
    schema = json.loads(schema_text)
    normalised = normalise_schema(schema)
    if for_xgrammar:
        normalised = _for_xgrammar(normalised)
    return schema_text if normalised == schema else json.dumps(normalised, ensure_ascii=False)


# Keywords whose values are JSON documents (a "format" there is data), and those mapping names to schemas (a
# property may be called "format").
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "definitions", "$defs", "dependentSchemas"})


def _for_xgrammar(node):
    # Recursive: normalisation bounds the schema's nesting (MAX_DEPTH).
    if isinstance(node, list):
        return [_for_xgrammar(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in _DATA_KEYWORDS
           else {n: _for_xgrammar(s) for n, s in v.items()} if k in _SCHEMA_MAPS and isinstance(v, dict)
           else _for_xgrammar(v) for k, v in node.items()}
    if isinstance(out.get("pattern"), str) and isinstance(out.get("format"), str):
        del out["format"]
    props, required = out.get("properties"), out.get("required")
    if isinstance(props, dict) and False in props.values() and not any(
            k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
        required = required if isinstance(required, list) else []
        out["properties"] = {k: v for k, v in props.items() if v is not False or k in required}
    return out


def json_schema_ebnf(schema_text: str, json_options: JsonOptions, *, xgrammar_only: bool = False) -> str:
    """The EBNF for a schema with the service's options, before the tail-form rewrite.

    With xgrammar_only, xgrammar's own EBNF for the schema as given (what xgrammar alone compiles).
    """
    import xgrammar as xgr

    if xgrammar_only:
        return str(xgr.Grammar.from_json_schema(schema_text, **json_options.xgrammar_kwargs()))
    ebnf = str(xgr.Grammar.from_json_schema(normalised_schema_text(schema_text, for_xgrammar=True),
                                           **json_options.xgrammar_kwargs()))
    ebnf = escape_regex_strings(fix_string_characters(ebnf)[0])[0]
    return _compact_free_values(ebnf) if json_options.whitespace == Whitespace.COMPACT else ebnf


# xgrammar's rules for the items of an untyped array / object, with the ", " it hard-codes.
_FREE_ITEM_RULES = ('basic_array_items ::= ((", " basic_any))',
                    'basic_object_properties ::= ((", " basic_string ":" basic_any))')


def _compact_free_values(ebnf: str) -> str:
    for rule in _FREE_ITEM_RULES:
        ebnf = ebnf.replace(rule, rule.replace('", "', '","'))
    return ebnf


def compile_json_schema(compiler, schema_text: str, json_options: JsonOptions, *, rewrite: bool = True):
    """A JSON Schema compiled the service's way (bounded strings in tail form unless rewrite=False)."""
    ebnf = json_schema_ebnf(schema_text, json_options)
    if rewrite:
        ebnf = rewrite_bounded_strings(ebnf)[0]
    return compiler.compile_grammar(ebnf)
