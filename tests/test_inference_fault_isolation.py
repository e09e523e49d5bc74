"""Fault isolation in the inference service: one request's failure costs that request, never the others.

Each test breaks something the way clients and models do (duplicate client
ids, a request whose text decoding breaks, a padded LM head, a huge prompt, a
request failed while its grammar compiles, a step loop that dies) and checks
that the others finish, KV blocks and grammar sessions come back, and the
service still serves, or, when the engine really is gone, says so.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time

import grpc
import pytest

from shared import errors
from shared.inference_client import InferenceClient, InferenceError
from tests.conftest import (InferenceServerThread, assert_engine_gone, background_complete, start_grammar_server,
                            wait_until)

DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 20, "maxItems": 20}


@pytest.fixture(scope="module")
def own_grammar():
    srv = start_grammar_server()
    yield srv
    srv.stop()


def _simulated(grammar, **engine):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    cfg = InferenceServiceConfig(host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(grammar.target,),
                                 simulate_step_ms=5.0, grace_seconds=1.0, grammar_step_timeout_seconds=5.0,
                                 engine=EngineConfig(**{"max_num_seqs": 8, "default_max_tokens": 32, **engine}))
    return InferenceServerThread(cfg)


@pytest.fixture(scope="module")
def simulated(own_grammar):
    srv = _simulated(own_grammar, max_prompt_bytes=64 * 1024)
    yield srv
    srv.stop()


def _settled(server, grammar=None) -> None:
    """Nothing in flight, no KV block held, no grammar session open: what every test must leave behind."""
    engine = server.server.engine
    wait_until(lambda: server.run_sync(lambda: engine.num_active) == 0, "requests left in the engine")
    assert server.run_sync(lambda: engine.runner.block_manager.usage_ratio) == 0.0
    assert server.run_sync(lambda: len(engine.runner.block_manager)) == 0
    if grammar is not None:
        # Closes go out with the engine's next step (or its idle flush): give it a moment.
        get = grammar.server.metrics.registry.get_sample_value
        wait_until(lambda: get("grammar_svc_active_sessions") == 0, "grammar sessions left open", timeout=10)


def _serves(server) -> None:
    with InferenceClient(server.target) as client:
        out = client.complete("still there?", json_schema=DIGITS, max_tokens=64)
    assert out.finish_reason == "stop" and len(json.loads(out.text)) == 20


def test_duplicate_request_ids_are_two_requests(simulated, own_grammar):
    """A client retrying with its own request_id: both run; cancelling one frees only its own blocks."""
    engine = simulated.server.engine
    stop_first = threading.Event()
    first_err: dict = {}

    def first():
        with InferenceClient(simulated.target) as client:
            try:
                for _ in client.generate("a", max_tokens=400, ignore_eos=True, request_id="same-id"):
                    if stop_first.is_set():
                        break  # the client goes away mid-stream: a cancel
            except InferenceError as e:
                first_err["e"] = e

    t1 = threading.Thread(target=first, daemon=True)
    t1.start()
    t2, box = background_complete(simulated.target, prompt="b", max_tokens=300, ignore_eos=True,
                                  request_id="same-id")
    wait_until(lambda: simulated.run_sync(lambda: len(engine.scheduler.running)) == 2, "both requests running")
    seq_ids = simulated.run_sync(lambda: [r.seq_id for r in engine.scheduler.running])
    assert len(set(seq_ids)) == 2
    stop_first.set()
    t1.join(30)
    # The first one's blocks are gone, the second still holds its own and goes on.
    wait_until(lambda: simulated.run_sync(lambda: len(engine.runner.block_manager)) == 1, "first request's KV freed")
    t2.join(60)
    assert "err" not in box, box.get("err")
    assert box["out"].finish_reason == "length" and len(box["out"].token_ids) == 300
    assert "e" not in first_err
    _settled(simulated, own_grammar)
    _serves(simulated)


def test_a_request_whose_text_breaks_fails_alone(simulated, own_grammar):
    """A per-row failure after sampling (here its text decoding raises) fails that request, not the batch."""
    engine = simulated.server.engine
    victim_t, victim = background_complete(simulated.target, prompt="victim", max_tokens=200, ignore_eos=True)
    others = [background_complete(simulated.target, prompt=f"o{i}", max_tokens=60, ignore_eos=True)
              for i in range(3)]
    others.append(background_complete(simulated.target, prompt="c", json_schema=DIGITS, max_tokens=64))

    def break_victim():
        for req in engine.scheduler.running:
            if req.prompt_ids == engine.tok.encode("victim") and req.num_output > 2:
                def push(ids):
                    raise RuntimeError("text decoding broke")
                req.text.push = push
                return True
        return False

    wait_until(lambda: simulated.run_sync(break_victim), "victim decoding")
    victim_t.join(30)
    assert victim["err"].code == grpc.StatusCode.INTERNAL and "incident" in victim["err"].message
    for t, box in others:
        t.join(60)
        assert "err" not in box, box.get("err")
        assert box["out"].finish_reason in ("length", "stop")
    _settled(simulated, own_grammar)


def test_a_storm_of_cancels_leaves_nothing_behind(simulated, own_grammar):
    """32 streams, half constrained, each dropped by its client after a few chunks (some before the first)."""
    rng = random.Random(8)
    plans = [(i, rng.randint(0, 6), i % 2 == 0) for i in range(32)]
    errors_seen = []

    def one(i, after, constrained):
        kwargs = dict(json_schema=DIGITS) if constrained else dict(ignore_eos=True)
        try:
            with InferenceClient(simulated.target) as client:
                for n, _ in enumerate(client.generate(f"storm {i}", max_tokens=200, **kwargs)):
                    if n >= after:
                        break
        except InferenceError as e:
            errors_seen.append(e)

    threads = [threading.Thread(target=one, args=p, daemon=True) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors_seen, errors_seen
    _settled(simulated, own_grammar)
    _serves(simulated)


def test_prompt_over_the_byte_limit_is_refused_before_tokenizing(simulated):
    with InferenceClient(simulated.target) as client, pytest.raises(InferenceError) as err:
        client.complete("x" * (64 * 1024 + 1), max_tokens=2)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "65537 bytes" in err.value.message and "--max-prompt-bytes" in err.value.message
    # At the limit it is tokenized: what it meets now is the context length, counted in tokens.
    with InferenceClient(simulated.target) as client, pytest.raises(InferenceError) as err:
        client.complete("x " * (32 * 1024), max_tokens=2)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "tokens" in err.value.message
    assert "bytes" not in err.value.message
    _settled(simulated)


def test_prompts_are_tokenized_off_the_event_loop(simulated):
    engine = simulated.server.engine
    threads = []
    encode = engine.tok.encode

    def spy(text, add_special_tokens=True):
        threads.append(threading.current_thread())
        return encode(text, add_special_tokens)

    simulated.run_sync(lambda: object.__setattr__(engine.tok, "encode", spy))
    try:
        with InferenceClient(simulated.target) as client:
            client.complete("tokenize me", max_tokens=2)
    finally:
        simulated.run_sync(lambda: object.__setattr__(engine.tok, "encode", encode))
    loop_thread = simulated._thread
    assert threads and all(t is not loop_thread for t in threads)


def test_a_request_failed_while_compiling_is_never_admitted(simulated, own_grammar):
    """An error handler finishes a request whose grammar is compiling: when the compile returns, it stays out."""
    engine = simulated.server.engine
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string", "maxLength": 30 + i} for i in range(3)},
              "required": ["f0"]}
    t, box = background_complete(simulated.target, prompt="c", json_schema=schema, max_tokens=32)

    def fail_compiling():
        for req in list(engine._compiling):
            engine._fail(req, errors.UnavailableError("failed by a test while compiling"))
            return True
        return False

    wait_until(lambda: simulated.run_sync(fail_compiling), "request compiling")
    t.join(60)
    assert box["err"].code == grpc.StatusCode.UNAVAILABLE and "while compiling" in box["err"].message
    # Let the compile come back (or time out), then check it never reached the scheduler.
    wait_until(lambda: simulated.run_sync(lambda: not engine._compiling), "compile settled", timeout=60)
    time.sleep(0.2)
    assert simulated.run_sync(lambda: engine.scheduler.has_work()) is False
    _settled(simulated, own_grammar)
    _serves(simulated)


# --------------------------------------------------------------------- a padded LM head

@pytest.fixture(scope="module")
def padded_model_dir(tmp_path_factory):
    """The embedded model with 64 padding rows in its LM head, made large (untrained padding often is),
    so that without the engine's guard the padding would win nearly every argmax."""
    from safetensors.torch import load_file, save_file

    from inference_svc.model.embedded_model import DEFAULT_SPEC, ensure_embedded_model
    from shared.tokenizer import load_hf_tokenizer

    spec = dataclasses.replace(DEFAULT_SPEC, vocab_padding=64)
    path = ensure_embedded_model(tmp_path_factory.mktemp("padded"), spec=spec)
    weights_file = path / "model.safetensors"
    weights = load_file(weights_file)
    vocab = len(load_hf_tokenizer())
    for name, w in weights.items():
        if w.dim() == 2 and w.shape[0] == vocab + 64:
            w[vocab:] *= 200.0
    save_file(weights, weights_file, metadata={"format": "pt"})
    return path, vocab


