"""`pattern` strings of one bounded character class, printed as bounded strings.

xgrammar 0.2.8 compiles a string's `pattern` into a `Regex("...",
json_string=true)` rule, matched with an automaton whose states carry no
precomputed token masks worth having for a bounded repetition: inside
`^[a-z0-9_-]{1,255}$` every mask fill re-checks most of the vocabulary
(milliseconds a row on the 129k tokenizer: docs/benchmarks.md, "Patterns and
long bounds"). Schema normalisation makes more of them
(grammar_svc/schema/schema_normalise.py folds `minLength`/`maxLength` beside a
one-class pattern into its bound).

A pattern that is exactly one character class with a `{n}` or `{m,n}` bound
between `^` and `$` is the same language as a bounded string of that class,
so it is printed the way xgrammar prints one,

    s   ::= (("\\"" s_1{m, n} "\\""))
    s_1 ::= (([class]))

and grammar_svc/schema/bounded_strings.py puts it in tail (or blocked) form like any
other. Only classes of printable ASCII other than `"` and `\\` are taken: for
them the JSON string and the decoded string are the same characters, so
`json_string=true` changes nothing. Anything else (other quantifiers, several
parts, escapes that need JSON escaping, non-ASCII) stays a Regex rule.
"""

from __future__ import annotations

import re

# The two printed rules: the string (quote, pattern rule, quote) and the pattern.
_STRING_RULE = re.compile(r'^(?P<name>[^\s:]+) ::= \(\("\\"" (?P<inner>[A-Za-z_][A-Za-z0-9_]*) "\\""\)\)(?P<rest>.*)$')
_REGEX_RULE = re.compile(r'^(?P<name>[^\s:]+) ::= Regex\("(?P<regex>(?:[^"\\]|\\.)*)", json_string=true\)$')
# One class (or \d, \w) with a bound, anchored at both ends.
_ONE_CLASS = re.compile(r"^\^(?P<cls>\[(?:[^\]\\]|\\.)+\]|\\d|\\w)\{(?P<min>\d+)(?:,(?P<max>\d+))?\}\$$")
_SHORTHANDS = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]}
# Characters a regex class may escape to mean themselves.
_LITERAL_ESCAPES = set("-.^$[]{}()|*+?/:_,;!@#%&=~<> '`")
_SAFE = (0x20, 0x7E)  # printable ASCII; '"' and '\\' are left out separately


def patterns_as_bounded_strings(ebnf: str, *, max_required: int, max_bound: int) -> tuple[str, int]:
    """Returns (EBNF with each one-class bounded pattern printed as a bounded string, patterns converted).

    A pattern rule is converted only where it is used once, as `"\\"" rule "\\""`: its own rule
    becomes the character class and the string rule gets the bound. Only bounds the bounded-string
    rewrite takes (at most `max_required` required and `max_bound` characters) are converted: printed as
    a repetition and left so, a pattern would compile slower than its Regex rule.
    """
    lines = ebnf.splitlines()
    uses: dict[str, int] = {}
    for line in lines:
        body = line.split(" ::= ", 1)[1] if " ::= " in line else line
        for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", re.sub(r'"(?:[^"\\]|\\.)*"', "", body)):
            uses[word] = uses.get(word, 0) + 1
    classes: dict[str, tuple[str, int, int]] = {}
    for line in lines:
        m = _REGEX_RULE.match(line)
        if m is None or uses.get(m["name"], 0) != 1:
            continue
        parsed = _one_class(m["regex"].replace("\\\\", "\\"))
        if parsed is not None and parsed[1] <= max_required and parsed[2] <= max_bound:
            classes[m["name"]] = parsed
    strings = {m["inner"] for line in lines if (m := _STRING_RULE.match(line)) is not None}
    classes = {name: parsed for name, parsed in classes.items() if name in strings}
    out: list[str] = []
    converted = 0
    for line in lines:
        s = _STRING_RULE.match(line)
        r = _REGEX_RULE.match(line)
        if s is not None and s["inner"] in classes:
            _, lo, hi = classes[s["inner"]]
            out.append(f'{s["name"]} ::= (("\\"" {s["inner"]}{{{lo}, {hi}}} "\\"")){s["rest"]}')
            converted += 1
        elif r is not None and r["name"] in classes:
            out.append(f'{r["name"]} ::= (({classes[r["name"]][0]}))')
        else:
            out.append(line)
    return "\n".join(out) + "\n", converted


def _one_class(regex: str) -> tuple[str, int, int] | None:
    """(EBNF class, min, max) of `^class{m,n}$`, or None where the pattern is anything else."""
    m = _ONE_CLASS.match(regex)
    if m is None:
        return None
    lo = int(m["min"])
    hi = int(m["max"]) if m["max"] is not None else lo
    if hi < lo:
        return None
    cls = m["cls"]
    ranges = _SHORTHANDS[cls[1]] if cls.startswith("\\") else _class_ranges(cls[1:-1])
    if not ranges:
        return None
    for a, b in ranges:
        if a < _SAFE[0] or b > _SAFE[1] or a <= ord('"') <= b or a <= ord("\\") <= b:
            return None
    return _print_class(ranges), lo, hi


def _class_ranges(body: str) -> list[tuple[int, int]] | None:
    """Code point ranges of a regex class body; None for negation, shorthands inside, or other escapes."""
    if body.startswith("^"):
        return None
    chars: list[tuple[str, bool]] = []  # (character, written raw)
    i = 0
    while i < len(body):
        if body[i] == "\\":
            if i + 1 >= len(body):
                return None
            e = body[i + 1]
            if e in _SHORTHANDS:
                chars += [(chr(c), False) for a, b in _SHORTHANDS[e] for c in range(a, b + 1)]
            elif e in _LITERAL_ESCAPES:
                chars.append((e, False))
            else:
                return None
            i += 2
        else:
            chars.append((body[i], True))
            i += 1
    ranges, j = [], 0
    while j < len(chars):
        # A raw '-' between two characters is a range; first or last it is itself.
        if j + 2 < len(chars) and chars[j + 1] == ("-", True):
            a, b = ord(chars[j][0]), ord(chars[j + 2][0])
            if b < a:
                return None
            ranges.append((a, b))
            j += 3
        else:
            ranges.append((ord(chars[j][0]), ord(chars[j][0])))
            j += 1
    return ranges


def _print_class(ranges: list[tuple[int, int]]) -> str:
    merged: list[list[int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    special = "]\\-^["

    def ch(c: int) -> str:
        return "\\" + chr(c) if chr(c) in special else chr(c)

    # Two neighbours are written as two characters (`\\-.`, not the range `\\--.`).
    return "[" + "".join(f"{ch(a)}-{ch(b)}" if b > a + 1 else "".join(map(ch, range(a, b + 1)))
                         for a, b in merged) + "]"
