"""Bounded-string grammar rewrite, applied to every JSON Schema the service compiles.

xgrammar 0.2.8 turns a JSON Schema string with `maxLength` into
`s ::= "\"" c{m, n} "\""` and, when compiling, expands `c{m, n}` into nested
optional rules `o_k ::= "" | c o_{k+1}`. Each `o_k` can end early, so every
token longer than the characters left runs past the end of its rule: the
compiler cannot decide it from the rule alone (a context-dependent token) and
the matcher re-checks it at every fill. Inside such a string nearly the whole
129k vocabulary is context-dependent, which costs milliseconds per mask.

The equivalent right-recursive form moves the closing quote into the rule:

    s    ::= "\"" c c ... c (m times) s_bN
    s_bk ::= "\"" | c s_b(k-1)          for k = n-m .. 1
    s_b0 ::= "\""

It accepts exactly the same strings, but a token that overflows the length
now fails *inside* the rule (certain at compile time), so the mask is a
cached lookup again. `c{m, -1}` (minLength only) gets the same treatment
with one self-recursive tail rule. Measured effect (`structd bench grammar`
compares both forms mask by mask): docs/benchmarks.md, "Bounded strings".

Where `c` is a JSON string character (grammar_svc/schema/json_strings.py: an
unescaped character or an escape sequence), each link spells out both
alternatives, `s_bk ::= "\"" | [^...] s_b(k-1) | "\\" escape s_b(k-1)`, and
the m required characters are a chain of the same shape: the character
class stays inline, so the masks stay cached lookups.

Longer bounds (more than MAX_EXPANDED optional characters) cannot take one
tail rule per character: each rule costs the compiler a pass over the
vocabulary, so a tail's compile grows with the bound, to seconds for a
1024-character one (docs/benchmarks.md, "Patterns and long bounds", has the
figures). They get a blocked form whose rules
do not depend on the bound (see _long_rules): two decompositions of the
string into 64-character blocks, half a block apart, each ending in a tail of
64-127 characters. Every position of the string is then at least 32
characters from the end of a block on one of the two, so a token no longer
than that is decided by that one's cached mask, and the last characters are
in tail form. The blocks and tails are shared by every long string of the
same class, so a schema pays for them once.

`pattern` strings that are one character class with a `{m,n}` bound are
first written in the same printed shape as a bounded string
(grammar_svc/schema/bounded_patterns.py), so both forms apply to them too.
"""

from __future__ import annotations

import re

from grammar_svc.schema.bounded_patterns import patterns_as_bounded_strings
from grammar_svc.schema.json_strings import CHAR_RULE, string_char_alternatives

# One printed rule of xgrammar's JSON-Schema EBNF for a bounded string, with
# an optional lookahead after it.
_BOUNDED_STRING = re.compile(
    r'^(?P<name>[^\s:]+) ::= \(\("\\"" (?P<chars>[^\s{}]+)\{(?P<min>\d+), (?P<max>-?\d+)\} "\\""\)\)(?P<rest>.*)$')
# Longer bounds take the blocked form below. xgrammar 0.2.8 expands at most
# ~128 nested rules itself (longer bounds get a windowed repetition instead),
# so past 128 the tail form compiles slower than the original, more so the
# longer the bound (docs/benchmarks.md, "Hand-timed figures behind code
# choices", "Bounded strings past 128 characters").
MAX_EXPANDED = 128
# The blocked form for longer bounds: block length, and the longest bound it takes (its rules per string grow
# by one per block: 512 blocks is ~1,000 small rules, which compile in milliseconds).
BLOCK = 64
MAX_BLOCKED = BLOCK * 512


QUOTE = '"\\""'  # the EBNF literal for one double quote
_CHAR_CLASS_BODY = re.compile(r"^\(\((\[.*\])\)\)$")


def rewrite_bounded_strings(ebnf: str, *, max_expanded: int = MAX_EXPANDED, block: int = BLOCK,
                            max_blocked: int = MAX_BLOCKED) -> tuple[str, int]:
    """Returns (EBNF with every bounded-string rule in tail form, rules rewritten).

    Bounds of more than `max_expanded` optional characters take the blocked form with blocks of `block`
    characters (tests use small ones), up to `max_blocked`; `pattern` strings of one bounded character
    class count as bounded strings.

    Strings with the same character class and the same number of optional
    characters share one tail chain, and strings with the same bounds one head
    rule (the original rule becomes an alias of it), so a schema with many
    bounded strings does not compile a chain per property: xgrammar compiles
    each distinct rule's token masks, which costs a vocabulary pass per
    position.
    """
    ebnf = patterns_as_bounded_strings(ebnf, max_required=max_expanded, max_bound=max_blocked)[0]
    count = 0
    lines = ebnf.splitlines()
    bodies = dict(line.split(" ::= ", 1) for line in lines if " ::= " in line)
    out: list[str] = []
    tails: dict[tuple[str, int], str] = {}
    blocks: dict[str, str] = {}
    heads: dict[tuple[str, int, int], str] = {}
    tail_lines: list[str] = []
    for line in lines:
        m = _BOUNDED_STRING.match(line)
        if m is None:
            out.append(line)
            continue
        name, chars, lo, hi, rest = m["name"], m["chars"], int(m["min"]), int(m["max"]), m["rest"]
        blocked = hi != -1 and hi - lo > max_expanded and hi - lo >= 2 * block
        if lo > max_expanded or (hi != -1 and (hi < lo or hi - lo > (max_blocked if blocked else max_expanded))):
            out.append(line)
            continue
        # Inline the character class: a sequence of references to one rule is slow to match.
        body = bodies.get(chars, "")
        json_char = body == f"(({CHAR_RULE}))"
        if json_char:
            chars = CHAR_RULE
        elif (m_class := _CHAR_CLASS_BODY.match(body)) is not None:
            chars = m_class.group(1)
        n = -1 if hi == -1 else hi - lo
        key = (chars, lo, n, blocked)
        head = heads.get(key)
        if head is None:
            head = _fresh_name(f"bounded_string_head_{len(heads)}", bodies)
            heads[key] = head
            if blocked:
                tail = f"{head}_long"
                tail_lines += _long_rules(tail, n, block, _chain(tails, tail_lines, bodies, chars, 2 * block - 1),
                                          _block_chain(blocks, tail_lines, bodies, chars, block))
            else:
                tail = _chain(tails, tail_lines, bodies, chars, n)
            if json_char and lo:
                # An escape is a choice, not a class: the required characters are a chain too.
                for k in range(lo, 0, -1):
                    then = tail if k == 1 else f"{head}_{k - 1}"
                    tail_lines.append(f"{head}_{k} ::= {' | '.join(_char_then(chars, then))}")
                tail_lines.append(f"{head} ::= {QUOTE} {head}_{lo}")
            else:
                tail_lines.append(f"{head} ::= {' '.join([QUOTE] + [chars] * lo + [tail])}")
        out.append(f"{name} ::= ({head}){rest}")
        count += 1
    return "\n".join(out + tail_lines) + "\n", count