def test_padded_vocabulary_is_never_sampled(own_grammar, padded_model_dir):
    from inference_svc.config import EngineConfig, InferenceServiceConfig

    path, vocab = padded_model_dir
    cfg = InferenceServiceConfig(host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(own_grammar.target,),
                                 model=path, num_threads=1, kv_cache_bytes=16 * 1024**2,
                                 engine=EngineConfig(max_num_seqs=4, default_max_tokens=16))
    srv = InferenceServerThread(cfg)
    try:
        assert srv.server.runner.vocab_size == vocab + 64
        with InferenceClient(srv.target) as client:
            for kwargs in (dict(), dict(temperature=1.0, seed=3), dict(json_schema=DIGITS, max_tokens=64),
                           dict(regex="[a-z]{8}")):
                out = client.complete("pad", max_tokens=kwargs.pop("max_tokens", 16), ignore_eos=not kwargs,
                                      top_logprobs=20, **kwargs)
                assert out.token_ids and max(out.token_ids) < vocab, kwargs
                # Nor is it ever an alternative (each padding row would otherwise top every list).
                assert max(t.token_id for lp in out.logprobs for t in lp.top_logprobs) < vocab, kwargs
                if "json_schema" in kwargs:
                    assert len(json.loads(out.text)) == 20
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def narrow_model_dir(tmp_path_factory):
    """The embedded model with 64 fewer embedding and LM head rows than its tokenizer has tokens (a
    mismatched checkpoint): the tokenizer's last 64 ids have no embedding."""
    from inference_svc.model.embedded_model import DEFAULT_SPEC, ensure_embedded_model
    from shared.tokenizer import load_hf_tokenizer

    path = ensure_embedded_model(tmp_path_factory.mktemp("narrow"), spec=dataclasses.replace(DEFAULT_SPEC,
                                                                                              vocab_padding=-64))
    tokenizer = load_hf_tokenizer()
    return path, len(tokenizer) - 64, tokenizer.convert_ids_to_tokens(len(tokenizer) - 1)


