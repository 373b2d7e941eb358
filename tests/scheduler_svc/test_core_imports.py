"""The scheduler's layering: the core is plain Python, and no module imports in a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import scheduler_svc

PACKAGE = Path(scheduler_svc.__file__).parent
# The core runs and is tested without a network, an event loop or a tracer.
BANNED = ("grpc", "asyncio", "opentelemetry", "kvstash.v1", "google.protobuf")


def imports_of_core() -> list[str]:
    """Every module loaded by importing each core module, in a fresh interpreter."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import scheduler_svc.core as core\n"
        "for m in pkgutil.walk_packages(core.__path__, 'scheduler_svc.core.'):\n"
        "    importlib.import_module(m.name)\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=PACKAGE.parent)
    return result.stdout.split()


def test_core_imports_no_grpc_asyncio_opentelemetry_or_protos() -> None:
    loaded = imports_of_core()
    assert "scheduler_svc.core.scheduler" in loaded  # the probe did import the core
    banned = [m for m in loaded if any(m == b or m.startswith(b + ".") for b in BANNED)]
    assert not banned, f"importing scheduler_svc.core loads {banned}"
    outside = [m for m in loaded
               if m.startswith("scheduler_svc.") and not m.startswith("scheduler_svc.core")]
    assert not outside, f"the core imports the service around it: {outside}"


def module_graph() -> dict[str, set[str]]:
    """scheduler_svc module -> the scheduler_svc modules it imports (anywhere in it)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets.add(node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t.startswith("scheduler_svc.") and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_cycle_in_scheduler_svc() -> None:
    graph = module_graph()
    assert "scheduler_svc.core.lifecycle" in graph["scheduler_svc.core.scheduler"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
