"""The three Dockerfiles. Docker cannot run here, so the build is replayed
without it: each image's build context (the files its Dockerfile COPYs, less
.dockerignore) gets the stubs generated the way `make setup` does and is
built into the wheel its `pip install` installs, which must carry the stubs,
the `structd` entry point and its own service only: no other service, no
benchmarks, no dependency of another extra. The image's command line and its
server then load from that context alone. The rest are the rules every image
follows.
"""

from __future__ import annotations

import fnmatch
import json
import re
import site
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.deploy_assets import REPO

# Image -> the package of its service.
PACKAGES = {"grammar": "grammar_svc", "inference": "inference_svc", "gateway": "gateway"}
DOCKERFILES = {image: REPO / package / "Dockerfile" for image, package in PACKAGES.items()}
# The extras each image installs besides the base dependencies.
EXTRAS = {"grammar": {"grammar"}, "inference": {"inference"}, "gateway": {"gateway"}}
# The image's `pip install` of the package: `pip install .` or `pip install ".[extra,...]"`.
PIP_INSTALL = re.compile(r"""pip install (['"]?)\.(?:\[([\w,-]+)\])?\1(?:\s|$)""")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in dockerfile.read_text().splitlines()
                                          if not l.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _torch_pin() -> str:
    return re.search(r"torch==([0-9.]+)", (REPO / "Makefile").read_text()).group(1)


