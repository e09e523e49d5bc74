"""Prometheus metrics of the gateway (`gateway_*`; names are part of the ops contract).

One CollectorRegistry per gateway instance, as in the services, so tests can
run one in-process. Labels stay low-cardinality: the route is one of the
API's fixed paths, the HTTP status is its class (2xx, 4xx, 5xx), the
upstream error its gRPC code name.
"""

from __future__ import annotations

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Whole requests, from a cached /v1/models answer to minutes-long completions on a CPU.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize")
STREAM_ROUTES = ROUTES[:3]
STATUS_CLASSES = ("2xx", "4xx", "5xx")


def status_class(status: int) -> str:
    return f"{status // 100}xx"


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "gateway_requests", "Finished API requests by route and HTTP status class (a stream counts once, "
            "with the status its headers carried).", ["route", "status_class"], registry=r)
        self.duration = Histogram(
            "gateway_request_duration_seconds", "Request arrival to its last byte sent (streams: to [DONE]).",
            ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(
            "gateway_time_to_first_token_seconds", "Streams only: request arrival to the first generated token "
            "sent to the client.", ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge(
            "gateway_requests_in_flight", "API requests being answered (streams until their last chunk).",
            ["route"], registry=r)
        self.disconnects = Counter(
            "gateway_client_disconnects", "Requests whose client went away before the answer was complete "
            "(the gRPC call was cancelled).", ["route"], registry=r)
        self.upstream_errors = Counter(
            "gateway_upstream_errors", "gRPC calls to the inference service that ended in an error status, by "
            "code (a client's own cancel excluded).", ["code"], registry=r)
        # Every child exported from the start: dashboards and rates see zeros, not gaps.
        for route in ROUTES:
            self.duration.labels(route)
            self.in_flight.labels(route)
            for cls in STATUS_CLASSES:
                self.requests.labels(route, cls)
        for route in STREAM_ROUTES:
            self.ttft.labels(route)
            self.disconnects.labels(route)
        for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE,
                     grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED):
            self.upstream_errors.labels(code.name)
