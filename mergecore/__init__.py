"""mergecore: turn distributed training checkpoints into verified Hugging Face folders.

Pure library (numpy, safetensors, fsspec; torch and transformers only where a format or check needs
them); the Prefect pipeline wraps it. Names are imported on first use, so `from mergecore import
CheckpointError` (the CLI's `notify`, `watch`) loads nothing but the errors.

The four things a user does, in the manner of safetensors' `save_file`/`load_file`:

>>> from mergecore import merge, verify, inspect, push
>>> from ckptflow.testing.examples import example_checkpoint, example_target
>>> inspect(example_checkpoint())["checkpoint"]["world_size"]
1
>>> model = example_target("package-model")
>>> merge(example_checkpoint(), model, dtype="bf16")["dtype"]
'bfloat16'
>>> all(check["ok"] for check in verify(model))
True
"""

from __future__ import annotations

import importlib

from .errors import CheckpointError, VerificationError

_WHERE = {
    "open_checkpoint": "formats", "MergePlan": "engine.plan", "open_target": "targets", "assembly_for": "assembly",
    **{name: "api" for name in ("merge", "verify", "inspect", "push", "merge_checkpoint", "write_adapter_folder")},
    **{name: "request" for name in ("MergeRequest", "MergeSource", "MergeSettings", "MergeTarget", "LoraSettings")},
    **{name: "engine.merge" for name in ("Prepared", "merge_group", "prepare")},
    **{name: "proofs.verify" for name in ("compare_logits", "compare_with_reference", "verify_manifest", "verify_round_trip")},
}

__all__ = [
    "merge", "verify", "inspect", "push", "MergeRequest", "MergeSource", "MergeSettings", "MergeTarget",
    "LoraSettings", "CheckpointError", "VerificationError", "MergePlan", "Prepared", "open_checkpoint", "open_target",
    "assembly_for", "prepare", "merge_group", "merge_checkpoint", "write_adapter_folder", "verify_round_trip",
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
