"""Engine-level grammar backend: tokenizers, compilation, cache, bitmasks.

The request-level counterpart is `grammar_svc.session.GrammarSession` (the
same two levels as vLLM's structured-output backend types). Compiles of the
same grammar are coalesced (single flight) and run in killable worker
processes, so a request never waits on another request's grammar.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from grammar_svc.cache import CompiledEntry, FailedEntry, GrammarCache
import xgrammar as xgr

from grammar_svc.compile_pool import CompilePool, WorkersBusyError
from grammar_svc.metrics import GrammarMetrics
from grammar_svc.spec import GrammarSpec, compile_spec
from grammar_svc.tokenizer_registry import RegisteredTokenizer, TokenizerRegistry
from shared.errors import CompileTimeoutError, InvalidGrammarError, LimitExceededError, NotFoundError, StructdError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileResult:
    entry: CompiledEntry
    cache_hit: bool


class GrammarBackend:
    def __init__(self, *, compile_workers: int, cache_bytes: int, max_spec_bytes: int,
                 default_timeout_seconds: float, metrics: GrammarMetrics):
        self.tokenizers = TokenizerRegistry()
        self.cache = GrammarCache(cache_bytes)
        self.pool = CompilePool(compile_workers, self.tokenizers.worker_payloads)
        # In-process compilers (one per tokenizer) for compiles a worker showed to be fast.
        self._local_compilers: dict[str, object] = {}
        self.max_spec_bytes = max_spec_bytes
        self.default_timeout_seconds = default_timeout_seconds
        self.metrics = metrics
        self._inflight: dict[str, asyncio.Future] = {}

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    async def compile(self, fingerprint: str, spec: GrammarSpec, timeout_seconds: float = 0.0) -> CompileResult:
        kind = spec.kind.value
        tokenizer = self.tokenizers.get(fingerprint)
        timeout = timeout_seconds if timeout_seconds > 0 else self.default_timeout_seconds
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
        fut = self._inflight.get(grammar_id)
        if fut is None:
            fut = asyncio.ensure_future(self._compile_once(tokenizer, spec, grammar_id, timeout))
            self._inflight[grammar_id] = fut
            fut.add_done_callback(lambda f: self._compile_done(grammar_id, f))
        # shield: one caller cancelling must not cancel the compile others wait on.
        entry = await asyncio.shield(fut)
        return CompileResult(entry, False)

    def _compile_done(self, grammar_id: str, fut: asyncio.Future) -> None:
        self._inflight.pop(grammar_id, None)
        # Waiters get the error re-raised; retrieving it here keeps a compile
        # whose callers all went away from logging "exception never retrieved".
        if not fut.cancelled():
            fut.exception()

    async def _compile_once(self, tokenizer: RegisteredTokenizer, spec: GrammarSpec, grammar_id: str,
                            timeout: float) -> CompiledEntry:
        kind = spec.kind.value
        start = time.perf_counter()
        try:
            out = await self.pool.compile(tokenizer.fingerprint, tokenizer.info_json, spec, timeout)
        except WorkersBusyError:
            self.metrics.compile_failures.labels(kind, "busy").inc()
            raise
        except CompileTimeoutError as e:
            self.metrics.compile_failures.labels(kind, "timeout").inc()
            self.cache.put(FailedEntry(grammar_id, e, timeout))
            raise
        except InvalidGrammarError as e:
            self.metrics.compile_failures.labels(kind, "invalid").inc()
            self.cache.put(FailedEntry(grammar_id, e))
            raise
        except Exception:
            self.metrics.compile_failures.labels(kind, "error").inc()
            raise
        finally:
            self.metrics.cache_bytes.set(self.cache.bytes)
        if out.serialized is None:
            compiled = await asyncio.to_thread(compile_spec, self._local_compiler(tokenizer), spec)
        else:
            compiled = await asyncio.to_thread(xgr.CompiledGrammar.deserialize_json, out.serialized, tokenizer.info)
        self.metrics.compile_duration.labels(kind).observe(time.perf_counter() - start)
        entry = CompiledEntry(grammar_id, compiled, tokenizer, out.warnings, out.duration_seconds, compiled.memory_size_bytes)
        self.cache.put(entry)
        self.metrics.cache_bytes.set(self.cache.bytes)
        return entry

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


def _reason(e: StructdError) -> str:
    return "too_large" if isinstance(e, LimitExceededError) else "invalid"
