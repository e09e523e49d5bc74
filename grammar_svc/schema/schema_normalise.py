"""JSON Schema normalisation before xgrammar: the same schema, in shapes xgrammar compiles right.

xgrammar 0.2.8 drops every keyword beside `anyOf`/`oneOf` (a node
`{"type": "object", "properties": ..., "anyOf": [{"required": ["a"]}, ...]}`
compiles to "any JSON value", bare numbers included) and compiles an `allOf`
of more than one schema to "any JSON value". Rewritten here, with the same
meaning:

- `allOf` is merged into its node (local `$ref`s inlined, types intersected,
  `required` united, bounds tightened, `properties` merged; an
  `additionalProperties` of one part applied to the other part's
  properties), so the node keeps every declared constraint;
- the keywords beside `anyOf`/`oneOf` are merged into each branch
  (`{A, anyOf: [B, C]}` is `anyOf: [A and B, A and C]`);
- `enum` values that the node's own `type` excludes are dropped;
- a node no value satisfies becomes `false` (xgrammar writes some value for
  it, one the schema rejects): an `enum` or `const` none of whose values has
  the node's `type` (of known names), an empty `enum`, an `allOf` whose parts
  have no value in common (two `const`s, disjoint `enum`s or types, a
  `false` part, a name one part requires and another forbids); an object
  node (`type: "object"`) with a required property that is `false`; an
  array node (`type: "array"`) whose `items` are `false` with `minItems` of
  1 or more, or whose prefix item i is `false` with `minItems` past i (the
  prefix of the schema's draft: `prefixItems` from 2020-12, an `items` array
  before); a node whose local `$ref`'s target normalises to `false` (in any
  draft: up to 7 the `$ref` replaces the node, after it the siblings only
  narrow it), so a `$ref` to a definition no value satisfies is handled as
  an inline `false` (xgrammar refuses a `$ref` to `false`, which made it
  refuse the whole schema where the property was optional). A target is
  normalised where the walk writes it, or where a `$ref` reaches it first;
  one that is not known (remote, plain-name or pointing nowhere, in a cycle,
  looked at past MAX_DEPTH) leaves the `$ref` as written.
  `anyOf`/`oneOf` branches that are `false` are dropped (none left: the node
  is `false`). A schema that is `false` as a whole is refused
  (InvalidGrammarError naming where and why, through each `$ref`: past
  NOTES_NAMED_FIRST + NOTES_NAMED_LAST notes, the first and the last ones);
- a type whose values the node's own bounds leave none of goes from its
  `type` (an untyped node: every other type), the keywords only that type
  reads with it; none left, the node is `false`. Those bounds:
  `minLength`/`maxLength`, `minItems`/`maxItems`, `minProperties`/
  `maxProperties` with no count between (or past the names `required` lists,
  or the names `additionalProperties: false` leaves), a `pattern` that is one
  atom repeated more times than `maxLength` allows, a `minimum`/
  `exclusiveMinimum` past the `maximum`/`exclusiveMaximum` (for integer: no
  integer between; a whole `multipleOf`: no multiple between), a `contains`
  that accepts no item or more items than `maxItems`/`maxContains` allow, a
  required property or an item within `minItems` that is `false`. `enum`
  values outside the bounds are dropped (none left, or a `const` outside
  them: `false`). xgrammar refuses most of these on a node of that one type
  (naming no place) and on a type list (which some value satisfies); it
  compiles the others to documents the schema rejects (`[]` for `contains:
  false`, an enum's values past its `maximum`). Only keywords the schema's
  draft has are read (no `const`, `contains` or numeric `exclusiveMinimum` in
  draft 4, no `minContains` before 2019-09), as jsonschema reads them; a
  bound that is no finite number, and a fractional `multipleOf`, are not.
  Those a draft lacks that a backend would enforce (`const`, `contains`,
  `minContains`/`maxContains`, `prefixItems`) are dropped, before a merge
  reads them;
- `not` with only a `type` becomes the remaining types (xgrammar ignores
  `not`); where it excludes integer but the node admits number, it is left
  as written (no JSON Schema type names the non-integral numbers it leaves);
- a `required` property that `properties` does not list is listed (with the
  node's `additionalProperties`, else any value): xgrammar's strict mode
  would otherwise drop it, writing an object without it; the names a
  required property's `dependencies` (up to draft 7; `dependentRequired`
  after) require are required too;
- a property whose schema is `false` on a closed object (no
  `patternProperties`), not required, is unlisted: forbidden all the same,
  and xgrammar refuses a `false` property schema (JsonSchemaStore's semgrep
  has one named `additionalProperties`);
- a `pattern` that is one repeated character class anchored at both ends
  (`^[a-z0-9_]+$`) takes the string's `minLength`/`maxLength` into its
  repetition (xgrammar ignores the lengths beside any `pattern`);
- a discriminated union written with `if`/`then`/`else` (the node's own, or
  parts of its `allOf`, each `if` only one property's `const`/`enum`, on an
  object node that requires that property and lists its values in an
  `enum`/`const`) becomes an `anyOf` with one branch per set of values the
  same `then`/`else` schemas apply to: both backends ignore `if` (a schema
  naming draft 4 or 6, which have no `if`, is left as written).

Both backends apply `oneOf` as `anyOf`. Where its branches are objects told
apart by one property's `const`/`enum` values (no value in two branches), that
property is made required in each, so no document matches two branches. That
one narrows the schema: a document without the property, which the schema
accepts when exactly one branch matches it, is not written. Where its
branches are closed objects (`additionalProperties: false`) no property name
of which is another's, the one document two can share is `{}`, and the
branches that may accept it get `minProperties: 1` (narrower where a branch
rejects `{}` for another reason). Any other `oneOf`
stays `anyOf` to the grammars (the output check reports a document matching
two branches).

A merge this module cannot do exactly (two different `pattern`s, two
`anyOf`s, a `$ref` cycle, draft 4's `exclusiveMinimum` flag beside the other
part's `minimum`, one part's `prefixItems` or `items` array beside the other's
`items` or `additionalItems` with another prefix) leaves that node as it was:
never a looser schema.
One part's `patternProperties` beside the other's `additionalProperties`:
the pattern's schema meets that `additionalProperties` (narrower for names
the other part lists), and beside `false` the pattern goes (the names it
admits are forbidden) unless a name the other part lists or admits may
match it (then the node is left as it was). An `if`/`then` case that
cannot be merged with the node's own keywords leaves the node as written too.
The one exception are keywords xgrammar ignores anyway (`if`/`then`/`else`,
`not`, `dependencies`...): where two parts of an `allOf` disagree on one, the
first part's stays, so the rest of the merge still constrains the grammar
(the service's compile warnings name these keywords). And a part whose
`additionalProperties` sits beside a `patternProperties` pattern that is not
a literal (`^x-` is one; `^x-+` is not) leaves the other part's names alone,
as if the pattern matched them: running a schema's own regexes here could
stall the service on one hostile pattern.

Where the schema names a draft up to 7, a node with a `$ref` is left as it is
(`false` where its target is): the `$ref` replaces it, the keywords beside it
constrain nothing (nor make it `false`). A `$ref` is read as the output check
reads it: a fragment starting `#/` as written is a JSON pointer from the
root once percent-decoded (any other is a plain name, not looked up). An
embedded resource (a subschema with an `$id`, `id` up to draft 4, that is
not a plain name) has its own base: a `$ref` inside one, or whose target is
in one, is not looked up (none inlined, none found `false`), nor is one on a
node a resource may have been merged into (above it through allOf/anyOf/
oneOf/if/then/else only: where a merge is worked on, a `$ref` is placed by
the path, not by where its keywords came from); and a resource is merged
with no other schema (its keywords would go under another base).
Two `allOf` parts' `contains` are not merged (an array may hold an
item for each and none for both), and a part's `minContains`/`maxContains`
count only its own `contains`' items: without one they are dropped.

Merging siblings into branches and inlining `$ref`s copies subschemas, so a
small schema can normalise to an exponentially large one (sixteen nested
`{properties: {p: ...}, anyOf: [...]}` levels, or `allOf: [{$ref}, {$ref}]`
chains). A work budget bounds it: every node produced (walked, merged or
copied) counts, and past `node_budget(input)` nodes, or nested past
MAX_DEPTH schemas, the schema is refused (RequestTooLargeError naming the
keyword path where the budget ran out) rather than growing the process
without bound.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any
from urllib.parse import unquote

from shared.errors import InvalidGrammarError, RequestTooLargeError

# Nodes any schema may produce, plus PER_INPUT_NODE for each of its own dicts and lists: far above what real
# schemas need (docs/benchmarks.md, "Hostile input at the grammar service"), far below what exhausts a worker.
BASE_NODE_BUDGET = 100_000
PER_INPUT_NODE = 4
# Schemas nested in one another while normalising ($ref targets inlined included), and in the result: well
# inside Python's recursion limit for every reader after this one (json.dumps, xgrammar, jsonschema).
MAX_DEPTH = 128
# The largest repetition count written into a pattern: Python's re takes up to 2**32 - 2 (the output check's
# engine), xgrammar's EBNF lexer up to 10**15.
MAX_PATTERN_REPEAT = 2**32 - 2

# Keywords that do not constrain the document (they stay on the node, never go into branches).
_ANNOTATIONS = frozenset({
    "$schema", "$id", "id", "$comment", "title", "description", "default", "examples", "definitions", "$defs",
    "deprecated", "readOnly", "writeOnly", "$anchor", "$vocabulary", "$dynamicAnchor", "$recursiveAnchor",
})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "definitions", "$defs", "dependentSchemas")
_SUBSCHEMA_ONE = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
                  "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_LOWER_BOUNDS = ("minLength", "minItems", "minProperties", "minimum", "minContains")
_UPPER_BOUNDS = ("maxLength", "maxItems", "maxProperties", "maximum", "maxContains")
# Keywords xgrammar 0.2.8 does not enforce: a conflict on one does not stop a merge.
_IGNORED_BY_XGRAMMAR = frozenset({"if", "then", "else", "not", "dependencies", "dependentRequired",
                                  "dependentSchemas", "unevaluatedProperties", "unevaluatedItems", "contentEncoding",
                                  "contentMediaType", "contentSchema"})
_JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
_TYPE_NAMES = frozenset({*_JSON_TYPES, "number", "integer"})
# The `$schema` of the drafts where a `$ref` replaces its node (every keyword beside it ignored). A schema
# naming no draft is read as 2020-12, where they apply, as the output check reads it.
_DRAFTS_IGNORING_REF_SIBLINGS = ("draft-03", "draft-04", "draft-06", "draft-07")
# The keywords a draft does not have, of those this module reads (draft 4's `exclusiveMinimum` is a flag on
# `minimum`; const and contains came in draft 6, if in draft 7, minContains, dependentRequired and prefixItems
# later): not read in a schema naming it. Where prefixItems is not read, an `items` array is (its form of a
# prefix), and only there.
_UNREAD = {"draft-03": ("const", "contains", "exclusiveMinimum", "exclusiveMaximum", "minContains", "maxContains",
                        "prefixItems", "if", "dependentRequired"),
           "draft-04": ("const", "contains", "exclusiveMinimum", "exclusiveMaximum", "minContains", "maxContains",
                        "prefixItems", "if", "dependentRequired"),
           "draft-06": ("minContains", "maxContains", "prefixItems", "if", "dependentRequired"),
           "draft-07": ("minContains", "maxContains", "prefixItems", "dependentRequired"), "2019-09": ("prefixItems",)}
# Those of them a backend would enforce: dropped (the others, which no backend enforces, stay as written).
_DROPPED = frozenset({"const", "contains", "minContains", "maxContains", "prefixItems"})


class _CannotMerge(Exception):
    """Two schemas whose conjunction this module cannot write as one schema."""


class _Unsatisfiable(_CannotMerge):
    """Two schemas no value satisfies both of: their conjunction is `false` (a _CannotMerge where the caller
    cannot write `false` in its place)."""


# The notes a refusal names in full: past them, the first ones, how many were left out, and the last ones (the
# cause). A chain of `$ref`s each to the next is as long as the schema, and each note naming all of its causes
# made text quadratic in it.
NOTES_NAMED_FIRST = 4
NOTES_NAMED_LAST = 2


class _Note:
    """Why a node became `false`: its own text and the note of the part that made it so (a link, not a copy:
    each note is built in constant space whatever the length of the chain behind it)."""

    __slots__ = ("text", "cause")

    def __init__(self, text: str, cause: _Note | None):
        self.text, self.cause = text, cause

    def __str__(self) -> str:
        links: list[str] = []
        note: _Note | None = self
        while note is not None:
            links.append(note.text)
            note = note.cause
        if len(links) > NOTES_NAMED_FIRST + NOTES_NAMED_LAST:
            left_out = len(links) - NOTES_NAMED_FIRST - NOTES_NAMED_LAST
            links[NOTES_NAMED_FIRST:-NOTES_NAMED_LAST] = [f"... {left_out} more ..."]
        return "; ".join(links)


class _ProbeTooDeep(Exception):
    """A `$ref` target normalised only to learn whether it is `false` nests past MAX_DEPTH where it was reached:
    the `$ref` stays (as written), where a refusal would refuse a schema that normalises fine without the look."""


def normalise_schema(schema: Any, budget: int | None = None) -> Any:
    """A copy of `schema` in shapes xgrammar compiles right (the same schema where nothing applies).

    RequestTooLargeError past `budget` nodes produced (default: node_budget(schema)) or MAX_DEPTH levels."""
    if not isinstance(schema, dict):
        return schema
    normaliser = _Normaliser(schema, not ref_siblings_ignored(schema),
                             node_budget(schema) if budget is None else budget)
    out = normaliser.node(schema)
    if out is False:
        raise InvalidGrammarError(f"json_schema matches nothing: {normaliser.notes['/']}; correct the part named "
                                  "last")
    # Merges share subtrees between places, so what json.dumps writes may be larger than what was built.
    if isinstance(out, dict):  # else the boolean schema an allOf of `false` merged into: nothing to measure
        _check_tree(out, normaliser.budget)
    return out


def ref_siblings_ignored(schema: Any) -> bool:
    """Whether `schema` declares a draft in which the keywords beside a `$ref` are ignored."""
    return schema_draft(schema) in _DRAFTS_IGNORING_REF_SIBLINGS


# jsonschema's validator classes by the draft this module names them.
_DRAFT_OF_VALIDATOR = {"Draft3Validator": "draft-03", "Draft4Validator": "draft-04", "Draft6Validator": "draft-06",
                       "Draft7Validator": "draft-07", "Draft201909Validator": "2019-09"}


def schema_draft(schema: Any) -> str:
    """The draft `schema` is read in, exactly as the output check reads it (jsonschema's validator_for: a
    draft's own meta-schema URL, with or without its empty fragment; anything else, e.g. https:// for a draft
    up to 7, or no `$schema`, is 2020-12). A draft found by a substring of the URL made this module drop
    keywords the output check then enforced."""
    from jsonschema import validators

    draft = schema.get("$schema") if isinstance(schema, dict) else None
    if not isinstance(draft, str):
        return "2020-12"
    found = validators.validator_for({"$schema": draft}, default=None)
    return _DRAFT_OF_VALIDATOR.get(getattr(found, "__name__", ""), "2020-12")


def node_budget(schema: Any) -> int:
    """The nodes normalising `schema` may produce."""
    return BASE_NODE_BUDGET + PER_INPUT_NODE * _count_nodes(schema)


def _count_nodes(value: Any) -> int:
    n, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            n += 1
            stack.extend(v.values())
        elif isinstance(v, list):
            n += 1
            stack.extend(v)
    return n


def _check_tree(root: Any, budget: int) -> None:
    """RequestTooLargeError if `root`, written out as a tree, has more than `budget` nodes or nests deeper than
    MAX_DEPTH (iterative, each shared subtree measured once)."""
    sizes: dict[int, tuple[int, int]] = {}  # id -> (nodes, depth)
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        v, children_done = stack.pop()
        if id(v) in sizes:
            continue
        children = list(v.values()) if isinstance(v, dict) else v
        if not children_done:
            stack.append((v, True))
            stack.extend((c, False) for c in children if isinstance(c, (dict, list)) and id(c) not in sizes)
            continue
        measured = [sizes[id(c)] for c in children if isinstance(c, (dict, list))]
        nodes = 1 + sum(m[0] for m in measured)
        depth = 1 + max((m[1] for m in measured), default=0)
        if nodes > budget:
            raise _too_large(f"normalising it would write more than {budget} schema nodes")
        if depth > MAX_DEPTH:
            raise _too_large(f"normalising it would nest deeper than {MAX_DEPTH} levels")
        sizes[id(v)] = (nodes, depth)


def _too_large(what: str, path: list[str] | None = None) -> RequestTooLargeError:
    at = f" (at {'/' + '/'.join(path) if path else 'the root'})" if path is not None else ""
    return RequestTooLargeError(
        f"json_schema is too complex to compile: {what}{at}; nested anyOf/oneOf beside other keywords and "
        "allOf of $refs multiply; simplify the schema")


class _Normaliser:
    def __init__(self, root: dict, ref_siblings: bool, budget: int):
        self.root = root
        self.ref_siblings = ref_siblings
        # 2019-09 split `dependencies` into dependentRequired and dependentSchemas: from there (and in a schema
        # naming no draft up to 7, read as 2020-12) it is no keyword.
        self.unread = frozenset(_UNREAD.get(schema_draft(root), ())) | ({"dependencies"} if ref_siblings else set())
        # Dropped, not only left unread: a merge would read them (a const beside the other part's enum), and
        # both backends enforce a const (a prefixItems) whatever the draft.
        self.dropped = self.unread & _DROPPED
        self.budget = budget
        self._produced = 0
        self._path: list[str] = []  # keywords (and names, indices) from the root to the node being worked on
        self._targets: dict[str, Any] = {}  # normalised $ref targets
        self._probe_targets: dict[str, Any] = {}  # those normalised inside a look (_ref_false)
        self._walked: dict[str, bool] = {}  # "#" + path -> whether the walk made the node there `false`
        self._target_notes: dict[str, _Note] = {}  # ref -> why its target became `false`
        self._expanding: set[str] = set()  # refs being normalised now: a ref back to one is a cycle
        self._cycles_cut = 0  # refs back to one being normalised met so far (each left as written there)
        # "#" + location -> a target normalised with no cycle cut: the node there, as the walk would write it
        self._whole: dict[str, Any] = {}
        # A `$ref` inside a resource with its own `$id` resolves against that resource, not against the root,
        # which is all _pointer reads (inlining the root's namesake wrote another schema than the output check
        # reads): such a `$ref`, and one whose target is in one, are not looked up (_looked_up).
        self.id_key = "id" if schema_draft(root) in ("draft-03", "draft-04") else "$id"
        self._resources = _embedded_resources(root, self.id_key)
        self._merged_from_resources = _merged_from(self._resources)
        self._bases: list[tuple[int, tuple[str, ...]]] = []  # (len(_path) at a target, the target's location)
        self._probing = 0  # nested $ref looks (_ref_false) under way
        self._in_target = 0  # targets being normalised where a `$ref` reached them (paths not the schema's own)
        self._unprobed: set[str] = set()  # refs whose look ran past MAX_DEPTH: left as written
        self.notes: dict[str, _Note] = {}  # path -> why the node there became `false` (the root's: always noted)

    def _here(self, *more: str) -> str:
        return "/" + "/".join([*self._path, *(m.replace("~", "~0").replace("/", "~1") for m in more)])

    def _false(self, why: str, cause: _Note | None = None) -> bool:
        """`false` for the node being worked on, noting why (and `cause`, the note of the part that made it so)."""
        here = self._here()
        self._last_note = self.notes[here] = _Note(f"at {'the root' if here == '/' else here}, {why}", cause)
        return False

    def _spend(self) -> None:
        self._produced += 1
        if self._produced > self.budget:
            raise _too_large(f"normalising it produced more than {self.budget} schema nodes", self._path)

    def _enter(self, part: str) -> None:
        if len(self._path) >= MAX_DEPTH:
            self._too_deep()
        self._path.append(part)

    def _too_deep(self) -> None:
        if self._probing:
            raise _ProbeTooDeep
        raise _too_large(f"normalising it nests deeper than {MAX_DEPTH} levels", self._path)

    def _copy(self, value: Any, depth: int = 0) -> Any:
        """A deep copy, counted against the budget."""
        if not isinstance(value, (dict, list)):
            return value
        self._spend()
        if depth > MAX_DEPTH:
            self._too_deep()
        if isinstance(value, dict):
            return {k: self._copy(v, depth + 1) for k, v in value.items()}
        return [self._copy(v, depth + 1) for v in value]

    def node(self, schema: Any) -> Any:
        if not isinstance(schema, dict):
            return schema
        self._spend()
        return self._shape({k: self._children(k, v) for k, v in schema.items() if k not in self.dropped})

    def _shape(self, out: dict) -> Any:
        """One node (its children already normalised) in shapes xgrammar compiles right."""
        if "$ref" in out and self._ref_false(out["$ref"]):
            # Nothing satisfies its target, so nothing satisfies it (whatever sits beside it, in any draft): an
            # inline `false` (xgrammar refuses a `$ref` to `false`, so the whole schema, where the parent could
            # have done without it: an optional property, an anyOf branch, items of an array that may be empty).
            return self._false(f"its $ref {out['$ref']!r} accepts no value", self._target_notes.get(out["$ref"]))
        if "$ref" in out and not self.ref_siblings:
            return out  # the `$ref` replaces it: the keywords beside it neither constrain nor make it `false`
        if "if" not in self.unread and (isinstance(out.get("allOf"), list) and out["allOf"] or "if" in out):
            self._last_note = None  # a note a merge below makes names why
            out = self._if_then_cases(out)
            if out is False:
                return self._false("no case of its if/then accepts a value", self._last_note)
        if isinstance(out.get("allOf"), list) and out["allOf"]:
            parts = [self._here("allOf", str(i)) for i in range(len(out["allOf"]))]
            try:
                out = self._merge_all_of(out)
            except _CannotMerge:
                pass  # left as it was: xgrammar's own approximation (its compile warning says so)
            if not isinstance(out, dict):
                # `{"allOf": [false]}`, or parts with no value in common: the schema `false`
                return self._false("its allOf parts have no value in common",
                                   next((self.notes[p] for p in parts if p in self.notes), None))
        for key in ("anyOf", "oneOf"):
            if isinstance(out.get(key), list) and out[key] and not ("anyOf" in out and "oneOf" in out):
                try:
                    out = self._distribute(out, key)
                except _CannotMerge:
                    pass  # left as it was
            if isinstance(out.get(key), list) and False in out[key]:
                # A branch that is `false` matches nothing (xgrammar refuses it): dropped.
                if not any(b is not False for b in out[key]):
                    return self._false(f"every branch of its {key} accepts no value",
                                       self.notes.get(self._here(key, "0")))
                out = {**out, key: [b for b in out[key] if b is not False]}
        found = _unsatisfiable(out, self.unread)
        if found is not None:
            why, part = found
            return self._false(why, self.notes.get(self._here(*part)) if part else None)
        out, why = _within_bounds(out, self.unread)
        if out is False:
            return self._false(why)
        if isinstance(out.get("oneOf"), list):
            out = _one_of_told_apart(out)
        if isinstance(out.get("pattern"), str) and ("minLength" in out or "maxLength" in out):
            out = _lengths_into_pattern(out)
        if isinstance(out.get("not"), dict) and set(out["not"]) == {"type"}:
            out = _not_type(out)
            if out is False:
                return self._false("its not excludes every type its type admits")
        if isinstance(out.get("required"), list):
            out = _required_listed(out, self.unread)
        if out.get("additionalProperties") is False and isinstance(out.get("properties"), dict) and \
                False in out["properties"].values() and not out.get("patternProperties"):
            out = _false_properties_unlisted(out)
        if isinstance(out.get("enum"), list) and "type" in out:
            kept = [v for v in out["enum"] if _has_type(v, out["type"])]
            if kept:  # else a type name that is no JSON type (known ones: `false` above): left as written
                out = {**out, "enum": kept}  # a new node: `out` may be a part another place holds
        return out

    def _children(self, key: str, value: Any) -> Any:
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            return {k: self._child(v, key, k) for k, v in value.items()}
        if key in _SUBSCHEMA_ONE:
            if key == "items" and isinstance(value, list):
                return [self._child(v, key, str(i)) for i, v in enumerate(value)]
            return self._child(value, key)
        if key in _SUBSCHEMA_LISTS and isinstance(value, list):
            return [self._child(v, key, str(i)) for i, v in enumerate(value)]
        return value

    def _child(self, schema: Any, *path: str) -> Any:
        """node(schema) with `path` (a keyword, then a name or an index) added to the path the budget names."""
        if not isinstance(schema, dict):
            return schema
        for part in path:
            self._enter(_escaped(part))
        try:
            reached = None if self._in_target or self._probing else self._whole.get("#" + self._here())
            # Normalised already through a `$ref` (not `false`: its note names the path it was reached by). Held
            # here and in _targets: no merge changes a node it is given, and _resolved inlines a copy.
            out = reached if reached is not None and reached is not False else self.node(schema)
            if not self._in_target:
                # Normalised where it is written (nothing being expanded): what a `$ref` to here asks
                self._walked["#" + self._here()] = out is False
            return out
        finally:
            del self._path[len(self._path) - len(path):]

    # ------------------------------------------------------------------ allOf / anyOf / oneOf

    def _merge_all_of(self, node: dict) -> dict:
        merged = {k: v for k, v in node.items() if k != "allOf"}
        for i, part in enumerate(node["allOf"]):
            self._enter("allOf")
            self._enter(str(i))
            try:
                merged = self.merge(merged, self._resolved(part, ()))
            finally:
                del self._path[-2:]
        # The merge may have brought an anyOf/oneOf in: it is distributed by the caller.
        return merged

    def _distribute(self, node: dict, key: str) -> dict:
        siblings = {k: v for k, v in node.items() if k != key and k not in _ANNOTATIONS}
        if not siblings:
            return node
        branches = []
        for i, b in enumerate(node[key]):
            self._enter(key)
            self._enter(str(i))
            try:
                merged = self.merge(self._copy(siblings), self._resolved(b, ()))
                branches.append(self._shape(merged) if isinstance(merged, dict) else merged)
            finally:
                del self._path[-2:]
        out = {k: v for k, v in node.items() if k in _ANNOTATIONS}
        out[key] = branches
        return out

    def _if_then_cases(self, node: dict) -> dict:
        """`if`/`then`/`else` on one discriminator property as an `anyOf` of its values' cases (module docstring)."""
        parts = node.get("allOf", [])
        own = [{k: node[k] for k in ("if", "then", "else") if k in node}] if "if" in node else []
        conditionals = [p for p in parts + own if _conditional_on(p) is not None] if isinstance(parts, list) else []
        if not conditionals or "anyOf" in node or "oneOf" in node:
            return node
        base = {k: v for k, v in node.items() if k != "allOf" and not (own and k in own[0] and own[0] in conditionals)}
        rest = [p for p in parts if _conditional_on(p) is None]
        names = {_conditional_on(c) for c in conditionals}
        try:
            merged = self._merge_all_of({**base, "allOf": rest}) if rest else base
            name = names.pop()
            props = merged.get("properties") if isinstance(merged, dict) else None
            values = _values_of(props.get(name)) if isinstance(props, dict) else None
            if names or not values or merged.get("type") != "object" or "anyOf" in merged or \
                    "oneOf" in merged or not isinstance(merged.get("required"), list) or name not in merged["required"]:
                return node
            # One branch per set of values that the same `then`/`else` schemas apply to.
            cases: dict[tuple, list] = {}
            for v in values:
                applied = tuple(_holds(c["if"], name, v) for c in conditionals)
                cases.setdefault(applied, []).append(v)
            notes = {k: v for k, v in merged.items() if k in _ANNOTATIONS}  # $defs among them: once, at the node
            own_keywords = {k: v for k, v in merged.items() if k not in _ANNOTATIONS}
            branches = []
            for applied, vs in cases.items():
                branch: Any = {"properties": {name: {"enum": vs}}}
                for c, holds in zip(conditionals, applied):
                    branch = self.merge(branch, c.get("then" if holds else "else", True))
                # Each branch whole (the node's own keywords merged in): an anyOf left beside keywords its
                # branches contradict would lose them to xgrammar, which drops what sits beside an anyOf.
                whole = self.merge(self._copy(own_keywords), branch)
                branches.append(self._shape(whole) if isinstance(whole, dict) else whole)
            if len(branches) == 1:
                return {**branches[0], **notes} if isinstance(branches[0], dict) else branches[0]
            return {**notes, "anyOf": branches}
        except _CannotMerge:
            return node  # left as it was: the allOf merge below, and xgrammar ignores `if`

    def _resolved(self, schema: Any, seen: tuple[str, ...]) -> Any:
        """`schema` with a top-level local `$ref` replaced by its (normalised) target."""
        if not isinstance(schema, dict) or "$ref" not in schema:
            return schema
        ref = schema["$ref"]
        if isinstance(ref, str) and ref in self._expanding:
            self._cycles_cut += 1
        if not isinstance(ref, str) or not ref.startswith("#") or ref in seen or ref in self._expanding or \
                not self._looked_up(ref):
            raise _CannotMerge(f"$ref {ref!r}")  # remote, a cycle, or another resource's: not inlined
        target = self._resolved(self._copy(self._target(ref)), seen + (ref,))
        if not self.ref_siblings:
            return target
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return self.merge(self._copy(target), rest) if rest else target

    def _target(self, ref: str) -> Any:
        """The normalised target of local `ref`, normalised once (where it is first reached: the path names it
        through the `$ref`); _CannotMerge where it points nowhere. A look (_ref_false) keeps its own: a target
        normalised inside one may have `$ref`s to those being expanded left as written, which _resolved would
        have inlined where it reached them; one where none was (no cycle cut) is the same target, kept for both
        (normalising it twice spent the budget twice)."""
        if ref in self._targets:
            return self._targets[ref]
        targets = self._probe_targets if self._probing else self._targets
        if ref not in targets:
            written, location = _walk(self.root, ref)
            cut = self._cycles_cut
            self._expanding.add(ref)
            self._enter(ref)
            self._in_target += 1
            self._bases.append((len(self._path), location))
            try:
                target = self.node(written)
                if target is False and self._here() in self.notes:
                    self._target_notes[ref] = self.notes[self._here()]
                targets[ref] = target
                if self._cycles_cut == cut:
                    self._targets[ref] = target
                    self._whole["#" + "/".join(("", *(_escaped(k) for k in location)))] = target
            finally:
                self._bases.pop()
                self._expanding.discard(ref)
                self._in_target -= 1
                self._path.pop()
        return targets[ref]

    def _looked_up(self, ref: str) -> bool:
        """Whether local `ref`, on the node being worked on, is read against the root: neither it nor its target
        is in an embedded resource, nor where one's keywords may have been merged in (_merged_from). A `$ref` is
        placed by the path: where a target is being normalised, the target's location and the path below it.
        A merge brings in keywords of the node's allOf/anyOf/oneOf parts and of the targets it inlines: a part's
        `$ref` is then read at the node (hence _merged_from), a target's where the target is (its location is
        checked as the target's). Where it points nowhere it is looked up (and found nowhere)."""
        if not self._resources:
            return True
        if self._bases:
            n, base = self._bases[-1]
            here = base + tuple(_unescaped(p) for p in self._path[n:])
        else:
            here = tuple(_unescaped(p) for p in self._path)
        try:
            target = _location(self.root, ref)
        except _CannotMerge:
            return True
        return not any(at[:i] in self._resources for at in (here, target) for i in range(len(at) + 1)) and \
            not any(at in self._merged_from_resources for at in (*_merged_into(here), target))

    def _ref_false(self, ref: Any) -> bool:
        """Whether local `ref`'s target normalises to `false` (False where that is not known: a remote or
        plain-name ref, one pointing nowhere, a cycle, another resource's, a look past MAX_DEPTH)."""
        if isinstance(ref, str) and ref in self._expanding:
            self._cycles_cut += 1
        if not isinstance(ref, str) or not ref.startswith("#") or ref in self._expanding or ref in self._unprobed \
                or not self._looked_up(ref):
            return False
        at = _fragment(ref)
        if at is None:
            return False  # a plain name: not looked up
        if at in self._walked:  # (its note, if any, is where the walk made it `false`)
            if (at[1:] or "/") in self.notes:
                self._target_notes.setdefault(ref, self.notes[at[1:] or "/"])
            return self._walked[at]
        for targets in (self._targets, self._probe_targets):
            if ref in targets:
                return targets[ref] is False
        self._probing += 1
        try:
            return self._target(ref) is False
        except _CannotMerge:
            return False  # it points nowhere (or past a scalar): the output check's error, not a `false`
        except _ProbeTooDeep:
            self._unprobed.add(ref)  # reached this deep, it is not looked at again
            return False
        finally:
            self._probing -= 1

    # ------------------------------------------------------------------ merge

    def merge(self, a: Any, b: Any) -> Any:
        """One schema meaning `a` and `b` (raises _CannotMerge where that cannot be written exactly)."""
        if b is True or b == {}:
            return a
        if a is True or a == {}:
            return b
        if a is False or b is False:
            return False  # nothing satisfies `false`, nor its conjunction with anything
        if not isinstance(a, dict) or not isinstance(b, dict):
            raise _CannotMerge("not a schema")
        a, b = self._resolved(a, ()), self._resolved(b, ())
        if not isinstance(a, dict) or not isinstance(b, dict):
            return self.merge(a, b)  # a `$ref` to `true` or `false`: merged as that schema
        if self._resources and (_base_of(a, self.id_key) or _base_of(b, self.id_key)):
            # One part's keywords would go under the other's base, or its id onto the merged node.
            raise _CannotMerge("an embedded resource (its own $id)")
        if "allOf" in a or "allOf" in b:
            raise _CannotMerge("an allOf that could not be merged itself")  # parts arrive normalised
        # A part's minContains/maxContains count its own `contains` items (none: they say nothing), never the
        # other part's: a merged node would apply them to those.
        a, b = ({k: v for k, v in p.items() if "contains" in p or k not in ("minContains", "maxContains")}
                for p in (a, b))
        # A part's items past its prefix (2020-12's items beside prefixItems; additionalItems beside an items
        # array) govern the elements past its own prefix only: beside the other part's prefix they would govern
        # fewer elements (looser), and the other part's would start applying past this part's (narrower).
        prefix_key, rest_key = ("items", "additionalItems") if "prefixItems" in self.unread else \
            ("prefixItems", "items")
        for p, q in ((a, b), (b, a)):
            if isinstance(p.get(prefix_key), list) and rest_key in q and \
                    json_key(p[prefix_key]) != json_key(q.get(prefix_key)):
                raise _CannotMerge(f"one part's {prefix_key} beside the other part's {rest_key}")
        if "exclusiveMinimum" in self.unread:
            # Draft 4's exclusiveMinimum is a flag on its own part's minimum: beside the other part's minimum (or
            # flag) a merged node would put it on that bound, or the tighter bound would lose its flag.
            for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
                pair_a, pair_b = ((p.get(bound), p.get(flag)) for p in (a, b))
                if (flag in a and (bound in b or flag in b) or flag in b and (bound in a or flag in a)) and \
                        json_key(pair_a) != json_key(pair_b):
                    raise _CannotMerge(f"draft 4's {flag} beside the other part's {bound}")
        self._spend()
        out = dict(a)
        try:
            for key, bv in b.items():
                if key not in out:
                    out[key] = bv
                elif json_key(out[key]) == json_key(bv) or key in _ANNOTATIONS or key in _IGNORED_BY_XGRAMMAR:
                    continue
                else:
                    out[key] = self._merge_keyword(key, out[key], bv)
            _apply_additional_properties(out, a, b, self.merge)
        except _Unsatisfiable as e:
            return self._false(str(e))
        if "const" in out and isinstance(out.get("enum"), list):
            if json_key(out["const"]) not in {json_key(v) for v in out["enum"]}:
                return self._false(f"its const {out['const']!r} is not in its enum")
            del out["enum"]  # xgrammar enforces one of the two: the const alone says both
        return out

    def _merge_keyword(self, key: str, av: Any, bv: Any) -> Any:
        if key == "type":
            return _intersect_types(av, bv)
        if key == "const":
            raise _Unsatisfiable(f"its parts' consts {av!r} and {bv!r} differ")  # (equal ones are kept once)
        if key == "required" and isinstance(av, list) and isinstance(bv, list):
            return av + [k for k in bv if k not in av]
        if key in ("properties", "patternProperties") and isinstance(av, dict) and isinstance(bv, dict):
            out = dict(av)
            for name, schema in bv.items():
                if name in out:
                    self._enter(key)
                    self._enter(name)
                    try:
                        out[name] = self.merge(out[name], schema)
                    finally:
                        del self._path[-2:]
                else:
                    out[name] = schema
            return out
        # (Not two `contains`: an array may hold an item for each, and none that satisfies both.)
        if key in ("items", "additionalProperties", "propertyNames") and not isinstance(av, list) \
                and not isinstance(bv, list):
            self._enter(key)
            try:
                return self.merge(av, bv)
            finally:
                self._path.pop()
        if key in _LOWER_BOUNDS and _numbers(av, bv):
            return max(av, bv)
        if key in _UPPER_BOUNDS and _numbers(av, bv):
            return min(av, bv)
        if key == "exclusiveMinimum" and _numbers(av, bv):
            return max(av, bv)
        if key == "exclusiveMaximum" and _numbers(av, bv):
            return min(av, bv)
        if key == "enum" and isinstance(av, list) and isinstance(bv, list):
            in_b = {json_key(w) for w in bv}
            both = [v for v in av if json_key(v) in in_b]
            if not both:
                raise _Unsatisfiable("its parts' enums have no value in common")
            return both
        if key == "uniqueItems" and isinstance(av, bool) and isinstance(bv, bool):
            return av or bv
        raise _CannotMerge(f"two different {key!r}")


