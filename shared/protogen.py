"""Generates the gRPC/protobuf Python stubs from protos/ into shared/gen/.

The stubs are build output (gitignored); `make setup` runs this. protoc sees
protos/ under the virtual path shared/gen/, so generated imports come out
package-qualified (``from shared.gen.grammar.v1 import ...``) without any
rewriting. ``--check`` regenerates into a temporary directory and fails when
the checked-in tree is missing or stale.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
GEN_PACKAGE = "shared/gen"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Writes stubs under out_root/shared/gen and returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = proto_files()
    args = [
        "grpc_tools.protoc",
        f"-I{GEN_PACKAGE}={PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(f) for f in files],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    gen = out_root / GEN_PACKAGE
    # Packages for every directory between shared/gen and the stubs.
    for d in [gen, *[p for p in gen.rglob("*") if p.is_dir()]]:
        (d / "__init__.py").touch()
    return sorted(p for p in gen.rglob("*") if p.is_file())


def _same_tree(a: Path, b: Path) -> list[str]:
    diffs = []
    a_files = {p.relative_to(a) for p in a.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    b_files = {p.relative_to(b) for p in b.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    for rel in sorted(a_files ^ b_files):
        diffs.append(f"missing or extra: {rel}")
    for rel in sorted(a_files & b_files):
        if not filecmp.cmp(a / rel, b / rel, shallow=False):
            diffs.append(f"stale: {rel}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if shared/gen is missing or stale")
    args = parser.parse_args(argv)
    target = ROOT / GEN_PACKAGE
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / GEN_PACKAGE
        if args.check:
            diffs = _same_tree(fresh, target) if target.exists() else ["shared/gen does not exist"]
            for d in diffs:
                print(d, file=sys.stderr)
            if diffs:
                print("stubs are stale: run `make setup`", file=sys.stderr)
                return 1
            print("stubs up to date")
            return 0
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(fresh, target)
    print(f"generated {sum(1 for _ in target.rglob('*.py'))} files in {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
