"""The layering, read from the code's own imports (ast: function-local and TYPE_CHECKING imports count too).

- the three services (grammar_svc/, inference_svc/, gateway/) never import each
  other: the HTTP gateway speaks to the inference service over gRPC only;
- shared/ imports no service nor structd/;
- the domain modules import neither grpc nor protobuf nor the generated stubs
  (shared.gen): they work on domain types. In grammar_svc/ and inference_svc/
  every module is a domain module but those listed in WIRE_SPEAKERS (the
  servicers, inference_svc/grammar/grammar_tier.py that translates the
  grammar tier's wire, and each server that serves them), so a new module is
  checked without anyone adding it to a list;
- each layer folder of a service imports only the folders below it (LAYERS),
  e.g. inference_svc/model/ nothing of api/, engine/, core/ or grammar/;
- no module imports itself back through others: no import cycle among the
  repository's modules, whether the import runs at load time, in a function,
  or only under TYPE_CHECKING (a cycle that type checking needs is still two
  modules that cannot be read apart; the value types both sides name go in
  the service's leaf module, inference_svc/types.py or grammar_svc/types.py,
  which imports nothing of the service at all);
- every import of a repository module names one that exists (a module moved
  without all of its importers following is found here, not by the first
  process that runs the line);
- nothing outside structd/ and tests/ imports structd/, the composition root.

An import here is `import x`, `from x import y` (also as x.y: y may be a
module), a relative import resolved against its package, importlib's
import_module or __import__ with a literal name, and `-m NAME` in a literal
command line (a module that starts another as a process depends on it just
as much). ../shared/tools/import_rules.py checks the first three rules from
outside the repository (absolute imports only).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("grammar_svc", "inference_svc", "gateway")
COMPOSITION = "structd"
# Per service, the modules that speak the wire (paths inside the service): its servicers, the inference
# service's link to the grammar tier (grammar_tier.py turns requests into grammar.v1 and answers back), and the
# servers that serve them. Every other module of the service is a domain module.
WIRE_SPEAKERS = {
    "inference_svc": ("server.py", "api/servicer.py", "grammar/grammar_tier.py"),
    "grammar_svc": ("server.py", "servicer.py"),
}
# The gateway is translation and transport; reading a JSON body is its one module with no wire in it.
GATEWAY_DOMAIN = ("body.py",)
WIRE = ("grpc", "grpc_health", "grpc_reflection", "grpc_status", "grpc_tools", "google.protobuf", "google.rpc",
        "shared.gen")
GENERATED = Path("shared") / "gen"

# Per service: which of its folders each layer folder may import, besides itself. A folder is a sub-package
# ("engine", "model/head") or a top-level module ("types"); the folders a service has and this does not name
# (its server, __main__, config and metrics: the composition and what every layer is configured and counted
# by) are not ruled, but a ruled folder imports them only where listed.
LAYERS = {
    "inference_svc": {
        # The value types every layer shares: the leaf, importing nothing of the service.
        "types": (),
        "model/head": (),
        # The forward pass: weights, KV cache, attention, the LM head.
        "model": ("model/head", "config"),
        # The link to the grammar tier: compiles, step streams, masks.
        "grammar": ("types",),
        # Where a step is planned and its tokens drawn: asks the grammar for masks and the model for logits.
        "engine": ("grammar", "model", "model/head", "types", "config", "metrics"),
        # The API layer: what a client asks for, turned into what the engine runs.
        "api": ("engine", "types", "config"),
        # The engine assembled and run in a process of its own; it loads the model's chat template and family
        # (api/chat.py, api/model_family.py) for the tokenizer's view and for the API side.
        "core": ("api", "engine", "grammar", "model", "types", "config", "metrics"),
    },
    "grammar_svc": {
        # A constraint's kind and JSON options: the leaf, importing nothing of the service.
        "types": (),
        # JSON Schema to grammar text: pure, no compiler.
        "schema": ("types",),
        # Tokenizers, compiling in worker processes, the compiled-grammar cache.
        "compile": ("schema", "types", "metrics"),
        # The per-step path: sessions, masks, jump-forward.
        "step": ("compile", "types", "metrics"),
    },
}


# ---------------------------------------------------------------- reading imports


def _literal(node: ast.AST) -> object:
    return node.value if isinstance(node, ast.Constant) else None


def _is_import_call(func: ast.expr) -> bool:
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    return name in ("import_module", "__import__")


def imports_of(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, module name) for everything `module` (dotted name) imports, wherever in the file."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[:len(parts) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            if base:
                yield node.lineno, base
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{base}.{alias.name}" if base else alias.name
        elif isinstance(node, ast.Call) and _is_import_call(node.func) and node.args \
                and isinstance(_literal(node.args[0]), str):
            yield node.lineno, _literal(node.args[0])
        elif isinstance(node, (ast.List, ast.Tuple)):
            for flag, name in zip(node.elts, node.elts[1:]):
                if _literal(flag) == "-m" and isinstance(_literal(name), str):
                    yield name.lineno, _literal(name)


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    """(dotted name, is a package) of a file under root."""
    parts = path.relative_to(root).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _imports_in(path: Path, root: Path = REPO) -> tuple[tuple[int, str], ...]:
    return _read_imports(path.read_text(), *_module_name(path, root))


@functools.lru_cache(maxsize=None)
def _read_imports(source: str, module: str, is_package: bool) -> tuple[tuple[int, str], ...]:
    """imports_of, parsed once per file text (every rule reads every file)."""
    return tuple(imports_of(source, module, is_package))


def _matches(name: str, banned: tuple[str, ...]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in banned)


def _files(top: str, root: Path = REPO) -> list[Path]:
    """The Python files of a top-level package (generated stubs left out)."""
    return sorted(p for p in (root / top).rglob("*.py")
                  if "__pycache__" not in p.parts and not p.is_relative_to(root / GENERATED))


def _packages(root: Path = REPO) -> list[str]:
    return sorted(p.parent.name for p in root.glob("*/__init__.py"))


def _violations(files: list[Path], banned: tuple[str, ...], root: Path = REPO) -> list[str]:
    """One line per offending statement (`from x import y` is read as x and x.y: the shorter is named)."""
    found: dict[tuple[str, int], str] = {}
    for p in files:
        for line, name in _imports_in(p, root):
            key = (str(p.relative_to(root)), line)
            if _matches(name, banned) and len(name) < len(found.get(key, name + " ")):
                found[key] = name
    return [f"{path}:{line} imports {name}" for (path, line), name in sorted(found.items())]


# ---------------------------------------------------------------- the repository's modules and their imports


def _modules(root: Path) -> dict[str, Path]:
    """Every module of the repository's packages, by dotted name."""
    return {_module_name(p, root)[0]: p for top in _packages(root) for p in _files(top, root)}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The repository module an imported name lives in (its longest prefix that is one), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _edges(root: Path) -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line}, repository modules only.

    `from pkg import mod` depends on pkg.mod, not on pkg's __init__ beyond
    what Python runs anyway: where a statement's longer name is itself a
    module, its shorter one is dropped, so a package that re-exports a
    submodule is not read as a cycle with it.
    """
    modules = _modules(root)
    edges: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        by_line: dict[int, set[str]] = {}
        for line, imported in _imports_in(path, root):
            by_line.setdefault(line, set()).add(imported)
        out: dict[str, int] = {}
        for line, names in sorted(by_line.items()):
            for imported in names:
                if any(other.startswith(imported + ".") and other in modules for other in names):
                    continue
                target = _resolve(imported, modules)
                if target is not None and target != name:
                    out.setdefault(target, line)
        edges[name] = out
    return edges


# ---------------------------------------------------------------- the rules


def services_never_import_each_other(root: Path = REPO) -> list[str]:
    """grammar_svc/, inference_svc/ and gateway/ never import each other."""
    return [v for own in SERVICES
            for v in _violations(_files(own, root), tuple(s for s in SERVICES if s != own), root)]


def shared_imports_no_service_nor_structd(root: Path = REPO) -> list[str]:
    """shared/ is what services and clients share: it imports neither service nor the composition root."""
    return _violations(_files("shared", root), (*SERVICES, COMPOSITION), root)


def _domain_files(root: Path) -> tuple[list[Path], list[str]]:
    """(the domain modules, a line for each listed path that does not exist)."""
    files, missing = [], []
    for service, speakers in WIRE_SPEAKERS.items():
        listed = {root / service / s for s in speakers}
        missing += [f"{p.relative_to(root)} does not exist: update WIRE_SPEAKERS" for p in sorted(listed)
                    if not p.is_file()]
        files += [p for p in _files(service, root) if p not in listed]
    gateway = [root / "gateway" / m for m in GATEWAY_DOMAIN]
    missing += [f"{p.relative_to(root)} does not exist: update GATEWAY_DOMAIN" for p in gateway if not p.is_file()]
    return files + [p for p in gateway if p.is_file()], missing


def domain_modules_import_no_grpc_nor_stubs(root: Path = REPO) -> list[str]:
    """Domain modules work on domain types: no grpc, no protobuf, no generated stubs."""
    files, missing = _domain_files(root)
    return missing + _violations(files, WIRE, root)


def _folder(module: str, path: Path) -> tuple[str, str]:
    """(service, folder) of a module: its sub-package inside the service ("model/head"), or its own name for a
    top-level module ("types"); the service's own __init__ is folder ""."""
    service, *inner = module.split(".")
    if path.name == "__init__.py":
        return service, "/".join(inner)
    return service, "/".join(inner[:-1]) or inner[-1]