def _conditional_on(part: Any) -> str | None:
    """The property an `{if, then, else}` part is conditional on, where its `if` is only that property's
    `const`/`enum` (and that it is required); else None."""
    if not isinstance(part, dict) or "if" not in part or not set(part) <= {"if", "then", "else"}:
        return None
    cond = part["if"]
    props = cond.get("properties") if isinstance(cond, dict) else None
    if not isinstance(props, dict) or len(props) != 1 or not set(cond) <= {"properties", "required"}:
        return None
    (name, schema), = props.items()
    if cond.get("required", [name]) not in ([], [name]) or not isinstance(schema, dict) or len(schema) != 1 or \
            _values_of(schema) is None:
        return None
    return name


def _values_of(schema: Any) -> list | None:
    """The values a `const` or `enum` schema allows (None: not such a schema)."""
    if isinstance(schema, dict) and "const" in schema:
        return [schema["const"]]
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list):
        return schema["enum"]
    return None


def _holds(cond: dict, name: str, value: Any) -> bool:
    return json_key(value) in {json_key(v) for v in _values_of(cond["properties"][name])}


def _one_of_told_apart(node: dict) -> dict:
    """`oneOf` branches told apart by one property's values, that property required in each (module docstring)."""
    branches = node["oneOf"]
    if len(branches) < 2 or not all(isinstance(b, dict) and b.get("type") == "object" and
                                     isinstance(b.get("properties"), dict) and
                                     isinstance(b.get("required", []), list) for b in branches):
        return node
    for name in branches[0]["properties"]:
        values = [_values_of(b["properties"].get(name)) for b in branches]
        if any(v is None for v in values):
            continue
        keys = [{json_key(v) for v in vs} for vs in values]
        if sum(len(k) for k in keys) != len(set().union(*keys)):
            continue  # two branches share a value
        out = dict(node)
        out["oneOf"] = [b if name in b.get("required", []) else {**b, "required": [*b.get("required", []), name]}
                        for b in branches]
        return out
    return _closed_branches_told_apart(node)


