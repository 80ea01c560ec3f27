"""verl's real merger as a benchmark baseline, run from a folder of its own, never from the project's env.

Install it once (verl 0.9.1 and only what `verl.model_merger` imports that the venv lacks; torch,
transformers, accelerate, numpy come from the venv; `--no-deps` keeps verl's pins, e.g. on transformers,
from touching anything):

    SITE=bench/_work/verl-site   # bench/_work is git-ignored
    python -m pip install --no-deps --target $SITE verl==0.9.1 ray==2.60.0 "tensordict==0.10.0" \\
        protobuf pyvers omegaconf antlr4-python3-runtime==4.9.3

then pass `--verl-site bench/_work/verl-site` to bench_merge.py / bench_world.py. verl's package
`__init__` imports ray and tensordict (its `DataProto`), so they are part of its merger's start-up.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LABEL = "verl (real, 0.9.1)"


def verl_env(site: Path) -> dict:
    """This process's environment with the verl folder first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site.resolve()), env.get("PYTHONPATH")]))
    return env


def verl_argv(role: Path, out: Path) -> list[str]:
    """`python -m verl.model_merger merge --backend fsdp ...` through a wrapper that reports work_seconds."""
    return [sys.executable, str(HERE / "verl_real_merge.py"), "merge", "--backend", "fsdp",
            "--local_dir", str(role), "--target_dir", str(out)]


def check_site(site: Path) -> None:
    if not (site / "verl" / "model_merger").is_dir():
        sys.exit(f"{site}: no verl.model_merger there; install it as the docstring of bench/verl_site.py says")


def same_tensors(ours: Path, theirs: Path) -> str:
    """Every tensor of two HF folders compared bit for bit (names, dtypes, shapes, bytes); a one-line summary.

    Raises AssertionError on the first difference, so a benchmark never compares against a wrong output.
    """
    from contextlib import ExitStack

    from safetensors import safe_open

    def tensors(folder: Path, stack: ExitStack) -> dict:
        """name -> the open file holding it"""
        found = {}
        for file in sorted(folder.glob("*.safetensors")):
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            found.update(dict.fromkeys(handle.keys(), handle))
        return found

    with ExitStack() as stack:
        a, b = tensors(ours, stack), tensors(theirs, stack)
        assert a, f"{ours}: no safetensors files"
        assert a.keys() == b.keys(), (f"tensor names differ: only ours {sorted(a.keys() - b.keys())[:5]}, "
                                      f"only verl {sorted(b.keys() - a.keys())[:5]}")
        nbytes = 0
        for name in sorted(a):
            x, y = a[name].get_tensor(name), b[name].get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape, \
                f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
            # compared as integers: bit for bit, NaN payloads included
            assert x.view(torch_uint(x)).equal(y.view(torch_uint(y))), f"{name}: values differ"
            nbytes += x.numel() * x.element_size()
    return f"{len(a)} tensors, {nbytes / 1e6:.0f} MB, bit-identical to verl's output"


def torch_uint(t):
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def compare_outputs(ours_argv: list[str], ours_out: Path, site: Path, role: Path, verl_out: Path) -> str:
    """Run our merge (`ours_argv`, writing `ours_out`) and verl's on `role` once each and compare every tensor,
    so the timing compares two mergers that produce the same model; both outputs are removed after."""
    import shutil
    import subprocess

    for folder in (ours_out, verl_out):
        shutil.rmtree(folder, ignore_errors=True)
    try:
        subprocess.run(ours_argv, check=True, capture_output=True)
        subprocess.run(verl_argv(role, verl_out), env=verl_env(site), check=True, capture_output=True)
        return same_tensors(ours_out, verl_out)
    finally:
        for folder in (ours_out, verl_out):
            shutil.rmtree(folder, ignore_errors=True)
