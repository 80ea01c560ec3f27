"""The merge code's hash (in every cache key) covers exactly the code that produces output bytes."""

from __future__ import annotations

import doctest
import shutil
from pathlib import Path

import pytest

import mergecore
from mergecore.engine import fingerprints
from mergecore.engine.fingerprints import NOT_OUTPUT_CODE, OUTPUT_CODE, code_version

PACKAGE = Path(mergecore.__file__).parent


@pytest.fixture
def tree(tmp_path):
    """A private copy of the mergecore source tree to edit."""
    copy = tmp_path / "mergecore"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def append_comment(path: Path) -> None:
    path.write_text(path.read_text() + "\n# edited\n")


def test_docstrings():
    assert doctest.testmod(fingerprints).failed == 0


def test_every_module_is_classified_once():
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    output = {m for m in modules if any(m.startswith(e) if e.endswith("/") else m == e for e in OUTPUT_CODE)}
    assert output.isdisjoint(NOT_OUTPUT_CODE)
    assert modules == output | set(NOT_OUTPUT_CODE), "classify new modules in OUTPUT_CODE or NOT_OUTPUT_CODE"
    assert all((PACKAGE / e).exists() for e in OUTPUT_CODE + NOT_OUTPUT_CODE)


def test_copy_of_the_tree_hashes_like_the_package(tree):
    assert code_version(tree) == code_version()


@pytest.mark.parametrize("module", ["hub.py", "proofs/verify.py", "describe.py", "errors.py", "__init__.py"])
def test_editing_a_module_outside_the_output_keeps_the_hash(tree, module):
    before = code_version(tree)
    append_comment(tree / module)
    fingerprints._code_version.cache_clear()
    assert code_version(tree) == before


@pytest.mark.parametrize("module", ["engine/writer.py", "families/transforms.py", "formats/megatron/legacy.py", "model/folder.py", "numbers/arrays.py"])
def test_editing_output_code_changes_the_hash(tree, module):
    before = code_version(tree)
    append_comment(tree / module)
    fingerprints._code_version.cache_clear()
    assert code_version(tree) != before


def test_a_new_reader_module_is_output_code(tree):
    before = code_version(tree)
    (tree / "formats" / "newformat.py").write_text("READ = 1\n")
    fingerprints._code_version.cache_clear()
    assert code_version(tree) != before
