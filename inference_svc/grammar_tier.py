"""The engine's view of the grammar tier: handshake, compiles, and one step stream per replica.

Each request is pinned to one replica (the one with the fewest open sessions
when its grammar is compiled). A step is sent as one `StepRequest` per replica
that has rows in it, written *before* the forward pass is launched; the
responses are read after the forward, and their masks decoded straight into
the engine's bitmask rows.

A replica whose stream breaks (or does not answer within the step timeout)
is reported as lost and marked down (new compiles avoid it until `maintain`
has registered the tokenizer with it again). A session is a pure function of
(grammar id, accepted tokens), so the engine replays the affected requests on
another replica. A `dns:///name:port` target (a Kubernetes headless Service)
stands for every address it resolves to, re-resolved periodically.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from shared import errors
from shared.codec import SparseMask
from shared.gen.grammar.v1 import grammar_service_pb2 as gpb
from shared.grammar_client import GrammarClient, StepStream, decode_masks
from shared.tokenizer import TokenizerDescription

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
# A grammar step is normally well under a millisecond; this only catches a hung replica.
STEP_TIMEOUT_SECONDS = 30.0

# Grammar tier status codes that mean "your constraint", passed on to the client as such.
_COMPILE_ERRORS: dict[grpc.StatusCode, type[errors.StructdError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidGrammarError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.CompileTimeoutError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.LimitExceededError,
}


def compile_error(e: grpc.aio.AioRpcError, target: str) -> errors.StructdError:
    cls = _COMPILE_ERRORS.get(e.code())
    if cls is not None:
        return cls(f"constraint: {e.details()}")
    return errors.UnavailableError(f"grammar tier {target}: {e.code().name}: {e.details()}")


@dataclass
class _Replica:
    index: int
    client: GrammarClient
    stream: StepStream | None = None
    sessions: int = 0
    registered: bool = False
    pending_closes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class GrammarRow:
    """One session's part of a step; row is its bitmask row (-1: none, e.g. close)."""

    replica: int
    step: gpb.SessionStep
    row: int


@dataclass
class StepResults:
    """Per row, in send order: a SessionResult, or the exception that lost it."""

    results: list[gpb.SessionResult | BaseException]
    # Per row: the mask as the id list it arrived as (None: dense, or no mask).
    sparse: list[SparseMask | None]
    lost_replicas: set[int]
    rpc_seconds: float


class PendingStep:
    """A step on its way: one task per replica writes its StepRequest and reads the answer."""

    def __init__(self, tier: "GrammarTier", parts: dict[int, list[int]], rows: list[GrammarRow], sent_at: float,
                 bitmask: np.ndarray):
        self._tier = tier
        self._parts = parts  # replica -> indices into rows
        self._rows = rows
        self._sent_at = sent_at
        self._tasks = {
            replica: asyncio.ensure_future(tier._exchange(
                replica, [rows[i].step for i in indices], bitmask, [max(rows[i].row, 0) for i in indices]))
            for replica, indices in parts.items()}

    async def receive(self) -> StepResults:
        out: list[gpb.SessionResult | BaseException | None] = [None] * len(self._rows)
        sparse: list[SparseMask | None] = [None] * len(self._rows)
        lost: set[int] = set()
        answers = await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        answered_at = self._sent_at
        for replica, answer in zip(self._tasks, answers):
            indices = self._parts[replica]
            if not isinstance(answer, BaseException) and len(answer[0].results) != len(indices):
                answer = ConnectionError(f"step answered {len(answer[0].results)} sessions, sent {len(indices)}")
            if isinstance(answer, BaseException):
                lost.add(replica)
                exc = self._tier._lose(replica, answer)
                for i in indices:
                    out[i] = exc
                continue
            resp, forms, at = answer
            answered_at = max(answered_at, at)
            for i, result, form in zip(indices, resp.results, forms):
                out[i] = result
                sparse[i] = form
        return StepResults(out, sparse, lost, answered_at - self._sent_at)


