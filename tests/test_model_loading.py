"""Model loading as users expect it: `--model` as a directory or a Hugging Face hub id, `--dtype auto`,
progress bars, the served model name, and one actionable line when `--model` names nothing.

There is no hub to reach from here, so hub ids resolve from a Hugging Face
cache built the way `hf download` leaves one (blobs named by their hash, a
snapshot of symlinks, refs/main), with HF_HUB_OFFLINE=1. A hub id served by a
real two-rank process, both ranks resolving it from such a cache, is in
tests/test_inference_tensor_parallel.py (its group starts once for both files).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from inference_svc.config import EngineConfig, InferenceServiceConfig
from inference_svc.model.embedded_model import DEFAULT_SPEC, EmbeddedModelSpec, ensure_embedded_model
from inference_svc.core.assembly import load_runner
from inference_svc.model.model_loading import (ModelNotFoundError, checkpoint_dtype, load_model, native_dtypes,
                                         pick_dtype, resolve_model)
from tests.conftest import REPO

TINY = EmbeddedModelSpec(name="test-tiny", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64)
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "structd/tiny-llama"
ALL = frozenset({"float32", "bfloat16", "float16"})


def fake_hub_cache(root: Path, repo_id: str, model_dir: Path, commit: str = COMMIT, skip=()) -> Path:
    """Puts model_dir's files into a Hugging Face cache at root as repo_id at commit (refs/main points there)."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        if file.name in skip:
            continue
        with open(file, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            try:
                os.link(file, blob)  # the same bytes without copying 142 MB
            except OSError:  # another filesystem: copy instead
                shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return root


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return ensure_embedded_model(tmp_path_factory.mktemp("tiny"), TINY, progress=None)


def offline_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "STRUCTD_"))}
    return dict(env, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), PYTHONPATH=str(REPO))


# ------------------------------------------------------------------------------------------ dtype

@pytest.mark.parametrize("requested, checkpoint, native, want", [
    pytest.param("float16", "bfloat16", frozenset({"float32"}), "float16", id="explicit-dtype-wins"),
    pytest.param("auto", "bfloat16", ALL, "bfloat16", id="bf16-checkpoint-native"),
    pytest.param("auto", "bfloat16", frozenset({"float32", "float16"}), "float32", id="bf16-not-native-exact-fp32"),
    pytest.param("auto", "float16", frozenset({"float32", "bfloat16"}), "float32", id="fp16-on-cpu-without-amx"),
    pytest.param("auto", "float16", ALL, "float16", id="fp16-checkpoint-native"),
    pytest.param("auto", "float32", ALL, "float32", id="fp32-checkpoint-stays-fp32"),
    pytest.param("auto", None, ALL, "float32", id="dtype-not-recorded"),
    pytest.param("auto", "float64", ALL, "float32", id="unservable-dtype"),
])
def test_pick_dtype(requested, checkpoint, native, want):
    assert pick_dtype(requested, checkpoint, native) == want


@pytest.mark.parametrize("config, want", [
    pytest.param({"dtype": "bfloat16"}, "bfloat16", id="transformers-5-key"),
    pytest.param({"torch_dtype": "float16"}, "float16", id="transformers-4-key"),
    pytest.param({"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16", id="multimodal-text-config"),
    pytest.param({"model_type": "llama"}, None, id="not-recorded"),
])
def test_checkpoint_dtype(tmp_path, config, want):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_dtype(tmp_path) == want


def test_auto_loads_a_bf16_checkpoint_as_this_device_computes_it(tiny_dir, tmp_path):
    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny_dir, bf16)
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps(dict(config, dtype="bfloat16")))
    model, _ = load_model(bf16, "cpu")
    assert model.dtype == (torch.bfloat16 if "bfloat16" in native_dtypes("cpu") else torch.float32)
    assert load_model(bf16, "cpu", "float32")[0].dtype == torch.float32
    assert load_model(tiny_dir, "cpu")[0].dtype == torch.float32, "a float32 checkpoint stays float32"


# --------------------------------------------------------------------------------- progress bars

def test_progress_bars_on_stderr(tmp_path, capsys):
    path = ensure_embedded_model(tmp_path, TINY, progress=lambda _m: None)
    assert "Drawing weights" in capsys.readouterr().err
    load_model(path, "cpu")
    assert "Loading weights" in capsys.readouterr().err
    ensure_embedded_model(tmp_path / "quiet", TINY, progress=None)
    assert "Drawing weights" not in capsys.readouterr().err, "progress=None builds silently"


