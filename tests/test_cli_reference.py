"""docs/cli.md is what the parsers say: no flag, default or environment variable drifts from the code.

The reference is written by `structd docs cli --write` (structd/cli_reference.py)
from the real parsers; these tests rebuild it and compare, and check that the
generator leaves nothing of a parser out and nothing of this machine in.
"""

from __future__ import annotations

import argparse

import pytest

from structd import cli_reference
from structd.cli import build_parser, main


def _every_flag(parser: argparse.ArgumentParser, path: str = "structd"):
    """(command, action) of every documented argument of every command, nested subcommands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _every_flag(sub, f"{path} {name}")
        elif action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
            yield path, action


def _section(text: str, command: str) -> str:
    start = text.index(f"\n## {command}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def test_committed_reference_is_what_the_parsers_say():
    committed = cli_reference.CLI_MD.read_text()
    assert committed == cli_reference.render(build_parser({})), (
        f"docs/cli.md differs from the command line's parsers: run `{cli_reference.REGENERATE}` and commit it")


def test_every_command_flag_default_and_environment_variable_is_in_its_section():
    text = cli_reference.render(build_parser({}))
    flags = list(_every_flag(build_parser({})))
    commands = {command for command, _ in flags}
    assert {"structd grammar", "structd inference", "structd gateway", "structd up", "structd generate",
            "structd bench grammar", "structd bench sampler", "structd docs cli"} <= commands
    for command, action in flags:
        section = _section(text, command)
        assert f"- `{cli_reference._invocation(action)}`" in section, (command, action.option_strings)
        variable = getattr(action, "env_variable", None)
        if variable:
            assert f"env `{variable}`" in section, (command, variable)
    # The flags issue 23 found missing from the README's table.
    assert "--max-mask-cache-slots" in _section(text, "structd grammar")
    assert "--model-cache-dir" in _section(text, "structd inference")
    for service in ("grammar", "inference", "gateway"):
        assert f"env `STRUCTD_{service.upper()}_LOG_LEVEL`" in _section(text, f"structd {service}")


def test_the_environment_and_the_machine_do_not_leak_in(monkeypatch, capsys):
    clean = cli_reference.render(build_parser({}))
    monkeypatch.setenv("STRUCTD_GRAMMAR_PORT", "1234")  # a default from the environment
    monkeypatch.setenv("COLUMNS", "40")  # argparse wraps usage at the terminal's width
    assert main(["docs", "cli"]) == 0
    assert capsys.readouterr().out == clean
    grammar = _section(clean, "structd grammar")
    assert "- `--compile-workers COMPILE_WORKERS` (default one per CPU;" in grammar
    assert "- `--fill-threads FILL_THREADS` (default one per CPU;" in grammar
    assert str(cli_reference.REPO) not in clean


def test_every_computed_default_names_a_flag_that_exists():
    flags = {(command, flag) for command, action in _every_flag(build_parser({})) for flag in action.option_strings}
    assert set(cli_reference.COMPUTED_DEFAULTS) <= flags


def test_check_fails_on_a_stale_file_naming_the_command_and_write_fixes_it(tmp_path, capsys):
    path = tmp_path / "cli.md"
    path.write_text("# stale\n")
    assert main(["docs", "cli", "--check", "--path", str(path)]) == 1
    assert cli_reference.REGENERATE in capsys.readouterr().err
    assert main(["docs", "cli", "--write", "--path", str(path)]) == 0
    assert main(["docs", "cli", "--check", "--path", str(path)]) == 0
    assert path.read_text() == cli_reference.render(build_parser({}))


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


@pytest.mark.parametrize("argv", [
    pytest.param(["grammar", "--port", "0", "--compile-workers", "3"], id="grammar"),
    pytest.param(["inference", "--simulate-step-ms", "5", "--grammar-target", "a:1,b:2"], id="inference"),
    pytest.param(["gateway", "--port", "9000"], id="gateway"),
    pytest.param(["up", "--grammar-replicas", "2"], id="up"),
    pytest.param(["generate", "--choice", "yes", "Well?"], id="generate"),
    pytest.param(["bench", "soak", "--out", "/o", "--streams", "4"], id="bench"),
    pytest.param(["docs", "cli", "--check"], id="docs"),
])
def test_a_command_s_own_parser_reads_its_line_as_the_whole_parser_does(argv):
    """main() builds the named command's parser alone (a service's start skips the benchmarks' imports)."""
    own, whole = build_parser({}, only=argv[0]), build_parser({})
    assert _commands(own) == [argv[0]] and argv[0] in _commands(whole)
    got, want = vars(own.parse_args(argv)), vars(whole.parse_args(argv))
    assert got.pop("func").__qualname__ == want.pop("func").__qualname__
    assert got == want


def test_a_name_that_is_no_command_gets_the_whole_parser_and_its_list(capsys):
    assert _commands(build_parser({}, only="serve")) == _commands(build_parser({}))
    with pytest.raises(SystemExit):
        main(["serve"])
    err = capsys.readouterr().err
    assert "invalid choice: 'serve'" in err and all(f"'{c}'" in err for c in _commands(build_parser({})))
