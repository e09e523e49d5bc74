"""Fills and encodes one step's masks.

A typical row fills in microseconds, so handing rows to threads costs more
than it saves: xgrammar's own BatchGrammarMatcher with two threads took
several times longer than a plain loop for the same cheap rows; two threads
of our own filling fast rows one by one hand the GIL, which every fill
releases, back and forth after each row and were slower than one; and one
batch call per thread did not beat the loop in the server
(docs/benchmarks.md, "The grammar replica's step at 32 sessions", and "Host
path at simulated steps", "The replica's own step, in isolation"). Rows are
therefore filled in a loop on the step's thread, and
only rows whose previous fill was slow (bounded strings take milliseconds)
go to helper threads first, where they run in parallel with the loop
(xgrammar releases the GIL while filling). A session's first fill goes
there too when nothing is known of it: a replayed session starts deep in
its document, and a grammar seen for the first time may start slow. A new
session of a grammar whose start state filled fast last time fills in the
loop (handing it to a thread and collecting it cost more than the row:
docs/benchmarks.md, "Host path at simulated steps", item 4).

A fill cannot be interrupted, and a few grammar states take seconds (a
long `pattern` string in a large schema). Rows on helper threads fill into
buffers of their own, and one that has been filling for longer than
--max-row-fill-seconds (counted from its own start) comes back late: its
session fails alone (RESOURCE_EXHAUSTED), the step answers for everyone
else, and the stuck thread is left to finish into its own buffer while a
fresh pool takes the rows queued behind it and the next steps. Every row is timed for the
mask-fill histogram; rows the client has cached or that repeat an earlier
row of the step are not encoded at all, and rows encoded recently are not
encoded again (_EncodeMemo).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import xgrammar as xgr

from grammar_svc.step.session import MatcherSession
from shared.codec import EncodedMask, FilledRow, MaskEncoder, StreamMaskCache

# A row whose last fill took longer than this is filled on a helper thread.
SLOW_ROW_SECONDS = 250e-6
# Encodings remembered across steps and streams (each key is a row: 16 KB at 129k tokens, so 8 MB).
ENCODE_MEMO_ENTRIES = 512
# Grammars whose start-state fill time is remembered (the table starts over when full).
START_FILL_ENTRIES = 4096


class _EncodeMemo:
    """Recently encoded rows -> their wire form.

    Encoding (popcount, id extraction, varints) costs far more than xgrammar's
    fill of a typical row, and the same masks recur: within a step (the rows
    that become same_as references) and across steps and streams (every JSON
    string interior, every separator). The stream mask cache only spares rows
    the client stored, and only large ones.
    """

    def __init__(self, entries: int):
        self._entries = entries
        self._memo: OrderedDict[tuple[int, bytes], EncodedMask] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, key: bytes, row, encoder: MaskEncoder) -> EncodedMask:
        memo_key = (encoder.vocab_size, key)
        with self._lock:
            enc = self._memo.get(memo_key)
            if enc is not None:
                self._memo.move_to_end(memo_key)
                return enc
        enc = encoder.encode_row(row)
        with self._lock:
            self._memo[memo_key] = enc
            if len(self._memo) > self._entries:
                self._memo.popitem(last=False)
        return enc


class _ThreadedRow:
    """One row filled on a helper thread into a bitmask of its own (a late fill must not write into a buffer
    a later step uses), with the time its fill started."""

    __slots__ = ("session", "vocab_size", "started", "future")

    def __init__(self, session: MatcherSession, vocab_size: int):
        self.session = session
        self.vocab_size = vocab_size
        self.started: float | None = None
        self.future = None

    def run(self):
        self.started = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self.session.fill(bitmask, 0)
        return bitmask


class _Buffers(threading.local):
    """Per-thread batch bitmasks (torch, as xgrammar wants) and their numpy views."""

    def get(self, vocab_size: int, rows: int):
        bufs = self.__dict__.setdefault("bufs", {})
        pair = bufs.get(vocab_size)
        if pair is None or pair[0].shape[0] < rows:
            t = xgr.allocate_token_bitmask(max(rows, 64), vocab_size)
            pair = (t, t.numpy())
            bufs[vocab_size] = pair
        return pair


@dataclass(frozen=True, slots=True)
class LateRow:
    """A row whose fill outlived the step's budget (still running on its abandoned thread)."""

    index: int
    session: MatcherSession
    fill_seconds: float  # how long it had been filling when it was given up
    position: int  # its place among the rows passed to fill()


