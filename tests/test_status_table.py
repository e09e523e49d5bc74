"""The one status table (shared/status.py), a test per row, and its rule.

The rule: a request that can never succeed (malformed, or past a limit it can
never pass) is INVALID_ARGUMENT, which no client retries; one refused for what
is happening now is RESOURCE_EXHAUSTED or UNAVAILABLE, which clients retry.
Each row is stated here as well as in the table, so changing a row's code
fails its test until both say the same.
"""

from __future__ import annotations

import grpc
import pytest

from shared import errors
from shared.status import MAX_DETAILS_BYTES, STATUS_TABLE, capped, error_for_code, status_for

C = grpc.StatusCode
NEVER_SUCCEEDS, TRY_LATER, OTHER = "never succeeds", "try later", "other"
ROWS = [
    pytest.param(errors.InvalidGrammarError, C.INVALID_ARGUMENT, NEVER_SUCCEEDS, id="invalid-grammar"),
    pytest.param(errors.InvalidRequestError, C.INVALID_ARGUMENT, NEVER_SUCCEEDS, id="invalid-request"),
    pytest.param(errors.RequestTooLargeError, C.INVALID_ARGUMENT, NEVER_SUCCEEDS, id="request-too-large"),
    pytest.param(errors.LimitExceededError, C.RESOURCE_EXHAUSTED, TRY_LATER, id="limit-exceeded-busy-now"),
    pytest.param(errors.CompileTimeoutError, C.DEADLINE_EXCEEDED, OTHER, id="compile-timeout"),
    pytest.param(errors.CheckTimeoutError, C.DEADLINE_EXCEEDED, OTHER, id="check-timeout"),
    pytest.param(errors.UnknownTokenizerError, C.FAILED_PRECONDITION, OTHER, id="unknown-tokenizer"),
    pytest.param(errors.BackendNotInstalledError, C.UNIMPLEMENTED, OTHER, id="backend-not-installed"),
    pytest.param(errors.NotFoundError, C.NOT_FOUND, OTHER, id="not-found"),
    pytest.param(errors.UnavailableError, C.UNAVAILABLE, TRY_LATER, id="unavailable"),
    pytest.param(errors.CancelledError, C.CANCELLED, OTHER, id="cancelled"),
    pytest.param(errors.GrammarDesyncError, C.ABORTED, TRY_LATER, id="grammar-desync"),
    pytest.param(errors.InternalError, C.INTERNAL, OTHER, id="internal"),
]
# Codes clients retry (the OpenAI SDKs retry 408, 409, 429 and 5xx; gRPC clients UNAVAILABLE and the like).
RETRIED = {C.RESOURCE_EXHAUSTED, C.UNAVAILABLE, C.ABORTED, C.DEADLINE_EXCEEDED, C.INTERNAL}


def test_every_row_is_tested_here():
    assert set(STATUS_TABLE) == {p.values[0] for p in ROWS}


@pytest.mark.parametrize("cls, code, kind", ROWS)
def test_row(cls, code, kind):
    assert STATUS_TABLE[cls] == code
    assert status_for(cls("what went wrong")) == (code, "what went wrong")
    if kind == NEVER_SUCCEEDS:
        assert code not in RETRIED
    elif kind == TRY_LATER:
        assert code in RETRIED


@pytest.mark.parametrize("cls, code", [
    # Subclasses take their base's row (the table is searched along the MRO).
    pytest.param(errors.NoAllowedTokenError, C.INVALID_ARGUMENT, id="no-allowed-token"),
    pytest.param(errors.GrammarCrashError, C.INVALID_ARGUMENT, id="grammar-crash"),
])
def test_subclasses_take_their_bases_row(cls, code):
    assert status_for(cls("m"))[0] == code


def test_a_limit_that_can_never_pass_is_not_a_busy_limit():
    # Two types, so nothing can raise the retried code for a request that can never succeed.
    assert not issubclass(errors.RequestTooLargeError, errors.LimitExceededError)
    assert issubclass(errors.RequestTooLargeError, errors.InvalidRequestError)


def test_anything_else_is_internal_with_an_incident_and_no_traceback():
    code, message = status_for(KeyError("secret detail"))
    assert code == C.INTERNAL and "incident" in message and "secret" not in message


def test_codes_received_from_another_service_become_the_first_row_for_them():
    assert type(error_for_code(C.INVALID_ARGUMENT.value[0], "m", errors.UnavailableError)) is errors.InvalidGrammarError
    assert type(error_for_code(C.RESOURCE_EXHAUSTED.value[0], "m", errors.UnavailableError)) is errors.LimitExceededError
    # Another service's bug is this side's default, never INTERNAL.
    assert type(error_for_code(C.INTERNAL.value[0], "m", errors.UnavailableError)) is errors.UnavailableError
    assert type(error_for_code(C.INTERNAL.value[0], "m", errors.CancelledError)) is errors.CancelledError
    assert type(error_for_code(C.ABORTED.value[0], "m", errors.UnavailableError)) is errors.GrammarDesyncError


def sent_bytes(message: str) -> int:
    """Its length percent-encoded as gRPC sends details."""
    return sum(1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode()) for ch in message)


def test_a_lone_surrogate_is_sent_as_its_escape():
    # grpc cannot encode it: the call would never be answered.
    assert capped("property '\ud800' accepts no value") == "property '\\ud800' accepts no value"


@pytest.mark.parametrize("message, cut", [
    pytest.param("a" * MAX_DETAILS_BYTES, 0, id="at-the-cap-as-it-is"),
    pytest.param("a" * (MAX_DETAILS_BYTES + 1), MAX_DETAILS_BYTES + 1 - (MAX_DETAILS_BYTES - 31), id="ascii-past-it"),
    pytest.param("%" * MAX_DETAILS_BYTES, MAX_DETAILS_BYTES - (MAX_DETAILS_BYTES - 31) // 3, id="percent-sent-as-3"),
    pytest.param("\u00e9" * MAX_DETAILS_BYTES, MAX_DETAILS_BYTES - (MAX_DETAILS_BYTES - 31) // 6, id="utf8-sent-as-6"),
])
def test_long_details_are_cut_to_the_cap_saying_how_much(message, cut):
    # Past the client's header limit a call ends RESOURCE_EXHAUSTED in place of its own code.
    out = capped(message)
    assert sent_bytes(out) <= MAX_DETAILS_BYTES
    assert out == message if not cut else out == f"{message[:len(message) - cut]} ... [{cut} more characters cut]"