def _closed_branches_told_apart(node: dict) -> dict:
    """Closed object branches no name of which is another's: the one document two may share is `{}`, invalid
    where two accept it, so each that may (nothing it requires says otherwise) gets `minProperties: 1`: exact, or
    narrower where a branch rejects `{}` for another reason (a `const`, say)."""
    branches = node["oneOf"]
    if not all(b.get("additionalProperties") is False and not b.get("patternProperties") for b in branches):
        return node
    names = [set(b["properties"]) for b in branches]
    if sum(len(n) for n in names) != len(set().union(*names)):
        return node
    empty_ok = [i for i, b in enumerate(branches) if not b.get("required") and
                not (_numbers(b.get("minProperties")) and b["minProperties"] >= 1)]
    if len(empty_ok) < 2:
        return node
    out = dict(node)
    out["oneOf"] = [{**b, "minProperties": 1} if i in empty_ok else b for i, b in enumerate(branches)]
    return out


def _not_type(node: dict) -> dict:
    """`not: {type: T}` as the types other than T (intersected with the node's own)."""
    excluded = set(_types(node["not"]["type"]))
    if "integer" in excluded and "number" not in excluded and ("type" not in node or "number" in _types(node["type"])):
        return node  # non-integral numbers stay, and no type names them: left as written
    if "number" in excluded or "integer" in excluded:
        excluded |= {"number", "integer"}
    remaining = [t for t in ("object", "array", "string", "number", "integer", "boolean", "null") if t not in excluded]
    if "number" in remaining:
        remaining.remove("integer")  # number already admits every integer
    try:
        types = _intersect_types(node["type"], remaining) if "type" in node else remaining
    except _Unsatisfiable:
        return False  # no type left
    except _CannotMerge:
        return node  # a name that is no JSON type: left as written
    out = {k: v for k, v in node.items() if k != "not"}
    out["type"] = types
    return out


