"""`structd bench lm-head` through the CLI, two reps (not a timing test): every row count is timed with each
kernel, the column forms are checked and timed at every width (MAX_SPARSE_IDS among them), the JSON, PNG and
tables carry them; a --vllm-python that cannot run vLLM's kernel is reported and the rest of the run stands."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from structd import cli
from inference_svc.model.head.sparse_head import MAX_SPARSE_IDS
from structd.bench.lm_head import COLUMN_ROWS, COLUMN_WIDTHS, ROWS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_run_through_the_cli(tmp_path, capsys):
    # This venv has no vLLM: its kernel is reported as not run.
    rc = cli.main(["bench", "lm-head", "--out", str(tmp_path), "--reps", "2", "--vllm-python", sys.executable])
    assert rc == 0
    result = json.loads((tmp_path / "lm-head.json").read_text())
    assert "load_average_start" in result and result["arguments"]["reps"] == 2
    assert [r["rows"] for r in result["rows"]] == list(ROWS)
    screens = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # a CPU whose oneDNN has bfloat16: the screen is timed
    for r in result["rows"]:
        assert set(r["median_ms"]) == {"plain", "onednn_packed"} | ({"greedy_screen"} if screens else set())
        assert all(ms > 0 for ms in r["median_ms"].values())
        if screens:
            assert 1 <= r["screen_kept_ids_mean"] <= 4096
        assert r["columns_exact"] == {"plain": True, "onednn_packed": True}
    assert MAX_SPARSE_IDS in COLUMN_WIDTHS  # the width the sparse head's limit is set from is measured
    assert [(c["rows"], c["columns"]) for c in result["columns"]] == [(r, w) for r in COLUMN_ROWS for w in COLUMN_WIDTHS]
    for c in result["columns"]:
        assert set(c["median_ms"]) == {"plain", "onednn_packed"} == set(c["share_of_full"])
        assert all(ms > 0 for ms in c["median_ms"].values()) and all(x > 0 for x in c["share_of_full"].values())
    assert (tmp_path / "lm-head.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    captured = capsys.readouterr()
    assert "| 64 |" in captured.out and "| 32 | 20,000 |" in captured.out
    assert "vLLM's kernel could not run" in captured.err


def test_bad_reps_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["bench", "lm-head", "--out", str(tmp_path), "--reps", "0"]) == 2
    assert "--reps" in capsys.readouterr().err
