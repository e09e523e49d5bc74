"""Checks a finished JSON-Schema output against its schema, in worker processes, never on a step's path.

xgrammar ignores or approximates some keywords (schema_warnings.py) and its
grammar may admit documents the schema rejects, so the service validates
every finished document it is asked about with `jsonschema` (the schema's
own draft, `$schema`, else 2020-12) and names each violation: keyword, JSON
pointer of the instance, message. A document that is not one JSON text at
all (not UTF-8, a raw control character in a string, NaN) is a violation of
keyword "json".

Validation runs in a process pool rather than a thread: `re` and jsonschema
hold the GIL, and one schema whose `pattern` backtracks for seconds would
otherwise stall every step stream of the replica; and a check past its
deadline has its pool's processes stopped and replaced, so such a schema
cannot hold the checkers either. A worker keeps a few validators by schema,
so a schema used by many requests is built once.

Each worker's address space is capped (RLIMIT_AS, --worker-memory-limit-bytes):
a check that needs more fails alone (INVALID_ARGUMENT naming the flag). A
worker that dies under a check (the OOM killer, a segfault, a kill) breaks
its pool: the pool is replaced, the check that was running there fails
alone (UNAVAILABLE, saying so; the caller reports it unchecked), and the
checks after it run on the new pool. A document nested deeper than
MAX_NESTING is not checked (INVALID_ARGUMENT): the validator recurses once
per level.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.errors import (CheckTimeoutError, InvalidGrammarError, InvalidRequestError, RequestTooLargeError,
                           UnavailableError)
from shared.json_nesting import MAX_NESTING, nesting_depth

if TYPE_CHECKING:  # the worker processes import this module: they need neither
    from grammar_svc.compile.backend import GrammarBackend
    from grammar_svc.metrics import GrammarMetrics

# Violations listed per document, and characters per message: the report rides on a response.
MAX_VIOLATIONS = 16
MAX_MESSAGE_CHARS = 300
# Violations counted past the listed ones before counting stops (a huge array of wrong items).
MAX_COUNTED = 10_000
# Validators a worker keeps (by schema text).
VALIDATORS_PER_WORKER = 64
JSON_KEYWORD = "json"
# How often a worker looks whether the server that started it is still there.
PARENT_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class Violation:
    keyword: str
    instance_pointer: str
    message: str


@dataclass(frozen=True)
class CheckReport:
    violations: tuple[Violation, ...]  # at most MAX_VIOLATIONS
    total: int
    seconds: float


def _pointer(path) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _cut(message: str) -> str:
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS - 3] + "..."


def _reject_constant(name: str):
    # Python's json accepts NaN and Infinity; JSON does not.
    raise ValueError(f"{name} is not JSON")


@functools.lru_cache(maxsize=VALIDATORS_PER_WORKER)
def _validator(schema_text: str):
    from jsonschema import Draft202012Validator, validators

    schema = json.loads(schema_text)
    cls = validators.validator_for(schema, default=Draft202012Validator)
    return cls(schema)


def _parse(document: bytes) -> tuple[object, Violation | None]:
    try:
        text = document.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, Violation(JSON_KEYWORD, "", f"the output is not UTF-8 (byte {e.start})")
    try:
        return json.loads(text, parse_constant=_reject_constant), None
    except ValueError as e:  # JSONDecodeError included: the document's fault, reported as such
        return None, Violation(JSON_KEYWORD, "", _cut(f"the output is not valid JSON: {e}"))


def check_document(schema_text: str, document: bytes) -> CheckReport:
    """The document's violations of the schema (runs in a worker process)."""
    try:
        return _check(schema_text, document)
    except MemoryError:  # the worker's address-space cap: a plain error, as it crosses the process boundary
        raise CheckOutOfMemoryError("MemoryError") from None


def _check(schema_text: str, document: bytes) -> CheckReport:
    start = time.perf_counter()
    if nesting_depth(document.decode("utf-8", "replace")) > MAX_NESTING:
        raise DocumentTooDeepError(f"the output nests arrays and objects deeper than {MAX_NESTING} levels")
    instance, broken = _parse(document)
    if broken is not None:
        return CheckReport((broken,), 1, time.perf_counter() - start)
    found: list[Violation] = []
    total = 0
    try:
        for error in _validator(schema_text).iter_errors(instance):
            total += 1
            if len(found) < MAX_VIOLATIONS:
                found.append(Violation(str(error.validator), _pointer(error.absolute_path), _cut(error.message)))
            elif total >= MAX_COUNTED:
                break
    except Exception as e:  # noqa: BLE001 - the schema's: jsonschema cannot apply it (unresolvable $ref, unknown type)
        # Raised as a plain error: jsonschema's own exceptions do not all cross the process boundary.
        raise UncheckableSchemaError(_cut(f"{type(e).__name__}: {e}")) from None
    return CheckReport(tuple(found), total, time.perf_counter() - start)


class UncheckableSchemaError(ValueError):
    """The validator cannot apply the schema to the document (not a violation: nothing was decided)."""


class DocumentTooDeepError(ValueError):
    """The document nests past MAX_NESTING: the validator would recurse past Python's limit."""


class CheckOutOfMemoryError(ValueError):
    """The check ran out of the worker's address-space cap."""


class CheckWorkerDiedError(UnavailableError):
    """The worker process running this check died under it (its pool is replaced; later checks run)."""


