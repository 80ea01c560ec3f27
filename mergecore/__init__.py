"""mergecore: turn distributed training checkpoints into verified Hugging Face folders.

Pure library (numpy, safetensors, fsspec; torch and transformers only where a format or check needs
them); the Prefect pipeline wraps it. Names are imported on first use, so `from mergecore import
CheckpointError` (the CLI's `notify`, `watch`) loads nothing but the errors.

The four things a user does, in the manner of safetensors' `save_file`/`load_file`:

>>> from mergecore import merge, verify, inspect, push
>>> from ckptflow.testing.examples import example_checkpoint, example_target
>>> inspect(example_checkpoint())["checkpoint"]["world_size"]
1
>>> merge(example_checkpoint(), example_target("package-model"), dtype="bf16")["dtype"]
'bfloat16'
>>> all(check["ok"] for check in verify(example_target("package-model")))
True
"""

from __future__ import annotations

import importlib
import sys
import types

from .errors import CheckpointError, VerificationError

_WHERE = {
    "open_checkpoint": "formats", "MergePlan": "engine.plan", "open_target": "targets",
    **{name: "api" for name in ("merge", "verify", "inspect", "push", "merge_checkpoint", "write_adapter_folder")},
    **{name: "request" for name in ("MergeRequest", "MergeSource", "MergeSettings", "MergeTarget", "LoraSettings")},
    **{name: "engine.merge" for name in ("Prepared", "merge_group", "prepare")},
    **{name: "proofs.verify" for name in ("compare_logits", "compare_with_reference", "verify_manifest", "verify_round_trip")},
}

__all__ = [
    "merge", "verify", "inspect", "push", "MergeRequest", "MergeSource", "MergeSettings", "MergeTarget",
    "LoraSettings", "CheckpointError", "VerificationError", "MergePlan", "Prepared", "open_checkpoint", "open_target",
    "prepare", "merge_group", "merge_checkpoint", "write_adapter_folder", "verify_round_trip", "verify_manifest",
    "compare_with_reference", "compare_logits",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'mergecore' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """`mergecore.inspect` is the public function even though a submodule has that name too (`mergecore/inspect.py`,
    the descriptions behind it): importing a submodule sets the package's attribute of its name, and this keeps
    that one assignment from replacing the function. `from mergecore.inspect import describe_source` still works
    (it reads sys.modules)."""

    @property
    def inspect(self):
        return __getattr__("inspect")

    @inspect.setter
    def inspect(self, value):
        if not isinstance(value, types.ModuleType):
            self.__dict__["inspect"] = value


sys.modules[__name__].__class__ = _Package