def _unsatisfiable(node: dict, unread: frozenset) -> tuple[str, tuple[str, ...]] | None:
    """Why no value satisfies `node` (its keywords final), with the path of the part that makes it so (empty: the
    node's own keywords); None where some value may. Only what is certain: an object's required property or an
    array's items matter only where the node's type is that type alone (other types ignore those keywords; where
    it admits others, _within_bounds drops the type, and it finds a const not of the node's type)."""
    types = _types(node.get("type"))
    known = bool(types) and set(types) <= _TYPE_NAMES
    enum = node.get("enum")
    if enum == []:
        return "its enum lists no value", ()
    if known and isinstance(enum, list) and not any(_has_type(v, types) for v in enum):
        return f"none of its enum values is of its type {node['type']!r}", ()
    if types == ["object"]:
        return _false_required(node)
    if types == ["array"]:
        return _false_items(node, unread)
    return None


def _false_required(node: dict) -> tuple[str, tuple[str, ...]] | None:
    """Why no object satisfies `node` (a required property that is `false`), with that property's path."""
    if isinstance(node.get("properties"), dict) and isinstance(node.get("required"), list):
        for name in node["required"]:
            if isinstance(name, str) and node["properties"].get(name) is False:
                return f"its required property {name!r} accepts no value", ("properties", name)
    return None