def _start_worker(memory_limit_bytes: int = 0) -> None:
    """A pool worker's initializer: the worker ends once the server that started it is gone, then _warm. A
    server that is killed cannot stop its pool, and a spawned worker holds both ends of its call queue, so it
    would wait on that queue for ever (holding its memory, and any pipe it inherited, such as a supervisor's
    stdout)."""
    threading.Thread(target=_exit_without_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    _warm(memory_limit_bytes)


def _exit_without_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(1)


def _warm(memory_limit_bytes: int = 0) -> None:
    """Caps the worker's address space, then imports the validator library when the worker starts, not under
    the first check's deadline."""
    from grammar_svc.compile.compile_worker import limit_address_space

    limit_address_space(memory_limit_bytes)
    import jsonschema  # noqa: F401


def _stop_pool(pool: ProcessPoolExecutor, wait: bool) -> None:
    """Shuts the pool down and terminates its workers (a check still running is abandoned); wait: until they
    and its manager thread are gone (taken before the shutdown, which lets go of them)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    if wait:
        for process in processes:
            process.join()
        if manager is not None:
            manager.join()


def document_bytes(token_ids, token_bytes, stop_ids) -> bytes:
    """The document a session accepted: its tokens' bytes, trailing stop tokens left out."""
    ids = list(token_ids)
    while ids and ids[-1] in stop_ids:
        ids.pop()
    return b"".join(token_bytes[t] for t in ids)


class OutputChecks:
    """CheckOutput: the pool the checks run in, the grammars they check against, and their metrics.
    `check` waits on the event loop, never blocks it."""

    def __init__(self, backend: "GrammarBackend", metrics: "GrammarMetrics", workers: int, *,
                 memory_limit_bytes: int = 0):
        self.backend = backend
        self.metrics = metrics
        self.workers = max(1, workers)
        self.memory_limit_bytes = memory_limit_bytes
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn: the server has threads (gRPC, fills), which fork would copy in an unknown state.
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_start_worker,
                                   initargs=(self.memory_limit_bytes,))

    async def warm(self) -> None:
        """Starts the workers (a spawned interpreter importing jsonschema takes a few hundred ms), so the
        first finished output is not the one that waits for it."""
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, _warm) for _ in range(self.workers)))

    def _recycle(self, pool: ProcessPoolExecutor) -> None:
        """Replaces a pool whose check outlived its deadline (the worker would go on holding a core, and a
        pool slot, for as long as the schema makes it), or one broken by a worker's death; its processes are
        stopped. Checks still running there are retried on the new pool."""
        if self._pool is not pool:
            return  # already replaced by another timed-out check
        self._pool = self._new_pool()
        _stop_pool(pool, wait=False)

    async def check(self, grammar_id: str, token_ids, timeout: float | None) -> CheckReport:
        """The violations of a finished document; CheckTimeoutError past `timeout` seconds (the pool it
        ran in is replaced, so a schema that validates for minutes holds no worker)."""
        entry = self.backend.lookup(grammar_id)
        if entry.json_schema is None:
            raise InvalidRequestError(f"grammar {grammar_id} is not a json_schema grammar: only JSON Schema "
                                      "outputs are checked")
        tokenizer = entry.tokenizer
        bad = [t for t in token_ids if not 0 <= t < len(tokenizer.token_bytes)]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{len(tokenizer.token_bytes) - 1})")
        document = document_bytes(token_ids, tokenizer.token_bytes, set(tokenizer.info.stop_token_ids))
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        for attempt in range(2):
            pool = self._pool
            try:
                future = loop.run_in_executor(pool, check_document, entry.json_schema, document)
                report = await asyncio.wait_for(future, None if deadline is None else max(0.0, deadline - loop.time()))
                break
            except asyncio.CancelledError:  # the caller's deadline passed (or it went away) first
                self.metrics.output_checks.labels("timeout").inc()
                self._recycle(pool)
                raise
            except TimeoutError:
                self.metrics.output_checks.labels("timeout").inc()
                self._recycle(pool)
                raise CheckTimeoutError(
                    f"checking the output against its schema outlived its {timeout:g} s deadline (a schema whose "
                    "validation is this slow, e.g. a backtracking pattern)") from None
            except BrokenProcessPool:
                if pool is self._pool or attempt:
                    # A worker died under it (killed, or out of memory past the cap): this check fails alone,
                    # a new pool takes the checks after it.
                    self.metrics.output_checks.labels("worker_died").inc()
                    self._recycle(pool)
                    raise CheckWorkerDiedError(
                        "the worker process checking this output died under it (killed, or out of memory); "
                        "the output is not checked") from None
                # else another check's timeout stopped this pool under it: once more, on the new one
            except UncheckableSchemaError as e:
                self.metrics.output_checks.labels("error").inc()
                raise InvalidGrammarError(f"this schema cannot be checked by jsonschema: {e}") from None
            except DocumentTooDeepError as e:
                self.metrics.output_checks.labels("error").inc()
                raise RequestTooLargeError(f"this output cannot be checked: {e}") from None
            except CheckOutOfMemoryError:
                self.metrics.output_checks.labels("error").inc()
                raise RequestTooLargeError(
                    f"checking this output against its schema needed more than the check worker's "
                    f"{self.memory_limit_bytes} bytes of address space (--worker-memory-limit-bytes)") from None
        self.metrics.output_checks.labels("invalid" if report.total else "valid").inc()
        for v in report.violations:
            self.metrics.output_violations.labels(v.keyword).inc()
        return report

    def close(self) -> None:
        """Stops the workers (a check still running is abandoned: the service is stopping) and waits for the
        pool to wind down, so the process has no child or pool thread left when it exits."""
        _stop_pool(self._pool, wait=True)
