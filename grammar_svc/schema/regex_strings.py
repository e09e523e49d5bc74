"""`pattern` and `format` strings in xgrammar's EBNF, written as JSON strings.

xgrammar 0.2.8 compiles a string's `pattern` (and its built-in `format`s) in
one of two ways. A `Regex("...", json_string=true)` rule keeps `"`, `\\` and
control characters out of the string (safe, if narrower than the pattern).
But a simple pattern is printed as plain EBNF,
`s ::= "\\"" s_1 "\\""` with the pattern's literals and character classes in
`s_1` and the rules it reaches, and these are the *decoded* characters,
written raw between the quotes:

- `^\\\\d+$` (a literal backslash, then digits) becomes `"\\\\" "d"...`: a raw
  `\\d` in the document, an invalid JSON escape;
- a `.` becomes `[\\0-\\U0010ffff]`: a raw `"` ends the string early, a raw
  control character is not JSON, and a surrogate's UTF-8 is not UTF-8;
- `format: json-pointer` holds `[\\0-.]` and `[0-}]` (quote, backslash,
  control characters).

Here every literal and class of those rules is written the JSON way: `"`,
`\\` and U+0000-U+001F by their escape sequences, surrogates left out, so
each still stands for one character of the decoded string (a `{m,n}` around
it counts the same). Classes and literals without such characters are left
exactly as they were (the masks of the usual `[a-z0-9]` rules do not change).

One sequence is already JSON: `format: email`'s quoted local part is printed
as `"\\\\" "\\""` (an escaped quote), kept as it is.
"""

from __future__ import annotations

import re

from grammar_svc.schema.json_strings import CHAR_RULE, ESCAPE_RULE

_MAX_CODEPOINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)
_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
# Characters that must be escaped inside a JSON string.
_ESCAPED = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
# A string rule xgrammar printed as EBNF: the name between the two quotes.
_STRING_RULE_REF = re.compile(r'"\\"" ([A-Za-z_][A-Za-z0-9_]*) "\\""')
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EBNF_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "0": "\0", "b": "\b", "f": "\f", "v": "\v", "a": "\a",
                 "e": "\x1b"}
_HEX_ESCAPE_LEN = {"x": 2, "u": 4, "U": 8}


def escape_regex_strings(ebnf: str) -> tuple[str, int]:
    """Returns (EBNF whose pattern/format string rules write JSON strings, literals and classes rewritten)."""
    lines = ebnf.splitlines()
    bodies = dict(line.split(" ::= ", 1) for line in lines if " ::= " in line)
    roots = {m.group(1) for body in bodies.values() for m in _STRING_RULE_REF.finditer(body)}
    # json_strings' own rules (a one-character bounded string is `"\"" json_string_char "\""`) are JSON already.
    done = {CHAR_RULE, ESCAPE_RULE, f"{ESCAPE_RULE}_u"}
    todo = [r for r in roots if r in bodies and r not in done and not bodies[r].startswith("Regex(")]
    reached: set[str] = set()
    while todo:
        name = todo.pop()
        if name in reached or name in done:
            continue
        reached.add(name)
        for token in _tokens(bodies[name]):
            if token[0] not in '"[' and _IDENT.fullmatch(token) and token in bodies:
                todo.append(token)
    changed = 0
    out = []
    for line in lines:
        name = line.split(" ::= ", 1)[0] if " ::= " in line else None
        if name in reached and not bodies[name].startswith("Regex("):
            body, n = _rewrite_body(bodies[name])
            changed += n
            line = f"{name} ::= {body}"
        out.append(line)
    return "\n".join(out) + "\n", changed


def _rewrite_body(body: str) -> tuple[str, int]:
    tokens = list(_tokens(body))
    out: list[str] = []
    changed = 0
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token.startswith('"'):
            text = _decode(token[1:-1])
            following = next((t for t in tokens[i + 1:] if not t.isspace()), "")
            if text == "\\" and following.startswith('"') and _decode(following[1:-1]).startswith('"'):
                # xgrammar's own escaped quote (format: email): already JSON.
                j = tokens.index(following, i + 1)
                out.extend(tokens[i:j + 1])
                i = j + 1
                continue
            new = _literal("".join(_json_char(ord(c)) for c in text))
            changed += new != _literal(text)
            out.append(new if new != _literal(text) else token)
        elif token.startswith("["):
            new = _json_class(token)
            changed += new is not None
            out.append(new or token)
        else:
            out.append(token)
        i += 1
    return "".join(out), changed


def _tokens(body: str):
    """Literals, classes and the text between them, in order (joined, they are `body`)."""
    i, n, start = 0, len(body), 0
    while i < n:
        c = body[i]
        if c in '"[':
            if start < i:
                yield from _split_words(body[start:i])
            end = _closing(body, i, '"' if c == '"' else "]")
            yield body[i:end + 1]
            i = start = end + 1
        else:
            i += 1
    if start < n:
        yield from _split_words(body[start:])


