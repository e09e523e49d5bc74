"""The two Dockerfiles. Docker cannot run here, so the build is replayed
without it: the build context the Dockerfiles see (the files they COPY,
less .dockerignore) gets the stubs generated the way `make setup` does and is
built into the wheel `pip install .` installs, which must carry the stubs
and the `structd` entry point. The rest are the rules every image follows.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.deploy_assets import REPO

DOCKERFILES = {"grammar": REPO / "grammar_svc" / "Dockerfile", "inference": REPO / "inference_svc" / "Dockerfile"}


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
    # The pinned torch, first, from the PyTorch index: CPU build for grammar, CUDA build for inference.
    torch_run = next(r for r in runs if "torch==" in r)
    assert f"torch=={_torch_pin()}" in torch_run
    assert runs.index(torch_run) < next(i for i, r in enumerate(runs) if "pip install ." in r)
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
    build = next(r for r in runs if "pip install ." in r)
    assert build.index("python -m shared.protogen") < build.index("pip install .")
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
    assert any("python -m inference_svc.embedded_model" in r for r in runs)
    user_at = max(n for n, (i, _) in enumerate(ins) if i == "USER")
    build_at = next(n for n, (i, a) in enumerate(ins) if i == "RUN" and "inference_svc.embedded_model" in a)
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


def test_build_context_yields_a_wheel_with_stubs_and_entry_point(tmp_path):
    """COPY sources as the Dockerfile lists them, honouring .dockerignore; then its RUN line."""
    ins = instructions(DOCKERFILES["grammar"])
    assert [a for i, a in instructions(DOCKERFILES["inference"]) if i == "COPY"] == \
        [a for i, a in ins if i == "COPY"], "both images build the same package"
    ignore = _dockerignore()
    ctx = tmp_path / "app"
    ctx.mkdir()
    for _, a in (x for x in ins if x[0] == "COPY"):
        *sources, dest = a.split()
        for src in sources:
            path = REPO / src
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
            for f in files:
                rel = f.relative_to(REPO).as_posix()
                if _ignored(rel, ignore):
                    continue
                target = ctx / (rel if dest.endswith("/") or dest == "./" or path.is_dir() else dest)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
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
    for stub in ("shared/gen/grammar/v1/grammar_service_pb2.py", "shared/gen/grammar/v1/grammar_service_pb2_grpc.py",
                 "shared/gen/inference/v1/inference_service_pb2.py",
                 "shared/gen/inference/v1/inference_service_pb2_grpc.py"):
        assert stub in names, stub
    assert {"grammar_svc/server.py", "inference_svc/server.py", "structd/cli.py"} <= names
    assert "structd = structd.cli:main" in entry_points
