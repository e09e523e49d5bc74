"""The engine and what it stands on, assembled: model runner, tokenizer view, chat template, grammar tier.

One assembly for both ways the service runs (`--engine-process`): inside the
API server's process (server.py), or in the engine core process that server
starts (engine_core.py). Either way the steps are the same: load the model,
describe its tokenizer to the grammar tier, build the engine, wait for a
grammar replica, start the step loop; and on the way out drain, close the
engine, stop the tensor-parallel ranks and the grammar tier's streams.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from inference_svc.config import DEFAULT_KV_CACHE_BYTES, InferenceServiceConfig
from inference_svc.engine.engine import Engine, TokenizerView
from inference_svc.grammar.grammar_tier import REPLICA_STATES, GrammarTier
from inference_svc.metrics import InferenceMetrics
from inference_svc.model.model_loading import ModelInfo, ModelSource, default_device, resolve_model
from inference_svc.model.paged_kernel import AttentionBackendError, resolve_backend
from inference_svc.model.tensor_parallel import RankInfo, TensorParallelRunner, agree_on_least, init_group

if TYPE_CHECKING:
    from inference_svc.api.model_family import ModelFamily

log = logging.getLogger(__name__)
# Context length of the simulated runner (it has no model config).
SIMULATED_MAX_MODEL_LEN = 8192
# The forward runs on its own thread while the event loop handles gRPC and grammar answers: with CPython's
# default GIL switch interval, a finished forward can wait milliseconds to be noticed. Whichever process runs
# the engine hands the GIL over more often instead (sys.setswitchinterval): the forward is noticed sooner and
# unconstrained steps get faster, constrained ones no worse, the embedded model unchanged; a shorter interval
# gained nothing more (docs/benchmarks.md, "The GIL switch interval").
GIL_SWITCH_INTERVAL_SECONDS = 0.0001


def tokenizer_view(tokenizer, extra_eos_ids=(), think_ids: tuple[int, int] | None = None,
                   family: ModelFamily | None = None, info_json: str | None = None) -> TokenizerView:
    """The engine's view of the tokenizer; special tokens of the family's tool-call markup stay in the text.
    info_json: the tokenizer's description for the grammar tier, which has every token's bytes."""
    from inference_svc.engine.text_stream import special_token_ids, token_bytes_for

    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos.update(extra_eos_ids)

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    start, end = think_ids if think_ids is not None else (None, None)
    special = frozenset(special_token_ids(tokenizer))
    if family is not None:
        special -= family.markup_ids(dict(zip(special, tokenizer.convert_ids_to_tokens(list(special)))))
    return TokenizerView(encode=encode, token_bytes=token_bytes_for(tokenizer, info_json), special_ids=special,
                         eos_ids=frozenset(eos),
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

    from inference_svc.model.model_loading import load_model, resolve_on_group
    from inference_svc.model.model_runner import PagedModelRunner
    from shared.tokenizer import load_hf_tokenizer

    started = time.perf_counter()
    device = config.device or default_device()
    if device == "cpu":
        torch.set_num_threads(config.torch_threads())
    elif device.startswith("cuda") and rank is None and torch.device(device).index is not None:
        # On this thread, the one that runs the forwards: kernels launched without an explicit device (xgrammar's
        # mask kernel, a new stream) go to --device's GPU, not to cuda:0 (plain "cuda" is cuda:0 already; a
        # tensor-parallel rank sets its own in init_group).
        torch.cuda.set_device(torch.device(device))
    if rank is not None:
        init_group(rank, "cuda" if device.startswith("cuda") else "cpu")
        source = resolve_on_group(config.model, rank.rank, source, embedded_cache_dir=config.model_cache_dir)
    source = source or resolve_source(config)

    def info(dtype: str) -> ModelInfo:
        return ModelInfo(config.served_model_name or source.default_name, source, dtype, device,
                         time.perf_counter() - started, time.time())

    if config.simulate_step_ms:
        from inference_svc.model.simulated_runner import SimulatedRunner

        # The embedded model's tokenizer is the packaged one: the same cached instance the handshake uses.
        tok = load_hf_tokenizer(str(source.path) if config.model is not None else None)
        runner = SimulatedRunner(config.simulate_step_ms / 1000.0, vocab_size=len(tok),
                                 block_size=config.block_size, prefix_caching=config.engine.prefix_caching)
        return runner, tok, (), SIMULATED_MAX_MODEL_LEN, info("")
    model, tok = load_model(source.path, device, config.dtype, tensor_parallel=rank is not None)
    # Sized from the device the weights are on (a tensor-parallel rank's own, set by init_group), not cuda:0.
    config = sized_for_device(config, str(next(model.parameters()).device))
    try:
        attention, why = resolve_backend(config.attention_backend, next(model.parameters()).device)
    except AttentionBackendError as e:  # the operator's --attention-backend on this device: say so and stop
        raise SystemExit(str(e)) from None
    log.info("attention: %s (%s)", attention, why)
    runner = PagedModelRunner.create(model, block_size=config.block_size,
                                     kv_cache_bytes=kv_cache_bytes(config, model, rank),
                                     tp_size=config.tp, packed_head=config.lm_head_kernel == "auto",
                                     greedy_screen=config.engine.greedy_head and config.engine.sparse_head,
                                     prefix_caching=config.engine.prefix_caching, attention_backend=attention)
    if (mode := config.compile_mode(device)) != "off":
        from inference_svc.model.compiled_forward import CompiledBody, CompileSettings, default_compile_cache_dir

        CompiledBody.install(model, CompileSettings(mode, config.bucket_sizes(),
                                                    config.compile_cache_dir or default_compile_cache_dir()),
                             progress=log.info)
    if rank is not None and rank.rank == 0:
        runner = TensorParallelRunner(runner)
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
    return runner, tok, eos_ids, model.config.max_position_embeddings, info(str(model.dtype).removeprefix("torch."))


def sized_for_device(config: InferenceServiceConfig, device: str) -> InferenceServiceConfig:
    """config with the engine's batch sizes that were left to the device (0) set for `device` (the same answer
    on every call and every rank: what a device is does not change)."""
    if config.engine.max_num_seqs and config.engine.max_num_batched_tokens:
        return config
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        engine = config.engine.sized_for("cuda", props.total_memory, props.name)
    else:
        engine = config.engine.sized_for("cpu")
    return replace(config, engine=engine)


def kv_cache_bytes(config: InferenceServiceConfig, model, rank: RankInfo | None) -> int:
    """--kv-cache-bytes, or with 0 what the device leaves (CUDA; every rank of a group agrees on the least)."""
    if config.kv_cache_bytes:
        return config.kv_cache_bytes
    device = next(model.parameters()).device
    if device.type != "cuda":
        return DEFAULT_KV_CACHE_BYTES
    from inference_svc.model.kv_budget import cuda_kv_cache_bytes

    budget = cuda_kv_cache_bytes(model, config.gpu_memory_utilization, config.engine.max_num_batched_tokens,
                                 config.engine.max_num_seqs, model.get_output_embeddings().weight.shape[0],
                                 graphs=config.compile_mode("cuda") != "off")
    return agree_on_least(budget, device) if rank is not None else budget


def load_tokenizer(config: InferenceServiceConfig, source: ModelSource):
    """The tokenizer load_runner loads with the model, without the model (for the API server's chat templates
    when the engine runs in its own process)."""
    if config.simulate_step_ms:
        from shared.tokenizer import load_hf_tokenizer

        return load_hf_tokenizer(str(source.path) if config.model is not None else None)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path, local_files_only=True)


def load_chat(config: InferenceServiceConfig, tokenizer):
    """(chat template, model family, (think-start id, end-of-thinking id) or None) for this model."""
    from inference_svc.api.chat import ChatTemplate, ChatTemplateError
    from inference_svc.api.model_family import detect_family, load_family

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


@dataclass(frozen=True)
class ServedModel:
    """What the API side needs to know of the engine's model (GetModelInfo, request limits)."""

    info: ModelInfo
    max_model_len: int  # the engine's: --max-model-len or the model's context, whichever is smaller
    vocab_size: int  # the tokenizer's


