"""gRPC channel and server options shared by both services, and the service config of a client's channel."""

import json

# The tokenizer handshake carries ~1 MB compressed; a 128-row step of dense
# masks is ~2 MB. 64 MiB leaves room for large vocabularies and batches.
MAX_MESSAGE_BYTES = 64 << 20

SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Accept the clients' keepalive pings below (default would answer GOAWAY).
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
)

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Keep step streams alive through idle periods and notice dead peers.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.enable_retries", 1),
    # A peer that went away (a replica restarting, a service draining) is dialled again with the attempts
    # starting about a second apart at most (gRPC jitters them; an attempt to an address that drops packets
    # still lasts up to gRPC's minimum connect timeout). gRPC's default backoff grows to two minutes, so a
    # channel to a replica that had been down a while tried again only long after it was back on its port.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)

# A readiness poll's channel (structd up, the benchmarks' and tests' starts): dialled again at every poll, so
# a service is seen serving within a poll of its port opening, not when the backoff next fires.
POLL_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 200),
)

# gRPC makes at most five attempts of a call, whatever a retry policy asks; retries are the attempts after the first.
MAX_RETRIES = 4
# Backoff between attempts: a replica that is draining is not back within it, the next one picked is what helps.
RETRY_INITIAL_BACKOFF_SECONDS = 0.05
RETRY_MAX_BACKOFF_SECONDS = 1.0


def service_config(service: str, *, retries: int = 0, round_robin: bool = False, health_check: bool = False) -> str:
    """A channel's service config (the `grpc.service_config` option) for calls to `service` ("pkg.Service").

    retries > 0: a call answered UNAVAILABLE is tried again, up to `retries` more times, with backoff. gRPC
    retries only a call that has not been committed, and a call is committed once the client has received
    anything from the server (its headers or a message): a stream that has already sent a response is never
    sent again, so no client sees part of an answer twice; a refusal before any response (a draining replica,
    a connection that failed) is what gets retried. round_robin: spread calls over every address the target
    resolves to, so a retry goes to the next replica rather than back to the one that refused.
    health_check: gRPC's client-side health checking (each address's grpc.health.v1 Watch for `service`): an
    address that answers NOT_SERVING (a draining replica) leaves the pick list until it serves again, so calls
    and a readiness probe sent over the channel go only to replicas that serve; with none serving, a call fails
    UNAVAILABLE at once. Needs round_robin (pick_first does not health-check in grpcio).
    """
    config: dict = {}
    if round_robin:
        config["loadBalancingConfig"] = [{"round_robin": {}}]
    if health_check:
        if not round_robin:
            raise ValueError("health_check needs round_robin")
        config["healthCheckConfig"] = {"serviceName": service}
    if retries:
        if not 0 < retries <= MAX_RETRIES:
            raise ValueError(f"retries must be 0..{MAX_RETRIES} (gRPC makes at most {MAX_RETRIES + 1} attempts)")
        config["methodConfig"] = [{
            "name": [{"service": service}],
            "retryPolicy": {"maxAttempts": retries + 1, "initialBackoff": f"{RETRY_INITIAL_BACKOFF_SECONDS}s",
                            "maxBackoff": f"{RETRY_MAX_BACKOFF_SECONDS}s", "backoffMultiplier": 2,
                            "retryableStatusCodes": ["UNAVAILABLE"]},
        }]
    return json.dumps(config)
