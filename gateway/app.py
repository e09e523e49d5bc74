"""The gateway's HTTP surface: a Starlette app with the OpenAI routes, /health and /metrics.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST
/v1/responses` (OpenAI's Responses API, stateless), `GET
/v1/models` (and `/v1/models/{id}`), vLLM's `POST /tokenize` and `POST
/detokenize`, `GET /health` (200 while an inference
replica answers SERVING, else 503: upstream.py) and `GET /metrics` (Prometheus), all on
one port as in vLLM. Every failure is answered through errors.py; unknown
paths and methods too, in the same OpenAI error shape. With --api-key,
every path but /health and /metrics needs a key (auth.py); with
--allowed-origins, browsers on those origins may call (CORS).
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import errors
from gateway.auth import ApiKeyMiddleware, ApiKeys, key_identity
from gateway.exchange import CLIENT_GONE, ClientGone, EventStream, Record, collect, read, until_disconnect
from gateway.intake import Intake, Translate
from gateway.metrics import GatewayMetrics
from gateway.responses_stream import ResponsesEventStream
from gateway.translation.request import chat_request, completion_request
from gateway.translation.responses import ResponsesReply, responses_request
from gateway.translation.tokens import detokenize_reply, detokenize_request, tokenize_reply, tokenize_request
from gateway.translation.response import ChatReply, CompletionReply, model_list, model_object
from gateway.upstream import Upstream

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "x-request-id"


class GatewayApp:
    def __init__(self, upstream: Upstream, metrics: GatewayMetrics, intake: Intake, *,
                 api_keys: ApiKeys | None = None, allowed_origins: tuple[str, ...] = ()):
        """api_keys: the keys requests must bear (None: none needed); allowed_origins: CORS (empty: none)."""
        self.upstream = upstream
        self.metrics = metrics
        self.intake = intake
        self.api_keys = api_keys
        self.allowed_origins = allowed_origins

    def middleware(self) -> list[Middleware]:
        """CORS outside the key check: a browser's preflight carries no key, and a 401 still gets the CORS
        headers that let the page read it."""
        stack = []
        if self.allowed_origins:
            stack.append(Middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                                    allow_methods=["GET", "POST"], allow_headers=["*"],
                                    expose_headers=[REQUEST_ID_HEADER]))
        if self.api_keys is not None:
            stack.append(Middleware(ApiKeyMiddleware, keys=self.api_keys))
        return stack

    def build(self) -> Starlette:
        return Starlette(middleware=self.middleware(), routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ], exception_handlers={HTTPException: self.http_error})

    # ------------------------------------------------------------------ errors

    def api_error(self, exc: BaseException) -> errors.ApiError:
        if isinstance(exc, grpc.aio.AioRpcError):
            self.metrics.upstream_errors.labels(exc.code().name).inc()
        error = errors.from_exception(exc)
        if error.status >= 500:
            log.warning("answered %d: %s", error.status, error.message)
        return error

    def error_response(self, exc: BaseException, record: Record | None = None) -> Response:
        error = self.api_error(exc)
        if record is not None:
            record.done(error.status)
        # A body refused for its size may be left unread (its declared length is past the limit, or it grew past
        # it), and its connection could carry another request only once all of it had come: closed with the
        # answer, rather than held open until the keep-alive timeout.
        headers = {"connection": "close"} if error.status == 413 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    async def http_error(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own 404 / 405, in the OpenAI error shape."""
        error = errors.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                "invalid_request_error")
        return JSONResponse(error.body(), status_code=error.status)

    # ------------------------------------------------------------------ completions

    async def _generate(self, request: Request, route: str, prefix: str, translate: Translate,
                        reply_type: type[ChatReply] | type[CompletionReply] | type[ResponsesReply],
                        stream_type: type[EventStream] = EventStream) -> Response:
        record = Record(self.metrics, route)
        call = None
        streaming = False
        try:
            info = await self.upstream.model_info()
            reply_id = f"{prefix}{uuid.uuid4().hex}"
            request_id = request.headers.get(REQUEST_ID_HEADER) or reply_id
            # Only the translation outlives the body: what the generation needs, not what the client sent.
            translated = await self.intake.translated(request, translate, info.model_id, request_id)
            reply = reply_type(translated, reply_id, int(time.time()))
            headers = {REQUEST_ID_HEADER: request_id}
            call = self.upstream.generate(translated.grpc_request, key_identity(request.scope))
            if translated.stream:
                first = await until_disconnect(request.receive, read(call))
                streaming = True
                return stream_type(call, reply, first, record, self.api_error, headers)
            result = await until_disconnect(request.receive, collect(call, reply))
            record.done(200)
            return JSONResponse(result, headers=headers)
        except (ClientGone, ClientDisconnect):  # the client's: it left; its call is cancelled below
            record.done(CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        except Exception as e:  # noqa: BLE001 - the client's, the upstream's or ours: answered via errors.py
            return self.error_response(e, record)
        finally:
            if call is not None and not streaming:
                call.cancel()  # no-op once finished; stops the generation when we answer early

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/chat/completions", "chatcmpl-", chat_request, ChatReply)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/completions", "cmpl-", completion_request, CompletionReply)

    async def responses(self, request: Request) -> Response:
        return await self._generate(request, "/v1/responses", "resp_", responses_request, ResponsesReply,
                                    ResponsesEventStream)

    # ------------------------------------------------------------------ tokens

    async def _unary(self, request: Request, route: str, translate: Translate, call, shape) -> Response:
        """A request answered by one unary call to the inference service: its body translated by `translate`,
        sent by `call`, the answer shaped by `shape`."""
        record = Record(self.metrics, route)
        try:
            info = await self.upstream.model_info()
            message = await self.intake.translated(request, translate, info.model_id, "")
            result = shape(await call(message, key_identity(request.scope)))
        except ClientDisconnect:
            record.done(CLIENT_GONE)
            return Response(status_code=CLIENT_GONE)
        except Exception as e:  # noqa: BLE001 - the client's, the upstream's or ours: answered via errors.py
            return self.error_response(e, record)
        record.done(200)
        return JSONResponse(result)

    async def tokenize(self, request: Request) -> Response:
        return await self._unary(request, "/tokenize", tokenize_request, self.upstream.tokenize, tokenize_reply)

    async def detokenize(self, request: Request) -> Response:
        return await self._unary(request, "/detokenize", detokenize_request, self.upstream.detokenize,
                                 detokenize_reply)

    # ------------------------------------------------------------------ models, health, metrics

    async def models(self, request: Request) -> Response:
        record = Record(self.metrics, "/v1/models")
        try:
            info = await self.upstream.model_info()
        except Exception as e:  # noqa: BLE001 - the upstream's (down, or GetModelInfo unimplemented)
            return self.error_response(e, record)
        record.done(200)
        return JSONResponse(model_list(info))

    async def model(self, request: Request) -> Response:
        record = Record(self.metrics, "/v1/models")
        try:
            info = await self.upstream.model_info()
            if request.path_params["model"] != info.model_id:
                raise errors.ModelNotFoundError(request.path_params["model"])
        except Exception as e:  # noqa: BLE001 - the client's (unknown model) or the upstream's
            return self.error_response(e, record)
        record.done(200)
        return JSONResponse(model_object(info))

    async def health(self, request: Request) -> Response:
        if await self.upstream.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "detail": f"no inference replica at {self.upstream.target} "
                                                                "is SERVING"}, status_code=503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)
