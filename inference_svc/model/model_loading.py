"""Where `--model` comes from and how its weights load: a local directory, a Hugging Face hub id, or the embedded model.

`resolve_model` turns the `--model` reference into a local directory:

- none: the embedded default model (built and cached on first use, embedded_model.py);
- an existing directory: used as it is (it must hold config.json);
- anything else that is a hub id ("org/name"): `huggingface_hub.snapshot_download`
  into the ordinary Hugging Face cache, so HF_HOME, HF_HUB_CACHE, HF_TOKEN and
  HF_HUB_OFFLINE=1 act as they do for every Hugging Face tool (the library
  reads them; a snapshot already cached is used without a download, and
  offline it is the only thing used). Only what a causal LM needs is fetched:
  config, tokenizer and chat template files and the safetensors weights
  (PyTorch .bin weights only when the repository has no safetensors).

A reference that cannot be resolved raises `ModelNotFoundError`, whose message
is one line saying what to do; `structd inference` prints it and exits 1
before anything listens (server.serve).

Tensor parallelism: rank 0 resolves (and downloads) before any other rank
starts looking, then tells them the commit it resolved (`resolve_on_group`);
the others take that exact snapshot from their cache and download it only when
their own cache lacks it (a pod with a cache of its own). So no two ranks ever
write one cache at the same time, and all load the same revision.

`load_model` loads a resolved directory with transformers. Its default dtype
"auto" is the checkpoint's (config.json `dtype`, or `torch_dtype` before
transformers 5) when the device computes it natively, otherwise float32,
which holds every float16 and bfloat16 value exactly (`pick_dtype`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
# Files a causal LM directory needs besides its weights (config, generation config, tokenizer, chat template).
HUB_FILES = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja")
SAFETENSORS = ("*.safetensors",)
PYTORCH_BIN = ("*.bin",)
# Llama-style repositories also carry the original (non-transformers) checkpoint: never fetched.
HUB_IGNORE = ("original/*",)


class ModelNotFoundError(Exception):
    """A `--model` reference that names no loadable model; the message says what to do."""


@dataclass(frozen=True)
class ModelSource:
    """A `--model` reference resolved to a local directory."""

    path: Path  # the directory transformers loads
    model_id: str  # what the user named: the hub id, the directory as given, or the embedded model's name
    default_name: str  # the served model name unless --served-model-name says otherwise
    revision: str | None = None  # the hub commit of the snapshot (None: not from the hub)


@dataclass(frozen=True)
class ModelInfo:
    """What a replica serves, once its weights are loaded (GetModelInfo reports it)."""

    served_name: str
    source: ModelSource
    dtype: str  # "" for the simulated runner, which has no weights
    device: str
    load_seconds: float  # resolving, downloading and loading, this process
    loaded_unix_seconds: float  # when loading finished


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_id_problem(reference: str) -> str | None:
    """Why `reference` cannot be a hub repository id, or None when it can."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(reference)
    except HFValidationError as e:  # the user's reference: not shaped like org/name
        return _one_line(e)
    return None


def reference_problem(reference: str | os.PathLike | None) -> str | None:
    """What is wrong with a `--model` reference before anything is downloaded (None: nothing seen yet)."""
    if reference is None:
        return None
    path = Path(reference)
    if path.is_dir():
        if not (path / "config.json").is_file():
            return f"--model {reference} is a directory but not a Hugging Face model directory (no config.json)"
        return None
    if hub_id_problem(str(reference)) is not None:
        return f"--model {reference}: no such directory, and not a Hugging Face hub id (org/name) either"
    return None


def resolve_model(reference: str | os.PathLike | None, *, embedded_cache_dir: Path | None = None,
                  hub_cache_dir: str | os.PathLike | None = None, revision: str | None = None,
                  local_files_only: bool = False, weights: bool = True) -> ModelSource:
    """The local directory of a `--model` reference (None: the embedded model), downloading a hub id's snapshot
    into the Hugging Face cache when it is not there (hub_cache_dir: not the library's default cache).

    weights=False (the simulated runner): only the tokenizer is needed, so the embedded model is not built
    (its tokenizer is the packaged one) and a hub snapshot gets no weight files.
    """
    if reference is None:
        from inference_svc.model.embedded_model import DEFAULT_SPEC, ensure_embedded_model
        from shared.tokenizer import default_tokenizer_dir

        path = ensure_embedded_model(embedded_cache_dir) if weights else default_tokenizer_dir()
        return ModelSource(path, DEFAULT_SPEC.name, DEFAULT_SPEC.name)
    reference = str(reference)
    if (problem := reference_problem(reference)) is not None:
        raise ModelNotFoundError(problem)
    if Path(reference).is_dir():
        # abspath normalises "." and a trailing slash without following a symlink such as /models/current.
        return ModelSource(Path(reference), reference, Path(os.path.abspath(reference)).name)
    folder = _snapshot(reference, revision, hub_cache_dir, local_files_only, weights)
    if weights and not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"--model {reference}: the hub repository has no config.json, so it is not a "
                                 f"transformers model")
    return ModelSource(folder, reference, reference, revision=folder.name)


