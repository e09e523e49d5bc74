"""The step loop: continuous batching with the grammar's masks computed while the forward runs.

One step, in order (the point of structd's design):

1. schedule: running requests and admissions, KV slots reserved;
2. send each constrained row's news to the grammar tier (tokens sampled last
   step, open on the first step, jump-forward wanted): one message per
   replica, written *before* the forward is launched;
3. forward on the executor thread; the event loop meanwhile reads the grammar
   answers (the replica advances its matchers and fills the next masks);
4. collect: wait only for what has not arrived (`inference_svc_mask_wait_seconds`),
   at most the grammar step deadline; masks were decoded straight into the
   preallocated bitmask rows;
5. sample (`step_sampler.py`): penalties, then masks applied as `masking.py`
   decides (xgrammar's kernel on a GPU, id lists on the CPU), bans, one token
   per request (with logprobs where asked); on the device thread, except on
   the CPU, where it runs on the event loop (see `_sample`);
6. emit: append, stream the deltas, finish what is done.

The deltas of step t reach the clients' streams only once step t+1 has sent
its grammar message and launched its forward (`_flush_outputs`): waking 32
Generate handlers queues 32 callbacks on the event loop, and queued ahead of
the grammar write's task they delayed it late into the forward
(docs/benchmarks.md, "Host path at simulated steps", item 1). A delta waits for
one schedule() and one send() more, well under a millisecond.

With `--sparse-head on` and a runner that splits (the paged model), a step
with constrained rows runs the model body alone in 3; if the grammar has
answered by then, the step is planned first and, when every row to sample
has a short allowed-id list, the LM head is computed at those ids only
(sparse_head.py); when at most half of them need every logit and the head's
rows are independent (the oneDNN head), those rows get the full head and the
rest their ids (the partial head); otherwise the full head runs at once.
Greedy rows without logprobs need only their argmax: with `--greedy-head on`
they get the float32 head at the ids a bfloat16 screen keeps (greedy_head.py),
and a step of such rows splits even with no constrained row.

A jump-forward answer (forced tokens, already accepted by the grammar) makes
that row's logits stale: the row is not sampled, the forced tokens join the
request's uncomputed tail and are fed as one multi-token extend next step,
whose mask comes from an empty grammar step. Requests whose grammar is still
compiling are outside the scheduler entirely, so no step waits on a compile.

Failure is local: whatever goes wrong for one request (its scheduling, its
grammar session, its sampling or text) fails that request alone; a failed
forward fails that step's requests; the loop goes on. Should the loop itself
end, every request in flight fails with UNAVAILABLE and `on_fatal` tells the
server, which turns NOT_SERVING and exits non-zero so it is replaced.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from inference_svc.config import EngineConfig
from inference_svc.grammar.grammar_link import NO_REPLICA, GrammarLink
from inference_svc.grammar.grammar_tier import GrammarRow, GrammarTier, PendingStep, RowOutcome, RowResult
from inference_svc.metrics import InferenceMetrics
from inference_svc.model.model_runner import ModelRunner
from inference_svc.engine.request import FinishReason, GenerationRequest, Output, Phase, Thinking
from inference_svc.engine.response_text import Piece, ResponseText
from inference_svc.engine.sampling import RowLogprobs, RowSampler, SamplingOptions, TokenLogprob, TopLogprob
from inference_svc.engine.schema_check import FinalChecks, wants_check
from inference_svc.engine.scheduler import ScheduledStep, Scheduler
from inference_svc.model.head.sparse_head import disallowed_ids, head_plan
from inference_svc.engine.step_sampler import Drawn, RowPlan, StepSampler
from inference_svc.types import Constraint, ToolCallReader
from shared import errors
from shared.codec import words_for_vocab

log = logging.getLogger(__name__)

# Times one request may move to another grammar replica before it fails.
MAX_REPLAYS = 3
# Loop iterations in a row that fail in a way no request can be blamed for before the engine gives up.
MAX_CONSECUTIVE_LOOP_FAILURES = 3
# What every request in flight, and every new one, hears once the engine is gone.
ENGINE_STOPPED = "the inference engine stopped; retry on another replica"


@dataclass(frozen=True)
class TokenizerView:
    """What the engine needs of the tokenizer: encoding, token bytes, special, stop and think ids."""

    encode: object  # (str, add_special_tokens: bool) -> list[int]
    token_bytes: list[bytes]
    special_ids: frozenset[int]
    eos_ids: frozenset[int]
    # The model family's think-start and end-of-thinking tokens (None: the model does not think).
    think_start_id: int | None = None
    think_end_id: int | None = None


@dataclass(frozen=True)
class Prompt:
    """A request's input: text to tokenize, or token ids fed as they are."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    # Rendered by a chat template: it spells out its own special tokens (BOS), so none are added.
    templated: bool = False


