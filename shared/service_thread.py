"""A service (anything with async start() and stop(grace)) run on a private event loop in a daemon thread.

Tests and in-process benchmarks use it to reach a real server over real gRPC
on loopback while still being able to look at its internals: `call` runs a
coroutine on the server's loop, `run_sync` a plain function there (engine
state is only touched on that loop).
"""

from __future__ import annotations

import asyncio
import threading


class ServiceThread:
    def __init__(self, server, name: str, start_timeout: float = 600.0, **start_kwargs):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self._thread.start()
        self.server = server
        self.call(server.start(**start_kwargs), timeout=start_timeout)

    def call(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run_sync(self, fn, timeout: float = 30.0):
        async def go():
            return fn()

        return self.call(go(), timeout)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        """Idempotent: a test may stop a server early (a lost replica); its fixture stops it again."""
        if not self._thread.is_alive():
            return
        self.call(self.server.stop(0), timeout=60.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