def test_ids_past_the_embedding_are_refused_per_request(own_grammar, narrow_model_dir):
    """An id the tokenizer has but the model cannot embed is an index error on the CPU and a device-side
    assert on a GPU (which poisons the whole CUDA context): each request naming one is refused, and the
    server goes on serving."""
    from inference_svc.config import EngineConfig, InferenceServiceConfig
    from shared.inference_client import InferenceError

    path, rows, last_token = narrow_model_dir
    cfg = InferenceServiceConfig(host="127.0.0.1", port=0, metrics_port=0, grammar_targets=(own_grammar.target,),
                                 model=path, num_threads=1, kv_cache_bytes=16 * 1024**2,
                                 engine=EngineConfig(max_num_seqs=4, default_max_tokens=8))
    srv = InferenceServerThread(cfg)
    try:
        assert srv.run_sync(lambda: srv.server.engine.token_id_limit) == rows
        with InferenceClient(srv.target) as client:
            for prompt, kwargs, names in [
                ([1, rows], {}, "prompt_token_ids"),
                ("hi", dict(logit_bias={rows + 3: 5.0}), "logit_bias"),
                ("hi", dict(stop_token_ids=[rows]), "stop_token_ids"),
                (f"text with {last_token} in it", {}, "no embedding for"),
            ]:
                with pytest.raises(InferenceError) as refused:
                    client.complete(prompt, max_tokens=4, **kwargs)
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, (names, refused.value)
                assert names in refused.value.message and str(rows - 1) in refused.value.message
            out = client.complete([1, rows - 1], max_tokens=4, ignore_eos=True)
            assert len(out.token_ids) == 4 and max(out.token_ids) < rows
    finally:
        srv.stop()


# --------------------------------------------------------------------- the loop itself

def test_a_dead_step_loop_turns_not_serving_and_fails_what_is_in_flight(own_grammar):
    srv = _simulated(own_grammar)
    try:
        engine = srv.server.engine
        t, box = background_complete(srv.target, prompt="in flight", max_tokens=2000, ignore_eos=True)
        wait_until(lambda: srv.run_sync(lambda: len(engine.scheduler.running)) == 1, "request running")

        async def broken():
            raise RuntimeError("a bug in the step loop")

        srv.run_sync(lambda: setattr(engine, "_iterate", broken))
        t.join(30)
        # The first failure no request can be blamed for fails what was scheduled (its state may be the
        # cause); three in a row end the loop.
        assert box["err"].code == grpc.StatusCode.INTERNAL and "incident" in box["err"].message
        assert_engine_gone(srv)
    finally:
        srv.stop()
