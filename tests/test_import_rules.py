"""The layering, read from the code's own imports (ast: function-local imports count too).

- the three services (grammar_svc/, inference_svc/, gateway/) never import each
  other: the HTTP gateway speaks to the inference service over gRPC only;
- shared/ imports no service nor structd/;
- the domain modules import neither grpc nor protobuf nor the generated stubs
  (shared.gen): they work on domain types, the servicers and
  inference_svc/grammar/grammar_tier.py translate;
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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("grammar_svc", "inference_svc", "gateway")
COMPOSITION = "structd"
# The modules that hold each service's logic on domain types; the wire is their servicers' (and grammar_tier's).
DOMAIN = {
    "inference_svc": ("engine", "scheduler", "request", "sampling", "masking", "model_runner", "paged_kv", "attention",
                      "text_stream", "grammar_session", "step_sampler", "response_text", "frontend", "chat",
                      "tool_calls", "model_family", "schema_check"),
    "grammar_svc": ("stepper", "sessions", "session", "backend", "compile_pool", "cache", "spec", "mask_filler",
                    "bounded_strings", "jump_forward", "json_grammar", "json_strings", "schema_normalise",
                    "output_check"),
    # The gateway is translation and transport; reading a JSON body is its one module with no wire in it.
    "gateway": ("body",),
}
WIRE = ("grpc", "grpc_health", "grpc_reflection", "grpc_status", "grpc_tools", "google.protobuf", "google.rpc",
        "shared.gen")
GENERATED = REPO / "shared" / "gen"


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


def _imports_in(path: Path) -> Iterator[tuple[int, str]]:
    parts = path.relative_to(REPO).with_suffix("").parts
    is_package = parts[-1] == "__init__"
    module = ".".join(parts[:-1] if is_package else parts)
    return imports_of(path.read_text(), module, is_package)


def _matches(name: str, banned: tuple[str, ...]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in banned)


def _files(top: str) -> list[Path]:
    """The Python files of a top-level package (generated stubs left out)."""
    return sorted(p for p in (REPO / top).rglob("*.py")
                  if "__pycache__" not in p.parts and not p.is_relative_to(GENERATED))


def _packages() -> list[str]:
    return sorted(p.parent.name for p in REPO.glob("*/__init__.py"))


def _violations(files: list[Path], banned: tuple[str, ...]) -> list[str]:
    """One line per offending statement (`from x import y` is read as x and x.y: the shorter is named)."""
    found: dict[tuple[str, int], str] = {}
    for p in files:
        for line, name in _imports_in(p):
            key = (str(p.relative_to(REPO)), line)
            if _matches(name, banned) and len(name) < len(found.get(key, name + " ")):
                found[key] = name
    return [f"{path}:{line} imports {name}" for (path, line), name in sorted(found.items())]


# ---------------------------------------------------------------- the rules


def services_never_import_each_other() -> list[str]:
    """grammar_svc/, inference_svc/ and gateway/ never import each other."""
    return [v for own in SERVICES
            for v in _violations(_files(own), tuple(s for s in SERVICES if s != own))]


def shared_imports_no_service_nor_structd() -> list[str]:
    """shared/ is what services and clients share: it imports neither service nor the composition root."""
    return _violations(_files("shared"), (*SERVICES, COMPOSITION))


def domain_modules_import_no_grpc_nor_stubs() -> list[str]:
    """Domain modules work on domain types: no grpc, no protobuf, no generated stubs."""
    paths = [REPO / service / f"{m}.py" for service, modules in DOMAIN.items() for m in modules]
    missing = [f"{p.relative_to(REPO)} does not exist: update DOMAIN" for p in paths if not p.is_file()]
    return missing + _violations([p for p in paths if p.is_file()], WIRE)


def only_structd_and_tests_import_structd() -> list[str]:
    """structd/ composes the services; nothing but itself and the tests imports it (not even by `-m`)."""
    files = [p for top in _packages() if top not in (COMPOSITION, "tests") for p in _files(top)]
    return _violations(files + sorted(REPO.glob("*.py")), (COMPOSITION,))


@pytest.mark.parametrize("rule", [
    pytest.param(services_never_import_each_other, id="services-never-import-each-other"),
    pytest.param(shared_imports_no_service_nor_structd, id="shared-imports-no-service-nor-structd"),
    pytest.param(domain_modules_import_no_grpc_nor_stubs, id="domain-modules-import-no-grpc-nor-stubs"),
    pytest.param(only_structd_and_tests_import_structd, id="only-structd-and-tests-import-structd"),
])
def test_import_rule(rule: Callable[[], list[str]]):
    violations = rule()
    assert not violations, f"{rule.__doc__}\n" + "\n".join(violations)


def test_the_rules_see_every_package():
    assert {*SERVICES, "shared", COMPOSITION, "tests"} <= set(_packages())
    assert all(_files(top) for top in (*SERVICES, "shared", COMPOSITION))


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
    assert {"grpc", "os.path", "shared.gen.grammar.v1", "shared.gen", "inference_svc.sibling", "shared",
            "inference_svc.sub.mod", "grammar_svc.compile.spec", "structd.cli", "google.protobuf", "structd",
            "grammar_svc.compile.compile_worker"} <= names
    assert {n for _, n in imports_of("from . import x", "inference_svc", is_package=True)} >= {"inference_svc.x"}
    assert _matches("shared.gen.grammar.v1", WIRE) and _matches("grpc", WIRE)
    assert not _matches("shared.generate", ("shared.gen",)) and not _matches("grpcio", WIRE)
