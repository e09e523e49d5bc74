"""The device check (scripts/device/): its CPU smoke runs every phase here, so it cannot rot between GPU runs.

`scripts/device/check --cpu-smoke` runs the same steps as on a GPU machine
(pytest -m cuda, random-model builds, `structd bench e2e` on a built model,
`structd bench grammar`) on tiny shapes; a step that errors fails here. Every
structd step of the GPU plan (the simulated runners' e2e steps, which the
smoke leaves to tests/test_bench_e2e.py, included) is parsed by structd's own
parser, so a bench flag that is renamed or dropped fails here too. The rest
pins the parts a smoke cannot reach: the GPU plan's sizes, the time budget
rule, the wheel tags prepare accepts.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEVICE = REPO / "scripts" / "device"
sys.path.insert(0, str(DEVICE))

import device_plan  # noqa: E402


def load_script(name: str):
    """scripts/device/<name> (a script without .py) as a module."""
    loader = importlib.machinery.SourceFileLoader(f"device_{name}", str(DEVICE / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out, work = tmp_path_factory.mktemp("device-out"), tmp_path_factory.mktemp("device-work")
    done = subprocess.run([sys.executable, str(DEVICE / "check"), "--cpu-smoke", "--out", str(out), "--work",
                           str(work)], cwd=REPO, capture_output=True, text=True, timeout=900)
    return done, out


def test_cpu_smoke_runs_every_phase_and_every_step_succeeds(smoke):
    done, out = smoke
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((out / "device-check.json").read_text())
    assert record["mode"] == "cpu-smoke"
    by_phase: dict[str, list[dict]] = {}
    for step in record["steps"]:
        by_phase.setdefault(step["phase"], []).append(step)
    # The smoke has one shape, the realistic phase's: no large phase.
    assert list(by_phase) == [p.name for p in device_plan.PHASES if p.name != "large"]
    for step in record["steps"]:
        assert step["status"] == "ok", step
    kinds = {s["kind"] for s in record["steps"]}
    assert kinds == {"versions", "pytest", "build", "e2e", "peer", "grammar", "attention"}
    assert record["environment"]["versions"]["torch"] and record["environment"]["import_failures"] == {}


def test_cpu_smoke_summarises_each_bench_it_ran(smoke):
    _, out = smoke
    record = json.loads((out / "device-check.json").read_text())
    for step in record["steps"]:
        summary = step["summary"]
        if step["kind"] == "pytest":
            assert summary["failed"] == summary["errors"] == 0
            if not record["environment"]["cuda_available"]:
                # Every cuda-marked test is collected and skips, saying why.
                assert summary["skipped"] > 0 and summary["passed"] == 0
                assert all("no CUDA device" in s["reason"] for s in summary["skips"])
        elif step["kind"] in ("e2e", "peer"):
            rows = summary["rows"]
            assert rows and all(r["constrained"]["tpot_mean_seconds"] and r["unconstrained"]["tpot_mean_seconds"]
                                for r in rows), summary
            assert all(r["tpot_ratio"] > 0 and r["constrained"]["errors"] == 0 for r in rows)
            assert all(r["constrained"]["tokens_per_second"] > 0 for r in rows)
        elif step["kind"] == "grammar":
            assert summary["rows"] and all(r["rtt_p50_seconds"] > 0 for r in summary["rows"])
        elif step["kind"] == "build":
            assert summary["vocab_size"] == 129_280 and summary["weight_bytes"] > 0
        elif step["kind"] == "attention":
            assert summary["rows"] and all(r["sdpa_attention_us"] > 0 for r in summary["rows"]), summary


def test_cpu_smoke_writes_the_markdown_png_and_results(smoke):
    _, out = smoke
    text = (out / "device-check.md").read_text()
    for phase in device_plan.PHASES[1:]:
        assert (f"##### {phase.title}" in text) == (phase.name != "large")
    assert "| tiny eager, 1 grammar replica(s) | " in text and "| 1 | 2 | " in text  # an e2e and a grammar row
    assert (out / "device-check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with tarfile.open(out / "device-check-results.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"e2e-tiny-eager-g1/e2e-bench.json", "grammar-fill1/grammar-bench.json", "pytest-cuda/junit.xml",
            "versions/stdout.log"} <= names


@pytest.mark.parametrize("cuda", [pytest.param(True, id="gpu"), pytest.param(False, id="cpu-smoke")])
def test_every_structd_step_parses_with_structd_s_own_flags(cuda):
    """What a renamed or dropped bench flag breaks: the GPU plan's steps (and the smoke's) as `structd` parses
    them, the simulated runners' e2e steps the smoke does not run included."""
    from structd.cli import build_parser

    steps = device_plan.plan(smoke=not cuda, repo=REPO, work=Path("/w"), model_root=Path("/m"), schemas=Path("/s"),
                             device_memory=80 * 1024**3 if cuda else None, cuda=cuda)
    structd_steps = [s for s in steps if s.argv[1:3] == ["-m", "structd"]]
    assert {s.kind for s in structd_steps} == ({"e2e", "grammar", "attention"})
    assert any(s.name.startswith("e2e-sim") for s in structd_steps) == cuda
    parser = build_parser({})
    for step in structd_steps:
        try:
            args = parser.parse_args(step.argv[3:])
        except SystemExit:
            pytest.fail(f"{step.name}: structd refuses {' '.join(step.argv[3:])}")
        assert args.command == "bench", step.name


