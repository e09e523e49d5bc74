"""`structd bench grammar`: the bounded-string micro-benchmark.

One schema per length, `{"s": string with maxLength N}` (N = 0: no
maxLength), walked through the real server one session at a time, so that
StepResponse.fill_duration_seconds is the time of exactly one row. Inside the
string the walk prefers short tokens (the shortest of 4 random allowed
non-quote tokens) so that every position of the string is visited. The same
token sequences are then replayed on the bounded-string rewrite of the same
schema (grammar_svc.schema.bounded_strings), compiled by the server as an EBNF spec,
and every mask is compared; finally both grammars are timed locally with
xgrammar directly.
"""

from __future__ import annotations

import json
import time

import grpc
import numpy as np

from grammar_svc.schema.bounded_strings import rewrite_bounded_strings
from grammar_svc.schema.json_grammar import json_schema_ebnf
from structd.bench.grammar.walks import open_stream
from structd.bench.harness import progress
from structd.bench.stats import summarize
from grammar_svc.compile.spec import JsonOptions
from shared.codec import allowed_ids, words_for_vocab
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient, decode_masks

PREFIX = b'{"s":"'
COMPILE_TIMEOUT = 120.0


def schema_for(max_length: int) -> str:
    s: dict = {"type": "string"}
    if max_length:
        s["maxLength"] = max_length
    return json.dumps({"type": "object", "properties": {"s": s}, "required": ["s"]})


def _string_state(text: bytes) -> tuple[bool, int]:
    """(inside the string value, code points consumed in it)."""
    if not text.startswith(PREFIX):
        return False, 0
    body = text[len(PREFIX):]
    if b'"' in body:
        return False, 0
    return True, len(body.decode("utf-8", "ignore"))


async def _walk(stream, decoder, grammar_id: str, vocab: np.ndarray, has_quote: np.ndarray, token_len: np.ndarray,
                vocab_size: int, rng, tokens: list[int] | None, max_steps: int = 120):
    """One session. With tokens=None it chooses tokens; else it replays them. Returns per-row records."""
    bm = np.zeros((1, words_for_vocab(vocab_size)), dtype=np.int32)
    chosen: list[int] = []
    rows = []
    text = b""
    sid = 1
    msg = [pb.SessionStep(session_id=sid, open=pb.OpenSession(grammar_id=grammar_id))]
    for step in range(max_steps):
        start = time.perf_counter()
        await stream.write(msg)
        resp = await stream.read()
        rtt = time.perf_counter() - start
        r = resp.results[0]
        if r.status != pb.SESSION_STATUS_OK or r.mask.WhichOneof("encoding") is None:
            break
        decode_masks(resp, decoder, bm)
        inside, chars = _string_state(text)
        rows.append(dict(inside=inside, chars=chars, fill=resp.fill_duration_seconds,
                         server=resp.server_duration_seconds, rtt=rtt, hash=hash(bm[0].tobytes()),
                         bytes=r.mask.ByteSize()))
        if tokens is not None:
            if step >= len(tokens):
                break
            tok = tokens[step]
        else:
            ids = allowed_ids(bm[0], vocab_size)
            if inside:
                plain = ids[~has_quote[ids]]
                if plain.size:
                    cand = plain[rng.integers(plain.size, size=4)]
                    tok = int(cand[np.argmin(token_len[cand])])
                else:
                    tok = int(ids[rng.integers(ids.size)])
            else:
                tok = int(ids[rng.integers(ids.size)])
        chosen.append(tok)
        text += vocab[tok]
        msg = [pb.SessionStep(session_id=sid, accept_token_ids=[tok])]
    await stream.write([pb.SessionStep(session_id=sid, close=True)])
    await stream.read()
    return rows, chosen


