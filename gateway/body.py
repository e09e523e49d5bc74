"""Reading a JSON request body field by field, with errors that name the parameter.

OpenAI answers a wrong type or value with a 400 whose `param` is the field
(`messages[1].content`, `response_format.json_schema.schema`); `Fields` does
the same for every field the gateway reads. A null counts as absent, as the
OpenAI API treats optional fields.

Before a body (or JSON text inside it, a schema given as a string) is
parsed, `check_shape` looks at its structure with a few byte scans in C
and refuses what no real request needs and what would cost the process
far more than its size: nesting deeper than MAX_NESTING (Python's parser
recurses, and a RecursionError is a 500) and more than MAX_VALUES values
(`[{},{},...]` parses to many times its size, and json.loads holds the GIL
for all of it: docs/benchmarks.md, "Hostile input at the gateway").
docs/openai.md documents both limits.
"""

from __future__ import annotations

import json
import math
from typing import Any

from gateway.errors import ApiError, InvalidParameterError

# Arrays and objects inside each other: a request's own structure is 4-5 deep (messages[i].content[j]), a
# JSON Schema a few levels more per nested object; OpenAI's structured outputs allow 10 levels of schema.
MAX_NESTING = 64
# Values (keys, strings, numbers, arrays, objects) in one document: a 128k-token prompt given as token ids
# is 128k; a long chat with tools a few thousand.
MAX_VALUES = 1 << 18
# The proto's field ranges: every integer field the gateway fills is an int32 unless it says otherwise,
# every number a float32.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38

_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class ShapeError(ValueError):
    """A JSON document too deep or too large to parse; `too_large`: refused for its size (413), else 400."""

    def __init__(self, message: str, too_large: bool):
        super().__init__(message)
        self.too_large = too_large


def check_shape(raw: bytes, what: str) -> None:
    """Raises ShapeError when the JSON document `raw` (UTF-8; `what` names it in the message) nests deeper
    than MAX_NESTING or holds more than MAX_VALUES values (counted from what is outside its strings, so an
    empty array or object counts twice). A document that is not valid JSON either passes (json.loads then
    says what is wrong) or is refused for its shape."""
    # Without escaped backslashes and escaped quotes, every '"' left opens or closes a string.
    flat = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    if flat.count(b'"') > 2 * MAX_VALUES:
        raise _too_many(what)
    outside = b"".join(flat.split(b'"')[::2])
    # Every value but the document itself is the first in its array or object, or follows a ',' or a ':'.
    values = 1 + sum(outside.count(c) for c in (b",", b":", b"[", b"{"))
    if values > MAX_VALUES:
        raise _too_many(what)
    # One pass of removing every innermost '[]' removes one level of nesting.
    brackets = outside.translate(_BRACKETS, _NOT_BRACKETS)
    for _ in range(MAX_NESTING):
        inner = brackets.replace(b"[]", b"")
        if inner == brackets:  # unbalanced: not JSON, which json.loads reports
            return
        brackets = inner
    if brackets:
        raise ShapeError(f"{what} nests arrays and objects deeper than {MAX_NESTING} levels.", too_large=False)


def _too_many(what: str) -> ShapeError:
    return ShapeError(f"{what} holds more than {MAX_VALUES} JSON values.", too_large=True)


def loads(raw: bytes, what: str, *, strict_numbers: bool = False) -> Any:
    """`raw` parsed as JSON after check_shape; ShapeError, or ValueError (with UnicodeDecodeError) naming what
    is wrong. strict_numbers: NaN and Infinity, which json.loads accepts, are refused too."""
    check_shape(raw, what)
    # UTF-8 only (RFC 8259): check_shape's byte scans rely on ASCII never appearing inside a multi-byte
    # character, which json.loads' UTF-16/32 detection would break.
    return json.loads(raw.decode("utf-8-sig"), parse_constant=_not_a_number if strict_numbers else None)


