"""`structd bench grammar`: the phases that talk to the server.

- compile: every schema once (cold) and once more (cached), client-observed;
- walks: a full batch of sessions doing seeded random valid walks, one step
  message per decoding step, with every mask decoded the way the inference
  side decodes it (shared.grammar_client.decode_masks + shared.codec).

Everything that a later local pass needs (which grammar each session used,
which tokens it accepted, a hash of every mask the server sent) is recorded.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from shared.codec import MaskDecoder, words_for_vocab
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient, decode_masks
from structd.bench.harness import progress


def open_stream(client: GrammarClient, vocab_size: int, mask_cache_slots: int | None = None):
    """(stream, decoder): one decoder per stream (it holds the stream's mask cache, where the client has one)."""
    import inspect

    params = inspect.signature(client.open_stream).parameters
    if "vocab_size" in params:
        kw = {} if mask_cache_slots is None or "mask_cache_slots" not in params else {"mask_cache_slots": mask_cache_slots}
        stream = client.open_stream(vocab_size, **kw)
        return stream, stream.decoder
    return client.open_stream(), MaskDecoder(vocab_size)


def server_default_compile_workers() -> int:
    from grammar_svc.config import GrammarServiceConfig

    return GrammarServiceConfig().compile_workers


def json_schema_spec(schema_text: str) -> pb.GrammarSpec:
    # Compact whitespace, strict: the service defaults.
    return pb.GrammarSpec(json_schema=pb.JsonSchema(schema=schema_text))


# ----------------------------------------------------------------------------- compile


@dataclass
class CompileRecord:
    name: str
    dataset: str
    schema_text: str
    status: str = "pending"  # ok, invalid, timeout, error
    cold_seconds: float = 0.0
    cached_seconds: float | None = None
    server_compile_seconds: float | None = None
    cold_cache_hit: bool = False
    cached_cache_hit: bool | None = None
    memory_bytes: int | None = None
    warnings: int = 0
    grammar_id: str = ""
    error: str = ""

    def summary(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "schema_text"}
        d["schema_bytes"] = len(self.schema_text)
        return d


_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: "invalid", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout"}


async def compile_once(client: GrammarClient, fp: str, text: str, timeout: float):
    start = time.perf_counter()
    try:
        resp = await client.compile(fp, json_schema_spec(text), timeout_seconds=timeout, rpc_timeout=timeout + 60)
        return "ok", time.perf_counter() - start, resp, ""
    except grpc.aio.AioRpcError as e:
        return _STATUS.get(e.code(), "error"), time.perf_counter() - start, None, f"{e.code().name}: {e.details()}"


async def warm_up_compile_workers(client: GrammarClient, fp: str, workers: int) -> None:
    """Each compile worker loads the tokenizer on its first job (seconds): pay that before measuring."""
    await asyncio.gather(*[
        compile_once(client, fp, json.dumps({"type": "object", "title": f"bench-warmup-{i}"}), 120.0)
        for i in range(max(1, workers))])


async def compile_phase(client: GrammarClient, fp: str, records: list[CompileRecord], timeout: float,
                        concurrency: int, progress_every: int = 25) -> None:
    sem = asyncio.Semaphore(max(1, concurrency))
    done = 0
    t0 = time.perf_counter()

    async def one(rec: CompileRecord):
        nonlocal done
        async with sem:
            status, seconds, resp, err = await compile_once(client, fp, rec.schema_text, timeout)
        rec.status, rec.cold_seconds, rec.error = status, seconds, err
        if resp is not None:
            rec.grammar_id = resp.grammar_id
            rec.server_compile_seconds = resp.compile_duration_seconds
            rec.cold_cache_hit = resp.cache_hit
            rec.memory_bytes = resp.memory_bytes
            rec.warnings = len(resp.warnings)
        done += 1
        if done % progress_every == 0 or done == len(records):
            counts = _counts(records)
            progress(f"compile (cold) {done}/{len(records)}: {counts} ({time.perf_counter() - t0:.0f} s)")

    await asyncio.gather(*[one(r) for r in records])
    # Cached: the same spec again, one at a time (client-observed unary round trip).
    for i, rec in enumerate(records, 1):
        status, seconds, resp, _ = await compile_once(client, fp, rec.schema_text, timeout)
        rec.cached_seconds = seconds
        rec.cached_cache_hit = resp.cache_hit if resp is not None else (status != "timeout")
        if i % (progress_every * 8) == 0 or i == len(records):
            progress(f"compile (cached) {i}/{len(records)}")


def _counts(records: list[CompileRecord]) -> dict:
    out: dict[str, int] = {}
    for r in records:
        if r.status != "pending":
            out[r.status] = out.get(r.status, 0) + 1
    return out


# ----------------------------------------------------------------------------- walks


def sample_allowed(row: np.ndarray, rng: np.random.Generator) -> int | None:
    """A uniformly random allowed token id of one packed row, without listing them all."""
    words = row.view(np.uint32)
    counts = np.bitwise_count(words)
    cum = np.cumsum(counts, dtype=np.int64)
    total = int(cum[-1])
    if total == 0:
        return None
    k = int(rng.integers(total))
    wi = int(np.searchsorted(cum, k, side="right"))
    r = k - (int(cum[wi]) - int(counts[wi]))
    word = int(words[wi])
    for bit in range(32):
        if word >> bit & 1:
            if r == 0:
                return wi * 32 + bit
            r -= 1
    raise AssertionError("popcount and bits disagree")


async def floor_phase(client: GrammarClient, vocab_size: int, steps: int, warmup: int = 20) -> dict:
    """Round trips of empty step messages: the transport + servicer floor under every step."""
    stream, _ = open_stream(client, vocab_size)
    rtt, server = [], []
    try:
        for i in range(warmup + steps):
            start = time.perf_counter()
            await stream.write([])
            resp = await stream.read()
            if i >= warmup:
                rtt.append(time.perf_counter() - start)
                server.append(resp.server_duration_seconds)
        await stream.close()
    finally:
        stream.cancel()
    return {"rtt": rtt, "server": server}


@dataclass
class SessionRecord:
    grammar: int  # index into the walk's grammar list
    tokens: list[int] = field(default_factory=list)
    end: str = "open"  # terminated, truncated, error, open (still running when the run ended)


@dataclass
class WalkRun:
    batch: int
    steps: int
    sessions: list[SessionRecord] = field(default_factory=list)
    # Per step (measured steps only).
    rtt: list[float] = field(default_factory=list)
    server: list[float] = field(default_factory=list)
    fill: list[float] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)
    response_bytes: list[int] = field(default_factory=list)
    request_bytes: list[int] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    # Per mask row (measured steps only), parallel lists.
    row_step: list[int] = field(default_factory=list)
    row_session: list[int] = field(default_factory=list)
    row_position: list[int] = field(default_factory=list)
    row_bytes: list[int] = field(default_factory=list)
    row_encoding: list[str] = field(default_factory=list)
    row_hash: list[int] = field(default_factory=list)
    statuses: dict = field(default_factory=dict)


