"""`structd docs cli`: docs/cli.md, the command reference, written from the argparse parsers themselves.

Every command and nested subcommand gets its usage, description and each
flag with its default, help and environment variable (shared/flags.py
records the variable on the flag), so the reference cannot drift from the
parsers: tests/test_cli_reference.py fails when the committed file differs
from what this module writes. The output is the same on every machine: the
parsers are built without the environment, a default computed from the
machine is printed as its rule (COMPUTED_DEFAULTS), a path default as a
path relative to the repository, and usage lines are wrapped at a fixed
width instead of the terminal's.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CLI_MD = REPO / "docs" / "cli.md"
REGENERATE = ".venv/bin/structd docs cli --write"
USAGE_WIDTH = 100

# (command, flag) -> the rule behind a default that depends on the machine the parser is built on.
COMPUTED_DEFAULTS = {
    ("structd grammar", "--compile-workers"): "one per CPU",
    ("structd grammar", "--fill-threads"): "one per CPU",
}

HEADER = f"""\
# Command reference

<!-- Generated from the argparse parsers by `structd docs cli --write`; do not edit by hand.
     tests/test_cli_reference.py fails when this file differs from what the parsers say. -->

Every command of the `structd` console script (also `python -m structd`),
generated from its parser: `python -m grammar_svc`, `python -m inference_svc`
and `python -m gateway` take exactly the flags of `structd grammar`,
`structd inference` and `structd gateway`. A flag with an environment
variable takes its default from that variable when it is set; a flag on the
command line wins. What the services do with their flags beyond one line of
help: [commands.md](commands.md); TLS: [deploy.md](deploy.md#tls-and-mutual-tls).
Regenerate after changing a parser: `{REGENERATE}`.
"""


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each direct subcommand, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name) or "", sub


def _commands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(one-line help, parser) of every command under `parser`, depth first, each before its subcommands."""
    for _, help_text, sub in _subcommands(parser):
        yield help_text, sub
        yield from _commands(sub)


def _usage(parser: argparse.ArgumentParser) -> str:
    # argparse wraps at the terminal's width (COLUMNS); the parser was built for this rendering alone.
    parser.formatter_class = functools.partial(argparse.HelpFormatter, width=USAGE_WIDTH)
    return parser.format_usage().strip()


def _invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        return action.metavar or action.dest
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    if action.metavar:
        metavar = action.metavar
    elif action.choices:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        metavar = action.dest.upper()
    return f"{flags} {metavar}"


def _default(command: str, action: argparse.Action) -> str | None:
    rule = next((COMPUTED_DEFAULTS[(command, flag)] for flag in action.option_strings
                 if (command, flag) in COMPUTED_DEFAULTS), None)
    if rule is not None:
        return rule
    value = action.default
    if action.nargs == 0 or value is None or value is argparse.SUPPRESS:
        return None
    if isinstance(value, Path) and value.is_absolute():
        value = os.path.relpath(value, REPO)
    elif isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return f"`{value}`" if str(value) else "`''`"


def _help(action: argparse.Action) -> str:
    if not action.help:
        return ""
    text = action.help % {**vars(action), "default": action.default} if "%" in action.help else action.help
    # Markdown would read `<ms>` as an HTML tag and a pair of `*` as emphasis.
    return " ".join(text.split()).replace("<", "&lt;").replace("*", "\\*")


def _flag_line(command: str, action: argparse.Action) -> str:
    facts = []
    default = _default(command, action)
    if default is not None:
        facts.append(f"default {default}")
    variable = getattr(action, "env_variable", None)
    if variable:
        facts.append(f"env `{variable}`")
    line = f"- `{_invocation(action)}`"
    if facts:
        line += f" ({'; '.join(facts)})"
    help_text = _help(action)
    return f"{line}: {help_text}" if help_text else line


def _section(command: str, help_text: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## {command}", ""]
    description = " ".join((parser.description or help_text).split())
    if description:
        lines += [description, ""]
    lines += ["```text", _usage(parser), "```", ""]
    children = list(_subcommands(parser))
    if children:
        lines += [f"- [`{sub.prog}`](#{_anchor(sub.prog)}): {text}" for _, text, sub in children] + [""]
    flags = [a for a in parser._actions if a.help is not argparse.SUPPRESS
             and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    if flags:
        lines += [_flag_line(command, a) for a in flags] + [""]
    return lines


def _anchor(command: str) -> str:
    """GitHub's anchor of a `## command` heading."""
    return "".join(c for c in command.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def render(parser: argparse.ArgumentParser) -> str:
    """docs/cli.md for the `structd` parser (built with an empty environment, so that no variable leaks in)."""
    lines = [HEADER, *_section(parser.prog, "", parser)]
    for help_text, sub in _commands(parser):
        lines += _section(sub.prog, help_text, sub)
    return "\n".join(lines).rstrip() + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help=f"write {CLI_MD.relative_to(REPO)} (default: print it)")
    what.add_argument("--check", action="store_true",
                      help=f"exit 1 when {CLI_MD.relative_to(REPO)} differs from what the parsers say")
    parser.add_argument("--path", type=Path, default=CLI_MD, help="the file --write and --check use")


def run(args: argparse.Namespace, build_parser: Callable[[dict[str, str]], argparse.ArgumentParser]) -> int:
    text = render(build_parser({}))
    if args.write:
        args.path.write_text(text)
        return 0
    if args.check:
        current = args.path.read_text() if args.path.exists() else ""
        if current != text:
            print(f"{args.path} differs from the command line's parsers: run `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0
