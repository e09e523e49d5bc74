"""Tool calling: the tools a request offers, the grammar its calls are written under, and the parser that reads them.

A request's tools and tool choice become one xgrammar structural tag in the
model family's tool-call format (model_family.py), with each call's
arguments under its tool's parameters schema, as compact strict JSON (the
grammar tier's defaults for json_schema: "," and ":" separators, no free
whitespace, no properties beyond those listed), sent as the tag's
`json_schema` parts so that the grammar tier compiles them with structd's
JSON grammar (grammar_svc/compile/structural_tags.py). A family that writes
its arguments as parameter tags (model_family.XmlArguments) gets xgrammar's
grammar for them instead (its `json_schema` format in the family's XML
style), and the parser turns the tags back into one JSON object. The answer text then holds
the calls as markup; `ToolCallParser` cuts them out of the streamed text and
returns each one whole, so a client never sees part of the markup, and, for
clients that stream a call's arguments as they are written (OpenAI's
streamed tool_calls), the calls' pieces as their text arrives.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from inference_svc.api.model_family import KEY_FIELD, STRING_FIELD, ModelFamily, ToolCallFormat, XmlArguments
from inference_svc.types import Constraint, JsonOptions, ParsedToolCall, ToolCallDelta
from shared.errors import InvalidGrammarError, InvalidRequestError, RequestTooLargeError
from shared.json_nesting import check_nesting
from shared.xgrammar_messages import clean_message

MODES = ("auto", "required", "none", "named")
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_NAME_CHARS = re.compile(r"[a-zA-Z0-9_-]*")
_LEADING_SPACE = re.compile(r"\s*")  # what str.lstrip() strips
# A call's index (Kimi K2's functions.NAME:0): bounded, so that a model cannot write digits forever.
MAX_INDEX_DIGITS = 4
INDEX_PATTERN = re.compile(f"[0-9]{{1,{MAX_INDEX_DIGITS}}}")
# Whitespace the parameter-tag styles allow in a row between tags and around JSON values (xgrammar's
# max_whitespace_cnt; unbounded by default): the templates write a newline or two, and a model that keeps
# writing whitespace there would otherwise never finish its call.
MAX_XML_WHITESPACE = 4
# OpenAI's limit; a request-shape bound that keeps the tool grammar and the prompt's tool list sane.
MAX_TOOLS = 128
# Converted schemas kept (see _EbnfCache): at most this many, and this many bytes of EBNF in all.
EBNF_CACHE_ENTRIES = 256
EBNF_CACHE_BYTES = 32 << 20


def check_tool_bytes(tools: Sequence[tuple[str, str]], max_bytes: int) -> None:
    """Refuses tools whose parameters schemas, as (name, JSON text) pairs, pass `max_bytes` (UTF-8) together.

    Checked before any schema is parsed: a request that can never pass
    costs its size in bytes and nothing more (no JSON tree, no grammar).
    The message names the limit and the largest tool.
    """
    sizes = [(len(text.encode("utf-8", "surrogatepass")), name) for name, text in tools]
    total = sum(size for size, _ in sizes)
    if total <= max_bytes:
        return
    size, name = max(sizes)
    raise RequestTooLargeError(
        f"the tools' parameters schemas are {total} bytes (tool {name!r}: {size}); this server accepts at most "
        f"{max_bytes} in all (--max-tool-bytes)")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict | None = None  # JSON Schema of the arguments object; None: any object

    @staticmethod
    def from_json(name: str, description: str, parameters_json: str) -> ToolSpec:
        """A tool whose parameters schema is JSON text (empty: any object)."""
        if not parameters_json.strip():
            return ToolSpec(name, description)
        check_nesting(parameters_json, f"tool {name!r}: parameters")  # before json.loads recurses into it
        try:
            parameters = json.loads(parameters_json)
        except json.JSONDecodeError as e:  # the client's schema text
            raise InvalidRequestError(
                f"tool {name!r}: parameters is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
        if not isinstance(parameters, dict):
            raise InvalidRequestError(
                f"tool {name!r}: parameters must be a JSON Schema object, got {type(parameters).__name__}")
        return ToolSpec(name, description, parameters)

    def arguments_schema(self) -> dict:
        """The schema a call's arguments follow: always one for a JSON object."""
        if self.parameters is None:
            return {"type": "object"}
        if "type" not in self.parameters:
            return {"type": "object", **self.parameters}
        return self.parameters


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # one of MODES
    name: str = ""  # mode "named": the tool to call
    # Modes auto and required: the tools the model may call (OpenAI's allowed_tools); empty: all of them.
    allowed: tuple[str, ...] = ()

    def callable_tools(self, tools: Sequence[ToolSpec]) -> list[ToolSpec]:
        """The tools the grammar lets the model call (all are still shown to it)."""
        if self.mode == "named":
            return [t for t in tools if t.name == self.name]
        return [t for t in tools if t.name in self.allowed] if self.allowed else list(tools)


