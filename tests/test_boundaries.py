"""The boundaries the design states, read from every product module's imports.

Imports are read with `ast`, nothing is imported (so no torch and no grpc is
needed): every `import` and `from ... import` anywhere in a module counts,
also inside functions and under TYPE_CHECKING; the scheduler core's purity
also follows what importing it actually runs (module-level imports and
parent packages), which replaces a subprocess that imported it.

    kvstash.sim           kvstash sim / calibrate: runs the scheduler core itself,
      |                   drives a real worker and cache to calibrate
    kvstash.launch        the `kvstash` command, stack, gateway, demo
      |  (starts the services, and kvstash.sim, as processes: imports none)
    scheduler_svc  cache_svc  gpu_worker     never import each other
      |                                      only gpu_worker imports torch
    kvstash (Client)  kvstash.cache_sdk
      |
    kvstash.common
      |
    kvstash.errors  kvstash.v1 (generated)

Each rule is a function from the import graph to its violations; the tests
below run it on the real graph, and on the real graph with one bad import
added, so every rule is seen to fail.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVICES = ("scheduler_svc", "cache_svc", "gpu_worker")
PRODUCT = ("kvstash", *SERVICES)

# Component -> the components it may import (besides itself). One row per
# component of the picture above; a new dependency is a design change, made here.
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),  # the vocabulary every side shares: a leaf
    "v1": set(),  # generated (not scanned)
    "common": {"errors", "v1"},  # what the services share
    "cache_sdk": {"errors", "v1", "common"},  # the cache's client, codec and arena
    "sdk": {"errors", "v1", "common"},  # what users import: no launcher, no service
    "scheduler_svc": {"errors", "v1", "common", "cache_sdk"},
    "cache_svc": {"errors", "v1", "common", "cache_sdk"},
    "gpu_worker": {"errors", "v1", "common", "cache_sdk"},
    # Runs the services as processes: imports none of them.
    "launch": {"errors", "v1", "common", "cache_sdk", "sdk"},
    # The simulator: what it simulates is the scheduler's own code (its core,
    # its decision record), and it calibrates by starting a worker and a cache
    # (launch), driving the worker as the scheduler does (its worker link) and
    # timing the cache's own disk files. Nothing of ours imports it.
    "sim": {"errors", "v1", "common", "cache_sdk", "sdk", "launch", "scheduler_svc",
            "cache_svc"},
}
# The worker's optional dependencies (pyproject's `worker` extra).
WORKER_ONLY = ("torch", "numpy", "safetensors")
CORE = "scheduler_svc.core"
# What the scheduler core may import besides the standard library and itself:
# plain-Python domain modules of kvstash, and a hash function.
PURE_KVSTASH = ("kvstash.errors", "kvstash.common.ids", "kvstash.common.sampling",
                "kvstash.common.units", "kvstash.common.layout", "kvstash.common.stats")
CORE_THIRD_PARTY = ("xxhash",)
# Standard-library modules the core must not use: it runs without an event loop.
CORE_BANNED_STDLIB = ("asyncio",)


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's target, as the module it loads."""

    target: str  # `from p import name` is p.name when that is a module, else p
    line: int
    runtime: bool  # runs when the module is imported: module level, not TYPE_CHECKING


Graph = dict[str, list[Import]]


def module_files() -> dict[str, Path]:
    """Every module of the product packages (kvstash/v1 included) by dotted name."""
    files = {}
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_in(module: str, path: Path, known: set[str]) -> list[Import]:
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, runtime: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno, runtime) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[:len(module.split(".")) - (not is_package)]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(sub if sub in known else base, node.lineno, runtime))
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            for statement in node.body:
                visit(statement, False)
            for statement in node.orelse:
                visit(statement, runtime)
        else:
            inner = runtime and not isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            for child in ast.iter_child_nodes(node):
                visit(child, inner)

    visit(ast.parse(path.read_text()), True)
    return found


