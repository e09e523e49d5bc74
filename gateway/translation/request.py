"""OpenAI request bodies -> inference.v1 GenerateRequest.

Chat (`/v1/chat/completions`) and legacy completions (`/v1/completions`)
share the sampling parameters, `response_format` and structd's extension
field `structured_outputs` (vLLM's name and shape, plus structd's own JSON
and jump-forward options). What structd cannot honour is refused with a 400
naming the parameter rather than ignored: `echo`, `suffix`, `best_of` other
than `n`. The sampling parameters (OpenAI's penalties and `logit_bias`,
vLLM's `min_p`, `stop_token_ids`, `include_stop_str_in_output`, ...) go on
to SamplingParams, whose ranges the inference service checks. `n`
goes on to the inference service, which refuses more than its --max-n
(INVALID_ARGUMENT, a 400 naming the flag). Fields this gateway
does not know are ignored, as vLLM does (`user`, `metadata`, `store`, ...).
docs/openai.md documents every decision made here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.body import INT32_MAX, Fields, ShapeError, loads
from gateway.errors import ModelNotFoundError
from shared.gen.inference.v1 import inference_service_pb2 as pb

# OpenAI's legacy completions default; chat leaves max_tokens to the server (--default-max-tokens).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_TOP_LOGPROBS = 20
# OpenAI's reasoning_effort values; every one but "none" turns thinking on (its length is thinking_token_budget's).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

# structured_outputs: the constraint kinds (vLLM's names) and the Constraint field each fills.
KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf", "json_object": "json_object",
         "structural_tag": "structural_tag"}
JSON_OPTIONS = ("whitespace", "max_whitespace_count", "indent", "lenient", "any_key_order", "disable_any_whitespace")
WHITESPACE = {"compact": pb.JSON_WHITESPACE_COMPACT, "flexible": pb.JSON_WHITESPACE_FLEXIBLE,
              "indented": pb.JSON_WHITESPACE_INDENTED}
# structured_outputs.backend (structd's): the grammar library; "guidance" is vLLM's name for llguidance.
GRAMMAR_BACKENDS = {"auto": pb.GRAMMAR_BACKEND_AUTO, "xgrammar": pb.GRAMMAR_BACKEND_XGRAMMAR,
                    "llguidance": pb.GRAMMAR_BACKEND_LLGUIDANCE, "guidance": pb.GRAMMAR_BACKEND_LLGUIDANCE}
# vLLM options that do not apply to structd's backend: accepted and ignored.
IGNORED_STRUCTURED_OUTPUTS = ("disable_fallback", "disable_additional_properties")


@dataclass(frozen=True)
class Translated:
    """A request ready for the inference service, and how its answer is shaped."""

    grpc_request: pb.GenerateRequest
    model: str
    stream: bool
    include_usage: bool
    # None: no logprobs; else how many alternatives per token.
    top_logprobs: int | None


def check_model(body: Fields, served: str) -> str:
    """The model id the answer names: the served one; a request naming another gets 404, as in vLLM."""
    model = body.string("model")
    if model and model != served:
        raise ModelNotFoundError(model)
    return served


# --------------------------------------------------------------------------- shared parameters


def _logit_bias(body: Fields) -> dict[int, float]:
    """OpenAI's {"token id": bias} (ids as JSON object keys, hence strings); the inference service checks
    the ids against the vocabulary and the biases' range."""
    bias = body.object("logit_bias")
    if bias is None:
        return {}
    out = {}
    for key in bias.obj:
        try:
            token = int(key)
        except ValueError:
            raise body.fail("logit_bias", f"'logit_bias' keys must be token ids, not {key!r}.") from None
        if not 0 <= token <= INT32_MAX:
            raise body.fail("logit_bias", f"'logit_bias': {key} is not a token id.")
        out[token] = bias.number(key, 0.0, minimum=-100.0, maximum=100.0)
    return out


