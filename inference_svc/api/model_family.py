"""Model families: how a model writes its thinking and its tool calls, as data.

A family is one small JSON file (the bundled ones are in `inference_svc/model_families/`;
`--model-family` may name one of them or give a path to another):

    {
      "name": "deepseek",
      "description": "free text for people",
      "detect_tokens": ["<｜tool▁calls▁begin｜>", ...],
      "think": {"start": "<think>", "end": "</think>"},
      "tool_calls": {
        "block_begin": "<｜tool▁calls▁begin｜>",
        "call_begin": "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>",
        "call_end": "<｜tool▁call▁end｜>",
        "separator": "",
        "block_end": "<｜tool▁calls▁end｜>"
      }
    }

A model's answer holds its calls as `block_begin`, then one or more calls
`call_begin` (with the tool's name for `{name}`), the arguments object as
JSON, `call_end`, joined by `separator`, then `block_end`. A family without
a block (both empty) writes each call on its own, `separator` between
consecutive calls. `call_begin` may also hold `{index}` after the name, where
the model writes the call's number (Kimi K2's `functions.NAME:0`): digits,
which the parser reads and does not return. `think` and `tool_calls` are optional: a family may have
neither thinking nor tools. `detect_tokens` are the strings that must all be
single tokens of a tokenizer's vocabulary for `detect_family` to pick the
family; the bundled families are tried in file-name order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

FAMILY_DIR = Path(__file__).parent.parent / "model_families"
NAME_FIELD = "{name}"
INDEX_FIELD = "{index}"

_TOP_FIELDS = {"name": str, "description": str, "detect_tokens": list, "think": dict, "tool_calls": dict}
_THINK_FIELDS = {"start": str, "end": str}
_TOOL_FIELDS = {"block_begin": str, "call_begin": str, "call_end": str, "separator": str, "block_end": str}


class ModelFamilyError(ValueError):
    """A family file that cannot be used (the server's configuration, not a request)."""


@dataclass(frozen=True)
class ToolCallFormat:
    """How a family writes tool calls in its answer text (see the module docstring)."""

    call_begin: str  # contains "{name}" once
    call_end: str
    separator: str = ""
    block_begin: str = ""
    block_end: str = ""

    @property
    def call_prefix(self) -> str:
        """The text of `call_begin` before the tool's name."""
        return self.call_begin.split(NAME_FIELD, 1)[0]

    @property
    def name_suffix(self) -> str:
        """The text of `call_begin` after the tool's name (up to the index, in a format with one)."""
        return self.call_begin.split(NAME_FIELD, 1)[1].split(INDEX_FIELD, 1)[0]

    @property
    def index_suffix(self) -> str | None:
        """The text of `call_begin` after the call's index; None: the format writes no index."""
        parts = self.call_begin.split(INDEX_FIELD, 1)
        return parts[1] if len(parts) == 2 else None

    @property
    def trigger(self) -> str:
        """What starts tool-call markup in free text: the block's begin, else a call's prefix."""
        return self.block_begin or self.call_prefix

    def begin_for(self, name: str) -> str:
        """The call's text before its arguments (before its index, in a format with one)."""
        return self.call_prefix + name + self.name_suffix

    def call_text(self, name: str, arguments: str, index: int = 0) -> str:
        """One whole call as the model writes it."""
        number = "" if self.index_suffix is None else f"{index}{self.index_suffix}"
        return self.begin_for(name) + number + arguments + self.call_end


@dataclass(frozen=True)
class ModelFamily:
    name: str
    think_start: str | None = None
    think_end: str | None = None
    tool_calls: ToolCallFormat | None = None
    detect_tokens: tuple[str, ...] = ()
    description: str = ""

    def think_token_ids(self, vocab: Mapping[str, int]) -> tuple[int, int] | None:
        """(think-start id, end-of-thinking id) when both markers are single tokens of `vocab`, else None."""
        if self.think_start is None or self.think_end is None:
            return None
        start, end = vocab.get(self.think_start), vocab.get(self.think_end)
        return None if start is None or end is None else (start, end)

    def markup_ids(self, tokens: Mapping[int, str]) -> frozenset[int]:
        """Of `tokens` (id -> text), those whose text is part of the tool-call markup.

        Kimi's and gpt-oss's tokenizers mark their tool-call tokens special,
        and decoding drops special tokens: these must stay in the answer's
        text for the parser to find the calls.
        """
        if self.tool_calls is None:
            return frozenset()
        f = self.tool_calls
        markup = (f.block_begin, f.call_begin, f.call_end, f.separator, f.block_end)
        return frozenset(i for i, text in tokens.items() if text and any(text in m for m in markup))


def bundled_names() -> list[str]:
    """The bundled families, in detection order."""
    return sorted(p.stem for p in FAMILY_DIR.glob("*.json"))


def load_family(name_or_path: str | Path) -> ModelFamily:
    """A bundled family by name ("deepseek"), or the family in a JSON file."""
    text = str(name_or_path)
    if text in bundled_names():
        return _load_file(FAMILY_DIR / f"{text}.json")
    path = Path(name_or_path)
    if path.is_file():
        return _load_file(path)
    raise ModelFamilyError(
        f"unknown model family {text!r}: give one of {', '.join(bundled_names())} or the path of a family JSON file")


def detect_family(vocab: Mapping[str, int]) -> ModelFamily | None:
    """The first bundled family whose detect tokens are all tokens of `vocab` (None: no family matches)."""
    for name in bundled_names():
        family = load_family(name)
        if family.detect_tokens and all(t in vocab for t in family.detect_tokens):
            return family
    return None


def _load_file(path: Path) -> ModelFamily:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:  # the operator's file: unreadable
        raise ModelFamilyError(f"{path}: cannot read model family file: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # the operator's file: not JSON
        raise ModelFamilyError(f"{path}: not valid JSON: {e}") from None
    return parse_family(data, str(path))


def parse_family(data: object, source: str) -> ModelFamily:
    """A family from its parsed JSON; errors name `source` and the field."""
    top = _fields(data, _TOP_FIELDS, source, "")
    name = top.get("name", "")
    if not name:
        raise ModelFamilyError(f"{source}: field 'name' is required (a non-empty string)")
    detect = top.get("detect_tokens", [])
    if not all(isinstance(t, str) and t for t in detect):
        raise ModelFamilyError(f"{source}: field 'detect_tokens' must be a list of non-empty strings")
    think_start = think_end = None
    if "think" in top:
        think = _fields(top["think"], _THINK_FIELDS, source, "think.")
        think_start, think_end = think.get("start"), think.get("end")
        if not think_start or not think_end:
            raise ModelFamilyError(f"{source}: fields 'think.start' and 'think.end' are both required and non-empty")
    tool_calls = _tool_format(top["tool_calls"], source) if "tool_calls" in top else None
    return ModelFamily(name=name, think_start=think_start, think_end=think_end, tool_calls=tool_calls,
                       detect_tokens=tuple(detect), description=top.get("description", ""))


def _tool_format(data: object, source: str) -> ToolCallFormat:
    f = _fields(data, _TOOL_FIELDS, source, "tool_calls.")
    for key in ("call_begin", "call_end"):
        if not f.get(key):
            raise ModelFamilyError(f"{source}: field 'tool_calls.{key}' is required and non-empty")
    if f["call_begin"].count(NAME_FIELD) != 1:
        raise ModelFamilyError(
            f"{source}: field 'tool_calls.call_begin' must contain {NAME_FIELD} exactly once (where the tool's name "
            f"goes), got {f['call_begin']!r}")
    for key, value in f.items():
        if INDEX_FIELD in value and (key != "call_begin" or value.count(INDEX_FIELD) > 1
                                     or value.index(INDEX_FIELD) < value.index(NAME_FIELD)):
            raise ModelFamilyError(f"{source}: {INDEX_FIELD} may appear once, in 'tool_calls.call_begin' after "
                                   f"{NAME_FIELD} (where the call's number goes), got {key} {value!r}")
    if not f["call_begin"].split(NAME_FIELD, 1)[1].split(INDEX_FIELD, 1)[0]:
        raise ModelFamilyError(f"{source}: field 'tool_calls.call_begin' must have text after {NAME_FIELD} (it is "
                               "where the name ends)")
    if bool(f.get("block_begin")) != bool(f.get("block_end")):
        raise ModelFamilyError(f"{source}: fields 'tool_calls.block_begin' and 'tool_calls.block_end' go together: "
                               "give both or neither")
    fmt = ToolCallFormat(**f)
    if not fmt.trigger:
        raise ModelFamilyError(f"{source}: without a block, 'tool_calls.call_begin' must start with text before "
                               f"{NAME_FIELD} (it is what marks a call in free text)")
    return fmt


def _fields(data: object, spec: dict[str, type], source: str, prefix: str) -> dict:
    if not isinstance(data, dict):
        where = f"field '{prefix.rstrip('.')}'" if prefix else "the file"
        raise ModelFamilyError(f"{source}: {where} must be a JSON object")
    unknown = sorted(set(data) - set(spec))
    if unknown:
        raise ModelFamilyError(f"{source}: unknown field '{prefix}{unknown[0]}' (known: {', '.join(spec)})")
    for key, value in data.items():
        if not isinstance(value, spec[key]):
            raise ModelFamilyError(
                f"{source}: field '{prefix}{key}' must be a {_JSON_TYPE[spec[key]]}, got {type(value).__name__}")
    return data


_JSON_TYPE = {str: "string", list: "list", dict: "JSON object"}
