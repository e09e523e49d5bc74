"""`structd generate`: one completion from a running inference service, on the command line.

Streams the text to stdout as it is generated, or with --json prints one JSON
line with text, finish_reason and usage at the end. --logprobs N adds each
token's log probability and N alternatives: to the JSON line, or without
--json to stderr once the text is done, one line per token.

--n K asks for K completions of the prompt (computed once by the server,
each completion with its own seed): once all have finished, each is printed
in index order under a "--- completion I (FINISH_REASON) ---" line, or with
--json as one JSON line each, carrying its "index". The exit status is the
worst of theirs.

With --json-schema, the keywords the grammar does not enforce ("warnings")
and the check of the finished output against the schema ("schema_check":
valid, invalid or unchecked; "schema_violations") go to the JSON line, or
without --json to stderr after the text; --strict-schema refuses a schema with
keywords the grammar does not enforce. Exit status: 0 success, 1 the RPC
failed or generation ended early (finish_reason error/cancelled), 2 bad
arguments or an unreadable file, 3 the output finished but breaks its schema,
130 Ctrl-C.

--chat sends PROMPT as one user message through the model's chat template
(--chat-template-kwargs JSON: the template's extra variables) instead of as
raw text.

--tls-ca-file (and --tls-cert-file / --tls-key-file for a server that
requires client certificates) dial over TLS; each also comes from the
environment as STRUCTD_GENERATE_TLS_CA_FILE and so on.

Wired into `structd.cli` as a subcommand; `python -m structd.generate` runs
it stand-alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable

from shared.flags import FlagSet
from shared.grpc_options import MAX_RETRIES
from shared.inference_client import (Completion, InferenceClient, InferenceError, Prompt, SchemaViolation,
                                     SchemaWarning, TokenLogprob)
from shared.tls import add_client_flags, client_tls_from_args

DEFAULT_TARGET = "127.0.0.1:50051"
ENV_PREFIX = "STRUCTD_GENERATE_"
# Finish reasons after which the text is not a finished answer.
_FAILED_FINISH_REASONS = ("error", "cancelled")
# The output finished but breaks its schema (schema_check "invalid").
EXIT_SCHEMA_VIOLATED = 3


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """argparse type: an int in [low, high], so out-of-range values are usage
    errors rather than protobuf exceptions."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is not in [{low}, {high}]")
        return value

    return parse


def _logit_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 42=-100), got {text!r}") from None


