"""The gateway's one error table: gRPC status code -> HTTP status and OpenAI error body.

Everything that goes wrong in a request ends here: a status from the
inference service (its message passed on as it is, incident id included),
a domain error raised by the gateway itself (mapped to its gRPC code by
`shared.status`, the one exception table, then to HTTP here), or an
`ApiError` that already knows its HTTP status (a body too large). Clients
get OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, so the
SDKs raise their usual exceptions (openai.BadRequestError for a 400, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from shared import errors
from shared.status import status_for

# gRPC code -> (HTTP status, OpenAI error type). One rule: a request that can never succeed is a 4xx the
# OpenAI SDKs do not retry (INVALID_ARGUMENT and its kin: 400; a body too large: 413, an ApiError); "try
# later" maps to a status they retry (409, 429, 5xx): RESOURCE_EXHAUSTED is overloaded now, UNAVAILABLE a
# replica gone, ABORTED the two tiers disagreeing on a token, where a retry is safe.
HTTP_FOR_CODE: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    # OpenAI answers an unknown model with 404 and type invalid_request_error.
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    # nginx's "client closed request": only logs and metrics ever see it.
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# INTERNAL, UNKNOWN, DATA_LOSS and anything else: a bug somewhere; the message carries the incident id.
SERVER_ERROR = (500, "server_error")


class ModelNotFoundError(errors.NotFoundError):
    """The request names a model this deployment does not serve."""

    param = "model"
    code = "model_not_found"

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.")


class InvalidParameterError(errors.InvalidRequestError):
    """A request body field with a wrong type or value; `param` names it as OpenAI does (dotted path)."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class ApiError(Exception):
    """An error answered as HTTP `status` with an OpenAI error body."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_status(code: grpc.StatusCode, message: str, param: str | None = None,
                error_code: str | None = None) -> ApiError:
    status, kind = HTTP_FOR_CODE.get(code, SERVER_ERROR)
    return ApiError(status, message, kind, param, error_code or code.name.lower())


def from_exception(exc: BaseException) -> ApiError:
    """The answer for anything a request handler raised (bugs get 500 and an incident id in the log)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        return from_status(exc.code(), exc.details() or exc.code().name)
    code, message = status_for(exc)
    return from_status(code, message, getattr(exc, "param", None), getattr(exc, "code", None))