def test_gpu_plan_covers_the_issue():
    steps = device_plan.plan(smoke=False, repo=REPO, work=Path("/w"), model_root=Path("/m"), schemas=Path("/s"),
                             device_memory=80 * 1024**3, cuda=True)
    names = [s.name for s in steps]
    assert names[:2] == ["versions", "pytest-cuda"]
    for shape, phase, replicas_run in (("0.5b", "realistic", (1, 4)), ("8b", "large", (1,))):
        mine = [s.name for s in steps if s.phase == phase and s.name != "attention"]
        # Most telling first: what serves by default on CUDA (compiled), the peer, then eager.
        assert mine == [f"build-{shape}", f"e2e-{shape}-compiled", f"peer-{shape}",
                        *(f"e2e-{shape}-eager-g{r}" for r in replicas_run)]
        peer = steps[names.index(f"peer-{shape}")]
        assert peer.needs == f"build-{shape}" and peer.argv[peer.argv.index("--device") + 1] == "cuda"
        compiled = steps[names.index(f"e2e-{shape}-compiled")]
        assert compiled.env["STRUCTD_INFERENCE_COMPILE"] == "default" and compiled.needs == f"build-{shape}"
        for replicas in replicas_run:
            step = steps[names.index(f"e2e-{shape}-eager-g{replicas}")]
            assert step.needs == f"build-{shape}" and step.env["STRUCTD_INFERENCE_COMPILE"] == "off"
            args = step.argv
            assert args[args.index("--concurrency") + 1] == "1,32,128"
            assert args[args.index("--grammar-replicas") + 1] == str(replicas)
            assert args[args.index("--dtype") + 1] == "bfloat16"
    sims = [s for s in steps if s.name.startswith("e2e-sim")]
    assert [s.argv[s.argv.index("--grammar-replicas") + 1] for s in sims] == ["1", "2"]
    assert all(s.argv[s.argv.index("--runners") + 1] == "sim2,sim5" for s in sims)
    grammar = [s for s in steps if s.kind == "grammar"]
    assert [s.argv[s.argv.index("--fill-threads") + 1] for s in grammar] == ["1", "4", "8"]
    assert all(s.argv[s.argv.index("--batch-sizes") + 1] == "32,128,256" for s in grammar)
    attention = steps[names.index("attention")]
    assert attention.argv[attention.argv.index("--device") + 1] == "cuda" and "--batches" not in attention.argv
    # One call of the default 480 s runs setup, correctness and the 0.5B shape; the 8B shape and the host path
    # each fit a second call's --budget-seconds 240 beside the setup.
    given = {phase: sum(s.budget for s in steps if s.phase == phase) for phase in {s.phase for s in steps}}
    assert given["setup"] + given["correctness"] + given["realistic"] <= 480
    assert given["setup"] + given["large"] <= 240 and given["setup"] + given["host"] <= 240
    assert steps[1].env == {"CUDA_LAUNCH_BLOCKING": "1"}


@pytest.mark.parametrize("only, smoke, want", [
    pytest.param("", False, {"setup", "correctness", "realistic"}, id="gpu-default-one-calls-worth"),
    pytest.param("", True, None, id="smoke-everything"),
    pytest.param("all", False, None, id="all"),
    pytest.param("large", False, {"setup", "large"}, id="second-call"),
    pytest.param("host, correctness", False, {"setup", "host", "correctness"}, id="listed"),
])
def test_a_call_runs_the_phases_its_only_names(only, smoke, want):
    """Without --only a GPU call runs what its budget holds; the 8B shape and the host path are not started
    with what is left (the first re-plan began an 8B run it then cut off)."""
    assert device_plan.phases_for(only, smoke) == want


