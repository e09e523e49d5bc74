"""The gateway image holds no model libraries: pyproject's dependencies split so the gateway installs the base and
its light `gateway` extra, what the gateway imports is all in them, and its Dockerfile installs nothing else.

The import check runs in a fresh interpreter where every installed package outside what `.[gateway]` installs
(the base and the gateway extra, with their dependencies) is made unimportable, as it is absent from the image:
importing any gateway module that needs one fails there, while optional imports (try/except ImportError) fall
back as they would in the image.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy_assets import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
MODEL_LIBRARIES = ("torch", "transformers", "xgrammar")
# Packages of this repository: not dependencies.
OWN_PACKAGES = {"gateway", "shared", "structd", "grammar_svc", "inference_svc"}

# Imports every module of the gateway package and the CLI module the image's entry point runs, with the given
# top-level modules unimportable, then prints the modules imported and the top-level modules loaded.
_PROBE = """
import importlib, json, pkgutil, sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` raises ImportError, as in the image
import gateway
modules = ["structd.cli"] + [m.name for m in pkgutil.walk_packages(gateway.__path__, "gateway.")]
for m in modules:
    importlib.import_module(m)
print(json.dumps({{"modules": modules, "loaded": sorted({{k.split(".")[0] for k, v in sys.modules.items() if v}})}}))
"""


def _closure(requirements: list[str]) -> set[str]:
    """Distributions installed to satisfy the requirements, transitively (markers evaluated, extras followed)."""
    seen: set[str] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name == "structd":
            todo.extend((Requirement(r), "") for e in req.extras for r in PYPROJECT["optional-dependencies"][e])
            continue
        first = name not in seen
        seen.add(name)
        for wanted in ([""] if first else []) + sorted(req.extras):
            todo.extend((Requirement(r), wanted) for r in importlib.metadata.requires(req.name) or [])
    return seen


def _gateway_image_packages() -> set[str]:
    return _closure(PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"]["gateway"])


def _outside_the_image() -> list[str]:
    """Installed top-level modules whose distributions `.[gateway]` does not install."""
    allowed = _gateway_image_packages()
    return sorted(m for m, dists in importlib.metadata.packages_distributions().items()
                  if m not in OWN_PACKAGES and not {canonicalize_name(d) for d in dists} & allowed)


@pytest.fixture(scope="module")
def probe() -> dict:
    blocked = _outside_the_image()
    assert set(MODEL_LIBRARIES) <= set(blocked)
    out = subprocess.run([sys.executable, "-c", _PROBE.format(blocked=blocked)], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, "a gateway module needs a package the gateway image lacks:\n" + out.stderr[-4000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_gateway_modules_import_with_only_what_the_gateway_extra_installs(probe):
    assert {"gateway.server", "gateway.app", "gateway.__main__"} <= set(probe["modules"])
    assert not set(MODEL_LIBRARIES) & set(probe["loaded"])


def test_the_gateway_extra_pulls_no_model_library():
    assert not {canonicalize_name(m) for m in MODEL_LIBRARIES} & _gateway_image_packages()


def test_the_base_dependencies_hold_no_model_library_and_make_setup_installs_everything():
    base = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["dependencies"]}
    assert not base & set(MODEL_LIBRARIES)
    extras = PYPROJECT["optional-dependencies"]
    assert {canonicalize_name(Requirement(r).name) for r in extras["grammar"]} >= set(MODEL_LIBRARIES)
    assert "structd[grammar]" in extras["inference"], "the inference service needs what the grammar service does"
    makefile = (REPO / "Makefile").read_text()
    setup = makefile.split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]  # the recipe make setup runs
    (installed,) = re.findall(r"pip install [^\n]*'\.\[([a-z,]+)\]'", setup)
    named = set(installed.split(","))
    expanded = named | {e for n in named for r in extras[n] if Requirement(r).name == "structd"
                        for e in Requirement(r).extras}
    # `make mutation` installs its own extra (docs/mutation.md): a tool for a documented command, not for make test.
    assert expanded == set(extras) - {"mutation"}, f"make setup leaves out extras: {sorted(set(extras) - expanded)}"
    assert "pip install --quiet -e '.[mutation]'" in makefile.split("\nmutation: setup", 1)[1]


def _pip_installs(dockerfile: str) -> list[str]:
    """The arguments of every `pip install` in a Dockerfile's RUN lines (continuations joined)."""
    text = (REPO / dockerfile).read_text().replace("\\\n", " ")
    return [m.group(1).strip() for m in re.finditer(r"pip install ([^&\n]+)", text)]


def test_the_gateway_dockerfile_installs_the_gateway_extra_only():
    installs = _pip_installs("gateway/Dockerfile")
    grpcio_tools = next(r for r in PYPROJECT["dependencies"] if r.startswith("grpcio-tools"))
    assert installs == [grpcio_tools, '".[gateway]"'], installs
    assert not any(lib in " ".join(installs) for lib in MODEL_LIBRARIES)


def test_each_service_dockerfile_installs_its_own_extra():
    assert _pip_installs("grammar_svc/Dockerfile")[-1] == '".[grammar]"'
    assert _pip_installs("inference_svc/Dockerfile")[-1] == '".[inference]"'