def _false_items(node: dict, unread: frozenset) -> tuple[str, tuple[str, ...]] | None:
    """Why no array satisfies `node` (items that are `false` where minItems asks for some), with their path. The
    prefix is the draft's: `prefixItems` from 2020-12, an `items` array before (the other form is not read)."""
    min_items = node.get("minItems")  # none: 0, which no rule below applies to
    if not _numbers(min_items):
        return None
    key = "items" if "prefixItems" in unread else "prefixItems"
    prefix = node.get(key) if isinstance(node.get(key), list) else []
    # 2020-12: items beside prefixItems governs the elements past them only (a closed tuple).
    if node.get("items") is False and min_items > (len(prefix) if key == "prefixItems" else 0):
        return f"its items accept no value and its minItems is {min_items}", ("items",)
    # `is`, not `in`/index: 0 == False in Python
    i = next((i for i, v in enumerate(prefix) if v is False), None)
    if i is not None and i < min_items:
        return f"its {key} item {i} accepts no value and its minItems is {min_items}", (key, str(i))
    return None


def _within_bounds(node: dict, unread: frozenset) -> tuple[Any, str]:
    """`node` without the types its own bounds leave no value of, and without the `enum` values they reject;
    `false` (with why) where nothing is left. Only bounds read as the output check reads them (`unread`: those
    the schema's draft does not have), and only where certain: `node` as it was otherwise."""
    types = _types(node.get("type"))
    if "type" in node and not (types and set(types) <= _TYPE_NAMES):
        return node, ""  # a type JSON does not have (or none named): not ours to read
    empty = _empty_types(node, unread)
    admitted = types or _ANY_TYPE
    left = [t for t in admitted if t not in empty]
    if not left:
        return False, " and ".join(dict.fromkeys(empty[t] for t in admitted))
    const = "const" in node and "const" not in unread
    values = [node["const"]] if const else node["enum"] if isinstance(node.get("enum"), list) else []
    whys = [_excluded(v, node, empty, unread) for v in values]
    if whys and None not in whys:
        return False, (f"its const {whys[0]}" if const else
                       f"none of its enum values is of its type and within its bounds ({'; '.join(whys[:3])})")
    out = node
    if left != admitted:
        gone = {_kind(t) for t in admitted} - {_kind(t) for t in left}
        out = {k: v for k, v in node.items() if not any(k in _TYPE_KEYWORDS[g] for g in gone)}
        out["type"] = left[0] if len(left) == 1 else left
    if not const and any(whys):
        out = {**out, "enum": [v for v, why in zip(values, whys) if why is None]}
    return out, ""


