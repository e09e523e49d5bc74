"""The peer users have today on the same GPU and shape: transformers `generate()` with xgrammar's logits processor.

`structd bench e2e`'s transformers peer runs the embedded model on the CPU;
the device check needs it on the device, on the random model its realistic
runs serve, so it runs this. At each concurrency N: one left-padded batch of
N prompts, greedy, constrained (one compiled JSON schema per row, xgrammar's
`contrib.hf.LogitsProcessor`) and unconstrained (exactly --max-tokens
tokens). Per phase: tokens/s over the batch's wall time, TPOT (the mean step
time after the first token) and TTFT (the first step). Writes <out>/peer.json
with rows shaped as device_report reads structd's.

    python scripts/device/hf_peer.py --model DIR --device cuda --dtype bfloat16 --concurrency 1,32 --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Bounded, like structd's e2e workload: every document ends within --max-tokens or is cut there.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "kind": {"enum": ["cat", "dog", "bird"]},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 30}},
     "required": ["name", "kind", "age"]},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                      "metric": {"type": "boolean"}}, "required": ["city", "days", "metric"]},
]


class _StepClock:
    """A logits processor that records when each step's logits are ready (structd bench e2e's peer times its
    steps the same way; a script does not import structd/)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def phase(model, tok, compiled, n: int, max_tokens: int, constrained: bool) -> dict:
    import torch
    from xgrammar.contrib.hf import LogitsProcessor

    clock = _StepClock()
    processors = [LogitsProcessor([compiled[i % len(compiled)] for i in range(n)])] if constrained else []
    enc = tok([f"Item {i}: describe it as JSON:" for i in range(n)], return_tensors="pt", padding=True).to(model.device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    kwargs = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad, logits_processor=[*processors, clock])
    if not constrained:
        kwargs["min_new_tokens"] = max_tokens
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**enc, **kwargs)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    new = out[:, enc["input_ids"].shape[1]:]
    tokens = int((new != pad).sum()) if constrained else new.numel()
    steps = len(clock.times)
    return {"tokens": tokens, "wall_seconds": wall, "tokens_per_second": tokens / wall if wall > 0 else None,
            "ttft_p50_seconds": clock.times[0] - started if steps else None,
            "tpot_mean_seconds": (clock.times[-1] - clock.times[0]) / (steps - 1) if steps > 1 else None,
            "errors": 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import xgrammar as xgr

    from inference_svc.model.model_loading import load_model

    t = time.perf_counter()
    model, tok = load_model(args.model, args.device, args.dtype)
    tok.padding_side = "left"
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=model.config.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    compiled = [compiler.compile_json_schema(json.dumps(s), any_whitespace=False) for s in SCHEMAS]
    setup = time.perf_counter() - t
    for constrained in (True, False):  # warm-up: kernels, the processors' first allocations
        phase(model, tok, compiled, 2, 4, constrained)
    rows = []
    for n in (int(x) for x in args.concurrency.split(",") if x.strip()):
        row = {"runner": "transformers + xgrammar", "grammar_replicas": "–", "concurrency": n}
        for kind in ("constrained", "unconstrained"):
            row[kind] = phase(model, tok, compiled, n, args.max_tokens, kind == "constrained")
        c, u = row["constrained"]["tpot_mean_seconds"], row["unconstrained"]["tpot_mean_seconds"]
        row["tpot_ratio"] = c / u if c and u else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    from importlib import metadata

    args.out.mkdir(parents=True, exist_ok=True)
    result = {"rows": rows, "setup_seconds": round(setup, 1), "device": args.device, "dtype": args.dtype,
              "max_tokens": args.max_tokens, "transformers": metadata.version("transformers"),
              "xgrammar": metadata.version("xgrammar")}
    (args.out / "peer.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