def each_layer_imports_only_the_layers_below(root: Path = REPO) -> list[str]:
    """Each layer folder of a service imports only the folders LAYERS allows it (and itself)."""
    modules, edges = _modules(root), _edges(root)
    found = []
    for module, targets in sorted(edges.items()):
        service, folder = _folder(module, modules[module])
        allowed = LAYERS.get(service, {}).get(folder)
        if allowed is None:
            continue
        for target, line in sorted(targets.items(), key=lambda t: t[1]):
            other_service, other = _folder(target, modules[target])
            if other_service == service and other not in (folder, "", *allowed):
                found.append(f"{modules[module].relative_to(root)}:{line} imports {target} "
                             f"({service}/{folder} may import {', '.join(allowed) or 'nothing of the service'})")
    unknown = [f"LAYERS names {service}/{f}, which is no folder of it" for service, rules in LAYERS.items()
               for f in rules if not ((root / service / f).is_dir() or (root / service / f"{f}.py").is_file())]
    return unknown + found


def _cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def no_import_cycles(root: Path = REPO) -> list[str]:
    """No module imports itself back through others (function-local and TYPE_CHECKING imports count)."""
    modules, edges = _modules(root), _edges(root)
    lines = []
    for component in _cycles(edges):
        members = set(component)
        steps = [f"{modules[m].relative_to(root)}:{line} imports {t}"
                 for m in component for t, line in sorted(edges[m].items()) if t in members]
        lines.append(f"cycle among {', '.join(component)}:\n    " + "\n    ".join(steps))
    return lines


