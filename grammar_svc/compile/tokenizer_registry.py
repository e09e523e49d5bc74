"""Tokenizers this replica has been given, by fingerprint.

The grammar tier has no model files: inference replicas send their tokenizer
(xgrammar TokenizerInfo JSON, optionally the HF tokenizer.json for
jump-forward) in the handshake, and everything else refers to it by the
SHA-256 fingerprint of the TokenizerInfo JSON.

The registry holds at most `max_tokenizers` (--max-tokenizers). A new one
evicts the least recently used tokenizer that nothing uses (no live session,
no compile in flight: `in_use` says which are); when every slot is in use the
registration is refused, so one caller cannot pin the replica's memory with
tokenizers nor take a tokenizer from under another caller's sessions.
"""

from __future__ import annotations

import collections
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from shared.errors import (InvalidRequestError, LimitExceededError, NotFoundError, RequestTooLargeError,
                           UnknownTokenizerError)
from shared.tokenizer import fingerprint as fingerprint_of

# A 129k-token TokenizerInfo is 4.4 MB of JSON; allow generous headroom.
MAX_TOKENIZER_JSON_BYTES = 64 << 20
# (last token, forced string) pairs remembered per tokenizer; the memo starts over when full.
MEMO_ENTRIES = 8192


class TokenizersFullError(LimitExceededError):
    """Every tokenizer slot is in use (RESOURCE_EXHAUSTED, like any limit; its own class so it is counted)."""


class ForcedTokensMemo:
    """(last token, forced string) -> (forced text, token ids), for one tokenizer (step/jump_forward.py's).

    Steps of different streams run on different threads: the dict is only
    read, or replaced whole under a lock, so a reader never sees it half
    cleared. Entries are never mutated (callers get a copy of the ids).
    """

    __slots__ = ("_entries", "_lock", "_max")

    def __init__(self, max_entries: int = MEMO_ENTRIES):
        self._entries: dict[tuple[int | None, str], tuple[str, tuple[int, ...]]] = {}
        self._lock = threading.Lock()
        self._max = max_entries

    def get(self, key: tuple[int | None, str]) -> tuple[str, tuple[int, ...]] | None:
        return self._entries.get(key)

    def put(self, key: tuple[int | None, str], value: tuple[str, tuple[int, ...]]) -> None:
        with self._lock:
            if len(self._entries) >= self._max:
                self._entries = {}
            self._entries[key] = value

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class RegisteredTokenizer:
    fingerprint: str
    info_json: str
    info: Any  # xgrammar.TokenizerInfo
    vocab_size: int
    # tokenizers.Tokenizer for canonical jump-forward tokenization, or None.
    hf_tokenizer: Any
    # Raw bytes of every token, for token-boundary checks.
    token_bytes: tuple[bytes, ...]
    # Jump-forward tokenizations already worked out for this tokenizer.
    forced_memo: ForcedTokensMemo = field(default_factory=ForcedTokensMemo, compare=False, repr=False)
    # llguidance's LLTokenizer for this tokenizer, built on the first llguidance grammar (llguidance_backend.py).
    llguidance: dict = field(default_factory=dict, compare=False, repr=False)


def _inflate(data: bytes, what: str) -> str:
    try:
        d = zlib.decompressobj()
        raw = d.decompress(data, MAX_TOKENIZER_JSON_BYTES)
        if d.unconsumed_tail:
            raise RequestTooLargeError(f"{what} is larger than {MAX_TOKENIZER_JSON_BYTES} bytes uncompressed")
        return raw.decode("utf-8")
    except zlib.error as e:
        raise InvalidRequestError(f"{what} is not zlib-compressed data: {e}") from None
    except UnicodeDecodeError:
        raise InvalidRequestError(f"{what} is not UTF-8 text") from None


