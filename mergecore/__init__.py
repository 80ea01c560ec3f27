"""mergecore: turn distributed training checkpoints into verified Hugging Face folders.

Pure library (numpy, safetensors, fsspec; torch and transformers only where a format or check needs
them); the Prefect pipeline wraps it. Names are imported on first use, so `from mergecore import
CheckpointError` (the CLI's `notify`, `watch`) loads nothing but the errors.

>>> from mergecore import merge_checkpoint
>>> merge_checkpoint("ckpts/global_step_100/actor", "out/model", dtype="bf16")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib

from .errors import CheckpointError, VerificationError

_WHERE = {
    "open_checkpoint": "formats", "MergePlan": "engine.plan", "open_target": "targets",
    "merge_checkpoint": "api", "write_adapter_folder": "api",
    **{name: "engine.merge" for name in ("Prepared", "merge_group", "prepare")},
    **{name: "proofs.verify" for name in ("compare_logits", "compare_with_reference", "verify_manifest", "verify_round_trip")},
}

__all__ = [
    "CheckpointError", "VerificationError", "MergePlan", "Prepared", "open_checkpoint", "open_target", "prepare",
    "merge_group", "merge_checkpoint", "write_adapter_folder", "verify_round_trip",
    "verify_manifest", "compare_with_reference", "compare_logits",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'mergecore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
