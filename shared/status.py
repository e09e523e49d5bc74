"""The one table that maps exceptions to gRPC status codes.

Servicers call `refuse` (or `status_for`) with whatever they caught; nothing
else in the code base chooses a status code. Exceptions that are not
`StructdError`s are bugs: the client gets INTERNAL with an incident id, the
traceback goes to the log, never to the client.
"""

from __future__ import annotations

import logging
import uuid

import grpc

from shared import errors

log = logging.getLogger(__name__)

STATUS_TABLE: dict[type[BaseException], grpc.StatusCode] = {
    errors.InvalidGrammarError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    # Never succeeds: not RESOURCE_EXHAUSTED, which clients (the OpenAI SDKs among them) retry with back-off.
    errors.RequestTooLargeError: grpc.StatusCode.INVALID_ARGUMENT,
    # Busy now: retried.
    errors.LimitExceededError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.CompileTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.CheckTimeoutError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.UnknownTokenizerError: grpc.StatusCode.FAILED_PRECONDITION,
    # Not the request's fault nor a passing state of the replica: this replica lacks the backend. Not
    # FAILED_PRECONDITION, on which the inference side re-registers the tokenizer (an unknown tokenizer's).
    errors.BackendNotInstalledError: grpc.StatusCode.UNIMPLEMENTED,
    errors.NotFoundError: grpc.StatusCode.NOT_FOUND,
    errors.UnavailableError: grpc.StatusCode.UNAVAILABLE,
    errors.CancelledError: grpc.StatusCode.CANCELLED,
    # The request's state diverged from its grammar session: retrying it is safe.
    errors.GrammarDesyncError: grpc.StatusCode.ABORTED,
    # Logged where it happened (another process); its message names the incident.
    errors.InternalError: grpc.StatusCode.INTERNAL,
}


# Status code number (google.rpc.Code, as the grammar tier reports per-session errors) -> the exception
# to raise on this side: the first class the table maps to that code. Not INTERNAL: another service's
# bug reaches callers as the caller's own default (a grammar replica's INTERNAL is UNAVAILABLE here).
_ERROR_FOR_CODE: dict[int, type[errors.StructdError]] = {}
for _cls, _code in STATUS_TABLE.items():
    if _cls is not errors.InternalError:
        _ERROR_FOR_CODE.setdefault(_code.value[0], _cls)


def error_for_code(code: int, message: str, default: type[errors.StructdError]) -> errors.StructdError:
    """The domain error for a status code received from another service (the inverse of the table)."""
    return _ERROR_FOR_CODE.get(code, default)(message)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(status code, client-facing message) for an exception."""
    for cls in type(exc).__mro__:
        code = STATUS_TABLE.get(cls)
        if code is not None:
            return code, str(exc)
    incident = uuid.uuid4().hex[:12]
    log.error("internal error %s", incident, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (incident {incident}); see the server log"


# The most bytes of details a status carries, as gRPC sends them (percent-encoded, in the grpc-message header): a
# client refuses a header block past its limit (grpcio's hard limit: 16 KiB), and the call then ends
# RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit"), which clients retry, in place of its own code.
MAX_DETAILS_BYTES = 4096


def _sent_bytes(ch: str) -> int:
    """Bytes `ch` takes in grpc-message: printable ASCII but `%` as itself, anything else each UTF-8 byte as %XX."""
    return 1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8"))


def capped(message: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """`message` within `limit` bytes as gRPC sends it: past it, its start and a marker saying how much was cut.
    A lone surrogate (a JSON `"\\ud800"` in a name the message repeats) is written as its escape: grpc cannot
    encode it, and the call was then never answered."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    total = 0
    for i, ch in enumerate(message):
        total += _sent_bytes(ch)
        if total > limit:
            break
    else:
        return message
    # Room for the marker (its digits at most the message's length's).
    room, kept = limit - len(f" ... [{len(message)} more characters cut]"), 0
    total = 0
    for ch in message:
        total += _sent_bytes(ch)
        if total > room:
            break
        kept += 1
    return f"{message[:kept]} ... [{len(message) - kept} more characters cut]"


def refuse(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Sets the call's status to the one the table gives `exc`; the handler then returns (None for a unary call).

    Set, not raised with context.abort: grpc's AbortError passes through
    grpc's own frames, which hold the request message, into reference cycles
    that only a full collection frees, and a process of millions of objects
    (a model, a tokenizer) seldom runs one, so each refused request's bytes,
    up to the message limit, stayed behind. The details are capped()
    (MAX_DETAILS_BYTES): a longer message would reach the client as
    RESOURCE_EXHAUSTED."""
    code, message = status_for(exc)
    context.set_code(code)
    context.set_details(capped(message))