def validate_tools(tools: Sequence[ToolSpec], choice: ToolChoice) -> None:
    """Raises InvalidRequestError for tools or a tool choice that cannot be served."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"{len(tools)} tools given; at most {MAX_TOOLS} are accepted")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not NAME_PATTERN.fullmatch(tool.name):
            raise InvalidRequestError(
                f"tools[{i}]: name {tool.name!r} is not valid: use 1 to 64 letters, digits, '_' or '-'")
        if tool.name in seen:
            raise InvalidRequestError(f"tools[{i}]: the name {tool.name!r} is used by more than one tool")
        seen.add(tool.name)
        params = tool.parameters
        if params is not None:
            if not isinstance(params, dict):
                raise InvalidRequestError(
                    f"tool {tool.name!r}: parameters must be a JSON Schema object, got {type(params).__name__}")
            if params.get("type", "object") != "object":
                raise InvalidRequestError(
                    f"tool {tool.name!r}: parameters must describe a JSON object (\"type\": \"object\"), "
                    f"got \"type\": {json.dumps(params['type'])}")
    if choice.mode not in MODES:
        raise InvalidRequestError(f"tool_choice mode {choice.mode!r} is not one of {', '.join(MODES)}")
    if choice.mode == "named":
        if not choice.name:
            raise InvalidRequestError("tool_choice names no tool: give the name of the tool to call")
        if choice.name not in seen:
            raise InvalidRequestError(
                f"tool_choice names {choice.name!r}, which is not among the request's tools"
                + (f" ({', '.join(sorted(seen))})" if seen else ""))
    elif choice.name:
        raise InvalidRequestError(f"tool_choice gives a name ({choice.name!r}) but its mode is {choice.mode}: "
                                  "a name goes with mode named only")
    if choice.mode in ("required", "named") and not tools:
        raise InvalidRequestError(f"tool_choice {choice.mode} needs at least one tool in tools")
    if choice.allowed:
        if choice.mode not in ("auto", "required"):
            raise InvalidRequestError(f"tool_choice allowed_tools goes with mode auto or required, not {choice.mode}")
        for name in choice.allowed:
            if name not in seen:
                raise InvalidRequestError(
                    f"tool_choice allowed_tools names {name!r}, which is not among the request's tools"
                    + (f" ({', '.join(sorted(seen))})" if seen else ""))


def tool_call_structural_tag(family: ModelFamily | None, tools: Sequence[ToolSpec], choice: ToolChoice,
                             answer: Constraint | None = None, parallel: bool = True) -> dict | None:
    """The xgrammar structural tag (as a dict to json.dumps) for a request's tool calls, or None.

    auto: free text, in which every tool-call block is well formed and each
    call valid (any number of blocks, each with one or more calls); with an
    `answer` constraint, either the answer or one tool-call block.
    required: one block of one or more calls and nothing else. named: one
    block with exactly one call of that tool. The answer constraint does not
    apply to either (the model writes no text). None (tool_choice none, or
    auto without tools): the tools add nothing, and the request's own
    constraint (if any) applies unchanged. Only the choice's callable tools
    (its allowed_tools) have calls in the grammar. `parallel` false: at most
    one call in all, and the answer ends with it (xgrammar's
    stop_after_first).
    """
    validate_tools(tools, choice)
    if choice.mode == "none" or not tools:
        return None
    fmt = _tool_format(family)
    callable_tools = choice.callable_tools(tools)
    if choice.mode == "named":
        (tool,) = callable_tools
        return _structural_tag(_block(fmt, _call_tag(fmt, tool)))
    one = not parallel
    calls = _block(fmt, _calls(fmt, callable_tools, one))
    if choice.mode == "required":
        return _structural_tag(calls)
    if answer is not None:
        return _structural_tag({"type": "or", "elements": [_answer_format(answer), calls]})
    excludes = [m for m in (family.think_start, family.think_end) if m]
    if fmt.block_begin:
        auto = {"type": "triggered_tags", "triggers": [fmt.block_begin], "tags": [calls], "excludes": excludes,
                "stop_after_first": one}
    else:
        auto = {"type": "triggered_tags", "triggers": [fmt.call_prefix],
                "tags": [_call_tag(fmt, t) for t in callable_tools], "excludes": excludes, "stop_after_first": one}
    return _structural_tag(auto)


def _tool_format(family: ModelFamily | None) -> ToolCallFormat:
    if family is None or family.tool_calls is None:
        which = "this model's family is unknown" if family is None else f"model family {family.name!r} has none"
        raise InvalidRequestError(f"tools need a tool-call format, and {which}: send the request without tools, "
                                  "or start the server with --model-family")
    return family.tool_calls


def _structural_tag(fmt: dict) -> dict:
    return {"type": "structural_tag", "format": fmt}


def _call_tag(fmt: ToolCallFormat, tool: ToolSpec) -> dict:
    if fmt.arguments is None:
        content = _json_format(tool.arguments_schema(), f"tool {tool.name!r}: parameters")
    else:
        schema = tool.arguments_schema()
        _compact_json_ebnf(json.dumps(schema), f"tool {tool.name!r}: parameters")  # refuses a bad schema here
        content = {"type": "json_schema", "json_schema": schema, "style": fmt.arguments.style,
                   "max_whitespace_cnt": MAX_XML_WHITESPACE}
    if fmt.index_suffix is not None:
        # One tag serves every position in a list of calls, so the index is any number of up to MAX_INDEX_DIGITS.
        content = {"type": "sequence", "elements": [{"type": "regex", "pattern": INDEX_PATTERN.pattern},
                                                    {"type": "const_string", "value": fmt.index_suffix}, content]}
    return {"type": "tag", "begin": fmt.begin_for(tool.name), "content": content, "end": fmt.call_end}


def _calls(fmt: ToolCallFormat, tools: Sequence[ToolSpec], one: bool = False) -> dict:
    """One or more calls of any of `tools`, joined by the family's separator (`one`: exactly one)."""
    return {"type": "tags_with_separator", "tags": [_call_tag(fmt, t) for t in tools], "separator": fmt.separator,
            "at_least_one": True, "stop_after_first": one}


