"""MaskBench-style mask checks through the service, against xgrammar directly.

A deterministic subset of ../shared/data/maskbench-sample.jsonl (every 9th
schema with all its test instances) is compiled through the service and with
xgrammar directly, with the options the service uses (compact JSON, strict,
schema key order). Each instance is serialized as compact JSON, tokenized
with the HF tokenizer, terminated with the stop token and fed token by token:
through the service (one session per instance, all sessions in each step
message, masks on) and through a local xgrammar matcher. A valid instance
passes when it is accepted to the end, an invalid one when it is rejected
somewhere.

The service must reach exactly xgrammar's verdict on every instance (so its
pass rates equal xgrammar's), and every mask it sends must agree with what it
then accepts: a token is accepted exactly when the previous mask allowed it.
Valid instances whose keys are not in schema order, or that use properties
the schema does not list, fail in strict mode on both sides: that is
xgrammar's behaviour with these options, not the service's.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import xgrammar as xgr

from grammar_svc.schema.json_grammar import compile_json_schema
from grammar_svc.types import JsonOptions
from shared.codec import words_for_vocab
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient, decode_masks
from tests.conftest import load_jsonl, run, shared_data

EVERY = 9
COMPILE_TIMEOUT_SECONDS = 3.0
# About 165 instances (of 52 schemas) are evaluated on an idle machine.
MIN_INSTANCES = 120


@dataclass
class Instance:
    schema_name: str
    group: str
    valid: bool
    text: str
    ids: list[int]  # with the stop token appended
    direct_reject: int | None = None  # index of the first rejected token, None if accepted to the end
    service_reject: int | None = None
    service_done: bool = False

    @property
    def direct_pass(self) -> bool:
        return (self.direct_reject is None) == self.valid

    @property
    def service_pass(self) -> bool:
        return (self.service_reject is None) == self.valid


@dataclass
class Bench:
    instances: list[Instance]
    schemas: int
    timeouts: int
    refused: int
    refused_instances: int
    timeout_instances: int
    mask_disagreements: list[str]
    seconds: float


def rate(xs: list[bool]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


@pytest.fixture(scope="module")
def bench(grammar_server, registered, xgr_tokenizer_info, hf_tokenizer) -> Bench:
    rows = load_jsonl(shared_data("maskbench-sample.jsonl"))[::EVERY]
    compiler = xgr.GrammarCompiler(xgr_tokenizer_info)
    kwargs = JsonOptions().xgrammar_kwargs()
    eos = xgr_tokenizer_info.stop_token_ids[0]
    vocab = registered.vocab_size
    pool = grammar_server.server.backend.pool
    start = time.monotonic()

    async def idle_worker(n: int = 1):
        # See test_jsonschemabench: every schema gets its full compile deadline.
        deadline = time.monotonic() + 120
        while pool.idle_workers < n:
            assert time.monotonic() < deadline, "no compile worker came back"
            await asyncio.sleep(0.05)

    async def compile_all(client):
        out = []
        timeouts = refused = refused_instances = timeout_instances = 0
        for row in rows:
            text = json.dumps(row["schema"])
            await idle_worker()
            try:
                resp = await client.compile(
                    registered.fingerprint, pb.GrammarSpec(json_schema=pb.JsonSchema(schema=text)),
                    timeout_seconds=COMPILE_TIMEOUT_SECONDS, rpc_timeout=COMPILE_TIMEOUT_SECONDS + 60)
                service_ok, gid = True, resp.grammar_id
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    timeouts += 1
                    timeout_instances += len(row["tests"])
                    continue
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
                service_ok, gid = False, ""
            try:
                # The service's grammar for it (grammar_svc/schema/json_grammar.py), compiled here.
                compiled = compile_json_schema(compiler, text, JsonOptions())
            except Exception:  # noqa: BLE001 - xgrammar refuses the schema
                compiled = None
            assert service_ok == (compiled is not None), f"{row['name']}: service and xgrammar disagree on compiling"
            if compiled is None:
                refused += 1
                refused_instances += len(row["tests"])
                continue
            out.append((row, gid, compiled))
        # Leave the shared server as found: every worker back and idle.
        await idle_worker(pool.base_workers)
        return out, timeouts, refused, refused_instances, timeout_instances

    def direct(compiled, ids) -> int | None:
        m = xgr.GrammarMatcher(compiled)
        for i, t in enumerate(ids):
            if not m.accept_token(t):
                return i
        assert m.is_terminated()
        return None

    async def feed(stream, sessions: dict[int, tuple[str, Instance]]) -> list[str]:
        """All instances token by token, one session each, all in every step."""
        words = words_for_vocab(vocab)
        bitmask = np.zeros((len(sessions), words), dtype=np.int32)
        masks = bitmask.view(np.uint32)
        disagreements: list[str] = []
        active = sorted(sessions)
        closing: list[int] = []
        resp = await stream.step([pb.SessionStep(session_id=s, open=pb.OpenSession(grammar_id=sessions[s][0]))
                                  for s in active])
        decode_masks(resp, stream.decoder, bitmask)
        assert all(r.status == pb.SESSION_STATUS_OK for r in resp.results)
        row_of = {s: i for i, s in enumerate(active)}
        pos = 0
        while active:
            ops = [pb.SessionStep(session_id=s, close=True) for s in closing]
            allowed = {}
            for s in active:
                t = sessions[s][1].ids[pos]
                allowed[s] = bool((masks[row_of[s], t >> 5] >> (t & 31)) & 1)
                ops.append(pb.SessionStep(session_id=s, accept_token_ids=[t]))
            resp = await stream.step(ops)
            rows = [row_of.get(r.session_id, 0) for r in resp.results]
            decode_masks(resp, stream.decoder, bitmask, rows)
            closing, still = [], []
            for r in resp.results[len(ops) - len(active):]:
                s, inst = r.session_id, sessions[r.session_id][1]
                accepted = r.status in (pb.SESSION_STATUS_OK, pb.SESSION_STATUS_TERMINATED)
                assert r.status != pb.SESSION_STATUS_ERROR, r
                if accepted != allowed[s]:
                    disagreements.append(f"{inst.schema_name} token {pos}: mask allowed={allowed[s]}, "
                                         f"status={pb.SessionStatus.Name(r.status)}")
                if r.status == pb.SESSION_STATUS_REJECTED:
                    inst.service_reject, inst.service_done = pos, True
                    closing.append(s)
                elif r.status == pb.SESSION_STATUS_TERMINATED:
                    assert pos == len(inst.ids) - 1, f"{inst.schema_name}: terminated before the stop token"
                    inst.service_reject, inst.service_done = None, True
                else:
                    assert pos < len(inst.ids) - 1, f"{inst.schema_name}: stop token accepted without terminating"
                    still.append(s)
            active = still
            pos += 1
        if closing:
            await stream.step([pb.SessionStep(session_id=s, close=True) for s in closing])
        return disagreements

    async def go():
        client = GrammarClient(registered.target)
        try:
            compiled, timeouts, refused, refused_instances, timeout_instances = await compile_all(client)
            instances, sessions = [], {}
            for row, gid, grammar in compiled:
                for test in row["tests"]:
                    text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
                    ids = hf_tokenizer.encode(text, add_special_tokens=False) + [eos]
                    inst = Instance(row["name"], row["group"], bool(test["valid"]), text, ids)
                    inst.direct_reject = direct(grammar, ids)
                    instances.append(inst)
                    sessions[len(instances)] = (gid, inst)
            stream = client.open_stream(vocab)
            try:
                disagreements = await feed(stream, sessions)
            finally:
                await stream.close()
            return Bench(instances, len(rows), timeouts, refused, refused_instances, timeout_instances,
                         disagreements, time.monotonic() - start)
        finally:
            await client.close()

    return run(go())


def summary(b: Bench) -> dict[str, float]:
    valid = [i for i in b.instances if i.valid]
    invalid = [i for i in b.instances if not i.valid]
    return {
        "instances": len(b.instances),
        "valid": len(valid),
        "invalid": len(invalid),
        "service_accept_valid": rate([i.service_pass for i in valid]),
        "direct_accept_valid": rate([i.direct_pass for i in valid]),
        "service_reject_invalid": rate([i.service_pass for i in invalid]),
        "direct_reject_invalid": rate([i.direct_pass for i in invalid]),
    }


def test_subset_is_meaningful(bench):
    s = summary(bench)
    print(f"\nmaskbench subset: {bench.schemas} schemas (every {EVERY}th), {s['instances']} instances evaluated "
          f"({s['valid']} valid, {s['invalid']} invalid) in {bench.seconds:.1f} s; excluded: "
          f"{bench.timeouts} schemas over the {COMPILE_TIMEOUT_SECONDS:g} s compile deadline "
          f"({bench.timeout_instances} instances), {bench.refused} schemas refused by xgrammar and the service "
          f"({bench.refused_instances} instances)")
    assert s["instances"] >= MIN_INSTANCES
    assert s["valid"] >= 30 and s["invalid"] >= 30
    assert all(i.service_done for i in bench.instances)


def test_service_verdict_equals_xgrammar_on_every_instance(bench):
    diff = [f"{i.schema_name} ({'valid' if i.valid else 'invalid'}): service rejects at {i.service_reject}, "
            f"xgrammar at {i.direct_reject}: {i.text[:120]}"
            for i in bench.instances if i.service_reject != i.direct_reject]
    assert not diff, "\n".join(diff[:20])


def test_pass_rates_at_least_xgrammar(bench, record_property):
    s = summary(bench)
    for k, v in s.items():
        record_property(k, v)
    print(f"\nmaskbench pass rates on {s['instances']} instances: "
          f"valid accepted: service {s['service_accept_valid']:.1%} vs xgrammar {s['direct_accept_valid']:.1%} "
          f"({s['valid']} valid); invalid rejected: service {s['service_reject_invalid']:.1%} vs xgrammar "
          f"{s['direct_reject_invalid']:.1%} ({s['invalid']} invalid)")
    assert s["service_accept_valid"] >= s["direct_accept_valid"]
    assert s["service_reject_invalid"] >= s["direct_reject_invalid"]
    # Not vacuous: most valid instances do get through, most invalid ones do not.
    assert s["service_accept_valid"] > 0.5 and s["service_reject_invalid"] > 0.5


def test_masks_agree_with_acceptance(bench):
    assert not bench.mask_disagreements, "\n".join(bench.mask_disagreements[:20])
