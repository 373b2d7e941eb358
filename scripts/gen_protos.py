"""Generates kvstash/v1 from protos/ (the only way that code is produced).

`--check` regenerates into a temporary folder and fails when anything differs
from the committed files, so hand edits and stale code are caught by `make test`.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE = Path("kvstash") / "v1"
INIT = '"""Generated from protos/kvstash/v1 by `make protos`. Do not edit."""\n'


def generate(out_root: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    bindir = Path(sys.executable).parent
    args = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *protos,
    ]
    # The mypy plugins chat on stderr: show it only when something failed.
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"protoc failed:\n{result.stderr}")
    (out_root / PACKAGE / "__init__.py").write_text(INIT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    target = ROOT / PACKAGE
    if not args.check:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / PACKAGE
        names = sorted({p.name for p in fresh.iterdir()} | {p.name for p in target.glob("*.py*")})
        stale = [n for n in names if not (target / n).is_file() or not (fresh / n).is_file()
                 or not filecmp.cmp(target / n, fresh / n, shallow=False)]
    if stale:
        print(f"generated code out of date: {', '.join(stale)}; run `make protos`", file=sys.stderr)
        return 1
    print(f"kvstash/v1 matches protos ({len(names)} files)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
