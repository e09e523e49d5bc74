"""The engine's view of the grammar tier: handshake, compiles, and one step stream per replica.

Each request is pinned to one replica: the one with the fewest sessions (open,
or compiling there) when its compile starts, ties to the replica listed first. A step is sent as one `StepRequest` per replica
that has rows in it, written *before* the forward pass is launched; the
responses are read after the forward, their masks decoded straight into the
engine's bitmask rows, and every row comes back to the engine as a small
typed `RowResult`: the engine never sees protobuf.

Nothing a replica sends is trusted blindly: a response must answer every
session it was sent, in order (`SessionResult.session_id`), and an OK result
must carry a mask, or the row cannot be used. A replica whose stream breaks,
that answers out of order, or that does not answer within the step deadline
(`--grammar-step-timeout-seconds`, counted from the end of the forward) is
reported as lost and marked down (new compiles avoid it until `maintain` has
registered the tokenizer with it again). A session is a pure function of
(grammar id, accepted tokens), so the engine replays the affected requests on
another replica; a replay longer than one message may carry is sent as
several messages on the stream before the step's own. A compile that finds a
replica UNAVAILABLE, or that does not answer it within the compile's own
deadline plus `COMPILE_RPC_MARGIN_SECONDS` (its event loop wedged while its
transport still answers keepalives), is retried once on another; the
request never waits on a silent replica longer than that. A compile carries
the request's end client (`GrammarLink.end_client`) for the replica's
per-caller limit. A `dns:///name:port` target
(a Kubernetes headless Service) stands for every address it resolves to,
re-resolved periodically; addresses that leave DNS are dropped.

What a replica answered to a Compile is remembered per replica (constraint ->
grammar id and warnings, `COMPILED_MEMO_ENTRIES`): the next request with the
same constraint (its grammar backend included) placed there opens its session at once, without the RPC (the
RPC and its task were a visible share of the inference process's CPU at a
high rate of new requests: docs/benchmarks.md, "Host path, second round",
item 2), except an answer the replica gave for want of a free compile worker
(`PROVISIONAL_BACKEND_REASONS`), which it may answer better next time. The
memo is dropped whenever the replica may have lost its cache (its stream
broke, a compile found it unregistered, it left DNS). Should the replica have evicted the grammar meanwhile, the session's open
fails NOT_FOUND and the request is replayed like any forgotten session;
replays always compile by RPC.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
import numpy as np

from inference_svc.grammar.grammar_link import GrammarLink
from inference_svc.types import CheckResult, Constraint, JsonOptions, SchemaCheck, SchemaViolation, SchemaWarning
from shared import errors
from shared.codec import SparseMask
from shared.gen.grammar.v1 import grammar_service_pb2 as gpb
from shared.grammar_client import GrammarClient, StepStream, decode_masks
from shared.tls import CertificateFiles, ClientTls
from shared.status import error_for_code
from shared.tokenizer import TokenizerDescription

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"
# A grammar step normally takes well under a millisecond; past this (after the forward) the replica is hung.
DEFAULT_STEP_TIMEOUT_SECONDS = 2.0
# Accepted tokens per SessionStep: comfortably below the grammar service's per-step limit (4,096), so a
# replayed generation of any length goes out as several messages.
MAX_ACCEPT_PER_MESSAGE = 2048
# A Compile RPC gets the compile's own deadline plus this before the replica counts as hung (queueing, transfer).
COMPILE_RPC_MARGIN_SECONDS = 5.0
# The compile deadline assumed when the server asks for none (0: the replica's default, at most its cap, whose
# default is this: --max-compile-timeout-seconds).
UNSET_COMPILE_TIMEOUT_SECONDS = 60.0
# Compile status codes that say the replica, not the constraint, failed: the compile moves to another one.
_RETRY_ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION)

# The replica lacks what the compile asked for (the llguidance backend): another replica may have it; this one
# keeps its registration and memo (it is fine for everything else).
_NOT_ON_THIS_REPLICA = grpc.StatusCode.UNIMPLEMENTED

# Grammar tier status codes that mean "your constraint", passed on to the client as such.
_COMPILE_ERRORS: dict[grpc.StatusCode, type[errors.StructdError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidGrammarError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.CompileTimeoutError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.LimitExceededError,
    # No replica has the backend the request named: the request's choice, which this deployment cannot serve
    # (INVALID_ARGUMENT, HTTP 400 at the gateway: a 5xx would be retried by SDKs, to the same answer).
    grpc.StatusCode.UNIMPLEMENTED: errors.InvalidRequestError,
}
_NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
# Per-session error codes that are the request's own (its constraint, a limit it hit): passed on as such;
# any other code is the replica's trouble and reaches the client as UNAVAILABLE.
_REQUEST_CODES = {grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}
# What inference_svc_grammar_replicas counts (replica_counts).
REPLICA_STATES = ("registered", "unregistered", "retired")
# Compile answers remembered per replica (see the module docstring); the least recently used go first.
# Constraints longer than COMPILED_MEMO_MAX_CONSTRAINT_CHARS are not remembered (at most ~16 MB of keys a replica).
COMPILED_MEMO_ENTRIES = 1024
COMPILED_MEMO_MAX_CONSTRAINT_CHARS = 16 * 1024
# CompileResponse.backend_reason of an answer not remembered: auto's llguidance fallback because no compile worker
# was free. The replica tries xgrammar again for the next request once a worker is, so that request asks again.
PROVISIONAL_BACKEND_REASONS = frozenset({"xgrammar_busy"})


def compile_error(e: grpc.aio.AioRpcError, target: str) -> errors.StructdError:
    cls = _COMPILE_ERRORS.get(e.code())
    if cls is not None:
        return cls(f"constraint: {e.details()}")
    return errors.UnavailableError(f"grammar tier {target}: {e.code().name}: {e.details()}")


class GrammarProtocolError(ConnectionError):
    """A replica answered something that does not match what it was sent: its stream cannot be trusted."""


class RowOutcome(enum.Enum):
    OK = "ok"  # the next mask is in the bitmask row (or `sparse`); forced tokens may come with it
    TERMINATED = "terminated"  # the grammar is complete
    REJECTED = "rejected"  # the grammar refused a token sampled under its own mask
    LOST = "lost"  # the replica lost the session (or died): rebuild it elsewhere
    FAILED = "failed"  # the session failed for a reason that is the request's: `error`


@dataclass(frozen=True, slots=True)
class RowResult:
    outcome: RowOutcome
    # The mask as the id list it arrived as (None: dense, in the bitmask row).
    sparse: SparseMask | None = None
    forced_token_ids: tuple[int, ...] = ()
    error: BaseException | None = None  # LOST and FAILED: why


@dataclass
class _Replica:
    id: int
    client: GrammarClient
    dns_name: str | None = None  # the dns:/// target it was resolved from
    stream: StepStream | None = None
    sessions: int = 0
    registered: bool = False
    # It did not answer a compile (or the tokenizer on a compile's way) in time: no compile is tried there, not
    # even to register it again on the way (that would wait out another deadline), until it answers a
    # registration (maintain()'s, or one already on its way). Never set beside `registered`.
    hung: bool = False
    retired: bool = False  # its address left DNS: no new sessions; gone once its sessions are
    pending_closes: list[int] = field(default_factory=list)
    # What it answered to Compile: constraint -> (grammar id, warnings).
    compiled: OrderedDict[Constraint, tuple[str, tuple[SchemaWarning, ...]]] = field(default_factory=OrderedDict)

    def unregister(self) -> None:
        """It may have restarted (or is gone): it needs the tokenizer again, and its cache may be empty."""
        self.registered = False
        self.compiled.clear()

    def mark_registered(self) -> None:
        """It answered a registration: whatever was said of it before (hung, even) is past."""
        self.registered, self.hung = True, False

    def mark_hung(self) -> None:
        self.unregister()
        self.hung = True

    def remember(self, constraint: Constraint, grammar_id: str, warnings: tuple[SchemaWarning, ...]) -> None:
        if len(constraint.text) + sum(map(len, constraint.choices)) > COMPILED_MEMO_MAX_CONSTRAINT_CHARS:
            return
        self.compiled[constraint] = (grammar_id, warnings)
        self.compiled.move_to_end(constraint)
        while len(self.compiled) > COMPILED_MEMO_ENTRIES:
            self.compiled.popitem(last=False)


@dataclass(frozen=True)
class GrammarRow:
    """One session's part of a step; row is its bitmask row."""

    link: GrammarLink
    row: int


