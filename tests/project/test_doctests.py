"""The library's docstring examples run: every mergecore module's doctests pass (an example that needs a real
checkpoint or network says `+SKIP`)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import mergecore

PACKAGE = Path(mergecore.__file__).parent
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def module_name(path: Path) -> str:
    parts = ("mergecore", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(module_name(p) for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=FLAGS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"


def test_the_examples_are_not_all_skipped():
    ran = sum(doctest.testmod(importlib.import_module(name), optionflags=FLAGS).attempted for name in MODULES)
    assert ran >= 30