def _block(fmt: ToolCallFormat, calls: dict) -> dict:
    if not fmt.block_begin:
        return calls
    return {"type": "tag", "begin": fmt.block_begin, "content": calls, "end": fmt.block_end}


def _json_format(schema: object, what: str, options: JsonOptions = JsonOptions()) -> dict:
    if options.whitespace != "compact":
        raise InvalidRequestError(
            f"{what} with {options.whitespace} whitespace cannot be combined with tools: with tools, JSON is "
            "compact (leave json_options.whitespace unset)")
    text = json.dumps(schema, sort_keys=False)
    ebnf = _compact_json_ebnf(text, what, options.lenient, options.any_key_order)  # refuses a bad schema here
    if options == JsonOptions() and isinstance(schema, dict):
        # The grammar tier compiles a structural tag's json_schema parts with structd's JSON grammar,
        # compact and strict: the schema's fixes (JSON strings, kept types) hold inside tool calls too.
        return {"type": "json_schema", "json_schema": schema}
    return {"type": "grammar", "grammar": ebnf}


class _EbnfCache:
    """Converted schemas by a digest of their text: what it holds is bounded in bytes as well as in entries.

    Keyed by the full schema text, a cache of 256 would pin 256 client
    schemas of any size in the API process (docs/benchmarks.md, "Hostile
    input at the inference service"); here a key is 32 bytes and the
    values (the EBNF) count against EBNF_CACHE_BYTES, least recently used
    out first. Worker threads share it (the conversions run off the
    event loop).
    """

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(*parts: object) -> bytes:
        return hashlib.sha256(json.dumps(parts).encode("utf-8", "surrogatepass")).digest()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> str | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: bytes, value: str) -> None:
        if len(value) > self.max_bytes // 4:  # one huge grammar must not empty the cache of everyone else's
            return
        with self._lock:
            old = self._entries.pop(key, None)
            self.bytes -= len(old) if old is not None else 0
            self._entries[key] = value
            self.bytes += len(value)
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self.bytes -= len(dropped)


