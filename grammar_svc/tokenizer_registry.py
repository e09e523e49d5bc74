"""Tokenizers this replica has been given, by fingerprint.

The grammar tier has no model files: inference replicas send their tokenizer
(xgrammar TokenizerInfo JSON, optionally the HF tokenizer.json for
jump-forward) in the handshake, and everything else refers to it by the
SHA-256 fingerprint of the TokenizerInfo JSON.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequestError, LimitExceededError, NotFoundError, UnknownTokenizerError
from shared.tokenizer import fingerprint as fingerprint_of

# A 129k-token TokenizerInfo is 4.4 MB of JSON; allow generous headroom.
MAX_TOKENIZER_JSON_BYTES = 64 << 20
MAX_TOKENIZERS = 16


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


def _inflate(data: bytes, what: str) -> str:
    try:
        d = zlib.decompressobj()
        raw = d.decompress(data, MAX_TOKENIZER_JSON_BYTES)
        if d.unconsumed_tail:
            raise LimitExceededError(f"{what} is larger than {MAX_TOKENIZER_JSON_BYTES} bytes uncompressed")
        return raw.decode("utf-8")
    except zlib.error as e:
        raise InvalidRequestError(f"{what} is not zlib-compressed data: {e}") from None
    except UnicodeDecodeError:
        raise InvalidRequestError(f"{what} is not UTF-8 text") from None


class TokenizerRegistry:
    def __init__(self):
        self._by_fp: dict[str, RegisteredTokenizer] = {}
        self._lock = threading.Lock()

    def get(self, fingerprint: str) -> RegisteredTokenizer:
        tok = self._by_fp.get(fingerprint)
        if tok is None:
            raise UnknownTokenizerError(
                f"tokenizer {fingerprint[:16] or '(empty)'}... is not registered on this replica; "
                "call RegisterTokenizer first"
            )
        return tok

    def worker_payloads(self) -> list[tuple[str, str]]:
        """(fingerprint, TokenizerInfo JSON) of every tokenizer, for new compile workers."""
        with self._lock:
            return [(t.fingerprint, t.info_json) for t in self._by_fp.values()]

    def __contains__(self, fingerprint: str) -> bool:
        return fingerprint in self._by_fp

    def register(self, fingerprint: str, info_zlib: bytes, hf_zlib: bytes) -> tuple[RegisteredTokenizer, bool]:
        """Returns (tokenizer, already_registered). Blocking: call off the event loop."""
        known = self._by_fp.get(fingerprint)
        if known is not None:
            return known, True
        if not info_zlib:
            raise NotFoundError(f"tokenizer {fingerprint[:16]}... is not registered; send tokenizer_info_json_zlib")
        if len(self._by_fp) >= MAX_TOKENIZERS:
            raise LimitExceededError(f"this replica already holds {MAX_TOKENIZERS} tokenizers")
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
            existing = self._by_fp.setdefault(actual, tok)
        return existing, existing is not tok
