"""What `pip install .` puts in site-packages: only `mergecore` (the library, a public name) and the `ckptflow`
namespace, every source module of the mapped folders included, and a torch requirement a current torch meets."""

from __future__ import annotations

from helpers import REPO
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

MAPPED = {"mergecore": "mergecore", "flows": "ckptflow/flows", "tasks": "ckptflow/tasks",
          "ckptflow_testing": "ckptflow/testing"}


def test_the_wheel_installs_only_the_project_namespaces(tmp_path):
    source = tmp_path / "source"  # a copy: setuptools builds in the source folder, and the checkout stays clean
    source.mkdir()
    for name in ("pyproject.toml", "README.md", *MAPPED):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                    str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("ckptflow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == {"ckptflow", "mergecore"}
    expected = {f"{MAPPED[folder]}/{path.relative_to(REPO / folder).as_posix()}"
                for folder in MAPPED for path in (REPO / folder).rglob("*.py")}
    assert expected <= set(names), sorted(expected - set(names))
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [Requirement(line.split(":", 1)[1].strip()) for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")]
    torch = next(r for r in requires if r.name == "torch")
    assert torch.specifier.contains("2.15.0") and torch.specifier.contains("3.0.0")
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "ckptflow = ckptflow.flows.cli:main" in entry
