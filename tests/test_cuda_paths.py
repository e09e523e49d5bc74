"""The CUDA paths, on a CUDA device: what only a GPU machine can run (`pytest -m cuda`).

scripts/device/check runs these there first, with CUDA_LAUNCH_BLOCKING=1 so
an asynchronous CUDA error names the kernel that raised it. Every test skips
where torch sees no CUDA device. On the embedded model in float32:

- the paged runner on CUDA gives the CPU runner's logits and greedy tokens
  over a few hundred mixed prefill / decode / jump-forward-extend steps;
- the compiled body with CUDA graphs (--compile default on CUDA) gives the
  eager body's greedy tokens over the same kind of steps, with no recompile;
- a CUDA server answers greedy requests (logprobs, min_tokens, grammars) as
  the CPU server does: the same tokens, the same logprobs within float error;
- the sparse LM head gives the full head's tokens and logprobs on CUDA,
  seeded sampling included;
- the engine-core process (`--engine-process on`, auto's choice on CUDA)
  serves concurrent constrained requests end to end through real grammar
  and inference servers, as the one-process CUDA server does.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from inference_svc.model.embedded_model import EmbeddedModelSpec, ensure_embedded_model
from inference_svc.model.model_loading import load_model
from inference_svc.model.model_runner import PagedModelRunner, SequenceChunk, StepBatch
from inference_svc.model.paged_kv import KVCacheSpec, PagedKVCache
from shared.inference_client import InferenceClient
from tests.conftest import TEST_COMPILE_TIMEOUT_SECONDS, InferenceServerThread

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device (scripts/device/check runs these on a GPU machine)")]

DEVICE = "cuda"
VOCAB = 129_280
# float32 on both devices: the kernels differ (cuBLAS vs oneDNN, summation order), the values within this.
ATOL = 2e-3
# A row whose two best logits are closer than this on the CPU may take either on CUDA: not a greedy check.
TIE = 1e-3
TINY = EmbeddedModelSpec(name="cuda-compile-tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
POINT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "kind": {"enum": ["cat", "dog", "bird"]},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 30}},
         "required": ["name", "kind", "age"]}


def make_runner(model_dir, device: str, num_blocks: int = 512, block_size: int = 16) -> PagedModelRunner:
    model, _ = load_model(model_dir, device, "float32")
    spec = KVCacheSpec.from_model_config(model.config, torch.float32, block_size)
    return PagedModelRunner(model, PagedKVCache(spec, num_blocks, device))


def mixed_steps(runners, steps: int, seed: int, check) -> int:
    """Feeds every runner the same steps (sequences arrive, prefill in chunks, decode the reference's greedy
    token, take jump-forward runs of forced tokens, finish and free their blocks); `check(step, logits per
    runner)` sees each step's logits. Returns the logits rows checked."""
    rng = random.Random(seed)
    fed: dict[int, list[int]] = {}
    pending: dict[int, list[int]] = {}
    next_id = rows = 0
    for step in range(steps):
        if len(pending) < 6 and rng.random() < 0.3:
            pending[next_id] = [rng.randrange(VOCAB) for _ in range(rng.randrange(2, 40))]
            fed[next_id] = []
            next_id += 1
        chunks = []
        for seq_id, todo in pending.items():
            n = min(len(todo), rng.randrange(1, 9))
            for r in runners:
                blocks = r.block_manager
                blocks.extend(seq_id, n) if seq_id in blocks else blocks.allocate(seq_id, n)
            chunks.append(SequenceChunk(seq_id, tuple(todo[:n]), len(fed[seq_id]), needs_logits=n == len(todo)))
        if not chunks:
            continue
        batch = StepBatch.of(chunks)
        logits = [r.forward(batch).float().cpu() for r in runners]
        check(step, logits)
        rows += logits[0].shape[0]
        for c in chunks:
            fed[c.seq_id].extend(c.token_ids)
            del pending[c.seq_id][: len(c.token_ids)]
        for seq_id, token in zip(batch.logit_seq_ids, logits[0].argmax(-1).tolist()):
            if len(fed[seq_id]) > 120:
                for r in runners:
                    r.block_manager.free(seq_id)
                del pending[seq_id]
                continue
            forced = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 5))] if rng.random() < 0.2 else []
            pending[seq_id] = [token, *forced]
        pending = {s: t for s, t in pending.items() if t}
    return rows