def _chain(tails: dict, tail_lines: list[str], bodies: dict, chars: str, n: int) -> str:
    """The tail chain of at most n characters then the quote (n = -1: any number), made once per (class, n)."""
    tail = tails.get((chars, n))
    if tail is None:
        tail = _fresh_name(f"bounded_string_tail_{len(tails)}", bodies)
        tails[(chars, n)] = tail
        if n == -1:
            tail_lines.append(f"{tail} ::= {' | '.join([QUOTE] + _char_then(chars, tail))}")
        else:
            for k in range(n, 0, -1):
                alternatives = [QUOTE] + _char_then(chars, _link(tail, k - 1, n))
                tail_lines.append(f"{_link(tail, k, n)} ::= {' | '.join(alternatives)}")
            tail_lines.append(f"{_link(tail, 0, n)} ::= {QUOTE}")
    return tail


def _block_chain(blocks: dict, tail_lines: list[str], bodies: dict, chars: str, block: int) -> str:
    """The chain of exactly `block` characters of a class (`{name}_k`: exactly k), made once per class."""
    name = blocks.get(chars)
    if name is None:
        name = _fresh_name(f"bounded_string_block_{len(blocks)}", bodies)
        blocks[chars] = name
        for k in range(block, 1, -1):
            tail_lines.append(f"{_link(name, k, block)} ::= {' | '.join(_char_then(chars, _link(name, k - 1, block)))}")
        tail_lines.append(f"{_link(name, 1, block)} ::= {' | '.join(_char_then(chars, ''))}")
    return name


def _long_rules(name: str, n: int, block: int, tail: str, blocks: str) -> list[str]:
    """`name`: at most n (>= 2 * block) characters of the class, then the quote, in the blocked form.

    With t_k the tail chain (at most k characters, then the quote) and b_k the block chain (exactly k):

        name  ::= a_q | b_(B/2) c_q'              two decompositions, half a block apart
        a_j   ::= t_(B-1) | b_B a_(j-1)           the string ends in this block, or a whole block follows
        a_0   ::= t_r                             the last B..2B-1 characters in tail form
        c_j   ::= b_B c_(j-1)                     the second never ends early: the first already can,
        c_0   ::= t_r'                            and the fewer parser states, the cheaper the fill

    Both accept exactly the strings of at most n characters (a_j: [0, B-1] or B + a_(j-1)). A token that
    runs past the end of a block of one decomposition is context-dependent there, but the other is at
    least B/2 characters from its own block's end, decides it and puts it in the mask, and xgrammar skips
    the re-check of a token some parser state already accepted. Near the bound both are in tail form,
    where a token too long for what is left is rejected at compile time.
    """
    tail_top = 2 * block - 1

    def t(k: int) -> str:
        return _link(tail, k, tail_top)

    def b(k: int) -> str:
        return _link(blocks, k, block)

    lines = []
    q, r = divmod(n, block)
    q, r = q - 1, r + block  # the last block stays in tail form
    lines.append(f"{name}_a0 ::= {t(r)}")
    for j in range(1, q + 1):
        lines.append(f"{name}_a{j} ::= {t(block - 1)} | {b(block)} {name}_a{j - 1}")
    half = block // 2
    q2, r2 = divmod(n - half, block)
    q2, r2 = q2 - 1, r2 + block
    lines.append(f"{name}_c0 ::= {t(r2)}")
    for j in range(1, q2 + 1):
        lines.append(f"{name}_c{j} ::= {b(block)} {name}_c{j - 1}")
    lines.append(f"{name} ::= {name}_a{q} | {b(half)} {name}_c{q2}")
    return lines


def _char_then(chars: str, then: str) -> list[str]:
    """Alternatives of one character of the string followed by `then` (a rule, or nothing)."""
    if chars == CHAR_RULE:
        return string_char_alternatives(then)
    return [f"{chars} {then}".rstrip()]


def _link(tail: str, k: int, n: int) -> str:
    """Rule of the chain with k characters left; the chain's entry (k = n) is `tail` itself."""
    return tail if k == n else f"{tail}_{k}"


def _fresh_name(base: str, taken) -> str:
    name = base
    while any(t == name or t.startswith(name + "_") for t in taken):
        name += "x"
    return name