class EngineAssembly:
    """Builds, starts and stops one engine with its runner and grammar tier (in whichever process runs it)."""

    def __init__(self, config: InferenceServiceConfig, metrics: InferenceMetrics, *, rank: RankInfo | None = None,
                 source: ModelSource | None = None,
                 on_fatal: Callable[[BaseException | None], None] | None = None):
        self.config = config
        self.metrics = metrics
        self.rank = rank  # rank 0 of a tensor-parallel group, or None
        self.source = source  # --model as already resolved (None: resolved when built)
        self.on_fatal = on_fatal
        self.runner = None
        self.engine: Engine | None = None
        self.grammar: GrammarTier | None = None
        self.served: ServedModel | None = None
        # load_chat's (template, family, think ids) for the model, once built (the API side renders with them).
        self.chat = None
        # The model's tokenizer, once built (the API side's Tokenize and Detokenize use it).
        self.tokenizer = None
        self._maintain: asyncio.Task | None = None
        # The thread the model was loaded on: the engine's device thread, which runs every forward.
        self.loaded_on: str | None = None

    async def build(self) -> ServedModel:
        """Loads the model and builds the engine (not started: see connect and start)."""
        from shared.tokenizer import describe, description_cache_dir

        c = self.config
        # The model loads (and the compiled body warms up) on the thread that will run every forward: CUDA graph
        # trees keep per-thread state, and the current CUDA device is per thread too (load_runner sets it).
        device_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-device")
        def load():
            self.loaded_on = threading.current_thread().name
            loaded = load_runner(c, self.rank, self.source)
            # The sizes load_runner gave the KV cache and the compiled body, for the engine's scheduler too.
            self.config = sized_for_device(c, c.device or default_device())
            return loaded

        try:
            runner, tok, eos_ids, max_model_len, info = await asyncio.get_running_loop().run_in_executor(
                device_thread, load)
        except BaseException:  # the model's failure to load (reported by the caller): no thread left behind
            device_thread.shutdown(wait=False)
            raise
        self.runner = runner
        self.metrics.kv_cache_bytes.set(runner.kv_cache_bytes)
        e = self.config.engine
        log.info("batch: up to %d sequences and %d tokens a step%s", e.max_num_seqs, e.max_num_batched_tokens,
                 "" if c.engine.max_num_seqs and c.engine.max_num_batched_tokens else " (sized by the device)")
        log.info("model %s ready in %.1f s (served as %s; vocab %d; %s)", info.source.model_id, info.load_seconds,
                 info.served_name, runner.vocab_size,
                 "simulated" if c.simulate_step_ms else f"{info.dtype} on {info.device}")
        desc = await asyncio.to_thread(describe, tok, runner.vocab_size,
                                       cache_dir=description_cache_dir(c.model_cache_dir))
        self.chat = await asyncio.to_thread(load_chat, c, tok)
        self.tokenizer = tok
        view = await asyncio.to_thread(tokenizer_view, tok, eos_ids, self.chat[2], self.chat[1], desc.info_json)
        self.grammar = GrammarTier(c.grammar_targets, desc, c.engine.compile_timeout_seconds,
                                   write_sparse_rows=runner.device.type != "cpu",
                                   step_timeout_seconds=c.grammar_step_timeout_seconds, tls=c.grammar_tls)
        for state in REPLICA_STATES:
            self.metrics.grammar_replicas.labels(state).set_function(
                lambda state=state: self.grammar.replica_counts()[state])
        self.engine = Engine(runner=runner, tokenizer=view, grammar=self.grammar, config=self.config.engine,
                             metrics=self.metrics, max_model_len=max_model_len, on_fatal=self.on_fatal,
                             device_thread=device_thread)
        self.served = ServedModel(info, self.engine.max_model_len, len(view.token_bytes))
        return self.served

    async def connect(self, timeout_seconds: float) -> None:
        """Waits until a grammar replica has the tokenizer (SystemExit past the timeout)."""
        c = self.config
        deadline = time.monotonic() + timeout_seconds
        while (n := await self.grammar.connect()) == 0:
            if time.monotonic() > deadline:
                raise SystemExit(f"no grammar replica reachable at {','.join(c.grammar_targets)}")
            log.info("waiting for the grammar tier at %s ...", ",".join(c.grammar_targets))
            await asyncio.sleep(1.0)
        log.info("grammar tier: %d of %d replica(s) have the tokenizer", n, len(self.grammar.targets))

    def start(self) -> None:
        self._maintain = asyncio.create_task(self.grammar.maintain(), name="grammar-tier-maintenance")
        self.engine.start()

    async def close(self, children: Sequence[subprocess.Popen] = ()) -> None:
        """After the drain: the engine, the tensor-parallel ranks (`children`: those this process started),
        the grammar tier's streams."""
        if self.engine is not None:
            await self.engine.close()
        if isinstance(self.runner, TensorParallelRunner):
            await asyncio.to_thread(self.runner.close)
        for child in children:
            try:
                await asyncio.to_thread(child.wait, 30)
            except subprocess.TimeoutExpired:
                child.kill()
        if self._maintain is not None:
            self._maintain.cancel()
        if self.grammar is not None:
            await self.grammar.close()
