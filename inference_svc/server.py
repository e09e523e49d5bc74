"""Assembles and runs the inference service: model, grammar tier link, engine, gRPC, health, metrics.

Health is NOT_SERVING until the model is loaded and at least one grammar
replica has the tokenizer; on SIGTERM it turns NOT_SERVING, refuses new
requests (UNAVAILABLE), lets running ones finish within the grace period and
cancels the rest. Should the engine's step loop ever end on its own, health
turns NOT_SERVING at once and the process exits non-zero, so the orchestrator
(Kubernetes, `structd up`) replaces it instead of routing to a dead engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from inference_svc.config import InferenceServiceConfig
from inference_svc.engine import Engine, TokenizerView
from inference_svc.frontend import Frontend, ServingInfo
from inference_svc.grammar_tier import GrammarTier
from inference_svc.metrics import InferenceMetrics
from inference_svc.model_loading import ModelInfo, ModelNotFoundError, ModelSource, resolve_model
from inference_svc.servicer import InferenceServicer
from inference_svc.tensor_parallel import (SPAWNED_ENV, RankInfo, TensorParallelRunner, init_group, rank_from_env,
                                           spawn_local_ranks, worker_loop)
from shared.gen.inference.v1 import inference_service_pb2 as pb
from shared.gen.inference.v1 import inference_service_pb2_grpc as pb_grpc
from shared.service_host import Hosted, ServiceHost, run_until_signalled

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceService"].full_name
GIL_SWITCH_INTERVAL_SECONDS = 0.0005
# Context length of the simulated runner (it has no model config).
SIMULATED_MAX_MODEL_LEN = 8192


def tokenizer_view(tokenizer, extra_eos_ids=(), think_ids: tuple[int, int] | None = None) -> TokenizerView:
    from inference_svc.text_stream import special_token_ids, token_bytes_for

    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos.update(extra_eos_ids)

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    start, end = think_ids if think_ids is not None else (None, None)
    return TokenizerView(encode=encode, token_bytes=token_bytes_for(tokenizer),
                         special_ids=frozenset(special_token_ids(tokenizer)), eos_ids=frozenset(eos),
                         think_start_id=start, think_end_id=end)


def resolve_source(config: InferenceServiceConfig) -> ModelSource:
    """Where --model is on this machine (downloaded into the Hugging Face cache when it must be)."""
    return resolve_model(config.model, embedded_cache_dir=config.model_cache_dir, weights=not config.simulate_step_ms)


def load_runner(config: InferenceServiceConfig, rank: RankInfo | None = None, source: ModelSource | None = None):
    """(runner, tokenizer, eos ids from the generation config, max model length, ModelInfo).

    source: --model as serve() already resolved it (None: resolved here).
    With a tensor-parallel rank, joins the group first, agrees with rank 0 on
    the snapshot, and loads this rank's shard; rank 0 gets a runner that
    broadcasts every step to the others.
    """
    import torch

    from inference_svc.model_loading import default_device, load_model, resolve_on_group
    from inference_svc.model_runner import PagedModelRunner
    from shared.tokenizer import load_hf_tokenizer

    started = time.perf_counter()
    device = config.device or default_device()
    if device == "cpu":
        torch.set_num_threads(config.torch_threads())
    if rank is not None:
        init_group(rank, "cuda" if device.startswith("cuda") else "cpu")
        source = resolve_on_group(config.model, rank.rank, source, embedded_cache_dir=config.model_cache_dir)
    source = source or resolve_source(config)

    def info(dtype: str) -> ModelInfo:
        return ModelInfo(config.served_model_name or source.default_name, source, dtype, device,
                         time.perf_counter() - started, time.time())

    if config.simulate_step_ms:
        from inference_svc.simulated_runner import SimulatedRunner

        # The embedded model's tokenizer is the packaged one: the same cached instance the handshake uses.
        tok = load_hf_tokenizer(str(source.path) if config.model is not None else None)
        runner = SimulatedRunner(config.simulate_step_ms / 1000.0, vocab_size=len(tok),
                                 block_size=config.block_size)
        return runner, tok, (), SIMULATED_MAX_MODEL_LEN, info("")
    model, tok = load_model(source.path, device, config.dtype, tensor_parallel=rank is not None)
    runner = PagedModelRunner.create(model, block_size=config.block_size, kv_cache_bytes=config.kv_cache_bytes,
                                     tp_size=config.tp)
    if (mode := config.compile_mode(device)) != "off":
        from inference_svc.compiled_forward import CompiledBody, CompileSettings, default_compile_cache_dir

        CompiledBody.install(model, CompileSettings(mode, config.bucket_sizes(),
                                                    config.compile_cache_dir or default_compile_cache_dir()),
                             progress=log.info)
    if rank is not None and rank.rank == 0:
        runner = TensorParallelRunner(runner)
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    return runner, tok, eos_ids, model.config.max_position_embeddings, info(str(model.dtype).removeprefix("torch."))


def load_chat(config: InferenceServiceConfig, tokenizer):
    """(chat template, model family, (think-start id, end-of-thinking id) or None) for this model."""
    from inference_svc.chat import ChatTemplate, ChatTemplateError
    from inference_svc.model_family import detect_family, load_family

    try:
        template = ChatTemplate.load(tokenizer, str(config.chat_template) if config.chat_template else None)
    except ChatTemplateError as e:  # the operator's --chat-template file: say so and stop
        raise SystemExit(f"--chat-template {config.chat_template}: {e}") from None
    if config.model_family == "none":
        family = None
    elif config.model_family == "auto":
        family = detect_family(tokenizer.get_vocab())
    else:
        try:
            family = load_family(config.model_family)
        except ValueError as e:  # the operator's flag: say so and stop
            raise SystemExit(f"--model-family {config.model_family}: {e}") from None
    vocab = tokenizer.get_vocab()
    think = family.think_token_ids(vocab) if family is not None else None
    if family is not None and family.think_start and think is None:
        log.warning("model family %s: %r / %r are not tokens of this tokenizer; thinking is off",
                    family.name, family.think_start, family.think_end)
    return template, family, think


class InferenceServer(Hosted):
    """One inference replica. `start` returns once it is SERVING; `stop` drains."""

    def __init__(self, config: InferenceServiceConfig, rank: RankInfo | None = None,
                 children: Sequence[subprocess.Popen] = (), source: ModelSource | None = None):
        self.config = config
        self.rank = rank  # rank 0 of a tensor-parallel group, or None
        self.children = list(children)  # ranks 1..N-1 this process started
        self.source = source  # --model as serve() resolved it (None: start() resolves it)
        # Set once the weights are loaded: served name, resolved model id and path, dtype, load time.
        self.model_info: ModelInfo | None = None
        self.runner = None
        self.metrics = InferenceMetrics()
        self.engine: Engine | None = None
        self.grammar: GrammarTier | None = None
        self.host: ServiceHost | None = None
        self._maintain: asyncio.Task | None = None
        # Set when the engine died: serve() stops and exits non-zero.
        self.failed = asyncio.Event()

    async def start(self, grammar_connect_timeout: float = 600.0) -> None:
        from shared.tokenizer import describe

        c = self.config
        self.host = ServiceHost((SERVICE_NAME,))
        if c.metrics_port:
            self.host.serve_metrics(c.host, c.metrics_port, self.metrics.registry)

        runner, tok, eos_ids, max_model_len, info = await asyncio.to_thread(load_runner, c, self.rank, self.source)
        self.runner, self.model_info = runner, info
        log.info("model %s ready in %.1f s (served as %s; vocab %d; %s)", info.source.model_id, info.load_seconds,
                 info.served_name, runner.vocab_size,
                 "simulated" if c.simulate_step_ms else f"{info.dtype} on {info.device}")
        desc = await asyncio.to_thread(describe, tok, runner.vocab_size)
        template, family, think = await asyncio.to_thread(load_chat, c, tok)
        view = await asyncio.to_thread(tokenizer_view, tok, eos_ids, think)
        self.grammar = GrammarTier(c.grammar_targets, desc, c.engine.compile_timeout_seconds,
                                   write_sparse_rows=runner.device.type != "cpu",
                                   step_timeout_seconds=c.grammar_step_timeout_seconds, tls=c.grammar_tls)
        self.engine = Engine(runner, view, self.grammar, c.engine, self.metrics, max_model_len,
                             on_fatal=self._engine_died)
        serving = ServingInfo(model_id=info.served_name, max_model_len=self.engine.max_model_len,
                              vocab_size=len(view.token_bytes), has_chat_template=template.available,
                              family=family.name if family is not None else "",
                              loaded_unix_seconds=int(info.loaded_unix_seconds))
        log.info("chat template: %s; model family: %s", "yes" if serving.has_chat_template else "none",
                 serving.family or "none")
        servicer = InferenceServicer(Frontend(self.engine, template, family), serving)
        pb_grpc.add_InferenceServiceServicer_to_server(servicer, self.host.server)
        self.host.listen(c.host, c.port, c.tls)
        if c.health_port:
            self.host.listen_health(c.host, c.health_port)
        await self.host.start()

        deadline = time.monotonic() + grammar_connect_timeout
        while (n := await self.grammar.connect()) == 0:
            if time.monotonic() > deadline:
                raise SystemExit(f"no grammar replica reachable at {','.join(c.grammar_targets)}")
            log.info("waiting for the grammar tier at %s ...", ",".join(c.grammar_targets))
            await asyncio.sleep(1.0)
        log.info("grammar tier: %d of %d replica(s) have the tokenizer", n, len(self.grammar.targets))
        self._maintain = asyncio.create_task(self.grammar.maintain(), name="grammar-tier-maintenance")
        self.engine.start()
        await self.host.set_serving(True)
        log.info("inference service SERVING on %s:%d (%s; metrics on :%d)", c.host, self.port,
                 c.tls.describe() if c.tls else "plaintext", self.metrics_port)

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
        if self.engine is not None:
            await self.engine.close()
        if isinstance(self.runner, TensorParallelRunner):
            await asyncio.to_thread(self.runner.close)
        for child in self.children:
            try:
                await asyncio.to_thread(child.wait, 30)
            except subprocess.TimeoutExpired:
                child.kill()
        if self._maintain is not None:
            self._maintain.cancel()
        if self.grammar is not None:
            await self.grammar.close()


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
    runner, *_ = await asyncio.to_thread(load_runner, config, rank)
    if host is not None:
        await host.set_serving(True)
    steps = await asyncio.to_thread(worker_loop, runner)
    log.info("tensor-parallel rank %d: rank 0 stopped the group after %d steps", rank.rank, steps)
    if host is not None:
        await host.stop(0)


async def serve(config: InferenceServiceConfig, argv: Sequence[str] = ()) -> None:
    """Runs one replica until SIGTERM/SIGINT. argv: the flags it was started with; with --tp N and no
    rank layout in the environment, ranks 1..N-1 are started locally with the same flags."""
    # The forward runs on its own thread while the event loop handles gRPC and grammar answers: with
    # CPython's default 5 ms GIL switch interval, a finished forward can wait milliseconds to be
    # noticed. Hand the GIL over at least every 0.5 ms instead.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_SECONDS)
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
    server = InferenceServer(config, rank, children, source)

    async def stop() -> None:
        log.info("draining (grace %.1f s)", config.grace_seconds)
        await server.stop()

    await run_until_signalled(server.start(), stop, lambda: (
        f"inference service listening on {config.host}:{server.port} "
        f"(metrics http://{config.host}:{server.metrics_port}/metrics)"), failed=server.failed)