@functools.lru_cache(maxsize=None)
def _bound_names(source: str) -> frozenset[str]:
    """The names a module binds at its top level (under if/try/with too): what `from it import x` may name."""
    names: set[str] = set()
    body = list(ast.parse(source).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
    return frozenset(names)


def every_import_of_the_repository_exists(root: Path = REPO) -> list[str]:
    """Every name imported from a repository package is a module of it, or a name its module binds."""
    modules = _modules(root)
    tops = set(_packages(root))
    found = []
    for module, path in sorted(modules.items()):
        for line, name in _imports_in(path, root):
            if name.partition(".")[0] not in tops or _matches(name, (".".join(GENERATED.parts),)):
                continue
            owner = _resolve(name, modules)
            rest = name[len(owner) + 1:] if owner else name
            if owner is None or (rest and rest.partition(".")[0] not in _bound_names(modules[owner].read_text())):
                found.append(f"{path.relative_to(root)}:{line} imports {name}, which does not exist")
    return found


def only_structd_and_tests_import_structd(root: Path = REPO) -> list[str]:
    """structd/ composes the services; nothing but itself and the tests imports it (not even by `-m`)."""
    files = [p for top in _packages(root) if top not in (COMPOSITION, "tests") for p in _files(top, root)]
    return _violations(files + sorted(root.glob("*.py")), (COMPOSITION,), root)


RULES = [services_never_import_each_other, shared_imports_no_service_nor_structd,
         domain_modules_import_no_grpc_nor_stubs, each_layer_imports_only_the_layers_below, no_import_cycles,
         every_import_of_the_repository_exists, only_structd_and_tests_import_structd]


@pytest.mark.parametrize("rule", [pytest.param(r, id=r.__name__.replace("_", "-")) for r in RULES])
def test_import_rule(rule: Callable[[], list[str]]):
    violations = rule()
    assert not violations, f"{rule.__doc__}\n" + "\n".join(violations)


def test_the_rules_see_every_package():
    assert {*SERVICES, "shared", COMPOSITION, "tests"} <= set(_packages())
    assert all(_files(top) for top in (*SERVICES, "shared", COMPOSITION))
    assert {"types", "engine", "model/head"} <= {_folder(m, p)[1] for m, p in _modules(REPO).items()}


def test_every_kind_of_import_is_read():
    source = '''
import grpc, os.path
from shared.gen.grammar.v1 import grammar_service_pb2 as pb
from shared import gen
from . import sibling
from .. import shared as up_one
from .sub.mod import name


def later():
    from grammar_svc.compile import spec
    import importlib
    importlib.import_module("structd.cli")
    __import__("google.protobuf")


COMMAND = [sys.executable, "-m", "structd", "grammar"]
OTHER = ("python", "-m", "grammar_svc.compile.compile_worker")
'''
    names = {name for _, name in imports_of(source, "inference_svc.engine.engine")}
    assert {"grpc", "os.path", "shared.gen.grammar.v1", "shared.gen", "inference_svc.engine.sibling",
            "inference_svc", "inference_svc.engine.sub.mod", "grammar_svc.compile.spec", "structd.cli",
            "google.protobuf", "structd", "grammar_svc.compile.compile_worker"} <= names
    assert {n for _, n in imports_of("from . import x", "inference_svc", is_package=True)} >= {"inference_svc.x"}
    assert _matches("shared.gen.grammar.v1", WIRE) and _matches("grpc", WIRE)
    assert not _matches("shared.generate", ("shared.gen",)) and not _matches("grpcio", WIRE)


# ---------------------------------------------------------------- each rule can fail

# A repository in miniature that breaks every rule once, each break on a line of its own that says which.
BROKEN = {
    "shared/__init__.py": "",
    "shared/client.py": "import inference_svc.engine.request  # shared imports a service\n",
    "structd/__init__.py": "",
    "tests/__init__.py": "",
    "gateway/__init__.py": "",
    "gateway/body.py": "def read():\n    from grammar_svc.compile import spec  # a service imports another\n",
    "grammar_svc/__init__.py": "",
    "grammar_svc/servicer.py": "import grpc\n",
    "grammar_svc/server.py": "import grpc\n",
    "grammar_svc/schema/__init__.py": "",
    "grammar_svc/schema/normalise.py": "from grammar_svc.step import session  # schema imports step\n",
    "grammar_svc/compile/__init__.py": "",
    "grammar_svc/compile/spec.py": "",
    "grammar_svc/step/__init__.py": "",
    "grammar_svc/step/session.py": "from grammar_svc.compile.spec import Spec  # Spec does not exist\n",
    "inference_svc/__init__.py": "",
    "inference_svc/server.py": "import grpc\nCOMMAND = ['python', '-m', 'structd']  # not the composition root\n",
    "inference_svc/api/__init__.py": "",
    "inference_svc/api/servicer.py": "",
    "inference_svc/grammar/__init__.py": "",
    "inference_svc/grammar/grammar_tier.py": "",
    "inference_svc/types.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from inference_svc.engine.request import Request  # the leaf imports\n"),
    "inference_svc/model/__init__.py": "",
    "inference_svc/model/runner.py": "from inference_svc.engine import request  # model imports engine\n",
    "inference_svc/engine/__init__.py": "",
    "inference_svc/engine/request.py": ("from inference_svc import types\nRequest = object\n\n\n"
                                        "def plan():\n    import google.protobuf  # a domain module reads the wire\n"),
}


