"""Writes a Llama-architecture model directory with random weights, for `--model`, in seconds.

The device check (scripts/device/check) measures realistic shapes on a GPU
machine that cannot download a checkpoint, so it builds one: config.json at a
named size on the 129,280-token DeepSeek tokenizer (the embedded model's
vocabulary), safetensors shards of N(0, 0.02²) weights (norms ones) drawn on
the device in the target dtype, the tokenizer files and the embedded model's
chat template. The text is meaningless; the shapes, the dtype and the
vocabulary are what a step's cost depends on.

    python scripts/device/random_llama.py --shape 8b --dtype bfloat16 --device cuda --out /dev/shm/llama-8b
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from inference_svc.model.embedded_model import (CHAT_TEMPLATE, CHAT_TEMPLATE_FILE, TOKENIZER_FILES,  # noqa: E402
                                                EmbeddedModelSpec, llama_config)

# name: (spec, tied embeddings). 0.5b has Qwen2.5-0.5B's body, 8b Llama-3-8B's; tiny is the CPU smoke's.
SHAPES = {
    "tiny": (EmbeddedModelSpec(name="random-llama-tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128), True),
    "0.5b": (EmbeddedModelSpec(name="random-llama-0.5b", hidden_size=896, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                               max_position_embeddings=32768, rope_theta=1e6), True),
    "8b": (EmbeddedModelSpec(name="random-llama-8b", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=8192,
                             rope_theta=5e5, rms_norm_eps=1e-5), False),
}
SHARD_BYTES = 2 * 1024**3


def parameter_count(shape: str) -> int:
    """Parameters of a shape on the 129,280-token vocabulary (for sizing the KV cache before building)."""
    spec, tied = SHAPES[shape]
    h, i, layers = spec.hidden_size, spec.intermediate_size, spec.num_hidden_layers
    kv = spec.num_key_value_heads * h // spec.num_attention_heads
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return 129_280 * h * (1 if tied else 2) + layers * per_layer + h


def build(shape: str, out: Path, dtype: str, device: str, seed: int = 0) -> dict:
    """Writes the directory at `out` (replacing it) and returns what was built."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaForCausalLM

    from shared.tokenizer import default_tokenizer_dir, load_hf_tokenizer

    started = time.perf_counter()
    spec, tied = SHAPES[shape]
    spec = replace(spec, seed=seed)
    tokenizer = load_hf_tokenizer()
    config = llama_config(spec, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id,
                          tokenizer.pad_token_id)
    config.tie_word_embeddings = tied
    config.dtype = dtype
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    shard: dict = {}
    files: list[list[str]] = []  # the names in each shard, in order
    size = total = params = 0

    def flush() -> None:
        # Written as soon as it is full: at 8b the host never holds more than one shard.
        save_file(shard, str(out / f"shard-{len(files)}.safetensors"), metadata={"format": "pt"})
        files.append(list(shard))
        shard.clear()

    # named_parameters() visits a tied matrix once, under the embedding's name, as save_pretrained stores it.
    for name, meta in model.named_parameters():
        if name.endswith("norm.weight"):
            value = torch.ones(meta.shape, dtype=torch_dtype, device=device)
        else:
            value = torch.randn(meta.shape, generator=generator, dtype=torch.float32, device=device)
            value = value.mul_(spec.initializer_range).to(torch_dtype)
        nbytes = value.numel() * value.element_size()
        if shard and size + nbytes > SHARD_BYTES:
            flush()
            size = 0
        shard[name] = value.cpu()
        size += nbytes
        total += nbytes
        params += value.numel()
        del value
    flush()
    weight_map = {}
    for k, names in enumerate(files):
        file = "model.safetensors" if len(files) == 1 else f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        (out / f"shard-{k}.safetensors").rename(out / file)
        weight_map.update(dict.fromkeys(names, file))
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, do_sample=False).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(default_tokenizer_dir() / name, out / name)
    shutil.copyfile(CHAT_TEMPLATE, out / CHAT_TEMPLATE_FILE)
    return {"shape": shape, "path": str(out), "dtype": dtype, "parameters": params, "weight_bytes": total,
            "shards": len(files), "vocab_size": config.vocab_size, "hidden_size": spec.hidden_size,
            "layers": spec.num_hidden_layers, "tied_embeddings": tied,
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="the model directory to write (replaced)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="cpu", help="where the weights are drawn (cuda is faster at 8b)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(build(args.shape, args.out, args.dtype, args.device, args.seed)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
