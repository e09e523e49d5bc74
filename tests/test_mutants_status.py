"""The status table's edges that mutation testing found untested (docs/mutation.md): what a client and the log see.

An unknown exception reaches the client as INTERNAL naming a 12-hex
incident id, and the log line carries the same id and the traceback; a
status code from another service becomes its domain error with the
message intact; `refuse` sets a real call's status and details (a real
gRPC server on loopback, one handler that refuses).
"""

from __future__ import annotations

import asyncio
import logging
import re

import grpc
import pytest

from shared import errors
from shared.status import error_for_code, refuse, status_for


def test_a_received_code_becomes_its_error_with_the_message():
    err = error_for_code(grpc.StatusCode.NOT_FOUND.value[0], "no grammar g1", errors.UnavailableError)
    assert type(err) is errors.NotFoundError and str(err) == "no grammar g1"
    fallback = error_for_code(grpc.StatusCode.INTERNAL.value[0], "replica bug", errors.UnavailableError)
    assert type(fallback) is errors.UnavailableError and str(fallback) == "replica bug"


def test_a_bug_is_internal_with_an_incident_the_log_names_with_its_traceback(caplog):
    try:
        raise KeyError("slot")
    except KeyError as e:
        bug = e
    with caplog.at_level(logging.ERROR, logger="shared.status"):
        code, message = status_for(bug)
    assert code == grpc.StatusCode.INTERNAL
    incident = re.fullmatch(r"internal error \(incident ([0-9a-f]{12})\); see the server log", message)
    assert incident, message
    (record,) = [r for r in caplog.records if r.name == "shared.status"]
    assert record.getMessage() == f"internal error {incident.group(1)}"
    assert record.exc_info is not None and record.exc_info[1] is bug


@pytest.mark.parametrize("exc, code, details", [
    pytest.param(errors.InvalidGrammarError("bad regex"), grpc.StatusCode.INVALID_ARGUMENT, "bad regex", id="known"),
    pytest.param(errors.GrammarDesyncError("desync"), grpc.StatusCode.ABORTED, "desync", id="desync"),
    pytest.param(RuntimeError("boom"), grpc.StatusCode.INTERNAL, "internal error (incident ", id="bug"),
])
def test_refuse_sets_a_real_calls_status_and_details(exc, code, details):
    async def scenario():
        async def handler(request, context):
            refuse(context, exc)
            return b""

        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "test.Refuse", {"Call": grpc.unary_unary_rpc_method_handler(handler)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await channel.unary_unary("/test.Refuse/Call")(b"", timeout=10)
                return refused.value
        finally:
            await server.stop(None)

    err = asyncio.run(scenario())
    assert err.code() == code and err.details().startswith(details)