@dataclass
class StepResults:
    """Per row, in send order: what the grammar said (closes are not reported)."""

    rows: list[RowResult]
    lost_replicas: dict[int, str]  # replica -> why: "timeout" (silent past the deadline) or "broken"
    rpc_seconds: float


@dataclass
class _Exchange:
    """One replica's part of a step on its way: the SessionSteps sent and the rows they fill."""

    steps: list[gpb.SessionStep]
    rows: list[int]  # index into the step's GrammarRows per step (-1: a close)
    bitmask_rows: list[int]


class PendingStep:
    """A step on its way: one task per replica writes its StepRequest and reads the answer."""

    def __init__(self, tier: "GrammarTier", parts: dict[int, _Exchange], num_rows: int, bitmask: np.ndarray):
        self._tier = tier
        self._parts = parts
        self._num_rows = num_rows
        self._sent_at = time.perf_counter()
        self._tasks = {replica: asyncio.ensure_future(tier._exchange(replica, part, bitmask))
                       for replica, part in parts.items()}

    @property
    def answered(self) -> bool:
        """Every replica has answered (or failed): `receive` returns without waiting."""
        return all(task.done() for task in self._tasks.values())

    async def receive(self, timeout: float | None = None) -> StepResults:
        """Every replica's answer; a replica that has not answered `timeout` seconds from now is lost."""
        out: list[RowResult | None] = [None] * self._num_rows
        lost: dict[int, str] = {}
        answered_at = self._sent_at
        if self._tasks:
            _, late = await asyncio.wait(self._tasks.values(), timeout=timeout)
            for task in late:
                task.cancel()
            # Cancelled tasks stop at their pending write or read; none touches the bitmask after this.
            await asyncio.gather(*late, return_exceptions=True)
        for replica, task in self._tasks.items():
            part = self._parts[replica]
            if task.cancelled():
                answer: object = TimeoutError(f"no answer within the {timeout:g} s grammar step deadline")
            else:
                answer = task.exception() or task.result()
            if isinstance(answer, BaseException):
                lost[replica] = "timeout" if task.cancelled() else "broken"
                exc = self._tier._lose(replica, answer)
                for i in part.rows:
                    if i >= 0:
                        out[i] = RowResult(RowOutcome.LOST, error=exc)
                continue
            results, at = answer
            answered_at = max(answered_at, at)
            for i, result in zip(part.rows, results):
                if i >= 0:
                    out[i] = result
        return StepResults(out, lost, answered_at - self._sent_at)