def _not_a_number(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_object(raw: bytes) -> "Fields":
    """The request body as a JSON object."""
    try:
        obj = loads(raw, "The request body")
    except ShapeError as e:  # the client's: answered 413 or 400, naming the limit
        if e.too_large:
            raise ApiError(413, str(e), "invalid_request_error", None, "request_too_large") from None
        raise InvalidParameterError(None, str(e)) from None
    except ValueError as e:  # the client's (UnicodeDecodeError is one): answered 400
        raise InvalidParameterError(None, f"The request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise InvalidParameterError(None, "The request body must be a JSON object.")
    return Fields(obj)


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _shown(value: float) -> str:
    """A number as a message quotes it: a 400-digit integer is not repeated whole."""
    text = repr(value)
    return text if len(text) <= 24 else text[:20] + "..."


class Fields:
    """One JSON object of the body; `path` is where it sits (empty for the body itself)."""

    def __init__(self, obj: dict[str, Any], path: str = ""):
        self.obj = obj
        self.path = path

    def name(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.path}[{key}]"
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def raw(self, key: str) -> Any:
        return self.obj.get(key)

    def fail(self, key: str | None, message: str) -> InvalidParameterError:
        return InvalidParameterError(self.name(key) if key is not None else (self.path or None), message)

    def _wrong(self, key: str, expected: str) -> InvalidParameterError:
        value = self.obj[key]
        return self.fail(key, f"'{self.name(key)}' must be {expected}, not {_type_name(value)}.")

    def string(self, key: str, default: str | None = None) -> str | None:
        value = self.obj.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self._wrong(key, "a string")
        return value

    def boolean(self, key: str, default: bool | None = None) -> bool | None:
        value = self.obj.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._wrong(key, "a boolean")
        return value

    def integer(self, key: str, default: int | None = None, *, minimum: int = INT32_MIN,
                maximum: int = INT32_MAX) -> int | None:
        """The field as an int in [minimum, maximum] (an int32 unless told otherwise, as the proto's fields)."""
        value = self.obj.get(key)
        if value is None:
            return default
        # JSON has one number type: 3.0 is an integer, 3.5 and true are not (1e400 and NaN are out of range).
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                isinstance(value, float) and math.isfinite(value) and not value.is_integer()):
            raise self._wrong(key, "an integer")
        self._check_range(key, value, minimum, maximum, "an integer")
        return int(value)

    def number(self, key: str, default: float | None = None, *, minimum: float = -FLOAT32_MAX,
               maximum: float = FLOAT32_MAX) -> float | None:
        """The field as a float in [minimum, maximum] (within a float32 unless told otherwise)."""
        value = self.obj.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._wrong(key, "a number")
        self._check_range(key, value, minimum, maximum, "a number")
        return float(value)

    def _check_range(self, key: str, value: float, minimum: float, maximum: float, kind: str) -> None:
        if not minimum <= value <= maximum:  # also true for NaN (json.loads accepts NaN and Infinity)
            raise self.fail(key, f"'{self.name(key)}' must be {kind} between {minimum} and {maximum}, "
                                 f"got {_shown(value)}.")

    def object(self, key: str) -> "Fields | None":
        value = self.obj.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self._wrong(key, "an object")
        return Fields(value, self.name(key))

    def array(self, key: str) -> list[Any] | None:
        value = self.obj.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise self._wrong(key, "an array")
        return value

    def objects(self, key: str) -> list["Fields"] | None:
        """An array of objects, each as Fields at `key[i]`."""
        items = self.array(key)
        if items is None:
            return None
        out = []
        for i, item in enumerate(items):
            where = f"{self.name(key)}[{i}]"
            if not isinstance(item, dict):
                raise InvalidParameterError(where, f"'{where}' must be an object, not {_type_name(item)}.")
            out.append(Fields(item, where))
        return out

    def unknown(self, known: set[str]) -> list[str]:
        """Keys present (not null) that are not in `known`, sorted."""
        return sorted(k for k, v in self.obj.items() if k not in known and v is not None)
