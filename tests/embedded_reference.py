"""The model the session's inference server serves (the embedded default), loaded in plain transformers.

Tests compare what the server returns with what the model itself computes:
its log_softmax for logprobs, transformers' own generate for the repetition
penalty. Loaded once per test process (136 MB in float32).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def reference_model():
    from transformers import AutoModelForCausalLM

    from inference_svc.model.embedded_model import ensure_embedded_model

    path = ensure_embedded_model(progress=None)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
