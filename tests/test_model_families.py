"""Every bundled model family against xgrammar's own structural tag for it, and its tool calls end to end.

xgrammar (`get_model_structural_tag`) knows each family's tool-call format;
structd keeps its own copy as data (inference_svc/model_families/*.json) so
that the arguments compile through structd's JSON grammar and the parser
reads the same markers. The first tests derive the markers from xgrammar's
tag for each family and compare, so an xgrammar upgrade that changes a
format fails here. Then, per family, on the real tokenizer: the parser
reads calls written in the format, and the grammar for tool_choice required
accepts them and refuses malformed ones. Last, a Llama 3 tool call through
the real inference server (simulated steps: its tokens are random, the
grammar gives them their form), and a Qwen3-Coder one, whose arguments are
parameter tags read back into JSON.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.builtin_structural_tag import _structural_tag_registry, get_model_structural_tag

from grammar_svc.compile.spec import GrammarSpec, compile_spec
from grammar_svc.types import Kind

from inference_svc.api.model_family import bundled_names, detect_family, load_family
from inference_svc.api.tool_calls import ToolCallParser, ToolChoice, ToolSpec, tool_call_structural_tag
from shared.gen.inference.v1 import inference_service_pb2 as pb

from tests.conftest import InferenceServerThread, inference_stub
from tests.test_tool_calls import random_answer

# Our family -> xgrammar's key for it.
XGRAMMAR_MODEL = {"deepseek": "deepseek_v3_1", "deepseek_r1": "deepseek_r1", "deepseek_v32": "deepseek_v3_2",
                  "deepseek_v4": "deepseek_v4", "deepseek_v41": "deepseek_v4_1", "exaone": "exaone",
                  "glm": "glm_4_7", "gpt_oss": "harmony", "kimi_k2": "kimi", "llama3": "llama", "mimo": "mimo",
                  "minimax": "minimax", "qwen": "qwen_3", "qwen3_coder": "qwen_3_coder"}
# xgrammar's keys for the same format as another key's (one function registered under both names).
SAME_AS = {"qwen_3_5": "qwen_3_coder"}
# xgrammar's families whose arguments nest tags recursively (objects and lists as tags of tags), which the
# parameter-tag reader does not read: not bundled (README says so).
NOT_BUNDLED = {"cohere", "kimi_k3", "minimax_m3"}
PROBE = "probe_tool"
FAMILIES = [pytest.param(load_family(n), id=n) for n in bundled_names()]

WEATHER = ToolSpec("get_weather", "", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]})
TIME = ToolSpec("get_time", "", None)
TOOLS = [WEATHER, TIME]
CALLS = [("get_weather", '{"city":"Paris","unit":"c"}'), ("get_time", '{"zone":"UTC"}')]


def test_every_xgrammar_family_is_bundled_or_listed_as_not():
    assert set(XGRAMMAR_MODEL) == set(bundled_names())
    assert set(_structural_tag_registry) == set(XGRAMMAR_MODEL.values()) | set(SAME_AS) | NOT_BUNDLED
    for alias, key in SAME_AS.items():
        assert _structural_tag_registry[alias] is _structural_tag_registry[key]


def _path_to_call(node, path=()):
    """The nodes from `node` down to the first tag whose begin names the probe tool."""
    if isinstance(node, list):
        for n in node:
            if (found := _path_to_call(n, path)) is not None:
                return found
        return None
    if not isinstance(node, dict):
        return None
    path = (*path, node)
    if node.get("type") == "tag" and PROBE in node.get("begin", ""):
        return path
    for value in node.values():
        if (found := _path_to_call(value, path)) is not None:
            return found
    return None


def xgrammar_format(model: str, reasoning: str = "disabled") -> tuple[dict, dict]:
    """(our tool_calls fields as xgrammar's tag for `model` writes them, the call's arguments format).

    separator None: xgrammar lets any text come between calls (triggered tags), so ours is free to pick one.
    """
    tag = get_model_structural_tag(model, tools=[{"type": "function", "function": {
        "name": PROBE, "parameters": {"type": "object"}}}], tool_choice="auto", reasoning=reasoning)
    *outer, container, call = _path_to_call(tag.model_dump(exclude_none=True)["format"])
    begin, content = call["begin"].replace(PROBE, "{name}"), call["content"]
    if content["type"] == "sequence":  # Kimi: the call's number, then its arguments marker, then the arguments
        *head, content = content["elements"]
        begin += "".join("{index}" if e["type"] == "regex" else e["value"] for e in head)
    block = outer[-1] if outer and outer[-1]["type"] == "tag" else {"begin": "", "end": ""}
    return ({"block_begin": block["begin"], "call_begin": begin, "call_end": call["end"],
             "separator": container.get("separator"), "block_end": block["end"]}, content)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_format_is_xgrammars_for_the_family(family):
    theirs, arguments = xgrammar_format(XGRAMMAR_MODEL[family.name])
    ours = family.tool_calls
    # JSON arguments: structd's grammar; parameter tags: xgrammar's, in the style the family names.
    assert (arguments["type"], arguments["style"]) == ("json_schema", ours.arguments.style if ours.arguments else "json")
    if theirs["separator"] is None:
        theirs["separator"] = ours.separator
    assert {k: getattr(ours, k) for k in theirs} == theirs
    if family.think_start:
        thinking = json.dumps(get_model_structural_tag(XGRAMMAR_MODEL[family.name], reasoning="enabled").model_dump())
        assert family.think_start in thinking and family.think_end in thinking


@pytest.mark.parametrize("vocab, expected", [
    pytest.param({"<|python_tag|>": 1, "<|eom_id|>": 2, "<|start_header_id|>": 3}, "llama3", id="llama3"),
    pytest.param({t: i for i, t in enumerate(load_family("kimi_k2").detect_tokens)}, "kimi_k2", id="kimi_k2"),
    pytest.param({t: i for i, t in enumerate(load_family("gpt_oss").detect_tokens)}, "gpt_oss", id="gpt_oss"),
    pytest.param({"<tool_call>": 1, "</tool_call>": 2}, "qwen", id="exaone-markers-are-qwen"),
    pytest.param({t: i for i, t in enumerate(load_family("glm").detect_tokens)}, "glm", id="glm"),
    pytest.param({t: i for i, t in enumerate(load_family("minimax").detect_tokens)}, "minimax", id="minimax"),
])
def test_detection_of_the_new_families(vocab, expected):
    assert detect_family(vocab).name == expected


def test_the_embedded_models_tokenizer_is_still_deepseek(hf_tokenizer):
    assert detect_family(hf_tokenizer.get_vocab()).name == "deepseek"


def answer(family, calls=CALLS) -> str:
    fmt = family.tool_calls
    return fmt.block_begin + fmt.separator.join(
        fmt.call_text(name, arguments, i) for i, (name, arguments) in enumerate(calls)) + fmt.block_end


def parse(family, pieces) -> tuple[str, list[tuple[str, str]], dict[int, str]]:
    """(content, calls, each call's arguments joined from its deltas)."""
    parser = ToolCallParser(family, [t.name for t in TOOLS], {t.name: t.arguments_schema() for t in TOOLS})
    content, calls, streamed = [], [], {}
    for piece in [*pieces, None]:
        text, found = parser.push(piece) if piece is not None else parser.finish()
        content.append(text)
        calls += [(c.name, c.arguments_json) for c in found]
        for d in parser.take_deltas():
            streamed[d.index] = streamed.get(d.index, "") + d.arguments_fragment
    return "".join(content), calls, streamed


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split", [pytest.param(False, id="whole"), pytest.param(True, id="char-by-char")])
def test_the_parser_reads_the_familys_calls(family, split):
    text = "Let me see. " + answer(family)
    content, calls, streamed = parse(family, list(text) if split else [text])
    assert content == "Let me see. "
    assert calls == CALLS
    assert streamed == {i: arguments for i, (_, arguments) in enumerate(CALLS)}


@pytest.fixture(scope="module")
def compiler(xgr_tokenizer_info):
    return xgr.GrammarCompiler(xgr_tokenizer_info)


def accepts(grammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.is_completed()


def _index(written: str):
    """A call whose index is `written` (None for a family without an index)."""
    def text(family):
        return answer(family, CALLS[:1]).replace(":0<", f":{written}<") if family.tool_calls.index_suffix else None
    return text


MALFORMED = [
    pytest.param(lambda f: answer(f, [("get_weather", '{"unit":"c"}')]), id="missing-required"),
    pytest.param(lambda f: answer(f, [("get_weather", '{"city":"Paris, France"}')]), id="string-too-long"),
    pytest.param(lambda f: None if f.tool_calls.arguments else answer(f, [("get_weather", '{"city": "Paris"}')]),
                 id="not-compact"),
    pytest.param(lambda f: answer(f, [("send_email", "{}")]), id="unknown-tool"),
    pytest.param(lambda f: answer(f, CALLS[:1])[:-1], id="cut-short"),
    pytest.param(lambda f: "Sure. " + answer(f), id="text-before"),
    pytest.param(_index("x"), id="index-not-a-number"),
    pytest.param(_index("12345"), id="index-too-long"),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_required_grammar_takes_the_familys_calls(compiler, family):
    tag = tool_call_structural_tag(family, TOOLS, ToolChoice("required"))
    grammar = compile_spec(compiler, GrammarSpec(Kind.STRUCTURAL_TAG, json.dumps(tag)))
    assert accepts(grammar, answer(family))
    assert accepts(grammar, answer(family, CALLS[1:]))
    if family.tool_calls.index_suffix:
        assert accepts(grammar, answer(family).replace(":1<", ":9999<"))
    for case in MALFORMED:
        text = case.values[0](family)
        assert text is None or not accepts(grammar, text), case.id


@pytest.mark.parametrize("family", FAMILIES)
def test_the_auto_and_named_grammars_take_the_familys_calls(compiler, family):
    def grammar(choice):
        tag = tool_call_structural_tag(family, TOOLS, choice)
        return compile_spec(compiler, GrammarSpec(Kind.STRUCTURAL_TAG, json.dumps(tag)))

    auto = grammar(ToolChoice("auto"))
    assert accepts(auto, "No call needed.")
    assert accepts(auto, "Let me see. " + answer(family))
    assert not accepts(auto, "Let me see. " + answer(family, [("get_weather", '{"unit":"c"}')]))
    named = grammar(ToolChoice("named", "get_time"))
    assert accepts(named, answer(family, CALLS[1:]))
    assert not accepts(named, answer(family, CALLS[:1]))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(2))
def test_random_answers_under_the_familys_grammar_parse_into_valid_calls(compiler, xgr_tokenizer_info, hf_tokenizer,
                                                                       family, seed):
    clock = ToolSpec("get_time", "", {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}})
    tools = [WEATHER, clock]  # bounded schemas: a uniform walk ends
    tag = tool_call_structural_tag(family, tools, ToolChoice("required"))
    ids = random_answer(compile_spec(compiler, GrammarSpec(Kind.STRUCTURAL_TAG, json.dumps(tag))),
                        xgr_tokenizer_info.vocab_size, seed)
    assert ids[-1] == hf_tokenizer.eos_token_id
    text = hf_tokenizer.decode(ids[:-1])
    parser = ToolCallParser(family, [t.name for t in tools], {t.name: t.arguments_schema() for t in tools})
    content, found = parser.push(text)
    rest, more = parser.finish()
    assert content + rest == "" and found + more, text
    for c in found + more:
        jsonschema.validate(json.loads(c.arguments_json), {t.name: t.parameters for t in tools}[c.name])


LLAMA_TEMPLATE = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}"
                  "<|eot_id|>{% endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n")