def test_an_unknown_phase_is_refused_naming_the_phases():
    with pytest.raises(ValueError, match="no phase gpu .*realistic, large, host, or all"):
        device_plan.phases_for("gpu", False)


def test_the_correctness_phase_runs_every_cuda_marked_test_file():
    """A new `-m cuda` test file is run on the GPU, not forgotten beside the plan."""
    steps = device_plan.plan(smoke=False, repo=REPO, work=Path("/w"), model_root=Path("/m"), schemas=Path("/s"),
                             device_memory=80 * 1024**3, cuda=True)
    listed = sorted(a for a in steps[1].argv if a.startswith("tests/"))
    marker = re.compile(r"^(@pytest\.mark\.cuda\b|pytestmark = .*pytest\.mark\.cuda\b)", re.M)
    marked = sorted(f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py") if marker.search(p.read_text()))
    assert listed == marked


def test_a_pytest_step_cut_off_is_summarised_from_what_it_printed(tmp_path):
    import device_report

    out = tmp_path / "stdout.log"
    out.write_text("collecting ... collected 3 items\n"
                   "tests/test_a.py::test_x PASSED                [ 33%]\n"
                   "tests/test_a.py::test_y[bf16-triton] FAILED   [ 66%]\n"
                   "tests/test_b.py::test_z SKIPPED (needs two CUDA devices) [100%]\n")
    got = device_report.summarize_pytest(tmp_path / "junit.xml", out)
    assert (got["passed"], got["failed"], got["skipped"]) == (1, 1, 1)
    assert got["failures"][0]["test"] == "test_a.py::test_y[bf16-triton]"
    assert got["skips"][0]["reason"] == "needs two CUDA devices" and "cut off" in got["note"]


def test_without_cuda_the_gpu_plan_skips_the_realistic_shapes_and_says_why():
    steps = device_plan.plan(smoke=False, repo=REPO, work=Path("/w"), model_root=Path("/m"), schemas=Path("/s"),
                             device_memory=None, cuda=False)
    shapes = [s for s in steps if s.phase in ("realistic", "large")]
    assert shapes and all(s.skip and "no CUDA device" in s.skip for s in shapes)
    assert all(s.skip is None for s in steps if s.phase not in ("realistic", "large"))


@pytest.mark.parametrize("memory_gib, weights_gib, want_gib", [
    pytest.param(80, 16, 16, id="h100-8b-capped"),
    pytest.param(24, 16, 1, id="small-card-floor"),
    pytest.param(40, 16, 9, id="half-of-what-is-left"),
])
def test_kv_cache_is_sized_from_device_memory(memory_gib, weights_gib, want_gib):
    got = device_plan.kv_cache_bytes(memory_gib * 1024**3, weights_gib * 1024**3)
    assert got == want_gib * 1024**3


def test_a_step_gets_its_budget_plus_what_earlier_steps_left_never_later_ones():
    check = load_script("check")
    steps = [device_plan.Step("p", n, [], budget) for n, budget in (("a", 100), ("b", 50), ("c", 30))]
    now = check.time.monotonic()
    assert check.step_timeout(steps, 0, now + 180) == pytest.approx(100, abs=1)
    # 'a' finished early: 'b' may use what is left but the 30 s 'c' was given.
    assert check.step_timeout(steps, 1, now + 150) == pytest.approx(120, abs=1)
    # 'b' overran into 'c''s share: 'c' gets only what is left.
    assert check.step_timeout(steps, 2, now + 20) == pytest.approx(20, abs=1)
    steps[2].skip = "not here"
    assert check.step_timeout(steps, 1, now + 150) == pytest.approx(150, abs=1)


@pytest.mark.parametrize("name, ok", [
    ("grpcio-1.85.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
    ("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl", True),
    ("transformers-5.23.0-py3-none-any.whl", True),
    ("grpcio-1.85.1-cp311-cp311-manylinux2014_x86_64.whl", False),
    ("protobuf-7.36.2-cp313-abi3-manylinux2014_x86_64.whl", False),
    ("xgrammar-0.2.8-cp312-cp312-manylinux_2_28_aarch64.whl", False),
    ("xgrammar-0.2.8-cp312-cp312-macosx_11_0_arm64.whl", False),
])
def test_prepare_takes_only_wheels_the_gpu_machine_installs(name, ok):
    prepare = load_script("prepare")
    assert (prepare.wheel_ok(Path(name)) is None) == ok


def test_prepare_pins_what_pyproject_pins():
    prepare = load_script("prepare")
    project = (REPO / "pyproject.toml").read_text()
    pins = prepare.pins()
    for name in prepare.PINNED:
        assert f'"{name}=={pins[name]}"' in project