def _stop_token_ids(body: Fields) -> list[int]:
    ids = body.array("stop_token_ids") or []
    for i, t in enumerate(ids):
        # JSON has one number type: 3.0 is an integer (as Fields.integer reads them).
        if (isinstance(t, bool) or not isinstance(t, (int, float)) or (isinstance(t, float) and not t.is_integer())
                or not 0 <= t <= INT32_MAX):
            raise body.fail("stop_token_ids", f"'stop_token_ids[{i}]' must be a token id (an integer >= 0).")
    return [int(t) for t in ids]


def _stop(body: Fields) -> list[str]:
    value = body.raw("stop")
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise body.fail("stop", "'stop' must be a string or an array of strings.")


def sampling(body: Fields, max_tokens: int | None) -> pb.SamplingParams:
    s = pb.SamplingParams(
        max_tokens=max_tokens or 0,
        # OpenAI's default temperature is 1; the proto's 0 means greedy.
        temperature=body.number("temperature", 1.0, minimum=0.0),
        top_p=body.number("top_p", 1.0, minimum=0.0, maximum=1.0),
        stop=_stop(body),
        ignore_eos=body.boolean("ignore_eos", False),
        min_tokens=body.integer("min_tokens", 0, minimum=0),
        repetition_penalty=body.number("repetition_penalty", 1.0, minimum=0.0),
        # The upper bound is the inference service's --max-n, which it enforces.
        n=body.integer("n", 1, minimum=1),
        presence_penalty=body.number("presence_penalty", 0.0, minimum=-2.0, maximum=2.0),
        frequency_penalty=body.number("frequency_penalty", 0.0, minimum=-2.0, maximum=2.0),
        logit_bias=_logit_bias(body),
        min_p=body.number("min_p", 0.0, minimum=0.0, maximum=1.0),
        stop_token_ids=_stop_token_ids(body),
        include_stop_str_in_output=body.boolean("include_stop_str_in_output", False),
    )
    # vLLM's -1 (and 0) disable top_k.
    top_k = body.integer("top_k", 0, minimum=-1)
    s.top_k = max(top_k, 0)
    # The proto's seed is a uint64; OpenAI and vLLM also take negative seeds: one maps to its 64-bit two's
    # complement (-1 is the seed 2**64 - 1), so every int64 and every uint64 is a seed.
    seed = body.integer("seed", None, minimum=-(2**63), maximum=2**64 - 1)
    if seed is not None:
        s.seed = seed % 2**64
    if body.raw("repetition_penalty") is not None and s.repetition_penalty == 0:
        raise body.fail("repetition_penalty", "'repetition_penalty' must be positive (1 disables it).")
    return s


def _stream(body: Fields) -> tuple[bool, bool]:
    stream = body.boolean("stream", False)
    options = body.object("stream_options")
    if options is not None and not stream:
        raise body.fail("stream_options", "'stream_options' is only allowed when 'stream' is true.")
    return stream, bool(options and options.boolean("include_usage", False))


# --------------------------------------------------------------------------- constraints


def _json_text(fields: Fields, key: str) -> str:
    """An object given inline or as JSON text, as JSON text (NaN and Infinity, which json.loads accepts, are
    not JSON and are refused here rather than passed on)."""
    value = fields.raw(key)
    if isinstance(value, str):
        try:
            loads(value.encode(), f"'{fields.name(key)}'", strict_numbers=True)
        except ShapeError as e:  # the client's: answered 400 naming the limit
            raise fields.fail(key, str(e)) from None
        except ValueError as e:  # the client's: answered 400
            raise fields.fail(key, f"'{fields.name(key)}' is not valid JSON: {e}") from None
        return value
    if not isinstance(value, dict):
        raise fields.fail(key, f"'{fields.name(key)}' must be an object (or its JSON text).")
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError as e:  # the client's: a NaN or an Infinity in it
        raise fields.fail(key, f"'{fields.name(key)}' is not valid JSON: {e}") from None


