"""A tiny checkpoint for the library's docstring examples, written once per process.

The examples of `mergecore.merge`, `verify`, `inspect` and `prepare` run on a real (single-process, world size 1)
verl FSDP checkpoint; writing one costs a second or two, so every example of a process shares this one.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def example_folder() -> Path:
    """A scratch folder for the examples' outputs, removed when the process ends."""
    folder = Path(tempfile.mkdtemp(prefix="ckptflow-examples-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


@lru_cache(maxsize=1)
def example_checkpoint() -> str:
    """The actor folder of a one-step, one-rank Qwen2-style verl checkpoint (written on first use)."""
    from .demo_checkpoint import DemoSpec, write_demo_checkpoint

    written = write_demo_checkpoint(example_folder() / "run", DemoSpec(mode="single", world_size=1, num_hidden_layers=1))
    return str(written.role_dir)


def example_target(name: str) -> str:
    """A fresh path for an example's output (nothing there yet, however often the example runs in a process)."""
    return str(Path(tempfile.mkdtemp(dir=example_folder())) / name)