def family_server(grammar_server, tmp_path_factory, family: str, template: str) -> InferenceServerThread:
    """The real inference server with --model-family `family` and a chat template like the family's (simulated
    steps)."""
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    path = tmp_path_factory.mktemp("template") / f"{family}.jinja"
    path.write_text(template)
    return InferenceServerThread(InferenceServiceConfig(
        host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar_server.target,), simulate_step_ms=1.0,
        chat_template=path, model_family=family, engine=EngineConfig(max_num_seqs=4, default_max_tokens=8)))


@pytest.fixture(scope="module")
def llama3_server(grammar_server, tmp_path_factory):
    srv = family_server(grammar_server, tmp_path_factory, "llama3", LLAMA_TEMPLATE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llama3_stub(llama3_server):
    with inference_stub(llama3_server.target) as stub:
        yield stub


@pytest.fixture(scope="module")
def llama3_openai(llama3_server):
    """The official OpenAI SDK through the gateway in front of the llama3 server."""
    import openai

    from gateway.config import GatewayConfig
    from gateway.server import GatewayServer
    from structd.bench.harness import ServiceThread

    gateway = ServiceThread(GatewayServer(GatewayConfig(host="127.0.0.1", port=0, target=llama3_server.target)),
                            "gateway", start_timeout=60.0)
    client = openai.OpenAI(base_url=f"http://{gateway.target}/v1", api_key="unused", max_retries=0, timeout=120.0)
    yield client
    client.close()
    gateway.stop()


def test_a_llama3_tool_call_through_the_openai_sdk(llama3_openai):
    """Issue 27's check: a Llama-3-style tool call as an OpenAI client receives it."""
    schema = WEATHER.parameters
    model = llama3_openai.models.list().data[0].id
    completion = llama3_openai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tool_choice="required",
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": schema}}],
        parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=3)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("seed", [1, 2])
