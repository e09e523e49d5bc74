"""Assembles and runs the gateway: the upstream channel, the Starlette app, uvicorn.

uvicorn serves the app on this process's event loop (the same loop as the
grpc.aio channel); signals are handled by shared.service_host's run loop,
as in the services, so SIGTERM stops accepting connections, lets requests
in flight finish for `--grace-seconds`, cancels the rest (their gRPC calls
with them) and exits 0.

With --tls-cert-file it serves HTTPS; the certificate files (and, with
--target-tls-*, the client certificate it presents to the inference service)
are looked at every few seconds and loaded again when they changed
(connections and requests already open keep theirs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn

from gateway.app import GatewayApp
from gateway.auth import ApiKeys
from gateway.config import GatewayConfig
from gateway.intake import Intake
from gateway.metrics import GatewayMetrics
from gateway.upstream import Upstream
from shared.service_host import run_until_signalled
from shared.tls import SslContextRotation, server_ssl_context

log = logging.getLogger(__name__)
# How often the HTTPS certificate files are looked at: cert-manager renews well before expiry, so seconds suffice.
CERTIFICATE_CHECK_SECONDS = 5.0


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the run loop in shared.service_host owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class GatewayServer:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = GatewayMetrics()
        self.upstream: Upstream | None = None
        self.intake: Intake | None = None
        self._uvicorn: _Uvicorn | None = None
        self._task: asyncio.Task | None = None
        self._rotation_task: asyncio.Task | None = None
        self.port = 0

    async def start(self) -> None:
        c = self.config
        self.upstream = Upstream(c.target, c.model_info_ttl_seconds, c.target_tls, retries=c.retries,
                                 retry_buffer_bytes=c.max_body_bytes)
        self.intake = Intake(c.max_body_bytes, c.max_body_bytes_in_flight)
        app = GatewayApp(self.upstream, self.metrics, self.intake, api_keys=ApiKeys(c.api_keys) if c.api_keys else None,
                         allowed_origins=c.allowed_origins).build()
        https, rotation = {}, None
        if c.tls is not None:
            ctx = server_ssl_context(c.tls)
            https = {"ssl_context_factory": lambda _config, _default: ctx}
            rotation = SslContextRotation(ctx, c.tls)
        if rotation is not None or c.target_tls is not None:
            self._rotation_task = asyncio.ensure_future(self._rotate(rotation, self.upstream))
        self._uvicorn = _Uvicorn(uvicorn.Config(
            app, host=c.host, port=c.port, lifespan="off", log_config=None, access_log=False,
            timeout_graceful_shutdown=c.grace_seconds, server_header=False, limit_concurrency=c.limit_concurrency,
            **https))
        self._task = asyncio.ensure_future(self._uvicorn.serve())
        while not self._uvicorn.started:
            if self._task.done():
                self._task.result()  # uvicorn's failure to start (the port is taken, ...) is raised here
                raise SystemExit(f"the gateway could not listen on {c.host}:{c.port}")
            await asyncio.sleep(0.01)
        self.port = self._uvicorn.servers[0].sockets[0].getsockname()[1]
        log.info("gateway on %s (inference service %s; %s; CORS %s)", self.url, c.target,
                 f"{len(c.api_keys)} API key(s)" if c.api_keys else "no API key needed",
                 ",".join(c.allowed_origins) or "off")

    @property
    def url(self) -> str:
        """Where it serves: http(s)://HOST:PORT."""
        return f"{'https' if self.config.tls else 'http'}://{self.config.host}:{self.port}"

    @staticmethod
    async def _rotate(https: SslContextRotation | None, upstream: Upstream) -> None:
        while True:
            await asyncio.sleep(CERTIFICATE_CHECK_SECONDS)
            if https is not None:
                https.check()
            upstream.renew_if_rotated()

    async def stop(self, grace: float | None = None) -> None:
        if self._rotation_task is not None:
            self._rotation_task.cancel()
        if self._uvicorn is not None and self._task is not None:
            if grace is not None:
                self._uvicorn.config.timeout_graceful_shutdown = grace
                # No grace: connections are dropped at once rather than waited for zero seconds.
                self._uvicorn.force_exit = grace == 0
            self._uvicorn.should_exit = True
            await self._task
        if self.upstream is not None:
            await self.upstream.close()


async def serve(config: GatewayConfig) -> None:
    server = GatewayServer(config)
    await run_until_signalled(
        server.start(), server.stop,
        lambda: f"gateway: {server.url}/v1 (inference service {config.target})")
