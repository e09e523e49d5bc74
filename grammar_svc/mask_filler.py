"""Fills and encodes one step's masks.

Measured with the 129k tokenizer on 2 cores: a typical row fills in ~4 µs,
so handing rows to threads costs more than it saves (xgrammar's own
BatchGrammarMatcher with 2 threads took 7x longer than a plain loop for 32
cheap rows). Rows are therefore filled in a loop on the step's thread, and
only rows whose previous fill was slow (bounded strings take milliseconds)
go to helper threads first, where they run in parallel with the loop
(xgrammar releases the GIL while filling). Every row is timed for the
mask-fill histogram; rows the client has cached or that repeat an earlier
row of the step are not encoded at all, and rows encoded recently are not
encoded again (_EncodeMemo).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xgrammar as xgr

from grammar_svc.session import GrammarSession
from shared.codec import EncodedMask, FilledRow, MaskEncoder, StreamMaskCache

# A row whose last fill took longer than this is filled on a helper thread.
SLOW_ROW_SECONDS = 250e-6
# Encodings remembered across steps and streams (each key is a row: 16 KB at 129k tokens, so 8 MB).
ENCODE_MEMO_ENTRIES = 512


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


class MaskFiller:
    def __init__(self, threads: int):
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="structd-fill")
        self._encoders: dict[int, MaskEncoder] = {}
        self._buffers = _Buffers()
        self._memo = _EncodeMemo(ENCODE_MEMO_ENTRIES)

    def encoder(self, vocab_size: int) -> MaskEncoder:
        enc = self._encoders.get(vocab_size)
        if enc is None:
            enc = self._encoders.setdefault(vocab_size, MaskEncoder(vocab_size))
        return enc

    def fill(self, rows: list[tuple[int, GrammarSession]], cache: StreamMaskCache | None = None) -> list[FilledRow]:
        """(result index, session) pairs -> their filled rows, in input order (a row the client has
        cached is not encoded)."""
        if not rows:
            return []
        vocab = rows[0][1].vocab_size
        if any(s.vocab_size != vocab for _, s in rows):
            # Sessions of several tokenizers on one stream: one pass per vocabulary.
            by_vocab: dict[int, list] = {}
            for r in rows:
                by_vocab.setdefault(r[1].vocab_size, []).append(r)
            out = [x for group in by_vocab.values() for x in self.fill(group, cache)]
            out.sort(key=lambda r: r.index)
            return out
        encoder = self.encoder(vocab)
        tensor, array = self._buffers.get(vocab, len(rows))
        slow = [self._pool.submit(s.fill, tensor, pos)
                for pos, (_, s) in enumerate(rows) if s.last_fill_seconds > SLOW_ROW_SECONDS]
        if slow:
            fast = [(pos, s) for pos, (_, s) in enumerate(rows) if s.last_fill_seconds <= SLOW_ROW_SECONDS]
        else:
            fast = [(pos, s) for pos, (_, s) in enumerate(rows)]
        for pos, s in fast:
            s.fill(tensor, pos)
        for f in slow:
            f.result()
        words = array[: len(rows)].view(np.uint32)
        if encoder.padding:
            # Padding bits sit in the last word only: cleared in place (this thread's buffer, refilled
            # every step) instead of masking a copy of every row.
            words[:, -1] &= encoder.valid[-1]
        out = []
        seen: set[bytes] = set()
        for pos, (index, session) in enumerate(rows):
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
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
