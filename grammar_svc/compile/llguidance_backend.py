"""llguidance as the grammar service's second backend: its grammars and a matcher with xgrammar's interface.

xgrammar compiles a whole grammar ahead (per-state token-mask caches), which
makes its masks cheap and a large schema's compile cost seconds to minutes;
llguidance builds its lexer and parser lazily, so a grammar is ready at once
and each mask is computed when asked for. The service serves a grammar from
either (backend.py chooses, per request); sessions (step/session.py) and the
mask filler see one matcher interface, xgrammar's GrammarMatcher's:
`LlguidanceMatcher` gives llguidance's LLMatcher that interface, so masks
(same vocabulary, same 32-bit word packing), accept, rollback, jump-forward
and replay behave on the wire as an xgrammar session's do.

Differences it papers over:
- an LLMatcher that consumes a token its mask forbids enters an error state
  for good; xgrammar rejects the token and stays where it was: tokens are
  offered with try_consume_tokens, which leaves the state as it was;
- xgrammar terminates on a stop token only (or, with
  terminate_without_stop_token, as soon as the grammar may end); llguidance
  also "stops" where nothing but a stop token can follow: termination is
  tracked here, xgrammar's way;
- xgrammar returns the forced string as str; llguidance as bytes.

The tokenizer llguidance gets is built from the registered TokenizerInfo
(the same token bytes, vocabulary size and stop tokens as xgrammar's), with
the registered tokenizer.json's encoder for the forced text it tokenizes
itself (else llguidance's greedy tokenization of the same vocabulary).

llguidance is imported where it is used, never at this module's import: an
image without it (a custom image, a platform with no wheel) still runs the
service on xgrammar. `probe_llguidance` finds out once, at the service's
start, whether it imports; backend.py then never calls into it where it
does not.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
import sys
import threading
from dataclasses import dataclass, field

from grammar_svc.types import JsonOptions, Kind, Whitespace
from shared.errors import InvalidGrammarError

XGRAMMAR = "xgrammar"
LLGUIDANCE = "llguidance"
# Also the service's default: xgrammar unless it refuses a grammar or compiles it too slowly.
AUTO = "auto"
# Bump whenever grammar_text can give a spec a different llguidance grammar (part of its grammar id).
GRAMMAR_REVISION = "llguidance-16"

_TOKENIZER_LOCK = threading.Lock()


@dataclass(frozen=True)
class LlguidanceAvailability:
    """Whether llguidance imports in this process: found once, at the service's start (probe_llguidance)."""

    version: str | None  # None: it does not import
    problem: str = ""  # why not, as the import failed

    @property
    def available(self) -> bool:
        return self.version is not None

    def why_missing(self) -> str:
        return f"llguidance does not import on this grammar replica ({self.problem})"


def probe_llguidance(import_module=importlib.import_module) -> LlguidanceAvailability:
    """Imports llguidance (`import_module` is the importer; the service passes the standard one) and says whether
    it worked and which version it is."""
    try:
        module = import_module("llguidance")
    except Exception as e:  # noqa: BLE001 - the image's: the package is missing or broken (a wheel for another
        # platform or glibc); the service runs on xgrammar alone and says why, never per request
        return LlguidanceAvailability(None, f"{type(e).__name__}: {e}")
    try:
        version = importlib.metadata.version("llguidance")
    except importlib.metadata.PackageNotFoundError:  # the image's: installed without its metadata (vendored)
        version = str(getattr(module, "__version__", "unknown version"))
    return LlguidanceAvailability(version)


def install_hint() -> str:
    """The pip command that installs the llguidance structd's grammar extra pins (read from structd's metadata,
    so it cannot drift from pyproject.toml)."""
    try:
        requirements = importlib.metadata.requires("structd") or []
    except importlib.metadata.PackageNotFoundError:  # the image's: structd run from a source tree, not installed
        requirements = []
    pinned = next((r.split(";")[0].strip() for r in requirements if re.match(r"llguidance\b", r)), "llguidance")
    return f"pip install '{pinned}'"


@dataclass(frozen=True)
class LlguidanceGrammar:
    """A grammar llguidance has validated against a tokenizer: what a CompiledEntry holds for this backend."""

    grammar: str  # llguidance's grammar JSON
    tokenizer: object  # llguidance.LLTokenizer
    stop_token_ids: frozenset[int]
    # A matcher in the start state that sessions copy: a copy costs far less than building the grammar's
    # matcher again, which a large schema makes expensive.
    start: object = field(compare=False, repr=False, default=None)
    # What llguidance ignores or approximates in it, one line each (CompileResponse.warnings).
    warnings: tuple[str, ...] = ()

    @property
    def memory_size_bytes(self) -> int:
        # The grammar text is all that is kept: lexer and parser tables are built per matcher.
        return sys.getsizeof(self.grammar)


