"""`structd bench prefix` through the CLI in its tiniest configuration (not a timing test).

In-process services on the embedded model, a 64-token prefix (four full KV
blocks), a few requests: the JSON's phases and their plausibility, the prefix
cache hit on the caching-on server and never on the other, the n phase's
prompt computed once, the PNG and the markdown. The real run and its numbers
are in docs/benchmarks.md ("Prefix caching").
"""

from __future__ import annotations

import json

from structd import cli

PREFIX = 64  # four blocks of the default 16 tokens: every later prompt can map all four
REQUESTS = 4
TURN = 20  # a first turn of 84 tokens fills a fifth block its second turn can map


def test_tiniest_run_writes_plausible_json_png_and_tables(tmp_path, capsys):
    rc = cli.main(["bench", "prefix", "--out", str(tmp_path), "--in-process", "--requests", str(REQUESTS),
                   "--prefix-tokens", str(PREFIX), "--suffix-tokens", "3,6", "--concurrency", "1,2",
                   "--max-tokens", "4", "--conversations", "2", "--turns", "2", "--turn-tokens", str(TURN), "--n", "2",
                   "--no-shared-rounds", "1", "--no-shared-requests", "2", "--no-shared-max-tokens", "4"])
    assert rc == 0
    result = json.loads((tmp_path / "prefix-bench.json").read_text())
    assert (tmp_path / "prefix-bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["machine"]["logical_cpus"] > 0 and result["runner"] == "embedded model"

    kinds = [(p["phase"], p["caching"], p["concurrency"]) for p in result["phases"]]
    assert kinds == [("shared_prefix", "on", 1), ("shared_prefix", "off", 1), ("shared_prefix", "on", 2),
                     ("shared_prefix", "off", 2), ("no_shared_prefix", "on", 2), ("no_shared_prefix", "off", 2),
                     ("multi_turn", "on", 2), ("multi_turn", "off", 2)]
    for p in result["phases"]:
        requests = 2 if p["phase"] == "no_shared_prefix" else REQUESTS
        assert p["errors"] == 0 and p["requests"] == requests, p
        assert 0 < p["tokens"] <= requests * 4 and p["throughput_tokens_per_second"] > 0
        assert p["ttft_seconds"]["p50"] > 0 and p["ttft_seconds"]["p99"] >= p["ttft_seconds"]["p50"]
        s = p["server"]
        assert s["prompt_tokens"] == p["prompt_tokens"] and s["forward_seconds"] > 0
        if p["caching"] == "off":
            # The server looks nothing up and the clients are told of no cached token.
            assert p["hit_rate"] == 0 and s["prefix_cache_queried_tokens"] == 0 and p["cached_prompt_tokens"] == 0
            continue
        if p["phase"] == "no_shared_prefix":
            # Prompts shorter than a block: looked up, never found.
            assert s["prefix_cache_queried_tokens"] > 0 and p["hit_rate"] == 0 and p["cached_prompt_tokens"] == 0
            continue
        assert 0 < p["hit_rate"] < 1 and s["prefix_cache_queried_tokens"] >= p["prompt_tokens"]
        if s["preemptions"] == 0:  # a readmission would count its hits again on the server only
            assert s["prefix_cache_hit_tokens"] == p["cached_prompt_tokens"]
        if p["phase"] == "shared_prefix":
            # Only the shared prefix can hit, and the first request always computes it.
            assert 0 < p["cached_prompt_tokens"] <= (REQUESTS - 1) * PREFIX
            assert all(r["cached_prompt_tokens"] in (0, PREFIX) for r in p["records"])
        else:
            assert len(p["ttft_p50_by_turn_seconds"]) == 2
            # Each conversation's second turn resends its first: more than the shared instruction hits.
            second = [r for r in p["records"] if r["turn"] == 1]
            assert all(r["cached_prompt_tokens"] > PREFIX for r in second), second

    n = {x["caching"]: x for x in result["n_phase"]}
    assert set(n) == {"on", "off"}
    for x in n.values():
        assert x["n"] == 2 and x["one_call"]["completions"] == 2 and x["one_call"]["errors"] == 0
        assert x["one_after_another"]["errors"] == 0 and x["time_ratio"] > 0
    # One call: the second completion maps the first's prompt blocks (all full ones of its 70 tokens).
    assert sorted(n["on"]["one_call"]["cached_prompt_tokens_each"]) == [0, PREFIX]
    assert n["off"]["one_call"]["cached_prompt_tokens_each"] == [0, 0]
    assert result["targets"]["n_prefill_once"]["status"] == "met"
    assert all("status" in t for t in result["targets"].values())
    assert result["vllm"]["status"].startswith("not run")

    out = capsys.readouterr().out
    assert "### Shared prefix" in out and "| 1 | on |" in out and "| 2 | off |" in out
    assert "### No shared prefix" in out and "| all | on |" in out
    assert "### Multi-turn" in out and "### n completions" in out and "### Targets (issue 25)" in out


def test_bad_suffix_range_is_a_usage_error(tmp_path, capsys):
    rc = cli.main(["bench", "prefix", "--out", str(tmp_path), "--suffix-tokens", "6,3"])
    assert rc == 2
    assert "--suffix-tokens" in capsys.readouterr().err
