"""The package's import structure, read from its source: ``python -m tools.architecture``.

Prints which package imports which, layer by layer, and every breach of the rules
``docs/architecture.md`` states (``tests/test_architecture.py`` fails on any):

- the layers below, bottom first: a package imports only from its own or lower layers;
- no import circle, between modules or between packages (imports inside functions and under
  ``TYPE_CHECKING`` count: a circle is a circle to a reader too);
- ``checkpoint`` is imported only by ``strategy`` and the top (the public API, the command line);
- no private name (``_x``) imported from another package;
- no file over 400 lines; no ``type: ignore[attr-defined]``; no ``getattr(self, "...")`` in ``strategy``.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_parallel"
TOP = "(top)"  # the package's own modules: the public API (__init__), __main__, the command line
COMPAT = "compat"  # lightning_parallel/compat.py, in the bottom layer: torch's and Lightning's privates
COMPAT_MODULES = (COMPAT, "compat_record")  # compat's code, and its record of the private APIs it reaches
LAYERS: list[set[str]] = [
    {
        COMPAT,
        "mesh",
        "comm",
        "memory",
        "optim",
        "precision",
        "experts",
        "context_parallel",
        "launch",
        "zero",
        "data_parallel",
        "tensor_parallel",
    },
    {"plans", "compression"},
    {"pipeline"},
    {"checkpoint", "config"},
    {"parallelize", "planner"},
    {"strategy"},
    {TOP},
]
CHECKPOINT_IMPORTERS = {"checkpoint", "strategy", TOP}
MAX_LINES = 400


@dataclass
class Imports:
    """Module -> the modules it imports (within the package), and the private names it takes."""

    edges: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    private: list[tuple[str, str, str]] = field(default_factory=list)  # (importer, module, name)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_imports(sources: Mapping[str, str]) -> Imports:
    """The imports of ``{module name: source}``, resolved to modules of the same mapping."""

    def resolve(name: str) -> str:
        while name and name not in sources:
            name = name.rpartition(".")[0]
        return name

    found = Imports()
    root = next(iter(sources)).split(".")[0] if sources else PACKAGE
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == root:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    found.edges[module].add(target if target in sources else resolve(node.module))
                    if alias.name.startswith("_"):
                        found.private.append((module, node.module, alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == root:
                        found.edges[module].add(resolve(alias.name))
    return found


def package_of(module: str, packages: Iterable[str]) -> str:
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in COMPAT_MODULES:
        return COMPAT
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in packages) else TOP


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (each is an import circle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in list(graph):
        if node not in index:
            visit(node)
    return out


def layer_of(package: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def breaches(sources: Mapping[str, str], packages: set[str]) -> list[str]:
    """Every breach of the rules in the module docstring, as a sentence."""
    imports = read_imports(sources)
    problems = []
    module_graph = {
        m: {t for t in targets if t != m and t != PACKAGE} for m, targets in imports.edges.items()
    }
    problems += [f"import circle between modules: {' -> '.join(c)}" for c in cycles(module_graph)]
    package_graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in module_graph.items():
        for target in targets:
            a, b = package_of(module, packages), package_of(target, packages)
            if a != b:
                package_graph[a].add(b)
    problems += [f"import circle between packages: {' -> '.join(c)}" for c in cycles(package_graph)]
    layered = {p for layer in LAYERS for p in layer}
    problems += [f"package {p!r} is in no layer (tools/architecture.py)" for p in sorted(packages - layered)]
    for a, targets in sorted(package_graph.items()):
        for b in sorted(targets):
            if a in layered and b in layered and layer_of(b) > layer_of(a):
                problems.append(f"{a} imports {b}, a higher layer")
            if b == "checkpoint" and a not in CHECKPOINT_IMPORTERS:
                problems.append(f"{a} imports checkpoint (only strategy and the top may)")
    for module, source_module, name in imports.private:
        if package_of(module, packages) != package_of(source_module, packages):
            problems.append(f"{module} imports the private name {name} of {source_module}")
    for module, source in sources.items():
        lines = source.count("\n")
        if lines > MAX_LINES:
            problems.append(
                f"{module} has {lines} lines (at most {MAX_LINES}: a module longer than that is two)"
            )
        if "type: ignore[attr-defined]" in source:
            problems.append(f"{module} has a `type: ignore[attr-defined]`")
        if package_of(module, packages) == "strategy" and 'getattr(self, "' in source:
            problems.append(f"{module} probes its own attributes with getattr(self, ...)")
    return problems


def package_sources(root: Path = ROOT / PACKAGE) -> tuple[dict[str, str], set[str]]:
    sources = {module_name(p, root.parent): p.read_text() for p in sorted(root.rglob("*.py"))}
    packages = {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return sources, packages


def main() -> int:
    sources, packages = package_sources()
    imports = read_imports(sources)
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in imports.edges.items():
        for target in targets:
            a, b = package_of(module, packages), package_of(target, packages)
            if a != b and target != PACKAGE:
                graph[a].add(b)
    for depth, layer in enumerate(LAYERS):
        print(f"layer {depth}:")
        for package in sorted(layer):
            print(f"  {package} -> {', '.join(sorted(graph.get(package, ()))) or '(nothing of ours)'}")
    problems = breaches(sources, packages)
    print("\n".join(problems) if problems else "no breach of the rules")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
