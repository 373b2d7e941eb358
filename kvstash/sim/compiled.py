"""`kvstash sim --core compiled`: the scheduler core, compiled by mypyc.

The simulator runs `scheduler_svc/core`, the code that serves, unchanged,
so it runs at that code's speed in CPython. mypyc (part of mypy) compiles
the same typed sources into C extension modules, as mypy and black ship
themselves; the simulator's process then imports those in place of the
sources. Nothing else does: the services always run the sources.

    key      sha256 of the Python version, mypyc's version and every source
    build    mypyc over the core's modules (setuptools, a C compiler), its
             extension modules kept in <cache>/<key>/, written once
    use      a finder ahead of the path: scheduler_svc.core.<module> -> its
             extension module; the package itself and all else as before

The cache is $KVSTASH_CACHE_DIR, else $XDG_CACHE_HOME/kvstash, else
~/.cache/kvstash. A build whose sources changed since is never used: its
key is another.

Compiled code trusts its annotations: given a value of another type (a
string for an enum setting, True for a count, a float token id) it raises
TypeError or takes it as it is, where the sources coerce it or answer
InvalidArgument. The simulator builds its configs and prompts typed; the
same pressured workloads, P/D pools and a real stack's decision record
decide identically under both (tests/kvstash/sim/test_compiled.py,
test_decisions_replay.py).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PACKAGE = "scheduler_svc.core"
CORES = ("auto", "compiled", "python")
_BUILDING = ".building-"
_SETUP = """
import json, os, sys
from setuptools import setup
from mypyc.build import mypycify
setup(name="kvstash-core", script_args=sys.argv[1:],
      ext_modules=mypycify(json.loads(os.environ["KVSTASH_MYPYC_ARGS"]),
                           target_dir=os.environ["KVSTASH_MYPYC_C"]))
"""


def _root() -> Path:
    """The directory holding the scheduler_svc package (a checkout, or site-packages)."""
    spec = importlib.util.find_spec("scheduler_svc")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent.parent


def sources(root: Path | None = None) -> list[Path]:
    """What mypyc compiles: the core's modules (the package's __init__ stays a
    source). The simulator's own loop around them gains nothing measurable
    compiled, and stays a source too."""
    core = (root or _root()) / "scheduler_svc" / "core"
    return sorted(p for p in core.glob("*.py") if p.name != "__init__.py")


def module_name(path: Path) -> str:
    return f"{path.parent.parent.name}.{path.parent.name}.{path.stem}"


def cache_dir() -> Path:
    base = os.environ.get("KVSTASH_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvstash"


def key(files: Sequence[Path]) -> str:
    """What a build depends on: the interpreter, mypyc, and every source's bytes."""
    digest = hashlib.sha256(sys.version.encode())
    digest.update(_mypyc_version().encode())
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def _mypyc_version() -> str:
    try:
        from mypy.version import __version__
    except ImportError:
        return "none"
    return __version__


def _suffix() -> str:
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert isinstance(suffix, str)
    return suffix


def built(directory: Path, files: Sequence[Path]) -> dict[str, Path] | None:
    """Module name -> extension module of a complete build in `directory`, or None."""
    modules = {module_name(p): directory / p.parent.parent.name / p.parent.name /
               (p.stem + _suffix()) for p in files}
    if not all(path.is_file() for path in modules.values()):
        return None
    return modules


def build(files: Sequence[Path], directory: Path) -> None:
    """Compiles `files` into `directory` (written whole, then renamed into place).
    RuntimeError, with mypyc's last words, where it cannot."""
    if _mypyc_version() == "none":
        raise RuntimeError("--core compiled needs mypyc: pip install 'kvstash[bench]' "
                           "(mypy ships it), and a C compiler")
    root = _root()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=_BUILDING, dir=directory.parent) as tmp:
        work = Path(tmp)
        args = ["--cache-dir", str(work / "mypy"), "--ignore-missing-imports",
                *(str(p.relative_to(root)) for p in files)]
        env = {**os.environ, "KVSTASH_MYPYC_ARGS": json.dumps(args),
               "KVSTASH_MYPYC_C": str(work / "c")}
        done = subprocess.run(
            [sys.executable, "-c", _SETUP, "build_ext", "--build-lib", str(work / "out"),
             "--build-temp", str(work / "temp")],
            cwd=root, env=env, capture_output=True, text=True, check=False)
        if done.returncode or built(work / "out", files) is None:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"mypyc could not compile the scheduler core:\n{tail}")
        try:
            (work / "out").rename(directory)
        except OSError:  # another process built it first
            if built(directory, files) is None:
                raise
    for other in directory.parent.iterdir():  # builds of older sources, not builds under way
        if other != directory and other.is_dir() and not other.name.startswith(_BUILDING):
            shutil.rmtree(other, ignore_errors=True)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, modules: dict[str, Path]) -> None:
        self.modules = modules

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        file = self.modules.get(fullname)
        return None if file is None else importlib.util.spec_from_file_location(fullname, file)


def activate(core: str) -> str:
    """Before anything imports the core: 'compiled' (building it where needed)
    or 'auto' (compiled where a build of these sources exists) make this
    process import the compiled modules. Returns the core it will run."""
    if core not in CORES:
        raise ValueError(f"--core must be one of {', '.join(CORES)}, got {core!r}")
    if core == "python":
        return "python"
    files = sources()
    if any(module_name(p) in sys.modules for p in files):  # in-process callers
        if core == "compiled" and running() != "compiled":
            raise RuntimeError("--core compiled: this process imported the core's sources "
                               "already; run it as `kvstash sim`")
        return running()
    directory = cache_dir() / "mypyc" / key(files)
    modules = built(directory, files)
    if modules is None:
        if core == "auto":
            return "python"
        build(files, directory)
        modules = built(directory, files)
        assert modules is not None
    sys.path.append(str(directory))  # mypyc's shared runtime module, by its own name
    sys.meta_path.insert(0, _Finder(modules))
    return "compiled"


def running() -> str:
    """Which core this process imported: 'compiled' or 'python'."""
    module = sys.modules.get(f"{PACKAGE}.scheduler")
    origin = getattr(module, "__file__", "") or ""
    return "python" if origin.endswith(".py") else "compiled"
