"""The step loop: continuous batching with the grammar's masks computed while the forward runs.

One step, in order (the point of structd's design):

1. schedule: running requests and admissions, KV slots reserved;
2. send each constrained row's news to the grammar tier (tokens sampled last
   step, open on the first step, jump-forward wanted): one message per
   replica, written *before* the forward is launched;
3. forward on the executor thread; the event loop meanwhile reads the grammar
   answers (the replica advances its matchers and fills the next masks);
4. wait only for what has not arrived (`inference_svc_mask_wait_seconds`);
   masks were decoded straight into the preallocated bitmask rows;
5. apply the bitmask on the logits' device (xgrammar's kernel; unconstrained
   rows are skipped by index), sample per request, stream the deltas.

A jump-forward answer (forced tokens, already accepted by the grammar) makes
that row's logits stale: the row is not sampled, the forced tokens join the
request's uncomputed tail and are fed as one multi-token extend next step,
whose mask comes from an empty grammar step. Requests whose grammar is still
compiling are outside the scheduler entirely, so no step waits on a compile.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from inference_svc.config import EngineConfig
from inference_svc.grammar_tier import GrammarRow, GrammarTier
from inference_svc.masking import apply_masks
from inference_svc.metrics import InferenceMetrics
from inference_svc.model_runner import ModelRunner
from inference_svc.request import FinishReason, GenerationRequest, Output, Phase
from inference_svc.sampling import RowSampler, SamplingOptions, sample
from inference_svc.scheduler import ScheduledStep, Scheduler
from inference_svc.text_stream import TextStream
from shared import errors
from shared.codec import SparseMask, words_for_vocab
from shared.gen.grammar.v1 import grammar_service_pb2 as gpb

log = logging.getLogger(__name__)

# Times one request may move to another grammar replica before it fails.
MAX_REPLAYS = 3
# SessionResult.error_code is a google.rpc.Code: grpc.StatusCode's number.
_NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
_GRAMMAR_ERROR_CODES = {
    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]: errors.LimitExceededError,  # the replica's session limit
    grpc.StatusCode.INVALID_ARGUMENT.value[0]: errors.InvalidRequestError,
}


@dataclass(frozen=True)
class TokenizerView:
    """What the engine needs of the tokenizer: encoding, token bytes, special and stop ids."""

    encode: object  # str -> list[int]
    token_bytes: list[bytes]
    special_ids: frozenset[int]
    eos_ids: frozenset[int]


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: TokenizerView, grammar: GrammarTier | None,
                 config: EngineConfig, metrics: InferenceMetrics, max_model_len: int):
        self.runner = runner
        self.tok = tokenizer
        self.grammar = grammar
        self.config = config
        self.metrics = metrics
        self.max_model_len = min(config.max_model_len or max_model_len, max_model_len)
        self.scheduler = Scheduler(runner.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self._compiling: set[GenerationRequest] = set()
        self._cancelled: list[GenerationRequest] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._draining = False
        # One thread: the device does one thing at a time, and torch ops release the GIL,
        # so the event loop keeps serving gRPC and reading grammar answers meanwhile.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-device")
        words = words_for_vocab(runner.vocab_size)
        self._bitmask_host = torch.zeros((config.max_num_seqs, words), dtype=torch.int32)
        if runner.device.type == "cuda":
            self._bitmask_host = self._bitmask_host.pin_memory()
            self._bitmask_dev = torch.zeros_like(self._bitmask_host, device=runner.device)
        else:
            self._bitmask_dev = self._bitmask_host
        self._bitmask_np = self._bitmask_host.numpy()
        self._eos = torch.tensor(sorted(tokenizer.eos_ids), dtype=torch.long, device=runner.device)
        self.tok_vocab_size = len(tokenizer.token_bytes)

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-step-loop")

    @property
    def num_active(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting) + len(self._compiling)

    async def drain(self, grace_seconds: float) -> None:
        """Stops admitting; lets requests finish within the grace period; cancels the rest."""
        self._draining = True
        deadline = time.monotonic() + grace_seconds
        while self.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for req in list(self.scheduler.running) + list(self.scheduler.waiting) + list(self._compiling):
            self.cancel(req)
        while self.num_active and self._task is not None and not self._task.done():
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    # --- requests ------------------------------------------------------------

    def submit(self, prompt: str, options: SamplingOptions, spec: gpb.GrammarSpec | None = None,
               jump_forward: bool = True, request_id: str = "") -> GenerationRequest:
        """Validates and enqueues a request; its outputs arrive on `request.outputs`."""
        if self._draining:
            raise errors.UnavailableError("the inference service is draining; retry on another replica")
        if not prompt:
            raise errors.InvalidRequestError("prompt is empty")
        if spec is not None and self.grammar is None:
            raise errors.UnavailableError("constrained generation needs a grammar tier (--grammar-target)")
        if self.num_active - len(self.scheduler.running) >= self.config.max_waiting:
            raise errors.LimitExceededError(
                f"{self.config.max_waiting} requests are already waiting; retry later or on another replica")
        prompt_ids = list(self.tok.encode(prompt))
        if len(prompt_ids) + options.max_tokens > self.max_model_len:
            raise errors.InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + sampling.max_tokens ({options.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens")
        blocks = self.runner.block_manager
        if blocks.blocks_for(len(prompt_ids) + options.max_tokens) > blocks.num_blocks:
            raise errors.InvalidRequestError(
                f"prompt + sampling.max_tokens ({len(prompt_ids) + options.max_tokens} tokens) does not fit the KV "
                f"cache ({blocks.num_blocks * blocks.block_size} tokens)")
        req = GenerationRequest(
            request_id=request_id or uuid.uuid4().hex,
            prompt_ids=prompt_ids,
            options=options,
            sampler=RowSampler(options, self.runner.device),
            text=TextStream(self.tok.token_bytes, self.tok.special_ids, options.stop),
            spec=spec,
            jump_forward=jump_forward,
        )
        if spec is None:
            self.scheduler.add(req)
            self._wake.set()
        else:
            self._compiling.add(req)
            asyncio.create_task(self._compile(req), name=f"compile-{req.request_id}")
        return req

    def cancel(self, req: GenerationRequest) -> None:
        """The client went away (or the server drains): free its KV and grammar session at the next step."""
        if req.phase is Phase.FINISHED or req.cancelled:
            return
        req.cancelled = True
        self._cancelled.append(req)
        self._wake.set()

    async def _compile(self, req: GenerationRequest) -> None:
        try:
            replica, grammar_id = await self.grammar.compile(req.spec)
        except Exception as e:  # noqa: BLE001 - any compile failure fails this request alone
            self._compiling.discard(req)
            if not req.cancelled:
                self._finish(req, None, error=e)
            return
        self._compiling.discard(req)
        req.grammar_replica, req.grammar_id = replica, grammar_id
        req.session_id = self.grammar.new_session_id()
        if req.grammar_ready_at is None:
            req.grammar_ready_at = time.monotonic()
            self.metrics.grammar_wait.observe(req.grammar_ready_at - req.arrival)
        if req.cancelled:
            self._finish(req, FinishReason.CANCELLED)
            return
        self.scheduler.add(req)
        self._wake.set()

    # --- the loop ------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._reap_cancelled()
            self._update_gauges()
            if not self.scheduler.has_work():
                if self.grammar is not None and self.grammar.has_pending_closes():
                    await self.grammar.send([], self._bitmask_np).receive()
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            step = self.scheduler.schedule()
            if step.preempted:
                self.metrics.preemptions.inc(len(step.preempted))
            if not step.chunks:
                # Nothing fits right now (KV full): wait for a finish or cancel to free blocks.
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._step(step)
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                log.exception("engine step failed")
                for s in step.chunks:
                    if s.request.phase is not Phase.FINISHED:
                        self._finish(s.request, None, error=e)

    async def _step(self, step: ScheduledStep) -> None:
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        for s in step.chunks:
            req = s.request
            if req.admitted_at is None:
                req.admitted_at = now
                self.metrics.queue_time.observe(now - (req.grammar_ready_at or req.arrival))
                self.metrics.prompt_tokens.inc(req.num_prompt)
        sampled = step.sampled
        rows = [self._grammar_row(req, i) for i, req in enumerate(sampled) if req.constrained]
        pending = None
        if self.grammar is not None and (rows or self.grammar.has_pending_closes()):
            pending = self.grammar.send(rows, self._bitmask_np)

        started = time.perf_counter()
        try:
            logits = await loop.run_in_executor(self._executor, self.runner.forward, step.batch)
        except Exception:
            if pending is not None:
                # Its tasks write into the bitmask: let them finish before the next step reuses the rows.
                await asyncio.gather(pending.receive(), return_exceptions=True)
            raise
        forward_done = time.perf_counter()
        self.scheduler.commit(step)
        self.metrics.forward_duration.observe(forward_done - started)
        self.metrics.batch_size.observe(len(step.chunks))

        results = None
        if pending is not None:
            results = await pending.receive()
            if rows:
                self.metrics.mask_wait.observe(max(0.0, time.perf_counter() - forward_done))
                self.metrics.grammar_rpc_duration.observe(results.rpc_seconds)
            for replica in results.lost_replicas:
                self._replica_lost(replica, results)

        # Which rows get sampled, and with which mask.
        to_sample: list[int] = []
        masked: list[tuple[int, SparseMask | None]] = []
        ban_eos: list[int] = []
        forced: dict[int, list[int]] = {}
        by_row = {g.row: (r, f) for g, r, f in zip(rows, results.results, results.sparse)} if rows else {}
        for i, req in enumerate(sampled):
            if req.phase is not Phase.RUNNING:  # finished, or moved to another grammar replica
                continue
            if req.constrained:
                result, form = by_row[i]
                if not self._take_grammar_result(req, result):
                    continue
                if result.jump_forward.forced_token_ids:
                    forced[i] = list(result.jump_forward.forced_token_ids)
                    continue
                masked.append((i, form))
            elif req.options.ignore_eos:
                ban_eos.append(i)
            to_sample.append(i)

        tokens: list[int] = []
        if to_sample:
            samplers = [sampled[i].sampler for i in to_sample]
            tokens = await loop.run_in_executor(
                self._executor, self._mask_and_sample, logits, masked, ban_eos, to_sample, samplers)
        appended = {True: 0, False: 0}
        for i, token in zip(to_sample, tokens):
            appended[sampled[i].constrained] += self._append(sampled[i], [token], sampled_token=True)
        for i, ids in forced.items():
            appended[sampled[i].constrained] += self._append(sampled[i], ids, sampled_token=False)
        for constrained, n in appended.items():
            if n:
                self.metrics.by_kind[constrained].generation_tokens.inc(n)

    def _grammar_row(self, req: GenerationRequest, row: int) -> GrammarRow:
        s = gpb.SessionStep(session_id=req.session_id, accept_token_ids=req.pending_accept,
                            jump_forward=req.jump_forward and bool(req.pending_accept))
        if not req.session_open:
            s.open.grammar_id = req.grammar_id
            req.session_open = True
        req.pending_accept = []
        return GrammarRow(req.grammar_replica, s, row)

    def _take_grammar_result(self, req: GenerationRequest, result) -> bool:
        """True when the row may be used (OK); otherwise finishes the request."""
        if isinstance(result, BaseException):
            self._finish(req, None, error=result)
            return False
        status = result.status
        if status == gpb.SESSION_STATUS_OK:
            return True
        if status == gpb.SESSION_STATUS_TERMINATED:
            self._finish(req, FinishReason.STOP)
        elif status == gpb.SESSION_STATUS_REJECTED:
            self._finish(req, None, error=errors.GrammarDesyncError(
                f"the grammar rejected token {req.all_ids[-1]} that was sampled under its mask"))
        else:
            req.session_open = False  # an ERROR leaves no session behind on the replica
            if result.error_code == _NOT_FOUND:
                # The replica forgot the session or its grammar (restart, idle expiry, eviction): replay.
                self._replay(req, errors.UnavailableError(f"grammar session: {result.error_message}"))
            else:
                cls = _GRAMMAR_ERROR_CODES.get(result.error_code, errors.UnavailableError)
                self._finish(req, None, error=cls(f"grammar session: {result.error_message}"))
        return False

    @torch.inference_mode()  # the logits are inference tensors: in-place masking needs the same mode
    def _mask_and_sample(self, logits: torch.Tensor, masked: list[tuple[int, SparseMask | None]],
                         ban_eos: list[int], rows: list[int], samplers: list[RowSampler]) -> list[int]:
        restrict = {}
        if masked:
            restrict = apply_masks(logits, masked, self._bitmask_host, self._bitmask_dev, self.tok_vocab_size)
        if ban_eos:
            idx = torch.tensor(ban_eos, device=logits.device)
            logits[idx.unsqueeze(1), self._eos.unsqueeze(0)] = float("-inf")
        return sample(logits, samplers, rows, [restrict.get(i) for i in rows] if restrict else None)

    # --- outputs -------------------------------------------------------------

    def _append(self, req: GenerationRequest, ids: list[int], *, sampled_token: bool) -> int:
        """Appends a step's tokens to a request and streams them; returns how many were appended."""
        room = req.options.max_tokens - req.num_output
        ids = ids[:room]
        req.all_ids.extend(ids)
        if req.constrained and sampled_token:
            req.pending_accept.extend(ids)
        if not sampled_token:
            req.forced_tokens += len(ids)
            self.metrics.forced_tokens.inc(len(ids))
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
            self.metrics.by_kind[req.constrained].ttft.observe(req.first_token_at - req.arrival)
        finish = None
        if sampled_token and ids[-1] in self.tok.eos_ids and not (req.options.ignore_eos and not req.constrained):
            finish = FinishReason.STOP
        delta = req.text.push(ids)
        if delta.stopped:
            finish = FinishReason.STOP_STRING
        elif finish is None and req.num_output >= req.options.max_tokens:
            finish = FinishReason.LENGTH
        if finish is None:
            req.outputs.put_nowait(Output(ids, delta.text))
        else:
            self._finish(req, finish, token_ids=ids, text=delta.text)
        return len(ids)

    def _finish(self, req: GenerationRequest, reason: FinishReason | None, *, token_ids: list[int] | None = None,
                text: str = "", error: BaseException | None = None) -> None:
        if req.phase is Phase.FINISHED:
            return
        if req.phase in (Phase.WAITING, Phase.RUNNING):
            self.scheduler.remove(req)
        req.phase = Phase.FINISHED
        if req.grammar_replica >= 0:
            self.grammar.release(req.grammar_replica, req.session_id if req.session_open else None)
        if error is None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            text += req.text.finish()
        kind = self.metrics.by_kind[req.constrained]
        kind.requests[(reason or FinishReason.ERROR).value].inc()
        now = time.monotonic()
        kind.e2e.observe(now - req.arrival)
        if req.first_token_at is not None and req.num_output > 1:
            kind.tpot.observe((now - req.first_token_at) / (req.num_output - 1))
        req.outputs.put_nowait(Output(token_ids or [], text, reason, req.usage(), error))

    def _replica_lost(self, replica: int, results) -> None:
        """Every request pinned to a replica whose stream broke moves to another one (replay)."""
        error = next((r for r in results.results if isinstance(r, BaseException)), None)
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            if req.constrained and req.grammar_replica == replica:
                req.session_open = False
                self._replay(req, error or errors.UnavailableError("grammar replica lost"))

    def _replay(self, req: GenerationRequest, cause: BaseException) -> None:
        """Rebuilds a lost grammar session elsewhere: a matcher is a pure function of (grammar, tokens).

        The request leaves the batch (its KV blocks are freed and recomputed on
        readmission), compiles its grammar on a live replica (the same grammar
        id everywhere; usually a cache hit) and reopens its session with every
        output token as accept_token_ids. Fails with `cause` after MAX_REPLAYS.
        """
        if req.replays >= MAX_REPLAYS:
            self._finish(req, None, error=cause)
            return
        log.warning("request %s: grammar session lost (%s); replaying %d tokens on another replica",
                    req.request_id, cause, req.num_output)
        req.replays += 1
        self.metrics.grammar_replays.inc()
        self.grammar.release(req.grammar_replica, None)
        req.grammar_replica = -1
        req.session_open = False
        req.pending_accept = list(req.output_ids)
        self.scheduler.remove(req)
        req.num_computed = 0
        req.phase = Phase.COMPILING
        self._compiling.add(req)
        asyncio.create_task(self._compile(req), name=f"replay-{req.request_id}")

    def _reap_cancelled(self) -> None:
        cancelled, self._cancelled = self._cancelled, []
        for req in cancelled:
            if req.phase in (Phase.WAITING, Phase.RUNNING):
                self._finish(req, FinishReason.CANCELLED)
            # COMPILING: _compile finishes it when the compile returns.

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting) + len(self._compiling))
        self.metrics.kv_usage.set(self.runner.block_manager.usage_ratio)