class _Encoder:
    """llguidance.TokenizerWrapper's tokenizer: text -> token ids of the registered vocabulary."""

    def __init__(self, tokens: list[bytes], stop_token_ids: list[int], special_token_ids: list[int], encode):
        self.eos_token_id = stop_token_ids[0] if stop_token_ids else None
        self.bos_token_id = None
        self.tokens = tokens
        self.special_token_ids = special_token_ids
        self._encode = encode

    def __call__(self, text):
        if isinstance(text, bytes):
            # TokenizerWrapper asks once whether bytes are taken; str is what both encoders read.
            raise TypeError("str only")
        return self._encode(text)


def llguidance_tokenizer(tok):
    """The registered tokenizer's llguidance LLTokenizer, built once per tokenizer and kept beside it (the build
    holds the GIL for seconds at 129k tokens: backend.py builds it at registration)."""
    holder = tok.llguidance
    built = holder.get("tokenizer")
    if built is not None:
        return built
    with _TOKENIZER_LOCK:
        built = holder.get("tokenizer")
        if built is None:
            built = _build_tokenizer(tok)
            holder["tokenizer"] = built
    return built


def _build_tokenizer(tok):
    import llguidance

    info = tok.info
    stops = [int(t) for t in info.stop_token_ids]
    # Stop tokens are special too: llguidance reads a token not marked special as its text, and a stop token's
    # text ("<｜end▁of▁sentence｜>") fits in a JSON string, so masks inside a string allowed ending there.
    specials = list(dict.fromkeys([int(t) for t in info.special_token_ids] + stops))
    tokens = list(tok.token_bytes)
    if tok.hf_tokenizer is not None:
        hf = tok.hf_tokenizer

        def encode(text: str) -> list[int]:
            return list(hf.encode(text, add_special_tokens=False).ids)
    else:
        greedy = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Encoder(tokens, stops, specials, lambda s: [])),
                                        n_vocab=tok.vocab_size, eos_token=stops or None)
        encode = greedy.greedy_tokenize
    wrapper = llguidance.TokenizerWrapper(_Encoder(tokens, stops, specials, encode))
    return llguidance.LLTokenizer(wrapper, n_vocab=tok.vocab_size, eos_token=stops or None)


def json_compile_options(options: JsonOptions) -> dict:
    """llguidance's JSON options for structd's; indented layout has no llguidance form."""
    if options.whitespace is Whitespace.INDENTED:
        raise InvalidGrammarError("the llguidance grammar backend cannot lay out indented JSON; use compact or "
                                  "flexible whitespace, or the xgrammar backend")
    if options.any_key_order:
        raise InvalidGrammarError("the llguidance grammar backend writes properties in schema order only; drop "
                                  "any_key_order, or use the xgrammar backend")
    # lenient: keywords llguidance does not implement are ignored and named in the compile warnings, and
    # coerce_one_of: oneOf is applied as anyOf (warned), as xgrammar does with both; the output check reports
    # a document that breaks them.
    out: dict = {"item_separator": ",", "key_separator": ":", "lenient": True, "coerce_one_of": True}
    if options.whitespace is Whitespace.COMPACT:
        out["whitespace_flexible"] = False
    else:
        out["whitespace_flexible"] = True
        out["whitespace_pattern"] = r"[\x20\x0A\x0D\x09]{0,%d}" % options.max_whitespace_count
    return out


def _closed_objects(node, strict: bool):
    """Strict mode's objects (xgrammar's strict_mode): no properties beyond those named where the schema
    says nothing about others."""
    if isinstance(node, list):
        return [_closed_objects(n, strict) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed_objects(v, strict) if k not in ("const", "enum", "default", "examples") else v
           for k, v in node.items()}
    if strict and "properties" in out and not any(
            k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def grammar_text(spec) -> str:
    """llguidance's grammar for a spec (structd's schema normalisation applied first; it is about the schema)."""
    import llguidance

    if spec.kind is Kind.JSON_SCHEMA or spec.kind is Kind.JSON_OBJECT:
        from grammar_svc.schema.json_grammar import normalised_schema_text
        from grammar_svc.schema.llguidance_schema import llguidance_schema

        text = spec.text if spec.kind is Kind.JSON_SCHEMA else '{"type": "object"}'
        schema = llguidance_schema(json.loads(normalised_schema_text(text)))
        schema = _closed_objects(schema, not spec.json_options.lenient)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=json_compile_options(spec.json_options))
    if spec.kind is Kind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind is Kind.CHOICE:
        # Lark string literals read JSON's escapes.
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.text))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    if spec.kind is Kind.EBNF:
        from llguidance.gbnf_to_lark import gbnf_to_lark

        text = spec.text if spec.root_rule == "root" else f"root ::= {spec.root_rule}\n{spec.text}"
        try:
            lark = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - the converter's parse error is the grammar's
            raise InvalidGrammarError(f"ebnf grammar does not convert to llguidance's Lark: {e}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise InvalidGrammarError(f"the llguidance grammar backend does not serve {spec.kind.value} constraints; "
                              "use the xgrammar backend")