@pytest.mark.parametrize("service", sorted(DOCKERFILES))
def test_dockerfile_rules(service):
    ins = instructions(DOCKERFILES[service])
    runs = [a for i, a in ins if i == "RUN"]
    # The pinned torch, first, from the PyTorch index: CPU build for grammar, CUDA build for inference; none in
    # the gateway's image, which never imports it (tests/test_gateway_image.py).
    if service == "gateway":
        assert not [r for r in runs if "torch" in r]
        torch_run = None
    else:
        torch_run = next(r for r in runs if "torch==" in r)
    if torch_run is not None:
        assert f"torch=={_torch_pin()}" in torch_run
        assert runs.index(torch_run) < next(i for i, r in enumerate(runs) if PIP_INSTALL.search(r))
        args = {a.split("=")[0]: a.split("=", 1)[1] for i, a in ins if i == "ARG" and "=" in a}
        index = re.search(r"--index-url\s+(\S+)", torch_run).group(1).strip('"')
        index = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], index)
        if service == "grammar":
            assert index.endswith("/whl/cpu")
        else:
            assert re.search(r"/whl/cu\d+$", index), f"inference needs a CUDA build of torch, not {index}"
    # Stubs as `make setup` makes them, before the package is installed.
    make_setup = re.search(r"^setup:.*\n\t(.*)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert "-m shared.protogen" in make_setup
    build = next(r for r in runs if PIP_INSTALL.search(r))
    assert build.index("python -m shared.protogen") < PIP_INSTALL.search(build).start()
    # Non-root, numerically (runAsNonRoot can only verify numeric users).
    user = [a for i, a in ins if i == "USER"][-1]
    assert re.fullmatch(r"[1-9][0-9]*(:[1-9][0-9]*)?", user), user
    assert ins[-1][0] in ("CMD", "ENTRYPOINT")
    entry = [a for i, a in ins if i == "ENTRYPOINT"][-1]
    assert entry.startswith(f'["structd", "{service}", "--host", "0.0.0.0"')
    env = " ".join(a for i, a in ins if i == "ENV")
    assert "HOME=/tmp" in env, "read-only root filesystem: HOME must be the writable /tmp"


def test_inference_image_prebuilds_the_embedded_model():
    ins = instructions(DOCKERFILES["inference"])
    runs = [a for i, a in ins if i == "RUN"]
    assert any("python -m inference_svc.model.embedded_model" in r for r in runs)
    user_at = max(n for n, (i, _) in enumerate(ins) if i == "USER")
    build_at = next(n for n, (i, a) in enumerate(ins) if i == "RUN" and "inference_svc.model.embedded_model" in a)
    assert build_at < user_at, "built as root into the image, read by the service user"


def _dockerignore() -> list[str]:
    return [l.strip() for l in (REPO / ".dockerignore").read_text().splitlines()
            if l.strip() and not l.startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    for p in patterns:
        p = p.rstrip("/")
        if p.startswith("**/"):
            if any(fnmatch.fnmatch(part, p[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatch("/".join(parts[:n]), p) for n in range(1, len(parts) + 1)):
            return True
    return False


def _setuptools_builds_here() -> bool:
    """pyproject.toml's build requirements are met by this environment."""
    from importlib.metadata import PackageNotFoundError, version

    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    minimum = next(int(m.group(1)) for r in build if (m := re.match(r"setuptools>=(\d+)", r)))
    try:
        return int(version("setuptools").split(".")[0]) >= minimum
    except PackageNotFoundError:
        return False


def _build_context(service: str, ctx: Path) -> None:
    """COPY sources as the Dockerfile lists them (a directory's files below dest, a file into a dest/ folder),
    honouring .dockerignore."""
    ignore = _dockerignore()
    for _, a in (x for x in instructions(DOCKERFILES[service]) if x[0] == "COPY"):
        *sources, dest = a.split()
        for src in sources:
            path = REPO / src
            if path.is_dir():
                pairs = [(f, Path(dest) / f.relative_to(path)) for f in path.rglob("*") if f.is_file()]
            else:
                pairs = [(path, Path(dest) / path.name if dest.endswith("/") else Path(dest))]
            for f, target in pairs:
                if not _ignored(f.relative_to(REPO).as_posix(), ignore):
                    (ctx / target).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, ctx / target)


def _installed_requirements(metadata: str, extras: set[str]) -> list[str]:
    """The wheel's Requires-Dist lines that `pip install .[extras]` installs."""
    out = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist: "):
            req, _, marker = line[len("Requires-Dist: "):].partition(";")
            extra = re.search(r"extra\s*==\s*['\"]([\w-]+)['\"]", marker)
            if extra is None or extra.group(1) in extras:
                out.append(req.strip())
    return out


# Loads the image's command line and its server from the build context alone: no site processing (so no
# editable install of the repository), the environment's site-packages for the third-party dependencies.
PROBE = """
import argparse, importlib, json, sys
ctx, site_dirs, modules, argv = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
sys.path[:] = [ctx, *[p for p in sys.path if p and 'site-packages' not in p], *site_dirs]
for m in modules:
    importlib.import_module(m)
from structd.cli import build_parser
parser = build_parser({})
parser.parse_args(argv)
sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
packages = {m.split('.')[0] for m in sys.modules} & {'grammar_svc', 'inference_svc', 'gateway', 'structd'}
print(json.dumps({"commands": sorted(sub.choices), "loaded": sorted(packages)}))
"""
IMAGE_COMMANDS = {"grammar": ["grammar"], "inference": ["generate", "inference"], "gateway": ["gateway"]}


@pytest.mark.parametrize("service", sorted(DOCKERFILES))
def test_build_context_yields_a_wheel_with_its_service_only(service, tmp_path):
    ins = instructions(DOCKERFILES[service])
    ctx = tmp_path / "app"
    ctx.mkdir()
    _build_context(service, ctx)
    assert not (ctx / "shared" / "gen").exists(), ".dockerignore must keep local stubs out of the context"
    gen = subprocess.run([sys.executable, "-m", "shared.protogen"], cwd=ctx, capture_output=True, text=True,
                         timeout=120)
    assert gen.returncode == 0, gen.stderr
    # The venv's setuptools builds it when new enough (fast, offline); otherwise pip's isolated build.
    isolation = ["--no-build-isolation"] if _setuptools_builds_here() else []
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
                            "-w", str(tmp_path / "dist"), "."], cwd=ctx, capture_output=True, text=True, timeout=300)
    assert wheel.returncode == 0, wheel.stderr
    (whl,) = (tmp_path / "dist").glob("structd-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
        metadata = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    for stub in ("shared/gen/grammar/v1/grammar_service_pb2.py", "shared/gen/grammar/v1/grammar_service_pb2_grpc.py",
                 "shared/gen/inference/v1/inference_service_pb2.py",
                 "shared/gen/inference/v1/inference_service_pb2_grpc.py"):
        assert stub in names, stub
    own = PACKAGES[service]
    others = tuple(f"{p}/" for p in PACKAGES.values() if p != own)
    assert {f"{own}/server.py", f"{own}/__main__.py", "shared/entry.py", "structd/cli.py"} <= names
    if service == "inference":  # data files, not modules: package data, or the image serves no chat or tools
        assert {"inference_svc/model_families/deepseek.json", "inference_svc/model_families/qwen.json",
                "inference_svc/model_families/deepseek.jinja"} <= names
    assert not [n for n in names if n.startswith((*others, "structd/bench/", "tests/"))]
    assert "structd = structd.cli:main" in entry_points
    # Dependencies: the base and this image's extras only; the benchmarks' plotting is in none.
    build = next(a for i, a in ins if i == "RUN" and PIP_INSTALL.search(a))
    extras = set(filter(None, (PIP_INSTALL.search(build).group(2) or "").split(",")))
    assert extras == EXTRAS[service]
    requirements = " ".join(_installed_requirements(metadata, extras))
    assert "matplotlib" not in requirements
    assert ("accelerate" in requirements) == (service == "inference"), "tensor-parallel sharding needs accelerate"
    assert ("uvicorn" in requirements) == (service == "gateway"), "only the gateway serves HTTP"
    # The image's command (ENTRYPOINT + CMD) parses, and the service's server loads, from the context alone.
    entry = json.loads(next(a for i, a in reversed(ins) if i == "ENTRYPOINT"))
    cmd = json.loads(next(a for i, a in reversed(ins) if i == "CMD"))
    assert entry[0] == "structd"
    probe = subprocess.run([sys.executable, "-S", "-E", "-c", PROBE, str(ctx), json.dumps(site.getsitepackages()),
                            json.dumps([f"{own}.server"]), json.dumps(entry[1:] + cmd)],
                           cwd=ctx, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    out = json.loads(probe.stdout.splitlines()[-1])
    assert out["commands"] == IMAGE_COMMANDS[service]
    assert not set(out["loaded"]) & {p for p in PACKAGES.values() if p != own}