def _excluded(value: Any, node: dict, empty: dict[str, str], unread: frozenset) -> str | None:
    """Why `value` does not satisfy `node`'s type and bounds, in words; None where it may."""
    for t, why in empty.items():
        if _has_type(value, [t]):
            return f"{value!r} is of type {t}, and {why}"
    if not _has_type(value, node.get("type")):
        return f"{value!r} is not of its type {node['type']!r}"
    return _violation(value, node, unread)


def _kind(json_type: str) -> str:
    return "number" if json_type == "integer" else json_type


def _empty_types(node: dict, unread: frozenset) -> dict[str, str]:
    """The types (of _TYPE_KEYWORDS', and integer) whose values `node`'s own bounds leave none of, each with why."""
    empty = {}
    why = _no_count(node, "minLength", "maxLength") or _no_pattern_length(node)
    if why:
        empty["string"] = why
    no_number, no_integer = _no_number(node, unread)
    if no_number:
        empty["number"] = empty["integer"] = no_number
    elif no_integer:
        empty["integer"] = no_integer
    why = _no_array(node, unread)
    if why:
        empty["array"] = why
    why = _no_object_counts(node)
    if why:
        empty["object"] = why
    return empty


def _finite(*values) -> bool:
    """Numbers, none infinite nor NaN (a bound that is not one is not read: never narrower for it)."""
    return all(_numbers(v) and (isinstance(v, int) or math.isfinite(v)) for v in values)


def _no_count(node: dict, lo_key: str, hi_key: str, need: int = 0, needed: str = "") -> str | None:
    """Why no count (a string's characters, an array's items, an object's properties) is within `node`'s lo_key
    and hi_key and at least `need` (which `needed` names); None where one may be."""
    lo, hi = node.get(lo_key), node.get(hi_key)
    if not _finite(hi):
        return None
    if _finite(lo) and lo > hi:
        return f"its {lo_key} {lo!r} is greater than its {hi_key} {hi!r}"
    if hi < 0:
        return f"its {hi_key} {hi!r} is negative"
    if need > hi:
        return f"its {hi_key} {hi!r} is less than {needed}"
    if _finite(lo) and math.ceil(lo) > hi:
        return f"no whole number is within its {lo_key} {lo!r} and its {hi_key} {hi!r}"
    return None


def _no_pattern_length(node: dict) -> str | None:
    """Why no string within `node`'s maxLength matches its pattern, one atom repeated at least n times (anchored
    or not: a match has n characters at least; the most it allows is not read, as Python's `$` also takes a
    string's last newline)."""
    pattern, most = node.get("pattern"), node.get("maxLength")
    m = REPEATED_ATOM.match(pattern) if isinstance(pattern, str) else None
    if m is None or not _finite(most) or _least_repeats(m) <= most:
        return None
    return f"its pattern {pattern!r} matches no string of fewer than {_least_repeats(m)} characters, and its " \
        f"maxLength is {most!r}"


def _no_number(node: dict, unread: frozenset) -> tuple[str | None, str | None]:
    """Why no number, and why no integer, is within `node`'s minimum/maximum (exclusive or not) and, where it
    is a whole number, a multiple of its multipleOf (a fractional one is not read: never narrower for it)."""
    lo = _tightest(node, "minimum", "exclusiveMinimum", max, unread)
    hi = _tightest(node, "maximum", "exclusiveMaximum", min, unread)
    if lo is None or hi is None:
        return None, None
    (lo_v, lo_open, lo_key), (hi_v, hi_open, hi_key) = lo, hi
    if lo_v > hi_v:
        return (f"its {lo_key} {lo_v!r} is greater than its {hi_key} {hi_v!r}",) * 2
    if lo_v == hi_v and (lo_open or hi_open):
        return (f"its {lo_key} {lo_v!r} equals its {hi_key} {hi_v!r}",) * 2
    between = f"within its {lo_key} {lo_v!r} and its {hi_key} {hi_v!r}"
    step = node.get("multipleOf")
    if isinstance(step, int) and not isinstance(step, bool) and step > 0:
        # Its multiples are integers: no number beside them.
        return (None, None) if _multiple_within(step, lo, hi) else \
            (f"no multiple of its multipleOf {step!r} is {between}",) * 2
    return None, None if _multiple_within(1, lo, hi) else f"no integer is {between}"


def _tightest(node: dict, inclusive: str, exclusive: str, pick, unread: frozenset) -> tuple | None:
    """(bound, exclusive?, keyword) of the tighter of `node`'s two bounds on one side (max or min: `pick`), the
    exclusive one where they are equal; None where neither is a finite number."""
    found = [(node[k], k == exclusive, k) for k in (inclusive, exclusive)
             if k not in unread and _finite(node.get(k))]
    if not found:
        return None
    tighter = pick(v for v, _, _ in found)
    return max(f for f in found if f[0] == tighter)  # of two equal bounds, the exclusive one (True > False)


def _multiple_within(step: int, lo: tuple, hi: tuple) -> bool:
    """Whether a multiple of `step` lies within the bounds (exact: fractions, not floats)."""
    q = Fraction(lo[0]) / step
    first = (math.floor(q) + 1 if lo[1] else math.ceil(q)) * step
    return first < hi[0] or first == hi[0] and not hi[1]


def _no_array(node: dict, unread: frozenset) -> str | None:
    """Why no array satisfies `node`'s item counts (minItems, maxItems, and those `contains` needs)."""
    need, needed = 0, ""
    least = node.get("minContains", 1) if "minContains" not in unread else 1
    # (A minContains that is no finite number: the contains rules are not applied.)
    if "contains" in node and "contains" not in unread and _finite(least):
        need, needed = math.ceil(least), f"its minContains {least!r}" if "minContains" in node else \
            "the item its contains needs"
        if node["contains"] is False and need >= 1:
            return "its contains accepts no item"
        most = node.get("maxContains")
        if "maxContains" not in unread and _finite(most) and most < need:
            return f"its maxContains {most!r} is less than {needed}"
    found = _false_items(node, unread)
    return found[0] if found else _no_count(node, "minItems", "maxItems", need, needed)