def _has_any(folder: Path, patterns: Iterable[str]) -> bool:
    return any(next(folder.glob(p), None) is not None for p in patterns)


def _snapshot(repo_id: str, revision: str | None, cache_dir, local_files_only: bool, weights: bool) -> Path:
    """The snapshot folder of repo_id (with safetensors weights, else PyTorch .bin ones, unless not `weights`);
    ModelNotFoundError when there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    cache = str(cache_dir or _hub_cache())
    at = f" (revision {revision})" if revision else ""

    def fetch(weights: tuple[str, ...], rev: str | None) -> Path:
        return Path(snapshot_download(repo_id, revision=rev, cache_dir=cache_dir, local_files_only=local_files_only,
                                      allow_patterns=[*HUB_FILES, *weights], ignore_patterns=list(HUB_IGNORE)))

    try:
        folder = fetch(SAFETENSORS if weights else (), revision)
        if weights and not _has_any(folder, SAFETENSORS):
            # Pinned to the commit just resolved, so both calls see one revision.
            folder = fetch(PYTORCH_BIN, folder.name)
    # Every branch below is the user's or their environment's: a name, a token, the network, the cache.
    except IncompleteSnapshotError as e:
        raise ModelNotFoundError(f"--model {repo_id}: {_one_line(e)}") from None
    except LocalEntryNotFoundError as e:
        if local_files_only or _offline():
            why = "nothing is downloaded while HF_HUB_OFFLINE=1" if _offline() else "only the cache was searched"
            raise ModelNotFoundError(
                f"--model {repo_id}{at}: no such directory, and not in the Hugging Face cache {cache}; {why}: run "
                f"`hf download {repo_id}` where the hub can be reached (with the same HF_HOME/HF_HUB_CACHE), or "
                f"pass a model directory") from None
        raise ModelNotFoundError(
            f"--model {repo_id}{at}: no such directory, not in the Hugging Face cache {cache}, and the hub could "
            f"not be reached ({_one_line(e.__cause__ or e)[:200]}): check the network or proxy (HF_ENDPOINT), or "
            f"pass a model directory") from None
    except GatedRepoError:
        raise ModelNotFoundError(f"--model {repo_id} is a gated repository: accept its terms on "
                                 f"https://huggingface.co/{repo_id} and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"--model {repo_id}: no such directory, and no model repository {repo_id} on the "
                                 f"Hugging Face hub (a private one needs HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"--model {repo_id}: the hub repository has no revision {revision}") from None
    except HfHubHTTPError as e:
        raise ModelNotFoundError(f"--model {repo_id}: the Hugging Face hub failed: {_one_line(e)[:300]}") from None
    except OSError as e:
        raise ModelNotFoundError(f"--model {repo_id}: could not use the Hugging Face cache {cache}: "
                                 f"{_one_line(e)}") from None
    if weights and not _has_any(folder, SAFETENSORS + PYTORCH_BIN):
        raise ModelNotFoundError(f"--model {repo_id}: the hub repository has no safetensors or PyTorch .bin weights")
    return folder


def resolve_on_group(reference: str | os.PathLike | None, rank: int, resolved: ModelSource | None = None, *,
                     embedded_cache_dir: Path | None = None) -> ModelSource:
    """Resolves a reference on every rank of the (initialised) torch.distributed group to the same snapshot.

    Rank 0 resolves first (`resolved`, when it already has), downloading if it must; the other ranks wait for it
    and receive the hub commit it got, then take that commit from their own cache, downloading it only if it
    is missing there (a rank with a cache of its own: nobody else writes to it).
    """
    import torch.distributed as dist

    box: list = [None]
    if rank == 0:
        try:
            resolved = resolved or resolve_model(reference, embedded_cache_dir=embedded_cache_dir)
        except ModelNotFoundError:
            dist.broadcast_object_list([("failed", None)], src=0)  # the other ranks stop instead of waiting
            raise
        dist.broadcast_object_list([("ok", resolved.revision)], src=0)
        return resolved
    dist.broadcast_object_list(box, src=0)
    outcome, revision = box[0]
    if outcome != "ok":
        raise ModelNotFoundError(f"--model {reference}: rank 0 could not resolve it (see rank 0's log)")
    try:
        return resolve_model(reference, embedded_cache_dir=embedded_cache_dir, revision=revision,
                             local_files_only=revision is not None)
    except ModelNotFoundError:
        if revision is None:
            raise
        # Not in this rank's cache (its own volume): this rank alone downloads the commit rank 0 has.
        return resolve_model(reference, embedded_cache_dir=embedded_cache_dir, revision=revision)


def checkpoint_dtype(path: str | os.PathLike) -> str | None:
    """The dtype a checkpoint was saved in, from its config.json (None: not recorded)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):  # the model directory's: unreadable config; transformers will say more
        return None
    for source in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(source.get(key), str):
                return source[key].removeprefix("torch.")
    return None