def _structured_kind(so: Fields, c: pb.Constraint) -> str | None:
    """Fills c from structured_outputs' one constraint kind; returns the key used (None: options only)."""
    given = [k for k in KINDS if so.has(k) and not (k == "json_object" and so.raw(k) is False)]
    if len(given) > 1:
        raise so.fail(None, f"'structured_outputs' takes one constraint, got {', '.join(given)}.")
    if not given:
        return None
    key = given[0]
    if key in ("json", "structural_tag"):
        setattr(c, KINDS[key], _json_text(so, key))
    elif key == "choice":
        choices = so.array("choice")
        if not choices or not all(isinstance(x, str) for x in choices):
            raise so.fail("choice", "'structured_outputs.choice' must be a non-empty array of strings.")
        c.choice.choices.extend(choices)
    elif key == "json_object":
        if so.boolean("json_object") is not True:
            raise so.fail("json_object", "'structured_outputs.json_object' must be true.")
        c.json_object = True
    else:
        text = so.string(key)
        if not text:
            raise so.fail(key, f"'{so.name(key)}' must be a non-empty string.")
        setattr(c, KINDS[key], text)
    return key


def _response_format(rf: Fields, c: pb.Constraint) -> bool:
    """Fills c from response_format; True when it asks for a constraint."""
    kind = rf.string("type")
    if kind in (None, "text"):
        return False
    if kind == "json_object":
        c.json_object = True
        return True
    if kind == "json_schema":
        spec = rf.object("json_schema")
        if spec is None or not spec.has("schema"):
            raise rf.fail("json_schema", "'response_format.json_schema.schema' is required with type json_schema.")
        spec.string("name")
        spec.boolean("strict")  # typed, not used: structd always decodes in strict mode (docs/openai.md)
        c.json_schema = _json_text(spec, "schema")
        return True
    raise rf.fail("type", f"'response_format.type' must be text, json_object or json_schema, not {kind!r}.")


def _json_options(so: Fields, c: pb.Constraint) -> None:
    given = [k for k in JSON_OPTIONS if so.has(k)]
    if not given:
        return
    if c.WhichOneof("kind") not in ("json_schema", "json_object"):
        raise so.fail(given[0], f"'{so.name(given[0])}' applies to JSON constraints only (structured_outputs.json, "
                                "json_object, or response_format json_schema / json_object).")
    o = c.json_options
    style = so.string("whitespace")
    if style is not None:
        if style not in WHITESPACE:
            raise so.fail("whitespace", f"'structured_outputs.whitespace' must be one of {', '.join(WHITESPACE)}.")
        o.whitespace = WHITESPACE[style]
    if so.has("disable_any_whitespace"):
        compact = so.boolean("disable_any_whitespace")
        if style is not None and (style == "compact") != compact:
            raise so.fail("disable_any_whitespace", "'structured_outputs.disable_any_whitespace' contradicts "
                                                    "'structured_outputs.whitespace'.")
        # vLLM's flag: false lets the model write whitespace between tokens (bounded here).
        o.whitespace = pb.JSON_WHITESPACE_COMPACT if compact else pb.JSON_WHITESPACE_FLEXIBLE
    o.max_whitespace_count = so.integer("max_whitespace_count", 0, minimum=0, maximum=32)
    o.indent = so.integer("indent", 0, minimum=0, maximum=16)
    o.lenient = so.boolean("lenient", False)
    o.any_key_order = so.boolean("any_key_order", False)


