"""How deep a JSON text nests, measured before anything recursive reads it.

Python's json module, the schema normaliser, xgrammar's schema reader and
jsonschema all recurse once (or more) per level: a short text nested a
thousand deep (`[[[[...`) would end in RecursionError, a bug's INTERNAL,
instead of a client error. Both services measure client JSON first (the
grammar service its specs and checked outputs, the inference service tool
schemas and the constraints it folds into tool grammars) and refuse past
MAX_NESTING levels with a message naming the limit.
"""

from __future__ import annotations

import re

from shared.errors import RequestTooLargeError

# Arrays and objects inside one another. Real JSON Schemas nest a few tens of levels at most; the gateway
# refuses bodies past the same depth, so what it passes on fits here. Far enough below Python's recursion
# limit that the deepest reader (jsonschema: several frames per schema level) stays clear of it.
MAX_NESTING = 64

_KEEP = b"[]{}"
_OTHER = bytes(b for b in range(256) if b not in _KEEP)
_AS_ARRAYS = bytes.maketrans(b"{}", b"[]")


def nesting_depth(text: str, stop_after: int = MAX_NESTING) -> int:
    """The deepest nesting of arrays and objects in `text`, counted up to stop_after + 1 (past that, the
    count stops). In text that is not JSON, brackets left open count as levels too.

    C-speed passes over the text, no loop per character: admission runs this on the event loop."""
    # Escaped backslashes and quotes gone, every '"' left opens or closes a string: the brackets
    # outside strings are every other piece.
    flat = text.encode("utf-8", "surrogatepass").replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(flat.split(b'"')[::2]).translate(_AS_ARRAYS, _OTHER)
    # Each pass takes out the innermost pairs: one level.
    depth = 0
    while brackets and depth <= stop_after:
        inner = brackets.replace(b"[]", b"")
        if inner == brackets:
            # Unbalanced, so not JSON; but a parser still recurses into every '[' before it finds the end
            # missing: those count as levels.
            return depth + brackets.count(b"[")
        brackets = inner
        depth += 1
    return depth


def check_nesting(text: str, what: str) -> None:
    """RequestTooLargeError when `text` (`what` names it) nests deeper than MAX_NESTING."""
    if nesting_depth(text) > MAX_NESTING:
        raise RequestTooLargeError(
            f"{what} nests arrays and objects deeper than this server's limit of {MAX_NESTING} levels")
