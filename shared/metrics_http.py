"""The `/metrics` HTTP endpoint of a service (and of an engine-core process): prometheus_client's WSGI app
on a thread, which a stop closes at once.

prometheus_client's own `start_http_server` runs `serve_forever()` with the
default poll of socketserver, so every drain and every restart of a service
waited up to that long on its metrics thread noticing the shutdown; this
loop polls every POLL_SECONDS (an idle wake-up costs next to nothing).
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

POLL_SECONDS = 0.05


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass  # a scrape every few seconds is not worth a log line


class MetricsHttp:
    """Serves `registry` on host:port (0: any free port, read back from `port`) until `close()`."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry):
        # An IPv6 host ("::") needs an AF_INET6 socket; getaddrinfo says which family the host is.
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        self._httpd = make_server(sockaddr[0], port, make_wsgi_app(registry), server_class, handler_class=_Quiet)
        self.port: int = self._httpd.server_port
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(POLL_SECONDS,),
                                        name="structd-metrics-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops accepting scrapes and closes the port (blocking for at most one poll)."""
        self._httpd.shutdown()
        self._httpd.server_close()
