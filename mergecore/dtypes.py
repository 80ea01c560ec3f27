"""Names of output dtypes as users spell them, and as safetensors/config.json spell them."""

import torch

from .errors import CheckpointError

_BY_NAME = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}

SAFETENSORS_NAME = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def config_dtype(config: dict) -> str | None:
    """The dtype a Hugging Face config declares (transformers 5 writes `dtype`, 4.x `torch_dtype`)."""
    return config.get("dtype") or config.get("torch_dtype")


def resolve_dtype(requested: str, config: dict) -> torch.dtype | None:
    """Map `auto|keep|bf16|fp16|fp32` to a torch dtype; None means keep each tensor's own dtype.

    >>> resolve_dtype("auto", {"torch_dtype": "bfloat16"})
    torch.bfloat16
    """
    requested = requested.lower()
    if requested == "keep":
        return None
    if requested == "auto":
        declared = config_dtype(config)
        return _BY_NAME.get(str(declared).removeprefix("torch.")) if declared else None
    if requested not in _BY_NAME:
        raise CheckpointError(f"unknown --dtype {requested!r}: use auto, keep, bf16, fp16 or fp32")
    return _BY_NAME[requested]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`, the spelling config.json uses."""
    return str(dtype).removeprefix("torch.")


def from_name(name: str) -> torch.dtype:
    return getattr(torch, name)


def element_size(name: str) -> int:
    """Bytes per element of a dtype named the torch way (`"bfloat16"` -> 2)."""
    return torch.empty((), dtype=from_name(name)).element_size()
