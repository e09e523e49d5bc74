"""The normalised JSON schema as llguidance's grammar is built from it: the same documents, in shapes it takes.

llguidance builds a recursive definition once, and refuses a schema that
asks it to intersect a definition with something else while that definition
is still being built ("circular references with sibling keys are not
supported"). Two shapes of real schemas ask that without changing what the
schema accepts, and are rewritten here:

- keywords beside a `$ref` in a schema that declares a draft up to 7. There
  a `$ref` replaces its node: the keywords beside it are ignored (jsonschema's
  Draft4..7 validators, so the output check and the validity bench;
  schema_normalise.py when it inlines a `$ref`; xgrammar ignores them in
  every draft). llguidance reads every schema as 2020-12, where they apply,
  and intersects them with the target: a recursive draft-04 schema whose
  properties say `{"$ref": ..., "type": "object"}` is refused. They are
  dropped. A schema declaring no draft keeps them: the output check reads it
  as 2020-12, where they apply.
- a property whose schema is, but for annotations, that of the one
  `patternProperties` pattern its name matches (WashingtonPost's
  `"properties": {"by": S}, "patternProperties": {"^[a-zA-Z0-9_]*": S}`).
  A property must be valid against both; llguidance intersects them, which
  refuses the schema where S refers to a definition being built. Both being
  S, the property's own schema adds nothing: it keeps only its annotations
  (an empty schema to llguidance), and the pattern's S applies to it alone.
  Names are matched as jsonschema matches them (`re.search`), where every
  pattern is a literal or one atom repeated (`^[a-zA-Z0-9_]*`): no name can
  make those slow. Any other pattern leaves the properties alone: the
  schema's own regexes do not run in the service.

llguidance does not implement `propertyNames` (it warns and ignores it;
xgrammar enforces it). Its commonest shape, `"propertyNames": {"pattern": P}`
on an object with no `properties` or `patternProperties`, is written as what
llguidance does implement, with the same meaning: every name must match P and
its value satisfy `additionalProperties`, so `"patternProperties": {P:
<additionalProperties>}, "additionalProperties": false`.
"""

from __future__ import annotations

import re
from typing import Any

from grammar_svc.schema.schema_normalise import REPEATED_ATOM, json_key, literal_of, ref_siblings_ignored

# What stays beside a `$ref`: keywords that constrain no document ($defs and ids also hold the targets of
# other references, which must stay where they are).
_KEPT_BESIDE_REF = frozenset({
    "$ref", "$schema", "$id", "id", "$comment", "title", "description", "default", "examples", "definitions",
    "$defs", "deprecated", "readOnly", "writeOnly", "$anchor",
})
# Keywords that say nothing about a document nor about how references inside resolve.
_ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples", "deprecated", "readOnly",
                          "writeOnly"})
# Keywords whose values are JSON documents, not schemas: nothing in them is a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names to schemas: a name there is no keyword ("default" may be a property).
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "definitions", "$defs", "dependentSchemas",
                          "dependencies"})


def llguidance_schema(schema: Any) -> Any:
    """`schema` (normalised) rewritten as the module docstring says: a schema accepting the same documents."""
    return _Rewriter(ref_siblings_ignored(schema)).node(schema)


class _Rewriter:
    def __init__(self, drop_ref_siblings: bool):
        self.drop_ref_siblings = drop_ref_siblings

    def node(self, node: Any) -> Any:
        # Recursive: the schema has been through normalisation, which bounds its nesting (MAX_DEPTH). Every
        # value but data is walked, unknown keywords included: a `$ref` may point into one.
        if isinstance(node, list):
            return [self.node(v) for v in node]
        if not isinstance(node, dict):
            return node
        if self.drop_ref_siblings and isinstance(node.get("$ref"), str):
            node = {k: v for k, v in node.items() if k in _KEPT_BESIDE_REF}
        out = {k: self._named(v) if k in _SCHEMA_MAPS else v if k in _DATA_KEYWORDS else self.node(v)
               for k, v in node.items()}
        if isinstance(out.get("properties"), dict) and isinstance(out.get("patternProperties"), dict):
            out["properties"] = _without_pattern_duplicates(out["properties"], out["patternProperties"])
        return _property_names_as_pattern(out)

    def _named(self, value: Any) -> Any:
        if not isinstance(value, dict):
            return self.node(value)
        return {name: self.node(v) for name, v in value.items()}


def _without_pattern_duplicates(properties: dict, patterns: dict) -> dict:
    compiled = []
    for pattern, schema in patterns.items():
        # Only patterns no input can make slow (a literal, one atom repeated): this runs in the grammar service,
        # where one hostile pattern would burn its threads. Any other pattern decides no name here.
        if not isinstance(pattern, str) or not (REPEATED_ATOM.match(pattern) or literal_of(pattern) is not None):
            return properties
        try:
            compiled.append((re.compile(pattern, re.ASCII), schema))  # ECMA's \d and \w are ASCII
        except (re.error, RecursionError, OverflowError):  # the schema's: a pattern Python does not read
            return properties
    out = {}
    for name, schema in properties.items():
        matched = [s for r, s in compiled if r.search(name)]
        if len(matched) == 1 and isinstance(schema, dict) and \
                json_key(_constraints(schema)) == json_key(_constraints(matched[0])):
            schema = {k: v for k, v in schema.items() if k in _ANNOTATIONS}
        out[name] = schema
    return out


def _constraints(schema: Any) -> Any:
    return {k: v for k, v in schema.items() if k not in _ANNOTATIONS} if isinstance(schema, dict) else schema


# Lookarounds, which llguidance refuses: a pattern it would only have ignored under propertyNames stays there.
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def _property_names_as_pattern(node: dict) -> dict:
    names = node.get("propertyNames")
    if not isinstance(names, dict) or set(_constraints(names)) != {"pattern"} or any(
            k in node for k in ("properties", "patternProperties", "unevaluatedProperties")):
        return node
    pattern = names["pattern"]
    if not isinstance(pattern, str) or _LOOKAROUND.search(pattern):
        return node
    out = {k: v for k, v in node.items() if k != "propertyNames"}
    if out.get("additionalProperties") is not False:  # else no name is allowed, matching or not
        out["patternProperties"] = {pattern: node.get("additionalProperties", True)}
        out["additionalProperties"] = False
    return out
