"""Assembles and runs the grammar service: gRPC server, health, reflection, metrics.

Health is NOT_SERVING until the compile workers are up and the preload file
is compiled; on SIGTERM it turns NOT_SERVING, stops accepting, and lets
in-flight calls finish within the grace period. Whether llguidance imports
is found once, as the replica is built: without it the replica serves from
xgrammar (one warning), or refuses to start where --grammar-backend names
llguidance.
"""

from __future__ import annotations

import asyncio
import logging

from grammar_svc.compile import preload
from grammar_svc.compile.backend import GrammarBackend
from grammar_svc.compile.llguidance_backend import (AUTO, LLGUIDANCE, LlguidanceAvailability, install_hint,
                                                    probe_llguidance)
from grammar_svc.config import GrammarServiceConfig
from grammar_svc.step.mask_filler import MaskFiller
from grammar_svc.metrics import GrammarMetrics
from grammar_svc.output_check import OutputChecks
from grammar_svc.servicer import GrammarServicer
from grammar_svc.step.sessions import SessionLimiter
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.gen.grammar.v1 import grammar_service_pb2_grpc as pb_grpc
from shared.service_host import Hosted, ServiceHost, run_until_signalled

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GrammarService"].full_name


class GrammarServer(Hosted):
    """One grammar replica. `start` returns once it is SERVING; `stop` drains. `llguidance`: whether llguidance
    imports (None: found out here, by importing it)."""

    def __init__(self, config: GrammarServiceConfig, *, llguidance: LlguidanceAvailability | None = None):
        self.config = config
        self.llguidance = llguidance if llguidance is not None else probe_llguidance()
        _check_llguidance(self.llguidance, config.grammar_backend)
        self.metrics = GrammarMetrics()
        self.limiter = SessionLimiter(config.max_sessions, self.metrics, config.max_sessions_per_stream)
        self.backend = GrammarBackend(
            compile_workers=config.compile_workers, cache_bytes=config.cache_bytes,
            max_spec_bytes=config.max_spec_bytes, default_timeout_seconds=config.compile_timeout_seconds,
            max_timeout_seconds=config.max_compile_timeout_seconds,
            timeout_cache_seconds=config.compile_timeout_cache_seconds,
            max_compile_workers=config.compile_workers_bound,
            compile_lane_after_seconds=config.compile_lane_after_seconds, metrics=self.metrics,
            max_tokenizers=config.max_tokenizers, max_compiles_per_caller=config.max_compiles_per_caller,
            tokenizers_in_sessions=self.limiter.fingerprints_in_use,
            worker_memory_limit_bytes=config.worker_memory_limit_bytes, grammar_backend=config.grammar_backend,
            fallback_after_seconds=config.fallback_after_seconds, llguidance=self.llguidance)
        self.filler = MaskFiller(config.fill_threads, config.max_row_fill_seconds)
        self.checks = OutputChecks(self.backend, self.metrics, config.check_workers,
                                   memory_limit_bytes=config.worker_memory_limit_bytes)
        self.servicer = GrammarServicer(backend=self.backend, limiter=self.limiter, filler=self.filler,
                                        metrics=self.metrics, max_tokens_per_step=config.max_tokens_per_step,
                                        max_mask_cache_slots=config.max_mask_cache_slots, checks=self.checks)
        # Created in start(): grpc.aio objects bind to the running event loop.
        self.host: ServiceHost | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        c = self.config
        self.host = ServiceHost((SERVICE_NAME,))
        pb_grpc.add_GrammarServiceServicer_to_server(self.servicer, self.host.server)
        self.host.listen(c.host, c.port, c.tls)
        if c.health_port:
            self.host.listen_health(c.host, c.health_port)
        await self.host.start()
        if c.metrics_port:
            self.host.serve_metrics(c.host, c.metrics_port, self.metrics.registry)
        await self.backend.start()
        await self.checks.warm()
        if c.preload_file is not None:
            await self._preload()
        self._sweeper = asyncio.create_task(self._sweep_forever())
        await self.host.set_serving(True)
        log.info("grammar service SERVING on %s:%d (%s; metrics on :%d)", c.host, self.port,
                 c.tls.describe() if c.tls else "plaintext", self.metrics_port)

    async def _preload(self) -> None:
        from shared.tokenizer import describe, load_hf_tokenizer

        path = self.config.preload_tokenizer
        tok = await asyncio.to_thread(load_hf_tokenizer, str(path) if path else None)
        desc = await asyncio.to_thread(describe, tok, len(tok))
        await self.backend.register_tokenizer(desc.fingerprint, desc.compressed_info(), desc.compressed_hf())
        items = preload.read(self.config.preload_file)
        ok = 0
        for i, (line, spec) in enumerate(items, 1):
            if isinstance(spec, Exception):
                log.warning("preload line %d skipped: %s", line, spec)
                continue
            try:
                await self.backend.compile(desc.fingerprint, spec)
                ok += 1
            except Exception as e:  # noqa: BLE001 - a bad preload line must not stop the replica
                log.warning("preload line %d failed to compile: %s", line, e)
            log.info("preload: %d/%d compiled", i, len(items))
        log.info("preload done: %d of %d constraints compiled", ok, len(items))

    async def _sweep_forever(self) -> None:
        ttl = self.config.session_idle_ttl_seconds
        while True:
            await asyncio.sleep(min(max(ttl / 4, 0.05), 30.0))
            expired = await asyncio.to_thread(self.limiter.sweep, ttl)
            if expired:
                log.info("expired %d idle sessions", expired)

    async def stop(self, grace: float | None = None) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self.host is not None:
            await self.host.stop(self.config.grace_seconds if grace is None else grace)
        await self.backend.close()
        self.servicer.close()
        self.filler.close()
        self.checks.close()


def _check_llguidance(llguidance: LlguidanceAvailability, grammar_backend: str) -> None:
    """Says once, at start, what the replica does about llguidance; refuses to start where it is the only backend
    configured and does not import (every constraint would fail)."""
    if llguidance.available:
        log.info("grammar backends: xgrammar and llguidance %s", llguidance.version)
        return
    if grammar_backend == LLGUIDANCE:
        raise SystemExit(f"the grammar service cannot start with --grammar-backend llguidance: "
                         f"{llguidance.why_missing()}. Install it ({install_hint()}) or start with --grammar-backend "
                         "auto or xgrammar")
    auto = (", and auto serves every constraint from xgrammar (no fallback to llguidance for what xgrammar refuses, "
            "crashes on or compiles slowly)") if grammar_backend == AUTO else ""
    log.warning("%s: requests naming llguidance are refused (UNIMPLEMENTED)%s; install it with %s",
                llguidance.why_missing(), auto, install_hint())


async def serve(config: GrammarServiceConfig) -> None:
    server = GrammarServer(config)

    async def stop() -> None:
        log.info("draining (grace %.1f s)", config.grace_seconds)
        await server.stop()

    await run_until_signalled(server.start(), stop, lambda: (
        f"grammar service listening on {config.host}:{server.port} "
        f"(metrics http://{config.host}:{server.metrics_port}/metrics)"))
