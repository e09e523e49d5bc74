"""The gateway's one typed configuration, built from CLI flags and env."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from shared.flags import FlagSet
from shared.tls import (ClientTls, ServerTls, add_client_flags, add_server_flags, client_tls_from_args,
                        server_tls_from_args)

ENV_PREFIX = "STRUCTD_GATEWAY_"


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # The inference service (a gRPC target: HOST:PORT, or dns:///NAME:PORT for several replicas, which the
    # gateway balances per request with round_robin).
    target: str = "127.0.0.1:50051"
    # How long GetModelInfo's answer (the served model id, for /v1/models and the `model` check) is reused
    # before it is refreshed (in the background: requests go on with the cached answer meanwhile).
    model_info_ttl_seconds: float = 5.0
    # Largest request body accepted (413 beyond): a long chat with tools is well under 1 MiB; the inference
    # service has its own prompt limit.
    max_body_bytes: int = 4 << 20
    # Bytes of request bodies being read or parsed at once, all requests together (503 beyond): with
    # --limit-concurrency, what bounds the memory that bodies take before they are translated.
    max_body_bytes_in_flight: int = 256 << 20
    # Connections and requests served at once (uvicorn answers 503 beyond); a stream holds one throughout.
    limit_concurrency: int = 1024
    # On SIGTERM: requests in flight get this long to finish before they are cancelled.
    grace_seconds: float = 10.0
    log_level: str = "INFO"
    # None: plain HTTP; else HTTPS with this certificate (clients' certificates required when it names a CA).
    tls: ServerTls | None = None
    # How the inference service is dialled: None: plaintext; else TLS with this CA and client certificate.
    target_tls: ClientTls | None = None

    def validate(self) -> "GatewayConfig":
        problems = []
        if not self.target.strip():
            problems.append("--target needs the inference service's HOST:PORT")
        if not 0 <= self.port <= 65535:
            problems.append("--port must be 0..65535")
        if self.model_info_ttl_seconds < 0:
            problems.append("--model-info-ttl-seconds must be >= 0")
        if self.max_body_bytes < 1024:
            problems.append("--max-body-bytes must be at least 1024")
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            problems.append("--max-body-bytes-in-flight must be at least --max-body-bytes")
        if self.limit_concurrency < 1:
            problems.append("--limit-concurrency must be at least 1")
        if self.grace_seconds < 0:
            problems.append("--grace-seconds must be >= 0")
        for tls in (self.tls, self.target_tls):
            if tls is not None:
                problems.extend(tls.problems())
        if problems:
            raise SystemExit("invalid gateway configuration: " + "; ".join(problems))
        return self


def add_arguments(parser: argparse.ArgumentParser, env: dict[str, str]) -> None:
    """Flags for `structd gateway`; each defaults to STRUCTD_GATEWAY_<NAME> when set."""
    d = GatewayConfig()
    f = FlagSet(parser, env, ENV_PREFIX)
    f.add("--target", d.target, "the inference service: HOST:PORT, or dns:///NAME:PORT to balance over replicas")
    f.add("--host", d.host)
    f.add("--port", d.port, "HTTP port: the OpenAI API, /health and /metrics")
    f.add("--model-info-ttl-seconds", d.model_info_ttl_seconds,
          "how long the inference service's model info (served model id) is cached")
    f.add("--max-body-bytes", d.max_body_bytes, "largest request body accepted (413 beyond)")
    f.add("--max-body-bytes-in-flight", d.max_body_bytes_in_flight,
          "request body bytes being read or parsed at once, all requests together (503 beyond)")
    f.add("--limit-concurrency", d.limit_concurrency, "connections and requests served at once (503 beyond)")
    f.add("--grace-seconds", d.grace_seconds, "on SIGTERM, how long requests in flight may still finish")
    f.add("--log-level", d.log_level)
    add_server_flags(f, what="HTTPS")
    add_client_flags(f, "--target-tls", "the inference service")


def from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        host=args.host,
        port=args.port,
        target=args.target,
        model_info_ttl_seconds=args.model_info_ttl_seconds,
        max_body_bytes=args.max_body_bytes,
        max_body_bytes_in_flight=args.max_body_bytes_in_flight,
        limit_concurrency=args.limit_concurrency,
        grace_seconds=args.grace_seconds,
        log_level=args.log_level,
        tls=server_tls_from_args(args),
        target_tls=client_tls_from_args(args, "--target-tls"),
    ).validate()
