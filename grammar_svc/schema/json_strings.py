"""JSON string characters in xgrammar's EBNF for bounded strings, made JSON.

xgrammar 0.2.8 prints a string with `minLength`/`maxLength` as
`"\"" c{m, n} "\""` with `c ::= [^\"\\\r\n]`: one raw character that may be
a control character (JSON forbids U+0000-U+001F unescaped, and `json.loads`
refuses a document holding one) and may never be an escape sequence (a
bounded string could not hold `\"` or `\n`), unlike its unbounded string
rule. Every occurrence of that class becomes one JSON string character:
an unescaped character other than `"`, `\\` and U+0000-U+001F, or one escape
sequence, so that `{m, n}` still counts characters of the decoded string, as
JSON Schema counts them.

Every string character class, the unbounded string's too, also leaves out
U+D800-U+DFFF: xgrammar's classes match the UTF-8 encoding of a surrogate
(`ED A0 80`), which is not UTF-8, so no JSON parser reads the document.

An escaped UTF-16 surrogate pair (`\\ud83d\\ude00`) decodes to one character,
so it is one character here too. A lone surrogate escape is not Unicode text
(strict parsers such as serde_json refuse it, and a pair split across the
count would change the length), so bounded strings do not admit one.
"""

from __future__ import annotations

# The class xgrammar prints for one character of a bounded string.
XGRAMMAR_BOUNDED_CHAR = '[^\\"\\\\\\r\\n]'
# The class of one character of xgrammar's unbounded string.
XGRAMMAR_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'
# One unescaped JSON string character (surrogates are not characters).
UNESCAPED = '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'
UNBOUNDED_FIXED = '[^\\0-\\x1f\\"\\\\\\r\\n\\uD800-\\uDFFF]'
BACKSLASH = '"\\\\"'  # the EBNF literal for one backslash
_HEX = "[0-9a-fA-F]"

CHAR_RULE = "json_string_char"
ESCAPE_RULE = "json_string_escape"


def string_char_alternatives(then: str, escape_rule: str = ESCAPE_RULE) -> list[str]:
    """The alternatives of one JSON string character followed by `then` (a rule or nothing)."""
    tail = f" {then}" if then else ""
    return [f"{UNESCAPED}{tail}", f"{BACKSLASH} {escape_rule}{tail}"]


def fix_string_characters(ebnf: str) -> tuple[str, int]:
    """Returns (EBNF with every string character a JSON string character, occurrences replaced)."""
    unbounded = ebnf.count(XGRAMMAR_STRING_CHAR)
    ebnf = ebnf.replace(XGRAMMAR_STRING_CHAR, UNBOUNDED_FIXED)
    count = ebnf.count(XGRAMMAR_BOUNDED_CHAR)
    if count == 0:
        return ebnf, unbounded
    names = {line.split(" ::= ", 1)[0] for line in ebnf.splitlines() if " ::= " in line}
    if CHAR_RULE in names or ESCAPE_RULE in names:
        # xgrammar names rules after schema paths (root_, definitions_, basic_): never these.
        raise ValueError(f"the grammar already defines {CHAR_RULE} or {ESCAPE_RULE}")
    fixed = ebnf.replace(XGRAMMAR_BOUNDED_CHAR, CHAR_RULE)
    return fixed.rstrip("\n") + "\n" + "\n".join(char_rules()) + "\n", count + unbounded


def char_rules() -> list[str]:
    """The rules `json_string_char` and `json_string_escape` (with its surrogate pairs)."""
    h = _HEX
    return [
        f"{CHAR_RULE} ::= " + " | ".join(string_char_alternatives("")),
        f'{ESCAPE_RULE} ::= [\\"\\\\/bfnrt] | "u" {ESCAPE_RULE}_u',
        # A non-surrogate code unit, or a high surrogate escaped with its low one.
        f"{ESCAPE_RULE}_u ::= [0-9a-cA-Ce-fE-F] {h} {h} {h} | [dD] [0-7] {h} {h}"
        f' | [dD] [89abAB] {h} {h} {BACKSLASH} "u" [dD] [c-fC-F] {h} {h}',
    ]
