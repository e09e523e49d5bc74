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

A family whose calls write their arguments as XML-like parameter tags
(Qwen3-Coder's `<parameter=KEY>VALUE</parameter>`, GLM's, MiniMax's,
DeepSeek V3.2's DSML) says so in `tool_calls.arguments`:

      "arguments": {
        "style": "qwen_xml",
        "parameter_begin": "<parameter={key}>",
        "value_begin": "",
        "parameter_end": "</parameter>"
      }

`style` is xgrammar's name for the format (its `json_schema` format's
`style`: xgrammar writes the grammar of these arguments), the rest is what
the parser reads: each parameter as `parameter_begin` (with the key for
`{key}`, and `true` or `false` for `{string}` where the family says whether
the value is raw text), optional whitespace, `value_begin`, the value and
`parameter_end`, whitespace between parameters. A value is raw text where
its property's schema takes a string, else JSON (see tool_calls.py).
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
_TOOL_FIELDS = {"block_begin": str, "call_begin": str, "call_end": str, "separator": str, "block_end": str,
                "arguments": dict}
_ARGUMENT_FIELDS = {"style": str, "parameter_begin": str, "value_begin": str, "parameter_end": str}
KEY_FIELD = "{key}"
STRING_FIELD = "{string}"
# xgrammar 0.2.8's parameter-tag styles whose markup is one tag per parameter (the recursive ones, Cohere's,
# MiniMax M3's and Kimi K3's, are not: README lists them as not bundled).
XML_STYLES = ("qwen_xml", "glm_xml", "minimax_xml", "deepseek_xml", "deepseek_v4_1_xml")


class ModelFamilyError(ValueError):
    """A family file that cannot be used (the server's configuration, not a request)."""


@dataclass(frozen=True)
class XmlArguments:
    """How a family writes a call's arguments as parameter tags (see the module docstring)."""

    style: str  # one of XML_STYLES
    parameter_begin: str  # contains "{key}" once, and "{string}" at most once after it
    parameter_end: str
    value_begin: str = ""

    @property
    def key_prefix(self) -> str:
        """The text of `parameter_begin` before the key: what starts a parameter."""
        return self.parameter_begin.split(KEY_FIELD, 1)[0]

    def parameter_text(self, key: str, value: str, raw: bool) -> str:
        """One parameter as the model writes it (`raw`: `value` is text, not JSON)."""
        begin = self.parameter_begin.replace(KEY_FIELD, key).replace(STRING_FIELD, "true" if raw else "false")
        return begin + self.value_begin + value + self.parameter_end


@dataclass(frozen=True)
class ToolCallFormat:
    """How a family writes tool calls in its answer text (see the module docstring)."""

    call_begin: str  # contains "{name}" once
    call_end: str
    separator: str = ""
    block_begin: str = ""
    block_end: str = ""
    arguments: XmlArguments | None = None  # None: the arguments are one JSON object

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
        """One whole call as the model writes it, from its arguments as a JSON object's text."""
        number = "" if self.index_suffix is None else f"{index}{self.index_suffix}"
        return self.begin_for(name) + number + self.arguments_text(arguments) + self.call_end

    def arguments_text(self, arguments: str) -> str:
        """A call's arguments as the model writes them, from their JSON object text."""
        if self.arguments is None:
            return arguments
        parts = []
        for key, value in json.loads(arguments).items():
            raw = isinstance(value, str)
            parts.append(self.arguments.parameter_text(key, value if raw else json.dumps(value, ensure_ascii=False),
                                                       raw))
        return "".join(parts)


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
        if f.arguments is not None:  # GLM's <arg_key> and <arg_value> are special tokens of its tokenizer
            a = f.arguments
            markup += (a.parameter_begin, a.value_begin, a.parameter_end)
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
    f = dict(_fields(data, _TOOL_FIELDS, source, "tool_calls."))
    arguments = _xml_arguments(f.pop("arguments"), source) if "arguments" in f else None
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
    if not f["call_begin"].split(NAME_FIELD, 1)[1].split(INDEX_FIELD, 1)[0] and arguments is None:
        # Parameter tags start with "<" or whitespace, never a name's character: they end the name themselves.
        raise ModelFamilyError(f"{source}: field 'tool_calls.call_begin' must have text after {NAME_FIELD} (it is "
                               "where the name ends)")
    if bool(f.get("block_begin")) != bool(f.get("block_end")):
        raise ModelFamilyError(f"{source}: fields 'tool_calls.block_begin' and 'tool_calls.block_end' go together: "
                               "give both or neither")
    fmt = ToolCallFormat(**f, arguments=arguments)
    if not fmt.trigger:
        raise ModelFamilyError(f"{source}: without a block, 'tool_calls.call_begin' must start with text before "
                               f"{NAME_FIELD} (it is what marks a call in free text)")
    return fmt


def _xml_arguments(data: object, source: str) -> XmlArguments:
    a = _fields(data, _ARGUMENT_FIELDS, source, "tool_calls.arguments.")
    where = f"{source}: field 'tool_calls.arguments."
    if a.get("style") not in XML_STYLES:
        raise ModelFamilyError(f"{where}style' must be one of {', '.join(XML_STYLES)} (xgrammar's parameter-tag "
                               f"styles), got {a.get('style')!r}")
    begin, end = a.get("parameter_begin", ""), a.get("parameter_end", "")
    if begin.count(KEY_FIELD) != 1 or not begin.split(KEY_FIELD, 1)[0] or not begin.split(KEY_FIELD, 1)[1]:
        raise ModelFamilyError(f"{where}parameter_begin' must contain {KEY_FIELD} once, with text before and after "
                               f"it, got {begin!r}")
    if begin.count(STRING_FIELD) > 1 or STRING_FIELD in begin.split(KEY_FIELD, 1)[0]:
        raise ModelFamilyError(f"{where}parameter_begin' may contain {STRING_FIELD} once, after {KEY_FIELD}, "
                               f"got {begin!r}")
    if not end:
        raise ModelFamilyError(f"{where}parameter_end' is required and non-empty")
    return XmlArguments(**a)


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