def _row_result(result: gpb.SessionResult, sparse: SparseMask | None, wants_mask: bool) -> RowResult:
    status = result.status
    if status == gpb.SESSION_STATUS_OK:
        if wants_mask and not result.mask.WhichOneof("encoding"):
            return RowResult(RowOutcome.LOST, error=errors.UnavailableError(
                f"grammar session {result.session_id}: the replica answered OK without a mask"))
        return RowResult(RowOutcome.OK, sparse, tuple(result.jump_forward.forced_token_ids))
    if status == gpb.SESSION_STATUS_TERMINATED:
        return RowResult(RowOutcome.TERMINATED)
    if status == gpb.SESSION_STATUS_REJECTED:
        return RowResult(RowOutcome.REJECTED)
    if status == gpb.SESSION_STATUS_CLOSED:
        return RowResult(RowOutcome.OK)
    message = f"grammar session: {result.error_message}"
    if result.error_code == _NOT_FOUND:
        # The replica forgot the session or its grammar (restart, idle expiry, eviction): rebuild it.
        return RowResult(RowOutcome.LOST, error=errors.UnavailableError(message))
    if result.error_code in _REQUEST_CODES:
        return RowResult(RowOutcome.FAILED, error=error_for_code(result.error_code, message, errors.UnavailableError))
    return RowResult(RowOutcome.FAILED, error=errors.UnavailableError(message))


_WHITESPACE = {
    "compact": gpb.WHITESPACE_STYLE_COMPACT,
    "flexible": gpb.WHITESPACE_STYLE_FLEXIBLE,
    "indented": gpb.WHITESPACE_STYLE_INDENTED,
}


def json_options(o: JsonOptions) -> gpb.JsonSchemaOptions:
    return gpb.JsonSchemaOptions(whitespace=_WHITESPACE[o.whitespace], indent=o.indent,
                                 max_whitespace_count=o.max_whitespace_count, any_key_order=o.any_key_order,
                                 lenient=o.lenient)


