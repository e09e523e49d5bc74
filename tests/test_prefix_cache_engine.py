"""Prefix caching through the real inference service: greedy outputs are the same with the cache on and off over
random workloads (shared prefixes of random lengths, partial last blocks, preemption under KV pressure, identical
prompts arriving together, cancellations mid-prefill), the block manager's books hold after every step, and the
comparison catches a wrong block hash."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared.inference_client import InferenceClient
from tests.conftest import InferenceServerThread

# Tokens past the tokenizer's specials, so a random id is an ordinary token.
LOW, HIGH = 1000, 120_000
BLOCK = 16


def _server(grammar_server, prefix_caching: bool):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    cfg = InferenceServiceConfig(
        host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar_server.target,), num_threads=1,
        # 20 blocks of 16: eight requests of up to ~170 tokens do not all fit, so some are preempted.
        block_size=BLOCK, kv_cache_bytes=_kv_bytes_for_blocks(20),
        engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=96, max_waiting=64, default_max_tokens=8,
                            prefix_caching=prefix_caching))
    return InferenceServerThread(cfg)


def _kv_bytes_for_blocks(blocks: int) -> int:
    from inference_svc.model.embedded_model import DEFAULT_SPEC

    spec = DEFAULT_SPEC
    # float32 keys and values of every layer for one block, as KVCacheSpec.bytes_per_block counts them.
    head_dim = spec.hidden_size // spec.num_attention_heads
    return blocks * BLOCK * 2 * spec.num_hidden_layers * spec.num_key_value_heads * head_dim * 4


def _checked(srv):
    """Makes the server's runner check the block manager's books before every forward, and count the tokens
    its forwards compute (srv.computed[0])."""
    srv.computed = [0]

    def install():
        runner = srv.server.engine.runner
        blocks = runner.block_manager
        for name in ("forward", "forward_body"):
            inner = getattr(runner, name, None)
            if inner is None:
                continue

            def checked(batch, _inner=inner):
                blocks.check_invariants()
                srv.computed[0] += batch.num_tokens
                return _inner(batch)

            setattr(runner, name, checked)
    srv.run_sync(install)
    return srv


@pytest.fixture(scope="module")
def cached(grammar_server):
    srv = _checked(_server(grammar_server, True))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def uncached(grammar_server):
    srv = _checked(_server(grammar_server, False))
    yield srv
    srv.stop()


def _workload(seed: int) -> list[list[int]]:
    """Eight prompts over two shared prefixes of random lengths (partial last blocks included), some identical."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(LOW, HIGH) for _ in range(rng.randrange(5, 120))] for _ in range(2)]
    prompts = []
    for _ in range(6):
        prefix = rng.choice(prefixes)
        prompts.append(prefix[:rng.randrange(len(prefix) // 2, len(prefix) + 1)]
                       + [rng.randrange(LOW, HIGH) for _ in range(rng.randrange(0, 40))])
    prompts += [prompts[0], prompts[0]]  # identical prompts, arriving together
    rng.shuffle(prompts)
    return prompts


def _outputs(srv, prompts: list[list[int]], rounds: int = 2) -> list[list[int]]:
    """Each prompt's greedy tokens, every prompt sent at once; `rounds` times (later rounds find the first's
    blocks cached), the rounds' answers must agree."""
    def one(prompt):
        with InferenceClient(srv.target) as client:
            return client.complete(prompt, max_tokens=8, ignore_eos=True, temperature=0.0).token_ids

    answers = []
    with ThreadPoolExecutor(len(prompts)) as pool:
        for _ in range(rounds):
            answers.append(list(pool.map(one, prompts)))
    assert all(a == answers[0] for a in answers), "a resent prompt got another greedy answer"
    return answers[0]


def _hits(srv) -> float:
    return srv.run_sync(lambda: srv.server.engine.metrics.prefix_cache_hits._value.get())


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"workload-{s}") for s in (1, 2, 3)])
def test_greedy_outputs_are_the_same_with_the_cache_on_and_off(cached, uncached, seed):
    prompts = _workload(seed)
    hits, computed = _hits(cached), [cached.computed[0], uncached.computed[0]]
    assert _outputs(cached, prompts, rounds=2) == _outputs(uncached, prompts, rounds=2)
    assert _hits(cached) > hits, "the workload's shared prefixes were found in the cache"
    with_cache, without = cached.computed[0] - computed[0], uncached.computed[0] - computed[1]
    assert with_cache < 0.8 * without, f"computed {with_cache} tokens with the cache, {without} without"


def test_preemption_happened_under_the_workloads(cached):
    """The KV cache is small on purpose: preempted requests come back and find their own blocks."""
    assert srv_metric(cached, "preemptions") > 0


def srv_metric(srv, name: str) -> float:
    return srv.run_sync(lambda: getattr(srv.server.engine.metrics, name)._value.get())


def test_cancelled_prefills_leave_the_cache_consistent(cached, uncached):
    """Requests cancelled mid-prefill (a long prompt, chunked over several steps) free their blocks; the blocks
    their finished chunks registered serve the next request with that prefix, which answers as without cache."""
    rng = random.Random(7)
    long_prompt = [rng.randrange(LOW, HIGH) for _ in range(400)]
    with InferenceClient(cached.target) as client:
        for _ in range(3):
            stream = client.generate(long_prompt, max_tokens=8, ignore_eos=True, temperature=0.0)
            stream.close()  # never read: the call is cancelled while the prompt is being computed
    follow = long_prompt[:300] + [rng.randrange(LOW, HIGH) for _ in range(5)]
    assert _outputs(cached, [follow], rounds=1) == _outputs(uncached, [follow], rounds=1)
    cached.run_sync(lambda: cached.server.engine.runner.block_manager.check_invariants())


def test_the_comparison_catches_a_hash_that_ignores_the_parent(cached, uncached, monkeypatch):
    """The property above fails for a block hash that names a block's tokens alone: a prompt that starts with
    another's second block would map that block, whose keys were computed at other positions after other tokens."""
    import hashlib

    from inference_svc.engine import scheduler

    def tokens_only(token_ids, hashes, block_size):
        for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
            hashes.append(hashlib.sha256(repr(list(token_ids[start:start + block_size])).encode()).digest())
        return hashes

    rng = random.Random(11)
    first, second = ([rng.randrange(LOW, HIGH) for _ in range(BLOCK)] for _ in range(2))
    tail = [rng.randrange(LOW, HIGH) for _ in range(3)]
    monkeypatch.setattr(scheduler, "chain_block_hashes", tokens_only)
    _outputs(cached, [first + second + tail], rounds=1)  # caches `second` as if it started a prompt
    fooled = _outputs(cached, [second + tail], rounds=1)
    assert fooled != _outputs(uncached, [second + tail], rounds=1)
