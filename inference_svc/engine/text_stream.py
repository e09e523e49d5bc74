"""Incremental detokenization for streamed responses: whole UTF-8 characters only, stop strings cut.

A byte-level BPE token can end in the middle of a character (an emoji is often
split over two or three tokens), so decoding token by token would emit U+FFFD
and then the character. `TextStream` appends each token's raw bytes to an
incremental UTF-8 decoder, which holds an incomplete trailing character until
its last byte arrives. With stop strings it also holds back the tail that could
still grow into one, so no delta ever contains part of a stop string (unless
`include_stop`, vLLM's include_stop_str_in_output: then the matched one ends
the text).

For this tokenizer the concatenated deltas equal `tokenizer.decode(ids,
skip_special_tokens=True)` (cut before the first stop string when one matches).
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    stopped: bool  # a stop string matched; `text` ends just before it (include_stop: with it); the stream is done


class TextStream:
    """One response's text: push the sampled token ids, send each returned delta."""

    def __init__(self, token_bytes: Sequence[bytes], skip_token_ids: Collection[int], stop: Sequence[str], *,
                 include_stop: bool = False):
        self._token_bytes = token_bytes
        self._include_stop = include_stop
        self._skip = skip_token_ids
        self._stop = tuple(stop)
        # Every proper prefix of a stop string: the tails worth holding back.
        self._prefixes = {s[:n] for s in self._stop for n in range(1, len(s))}
        self._longest_prefix = max((len(p) for p in self._prefixes), default=0)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded, not yet returned: may be the start of a stop string
        # The first `_floor` characters of `_held` were pushed with match_stop=False: no match may end there.
        self._floor = 0
        self._parts: list[str] = []
        self._stopped = False
        self._finished = False

    @property
    def text(self) -> str:
        """All text returned so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, token_ids: Iterable[int], *, match_stop: bool = True) -> Delta:
        """The text these tokens complete. match_stop=False: a stop string ending in them is not matched
        (a tail that may still grow into one is held back all the same)."""
        if self._stopped or self._finished:
            why = "matched a stop string" if self._stopped else "finished"
            raise ValueError(f"push() after the stream {why}")
        data = b"".join(self._token_bytes[t] for t in token_ids if t not in self._skip)
        return self._emit(self._decoder.decode(data), final=False, match_stop=match_stop)

    def finish(self) -> str:
        """The rest of the text at the end of generation; an incomplete trailing character becomes U+FFFD.

        After a stop string (or a previous finish) there is nothing left: returns "".
        """
        if self._stopped or self._finished:
            return ""
        self._finished = True
        return self._emit(self._decoder.decode(b"", final=True), final=True).text

    def _emit(self, new: str, *, final: bool, match_stop: bool = True) -> Delta:
        if not self._stop:
            return self._out(new, stopped=False)
        buf = self._held + new
        floor = self._floor if match_stop else len(buf)
        cut, end = self._first_match(buf, floor)
        if cut >= 0:
            self._held = ""
            self._stopped = True
            return self._out(buf[:end if self._include_stop else cut], stopped=True)
        keep = 0 if final else self._held_back(buf)
        self._held = buf[len(buf) - keep :]
        self._floor = max(0, floor - (len(buf) - keep))
        return self._out(buf[: len(buf) - keep], stopped=False)

    def _first_match(self, buf: str, floor: int) -> tuple[int, int]:
        """Where the stop string that ends first in `buf`, past `floor`, starts (the longest on a tie) and
        ends, or (-1, -1).

        By end, not start, so that the cut does not depend on how text is split into
        pushes: with stops "abcd" and "bc", "abc" has already stopped at "bc". A match still
        to complete starts in `_held` or later, and `_held` holds no whole stop string that
        may match, so a match found here is the first in the whole text. Matches ending at
        or before `floor` lie in text pushed while matching was off (before min_tokens).
        """
        found = []
        for s in self._stop:
            i = buf.find(s)
            while 0 <= i and i + len(s) <= floor:
                i = buf.find(s, i + 1)
            if i >= 0:
                found.append((i + len(s), i))
        if not found:
            return -1, -1
        end, start = min(found)
        return start, end

    def _held_back(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._longest_prefix), 0, -1):
            if buf[-n:] in self._prefixes:
                return n
        return 0

    def _out(self, text: str, *, stopped: bool) -> Delta:
        if text:
            self._parts.append(text)
        return Delta(text, stopped)


@functools.lru_cache(maxsize=4)
def token_bytes_for(tokenizer, info_json: str | None = None) -> tuple[bytes, ...]:
    """Raw bytes of every token id (as xgrammar decodes them), for `TextStream`.

    A tuple: the result is cached and shared by every stream. info_json: xgrammar's serialized description of
    this tokenizer (the grammar handshake's), read instead of describing the vocabulary again where it covers
    every id (a model's padded vocabulary does; its padding is cut off).
    """
    import xgrammar as xgr

    n = len(tokenizer)
    info = xgr.TokenizerInfo.deserialize_json(info_json) if info_json is not None else None
    if info is None or info.vocab_size < n:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=n)
    # decoded_vocab mixes bytes with a bytes subclass from xgrammar's FFI; plain bytes join faster.
    return tuple(bytes(b) for b in info.decoded_vocab[:n])


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops.

    Not just `all_special_ids`: the DeepSeek tokenizer names only bos/eos there
    but marks 1,230 added tokens (pad, placeholders, ...) special, and decode skips them all.
    """
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
