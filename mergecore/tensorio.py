"""Reading Hugging Face folders back, tensor by tensor, and comparing tensors bit for bit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, dtypes and bytes (NaN payloads and signed zeros included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        int_type = _SAME_SIZE_INT[a.element_size()]
        return torch.equal(a.contiguous().view(int_type), b.contiguous().view(int_type))
    return torch.equal(a, b)


class HfWeights:
    """The weights of a Hugging Face folder (sharded or single safetensors, or pytorch .bin).

    >>> with HfWeights("out/model") as weights:          # doctest: +SKIP
    ...     weights.get("model.norm.weight").shape
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        self._bins: dict[str, dict] = {}

    def __enter__(self) -> HfWeights:
        files = sorted(self.folder.glob("*.safetensors"))
        for file in files:
            handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
            for name in handle.keys():
                self._where[name] = handle
        if not files:
            for file in sorted(self.folder.glob("pytorch_model*.bin")):
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                self._where.update({name: state for name in state})
        if not self._where:
            raise CheckpointError(f"{self.folder}: no *.safetensors or pytorch_model*.bin weights found")
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        holder = self._where[name]
        return holder[name] if isinstance(holder, dict) else holder.get_tensor(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._where:
            yield name, self.get(name)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None
