"""The `structd` command line as real subprocesses.

`structd grammar` (start-up to SERVING, the preload file, SIGTERM drain, bad
flags), `structd up`'s refusal of zero replicas, and `python -m shared.protogen --check`. A real `structd up`
serving and stopping is tests/test_up_supervision.py's, which starts one for all its tests.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared.grammar_client import GrammarClient
from shared.ports import free_ports
from tests.conftest import REPO, run

PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else sys.executable
STARTUP_TIMEOUT = 300.0  # bounds a broken run only: start-up loads xgrammar and the 129k tokenizer
EXIT_TIMEOUT = 120.0


# ---------------------------------------------------------------- helpers


def clean_env() -> dict[str, str]:
    """The environment without STRUCTD_GRAMMAR_* / STRUCTD_INFERENCE_* overrides from the caller."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("STRUCTD_GRAMMAR_", "STRUCTD_INFERENCE_"))}


class Proc:
    """A subprocess whose merged stdout/stderr is collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.args = args
        self.popen = subprocess.Popen(args, cwd=REPO, env=env or clean_env(), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, needle: str, timeout: float = STARTUP_TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line with {needle!r} within {timeout:.0f} s:\n{self.output}") from None
            if line is None:
                raise AssertionError(f"process exited ({self.popen.poll()}) before {needle!r}:\n{self.output}")
            if needle in line:
                return line

    def wait(self, timeout: float = EXIT_TIMEOUT) -> int:
        rc = self.popen.wait(timeout)
        self._reader.join(10)
        return rc

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(30)


def children_of(pid: int) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.add(int(d))
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def health(target: str, service: str = "") -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10).status


def serving() -> int:
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckResponse.SERVING


def wait_serving(target: str, proc: Proc) -> None:
    from structd.up import wait_serving as up_wait_serving

    try:
        up_wait_serving(target, proc.popen, timeout=STARTUP_TIMEOUT)
    except (RuntimeError, TimeoutError) as e:
        raise AssertionError(f"{e}\n{proc.output}") from None


# ---------------------------------------------------------------- structd grammar

PRELOAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                  "required": ["a"]}
PRELOAD_LINES = [
    json.dumps({"json_schema": PRELOAD_SCHEMA, "options": {"whitespace": "compact"}}),
    json.dumps({"regex": "[0-9]{3}-[0-9]{4}"}),
    "",
    "# a comment line",
    json.dumps({"choice": ["yes", "no", 'say "hi"']}),
    json.dumps({"json_schema": PRELOAD_SCHEMA, "options": {"whitespace": "indented", "indent": 4}}),
    "this line is not JSON",
    json.dumps({"regex": "[a-"}),
    json.dumps({"regex": "x", "choice": ["y"]}),
]


@pytest.fixture(scope="module")
def grammar_proc(tmp_path_factory):
    """One `structd grammar` process with a preload file, shared by this module's grammar tests."""
    preload = tmp_path_factory.mktemp("preload") / "preload.jsonl"
    preload.write_text("\n".join(PRELOAD_LINES) + "\n")
    port, mport = free_ports(), free_ports()
    proc = Proc([PYTHON, "-m", "structd", "grammar", "--host", "127.0.0.1", "--port", str(port),
                 "--metrics-port", str(mport), "--compile-workers", "1", "--fill-threads", "1",
                 "--grace-seconds", "3", "--preload-file", str(preload)])
    try:
        target = f"127.0.0.1:{port}"
        wait_serving(target, proc)
        proc.target, proc.port, proc.metrics_port = target, port, mport
        yield proc
    finally:
        proc.kill()


def test_grammar_serves_and_announces(grammar_proc):
    line = grammar_proc.wait_for_line("grammar service listening on", timeout=30)
    assert f"127.0.0.1:{grammar_proc.port}" in line
    assert f"http://127.0.0.1:{grammar_proc.metrics_port}/metrics" in line
    assert health(grammar_proc.target) == serving()
    assert health(grammar_proc.target, "grammar.v1.GrammarService") == serving()
    with urllib.request.urlopen(f"http://127.0.0.1:{grammar_proc.metrics_port}/metrics", timeout=30) as r:
        body = r.read().decode()
    assert "grammar_svc_cache_misses_total" in body