_INT32_MAX = 2**31 - 1
_UINT64_MAX = 2**64 - 1
# The server's bound on alternatives per token (inference_svc.engine.sampling.MAX_TOP_LOGPROBS).
_MAX_TOP_LOGPROBS = 20


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object ({\"name\": value, ...})")
    return value


def add_arguments(parser: argparse.ArgumentParser, env: dict[str, str] | None = None) -> None:
    """env: where the TLS flags' STRUCTD_GENERATE_* twins are read (None: nowhere)."""
    parser.add_argument("--target", default=DEFAULT_TARGET, help="inference service HOST:PORT (default %(default)s)")
    parser.add_argument("--retries", type=_int_in(0, MAX_RETRIES), default=0, metavar="N",
                        help="try a request refused with UNAVAILABLE before any output (a draining or unreachable "
                             f"replica) again, up to N times (0 to {MAX_RETRIES}), on the target's next address")
    add_client_flags(FlagSet(parser, env or {}, ENV_PREFIX), "--tls", "the inference service")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--json-schema", metavar="FILE", help="JSON schema file (- = stdin)")
    kind.add_argument("--regex", metavar="PATTERN", help="regular expression the output must match")
    kind.add_argument("--ebnf", metavar="FILE", help="EBNF grammar file (- = stdin)")
    kind.add_argument("--choice", metavar="TEXT", action="append",
                      help="one allowed output; repeat for each choice")
    kind.add_argument("--json-object", action="store_true", help="any JSON object")
    kind.add_argument("--structural-tag", metavar="FILE", help="xgrammar structural tag JSON file (- = stdin)")
    parser.add_argument("--max-tokens", type=_int_in(0, _INT32_MAX), default=0, metavar="N",
                        help="0 = server default")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.0, metavar="P", help="0 or 1 = disabled")
    parser.add_argument("--top-k", type=_int_in(0, _INT32_MAX), default=0, metavar="K", help="0 = disabled")
    parser.add_argument("--seed", type=_int_in(-(2**63), _UINT64_MAX), default=None, metavar="S",
                        help="reproducible sampling; default random (a negative seed is its 64-bit two's "
                             "complement, as the gateway takes OpenAI's)")
    parser.add_argument("--stop", metavar="TEXT", action="append", help="stop string; repeatable")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end of sequence")
    parser.add_argument("--min-tokens", type=_int_in(0, _INT32_MAX), default=0, metavar="N",
                        help="no end of sequence or stop string before N tokens (a grammar still ends where it "
                             "completes)")
    parser.add_argument("--repetition-penalty", type=float, default=0.0, metavar="P",
                        help="> 1 discourages tokens already in the prompt or output; 0 or 1 = disabled")
    parser.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                        help="OpenAI's presence penalty, -2 to 2: subtracted from every token already in the output")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, metavar="P",
                        help="OpenAI's frequency penalty, -2 to 2: subtracted once per occurrence in the output")
    parser.add_argument("--logit-bias", type=_logit_bias, action="append", metavar="ID=BIAS",
                        help="add BIAS (-100 to 100) to token ID's logit before the constraint's mask; repeatable")
    parser.add_argument("--min-p", type=float, default=0.0, metavar="P",
                        help="drop tokens less likely than P times the likeliest (0 to 1; 0 = disabled)")
    parser.add_argument("--stop-token-id", dest="stop_token_ids", type=_int_in(0, _INT32_MAX), action="append",
                        metavar="ID", help="a token id that ends the output as end of sequence does; repeatable")
    parser.add_argument("--include-stop-str", dest="include_stop_str_in_output", action="store_true",
                        help="keep the matched stop string (or stop token's text) at the end of the output")
    parser.add_argument("--logprobs", type=_int_in(0, _MAX_TOP_LOGPROBS), default=None, metavar="N",
                        help="each token's log probability and its N most likely alternatives (0 to 20)")
    parser.add_argument("--n", type=_int_in(1, _INT32_MAX), default=1, metavar="K",
                        help="K completions of the prompt, each printed under its index (the server's --max-n "
                             "bounds K)")
    parser.add_argument("--strict-schema", action="store_true",
                        help="with --json-schema: refuse a schema with keywords the grammar does not enforce")
    parser.add_argument("--grammar-backend", choices=("auto", "xgrammar", "llguidance"), default=None,
                        help="the library serving the constraint's grammar (default: the grammar replica's "
                             "--grammar-backend)")
    parser.add_argument("--no-jump-forward", dest="disable_jump_forward", action="store_true",
                        help="sample every token, even where the grammar allows only one")
    parser.add_argument("--chat", action="store_true",
                        help="send PROMPT as one user message, rendered by the model's chat template (default: "
                             "the raw prompt text)")
    parser.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                        help="with --chat: extra chat template variables, a JSON object (vLLM's "
                             "chat_template_kwargs, e.g. '{\"enable_thinking\": false}')")
    parser.add_argument("--json", dest="json_output", action="store_true",
                        help="print one JSON line {text, finish_reason, usage} at the end instead of streaming")
    # For tests and scripts that must not wait forever; not part of the documented interface.
    parser.add_argument("--timeout-seconds", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("prompt", metavar="PROMPT", help="the prompt text")


class _UnreadableFile(Exception):
    pass


def _read_text(path: str) -> str:
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise _UnreadableFile(f"cannot read {path}: {reason}") from e


def _constraint(args: argparse.Namespace) -> dict[str, Any]:
    """The constraint keyword argument of the client for the given flag, if any."""
    if args.json_schema is not None:
        return {"json_schema": _read_text(args.json_schema)}
    if args.ebnf is not None:
        return {"ebnf": _read_text(args.ebnf)}
    if args.structural_tag is not None:
        return {"structural_tag": _read_text(args.structural_tag)}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    if args.json_object:
        return {"json_object": True}
    return {}


def run(args: argparse.Namespace) -> int:
    try:
        constraint = _constraint(args)
    except _UnreadableFile as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.strict_schema and args.json_schema is None:
        print("error: --strict-schema needs --json-schema", file=sys.stderr)
        return 2
    if args.grammar_backend and not constraint:
        print("error: --grammar-backend needs a constraint (--json-schema, --regex, ...)", file=sys.stderr)
        return 2
    if args.chat_template_kwargs is not None and not args.chat:
        print("error: --chat-template-kwargs needs --chat (a raw prompt has no chat template)", file=sys.stderr)
        return 2
    prompt: Prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    tls = client_tls_from_args(args, "--tls")
    if tls is not None and (problems := tls.problems()):
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    options: dict[str, Any] = dict(
        constraint,
        disable_jump_forward=args.disable_jump_forward, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        stop=args.stop or (), ignore_eos=args.ignore_eos, timeout=args.timeout_seconds,
        min_tokens=args.min_tokens, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        logit_bias=dict(args.logit_bias or ()), min_p=args.min_p, stop_token_ids=args.stop_token_ids or (),
        include_stop_str_in_output=args.include_stop_str_in_output,
        logprobs=args.logprobs is not None, top_logprobs=args.logprobs or 0, strict_schema=args.strict_schema,
        grammar_backend=args.grammar_backend or "", n=args.n, chat_template_kwargs=args.chat_template_kwargs,
    )
    try:
        with InferenceClient(args.target, tls_ca_file=args.tls_ca_file, tls_cert_file=args.tls_cert_file,
                             tls_key_file=args.tls_key_file, retries=args.retries) as client:
            if args.n > 1:
                finish_reason, check = _print_all(client, prompt, options, args.json_output)
            elif args.json_output:
                finish_reason, check = _print_json(client, prompt, options)
            else:
                finish_reason, check = _stream(client, prompt, options)
    except InferenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Leaving the stream cancelled the RPC; the shell prints ^C.
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: stop quietly, and keep the
        # interpreter from failing again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    if finish_reason is None or finish_reason in _FAILED_FINISH_REASONS:
        print(f"error: generation ended early (finish_reason {finish_reason or 'missing'})", file=sys.stderr)
        return 1
    return EXIT_SCHEMA_VIOLATED if check == "invalid" else 0


def _stream(client: InferenceClient, prompt: Prompt, options: dict[str, Any]) -> tuple[str | None, str | None]:
    """Streams the text; returns (finish_reason, schema_check)."""
    finish_reason = check = None
    logprobs: list[TokenLogprob] = []
    warnings: list[SchemaWarning] = []
    violations: list[SchemaViolation] = []
    detail = ""
    for chunk in client.generate(prompt, **options):
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        logprobs.extend(chunk.logprobs)
        warnings.extend(chunk.warnings)
        finish_reason = chunk.finish_reason or finish_reason
        if chunk.schema_check is not None:
            check, violations, detail = chunk.schema_check, chunk.schema_violations, chunk.schema_check_detail
    if sys.stdout.isatty():
        # End the line for the shell prompt; piped output stays exactly the text.
        sys.stdout.write("\n")
        sys.stdout.flush()
    # After the text, not interleaved with it: stdout stays exactly the text.
    _print_logprobs(logprobs)
    _print_warnings(warnings)
    _print_check(check, violations, detail)
    return finish_reason, check


def _print_logprobs(logprobs: list[TokenLogprob], label: str = "") -> None:
    for lp in logprobs:
        alternatives = ", ".join(f"{_token_text(t.token_bytes)} {t.logprob:.4f}" for t in lp.top_logprobs)
        print(f"{label}{lp.logprob:.4f}\t{_token_text(lp.token_bytes)}"
              + ("\tforced" if lp.forced else f"\t[{alternatives}]" if alternatives else ""), file=sys.stderr)


def _print_warnings(warnings: list[SchemaWarning]) -> None:
    for w in warnings:
        print(f"warning: {w.message}", file=sys.stderr)


def _print_check(check: str | None, violations: list[SchemaViolation], detail: str, label: str = "") -> None:
    for v in violations:
        print(f"{label}schema violation: {v.keyword} at {v.instance_pointer or '(root)'}: {v.message}",
              file=sys.stderr)
    if check == "unchecked" or detail:
        print(f"{label}schema check {check}: {detail}", file=sys.stderr)


def _print_all(client: InferenceClient, prompt: Prompt, options: dict[str, Any],
               json_output: bool) -> tuple[str | None, str | None]:
    """Prints the n completions in index order; returns the worst (finish_reason, schema_check): a failed
    finish before any other, then an invalid output."""
    completions = client.complete_all(prompt, **options)
    for c in completions:
        if json_output:
            print(json.dumps({"index": c.index, **_json_line(c, options["logprobs"])}), flush=True)
            continue
        print(f"--- completion {c.index} ({c.finish_reason}) ---")
        print(c.text, flush=True)
        label = f"completion {c.index}: "
        _print_logprobs(c.logprobs, label)
        _print_check(c.schema_check, c.schema_violations, c.schema_check_detail, label)
    if not json_output:
        _print_warnings(completions[0].warnings)  # one constraint: the same for every completion
    failed = [c.finish_reason for c in completions if c.finish_reason in _FAILED_FINISH_REASONS]
    invalid = any(c.schema_check == "invalid" for c in completions)
    return (failed[0] if failed else completions[0].finish_reason), ("invalid" if invalid else None)


def _token_text(raw: bytes) -> str:
    """A token as a quoted JSON string (a token may hold part of a UTF-8 character: U+FFFD then)."""
    return json.dumps(raw.decode("utf-8", "replace"), ensure_ascii=False)


def _logprob_json(lp: TokenLogprob) -> dict[str, Any]:
    """OpenAI's shape (token, logprob, bytes, top_logprobs) plus the token id and whether it was forced."""
    return {
        "token_id": lp.token_id, "token": lp.token_bytes.decode("utf-8", "replace"), "bytes": list(lp.token_bytes),
        "logprob": lp.logprob, "forced": lp.forced,
        "top_logprobs": [{"token_id": t.token_id, "token": t.token_bytes.decode("utf-8", "replace"),
                          "bytes": list(t.token_bytes), "logprob": t.logprob} for t in lp.top_logprobs],
    }


def _json_line(completion: Completion, logprobs: bool) -> dict[str, Any]:
    usage = completion.usage
    line: dict[str, Any] = {
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                  "forced_tokens": usage.forced_tokens},
    }
    if logprobs:
        line["logprobs"] = [_logprob_json(lp) for lp in completion.logprobs]
    if completion.warnings:
        line["warnings"] = [dataclasses.asdict(w) for w in completion.warnings]
    if completion.schema_check is not None:
        line["schema_check"] = completion.schema_check
        line["schema_violations"] = [dataclasses.asdict(v) for v in completion.schema_violations]
        line["schema_check_detail"] = completion.schema_check_detail
    return line


def _print_json(client: InferenceClient, prompt: Prompt, options: dict[str, Any]) -> tuple[str, str | None]:
    completion = client.complete(prompt, **options)
    print(json.dumps(_json_line(completion, options["logprobs"])), flush=True)
    return completion.finish_reason, completion.schema_check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="structd generate", description=__doc__.splitlines()[0])
    add_arguments(parser, dict(os.environ))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