def compile_llguidance(tok, spec) -> LlguidanceGrammar:
    """The spec's llguidance grammar, validated against the tokenizer; InvalidGrammarError where llguidance
    refuses it. Blocking (llguidance releases the GIL while it builds the grammar): call off the event loop."""
    import llguidance

    tokenizer = llguidance_tokenizer(tok)
    try:
        grammar = grammar_text(spec)
    except ValueError as e:  # llguidance's: the schema is not one it reads
        raise InvalidGrammarError(f"{spec.kind.value} is refused by llguidance: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise InvalidGrammarError(f"{spec.kind.value} is refused by llguidance: {messages[0] if messages else ''}")
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidGrammarError(f"{spec.kind.value} is refused by llguidance: {matcher.get_error()}")
    return LlguidanceGrammar(grammar, tokenizer, frozenset(int(t) for t in tok.info.stop_token_ids), matcher,
                             tuple(_warning_lines(messages)))


def llguidance_only_features(text: str) -> list[str]:
    """JSON pointers of what llguidance enforces and xgrammar 0.2.8 ignores in a JSON schema, found by compiling
    each JSON Schema keyword with both and walking a valid and an invalid document through each (issue 26):
    only `multipleOf` on numbers (xgrammar warns and drops it; llguidance checks it exactly). Conservative:
    an unreadable schema has none."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):  # the schema's (not JSON, or nested past json's recursion): the compile
        return []                         # that follows refuses it, naming why
    found, stack = [], [("", schema)]
    while stack:
        pointer, node = stack.pop()
        if isinstance(node, list):
            stack += [(f"{pointer}/{i}", v) for i, v in enumerate(node)]
            continue
        if not isinstance(node, dict):
            continue
        t = node.get("type")
        if "multipleOf" in node and (t == "number" or (isinstance(t, list) and "number" in t)):
            found.append(f"{pointer}/multipleOf")
        stack += [(f"{pointer}/{k.replace('~', '~0').replace('/', '~1')}", v) for k, v in node.items()
                  if k not in ("const", "enum", "default", "examples")]
    return found


def ignored_beyond_xgrammar(warnings) -> list[str]:
    """The keywords llguidance's compile warnings say it ignores and xgrammar enforces, in order, once each."""
    from grammar_svc.schema.schema_warnings import IGNORED_KEYWORDS

    # then/else come with if; both apply oneOf as anyOf; unknown formats are ignored by both.
    shared = set(IGNORED_KEYWORDS) | {"then", "else", "oneOf", "Unknown"}
    return list(dict.fromkeys(line.split(" ", 1)[0] for line in warnings if line.split(" ", 1)[0] not in shared))


def ignores_only_what_xgrammar_ignores(warnings) -> bool:
    """Whether serving the grammar from llguidance loses nothing xgrammar's would have enforced."""
    return not ignored_beyond_xgrammar(warnings)


_UNIMPLEMENTED = re.compile(r"^Unimplemented keys: (\[.*?\])(?: \(\d+ times\))?$")


def _warning_lines(messages: list[str]) -> list[str]:
    """llguidance's warnings as compile warning lines, each led by the keyword it is about."""
    out = []
    for message in messages:
        keys = _UNIMPLEMENTED.match(message)
        try:
            names = json.loads(keys.group(1)) if keys else None
        except ValueError:
            names = None
        if isinstance(names, list):
            out += [f"{name} is ignored (llguidance does not implement it)" for name in names]
        else:
            out.append(message)
    return out


class LlguidanceMatcher:
    """An llguidance LLMatcher behind the part of xgrammar's GrammarMatcher interface sessions use."""

    __slots__ = ("_m", "_stops", "_terminate_without_stop", "_stopped")

    def __init__(self, compiled: LlguidanceGrammar, *, terminate_without_stop_token: bool = False):
        self._m = compiled.start.deep_copy()
        if self._m.is_error():
            raise InvalidGrammarError(f"llguidance matcher failed: {self._m.get_error()}")
        self._stops = compiled.stop_token_ids
        self._terminate_without_stop = terminate_without_stop_token
        # Whether the last token accepted was a stop token: termination is xgrammar's, not llguidance's.
        self._stopped = False

    def accept_token(self, token: int) -> bool:
        if self.is_terminated():
            return False
        if token in self._stops:
            # try_consume_tokens never takes a stop token; consume_token takes one where the grammar may end.
            if not self._m.is_accepting() or not self._m.consume_token(token):
                return False
            self._stopped = True
            return True
        return self._m.try_consume_tokens([token]) == 1

    def rollback(self, k: int) -> None:
        if k:
            # Nothing is accepted after a stop token: it is the last one, and the first rolled back.
            self._stopped = False
            self._m.rollback(k)

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> None:
        v = bitmask[index]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def find_jump_forward_string(self) -> str:
        # Raises UnicodeDecodeError inside a multi-byte character, as xgrammar's str does (the caller samples).
        return self._m.compute_ff_bytes().decode("utf-8")

    def is_terminated(self) -> bool:
        return self._stopped or (self._terminate_without_stop and self._m.is_accepting())
