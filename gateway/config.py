"""The gateway's one typed configuration, built from CLI flags and env."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from gateway.auth import ApiKeyFileError, key_problems, read_key_file
from shared.client_identity import parse_allowed
from shared.flags import FlagSet
from shared.grpc_options import MAX_RETRIES
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
    # Keys a request must bear (Authorization: Bearer KEY); empty: no key needed. Never printed.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Origins browsers may call from (CORS); "*" for any; empty: no CORS headers at all.
    allowed_origins: tuple[str, ...] = ()
    # A Generate (or other call) that a replica refuses with UNAVAILABLE before it sent anything is tried again on
    # another replica this many times (gRPC's retry policy; 0: never).
    retries: int = 2

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
        if not 0 <= self.retries <= MAX_RETRIES:
            problems.append(f"--retries must be 0..{MAX_RETRIES} (gRPC makes at most {MAX_RETRIES + 1} attempts)")
        problems.extend(key_problems(self.api_keys))
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
    f.add_repeated("--api-key", "a key clients must send as `Authorization: Bearer KEY` (repeat the flag for "
                   "several; the environment variable takes them comma-separated); without any key (here or in "
                   "--api-key-file) the gateway needs none. /health and /metrics stay open", metavar="KEY")
    f.add("--api-key-file", None, "a file of keys, one a line (blank lines and # comments skipped), added to "
          "--api-key's", kind=Path)
    f.add("--allowed-origins", "", "origins browsers may call from (CORS), comma-separated, or * for any; empty: "
          "no CORS headers")
    f.add("--retries", d.retries, "times a call refused with UNAVAILABLE before any answer (a draining or "
          "unreachable replica) is tried again, on another replica where the target has several (0: never)")
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
        api_keys=api_keys_from_args(args),
        allowed_origins=parse_allowed(args.allowed_origins),
        retries=args.retries,
    ).validate()


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key's keys (or the environment's), then --api-key-file's, each once."""
    keys = list(args.api_key)
    if args.api_key_file is not None:
        try:
            keys += read_key_file(args.api_key_file)
        except ApiKeyFileError as e:
            raise SystemExit(f"invalid gateway configuration: {e}") from None
    return tuple(dict.fromkeys(keys))