def test_a_llama3_tool_call_through_the_server(llama3_stub, seed):
    schema = WEATHER.parameters
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Weather in Paris?")],
        tools=[pb.Tool(name="get_weather", parameters_json_schema=json.dumps(schema))],
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), parallel_tool_calls=False,
        sampling=pb.SamplingParams(max_tokens=200, temperature=1.0, seed=seed))
    responses = list(llama3_stub.Generate(request, timeout=120))
    assert llama3_stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model_family == "llama3"
    (call,) = [c for r in responses for c in r.tool_calls]
    assert call.name == "get_weather" and responses[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert "".join(r.text for r in responses) == ""
    jsonschema.validate(json.loads(call.arguments_json), schema)


QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def qwen3_coder_stub(grammar_server, tmp_path_factory):
    """The real inference server with --model-family qwen3_coder: tool arguments as parameter tags."""
    srv = family_server(grammar_server, tmp_path_factory, "qwen3_coder", QWEN_TEMPLATE)
    with inference_stub(srv.target) as stub:
        yield stub
    srv.stop()


@pytest.mark.parametrize("seed", [1, 2])
def test_a_qwen3_coder_tool_call_through_the_server(qwen3_coder_stub, seed):
    """Parameter tags through the whole stack: xgrammar's qwen_xml grammar on the grammar tier, the arguments
    the client gets as one JSON object valid under the tool's schema (an integer property as a number)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"]}
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Weather in Paris?")],
        tools=[pb.Tool(name="get_weather", parameters_json_schema=json.dumps(schema))],
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), parallel_tool_calls=False,
        sampling=pb.SamplingParams(max_tokens=400, temperature=1.0, seed=seed))
    responses = list(qwen3_coder_stub.Generate(request, timeout=120))
    (call,) = [c for r in responses for c in r.tool_calls]
    assert call.name == "get_weather" and responses[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    arguments = json.loads(call.arguments_json)
    jsonschema.validate(arguments, schema)
    assert isinstance(arguments["days"], int)


def test_special_tokens_of_the_markup_stay_in_the_text():
    """gpt-oss's and Kimi's tokenizers mark their tool-call tokens special: decoding would drop them, and the
    parser would never see a call. The engine's view keeps those of the family's markup, and only those."""
    from transformers import AutoTokenizer

    from inference_svc.core.assembly import tokenizer_view
    from inference_svc.model.embedded_model import ensure_embedded_model

    tok = AutoTokenizer.from_pretrained(str(ensure_embedded_model()))
    tok.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|call|>", "<|return|>"]})
    channel, call, other = tok.convert_tokens_to_ids(["<|channel|>", "<|call|>", "<|return|>"])
    assert {channel, call, other} <= tokenizer_view(tok).special_ids
    kept = tokenizer_view(tok, family=load_family("gpt_oss")).special_ids
    assert other in kept and tok.eos_token_id in kept
    assert channel not in kept and call not in kept
