"""The CUDA paths, on a CUDA device: what only a GPU machine can run (`pytest -m cuda`).

scripts/device/check runs these there first, with CUDA_LAUNCH_BLOCKING=1 so
an asynchronous CUDA error names the kernel that raised it. Every test skips
where torch sees no CUDA device (the one on two GPUs where it sees fewer). On
the embedded model:

- the paged runner on CUDA gives the CPU runner's logits and greedy tokens
  over a few hundred mixed prefill / decode / jump-forward-extend steps, in
  float32 and bfloat16, with SDPA and with Triton's paged kernel (the CPU
  float32 SDPA runner is the reference throughout);
- a runner on Triton's kernel compiles its two variants when made and none
  in its steps (split decodes of a long context included);
- the compiled body with CUDA graphs (--compile default on CUDA), warmed up on
  a device thread as the server does, gives the eager body's greedy tokens
  there with no recompile, no graph recorded after the warm-up and no
  cudagraph skip, and refuses a forward from another thread;
- xgrammar's bitmask kernel (masking.py's CUDA path) masks what the CPU path
  masks: rows allowing everything, nothing, a few ids, most ids, stale bits
  past the tokenizer's vocabulary, an unconstrained row left alone;
- the step sampler on CUDA: masked ids never drawn, greedy rows and their
  logprobs the CPU's, seeded rows reproducible and independent of their
  neighbours, logit bias and penalties applied;
- LmHead.create's choice is logged;
- a CUDA server (on an explicit cuda:N, its device thread's current device)
  answers greedy requests (logprobs, min_tokens, grammars) as the CPU server
  does, refuses a token id past the embedding without losing its CUDA
  context, and so does a compiled one (CUDA graphs, graph partitioning, the
  KV cache sized by --gpu-memory-utilization) with no graph recorded while
  serving;
- the sparse LM head gives the full head's tokens and logprobs on CUDA,
  seeded sampling included;
- the engine-core process (`--engine-process on`, auto's choice on CUDA)
  serves concurrent constrained requests end to end through real grammar
  and inference servers, as the one-process CUDA server does;
- with two GPUs, `--tp 2` over NCCL decodes as one GPU does.
"""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import torch

from inference_svc.model.embedded_model import EmbeddedModelSpec, ensure_embedded_model
from inference_svc.model.model_loading import load_model
from inference_svc.model.model_runner import PagedModelRunner, SequenceChunk, StepBatch
from inference_svc.model.paged_kv import KVCacheSpec, PagedKVCache
from shared.inference_client import InferenceClient, InferenceError
from tests.conftest import REPO, TEST_COMPILE_TIMEOUT_SECONDS, InferenceServerThread

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device (scripts/device/check runs these on a GPU machine)")]

DEVICE = "cuda"
VOCAB = 129_280
# float32 on both devices: the kernels differ (cuBLAS vs oneDNN, summation order), the values within this.
ATOL = 2e-3
# A row whose two best logits are closer than this on the CPU may take either on CUDA: not a greedy check.
TIE = 1e-3
# bfloat16 weights, activations and KV against the float32 reference: the embedded model's logits (a few units
# in size) move by up to ~0.015 between the two on the CPU; three times that, and a margin well past it.
BF16_ATOL = 0.05
BF16_TIE = 0.1
TINY = EmbeddedModelSpec(name="cuda-compile-tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
POINT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                          "kind": {"enum": ["cat", "dog", "bird"]},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 30}},
         "required": ["name", "kind", "age"]}


def make_runner(model_dir, device: str, num_blocks: int = 512, block_size: int = 16, dtype: str = "float32",
                attention_backend: str = "sdpa") -> PagedModelRunner:
    model, _ = load_model(model_dir, device, dtype)
    spec = KVCacheSpec.from_model_config(model.config, next(model.parameters()).dtype, block_size)
    return PagedModelRunner(model, PagedKVCache(spec, num_blocks, device), attention_backend=attention_backend)