def strict_refusal(warnings: tuple[SchemaWarning, ...]) -> errors.InvalidGrammarError:
    """The error for a strict_schema request whose schema the grammar cannot enforce whole."""
    named = "; ".join(f"{w.keyword} at {w.json_pointer or 'the root'}" if w.json_pointer else w.message
                      for w in warnings)
    return errors.InvalidGrammarError(
        f"constraint.strict_schema: the grammar does not enforce {len(warnings)} part(s) of this schema: {named}. "
        "Remove or rewrite them, or drop strict_schema to generate anyway (every finished output is then "
        "checked and its violations returned)")


_BACKEND = {
    "": gpb.GRAMMAR_BACKEND_UNSPECIFIED,
    "auto": gpb.GRAMMAR_BACKEND_AUTO,
    "xgrammar": gpb.GRAMMAR_BACKEND_XGRAMMAR,
    "llguidance": gpb.GRAMMAR_BACKEND_LLGUIDANCE,
}


def grammar_spec(c: Constraint) -> gpb.GrammarSpec:
    """The grammar tier's spec for a request's constraint."""
    if c.kind == "json_schema":
        return gpb.GrammarSpec(json_schema=gpb.JsonSchema(schema=c.text, options=json_options(c.json_options)))
    if c.kind == "regex":
        return gpb.GrammarSpec(regex=c.text)
    if c.kind == "ebnf":
        return gpb.GrammarSpec(ebnf=gpb.Ebnf(grammar=c.text))
    if c.kind == "choice":
        return gpb.GrammarSpec(choice=gpb.ChoiceList(choices=c.choices))
    if c.kind == "json_object":
        return gpb.GrammarSpec(json_object=gpb.JsonObject(options=json_options(c.json_options)))
    return gpb.GrammarSpec(structural_tag=c.text)


def _check_answer(resp: gpb.StepResponse, steps: list[gpb.SessionStep]) -> None:
    """A response must answer exactly the sessions sent, in order: otherwise no row of it can be trusted."""
    if len(resp.results) != len(steps):
        raise GrammarProtocolError(f"step answered {len(resp.results)} sessions, sent {len(steps)}")
    for sent, got in zip(steps, resp.results):
        if got.session_id != sent.session_id:
            raise GrammarProtocolError(
                f"step answered session {got.session_id} where session {sent.session_id} was sent")