def import_graph() -> Graph:
    """Product module -> its imports; generated code is not scanned."""
    files = module_files()
    return {name: imports_in(name, path, set(files)) for name, path in files.items()
            if not name.startswith("kvstash.v1")}


def component(module: str) -> str | None:
    """The component a module belongs to (MAY_IMPORT's keys); None: not ours."""
    parts = module.split(".")
    if parts[0] in SERVICES:
        return parts[0]
    if parts[0] != "kvstash":
        return None
    if len(parts) == 1:
        return "sdk"
    if parts[1] in ("errors", "v1", "common", "cache_sdk", "launch", "sim"):
        return parts[1]
    return "sdk"  # any other module left in kvstash/ is what users import


def top(module: str) -> str:
    return module.split(".", maxsplit=1)[0]


# -- the rules -----------------------------------------------------------------

def layering_violations(graph: Graph) -> list[str]:
    """Each component imports itself and what MAY_IMPORT lists, nothing else
    of ours: no service imports another, the users' SDK imports no launcher
    and no service, services do not import the launcher, the launcher no service."""
    bad = []
    for module, imports in graph.items():
        own = component(module)
        assert own is not None
        for imp in imports:
            other = component(imp.target)
            if other is not None and other != own and other not in MAY_IMPORT[own]:
                bad.append(f"{module}:{imp.line} ({own}) imports {imp.target} ({other})")
    return bad


def torch_violations(graph: Graph) -> list[str]:
    """Only the worker imports torch (and the worker's other extras)."""
    return [f"{module}:{imp.line} imports {imp.target}"
            for module, imports in graph.items() if top(module) != "gpu_worker"
            for imp in imports if top(imp.target) in WORKER_ONLY]


def allowed_in_core(target: str) -> bool:
    name = top(target)
    if name in sys.stdlib_module_names:
        return name not in CORE_BANNED_STDLIB
    return (name in CORE_THIRD_PARTY or target == CORE or target.startswith(CORE + ".")
            or target in PURE_KVSTASH)


def parents(module: str) -> Iterator[str]:
    parts = module.split(".")
    for k in range(1, len(parts)):
        yield ".".join(parts[:k])


