"""Proof in the engine that serves the model: vLLM loads the folder and computes what transformers computes.

vLLM runs in its own environment and process (`environment`, `vllm_probe.py`); `check` compares.

>>> install_engine("vllm")                       # doctest: +SKIP
>>> engine_check(Path("out/model"), "vllm")["ok"]  # doctest: +SKIP
True
"""

from __future__ import annotations

from pathlib import Path  # noqa: F401 - the example's name

from .check import TOLERANCES, engine_check
from .environment import ENGINES, check_engine, engine_python, install_engine

__all__ = ["ENGINES", "TOLERANCES", "check_engine", "engine_check", "engine_python", "install_engine"]
