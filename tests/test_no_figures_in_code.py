"""Measured figures live in docs/benchmarks.md only, and the code's pointers to it name sections that exist.

A timing in a docstring goes stale with the next kernel, machine or refactor,
and two copies of it soon disagree (issue 23 found the LM head's cost at 32
rows given three ways). So production code (inference_svc/, grammar_svc/,
gateway/, shared/, and structd/ outside structd/bench/) holds no measured
time in ms/µs/ns, no speed ratio such as "7x", no percentage, and no
measured seconds ("~2 s", "5.7 s", "5-20 s"), in its comments and string literals (docstrings
and --help texts included). It says why, and points to the section of
docs/benchmarks.md that holds the numbers: `docs/benchmarks.md, "Section"`,
optionally followed by `, "Subsection"` (a bare mention of the file names no
section and fails). Every such quoted name must start a heading or a bold
paragraph there, so a renamed section cannot leave a pointer behind.

Configuration defaults written as numbers with their unit in seconds
(`2 s by default`) are not measurements and are not matched; sizes that are
facts of a format (129,280 tokens, 16 KB a mask row) neither.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRODUCTION = ("inference_svc", "grammar_svc", "gateway", "shared", "structd")
# The benchmarks themselves report figures; shared/gen is protoc's output.
EXCLUDED = ("structd/bench", "shared/gen")
BENCHMARKS_MD = REPO / "docs" / "benchmarks.md"

_NUM = r"\d+(?:[.,]\d+)?"
_RANGE = rf"{_NUM}(?:\s?(?:-|to)\s?{_NUM})?"
FIGURE = re.compile(rf"""
    (?<![\w.]){_RANGE}\s?(?:ms|us|µs|μs|ns)\b        # a time: 28.0 ms, 0.6 µs, 5-20 ms
  | (?<![\w.]){_NUM}(?:-{_NUM})?x\b                  # a ratio: 7x, 1.1-2.5x (not a format spec's 04x)
  | (?<![\w.]){_RANGE}\s?%                           # a percentage: 5-8%
  | (?:~|\babout\s|\bmeasured\sat\s){_RANGE}\s?s\b   # measured seconds: ~18 s, about 2 s
  | (?<![\w.])(?:\d+\.\d+|\d+\s?(?:-|to)\s?\d+(?:\.\d+)?)\s?s\b  # 5.7 s, 5-20 s (not a default's "2 s")