def assert_same_greedy(step: int, want: torch.Tensor, got: torch.Tensor) -> int:
    """got's rows pick want's greedy token wherever want has a clear best; returns how many rows had one."""
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > TIE
    same = want.argmax(-1) == got.argmax(-1)
    assert bool(same[clear].all()), f"step {step}: greedy tokens differ at rows {(~same & clear).nonzero().tolist()}"
    return int(clear.sum())


def test_cuda_runner_equals_the_cpu_reference_over_mixed_steps():
    model_dir = ensure_embedded_model(progress=None)
    cpu, cuda = make_runner(model_dir, "cpu"), make_runner(model_dir, DEVICE)
    clear = [0]

    def check(step, logits):
        want, got = logits
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"step {step}: {m}")
        clear[0] += assert_same_greedy(step, want, got)

    rows = mixed_steps([cpu, cuda], steps=300, seed=7, check=check)
    assert rows > 300 and clear[0] > 0.95 * rows


def test_kv_cache_is_sized_from_what_the_device_has_left():
    """--kv-cache-bytes 0 on CUDA: a profiling forward measures the largest step, and the cache gets what
    --gpu-memory-utilization leaves; allocating it then fits."""
    from inference_svc.model.kv_budget import cuda_kv_cache_bytes
    from inference_svc.model.model_loading import load_model
    from inference_svc.model.paged_kv import KVCacheSpec, PagedKVCache

    model, _ = load_model(ensure_embedded_model(progress=None), DEVICE)
    free, total = torch.cuda.mem_get_info()
    budget = cuda_kv_cache_bytes(model, 0.5, 512, 16, model.get_output_embeddings().weight.shape[0], graphs=True)
    assert 0 < budget < 0.5 * total - (total - free)
    spec = KVCacheSpec.from_model_config(model.config, next(model.parameters()).dtype, 16)
    cache = PagedKVCache(spec, spec.blocks_for_bytes(budget), DEVICE)
    assert cache.blocks.num_blocks * spec.bytes_per_block <= budget


def test_compiled_body_with_cuda_graphs_equals_eager(tmp_path):
    from inference_svc.model.compiled_forward import CompiledBody, CompileSettings

    model_dir = ensure_embedded_model(tmp_path / "model", TINY, progress=None)
    eager, compiled = make_runner(model_dir, DEVICE), make_runner(model_dir, DEVICE)
    lines: list[str] = []
    # "default" is reduce-overhead (CUDA graphs) on CUDA; steps above the largest bucket run eagerly.
    CompiledBody.install(compiled.model, CompileSettings("default", (16,), tmp_path / "inductor"),
                         progress=lines.append)
    assert lines[-1].startswith("model body compiled in")
    clear = [0]

    def check(step, logits):
        want, got = logits
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"step {step}: {m}")
        clear[0] += assert_same_greedy(step, want, got)

    with torch.compiler.set_stance("fail_on_recompile"):
        rows = mixed_steps([eager, compiled], steps=240, seed=13, check=check)
    assert rows > 200 and clear[0] > 0.95 * rows


# --- through the servers ----------------------------------------------------------------------------


def _config(grammar, **overrides):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    base = dict(host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar.target,), num_threads=2,
                kv_cache_bytes=256 * 1024**2, block_size=16, dtype="float32", compile="off", device=DEVICE,
                engine=EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, max_waiting=64, default_max_tokens=32,
                                    compile_timeout_seconds=TEST_COMPILE_TIMEOUT_SECONDS))
    return InferenceServiceConfig(**{**base, **overrides})


@contextmanager
def _served(grammar, engine_process="off", **overrides):
    """A real inference server (and a client of it) wired to the session's grammar server."""
    srv = InferenceServerThread(_config(grammar, **overrides), engine_process=engine_process, start_timeout=300.0)
    client = InferenceClient(srv.target)
    try:
        yield srv, client
    finally:
        client.close()
        srv.stop()


@pytest.fixture(scope="module")
def cpu_server(grammar_server):
    with _served(grammar_server, device="cpu") as (_, client):
        yield client


@pytest.fixture(scope="module")
def cuda_server(grammar_server):
    with _served(grammar_server) as served:
        yield served


@pytest.fixture(scope="module")
def cuda_full_head(grammar_server):
    with _served(grammar_server, engine=replace(_config(grammar_server).engine, sparse_head=False)) as (_, client):
        yield client


@pytest.fixture(scope="module")
def cuda_core(grammar_server):
    with _served(grammar_server, engine_process="on") as served:
        yield served