def constraint(body: Fields) -> pb.Constraint | None:
    """response_format and/or structured_outputs as one Constraint (None: unconstrained)."""
    c = pb.Constraint()
    so = body.object("structured_outputs")
    rf = body.object("response_format")
    from_so = None
    if so is not None:
        if so.has("whitespace_pattern"):
            raise so.fail("whitespace_pattern", "'structured_outputs.whitespace_pattern' is not supported: use "
                                                "'whitespace' (compact, flexible or indented) and "
                                                "'max_whitespace_count'.")
        known = {*KINDS, *JSON_OPTIONS, *IGNORED_STRUCTURED_OUTPUTS, "disable_jump_forward", "strict_schema", "backend"}
        unknown = so.unknown(known)
        if unknown:
            raise so.fail(unknown[0], f"Unknown field '{so.name(unknown[0])}'; structured_outputs takes "
                                      f"{', '.join(sorted(known))}.")
        from_so = _structured_kind(so, c)
    if rf is not None:
        if _response_format(rf, c) and from_so is not None:
            raise rf.fail(None, f"'response_format' and 'structured_outputs.{from_so}' both constrain the output: "
                                "give one.")
    if so is not None:
        _json_options(so, c)
        c.disable_jump_forward = so.boolean("disable_jump_forward", False)
        if c.disable_jump_forward and c.WhichOneof("kind") is None:
            raise so.fail("disable_jump_forward", "'structured_outputs.disable_jump_forward' needs a constraint.")
        c.strict_schema = so.boolean("strict_schema", False)
        if c.strict_schema and c.WhichOneof("kind") != "json_schema":
            raise so.fail("strict_schema", "'structured_outputs.strict_schema' applies to a JSON Schema "
                                           "(structured_outputs.json or response_format json_schema) only.")
        backend = so.string("backend")
        if backend is not None:
            if backend not in GRAMMAR_BACKENDS:
                raise so.fail("backend", f"'structured_outputs.backend' must be one of {', '.join(GRAMMAR_BACKENDS)}.")
            if c.WhichOneof("kind") is None:
                raise so.fail("backend", "'structured_outputs.backend' needs a constraint.")
            c.backend = GRAMMAR_BACKENDS[backend]
    return c if c.WhichOneof("kind") is not None else None


# --------------------------------------------------------------------------- chat


def _content(m: Fields, required: bool) -> str:
    value = m.raw("content")
    if value is None:
        if required:
            raise m.fail("content", f"'{m.name('content')}' is required for role {m.raw('role')!r}.")
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in m.objects("content"):
            if part.string("type") != "text":
                raise part.fail("type", f"'{part.name('type')}': only text content parts are supported.")
            texts.append(part.string("text", ""))
        return "\n".join(texts)
    raise m.fail("content", f"'{m.name('content')}' must be a string or an array of text parts.")


def _function(item: Fields) -> Fields:
    """The `function` object of a tool or a tool call: type function (the default), with a name."""
    if item.string("type", "function") != "function":
        raise item.fail("type", f"'{item.name('type')}': only function tools and calls are supported.")
    fn = item.object("function")
    if fn is None or not fn.string("name"):
        raise item.fail("function", f"'{item.name('function')}.name' is required.")
    return fn


def _tool_calls(m: Fields) -> list[pb.ToolCall]:
    out = []
    for call in m.objects("tool_calls") or []:
        fn = _function(call)
        out.append(pb.ToolCall(id=call.string("id", ""), name=fn.string("name"),
                               arguments_json=fn.string("arguments", "") or "{}"))
    return out


def _reasoning_input(m: Fields) -> str:
    """An assistant message's thinking: `reasoning` (vLLM's current name) or `reasoning_content` (its older
    one, kept as an alias); both given must agree."""
    given = {k: m.string(k, "") for k in ("reasoning", "reasoning_content") if m.has(k)}
    values = {v for v in given.values() if v}
    if len(values) > 1:
        raise m.fail("reasoning", f"'{m.name('reasoning')}' and '{m.name('reasoning_content')}' differ: give one "
                                  "(they are two names for the same thinking).")
    return values.pop() if values else ""


def messages(body: Fields) -> list[pb.ChatMessage]:
    items = body.objects("messages")
    if not items:
        raise body.fail("messages", "'messages' must be a non-empty array.")
    out = []
    for m in items:
        role = m.string("role")
        if role not in CHAT_ROLES:
            raise m.fail("role", f"'{m.name('role')}' must be one of {', '.join(CHAT_ROLES)}, not {role!r}.")
        msg = pb.ChatMessage(role=CHAT_ROLES[role], name=m.string("name", ""))
        if role == "assistant":
            msg.tool_calls.extend(_tool_calls(m))
            msg.reasoning_content = _reasoning_input(m)
            msg.content = _content(m, required=not msg.tool_calls)
        else:
            msg.content = _content(m, required=True)
        if role == "tool":
            msg.tool_call_id = m.string("tool_call_id", "")
            if not msg.tool_call_id:
                raise m.fail("tool_call_id", f"'{m.name('tool_call_id')}' is required for role 'tool'.")
        out.append(msg)
    return out


