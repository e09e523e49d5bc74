"""Assembles and runs the inference service: model, grammar tier link, engine, gRPC, health, metrics.

Health is NOT_SERVING until the model is loaded and at least one grammar
replica has the tokenizer; on SIGTERM it turns NOT_SERVING, refuses new
requests (UNAVAILABLE), lets running ones finish within the grace period and
cancels the rest. Should the engine's step loop ever end on its own, health
turns NOT_SERVING at once and the process exits non-zero, so the orchestrator
(Kubernetes, `structd up`) replaces it instead of routing to a dead engine.

The engine runs in this process, or, with `--engine-process on` (`auto`
with CUDA), in an engine core process this one starts (engine_core.py): then this process is
the API server (gRPC, health, chat templates, tools; `EngineClient` stands
in for the engine), and the core loads the model, talks to the grammar tier,
runs the step loop and serves the metrics.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from inference_svc.config import InferenceServiceConfig
from inference_svc.engine.engine import Engine
from inference_svc.core.engine_client import EngineClient
from inference_svc.core.assembly import (GIL_SWITCH_INTERVAL_SECONDS, EngineAssembly, load_chat, load_runner,
                                        load_tokenizer, resolve_source)
from inference_svc.api.frontend import Frontend, ServingInfo
from inference_svc.api.tokenizing import Tokenization
from inference_svc.grammar.grammar_tier import GrammarTier
from inference_svc.metrics import InferenceMetrics
from inference_svc.model.model_loading import ModelInfo, ModelNotFoundError, ModelSource
from inference_svc.api.servicer import InferenceServicer
from inference_svc.model.tensor_parallel import SPAWNED_ENV, RankInfo, rank_from_env, spawn_local_ranks, worker_loop
from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from shared.service_host import Hosted, ServiceHost, run_until_signalled

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name


class InferenceServer(Hosted):
    """One inference replica. `start` returns once it is SERVING; `stop` drains."""

    def __init__(self, config: InferenceServiceConfig, *, rank: RankInfo | None = None,
                 children: Sequence[subprocess.Popen] = (), source: ModelSource | None = None):
        self.config = config
        self.rank = rank  # rank 0 of a tensor-parallel group, or None
        self.children = list(children)  # ranks 1..N-1 this process started
        self.source = source  # --model as serve() resolved it (None: start() resolves it)
        # Set once the weights are loaded: served name, resolved model id and path, dtype, load time.
        self.model_info: ModelInfo | None = None
        # With the engine in this process: its stack, runner, grammar tier and metrics (with --engine-process
        # on they live in the core process, and `engine` is the EngineClient that talks to it).
        self.stack: EngineAssembly | None = None
        self.runner = None
        self.metrics = InferenceMetrics()
        self.engine: Engine | EngineClient | None = None
        self.grammar: GrammarTier | None = None
        self.frontend: Frontend | None = None
        self.host: ServiceHost | None = None
        # Set when the engine died: serve() stops and exits non-zero.
        self.failed = asyncio.Event()

    async def start(self, grammar_connect_timeout: float = 600.0) -> None:
        c = self.config
        self.host = ServiceHost((SERVICE_NAME,), max_concurrent_rpcs=c.max_concurrent_rpcs)
        own_process = c.engine_in_own_process()
        if own_process:
            if self.source is None:
                self.source = await asyncio.to_thread(resolve_source, c)
            self.engine = client = EngineClient(c, rank=self.rank, source=self.source, on_fatal=self._engine_died)
            await client.launch(grammar_connect_timeout)  # the core loads the model while this one loads the tokenizer
            tok = await asyncio.to_thread(load_tokenizer, c, self.source)
            template, family, _ = await asyncio.to_thread(load_chat, c, tok)
        else:
            if c.metrics_port:
                self.host.serve_metrics(c.host, c.metrics_port, self.metrics.registry)
            self.stack = EngineAssembly(c, self.metrics, rank=self.rank, source=self.source, on_fatal=self._engine_died)
            served = await self.stack.build()
            self.engine, self.runner, self.grammar = self.stack.engine, self.stack.runner, self.stack.grammar
            self.model_info = served.info
            template, family, _ = self.stack.chat
            tok = self.stack.tokenizer
        self.host.listen(c.host, c.port, c.tls)
        if c.health_port:
            self.host.listen_health(c.host, c.health_port)
        await self.host.start()  # NOT_SERVING until the engine is ready

        if own_process:
            served, self.host.metrics_port = await client.ready()
            self.model_info = served.info
        else:
            await self.stack.connect(grammar_connect_timeout)
            self.stack.start()
        serving = ServingInfo(model_id=served.info.served_name, max_model_len=served.max_model_len,
                              vocab_size=served.vocab_size, has_chat_template=template.available,
                              family=family.name if family is not None else "",
                              loaded_unix_seconds=int(served.info.loaded_unix_seconds))
        log.info("chat template: %s; model family: %s", "yes" if serving.has_chat_template else "none",
                 serving.family or "none")
        self.frontend = Frontend(self.engine, template, family)
        tokenization = Tokenization(tok, template, vocab_size=serving.vocab_size,
                                    max_prompt_bytes=c.engine.max_prompt_bytes)
        pb_grpc.add_InferenceServiceServicer_to_server(InferenceServicer(self.frontend, serving, tokenization),
                                                       self.host.server)
        await self.host.set_serving(True)
        log.info("inference service SERVING on %s:%d (%s; engine %s; metrics on :%d)", c.host, self.port,
                 c.tls.describe() if c.tls else "plaintext",
                 "in its own process" if own_process else "in this process", self.metrics_port)

    def _engine_died(self, cause: BaseException | None) -> None:
        log.critical("the engine stopped (%r): NOT_SERVING; the process exits so it is replaced", cause)
        self.failed.set()
        asyncio.ensure_future(self.host.set_serving(False))

    async def stop(self, grace: float | None = None) -> None:
        grace = self.config.grace_seconds if grace is None else grace
        if self.host is not None:
            await self.host.set_serving(False)
        if self.engine is not None:
            await self.engine.drain(grace)
        if self.host is not None:
            await self.host.stop(1.0)
        if self.frontend is not None:
            self.frontend.close()
        if isinstance(self.engine, EngineClient):
            await self.engine.close()  # the core closes its engine, ranks and grammar streams itself
            await self._wait_children()
        elif self.stack is not None:
            await self.stack.close()
            await self._wait_children()

    async def _wait_children(self) -> None:
        for child in self.children:
            try:
                await asyncio.to_thread(child.wait, 30)
            except subprocess.TimeoutExpired:
                child.kill()


async def serve_worker(config: InferenceServiceConfig, rank: RankInfo, health_port: int | None) -> None:
    """Ranks 1..N-1: load this rank's shard, then run every step rank 0 broadcasts.

    In a LeaderWorkerSet each rank is a pod with gRPC probes: health_port
    serves grpc.health.v1 (SERVING once the shard is loaded).
    """
    host = None
    if health_port is not None:
        host = ServiceHost((), reflection_enabled=False)
        host.listen(config.host, health_port, config.tls)
        if config.health_port:
            host.listen_health(config.host, config.health_port)
        await host.start()
    # One thread loads the shard and runs every step, as the engine's device thread does on rank 0: the current
    # CUDA device (init_group sets it to this rank's GPU) is per thread, and kernels launched without an explicit
    # device (Triton's) go to it. Two asyncio.to_thread calls may land on two threads of the default pool.
    device_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-device")
    loop = asyncio.get_running_loop()
    try:
        runner, *_ = await loop.run_in_executor(device_thread, load_runner, config, rank)
        if host is not None:
            await host.set_serving(True)
        steps = await loop.run_in_executor(device_thread, worker_loop, runner)
    finally:
        device_thread.shutdown(wait=False)
    log.info("tensor-parallel rank %d: rank 0 stopped the group after %d steps", rank.rank, steps)
    if host is not None:
        await host.stop(0)


async def serve(config: InferenceServiceConfig, argv: Sequence[str] = ()) -> None:
    """Runs one replica until SIGTERM/SIGINT. argv: the flags it was started with; with --tp N and no
    rank layout in the environment, ranks 1..N-1 are started locally with the same flags."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)  # see core/assembly.py
    rank, children = None, []
    if config.tp > 1:
        rank = rank_from_env(dict(os.environ), config.tp)
        if rank is not None and rank.rank != 0:
            # A rank this process started itself shares rank 0's host and ports: no health server.
            local = os.environ.get(SPAWNED_ENV) == "1"
            await serve_worker(config, rank, None if local else config.port)
            return
    # Before any other rank starts and before anything listens: a --model that names nothing ends the process
    # with one line. Blocking on purpose: Ctrl-C stops a download at once (a worker thread would be waited for).
    try:
        source = resolve_source(config)
    except ModelNotFoundError as e:  # the user's --model (or their network, token, cache)
        raise SystemExit(f"structd inference: {e}") from None
    if config.tp > 1 and rank is None:
        rank, children = spawn_local_ranks(config.tp, argv)
    server = InferenceServer(config, rank=rank, children=children, source=source)

    async def stop() -> None:
        log.info("draining (grace %.1f s)", config.grace_seconds)
        await server.stop()

    await run_until_signalled(server.start(), stop, lambda: (
        f"inference service listening on {config.host}:{server.port} "
        f"(metrics http://{config.host}:{server.metrics_port}/metrics)"), failed=server.failed)
