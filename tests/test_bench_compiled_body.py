"""`structd bench compiled-body` through the CLI, eager only and two reps (not a timing test: a cold inductor
compile takes minutes, and tests/test_compiled_forward.py pins the compiled body's equality with eager): every
step is timed, and the JSON, PNG and table carry the medians, ratios and greedy agreement."""

from __future__ import annotations

import json

import pytest

from structd import cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_eager_only_run_through_the_cli(tmp_path, capsys):
    rc = cli.main(["bench", "compiled-body", "--out", str(tmp_path), "--modes", "", "--reps", "2", "--small-head"])
    assert rc == 0
    result = json.loads((tmp_path / "compiled-body.json").read_text())
    assert result["arguments"]["small_head"] is True and "load_average_start" in result
    steps = result["steps"]
    assert [s["step"] for s in steps] == ["decode N=1", "decode N=5 (pads to 8)", "decode N=8", "decode N=32",
                                          "prefill 128"]
    for s in steps:
        assert list(s["median_ms"]) == ["eager"] and s["median_ms"]["eager"] > 0
        assert s["eager_over"] == {"eager": 1.0} and s["greedy_equal"] == {"eager": True}
    assert (tmp_path / "compiled-body.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| prefill 128 |" in capsys.readouterr().out


def test_host_model_with_a_mixed_step(tmp_path):
    rc = cli.main(["bench", "compiled-body", "--out", str(tmp_path), "--modes", "", "--reps", "1", "--host-model",
                   "--decodes", "2", "--mixed"])
    assert rc == 0
    steps = json.loads((tmp_path / "compiled-body.json").read_text())["steps"]
    assert [s["step"] for s in steps] == ["decode N=2 (pads to 8)", "prefill 128",
                                          "mixed: 30 decodes, extend 3, prefill 64, chunk 32"]
    for s in steps:
        assert s["median_cpu_ms"]["eager"] > 0 and s["greedy_equal"] == {"eager": True}
    # Each of the 24 layers dispatches ops; the mixed step attends three plans per layer, the decode step one.
    assert 24 < steps[0]["eager_aten_ops"] < steps[2]["eager_aten_ops"]


def test_bad_buckets_is_a_usage_error(tmp_path, capsys):
    rc = cli.main(["bench", "compiled-body", "--out", str(tmp_path), "--buckets", "1,eight"])
    assert rc == 2
    assert "--buckets" in capsys.readouterr().err
    rc = cli.main(["bench", "compiled-body", "--out", str(tmp_path), "--decodes", "0"])
    assert rc == 2
    assert "--decodes" in capsys.readouterr().err
