"""The one flag mechanism of the services: every flag may take its default from an environment variable.

`FlagSet(parser, env, "STRUCTD_GRAMMAR_").add("--max-sessions", 4096)` adds
`--max-sessions` whose default comes from STRUCTD_GRAMMAR_MAX_SESSIONS when
set. A value from the environment is converted by argparse exactly like one
typed on the command line, and only when that subcommand is parsed: a
malformed STRUCTD_GRAMMAR_PORT=abc is a usage error of `structd grammar`
(exit 2) that names the variable, and never breaks `structd generate`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


class _FromEnv(str):
    """A default read from the environment; argparse converts string defaults with the flag's type."""

    variable: str


def _converter(convert: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            return convert(raw)
        except (TypeError, ValueError):
            where = f" (from the environment variable {raw.variable})" if isinstance(raw, _FromEnv) else ""
            raise argparse.ArgumentTypeError(f"invalid {name} value: {str(raw)!r}{where}") from None

    parse.__name__ = name  # the messages read like argparse's own ("invalid int value: 'abc'")
    return parse


_KINDS: dict[type, tuple[Callable[[str], Any], str]] = {
    int: (int, "int"), float: (float, "float"), str: (str, "str"), Path: (Path, "path")}


class _Repeated(argparse.Action):
    """A repeatable flag whose values, once any is given, replace the default (the environment's list)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest)
        setattr(namespace, self.dest, (() if current is self.default else tuple(current)) + (values,))


class FlagSet:
    def __init__(self, parser: argparse.ArgumentParser, env: Mapping[str, str], prefix: str):
        self.parser = parser
        self.env = env
        self.prefix = prefix

    def variable(self, flag: str) -> str:
        return self.prefix + flag.lstrip("-").replace("-", "_").upper()

    def add(self, flag: str, default: Any, help: str | None = None, *, kind: type | None = None) -> None:
        """Adds `flag`; its type is `kind`, or the default's (a None default needs `kind`, else str)."""
        kind = kind or (type(default) if default is not None else str)
        convert, name = _KINDS[kind]
        raw = self.env.get(self.variable(flag))
        if raw is not None:
            default = _FromEnv(raw)
            default.variable = self.variable(flag)
        action = self.parser.add_argument(flag, type=_converter(convert, name), default=default, help=help)
        action.env_variable = self.variable(flag)  # docs/cli.md names it (structd/cli_reference.py)

    def add_repeated(self, flag: str, help: str | None = None, *, metavar: str | None = None) -> None:
        """A string flag that may be given several times (a tuple; empty when never given); its environment
        variable holds the values comma-separated, and flags on the command line replace them."""
        raw = self.env.get(self.variable(flag))
        default = tuple(v.strip() for v in raw.split(",") if v.strip()) if raw is not None else ()
        action = self.parser.add_argument(flag, action=_Repeated, default=default, help=help, metavar=metavar)
        action.env_variable = self.variable(flag)