@dataclass
class _Slot:
    session_id: int
    record: int
    opened: bool = False
    pending: int | None = None


async def walk_phase(client: GrammarClient, grammar_ids: list[str], vocab_size: int, batch: int, steps: int,
                     warmup: int, max_session_tokens: int, seed: int, progress_every: int = 100,
                     mask_cache_slots: int | None = None) -> WalkRun:
    rng = np.random.default_rng(seed)
    run = WalkRun(batch=batch, steps=steps)
    bitmask = np.zeros((batch, words_for_vocab(vocab_size)), dtype=np.int32)
    next_id = 1

    def new_slot() -> _Slot:
        nonlocal next_id
        run.sessions.append(SessionRecord(grammar=int(rng.integers(len(grammar_ids)))))
        slot = _Slot(session_id=next_id, record=len(run.sessions) - 1)
        next_id += 1
        return slot

    slots = [new_slot() for _ in range(batch)]
    to_close: list[int] = []
    stream, decoder = open_stream(client, vocab_size, mask_cache_slots)
    t0 = time.perf_counter()
    try:
        for step in range(warmup + steps):
            measured = step >= warmup
            msgs = []
            for s in slots:
                rec = run.sessions[s.record]
                if not s.opened:
                    msgs.append(pb.SessionStep(session_id=s.session_id,
                                               open=pb.OpenSession(grammar_id=grammar_ids[rec.grammar])))
                    s.opened = True
                else:
                    msgs.append(pb.SessionStep(session_id=s.session_id, accept_token_ids=[s.pending]))
                    rec.tokens.append(s.pending)
            msgs.extend(pb.SessionStep(session_id=sid, close=True) for sid in to_close)
            to_close = []
            start = time.perf_counter()
            await stream.write(msgs)
            resp = await stream.read()
            rtt = time.perf_counter() - start
            dstart = time.perf_counter()
            decode_masks(resp, decoder, bitmask)
            decode_seconds = time.perf_counter() - dstart
            n_masks = 0
            for i, s in enumerate(slots):
                r = resp.results[i]
                rec = run.sessions[s.record]
                status = pb.SessionStatus.Name(r.status)
                run.statuses[status] = run.statuses.get(status, 0) + 1
                field_name = r.mask.WhichOneof("encoding")
                if r.status == pb.SESSION_STATUS_OK and field_name is not None:
                    n_masks += 1
                    row = bitmask[i]
                    if measured:
                        run.row_step.append(step - warmup)
                        run.row_session.append(s.record)
                        run.row_position.append(len(rec.tokens))
                        run.row_bytes.append(r.mask.ByteSize())
                        run.row_encoding.append(field_name)
                        run.row_hash.append(hash(row.tobytes()))
                    if len(rec.tokens) >= max_session_tokens:
                        rec.end = "truncated"
                    else:
                        tok = sample_allowed(row, rng)
                        if tok is None:
                            rec.end = "error"
                        else:
                            s.pending = tok
                            continue
                elif r.status == pb.SESSION_STATUS_TERMINATED:
                    rec.end = "terminated"
                else:
                    rec.end = "error"
                # Session over: close it with the next message, refill the slot.
                to_close.append(s.session_id)
                slots[i] = new_slot()
            if measured:
                run.rtt.append(rtt)
                run.server.append(resp.server_duration_seconds)
                run.fill.append(resp.fill_duration_seconds)
                run.masks.append(n_masks)
                run.response_bytes.append(resp.ByteSize())
                run.request_bytes.append(sum(m.ByteSize() for m in msgs))
                run.decode.append(decode_seconds)
            if (step + 1) % progress_every == 0:
                progress(f"walks batch={batch}: step {step + 1}/{warmup + steps}, "
                         f"{len(run.sessions)} sessions, {time.perf_counter() - t0:.0f} s")
        # Close whatever is still open (not measured).
        closes = [pb.SessionStep(session_id=s.session_id, close=True) for s in slots] + \
                 [pb.SessionStep(session_id=sid, close=True) for sid in to_close]
        await stream.write(closes)
        await stream.read()
        await stream.close()
    finally:
        stream.cancel()
    return run