""", re.X)

# `docs/benchmarks.md, "A", "B"` (also `: "A"`, `"A", and "B"`): the quoted names after the path.
POINTER = re.compile(r'docs/benchmarks\.md((?:\s*(?:[,:;]\s*)?(?:and\s+)?"[^"]+")+)')
QUOTED = re.compile(r'"([^"]+)"')


def production_files() -> list[Path]:
    files = []
    for root in PRODUCTION:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if not rel.startswith(EXCLUDED):
                files.append(path)
    return files


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment block (consecutive comment lines joined) and every string literal."""
    block: list[str] = []
    start = last = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        if block and tok.start[0] == last + 1:
            block.append(tok.string.lstrip("#").strip())
        else:
            if block:
                yield start, " ".join(block)
            block, start = [tok.string.lstrip("#").strip()], tok.start[0]
        last = tok.start[0]
    if block:
        yield start, " ".join(block)
    tree = ast.parse(source)
    # The constant parts of an f-string's format spec ("04x" in f"{cp:04x}") are no prose.
    specs = {id(part) for node in ast.walk(tree) if isinstance(node, ast.FormattedValue) and node.format_spec
             for part in node.format_spec.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in specs:
            yield node.lineno, " ".join(node.value.split())


def figures(source: str) -> list[tuple[int, str]]:
    """(line, figure) of every measured figure in `source`'s prose, in line order."""
    return sorted(((line, m.group(0)) for line, text in prose(source) for m in FIGURE.finditer(text)),
                  key=lambda found: found[0])


def pointers(source: str) -> list[tuple[int, str]]:
    return [(line, " ".join(name.split())) for line, text in prose(source)
            for m in POINTER.finditer(text) for name in QUOTED.findall(m.group(1))]


def unnamed_mentions(text: str) -> int:
    """How many times `text` mentions docs/benchmarks.md without naming a section after it."""
    return len(re.findall(r"docs/benchmarks\.md", text)) - len(POINTER.findall(text))


def section_starts(markdown: str) -> list[str]:
    """Each heading's text and each bold span's, whitespace-normalised: what a pointer may name."""
    heads = [m.group(1) for m in re.finditer(r"^#+\s+(.+)$", markdown, re.M)]
    bold = [m.group(1) for m in re.finditer(r"\*\*(.+?)\*\*", markdown, re.S)]
    return [" ".join(t.split()) for t in heads + bold]


def names_a_section(name: str, starts: list[str]) -> bool:
    return any(s.startswith(name) for s in starts)


def test_the_detector_finds_figures_in_comments_docstrings_and_help():
    snippet = '''"""Module doc: the full head takes 21-34 ms at 32 rows."""
# a typical row fills in ~4 µs, and the batch call took 7x longer
X = 1  # costs 13-15% of the full head
def f():
    """Importing takes about 2 s on an idle machine, 5 to 20 s on a busy one; serializing 5.7 s."""
HELP = "off on CPU, where it gains ~1 ms per step"
'''
    assert [fig for _, fig in figures(snippet)] == ["21-34 ms", "4 µs", "7x", "13-15%", "about 2 s", "5 to 20 s", "5.7 s",
                                                   "1 ms"]


def test_the_detector_leaves_words_units_sizes_and_defaults_alone():
    snippet = '''"""Fills take microseconds, compiles milliseconds; a 129,280-token vocabulary, 16 KB a row."""
# below --grammar-step-timeout-seconds, 2 s by default; 4 x --compile-workers; 0x1F
HEX = f"\\\\u{0x41:04x}"
LOG = f"{1.5:.1f} ms"
'''
    assert figures(snippet) == []


def test_the_pointer_reader_joins_wrapped_comments_and_reads_every_name():
    snippet = '''# the hop costs more (docs/benchmarks.md, "Hand-timed figures
# behind code choices", "The grammar replica's step path")
"""Doc (docs/benchmarks.md, "The greedy
head", has the figures) and (docs/benchmarks.md, "A", and "B, with a comma")."""
'''
    assert [name for _, name in pointers(snippet)] == [
        "Hand-timed figures behind code choices", "The grammar replica's step path", "The greedy head", "A",
        "B, with a comma"]
    starts = section_starts("# T\n\n## The greedy head (`--greedy-head`)\n\n**A** first.\n")
    assert names_a_section("The greedy head", starts) and names_a_section("A", starts)
    assert not names_a_section("B, with a comma", starts)
    assert unnamed_mentions("measured (docs/benchmarks.md) and docs/benchmarks.md, \"A\"") == 1


def test_production_code_holds_no_measured_figures():
    found = [f"{path.relative_to(REPO)}:{line}: {fig!r}" for path in production_files()
             for line, fig in figures(path.read_text())]
    assert not found, ("measured figures belong in docs/benchmarks.md; say why here and point to its section:\n"
                       + "\n".join(found))


def test_every_mention_of_benchmarks_md_names_its_section():
    bare = [f"{path.relative_to(REPO)}:{line}" for path in production_files()
            for line, text in prose(path.read_text()) if unnamed_mentions(text)]
    assert not bare, 'write docs/benchmarks.md, "Section" (which section holds the figures):\n' + "\n".join(bare)


def test_every_pointer_into_benchmarks_md_names_a_section_there():
    starts = section_starts(BENCHMARKS_MD.read_text())
    missing = [f"{path.relative_to(REPO)}:{line}: {name!r}" for path in production_files()
               for line, name in pointers(path.read_text()) if not names_a_section(name, starts)]
    assert not missing, "no heading or bold paragraph of docs/benchmarks.md starts so:\n" + "\n".join(missing)
