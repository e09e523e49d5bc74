"""The tokenizer description kept on disk (shared/tokenizer.py): what a later process reads is what it would have
built, a damaged file is built again, and every input of the description names its own file.

A tiny byte-level tokenizer keeps each build at milliseconds; the services' tests use the real one through the
same cache (the inference service and the session's `tokenizer_desc`).
"""

from __future__ import annotations

import itertools
import logging

import pytest

from shared import tokenizer as shared_tokenizer
from shared.tokenizer import describe

_views = itertools.count()


def tiny_tokenizer(eos: str = "<eos>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<eos>": len(vocab), "<end>": len(vocab) + 1})
    tk = Tokenizer(models.BPE(vocab, []))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=eos)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def view(cache):
    """Another path to the same cache folder: describe() remembers what it described per path, as a process
    does, so a new path reads the folder as a later process would."""
    link = cache.parent / f"{cache.name}-view-{next(_views)}"
    link.symlink_to(cache, target_is_directory=True)
    return link


def no_build(monkeypatch):
    import xgrammar as xgr

    def refuse(*args, **kwargs):
        raise AssertionError("described again instead of read from the cache")

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", refuse)


def test_a_description_read_from_the_cache_is_the_one_built(tok, tmp_path, monkeypatch):
    cache = tmp_path / "tokenizers"
    built = describe(tok, len(tok), cache_dir=cache)
    [file] = cache.iterdir()
    no_build(monkeypatch)
    read = describe(tok, len(tok), cache_dir=view(cache))
    assert read is not built and read == built
    assert (read.fingerprint, read.vocab_size) == (shared_tokenizer.fingerprint(built.info_json), len(tok))
    assert read.compressed_info() == built.compressed_info() and read.compressed_hf() == built.compressed_hf()
    assert read.hf_tokenizer_json == tok.backend_tokenizer.to_str()
    assert list(cache.iterdir()) == [file]


@pytest.mark.parametrize("damage", [
    pytest.param(lambda data: data[:-10], id="truncated"),
    pytest.param(lambda data: b"not a description\n" + data, id="foreign"),
    pytest.param(lambda data: data.replace(b'"vocab_size"', b'"vocab_sizes"', 1), id="header"),
    pytest.param(lambda data: data[:200] + bytes(64) + data[264:], id="corrupt-stream"),
])
def test_a_damaged_file_is_described_again_and_rewritten(tok, tmp_path, damage, caplog):
    cache = tmp_path / "tokenizers"
    built = describe(tok, len(tok), cache_dir=cache)
    [file] = cache.iterdir()
    whole = file.read_bytes()
    file.write_bytes(damage(whole))
    with caplog.at_level(logging.WARNING, logger="shared.tokenizer"):
        again = describe(tok, len(tok), cache_dir=view(cache))
    assert again == built and "described again" in caplog.text
    assert file.read_bytes() == whole


@pytest.mark.parametrize("change", [
    pytest.param(dict(vocab_size=300), id="vocab-size"),
    pytest.param(dict(with_hf_json=False), id="without-hf-json"),
    pytest.param(dict(eos="<end>"), id="end-of-sequence-token"),
])
def test_each_input_of_a_description_names_its_own_file(tmp_path, change):
    cache = tmp_path / "tokenizers"
    base = tiny_tokenizer()
    first = describe(base, len(base), cache_dir=cache)
    other_tok = tiny_tokenizer(change.get("eos", "<eos>"))
    other = describe(other_tok, change.get("vocab_size", len(other_tok)),
                     with_hf_json=change.get("with_hf_json", True), cache_dir=view(cache))
    assert len(list(cache.iterdir())) == 2
    assert other != first
    if "with_hf_json" in change:
        assert other.hf_tokenizer_json is None and other.compressed_hf() == b""
        assert describe(other_tok, len(other_tok), with_hf_json=False, cache_dir=view(cache)) == other


def test_a_cache_that_cannot_be_written_still_describes(tok, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="shared.tokenizer"):
        desc = describe(tok, len(tok), cache_dir=blocked / "tokenizers")
    assert desc.vocab_size == len(tok) and "not cached" in caplog.text
    assert blocked.read_text() == ""


def test_the_cache_lives_beside_the_embedded_model(tmp_path, monkeypatch):
    from inference_svc.model.embedded_model import default_cache_root

    assert shared_tokenizer.description_cache_dir(tmp_path) == tmp_path / "tokenizers"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert shared_tokenizer.description_cache_dir() == default_cache_root() / "tokenizers"


def test_the_cache_file_is_readable_by_whoever_shares_the_folder(tok, tmp_path):
    """Written as the umask allows (not a temporary file's 0600): another user of a shared cache folder reads it."""
    import os
    import stat

    cache = tmp_path / "shared-cache"
    old = os.umask(0o022)
    try:
        describe(tok, len(tok), cache_dir=cache)
    finally:
        os.umask(old)
    (written,) = [p for p in cache.rglob("*") if p.is_file()]
    assert stat.S_IMODE(written.stat().st_mode) == 0o644


def test_a_temporary_file_a_killed_writer_left_is_removed_at_the_next_write(tok, tmp_path):
    """A writer killed between writing and renaming leaves a .tmp-* file; the next write removes one old
    enough to have no writer, and leaves a recent one (a writer may still be on it)."""
    import os
    import time

    cache = tmp_path / "tokenizers"
    cache.mkdir()
    abandoned, recent = cache / ".tmp-abandoned", cache / ".tmp-recent"
    abandoned.write_bytes(b"half a description")
    recent.write_bytes(b"being written")
    old = time.time() - shared_tokenizer.TMP_ABANDONED_SECONDS - 60
    os.utime(abandoned, (old, old))
    describe(tok, len(tok), cache_dir=cache)
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".tmp-")) == [".tmp-recent"]