def native_dtypes(device: str) -> frozenset[str]:
    """The floating-point dtypes `device` computes at full speed (float32 always)."""
    import torch

    native = {"float32"}
    if device.startswith("cuda"):
        native.add("float16")
        if torch.cuda.is_bf16_supported(including_emulation=False):
            native.add("bfloat16")
        return frozenset(native)
    # CPUs: bfloat16 matmuls are fast only with AVX512-BF16 or AMX; without them torch emulates bf16 slower
    # than float32. These probes are private to torch: treated as absent when a release drops them.
    probes = {"bfloat16": ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
              "float16": ("_is_amx_fp16_supported",)}
    for dtype, names in probes.items():
        if any(getattr(torch.cpu, name, lambda: False)() for name in names):
            native.add(dtype)
    return frozenset(native)


def pick_dtype(requested: str, checkpoint: str | None, native: frozenset[str]) -> str:
    """The dtype to load in: `requested`, or for "auto" the checkpoint's if native here, else float32.

    float32 checkpoints stay float32 (vLLM and SGLang would take float16 for them: exactness first, and the
    embedded model is one). float32 holds every bfloat16 and float16 value exactly, so the fallback loses
    nothing; it only costs speed and memory, which an explicit --dtype trades back.
    """
    if requested != "auto":
        return requested
    if checkpoint in DTYPES and checkpoint in native:
        return checkpoint
    return "float32"


def resolve_dtype(dtype):
    """torch.dtype from a dtype or a name ("float32", "bfloat16", "float16")."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"unknown floating-point dtype {dtype!r} (use auto, float32, bfloat16 or float16)")
    return resolved


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(path: str | os.PathLike, device: str | None = None, dtype="auto", *, tensor_parallel: bool = False):
    """(model, tokenizer) for a Hugging Face causal LM directory, in eval mode on `device`.

    Local files only: a path that is not a complete model directory fails
    here rather than reaching for a model hub (`resolve_model` does that).
    The weights load straight onto the device, under transformers' "Loading
    weights" progress bar on stderr (HF_HUB_DISABLE_PROGRESS_BARS=1 hides it).
    With tensor_parallel (a torch.distributed group already initialised),
    transformers shards the weights over the group's ranks (`tp_plan="auto"`)
    and places them itself.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    device = device or default_device()
    if isinstance(dtype, str) and dtype == "auto":
        checkpoint = checkpoint_dtype(path)
        dtype = pick_dtype("auto", checkpoint, native_dtypes(device))
        if checkpoint not in (None, dtype):
            log.info("the checkpoint is %s, which %s does not compute natively: loading as %s (--dtype overrides)",
                     checkpoint, device, dtype)
    torch_dtype = resolve_dtype(dtype)
    started = time.perf_counter()
    log.info("loading the weights of %s as %s %s", path, str(torch_dtype).removeprefix("torch."),
             "sharded over the tensor-parallel group" if tensor_parallel else f"on {device}")
    placement = dict(tp_plan="auto") if tensor_parallel else dict(device_map=device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True, **placement)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    log.info("weights loaded in %.1f s", time.perf_counter() - started)
    return model, tokenizer
