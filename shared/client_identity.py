"""Who is calling: the names a client certificate carries, the allow-list every TLS server checks them against,
and the end client a trusted caller speaks for.

Mutual TLS proves that a client holds a certificate from the CA; the
allow-list (`--tls-allowed-clients`) says which of those may call this
server at all: the grammar tier only the inference replicas, the inference
service only the gateway and named clients. grpc's TLS credentials cannot
filter by name, so `AllowedClients` is a server interceptor that reads each
call's authenticated peer (its certificate's CN and SANs) and refuses
everyone else with PERMISSION_DENIED before the handler runs.

`END_CLIENT_METADATA` carries the end client a caller acts for (a caller
of the inference service that fronts many users names each one there; the
gateway does not yet, having no API keys; the inference service passes its
own caller's identity on to the grammar tier). It is believed only from callers
that authenticated with a certificate, which an allow-list narrows to the
operator's own services: per-caller limits then count each end client
apart.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence

import grpc

# Metadata key (gRPC keys are lower case) naming the end client a certificate-authenticated caller acts for.
END_CLIENT_METADATA = "x-structd-end-client"
# An end client's name is a label, not a payload: longer values are cut to this many characters.
MAX_END_CLIENT_CHARS = 128
# The auth context's keys that hold a certificate's names: subject CN first, then every SAN kind grpc reports.
_NAME_KEYS = ("x509_common_name", "x509_subject_alternative_name", "peer_dns", "peer_uri", "peer_email", "peer_ip")


def certificate_names(auth_context: Mapping[str, Sequence[bytes]] | None) -> tuple[str, ...]:
    """The authenticated client certificate's names (CN, then SANs), empty without one."""
    names: list[str] = []
    for key in _NAME_KEYS:
        for value in (auth_context or {}).get(key, ()):
            name = value.decode(errors="replace")
            if name not in names:
                names.append(name)
    return tuple(names)


def certificate_identity(auth_context: Mapping[str, Sequence[bytes]] | None) -> str | None:
    """One name for the certificate: its subject's CN, else its first SAN (None: no client certificate).

    SANs come second since replicas of different tenants may share host names.
    """
    auth = auth_context or {}
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names = auth.get(key)
        if names:
            return names[0].decode(errors="replace")
    return None


def end_client(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The END_CLIENT_METADATA value in these metadata ("" when absent); believe it only from a certificate."""
    for key, value in metadata or ():
        if key == END_CLIENT_METADATA:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            return text.strip()[:MAX_END_CLIENT_CHARS]
    return ""


def acting_for(auth_context: Mapping[str, Sequence[bytes]] | None,
               metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The end client of a call: its certificate's identity, and the END_CLIENT_METADATA it names within it
    ("gateway/key-1"; "" without a client certificate, whose metadata is not believed)."""
    identity = certificate_identity(auth_context)
    if identity is None:
        return ""
    forwarded = end_client(metadata)
    return f"{identity}/{forwarded}" if forwarded else identity


def parse_allowed(raw: str) -> tuple[str, ...]:
    """--tls-allowed-clients: comma-separated certificate names (empty: any certificate from the CA)."""
    return tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))


class AllowedClients(grpc.aio.ServerInterceptor):
    """Every call's client certificate must carry one of `allowed` as its CN or a SAN (empty: any client the
    TLS layer accepted); others get PERMISSION_DENIED, naming the certificate and the flag."""

    def __init__(self, allowed: Sequence[str] = ()):
        self.allowed = frozenset(allowed)

    def refusal(self, auth_context) -> str | None:
        """Why this peer may not call (None: it may)."""
        if not self.allowed:
            return None
        names = certificate_names(auth_context)
        if self.allowed.intersection(names):
            return None
        who = f"client certificate {names[0]!r}" if names else "a caller without a client certificate"
        return f"{who} is not among this server's allowed clients (--tls-allowed-clients)"

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not self.allowed:
            return handler
        return _guarded(handler, self)


def _guarded(handler: grpc.RpcMethodHandler, gate: AllowedClients) -> grpc.RpcMethodHandler:
    """The same handler, with the allow-list checked before its behaviour runs."""
    for kind, factory in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                          ("unary_stream", grpc.unary_stream_rpc_method_handler),
                          ("stream_unary", grpc.stream_unary_rpc_method_handler),
                          ("stream_stream", grpc.stream_stream_rpc_method_handler)):
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            return factory(_checked(behaviour, gate), request_deserializer=handler.request_deserializer,
                           response_serializer=handler.response_serializer)
    return handler


def _checked(behaviour, gate: AllowedClients):
    # grpc.aio tells a streaming handler that yields from one that writes by its function type: keep the type.
    if inspect.isasyncgenfunction(behaviour):
        async def streamed(request, context):
            if (why := gate.refusal(context.auth_context())) is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            async for response in behaviour(request, context):
                yield response

        return streamed

    async def called(request, context):
        if (why := gate.refusal(context.auth_context())) is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        result = behaviour(request, context)
        return await result if inspect.isawaitable(result) else result

    return called