async def run_bounded(client: GrammarClient, fp: str, info, lengths: list[int], walks: int, seed: int,
                      local: bool, mask_cache_slots: int | None = None) -> dict:
    import xgrammar as xgr

    vocab_size = info.vocab_size
    vocab = [bytes(b) for b in info.decoded_vocab]
    has_quote = np.array([b'"' in b for b in vocab])
    token_len = np.array([len(b) for b in vocab])
    stop = set(info.stop_token_ids)
    has_quote[list(stop)] = True  # never chosen "inside" on purpose
    rng = np.random.default_rng(seed)
    opts = JsonOptions()
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False) if local else None
    results = []
    for n in lengths:
        schema = schema_for(n)
        ebnf, rules = rewrite_bounded_strings(json_schema_ebnf(schema, opts))
        entry: dict = {"max_length": n, "rewritten_rules": rules}
        t = time.perf_counter()
        try:
            # Its own deadline: long bounds take seconds, more than --compile-timeout may allow.
            orig = await client.compile(fp, pb.GrammarSpec(json_schema=pb.JsonSchema(schema=schema)),
                                        timeout_seconds=COMPILE_TIMEOUT, rpc_timeout=COMPILE_TIMEOUT + 30)
            entry["server_compile_seconds"] = orig.compile_duration_seconds
            entry["client_compile_seconds"] = time.perf_counter() - t
            rew = None
            if rules:
                rew = await client.compile(fp, pb.GrammarSpec(ebnf=pb.Ebnf(grammar=ebnf)),
                                           timeout_seconds=COMPILE_TIMEOUT, rpc_timeout=COMPILE_TIMEOUT + 30)
                entry["rewrite_server_compile_seconds"] = rew.compile_duration_seconds
        except grpc.aio.AioRpcError as e:
            entry["error"] = f"{e.code().name}: {e.details()}"
            results.append(entry)
            progress(f"bounded maxLength={n or 'none'}: compile failed ({entry['error']})")
            continue
        orig_rows, rew_rows, token_seqs = [], [], []
        for w in range(walks):
            stream, decoder = open_stream(client, vocab_size, mask_cache_slots)
            try:
                # Long enough to reach the end of the string (the walk adds ~1-2 characters a step).
                rows, toks = await _walk(stream, decoder, orig.grammar_id, vocab, has_quote, token_len, vocab_size, rng,
                                         None, max_steps=120 + 2 * n)
                orig_rows += rows
                token_seqs.append(toks)
                if rew is not None:
                    rrows, _ = await _walk(stream, decoder, rew.grammar_id, vocab, has_quote, token_len, vocab_size, rng,
                                           toks, max_steps=len(toks) + 1)
                    for a, b in zip(rows, rrows):
                        b["inside"], b["chars"] = a["inside"], a["chars"]
                        b["same_mask"] = a["hash"] == b["hash"]
                    rew_rows += rrows
                await stream.close()
            finally:
                stream.cancel()
        inside = [r for r in orig_rows if r["inside"]]
        entry["rows_inside"] = len(inside)
        entry["server_fill_inside"] = summarize([r["fill"] for r in inside])
        entry["server_fill_outside"] = summarize([r["fill"] for r in orig_rows if not r["inside"]])
        entry["rtt_inside"] = summarize([r["rtt"] for r in inside])
        entry["fill_by_chars"] = _by_chars(inside)
        if rew_rows:
            rin = [r for r in rew_rows if r["inside"]]
            entry["rewrite_server_fill_inside"] = summarize([r["fill"] for r in rin])
            entry["rewrite_rtt_inside"] = summarize([r["rtt"] for r in rin])
            entry["rewrite_fill_by_chars"] = _by_chars(rin)
            entry["rewrite_rows"] = len(rew_rows)
            entry["rewrite_mask_mismatches"] = sum(1 for r in rew_rows if not r["same_mask"])
            entry["rewrite_rows_compared"] = len(rew_rows)
        if local:
            entry.update(_local(compiler, schema, ebnf if rules else None, token_seqs, vocab, vocab_size))
        results.append(entry)
        msg = (f"bounded maxLength={n or 'none'}: {len(inside)} rows inside the string, server fill p50 "
               f"{entry['server_fill_inside'].get('p50', 0) * 1e3:.3f} ms")
        if rew_rows:
            msg += (f", rewritten {entry['rewrite_server_fill_inside'].get('p50', 0) * 1e3:.3f} ms, "
                    f"{entry['rewrite_mask_mismatches']} mask mismatches in {len(rew_rows)} rows")
        progress(msg)
    return {"walks_per_length": walks, "lengths": results}


def _by_chars(rows) -> dict:
    out: dict[int, list[float]] = {}
    for r in rows:
        out.setdefault(r["chars"], []).append(r["fill"])
    return {str(k): float(np.median(v)) for k, v in sorted(out.items())}


def _local(compiler, schema: str, ebnf: str | None, token_seqs, vocab, vocab_size: int) -> dict:
    import xgrammar as xgr

    t = time.perf_counter()
    cg = compiler.compile_json_schema(schema, **JsonOptions().xgrammar_kwargs())
    out: dict = {"local_compile_seconds": time.perf_counter() - t}
    cg2 = None
    if ebnf is not None:
        t = time.perf_counter()
        cg2 = compiler.compile_grammar(ebnf)
        out["local_rewrite_compile_seconds"] = time.perf_counter() - t
    buf = xgr.allocate_token_bitmask(1, vocab_size)
    buf2 = xgr.allocate_token_bitmask(1, vocab_size)
    f1, f2, mism = [], [], 0
    for toks in token_seqs:
        m = xgr.GrammarMatcher(cg)
        m2 = xgr.GrammarMatcher(cg2) if cg2 is not None else None
        text = b""
        for tok in toks:
            inside, _ = _string_state(text)
            t = time.perf_counter()
            m.fill_next_token_bitmask(buf)
            dt = time.perf_counter() - t
            if inside:
                f1.append(dt)
            if m2 is not None:
                t = time.perf_counter()
                m2.fill_next_token_bitmask(buf2)
                dt = time.perf_counter() - t
                if inside:
                    f2.append(dt)
                mism += int(not np.array_equal(buf.numpy(), buf2.numpy()))
                m2.accept_token(tok)
            m.accept_token(tok)
            text += vocab[tok]
    out["local_fill_inside"] = summarize(f1)
    if cg2 is not None:
        out["local_rewrite_fill_inside"] = summarize(f2)
        out["local_rewrite_mask_mismatches"] = mism
    return out
