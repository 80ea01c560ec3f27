"""The import layering, read from the source (function-local imports count too, so nothing hides in a function):
mergecore never imports Prefect, tasks or flows; every import points down the layer order `LAYERS`; no package has an
import circle between its modules."""

from __future__ import annotations

from helpers import REPO
import ast
from pathlib import Path

import pytest

ROOT = REPO
PACKAGES = {"mergecore": "mergecore", "tasks": "ckptflow.tasks", "flows": "ckptflow.flows"}
# The layers, bottom first: a module may import its own layer's modules and those of the layers below, never above.
# Each entry is a mergecore sub-package or top-level module (docs/architecture.md draws this order).
LAYERS = [
    ["errors"], ["numbers"], ["storage"], ["families"], ["formats"], ["views"], ["quantize"], ["model"], ["targets"],
    ["request"], ["engine"], ["proofs"], ["serving"], ["assembly"], ["describe", "hub"], ["picture"], ["api"], ["mergecore"],
]


def modules(folder: str) -> dict[str, Path]:
    """The folder's modules under the names they are imported by (the folders are mapped into `ckptflow.`)."""
    found = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join([PACKAGES[folder], *parts])] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module `name` imports anywhere in its file: absolute names, and relative ones resolved (a name
    imported from a package is the submodule when one exists, else the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
    return found


def graph(package: str) -> dict[str, set[str]]:
    known = modules(package)
    return {name: {m for m in imported(name, path, known) if m in known and m != name} for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_mergecore_never_imports_prefect_tasks_or_flows():
    known = modules("mergecore")
    offenders = {name: sorted(m for m in imported(name, path, known) if m.split(".")[0] in ("prefect", "prefect_dask",
                                                                                          "ckptflow"))
                 for name, path in known.items()}
    assert {name: found for name, found in offenders.items() if found} == {}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(package):
    assert circles(graph(package)) == []


def test_the_checker_sees_a_circle_hidden_in_a_function(tmp_path):
    """The check itself: a circle made only of function-local imports is found."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from .n import g\n")
    assert imported("pkg.m", source, {"pkg.n": source}) == {"pkg.n"}


def test_the_architecture_page_names_every_package_by_its_docstring():
    """docs/architecture.md collects each mergecore sub-package's first docstring line, and mergecore's top holds
    at most eight modules (the rest live in sub-packages)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    packages = sorted(p.parent.relative_to(ROOT / "mergecore").as_posix() for p in (ROOT / "mergecore").rglob("*/__init__.py"))
    assert "formats/megatron" in packages  # sub-packages of sub-packages are collected too
    for package in packages:
        first = ast.get_docstring(ast.parse((ROOT / "mergecore" / package / "__init__.py").read_text())).splitlines()[0]
        assert f"| `{package}/` | {first} |" in page, package
    assert len(list((ROOT / "mergecore").glob("*.py"))) <= 8


def layer_of(module: str) -> int:
    """The index in `LAYERS` of a mergecore module (`mergecore.engine.plan` -> engine's)."""
    parts = module.split(".")
    unit = parts[1] if len(parts) > 1 else "mergecore"
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets if layer_of(b) > layer_of(a))


def test_every_import_points_down_the_layers():
    """Module-level and function-local alike: a lower layer never reaches up (the engine writing through the
    targets it is called by, a reader asking the proofs that check it)."""
    edges = graph("mergecore")
    assert not [m for m in edges if m != "mergecore" and not any(m.split(".")[1] in layer for layer in LAYERS)], \
        "a new mergecore sub-package or module: give it its place in LAYERS"
    assert upward_imports(edges) == []


def test_the_checker_sees_an_upward_import_in_a_function(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from ..assembly import assembly_for\n")
    found = imported("mergecore.engine.m", source, {"mergecore.assembly": source})
    assert upward_imports({"mergecore.engine.m": found}) == ["mergecore.engine.m -> mergecore.assembly"]


def test_the_architecture_page_draws_the_layers():
    page = (ROOT / "docs" / "architecture.md").read_text()
    drawn = " < ".join(" ".join(f"`{unit}`" for unit in layer) for layer in LAYERS)
    assert drawn in page, drawn