def tools(body: Fields, req: pb.GenerateRequest) -> None:
    names = []
    for t in body.objects("tools") or []:
        fn = _function(t)
        params = _json_text(fn, "parameters") if fn.has("parameters") else ""
        req.tools.add(name=fn.string("name"), description=fn.string("description", ""),
                      parameters_json_schema=params)
        names.append(fn.string("name"))
    parallel = body.boolean("parallel_tool_calls")
    if parallel is not None:
        req.parallel_tool_calls = parallel
    choice = body.raw("tool_choice")
    if choice is None:
        return
    modes = {"auto": pb.TOOL_CHOICE_MODE_AUTO, "required": pb.TOOL_CHOICE_MODE_REQUIRED,
             "none": pb.TOOL_CHOICE_MODE_NONE}
    if isinstance(choice, str) and choice in modes:
        req.tool_choice.mode = modes[choice]
    elif isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        _allowed_tools(body.object("tool_choice"), names, req)
    elif isinstance(choice, dict):
        fn = body.object("tool_choice").object("function")
        name = fn.string("name") if fn is not None else None
        if not name:
            raise body.fail("tool_choice", "'tool_choice.function.name' is required for a named tool choice.")
        if name not in names:
            raise body.fail("tool_choice", f"'tool_choice' names {name!r}, which is not in 'tools'.")
        req.tool_choice.mode = pb.TOOL_CHOICE_MODE_NAMED
        req.tool_choice.name = name
    else:
        raise body.fail("tool_choice", "'tool_choice' must be auto, required, none, "
                                       '{"type": "function", "function": {"name": ...}} or '
                                       '{"type": "allowed_tools", "allowed_tools": {"mode": ..., "tools": [...]}}.')
    if not names and req.tool_choice.mode != pb.TOOL_CHOICE_MODE_NONE:
        raise body.fail("tool_choice", "'tool_choice' needs 'tools'.")


def _allowed_tools(choice: Fields, names: list[str], req: pb.GenerateRequest) -> None:
    """OpenAI's {"type": "allowed_tools", "allowed_tools": {"mode": "auto"|"required", "tools": [{"type":
    "function", "function": {"name": ...}}, ...]}}: the grammar lets the model call these tools only."""
    allowed = choice.object("allowed_tools")
    if allowed is None:
        raise choice.fail("allowed_tools", "'tool_choice.allowed_tools' is required with type allowed_tools.")
    mode = allowed.string("mode", "auto")
    if mode not in ("auto", "required"):
        raise allowed.fail("mode", f"'{allowed.name('mode')}' must be auto or required, not {mode!r}.")
    req.tool_choice.mode = pb.TOOL_CHOICE_MODE_AUTO if mode == "auto" else pb.TOOL_CHOICE_MODE_REQUIRED
    listed = allowed.objects("tools") or []
    if not listed:
        raise allowed.fail("tools", f"'{allowed.name('tools')}' must list at least one tool.")
    for t in listed:
        # OpenAI's entries are {"type": "function", "function": {"name": ...}}; a bare {"name": ...} also reads.
        name = _function(t).string("name") if t.has("function") else t.string("name")
        if not name:
            raise t.fail("function", f"'{t.name('function')}.name' is required.")
        if name not in names:
            raise t.fail("function", f"'{t.name('function')}' names {name!r}, which is not in 'tools'.")
        req.tool_choice.allowed_tools.append(name)


