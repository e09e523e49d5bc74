"""`structd gateway`'s flags: STRUCTD_GATEWAY_* environment twins, validation that names the flag, and the
command line (`structd gateway` = `python -m gateway`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway import config
from structd.cli import build_parser
from tests.conftest import REPO


def test_environment_twins_are_defaults_and_flags_win():
    env = {"STRUCTD_GATEWAY_PORT": "8080", "STRUCTD_GATEWAY_TARGET": "dns:///inference:50051",
           "STRUCTD_GATEWAY_MODEL_INFO_TTL_SECONDS": "0.5", "STRUCTD_GATEWAY_LIMIT_CONCURRENCY": "64"}
    cfg = config.from_args(build_parser(env).parse_args(["gateway"]))
    assert (cfg.port, cfg.target, cfg.model_info_ttl_seconds) == (8080, "dns:///inference:50051", 0.5)
    assert cfg.limit_concurrency == 64
    assert config.from_args(build_parser(env).parse_args(["gateway", "--port", "9000"])).port == 9000


def test_a_malformed_variable_is_a_usage_error_naming_it(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser({"STRUCTD_GATEWAY_PORT": "eighty"}).parse_args(["gateway"])
    assert exit_.value.code == 2 and "STRUCTD_GATEWAY_PORT" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    pytest.param(["--target", " "], "--target", id="target"),
    pytest.param(["--port", "70000"], "--port", id="port"),
    pytest.param(["--max-body-bytes", "10"], "--max-body-bytes", id="max-body-bytes"),
    pytest.param(["--max-body-bytes-in-flight", "2048"], "--max-body-bytes-in-flight", id="in-flight-below-one-body"),
    pytest.param(["--limit-concurrency", "0"], "--limit-concurrency", id="limit-concurrency"),
    pytest.param(["--model-info-ttl-seconds", "-1"], "--model-info-ttl-seconds", id="ttl"),
])
def test_invalid_configuration_names_the_flag(argv, message):
    with pytest.raises(SystemExit, match=message):
        config.from_args(build_parser({}).parse_args(["gateway", *argv]))


def test_python_m_gateway_is_structd_gateway():
    out = subprocess.run([sys.executable, "-m", "gateway", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--target" in out.stdout and "--model-info-ttl-seconds" in out.stdout
