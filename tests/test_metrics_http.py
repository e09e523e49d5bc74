"""The /metrics endpoint every service serves (shared/metrics_http.py): the registry's exposition on the port
asked for, IPv6 hosts included, and a close that frees the port for the next start."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from shared.metrics_http import MetricsHttp


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:  # this machine's: no IPv6 loopback
        return False


@pytest.mark.parametrize("host, url_host", [
    pytest.param("127.0.0.1", "127.0.0.1", id="ipv4"),
    pytest.param("::1", "[::1]", id="ipv6",
                 marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")),
])
def test_serves_the_registry_then_frees_its_port(host, url_host):
    registry = CollectorRegistry()
    Counter("structd_test_things", "Things counted.", registry=registry).inc(3)
    endpoint = MetricsHttp(host, 0, registry)
    try:
        with urllib.request.urlopen(f"http://{url_host}:{endpoint.port}/metrics", timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            assert "structd_test_things_total 3.0" in r.read().decode()
    finally:
        endpoint.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{url_host}:{endpoint.port}/metrics", timeout=2)
    # Closed, not lingering: the next start of a service takes the same port.
    again = MetricsHttp(host, endpoint.port, registry)
    again.close()
