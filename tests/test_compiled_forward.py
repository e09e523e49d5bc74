"""The compiled model body (--compile): greedy tokens equal the eager runner's over mixed steps; the flag.

The compile runs inductor for real (g++ on CPU); one small bucket keeps it
near half a minute on 2 cores, and steps above it exercise the eager fallback.
Its kernels go to the machine's compile cache (`--compile-cache-dir`'s
default), as a server's do: a later run on the same machine traces again and
loads them instead of calling g++, as a restarted server does. Inductor keys
them by the traced graph, its config, torch and the compiler, so a change to
the model code, the attention op's signature or the compile settings compiles
again.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from inference_svc.config import bucket_sizes
from inference_svc.model.compiled_forward import (CompiledBody, CompileSettings, adopt_cudagraph_state,
                                                  default_compile_cache_dir, inductor_mode)
from inference_svc.model.embedded_model import EmbeddedModelSpec, ensure_embedded_model
from inference_svc.model.model_loading import load_model
from inference_svc.model.model_runner import PagedModelRunner, SequenceChunk, StepBatch
from inference_svc.model.paged_kv import KVCacheSpec, PagedKVCache
from tests.conftest import inference_config

TINY = EmbeddedModelSpec(name="compile-tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
BUCKET = 8
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    model_dir = ensure_embedded_model(tmp_path_factory.mktemp("compile-model"), TINY, progress=None)

    def runner(compiled: bool) -> PagedModelRunner:
        model, _ = load_model(model_dir, "cpu")
        spec = KVCacheSpec.from_model_config(model.config, torch.float32, 4)
        runner = PagedModelRunner(model, PagedKVCache(spec, 256))
        if compiled:
            settings = CompileSettings("default", (BUCKET,), default_compile_cache_dir())
            CompiledBody.install(model, settings, progress=lines.append)
        return runner

    lines: list[str] = []
    eager, compiled = runner(False), runner(True)
    return eager, compiled, lines


def test_warm_up_reports_each_bucket(runners):
    *_, lines = runners
    assert lines[0].startswith("compiling the model body (default) for 1 token buckets [8]")
    assert "bucket    8 tokens compiled (1/1" in lines[1] and lines[-1].startswith("model body compiled in")


def test_greedy_tokens_equal_eager_over_mixed_steps(runners):
    """Sequences arrive, prefill in chunks, decode, take jump-forward runs (extends) and finish; every step
    feeds both runners the same tokens, and each row's greedy token must be the same."""
    eager, compiled, _ = runners
    rng = random.Random(13)
    fed: dict[int, list[int]] = {}  # tokens in each runner's KV cache per live sequence
    pending: dict[int, list[int]] = {}  # prompt tokens not fed yet, then the next tokens to feed
    next_id, rows, buckets_seen = 0, 0, set()
    # Start-up compiled every graph a step needs: a recompile here would stall a request for seconds.
    with torch.compiler.set_stance("fail_on_recompile"):
        for step in range(240):
            if len(pending) < 5 and rng.random() < 0.3:
                pending[next_id] = [rng.randrange(129_280) for _ in range(rng.randrange(2, 20))]
                fed[next_id] = []
                next_id += 1
            chunks = []
            for seq_id, todo in pending.items():
                n = min(len(todo), rng.randrange(1, 7))
                start = len(fed[seq_id])
                for r in (eager, compiled):
                    blocks = r.block_manager
                    blocks.extend(seq_id, n) if seq_id in blocks else blocks.allocate(seq_id, n)
                chunks.append(SequenceChunk(seq_id, tuple(todo[:n]), start, needs_logits=n == len(todo)))
            if not chunks:
                continue
            batch = StepBatch.of(chunks)
            buckets_seen.add(batch.num_tokens <= BUCKET)
            want, got = eager.forward(batch), compiled.forward(batch)
            assert torch.equal(want.argmax(-1), got.argmax(-1)), f"step {step}: greedy tokens differ"
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            rows += want.shape[0]
            for c in chunks:
                fed[c.seq_id].extend(c.token_ids)
                del pending[c.seq_id][: len(c.token_ids)]
            for seq_id, token in zip(batch.logit_seq_ids, want.argmax(-1).tolist()):
                if len(fed[seq_id]) > 40:
                    for r in (eager, compiled):
                        r.block_manager.free(seq_id)
                    del pending[seq_id]
                    continue
                # Now and then a jump-forward run: the sampled token plus tokens the grammar forces.
                forced = [rng.randrange(129_280) for _ in range(rng.randrange(1, 4))] if rng.random() < 0.2 else []
                pending[seq_id] = [token, *forced]
            pending = {s: t for s, t in pending.items() if t}
    assert rows > 200 and buckets_seen == {True, False}  # padded compiled steps and eager fallbacks both ran


