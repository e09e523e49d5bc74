"""What every structd server has around its own service: gRPC health and reflection, the Prometheus
endpoint, and the SIGTERM/SIGINT run loop.

Both services (and the health-only tensor-parallel worker ranks) use it, so
probes, drains and `/metrics` behave the same everywhere: health answers
NOT_SERVING from the moment the port is open until the service says it is
ready, and again from the moment it starts to drain.

With TLS the service's port takes only TLS (and, with a client CA, only
clients with a certificate from it); an optional plaintext health port then
answers grpc.health.v1 alone, from the same health state, for probes that
cannot present a certificate (the kubelet's gRPC probe): it serves no other
service, so nothing but SERVING/NOT_SERVING is reachable without TLS.
With an allow-list of client names (`ServerTls.allowed_clients`) every
call on the service's port, health included, comes from one of them or is
refused PERMISSION_DENIED (shared/client_identity.py). `max_concurrent_rpcs`
bounds the calls in progress at once, streams included: past it grpc
refuses new ones with RESOURCE_EXHAUSTED, which clients retry.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from shared.client_identity import AllowedClients
from shared.grpc_options import SERVER_OPTIONS
from shared.metrics_http import MetricsHttp
from shared.tls import ServerTls, server_credentials

log = logging.getLogger(__name__)


class ServiceHost:
    """A grpc.aio server with health (overall and per service), reflection and an optional /metrics port.

    Build it inside the running event loop (grpc.aio objects bind to it).
    """

    def __init__(self, service_names: tuple[str, ...], *, reflection_enabled: bool = True,
                 max_concurrent_rpcs: int | None = None):
        self.service_names = service_names
        self.health = health.aio.HealthServicer()
        # Allows everyone until listen() is given TLS with an allow-list.
        self.allowed_clients = AllowedClients()
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=(self.allowed_clients,),
                                      maximum_concurrent_rpcs=max_concurrent_rpcs)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflection_enabled:
            reflection.enable_server_reflection(
                (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.port = 0
        self.metrics_port = 0
        self.health_port = 0
        # The plaintext health-only server (listen_health), None without one.
        self._health_server: grpc.aio.Server | None = None
        self._metrics_http = None

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    def listen(self, host: str, port: int, tls: ServerTls | None = None) -> int:
        """The service's port: TLS (mutual with a client CA, named clients only with an allow-list) when tls is
        given, else plaintext."""
        address = f"{host}:{port}"
        if tls is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.allowed_clients.allowed = frozenset(tls.allowed_clients)
            self.port = self.server.add_secure_port(address, server_credentials(tls))
        if self.port == 0:
            raise SystemExit(f"cannot listen on {address}")
        return self.port

    def listen_health(self, host: str, port: int) -> int:
        """A plaintext port that answers grpc.health.v1 only (the same statuses as the service's port)."""
        self._health_server = grpc.aio.server(options=SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        self.health_port = self._health_server.add_insecure_port(f"{host}:{port}")
        if self.health_port == 0:
            raise SystemExit(f"cannot listen on {host}:{port} (health port)")
        return self.health_port

    def serve_metrics(self, host: str, port: int, registry: CollectorRegistry) -> None:
        """Starts the /metrics endpoint (port 0 in the config disables it: do not call)."""
        self._metrics_http = MetricsHttp(host, port, registry)
        self.metrics_port = self._metrics_http.port

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()
        if self._health_server is not None:
            await self._health_server.start()

    async def stop(self, grace: float) -> None:
        """NOT_SERVING, then the gRPC server stops (in-flight calls get `grace` seconds) and /metrics closes."""
        await self.set_serving(False)
        await self.server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(0)
        self.close_metrics()

    def close_metrics(self) -> None:
        if self._metrics_http is not None:
            self._metrics_http.close()
            self._metrics_http = None


class Hosted:
    """For a server class that keeps its ServiceHost in `self.host` (None until started): where it listens."""

    host: ServiceHost | None = None

    @property
    def port(self) -> int:
        return self.host.port if self.host else 0

    @property
    def metrics_port(self) -> int:
        return self.host.metrics_port if self.host else 0


async def run_until_signalled(start: Awaitable[None], stop: Callable[[], Awaitable[None]], announce: Callable[[], str],
                              failed: asyncio.Event | None = None) -> None:
    """Starts a server, prints `announce()` once it is up, runs until SIGTERM/SIGINT (or `failed`), then stops.

    A signal during start-up cancels it. When `failed` was set (the service
    broke beyond repair), the process exits non-zero so its orchestrator
    replaces it.
    """
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    starting = asyncio.ensure_future(start)
    stopped = asyncio.ensure_future(stop_requested.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        starting.result()
        print(announce(), flush=True)
        waits = {stopped}
        broken = asyncio.ensure_future(failed.wait()) if failed is not None else None
        if broken is not None:
            waits.add(broken)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if broken is not None:
            broken.cancel()
    else:
        starting.cancel()
    stopped.cancel()
    await stop()
    if failed is not None and failed.is_set():
        raise SystemExit("the service stopped because it failed (see the log above)")