def core_violations(graph: Graph) -> list[str]:
    """The core imports only the standard library (no asyncio), xxhash, itself
    and the pure kvstash modules, anywhere in its code; and importing it runs
    nothing else: module-level imports and parent packages are followed
    through everything it loads."""
    core = [m for m in graph if m == CORE or m.startswith(CORE + ".")]
    enclosing = {p for m in [*core, *PURE_KVSTASH] for p in parents(m)}
    bad = [f"{module}:{imp.line} imports {imp.target}"
           for module in core for imp in graph[module] if not allowed_in_core(imp.target)]
    loaded_by: dict[str, str] = {}  # product module -> the module that loads it
    todo = [(m, m) for m in core]
    while todo:
        module, by = todo.pop()
        if module in loaded_by or module not in graph:
            continue
        loaded_by[module] = by
        todo.extend((p, module) for p in parents(module))
        for imp in graph[module]:
            if not imp.runtime:
                continue
            todo.append((imp.target, module))
            if module not in core and not (allowed_in_core(imp.target)
                                           or imp.target in enclosing):
                bad.append(f"{module}:{imp.line} imports {imp.target} "
                           f"(loaded with the core, by {loaded_by[module]})")
    return bad


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A path that comes back to where it started, or None."""
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


def cycle_violations(graph: Graph) -> list[str]:
    """No import cycle among product modules (any import counts: a lazy or
    TYPE_CHECKING import that closes a loop still ties the modules together)."""
    edges = {m: {i.target for i in imports if i.target in graph and i.target != m}
             for m, imports in graph.items()}
    cycle = find_cycle(edges)
    return [" -> ".join(cycle)] if cycle else []


RULES: dict[str, Callable[[Graph], list[str]]] = {
    "layering": layering_violations,
    "torch": torch_violations,
    "core": core_violations,
    "cycles": cycle_violations,
}


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph()


def test_the_graph_reads_every_package(graph: Graph) -> None:
    for module in ("kvstash.client", "kvstash.common.rpc_server", "kvstash.cache_sdk.cache_client",
                   "kvstash.launch.stack", "scheduler_svc.core.scheduler", "cache_svc.server",
                   "gpu_worker.runner"):
        assert graph[module], module
    assert {component(m) for m in graph} == set(MAY_IMPORT) - {"v1"}
    targets = {i.target for i in graph["kvstash.launch.cli"]}
    assert {"kvstash.errors", "kvstash.common.security", "kvstash.launch.stack"} <= targets
    lazy = [i for i in graph["kvstash"] if i.target == "kvstash.client"]
    assert lazy and not lazy[0].runtime  # inside a function: not run on import


@pytest.mark.parametrize("rule", sorted(RULES))
def test_rule_holds(graph: Graph, rule: str) -> None:
    bad = RULES[rule](graph)
    assert not bad, f"{RULES[rule].__doc__}\n" + "\n".join(bad)


def added(graph: Graph, module: str, target: str, runtime: bool = True) -> Graph:
    """The graph with one more import in `module`."""
    return {**graph, module: [*graph[module], Import(target, 0, runtime)]}


@pytest.mark.parametrize(("rule", "module", "target", "found"), [
    ("layering", "cache_svc.server", "scheduler_svc.engine", "(scheduler_svc)"),
    ("layering", "gpu_worker.server", "cache_svc.arena", "(cache_svc)"),
    ("layering", "kvstash.client", "kvstash.launch.stack", "(launch)"),
    ("layering", "kvstash.client", "scheduler_svc.engine", "(scheduler_svc)"),
    ("layering", "scheduler_svc.engine", "kvstash.launch.processes", "(launch)"),
    ("layering", "kvstash.launch.stack", "scheduler_svc.server", "(scheduler_svc)"),
    ("layering", "kvstash.common.rpc_errors", "kvstash.client", "(sdk)"),
    ("layering", "kvstash.errors", "kvstash.common.units", "(common)"),
    ("torch", "scheduler_svc.engine", "torch", "torch"),
    ("torch", "kvstash.common.layout", "numpy", "numpy"),
    ("core", "scheduler_svc.core.scheduler", "grpc", "grpc"),
    ("core", "scheduler_svc.core.scheduler", "asyncio", "asyncio"),
    ("core", "scheduler_svc.core.scheduler", "kvstash.v1.common_pb2", "kvstash.v1"),
    ("core", "scheduler_svc.core.scheduler", "scheduler_svc.engine", "scheduler_svc.engine"),
    ("core", "scheduler_svc.core.scheduler", "kvstash.common.rpc_errors",
     "kvstash.common.rpc_errors"),
    # Not in the core, but loaded with it: a pure module that pulls grpc.
    ("core", "kvstash.common.ids", "grpc", "loaded with the core"),
    ("core", "kvstash.common.sampling", "opentelemetry", "loaded with the core"),
    ("cycles", "kvstash.common.units", "kvstash.launch.cli", "kvstash.common.units"),
    ("cycles", "scheduler_svc.core.lifecycle", "scheduler_svc.core.scheduler", "lifecycle"),
])
def test_rule_finds_a_bad_import(graph: Graph, rule: str, module: str, target: str,
                                 found: str) -> None:
    bad = RULES[rule](added(graph, module, target))
    assert any(found in b for b in bad), bad


def test_an_import_inside_a_function_of_a_loaded_module_is_not_loaded(graph: Graph) -> None:
    """kvstash/__init__ loads the client lazily: the core may import kvstash.errors."""
    assert not core_violations(added(graph, "kvstash.common.ids", "grpc", runtime=False))
    assert core_violations(added(graph, "kvstash", "grpc"))


def test_the_cycle_check_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
