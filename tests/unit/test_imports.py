"""Import rules of gateway/: no import cycle, no private name imported from another module, and
none of the layer arrows that must never exist (the "never" list of the architecture).

Every import counts, also those inside functions and under `TYPE_CHECKING`: a cycle a function
hides still ties the modules together. `KNOWN_CYCLES` and `KNOWN_PRIVATE` are what is left to
untangle; they may only shrink (a new cycle or private import fails, and so does an entry that
no longer exists)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"

LAYERS = {
    "gateway.api": "Api",
    "gateway.cli": "Cli",
    "gateway.cli_render": "Cli",
    "gateway.cli_frame": "Cli",
    "gateway.services": "Services",
    "gateway.jobs": "Jobs",
    "gateway.context": "Context",
    "gateway.store": "Store",
    "gateway.upstream": "Upstream",
}
NEVER = {
    ("Api", "Store"): "HTTP handlers go through a service",
    ("Cli", "Store"): "commands go through a service",
    ("Jobs", "Store"): "background work goes through a service",
    ("Store", "Context"): "storage returns records; the service builds views",
    ("Store", "Services"): "storage knows no use cases",
    ("Context", "Store"): "the pure core does no I/O",
    ("Context", "Upstream"): "the pure core does no I/O",
    ("Context", "Api"): "the core knows no HTTP",
    ("Context", "Services"): "the pure core is called, never calls",
    ("Store", "Upstream"): "storage and providers are independent seams",
    ("Upstream", "Store"): "storage and providers are independent seams",
    ("Store", "Api"): "storage knows no HTTP",
    ("Upstream", "Api"): "providers know no HTTP server",
    ("Services", "Api"): "use cases know no HTTP",
}
KNOWN_CYCLES: set[frozenset[str]] = set()
KNOWN_PRIVATE: set[tuple[str, str, str]] = set()

Imports = dict[str, set[tuple[str, str]]]  # module -> (module imported from, name)


def modules(package: Path, name: str = "gateway") -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        dotted = ".".join((name, *parts))
        found[dotted.removesuffix(".__init__")] = path
    return found


def imports(found: Mapping[str, Path]) -> Imports:
    """Every `from gateway... import name` and `import gateway...` of each module."""
    result: Imports = {}
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        pairs: set[tuple[str, str]] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join([*base, *([node.module] if node.module else [])])
                pairs.update((source, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                pairs.update((alias.name, "") for alias in node.names)
        result[name] = {(s, n) for s, n in pairs if s.split(".")[0] == name.split(".")[0]}
    return result


def edges(found: Mapping[str, Path], imported: Imports) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, pairs in imported.items():
        for source, what in pairs:
            target = f"{source}.{what}" if f"{source}.{what}" in found else source
            if target in found and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(frozenset(group))
    return groups


def layer(module: str) -> str | None:
    return next(
        (layer for prefix, layer in LAYERS.items() if module == prefix or module.startswith(prefix + ".")),
        None,
    )


FOUND = modules(PACKAGE)
IMPORTED = imports(FOUND)


def test_no_import_cycle() -> None:
    assert set(cycles(edges(FOUND, IMPORTED))) == KNOWN_CYCLES


def test_no_private_name_is_imported_from_another_module() -> None:
    private = {
        (name, source, what)
        for name, pairs in IMPORTED.items()
        for source, what in pairs
        if what.startswith("_") and not what.startswith("__") and source != name
    }
    assert private == KNOWN_PRIVATE


def test_no_arrow_that_must_never_exist() -> None:
    wrong = [
        f"{name} imports {source}: {NEVER[(layer(name), layer(source))]}"
        for name, pairs in IMPORTED.items()
        for source, _ in pairs
        if (layer(name), layer(source)) in NEVER
    ]
    assert wrong == []


def test_the_rules_catch_a_new_cycle_and_a_private_import(tmp_path: Path) -> None:
    """The checks themselves: a package where a imports b, b imports c, c imports a (inside a
    function) and b imports a private name of c."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import B\n")
    (package / "b.py").write_text("from pkg.c import _hidden\nB = 1\n")
    (package / "c.py").write_text("def f():\n    from pkg import a\n_hidden = 2\n")
    found = modules(package, "pkg")
    imported = imports(found)
    assert cycles(edges(found, imported)) == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]
    assert ("pkg.c", "_hidden") in imported["pkg.b"]
