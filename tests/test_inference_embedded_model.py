"""The embedded default model: deterministic builds, cached HF directories, loading."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from inference_svc.model.embedded_model import (
    DEFAULT_SPEC,
    SPEC_FILE,
    EmbeddedModelSpec,
    ensure_embedded_model,
    model_dir_name,
)
from inference_svc.model.model_loading import load_model
from inference_svc.model.model_runner import PagedModelRunner, SequenceChunk, StepBatch

TINY = EmbeddedModelSpec(name="test-tiny", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64)
VOCAB = 129_280


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These models are tiny: a second intra-op thread only adds barrier waits, which cost
    whole scheduler time slices when the machine is busy (measured: 0.2 s vs 8 s here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    """The real default embedded model, built once per test session."""
    return ensure_embedded_model(tmp_path_factory.mktemp("embedded-default"), progress=None)


def test_two_builds_are_bit_identical(tmp_path):
    messages = []
    first = ensure_embedded_model(tmp_path / "one", TINY, progress=messages.append)
    second = ensure_embedded_model(tmp_path / "two", TINY, progress=None)
    assert first.name == second.name == model_dir_name(TINY)
    assert any("building embedded model test-tiny" in m for m in messages)
    assert sha256(first / "model.safetensors") == sha256(second / "model.safetensors")
    reseeded = replace(TINY, seed=1)
    assert model_dir_name(reseeded) != model_dir_name(TINY)


def test_cached_directory_is_reused_and_complete(tmp_path):
    path = ensure_embedded_model(tmp_path, TINY, progress=None)
    messages = []
    assert ensure_embedded_model(tmp_path, TINY, progress=messages.append) == path
    assert messages == []  # no rebuild
    # Only the finished directory is left: the build happened in a temp dir renamed into place.
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", SPEC_FILE} <= names
    assert json.loads((path / SPEC_FILE).read_text())["spec"]["seed"] == TINY.seed
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 1


def test_tiny_model_loads_like_any_hf_model(tmp_path):
    model, tokenizer = load_model(ensure_embedded_model(tmp_path, TINY, progress=None), "cpu")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.num_key_value_heads == 2
    assert len(tokenizer) == VOCAB and tokenizer.eos_token_id == 1
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    with torch.inference_mode():
        assert model(ids).logits.shape == (1, ids.shape[1], VOCAB)


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path, "cpu")
    with pytest.raises(ValueError, match="dtype"):
        load_model(ensure_embedded_model(tmp_path, TINY, progress=None), "cpu", "int8")


def test_default_model_builds_loads_and_serves(default_model_dir):
    model, tokenizer = load_model(default_model_dir, "cpu")
    config = model.config
    assert config.vocab_size == VOCAB == len(tokenizer)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        DEFAULT_SPEC.hidden_size, DEFAULT_SPEC.num_hidden_layers, DEFAULT_SPEC.num_attention_heads,
        DEFAULT_SPEC.num_key_value_heads)
    ids = tokenizer("The grammar decides", add_special_tokens=False).input_ids
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0, -1]

    runner = PagedModelRunner.create(model, num_blocks=8)
    runner.block_manager.allocate("s", len(ids))
    logits = runner.forward(StepBatch.of([SequenceChunk("s", tuple(ids), 0)]))
    assert logits.shape == (1, VOCAB) and logits.dtype == torch.float32
    assert torch.allclose(logits[0], want, atol=1e-4)