def test_grammar_preload_is_cache_hit(grammar_proc):
    from shared.tokenizer import default_description

    desc = default_description()
    schema = json.dumps(PRELOAD_SCHEMA)  # the preload file's object, as the preloader serialises it
    compact = pb.JsonSchemaOptions(whitespace=pb.WHITESPACE_STYLE_COMPACT)
    specs = {
        "schema-compact": pb.GrammarSpec(json_schema=pb.JsonSchema(schema=schema, options=compact)),
        "schema-default": pb.GrammarSpec(json_schema=pb.JsonSchema(schema=schema)),  # UNSPECIFIED = compact
        "schema-indented-4": pb.GrammarSpec(json_schema=pb.JsonSchema(schema=schema, options=pb.JsonSchemaOptions(
            whitespace=pb.WHITESPACE_STYLE_INDENTED, indent=4))),
        "regex": pb.GrammarSpec(regex="[0-9]{3}-[0-9]{4}"),
        "choice": pb.GrammarSpec(choice=pb.ChoiceList(choices=["yes", "no", 'say "hi"'])),
        # Not preloaded: the same schema in another whitespace style, another regex.
        "schema-flexible": pb.GrammarSpec(json_schema=pb.JsonSchema(schema=schema, options=pb.JsonSchemaOptions(
            whitespace=pb.WHITESPACE_STYLE_FLEXIBLE))),
        "other-regex": pb.GrammarSpec(regex="[0-9]{3}"),
    }

    async def go():
        client = GrammarClient(grammar_proc.target)
        try:
            reg = await client.register_tokenizer(desc)
            out = {}
            for name, spec in specs.items():
                out[name] = await client.compile(desc.fingerprint, spec)
            return reg, out
        finally:
            await client.close()

    reg, out = run(go())
    # The preloader registered the embedded tokenizer itself: same fingerprint.
    assert reg.already_registered
    assert {name: r.cache_hit for name, r in out.items()} == {
        "schema-compact": True, "schema-default": True, "schema-indented-4": True, "regex": True, "choice": True,
        "schema-flexible": False, "other-regex": False,
    }
    assert out["schema-compact"].grammar_id == out["schema-default"].grammar_id
    # Bad lines were reported and skipped; the good ones were all compiled.
    log = grammar_proc.output
    assert "preload line 7 skipped" in log
    assert "preload line 9 skipped" in log
    assert "preload line 8 failed to compile" in log
    assert "preload done: 4 of 7 constraints compiled" in log


@pytest.mark.parametrize(
    "argv, env, message",
    [
        pytest.param(["--compile-workers", "0"], {}, "--compile-workers must be at least 1", id="compile-workers-0"),
        pytest.param(["--fill-threads", "0", "--max-sessions", "0"], {},
                     "--fill-threads must be at least 1; --max-sessions must be at least 1", id="two-problems"),
        pytest.param(["--compile-timeout-seconds", "0"], {}, "--compile-timeout-seconds must be positive",
                     id="timeout-0"),
        pytest.param(["--compile-timeout-seconds", "120"], {},
                     "--compile-timeout-seconds must not exceed --max-compile-timeout-seconds", id="timeout-over-max"),
        pytest.param(["--compile-workers", "4"], {"STRUCTD_GRAMMAR_MAX_COMPILE_WORKERS": "2"},
                     "--max-compile-workers must be at least --compile-workers", id="env-max-workers-below-base"),
        pytest.param(["--preload-file", "/nonexistent/preload.jsonl"], {}, "does not exist", id="missing-preload"),
        pytest.param([], {"STRUCTD_GRAMMAR_COMPILE_WORKERS": "0"}, "--compile-workers must be at least 1",
                     id="env-compile-workers-0"),
        pytest.param(["--port", "not-a-port"], {}, "invalid int value", id="port-not-int"),
        pytest.param(["--no-such-flag"], {}, "unrecognized arguments", id="unknown-flag"),
    ],
)
def test_grammar_bad_configuration_exits_nonzero(argv, env, message):
    proc = subprocess.run([PYTHON, "-m", "structd", "grammar", "--port", "0", "--metrics-port", "0", *argv],
                          cwd=REPO, env={**clean_env(), **env}, capture_output=True, text=True, timeout=EXIT_TIMEOUT)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_command_line_is_read_without_the_model_libraries():
    """The whole parser (`structd --help`, `structd docs cli`, a name that is no command), each service's flags
    included, loads no model library: a refused flag, `up`, `generate` and the gateway pay no torch, xgrammar or
    transformers import for it."""
    probe = ("import sys\nfor name in ('torch', 'xgrammar', 'transformers'):\n    sys.modules[name] = None\n"
             "from structd import cli\ncli.build_parser({})\n")
    proc = subprocess.run([PYTHON, "-c", probe], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=EXIT_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_grammar_sigterm_drains_and_exits_zero(grammar_proc):
    """Runs last in this module: it stops the module's server."""
    pid = grammar_proc.popen.pid
    # Compile workers are forked by the workers' zygote, a child of the service.
    workers = children_of(pid)
    workers |= {g for c in workers for g in children_of(c)}
    assert len(workers) >= 2, "the compile worker processes should descend from the service"
    assert all(running(w) for w in workers)
    grammar_proc.popen.send_signal(signal.SIGTERM)
    assert grammar_proc.wait() == 0, grammar_proc.output
    assert "draining (grace 3.0 s)" in grammar_proc.output
    # The process ends without the interpreter's teardown (shared/entry.py), its pools wound down first: nothing
    # is left for multiprocessing's resource tracker to warn of, and nothing raised on the way out.
    assert "leaked" not in grammar_proc.output and "Traceback" not in grammar_proc.output, grammar_proc.output
    # No compile worker outlives the service. The pool waits for each worker it holds, but once, under make test's
    # load, one was still running as the service exited (not reproduced; likely one being forked as it stopped,
    # which exits at its socket's EOF): a bounded wait, so a worker that stays still fails.
    deadline = time.monotonic() + 10.0
    while [w for w in workers if running(w)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [w for w in workers if running(w)]


# ---------------------------------------------------------------- structd up


def test_up_rejects_zero_replicas():
    proc = subprocess.run([PYTHON, "-m", "structd", "up", "--grammar-replicas", "0"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=EXIT_TIMEOUT)
    assert proc.returncode == 2
    assert "--grammar-replicas must be at least 1" in proc.stderr


# ---------------------------------------------------------------- stubs


def test_protogen_check_passes():
    proc = subprocess.run([PYTHON, "-m", "shared.protogen", "--check"], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=EXIT_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stubs up to date" in proc.stdout
