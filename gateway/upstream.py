"""The gateway's one gRPC channel to the inference service, and what it asks of it besides Generate.

One `grpc.aio` channel per process, with round_robin load balancing: a
`dns:///NAME:PORT` target that resolves to several inference replicas
spreads requests over all of them (a plain HOST:PORT is one address, where
round_robin changes nothing). `GetModelInfo`'s answer is cached for
`--model-info-ttl-seconds`; once it is older, requests go on with it while
one refresh runs in the background (a replica that does not answer costs
that refresh its deadline, not every request), and only a gateway that has
never had an answer waits for one.
The channel health-checks every replica (gRPC's client-side health
checking: each address's grpc.health.v1 Watch): a replica that answers
NOT_SERVING (draining, its engine dead) leaves round_robin's pick list until
it serves again, so requests go to the replicas that serve. Readiness
(/health) is a Health.Check sent over the same channel: it lands on a
serving replica while there is one, so /health says 200 while any replica
serves and 503 once none does, rather than alternating with the replica
round robin picked.
A call a replica refuses with UNAVAILABLE before it answered anything (it
is draining, or it cannot be reached) is tried again, `--retries` times, by
gRPC's retry policy: round_robin sends the next attempt to the next replica.
A stream that has sent a response is never retried (gRPC commits a call
once anything of the answer arrived), so no client sees text twice.
Each Generate names the API key's identity as its end client
(`x-structd-end-client`), which the inference service believes from a
caller with a client certificate (--target-tls-*) only.
With TLS, a rotated client certificate (see `renew_if_rotated`) is presented
by a new channel for new requests, while those in flight finish on the old.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.client_identity import END_CLIENT_METADATA
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from shared.grpc_options import CHANNEL_OPTIONS, service_config
from shared.tls import CertificateFiles, ClientTls, aio_channel

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
# A health check or model-info call that takes longer than this means the upstream is not fit to serve.
PROBE_TIMEOUT_SECONDS = 2.0
# After a client certificate rotation, how long requests still on the old channel may go on before it closes.
RETIRED_CHANNEL_GRACE_SECONDS = 600.0


class Upstream:
    """Build it inside the running event loop (grpc.aio objects bind to it)."""

    def __init__(self, target: str, model_info_ttl_seconds: float, tls: ClientTls | None = None, *,
                 retries: int = 0, retry_buffer_bytes: int = 0):
        """tls: dial over TLS (mutual with a client certificate); None: plaintext. retries: attempts after the
        first of a call refused with UNAVAILABLE; retry_buffer_bytes: the largest request that can be retried
        (gRPC keeps a call's request to send it again; a larger one is sent once; 0: gRPC's default)."""
        self.target = target
        self.tls = tls
        self._options = CHANNEL_OPTIONS + (
            ("grpc.service_config", service_config(SERVICE_NAME, retries=retries, round_robin=True,
                                                   health_check=True)),)
        if retry_buffer_bytes:
            self._options += (("grpc.per_rpc_retry_buffer_size", retry_buffer_bytes),)
        self._tls_files = CertificateFiles(tls) if tls is not None else None
        self._connect()
        self._retiring: set[asyncio.Task] = set()
        self._ttl = model_info_ttl_seconds
        self._info: pb.GetModelInfoResponse | None = None
        self._info_at = 0.0
        self._refresh: asyncio.Task | None = None

    def _connect(self) -> None:
        self.channel = aio_channel(self.target, self.tls, self._options)
        self.stub = pb_grpc.InferenceServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def renew_if_rotated(self) -> bool:
        """When the client certificate files changed: new requests go over a new channel that presents the new
        certificate; the old channel closes once its requests finish (or after RETIRED_CHANNEL_GRACE_SECONDS)."""
        if self._tls_files is None or not self._tls_files.changed():
            return False
        old = self.channel
        self._connect()
        task = asyncio.ensure_future(old.close(RETIRED_CHANNEL_GRACE_SECONDS))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        self._tls_files.loaded()
        return True

    def generate(self, request: pb.GenerateRequest, end_client: str = "") -> grpc.aio.UnaryStreamCall:
        """end_client: the API key's identity ("": none, the gateway itself is the caller)."""
        return self.stub.Generate(request, metadata=_end_client(end_client))

    async def tokenize(self, request: pb.TokenizeRequest, end_client: str = "") -> pb.TokenizeResponse:
        return await self.stub.Tokenize(request, metadata=_end_client(end_client))

    async def detokenize(self, request: pb.DetokenizeRequest, end_client: str = "") -> pb.DetokenizeResponse:
        return await self.stub.Detokenize(request, metadata=_end_client(end_client))

    async def model_info(self) -> pb.GetModelInfoResponse:
        """The served model's info: the cached answer, refreshed in the background once older than
        `model_info_ttl_seconds`; with none cached, the first answer, or the RPC's error."""
        if self._refresh is None and (self._info is None or time.monotonic() - self._info_at > self._ttl):
            self._refresh = asyncio.ensure_future(self._fetch_info())
            self._refresh.add_done_callback(self._refreshed)
        if self._info is not None:
            return self._info
        return await asyncio.shield(self._refresh)  # one waiter leaving does not cancel it for the others

    async def _fetch_info(self) -> pb.GetModelInfoResponse:
        info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=PROBE_TIMEOUT_SECONDS)
        self._info, self._info_at = info, time.monotonic()
        return info

    def _refreshed(self, task: asyncio.Task) -> None:
        self._refresh = None
        if not task.cancelled() and task.exception() is not None and self._info is not None:
            # The upstream's: requests go on with the cached info; the next one after this tries again.
            log.warning("model info refresh failed (serving the cached info): %s", task.exception())

    async def ready(self) -> bool:
        """A replica answers SERVING (connected, loaded, not draining): the channel's health checking sends the
        probe to a replica that serves while one does."""
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                            timeout=PROBE_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError:
            return False  # the upstream's: down, unreachable or too slow; /health says 503
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        for task in self._retiring:
            task.cancel()
        await self.channel.close()


def _end_client(identity: str) -> tuple[tuple[str, str], ...] | None:
    return ((END_CLIENT_METADATA, identity),) if identity else None