# ------------------------------------------------------------------------------- --model resolution

def test_local_directory_is_served_under_its_name(tiny_dir, tmp_path):
    (tmp_path / "current").symlink_to(tiny_dir)
    for given, name in ((str(tiny_dir), tiny_dir.name), (f"{tiny_dir}/", tiny_dir.name),
                        (str(tmp_path / "current"), "current")):
        source = resolve_model(given)
        assert (source.path, source.model_id, source.default_name, source.revision) == (
            Path(given), given, name, None)


def test_no_model_is_the_embedded_one():
    source = resolve_model(None)
    assert source.path == ensure_embedded_model()
    assert source.model_id == source.default_name == DEFAULT_SPEC.name == "structd-tiny-llama"


def test_hub_id_resolves_from_the_cache(tiny_dir, tmp_path):
    cache = fake_hub_cache(tmp_path, "org/tiny", tiny_dir)
    source = resolve_model("org/tiny", hub_cache_dir=cache, local_files_only=True)
    assert source.path == cache / "models--org--tiny" / "snapshots" / COMMIT
    assert (source.model_id, source.default_name, source.revision) == ("org/tiny", "org/tiny", COMMIT)
    assert resolve_model("org/tiny", hub_cache_dir=cache, revision=COMMIT, local_files_only=True) == source
    model, tokenizer = load_model(source.path, "cpu")
    assert model.config.hidden_size == TINY.hidden_size and len(tokenizer) == 129_280


@pytest.mark.parametrize("repo_id, skip, message", [
    pytest.param("org/absent", (), "hf download org/absent", id="not-cached"),
    pytest.param("org/no-weights", ("model.safetensors",), "no safetensors or PyTorch .bin weights",
                 id="no-weights"),
    pytest.param("org/no-config", ("config.json",), "no config.json", id="not-a-transformers-model"),
])
def test_unresolvable_hub_ids(tiny_dir, tmp_path, repo_id, skip, message):
    cache = fake_hub_cache(tmp_path, repo_id, tiny_dir, skip=skip) if skip else tmp_path
    with pytest.raises(ModelNotFoundError, match=message) as err:
        resolve_model(repo_id, hub_cache_dir=cache, local_files_only=True)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    pytest.param(dict(model="/no/such/dir"), "not a Hugging Face hub id", id="missing-absolute-path"),
    pytest.param(dict(model="a/b/c"), "not a Hugging Face hub id", id="neither-path-nor-hub-id"),
    pytest.param(dict(model="."), "no config.json", id="directory-without-config"),
    pytest.param(dict(dtype="int8"), "use auto, float32", id="bad-dtype"),
    pytest.param(dict(served_model_name=" "), "--served-model-name", id="empty-served-name"),
])
def test_configuration_problems(overrides, message):
    with pytest.raises(SystemExit, match=message):
        InferenceServiceConfig(**overrides).validate()


def test_hub_ids_pass_validation_without_a_network():
    assert InferenceServiceConfig(model="Qwen/Qwen2.5-0.5B-Instruct").validate().dtype == "auto"


# ------------------------------------------------------------------------- what the server reports

@pytest.mark.parametrize("served, want", [
    pytest.param(None, "structd-tiny-llama", id="default-name"),
    pytest.param("my-model", "my-model", id="served-model-name"),
])
def test_load_runner_reports_the_model(served, want):
    # The simulated runner loads no weights: this is the served-name path without a second model in memory.
    config = InferenceServiceConfig(simulate_step_ms=1.0, served_model_name=served, num_threads=1)
    before = time.time()
    *_, info = load_runner(config)
    assert (info.served_name, info.source.model_id, info.dtype) == (want, "structd-tiny-llama", "")
    assert info.load_seconds > 0 and before <= info.loaded_unix_seconds <= time.time()


def test_server_keeps_its_model_info(inference_server):
    info = inference_server.server.model_info
    assert (info.served_name, info.source.model_id, info.dtype, info.device) == (
        "structd-tiny-llama", "structd-tiny-llama", "float32", "cpu")
    assert info.source.path == ensure_embedded_model() and info.load_seconds > 0


# ------------------------------------------------------------------------------ the real process

def test_hub_id_that_resolves_nowhere_fails_at_start_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "structd", "inference", "--model", "org/absent", "--port", "0",
                           "--metrics-port", "0"], cwd=REPO, env=offline_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("structd inference: --model org/absent: ") and "HF_HUB_OFFLINE=1" in lines[0]