def test_split_body_runs_compiled(runners):
    """The engine's head-split path (forward_body, then the head) goes through the same compiled graphs."""
    eager, compiled, _ = runners
    for r in (eager, compiled):
        r.block_manager.allocate("split", 5)
    batch = StepBatch.of([SequenceChunk("split", (3, 1, 4, 1, 5), 0)])
    with torch.compiler.set_stance("fail_on_recompile"):
        want, got = eager.forward_body(batch), compiled.forward_body(batch)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for r in (eager, compiled):
        r.block_manager.free("split")


def test_padding_rows_write_no_kv(runners):
    """A padded step leaves every KV slot it was not given unchanged."""
    _, compiled, _ = runners
    cache = compiled.kv_cache
    before = [t.clone() for t in cache.flat(0)]
    blocks = compiled.block_manager
    blocks.allocate("pad", 3)
    compiled.forward(StepBatch.of([SequenceChunk("pad", (5, 6, 7), 0)]))
    written = set(blocks.slot_mapping("pad", 0, 3))
    after = cache.flat(0)
    for old, new in zip(before, after):
        changed = (old != new).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= written
    blocks.free("pad")


@pytest.mark.parametrize("max_tokens, want", [
    pytest.param(1, (1,), id="one"),
    pytest.param(512, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), id="power-of-two"),
    pytest.param(48, (1, 2, 4, 8, 16, 32, 48), id="tail"),
])
def test_bucket_sizes(max_tokens, want):
    assert bucket_sizes(max_tokens) == want


@pytest.mark.parametrize("mode, device, want", [
    pytest.param("default", "cpu", None, id="cpu-default"),
    pytest.param("max-autotune", "cpu", "max-autotune-no-cudagraphs", id="cpu-autotune-no-graphs"),
    pytest.param("default", "cuda", "reduce-overhead", id="cuda-graphs"),
    pytest.param("max-autotune", "cuda", "max-autotune", id="cuda-autotune"),
])
def test_cuda_graphs_only_on_cuda(mode, device, want):
    assert inductor_mode(mode, torch.device(device)) == want


@pytest.mark.parametrize("argv, env, device, mode, buckets", [
    pytest.param([], {}, "cpu", "off", (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), id="auto-off-on-cpu"),
    pytest.param([], {}, "cuda", "default", (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), id="auto-default-on-cuda"),
    pytest.param(["--compile", "max-autotune", "--max-num-batched-tokens", "64"], {}, "cpu", "max-autotune",
                 (1, 2, 4, 8, 16, 32, 64), id="buckets-follow-batch-budget"),
    pytest.param(["--compile-buckets", "32,8,8"], {"STRUCTD_INFERENCE_COMPILE": "default"}, "cpu", "default",
                 (8, 32), id="env-twin-and-buckets"),
    # A large GPU's budget (or one given): larger steps run eagerly rather than compile fourteen buckets.
    pytest.param(["--max-num-batched-tokens", "8192"], {}, "cuda", "default",
                 (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), id="buckets-stop-at-512"),
])
def test_compile_flags(argv, env, device, mode, buckets):
    config = inference_config(argv, env)
    assert config.compile_mode(device) == mode and config.bucket_sizes() == buckets