def served_device() -> str:
    """An explicit cuda:N, the last GPU: with two or more, a server off cuda:0 (its device thread must set it)."""
    return f"cuda:{torch.cuda.device_count() - 1}"


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


def assert_same_greedy(step: int, want: torch.Tensor, got: torch.Tensor, tie: float = TIE) -> int:
    """got's rows pick want's greedy token wherever want has a clear best; returns how many rows had one."""
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tie
    same = want.argmax(-1) == got.argmax(-1)
    assert bool(same[clear].all()), f"step {step}: greedy tokens differ at rows {(~same & clear).nonzero().tolist()}"
    return int(clear.sum())


RUNNERS = [
    pytest.param("float32", "sdpa", 300, ATOL, TIE, 0.95, id="fp32-sdpa"),
    pytest.param("float32", "triton", 150, ATOL, TIE, 0.95, id="fp32-triton"),
    pytest.param("bfloat16", "sdpa", 150, BF16_ATOL, BF16_TIE, 0.5, id="bf16-sdpa"),
    pytest.param("bfloat16", "triton", 150, BF16_ATOL, BF16_TIE, 0.5, id="bf16-triton"),
]


@pytest.mark.parametrize("dtype, backend, steps, atol, tie, clear_share", RUNNERS)
def test_cuda_runner_equals_the_cpu_reference_over_mixed_steps(dtype, backend, steps, atol, tie, clear_share):
    """The context builder, the KV writes and reads and the attention backend on CUDA, against the CPU float32
    SDPA runner fed the same steps."""
    model_dir = ensure_embedded_model(progress=None)
    cpu = make_runner(model_dir, "cpu")
    cuda = make_runner(model_dir, DEVICE, dtype=dtype, attention_backend=backend)
    clear = [0]

    def check(step, logits):
        want, got = logits
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"step {step}: {m}")
        clear[0] += assert_same_greedy(step, want, got, tie)

    rows = mixed_steps([cpu, cuda], steps=steps, seed=7, check=check)
    assert rows > steps and clear[0] > clear_share * rows


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


class OnThread:
    """A runner whose forwards run on one executor thread, as the engine's device thread runs them."""

    def __init__(self, runner: PagedModelRunner, thread: ThreadPoolExecutor):
        self.runner, self.thread = runner, thread

    @property
    def block_manager(self):
        return self.runner.block_manager

    def forward(self, batch):
        return self.thread.submit(self.runner.forward, batch).result(120)