class GrammarTier:
    def __init__(self, targets: tuple[str, ...], tokenizer: TokenizerDescription, compile_timeout_seconds: float = 0.0,
                 *, write_sparse_rows: bool = True, step_timeout_seconds: float = DEFAULT_STEP_TIMEOUT_SECONDS,
                 tls: ClientTls | None = None):
        # False when masks are applied from their id lists (logits on the CPU): their bitmask rows stay unwritten.
        self.write_sparse_rows = write_sparse_rows
        self.step_timeout_seconds = step_timeout_seconds
        self.tls = tls  # None: plaintext
        # The client certificate files, watched by connect(): a rotated certificate is used for new calls.
        self._tls_files = CertificateFiles(tls) if tls is not None else None
        self._replicas: dict[int, _Replica] = {}
        self._replica_ids = itertools.count()
        # dns:///name:port is a set of replicas (a headless Service): one per address, re-resolved by maintain().
        self._dns_names = [t for t in targets if t.startswith(DNS_SCHEME)]
        for t in targets:
            if not t.startswith(DNS_SCHEME):
                self._add(t)
        for name, addresses in self._lookup_all().items():
            self._apply_resolution(name, addresses)
        self.tokenizer = tokenizer
        self.compile_timeout_seconds = compile_timeout_seconds
        self._session_ids = itertools.count(1)

    def _add(self, target: str, dns_name: str | None = None) -> None:
        if all(r.client.target != target or r.retired for r in self._replicas.values()):
            rid = next(self._replica_ids)
            self._replicas[rid] = _Replica(rid, GrammarClient(target, tls=self._tls_for(dns_name)), dns_name)

    def _tls_for(self, dns_name: str | None) -> ClientTls | None:
        if self.tls is not None and dns_name is not None and not self.tls.server_name:
            # Dialled by pod IP: the replica's certificate names the Service, not the address.
            return self.tls.with_server_name(dns_name[len(DNS_SCHEME):].rpartition(":")[0])
        return self.tls

    def _renew_if_rotated(self) -> None:
        """A rotated client certificate: every replica's new calls and streams present it, while the streams
        already open keep their connection (their channel is closed once a new stream replaces them)."""
        if self._tls_files is None or not self._tls_files.changed():
            return
        for r in self._replicas.values():
            r.client.renew(self._tls_for(r.dns_name))
        self._tls_files.loaded()

    def _lookup_all(self) -> dict[str, set[str]]:
        """The addresses each dns:/// target resolves to now (blocking; names that fail to resolve are left out)."""
        resolved = {}
        for name in self._dns_names:
            host, _, port = name[len(DNS_SCHEME):].rpartition(":")
            try:
                infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except (OSError, ValueError) as e:  # the DNS server's or the operator's: keep what we have
                log.warning("cannot resolve grammar target %s: %s", name, e)
                continue
            addresses = {f"[{a[0]}]:{a[1]}" if family == socket.AF_INET6 else f"{a[0]}:{a[1]}"
                         for family, _, _, _, a in infos}
            if addresses:  # an empty answer is a lookup that failed, not a tier of zero replicas
                resolved[name] = addresses
        return resolved

    def _apply_resolution(self, name: str, addresses: set[str]) -> None:
        """One replica per address; replicas whose address is gone are retired, not redialled."""
        for r in list(self._replicas.values()):
            if r.dns_name == name and not r.retired and r.client.target not in addresses:
                log.warning("grammar replica %s left %s: dropped", r.client.target, name)
                r.retired = True
                r.unregister()
                self._forget_if_unused(r)
        for address in sorted(addresses):
            self._add(address, name)

    def _forget_if_unused(self, r: _Replica) -> None:
        if r.retired and r.sessions == 0 and r.stream is None:
            del self._replicas[r.id]
            asyncio.ensure_future(r.client.close())

    async def maintain(self, interval_seconds: float = 5.0) -> None:
        """Forever: re-resolves dns:/// targets and hands the tokenizer to replicas that lack it."""
        while True:
            await asyncio.sleep(interval_seconds)
            try:
                await self.connect(timeout=min(interval_seconds, 5.0))
            except Exception:  # noqa: BLE001 - a replica's or DNS's failure; the next round tries again
                log.exception("grammar tier maintenance failed")

    def replica_counts(self) -> dict[str, int]:
        """Replicas by state (REPLICA_STATES). Read at scrape time from the metrics thread: list() of the dict's
        values is taken without releasing the GIL."""
        counts = dict.fromkeys(REPLICA_STATES, 0)
        for r in list(self._replicas.values()):
            counts["retired" if r.retired else "registered" if r.registered else "unregistered"] += 1
        return counts

    @property
    def targets(self) -> list[str]:
        return [r.client.target for r in self._replicas.values() if not r.retired]

    def target(self, replica: int) -> str:
        return self._replicas[replica].client.target

    async def connect(self, timeout: float = 5.0) -> int:
        """Registers the tokenizer with every replica not yet registered (dns:/// targets re-resolved first);
        returns how many are."""
        self._renew_if_rotated()
        if self._dns_names:
            for name, addresses in (await asyncio.to_thread(self._lookup_all)).items():
                self._apply_resolution(name, addresses)

        async def one(r: _Replica) -> None:
            if r.registered or r.retired:
                return
            try:
                await r.client.register_tokenizer(self.tokenizer, timeout=timeout)
                r.mark_registered()
            except grpc.aio.AioRpcError as e:  # the replica's: it stays down until it answers
                log.debug("grammar replica %s not reachable: %s", r.client.target, e.details())

        await asyncio.gather(*(one(r) for r in list(self._replicas.values())))
        return sum(r.registered for r in self._replicas.values())

    def new_session_id(self) -> int:
        return next(self._session_ids)

    def _pick(self, exclude: set[int]) -> _Replica | None:
        """The live replica (not retired, not hung) with the fewest sessions (compiles in flight included),
        a registered one where there is one; ties go to the one added first, so placement is deterministic."""
        live = [r for r in self._replicas.values() if not r.retired and not r.hung and r.id not in exclude]
        candidates = [r for r in live if r.registered] or live
        return min(candidates, key=lambda r: (r.sessions, r.id)) if candidates else None

    async def compile(self, link: GrammarLink) -> None:
        """Compiles the session's constraint on the least-loaded registered replica and places the session
        there (opened with the next step). A replica that answers UNAVAILABLE or FAILED_PRECONDITION (it is
        down, or forgot the tokenizer) is marked unregistered and the compile is tried once more on another one;
        one that answers UNIMPLEMENTED (it lacks the backend asked for) stays registered, does not count
        towards those two, and every other replica is tried; with none left, the client hears the last
        replica's answer (UNIMPLEMENTED as INVALID_ARGUMENT: the request names what no replica has)."""
        tried: set[int] = set()
        lost = 0  # replicas that failed it (down, hung, forgot the tokenizer): two and the compile gives up
        refused: tuple[grpc.aio.AioRpcError, str] | None = None  # the last replica's own answer, and its target
        while True:
            r = self._pick(tried)
            if r is None:
                if refused is not None:
                    # Its message says what the replica lacks (llguidance, say) and how to mend it.
                    raise compile_error(*refused) from None
                raise errors.UnavailableError("no grammar replica is available; retry later")
            tried.add(r.id)
            # Counted from the pick, not the answer: requests that arrive together compile concurrently,
            # and each must see the others' picks or they would all land on the same replica.
            r.sessions += 1
            placed = False
            try:
                known = r.compiled.get(link.constraint) if r.registered and not link.replays else None
                if known is not None:
                    r.compiled.move_to_end(link.constraint)
                    grammar_id, link.warnings = known
                else:
                    grammar_id, link.warnings = await self._compile_on(r, link.constraint, link.end_client)
                if link.constraint.strict_schema and link.warnings:
                    raise strict_refusal(link.warnings)
                placed = True
            except grpc.aio.AioRpcError as e:
                if e.code() == _NOT_ON_THIS_REPLICA:
                    refused = (e, r.client.target)
                    continue  # the next replica, or (none left) this answer
                if e.code() not in _RETRY_ELSEWHERE:
                    raise compile_error(e, r.client.target) from None  # the constraint's, or the caller's deadline
                # The replica's: it is down, or restarted without the tokenizer (maintain() re-registers it).
                r.unregister()
                lost += 1
                if lost >= 2:
                    raise compile_error(e, r.client.target) from None
                refused = (e, r.client.target)
                log.warning("grammar replica %s: compile failed with %s; trying another replica",
                            r.client.target, e.code().name)
                continue
            except TimeoutError:
                # Hung (SIGSTOPped, its event loop wedged): new compiles avoid it until it answers maintain().
                r.mark_hung()
                lost += 1
                seconds = self.compile_rpc_seconds
                if lost >= 2 or self._pick(tried) is None:
                    raise errors.UnavailableError(
                        f"grammar replica {r.client.target} did not answer the compile within {seconds:g} s (the "
                        f"compile deadline plus {COMPILE_RPC_MARGIN_SECONDS:g} s): it is hung; retry later"
                    ) from None
                log.warning("grammar replica %s: no answer to a compile within %g s; trying another replica",
                            r.client.target, seconds)
                continue
            finally:
                if not placed:  # refused, failed or cancelled: the reservation goes back
                    r.sessions -= 1
                    self._forget_if_unused(r)
            break
        link.placed_on(r.id, grammar_id, self.new_session_id())

    @property
    def compile_rpc_seconds(self) -> float:
        """How long a replica may take to answer a Compile before it counts as hung."""
        return (self.compile_timeout_seconds or UNSET_COMPILE_TIMEOUT_SECONDS) + COMPILE_RPC_MARGIN_SECONDS

    async def _compile_on(self, r: _Replica, constraint: Constraint,
                          end_client: str = "") -> tuple[str, tuple[SchemaWarning, ...]]:
        """(grammar id, warnings) from a Compile RPC to `r` (remembered there); TimeoutError when `r` does not
        answer within compile_rpc_seconds."""
        if not r.registered:
            try:
                await r.client.register_tokenizer(self.tokenizer, timeout=5.0)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the replica's silence, not the constraint's
                    raise TimeoutError from None
                raise
            # (A compile that timed out meanwhile may have marked it hung: it has answered since.)
            r.mark_registered()
        seconds = self.compile_rpc_seconds
        # The replica hears a deadline a little later than ours, so ours (a TimeoutError, never its
        # DEADLINE_EXCEEDED answer for a compile that outlived its own timeout) is what a hung replica yields.
        resp = await asyncio.wait_for(
            r.client.compile(self.tokenizer.fingerprint, grammar_spec(constraint), self.compile_timeout_seconds,
                             rpc_timeout=seconds + 1.0, end_client=end_client, backend=_BACKEND[constraint.backend]),
            seconds)
        for w in resp.warnings:
            log.info("grammar %s: %s", resp.grammar_id[:12], w)
        warnings = tuple(SchemaWarning(w.keyword, w.json_pointer, w.message) for w in resp.warning_details)
        if resp.backend_reason not in PROVISIONAL_BACKEND_REASONS:
            r.remember(constraint, resp.grammar_id, warnings)
        return resp.grammar_id, warnings

    async def check_output(self, replica: int, constraint: Constraint, grammar_id: str, token_ids: list[int],
                           timeout: float) -> SchemaCheck:
        """A finished document checked against its schema, on the replica that ran it (another live one when
        it is gone, compiling the grammar there first). Never raises for the tier's failures: the check is
        then UNCHECKED, saying why."""
        deadline = time.monotonic() + timeout
        r = self._replicas.get(replica)
        if r is None or r.retired or not r.registered:
            r = self._pick(set())
            if r is None:
                return SchemaCheck(CheckResult.UNCHECKED, detail="no grammar replica was available to check it")
        for attempt in range(2):
            try:
                resp = await r.client.check_output(grammar_id, token_ids,
                                                   rpc_timeout=max(0.001, deadline - time.monotonic()))
                break
            except grpc.aio.AioRpcError as e:  # the replica's answer: unchecked unless it only forgot the grammar
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    return SchemaCheck(CheckResult.UNCHECKED, detail=(
                        f"the check did not finish within --schema-check-timeout-seconds ({timeout:g} s)"))
                if e.code() != grpc.StatusCode.NOT_FOUND or attempt:
                    return SchemaCheck(CheckResult.UNCHECKED, detail=(
                        f"grammar replica {r.client.target} could not check it: {e.code().name}: {e.details()}"))
            try:
                # Evicted (or never compiled on this replica): the same grammar id again, usually at once.
                await r.client.compile(self.tokenizer.fingerprint, grammar_spec(constraint),
                                       self.compile_timeout_seconds, rpc_timeout=max(0.001, deadline - time.monotonic()),
                                       backend=_BACKEND[constraint.backend])
            except grpc.aio.AioRpcError as e:  # the replica's, or the deadline's
                return SchemaCheck(CheckResult.UNCHECKED, detail=(
                    f"grammar replica {r.client.target} could not recompile the grammar to check it: "
                    f"{e.code().name}: {e.details()}"))
        violations = tuple(SchemaViolation(v.keyword, v.instance_pointer, v.message) for v in resp.violations)
        if not resp.total_violations:
            return SchemaCheck(CheckResult.VALID)
        left_out = resp.total_violations - len(violations)
        return SchemaCheck(CheckResult.INVALID, violations,
                           f"{left_out} more violation(s) not listed" if left_out > 0 else "")

    def release(self, link: GrammarLink) -> None:
        """A request is done with its replica (finished, or its session is to be rebuilt elsewhere):
        its open session is closed with the next step."""
        r = self._replicas.get(link.replica)
        if r is not None:
            r.sessions = max(0, r.sessions - 1)
            if link.open and r.stream is not None:
                r.pending_closes.append(link.session_id)
            self._forget_if_unused(r)
        link.released()

    def has_pending_closes(self) -> bool:
        return any(r.pending_closes for r in self._replicas.values())

    def send(self, rows: list[GrammarRow], bitmask: np.ndarray) -> PendingStep:
        """Starts one StepRequest per replica with rows (plus pending closes); returns before any answer.

        Each row's session tells the grammar what it has not been told yet (its
        pending tokens, and opens the session the first time). Writing, reading
        and decoding the masks into `bitmask` (row GrammarRow.row) run as tasks,
        so the caller launches its forward pass at once and all of it overlaps the
        forward. The caller must not touch those rows until receive().
        """
        parts: dict[int, _Exchange] = {}
        for i, row in enumerate(rows):
            s = row.link
            step = gpb.SessionStep(session_id=s.session_id, accept_token_ids=s.pending_accept,
                                   jump_forward=s.jump_forward and bool(s.pending_accept))
            if not s.open:
                step.open.grammar_id = s.grammar_id
                s.open = True
            s.pending_accept = []
            part = parts.setdefault(s.replica, _Exchange([], [], []))
            part.steps.append(step)
            part.rows.append(i)
            part.bitmask_rows.append(row.row)
        for r in self._replicas.values():
            if r.pending_closes:
                part = parts.setdefault(r.id, _Exchange([], [], []))
                for sid in r.pending_closes:
                    part.steps.append(gpb.SessionStep(session_id=sid, close=True))
                    part.rows.append(-1)
                    part.bitmask_rows.append(0)
                r.pending_closes.clear()
        return PendingStep(self, parts, len(rows), bitmask)

    async def _exchange(self, replica: int, part: _Exchange, bitmask: np.ndarray) -> tuple[list[RowResult], float]:
        """One replica's part of a step: its rows' results (masks decoded into the bitmask), and when."""
        r = self._replicas.get(replica)
        if r is None or r.retired:
            raise ConnectionError("the replica's address left DNS")
        if r.stream is None:
            if r.client.has_retired_channels:
                # The stream that kept a channel from before a certificate rotation is gone.
                asyncio.ensure_future(r.client.close_retired())
            r.stream = r.client.open_stream(self.tokenizer.vocab_size, write_sparse_rows=self.write_sparse_rows)
        stream = r.stream
        steps = part.steps
        early = await self._catch_up(stream, steps)
        await stream.write(steps)
        resp = await stream.read()
        _check_answer(resp, steps)
        forms: list[SparseMask | None] = []
        decode_masks(resp, stream.decoder, bitmask, part.bitmask_rows, forms)
        results = [early.get(k) or _row_result(res, form, wants_mask=not step.close)
                   for k, (step, res, form) in enumerate(zip(steps, resp.results, forms))]
        return results, time.perf_counter()

    async def _catch_up(self, stream: StepStream, steps: list[gpb.SessionStep]) -> dict[int, RowResult]:
        """Sends the head of every token run too long for one message (a replay) ahead of the step, in as
        many messages as it takes, trimming `steps` to what is left. Returns the rows that failed on the
        way (their step is reduced to a no-op; the failure is their result)."""
        early: dict[int, RowResult] = {}
        while True:
            long = [k for k, s in enumerate(steps) if len(s.accept_token_ids) > MAX_ACCEPT_PER_MESSAGE and k not in early]
            if not long:
                return early
            head = []
            for k in long:
                s = steps[k]
                h = gpb.SessionStep(session_id=s.session_id, skip_mask=True,
                                    accept_token_ids=s.accept_token_ids[:MAX_ACCEPT_PER_MESSAGE])
                if s.HasField("open"):
                    h.open.CopyFrom(s.open)
                    s.ClearField("open")
                del s.accept_token_ids[:MAX_ACCEPT_PER_MESSAGE]
                head.append(h)
            await stream.write(head)
            resp = await stream.read()
            _check_answer(resp, head)
            for k, res in zip(long, resp.results):
                result = _row_result(res, None, wants_mask=False)
                if result.outcome is not RowOutcome.OK:
                    early[k] = result
                    # Nothing more to tell this session; an empty no-mask step keeps the rows aligned.
                    steps[k] = gpb.SessionStep(session_id=steps[k].session_id, skip_mask=True)

    def _lose(self, replica: int, cause: BaseException) -> errors.UnavailableError:
        detail = cause.details() if isinstance(cause, grpc.aio.AioRpcError) else (str(cause) or type(cause).__name__)
        r = self._replicas.get(replica)
        if r is None:
            return errors.UnavailableError(f"grammar replica lost: {detail}")
        # New compiles avoid it until it has the tokenizer again (a replay's compile may hand it over on its way:
        # one slow step is not a hung replica, and with no other replica its requests' replays would fail).
        r.unregister()
        if r.stream is not None:
            r.stream.cancel()
            r.stream = None
        r.pending_closes.clear()  # the replica drops a broken stream's sessions itself
        log.warning("grammar replica %s lost its step stream: %s", r.client.target, detail)
        self._forget_if_unused(r)
        return errors.UnavailableError(f"grammar replica {r.client.target} lost the step stream: {detail}")

    async def close(self) -> None:
        for r in self._replicas.values():
            if r.stream is not None:
                r.stream.cancel()
            await r.client.close()