GREEDY = [
    pytest.param("Describe a pet as JSON:", dict(json_schema=POINT, top_logprobs=5), id="json-top-logprobs"),
    pytest.param("Describe a pet as JSON:", dict(json_schema=POINT, min_tokens=12, logprobs=True,
                                                 disable_jump_forward=True), id="json-min-tokens-no-jump-forward"),
    pytest.param("Answer:", dict(regex=r"(yes|no|maybe)( because [a-z]{1,6})?", top_logprobs=3), id="regex"),
    pytest.param("Once upon a time", dict(ignore_eos=True, logprobs=True), id="unconstrained"),
    pytest.param("Once upon a time", dict(min_tokens=20, top_logprobs=2), id="unconstrained-min-tokens"),
    pytest.param("Pick:", dict(choice=["alpha", "beta", "gamma delta"], repetition_penalty=1.3, top_logprobs=3),
                 id="choice-penalty"),
]


def assert_same_logprobs(got, want, atol: float) -> None:
    assert [t.token_id for t in got] == [t.token_id for t in want]
    for g, w in zip(got, want):
        assert g.forced == w.forced and abs(g.logprob - w.logprob) <= atol, (g, w)
        assert len(g.top_logprobs) == len(w.top_logprobs)
        for a, b in zip(g.top_logprobs, w.top_logprobs):
            assert abs(a.logprob - b.logprob) <= atol, (g, w)


@pytest.mark.parametrize("prompt, options", GREEDY)
def test_cuda_server_answers_greedy_requests_as_the_cpu_server(cpu_server, cuda_server, prompt, options):
    _, cuda = cuda_server
    want = cpu_server.complete(prompt, max_tokens=40, timeout=120, **options)
    got = cuda.complete(prompt, max_tokens=40, timeout=120, **options)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert len(got.token_ids) >= options.get("min_tokens", 0)
    assert_same_logprobs(got.logprobs, want.logprobs, atol=ATOL)


SAMPLED = [
    pytest.param(dict(json_schema=POINT, temperature=1.0, seed=3, top_logprobs=5), id="json-sampled-logprobs"),
    pytest.param(dict(json_schema=POINT, temperature=0.7, top_p=0.9, seed=11, disable_jump_forward=True),
                 id="json-top_p-no-jump-forward"),
    pytest.param(dict(regex=r"[0-9]{20}", temperature=1.2, seed=5, logprobs=True), id="regex-digits"),
    pytest.param(dict(json_schema=POINT, repetition_penalty=1.3, min_tokens=3, top_logprobs=2), id="json-greedy"),
    pytest.param(dict(ignore_eos=True), id="unconstrained-greedy-screened"),
]


@pytest.mark.parametrize("options", SAMPLED)
def test_sparse_head_gives_the_full_heads_output_on_cuda(cuda_server, cuda_full_head, options):
    srv, sparse = cuda_server
    want = cuda_full_head.complete("Describe a pet as JSON:", max_tokens=32, timeout=120, **options)
    got = sparse.complete("Describe a pet as JSON:", max_tokens=32, timeout=120, **options)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    # The same device and kernels but a narrower product: float error only.
    assert_same_logprobs(got.logprobs, want.logprobs, atol=1e-4)


def test_sparse_head_steps_ran_on_cuda(cuda_server):
    srv, client = cuda_server
    before = srv.server.metrics.lm_head_steps.labels("sparse")._value.get()
    client.complete("Pick:", max_tokens=8, choice=["alpha", "beta"], temperature=1.0, seed=1, timeout=120)
    assert srv.server.metrics.lm_head_steps.labels("sparse")._value.get() > before


def test_engine_core_process_serves_concurrent_constrained_requests_on_cuda(cuda_server, cuda_core):
    _, one = cuda_server
    core_srv, core = cuda_core
    assert core_srv.server.engine._process.poll() is None  # the core is a live child process

    def ask(client, prompt):
        return client.complete(prompt, max_tokens=48, json_schema=POINT, timeout=180)

    prompts = [f"Pet number {i} as JSON:" for i in range(12)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outputs = list(pool.map(lambda p: ask(core, p), prompts))
    for out in outputs:
        assert out.finish_reason in ("stop", "length"), out
        if out.finish_reason == "stop":
            doc = json.loads(out.text)
            assert set(doc) == {"name", "kind", "age"} and doc["kind"] in ("cat", "dog", "bird"), out.text
            assert out.schema_check == "valid", out
    # One at a time, the core and the one-process server run the same steps: the same tokens.
    for prompt in prompts[:3]:
        assert ask(core, prompt).token_ids == ask(one, prompt).token_ids, prompt
