"""The storage package's face: `mergecore/storage/__init__.py` only re-exports what its modules define, and no
code outside storage reaches a private storage name (an import of `_name`, or `obj._name` of a storage class),
so storage can change inside without breaking its users."""

from __future__ import annotations

import ast
from helpers import REPO

import mergecore.storage as storage

STORAGE = REPO / "mergecore" / "storage"
OUTSIDE = sorted(p for folder in ("mergecore", "flows", "tasks") for p in (REPO / folder).rglob("*.py")
                 if STORAGE not in p.parents)


def private_storage_names() -> set[str]:
    """Every `_name` storage defines: module-level functions, classes, constants, and class members."""
    names = set()
    for path in STORAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_the_package_face_only_re_exports():
    tree = ast.parse((STORAGE / "__init__.py").read_text())
    defined = [type(node).__name__ for node in tree.body
               if not isinstance(node, (ast.ImportFrom, ast.Import)) and not (isinstance(node, ast.Expr)
                                                                               and isinstance(node.value, ast.Constant))
               and not (isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__all__"])]
    assert defined == []
    assert {"Location", "RangeFile", "fetch_ranges", "publishable_hf_files", "fingerprint_of"} <= set(storage.__all__)
    assert all(getattr(storage, name).__module__.startswith("mergecore.storage.") for name in storage.__all__)


def test_no_code_outside_storage_reaches_a_private_storage_name():
    private = private_storage_names()
    assert {"_reading", "_fresh_info", "_cached_copy", "_fenced"} <= private  # the finder sees storage's own
    found = []
    for path in OUTSIDE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and "storage" in (node.module or "").split("."):
                found += [f"{path.name}: import {a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert found == []