@pytest.fixture
def broken(tmp_path) -> Path:
    for rel, text in BROKEN.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


@pytest.mark.parametrize("rule, want", [
    (services_never_import_each_other, ["gateway/body.py:2 imports grammar_svc.compile"]),
    (shared_imports_no_service_nor_structd, ["shared/client.py:1 imports inference_svc.engine.request"]),
    (domain_modules_import_no_grpc_nor_stubs, ["inference_svc/engine/request.py:6 imports google.protobuf"]),
    (each_layer_imports_only_the_layers_below, [
        "grammar_svc/schema/normalise.py:1 imports grammar_svc.step.session (grammar_svc/schema may import "
        "types)",
        "inference_svc/model/runner.py:1 imports inference_svc.engine.request (inference_svc/model may import "
        "model/head, config)",
        "inference_svc/types.py:3 imports inference_svc.engine.request (inference_svc/types may import nothing "
        "of the service)"]),
    (no_import_cycles, ["cycle among inference_svc.engine.request, inference_svc.types:\n"
                        "    inference_svc/engine/request.py:1 imports inference_svc.types\n"
                        "    inference_svc/types.py:3 imports inference_svc.engine.request"]),
    (every_import_of_the_repository_exists, ["grammar_svc/step/session.py:1 imports grammar_svc.compile.spec.Spec, "
                                             "which does not exist"]),
    (only_structd_and_tests_import_structd, ["inference_svc/server.py:2 imports structd"]),
])
def test_each_rule_finds_its_violation(broken: Path, rule, want: list[str]):
    found = rule(broken)
    assert [line for line in found if "does not exist: update" not in line and "no folder of it" not in line] == want


def test_the_lists_the_rules_read_must_name_what_exists(broken: Path):
    (broken / "grammar_svc" / "servicer.py").unlink()
    assert "grammar_svc/servicer.py does not exist: update WIRE_SPEAKERS" in domain_modules_import_no_grpc_nor_stubs(
        broken)
    assert "LAYERS names inference_svc/core, which is no folder of it" in each_layer_imports_only_the_layers_below(
        broken)


def test_a_package_that_re_exports_its_module_is_no_cycle(tmp_path):
    for rel, text in {"pkg/__init__.py": "from pkg.mod import f\n",
                      "pkg/mod.py": "def f():\n    from pkg import other\n",
                      "pkg/other.py": ""}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert no_import_cycles(tmp_path) == []
    (tmp_path / "pkg" / "other.py").write_text("from pkg import mod\n")
    assert no_import_cycles(tmp_path) == [
        "cycle among pkg.mod, pkg.other:\n    pkg/mod.py:2 imports pkg.other\n    pkg/other.py:1 imports pkg.mod"]