def _no_object_counts(node: dict) -> str | None:
    """Why no object satisfies `node`'s property counts and names: minProperties, maxProperties, the names it
    requires, and those `additionalProperties: false` leaves it."""
    required = list(dict.fromkeys(n for n in node["required"] if isinstance(n, str))) \
        if isinstance(node.get("required"), list) else []
    why = _no_count(node, "minProperties", "maxProperties", len(required),
                    f"the number of properties it requires ({len(required)})")
    found = _false_required(node)
    props = node.get("properties", {})
    if why or found or node.get("additionalProperties") is not False or not isinstance(props, dict):
        return why or (found[0] if found else None)
    patterns = node.get("patternProperties", {})
    allowed = [n for n, s in props.items() if s is not False]
    for name in required:
        if name not in allowed and not _may_match(patterns, name):
            return f"its required property {name!r} is one its additionalProperties false forbids"
    least = node.get("minProperties")
    if not patterns and _finite(least) and least > len(allowed):
        return f"its minProperties {least!r} is more than the number of properties it allows ({len(allowed)})"
    return None


def _violation(value: Any, node: dict, unread: frozenset) -> str | None:
    """Which of `node`'s own bounds `value` breaks, in words (the first; the check the output check makes);
    None where it breaks none of those."""
    if isinstance(value, (str, list, dict)):
        count, lo_key, hi_key = {str: ("characters", "minLength", "maxLength"), list: ("items", "minItems", "maxItems"),
                                 dict: ("properties", "minProperties", "maxProperties")}[type(value)]
        lo, hi = node.get(lo_key), node.get(hi_key)
        if _numbers(lo) and len(value) < lo:
            return f"{value!r} has fewer {count} than its {lo_key} {lo!r}"
        if _numbers(hi) and len(value) > hi:
            return f"{value!r} has more {count} than its {hi_key} {hi!r}"
        required = node.get("required")
        if isinstance(value, dict) and isinstance(required, list):
            missing = next((n for n in required if isinstance(n, str) and n not in value), None)
            if missing is not None:
                return f"{value!r} lacks its required property {missing!r}"
        return None
    if not _numbers(value):
        return None
    for key, breaks, says in (("minimum", lambda b: value < b, "below"), ("maximum", lambda b: value > b, "above"),
                              ("exclusiveMinimum", lambda b: value <= b, "not above"),
                              ("exclusiveMaximum", lambda b: value >= b, "not below")):
        bound = node.get(key)
        if key not in unread and _numbers(bound) and breaks(bound):
            return f"{value!r} is {says} its {key} {bound!r}"
    step = node.get("multipleOf")
    if isinstance(step, int) and not isinstance(step, bool) and step > 0 and value % step:
        return f"{value!r} is not a multiple of its multipleOf {step!r}"
    return None


def _required_listed(node: dict, unread: frozenset) -> dict:
    """Every required name (with what its dependencies require, in the keyword of the schema's draft) listed in
    `properties`."""
    required = [k for k in node["required"] if isinstance(k, str)]
    for key in ("dependencies", "dependentRequired"):
        deps = node.get(key) if key not in unread else None
        if not isinstance(deps, dict):
            continue
        for name in required:  # grows while it is walked: dependencies of dependencies
            more = deps.get(name)
            if isinstance(more, list):
                required += [d for d in more if isinstance(d, str) and d not in required]
    props = node.get("properties", {})
    extra = node.get("additionalProperties", True)
    if not isinstance(props, dict) or "patternProperties" in node or extra is False:
        missing = []  # a pattern may govern them, or nothing may (or `properties` is no map): left as written
    else:
        missing = [k for k in required if k not in props]
    if required == node["required"] and not missing:
        return node
    out = dict(node)
    out["required"] = required
    if missing:
        out["properties"] = {**props, **{k: ({} if extra is True else extra) for k in missing}}
    return out


def _false_properties_unlisted(node: dict) -> dict:
    """A property whose schema is `false` on a closed object, not required: unlisted, forbidden all the same."""
    required = node.get("required") if isinstance(node.get("required"), list) else []
    props = {k: v for k, v in node["properties"].items() if v is not False or k in required}
    return {**node, "properties": props}


# What only an object's value is checked against: moot on a node no object satisfies.
_OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties", "minProperties",
                    "maxProperties", "propertyNames", "dependencies", "dependentRequired", "dependentSchemas",
                    "unevaluatedProperties")
# What an untyped node admits (integer is within number), and every JSON value but an object.
_ANY_TYPE = ["array", "boolean", "null", "number", "object", "string"]
_NOT_OBJECT = [t for t in _ANY_TYPE if t != "object"]
# What only values of one type are checked against (integer's are number's): moot on a node that no longer
# admits that type.
_TYPE_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "additionalItems", "contains", "minContains", "maxContains", "minItems",
              "maxItems", "uniqueItems", "unevaluatedItems"),
    "object": _OBJECT_KEYWORDS,
}


def _no_object(out: dict, why: str) -> None:
    """`out` (a merged node) satisfied by no object: unsatisfiable where it must be an object; otherwise its type
    narrowed to what else it admits, its object keywords dropped (moot). Left as written, an untyped one
    compiled as if the allOf were not there (xgrammar reads properties as the object's)."""
    types = _types(out.get("type"))
    if types and not set(types) <= _TYPE_NAMES:
        raise _CannotMerge(why)  # a type name JSON does not have: not ours to read
    rest = [t for t in types if t != "object"] if types else _NOT_OBJECT
    if not rest:
        raise _Unsatisfiable(why)
    for key in _OBJECT_KEYWORDS:
        out.pop(key, None)
    out["type"] = rest[0] if len(rest) == 1 else rest


def _apply_additional_properties(out: dict, a: dict, b: dict, merge) -> None:
    """Each part's `additionalProperties` also governs the other part's properties (allOf semantics)."""
    for part, other in ((a, b), (b, a)):
        extra = part.get("additionalProperties", True)
        if extra is True:
            continue
        patterns = part.get("patternProperties", {})
        theirs = other.get("patternProperties")
        merged = out.get("patternProperties")
        if isinstance(theirs, dict) and isinstance(merged, dict):
            # A name the other part's pattern admits is one of this part's additional properties too (unless
            # this part lists it, or its own pattern admits it).
            fresh = [q for q in theirs if not isinstance(patterns, dict) or q not in patterns]
            if fresh:
                merged = out["patternProperties"] = dict(merged)
                for q in fresh:
                    if extra is not False:
                        merged[q] = merge(merged[q], extra)  # the pattern's schema meets it (narrower for those)
                        if merged[q] is False:  # exact, but xgrammar refuses a `false` pattern
                            raise _CannotMerge("a pattern's schema and the other part's additionalProperties")
                    elif patterns or any(_may_match({q: {}}, n) for n in _names(part.get("properties"))):
                        # A name this part lists or admits may match it: forbidding the pattern would forbid
                        # it (xgrammar refuses a `false` pattern anyway), keeping it would let the others past.
                        raise _CannotMerge("patternProperties beside the other part's additionalProperties")
                    else:
                        del merged[q]  # every name it admits is forbidden: additionalProperties false says so
        required = out.get("required", [])
        own = _names(part.get("properties"))
        if extra is False and isinstance(required, list) and any(
                isinstance(n, str) and n not in own and not _may_match(patterns, n) for n in required):
            _no_object(out, "a property one part requires the other forbids")
            return
    props = out.get("properties")
    if not isinstance(props, dict):
        return
    props = out["properties"] = dict(props)  # possibly a part's own dict: the parts stay as they were
    for part in (a, b):
        extra = part.get("additionalProperties", True)
        if extra is True:
            continue
        own = _names(part.get("properties"))
        patterns = part.get("patternProperties", {})
        for name in [n for n in props if n not in own and not _may_match(patterns, n)]:
            if extra is False:
                # A required one raised in the loop above: `required` as a list names it there.
                del props[name]
            else:
                props[name] = merge(props[name], extra)


def json_key(value: Any) -> Any:
    """A hashable key equal for values JSON calls equal: true is not 1, false is not 0 (where Python's equality
    says they are), 1 and 1.0 are one number. Keys, not pairwise comparisons, so an enum intersection is linear."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return type(value).__name__, value
    if isinstance(value, (int, float)):
        return "number", value  # 1 == 1.0, with one hash
    if isinstance(value, list):
        return "array", tuple(json_key(v) for v in value)
    if isinstance(value, dict):
        return "object", frozenset((k, json_key(v)) for k, v in value.items())
    return "other", repr(value)


_REGEX_SYNTAX = re.compile(r"[\\.^$*+?()\[\]{}|]")


def literal_of(pattern: str) -> str | None:
    """The text a pattern without regex syntax stands for, its anchors aside (None for any other pattern)."""
    literal = pattern.removeprefix("^").removesuffix("$")
    return None if _REGEX_SYNTAX.search(literal) else literal


def _names(properties: Any) -> dict:
    """A part's `properties` as a map (any other value, which names no property, as an empty one)."""
    return properties if isinstance(properties, dict) else {}