_EBNF_CACHE = _EbnfCache(EBNF_CACHE_ENTRIES, EBNF_CACHE_BYTES)


def _compact_json_ebnf(schema_text: str, what: str, lenient: bool = False, any_order: bool = False) -> str:
    """The schema as EBNF, as the grammar tier compiles json_schema by default (compact, strict).

    The structural tag's own json_schema format allows free whitespace
    between tokens; its grammar format takes this EBNF instead.
    """
    key = _EbnfCache.key(schema_text, lenient, any_order)
    cached = _EBNF_CACHE.get(key)
    if cached is None:
        cached = _convert(schema_text, what, lenient, any_order)
        _EBNF_CACHE.put(key, cached)
    return cached


def _convert(schema_text: str, what: str, lenient: bool, any_order: bool) -> str:
    import xgrammar as xgr

    try:
        grammar = xgr.Grammar.from_json_schema(schema_text, any_whitespace=False, separators=(",", ":"),
                                               strict_mode=not lenient, any_order=any_order)
    except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError) as e:  # the client's schema, refused
        raise InvalidGrammarError(f"{what} cannot be used as a JSON Schema: {clean_message(str(e))}") from None
    return str(grammar)


def _answer_format(answer: Constraint) -> dict:
    """The request's own constraint as a structural-tag format, for `or` with the tool calls."""
    if answer.kind in ("json_schema", "structural_tag"):
        check_nesting(answer.text, answer.kind)  # before json.loads recurses into it
    if answer.kind == "json_schema":
        try:
            schema = json.loads(answer.text)
        except json.JSONDecodeError as e:  # the client's schema text
            raise InvalidGrammarError(f"json_schema is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
                                      ) from None
        return _json_format(schema, "json_schema", answer.json_options)
    if answer.kind == "json_object":
        return _json_format({"type": "object"}, "json_object", answer.json_options)
    if answer.kind == "regex":
        return {"type": "regex", "pattern": answer.text}
    if answer.kind == "ebnf":
        return {"type": "grammar", "grammar": answer.text}
    if answer.kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in answer.choices]}
    try:
        tag = json.loads(answer.text)
    except json.JSONDecodeError as e:  # the client's structural tag text
        raise InvalidGrammarError(f"structural_tag is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
                                  ) from None
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
        raise InvalidRequestError(
            'with tools, a structural_tag constraint must be in xgrammar\'s format form ({"type": '
            '"structural_tag", "format": {...}}); the legacy form (structures and triggers) cannot be combined '
            "with tool calls")
    return tag["format"]


