"""Fills and encodes one step's masks in parallel threads.

xgrammar releases the GIL while filling, so plain threads run rows in
parallel. Rows are dealt to threads longest-first by each session's last fill
time (LPT scheduling): a slow row (a bounded string can take milliseconds)
starts at once on its own thread instead of queueing behind fast ones. Each
row is timed individually for the mask-fill histogram and encoded to its wire
form on the thread that filled it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xgrammar as xgr

from grammar_svc.session import GrammarSession
from shared.codec import EncodedMask, MaskEncoder


class _Buffers(threading.local):
    """Per-thread bitmask buffers, one per vocabulary size, grown on demand."""

    def get(self, vocab_size: int, rows: int):
        bufs = self.__dict__.setdefault("bufs", {})
        buf = bufs.get(vocab_size)
        if buf is None or buf.shape[0] < rows:
            buf = xgr.allocate_token_bitmask(max(rows, 8), vocab_size)
            bufs[vocab_size] = buf
        return buf


class MaskFiller:
    def __init__(self, threads: int):
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads - 1), thread_name_prefix="structd-fill")
        self._encoders: dict[int, MaskEncoder] = {}
        self._buffers = _Buffers()

    def encoder(self, vocab_size: int) -> MaskEncoder:
        enc = self._encoders.get(vocab_size)
        if enc is None:
            enc = self._encoders.setdefault(vocab_size, MaskEncoder(vocab_size))
        return enc

    def _fill_chunk(self, chunk: list[tuple[int, GrammarSession]]):
        out = []
        for index, session in chunk:
            vocab = session.vocab_size
            buf = self._buffers.get(vocab, 1)
            session.fill(buf, 0)
            row = buf[0].numpy()
            enc = self.encoder(vocab).encode_row(row)
            out.append((index, enc, row.tobytes(), session.last_fill_seconds))
        return out

    def fill(self, rows: list[tuple[int, GrammarSession]]) -> list[tuple[int, EncodedMask, bytes, float]]:
        """(result index, session) pairs -> (result index, encoding, row bytes, fill seconds), in input order."""
        if not rows:
            return []
        n_chunks = min(self.threads, len(rows))
        if n_chunks == 1:
            return self._fill_chunk(rows)
        chunks: list[list] = [[] for _ in range(n_chunks)]
        loads = np.zeros(n_chunks)
        # Longest first onto the least-loaded chunk; unknown costs count as small.
        for item in sorted(rows, key=lambda r: r[1].last_fill_seconds, reverse=True):
            k = int(loads.argmin())
            chunks[k].append(item)
            loads[k] += item[1].last_fill_seconds + 1e-6
        futures = [self._pool.submit(self._fill_chunk, c) for c in chunks[1:]]
        results = self._fill_chunk(chunks[0])
        for f in futures:
            results.extend(f.result())
        results.sort(key=lambda r: r[0])
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