def graphs_recorded(device_index: int) -> int:
    """CUDA graphs cudagraph trees recorded so far by the calling thread's tree manager (one per thread)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    # The manager numbers its graphs from an itertools.count: its repr is the next id.
    return 0 if manager is None else int(repr(manager.graph_counter).removeprefix("count(").removesuffix(")"))


@pytest.mark.timeout(300)
def test_compiled_body_warmed_on_the_device_thread_equals_eager_there(tmp_path):
    """Warmed up (each bucket run twice) on a device thread and run there: the eager body's tokens, no
    recompile, no graph recorded after the warm-up, no cudagraph skip; a forward from another thread is
    refused rather than recorded again into a second pool."""
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    from inference_svc.model.compiled_forward import CompiledBody, CompileSettings

    # Else every CUDA-graph server refuses to start (check_graph_partition): say so first.
    assert inductor_config.graph_partition, "this torch has inductor's graph partitioning off"
    model_dir = ensure_embedded_model(tmp_path / "model", TINY, progress=None)
    eager, compiled = make_runner(model_dir, DEVICE), make_runner(model_dir, DEVICE)
    index = compiled.device.index or 0
    device_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-device")
    lines: list[str] = []
    skips = counters["inductor"]["cudagraph_skips"]
    # "default" is reduce-overhead (CUDA graphs) on CUDA; steps above the largest bucket run eagerly.
    settings = CompileSettings("default", (16,), tmp_path / "inductor")
    device_thread.submit(CompiledBody.install, compiled.model, settings, lines.append).result(240)
    assert lines[-1].startswith("model body compiled in")
    recorded = device_thread.submit(graphs_recorded, index).result()
    assert recorded > 0, "the warm-up recorded no CUDA graph"
    clear = [0]

    def check(step, logits):
        want, got = logits
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"step {step}: {m}")
        clear[0] += assert_same_greedy(step, want, got)

    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            rows = mixed_steps([eager, OnThread(compiled, device_thread)], steps=240, seed=13, check=check)
        assert rows > 200 and clear[0] > 0.95 * rows
        assert device_thread.submit(graphs_recorded, index).result() == recorded, "a step recorded a graph"
        assert counters["inductor"]["cudagraph_skips"] == skips, "inductor skipped CUDA graphs"
        blocks = compiled.block_manager
        blocks.allocate("elsewhere", 3)
        with pytest.raises(RuntimeError, match="must replay on the thread that recorded them"):
            compiled.forward(StepBatch.of([SequenceChunk("elsewhere", (1, 2, 3), 0)]))
        blocks.free("elsewhere")
    finally:
        device_thread.shutdown(wait=True)


def kernel_variants() -> int:
    """Variants of the paged kernel Triton has compiled in this process (a JITFunction's device_caches hold
    (kernel cache, ...) per device in triton 3.6 and 3.9 alike)."""
    from inference_svc.model.paged_kernel import _kernel

    return sum(len(entry[0]) for entry in _kernel().device_caches.values())


def test_the_paged_kernel_compiles_nothing_after_the_runners_warm_up(tmp_path):
    """A Triton runner compiles the kernel's two variants (unsplit, split) when it is made, as load_runner makes it
    on the device thread; its steps then compile none: decodes, extends and chunks beside them, whose index
    tensors sit at other offsets of the step's one copy each step, and a long context's split decodes."""
    from inference_svc.model.paged_kernel import splits_for

    model_dir = ensure_embedded_model(tmp_path / "model", TINY, progress=None)
    before = kernel_variants()  # TINY's head shape: no other test compiles the kernel for it
    runner = make_runner(model_dir, DEVICE, attention_backend="triton")
    assert kernel_variants() == before + 2, "the warm-up did not compile both variants"
    mixed_steps([runner], steps=60, seed=5, check=lambda step, logits: None)
    long = 700
    assert splits_for(2, long + 1, runner.device) > 1  # one sequence's 2 KV-head programs: its decodes split
    blocks = runner.block_manager
    blocks.allocate("long", long)
    runner.forward(StepBatch.of([SequenceChunk("long", tuple(range(1, long + 1)), 0)]))
    for n in range(3):
        blocks.extend("long", 1)
        runner.forward(StepBatch.of([SequenceChunk("long", (7,), long + n)]))
    assert kernel_variants() == before + 2, "a step compiled a variant the warm-up had not"


MASK_KINDS = {"few": 0.003, "most": 0.97, "random": 0.5, "none": 0.0, "all": 1.0}


def _set_bits(row: np.ndarray, ids: np.ndarray) -> None:
    np.bitwise_or.at(row, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))


def test_the_mask_kernel_on_cuda_masks_what_the_cpu_path_masks():
    """masking.apply_masks on CUDA (xgrammar's Triton bitmask kernel over the rows listed) then the step's
    padding columns, against the CPU path (id lists, numpy for dense rows) and the same padding: the same
    logits bit for bit, an unconstrained row untouched."""
    from inference_svc.engine.masking import apply_masks
    from shared.codec import MaskDecoder, MaskEncoder, words_for_vocab

    rng = np.random.default_rng(0)
    kinds = list(MASK_KINDS)
    for case in range(30):
        vocab = int(rng.integers(1, 5000)) if case % 3 else VOCAB
        extra = int(rng.choice([0, 5, 40, 100]))
        width, n = vocab + extra, int(rng.integers(1, 8))
        words = words_for_vocab(width)
        enc, dec = MaskEncoder(vocab), MaskDecoder(vocab)
        host = torch.zeros((n, words), dtype=torch.int32).pin_memory()
        masked = []
        for i in range(n):
            ids = np.flatnonzero(rng.random(vocab) < MASK_KINDS[kinds[(case + i) % len(kinds)]])
            row = np.zeros(words_for_vocab(vocab), dtype=np.uint32)
            _set_bits(row, ids)
            e = enc.encode_row(row.view(np.int32))
            form = dec.decode_into(e.field, e.value, host[i].numpy(), [])
            if i == 0:
                # Stale bits past the tokenizer's vocabulary (a padded head's columns): never drawable.
                _set_bits(host[i].numpy().view(np.uint32), np.arange(vocab, words * 32))
            if i < n - 1 or n == 1:  # the last row of a batch is unconstrained
                masked.append((i, form))
        logits = torch.randn(n, width, generator=torch.Generator().manual_seed(case))
        want = logits.clone()
        for i, ids in apply_masks(want, masked, host, host, vocab).items():
            allowed_only = torch.full_like(want[i], float("-inf"))
            allowed_only[torch.from_numpy(ids)] = want[i, torch.from_numpy(ids)]
            want[i] = allowed_only
        got = logits.to(DEVICE)
        assert apply_masks(got, masked, host, torch.zeros_like(host, device=DEVICE), vocab) == {}
        want[:, vocab:] = got[:, vocab:] = float("-inf")  # as StepSampler.sample does for a padded head
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, msg=lambda m: f"case {case}: {m}")


def _step_sampler(device: str, rows: int, words: int):
    from inference_svc.engine.step_sampler import StepSampler

    host = torch.zeros((rows, words), dtype=torch.int32)
    if device != "cpu":
        host = host.pin_memory()
    dev = host if device == "cpu" else torch.zeros_like(host, device=device)
    return StepSampler(VOCAB, {1}, host, dev), host


SAMPLED_ROWS = [dict(temperature=0.0, top_logprobs=5), dict(temperature=0.0), dict(temperature=1.0, seed=1,
                top_logprobs=3), dict(temperature=0.8, top_k=20, seed=2, logprobs=True),
                dict(temperature=0.8, top_p=0.9, seed=3), dict(temperature=0.7, min_p=0.05, seed=4),
                dict(temperature=1.0, seed=5, logit_bias={7: 5.0}), dict(temperature=0.0, repetition_penalty=1.3,
                                                                      logprobs=True)]


def sampling_options(spec: dict):
    """SamplingOptions from a dict of SamplingParams fields (those left out at their defaults)."""
    from inference_svc.engine.sampling import SamplingOptions

    spec = dict(spec)
    return SamplingOptions.validated(max_tokens=0, top_p=spec.pop("top_p", 1.0), top_k=spec.pop("top_k", 0),
                                     seed=spec.pop("seed", None), stop=(), ignore_eos=False, default_max_tokens=64,
                                     max_max_tokens=4096, **spec)


def test_a_row_sampler_is_made_without_waiting_for_the_device():
    """Engine.submit makes each request's RowSampler on the event loop, where a wait for the device stalls
    every RPC for the forward in flight: its generator and logit bias are made without one (the bias stays on
    the host; adjust_rows copies a step's biases over on the device thread)."""
    from inference_svc.engine.sampling import RowSampler

    torch.cuda.set_sync_debug_mode("error")  # a synchronizing CUDA call raises
    try:
        sampler = RowSampler(sampling_options(dict(temperature=1.0, seed=3, logit_bias={5: 1.0, 9: -2.0})), DEVICE)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sampler.bias[0].device.type == "cpu" and sampler.generator.device.type == "cuda"


def _sampled_step(device: str, copies: int, step: int = 0):
    """(StepSampler, logits on `device`, plan, samplers, allowed ids) for SAMPLED_ROWS repeated `copies` times
    under dense masks, with an EOS ban, a repetition penalty, a logit bias and rows before their min_tokens."""
    from inference_svc.engine.sampling import RowSampler
    from inference_svc.engine.step_sampler import RowPlan
    from shared.codec import words_for_vocab

    kinds = len(SAMPLED_ROWS)
    n, width = kinds * copies, VOCAB + 64  # a padded head: 64 columns past the tokenizer
    rng = np.random.default_rng(100 + step)
    allowed = [np.flatnonzero(rng.random(VOCAB) < p) for p in (0.5, 0.01, 0.3, 0.9, 0.2, 0.6, 0.001, 0.4)]
    allowed[6] = np.union1d(allowed[6], [7])  # the biased id is allowed
    allowed = allowed * copies
    sampler, host = _step_sampler(device, n, words_for_vocab(width))
    for i, ids in enumerate(allowed):
        _set_bits(host[i].numpy().view(np.uint32), ids)
    history = np.array([7, 11, 13], dtype=np.int64)
    plan = RowPlan(sample=list(range(n)), masked=[(i, None) for i in range(n)],
                   ban_eos=[1 + kinds * c for c in range(copies)],
                   penalties=[(7 + kinds * c, history, 1.3) for c in range(copies)],
                   before_min_tokens=[r + kinds * c for c in range(copies) for r in (2, 5)])
    plan.bias = [(6 + kinds * c, *RowSampler(sampling_options(SAMPLED_ROWS[6]), device).bias) for c in range(copies)]
    samplers = [RowSampler(sampling_options(spec), device) for spec in SAMPLED_ROWS * copies]
    logits = torch.randn(n, width, generator=torch.Generator().manual_seed(step)) * 4
    return sampler, logits.to(device), plan, samplers, allowed


def test_the_step_sampler_waits_on_the_host_per_group_not_per_row():
    """A step of 8 rows (every kind of row once) and one of 16 (each twice) wait on the host as often: the
    waits are per group of rows, never per row (torch's sync debug mode counts them)."""
    import warnings

    def waits(copies: int) -> int:
        sampler, logits, plan, samplers, _ = _sampled_step(DEVICE, copies)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                drawn = sampler.sample(logits, plan, samplers)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert not [d for d in drawn if isinstance(d, Exception)], drawn
        return sum("synchroniz" in str(w.message).lower() for w in caught)

    one = waits(1)
    assert 0 < one == waits(2)


def test_the_step_sampler_on_cuda_draws_what_the_masks_allow_as_the_cpu_does():
    """StepSampler.sample on CUDA (dense masks through the bitmask kernel, bias, repetition penalty, an EOS
    ban): every token allowed; greedy rows and their logprobs the CPU's; a sampled row's logprob that of the
    masked distribution; seeded rows drawn again alike, and alike when drawn alone."""
    from inference_svc.engine.sampling import RowSampler
    from inference_svc.engine.step_sampler import RowPlan

    for step in range(5):
        results = {}
        for device in ("cpu", DEVICE):
            sampler, logits, plan, samplers, allowed = _sampled_step(device, 1, step)
            drawn = sampler.sample(logits.clone(), plan, samplers)
            assert not [d for d in drawn if isinstance(d, Exception)], drawn
            results[device] = drawn
            if device == DEVICE:
                again = sampler.sample(logits.clone(), plan, [RowSampler(sampling_options(s), device)
                                                              for s in SAMPLED_ROWS])
                assert [t for t, _ in again] == [t for t, _ in drawn], "seeded rows drew otherwise"
                alone = RowPlan(sample=[3], masked=[(3, None)])
                (token, _), = sampler.sample(logits.clone(), alone,
                                             [RowSampler(sampling_options(SAMPLED_ROWS[3]), device)])
                assert token == drawn[3][0], "a seeded row drew otherwise beside other rows"
        logits = logits.cpu()
        for i, ((token, lp), (cpu_token, cpu_lp)) in enumerate(zip(results[DEVICE], results["cpu"])):
            assert token < VOCAB and token in set(allowed[i].tolist()), (step, i, token)
            if SAMPLED_ROWS[i]["temperature"] == 0.0:
                assert token == cpu_token, (step, i)
                if cpu_lp is not None:
                    assert lp.logprob == pytest.approx(cpu_lp.logprob, abs=1e-4)
                    assert [t for t, _ in lp.top] == [t for t, _ in cpu_lp.top]
        # Row 2 (temperature 1, nothing cut): its logprob is the masked row's log-softmax at its token.
        token, lp = results[DEVICE][2]
        masked_row = torch.full((VOCAB,), float("-inf"))
        masked_row[torch.from_numpy(allowed[2])] = logits[2, torch.from_numpy(allowed[2])]
        assert lp.logprob == pytest.approx(float(torch.log_softmax(masked_row.double(), 0)[token]), abs=1e-4)


def test_the_lm_head_choice_is_logged_on_cuda(caplog):
    """LmHead.create on CUDA: F.linear (the oneDNN kernel and the bfloat16 screen are the CPU's), and the
    choice in the log with whether the sparse head is on."""
    with caplog.at_level(logging.INFO, logger="inference_svc.model.model_runner"):
        runner = make_runner(ensure_embedded_model(progress=None), DEVICE)
    lines = [r.getMessage() for r in caplog.records if r.name == "inference_svc.model.model_runner"
             and r.getMessage().startswith("LM head: ")]
    assert runner.lm_head.name == "plain" and runner.lm_head.screen is None
    want = "LM head: plain kernel" + ("" if runner.lm_head.exact_columns else " (no sparse head)")
    assert lines == [want], caplog.text


# --- through the servers ----------------------------------------------------------------------------


def _config(grammar, **overrides):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    base = dict(host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar.target,), num_threads=2,
                kv_cache_bytes=256 * 1024**2, block_size=16, dtype="float32", compile="off", device=served_device(),
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
def cuda_compiled(grammar_server, tmp_path_factory):
    """A server as `structd inference` runs on a GPU: the body compiled with CUDA graphs (one bucket: steps of
    more tokens run eagerly), the KV cache sized from the device (a small --gpu-memory-utilization, beside
    the module's other servers)."""
    with _served(grammar_server, compile="default", compile_buckets=(8,), kv_cache_bytes=0,
                 gpu_memory_utilization=0.3, compile_cache_dir=tmp_path_factory.mktemp("inductor")) as served:
        yield served


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


def on_device_thread(srv, fn, *args):
    return srv.server.engine._executor.submit(fn, *args).result(60)


def test_the_device_thread_loaded_the_model_and_runs_on_the_served_device(cuda_server):
    """--device cuda:N: the model loaded on the engine's device thread, whose current CUDA device is N (so
    Triton's kernels, launched on the current device, run where the tensors are)."""
    srv, client = cuda_server
    index = torch.device(served_device()).index
    assert on_device_thread(srv, lambda: torch.cuda.current_device()) == index
    assert srv.server.stack.loaded_on == on_device_thread(srv, lambda: threading.current_thread().name)
    assert srv.server.engine.runner.device == torch.device("cuda", index)
    out = client.complete("Pick:", max_tokens=8, choice=["alpha", "beta"], timeout=120)
    assert out.text in ("alpha", "beta")


def test_ids_past_the_embedding_are_refused_and_the_cuda_context_survives(grammar_server, tmp_path):
    """A model with 64 fewer embedding rows than its tokenizer has tokens: an id between the two would be a
    device-side assert, which poisons the whole CUDA context. Refused per request (prompt ids, logit_bias,
    stop_token_ids), and the server answers the next request."""
    from inference_svc.model.embedded_model import DEFAULT_SPEC

    path = ensure_embedded_model(tmp_path / "narrow", replace(DEFAULT_SPEC, vocab_padding=-64), progress=None)
    with _served(grammar_server, model=path) as (srv, client):
        rows = srv.server.engine.runner.embedding_rows
        assert srv.server.engine.token_id_limit == rows
        for prompt, kwargs, names in [([1, rows], {}, "prompt_token_ids"), ([1, rows + 63], {}, "prompt_token_ids"),
                                      ("hi", dict(logit_bias={rows + 3: 5.0}), "logit_bias"),
                                      ("hi", dict(stop_token_ids=[rows]), "stop_token_ids")]:
            with pytest.raises(InferenceError) as refused:
                client.complete(prompt, max_tokens=4, timeout=60, **kwargs)
            assert refused.value.code.name == "INVALID_ARGUMENT" and names in refused.value.message
        out = client.complete([1, rows - 1], max_tokens=4, ignore_eos=True, timeout=60)
        assert len(out.token_ids) == 4 and max(out.token_ids) < rows


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prompt, options", GREEDY[:3] + GREEDY[4:5])
def test_compiled_cuda_server_answers_greedy_requests_as_the_cpu_server(cpu_server, cuda_compiled, prompt,
                                                                        options):
    from torch._dynamo.utils import counters

    srv, compiled = cuda_compiled
    index = torch.device(served_device()).index
    recorded = on_device_thread(srv, graphs_recorded, index)
    skips = counters["inductor"]["cudagraph_skips"]
    want = cpu_server.complete(prompt, max_tokens=40, timeout=120, **options)
    got = compiled.complete(prompt, max_tokens=40, timeout=120, **options)
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert_same_logprobs(got.logprobs, want.logprobs, atol=ATOL)
    assert recorded > 0 and on_device_thread(srv, graphs_recorded, index) == recorded, "a request recorded a graph"
    assert counters["inductor"]["cudagraph_skips"] == skips


def test_compiled_cuda_server_sized_its_kv_cache_from_the_device(cuda_compiled):
    srv, _ = cuda_compiled
    size = srv.server.stack.runner.kv_cache_bytes
    assert size > 0 and srv.server.metrics.kv_cache_bytes._value.get() == size
    free, total = torch.cuda.mem_get_info(torch.device(served_device()))
    assert size < 0.3 * total


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


def test_sparse_head_steps_ran_on_cuda_where_its_columns_are_exact(cuda_server):
    """A choice's few allowed ids take the sparse head where the start-up check found cuBLAS's column form
    bitwise the full head's, and never where it did not (the first H200 run: not bitwise, sparse head off)."""
    srv, client = cuda_server
    before = srv.server.metrics.lm_head_steps.labels("sparse")._value.get()
    client.complete("Pick:", max_tokens=8, choice=["alpha", "beta"], temperature=1.0, seed=1, timeout=120)
    ran = srv.server.metrics.lm_head_steps.labels("sparse")._value.get() > before
    assert ran == srv.server.stack.runner.lm_head.exact_columns


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


@pytest.fixture(scope="module")
def cuda_tp2(grammar_server):
    """`structd inference --tp 2 --device cuda`: rank 0 here starts rank 1 itself (LOCAL_RANK 1: cuda:1)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from structd.bench.harness import free_port
    from structd.up import wait_serving

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "structd", "inference", "--host", "127.0.0.1", "--port", str(port),
                             "--metrics-port", "0", "--grammar-target", grammar_server.target, "--tp", "2",
                             "--device", "cuda", "--dtype", "float32", "--kv-cache-bytes", str(256 * 1024**2),
                             "--log-level", "WARNING", "--engine-process", "off"], cwd=REPO)
    try:
        wait_serving(f"127.0.0.1:{port}", proc, timeout=300)
        with InferenceClient(f"127.0.0.1:{port}") as client:
            yield client
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("prompt, options", GREEDY[2:4])
def test_two_gpus_decode_as_one(cuda_server, cuda_tp2, prompt, options):
    """NCCL bound to each rank's GPU (device_id), rank 1's steps on the thread that set its device."""
    _, one = cuda_server
    want = one.complete(prompt, max_tokens=24, timeout=120, **options)
    got = cuda_tp2.complete(prompt, max_tokens=24, timeout=120, **options)
    assert got.token_ids == want.token_ids
