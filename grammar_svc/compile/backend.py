"""Engine-level grammar backend: tokenizers, compilation and the compiled-grammar cache (masks are the
sessions' and the mask filler's).

The request-level counterpart is `grammar_svc.step.session.MatcherSession` (the
same two levels as vLLM's structured-output backend types). Compiles of the
same grammar are coalesced (single flight) and run in killable worker
processes, so a request never waits on another request's grammar. A compile
whose every caller went away is cancelled (its worker is killed). A worker
that dies under a compile is replaced and the compile retried; a spec that
kills `CRASH_LIMIT` workers in a row is refused from the failure cache.

Two libraries compile grammars: xgrammar (in the workers; masks are cached
lookups, a large schema costs seconds to minutes) and llguidance (in
process, ready at once, masks computed lazily: llguidance_backend.py). A
request names one (CompileRequest.backend), or the replica's
--grammar-backend decides; `auto` compiles with xgrammar and falls back to
llguidance when xgrammar refuses the grammar, crashes on it, has not
finished after --fallback-after-seconds, or could not even start it now
(every compile worker busy and none about to be free: the request would
queue); not for the budget or a busy moment (nor for a feature) where
llguidance's grammar ignores a keyword xgrammar's enforces. A compile past
the budget goes on into the cache (the shared compile, stopped for its
worker only while no request but outlived ones waits for it); where
llguidance refuses the grammar too, the request waits for it within its
deadline, and a grammar xgrammar does not finish then is INVALID_ARGUMENT
naming llguidance's reason (at once when asked again, while the timeout is
remembered). A fallback is cached under llguidance's grammar id with the
reason that decided it: the next request for the same spec is answered from
it, or from xgrammar's grammar once that is cached. A grammar id a request
was served from stays valid (nothing drops it but the cache's eviction).

Where llguidance does not import (the replica's image lacks it: server.py
finds out once, at start), auto is xgrammar alone (no feature path, hedge or
fallback, and no llguidance tokenizer built), and a request naming
llguidance is refused (BackendNotInstalledError: UNIMPLEMENTED, naming
the package and how to install it), never an import failing per request.

Per-caller limits live here too: distinct compiles a caller may wait on
(caller_compiles.py), the cap on a compile's deadline (a compile the cap cut
short is INVALID_ARGUMENT naming --max-compile-timeout-seconds, not a
deadline the client chose: asking again cannot help), and the tokenizer registry's size (an evicted
tokenizer takes its compiled grammars and compile workers' copies with it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import xgrammar as xgr

from grammar_svc.compile.cache import CompiledEntry, FailedEntry, GrammarCache
from grammar_svc.compile.caller_compiles import CallerCompiles
from grammar_svc.compile.compile_pool import CompilePool, WorkerCrashedError, WorkersBusyError
from grammar_svc.compile.llguidance_backend import (AUTO, LLGUIDANCE, XGRAMMAR, LlguidanceAvailability,
                                                    compile_llguidance, ignored_beyond_xgrammar,
                                                    ignores_only_what_xgrammar_ignores, install_hint,
                                                    llguidance_only_features, llguidance_tokenizer)
from grammar_svc.metrics import GrammarMetrics
from grammar_svc.compile.spec import GrammarSpec, compile_spec
from grammar_svc.compile.tokenizer_registry import RegisteredTokenizer, TokenizerRegistry, TokenizersFullError
from grammar_svc.types import Kind
from shared.errors import (BackendNotInstalledError, CompileTimeoutError, GrammarCrashError, InvalidGrammarError,
                           NotFoundError, RequestTooLargeError, StructdError)

log = logging.getLogger(__name__)

# A spec under which this many workers died is refused (a compiler crash is deterministic
# far more often than not; one death alone may be the OOM killer or an operator).
CRASH_LIMIT = 2
# Specs whose crashes are remembered (oldest forgotten first).
CRASH_MEMORY = 4096


# Why a compile was served by the backend that served it (grammar_svc_backend_choices_total's reason label):
# requested (CompileRequest.backend), configured (--grammar-backend names one), default (auto: xgrammar
# compiled it), feature (auto: the schema uses what only llguidance enforces), and auto's fallbacks to llguidance.
REQUESTED, CONFIGURED, DEFAULT, FEATURE = "requested", "configured", "default", "feature"
XGRAMMAR_REFUSED, XGRAMMAR_SLOW, XGRAMMAR_CRASHED = "xgrammar_refused", "xgrammar_slow", "xgrammar_crashed"
# auto: no compile worker was free or about to be, so xgrammar could not have started within the budget.
XGRAMMAR_BUSY = "xgrammar_busy"
FALLBACK_REASONS = (XGRAMMAR_REFUSED, XGRAMMAR_SLOW, XGRAMMAR_CRASHED, XGRAMMAR_BUSY)
# auto: xgrammar served a schema auto would have given llguidance (feature, busy, slow), because llguidance's
# grammar ignores a keyword xgrammar's enforces: that trade is not made for the client.
LLGUIDANCE_IGNORES = "llguidance_ignores"
# An llguidance grammar auto built before anything decided it would serve (the hedge, or a candidate refused for
# what it ignores): cached, so a request naming llguidance is served from it and its id stays valid, but auto
# answers from it only once a reason is recorded.
UNDECIDED = ""


@dataclass(frozen=True)
class CompileResult:
    entry: CompiledEntry
    cache_hit: bool
    # Why the entry's backend serves this request.
    reason: str = DEFAULT

    @property
    def backend(self) -> str:
        return self.entry.backend


class _Flight:
    """One compile in progress and how many callers still wait for it."""

    def __init__(self, task: asyncio.Task, fingerprint: str, timeout: float):
        self.task = task
        self.fingerprint = fingerprint
        # The deadline the compile runs under: its first caller's.
        self.timeout = timeout
        self.waiters = 0
        # The waiters whose requests llguidance answered (auto past its budget): they wait only to land the
        # grammar in the cache, so a compile whose every waiter is one of them may be stopped for its worker.
        self.outlived: set[asyncio.Future] = set()

    def only_outlived(self) -> bool:
        return not self.task.done() and self.waiters <= len(self.outlived)


class GrammarBackend:
    def __init__(self, *, compile_workers: int, cache_bytes: int, max_spec_bytes: int,
                 default_timeout_seconds: float, metrics: GrammarMetrics, llguidance: LlguidanceAvailability,
                 max_timeout_seconds: float = 60.0,
                 timeout_cache_seconds: float = 30.0, max_compile_workers: int = 0,
                 compile_lane_after_seconds: float = 0.5, max_tokenizers: int = 16,
                 max_compiles_per_caller: int = 64,
                 tokenizers_in_sessions: Callable[[], set[str]] = set, worker_memory_limit_bytes: int = 0,
                 grammar_backend: str = AUTO, fallback_after_seconds: float = 1.5):
        self.grammar_backend = grammar_backend
        self.fallback_after_seconds = fallback_after_seconds
        self.llguidance = llguidance
        metrics.backend_available.labels(XGRAMMAR).set(1)  # imported above: without it nothing runs
        metrics.backend_available.labels(LLGUIDANCE).set(1 if llguidance.available else 0)
        self._tokenizers_in_sessions = tokenizers_in_sessions
        self.tokenizers = TokenizerRegistry(max_tokenizers, self._tokenizers_in_use)
        self.callers = CallerCompiles(max_compiles_per_caller, metrics)
        self.cache = GrammarCache(cache_bytes)
        self.pool = CompilePool(compile_workers, self.tokenizers.worker_payloads, max_workers=max_compile_workers,
                                lane_after_seconds=compile_lane_after_seconds, metrics=metrics,
                                memory_limit_bytes=worker_memory_limit_bytes)
        # In-process compilers (one per tokenizer) for compiles a worker showed to be fast.
        self._local_compilers: dict[str, object] = {}
        self.max_spec_bytes = max_spec_bytes
        self.default_timeout_seconds = default_timeout_seconds
        self.max_timeout_seconds = max_timeout_seconds
        self.timeout_cache_seconds = timeout_cache_seconds
        self.metrics = metrics
        self._inflight: dict[str, _Flight] = {}
        # grammar id -> the load of a compiled grammar its request's deadline passed during (lands in the cache).
        self._loads: dict[str, asyncio.Future] = {}
        # auto's xgrammar compiles (the shared flights) that went on after a request's budget, oldest first: each
        # finishes into the cache unless a request needs its worker first and nobody else waits for it.
        self._outlived: collections.OrderedDict[str, _Flight] = collections.OrderedDict()
        # grammar id -> workers that died compiling it.
        self._crashes: collections.OrderedDict[str, int] = collections.OrderedDict()

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    def _tokenizers_in_use(self) -> set[str]:
        """Tokenizers a live session or a compile in flight uses. Called from the registering thread:
        list() of the flights is taken without releasing the GIL."""
        return self._tokenizers_in_sessions() | {f.fingerprint for f in list(self._inflight.values())}

    async def register_tokenizer(self, fingerprint: str, info_zlib: bytes,
                                 hf_zlib: bytes) -> tuple[RegisteredTokenizer, bool]:
        """RegisterTokenizer: (tokenizer, already_registered); evicts unused tokenizers to make room."""
        try:
            tok, already, evicted = await asyncio.to_thread(self.tokenizers.register, fingerprint, info_zlib, hf_zlib)
        except TokenizersFullError:  # the caller's: every slot is in use; counted, then mapped
            self.metrics.limit_rejections.labels("tokenizers").inc()
            raise
        if not already and self.grammar_backend != XGRAMMAR and self.llguidance.available:
            # Built now, not by the first compile that falls back to llguidance: building it holds the GIL for
            # seconds at 129k tokens, which stalled every request in flight (docs/benchmarks.md, "Backend
            # coverage"). On an xgrammar replica only a request naming llguidance needs it: built then.
            try:
                await asyncio.to_thread(llguidance_tokenizer, tok)
            except Exception:  # noqa: BLE001 - llguidance's failure: its compiles report it; xgrammar still serves
                log.warning("llguidance could not build tokenizer %s...", fingerprint[:16], exc_info=True)
        for fp in evicted:
            dropped = self.cache.drop_tokenizer(fp)
            self._local_compilers.pop(fp, None)
            self.pool.forget_tokenizer(fp)
            self.metrics.tokenizer_evictions.inc()
            log.info("evicted unused tokenizer %s... and its %d compiled grammars (--max-tokenizers %d)",
                     fp[:16], dropped, self.tokenizers.max_tokenizers)
        self.metrics.tokenizers.set(len(self.tokenizers))
        self.metrics.cache_bytes.set(self.cache.bytes)
        return tok, already

    async def compile(self, fingerprint: str, spec: GrammarSpec, timeout_seconds: float = 0.0,
                      caller: str | None = None, backend: str = "") -> CompileResult:
        """The compiled grammar, from the cache or compiled now. `caller` (None: the server itself, e.g.
        the preload) counts against --max-compiles-per-caller while it waits on a compile. `backend`
        (xgrammar, llguidance, auto; "": --grammar-backend) chooses the library."""
        timeout = timeout_seconds if timeout_seconds > 0 else self.default_timeout_seconds
        # The client chooses its deadline, the operator how much of a core one compile may hold.
        capped = timeout > self.max_timeout_seconds
        timeout = min(timeout, self.max_timeout_seconds)
        choice = backend or self.grammar_backend
        try:
            if choice == AUTO and self.llguidance.available:
                result = await self._compile_auto(fingerprint, spec, timeout, caller)
            elif choice == AUTO:
                # Without llguidance auto has nothing to fall back to: xgrammar's answer, within the deadline.
                result = replace(await self._compile(fingerprint, spec, timeout, caller), reason=DEFAULT)
            else:
                reason = REQUESTED if backend else CONFIGURED
                if choice == LLGUIDANCE:
                    result = await self._compile_llguidance(fingerprint, spec, timeout, reason)
                else:
                    result = replace(await self._compile(fingerprint, spec, timeout, caller), reason=reason)
        except WorkersBusyError:
            raise  # the queue's doing, not the cap's
        except CompileTimeoutError as e:
            if not capped:
                raise
            self.metrics.limit_rejections.labels("compile_timeout_cap").inc()
            raise RequestTooLargeError(
                f"{spec.kind.value} compilation ran to this replica's cap of {self.max_timeout_seconds:g} s "
                f"(--max-compile-timeout-seconds) before the {timeout:g} s asked for; simplify the constraint "
                "or ask the operator to raise the cap") from e
        self.metrics.backend_choices.labels(result.backend, result.reason).inc()
        return result

    async def _compile_auto(self, fingerprint: str, spec: GrammarSpec, timeout: float,
                            caller: str | None) -> CompileResult:
        """xgrammar's grammar, unless the schema uses what only llguidance enforces, or xgrammar refuses it,
        crashes on it, is still compiling it after --fallback-after-seconds or could not start it now: then
        llguidance's (xgrammar's answer where llguidance refuses it too). Where only a feature or xgrammar's cost
        speaks for llguidance, not if llguidance's grammar ignores a keyword xgrammar's enforces
        (LLGUIDANCE_IGNORES): that trade is not made for the client."""
        xgrammar_id = spec.grammar_id(fingerprint)
        fallback = self.cache.get(spec.grammar_id(fingerprint, LLGUIDANCE))
        if isinstance(fallback, CompiledEntry) and fallback.backend_reason == FEATURE:
            self.metrics.cache_hits.labels(spec.kind.value).inc()
            return CompileResult(fallback, True, FEATURE)
        served = self.cache.get(xgrammar_id)
        if isinstance(served, CompiledEntry):
            # Also where a fallback answered before and xgrammar's compile finished into the cache since: new
            # sessions get xgrammar's cheaper masks (open ones stay on the backend they opened with).
            return replace(await self._compile(fingerprint, spec, timeout, caller), reason=DEFAULT)
        # Asked once per request: the answer may stop an outlived compile to free its worker, and asking again
        # before that worker is free would stop another, or see none free and fall back after all.
        queues: list[bool] = []

        def would_queue() -> bool:
            if not queues:
                queues.append(self._xgrammar_would_queue(xgrammar_id))
            return queues[0]

        if isinstance(fallback, CompiledEntry) and fallback.backend_reason in FALLBACK_REASONS and not (
                fallback.backend_reason == XGRAMMAR_BUSY and xgrammar_id not in self._inflight
                and not would_queue()):
            # Decided before: xgrammar is not tried again while llguidance's grammar is cached, except after a
            # busy moment (xgrammar never tried it) when a worker is free now.
            self.metrics.cache_hits.labels(spec.kind.value).inc()
            return CompileResult(fallback, True, fallback.backend_reason)
        # Whether llguidance's grammar was refused for what it ignores: xgrammar's answer then says so.
        declined = False
        if spec.kind is Kind.JSON_SCHEMA and llguidance_only_features(spec.text):
            chosen = await self._llguidance_candidate(fingerprint, spec, timeout)
            if chosen is not None and ignores_only_what_xgrammar_ignores(chosen.entry.warnings):
                return self._decided(chosen, FEATURE)
            declined = chosen is not None
        if would_queue() and not declined:
            # Queued behind other compiles, xgrammar would spend the budget waiting (most of a burst did, then
            # fell back anyway: docs/benchmarks.md, "Backend coverage").
            chosen = await self._llguidance_candidate(fingerprint, spec, timeout)
            if chosen is not None and ignores_only_what_xgrammar_ignores(chosen.entry.warnings):
                return self._decided(chosen, XGRAMMAR_BUSY)
            # Where llguidance cannot serve it, or would drop what xgrammar enforces, waiting for xgrammar is
            # the only answer left.
            declined = chosen is not None
        start = time.monotonic()
        budget = min(self.fallback_after_seconds, timeout)
        first = asyncio.ensure_future(self._compile(fingerprint, spec, timeout, caller))
        # llguidance's grammar is built from half the budget on, beside xgrammar's compile, so a fallback at the
        # budget does not wait for it too. Built undecided: xgrammar may still answer within the budget.
        hedge = None
        try:
            done, _ = await asyncio.wait({first}, timeout=budget / 2)
            if not done:
                hedge = asyncio.ensure_future(self._compile_llguidance(
                    fingerprint, spec, timeout - (time.monotonic() - start), UNDECIDED))
                hedge.add_done_callback(_consume)
                done, _ = await asyncio.wait({first}, timeout=max(0.0, budget - (time.monotonic() - start)))
            if not done:
                try:
                    result = await hedge
                except (InvalidGrammarError, CompileTimeoutError):
                    # llguidance refuses it or ran out of time: xgrammar's compile, past the budget (perhaps only
                    # queued behind a burst), is the only answer left, so it is waited for within the deadline.
                    # Refused at the budget, schemas xgrammar compiles in seconds, or milliseconds once a worker
                    # is free, went unserved (docs/benchmarks.md, "Backend coverage").
                    result = None
                if result is not None and ignores_only_what_xgrammar_ignores(result.entry.warnings):
                    self._outlive(xgrammar_id, first)
                    return self._decided(result, XGRAMMAR_SLOW)
                declined = declined or result is not None
                await asyncio.wait({first})
        except BaseException:
            first.cancel()  # the caller went away: so does its share of the compile
            if hedge is not None:
                hedge.cancel()
            raise
        try:
            served = first.result()
        except InvalidGrammarError as e:
            refusal, reason = e, XGRAMMAR_REFUSED
        except GrammarCrashError as e:
            refusal, reason = e, XGRAMMAR_CRASHED
        except CompileTimeoutError as e:  # past the deadline, remembered, or a deadline shorter than the budget
            refusal, reason = e, XGRAMMAR_SLOW
        else:
            return replace(served, reason=LLGUIDANCE_IGNORES if declined else DEFAULT)
        if hedge is not None:
            # llguidance's grammar is being built already: the fallback below is answered from it.
            await asyncio.gather(hedge, return_exceptions=True)
        try:
            result = await self._compile_llguidance(fingerprint, spec, timeout - (time.monotonic() - start),
                                                    UNDECIDED)
        except (InvalidGrammarError, CompileTimeoutError) as e:
            if (reason == XGRAMMAR_SLOW and isinstance(e, InvalidGrammarError)
                    and timeout >= self.fallback_after_seconds):
                # xgrammar's timeout is remembered: asking again is refused at once, naming llguidance's reason.
                # (A deadline shorter than the budget ran out on the caller's side: DEADLINE_EXCEEDED, below.)
                raise _neither_serves(spec, timeout, e) from None
            raise refusal from None  # both refuse it: xgrammar's reason is the one clients know
        ignored = ignored_beyond_xgrammar(result.entry.warnings)
        if reason == XGRAMMAR_SLOW and ignored:
            # xgrammar could serve it, given the time; llguidance's grammar would not enforce all of it.
            raise CompileTimeoutError(
                f"{refusal} (llguidance compiles it at once but ignores {', '.join(ignored)}, which xgrammar "
                "enforces: ask for backend llguidance to accept that, or for a longer deadline)") from None
        return self._decided(result, reason)

    async def _llguidance_candidate(self, fingerprint: str, spec: GrammarSpec, timeout: float) -> CompileResult | None:
        """llguidance's grammar for auto to weigh, undecided; None where llguidance cannot serve it now."""
        try:
            return await self._compile_llguidance(fingerprint, spec, timeout, UNDECIDED)
        except (InvalidGrammarError, CompileTimeoutError):  # llguidance's refusal: xgrammar's answer is still one
            return None

    def _decided(self, result: CompileResult, reason: str) -> CompileResult:
        """auto's answer from llguidance's grammar, the reason that decided it recorded on the cached entry (the
        next auto request for the constraint reads it there; the grammar id is unchanged)."""
        entry = result.entry
        if entry.backend_reason != reason:
            entry = replace(entry, backend_reason=reason)
            self.cache.put(entry)
        return CompileResult(entry, result.cache_hit, reason)

    def _xgrammar_would_queue(self, xgrammar_id: str) -> bool:
        """Whether an xgrammar compile of this grammar asked for now would wait for a worker: none idle or
        starting that no earlier compile waits for. A compile that outlived its budget gives its worker up
        (the oldest first) rather than send a request to the fallback, where nothing else waits: not one that
        a request still waits for (a request naming xgrammar, or auto's within its budget, joined it)."""
        if xgrammar_id in self._inflight:
            return False  # joining a compile in flight takes no worker
        pool = self.pool
        if pool.idle_workers + pool.starting_workers > pool.waiting_jobs:
            return False
        if pool.waiting_jobs == 0:
            for grammar_id, flight in list(self._outlived.items()):
                if flight.task.done():
                    del self._outlived[grammar_id]
                elif flight.only_outlived():
                    # Its worker is killed and replaced: this request waits for that one.
                    del self._outlived[grammar_id]
                    if self._inflight.get(grammar_id) is flight:
                        del self._inflight[grammar_id]
                    flight.task.cancel()
                    return False
        return True

    def _outlive(self, xgrammar_id: str, waiter: asyncio.Future) -> None:
        """A request's xgrammar compile past the budget goes on (the request has llguidance's answer) and
        finishes into the cache, within its deadline, unless its worker is wanted first (_xgrammar_would_queue)
        while nobody else waits for it."""
        waiter.add_done_callback(_consume)
        flight = self._inflight.get(xgrammar_id)
        if flight is None or flight.task.done():
            return  # it ended as the budget did: the waiter ends with it
        flight.outlived.add(waiter)
        waiter.add_done_callback(flight.outlived.discard)
        if self._outlived.get(xgrammar_id) is not flight:
            self._outlived.pop(xgrammar_id, None)
            self._outlived[xgrammar_id] = flight

    async def _compile_llguidance(self, fingerprint: str, spec: GrammarSpec, timeout: float,
                                  reason: str) -> CompileResult:
        """llguidance's grammar (no worker: it builds lazily, so a compile is a validation; it runs on a thread,
        llguidance releasing the GIL)."""
        if not self.llguidance.available:
            raise BackendNotInstalledError(
                f"{self.llguidance.why_missing()}, so it cannot serve backend llguidance: ask for backend auto or "
                f"xgrammar (auto serves every constraint from xgrammar here), or have the operator install it "
                f"({install_hint()})")
        kind = spec.kind.value
        tokenizer = self.tokenizers.get(fingerprint)
        grammar_id = spec.grammar_id(fingerprint, LLGUIDANCE)
        cached = self.cache.get(grammar_id)
        if isinstance(cached, CompiledEntry):
            self.metrics.cache_hits.labels(kind).inc()
            return CompileResult(cached, True, reason)
        if isinstance(cached, FailedEntry):
            self.metrics.cache_hits.labels(kind).inc()
            raise cached.error
        self.metrics.cache_misses.labels(kind).inc()
        start = time.perf_counter()
        try:
            spec.validate(self.max_spec_bytes)
            if timeout <= 0:
                raise CompileTimeoutError(f"{kind} compilation left no time for llguidance; retry with a longer "
                                          "deadline")
            compiled = await asyncio.wait_for(asyncio.to_thread(compile_llguidance, tokenizer, spec), timeout)
        except asyncio.TimeoutError:
            self.metrics.compile_failures.labels(kind, "timeout").inc()
            raise CompileTimeoutError(f"{kind} compilation (llguidance) exceeded its {timeout:g} s deadline; "
                                      "retry later") from None
        except StructdError as e:
            self.metrics.compile_failures.labels(
                kind, "timeout" if isinstance(e, CompileTimeoutError) else _reason(e)).inc()
            if isinstance(e, InvalidGrammarError):
                self.cache.put(FailedEntry(grammar_id, e))
            raise
        duration = time.perf_counter() - start
        self.metrics.compile_duration.labels(kind).observe(duration)
        entry = CompiledEntry(grammar_id, compiled, tokenizer, compiled.warnings, duration, compiled.memory_size_bytes,
                              json_schema=spec.text if spec.kind is Kind.JSON_SCHEMA else None,
                              backend=LLGUIDANCE, backend_reason=reason)
        self.cache.put(entry)
        self.metrics.cache_bytes.set(self.cache.bytes)
        return CompileResult(entry, False, reason)

    async def _compile(self, fingerprint: str, spec: GrammarSpec, timeout: float,
                       caller: str | None) -> CompileResult:
        kind = spec.kind.value
        tokenizer = self.tokenizers.get(fingerprint)
        grammar_id = spec.grammar_id(fingerprint)
        cached = self.cache.get(grammar_id)
        if isinstance(cached, CompiledEntry):
            self.metrics.cache_hits.labels(kind).inc()
            return CompileResult(cached, True)
        if isinstance(cached, FailedEntry) and (cached.timeout_seconds is None or timeout <= cached.timeout_seconds):
            self.metrics.cache_hits.labels(kind).inc()
            raise cached.error
        self.metrics.cache_misses.labels(kind).inc()
        try:
            spec.validate(self.max_spec_bytes)
        except StructdError as e:
            self.metrics.compile_failures.labels(kind, _reason(e)).inc()
            raise
        if caller is not None:
            self.callers.enter(caller, grammar_id)
        asked, deadline = timeout, time.monotonic() + timeout
        joined = False
        try:
            while True:
                flight = self._inflight.get(grammar_id)
                if flight is None or flight.task.done():  # (one ended, not yet removed by _compile_done)
                    flight = _Flight(asyncio.ensure_future(self._compile_once(tokenizer, spec, grammar_id, timeout)),
                                     tokenizer.fingerprint, timeout)
                    self._inflight[grammar_id] = flight
                    flight.task.add_done_callback(lambda f, flight=flight: self._compile_done(grammar_id, flight))
                    mine = True
                else:
                    mine, joined = False, True
                try:
                    entry = await self._wait_for(flight, grammar_id)
                except CompileTimeoutError as e:
                    if not joined:
                        raise
                    # A compile joined under a shorter deadline than this request's ran out of its own: with more
                    # time left than that compile had, this request compiles again in it rather than hear of a
                    # deadline it did not ask for.
                    landed = None if mine else await self._landing(grammar_id, deadline)
                    if landed is not None:
                        return CompileResult(landed, True)
                    timeout = deadline - time.monotonic()
                    if not mine and self._compile_again(flight, e, timeout):
                        continue
                    if isinstance(e, WorkersBusyError):
                        raise
                    raise CompileTimeoutError(
                        f"{kind} compilation did not finish within its {asked:g} s deadline (the compile was "
                        "shared with another request for the same grammar); simplify the constraint or raise "
                        "timeout_seconds", ran_seconds=e.ran_seconds) from None
                return CompileResult(entry, False)
        finally:
            if caller is not None:
                self.callers.leave(caller, grammar_id)

    def _compile_again(self, flight: _Flight, stopped: CompileTimeoutError, left: float) -> bool:
        """Whether a request that joined `flight`, which stopped at its own deadline, compiles again in the
        `left` seconds it still has: not one auto has answered already (it waited only to land the grammar in
        the cache), and only with more time than the grammar had (as a remembered timeout is held)."""
        if asyncio.current_task() in flight.outlived:
            return False
        tried = flight.timeout if stopped.ran_seconds is None else min(flight.timeout, stopped.ran_seconds)
        return left > tried

    async def _landing(self, grammar_id: str, deadline: float) -> CompiledEntry | None:
        """The grammar, where a compile that stopped while loading it lands it in the cache before `deadline`
        (not compiled again), else None."""
        load = self._loads.get(grammar_id)
        if load is not None:
            try:
                await asyncio.wait_for(asyncio.shield(load), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass  # not by this request's deadline: compiling again cannot finish sooner either
            except Exception:  # noqa: BLE001 - xgrammar's failure to load it (_land logs nothing): compiled again
                pass
        cached = self.cache.get(grammar_id)
        return cached if isinstance(cached, CompiledEntry) else None

    async def _wait_for(self, flight: _Flight, grammar_id: str) -> CompiledEntry:
        """The flight's grammar, waited for as one of its callers."""
        flight.waiters += 1
        try:
            # shield: one caller cancelling must not cancel the compile others wait on.
            return await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                # The last caller went away (cancelled, or its deadline passed): nobody wants
                # this grammar now, so stop the compile; the pool kills its worker.
                if self._inflight.get(grammar_id) is flight:
                    del self._inflight[grammar_id]
                flight.task.cancel()

    def _compile_done(self, grammar_id: str, flight: _Flight) -> None:
        if self._inflight.get(grammar_id) is flight:
            del self._inflight[grammar_id]
        if self._outlived.get(grammar_id) is flight:
            del self._outlived[grammar_id]
        # Waiters get the error re-raised; retrieving it here keeps a compile
        # whose callers all went away from logging "exception never retrieved".
        if not flight.task.cancelled():
            flight.task.exception()

    async def _compile_once(self, tokenizer: RegisteredTokenizer, spec: GrammarSpec, grammar_id: str,
                            timeout: float) -> CompiledEntry:
        kind = spec.kind.value
        start = time.perf_counter()
        deadline = time.monotonic() + timeout
        try:
            out = await self._compile_on_workers(tokenizer, spec, grammar_id, timeout)
        except WorkersBusyError:
            self.metrics.compile_failures.labels(kind, "busy").inc()
            raise
        except GrammarCrashError as e:
            self.metrics.compile_failures.labels(kind, "crash").inc()
            self.cache.put(FailedEntry(grammar_id, e))
            raise
        except CompileTimeoutError as e:
            self.metrics.compile_failures.labels(kind, "timeout").inc()
            # Remembered briefly: the same deadline may well be enough once the load has passed. Held against
            # deadlines up to what the compile itself had (less than the request's when it waited for a worker).
            tried = timeout if e.ran_seconds is None else min(timeout, e.ran_seconds)
            self.cache.put(FailedEntry(grammar_id, e, tried,
                                       expires_at=time.monotonic() + self.timeout_cache_seconds))
            raise
        except (InvalidGrammarError, RequestTooLargeError) as e:  # the spec's own, every time: remembered
            self.metrics.compile_failures.labels(kind, _reason(e)).inc()
            self.cache.put(FailedEntry(grammar_id, e))
            raise
        except Exception:  # noqa: BLE001 - ours or xgrammar's bug: counted, then mapped to INTERNAL
            self.metrics.compile_failures.labels(kind, "error").inc()
            raise
        finally:
            self.metrics.cache_bytes.set(self.cache.bytes)
        if out.serialized is None:
            load = asyncio.ensure_future(asyncio.to_thread(compile_spec, self._local_compiler(tokenizer), spec))
        else:
            load = asyncio.ensure_future(
                asyncio.to_thread(xgr.CompiledGrammar.deserialize_json, out.serialized, tokenizer.info))
        # Loading it here is part of the request's deadline (a large grammar under a burst took seconds past it:
        # docs/benchmarks.md, "The whole sample"); a load past it still lands in the cache for the next request.
        try:
            compiled = await asyncio.wait_for(
                asyncio.shield(load), max(0.0, deadline + out.tokenizer_seconds - time.monotonic()))
        except asyncio.TimeoutError:
            load.add_done_callback(lambda f: self._land(f, grammar_id, tokenizer, spec, out))
            # Requests that joined this compile with later deadlines wait for the load, not compile again.
            self._loads[grammar_id] = load
            load.add_done_callback(lambda f: self._loads.pop(grammar_id, None) if self._loads.get(grammar_id) is f
                                   else None)
            self.metrics.compile_failures.labels(kind, "timeout").inc()
            raise CompileTimeoutError(
                f"{kind} compilation exceeded its {timeout:g} s deadline loading the compiled grammar into the "
                "grammar service; retry (it is cached once loaded)") from None
        self.metrics.compile_duration.labels(kind).observe(time.perf_counter() - start)
        return self._keep(grammar_id, compiled, tokenizer, spec, out)

    def _land(self, load: asyncio.Future, grammar_id: str, tokenizer: RegisteredTokenizer, spec: GrammarSpec,
              out) -> None:
        """A load that outlived its request's deadline: cached all the same, while its tokenizer is."""
        if load.cancelled() or load.exception() is not None:
            return  # xgrammar's failure to load it (retrieved here, not logged as never retrieved): compiled again
        if tokenizer.fingerprint in self.tokenizers:
            self._keep(grammar_id, load.result(), tokenizer, spec, out)

    def _keep(self, grammar_id: str, compiled, tokenizer: RegisteredTokenizer, spec: GrammarSpec,
              out) -> CompiledEntry:
        """xgrammar's grammar, loaded in this process, cached."""
        entry = CompiledEntry(grammar_id, compiled, tokenizer, out.warnings, out.duration_seconds,
                              compiled.memory_size_bytes,
                              json_schema=spec.text if spec.kind is Kind.JSON_SCHEMA else None)
        self.cache.put(entry)
        self.metrics.cache_bytes.set(self.cache.bytes)
        return entry

    async def _compile_on_workers(self, tokenizer: RegisteredTokenizer, spec: GrammarSpec, grammar_id: str,
                                  timeout: float):
        """The pool's compile, retried on a fresh worker when one dies under it, within one deadline."""
        deadline = time.monotonic() + timeout
        remaining = timeout  # the first attempt gets (and its error names) the whole deadline
        while True:
            if remaining <= 0:
                raise CompileTimeoutError(
                    f"{spec.kind.value} compilation exceeded its {timeout:g} s deadline (compile workers "
                    "died under it); retry later")
            try:
                out = await self.pool.compile(tokenizer.fingerprint, tokenizer.info_json, spec, remaining)
            except WorkerCrashedError as e:  # the worker process's failure; maybe the spec's doing
                if not e.during_compile:
                    # Died loading a tokenizer: nothing to hold against the spec.
                    remaining = deadline - time.monotonic()
                    continue
                crashes = self._crashes.pop(grammar_id, 0) + 1
                self._crashes[grammar_id] = crashes
                while len(self._crashes) > CRASH_MEMORY:
                    self._crashes.popitem(last=False)
                log.warning("compile worker died compiling grammar %s (%d of %d allowed): %s",
                            grammar_id, crashes, CRASH_LIMIT, e)
                if crashes >= CRASH_LIMIT:
                    raise GrammarCrashError(
                        f"{spec.kind.value}: compiling this constraint crashed the grammar compiler "
                        f"{crashes} times; it is refused (a compiler bug, or a constraint too large for the "
                        f"worker's memory: {_memory_cap(self.pool.memory_limit_bytes)}): simplify the constraint"
                    ) from None
                remaining = deadline - time.monotonic()
                continue
            self._crashes.pop(grammar_id, None)
            return out

    def _local_compiler(self, tokenizer: RegisteredTokenizer):
        compiler = self._local_compilers.get(tokenizer.fingerprint)
        if compiler is None:
            compiler = xgr.GrammarCompiler(tokenizer.info, max_threads=1, cache_enabled=False)
            self._local_compilers[tokenizer.fingerprint] = compiler
        return compiler

    def lookup(self, grammar_id: str) -> CompiledEntry:
        """The compiled grammar for a session open; NOT_FOUND if not compiled here."""
        entry = self.cache.get(grammar_id)
        if not isinstance(entry, CompiledEntry):
            raise NotFoundError(
                f"grammar {grammar_id} is not compiled on this replica (or was evicted); call Compile and reopen"
            )
        return entry


def _neither_serves(spec: GrammarSpec, seconds: float, llguidance_refusal: InvalidGrammarError) -> InvalidGrammarError:
    """A constraint llguidance refuses and xgrammar did not compile within `seconds` (the fallback budget, or a
    remembered timeout): the constraint's fault (INVALID_ARGUMENT), named by llguidance's refusal."""
    return InvalidGrammarError(
        f"{spec.kind.value}: no grammar backend serves this constraint: xgrammar did not compile it within "
        f"{seconds:g} s and {llguidance_refusal}. Rewrite that part of the constraint, or ask for backend xgrammar "
        "with a long compile deadline (up to the replica's --max-compile-timeout-seconds)")


def _consume(fut: asyncio.Future) -> None:
    """Retrieves the outcome of a task nobody awaits (a hedge not needed, a compile that outlived its caller)."""
    if not fut.cancelled():
        fut.exception()


def _memory_cap(limit_bytes: int) -> str:
    return f"{limit_bytes} bytes, --worker-memory-limit-bytes" if limit_bytes else "--worker-memory-limit-bytes 0"


def _reason(e: StructdError) -> str:
    return "too_large" if isinstance(e, RequestTooLargeError) else "invalid"