def reasoning(body: Fields, req: pb.GenerateRequest) -> None:
    """chat_template_kwargs.enable_thinking / thinking and reasoning_effort turn thinking on or off; the other
    chat_template_kwargs go to the chat template as they are (the inference service refuses the names the
    template uses itself)."""
    wanted: list[tuple[str, bool]] = []
    kwargs = body.object("chat_template_kwargs")
    if kwargs is not None:
        wanted += [(kwargs.name(k), kwargs.boolean(k)) for k in ("enable_thinking", "thinking") if kwargs.has(k)]
        rest = {k: v for k, v in kwargs.obj.items() if k not in ("enable_thinking", "thinking")}
        if rest:
            try:
                req.chat_template_kwargs_json = json.dumps(rest, allow_nan=False)
            except ValueError as e:  # the client's: a NaN or an Infinity in it
                raise body.fail("chat_template_kwargs", f"'chat_template_kwargs' is not valid JSON: {e}") from None
    effort = body.string("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise body.fail("reasoning_effort", f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}.")
        wanted.append(("reasoning_effort", effort != "none"))
    if len({on for _, on in wanted}) > 1:
        raise body.fail(wanted[-1][0], f"{' and '.join(repr(w) for w, _ in wanted)} contradict each other.")
    if wanted:
        req.reasoning = wanted[0][1]


def _thinking_budget(body: Fields, req: pb.GenerateRequest) -> None:
    req.max_thinking_tokens = body.integer("thinking_token_budget", 0, minimum=0)


def chat_request(body: Fields, served_model: str, request_id: str) -> Translated:
    model = check_model(body, served_model)
    stream, include_usage = _stream(body)
    max_tokens = body.integer("max_completion_tokens", None, minimum=1) or body.integer("max_tokens", None, minimum=1)
    req = pb.GenerateRequest(request_id=request_id, sampling=sampling(body, max_tokens))
    req.messages.extend(messages(body))
    tools(body, req)
    reasoning(body, req)
    _thinking_budget(body, req)
    c = constraint(body)
    if c is not None:
        req.constraint.CopyFrom(c)
    top = None
    if body.boolean("logprobs", False):
        top = body.integer("top_logprobs", 0, minimum=0, maximum=MAX_TOP_LOGPROBS)
        req.sampling.logprobs = True
        req.sampling.top_logprobs = top
    elif body.has("top_logprobs"):
        raise body.fail("top_logprobs", "'top_logprobs' needs 'logprobs': true.")
    return Translated(req, model, stream, include_usage, top)


# --------------------------------------------------------------------------- legacy completions


def _prompt(body: Fields, req: pb.GenerateRequest) -> None:
    value = body.raw("prompt")
    # A batch of one is the prompt itself: [str] or [[int, ...]].
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise body.fail("prompt", "'prompt' is empty.")
        req.prompt = value
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if min(value) < 0 or max(value) >= 2**31:
            raise body.fail("prompt", "'prompt' token ids must be non-negative 32-bit integers.")
        req.prompt_token_ids.extend(value)
    elif isinstance(value, list) and len(value) > 1:
        raise body.fail("prompt", "'prompt' takes one prompt (a string or a token-id array): send one request "
                                  "per prompt.")
    else:
        raise body.fail("prompt", "'prompt' must be a string or an array of token ids.")


def completion_request(body: Fields, served_model: str, request_id: str) -> Translated:
    model = check_model(body, served_model)
    if body.boolean("echo", False):
        raise body.fail("echo", "'echo' is not supported: the prompt is not returned with the completion.")
    if body.string("suffix"):
        raise body.fail("suffix", "'suffix' is not supported (no fill-in-the-middle).")
    stream, include_usage = _stream(body)
    max_tokens = body.integer("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, minimum=1)
    req = pb.GenerateRequest(request_id=request_id, sampling=sampling(body, max_tokens))
    if body.integer("best_of", req.sampling.n) != req.sampling.n:
        raise body.fail("best_of", "'best_of' must equal 'n' (or be left out): structd returns every completion it "
                                   "generates and does not rank them.")
    _prompt(body, req)
    _thinking_budget(body, req)
    c = constraint(body)
    if c is not None:
        req.constraint.CopyFrom(c)
    top = body.integer("logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top is not None:
        req.sampling.logprobs = True
        req.sampling.top_logprobs = top
    return Translated(req, model, stream, include_usage, top)