class ToolCallParser:
    """Splits one response's answer text into content and tool calls, as it streams.

    `push` each text delta and send what it returns; `finish` at the end.
    A tail that could be the start of markup is held back until it is known,
    and each call is returned once its end marker has arrived. Markup that
    does not parse (a model writing it without the grammar: tool_choice
    none, or no tools) is returned as content, never raised. Whitespace
    between calls and after the last one is layout, not content. With
    `tool_names`, a call of any other name is not a call.

    `take_deltas` gives the pieces of the calls as their text arrived since
    it was last called: a call's id and name once its name is complete, then
    its arguments text (none of the end marker). Under the tool grammar
    every call that starts completes, unless the response is cut short
    (max_tokens): then its pieces so far were given and its markup comes
    back as content.
    """

    def __init__(self, family: ModelFamily | None, tool_names: Collection[str] | None = None,
                 schemas: Mapping[str, dict] | None = None):
        self._fmt = _tool_format(family)
        self._names = None if tool_names is None else frozenset(tool_names)
        # Each tool's arguments schema: how a parameter tag's value is read (text or JSON) in an XML family.
        self._schemas = schemas or {}
        self._xml = None if self._fmt.arguments is None else _XmlReader(self._fmt.arguments, self._fmt.call_end)
        self._buf = ""  # text received and not yet returned
        self._in_block = False  # between calls of a block: a separator and a call, or the block's end, is next
        self._after_call = False  # whitespace here is layout until other text shows it is content
        self._num_calls = 0  # calls returned so far: the next call's index
        self._deltas: list[ToolCallDelta] = []
        # The call being read, once its name is known: its id and how much of its arguments text has been given.
        self._open_id = ""
        self._open_sent = 0  # characters of its arguments text given (JSON arguments)
        self._scan: _ObjectScan | None = None  # where the open call's JSON arguments close, read as they arrive
        # Parameter-tag arguments: the open call's parameters given so far (as JSON pairs), and where reading
        # its tags resumes in the buffer.
        self._xml_pairs: list[str] = []
        self._xml_stop = 0

    def push(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        # Held by one local name alone, the buffer grows in place (CPython); `self._buf += text` copied all of it.
        buf, self._buf = self._buf, ""
        buf += text
        self._buf = buf
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The rest: held text that never became a call is content."""
        return self._drain(final=True)

    def take_deltas(self) -> list[ToolCallDelta]:
        deltas, self._deltas = self._deltas, []
        return deltas

    def _drain(self, final: bool) -> tuple[str, list[ParsedToolCall]]:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        fmt = self._fmt
        while self._buf:
            if self._in_block:
                status, call, end = self._next_in_block(final)
                if status == "more":
                    break
                if status == "call":
                    calls.append(call)
                elif status == "end":
                    self._in_block, self._after_call = False, True
                else:  # not the block's continuation: what follows is text
                    self._in_block = False
                    continue
                self._buf = self._buf[end:]
                continue
            if self._after_call:
                rest = self._buf.lstrip()
                # Between calls without a block, the family's separator is layout too (gpt-oss's
                # "<|start|>assistant", Llama's "; ") when a call follows it.
                glue = "" if fmt.block_begin else fmt.separator.strip()
                after = rest[len(glue):].lstrip() if glue and rest.startswith(glue) else None
                if after is not None and after.startswith(fmt.trigger):
                    rest = after
                if not rest or (not final and (_could_start(rest, fmt.trigger) or _could_start(rest, glue) or (
                        after is not None and (not after or _could_start(after, fmt.trigger))))):
                    if final:
                        self._buf = ""
                    break
                self._after_call = False
                if rest.startswith(fmt.trigger):
                    self._buf = rest
            start = self._buf.find(fmt.trigger)
            if start < 0:
                keep = 0 if final else _held_tail(self._buf, fmt.trigger)
                content.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            content.append(self._buf[:start])
            self._buf = self._buf[start:]
            status, call, end = self._call_at(len(fmt.block_begin), final)
            if status == "more":
                break
            if status == "bad":  # not markup after all: its trigger is text, and the search goes on after it
                content.append(fmt.trigger)
                self._buf = self._buf[len(fmt.trigger):]
                continue
            calls.append(call)
            self._buf = self._buf[end:]
            if fmt.block_begin:
                self._in_block = True
            else:
                self._after_call = True
        if final:
            content.append(self._buf)
            self._buf, self._in_block, self._after_call = "", False, False
        return "".join(content), calls

    def _next_in_block(self, final: bool) -> tuple[str, ParsedToolCall | None, int]:
        fmt = self._fmt
        if self._buf.startswith(fmt.block_end):
            return "end", None, len(fmt.block_end)
        if self._buf.startswith(fmt.separator + fmt.call_prefix):
            return self._call_at(len(fmt.separator), final)
        if not final and (_could_start(self._buf, fmt.block_end) or
                          _could_start(self._buf, fmt.separator + fmt.call_prefix)):
            return "more", None, 0
        return "bad", None, 0

    def _call_at(self, pos: int, final: bool) -> tuple[str, ParsedToolCall | None, int]:
        """Parses one call starting at self._buf[pos]: ("call", call, end), "more" (text may still come) or "bad"."""
        fmt, buf = self._fmt, self._buf
        more = "bad" if final else "more"
        if not buf.startswith(fmt.call_prefix, pos):
            return (more if _could_start(buf[pos:], fmt.call_prefix) else "bad"), None, 0
        name_at = pos + len(fmt.call_prefix)
        name_end = _NAME_CHARS.match(buf, name_at).end()
        name = buf[name_at:name_end]
        if name_end == len(buf):
            return (more if len(name) <= 64 else "bad"), None, 0
        if not NAME_PATTERN.fullmatch(name) or (self._names is not None and name not in self._names):
            return "bad", None, 0
        if not buf.startswith(fmt.name_suffix, name_end):
            return (more if _could_start(buf[name_end:], fmt.name_suffix) else "bad"), None, 0
        args_at = name_end + len(fmt.name_suffix)
        if fmt.index_suffix is not None:
            digits = INDEX_PATTERN.match(buf, args_at)
            index_end = digits.end() if digits else args_at
            if index_end == len(buf):
                return more, None, 0
            if index_end == args_at:
                return "bad", None, 0
            if not buf.startswith(fmt.index_suffix, index_end):
                return (more if _could_start(buf[index_end:], fmt.index_suffix) else "bad"), None, 0
            args_at = index_end + len(fmt.index_suffix)
        if self._xml is not None:
            return self._xml_call_at(name, args_at, final)
        # Positions, not slices, of the growing buffer: a long argument is streamed a token at a time.
        args_at = _LEADING_SPACE.match(buf, args_at).end()  # the arguments' text starts at their "{"
        if args_at < len(buf) and buf[args_at] != "{":
            return "bad", None, 0
        self._open(name)
        if args_at < len(buf):
            if self._scan is None:
                self._scan = _ObjectScan(args_at)
            scan = self._scan
            closed = scan.close(buf)
            if closed >= 0 and scan.arguments is not None:
                # The call ends at the first end marker after the object, with only whitespace before it: an
                # earlier marker is inside the arguments (a string), and after other text none can follow.
                end = buf.find(fmt.call_end, closed)
                if 0 <= end <= _skip_space(buf, closed):
                    self._send_arguments(buf, args_at, end)
                    return "call", self._close(name, scan.arguments), end + len(fmt.call_end)
        if final:
            self._open_id = ""
            return "bad", None, 0
        # No end marker closes the arguments yet: all of the text is theirs but a tail that may yet become the
        # marker.
        self._send_arguments(buf, args_at, len(buf) - _held_tail(buf, fmt.call_end, args_at))
        return "more", None, 0

    def _xml_call_at(self, name: str, args_at: int, final: bool) -> tuple[str, ParsedToolCall | None, int]:
        """`_call_at` for arguments written as parameter tags: each parameter is given as JSON once it is closed."""
        xml, buf = self._xml, self._buf
        head_at = _LEADING_SPACE.match(buf, args_at).end()
        head = buf[head_at:head_at + max(len(xml.key_prefix), len(xml.call_end))]
        if head and not any(head.startswith(m) or _could_start(head, m) for m in (xml.key_prefix, xml.call_end)):
            return "bad", None, 0
        if not self._open_id:
            self._xml_pairs, self._xml_stop = [], args_at
        self._open(name)
        # The buffer only grows while a call is open: reading resumes after the parameters already given, so a
        # long argument streamed a token at a time is read once, not once per token.
        params, self._xml_stop = xml.parameters(buf, self._xml_stop, self._schemas.get(name))
        for key, value in params:
            pair = json.dumps(key, ensure_ascii=False) + ":" + _compact(value)
            self._deltas.append(ToolCallDelta(self._num_calls, arguments_fragment=("," if self._xml_pairs else "{")
                                              + pair))
            self._xml_pairs.append(pair)
        end = _skip_space(buf, self._xml_stop)
        if buf.startswith(xml.call_end, end):
            self._deltas.append(ToolCallDelta(self._num_calls, arguments_fragment="}" if self._xml_pairs else "{}"))
            arguments = "{" + ",".join(self._xml_pairs) + "}"
            return "call", self._close(name, arguments), end + len(xml.call_end)
        if final:
            self._open_id = ""
            return "bad", None, 0
        return "more", None, 0

    def _open(self, name: str) -> None:
        """The call being read has a name: its id and name are given once."""
        if not self._open_id:
            self._open_id = "call_" + secrets.token_hex(12)
            self._open_sent = 0
            self._scan = None
            self._deltas.append(ToolCallDelta(self._num_calls, self._open_id, name))

    def _close(self, name: str, arguments: str) -> ParsedToolCall:
        call = ParsedToolCall(self._open_id, name, arguments)
        self._open_id = ""
        self._num_calls += 1
        return call

    def _send_arguments(self, buf: str, start: int, stop: int) -> None:
        """Gives the open call's arguments text, buf[start:stop] (all of it known to be theirs), past what was given."""
        if stop - start > self._open_sent:
            self._deltas.append(ToolCallDelta(self._num_calls, arguments_fragment=buf[start + self._open_sent:stop]))
            self._open_sent = stop - start


class _ObjectScan:
    """Where a call's JSON arguments object closes, read once as its text grows.

    A JSON object ends exactly where its brackets first balance outside a string, so that is the only
    place its text can be followed by the call's end marker; json.loads runs once, there. Trying each end
    marker from the arguments' start instead cost a json.loads of the whole text per marker per streamed
    token: with Llama 3's "}" as the marker, code in an argument made a call cubic in its length.
    """

    _SIGNIFICANT = re.compile(r'["\\{}\[\]]')

    def __init__(self, start: int):
        self._start = start
        self._pos = start  # text before this position has been read
        self._depth = 0
        self._in_string = False
        self._escaped = False  # the text read ends inside a string's escape: the next character is escaped
        self.closed = -1  # the position just past the bracket that balances the first, once read
        self.arguments: str | None = None  # the object as compact JSON, once closed, if it is JSON

    def close(self, text: str) -> int:
        """Reads what `text` added since the last call; returns `closed` (-1 while the object is open)."""
        pos = self._pos
        while self.closed < 0 and pos < len(text):
            if self._escaped:
                pos, self._escaped = pos + 1, False
                continue
            found = self._SIGNIFICANT.search(text, pos)
            if found is None:
                pos = len(text)
                break
            char, pos = found.group(), found.end()
            if self._in_string:
                if char == '"':
                    self._in_string = False
                elif char == "\\":
                    self._escaped = True
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.closed = pos
                    self.arguments = _json_object(text[self._start:pos])
        self._pos = pos
        return self.closed


# A parameter tag's value that was meant as JSON and is not (yet): its end marker was inside it.
_NOT_JSON = object()
_SPACE = " \n\r\t"


class _XmlReader:
    """Reads a call's parameter tags (model_family.XmlArguments) back into (key, value) pairs.

    xgrammar's XML styles write a value as raw text where its property's
    schema takes a string, and as JSON otherwise (a property that takes
    either: JSON when it parses as a type the schema takes). xgrammar's
    grammar puts free whitespace around every value but a plain string
    (`"type": "string"` with no enum, const, length, pattern or format):
    there it is layout and dropped; a plain string keeps its own, but for
    the one newline on each side that Qwen3-Coder's template writes (code
    keeps its indentation and its last newline). A raw value ends at the first end
    marker (xgrammar's grammar excludes the marker from raw text); a JSON
    value at the first end marker after which it parses. Keys are read as
    the tool's declared property names first (a name may hold characters
    that a key pattern would stop at), then as any name.
    """

    def __init__(self, fmt: XmlArguments, call_end: str):
        self.key_prefix = fmt.key_prefix
        self.end = fmt.parameter_end
        self.call_end = call_end.lstrip(_SPACE)  # whitespace before it is layout
        self._fmt = fmt
        self._newline_layout = fmt.style == "qwen_xml"
        self._patterns: dict[tuple[str, ...], re.Pattern] = {}

    def _begin(self, names: tuple[str, ...]) -> re.Pattern:
        pattern = self._patterns.get(names)
        if pattern is None:
            declared = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
            key = f"(?P<key>{declared + '|' if declared else ''}[^<>\"\n]+?)"
            begin = re.escape(self._fmt.parameter_begin).replace(re.escape(KEY_FIELD), key)
            begin = begin.replace(re.escape(STRING_FIELD), "(?P<string>true|false)")
            value = f"[{_SPACE}]*" + re.escape(self._fmt.value_begin) if self._fmt.value_begin else ""
            pattern = self._patterns[names] = re.compile(begin + value)
        return pattern

    def parameters(self, text: str, pos: int, schema: dict | None) -> tuple[list[tuple[str, object]], int]:
        """The parameters closed in `text` from `pos`, and where the text after the last of them starts."""
        params: list[tuple[str, object]] = []
        props = schema.get("properties") if isinstance(schema, dict) else None
        props = props if isinstance(props, dict) else {}
        begin = self._begin(tuple(k for k in props if isinstance(k, str)))
        while (m := begin.match(text, _skip_space(text, pos))) is not None:
            key, value_at = m["key"], m.end()
            prop = _resolve(props.get(key), schema)
            end = text.find(self.end, value_at)
            while end >= 0:
                value = _xml_value(text[value_at:end], prop, schema, m.groupdict().get("string"),
                                   self._newline_layout)
                if value is not _NOT_JSON:
                    break
                end = text.find(self.end, end + 1)
            if end < 0:
                break
            params.append((key, value))
            pos = end + len(self.end)
        return params, pos


def _xml_value(text: str, schema: object, root: object, string: str | None, newline_layout: bool) -> object:
    """A parameter tag's value: raw text or JSON, as its property's schema (or DeepSeek's string=) says."""
    stripped = text.strip(_SPACE)
    types = _json_types(schema, root)
    plain = isinstance(schema, dict) and schema.get("type") == "string" and not any(
        k in schema for k in ("enum", "const", "maxLength", "minLength", "pattern", "format"))
    raw = (_unwrap_newlines(text) if newline_layout else text) if plain else stripped
    if string == "true" or (string is None and types == {"string"}):
        return raw
    try:
        value = json.loads(stripped, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # the model's text: not JSON (raw text, or cut by an end marker inside it)
        return raw if string is None and (types is None or "string" in types) else _NOT_JSON
    if isinstance(value, float) and not math.isfinite(value):  # 1e400: JSON has no such number, keep the text
        return stripped
    if string == "false":
        return value
    kind = _json_type(value)
    if types is None:  # a property without a type: raw text, or a JSON array or object (xgrammar's xml_any)
        return value if kind in ("array", "object") else raw
    if kind in types or (kind == "integer" and "number" in types):
        return value if kind != "string" else raw
    return raw if "string" in types else _NOT_JSON


def _unwrap_newlines(text: str) -> str:
    """Text less the one newline on each side that Qwen3-Coder's template puts around a value."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def _resolve(schema: object, root: object, depth: int = 0) -> object:
    """`schema` with a local $ref followed (into the tool's own schema), as xgrammar's grammar follows it."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 32:
        ref = schema["$ref"]
        if not ref.startswith("#"):
            return schema
        node = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        schema, depth = node, depth + 1
    return schema


def _json_types(schema: object, root: object = None) -> set[str] | None:
    """The JSON types `schema` admits, or None where it does not say."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return {_json_type(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {_json_type(v) for v in schema["enum"]}
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            branches = [_json_types(b, root) for b in schema[key]]
            return None if any(b is None for b in branches) else set().union(*branches)
    if isinstance(schema.get("allOf"), list):
        said = [t for t in (_json_types(b, root) for b in schema["allOf"]) if t is not None]
        return set.intersection(*said) if said else None
    return None


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _SPACE:
        pos += 1
    return pos


def _could_start(text: str, marker: str) -> bool:
    """`text` is a proper prefix of `marker`: more text may complete it."""
    return len(text) < len(marker) and marker.startswith(text)


def _held_tail(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest end of text[start:] that is a proper prefix of `marker`."""
    for n in range(min(len(text) - start, len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _json_object(text: str) -> str | None:
    """`text` as compact JSON when it is one JSON object, else None."""
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # the model's text: not a JSON object, or nested past what json reads
        return None
    if not isinstance(value, dict):
        return None
    return _compact(value)