def _split_words(text: str):
    pos = 0
    for m in _IDENT.finditer(text):
        if m.start() > pos:
            yield text[pos:m.start()]
        yield m.group(0)
        pos = m.end()
    if pos < len(text):
        yield text[pos:]


def _closing(body: str, i: int, close: str) -> int:
    j = i + 1
    while body[j] != close:
        j += 2 if body[j] == "\\" else 1
    return j


def _decode(text: str) -> str:
    """The characters an EBNF literal or class body stands for (its escapes resolved)."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = text[i + 1]
        if e in _HEX_ESCAPE_LEN:
            k = _HEX_ESCAPE_LEN[e]
            out.append(chr(int(text[i + 2:i + 2 + k], 16)))
            i += 2 + k
        else:
            out.append(_EBNF_ESCAPES.get(e, e))
            i += 2
    return "".join(out)


def _class_ranges(token: str) -> list[tuple[int, int]]:
    """The code point ranges of an EBNF class `[...]` / `[^...]`."""
    body = token[1:-1]
    negated = body.startswith("^")
    if negated:
        body = body[1:]
    chars, raw = [], []  # decoded characters and whether each was written raw (a raw '-' is a range)
    i = 0
    while i < len(body):
        if body[i] == "\\":
            e = body[i + 1]
            k = _HEX_ESCAPE_LEN.get(e, 0)
            chars.append(_decode(body[i:i + 2 + k]))
            raw.append(False)
            i += 2 + k
        else:
            chars.append(body[i])
            raw.append(True)
            i += 1
    ranges, j = [], 0
    while j < len(chars):
        if j + 2 < len(chars) and chars[j + 1] == "-" and raw[j + 1]:
            ranges.append((ord(chars[j]), ord(chars[j + 2])))
            j += 3
        else:
            ranges.append((ord(chars[j]), ord(chars[j])))
            j += 1
    ranges = _merge(ranges)
    return _subtract([(0, _MAX_CODEPOINT)], ranges) if negated else ranges


def _json_class(token: str) -> str | None:
    """The class as JSON string characters, or None where it needs no change."""
    ranges = _class_ranges(token)
    must_escape = _intersect(ranges, _ESCAPED)
    has_surrogates = bool(_intersect(ranges, [_SURROGATES]))
    if not must_escape and not has_surrogates:
        return None
    safe = _subtract(ranges, _ESCAPED + [_SURROGATES])
    alternatives = [_print_class(safe)] if safe else []
    escaped = [cp for lo, hi in must_escape for cp in range(lo, hi + 1)]
    if all(cp in escaped for cp in range(0x20)):
        # Every control character: one escape class instead of 32 literals.
        alternatives.append('"\\\\" [bfnrt]')
        alternatives.append('"\\\\u00" [01] [0-9a-fA-F]')
        escaped = [cp for cp in escaped if cp >= 0x20]
    alternatives += [_literal(_json_char(cp)) for cp in escaped]
    if not alternatives:
        # Surrogates alone match no character, and xgrammar has no empty class: left as printed (the
        # service's output check reports a document holding one).
        return None
    return "(" + " | ".join(alternatives) + ")"


def _json_char(cp: int) -> str:
    """One character as it is written inside a JSON string."""
    if cp in _SHORT_ESCAPES:
        return "\\" + _SHORT_ESCAPES[cp]
    if cp < 0x20:
        return f"\\u{cp:04x}"
    return chr(cp)


def _literal(text: str) -> str:
    return '"' + "".join(_ebnf_char(ord(c), '"\\') for c in text) + '"'


def _print_class(ranges: list[tuple[int, int]]) -> str:
    special = "]\\-^["
    items = [_ebnf_char(lo, special) if lo == hi else _ebnf_char(lo, special) + "-" + _ebnf_char(hi, special)
             for lo, hi in ranges]
    return "[" + "".join(items) + "]"


def _ebnf_char(cp: int, special: str) -> str:
    if 0x20 < cp < 0x7F:
        return "\\" + chr(cp) if chr(cp) in special else chr(cp)
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


def _merge(ranges):
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[0] <= r[1]):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _intersect(a, b):
    return _merge([(max(lo, blo), min(hi, bhi)) for lo, hi in a for blo, bhi in b])


def _subtract(a, b):
    out = list(_merge(a))
    for blo, bhi in _merge(b):
        nxt = []
        for lo, hi in out:
            if bhi < lo or blo > hi:
                nxt.append((lo, hi))
                continue
            if lo < blo:
                nxt.append((lo, blo - 1))
            if hi > bhi:
                nxt.append((bhi + 1, hi))
        out = nxt
    return out
