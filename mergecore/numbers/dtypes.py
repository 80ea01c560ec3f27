"""Output dtypes as users spell them (`bf16`), resolved to the names config.json uses (`bfloat16`)."""

from ..errors import CheckpointError

_BY_NAME = {
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}


def config_dtype(config: dict) -> str | None:
    """The dtype a Hugging Face config declares (transformers 5 writes `dtype`, 4.x `torch_dtype`)."""
    return config.get("dtype") or config.get("torch_dtype")


def resolve_dtype(requested: str, config: dict) -> str | None:
    """Map `auto|keep|bf16|fp16|fp32` to a dtype name; None means keep each tensor's own dtype.

    >>> resolve_dtype("auto", {"torch_dtype": "bfloat16"})
    'bfloat16'
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