class TokenizerRegistry:
    """Registered tokenizers in least-recently-used order (oldest first)."""

    def __init__(self, max_tokenizers: int = 16, in_use: Callable[[], set[str]] = set):
        self.max_tokenizers = max_tokenizers
        # Fingerprints of the tokenizers a live session or a compile in flight uses (never evicted).
        self.in_use = in_use
        self._by_fp: collections.OrderedDict[str, RegisteredTokenizer] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_fp)

    def get(self, fingerprint: str) -> RegisteredTokenizer:
        with self._lock:
            tok = self._by_fp.get(fingerprint)
            if tok is not None:
                self._by_fp.move_to_end(fingerprint)
        if tok is None:
            raise UnknownTokenizerError(
                f"tokenizer {fingerprint[:16] or '(empty)'}... is not registered on this replica "
                "(or was evicted while unused); call RegisterTokenizer first"
            )
        return tok

    def worker_payloads(self) -> list[tuple[str, str]]:
        """(fingerprint, TokenizerInfo JSON) of every tokenizer, for new compile workers."""
        with self._lock:
            return [(t.fingerprint, t.info_json) for t in self._by_fp.values()]

    def __contains__(self, fingerprint: str) -> bool:
        return fingerprint in self._by_fp

    def register(self, fingerprint: str, info_zlib: bytes,
                 hf_zlib: bytes) -> tuple[RegisteredTokenizer, bool, list[str]]:
        """Returns (tokenizer, already_registered, fingerprints evicted to make room).
        Blocking: call off the event loop."""
        if fingerprint in self._by_fp:
            return self.get(fingerprint), True, []
        if not info_zlib:
            raise NotFoundError(f"tokenizer {fingerprint[:16]}... is not registered; send tokenizer_info_json_zlib")
        # Checked before the expensive parse too, so a full replica refuses cheaply.
        with self._lock:
            self._victims(1)
        info_json = _inflate(info_zlib, "tokenizer_info_json_zlib")
        actual = fingerprint_of(info_json)
        if fingerprint and fingerprint != actual:
            raise InvalidRequestError(
                f"tokenizer_fingerprint {fingerprint[:16]}... does not match the SHA-256 of the tokenizer info ({actual[:16]}...)"
            )
        import xgrammar as xgr

        try:
            info = xgr.TokenizerInfo.deserialize_json(info_json)
        except Exception as e:  # noqa: BLE001 - any parse failure is the client's input
            raise InvalidRequestError(f"tokenizer_info_json_zlib is not an xgrammar TokenizerInfo: {e}") from None
        hf = None
        if hf_zlib:
            from tokenizers import Tokenizer

            try:
                hf = Tokenizer.from_str(_inflate(hf_zlib, "hf_tokenizer_json_zlib"))
            except Exception as e:  # noqa: BLE001
                raise InvalidRequestError(f"hf_tokenizer_json_zlib is not a tokenizer.json: {e}") from None
        token_bytes = tuple(bytes(b) for b in info.decoded_vocab)
        tok = RegisteredTokenizer(actual, info_json, info, info.vocab_size, hf, token_bytes)
        with self._lock:
            existing = self._by_fp.get(actual)
            if existing is not None:
                self._by_fp.move_to_end(actual)
                return existing, True, []
            evicted = self._victims(1)
            for fp in evicted:
                del self._by_fp[fp]
            self._by_fp[actual] = tok
        return tok, False, evicted

    def _victims(self, room: int) -> list[str]:
        """The least recently used unused tokenizers to evict so `room` more fit; RESOURCE_EXHAUSTED
        when too many are in use."""
        excess = len(self._by_fp) + room - self.max_tokenizers
        if excess <= 0:
            return []
        busy = self.in_use()
        idle = [fp for fp in self._by_fp if fp not in busy]
        if len(idle) < excess:
            raise TokenizersFullError(
                f"this grammar replica holds its limit of {self.max_tokenizers} tokenizers (--max-tokenizers) "
                f"and {len(self._by_fp) - len(idle)} of them are in use by live sessions or compiles; "
                "retry when sessions have closed, or raise --max-tokenizers")
        return idle[:excess]