def _may_match(patterns: Any, name: str) -> bool:
    """Whether one of a part's `patternProperties` may govern `name` (then its `additionalProperties` does not).

    Literal patterns ("^x-", "^id$", "tag") are decided exactly; any other pattern is taken to match: running a
    schema's own regexes here, in the grammar service (llguidance's compiles are in process), would let one
    hostile pattern stall it. So a part with such a pattern admits the other part's names, as before.
    """
    if not isinstance(patterns, dict):
        return bool(patterns)
    for pattern in patterns:
        if not isinstance(pattern, str):
            return True
        literal = literal_of(pattern)
        if literal is None:
            return True
        if pattern.startswith("^") and pattern.endswith("$"):
            found = name == literal
        elif pattern.startswith("^"):
            found = name.startswith(literal)
        elif pattern.endswith("$"):
            found = name.endswith(literal)
        else:
            found = literal in name
        if found:
            return True
    return False


# A whole pattern that is one atom (a class, an escape like \d, or `.`) repeated.
REPEATED_ATOM = re.compile(r"^\^?(?P<atom>\[(?:\\.|[^\]\\])+\]|\\[dDwWsS]|\.)"
                            r"(?P<q>[+*]|\{(?P<lo>\d+)(?P<comma>,(?P<hi>\d*))?\})\$?$")


def _lengths_into_pattern(node: dict) -> dict:
    """`^A+$` with minLength m and maxLength n becomes `^A{m,n}$`: one character per atom, so exact."""
    m = REPEATED_ATOM.match(node["pattern"])
    lo, hi = node.get("minLength", 0), node.get("maxLength")
    if m is None or not _finite(lo) or (hi is not None and not _finite(hi)):
        return node  # (an infinite length is no whole number to write)
    q, q_lo = m["q"], _least_repeats(m)
    # Anchored at both ends, or a maxLength that leaves room for the fewest repeats only (a match is then the
    # whole string): `[ab]+` matches within "xa", which `^[ab]{1,3}$` would reject.
    anchored = node["pattern"].startswith("^") and node["pattern"].endswith("$")
    if not anchored and not (_finite(hi) and hi < q_lo + 1):
        return node
    q_hi = None if q in "+*" else (int(m["lo"]) if m["comma"] is None else (int(m["hi"]) if m["hi"] else None))
    # A length is whole: a fractional bound is the next whole one inside it (int() took minLength 2.5 as 2).
    lo = max(math.ceil(lo), q_lo)
    hi = q_hi if hi is None else math.floor(hi) if q_hi is None else min(math.floor(hi), q_hi)
    if hi is not None and hi < lo:
        return node  # unsatisfiable: left to xgrammar as written
    if max(lo, hi or 0) > MAX_PATTERN_REPEAT:
        return node  # a count no regex engine takes: xgrammar refused the pattern ("Integer is too large")
    out = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    out["pattern"] = f"^{m['atom']}{{{lo},{'' if hi is None else hi}}}$"
    return out


def _least_repeats(m: re.Match) -> int:
    """The fewest times a REPEATED_ATOM match's atom repeats: the fewest characters a string it matches has."""
    return 1 if m["q"] == "+" else 0 if m["q"] == "*" else int(m["lo"])


# Keywords whose values are data, not schemas: an `$id` in them is a value.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _base_of(node: dict, key: str) -> bool:
    """Whether `node` has an id (`key`) that changes the base its `$ref`s resolve against (a plain name does not)."""
    return isinstance(node.get(key), str) and not node[key].startswith("#")


def _embedded_resources(root: dict, key: str) -> frozenset[tuple[str, ...]]:
    """The locations (keys from the root) of the schemas below `root` with an id of their own that changes the
    base `$ref`s resolve against (`id` up to draft 4, `$id` after; a plain-name fragment `#a` changes none).
    Every object but data is looked at, names in a map of schemas excepted: never a base missed (the price: a
    stray `$id` leaves the `$ref`s in and to it as written)."""
    found = []
    stack: list[tuple[Any, bool, tuple[str, ...]]] = [(v, k in _SUBSCHEMA_MAPS or k == "dependencies", (k,))
                                                      for k, v in root.items() if k not in _DATA_KEYWORDS]
    while stack:
        value, names, at = stack.pop()
        if isinstance(value, list):
            stack.extend((v, False, (*at, str(i))) for i, v in enumerate(value))
        elif isinstance(value, dict):
            if names:
                stack.extend((v, False, (*at, k)) for k, v in value.items())
                continue
            if _base_of(value, key):
                found.append(at)
            stack.extend((v, k in _SUBSCHEMA_MAPS or k == "dependencies", (*at, k)) for k, v in value.items()
                         if k not in _DATA_KEYWORDS)
    return frozenset(found)


# Keywords whose subschemas a merge brings into their node (allOf merged, siblings distributed into anyOf/oneOf
# branches, then/else into the cases of an if).
_MERGED_IN = frozenset({"allOf", "anyOf", "oneOf", "if", "then", "else"})


def _merged_from(resources: frozenset[tuple[str, ...]]) -> frozenset[tuple[str, ...]]:
    """The locations a resource's keywords may be merged into: those above it through _MERGED_IN keywords
    (and their indices) only. A `$ref` read there may be the resource's."""
    out = set()
    for at in resources:
        i = len(at)
        while i > 0 and (at[i - 1] in _MERGED_IN or at[i - 1].isdigit()):
            i -= 1
            out.add(at[:i])
    return frozenset(out)


def _merged_into(at: tuple[str, ...]) -> list[tuple[str, ...]]:
    """`at` and the locations above it through _MERGED_IN keywords only: a merge works on a node's parts (a
    branch its siblings are distributed into) at the part's path."""
    out = [at]
    while at and (at[-1] in _MERGED_IN or at[-1].isdigit()):
        at = at[:-1]
        out.append(at)
    return out


def _escaped(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def _unescaped(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def _fragment(ref: str) -> str | None:
    """`ref` (a local one) as the JSON pointer it names, None where it names none (a plain name, an $anchor's or
    an $id's). Decided on the fragment as written, as the output check (jsonschema's referencing) decides:
    `#%2F%24defs%2Fx` is a plain name there (NoSuchAnchor), not the pointer it decodes to. A pointer is then
    percent-decoded before it is split at `/` (`%25` is `%`, not the name `a%25`)."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    return "#" + unquote(ref[1:])


# Digits past which an array index is past any array (and int() would refuse a long enough one).
_MAX_INDEX_DIGITS = 18


def _location(root: dict, ref: str) -> tuple[str, ...]:
    """The keys from the root to local `ref`'s target (an index as written without leading zeros)."""
    return _walk(root, ref)[1]


def _walk(root: dict, ref: str) -> tuple[Any, tuple[str, ...]]:
    """Local `ref`'s target as written, and its location; _CannotMerge where it points nowhere."""
    at = _fragment(ref)
    if at is None:
        raise _CannotMerge(f"$ref {ref!r} is a plain-name fragment")  # not looked up
    node: Any = root
    keys = []
    for raw in at[1:].split("/")[1:] if at != "#" else []:
        part = _unescaped(raw)
        if isinstance(node, dict) and part in node:
            node = node[part]
        # ASCII digits only: str.isdigit() takes "²", which int() refuses.
        elif isinstance(node, list) and part.isascii() and part.isdigit() and len(part) <= _MAX_INDEX_DIGITS \
                and int(part) < len(node):
            node = node[int(part)]
            part = str(int(part))
        else:
            raise _CannotMerge(f"$ref {ref!r} points nowhere")
        keys.append(part)
    return node, tuple(keys)


def _types(t: Any) -> list[str]:
    return [t] if isinstance(t, str) else list(t) if isinstance(t, list) else []


def _intersect_types(a: Any, b: Any) -> Any:
    ta, tb = _types(a), _types(b)
    out = [t for t in ta if t in tb]
    out += [t for t in ("integer",) if t not in out and ((t in ta and "number" in tb) or (t in tb and "number" in ta))]
    if not out and set(ta) <= _TYPE_NAMES and set(tb) <= _TYPE_NAMES and ta and tb:
        raise _Unsatisfiable(f"its parts' types {a!r} and {b!r} have no value in common")
    if not out:
        raise _CannotMerge("types with nothing in common")  # a name that is no JSON type among them
    return out[0] if len(out) == 1 else out


def _numbers(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _has_type(value: Any, declared: Any) -> bool:
    for t in _types(declared):
        if t in ("number", "integer"):
            if _numbers(value) and (t == "number" or float(value).is_integer()):
                return True
        elif t in _JSON_TYPES and isinstance(value, _JSON_TYPES[t]) and not (t != "boolean" and isinstance(value, bool)):
            return True
    return not _types(declared)