class GrammarTier:
    def __init__(self, targets: tuple[str, ...], tokenizer: TokenizerDescription, compile_timeout_seconds: float = 0.0,
                 *, write_sparse_rows: bool = True):
        # False when masks are applied from their id lists (logits on the CPU): their bitmask rows stay unwritten.
        self.write_sparse_rows = write_sparse_rows
        self._replicas: list[_Replica] = []
        # dns:///name:port is a set of replicas (a headless Service): one per address, re-resolved by maintain().
        self._dns_names = [t for t in targets if t.startswith(DNS_SCHEME)]
        for t in targets:
            if not t.startswith(DNS_SCHEME):
                self._add(t)
        self._resolve()
        self.tokenizer = tokenizer
        self.compile_timeout_seconds = compile_timeout_seconds
        self._session_ids = itertools.count(1)

    def _add(self, target: str) -> None:
        if all(r.client.target != target for r in self._replicas):
            self._replicas.append(_Replica(len(self._replicas), GrammarClient(target)))

    def _resolve(self) -> None:
        """Adds a replica for every address the dns:/// targets resolve to now (vanished ones fail and stay down)."""
        for name in self._dns_names:
            host, _, port = name[len(DNS_SCHEME):].rpartition(":")
            try:
                infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except (OSError, ValueError) as e:
                log.warning("cannot resolve grammar target %s: %s", name, e)
                continue
            for family, _, _, _, addr in infos:
                self._add(f"[{addr[0]}]:{addr[1]}" if family == socket.AF_INET6 else f"{addr[0]}:{addr[1]}")

    async def maintain(self, interval_seconds: float = 5.0) -> None:
        """Forever: re-resolves dns:/// targets and hands the tokenizer to replicas that lack it."""
        while True:
            await asyncio.sleep(interval_seconds)
            await self.connect(timeout=min(interval_seconds, 5.0))

    @property
    def targets(self) -> list[str]:
        return [r.client.target for r in self._replicas]

    def target(self, replica: int) -> str:
        return self._replicas[replica].client.target

    async def connect(self, timeout: float = 5.0) -> int:
        """Registers the tokenizer with every replica not yet registered (dns:/// targets re-resolved first);
        returns how many are."""
        if self._dns_names:
            await asyncio.to_thread(self._resolve)

        async def one(r: _Replica) -> None:
            if r.registered:
                return
            try:
                await r.client.register_tokenizer(self.tokenizer, timeout=timeout)
                r.registered = True
            except grpc.aio.AioRpcError as e:
                log.debug("grammar replica %s not reachable: %s", r.client.target, e.details())

        await asyncio.gather(*(one(r) for r in self._replicas))
        return sum(r.registered for r in self._replicas)

    def new_session_id(self) -> int:
        return next(self._session_ids)

    async def compile(self, spec: gpb.GrammarSpec) -> tuple[int, str]:
        """(replica, grammar id) for a constraint, on the least-loaded registered replica."""
        candidates = [r for r in self._replicas if r.registered] or self._replicas
        r = min(candidates, key=lambda r: r.sessions)
        try:
            if not r.registered:
                await r.client.register_tokenizer(self.tokenizer, timeout=5.0)
                r.registered = True
            resp = await r.client.compile(self.tokenizer.fingerprint, spec, self.compile_timeout_seconds)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                # The replica restarted and forgot the tokenizer: hand it over again next time.
                r.registered = False
            raise compile_error(e, r.client.target) from None
        for w in resp.warnings:
            log.info("grammar %s: %s", resp.grammar_id[:12], w)
        r.sessions += 1
        return r.index, resp.grammar_id

    def release(self, replica: int, session_id: int | None) -> None:
        """A request is done with its replica; its open session is closed with the next step."""
        r = self._replicas[replica]
        r.sessions = max(0, r.sessions - 1)
        if session_id is not None and r.stream is not None:
            r.pending_closes.append(session_id)

    def has_pending_closes(self) -> bool:
        return any(r.pending_closes for r in self._replicas)

    def send(self, rows: list[GrammarRow], bitmask: np.ndarray) -> PendingStep:
        """Starts one StepRequest per replica with rows (plus pending closes); returns before any answer.

        Writing, reading and decoding the masks into `bitmask` (row GrammarRow.row)
        run as tasks, so the caller launches its forward pass at once and all of
        it overlaps the forward. The caller must not touch those rows until receive().
        """
        parts: dict[int, list[int]] = {}
        rows = list(rows)
        for r in self._replicas:
            for sid in r.pending_closes:
                rows.append(GrammarRow(r.index, gpb.SessionStep(session_id=sid, close=True), -1))
            r.pending_closes.clear()
        for i, row in enumerate(rows):
            parts.setdefault(row.replica, []).append(i)
        return PendingStep(self, parts, rows, time.perf_counter(), bitmask)

    async def _exchange(self, replica: int, steps: list[gpb.SessionStep], bitmask: np.ndarray, rows: list[int]):
        """(response, its masks' sparse forms, when decoded) for one replica's part of a step."""
        r = self._replicas[replica]
        if r.stream is None:
            r.stream = r.client.open_stream(self.tokenizer.vocab_size, write_sparse_rows=self.write_sparse_rows)
        stream = r.stream
        await stream.write(steps)
        resp = await asyncio.wait_for(stream.read(), STEP_TIMEOUT_SECONDS)
        forms: list[SparseMask | None] = []
        if len(resp.results) == len(steps):
            decode_masks(resp, stream.decoder, bitmask, rows, forms)
        return resp, forms, time.perf_counter()

    def _lose(self, replica: int, cause: BaseException) -> errors.UnavailableError:
        r = self._replicas[replica]
        # New compiles avoid it until maintain() has handed it the tokenizer again.
        r.registered = False
        if r.stream is not None:
            r.stream.cancel()
            r.stream = None
        r.pending_closes.clear()  # the replica drops a broken stream's sessions itself
        detail = cause.details() if isinstance(cause, grpc.aio.AioRpcError) else (str(cause) or type(cause).__name__)
        log.warning("grammar replica %s lost its step stream: %s", r.client.target, detail)
        return errors.UnavailableError(f"grammar replica {r.client.target} lost the step stream: {detail}")

    async def close(self) -> None:
        for r in self._replicas:
            if r.stream is not None:
                r.stream.cancel()
            await r.client.close()