@pytest.mark.parametrize("engine, device, memory_gib, name, want", [
    pytest.param({}, "cpu", 0, "", (64, 512), id="cpu"),
    pytest.param({}, "cuda", 24, "NVIDIA L4", (256, 2048), id="gpu"),
    pytest.param({}, "cuda", 80, "NVIDIA A100-SXM4-80GB", (256, 2048), id="a100-not-large"),
    pytest.param({}, "cuda", 80, "NVIDIA H100 80GB HBM3", (1024, 8192), id="h100-large"),
    pytest.param({}, "cuda", 140, "NVIDIA H200", (1024, 8192), id="h200-large"),
    pytest.param({"max_num_seqs": 32}, "cuda", 140, "NVIDIA H200", (32, 8192), id="given-seqs-kept"),
    pytest.param({"max_num_batched_tokens": 96}, "cpu", 0, "", (64, 96), id="given-tokens-kept"),
])
def test_the_batch_is_sized_by_the_device_where_it_was_left_to_it(engine, device, memory_gib, name, want):
    from inference_svc.config import EngineConfig

    got = EngineConfig(**engine).sized_for(device, memory_gib * 2**30, name)
    assert (got.max_num_seqs, got.max_num_batched_tokens) == want


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--compile", "fast"], "--compile fast: use auto, off, default, max-autotune", id="unknown-mode"),
    pytest.param(["--compile", "default", "--tp", "2"], "needs --tp 1", id="sharded"),
    pytest.param(["--compile-buckets", "8,0"], "must be positive", id="zero-bucket"),
    pytest.param(["--compile-buckets", "8;16"], "--compile-buckets 8;16: use token counts", id="not-a-list"),
])
def test_compile_flag_problems(argv, message):
    with pytest.raises(SystemExit, match=message):
        inference_config(argv)


@pytest.mark.parametrize("mode, partition, refused", [
    pytest.param("reduce-overhead", True, False, id="graphs-with-partitioning"),
    pytest.param("reduce-overhead", False, True, id="graphs-without-partitioning"),
    pytest.param("max-autotune", False, True, id="autotune-graphs-without-partitioning"),
    pytest.param("max-autotune-no-cudagraphs", False, False, id="no-graphs"),
    pytest.param(None, False, False, id="cpu-default"),
])
def test_cuda_graphs_need_graph_partitioning(mode, partition, refused):
    """Without partitioning the opaque attention op would be captured with one step's KV slots and replayed
    on every later step: a start-up error, never silently wrong answers."""
    import torch._inductor.config as inductor_config

    from inference_svc.model.compiled_forward import check_graph_partition

    with inductor_config.patch(graph_partition=partition):
        if refused:
            with pytest.raises(RuntimeError, match="graph partitioning"):
                check_graph_partition(mode)
        else:
            check_graph_partition(mode)


def test_the_model_loads_on_the_thread_that_runs_its_forwards(inference_server):
    """CUDA graph trees and the current CUDA device are per thread: the model is loaded (and its graphs
    warmed up) on the engine's device thread, the one every forward runs on."""
    import threading

    engine = inference_server.server.engine
    forward_thread = engine._executor.submit(lambda: threading.current_thread().name).result(30)
    assert inference_server.server.stack.loaded_on == forward_thread


def test_the_service_sizes_the_batch_left_to_the_device_as_the_engine_and_kv_budget_see_it():
    """`structd inference` without --max-num-seqs / --max-num-batched-tokens: what the assembly gives the
    scheduler (and load_runner the KV budget and compile buckets) on a CPU; given flags are kept."""
    from inference_svc.core.assembly import sized_for_device

    left = sized_for_device(inference_config([]), "cpu").engine
    assert (left.max_num_seqs, left.max_num_batched_tokens) == (64, 512)
    given = sized_for_device(inference_config(["--max-num-seqs", "8"]), "cpu").engine
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (8, 512)


def test_a_thread_that_did_not_import_cudagraph_trees_gets_its_own_state():
    """adopt_cudagraph_state on a thread with no CUDA graph trees state gives it one of its own (what torch
    2.13's get_obj does on first use, and what torch 2.11's asserts is there: the first GPU run's compiled
    servers failed their warm-up on it); a thread that has state keeps it."""
    from torch._inductor import cudagraph_trees

    def state():
        has = hasattr(cudagraph_trees.local, "tree_manager_containers")
        return has or torch._C._is_key_in_tls("tree_manager_containers"), (
            cudagraph_trees.local.tree_manager_containers if has else None)

    seen = {}

    def fresh_thread():
        seen["before"] = state()[0]
        adopt_cudagraph_state()
        seen["after"], first = state()
        adopt_cudagraph_state()
        seen["kept"] = state()[1] is first
        seen["in_tls"] = torch._C._get_obj_in_tls("tree_manager_containers") is first
        seen["containers"] = first

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert seen == {"before": False, "after": True, "kept": True, "in_tls": True, "containers": seen["containers"]}
    # Its own: not the importing thread's (whose graphs it would otherwise record into from another thread).
    assert seen["containers"] is not cudagraph_trees.local.__dict__.get("tree_manager_containers", object())