class MaskFiller:
    def __init__(self, threads: int, max_row_fill_seconds: float = 1.0):
        self.threads = threads
        self.max_row_fill_seconds = max_row_fill_seconds
        self._pool = self._new_pool()
        self._encoders: dict[int, MaskEncoder] = {}
        self._buffers = _Buffers()
        self._memo = _EncodeMemo(ENCODE_MEMO_ENTRIES)
        # Grammar id -> how long a new session's first fill (its start state) took last time.
        self._start_fills: dict[str, float] = {}

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=max(1, self.threads), thread_name_prefix="structd-fill")

    def _submit(self, session: MatcherSession, vocab_size: int) -> _ThreadedRow:
        row = _ThreadedRow(session, vocab_size)
        try:
            row.future = self._pool.submit(row.run)
        except RuntimeError:  # another stream's late row has just retired this pool: take the new one
            row.future = self._pool.submit(row.run)
        return row

    def _collect(self, threaded: dict[int, _ThreadedRow], rows, tensor) -> list[LateRow]:
        """Copies the threaded rows into the step's buffer as they finish; a row that has been filling
        for longer than the budget (counted from its own start: a row queued behind others is not late)
        is given up, and the rows queued behind it move to a fresh pool."""
        late: list[LateRow] = []
        pending = dict(threaded)
        budget = self.max_row_fill_seconds
        while pending:
            now = time.perf_counter()
            running = [r.started for r in pending.values() if r.started is not None]
            timeout = max(1e-3, min(running) + budget - now) if running else budget
            wait([r.future for r in pending.values()], timeout=timeout, return_when=FIRST_COMPLETED)
            now = time.perf_counter()
            stuck = []
            for pos, r in list(pending.items()):
                if r.future.done():
                    tensor[pos].copy_(r.future.result()[0])
                    del pending[pos]
                elif r.started is not None and now - r.started > budget:
                    # This session's grammar state: its fill outlived the budget (it cannot be stopped).
                    stuck.append(pos)
            if stuck:
                for pos in stuck:
                    late.append(LateRow(rows[pos][0], rows[pos][1], now - pending.pop(pos).started, pos))
                # The stuck threads keep their pool busy until their fills end: the rows queued behind them
                # and the next steps get a new pool.
                retired, self._pool = self._pool, self._new_pool()
                for pos, r in list(pending.items()):
                    if r.future.cancel():
                        pending[pos] = self._submit(r.session, r.vocab_size)
                retired.shutdown(wait=False)
        return late

    def _slow(self, s: MatcherSession) -> bool:
        """Whether a row is expected to be slow, and so goes to a helper thread."""
        if not s.never_filled:
            return s.last_fill_seconds > SLOW_ROW_SECONDS
        if s.num_accepted:
            return True  # a replay: its first fill is deep in its document
        known = self._start_fills.get(s.entry.grammar_id)
        return known is None or known > SLOW_ROW_SECONDS

    def _note_start_fills(self, rows, starts: list[int], late_pos: set[int]) -> None:
        if len(self._start_fills) >= START_FILL_ENTRIES:
            self._start_fills = {}
        for pos in starts:
            s = rows[pos][1]
            # A start that outlived the row budget stays on helper threads for good.
            self._start_fills[s.entry.grammar_id] = self.max_row_fill_seconds if pos in late_pos else s.last_fill_seconds

    def encoder(self, vocab_size: int) -> MaskEncoder:
        enc = self._encoders.get(vocab_size)
        if enc is None:
            enc = self._encoders.setdefault(vocab_size, MaskEncoder(vocab_size))
        return enc

    def fill(self, rows: list[tuple[int, MatcherSession]],
             cache: StreamMaskCache | None = None) -> tuple[list[FilledRow], list[LateRow]]:
        """(result index, session) pairs -> their filled rows, in input order (a row the client has
        cached is not encoded), and the rows that did not fill within --max-row-fill-seconds."""
        if not rows:
            return [], []
        vocab = rows[0][1].vocab_size
        if any(s.vocab_size != vocab for _, s in rows):
            # Sessions of several tokenizers on one stream: one pass per vocabulary.
            by_vocab: dict[int, list] = {}
            for r in rows:
                by_vocab.setdefault(r[1].vocab_size, []).append(r)
            out, late = [], []
            for group in by_vocab.values():
                filled, group_late = self.fill(group, cache)
                out += filled
                late += group_late
            out.sort(key=lambda r: r.index)
            return out, late
        encoder = self.encoder(vocab)
        tensor, array = self._buffers.get(vocab, len(rows))
        starts = [pos for pos, (_, s) in enumerate(rows) if s.never_filled and not s.num_accepted]
        threaded = {pos: self._submit(s, vocab) for pos, (_, s) in enumerate(rows) if self._slow(s)}
        for pos, (_, s) in enumerate(rows):
            if pos not in threaded:
                s.fill(tensor, pos)
        late = self._collect(threaded, rows, tensor)
        late_pos = {row.position for row in late}
        if starts:
            self._note_start_fills(rows, starts, late_pos)
        words = array[: len(rows)].view(np.uint32)
        if encoder.padding:
            # Padding bits sit in the last word only: cleared in place (this thread's buffer, refilled
            # every step) instead of masking a copy of every row.
            words[:, -1] &= encoder.valid[-1]
        out = []
        seen: set[bytes] = set()
        for pos, (index, session) in enumerate(rows):
            if pos in late_pos:
                continue
            row = words[pos]
            key = row.tobytes()
            # A row equal to an earlier one of this step goes out as a same_as reference
            # (assign_wire_forms), and one the client has cached as its slot: neither needs an encoding.
            # The stream cache is only read here (writes happen afterwards, under the same stream lock).
            if key in seen or (cache is not None and cache.lookup(key) is not None):
                enc = None
            else:
                seen.add(key)
                enc = self._memo.encode(key, row, encoder)
            out.append(FilledRow(index, key, enc, encoder, session.last_fill_seconds))
        return out, late

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