class Engine:
    def __init__(self, *, runner: ModelRunner, tokenizer: TokenizerView, grammar: GrammarTier | None,
                 config: EngineConfig, metrics: InferenceMetrics, max_model_len: int,
                 on_fatal: Callable[[BaseException | None], None] | None = None,
                 device_thread: ThreadPoolExecutor | None = None):
        """device_thread: the one-thread executor the runner was loaded on (the engine owns it from here)."""
        self.runner = runner
        self.tok = tokenizer
        self.grammar = grammar
        # The assembly sizes the batch for the device; an engine built without it (tests) gets a CPU's sizes.
        config = config.sized_for("cpu")
        self.config = config
        self.metrics = metrics
        self.on_fatal = on_fatal
        self.max_model_len = min(config.max_model_len or max_model_len, max_model_len)
        self.scheduler = Scheduler(runner.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self._compiling: set[GenerationRequest] = set()
        self._cancelled: list[GenerationRequest] = []
        # Outputs the step loop produced, handed to the clients' streams at its next wait (_flush_outputs).
        self._outbox: list[tuple[GenerationRequest, Output]] = []
        self._tokenizing = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._draining = False
        self._closing = False
        self.dead = False
        # One thread: the device does one thing at a time, and torch ops release the GIL,
        # so the event loop keeps serving gRPC and reading grammar answers meanwhile. The one the model was
        # loaded and its graphs warmed on, where there was one (CUDA graph trees are per thread).
        self._executor = device_thread or ThreadPoolExecutor(1, thread_name_prefix="engine-device")
        words = words_for_vocab(runner.vocab_size)
        self._bitmask_host = torch.zeros((config.max_num_seqs, words), dtype=torch.int32)
        if runner.device.type == "cuda":
            self._bitmask_host = self._bitmask_host.pin_memory()
            self._bitmask_dev = torch.zeros_like(self._bitmask_host, device=runner.device)
        else:
            self._bitmask_dev = self._bitmask_host
        self._bitmask_np = self._bitmask_host.numpy()
        # Ids at or past this are padding of a model whose LM head is wider than its tokenizer: never sampled.
        self.tok_vocab_size = len(tokenizer.token_bytes)
        # Ids a request may name (prompt, logit_bias, stop_token_ids): a token of the tokenizer that the model can
        # embed and score. Past the embedding an id is an index error on the CPU and a device-side assert on a GPU,
        # which poisons the whole CUDA context: refused per request instead.
        self.token_id_limit = min(self.tok_vocab_size, runner.vocab_size, runner.embedding_rows)
        # Finished json_schema outputs wait here for their schema check, never in the step loop.
        self._checks = FinalChecks(grammar, metrics, config.schema_check_timeout_seconds) if grammar else None
        self._sampler = StepSampler(self.tok_vocab_size, tokenizer.eos_ids, self._bitmask_host, self._bitmask_dev)
        # The body and the LM head as two calls, so a step's head can be computed at its allowed ids only
        # (sparse_head.py); runners that cannot split (simulated, tensor-parallel) keep the one forward.
        self._split_head = config.sparse_head and getattr(runner, "splits_head", False)
        # ... and some rows in full, the rest at their ids, where the head's rows are independent (lm_head.py).
        self._partial_head = self._split_head and getattr(runner, "partial_head", False)
        # ... and greedy rows at the ids a bfloat16 screen keeps (greedy_head.py), unless --greedy-head off.
        self._greedy_head = (self._partial_head and config.greedy_head and getattr(runner, "greedy_screen", False))
        self._eos_ids = np.array(sorted(tokenizer.eos_ids), dtype=np.int64)

    # --- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-step-loop")
        self._task.add_done_callback(self._loop_ended)

    @property
    def num_active(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting) + len(self._compiling)

    def _in_flight(self) -> list[GenerationRequest]:
        return list(self.scheduler.running) + list(self.scheduler.waiting) + list(self._compiling)

    async def drain(self, grace_seconds: float) -> None:
        """Stops admitting; lets requests finish within the grace period; cancels the rest."""
        self._draining = True
        deadline = time.monotonic() + grace_seconds
        while self.num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for req in self._in_flight():
            self.cancel(req)
        while self.num_active and self._task is not None and not self._task.done():
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            except Exception:  # noqa: BLE001 - the loop's own death, already reported by _loop_ended
                pass
        self._flush_outputs()  # what the loop held when it was stopped still reaches its streams
        if self._checks is not None:
            await self._checks.close()
        self._executor.shutdown(wait=True)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The step loop is gone (a bug, not a request's fault): nothing in flight can finish here any more."""
        if self._closing:
            return
        cause = None if task.cancelled() else task.exception()
        log.critical("the engine's step loop ended; failing every request in flight", exc_info=cause)
        self.dead = True
        self._flush_outputs()
        error = errors.UnavailableError(ENGINE_STOPPED)
        for req in self._in_flight():
            self._fail(req, error)
        if self.on_fatal is not None:
            self.on_fatal(cause)

    # --- requests ------------------------------------------------------------

    async def submit(self, prompt: Prompt | str, options: SamplingOptions, *, constraint: Constraint | None = None,
                     jump_forward: bool = True, request_id: str = "", reasoning: bool | None = None,
                     max_thinking_tokens: int = 0, tool_parser: ToolCallReader | None = None,
                     end_client: str = "") -> GenerationRequest:
        """Validates and enqueues a request; its outputs arrive on `request.outputs`.

        A text prompt is measured in bytes before it is tokenized, and tokenized
        on a worker thread: a huge prompt costs its own request time, not
        everyone's step. A prompt that ends with the think-start token starts
        in thinking (`reasoning=True` insists on it); `tool_parser` cuts tool
        calls out of the answer text; `end_client` is who the grammar tier
        counts the request's compile against, within the caller's share.
        """
        self._check_accepting()
        if isinstance(prompt, str):
            prompt = Prompt(prompt)
        if constraint is not None and self.grammar is None:
            raise errors.UnavailableError("constrained generation needs a grammar tier (--grammar-target)")
        if max_thinking_tokens < 0:
            raise errors.InvalidRequestError(f"max_thinking_tokens must be >= 0 (0 = no budget), got {max_thinking_tokens}")
        if self.num_active + self._tokenizing - len(self.scheduler.running) + options.n > self.config.max_waiting:
            raise errors.LimitExceededError(
                f"{self.config.max_waiting} requests are already waiting; retry later or on another replica")
        options.check_token_ids(self.token_id_limit)
        prompt_ids = await self._prompt_ids(prompt)
        self._check_accepting()  # again: it may have started draining while the prompt was tokenized
        if len(prompt_ids) + options.max_tokens > self.max_model_len:
            raise errors.InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + sampling.max_tokens ({options.max_tokens}) exceeds the "
                f"model's context of {self.max_model_len} tokens")
        blocks = self.runner.block_manager
        if blocks.blocks_for(len(prompt_ids) + options.max_tokens) > blocks.num_blocks:
            raise errors.InvalidRequestError(
                f"prompt + sampling.max_tokens ({len(prompt_ids) + options.max_tokens} tokens) does not fit the KV "
                f"cache ({blocks.num_blocks * blocks.block_size} tokens)")
        thinking = self._thinking_for(prompt_ids, reasoning, max_thinking_tokens)
        request_id = request_id or uuid.uuid4().hex
        group = [self._request(i, prompt_ids, options, request_id, thinking, tool_parser,
                               GrammarLink(constraint, jump_forward, end_client=end_client) if constraint else None)
                 for i in range(options.n)]
        req = group[0]
        req.siblings, req.open_completions = group[1:], len(group)
        for i, sibling in enumerate(req.siblings, 1):
            sibling.index, sibling.leader = i, req
        if constraint is None:
            for completion in group:
                self.scheduler.add(completion)
            self._wake.set()
        else:
            # The others compile once the first has: the grammar tier's cache answers them, one compile in all.
            self._start_compile(req)
        return req

    def _request(self, index: int, prompt_ids: list[int], options: SamplingOptions, request_id: str,
                 thinking: Thinking | None, tool_parser: ToolCallReader | None,
                 grammar: GrammarLink | None) -> GenerationRequest:
        """Completion `index` of a request; each has its own sampler (its own seed), text, thinking state,
        tool-call parser and grammar session."""
        options = options.for_completion(index)
        return GenerationRequest(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            options=options,
            sampler=RowSampler(options, self.runner.device),
            text=ResponseText(self.tok.token_bytes, self.tok.special_ids, options.stop,
                              include_stop=options.include_stop_str_in_output,
                              think_end_id=thinking.end_id if thinking is not None else None,
                              tool_parser=copy.deepcopy(tool_parser) if index else tool_parser),
            grammar=grammar,
            thinking=dataclasses.replace(thinking) if thinking is not None else None,
        )

    async def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if prompt.token_ids:
            if prompt.text:
                raise errors.InvalidRequestError("give prompt text or prompt token ids, not both")
            bad = [t for t in prompt.token_ids if not 0 <= t < self.token_id_limit]
            if bad:
                raise errors.InvalidRequestError(
                    f"prompt_token_ids: {bad[0]} is not a token id of this model (0 to {self.token_id_limit - 1})"
                    + (f", and {len(bad) - 1} more" if len(bad) > 1 else ""))
            return list(prompt.token_ids)
        if not prompt.text:
            raise errors.InvalidRequestError("the prompt is empty: give prompt, messages or prompt_token_ids")
        prompt_bytes = len(prompt.text.encode("utf-8", "surrogatepass"))
        if prompt_bytes > self.config.max_prompt_bytes:
            raise errors.InvalidRequestError(
                f"prompt is {prompt_bytes} bytes; this server accepts at most {self.config.max_prompt_bytes} "
                "(--max-prompt-bytes)")
        self._tokenizing += 1
        try:
            ids = list(await asyncio.to_thread(self.tok.encode, prompt.text, not prompt.templated))
        finally:
            self._tokenizing -= 1
        if ids and max(ids) >= self.token_id_limit:
            # The tokenizer has tokens the model has no embedding for (a mismatched checkpoint): this text uses one.
            raise errors.InvalidRequestError(
                f"the prompt tokenizes to id {max(ids)}, which this model has no embedding for (its ids are 0 to "
                f"{self.token_id_limit - 1}): the served tokenizer is larger than the model; avoid that token")
        return ids

    def _thinking_for(self, prompt_ids: list[int], reasoning: bool | None, budget: int) -> Thinking | None:
        """A request thinks when its prompt opened a think block (the template did, or the client)."""
        start, end = self.tok.think_start_id, self.tok.think_end_id
        opened = start is not None and end is not None and bool(prompt_ids) and prompt_ids[-1] == start
        if not opened:
            if reasoning:
                raise errors.InvalidRequestError(
                    "reasoning is on but the prompt does not open a think block: this model's chat template "
                    "(or the raw prompt) must end with its think-start token"
                    + ("" if start is not None else "; this server knows no thinking format for its model "
                       "(--model-family)"))
            return None
        return Thinking(end_id=end, budget=budget)

    def _check_accepting(self) -> None:
        if self.dead:
            raise errors.UnavailableError(ENGINE_STOPPED)
        if self._draining:
            raise errors.UnavailableError("the inference service is draining; retry on another replica")

    def cancel(self, req: GenerationRequest) -> None:
        """The client went away (or the server drains): free its KV and grammar session at the next step,
        every completion's when it asked for n."""
        for completion in req.group:
            if completion.phase is Phase.FINISHED or completion.cancelled:
                continue
            completion.cancelled = True
            self._cancelled.append(completion)
        self._wake.set()

    def _start_compile(self, req: GenerationRequest) -> None:
        req.phase = Phase.COMPILING
        self._compiling.add(req)
        asyncio.create_task(self._compile(req), name=f"compile-{req.seq_id}")

    async def _compile(self, req: GenerationRequest) -> None:
        first = req.grammar_ready_at is None
        try:
            await self.grammar.compile(req.grammar)
        except Exception as e:  # noqa: BLE001 - the request's: its constraint, or no replica left for it
            self._compiling.discard(req)
            self._finish(req, FinishReason.CANCELLED if req.cancelled else None, error=None if req.cancelled else e)
            if first:
                self._end_unstarted(req.siblings)
            return
        self._compiling.discard(req)
        if req.phase is Phase.FINISHED:
            # Failed (or the engine stopped) while it compiled: it must never run again.
            self.grammar.release(req.grammar)
            if first:
                self._end_unstarted(req.siblings)
            return
        if first:
            req.grammar_ready_at = time.monotonic()
            self.metrics.grammar_wait.observe(req.grammar_ready_at - req.arrival)
            for sibling in req.siblings:  # n > 1: compiled now, so the grammar tier's cache answers them
                if sibling.cancelled:
                    self._finish(sibling, FinishReason.CANCELLED)
                else:
                    self._start_compile(sibling)
        if req.cancelled:
            self._finish(req, FinishReason.CANCELLED)
            return
        self.scheduler.add(req)
        self._wake.set()

    def _end_unstarted(self, siblings: list[GenerationRequest]) -> None:
        """The other completions of a request whose first could not compile: they never started, and the
        stream has ended with the first's error (or its cancellation)."""
        for sibling in siblings:
            self._finish(sibling, FinishReason.CANCELLED)

    # --- the loop ------------------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                await self._iterate()
                failures = 0
            except Exception as e:  # noqa: BLE001 - nobody's in particular: everyone scheduled fails, the loop goes on
                self._flush_outputs()
                failures += 1
                log.exception("engine loop iteration failed (%d in a row)", failures)
                if failures >= MAX_CONSECUTIVE_LOOP_FAILURES:
                    raise
                for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._fail(req, e)

    async def _iterate(self) -> None:
        self._reap_cancelled()
        self._update_gauges()
        if not self.scheduler.has_work():
            self._flush_outputs()
            if self.grammar is not None and self.grammar.has_pending_closes():
                await self._receive(self.grammar.send([], self._bitmask_np))
                return
            self._wake.clear()
            await self._wake.wait()
            return
        started = time.perf_counter()
        step = self.scheduler.schedule()
        self.metrics.host_phase["schedule"].observe(time.perf_counter() - started)
        for req, e in step.failed:
            log.error("request %s (seq %d) could not be scheduled", req.request_id, req.seq_id, exc_info=e)
            self._fail(req, e)
        if step.preempted:
            self.metrics.preemptions.inc(len(step.preempted))
        if step.prefix_queried_tokens:
            self.metrics.prefix_cache_queries.inc(step.prefix_queried_tokens)
            self.metrics.prefix_cache_hits.inc(step.prefix_hit_tokens)
        if not step.chunks:
            # Nothing fits right now (KV full): wait for a finish or cancel to free blocks.
            self._flush_outputs()
            self._wake.clear()
            await self._wake.wait()
            return
        try:
            await self._step(step)
        except Exception as e:  # noqa: BLE001 - a failed step (e.g. the forward) fails its requests, not the server
            log.exception("engine step failed")
            self.metrics.step_failures.inc()
            for s in step.chunks:
                self._finish(s.request, None, error=e)
            self._flush_outputs()

    async def _step(self, step: ScheduledStep) -> None:
        self._note_admissions(step)
        sampled = step.sampled
        rows = [GrammarRow(req.grammar, i) for i, req in enumerate(sampled) if req.grammar_active]
        pending = None
        if self.grammar is not None and (rows or self.grammar.has_pending_closes()):
            started = time.perf_counter()
            pending = self.grammar.send(rows, self._bitmask_np)
            self.metrics.host_phase["grammar_send"].observe(time.perf_counter() - started)
        split = self._split_head and (bool(rows) or any(self._screenable(req) for req in sampled))
        logits, forward_done = await self._forward(step, pending, body_only=split)
        plan = None
        if split:
            # `logits` holds the body's hidden states: the head waits for nothing, so unless the grammar has
            # answered already it runs in full now (the answers keep arriving meanwhile, as they did).
            hidden, path, head = logits, "full_late", self.runner.head
            if pending is None or pending.answered:
                plan = self._timed_plan(sampled, await self._answers(pending, rows, forward_done) if pending else {})
                chosen = head_plan(plan.sample, plan.masked, self.tok_vocab_size, partial=self._partial_head,
                                   greedy=self._greedy_rows(sampled, plan))
                if chosen is None:
                    path = "full_needed"
                else:
                    path = "partial" if chosen.full_rows.size else "screened" if chosen.screened else "sparse"
                    head = functools.partial(self.runner.sparse_head, ids=chosen.ids, full_rows=chosen.full_rows,
                                             screened=chosen.screened, vocab_limit=chosen.vocab_limit)
            try:
                logits = await asyncio.get_running_loop().run_in_executor(self._executor, head, hidden)
            except Exception:
                if plan is None:
                    # As in _forward: the answers' tasks write into the bitmask rows the next step reuses.
                    await asyncio.gather(self._receive(pending), return_exceptions=True)
                raise
            if plan is None:
                forward_done = time.perf_counter()  # the mask wait starts when the logits are there
            self.metrics.lm_head_steps.labels(path).inc()
        else:
            self.metrics.lm_head_steps.labels("full").inc()
        if plan is None:
            plan = self._timed_plan(sampled, await self._answers(pending, rows, forward_done) if pending else {})
        started = time.perf_counter()
        tokens = await self._sample(logits, plan, sampled)
        emitting = time.perf_counter()
        self._emit(sampled, plan, tokens)
        phases = self.metrics.host_phase
        phases["sample"].observe(emitting - started)
        phases["emit"].observe(time.perf_counter() - emitting)

    def _screenable(self, req: GenerationRequest) -> bool:
        """A row whose draw is the argmax of its logits and nothing else (no logprobs, bias, penalties or EOS
        ban for min_tokens): the greedy screen may find it (greedy_head.py)."""
        return (self._greedy_head and req.sampler.argmax_only and not req.options.wants_logprobs
                and not req.sampler.adjusts and req.num_output >= req.options.min_tokens)

    def _greedy_rows(self, sampled: list[GenerationRequest], plan: RowPlan) -> dict[int, np.ndarray | None]:
        """The plan's screenable rows -> the ids each may not take besides its disallowed-id list: a banned
        EOS, and for a row whose mask came dense every id it disallows (read from its bitmask row)."""
        if not self._greedy_head:
            return {}
        banned = set(plan.ban_eos)
        dense = {i for i, form in plan.masked if form is None}
        out = {}
        for i in plan.sample:
            if not self._screenable(sampled[i]):
                continue
            extra = self._eos_ids if i in banned else None
            if i in dense:
                masked_out = disallowed_ids(self._bitmask_np[i], self.tok_vocab_size)
                extra = masked_out if extra is None else np.union1d(masked_out, extra)
            out[i] = extra
        return out

    def _timed_plan(self, sampled: list[GenerationRequest], results: dict[int, RowResult]) -> RowPlan:
        started = time.perf_counter()
        plan = self._plan(sampled, results)
        self.metrics.host_phase["plan"].observe(time.perf_counter() - started)
        return plan

    async def _answers(self, pending: PendingStep, rows: list[GrammarRow], forward_done: float) -> dict[int, RowResult]:
        """The grammar's answer per bitmask row, waiting at most the step deadline (see _receive)."""
        answered = await self._receive(pending)
        if rows:
            self.metrics.mask_wait.observe(max(0.0, time.perf_counter() - forward_done))
            self.metrics.grammar_rpc_duration.observe(answered.rpc_seconds)
        return {g.row: r for g, r in zip(rows, answered.rows)}

    def _note_admissions(self, step: ScheduledStep) -> None:
        now = time.monotonic()
        for s in step.chunks:
            req = s.request
            if req.admitted_at is None:
                req.admitted_at = now
                self.metrics.queue_time.observe(now - (req.grammar_ready_at or req.arrival))
                if req.leader is None:  # n completions share one prompt
                    self.metrics.prompt_tokens.inc(req.num_prompt)

    async def _forward(self, step: ScheduledStep, pending: PendingStep | None,
                       body_only: bool = False) -> tuple[torch.Tensor, float]:
        """The step's logits (body_only: the hidden states the LM head turns into them) and when they were done."""
        started = time.perf_counter()
        run = self.runner.forward_body if body_only else self.runner.forward
        try:
            running = asyncio.get_running_loop().run_in_executor(self._executor, run, step.batch)
            # The grammar message is on its way and the forward running: now the last step's deltas go out.
            self._flush_outputs()
            logits = await running
        except Exception:
            if pending is not None:
                # Its tasks write into the bitmask: let them finish before the next step reuses the rows.
                await asyncio.gather(self._receive(pending), return_exceptions=True)
            raise
        forward_done = time.perf_counter()
        self.scheduler.commit(step)
        self.metrics.forward_duration.observe(forward_done - started)
        self.metrics.batch_size.observe(len(step.chunks))
        return logits, forward_done

    async def _receive(self, pending: PendingStep):
        """The grammar's answers, at most the step deadline after now; requests of lost replicas move on."""
        answered = await pending.receive(self.grammar.step_timeout_seconds)
        for replica, reason in answered.lost_replicas.items():
            self.metrics.grammar_replica_losses.labels(reason).inc()
            self._replica_lost(replica)
        return answered

    def _plan(self, sampled: list[GenerationRequest], results: dict[int, RowResult]) -> RowPlan:
        """Which rows get sampled, and with which mask; requests the grammar finished or moved leave here."""
        plan = RowPlan()
        for i, req in enumerate(sampled):
            if req.phase is not Phase.RUNNING:  # finished, or moved to another grammar replica
                continue
            if req.thinking is not None and req.thinking.budget_spent:
                # Out of thinking budget: the end-of-thinking token is appended instead of sampled.
                plan.forced[i] = [req.thinking.end_id]
                continue
            if req.grammar_active:
                result = results[i]
                if not self._take_grammar_result(req, result):
                    continue
                if result.forced_token_ids:
                    plan.forced[i] = list(result.forced_token_ids)
                    continue
                plan.masked.append((i, result.sparse))
            elif req.options.ignore_eos:
                plan.ban_eos.append(i)
            plan.sample.append(i)
        return plan

    async def _sample(self, logits: torch.Tensor, plan: RowPlan,
                      sampled: list[GenerationRequest]) -> list[Drawn | Exception]:
        if not plan.sample:
            return []
        for i in plan.sample:
            req = sampled[i]
            if req.sampler.adjusts:
                self._plan_adjustments(plan, i, req)
            if req.num_output < req.options.min_tokens:
                plan.before_min_tokens.append(i)
                if req.options.stop_token_ids:
                    plan.min_tokens_bans[i] = np.union1d(self._eos_ids, sorted(req.options.stop_token_ids))
        samplers = [sampled[i].sampler for i in plan.sample]
        if logits.device.type == "cpu":
            # Drawn right here: on the CPU a step's draw is a short run of numpy and torch calls that hold the
            # GIL between them; on the device thread it competed with the Generate handlers the
            # forward's launch had just woken, and took far longer (docs/benchmarks.md, "Host path at
            # simulated steps", "Then: the draw on the event loop").
            return self._sampler.sample(logits, plan, samplers)
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._sampler.sample, logits, plan, samplers)

    @staticmethod
    def _plan_adjustments(plan: RowPlan, i: int, req: GenerationRequest) -> None:
        """Row i's logit bias and penalties, from its request's tokens so far."""
        s, o = req.sampler, req.options
        if s.bias is not None:
            plan.bias.append((i, *s.bias))
        if s.seen is not None:
            plan.penalties.append((i, s.seen.update(req.all_ids), o.repetition_penalty))
        if s.counts is not None:
            plan.occurrences.append((i, *s.counts.update(req.all_ids, req.num_prompt), o.presence_penalty,
                                     o.frequency_penalty))

    def _emit(self, sampled: list[GenerationRequest], plan: RowPlan, tokens: list[Drawn | Exception]) -> None:
        appended = {True: 0, False: 0}
        for i, drawn in zip(plan.sample, tokens):
            req = sampled[i]
            if isinstance(drawn, Exception):
                self._fail(req, drawn)
            else:
                token, logprobs = drawn
                appended[req.constrained] += self._append_guarded(req, [token], sampled_token=True,
                                                                  logprobs=logprobs)
        for i, ids in plan.forced.items():
            appended[sampled[i].constrained] += self._append_guarded(sampled[i], ids, sampled_token=False)
        for constrained, n in appended.items():
            if n:
                self.metrics.by_kind[constrained].generation_tokens.inc(n)

    def _take_grammar_result(self, req: GenerationRequest, result: RowResult) -> bool:
        """True when the row may be used; otherwise the request finishes or moves to another replica."""
        outcome = result.outcome
        if outcome is RowOutcome.OK:
            return True
        if outcome is RowOutcome.TERMINATED:
            self._finish(req, FinishReason.STOP)
        elif outcome is RowOutcome.REJECTED:
            self._finish(req, None, error=errors.GrammarDesyncError(
                f"the grammar rejected token {req.all_ids[-1]} that was sampled under its mask"))
        elif outcome is RowOutcome.LOST:
            self._replay(req, result.error)
        else:
            req.grammar.open = False  # a failed step leaves no session behind on the replica
            self._finish(req, None, error=result.error)
        return False

    # --- outputs -------------------------------------------------------------

    def _append_guarded(self, req: GenerationRequest, ids: list[int], *, sampled_token: bool,
                        logprobs: RowLogprobs | None = None) -> int:
        try:
            return self._append(req, ids, sampled_token=sampled_token, logprobs=logprobs)
        except Exception as e:  # noqa: BLE001 - this request's tokens or text broke: it fails alone
            log.exception("request %s (seq %d): appending tokens failed", req.request_id, req.seq_id)
            self._fail(req, e)
            return 0

    def _append(self, req: GenerationRequest, ids: list[int], *, sampled_token: bool,
                logprobs: RowLogprobs | None = None) -> int:
        """Appends a step's tokens to a request and streams them; returns how many were appended.

        `logprobs`: the sampled token's, for a request that asked (tokens appended without them are forced).
        """
        room = req.options.max_tokens - req.num_output
        ids = ids[:room]
        # A sampled stop token (once min_tokens allows it, as EOS) ends the output; its text is cut unless asked for.
        stops = req.options.stop_token_ids
        stop_token = bool(sampled_token and stops and ids and ids[-1] in stops
                          and req.num_output >= req.options.min_tokens)
        # First: tokens it cannot decode must not reach all_ids.
        piece = self._push_text(req, ids[:-1] if stop_token and not req.options.include_stop_str_in_output else ids)
        token_logprobs = self._token_logprobs(ids, logprobs) if req.options.wants_logprobs else None
        req.all_ids.extend(ids)
        masked = req.grammar_active  # this step's tokens were under the grammar's mask (not thinking)
        if masked and sampled_token:
            req.grammar.pending_accept.extend(ids)
        if not sampled_token:
            req.forced_tokens += len(ids)
            if masked:
                self.metrics.forced_tokens.inc(len(ids))
        if req.thinking is not None and not req.thinking.done:
            self._note_thinking(req, ids)
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
            self.metrics.by_kind[req.constrained].ttft.observe(req.first_token_at - req.arrival)
        finish = None
        if stop_token or (sampled_token and ids[-1] in self.tok.eos_ids
                          and not (req.options.ignore_eos and not masked)):
            finish = FinishReason.STOP
        if piece.stopped:
            finish = FinishReason.STOP_STRING
        elif finish is None and req.num_output >= req.options.max_tokens:
            finish = FinishReason.LENGTH
        if finish is None:
            self._deliver(req, Output(ids, piece.text, reasoning_text=piece.reasoning_text,
                                      tool_calls=piece.tool_calls, logprobs=token_logprobs,
                                      tool_call_deltas=piece.tool_call_deltas))
        else:
            self._finish(req, finish, token_ids=ids, piece=piece, logprobs=token_logprobs)
        return len(ids)

    @staticmethod
    def _push_text(req: GenerationRequest, ids: list[int]) -> Piece:
        """The text of `ids`; stop strings match only from the request's min_tokens-th output token on."""
        early = min(len(ids), req.options.min_tokens - 1 - req.num_output)
        if early <= 0:
            return req.text.push(ids)
        piece = req.text.push(ids[:early], match_stop=False)
        return piece + req.text.push(ids[early:]) if early < len(ids) else piece

    def _token_logprobs(self, ids: list[int], drawn: RowLogprobs | None) -> list[TokenLogprob]:
        """Per token: the sampler's logprobs for a drawn token; logprob 0, forced, for tokens appended unsampled."""
        token_bytes = self.tok.token_bytes
        if drawn is None:
            return [TokenLogprob(t, token_bytes[t], 0.0, forced=True) for t in ids]
        top = tuple(TopLogprob(t, token_bytes[t], v) for t, v in drawn.top)
        return [TokenLogprob(t, token_bytes[t], drawn.logprob, top=top) for t in ids]

    def _note_thinking(self, req: GenerationRequest, ids: list[int]) -> None:
        thinking = req.thinking
        if thinking.end_id in ids:
            thinking.tokens += ids.index(thinking.end_id)
            thinking.done = True
            self.metrics.thinking_tokens.inc(ids.index(thinking.end_id) + 1)
        else:
            thinking.tokens += len(ids)
            self.metrics.thinking_tokens.inc(len(ids))

    def _fail(self, req: GenerationRequest, error: BaseException) -> None:
        """Fails one request with `error`; never raises (it runs in the loop's error paths)."""
        self.metrics.row_failures.inc()
        try:
            self._finish(req, None, error=error)
        except Exception:  # noqa: BLE001 - its bookkeeping is beyond repair: still tell the client
            log.exception("request %s (seq %d): finishing it failed", req.request_id, req.seq_id)
            if req.phase is not Phase.FINISHED:
                req.phase = Phase.FINISHED
                self._compiling.discard(req)
                self._deliver(req, Output([], "", None, req.usage(), error))

    def _finish(self, req: GenerationRequest, reason: FinishReason | None, *, token_ids: list[int] | None = None,
                piece: Piece = Piece(), error: BaseException | None = None,
                logprobs: list[TokenLogprob] | None = None) -> None:
        if req.phase is Phase.FINISHED:
            return
        if req.phase in (Phase.WAITING, Phase.RUNNING):
            self.scheduler.remove(req)
        self._compiling.discard(req)
        req.phase = Phase.FINISHED
        checked_on = NO_REPLICA
        if req.grammar is not None:
            checked_on = req.grammar.replica  # the replica that ran it checks it (release forgets it)
            self.grammar.release(req.grammar)
        if error is None and reason in (FinishReason.STOP, FinishReason.LENGTH):
            piece += req.text.finish()
        if reason is FinishReason.STOP and req.text.num_tool_calls:
            reason = FinishReason.TOOL_CALLS  # the model ended its turn to have its tools called
        kind = self.metrics.by_kind[req.constrained]
        kind.requests[(reason or FinishReason.ERROR).value].inc()
        now = time.monotonic()
        kind.e2e.observe(now - req.arrival)
        if req.first_token_at is not None and req.num_output > 1:
            kind.tpot.observe((now - req.first_token_at) / (req.num_output - 1))
        output = Output(token_ids or [], piece.text, reason, req.usage(), error,
                        reasoning_text=piece.reasoning_text, tool_calls=piece.tool_calls, logprobs=logprobs,
                        tool_call_deltas=piece.tool_call_deltas)
        if error is not None and len(req.group) > 1:
            self.cancel(req)  # the call ends with this completion's error: the others' work is for nobody
        if reason is FinishReason.STOP and error is None and wants_check(req):
            # The document is complete: its last response waits for the schema check, off the step loop.
            self._checks.deliver(req, output, checked_on)
        else:
            self._deliver(req, output)

    def _deliver(self, req: GenerationRequest, output: Output) -> None:
        """Hands an output to the request's stream: at the step loop's next wait when the loop made it
        (see the module docstring), at once when another task did (a compile that failed, drain)."""
        if self._task is not None and asyncio.current_task() is self._task:
            self._outbox.append((req, output))
        else:
            req.put_output(output)

    def _flush_outputs(self) -> None:
        """Every output the step loop held goes to its stream, in the order it was made."""
        outbox, self._outbox = self._outbox, []
        for req, output in outbox:
            req.put_output(output)

    def _replica_lost(self, replica: int) -> None:
        """Every request pinned to a replica whose stream broke moves to another one (replay)."""
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            if req.constrained and req.grammar.replica == replica:
                self._replay(req, errors.UnavailableError("grammar replica lost"))

    def _replay(self, req: GenerationRequest, cause: BaseException) -> None:
        """Rebuilds a lost grammar session elsewhere: a matcher is a pure function of (grammar, tokens).

        The request leaves the batch (its KV blocks are freed and recomputed on
        readmission), compiles its grammar on a live replica (the same grammar
        id everywhere; usually a cache hit) and reopens its session with every
        output token as accept_token_ids. Fails with `cause` after MAX_REPLAYS.
        """
        if req.grammar.replays >= MAX_REPLAYS:
            self._finish(req, None, error=cause)
            return
        log.warning("request %s (seq %d): grammar session lost (%s); replaying %d tokens on another replica",
                    req.request_id, req.seq_id, cause, req.num_output)
        self.metrics.grammar_replays.inc()
        self.grammar.release(req.grammar)
        req.grammar.rebuild_from(req.answer_ids)
        self.scheduler.remove(req)
        req.num_computed = 0
        self._start_compile(req)

    def _reap_cancelled(self) -> None:
        cancelled, self._cancelled = self._cancelled, []
        for req in cancelled:
            if req.phase in (Phase.WAITING, Phase.RUNNING):
                try:
                    self._finish(req, FinishReason.CANCELLED)
                except Exception as e:  # noqa: BLE001 - this request's bookkeeping: it fails alone
                    self._fail(req, e)
            # COMPILING: _compile finishes it when the compile returns.

    def _update_gauges(self) -> None:
        try:
            self.metrics.running.set(len(self.scheduler.running))
            self.metrics.waiting.set(len(self.scheduler.waiting) + len(self._compiling))
            blocks = self.runner.block_manager
            self.metrics.kv_usage.set(blocks.usage_ratio)
            self.metrics.kv_cached_free.set(blocks.num_cached_free_blocks / blocks.num_blocks)
            self.metrics.prefix_cached_blocks.set(blocks.num_cached_blocks)
        except Exception:  # noqa: BLE001 - the metrics library's: gauges are best effort, steps are not
            log.exception("updating gauges failed")

