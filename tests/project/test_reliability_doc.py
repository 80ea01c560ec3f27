"""docs/reliability.md names, for every case, the test that keeps its behaviour true: those tests must exist."""

from __future__ import annotations

from helpers import REPO
import re
from pathlib import Path

ROOT = REPO


def test_every_case_names_tests_that_exist():
    text = (ROOT / "docs" / "reliability.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) >= 30
    for row in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row)
        assert named, f"a case without a test: {row}"
        for file, name in named:
            assert re.search(rf"^def {name}\(", (ROOT / file).read_text(), re.M), f"{file}::{name} is gone"
